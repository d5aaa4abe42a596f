//! [`RedisBackend`]: the `dlock_core::Backend` implementation over one master or, in
//! Redlock mode, over N independent masters.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use dlock_core::{
    Backend, Enqueued, Entry, EntryKind, Error, Gone, NameRules, Position, QueuePath, Result,
    SessionOptions, Ticket,
};
use fred::prelude::{EventInterface, Value};
use futures::future::{join_all, BoxFuture};
use parking_lot::Mutex;
use tokio::sync::{watch, Notify};
use tokio::task::AbortHandle;
use tokio::time::Instant;
use tracing::{debug, info, warn, Instrument};

use crate::keys::QueueKeys;
use crate::node::{Node, Tuning};
use crate::reply;
use crate::scripts::Scripts;

/// The lease when [`SessionOptions::session_timeout`] is not set: Redisson's watchdog
/// default.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The shortest lease accepted; below it the watchdog's lease/3 period is shorter than a
/// loaded machine's scheduling jitter.
pub const MIN_LEASE: Duration = Duration::from_millis(300);

/// At most this many Redlock sequence proposals per enqueue, before it gives up with an
/// error. Proposals are also bounded in time: no new one once a third of the lease has
/// passed (the entry must still be valid when a majority took it).
const REDLOCK_ATTEMPTS: usize = 64;

/// Longest random pause between two refused Redlock proposals. Contenders that proposed
/// the same sequence and split the masters would otherwise collide again in lockstep.
const REDLOCK_MAX_BACKOFF: Duration = Duration::from_millis(25);

/// Renewal scripts in flight at once per master in a watchdog round (over all queues).
const RENEW_IN_FLIGHT: usize = 64;

/// How long after an entry key's expiry its watcher re-checks it (server and client
/// clocks tick apart; a re-check that finds the key still there just waits again).
const GONE_MARGIN: Duration = Duration::from_millis(5);

/// How long a channel left without waiters stays subscribed, so that the channels of
/// many waits share one UNSUBSCRIBE. A listener that comes back meanwhile reuses it.
const UNSUBSCRIBE_BATCH: Duration = Duration::from_millis(20);

/// How long a Redlock call waits for the remaining masters once a majority answered.
const STRAGGLER_GRACE: Duration = Duration::from_millis(20);

/// Which servers the backend talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Single,
    Redlock,
}

/// Why a live entry stopped being live.
#[derive(Debug, Clone)]
enum Fate {
    Lost(String),
    Released,
    Closed,
}

/// An entry this client created and renews.
#[derive(Debug)]
struct Live {
    /// Shared: a renewal round groups entries by queue without copying the key names.
    keys: Arc<QueueKeys>,
    ticket: Option<String>,
    /// When the last renewal that reached a majority was *sent*: the server's expiry is
    /// later than this plus the lease, so a deadline computed from it is conservative.
    renewed_at: Instant,
    fate: watch::Sender<Option<Fate>>,
}

/// One pub/sub channel some waiters of this client listen on.
#[derive(Debug)]
struct Chan {
    waiters: usize,
    notify: Arc<Notify>,
    /// A message arrived on the channel (not just a reconnect wake-up). On a gone-channel
    /// that means the entry is gone: names are never reused, and only its removal or
    /// expiry is published there.
    heard: Arc<AtomicBool>,
    /// The message said the entry went as the head of its queue (`removed head`: see the
    /// remove script). Set before `heard`.
    head: Arc<AtomicBool>,
    ready: Arc<tokio::sync::OnceCell<()>>,
}

/// Counters for tests and status output.
#[derive(Debug, Default)]
struct Counters {
    messages: AtomicU64,
    subscribes: AtomicU64,
    renewals: AtomicU64,
    lost: AtomicU64,
    timer_rechecks: AtomicU64,
    missed_wakeups: AtomicU64,
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
}

struct Shared {
    mode: Mode,
    nodes: Vec<Node>,
    majority: usize,
    lease: Duration,
    /// The lease in ms, as every enqueue and renewal sends it.
    lease_ms: Value,
    /// `wait_changed`'s re-check period (`wait_gone` times its own: see `gone_recheck`).
    recheck: Duration,
    /// Clock drift allowance (Redlock: 1% of the lease plus 2 ms).
    drift: Duration,
    scripts: Scripts,
    live: Mutex<HashMap<(String, String), Live>>,
    chans: Mutex<HashMap<String, Chan>>,
    /// Channels whose last waiter left, to unsubscribe in the next batch.
    idle_chans: Mutex<Vec<String>>,
    /// Serialises SUBSCRIBE/UNSUBSCRIBE so that a late UNSUBSCRIBE never undoes a newer
    /// SUBSCRIBE of the same channel.
    sub_ops: tokio::sync::Mutex<()>,
    /// Highest sequence seen per queue (Redlock proposals).
    seq_hint: Mutex<HashMap<String, u64>>,
    /// Wakes the watchdog for an immediate round (after a reconnect).
    wake: Arc<Notify>,
    closed: AtomicBool,
    tasks: Mutex<Vec<AbortHandle>>,
    counters: Counters,
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
    shared: Arc<Shared>,
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
    /// Connects to one Redis master at `addr` (`host:port`).
    ///
    /// The lease of every entry is `opts.session_timeout` (default [`DEFAULT_LEASE`],
    /// at least [`MIN_LEASE`]); the watchdog renews it every lease/3.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a malformed address or a lease below [`MIN_LEASE`];
    /// [`Error::Unreachable`] if the server does not accept a connection within
    /// `opts.connect_timeout`.
    pub async fn connect(addr: &str, opts: SessionOptions) -> Result<Arc<RedisBackend>> {
        Self::connect_mode(Mode::Single, &[addr.to_owned()], None, opts).await
    }

