//! The in-memory backend's semantics, on paused time.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    lost_margin, Backend, Entry, EntryKind, Error, FencingToken, Gone, LockName, NameRules,
    Position, QueuePath, SessionOptions,
};
use tokio::time::Instant;

use super::{FaultPlan, MemBackend, MemServer};

const SESSION: Duration = Duration::from_secs(2);

fn queue(name: &str) -> QueuePath {
    QueuePath::root(LockName::new(name, NameRules::common()).expect("name"))
}

async fn session(server: &Arc<MemServer>) -> Arc<MemBackend> {
    server
        .connect(SessionOptions::default().with_session_timeout(SESSION))
        .await
        .expect("connect")
}

async fn add(b: &MemBackend, q: &QueuePath, kind: EntryKind) -> Entry {
    b.enqueue(q, &crate::ticket(), kind, Position::Tail, b"")
        .await
        .expect("enqueue")
        .mine
}

#[tokio::test(start_paused = true)]
async fn a_live_session_outlasts_many_timeouts() {
    let server = MemServer::new();
    let a = session(&server).await;
    let q = queue("live");
    let e = add(&a, &q, EntryKind::Lock).await;
    tokio::time::sleep(SESSION * 10).await;
    assert!(server.is_alive(a.session()));
    assert!(a.contains(&q, &e).await.expect("contains"));
}

#[tokio::test(start_paused = true)]
async fn a_cut_off_session_is_lost_a_margin_before_it_expires() {
    let server = MemServer::new();
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("expiry");
    let held = add(&a, &q, EntryKind::Lock).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let lost = a.lost(&q, &held);
    server.partition(a.session());
    let cut_at = Instant::now();
    let lost_at = tokio::spawn(async move {
        let e = lost.await;
        (Instant::now(), e)
    });
    b.wait_gone(&q, &held).await.expect("the entry goes");
    let gone_at = Instant::now();
    let (lost_at, why) = lost_at.await.expect("lost task");
    assert!(matches!(why, Error::LockLost(_)), "{why:?}");
    assert!(
        gone_at - lost_at >= lost_margin(SESSION),
        "lost {:?} before the expiry, less than the margin {:?}",
        gone_at - lost_at,
        lost_margin(SESSION)
    );
    assert!(gone_at - cut_at <= SESSION, "expired too late");
    assert!(!server.is_alive(a.session()));
    server.heal(a.session());
    assert!(matches!(a.queue(&q).await, Err(Error::LockLost(_))));
}

#[tokio::test(start_paused = true)]
async fn late_heartbeat_replies_fire_lost_before_the_server_would_expire() {
    let server = MemServer::new();
    let a = session(&server).await;
    let q = queue("late");
    let held = add(&a, &q, EntryKind::Lock).await;
    server.delay_replies(a.session(), SESSION);
    let e = tokio::time::timeout(SESSION * 2, a.lost(&q, &held))
        .await
        .expect("lost fires");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    // The server kept receiving heartbeats: the session is alive there, the client
    // simply could not prove it in time.
    assert!(server.is_alive(a.session()));
}

#[tokio::test(start_paused = true)]
async fn a_server_side_expiry_reaches_the_client_only_through_lost() {
    let server = MemServer::new();
    let a = session(&server).await;
    let q = queue("expire");
    let held = add(&a, &q, EntryKind::Lock).await;
    assert!(server.expire_session(a.session()));
    assert!(server.revision() >= 1);
    let e = tokio::time::timeout(SESSION, a.lost(&q, &held))
        .await
        .expect("the next heartbeat is refused");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    assert!(matches!(a.queue(&q).await, Err(Error::LockLost(_))));
}

#[tokio::test(start_paused = true)]
async fn close_removes_entries_and_refuses_every_later_call() {
    let server = MemServer::new();
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("close");
    let held = add(&a, &q, EntryKind::Lock).await;
    let lost = a.lost(&q, &held);
    a.close().await.expect("close");
    a.close().await.expect("close is idempotent");
    assert!(matches!(lost.await, Error::LockLost(_)));
    assert!(b.queue(&q).await.expect("queue").is_empty());
    assert!(matches!(a.queue(&q).await, Err(Error::Closed)));
    assert!(matches!(a.remove(&q, &held).await, Err(Error::Closed)));
}

