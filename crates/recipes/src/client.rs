//! [`Client`]: one session on a backend, and the factory of every recipe.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::driver::holders;
use dlock_core::{
    Capability, DynBackend, Entry, EntryKind, Error, LockName, Position, QueuePath, Result,
};
use tracing::Instrument;

use crate::guard::{Held, LockGuard};
use crate::listing::LockSummary;
use crate::queue::{self, Wait};
use crate::reentry::{ClientId, HoldKey, Recipe, Scope};
use crate::tickets::TicketSource;
use crate::{Election, MultiLock, Mutex, RwLock, Semaphore, SemaphoreMutex};

/// A session on one backend: every lock made from it shares the session (its entries
/// vanish together if the process dies). A hold re-enters only through the client (or a
/// clone of it) that took it; see [`LockGuard::scope`].
///
/// Cheap to clone; clones share the session. Build one per process (or per service),
/// not one per lock.
pub struct Client<B: DynBackend + ?Sized = dyn DynBackend> {
    pub(crate) backend: Arc<B>,
    pub(crate) id: ClientId,
    pub(crate) data: Arc<[u8]>,
    pub(crate) tickets: TicketSource,
    /// The runtime the client was made on, where clean-ups left by drops run.
    pub(crate) rt: queue::Runtime,
}

impl<B: DynBackend + ?Sized> Clone for Client<B> {
    fn clone(&self) -> Self {
        Client {
            backend: self.backend.clone(),
            id: self.id,
            data: self.data.clone(),
            tickets: self.tickets.clone(),
            rt: self.rt.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for Client<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("backend", &self.backend.kind())
            .finish()
    }
}

/// One contender of a lock, as [`Client::participants`] reports it. More fields may come.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Participant {
    /// The queue it stands in: `""` for the lock itself, `"leases"` / `"locks"` for a
    /// semaphore's.
    pub queue: &'static str,
    /// The entry.
    pub entry: Entry,
    /// True if it holds the lock (or a permit); false while it waits.
    pub holds: bool,
}

impl Client<dyn DynBackend> {
    /// A client over a backend built by hand, such as an adapter on the application's
    /// own client (`ZkBackend::from_client`, `EtcdBackend::from_client`,
    /// `RedisBackend::from_client`): the same type [`dlock::connect`] returns, so the
    /// rest of the application cannot tell the two apart.
    ///
    /// The backend's session is this client's: [`Client::close`] closes the backend
    /// (which, for an adapter on a borrowed client, removes dlock's entries and leaves
    /// the application's connection open).
    ///
    /// [`dlock::connect`]: https://docs.rs/dlock/latest/dlock/fn.connect.html
    pub fn from_backend<B: DynBackend + 'static>(backend: Arc<B>) -> Self {
        Client::new(backend)
    }
}

impl<B: DynBackend + ?Sized> Client<B> {
    /// A client over an already connected backend.
    ///
    /// Made inside a tokio runtime, it keeps that runtime for the clean-ups a drop
    /// leaves (a guard or an acquire future dropped without being awaited to the end):
    /// make it on the runtime that keeps the backend's session alive, as
    /// `dlock::connect` does.
    pub fn new(backend: Arc<B>) -> Self {
        let data = owner_data();
        Client {
            backend,
            id: ClientId::next(),
            data: Arc::from(data.into_bytes()),
            tickets: TicketSource::os(),
            rt: queue::Runtime::current(),
        }
    }

    /// This client, drawing its tickets from `tickets` instead of the operating system:
    /// a seeded source makes a simulation's entry names the same on every run.
    #[must_use]
    pub fn with_tickets(mut self, tickets: TicketSource) -> Self {
        self.tickets = tickets;
        self
    }

    /// Where the clean-ups of a lock taken now run if a drop leaves any: the runtime this
    /// client was made on, or the current one for a client made outside any runtime.
    pub(crate) fn cleanup_runtime(&self) -> queue::Runtime {
        self.rt.or_current()
    }

    /// The backend this client runs on.
    pub fn backend(&self) -> &Arc<B> {
        &self.backend
    }

