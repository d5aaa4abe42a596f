//! [`EtcdBackend`]: the [`Backend`] trait on etcd v3.

use std::collections::HashMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Backend, Enqueued, Entry, EntryKind, Error, Hints, NameRules, Position, QueuePath, Result,
    SessionOptions, Ticket,
};
use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, GetOptions, GetResponse, KvClient,
    LeaseClient, SortOrder, SortTarget, Txn, TxnOp, TxnOpResponse, WatchFilterType, WatchOptions,
};
use futures::future::BoxFuture;
use tokio::sync::{oneshot, watch, Semaphore};
use tokio::time::{sleep, timeout, Instant};
use tracing::Instrument;

use crate::errors::{map, retrying};
use crate::layout::{self, RawKv};
use crate::session::Session;
use crate::watches::{Watch, Watches};

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
    kv: KvClient,
    /// Every watch of this client, multiplexed over one stream.
    watches: Watches,
    /// Bounds the requests this client has in flight; see [`request`].
    in_flight: Arc<Semaphore>,
    lease: LeaseClient,
    endpoints: Vec<String>,
    ttl_requested: Duration,
    connect_timeout: Duration,
    request_timeout: Duration,
    session: parking_lot::Mutex<Arc<Session>>,
    /// Every session this client had, by lease id, so `lost` of an entry on an older
    /// session answers at once.
    sessions: parking_lot::Mutex<HashMap<i64, Arc<Session>>>,
    /// Serialises granting a new lease after a loss.
    renew: tokio::sync::Mutex<()>,
    local: parking_lot::Mutex<Local>,
    closed: AtomicBool,
    /// The highest cluster revision this client has seen; reads must not go back before it.
    seen_rev: AtomicI64,
}

/// What this client's own contenders have claimed, so that two of them never share a key
/// and a cancelled enqueue can be cleaned up.
#[derive(Default)]
struct Local {
    /// etcd's mutex key `NAME/<lease hex>` → the ticket using it. A lease has only one
    /// such key per name, so a second local contender on the same name takes a ticketed
    /// key instead (see the crate docs).
    primary: HashMap<String, String>,
    /// Ticket → the key its enqueue created, or may have created.
    tickets: HashMap<String, Pending>,
}

