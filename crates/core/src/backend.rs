//! The trait every backend adapter implements ([`Backend`]), its object-safe form for a
//! backend chosen at run time ([`DynBackend`]), and the contract they keep.
//!
//! A backend stores queues of [`Entry`]s whose lifetime is bound to a session: a
//! ZooKeeper session, an etcd lease, a Redis watchdog lease. The recipes crate builds
//! every lock out of the operations below and never learns which backend it runs on.
//!
//! # Contract
//! - **Ordering.** [`Backend::enqueue`] and [`Backend::queue`] return queues sorted by
//!   [`crate::entry::queue_order`]; sequence numbers in one queue grow in the order the
//!   entries were added, as seen by every client.
//! - **Session binding.** An entry disappears by itself once its session is gone (crash,
//!   partition past the session timeout). Before that moment, [`Backend::lost`] of every
//!   entry on that session has completed.
//! - **One round trip.** `enqueue` adds the entry and returns the queue as it stands
//!   right after the add, in one round trip where the backend allows it.
//! - **No missed wake-up.** [`Backend::wait_gone`] arms its watch before it checks that
//!   the entry still exists, and returns at once if it does not; [`Backend::wait_changed`]
//!   likewise compares against the queue the caller saw.
//! - **Idempotent removal.** [`Backend::remove`] and [`Backend::abandon`] succeed when the
//!   entry is already gone, so they may be retried and run in the background.
//! - **Cancel safety.** Every future may be dropped at any await point. A dropped
//!   `enqueue` may still have created its entry on the server; the caller then calls
//!   `abandon` with the same [`Ticket`], which removes whatever the ticket created.
//! - **Listing.** [`Backend::list_queues`] finds every queue with an entry under a name
//!   prefix, named by its path ([`QueuePath::relative`]) with no namespace, chroot or key
//!   prefix in front: what a queue of that path would be called by the caller.

use std::future::Future;
use std::time::Duration;

use futures::future::BoxFuture;

use crate::entry::{Entry, EntryKind, Ticket};
use crate::error::{Error, Result};
use crate::name::{NameRules, QueuePath};
use crate::security::{Credentials, TlsOptions};

/// Where a new entry goes in its queue.
#[derive(Debug, Clone, Copy)]
pub enum Position<'a> {
    /// At the tail: the normal case.
    Tail,
    /// Beside an entry the caller holds, with the same sequence number. Used for a write
    /// holder's read entry (downgrade), which must not queue behind waiting writers.
    /// Only ever a read beside its owner's held write: the only way an entry can appear
    /// ahead of one already queued, which [`crate::driver::Snapshot`] relies on.
    Beside(&'a Entry),
}

/// Settings every backend's connect takes; each adapter documents its own defaults.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SessionOptions {
    /// How long a crashed or paused holder keeps its entries (ZooKeeper session timeout,
    /// etcd lease TTL, Redis lease). `None` takes the backend's documented default.
    pub session_timeout: Option<Duration>,
    /// How long connecting may take before [`Error::Unreachable`].
    pub connect_timeout: Duration,
    /// TLS to the servers; `None` is plain TCP.
    pub tls: Option<TlsOptions>,
    /// Credentials to authenticate with; `None` connects anonymously.
    pub credentials: Option<Credentials>,
    /// A prefix of every key the backend writes, so applications sharing one server do
    /// not see each other's locks: Redis key prefix (URL `?prefix=app1:`), etcd key
    /// namespace (`?namespace=/app1/`). ZooKeeper has its chroot for that and refuses a
    /// namespace ([`Error::InvalidUrl`]).
    pub namespace: Option<String>,
    /// Redis with replicas (`redis://`, `redis+sentinel://`; URL `?replicas=1`): a grant,
    /// a lease renewal or an election leader's proclaim counts only once at least this
    /// many replicas acknowledged it (`WAIT`), so a replica promoted after the primary fails has the holder's entry
    /// for as long as the holder counts on it. 0 (the default) waits for none: the
    /// asynchronous replication gap in docs/safety.md. ZooKeeper and etcd acknowledge a
    /// write only once a quorum has it and refuse this ([`Error::InvalidUrl`]); so do
    /// Redlock and Redis Cluster, where dlock does not send `WAIT`.
    pub replicas: u32,
}

impl Default for SessionOptions {
    fn default() -> Self {
        SessionOptions {
            session_timeout: None,
            connect_timeout: Duration::from_secs(5),
            tls: None,
            credentials: None,
            namespace: None,
            replicas: 0,
        }
    }
}

impl SessionOptions {
    /// The longest session or connect timeout the setters take (a year); a longer one is
    /// taken as this. Durations near `Duration::MAX` would overflow the clock arithmetic
    /// of deadlines, heartbeats and retries in the adapters.
    pub const MAX_TIMEOUT: Duration = Duration::from_secs(365 * 24 * 3600);