#[tokio::test(start_paused = true)]
async fn beside_needs_this_sessions_live_writer() {
    let server = MemServer::new();
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("beside");
    let w = add(&a, &q, EntryKind::Write).await;
    let _queued = add(&b, &q, EntryKind::Write).await;
    // Another session's writer: refused.
    let other = b
        .enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Read,
            Position::Beside(&w),
            b"",
        )
        .await;
    assert!(matches!(other, Err(Error::LockLost(_))), "{other:?}");
    // Its own writer: at the writer's sequence, ahead of the queued writer.
    let read = a
        .enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Read,
            Position::Beside(&w),
            b"",
        )
        .await
        .expect("beside");
    assert_eq!(read.mine.seq, w.seq);
    let at = read.queue.iter().position(|e| e.name == read.mine.name);
    assert!(matches!(at, Some(0 | 1)), "not beside its writer: {at:?}");
    // A deleted writer: refused, nothing put.
    a.remove(&q, &read.mine).await.expect("remove read");
    b.remove(&q, &w)
        .await
        .expect("delete the writer from outside");
    let dead = a
        .enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Read,
            Position::Beside(&w),
            b"",
        )
        .await;
    assert!(matches!(dead, Err(Error::LockLost(_))), "{dead:?}");
    assert_eq!(a.queue(&q).await.expect("queue").len(), 1);
}

#[tokio::test(start_paused = true)]
async fn abandon_removes_what_the_ticket_made() {
    let server = MemServer::new();
    let a = session(&server).await;
    let q = queue("abandon");
    let ticket = crate::ticket();
    let keep = add(&a, &q, EntryKind::Lock).await;
    a.enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"")
        .await
        .expect("enqueue");
    a.abandon(&q, &ticket).await.expect("abandon");
    a.abandon(&q, &ticket).await.expect("abandon again");
    let left = a.queue(&q).await.expect("queue");
    assert_eq!(left, vec![keep]);
}

#[tokio::test(start_paused = true)]
async fn a_dropped_reply_then_a_retry_adds_and_removes_once() {
    let server = MemServer::new();
    let a = session(&server).await;
    let q = queue("retry");
    let ticket = crate::ticket();
    server.drop_reply(a.session(), 1);
    let first = a
        .enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"")
        .await;
    assert!(matches!(first, Err(Error::Unreachable(_))), "{first:?}");
    assert_eq!(a.queue(&q).await.expect("queue").len(), 1, "applied anyway");
    let retry = a
        .enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"")
        .await
        .expect("retry");
    assert_eq!(retry.queue.len(), 1, "the retry added nothing");
    assert!(retry.mine.is_from(&ticket));

    server.drop_reply(a.session(), 1);
    let removed = a.remove(&q, &retry.mine).await;
    assert!(matches!(removed, Err(Error::Unreachable(_))), "{removed:?}");
    a.remove(&q, &retry.mine)
        .await
        .expect("the retry finds it gone");
    assert!(a.queue(&q).await.expect("queue").is_empty());
}

#[tokio::test(start_paused = true)]
async fn remove_and_contains_compare_the_token() {
    let server = MemServer::new();
    let a = session(&server).await;
    let q = queue("token");
    let e = add(&a, &q, EntryKind::Lock).await;
    let mut other = e.clone();
    other.token = e.token.map(|t| FencingToken::new(t.get() + 1));
    assert!(!a.contains(&q, &other).await.expect("contains"));
    a.remove(&q, &other).await.expect("remove");
    assert!(
        a.contains(&q, &e).await.expect("contains"),
        "a newer name-twin was removed"
    );
}

#[tokio::test(start_paused = true)]
async fn a_lost_watch_event_is_rescued_by_the_recheck() {
    let server = MemServer::new();
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("lostwatch");
    let held = add(&a, &q, EntryKind::Lock).await;
    server.lose_watch_event(b.session(), 1);
    let (b2, q2, held2) = (b.clone(), q.clone(), held.clone());
    let waiter = tokio::spawn(async move {
        let gone = b2.wait_gone_detail(&q2, &held2).await;
        (Instant::now(), gone)
    });
    tokio::task::yield_now().await;
    let removed_at = Instant::now();
    a.remove(&q, &held).await.expect("remove");
    let (woke_at, gone) = waiter.await.expect("waiter");
    assert_eq!(gone.expect("wait"), Gone::Unknown, "found by a check");
    // tokio's timers tick in whole milliseconds.
    assert!(
        woke_at - removed_at <= b.recheck_interval() + Duration::from_millis(1),
        "woke {:?} after the removal, recheck {:?}",
        woke_at - removed_at,
        b.recheck_interval()
    );
}

