//! [`RedisBackend`]: the `dlock_core::Backend` implementation over one master or, in
//! Redlock mode, over N independent masters.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Backend, Capability, Enqueued, Entry, EntryKind, Error, Gone, ListedQueue, NameRules, Position,
    QueuePath, Result, Ticket, Woken,
};
use fred::prelude::Value;
use futures::future::{join_all, BoxFuture};
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::task::AbortHandle;
use tracing::{info, warn, Instrument};

use crate::keys::{self, QueueKeys};
use crate::node::Node;
use crate::pubsub::Chan;
use crate::scripts::Scripts;
use crate::watchdog::{Fate, Live};

/// How many queues a listing reads at once.
const LIST_PARALLEL: usize = 16;

/// Which servers the backend talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    Single,
    Redlock,
}

/// Counters for tests and status output.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) messages: AtomicU64,
    pub(crate) subscribes: AtomicU64,
    pub(crate) renewals: AtomicU64,
    pub(crate) lost: AtomicU64,
    timer_rechecks: AtomicU64,
    pub(crate) missed_wakeups: AtomicU64,
    pub(crate) solo_mismatches: AtomicU64,
    pub(crate) unreplicated: AtomicU64,
}

/// A snapshot of a backend's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct Stats {
    /// Pub/sub messages received for a channel some waiter listened on.
    pub messages: u64,
    /// SUBSCRIBEs sent (one per channel while someone waits on it, per master).
    pub subscribes: u64,
    /// Entry renewals the watchdog sent (per entry and master).
    pub renewals: u64,
    /// Entries whose `lost()` fired with [`Error::LockLost`].
    pub lost: u64,
    /// Entries live (renewed by the watchdog) right now.
    pub live: usize,
    /// Times a waiter (`wait_gone`, `wait_changed`) was woken by its re-check timer
    /// rather than by a message or a reconnect. A long hold makes these legitimately.
    pub timer_rechecks: u64,
    /// Timer re-checks that found the watched entry gone (or the queue changed): a
    /// wake-up whose message never reached the waiter. With a healthy connection every
    /// removal is published, so this stays 0 (but for entries of dead clients, whose
    /// expiry nobody publishes); anything else is a missed wake-up that cost the waiter up
    /// to a whole re-check period.
    pub missed_wakeups: u64,
    /// Through Sentinel: times a `+switch-master` announcement for the service made the
    /// clients reconnect to a new primary (0 otherwise).
    pub primary_switches: u64,
    /// On a Redis Cluster: scripts retried after a `TRYAGAIN` (their slot was being
    /// migrated, its keys split between two nodes); 0 elsewhere.
    pub slot_retries: u64,
    /// Uncontended releases (`RELEASE_SOLO`) that sent the entry's whole value and found
    /// a different one under the holder's name, removed by the name instead. No dlock
    /// client changes a solo entry's value, so this stays 0 unless something else wrote
    /// the lock's key; a release that finds it is correct, only slower.
    pub solo_mismatches: u64,
    /// With [`dlock_core::SessionOptions::replicas`]: grants, renewal rounds and
    /// proclaims that did not count because fewer replicas acknowledged them in time
    /// (or the connection changed before they were asked). 0 without it.
    pub unreplicated: u64,
}

/// A hash map of this client's own registries (keyed by queue keys, entry names,
/// channels): a fast hash with a random seed per map is enough there, where SipHash cost
/// about 3 % of the client's instructions per uncontended lock.
pub(crate) type FastMap<K, V> = HashMap<K, V, foldhash::fast::RandomState>;

