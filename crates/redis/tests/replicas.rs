//! `SessionOptions::replicas` (`?replicas=1`) on a private primary and its replica, both
//! started and stopped by these tests (they run when `DLOCK_TEST_REDIS` is set, as the
//! other fault tests do): a grant or a renewal counts only once the replica has it.
//!
//! The replica is stopped with SIGSTOP, so it holds on to its copy of the data and
//! acknowledges nothing: what a replica cut off from its primary looks like to the
//! primary, and what a replica promoted after such a cut would serve.

mod common;

use std::time::{Duration, Instant};

use common::*;
use dlock_core::{Backend, EntryKind, Error, Position, SessionOptions};
use dlock_redis::RedisBackend;
use futures::FutureExt;

const LEASE: Duration = Duration::from_secs(2);

async fn connect_replicated(addr: &str, replicas: u32) -> std::sync::Arc<RedisBackend> {
    RedisBackend::connect(addr, opts(LEASE).with_replicas(replicas))
        .await
        .expect("connect to the primary")
}

#[tokio::test]
async fn a_grant_counts_once_the_replica_has_it() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDIS", "a_grant_counts_once_the_replica_has_it").is_none() {
        return;
    }
    let primary = TestServer::start();
    let replica = TestServer::start_replica_of(&primary);
    let b = connect_replicated(&primary.addr(), 1).await;
    let on_primary = inspector(&primary.addr()).await;
    let on_replica = inspector(&replica.addr()).await;

    // Granted: the replica has the entry as soon as the grant returns (no waiting here).
    let q = fresh_queue("replicas-grant");
    let key = queue_key(&q);
    let held = enqueue_lock(&b, &q)
        .await
        .expect("granted with the replica up");
    assert!(
        key_exists(&on_replica, &key).await,
        "a grant returned before the replica had its entry"
    );
    assert_eq!(b.stats().unreplicated, 0);

    // A second contender takes the queue path (ENQUEUE, not the solo fast path).
    let q2 = fresh_queue("replicas-queue");
    let first = enqueue_lock(&b, &q2).await.expect("first of q2");

    replica.signal("STOP");
    let started = Instant::now();
    let refused = enqueue_lock(&b, &fresh_queue("replicas-stopped")).await;
    assert!(
        matches!(&refused, Err(Error::Unreachable(m)) if m.contains("replicas")),
        "an uncontended grant the replica did not acknowledge: {refused:?}"
    );
    let queued = b
        .enqueue(
            &q2,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"",
        )
        .await;
    assert!(
        matches!(&queued, Err(Error::Unreachable(m)) if m.contains("replicas")),
        "a queued entry the replica did not acknowledge: {queued:?}"
    );
    eprintln!("two refusals took {:?}", started.elapsed());
    assert!(
        started.elapsed() < LEASE,
        "each refusal waits the replica wait (lease/20, at least 100 ms), not longer"
    );
    assert_eq!(b.stats().unreplicated, 2);
    // Taken back on the primary: q2 holds its first entry only, nothing else was left.
    let listed = b.queue(&q2).await.expect("list q2");
    assert_eq!(
        listed.iter().map(|e| e.name.as_str()).collect::<Vec<_>>(),
        [first.mine.name.as_str()],
        "the refused entry was left in the queue"
    );
    let left = scan_keys(&on_primary, "dlock:{test/replicas-stopped/*").await;
    assert!(left.is_empty(), "a refused grant left keys: {left:?}");

    replica.signal("CONT");
    let q3 = fresh_queue("replicas-back");
    let again = enqueue_lock(&b, &q3)
        .await
        .expect("granted again once the replica acknowledges");
    b.remove(&q3, &again.mine).await.expect("release");
    b.remove(&q2, &first.mine).await.expect("release");
    b.remove(&q, &held.mine).await.expect("release");
    b.close().await.expect("close");
}

#[tokio::test]
async fn renewals_the_replica_misses_do_not_count() {
    init_tracing();
    if endpoint(
        "DLOCK_TEST_REDIS",
        "renewals_the_replica_misses_do_not_count",
    )
    .is_none()
    {
        return;
    }
    let primary = TestServer::start();
    let replica = TestServer::start_replica_of(&primary);
    // One holder that waits for the replica, one that does not (the behaviour before
    // the setting existed), on the same primary.
    let waits = connect_replicated(&primary.addr(), 1).await;
    let trusts = connect_replicated(&primary.addr(), 0).await;
    let (qw, qt) = (fresh_queue("replicas-renew"), fresh_queue("replicas-trust"));
    let ew = enqueue_lock(&waits, &qw).await.expect("granted").mine;
    let et = enqueue_lock(&trusts, &qt).await.expect("granted").mine;
    let (lost_w, mut lost_t) = (waits.lost(&qw, &ew), trusts.lost(&qt, &et));
    let on_replica_copy = inspector(&replica.addr()).await;
    assert!(key_exists(&on_replica_copy, &queue_key(&qw)).await);

    // From here the replica acknowledges nothing: its copy of the entry ends one lease
    // after the last renewal it has, at the latest.
    let stopped = Instant::now();
    replica.signal("STOP");
    let reason = tokio::time::timeout(LEASE * 3, lost_w)
        .await
        .expect("lost() fires: no renewal since the stop counts");
    let after = stopped.elapsed();
    eprintln!("replica stopped: lost() after {after:?}: {reason}");
    assert!(
        matches!(&reason, Error::LockLost(r) if r.contains("no successful renewal")),
        "{reason:?}"
    );
    assert!(
        after < LEASE,
        "lost() must fire before the replica's copy may end (one lease after the last \
         renewal it has, before the stop), not after {after:?}"
    );
    assert!(waits.stats().unreplicated >= 1);
    // The holder that does not wait counts renewals only the primary has: a replica
    // promoted now would drop its entry while it still holds.
    tokio::time::sleep(LEASE).await;
    assert!(
        (&mut lost_t).now_or_never().is_none(),
        "without replicas the holder keeps counting on renewals the replica never saw"
    );
    replica.signal("CONT");
    trusts.remove(&qt, &et).await.expect("release");
    trusts.close().await.expect("close");
    waits.close().await.expect("close");
}

#[tokio::test]
async fn redlock_and_cluster_refuse_replicas() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDIS", "redlock_and_cluster_refuse_replicas").is_none() {
        return;
    }
    let server = TestServer::start();
    let opts = SessionOptions::default().with_replicas(1);
    let refused = RedisBackend::connect_redlock(&[server.addr()], opts).await;
    assert!(
        matches!(&refused, Err(Error::InvalidUrl { reason, .. }) if reason.contains("replicas")),
        "{refused:?}"
    );
}