    /// Sets the session timeout (at most [`SessionOptions::MAX_TIMEOUT`]).
    pub fn with_session_timeout(mut self, d: Duration) -> Self {
        self.session_timeout = Some(d.min(Self::MAX_TIMEOUT));
        self
    }

    /// Sets the connect timeout (at most [`SessionOptions::MAX_TIMEOUT`]).
    pub fn with_connect_timeout(mut self, d: Duration) -> Self {
        self.connect_timeout = d.min(Self::MAX_TIMEOUT);
        self
    }

    /// The session timeout to run on: [`SessionOptions::session_timeout`], or `default`
    /// where it is `None`, at most [`SessionOptions::MAX_TIMEOUT`]. Adapters read the
    /// field through this, so a value set on the public field past what the setter takes
    /// is clamped the same way instead of overflowing their clock arithmetic.
    pub fn session_timeout_or(&self, default: Duration) -> Duration {
        self.session_timeout
            .unwrap_or(default)
            .min(Self::MAX_TIMEOUT)
    }

    /// The connect timeout to run on: [`SessionOptions::connect_timeout`], at most
    /// [`SessionOptions::MAX_TIMEOUT`] (as [`SessionOptions::session_timeout_or`]).
    pub fn connect_limit(&self) -> Duration {
        self.connect_timeout.min(Self::MAX_TIMEOUT)
    }

    /// How long one connection attempt to one server (TCP connect, TLS handshake) may
    /// take within [`SessionOptions::connect_timeout`]: a third of it, and at least a
    /// second unless the connect timeout itself is shorter.
    ///
    /// Clients try a list of servers one after the other. With the whole connect timeout
    /// per attempt, one server whose handshake stalls (a host that is down and drops the
    /// SYN, a listen queue that overflowed: the kernel retransmits after 1 s, 3 s, 7 s)
    /// uses it all and the next server is never tried. A third leaves room for two more
    /// attempts; the floor keeps a slow but working TLS handshake from being cut off
    /// again and again.
    pub fn attempt_timeout(&self) -> Duration {
        let limit = self.connect_limit();
        (limit / 3).max(limit.min(Duration::from_secs(1)))
    }

    /// Connects over TLS with these settings.
    pub fn with_tls(mut self, tls: TlsOptions) -> Self {
        self.tls = Some(tls);
        self
    }

    /// Authenticates with these credentials.
    pub fn with_credentials(mut self, credentials: Credentials) -> Self {
        self.credentials = Some(credentials);
        self
    }

    /// Prefixes every key with `namespace` (see [`SessionOptions::namespace`]).
    pub fn with_namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    /// Counts a grant or a renewal only once `replicas` replicas acknowledged it (see
    /// [`SessionOptions::replicas`]).
    pub fn with_replicas(mut self, replicas: u32) -> Self {
        self.replicas = replicas;
        self
    }

    /// For a backend that does not wait for replicas: [`Error::InvalidUrl`], saying
    /// `why`, when [`SessionOptions::replicas`] asks it to, rather than connect with a
    /// guarantee the caller asked for and does not get.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] when `replicas` is not 0.
    pub fn refuse_replicas(&self, why: &str) -> Result<(), Error> {
        if self.replicas == 0 {
            return Ok(());
        }
        Err(Error::InvalidUrl {
            url: String::new(),
            reason: format!("replicas={} is not taken here: {why}", self.replicas),
        })
    }
}

/// What a backend tells the recipes about its costs ([`Backend::hints`]). Every choice
/// is safe either way. [`Hints::watch_ahead`] and [`Hints::atomic_enqueue_removing`]
/// change only the number of round trips on a handoff and of server requests per
/// acquire; [`Hints::ranked_semaphore`] also decides where the semaphore's entries are
/// written, so it is fixed by the backend's code.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Hints {
    /// An exclusive waiter also watches the entry ahead of the one it waits on and lists
    /// the queue again when that one goes, so the handoff to it needs no listing
    /// ([`crate::driver::Snapshot::next_blocker`]): one more watch and one wake-up more
    /// per waiter, one round trip less on every handoff. Pays where a listing waits behind
    /// synced writes (ZooKeeper); not where a watch costs several commands (Redis).
    pub watch_ahead: bool,
    /// [`Backend::enqueue_removing`] is one atomic request here (not the default's enqueue
    /// then remove), so the semaphore lists its leases first and takes a free permit
    /// with it, instead of adding its lease before it looks.
    pub atomic_enqueue_removing: bool,
    /// The semaphore keeps one queue of permits and no internal mutex: the first N
    /// entries hold, the rest wait for one of the entries just ahead of them to go (at
    /// least the N nearest; [`crate::driver::permit_decision`]). Two synced writes per permit, where
    /// Curator's layout (the default) takes a mutex first; but Curator's own clients
    /// cannot share such a semaphore. Unlike the other hints this one decides the
    /// semaphore's layout (which queue its entries go to), so it must never differ
    /// between two clients of one backend: it is fixed by the backend's code, not by
    /// configuration. It relies on a new entry always sorting after every entry already
    /// in its queue, so that an entry's count of entries ahead only goes down.
    pub ranked_semaphore: bool,
}