#[derive(Clone)]
struct Pending {
    key: String,
    primary: bool,
    lease: i64,
    /// Becomes `true` once the enqueue's transaction has been answered (or failed): only
    /// then can a delete not be overtaken by it.
    done: watch::Receiver<bool>,
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

/// How often `wait_gone` re-reads its key while its watch may still be unsynced.
const UNSYNCED_CHECK: Duration = Duration::from_millis(25);
/// How long `wait_gone` keeps re-reading (two reads). The server's catch-up loop syncs
/// a lagging watcher within 100 ms anyway; measured under W2 (8 workers, about 1 % of
/// watches unsynced), every delete a re-read found first was found by the 25 ms one, and
/// without the re-reads W2 lost a quarter of its rate to 100 ms stalls.
const UNSYNCED_WINDOW: Duration = Duration::from_millis(55);

/// How many requests one client has in flight at most. Requests beyond it wait for a
/// free slot before their time budget starts, so a thousand acquires queued at once on
/// one client are sent a few dozen at a time instead of all timing out together behind
/// each other.
const MAX_IN_FLIGHT: usize = 64;

/// Runs one idempotent request with [`retrying`], once a slot of `limit` is free. The
/// budget counts from the moment the request is sent, not from when it was queued.
async fn request<T, F, Fut>(
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

fn queue_read() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

/// Whether `resp` has `entry` under `key`: the key, created at the entry's token (a key
/// re-created under the same name has a newer create revision).
fn holds_entry(resp: &GetResponse, key: &str, entry: &Entry) -> bool {
    resp.kvs().iter().any(|kv| {
        let created = u64::try_from(kv.create_revision()).ok();
        kv.key() == key.as_bytes()
            && entry.token_matches(created.map(dlock_core::FencingToken::new))
    })
}

fn raw(kv: &etcd_client::KeyValue) -> RawKv<'_> {
    RawKv {
        key: kv.key(),
        value: kv.value(),
        create_revision: kv.create_revision(),
    }
}

fn header_rev(h: Option<&etcd_client::ResponseHeader>) -> i64 {
    h.map(|h| h.revision()).unwrap_or(0)
}

impl EtcdBackend {
    /// Connects to the etcd cluster at `endpoints` (`host:port` or `http://host:port`; the
    /// client spreads requests over all of them and fails over when one dies) and grants
    /// the session's lease.
    ///
    /// The lease TTL is `opts.session_timeout` rounded up to whole seconds, or
    /// [`DEFAULT_SESSION_TTL`]; the server may raise it (to 1.5 × its election timeout),
    /// and [`Backend::session_timeout`] reports what it granted.
    ///
    /// # Errors
    /// [`Error::InvalidUrl`] for an empty list or an endpoint the client cannot parse;
    /// [`Error::Unreachable`] if no endpoint answered within `opts.connect_timeout`.
    pub async fn connect(endpoints: &[String], opts: SessionOptions) -> Result<Arc<EtcdBackend>> {
        let joined = endpoints.join(",");
        if endpoints.is_empty() || endpoints.iter().any(|e| e.trim().is_empty()) {
            return Err(Error::InvalidUrl {
                url: joined,
                reason: "expected a comma-separated list of host:port etcd endpoints".into(),
            });
        }
        let ttl = opts.session_timeout.unwrap_or(DEFAULT_SESSION_TTL);
        let connect_timeout = opts.connect_timeout;
        let request_timeout = connect_timeout.max(Duration::from_secs(5));
        // HTTP/2 pings find a dead server even on an idle watch or keep-alive stream,
        // which etcd-client would otherwise wait on forever.
        let ping = (ttl / 3).clamp(Duration::from_millis(500), Duration::from_secs(10));
        let co = ConnectOptions::new()
            .with_connect_timeout(connect_timeout)
            .with_timeout(request_timeout)
            .with_keep_alive(ping, ping)
            .with_keep_alive_while_idle(true)
            // A member that lost its leader answers "no leader" at once instead of holding
            // the request until it times out; the request is then retried elsewhere.
            .with_require_leader(true);
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
        let (client, session) = match timeout(connect_timeout, attempt).await {
            Ok(Err(Error::Unreachable(why))) => {
                return Err(Error::Unreachable(format!("etcd at {joined}: {why}")))
            }
            Ok(r) => r?,
            Err(_) => {
                return Err(Error::Unreachable(format!(
                    "no etcd endpoint of {joined} answered within {connect_timeout:?}"
                )))
            }
        };
        let mut sessions = HashMap::new();
        sessions.insert(session.id(), session.clone());
        Ok(Arc::new(EtcdBackend {
            kv: client.kv_client(),
            watches: Watches::new(client.watch_client(), request_timeout),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            lease: client.lease_client(),
            endpoints: endpoints.to_vec(),
            ttl_requested: ttl,
            connect_timeout,
            request_timeout,
            session: parking_lot::Mutex::new(session),
            sessions: parking_lot::Mutex::new(sessions),
            renew: tokio::sync::Mutex::new(()),
            local: parking_lot::Mutex::new(Local::default()),
            closed: AtomicBool::new(false),
            seen_rev: AtomicI64::new(0),
        }))
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

    /// The current session, granting a new lease if the last one was lost.
    async fn live_session(&self) -> Result<Arc<Session>> {
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

    /// Picks the key for `ticket`'s entry and records it before anything is sent, so
    /// `abandon` finds it even if the enqueue future is dropped mid-flight.
    fn claim(
        &self,
        prefix: &str,
        ticket: &Ticket,
        kind: EntryKind,
        lease: i64,
        avoid_primary: bool,
    ) -> (String, bool, Option<watch::Receiver<bool>>) {
        let mut local = self.local.lock();
        if let Some(p) = local.tickets.get(ticket.as_str()) {
            if p.lease == lease && p.key.starts_with(prefix) && !(avoid_primary && p.primary) {
                // A retry with the same ticket: the same key, so the retry is idempotent.
                return (p.key.clone(), p.primary, Some(p.done.clone()));
            }
        }
        if let Some(old) = local.tickets.remove(ticket.as_str()) {
            if old.primary
                && local.primary.get(&old.key).map(String::as_str) == Some(ticket.as_str())
            {
                local.primary.remove(&old.key);
            }
        }
        let primary_key = format!("{prefix}{}", layout::entry_name(lease, ticket, kind, true));
        let primary =
            kind == EntryKind::Lock && !avoid_primary && !local.primary.contains_key(&primary_key);
        let key = if primary {
            local
                .primary
                .insert(primary_key.clone(), ticket.as_str().to_owned());
            primary_key
        } else {
            format!("{prefix}{}", layout::entry_name(lease, ticket, kind, false))
        };
        (key, primary, None)
    }

    /// `Some(primary)` if `key` is the key `ticket` claimed under the live session's
    /// lease and its enqueue has been answered: then no entry newer than the one to
    /// remove can exist under `key`, since only this client writes keys named after its
    /// lease, and it writes `key` again only after the claim is forgotten.
    ///
    /// A primary key (the only kind a later contender of this client can take again) is
    /// retired on the way: [`Self::delete_claimed`] frees it only once its delete is
    /// answered, so a second release of the same entry running meanwhile, or a plain
    /// delete dropped mid-flight, can never meet a newer entry under it.
    fn take_claim(&self, key: &str, ticket: Option<&str>, lease: Option<i64>) -> Option<bool> {
        let ticket = ticket?;
        let session = self.session.lock().clone();
        if lease != Some(session.id()) || !session.is_alive() {
            return None;
        }
        let mut local = self.local.lock();
        let primary = local
            .tickets
            .get(ticket)
            .filter(|p| p.key == key && p.lease == session.id() && *p.done.borrow())?
            .primary;
        if primary {
            match local.primary.get_mut(key) {
                Some(owner) if owner == ticket => owner.clear(),
                _ => return None,
            }
        }
        Some(primary)
    }

    /// Releases an entry [`Self::take_claim`] took with a plain delete, as etcd's own
    /// unlock does: no compare, so the server skips the read a transaction makes before
    /// it writes (measured: about a tenth of W1's server CPU per lock). One attempt
    /// only: a retry could let a lost first attempt land after the key is free again, on
    /// a newer entry. If the attempt fails, a primary key stays retired for this session
    /// (the delete may still land) and `false` tells the caller to remove the entry
    /// another way (a release: with the compare; an abandon: with retries, the key
    /// staying retired). `primary` is whether the caller retired the key for this call.
    async fn delete_claimed(&self, key: &str, primary: bool) -> bool {
        let attempt = async {
            let _slot = self.in_flight.acquire().await.ok();
            self.kv.clone().delete(key, None).await
        };
        let why = match timeout(self.request_timeout, attempt).await {
            Ok(Ok(resp)) => {
                self.observe(header_rev(resp.header()));
                if primary {
                    let mut local = self.local.lock();
                    if local.primary.get(key).is_some_and(String::is_empty) {
                        local.primary.remove(key);
                    }
                }
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.request_timeout),
        };
        tracing::debug!(key, error = %why, "plain delete got no answer; the key stays retired");
        false
    }

    /// Forgets what `ticket` claimed for `key`. A primary key retired by
    /// [`Self::take_claim`] stays retired.
    fn forget(&self, ticket: Option<&str>, key: &str) {
        let Some(ticket) = ticket else { return };
        let mut local = self.local.lock();
        if local.tickets.get(ticket).is_some_and(|p| p.key == key) {
            local.tickets.remove(ticket);
        }
        if local.primary.get(key).map(String::as_str) == Some(ticket) {
            local.primary.remove(key);
        }
    }

    async fn enqueue_impl(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        let writer = match at {
            Position::Tail => None,
            Position::Beside(e) if kind == EntryKind::Read => Some(e),
            Position::Beside(_) => {
                return Err(Error::WouldDeadlock(format!(
                    "only a read entry can be placed beside a held entry, not a {kind} entry"
                )))
            }
        };
        let prefix = layout::queue_prefix(q);
        let session = self.live_session().await?;
        let lease = session.id();
        let value = layout::encode_value(ticket, writer.map(|w| w.seq), data);
        // A downgrade's read entry may only sit beside a write that is still ours: the
        // same entry (its creation revision is its token) under this session's lease. A
        // write deleted from outside, or left under a lease this session replaced, fails
        // the transaction instead of leaving a read entry in a dead writer's place.
        let writer_check = match writer {
            None => None,
            Some(w) => {
                let Some(rev) = w.token.and_then(|t| i64::try_from(t.get()).ok()) else {
                    return Err(Error::LockLost(format!(
                        "the write entry {} to downgrade has no token",
                        w.name
                    )));
                };
                Some((format!("{prefix}{}", w.name), rev))
            }
        };
        let mut avoid_primary = false;
        let mut cleaned = false;
        loop {
            let (key, primary, previous) = self.claim(&prefix, ticket, kind, lease, avoid_primary);
            if let Some(mut prev) = previous {
                // Let an earlier attempt with this ticket land first, so that this one
                // finds its key instead of racing it.
                let _ = timeout(self.request_timeout, prev.wait_for(|d| *d)).await;
            }
            let (done_tx, done_rx) = watch::channel(false);
            self.local.lock().tickets.insert(
                ticket.as_str().to_owned(),
                Pending {
                    key: key.clone(),
                    primary,
                    lease,
                    done: done_rx,
                },
            );
            // etcd's Go Mutex in one round trip: create my key if it does not exist, and
            // read the queue. The else branch (my key exists: a retry whose first answer
            // was lost) reads the same queue, so retrying is idempotent.
            let put = etcd_client::PutOptions::new().with_lease(lease);
            let mut when = vec![Compare::create_revision(key.clone(), CompareOp::Equal, 0)];
            if let Some((wkey, rev)) = &writer_check {
                when.push(Compare::create_revision(
                    wkey.clone(),
                    CompareOp::Equal,
                    *rev,
                ));
                when.push(Compare::lease(wkey.clone(), CompareOp::Equal, lease));
            }
            let txn = Txn::new()
                .when(when)
                .and_then([
                    TxnOp::put(key.clone(), value.clone(), Some(put)),
                    TxnOp::get(prefix.clone(), Some(queue_read())),
                ])
                .or_else([TxnOp::get(prefix.clone(), Some(queue_read()))]);
            // The transaction runs in its own task: a dropped enqueue cannot cancel it
            // halfway, and `abandon` waits for its answer before deleting the key. (Polling
            // it in place and handing it to a task only when dropped was measured: no
            // faster in W1, and more context switches per lock.)
            let (tx, rx) = oneshot::channel();
            let kv = self.kv.clone();
            let budget = self.request_timeout;
            let limit = self.in_flight.clone();
            tokio::spawn(async move {
                let r = request(&limit, budget, || {
                    let (mut kv, txn) = (kv.clone(), txn.clone());
                    async move { kv.txn(txn).await }
                })
                .await;
                // `done` first: a release right after the answer must find it set.
                let _ = done_tx.send(true);
                let _ = tx.send(r);
            });
            let resp = rx
                .await
                .map_err(|_| Error::Closed)?
                .map_err(|e| map(&format!("enqueue on {q}"), e))?;
            self.observe(header_rev(resp.header()));
            let Some(get) = resp.op_responses().into_iter().find_map(|op| match op {
                TxnOpResponse::Get(g) => Some(g),
                _ => None,
            }) else {
                return Err(Error::backend(
                    format!("enqueue on {q}"),
                    "the transaction's answer has no queue read",
                ));
            };
            if let Some((wkey, rev)) = &writer_check {
                let ours = get.kvs().iter().any(|kv| {
                    kv.key() == wkey.as_bytes()
                        && kv.create_revision() == *rev
                        && kv.lease() == lease
                });
                if !ours {
                    // Only reachable when the transaction failed: it put nothing now (an
                    // earlier attempt's read entry, if any, is the caller's to abandon).
                    return Err(Error::LockLost(format!(
                        "the write entry {wkey} to downgrade is gone or no longer this session's"
                    )));
                }
            }
            let queue = layout::queue_from_kvs(&prefix, get.kvs().iter().map(raw));
            let name = &key[prefix.len()..];
            let Some(mine) = queue.iter().find(|e| e.name == name).cloned() else {
                return Err(Error::backend(
                    format!("enqueue on {q}"),
                    format!("the queue read does not contain the new key {key}"),
                ));
            };
            if !resp.succeeded() && mine.ticket.as_deref() != Some(ticket.as_str()) {
                // etcd's key for this lease exists, but another ticket wrote it, and no
                // local contender claims it (this ticket holds the claim): an orphan that
                // would hold the lock until the session ends. Delete exactly that entry
                // and try again; if that fails, queue under a ticketed key instead.
                if primary && !cleaned {
                    cleaned = true;
                    tracing::warn!(key = %key, token = mine.token.map(|t| t.get()).unwrap_or(0), "removing an orphaned entry under this lease's mutex key");
                    if self.remove_exact(&key, mine.token).await.is_ok() {
                        continue;
                    }
                }
                avoid_primary = true;
                continue;
            }
            tracing::debug!(
                queue = %q,
                entry = %mine.name,
                token = mine.token.map(|t| t.get()).unwrap_or(0),
                created = resp.succeeded(),
                "enqueued"
            );
            return Ok(Enqueued { mine, queue });
        }
    }

    /// Deletes `key` if it still holds the entry created at revision `token` (any entry
    /// under `key` if `token` is unknown). Never deletes a newer entry of the same name:
    /// a late retried release must not free someone else's lock.
    async fn remove_exact(&self, key: &str, token: Option<dlock_core::FencingToken>) -> Result<()> {
        let txn = match token.and_then(|t| i64::try_from(t.get()).ok()) {
            Some(rev) => Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, rev)])
                .and_then([TxnOp::delete(key, None)]),
            None => Txn::new().and_then([TxnOp::delete(key, None)]),
        };
        let resp = request(&self.in_flight, self.request_timeout, || {
            let (mut kv, txn) = (self.kv.clone(), txn.clone());
            async move { kv.txn(txn).await }
        })
        .await
        .map_err(|e| map(&format!("releasing {key}"), e))?;
        self.observe(header_rev(resp.header()));
        Ok(())
    }

