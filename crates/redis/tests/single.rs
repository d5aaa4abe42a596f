//! Integration tests against one real Redis master (`DLOCK_TEST_REDIS=host:port`), plus
//! fault tests on private redis-server processes this test starts and kills itself (they
//! run when `DLOCK_TEST_REDIS` is set, so that one switch turns on every Redis test).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use dlock_core::{decide, Backend, Decision, EntryKind, Error, Position, SessionOptions};
use dlock_redis::RedisBackend;
use dlock_testkit::contract::gone::{xorshift, Occupancy};
use futures::FutureExt;

const LONG: Duration = Duration::from_secs(30);

// The contract every backend keeps (order, FIFO, tokens, beside, abandon, close,
// sub-queues, unsupported capabilities) is dlock-testkit's contract suite, instantiated
// in tests/contract.rs for this master, Redlock and Sentinel. The tests below check what
// only Redis has: keys, the watchdog, pub/sub wake-ups, restarts.

#[tokio::test]
async fn a_removal_wakes_only_its_watcher() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "a_removal_wakes_only_its_watcher") else {
        return;
    };
    let b = connect(&addr, LONG).await;
    let q = fresh_queue("herd");
    let mut entries = Vec::new();
    for _ in 0..21 {
        let e = enqueue_lock(&b, &q).await.expect("enqueue");
        entries.push(e.mine);
    }
    let woken = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 1..21 {
        let (b, q, watched, woken) = (b.clone(), q.clone(), entries[i - 1].clone(), woken.clone());
        tasks.push(tokio::spawn(async move {
            b.wait_gone(&q, &watched).await.expect("wait_gone");
            woken.fetch_add(1, Ordering::SeqCst);
        }));
    }
    // Every waiter is subscribed once each of the 20 channels is.
    assert!(
        eventually(Duration::from_secs(20), || async {
            b.stats().subscribes >= 20
        })
        .await,
        "20 subscriptions"
    );
    let before = b.stats();
    b.remove(&q, &entries[0]).await.expect("remove the head");
    assert!(
        eventually(Duration::from_secs(20), || async {
            woken.load(Ordering::SeqCst) >= 1
        })
        .await,
        "the head's watcher wakes"
    );
    // Give any wrongly woken waiter several re-check periods to show up.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let after = b.stats();
    eprintln!(
        "herd test: woken={} messages={} subscribes={}",
        woken.load(Ordering::SeqCst),
        after.messages - before.messages,
        after.subscribes
    );
    assert_eq!(woken.load(Ordering::SeqCst), 1, "exactly one waiter woke");
    assert_eq!(after.messages - before.messages, 1, "one message delivered");
    assert!(tasks[0].is_finished());
    assert!(tasks[1..].iter().all(|t| !t.is_finished()));
    for t in tasks {
        t.abort();
    }
    b.close().await.expect("close");
}

#[tokio::test]
async fn watchdog_keeps_an_entry_alive_past_its_lease() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "watchdog_keeps_an_entry_alive") else {
        return;
    };
    let b = connect(&addr, Duration::from_secs(1)).await;
    let insp = inspector(&addr).await;
    let q = fresh_queue("watchdog");
    let e = enqueue_lock(&b, &q).await.expect("enqueue").mine;
    let lost = b.lost(&q, &e);
    tokio::time::sleep(Duration::from_millis(3500)).await;
    // The lock's only entry is its one key (the queue's): see `solo_entry_*` below.
    let key = format!("dlock:{{{}}}:q", q.lock);
    assert!(
        key_exists(&insp, &key).await,
        "entry alive after 3.5 leases"
    );
    let pttl: i64 = fred::prelude::KeysInterface::pttl(&insp, &key)
        .await
        .expect("pttl");
    assert!(pttl > 0 && pttl <= 1000, "lease re-armed, pttl={pttl}");
    assert!(
        lost.now_or_never().is_none(),
        "lost() must not fire while held"
    );
    assert!(b.stats().renewals >= 3, "renewed: {:?}", b.stats());
    // Release stops the renewal: the entry is gone and stays gone.
    b.remove(&q, &e).await.expect("remove");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert!(!key_exists(&insp, &key).await, "no renewal after release");
    let lost_after = b.lost(&q, &e).await;
    assert!(matches!(lost_after, Error::LockLost(_)), "{lost_after:?}");
    b.close().await.expect("close");
}

/// The child half of `a_killed_client_s_entry_expires`: holds an entry until killed.
#[tokio::test]
async fn child_holder() {
    let (Ok(addr), Ok(lock)) = (
        std::env::var("DLOCK_REDIS_CHILD_ADDR"),
        std::env::var("DLOCK_REDIS_CHILD_LOCK"),
    ) else {
        return; // Only meaningful when spawned by the parent test.
    };
    let b = connect(&addr, Duration::from_secs(1)).await;
    let q = dlock_core::QueuePath::root(
        dlock_core::LockName::new(&lock, dlock_redis::NAME_RULES).expect("name"),
    );
    let e = b
        .enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"child",
        )
        .await
        .expect("child enqueues");
    println!("DLOCK_ENTRY={}", e.mine.name);
    tokio::time::sleep(Duration::from_secs(120)).await;
}

#[tokio::test]
async fn a_killed_client_s_entry_expires() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "a_killed_client_s_entry_expires") else {
        return;
    };
    use std::io::BufRead;
    let q = fresh_queue("crash");
    let mut child = std::process::Command::new(std::env::current_exe().expect("test exe"))
        .args(["--exact", "child_holder", "--nocapture", "--test-threads=1"])
        .env("DLOCK_REDIS_CHILD_ADDR", &addr)
        .env("DLOCK_REDIS_CHILD_LOCK", q.lock.as_str())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn child");
    let stdout = child.stdout.take().expect("child stdout");
    let name = tokio::task::spawn_blocking(move || {
        std::io::BufReader::new(stdout)
            .lines()
            .map_while(Result::ok)
            .find_map(|l| {
                l.split_once("DLOCK_ENTRY=")
                    .map(|(_, n)| n.trim().to_owned())
            })
    })
    .await
    .expect("join")
    .expect("child printed its entry");
    let observer = connect(&addr, LONG).await;
    // The child's watchdog keeps it alive past its 1 s lease...
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let listed = observer.queue(&q).await.expect("queue");
    assert!(
        listed.iter().any(|e| e.name == name),
        "alive while the child runs"
    );
    // ...until the process dies without a word.
    child.kill().expect("SIGKILL the child");
    let _ = child.wait();
    assert!(
        eventually(Duration::from_secs(15), || async {
            observer
                .queue(&q)
                .await
                .map(|l| l.is_empty())
                .unwrap_or(false)
        })
        .await,
        "the dead client's entry expired"
    );
    let insp = inspector(&addr).await;
    let left = scan_keys(
        &insp,
        &format!("dlock:{{{}}}*", glob_escape(q.lock.as_str())),
    )
    .await;
    assert!(left.is_empty(), "keys left: {left:?}");
    observer.close().await.expect("close");
}