    /// Connects to the primary of the Sentinel-monitored `service`, found through the
    /// Sentinels at `sentinels` (`host:port` each; the first that answers is asked).
    ///
    /// Behaves as [`RedisBackend::connect`] against that primary, and follows failovers:
    /// on every reconnection both the command and the subscriber connection ask the
    /// Sentinels again and check that the server they name answers `ROLE` with
    /// `master`, and every Sentinel's `+switch-master` announcement for `service`
    /// forces that reconnection at once (also when the old primary is still up), so after
    /// the Sentinels promote a replica the clients, the watchdog and the pub/sub
    /// wake-ups all move to it. The watchdog runs a round right after the
    /// reconnection: an entry the failover lost (Redis replicates asynchronously, so a
    /// write acknowledged just before the primary died may never have reached the
    /// replica) fires `lost()` then, and an entry that survived keeps being renewed.
    /// Fencing tokens stay monotonic across a failover as long as the servers' clocks do
    /// (see the crate docs).
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for an empty or repeated Sentinel list, a malformed address,
    /// an empty service name or a lease below [`MIN_LEASE`]; [`Error::Unreachable`] if no
    /// primary accepts a connection within `opts.connect_timeout` (Sentinels down, the
    /// service unknown to them, or a failover still under way).
    pub async fn connect_sentinel(
        sentinels: &[String],
        service: &str,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        if service.is_empty()
            || !service
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        {
            return Err(Error::InvalidUrl {
                url: format!("{}/{service}", sentinels.join(",")),
                reason:
                    "the Sentinel service name must be non-empty letters, digits, '-', '_' or '.'"
                        .into(),
            });
        }
        Self::connect_mode(Mode::Single, sentinels, Some(service), opts).await
    }

    /// Connects to N independent masters for Redlock (see the crate docs for what that
    /// does and does not guarantee). Succeeds once a majority is connected within
    /// `opts.connect_timeout`; the others keep reconnecting in the background.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for an empty list, a malformed or repeated address, or a lease
    /// below [`MIN_LEASE`]; [`Error::Unreachable`] if fewer than a majority connect in time.
    pub async fn connect_redlock(
        addrs: &[String],
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        Self::connect_mode(Mode::Redlock, addrs, None, opts).await
    }