    /// Remembers that the cluster has reached revision `rev`.
    fn observe(&self, rev: i64) {
        self.seen_rev.fetch_max(rev, Ordering::AcqRel);
    }

    /// A read that reflects at least revision `floor` and everything this client has seen
    /// (its own writes, the deletes its watches reported), retried on another endpoint if
    /// one is down.
    ///
    /// It is first served by whichever member gets it, without a quorum round
    /// (serializable); only if that member lags behind the floor is it repeated as a
    /// linearizable read. A view at or after my own entry's revision is safe for the
    /// driver: it lists every entry still ahead of mine (entries are only ever added
    /// behind), so it can make me wait longer, never let me in early.
    async fn fresh_get(
        &self,
        key: &str,
        opts: GetOptions,
        floor: i64,
    ) -> std::result::Result<GetResponse, etcd_client::Error> {
        let floor = floor.max(self.seen_rev.load(Ordering::Acquire));
        let read = |opts: GetOptions| {
            request(&self.in_flight, self.request_timeout, move || {
                let (mut kv, opts) = (self.kv.clone(), opts.clone());
                async move { kv.get(key, Some(opts)).await }
            })
        };
        let r = read(opts.clone().with_serializable()).await?;
        let rev = header_rev(r.header());
        if rev >= floor {
            self.observe(rev);
            return Ok(r);
        }
        let r = read(opts).await?;
        self.observe(header_rev(r.header()));
        Ok(r)
    }