/// Beyond the contract's empty queue: no key of the lock (entries, counters, channels'
/// bookkeeping) is left, and the watchdog has nothing left to renew.
#[tokio::test]
async fn abandoned_enqueues_leave_no_keys_and_nothing_to_renew() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "dropped_enqueues_then_abandon") else {
        return;
    };
    let b = connect(&addr, LONG).await;
    let insp = inspector(&addr).await;
    let q = fresh_queue("dropped");
    let mut completed = 0;
    for i in 0..200 {
        let t = dlock_testkit::ticket();
        {
            let mut fut = std::pin::pin!(b.enqueue(&q, &t, EntryKind::Lock, Position::Tail, b"x"));
            // Drop after 0, 1 or a few polls: before sending, in flight, or done.
            for _ in 0..(i % 4) {
                if futures::poll!(fut.as_mut()).is_ready() {
                    completed += 1;
                    break;
                }
                tokio::task::yield_now().await;
            }
        }
        b.abandon(&q, &t).await.expect("abandon");
    }
    let left = scan_keys(
        &insp,
        &format!("dlock:{{{}}}*", glob_escape(q.lock.as_str())),
    )
    .await;
    eprintln!(
        "dropped enqueues: {completed} of 200 completed before the drop; keys left: {}",
        left.len()
    );
    assert!(left.is_empty(), "keys left: {left:?}");
    assert_eq!(b.stats().live, 0, "nothing left to renew");
    b.close().await.expect("close");
}

#[tokio::test]
async fn bad_input_gets_typed_errors() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "bad_input_gets_typed_errors") else {
        return;
    };
    for bad in ["nohost", "h:0", "h:99999", ":6379", "a/b:1"] {
        let e = RedisBackend::connect(bad, SessionOptions::default())
            .await
            .expect_err(bad);
        assert!(matches!(e, Error::InvalidUrl { .. }), "{bad}: {e:?}");
    }
    let e = RedisBackend::connect(&addr, opts(Duration::from_millis(10)))
        .await
        .expect_err("tiny lease");
    assert!(matches!(e, Error::InvalidUrl { .. }), "{e:?}");
    let e = RedisBackend::connect("redis://x:1", SessionOptions::default())
        .await
        .expect_err("an address, not a URL");
    assert!(matches!(e, Error::InvalidUrl { .. }), "{e:?}");
    // A closed port: Unreachable within the connect timeout, not a hang.
    let free = std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port();
    let e = tokio::time::timeout(
        Duration::from_secs(30),
        RedisBackend::connect(
            &format!("127.0.0.1:{free}"),
            SessionOptions::default().with_connect_timeout(Duration::from_secs(1)),
        ),
    )
    .await
    .expect("connect gives up")
    .expect_err("nobody listens");
    assert!(matches!(e, Error::Unreachable(_)), "{e:?}");
    // After close every call is Closed.
    let b = RedisBackend::connect(&addr, opts(LONG))
        .await
        .expect("connect");
    let q = fresh_queue("closed");
    let e = enqueue_lock(&b, &q).await.expect("enqueue").mine;
    let lost = b.lost(&q, &e);
    b.close().await.expect("close");
    b.close().await.expect("close is idempotent");
    assert!(matches!(lost.await, Error::Closed));
    let err = b.queue(&q).await.expect_err("closed");
    assert!(matches!(err, Error::Closed), "{err:?}");
}

#[tokio::test]
async fn a_restart_without_persistence_fires_lost() {
    init_tracing();
    if endpoint(
        "DLOCK_TEST_REDIS",
        "a_restart_without_persistence_fires_lost",
    )
    .is_none()
    {
        return;
    }
    let mut server = TestServer::start();
    let b = connect(&server.addr(), Duration::from_secs(3)).await;
    let q = fresh_queue("restart");
    let e = enqueue_lock(&b, &q).await.expect("enqueue").mine;
    let lost = b.lost(&q, &e);
    server.kill();
    server.restart();
    let reason = tokio::time::timeout(Duration::from_secs(30), lost)
        .await
        .expect("lost() fires after the restart");
    eprintln!("restart: lost() said: {reason}");
    assert!(matches!(reason, Error::LockLost(_)), "{reason:?}");
    // The backend works again on the restarted server.
    let again = enqueue_lock(&b, &q).await.expect("enqueue after restart");
    assert_eq!(decide(&again.queue, &again.mine.name), Decision::Acquired);
    assert!(
        again.mine.token > e.token,
        "token kept growing across the restart"
    );
    b.close().await.expect("close");
}

#[tokio::test]
async fn dropping_the_backend_stops_renewal_and_removes_its_entries() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "dropping_the_backend") else {
        return;
    };
    let insp = inspector(&addr).await;
    let q = fresh_queue("drop");
    let b = connect(&addr, Duration::from_secs(1)).await;
    let e = enqueue_lock(&b, &q).await.expect("enqueue").mine;
    let lost = b.lost(&q, &e);
    drop(b);
    assert!(matches!(lost.await, Error::Closed));
    let pattern = format!("dlock:{{{}}}*", glob_escape(q.lock.as_str()));
    assert!(
        eventually(Duration::from_secs(10), || async {
            scan_keys(&insp, &pattern).await.is_empty()
        })
        .await,
        "dropping the backend removed its keys"
    );
    // And nothing renews or re-creates them afterwards.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(scan_keys(&insp, &pattern).await.is_empty());
}

#[tokio::test]
async fn a_silent_client_s_entry_expires_and_wakes_its_watcher() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "a_silent_client_s_entry_expires") else {
        return;
    };
    let q = fresh_queue("silent");
    let dead = connect(&addr, Duration::from_secs(1)).await;
    let e = enqueue_lock(&dead, &q).await.expect("enqueue").mine;
    let waiter = connect(&addr, LONG).await;
    let w = enqueue_lock(&waiter, &q).await.expect("enqueue");
    assert!(matches!(decide(&w.queue, &w.mine.name), Decision::Wait(x) if x.name == e.name));
    // The watchdog dies without removing anything, as in a crash.
    dead.simulate_crash();
    tokio::time::timeout(Duration::from_secs(20), waiter.wait_gone(&q, &e))
        .await
        .expect("the expired entry's watcher wakes (re-check timer)")
        .expect("wait_gone");
    let now = waiter.queue(&q).await.expect("queue");
    assert_eq!(decide(&now, &w.mine.name), Decision::Acquired);
    waiter.close().await.expect("close");
}

