//! Waits: one attempt of `wait_gone` and of `wait_changed` on a watch armed from now,
//! the re-reads that cover a watch the server left unsynced, and the retry around them.

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Entry, EntryKind, Error, Gone, Result, Woken};
use etcd_client::{
    EventType, GetOptions, GetResponse, WatchFilterType, WatchOptions, WatchResponse,
};
use tokio::time::{sleep, timeout_at, Instant};

use crate::backend::EtcdBackend;
use crate::errors::map;
use crate::hubs::{Hub, Joined, Sub};
use crate::layout;
use crate::reads::{header_rev, holds_entry, queue_read, raw};
use crate::watches::Watch;

/// How often `wait_gone` re-reads its key while its watch may still be unsynced.
///
/// A traced W2 run (8 workers, one etcd) with 25 ms found 3 % of the handoffs (26 of
/// 883) woken by a re-read, not the watch, 6-20 ms late: a fifth of all handoff time.
/// Three interleaved rounds each, 25 / 5 / 2 ms: W2 353-394 / 470-514 / 371-489 ops/s,
/// queue reads per lock 2.15 / 2.73 / 4.4; W5 737 vs 796 (25 vs 5 ms); W4 316 vs 306,
/// within its noise (its waiters wait longer, so they re-read more). 5 ms it is.
const UNSYNCED_CHECK: Duration = Duration::from_millis(5);
/// How long `wait_gone` keeps re-reading (at most eleven reads, only within this time
/// after the watch is armed: a waiter that stays queued longer costs nothing more). The
/// server's catch-up loop syncs a lagging watcher within 100 ms anyway; measured with
/// 25 ms re-reads under W2, every delete a re-read found first was found by the first
/// one, and without the re-reads W2 lost a quarter of its rate to 100 ms stalls.
const UNSYNCED_WINDOW: Duration = Duration::from_millis(55);

/// The longest queue (in keys under its prefix) whose waiters watch it whole to learn
/// whether the entry they wait on went as the head ([`EtcdBackend::wait_gone_tracking_once`]).
/// Only the first entries of a queue can see it this short, so each change of a queue
/// reaches at most this many such watches, and a longer queue costs what it did before.
pub(crate) const TRACK_AT_MOST: i64 = 8;

/// Whether a watch event is news to a waiter whose read answered at revision `read_rev`:
/// it happened after that read (its key's mod revision, which a delete event carries
/// too, is above it). An event at or below it is already in the read.
///
/// A watch from "now" starts at the revision of the member that serves it, and that
/// member can be behind the one that answered the read (floored past it): a follower
/// resumed after a stall, or rejoining after a cut, answers a watch create at its old
/// revision before it has caught up, then sends every event since, including ones the
/// read had already shown. Seen in `cargo xtask chaos`, follower-cut on etcd: a waiter
/// took the replayed put of the lease it was waiting behind for a change, and a
/// semaphore-mutex let a second holder in; `tests/lagging_member.rs` reproduces it with a
/// stopped follower. An event without a key-value is not news either: etcd always sends
/// one, and a waiter that ignores a change only waits for the next one or its re-read.
fn after_read(kv: Option<&etcd_client::KeyValue>, read_rev: i64) -> bool {
    kv.is_some_and(|kv| kv.mod_revision() > read_rev)
}

/// Logs an event [`after_read`] left out (at debug: the fault runs count them).
fn stale(key: &str, kv: Option<&etcd_client::KeyValue>, read_rev: i64) {
    tracing::debug!(
        target: "dlock_etcd::stale_event",
        key,
        event_rev = kv.map(etcd_client::KeyValue::mod_revision),
        read_rev,
        "a watch event already in the read (its member lagged behind the read's); ignored"
    );
}

/// Where [`EtcdBackend::until_gone`] takes its watch messages from: a watch armed for
/// this wait, or the client's hub of the queue (`hubs.rs`).
enum Feed<'a> {
    Own(&'a mut Watch),
    Hub(&'a mut Sub),
}

impl Feed<'_> {
    /// The next message, `None` once the watch has ended. Cancel-safe.
    async fn message(&mut self) -> Option<Arc<WatchResponse>> {
        match self {
            Feed::Own(w) => w.message().await.map(Arc::new),
            Feed::Hub(s) => s.message().await,
        }
    }
}

