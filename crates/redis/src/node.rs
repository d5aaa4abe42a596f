//! One Redis master: a command client and a subscriber client, configured for locks.

use std::time::Duration;

use dlock_core::Error;
use fred::clients::SubscriberClient;
use fred::prelude::{
    Builder, ClientLike, Config, ErrorKind, EventInterface, KeysInterface, LuaInterface,
    PubsubInterface, ReconnectPolicy, ServerConfig, ServerInterface, Value,
};
use fred::types::scripts::Script;
use fred::types::{ConnectHandle, RespVersion};
use tokio::time::Instant;

use crate::tls::Access;

#[cfg(test)]
mod replicated_tests;
mod sentinel;
use sentinel::{Checked, Fence};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// How many keys one `SCAN` step asks the server to look at: a step stays short on the
/// server (SCAN runs on its one thread between other clients' commands).
const SCAN_COUNT: u32 = 1000;

/// The first pause before a script that got `TRYAGAIN` is sent again ([`Node::eval`]).
const TRYAGAIN_FIRST_PAUSE: Duration = Duration::from_millis(5);

/// The longest pause between two attempts of a script that got `TRYAGAIN`.
const TRYAGAIN_MAX_PAUSE: Duration = Duration::from_millis(100);

/// Client settings derived from the session options.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// fred's `connection_timeout`: one attempt's share of the connect timeout
    /// ([`dlock_core::SessionOptions::attempt_timeout`]); the connect waits for the whole.
    pub attempt_timeout: Duration,
    pub command_timeout: Duration,
    /// The database to SELECT (`None`: the server's default, 0).
    pub database: Option<u8>,
}

/// One master. Both clients reconnect forever ([`reconnect_policy`]); commands are never
/// replayed after a reconnect (`max_command_attempts = 1`, pitfall R1), and every command
/// times out after [`Tuning::command_timeout`] (fred's default is no timeout at all).
///
/// The command client may be the application's own ([`Node::borrow`]): then dlock's
/// commands carry those two settings themselves ([`Node::cmd`]), and the client's
/// connection, reconnection and shutdown stay the application's.
pub(crate) struct Node {
    pub addr: String,
    /// A Redis Cluster: commands go to the master of their key's slot (fred follows
    /// `MOVED` and `ASK`), and wake-ups use sharded pub/sub on that slot
    /// (`SSUBSCRIBE`; the scripts `SPUBLISH`).
    pub sharded: bool,
    pub client: fred::prelude::Client,
    pub sub: SubscriberClient,
    /// The options every command of ours carries: one attempt, our timeout.
    cmd: fred::types::config::Options,
    /// False when `client` is the application's: we never connect or quit it.
    owns_client: bool,
    conn_tasks: Vec<ConnectHandle>,
    resubscriber: tokio::task::AbortHandle,
    /// Sentinel mode: one pub/sub client per Sentinel, listening for `+switch-master`.
    watchers: Vec<SubscriberClient>,
    watcher_tasks: Vec<tokio::task::AbortHandle>,
    /// How many times a `+switch-master` for our service moved the clients.
    pub switches: Arc<AtomicU64>,
    /// How many scripts were retried after a `TRYAGAIN` ([`Node::eval`]).
    pub tryagains: AtomicU64,
    /// How many of `watchers` have a confirmed `+switch-master` subscription.
    watching: Arc<tokio::sync::watch::Sender<usize>>,
    /// Sentinel mode: set while a failover may have replaced the primary this client is
    /// on, and until both clients are verified on the one the Sentinels announced. Every
    /// script waits for it to clear ([`Node::pass_fence`]).
    fence: Arc<tokio::sync::watch::Sender<Option<Fence>>>,
    /// Sentinel mode: one plain client per Sentinel given, to ask it for the primary
    /// ([`Node::check_primary`]). Empty otherwise.
    askers: Vec<fred::prelude::Client>,
    /// Sentinel mode: the primary the Sentinels' newest configuration named (or a
    /// `+switch-master` announced) and the two connections found on it. A script whose
    /// reply came over any other connection, even a new one to the same server, does not
    /// count ([`Node::check_landed`]).
    verified: Arc<parking_lot::Mutex<Option<Checked>>>,
    /// Sentinel mode: reconnections of either client or of a Sentinel watcher, counted so
    /// that the primary check does not open the fence on answers that one of them
    /// overtook ([`Node::check_primary`]).
    reconnects: Arc<AtomicU64>,
    /// Sentinel mode: reconnections of the Sentinel watchers alone, so that the switch
    /// follower does not open the fence on a switch a later one (missed while a watcher
    /// was away) may have overtaken ([`Node::follow_switches`]).
    watcher_reconnects: Arc<AtomicU64>,
    /// Sentinel mode: the last refusal (credentials, permissions) a Sentinel gave the
    /// primary check, for the connect to report instead of timing out.
    check_refusal: Arc<parking_lot::Mutex<Option<fred::error::Error>>>,
    /// Connection errors of both clients, subscribed before they connect, so that the
    /// connect can tell refused credentials or a failed TLS handshake from a server that
    /// is down (fred retries both the same way).
    conn_errors: parking_lot::Mutex<Vec<ErrorRx>>,
}

/// The command connection before a write whose replication [`Node::replicated`] asks
/// about: which connection it was, and a subscription to fred's reconnection
/// announcements from then on.
pub(crate) struct Mark {
    reconnects: tokio::sync::broadcast::Receiver<fred::types::config::Server>,
    connection: Option<(String, Option<i64>)>,
}

type ErrorRx =
    tokio::sync::broadcast::Receiver<(fred::error::Error, Option<fred::types::config::Server>)>;

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node").field("addr", &self.addr).finish()
    }
}

