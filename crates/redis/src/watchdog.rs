//! The watchdog and the registry of live entries: renewal rounds, the lease deadlines,
//! and `lost()` firing for entries gone or not renewed in time.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};

use fred::prelude::Value;
use tokio::sync::watch;
use tokio::time::Instant;
use tracing::{debug, warn};

use crate::backend::{Mode, Shared};
use crate::keys::QueueKeys;
use crate::reply;

/// Renewal scripts in flight at once per master in a watchdog round (over all queues).
const RENEW_IN_FLIGHT: usize = 64;

/// Why a live entry stopped being live.
#[derive(Debug, Clone)]
pub(crate) enum Fate {
    Lost(String),
    Released,
    Closed,
}

/// What the release of an entry created solo sends to `RELEASE_SOLO`.
#[derive(Debug)]
pub(crate) struct SoloRelease {
    /// The entry's whole value, `<name> <token> <data>`, or `<name> ` alone when the
    /// data is longer than [`SoloRelease::WHOLE_UP_TO`] bytes.
    pub(crate) arg: Value,
    /// Whether `arg` is the whole value: a release found by the name only is then a
    /// value that changed on the server ([`crate::Stats::solo_mismatches`]).
    pub(crate) whole: bool,
}

impl SoloRelease {
    /// Data up to this many bytes is sent back whole with the release (one string
    /// comparison on the server); longer data is not sent twice, and the server finds
    /// the holder's entry by its name instead (about 6k instructions more).
    pub(crate) const WHOLE_UP_TO: usize = 256;

    /// The release argument of the solo entry `name` with `token` and `data`, as
    /// `ACQUIRE_SOLO` wrote it: `token` is the decimal string that script returned.
    pub(crate) fn new(name: &str, token: &str, data: &[u8]) -> Self {
        let whole = data.len() <= Self::WHOLE_UP_TO;
        let mut arg = Vec::with_capacity(name.len() + token.len() + data.len() + 2);
        arg.extend_from_slice(name.as_bytes());
        arg.push(b' ');
        if whole {
            arg.extend_from_slice(token.as_bytes());
            arg.push(b' ');
            arg.extend_from_slice(data);
        }
        SoloRelease {
            arg: Value::Bytes(arg.into()),
            whole,
        }
    }
}

/// An entry this client created and renews.
#[derive(Debug)]
pub(crate) struct Live {
    /// Shared: a renewal round groups entries by queue without copying the key names.
    pub(crate) keys: Arc<QueueKeys>,
    pub(crate) ticket: Option<String>,
    /// Created by the uncontended fast path as the lock's one key: what its release
    /// (`RELEASE_SOLO`) sends. It still says so after a second entry or a watcher moved
    /// the entry into the queue layout (the release then learns that from the server).
    /// `None` for an entry created in the queue layout.
    pub(crate) solo: Option<SoloRelease>,
    /// When the last renewal that reached a majority was *sent*: the server's expiry is
    /// later than this plus the lease, so a deadline computed from it is conservative.
    renewed_at: Instant,
    /// Seen past its deadline ([`Shared::overdue`]): lost for good, whatever renewal is
    /// credited later (one sent before the deadline can be answered after it, and a
    /// reader already told "lost" must not be told "held" next).
    lapsed: bool,
    pub(crate) fate: watch::Sender<Option<Fate>>,
}

