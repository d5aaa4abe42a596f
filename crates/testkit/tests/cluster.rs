//! Starts one real ZooKeeper, etcd and Redis, exercises the fault-injection API on them,
//! and tears them down. Needs only the Debian packages (`ensure_installed` adds them).

use std::time::{Duration, Instant};

use dlock_testkit::{
    ensure_installed, etcd_healthy, redis_ping, redis_query, scratch_state_path, zk_mode, Backend,
    Cluster, ClusterSpec, State, ZkMode, SENTINEL_SERVICE,
};

fn wait_until(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let started = Instant::now();
    while !cond() {
        assert!(started.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn one_node_each_starts_survives_kill_restart_stop_and_goes_down() {
    ensure_installed().expect("server packages installed");
    let mut spec = ClusterSpec {
        zk: 1,
        etcd: 1,
        redis: 1,
        state_path: Some(scratch_state_path("selftest")),
        ..ClusterSpec::default()
    };
    // Away from the default ports, which `cargo xtask integration` uses meanwhile.
    let mut cluster =
        Cluster::start_at_free_offset(&mut spec, (0..200u16).map(|k| 20_000 + k * 150))
            .expect("cluster starts");

    let zk = cluster.server(Backend::Zookeeper, 1).expect("zk1").clone();
    let etcd = cluster.server(Backend::Etcd, 1).expect("etcd1").clone();
    let redis = cluster.server(Backend::Redis, 1).expect("redis1").clone();
    let probe = Duration::from_secs(2);
    assert_eq!(zk_mode(&zk.addr, probe), Some(ZkMode::Standalone));
    assert!(etcd_healthy(&etcd.addr, probe));
    assert!(redis_ping(&redis.addr, probe));
    assert_eq!(
        zk.addr,
        format!("127.0.0.1:{}", 2181 + spec.port_offset),
        "port layout"
    );
    assert_eq!(cluster.zk_leader(), Some(1));
    assert_eq!(
        cluster
            .wait_leader(Backend::Etcd, Duration::from_secs(30))
            .expect("etcd leader"),
        1
    );

    // Another process's view: the state file has every server with its argv.
    let path = spec.state_path.clone().expect("state path");
    let loaded = State::load(&path).expect("state file loads");
    assert_eq!(loaded.servers, cluster.servers);
    assert_eq!(cluster.endpoints().zk.as_deref(), Some(zk.addr.as_str()));

    // Kill and restart Redis: same port, new pid, written back to the file.
    cluster.kill(Backend::Redis, 1).expect("kill redis");
    assert!(!redis.is_running(), "redis pid {} still alive", redis.pid);
    assert!(!redis_ping(&redis.addr, Duration::from_millis(500)));
    cluster.restart(Backend::Redis, 1).expect("restart redis");
    let restarted = cluster.server(Backend::Redis, 1).expect("redis1").clone();
    assert_ne!(restarted.pid, redis.pid);
    assert!(redis_ping(&restarted.addr, probe));
    let reloaded = State::load(&path).expect("reload");
    assert_eq!(
        reloaded.server(Backend::Redis, 1).expect("redis1").pid,
        restarted.pid
    );

    // Restart ZooKeeper on its data dir, through a State loaded from the file, as a fault
    // test in another process would.
    let mut other = State::load(&path).expect("load for restart");
    other.restart(Backend::Zookeeper, 1).expect("restart zk");
    assert!(!zk.is_running(), "old zk pid {} still alive", zk.pid);
    assert_eq!(
        zk_mode(&zk.addr, probe),
        Some(ZkMode::Standalone),
        "restarted zk serves"
    );
    // `cluster` still holds the old zk pid in memory; its teardown must kill the new
    // incarnation all the same, because it reads the state file (checked below).
    let zk_new = other.server(Backend::Zookeeper, 1).expect("zk1").clone();
    assert_ne!(zk_new.pid, zk.pid);

    // A stopped etcd accepts connections but answers nothing; SIGCONT brings it back.
    cluster.stop(Backend::Etcd, 1).expect("stop etcd");
    assert!(etcd.is_stopped());
    assert!(!etcd_healthy(&etcd.addr, Duration::from_millis(500)));
    cluster.cont(Backend::Etcd, 1).expect("cont etcd");
    wait_until(
        "etcd healthy after SIGCONT",
        Duration::from_secs(30),
        || etcd_healthy(&etcd.addr, probe),
    );

    let root = cluster.root_dir.clone();
    let servers = cluster.servers.clone();
    cluster.down().expect("down");
    for s in &servers {
        assert!(
            !s.is_running(),
            "{} {} pid {} survived down",
            s.backend,
            s.id,
            s.pid
        );
    }
    assert!(!root.exists(), "data dir {} left behind", root.display());
    assert!(!path.exists(), "state file left behind");
}

/// Runs against the cluster `cargo xtask integration` started (through `DLOCK_TEST_STATE`):
/// the leader of each quorum backend is killed, a new leader must appear among the others,
/// and the old one comes back on its data dir. The cluster is whole again afterwards.
#[test]
fn shared_cluster_survives_leader_kill_and_restart() {
    let Some(mut state) = dlock_testkit::require_state() else {
        return;
    };
    let limit = Duration::from_secs(60);
    for backend in [Backend::Zookeeper, Backend::Etcd] {
        let nodes = state.servers_of(backend).count();
        if nodes == 0 {
            continue;
        }
        let old = state.wait_leader(backend, limit).expect("a leader");
        state.kill(backend, old).expect("kill leader");
        assert!(!state.server(backend, old).expect("node").is_running());
        if nodes >= 3 {
            let new = state.wait_leader(backend, limit).expect("a new leader");
            assert_ne!(new, old, "{backend}: the killed node cannot lead");
        }
        state.restart(backend, old).expect("restart old leader");
        let ids: Vec<u32> = state.servers_of(backend).map(|s| s.id).collect();
        for id in ids {
            state
                .wait_ready(backend, id, limit)
                .expect("node ready again");
        }
        // The file now names the new incarnation, for the tests that run after this one.
        let path = state.path().expect("loaded from a file").to_path_buf();
        let reloaded = State::load(&path).expect("reload");
        assert_eq!(
            reloaded.server(backend, old).expect("node").pid,
            state.server(backend, old).expect("node").pid
        );
    }
}

/// The Sentinel group: a primary, two replicas in sync and three Sentinels that agree on
/// the primary; SIGKILL the primary and the Sentinels promote a replica; the old primary,
/// restarted empty, rejoins as a replica of the new one and the group is whole again.
#[test]
fn sentinel_group_fails_over_when_the_primary_is_killed() {
    ensure_installed().expect("server packages installed");
    let mut spec = ClusterSpec {
        zk: 0,
        etcd: 0,
        redis: 0,
        sentinel_replicas: 2,
        redis_cluster: false,
        state_path: Some(scratch_state_path("sentinel-selftest")),
        ..ClusterSpec::default()
    };
    let mut cluster =
        Cluster::start_at_free_offset(&mut spec, (0..200u16).map(|k| 21_000 + k * 150))
            .expect("sentinel group starts");
    let limit = Duration::from_secs(60);
    assert_eq!(cluster.servers_of(Backend::RedisHa).count(), 3);
    assert_eq!(cluster.servers_of(Backend::Sentinel).count(), 3);
    let sentinels = cluster.addrs(Backend::Sentinel);
    assert_eq!(
        cluster.endpoints().redis_sentinel,
        Some(format!("{sentinels}/{SENTINEL_SERVICE}"))
    );
    assert_eq!(
        cluster.endpoints().redis,
        None,
        "no independent master asked"
    );
    assert_eq!(
        cluster
            .wait_leader(Backend::RedisHa, limit)
            .expect("primary"),
        1
    );

    let primary = cluster.server(Backend::RedisHa, 1).expect("node 1").clone();
    let t = Duration::from_secs(2);
    assert_eq!(
        redis_query(&primary.addr, &["SET", "k", "v"], t).as_deref(),
        Some("OK")
    );
    assert_eq!(
        redis_query(&primary.addr, &["WAIT", "2", "10000"], t * 6).as_deref(),
        Some("2"),
        "both replicas acknowledged the write"
    );

    cluster.kill(Backend::RedisHa, 1).expect("kill the primary");
    let new = cluster.wait_failover(1, limit).expect("a failover");
    assert_ne!(new, 1, "a replica is promoted");
    let promoted = cluster
        .server(Backend::RedisHa, new)
        .expect("promoted")
        .clone();
    assert_eq!(
        redis_query(&promoted.addr, &["GET", "k"], t).as_deref(),
        Some("v"),
        "the promoted replica kept the replicated write"
    );

    // Only once every Sentinel sees the promoted node up: a spurious failover to the
    // old primary, back empty, would lose the write (`wait_sentinels_see_primary_up`).
    cluster
        .wait_sentinels_see_primary_up(limit)
        .expect("every Sentinel sees the new primary up");
    cluster
        .restart(Backend::RedisHa, 1)
        .expect("restart the old primary");
    wait_until("the old primary turned into a replica", limit, || {
        redis_query(&primary.addr, &["ROLE"], t).is_some_and(|r| r.lines().next() == Some("slave"))
    });
    // The group settles on a primary again. Usually the promoted replica; on a loaded
    // machine the Sentinels may fail over once more (down-after-milliseconds is 1 s),
    // to the other replica, which is as good. Never to the old primary, which came back
    // empty and was made a replica above.
    let settled = cluster
        .wait_sentinel_group(limit)
        .expect("the group is whole again");
    assert_ne!(settled, 1, "the emptied old primary leads again");
    if settled != new {
        eprintln!("note: the Sentinels failed over once more, from node {new} to node {settled}");
    }

    let servers = cluster.servers.clone();
    cluster.down().expect("down");
    for s in &servers {
        assert!(!s.is_running(), "{} {} survived down", s.backend, s.id);
    }
}
