//! A removal that fails never leaves a ghost behind a live session: a real backend, behind
//! a wrapper whose first removals fail as an unreachable server's would, still ends with
//! the entry gone while its session lives, so the next contender gets in.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use dlock::{Error, Result};
use dlock_testkit::tap::{Call, Tap, Tapped};

use crate::support::{client, client_with, eventually, leftovers, unique, Kind};

/// More failures than the old background retry made (one release, then five): the entry
/// must still go.
const FAILURES: usize = 7;

/// Long enough for [`FAILURES`] retries at their longest back-off, far shorter than the
/// session that keeps the entry.
const WITHIN: Duration = Duration::from_secs(20);

/// Fails the first `remove` and `abandon` calls with [`Error::Unreachable`] before they
/// reach the server; every other call, and every later removal, goes through unchanged.
struct FailingRemovals {
    removes_to_fail: AtomicUsize,
    abandons_to_fail: AtomicUsize,
    removes_failed: AtomicUsize,
    abandons_failed: AtomicUsize,
}

impl FailingRemovals {
    fn new(removes: usize, abandons: usize) -> Self {
        FailingRemovals {
            removes_to_fail: AtomicUsize::new(removes),
            abandons_to_fail: AtomicUsize::new(abandons),
            removes_failed: AtomicUsize::new(0),
            abandons_failed: AtomicUsize::new(0),
        }
    }

    /// Takes one failure from `budget` if any is left.
    fn fail(budget: &AtomicUsize, count: &AtomicUsize) -> bool {
        let took = budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if took {
            count.fetch_add(1, Ordering::SeqCst);
        }
        took
    }
}

impl Tap for FailingRemovals {
    // Decided at the call, as a server refusing the request would.
    fn begin(&self, call: Call) -> Result<()> {
        match call {
            Call::Remove if Self::fail(&self.removes_to_fail, &self.removes_failed) => {
                Err(Error::Unreachable("injected: remove".into()))
            }
            Call::Abandon if Self::fail(&self.abandons_to_fail, &self.abandons_failed) => {
                Err(Error::Unreachable("injected: abandon".into()))
            }
            _ => Ok(()),
        }
    }
}

/// A release whose removal fails again and again, and a waiter's clean-up that does the
/// same, both still remove their entries while the session lives: nobody waits behind a
/// ghost. (Before, the background retry gave up after five attempts and the entry stayed
/// under a session that kept being renewed.)
pub async fn failed_removals_keep_trying_while_the_session_lives(_kind: Kind, url: &str) {
    let name = unique("ghost");
    let real = client(url).await;
    let observer = client(url).await;
    let flaky = Tapped::new(
        real.backend().clone(),
        FailingRemovals::new(FAILURES, FAILURES),
    );
    let c = dlock::Client::new(flaky.clone() as std::sync::Arc<dyn dlock::DynBackend>);

    // A held entry whose release keeps failing.
    let mut g = c.mutex(&name).expect("name").lock().await.expect("lock");
    let released = g.release().await;
    assert!(
        matches!(released, Err(Error::Unreachable(_))),
        "the injected failure should reach the caller: {released:?}"
    );
    assert!(
        eventually(WITHIN, || async { leftovers(&observer, &name).await == 0 }).await,
        "the released entry is still queued after {} failed removals (the session lives)",
        flaky.tap().removes_failed.load(Ordering::SeqCst)
    );
    assert_eq!(flaky.tap().removes_failed.load(Ordering::SeqCst), FAILURES);
    let mut next = observer
        .mutex(&name)
        .expect("name")
        .try_lock()
        .await
        .expect("the next contender gets in");

    // A waiter's entry whose clean-up keeps failing.
    let refused = c.mutex(&name).expect("name").try_lock().await;
    assert!(matches!(refused, Err(Error::WouldBlock)), "{refused:?}");
    assert!(
        eventually(WITHIN, || async { leftovers(&observer, &name).await == 1 }).await,
        "the refused waiter's entry is still queued after {} failed removals",
        flaky.tap().abandons_failed.load(Ordering::SeqCst)
    );
    assert_eq!(flaky.tap().abandons_failed.load(Ordering::SeqCst), FAILURES);
    next.release().await.expect("release");
    assert_eq!(leftovers(&observer, &name).await, 0);

    real.close().await.expect("close");
    observer.close().await.expect("close");
}

