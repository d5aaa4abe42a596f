//! [`Semaphore`] and [`SemaphoreMutex`]: Curator's InterProcessSemaphoreV2 algorithm and
//! layout, over any backend.
//!
//! A semaphore `s` keeps two queues: `s/locks`, an internal fair mutex, and `s/leases`,
//! one entry per permit. Only the holder of the internal mutex adds a lease (Curator's
//! rule), so while it holds the mutex the lease set can only shrink. The holder adds its
//! lease and holds a permit once there are at most `permits` leases; otherwise it waits,
//! still holding the mutex, until a lease goes; it releases the mutex either way. So only
//! one contender ever waits on the leases: a returned permit wakes exactly one waiter (no
//! herd), and permits are granted in arrival order. Leases are session-bound: a crashed
//! holder's permit comes back by itself.
//!
//! Two orders of steps, chosen by [`dlock_core::Hints::atomic_enqueue_removing`]:
//! Curator's (add the lease, list, wait with the lease in place, then release the mutex),
//! and, where adding an entry and removing another is one atomic request (ZooKeeper's
//! `multi`), list first, then add the lease and release the mutex in that one request
//! once a permit is free: one synced write less on the mutex's critical path, and the
//! lease exists only if the mutex entry still did, after which the contender counts the
//! leases up to its own once more (a Curator contender can add a lease without the mutex:
//! one whose session expired while it held it), and gives its lease back and queues
//! again if more than `permits` are out. Both orders keep "at most `permits` leases are
//! held": whoever holds the newest lease counted every other holder's.
//!
//! Where the backend says [`dlock_core::Hints::ranked_semaphore`] (etcd), there is no
//! internal mutex and no Curator layout: every contender's entry goes to one queue,
//! `s/permits`, and the first N entries hold ([`dlock_core::driver::permit_decision`]).
//! A waiter waits for one of the entries just ahead of it to go (the N nearest, and up
//! to eight), so a release wakes at most eight waiters (N if more; where contenders of
//! one name were given different counts, every waiter also watches each entry ahead
//! with a count below its own, whose release can wake the whole queue); it arms watches
//! only from a fresh listing, and lists again once fewer than N of its watches are left
//! ([`dlock_core::driver::permit_next`]), so a handoff costs the same whatever the queue's
//! length. A permit costs two synced writes (the entry's creation and
//! its removal) instead of Curator's three with a grant serialized behind a mutex
//! (docs/benchmarks.md, round eight). Each entry's payload ends with ` permits=N`, the
//! count its contender was given, so a listing can tell holders from waiters, and a
//! contender given more permits than one ahead of it goes by the smaller count: a
//! semaphore-mutex's holder is alone even beside a semaphore of the same name.

use std::time::Duration;

use std::collections::HashSet;

use dlock_core::driver::{lease_granted, permit_next, PermitNext};
use dlock_core::{
    Capability, DynBackend, Entry, EntryKind, Error, Gone, LockName, Position, QueuePath, Result,
};
use futures::future::BoxFuture;
use futures::stream::{FuturesUnordered, StreamExt as _};

use crate::guard::{Held, LockGuard};
use crate::multi::MultiGuard;
use crate::queue::{self, AbandonOnDrop, Wait};
use crate::reentry::{HoldKey, Recipe, Scope};
use crate::Client;
use tracing::Instrument;

/// The internal-mutex queue of a semaphore (Curator's `locks`).
pub const LOCKS: &str = "locks";
/// The lease queue of a semaphore (Curator's `leases`).
pub const LEASES: &str = "leases";
/// The one queue of a ranked semaphore ([`dlock_core::Hints::ranked_semaphore`]): the
/// first N entries hold a permit, the rest wait.
pub const PERMITS: &str = "permits";

/// How many entries ahead a ranked semaphore's waiter watches at least (every one, up
/// to this many). Armed together right after the enqueue, they need no read of their
/// own (the enqueue's listing serves them: etcd's kept queue watch), and none is armed
/// again while the entries ahead go (more are armed only from a new listing:
/// [`dlock_core::driver::permit_next`]); with only the `permits` nearest, each release
/// made every waiter behind it arm the next one, a read each. Measured on one etcd (W4,
/// 8 workers, 3 permits): see docs/benchmarks.md, round eight. A change wakes at most
/// this many waiters (or the permit count, if larger): constant in the queue's length,
/// where every contender of the name was given one count (see [`permit_holders`]).
const WATCH_AHEAD: usize = 8;

