//! [`ZkBackend`]: the [`Backend`] trait on one ZooKeeper session.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::entry::{format_seq, sort_queue};
use dlock_core::{
    Backend, Capability, Enqueued, Entry, EntryKind, Error, FencingToken, Hints, NameRules,
    Position, QueuePath, Result, SessionOptions, Ticket,
};
use futures::future::BoxFuture;
use futures::FutureExt;
use tracing::Instrument;
use zookeeper_client as zk;

use crate::errors::{connect_error, is_connection_loss, map_err};
use crate::session::{watch_session, Health, Shared};
use crate::{nodelay, ZkOptions};

/// The session timeout asked for when [`SessionOptions::session_timeout`] is `None`.
///
/// Ten seconds: long enough to ride out a leader election and a GC pause, short enough
/// that a crashed holder's locks free up quickly. The server clamps whatever is asked to
/// `[2, 20] × tickTime` (4–40 s with the default tickTime of 2 s); the negotiated value
/// is what [`Backend::session_timeout`] reports.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// How often enqueue re-creates its entry after the parent vanished or the connection
/// dropped before it gives up. Each retry needs a concurrent deletion or a reconnect, so
/// the bound is never reached in practice; it only turns a livelock into an error.
const MAX_ENQUEUE_ATTEMPTS: usize = 8;

/// How often an idempotent request is re-sent after the connection dropped. Each retry waits for
/// the client to reconnect (zookeeper-client queues requests meanwhile), and the session
/// guard ends the wait once the session is declared lost, so a few cover any failover.
const MAX_RETRIES: usize = 4;