pub(crate) struct Shared {
    pub(crate) mode: Mode,
    /// In front of every key and channel name (`?prefix=`; empty for none).
    pub(crate) prefix: String,
    pub(crate) nodes: Vec<Node>,
    pub(crate) majority: usize,
    pub(crate) lease: Duration,
    /// The lease in ms, as every enqueue and renewal sends it.
    pub(crate) lease_ms: Value,
    /// `wait_changed`'s re-check period (`wait_gone` times its own: see `gone_recheck`).
    pub(crate) recheck: Duration,
    /// Clock drift allowance (Redlock: 1% of the lease plus 2 ms).
    pub(crate) drift: Duration,
    /// [`dlock_core::SessionOptions::replicas`]: how many replicas must acknowledge a
    /// grant or a renewal before it counts (one master only; 0: none).
    pub(crate) replicas: u32,
    /// How long a grant or a renewal round waits for them ([`Shared::replicated`]).
    pub(crate) replica_wait: Duration,
    pub(crate) scripts: Scripts,
    /// Live entries by (queue key, entry name). [`FastMap`]s: looked up several times
    /// per lock.
    pub(crate) live: Mutex<FastMap<(String, String), Live>>,
    pub(crate) chans: Mutex<FastMap<String, Chan>>,
    /// Channels whose last waiter left, to unsubscribe in the next batch.
    pub(crate) idle_chans: Mutex<Vec<String>>,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so that a late UNSUBSCRIBE never undoes a newer
    /// SUBSCRIBE of the same channel.
    pub(crate) sub_ops: tokio::sync::Mutex<()>,
    /// Highest sequence seen per queue (Redlock proposals).
    pub(crate) seq_hint: crate::redlock::SeqHints,
    /// Queue keys this client last found with another entry, and when: an enqueue on
    /// one of them skips the uncontended fast path for [`CONTENDED_FOR`] (the attempt
    /// would fail and cost a round trip and a script run). Advice only: either path is
    /// correct on any queue.
    pub(crate) contended: Mutex<FastMap<String, std::time::Instant>>,
    /// Wakes the watchdog for an immediate round (after a reconnect).
    pub(crate) wake: Arc<Notify>,
    /// Tells the watchdog that an entry with an early deadline was registered (a reply
    /// that arrived late): it looks at the deadlines again instead of sleeping on the
    /// earliest one it knew of.
    pub(crate) deadlines: Arc<Notify>,
    pub(crate) closed: AtomicBool,
    /// Held (shared) by every `remove` and `abandon` from its check that the backend is
    /// open to its last request; `close` takes it exclusively before it collects the
    /// live entries. An entry a removal took out of `live` is then either removed by
    /// that removal, which `close` waits for, or still in `live` for `close` to remove:
    /// never left to expire after a lease (an interrupted `dlock exec` closing at once).
    pub(crate) removing: tokio::sync::RwLock<()>,
    pub(crate) tasks: Mutex<Vec<AbortHandle>>,
    pub(crate) counters: Counters,
}

/// The Redis backend: fair queues of session-bound entries in Lua, kept alive by a
/// watchdog, with pub/sub wake-ups. See the crate docs for the data model.
///
/// Cheap to share: hand out the `Arc` returned by [`RedisBackend::connect`]. Dropping the
/// last `Arc` stops the watchdog at once (so no entry is renewed after that) and, inside a
/// tokio runtime, removes this client's entries in the background as
/// [`Backend::close`] does.
///
/// [`Backend::lost`] completes with [`Error::LockLost`] when the watchdog gives the entry
/// up (gone on the server, or not renewed for a whole lease), with [`Error::NotHeld`] once
/// this client removed or abandoned it, with [`Error::Closed`] after close or drop, and at
/// once with [`Error::LockLost`] for an entry this client does not keep alive.
pub struct RedisBackend {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for RedisBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisBackend")
            .field("kind", &self.kind())
            .field("masters", &self.shared.nodes)
            .field("lease", &self.shared.lease)
            .finish()
    }
}

