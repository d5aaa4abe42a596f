//! A watch served by a member that lags behind what the client has already read must not
//! wake a waiter with events the read showed.
//!
//! dlock arms a watch "from now", then reads. "Now" is the revision of the member that
//! serves the watch; the read is floored at the newest revision the client has seen, so
//! a lagging member cannot answer it. A member that lags (a follower resumed after a
//! stall, or rejoining after a cut) answers a watch create at its old revision, then
//! catches up and sends every event since: puts and deletes the read already showed.
//! Taken as news, the put of a lease the semaphore waited behind looked like a lease
//! gone, and the delete of an older entry under a reused key looked like the awaited
//! entry gone; either lets a second holder in (`cargo xtask chaos`, follower-cut on
//! etcd: a semaphore-mutex overlap). Here the follower is stopped (SIGSTOP) while the
//! waits are armed on it, so it answers their creates the moment it resumes, before it
//! has caught up.
//!
//! Needs the 3-member etcd cluster of `cargo xtask integration` (`DLOCK_TEST_STATE`); a
//! test binary of its own, so the stopped member disturbs no other test.

use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Backend, Entry, EntryKind, LockName, Position, QueuePath, SessionOptions};
use dlock_etcd::EtcdBackend;
use dlock_testkit::{Backend as Server, State};
use tokio::time::{sleep, timeout};

/// Generous bound for anything that should happen "soon" on a loaded 2-core machine.
const SOON: Duration = Duration::from_secs(30);
/// Long enough that no session ends while a member is cut off.
const SESSION: Duration = Duration::from_secs(30);

/// The value of the gauge `name` on the etcd member serving clients at `addr`.
fn gauge(addr: &str, name: &str) -> u64 {
    let mut s = TcpStream::connect(addr).expect("connect to the member's /metrics");
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        s,
        "GET /metrics HTTP/1.0\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("ask /metrics");
    let mut text = String::new();
    s.read_to_string(&mut text).expect("read /metrics");
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map(|v| v as u64)
        .unwrap_or_else(|| panic!("{name} not in {addr}'s /metrics"))
}

fn watch_streams(addr: &str) -> u64 {
    gauge(addr, "etcd_debugging_mvcc_watch_stream_total")
}

fn watchers(addr: &str) -> u64 {
    gauge(addr, "etcd_debugging_mvcc_watcher_total")
}

fn queue(test: &str) -> QueuePath {
    let n = format!("dlock-test/{test}/{}", uuid::Uuid::new_v4().simple());
    QueuePath::root(LockName::new(&n, dlock_etcd::NAME_RULES).expect("valid test name"))
}

/// Adds an entry of `kind` to `q` under a fresh ticket.
async fn add(b: &EtcdBackend, q: &QueuePath, kind: EntryKind) -> Entry {
    b.enqueue(q, &dlock_testkit::ticket(), kind, Position::Tail, b"")
        .await
        .expect("enqueue")
        .mine
}

async fn connect(eps: &[String]) -> Arc<EtcdBackend> {
    EtcdBackend::connect(eps, SessionOptions::default().with_session_timeout(SESSION))
        .await
        .expect("connect to the test etcd")
}