#[tokio::test]
async fn a_stalled_server_fires_lost_after_one_lease() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDIS", "a_stalled_server_fires_lost").is_none() {
        return;
    }
    let server = TestServer::start();
    let b = connect(&server.addr(), Duration::from_secs(1)).await;
    let q = fresh_queue("stall");
    let e = enqueue_lock(&b, &q).await.expect("enqueue").mine;
    let lost = b.lost(&q, &e);
    assert!(b.lost_now(&q, &e).is_none(), "held: lost_now says nothing");
    let insp = inspector(&server.addr()).await;
    // The lock's only entry: its one key (the queue's).
    let key = format!("dlock:{{{}}}:q", q.lock);
    assert!(key_exists(&insp, &key).await, "the entry is there at first");
    server.signal("STOP");
    let reason = tokio::time::timeout(Duration::from_secs(30), lost)
        .await
        .expect("lost() fires while the server is stalled");
    server.signal("CONT");
    eprintln!("stall: lost() said: {reason}");
    assert!(
        matches!(&reason, Error::LockLost(r) if r.contains("no successful renewal")),
        "{reason:?}"
    );
    // Known lost from then on, without a lost future (the reason went with the entry's
    // registration; a lost future made now gives the same answer).
    let now = b.lost_now(&q, &e);
    assert!(matches!(&now, Some(Error::LockLost(_))), "{now:?}");
    let fresh = b.lost(&q, &e).now_or_never();
    assert_eq!(
        now.map(|e| e.to_string()),
        fresh.map(|e| e.to_string()),
        "lost_now answers as a lost future made now"
    );
    // The entry is not renewed after it was given up: it expires on the server.
    assert!(
        eventually(Duration::from_secs(10), || async {
            !key_exists(&insp, &key).await
        })
        .await,
        "the given-up entry is gone"
    );
    b.close().await.expect("close");
}

/// Waits for every worker, each within a generous bound, and fails on a worker's panic.
async fn join_workers(tasks: Vec<tokio::task::JoinHandle<()>>) {
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(600), t)
            .await
            .expect("workers finish")
            .expect("worker ok");
    }
}

/// Takes `kind` on `q` through the backend protocol (enqueue, watch the blocker the driver
/// names, re-list), as the recipes do.
async fn acquire_raw(
    b: &RedisBackend,
    q: &dlock_core::QueuePath,
    kind: EntryKind,
) -> dlock_core::Entry {
    let added = b
        .enqueue(q, &dlock_testkit::ticket(), kind, Position::Tail, b"")
        .await
        .expect("enqueue");
    let mine = added.mine;
    let mut queue = added.queue;
    loop {
        let blocker = match decide(&queue, &mine.name) {
            Decision::Acquired => return mine,
            Decision::Missing => panic!("entry {} vanished while waiting", mine.name),
            Decision::Wait(blocker) => blocker.clone(),
        };
        b.wait_gone(q, &blocker).await.expect("wait_gone");
        queue = b.queue(q).await.expect("queue");
    }
}

/// Regression (benchmark W5: p99 of about 1 s): readers and writers with short holds on
/// one read/write queue, each on its own client. Every wait must end by a message, never
/// by the re-check timer finding the entry already gone: fred's SUBSCRIBE resolves once
/// written, so without a round trip on the subscriber connection the existence check
/// could overtake the SUBSCRIBE and the removal's message was lost.
// Several runtime threads, as in an application: the subscriber's and the command
// client's writes then really race.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rwlock_waits_end_by_message_not_by_the_recheck_timer() {
    init_tracing();
    let Some(addr) = endpoint(
        "DLOCK_TEST_REDIS",
        "rwlock_waits_end_by_message_not_by_the_recheck_timer",
    ) else {
        return;
    };
    const WORKERS: u64 = 8;
    const ROUNDS: u64 = 300;
    let q = fresh_queue("rw-wakeups");
    let occupancy = Arc::new(Occupancy::default());
    let mut backends = Vec::new();
    for _ in 0..WORKERS {
        backends.push(connect(&addr, LONG).await);
    }
    let mut tasks = Vec::new();
    for (i, b) in backends.iter().enumerate() {
        let (b, q, occupancy) = (b.clone(), q.clone(), occupancy.clone());
        tasks.push(tokio::spawn(async move {
            let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ (i as u64 + 1);
            for _ in 0..ROUNDS {
                let kind = if xorshift(&mut x) % 100 < 25 {
                    EntryKind::Write
                } else {
                    EntryKind::Read
                };
                let mine = acquire_raw(&b, &q, kind).await;
                occupancy.enter(kind);
                tokio::task::yield_now().await;
                occupancy.leave(kind);
                b.remove(&q, &mine).await.expect("remove");
            }
        }));
    }
    join_workers(tasks).await;
    let (mut messages, mut rechecks, mut missed) = (0, 0, 0);
    for b in &backends {
        let s = b.stats();
        messages += s.messages;
        rechecks += s.timer_rechecks;
        missed += s.missed_wakeups;
        b.close().await.expect("close");
    }
    eprintln!(
        "rw wake-ups: {} acquires, messages={messages} timer_rechecks={rechecks} missed_wakeups={missed}",
        WORKERS * ROUNDS
    );
    assert_eq!(occupancy.violations(), 0, "rw exclusion");
    assert!(
        messages > 0,
        "the workers contended and were woken by messages"
    );
    assert_eq!(
        missed, 0,
        "waits the re-check timer had to rescue (a removal's message never arrived)"
    );
}

/// The listing-free handoff on a real server: the remove script says `removed head` only
/// when nothing else is queued at or ahead of the entry, and waiters granted on that
/// (readers, writers, write holders downgrading beside their write) never break
/// exclusion (the contract's `head_handoffs_keep_exclusion`). Here some grants are made
/// that way, and every wait still ends by a message.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn head_removals_grant_without_a_listing_and_keep_exclusion() {
    init_tracing();
    let Some(addr) = endpoint(
        "DLOCK_TEST_REDIS",
        "head_removals_grant_without_a_listing_and_keep_exclusion",
    ) else {
        return;
    };
    // Every session the contract opens, kept to read its wake-up counters afterwards.
    let opened: Arc<parking_lot::Mutex<Vec<Arc<RedisBackend>>>> = Arc::default();
    let connect = {
        let opened = opened.clone();
        dlock_testkit::contract::connect_fn(move |o| {
            let (addr, opened) = (addr.clone(), opened.clone());
            async move {
                let b = RedisBackend::connect(&addr, o).await?;
                opened.lock().push(b.clone());
                Ok(b)
            }
        })
    };
    let heads = dlock_testkit::contract::gone::head_handoffs_keep_exclusion(connect).await;
    let missed: u64 = opened.lock().iter().map(|b| b.stats().missed_wakeups).sum();
    eprintln!("head handoffs: {heads} granted by a head removal, missed_wakeups={missed}");
    assert!(heads > 0, "some handoffs were granted by a head removal");
    assert_eq!(missed, 0, "waits the re-check timer had to rescue");
}