/// A guard dropped unreleased while another client waits hands the lock on long before the
/// dropped holder's session would end (60 s here): its background release runs to the
/// end. On Redis a lone holder's entry is one key, which the waiter's enqueue moves into
/// the queue layout, so that release takes two scripts (the lone-entry release answers
/// "queued now", then the queue's removal). Before, the first script's settling of the
/// entry completed the entry's own lost signal, which the background retry took for the
/// session's end: it stopped after one script, and the waiter got the lock only when the
/// key expired, a whole lease later.
pub async fn a_dropped_guard_hands_the_lock_on_before_its_session_ends(_kind: Kind, url: &str) {
    let name = unique("dropped");
    let a = client_with(
        url,
        dlock::SessionOptions::default().with_session_timeout(Duration::from_secs(60)),
    )
    .await;
    let b = client(url).await;
    let held = a.mutex(&name).expect("n").lock().await.expect("lock");
    let waiter = {
        let m = b.mutex(&name).expect("n");
        tokio::spawn(async move { m.lock_timeout(WITHIN).await })
    };
    assert!(
        eventually(WITHIN, || async { leftovers(&a, &name).await == 2 }).await,
        "the waiter never queued"
    );
    drop(held);
    let mut g = waiter
        .await
        .expect("waiter task")
        .expect("the dropped guard's lock was handed on before its 60 s session ended");
    g.release().await.expect("release");
    assert_eq!(leftovers(&a, &name).await, 0);
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// `b` gets the lock `name` within [`WITHIN`] (`why` says what should have handed it
/// on), releases it, and nothing of the lock is left.
async fn handed_on(b: &dlock::Client, name: &str, why: &str) {
    let mut g = b
        .mutex(name)
        .expect("n")
        .lock_timeout(WITHIN)
        .await
        .unwrap_or_else(|e| panic!("{why}: {e:?}"));
    g.release().await.expect("release");
    assert_eq!(leftovers(b, name).await, 0);
}

/// A hold on `name` by `a` and a waiter of `c` queued behind it (both clients with 60 s
/// sessions, so only a removal frees the lock in a test's time), and `b` to look.
struct HeldAndWaiting {
    a: dlock::Client,
    b: dlock::Client,
    c: dlock::Client,
    held: dlock::LockGuard,
    waiting: std::pin::Pin<Box<dyn std::future::Future<Output = Result<dlock::LockGuard>> + Send>>,
}

async fn held_and_waiting(url: &str, name: &str) -> HeldAndWaiting {
    let long = || {
        client_with(
            url,
            dlock::SessionOptions::default().with_session_timeout(Duration::from_secs(60)),
        )
    };
    let (a, c) = (long().await, long().await);
    let b = client(url).await;
    let held = a.mutex(name).expect("n").lock().await.expect("lock");
    let m = c.mutex(name).expect("n");
    let mut waiting: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> =
        Box::pin(async move { m.lock().await });
    tokio::select! {
        r = &mut waiting => panic!("the waiter got a held lock: {r:?}"),
        queued = eventually(WITHIN, || async { leftovers(&b, name).await == 2 }) => {
            assert!(queued, "the waiter never queued");
        }
    }
    HeldAndWaiting {
        a,
        b,
        c,
        held,
        waiting,
    }
}

/// A waiting acquire and a held guard dropped on a thread with no tokio runtime (both are
/// `Send`; a plain `std::thread`, a rayon worker or the last `Arc` let go there) still
/// remove their entries, on the runtime they were made on, long before their 60 s
/// sessions would end. Before, the clean-up found no runtime to run on, logged a warning
/// and gave up, and the entries stayed under sessions the backends kept alive: every
/// other contender waited for the process to end.
pub async fn entries_dropped_off_the_runtime_still_go(_kind: Kind, url: &str) {
    let name = unique("offrt");
    let HeldAndWaiting {
        a,
        b,
        c,
        held,
        waiting,
    } = held_and_waiting(url, &name).await;
    std::thread::spawn(move || drop(waiting))
        .join()
        .expect("drop thread");
    assert!(
        eventually(WITHIN, || async { leftovers(&b, &name).await == 1 }).await,
        "the waiter dropped off the runtime left its entry queued"
    );

    std::thread::spawn(move || drop(held))
        .join()
        .expect("drop thread");
    handed_on(
        &b,
        &name,
        "the guard dropped off the runtime handed the lock on",
    )
    .await;
    for c in [a, b, c] {
        c.close().await.expect("close");
    }
}

/// Runs `f` on a thread of its own inside a short-lived current-thread runtime, and
/// drops that runtime before returning: the shape of a synchronous wrapper that makes a
/// runtime per call. Such a runtime runs no task spawned on it once its `block_on`
/// returns, and discards them when it is dropped.
async fn in_a_short_lived_runtime<T: Send + 'static>(
    f: impl std::future::Future<Output = T> + Send + 'static,
) -> T {
    tokio::task::spawn_blocking(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let out = rt.block_on(f);
        drop(rt);
        out
    })
    .await
    .expect("the short-lived runtime's thread")
}

