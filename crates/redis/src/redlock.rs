//! Running scripts on the masters and agreeing: the gather with its straggler grace, the
//! majority check, the merge of the masters' views, and the enqueue's Redlock sequence
//! proposals with their randomised backoff.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Enqueued, Entry, EntryKind, Error, FencingToken, Position, QueuePath, Result, Ticket,
};
use fred::prelude::Value;
use tokio::time::Instant;
use tracing::debug;

use crate::backend::{Mode, RedisBackend, Shared};
use crate::keys::QueueKeys;
use crate::reply;
use crate::watchdog::SoloRelease;

/// At most this many Redlock sequence proposals per enqueue, before it gives up with an
/// error. Proposals are also bounded in time: no new one once a third of the lease has
/// passed (the entry must still be valid when a majority took it).
const REDLOCK_ATTEMPTS: usize = 64;

/// Longest random pause between two refused Redlock proposals. Contenders that proposed
/// the same sequence and split the masters would otherwise collide again in lockstep.
const REDLOCK_MAX_BACKOFF: Duration = Duration::from_millis(25);

/// How long a Redlock call waits for the remaining masters once a majority answered.
const STRAGGLER_GRACE: Duration = Duration::from_millis(20);

/// Past this many queues, [`SeqHints`] forgets those not seen for a lease.
const SEQ_HINTS_KEPT: usize = 1024;

/// The highest Redlock sequence this client has seen per queue: where its next proposal
/// starts, so that it is not refused for being below what a master already holds.
///
/// Advice only: a master refuses a proposal at or below its counter or its queue and
/// answers with the value to beat, so a forgotten hint costs at most one refused
/// proposal. A hint not raised for a whole lease is worth nothing more (the masters'
/// counters are written with the lease as their TTL, and the entries it reflected have
/// gone or been seen again since), so once the map holds [`SEQ_HINTS_KEPT`] queues
/// those go: it stays as large as the set of locks used within one lease, not every
/// lock name the process ever used.
#[derive(Debug, Default)]
pub(crate) struct SeqHints(parking_lot::Mutex<std::collections::HashMap<String, (u64, Instant)>>);

impl SeqHints {
    /// The hint for `queue` (0: none).
    pub(crate) fn get(&self, queue: &str) -> u64 {
        self.0.lock().get(queue).map_or(0, |(seq, _)| *seq)
    }

    /// Raises `queue`'s hint to at least `seq`; `lease` is how long an unraised hint is
    /// kept once the map is full.
    pub(crate) fn raise(&self, queue: &str, seq: u64, lease: Duration) {
        let now = Instant::now();
        let mut map = self.0.lock();
        if map.len() >= SEQ_HINTS_KEPT && !map.contains_key(queue) {
            map.retain(|_, (_, at)| now.duration_since(*at) < lease);
        }
        let hint = map.entry(queue.to_owned()).or_insert((0, now));
        *hint = (hint.0.max(seq), now);
    }

    /// How many queues have a hint.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.0.lock().len()
    }
}

impl Shared {
    /// Removes, on every master, whatever entry `ticket` has in the queue (`ABANDON`):
    /// the take-back of an enqueue that does not count, and [`dlock_core::Backend::abandon`].
    pub(crate) async fn abandon_ticket(
        &self,
        keys: &QueueKeys,
        ticket: &Ticket,
    ) -> Vec<Result<Value>> {
        let mut args = Shared::q_args(keys);
        args.push(Value::from(ticket.protected_prefix()));
        self.eval_all("abandoning an entry", &self.scripts.abandon, keys, args)
            .await
    }

    pub(crate) async fn eval_all(
        &self,
        what: &str,
        script: &fred::types::scripts::Script,
        keys: &QueueKeys,
        args: Vec<Value>,
    ) -> Vec<Result<Value>> {
        let k = keys.script_keys();
        if let [node] = self.nodes.as_slice() {
            // One master: no straggler bookkeeping (the request is copied once per
            // command sent, as for each master below).
            return vec![node.eval(what, script, || (k.clone(), args.clone())).await];
        }
        self.gather(
            self.nodes
                .iter()
                .map(|n| n.eval(what, script, || (k.clone(), args.clone()))),
        )
        .await
    }