/// `wait_gone_detail` says `Gone::Head` only for a head removal: not for a waiter
/// cancelled behind a holder, not for a write removed beside its downgrade read, not for
/// an entry already gone before the wait.
#[tokio::test]
async fn wait_gone_detail_reports_head_only_for_the_head() {
    use dlock_core::Gone;
    init_tracing();
    let Some(addr) = endpoint(
        "DLOCK_TEST_REDIS",
        "wait_gone_detail_reports_head_only_for_the_head",
    ) else {
        return;
    };
    let a = connect(&addr, LONG).await;
    let b = connect(&addr, LONG).await;
    let q = fresh_queue("gone-detail");
    let add = |kind, at| {
        let (a, q) = (a.clone(), q.clone());
        async move {
            a.enqueue(&q, &dlock_testkit::ticket(), kind, at, b"")
                .await
                .expect("enqueue")
                .mine
        }
    };
    // Removes `gone` once b's watch on it is subscribed; returns what b's wait said.
    let watch_then_remove = |gone: dlock_core::Entry| {
        let (a, b, q) = (a.clone(), b.clone(), q.clone());
        async move {
            let before = b.stats().subscribes;
            let (b2, q2, g2) = (b.clone(), q.clone(), gone.clone());
            let waiter = tokio::spawn(async move { b2.wait_gone_detail(&q2, &g2).await });
            assert!(
                eventually(Duration::from_secs(20), || {
                    let b = b.clone();
                    async move { b.stats().subscribes > before }
                })
                .await,
                "the watch subscribed"
            );
            a.remove(&q, &gone).await.expect("remove");
            tokio::time::timeout(Duration::from_secs(20), waiter)
                .await
                .expect("the watch ends")
                .expect("join")
                .expect("wait_gone_detail")
        }
    };
    let l1 = add(EntryKind::Lock, Position::Tail).await;
    let l2 = add(EntryKind::Lock, Position::Tail).await;
    let l3 = add(EntryKind::Lock, Position::Tail).await;
    // l2 cancelled while l1 holds: not the head.
    assert_eq!(watch_then_remove(l2.clone()).await, Gone::Unknown);
    // Already gone before the wait: never the head. (Unknown while the channel the last
    // wait heard l2's removal on is still subscribed; Vanished, so the waiter lists
    // again, once it is not.)
    assert_ne!(
        tokio::time::timeout(Duration::from_secs(20), b.wait_gone_detail(&q, &l2))
            .await
            .expect("returns at once")
            .expect("wait_gone_detail"),
        Gone::Head
    );
    // Never reported as head, whatever the timing, for the cases above; for the holder's
    // release the message may lose the race with the watch's existence check (then it
    // says Unknown), so it is tried a few times and must say Head at least once.
    let mut heads = 0;
    let mut holder = l1;
    let mut next = l3;
    for _ in 0..5 {
        if watch_then_remove(holder).await == Gone::Head {
            heads += 1;
        }
        holder = next;
        next = add(EntryKind::Lock, Position::Tail).await;
    }
    assert!(heads > 0, "a holder's release at the head said Head");
    a.remove(&q, &holder).await.expect("remove");
    a.remove(&q, &next).await.expect("remove");

    // A write holder downgrades: the read beside it shares its sequence, so removing the
    // write is not a head removal (a writer queued behind must list again and wait for
    // the read); removing the read afterwards is.
    let mut heads = 0;
    for _ in 0..5 {
        let w = add(EntryKind::Write, Position::Tail).await;
        let r = a
            .enqueue(
                &q,
                &dlock_testkit::ticket(),
                EntryKind::Read,
                Position::Beside(&w),
                b"",
            )
            .await
            .expect("downgrade")
            .mine;
        let waiting = add(EntryKind::Write, Position::Tail).await;
        assert_eq!(watch_then_remove(w).await, Gone::Unknown);
        if watch_then_remove(r).await == Gone::Head {
            heads += 1;
        }
        a.remove(&q, &waiting).await.expect("remove");
    }
    assert!(heads > 0, "the downgrade read alone at the head said Head");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A finished wait's channel is unsubscribed (in a batch, shortly after), and one that
/// is still waited on is not: the server keeps no subscription per past wait.
#[tokio::test]
async fn finished_waits_leave_no_subscription_behind() {
    use fred::prelude::ClientLike;
    init_tracing();
    let Some(addr) = endpoint(
        "DLOCK_TEST_REDIS",
        "finished_waits_leave_no_subscription_behind",
    ) else {
        return;
    };
    let a = connect(&addr, LONG).await;
    let b = connect(&addr, LONG).await;
    let inspect = inspector(&addr).await;
    let q = fresh_queue("unsubscribed");
    let pattern = format!("dlock:{{{}}}:*", glob_escape(q.lock.as_str()));
    let channels = || {
        let (inspect, pattern) = (inspect.clone(), pattern.clone());
        async move {
            let v: Vec<String> = inspect
                .custom(fred::cmd!("PUBSUB"), vec!["CHANNELS".to_owned(), pattern])
                .await
                .expect("pubsub channels");
            v
        }
    };
    for _ in 0..30 {
        let e = enqueue_lock(&a, &q).await.expect("enqueue").mine;
        let before = b.stats().subscribes;
        let waiter = spawn_wait_gone(&b, &q, &e);
        assert!(
            eventually(LONG, || async { b.stats().subscribes > before }).await,
            "the waiter subscribed"
        );
        a.remove(&q, &e).await.expect("remove");
        woken(waiter, LONG, "the wait ends").await;
        // The waiter has no entry of its own and the watched entry was its queue's
        // only one: its removal must still be published, or the wait ends by the timer.
        assert_eq!(
            b.stats().missed_wakeups,
            0,
            "the wait ended by the removal message"
        );
    }
    // One wait still under way keeps its channel.
    let held = enqueue_lock(&a, &q).await.expect("enqueue").mine;
    let waiter = spawn_wait_gone(&b, &q, &held);
    assert!(
        eventually(LONG, || async { channels().await.len() == 1 }).await,
        "only the live wait's channel stays subscribed: {:?}",
        channels().await
    );
    assert!(!waiter.is_finished());
    a.remove(&q, &held).await.expect("remove");
    woken(waiter, LONG, "the wait ends").await;
    assert!(
        eventually(LONG, || async { channels().await.is_empty() }).await,
        "no channel left subscribed: {:?}",
        channels().await
    );
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// The uncontended fast path keeps a lock's only entry as one string at the queue's key;
/// a second entry, or a client that watches it with no entry of its own, moves it into
/// the queue layout first. Checks both layouts on the server, and that nothing a holder,
/// a waiter or an observer relies on changes across the move: the holder's name,
/// sequence and token; FIFO; `contains`; `wait_gone` of a solo entry by a client that
/// never queued (it moves the entry, must wait, then wakes by message, since a solo
/// entry's release publishes nothing); the holder's release after the move
/// (`RELEASE_SOLO` says "queued" and `REMOVE` runs); and no key left once both are gone.
#[tokio::test]
async fn solo_entry_moves_into_the_queue_when_a_second_arrives() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "solo_entry_moves_into_the_queue") else {
        return;
    };
    let a = connect(&addr, LONG).await;
    let b = connect(&addr, LONG).await;
    let observer = connect(&addr, LONG).await;
    let insp = inspector(&addr).await;
    let q = fresh_queue("solo");
    let qkey = format!("dlock:{{{}}}:q", q.lock);
    let kind = |k: String| {
        let insp = insp.clone();
        async move {
            let t: String = fred::prelude::KeysInterface::r#type(&insp, k)
                .await
                .expect("TYPE");
            t
        }
    };
    let enqueue = |c: Arc<RedisBackend>, data: &'static [u8]| {
        let q = q.clone();
        async move {
            c.enqueue(
                &q,
                &dlock_testkit::ticket(),
                EntryKind::Lock,
                Position::Tail,
                data,
            )
            .await
            .expect("enqueue")
        }
    };

    // 1. Alone: one string key, `<name> <token> <data>`, and no entry key.
    let first = enqueue(a.clone(), b"first data").await;
    assert_eq!(decide(&first.queue, &first.mine.name), Decision::Acquired);
    assert_eq!(kind(qkey.clone()).await, "string");
    let token = first.mine.token.expect("a token").get();
    assert_eq!(first.mine.seq, token, "the sequence is the token");
    let v: String = fred::prelude::KeysInterface::get(&insp, &qkey)
        .await
        .expect("GET");
    assert_eq!(v, format!("{} {token} first data", first.mine.name));
    let entry_key = format!("dlock:{{{}}}:e:{}", q.lock, first.mine.name);
    assert!(!key_exists(&insp, &entry_key).await, "no entry key yet");
    let listed = a.participants(&q).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(listed[0].name, first.mine.name);
    assert_eq!(listed[0].token, first.mine.token);
    assert_eq!(listed[0].data, b"first data");
    assert!(a.contains(&q, &first.mine).await.expect("contains"));
    // A watch of the solo entry's data (`wait_data_changed`) moves it into the
    // queue layout, unchanged, and waits: the entry lives and its data is the same.
    // Spawned, and the move waited for, not timed: the watch subscribes twice before
    // it moves the entry, which a busy machine may take longer than any fixed window.
    let data_watch = {
        let (a, q, e) = (a.clone(), q.clone(), first.mine.clone());
        tokio::spawn(async move { a.wait_data_changed(&q, &e, b"first data").await })
    };
    assert!(
        eventually(LONG, || async { kind(qkey.clone()).await == "zset" }).await,
        "the data watch moved it"
    );
    // Let a watch that wrongly answers now (the data is unchanged) do so before looking.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(
        !data_watch.is_finished(),
        "the data watch returned: {:?}",
        data_watch.await
    );
    data_watch.abort();
    assert!(a.contains(&q, &first.mine).await.expect("contains"));

    // 2. A second entry queues behind it.
    let second = enqueue(b.clone(), b"").await;
    let Decision::Wait(ahead) = decide(&second.queue, &second.mine.name) else {
        panic!("the second waits: {:?}", second.queue);
    };
    assert_eq!(ahead.name, first.mine.name);
    assert_eq!(ahead.seq, first.mine.seq);
    assert!(
        second.mine.token > first.mine.token,
        "tokens grow across the move"
    );
    assert_eq!(kind(qkey.clone()).await, "zset");
    let v: String = fred::prelude::KeysInterface::get(&insp, &entry_key)
        .await
        .expect("GET entry");
    assert!(
        v.starts_with(&format!("{token} ")) && v.ends_with(" first data"),
        "the moved entry keeps its token and data: {v}"
    );
    let listed = b.participants(&q).await.expect("list");
    let names: Vec<&str> = listed.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(names, [first.mine.name.as_str(), second.mine.name.as_str()]);
    assert_eq!(listed[0].token, first.mine.token);
    assert!(a
        .contains(&q, &first.mine)
        .await
        .expect("contains after the move"));

    // 3. A client that never queued watches the moved entry: it must not return while
    //    the entry is there.
    let watched = spawn_wait_gone(&observer, &q, &first.mine);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !watched.is_finished(),
        "wait_gone returned while the entry lives"
    );

    // 4. The holder releases after the move: the waiter and the observer wake.
    let waiter = spawn_wait_gone(&b, &q, &first.mine);
    a.remove(&q, &first.mine).await.expect("release");
    woken(waiter, Duration::from_secs(5), "the waiter wakes").await;
    woken(watched, Duration::from_secs(5), "the observer wakes").await;
    let now = b.queue(&q).await.expect("list");
    assert_eq!(decide(&now, &second.mine.name), Decision::Acquired);
    b.remove(&q, &second.mine).await.expect("release");
    // `b` found the lock contended a moment ago: its next enqueue skips the fast path
    // (which would likely fail) and takes the queue layout, alone; the one after that,
    // having found the lock free, takes the fast path again.
    let again = enqueue(b.clone(), b"").await;
    assert_eq!(kind(qkey.clone()).await, "zset");
    b.remove(&q, &again.mine).await.expect("release");
    let solo_again = enqueue(b.clone(), b"").await;
    assert_eq!(kind(qkey.clone()).await, "string");
    assert!(solo_again.mine.token > again.mine.token);
    // A second arrival moves a solo entry into the queue layout, unchanged, ahead of it.
    let behind = enqueue(a.clone(), b"").await;
    assert_eq!(kind(qkey.clone()).await, "zset");
    let Decision::Wait(ahead) = decide(&behind.queue, &behind.mine.name) else {
        panic!("the second waits: {:?}", behind.queue);
    };
    assert_eq!(
        (&ahead.name, ahead.seq),
        (&solo_again.mine.name, solo_again.mine.seq)
    );
    assert!(behind.mine.token > solo_again.mine.token);
    b.remove(&q, &solo_again.mine).await.expect("release");
    a.remove(&q, &behind.mine).await.expect("release");

    // 5. A client that never queued watches a solo entry: its watch moves the entry
    //    into the queue layout (the release of a solo entry publishes nothing), waits
    //    while the entry lives, and the holder's release wakes it by message.
    // (`b`: `a` found the lock contended just now, so it would skip the fast path.)
    let third = enqueue(b.clone(), b"third").await;
    assert_eq!(kind(qkey.clone()).await, "string");
    assert!(third.mine.token > solo_again.mine.token);
    let before = observer.stats();
    let watched = spawn_wait_gone(&observer, &q, &third.mine);
    assert!(
        eventually(Duration::from_secs(5), || async {
            kind(qkey.clone()).await == "zset"
        })
        .await,
        "the watch moved the solo entry into the queue layout"
    );
    let third_key = format!("dlock:{{{}}}:e:{}", q.lock, third.mine.name);
    let v: String = fred::prelude::KeysInterface::get(&insp, &third_key)
        .await
        .expect("GET entry");
    let third_token = third.mine.token.expect("a token").get();
    assert!(
        v.starts_with(&format!("{third_token} ")) && v.ends_with(" third"),
        "the moved entry keeps its token and data: {v}"
    );
    let listed = a.participants(&q).await.expect("list");
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (&listed[0].name, listed[0].token),
        (&third.mine.name, third.mine.token)
    );
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!watched.is_finished());
    b.remove(&q, &third.mine).await.expect("release");
    woken(watched, Duration::from_secs(5), "the observer wakes").await;
    assert!(
        observer.stats().messages > before.messages,
        "woken by the message"
    );
    let left = scan_keys(
        &insp,
        &format!("dlock:{{{}}}*", glob_escape(q.lock.as_str())),
    )
    .await;
    assert!(left.is_empty(), "keys left behind: {left:?}");
    for c in [a, b, observer] {
        c.close().await.expect("close");
    }
}