/// Runs an idempotent request again when the connection dropped before its reply came:
/// a leader failover or a server restart then costs a wait, not an error.
async fn retry<T, F, Fut>(mut request: F) -> Result<T, zk::Error>
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
    shared: Arc<Shared>,
    states: zk::StateWatcher,
    session_timeout: Duration,
    session_id: zk::SessionId,
    watcher: tokio::task::AbortHandle,
    /// The leader heartbeat ([`crate::heartbeat`]); aborted on drop like `watcher`.
    heartbeat: tokio::task::AbortHandle,
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
    /// Connects to ZooKeeper with the default [`ZkOptions`].
    ///
    /// `connect_string` is `host:port[,host:port...][/chroot]`, as for the Java client. A
    /// chroot that does not exist yet is created (as persistent nodes). The session asks
    /// for [`SessionOptions::session_timeout`], or [`DEFAULT_SESSION_TIMEOUT`].
    ///
    /// Must be called inside a tokio runtime: a task watching the session is spawned.
    ///
    /// # Errors
    /// - [`Error::Unreachable`] if no server answered within
    ///   [`SessionOptions::connect_timeout`].
    /// - [`Error::InvalidUrl`] if the connect string or chroot is malformed.
    /// - [`Error::Backend`] if the chroot could not be created.
    pub async fn connect(connect_string: &str, opts: SessionOptions) -> Result<Arc<ZkBackend>> {
        Self::connect_with(connect_string, opts, ZkOptions::default()).await
    }

    /// Connects like [`ZkBackend::connect`], with adapter-specific options.
    ///
    /// # Errors
    /// As [`ZkBackend::connect`].
    pub async fn connect_with(
        connect_string: &str,
        opts: SessionOptions,
        zk_opts: ZkOptions,
    ) -> Result<Arc<ZkBackend>> {
        let (hosts, chroot) = split_chroot(connect_string);
        if hosts.trim().is_empty() {
            return Err(Error::InvalidUrl {
                url: connect_string.to_owned(),
                reason: "no ZooKeeper host given".into(),
            });
        }
        let timeout = opts.session_timeout.unwrap_or(DEFAULT_SESSION_TIMEOUT);
        // The leader created the session after this: it lives at least a session timeout
        // from here (the heartbeat's first proof).
        let requested = tokio::time::Instant::now();
        let connecting = zk::Client::connector()
            .with_session_timeout(timeout)
            .connect(hosts);
        let client = match tokio::time::timeout(opts.connect_timeout, connecting).await {
            Err(_elapsed) => {
                return Err(Error::Unreachable(format!(
                    "no ZooKeeper server of {hosts:?} answered within {:?}",
                    opts.connect_timeout
                )))
            }
            Ok(Err(err)) => return Err(connect_error(connect_string, err)),
            Ok(Ok(client)) => client,
        };

        let (resolved, conf) = {
            let hosts = hosts.to_owned();
            tokio::task::spawn_blocking(move || {
                let resolved = nodelay::resolve(&hosts);
                let conf = crate::heartbeat::probe_conf(&resolved);
                (resolved, conf)
            })
            .await
            .unwrap_or_default()
        };
        let tick = zk_opts.tick_time.or(conf.map(|c| c.tick));
        let negotiated = client.session_timeout();
        match conf {
            None if zk_opts.tick_time.is_some() => tracing::warn!(
                session_timeout = ?negotiated,
                "no ZooKeeper server answered `conf` (4lw.commands.whitelist), so the adapter \
                 cannot check the ensemble's syncLimit: make sure the session timeout is at \
                 least 2 x syncLimit x tickTime, or a follower cut off from its leader costs \
                 every session behind it"
            ),
            None => tracing::warn!(
                session_timeout = ?negotiated,
                "no ZooKeeper server answered `conf` (add it to 4lw.commands.whitelist, or set \
                 ZkOptions::tick_time): assuming tickTime is half the session timeout, so the \
                 lost signal will also fire on leader elections and reconnections; and make \
                 sure the session timeout is at least 2 x syncLimit x tickTime of the \
                 ensemble, or a follower cut off from its leader costs every session behind it"
            ),
            Some(c) if !crate::heartbeat::session_outlasts_follower_detection(negotiated, &c) => {
                tracing::warn!(
                    session_timeout = ?negotiated,
                    follower_detection = ?c.follower_detection,
                    "the negotiated ZooKeeper session timeout is shorter than 2 x syncLimit x \
                     tickTime: a follower cut off from its leader serves its clients for \
                     syncLimit x tickTime while the leader may expire their sessions, so every \
                     such partition will cost the session and its locks (the lost signal \
                     still fires before the leader can grant them elsewhere); ask for a \
                     session timeout of at least 2 x syncLimit x tickTime, or lower syncLimit \
                     (and raise maxSessionTimeout if the server caps the request)"
                );
            }
            Some(_) => {}
        }
        let servers: Arc<[std::net::SocketAddr]> = if zk_opts.tcp_nodelay {
            nodelay::apply(&resolved);
            resolved.into()
        } else {
            Arc::from(Vec::new())
        };

        let client = match chroot {
            None => client,
            Some(root) => {
                let rooted = client.clone().chroot(root).map_err(|_| Error::InvalidUrl {
                    url: connect_string.to_owned(),
                    reason: format!("invalid chroot {root:?}"),
                })?;
                let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
                let mkdir = client.mkdir(root, &persistent);
                match tokio::time::timeout(opts.connect_timeout, mkdir).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => return Err(map_err("creating the chroot", err)),
                    Err(_elapsed) => {
                        return Err(Error::Unreachable(format!(
                            "creating the chroot {root:?} took longer than {:?}",
                            opts.connect_timeout
                        )))
                    }
                }
                rooted
            }
        };

        let session_timeout = client.session_timeout();
        let session_id = client.session_id();
        let states = client.state_watcher();
        let task_states = client.state_watcher();
        let shared = Arc::new(Shared::new(client));
        let task = tokio::spawn(watch_session(
            Arc::downgrade(&shared),
            task_states,
            session_timeout,
            servers,
        ));
        let heartbeat = tokio::spawn(crate::heartbeat::run(
            Arc::downgrade(&shared),
            session_timeout,
            requested,
            states.clone(),
            tick,
        ));
        let backend = Arc::new(ZkBackend {
            shared,
            states,
            session_timeout,
            session_id,
            watcher: task.abort_handle(),
            heartbeat: heartbeat.abort_handle(),
        });
        tracing::info!(session = %session_id, ?session_timeout, "ZooKeeper session established");
        Ok(backend)
    }

    /// The underlying zookeeper-client handle, for what the trait does not cover (guarded
    /// writes with `new_check_writer`, inspecting the tree). It shares this session:
    /// entries it creates are ephemeral to the same session, and holding it keeps the
    /// session open after [`Backend::close`] until it is dropped.
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

    fn handle(&self) -> Result<Arc<zk::Client>> {
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

    async fn enqueue_inner(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        let client = self.handle()?;
        let parent = znode(q);
        let (name, mode) = match at {
            Position::Tail => (
                ticket.name_prefix(kind),
                zk::CreateMode::EphemeralSequential,
            ),
            // Curator's downgrade: a non-sequential node carrying the writer's sequence.
            Position::Beside(writer) => (
                format!("{}{}", ticket.name_prefix(kind), format_seq(writer.seq)),
                zk::CreateMode::Ephemeral,
            ),
        };
        let sequential = matches!(mode, zk::CreateMode::EphemeralSequential);
        let path = format!("{parent}/{name}");
        // A downgrade's read entry is created in one multi with a check that its write
        // entry still exists: a write deleted from outside fails the multi, and no read
        // entry takes a dead writer's place. (The write is this session's ephemeral, and a
        // session is never replaced, so existing means ours.)
        let writer_path = match at {
            Position::Beside(writer) => Some(format!("{parent}/{}", writer.name)),
            Position::Tail => None,
        };
        let options = mode.with_acls(zk::Acls::anyone_all());
        // Set when a create's reply was lost: it may have happened on the server.
        let mut maybe_created = false;
        for _ in 0..MAX_ENQUEUE_ATTEMPTS {
            if std::mem::take(&mut maybe_created) {
                // Curator's protected mode: find the entry by the ticket in its name. The
                // listing is ordered after the lost create, so if it is absent now it was
                // never made and creating again cannot duplicate it.
                if let Some((stat, mine)) = self.find_own(&client, &parent, ticket, kind).await? {
                    let names = retry(|| client.list_children(&parent))
                        .await
                        .map_err(|e| map_err("enqueue: listing the queue", e))?;
                    return build_enqueued(names, mine, &stat, data);
                }
            }
            // Both requests are written when called, in this order, so the listing is taken
            // right after the create on the server: one round trip for both.
            let create = match &writer_path {
                None => client
                    .create(&path, data, &options)
                    .map(|r| r.map(|(stat, seq)| (stat, Some(seq))))
                    .boxed(),
                Some(writer_path) => {
                    let mut multi = client.new_multi_writer();
                    multi
                        .add_check_version(writer_path, -1)
                        .and_then(|()| multi.add_create(&path, data, &options))
                        .map_err(|e| map_err("enqueue: building the multi", e))?;
                    multi
                        .commit()
                        .map(|r| match r {
                            Ok(results) => match results.into_iter().nth(1) {
                                Some(zk::MultiWriteResult::Create { stat, .. }) => Ok((stat, None)),
                                _ => Err(zk::Error::UnexpectedError(
                                    "the server's multi reply has no create result".into(),
                                )),
                            },
                            Err(zk::MultiWriteError::OperationFailed {
                                index: 0,
                                source: zk::Error::NoNode,
                            }) => Err(zk::Error::BadVersion),
                            Err(e) => Err(e.into()),
                        })
                        .boxed()
                }
            };
            let list = client.get_children(&parent);
            let (created, listed) = futures::join!(create, list);
            let (stat, mine) = match created {
                Ok((stat, Some(seq))) => (stat, format!("{name}{seq}")),
                // ZooKeeper before 3.9 answers a create inside a multi without its stat
                // (ZOOKEEPER-4026); the token is the czxid, so read it.
                Ok((stat, None)) if stat.is_invalid() => {
                    match retry(|| client.check_stat(&path)).await {
                        Ok(Some(stat)) => (stat, name.clone()),
                        Ok(None) => {
                            return Err(Error::LockLost(format!(
                                "entry {path} vanished right after it was created"
                            )))
                        }
                        Err(err) => return Err(map_err("enqueue: reading the entry", err)),
                    }
                }
                Ok((stat, None)) => (stat, name.clone()),
                // Only the multi's check of the write entry fails so: a version of -1
                // matches any node that exists.
                Err(zk::Error::BadVersion) if writer_path.is_some() => {
                    return Err(Error::LockLost(format!(
                        "the write entry beside which the read entry was asked for is gone from {parent}"
                    )))
                }
                Err(zk::Error::NoNode) => {
                    // The parent was never created, or its container was reaped while empty.
                    self.make_parent(&client, &parent).await?;
                    continue;
                }
                Err(zk::Error::NodeExists) if !sequential => {
                    // A retried Beside create whose first reply was lost: ours if our session owns it.
                    let (_, stat) = retry(|| client.get_data(&path))
                        .await
                        .map_err(|e| map_err("enqueue: reading an existing entry", e))?;
                    if stat.ephemeral_owner != self.session_id.0 {
                        return Err(Error::backend(
                            "enqueue",
                            format!("entry {path} already exists and belongs to another session"),
                        ));
                    }
                    (stat, name.clone())
                }
                Err(err) if is_connection_loss(&err) => {
                    tracing::debug!(%err, "connection lost during create; looking for the entry");
                    maybe_created = true;
                    continue;
                }
                Err(err) => return Err(map_err("enqueue", err)),
            };
            let names = match listed {
                Ok((names, _)) if names.contains(&mine) => names,
                _ => retry(|| client.list_children(&parent))
                    .await
                    .map_err(|e| map_err("enqueue: listing the queue", e))?,
            };
            return build_enqueued(names, mine, &stat, data);
        }
        Err(Error::backend(
            "enqueue",
            format!(
                "gave up after {MAX_ENQUEUE_ATTEMPTS} attempts: the queue's parent kept \
                 vanishing or the connection kept dropping"
            ),
        ))
    }

    /// Creates an entry at the tail of `q` and deletes `gone` from `gone_q` in one
    /// `multi`: one synced write, atomic, so after a lost reply either both happened
    /// (the entry is found by its ticket) or neither.
    #[allow(clippy::too_many_arguments)]
    async fn enqueue_removing_inner(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> Result<Entry> {
        let client = self.handle()?;
        let parent = znode(q);
        let path = format!("{parent}/{}", ticket.name_prefix(kind));
        let gone_path = format!("{}/{}", znode(gone_q), gone.name);
        let options = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
        let mut maybe_done = false;
        for _ in 0..MAX_ENQUEUE_ATTEMPTS {
            if std::mem::take(&mut maybe_done) {
                if let Some((stat, mine)) = self.find_own(&client, &parent, ticket, kind).await? {
                    return entry_with_stat(mine, &stat, data);
                }
            }
            let mut multi = client.new_multi_writer();
            multi
                .add_create(&path, data, &options)
                .and_then(|()| multi.add_delete(&gone_path, None))
                .map_err(|e| map_err("enqueue_removing: building the multi", e))?;
            match multi.commit().await {
                Ok(results) => {
                    let Some(zk::MultiWriteResult::Create {
                        path: created,
                        stat,
                    }) = results.into_iter().next()
                    else {
                        return Err(Error::backend(
                            "enqueue_removing",
                            "the server's multi reply has no create result",
                        ));
                    };
                    let mine = created.rsplit('/').next().unwrap_or(&created).to_owned();
                    // ZooKeeper before 3.9 answers a create inside a multi without its stat
                    // (ZOOKEEPER-4026); the token is the czxid, so read it.
                    let stat = if stat.is_invalid() {
                        let own = format!("{parent}/{mine}");
                        match retry(|| client.check_stat(&own)).await {
                            Ok(Some(stat)) => stat,
                            Ok(None) => {
                                return Err(Error::LockLost(format!(
                                    "entry {own} vanished right after it was created"
                                )))
                            }
                            Err(err) => {
                                return Err(map_err("enqueue_removing: reading the entry", err))
                            }
                        }
                    } else {
                        stat
                    };
                    return entry_with_stat(mine, &stat, data);
                }
                Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NoNode,
                }) => {
                    self.make_parent(&client, &parent).await?;
                }
                Err(zk::MultiWriteError::OperationFailed {
                    index: 1,
                    source: zk::Error::NoNode,
                }) => {
                    return Err(Error::LockLost(format!(
                        "held entry {gone_path} vanished before it was handed on"
                    )))
                }
                Err(zk::MultiWriteError::RequestFailed { source })
                    if is_connection_loss(&source) =>
                {
                    tracing::debug!(err = %source, "connection lost during the multi; looking for the entry");
                    maybe_done = true;
                }
                Err(err) => return Err(map_err("enqueue_removing", err.into())),
            }
        }
        Err(Error::backend(
            "enqueue_removing",
            format!(
                "gave up after {MAX_ENQUEUE_ATTEMPTS} attempts: the queue's parent kept \
                 vanishing or the connection kept dropping"
            ),
        ))
    }

    /// Creates `parent` and its ancestors as container nodes, as Curator's
    /// `creatingParentContainersIfNeeded` does, so the server reaps them once empty.
    async fn make_parent(&self, client: &zk::Client, parent: &str) -> Result<()> {
        let container = zk::CreateMode::Container.with_acls(zk::Acls::anyone_all());
        match retry(|| client.mkdir(parent, &container)).await {
            Ok(()) | Err(zk::Error::NodeExists) => Ok(()),
            Err(zk::Error::NoNode) => Err(Error::backend(
                "enqueue: creating the queue's parents",
                "the chroot does not exist (deleted after connect?)",
            )),
            Err(err) => Err(map_err("enqueue: creating the queue's parents", err)),
        }
    }

    /// Finds the entry `ticket` created in `parent`, with its stat.
    async fn find_own(
        &self,
        client: &zk::Client,
        parent: &str,
        ticket: &Ticket,
        kind: EntryKind,
    ) -> Result<Option<(zk::Stat, String)>> {
        // The create whose reply was lost was not seen by this session, so a server this
        // session reconnected to may not have applied it yet: sync through the leader first.
        match retry(|| client.sync(parent)).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(err) => {
                return Err(map_err(
                    "enqueue: syncing before a lost create's lookup",
                    err,
                ))
            }
        }
        let names = match retry(|| client.list_children(parent)).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(err) => return Err(map_err("enqueue: looking for a lost create", err)),
        };
        let prefix = ticket.name_prefix(kind);
        let Some(name) = names.into_iter().find(|n| n.starts_with(&prefix)) else {
            return Ok(None);
        };
        let path = format!("{parent}/{name}");
        match retry(|| client.get_data(&path)).await {
            Ok((_, stat)) => Ok(Some((stat, name))),
            Err(zk::Error::NoNode) => Ok(None),
            Err(err) => Err(map_err("enqueue: reading a recovered entry", err)),
        }
    }

    async fn queue_inner(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        let client = self.handle()?;
        let parent = znode(q);
        match retry(|| client.list_children(&parent)).await {
            Ok(names) => Ok(parse_queue(names)),
            Err(zk::Error::NoNode) => Ok(Vec::new()),
            Err(err) => Err(map_err("listing the queue", err)),
        }
    }

    async fn contains_inner(&self, q: &QueuePath, entry: &Entry) -> Result<bool> {
        let client = self.handle()?;
        let parent = znode(q);
        // The session's server may be a follower that trails the leader (or is cut off
        // from it and does not know yet): without a sync it would say "still there" about
        // an entry the leader already deleted. A sync completes only through the leader.
        match retry(|| client.sync(&parent)).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(err) => return Err(map_err("syncing before looking up an entry", err)),
        }
        let path = format!("{parent}/{}", entry.name);
        match retry(|| client.check_stat(&path)).await {
            // A sequential name is never reused, but the czxid (the token) settles it.
            Ok(Some(stat)) => Ok(entry.token_matches(czxid_token(stat.czxid))),
            Ok(None) => Ok(false),
            Err(err) => Err(map_err("looking up an entry", err)),
        }
    }

    async fn wait_gone_inner(&self, q: &QueuePath, entry: &Entry) -> Result<()> {
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
    }

    async fn wait_changed_inner(&self, q: &QueuePath, seen: &[Entry]) -> Result<()> {
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
                        Err(err) => return Err(map_err("waiting for the queue to change", err)),
                    }
                }
                Err(err) => return Err(map_err("waiting for the queue to change", err)),
            }
        }
    }

    async fn remove_inner(&self, q: &QueuePath, entry: &Entry) -> Result<()> {
        let client = self.handle()?;
        let path = format!("{}/{}", znode(q), entry.name);
        match retry(|| client.delete(&path, None)).await {
            Ok(()) | Err(zk::Error::NoNode) => Ok(()),
            Err(err) => Err(map_err("removing an entry", err)),
        }
    }

    async fn abandon_inner(&self, q: &QueuePath, ticket: &Ticket) -> Result<()> {
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
            Err(zk::Error::NoNode) => return Ok(()),
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
        Ok(())
    }

    async fn participants_inner(&self, q: &QueuePath) -> Result<Vec<Entry>> {
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
    }

    async fn set_data_inner(&self, q: &QueuePath, entry: &Entry, data: &[u8]) -> Result<()> {
        let client = self.handle()?;
        let path = format!("{}/{}", znode(q), entry.name);
        match retry(|| client.set_data(&path, data, None)).await {
            Ok(_) | Err(zk::Error::NoNode) => Ok(()),
            Err(err) => Err(map_err("writing an entry's payload", err)),
        }
    }

    async fn wait_data_changed_inner(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> Result<Option<Vec<u8>>> {
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
    }

    async fn read_value_inner(&self, q: &QueuePath) -> Result<Option<Vec<u8>>> {
        let client = self.handle()?;
        let path = znode(q);
        match retry(|| client.get_data(&path)).await {
            Ok((data, _)) if data.is_empty() => Ok(None),
            Ok((data, _)) => Ok(Some(data)),
            Err(zk::Error::NoNode) => Ok(None),
            Err(err) => Err(map_err("reading the shared value", err)),
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
        matches!(capability, Capability::Revocation | Capability::SharedValue)
    }

    fn enqueue<'a>(
        &'a self,
        q: &'a QueuePath,
        ticket: &'a Ticket,
        kind: EntryKind,
        at: Position<'a>,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<Enqueued>> {
        let span = tracing::debug_span!("zk.enqueue", queue = %q, %kind, ticket = ticket.as_str());
        Box::pin(
            async move {
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
            .instrument(span),
        )
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
        let span = tracing::debug_span!("zk.enqueue_removing", queue = %q, %kind, ticket = ticket.as_str(), gone = %gone.name);
        Box::pin(
            async move {
                let result = self
                    .guarded(self.enqueue_removing_inner(q, ticket, kind, data, gone_q, gone))
                    .await;
                match &result {
                    Ok(mine) => tracing::debug!(entry = %mine.name, "enqueued, handed on"),
                    Err(err) => tracing::debug!(%err, "enqueue_removing failed"),
                }
                result
            }
            .instrument(span),
        )
    }

    fn queue<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(self.guarded(self.queue_inner(q)))
    }

    /// One `exists` of the entry's node, its czxid compared with the token. Like every
    /// ZooKeeper read it is answered by the server this session is connected to, which
    /// may trail the leader by the commits in flight; the session itself is what
    /// vouches for the entry in between.
    fn contains<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<bool>> {
        Box::pin(self.guarded(self.contains_inner(q, entry)))
    }

    fn wait_gone<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("zk.wait_gone", queue = %q, entry = %entry.name);
        Box::pin(
            self.guarded(self.wait_gone_inner(q, entry))
                .instrument(span),
        )
    }

    fn wait_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        seen: &'a [Entry],
    ) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("zk.wait_changed", queue = %q, seen = seen.len());
        Box::pin(
            self.guarded(self.wait_changed_inner(q, seen))
                .instrument(span),
        )
    }

    fn remove<'a>(&'a self, q: &'a QueuePath, entry: &'a Entry) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!(
            "zk.remove",
            queue = %q,
            entry = %entry.name,
            token = ?entry.token.map(FencingToken::get)
        );
        Box::pin(
            async move {
                let result = self.guarded(self.remove_inner(q, entry)).await;
                if let Err(err) = &result {
                    tracing::debug!(%err, "remove failed");
                }
                result
            }
            .instrument(span),
        )
    }

    fn abandon<'a>(&'a self, q: &'a QueuePath, ticket: &'a Ticket) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("zk.abandon", queue = %q, ticket = ticket.as_str());
        Box::pin(self.guarded(self.abandon_inner(q, ticket)).instrument(span))
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

    fn read_value<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Option<Vec<u8>>>> {
        Box::pin(self.guarded(self.read_value_inner(q)))
    }

    fn participants<'a>(&'a self, q: &'a QueuePath) -> BoxFuture<'a, Result<Vec<Entry>>> {
        Box::pin(self.guarded(self.participants_inner(q)))
    }

    fn set_data<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        data: &'a [u8],
    ) -> BoxFuture<'a, Result<()>> {
        let span = tracing::debug_span!("zk.set_data", queue = %q, entry = %entry.name);
        Box::pin(
            self.guarded(self.set_data_inner(q, entry, data))
                .instrument(span),
        )
    }

    fn wait_data_changed<'a>(
        &'a self,
        q: &'a QueuePath,
        entry: &'a Entry,
        seen: &'a [u8],
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>>> {
        let span = tracing::debug_span!("zk.wait_data_changed", queue = %q, entry = %entry.name);
        Box::pin(
            self.guarded(self.wait_data_changed_inner(q, entry, seen))
                .instrument(span),
        )
    }

    fn close(&self) -> BoxFuture<'_, Result<()>> {
        Box::pin(async move {
            let mut states = self.states.clone();
            self.shared.conclude(Health::Closed);
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
        })
    }
}