/// Reconnect at once and often, then every 200 ms: 10, 20, 40, 80, 160, then 200 ms
/// between attempts, plus up to 10 ms of jitter, forever.
///
/// A Redis restart or failover drops every client's connection at the same instant; with
/// this schedule they all come back within a few milliseconds of each other once the
/// server answers (fred's default jitter of 100 ms on a 200 ms period spread them over
/// 300 ms). Then what decides who acts first is the work each does: a holder's first
/// round trip after the reconnection is its watchdog's check, while a waiter needs a few
/// (existence check, listing, enqueue), so a holder whose entry the server forgot usually
/// fires `lost()` before another client is granted the lock. Usually, not always: the
/// clients are separate processes.
pub(crate) fn reconnect_policy() -> ReconnectPolicy {
    let mut policy = ReconnectPolicy::new_exponential(0, 10, 200, 2);
    policy.set_jitter(10);
    policy
}

/// A builder of our clients of one server: every command times out after the command
/// timeout, one attempt per command (pitfall R1), reconnecting by [`reconnect_policy`].
fn builder(config: Config, tuning: Tuning) -> Builder {
    let mut b = Builder::from_config(config);
    b.with_performance_config(|p| p.default_command_timeout = tuning.command_timeout)
        .with_connection_config(|c| {
            c.connection_timeout = tuning.attempt_timeout;
            c.internal_command_timeout = tuning.command_timeout;
            c.max_command_attempts = 1;
        })
        .set_policy(reconnect_policy());
    b
}

/// The typed error for a refusal by the server's ACL or TLS, if `e` is one.
pub(crate) fn access_error(e: &fred::error::Error) -> Option<Error> {
    let details = e.details();
    if *e.kind() == ErrorKind::Auth
        || details.starts_with("WRONGPASS")
        || details.starts_with("NOAUTH")
    {
        return Some(Error::Unauthenticated(format!("redis: {details}")));
    }
    if details.starts_with("NOPERM")
        || details.contains("The user executing the script can't")
        || details.contains("no permissions to")
    {
        return Some(Error::PermissionDenied(format!("redis: {details}")));
    }
    // rustls reports a failed handshake as an I/O error carrying its own error.
    let handshake = [
        "InvalidCertificate",
        "invalid peer certificate",
        "CertificateRequired",
        "HandshakeFailure",
        "NoCertificatesPresented",
    ];
    if *e.kind() == ErrorKind::Tls || handshake.iter().any(|w| details.contains(w)) {
        return Some(Error::Tls(format!("redis: {details}")));
    }
    // The SELECT of the URL's database, refused during the connection's set-up: no
    // retry can fix it, and it is the caller's URL that is wrong, not the server's reach.
    if details.contains("DB index is out of range") {
        return Some(Error::InvalidUrl {
            url: "redis://host:port/DATABASE".to_owned(),
            reason: format!(
                "the server has no such database ({details}): the path of a redis URL is a \
                 database number below the server's `databases` setting (16 by default)"
            ),
        });
    }
    None
}

/// Checks `host:port` and returns it unchanged.
pub(crate) fn check_addr(addr: &str) -> Result<&str, Error> {
    let bad = |reason: &str| Error::InvalidUrl {
        url: addr.to_owned(),
        reason: reason.to_owned(),
    };
    let (host, port) = addr
        .rsplit_once(':')
        .ok_or_else(|| bad("expected host:port"))?;
    if host.is_empty() || host.contains(['/', '@', ',', ' ']) {
        return Err(bad("bad host"));
    }
    port.parse::<u16>()
        .ok()
        .filter(|p| *p != 0)
        .ok_or_else(|| bad("port must be a number in 1..=65535"))?;
    Ok(addr)
}

/// `host:port` addresses, checked, as (host, port) pairs.
fn host_ports(addrs: &[String]) -> Result<Vec<(String, u16)>, Error> {
    let mut hosts = Vec::with_capacity(addrs.len());
    for a in addrs {
        let (host, port) = check_addr(a)?
            .rsplit_once(':')
            .ok_or_else(|| Error::InvalidUrl {
                url: a.clone(),
                reason: "expected host:port".into(),
            })?;
        let port = port.parse::<u16>().map_err(|e| Error::InvalidUrl {
            url: a.clone(),
            reason: e.to_string(),
        })?;
        hosts.push((host.to_owned(), port));
    }
    Ok(hosts)
}

impl Node {
    /// Builds the clients and starts connecting them; does not wait for the connection.
    pub fn start(addr: &str, tuning: Tuning, access: &Access) -> Result<Node, Error> {
        let addr = check_addr(addr)?;
        let mut config =
            Config::from_url(&format!("redis://{addr}")).map_err(|e| Error::InvalidUrl {
                url: addr.to_owned(),
                reason: e.to_string(),
            })?;
        access.apply(&mut config);
        config.database = tuning.database;
        Self::start_with(addr.to_owned(), config, tuning, None)
    }

    /// Builds clients of the Redis Cluster that the seed nodes `seeds` (`host:port`
    /// each) belong to, and starts connecting them; does not wait.
    ///
    /// fred reads the slot map (`CLUSTER SLOTS`) from the first seed that answers and
    /// keeps one connection per master; a command goes to the master of its first key's
    /// slot and follows `MOVED` (re-reading the map) and `ASK` (during a slot
    /// migration) by itself. Every key and channel of one lock shares the lock's hash
    /// tag, so each script and each wake-up of a lock is on one slot, one master.
    pub fn start_cluster(seeds: &[String], tuning: Tuning, access: &Access) -> Result<Node, Error> {
        let hosts = host_ports(seeds)?;
        let mut config = Config {
            server: ServerConfig::new_clustered(hosts),
            ..Config::default()
        };
        access.apply(&mut config);
        Self::start_with(format!("cluster {}", seeds.join(",")), config, tuning, None)
    }