impl Hints {
    /// Hints with every field set as given, and no [`Hints::ranked_semaphore`] (the
    /// struct is `#[non_exhaustive]`).
    pub const fn new(watch_ahead: bool, atomic_enqueue_removing: bool) -> Self {
        Hints {
            watch_ahead,
            atomic_enqueue_removing,
            ranked_semaphore: false,
        }
    }

    /// These hints with [`Hints::ranked_semaphore`] set as given.
    pub const fn with_ranked_semaphore(mut self, ranked: bool) -> Self {
        self.ranked_semaphore = ranked;
        self
    }
}

/// An optional ability of a backend, beyond the queue every backend keeps. A recipe
/// that needs one asks [`Backend::supports`] before it writes anything, so asking a
/// backend for what it cannot do is [`Error::Unsupported`] at the call, never a silent
/// default and never a half-done operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Capability {
    /// Writing and watching an entry's payload ([`Backend::set_data`],
    /// [`Backend::wait_data_changed`]): how a holder is asked to release (Curator's
    /// revocation).
    Revocation,
    /// A small value stored at a queue itself ([`Backend::read_value`]): the semaphore's
    /// shared permit count (Curator's `SharedCount`).
    SharedValue,
    /// Replacing a live entry's own payload in place, only while it is still that entry
    /// ([`Backend::proclaim`]), and watching it ([`Backend::wait_data_changed`]): how an
    /// election's leader changes its value without giving up the lead (etcd's
    /// `Election.Proclaim`).
    Proclaim,
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Capability::Revocation => "revocation (an entry's payload, written and watched)",
            Capability::SharedValue => "a shared value stored at the lock (a shared permit count)",
            Capability::Proclaim => "proclaim (a live entry's own payload, replaced in place)",
        })
    }
}

/// How a watched entry left its queue, as far as the backend can tell
/// ([`Backend::wait_gone_detail`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Gone {
    /// Nothing more is known: entries ahead of it may still be queued.
    Unknown,
    /// At the moment it was removed, no other entry was queued with a sequence number up
    /// to its own: it was the head of the queue, with no downgrade read beside it. A
    /// backend reports this only when it knows it for certain at the removal's moment:
    /// the removal itself observed it atomically (one script, one transaction; on
    /// several masters, a majority did), or the waiter read every entry up to that
    /// sequence at one revision and then saw every change to the queue after it, in
    /// order, up to and including the removal's own (etcd, on a short queue). The
    /// contract's `gone` tests check that it is never said for anything else.
    Head,
    /// Found missing by a check, not seen being removed: the server may have lost it
    /// together with other entries (a restart that kept no data, a failover to a replica
    /// that never had them), the waiter's own entry included. The waiter must list the
    /// queue again before it takes the lock: a view taken before the loss would let it
    /// in with no entry of its own on the server.
    Vanished,
}

/// What a waiter learns when the entry it waited on goes ([`Backend::wait_gone_behind`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Woken {
    /// How the entry went.
    pub gone: Gone,
    /// The backend knows that the waiter's own entry was still queued when the watched
    /// entry went (from the same ordered stream of events that told it so), so the waiter
    /// needs no [`Backend::still_queued`] before it holds. `false` says only that it does
    /// not know.
    pub mine_queued: bool,
}

impl Woken {
    /// A wake-up: how the entry went, and whether the waiter's own entry is known to
    /// have been queued then.
    pub const fn new(gone: Gone, mine_queued: bool) -> Self {
        Woken { gone, mine_queued }
    }
}

/// The result of [`Backend::enqueue`].
#[derive(Debug, Clone)]
pub struct Enqueued {
    /// The entry that was added, with its fencing token.
    pub mine: Entry,
    /// The whole queue right after the add, in queue order, `mine` included.
    pub queue: Vec<Entry>,
}

/// One queue with at least one entry, as [`Backend::list_queues`] finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ListedQueue {
    /// The queue's path as [`QueuePath::relative`] writes it: `orders/42` for a lock's
    /// own queue, `orders/42/leases` for a semaphore's sub-queue. A backend cannot tell a
    /// sub-queue from a lock of that name (both are the same path on ZooKeeper and etcd),
    /// so it reports paths and leaves the recipes' layout to the recipes.
    pub path: String,
    /// Its entries in queue order, never empty: names, kinds and sequence numbers
    /// always; tokens and payloads where the listing read them anyway.
    pub entries: Vec<Entry>,
}

