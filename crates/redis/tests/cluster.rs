//! Integration tests on a Redis Cluster (`DLOCK_TEST_REDIS_CLUSTER=h:p,...`, every node a
//! seed) and real failovers of the shared cluster (`DLOCK_TEST_STATE`): `CLUSTER
//! FAILOVER` on a replica, and SIGKILL of a master so that its replica is promoted.
//!
//! The tests of this file share one cluster, and some fail a master over, so they take
//! turns ([`SERIAL`]).

mod common;

use std::time::{Duration, Instant};

use common::*;
use dlock_core::{decide, Backend, Decision, EntryKind, Error, Position, QueuePath};
use dlock_redis::RedisBackend;
use dlock_testkit::{key_slot, redis_query, Backend as Server, State};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const WAIT: Duration = Duration::from_secs(60);

fn seeds(nodes: &str) -> Vec<String> {
    nodes.split(',').map(|s| s.trim().to_owned()).collect()
}

async fn connect_cluster(nodes: &str, lease: Duration) -> std::sync::Arc<RedisBackend> {
    RedisBackend::connect_cluster(&seeds(nodes), opts(lease))
        .await
        .expect("connect to the cluster")
}

async fn lock(b: &RedisBackend, q: &QueuePath) -> dlock_core::Enqueued {
    let deadline = Instant::now() + WAIT;
    loop {
        // A slot without a master (a failover under way) is unreachable for a moment.
        match b
            .enqueue(
                q,
                &dlock_testkit::ticket(),
                EntryKind::Lock,
                Position::Tail,
                b"",
            )
            .await
        {
            Ok(e) => return e,
            Err(Error::Unreachable(e)) if Instant::now() < deadline => {
                eprintln!("enqueue: {e}; retrying");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("enqueue: {e}"),
        }
    }
}

/// Waits (through `wait_gone`) until `mine`, enqueued in `queue`, holds the lock.
async fn wait_turn(
    b: &RedisBackend,
    q: &QueuePath,
    mine: dlock_core::Entry,
    mut queue: Vec<dlock_core::Entry>,
) -> dlock_core::Entry {
    loop {
        match decide(&queue, &mine.name) {
            Decision::Acquired => return mine,
            Decision::Wait(ahead) => {
                tokio::time::timeout(WAIT, b.wait_gone(q, ahead))
                    .await
                    .unwrap_or_else(|_| {
                        panic!("{} ahead of {} did not go in time", ahead.name, mine.name)
                    })
                    .expect("wait_gone");
                queue = b.queue(q).await.expect("queue");
            }
            other => panic!("unexpected decision {other:?}"),
        }
    }
}

/// The queue key of `q`, whose slot is the lock's.
fn queue_key(q: &QueuePath) -> String {
    format!("dlock:{{{}}}:q", q.lock.as_str())
}

/// A fresh queue whose slot the master `master` serves.
fn queue_on(state: &State, master: u32, test: &str) -> QueuePath {
    for _ in 0..10_000 {
        let q = fresh_queue(test);
        if state.redis_cluster_master_of(&queue_key(&q)).ok() == Some(master) {
            return q;
        }
    }
    panic!("no lock name found on master {master}");
}

fn addr(state: &State, id: u32) -> String {
    state
        .server(Server::RedisCluster, id)
        .expect("cluster node")
        .addr
        .clone()
}

/// Waits until the replica `replica` has applied everything its master sent so far.
async fn replicated(state: &State, master: u32, replica: u32) {
    let t = Duration::from_secs(2);
    let offset = |id: u32, field: &str| {
        redis_query(&addr(state, id), &["INFO", "replication"], t)
            .and_then(|i| {
                i.lines()
                    .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
            })
            .and_then(|v| v.parse::<u64>().ok())
    };
    let target = offset(master, "master_repl_offset:").expect("master offset");
    assert!(
        eventually(WAIT, || async {
            offset(replica, "master_repl_offset:").is_some_and(|o| o >= target)
        })
        .await,
        "replica {replica} never caught up with master {master}"
    );
}

#[tokio::test]
async fn locks_spread_over_masters_and_wake_ups_are_sharded() {
    init_tracing();
    let Some(nodes) = dlock_testkit::require_redis_cluster() else {
        return;
    };
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    state
        .wait_redis_cluster_ok(WAIT)
        .expect("the cluster serves every slot");
    let lease = Duration::from_secs(15);
    let a = connect_cluster(&nodes, lease).await;
    let b = connect_cluster(&nodes, lease).await;
    assert_eq!(a.kind(), "redis-cluster");
    // Locks on two different masters: each works on its own slot.
    let masters: Vec<u32> = state
        .servers_of(Server::RedisCluster)
        .filter(|s| {
            redis_query(&s.addr, &["ROLE"], Duration::from_secs(1))
                .is_some_and(|r| r.lines().next() == Some("master"))
        })
        .map(|s| s.id)
        .collect();
    assert_eq!(masters.len(), 3, "three masters");
    for &m in &masters[..2] {
        let q = queue_on(&state, m, "cluster-spread");
        let first = lock(&a, &q).await;
        assert_eq!(decide(&first.queue, &first.mine.name), Decision::Acquired);
        // The keys are on that master (a plain GET of another master's key is MOVED).
        // An uncontended hold is the lock's one key (the queue's).
        let key = format!("dlock:{{{}}}:q", q.lock.as_str());
        assert_eq!(
            redis_query(&addr(&state, m), &["EXISTS", &key], Duration::from_secs(2)).as_deref(),
            Some("1"),
            "the entry lives on the master of slot {}",
            key_slot(&key)
        );

        let second = lock(&b, &q).await;
        let Decision::Wait(ahead) = decide(&second.queue, &second.mine.name) else {
            panic!("the second contender waits: {:?}", second.queue);
        };
        assert_eq!(ahead.name, first.mine.name);
        let before = b.stats();
        let waiter = {
            let (b, q, mine, queue) = (b.clone(), q.clone(), second.mine.clone(), second.queue);
            tokio::spawn(async move { wait_turn(&b, &q, mine, queue).await })
        };
        // The waiter listens on a sharded channel of the lock's slot, on its master,
        // and on no plain channel anywhere.
        let chan = format!("dlock:{{{}}}:gone:{}", q.lock.as_str(), first.mine.name);
        let t = Duration::from_secs(2);
        assert!(
            eventually(WAIT, || async {
                redis_query(&addr(&state, m), &["PUBSUB", "SHARDNUMSUB", &chan], t)
                    .is_some_and(|r| r.lines().nth(1) == Some("1"))
            })
            .await,
            "the waiter subscribed with SSUBSCRIBE on master {m}"
        );
        assert_eq!(
            redis_query(&addr(&state, m), &["PUBSUB", "NUMSUB", &chan], t)
                .and_then(|r| r.lines().nth(1).map(str::to_owned))
                .as_deref(),
            Some("0"),
            "no plain SUBSCRIBE"
        );
        a.remove(&q, &first.mine).await.expect("unlock");
        let got = tokio::time::timeout(WAIT, waiter)
            .await
            .expect("the waiter wakes")
            .expect("waiter task");
        assert_eq!(got.name, second.mine.name);
        assert!(got.token > first.mine.token, "tokens grow");
        let after = b.stats();
        assert!(
            after.messages > before.messages,
            "woken by the SPUBLISH of the removal"
        );
        assert_eq!(after.missed_wakeups, before.missed_wakeups);
        b.remove(&q, &got).await.expect("unlock");
        assert!(b.participants(&q).await.expect("participants").is_empty());
    }
    // `list_queues` walks every master.
    let qs: Vec<QueuePath> = masters
        .iter()
        .map(|&m| queue_on(&state, m, "cluster-list"))
        .collect();
    let mut held = Vec::new();
    for q in &qs {
        held.push(lock(&a, q).await.mine);
    }
    let listed = b.list_queues("test/cluster-list/").await.expect("list");
    for q in &qs {
        assert!(
            listed.iter().any(|l| l.path == q.lock.as_str()),
            "{} listed: {listed:?}",
            q.lock.as_str()
        );
    }
    for (q, e) in qs.iter().zip(&held) {
        a.remove(q, e).await.expect("unlock");
    }
    a.close().await.expect("close");
    b.close().await.expect("close");
}

#[tokio::test]
async fn bad_cluster_arguments_are_typed_errors() {
    let o = opts(Duration::from_secs(15));
    for seeds in [
        Vec::new(),
        vec!["127.0.0.1:1".to_owned(), "127.0.0.1:1".to_owned()],
        vec!["127.0.0.1".to_owned()],
    ] {
        let r = RedisBackend::connect_cluster(&seeds, o.clone()).await;
        assert!(
            matches!(r, Err(Error::InvalidUrl { .. })),
            "{seeds:?}: {:?}",
            r.map(|_| ())
        );
    }
    let quick = o.with_connect_timeout(Duration::from_millis(500));
    let r = RedisBackend::connect_cluster(&["127.0.0.1:1".to_owned()], quick).await;
    assert!(
        matches!(r, Err(Error::Unreachable(_))),
        "{:?}",
        r.map(|_| ())
    );
}

/// `CLUSTER FAILOVER` on the replica of the master that holds a lock: the replica
/// catches up before it takes over, so the hold survives (no `lost()`), the holder keeps
/// renewing on the new master, a new client queues behind it with a larger token, and a
/// waiter queued before the failover is handed the lock when the holder releases.
#[tokio::test]
async fn manual_failover_keeps_replicated_holds_and_wakes_waiters() {
    init_tracing();
    let Some(nodes) = dlock_testkit::require_redis_cluster() else {
        return;
    };
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    state
        .wait_redis_cluster_ok(WAIT)
        .expect("the cluster serves every slot");
    let lease = Duration::from_secs(6);
    let probe = fresh_queue("cluster-manual-failover");
    let master = state
        .redis_cluster_master_of(&queue_key(&probe))
        .expect("master of the slot");
    let replica = state.redis_cluster_replica_of(master).expect("its replica");
    let a = connect_cluster(&nodes, lease).await;
    let w = connect_cluster(&nodes, lease).await;
    let q = probe;
    let held = lock(&a, &q).await.mine;
    let held_lost = a.lost(&q, &held);
    let queued = lock(&w, &q).await;
    assert!(matches!(
        decide(&queued.queue, &queued.mine.name),
        Decision::Wait(_)
    ));
    let waiter = {
        let (w, q, mine, queue) = (w.clone(), q.clone(), queued.mine.clone(), queued.queue);
        tokio::spawn(async move { wait_turn(&w, &q, mine, queue).await })
    };
    replicated(&state, master, replica).await;

    assert_eq!(
        redis_query(
            &addr(&state, replica),
            &["CLUSTER", "FAILOVER"],
            Duration::from_secs(5)
        )
        .as_deref(),
        Some("OK")
    );
    assert!(
        eventually(WAIT, || async {
            state.redis_cluster_master_of(&queue_key(&q)).ok() == Some(replica)
        })
        .await,
        "the replica took the slot over"
    );
    state
        .wait_redis_cluster_ok(WAIT)
        .expect("the cluster settles");

    // The hold survived: a new client queues behind it, with a larger token.
    let b = connect_cluster(&nodes, lease).await;
    let behind = lock(&b, &q).await;
    assert!(
        matches!(decide(&behind.queue, &behind.mine.name), Decision::Wait(_)),
        "the hold survived the failover: {:?}",
        behind.queue
    );
    assert!(behind.mine.token > held.token);
    // Two renewal periods on the new master: still held, nothing fired.
    tokio::time::sleep(lease * 2 / 3).await;
    assert!(
        futures::FutureExt::now_or_never(held_lost).is_none(),
        "lost() must not fire for an entry that survived the failover"
    );
    assert!(
        a.contains(&q, &held).await.expect("contains"),
        "the holder's entry is still on the new master"
    );
    // The waiter queued before the failover is next: handed the lock on release.
    a.remove(&q, &held).await.expect("unlock");
    let got = tokio::time::timeout(WAIT, waiter)
        .await
        .expect("the waiter from before the failover wakes")
        .expect("waiter task");
    assert_eq!(got.name, queued.mine.name);
    assert!(got.token > held.token);
    w.remove(&q, &got).await.expect("unlock");
    let behind_name = behind.mine.name.clone();
    let next = wait_turn(&b, &q, behind.mine, behind.queue).await;
    assert_eq!(next.name, behind_name);
    b.remove(&q, &next).await.expect("unlock");
    for c in [a, b, w] {
        c.close().await.expect("close");
    }
}

/// SIGKILL the master that holds two locks of one client: one entry replicated (it must
/// survive), one that the replica never had (made so by emptying the replica right after
/// it received that entry, and before the other was written: asynchronous replication
/// loses a write the same way). After the replica is promoted the holder's `lost()`
/// fires for the second, the next client gets it with a larger token, the first keeps
/// its lock, and the old master rejoins as a replica.
#[tokio::test]
async fn master_kill_loses_only_unreplicated_holds_and_they_fire_lost() {
    init_tracing();
    let Some(nodes) = dlock_testkit::require_redis_cluster() else {
        return;
    };
    let Some(mut state) = dlock_testkit::require_state() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    state
        .wait_redis_cluster_ok(WAIT)
        .expect("the cluster serves every slot");
    // A lease well above a failover (2 s node timeout, then the election), so a surviving
    // entry is renewed on the new master before it could expire.
    let lease = Duration::from_secs(15);
    let lost_q = fresh_queue("cluster-kill-lost");
    let master = state
        .redis_cluster_master_of(&queue_key(&lost_q))
        .expect("master of the slot");
    let kept_q = queue_on(&state, master, "cluster-kill-kept");
    let replica = state.redis_cluster_replica_of(master).expect("its replica");
    let (master_addr, replica_addr) = (addr(&state, master), addr(&state, replica));
    let t = Duration::from_secs(5);
    let q = |addr: &str, args: &[&str]| {
        redis_query(addr, args, t).unwrap_or_else(|| panic!("{addr}: {args:?} unanswered"))
    };

    let a = connect_cluster(&nodes, lease).await;
    // The entry to lose: written, replicated, then wiped on the replica (a keyless
    // FLUSHALL is accepted by a writable replica; keyed writes would be MOVED).
    q(&replica_addr, &["CONFIG", "SET", "replica-read-only", "no"]);
    let gone = lock(&a, &lost_q).await.mine;
    replicated(&state, master, replica).await;
    assert_eq!(q(&replica_addr, &["FLUSHALL"]), "OK");
    q(
        &replica_addr,
        &["CONFIG", "SET", "replica-read-only", "yes"],
    );
    // The entry to keep: written after the wipe, replicated.
    let kept = lock(&a, &kept_q).await.mine;
    replicated(&state, master, replica).await;
    let gone_lost = a.lost(&lost_q, &gone);
    let kept_lost = a.lost(&kept_q, &kept);
    assert_eq!(q(&master_addr, &["ROLE"]).lines().next(), Some("master"));

    state
        .kill(Server::RedisCluster, master)
        .expect("SIGKILL the master");
    let killed_at = Instant::now();
    assert!(
        eventually(WAIT, || async {
            state.redis_cluster_master_of(&queue_key(&lost_q)).ok() == Some(replica)
        })
        .await,
        "the replica is promoted"
    );
    eprintln!(
        "master {master} killed, replica {replica} promoted after {:?}",
        killed_at.elapsed()
    );

    let reason = tokio::time::timeout(WAIT, gone_lost)
        .await
        .expect("lost() fires for the entry the failover lost");
    assert!(matches!(reason, Error::LockLost(_)), "{reason:?}");
    eprintln!("lost() fired {:?} after the SIGKILL", killed_at.elapsed());
    let b = connect_cluster(&nodes, lease).await;
    let taken_added = lock(&b, &lost_q).await;
    let taken = wait_turn(&b, &lost_q, taken_added.mine, taken_added.queue).await;
    assert!(
        taken.token > gone.token,
        "token after the failover ({:?}) above the one before ({:?})",
        taken.token,
        gone.token
    );
    // The replicated entry survived: its holder keeps it, the next client queues.
    let behind = lock(&b, &kept_q).await;
    assert!(
        matches!(decide(&behind.queue, &behind.mine.name), Decision::Wait(_)),
        "the surviving holder still holds: {:?}",
        behind.queue
    );
    assert!(behind.mine.token > kept.token);
    assert!(
        futures::FutureExt::now_or_never(kept_lost).is_none(),
        "lost() must not fire for an entry that survived the failover"
    );
    a.remove(&kept_q, &kept).await.expect("unlock the survivor");
    let behind_name = behind.mine.name.clone();
    let next = wait_turn(&b, &kept_q, behind.mine, behind.queue).await;
    assert_eq!(next.name, behind_name);
    b.remove(&kept_q, &next).await.expect("unlock");
    b.remove(&lost_q, &taken).await.expect("unlock");
    a.close().await.expect("close");
    b.close().await.expect("close");

    // Whole again for whoever runs next: the old master back, as a replica.
    state
        .restart(Server::RedisCluster, master)
        .expect("restart the old master");
    assert!(
        eventually(WAIT, || async {
            redis_query(&master_addr, &["ROLE"], Duration::from_secs(1))
                .is_some_and(|r| r.lines().next() == Some("slave"))
        })
        .await,
        "the old master rejoins as a replica"
    );
    state
        .wait_redis_cluster_ok(WAIT)
        .expect("the cluster is whole again");
}
