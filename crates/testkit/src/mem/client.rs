//! The client side: one session on a [`MemServer`], its heartbeat keeper, its lost
//! signal, and the [`Backend`] trait over the server's operations.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::backend::lost_margin;
use dlock_core::{
    Backend, Capability, Enqueued, Entry, EntryKind, Error, Gone, Hints, ListedQueue, NameRules,
    Position, QueuePath, Result, SharedDeadline, Ticket,
};
use futures::future::BoxFuture;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use super::faults::Request;
use super::server::{not_behind, Ops};
use super::{MemServer, SessionId};

/// One client session on a [`MemServer`], implementing [`Backend`] with the semantics of
/// the real adapters (see the [module docs](super)).
///
/// A heartbeat task keeps the session alive every third of its timeout. Its
/// [`Backend::lost`] fires [`lost_margin`] before the server's deadline, counted from when
/// the last acknowledged heartbeat was sent, or when a refused call or heartbeat says the
/// session expired, or on [`Backend::close`]. Dropping it closes the session.
#[derive(Debug)]
pub struct MemBackend {
    link: Arc<Link>,
    timeout: Duration,
    recheck: Duration,
}

/// What the client and its keeper share: the way to the server, and the session's
/// health as the client knows it.
#[derive(Debug)]
struct Link {
    server: Arc<MemServer>,
    id: SessionId,
    health: watch::Sender<Health>,
    /// When the keeper will conclude the session lost unless a heartbeat is
    /// acknowledged first, read by `lost_now` (as the real adapters do), so that a loss
    /// is known on time even where the keeper has not been run since.
    deadline: SharedDeadline,
}

/// How often a reply held by a partition looks whether the cut healed.
const HELD_REPLY_POLL: Duration = Duration::from_millis(5);

#[derive(Debug, Clone, PartialEq, Eq)]
enum Health {
    Live,
    /// The session can no longer be trusted: expired, or unconfirmed past its deadline.
    Lost(String),
    /// Closed by the client.
    Closed,
}

impl Health {
    /// The error of a call made in this state.
    fn call_error(&self) -> Option<Error> {
        match self {
            Health::Live => None,
            Health::Lost(why) => Some(Error::LockLost(why.clone())),
            Health::Closed => Some(Error::Closed),
        }
    }

    /// The reason `lost()` gives in this state.
    fn lost_error(&self) -> Error {
        match self {
            Health::Live | Health::Lost(_) => self
                .call_error()
                .unwrap_or_else(|| Error::LockLost("the session ended".into())),
            Health::Closed => Error::LockLost("the session was closed".into()),
        }
    }
}

impl Link {
    /// Moves the health out of `Live` (the first verdict stays).
    fn conclude(&self, verdict: Health) {
        self.health.send_if_modified(|h| {
            let first = *h == Health::Live;
            if first {
                *h = verdict;
            }
            first
        });
    }

    /// Completes with the call error once the session is no longer live.
    fn ended(&self) -> impl Future<Output = Error> + 'static {
        let mut rx = self.health.subscribe();
        async move {
            match rx.wait_for(|h| *h != Health::Live).await {
                Ok(h) => h.call_error().unwrap_or(Error::Closed),
                Err(_) => Error::Closed,
            }
        }
    }

    /// Sends one request: refused at once unless the session is live, cut off by a
    /// partition, applied by the server, then its reply delayed or lost by the faults.
    async fn call<T>(
        &self,
        request: Request,
        op: impl FnOnce(&mut Ops<'_>) -> Result<T>,
    ) -> Result<T> {
        if let Some(e) = self.health.borrow().call_error() {
            return Err(e);
        }
        let reply = self.server.request(self.id, request, op)?;
        if !reply.fate.delay.is_zero() {
            let arrives = tokio::time::Instant::now() + reply.fate.delay;
            tokio::select! {
                () = tokio::time::sleep_until(arrives) => {}
                e = self.ended() => {
                    // A closed client hears nothing more. A lost session's reply still
                    // arrives, late, as a real server's does (etcd's and Redis's
                    // requests do not depend on the lease or the watchdog): a grant can
                    // reach a client whose session is already gone.
                    if !matches!(e, Error::LockLost(_)) {
                        return Err(e);
                    }
                    tokio::time::sleep_until(arrives).await;
                }
            }
        }
        // Nor can a reply cross a partition that began while it was on its way: it
        // arrives once the cut heals (TCP retransmits it), however long that took and
        // whatever became of the session meanwhile, as an etcd reply held up by a cut
        // does.
        while self.server.is_partitioned(self.id) {
            if *self.health.borrow() == Health::Closed {
                return Err(Error::Closed);
            }
            tokio::time::sleep(HELD_REPLY_POLL).await;
        }
        if reply.fate.dropped {
            return Err(Error::Unreachable(format!(
                "the in-memory server's reply to session {} was lost",
                self.id
            )));
        }
        if reply.expired {
            self.conclude(Health::Lost(format!("session {} expired", self.id)));
        }
        reply.result
    }
}

