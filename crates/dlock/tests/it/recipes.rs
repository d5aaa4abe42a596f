//! Recipe behaviour, written once and run on every backend by `backend_tests!`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock::{Error, SessionOptions};
use futures::FutureExt;

use crate::support::{client, client_with, eventually, holder_entry, leftovers, unique, Kind};

const GENEROUS: Duration = Duration::from_secs(30);

/// Four sessions hammer one mutex: never two inside, every token larger than the last.
pub async fn mutex_excludes_and_tokens_grow(kind: Kind, url: &str) {
    let name = unique("excl");
    let inside = Arc::new(AtomicBool::new(false));
    let tokens = Arc::new(parking_lot_free::Tokens::default());
    let mut tasks = Vec::new();
    for _ in 0..4 {
        let c = client(url).await;
        let (name, inside, tokens) = (name.clone(), inside.clone(), tokens.clone());
        tasks.push(tokio::spawn(async move {
            let m = c.mutex(&name).expect("name");
            for _ in 0..10 {
                let mut g = m.lock().await.expect("lock");
                assert!(!inside.swap(true, Ordering::SeqCst), "two holders at once");
                tokens.push(g.token().get());
                tokio::task::yield_now().await;
                inside.store(false, Ordering::SeqCst);
                g.release().await.expect("release");
            }
            c.close().await.expect("close");
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let seen = tokens.take();
    assert_eq!(seen.len(), 40);
    // Redlock's tokens are documented as not safe fencing tokens: no total order.
    assert!(
        matches!(kind, Kind::Redlock) || seen.windows(2).all(|w| w[0] < w[1]),
        "tokens must strictly increase in acquisition order: {seen:?}"
    );
}

/// A held lock times out others cleanly: the right error, nothing left behind.
pub async fn timeout_and_try_lock_leave_nothing(_kind: Kind, url: &str) {
    let name = unique("timeout");
    let a = client(url).await;
    let b = client(url).await;
    let mut g = a.mutex(&name).expect("name").lock().await.expect("lock");
    let mb = b.mutex(&name).expect("name");
    match mb.lock_timeout(Duration::from_millis(300)).await {
        Err(Error::Timeout(d)) => assert_eq!(d, Duration::from_millis(300)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert!(matches!(mb.try_lock().await, Err(Error::WouldBlock)));
    assert_eq!(
        leftovers(&a, &name).await,
        1,
        "only the holder's entry remains"
    );
    g.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "entries left after release"
    );
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// 200 acquisitions cancelled by timeouts and by dropped futures leave zero entries.
pub async fn cancelled_acquisitions_leave_nothing(_kind: Kind, url: &str) {
    let name = unique("cancel");
    let holder = client(url).await;
    let waiter = client(url).await;
    let mut g = holder
        .mutex(&name)
        .expect("name")
        .lock()
        .await
        .expect("lock");
    let m = waiter.mutex(&name).expect("name");
    for i in 0..200u64 {
        if i % 2 == 0 {
            // A timeout at a varying point of the attempt.
            let r = m.lock_timeout(Duration::from_millis(i % 7)).await;
            assert!(matches!(r, Err(Error::Timeout(_))), "attempt {i}: {r:?}");
        } else {
            // A future dropped after a varying number of polls.
            let mut fut = Box::pin(m.lock());
            for _ in 0..(i % 5) {
                if (&mut fut).now_or_never().is_some() {
                    panic!("acquired a held lock");
                }
                tokio::task::yield_now().await;
            }
            drop(fut);
        }
    }
    g.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&holder, &name).await == 0 }).await,
        "cancelled acquisitions left {} entries",
        leftovers(&holder, &name).await
    );
    holder.close().await.expect("close");
    waiter.close().await.expect("close");
}

/// `replicas=1` (`SessionOptions::replicas`): one Redis primary waits for its replicas
/// before a grant counts; every other backend refuses it when connecting, as a URL
/// error, rather than connect without the guarantee asked for. The shared Sentinel group
/// has a replica, so a lock through it is granted; the shared single server has none, so
/// a lock there is refused (`Unreachable`, the replicas named) and leaves nothing behind.
/// Not on mem: the in-memory backend has no replicas to wait for.
pub async fn replicas_where_they_mean_something(kind: Kind, url: &str) {
    let sep = if url.contains('?') { '&' } else { '?' };
    let with = format!("{url}{sep}replicas=1");
    // A lease far longer than the wait below: an entry gone within it was taken back,
    // not expired.
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(60));
    let connected = dlock::connect_with(&with, opts.clone()).await;
    match kind {
        Kind::RedisSentinel | Kind::Redis => {
            let c = connected.unwrap_or_else(|e| panic!("{kind:?} takes replicas=1: {e}"));
            let name = unique("replicas");
            let got = c.mutex(&name).expect("mutex").lock().await;
            if kind == Kind::RedisSentinel {
                let mut g = got.expect("granted: the group's replica acknowledges");
                g.release().await.expect("release");
            } else {
                assert!(
                    matches!(&got, Err(Error::Unreachable(m)) if m.contains("replicas")),
                    "a server without replicas cannot grant with replicas=1: {:?}",
                    got.as_ref().map(dlock::LockGuard::token)
                );
            }
            assert!(
                eventually(Duration::from_secs(3), || async {
                    leftovers(&c, &name).await == 0
                })
                .await,
                "replicas=1 left an entry behind"
            );
            c.close().await.expect("close");
        }
        _ => {
            assert!(
                matches!(&connected, Err(Error::InvalidUrl { reason, .. }) if reason.contains("replicas")),
                "{kind:?} must refuse replicas=1: {:?}",
                connected.as_ref().map(|_| "connected")
            );
            // Set through the options instead of the URL: the same refusal.
            let direct = dlock::connect_with(url, opts.with_replicas(1)).await;
            assert!(
                matches!(&direct, Err(Error::InvalidUrl { reason, .. }) if reason.contains("replicas")),
                "{kind:?} must refuse SessionOptions::replicas: {:?}",
                direct.as_ref().map(|_| "connected")
            );
        }
    }
}

/// Bad input gives typed errors, never a panic, and leaves nothing behind.
pub async fn bad_input_gives_typed_errors(_kind: Kind, url: &str) {
    let c = client(url).await;
    assert!(matches!(c.mutex(""), Err(Error::InvalidName { .. })));
    assert!(matches!(c.mutex("a\0b"), Err(Error::InvalidName { .. })));
    assert!(matches!(c.mutex("a//b"), Err(Error::InvalidName { .. })));
    assert!(matches!(c.semaphore("s", 0), Err(Error::InvalidPermits(_))));
    let name = unique("bad");
    // Release twice.
    let mut g = c.mutex(&name).expect("name").lock().await.expect("lock");
    g.release().await.expect("first release");
    assert!(matches!(g.release().await, Err(Error::NotHeld(_))));
    // Upgrade read -> write, inside the read hold.
    let rw = c.rwlock(&name).expect("name");
    let mut r = rw.read().await.expect("read");
    assert!(matches!(
        r.scope(rw.write_timeout(GENEROUS)).await,
        Err(Error::WouldDeadlock(_))
    ));
    r.release().await.expect("release");
    // Semaphore-mutex taken twice inside its own hold.
    let sm = c.semaphore_mutex(&name).expect("name");
    let mut s = sm.lock().await.expect("lock");
    assert!(matches!(
        s.scope(sm.lock_timeout(GENEROUS)).await,
        Err(Error::WouldDeadlock(_))
    ));
    s.release().await.expect("release");
    // A multi-lock naming a lock twice.
    let multi = c.multi().mutex(&name).expect("a").write(&name).expect("b");
    assert!(matches!(
        multi.acquire().await,
        Err(Error::WouldDeadlock(_))
    ));
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "bad input left entries behind"
    );
    c.close().await.expect("close");
}