    /// Connects from a URL: `redis://host:port` (one master),
    /// `redlock://h1:p1,h2:p2,...` (independent masters) or
    /// `redis+sentinel://s1:p1,s2:p2,.../service` (the primary of a Sentinel group).
    ///
    /// # Errors
    /// As [`RedisBackend::connect`], [`RedisBackend::connect_redlock`] and
    /// [`RedisBackend::connect_sentinel`]; a URL with another scheme, a path (other than
    /// the Sentinel service), or credentials is [`Error::InvalidUrl`].
    pub async fn connect_url(url: &str, opts: SessionOptions) -> Result<Arc<RedisBackend>> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: url.to_owned(),
            reason: reason.to_owned(),
        };
        let (scheme, rest) = url.split_once("://").ok_or_else(|| bad("missing scheme"))?;
        let rest = rest.strip_suffix('/').unwrap_or(rest);
        if scheme == "redis+sentinel" {
            let (hosts, service) = rest
                .split_once('/')
                .ok_or_else(|| bad("expected redis+sentinel://host:port,.../service-name"))?;
            if hosts.contains(['@', '?']) || service.contains(['/', '@', '?']) {
                return Err(bad(
                    "only a host:port list and a service name are supported (no credentials or query)",
                ));
            }
            let sentinels: Vec<String> = hosts.split(',').map(str::to_owned).collect();
            return Self::connect_sentinel(&sentinels, service, opts).await;
        }
        if rest.contains(['/', '@', '?']) {
            return Err(bad(
                "only host:port lists are supported (no path, credentials or query)",
            ));
        }
        match scheme {
            "redis" => Self::connect(rest, opts).await,
            "redlock" => {
                let addrs: Vec<String> = rest.split(',').map(str::to_owned).collect();
                Self::connect_redlock(&addrs, opts).await
            }
            _ => Err(bad("scheme must be redis, redlock or redis+sentinel")),
        }
    }

    /// `addrs` are the masters, or with `sentinel_service` the Sentinels of that service
    /// (one node: the primary they name).
    async fn connect_mode(
        mode: Mode,
        addrs: &[String],
        sentinel_service: Option<&str>,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        let lease = opts.session_timeout.unwrap_or(DEFAULT_LEASE);
        let what = match sentinel_service {
            Some(service) => format!("{}/{service}", addrs.join(",")),
            None => addrs.join(","),
        };
        if lease < MIN_LEASE {
            return Err(Error::InvalidUrl {
                url: what,
                reason: format!("session timeout {lease:?} is below the minimum {MIN_LEASE:?}"),
            });
        }
        if addrs.is_empty() {
            return Err(Error::InvalidUrl {
                url: what,
                reason: "no server given".into(),
            });
        }
        let distinct: HashSet<&String> = addrs.iter().collect();
        if distinct.len() != addrs.len() {
            return Err(Error::InvalidUrl {
                url: what,
                reason: "a server is listed twice".into(),
            });
        }
        for a in addrs {
            crate::node::check_addr(a)?;
        }
        let tuning = Tuning {
            connect_timeout: opts.connect_timeout,
            command_timeout: (lease / 2).clamp(Duration::from_secs(1), Duration::from_secs(5)),
        };
        let nodes = match sentinel_service {
            Some(service) => vec![Node::start_sentinel(addrs, service, tuning)?],
            None => addrs
                .iter()
                .map(|a| Node::start(a, tuning))
                .collect::<Result<Vec<_>>>()?,
        };
        let majority = nodes.len() / 2 + 1;
        let deadline = Instant::now() + opts.connect_timeout;
        let results = join_all(nodes.iter().map(|n| n.wait_connected(deadline))).await;
        let connected = results.iter().filter(|r| r.is_ok()).count();
        if connected < majority {
            for n in &nodes {
                n.shutdown().await;
            }
            let first = results.into_iter().find_map(|r| r.err());
            return Err(match (mode, first) {
                (Mode::Single, Some(e)) => e,
                _ => Error::Unreachable(format!(
                    "only {connected} of {} redis masters connected within {:?}; a majority ({majority}) is needed",
                    addrs.len(),
                    opts.connect_timeout
                )),
            });
        }
        for (n, r) in nodes.iter().zip(&results) {
            if let Err(e) = r {
                warn!(master = %n.addr, error = %e, "redlock master not connected yet; it keeps reconnecting");
            }
        }
        let shared = Arc::new(Shared {
            mode,
            majority,
            lease,
            lease_ms: Value::from(lease.as_millis().to_string()),
            recheck: (lease / 3).min(Duration::from_secs(1)),
            drift: lease / 100 + Duration::from_millis(2),
            scripts: Scripts::new(),
            live: Mutex::new(HashMap::new()),
            chans: Mutex::new(HashMap::new()),
            idle_chans: Mutex::new(Vec::new()),
            sub_ops: tokio::sync::Mutex::new(()),
            seq_hint: Mutex::new(HashMap::new()),
            wake: Arc::new(Notify::new()),
            closed: AtomicBool::new(false),
            tasks: Mutex::new(Vec::new()),
            counters: Counters::default(),
            nodes,
        });
        shared.start_tasks();
        info!(kind = shared.kind(), masters = %what, ?lease, "redis backend connected");
        Ok(Arc::new(RedisBackend { shared }))
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
            primary_switches: self
                .shared
                .nodes
                .iter()
                .map(|n| n.switches.load(Ordering::Relaxed))
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
    fn kind(&self) -> &'static str {
        match self.mode {
            Mode::Single => "redis",
            Mode::Redlock => "redlock",
        }
    }

    fn check_open(&self) -> Result<()> {
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

    /// Starts the watchdog, one pub/sub dispatcher per master, and the reconnect hooks.
    /// Every task holds a `Weak` or is aborted on drop/close, so none keeps the clients
    /// alive past their owner.
    fn start_tasks(self: &Arc<Self>) {
        let mut tasks = Vec::new();
        let weak = Arc::downgrade(self);
        tasks.push(tokio::spawn(watchdog(weak.clone())).abort_handle());
        for node in &self.nodes {
            let mut rx = node.sub.message_rx();
            let w = weak.clone();
            tasks.push(
                tokio::spawn(async move {
                    use tokio::sync::broadcast::error::RecvError;
                    loop {
                        let msg = rx.recv().await;
                        let Some(s) = w.upgrade() else { return };
                        match msg {
                            Ok(m) => s.dispatch(&m.channel, &m.value),
                            // Missed messages: let every waiter re-check.
                            Err(RecvError::Lagged(_)) => s.wake_all_waiters(),
                            Err(RecvError::Closed) => return,
                        }
                    }
                })
                .abort_handle(),
            );
            let (w1, w2) = (weak.clone(), weak.clone());
            for h in node.on_reconnect(
                move || {
                    if let Some(s) = w1.upgrade() {
                        s.wake.notify_one();
                    }
                },
                move || {
                    if let Some(s) = w2.upgrade() {
                        s.wake_all_waiters();
                    }
                },
            ) {
                tasks.push(h.abort_handle());
            }
        }
        self.tasks.lock().extend(tasks);
    }

    // ---- pub/sub -------------------------------------------------------------------

    fn dispatch(&self, channel: &str, payload: &Value) {
        let chan = self
            .chans
            .lock()
            .get(channel)
            .map(|c| (c.notify.clone(), c.heard.clone(), c.head.clone()));
        if let Some((n, heard, head)) = chan {
            self.counters.messages.fetch_add(1, Ordering::Relaxed);
            if payload.as_str().is_some_and(|p| p.ends_with(" head")) {
                head.store(true, Ordering::SeqCst);
            }
            heard.store(true, Ordering::SeqCst);
            n.notify_waiters();
        }
    }

    /// Waits for a message on the waiter's channel or the re-check timer; true if the
    /// timer ended the wait.
    async fn wait_notified(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    ) -> bool {
        self.wait_notified_for(notified, self.recheck).await
    }

    /// As [`Shared::wait_notified`], with the timer given.
    async fn wait_notified_for(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        timer: Duration,
    ) -> bool {
        tokio::select! {
            _ = notified => false,
            _ = tokio::time::sleep(timer) => true,
        }
    }

    /// When a `wait_gone` re-checks an entry whose key has `ttl_ms` left (-1: no TTL):
    /// just after the key expires, and at the latest after lease/3.
    fn gone_recheck(&self, ttl_ms: i64) -> Duration {
        let period = self.lease / 3;
        match u64::try_from(ttl_ms) {
            Ok(ms) => period.min(Duration::from_millis(ms) + GONE_MARGIN),
            Err(_) => period,
        }
    }

    /// Counts a wait that ended on a timer re-check as a missed wake-up.
    fn count_recheck(&self, by_timer: bool) {
        if by_timer {
            self.counters.missed_wakeups.fetch_add(1, Ordering::Relaxed);
            debug!("a waiter's message never came; its re-check timer found the change");
        }
    }

    fn wake_all_waiters(&self) {
        for c in self.chans.lock().values() {
            c.notify.notify_waiters();
        }
    }

    /// Registers a waiter on `channel`. With `confirm`, returns once the channel is
    /// subscribed on every master that answered (a master that did not is covered by the
    /// re-check timer); without, once the SUBSCRIBE is sent, and the caller's next command
    /// on the subscriber connection confirms it ([`Node::pttl_after_subscribe`]).
    async fn listen(self: &Arc<Self>, channel: &str, confirm: bool) -> Listener {
        let (notify, heard, head, ready) = {
            let mut chans = self.chans.lock();
            let c = chans.entry(channel.to_owned()).or_insert_with(|| Chan {
                waiters: 0,
                notify: Arc::new(Notify::new()),
                heard: Arc::new(AtomicBool::new(false)),
                head: Arc::new(AtomicBool::new(false)),
                ready: Arc::new(tokio::sync::OnceCell::new()),
            });
            c.waiters += 1;
            (
                c.notify.clone(),
                c.heard.clone(),
                c.head.clone(),
                c.ready.clone(),
            )
        };
        let listener = Listener {
            shared: self.clone(),
            channel: channel.to_owned(),
            notify,
            heard,
            head,
        };
        ready
            .get_or_init(|| async {
                // SUBSCRIBE is sent under the lock (so a late UNSUBSCRIBE of the same
                // channel never overtakes it) and confirmed outside it: waiters arming
                // many channels at once share round trips instead of queueing one each.
                let sent = {
                    let _ops = self.sub_ops.lock().await;
                    join_all(self.nodes.iter().map(|n| n.subscribe(channel))).await
                };
                let results = self
                    .gather(self.nodes.iter().zip(sent).map(|(n, sent)| async move {
                        sent?;
                        if confirm {
                            n.confirm_subscriptions().await?;
                        }
                        Ok(())
                    }))
                    .await;
                for r in results {
                    match r {
                        Ok(()) => {
                            self.counters.subscribes.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            warn!(%channel, error = %e, "subscribe failed; falling back to the re-check timer")
                        }
                    }
                }
            })
            .await;
        listener
    }

    fn unlisten(self: &Arc<Self>, channel: String) {
        let last = {
            let mut chans = self.chans.lock();
            match chans.get_mut(&channel) {
                Some(c) => {
                    c.waiters = c.waiters.saturating_sub(1);
                    c.waiters == 0
                }
                None => false,
            }
        };
        if !last {
            return;
        }
        // Channels left without waiters are unsubscribed in batches, one UNSUBSCRIBE per
        // master for all that piled up during UNSUBSCRIBE_BATCH: a gone-channel serves
        // one wait, so one command per wait would otherwise follow every handoff.
        let Ok(h) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let first = {
            let mut idle = self.idle_chans.lock();
            idle.push(channel);
            idle.len() == 1
        };
        if !first {
            return;
        }
        let shared = self.clone();
        h.spawn(async move {
            tokio::time::sleep(UNSUBSCRIBE_BATCH).await;
            let _ops = shared.sub_ops.lock().await;
            let batch = std::mem::take(&mut *shared.idle_chans.lock());
            // A channel someone listens on again keeps its subscription (and its Chan).
            let gone: Vec<String> = {
                let mut chans = shared.chans.lock();
                batch
                    .into_iter()
                    .filter(|ch| match chans.get(ch) {
                        Some(c) if c.waiters == 0 => {
                            chans.remove(ch);
                            true
                        }
                        _ => false,
                    })
                    .collect()
            };
            if !gone.is_empty() && !shared.closed.load(Ordering::SeqCst) {
                for r in join_all(shared.nodes.iter().map(|n| n.unsubscribe_all(&gone))).await {
                    if let Err(e) = r {
                        debug!(channels = gone.len(), error = %e, "unsubscribe failed");
                    }
                }
            }
        });
    }

    // ---- running scripts on the masters ------------------------------------------

    async fn eval_all(
        &self,
        what: &str,
        script: &fred::types::scripts::Script,
        keys: &QueueKeys,
        args: Vec<Value>,
    ) -> Vec<Result<Value>> {
        let k = keys.script_keys();
        if let [node] = self.nodes.as_slice() {
            // One master: no copies of the request, no straggler bookkeeping.
            return vec![node.eval(what, script, k, args).await];
        }
        self.gather(
            self.nodes
                .iter()
                .map(|n| n.eval(what, script, k.clone(), args.clone())),
        )
        .await
    }

    /// Runs one request per master and collects the answers, in no particular order.
    /// Once a majority has answered, the others get [`STRAGGLER_GRACE`] more and then
    /// count as failed: a dead master would otherwise hold every call for its whole
    /// command timeout. On one master this is just that master's answer.
    async fn gather<T, F>(&self, requests: impl IntoIterator<Item = F>) -> Vec<Result<T>>
    where
        F: std::future::Future<Output = Result<T>>,
    {
        use futures::StreamExt;
        let mut pending: futures::stream::FuturesUnordered<F> = requests.into_iter().collect();
        let n = pending.len();
        let mut out = Vec::with_capacity(n);
        let mut oks = 0;
        let grace = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(grace);
        let mut grace_armed = false;
        loop {
            tokio::select! {
                r = pending.next() => match r {
                    Some(r) => {
                        oks += usize::from(r.is_ok());
                        out.push(r);
                        if oks >= self.majority && !grace_armed && out.len() < n {
                            grace.as_mut().reset(Instant::now() + STRAGGLER_GRACE);
                            grace_armed = true;
                        }
                    }
                    None => break,
                },
                _ = &mut grace, if grace_armed => {
                    for _ in out.len()..n {
                        out.push(Err(Error::Unreachable(format!(
                            "a redis master did not answer within {STRAGGLER_GRACE:?} of the majority"
                        ))));
                    }
                    break;
                }
            }
        }
        out
    }

    /// Keeps the answers if a majority answered (on one master: the answer), otherwise
    /// returns the error to report.
    fn quorum<T>(&self, results: Vec<Result<T>>) -> Result<Vec<T>> {
        let n = results.len();
        let mut oks = Vec::with_capacity(n);
        let mut first_err = None;
        for r in results {
            match r {
                Ok(v) => oks.push(v),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        if oks.len() >= self.majority {
            return Ok(oks);
        }
        Err(match (self.mode, first_err) {
            (Mode::Single, Some(e)) => e,
            (_, e) => Error::Unreachable(format!(
                "only {} of {n} redis masters answered, a majority ({}) is needed{}",
                oks.len(),
                self.majority,
                e.map(|e| format!(": {e}")).unwrap_or_default()
            )),
        })
    }

    fn q_args(keys: &QueueKeys) -> Vec<Value> {
        vec![
            Value::from(keys.entry_prefix.as_str()),
            Value::from(keys.gone_prefix.as_str()),
            Value::from(keys.changed.as_str()),
        ]
    }

    /// Lists the live queue, or with `upto` only the entries whose sequence is at most
    /// that (the part ahead of an entry).
    async fn list(&self, keys: &QueueKeys, detail: bool, upto: Option<u64>) -> Result<Vec<Entry>> {
        let mut args = Self::q_args(keys);
        args.push(Value::from(if detail { "1" } else { "0" }));
        args.push(Value::from(upto.map(|s| s.to_string()).unwrap_or_default()));
        let results = self
            .eval_all("listing a queue", &self.scripts.list, keys, args)
            .await;
        let views = self
            .quorum(results)?
            .into_iter()
            .map(|v| reply::entries(v, detail))
            .collect::<Result<Vec<_>>>()?;
        Ok(self.merge(keys, views))
    }

    /// Merges the masters' views: the union of their live entries, in queue order. On one
    /// master this is its view. On N masters every entry carries the same name (and so
    /// the same sequence) wherever it exists, so the union is one consistent order; an
    /// entry present on a minority only (a failed enqueue not yet cleaned up) only makes
    /// later entries wait, never lets two in. The token shown is the highest any master
    /// reported.
    fn merge(&self, keys: &QueueKeys, mut views: Vec<Vec<Entry>>) -> Vec<Entry> {
        if self.mode == Mode::Single && views.len() == 1 {
            // One view: nothing to merge, and no Redlock proposals to hint.
            let mut q = views.pop().unwrap_or_default();
            dlock_core::entry::sort_queue(&mut q);
            return q;
        }
        let mut by_name: BTreeMap<String, Entry> = BTreeMap::new();
        for e in views.into_iter().flatten() {
            match by_name.get_mut(&e.name) {
                Some(seen) => {
                    seen.token = seen.token.max(e.token);
                }
                None => {
                    by_name.insert(e.name.clone(), e);
                }
            }
        }
        let mut q: Vec<Entry> = by_name.into_values().collect();
        dlock_core::entry::sort_queue(&mut q);
        if let Some(max) = q.iter().map(|e| e.seq).max() {
            let mut hints = self.seq_hint.lock();
            let h = hints.entry(keys.queue.clone()).or_insert(0);
            *h = (*h).max(max);
        }
        q
    }

    async fn remove_names(&self, keys: &QueueKeys, names: &[String]) -> Result<()> {
        let mut args = Self::q_args(keys);
        args.extend(names.iter().map(|n| Value::from(n.as_str())));
        let results = self
            .eval_all("removing an entry", &self.scripts.remove, keys, args)
            .await;
        self.quorum(results).map(|_| ())
    }

    // ---- live entries and the watchdog ------------------------------------------

    fn register(
        &self,
        keys: &Arc<QueueKeys>,
        name: &str,
        ticket: Option<String>,
        sent_at: Instant,
    ) {
        let (tx, _) = watch::channel(None);
        self.live.lock().insert(
            (keys.queue.clone(), name.to_owned()),
            Live {
                keys: keys.clone(),
                ticket,
                renewed_at: sent_at,
                fate: tx,
            },
        );
    }

    /// Stops renewing an entry and tells its `lost()` futures why.
    fn settle(&self, queue_key: &str, name: &str, fate: Fate) -> Option<Arc<QueueKeys>> {
        let live = self
            .live
            .lock()
            .remove(&(queue_key.to_owned(), name.to_owned()))?;
        if let Fate::Lost(reason) = &fate {
            self.counters.lost.fetch_add(1, Ordering::Relaxed);
            warn!(queue = %queue_key, entry = %name, %reason, "lock entry lost");
        }
        let _ = live.fate.send(Some(fate));
        Some(live.keys)
    }

    /// Declares an entry lost and removes whatever is left of it, in the background, so
    /// that a remnant on some master does not make others wait for its expiry.
    fn lose(self: &Arc<Self>, queue_key: &str, name: &str, reason: String) {
        if let Some(keys) = self.settle(queue_key, name, Fate::Lost(reason)) {
            let shared = self.clone();
            let name = name.to_owned();
            tokio::spawn(async move {
                let _ = shared.remove_names(&keys, &[name]).await;
            });
        }
    }

    /// When an entry renewed by a round sent at `renewed_at` is declared lost: the lease,
    /// less the clock-drift allowance, less [`dlock_core::lost_margin`], so that `lost()`
    /// fires that margin before the server may expire it.
    fn deadline_of(&self, renewed_at: Instant) -> Instant {
        renewed_at
            + self
                .lease
                .saturating_sub(self.drift + dlock_core::lost_margin(self.lease))
    }

    /// Fires `lost()` of every entry not renewed for a whole lease (minus drift): past
    /// that point the server may already have expired it. Returns the earliest deadline
    /// still ahead.
    fn fire_overdue(self: &Arc<Self>) -> Option<Instant> {
        let now = Instant::now();
        let mut overdue = Vec::new();
        let mut next: Option<Instant> = None;
        for (k, l) in self.live.lock().iter() {
            let d = self.deadline_of(l.renewed_at);
            if d <= now {
                overdue.push(k.clone());
            } else {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        for (q, name) in overdue {
            self.lose(
                &q,
                &name,
                format!(
                    "no successful renewal for a whole lease ({:?}, less drift and the safety margin)",
                    self.lease
                ),
            );
        }
        next
    }

    /// One renewal round: one script per queue and master, [`RENEW_IN_FLIGHT`] per master
    /// in flight at a time, each built only when sent, so that a client holding many locks
    /// does not hold a copy of every request at once. An entry is credited as soon as a
    /// majority of masters renewed it, so a dead master that answers only at its command
    /// timeout does not delay the credit.
    async fn renew_round(self: &Arc<Self>) {
        use futures::StreamExt;
        let mut groups: Vec<(Arc<QueueKeys>, Vec<String>)> = Vec::new();
        {
            let mut by_queue: HashMap<&str, usize> = HashMap::new();
            let live = self.live.lock();
            for ((_, name), l) in live.iter() {
                let i = *by_queue.entry(l.keys.queue.as_str()).or_insert_with(|| {
                    groups.push((l.keys.clone(), Vec::new()));
                    groups.len() - 1
                });
                groups[i].1.push(name.clone());
            }
        }
        if groups.is_empty() {
            return;
        }
        let sent_at = Instant::now();
        let (groups_ref, lease_ref) = (&groups, &self.lease_ms);
        let jobs = (0..groups.len()).flat_map(|g| (0..self.nodes.len()).map(move |n| (g, n)));
        let mut pending = futures::stream::iter(jobs)
            .map(|(g, n)| async move {
                let (keys, names) = &groups_ref[g];
                let mut args = Vec::with_capacity(names.len() + 2);
                args.push(Value::from(keys.entry_prefix.as_str()));
                args.push(lease_ref.clone());
                args.extend(names.iter().map(|n| Value::from(n.as_str())));
                let r = self.nodes[n]
                    .eval(
                        "renewing entries",
                        &self.scripts.renew,
                        keys.script_keys(),
                        args,
                    )
                    .await
                    .and_then(|v| reply::renewed(v, names.len()));
                (g, r)
            })
            .buffer_unordered(RENEW_IN_FLIGHT * self.nodes.len());
        // Per group and entry: (renewed, gone, last error).
        let mut tally: Vec<Vec<(usize, usize, Option<String>)>> = groups
            .iter()
            .map(|(_, names)| vec![(0, 0, None); names.len()])
            .collect();
        while let Some((g, r)) = pending.next().await {
            let (keys, names) = &groups[g];
            for (i, name) in names.iter().enumerate() {
                let t = &mut tally[g][i];
                match &r {
                    Ok(v) if v[i] => {
                        t.0 += 1;
                        self.counters.renewals.fetch_add(1, Ordering::Relaxed);
                        if t.0 == self.majority {
                            if let Some(l) = self
                                .live
                                .lock()
                                .get_mut(&(keys.queue.clone(), name.clone()))
                            {
                                l.renewed_at = l.renewed_at.max(sent_at);
                            }
                        }
                    }
                    Ok(_) => t.1 += 1,
                    Err(e) => t.2 = Some(e.to_string()),
                }
            }
        }
        let n = self.nodes.len();
        for ((keys, names), tally) in groups.iter().zip(tally) {
            for (name, (ok, gone, err)) in names.iter().zip(tally) {
                if ok >= self.majority {
                    continue;
                }
                if gone > n - self.majority {
                    let reason = match self.mode {
                        Mode::Single => "the entry expired or was deleted on the server".to_owned(),
                        Mode::Redlock => format!(
                            "the entry is gone from {gone} of {n} masters; a majority no longer holds it"
                        ),
                    };
                    self.lose(&keys.queue, name, reason);
                } else if let Some(e) = err {
                    debug!(entry = %name, error = %e, "renewal failed; retrying until the lease runs out");
                }
            }
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

/// A waiter's registration on a channel; unsubscribes when the last one goes.
struct Listener {
    shared: Arc<Shared>,
    channel: String,
    notify: Arc<Notify>,
    heard: Arc<AtomicBool>,
    head: Arc<AtomicBool>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shared.unlisten(std::mem::take(&mut self.channel));
    }
}

/// The watchdog (Redisson's idea): renews every live entry every lease/3 with a script
/// that only extends entries that still exist, fires `lost()` where the entry is gone or
/// no renewal succeeded for a whole lease, and runs an extra round right after a
/// reconnect (a restart without persistence forgets every key, pitfall R4). It holds only
/// a `Weak`, and the owner aborts it on close and drop.
async fn watchdog(weak: Weak<Shared>) {
    let period = match weak.upgrade() {
        Some(s) => s.lease / 3,
        None => return,
    };
    loop {
        let Some(shared) = weak.upgrade() else { return };
        let round_started = Instant::now();
        shared.fire_overdue();
        {
            let round = shared.renew_round();
            tokio::pin!(round);
            loop {
                let next = shared.fire_overdue();
                let sleep =
                    tokio::time::sleep_until(next.unwrap_or_else(|| Instant::now() + period));
                tokio::select! {
                    _ = &mut round => break,
                    _ = sleep => {}
                }
            }
        }
        let wake = shared.wake.clone();
        drop(shared);
        tokio::select! {
            _ = tokio::time::sleep_until(round_started + period) => {}
            _ = wake.notified() => {}
        }
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

    fn enqueue<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        at: Position<'a>,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<Enqueued>> {
        let span = tracing::debug_span!("enqueue", lock = %q, %kind, ticket = ticket.as_str());
        Box::pin(
            self.enqueue_inner(q, ticket, kind, at, data)
                .instrument(span),
        )
    }

    fn queue<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            self.shared.check_open()?;
            self.shared.list(&QueueKeys::new(q), false, None).await
        })
    }

    fn queue_ahead<'a>(
        &'a self,
        q: &'a QueuePath,
        mine: &'a Entry,
    ) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            self.shared.check_open()?;
            // Every entry ahead of `mine` has a sequence up to its own (a downgrade's
            // read entry shares its writer's): one ZRANGEBYSCORE, O(entries ahead).
            self.shared
                .list(&QueueKeys::new(q), false, Some(mine.seq))
                .await
        })
    }

    /// The entries up to `entry`'s sequence (one `ZRANGEBYSCORE`), searched for its name.
    /// On one master the token is compared too: it is the value the enqueue wrote into
    /// the entry, so any other value is another entry. Redlock's token is the highest of
    /// the masters that answered, which can differ between two reads of the same entry.
    fn contains<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let ahead = self.queue_ahead(q, entry).await?;
            let exact = self.shared.mode == Mode::Single;
            Ok(ahead
                .iter()
                .any(|e| e.name == entry.name && (!exact || entry.token_matches(e.token))))
        })
    }

    fn wait_gone<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { self.wait_gone_detail(q, entry).await.map(|_| ()) })
    }

    /// On one master, [`Gone::Head`] when the message that woke the waiter said the entry
    /// was removed as the head of its queue (the remove script checks it atomically).
    /// Redlock says [`Gone::Unknown`] after a message: one master's message does not
    /// speak for a majority, so its waiters list the queue as before. On either, an entry
    /// found missing with no removal message heard is [`Gone::Vanished`]: it expired, or
    /// the server lost it (with the waiter's own entry, perhaps), so the waiter lists
    /// the queue before it may hold.
    fn wait_gone_detail<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
    ) -> BoxFuture<'a, Result<Gone>> {
        let span = tracing::debug_span!("wait_gone", lock = %q, entry = %entry.name);
        Box::pin(
            async move {
                let s = &self.shared;
                s.check_open()?;
                let keys = QueueKeys::new(q);
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
            .instrument(span),
        )
    }

    fn wait_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        seen: &'a [Entry],
    ) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("wait_changed", lock = %q);
        Box::pin(
            async move {
                let s = &self.shared;
                s.check_open()?;
                let keys = QueueKeys::new(q);
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
                    let same = now.len() == seen.len()
                        && now.iter().all(|e| seen.contains(e.name.as_str()));
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
            .instrument(span),
        )
    }

    fn remove<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        let span =
            tracing::debug_span!("remove", lock = %q, entry = %entry.name, token = ?entry.token);
        Box::pin(
            async move {
                let s = &self.shared;
                // Stop renewing before deleting: no renewal may follow a release. A live
                // entry's keys were built by its enqueue; reuse them.
                let keys = match s.settle(&QueueKeys::queue_key(q), &entry.name, Fate::Released) {
                    Some(keys) => keys,
                    None => Arc::new(QueueKeys::new(q)),
                };
                s.check_open()?;
                s.remove_names(&keys, std::slice::from_ref(&entry.name))
                    .await
            }
            .instrument(span),
        )
    }

    fn abandon<'a>(&'a self, q: &'a QueuePath, ticket: &'a Ticket) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("abandon", lock = %q, ticket = ticket.as_str());
        Box::pin(
            async move {
                let s = &self.shared;
                let keys = QueueKeys::new(q);
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
            .instrument(span),
        )
    }

    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        let name = entry.name.clone();
        let rx = self
            .shared
            .live
            .lock()
            .get(&(QueueKeys::queue_key(q), name.clone()))
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

    fn participants<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            self.shared.check_open()?;
            self.shared.list(&QueueKeys::new(q), true, None).await
        })
    }

    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            self.shared.close().await;
            Ok(())
        })
    }
}