    /// Validates `name` against this backend's rules.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn lock_name(&self, name: &str) -> Result<LockName> {
        LockName::new(name, self.backend.name_rules())
    }

    /// A reentrant, fair mutex (Curator's InterProcessMutex). See [`Mutex`].
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn mutex(&self, name: &str) -> Result<Mutex<B>> {
        Ok(Mutex::new(self.clone(), self.lock_name(name)?))
    }

    /// A non-reentrant mutex (Curator's InterProcessSemaphoreMutex). See [`SemaphoreMutex`].
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn semaphore_mutex(&self, name: &str) -> Result<SemaphoreMutex<B>> {
        Ok(SemaphoreMutex::new(self.clone(), self.lock_name(name)?))
    }

    /// A fair read/write lock (Curator's InterProcessReadWriteLock). See [`RwLock`].
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn rwlock(&self, name: &str) -> Result<RwLock<B>> {
        Ok(RwLock::new(self.clone(), self.lock_name(name)?))
    }

    /// A counting semaphore of `permits` permits (Curator's InterProcessSemaphoreV2).
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::InvalidPermits`] for zero permits.
    pub fn semaphore(&self, name: &str, permits: u32) -> Result<Semaphore<B>> {
        if permits == 0 {
            return Err(Error::InvalidPermits(
                "a semaphore needs at least one permit".into(),
            ));
        }
        Ok(Semaphore::new(self.clone(), self.lock_name(name)?, permits))
    }

    /// A leader election (etcd's `concurrency.Election`, Curator's `LeaderLatch`). See
    /// [`Election`]. Its queue is a mutex's of the same name: give elections names of
    /// their own.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn election(&self, name: &str) -> Result<Election<B>> {
        Ok(Election::new(self.clone(), self.lock_name(name)?))
    }

    /// An empty multi-lock; add parts with [`MultiLock::mutex`] and friends.
    pub fn multi(&self) -> MultiLock<B> {
        MultiLock::new(self.clone())
    }

    /// The server that serves the lock `name` when that depends on the lock (on a Redis
    /// Cluster: the master of its slot, `host:port (slot N)`), as this client routes it
    /// now; `None` on backends where every lock is served alike. No round trip.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn serving_node(&self, name: &str) -> Result<Option<String>> {
        let lock = self.lock_name(name)?;
        Ok(self.backend.serving_node(&QueuePath::root(lock)))
    }

    /// Every contender of the lock `name`, whatever the recipe: entries directly under
    /// the name (mutex, read/write), in a semaphore's `leases` and `locks` queues, and in
    /// a ranked semaphore's `permits` queue (whose first N entries hold).
    ///
    /// # Errors
    /// [`Error::InvalidName`], or a backend error.
    pub async fn participants(&self, name: &str) -> Result<Vec<Participant>> {
        let lock = self.lock_name(name)?;
        let mut out = Vec::new();
        for sub in [
            None,
            Some(crate::semaphore::LEASES),
            Some(crate::semaphore::LOCKS),
            Some(crate::semaphore::PERMITS),
        ] {
            let q = QueuePath {
                lock: lock.clone(),
                sub,
            };
            let entries = self.backend.participants(&q).await?;
            let held: Vec<String> = match sub {
                Some(crate::semaphore::LEASES) => entries.iter().map(|e| e.name.clone()).collect(),
                Some(crate::semaphore::PERMITS) => entries
                    .iter()
                    .zip(crate::semaphore::permit_holders(&entries))
                    .filter(|(_, h)| *h)
                    .map(|(e, _)| e.name.clone())
                    .collect(),
                _ => holders(&entries).iter().map(|e| e.name.clone()).collect(),
            };
            out.extend(entries.into_iter().map(|entry| Participant {
                queue: sub.unwrap_or(""),
                holds: held.contains(&entry.name),
                entry,
            }));
        }
        Ok(out)
    }

    /// Every lock whose name starts with `prefix` (a plain string prefix, `""` for all;
    /// `orders/` for the locks below `orders`) that has a holder or a waiter now, sorted
    /// by name, with its kind and how many entries hold and wait. A lock nobody holds or
    /// waits for is not listed: the servers keep nothing else that names it.
    ///
    /// A snapshot of each lock, not of all of them at once (but on etcd, where one
    /// revision is read): a lock may be taken or freed while the others are read, so the
    /// listing can show a lock that is already free, or miss one taken meanwhile. What it
    /// costs depends on the backend: ZooKeeper lists every znode under the prefix (one
    /// request per znode, a few at a time), etcd reads every key under it (in pages, at
    /// one revision), Redis `SCAN`s its whole keyspace on every master for the lock
    /// queues' keys and reads each queue found. For operators and tools, not a hot path.
    ///
    /// On etcd only keys bound to the lease their name starts with count (dlock's and
    /// etcd's own lock keys), so the configuration keys of a shared etcd are not listed
    /// as locks. A semaphore is listed once, under its own name; a lock named
    /// `…/locks` is taken for a semaphore's internal queue, as [`Client::participants`]
    /// takes it.
    ///
    /// # Errors
    /// [`Error::InvalidName`] for a prefix no valid name starts with; a backend error.
    pub async fn locks(&self, prefix: &str) -> Result<Vec<LockSummary>> {
        let rules = self.backend.name_rules();
        let prefix = dlock_core::name_prefix(prefix, rules)?;
        let queues = self.backend.list_queues(&prefix).await?;
        Ok(crate::listing::summarize(&prefix, &queues, rules))
    }

    /// How long a crashed or paused holder keeps its locks.
    pub fn session_timeout(&self) -> Duration {
        self.backend.session_timeout()
    }

    /// Whether this client can take locks now: its session is live and its servers
    /// answer, with one cheap round trip that needs no permission on any lock. Meant for
    /// a readiness probe.
    ///
    /// # Errors
    /// What an acquire would get now: [`Error::Unreachable`], [`Error::LockLost`] (the
    /// session ended), [`Error::Closed`], or a refusal.
    pub async fn health(&self) -> Result<()> {
        self.backend.health().await
    }

    /// Closes the session: every lock and permit held through this client is released
    /// at once (their guards' lost signals fire), and every acquire still waiting on it
    /// fails with [`Error::Closed`] or [`Error::LockLost`].
    ///
    /// # Errors
    /// A backend error if the close request failed (the session then ends by timeout).
    ///
    /// # Upstream
    /// Curator `CuratorFramework.close()`; etcd `Session.Close()` (revokes the lease).
    pub async fn close(&self) -> Result<()> {
        self.backend.close().await
    }

    /// Asks every current holder of `name` to release it: writes Curator's revocation
    /// message ([`dlock_core::entry::REVOKE_MESSAGE`]) into each holding entry, as
    /// Curator's `Revoker.attemptRevoke` does. Holders that took the lock with
    /// [`Mutex::lock_revocable`] (or Curator's `makeRevocable`) are told; others never
    /// notice. Revocation is cooperative: nothing is released by force.
    ///
    /// Returns how many holding entries were asked (0 if the lock is free).
    ///
    /// An election's leader is never asked (it is not a lock holder, and Curator's
    /// `Revoker` never asks one either): its entry's payload is the leader's value,
    /// which the message would replace, and a Curator `LeaderLatch` queued behind it
    /// watches that entry with a one-shot watch that a data change uses up, after which
    /// it would miss the leader's resignation. To move a leadership, resign it.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unsupported`] on a backend without
    /// [`Capability::Revocation`]; a backend error.
    pub async fn revoke(&self, name: &str) -> Result<usize> {
        self.require(Capability::Revocation)?;
        let parts = self.participants(name).await?;
        let lock = self.lock_name(name)?;
        let mut asked = 0;
        // The semaphore's internal lock is held only while acquiring: not a holder.
        for p in parts.iter().filter(|p| {
            p.holds
                && p.queue != crate::semaphore::LOCKS
                && p.entry.kind != dlock_core::EntryKind::Candidate
        }) {
            let q = QueuePath {
                lock: lock.clone(),
                sub: (!p.queue.is_empty()).then_some(p.queue),
            };
            tracing::debug!(lock = %lock, entry = %p.entry.name, "asking the holder to release");
            self.backend
                .set_data(&q, &p.entry, dlock_core::entry::REVOKE_MESSAGE)
                .await?;
            asked += 1;
        }
        Ok(asked)
    }

    /// The reentrant acquire shared by the mutex, the read and the write lock.
    /// [`Error::Unsupported`] unless the backend has `capability`: checked before an
    /// operation that needs it writes anything.
    pub(crate) fn require(&self, capability: Capability) -> Result<()> {
        if self.backend.supports(capability) {
            Ok(())
        } else {
            Err(Error::Unsupported {
                backend: self.backend.kind(),
                capability,
            })
        }
    }

    pub(crate) async fn acquire_reentrant(
        &self,
        lock: &LockName,
        recipe: Recipe,
        kind: EntryKind,
        wait: Wait,
    ) -> Result<LockGuard<B>> {
        let data = self.data.clone();
        self.acquire_reentrant_with(lock, recipe, kind, wait, &data)
            .await
    }

    /// [`Client::acquire_reentrant`] with the entry's payload given (a revocable lock
    /// writes an empty one, as Curator does).
    pub(crate) async fn acquire_reentrant_with(
        &self,
        lock: &LockName,
        recipe: Recipe,
        kind: EntryKind,
        wait: Wait,
        data: &[u8],
    ) -> Result<LockGuard<B>> {
        let key = HoldKey {
            client: self.id,
            lock: lock.clone(),
            recipe,
        };
        // Re-entry: only code inside a scope of this very hold (see `LockGuard::scope`).
        if let Some(held) = Scope::find::<Held<B>>(&key) {
            match held.join() {
                Ok(()) => {
                    let token = held.token;
                    // The guard first: it undoes the join if the log line panics.
                    let guard = LockGuard::new(held);
                    tracing::debug!(lock = %lock, token = %token, "re-entered");
                    return Ok(guard);
                }
                // The scope's hold has ended: take the lock afresh, below.
                Err(Error::NotHeld(_)) => {}
                Err(e) => return Err(e),
            }
        }
        // A write holder's read entry goes beside its write entry, so it is granted at
        // once and no queued writer can slip in between (downgrade). A lost write is
        // never downgraded: its entry may be gone, and the read would take its place.
        let beside = match recipe {
            Recipe::Read => {
                Scope::find::<Held<B>>(&key.with_recipe(Recipe::Write)).filter(|w| w.guards() > 0)
            }
            _ => None,
        };
        if let Some(reason) = beside.as_ref().and_then(|w| w.lost_reason()) {
            return Err(Error::LockLost(format!(
                "{lock}: the write hold to downgrade was lost: {reason}"
            )));
        }
        if recipe == Recipe::Write
            && Scope::find::<Held<B>>(&key.with_recipe(Recipe::Read))
                .is_some_and(|r| r.guards() > 0)
        {
            return Err(Error::WouldDeadlock(format!(
                "{lock}: a read holder cannot take the write lock (upgrade would deadlock); release the read lock first"
            )));
        }
        let q = QueuePath::root(lock.clone());
        let span = tracing::debug_span!(
            "dlock.acquire",
            lock = %lock,
            kind = %kind.label(),
            token = tracing::field::Empty,
            wait_ms = tracing::field::Empty
        );
        let asked = tokio::time::Instant::now();
        let at = match &beside {
            Some(w) => Position::Beside(&w.entry),
            None => Position::Tail,
        };
        let ticket = self.tickets.ticket();
        let result = async {
            let rt = self.cleanup_runtime();
            let entry = queue::acquire(&self.backend, &q, ticket, kind, at, data, wait, &rt)
                .instrument(span.clone())
                .await?;
            Held::grant(self.backend.clone(), q, entry, Some(key), rt).await
        }
        .await
        // A guard before anything else runs (metrics, the log line): if that panics, the
        // guard's drop removes the entry.
        .map(LockGuard::new);
        crate::metrics::acquire(self.backend.kind(), kind.label(), asked.elapsed(), &result);
        let guard = result?;
        span.record("token", guard.token().get());
        span.record("wait_ms", asked.elapsed().as_secs_f64() * 1e3);
        tracing::debug!(parent: &span, "acquired");
        Ok(guard)
    }
}

/// What every entry of a client carries, for `dlock status` and for humans reading the
/// server: `dlock pid=PID host=HOST` (the host left out where it cannot be read), so a
/// holder can be found on a fleet of machines.
fn owner_data() -> String {
    let pid = std::process::id();
    // The kernel's node name: no libc call, nothing to parse beyond one line.
    match std::fs::read_to_string("/proc/sys/kernel/hostname") {
        Ok(h) if !h.trim().is_empty() => format!("dlock pid={pid} host={}", h.trim()),
        _ => format!("dlock pid={pid}"),
    }
}
