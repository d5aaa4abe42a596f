//! [`Election`]: leader election over the same fair queue as the [`crate::Mutex`]
//! (etcd's `concurrency.Election`, Curator's `LeaderLatch`), on their wire layouts: a
//! candidate is an [`EntryKind::Candidate`] entry, a `LeaderLatch` node on ZooKeeper
//! and Go's election key on etcd (see `docs/election.md`).
//!
//! A candidacy is one exclusive entry in the election's queue whose payload is the
//! candidate's value. The first entry leads; each candidate watches only the entry
//! ahead of it, so a leader's resignation or loss wakes only the next candidate. The
//! leader's term is its entry's fencing token.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::driver::holders;
use dlock_core::{
    decide, Capability, Decision, DynBackend, Entry, EntryKind, Error, FencingToken, LockName,
    Position, QueuePath, Result,
};
use futures::stream::{BoxStream, StreamExt};
use futures::FutureExt;
use tracing::Instrument;

use crate::guard::{Held, LockGuard};
use crate::queue::{self, Wait};
use crate::Client;

/// A leader election shared by every process that names the same election: at most one
/// candidate leads at a time, candidates lead in the order they campaigned (FIFO), and
/// each leader's term (its fencing token) is larger than its predecessors' where the
/// backend's tokens are ordered (ZooKeeper, etcd, one Redis master; not Redlock: see
/// `dlock_core::FencingToken`).
///
/// The election's queue is the one a [`crate::Mutex`] of the same name uses: a mutex and
/// an election of one name exclude each other. Use distinct names.
///
/// Cheap to clone; clones share the client's session.
///
/// # Session loss
/// A candidate's entry lives as long as its client's session. A campaign waiting when the
/// session ends fails with [`Error::LockLost`]; a leader's [`Leadership::lost`] fires
/// before any other candidate can lead.
pub struct Election<B: DynBackend + ?Sized = dyn DynBackend> {
    client: Client<B>,
    name: LockName,
}

// Written out because a derive would demand `B: Clone + Debug`, which `dyn DynBackend` is not.
impl<B: DynBackend + ?Sized> Clone for Election<B> {
    fn clone(&self) -> Self {
        Election {
            client: self.client.clone(),
            name: self.name.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for Election<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Election")
            .field("name", &self.name.as_str())
            .finish()
    }
}

/// The leader of an election as read from the server ([`Election::leader`],
/// [`Election::observe`]). More fields may come.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Leader {
    /// The value the leader campaigned with, or last proclaimed
    /// ([`Leadership::proclaim`]).
    pub value: Vec<u8>,
    /// The leader's term: its entry's fencing token, as [`Leadership::term`] reports it
    /// to the leader itself.
    pub term: FencingToken,
    /// The name of the leader's entry on the server (a znode name, the last part of a
    /// key), for logs and status output.
    pub entry: String,
}

impl Leader {
    /// The value as UTF-8 text, if it is.
    pub fn value_str(&self) -> Option<&str> {
        std::str::from_utf8(&self.value).ok()
    }
}

impl<B: DynBackend + ?Sized> Election<B> {
    pub(crate) fn new(client: Client<B>, name: LockName) -> Self {
        Election { client, name }
    }

    /// The election's name.
    pub fn name(&self) -> &LockName {
        &self.name
    }

    fn queue(&self) -> QueuePath {
        QueuePath::root(self.name.clone())
    }

    /// Stands for election with `value` and waits until this candidate leads, however
    /// long that takes. Candidates lead in the order they campaigned; while it waits, this
    /// candidate watches only the candidate ahead of it.
    ///
    /// Never re-entrant: a second campaign through the same client (or in the task that
    /// leads) is one more candidate, queued behind the first; awaiting it while holding
    /// the first [`Leadership`] waits for itself.
    ///
    /// # Errors
    /// [`Error::LockLost`] if the session ends while waiting ([`Error::Closed`] after
    /// [`Client::close`]); a backend error.
    ///
    /// # Cancel safety
    /// Cancel-safe: dropping the future withdraws the candidacy (its entry is removed, in
    /// the background if need be). Nothing is left behind.
    ///
    /// # Upstream
    /// etcd `concurrency.Election.Campaign`; Curator `LeaderLatch.start()` + `await()`.
    pub async fn campaign(&self, value: impl AsRef<[u8]>) -> Result<Leadership<B>> {
        self.campaign_with(value.as_ref(), Wait::Forever).await
    }

