//! [`LockGuard`]: proof of holding a lock, with its fencing token and lost signal.

use std::fmt;
use std::future::Future;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use dlock_core::{
    Backend, Entry, Error, FencingToken, HoldCounts, LockName, OwnerId, QueuePath, Result,
};
use futures::future::{BoxFuture, FutureExt, Shared};

use crate::queue::spawn_remove;

/// Which reentrancy table a hold counts in: one per recipe kind, so a read hold and a
/// write hold of the same name are counted apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Recipe {
    Mutex,
    Read,
    Write,
    SemaphoreMutex,
}

pub(crate) type HoldKey = (LockName, Recipe);

/// The reentrancy table of one client.
pub(crate) type Holds<B> = HoldCounts<HoldKey, Arc<Held<B>>>;

/// The owner of the current code: the tokio task, or the thread outside a task.
pub(crate) fn current_owner() -> OwnerId {
    match tokio::task::try_id() {
        Some(id) => {
            let mut h = std::collections::hash_map::DefaultHasher::new();
            id.hash(&mut h);
            OwnerId::Task(h.finish())
        }
        None => OwnerId::Thread(std::thread::current().id()),
    }
}

/// One entry that holds a lock, shared by all reentrant guards of its owner.
pub(crate) struct Held<B: Backend + ?Sized> {
    pub(crate) backend: Arc<B>,
    pub(crate) q: QueuePath,
    pub(crate) entry: Entry,
    pub(crate) token: FencingToken,
    lost: Shared<BoxFuture<'static, String>>,
}

impl<B: Backend + ?Sized> Held<B> {
    pub(crate) fn new(backend: Arc<B>, q: QueuePath, entry: Entry) -> Result<Arc<Self>> {
        let token = entry.token.ok_or_else(|| {
            Error::backend(
                format!("acquire {q}"),
                format!("the {} backend gave no fencing token", backend.kind()),
            )
        })?;
        let lost = backend
            .lost(&q, &entry)
            .map(|e| match e {
                Error::LockLost(msg) => msg,
                other => other.to_string(),
            })
            .boxed()
            .shared();
        Ok(Arc::new(Held {
            backend,
            q,
            entry,
            token,
            lost,
        }))
    }
}

/// Holds a lock (or one semaphore permit) until [`LockGuard::release`] is awaited or the
/// guard is dropped.
///
/// Dropping the guard releases in the background (on the current tokio runtime); await
/// [`LockGuard::release`] instead to learn whether the release reached the server. A
/// reentrant lock is released on the server only when its owner's last guard goes.
///
/// The guard may be moved to and released from any task: ownership is the guard's, not
/// the thread's or the task's.
#[must_use = "the lock is released as soon as the guard is dropped"]
pub struct LockGuard<B: Backend + ?Sized = dyn Backend> {
    held: Arc<Held<B>>,
    reentry: Option<(Arc<Holds<B>>, HoldKey, OwnerId)>,
    released: bool,
}

impl<B: Backend + ?Sized> LockGuard<B> {
    pub(crate) fn new(
        held: Arc<Held<B>>,
        reentry: Option<(Arc<Holds<B>>, HoldKey, OwnerId)>,
    ) -> Self {
        LockGuard {
            held,
            reentry,
            released: false,
        }
    }