    /// Whether `name` is listed (scored up to `upto`) on a majority of the masters:
    /// `true` once a majority lists it, `false` once more than the rest miss it (it can
    /// no longer be on a majority), asking every master and waiting, unlike
    /// [`Shared::gather`], for as many as it takes to tell (a slow master that holds the
    /// entry is waited for, up to the command timeout). [`Error::Unreachable`] when the
    /// masters that answered cannot tell.
    pub(crate) async fn listed_by_majority(
        &self,
        keys: &QueueKeys,
        name: &str,
        upto: u64,
    ) -> Result<bool> {
        use futures::StreamExt;
        let mut args = Self::q_args(keys);
        args.push(Value::from("0"));
        args.push(Value::from(upto.to_string()));
        let k = keys.script_keys();
        let mut pending: futures::stream::FuturesUnordered<_> = self
            .nodes
            .iter()
            .map(|n| {
                n.eval("listing a queue", &self.scripts.list, || {
                    (k.clone(), args.clone())
                })
            })
            .collect();
        let n = self.nodes.len();
        let (mut listed, mut missing, mut failed) = (0usize, 0usize, Vec::new());
        while let Some(r) = pending.next().await {
            match r.and_then(|v| reply::entries(v, false)) {
                Ok(view) if view.iter().any(|e| e.name == name) => listed += 1,
                Ok(_) => missing += 1,
                Err(e) => failed.push(e.to_string()),
            }
            if listed >= self.majority {
                return Ok(true);
            }
            if missing > n - self.majority {
                return Ok(false);
            }
        }
        Err(Error::Unreachable(format!(
            "entry {name} is listed on {listed} and missing on {missing} of {n} redis masters; \
             a majority ({}) must answer to tell: {}",
            self.majority,
            failed.join("; ")
        )))
    }