    /// [`Election::campaign`], waiting at most `timeout`. A zero timeout asks once: an
    /// election nobody leads is won (one round trip), a led one gives
    /// [`Error::Timeout`] at once.
    ///
    /// # Errors
    /// [`Error::Timeout`], with the candidacy withdrawn before it returns; as
    /// [`Election::campaign`] otherwise.
    ///
    /// # Cancel safety
    /// As [`Election::campaign`].
    ///
    /// # Upstream
    /// Curator `LeaderLatch.await(timeout, unit)` (which returns `false` where dlock
    /// returns [`Error::Timeout`]).
    pub async fn campaign_timeout(
        &self,
        value: impl AsRef<[u8]>,
        timeout: Duration,
    ) -> Result<Leadership<B>> {
        self.campaign_with(value.as_ref(), Wait::timeout(timeout))
            .await
    }

    /// Leads only if nobody leads or campaigns ahead; never waits.
    ///
    /// # Errors
    /// [`Error::WouldBlock`] if another candidate leads or waits ahead; the candidacy is
    /// withdrawn before this returns. As [`Election::campaign`] otherwise.
    ///
    /// # Cancel safety
    /// As [`Election::campaign`].
    pub async fn try_campaign(&self, value: impl AsRef<[u8]>) -> Result<Leadership<B>> {
        self.campaign_with(value.as_ref(), Wait::No).await
    }

    async fn campaign_with(&self, value: &[u8], wait: Wait) -> Result<Leadership<B>> {
        let backend = &self.client.backend;
        let q = self.queue();
        let span = tracing::debug_span!(
            "dlock.acquire",
            lock = %self.name,
            kind = "election",
            token = tracing::field::Empty,
            wait_ms = tracing::field::Empty
        );
        let asked = tokio::time::Instant::now();
        let ticket = self.client.tickets.ticket();
        let result = async {
            let rt = self.client.cleanup_runtime();
            let entry = queue::acquire(
                backend,
                &q,
                ticket,
                EntryKind::Candidate,
                Position::Tail,
                value,
                wait,
                &rt,
            )
            .instrument(span.clone())
            .await?;
            // No reentry key: an election is never re-entered.
            Held::grant(backend.clone(), q.clone(), entry, None, rt).await
        }
        .await
        // A guard before the metrics and the log line: see `Client::acquire_reentrant_with`.
        .map(LockGuard::new);
        crate::metrics::acquire(backend.kind(), "election", asked.elapsed(), &result);
        let guard = result?;
        span.record("token", guard.token().get());
        span.record("wait_ms", asked.elapsed().as_secs_f64() * 1e3);
        tracing::debug!(parent: &span, "elected");
        Ok(Leadership {
            value: std::sync::Mutex::new(value.to_vec()),
            guard,
        })
    }

    /// The current leader, or `None` if nobody campaigns. One listing of the candidates
    /// with their values (on ZooKeeper a sync, a listing and one read per candidate; on
    /// etcd one linearizable range read; on Redis one script).
    ///
    /// # Errors
    /// A backend error.
    ///
    /// # Upstream
    /// etcd `concurrency.Election.Leader`; Curator `LeaderLatch.getLeader()`.
    pub async fn leader(&self) -> Result<Option<Leader>> {
        let entries = self.client.backend.participants(&self.queue()).await?;
        Ok(leader_of(self.client.backend.kind(), &entries)?.map(|(l, _)| l))
    }

    /// The leaders of this election as they change: first the current one (`None` if
    /// nobody campaigns), then an item each time the leader, its term or its value
    /// changes, in the order the changes happened. Driven by the backend's watches (the
    /// leader's entry going, its value changing, the empty election gaining a
    /// candidate), never by polling; each wake-up costs one listing as
    /// [`Election::leader`]'s.
    ///
    /// Changes closer together than that listing may be seen as one: the stream never
    /// yields a leader older than one it yielded, nor the same leader twice in a row,
    /// but a leader that led only briefly may be skipped. On Redis a candidate joining an
    /// empty election is seen at the backend's next re-check (removals are published,
    /// additions are not); a proclaimed value is published to the leader's entry's
    /// data channel (one master, Sentinel, Cluster), and Redlock has no proclaim.
    ///
    /// After an error (yielded as an item) the stream ends; call `observe` again to
    /// resume. Dropping the stream stops its watches.
    ///
    /// # Upstream
    /// etcd `concurrency.Election.Observe`.
    pub fn observe(&self) -> BoxStream<'static, Result<Option<Leader>>> {
        let state = Observer {
            backend: self.client.backend.clone(),
            q: self.queue(),
            listing: None,
            last: None,
            done: false,
        };
        futures::stream::unfold(state, |mut s| async move {
            if s.done {
                return None;
            }
            match s.next().await {
                Ok(leader) => Some((Ok(leader), s)),
                Err(e) => {
                    s.done = true;
                    Some((Err(e), s))
                }
            }
        })
        .boxed()
    }
}