/// The fencing token of a node: its czxid (`None` only for a negative one, which a
/// server never sends).
fn czxid_token(czxid: i64) -> Option<FencingToken> {
    u64::try_from(czxid).ok().map(FencingToken::new)
}

/// The znode path of a queue: lock `a/b` is `/a/b` under the chroot, its semaphore
/// sub-queue `leases` is `/a/b/leases`.
fn znode(q: &QueuePath) -> String {
    format!("/{}", q.relative())
}

/// Splits `h:p,h:p/chroot` into hosts and chroot. A `/` that belongs to a `tcp://`
/// scheme is not the chroot. A bare `/` chroot is no chroot.
pub(crate) fn split_chroot(connect_string: &str) -> (&str, Option<&str>) {
    let bytes = connect_string.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'/' {
            continue;
        }
        let scheme_slash = connect_string[..i].ends_with(':')
            || (connect_string[..i].ends_with(":/") && bytes.get(i + 1) != Some(&b'/'));
        if scheme_slash {
            continue;
        }
        let root = connect_string[i..].trim_end_matches('/');
        let root = if root.is_empty() { None } else { Some(root) };
        return (&connect_string[..i], root);
    }
    (connect_string, None)
}

fn parse_queue(names: Vec<String>) -> Vec<Entry> {
    let mut entries: Vec<Entry> = names.into_iter().filter_map(Entry::from_name).collect();
    sort_queue(&mut entries);
    entries
}

