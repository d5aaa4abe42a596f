//! [`LockGuard`]: proof of holding a lock, with its fencing token and lost signal.

use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dlock_core::{DynBackend, Entry, Error, FencingToken, LockName, QueuePath, Result};
use futures::future::FutureExt;
use tracing::Instrument;

use crate::queue::{lost_signal, spawn_remove, Ending, LostSignal, Runtime};
use crate::reentry::{HoldKey, Recipe, Scope};

/// One entry that holds a lock, shared by every guard of that hold (the first one and
/// its re-entries).
pub(crate) struct Held<B: DynBackend + ?Sized> {
    pub(crate) backend: Arc<B>,
    pub(crate) q: QueuePath,
    pub(crate) entry: Entry,
    pub(crate) token: FencingToken,
    lost: LostSignal,
    /// Which client's which recipe this is; `None` for a semaphore permit, which no
    /// scope re-enters.
    pub(crate) key: Option<HoldKey>,
    /// Guards not yet released. The entry is removed when this drops to zero, and a
    /// hold at zero is never re-entered.
    guards: AtomicUsize,
    /// When the hold was granted, for `dlock_hold_seconds`.
    granted_at: std::time::Instant,
    /// Where a removal left by a dropped guard runs: the client's runtime (see
    /// [`Runtime`]).
    rt: Runtime,
}

/// An entry whose grant was refused, removed in the background ([`spawn_remove`]) when
/// dropped while it still holds it.
struct RefusedGrant<B: DynBackend + ?Sized>(
    Option<(Runtime, Arc<B>, QueuePath, Entry, LostSignal)>,
);

impl<B: DynBackend + ?Sized> Drop for RefusedGrant<B> {
    fn drop(&mut self) {
        if let Some((rt, backend, q, entry, ended)) = self.0.take() {
            spawn_remove(&rt, backend, q, entry, ended);
        }
    }
}

impl<B: DynBackend + ?Sized> Held<B> {
    /// The hold of `entry`, just granted in `q`; or, when it cannot be handed out (no
    /// fencing token, or the session already lost), the entry removed and the reason.
    pub(crate) async fn grant(
        backend: Arc<B>,
        q: QueuePath,
        entry: Entry,
        key: Option<HoldKey>,
        rt: Runtime,
    ) -> Result<Arc<Self>> {
        // The signal is made before the check: on Redis a loss in between would
        // otherwise leave it only the generic reason of an entry no longer registered.
        let lost = lost_signal(backend.lost(&q, &entry));
        match Self::check(&backend, &q, &entry) {
            Ok(token) => Ok(Arc::new(Held {
                lost,
                backend,
                q,
                entry,
                token,
                key,
                guards: AtomicUsize::new(1),
                granted_at: std::time::Instant::now(),
                rt,
            })),
            Err(e) => {
                // Removed now if it can be; if the removal fails, or this future is
                // dropped while it runs, in the background, retried while the session
                // lives (the acquire's own clean-up was disarmed by the grant).
                let mut pending =
                    RefusedGrant(Some((rt, backend.clone(), q.clone(), entry.clone(), lost)));
                if backend.remove(&q, &entry).await.is_ok() {
                    pending.0 = None;
                }
                Err(e)
            }
        }
    }

    /// Removes the entry in the background, retried while the session lives
    /// ([`spawn_remove`], until the hold's own lost signal, made at the grant, says the
    /// session ended), on the client's runtime ([`Runtime`]).
    fn remove_in_background(&self) {
        spawn_remove(
            &self.rt,
            self.backend.clone(),
            self.q.clone(),
            self.entry.clone(),
            self.lost.clone(),
        );
    }

    /// The granted entry's token, or why it cannot be handed out.
    fn check(backend: &Arc<B>, q: &QueuePath, entry: &Entry) -> Result<FencingToken> {
        let token = entry.token.ok_or_else(|| {
            Error::backend(
                format!("acquire {q}"),
                format!("the {} backend gave no fencing token", backend.kind()),
            )
        })?;
        // A grant can reach the client after its session ended: a reply held up by a
        // partition arrives once the server has already expired the session and its
        // entry, and let the next contender in. A hold whose loss the client knows by
        // now is never handed out.
        if let Some(lost) = backend.lost_now(q, entry) {
            return Err(Error::LockLost(format!(
                "{q}: the session was lost before the grant of {} reached this client: {}",
                entry.name,
                Ending::of(lost).reason
            )));
        }
        Ok(token)
    }