/// What a ranked semaphore's entry carries after the client's data: the permit count
/// its contender was given, for listings.
const PERMITS_TAG: &str = " permits=";

/// The payload of a ranked semaphore's entry: the client's data, then ` permits=N`.
fn permit_data(client: &[u8], permits: u32) -> Vec<u8> {
    let mut d = client.to_vec();
    d.extend_from_slice(PERMITS_TAG.as_bytes());
    d.extend_from_slice(permits.to_string().as_bytes());
    d
}

/// The permit count a ranked semaphore's entry was written with (see [`permit_data`]),
/// if its payload says.
pub(crate) fn permits_of(entry: &Entry) -> Option<usize> {
    // By bytes: the client's data before the tag need not be UTF-8.
    let tag = PERMITS_TAG.as_bytes();
    let at = entry.data.windows(tag.len()).rposition(|w| w == tag)?;
    std::str::from_utf8(&entry.data[at + tag.len()..])
        .ok()?
        .parse()
        .ok()
}

/// The count a ranked semaphore's waiter at `mine` goes by: its own, `permits`, or the
/// smallest count of an entry ahead of it, if smaller ([`permit_holders`] says why). An
/// entry ahead without a count (not written by dlock) sets no bound.
///
/// On a view that over-counts the entries ahead (as every view does: entries ahead only
/// go), the bound is at most the true one, so a grant on the view is a grant on the truth.
fn bounded_permits(view: &[Entry], mine: &str, permits: u32) -> u32 {
    view.iter()
        .take_while(|e| e.name != mine)
        .filter_map(permits_of)
        .map(|n| u32::try_from(n).unwrap_or(u32::MAX))
        .fold(permits, u32::min)
}

/// Whether each entry of a ranked semaphore's queue (in queue order) holds a permit: the
/// entry at index i does while i is below its contender's count and below every count
/// of the entries ahead of it. Contenders normally share one count, and this is "the
/// first N hold". Where counts differ (a semaphore-mutex beside a semaphore of the same
/// name, or semaphores of one name given different counts), the holders are still the
/// queue's first entries, and each holder with a count of n shares the semaphore with
/// fewer than n others: a semaphore-mutex's holder is alone, and one given 3 permits
/// never shares with 3 more because a later contender was given 5. (Counting its own
/// count only, a contender given 3 would be let in beside a semaphore-mutex's holder.)
/// An entry without a count is taken to hold and sets no bound (the listing then errs
/// towards "held").
pub(crate) fn permit_holders(entries: &[Entry]) -> Vec<bool> {
    let mut bound = usize::MAX;
    entries
        .iter()
        .enumerate()
        .map(|(i, e)| match permits_of(e) {
            Some(n) => {
                bound = bound.min(n);
                i < bound
            }
            None => true,
        })
        .collect()
}

/// Where a semaphore's permit count comes from.
#[derive(Debug, Clone)]
enum Permits {
    Fixed(u32),
    /// Read from a shared count node on every acquire (Curator's SharedCount: a 4-byte
    /// big-endian integer), so every process agrees on the count.
    Shared(LockName),
}

/// A fair counting semaphore: at most N holders at once, across all processes.
///
/// Each permit is its own [`LockGuard`], with its own fencing token and lost signal.
/// Matches Curator's `InterProcessSemaphoreV2` on the wire, so Java and dlock holders
/// share the same permits.
///
/// Give every contender of one name the same count (a [`SemaphoreMutex`] of that name
/// is a semaphore of one). Where counts differ, what a holder shares depends on the
/// layout: on a ranked semaphore (etcd) no holder shares it with as many others as its
/// own count, so a semaphore-mutex's holder is alone; in Curator's layout (ZooKeeper,
/// Redis), as with Curator, each contender counts the leases out against its own count
/// only, so one given three is let in beside a semaphore-mutex's holder.
pub struct Semaphore<B: DynBackend + ?Sized = dyn DynBackend> {
    client: Client<B>,
    name: LockName,
    permits: Permits,
}

// Written out because a derive would demand `B: Clone + Debug`, which `dyn DynBackend` is not.
impl<B: DynBackend + ?Sized> Clone for Semaphore<B> {
    fn clone(&self) -> Self {
        Semaphore {
            client: self.client.clone(),
            name: self.name.clone(),
            permits: self.permits.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for Semaphore<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Semaphore")
            .field("name", &self.name.as_str())
            .field("permits", &self.permits)
            .finish()
    }
}

impl<B: DynBackend + ?Sized> Semaphore<B> {
    pub(crate) fn new(client: Client<B>, name: LockName, permits: u32) -> Self {
        Semaphore {
            client,
            name,
            permits: Permits::Fixed(permits),
        }
    }