fn build_enqueued(
    names: Vec<String>,
    mine: String,
    stat: &zk::Stat,
    data: &[u8],
) -> Result<Enqueued> {
    let me = entry_with_stat(mine, stat, data)?;
    let mut queue = parse_queue(names);
    match queue.iter_mut().find(|e| e.name == me.name) {
        Some(slot) => *slot = me.clone(),
        None => {
            queue.push(me.clone());
            sort_queue(&mut queue);
        }
    }
    Ok(Enqueued { mine: me, queue })
}

/// The entry this session created as `mine`, with its token (the czxid) and payload.
fn entry_with_stat(mine: String, stat: &zk::Stat, data: &[u8]) -> Result<Entry> {
    let czxid = u64::try_from(stat.czxid).map_err(|_| {
        Error::backend(
            "enqueue",
            "the server returned no czxid for the created entry (ZooKeeper 3.5 or later is required)",
        )
    })?;
    let mut me = Entry::from_name(mine.as_str()).ok_or_else(|| {
        Error::backend(
            "enqueue",
            format!("created entry {mine:?} does not parse as an entry name"),
        )
    })?;
    me.token = Some(FencingToken::new(czxid));
    me.created_ms = Some(stat.ctime);
    me.data = data.to_vec();
    Ok(me)
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
    fn splits_chroot() {
        assert_eq!(split_chroot("a:1,b:2/x/y"), ("a:1,b:2", Some("/x/y")));
        assert_eq!(split_chroot("a:1/"), ("a:1", None));
        assert_eq!(split_chroot("a:1"), ("a:1", None));
        assert_eq!(
            split_chroot("tcp://a:1,tcp://b:2/r"),
            ("tcp://a:1,tcp://b:2", Some("/r"))
        );
        assert_eq!(split_chroot("a:1/r/"), ("a:1", Some("/r")));
    }

    #[test]
    fn znode_paths() {
        let lock = dlock_core::LockName::new("a/b", crate::NAME_RULES).expect("valid");
        assert_eq!(znode(&QueuePath::root(lock.clone())), "/a/b");
        assert_eq!(znode(&QueuePath::sub(lock, "leases")), "/a/b/leases");
    }

    #[test]
    fn enqueued_includes_mine_with_token() {
        let t = Ticket::new();
        let mine = format!("{}0000000002", t.name_prefix(EntryKind::Lock));
        let other = Ticket::new();
        let names = vec![
            "leases".to_owned(),
            format!("{}0000000003", other.name_prefix(EntryKind::Lock)),
            format!("{}0000000001", other.name_prefix(EntryKind::Lock)),
        ];
        let stat = zk::Stat {
            czxid: 42,
            mzxid: 42,
            pzxid: 42,
            ctime: 7,
            mtime: 7,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 1,
            data_length: 0,
            num_children: 0,
        };
        let done = build_enqueued(names, mine.clone(), &stat, b"me").expect("built");
        assert_eq!(done.mine.token, Some(FencingToken::new(42)));
        let seqs: Vec<u64> = done.queue.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3]);
        assert_eq!(done.queue[1].name, mine);
        assert_eq!(done.queue[1].data, b"me");
    }
}