impl ListedQueue {
    /// The queue at `path` with `entries` (the struct is `#[non_exhaustive]`).
    pub fn new(path: impl Into<String>, entries: Vec<Entry>) -> Self {
        ListedQueue {
            path: path.into(),
            entries,
        }
    }
}

/// How long before the earliest moment the server may expire a session of timeout
/// `session` every backend's [`Backend::lost`] fires: max(10 % of the timeout, 100 ms).
/// It covers the last round trip, scheduler delay (a loaded machine, a slow poll) and
/// timer skew between the client's and the server's clocks, which all run between the
/// moment the client's deadline passes and the moment its holder stops.
pub fn lost_margin(session: Duration) -> Duration {
    (session / 10).max(Duration::from_millis(100))
}

/// A key/value store with session-bound, ordered queues: the one seam between the
/// recipes and a server. See the module docs for the contract every implementation keeps.
///
/// Implement this trait for a backend: its async methods return `impl Future + Send`,
/// so an adapter writes them as `async fn` or returns an `async` block, with no boxing.
/// Where the backend is chosen at run time (the facade's `Arc<dyn DynBackend>`), use
/// [`DynBackend`], its object-safe twin, which a blanket impl provides for every
/// `Backend` by boxing each call's future; one allocation per call is noise beside a
/// network round trip.
pub trait Backend: Send + Sync + 'static {
    /// A short backend label for logs and status output: `zk`, `etcd`, `redis`, `redlock`.
    fn kind(&self) -> &'static str;

    /// The lock-name rules of this backend.
    fn name_rules(&self) -> NameRules;

    /// How long a crashed or paused holder keeps its entries: the ZooKeeper session
    /// timeout, the etcd lease TTL, the Redis lease.
    fn session_timeout(&self) -> Duration;

    /// How the recipes should trade round trips against server requests on this backend.
    /// The default asks for nothing beyond the minimum number of requests.
    fn hints(&self) -> Hints {
        Hints::default()
    }

    /// Whether this backend has `capability`. The default has none; a backend that
    /// overrides the methods of a capability says so here, and the recipes check it
    /// before they start an operation that needs it.
    fn supports(&self, capability: Capability) -> bool {
        let _ = capability;
        false
    }

    /// Adds an entry of `kind` for `ticket` to queue `q`, bound to the session, and
    /// returns it with the queue as it stands right after. Creates the queue's parents
    /// on demand.
    fn enqueue(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> impl Future<Output = Result<Enqueued>> + Send;

    /// Adds an entry of `kind` for `ticket` at the tail of `q` and removes `gone` from
    /// `gone_q`, as one atomic step where the backend allows it (ZooKeeper: one `multi`,
    /// one synced write instead of two). Returns the added entry with its token. The
    /// semaphore uses it to take its lease and hand its internal mutex on in one step.
    ///
    /// `gone` is an entry the caller holds; a backend may fail with [`Error::LockLost`]
    /// if it is missing. On any error the caller cleans up both, as after a failed
    /// [`Backend::enqueue`] (`abandon` with `ticket`, `remove` of `gone`). The default
    /// enqueues, then removes: the same effect in two round trips.
    fn enqueue_removing(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> impl Future<Output = Result<Entry>> + Send {
        async move {
            let added = Backend::enqueue(self, q, ticket, kind, Position::Tail, data).await?;
            Backend::remove(self, gone_q, gone).await?;
            Ok(added.mine)
        }
    }

    /// The queue `q` in queue order (empty if it does not exist).
    fn queue(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send;

    /// The part of `q` that decides `mine`'s place, in queue order: every entry queued
    /// ahead of `mine` (by [`crate::entry::queue_order`]) and `mine` itself if it is still
    /// queued; entries behind `mine` may or may not be included. [`crate::driver::decide`]
    /// gives the same answer for `mine` on it as on the whole queue (it only looks ahead),
    /// so a woken waiter can re-check at a cost that grows with what is ahead of it, not
    /// with the queue's length.
    ///
    /// The default returns the whole queue ([`Backend::queue`]); backends that can read a
    /// prefix of a queue cheaply override it.
    fn queue_ahead(
        &self,
        q: &QueuePath,
        mine: &Entry,
    ) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        let _ = mine;
        Backend::queue(self, q)
    }

    /// Whether `entry` is still in `q` on the server: the question a holder asks to
    /// confirm it still holds.
    ///
    /// The default reads [`Backend::queue_ahead`], which for a holder is at most the
    /// entries granted beside it, and looks for `entry`'s name. Backends whose token is
    /// one value the server keeps with the entry override it to compare the token too,
    /// so that an entry re-created under the same name does not count; the default
    /// cannot, because a token may be a view that differs between reads (Redlock's is
    /// the highest of the masters that answered).
    fn contains(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<bool>> + Send {
        async move {
            let ahead = Backend::queue_ahead(self, q, entry).await?;
            Ok(ahead.iter().any(|e| e.name == entry.name))
        }
    }

    /// Whether a waiter's own `entry` is still in `q`, asked when a watch of this session
    /// ([`Backend::wait_gone`], [`Backend::wait_gone_detail`]) has just said that an entry
    /// ahead of it went, before the waiter takes the lock from its own view.
    ///
    /// The answer must reflect at least every change that watch reported: an entry
    /// deleted from outside before the one ahead went (an operator's delete, a revoked
    /// lease, a server that lost keys) must be reported gone, or its waiter would hold
    /// beside the contender that queued after the deletion. It may reflect an older state
    /// than [`Backend::contains`], which a holder asks about the present. The default is
    /// [`Backend::contains`]; a backend that can answer for the watched moment more
    /// cheaply overrides it.
    fn still_queued(
        &self,
        q: &QueuePath,
        entry: &Entry,
    ) -> impl Future<Output = Result<bool>> + Send {
        Backend::contains(self, q, entry)
    }

    /// Completes once `entry` is no longer in `q` (at once if it is already gone). Only
    /// that very entry's removal counts, never that of an older entry under the same
    /// name (a key reused by the same client), however late its event arrives.
    fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send;

    /// As [`Backend::wait_gone`], and says what the backend knows of how `entry` went
    /// ([`Gone`]). A backend that knows the removed entry was the head of its queue
    /// spares the woken waiter its re-listing ([`crate::driver::Snapshot::without_head`]):
    /// one round trip less on the handoff.
    ///
    /// The default waits with [`Backend::wait_gone`] and knows nothing
    /// ([`Gone::Unknown`]), which is always correct.
    fn wait_gone_detail(
        &self,
        q: &QueuePath,
        entry: &Entry,
    ) -> impl Future<Output = Result<Gone>> + Send {
        async move {
            Backend::wait_gone(self, q, entry).await?;
            Ok(Gone::Unknown)
        }
    }

    /// As [`Backend::wait_gone_detail`], for a waiter whose own entry in `q` is `mine`:
    /// also says whether the backend knows `mine` was still queued when `entry` went
    /// ([`Woken::mine_queued`]). It must never say so of an entry deleted before `entry`
    /// went; the contract's `still_queued_answers_for_the_moment_of_the_wake` checks it.
    ///
    /// The default waits with [`Backend::wait_gone_detail`] and knows nothing of `mine`,
    /// which is always correct: the waiter then asks [`Backend::still_queued`].
    fn wait_gone_behind(
        &self,
        q: &QueuePath,
        entry: &Entry,
        mine: &Entry,
    ) -> impl Future<Output = Result<Woken>> + Send {
        let _ = mine;
        async move {
            let gone = Backend::wait_gone_detail(self, q, entry).await?;
            Ok(Woken::new(gone, false))
        }
    }

    /// Completes once the set of entries in `q` differs from `seen` (at once if it
    /// already does). Used only by the one semaphore contender that waits on leases.
    /// A change reported by a watch counts even if the set has changed back since: the
    /// caller knows which changes can happen (while it holds the semaphore's internal
    /// mutex, leases can only go). Only a removal must wake it promptly: a backend may
    /// leave an addition to its periodic re-check (Redis publishes removals only).
    ///
    /// A change already in `seen` never counts: the semaphore takes a wake for a lease
    /// gone, so an event the caller's read had shown (an etcd member that lagged behind
    /// that read sends such events once it catches up) must not complete it.
    fn wait_changed(
        &self,
        q: &QueuePath,
        seen: &[Entry],
    ) -> impl Future<Output = Result<()>> + Send;

    /// Removes `entry` from `q`. Succeeds if it is already gone.
    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send;

    /// Removes whatever entry `ticket` created in `q`, if any: the clean-up after a
    /// cancelled or failed `enqueue`. Succeeds if there is none.
    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send;

    /// Completes, with the reason, once `entry` can no longer be trusted to be held:
    /// the session expired, or was cut off from the servers for longer than its timeout,
    /// or the entry's lease could not be renewed. Never completes while it is held.
    ///
    /// It must complete before the server can let any other contender in: at least
    /// [`lost_margin`] of the session timeout before the earliest moment the server may
    /// expire the session, computed from when the request that last proved the session
    /// alive was *sent* (the server renewed it after that).
    ///
    /// Once the client knows the entry is lost (or its session closed), every lost
    /// future made from then on completes at its first poll, and the client never
    /// forgets a loss: the recipes learn synchronously whether a hold is lost by asking
    /// [`Backend::lost_now`] (`is_lost`, the grant, re-entry, release, `verify`).
    ///
    /// Unlike the other methods it returns a boxed `'static` future: the signal outlives
    /// the call that asked for it (a guard keeps it while it holds).
    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error>;

    /// What a lost future of `entry` made now would complete with at its first poll:
    /// `Some(reason)` once the client knows the entry is lost or its session closed (on
    /// backends whose signal is per entry, such as Redis, also once it was released),
    /// `None` while it would wait. The recipes ask it at every grant, re-entry and
    /// release, without keeping a signal.
    ///
    /// It must also answer `Some` once the session's (or the entry's) deadline has
    /// passed, whether or not the task that keeps the session alive has run since to
    /// declare the loss, and keep answering `Some` after that: on a starved runtime that
    /// task can run long after the server expired the session (see
    /// [`crate::SharedDeadline`]). A lost future can only say so once that task runs.
    ///
    /// The default polls a fresh [`Backend::lost`] future once: right while the keeping
    /// task runs on time, not the deadline's part. Every adapter in this repository and
    /// the in-memory backend override it to read their state directly, and to compare the
    /// clock with their deadline; the contract suite checks it agrees with a lost future
    /// while held and after `close`.
    fn lost_now(&self, q: &QueuePath, entry: &Entry) -> Option<Error> {
        futures::FutureExt::now_or_never(self.lost(q, entry))
    }

    /// Reads the small value stored at the queue `q` itself (not in one of its entries),
    /// or `None` if none is set. The recipes use it for the semaphore's shared permit
    /// count (Curator's `SharedCount`), read at [`QueuePath::root`] of the count's name.
    ///
    /// Part of [`Capability::SharedValue`]. The default fails with
    /// [`Error::Unsupported`]. ZooKeeper overrides it and reads the data of `q`'s znode,
    /// where empty data or a missing znode counts as not set.
    fn read_value(&self, q: &QueuePath) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        let _ = q;
        async move { Err(unsupported(Backend::kind(self), Capability::SharedValue)) }
    }

    /// Replaces the payload of `entry` in `q` with `data`: how a revocation request is
    /// delivered (Curator's `Revoker.attemptRevoke` writes [`crate::entry::REVOKE_MESSAGE`]
    /// into the holder's node). Succeeds if the entry is already gone, as Curator's does.
    ///
    /// Part of [`Capability::Revocation`]. The default fails with [`Error::Unsupported`];
    /// backends that can watch an entry's payload override it together with
    /// [`Backend::wait_data_changed`].
    fn set_data(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        let _ = (q, entry, data);
        async move { Err(unsupported(Backend::kind(self), Capability::Revocation)) }
    }

    /// Replaces the payload of this session's own live `entry` in `q` with `data`, only
    /// if the entry is still the one created (same token where the backend has tokens):
    /// never on a newer entry that took its name. An election's leader changes its
    /// value this way.
    ///
    /// # Errors
    /// [`Error::LockLost`] where the backend can tell that the entry is gone or was
    /// replaced (a backend that cannot tell writes nothing then, and the caller checks
    /// the entry with a listing); a backend error.
    ///
    /// Part of [`Capability::Proclaim`]. The default writes with [`Backend::set_data`]
    /// on a backend with [`Capability::Revocation`] (a znode's name is never reused
    /// under its parent, so the write reaches only that entry or nothing), and fails
    /// with [`Error::Unsupported`] otherwise.
    fn proclaim(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        async move {
            if Backend::supports(self, Capability::Revocation) {
                Backend::set_data(self, q, entry, data).await
            } else {
                Err(unsupported(Backend::kind(self), Capability::Proclaim))
            }
        }
    }

    /// Completes with the payload of `entry` once it differs from `seen` (at once if it
    /// already does), or with `None` once the entry is gone. Arms its watch before it
    /// reads, so no change is missed.
    ///
    /// Part of [`Capability::Revocation`] and of [`Capability::Proclaim`]. The default
    /// fails with [`Error::Unsupported`].
    fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        let _ = (q, entry, seen);
        async move { Err(unsupported(Backend::kind(self), Capability::Revocation)) }
    }

    /// The server that serves queue `q` when that depends on the lock (a Redis Cluster:
    /// the master of the lock's slot, as `host:port (slot N)`), for status output;
    /// `None` (the default) where every lock is served alike (one server, an ensemble, a
    /// quorum). Read from what this client routes by, without a round trip: after a
    /// failover the client has not yet seen, it names the old server.
    fn serving_node(&self, q: &QueuePath) -> Option<String> {
        let _ = q;
        None
    }

    /// The queue `q` with every detail the backend can give (tokens, data, creation
    /// time), for status output. May cost more round trips than [`Backend::queue`].
    fn participants(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        Backend::queue(self, q)
    }

    /// Every queue whose path ([`QueuePath::relative`]) starts with `prefix` (a plain
    /// string prefix; `""` for all) and that has at least one entry, each with its
    /// entries in queue order; sorted by path. `prefix` has no leading `/`. Paths are as
    /// the caller names locks: without the backend's namespace, key prefix or chroot.
    ///
    /// Each queue is read as a whole, but the listing is not one atomic view across
    /// queues unless the backend says so: a queue may gain or lose its entries while the
    /// others are read. Its cost grows with what the backend must walk to find the queues
    /// (the znodes under the prefix, the keys under it, the whole keyspace for a Redis
    /// `SCAN`), not only with the queues found: meant for operators and status tools, not
    /// for a hot path.
    fn list_queues(&self, prefix: &str) -> impl Future<Output = Result<Vec<ListedQueue>>> + Send;

    /// Whether this client can take locks now: its session is live and its servers
    /// answer, checked with one cheap round trip that needs no permission on any lock
    /// (for a readiness probe). `Ok` when they do; otherwise the error an acquire would
    /// get ([`Error::Unreachable`], [`Error::LockLost`] for an ended session,
    /// [`Error::Closed`], a refusal).
    fn health(&self) -> impl Future<Output = Result<()>> + Send;

    /// Closes the session: every entry on it goes at once. Idempotent.
    fn close(&self) -> impl Future<Output = Result<()>> + Send;
}