impl RedisBackend {
    /// `wait_gone_detail`, and the entry the waking message named behind the removed
    /// head (`removed head <name>`; one master only).
    async fn gone_with_next(&self, q: &QueuePath, entry: &Entry) -> Result<(Gone, Option<String>)> {
        let span = tracing::debug_span!("wait_gone", lock = %q, entry = %entry.name);
        async move {
            let s = &self.shared;
            s.check_open()?;
            let keys = QueueKeys::new(&self.shared.prefix, q);
            let key = keys.entry(&entry.name);
            // Subscribe first, then check on the same connection: a removal between
            // the two is seen by the check, one after it by the message.
            let listener = s.listen(&keys.gone_channel(&entry.name), false).await;
            let mut by_timer = false;
            loop {
                let notified = listener.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                s.check_open()?;
                // On one master the message is the answer: a round trip saved per
                // handoff. (Redlock: one master's message does not mean a majority
                // removed it, so it re-checks.)
                if s.mode == Mode::Single && listener.heard.load(Ordering::SeqCst) {
                    // Unless the primary that sent it may be the one a failover is
                    // replacing: then the waiter lists the queue (`Vanished`: not a
                    // grant from its view; the listing is a script, which waits for the
                    // failover to be followed). The removal the message tells of may
                    // not be on the primary that follows.
                    return Ok(if s.nodes[0].fenced() {
                        (Gone::Vanished, None)
                    } else if listener.head.load(Ordering::SeqCst) {
                        (Gone::Head, listener.next.lock().clone())
                    } else {
                        (Gone::Unknown, None)
                    });
                }
                let results = s
                    .gather(s.nodes.iter().map(|n| n.pttl_after_subscribe(&key)))
                    .await;
                let mut ttls = s.quorum(results)?;
                if s.mode == Mode::Single && ttls.iter().all(Option::is_none) {
                    // No entry key: the entry may be the lock's solo key, whose release
                    // publishes nothing; moved into the queue layout, its removal is
                    // published. The check above was answered after the SUBSCRIBE on
                    // its connection, so the move, sent after that answer, is in turn
                    // after the subscription: a removal the move does not see reaches
                    // the listener.
                    ttls = vec![s.unsolo(&keys, &entry.name).await?];
                }
                let Some(longest) = ttls.iter().flatten().max().copied() else {
                    s.count_recheck(by_timer);
                    // No removal message: the key expired, or the server lost it
                    // with others (a restart without persistence, a failover to a
                    // replica that never had it), the waiter's own entry perhaps
                    // too, so the waiter must list again before it holds.
                    return Ok(if listener.heard.load(Ordering::SeqCst) {
                        (Gone::Unknown, None)
                    } else {
                        (Gone::Vanished, None)
                    });
                };
                // An expiry nobody publishes (a dead client's entry) is caught when the
                // key's TTL runs out; anything else (a message lost in a way no
                // reconnect wake-up covers) within lease/3. A periodic re-check of
                // every waiter would cost O(waiters) server calls per second.
                by_timer = s.wait_notified_for(notified, s.gone_recheck(longest)).await;
                if by_timer {
                    s.counters.timer_rechecks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        .instrument(span)
        .await
    }

    /// The lease every entry gets (the session timeout).
    pub fn lease(&self) -> Duration {
        self.shared.lease
    }

    /// The addresses of the masters, in the order given; through Sentinel, one label
    /// `sentinel <sentinels>/<service>` (the primary itself may change at any time).
    pub fn masters(&self) -> Vec<String> {
        self.shared.nodes.iter().map(|n| n.addr.clone()).collect()
    }

    /// A snapshot of this client's counters (pub/sub messages, subscriptions, renewals).
    pub fn stats(&self) -> Stats {
        let c = &self.shared.counters;
        Stats {
            messages: c.messages.load(Ordering::Relaxed),
            subscribes: c.subscribes.load(Ordering::Relaxed),
            renewals: c.renewals.load(Ordering::Relaxed),
            lost: c.lost.load(Ordering::Relaxed),
            live: self.shared.live.lock().len(),
            timer_rechecks: c.timer_rechecks.load(Ordering::Relaxed),
            missed_wakeups: c.missed_wakeups.load(Ordering::Relaxed),
            solo_mismatches: c.solo_mismatches.load(Ordering::Relaxed),
            unreplicated: c.unreplicated.load(Ordering::Relaxed),
            primary_switches: self
                .shared
                .nodes
                .iter()
                .map(|n| n.switches.load(Ordering::Relaxed))
                .sum(),
            slot_retries: self
                .shared
                .nodes
                .iter()
                .map(|n| n.tryagains.load(Ordering::Relaxed))
                .sum(),
        }
    }

    /// Stops the watchdog without removing anything, as if the process had died: every
    /// entry of this client expires one lease later. For fault-injection tests and
    /// demos; the backend is closed afterwards.
    #[doc(hidden)]
    pub fn simulate_crash(&self) {
        self.shared.closed.store(true, Ordering::SeqCst);
        self.shared.abort_tasks();
        let live: Vec<Live> = self.shared.live.lock().drain().map(|(_, l)| l).collect();
        for l in live {
            let _ = l.fate.send(Some(Fate::Closed));
        }
        for n in &self.shared.nodes {
            n.abort_tasks();
        }
    }
}

impl Drop for RedisBackend {
    fn drop(&mut self) {
        // Stop renewing first, synchronously: a renewal must never outlive its owner.
        self.shared.abort_tasks();
        if self.shared.closed.load(Ordering::SeqCst) {
            return;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(h) => {
                let shared = self.shared.clone();
                h.spawn(async move { shared.close().await });
            }
            Err(_) => {
                // Without a runtime nothing can be sent: the entries expire after the lease.
                for n in &self.shared.nodes {
                    n.abort_tasks();
                }
            }
        }
    }
}

impl Shared {
    pub(crate) fn kind(&self) -> &'static str {
        match self.mode {
            Mode::Single if self.nodes.iter().any(|n| n.sharded) => "redis-cluster",
            Mode::Single => "redis",
            Mode::Redlock => "redlock",
        }
    }

    pub(crate) fn check_open(&self) -> Result<()> {
        if self.closed.load(Ordering::SeqCst) {
            Err(Error::Closed)
        } else {
            Ok(())
        }
    }

    /// The connection the writes about to be sent go over, when
    /// [`Shared::replicated`] will be asked about them (`None` otherwise: nothing to
    /// look up on the hot path).
    pub(crate) fn replication_mark(&self) -> Option<crate::node::Mark> {
        (self.replicas > 0).then(|| self.nodes[0].mark())
    }

    /// With [`dlock_core::SessionOptions::replicas`]: `Ok` once that many replicas
    /// acknowledged every write made since `mark` ([`Shared::replication_mark`]),
    /// within [`Shared::replica_wait`] ([`crate::node::Node::replicated`]). Always `Ok`
    /// without it. Only one master takes the setting (see `assemble`).
    ///
    /// # Errors
    /// [`Error::Unreachable`] when they did not: the writes must not count.
    pub(crate) async fn replicated(
        &self,
        what: &str,
        mark: Option<crate::node::Mark>,
    ) -> Result<()> {
        if self.replicas == 0 {
            return Ok(());
        }
        let Some(mark) = mark else {
            // Every caller takes a mark when replicas are asked; without one there is
            // nothing to tell the connection by, so nothing counts.
            self.counters.unreplicated.fetch_add(1, Ordering::Relaxed);
            return Err(Error::Unreachable(format!(
                "{what}: no connection was marked before the write; it does not count"
            )));
        };
        let r = self.nodes[0]
            .replicated(what, mark, self.replicas, self.replica_wait)
            .await;
        if r.is_err() {
            self.counters.unreplicated.fetch_add(1, Ordering::Relaxed);
        }
        r
    }

    fn abort_tasks(&self) {
        for t in self.tasks.lock().drain(..) {
            t.abort();
        }
    }

    /// Removes every live entry and stops everything. Idempotent.
    async fn close(self: &Arc<Self>) {
        if self.closed.swap(true, Ordering::SeqCst) {
            return;
        }
        self.abort_tasks();
        // Removals under way finish first: the entries they took out of `live` go with
        // them (see `removing`).
        let _quiet = self.removing.write().await;
        let live: Vec<((String, String), Live)> = self.live.lock().drain().collect();
        let mut groups: HashMap<String, (Arc<QueueKeys>, Vec<String>)> = HashMap::new();
        for ((q, name), l) in live {
            let _ = l.fate.send(Some(Fate::Closed));
            groups
                .entry(q)
                .or_insert_with(|| (l.keys.clone(), Vec::new()))
                .1
                .push(name);
        }
        let removals = groups
            .values()
            .map(|(keys, names)| self.remove_names(keys, names));
        for r in join_all(removals).await {
            if let Err(e) = r {
                warn!(error = %e, "close: some entries could not be removed; they expire after the lease");
            }
        }
        self.wake_all_waiters();
        join_all(self.nodes.iter().map(|n| n.shutdown())).await;
        info!(kind = self.kind(), "redis backend closed");
    }
}

impl Shared {
    /// One entry's token and data, or `None` if its key is gone (one master).
    async fn read_entry(
        &self,
        keys: &QueueKeys,
        name: &str,
    ) -> Result<Option<crate::reply::EntryValue>> {
        let args = vec![Value::from(keys.entry_prefix()), Value::from(name)];
        let results = self
            .eval_all("reading an entry", &self.scripts.read, keys, args)
            .await;
        let reply = self
            .quorum(results)?
            .into_iter()
            .next()
            .ok_or_else(|| Error::backend("reading an entry", "no master answered the read"))?;
        crate::reply::entry_value(reply)
    }
}

impl Backend for RedisBackend {
    fn kind(&self) -> &'static str {
        self.shared.kind()
    }

    fn name_rules(&self) -> NameRules {
        crate::NAME_RULES
    }

    fn session_timeout(&self) -> Duration {
        self.shared.lease
    }

    /// [`Capability::Proclaim`] on one master (alone, a Sentinel group's primary, a
    /// Redis Cluster slot's master): there one script both checks that the entry still
    /// leads and writes its value. Not on Redlock: see [`RedisBackend::proclaim`].
    fn supports(&self, capability: Capability) -> bool {
        capability == Capability::Proclaim && self.shared.mode == Mode::Single
    }

    fn enqueue(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> impl Future<Output = Result<Enqueued>> + Send {
        let span = tracing::debug_span!("enqueue", lock = %q, %kind, ticket = ticket.as_str());
        self.enqueue_inner(q, ticket, kind, at, data)
            .instrument(span)
    }

    async fn queue(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        self.shared.check_open()?;
        self.shared
            .list(&QueueKeys::new(&self.shared.prefix, q), false, None)
            .await
    }

    async fn queue_ahead(&self, q: &QueuePath, mine: &Entry) -> Result<Vec<Entry>> {
        self.shared.check_open()?;
        // Every entry ahead of `mine` has a sequence up to its own (a downgrade's
        // read entry shares its writer's): one ZRANGEBYSCORE, O(entries ahead).
        self.shared
            .list(
                &QueueKeys::new(&self.shared.prefix, q),
                false,
                Some(mine.seq),
            )
            .await
    }

    /// The entries up to `entry`'s sequence (one `ZRANGEBYSCORE`), searched for its name.
    /// On one master the token is compared too: it is the value the enqueue wrote into
    /// the entry, so any other value is another entry. On Redlock the entry counts only
    /// where a majority of the masters list it: one left on a minority (the others lost
    /// its keys to an expiry or a restart) holds nothing, since another contender can be
    /// granted by that majority. It is `false` only once too many masters miss it for a
    /// majority to be left, and a master slow to answer is waited for rather than
    /// counted as missing (an entry often sits on a bare majority, and one of those
    /// masters may be the slow one); when the masters that answered cannot tell, the
    /// answer is [`Error::Unreachable`]. Its token is not compared there: Redlock's is
    /// the highest of the masters that answered, which can differ between two reads.
    async fn contains(&self, q: &QueuePath, entry: &Entry) -> Result<bool> {
        let s = &self.shared;
        s.check_open()?;
        let keys = QueueKeys::new(&s.prefix, q);
        if s.mode == Mode::Single {
            let ahead = s.list(&keys, false, Some(entry.seq)).await?;
            return Ok(ahead
                .iter()
                .any(|e| e.name == entry.name && entry.token_matches(e.token)));
        }
        s.listed_by_majority(&keys, &entry.name, entry.seq).await
    }

    async fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> Result<()> {
        self.wait_gone_detail(q, entry).await.map(|_| ())
    }

    /// On one master, [`Gone::Head`] when the message that woke the waiter said the entry
    /// was removed as the head of its queue (the remove script checks it atomically).
    /// Redlock says [`Gone::Unknown`] after a message: one master's message does not
    /// speak for a majority, so its waiters list the queue as before. On either, an entry
    /// found missing with no removal message heard is [`Gone::Vanished`]: it expired, or
    /// the server lost it (with the waiter's own entry, perhaps), so the waiter lists
    /// the queue before it may hold.
    async fn wait_gone_detail(&self, q: &QueuePath, entry: &Entry) -> Result<Gone> {
        self.gone_with_next(q, entry).await.map(|(gone, _)| gone)
    }

    /// On one master, [`Woken::mine_queued`] when the message that woke the waiter named
    /// its entry as the one behind the removed head (`removed head <name>`: the remove
    /// script found that entry's key there when it removed the head). Redlock, whose one
    /// master's message does not speak for a majority, never says so.
    async fn wait_gone_behind(&self, q: &QueuePath, entry: &Entry, mine: &Entry) -> Result<Woken> {
        let (gone, next) = self.gone_with_next(q, entry).await?;
        Ok(Woken::new(
            gone,
            next.as_deref() == Some(mine.name.as_str()),
        ))
    }

    fn wait_changed(
        &self,
        q: &QueuePath,
        seen: &[Entry],
    ) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("wait_changed", lock = %q);
        async move {
            let s = &self.shared;
            s.check_open()?;
            let keys = QueueKeys::new(&self.shared.prefix, q);
            let listener = s.listen(keys.changed(), true).await;
            // A lock's only entry may be a solo one, whose release publishes nothing
            // (`RELEASE_SOLO`): moved into the queue layout once the listener is in
            // force (on every pass), its removal is published on the queue channel.
            let lone = match (seen, s.mode) {
                ([only], Mode::Single) => Some(only.name.as_str()),
                _ => None,
            };
            let seen: HashSet<&str> = seen.iter().map(|e| e.name.as_str()).collect();
            let mut by_timer = false;
            loop {
                let notified = listener.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                s.check_open()?;
                if let Some(name) = lone {
                    s.unsolo(&keys, name).await?;
                }
                let now = s.list(&keys, false, None).await?;
                let same =
                    now.len() == seen.len() && now.iter().all(|e| seen.contains(e.name.as_str()));
                if !same {
                    s.count_recheck(by_timer);
                    return Ok(());
                }
                by_timer = s.wait_notified(notified).await;
                if by_timer {
                    s.counters.timer_rechecks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        .instrument(span)
    }

    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        let span =
            tracing::debug_span!("remove", lock = %q, entry = %entry.name, token = ?entry.token);
        async move {
            let s = &self.shared;
            let _removing = s.removing.read().await;
            s.check_open()?;
            // Stop renewing before deleting: no renewal may follow a release. A live
            // entry's keys were built by its enqueue; reuse them.
            let filed = (
                QueueKeys::queue_key(&self.shared.prefix, q),
                entry.name.clone(),
            );
            let (keys, solo) = match s.settle_filed(&filed, Fate::Released) {
                Some(live) => live,
                None => (Arc::new(QueueKeys::new(&self.shared.prefix, q)), None),
            };
            if let Some(value) = solo {
                if s.release_solo(&keys, value).await? {
                    return Ok(());
                }
            }
            s.remove_names(&keys, std::slice::from_ref(&entry.name))
                .await
        }
        .instrument(span)
    }

    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("abandon", lock = %q, ticket = ticket.as_str());
        async move {
            let s = &self.shared;
            let _removing = s.removing.read().await;
            s.check_open()?;
            let keys = QueueKeys::new(&self.shared.prefix, q);
            let mine: Vec<String> = s
                .live
                .lock()
                .iter()
                .filter(|((qk, _), l)| {
                    *qk == keys.queue && l.ticket.as_deref() == Some(ticket.as_str())
                })
                .map(|((_, name), _)| name.clone())
                .collect();
            for name in mine {
                s.settle(&keys.queue, &name, Fate::Released);
            }
            let results = s.abandon_ticket(&keys, ticket).await;
            s.quorum(results).map(|_| ())
        }
        .instrument(span)
    }

    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        let key = (
            QueueKeys::queue_key(&self.shared.prefix, q),
            entry.name.clone(),
        );
        let rx = self
            .shared
            .live
            .lock()
            .get(&key)
            .map(|l| l.fate.subscribe());
        let (_, name) = key;
        let closed = self.shared.closed.load(Ordering::SeqCst);
        let lease = self.shared.lease;
        Box::pin(async move {
            let Some(mut rx) = rx else {
                return not_live(closed, &name);
            };
            // The sender gone without a fate (`Err`) is a release, as `None` is.
            let fate = rx
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|f| f.clone());
            if matches!(fate, None | Some(Fate::Released)) {
                // Released by this client: nothing renews the entry any more, so its
                // keys are gone from the server within one lease, removed or not. Until
                // then the signal says nothing (a release whose removal failed is
                // retried while it waits: see the recipes' background removal); then it
                // says the entry is gone, which ends those retries.
                tokio::time::sleep(lease).await;
                return Error::LockLost(format!(
                    "entry {name} was released by this client, and a lease has passed since"
                ));
            }
            fate_error(fate.as_ref(), &name)
        })
    }

