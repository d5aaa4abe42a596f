//! The fair-queue acquire loop every recipe shares: add an entry, ask the driver, watch
//! the one entry it names, repeat; and the clean-up that makes every acquire
//! cancellation-safe.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::driver::{Decision, Snapshot};
use dlock_core::{
    DynBackend, Entry, EntryKind, Error, Gone, Position, QueuePath, Result, Ticket, Woken,
};
use futures::future::{BoxFuture, FutureExt as _, Map, Shared};
use tokio::time::Instant;

/// How long an acquire may wait.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Wait {
    /// Until acquired (or the session is lost).
    Forever,
    /// Until this instant, then [`Error::Timeout`] with the original duration.
    Until(Instant, Duration),
    /// Not at all: [`Error::WouldBlock`] if anyone conflicting is ahead.
    No,
    /// A zero timeout: one attempt, as [`Wait::No`], that takes a free lock;
    /// [`Error::Timeout`] of zero if anyone conflicting is ahead.
    Zero,
}

impl Wait {
    /// At most `d`; a zero `d` still asks once (a free lock is taken), as tokio's
    /// `timeout(ZERO, ..)` polls its future once. A `d` too long for the clock to add
    /// (`Duration::MAX`, a common way to say "forever") waits forever.
    pub(crate) fn timeout(d: Duration) -> Self {
        if d.is_zero() {
            return Wait::Zero;
        }
        match Instant::now().checked_add(d) {
            Some(deadline) => Wait::Until(deadline, d),
            None => Wait::Forever,
        }
    }

    /// The error of an attempt that found someone conflicting ahead, if this wait does
    /// not wait for them.
    pub(crate) fn refusal(self) -> Option<Error> {
        match self {
            Wait::No => Some(Error::WouldBlock),
            Wait::Zero => Some(Error::Timeout(Duration::ZERO)),
            Wait::Forever | Wait::Until(..) => None,
        }
    }
}

/// Runs `fut` under the deadline of `wait`: [`Error::Timeout`] with the caller's duration
/// once it passes.
pub(crate) async fn within<T>(
    wait: Wait,
    fut: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    match wait {
        Wait::Until(deadline, d) => tokio::time::timeout_at(deadline, fut)
            .await
            .unwrap_or(Err(Error::Timeout(d))),
        Wait::Forever | Wait::No | Wait::Zero => fut.await,
    }
}

/// Where the clean-ups a drop leaves behind run: the tokio runtime the client was made on.
///
/// Guards and acquire futures are `Send`, and a `Drop` cannot await, so a removal left
/// by one is spawned as a task. It must run where the client's session is kept alive,
/// which is not always where the drop happens:
/// - a plain `std::thread` or a rayon worker has no runtime at all;
/// - a short-lived runtime (a synchronous wrapper that runs `block_on` on a runtime of
///   its own per call) is current at the drop but runs no task spawned on it once its
///   `block_on` returns, and discards them when dropped.
///
/// Either way the entry would stay for as long as the session lives (the backend's own
/// tasks keep the session alive), and every other contender would wait for the process
/// to end. Next in line come the runtime the lock was taken on (for a client made
/// outside any runtime, or on one that has shut down since), then the one current at
/// the drop.
#[derive(Clone, Debug, Default)]
pub(crate) struct Runtime {
    /// The client's runtime.
    home: Option<tokio::runtime::Handle>,
    /// The runtime the lock was taken on.
    taken: Option<tokio::runtime::Handle>,
}

impl Runtime {
    /// The runtime of the calling code, if any, as a client's.
    pub(crate) fn current() -> Self {
        Runtime {
            home: tokio::runtime::Handle::try_current().ok(),
            taken: None,
        }
    }

    /// This client's runtime, with the current one (an acquire's) next in line.
    pub(crate) fn or_current(&self) -> Self {
        Runtime {
            home: self.home.clone(),
            taken: tokio::runtime::Handle::try_current().ok(),
        }
    }