    /// A semaphore whose permit count is read from the shared count stored at
    /// `count_name` (Curator's `SharedCount` format), instead of a fixed number.
    ///
    /// # Errors
    /// [`Error::InvalidName`]; [`Error::Unsupported`] on a backend without
    /// [`Capability::SharedValue`] (only ZooKeeper has it).
    pub fn with_shared_count(client: &Client<B>, name: &str, count_name: &str) -> Result<Self> {
        client.require(Capability::SharedValue)?;
        Ok(Semaphore {
            client: client.clone(),
            name: client.lock_name(name)?,
            permits: Permits::Shared(client.lock_name(count_name)?),
        })
    }

    /// The semaphore's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    /// The permit count now in force.
    ///
    /// # Errors
    /// [`Error::InvalidPermits`] if the shared count is missing, malformed or below 1.
    pub async fn permits(&self) -> Result<u32> {
        match &self.permits {
            Permits::Fixed(n) => Ok(*n),
            Permits::Shared(count) => {
                let raw = self
                    .client
                    .backend
                    .read_value(&QueuePath::root(count.clone()))
                    .await?
                    .ok_or_else(|| {
                        Error::InvalidPermits(format!("shared count {count} is not set"))
                    })?;
                let bytes: [u8; 4] = raw.as_slice().try_into().map_err(|_| {
                    Error::InvalidPermits(format!("shared count {count} is not a 4-byte integer"))
                })?;
                let n = i32::from_be_bytes(bytes);
                u32::try_from(n)
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| Error::InvalidPermits(format!("shared count {count} is {n}")))
            }
        }
    }

    /// Waits for one permit. Permits are granted in
    /// arrival order. Each permit is its own guard (not reentrant: the same task asking
    /// twice takes two permits).
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::LockLost`], [`Error::InvalidPermits`], backend errors.
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped attempt removes its internal-mutex entry and its lease.
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the permit is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the permit from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessSemaphoreV2.acquire()` (same algorithm and layout); Redisson `RPermitExpirableSemaphore.acquire()`, but the
    /// permit is bound to the session rather than to a client-clock expiry.
    pub async fn acquire(&self) -> Result<LockGuard<B>> {
        self.acquire_lease(Wait::Forever, None).await
    }

    /// Waits at most `timeout` for one permit. A zero timeout asks once: a free permit
    /// is taken.
    ///
    /// # Errors
    /// [`Error::Timeout`]; the attempt's entries are removed before it returns; as
    /// [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`].
    ///
    /// # Upstream
    /// Curator `InterProcessSemaphoreV2.acquire(time, unit)`; Redisson
    /// `tryAcquire(waitTime, unit)`.
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<LockGuard<B>> {
        self.acquire_lease(Wait::timeout(timeout), None).await
    }

