//! Connecting: [`RedisBackend::connect`] and its Sentinel, Redlock and URL variants, the
//! validation of addresses and leases, and the start of the background tasks.

use std::collections::HashSet;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Error, Result, SessionOptions};
use fred::prelude::{EventInterface, Value};
use futures::future::join_all;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tokio::time::Instant;
use tracing::{info, warn};

use crate::backend::{Counters, Mode, RedisBackend, Shared};
use crate::node::{Node, Tuning};
use crate::scripts::Scripts;
use crate::tls::Access;
use crate::watchdog::watchdog;

/// The lease when [`SessionOptions::session_timeout`] is not set: Redisson's watchdog
/// default.
pub const DEFAULT_LEASE: Duration = Duration::from_secs(30);

/// The shortest lease accepted; below it the watchdog's lease/3 period is shorter than a
/// loaded machine's scheduling jitter.
pub const MIN_LEASE: Duration = Duration::from_millis(300);

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
        Self::connect_mode(Mode::Single, &[addr.to_owned()], None, 0, opts).await
    }

    /// [`RedisBackend::connect`] to database `database` of the server (`SELECT`ed on
    /// every connection; `redis://host:port/3` in the facade). Keys live in that
    /// database; pub/sub channels are server-wide, so clients of two databases that use
    /// the same lock name only see each other's wake-ups, which their waiters re-check.
    ///
    /// # Errors
    /// As [`RedisBackend::connect`].
    pub async fn connect_database(
        addr: &str,
        database: u8,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        Self::connect_mode(Mode::Single, &[addr.to_owned()], None, database, opts).await
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
    /// The first script runs only once more than half of `sentinels` answer `SENTINEL
    /// MASTER` and the newest configuration among the answers (the highest
    /// `config-epoch`) names the primary both clients are connected to, and the same
    /// check follows every reconnection to another server: a Sentinel cut off from the
    /// others can name an old primary that is still up, where this client would take
    /// locks others hold on the new one. So the client needs a majority of the Sentinels
    /// it was given, as the Sentinels themselves need one to fail over.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for an empty or repeated Sentinel list, a malformed address,
    /// an empty service name or a lease below [`MIN_LEASE`]; [`Error::Unreachable`] if no
    /// primary accepts a connection within `opts.connect_timeout` (Sentinels down, the
    /// service unknown to them, or a failover still under way), or fewer than a majority
    /// of the Sentinels answered by then.
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
        Self::connect_mode(
            Mode::Single,
            sentinels,
            Some(Topology::Sentinel(service)),
            0,
            opts,
        )
        .await
    }

    /// Connects to the Redis Cluster that the seed nodes `seeds` (`host:port` each; any
    /// of its nodes, one is enough) belong to.
    ///
    /// Each lock lives on the master of its slot (every key of a lock shares the hash
    /// tag `{name}`), so each lock behaves as on [`RedisBackend::connect`]'s one master:
    /// the same scripts, tokens, watchdog and FIFO queue. The clients follow the
    /// cluster: `MOVED` and `ASK` are followed, and after any change of the slot map
    /// (a failover, a slot migration) the watchdog runs a round at once, so an entry
    /// the new master never received (replication is asynchronous) fires `lost()`, and
    /// the waiters re-check. Wake-ups use sharded pub/sub (`SSUBSCRIBE` and, in the
    /// scripts, `SPUBLISH` on the lock's slot; Redis 7.0 or later), so a release is
    /// sent to the subscribers of that slot's master and its replicas only, not over
    /// the whole cluster bus.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for an empty or repeated seed list, a malformed address or a
    /// lease below [`MIN_LEASE`]; [`Error::Unreachable`] if no seed answers within
    /// `opts.connect_timeout`.
    pub async fn connect_cluster(
        seeds: &[String],
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        Self::connect_mode(Mode::Single, seeds, Some(Topology::Cluster), 0, opts).await
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
        Self::connect_mode(Mode::Redlock, addrs, None, 0, opts).await
    }

    /// Builds the backend on the application's own fred client (bring your own client):
    /// dlock's commands go over `client`'s connection; dlock opens one connection of its
    /// own, a subscriber for its wake-ups (a connection in subscribed mode can run no
    /// other command), with `client`'s configuration: server, TLS, credentials. A client
    /// configured for Sentinel gets the failover watch of
    /// [`RedisBackend::connect_sentinel`] (one more connection per Sentinel), and one
    /// configured for a Redis Cluster works as [`RedisBackend::connect_cluster`].
    ///
    /// **Who owns what.** `client` stays the application's: dlock never connects, quits
    /// or reconfigures it, so call its `init()` (or `connect()`) as usual; dlock waits up
    /// to `opts.connect_timeout` for it to be connected. [`Backend::close`] removes
    /// dlock's entries and closes only dlock's subscriber. `opts.tls` and
    /// `opts.credentials` are ignored (they are the client's); `opts.session_timeout`
    /// (the lease) and `opts.namespace` (the key prefix) apply as for
    /// [`RedisBackend::connect`].
    ///
    /// **What dlock needs of the client.** Each of dlock's commands is sent with its own
    /// options, whatever the client's defaults: one attempt (never replayed after a
    /// reconnection, where a replayed enqueue could take a second place in a queue) and
    /// a timeout of half the lease (1 to 5 s). The client may speak RESP2 or RESP3. On a
    /// Redis Cluster, fred ends a client's routing task when a command meets an `ASK`
    /// (a slot being migrated); dlock restarts its own clients', but a borrowed client's
    /// task is the application's to start again (docs/own-client.md).
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for a client configured for anything but one server, a
    /// Sentinel group or a Redis Cluster, a lease below [`MIN_LEASE`] or a bad prefix; [`Error::Unreachable`] if the
    /// client or dlock's subscriber is not connected within `opts.connect_timeout`;
    /// [`Error::Unauthenticated`], [`Error::PermissionDenied`] or [`Error::Tls`] if the
    /// server refuses the subscriber.
    ///
    /// [`Backend::close`]: dlock_core::Backend::close
    pub async fn from_client(
        client: fred::clients::Client,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        let what = "the application's fred client".to_owned();
        let (lease, prefix) = check_session(&what, &opts)?;
        let node = Node::borrow(client, tuning(&opts, lease))?;
        Self::assemble(Mode::Single, vec![node], what, &opts, lease, prefix).await
    }

    /// [`RedisBackend::from_client`] on one client of the application's `pool` (the
    /// next in its rotation): dlock's commands use that client's connection.
    ///
    /// # Errors
    /// As [`RedisBackend::from_client`].
    pub async fn from_pool(
        pool: &fred::clients::Pool,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        Self::from_client(pool.next().clone(), opts).await
    }

    /// Redlock over the application's own clients, one per independent master, as
    /// [`RedisBackend::connect_redlock`] and with what [`RedisBackend::from_client`]
    /// says of each client.
    ///
    /// # Errors
    /// As [`RedisBackend::from_client`], and [`Error::InvalidUrl`] for no client or two
    /// clients of the same server.
    pub async fn from_redlock_clients(
        clients: Vec<fred::clients::Client>,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        let what = "the application's fred clients".to_owned();
        let (lease, prefix) = check_session(&what, &opts)?;
        let nodes = clients
            .into_iter()
            .map(|c| Node::borrow(c, tuning(&opts, lease)))
            .collect::<Result<Vec<_>>>()?;
        let distinct: HashSet<&String> = nodes.iter().map(|n| &n.addr).collect();
        if nodes.is_empty() || distinct.len() != nodes.len() {
            return Err(Error::InvalidUrl {
                url: what,
                reason: "Redlock needs at least one client, each of a different server".into(),
            });
        }
        Self::assemble(Mode::Redlock, nodes, what, &opts, lease, prefix).await
    }

    /// `addrs` are the masters, or the Sentinels of a service (one node: the primary
    /// they name), or the seeds of a cluster (one node: the whole cluster).
    async fn connect_mode(
        mode: Mode,
        addrs: &[String],
        topology: Option<Topology<'_>>,
        database: u8,
        opts: SessionOptions,
    ) -> Result<Arc<RedisBackend>> {
        let what = match topology {
            Some(Topology::Sentinel(service)) => format!("{}/{service}", addrs.join(",")),
            _ => addrs.join(","),
        };
        let (lease, prefix) = check_session(&what, &opts)?;
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
            database: (database != 0).then_some(database),
            ..tuning(&opts, lease)
        };
        let access = Access::new(&opts)?;
        let nodes = match topology {
            Some(Topology::Sentinel(service)) => {
                vec![Node::start_sentinel(addrs, service, tuning, &access)?]
            }
            Some(Topology::Cluster) => vec![Node::start_cluster(addrs, tuning, &access)?],
            None => addrs
                .iter()
                .map(|a| Node::start(a, tuning, &access))
                .collect::<Result<Vec<_>>>()?,
        };
        Self::assemble(mode, nodes, what, &opts, lease, prefix).await
    }

    /// Waits for a majority of `nodes` to connect, then starts the backend on them.
    async fn assemble(
        mode: Mode,
        nodes: Vec<Node>,
        what: String,
        opts: &SessionOptions,
        lease: Duration,
        prefix: String,
    ) -> Result<Arc<RedisBackend>> {
        if opts.replicas > 0 && (mode == Mode::Redlock || nodes.iter().any(|n| n.sharded)) {
            for n in &nodes {
                n.shutdown().await;
            }
            return Err(Error::InvalidUrl {
                url: what,
                reason: format!(
                    "replicas={} is taken by one primary only (redis://, redis+sentinel://): \
                     dlock does not wait for replicas on Redlock masters or a Redis Cluster",
                    opts.replicas
                ),
            });
        }
        let majority = nodes.len() / 2 + 1;
        let deadline = Instant::now() + opts.connect_limit();
        let results = join_all(nodes.iter().map(|n| n.wait_connected(deadline))).await;
        let connected = results.iter().filter(|r| r.is_ok()).count();
        if connected < majority {
            for n in &nodes {
                n.shutdown().await;
            }
            // A refusal (credentials, permissions, TLS) says more than "unreachable".
            let errors: Vec<Error> = results.into_iter().filter_map(|r| r.err()).collect();
            let first = match errors.iter().position(Error::is_refusal) {
                Some(i) => errors.into_iter().nth(i),
                None => errors.into_iter().next(),
            };
            return Err(match (mode, first) {
                (_, Some(e)) if e.is_refusal() => e,
                (Mode::Single, Some(e)) => e,
                _ => Error::Unreachable(format!(
                    "only {connected} of {} redis masters connected within {:?}; a majority ({majority}) is needed",
                    nodes.len(),
                    opts.connect_limit()
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
            prefix,
            majority,
            lease,
            lease_ms: Value::from(lease.as_millis().to_string()),
            recheck: (lease / 3).min(Duration::from_secs(1)),
            drift: lease / 100 + Duration::from_millis(2),
            replicas: opts.replicas,
            // Short: a WAIT holds back every command of the connection meanwhile. A
            // healthy replica acknowledges within a round trip.
            replica_wait: (lease / 20).clamp(Duration::from_millis(100), Duration::from_secs(1)),
            scripts: Scripts::new(nodes.iter().any(|n| n.sharded), lease.as_millis()),
            live: Mutex::new(crate::backend::FastMap::default()),
            chans: Mutex::new(crate::backend::FastMap::default()),
            idle_chans: Mutex::new(Vec::new()),
            sub_ops: tokio::sync::Mutex::new(()),
            seq_hint: Default::default(),
            contended: Mutex::new(crate::backend::FastMap::default()),
            wake: Arc::new(Notify::new()),
            deadlines: Arc::new(Notify::new()),
            closed: AtomicBool::new(false),
            removing: tokio::sync::RwLock::new(()),
            tasks: Mutex::new(Vec::new()),
            counters: Counters::default(),
            nodes,
        });
        shared.start_tasks();
        info!(kind = shared.kind(), masters = %what, ?lease, "redis backend connected");
        Ok(Arc::new(RedisBackend { shared }))
    }
}

/// How the addresses of a URL are used, besides as independent masters.
#[derive(Debug, Clone, Copy)]
enum Topology<'a> {
    /// Sentinels of this service.
    Sentinel(&'a str),
    /// Seed nodes of a Redis Cluster.
    Cluster,
}

/// The lease and key prefix of `opts`, checked.
fn check_session(what: &str, opts: &SessionOptions) -> Result<(Duration, String)> {
    let lease = opts.session_timeout_or(DEFAULT_LEASE);
    if lease < MIN_LEASE {
        return Err(Error::InvalidUrl {
            url: what.to_owned(),
            reason: format!("session timeout {lease:?} is below the minimum {MIN_LEASE:?}"),
        });
    }
    // The hash tag `{lock name}` must stay the only braces of every key.
    let prefix = opts.namespace.clone().unwrap_or_default();
    if prefix.contains(['{', '}']) || prefix.chars().any(char::is_control) {
        return Err(Error::InvalidUrl {
            url: what.to_owned(),
            reason: "the key prefix may not contain '{', '}' or control characters".into(),
        });
    }
    Ok((lease, prefix))
}

/// The client settings for `lease`.
fn tuning(opts: &SessionOptions, lease: Duration) -> Tuning {
    Tuning {
        attempt_timeout: opts.attempt_timeout(),
        command_timeout: (lease / 2).clamp(Duration::from_secs(1), Duration::from_secs(5)),
        database: None,
    }
}

impl Shared {
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
            let w = weak.clone();
            for h in node.on_cluster_change(move || {
                if let Some(s) = w.upgrade() {
                    s.wake.notify_one();
                    s.wake_all_waiters();
                }
            }) {
                tasks.push(h.abort_handle());
            }
        }
        self.tasks.lock().extend(tasks);
    }
}
