//! Integration tests against a real etcd named by `DLOCK_TEST_ETCD` (`host:port,...`).
//!
//! Without it every test prints a `SKIPPED` line and returns, unless `CI` is set, in which
//! case it fails. Each test works under its own random lock name.

use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::driver::{decide, Decision};
use dlock_core::{
    Backend, Entry, EntryKind, Error, LockName, Position, QueuePath, SessionOptions, Ticket,
};
use dlock_etcd::EtcdBackend;
use dlock_testkit::frame_drop::{Action, Frame, Side, DATA};
use tokio::time::{timeout, Instant};

/// Generous bound for anything that should happen "soon" on a loaded 2-core machine.
const SOON: Duration = Duration::from_secs(20);

fn endpoints(test: &str) -> Option<Vec<String>> {
    match std::env::var("DLOCK_TEST_ETCD") {
        Ok(v) if !v.trim().is_empty() => Some(
            v.split(',')
                .map(|s| s.trim().to_owned())
                .filter(|s| !s.is_empty())
                .collect(),
        ),
        _ => {
            assert!(
                std::env::var_os("CI").is_none(),
                "{test}: DLOCK_TEST_ETCD is not set but CI is"
            );
            // Straight to the process' stderr: libtest captures `eprintln!` of passing tests.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: {test}: DLOCK_TEST_ETCD not set"
            );
            None
        }
    }
}

macro_rules! etcd_or_skip {
    ($test:expr) => {
        match endpoints($test) {
            Some(e) => e,
            None => return,
        }
    };
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

fn unique_name(test: &str) -> LockName {
    let n = format!("dlock-test/{test}/{}", uuid::Uuid::new_v4().simple());
    LockName::new(&n, dlock_etcd::NAME_RULES).expect("valid test name")
}

async fn connect(eps: &[String]) -> Arc<EtcdBackend> {
    EtcdBackend::connect(eps, SessionOptions::default())
        .await
        .expect("connect to the test etcd")
}

async fn raw(eps: &[String]) -> etcd_client::Client {
    etcd_client::Client::connect(eps, None)
        .await
        .expect("raw etcd client")
}

/// Every key under `prefix`, with its create revision.
async fn keys_under(c: &mut etcd_client::Client, prefix: &str) -> Vec<(String, i64)> {
    let r = c
        .get(prefix, Some(etcd_client::GetOptions::new().with_prefix()))
        .await
        .expect("raw get");
    r.kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                kv.create_revision(),
            )
        })
        .collect()
}

async fn enqueue(b: &EtcdBackend, q: &QueuePath, kind: EntryKind) -> (Ticket, Entry, Vec<Entry>) {
    let t = dlock_testkit::ticket();
    let e = b
        .enqueue(q, &t, kind, Position::Tail, b"test")
        .await
        .expect("enqueue");
    (t, e.mine, e.queue)
}

fn etcdctl(eps: &[String]) -> tokio::process::Command {
    let mut c = tokio::process::Command::new("etcdctl");
    c.env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", eps.join(",")))
        .kill_on_drop(true);
    c
}

// The contract every backend keeps (order, FIFO, tokens, beside, abandon, close,
// sub-queues, unsupported capabilities) is dlock-testkit's contract suite, instantiated in
// tests/contract.rs. The tests below check what only etcd has: its mutex's key layout,
// leases, etcdctl interop.

/// etcd closes a connection that pings more often than every 5 s while it sends nothing
/// (`--grpc-keepalive-min-time`: GOAWAY `too_many_pings` at the third early ping), with
/// every stream on it. Clients with a 2 s session, waiting quietly on a 3-member
/// cluster, keep their one watch stream and their session for three times as long as
/// the GOAWAY took when they pinged every third of the TTL (it came 2.7 s after
/// connecting, on each connection that carried no keep-alive answers).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_waiters_on_a_short_session_keep_their_streams() {
    init_tracing();
    let eps = etcd_or_skip!("quiet_waiters_on_a_short_session_keep_their_streams");
    if eps.len() < 2 {
        // One member means one connection, which the keep-alive answers keep busy.
        eprintln!("NOTE: one etcd endpoint: this test proves little; CI runs three");
    }
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(2));
    let q = QueuePath::root(unique_name("quiet-waiters"));
    let holder = EtcdBackend::connect(&eps, opts.clone())
        .await
        .expect("connect");
    let (_, held, _) = enqueue(&holder, &q, EntryKind::Lock).await;
    let mut held_lost = holder.lost(&q, &held);
    let mut waiters = Vec::new();
    for _ in 0..3 {
        let b = EtcdBackend::connect(&eps, opts.clone())
            .await
            .expect("connect");
        let (_, mine, queue) = enqueue(&b, &q, EntryKind::Lock).await;
        let ahead = match decide(&queue, &mine.name) {
            Decision::Wait(ahead) => ahead.clone(),
            other => panic!("a second contender did not wait: {other:?}"),
        };
        let lost = b.lost(&q, &mine);
        let wait = tokio::spawn({
            let (b, q) = (b.clone(), q.clone());
            async move { b.wait_gone(&q, &ahead).await }
        });
        waiters.push((b, mine, lost, wait));
    }
    tokio::time::sleep(Duration::from_secs(8)).await;
    assert!(
        futures::FutureExt::now_or_never(&mut held_lost).is_none(),
        "the holder's session was lost"
    );
    for (i, (b, _, lost, wait)) in waiters.iter_mut().enumerate() {
        assert_eq!(
            b.watch_streams_opened(),
            1,
            "waiter {i}'s watch stream broke and was re-opened"
        );
        assert!(
            futures::FutureExt::now_or_never(lost).is_none(),
            "waiter {i}'s session was lost"
        );
        if wait.is_finished() {
            let got = wait.await;
            panic!("waiter {i} stopped waiting while the lock was held: {got:?}");
        }
    }
    holder.remove(&q, &held).await.expect("release");
    for (b, mine, _, wait) in waiters {
        timeout(SOON, wait)
            .await
            .expect("the waiter is woken")
            .expect("waiter task")
            .expect("wait_gone");
        b.remove(&q, &mine).await.expect("release");
        b.close().await.expect("close");
    }
    holder.close().await.expect("close");
}