/// A leader's proclaim (`Backend::proclaim`) rewrites its entry's value in place and keeps
/// its lease (the key's TTL, its token); a `wait_data_changed` on it is woken by the
/// script's message, not by its re-check timer. An entry queued behind the head and a
/// removed entry are refused with `LockLost`, and nothing is written: the waiting
/// entry's value stays, and no key comes back for the removed one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proclaim_keeps_the_lease_and_wakes_its_watcher_by_message() {
    init_tracing();
    let Some(addr) = endpoint(
        "DLOCK_TEST_REDIS",
        "proclaim_keeps_the_lease_and_wakes_its_watcher_by_message",
    ) else {
        return;
    };
    let b = connect(&addr, Duration::from_secs(10)).await;
    let watcher = connect(&addr, Duration::from_secs(10)).await;
    let keys = inspector(&addr).await;
    let q = fresh_queue("proclaim");
    let add = |data: &'static [u8]| {
        let (b, q) = (b.clone(), q.clone());
        async move {
            b.enqueue(
                &q,
                &dlock_testkit::ticket(),
                EntryKind::Candidate,
                Position::Tail,
                data,
            )
            .await
            .expect("enqueue")
            .mine
        }
    };
    let leader = add(b"v1").await;
    let behind = add(b"w1").await;
    let key = |name: &str| format!("dlock:{{{}}}:e:{name}", q.lock.as_str());

    let before = watcher.stats();
    let waiting = {
        let (w, q, e) = (watcher.clone(), q.clone(), leader.clone());
        tokio::spawn(async move { w.wait_data_changed(&q, &e, b"v1").await })
    };
    assert!(
        eventually(LONG, || async {
            watcher.stats().subscribes >= before.subscribes + 2
        })
        .await,
        "the watcher subscribes to the entry's data and gone channels"
    );
    b.proclaim(&q, &leader, b"v2 with spaces")
        .await
        .expect("proclaim");
    let got = tokio::time::timeout(LONG, waiting)
        .await
        .expect("the watcher wakes")
        .expect("task")
        .expect("wait_data_changed");
    assert_eq!(got.as_deref(), Some(&b"v2 with spaces"[..]));
    let after = watcher.stats();
    assert!(after.messages > before.messages, "woken by a message");
    assert_eq!(
        after.missed_wakeups, before.missed_wakeups,
        "not found by the re-check timer"
    );
    let ttl: i64 =
        fred::prelude::ClientLike::custom(&keys, fred::cmd!("PTTL"), vec![key(&leader.name)])
            .await
            .expect("pttl");
    assert!(ttl > 0, "the entry keeps its lease (PTTL {ttl})");
    let listed = watcher.participants(&q).await.expect("participants");
    assert_eq!(listed.len(), 2);
    assert_eq!(
        (
            listed[0].name.as_str(),
            listed[0].token,
            listed[0].data.as_slice()
        ),
        (leader.name.as_str(), leader.token, &b"v2 with spaces"[..]),
        "same entry, same token, new value"
    );

    // Queued behind the leader: refused, nothing written.
    let e = b
        .proclaim(&q, &behind, b"jump")
        .await
        .expect_err("an entry that does not lead");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    let listed = watcher.participants(&q).await.expect("participants");
    assert_eq!(listed[1].data, b"w1", "the waiting entry's value stays");

    // Removed: refused, and no key comes back.
    b.remove(&q, &leader).await.expect("remove");
    let e = b
        .proclaim(&q, &leader, b"late")
        .await
        .expect_err("a removed entry");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    assert!(
        !key_exists(&keys, &key(&leader.name)).await,
        "nothing written"
    );
    // Now `behind` leads, and a change of its value is seen; its removal ends a wait
    // with `None`.
    b.proclaim(&q, &behind, b"w2")
        .await
        .expect("the new leader proclaims");
    let gone = {
        let (w, q, e) = (watcher.clone(), q.clone(), behind.clone());
        tokio::spawn(async move { w.wait_data_changed(&q, &e, b"w2").await })
    };
    tokio::time::sleep(Duration::from_millis(100)).await;
    b.remove(&q, &behind).await.expect("remove");
    let got = tokio::time::timeout(LONG, gone)
        .await
        .expect("the watcher wakes")
        .expect("task")
        .expect("wait_data_changed");
    assert_eq!(got, None, "the entry went");
    b.close().await.expect("close");
    watcher.close().await.expect("close");
}

