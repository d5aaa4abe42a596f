//! Integration tests through Redis Sentinel (`DLOCK_TEST_REDIS_SENTINEL=h:p,h:p,h:p/service`),
//! and a real failover of the shared cluster's Sentinel group (`DLOCK_TEST_STATE`): the
//! primary is SIGKILLed, the Sentinels promote the replica, the clients follow.
//!
//! The tests of this file share one Sentinel group, and one of them fails it over, so
//! they take turns ([`SERIAL`]).

mod common;

use std::time::{Duration, Instant};

use common::*;
use dlock_core::{decide, Backend, Decision, Error, QueuePath};
use dlock_redis::RedisBackend;
use dlock_testkit::{redis_query, Backend as Server};

static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const WAIT: Duration = Duration::from_secs(60);
const LONG: Duration = Duration::from_secs(30);

/// The Sentinels and the service of a `DLOCK_TEST_REDIS_SENTINEL` value
/// (`h:p,h:p,h:p/service`).
fn sentinels_and_service(group: &str) -> (Vec<String>, String) {
    let (hosts, service) = group.split_once('/').expect("h:p,.../service");
    (
        hosts.split(',').map(str::to_owned).collect(),
        service.to_owned(),
    )
}

async fn connect_sentinel(group: &str, lease: Duration) -> std::sync::Arc<RedisBackend> {
    let (sentinels, service) = sentinels_and_service(group);
    RedisBackend::connect_sentinel(&sentinels, &service, opts(lease))
        .await
        .expect("connect through the Sentinels")
}

async fn lock(b: &RedisBackend, q: &QueuePath) -> dlock_core::Enqueued {
    enqueue_lock(b, q).await.expect("enqueue")
}