    /// The queue as the cluster's quorum sees it now. Status output must show every
    /// entry that exists, even to a fresh client whose first serializable read could be
    /// served by a lagging member.
    async fn read_queue_linearizable(&self, prefix: &str) -> Result<Vec<Entry>> {
        let resp: GetResponse = request(&self.in_flight, self.request_timeout, move || {
            let mut kv = self.kv.clone();
            async move { kv.get(prefix, Some(queue_read())).await }
        })
        .await
        .map_err(|e| map(&format!("reading queue {prefix}"), e))?;
        self.observe(header_rev(resp.header()));
        Ok(layout::queue_from_kvs(prefix, resp.kvs().iter().map(raw)))
    }

    async fn read_queue(&self, prefix: &str) -> Result<(Vec<Entry>, i64)> {
        let resp: GetResponse = self
            .fresh_get(prefix, queue_read(), 0)
            .await
            .map_err(|e| map(&format!("reading queue {prefix}"), e))?;
        let rev = header_rev(resp.header());
        Ok((
            layout::queue_from_kvs(prefix, resp.kvs().iter().map(raw)),
            rev,
        ))
    }

    /// Arms a watch from "now" on `key` (a prefix if `prefix`) on the client's shared
    /// watch stream and waits for its `created` answer; returns the watch and the
    /// revision it starts after.
    ///
    /// Watching from now (no start revision) is what keeps the handoff fast: the server
    /// puts such a watcher in its *synced* group and sends it each event as it is
    /// committed, where a watch from a past revision (etcd's own Mutex) is served by the
    /// loop that catches up unsynced watchers every 100 ms.
    async fn arm(&self, key: &str, prefix: bool, no_put: bool) -> Result<(Watch, i64)> {
        if self.closed.load(Ordering::Acquire) {
            return Err(Error::Closed);
        }
        let mut opts = WatchOptions::new();
        if prefix {
            opts = opts.with_prefix();
        }
        if no_put {
            opts = opts.with_filters([WatchFilterType::NoPut]);
        }
        let opened = timeout(self.request_timeout, async {
            let mut w = self
                .watches
                .watch(key, opts)
                .await
                .map_err(|e| map(&format!("watching {key}"), e))?;
            match w.message().await {
                Some(m) if m.created() && !m.canceled() => Ok((w, header_rev(m.header()))),
                Some(m) => Err(Error::backend(
                    format!("watching {key}"),
                    format!("watch refused: {}", m.cancel_reason()),
                )),
                None => Err(Error::Unreachable(format!(
                    "watching {key}: stream closed before the watch was created"
                ))),
            }
        })
        .await;
        match opened {
            Ok(r) => r,
            Err(_) => Err(Error::Unreachable(format!(
                "watching {key}: no answer within {:?}",
                self.request_timeout
            ))),
        }
    }