/// A client on `follower` and `leader` whose watch stream is on the follower: clients are
/// made until one's stream lands there (the balancer picks an endpoint per stream).
async fn watching_on(follower: &str, leader: &str, scratch: &QueuePath) -> Arc<EtcdBackend> {
    let writer = connect(&[leader.to_owned()]).await;
    for _ in 0..24 {
        let before = watch_streams(follower);
        let b = connect(&[follower.to_owned(), leader.to_owned()]).await;
        // A wait on an entry already gone opens the client's stream, arms one watch and
        // returns (the stream stays open for the client's later watches).
        let gone = add(&writer, scratch, EntryKind::Lease).await;
        writer.remove(scratch, &gone).await.expect("remove");
        timeout(SOON, b.wait_gone(scratch, &gone))
            .await
            .expect("wait_gone of a removed entry returns")
            .expect("wait_gone");
        if watch_streams(follower) > before {
            writer.close().await.expect("close");
            return b;
        }
        b.close().await.expect("close");
    }
    panic!("no client's watch stream landed on the follower in 24 tries");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_members_watch_never_wakes_a_waiter_with_what_it_read() {
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    if state.servers_of(Server::Etcd).count() < 3 {
        eprintln!("SKIPPED: needs a 3-member etcd cluster");
        return;
    }
    let leader = tokio::task::block_in_place(|| state.wait_leader(Server::Etcd, SOON))
        .expect("an etcd leader");
    let follower = state
        .servers_of(Server::Etcd)
        .map(|s| s.id)
        .find(|id| *id != leader)
        .expect("a follower");
    let addr = |id| state.server(Server::Etcd, id).expect("member").addr.clone();
    let (l, f) = (addr(leader), addr(follower));

    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let a = connect(std::slice::from_ref(&l)).await;
    let b = watching_on(&f, &l, &queue("scratch")).await;

    // Before the stop, so the follower has it: an entry under A's mutex key for its name.
    let reused = queue("reused-key");
    let old = add(&a, &reused, EntryKind::Lock).await;

    let armed = watchers(&f);
    let stopped = Stopped::new(&state, follower);
    // While the follower is stopped: the old entry goes and a new one takes its key (A's
    // next contender on the name), and a lease is added to another queue.
    a.remove(&reused, &old).await.expect("remove the old entry");
    let new = add(&a, &reused, EntryKind::Lock).await;
    assert_eq!(new.name, old.name, "the new entry reuses the old one's key");
    assert_ne!(new.token, old.token);
    let leases = queue("leases");
    let lease = add(&a, &leases, EntryKind::Lease).await;
    // B learns of both from the leader (a linearizable read, retried past the stopped
    // follower), so its reads are floored past the follower's revision.
    assert!(from_the_leader(&b, &reused, &new).await);
    assert!(from_the_leader(&b, &leases, &lease).await);
    // B waits for the new entry to go, and for the lease queue to change from what it
    // read. Both watch creates wait on the stopped follower's stream.
    let gone = tokio::spawn({
        let (b, q, e) = (b.clone(), reused.clone(), new.clone());
        async move { b.wait_gone(&q, &e).await }
    });
    let changed = tokio::spawn({
        let (b, q, seen) = (b.clone(), leases.clone(), vec![lease.clone()]);
        async move { b.wait_changed(&q, &seen).await }
    });
    sleep(Duration::from_millis(500)).await;
    // Resumed, the follower answers the creates at once, at the revision it stopped at,
    // and catches up with the leader a few fsyncs later: then it sends both watches the
    // events since, which B's reads (floored past them) already showed.
    drop(stopped);
    // Both watches are on the follower (unless a wait already returned, which the checks
    // below report).
    let mut on_follower = watchers(&f);
    for _ in 0..40 {
        if on_follower >= armed + 2 || gone.is_finished() || changed.is_finished() {
            break;
        }
        sleep(Duration::from_millis(50)).await;
        on_follower = watchers(&f);
    }
    assert!(
        on_follower >= armed + 2 || gone.is_finished() || changed.is_finished(),
        "B's watches are not on the follower ({on_follower} there, {armed} before): the test would not test what it says"
    );
    sleep(Duration::from_secs(3)).await;
    assert!(
        !gone.is_finished(),
        "wait_gone returned on the replayed delete of the older entry under the same key: {:?}",
        gone.await
    );
    assert!(
        !changed.is_finished(),
        "wait_changed returned on the replayed put of a lease it had already read: {:?}",
        changed.await
    );

    // What they wait for wakes them.
    a.remove(&reused, &new).await.expect("remove");
    timeout(SOON, gone)
        .await
        .expect("wait_gone returns once the entry goes")
        .expect("task")
        .expect("wait_gone");
    a.remove(&leases, &lease).await.expect("remove");
    timeout(SOON, changed)
        .await
        .expect("wait_changed returns once the queue changes")
        .expect("task")
        .expect("wait_changed");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// `contains`, asked until an answer comes: each try that the balancer sends to the
/// stopped follower times out.
async fn from_the_leader(b: &EtcdBackend, q: &QueuePath, e: &Entry) -> bool {
    for _ in 0..10 {
        match b.contains(q, e).await {
            Ok(found) => return found,
            Err(err) => eprintln!("contains: {err}; asking again"),
        }
    }
    panic!("no answer to contains in 10 tries");
}

/// An etcd member stopped (SIGSTOP) until this is dropped, so a failing assertion never
/// leaves it stopped for the tests after this one.
struct Stopped<'a> {
    state: &'a State,
    id: u32,
}

impl<'a> Stopped<'a> {
    fn new(state: &'a State, id: u32) -> Self {
        tokio::task::block_in_place(|| state.stop(Server::Etcd, id)).expect("SIGSTOP the follower");
        Stopped { state, id }
    }
}

impl Drop for Stopped<'_> {
    fn drop(&mut self) {
        tokio::task::block_in_place(|| self.state.cont(Server::Etcd, self.id))
            .expect("SIGCONT the follower");
    }
}
