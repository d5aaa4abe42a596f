//! Claims: the key each ticket's entry takes (etcd's mutex key or a ticketed one), the
//! pending tickets that let a cancelled enqueue be cleaned up, the enqueue's put-if-absent
//! transaction, and the deletes that free a claimed key.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use dlock_core::{Enqueued, Entry, EntryKind, Error, Position, QueuePath, Result, Ticket};
use etcd_client::{Compare, CompareOp, Txn, TxnOp, TxnOpResponse};
use tokio::sync::{oneshot, watch};
use tokio::time::timeout;

use crate::backend::{request, EtcdBackend};
use crate::errors::map;
use crate::layout;
use crate::reads::{header_rev, queue_read, raw};
use crate::waits::TRACK_AT_MOST;

/// What this client's own contenders have claimed, so that two of them never share a key
/// and a cancelled enqueue can be cleaned up.
#[derive(Default)]
pub(crate) struct Local {
    /// etcd's mutex key `NAME/<lease hex>` → the ticket using it. A lease has only one
    /// such key per name, so a second local contender on the same name takes a ticketed
    /// key instead (see the crate docs).
    pub(crate) primary: HashMap<String, String>,
    /// Ticket → the key its enqueue created, or may have created.
    pub(crate) tickets: HashMap<String, Pending>,
}

#[derive(Clone)]
pub(crate) struct Pending {
    pub(crate) key: String,
    pub(crate) primary: bool,
    pub(crate) lease: i64,
    /// Becomes `true` once the enqueue's transaction has been answered (or failed): only
    /// then can a delete not be overtaken by it.
    pub(crate) done: watch::Receiver<bool>,
    /// Set when an attempt of the enqueue's transaction went unanswered (it was retried,
    /// or the enqueue failed): a copy of it may still be applied later, after the entry
    /// is removed (see `sweeps.rs`).
    pub(crate) uncertain: Arc<AtomicBool>,
}

impl Pending {
    /// Whether a copy of this enqueue may still land (see [`Pending::uncertain`]).
    pub(crate) fn is_uncertain(&self) -> bool {
        self.uncertain.load(Ordering::Acquire)
    }
}