/// The state of [`Election::observe`] between two items.
struct Observer<B: DynBackend + ?Sized> {
    backend: Arc<B>,
    q: QueuePath,
    /// The last listing: `None` before the first.
    listing: Option<Vec<Entry>>,
    /// The last leader yielded: `None` before the first item.
    last: Option<Option<Leader>>,
    done: bool,
}

impl<B: DynBackend + ?Sized> Observer<B> {
    /// Waits for the next change of leader (the first item at once) and returns it.
    async fn next(&mut self) -> Result<Option<Leader>> {
        loop {
            if let Some(listing) = &self.listing {
                self.wait(listing).await?;
            }
            let entries = self.backend.participants(&self.q).await?;
            let now = leader_of(self.backend.kind(), &entries)?.map(|(l, _)| l);
            self.listing = Some(entries);
            if self.last.as_ref() != Some(&now) {
                self.last = Some(now.clone());
                return Ok(now);
            }
        }
    }

    /// Completes once `listing`'s leader may have changed: its entry went or its value
    /// changed, or, with no leader, the queue changed.
    async fn wait(&self, listing: &[Entry]) -> Result<()> {
        let head = holders(listing).first().copied();
        match head {
            None => self.backend.wait_changed(&self.q, listing).await,
            Some(head) => {
                let gone = self.backend.wait_gone(&self.q, head);
                let changed = if self.backend.supports(Capability::Proclaim) {
                    self.backend
                        .wait_data_changed(&self.q, head, &head.data)
                        .map(|r| r.map(|_| ()))
                        .boxed()
                } else {
                    futures::future::pending().boxed()
                };
                tokio::select! {
                    r = gone => r,
                    r = changed => r,
                }
            }
        }
    }
}

/// The leader of a listing with details ([`DynBackend::participants`]) and its entry.
fn leader_of<'a>(
    backend: &'static str,
    entries: &'a [Entry],
) -> Result<Option<(Leader, &'a Entry)>> {
    let Some(head) = holders(entries).first().copied() else {
        return Ok(None);
    };
    let term = head.token.ok_or_else(|| {
        Error::backend(
            "reading the leader",
            format!(
                "the {backend} backend gave no fencing token for {}",
                head.name
            ),
        )
    })?;
    Ok(Some((
        Leader {
            value: head.data.clone(),
            term,
            entry: head.name.clone(),
        },
        head,
    )))
}

/// Leading an election: proof that this candidate's entry was first in the election's
/// queue, with its term (fencing token) and lost signal. Resigns when
/// [`Leadership::resign`] is awaited or when dropped (in the background, on the current
/// tokio runtime).
///
/// Never re-entered: there is no second guard of a leadership.
#[must_use = "the leadership is resigned as soon as it is dropped"]
pub struct Leadership<B: DynBackend + ?Sized = dyn DynBackend> {
    guard: LockGuard<B>,
    /// The value last written (campaigned with or proclaimed).
    value: std::sync::Mutex<Vec<u8>>,
}

impl<B: DynBackend + ?Sized> Leadership<B> {
    /// The election's name.
    pub fn name(&self) -> &LockName {
        self.guard.name()
    }

    /// This leader's term: its entry's fencing token. A later leader's term is larger on
    /// ZooKeeper and etcd, on one Redis master as long as its clock does not step back,
    /// and not ordered on Redlock (see `dlock_core::FencingToken`). Pass it to the
    /// storage the leader writes, which must reject a lower term than one it has seen.
    pub fn term(&self) -> FencingToken {
        self.guard.token()
    }

    /// The value this leader campaigned with or last proclaimed (local: no round trip).
    pub fn value(&self) -> Vec<u8> {
        self.value
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }

    /// The entry that leads on the server.
    pub fn entry(&self) -> &Entry {
        self.guard.entry()
    }

