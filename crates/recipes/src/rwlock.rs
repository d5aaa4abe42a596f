//! [`RwLock`]: a fair distributed read/write lock with downgrade (Curator's
//! InterProcessReadWriteLock).

use std::time::Duration;

use dlock_core::{DynBackend, EntryKind, LockName, Result};

use crate::guard::LockGuard;
use crate::queue::Wait;
use crate::reentry::{HoldKey, Recipe};
use crate::Client;

/// Shared readers, exclusive writers, granted in arrival order.
///
/// Readers and writers queue in one sequence (Curator's `__READ__` / `__WRIT__` nodes),
/// so a reader never overtakes a writer that arrived first: writers do not starve. Both
/// sides are reentrant inside the holder's scope ([`LockGuard::scope`],
/// [`LockGuard::reenter`]). A write holder may take the read lock and then release the
/// write lock (downgrade, [`RwLock::downgrade`]): its read entry is placed beside its
/// write entry, so no queued writer gets in between. Asking for the write lock inside a
/// read hold's scope gets [`dlock_core::Error::WouldDeadlock`] instead of waiting forever
/// (Curator hangs).
pub struct RwLock<B: DynBackend + ?Sized = dyn DynBackend> {
    client: Client<B>,
    name: LockName,
}

// Written out because a derive would demand `B: Clone + Debug`, which `dyn DynBackend` is not.
impl<B: DynBackend + ?Sized> Clone for RwLock<B> {
    fn clone(&self) -> Self {
        RwLock {
            client: self.client.clone(),
            name: self.name.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for RwLock<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RwLock")
            .field("name", &self.name.as_str())
            .finish()
    }
}

impl<B: DynBackend + ?Sized> RwLock<B> {
    pub(crate) fn new(client: Client<B>, name: LockName) -> Self {
        RwLock { client, name }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// Waits for the read lock. Shared with other
    /// readers, granted once no writer holds or waits ahead. Inside the scope of this
    /// client's read hold it re-enters; inside the scope of its write hold it takes the
    /// read lock beside the write (downgrade): both return at once.
    ///
    /// # Errors
    /// [`dlock_core::Error::Timeout`], [`dlock_core::Error::LockLost`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped attempt's entry is removed.
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the read lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the read lock from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessReadWriteLock.readLock().acquire()`; Redisson `RReadWriteLock.readLock().lock()`.
    pub async fn read(&self) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(&self.name, Recipe::Read, EntryKind::Read, Wait::Forever)
            .await
    }

    /// Waits at most `timeout` for the read lock. A zero timeout asks once: a free
    /// read lock is taken.
    ///
    /// # Errors
    /// [`dlock_core::Error::Timeout`]; the attempt's entry is removed before it
    /// returns; as [`RwLock::read`].
    ///
    /// # Cancel safety
    /// As [`RwLock::read`].
    ///
    /// # Upstream
    /// Curator `readLock().acquire(time, unit)`; Redisson `readLock().tryLock(waitTime,
    /// unit)`.
    pub async fn read_timeout(&self, timeout: Duration) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(
                &self.name,
                Recipe::Read,
                EntryKind::Read,
                Wait::timeout(timeout),
            )
            .await
    }

    /// Takes the read lock only if no writer holds or waits ahead; never waits.
    ///
    /// # Errors
    /// [`dlock_core::Error::WouldBlock`]; the attempt's entry is removed.
    ///
    /// # Cancel safety
    /// As [`RwLock::read`].
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the read lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the read lock from then on.
    ///
    /// # Upstream
    /// Curator `readLock().acquire(0, unit)`; Redisson `readLock().tryLock()`.
    pub async fn try_read(&self) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(&self.name, Recipe::Read, EntryKind::Read, Wait::No)
            .await
    }

    /// Waits for the write lock. Exclusive; granted
    /// once every entry ahead (reader or writer) is gone. Re-entrant inside the scope of
    /// this client's write hold.
    ///
    /// # Errors
    /// [`dlock_core::Error::WouldDeadlock`] inside the scope of a read hold of this lock
    /// (upgrade); [`dlock_core::Error::Timeout`], [`dlock_core::Error::LockLost`].
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped attempt's entry is removed.
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the write lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the write lock from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessReadWriteLock.writeLock().acquire()` (which hangs on an
    /// upgrade where dlock returns an error); Redisson `writeLock().lock()`.
    pub async fn write(&self) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(&self.name, Recipe::Write, EntryKind::Write, Wait::Forever)
            .await
    }

    /// Waits at most `timeout` for the write lock. A zero timeout asks once: a free
    /// lock is taken.
    ///
    /// # Errors
    /// [`dlock_core::Error::Timeout`]; the attempt's entry is removed before it
    /// returns; as [`RwLock::write`].
    ///
    /// # Cancel safety
    /// As [`RwLock::write`].
    ///
    /// # Upstream
    /// Curator `writeLock().acquire(time, unit)`; Redisson `writeLock().tryLock(waitTime,
    /// unit)`.
    pub async fn write_timeout(&self, timeout: Duration) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(
                &self.name,
                Recipe::Write,
                EntryKind::Write,
                Wait::timeout(timeout),
            )
            .await
    }

    /// Takes the write lock only if nobody holds or waits ahead; never waits.
    ///
    /// # Errors
    /// [`dlock_core::Error::WouldBlock`], [`dlock_core::Error::WouldDeadlock`].
    ///
    /// # Cancel safety
    /// As [`RwLock::write`].
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the write lock is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the write lock from then on.
    ///
    /// # Upstream
    /// Curator `writeLock().acquire(0, unit)`; Redisson `writeLock().tryLock()`.
    pub async fn try_write(&self) -> Result<LockGuard<B>> {
        self.client
            .acquire_reentrant(&self.name, Recipe::Write, EntryKind::Write, Wait::No)
            .await
    }

    /// Downgrades `write`, a write guard of this lock: takes the read lock beside it at
    /// once, so that no writer queued behind can get in when `write` is then released.
    /// The same as asking for the read lock inside `write.scope(..)`.
    ///
    /// # Errors
    /// - [`dlock_core::Error::LockLost`] if the write hold's lost signal has fired, or
    ///   the server no longer has its entry: a read never takes a dead writer's place;
    /// - [`dlock_core::Error::NotHeld`] if `write` is not a live write guard of this lock
    ///   taken through this client;
    /// - backend errors.
    ///
    /// # Upstream
    /// Curator: `writeLock().acquire()`, `readLock().acquire()`, `writeLock().release()`.
    pub async fn downgrade(&self, write: &LockGuard<B>) -> Result<LockGuard<B>> {
        let key = HoldKey {
            client: self.client.id,
            lock: self.name.clone(),
            recipe: Recipe::Write,
        };
        if !write.is_hold_of(&key) {
            return Err(dlock_core::Error::NotHeld(format!(
                "{}: the guard given to downgrade is not a live write guard of this lock from this client",
                self.name
            )));
        }
        write.scope(self.read()).await
    }
}
