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
    connect_leased(addr, replicas, LEASE).await
}

async fn connect_leased(
    addr: &str,
    replicas: u32,
    lease: Duration,
) -> std::sync::Arc<RedisBackend> {
    RedisBackend::connect(addr, opts(lease).with_replicas(replicas))
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

/// The failover the setting is for, end to end: the replication link is cut (dropped
/// packets, so neither end notices) while a holder renews on the primary, then the
/// primary dies and the replica is promoted. The holder must be told it lost the lock
/// before its entry ends on the promoted replica, where anyone can take it from then on.
/// Without the setting the holder counts the renewals only the old primary saw, and is
/// told up to a renewal period after the entry ended there (this test, run with
/// `replicas` 0, fails that way).
#[tokio::test]
async fn a_replica_promoted_after_a_cut_lets_nobody_in_before_the_holder_is_told() {
    init_tracing();
    if endpoint(
        "DLOCK_TEST_REDIS",
        "a_replica_promoted_after_a_cut_lets_nobody_in_before_the_holder_is_told",
    )
    .is_none()
    {
        return;
    }
    // Longer than the other tests' lease: the holder is told `lost_margin` (10 % of
    // it) before the deadline, a margin a loaded test machine must not eat.
    let lease = LEASE * 3;
    let mut primary = TestServer::start();
    let replica = TestServer::start_replica_of(&primary);
    let a = connect_leased(&primary.addr(), 1, lease).await;
    let q = fresh_queue("replicas-promotion");
    let key = queue_key(&q);
    let held = enqueue_lock(&a, &q).await.expect("granted").mine;
    let lost = a.lost(&q, &held);
    let told = tokio::spawn(async move {
        let reason = lost.await;
        (Instant::now(), reason)
    });
    // A renewal or two count first.
    tokio::time::sleep(lease / 2).await;
    let link = dlock_testkit::connections_of(replica.pid(), primary.port)
        .expect("the replica's connections");
    assert!(!link.is_empty(), "the replica has no link to its primary");
    let pairs: Vec<(u16, u16)> = link.iter().map(|&l| (l, primary.port)).collect();
    let cut = dlock_testkit::NetCut::new(&pairs, &[]).expect("cut the link (root and nft)");
    // The holder keeps renewing on the primary; none of it reaches the replica.
    tokio::time::sleep(lease / 2).await;
    primary.kill();
    let r_addr = replica.addr();
    assert_eq!(
        dlock_testkit::redis_query(&r_addr, &["REPLICAOF", "NO", "ONE"], lease).as_deref(),
        Some("OK")
    );
    let on_new_primary = inspector(&r_addr).await;
    let deadline = Instant::now() + lease * 5;
    while key_exists(&on_new_primary, &key).await {
        assert!(
            Instant::now() < deadline,
            "the entry never ended on the new primary"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let open = Instant::now();
    let (told_at, reason) = tokio::time::timeout(lease * 3, told)
        .await
        .expect("lost() fires")
        .expect("task");
    eprintln!(
        "promotion: holder told {:?} before the entry ended on the new primary: {reason}",
        open.checked_duration_since(told_at)
    );
    assert!(
        told_at <= open,
        "two holders: the entry ended on the promoted replica {:?} before its holder was told",
        told_at - open
    );
    // Anyone is granted there now.
    let b = connect(&r_addr, lease).await;
    let second = enqueue_lock(&b, &q)
        .await
        .expect("enqueue on the new primary");
    assert_eq!(
        second.queue.len(),
        1,
        "the new primary still had the old entry"
    );
    drop(cut);
    b.close().await.expect("close");
    let _ = tokio::time::timeout(lease, a.close()).await;
}

/// A leader's proclaim counts only once the replica has the value: with the replica
/// stopped it fails with `Unreachable` (the value is on the primary only, and a replica
/// promoted now would show the leader's older one); running, the replica has the new
/// value when the proclaim returns.
#[tokio::test]
async fn a_proclaim_counts_once_the_replica_has_the_value() {
    init_tracing();
    if endpoint(
        "DLOCK_TEST_REDIS",
        "a_proclaim_counts_once_the_replica_has_the_value",
    )
    .is_none()
    {
        return;
    }
    let primary = TestServer::start();
    let replica = TestServer::start_replica_of(&primary);
    // A lease long enough that the stopped replica costs the renewals nothing here.
    let b = connect_leased(&primary.addr(), 1, Duration::from_secs(30)).await;
    let on_replica = inspector(&replica.addr()).await;
    let q = fresh_queue("replicas-proclaim");
    let leader = b
        .enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Candidate,
            Position::Tail,
            b"v1",
        )
        .await
        .expect("candidate granted with the replica up")
        .mine;
    let entry_key = format!("dlock:{{{}}}:e:{}", q.lock.as_str(), leader.name);
    let value_on_replica = || async {
        let v: Option<String> = fred::prelude::KeysInterface::get(&on_replica, &entry_key)
            .await
            .expect("GET on the replica");
        v.unwrap_or_default()
    };

    b.proclaim(&q, &leader, b"v2").await.expect("proclaim");
    assert!(
        value_on_replica().await.ends_with(" v2"),
        "a proclaim returned before the replica had its value: {:?}",
        value_on_replica().await
    );
    let before = b.stats().unreplicated;

    replica.signal("STOP");
    let refused = b.proclaim(&q, &leader, b"v3").await;
    assert!(
        matches!(&refused, Err(Error::Unreachable(m)) if m.contains("replicas")),
        "a proclaim the replica did not acknowledge: {refused:?}"
    );
    assert_eq!(b.stats().unreplicated, before + 1);

    replica.signal("CONT");
    b.proclaim(&q, &leader, b"v4")
        .await
        .expect("proclaim once the replica acknowledges again");
    assert!(value_on_replica().await.ends_with(" v4"));
    b.remove(&q, &leader).await.expect("release");
    b.close().await.expect("close");
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