/// What a waiter watching its queue whole knows of the entries queued up to the one it
/// waits on ([`EtcdBackend::wait_gone_tracking_once`]).
struct Ahead<'a> {
    prefix: &'a str,
    /// The key of the entry waited on.
    key: &'a str,
    /// The revision of the read that listed `names`.
    read_rev: i64,
    /// The other entries queued with a sequence up to that entry's, as of `read_rev` and
    /// every delete since; `None` when they are not tracked (a write among them).
    names: Option<HashSet<String>>,
    /// The waiter's own entry's name, while the read showed it and no delete of it has
    /// been seen: when the entry waited on goes, it is still queued.
    mine: Option<String>,
}

impl Ahead<'_> {
    /// Applies one watch message. Once it holds the delete of the entry waited on:
    /// [`Gone::Head`] if no other entry is left up to its sequence after every change of
    /// that revision (and they were tracked), else [`Gone::Unknown`].
    fn apply(&mut self, m: &WatchResponse) -> Option<Gone> {
        let mut gone_at = None;
        for e in m.events() {
            let Some(kv) = e.kv() else { continue };
            // A revision's changes come in one message: finish the delete's revision,
            // so that an entry ahead deleted in the same transaction counts as gone.
            if gone_at.is_some_and(|rev| kv.mod_revision() != rev) {
                break;
            }
            if !after_read(Some(kv), self.read_rev) {
                stale(self.prefix, Some(kv), self.read_rev);
                continue;
            }
            let Some(name) = kv
                .key()
                .strip_prefix(self.prefix.as_bytes())
                .and_then(|n| std::str::from_utf8(n).ok())
                .filter(|n| layout::parse_name(n).is_some())
            else {
                // Not an entry of this queue (a sub-queue's key).
                continue;
            };
            // The watch takes deletes only. No put can bring an entry ahead unseen: a
            // new entry sorts behind, except a read beside a write, and with a write
            // ahead nothing is tracked.
            if e.event_type() != EventType::Delete {
                continue;
            }
            if kv.key() == self.key.as_bytes() {
                gone_at = Some(kv.mod_revision());
            } else {
                if self.mine.as_deref() == Some(name) {
                    self.mine = None;
                }
                if let Some(names) = &mut self.names {
                    names.remove(name);
                }
            }
        }
        gone_at.map(|_| {
            if self.names.as_ref().is_some_and(HashSet::is_empty) {
                Gone::Head
            } else {
                Gone::Unknown
            }
        })
    }
}