/// The lock's every key (`dlock:{L}:*`) with its string value, as the inspector sees it.
async fn lock_keys(insp: &fred::prelude::Client, lock: &str) -> Vec<(String, Option<String>)> {
    let mut keys = scan_keys(insp, &format!("dlock:{{{}}}:*", glob_escape(lock))).await;
    keys.sort();
    let mut out = Vec::new();
    for k in keys {
        let v: Option<String> = fred::prelude::KeysInterface::get(insp, &k)
            .await
            .unwrap_or(None);
        out.push((k, v));
    }
    out
}

/// A lock key holding a string that is not a solo entry (`<name> <token> <data>`: here
/// no space, a token that is not a number, an empty string): acquiring, releasing (by
/// the session whose solo entry it overwrote, and by another) and reading the status are
/// typed backend errors, and the key is left as it was, with nothing written beside it.
#[tokio::test]
async fn a_malformed_solo_value_is_a_typed_error_and_left_alone() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "a_malformed_solo_value") else {
        return;
    };
    let b = connect(&addr, LONG).await;
    let other = connect(&addr, LONG).await;
    let insp = inspector(&addr).await;
    for garbage in ["nospaces", "_c_x-lock-1 notanumber data", ""] {
        let q = fresh_queue("malformed-solo");
        let key = format!("dlock:{{{}}}:q", q.lock);
        // A solo entry of `b`'s, then the garbage over it.
        let mine = enqueue_lock(&b, &q).await.expect("enqueue").mine;
        let _: () = fred::prelude::KeysInterface::set(&insp, &key, garbage, None, None, false)
            .await
            .expect("plant");
        let planted = vec![(key.clone(), Some(garbage.to_owned()))];
        assert_eq!(lock_keys(&insp, &q.lock.to_string()).await, planted);

        let status = b.queue(&q).await;
        assert!(
            matches!(status, Err(Error::Backend { .. })),
            "{garbage:?}: status {status:?}"
        );
        for (who, backend) in [("b", &b), ("other", &other)] {
            let acquired = enqueue_lock(backend, &q).await;
            assert!(
                matches!(acquired, Err(Error::Backend { .. })),
                "{garbage:?}: acquire by {who} {acquired:?}"
            );
            assert_eq!(
                lock_keys(&insp, &q.lock.to_string()).await,
                planted,
                "after acquire"
            );
        }
        // Another session's release first: the holder's marks the entry released.
        for (who, backend) in [("another session", &other), ("its holder", &b)] {
            let released = backend.remove(&q, &mine).await;
            assert!(
                matches!(released, Err(Error::Backend { .. })),
                "{garbage:?}: release by {who} {released:?}"
            );
            assert_eq!(
                lock_keys(&insp, &q.lock.to_string()).await,
                planted,
                "after release"
            );
        }
        let _: i64 = fred::prelude::KeysInterface::del(&insp, &key)
            .await
            .expect("clean up");
    }
    b.close().await.expect("close");
    other.close().await.expect("close");
}