impl MemBackend {
    /// Starts the client of session `id`, opened at `connected`, and its keeper.
    pub(crate) fn start(
        server: Arc<MemServer>,
        id: SessionId,
        timeout: Duration,
        connected: Instant,
    ) -> Arc<MemBackend> {
        let (health, _) = watch::channel(Health::Live);
        let deadline = SharedDeadline::unset(connected.into_std());
        // Set before the keeper first runs, which a busy runtime may not get to soon.
        deadline.extend(
            lost_at(connected, timeout).into_std(),
            Instant::now().into_std(),
        );
        let link = Arc::new(Link {
            server,
            id,
            health,
            deadline,
        });
        tokio::spawn(keep(link.clone(), timeout, connected));
        Arc::new(MemBackend {
            link,
            timeout,
            recheck: (timeout / 3).min(Duration::from_secs(1)),
        })
    }

    /// This client's session, by which the [`MemServer`]'s fault hooks name it.
    pub fn session(&self) -> SessionId {
        self.link.id
    }

    /// The server this client talks to.
    pub fn server(&self) -> &Arc<MemServer> {
        &self.link.server
    }

    /// How long a wait goes without a watch event before it checks again: a third of
    /// the session timeout, at most a second (as the Redis adapter's re-check).
    pub fn recheck_interval(&self) -> Duration {
        self.recheck
    }