    /// The lost signal's reason, if the backend knows the hold is lost.
    ///
    /// Once the shared signal has completed it answers; before that,
    /// the backend is asked ([`dlock_core::Backend::lost_now`]: what a fresh lost future
    /// would complete with at its first poll). Polling the shared signal instead would
    /// not do: a `Shared` answers `Pending`, without looking, to every clone but the one
    /// being polled, so a peek made while another task is inside that poll (a thread
    /// preempted there for as long as the scheduler likes) would miss a known loss, and
    /// a lost hold would be reported held or re-entered.
    pub(crate) fn lost_reason(&self) -> Option<String> {
        if let Some(why) = self.lost.peek() {
            return Some(why.reason.clone());
        }
        self.backend
            .lost_now(&self.q, &self.entry)
            .map(|e| Ending::of(e).reason)
    }

    /// Counts one more guard of this hold (a re-entry).
    ///
    /// # Errors
    /// [`Error::LockLost`] once the lost signal has fired: a lost hold is never handed
    /// out again. [`Error::NotHeld`] if every guard was already released.
    pub(crate) fn join(&self) -> Result<()> {
        if let Some(reason) = self.lost_reason() {
            return Err(Error::LockLost(reason));
        }
        let mut n = self.guards.load(Ordering::Acquire);
        loop {
            if n == 0 {
                return Err(Error::NotHeld(format!(
                    "{}: every guard of this hold was released",
                    self.q.lock
                )));
            }
            match self
                .guards
                .compare_exchange_weak(n, n + 1, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return Ok(()),
                Err(now) => n = now,
            }
        }
    }

    /// Counts one guard released; `Some(lost)` if it was the last, so the entry must go.
    /// `lost` is whether the hold was lost by then, looked at by the caller before the
    /// count drops (see [`LockGuard::release`]). The caller sets the entry's removal
    /// going, then reports the end ([`Held::ended`]): a panic in a metrics recorder must
    /// not come between the last guard and the removal, which nothing else would send.
    fn leave(&self, lost: bool) -> Option<bool> {
        (self.guards.fetch_sub(1, Ordering::AcqRel) == 1).then_some(lost)
    }

    /// Reports the hold's end (`lost`: it had been lost) to `dlock_hold_seconds` and
    /// `dlock_holds_lost_total`, once its removal is under way.
    fn ended(&self, lost: bool) {
        crate::metrics::hold_ended(
            self.backend.kind(),
            self.entry.kind.label(),
            self.granted_at.elapsed(),
            lost,
        );
    }

    /// How many guards of this hold are not yet released.
    pub(crate) fn guards(&self) -> usize {
        self.guards.load(Ordering::Acquire)
    }
}

/// Holds a lock (or one semaphore permit) until [`LockGuard::release`] is awaited or the
/// guard is dropped.
///
/// Dropping the guard releases in the background, retried while the session lives, on
/// the tokio runtime its [`crate::Client`] was made on (wherever the drop happens: a
/// thread with no runtime, a short-lived runtime that would never run the task); await
/// [`LockGuard::release`] instead to learn whether the release reached the server.
///
/// # Reentrancy
/// A hold of a reentrant lock ([`crate::Mutex`], either side of [`crate::RwLock`]) is
/// re-entered only by code that provably runs inside it: through the guard
/// ([`LockGuard::reenter`]) or inside a future the guard scopes ([`LockGuard::scope`]).
/// Anything else that asks for the lock, a sibling future of the same task included
/// (`join!`, `select!`, `FuturesUnordered`), queues like any other contender and waits
/// until the hold ends. The entry leaves the server when the hold's last guard is
/// released. A hold whose lost signal has fired is never re-entered:
/// [`Error::LockLost`].
///
/// The guard may be moved to and released from any task: ownership is the guard's, not
/// the thread's or the task's.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard<B: DynBackend + ?Sized = dyn DynBackend> {
    held: Arc<Held<B>>,
    released: bool,
}

impl<B: DynBackend + ?Sized> LockGuard<B> {
    /// A guard of `held`, whose guard count already includes it.
    pub(crate) fn new(held: Arc<Held<B>>) -> Self {
        LockGuard {
            held,
            released: false,
        }
    }

