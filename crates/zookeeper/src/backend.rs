//! [`ZkBackend`]: the [`Backend`] trait on one ZooKeeper session.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::entry::sort_queue;
use dlock_core::{
    Backend, Capability, Enqueued, Entry, EntryKind, Error, FencingToken, Gone, Hints, ListedQueue,
    NameRules, Position, QueuePath, Result, Ticket, Woken,
};
use futures::future::BoxFuture;
use futures::FutureExt as _;
use tracing::Instrument;
use zookeeper_client as zk;

use crate::errors::{is_connection_loss, map_err};
use crate::session::{remove_tracked, Health, Shared};

/// The session timeout asked for when [`dlock_core::SessionOptions::session_timeout`] is `None`.
///
/// Ten seconds: long enough to ride out a leader election and a GC pause, short enough
/// that a crashed holder's locks free up quickly. The server clamps whatever is asked to
/// `[2, 20] × tickTime` (4–40 s with the default tickTime of 2 s); the negotiated value
/// is what [`Backend::session_timeout`] reports.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How often an idempotent request is re-sent after the connection dropped. Each retry waits for
/// the client to reconnect (zookeeper-client queues requests meanwhile), and the session
/// guard ends the wait once the session is declared lost, so a few cover any failover.
const MAX_RETRIES: usize = 4;

/// Runs an idempotent request again when the connection dropped before its reply came:
/// a leader failover or a server restart then costs a wait, not an error.
pub(crate) async fn retry<T, F, Fut>(mut request: F) -> Result<T, zk::Error>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, zk::Error>>,
{
    let mut left = MAX_RETRIES;
    loop {
        match request().await {
            Err(err) if left > 0 && is_connection_loss(&err) => {
                left -= 1;
                tracing::debug!(%err, "ZooKeeper connection lost before the reply; re-sending");
            }
            other => return other,
        }
    }
}

/// A [`Backend`] on one ZooKeeper session, laid out as Apache Curator 5 lays out its
/// locks, so Java services using Curator and dlock users share the same queues.
///
/// Every entry is an ephemeral znode of this session: closing the backend, dropping it, or
/// losing the session removes them all. Cloning is done through the `Arc` that
/// [`ZkBackend::connect`] returns; one backend serves any number of locks and tasks.
#[derive(Debug)]
pub struct ZkBackend {
    pub(crate) shared: Arc<Shared>,
    pub(crate) states: zk::StateWatcher,
    pub(crate) session_timeout: Duration,
    pub(crate) session_id: zk::SessionId,
    pub(crate) watcher: tokio::task::AbortHandle,
    /// The leader heartbeat ([`crate::heartbeat`]); aborted on drop like `watcher`.
    pub(crate) heartbeat: tokio::task::AbortHandle,
    /// The ACL of every node this backend creates ([`crate::security::acls`]).
    pub(crate) acls: zk::Acls<'static>,
}

impl Drop for ZkBackend {
    fn drop(&mut self) {
        // The task holds only a weak reference; abort it so it does not wait forever on
        // a state watcher of a session nobody uses.
        self.watcher.abort();
        self.heartbeat.abort();
    }
}

impl ZkBackend {
    /// The underlying zookeeper-client handle, for what the trait does not cover (guarded
    /// writes with `new_check_writer`, inspecting the tree). It shares this session:
    /// entries it creates are ephemeral to the same session, and holding it keeps the
    /// session open after [`Backend::close`] until it is dropped. The same holds after a
    /// lost signal: dlock then gives up its own handle so that the session ends, but a
    /// session the server still keeps (the signal can fire on a stall shorter than the
    /// timeout) stays open with dlock's entries in it, blocking other contenders, for as
    /// long as a handle taken here lives. Drop it when the lock is lost.
    ///
    /// # Errors
    /// [`Error::LockLost`] or [`Error::Closed`] once the session is over.
    pub fn client(&self) -> Result<zk::Client> {
        self.handle().map(|c| zk::Client::clone(&c))
    }

    /// The ZooKeeper session id, as the server's `cons` command and `ephemeralOwner` show it.
    pub fn session_id(&self) -> i64 {
        self.session_id.0
    }