/// A `FrameDrop` rule that swallows the DATA frames `picks` picks and passes the rest.
fn swallow_data(
    picks: impl Fn(&Frame<'_>) -> bool + Send + Sync + 'static,
) -> impl Fn(&Frame<'_>) -> Action + Send + Sync + 'static {
    move |f| {
        if f.kind == DATA && picks(f) {
            Action::Swallow
        } else {
            Action::Pass
        }
    }
}

/// Whether a client DATA frame is one whole gRPC message holding a lease ID alone (field
/// 1, a varint of 2^32 or more): a keep-alive renewal, a TTL query or a revoke. Never the
/// lease grant, whose field 1 is its TTL in seconds.
fn carries_only_a_lease_id(payload: &[u8]) -> bool {
    let [0, l0, l1, l2, l3, msg @ ..] = payload else {
        return false;
    };
    if usize::try_from(u32::from_be_bytes([*l0, *l1, *l2, *l3])).ok() != Some(msg.len()) {
        return false;
    }
    let [0x08, varint @ ..] = msg else {
        return false;
    };
    let mut id = 0u64;
    for (i, byte) in varint.iter().enumerate().take(10) {
        id |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return i + 1 == varint.len() && id >= 1 << 32;
        }
    }
    false
}

/// An etcd member may leave a keep-alive renewal unanswered while it answers everything
/// else on the connection (seen under load, on a stream's first renewal). The session
/// then sends it again on a new stream after one renewal's wait, instead of waiting for
/// that answer until its lease is as good as gone. A proxy swallows the opening's renewal,
/// and then the first renewal on the stream opened in its place; a 2 s session still
/// keeps its lease, and the lock it holds, for three times its TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unanswered_keep_alive_renewals_are_sent_again_on_a_new_stream() {
    init_tracing();
    let eps = etcd_or_skip!("unanswered_keep_alive_renewals_are_sent_again_on_a_new_stream");
    // Lease-ID messages in order: the opening's renewal (swallowed), the second opening's
    // (answered), that stream's first renewal (swallowed), the third opening's, ...
    let seen = AtomicU64::new(0);
    let picks = move |f: &Frame<'_>| {
        f.from == Side::Client
            && carries_only_a_lease_id(f.payload)
            && [1, 3].contains(&(seen.fetch_add(1, Ordering::SeqCst) + 1))
    };
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(2));
    let (proxy, b) = through(&eps, swallow_data(picks), opts).await;
    let q = QueuePath::root(unique_name("keep-alive-opening"));
    let (_, held, _) = enqueue(&b, &q, EntryKind::Lock).await;
    let mut lost = b.lost(&q, &held);
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(
        proxy.swallowed(),
        2,
        "not both keep-alive renewals were swallowed: the test staged less than it says"
    );
    if let Some(e) = futures::FutureExt::now_or_never(&mut lost) {
        panic!("the session was lost: {e}");
    }
    let direct = connect(&eps).await;
    assert!(
        direct.contains(&q, &held).await.expect("contains"),
        "the held entry is gone: its lease expired"
    );
    b.remove(&q, &held).await.expect("release");
    b.close().await.expect("close");
    direct.close().await.expect("close");
}

/// Whether a client DATA frame is one whole gRPC message creating a watch: a
/// `WatchRequest` whose `create_request` (field 1) starts with its key (field 1). Puts,
/// ranges and deletes have their key's own bytes after that first tag, transactions a
/// compare's fields, lease calls a lease field: none of them matches.
fn creates_a_watch(payload: &[u8]) -> bool {
    let [0, l0, l1, l2, l3, 0x0a, rest @ ..] = payload else {
        return false;
    };
    if usize::try_from(u32::from_be_bytes([*l0, *l1, *l2, *l3])).ok() != Some(rest.len() + 1) {
        return false;
    }
    let mut len = 0usize;
    for (i, byte) in rest.iter().enumerate().take(5) {
        len |= usize::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return rest.get(i + 1) == Some(&0x0a) && rest.len() == i + 1 + len;
        }
    }
    false
}

/// A `FrameDrop` rule on the client's first watch stream (the one its first watch create
/// went out on): once stalled, that stream's DATA frames from `side` are swallowed.
#[derive(Clone, Default)]
struct FirstWatchStream {
    stream: Arc<AtomicU64>,
    stalled: Arc<AtomicBool>,
}

impl FirstWatchStream {
    fn rule(&self, side: Side) -> impl Fn(&Frame<'_>) -> Action + Send + Sync + 'static {
        let me = self.clone();
        swallow_data(move |f| {
            if f.from == Side::Client && creates_a_watch(f.payload) {
                let _ = me.stream.compare_exchange(
                    0,
                    f.stream.into(),
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
            }
            f.from == side
                && me.stalled.load(Ordering::SeqCst)
                && u64::from(f.stream) == me.stream.load(Ordering::SeqCst)
        })
    }

    fn created(&self) -> bool {
        self.stream.load(Ordering::SeqCst) != 0
    }

    fn stall(&self) {
        self.stalled.store(true, Ordering::SeqCst);
    }
}

/// A proxy to the first endpoint under `rule`, and a backend connected through it.
async fn through(
    eps: &[String],
    rule: impl Fn(&Frame<'_>) -> Action + Send + Sync + 'static,
    opts: SessionOptions,
) -> (dlock_testkit::FrameDrop, Arc<EtcdBackend>) {
    let proxy = dlock_testkit::FrameDrop::start(&eps[0], rule)
        .await
        .expect("start the proxy");
    let b = EtcdBackend::connect(&[proxy.addr()], opts)
        .await
        .expect("connect through the proxy");
    (proxy, b)
}

/// A watch stream that the server stops answering, while the connection and every other
/// call on it are still served, is given up: a wait whose watch it leaves unanswered
/// arms it on a new stream and is woken by the release. (Before, every later watch of
/// the client went to the stalled stream, and each wait failed once its retries ran out.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_watch_stream_that_stops_answering_is_replaced() {
    init_tracing();
    let eps = etcd_or_skip!("a_watch_stream_that_stops_answering_is_replaced");
    // The stream the waiter's first watch is created on; its requests swallowed once
    // stalled. The session is longer than the 5 s a watch's `created` answer is waited
    // for, so a wait retries.
    let first = FirstWatchStream::default();
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(10));
    let (proxy, waiter) = through(&eps, first.rule(Side::Client), opts).await;
    let holder = connect(&eps).await;

    // Behind a held lock (released after half a second), a wait is woken by the release.
    let wait_behind = |name: &'static str| {
        let (waiter, holder) = (waiter.clone(), holder.clone());
        async move {
            let q = QueuePath::root(unique_name(name));
            let (_, held, _) = enqueue(&holder, &q, EntryKind::Lock).await;
            let (_, mine, queue) = enqueue(&waiter, &q, EntryKind::Lock).await;
            let Decision::Wait(ahead) = decide(&queue, &mine.name) else {
                panic!("a second contender did not wait");
            };
            let ahead = ahead.clone();
            let wait = tokio::spawn({
                let (waiter, q) = (waiter.clone(), q.clone());
                async move { waiter.wait_gone(&q, &ahead).await }
            });
            tokio::time::sleep(Duration::from_millis(500)).await;
            holder.remove(&q, &held).await.expect("release");
            let woken = timeout(SOON, wait).await;
            waiter.remove(&q, &mine).await.expect("release");
            assert!(matches!(woken, Ok(Ok(Ok(_)))), "{name}: {woken:?}");
        }
    };
    wait_behind("stream-ok").await;
    assert!(first.created(), "no watch was created");
    assert_eq!(waiter.watch_streams_opened(), 1);

    first.stall();
    wait_behind("stream-stalled").await;
    assert!(
        proxy.swallowed() > 0,
        "nothing was swallowed: the stream never stalled"
    );
    assert_eq!(
        waiter.watch_streams_opened(),
        2,
        "the stalled stream was not replaced"
    );
    waiter.close().await.expect("close");
    holder.close().await.expect("close");
}