/// Timeouts set straight on `SessionOptions`' public fields, past what the setters take
/// (`Duration::MAX`, "forever"), are taken as the longest allowed: the client connects,
/// locks and closes instead of panicking on the clock arithmetic of its deadlines.
pub async fn huge_session_options_are_clamped_not_a_panic(_kind: Kind, url: &str) {
    let mut opts = SessionOptions::default();
    opts.session_timeout = Some(Duration::MAX);
    opts.connect_timeout = Duration::MAX;
    let c = client_with(url, opts).await;
    let name = unique("huge-opts");
    let mut g = c.mutex(&name).expect("name").lock().await.expect("lock");
    let other = client(url).await;
    assert!(
        matches!(
            other.mutex(&name).expect("name").try_lock().await,
            Err(Error::WouldBlock)
        ),
        "the lock taken with clamped options excludes another client"
    );
    g.release().await.expect("release");
    assert_eq!(leftovers(&c, &name).await, 0, "the release left entries");
    c.close().await.expect("close");
    other.close().await.expect("close");
}

/// Readers share; a writer excludes readers; a queued writer blocks later readers.
pub async fn rwlock_readers_share_writers_exclude(_kind: Kind, url: &str) {
    let name = unique("rw");
    let a = client(url).await;
    let b = client(url).await;
    let c = client(url).await;
    let (ra, rb, rc) = (
        a.rwlock(&name).expect("n"),
        b.rwlock(&name).expect("n"),
        c.rwlock(&name).expect("n"),
    );
    let mut r1 = ra.read().await.expect("read a");
    let mut r2 = rb.read_timeout(GENEROUS).await.expect("readers share");
    assert!(matches!(rc.try_write().await, Err(Error::WouldBlock)));
    // A writer queues; a reader arriving after it must wait (no writer starvation).
    let w = tokio::spawn(async move {
        let mut g = rc.write_timeout(GENEROUS).await.expect("write");
        let t = g.token();
        tokio::time::sleep(Duration::from_millis(200)).await;
        g.release().await.expect("release");
        (t, c)
    });
    assert!(
        eventually(GENEROUS, || async {
            a.participants(&name).await.map(|p| p.len()).unwrap_or(0) == 3
        })
        .await
    );
    let late = client(url).await;
    let rl = late.rwlock(&name).expect("n");
    assert!(matches!(rl.try_read().await, Err(Error::WouldBlock)));
    r1.release().await.expect("release");
    r2.release().await.expect("release");
    let (wt, c) = w.await.expect("writer");
    let mut r3 = rl.read_timeout(GENEROUS).await.expect("read after writer");
    assert!(r3.token() > wt);
    r3.release().await.expect("release");
    for x in [a, b, c, late] {
        x.close().await.expect("close");
    }
}

