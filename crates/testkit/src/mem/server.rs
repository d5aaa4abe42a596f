//! The server side: queues, the revision, sessions and watches, all behind one lock.
//!
//! Every operation runs whole under the lock, so each is atomic and linearizable, as a
//! ZooKeeper `multi`, an etcd transaction or a Redis script is. A watch event is sent
//! only after the change that fires it is applied, so it never arrives before the change
//! is visible to reads; faults may make it late, or lose it.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Weak};
use std::time::Duration;

use dlock_core::entry::{format_seq, queue_order};
use dlock_core::{
    Enqueued, Entry, EntryKind, Error, FencingToken, Gone, ListedQueue, LockName, Position,
    QueuePath, Result, SessionOptions, Ticket,
};
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::faults::{deliver, EventFate, FaultPlan, ReplyFate, Request, SessionFaults};
use super::{MemBackend, SessionId};

/// The session timeout of a [`MemServer::connect`] whose options name none.
pub const DEFAULT_SESSION_TIMEOUT: Duration = Duration::from_secs(10);

/// A queue's key: a [`QueuePath`] in an order, so that every walk over the queues (a
/// session's expiry) fires its watch events, and draws their faults, in one order.
type QueueKey = (LockName, Option<&'static str>);

/// An in-memory lock server shared by any number of [`MemBackend`] sessions.
///
/// It keeps queues of entries keyed by [`QueuePath`], one global revision that strictly
/// increases with every entry added (each entry's sequence and fencing token), the
/// values read by [`dlock_core::Backend::read_value`], sessions with their deadlines,
/// and watches. Its clock is `tokio::time`: under `tokio::time::pause()` it runs on
/// virtual time, which is then the clock of the runtime that calls it, so a server under
/// paused time must be used from one runtime only.
///
/// The fault hooks act on one session by its [`SessionId`] ([`MemBackend::session`]).
#[derive(Debug)]
pub struct MemServer {
    state: Mutex<State>,
    plan: Option<FaultPlan>,
    /// See [`MemServer::rank_semaphores`].
    ranked: AtomicBool,
}

#[derive(Debug, Default)]
struct State {
    revision: u64,
    queues: BTreeMap<QueueKey, Queue>,
    values: BTreeMap<QueueKey, Vec<u8>>,
    sessions: BTreeMap<SessionId, Session>,
    next_session: u64,
}

#[derive(Debug, Default)]
struct Queue {
    /// By `(seq, name)`: [`queue_order`].
    entries: BTreeMap<(u64, String), Stored>,
    watches: Vec<Watch>,
}

#[derive(Debug)]
struct Stored {
    entry: Entry,
    session: SessionId,
}

#[derive(Debug)]
struct Watch {
    target: Target,
    session: SessionId,
    tx: oneshot::Sender<Gone>,
}

#[derive(Debug, PartialEq, Eq)]
enum Target {
    /// The removal of the entry of this name.
    Removed(String),
    /// Any entry added to or removed from the queue.
    Children,
    /// A payload change or the removal of the entry of this name.
    Data(String),
}

#[derive(Debug)]
struct Session {
    timeout: Duration,
    /// The server expires the session at this moment unless a heartbeat comes first.
    deadline: Instant,
    ended: Option<Ended>,
    faults: SessionFaults,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ended {
    Expired,
    Closed,
}

/// A change to a queue, for its watches.
enum Change {
    Added,
    Removed { name: String, head: bool },
    Data(String),
}

/// The server's answer to one request, before the faults act on its way back.
pub(crate) struct Reply<T> {
    pub(crate) result: Result<T>,
    pub(crate) fate: ReplyFate,
    /// The session had expired: the request was refused.
    pub(crate) expired: bool,
}

/// A watch armed by a wait: `None` when the awaited change has already happened.
pub(crate) type Armed = Option<oneshot::Receiver<Gone>>;

impl MemServer {
    /// A server with no faults beyond those set per call.
    pub fn new() -> Arc<MemServer> {
        Arc::new(MemServer {
            state: Mutex::new(State::default()),
            plan: None,
            ranked: AtomicBool::new(false),
        })
    }

    /// A server whose sessions also draw faults from `plan`, each from its own generator
    /// seeded by the plan's seed and the session's number.
    pub fn with_faults(plan: FaultPlan) -> Arc<MemServer> {
        Arc::new(MemServer {
            state: Mutex::new(State::default()),
            plan: Some(plan),
            ranked: AtomicBool::new(false),
        })
    }

    /// Has every client of this server say [`dlock_core::Hints::ranked_semaphore`] (off
    /// by default: mem takes ZooKeeper's paths), so the recipes' etcd semaphore runs here
    /// too. Set it before any client takes a semaphore: clients of one name must agree.
    pub fn rank_semaphores(&self, on: bool) {
        self.ranked.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Whether [`MemServer::rank_semaphores`] is on.
    pub(crate) fn ranks_semaphores(&self) -> bool {
        self.ranked.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Opens a session and returns its client, which keeps it alive with heartbeats
    /// until it is closed or dropped. `opts.session_timeout` of `None` takes
    /// [`DEFAULT_SESSION_TIMEOUT`]; `opts.connect_timeout` is not used (connecting cannot
    /// fail on its way).
    ///
    /// # Errors
    /// [`Error::Unreachable`] when called outside a tokio runtime, which the session's
    /// keeper and expiry timer need.
    pub async fn connect(self: &Arc<Self>, opts: SessionOptions) -> Result<Arc<MemBackend>> {
        let runtime = tokio::runtime::Handle::try_current()
            .map_err(|e| Error::Unreachable(format!("the in-memory server needs tokio: {e}")))?;
        let timeout = opts.session_timeout_or(DEFAULT_SESSION_TIMEOUT);
        let now = Instant::now();
        let id = {
            let mut st = self.state.lock();
            st.next_session += 1;
            let id = SessionId(st.next_session);
            let faults = SessionFaults::new(self.plan.as_ref(), id.0);
            st.sessions.insert(
                id,
                Session {
                    timeout,
                    deadline: now + timeout,
                    ended: None,
                    faults,
                },
            );
            id
        };
        runtime.spawn(reap(Arc::downgrade(self), id));
        Ok(MemBackend::start(self.clone(), id, timeout, now))
    }

    /// The highest revision handed out so far: the sequence and token of the newest
    /// entry.
    pub fn revision(&self) -> u64 {
        self.state.lock().revision
    }

    /// A fault made outside the protocol, as an operator's `delete` or a revoked lease
    /// makes it: deletes the entry of `q` that `choose` picks from the queue as it stands
    /// (in queue order), in one atomic step with the pick, firing the watches a removal
    /// fires. Its session goes on and is not told. Returns the entry deleted, if any.
    pub fn delete_from_outside(
        &self,
        q: &QueuePath,
        choose: impl FnOnce(&[Entry]) -> Option<usize>,
    ) -> Option<Entry> {
        let mut st = self.state.lock();
        st.sweep(Instant::now());
        let queue = st.list(q);
        let victim = queue.get(choose(&queue)?)?.clone();
        st.remove_where(q, |e| e.name == victim.name);
        Some(victim)
    }

    /// Whether the session is still alive on the server (neither expired nor closed).
    /// Expires it first if its deadline has passed.
    pub fn is_alive(&self, id: SessionId) -> bool {
        let mut st = self.state.lock();
        st.sweep(Instant::now());
        st.sessions.get(&id).is_some_and(|s| s.ended.is_none())
    }

    /// Sets (`Some`) or clears (`None`) the value read at queue `q` by
    /// [`dlock_core::Backend::read_value`]: a semaphore's shared count lives at
    /// [`QueuePath::root`] of the count's name, as 4 big-endian bytes.
    pub fn set_value(&self, q: &QueuePath, value: Option<Vec<u8>>) {
        let mut st = self.state.lock();
        match value {
            Some(v) => st.values.insert(key(q), v),
            None => st.values.remove(&key(q)),
        };
    }

    pub(crate) fn session_faults(&self, id: SessionId, f: impl FnOnce(&mut SessionFaults)) {
        if let Some(s) = self.state.lock().sessions.get_mut(&id) {
            f(&mut s.faults);
        }
    }

    /// Runs one request of session `id` through the faults and, if it reaches the
    /// server, applies `op` atomically. Fails with [`Error::Unreachable`] if it does not
    /// reach the server.
    pub(crate) fn request<T>(
        &self,
        id: SessionId,
        request: Request,
        op: impl FnOnce(&mut Ops<'_>) -> Result<T>,
    ) -> Result<Reply<T>> {
        let now = Instant::now();
        let mut st = self.state.lock();
        st.sweep(now);
        let Some(session) = st.sessions.get_mut(&id) else {
            return Err(Error::Closed);
        };
        if session.faults.partitioned {
            return Err(Error::Unreachable(format!(
                "session {id} is cut off from the in-memory server"
            )));
        }
        let fate = session.faults.reply(request);
        let ended = session.ended;
        if ended.is_none() && request == Request::Heartbeat {
            session.deadline = now + session.timeout;
        }
        let result = match ended {
            Some(Ended::Expired) => Err(Error::LockLost(format!("session {id} expired"))),
            Some(Ended::Closed) => Err(Error::Closed),
            None => op(&mut Ops { st: &mut st, id }),
        };
        Ok(Reply {
            result,
            fate,
            expired: ended == Some(Ended::Expired),
        })
    }

    /// Expires session `id` now; returns whether it was alive.
    pub(crate) fn expire(&self, id: SessionId) -> bool {
        self.state.lock().end(id, Ended::Expired)
    }

    /// Closes session `id` on the server: its entries go at once. Idempotent.
    pub(crate) fn close(&self, id: SessionId) {
        self.state.lock().end(id, Ended::Closed);
    }

    /// Whether session `id` is cut off (a close cannot reach the server then).
    pub(crate) fn is_partitioned(&self, id: SessionId) -> bool {
        self.state
            .lock()
            .sessions
            .get(&id)
            .is_some_and(|s| s.faults.partitioned)
    }
}

/// The server's expiry timer of one session: expires it once its deadline passes without
/// a heartbeat. Every request also expires overdue sessions first, so a session whose
/// timer's runtime has shut down still expires.
async fn reap(server: Weak<MemServer>, id: SessionId) {
    loop {
        let deadline = {
            let Some(server) = server.upgrade() else {
                return;
            };
            let mut st = server.state.lock();
            st.sweep(Instant::now());
            match st.sessions.get(&id) {
                Some(s) if s.ended.is_none() => s.deadline,
                _ => return,
            }
        };
        tokio::time::sleep_until(deadline).await;
    }
}

/// The operations of one request, applied under the server's lock for session `id`.
pub(crate) struct Ops<'a> {
    st: &'a mut State,
    id: SessionId,
}

impl Ops<'_> {
    /// Adds an entry for `ticket` (or finds the one it already added: a retry after a
    /// lost reply adds nothing twice).
    pub(crate) fn enqueue(
        &mut self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        let mine = match self.st.find_own(q, ticket, kind) {
            Some(e) => e,
            None => {
                let seq = match at {
                    Position::Tail => self.st.revision + 1,
                    Position::Beside(writer) => match self.st.stored(q, writer) {
                        Some(w) if w.session == self.id => w.entry.seq,
                        _ => {
                            return Err(Error::LockLost(format!(
                                "the write entry {} beside which a read entry was asked for \
                                 is not this session's in {q}",
                                writer.name
                            )))
                        }
                    },
                };
                self.st.add(q, self.id, ticket, kind, seq, data)
            }
        };
        Ok(Enqueued {
            queue: self.st.list(q),
            mine,
        })
    }

    /// Adds an entry for `ticket` at the tail of `q` and removes `gone` from `gone_q`, in
    /// one step; a retry finds the entry `ticket` already added.
    pub(crate) fn enqueue_removing(
        &mut self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> Result<Entry> {
        if let Some(e) = self.st.find_own(q, ticket, kind) {
            return Ok(e);
        }
        if self.st.stored(gone_q, gone).is_none() {
            return Err(Error::LockLost(format!(
                "held entry {} vanished from {gone_q} before it was handed on",
                gone.name
            )));
        }
        self.st.remove_where(gone_q, |e| e.name == gone.name);
        let seq = self.st.revision + 1;
        Ok(self.st.add(q, self.id, ticket, kind, seq, data))
    }

    /// The queue in queue order.
    pub(crate) fn queue(&mut self, q: &QueuePath) -> Vec<Entry> {
        self.st.list(q)
    }

    /// Every queue with an entry whose path starts with `prefix`, sorted by path: the
    /// whole server is read in one step, so the listing is one atomic view.
    pub(crate) fn list_queues(&mut self, prefix: &str) -> Vec<ListedQueue> {
        let mut out: Vec<ListedQueue> = self
            .st
            .queues
            .iter()
            .filter(|(_, queue)| !queue.entries.is_empty())
            .map(|((lock, sub), queue)| {
                let path = QueuePath {
                    lock: lock.clone(),
                    sub: *sub,
                }
                .relative();
                (path, queue)
            })
            .filter(|(path, _)| path.starts_with(prefix))
            .map(|(path, queue)| {
                let entries = queue.entries.values().map(|s| s.entry.clone()).collect();
                ListedQueue::new(path, entries)
            })
            .collect();
        out.sort_by(|a, b| a.path.cmp(&b.path));
        out
    }

    /// Whether `entry` (its name, and its token where known) is in `q`.
    pub(crate) fn contains(&mut self, q: &QueuePath, entry: &Entry) -> bool {
        self.st.stored(q, entry).is_some()
    }

    /// Removes `entry` unless it is gone or a newer entry has its name.
    pub(crate) fn remove(&mut self, q: &QueuePath, entry: &Entry) {
        if self.st.stored(q, entry).is_some() {
            self.st.remove_where(q, |e| e.name == entry.name);
        }
    }

    /// Removes every entry `ticket` created in `q`.
    pub(crate) fn abandon(&mut self, q: &QueuePath, ticket: &Ticket) {
        self.st.remove_where(q, |e| e.is_from(ticket));
    }

    /// Arms a watch on the removal of `entry`, unless it is already gone.
    pub(crate) fn arm_gone(&mut self, q: &QueuePath, entry: &Entry) -> Armed {
        self.st.stored(q, entry)?;
        Some(self.arm(q, Target::Removed(entry.name.clone())))
    }

    /// Arms a watch on any change of `q`, unless its entries already differ from `seen`.
    pub(crate) fn arm_changed(&mut self, q: &QueuePath, seen: &[Entry]) -> Armed {
        let now = self.st.list(q);
        let same =
            now.len() == seen.len() && seen.iter().all(|s| now.iter().any(|e| e.name == s.name));
        if !same {
            return None;
        }
        Some(self.arm(q, Target::Children))
    }

    /// The payload of `entry` if it differs from `seen` (`Ok(None)` if the entry is
    /// gone), or a watch armed on its next change.
    pub(crate) fn arm_data(
        &mut self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> Result<Option<Vec<u8>>, oneshot::Receiver<Gone>> {
        match self.st.stored(q, entry) {
            None => Ok(None),
            Some(s) if s.entry.data != seen => Ok(Some(s.entry.data.clone())),
            Some(_) => Err(self.arm(q, Target::Data(entry.name.clone()))),
        }
    }

    /// Replaces the payload of `entry`, if it is still there.
    pub(crate) fn set_data(&mut self, q: &QueuePath, entry: &Entry, data: &[u8]) {
        let Some(queue) = self.st.queues.get_mut(&key(q)) else {
            return;
        };
        let Some(stored) = queue
            .entries
            .values_mut()
            .find(|s| s.entry.name == entry.name && entry.token_matches(s.entry.token))
        else {
            return;
        };
        stored.entry.data = data.to_vec();
        self.st.fire(q, &[Change::Data(entry.name.clone())]);
    }

    /// The value stored at `q` itself.
    pub(crate) fn read_value(&mut self, q: &QueuePath) -> Option<Vec<u8>> {
        self.st
            .values
            .get(&key(q))
            .filter(|v| !v.is_empty())
            .cloned()
    }

    fn arm(&mut self, q: &QueuePath, target: Target) -> oneshot::Receiver<Gone> {
        let (tx, rx) = oneshot::channel();
        let queue = self.st.queues.entry(key(q)).or_default();
        // Waits that were cancelled or re-armed leave closed watches behind.
        queue.watches.retain(|w| !w.tx.is_closed());
        queue.watches.push(Watch {
            target,
            session: self.id,
            tx,
        });
        rx
    }
}

impl State {
    /// Expires every live session whose deadline is not after `now`.
    fn sweep(&mut self, now: Instant) {
        let overdue: Vec<SessionId> = self
            .sessions
            .iter()
            .filter(|(_, s)| s.ended.is_none() && s.deadline <= now)
            .map(|(id, _)| *id)
            .collect();
        for id in overdue {
            self.end(id, Ended::Expired);
        }
    }

    /// Ends a session and removes its entries; returns whether it was alive.
    fn end(&mut self, id: SessionId, how: Ended) -> bool {
        let Some(session) = self.sessions.get_mut(&id) else {
            return false;
        };
        if session.ended.is_some() {
            return false;
        }
        session.ended = Some(how);
        let owned: Vec<QueueKey> = self
            .queues
            .iter()
            .filter(|(_, queue)| queue.entries.values().any(|s| s.session == id))
            .map(|(k, _)| k.clone())
            .collect();
        for (lock, sub) in owned {
            let q = QueuePath { lock, sub };
            self.remove_owned(&q, id);
        }
        // Its own watches will never be delivered.
        for queue in self.queues.values_mut() {
            queue.watches.retain(|w| w.session != id);
        }
        true
    }

    fn remove_owned(&mut self, q: &QueuePath, id: SessionId) {
        let Some(queue) = self.queues.get(&key(q)) else {
            return;
        };
        let names: Vec<String> = queue
            .entries
            .values()
            .filter(|s| s.session == id)
            .map(|s| s.entry.name.clone())
            .collect();
        self.remove_where(q, |e| names.contains(&e.name));
    }

    /// The entry `ticket` added to `q` as `kind`, if it is there.
    fn find_own(&self, q: &QueuePath, ticket: &Ticket, kind: EntryKind) -> Option<Entry> {
        let queue = self.queues.get(&key(q))?;
        queue
            .entries
            .values()
            .find(|s| s.entry.is_from(ticket) && s.entry.kind == kind)
            .map(|s| s.entry.clone())
    }

    /// The stored entry with `entry`'s name, if its token matches where both are known.
    fn stored(&self, q: &QueuePath, entry: &Entry) -> Option<&Stored> {
        let queue = self.queues.get(&key(q))?;
        queue
            .entries
            .get(&(entry.seq, entry.name.clone()))
            .or_else(|| queue.entries.values().find(|s| s.entry.name == entry.name))
            .filter(|s| entry.token_matches(s.entry.token))
    }

    fn list(&self, q: &QueuePath) -> Vec<Entry> {
        self.queues
            .get(&key(q))
            .map(|queue| queue.entries.values().map(|s| s.entry.clone()).collect())
            .unwrap_or_default()
    }

    /// Adds an entry at sequence `seq` with the next revision as its token.
    fn add(
        &mut self,
        q: &QueuePath,
        session: SessionId,
        ticket: &Ticket,
        kind: EntryKind,
        seq: u64,
        data: &[u8],
    ) -> Entry {
        self.revision += 1;
        let entry = Entry {
            name: format!("{}{}", ticket.name_prefix(kind), format_seq(seq)),
            kind,
            seq,
            token: Some(FencingToken::new(self.revision)),
            ticket: Some(ticket.as_str().to_owned()),
            created_ms: None,
            data: data.to_vec(),
        };
        let queue = self.queues.entry(key(q)).or_default();
        queue.entries.insert(
            (seq, entry.name.clone()),
            Stored {
                entry: entry.clone(),
                session,
            },
        );
        self.fire(q, &[Change::Added]);
        entry
    }

    /// Removes every entry of `q` matching `pred` in one step. Each removed entry was the
    /// head if no other entry queued before the step had a sequence up to its own.
    fn remove_where(&mut self, q: &QueuePath, pred: impl Fn(&Entry) -> bool) {
        let Some(queue) = self.queues.get_mut(&key(q)) else {
            return;
        };
        let gone: Vec<(u64, String)> = queue
            .entries
            .iter()
            .filter(|(_, s)| pred(&s.entry))
            .map(|(k, _)| k.clone())
            .collect();
        let changes: Vec<Change> = gone
            .iter()
            .map(|(seq, name)| Change::Removed {
                name: name.clone(),
                head: !queue.entries.keys().any(|(s, n)| n != name && s <= seq),
            })
            .collect();
        for k in &gone {
            queue.entries.remove(k);
        }
        if queue.entries.is_empty() && queue.watches.is_empty() {
            self.queues.remove(&key(q));
        }
        self.fire(q, &changes);
    }

    /// Sends the watch events `changes` fire, each by its watcher's faults.
    fn fire(&mut self, q: &QueuePath, changes: &[Change]) {
        let Some(queue) = self.queues.get_mut(&key(q)) else {
            return;
        };
        let mut fired = Vec::new();
        let mut kept = Vec::new();
        for w in queue.watches.drain(..) {
            let event = changes.iter().find_map(|c| match (c, &w.target) {
                (Change::Removed { name, head }, Target::Removed(t)) if name == t => {
                    Some(if *head { Gone::Head } else { Gone::Unknown })
                }
                (Change::Removed { name, .. }, Target::Data(t)) if name == t => Some(Gone::Unknown),
                (Change::Data(name), Target::Data(t)) if name == t => Some(Gone::Unknown),
                (Change::Added | Change::Removed { .. }, Target::Children) => Some(Gone::Unknown),
                _ => None,
            });
            match event {
                Some(event) => fired.push((w, event)),
                None => kept.push(w),
            }
        }
        queue.watches = kept;
        for (w, event) in fired {
            if w.tx.is_closed() {
                continue;
            }
            let fate = match self.sessions.get_mut(&w.session) {
                Some(s) if s.ended.is_none() => s.faults.event(),
                _ => EventFate::Lose,
            };
            deliver(w.tx, event, fate);
        }
    }
}

fn key(q: &QueuePath) -> QueueKey {
    (q.lock.clone(), q.sub)
}

/// Whether `a` is queued ahead of, or is, `mine`.
pub(crate) fn not_behind(a: &Entry, mine: &Entry) -> bool {
    queue_order(a, mine) != std::cmp::Ordering::Greater
}