    /// Completes with [`Error::LockLost`] once this leadership can no longer be trusted:
    /// the session expired, the client was cut off longer than the session timeout, or
    /// the lease could not be renewed. It completes before another candidate can lead, so
    /// stop acting as leader when it does.
    ///
    /// Never completes while leading. Cancel-safe, and it borrows nothing.
    pub fn lost(&self) -> impl std::future::Future<Output = Error> + Send + 'static {
        self.guard.lost()
    }

    /// True once the client knows this leadership is lost (see [`LockGuard::is_lost`]).
    pub fn is_lost(&self) -> bool {
        self.guard.is_lost()
    }

    /// Asks the server, in one round trip, whether this leader's entry is still there
    /// (with the same token where the backend keeps one) and still first of the
    /// election's queue, and fails if not. [`Leadership::lost`] fires only once the
    /// client has learned of a loss; call `verify` before committing a leader's effects
    /// to learn of a loss it has not seen yet.
    ///
    /// Two reads, sent together: the entry's presence as [`LockGuard::verify`] asks it
    /// ([`dlock_core::DynBackend::contains`]), never from a possibly stale copy (on
    /// ZooKeeper it follows a `sync` through the leader, so a follower that trails the
    /// leader, or is cut off from it and does not know yet, cannot confirm an entry the
    /// leader already deleted), and the entries ahead of it, since presence alone does
    /// not show the lead where an entry can come to sort ahead of a leader (Redlock,
    /// after a master lost its keys and accepted a lower proposal).
    ///
    /// # Errors
    /// [`Error::LockLost`] if the lost signal has fired, the entry is gone or it no
    /// longer leads; the backend's error if the server could not be asked (unconfirmed,
    /// not known lost).
    pub async fn verify(&self) -> Result<()> {
        let held = self.guard.held();
        if let Some(reason) = held.lost_reason() {
            return Err(Error::LockLost(reason));
        }
        let (present, ahead) = futures::future::join(
            held.backend.contains(&held.q, &held.entry),
            held.backend.queue_ahead(&held.q, &held.entry),
        )
        .await;
        let (present, ahead) = (present?, ahead?);
        if let Some(reason) = held.lost_reason() {
            return Err(Error::LockLost(reason));
        }
        if !present {
            return Err(Error::LockLost(format!(
                "{}: entry {} is no longer on the server",
                held.q.lock, held.entry.name
            )));
        }
        let mine = ahead.iter().find(|e| e.name == held.entry.name);
        let leads = matches!(decide(&ahead, &held.entry.name), Decision::Acquired)
            && mine.is_some_and(|e| held.entry.token_matches(e.token));
        if leads {
            Ok(())
        } else {
            Err(Error::LockLost(format!(
                "{}: entry {} no longer leads",
                held.q.lock, held.entry.name
            )))
        }
    }

    /// Replaces this leader's value without giving up the lead: what
    /// [`Election::leader`] and [`Election::observe`] report from then on. Writes the
    /// entry's payload, then confirms the entry still leads ([`Leadership::verify`]):
    /// two round trips (three on Redis with `?replicas=N`, which waits for the replicas
    /// to have the value).
    ///
    /// # Errors
    /// [`Error::Unsupported`] at once, with nothing written, on a backend without
    /// [`Capability::Proclaim`] (ZooKeeper, etcd, one Redis master alone, through
    /// Sentinel or in a Redis Cluster, and the in-memory backend have it; Redlock does
    /// not); [`Error::LockLost`] if the leadership is lost (on etcd nothing is written
    /// then, as Go's `Proclaim` guards its put with the key's create revision; on Redis
    /// nothing either, as one script writes only while the entry exists with its token
    /// and leads its queue; on ZooKeeper the value may have been written to the gone
    /// entry, which nobody reads); on Redis with `?replicas=N`, [`Error::Unreachable`]
    /// when the replicas did not acknowledge the value in time (it is on the primary,
    /// where observers may already have read it, and may be lost in a failover); a
    /// backend error.
    ///
    /// On ZooKeeper, a Curator `LeaderLatch` queued right behind this leader misses the
    /// leader's resignation after a proclaim: its watch on the node ahead acts only on
    /// a deletion, and the data change uses that one-shot watch up. Proclaim only in
    /// elections without Curator latches (see `docs/election.md`).
    ///
    /// # Upstream
    /// etcd `concurrency.Election.Proclaim`.
    pub async fn proclaim(&self, value: impl AsRef<[u8]>) -> Result<()> {
        let held = self.guard.held();
        if !held.backend.supports(Capability::Proclaim) {
            return Err(Error::Unsupported {
                backend: held.backend.kind(),
                capability: Capability::Proclaim,
            });
        }
        if let Some(reason) = held.lost_reason() {
            return Err(Error::LockLost(reason));
        }
        let value = value.as_ref();
        held.backend.proclaim(&held.q, &held.entry, value).await?;
        self.verify().await?;
        *self
            .value
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = value.to_vec();
        Ok(())
    }

    /// Gives up the lead: removes this candidate's entry, which wakes the next candidate
    /// (only it). Dropping the leadership does the same in the background.
    ///
    /// # Errors
    /// [`Error::LockLost`] if the leadership had been lost before; a backend error if
    /// the removal failed (it is then retried in the background while the session
    /// lives).
    ///
    /// # Cancel safety
    /// If the future is dropped before it completes, the entry is removed in the
    /// background.
    ///
    /// # Upstream
    /// etcd `concurrency.Election.Resign`; Curator `LeaderLatch.close()`.
    pub async fn resign(mut self) -> Result<()> {
        self.guard.release().await
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for Leadership<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leadership")
            .field("election", &self.name().as_str())
            .field("entry", &self.entry().name)
            .field("term", &self.term())
            .finish()
    }
}