    /// A node on the application's own command client (bring your own client): dlock
    /// sends its commands over `client`'s connection and opens only its subscriber, with
    /// `client`'s configuration (server, TLS, credentials). A client configured for
    /// Sentinel gets the same failover watch as [`Node::start_sentinel`]; one configured
    /// for a Redis Cluster is used as [`Node::start_cluster`]'s.
    ///
    /// # Errors
    /// [`Error::Backend`] if fred cannot build the subscriber from `client`'s
    /// configuration.
    pub fn borrow(client: fred::prelude::Client, tuning: Tuning) -> Result<Node, Error> {
        let config = client.client_config();
        match &config.server {
            ServerConfig::Centralized { server } => {
                let addr = format!("{}:{}", server.host, server.port);
                Self::start_with(addr, config, tuning, Some(client))
            }
            ServerConfig::Sentinel {
                hosts,
                service_name,
                ..
            } => {
                let hosts: Vec<(String, u16)> =
                    hosts.iter().map(|h| (h.host.to_string(), h.port)).collect();
                let service = service_name.clone();
                let label = hosts
                    .iter()
                    .map(|(h, p)| format!("{h}:{p}"))
                    .collect::<Vec<_>>()
                    .join(",");
                let mut node = Self::start_with(
                    format!("sentinel {label}/{service}"),
                    config.clone(),
                    tuning,
                    Some(client),
                )?;
                if let Err(e) = node.watch_sentinels(hosts, &service, tuning, &config) {
                    node.abort_tasks();
                    return Err(e);
                }
                Ok(node)
            }
            ServerConfig::Clustered { hosts, .. } => {
                let label = hosts
                    .iter()
                    .map(|h| format!("{}:{}", h.host, h.port))
                    .collect::<Vec<_>>()
                    .join(",");
                Self::start_with(format!("cluster {label}"), config, tuning, Some(client))
            }
        }
    }

    /// Builds clients that find the primary of `service` through the Sentinels at
    /// `sentinels` (`host:port` each) and starts connecting them; does not wait.
    ///
    /// fred asks the Sentinels (in order, the first that answers) for the primary's
    /// address and checks its `ROLE` on every (re)connection, so after a failover both
    /// clients reconnect to the promoted replica: when the old primary dies its
    /// connections drop; when it stays up, the Sentinels' `+switch-master` announcement
    /// (see [`Node::watch_sentinel`]) or its first `READONLY` reply once demoted makes
    /// the clients reconnect (fred's `custom-reconnect-errors`).
    ///
    /// The Sentinels and the primary are reached with the same TLS settings and
    /// credentials (`access`).
    pub fn start_sentinel(
        sentinels: &[String],
        service: &str,
        tuning: Tuning,
        access: &Access,
    ) -> Result<Node, Error> {
        let label = format!("{}/{service}", sentinels.join(","));
        let hosts = host_ports(sentinels)?;
        let mut config = Config {
            server: ServerConfig::new_sentinel(hosts.clone(), service),
            ..Config::default()
        };
        access.apply(&mut config);
        let mut node = Self::start_with(format!("sentinel {label}"), config.clone(), tuning, None)?;
        if let Err(e) = node.watch_sentinels(hosts, service, tuning, &config) {
            node.abort_tasks();
            return Err(e);
        }
        Ok(node)
    }

    /// Builds the subscriber (and, unless `borrowed` is the application's client, the
    /// command client) from `config` and starts connecting what it built.
    fn start_with(
        addr: String,
        mut config: Config,
        tuning: Tuning,
        borrowed: Option<fred::prelude::Client>,
    ) -> Result<Node, Error> {
        // Keep retrying a server that is down at start-up too: a Redlock minority may come
        // back later, and a Sentinel group may be between primaries. The caller bounds the
        // wait with the connect timeout.
        config.fail_fast = false;
        let sharded = matches!(config.server, ServerConfig::Clustered { .. });
        // The subscriber speaks RESP3 so that it can also run the waiter's existence
        // check: sent after the SUBSCRIBE on the same connection, the server answers it
        // only once the subscription is in force, which saves the confirming PING and its
        // round trip ([`Node::pttl_after_subscribe`]). The command client stays on RESP2.
        let sub_config = Config {
            version: RespVersion::RESP3,
            ..config.clone()
        };
        let builder = |config: Config| builder(config, tuning);
        let owns_client = borrowed.is_none();
        let client = match borrowed {
            Some(client) => client,
            None => builder(config)
                .build()
                .map_err(|e| Error::backend(format!("configuring client for {addr}"), e))?,
        };
        let sub = builder(sub_config)
            .build_subscriber_client()
            .map_err(|e| Error::backend(format!("configuring subscriber for {addr}"), e))?;
        let mut conn_errors = vec![sub.error_rx()];
        let mut conn_tasks = vec![keep_routing(&sub, sharded, &addr)];
        if owns_client {
            conn_errors.push(client.error_rx());
            conn_tasks.push(keep_routing(&client, sharded, &addr));
        }
        let conn_errors = parking_lot::Mutex::new(conn_errors);
        let cmd = fred::types::config::Options {
            max_attempts: Some(1),
            timeout: Some(tuning.command_timeout),
            ..Default::default()
        };
        // R3: only a SubscriberClient that manages its subscriptions re-subscribes after a
        // reconnect. The handle ends when the client quits.
        let resubscriber = resubscribe_on_reconnect(&sub, addr.clone(), false);
        Ok(Node {
            addr,
            sharded,
            client,
            sub,
            cmd,
            owns_client,
            conn_tasks,
            resubscriber,
            watchers: Vec::new(),
            watcher_tasks: Vec::new(),
            switches: Arc::new(AtomicU64::new(0)),
            tryagains: AtomicU64::new(0),
            watching: Arc::new(tokio::sync::watch::Sender::new(0)),
            fence: Arc::new(tokio::sync::watch::Sender::new(None)),
            askers: Vec::new(),
            verified: Arc::new(parking_lot::Mutex::new(None)),
            reconnects: Arc::new(AtomicU64::new(0)),
            watcher_reconnects: Arc::new(AtomicU64::new(0)),
            check_refusal: Arc::new(parking_lot::Mutex::new(None)),
            conn_errors,
        })
    }