    /// Takes a permit only if one is free now; never waits. Also returns
    /// [`Error::WouldBlock`] while another contender is in the middle of taking a permit
    /// (it holds the semaphore's internal mutex for one round trip or two).
    ///
    /// # Errors
    /// [`Error::WouldBlock`] if none is free; the attempt's entries are removed.
    ///
    /// # Cancel safety
    /// As [`Semaphore::acquire`].
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the permit is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the permit from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessSemaphoreV2.acquire(0, unit)`; Redisson `tryAcquire()`.
    pub async fn try_acquire(&self) -> Result<LockGuard<B>> {
        self.acquire_lease(Wait::No, None).await
    }

    /// Waits for `n` permits, all or none, held by one guard: on an error the permits
    /// already taken are returned before this returns.
    ///
    /// The permits are taken one at a time, as Curator's `acquire(qty)` takes them: two
    /// callers that each ask for more than half the permits can each get some and wait
    /// for the rest forever. Give such calls a timeout, or serialize them (a mutex
    /// around the `acquire_many`). On etcd, where a contender goes by the smallest count
    /// ahead of it, so can one caller beside a smaller count: holding one of three
    /// permits, its second waits behind a semaphore-mutex contender of the same name
    /// that queued in between, which waits for the first (one count per name avoids it).
    ///
    /// # Errors
    /// [`Error::InvalidPermits`] if `n` is 0 or more than the semaphore has; as
    /// [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// Cancel-safe: permits already taken are released in the background (their guards
    /// are dropped), the pending attempt's entries are removed.
    ///
    /// # Session loss
    /// If the session ends while this call waits (expiry, a partition longer than the
    /// session timeout, a lease that could not be renewed), it returns
    /// [`dlock_core::Error::LockLost`] ([`dlock_core::Error::Closed`] if this client was
    /// closed) and its entry is gone with the session. Once the permit is held, the
    /// guard's [`crate::LockGuard::lost`] fires instead: stop the critical section, since
    /// another client may hold the permit from then on.
    ///
    /// # Upstream
    /// Curator `InterProcessSemaphoreV2.acquire(qty, time, unit)`.
    pub async fn acquire_many(&self, n: u32) -> Result<MultiGuard<B>> {
        self.acquire_many_with(n, Wait::Forever).await
    }

    /// [`Semaphore::acquire_many`] under one deadline for all `n` permits; a zero
    /// timeout asks once for each.
    ///
    /// # Errors
    /// [`Error::Timeout`] once the deadline passes, after the permits taken were
    /// returned; as [`Semaphore::acquire_many`].
    pub async fn acquire_many_timeout(&self, n: u32, timeout: Duration) -> Result<MultiGuard<B>> {
        self.acquire_many_with(n, Wait::timeout(timeout)).await
    }

    /// [`Semaphore::acquire_many`] only if `n` permits are free now; never waits.
    ///
    /// # Errors
    /// [`Error::WouldBlock`], after the permits taken were returned; as
    /// [`Semaphore::acquire_many`].
    pub async fn try_acquire_many(&self, n: u32) -> Result<MultiGuard<B>> {
        self.acquire_many_with(n, Wait::No).await
    }

    async fn acquire_many_with(&self, n: u32, w: Wait) -> Result<MultiGuard<B>> {
        let total = self.permits().await?;
        if n == 0 || n > total {
            return Err(Error::InvalidPermits(format!(
                "asked for {n} of the {total} permits of {}",
                self.name
            )));
        }
        // Not sized from `n`, which only the permit count bounds (up to u32::MAX): the
        // guards come one wait at a time.
        let mut got = Vec::new();
        for _ in 0..n {
            match self.acquire_lease(w, None).await {
                Ok(g) => got.push(g),
                Err(e) => {
                    for mut g in got.into_iter().rev() {
                        let _ = g.release().await;
                    }
                    return Err(e);
                }
            }
        }
        MultiGuard::granted(got).await
    }

    /// Takes one lease; `key` names the hold for scopes (a semaphore-mutex's), `None`
    /// for a plain permit. The guard is made before the metrics and the log line, so
    /// that a panic in a recorder or a subscriber drops a guard, which removes the
    /// entry, rather than a bare hold, which nothing would remove.
    pub(crate) async fn acquire_lease(
        &self,
        w: Wait,
        key: Option<HoldKey>,
    ) -> Result<LockGuard<B>> {
        let span = tracing::debug_span!(
            "dlock.acquire",
            lock = %self.name,
            kind = "lease",
            token = tracing::field::Empty,
            wait_ms = tracing::field::Empty
        );
        let asked = tokio::time::Instant::now();
        // The guard is made inside the instrumented future: the span's exit runs after.
        let result = async { self.acquire_lease_inner(w, key).await.map(LockGuard::new) }
            .instrument(span.clone())
            .await;
        crate::metrics::acquire(
            self.client.backend.kind(),
            "lease",
            asked.elapsed(),
            &result,
        );
        let guard = result?;
        span.record("token", guard.token().get());
        span.record("wait_ms", asked.elapsed().as_secs_f64() * 1e3);
        tracing::debug!(parent: &span, "acquired");
        Ok(guard)
    }

    async fn acquire_lease_inner(
        &self,
        w: Wait,
        key: Option<HoldKey>,
    ) -> Result<std::sync::Arc<Held<B>>> {
        let backend = &self.client.backend;
        let rt = self.client.cleanup_runtime();
        let max = self.permits().await?;
        if backend.hints().ranked_semaphore {
            let (q, entry) = self.acquire_ranked(w, max, &rt).await?;
            return Held::grant(backend.clone(), q, entry, key, rt).await;
        }
        let locks = QueuePath::sub(self.name.clone(), LOCKS);
        let leases = QueuePath::sub(self.name.clone(), LEASES);
        // A turn that gave its lease back (`Ok(None)` below) queues again.
        loop {
            // The internal mutex: fair, and only its holder waits on the leases.
            let inner = queue::acquire(
                backend,
                &locks,
                self.client.tickets.ticket(),
                EntryKind::Lock,
                Position::Tail,
                &self.client.data,
                w,
                &rt,
            )
            .await?;
            let mut lost = backend.lost(&locks, &inner);
            let mut inner_guard = RemoveInner {
                backend: backend.clone(),
                q: locks.clone(),
                // Made before any removal of the internal mutex is sent: its background
                // retries stop only at the session's end (see `queue::spawn_remove`).
                ended: queue::lost_signal(backend.lost(&locks, &inner)),
                entry: Some(inner),
                rt: rt.clone(),
            };
            let ticket = self.client.tickets.ticket();
            let cleanup =
                AbandonOnDrop::new(backend.clone(), leases.clone(), ticket.clone(), rt.clone());
            let attempt = async {
                // While this contender holds the internal mutex nobody else adds a lease, so
                // the lease set can only shrink: one listing tells whether a permit is free,
                // and a change reported after it means one is. Where the backend can, the
                // lease is then created and the mutex handed on in one atomic step (one
                // synced write on ZooKeeper), without a lease that has to wait.
                if !backend.hints().atomic_enqueue_removing {
                    // Curator's order: add the lease, then look; wait with it in place.
                    let enq = backend
                        .enqueue(
                            &leases,
                            &ticket,
                            EntryKind::Lease,
                            Position::Tail,
                            &self.client.data,
                        )
                        .await?;
                    let mine = enq.mine;
                    let mut seen = enq.queue;
                    loop {
                        if !seen.iter().any(|e| e.name == mine.name) {
                            return Err(Error::LockLost(format!(
                                "lease {} vanished from {leases}",
                                mine.name
                            )));
                        }
                        if lease_granted(seen.len(), max) {
                            return Ok(Some(mine));
                        }
                        if let Some(refused) = w.refusal() {
                            return Err(refused);
                        }
                        tokio::select! {
                            r = backend.wait_changed(&leases, &seen) => r?,
                            e = &mut lost => return Err(e),
                        }
                        seen = backend.queue(&leases).await?;
                    }
                }
                let mut seen = backend.queue(&leases).await?;
                loop {
                    if lease_granted(seen.len() + 1, max) {
                        let Some(inner) = inner_guard.entry.as_ref() else {
                            return Err(Error::LockLost(format!(
                                "the internal mutex of {} was released while taking a lease",
                                self.name
                            )));
                        };
                        let mine = backend
                            .enqueue_removing(
                                &leases,
                                &ticket,
                                EntryKind::Lease,
                                &self.client.data,
                                &locks,
                                inner,
                            )
                            .await?;
                        // The mutex entry went with the lease's creation.
                        inner_guard.entry = None;
                        // Counted again with the lease in place, as Curator's contender
                        // counts: the listing above was made before it, and a lease
                        // can be added without the mutex (a Curator contender whose
                        // session expired while it held the mutex creates its lease on
                        // a new session without taking the mutex again). Of any set of
                        // holders, the one with the newest lease counted every other
                        // holder's lease ahead of its own, so nobody who finds at most
                        // `max` up to its own can be one too many.
                        let upto = backend.queue_ahead(&leases, &mine).await?;
                        return match upto.iter().position(|e| e.name == mine.name) {
                            Some(i) if lease_granted(i + 1, max) => Ok(Some(mine)),
                            Some(i) => {
                                tracing::warn!(
                                    semaphore = %self.name,
                                    leases = i + 1,
                                    permits = max,
                                    "more leases than permits: one was added without the internal mutex; giving this one back and queueing again"
                                );
                                Ok(None)
                            }
                            None => Err(Error::LockLost(format!(
                                "lease {} vanished from {leases}",
                                mine.name
                            ))),
                        };
                    }
                    if let Some(refused) = w.refusal() {
                        return Err(refused);
                    }
                    tokio::select! {
                        r = backend.wait_changed(&leases, &seen) => r?,
                        e = &mut lost => return Err(e),
                    }
                    if lease_granted(seen.len(), max) {
                        // At least one of the `seen` leases went and none came, so a permit
                        // is free whichever it was: only the count matters from here on.
                        seen.pop();
                    } else {
                        seen = backend.queue(&leases).await?;
                    }
                }
            };
            let result = queue::within(w, attempt).await;
            inner_guard.release().await;
            match result {
                Ok(Some(entry)) => {
                    cleanup.disarm();
                    return Held::grant(backend.clone(), leases.clone(), entry, key, rt).await;
                }
                Ok(None) => cleanup.abandon_now().await,
                Err(e) => {
                    cleanup.abandon_now().await;
                    return Err(e);
                }
            }
        }
    }
}

impl<B: DynBackend + ?Sized> Semaphore<B> {
    /// Takes a permit of a ranked semaphore: adds an entry to `permits` and waits until
    /// fewer than `max` entries are ahead of it, and fewer than the count of any entry
    /// ahead ([`permit_holders`]). Cancellation-safe as every acquire: on
    /// an error, or when dropped, the entry is removed.
    async fn acquire_ranked(
        &self,
        w: Wait,
        max: u32,
        rt: &queue::Runtime,
    ) -> Result<(QueuePath, Entry)> {
        let backend = &self.client.backend;
        let q = QueuePath::sub(self.name.clone(), PERMITS);
        let ticket = self.client.tickets.ticket();
        let cleanup = AbandonOnDrop::new(backend.clone(), q.clone(), ticket.clone(), rt.clone());
        let data = permit_data(&self.client.data, max);
        let attempt = async {
            let enq = backend
                .enqueue(&q, &ticket, EntryKind::Lease, Position::Tail, &data)
                .await?;
            let mine = enq.mine;
            // The listing as this contender last knew it: entries ahead only go (a new
            // one sorts last), so dropping those it is told went keeps it an
            // over-count of who is ahead, and a grant on it is a grant on the truth.
            let mut view = enq.queue;
            // Armed at the first wait, as in a mutex acquire.
            let mut lost: Option<BoxFuture<'static, Error>> = None;
            // One watch per entry waited on, kept until that entry goes: the window
            // only ever gains entries further ahead as the nearer ones go.
            let mut watches = FuturesUnordered::new();
            let mut watching: HashSet<String> = HashSet::new();
            // Whether `view` is a listing not yet acted on: only such a listing is
            // trusted to arm watches from (`permit_next`).
            let mut fresh = true;
            // Whether every wake-up since the last listing showed `mine` still queued
            // when its entry went (`Woken::mine_queued`). All of them, not the last: the
            // watches are separate streams, so their wake-ups can arrive in another
            // order than the removals, and an earlier removal's "still queued" heard
            // last must not stand for a later removal that came after `mine` went.
            let mut proven = true;
            loop {
                let bound = bounded_permits(&view, &mine.name, max);
                let next = permit_next(
                    &view,
                    &mine.name,
                    bound,
                    WATCH_AHEAD,
                    |n| watching.contains(n),
                    fresh,
                );
                let listed = std::mem::replace(&mut fresh, false);
                match next {
                    // On a listing that named `mine`, granted; on a view a watch
                    // shortened, granted once `mine` is known to be still queued.
                    PermitNext::Granted if listed => return Ok(mine),
                    PermitNext::Granted => {
                        return queue::confirmed(backend.as_ref(), &q, mine, proven).await
                    }
                    PermitNext::Missing => {
                        return Err(Error::LockLost(format!(
                            "entry {} vanished from {q} while waiting",
                            mine.name
                        )))
                    }
                    PermitNext::Relist => {
                        view = backend.queue_ahead(&q, &mine).await?;
                        (fresh, proven) = (true, true);
                        continue;
                    }
                    PermitNext::Wait(mut arm) => {
                        if let Some(refused) = w.refusal() {
                            return Err(refused);
                        }
                        // An entry ahead with a smaller count than `max` holds the bound
                        // down until it goes, wherever it is in the queue: watched too,
                        // or a permit it frees would wait for a nearer entry to go.
                        if bound < max {
                            arm.extend(
                                view.iter()
                                    .take_while(|e| e.name != mine.name)
                                    .filter(|e| {
                                        permits_of(e).is_some_and(|n| n < max as usize)
                                            && !watching.contains(&e.name)
                                            && !arm.iter().any(|a| a.name == e.name)
                                    })
                                    .cloned()
                                    .collect::<Vec<_>>(),
                            );
                        }
                        for e in arm {
                            watching.insert(e.name.clone());
                            let gone = queue::watch_gone_behind(
                                backend.clone(),
                                q.clone(),
                                e.clone(),
                                mine.clone(),
                            );
                            watches.push(async move { (e.name, gone.await) });
                        }
                    }
                }
                tracing::trace!(queue = %q, mine = %mine.name, watching = watching.len(), "waiting for a permit");
                let lost = lost.get_or_insert_with(|| backend.lost(&q, &mine));
                tokio::select! {
                    // A session lost at the moment a permit came free is lost.
                    biased;
                    e = lost => return Err(e),
                    Some((name, r)) = watches.next() => {
                        watching.remove(&name);
                        let woken = r?;
                        proven &= woken.mine_queued;
                        match woken.gone {
                            // Found missing, not seen removed: it may have gone with
                            // mine, which only a fresh listing can tell.
                            Gone::Vanished => {
                                view = backend.queue_ahead(&q, &mine).await?;
                                (fresh, proven) = (true, true);
                            }
                            _ => view.retain(|e| e.name != name),
                        }
                    }
                }
            }
        };
        match queue::within(w, attempt).await {
            Ok(entry) => {
                cleanup.disarm();
                Ok((q, entry))
            }
            Err(e) => {
                cleanup.abandon_now().await;
                Err(e)
            }
        }
    }
}

/// Releases the internal mutex of a semaphore acquire, in the background if the acquire
/// future is dropped.
struct RemoveInner<B: DynBackend + ?Sized> {
    backend: std::sync::Arc<B>,
    q: QueuePath,
    entry: Option<dlock_core::Entry>,
    /// The entry's lost signal, made before its first removal was sent.
    ended: queue::LostSignal,
    /// Where a removal left by a drop runs (see [`queue::Runtime`]).
    rt: queue::Runtime,
}

impl<B: DynBackend + ?Sized> RemoveInner<B> {
    async fn release(mut self) {
        if let Some(e) = &self.entry {
            if self.backend.remove(&self.q, e).await.is_ok() {
                self.entry = None;
            }
        }
    }
}

impl<B: DynBackend + ?Sized> Drop for RemoveInner<B> {
    fn drop(&mut self) {
        if let Some(e) = self.entry.take() {
            queue::spawn_remove(
                &self.rt,
                self.backend.clone(),
                self.q.clone(),
                e,
                self.ended.clone(),
            );
        }
    }
}

/// A non-reentrant mutex: a [`Semaphore`] with one permit (Curator's
/// `InterProcessSemaphoreMutex`, same layout).
///
/// Asking for it again inside the holder's own scope ([`LockGuard::scope`]) returns
/// [`Error::WouldDeadlock`] where Curator deadlocks; anyone else, a sibling future of the
/// holding task included, waits like any contender. The guard may be released from any
/// task.
pub struct SemaphoreMutex<B: DynBackend + ?Sized = dyn DynBackend> {
    sem: Semaphore<B>,
}

// Written out because a derive would demand `B: Clone + Debug`, which `dyn DynBackend` is not.
impl<B: DynBackend + ?Sized> Clone for SemaphoreMutex<B> {
    fn clone(&self) -> Self {
        SemaphoreMutex {
            sem: self.sem.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for SemaphoreMutex<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SemaphoreMutex")
            .field("name", &self.sem.name.as_str())
            .finish()
    }
}

impl<B: DynBackend + ?Sized> SemaphoreMutex<B> {
    pub(crate) fn new(client: Client<B>, name: LockName) -> Self {
        SemaphoreMutex {
            sem: Semaphore::new(client, name, 1),
        }
    }

    /// The lock's name.
    pub fn name(&self) -> &LockName {
        &self.sem.name
    }

    /// Waits for the lock.
    ///
    /// # Errors
    /// [`Error::WouldDeadlock`] if called inside a scope of this lock's own hold; as
    /// [`Semaphore::acquire`].
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`Semaphore::acquire`].
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
    /// Curator `InterProcessSemaphoreMutex.acquire()` (which self-deadlocks on
    /// re-entry); Redisson's non-reentrant lock.
    pub async fn lock(&self) -> Result<LockGuard<B>> {
        self.lock_with(Wait::Forever).await
    }

    /// Waits at most `timeout` for the lock. A zero timeout asks once: a free lock is
    /// taken.
    ///
    /// # Errors
    /// [`Error::Timeout`]; the attempt's entries are removed before it returns; as
    /// [`SemaphoreMutex::lock`].
    ///
    /// # Cancel safety
    /// As [`SemaphoreMutex::lock`].
    ///
    /// # Upstream
    /// Curator `InterProcessSemaphoreMutex.acquire(time, unit)`.
    pub async fn lock_timeout(&self, timeout: Duration) -> Result<LockGuard<B>> {
        self.lock_with(Wait::timeout(timeout)).await
    }

    /// Takes the lock only if it is free now; never waits.
    ///
    /// # Errors
    /// [`Error::WouldBlock`], [`Error::WouldDeadlock`].
    ///
    /// # Cancel safety
    /// As [`SemaphoreMutex::lock`].
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
    /// Curator `InterProcessSemaphoreMutex.acquire(0, unit)`.
    pub async fn try_lock(&self) -> Result<LockGuard<B>> {
        self.lock_with(Wait::No).await
    }

    async fn lock_with(&self, w: Wait) -> Result<LockGuard<B>> {
        let client = &self.sem.client;
        let key = HoldKey {
            client: client.id,
            lock: self.sem.name.clone(),
            recipe: Recipe::SemaphoreMutex,
        };
        // Only code inside this very hold's scope is known to ask again; anyone else
        // (a sibling future of the same task included) waits like any contender.
        if Scope::find::<Held<B>>(&key).is_some_and(|h| h.guards() > 0) {
            return Err(Error::WouldDeadlock(format!(
                "{} is not reentrant and the current scope already holds it",
                self.sem.name
            )));
        }
        self.sem.acquire_lease(w, Some(key)).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::driver::{permit_decision, PermitDecision};

    fn entry(i: usize, permits: Option<u32>) -> Entry {
        Entry {
            name: format!("e{i}"),
            kind: EntryKind::Lease,
            seq: i as u64,
            token: None,
            ticket: None,
            created_ms: None,
            data: match permits {
                Some(n) => permit_data(b"host", n),
                None => b"foreign".to_vec(),
            },
        }
    }

    /// Every queue of up to five entries, each given 1, 2 or 3 permits or no count: the
    /// holders are the queue's first entries; a holder given n shares with fewer than n
    /// others; with one count N for all, the first N hold; and a waiter's own decision
    /// (its bound on the queue, then the driver's rule) agrees with the listing's.
    #[test]
    fn mixed_counts_never_let_a_holder_share_beyond_its_own_count() {
        let choices = [Some(1), Some(2), Some(3), None];
        for len in 1..=5usize {
            for code in 0..choices.len().pow(len as u32) {
                let counts: Vec<Option<u32>> = (0..len)
                    .map(|i| choices[code / choices.len().pow(i as u32) % choices.len()])
                    .collect();
                let q: Vec<Entry> = counts
                    .iter()
                    .enumerate()
                    .map(|(i, c)| entry(i, *c))
                    .collect();
                let held = permit_holders(&q);
                let holders = held.iter().filter(|h| **h).count();
                assert!(
                    held.iter().skip(holders).all(|h| !h) || counts.contains(&None),
                    "holders not a prefix: {counts:?} -> {held:?}"
                );
                for (i, c) in counts.iter().enumerate() {
                    let Some(n) = c else { continue };
                    if held[i] {
                        let with_count = (0..len)
                            .filter(|j| held[*j] && counts[*j].is_some())
                            .count();
                        assert!(with_count <= *n as usize, "{counts:?} -> {held:?}");
                    }
                    let bound = bounded_permits(&q, &q[i].name, *n);
                    let granted =
                        permit_decision(&q, &q[i].name, bound, 8) == PermitDecision::Granted;
                    assert_eq!(granted, held[i], "entry {i} of {counts:?}");
                }
                if let Some(n) = counts[0].filter(|_| counts.iter().all(|c| *c == counts[0])) {
                    assert_eq!(holders, len.min(n as usize), "{counts:?}");
                }
            }
        }
    }

    /// The case a review found: a semaphore-mutex's holder first, then a contender given
    /// three permits, then one given three behind a semaphore-mutex's waiter. Counting
    /// only its own count, the second was granted beside the first, and the fourth ahead
    /// of the third, queued before it.
    #[test]
    fn a_semaphore_mutex_holder_is_alone_and_keeps_its_place() {
        let q = [entry(0, Some(1)), entry(1, Some(3))];
        assert_eq!(permit_holders(&q), [true, false]);
        assert_eq!(bounded_permits(&q, "e1", 3), 1);
        let q = [entry(0, Some(3)), entry(1, Some(1)), entry(2, Some(3))];
        assert_eq!(permit_holders(&q), [true, false, false]);
        assert_eq!(bounded_permits(&q, "e2", 3), 1);
        let q = [entry(0, Some(3)), entry(1, Some(3)), entry(2, Some(5))];
        assert_eq!(permit_holders(&q), [true, true, true]);
        let q = [entry(0, Some(2)), entry(1, Some(5)), entry(2, Some(5))];
        assert_eq!(permit_holders(&q), [true, true, false]);
    }
}