    /// Spawns the task `make` builds on the client's runtime; if there is none, or it has
    /// shut down (tokio then cancels the task inside `spawn`, unrun), on the runtime the
    /// lock was taken on, then on the one current now. False when none took it.
    pub(crate) fn spawn<F>(&self, make: impl Fn() -> F) -> bool
    where
        F: std::future::Future<Output = ()> + Send + 'static,
    {
        /// Whether `rt` took the task: a task bound to a runtime that has shut down is
        /// cancelled before `spawn` returns (one that already ran to its end, on a
        /// worker of a live runtime, was taken).
        fn took(
            rt: &tokio::runtime::Handle,
            task: impl std::future::Future<Output = ()> + Send + 'static,
        ) -> bool {
            !matches!(
                futures::FutureExt::now_or_never(rt.spawn(task)),
                Some(Err(e)) if e.is_cancelled()
            )
        }
        for kept in [&self.home, &self.taken].into_iter().flatten() {
            if took(kept, make()) {
                return true;
            }
        }
        match tokio::runtime::Handle::try_current() {
            Ok(now) => took(&now, make()),
            Err(_) => false,
        }
    }
}

/// Removes a ticket's entry when dropped while armed. An acquire future that is dropped
/// at any await point (a `select!`, a timeout, an aborted task) thereby still removes
/// whatever its enqueue may have created, in the background.
pub(crate) struct AbandonOnDrop<B: DynBackend + ?Sized> {
    backend: Arc<B>,
    q: QueuePath,
    ticket: Ticket,
    armed: bool,
    /// Where a removal left by a drop runs (see [`Runtime`]).
    rt: Runtime,
}

impl<B: DynBackend + ?Sized> AbandonOnDrop<B> {
    pub(crate) fn new(backend: Arc<B>, q: QueuePath, ticket: Ticket, rt: Runtime) -> Self {
        AbandonOnDrop {
            backend,
            q,
            ticket,
            armed: true,
            rt,
        }
    }

    /// The attempt succeeded: its entry now belongs to a guard.
    pub(crate) fn disarm(mut self) {
        self.armed = false;
    }

    /// The attempt failed: remove its entry now, so the caller sees a clean server
    /// when the error reaches it.
    pub(crate) async fn abandon_now(mut self) {
        // Stay armed until the removal succeeded: if this future is dropped halfway, or
        // the removal fails, `Drop` retries it in the background.
        match self.backend.abandon(&self.q, &self.ticket).await {
            Ok(()) => self.armed = false,
            Err(e) => {
                tracing::warn!(queue = %self.q, error = %e, "abandon failed; retrying in the background");
            }
        }
    }
}

impl<B: DynBackend + ?Sized> Drop for AbandonOnDrop<B> {
    fn drop(&mut self) {
        if self.armed {
            spawn_abandon(
                &self.rt,
                self.backend.clone(),
                self.q.clone(),
                self.ticket.clone(),
            );
        }
    }
}

/// The longest pause between two attempts of a background removal.
const REMOVAL_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// The pause after failed background removal attempt `attempt` (from 0): 100 ms,
/// doubling, at most [`REMOVAL_BACKOFF_MAX`].
fn removal_backoff(attempt: u32) -> Duration {
    Duration::from_millis(100u64 << attempt.min(10)).min(REMOVAL_BACKOFF_MAX)
}