    /// True if a read answered at `read_rev`, sent after the `created` answer of a watch
    /// that starts after `watch_rev`, proves that watch synced (see [`Self::wait_gone_once`]).
    fn proves_synced(&self, read_rev: i64, watch_rev: i64) -> bool {
        // Revisions of two members are only comparable this way on one member.
        self.endpoints.len() == 1 && read_rev == watch_rev
    }

    /// One attempt of `wait_gone`: `Ok` once the entry is gone.
    ///
    /// Costs one watch create on the shared stream and one read; a waiter that stays
    /// queued costs nothing more until its predecessor goes.
    async fn wait_gone_once(&self, key: &str, entry: &Entry) -> Result<()> {
        let exists = |r: &GetResponse| holds_entry(r, key, entry);
        // Arm the watch first, then read the key at or after the revision the watch
        // starts after: a delete is then either in the read or reported by the watch.
        let (mut watch, watch_rev) = self.arm(key, false, true).await?;
        let read = self
            .fresh_get(key, GetOptions::new(), watch_rev)
            .await
            .map_err(|e| map(&format!("reading {key}"), e))?;
        if !exists(&read) {
            return Ok(());
        }
        // The server starts a watch from "now" as synced, unless a write lands between the
        // moment it reads its revision and the moment it registers the watcher; such a
        // watcher is caught up by the 100 ms loop, and a delete in that gap would reach
        // us up to 100 ms late, stalling every waiter behind us. If the read shows that
        // nothing was written since the watch's start, it is synced; otherwise two cheap
        // reads, 25 and 50 ms in, bound that stall without waiting on the loop.
        let now = Instant::now();
        let mut next_check = now + UNSYNCED_CHECK;
        let last_check = if self.proves_synced(header_rev(read.header()), watch_rev) {
            now
        } else {
            now + UNSYNCED_WINDOW
        };
        loop {
            let msg = tokio::select! {
                m = watch.message() => m,
                _ = tokio::time::sleep_until(next_check), if next_check <= last_check => {
                    next_check += UNSYNCED_CHECK;
                    let r = self
                        .fresh_get(key, GetOptions::new(), watch_rev)
                        .await
                        .map_err(|e| map(&format!("reading {key}"), e))?;
                    if !exists(&r) {
                        tracing::debug!(target: "dlock_etcd::unsynced", key, "delete found by a re-read before the watch reported it");
                        return Ok(());
                    }
                    continue;
                }
            };
            match msg {
                Some(m) => {
                    self.observe(header_rev(m.header()));
                    if m.canceled() {
                        return Err(Error::Unreachable(format!(
                            "watch on {key} cancelled by the server (compacted at {}): {}",
                            m.compact_revision(),
                            m.cancel_reason()
                        )));
                    }
                    if m.events()
                        .iter()
                        .any(|e| e.event_type() == EventType::Delete)
                    {
                        return Ok(());
                    }
                }
                None => return Err(Error::Unreachable(format!("watch on {key}: stream closed"))),
            }
        }
    }