    async fn call<T>(&self, op: impl FnOnce(&mut Ops<'_>) -> Result<T>) -> Result<T> {
        self.link.call(Request::Call, op).await
    }

    /// Waits for an armed watch's event (`Some`), or for the re-check timer (`None`): a
    /// lost event leaves only the timer.
    async fn wait_armed(&self, armed: oneshot::Receiver<Gone>) -> Result<Option<Gone>> {
        let event = async {
            match armed.await {
                Ok(gone) => gone,
                Err(_) => std::future::pending().await,
            }
        };
        tokio::select! {
            gone = event => Ok(Some(gone)),
            () = tokio::time::sleep(self.recheck) => Ok(None),
            e = self.link.ended() => Err(e),
        }
    }
}

impl Drop for MemBackend {
    fn drop(&mut self) {
        close_session(&self.link);
    }
}

/// Ends the session on the client, then on the server unless the close cannot get
/// there (a partition: the server then expires it by its timeout).
fn close_session(link: &Link) {
    link.conclude(Health::Closed);
    if !link.server.is_partitioned(link.id) {
        link.server.close(link.id);
    }
}

/// When a session whose last acknowledged heartbeat was sent at `acked_sent` is lost:
/// `lost_margin` before the server may expire it.
fn lost_at(acked_sent: Instant, timeout: Duration) -> Instant {
    (acked_sent + timeout)
        .checked_sub(lost_margin(timeout))
        .unwrap_or(acked_sent)
}

/// Why a session is lost whose deadline passed with no heartbeat acknowledged.
fn unacknowledged(id: SessionId, timeout: Duration) -> String {
    format!(
        "no heartbeat of session {id} acknowledged within {:?} of the session timeout \
         {timeout:?}",
        timeout.saturating_sub(lost_margin(timeout)),
    )
}

/// The session keeper: heartbeats every third of the timeout, and the lost verdict once
/// `lost_margin` before the server's earliest deadline passes without an acknowledged
/// heartbeat, counted from when that heartbeat was sent.
async fn keep(link: Arc<Link>, timeout: Duration, connected: Instant) {
    let beat_every = timeout / 3;
    let retry_every = (beat_every / 4).max(Duration::from_millis(1));
    let mut acked_sent = connected;
    let mut next_beat = connected + beat_every;
    let mut in_flight: Option<(Instant, BoxFuture<'static, Result<()>>)> = None;
    loop {
        let lost_at = lost_at(acked_sent, timeout);
        // Moved only while it has not passed: a reader may already have been told the
        // session is lost, and then it is.
        if !link
            .deadline
            .extend(lost_at.into_std(), Instant::now().into_std())
        {
            link.conclude(Health::Lost(unacknowledged(link.id, timeout)));
            return;
        }
        let idle = in_flight.is_none();
        let reply = async {
            match in_flight.as_mut() {
                Some((_, beat)) => beat.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = link.ended() => return,
            () = tokio::time::sleep_until(lost_at) => {
                link.conclude(Health::Lost(unacknowledged(link.id, timeout)));
                return;
            }
            result = reply => {
                let sent = in_flight.take().map_or(acked_sent, |(sent, _)| sent);
                match result {
                    Ok(()) => {
                        acked_sent = acked_sent.max(sent);
                        next_beat = sent + beat_every;
                    }
                    Err(Error::Unreachable(_)) => next_beat = Instant::now() + retry_every,
                    // Expired (the call concluded it) or closed.
                    Err(_) => return,
                }
            }
            () = tokio::time::sleep_until(next_beat), if idle => {
                let beat_link = link.clone();
                let beat = Box::pin(async move {
                    beat_link.call(Request::Heartbeat, |_| Ok(())).await
                });
                in_flight = Some((Instant::now(), beat));
            }
        }
    }
}

impl Backend for MemBackend {
    fn kind(&self) -> &'static str {
        "mem"
    }

    /// ZooKeeper's: the in-memory server models ZooKeeper's queue (sequential entries,
    /// a read beside its writer, payload watches, a value at the lock's own node), so a
    /// name it accepts is one the backend it models most closely accepts too.
    /// ZooKeeper's rules: mem keeps ZooKeeper's layout (sequential entries, a value at
    /// the lock's own node), so a name it takes is one ZooKeeper takes too.
    fn name_rules(&self) -> NameRules {
        NameRules::common()
            .reserving("zookeeper")
            .refusing_entry_like_segments()
    }

    fn session_timeout(&self) -> Duration {
        self.timeout
    }

    /// Both: watches cost nothing here, and `enqueue_removing` is one atomic step, so the
    /// recipes take the paths ZooKeeper takes; a ranked semaphore where the server says
    /// ([`MemServer::rank_semaphores`]), to take etcd's.
    fn hints(&self) -> Hints {
        Hints::new(true, true).with_ranked_semaphore(self.link.server.ranks_semaphores())
    }

    /// Both, as on ZooKeeper: payloads are written and watched, and a queue keeps a
    /// value of its own ([`MemServer::set_value`]).
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
        self.call(move |ops| ops.enqueue(q, ticket, kind, at, data))
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
        self.call(move |ops| ops.enqueue_removing(q, ticket, kind, data, gone_q, gone))
    }

    fn queue(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        self.call(move |ops| Ok(ops.queue(q)))
    }

    fn queue_ahead(
        &self,
        q: &QueuePath,
        mine: &Entry,
    ) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        self.call(move |ops| {
            Ok(ops
                .queue(q)
                .into_iter()
                .filter(|e| not_behind(e, mine))
                .collect())
        })
    }

