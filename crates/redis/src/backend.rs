//! [`RedisBackend`]: the `dlock_core::Backend` implementation over one master or, in
//! Redlock mode, over N independent masters.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Backend, Enqueued, Entry, EntryKind, Error, Gone, ListedQueue, NameRules, Position, QueuePath,
    Result, Ticket,
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
}

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
    pub(crate) scripts: Scripts,
    pub(crate) live: Mutex<HashMap<(String, String), Live>>,
    pub(crate) chans: Mutex<HashMap<String, Chan>>,
    /// Channels whose last waiter left, to unsubscribe in the next batch.
    pub(crate) idle_chans: Mutex<Vec<String>>,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so that a late UNSUBSCRIBE never undoes a newer
    /// SUBSCRIBE of the same channel.
    pub(crate) sub_ops: tokio::sync::Mutex<()>,
    /// Highest sequence seen per queue (Redlock proposals).
    pub(crate) seq_hint: Mutex<HashMap<String, u64>>,
    /// Wakes the watchdog for an immediate round (after a reconnect).
    pub(crate) wake: Arc<Notify>,
    pub(crate) closed: AtomicBool,
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
    /// the entry, so any other value is another entry. Redlock's token is the highest of
    /// the masters that answered, which can differ between two reads of the same entry.
    async fn contains(&self, q: &QueuePath, entry: &Entry) -> Result<bool> {
        let ahead = self.queue_ahead(q, entry).await?;
        let exact = self.shared.mode == Mode::Single;
        Ok(ahead
            .iter()
            .any(|e| e.name == entry.name && (!exact || entry.token_matches(e.token))))
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
    fn wait_gone_detail(
        &self,
        q: &QueuePath,
        entry: &Entry,
    ) -> impl Future<Output = Result<Gone>> + Send {
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
                    return Ok(if listener.head.load(Ordering::SeqCst) {
                        Gone::Head
                    } else {
                        Gone::Unknown
                    });
                }
                let results = s
                    .gather(s.nodes.iter().map(|n| n.pttl_after_subscribe(&key)))
                    .await;
                let ttls = s.quorum(results)?;
                let Some(longest) = ttls.iter().flatten().max().copied() else {
                    s.count_recheck(by_timer);
                    // No removal message: the key expired, or the server lost it
                    // with others (a restart without persistence, a failover to a
                    // replica that never had it), the waiter's own entry perhaps
                    // too, so the waiter must list again before it holds.
                    return Ok(if listener.heard.load(Ordering::SeqCst) {
                        Gone::Unknown
                    } else {
                        Gone::Vanished
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
            let seen: HashSet<&str> = seen.iter().map(|e| e.name.as_str()).collect();
            // Confirmed: the listing below runs on the command connection.
            let listener = s.listen(&keys.changed, true).await;
            let mut by_timer = false;
            loop {
                let notified = listener.notify.notified();
                tokio::pin!(notified);
                notified.as_mut().enable();
                s.check_open()?;
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
            // Stop renewing before deleting: no renewal may follow a release. A live
            // entry's keys were built by its enqueue; reuse them.
            let keys = match s.settle(
                &QueueKeys::queue_key(&self.shared.prefix, q),
                &entry.name,
                Fate::Released,
            ) {
                Some(keys) => keys,
                None => Arc::new(QueueKeys::new(&self.shared.prefix, q)),
            };
            s.check_open()?;
            s.remove_names(&keys, std::slice::from_ref(&entry.name))
                .await
        }
        .instrument(span)
    }

    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("abandon", lock = %q, ticket = ticket.as_str());
        async move {
            let s = &self.shared;
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
            s.check_open()?;
            let mut args = Shared::q_args(&keys);
            args.push(Value::from(ticket.protected_prefix()));
            let results = s
                .eval_all("abandoning an entry", &s.scripts.abandon, &keys, args)
                .await;
            s.quorum(results).map(|_| ())
        }
        .instrument(span)
    }

    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        let name = entry.name.clone();
        let rx = self
            .shared
            .live
            .lock()
            .get(&(QueueKeys::queue_key(&self.shared.prefix, q), name.clone()))
            .map(|l| l.fate.subscribe());
        let closed = self.shared.closed.load(Ordering::SeqCst);
        Box::pin(async move {
            let Some(mut rx) = rx else {
                if closed {
                    return Error::Closed;
                }
                return Error::LockLost(format!(
                    "entry {name} is not live on this client (removed, expired or never created)"
                ));
            };
            let fate = rx.wait_for(Option::is_some).await.map(|f| f.clone());
            match fate {
                Ok(f) => match f {
                    Some(Fate::Lost(reason)) => Error::LockLost(reason),
                    Some(Fate::Closed) => Error::Closed,
                    Some(Fate::Released) | None => {
                        Error::NotHeld(format!("entry {name} was released by this client"))
                    }
                },
                Err(_) => Error::NotHeld(format!("entry {name} was released by this client")),
            }
        })
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