    /// Runs one request per master and collects the answers, in no particular order.
    /// Once a majority has answered, the others get [`STRAGGLER_GRACE`] more and then
    /// count as failed: a dead master would otherwise hold every call for its whole
    /// command timeout. On one master this is just that master's answer.
    pub(crate) async fn gather<T, F>(&self, requests: impl IntoIterator<Item = F>) -> Vec<Result<T>>
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
    pub(crate) fn quorum<T>(&self, results: Vec<Result<T>>) -> Result<Vec<T>> {
        let n = results.len();
        let mut oks = Vec::with_capacity(n);
        let mut errors = Vec::new();
        for r in results {
            match r {
                Ok(v) => oks.push(v),
                Err(e) => errors.push(e),
            }
        }
        if oks.len() >= self.majority {
            return Ok(oks);
        }
        if let Some(refused) = decisive_refusal(&errors, n, self.majority) {
            return Err(refused);
        }
        let first_err = errors.into_iter().next();
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

    pub(crate) fn q_args(keys: &QueueKeys) -> Vec<Value> {
        vec![
            Value::from(keys.entry_prefix()),
            Value::from(keys.gone_prefix()),
            Value::from(keys.changed()),
        ]
    }

    /// Lists the live queue, or with `upto` only the entries whose sequence is at most
    /// that (the part ahead of an entry).
    pub(crate) async fn list(
        &self,
        keys: &QueueKeys,
        detail: bool,
        upto: Option<u64>,
    ) -> Result<Vec<Entry>> {
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
    pub(crate) fn merge(&self, keys: &QueueKeys, mut views: Vec<Vec<Entry>>) -> Vec<Entry> {
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
            self.seq_hint.raise(&keys.queue, max, self.lease);
        }
        q
    }

    /// Whether this client found `queue` with another entry within [`CONTENDED_FOR`].
    fn seen_contended(&self, queue: &str) -> bool {
        self.contended
            .lock()
            .get(queue)
            .is_some_and(|at| at.elapsed() < CONTENDED_FOR)
    }

    /// Records whether `queue` had another entry. The map stays small: past 1,024 keys
    /// the stale ones go.
    fn note_contended(&self, queue: &str, contended: bool) {
        let mut map = self.contended.lock();
        if !contended {
            map.remove(queue);
            return;
        }
        if map.len() >= 1024 {
            map.retain(|_, at| at.elapsed() < CONTENDED_FOR);
        }
        map.insert(queue.to_owned(), std::time::Instant::now());
    }

    /// Releases an entry the fast path created, given what its registration kept;
    /// `true` when done (removed, or not there any more), `false` when a second entry
    /// or a watcher ([`Shared::unsolo`]) has moved it into the queue layout since, and
    /// [`Shared::remove_names`] must remove it.
    pub(crate) async fn release_solo(&self, keys: &QueueKeys, solo: SoloRelease) -> Result<bool> {
        let reply = self.nodes[0]
            .eval("removing an entry", &self.scripts.release_solo, || {
                (vec![keys.queue.clone()], vec![solo.arg.clone()])
            })
            .await?;
        let reply = reply.as_i64();
        if reply == Some(2) && solo.whole {
            self.counters
                .solo_mismatches
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        Ok(reply != Some(-1))
    }

    /// Moves `name` into the queue layout if it is the lock's solo entry (one master
    /// only), and returns its entry key's time left in ms, `None` when it has no entry
    /// key (gone). A client that watches an entry with no entry of its own calls this
    /// once it listens on the entry's gone-channel: a solo entry's release
    /// (`RELEASE_SOLO`) publishes nothing, a queued entry's removal does. It does so on
    /// every pass of its wait, not once: a move the server acknowledged can be lost
    /// with it (a failover to a replica that never saw it).
    pub(crate) async fn unsolo(&self, keys: &QueueKeys, name: &str) -> Result<Option<i64>> {
        let reply = self.nodes[0]
            .eval(
                "checking an entry",
                &self.scripts.unsolo,
                // All three of the lock's keys, as every PRELUDE script names them: in
                // a Redis Cluster slot being migrated the sequence key never exists, so
                // a node refuses the script unrun (`TRYAGAIN`, retried; `ASK`) instead
                // of running its `DEL` of the solo string and then being refused the
                // entry key it names only in `ARGV`, which would delete a held entry.
                || {
                    (
                        keys.script_keys(),
                        vec![
                            Value::from(keys.entry_prefix()),
                            self.lease_ms.clone(),
                            Value::from(name),
                        ],
                    )
                },
            )
            .await?;
        match reply.as_i64() {
            Some(-2) => Ok(None),
            Some(ms) => Ok(Some(ms)),
            None => Err(Error::backend(
                "checking an entry",
                format!("unexpected reply to the solo move: {reply:?}"),
            )),
        }
    }

    pub(crate) async fn remove_names(&self, keys: &QueueKeys, names: &[String]) -> Result<()> {
        let mut args = Self::q_args(keys);
        args.extend(names.iter().map(|n| Value::from(n.as_str())));
        let results = self
            .eval_all("removing an entry", &self.scripts.remove, keys, args)
            .await;
        self.quorum(results).map(|_| ())
    }
}

/// How long an enqueue skips the uncontended fast path on a queue this client last found
/// with another entry: while a lock stays contended, each attempt would fail.
const CONTENDED_FOR: Duration = Duration::from_secs(1);

impl RedisBackend {
    /// The uncontended fast path ([`crate::scripts`]' `ACQUIRE_SOLO`): on one master, a
    /// tail entry into a lock with no entry is taken as the lock's one key. `None` when
    /// it does not apply or the lock has an entry: the caller enqueues as usual (one
    /// round trip more for a contended acquire, none for an uncontended one).
    ///
    /// Not for Redlock (its sequences are agreed across masters), not beside a writer,
    /// and not for election candidates: a leader's value is proclaimed in place, which
    /// the queue layout's entry key carries.
    async fn try_solo(
        &self,
        keys: &Arc<QueueKeys>,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        prefix: &str,
        data: &[u8],
    ) -> Result<Option<Enqueued>> {
        let s = &self.shared;
        if s.mode != Mode::Single || !matches!(at, Position::Tail) || kind == EntryKind::Candidate {
            return Ok(None);
        }
        // The script writes `prefix` and the entry is built from the ticket and kind
        // (`Ticket::entry`): they must name the same entry.
        debug_assert_eq!(prefix, ticket.name_prefix(kind));
        if s.seen_contended(&keys.queue) {
            return Ok(None);
        }
        let node = &s.nodes[0];
        let mark = s.replication_mark();
        let sent_at = Instant::now();
        let reply = node
            .eval("adding an entry", &s.scripts.acquire_solo, || {
                let args = if data.is_empty() {
                    vec![Value::from(prefix)]
                } else {
                    vec![Value::from(prefix), Value::from(data)]
                };
                (vec![keys.queue.clone()], args)
            })
            .await?;
        let Some((token, token_text)) = reply::solo_token(reply)? else {
            s.note_contended(&keys.queue, true);
            return Ok(None);
        };
        // The name and value as the script joined them, from the token's digits as it
        // returned them (not re-formatted from the number).
        let mut mine = ticket
            .entry(kind, &token_text)
            .ok_or_else(|| Error::backend("adding an entry", "solo entry name does not parse"))?;
        mine.token = Some(FencingToken::new(token));
        mine.created_ms = i64::try_from(token / 1000).ok();
        if let Err(e) = s.replicated("taking a lock", mark).await {
            // Held on the primary only: a replica promoted now would not have it. Not
            // counted, so taken back (a removal the replica misses only holds others
            // back there until the lease ends).
            let _ = s.remove_names(keys, std::slice::from_ref(&mine.name)).await;
            return Err(e);
        }
        s.register(
            keys,
            &mine.name,
            Some(ticket.as_str().to_owned()),
            sent_at,
            Some(SoloRelease::new(&mine.name, &token_text, data)),
        );
        if s.closed.load(std::sync::atomic::Ordering::SeqCst) {
            // As in the queue path: `close` may have swept the live entries already.
            s.settle(&keys.queue, &mine.name, crate::watchdog::Fate::Closed);
            let _ = s.remove_names(keys, std::slice::from_ref(&mine.name)).await;
            return Err(Error::Closed);
        }
        let mut listed = mine.clone();
        listed.created_ms = None;
        mine.data = data.to_vec();
        debug!(entry = %mine.name, token, "entry added as the lock's only one");
        Ok(Some(Enqueued {
            mine,
            queue: vec![listed],
        }))
    }

    pub(crate) async fn enqueue_inner(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        let s = &self.shared;
        s.check_open()?;
        let keys = Arc::new(QueueKeys::new(&s.prefix, q));
        let started = Instant::now();
        let prefix = ticket.name_prefix(kind);
        if let Some(added) = self
            .try_solo(&keys, ticket, kind, at, &prefix, data)
            .await?
        {
            return Ok(added);
        }
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
                    let hint = s.seq_hint.get(&keys.queue);
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
            let mark = s.replication_mark();
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
                if let Err(e) = s.replicated("adding an entry", mark).await {
                    // As in `try_solo`: an entry a promoted replica would not have is
                    // not counted, and is taken back.
                    let _ = s.abandon_ticket(&keys, ticket).await;
                    return Err(e);
                }
                let mut mine = added[0].0.clone();
                mine.data = data.to_vec();
                mine.token = added.iter().filter_map(|(m, _)| m.token).max();
                s.register(
                    &keys,
                    &mine.name,
                    Some(ticket.as_str().to_owned()),
                    sent_at,
                    None,
                );
                if s.closed.load(std::sync::atomic::Ordering::SeqCst) {
                    // `close` ran while this enqueue was in flight: its sweep of the live
                    // entries may have run before the line above, so take it back here
                    // rather than leave it to the lease.
                    s.settle(&keys.queue, &mine.name, crate::watchdog::Fate::Closed);
                    let _ = s
                        .remove_names(&keys, std::slice::from_ref(&mine.name))
                        .await;
                    return Err(Error::Closed);
                }
                let views = added.into_iter().map(|(_, q)| q).collect();
                let queue = s.merge(&keys, views);
                if s.mode == Mode::Single {
                    s.note_contended(&keys.queue, queue.len() > 1);
                }
                debug!(entry = %mine.name, seq = mine.seq, token = ?mine.token, waiting = queue.len(), "entry added");
                return Ok(Enqueued { mine, queue });
            }
            if !added.is_empty() || !failed.is_empty() {
                // Added on a minority, too late, or maybe added where the reply was lost:
                // take it back everywhere before proposing again.
                let _ = s.abandon_ticket(&keys, ticket).await;
            }
            let n = s.nodes.len();
            if s.mode == Mode::Single {
                if !failed.is_empty() {
                    return Err(failed.swap_remove(0));
                }
            } else if failed.len() > n - s.majority {
                if let Some(refused) = decisive_refusal(&failed, n, s.majority) {
                    return Err(refused);
                }
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
            s.seq_hint.raise(&keys.queue, proposal, s.lease);
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

/// The refusal to report when the masters that refused the client (credentials,
/// permissions, TLS) are enough on their own to deny a majority: retrying elsewhere
/// cannot help, and "unreachable" would hide the cause. `None` otherwise.
pub(crate) fn decisive_refusal(errors: &[Error], n: usize, majority: usize) -> Option<Error> {
    let refusals: Vec<&Error> = errors.iter().filter(|e| e.is_refusal()).collect();
    if refusals.len() <= n - majority {
        return None;
    }
    let what = format!("{} of {n} redis masters refused", refusals.len());
    Some(match refusals[0] {
        Error::Unauthenticated(m) => Error::Unauthenticated(format!("{what}: {m}")),
        Error::PermissionDenied(m) => Error::PermissionDenied(format!("{what}: {m}")),
        Error::Tls(m) => Error::Tls(format!("{what}: {m}")),
        _ => return None,
    })
}

#[cfg(test)]
mod refusal_tests {
    use super::*;

    #[test]
    fn refusals_decide_only_when_they_deny_a_majority() {
        let denied = || Error::PermissionDenied("NOPERM".into());
        let down = || Error::Unreachable("down".into());
        assert!(matches!(
            decisive_refusal(&[denied(), denied()], 3, 2),
            Some(Error::PermissionDenied(_))
        ));
        assert!(decisive_refusal(&[denied(), down()], 3, 2).is_none());
        assert!(decisive_refusal(&[down(), down()], 3, 2).is_none());
        assert!(matches!(
            decisive_refusal(&[denied(), denied(), denied()], 5, 3),
            Some(Error::PermissionDenied(_))
        ));
    }
}

#[cfg(test)]
mod seq_hint_tests {
    use super::*;

    /// Hints only rise; once the map is full, the hints not raised for a lease go (it
    /// grew by one queue per lock name the process ever used), and live ones stay.
    #[tokio::test(start_paused = true)]
    async fn hints_rise_and_stale_ones_go_once_full() {
        let lease = Duration::from_secs(5);
        let hints = SeqHints::default();
        hints.raise("q", 7, lease);
        hints.raise("q", 3, lease);
        assert_eq!(hints.get("q"), 7, "a hint never falls");
        assert_eq!(hints.get("other"), 0);
        for i in 1..SEQ_HINTS_KEPT {
            hints.raise(&format!("old-{i}"), 1, lease);
        }
        assert_eq!(hints.len(), SEQ_HINTS_KEPT);
        tokio::time::advance(lease).await;
        hints.raise("q", 8, lease);
        assert_eq!(hints.len(), SEQ_HINTS_KEPT, "a known queue prunes nothing");
        hints.raise("new", 2, lease);
        assert_eq!(hints.len(), 2, "the hints older than a lease went");
        assert_eq!((hints.get("q"), hints.get("new")), (8, 2));
        assert_eq!(hints.get("old-1"), 0);
        // Within a lease, nothing goes: the map is as large as the locks in use.
        for i in 0..SEQ_HINTS_KEPT {
            hints.raise(&format!("live-{i}"), 1, lease);
        }
        assert_eq!(hints.len(), SEQ_HINTS_KEPT + 2);
    }
}