    /// The fencing token of this hold: larger than the token of every earlier holder of
    /// the same lock. Pass it to the storage you protect, which must reject a write whose
    /// token is lower than one it has seen (see `dlock_core::FenceGate`).
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
        self.held.lost.clone().map(Error::LockLost)
    }

    /// True if the lost signal has fired.
    pub fn is_lost(&self) -> bool {
        self.held.lost.clone().now_or_never().is_some()
    }

    /// Asks the server whether this hold's entry is still there, and fails if it is not.
    ///
    /// [`LockGuard::lost`] fires only once the client has learned of a loss, and a loss
    /// can go unseen for a while: a pause past the session, or an entry deleted on the
    /// server, is noticed at the next keep-alive. Call `verify` when a critical section
    /// ends and before its effects are committed, to learn whether it may have overlapped
    /// another holder's. Costs one read ([`dlock_core::Backend::contains`]): of the
    /// entry itself on ZooKeeper and etcd, of the entries up to it on Redis; never of
    /// the waiters queued behind it.
    ///
    /// # Errors
    /// - [`Error::LockLost`] if the lost signal has fired, or the entry is gone;
    /// - the backend's error if the server could not be asked (the hold is then
    ///   unconfirmed, not known lost).
    pub async fn verify(&self) -> Result<()> {
        let held = &self.held;
        if let Some(reason) = held.lost.clone().now_or_never() {
            return Err(Error::LockLost(reason));
        }
        let present = held.backend.contains(&held.q, &held.entry).await?;
        if let Some(reason) = held.lost.clone().now_or_never() {
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

    /// Releases this hold. For a reentrant lock, the entry is removed when the owner's
    /// last hold is released.
    ///
    /// # Errors
    /// - [`Error::NotHeld`] if this guard was already released;
    /// - [`Error::LockLost`] if the lock had been lost before the release;
    /// - a backend error if the removal failed (the entry then still goes with the
    ///   session, and a background retry is made).
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
        if !self.count_down()? {
            return Ok(());
        }
        let held = &self.held;
        let span = tracing::debug_span!("release", lock = %held.q.lock, token = %held.token);
        let _enter = span.enter();
        let was_lost = self.is_lost();
        let mut remover = RemoveOnDrop(Some(held.clone()));
        let r = held.backend.remove(&held.q, &held.entry).await;
        remover.0 = None;
        match r {
            Ok(()) if was_lost => Err(Error::LockLost(format!(
                "{} had been lost before it was released",
                held.q.lock
            ))),
            Ok(()) => Ok(()),
            Err(e) => {
                if !e.is_lost() {
                    spawn_remove(held.backend.clone(), held.q.clone(), held.entry.clone());
                }
                Err(e)
            }
        }
    }

    /// Counts one release in the reentrancy table; true if the entry must now go.
    fn count_down(&self) -> Result<bool> {
        match &self.reentry {
            None => Ok(true),
            Some((holds, key, owner)) => match holds.release(key, owner) {
                Ok(last) => Ok(last.is_some()),
                Err(()) => Err(Error::NotHeld(format!(
                    "{} is not held by this owner",
                    key.0
                ))),
            },
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
pub struct RevocableGuard<B: Backend + ?Sized = dyn Backend> {
    guard: LockGuard<B>,
}

impl<B: Backend + ?Sized> RevocableGuard<B> {
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

impl<B: Backend + ?Sized> std::ops::Deref for RevocableGuard<B> {
    type Target = LockGuard<B>;
    fn deref(&self) -> &LockGuard<B> {
        &self.guard
    }
}

impl<B: Backend + ?Sized> std::ops::DerefMut for RevocableGuard<B> {
    fn deref_mut(&mut self) -> &mut LockGuard<B> {
        &mut self.guard
    }
}

impl<B: Backend + ?Sized> fmt::Debug for RevocableGuard<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("RevocableGuard").field(&self.guard).finish()
    }
}

/// Finishes a release whose future was dropped halfway.
struct RemoveOnDrop<B: Backend + ?Sized>(Option<Arc<Held<B>>>);

impl<B: Backend + ?Sized> Drop for RemoveOnDrop<B> {
    fn drop(&mut self) {
        if let Some(h) = self.0.take() {
            spawn_remove(h.backend.clone(), h.q.clone(), h.entry.clone());
        }
    }
}

impl<B: Backend + ?Sized> Drop for LockGuard<B> {
    fn drop(&mut self) {
        if self.released {
            return;
        }
        self.released = true;
        if let Ok(true) = self.count_down() {
            spawn_remove(
                self.held.backend.clone(),
                self.held.q.clone(),
                self.held.entry.clone(),
            );
        }
    }
}

impl<B: Backend + ?Sized> fmt::Debug for LockGuard<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LockGuard")
            .field("lock", &self.held.q.lock.as_str())
            .field("entry", &self.held.entry.name)
            .field("token", &self.held.token)
            .field("released", &self.released)
            .finish()
    }
}