/// A writer takes the read lock and releases the write lock: a queued writer does not
/// get in between, and gets in once the read is released.
pub async fn rwlock_downgrade(_kind: Kind, url: &str) {
    let name = unique("down");
    let a = client(url).await;
    let b = client(url).await;
    let ra = a.rwlock(&name).expect("n");
    let rb = b.rwlock(&name).expect("n");
    let mut w = ra.write().await.expect("write");
    let got = Arc::new(AtomicBool::new(false));
    let got2 = got.clone();
    let queued = tokio::spawn(async move {
        let mut g = rb.write_timeout(GENEROUS).await.expect("queued writer");
        got2.store(true, Ordering::SeqCst);
        g.release().await.expect("release");
        b
    });
    assert!(
        eventually(GENEROUS, || async {
            a.participants(&name).await.map(|p| p.len()).unwrap_or(0) == 2
        })
        .await
    );
    let mut r = ra.downgrade(&w).await.expect("downgrade read");
    w.release().await.expect("release write");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !got.load(Ordering::SeqCst),
        "queued writer got in during the downgrade"
    );
    r.release().await.expect("release read");
    let b = queued.await.expect("writer task");
    assert!(got.load(Ordering::SeqCst));
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A read entry never takes a dead writer's place: asked to go beside a write entry that
/// was deleted from outside, the backend fails with `LockLost` and puts nothing (the
/// backend is asked directly, so the write's lost signal cannot answer first); the
/// recipe's downgrade of that write fails the same way and leaves nothing either.
pub async fn downgrade_beside_a_deleted_write_is_lost(_kind: Kind, url: &str) {
    use dlock_core::{EntryKind, Position};
    let name = unique("downgone");
    let a = client(url).await;
    let b = client(url).await;
    let ra = a.rwlock(&name).expect("n");
    let w = ra.write().await.expect("write");
    let (q, entry) = holder_entry(&b, &name).await;
    b.backend()
        .remove(&q, &entry)
        .await
        .expect("delete the write entry from outside");
    let ticket = dlock_testkit::ticket();
    let beside = a
        .backend()
        .enqueue(&q, &ticket, EntryKind::Read, Position::Beside(&entry), b"")
        .await;
    assert!(
        matches!(beside, Err(Error::LockLost(_))),
        "a read entry was put beside a deleted write: {:?}",
        beside.map(|e| e.mine)
    );
    assert_eq!(
        leftovers(&b, &name).await,
        0,
        "the refused read entry was left in the queue"
    );
    let down = ra.downgrade(&w).await;
    assert!(
        matches!(down, Err(Error::LockLost(_))),
        "the downgrade of a deleted write succeeded: {:?}",
        down.map(|g| g.token())
    );
    assert!(
        eventually(GENEROUS, || async { leftovers(&b, &name).await == 0 }).await,
        "the refused downgrade left an entry"
    );
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// Eight sessions share a semaphore of 3: the peak is exactly 3, never more.
pub async fn semaphore_peak_equals_permits(_kind: Kind, url: &str) {
    let name = unique("sem");
    let live = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    // Connect everyone first so the workers contend from the start, as at a barrier.
    let mut sessions = Vec::new();
    for _ in 0..8 {
        sessions.push(client(url).await);
    }
    let mut tasks = Vec::new();
    for c in sessions {
        let (name, live, peak) = (name.clone(), live.clone(), peak.clone());
        tasks.push(tokio::spawn(async move {
            let s = c.semaphore(&name, 3).expect("sem");
            for _ in 0..4 {
                let mut p = s
                    .acquire_timeout(Duration::from_secs(60))
                    .await
                    .expect("permit");
                let now = live.fetch_add(1, Ordering::SeqCst) + 1;
                peak.fetch_max(now, Ordering::SeqCst);
                // Hold until all three permits have been out at once (or a while has
                // passed): on a loaded machine a fixed hold time may end before the next
                // grants arrive, and the peak would measure the machine, not the recipe.
                let _ = eventually(Duration::from_secs(5), || async {
                    peak.load(Ordering::SeqCst) >= 3
                })
                .await;
                tokio::time::sleep(Duration::from_millis(20)).await;
                live.fetch_sub(1, Ordering::SeqCst);
                p.release().await.expect("release");
            }
            c
        }));
    }
    let mut clients = Vec::new();
    for t in tasks {
        clients.push(t.await.expect("task"));
    }
    assert_eq!(
        peak.load(Ordering::SeqCst),
        3,
        "peak must equal the permits exactly"
    );
    assert!(
        eventually(GENEROUS, || async {
            leftovers(&clients[0], &name).await == 0
        })
        .await,
        "semaphore left entries"
    );
    for c in clients {
        c.close().await.expect("close");
    }
}

/// A multi-lock rolls back when one part times out; two multi-locks over the same names
/// listed in opposite orders never deadlock.
pub async fn multilock_rollback_and_order(_kind: Kind, url: &str) {
    let (x, y) = (unique("mx"), unique("my"));
    let a = client(url).await;
    let b = client(url).await;
    let mut hold_y = b.mutex(&y).expect("n").lock().await.expect("hold y");
    let m = a.multi().mutex(&x).expect("x").mutex(&y).expect("y");
    assert!(matches!(
        m.acquire_timeout(Duration::from_millis(500)).await,
        Err(Error::Timeout(_))
    ));
    // x was rolled back: b can take it at once.
    let mut gx = b
        .mutex(&x)
        .expect("n")
        .try_lock()
        .await
        .expect("x was released");
    gx.release().await.expect("release");
    hold_y.release().await.expect("release");
    let mut tasks = Vec::new();
    for (c, first, second) in [(a, x.clone(), y.clone()), (b, y.clone(), x.clone())] {
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let m = c
                    .multi()
                    .mutex(&first)
                    .expect("n")
                    .mutex(&second)
                    .expect("n");
                let mut g = m
                    .acquire_timeout(Duration::from_secs(60))
                    .await
                    .expect("multi");
                assert_eq!(g.tokens().len(), 2);
                g.release().await.expect("release");
            }
            c
        }));
    }
    for t in tasks {
        t.await.expect("no deadlock").close().await.expect("close");
    }
}