/// Clean-ups run on the runtime the client was made on, where its session is kept
/// alive, not on whatever runtime is current at the drop: a guard or a waiting acquire
/// dropped inside a short-lived runtime (one that would discard the removal unrun), or
/// a guard taken on such a runtime and dropped after it is gone, still hands the lock
/// on while the session lives; and a client made on a runtime gone since falls back to
/// the runtime its lock was taken on.
pub async fn entries_dropped_inside_another_runtime_still_go(_kind: Kind, url: &str) {
    let name = unique("otherrt");
    let HeldAndWaiting {
        a,
        b,
        c,
        held,
        waiting,
    } = held_and_waiting(url, &name).await;
    in_a_short_lived_runtime(async move { drop(waiting) }).await;
    assert!(
        eventually(WITHIN, || async { leftovers(&b, &name).await == 1 }).await,
        "the waiter dropped inside a short-lived runtime left its entry queued"
    );

    in_a_short_lived_runtime(async move { drop(held) }).await;
    handed_on(
        &b,
        &name,
        "the guard dropped inside a short-lived runtime handed the lock on",
    )
    .await;

    // Taken on a short-lived runtime, dropped where no runtime is current once that
    // runtime is gone.
    let m = a.mutex(&name).expect("n");
    let taken = in_a_short_lived_runtime(async move { m.lock().await.expect("lock") }).await;
    std::thread::spawn(move || drop(taken))
        .join()
        .expect("drop thread");
    handed_on(
        &b,
        &name,
        "a guard taken on a runtime gone since handed the lock on when dropped",
    )
    .await;

    // A client made on a short-lived runtime (gone since), over a backend whose session
    // lives here: a guard it takes here and drops where no runtime is current is
    // removed on the runtime the lock was taken on.
    let backend = a.backend().clone();
    let made_elsewhere = in_a_short_lived_runtime(async move { dlock::Client::new(backend) }).await;
    let taken = made_elsewhere
        .mutex(&name)
        .expect("n")
        .lock()
        .await
        .expect("lock");
    std::thread::spawn(move || drop(taken))
        .join()
        .expect("drop thread");
    handed_on(
        &b,
        &name,
        "a guard of a client made on a runtime gone since handed the lock on when dropped",
    )
    .await;
    drop(made_elsewhere);
    for c in [a, b, c] {
        c.close().await.expect("close");
    }
}