impl Shared {
    /// Files a new entry whose creating request was sent at `sent_at` (its lease runs
    /// from no earlier), for the watchdog to renew.
    ///
    /// A reply can arrive late (retransmissions, a stalled server), at most the command
    /// timeout after the request, which for a short lease is more than the lease less
    /// drift and [`dlock_core::lost_margin`]. An entry whose deadline has passed by now is
    /// declared lost at once, so its grant is refused ([`Shared::lose`]); one whose
    /// deadline falls before the watchdog's next round wakes it to look again, since it
    /// sleeps until the earliest deadline it knew of, and to renew at once.
    pub(crate) fn register(
        self: &Arc<Self>,
        keys: &Arc<QueueKeys>,
        name: &str,
        ticket: Option<String>,
        sent_at: Instant,
        solo: Option<SoloRelease>,
    ) {
        let (tx, _) = watch::channel(None);
        self.live.lock().insert(
            (keys.queue.clone(), name.to_owned()),
            Live {
                keys: keys.clone(),
                ticket,
                solo,
                renewed_at: sent_at,
                lapsed: false,
                fate: tx,
            },
        );
        let (deadline, now) = (self.deadline_of(sent_at), Instant::now());
        if deadline <= now {
            self.lose(
                &keys.queue,
                name,
                format!(
                    "the reply that created it came {:?} after the request: past its lease \
                     ({:?}) less drift and the safety margin",
                    now - sent_at,
                    self.lease
                ),
            );
        } else if deadline < now + self.lease / 3 {
            // Look at the deadlines again, and renew now: a round that succeeds in time
            // saves the entry rather than letting it run out before the next one.
            self.deadlines.notify_one();
            self.wake.notify_one();
        }
    }

    /// Stops renewing an entry and tells its `lost()` futures why.
    pub(crate) fn settle(&self, queue_key: &str, name: &str, fate: Fate) -> Option<Arc<QueueKeys>> {
        self.settle_live(queue_key, name, fate)
            .map(|(keys, _)| keys)
    }

    /// As [`Shared::settle`], and gives back the value of an entry created solo.
    pub(crate) fn settle_live(
        &self,
        queue_key: &str,
        name: &str,
        fate: Fate,
    ) -> Option<(Arc<QueueKeys>, Option<SoloRelease>)> {
        self.settle_filed(&(queue_key.to_owned(), name.to_owned()), fate)
    }

    /// As [`Shared::settle_live`], for an entry named by the key it is filed under
    /// (queue key, entry name), when the caller has that key built already.
    pub(crate) fn settle_filed(
        &self,
        filed: &(String, String),
        fate: Fate,
    ) -> Option<(Arc<QueueKeys>, Option<SoloRelease>)> {
        let (queue_key, name) = filed;
        let live = self.live.lock().remove(filed)?;
        let lost = match &fate {
            Fate::Lost(reason) => Some(reason.clone()),
            _ => None,
        };
        // Told before it is logged: a grant checked while the line is written must
        // already see the entry lost.
        let _ = live.fate.send(Some(fate));
        if let Some(reason) = lost {
            self.counters.lost.fetch_add(1, Ordering::Relaxed);
            warn!(queue = %queue_key, entry = %name, %reason, "lock entry lost");
        }
        Some((live.keys, live.solo))
    }

    /// Declares an entry lost and removes whatever is left of it, in the background, so
    /// that a remnant on some master does not make others wait for its expiry.
    ///
    /// The removal waits [`dlock_core::lost_margin`] first: `lost()` promises the holder
    /// that much time before anyone else is granted, and a removal sent at once would
    /// let the next contender in right after the signal whenever the server is
    /// reachable again by then (renewals held back through a Sentinel failover, then
    /// let through: `sentinel_holder_behind_a_stale_sentinel` granted 150 ms after the
    /// signal, with 200 ms promised).
    fn lose(self: &Arc<Self>, queue_key: &str, name: &str, reason: String) {
        if let Some(keys) = self.settle(queue_key, name, Fate::Lost(reason)) {
            let shared = self.clone();
            let name = name.to_owned();
            let pause = dlock_core::lost_margin(self.lease);
            tokio::spawn(async move {
                tokio::time::sleep(pause).await;
                let _ = shared.remove_names(&keys, &[name]).await;
            });
        }
    }

    /// When an entry renewed by a round sent at `renewed_at` is declared lost: the lease,
    /// less the clock-drift allowance, less [`dlock_core::lost_margin`], so that `lost()`
    /// fires that margin before the server may expire it.
    fn deadline_of(&self, renewed_at: Instant) -> Instant {
        renewed_at
            + self
                .lease
                .saturating_sub(self.drift + dlock_core::lost_margin(self.lease))
    }

    /// Why an entry is lost whose deadline passed with no renewal: [`Shared::overdue`], or
    /// the watchdog's round that finds it so.
    pub(crate) fn overdue_reason(&self) -> String {
        format!(
            "no successful renewal for a whole lease ({:?}, less drift and the safety margin)",
            self.lease
        )
    }