/// A holder whose runtime was starved past its session (its only thread blocked in
/// synchronous code, so the task that keeps the session alive could not run) knows the
/// hold is lost as soon as it looks, before that task has run to say so: `is_lost()` and
/// a re-entry compare the clock with the session's deadline (on Redis, the entry's), as
/// a grant and a release do, and the loss stays known once the keeping task runs. Before, they trusted the keeping task's verdict, which comes only once
/// it runs: the holder went on under a session the server may already have expired.
pub async fn a_starved_runtime_knows_its_session_deadline_passed(_kind: Kind, url: &str) {
    let url = url.to_owned();
    let name = unique("starved");
    let session = Duration::from_secs(4);
    let seen = tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let seen = rt.block_on(async move {
            let c = client_with(
                &url,
                SessionOptions::default().with_session_timeout(session),
            )
            .await;
            let mut g = c.mutex(&name).expect("name").lock().await.expect("lock");
            assert!(!g.is_lost(), "lost as soon as granted");
            // The runtime's one thread is blocked: nothing of the client runs.
            std::thread::sleep(session + Duration::from_secs(2));
            let (lost, reentry) = (g.is_lost(), g.reenter().err());
            // And it stays known: the keeping task runs now, and may take a renewal's
            // late answer; the release still reports the loss.
            tokio::task::yield_now().await;
            let still = g.is_lost();
            let released = g.release().await.err();
            let _ = c.close().await;
            (lost, reentry, still, released)
        });
        drop(rt);
        seen
    })
    .await
    .expect("the starved runtime's thread");
    assert!(seen.0, "is_lost() said false past the session's deadline");
    assert!(
        matches!(seen.1, Some(Error::LockLost(_))),
        "a re-entry past the session's deadline: {:?}",
        seen.1
    );
    assert!(seen.2, "is_lost() went back to false");
    assert!(
        matches!(seen.3, Some(Error::LockLost(_))),
        "the release past the session's deadline: {:?}",
        seen.3
    );
}

