//! [`EtcdBackend`]: the [`Backend`] trait on etcd v3.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Backend, Capability, Enqueued, Entry, EntryKind, Error, Gone, Hints, ListedQueue, NameRules,
    Position, QueuePath, Result, SessionOptions, Ticket, Woken,
};
use etcd_client::{
    Certificate, Client, ConnectOptions, GetOptions, GetResponse, Identity, LeaseClient, TlsOptions,
};
use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio::time::timeout;
use tracing::Instrument;

use crate::claims::Local;
use crate::errors::{diagnose_unreachable, map, retrying};
use crate::hubs::Hubs;
use crate::kv_pool::KvPool;
use crate::layout;
use crate::reads::{header_rev, holds_entry};
use crate::session::Session;
use crate::watches::Watches;

/// Why an etcd backend refuses [`SessionOptions::replicas`].
const ETCD_QUORUM: &str =
    "etcd answers a write only once a quorum of its members has it, whatever the setting";

/// The session TTL when [`SessionOptions::session_timeout`] is `None`: 60 s, the default
/// of etcd's Go `concurrency.NewSession` (`etcdctl lock` uses 10 s). A crashed holder
/// keeps its locks this long.
pub const DEFAULT_SESSION_TTL: Duration = Duration::from_secs(60);

/// A connection to an etcd cluster with one session (lease) on it.
///
/// Every entry this client creates is bound to its one lease, which a background task
/// renews every TTL/3. Cheap to share: wrap it in an [`Arc`] (as [`EtcdBackend::connect`]
/// does) and hand it to the recipes.
///
/// # Sessions
/// If the lease is lost (expired during a partition, revoked by someone else), every
/// entry on it reports [`Error::LockLost`] through [`Backend::lost`]; the next
/// `enqueue` grants a fresh lease, so the client stays usable. [`Backend::close`] revokes
/// the lease, which frees every lock of this client at once; dropping the last `Arc`
/// without `close` revokes it in the background.
pub struct EtcdBackend {
    pub(crate) kv: Arc<KvPool>,
    /// In front of every key (`?namespace=`; empty for none).
    pub(crate) namespace: String,
    /// Every watch of this client, multiplexed over one stream.
    pub(crate) watches: Watches,
    /// The queue watches kept armed between waits (`hubs.rs`).
    pub(crate) hubs: Hubs,
    /// Bounds the requests this client has in flight; see [`request`].
    pub(crate) in_flight: Arc<Semaphore>,
    lease: LeaseClient,
    pub(crate) endpoints: Vec<String>,
    ttl_requested: Duration,
    connect_timeout: Duration,
    pub(crate) request_timeout: Duration,
    pub(crate) session: parking_lot::Mutex<Arc<Session>>,
    /// Every session this client had, by lease id, so `lost` of an entry on an older
    /// session answers at once.
    sessions: parking_lot::Mutex<HashMap<i64, Arc<Session>>>,
    /// Serialises granting a new lease after a loss.
    renew: tokio::sync::Mutex<()>,
    pub(crate) local: parking_lot::Mutex<Local>,
    pub(crate) closed: AtomicBool,
    /// The highest cluster revision this client has seen; reads must not go back before it.
    pub(crate) seen_rev: AtomicI64,
    /// This backend, for the background tasks that must not keep it alive (`sweeps.rs`).
    pub(crate) me: std::sync::Weak<EtcdBackend>,
    /// How many sweeps run (`sweeps.rs`).
    pub(crate) sweeps: std::sync::atomic::AtomicUsize,
}

impl fmt::Debug for EtcdBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.session.lock().clone();
        f.debug_struct("EtcdBackend")
            .field("endpoints", &self.endpoints)
            .field("lease", &format_args!("{:x}", s.id()))
            .field("ttl", &s.ttl())
            .field("alive", &s.is_alive())
            .finish_non_exhaustive()
    }
}

/// How many requests one client has in flight at most. Requests beyond it wait for a
/// free slot before their time budget starts, so a thousand acquires queued at once on
/// one client are sent a few dozen at a time instead of all timing out together behind
/// each other.
const MAX_IN_FLIGHT: usize = 64;