/// Enqueues and waits (through `wait_gone`) until the entry holds the lock.
async fn acquire(b: &RedisBackend, q: &QueuePath) -> dlock_core::Entry {
    let added = lock(b, q).await;
    wait_turn(b, q, added.mine, added.queue).await
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

#[tokio::test]
async fn lock_and_unlock_through_sentinel() {
    init_tracing();
    let Some(group) = dlock_testkit::require_redis_sentinel() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let a = connect_sentinel(&group, LONG).await;
    let b = connect_sentinel(&group, LONG).await;
    assert_eq!(a.kind(), "redis");
    let q = fresh_queue("sentinel-basic");
    let first = lock(&a, &q).await;
    assert_eq!(decide(&first.queue, &first.mine.name), Decision::Acquired);
    let waiter = {
        let (b, q) = (b.clone(), q.clone());
        tokio::spawn(async move { acquire(&b, &q).await })
    };
    assert!(
        eventually(WAIT, || async {
            a.participants(&q).await.is_ok_and(|p| p.len() == 2)
        })
        .await,
        "the second client queues behind the holder"
    );
    a.remove(&q, &first.mine).await.expect("unlock");
    let second = tokio::time::timeout(WAIT, waiter)
        .await
        .expect("the waiter wakes")
        .expect("waiter task");
    assert!(second.token > first.mine.token, "tokens grow");
    b.remove(&q, &second).await.expect("unlock");
    assert!(b.participants(&q).await.expect("participants").is_empty());
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// `replicas=1` through Sentinel works: grants are granted (the group's replica
/// acknowledges) and each is on the replica when it returns. Local replication is fast,
/// so the second would mostly hold without the setting too; what the setting adds is
/// shown by tests/replicas.rs, which cuts or stops a replica.
#[tokio::test]
async fn a_grant_through_sentinel_is_on_the_replica_when_it_returns() {
    init_tracing();
    let Some(group) = dlock_testkit::require_redis_sentinel() else {
        return;
    };
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let primary = state
        .wait_leader(Server::RedisHa, WAIT)
        .expect("the Sentinels agree on a primary");
    let replica_addr = state
        .servers_of(Server::RedisHa)
        .find(|s| s.id != primary && s.is_running())
        .expect("a replica")
        .addr
        .clone();
    let (sentinels, service) = sentinels_and_service(&group);
    let b = RedisBackend::connect_sentinel(&sentinels, &service, opts(LONG).with_replicas(1))
        .await
        .expect("connect through the Sentinels");
    let t = Duration::from_secs(5);
    for round in 0..20 {
        let q = fresh_queue("sentinel-replicas");
        let added = lock(&b, &q).await;
        let key = format!("dlock:{{{}}}:q", q.lock.as_str());
        assert_eq!(
            redis_query(&replica_addr, &["EXISTS", &key], t).as_deref(),
            Some("1"),
            "round {round}: the grant returned before the replica had the entry"
        );
        b.remove(&q, &added.mine).await.expect("remove");
    }
    assert_eq!(b.stats().unreplicated, 0);
    b.close().await.expect("close");
}

/// A Sentinel whose TCP connect hangs, listed first, costs one connection attempt, not
/// the whole connect timeout: the clients ask the next Sentinel and connect within the
/// timeout (fred asks the Sentinels one after the other).
#[tokio::test]
async fn a_sentinel_that_stalls_the_handshake_costs_one_attempt() {
    init_tracing();
    let Some(group) = dlock_testkit::require_redis_sentinel() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let (sentinels, service) = sentinels_and_service(&group);
    let hole = dlock_testkit::BlackHole::new().expect("black hole");
    let mut with_hole = vec![hole.addr()];
    with_hole.extend(sentinels);
    let timeout = Duration::from_secs(4);
    let start = Instant::now();
    let b = RedisBackend::connect_sentinel(
        &with_hole,
        &service,
        opts(LONG).with_connect_timeout(timeout),
    )
    .await
    .unwrap_or_else(|e| panic!("connect with a stalled first Sentinel: {e}"));
    assert!(start.elapsed() < timeout, "{:?}", start.elapsed());
    let q = fresh_queue("sentinel-stalled");
    let added = lock(&b, &q).await;
    assert_eq!(decide(&added.queue, &added.mine.name), Decision::Acquired);
    b.remove(&q, &added.mine).await.expect("remove");
    b.close().await.expect("close");
}

#[tokio::test]
async fn bad_sentinel_arguments_are_typed_errors() {
    let o = opts(LONG);
    let one = |s: &str| vec![s.to_owned()];
    for (sentinels, service) in [
        (one("127.0.0.1:1"), ""),
        (
            vec!["127.0.0.1:1".to_owned(), "127.0.0.1:1".to_owned()],
            "mymaster",
        ),
        (one("127.0.0.1"), "mymaster"),
        (one("u:p@127.0.0.1:1"), "mymaster"),
        (one("127.0.0.1:1"), "my master"),
        (Vec::new(), "mymaster"),
    ] {
        let r = RedisBackend::connect_sentinel(&sentinels, service, o.clone()).await;
        assert!(
            matches!(r, Err(Error::InvalidUrl { .. })),
            "{sentinels:?}/{service}: {:?}",
            r.map(|_| ())
        );
    }
    // Nobody listens there: unreachable within the connect timeout, not a hang.
    let quick = o.with_connect_timeout(Duration::from_millis(500));
    let r = RedisBackend::connect_sentinel(&["127.0.0.1:1".to_owned()], "mymaster", quick).await;
    assert!(
        matches!(r, Err(Error::Unreachable(_))),
        "{:?}",
        r.map(|_| ())
    );
}

/// SIGKILL the primary while one client holds two locks: one entry replicated (it must
/// survive: the holder keeps the lock and the next client queues behind it), one the
/// replica never got (simulated by deleting it on the replica only: asynchronous
/// replication loses a write that way). After the failover the holder's `lost()` fires for
/// the second, the next client gets it with a larger token, the holder's own waits are
/// woken by messages on the new primary, and every token issued after the failover is
/// above every token issued before.
#[tokio::test]
async fn primary_kill_fails_over_and_clients_follow() {
    init_tracing();
    let Some(group) = dlock_testkit::require_redis_sentinel() else {
        return;
    };
    let Some(mut state) = dlock_testkit::require_state() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    // A lease well above a failover (1 s down-after plus election and promotion), so a
    // surviving entry is renewed on the new primary before it could expire.
    let lease = Duration::from_secs(15);
    let primary = state
        .wait_leader(Server::RedisHa, WAIT)
        .expect("the Sentinels agree on a primary");
    let replica_addr = state
        .servers_of(Server::RedisHa)
        .find(|s| s.id != primary && s.is_running())
        .expect("a replica")
        .addr
        .clone();
    let a = connect_sentinel(&group, lease).await;
    let kept_q = fresh_queue("failover-kept");
    let lost_q = fresh_queue("failover-lost");
    let kept = lock(&a, &kept_q).await.mine;
    let gone = lock(&a, &lost_q).await.mine;
    let gone_lost = a.lost(&lost_q, &gone);
    let kept_lost = a.lost(&kept_q, &kept);

    let t = Duration::from_secs(5);
    let q = |addr: &str, args: &[&str]| {
        redis_query(addr, args, t).unwrap_or_else(|| panic!("{addr}: {args:?} unanswered"))
    };
    // Both entries on the replica, then "un-replicate" the second one there. (`WAIT` from
    // a fresh connection would not do: it waits only for that connection's own writes.)
    // Each is its lock's only entry: the lock's one key (the queue's) is the entry.
    let gone_key = format!("dlock:{{{}}}:q", lost_q.lock.as_str());
    let kept_key = format!("dlock:{{{}}}:q", kept_q.lock.as_str());
    let replicated = Instant::now() + WAIT;
    while q(&replica_addr, &["EXISTS", &kept_key, &gone_key]) != "2" {
        assert!(
            Instant::now() < replicated,
            "the replica never got both entries"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    q(&replica_addr, &["CONFIG", "SET", "replica-read-only", "no"]);
    assert_eq!(q(&replica_addr, &["DEL", &gone_key]), "1");
    q(
        &replica_addr,
        &["CONFIG", "SET", "replica-read-only", "yes"],
    );

    state
        .kill(Server::RedisHa, primary)
        .expect("SIGKILL the primary");
    let promoted = state
        .wait_failover(primary, WAIT)
        .expect("the Sentinels fail over");
    eprintln!("failover: node {primary} killed, node {promoted} promoted");

    // The entry the new primary never had: lost() fires (after the reconnection's
    // watchdog round), and the next client takes the lock with a larger token.
    let reason = tokio::time::timeout(WAIT, gone_lost)
        .await
        .expect("lost() fires for the entry the failover lost");
    assert!(matches!(reason, Error::LockLost(_)), "{reason:?}");
    let b = connect_sentinel(&group, lease).await;
    let taken = acquire(&b, &lost_q).await;
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

    // The holder's own clients followed: a wait of `a` is woken by the message `b`'s
    // removal publishes on the new primary, not by the re-check timer.
    let again = lock(&a, &lost_q).await;
    let again_name = again.mine.name.clone();
    let before = a.stats().messages;
    let waiter = {
        let (a, q) = (a.clone(), lost_q.clone());
        tokio::spawn(async move { wait_turn(&a, &q, again.mine, again.queue).await })
    };
    // Let the waiter subscribe before the removal (a late subscriber re-checks anyway).
    assert!(eventually(WAIT, || async { a.stats().subscribes > 0 }).await);
    b.remove(&lost_q, &taken).await.expect("unlock");
    let got = tokio::time::timeout(WAIT, waiter)
        .await
        .expect("the holder's wait ends")
        .expect("waiter task");
    assert_eq!(got.name, again_name);
    assert!(got.token > taken.token);
    assert!(
        a.stats().messages > before,
        "the wake-up came over pub/sub on the new primary"
    );

    // The surviving hold ends normally; nothing fired for it meanwhile.
    assert!(
        futures::FutureExt::now_or_never(kept_lost).is_none(),
        "lost() must not fire for an entry that survived the failover"
    );
    a.remove(&kept_q, &kept).await.expect("unlock the survivor");
    a.remove(&lost_q, &got).await.expect("unlock");
    let behind_name = behind.mine.name.clone();
    let next = wait_turn(&b, &kept_q, behind.mine, behind.queue).await;
    assert_eq!(next.name, behind_name);
    b.remove(&kept_q, &next).await.expect("unlock");
    a.close().await.expect("close");
    b.close().await.expect("close");

    // Leave the group whole for whoever runs next: the old primary back, as a replica,
    // once every Sentinel sees the promoted node up (`wait_sentinels_see_primary_up`).
    state
        .wait_sentinels_see_primary_up(WAIT)
        .expect("every Sentinel sees the new primary up");
    state
        .restart(Server::RedisHa, primary)
        .expect("restart the old primary");
    let old = state
        .server(Server::RedisHa, primary)
        .expect("node")
        .addr
        .clone();
    assert!(
        eventually(WAIT, || {
            let old = old.clone();
            async move {
                redis_query(&old, &["ROLE"], Duration::from_secs(1))
                    .is_some_and(|r| r.lines().next() == Some("slave"))
            }
        })
        .await,
        "the old primary rejoins as a replica"
    );
}

/// `SENTINEL FAILOVER`: the old primary stays up, and answers as a master until the
/// Sentinels demote it (about 10 s later). A client must not stay there meanwhile, or it
/// and a client that connects to the new primary could both hold one lock: the
/// `+switch-master` announcement moves it at once. Its replicated lock survives, and a
/// new client queues behind it on the new primary.
#[tokio::test]
async fn manual_failover_moves_clients_off_the_live_old_primary() {
    init_tracing();
    let Some(group) = dlock_testkit::require_redis_sentinel() else {
        return;
    };
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    let _turn = SERIAL.lock().await;
    let lease = Duration::from_secs(15);
    let old = state
        .wait_sentinel_group(WAIT)
        .expect("a whole Sentinel group");
    let old_addr = state
        .server(Server::RedisHa, old)
        .expect("primary")
        .addr
        .clone();
    let a = connect_sentinel(&group, lease).await;
    let q = fresh_queue("manual-failover");
    let held = lock(&a, &q).await.mine;
    let held_lost = a.lost(&q, &held);
    let t = Duration::from_secs(5);
    assert_eq!(
        redis_query(&old_addr, &["WAIT", "1", "5000"], t * 2).as_deref(),
        Some("1"),
        "the replica has the entry"
    );
    let sentinel = state
        .servers_of(Server::Sentinel)
        .next()
        .expect("a Sentinel")
        .addr
        .clone();
    let service = group.rsplit_once('/').expect("service").1.to_owned();
    assert_eq!(
        redis_query(&sentinel, &["SENTINEL", "FAILOVER", &service], t).as_deref(),
        Some("OK")
    );
    let new = state
        .wait_failover(old, WAIT)
        .expect("the Sentinels fail over");
    let new_addr = state
        .server(Server::RedisHa, new)
        .expect("new")
        .addr
        .clone();
    eprintln!("manual failover: node {old} -> node {new}");
    assert!(
        eventually(WAIT, || async { a.stats().primary_switches >= 1 }).await,
        "the +switch-master announcement reached the client"
    );
    // `a` now writes to the new primary: a fresh entry of its lands there.
    let q2 = fresh_queue("manual-failover-after");
    let after = loop {
        match enqueue_lock(&a, &q2).await {
            Ok(e) => break e.mine,
            Err(Error::Unreachable(_)) => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(e) => panic!("enqueue after the failover: {e}"),
        }
    };
    // `after` is its lock's only entry: the lock's one key (the queue's).
    let key = format!("dlock:{{{}}}:q", q2.lock.as_str());
    assert_eq!(
        redis_query(&new_addr, &["EXISTS", &key], t).as_deref(),
        Some("1"),
        "the client's write went to the new primary"
    );
    // The replicated hold survived; a new client (on the new primary) queues behind it.
    let b = connect_sentinel(&group, lease).await;
    let behind = lock(&b, &q).await;
    assert!(
        matches!(decide(&behind.queue, &behind.mine.name), Decision::Wait(_)),
        "the hold survived the failover: {:?}",
        behind.queue
    );
    assert!(behind.mine.token > held.token);
    assert!(futures::FutureExt::now_or_never(held_lost).is_none());
    a.remove(&q, &held).await.expect("unlock");
    a.remove(&q2, &after).await.expect("unlock");
    let behind_name = behind.mine.name.clone();
    let next = wait_turn(&b, &q, behind.mine, behind.queue).await;
    assert_eq!(next.name, behind_name);
    b.remove(&q, &next).await.expect("unlock");
    a.close().await.expect("close");
    b.close().await.expect("close");
    // Whole again (the old primary demoted to a replica) for whoever runs next.
    state
        .wait_sentinel_group(WAIT)
        .expect("the old primary rejoins as a replica");
}