    /// Whether `live`'s deadline has passed, whether or not the watchdog has run since
    /// to declare it lost: on a starved runtime it can run long after the server expired
    /// the key and granted the lock to another client.
    ///
    /// Once it has said so, it always will: the entry lapses for good.
    pub(crate) fn overdue(&self, live: &mut Live) -> bool {
        if !live.lapsed && self.deadline_of(live.renewed_at) <= Instant::now() {
            live.lapsed = true;
        }
        live.lapsed
    }

    /// Credits `live` with a renewal sent at `sent_at` that a majority (and the asked
    /// replicas) acknowledged, unless it is already overdue: a renewal answered after
    /// the deadline does not bring a lapsed entry back.
    fn credit(&self, live: &mut Live, sent_at: Instant) {
        if !self.overdue(live) {
            live.renewed_at = live.renewed_at.max(sent_at);
        }
    }

    /// Fires `lost()` of every entry not renewed for a whole lease (minus drift): past
    /// that point the server may already have expired it. Returns the earliest deadline
    /// still ahead.
    fn fire_overdue(self: &Arc<Self>) -> Option<Instant> {
        let now = Instant::now();
        let mut overdue = Vec::new();
        let mut next: Option<Instant> = None;
        for (k, l) in self.live.lock().iter() {
            let d = self.deadline_of(l.renewed_at);
            if l.lapsed || d <= now {
                overdue.push(k.clone());
            } else {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        for (q, name) in overdue {
            self.lose(&q, &name, self.overdue_reason());
        }
        next
    }

    /// One renewal round: one script per queue and master, [`RENEW_IN_FLIGHT`] per master
    /// in flight at a time, each built only when sent, so that a client holding many locks
    /// does not hold a copy of every request at once. An entry is credited as soon as a
    /// majority of masters renewed it, so a dead master that answers only at its command
    /// timeout does not delay the credit.
    async fn renew_round(self: &Arc<Self>) {
        use futures::StreamExt;
        let mut groups: Vec<(Arc<QueueKeys>, Vec<String>)> = Vec::new();
        {
            let mut by_queue: HashMap<&str, usize> = HashMap::new();
            let live = self.live.lock();
            for ((_, name), l) in live.iter() {
                let i = *by_queue.entry(l.keys.queue.as_str()).or_insert_with(|| {
                    groups.push((l.keys.clone(), Vec::new()));
                    groups.len() - 1
                });
                groups[i].1.push(name.clone());
            }
        }
        if groups.is_empty() {
            return;
        }
        let mark = self.replication_mark();
        let sent_at = Instant::now();
        let (groups_ref, lease_ref) = (&groups, &self.lease_ms);
        let jobs = (0..groups.len()).flat_map(|g| (0..self.nodes.len()).map(move |n| (g, n)));
        let mut pending = futures::stream::iter(jobs)
            .map(|(g, n)| async move {
                let (keys, names) = &groups_ref[g];
                let mut args = Vec::with_capacity(names.len() + 2);
                args.push(Value::from(keys.entry_prefix()));
                args.push(lease_ref.clone());
                args.extend(names.iter().map(|n| Value::from(n.as_str())));
                let r = self.nodes[n]
                    .eval("renewing entries", &self.scripts.renew, || {
                        (keys.script_keys(), args.clone())
                    })
                    .await
                    .and_then(|v| reply::renewed(v, names.len()));
                (g, r)
            })
            .buffer_unordered(RENEW_IN_FLIGHT * self.nodes.len());
        // Per group and entry: (renewed, gone, last error).
        let mut tally: Vec<Vec<(usize, usize, Option<String>)>> = groups
            .iter()
            .map(|(_, names)| vec![(0, 0, None); names.len()])
            .collect();
        // With `replicas`, renewals are credited only once the replicas acknowledged
        // them, after the round: a renewal a promoted replica does not have would let
        // the holder count on a lease that the replica ends earlier.
        let mut credits: Vec<(String, String)> = Vec::new();
        while let Some((g, r)) = pending.next().await {
            let (keys, names) = &groups[g];
            for (i, name) in names.iter().enumerate() {
                let t = &mut tally[g][i];
                match &r {
                    Ok(v) if v[i] => {
                        t.0 += 1;
                        self.counters.renewals.fetch_add(1, Ordering::Relaxed);
                        if t.0 == self.majority {
                            let key = (keys.queue.clone(), name.clone());
                            if self.replicas > 0 {
                                credits.push(key);
                            } else if let Some(l) = self.live.lock().get_mut(&key) {
                                self.credit(l, sent_at);
                            }
                        }
                    }
                    Ok(_) => t.1 += 1,
                    Err(e) => t.2 = Some(e.to_string()),
                }
            }
        }
        if !credits.is_empty() {
            match self.replicated("renewing entries", mark).await {
                Ok(()) => {
                    let mut live = self.live.lock();
                    for key in &credits {
                        if let Some(l) = live.get_mut(key) {
                            self.credit(l, sent_at);
                        }
                    }
                }
                Err(e) => {
                    warn!(entries = credits.len(), error = %e, "renewals not acknowledged by the replicas do not count; the entries are lost at their deadlines unless a later round is");
                }
            }
        }
        let n = self.nodes.len();
        for ((keys, names), tally) in groups.iter().zip(tally) {
            for (name, (ok, gone, err)) in names.iter().zip(tally) {
                if ok >= self.majority {
                    continue;
                }
                if gone > n - self.majority {
                    let reason = match self.mode {
                        Mode::Single => "the entry expired or was deleted on the server".to_owned(),
                        Mode::Redlock => format!(
                            "the entry is gone from {gone} of {n} masters; a majority no longer holds it"
                        ),
                    };
                    self.lose(&keys.queue, name, reason);
                } else if let Some(e) = err {
                    debug!(entry = %name, error = %e, "renewal failed; retrying until the lease runs out");
                }
            }
        }
    }
}

/// The watchdog (Redisson's idea): renews every live entry every lease/3 with a script
/// that only extends entries that still exist, fires `lost()` where the entry is gone or
/// no renewal succeeded for a whole lease, and runs an extra round right after a
/// reconnect (a restart without persistence forgets every key, pitfall R4). It holds only
/// a `Weak`, and the owner aborts it on close and drop.
pub(crate) async fn watchdog(weak: Weak<Shared>) {
    let period = match weak.upgrade() {
        Some(s) => s.lease / 3,
        None => return,
    };
    loop {
        let Some(shared) = weak.upgrade() else { return };
        let round_started = Instant::now();
        shared.fire_overdue();
        {
            let round = shared.renew_round();
            tokio::pin!(round);
            loop {
                let next = shared.fire_overdue();
                let sleep =
                    tokio::time::sleep_until(next.unwrap_or_else(|| Instant::now() + period));
                tokio::select! {
                    _ = &mut round => break,
                    _ = sleep => {}
                    // A new entry's deadline may be earlier than `next`.
                    () = shared.deadlines.notified() => {}
                }
            }
        }
        // Between rounds the deadlines keep running: a deadline that falls in this sleep
        // (renewals that keep failing, say timing out at the command timeout) must fire
        // `lost()` then, not at the next round, which may be after the server expired the
        // entry. So wake at the earliest deadline too, as the round above does. The check
        // right after the round also catches a deadline that passed as the round ended.
        let next_round = round_started + period;
        let mut next_deadline = shared.fire_overdue();
        let (wake, deadlines) = (shared.wake.clone(), shared.deadlines.clone());
        // No strong reference while asleep, as before.
        drop(shared);
        // Pinned once: a reconnect's `notify_one` during the round (or this wait) is kept
        // as a permit and taken here, and one arriving between two sleeps is not missed.
        let notified = wake.notified();
        tokio::pin!(notified);
        loop {
            let until = next_deadline.map_or(next_round, |d| d.min(next_round));
            tokio::select! {
                _ = &mut notified => break,
                _ = tokio::time::sleep_until(until) => {}
                // A new entry's deadline may be earlier than `until` (`register`); a
                // `notify_one` while no one waits is kept as a permit, so none is missed.
                () = deadlines.notified() => {}
            }
            if Instant::now() >= next_round {
                // The round's start checks the deadlines.
                break;
            }
            let Some(shared) = weak.upgrade() else { return };
            next_deadline = shared.fire_overdue();
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicBool;
    use std::sync::Arc;
    use std::time::Duration;

    use fred::prelude::Value;
    use parking_lot::Mutex;
    use tokio::sync::Notify;
    use tokio::time::Instant;

    use super::{watchdog, Fate, SoloRelease};
    use crate::backend::{Counters, Mode, Shared};
    use crate::keys::QueueKeys;
    use crate::node::{Node, Tuning};
    use crate::scripts::Scripts;
    use crate::tls::Access;

    /// A backend on one master that accepts connections and never answers: every
    /// renewal times out after `command_timeout`.
    fn unanswering(addr: &str, lease: Duration, command_timeout: Duration) -> Arc<Shared> {
        let tuning = Tuning {
            attempt_timeout: command_timeout,
            command_timeout,
            database: None,
        };
        let node = Node::start(addr, tuning, &Access::default()).expect("node");
        Arc::new(Shared {
            mode: Mode::Single,
            prefix: String::new(),
            nodes: vec![node],
            majority: 1,
            lease,
            lease_ms: Value::from(lease.as_millis().to_string()),
            recheck: (lease / 3).min(Duration::from_secs(1)),
            drift: lease / 100 + Duration::from_millis(2),
            replicas: 0,
            replica_wait: Duration::from_millis(100),
            scripts: Scripts::new(false, lease.as_millis()),
            live: Mutex::new(crate::backend::FastMap::default()),
            chans: Mutex::new(crate::backend::FastMap::default()),
            idle_chans: Mutex::new(Vec::new()),
            sub_ops: tokio::sync::Mutex::new(()),
            seq_hint: Default::default(),
            contended: Mutex::new(crate::backend::FastMap::default()),
            wake: Arc::new(Notify::new()),
            deadlines: Arc::new(Notify::new()),
            closed: AtomicBool::new(false),
            removing: tokio::sync::RwLock::new(()),
            tasks: Mutex::new(Vec::new()),
            counters: Counters::default(),
        })
    }

    /// A holder cut off right after a successful renewal, on the default 30 s lease:
    /// rounds every 10 s, each renewal timing out (5 s). Its deadline, t0 + 30 s − 0.302 s
    /// − 3 s ≈ t0 + 26.7 s, falls while the watchdog sleeps between the round of t0 + 20 s
    /// (timed out at t0 + 25 s) and the one of t0 + 30 s, the moment the server may expire
    /// the entry. `lost()` must fire at the deadline, not then: before, it fired at the
    /// next round. Paused time (the clock moves only when every task waits), so the
    /// moments are exact whatever the machine's load.
    #[tokio::test(start_paused = true)]
    async fn lost_fires_at_the_deadline_between_rounds() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let lease = Duration::from_secs(30);
        let shared = unanswering(&addr, lease, Duration::from_secs(5));
        let keys = Arc::new(QueueKeys::of("", "watchdog-test", None));
        let t0 = Instant::now();
        shared.register(&keys, "e1", None, t0, None);
        let mut fate = shared.live.lock()[&(keys.queue.clone(), "e1".to_owned())]
            .fate
            .subscribe();
        let deadline = shared.deadline_of(t0);
        let task = tokio::spawn(watchdog(Arc::downgrade(&shared)));

        let settled = tokio::time::timeout(2 * lease, fate.wait_for(Option::is_some))
            .await
            .expect("lost() never fired")
            .expect("fate sender dropped")
            .clone();
        let fired = Instant::now();
        task.abort();
        shared.nodes[0].abort_tasks();
        drop(listener);

        assert!(
            matches!(&settled, Some(Fate::Lost(r)) if r.contains("no successful renewal")),
            "{settled:?}"
        );
        // Not early: the entry is still renewed (and valid) until its deadline.
        assert!(
            fired >= deadline,
            "fired {:?} before the deadline",
            deadline - fired
        );
        // At the deadline (paused time: exactly, but for the watchdog's own steps).
        let slack = Duration::from_millis(10);
        assert!(
            fired <= deadline + slack,
            "lost() fired {:?} after the deadline (t0 + {:?}), at t0 + {:?}; the server may expire the entry at t0 + {:?}",
            fired - deadline,
            deadline - t0,
            fired - t0,
            lease,
        );
    }
    /// An entry whose creating reply came back later than its lease less drift and the
    /// margin (a short lease, a reply held up by retransmissions) is lost the moment it
    /// is registered, so its grant is refused; and one whose deadline falls before the
    /// watchdog's next round, which sleeps until the earliest deadline it knew of, wakes
    /// it: `lost()` fires at that deadline, not at the next round. Before, neither was
    /// looked at until the next round, up to lease/3 later, while the server could
    /// already have expired the entry and let another contender in.
    #[tokio::test(start_paused = true)]
    async fn late_replies_are_lost_at_once_or_at_their_deadline() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        let lease = Duration::from_secs(1);
        let shared = unanswering(&addr, lease, Duration::from_secs(1));
        let keys = Arc::new(QueueKeys::of("", "watchdog-late", None));
        let fate_of = |name: &str| {
            shared.live.lock()[&(keys.queue.clone(), name.to_owned())]
                .fate
                .subscribe()
        };
        let task = tokio::spawn(watchdog(Arc::downgrade(&shared)));
        // The watchdog's first round has nothing to renew: it sleeps until the next.
        tokio::time::sleep(Duration::from_millis(10)).await;

        // Past its deadline when the reply came: lost before anyone can be handed it.
        let sent = Instant::now() - lease;
        shared.register(&keys, "past", None, sent, None);
        assert!(
            !shared
                .live
                .lock()
                .contains_key(&(keys.queue.clone(), "past".to_owned())),
            "an entry registered past its deadline is still live"
        );

        // 50 ms before its deadline when the reply came: lost at that deadline.
        let now = Instant::now();
        let sent = now + Duration::from_millis(50) - (shared.deadline_of(now) - now);
        shared.register(&keys, "late", None, sent, None);
        let mut fate = fate_of("late");
        let deadline = shared.deadline_of(sent);
        let settled = tokio::time::timeout(lease, fate.wait_for(Option::is_some))
            .await
            .expect("lost() never fired")
            .expect("fate sender dropped")
            .clone();
        let fired = Instant::now();
        task.abort();
        shared.nodes[0].abort_tasks();
        drop(listener);
        assert!(matches!(settled, Some(Fate::Lost(_))), "{settled:?}");
        assert!(fired >= deadline, "fired {:?} early", deadline - fired);
        assert!(
            fired <= deadline + Duration::from_millis(10),
            "lost() fired {:?} after the deadline; the watchdog's next round was {:?} away",
            fired - deadline,
            lease / 3
        );
    }

    /// The solo release's argument is `ACQUIRE_SOLO`'s value, `<name> <token> <data>`,
    /// for data up to [`SoloRelease::WHOLE_UP_TO`] bytes (spaces and binary included),
    /// and `<name> ` alone above it, which the script matches by the name.
    #[test]
    fn a_solo_release_sends_the_whole_value_up_to_the_limit() {
        let bytes = |v: &Value| v.as_bytes().expect("bytes").to_vec();
        let none = SoloRelease::new("_c_x-lock-1795932003520063", "1795932003520063", b"");
        assert!(none.whole);
        assert_eq!(
            bytes(&none.arg),
            b"_c_x-lock-1795932003520063 1795932003520063 "
        );
        let odd = SoloRelease::new("n", "7", b"a b\x00\xff");
        assert_eq!(bytes(&odd.arg), b"n 7 a b\x00\xff");
        let at = vec![b'd'; SoloRelease::WHOLE_UP_TO];
        let at_limit = SoloRelease::new("n", "7", &at);
        assert!(at_limit.whole);
        assert_eq!(bytes(&at_limit.arg), [&b"n 7 "[..], &at].concat());
        let over = SoloRelease::new("n", "7", &[b'd'; SoloRelease::WHOLE_UP_TO + 1]);
        assert!(!over.whole);
        assert_eq!(bytes(&over.arg), b"n ");
    }
}
