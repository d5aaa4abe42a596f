//! Faults of one session on a [`super::MemServer`]: the hooks a test calls, and the draws
//! from a seeded [`FaultPlan`].
//!
//! Every draw comes from one [`StdRng`] per session, seeded from the plan's seed and the
//! session's number, and is made in the order the session's requests and watch events
//! reach the server. Under `tokio::time::pause()` on a current-thread runtime that order,
//! and so every fault, is the same for one seed on every run.

use std::time::Duration;

use dlock_core::Gone;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::sync::oneshot;

use super::{MemServer, SessionId};

/// Probabilities of the faults a [`super::MemServer`] draws at random for every session,
/// from one seed. A probability outside `0.0..=1.0` acts as the nearest bound (NaN as 0).
///
/// Drawn faults add to those set per call ([`super::MemServer::drop_reply`] and friends):
/// explicit ones are used first.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultPlan {
    /// Seeds every session's generator (with the session's number), so one seed replays
    /// the same faults.
    pub seed: u64,
    /// Chance that the server applies a backend call but its reply is lost: the caller
    /// gets [`dlock_core::Error::Unreachable`]. Also drawn for heartbeats, whose lost
    /// reply the client does not count as a renewal.
    pub drop_reply: f64,
    /// Chance that a reply (of a call or a heartbeat) comes late, by a uniform draw up to
    /// [`FaultPlan::max_reply_delay`].
    pub delay_reply: f64,
    /// The longest drawn reply delay.
    pub max_reply_delay: Duration,
    /// Chance that a watch event is never delivered: the watcher finds the change by its
    /// re-check timer.
    pub lose_watch_event: f64,
    /// Chance that a watch event is delivered late, by a uniform draw up to
    /// [`FaultPlan::max_watch_delay`]; events drawn different delays arrive out of order.
    pub delay_watch_event: f64,
    /// The longest drawn watch-event delay.
    pub max_watch_delay: Duration,
}

impl FaultPlan {
    /// A plan with `seed` and no faults; set the probabilities wanted on it.
    pub fn new(seed: u64) -> Self {
        FaultPlan {
            seed,
            ..FaultPlan::default()
        }
    }
}

/// What a request is, for the faults that apply only to some.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Request {
    /// A [`dlock_core::Backend`] call.
    Call,
    /// A session keeper's heartbeat.
    Heartbeat,
}

/// What happens to one reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct ReplyFate {
    /// The request was applied, but the reply never reaches the client.
    pub(crate) dropped: bool,
    /// How late the reply reaches the client.
    pub(crate) delay: Duration,
}

/// What happens to one watch event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum EventFate {
    /// Delivered at once.
    Deliver,
    /// Never delivered.
    Lose,
    /// Delivered after this long.
    Delay(Duration),
}

/// The fault state of one session, kept by the server.
#[derive(Debug)]
pub(crate) struct SessionFaults {
    /// No request, heartbeat or watch event gets through.
    pub(crate) partitioned: bool,
    /// Replies of backend calls still to drop (heartbeats are not counted).
    drop_replies: usize,
    /// Every reply's delay.
    reply_delay: Duration,
    /// Watch events still to lose.
    lose_events: usize,
    /// Every watch event is delayed by a draw up to this.
    max_event_delay: Duration,
    plan: FaultPlan,
    rng: StdRng,
}