/// The least time between two HTTP/2 pings on one connection. etcd counts a ping that
/// comes sooner than its `--grpc-keepalive-min-time` (5 s by default) after the last one,
/// on a connection it has sent nothing on since, as a strike, and at the third closes the
/// connection with GOAWAY `too_many_pings`, breaking every watch and keep-alive stream on
/// it. Pinging every third of a 2 s TTL did that about 3 s after every connect to a
/// member that carried only a quiet watch. A second above etcd's default keeps timer
/// jitter from counting as a strike.
const MIN_PING_INTERVAL: Duration = Duration::from_secs(6);

/// Runs one idempotent request with [`retrying`], once a slot of `limit` is free. The
/// budget counts from the moment the request is sent, not from when it was queued.
pub(crate) async fn request<T, F, Fut>(
    limit: &Semaphore,
    budget: Duration,
    op: F,
) -> std::result::Result<T, etcd_client::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, etcd_client::Error>>,
{
    // The semaphore is never closed; should it be, the request goes unthrottled.
    let _slot = limit.acquire().await.ok();
    retrying(budget, op).await
}

/// Adds TLS and authentication from `opts` to the client's connect options.
fn secure(mut co: ConnectOptions, opts: &SessionOptions) -> Result<ConnectOptions> {
    if let Some(tls) = &opts.tls {
        let read = |what: &str, path: &std::path::Path| {
            std::fs::read(path)
                .map_err(|e| Error::Tls(format!("reading {what} {}: {e}", path.display())))
        };
        let mut t = TlsOptions::new();
        t = match &tls.ca {
            Some(ca) => t.ca_certificate(Certificate::from_pem(read("the CA bundle", ca)?)),
            None => t.with_native_roots(),
        };
        if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
            t = t.identity(Identity::from_pem(
                read("the client certificate", cert)?,
                read("the client key", key)?,
            ));
        }
        if let Some(name) = &tls.server_name {
            t = t.domain_name(name.clone());
        }
        co = co.with_tls(t);
    }
    if let Some(c) = &opts.credentials {
        let user = c.user.clone().ok_or_else(|| Error::InvalidUrl {
            url: String::new(),
            reason: "etcd authenticates a user: give USER:PASSWORD@".into(),
        })?;
        co = co
            .with_user(user, c.password.expose())
            .with_auto_token_refresh(true);
    }
    Ok(co)
}

impl EtcdBackend {
    /// `wait_gone_detail` and `wait_gone_behind`: the wait, retried across broken
    /// watches, on a short queue watched whole (`wait_gone_tracking_once`).
    async fn gone_tracking(
        &self,
        q: &QueuePath,
        entry: &Entry,
        mine: Option<&Entry>,
    ) -> Result<Woken> {
        let span = tracing::debug_span!("etcd.wait_gone", lock = %q, entry = %entry.name, token = entry.token.map(|t| t.get()).unwrap_or(0));
        async move {
            let prefix = layout::queue_prefix(&self.namespace, q);
            let key = format!("{prefix}{}", entry.name);
            let woken = self
                .retry_watch(&key, || {
                    self.wait_gone_tracking_once(&prefix, &key, entry, mine)
                })
                .await?;
            tracing::debug!(gone = ?woken.gone, mine_queued = woken.mine_queued, "gone");
            Ok(woken)
        }
        .instrument(span)
        .await
    }