/// A solo entry's release (`RELEASE_SOLO`) compares the value its acquire wrote, whole,
/// with no data, text data and binary data: it removes that value by the comparison
/// (`Stats::solo_mismatches` stays 0, so the fast path is the one taken); data longer
/// than the client sends back is removed by the name, not counted as a mismatch; it
/// leaves another entry's solo value in place (the holder's expired and another client
/// took the lock), answering the release as done; and it still removes a value that
/// carries the holder's name with anything else after it, as the release did when it
/// matched names (no dlock client writes one, but a key that names the holder is the
/// holder's), counting that one mismatch.
#[tokio::test]
async fn a_solo_release_removes_its_own_value_and_no_other() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "a_solo_release_removes_its_own") else {
        return;
    };
    let b = connect(&addr, LONG).await;
    let insp = inspector(&addr).await;
    let q = fresh_queue("solo-release");
    let key = format!("dlock:{{{}}}:q", q.lock);
    let get = |insp: fred::prelude::Client, key: String| async move {
        let v: Option<Vec<u8>> = fred::prelude::KeysInterface::get(&insp, key)
            .await
            .expect("GET");
        v
    };
    let solo = |insp: fred::prelude::Client, key: String| async move {
        let t: String = fred::prelude::KeysInterface::r#type(&insp, key)
            .await
            .expect("TYPE");
        assert_eq!(t, "string", "the entry is the lock's solo one");
    };
    let acquire = |data: Vec<u8>| {
        let (b, q) = (b.clone(), q.clone());
        async move {
            b.enqueue(
                &q,
                &dlock_testkit::ticket(),
                EntryKind::Lock,
                Position::Tail,
                &data,
            )
            .await
            .expect("enqueue")
            .mine
        }
    };

    // Its own value, with no data, text data, binary data and long data: removed.
    let long = vec![b'x'; 300];
    for data in [&b""[..], b"some data", b"\xff\x00 \xfe", &long] {
        let mine = acquire(data.to_vec()).await;
        let token = mine.token.expect("a token").get();
        let mut written = format!("{} {token} ", mine.name).into_bytes();
        written.extend_from_slice(data);
        assert_eq!(get(insp.clone(), key.clone()).await, Some(written));
        b.remove(&q, &mine).await.expect("release");
        assert_eq!(get(insp.clone(), key.clone()).await, None, "released");
        assert_eq!(b.stats().solo_mismatches, 0, "by the whole value");
    }

    // Another entry's solo value where its own was: left as it is.
    let mine = acquire(Vec::new()).await;
    solo(insp.clone(), key.clone()).await;
    let other = "_c_00000000-0000-0000-0000-000000000000-lock-0000000007 7 ";
    let _: () = fred::prelude::KeysInterface::set(&insp, &key, other, None, None, false)
        .await
        .expect("plant");
    b.remove(&q, &mine).await.expect("release");
    assert_eq!(
        get(insp.clone(), key.clone()).await,
        Some(other.as_bytes().to_vec()),
        "another's entry left"
    );
    assert_eq!(b.stats().solo_mismatches, 0);
    let _: i64 = fred::prelude::KeysInterface::del(&insp, &key)
        .await
        .expect("clean up");

    // Its name with another token and data after it: still its own, removed by name.
    let mine = acquire(Vec::new()).await;
    solo(insp.clone(), key.clone()).await;
    let renamed = format!("{} 12 other data", mine.name);
    let _: () = fred::prelude::KeysInterface::set(&insp, &key, renamed, None, None, false)
        .await
        .expect("plant");
    b.remove(&q, &mine).await.expect("release");
    assert_eq!(
        get(insp.clone(), key.clone()).await,
        None,
        "removed by name"
    );
    assert_eq!(b.stats().solo_mismatches, 1, "found by the name");
    assert!(lock_keys(&insp, &q.lock.to_string()).await.is_empty());
    b.close().await.expect("close");
}

/// A solo entry's release publishes nothing (`RELEASE_SOLO`), so a `wait_changed` that
/// saw that one entry moves it into the queue layout once it listens: the release wakes
/// it by the message, not by the re-check timer. (Without the move, this waiter was
/// woken by its timer.)
#[tokio::test]
async fn wait_changed_on_a_lone_solo_entry_is_woken_by_its_release() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "wait_changed_on_a_lone_solo_entry") else {
        return;
    };
    let holder = connect(&addr, LONG).await;
    let watcher = connect(&addr, LONG).await;
    let insp = inspector(&addr).await;
    let q = fresh_queue("lone-solo-changed");
    let mine = enqueue_lock(&holder, &q).await.expect("enqueue").mine;
    let kind: String =
        fred::prelude::ClientLike::custom(&insp, fred::cmd!("TYPE"), vec![queue_key(&q)])
            .await
            .expect("type");
    assert_eq!(kind, "string", "the entry took the uncontended fast path");
    let seen = watcher.queue(&q).await.expect("queue");
    assert_eq!(seen.len(), 1, "{seen:?}");

    let before = watcher.stats();
    let waiting = {
        let (w, q, seen) = (watcher.clone(), q.clone(), seen.clone());
        tokio::spawn(async move { w.wait_changed(&q, &seen).await })
    };
    assert!(
        eventually(LONG, || async {
            watcher.stats().subscribes > before.subscribes
        })
        .await,
        "the watcher subscribes"
    );
    assert!(
        eventually(LONG, || async {
            let kind: String =
                fred::prelude::ClientLike::custom(&insp, fred::cmd!("TYPE"), vec![queue_key(&q)])
                    .await
                    .expect("type");
            kind == "zset"
        })
        .await,
        "the watcher moved the solo entry into the queue layout"
    );
    assert!(
        !waiting.is_finished(),
        "wait_changed returned with no change"
    );
    holder.remove(&q, &mine).await.expect("release");
    tokio::time::timeout(LONG, waiting)
        .await
        .expect("the watcher wakes")
        .expect("task")
        .expect("wait_changed");
    let after = watcher.stats();
    assert!(after.messages > before.messages, "woken by a message");
    // A re-check that found nothing (the 1 s timer, if the machine stalled before the
    // release) is harmless; one that found the change would mean the message missed.
    assert_eq!(
        after.missed_wakeups, before.missed_wakeups,
        "not found by the re-check timer"
    );
    holder.close().await.expect("close");
    watcher.close().await.expect("close");
}

