//! A hold's synchronous checks (`is_lost`, re-entry, `verify`'s first look) see a loss
//! the backend already knows, even while another task is in the middle of polling the
//! hold's lost signal.
//!
//! A guard's `lost()` futures share one signal. If a peek went through that shared
//! future, a peek made while another task's poll of it is under way could not look
//! (a `futures::future::Shared` answers `Pending` to everyone but the task polling
//! it): `is_lost()` would say false, and a lost hold would be re-entered. On an
//! oversubscribed machine a thread can be preempted in that poll for milliseconds,
//! long enough for the next holder to be granted. The backend here stalls the first
//! poll of a lost future on another thread, to hold that window open.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use dlock_core::{DynBackend, Error, QueuePath, SessionOptions};
use dlock_recipes::Client;
use dlock_testkit::mem::MemServer;
use dlock_testkit::tap::{Tap, Tapped};
use futures::future::BoxFuture;

/// Holds the next poll of a lost future, wherever it runs, until told to go on.
struct Stall {
    armed: AtomicBool,
    entered: Mutex<mpsc::Sender<()>>,
    go: Mutex<mpsc::Receiver<()>>,
}

/// Hands out lost futures whose first poll after [`Stall::armed`] is set blocks its
/// thread (as a preempted thread would stop) until the test lets it go.
struct Stalling(Arc<Stall>);

impl Tap for Stalling {
    fn lost(&self, signal: BoxFuture<'static, Error>) -> BoxFuture<'static, Error> {
        Box::pin(StalledLost {
            inner: signal,
            stall: self.0.clone(),
        })
    }
}

struct StalledLost {
    inner: BoxFuture<'static, Error>,
    stall: Arc<Stall>,
}

impl Future for StalledLost {
    type Output = Error;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Error> {
        if self.stall.armed.swap(false, Ordering::SeqCst) {
            let entered = self.stall.entered.lock().expect("entered").clone();
            entered.send(()).expect("the test waits for the stall");
            self.stall
                .go
                .lock()
                .expect("go")
                .recv()
                .expect("the test lets the stall go");
        }
        self.inner.as_mut().poll(cx)
    }
}

/// A lost hold's guard, whose backend already knows of the loss but whose shared lost
/// signal nobody has polled since; and the stall to arm.
async fn lost_hold() -> (
    dlock_recipes::LockGuard<Tapped<Stalling>>,
    Arc<Stall>,
    mpsc::Receiver<()>,
    mpsc::Sender<()>,
) {
    let server = MemServer::new();
    let inner = server
        .connect(SessionOptions::default().with_session_timeout(Duration::from_secs(4)))
        .await
        .expect("mem session");
    let (entered_tx, entered_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel();
    let stall = Arc::new(Stall {
        armed: AtomicBool::new(false),
        entered: Mutex::new(entered_tx),
        go: Mutex::new(go_rx),
    });
    let backend = Tapped::new(inner.clone(), Stalling(stall.clone()));
    let client = Client::new(backend.clone());
    let guard = client
        .mutex("peek/one")
        .expect("name")
        .lock()
        .await
        .expect("lock");
    assert!(!guard.is_lost(), "just granted");

    // The server expires the session; wait (on a lost future of the backend's own,
    // not the guard's) until the client knows.
    assert!(server.expire_session(inner.session()));
    let q = QueuePath::root(guard.name().clone());
    let known = DynBackend::lost(&*inner, &q, guard.entry());
    let e = tokio::time::timeout(Duration::from_secs(20), known)
        .await
        .expect("the client learns of the expiry");
    assert!(e.is_lost(), "{e:?}");
    (guard, stall, entered_rx, go_tx)
}

/// Polls the guard's lost signal on another thread, stalled inside that poll, and
/// returns once the stall has begun. Joining the thread lets it finish.
fn poll_elsewhere(
    guard: &dlock_recipes::LockGuard<Tapped<Stalling>>,
    stall: &Stall,
    entered: &mpsc::Receiver<()>,
) -> std::thread::JoinHandle<Error> {
    stall.armed.store(true, Ordering::SeqCst);
    let signal = guard.lost();
    let other = std::thread::spawn(move || futures::executor::block_on(signal));
    entered
        .recv_timeout(Duration::from_secs(20))
        .expect("the other thread polls the lost signal");
    other
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn is_lost_sees_a_known_loss_while_another_task_polls_the_signal() {
    let (guard, stall, entered, go) = lost_hold().await;
    let other = poll_elsewhere(&guard, &stall, &entered);
    let seen = guard.is_lost();
    go.send(()).expect("the stalled poll waits");
    let e = other.join().expect("the other thread");
    assert!(e.is_lost(), "{e:?}");
    assert!(
        seen,
        "is_lost() said false for a hold whose loss the backend knew"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_hold_is_not_reentered_while_another_task_polls_the_signal() {
    let (guard, stall, entered, go) = lost_hold().await;
    let other = poll_elsewhere(&guard, &stall, &entered);
    let again = guard.reenter();
    go.send(()).expect("the stalled poll waits");
    other.join().expect("the other thread");
    assert!(
        matches!(again, Err(Error::LockLost(_))),
        "a lost hold was re-entered: {:?}",
        again.as_ref().map(|g| g.token())
    );
}

/// A multi-lock's guard answers `is_lost()` for its parts: true once the backend knows
/// any of them is lost, so a worker can look before it starts under the locks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_multi_guard_is_lost_once_a_part_is() {
    let server = MemServer::new();
    let backend = server
        .connect(SessionOptions::default().with_session_timeout(Duration::from_secs(4)))
        .await
        .expect("mem session");
    let client = Client::new(backend.clone());
    let multi = client
        .multi()
        .mutex("peek/multi/a")
        .and_then(|m| m.mutex("peek/multi/b"))
        .expect("names");
    let guard = multi.acquire().await.expect("acquire");
    assert!(!guard.is_lost(), "just granted");

    assert!(server.expire_session(backend.session()));
    let part = &guard.guards()[1];
    let q = QueuePath::root(part.name().clone());
    let known = DynBackend::lost(&*backend, &q, part.entry());
    let e = tokio::time::timeout(Duration::from_secs(20), known)
        .await
        .expect("the client learns of the expiry");
    assert!(e.is_lost(), "{e:?}");
    assert!(
        guard.is_lost(),
        "a multi guard whose parts are lost says held"
    );
}

/// The synchronous looks at a loss (`is_lost`, re-entry) do not poll a lost future:
/// a task whose budget is spent gets `Pending` from any tokio resource's first poll,
/// and a known loss would be reported held, a lost hold re-entered.
#[tokio::test]
async fn a_task_with_its_budget_spent_still_sees_a_known_loss() {
    // The stall is never armed here: only the budget stands in the way.
    let (guard, _stall, _entered, _go) = lost_hold().await;
    dlock_testkit::contract::spend_task_budget();
    let seen = guard.is_lost();
    let again = guard.reenter();
    assert!(seen, "is_lost() said false for a known loss, budget spent");
    assert!(
        matches!(again, Err(Error::LockLost(_))),
        "a lost hold was re-entered with the budget spent: {:?}",
        again.as_ref().map(|g| g.token())
    );
}