    /// Connects to the etcd cluster at `endpoints` (`host:port` or `http://host:port`; the
    /// client spreads requests over all of them and fails over when one dies) and grants
    /// the session's lease.
    ///
    /// The lease TTL is `opts.session_timeout` rounded up to whole seconds, or
    /// [`DEFAULT_SESSION_TTL`]; the server may raise it (to 1.5 × its election timeout),
    /// and [`Backend::session_timeout`] reports what it granted.
    ///
    /// With `opts.tls` the endpoints are dialled over TLS (`https`), verified against the
    /// given CA or the system roots, presenting the client certificate if one is given;
    /// with `opts.credentials` the client authenticates as that user and refreshes its
    /// token when the server expires it.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for an empty list or an endpoint the client cannot parse;
    /// [`Error::Unreachable`] if no endpoint answered within `opts.connect_timeout`;
    /// [`Error::Unauthenticated`] for credentials etcd refuses, [`Error::Tls`] for TLS
    /// files that cannot be read, a server certificate that fails verification, or a
    /// handshake the server refused (no client certificate where it requires one).
    pub async fn connect(endpoints: &[String], opts: SessionOptions) -> Result<Arc<EtcdBackend>> {
        let joined = endpoints.join(",");
        if endpoints.is_empty() || endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(Error::InvalidUrl {
                url: joined,
                reason: "expected a comma-separated list of host:port etcd endpoints".into(),
            });
        }
        opts.refuse_replicas(ETCD_QUORUM)?;
        let ttl = opts.session_timeout_or(DEFAULT_SESSION_TTL);
        let connect_timeout = opts.connect_limit();
        let request_timeout = connect_timeout.max(Duration::from_secs(5));
        // HTTP/2 pings find a dead server even on an idle watch or keep-alive stream,
        // which etcd-client would otherwise wait on forever; no more often than etcd
        // permits ([`MIN_PING_INTERVAL`]).
        let ping = (ttl / 3).clamp(MIN_PING_INTERVAL, Duration::from_secs(10));
        let ping_timeout = (ttl / 3).clamp(Duration::from_secs(1), Duration::from_secs(10));
        let co = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            .with_timeout(request_timeout)
            .with_keep_alive(ping, ping_timeout)
            .with_keep_alive_while_idle(true)
            // A member that lost its leader answers "no leader" at once instead of holding
            // the request until it times out; the request is then retried elsewhere.
            .with_require_leader(true);
        let co = secure(co, &opts)?;
        let span = tracing::debug_span!("etcd.connect", endpoints = %joined);
        let attempt = async {
            let mut client =
                Client::connect(endpoints, Some(co))
                    .await
                    .map_err(|e| match map(&joined, e) {
                        Error::Backend { source, .. } => Error::InvalidUrl {
                            url: joined.clone(),
                            reason: source.to_string(),
                        },
                        other => other,
                    })?;
            crate::server_version::warn_if_affected(&mut client).await;
            let session = Session::start(client.lease_client(), ttl).await?;
            Ok::<_, Error>((client, session))
        }
        .instrument(span);
        let why = match timeout(connect_timeout, attempt).await {
            Ok(Ok(connected)) => Ok(connected),
            Ok(Err(Error::Unreachable(why))) => Err(format!("etcd at {joined}: {why}")),
            Ok(Err(e)) => return Err(e),
            Err(_) => Err(format!(
                "no etcd endpoint of {joined} answered within {connect_timeout:?}"
            )),
        };
        // Over TLS, "unreachable" may be a handshake the server refused.
        let (client, session) = match why {
            Ok(connected) => connected,
            Err(why) => return Err(diagnose_unreachable(endpoints, &opts, why).await),
        };
        Ok(Self::assemble(
            &client,
            session,
            endpoints.to_vec(),
            &opts,
            request_timeout,
        ))
    }

    /// Builds the backend on the application's own etcd client (bring your own client):
    /// dlock's requests, watches and lease keep-alives share its connections, and its
    /// endpoints, TLS and credentials are the client's.
    ///
    /// **Who owns what.** The connection stays the application's: dlock never closes it,
    /// and [`Backend::close`] only revokes dlock's lease. The lease (the session every
    /// entry is attached to) is dlock's own, granted here with the TTL of
    /// `opts.session_timeout` (or [`DEFAULT_SESSION_TTL`]); `opts.tls` and
    /// `opts.credentials` are ignored (they are the client's). dlock puts its own
    /// timeout (`opts.connect_timeout`, at least 5 s) on each of its requests.
    ///
    /// **What dlock needs of the client.** Build it with HTTP/2 keep-alive
    /// (`ConnectOptions::with_keep_alive` and `with_keep_alive_while_idle(true)`), as
    /// [`EtcdBackend::connect`] does: without it, a watch on an idle connection to a
    /// server that died waits until the lease's own deadline fires the lost signal
    /// instead of failing over at once. The lost signal itself does not depend on it.
    ///
    /// # Errors
    /// [`Error::Unreachable`] if the lease is not granted within `opts.connect_timeout`;
    /// [`Error::Unauthenticated`] or [`Error::PermissionDenied`] if the client's user
    /// may not grant a lease.
    pub async fn from_client(client: Client, opts: SessionOptions) -> Result<Arc<EtcdBackend>> {
        opts.refuse_replicas(ETCD_QUORUM)?;
        let ttl = opts.session_timeout_or(DEFAULT_SESSION_TTL);
        let connect_timeout = opts.connect_limit();
        let request_timeout = connect_timeout.max(Duration::from_secs(5));
        let mut probe = client.clone();
        let attempt = async {
            crate::server_version::warn_if_affected(&mut probe).await;
            Session::start(client.lease_client(), ttl).await
        };
        let session = match timeout(connect_timeout, attempt).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Unreachable(format!(
                    "the application's etcd client did not grant a lease within {connect_timeout:?}"
                )))
            }
        };
        Ok(Self::assemble(
            &client,
            session,
            Vec::new(),
            &opts,
            request_timeout,
        ))
    }

    /// The backend around a connected client and its first session.
    fn assemble(
        client: &Client,
        session: Arc<Session>,
        endpoints: Vec<String>,
        opts: &SessionOptions,
        request_timeout: Duration,
    ) -> Arc<EtcdBackend> {
        let ttl = opts.session_timeout_or(DEFAULT_SESSION_TTL);
        let connect_timeout = opts.connect_limit();
        let mut sessions = HashMap::new();
        sessions.insert(session.id(), session.clone());
        Arc::new_cyclic(|me| EtcdBackend {
            kv: KvPool::new(client.kv_client()),
            namespace: opts.namespace.clone().unwrap_or_default(),
            watches: Watches::new(client.watch_client(), request_timeout),
            hubs: Hubs::default(),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            lease: client.lease_client(),
            endpoints,
            ttl_requested: ttl,
            connect_timeout,
            request_timeout,
            session: parking_lot::Mutex::new(session),
            sessions: parking_lot::Mutex::new(sessions),
            renew: tokio::sync::Mutex::new(()),
            local: parking_lot::Mutex::new(Local::default()),
            closed: AtomicBool::new(false),
            seen_rev: AtomicI64::new(0),
            me: me.clone(),
            sweeps: std::sync::atomic::AtomicUsize::new(0),
        })
    }

    /// The id of the current session's lease (etcd's mutex keys end in it, in hex).
    pub fn lease_id(&self) -> i64 {
        self.session.lock().id()
    }

    /// How many watch streams this client has opened: one for all its waits, unless a
    /// stream broke and was re-opened. For tests and diagnostics.
    pub fn watch_streams_opened(&self) -> u64 {
        self.watches.opened()
    }

    /// How many watches this client has asked the server for. Each wait arms one,
    /// except a mutex waiter's wait on a short queue, which joins the watch this client
    /// keeps on that queue (armed by the first such wait, cancelled a few seconds after
    /// the last). For tests and diagnostics.
    pub fn watches_armed(&self) -> u64 {
        self.watches.armed()
    }

    /// The session whose lease `entry` was created with, or the current one for an
    /// entry without a lease in its name: the one whose end is the entry's loss.
    fn entry_session(&self, entry: &Entry) -> Arc<Session> {
        layout::lease_of(entry)
            .and_then(|id| self.sessions.lock().get(&id).cloned())
            .unwrap_or_else(|| self.session.lock().clone())
    }

    /// The session of lease `id`, if this client had one.
    pub(crate) fn session_of(&self, id: i64) -> Option<Arc<Session>> {
        self.sessions.lock().get(&id).cloned()
    }

    /// The current session, granting a new lease if the last one was lost.
    pub(crate) async fn live_session(&self) -> Result<Arc<Session>> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let s = self.session.lock().clone();
        if s.is_alive() {
            return Ok(s);
        }
        let _renewing = self.renew.lock().await;
        let s = self.session.lock().clone();
        if s.is_alive() {
            return Ok(s);
        }
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        tracing::info!(old_lease = format_args!("{:x}", s.id()), reason = %s.dead_error(), "granting a new session lease");
        let new = match timeout(
            self.connect_timeout,
            Session::start(self.lease.clone(), self.ttl_requested),
        )
        .await
        {
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Unreachable(format!(
                    "no etcd endpoint answered a lease grant within {:?}",
                    self.connect_timeout
                )))
            }
        };
        *self.session.lock() = new.clone();
        self.sessions.lock().insert(new.id(), new.clone());
        Ok(new)
    }
}