/// A watch that stops delivering (the server's frames for its stream lost on the way,
/// the connection and the stream still open) cannot strand a waiter, nor the waiters
/// queued behind it: once per session TTL the waiter re-reads, finds its predecessor
/// gone and stops waiting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiter_whose_watch_goes_deaf_is_woken_by_its_periodic_re_read() {
    init_tracing();
    let eps = etcd_or_skip!("a_waiter_whose_watch_goes_deaf_is_woken_by_its_periodic_re_read");
    // The stream the waiter's watch is created on; once deaf, its events are swallowed.
    let first = FirstWatchStream::default();
    let ttl = Duration::from_secs(3);
    let opts = SessionOptions::default().with_session_timeout(ttl);
    let (proxy, waiter) = through(&eps, first.rule(Side::Server), opts).await;
    let holder = connect(&eps).await;
    let q = QueuePath::root(unique_name("deaf-watch"));
    let (_, held, _) = enqueue(&holder, &q, EntryKind::Lock).await;
    let (_, mine, queue) = enqueue(&waiter, &q, EntryKind::Lock).await;
    let Decision::Wait(ahead) = decide(&queue, &mine.name) else {
        panic!("a second contender did not wait");
    };
    let ahead = ahead.clone();
    let wait = tokio::spawn({
        let (waiter, q) = (waiter.clone(), q.clone());
        async move { waiter.wait_gone(&q, &ahead).await }
    });
    // Let the watch be created and its `created` answer through, then go deaf.
    let created_by = Instant::now() + SOON;
    while !first.created() {
        assert!(Instant::now() < created_by, "no watch was created");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    first.stall();
    holder.remove(&q, &held).await.expect("release");
    let released = Instant::now();
    let woken = timeout(SOON, wait).await;
    let after = released.elapsed();
    assert!(matches!(woken, Ok(Ok(Ok(_)))), "{woken:?}");
    assert!(
        proxy.swallowed() > 0,
        "the release's event was not swallowed: the watch never went deaf"
    );
    assert!(
        after <= ttl + Duration::from_secs(2),
        "woken {after:?} after the release, more than a TTL of {ttl:?}"
    );
    waiter.remove(&q, &mine).await.expect("release");
    waiter.close().await.expect("close");
    holder.close().await.expect("close");
}

/// A `FrameDrop` rule that, once armed with some bytes, holds back the first client
/// DATA frame containing them (a request delayed in the network, past the client's
/// timeout), drops the rest of that request's stream (the client's reset when it gives
/// up, lost as packets would be, so the server still serves the request when it comes),
/// and notes when the server answers it.
#[derive(Clone, Default)]
struct DelayOne {
    target: Arc<std::sync::Mutex<Vec<u8>>>,
    stream: Arc<AtomicU64>,
    answered: Arc<AtomicBool>,
}

impl DelayOne {
    fn arm(&self, bytes: &[u8]) {
        *self.target.lock().expect("target") = bytes.to_vec();
    }

    fn disarm(&self) {
        self.target.lock().expect("target").clear();
    }