/// [`Backend`] as an object-safe trait, for holding a backend chosen at run time as
/// `Arc<dyn DynBackend>` (the facade's `connect` does). Every method is the [`Backend`]
/// method of the same name, with the same contract, its future boxed.
///
/// Do not implement it: implement [`Backend`], and the blanket impl provides this one.
/// Code that uses a backend (the recipes) is generic over `B: DynBackend + ?Sized`, so it
/// runs both on a concrete backend and on `dyn DynBackend`. A concrete backend has both
/// traits, so a method call on it is ambiguous where both are in scope: import the one
/// you call through.
pub trait DynBackend: Send + Sync + 'static {
    /// [`Backend::kind`].
    fn kind(&self) -> &'static str;
    /// [`Backend::name_rules`].
    fn name_rules(&self) -> NameRules;
    /// [`Backend::session_timeout`].
    fn session_timeout(&self) -> Duration;
    /// [`Backend::hints`].
    fn hints(&self) -> Hints;
    /// [`Backend::supports`].
    fn supports(&self, capability: Capability) -> bool;
    /// [`Backend::enqueue`].
    fn enqueue<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        at: Position<'a>,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<Enqueued>>;
    /// [`Backend::enqueue_removing`].
    fn enqueue_removing<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        data: &'a [u8],
        gone_q: &'a QueuePath,
        gone: &'a Entry,
    ) -> BoxFuture<'a, Result<Entry>>;
    /// [`Backend::queue`].
    fn queue<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>>;
    /// [`Backend::queue_ahead`].
    fn queue_ahead<'a>(
        &'a self,
        q: &'a QueuePath,
        mine: &'a Entry,
    ) -> BoxFuture<'a, Result<Vec<Entry>>>;
    /// [`Backend::contains`].
    fn contains<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<bool>>;
    /// [`Backend::still_queued`].
    fn still_queued<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
    ) -> BoxFuture<'a, Result<bool>>;
    /// [`Backend::wait_gone`].
    fn wait_gone<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>>;
    /// [`Backend::wait_gone_detail`].
    fn wait_gone_detail<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
    ) -> BoxFuture<'a, Result<Gone>>;
    /// [`Backend::wait_gone_behind`].
    fn wait_gone_behind<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        mine: &'a Entry,
    ) -> BoxFuture<'a, Result<Woken>>;
    /// [`Backend::wait_changed`].
    fn wait_changed<'a>(&'a self, q: &'a QueuePath, seen: &'a [Entry])
        -> BoxFuture<'a, Result<()>>;
    /// [`Backend::remove`].
    fn remove<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>>;
    /// [`Backend::abandon`].
    fn abandon<'a>(&'a self, q: &'a QueuePath, ticket: &'a Ticket) -> BoxFuture<'a, Result<()>>;
    /// [`Backend::lost`].
    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error>;
    /// [`Backend::lost_now`].
    fn lost_now(&self, q: &QueuePath, entry: &Entry) -> Option<Error>;
    /// [`Backend::read_value`].
    fn read_value<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Option<Vec<u8>>>>;
    /// [`Backend::set_data`].
    fn set_data<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<()>>;
    /// [`Backend::proclaim`].
    fn proclaim<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<()>>;
    /// [`Backend::wait_data_changed`].
    fn wait_data_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        seen: &'a [u8],
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>>>;
    /// [`Backend::serving_node`].
    fn serving_node(&self, q: &QueuePath) -> Option<String>;
    /// [`Backend::participants`].
    fn participants<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>>;
    /// [`Backend::list_queues`].
    fn list_queues<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Vec<ListedQueue>>>;
    /// [`Backend::health`].
    fn health(&self) -> BoxFuture<'_, Result<()>>;
    /// [`Backend::close`].
    fn close(&self) -> BoxFuture<'_, Result<()>>;
}

