//! [`Mutex`]: the reentrant, fair, distributed mutex (Curator's InterProcessMutex).

use std::time::Duration;

use dlock_core::{Capability, DynBackend, EntryKind, LockName, Result};

use crate::guard::{Held, LockGuard, RevocableGuard};
use crate::queue::Wait;
use crate::reentry::{HoldKey, Recipe, Scope};
use crate::Client;

/// A reentrant, fair (FIFO) mutex shared by every process that names the same lock.
///
/// Matches Curator's `InterProcessMutex` on the wire (ZooKeeper: `_c_<uuid>-lock-<seq>`
/// nodes under the lock's path), so Java services using Curator and dlock exclude each
/// other. Reentrant by scope, not by task: code inside the holder's
/// [`LockGuard::scope`] (or with the guard in hand, [`LockGuard::reenter`]) re-enters and
/// must release as many times, and the server sees one entry; a sibling future of the
/// same task (`join!`, `select!`) waits like any other contender.
///
/// # Session loss
/// If the session ends (crash, partition past the session timeout, lease not renewed)
/// the lock frees itself on the server and the guard's [`LockGuard::lost`] fires.
pub struct Mutex<B: DynBackend + ?Sized = dyn DynBackend> {
    client: Client<B>,
    name: LockName,
}

// Written out because a derive would demand `B: Clone + Debug`, which `dyn DynBackend` is not.
impl<B: DynBackend + ?Sized> Clone for Mutex<B> {
    fn clone(&self) -> Self {
        Mutex {
            client: self.client.clone(),
            name: self.name.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for Mutex<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mutex")
            .field("name", &self.name.as_str())
            .finish()
    }
}

impl<B: DynBackend + ?Sized> Mutex<B> {
    pub(crate) fn new(client: Client<B>, name: LockName) -> Self {
        Mutex { client, name }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// Waits until the lock is held, however long that takes.
    ///
    /// Inside a scope of this client's hold of this lock ([`LockGuard::scope`]), counts
    /// one more guard of that hold and returns at once (no round trip); each guard must
    /// be released. Anywhere else it queues, even in the task that holds the lock: a
    /// task that holds it and asks again outside the guard's scope waits for itself.
    ///
    /// # Errors
    /// [`dlock_core::Error::LockLost`] if the session ends while waiting; backend errors.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future (a `select!`, a timeout) removes this attempt's
    /// entry from the queue, in the background if need be. Nothing is left behind.
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the lock from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessMutex.acquire()`; etcd `concurrency.Mutex.Lock`; Redisson
    /// `RLock.lock()` (but fair, like `RFairLock`).
    pub async fn lock(&self) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(&self.name, Recipe::Mutex, EntryKind::Lock, Wait::Forever)
            .await
    }

    /// Takes the lock only if nobody holds it or waits ahead; never waits.
    ///
    /// # Errors
    /// [`dlock_core::Error::WouldBlock`] if it is taken; the attempt's entry is removed
    /// before this returns.
    ///
    /// # Cancel safety
    /// As [`Mutex::lock`].
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the lock from then on.
    ///
    /// # Upstream
    /// etcd `concurrency.Mutex.TryLock`; Curator `acquire(0, unit)`; Redisson
    /// `tryLock()`.
    pub async fn try_lock(&self) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(&self.name, Recipe::Mutex, EntryKind::Lock, Wait::No)
            .await
    }

    /// Waits at most `timeout` for the lock. A zero timeout asks once: a free lock is
    /// taken (one round trip), a held one gives [`dlock_core::Error::Timeout`] at once.
    ///
    /// # Errors
    /// [`dlock_core::Error::Timeout`]; the attempt's entry is removed before it returns.
    ///
    /// # Cancel safety
    /// As [`Mutex::lock`].
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the lock from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessMutex.acquire(time, unit)` (which returns `false` where dlock
    /// returns [`dlock_core::Error::Timeout`]); Redisson `tryLock(waitTime, unit)`.
    pub async fn lock_timeout(&self, timeout: Duration) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(
                &self.name,
                Recipe::Mutex,
                EntryKind::Lock,
                Wait::timeout(timeout),
            )
            .await
    }

    /// Waits for the lock, taken so that others can ask this holder to release it: the guard's
    /// [`RevocableGuard::revoke_requested`] completes when [`Client::revoke`], `dlock
    /// revoke` or Curator's `Revoker.attemptRevoke` targets it. The entry is written with
    /// an empty payload, as Curator's `makeRevocable` does.
    ///
    /// # Errors
    /// As [`Mutex::lock_timeout`]; [`dlock_core::Error::Unsupported`] at once, with nothing
    /// written, on a backend without [`Capability::Revocation`] (only ZooKeeper has it).
    ///
    /// # Cancel safety
    /// As [`Mutex::lock`].
    ///
    /// # Session loss
    /// As [`Mutex::lock`]: the guard's [`crate::LockGuard::lost`] fires once the session
    /// is gone.
    ///
    /// # Upstream
    /// Curator `InterProcessMutex.makeRevocable(listener)` + `acquire()`.
    pub async fn lock_revocable(&self) -> Result<RevocableGuard<B>> {
        self.lock_revocable_with(Wait::Forever).await
    }

    /// [`Mutex::lock_revocable`], waiting at most `timeout` (a zero timeout asks once).
    ///
    /// # Errors
    /// As [`Mutex::lock_timeout`] and [`Mutex::lock_revocable`].
    pub async fn lock_revocable_timeout(&self, timeout: Duration) -> Result<RevocableGuard<B>> {
        self.lock_revocable_with(Wait::timeout(timeout)).await
    }

    async fn lock_revocable_with(&self, wait: Wait) -> Result<RevocableGuard<B>> {
        self.client.require(Capability::Revocation)?;
        let guard = self
            .client
            .acquire_reentrant_with(&self.name, Recipe::Mutex, EntryKind::Lock, wait, &[])
            .await?;
        Ok(RevocableGuard::new(guard))
    }

    /// How many guards the hold whose scope the current code runs in has (0 outside
    /// every scope of this client's hold of this lock). Local: no round trip, and it does
    /// not notice a lost session (use [`crate::LockGuard::lost`]).
    ///
    /// Redisson `getHoldCount()`; Curator `isOwnedByCurrentThread()` is `hold_count() > 0`.
    pub fn hold_count(&self) -> usize {
        let key = HoldKey {
            client: self.client.id,
            lock: self.name.clone(),
            recipe: Recipe::Mutex,
        };
        Scope::find::<Held<B>>(&key).map_or(0, |h| h.guards())
    }
}