    /// Re-enters this hold: one more guard of the same entry and fencing token, which
    /// must be released too. No round trip.
    ///
    /// # Errors
    /// - [`Error::LockLost`] if the lost signal has fired (the hold is not handed out
    ///   again);
    /// - [`Error::NotHeld`] if this guard was released;
    /// - [`Error::WouldDeadlock`] for a non-reentrant hold (a
    ///   [`crate::SemaphoreMutex`] or a semaphore permit).
    ///
    /// # Upstream
    /// Curator `InterProcessMutex.acquire()` on the thread that holds it; Redisson
    /// `lock()` by the holding thread.
    pub fn reenter(&self) -> Result<LockGuard<B>> {
        if self.released {
            return Err(Error::NotHeld(format!(
                "{} was already released by this guard",
                self.held.q.lock
            )));
        }
        match &self.held.key {
            Some(k) if k.recipe != Recipe::SemaphoreMutex => {}
            _ => {
                return Err(Error::WouldDeadlock(format!(
                    "{} is not reentrant",
                    self.held.q.lock
                )))
            }
        }
        self.held.join()?;
        // The guard first: it undoes the join if what follows panics.
        let guard = LockGuard::new(self.held.clone());
        tracing::debug!(lock = %self.held.q.lock, token = %self.held.token, "re-entered");
        Ok(guard)
    }