    /// One attempt of `wait_changed`.
    async fn wait_changed_once(&self, prefix: &str, seen: &[Entry]) -> Result<()> {
        let same = |q: &[Entry]| {
            q.len() == seen.len()
                && q.iter()
                    .all(|e| seen.iter().any(|s| s.name == e.name && s.token == e.token))
        };
        let (mut watch, watch_rev) = self.arm(prefix, true, false).await?;
        let resp = self
            .fresh_get(prefix, queue_read(), watch_rev)
            .await
            .map_err(|e| map(&format!("reading queue {prefix}"), e))?;
        let queue = layout::queue_from_kvs(prefix, resp.kvs().iter().map(raw));
        if !same(&queue) {
            return Ok(());
        }
        loop {
            match watch.message().await {
                Some(m) => {
                    self.observe(header_rev(m.header()));
                    if m.canceled() {
                        return Err(Error::Unreachable(format!(
                            "watch on {prefix} cancelled by the server (compacted at {}): {}",
                            m.compact_revision(),
                            m.cancel_reason()
                        )));
                    }
                    // Only keys directly in the queue count; a sub-queue's traffic does not.
                    let relevant = m.events().iter().any(|e| {
                        e.kv().is_some_and(|kv| {
                            kv.key()
                                .strip_prefix(prefix.as_bytes())
                                .and_then(|n| std::str::from_utf8(n).ok())
                                .and_then(layout::parse_name)
                                .is_some()
                        })
                    });
                    if relevant {
                        return Ok(());
                    }
                }
                None => {
                    return Err(Error::Unreachable(format!(
                        "watch on {prefix}: stream closed"
                    )))
                }
            }
        }
    }