    pub(crate) fn handle(&self) -> Result<Arc<zk::Client>> {
        let client = self.shared.client.lock().clone();
        match client {
            Some(client) => Ok(client),
            None => Err(self.shared.error().unwrap_or(Error::Closed)),
        }
    }

    /// Runs `op` unless the session is over, and abandons it with the session's error as
    /// soon as the session is declared lost: zookeeper-client queues requests while
    /// disconnected, so without this a partitioned caller would hang instead of failing.
    async fn guarded<T>(&self, op: impl Future<Output = Result<T>>) -> Result<T> {
        let mut health = self.shared.health.subscribe();
        tokio::select! {
            biased;
            verdict = health.wait_for(|h| *h != Health::Live) => {
                let err = verdict.ok().and_then(|h| h.error());
                Err(err.unwrap_or(Error::Closed))
            }
            result = op => result,
        }
    }
}

impl Backend for ZkBackend {
    fn kind(&self) -> &'static str {
        "zk"
    }

    fn name_rules(&self) -> NameRules {
        crate::NAME_RULES
    }

    fn session_timeout(&self) -> Duration {
        self.session_timeout
    }

    fn hints(&self) -> Hints {
        // A listing queues behind pending synced writes on the server, so a handoff that
        // needs none is faster; `enqueue_removing` is one multi.
        Hints::new(true, true)
    }

    /// Both: an entry's payload is its znode's data, watched with a data watch; a
    /// shared value is the data of the queue's znode (Curator's layouts).
    fn supports(&self, capability: Capability) -> bool {
        matches!(
            capability,
            Capability::Revocation | Capability::SharedValue | Capability::Proclaim
        )
    }

    fn enqueue(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> impl Future<Output = Result<Enqueued>> + Send {
        let span = tracing::debug_span!("zk.enqueue", queue = %q, %kind, ticket = ticket.as_str());
        async move {
            self.shared.track(ticket.as_str());
            let result = self
                .guarded(self.enqueue_inner(q, ticket, kind, at, data))
                .await;
            match &result {
                Ok(done) => tracing::debug!(
                    entry = %done.mine.name,
                    token = ?done.mine.token.map(FencingToken::get),
                    queue_len = done.queue.len(),
                    "enqueued"
                ),
                Err(err) => tracing::debug!(%err, "enqueue failed"),
            }
            result
        }
        .instrument(span)
    }

    fn enqueue_removing(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> impl Future<Output = Result<Entry>> + Send {
        let span = tracing::debug_span!("zk.enqueue_removing", queue = %q, %kind, ticket = ticket.as_str(), gone = %gone.name);
        async move {
            self.shared.track(ticket.as_str());
            let result = self
                .guarded(self.enqueue_removing_inner(q, ticket, kind, data, gone_q, gone))
                .await;
            match &result {
                Ok(mine) => {
                    self.shared.untrack(&gone.name);
                    tracing::debug!(entry = %mine.name, "enqueued, handed on")
                }
                Err(err) => tracing::debug!(%err, "enqueue_removing failed"),
            }
            result
        }
        .instrument(span)
    }

    fn queue(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        self.guarded(async move {
            let client = self.handle()?;
            let parent = znode(q);
            match retry(|| client.list_children(&parent)).await {
                Ok(names) => Ok(parse_queue(names)),
                Err(zk::Error::NoNode) => Ok(Vec::new()),
                Err(err) => Err(map_err("listing the queue", err)),
            }
        })
    }

    /// One `exists` of the entry's node, its czxid compared with the token. Like every
    /// ZooKeeper read it is answered by the server this session is connected to, which
    /// may trail the leader by the commits in flight; the session itself is what
    /// vouches for the entry in between.
    fn contains(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<bool>> + Send {
        self.guarded(async move {
            let client = self.handle()?;
            let parent = znode(q);
            // The session's server may be a follower that trails the leader (or is cut off
            // from it and does not know yet): without a sync it would say "still there" about
            // an entry the leader already deleted. A sync completes only through the leader.
            let path = format!("{parent}/{}", entry.name);
            // Both sent at once: a server answers one session's requests in order, so the
            // `exists` is answered after the sync (ZooKeeper's own sync-then-read idiom),
            // in one round trip. After a dropped connection, one after the other.
            let stat = match futures::future::join(client.sync(&parent), client.check_stat(&path))
                .await
            {
                (Ok(()) | Err(zk::Error::NoNode), Ok(stat)) => Ok(stat),
                (Err(err), _) if !is_connection_loss(&err) && err != zk::Error::NoNode => {
                    return Err(map_err("syncing before looking up an entry", err))
                }
                _ => {
                    match retry(|| client.sync(&parent)).await {
                        Ok(()) | Err(zk::Error::NoNode) => {}
                        Err(err) => return Err(map_err("syncing before looking up an entry", err)),
                    }
                    retry(|| client.check_stat(&path)).await
                }
            };
            match stat {
                // A sequential name is never reused, but the czxid (the token) settles it.
                Ok(Some(stat)) => Ok(entry.token_matches(czxid_token(stat.czxid))),
                Ok(None) => Ok(false),
                Err(err) => Err(map_err("looking up an entry", err)),
            }
        })
    }

    fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("zk.wait_gone", queue = %q, entry = %entry.name);
        self.guarded(async move {
            let client = self.handle()?;
            let path = format!("{}/{}", znode(q), entry.name);
            loop {
                // A data watch, not an exists watch: on a node already gone an exists watch
                // would wait for a creation that never comes (pitfall Z4).
                let watcher = match retry(|| client.get_and_watch_data(&path)).await {
                    Ok((_, _, watcher)) => watcher,
                    Err(zk::Error::NoNode) => return Ok(()),
                    Err(err) => return Err(map_err("waiting for an entry to go", err)),
                };
                let event = watcher.changed().await;
                match event.event_type {
                    zk::EventType::NodeDeleted => return Ok(()),
                    zk::EventType::Session => session_event_result(event.session_state)?,
                    // Data changed (e.g. Curator's revocation request): re-arm.
                    _ => {}
                }
            }
        })
        .instrument(span)
    }

    /// As `wait_gone`, with a data watch on the waiter's own node sent just before the
    /// one on `entry`, over the same connection: the server answers one session's
    /// requests in order and sends its watch events in the order of the changes, and the
    /// client hands each event to its watcher as it reads it. So if the own node was
    /// deleted before `entry`, its event is already in when `entry`'s arrives, and
    /// [`Woken::mine_queued`] is said only when it is not and the connection never
    /// changed from the moment both watches were sent (a reconnect re-arms watches in
    /// no particular order, and may reach a server that trails the last). One request
    /// more per wait, none on the handoff.
    fn wait_gone_behind(
        &self,
        q: &QueuePath,
        entry: &Entry,
        mine: &Entry,
    ) -> impl Future<Output = Result<Woken>> + Send {
        let span = tracing::debug_span!("zk.wait_gone_behind", queue = %q, entry = %entry.name, mine = %mine.name);
        self.guarded(async move {
            let client = self.handle()?;
            let parent = znode(q);
            let path = format!("{parent}/{}", entry.name);
            let own_path = format!("{parent}/{}", mine.name);
            // Any change of the connection's state from here on is seen at the end.
            let mut states = self.states.clone();
            let _ = states.state();
            // Sent in this order when called (zookeeper-client sends at the call).
            let own = client.get_and_watch_data(&own_path);
            let mut first = Some(client.get_and_watch_data(&path));
            let mut own = match own.await {
                Ok((_, stat, watcher)) if mine.token_matches(czxid_token(stat.czxid)) => {
                    Some(watcher)
                }
                // Gone already (or another node of its name): no proof; the waiter asks.
                Ok(_) | Err(zk::Error::NoNode) => None,
                Err(err) if is_connection_loss(&err) => None,
                Err(err) => return Err(map_err("watching the waiter's own entry", err)),
            };
            loop {
                let armed = match first.take() {
                    Some(sent) => match sent.await {
                        Err(err) if is_connection_loss(&err) => {
                            own = None;
                            retry(|| client.get_and_watch_data(&path)).await
                        }
                        other => other,
                    },
                    None => retry(|| client.get_and_watch_data(&path)).await,
                };
                // A data watch, not an exists watch (pitfall Z4), as in `wait_gone`.
                let watcher = match armed {
                    Ok((_, _, watcher)) => watcher,
                    Err(zk::Error::NoNode) => break,
                    Err(err) => return Err(map_err("waiting for an entry to go", err)),
                };
                let event = watcher.changed().await;
                match event.event_type {
                    zk::EventType::NodeDeleted => break,
                    zk::EventType::Session => session_event_result(event.session_state)?,
                    _ => {}
                }
            }
            let same_connection = states.changed().now_or_never().is_none();
            let mine_queued = match own.take() {
                Some(watcher) => {
                    let mut fired = Box::pin(watcher.changed());
                    let unfired = fired.as_mut().now_or_never().is_none();
                    if unfired {
                        // Left armed until the node goes (its release, or the session's
                        // end): a watcher dropped unfired costs the server a
                        // RemoveWatches request, one more per handoff.
                        tokio::spawn(async move {
                            fired.await;
                        });
                    }
                    same_connection && unfired
                }
                None => false,
            };
            Ok(Woken::new(Gone::Unknown, mine_queued))
        })
        .instrument(span)
    }

    fn wait_changed(
        &self,
        q: &QueuePath,
        seen: &[Entry],
    ) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("zk.wait_changed", queue = %q, seen = seen.len());
        self.guarded(async move {
            let client = self.handle()?;
            let parent = znode(q);
            let seen: BTreeSet<&str> = seen.iter().map(|e| e.name.as_str()).collect();
            loop {
                match retry(|| client.get_and_watch_children(&parent)).await {
                    Ok((names, _, watcher)) => {
                        let now: BTreeSet<&str> = names
                            .iter()
                            .filter(|n| Entry::from_name(n.as_str()).is_some())
                            .map(String::as_str)
                            .collect();
                        if now != seen {
                            return Ok(());
                        }
                        let event = watcher.changed().await;
                        if event.event_type == zk::EventType::Session {
                            session_event_result(event.session_state)?;
                        } else {
                            // The children changed after a listing equal to `seen`: report it
                            // without listing again (the caller knows what changes can happen).
                            return Ok(());
                        }
                    }
                    Err(zk::Error::NoNode) => {
                        if !seen.is_empty() {
                            return Ok(());
                        }
                        // An empty queue whose parent is missing: wait for it to appear.
                        match retry(|| client.check_and_watch_stat(&parent)).await {
                            Ok((Some(_), _)) => {}
                            Ok((None, watcher)) => {
                                let event = watcher.changed().await;
                                if event.event_type == zk::EventType::Session {
                                    session_event_result(event.session_state)?;
                                }
                            }
                            Err(err) => {
                                return Err(map_err("waiting for the queue to change", err))
                            }
                        }
                    }
                    Err(err) => return Err(map_err("waiting for the queue to change", err)),
                }
            }
        })
        .instrument(span)
    }

    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!(
            "zk.remove",
            queue = %q,
            entry = %entry.name,
            token = ?entry.token.map(FencingToken::get)
        );
        async move {
            let result = self
                .guarded(async move {
                    let client = self.handle()?;
                    let path = format!("{}/{}", znode(q), entry.name);
                    match retry(|| client.delete(&path, None)).await {
                        Ok(()) | Err(zk::Error::NoNode) => {
                            self.shared.untrack(&entry.name);
                            Ok(())
                        }
                        Err(err) => Err(map_err("removing an entry", err)),
                    }
                })
                .await;
            if let Err(err) = &result {
                tracing::debug!(%err, "remove failed");
            }
            result
        }
        .instrument(span)
    }

    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("zk.abandon", queue = %q, ticket = ticket.as_str());
        self.guarded(async move {
            let client = self.handle()?;
            let parent = znode(q);
            // A create a dropped enqueue sent may have been committed without this session
            // seeing its reply, and a server the session reconnected to may not have applied
            // it yet: sync through the leader before listing.
            match retry(|| client.sync(&parent)).await {
                Ok(()) | Err(zk::Error::NoNode) => {}
                Err(err) => return Err(map_err("abandoning an entry: syncing", err)),
            }
            let names = match retry(|| client.list_children(&parent)).await {
                Ok(names) => names,
                Err(zk::Error::NoNode) => {
                    self.shared.untrack(ticket.as_str());
                    return Ok(());
                }
                Err(err) => return Err(map_err("abandoning an entry: listing", err)),
            };
            let deletes: Vec<_> = names
                .iter()
                .filter(|n| dlock_core::entry::protected_id(n).as_deref() == Some(ticket.as_str()))
                .map(|n| {
                    tracing::debug!(entry = %n, "abandoning entry");
                    let path = format!("{parent}/{n}");
                    let client = &client;
                    async move { retry(|| client.delete(&path, None)).await }
                })
                .collect();
            for result in futures::future::join_all(deletes).await {
                match result {
                    Ok(()) | Err(zk::Error::NoNode) => {}
                    Err(err) => return Err(map_err("abandoning an entry", err)),
                }
            }
            self.shared.untrack(ticket.as_str());
            Ok(())
        })
        .instrument(span)
    }

    fn lost(&self, _q: &QueuePath, _entry: &Entry) -> BoxFuture<'static, Error> {
        let mut health = self.shared.health.subscribe();
        Box::pin(async move {
            let verdict = health
                .wait_for(|h| *h != Health::Live)
                .await
                .ok()
                .and_then(|h| h.error());
            verdict.unwrap_or(Error::Closed)
        })
    }

    /// The session's verdict, read directly: a lost future's first poll may answer
    /// `Pending` to a task whose tokio budget is spent, even for a loss already known.
    fn lost_now(&self, _q: &QueuePath, _entry: &Entry) -> Option<Error> {
        self.shared.lost_now()
    }

    fn read_value(&self, q: &QueuePath) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        self.guarded(async move {
            let client = self.handle()?;
            let path = znode(q);
            match retry(|| client.get_data(&path)).await {
                Ok((data, _)) if data.is_empty() => Ok(None),
                Ok((data, _)) => Ok(Some(data)),
                Err(zk::Error::NoNode) => Ok(None),
                Err(err) => Err(map_err("reading the shared value", err)),
            }
        })
    }

    fn participants(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        self.guarded(async move {
            let client = self.handle()?;
            let parent = znode(q);
            // Status and revocation must see every entry any client has been told it holds,
            // not the possibly lagging view of this session's server: sync first.
            match retry(|| client.sync(&parent)).await {
                Ok(()) | Err(zk::Error::NoNode) => {}
                Err(err) => return Err(map_err("syncing before listing participants", err)),
            }
            let names = match retry(|| client.list_children(&parent)).await {
                Ok(names) => names,
                Err(zk::Error::NoNode) => return Ok(Vec::new()),
                Err(err) => return Err(map_err("listing participants", err)),
            };
            let entries = parse_queue(names);
            let reads: Vec<_> = entries
                .iter()
                .map(|e| {
                    let path = format!("{parent}/{}", e.name);
                    let client = &client;
                    async move { retry(|| client.get_data(&path)).await }
                })
                .collect();
            let mut out = Vec::with_capacity(entries.len());
            for (mut entry, read) in entries
                .into_iter()
                .zip(futures::future::join_all(reads).await)
            {
                match read {
                    Ok((data, stat)) => {
                        entry.token = czxid_token(stat.czxid);
                        entry.created_ms = Some(stat.ctime);
                        entry.data = data;
                        out.push(entry);
                    }
                    // Released between the listing and the read.
                    Err(zk::Error::NoNode) => {}
                    Err(err) => return Err(map_err("reading a participant", err)),
                }
            }
            Ok(out)
        })
    }

    fn set_data(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        let span = tracing::debug_span!("zk.set_data", queue = %q, entry = %entry.name);
        self.guarded(async move {
            let client = self.handle()?;
            let path = format!("{}/{}", znode(q), entry.name);
            match retry(|| client.set_data(&path, data, None)).await {
                Ok(_) | Err(zk::Error::NoNode) => Ok(()),
                Err(err) => Err(map_err("writing an entry's payload", err)),
            }
        })
        .instrument(span)
    }

    fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        let span = tracing::debug_span!("zk.wait_data_changed", queue = %q, entry = %entry.name);
        self.guarded(async move {
            let client = self.handle()?;
            let path = format!("{}/{}", znode(q), entry.name);
            loop {
                // Read and arm in one request: a change after the read fires the watch.
                let watcher = match retry(|| client.get_and_watch_data(&path)).await {
                    Ok((data, _, _)) if data != seen => return Ok(Some(data)),
                    Ok((_, _, watcher)) => watcher,
                    Err(zk::Error::NoNode) => return Ok(None),
                    Err(err) => return Err(map_err("watching an entry's payload", err)),
                };
                let event = watcher.changed().await;
                match event.event_type {
                    zk::EventType::NodeDeleted => return Ok(None),
                    zk::EventType::Session => session_event_result(event.session_state)?,
                    _ => {}
                }
            }
        })
        .instrument(span)
    }

    /// A walk of the znodes under the prefix (`crate::listing`), after one `sync`.
    fn list_queues(&self, prefix: &str) -> impl Future<Output = Result<Vec<ListedQueue>>> + Send {
        self.guarded(self.list_queues_inner(prefix))
    }

    /// An `exists` of the (chroot's) root, through the session: ZooKeeper checks no ACL
    /// for it, and it fails once the session is over.
    async fn health(&self) -> Result<()> {
        let client = self.handle()?;
        let ask = async {
            client
                .check_stat("/")
                .await
                .map(|_| ())
                .map_err(|e| map_err("health check", e))
        };
        match tokio::time::timeout(self.session_timeout, self.guarded(ask)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Unreachable(format!(
                "health check: no ZooKeeper answer within {:?}",
                self.session_timeout
            ))),
        }
    }

    async fn close(&self) -> Result<()> {
        let mut states = self.states.clone();
        self.shared.conclude(Health::Closed);
        if let Some(borrowed) = &self.shared.borrowed {
            // The session is the application's and goes on: delete what we made in it.
            match tokio::time::timeout(self.session_timeout, remove_tracked(borrowed)).await {
                Ok(Ok(_)) => {}
                Ok(Err(err)) => return Err(map_err("removing entries on close", err)),
                Err(_) => {
                    return Err(Error::Unreachable(format!(
                        "ZooKeeper did not confirm the removal of dlock's entries within {:?}",
                        self.session_timeout
                    )))
                }
            }
            return Ok(());
        }
        // The session ends once the last client clone is gone; in-flight operations
        // drop theirs as their guards see `Closed`. Wait (bounded) for the server to
        // confirm, so entries are gone when close returns.
        let confirmed = tokio::time::timeout(self.session_timeout, async {
            while !states.peek_state().is_terminated() {
                states.changed().await;
            }
        })
        .await;
        if confirmed.is_err() {
            tracing::warn!("ZooKeeper did not confirm the session close in time");
        }
        Ok(())
    }
}