    /// The first refusal (credentials, permissions, TLS) among the connection errors
    /// seen since the last call.
    fn refused(&self) -> Option<Error> {
        let mut refusal = None;
        for rx in self.conn_errors.lock().iter_mut() {
            loop {
                use tokio::sync::broadcast::error::TryRecvError;
                let e = match rx.try_recv() {
                    Ok((e, _server)) => e,
                    // Attempts repeat every few ms: older ones may have been dropped.
                    Err(TryRecvError::Lagged(_)) => continue,
                    Err(TryRecvError::Empty | TryRecvError::Closed) => break,
                };
                tracing::debug!(addr = %self.addr, kind = ?e.kind(), error = %e, "redis connection attempt failed");
                if refusal.is_none() {
                    refusal = access_error(&e);
                }
            }
        }
        refusal
    }

    /// Waits until both clients are connected and, through Sentinel, found on the
    /// primary of the Sentinels' newest configuration ([`Node::check_primary`]) with one
    /// failover watch in force, or `deadline` passes.
    ///
    /// The watch is waited for so that a failover right after connecting is not missed:
    /// every Sentinel announces the switch, so one watch is enough. Without any, the
    /// clients still follow a failover, only later (a `READONLY` reply once the old
    /// primary is demoted), so a missing watch is a warning, not a failed connect.
    pub async fn wait_connected(&self, deadline: Instant) -> Result<(), Error> {
        self.wait_clients(deadline).await?;
        if self.watchers.is_empty() {
            return Ok(());
        }
        self.wait_checked(deadline).await?;
        let mut watching = self.watching.subscribe();
        let watched = tokio::time::timeout_at(deadline, watching.wait_for(|n| *n > 0));
        if !matches!(watched.await, Ok(Ok(_))) {
            tracing::warn!(
                service = %self.addr,
                "no Sentinel confirmed the failover watch in time; a failover is followed once the old primary refuses writes"
            );
        }
        Ok(())
    }