/// Runs `op` (a removal) until it succeeds, fails with an error after which the
/// session's entries are gone anyway ([`Error::is_lost`]: lost, or the client closed),
/// or `ended` completes with such an error (the session that keeps the entry ended, so
/// the server removes it). It never gives up while the session lives: an entry left under a live session
/// (an etcd lease or a Redis watchdog that keeps renewing it, a ZooKeeper session that
/// keeps pinging) is a ghost that every other contender waits behind for as long as the
/// process runs.
async fn remove_until_done<F>(
    q: &QueuePath,
    what: &str,
    mut op: F,
    ended: impl std::future::Future<Output = Ending>,
) where
    F: FnMut() -> BoxFuture<'static, Result<()>>,
{
    let retry = async {
        for attempt in 0u32.. {
            match op().await {
                Ok(()) => return,
                Err(e) if e.is_lost() => return,
                Err(e) => {
                    // Loud now and then, so a removal that keeps failing (a server that
                    // refuses it) is seen, without a line per attempt.
                    if attempt % 10 == 4 {
                        tracing::warn!(queue = %q, attempt, error = %e, "background {what} still failing; retrying while the session lives");
                    } else {
                        tracing::debug!(queue = %q, attempt, error = %e, "background {what} failed");
                    }
                    tokio::time::sleep(removal_backoff(attempt)).await;
                }
            }
        }
    };
    // `ended` is the entry's lost signal, made before the first removal was sent. On
    // ZooKeeper, etcd and the in-memory backend it is the session's. On Redis it is the
    // entry's: a removal takes the entry out of the registry with its first request,
    // and the signal then completes one lease later (the unrenewed key is gone by then),
    // with `LockLost`, which ends the retries; anything that is not a loss (`NotHeld`)
    // must not end them: on Redis a lone entry moved into the queue layout takes a
    // second script to go, and without it the next holder waits for the key to expire.
    let ended = async {
        let e = ended.await;
        if e.lost {
            e.reason
        } else {
            std::future::pending().await
        }
    };
    tokio::select! {
        () = retry => {}
        reason = ended => tracing::debug!(queue = %q, %reason, "session ended; its entries go with it"),
    }
}

/// Background removal of a ticket's entry, retried while the session lives (see
/// [`remove_until_done`]).
fn spawn_abandon<B: DynBackend + ?Sized>(
    rt: &Runtime,
    backend: Arc<B>,
    q: QueuePath,
    ticket: Ticket,
) {
    let task = || {
        let (backend, q, ticket) = (backend.clone(), q.clone(), ticket.clone());
        async move {
            // An abandoned attempt has no entry to ask `lost()` about: the retries end on
            // success, or when the backend says the session is gone or closed.
            let op = || {
                let (backend, q, ticket) = (backend.clone(), q.clone(), ticket.clone());
                Box::pin(async move { backend.abandon(&q, &ticket).await }) as BoxFuture<'static, _>
            };
            remove_until_done(&q, "abandon", op, std::future::pending()).await;
        }
    };
    if !rt.spawn(task) {
        tracing::warn!(queue = %q, "no tokio runtime to remove an abandoned entry; it goes with the session");
    }
}

/// What a hold's lost signal said, in a form every clone of the signal can have.
#[derive(Clone, Debug)]
pub(crate) struct Ending {
    /// [`Error::is_lost`] of the backend's answer: the session (or, on Redis, the
    /// entry's lease) ended, or the client was closed. False for an entry this client
    /// released, which ends nothing.
    pub(crate) lost: bool,
    /// Why, as a guard reports it.
    pub(crate) reason: String,
}

impl Ending {
    /// What `e`, a lost future's answer, says.
    pub(crate) fn of(e: Error) -> Ending {
        let lost = e.is_lost();
        let reason = match e {
            Error::LockLost(msg) => msg,
            other => other.to_string(),
        };
        Ending { lost, reason }
    }
}

/// A hold's lost signal, shared by its guards and by the background removal of its
/// entry: what the backend's lost future said, once it completed. Awaited through
/// `LockGuard::lost`; never polled to peek (the grant, re-entries and the release ask
/// [`dlock_core::Backend::lost_now`]: see `Held::lost_reason`).
///
/// Made at the grant, not at the first `LockGuard::lost`: a lost future made after the
/// loss still completes at once, but some backends (Redis) forget the reason with the
/// entry and would give a generic one, or, once this client's own removal has started,
/// call the entry lost (see [`spawn_remove`]).
///
/// The backend's boxed future mapped in place, not boxed again: one allocation less per
/// hold.
pub(crate) type LostSignal = Shared<Map<BoxFuture<'static, Error>, fn(Error) -> Ending>>;