impl<B: Backend> DynBackend for B {
    fn kind(&self) -> &'static str {
        Backend::kind(self)
    }
    fn name_rules(&self) -> NameRules {
        Backend::name_rules(self)
    }
    fn session_timeout(&self) -> Duration {
        Backend::session_timeout(self)
    }
    fn hints(&self) -> Hints {
        Backend::hints(self)
    }
    fn supports(&self, capability: Capability) -> bool {
        Backend::supports(self, capability)
    }
    fn enqueue<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        at: Position<'a>,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<Enqueued>> {
        Box::pin(Backend::enqueue(self, q, ticket, kind, at, data))
    }
    fn enqueue_removing<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        data: &'a [u8],
        gone_q: &'a QueuePath,
        gone: &'a Entry,
    ) -> BoxFuture<'a, Result<Entry>> {
        Box::pin(Backend::enqueue_removing(
            self, q, ticket, kind, data, gone_q, gone,
        ))
    }
    fn queue<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(Backend::queue(self, q))
    }
    fn queue_ahead<'a>(
        &'a self,
        q: &'a QueuePath,
        mine: &'a Entry,
    ) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(Backend::queue_ahead(self, q, mine))
    }
    fn contains<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<bool>> {
        Box::pin(Backend::contains(self, q, entry))
    }
    fn still_queued<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
    ) -> BoxFuture<'a, Result<bool>> {
        Box::pin(Backend::still_queued(self, q, entry))
    }
    fn wait_gone<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        Box::pin(Backend::wait_gone(self, q, entry))
    }
    fn wait_gone_detail<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
    ) -> BoxFuture<'a, Result<Gone>> {
        Box::pin(Backend::wait_gone_detail(self, q, entry))
    }
    fn wait_gone_behind<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        mine: &'a Entry,
    ) -> BoxFuture<'a, Result<Woken>> {
        Box::pin(Backend::wait_gone_behind(self, q, entry, mine))
    }
    fn wait_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        seen: &'a [Entry],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(Backend::wait_changed(self, q, seen))
    }
    fn remove<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        Box::pin(Backend::remove(self, q, entry))
    }
    fn abandon<'a>(&'a self, q: &'a QueuePath, ticket: &'a Ticket) -> BoxFuture<'a, Result<()>> {
        Box::pin(Backend::abandon(self, q, ticket))
    }
    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        Backend::lost(self, q, entry)
    }
    fn lost_now(&self, q: &QueuePath, entry: &Entry) -> Option<Error> {
        Backend::lost_now(self, q, entry)
    }
    fn read_value<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Option<Vec<u8>>>> {
        Box::pin(Backend::read_value(self, q))
    }
    fn set_data<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(Backend::set_data(self, q, entry, data))
    }
    fn proclaim<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(Backend::proclaim(self, q, entry, data))
    }
    fn wait_data_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        seen: &'a [u8],
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>>> {
        Box::pin(Backend::wait_data_changed(self, q, entry, seen))
    }
    fn serving_node(&self, q: &QueuePath) -> Option<String> {
        Backend::serving_node(self, q)
    }
    fn participants<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(Backend::participants(self, q))
    }
    fn list_queues<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<Vec<ListedQueue>>> {
        Box::pin(Backend::list_queues(self, prefix))
    }
    fn health(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Backend::health(self))
    }
    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(Backend::close(self))
    }
}