    fn rule(&self) -> impl Fn(&Frame<'_>) -> Action + Send + Sync + 'static {
        let me = self.clone();
        move |f| {
            let held = me.stream.load(Ordering::SeqCst);
            let on_held = held != 0 && u64::from(f.stream) == held;
            match f.from {
                Side::Server => {
                    if on_held && f.kind == DATA {
                        me.answered.store(true, Ordering::SeqCst);
                    }
                    Action::Pass
                }
                Side::Client if on_held => {
                    if f.kind == DATA {
                        Action::Hold
                    } else {
                        Action::Swallow
                    }
                }
                Side::Client => {
                    let t = me.target.lock().map(|t| t.clone()).unwrap_or_default();
                    if held == 0
                        && f.kind == DATA
                        && !t.is_empty()
                        && f.payload.windows(t.len()).any(|w| w == t.as_slice())
                    {
                        me.stream.store(f.stream.into(), Ordering::SeqCst);
                        Action::Hold
                    } else {
                        Action::Pass
                    }
                }
            }
        }
    }

    /// Waits until the server has answered the held request (after its release).
    async fn answered(&self) {
        let by = Instant::now() + SOON;
        while !self.answered.load(Ordering::SeqCst) {
            assert!(Instant::now() < by, "the late request was never answered");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A release whose plain delete goes unanswered leaves its mutex key retired for the
/// session: that delete may still reach the server, late, and must then find nothing of
/// a later hold to delete (etcd's mutex key is the same for every hold of a name by one
/// lease). Staged: the proxy holds the release's delete back; the release completes
/// another way; the client takes the lock again; then the held delete reaches the
/// server, which answers it. The second hold is still there, and the lock still held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_release_delete_cannot_remove_a_later_hold() {
    init_tracing();
    let eps = etcd_or_skip!("a_late_release_delete_cannot_remove_a_later_hold");
    let delay = DelayOne::default();
    let (proxy, a) = through(&eps, delay.rule(), SessionOptions::default()).await;
    let b = connect(&eps).await;
    let q = QueuePath::root(unique_name("late-delete"));

    let (_, first, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    assert!(matches!(decide(&queue, &first.name), Decision::Acquired));
    delay.arm(first.name.as_bytes());
    a.remove(&q, &first)
        .await
        .expect("the release completes another way");
    delay.disarm();
    assert!(proxy.held() > 0, "the release's delete was not held back");
    assert!(
        !b.contains(&q, &first).await.expect("contains"),
        "the first hold is still there"
    );

    let (_, second, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    assert!(matches!(decide(&queue, &second.name), Decision::Acquired));
    proxy.release_held();
    delay.answered().await;
    assert!(
        b.contains(&q, &second).await.expect("contains"),
        "the late delete of {} removed the later hold {}",
        first.name,
        second.name
    );
    let (_, other, queue) = enqueue(&b, &q, EntryKind::Lock).await;
    assert!(
        matches!(decide(&queue, &other.name), Decision::Wait(_)),
        "another client got the lock while it was held"
    );
    b.remove(&q, &other).await.expect("release");
    a.remove(&q, &second).await.expect("release");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// An enqueue whose first attempt goes unanswered is retried; if that attempt reaches
/// the server after the entry was granted and released, its put-if-absent creates the
/// entry again, under the client's live lease, where nobody holds or releases it. The
/// client's sweep of the released key takes that copy back, and another contender gets
/// the lock. Staged: the proxy holds the enqueue's first attempt back past its retry,
/// and lets it through after the release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_enqueue_copy_after_the_release_is_taken_back() {
    init_tracing();
    let eps = etcd_or_skip!("a_late_enqueue_copy_after_the_release_is_taken_back");
    let delay = DelayOne::default();
    let (proxy, a) = through(&eps, delay.rule(), SessionOptions::default()).await;
    let b = connect(&eps).await;
    let name = unique_name("late-enqueue");
    let q = QueuePath::root(name.clone());

    delay.arm(name.as_str().as_bytes());
    let (_, mine, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    delay.disarm();
    assert!(
        proxy.held() > 0,
        "the enqueue's first attempt was not held back"
    );
    assert!(matches!(decide(&queue, &mine.name), Decision::Acquired));
    a.remove(&q, &mine).await.expect("release");
    proxy.release_held();
    delay.answered().await;

    let by = Instant::now() + SOON;
    loop {
        let (_, other, queue) = enqueue(&b, &q, EntryKind::Lock).await;
        let got = matches!(decide(&queue, &other.name), Decision::Acquired);
        b.remove(&q, &other).await.expect("release");
        if got {
            break;
        }
        assert!(
            Instant::now() < by,
            "the late copy of {} still blocks the lock: {queue:?}",
            mine.name
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    a.close().await.expect("close");
    b.close().await.expect("close");
}

#[tokio::test]
async fn entries_are_etcds_mutex_keys_and_a_retry_is_idempotent() {
    let eps = etcd_or_skip!("entries_are_etcds_mutex_keys_and_a_retry_is_idempotent");
    init_tracing();
    let (a, b) = (connect(&eps).await, connect(&eps).await);
    let q = QueuePath::root(unique_name("order"));

    let (_, a1, q1) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(
        a1.name,
        format!("{:x}", a.lease_id()),
        "etcd's own mutex key"
    );
    assert_eq!(q1, vec![a1.clone()]);
    assert_eq!(a1.token.map(|t| t.get()), Some(a1.seq));
    let (_, b1, q2) = enqueue(&b, &q, EntryKind::Lock).await;
    assert_eq!(q2[1], b1);

    // A second contender of client `a` on the same name gets its own key, behind `b`.
    let (t3, a2, q3) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_ne!(a2.name, a1.name);
    assert!(a2.name.starts_with(&format!("{:x}-", a.lease_id())));
    assert_eq!(
        q3.iter().map(|e| &e.name).collect::<Vec<_>>(),
        vec![&a1.name, &b1.name, &a2.name]
    );
    assert_eq!(decide(&q3, &a2.name), Decision::Wait(&q3[1]));

    // Retrying an enqueue with the same ticket finds the same entry: idempotent.
    let again = a
        .enqueue(&q, &t3, EntryKind::Lock, Position::Tail, b"test")
        .await
        .expect("retried enqueue");
    assert_eq!(again.mine, a2);
    assert_eq!(again.queue.len(), 3);
    a.close().await.expect("close a");
    b.close().await.expect("close b");
}

/// Enqueues dropped after one poll and then abandoned free the client's claim on its
/// mutex key: the next mutex entry is etcd's own key again, and no key is left.
#[tokio::test]
async fn abandoned_drops_free_the_clients_mutex_key() {
    let eps = etcd_or_skip!("abandoned_drops_free_the_clients_mutex_key");
    init_tracing();
    let a = connect(&eps).await;
    let mut c = raw(&eps).await;
    let name = unique_name("abandon");
    let q = QueuePath::root(name.clone());
    for _ in 0..20 {
        let t = dlock_testkit::ticket();
        let enqueue = a.enqueue(&q, &t, EntryKind::Lock, Position::Tail, b"x");
        let _ = futures::FutureExt::now_or_never(enqueue);
        a.abandon(&q, &t).await.expect("abandon");
    }
    assert!(keys_under(&mut c, &format!("{name}/")).await.is_empty());
    let (_, e, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(e.name, format!("{:x}", a.lease_id()));
    a.close().await.expect("close");
    assert!(keys_under(&mut c, &format!("{name}/")).await.is_empty());
}

/// The same key created again is a different entry: waiting on the old one returns.
#[tokio::test]
async fn an_older_entry_under_a_reused_key_counts_as_gone() {
    let eps = etcd_or_skip!("an_older_entry_under_a_reused_key_counts_as_gone");
    init_tracing();
    let (a, b) = (connect(&eps).await, connect(&eps).await);
    let q = QueuePath::root(unique_name("reused"));
    let (_, a1, _) = enqueue(&a, &q, EntryKind::Lock).await;
    a.remove(&q, &a1).await.expect("release a");
    let (_, a2, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(a2.name, a1.name);
    assert_ne!(a2.token, a1.token);
    timeout(SOON, b.wait_gone(&q, &a1))
        .await
        .expect("an older entry under a reused key counts as gone")
        .expect("ok");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A downgrade's read is named `-r` beside its writer's `-w` key and carries its own
/// create revision as its token (above a writer queued later); a write `Beside` is
/// refused as a deadlock.
#[tokio::test]
async fn beside_read_has_its_own_revision_and_a_beside_write_would_deadlock() {
    let eps = etcd_or_skip!("beside_read_has_its_own_revision_and_a_beside_write_would_deadlock");
    init_tracing();
    let (a, b) = (connect(&eps).await, connect(&eps).await);
    let root = QueuePath::root(unique_name("rw"));
    let (_, w, _) = enqueue(&a, &root, EntryKind::Write).await;
    assert!(w.name.ends_with("-w"));
    let (_, w2, _) = enqueue(&b, &root, EntryKind::Write).await;
    let down = a
        .enqueue(
            &root,
            &dlock_testkit::ticket(),
            EntryKind::Read,
            Position::Beside(&w),
            b"",
        )
        .await
        .expect("enqueue beside");
    assert!(
        down.mine.token > w2.token,
        "the token is still its own revision"
    );
    assert!(matches!(
        a.enqueue(
            &root,
            &dlock_testkit::ticket(),
            EntryKind::Write,
            Position::Beside(&w),
            b""
        )
        .await,
        Err(Error::WouldDeadlock(_))
    ));
    a.close().await.expect("close");
    b.close().await.expect("close");
}

#[tokio::test]
async fn etcdctl_lock_holder_keeps_dlock_waiting() {
    let eps = etcd_or_skip!("etcdctl_lock_holder_keeps_dlock_waiting");
    init_tracing();
    let a = connect(&eps).await;
    let mut c = raw(&eps).await;
    let name = unique_name("ctl-holds");
    let q = QueuePath::root(name.clone());
    let prefix = format!("{name}/");

    let mut ctl = etcdctl(&eps)
        .args(["lock", name.as_str(), "sleep", "2"])
        .stdout(Stdio::null())
        .spawn()
        .expect("spawn etcdctl");
    let deadline = Instant::now() + SOON;
    let ctl_key = loop {
        if let Some((k, _)) = keys_under(&mut c, &prefix).await.into_iter().next() {
            break k;
        }
        assert!(Instant::now() < deadline, "etcdctl never created its key");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };

    let (_, mine, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    let blocker = match decide(&queue, &mine.name) {
        Decision::Wait(e) => e.clone(),
        other => panic!("dlock must queue behind etcdctl, got {other:?}"),
    };
    assert_eq!(format!("{prefix}{}", blocker.name), ctl_key);
    timeout(SOON, a.wait_gone(&q, &blocker))
        .await
        .expect("etcdctl releases")
        .expect("wait_gone");
    let status = timeout(SOON, ctl.wait())
        .await
        .expect("etcdctl exits")
        .expect("wait");
    assert!(status.success(), "etcdctl lock failed: {status}");
    let queue = a.queue(&q).await.expect("queue");
    assert_eq!(decide(&queue, &mine.name), Decision::Acquired);
    a.remove(&q, &mine).await.expect("remove");
    a.close().await.expect("close");
}

#[tokio::test]
async fn dlock_holder_keeps_etcdctl_lock_waiting() {
    let eps = etcd_or_skip!("dlock_holder_keeps_etcdctl_lock_waiting");
    init_tracing();
    let a = connect(&eps).await;
    let mut c = raw(&eps).await;
    let name = unique_name("dlock-holds");
    let q = QueuePath::root(name.clone());
    let prefix = format!("{name}/");
    let (_, mine, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(decide(&queue, &mine.name), Decision::Acquired);

    // etcdctl without a command prints the key once it holds the lock.
    let ctl = etcdctl(&eps)
        .args(["lock", "--ttl=2", name.as_str()])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn etcdctl");
    // It must really contend: its waiter key shows up behind ours.
    let deadline = Instant::now() + SOON;
    while keys_under(&mut c, &prefix).await.len() < 2 {
        assert!(Instant::now() < deadline, "etcdctl never queued");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut ctl = ctl;
    ctl.start_kill().expect("stop etcdctl");
    let out = ctl.wait_with_output().await.expect("etcdctl output");
    let printed = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        !printed.contains(&prefix),
        "etcdctl got the lock while dlock held it: {printed:?}"
    );

    // Control: once dlock releases, etcdctl does get the lock and prints its key.
    a.remove(&q, &mine).await.expect("release");
    let out = etcdctl(&eps)
        .args(["lock", "--ttl=2", name.as_str(), "echo", "held"])
        .output();
    let out = timeout(SOON, out)
        .await
        .expect("etcdctl finishes")
        .expect("run etcdctl");
    assert!(out.status.success(), "etcdctl lock after release: {out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("held"));
    a.close().await.expect("close");
}

#[tokio::test]
async fn keepalive_holds_and_revoked_lease_fires_lost() {
    let eps = etcd_or_skip!("keepalive_holds_and_revoked_lease_fires_lost");
    init_tracing();
    // Short enough to see several renewals, long enough that a loaded machine's scheduling
    // delays (renewals go out every TTL/3) do not lose it.
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(3));
    let a = EtcdBackend::connect(&eps, opts).await.expect("connect");
    let mut c = raw(&eps).await;
    let name = unique_name("lost");
    let q = QueuePath::root(name.clone());
    let (_, mine, _) = enqueue(&a, &q, EntryKind::Lock).await;
    let lost = a.lost(&q, &mine);
    let lost = tokio::spawn(lost);

    // Well past two TTLs the keep-alive has kept the entry.
    tokio::time::sleep(a.session_timeout() * 2 + Duration::from_secs(1)).await;
    assert!(
        !lost.is_finished(),
        "lost fired while the lease was renewed"
    );
    assert_eq!(keys_under(&mut c, &format!("{name}/")).await.len(), 1);

    let old_lease = a.lease_id();
    c.lease_revoke(old_lease)
        .await
        .expect("revoke from another client");
    let err = timeout(SOON, lost)
        .await
        .expect("lost fires")
        .expect("task");
    assert!(matches!(err, Error::LockLost(_)), "got {err:?}");
    assert!(keys_under(&mut c, &format!("{name}/")).await.is_empty());

    // The client grants a new lease for the next acquire.
    let (_, again, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_ne!(a.lease_id(), old_lease);
    assert_eq!(decide(&queue, &again.name), Decision::Acquired);
    let still = tokio::spawn(a.lost(&q, &again));
    // An entry of the old session answers lost at once; the new one is held.
    let old = timeout(SOON, a.lost(&q, &mine))
        .await
        .expect("old session is lost");
    assert!(old.is_lost(), "got {old:?}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!still.is_finished());

    a.close().await.expect("close");
    let err = timeout(SOON, still)
        .await
        .expect("close ends the session")
        .expect("task");
    assert!(matches!(err, Error::Closed), "got {err:?}");
    assert!(
        keys_under(&mut c, &format!("{name}/")).await.is_empty(),
        "close revokes the lease"
    );
    assert!(matches!(
        a.enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b""
        )
        .await,
        Err(Error::Closed)
    ));
    a.close().await.expect("close is idempotent");
}

#[tokio::test]
async fn unreachable_endpoints_and_bad_input() {
    init_tracing();
    let opts = SessionOptions::default().with_connect_timeout(Duration::from_secs(1));
    let dead = vec!["127.0.0.1:1".to_owned()];
    match EtcdBackend::connect(&dead, opts.clone()).await {
        Err(Error::Unreachable(msg)) => assert!(msg.contains("127.0.0.1:1"), "{msg}"),
        other => panic!("expected Unreachable, got {other:?}"),
    }
    assert!(matches!(
        EtcdBackend::connect(&[], opts.clone()).await,
        Err(Error::InvalidUrl { .. })
    ));
    match EtcdBackend::connect(&["http://[::1".to_owned()], opts).await {
        Err(Error::InvalidUrl { .. } | Error::Unreachable(_)) => {}
        other => panic!("expected a typed error for a malformed endpoint, got {other:?}"),
    }
}

#[tokio::test]
async fn a_dead_endpoint_in_the_list_is_skipped() {
    let mut eps = etcd_or_skip!("a_dead_endpoint_in_the_list_is_skipped");
    init_tracing();
    eps.insert(0, "127.0.0.1:1".to_owned());
    let a = connect(&eps).await;
    let q = QueuePath::root(unique_name("failover"));
    for _ in 0..10 {
        let (_, e, queue) = enqueue(&a, &q, EntryKind::Lock).await;
        assert_eq!(decide(&queue, &e.name), Decision::Acquired);
        a.remove(&q, &e).await.expect("remove");
    }
    a.close().await.expect("close");
}

/// W2 of the baselines: 8 workers, each with its own client, on one lock name, for 3 s.
/// Run in release to compare with etcd's own lock (81 handoffs/s on this machine):
/// `cargo test --release -p dlock-etcd --test etcd handoff_rate -- --nocapture`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_rate() {
    let eps = etcd_or_skip!("handoff_rate");
    init_tracing();
    const WORKERS: usize = 8;
    let q = QueuePath::root(unique_name("handoff"));
    let mut clients = Vec::new();
    for _ in 0..WORKERS {
        clients.push(connect(&eps).await);
    }
    let holder = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let counter = Arc::new(AtomicU64::new(0));
    let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS));
    let mut tasks = Vec::new();
    for b in clients.clone() {
        let (q, holder, violations, counter, barrier) = (
            q.clone(),
            holder.clone(),
            violations.clone(),
            counter.clone(),
            barrier.clone(),
        );
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let start = Instant::now();
            let end = start + Duration::from_secs(3);
            let mut ops = 0u64;
            let mut waits = Vec::new();
            while Instant::now() < end {
                let t0 = Instant::now();
                let (_, mine, mut queue) = enqueue(&b, &q, EntryKind::Lock).await;
                loop {
                    let blocker = match decide(&queue, &mine.name) {
                        Decision::Acquired => break,
                        Decision::Wait(e) => e.clone(),
                        Decision::Missing => panic!("entry vanished"),
                    };
                    b.wait_gone(&q, &blocker).await.expect("wait_gone");
                    queue = b.queue(&q).await.expect("queue");
                }
                waits.push(t0.elapsed());
                if holder.swap(true, Ordering::SeqCst) {
                    violations.fetch_add(1, Ordering::SeqCst);
                }
                let v = counter.load(Ordering::SeqCst);
                counter.store(v + 1, Ordering::SeqCst);
                holder.store(false, Ordering::SeqCst);
                b.remove(&q, &mine).await.expect("release");
                ops += 1;
            }
            (start, Instant::now(), ops, waits)
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("worker"));
    }
    let first = results.iter().map(|r| r.0).min().expect("workers");
    let last = results.iter().map(|r| r.1).max().expect("workers");
    let total: u64 = results.iter().map(|r| r.2).sum();
    let mut waits: Vec<Duration> = results.iter().flat_map(|r| r.3.clone()).collect();
    waits.sort();
    let pct = |p: f64| waits[((waits.len() as f64 * p) as usize).min(waits.len() - 1)];
    let per: Vec<u64> = results.iter().map(|r| r.2).collect();
    let secs = (last - first).as_secs_f64();
    eprintln!(
        "handoff_rate: {total} handoffs in {secs:.2} s = {:.0}/s (etcd's own lock: ~81/s); \
         wait p50 {:?} p99 {:?}; per worker {per:?}; violations {}",
        total as f64 / secs,
        pct(0.5),
        pct(0.99),
        violations.load(Ordering::SeqCst)
    );
    assert_eq!(violations.load(Ordering::SeqCst), 0, "two holders at once");
    assert_eq!(
        counter.load(Ordering::SeqCst),
        total,
        "lost updates in the critical section"
    );
    assert!(total > 0);
    for c in clients {
        c.close().await.expect("close");
    }
}

/// The baseline for [`handoff_rate`], measured under the same conditions: etcd's own lock
/// (the server's v3lock RPC, i.e. Go's `concurrency.Mutex`), 8 clients with a lease each,
/// lock → unlock on one name for 3 s. Only a measurement: dlock itself never calls this
/// RPC (a cancelled call leaves a ghost waiter).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn handoff_rate_of_etcds_own_lock() {
    let eps = etcd_or_skip!("handoff_rate_of_etcds_own_lock");
    const WORKERS: usize = 8;
    let name = unique_name("v3lock");
    let barrier = Arc::new(tokio::sync::Barrier::new(WORKERS));
    let mut tasks = Vec::new();
    for _ in 0..WORKERS {
        let mut c = raw(&eps).await;
        let lease = c.lease_grant(60, None).await.expect("lease").id();
        let (name, barrier) = (name.to_string(), barrier.clone());
        tasks.push(tokio::spawn(async move {
            barrier.wait().await;
            let start = Instant::now();
            let end = start + Duration::from_secs(3);
            let mut ops = 0u64;
            while Instant::now() < end {
                let opts = etcd_client::LockOptions::new().with_lease(lease);
                let held = c.lock(name.as_str(), Some(opts)).await.expect("lock");
                c.unlock(held.key()).await.expect("unlock");
                ops += 1;
            }
            c.lease_revoke(lease).await.expect("revoke");
            (start, Instant::now(), ops)
        }));
    }
    let mut results = Vec::new();
    for t in tasks {
        results.push(t.await.expect("worker"));
    }
    let first = results.iter().map(|r| r.0).min().expect("workers");
    let last = results.iter().map(|r| r.1).max().expect("workers");
    let total: u64 = results.iter().map(|r| r.2).sum();
    let secs = (last - first).as_secs_f64();
    eprintln!(
        "handoff_rate_of_etcds_own_lock: {total} handoffs in {secs:.2} s = {:.0}/s",
        total as f64 / secs
    );
    assert!(total > 0);
}

#[tokio::test]
async fn a_late_second_release_never_deletes_the_next_entry_under_the_key() {
    let eps = etcd_or_skip!("a_late_second_release_never_deletes_the_next_entry_under_the_key");
    init_tracing();
    let a = connect(&eps).await;
    let mut c = raw(&eps).await;
    let name = unique_name("late-release");
    let q = QueuePath::root(name.clone());
    let prefix = format!("{name}/");
    let (_, e1, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(e1.name, format!("{:x}", a.lease_id()));
    a.remove(&q, &e1).await.expect("release e1");
    assert!(keys_under(&mut c, &prefix).await.is_empty());
    // The key is free again, so the next contender of this client takes it anew.
    let (_, e2, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(e2.name, e1.name);
    let t2 = e2.token.expect("token").get();
    assert!(t2 > e1.token.expect("token").get());
    // Releasing e1 a second time (a late retry) must leave e2 in place.
    a.remove(&q, &e1).await.expect("second release of e1");
    let left = keys_under(&mut c, &prefix).await;
    assert_eq!(
        left,
        vec![(
            format!("{prefix}{}", e2.name),
            i64::try_from(t2).expect("revision")
        )]
    );
    // Two releases of one entry at once (a guard's release and its drop's background
    // retry) both succeed, and the key is free again afterwards.
    let (r1, r2) = tokio::join!(a.remove(&q, &e2), a.remove(&q, &e2));
    r1.expect("release e2");
    r2.expect("release e2 again, concurrently");
    assert!(keys_under(&mut c, &prefix).await.is_empty());
    let (_, e3, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(e3.name, e1.name);
    a.remove(&q, &e3).await.expect("release e3");
    assert!(keys_under(&mut c, &prefix).await.is_empty());
    // An abandoned enqueue (a cancelled acquire) whose delete was answered frees the key
    // too; a second abandon of the same ticket is a no-op.
    let (t4, e4, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(e4.name, e1.name);
    a.abandon(&q, &t4).await.expect("abandon");
    a.abandon(&q, &t4).await.expect("abandon again");
    assert!(keys_under(&mut c, &prefix).await.is_empty());
    let (_, e5, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(e5.name, e1.name, "the abandoned key is free again");
    a.remove(&q, &e5).await.expect("release e5");
    assert!(keys_under(&mut c, &prefix).await.is_empty());
    a.close().await.expect("close");
}

#[tokio::test]
async fn contenders_of_one_client_exclude_each_other_in_order() {
    let eps = etcd_or_skip!("contenders_of_one_client_exclude_each_other_in_order");
    init_tracing();
    let a = connect(&eps).await;
    let b = connect(&eps).await;
    let q = QueuePath::root(unique_name("local"));
    let (_, a1, q1) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(decide(&q1, &a1.name), Decision::Acquired);
    // A second task of the same client does not share a1's key, so it does not hold.
    let (_, a2, q2) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(decide(&q2, &a2.name), Decision::Wait(&a1));
    let (_, b1, _) = enqueue(&b, &q, EntryKind::Lock).await;

    a.remove(&q, &a1).await.expect("release a1");
    timeout(SOON, a.wait_gone(&q, &a1))
        .await
        .expect("gone")
        .expect("ok");
    let now = a.queue(&q).await.expect("queue");
    assert_eq!(decide(&now, &a2.name), Decision::Acquired);
    assert_eq!(decide(&now, &b1.name), Decision::Wait(&a2));

    // etcd's key is free again: the next local contender takes it, behind b1.
    let (_, a3, q3) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(a3.name, format!("{:x}", a.lease_id()));
    assert_eq!(decide(&q3, &a3.name), Decision::Wait(&b1));
    for (c, e) in [(&a, &a2), (&b, &b1), (&a, &a3)] {
        c.remove(&q, e).await.expect("remove");
    }
    a.close().await.expect("close");
    b.close().await.expect("close");
}

#[tokio::test]
async fn dropping_the_client_revokes_its_lease() {
    let eps = etcd_or_skip!("dropping_the_client_revokes_its_lease");
    init_tracing();
    let mut c = raw(&eps).await;
    let name = unique_name("drop");
    let q = QueuePath::root(name.clone());
    let a = connect(&eps).await;
    let (_, _mine, _) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(a.session_timeout(), dlock_etcd::DEFAULT_SESSION_TTL);
    drop(a);
    // Well before the 60 s TTL could expire it.
    let deadline = Instant::now() + SOON;
    while !keys_under(&mut c, &format!("{name}/")).await.is_empty() {
        assert!(
            Instant::now() < deadline,
            "the dropped client's key is still there"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn an_orphan_under_the_clients_mutex_key_is_cleared() {
    let eps = etcd_or_skip!("an_orphan_under_the_clients_mutex_key_is_cleared");
    init_tracing();
    let a = connect(&eps).await;
    let mut c = raw(&eps).await;
    let name = unique_name("orphan");
    let q = QueuePath::root(name.clone());
    // A key on a's lease that none of a's contenders owns (say, a release that never
    // reached the server, its retries given up).
    let key = format!("{name}/{:x}", a.lease_id());
    let put = etcd_client::PutOptions::new().with_lease(a.lease_id());
    c.put(key.clone(), "", Some(put)).await.expect("raw put");
    let (_, mine, queue) = enqueue(&a, &q, EntryKind::Lock).await;
    assert_eq!(format!("{name}/{}", mine.name), key);
    assert_eq!(
        queue,
        vec![mine.clone()],
        "the orphan is gone, mine took its key"
    );
    assert_eq!(decide(&queue, &mine.name), Decision::Acquired);
    a.remove(&q, &mine).await.expect("remove");
    a.close().await.expect("close");
}

/// Hundreds of waiters queued at once on one client: every enqueue is answered (requests
/// beyond the in-flight limit wait for a slot before their time budget starts), every
/// wait shares the client's one watch stream, and the lock is handed down the queue in
/// order, one holder at a time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_waiters_on_one_client_share_one_watch_stream() {
    let eps = etcd_or_skip!("many_waiters_on_one_client_share_one_watch_stream");
    init_tracing();
    const WAITERS: usize = 300;
    let holder_client = connect(&eps).await;
    let waiters = connect(&eps).await;
    let q = QueuePath::root(unique_name("many"));
    let (_, held, first) = enqueue(&holder_client, &q, EntryKind::Lock).await;
    assert_eq!(decide(&first, &held.name), Decision::Acquired);

    let inside = Arc::new(AtomicBool::new(false));
    let violations = Arc::new(AtomicU64::new(0));
    let order = Arc::new(parking_lot::Mutex::new(Vec::new()));
    let queued = Arc::new(AtomicU64::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..WAITERS {
        let (b, q, inside, violations, order, queued) = (
            waiters.clone(),
            q.clone(),
            inside.clone(),
            violations.clone(),
            order.clone(),
            queued.clone(),
        );
        tasks.spawn(async move {
            let (_, mine, mut queue) = enqueue(&b, &q, EntryKind::Lock).await;
            queued.fetch_add(1, Ordering::SeqCst);
            loop {
                let blocker = match decide(&queue, &mine.name) {
                    Decision::Acquired => break,
                    Decision::Wait(e) => e.clone(),
                    Decision::Missing => panic!("entry {} vanished", mine.name),
                };
                b.wait_gone(&q, &blocker).await.expect("wait_gone");
                queue = b.queue(&q).await.expect("queue");
            }
            if inside.swap(true, Ordering::SeqCst) {
                violations.fetch_add(1, Ordering::SeqCst);
            }
            order.lock().push(mine.seq);
            inside.store(false, Ordering::SeqCst);
            b.remove(&q, &mine).await.expect("release");
        });
    }
    let deadline = Instant::now() + Duration::from_secs(120);
    while queued.load(Ordering::SeqCst) < WAITERS as u64 {
        assert!(
            Instant::now() < deadline,
            "only {} of {WAITERS} enqueues answered",
            queued.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    holder_client
        .remove(&q, &held)
        .await
        .expect("holder release");
    while let Some(r) = timeout(Duration::from_secs(120), tasks.join_next())
        .await
        .expect("the queue drains")
    {
        r.expect("waiter task");
    }
    let streams = waiters.watch_streams_opened();
    let order = order.lock().clone();
    assert_eq!(violations.load(Ordering::SeqCst), 0, "two holders at once");
    assert_eq!(order.len(), WAITERS);
    assert!(
        order.windows(2).all(|w| w[0] < w[1]),
        "granted out of queue order: {order:?}"
    );
    // One stream for the waiters' client (a re-open after a broken stream is allowed);
    // a stream per wait would be hundreds.
    assert!(
        streams <= 3,
        "{streams} watch streams opened for {WAITERS} waits"
    );
    holder_client.close().await.expect("close");
    waiters.close().await.expect("close");
}

/// On a short queue `wait_gone_detail` says [`dlock_core::Gone::Head`] for a holder's
/// release, so the next waiter takes the lock without listing the queue; on a queue
/// longer than it watches whole, it knows nothing of how the entry went. (The contract's
/// `wait_gone_detail_says_head_only_for_a_head_removal` checks the cases it must not
/// say it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_at_the_head_of_a_short_queue_says_head() {
    use dlock_core::Gone;
    let eps = etcd_or_skip!("a_release_at_the_head_of_a_short_queue_says_head");
    init_tracing();
    let a = connect(&eps).await;
    let b = connect(&eps).await;
    let q = QueuePath::root(unique_name("gone-head"));
    // Waits on `gone` from b, removes it from a once the wait had time to arm.
    let answer = |gone: Entry| {
        let (a, b, q) = (a.clone(), b.clone(), q.clone());
        async move {
            let waiter = {
                let (b, q, gone) = (b.clone(), q.clone(), gone.clone());
                tokio::spawn(async move { b.wait_gone_detail(&q, &gone).await })
            };
            tokio::time::sleep(Duration::from_millis(300)).await;
            a.remove(&q, &gone).await.expect("remove");
            timeout(SOON, waiter)
                .await
                .expect("the wait ends")
                .expect("join")
                .expect("wait_gone_detail")
        }
    };
    // The holder's release, with one waiter behind: the wait was armed in time at least
    // once in five (a slow arm reads it gone, and says Unknown).
    let mut heads = 0;
    for _ in 0..5 {
        let (_, holder, _) = enqueue(&a, &q, EntryKind::Lock).await;
        let (_, next, _) = enqueue(&a, &q, EntryKind::Lock).await;
        if answer(holder).await == Gone::Head {
            heads += 1;
        }
        a.remove(&q, &next).await.expect("remove");
    }
    assert!(heads > 0, "a release at the head said Head");

    // Nine keys: longer than a queue is watched whole. The head's release is then
    // reported as a plain delete.
    let mut queued = Vec::new();
    for _ in 0..9 {
        queued.push(enqueue(&a, &q, EntryKind::Lock).await.1);
    }
    assert_eq!(answer(queued[0].clone()).await, Gone::Unknown);
    for e in &queued[1..] {
        a.remove(&q, e).await.expect("remove");
    }
}

/// A client's mutex waits on one short queue share one watch, kept armed between them
/// (a watch armed per wait is often started unsynced by etcd 3.4, and its delete then
/// comes late): consecutive waits arm one watch, not one each, still answer `Head` for
/// a head's release, and a wait joining the kept watch after its entry went, its delete
/// already passed on, still returns at once. A few seconds after the last wait the watch
/// is let go, and the next wait arms another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_on_one_queue_share_a_kept_watch() {
    use dlock_core::Gone;
    let eps = etcd_or_skip!("waits_on_one_queue_share_a_kept_watch");
    init_tracing();
    let a = connect(&eps).await;
    let b = connect(&eps).await;
    let q = QueuePath::root(unique_name("kept-watch"));
    // The holder's release with one waiter behind, the wait given time to arm; the next
    // entry goes too.
    let handoff = || {
        let (a, b, q) = (a.clone(), b.clone(), q.clone());
        async move {
            let (_, holder, _) = enqueue(&a, &q, EntryKind::Lock).await;
            let (_, next, _) = enqueue(&a, &q, EntryKind::Lock).await;
            let waiter = {
                let (b, q, holder) = (b.clone(), q.clone(), holder.clone());
                tokio::spawn(async move { b.wait_gone_detail(&q, &holder).await })
            };
            // Time for the wait's read (a wait that reads after the removal says
            // Unknown): a second, for a busy machine.
            tokio::time::sleep(Duration::from_millis(1_000)).await;
            assert!(
                !waiter.is_finished(),
                "the wait ended while its entry was there"
            );
            a.remove(&q, &holder).await.expect("remove");
            let gone = timeout(SOON, waiter)
                .await
                .expect("the wait ends once its entry goes")
                .expect("join")
                .expect("wait_gone_detail");
            a.remove(&q, &next).await.expect("remove");
            gone
        }
    };
    assert_eq!(
        handoff().await,
        Gone::Head,
        "the first wait (arms the watch)"
    );
    let armed = b.watches_armed();
    for i in 0..5 {
        assert_eq!(handoff().await, Gone::Head, "wait {i} on the kept watch");
    }
    // Gone before the wait, its delete already passed on by the kept watch.
    let (_, early, _) = enqueue(&a, &q, EntryKind::Lock).await;
    a.remove(&q, &early).await.expect("remove");
    tokio::time::sleep(Duration::from_millis(200)).await;
    let gone = timeout(SOON, b.wait_gone_detail(&q, &early))
        .await
        .expect("a wait on an entry already gone returns at once")
        .expect("wait_gone_detail");
    assert_eq!(
        gone,
        Gone::Unknown,
        "an entry gone before the wait is not said Head"
    );
    assert_eq!(
        b.watches_armed(),
        armed,
        "waits after the first armed watches of their own"
    );
    // Idle past the kept watch's linger (2 to 4 s, later if its idle checks are held up
    // on a loaded machine): the next wait arms again.
    tokio::time::sleep(Duration::from_millis(6_500)).await;
    assert_eq!(handoff().await, Gone::Head, "the wait after the linger");
    assert_eq!(
        b.watches_armed(),
        armed + 1,
        "the kept watch outlived its linger, or the wait after it armed more than one"
    );
}

/// A wait on the kept watch may take its queue listing from the waiting client's own
/// latest enqueue (which reads the queue anyway) instead of a read of its own, but only
/// a listing that shows the entry waited on and is not older than what the kept watch
/// already passed on. Three waits by a client that enqueues too: one on its predecessor
/// in that listing (pending, then `Head`), one on an entry queued after the listing (it
/// must stay pending: that listing does not show it, which would read as "gone"), and one
/// after an entry ahead was
/// deleted and its delete passed on before the wait (it must still say `Head`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_takes_its_listing_from_an_enqueue_only_when_it_may() {
    use dlock_core::Gone;
    let eps = etcd_or_skip!("a_wait_takes_its_listing_from_an_enqueue_only_when_it_may");
    init_tracing();
    let a = connect(&eps).await;
    let b = connect(&eps).await;
    let q = QueuePath::root(unique_name("enqueue-listing"));
    // Time for a spawned wait's read, kept under the kept watch's linger (2 s).
    let settle = || tokio::time::sleep(Duration::from_millis(500));
    let wait = |gone: Entry| {
        let (b, q) = (b.clone(), q.clone());
        tokio::spawn(async move { b.wait_gone_detail(&q, &gone).await })
    };
    let ended = |w: tokio::task::JoinHandle<dlock_core::Result<Gone>>| async move {
        timeout(SOON, w)
            .await
            .expect("the wait ends once its entry goes")
            .expect("join")
            .expect("wait_gone_detail")
    };
    // B's kept watch of the queue, armed by a first wait.
    let (_, h0, _) = enqueue(&a, &q, EntryKind::Lock).await;
    let w = wait(h0.clone());
    settle().await;
    a.remove(&q, &h0).await.expect("remove");
    assert_eq!(ended(w).await, Gone::Head, "h0 went as the head");

    // 1. B queues behind A's holder: B's enqueue listed [h1, b1].
    let (_, h1, _) = enqueue(&a, &q, EntryKind::Lock).await;
    let (_, b1, _) = enqueue(&b, &q, EntryKind::Lock).await;
    let w = wait(h1.clone());
    settle().await;
    assert!(!w.is_finished(), "the wait on h1 ended while h1 was there");
    a.remove(&q, &h1).await.expect("remove");
    assert_eq!(ended(w).await, Gone::Head, "h1 went as the head");

    // 2. An entry queued after B's latest enqueue (B's b2, after h1's delete, so recent
    // enough), that listing does not show it.
    let (_, b2, _) = enqueue(&b, &q, EntryKind::Lock).await;
    let (_, a2, _) = enqueue(&a, &q, EntryKind::Lock).await;
    settle().await;
    let w = wait(a2.clone());
    settle().await;
    assert!(
        !w.is_finished(),
        "the wait on a2 ended while a2 was there: {:?}",
        w.await
    );
    b.remove(&q, &b1).await.expect("remove");
    b.remove(&q, &b2).await.expect("remove");
    a.remove(&q, &a2).await.expect("remove");
    assert_eq!(ended(w).await, Gone::Head, "a2 went as the head");

    // 3. B's enqueue lists [x, p, b3]; x goes, its delete passed on by the kept watch
    // before the wait on p begins: a wait using that listing would still count x as
    // ahead of p, and could not say Head.
    let (_, x, _) = enqueue(&a, &q, EntryKind::Lock).await;
    let (_, p, _) = enqueue(&a, &q, EntryKind::Lock).await;
    let (_, b3, listed) = enqueue(&b, &q, EntryKind::Lock).await;
    assert_eq!(listed.len(), 3, "B's enqueue listed x, p and its own entry");
    a.remove(&q, &x).await.expect("remove");
    settle().await;
    let w = wait(p.clone());
    settle().await;
    assert!(!w.is_finished(), "the wait on p ended while p was there");
    a.remove(&q, &p).await.expect("remove");
    assert_eq!(
        ended(w).await,
        Gone::Head,
        "p went as the head, x long gone"
    );
    b.remove(&q, &b3).await.expect("remove");
}

/// The contract's mixed readers, writers, locks and downgrades, where a head removal
/// grants without a listing: exclusion holds, and on etcd some grants were made that way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn head_handoffs_grant_without_a_listing() {
    let eps = etcd_or_skip!("head_handoffs_grant_without_a_listing");
    init_tracing();
    let connect = dlock_testkit::contract::connect_fn(move |opts| {
        let eps = eps.clone();
        async move { EtcdBackend::connect(&eps, opts).await }
    });
    let heads = dlock_testkit::contract::tests::head_handoffs_keep_exclusion(connect).await;
    eprintln!("head handoffs: {heads} grants by a head removal");
    assert!(heads > 0, "some handoffs were granted by a head removal");
}