impl EtcdBackend {
    /// Arms a watch from "now" on `key` (a prefix if `prefix`) on the client's shared
    /// watch stream and waits for its `created` answer; returns the watch and the
    /// revision it starts after.
    ///
    /// Watching from now (no start revision) is what keeps the handoff fast: the server
    /// puts such a watcher in its *synced* group and sends it each event as it is
    /// committed, where a watch from a past revision (etcd's own Mutex) is served by the
    /// loop that catches up unsynced watchers every 100 ms.
    pub(crate) async fn arm(&self, key: &str, prefix: bool, no_put: bool) -> Result<(Watch, i64)> {
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
        let deadline = Instant::now() + self.request_timeout;
        let no_answer = || {
            Error::Unreachable(format!(
                "watching {key}: no answer within {:?}",
                self.request_timeout
            ))
        };
        let mut w = match timeout_at(deadline, self.watches.watch(key, opts)).await {
            Ok(w) => w.map_err(|e| map(&format!("watching {key}"), e))?,
            Err(_) => return Err(no_answer()),
        };
        match timeout_at(deadline, w.message()).await {
            Ok(Some(m)) if m.created() && !m.canceled() => Ok((w, header_rev(m.header()))),
            Ok(Some(m)) => Err(Error::backend(
                format!("watching {key}"),
                format!("watch refused: {}", m.cancel_reason()),
            )),
            Ok(None) => Err(Error::Unreachable(format!(
                "watching {key}: stream closed before the watch was created"
            ))),
            Err(_) => {
                // The stream took the create and left it unanswered. A member can do
                // that to one stream while it serves the rest of the connection, and
                // every later watch of this client would go to the same stream: give
                // it up, so the caller's retry opens another (which the balancer may
                // send to another member).
                tracing::debug!(key, "no answer to a watch create; giving its stream up");
                w.give_up_stream();
                Err(no_answer())
            }
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
    pub(crate) async fn wait_gone_once(&self, key: &str, entry: &Entry) -> Result<()> {
        // Arm the watch first, then read the key at or after the revision the watch
        // starts after: a delete is then either in the read or reported by the watch.
        let (mut watch, watch_rev) = self.arm(key, false, true).await?;
        let read = self
            .fresh_get(key, GetOptions::new(), watch_rev)
            .await
            .map_err(|e| map(&format!("reading {key}"), e))?;
        if !holds_entry(&read, key, entry) {
            return Ok(());
        }
        let read_rev = header_rev(read.header());
        let gone = |m: &WatchResponse| {
            // Only a delete after the read that showed the entry: a lagging member's
            // watch can still report the delete of an older entry that had the same key
            // (`after_read`).
            for e in m.events() {
                if e.event_type() != EventType::Delete {
                    continue;
                }
                if after_read(e.kv(), read_rev) {
                    return Some(());
                }
                stale(key, e.kv(), read_rev);
            }
            None
        };
        let armed_at = Instant::now();
        self.until_gone(
            key,
            entry,
            Feed::Own(&mut watch),
            (watch_rev, read_rev, armed_at),
            gone,
        )
        .await?;
        Ok(())
    }

    /// One attempt of `wait_gone_detail`: once the entry is gone, whether it went as the
    /// head of its queue ([`Gone::Head`]), which spares the woken waiter its listing.
    ///
    /// A short queue (at most [`TRACK_AT_MOST`] keys) is watched whole: the read after
    /// the watch starts lists every entry queued up to `entry`'s sequence, and the
    /// watch's deletes, every one after that read and in revision order, take them off.
    /// If none is left when `entry`'s delete comes, with every other change of that
    /// revision applied, nothing was queued up to it when it went: a release by the
    /// head. That is what [`Gone::Head`] asks of a backend, known here from one
    /// consistent read and every change after it rather than from the removal itself.
    /// No entry can join there unseen: a new entry sorts behind `entry`, except a read
    /// put beside a write (a downgrade) with that write's sequence, so when an entry
    /// ahead of `entry` is a write, nothing is tracked and the answer is
    /// [`Gone::Unknown`]. Only exclusive `Lock` entries are waited on this way; a read
    /// or a write is watched by its key alone.
    ///
    /// A longer queue is left to [`Self::wait_gone_once`] (one key watched). Only the
    /// first [`TRACK_AT_MOST`] entries of a queue can have seen it that short, so each
    /// change of a queue is sent to at most that many of its waiters, however long it
    /// grows.
    pub(crate) async fn wait_gone_tracking_once(
        &self,
        prefix: &str,
        key: &str,
        entry: &Entry,
        mine: Option<&Entry>,
    ) -> Result<Woken> {
        let one_key = || async {
            self.wait_gone_once(key, entry)
                .await
                .map(|()| Woken::new(Gone::Unknown, false))
        };
        if !matches!(entry.kind, EntryKind::Lock | EntryKind::Lease) {
            // A read or write queue (`RwLock`): its readers come and go beside each
            // other, and each of their deletes would reach every whole-queue watch.
            // Measured (W5, 90 % reads, five interleaved rounds against one etcd):
            // 12 % slower with writers waiting on reads watching the queue whole. A
            // write waited on could also be joined by a downgrade's read. A ranked
            // semaphore's entries (`Lease`) queue as a mutex's do, each behind the last.
            return one_key().await;
        }
        // Deletes only: a put can bring an entry ahead only as a read beside a write,
        // and with a write up to `entry` in the read nothing is tracked. The watch is the
        // client's hub of this queue, armed by the first such wait and kept between
        // waits; read at or above the revision its feed covers, the queue and the feed
        // show every change, as a watch armed before the read would.
        let (hub, joined) = self.join_queue(prefix).await?;
        let mut sub = joined.sub;
        // The queue as an enqueue of this client read it, if that read is recent enough
        // (at or above `covered`) and shows the entry; else a read of its own. (A read
        // from before the entry was created does not show it, and would say "gone".)
        let (read, read_rev) = match joined.snapshot.filter(|(_, r)| holds_entry(r, key, entry)) {
            Some((rev, r)) => (r, rev),
            None => {
                let r = self
                    .fresh_get(
                        prefix,
                        queue_read().with_limit(TRACK_AT_MOST + 1),
                        joined.covered,
                    )
                    .await
                    .map_err(|e| map(&format!("reading queue {prefix}"), e))?;
                let rev = header_rev(r.header());
                (Arc::new(r), rev)
            }
        };
        if read.more() || read.kvs().len() > TRACK_AT_MOST as usize {
            // Too long to watch whole: leave the hub and watch the one key. (The read
            // holds only the queue's first keys: it cannot say `entry` is gone.)
            drop(sub);
            return one_key().await;
        }
        if !holds_entry(&read, key, entry) {
            return Ok(Woken::new(Gone::Unknown, false));
        }
        let queue = layout::queue_from_kvs(prefix, read.kvs().iter().map(raw));
        let Some(seq) = queue.iter().find(|e| e.name == entry.name).map(|e| e.seq) else {
            // Its key is not an entry of this queue's layout: nothing to track.
            return Ok(Woken::new(Gone::Unknown, false));
        };
        // The waiter's own entry, where the read shows it (its create revision its
        // token: a key of the same name created again is another entry).
        let mine = mine
            .filter(|m| holds_entry(&read, &format!("{prefix}{}", m.name), m))
            .map(|m| m.name.clone());
        let ahead_of_it = queue
            .iter()
            .filter(|e| e.seq <= seq && e.name != entry.name);
        let names = if ahead_of_it.clone().any(|e| e.kind == EntryKind::Write) {
            None
        } else {
            Some(ahead_of_it.map(|e| e.name.clone()).collect())
        };
        let mut ahead = Ahead {
            prefix,
            key,
            read_rev,
            names,
            mine,
        };
        let seen = self
            .until_gone(
                key,
                entry,
                Feed::Hub(&mut sub),
                (hub.watch_rev, read_rev, hub.armed_at),
                |m| ahead.apply(m),
            )
            .await?;
        // Only a delete the feed delivered has every earlier delete before it: one
        // found by a re-read (`None`) may be ahead of a watch the server left unsynced.
        Ok(match seen {
            Some(gone) => Woken::new(gone, ahead.mine.is_some()),
            None => Woken::new(Gone::Unknown, false),
        })
    }

    /// Joins the client's hub of the queue at `prefix` (`hubs.rs`), arming its watch
    /// (the whole queue, deletes only) if there is none or its watch has ended: the
    /// hub, the feed and the revision a read must reach to miss nothing.
    async fn join_queue(&self, prefix: &str) -> Result<(Arc<Hub>, Joined)> {
        let found = self.hubs.lock().get(prefix).cloned();
        if let Some(hub) = found {
            if let Some(joined) = hub.subscribe() {
                return Ok((hub, joined));
            }
        }
        let (watch, watch_rev) = self.arm(prefix, true, true).await?;
        Ok(Hub::start(&self.hubs, prefix.to_owned(), watch, watch_rev))
    }

    /// Waits on a watch's `feed` until `on_message` says the entry at `key` is gone
    /// (`Some`), or a re-read finds it gone first (`None`). The revision the watch
    /// starts after, that of the read that last showed the entry, and when the watch
    /// was armed.
    async fn until_gone<T>(
        &self,
        key: &str,
        entry: &Entry,
        mut feed: Feed<'_>,
        (watch_rev, read_rev, armed_at): (i64, i64, Instant),
        mut on_message: impl FnMut(&WatchResponse) -> Option<T>,
    ) -> Result<Option<T>> {
        let exists = |r: &GetResponse| holds_entry(r, key, entry);
        // The server starts a watch from "now" as synced, unless a write lands between the
        // moment it reads its revision and the moment it registers the watcher; such a
        // watcher is caught up by the 100 ms loop, and a delete in that gap would reach
        // us up to 100 ms late, stalling every waiter behind us. If the read shows that
        // nothing was written since the watch's start, it is synced; otherwise two cheap
        // reads every 5 ms for the first 55 ms bound that stall without waiting on the loop.
        // A hub's watch armed longer ago than that has been caught up (`hubs.rs`).
        let now = Instant::now();
        let mut next_check = now + UNSYNCED_CHECK;
        let last_check = if self.proves_synced(read_rev, watch_rev) {
            now
        } else {
            armed_at + UNSYNCED_WINDOW
        };
        // A backstop, once per session TTL: if the watch ever misses the delete (it must
        // not, but a missed wake-up would strand this waiter, and everyone queued behind
        // it, for as long as the session lives), a read finds it. One read per waiter per
        // TTL; a waiter that finds its predecessor gone this way says so.
        let audit_every = self.session.lock().ttl().max(Duration::from_secs(1));
        let mut next_audit = now + audit_every;
        loop {
            let msg = tokio::select! {
                m = feed.message() => m,
                _ = tokio::time::sleep_until(next_audit) => {
                    next_audit += audit_every;
                    let r = self
                        .fresh_get(key, GetOptions::new(), watch_rev)
                        .await
                        .map_err(|e| map(&format!("reading {key}"), e))?;
                    if !exists(&r) {
                        tracing::warn!(key, "the entry ahead is gone but its watch did not report the delete; found by the periodic re-read");
                        return Ok(None);
                    }
                    continue;
                }
                _ = tokio::time::sleep_until(next_check), if next_check <= last_check => {
                    next_check += UNSYNCED_CHECK;
                    let r = self
                        .fresh_get(key, GetOptions::new(), watch_rev)
                        .await
                        .map_err(|e| map(&format!("reading {key}"), e))?;
                    if !exists(&r) {
                        tracing::debug!(target: "dlock_etcd::unsynced", key, "delete found by a re-read before the watch reported it");
                        return Ok(None);
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
                    if let Some(done) = on_message(&m) {
                        return Ok(Some(done));
                    }
                }
                None => return Err(Error::Unreachable(format!("watch on {key}: stream closed"))),
            }
        }
    }

    /// One attempt of `wait_changed`.
    pub(crate) async fn wait_changed_once(&self, prefix: &str, seen: &[Entry]) -> Result<()> {
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
        let read_rev = header_rev(resp.header());
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
                    // Only keys directly in the queue count; a sub-queue's traffic does
                    // not. Nor does a change the read already showed (`after_read`): the
                    // semaphore takes a wake here for a lease gone.
                    for e in m.events() {
                        let in_queue = e.kv().is_some_and(|kv| {
                            kv.key()
                                .strip_prefix(prefix.as_bytes())
                                .and_then(|n| std::str::from_utf8(n).ok())
                                .and_then(layout::parse_name)
                                .is_some()
                        });
                        if !in_queue {
                            continue;
                        }
                        if after_read(e.kv(), read_rev) {
                            return Ok(());
                        }
                        stale(prefix, e.kv(), read_rev);
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

    /// One attempt of `wait_data_changed`: the entry's data once it differs from
    /// `seen`, `None` once the entry is gone (deleted, or its key holds a newer entry).
    pub(crate) async fn wait_data_changed_once(
        &self,
        key: &str,
        entry: &Entry,
        seen: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        let mine = |kv: &etcd_client::KeyValue| {
            let created = u64::try_from(kv.create_revision()).ok();
            kv.key() == key.as_bytes()
                && entry.token_matches(created.map(dlock_core::FencingToken::new))
        };
        // Arm first, then read at or after the watch's start: a change is then either in
        // the read or reported by the watch.
        let (mut watch, watch_rev) = self.arm(key, false, false).await?;
        let read = self
            .fresh_get(key, GetOptions::new(), watch_rev)
            .await
            .map_err(|e| map(&format!("reading {key}"), e))?;
        let Some(kv) = read.kvs().iter().find(|kv| mine(kv)) else {
            return Ok(None);
        };
        let data = layout::decode_value(kv.value()).data;
        if data != seen {
            return Ok(Some(data.to_vec()));
        }
        let read_rev = header_rev(read.header());
        loop {
            match watch.message().await {
                Some(m) => {
                    self.observe(header_rev(m.header()));
                    if m.canceled() {
                        return Err(Error::Unreachable(format!(
                            "watch on {key} cancelled by the server (compacted at {}): {}",
                            m.compact_revision(),
                            m.cancel_reason()
                        )));
                    }
                    for e in m.events() {
                        if !after_read(e.kv(), read_rev) {
                            stale(key, e.kv(), read_rev);
                            continue;
                        }
                        if e.event_type() == EventType::Delete {
                            return Ok(None);
                        }
                        let Some(kv) = e.kv() else { continue };
                        if !mine(kv) {
                            return Ok(None);
                        }
                        let data = layout::decode_value(kv.value()).data;
                        if data != seen {
                            return Ok(Some(data.to_vec()));
                        }
                    }
                }
                None => return Err(Error::Unreachable(format!("watch on {key}: stream closed"))),
            }
        }
    }

    /// Retries a watch attempt after transient failures (a broken stream, a server that
    /// went away, a compaction) for up to one session TTL; the caller's `lost` fires first
    /// if the outage outlives the session.
    pub(crate) async fn retry_watch<'a, T, F, Fut>(
        &'a self,
        what: &str,
        mut attempt: F,
    ) -> Result<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T>> + 'a,
    {
        let mut outage: Option<Instant> = None;
        let mut backoff = Duration::from_millis(20);
        loop {
            let began = Instant::now();
            match attempt().await {
                Ok(done) => return Ok(done),
                Err(e @ Error::Unreachable(_)) => {
                    let now = Instant::now();
                    if !outage_continues(&mut outage, began, now, self.session.lock().ttl()) {
                        return Err(e);
                    }
                    if outage == Some(now) {
                        backoff = Duration::from_millis(20);
                    }
                    tracing::debug!(what, error = %e, "watch failed; re-arming");
                    sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// How long an attempt of [`EtcdBackend::retry_watch`] must have run before its failure
/// counts as the start of a new outage rather than part of the one before: longer than
/// the longest back-off and an arming round trip, so it was a watch that worked.
const WORKED_FOR: Duration = Duration::from_secs(3);

/// Whether [`EtcdBackend::retry_watch`] tries again after an attempt that began at `began`
/// failed at `now`: while the outage (`outage`, its start, kept across calls) is shorter
/// than `ttl`. The outage is measured from its first failure, not from the first attempt:
/// one attempt lasts a whole wait behind one entry, so a waiter queued longer than a TTL
/// would otherwise never be retried.
fn outage_continues(
    outage: &mut Option<Instant>,
    began: Instant,
    now: Instant,
    ttl: Duration,
) -> bool {
    if now.duration_since(began) >= WORKED_FOR {
        *outage = Some(now);
    }
    let start = *outage.get_or_insert(began);
    now.duration_since(start) < ttl
}

#[cfg(test)]
mod outage_tests {
    use super::*;

    #[test]
    fn an_outage_is_measured_from_its_first_failure() {
        let ttl = Duration::from_secs(60);
        let t0 = Instant::now();
        let mut outage = None;
        // A watch that worked for five minutes, then broke: retried.
        let failed = t0 + Duration::from_secs(300);
        assert!(outage_continues(&mut outage, t0, failed, ttl));
        // Quick failures after it: retried while the outage is under a TTL...
        let mut at = failed;
        for _ in 0..50 {
            let began = at;
            at += Duration::from_secs(1);
            assert!(outage_continues(&mut outage, began, at, ttl));
        }
        // ...and given up once it lasts a TTL.
        let began = failed + Duration::from_secs(59);
        assert!(!outage_continues(&mut outage, began, failed + ttl, ttl));
        // Never working at all: given up after a TTL from the first attempt.
        let mut fresh = None;
        assert!(outage_continues(
            &mut fresh,
            t0,
            t0 + Duration::from_millis(5),
            ttl
        ));
        assert!(!outage_continues(
            &mut fresh,
            t0 + Duration::from_secs(59),
            t0 + ttl,
            ttl
        ));
    }
}