impl SessionFaults {
    /// No faults yet; draws follow `plan` (no plan: nothing is drawn).
    pub(crate) fn new(plan: Option<&FaultPlan>, session: u64) -> Self {
        let plan = plan.cloned().unwrap_or_default();
        let rng = StdRng::seed_from_u64(plan.seed ^ session.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        SessionFaults {
            partitioned: false,
            drop_replies: 0,
            reply_delay: Duration::ZERO,
            lose_events: 0,
            max_event_delay: Duration::ZERO,
            plan,
            rng,
        }
    }

    pub(crate) fn drop_replies(&mut self, n: usize) {
        self.drop_replies = self.drop_replies.saturating_add(n);
    }

    pub(crate) fn delay_replies(&mut self, d: Duration) {
        self.reply_delay = d;
    }

    pub(crate) fn lose_watch_events(&mut self, n: usize) {
        self.lose_events = self.lose_events.saturating_add(n);
    }

    pub(crate) fn delay_watch_events(&mut self, max: Duration) {
        self.max_event_delay = max;
    }

    /// The fate of the reply to one request that reached the server.
    pub(crate) fn reply(&mut self, request: Request) -> ReplyFate {
        let mut fate = ReplyFate {
            dropped: false,
            delay: self.reply_delay,
        };
        if request == Request::Call && self.drop_replies > 0 {
            self.drop_replies -= 1;
            fate.dropped = true;
        } else if self.chance(self.plan.drop_reply) {
            fate.dropped = true;
        }
        if self.chance(self.plan.delay_reply) {
            fate.delay += self.upto(self.plan.max_reply_delay);
        }
        fate
    }

    /// The fate of one watch event for this session.
    pub(crate) fn event(&mut self) -> EventFate {
        if self.partitioned {
            return EventFate::Lose;
        }
        if self.lose_events > 0 {
            self.lose_events -= 1;
            return EventFate::Lose;
        }
        if self.chance(self.plan.lose_watch_event) {
            return EventFate::Lose;
        }
        let mut delay = Duration::ZERO;
        if !self.max_event_delay.is_zero() {
            delay += self.upto(self.max_event_delay);
        }
        if self.chance(self.plan.delay_watch_event) {
            delay += self.upto(self.plan.max_watch_delay);
        }
        if delay.is_zero() {
            EventFate::Deliver
        } else {
            EventFate::Delay(delay)
        }
    }

    /// True with probability `p`. Draws nothing for a probability of zero, so a plan
    /// without a fault leaves the other draws where they were.
    fn chance(&mut self, p: f64) -> bool {
        p > 0.0 && self.rng.gen::<f64>() < p
    }

    /// A uniform duration in `0..=max`, by whole microseconds.
    fn upto(&mut self, max: Duration) -> Duration {
        let micros = u64::try_from(max.as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(self.rng.gen_range(0..=micros))
    }
}

/// The fault hooks, per session: what a test (or a seeded simulation) does to one client.
impl MemServer {
    /// Expires session `id` now, as the server does once its timeout passes without a
    /// heartbeat: its entries go and their watchers are told. The client is not told: it
    /// learns through its `lost()` (a refused heartbeat or its own deadline) or a refused
    /// call. Returns whether the session was alive.
    pub fn expire_session(&self, id: SessionId) -> bool {
        self.expire(id)
    }

    /// Cuts session `id` off: its calls fail with [`dlock_core::Error::Unreachable`] without reaching
    /// the server, its heartbeats are not received (so its `lost()` fires by its own
    /// clock, and the server expires it once its timeout passes), and its watch events
    /// are lost.
    pub fn partition(&self, id: SessionId) {
        self.session_faults(id, |f| f.partitioned = true);
    }

    /// Ends a [`MemServer::partition`] of session `id`. A session the server expired
    /// meanwhile stays expired.
    pub fn heal(&self, id: SessionId) {
        self.session_faults(id, |f| f.partitioned = false);
    }

    /// The next `n` backend calls of session `id` are applied by the server, but their
    /// replies are lost: the caller gets [`dlock_core::Error::Unreachable`]. Heartbeats are not
    /// counted.
    pub fn drop_reply(&self, id: SessionId, n: usize) {
        self.session_faults(id, |f| f.drop_replies(n));
    }

    /// Every reply to session `id` (calls and heartbeats) reaches it `d` after the server
    /// applied the request, until set again; `Duration::ZERO` ends it.
    pub fn delay_replies(&self, id: SessionId, d: Duration) {
        self.session_faults(id, |f| f.delay_replies(d));
    }

    /// The next `n` watch events for session `id` are never delivered: its waits find
    /// the change by their re-check timer.
    pub fn lose_watch_event(&self, id: SessionId, n: usize) {
        self.session_faults(id, |f| f.lose_watch_events(n));
    }

    /// Every watch event for session `id` is delivered late, by a delay drawn up to
    /// `max` (so events may arrive out of order), until set again; `Duration::ZERO` ends
    /// it. An event is never delivered before its change is visible to reads.
    pub fn delay_watch_events(&self, id: SessionId, max: Duration) {
        self.session_faults(id, |f| f.delay_watch_events(max));
    }
}

/// Sends one watch event now, later, or never (dropping the sender: the waiter sees no
/// event and re-checks on its timer).
pub(crate) fn deliver(tx: oneshot::Sender<Gone>, event: Gone, fate: EventFate) {
    match fate {
        EventFate::Deliver => {
            let _ = tx.send(event);
        }
        EventFate::Lose => drop(tx),
        EventFate::Delay(d) => match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                rt.spawn(async move {
                    tokio::time::sleep(d).await;
                    let _ = tx.send(event);
                });
            }
            // Outside a runtime no timer can run: late is then as late as now.
            Err(_) => {
                let _ = tx.send(event);
            }
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_seed_draws_the_same_faults() {
        let plan = FaultPlan {
            drop_reply: 0.3,
            delay_reply: 0.5,
            max_reply_delay: Duration::from_millis(40),
            lose_watch_event: 0.2,
            ..FaultPlan::new(7)
        };
        let draw = || {
            let mut f = SessionFaults::new(Some(&plan), 3);
            (0..50)
                .map(|_| (f.reply(Request::Call), f.event()))
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(), draw());
        assert!(draw().iter().any(|(r, _)| r.dropped));
        assert!(draw().iter().any(|(_, e)| *e == EventFate::Lose));
    }

    #[test]
    fn explicit_drops_skip_heartbeats() {
        let mut f = SessionFaults::new(None, 1);
        f.drop_replies(1);
        assert!(!f.reply(Request::Heartbeat).dropped);
        assert!(f.reply(Request::Call).dropped);
        assert!(!f.reply(Request::Call).dropped);
    }
}