    /// As the lost future made now answers at its first poll, from the registry of live
    /// entries, without a subscription or a boxed future (the recipes ask it at every
    /// grant, re-entry and release, and for `is_lost` and `verify`); and an entry past
    /// its renewal deadline is lost here even before the watchdog has run to say so.
    fn lost_now(&self, q: &QueuePath, entry: &Entry) -> Option<Error> {
        let key = (
            QueueKeys::queue_key(&self.shared.prefix, q),
            entry.name.clone(),
        );
        let fate = match self.shared.live.lock().get_mut(&key) {
            None => None,
            Some(l) => {
                let fate = l.fate.borrow().clone();
                match fate {
                    Some(f) => Some(f),
                    // Past its deadline, though the watchdog has not run to say so.
                    None if self.shared.overdue(l) => {
                        return Some(Error::LockLost(self.shared.overdue_reason()))
                    }
                    None => return None,
                }
            }
        };
        let closed = self.shared.closed.load(Ordering::SeqCst);
        Some(match fate {
            None => not_live(closed, &entry.name),
            Some(f) => fate_error(Some(&f), &entry.name),
        })
    }

    /// One script on the entry's master writes `data` as the entry's value only if the
    /// entry is still the one created (its key exists, queued, with the token its
    /// enqueue wrote) and it leads its queue (no live entry ahead of it), keeping its
    /// lease; it publishes the change on the entry's data channel, which wakes
    /// [`Backend::wait_data_changed`]. Otherwise it writes nothing and this returns
    /// [`Error::LockLost`]. A retry after a lost reply writes the same value under the
    /// same guard.
    ///
    /// With [`dlock_core::SessionOptions::replicas`], the value counts only once that
    /// many replicas have it (`WAIT`, as a grant): otherwise [`Error::Unreachable`], and
    /// the value, written on the primary, may be lost with it in a failover (readers
    /// would then see the leader's previous value).
    ///
    /// Stricter than the trait asks: an entry that is queued but does not lead is
    /// refused too, so a deposed leader's proclaim writes nothing even while its entry
    /// is still queued.
    ///
    /// Redlock refuses with [`Error::Unsupported`] before writing anything. The
    /// masters would run the guarded write independently, and a write that reaches
    /// only some of them (a master down or slow, a reply lost) leaves them holding
    /// different values for one entry with nothing to order them: a reader's majority
    /// could show the old value, the new one, or a mix from one read to the next, and
    /// the leader could not tell a failed proclaim from one a later read shows. Making
    /// it sound needs a version per value and reads that take only what a majority
    /// agrees on, which the listing does not do.
    fn proclaim(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("proclaim", lock = %q, entry = %entry.name);
        async move {
            let s = &self.shared;
            if s.mode != Mode::Single {
                return Err(Error::Unsupported {
                    backend: s.kind(),
                    capability: Capability::Proclaim,
                });
            }
            s.check_open()?;
            let keys = QueueKeys::new(&s.prefix, q);
            let mut args = Shared::q_args(&keys);
            args.extend([
                Value::from(entry.name.as_str()),
                Value::from(entry.token.map(|t| t.get().to_string()).unwrap_or_default()),
                Value::from(data),
                Value::from(keys.data_prefix()),
            ]);
            let mark = s.replication_mark();
            let results = s
                .eval_all("proclaiming a value", &s.scripts.proclaim, &keys, args)
                .await;
            let reply = s.quorum(results)?.into_iter().next().ok_or_else(|| {
                Error::backend("proclaiming a value", "no master answered the proclaim")
            })?;
            match crate::reply::proclaim(reply)? {
                // With replicas asked, the value counts once they have it: a replica
                // promoted without it would show readers the leader's older value.
                crate::reply::Proclaim::Done => s.replicated("proclaiming a value", mark).await,
                crate::reply::Proclaim::Gone => Err(Error::LockLost(format!(
                    "{q}: entry {} is gone; nothing was written",
                    entry.name
                ))),
                crate::reply::Proclaim::Behind { first } => Err(Error::LockLost(format!(
                    "{q}: entry {} no longer leads ({first} is ahead of it); nothing was written",
                    entry.name
                ))),
            }
        }
        .instrument(span)
    }

