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

/// An entry this client created and renews.
#[derive(Debug)]
pub(crate) struct Live {
    /// Shared: a renewal round groups entries by queue without copying the key names.
    pub(crate) keys: Arc<QueueKeys>,
    pub(crate) ticket: Option<String>,
    /// Created by the uncontended fast path as the lock's one key: released with
    /// `RELEASE_SOLO` (which says when a second entry moved it into the queue layout).
    pub(crate) solo: bool,
    /// When the last renewal that reached a majority was *sent*: the server's expiry is
    /// later than this plus the lease, so a deadline computed from it is conservative.
    renewed_at: Instant,
    pub(crate) fate: watch::Sender<Option<Fate>>,
}

impl Shared {
    pub(crate) fn register(
        &self,
        keys: &Arc<QueueKeys>,
        name: &str,
        ticket: Option<String>,
        sent_at: Instant,
        solo: bool,
    ) {
        let (tx, _) = watch::channel(None);
        self.live.lock().insert(
            (keys.queue.clone(), name.to_owned()),
            Live {
                keys: keys.clone(),
                ticket,
                solo,
                renewed_at: sent_at,
                fate: tx,
            },
        );
    }

    /// Stops renewing an entry and tells its `lost()` futures why.
    pub(crate) fn settle(&self, queue_key: &str, name: &str, fate: Fate) -> Option<Arc<QueueKeys>> {
        self.settle_live(queue_key, name, fate)
            .map(|(keys, _)| keys)
    }

    /// As [`Shared::settle`], and says whether the entry was created solo.
    pub(crate) fn settle_live(
        &self,
        queue_key: &str,
        name: &str,
        fate: Fate,
    ) -> Option<(Arc<QueueKeys>, bool)> {
        let live = self
            .live
            .lock()
            .remove(&(queue_key.to_owned(), name.to_owned()))?;
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
    fn lose(self: &Arc<Self>, queue_key: &str, name: &str, reason: String) {
        if let Some(keys) = self.settle(queue_key, name, Fate::Lost(reason)) {
            let shared = self.clone();
            let name = name.to_owned();
            tokio::spawn(async move {
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

    /// Fires `lost()` of every entry not renewed for a whole lease (minus drift): past
    /// that point the server may already have expired it. Returns the earliest deadline
    /// still ahead.
    fn fire_overdue(self: &Arc<Self>) -> Option<Instant> {
        let now = Instant::now();
        let mut overdue = Vec::new();
        let mut next: Option<Instant> = None;
        for (k, l) in self.live.lock().iter() {
            let d = self.deadline_of(l.renewed_at);
            if d <= now {
                overdue.push(k.clone());
            } else {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
        }
        for (q, name) in overdue {
            self.lose(
                &q,
                &name,
                format!(
                    "no successful renewal for a whole lease ({:?}, less drift and the safety margin)",
                    self.lease
                ),
            );
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
        let sent_at = Instant::now();
        let (groups_ref, lease_ref) = (&groups, &self.lease_ms);
        let jobs = (0..groups.len()).flat_map(|g| (0..self.nodes.len()).map(move |n| (g, n)));
        let mut pending = futures::stream::iter(jobs)
            .map(|(g, n)| async move {
                let (keys, names) = &groups_ref[g];
                let mut args = Vec::with_capacity(names.len() + 2);
                args.push(Value::from(keys.entry_prefix.as_str()));
                args.push(lease_ref.clone());
                args.extend(names.iter().map(|n| Value::from(n.as_str())));
                let r = self.nodes[n]
                    .eval(
                        "renewing entries",
                        &self.scripts.renew,
                        keys.script_keys(),
                        args,
                    )
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
        while let Some((g, r)) = pending.next().await {
            let (keys, names) = &groups[g];
            for (i, name) in names.iter().enumerate() {
                let t = &mut tally[g][i];
                match &r {
                    Ok(v) if v[i] => {
                        t.0 += 1;
                        self.counters.renewals.fetch_add(1, Ordering::Relaxed);
                        if t.0 == self.majority {
                            if let Some(l) = self
                                .live
                                .lock()
                                .get_mut(&(keys.queue.clone(), name.clone()))
                            {
                                l.renewed_at = l.renewed_at.max(sent_at);
                            }
                        }
                    }
                    Ok(_) => t.1 += 1,
                    Err(e) => t.2 = Some(e.to_string()),
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
                }
            }
        }
        let wake = shared.wake.clone();
        drop(shared);
        tokio::select! {
            _ = tokio::time::sleep_until(round_started + period) => {}
            _ = wake.notified() => {}
        }
    }
}