#[tokio::test(start_paused = true)]
async fn the_removal_of_the_head_is_reported_as_such() {
    let server = MemServer::new();
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("head");
    let first = add(&a, &q, EntryKind::Write).await;
    let second = add(&a, &q, EntryKind::Write).await;
    let (b2, q2, s2) = (b.clone(), q.clone(), second.clone());
    let behind = tokio::spawn(async move { b2.wait_gone_detail(&q2, &s2).await });
    // A read beside the head: its writer's removal is not the head's any more.
    let read = a
        .enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Read,
            Position::Beside(&first),
            b"",
        )
        .await
        .expect("beside")
        .mine;
    let (b3, q3, f3) = (b.clone(), q.clone(), first.clone());
    let head = tokio::spawn(async move { b3.wait_gone_detail(&q3, &f3).await });
    tokio::task::yield_now().await;
    a.remove(&q, &first).await.expect("remove");
    assert_eq!(head.await.expect("task").expect("wait"), Gone::Unknown);
    a.remove(&q, &read).await.expect("remove");
    a.remove(&q, &second).await.expect("remove");
    assert_eq!(behind.await.expect("task").expect("wait"), Gone::Head);
}

#[tokio::test(start_paused = true)]
async fn payload_changes_and_the_shared_value_are_seen() {
    let server = MemServer::new();
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("payload");
    assert_eq!(a.read_value(&q).await.expect("read"), None);
    server.set_value(&q, Some(3i32.to_be_bytes().to_vec()));
    assert_eq!(
        a.read_value(&q).await.expect("read"),
        Some(3i32.to_be_bytes().to_vec())
    );
    let held = add(&a, &q, EntryKind::Lock).await;
    let (a2, q2, h2) = (a.clone(), q.clone(), held.clone());
    let watcher = tokio::spawn(async move { a2.wait_data_changed(&q2, &h2, b"").await });
    tokio::task::yield_now().await;
    b.set_data(&q, &held, b"__REVOKE__").await.expect("set");
    assert_eq!(
        watcher.await.expect("task").expect("wait"),
        Some(b"__REVOKE__".to_vec())
    );
    a.remove(&q, &held).await.expect("remove");
    assert_eq!(
        a.wait_data_changed(&q, &held, b"").await.expect("wait"),
        None
    );
}

/// One scenario under a seeded plan: every call's outcome and the virtual time it took.
async fn seeded_trace(seed: u64) -> Vec<(String, Duration)> {
    let server = MemServer::with_faults(FaultPlan {
        drop_reply: 0.2,
        delay_reply: 0.3,
        max_reply_delay: Duration::from_millis(50),
        lose_watch_event: 0.3,
        delay_watch_event: 0.3,
        max_watch_delay: Duration::from_millis(80),
        ..FaultPlan::new(seed)
    });
    let a = session(&server).await;
    let b = session(&server).await;
    let q = queue("seeded");
    let start = Instant::now();
    let mut trace = Vec::new();
    for _ in 0..20 {
        let ticket = crate::ticket();
        let got = a
            .enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"")
            .await;
        trace.push((format!("enqueue {}", got.is_ok()), start.elapsed()));
        let Ok(got) = got else {
            let _ = a.abandon(&q, &ticket).await;
            continue;
        };
        let (b2, q2, m2) = (b.clone(), q.clone(), got.mine.clone());
        let waiter = tokio::spawn(async move { b2.wait_gone_detail(&q2, &m2).await });
        tokio::task::yield_now().await;
        let removed = a.remove(&q, &got.mine).await;
        trace.push((format!("remove {}", removed.is_ok()), start.elapsed()));
        let gone = waiter.await.expect("task");
        trace.push((format!("gone {gone:?}"), start.elapsed()));
    }
    trace
}

#[tokio::test(start_paused = true)]
async fn one_seed_replays_the_same_run() {
    let first = seeded_trace(42).await;
    assert_eq!(first, seeded_trace(42).await);
    assert!(
        first.iter().any(|(what, _)| what.contains("false")),
        "no fault drawn: {first:?}"
    );
}