impl RedisBackend {
    async fn enqueue_inner(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        let s = &self.shared;
        s.check_open()?;
        let keys = Arc::new(QueueKeys::new(q));
        let started = Instant::now();
        let prefix = ticket.name_prefix(kind);
        // Redlock proposals: each is above every counter a master reported and every
        // sequence seen, plus a random offset that widens with each refusal, so that
        // contenders stop proposing the same sequence and splitting the masters.
        let mut rng = Jitter::new(ticket.as_str());
        let mut proposal = 0u64;
        let mut attempts = 0usize;
        for attempt in 0..REDLOCK_ATTEMPTS {
            attempts = attempt + 1;
            let (mode, p, writer) = match (at, s.mode) {
                (Position::Beside(w), _) => ("beside", w.seq, w.name.as_str()),
                (Position::Tail, Mode::Single) => ("tail", 0, ""),
                (Position::Tail, Mode::Redlock) => {
                    let hint = s.seq_hint.lock().get(&keys.queue).copied().unwrap_or(0);
                    let spread = 1u64 << attempt.min(5);
                    proposal = proposal.max(hint) + 1 + rng.below(spread);
                    ("cas", proposal, "")
                }
            };
            let mut args = Shared::q_args(&keys);
            args.extend([
                Value::from(prefix.as_str()),
                s.lease_ms.clone(),
                Value::from(data),
                Value::from(mode),
                Value::from(p.to_string()),
                Value::from(writer),
            ]);
            let sent_at = Instant::now();
            let results = s
                .eval_all("adding an entry", &s.scripts.enqueue, &keys, args)
                .await;
            let mut added = Vec::new();
            let (mut rejected, mut missing, mut failed) = (0usize, 0usize, Vec::new());
            for r in results {
                match r.and_then(reply::enqueue) {
                    Ok(reply::Enqueue::Added { mine, queue }) => added.push((mine, queue)),
                    Ok(reply::Enqueue::Rejected { counter }) => {
                        rejected += 1;
                        proposal = proposal.max(counter);
                    }
                    Ok(reply::Enqueue::Missing) => missing += 1,
                    Err(e) => failed.push(e),
                }
            }
            // Redlock validity: the entry is only worth having if a majority took it with
            // time left on its lease (monotonic clock, drift allowance as in the Redis docs).
            let valid = started.elapsed() + s.drift < s.lease;
            if added.len() >= s.majority && valid {
                let mut mine = added[0].0.clone();
                mine.data = data.to_vec();
                mine.token = added.iter().filter_map(|(m, _)| m.token).max();
                s.register(&keys, &mine.name, Some(ticket.as_str().to_owned()), sent_at);
                let views = added.into_iter().map(|(_, q)| q).collect();
                let queue = s.merge(&keys, views);
                debug!(entry = %mine.name, seq = mine.seq, token = ?mine.token, waiting = queue.len(), "entry added");
                return Ok(Enqueued { mine, queue });
            }
            if !added.is_empty() || !failed.is_empty() {
                // Added on a minority, too late, or maybe added where the reply was lost:
                // take it back everywhere before proposing again.
                let mut args = Shared::q_args(&keys);
                args.push(Value::from(ticket.protected_prefix()));
                let _ = s
                    .eval_all("abandoning an entry", &s.scripts.abandon, &keys, args)
                    .await;
            }
            let n = s.nodes.len();
            if s.mode == Mode::Single {
                if !failed.is_empty() {
                    return Err(failed.swap_remove(0));
                }
            } else if failed.len() > n - s.majority {
                return Err(Error::Unreachable(format!(
                    "only {} of {n} redis masters answered, a majority ({}) is needed: {}",
                    n - failed.len(),
                    s.majority,
                    failed
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join("; ")
                )));
            }
            if missing > 0 && missing + failed.len() > n - s.majority {
                return Err(Error::LockLost(format!(
                    "the write entry {} beside which the read entry was asked for is gone",
                    match at {
                        Position::Beside(w) => w.name.as_str(),
                        Position::Tail => "",
                    }
                )));
            }
            if !valid {
                return Err(Error::Unreachable(format!(
                    "redlock: adding the entry took {:?}, longer than its lease {:?}",
                    started.elapsed(),
                    s.lease
                )));
            }
            if rejected == 0 {
                break;
            }
            debug!(
                attempt,
                proposal, rejected, "redlock: sequence refused, proposing a higher one"
            );
            {
                let mut hints = s.seq_hint.lock();
                let h = hints.entry(keys.queue.clone()).or_insert(0);
                *h = (*h).max(proposal);
            }
            if started.elapsed() + s.drift >= s.lease / 3 {
                break;
            }
            // Contenders that split the masters retry at random moments, not in lockstep.
            let cap = REDLOCK_MAX_BACKOFF.as_micros() as u64;
            let pause = rng.below((250u64 << attempt.min(7)).min(cap));
            tokio::time::sleep(Duration::from_micros(pause)).await;
        }
        Err(Error::backend(
            "adding an entry",
            format!(
                "redlock: the masters did not agree on a sequence after {attempts} proposals in {:?}",
                started.elapsed()
            ),
        ))
    }
}

/// A small xorshift generator for Redlock proposal offsets and pauses: seeded from the
/// ticket and the clock, so that contenders (even in one process) draw differently. Not
/// for anything security related.
struct Jitter(u64);

impl Jitter {
    fn new(ticket: &str) -> Self {
        let clock = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(0);
        let seed = ticket.bytes().fold(clock ^ 0x9E37_79B9_7F4A_7C15, |a, b| {
            a.wrapping_mul(0x100_0000_01B3).wrapping_add(u64::from(b))
        });
        Jitter(seed | 1)
    }

    /// A number in `0..n` (0 when `n` is 0).
    fn below(&mut self, n: u64) -> u64 {
        let mut x = self.0;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.0 = x;
        if n == 0 {
            0
        } else {
            x % n
        }
    }
}