    /// Runs `fut` inside this hold: while it runs, asking the same client for the same
    /// lock re-enters this hold instead of queueing (for a [`crate::RwLock`] write hold,
    /// asking for the read lock takes it beside the write, the downgrade; for a
    /// non-reentrant lock, asking again is [`Error::WouldDeadlock`]).
    ///
    /// Only `fut`, and the futures it polls, run inside: a future polled beside it (by
    /// `join!`, `select!`, ...) does not, nor does a task it spawns. Scopes nest: the
    /// scopes around the returned future are the ones it is polled in, read at each
    /// poll, not the ones it was made or first polled in, so a scoped future made (or
    /// polled once) inside another guard's scope and awaited outside it (or handed to
    /// another task) does not carry that guard's hold along.
    ///
    /// ```no_run
    /// # async fn f(client: dlock_recipes::Client) -> dlock_core::Result<()> {
    /// let m = client.mutex("jobs/7")?;
    /// let mut g = m.lock().await?;
    /// g.scope(async {
    ///     // Code that takes the same lock, e.g. a helper that locks on its own.
    ///     let mut again = m.lock().await?; // re-entered: same entry, same token
    ///     again.release().await
    /// })
    /// .await?;
    /// g.release().await
    /// # }
    /// ```
    pub fn scope<'a, F>(&'a self, fut: F) -> impl Future<Output = F::Output> + 'a
    where
        F: Future + 'a,
    {
        let hold = match &self.held.key {
            Some(k) if !self.released => {
                let held: Arc<dyn std::any::Any + Send + Sync> = self.held.clone();
                Some((k.clone(), held))
            }
            _ => None,
        };
        // The surrounding scopes are read at each poll, where the future runs: read when
        // it was made (or first polled), they would be the scopes of code the future may
        // no longer run in (see the doc above).
        Scope::holding(hold, fut)
    }

    /// The hold this guard counts in.
    pub(crate) fn held(&self) -> &Arc<Held<B>> {
        &self.held
    }

    /// True if this guard is unreleased and belongs to the hold `key` names.
    pub(crate) fn is_hold_of(&self, key: &HoldKey) -> bool {
        !self.released && self.held.key.as_ref() == Some(key)
    }

    /// The fencing token of this hold. On ZooKeeper and etcd an exclusive hold's token is
    /// larger than that of every earlier exclusive holder of the same lock; on one Redis
    /// master only as long as the server's clock does not step back; Redlock tokens give
    /// no such order (see `dlock_core::FencingToken`). Pass it to the storage you protect,
    /// which must reject a write whose token is lower than one it has seen (see
    /// `dlock_core::FenceGate`).
    pub fn token(&self) -> FencingToken {
        self.held.token
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.held.q.lock
    }

    /// The entry that holds the lock on the server.
    pub fn entry(&self) -> &Entry {
        &self.held.entry
    }

    /// Completes with [`Error::LockLost`] once the lock can no longer be trusted to be
    /// held: the session expired, the client was cut off from the servers longer than the
    /// session timeout, or the lease could not be renewed. Another client may hold the
    /// lock from then on, so stop the critical section (the CLI kills its child).
    ///
    /// Never completes while the lock is held. Cancel-safe: dropping it loses nothing.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        self.held.lost.clone().map(|e| Error::LockLost(e.reason))
    }

    /// True once the client knows this hold is lost: [`LockGuard::lost`] has completed,
    /// or would complete at its next poll, or the session's deadline has passed (with
    /// the adapters in this repository: even if the task that keeps the session alive
    /// has not run since, on a starved runtime, to fire `lost()`). Once true, it stays
    /// true. It asks the backend's own state, so the answer holds even while another
    /// task is polling `lost()`. Local: no round trip.
    pub fn is_lost(&self) -> bool {
        self.held.lost_reason().is_some()
    }

    /// Asks the server whether this hold's entry is still there, and fails if it is not.
    ///
    /// [`LockGuard::lost`] fires only once the client has learned of a loss, and a loss
    /// can go unseen for a while: a pause past the session is noticed at the next
    /// keep-alive, and an entry deleted on the server by someone else at the next lease
    /// renewal on Redis, but not at all on ZooKeeper and etcd, whose lost signal is the
    /// session's (only `verify` sees it there). Call `verify` when a critical section
    /// ends and before its effects are committed, to learn whether it may have overlapped
    /// another holder's. Costs one read ([`dlock_core::DynBackend::contains`]): of the
    /// entry itself on ZooKeeper and etcd, of the entries up to it on Redis; never of
    /// the waiters queued behind it.
    ///
    /// # Errors
    /// - [`Error::NotHeld`] if this guard was released (its hold may live on in other
    ///   guards, but this one no longer holds it);
    /// - [`Error::LockLost`] if the lost signal has fired, or the entry is gone;
    /// - the backend's error if the server could not be asked (the hold is then
    ///   unconfirmed, not known lost).
    pub async fn verify(&self) -> Result<()> {
        if self.released {
            return Err(Error::NotHeld(format!(
                "{} was already released by this guard",
                self.held.q.lock
            )));
        }
        let held = &self.held;
        if let Some(reason) = held.lost_reason() {
            return Err(Error::LockLost(reason));
        }
        let present = held.backend.contains(&held.q, &held.entry).await?;
        if let Some(reason) = held.lost_reason() {
            return Err(Error::LockLost(reason));
        }
        if present {
            Ok(())
        } else {
            Err(Error::LockLost(format!(
                "{}: entry {} is no longer on the server",
                held.q.lock, held.entry.name
            )))
        }
    }

    /// Releases this hold. The entry is removed when the hold's last guard is released
    /// (a re-entered hold has several).
    ///
    /// # Errors
    /// - [`Error::NotHeld`] if this guard was already released;
    /// - [`Error::LockLost`] if the lock had been lost before the release;
    /// - a backend error if the removal failed: it is then retried in the background
    ///   until it succeeds or the session ends, never given up while the session lives
    ///   (an entry left under a live session would block every other contender).
    ///
    /// # Cancel safety
    /// If the future is dropped before it completes, the guard counts as released and the
    /// entry is removed in the background.
    ///
    /// # Session loss
    /// Releasing a lost lock returns [`Error::LockLost`] (or [`Error::Closed`]): its
    /// entry went with the session, and the caller learns that its critical section may
    /// have overlapped another holder's.
    ///
    /// # Upstream
    /// Curator `InterProcessMutex.release()` / `Lease.close()`; etcd `Mutex.Unlock`
    /// (whose retry can delete a newer lock of the same session, etcd#22082; a guard
    /// releases once); Redisson `unlock()`.
    pub async fn release(&mut self) -> Result<()> {
        if self.released {
            return Err(Error::NotHeld(format!(
                "{} was already released by this guard",
                self.held.q.lock
            )));
        }
        self.released = true;
        // Looked at while this guard still counts: once it no longer does, another
        // guard's release may remove the entry, which a backend with a per-entry signal
        // (Redis) would then report as lost.
        let lost = self.held.lost_reason();
        let Some(was_lost) = self.held.leave(lost.is_some()) else {
            // Other guards of this hold remain, so the entry stays; but a section that
            // ran while the hold was lost must still hear of it, whichever guard ends it.
            if let Some(reason) = lost {
                return Err(Error::LockLost(format!(
                    "{} had been lost before it was released: {reason}",
                    self.held.q.lock
                )));
            }
            return Ok(());
        };
        let held = &self.held;
        // The removal is armed before anything else runs (the span, the metrics): from
        // here a panic drops it, which sends the removal.
        let mut remover = RemoveOnDrop(Some(held.clone()));
        let span = tracing::debug_span!("dlock.release", lock = %held.q.lock, token = %held.token);
        held.ended(was_lost);
        let r = held
            .backend
            .remove(&held.q, &held.entry)
            .instrument(span)
            .await;
        remover.0 = None;
        match r {
            Ok(()) if was_lost => Err(Error::LockLost(format!(
                "{} had been lost before it was released",
                held.q.lock
            ))),
            Ok(()) => Ok(()),
            Err(e) => {
                if !e.is_lost() {
                    held.remove_in_background();
                }
                Err(e)
            }
        }
    }
}