/// The error of a trait method a backend does not implement.
fn unsupported(backend: &'static str, capability: Capability) -> Error {
    Error::Unsupported {
        backend,
        capability,
    }
}

#[cfg(test)]
mod margin_tests {
    use super::*;

    #[test]
    fn the_lost_margin_is_a_tenth_of_the_session_and_at_least_100_ms() {
        assert_eq!(
            lost_margin(Duration::from_secs(2)),
            Duration::from_millis(200)
        );
        assert_eq!(lost_margin(Duration::from_secs(30)), Duration::from_secs(3));
        assert_eq!(
            lost_margin(Duration::from_millis(300)),
            Duration::from_millis(100)
        );
    }
}

#[cfg(test)]
mod attempt_tests {
    use super::*;

    fn attempt(connect: Duration) -> Duration {
        SessionOptions::default()
            .with_connect_timeout(connect)
            .attempt_timeout()
    }

    /// A third of the connect timeout, at least a second, never more than the whole.
    #[test]
    fn an_attempt_gets_a_third_of_the_connect_timeout_and_at_least_a_second() {
        assert_eq!(attempt(Duration::from_secs(6)), Duration::from_secs(2));
        assert_eq!(attempt(Duration::from_secs(2)), Duration::from_secs(1));
        assert_eq!(
            attempt(Duration::from_millis(500)),
            Duration::from_millis(500)
        );
        for ms in [1, 10, 999, 1000, 2999, 3000, 5000, 60_000] {
            let whole = Duration::from_millis(ms);
            let a = attempt(whole);
            assert!(a <= whole && a >= whole / 3, "{whole:?}: {a:?}");
        }
    }
}
