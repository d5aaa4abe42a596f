//! Starts a secured cluster (TLS, authentication, access control) and proves with the
//! servers' own clients (`redis-cli`, `etcdctl`) and the testkit's TLS probes that the
//! security is real: the app user may do dlock's work and nothing else, other users,
//! wrong passwords, plaintext and a foreign CA are refused.

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use dlock_testkit::secure::{
    etcdctl_tls_args, Caller, APP_PASSWORD, APP_USER, ETCD_APP_PREFIX, NOBODY_PASSWORD,
    NOBODY_USER, WRONG_PASSWORD,
};
use dlock_testkit::{
    ensure_installed, etcd_healthy, redis_ping, scratch_state_path, tls_handshake, zk_mode,
    Backend, Cluster, ClusterSpec, LockService, State, ZkMode, ENV_SECURE_ETCD, ENV_SECURE_REDIS,
    ENV_SECURE_REDLOCK, ENV_SECURE_STATE, ENV_SECURE_ZK,
};

/// Runs a client and returns its exit success and stdout + stderr: `redis-cli` exits 0
/// on error replies and `etcdctl` on some errors, so tests read the output.
fn run(program: &str, args: &[String]) -> (bool, String) {
    let out = Command::new(program)
        .args(args)
        .env("ETCDCTL_API", "3")
        .output()
        .unwrap_or_else(|e| panic!("running {program}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

fn redis_cli(addr: &str, tls: &[String], user: Option<(&str, &str)>, cmd: &[&str]) -> String {
    let (host, port) = addr.rsplit_once(':').expect("host:port");
    let mut args: Vec<String> = tls.to_vec();
    args.extend(["-h", host, "-p", port].map(String::from));
    if let Some((u, p)) = user {
        args.extend(["--user", u, "--pass", p, "--no-auth-warning"].map(String::from));
    }
    args.extend(cmd.iter().map(|s| s.to_string()));
    run("redis-cli", &args).1
}

fn etcdctl(endpoint: &str, pki_tls: &[String], user: &str, cmd: &[&str]) -> (bool, String) {
    let mut args = vec![
        format!("--endpoints=https://{endpoint}"),
        "--dial-timeout=2s".into(),
        "--command-timeout=3s".into(),
        format!("--user={user}"),
    ];
    args.extend(pki_tls.iter().cloned());
    args.extend(cmd.iter().map(|s| s.to_string()));
    run("etcdctl", &args)
}

fn path_str(p: &Path) -> String {
    p.display().to_string()
}

#[test]
fn secure_cluster_enforces_tls_authentication_and_acls() {
    ensure_installed().expect("server packages installed");
    let mut spec = ClusterSpec {
        zk: 1,
        etcd: 1,
        redis: 3,
        secure: true,
        state_path: Some(scratch_state_path("secure-selftest")),
        ..ClusterSpec::default()
    };
    // Offsets that are 100 mod 150: between the plain self-tests' (50 and 0 mod 150).
    let started = std::time::Instant::now();
    let mut cluster =
        Cluster::start_at_free_offset(&mut spec, (0..200u16).map(|k| 20_100 + k * 150))
            .expect("secured cluster starts");
    eprintln!("secured cluster ready in {:?}", started.elapsed());
    let pki = cluster.pki().expect("a secured cluster has a PKI");
    assert_eq!(pki.dir, cluster.root_dir.join("pki"));
    for f in [&pki.ca, &pki.cert, &pki.key, &pki.server_pem, &pki.other_ca] {
        assert!(f.exists(), "{} missing", f.display());
    }
    let t = Duration::from_secs(2);

    // --- ZooKeeper: TLS only, client certificate required.
    let zk = cluster.server(Backend::Zookeeper, 1).expect("zk1").clone();
    assert_eq!(zk.zk_mode(t), Some(ZkMode::Standalone), "srvr over TLS");
    assert_eq!(zk_mode(&zk.addr, t), None, "no plaintext ZooKeeper");
    assert_eq!(cluster.zk_leader(), Some(1));
    assert!(
        tls_handshake(&zk.addr, &pki.other_ca, &pki.cert, &pki.key, t).is_err(),
        "a client trusting another CA must not accept ZooKeeper's certificate"
    );

    // --- etcd: https with client certificates, users and roles.
    let etcd = cluster.server(Backend::Etcd, 1).expect("etcd1").clone();
    assert!(!etcd_healthy(&etcd.addr, t), "no plaintext etcd");
    assert_eq!(
        cluster
            .wait_leader(Backend::Etcd, Duration::from_secs(30))
            .expect("etcd leader over TLS"),
        1
    );
    let etls = etcdctl_tls_args(&pki);
    let app = format!("{APP_USER}:{APP_PASSWORD}");
    let key = format!("{ETCD_APP_PREFIX}x");
    let (ok, out) = etcdctl(&etcd.addr, &etls, &app, &["put", &key, "1"]);
    assert!(ok && out.contains("OK"), "app put {key}: {out}");
    let (ok, out) = etcdctl(&etcd.addr, &etls, &app, &["get", &key]);
    assert!(ok && out.contains(&key), "app get {key}: {out}");
    let (_, out) = etcdctl(&etcd.addr, &etls, &app, &["put", "other/x", "1"]);
    assert!(out.contains("permission denied"), "app put other/x: {out}");
    let nobody = format!("{NOBODY_USER}:{NOBODY_PASSWORD}");
    let (_, out) = etcdctl(&etcd.addr, &etls, &nobody, &["put", &key, "2"]);
    assert!(out.contains("permission denied"), "nobody put: {out}");
    let wrong = format!("{APP_USER}:{WRONG_PASSWORD}");
    let (_, out) = etcdctl(&etcd.addr, &etls, &wrong, &["get", &key]);
    assert!(
        out.contains("authentication failed"),
        "wrong password: {out}"
    );

    // --- Redis: TLS only, ACL users.
    let redis = cluster.server(Backend::Redis, 1).expect("redis1").clone();
    let rtls: Vec<String> = vec![
        "--tls".into(),
        "--cacert".into(),
        path_str(&pki.ca),
        "--cert".into(),
        path_str(&pki.cert),
        "--key".into(),
        path_str(&pki.key),
    ];
    let app = Some((APP_USER, APP_PASSWORD));
    let out = redis_cli(&redis.addr, &rtls, app, &["SET", "dlock:{x}:q", "v"]);
    assert_eq!(out.trim(), "OK", "app SET dlock:{{x}}:q");
    let out = redis_cli(&redis.addr, &rtls, app, &["SET", "other:x", "v"]);
    assert!(out.contains("NOPERM"), "app SET other:x: {out}");
    let out = redis_cli(&redis.addr, &rtls, app, &["KEYS", "*"]);
    assert!(out.contains("NOPERM"), "app KEYS: {out}");
    let out = redis_cli(
        &redis.addr,
        &rtls,
        app,
        &[
            "EVAL",
            "return redis.call('GET', KEYS[1])",
            "1",
            "dlock:{x}:q",
        ],
    );
    assert_eq!(out.trim(), "v", "app EVAL on a dlock key");
    let out = redis_cli(&redis.addr, &rtls, app, &["PUBLISH", "other", "m"]);
    assert!(out.contains("NOPERM"), "app PUBLISH other: {out}");
    let out = redis_cli(
        &redis.addr,
        &rtls,
        Some((NOBODY_USER, NOBODY_PASSWORD)),
        &["GET", "dlock:{x}:q"],
    );
    assert!(out.contains("NOPERM"), "nobody GET dlock:{{x}}:q: {out}");
    let out = redis_cli(
        &redis.addr,
        &rtls,
        Some((APP_USER, WRONG_PASSWORD)),
        &["GET", "dlock:{x}:q"],
    );
    assert!(out.contains("WRONGPASS"), "wrong password: {out}");
    let out = redis_cli(&redis.addr, &rtls, None, &["GET", "dlock:{x}:q"]);
    assert!(out.contains("NOAUTH"), "anonymous: {out}");
    // Client certificates are optional on Redis: the CA alone is enough.
    let ca_only: Vec<String> = rtls[..3].to_vec();
    let out = redis_cli(&redis.addr, &ca_only, app, &["GET", "dlock:{x}:q"]);
    assert_eq!(out.trim(), "v", "app without a client certificate");
    // Plaintext on the TLS port fails.
    assert!(!redis_ping(&redis.addr, t), "plaintext PING answered");
    let out = redis_cli(&redis.addr, &[], app, &["PING"]);
    assert!(!out.contains("PONG"), "plaintext redis-cli: {out}");
    assert!(
        tls_handshake(&redis.addr, &pki.other_ca, &pki.cert, &pki.key, t).is_err(),
        "a client trusting another CA must not accept Redis's certificate"
    );
    assert_eq!(
        redis
            .redis_query(&["ACL", "DRYRUN", APP_USER, "GET", "other:x"], t)
            .map(|r| r.contains("permissions")),
        Some(true),
        "the testkit's own query logs in as the administrator"
    );
    for s in cluster.servers_of(Backend::Redis) {
        assert!(s.is_ready(t), "redis {} ready over TLS", s.id);
    }
    // Every command dlock's Redis adapter sends (connecting, EVALSHA with SCRIPT LOAD on
    // NOSCRIPT, PTTL, pub/sub) and every command its scripts run, on its key and channel
    // names (crates/redis/src/keys.rs): allowed for the app user, refused for nobody
    // where a key or channel is named.
    let (q, seq, tok) = ("dlock:{l}:q", "dlock:{l}:seq", "dlock:{l}:token");
    let (entry, gone, chg) = ("dlock:{l}:e:n", "dlock:{l}:gone:n", "dlock:{l}:chg");
    let sha = "e0e1f9fabfc9d4800c877a703b823ac0578ff8db";
    let commands: &[&[&str]] = &[
        &["HELLO", "3"],
        &["CLIENT", "SETNAME", "dlock"],
        &["SELECT", "0"],
        &["PING"],
        &["ROLE"],
        &["INFO", "server"],
        &["TIME"],
        &["SCRIPT", "LOAD", "return 1"],
        &["EVALSHA", sha, "3", q, seq, tok],
        &["PTTL", entry],
        &["SUBSCRIBE", gone],
        &["UNSUBSCRIBE", gone],
        &["DEL", entry, q, seq, tok],
        &["EXISTS", entry],
        &["GET", entry],
        &["SET", tok, "1", "PX", "1000"],
        &["PEXPIRE", q, "1000", "GT"],
        &["PUBLISH", chg, "n"],
        &["ZADD", q, "1", "n"],
        &["ZRANGE", q, "0", "-1", "WITHSCORES"],
        &["ZRANGEBYSCORE", q, "-inf", "1", "WITHSCORES"],
        &["ZREM", q, "n"],
    ];
    for cmd in commands {
        let mut args = vec!["ACL", "DRYRUN", APP_USER];
        args.extend_from_slice(cmd);
        let reply = redis.redis_query(&args, t);
        assert_eq!(reply.as_deref(), Some("OK"), "app may run {cmd:?}");
        let names_a_key = cmd.iter().any(|a| a.starts_with("dlock:"));
        // UNSUBSCRIBE checks no channel; EVALSHA checks keys only once the script runs.
        if names_a_key && !matches!(cmd[0], "EVALSHA" | "UNSUBSCRIBE") {
            args[2] = NOBODY_USER;
            let reply = redis.redis_query(&args, t).unwrap_or_default();
            assert!(
                reply.contains("permissions"),
                "nobody may not run {cmd:?}: {reply}"
            );
        }
    }

    // --- The URLs and environment handed to dlock's tests.
    assert_eq!(
        cluster.endpoints(),
        dlock_testkit::Endpoints::default(),
        "no plain DLOCK_TEST_* endpoints for a secured cluster"
    );
    let env = cluster.secure_env();
    let names: Vec<&str> = env.iter().map(|(k, _)| *k).collect();
    assert_eq!(
        names,
        [
            ENV_SECURE_ZK,
            ENV_SECURE_ETCD,
            ENV_SECURE_REDIS,
            ENV_SECURE_REDLOCK,
            ENV_SECURE_STATE
        ]
    );
    let redlock = cluster
        .secure_url(LockService::Redlock, Caller::App)
        .expect("redlock url");
    let prefix = format!(
        "redlocks://{APP_USER}:{APP_PASSWORD}@{}?ca={}&cert=",
        cluster.addrs(Backend::Redis),
        pki.ca.display()
    );
    assert!(redlock.starts_with(&prefix), "{redlock}");
    for (name, url) in &env {
        eprintln!("{name}={url}");
    }

    // --- The state file carries what the probes need: another process restarts nodes.
    let path = spec.state_path.clone().expect("state path");
    let mut other = State::load(&path).expect("state loads");
    assert_eq!(other.pki(), Some(pki.clone()));
    other
        .restart(Backend::Redis, 1)
        .expect("restart secured redis");
    let out = redis_cli(&redis.addr, &rtls, app, &["SET", "dlock:{x}:q", "w"]);
    assert_eq!(
        out.trim(),
        "OK",
        "app after the restart (ACLs come from argv)"
    );
    cluster
        .restart(Backend::Zookeeper, 1)
        .expect("restart secured zk");
    assert_eq!(cluster.zk_leader(), Some(1));

    cluster.down().expect("down");
    assert!(!pki.dir.exists(), "PKI left behind");
}

/// A secured Sentinel group: TLS replication, Sentinels on TLS with ACL users; the app
/// user finds the primary through a Sentinel and writes to it; the group fails over when
/// the primary is killed, and the restarted old primary rejoins as a replica.
#[test]
fn secure_sentinel_group_serves_the_app_user_and_fails_over() {
    ensure_installed().expect("server packages installed");
    let mut spec = ClusterSpec {
        zk: 0,
        etcd: 0,
        redis: 0,
        sentinel_replicas: 1,
        redis_cluster: false,
        secure: true,
        state_path: Some(scratch_state_path("secure-sentinel-selftest")),
        ..ClusterSpec::default()
    };
    let mut cluster =
        Cluster::start_at_free_offset(&mut spec, (0..200u16).map(|k| 21_100 + k * 150))
            .expect("secured Sentinel group starts");
    let limit = Duration::from_secs(60);
    let pki = cluster.pki().expect("PKI");
    let rtls: Vec<String> = vec![
        "--tls".into(),
        "--cacert".into(),
        path_str(&pki.ca),
        "--cert".into(),
        path_str(&pki.cert),
        "--key".into(),
        path_str(&pki.key),
    ];
    let app = Some((APP_USER, APP_PASSWORD));
    assert_eq!(
        cluster
            .wait_leader(Backend::RedisHa, limit)
            .expect("primary"),
        1
    );
    let sentinel = cluster.server(Backend::Sentinel, 1).expect("s1").clone();
    let out = redis_cli(
        &sentinel.addr,
        &rtls,
        app,
        &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster"],
    );
    let primary = cluster.server(Backend::RedisHa, 1).expect("node 1").clone();
    let port = primary.addr.rsplit_once(':').expect("port").1;
    assert!(out.lines().any(|l| l == port), "app asks a Sentinel: {out}");
    let out = redis_cli(
        &sentinel.addr,
        &rtls,
        app,
        &["SENTINEL", "SET", "mymaster", "quorum", "1"],
    );
    assert!(
        out.contains("NOPERM"),
        "app may not reconfigure a Sentinel: {out}"
    );
    let out = redis_cli(&sentinel.addr, &[], app, &["PING"]);
    assert!(!out.contains("PONG"), "plaintext Sentinel: {out}");
    let out = redis_cli(&primary.addr, &rtls, app, &["SET", "dlock:{s}:q", "v"]);
    assert_eq!(out.trim(), "OK", "app writes to the primary");
    let url = cluster
        .secure_url(LockService::RedisSentinel, Caller::App)
        .expect("sentinel url");
    assert!(
        url.starts_with(&format!(
            "rediss+sentinel://{APP_USER}:{APP_PASSWORD}@{}/mymaster?ca=",
            cluster.addrs(Backend::Sentinel)
        )),
        "{url}"
    );
    assert!(cluster
        .secure_env()
        .contains(&(dlock_testkit::ENV_SECURE_REDIS_SENTINEL, url)));

    cluster.kill(Backend::RedisHa, 1).expect("kill primary");
    let new = cluster.wait_failover(1, limit).expect("failover");
    assert_eq!(new, 2);
    let promoted = cluster.server(Backend::RedisHa, 2).expect("node 2").clone();
    let out = redis_cli(&promoted.addr, &rtls, app, &["GET", "dlock:{s}:q"]);
    assert_eq!(out.trim(), "v", "the write replicated over TLS");
    // Not before every Sentinel has an answering link to the new primary: right after
    // `+switch-master` the Sentinels reconnect to it, and a link that has not answered
    // within down-after-milliseconds (1 s) marks it down. With the old primary back as an
    // empty master, that spurious failover promotes the empty node and loses the write
    // (seen here in 6 of 21 runs before this wait).
    cluster
        .wait_sentinels_see_primary_up(limit)
        .expect("every Sentinel sees the new primary up");
    cluster
        .restart(Backend::RedisHa, 1)
        .expect("restart old primary");
    // The group is whole again: every live node linked and known to every Sentinel,
    // and the write is still there whichever node leads (the old primary came back
    // empty: leading with its data would be a failover that lost an acknowledged write).
    let settled = cluster.wait_sentinel_group(limit).expect("group whole");
    if settled != new {
        eprintln!("note: the Sentinels failed over once more, from node {new} to node {settled}");
    }
    let leader = cluster
        .server(Backend::RedisHa, settled)
        .expect("leader")
        .clone();
    let out = redis_cli(&leader.addr, &rtls, app, &["GET", "dlock:{s}:q"]);
    assert_eq!(
        out.trim(),
        "v",
        "the write survived the old primary's return (node {settled} leads)"
    );
    cluster.down().expect("down");
}

#[test]
fn a_plain_cluster_has_no_secure_urls() {
    let state_json = r#"{"root_dir":"/tmp/dlock-cluster-x","port_offset":0,"servers":[{"backend":"redis","id":1,"addr":"127.0.0.1:6379","pid":1,"start_time":1,"data_dir":"/d","log_path":"/d/out.log","argv":["redis-server"]}]}"#;
    let path = std::env::temp_dir().join(format!("dlock-testkit-old-{}.json", std::process::id()));
    std::fs::write(&path, state_json).expect("write");
    let state = State::load(&path).expect("a state file from before secured clusters loads");
    std::fs::remove_file(&path).expect("cleanup");
    assert_eq!(state.servers[0].tls, None);
    assert_eq!(state.pki(), None);
    assert!(state.secure_env().is_empty());
    assert_eq!(state.secure_url(LockService::Redis, Caller::App), None);
}