    /// Compares the token too: an entry re-created under the same name does not count.
    fn contains(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<bool>> + Send {
        self.call(move |ops| Ok(ops.contains(q, entry)))
    }

    async fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> Result<()> {
        self.wait_gone_detail(q, entry).await.map(|_| ())
    }

    /// [`Gone::Head`] when the removal the watch reported found no other entry with a
    /// sequence up to the watched one's, in the same atomic step; [`Gone::Unknown`] when
    /// the entry was found gone by a check. Never [`Gone::Vanished`]: the server loses
    /// no data.
    async fn wait_gone_detail(&self, q: &QueuePath, entry: &Entry) -> Result<Gone> {
        loop {
            let Some(armed) = self.call(|ops| Ok(ops.arm_gone(q, entry))).await? else {
                return Ok(Gone::Unknown);
            };
            if let Some(gone) = self.wait_armed(armed).await? {
                return Ok(gone);
            }
        }
    }

    async fn wait_changed(&self, q: &QueuePath, seen: &[Entry]) -> Result<()> {
        loop {
            let Some(armed) = self.call(|ops| Ok(ops.arm_changed(q, seen))).await? else {
                return Ok(());
            };
            if self.wait_armed(armed).await?.is_some() {
                return Ok(());
            }
        }
    }

    /// Never removes a newer entry of the same name (the token is compared).
    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        self.call(move |ops| {
            ops.remove(q, entry);
            Ok(())
        })
    }

    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        self.call(move |ops| {
            ops.abandon(q, ticket);
            Ok(())
        })
    }

    /// The session's health, read directly (a lost future's first poll may answer
    /// `Pending` to a task whose tokio budget is spent).
    fn lost_now(&self, _q: &QueuePath, _entry: &Entry) -> Option<Error> {
        {
            let health = self.link.health.borrow();
            if *health != Health::Live {
                return Some(health.lost_error());
            }
        }
        self.link
            .deadline
            .passed(Instant::now().into_std())
            .then(|| Error::LockLost(unacknowledged(self.link.id, self.timeout)))
    }

    fn lost(&self, _q: &QueuePath, _entry: &Entry) -> BoxFuture<'static, Error> {
        let mut rx = self.link.health.subscribe();
        Box::pin(async move {
            match rx.wait_for(|h| *h != Health::Live).await {
                Ok(h) => h.lost_error(),
                Err(_) => Error::LockLost("the session ended".into()),
            }
        })
    }

    /// The value set by [`MemServer::set_value`]; empty counts as not set, as on
    /// ZooKeeper.
    fn read_value(&self, q: &QueuePath) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        self.call(move |ops| Ok(ops.read_value(q)))
    }

    fn set_data(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        self.call(move |ops| {
            ops.set_data(q, entry, data);
            Ok(())
        })
    }

    async fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        loop {
            match self.call(|ops| Ok(ops.arm_data(q, entry, seen))).await? {
                Ok(now) => return Ok(now),
                Err(armed) => {
                    // An event or a re-check: read again either way.
                    self.wait_armed(armed).await?;
                }
            }
        }
    }

    /// The queue with every entry's token and payload (no creation time: the server
    /// keeps only `tokio::time`).
    fn participants(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        self.queue(q)
    }

    /// Closes the session: its entries go at once (unless it is cut off, when the server
    /// expires it by its timeout), its `lost()` fires, and every later call fails with
    /// [`Error::Closed`]. Idempotent.
    /// One step on the server: every queue at once, atomically.
    fn list_queues(&self, prefix: &str) -> impl Future<Output = Result<Vec<ListedQueue>>> + Send {
        self.call(move |ops| Ok(ops.list_queues(prefix)))
    }

    /// One request to the server: fails as every call does once the session is over or
    /// while the client is partitioned.
    async fn health(&self) -> Result<()> {
        self.call(move |_ops| Ok(())).await
    }

    async fn close(&self) -> Result<()> {
        close_session(&self.link);
        Ok(())
    }
}