/// A server that forgot the scripts (`SCRIPT FLUSH`, as a restart or a failover to a
/// replica that never loaded them does) answers `NOSCRIPT`; the script is loaded and
/// the same request sent again, built a second time: the solo acquire's name prefix and
/// data, and the solo release's whole value, arrive as the first attempt would have
/// sent them.
#[tokio::test]
async fn scripts_the_server_forgot_are_loaded_and_the_request_sent_again() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDIS", "scripts_the_server_forgot_are_loaded").is_none() {
        return;
    }
    // A server of its own: flushing the shared one's scripts would send every other
    // test running against it down this path too.
    let server = TestServer::start();
    let b = connect(&server.addr(), LONG).await;
    let insp = inspector(&server.addr()).await;
    let flush = || async {
        let _: String =
            fred::prelude::ClientLike::custom(&insp, fred::cmd!("SCRIPT"), vec!["FLUSH"])
                .await
                .expect("SCRIPT FLUSH");
    };
    let q = fresh_queue("noscript");
    let key = format!("dlock:{{{}}}:q", q.lock);
    for data in [&b""[..], b"some data"] {
        flush().await;
        let mine = b
            .enqueue(
                &q,
                &dlock_testkit::ticket(),
                EntryKind::Lock,
                Position::Tail,
                data,
            )
            .await
            .expect("enqueue after the flush")
            .mine;
        let token = mine.token.expect("a token").get();
        let mut written = format!("{} {token} ", mine.name).into_bytes();
        written.extend_from_slice(data);
        let v: Option<Vec<u8>> = fred::prelude::KeysInterface::get(&insp, &key)
            .await
            .expect("GET");
        assert_eq!(
            v,
            Some(written),
            "the solo value as the first attempt sends it"
        );
        flush().await;
        b.remove(&q, &mine).await.expect("release after the flush");
        let v: Option<Vec<u8>> = fred::prelude::KeysInterface::get(&insp, &key)
            .await
            .expect("GET");
        assert_eq!(v, None, "released by its whole value");
        assert_eq!(b.stats().solo_mismatches, 0, "matched by the whole value");
    }
    // Each of the four requests above met NOSCRIPT and loaded its script again (with
    // no flush, only the first of each would have: two).
    let stats: String =
        fred::prelude::ClientLike::custom(&insp, fred::cmd!("INFO"), vec!["commandstats"])
            .await
            .expect("INFO");
    let loads = stats
        .lines()
        .find_map(|l| l.strip_prefix("cmdstat_script|load:calls="))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.parse::<u64>().ok())
        .unwrap_or(0);
    assert_eq!(loads, 4, "SCRIPT LOAD calls: {stats}");
    b.close().await.expect("close");
}

/// An enqueue that runs twice for one ticket (on a cluster fred can fail a command that
/// ran with the error it gives a `MOVED` it did not follow, and the adapter sends it
/// again) makes one entry, not a second one queued behind the first: the second run
/// returns the first run's entry, token included. Once for a lone entry (the solo
/// acquire finds the key taken, and the enqueue finds the entry it moved into the
/// queue) and once for an entry queued behind another.
#[tokio::test]
async fn an_enqueue_run_twice_for_one_ticket_makes_one_entry() {
    init_tracing();
    let Some(addr) = endpoint("DLOCK_TEST_REDIS", "an_enqueue_run_twice") else {
        return;
    };
    let b = connect(&addr, LONG).await;
    let q = fresh_queue("enqueue-twice");
    let enqueue = |ticket: dlock_core::Ticket| {
        let (b, q) = (&b, &q);
        async move {
            b.enqueue(q, &ticket, EntryKind::Lock, Position::Tail, b"")
                .await
                .expect("enqueue")
        }
    };
    let (first, second) = (dlock_testkit::ticket(), dlock_testkit::ticket());
    let a1 = enqueue(first.clone()).await;
    let a2 = enqueue(first.clone()).await;
    assert_eq!(a2.mine.name, a1.mine.name, "a second entry for one ticket");
    assert_eq!(a2.mine.token, a1.mine.token);
    assert_eq!(a2.queue.len(), 1, "the queue: {:?}", a2.queue);
    let b1 = enqueue(second.clone()).await;
    assert_eq!(b1.queue.len(), 2, "the queue: {:?}", b1.queue);
    let b2 = enqueue(second).await;
    assert_eq!(b2.mine.name, b1.mine.name, "a second entry for one ticket");
    assert_eq!(b2.mine.token, b1.mine.token);
    let names: Vec<&str> = b2.queue.iter().map(|e| e.name.as_str()).collect();
    assert_eq!(
        names,
        [a1.mine.name.as_str(), b1.mine.name.as_str()],
        "the queue after the second run"
    );
    b.remove(&q, &a1.mine).await.expect("remove");
    b.remove(&q, &b1.mine).await.expect("remove");
    b.close().await.expect("close");
}

/// An enqueue that finds this ticket's entry from an earlier run of the same request
/// gives it a whole lease from now: the client files the entry with this request's
/// send time and counts the lease from then, so the server must not expire it sooner.
/// (The earlier run is a Redis Cluster `ACQUIRE_SOLO` that ran although fred reported
/// it failed, retried after up to a command timeout: it started the server's lease, and
/// the client, which never saw it succeed, filed nothing then.) Staged here by writing
/// that run's solo string by hand, with the ticket's name, 1.5 s into a 3 s lease
/// before the enqueue; before the fix the entry kept the 1.5 s left, and a watchdog
/// renewal that failed after the first 1.5 s would not have fired `lost()` before the
/// server expired it.
#[tokio::test]
async fn an_enqueue_finding_its_own_earlier_entry_renews_its_lease() {
    init_tracing();
    let Some(addr) = endpoint(
        "DLOCK_TEST_REDIS",
        "an_enqueue_finding_its_own_earlier_entry",
    ) else {
        return;
    };
    let lease = Duration::from_secs(3);
    let b = connect(&addr, lease).await;
    let insp = inspector(&addr).await;
    let q = fresh_queue("enqueue-rearms");
    let ticket = dlock_testkit::ticket();
    let prefix = ticket.name_prefix(EntryKind::Lock);
    let (secs, micros): (String, String) =
        fred::prelude::ClientLike::custom(&insp, fred::cmd!("TIME"), Vec::<String>::new())
            .await
            .expect("time");
    let token = format!("{secs}{micros:0>6}");
    let queue_key = format!("dlock:{{{}}}:q", q.lock);
    let earlier: Option<String> = fred::prelude::KeysInterface::set(
        &insp,
        &queue_key,
        format!("{prefix}{token} {token} "),
        Some(fred::types::Expiration::PX(lease.as_millis() as i64)),
        Some(fred::types::SetOptions::NX),
        false,
    )
    .await
    .expect("write the earlier run's solo entry");
    assert_eq!(earlier.as_deref(), Some("OK"));
    tokio::time::sleep(lease / 2).await;
    let sent = std::time::Instant::now();
    let added = b
        .enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"")
        .await
        .expect("enqueue");
    assert_eq!(
        added.mine.name,
        format!("{prefix}{token}"),
        "the earlier entry"
    );
    assert_eq!(added.mine.token.map(|t| t.get().to_string()), Some(token));
    let entry_key = format!("dlock:{{{}}}:e:{}", q.lock, added.mine.name);
    for key in [&entry_key, &queue_key] {
        let pttl: i64 = fred::prelude::KeysInterface::pttl(&insp, key)
            .await
            .expect("pttl");
        // What the client counts on: a lease from its send. 50 ms for PTTL's rounding
        // and this machine's scheduling, far below the 1.5 s the old script left off.
        let floor = lease.saturating_sub(sent.elapsed()).as_millis() as i64 - 50;
        assert!(
            pttl >= floor,
            "{key}: PTTL {pttl} ms, the client counts on {floor}"
        );
    }
    b.remove(&q, &added.mine).await.expect("remove");
    assert!(!key_exists(&insp, &entry_key).await, "removed");
    b.close().await.expect("close");
}