    /// Retries a watch attempt after transient failures (a broken stream, a server that
    /// went away, a compaction) for up to one session TTL; the caller's `lost` fires first
    /// if the outage outlives the session.
    async fn retry_watch<'a, F, Fut>(&'a self, what: &str, mut attempt: F) -> Result<()>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<()>> + 'a,
    {
        let started = Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            match attempt().await {
                Ok(()) => return Ok(()),
                Err(e @ Error::Unreachable(_)) if started.elapsed() < self.session.lock().ttl() => {
                    tracing::debug!(what, error = %e, "watch failed; re-arming");
                    sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Backend for EtcdBackend {
    fn kind(&self) -> &'static str {
        "etcd"
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
        Hints::default()
    }

    fn enqueue<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        at: Position<'a>,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<Enqueued>> {
        let span =
            tracing::debug_span!("etcd.enqueue", lock = %q, kind = %kind, ticket = ticket.as_str());
        Box::pin(
            self.enqueue_impl(q, ticket, kind, at, data)
                .instrument(span),
        )
    }

    fn queue<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            let prefix = layout::queue_prefix(q);
            Ok(self.read_queue(&prefix).await?.0)
        })
    }

    fn participants<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(async move {
            let prefix = layout::queue_prefix(q);
            self.read_queue_linearizable(&prefix).await
        })
    }

    /// One linearizable keys-only read of the entry's key (a lagging member must not
    /// vouch for a deleted entry), its create revision compared with the token.
    fn contains<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let key = format!("{}{}", layout::queue_prefix(q), entry.name);
            let resp: GetResponse = request(&self.in_flight, self.request_timeout, || {
                let mut kv = self.kv.clone();
                let key = key.as_str();
                async move { kv.get(key, Some(GetOptions::new().with_keys_only())).await }
            })
            .await
            .map_err(|e| map(&format!("looking up {key}"), e))?;
            self.observe(header_rev(resp.header()));
            Ok(holds_entry(&resp, &key, entry))
        })
    }

    fn wait_gone<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("etcd.wait_gone", lock = %q, entry = %entry.name, token = entry.token.map(|t| t.get()).unwrap_or(0));
        Box::pin(
            async move {
                let key = format!("{}{}", layout::queue_prefix(q), entry.name);
                self.retry_watch(&key, || self.wait_gone_once(&key, entry))
                    .await
            }
            .instrument(span),
        )
    }

    fn wait_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        seen: &'a [Entry],
    ) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("etcd.wait_changed", lock = %q);
        Box::pin(
            async move {
                let prefix = layout::queue_prefix(q);
                self.retry_watch(&prefix, || self.wait_changed_once(&prefix, seen))
                    .await
            }
            .instrument(span),
        )
    }

    fn remove<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("etcd.remove", lock = %q, entry = %entry.name, token = entry.token.map(|t| t.get()).unwrap_or(0));
        Box::pin(
            async move {
                let key = format!("{}{}", layout::queue_prefix(q), entry.name);
                let ticket = entry.ticket.as_deref();
                let deleted = match self.take_claim(&key, ticket, layout::lease_of(entry)) {
                    Some(primary) => self.delete_claimed(&key, primary).await,
                    None => false,
                };
                if !deleted {
                    self.remove_exact(&key, entry.token).await?;
                }
                self.forget(ticket, &key);
                tracing::debug!("removed");
                Ok(())
            }
            .instrument(span),
        )
    }

    fn abandon<'a>(&'a self, q: &'a QueuePath, ticket: &'a Ticket) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("etcd.abandon", lock = %q, ticket = ticket.as_str());
        Box::pin(
            async move {
                let prefix = layout::queue_prefix(q);
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
                let _ = timeout(self.request_timeout, p.done.wait_for(|d| *d)).await;
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
                        let (mut kv, key) = (self.kv.clone(), p.key.clone());
                        async move { kv.delete(key, None).await }
                    })
                    .await
                    .map_err(|e| map(&format!("abandoning {}", p.key), e))?;
                }
                self.forget(Some(ticket.as_str()), &p.key);
                tracing::debug!(key = %p.key, "abandoned");
                Ok(())
            }
            .instrument(span),
        )
    }

    fn lost(&self, _q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        let session = layout::lease_of(entry)
            .and_then(|id| self.sessions.lock().get(&id).cloned())
            .unwrap_or_else(|| self.session.lock().clone());
        Box::pin(session.lost())
    }

    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
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
        })
    }
}