impl Backend for EtcdBackend {
    fn kind(&self) -> &'static str {
        "etcd"
    }

    /// [`Capability::Proclaim`] only: etcd writes no revocation requests.
    fn supports(&self, capability: Capability) -> bool {
        capability == Capability::Proclaim
    }

    /// Go's `Election.Proclaim`: one transaction, a put guarded by the key's create
    /// revision (`crate::claims`).
    fn proclaim(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("etcd.proclaim", lock = %q, entry = %entry.name);
        self.proclaim_impl(q, entry, data).instrument(span)
    }

    /// A watch on the entry's key armed before one read (`crate::waits`), retried as
    /// `wait_gone` is.
    fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        let span = tracing::debug_span!("etcd.wait_data_changed", lock = %q, entry = %entry.name);
        async move {
            let key = format!("{}{}", layout::queue_prefix(&self.namespace, q), entry.name);
            let out = std::sync::Mutex::new(None);
            self.retry_watch(&key, || async {
                let r = self.wait_data_changed_once(&key, entry, seen).await?;
                if let Ok(mut slot) = out.lock() {
                    *slot = Some(r);
                }
                Ok(())
            })
            .await?;
            Ok(out
                .into_inner()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .flatten())
        }
        .instrument(span)
    }

    fn name_rules(&self) -> NameRules {
        crate::NAME_RULES
    }

    fn session_timeout(&self) -> Duration {
        self.session.lock().ttl()
    }

    fn hints(&self) -> Hints {
        // No `watch_ahead`: a listing here is a serializable read that does not wait
        // behind synced writes, so skipping it on a handoff gains little, and the extra
        // watch costs a server request per lock. Measured against one etcd, five
        // interleaved runs each: W2 median 371/s off vs 338/s on, server requests per
        // lock 4.06 vs 5.08; W5 704/s vs 669/s, 2.83 vs 2.88.
        // `atomic_enqueue_removing`: a transaction puts one key and deletes another
        // (`enqueue_removing` above), so a semaphore's lease and its mutex's handoff
        // are one synced write.
        // `ranked_semaphore`: no internal mutex, the first N entries of one queue hold:
        // a new key's create revision is above every existing key's, so it always sorts
        // last. Two synced writes per permit; the mutex layout measured at 0.58x-0.61x
        // the put + delete ceiling in W4, a mutex-free prototype at 2.8x
        // (docs/benchmarks.md, round eight).
        Hints::new(false, true).with_ranked_semaphore(true)
    }

    fn enqueue(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> impl Future<Output = Result<Enqueued>> + Send {
        let span =
            tracing::debug_span!("etcd.enqueue", lock = %q, kind = %kind, ticket = ticket.as_str());
        self.enqueue_impl(q, ticket, kind, at, data, None)
            .instrument(span)
    }

    /// One transaction: put the new entry's key (if absent) and delete `gone`'s key (if
    /// it still holds that very entry, by create revision), then read `q`. One synced
    /// write where enqueue + remove are two (Curator's semaphore order takes its lease
    /// and hands its internal mutex on with it; etcd's own semaphore is ranked and has no
    /// such mutex).
    fn enqueue_removing(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> impl Future<Output = Result<Entry>> + Send {
        let span = tracing::debug_span!("etcd.enqueue_removing", lock = %q, kind = %kind, ticket = ticket.as_str(), gone = %gone.name);
        async move {
            let enq = self
                .enqueue_impl(q, ticket, kind, Position::Tail, data, Some((gone_q, gone)))
                .await?;
            Ok(enq.mine)
        }
        .instrument(span)
    }

    async fn queue(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        let prefix = layout::queue_prefix(&self.namespace, q);
        Ok(self.read_queue(&prefix).await?.0)
    }

    async fn participants(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        let prefix = layout::queue_prefix(&self.namespace, q);
        self.read_queue_linearizable(&prefix).await
    }

    /// Range reads of the keys under the prefix at one revision (`reads.rs`): entries
    /// bound to the lease their name starts with, grouped by queue.
    async fn list_queues(&self, prefix: &str) -> Result<Vec<ListedQueue>> {
        self.list_queues_inner(prefix).await
    }

    /// One linearizable keys-only read of the entry's key (a lagging member must not
    /// vouch for a deleted entry), its create revision compared with the token.
    async fn contains(&self, q: &QueuePath, entry: &Entry) -> Result<bool> {
        let key = format!("{}{}", layout::queue_prefix(&self.namespace, q), entry.name);
        let resp: GetResponse = request(&self.in_flight, self.request_timeout, || {
            let key = key.as_str();
            self.kv
                .with(async move |kv| kv.get(key, Some(GetOptions::new().with_keys_only())).await)
        })
        .await
        .map_err(|e| map(&format!("looking up {key}"), e))?;
        self.observe(header_rev(resp.header()));
        Ok(holds_entry(&resp, &key, entry))
    }

    /// One read of the entry's key, served by any member that has reached every revision
    /// this client has seen (`fresh_get`), the deletes its watches reported included:
    /// serializable where that member is up to date, so no quorum round on a handoff. A
    /// member that has applied the delete the waiter was woken by has applied every
    /// earlier one, its own entry's included. (A waiter its whole-queue watch woke needs
    /// none: `wait_gone_behind`.)
    async fn still_queued(&self, q: &QueuePath, entry: &Entry) -> Result<bool> {
        let key = format!("{}{}", layout::queue_prefix(&self.namespace, q), entry.name);
        let resp = self
            .fresh_get(&key, GetOptions::new().with_keys_only(), 0)
            .await
            .map_err(|e| map(&format!("looking up {key}"), e))?;
        Ok(holds_entry(&resp, &key, entry))
    }

    fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("etcd.wait_gone", lock = %q, entry = %entry.name, token = entry.token.map(|t| t.get()).unwrap_or(0));
        async move {
            let key = format!("{}{}", layout::queue_prefix(&self.namespace, q), entry.name);
            self.retry_watch(&key, || self.wait_gone_once(&key, entry))
                .await
        }
        .instrument(span)
    }

    /// As `wait_gone`, and on a short queue watched whole, says whether `entry` went as
    /// the head ([`Gone::Head`]: the woken waiter then needs no listing). See
    /// `wait_gone_tracking_once` in `waits.rs`.
    async fn wait_gone_detail(&self, q: &QueuePath, entry: &Entry) -> Result<Gone> {
        self.gone_tracking(q, entry, None).await.map(|w| w.gone)
    }

    /// As `wait_gone_detail`, and on a short queue watched whole,
    /// [`Woken::mine_queued`] when the queue read showed the waiter's own entry and the
    /// watch's deletes after it, in order up to the one of `entry`, did not include it.
    async fn wait_gone_behind(&self, q: &QueuePath, entry: &Entry, mine: &Entry) -> Result<Woken> {
        self.gone_tracking(q, entry, Some(mine)).await
    }

    fn wait_changed(
        &self,
        q: &QueuePath,
        seen: &[Entry],
    ) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("etcd.wait_changed", lock = %q);
        async move {
            let prefix = layout::queue_prefix(&self.namespace, q);
            self.retry_watch(&prefix, || self.wait_changed_once(&prefix, seen))
                .await
        }
        .instrument(span)
    }

    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("etcd.remove", lock = %q, entry = %entry.name, token = entry.token.map(|t| t.get()).unwrap_or(0));
        async move {
            let key = format!("{}{}", layout::queue_prefix(&self.namespace, q), entry.name);
            let ticket = entry.ticket.as_deref();
            let deleted = match self.take_claim(&key, ticket, layout::lease_of(entry)) {
                Some(primary) => self.delete_claimed(&key, primary).await,
                None => false,
            };
            if !deleted {
                self.remove_exact(&key, entry.token).await?;
            }
            if let Some(p) = self.forget(ticket, &key) {
                if p.is_uncertain() {
                    self.sweep_later(&p, ticket.unwrap_or_default());
                }
            }
            tracing::debug!("removed");
            Ok(())
        }
        .instrument(span)
    }

    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("etcd.abandon", lock = %q, ticket = ticket.as_str());
        async move {
            let prefix = layout::queue_prefix(&self.namespace, q);
            let pending = self
                .local
                .lock()
                .tickets
                .get(ticket.as_str())
                .filter(|p| p.key.starts_with(&prefix))
                .cloned();
            let Some(mut p) = pending else {
                return Ok(());
            };
            // The enqueue's transaction may still be in flight; a delete sent now could
            // be applied before it and leave its key behind.
            // The wait is bounded, and the transaction can outlast it (queued for an
            // in-flight slot, or a last attempt started near its deadline): then it may
            // still land after the delete below, so its key is swept as after an
            // unanswered attempt.
            let answered = timeout(self.request_timeout, p.done.wait_for(|d| *d))
                .await
                .is_ok();
            // As in a release: the mutex key is retired while its delete is in flight,
            // and stays retired for the session unless one attempt was answered, since
            // an unanswered attempt may still land after a later claim of the key.
            let retired = p.primary && {
                let mut local = self.local.lock();
                match local.primary.get_mut(&p.key) {
                    Some(owner) if owner == ticket.as_str() => {
                        owner.clear();
                        true
                    }
                    _ => false,
                }
            };
            if !self.delete_claimed(&p.key, retired).await {
                request(&self.in_flight, self.request_timeout, || {
                    let key = p.key.clone();
                    self.kv.with(async move |kv| kv.delete(key, None).await)
                })
                .await
                .map_err(|e| map(&format!("abandoning {}", p.key), e))?;
            }
            self.forget(Some(ticket.as_str()), &p.key);
            if !answered || p.is_uncertain() {
                self.sweep_later(&p, ticket.as_str());
            }
            tracing::debug!(key = %p.key, "abandoned");
            Ok(())
        }
        .instrument(span)
    }

    fn lost(&self, _q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        Box::pin(self.entry_session(entry).lost())
    }

    /// The entry's session's state, read directly: a lost future's first poll may
    /// answer `Pending` to a task whose tokio budget is spent, even for a loss already
    /// known.
    fn lost_now(&self, _q: &QueuePath, entry: &Entry) -> Option<Error> {
        self.entry_session(entry).lost_now()
    }

    /// The session's lease, asked for its time to live: proves the server answers and
    /// the lease is there (a lost one is granted again first, as an acquire would), and
    /// needs no permission on any key.
    async fn health(&self) -> Result<()> {
        let session = self.live_session().await?;
        let mut lease = self.lease.clone();
        match timeout(self.request_timeout, lease.time_to_live(session.id(), None)).await {
            // -1 is a lease etcd no longer has; 0 one with under a second left (the
            // time left is cut to whole seconds), still there.
            Ok(Ok(r)) if r.ttl() >= 0 => Ok(()),
            Ok(Ok(_)) => Err(Error::LockLost(format!(
                "health check: the session's lease {:x} is gone",
                session.id()
            ))),
            Ok(Err(e)) => Err(map("health check", e)),
            Err(_) => Err(Error::Unreachable(format!(
                "health check: no etcd answer within {:?}",
                self.request_timeout
            ))),
        }
    }

    async fn close(&self) -> Result<()> {
        if self.closed.swap(true, Ordering::AcqRel) {
            return Ok(());
        }
        let current = self.session.lock().clone();
        let was_alive = current.is_alive();
        for s in self.sessions.lock().values() {
            s.mark_closed();
        }
        self.watches.close();
        if !was_alive {
            // Lost earlier: the lease is gone or being revoked by the keep-alive task.
            return Ok(());
        }
        let id = current.id();
        let revoked = retrying(self.request_timeout, || {
            let mut lease = self.lease.clone();
            async move { lease.revoke(id).await }
        })
        .await;
        match revoked {
            Ok(_) => Ok(()),
            Err(e) => match map("revoking the session lease", e) {
                Error::LockLost(_) => Ok(()),
                other => Err(other),
            },
        }
    }
}