/// The fencing token of a node: its czxid (`None` only for a negative one, which a
/// server never sends).
fn czxid_token(czxid: i64) -> Option<FencingToken> {
    u64::try_from(czxid).ok().map(FencingToken::new)
}

/// The znode path of a queue: lock `a/b` is `/a/b` under the chroot, its semaphore
/// sub-queue `leases` is `/a/b/leases`.
pub(crate) fn znode(q: &QueuePath) -> String {
    format!("/{}", q.relative())
}

pub(crate) fn parse_queue(names: Vec<String>) -> Vec<Entry> {
    let mut entries: Vec<Entry> = names.into_iter().filter_map(Entry::from_name).collect();
    sort_queue(&mut entries);
    entries
}

/// The result of a watch that fired with a session event instead of a node event:
/// terminal states end the wait, others (the crate does not send them) re-arm.
fn session_event_result(state: zk::SessionState) -> Result<()> {
    match state {
        zk::SessionState::Expired => Err(Error::LockLost("ZooKeeper session expired".into())),
        zk::SessionState::AuthFailed => {
            Err(Error::LockLost("ZooKeeper authentication failed".into()))
        }
        zk::SessionState::Closed => Err(Error::Closed),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn znode_paths() {
        let lock = dlock_core::LockName::new("a/b", crate::NAME_RULES).expect("valid");
        assert_eq!(znode(&QueuePath::root(lock.clone())), "/a/b");
        assert_eq!(znode(&QueuePath::sub(lock, "leases")), "/a/b/leases");
    }
}