/// `lost`, a backend's lost future, shared.
pub(crate) fn lost_signal(lost: BoxFuture<'static, Error>) -> LostSignal {
    lost.map(Ending::of as fn(Error) -> Ending).shared()
}

/// Background removal of a held entry (a guard dropped without `release`, or a release
/// that failed), retried while the session lives (see [`remove_until_done`]).
///
/// `ended` is the entry's lost signal made before the first removal was sent, which
/// on Redis is the difference that matters: a removal takes the entry out of the
/// registry its renewals and lost signals come from before it sends anything, so a
/// signal made after a failed first removal would find no entry and report it lost,
/// and the retries would stop at once, leaving the entry on the server, unrenewed,
/// until its lease runs out.
pub(crate) fn spawn_remove<B: DynBackend + ?Sized>(
    rt: &Runtime,
    backend: Arc<B>,
    q: QueuePath,
    entry: Entry,
    ended: LostSignal,
) {
    let task = || {
        let (backend, q, entry, ended) = (backend.clone(), q.clone(), entry.clone(), ended.clone());
        async move {
            let op = || {
                let (backend, q, entry) = (backend.clone(), q.clone(), entry.clone());
                Box::pin(async move { backend.remove(&q, &entry).await }) as BoxFuture<'static, _>
            };
            remove_until_done(&q, "release", op, ended).await;
        }
    };
    if !rt.spawn(task) {
        tracing::warn!(queue = %q, "no tokio runtime to release a dropped guard; the entry goes with the session");
    }
}

/// [`DynBackend::wait_gone_behind`] on owned arguments, so the watch can outlive one
/// loop turn: a waiter whose own entry is `mine` waits for `entry` to go.
pub(crate) fn watch_gone_behind<B: DynBackend + ?Sized>(
    backend: Arc<B>,
    q: QueuePath,
    entry: Entry,
    mine: Entry,
) -> BoxFuture<'static, Result<Woken>> {
    Box::pin(async move { backend.wait_gone_behind(&q, &entry, &mine).await })
}

/// [`DynBackend::wait_gone_detail`] on owned arguments, so the watch can outlive one loop
/// turn.
pub(crate) fn watch_gone<B: DynBackend + ?Sized>(
    backend: Arc<B>,
    q: QueuePath,
    entry: Entry,
) -> BoxFuture<'static, Result<Gone>> {
    Box::pin(async move { backend.wait_gone_detail(&q, &entry).await })
}

/// `mine`, once it is known to have been queued when the entry ahead went: the last
/// step of a grant made from a waiter's own view after a watch said that entry went.
/// `proven` is the watch's own word ([`Woken::mine_queued`]); without it, the server is
/// asked.
///
/// The view cannot see the waiter's own entry go. Deleted from outside while it waited
/// (an operator's delete, a revoked lease, a server that lost keys), the entry is no
/// longer ahead of anyone, so the contender that queued after it takes the lock when
/// the same entry goes, and without this read both would hold.
/// [`DynBackend::still_queued`] answers for a moment no earlier than the change the
/// waiter's watch reported, so an entry it finds was there when the one ahead went. At
/// most one read per handoff, on the waiter's side, and none where the watch's ordered
/// events already showed the entry there. Curator lists the queue on every wake and
/// etcd's lock reads its own key after its wait for the same reason. A grant from a
/// listing that named `mine` needs none.
pub(crate) async fn confirmed<B: DynBackend + ?Sized>(
    backend: &B,
    q: &QueuePath,
    mine: Entry,
    proven: bool,
) -> Result<Entry> {
    if proven || backend.still_queued(q, &mine).await? {
        Ok(mine)
    } else {
        Err(Error::LockLost(format!(
            "entry {} was deleted from {q} while it waited",
            mine.name
        )))
    }
}