impl EtcdBackend {
    /// Picks the key for `ticket`'s entry and records it before anything is sent, so
    /// `abandon` finds it even if the enqueue future is dropped mid-flight.
    fn claim(
        &self,
        prefix: &str,
        ticket: &Ticket,
        kind: EntryKind,
        lease: i64,
        avoid_primary: bool,
    ) -> (String, bool, Option<Pending>) {
        let mut local = self.local.lock();
        if let Some(p) = local.tickets.get(ticket.as_str()) {
            if p.lease == lease && p.key.starts_with(prefix) && !(avoid_primary && p.primary) {
                // A retry with the same ticket: the same key, so the retry is idempotent.
                return (p.key.clone(), p.primary, Some(p.clone()));
            }
        }
        if let Some(old) = local.tickets.remove(ticket.as_str()) {
            if old.primary
                && local.primary.get(&old.key).map(String::as_str) == Some(ticket.as_str())
            {
                local.primary.remove(&old.key);
            }
        }
        let primary_key = layout::entry_key(prefix, lease, ticket, kind, true);
        let primary = matches!(kind, EntryKind::Lock | EntryKind::Candidate)
            && !avoid_primary
            && !local.primary.contains_key(&primary_key);
        let key = if primary {
            local
                .primary
                .insert(primary_key.clone(), ticket.as_str().to_owned());
            primary_key
        } else {
            layout::entry_key(prefix, lease, ticket, kind, false)
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
    pub(crate) fn take_claim(
        &self,
        key: &str,
        ticket: Option<&str>,
        lease: Option<i64>,
    ) -> Option<bool> {
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
    pub(crate) async fn delete_claimed(&self, key: &str, primary: bool) -> bool {
        let attempt = async {
            let _slot = self.in_flight.acquire().await.ok();
            self.kv.with(async |kv| kv.delete(key, None).await).await
        };
        let why = match timeout(self.request_timeout, attempt).await {
            Ok(Ok(resp)) => {
                self.observe(header_rev(resp.header()));
                if primary {
                    self.free_retired(key);
                }
                return true;
            }
            Ok(Err(e)) => e.to_string(),
            Err(_) => format!("no answer within {:?}", self.request_timeout),
        };
        tracing::debug!(key, error = %why, "plain delete got no answer; the key stays retired");
        false
    }

    /// Frees a primary key [`Self::take_claim`] retired, once the delete of its entry was
    /// answered: a later contender of this client may take it again.
    fn free_retired(&self, key: &str) {
        let mut local = self.local.lock();
        if local.primary.get(key).is_some_and(String::is_empty) {
            local.primary.remove(key);
        }
    }

    /// Forgets what `ticket` claimed for `key`, and returns it. A primary key retired by
    /// [`Self::take_claim`] stays retired.
    pub(crate) fn forget(&self, ticket: Option<&str>, key: &str) -> Option<Pending> {
        let ticket = ticket?;
        let mut local = self.local.lock();
        let pending = if local.tickets.get(ticket).is_some_and(|p| p.key == key) {
            local.tickets.remove(ticket)
        } else {
            None
        };
        if local.primary.get(key).map(String::as_str) == Some(ticket) {
            local.primary.remove(key);
        }
        pending
    }

    /// Whether any contender of this client claims `key` now.
    pub(crate) fn claimed(&self, key: &str) -> bool {
        self.local.lock().tickets.values().any(|p| p.key == key)
    }

    /// Adds `ticket`'s entry to `q` (see the crate docs for the key it takes). With
    /// `hand_on`, the same transaction also deletes that entry (a queue and an entry
    /// this client holds), guarded by its create revision: the new entry exists only if
    /// that one still did, and both happen in one synced write ([`Backend::enqueue_removing`]).
    ///
    /// [`Backend::enqueue_removing`]: dlock_core::Backend::enqueue_removing
    pub(crate) async fn enqueue_impl(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
        hand_on: Option<(&QueuePath, &Entry)>,
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
        let prefix = layout::queue_prefix(&self.namespace, q);
        let session = self.live_session().await?;
        let lease = session.id();
        let value = layout::encode_value(ticket, kind, writer.map(|w| w.seq), data);
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
        let hand_on = match hand_on {
            None => None,
            Some((gone_q, gone)) => {
                let Some(rev) = gone.token.and_then(|t| i64::try_from(t.get()).ok()) else {
                    return Err(Error::LockLost(format!(
                        "the entry {} to hand on has no token",
                        gone.name
                    )));
                };
                let key = format!(
                    "{}{}",
                    layout::queue_prefix(&self.namespace, gone_q),
                    gone.name
                );
                // Retired like a release's key (`take_claim`): no contender of this client
                // claims it again while the delete is in flight.
                let claim = self.take_claim(&key, gone.ticket.as_deref(), layout::lease_of(gone));
                Some((key, rev, gone.ticket.as_deref(), claim))
            }
        };
        // An entry that hands another on never takes the mutex key: a failed compare then
        // means only "mine exists already" (an earlier attempt) or "the other is gone".
        let mut avoid_primary = hand_on.is_some();
        let mut cleaned = false;
        // The mutex key this ticket gave up with a copy still on it (see below).
        let mut given_up: Option<Pending> = None;
        loop {
            let (key, primary, previous) = self.claim(&prefix, ticket, kind, lease, avoid_primary);
            if let Some(p) = given_up.take() {
                // Now that no contender of this client claims it, the sweep takes back
                // the copy on it (and any that lands later); a contender that claims it
                // meanwhile finds the copy with its own enqueue and deletes it.
                self.sweep_later(&p, ticket.as_str());
            }
            // A retry of this ticket keeps what an earlier attempt left uncertain.
            let uncertain: Arc<AtomicBool> = previous
                .as_ref()
                .map(|p| p.uncertain.clone())
                .unwrap_or_default();
            if let Some(Pending { done: mut prev, .. }) = previous {
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
                    uncertain: uncertain.clone(),
                },
            );
            // etcd's Go Mutex in one round trip: create my key if it does not exist, and
            // read the queue. The else branch (my key exists: a retry whose first answer
            // was lost) reads the same queue, so retrying is idempotent.
            let parts = TxnParts {
                key: key.clone(),
                value: value.clone(),
                prefix: prefix.clone(),
                lease,
                writer_check: writer_check.clone(),
                hand_on: hand_on.as_ref().map(|(gkey, rev, ..)| (gkey.clone(), *rev)),
            };
            // The transaction runs in its own task: a dropped enqueue cannot cancel it
            // halfway, and `abandon` waits for its answer before deleting the key. (Polling
            // it in place and handing it to a task only when dropped was measured: no
            // faster in W1, and more context switches per lock.)
            let (tx, rx) = oneshot::channel();
            let kv = self.kv.clone();
            let budget = self.request_timeout;
            let limit = self.in_flight.clone();
            tokio::spawn(async move {
                let mut sent = 0u32;
                let r = request(&limit, budget, || {
                    sent += 1;
                    // Built for each attempt: etcd-client takes the transaction by value.
                    let txn = parts.txn();
                    kv.with(async move |kv| kv.txn(txn).await)
                })
                .await;
                // An attempt that was not answered may have been applied, or may still
                // be: a member that forwarded it to a leader which then stopped hands it
                // on when that leader resumes, after the retry and maybe after the
                // entry's release.
                if sent > 1 || r.is_err() {
                    uncertain.store(true, Ordering::Release);
                }
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
            // A client that waits on this queue keeps a watch on it (`hubs.rs`): this
            // read of the whole queue can spare its next wait a read of its own. (Only a
            // short one: a wait on a longer queue watches one key and reads it.)
            if get.kvs().len() <= TRACK_AT_MOST as usize {
                if let Some(hub) = self.hubs.lock().get(&prefix) {
                    hub.offer(header_rev(resp.header()), get);
                }
            }
            let name = &key[prefix.len()..];
            if let Some((gkey, rev, gone_ticket, claim)) = &hand_on {
                // Mine is there: this attempt or an earlier one with the same ticket (whose
                // answer was lost) put it, and deleted the other in the same transaction.
                // Mine is not: the compare on the other failed, it was gone; nothing written.
                if !queue.iter().any(|e| e.name == name) {
                    return Err(Error::LockLost(format!(
                        "{gkey}: the entry created at revision {rev} to hand on is gone; nothing was written"
                    )));
                }
                if *claim == Some(true) {
                    self.free_retired(gkey);
                }
                if let Some(p) = self.forget(*gone_ticket, gkey) {
                    if p.is_uncertain() {
                        self.sweep_later(&p, gone_ticket.unwrap_or_default());
                    }
                }
            }
            let Some(mut mine) = queue.iter().find(|e| e.name == name).cloned() else {
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
                //
                // A candidate's value is raw (Go's election layout) and names no ticket,
                // so an earlier attempt of this very ticket whose answer was lost lands
                // here too: it is deleted by its create revision and put again, which
                // leaves exactly one entry either way (queued anew, behind whoever
                // came meanwhile) and never a stray one.
                //
                // A second copy can land between that delete and the put (two late
                // attempts, or a late copy of an earlier ticket's enqueue): then the
                // entry goes under a ticketed key, and the copy left on the mutex key,
                // which nothing claims any more, is swept, not left ahead of every
                // candidate for the session's life
                // (`etcd_candidate_key_recreated_during_its_enqueue_is_not_orphaned`).
                if primary && !cleaned {
                    cleaned = true;
                    tracing::warn!(key = %key, token = mine.token.map(|t| t.get()).unwrap_or(0), "removing an orphaned entry under this lease's mutex key");
                    if self.remove_exact(&key, mine.token).await.is_ok() {
                        continue;
                    }
                }
                if primary {
                    given_up = self
                        .local
                        .lock()
                        .tickets
                        .get(ticket.as_str())
                        .filter(|p| p.key == key)
                        .cloned();
                }
                avoid_primary = true;
                continue;
            }
            if kind == EntryKind::Candidate {
                // Read back, a raw-valued key is a mutex contender without a ticket;
                // the caller's own entry is the candidate its ticket made (`remove`
                // finds its claim by this ticket).
                mine.kind = kind;
                mine.ticket = Some(ticket.as_str().to_owned());
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
    pub(crate) async fn remove_exact(
        &self,
        key: &str,
        token: Option<dlock_core::FencingToken>,
    ) -> Result<()> {
        let txn = match token.and_then(|t| i64::try_from(t.get()).ok()) {
            Some(rev) => Txn::new()
                .when([Compare::create_revision(key, CompareOp::Equal, rev)])
                .and_then([TxnOp::delete(key, None)]),
            None => Txn::new().and_then([TxnOp::delete(key, None)]),
        };
        let resp = request(&self.in_flight, self.request_timeout, || {
            let txn = txn.clone();
            self.kv.with(async move |kv| kv.txn(txn).await)
        })
        .await
        .map_err(|e| map(&format!("releasing {key}"), e))?;
        self.observe(header_rev(resp.header()));
        Ok(())
    }

    /// Go's `Election.Proclaim`: puts `data` on `entry`'s key, on its lease, in one
    /// transaction that compares the key's create revision with the entry's token, so
    /// the value lands only on that very entry, never on a newer one under its name.
    /// A candidate's value is `data` alone; another kind keeps dlock's header.
    pub(crate) async fn proclaim_impl(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> Result<()> {
        let key = format!("{}{}", layout::queue_prefix(&self.namespace, q), entry.name);
        let Some(rev) = entry.token.and_then(|t| i64::try_from(t.get()).ok()) else {
            return Err(Error::LockLost(format!(
                "{key}: the entry has no token to compare"
            )));
        };
        let Some(lease) = layout::lease_of(entry) else {
            return Err(Error::backend(
                format!("proclaiming on {key}"),
                "the key is not bound to a lease this layout names",
            ));
        };
        let value = match (entry.kind, entry.ticket.as_deref()) {
            (EntryKind::Candidate, _) | (_, None) => data.to_vec(),
            (kind, Some(ticket)) => {
                let beside = (kind == EntryKind::Read
                    && Some(entry.seq) != entry.token.map(|t| t.get()))
                .then_some(entry.seq);
                layout::encode_value_for(ticket, kind, beside, data)
            }
        };
        let txn = Txn::new()
            .when([Compare::create_revision(key.clone(), CompareOp::Equal, rev)])
            .and_then([TxnOp::put(
                key.clone(),
                value,
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )]);
        // A retried put is harmless: the same value under the same guard.
        let resp = request(&self.in_flight, self.request_timeout, || {
            let txn = txn.clone();
            self.kv.with(async move |kv| kv.txn(txn).await)
        })
        .await
        .map_err(|e| map(&format!("proclaiming on {key}"), e))?;
        self.observe(header_rev(resp.header()));
        if resp.succeeded() {
            Ok(())
        } else {
            Err(Error::LockLost(format!(
                "{key}: the entry created at revision {rev} is gone; nothing was written"
            )))
        }
    }
}

/// What an enqueue's transaction is built from, owned by the task that sends it.
struct TxnParts {
    key: String,
    value: Vec<u8>,
    prefix: String,
    lease: i64,
    /// A downgrade's write entry: its key and create revision, which must still be
    /// this lease's.
    writer_check: Option<(String, i64)>,
    /// An entry to delete in the same transaction: its key and create revision.
    hand_on: Option<(String, i64)>,
}

impl TxnParts {
    /// Creates the key unless it exists, and reads the queue either way.
    fn txn(&self) -> Txn {
        let put = etcd_client::PutOptions::new().with_lease(self.lease);
        let mut when = vec![Compare::create_revision(
            self.key.as_str(),
            CompareOp::Equal,
            0,
        )];
        if let Some((wkey, rev)) = &self.writer_check {
            when.push(Compare::create_revision(
                wkey.as_str(),
                CompareOp::Equal,
                *rev,
            ));
            when.push(Compare::lease(wkey.as_str(), CompareOp::Equal, self.lease));
        }
        let mut then = vec![TxnOp::put(
            self.key.as_str(),
            self.value.as_slice(),
            Some(put),
        )];
        if let Some((gkey, rev)) = &self.hand_on {
            when.push(Compare::create_revision(
                gkey.as_str(),
                CompareOp::Equal,
                *rev,
            ));
            then.push(TxnOp::delete(gkey.as_str(), None));
        }
        then.push(TxnOp::get(self.prefix.as_str(), Some(queue_read())));
        Txn::new()
            .when(when)
            .and_then(then)
            .or_else([TxnOp::get(self.prefix.as_str(), Some(queue_read()))])
    }
}