    /// Listens on the entry's data channel (a proclaim publishes there) and its gone
    /// channel, then reads the entry, and reads it again on each message, reconnect or
    /// re-check timer: the value once it differs from `seen`, `None` once the entry is
    /// gone (or another entry has its name). One master only, as
    /// [`RedisBackend::proclaim`]; Redlock refuses with [`Error::Unsupported`].
    fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        let span = tracing::debug_span!("wait_data_changed", lock = %q, entry = %entry.name);
        async move {
            let s = &self.shared;
            if s.mode != Mode::Single {
                return Err(Error::Unsupported {
                    backend: s.kind(),
                    capability: Capability::Revocation,
                });
            }
            s.check_open()?;
            let keys = QueueKeys::new(&s.prefix, q);
            // Subscribed (confirmed) before the first read, which runs on the command
            // connection: a change before the read is in it, one after it is published
            // to a live subscription.
            let changed = s.listen(&keys.data_channel(&entry.name), true).await;
            let gone = s.listen(&keys.gone_channel(&entry.name), true).await;
            let mut by_timer = false;
            loop {
                let on_change = changed.notify.notified();
                let on_gone = gone.notify.notified();
                tokio::pin!(on_change, on_gone);
                on_change.as_mut().enable();
                on_gone.as_mut().enable();
                s.check_open()?;
                // A solo entry's release publishes nothing (`RELEASE_SOLO`): moved into
                // the queue layout once both listeners are in force (on every pass), its
                // removal is. An election candidate is never solo (`try_solo`), so a
                // leader's observer pays nothing for this.
                if entry.kind != EntryKind::Candidate {
                    s.unsolo(&keys, &entry.name).await?;
                }
                let now = s.read_entry(&keys, &entry.name).await?;
                let verdict = match now {
                    None => Some(None),
                    Some((token, _)) if entry.token.is_some_and(|t| Some(t.get()) != token) => {
                        Some(None)
                    }
                    Some((_, data)) if data != seen => Some(Some(data)),
                    Some(_) => None,
                };
                if let Some(v) = verdict {
                    s.count_recheck(by_timer);
                    return Ok(v);
                }
                by_timer = tokio::select! {
                    _ = &mut on_change => false,
                    _ = &mut on_gone => false,
                    _ = tokio::time::sleep(s.recheck) => true,
                };
                if by_timer {
                    s.counters.timer_rechecks.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        .instrument(span)
    }

    /// On a Redis Cluster, the master of the lock's slot in the command client's slot
    /// map (what its commands are routed by), `host:port (slot N)`; `None` otherwise.
    fn serving_node(&self, q: &QueuePath) -> Option<String> {
        let node = self.shared.nodes.first().filter(|n| n.sharded)?;
        node.serving(&QueueKeys::queue_key(&self.shared.prefix, q))
    }

    async fn participants(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        self.shared.check_open()?;
        self.shared
            .list(&QueueKeys::new(&self.shared.prefix, q), true, None)
            .await
    }

    /// `SCAN MATCH <prefix>dlock:{<name prefix>*}:q*` on every master (a majority must
    /// answer; Sentinel: the primary), then one listing of each queue key found in any of
    /// them (the same listing as [`Backend::queue`]: on Redlock a majority's merged view).
    /// `SCAN` walks the whole keyspace of each master whatever the prefix, in steps
    /// between other clients' commands; a queue created or emptied during the walk may
    /// be missed or found empty.
    async fn list_queues(&self, prefix: &str) -> Result<Vec<ListedQueue>> {
        use futures::{StreamExt, TryStreamExt};
        self.shared.check_open()?;
        let rp = self.shared.prefix.as_str();
        let pattern = keys::queue_scan_pattern(rp, prefix);
        let scans = self
            .shared
            .gather(self.shared.nodes.iter().map(|n| n.scan_keys(&pattern)))
            .await;
        let found: BTreeSet<String> = self.shared.quorum(scans)?.into_iter().flatten().collect();
        let queues: Vec<(String, QueueKeys)> = found
            .iter()
            .filter_map(|k| keys::parse_queue_key(rp, k))
            .map(|(lock, sub)| {
                let path = match sub {
                    Some(sub) => format!("{lock}/{sub}"),
                    None => lock.to_owned(),
                };
                (path, QueueKeys::of(rp, lock, sub))
            })
            .filter(|(path, _)| path.starts_with(prefix))
            .collect();
        let shared = &self.shared;
        let mut listed: Vec<ListedQueue> = futures::stream::iter(queues)
            .map(|(path, keys)| async move {
                let entries = shared.list(&keys, false, None).await?;
                Ok::<_, Error>(ListedQueue::new(path, entries))
            })
            .buffer_unordered(LIST_PARALLEL)
            .try_filter(|q| std::future::ready(!q.entries.is_empty()))
            .try_collect()
            .await?;
        listed.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(listed)
    }

    /// `PING` on every master: healthy when a majority (the one master) answers. The
    /// watchdog's own verdicts stay per entry.
    async fn health(&self) -> Result<()> {
        if self.shared.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        use fred::prelude::ClientLike as _;
        let pings = self.shared.nodes.iter().map(|n| async move {
            n.client
                .ping::<()>(None)
                .await
                .map_err(|e| n.map_err("health check", e))
        });
        let results = futures::future::join_all(pings).await;
        self.shared.quorum(results).map(|_| ())
    }

    async fn close(&self) -> Result<()> {
        self.shared.close().await;
        Ok(())
    }
}

/// A lost future's answer for an entry this client does not have among its live ones.
fn not_live(closed: bool, name: &str) -> Error {
    if closed {
        return Error::Closed;
    }
    Error::LockLost(format!(
        "entry {name} is not live on this client (removed, expired or never created)"
    ))
}

/// A lost future's answer once its entry's fate is known (`None`: its registration went
/// without one, which only a release does).
fn fate_error(fate: Option<&Fate>, name: &str) -> Error {
    match fate {
        Some(Fate::Lost(reason)) => Error::LockLost(reason.clone()),
        Some(Fate::Closed) => Error::Closed,
        Some(Fate::Released) | None => {
            Error::NotHeld(format!("entry {name} was released by this client"))
        }
    }
}