    async fn wait_clients(&self, deadline: Instant) -> Result<(), Error> {
        // `wait_for_connect` can miss a connection that completes between its state check
        // and its subscription, so poll in short slices.
        loop {
            if self.client.is_connected() && self.sub.is_connected() {
                return Ok(());
            }
            let now = Instant::now();
            if let Some(refusal) = self.refused() {
                return Err(refusal);
            }
            if now >= deadline {
                return Err(Error::Unreachable(format!(
                    "redis at {} did not accept a connection in time (client {:?}, subscriber {:?})",
                    self.addr,
                    self.client.state(),
                    self.sub.state()
                )));
            }
            let slice = (deadline - now).min(Duration::from_millis(50));
            let pending = if self.client.is_connected() {
                self.sub.wait_for_connect().await_in(slice).await
            } else {
                self.client.wait_for_connect().await_in(slice).await
            };
            if let Err(e) = &pending {
                // Retrying cannot fix refused credentials or a certificate that fails
                // verification: say so now instead of timing out as "unreachable".
                if let Some(typed) = e.as_ref().and_then(access_error) {
                    return Err(typed);
                }
                // Failed attempt: the reconnect policy retries; do not spin meanwhile.
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    }

    /// Stops both clients: QUIT if connected, then ends their connection tasks so that a
    /// client of an unreachable server stops reconnecting.
    pub async fn shutdown(&self) {
        let quit = async {
            let client = async {
                if self.owns_client {
                    let _ = self.client.quit().await;
                }
            };
            let _ = futures::join!(
                client,
                self.sub.quit(),
                futures::future::join_all(self.watchers.iter().map(|w| w.quit())),
                futures::future::join_all(self.askers.iter().map(|a| a.quit()))
            );
        };
        let _ = tokio::time::timeout(Duration::from_secs(1), quit).await;
        self.abort_tasks();
    }

    pub fn abort_tasks(&self) {
        for t in &self.conn_tasks {
            t.abort();
        }
        self.resubscriber.abort();
        for t in &self.watcher_tasks {
            t.abort();
        }
    }

    /// Runs `script` with EVALSHA, loading it on NOSCRIPT.
    ///
    /// On a cluster, a script refused because its slot is being migrated is sent again
    /// ([`Node::mid_move_retry`]), until the command timeout has passed since the first
    /// attempt. During a move (`redis-cli --cluster reshard`) the slot's keys are split
    /// between two nodes: the source answers `TRYAGAIN` to a command over keys it has only
    /// some of, and `ASK` once it has none; the target answers `TRYAGAIN` to a command
    /// sent there with `ASKING` unless it has every key. Every script of ours names three
    /// keys, and the sequence key of a non-Redlock queue never exists, so every script on
    /// that slot is refused until the slot is assigned, after which the source answers
    /// `MOVED`, which fred follows. Both refusals come before anything runs. fred's
    /// "Too many failed write attempts." does not always mean that, though: it fails
    /// with it, too, a command that was in flight on a connection it found broken while
    /// following another command's `MOVED`, which may have run; so the scripts are made
    /// safe to run twice: a tail enqueue returns the entry its ticket already has (see
    /// `scripts::ENQUEUE`), a read entry beside its writer is written under the same
    /// name again (only its token and the counter move), a second removal, renewal or
    /// abandon finds nothing more to do, and a release that ran twice may report its
    /// entry gone. Without the retry a
    /// routine topology change fails an acquire or a release and misses renewals.
    ///
    /// `request` builds the keys and arguments, once per command sent: fred takes them
    /// by value, so a request that is built in the closure (the uncontended acquire's
    /// and release's) is not copied for a retry that almost never comes (the copies
    /// took six allocations per uncontended acquire + release).
    pub async fn eval<R>(&self, what: &str, script: &Script, request: R) -> Result<Value, Error>
    where
        R: Fn() -> (Vec<String>, Vec<Value>) + Send + Sync,
    {
        self.pass_fence(what).await?;
        let ran = self
            .mid_move_retry(|| self.eval_once(script, &request))
            .await;
        self.check_landed(what)?;
        ran.map_err(|e| self.map_err(what, e))
    }

    /// The command client's connection right now, to tell later whether replies still
    /// come over it ([`Node::replicated`]).
    pub fn mark(&self) -> Mark {
        Mark {
            // Subscribed first: a reconnection after this point is either seen here or
            // already in the connection read below.
            reconnects: self.client.reconnect_rx(),
            connection: sentinel::connection(&self.client),
        }
    }

    /// Waits, at most `timeout`, until `replicas` replicas have every write the command
    /// connection made so far (`WAIT`): those of the scripts whose replies came before
    /// this call among them. `since` is that connection as [`Node::mark`] saw it before
    /// those scripts were sent: `WAIT` answers for its own connection's writes only, so
    /// if the client reconnected in between, its answer says nothing about them. A
    /// reconnection is told two ways: fred announces it before it sends any of our
    /// commands on the new connection (so before this `WAIT`; its own set-up commands
    /// come first), and the connection's server and `CLIENT ID` change (a connection
    /// without an ID never counts).
    ///
    /// `WAIT` holds back every later command of the connection while it waits (the
    /// server serves a client's commands in order), so `timeout` is kept short.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when fewer replicas acknowledged in time, or the
    /// connection changed: the writes do not count. As [`Node::eval`] when `WAIT` fails.
    pub async fn replicated(
        &self,
        what: &str,
        mut since: Mark,
        replicas: u32,
        timeout: Duration,
    ) -> Result<(), Error> {
        let ms = i64::try_from(timeout.as_millis())
            .unwrap_or(i64::MAX)
            .max(1);
        let acked: i64 = Box::pin(
            self.client
                .with_options(&self.cmd)
                .wait(i64::from(replicas), ms),
        )
        .await
        .map_err(|e| self.map_err(what, e))?;
        let now = sentinel::connection(&self.client);
        let announced = !matches!(
            since.reconnects.try_recv(),
            Err(tokio::sync::broadcast::error::TryRecvError::Empty)
        );
        let same =
            matches!((&since.connection, &now), (Some(a), Some(b)) if a == b && a.1.is_some());
        if announced || !same {
            return Err(Error::Unreachable(format!(
                "redis at {} while {what}: the replicas could not be asked about it (the connection changed, or has no CLIENT ID); it does not count",
                self.addr
            )));
        }
        if acked < i64::from(replicas) {
            return Err(Error::Unreachable(format!(
                "redis at {} while {what}: {acked} of the {replicas} replicas asked acknowledged it within {timeout:?}; it does not count",
                self.addr
            )));
        }
        Ok(())
    }

    /// Runs `attempt` once, and on a cluster again (after 5 ms, doubling up to 100 ms)
    /// while it is refused unrun because its slot is being migrated
    /// ([`refused_mid_move`]), until the command timeout has passed since the first try.
    async fn mid_move_retry<T, F, Fut>(&self, attempt: F) -> fred::prelude::FredResult<T>
    where
        F: Fn() -> Fut,
        Fut: std::future::Future<Output = fred::prelude::FredResult<T>>,
    {
        let started = tokio::time::Instant::now();
        let budget = self.cmd.timeout.unwrap_or(Duration::from_secs(5));
        let mut pause = TRYAGAIN_FIRST_PAUSE;
        loop {
            match attempt().await {
                Err(e)
                    if self.sharded
                        && refused_mid_move(&e)
                        && started.elapsed() + pause < budget =>
                {
                    tracing::debug!(cluster = %self.addr, error = %e, "slot being migrated; retrying");
                    self.tryagains.fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(TRYAGAIN_MAX_PAUSE);
                }
                other => return other,
            }
        }
    }

    /// One EVALSHA, and on NOSCRIPT one load and run of the script (on a cluster: an
    /// `EVAL`, which caches it on the slot's master).
    async fn eval_once<R>(&self, script: &Script, request: &R) -> Result<Value, fred::error::Error>
    where
        R: Fn() -> (Vec<String>, Vec<Value>) + Send + Sync,
    {
        // Not `Script::evalsha_with_reload`: it takes a bare client, without our options.
        let client = self.client.with_options(&self.cmd);
        let (keys, args) = request();
        // fred's command futures are about 7 KB: boxed here, where they are made, every
        // future that awaits this one stays small, instead of each level of the call
        // (and the backend seam's box) copying those kilobytes once more.
        let first =
            Box::pin(client.evalsha::<Value, _, _, _>(script.sha1().clone(), keys, args)).await;
        match first {
            Err(e) if e.details().starts_with("NOSCRIPT") => {
                // Our scripts are all built from their source, so it is always there.
                let Some(lua) = script.lua() else {
                    return Err(e);
                };
                let (keys, args) = request();
                if self.sharded {
                    // SCRIPT LOAD is not routed by key on a cluster (it would load the
                    // script on some node, perhaps not the slot's master): EVAL goes to
                    // the slot's master and caches the script there.
                    Box::pin(client.eval(lua.clone(), keys, args)).await
                } else {
                    Box::pin(client.script_load::<Value, _>(lua.clone())).await?;
                    Box::pin(client.evalsha(script.sha1().clone(), keys, args)).await
                }
            }
            other => other,
        }
    }

    /// The time `key` has left in ms (-1: no TTL), or `None` if it does not exist.
    ///
    /// On a cluster, retried as [`Node::eval`] while the slot is being migrated.
    pub async fn pttl(&self, key: &str) -> Result<Option<i64>, Error> {
        let n: i64 = self
            .mid_move_retry(|| {
                Box::pin(async { self.client.with_options(&self.cmd).pttl(key).await })
            })
            .await
            .map_err(|e| self.map_err("checking an entry", e))?;
        Ok((n != -2).then_some(n))
    }

    /// The time `key` has left in ms, as [`Node::pttl`], asked on the subscriber
    /// connection: the server runs it after every SUBSCRIBE sent before this call, so a
    /// removal it does not see is published to a subscription already in force (the
    /// confirmation [`Node::confirm_subscriptions`] gives, in the same round trip as the
    /// check). If the subscriber fails, asks on the command connection: the subscription
    /// is then in doubt anyway, and the waiter's re-check timer and reconnect wake-up
    /// cover it, as after a failed SUBSCRIBE.
    pub async fn pttl_after_subscribe(&self, key: &str) -> Result<Option<i64>, Error> {
        match Box::pin(self.sub.with_options(&self.cmd).pttl::<i64, _>(key)).await {
            Ok(n) => Ok((n != -2).then_some(n)),
            Err(e) => {
                tracing::debug!(master = %self.addr, error = %e, "existence check on the subscriber failed; asking the command connection");
                self.pttl(key).await
            }
        }
    }

    /// Sends SUBSCRIBE for `channel`. It is *not* in force yet: see
    /// [`Node::confirm_subscriptions`] and [`Node::pttl_after_subscribe`].
    ///
    /// On a cluster this is `SSUBSCRIBE` on the channel's slot (the master the waiter's
    /// existence check goes to next), and it *is* in force when it returns: fred waits
    /// for the server's confirmation of an `SSUBSCRIBE`, following `MOVED`.
    pub async fn subscribe(&self, channel: &str) -> Result<(), Error> {
        let sent = if self.sharded {
            // Refused unrun after a slot moved (`MOVED`, fred's map now re-read): again.
            self.mid_move_retry(|| Box::pin(self.sub.ssubscribe(channel)))
                .await
        } else {
            // Boxed as in `eval_once`: fred's futures are kilobytes.
            Box::pin(self.sub.subscribe(channel)).await
        };
        sent.map_err(|e| self.map_err("subscribing", e))
    }

    /// Returns once the server has processed every SUBSCRIBE sent before this call.
    ///
    /// fred resolves `subscribe` as soon as the command is *written* (its confirmation
    /// arrives out of band and is dropped), so a command sent next on the other
    /// connection, such as the waiter's existence check, could reach the server first,
    /// and a removal published between the two was never delivered (the benchmark's 1 s
    /// stalls). A PING on the subscriber connection is answered only after everything
    /// sent before it on that connection, the SUBSCRIBEs included.
    pub async fn confirm_subscriptions(&self) -> Result<(), Error> {
        Box::pin(self.sub.ping::<Value>(None))
            .await
            .map(|_| ())
            .map_err(|e| self.map_err("confirming a subscription", e))
    }

    /// Sends one UNSUBSCRIBE for all of `channels` (at least one).
    ///
    /// On a cluster, one `SUNSUBSCRIBE` per slot: the server refuses one whose channels
    /// are on different slots.
    pub async fn unsubscribe_all(&self, channels: &[String]) -> Result<(), Error> {
        if !self.sharded {
            return self
                .sub
                .unsubscribe(channels.to_vec())
                .await
                .map_err(|e| self.map_err("unsubscribing", e));
        }
        let groups = fred::util::group_by_hash_slot(channels.iter().map(String::as_str))
            .map_err(|e| self.map_err("unsubscribing", e))?;
        for (_, group) in groups {
            let group: Vec<String> = group.into_iter().filter_map(|k| k.into_string()).collect();
            self.sub
                .sunsubscribe(group)
                .await
                .map_err(|e| self.map_err("unsubscribing", e))?;
        }
        Ok(())
    }

    /// Maps a fred error: connection trouble and timeouts are [`Error::Unreachable`],
    /// everything else (a script error, a protocol surprise) is [`Error::Backend`].
    ///
    /// A server that is not (or not yet) a writable primary also counts as unreachable:
    /// `READONLY` (a demoted primary, before the client reconnected to the promoted
    /// replica), `LOADING` (a restart reading its data), `MASTERDOWN` (a replica cut off
    /// from its primary); on a cluster `CLUSTERDOWN` (slots without a master, during a
    /// failover), `TRYAGAIN` (a multi-key command during a slot migration) and a
    /// `MOVED`/`ASK` left over once fred's redirections ran out. Each is transient; the
    /// command was not applied.
    ///
    /// ACL refusals are typed: `WRONGPASS`/`NOAUTH` [`Error::Unauthenticated`], `NOPERM`
    /// (and a script's call refused by the ACL) [`Error::PermissionDenied`]; a TLS
    /// failure is [`Error::Tls`].
    pub fn map_err(&self, what: &str, e: fred::error::Error) -> Error {
        if let Some(typed) = access_error(&e) {
            return typed;
        }
        let transient = [
            "READONLY",
            "LOADING",
            "MASTERDOWN",
            "CLUSTERDOWN",
            "TRYAGAIN",
            "MOVED",
            "ASK",
        ];
        if transient.iter().any(|p| e.details().starts_with(p)) {
            return Error::Unreachable(format!("redis at {} while {what}: {e}", self.addr));
        }
        match e.kind() {
            ErrorKind::IO
            | ErrorKind::Timeout
            | ErrorKind::Canceled
            | ErrorKind::Routing
            | ErrorKind::Backpressure
            | ErrorKind::Cluster => {
                Error::Unreachable(format!("redis at {} while {what}: {e}", self.addr))
            }
            _ => Error::backend(format!("{what} on redis at {}", self.addr), e),
        }
    }

    /// On a cluster, the master that `key`'s slot is routed to in the command client's
    /// cached slot map, as `host:port (slot N)`.
    pub fn serving(&self, key: &str) -> Option<String> {
        use fred::interfaces::ClusterInterface as _;
        let slot = fred::util::redis_keyslot(key.as_bytes());
        let state = self.client.cached_cluster_state()?;
        let server = state.get_server(slot)?;
        Some(format!("{}:{} (slot {slot})", server.host, server.port))
    }

    /// Every key matching `pattern`: a full `SCAN` cursor walk over this master's
    /// keyspace, [`SCAN_COUNT`] keys a step. `SCAN` may return a key twice; the caller
    /// de-duplicates.
    pub async fn scan_keys(&self, pattern: &str) -> Result<Vec<String>, Error> {
        use futures::TryStreamExt;
        // On a cluster every master is walked (each holds its own slots' keys).
        let keys: Vec<fred::types::Key> = if self.sharded {
            self.client
                .scan_cluster_buffered(pattern.to_owned(), Some(SCAN_COUNT), None)
                .try_collect()
                .await
        } else {
            self.client
                .scan_buffered(pattern.to_owned(), Some(SCAN_COUNT), None)
                .try_collect()
                .await
        }
        .map_err(|e| self.map_err("listing the locks (SCAN)", e))?;
        Ok(keys.into_iter().filter_map(|k| k.into_string()).collect())
    }

    /// Calls `on_reconnect` after every reconnection of the command client (and the first
    /// connection), and `on_resubscribe` after every reconnection of the subscriber.
    pub fn on_reconnect(
        &self,
        on_reconnect: impl Fn() + Send + Sync + 'static,
        on_resubscribe: impl Fn() + Send + Sync + 'static,
    ) -> Vec<tokio::task::JoinHandle<fred::prelude::FredResult<()>>> {
        let on_reconnect = std::sync::Arc::new(on_reconnect);
        let on_resubscribe = std::sync::Arc::new(on_resubscribe);
        let a = self.client.on_reconnect(move |server| {
            let f = on_reconnect.clone();
            async move {
                tracing::info!(%server, "redis connection (re)established; re-checking live entries");
                f();
                Ok(())
            }
        });
        let b = self.sub.on_reconnect(move |server| {
            let f = on_resubscribe.clone();
            async move {
                tracing::debug!(%server, "subscriber (re)connected; waking waiters to re-check");
                f();
                Ok(())
            }
        });
        vec![a, b]
    }
}

impl Node {
    /// On a cluster, after every change of the slot map that either client saw (a
    /// failover, a slot moved; fred re-reads the map on `MOVED` and after reconnecting):
    /// renews the sharded subscriptions on the slots' new masters, then calls
    /// `on_change` (the backend re-checks its held entries and wakes its waiters). None
    /// on a single server.
    pub fn on_cluster_change(
        &self,
        on_change: impl Fn() + Send + Sync + 'static,
    ) -> Vec<tokio::task::JoinHandle<fred::prelude::FredResult<()>>> {
        if !self.sharded {
            return Vec::new();
        }
        let on_change = Arc::new(on_change);
        [self.client.cluster_change_rx(), self.sub.cluster_change_rx()]
            .into_iter()
            .map(|mut rx| {
                let (sub, f, addr) = (self.sub.clone(), on_change.clone(), self.addr.clone());
                tokio::spawn(async move {
                    use tokio::sync::broadcast::error::RecvError;
                    loop {
                        match rx.recv().await {
                            Ok(changes) => {
                                tracing::info!(cluster = %addr, ?changes, "the cluster's slot map changed; renewing subscriptions and re-checking held entries");
                            }
                            Err(RecvError::Lagged(_)) => {}
                            Err(RecvError::Closed) => return Ok(()),
                        }
                        f();
                        if let Err(e) = resubscribe_shards(&sub).await {
                            tracing::warn!(cluster = %addr, error = %e, "renewing sharded subscriptions failed; waiters fall back to their re-check timers");
                        }
                        f();
                    }
                })
            })
            .collect()
    }
}

/// Starts `client`'s connection (routing) task, and on a cluster starts it again
/// whenever it ends with an error: fred ends it, and every later command of the client
/// waits for its timeout, when it fails to follow an `ASK` ([`refused_mid_move`]), which
/// a slot migration causes. Commands in flight on the client then fail as after a
/// dropped connection. A task that ends without an error (QUIT) is not restarted; the
/// task is aborted with the node.
fn keep_routing<C>(client: &C, sharded: bool, addr: &str) -> ConnectHandle
where
    C: ClientLike + Clone + Send + Sync + 'static,
{
    if !sharded {
        return client.connect();
    }
    let (client, addr) = (client.clone(), addr.to_owned());
    tokio::spawn(async move {
        loop {
            match client.connect().await {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) if e.is_canceled() || *e.kind() == ErrorKind::Config => return Err(e),
                Ok(Err(e)) => {
                    tracing::debug!(cluster = %addr, error = %e, "fred ended the client's routing task; starting it again");
                }
                Err(join) => {
                    return Err(fred::error::Error::new(
                        ErrorKind::Unknown,
                        format!("routing task of {addr}: {join}"),
                    ))
                }
            }
            // A pause, so that a task that keeps ending at once is not restarted in a
            // busy loop.
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
}

/// Whether a command was refused, unrun, because its slot moved or is being moved, in
/// one of the three ways fred 10 reports it with one attempt per command (pitfall R1):
/// - `TRYAGAIN`: the node has only some of the keys the command names (a migration).
/// - "Too many failed write attempts.": the node answered `MOVED`; fred re-read the slot
///   map but, its one attempt spent, did not send the command again. fred gives the
///   same error to a command in flight on a connection that it found broken while it
///   re-read the map (it puts such commands back in its retry buffer, where their spent
///   attempt fails them): that command may have run, which is why every script is safe
///   to run twice (see [`Node::eval`]).
/// - "Max attempts reached.": the node answered `ASK` (a migration). fred sends the
///   command it was told to take elsewhere back to the slot's owner (it sets no target
///   node for it), so it cannot follow an `ASK` at all; with its attempts spent it
///   fails the command with this error (given nowhere else) *and ends the client's
///   routing task* ([`keep_routing`] starts it again). Following that `ASK` would not
///   help a script anyway: the target refuses it with `TRYAGAIN` until the move is
///   done, since the queue's sequence key, one of the three keys every script names,
///   never exists outside Redlock.
fn refused_mid_move(e: &fred::error::Error) -> bool {
    e.details().starts_with("TRYAGAIN")
        || (*e.kind() == ErrorKind::Unknown && e.details() == "Too many failed write attempts.")
        || (*e.kind() == ErrorKind::Routing && e.details() == "Max attempts reached.")
}

/// What fred's `manage_subscriptions` does (re-subscribe every tracked channel after each
/// (re)connection of `sub`), with our own logging: a re-subscription cancelled because
/// the client is quitting is routine (a short-lived CLI run quits right after its first
/// connection) and logged at debug; fred logs it as an error, a second line on the CLI's
/// one-line stderr. Other failures are warnings: the waiters' re-check timers cover them.
///
/// `one_by_one`: one `SUBSCRIBE` per channel (a Sentinel watcher: an ACL refuses a
/// `SUBSCRIBE` as a whole when one of its channels is not allowed, and `+switch-master`
/// must not go down with a refused fence channel).
fn resubscribe_on_reconnect(
    sub: &SubscriberClient,
    addr: String,
    one_by_one: bool,
) -> tokio::task::AbortHandle {
    let sub = sub.clone();
    let mut reconnects = sub.reconnect_rx();
    tokio::spawn(async move {
        while reconnects.recv().await.is_ok() {
            match resubscribe(&sub, one_by_one).await {
                Ok(()) => {}
                Err(e) if *e.kind() == ErrorKind::Canceled => {
                    tracing::debug!(master = %addr, error = %e, "re-subscription cancelled (the client is quitting)");
                }
                Err(e) => {
                    tracing::warn!(master = %addr, error = %e, "re-subscribing after a reconnect failed; waiters fall back to their re-check timers");
                }
            }
        }
    })
    .abort_handle()
}

/// Subscribes again to what `sub` tracks. Not fred's `resubscribe_all`: that sends
/// `SUBSCRIBE` and `PSUBSCRIBE` even with nothing to subscribe to, and the server's
/// "wrong number of arguments" error fails the whole call (or, on a connection that is
/// also running a command of ours, is taken as that command's answer).
async fn resubscribe(sub: &SubscriberClient, one_by_one: bool) -> fred::prelude::FredResult<()> {
    let channels = sub.tracked_channels();
    if one_by_one {
        let mut first_error = None;
        for channel in channels {
            if let Err(e) = sub.subscribe(channel).await {
                first_error.get_or_insert(e);
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
    } else if !channels.is_empty() {
        sub.subscribe(channels.into_iter().collect::<Vec<_>>())
            .await?;
    }
    let patterns = sub.tracked_patterns();
    if !patterns.is_empty() {
        sub.psubscribe(patterns.into_iter().collect::<Vec<_>>())
            .await?;
    }
    resubscribe_shards(sub).await
}

/// Sends `SSUBSCRIBE` again for every sharded channel `sub` tracks, one per channel (fred
/// never pipelines them: each waits for its confirmation, following `MOVED`). Also after
/// a slot changed masters: the old master pushes `sunsubscribe` for the slot's channels,
/// which fred drops without a word, so a subscription is renewed on the new master.
pub(crate) async fn resubscribe_shards(sub: &SubscriberClient) -> fred::prelude::FredResult<()> {
    for channel in sub.tracked_shard_channels() {
        sub.ssubscribe(channel).await?;
    }
    Ok(())
}

/// `timeout` as a method, to keep the connect loop readable.
/// `Err(None)`: the slice passed; `Err(Some(e))`: the attempt failed with `e`.
trait AwaitIn: std::future::Future<Output = fred::prelude::FredResult<()>> + Sized {
    async fn await_in(self, d: Duration) -> Result<(), Option<fred::error::Error>> {
        match tokio::time::timeout(d, self).await {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => Err(Some(e)),
            Err(_) => Err(None),
        }
    }
}

impl<F: std::future::Future<Output = fred::prelude::FredResult<()>>> AwaitIn for F {}