/// Closing a session fires the lost signal of every guard on it, and another session
/// gets the lock.
pub async fn lost_signal_fires_on_session_end(_kind: Kind, url: &str) {
    let name = unique("lost");
    let a = client(url).await;
    let b = client(url).await;
    let g = a.mutex(&name).expect("n").lock().await.expect("lock");
    let lost = g.lost();
    assert!(!g.is_lost());
    a.close().await.expect("close");
    let e = tokio::time::timeout(GENEROUS, lost)
        .await
        .expect("lost fired");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    let mut gb = b
        .mutex(&name)
        .expect("n")
        .lock_timeout(GENEROUS)
        .await
        .expect("the lock freed itself");
    gb.release().await.expect("release");
    drop(g);
    b.close().await.expect("close");
}

/// `verify` asks the server about the hold's own entry: it passes while the entry is
/// there (with a waiter queued behind it), and fails with `LockLost` once the entry is
/// deleted from outside, before any keep-alive could tell the holder. `contains` does not
/// take an entry of the same name with another token for the held one (except on
/// Redlock, whose token is a per-read view).
pub async fn verify_checks_the_entry_on_the_server(kind: Kind, url: &str) {
    let name = unique("verify");
    let a = client(url).await;
    let b = client(url).await;
    let g = a.mutex(&name).expect("n").lock().await.expect("lock");
    let mb = b.mutex(&name).expect("n");
    let waiter = tokio::spawn(async move {
        let mut g = mb
            .lock_timeout(GENEROUS)
            .await
            .expect("waiter gets the lock");
        g.release().await.expect("release");
    });
    assert!(
        eventually(GENEROUS, || async {
            a.participants(&name).await.map(|p| p.len()).unwrap_or(0) == 2
        })
        .await,
        "the waiter never queued"
    );
    g.verify().await.expect("verify while held");
    // A released re-entry no longer holds, though its hold lives on in `g`.
    let mut again = g.reenter().expect("re-enter");
    again.release().await.expect("release the re-entry");
    let e = again
        .verify()
        .await
        .expect_err("verify of a released guard");
    assert!(matches!(e, Error::NotHeld(_)), "{e:?}");
    g.verify()
        .await
        .expect("verify while still held by the first guard");

    let (q, entry) = holder_entry(&a, &name).await;
    assert!(a.backend().contains(&q, &entry).await.expect("contains"));
    // Redlock's token is the highest of the masters that answered, so a read may show
    // another value for the same entry: it is matched by name only.
    if !matches!(kind, Kind::Redlock) {
        let token = g.token().get();
        let mut other = entry.clone();
        other.token = Some(dlock_core::FencingToken::new(token + 1));
        assert!(
            !a.backend().contains(&q, &other).await.expect("contains"),
            "an entry with another token must not count as the held one"
        );
    }

    a.backend()
        .remove(&q, &entry)
        .await
        .expect("delete the holder's entry from outside");
    let e = g.verify().await.expect_err("verify after the entry went");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    tokio::time::timeout(GENEROUS, waiter)
        .await
        .expect("waiter finished")
        .expect("waiter task");
    drop(g);
    assert_eq!(leftovers(&a, &name).await, 0, "entries left under {name}");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A waiter whose own entry is deleted from outside while it waits (an operator's
/// delete, a revoked lease) never takes the lock from the view it had: when the entry
/// ahead of it goes, it fails with `LockLost`, and the contender that queued after the
/// deletion, which no longer sees it, gets the lock alone. Curator lists the queue on
/// every wake and etcd's lock reads its own key after its wait, for the same reason.
pub async fn a_waiter_whose_entry_went_is_never_granted(_kind: Kind, url: &str) {
    let name = unique("waitgone");
    let a = client(url).await;
    let b = client(url).await;
    let c = client(url).await;
    let mut g = a.mutex(&name).expect("n").lock().await.expect("lock");
    let mb = b.mutex(&name).expect("n");
    let waiter = tokio::spawn(async move {
        // A hold taken here is released at once: the assertion below is on the result.
        mb.lock_timeout(GENEROUS).await.map(|g| g.token().get())
    });
    let queued = |n: usize| {
        let a = &a;
        let name = &name;
        async move {
            eventually(GENEROUS, || async {
                a.participants(name).await.map(|p| p.len()).unwrap_or(0) == n
            })
            .await
        }
    };
    assert!(queued(2).await, "the waiter never queued");
    let waiting: Vec<_> = a
        .participants(&name)
        .await
        .expect("participants")
        .into_iter()
        .filter(|p| !p.holds)
        .collect();
    assert_eq!(waiting.len(), 1, "one waiter expected: {waiting:?}");
    let q = dlock_core::QueuePath::root(a.lock_name(&name).expect("name"));
    a.backend()
        .remove(&q, &waiting[0].entry)
        .await
        .expect("delete the waiter's entry from outside");
    let mc = c.mutex(&name).expect("n");
    let newcomer = tokio::spawn(async move {
        let held = mc.lock_timeout(GENEROUS).await;
        held.map(|g| (g.token().get(), g))
    });
    assert!(queued(2).await, "the newcomer never queued");
    g.release().await.expect("release");
    let got = tokio::time::timeout(GENEROUS, waiter)
        .await
        .expect("the waiter finished")
        .expect("waiter task");
    assert!(
        matches!(got, Err(Error::LockLost(_))),
        "a waiter whose entry was deleted took the lock beside the newcomer: {got:?}"
    );
    let (_, mut gc) = tokio::time::timeout(GENEROUS, newcomer)
        .await
        .expect("the newcomer finished")
        .expect("newcomer task")
        .expect("the newcomer gets the lock");
    gc.release().await.expect("release");
    assert_eq!(leftovers(&a, &name).await, 0, "entries left under {name}");
    for x in [a, b, c] {
        x.close().await.expect("close");
    }
}

/// Token bookkeeping without an extra dependency.
mod parking_lot_free {
    #[derive(Default)]
    pub struct Tokens(std::sync::Mutex<Vec<u64>>);
    impl Tokens {
        pub fn push(&self, t: u64) {
            self.0.lock().expect("poisoned").push(t);
        }
        pub fn take(&self) -> Vec<u64> {
            std::mem::take(&mut *self.0.lock().expect("poisoned"))
        }
    }
}

/// An ability the backend lacks is a typed error at the call, with nothing written: a
/// revocable lock, a revocation request and a shared permit count on every backend but
/// ZooKeeper; the CLI says so with exit code 64. Where the backend has the ability, the
/// same calls work.
pub async fn missing_capabilities_fail_at_the_call(_kind: Kind, url: &str) {
    use dlock::Capability;
    let name = unique("caps");
    let c = client(url).await;
    let backend = c.backend().clone();
    let unsupported = |e: &Error, wanted: Capability| matches!(e, Error::Unsupported { capability, .. } if *capability == wanted);
    let mutex = c.mutex(&name).expect("n");
    if backend.supports(Capability::Revocation) {
        let mut g = mutex.lock_revocable().await.expect("revocable lock");
        assert_eq!(c.revoke(&name).await.expect("revoke"), 1);
        g.release().await.expect("release");
    } else {
        let e = mutex
            .lock_revocable()
            .await
            .map(|_| ())
            .expect_err("a revocable lock needs revocation");
        assert!(unsupported(&e, Capability::Revocation), "{e:?}");
        let e = c.revoke(&name).await.expect_err("revoke needs revocation");
        assert!(unsupported(&e, Capability::Revocation), "{e:?}");
        let code = crate::support::dlock()
            .args(["--url", url, "exec", &name, "--revocable", "--", "true"])
            .output()
            .expect("run dlock")
            .status
            .code();
        assert_eq!(code, Some(64), "`exec --revocable` without revocation");
    }
    let shared = dlock::Semaphore::with_shared_count(&c, &name, &format!("{name}-count"));
    if backend.supports(Capability::SharedValue) {
        assert!(shared.is_ok(), "{:?}", shared.err());
    } else {
        let e = shared
            .map(|_| ())
            .expect_err("a shared count needs a shared value");
        assert!(unsupported(&e, Capability::SharedValue), "{e:?}");
    }
    assert_eq!(leftovers(&c, &name).await, 0, "nothing was written");
    c.close().await.expect("close");
}

/// `Client::health` answers `Ok` while the session is live and the server answers, and
/// an error once the client is closed.
pub async fn health_is_ok_while_live_and_an_error_after_close(_kind: Kind, url: &str) {
    let c = client(url).await;
    c.health().await.expect("a live client is healthy");
    c.close().await.expect("close");
    let e = c
        .health()
        .await
        .expect_err("a closed client is not healthy");
    assert!(e.is_lost(), "{e:?}");
}

/// Two applications on one server, each in its own namespace (`?prefix=` on Redis,
/// `?namespace=` on etcd, a chroot on ZooKeeper), take the same lock name at once and
/// never see each other's entries; inside one namespace the lock still excludes.
pub async fn namespaces_keep_applications_apart(kind: Kind, url: &str) {
    let tag = unique("ns").replace('/', "-");
    let within = |app: &str| match kind {
        Kind::Zk => format!("{url}/{tag}-{app}"),
        Kind::Etcd => format!("{url}?namespace={tag}-{app}/"),
        _ => format!("{url}?prefix={tag}-{app}:"),
    };
    let (a, b, a2) = (
        client(&within("a")).await,
        client(&within("b")).await,
        client(&within("a")).await,
    );
    let name = unique("shared-name");
    let mut ga = a
        .mutex(&name)
        .expect("n")
        .try_lock()
        .await
        .expect("a takes it");
    let mut gb = b
        .mutex(&name)
        .expect("n")
        .try_lock()
        .await
        .expect("b takes the same name in its own namespace");
    assert!(matches!(
        a2.mutex(&name).expect("n").try_lock().await,
        Err(Error::WouldBlock)
    ));
    assert_eq!(leftovers(&a, &name).await, 1, "a sees only its own entry");
    assert_eq!(leftovers(&b, &name).await, 1, "b sees only its own entry");
    ga.release().await.expect("release");
    gb.release().await.expect("release");
    for c in [a, b, a2] {
        c.close().await.expect("close");
    }
    if kind == Kind::Redis {
        // Databases: `redis://h:p/N` keeps its keys in database N.
        let (d3, d4, d3b, d0) = (
            client(&format!("{url}/3")).await,
            client(&format!("{url}/4")).await,
            client(&format!("{url}/3")).await,
            client(url).await,
        );
        let mut g3 = d3.mutex(&name).expect("n").try_lock().await.expect("db 3");
        let mut g4 = d4
            .mutex(&name)
            .expect("n")
            .try_lock()
            .await
            .expect("the same name in database 4");
        assert!(matches!(
            d3b.mutex(&name).expect("n").try_lock().await,
            Err(Error::WouldBlock)
        ));
        assert_eq!(leftovers(&d0, &name).await, 0, "database 0 sees nothing");
        assert_eq!(
            leftovers(&d3, &name).await,
            1,
            "database 3 sees its own entry"
        );
        g3.release().await.expect("release");
        g4.release().await.expect("release");
        for c in [d3, d4, d3b, d0] {
            c.close().await.expect("close");
        }
    }
}