/// A [`LockGuard`] whose holder can be asked to release by anyone: by
/// [`crate::Client::revoke`], the `dlock revoke` command, or Curator's
/// `Revoker.attemptRevoke` on its node. Made by [`crate::Mutex::lock_revocable`].
///
/// Revocation is cooperative, as in Curator: the request only completes
/// [`RevocableGuard::revoke_requested`]; the holder decides when to release. Everything
/// else is the inner guard's, through `Deref`.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct RevocableGuard<B: DynBackend + ?Sized = dyn DynBackend> {
    guard: LockGuard<B>,
}

impl<B: DynBackend + ?Sized> RevocableGuard<B> {
    pub(crate) fn new(guard: LockGuard<B>) -> Self {
        RevocableGuard { guard }
    }

    /// Completes with `Ok(())` once someone asked this holder to release (the entry's
    /// payload became Curator's `__REVOKE__`), at once if that already happened.
    ///
    /// # Errors
    /// [`Error::LockLost`] if the session ends first; [`Error::NotHeld`] if the entry is
    /// gone (released); a backend error on backends without entry payload watches.
    ///
    /// # Cancel safety
    /// Cancel-safe, and it borrows nothing: it may be raced against the work in a
    /// `select!` or moved to another task.
    pub fn revoke_requested(&self) -> impl Future<Output = Result<()>> + Send + 'static {
        let held = self.guard.held.clone();
        async move {
            let mut seen = held.entry.data.clone();
            loop {
                if seen == dlock_core::entry::REVOKE_MESSAGE {
                    tracing::debug!(lock = %held.q.lock, token = %held.token, "revocation requested");
                    return Ok(());
                }
                match held
                    .backend
                    .wait_data_changed(&held.q, &held.entry, &seen)
                    .await?
                {
                    Some(data) => seen = data,
                    None => {
                        return Err(Error::NotHeld(format!(
                            "{}: the entry is gone (released, or its session ended)",
                            held.q.lock
                        )))
                    }
                }
            }
        }
    }

    /// The plain guard, for code that takes a [`LockGuard`].
    pub fn into_inner(self) -> LockGuard<B> {
        self.guard
    }
}

impl<B: DynBackend + ?Sized> std::ops::Deref for RevocableGuard<B> {
    type Target = LockGuard<B>;
    fn deref(&self) -> &LockGuard<B> {
        &self.guard
    }
}

impl<B: DynBackend + ?Sized> std::ops::DerefMut for RevocableGuard<B> {
    fn deref_mut(&mut self) -> &mut LockGuard<B> {
        &mut self.guard
    }
}

impl<B: DynBackend + ?Sized> fmt::Debug for RevocableGuard<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RevocableGuard").field(&self.guard).finish()
    }
}

/// Finishes a release whose future was dropped halfway.
struct RemoveOnDrop<B: DynBackend + ?Sized>(Option<Arc<Held<B>>>);

impl<B: DynBackend + ?Sized> Drop for RemoveOnDrop<B> {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            h.remove_in_background();
        }
    }
}

impl<B: DynBackend + ?Sized> Drop for LockGuard<B> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        if let Some(lost) = self.held.leave(self.held.lost_reason().is_some()) {
            self.held.remove_in_background();
            self.held.ended(lost);
        }
    }
}

impl<B: DynBackend + ?Sized> fmt::Debug for LockGuard<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lock", &self.held.q.lock.as_str())
            .field("entry", &self.held.entry.name)
            .field("token", &self.held.token)
            .field("released", &self.released)
            .finish()
    }
}