/// Adds an entry of `kind` to `q` and waits until the driver grants it.
///
/// On any error (timeout, would-block, lost session) the entry is removed before the
/// error is returned; if the returned future is dropped, it is removed in the
/// background, on `rt` (see [`Runtime`]).
#[allow(clippy::too_many_arguments)]
pub(crate) async fn acquire<B: DynBackend + ?Sized>(
    backend: &Arc<B>,
    q: &QueuePath,
    ticket: Ticket,
    kind: EntryKind,
    at: Position<'_>,
    data: &[u8],
    wait: Wait,
    rt: &Runtime,
) -> Result<Entry> {
    let cleanup = AbandonOnDrop::new(backend.clone(), q.clone(), ticket.clone(), rt.clone());
    let attempt = async {
        let enq = backend.enqueue(q, &ticket, kind, at, data).await?;
        let mine = enq.mine;
        let mut view = Snapshot::new(enq.queue, &mine.name);
        // Armed at the first wait: a grant at once needs no lost signal here (the hold
        // takes its own, and checks it before it is handed out).
        let mut lost: Option<BoxFuture<'static, Error>> = None;
        let watch_ahead = backend.hints().watch_ahead;
        // The watch on the entry this waiter waits on, kept across a re-listing that
        // names the same entry again, so it is armed once.
        let mut watch: Option<(String, BoxFuture<'static, Result<Woken>>)> = None;
        loop {
            let (blocker, next) = match view.decide(&mine.name) {
                Decision::Acquired => return Ok(mine),
                Decision::Missing => {
                    return Err(Error::LockLost(format!(
                        "entry {} vanished from {q} while waiting",
                        mine.name
                    )))
                }
                Decision::Wait(blocker) => {
                    let next = watch_ahead
                        .then(|| view.next_blocker(&mine.name).cloned())
                        .flatten();
                    (blocker.clone(), next)
                }
            };
            if let Some(refused) = wait.refusal() {
                return Err(refused);
            }
            tracing::trace!(queue = %q, mine = %mine.name, watching = %blocker.name, next = ?next.as_ref().map(|e| &e.name), "waiting");
            let mut gone = match watch.take() {
                Some((name, fut)) if name == blocker.name => fut,
                _ => watch_gone_behind(backend.clone(), q.clone(), blocker.clone(), mine.clone()),
            };
            // Both watches are armed in the same poll, so in one round trip.
            let mut next_gone = match next {
                Some(e) => watch_gone(backend.clone(), q.clone(), e),
                None => Box::pin(futures::future::pending()),
            };
            let lost = lost.get_or_insert_with(|| backend.lost(q, &mine));
            tokio::select! {
                // A session lost at the moment the blocker went is lost: never granted.
                biased;
                e = lost => return Err(e),
                r = &mut gone => {
                    // Told the blocker went as the head, the view needs no listing
                    // however stale it is (see `Snapshot::without_head`).
                    // Found vanished, it may have gone with mine: only a fresh listing,
                    // which would no longer name mine, can tell.
                    let woken = r?;
                    let granted = match woken.gone {
                        Gone::Head => view.without_head(&blocker.name, &mine.name),
                        Gone::Vanished => false,
                        _ => view.without(&blocker.name, &mine.name),
                    };
                    if granted {
                        return confirmed(backend.as_ref(), q, mine, woken.mine_queued).await;
                    }
                }
                r = &mut next_gone => {
                    r?;
                    // The entry ahead of the blocker went: list again now, while the
                    // blocker may still hold, so its release needs no listing.
                    watch = Some((blocker.name.clone(), gone));
                }
            }
            // Only what is ahead of mine decides: O(entries ahead), not O(queue).
            view = Snapshot::new(backend.queue_ahead(q, &mine).await?, &mine.name);
        }
    };
    match within(wait, attempt).await {
        Ok(entry) => {
            cleanup.disarm();
            Ok(entry)
        }
        Err(e) => {
            cleanup.abandon_now().await;
            Err(e)
        }
    }
}
