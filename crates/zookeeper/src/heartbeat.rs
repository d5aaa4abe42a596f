//! The session as the *leader* knows it: a heartbeat of `sync` requests that proves, from
//! the client, until when the leader cannot have expired the session.
//!
//! # Why the connection state is not enough
//! The server that answers a client's pings may be a follower cut off from the leader.
//! It keeps answering until it notices (syncLimit × tickTime), while the leader, which
//! alone expires sessions, no longer hears of the client and expires its session a
//! session timeout `t` after the last touch the follower forwarded. With the test
//! ensemble's timings (tick 200 ms, syncLimit 10) and a 2 s session, the leader granted a
//! lock to another client 2.06 s after such a cut while the holder's connection still
//! looked healthy (`follower_cut_from_leader_loses_before_the_next_grant`).
//!
//! # What a completed `sync` proves
//! A `sync` is forwarded by a follower to the leader over the follower's one TCP
//! connection to it, and answered over the same connection. The follower records every
//! request of a session as a touch and reports its touches in its answer to the leader's
//! next PING, which the leader sends every tickTime/2. TCP keeps order, so once a `sync`
//! sent at `s2` completes, every message the follower sent the leader before forwarding
//! it has arrived, including its answers to the PINGs that followed an earlier `sync`
//! sent at `s1` (when `s2 - s1` is longer than a tick; ZooKeeper's minimum session is two
//! ticks, so `t / 2` is). So the leader touched the session at or after `s1`, and cannot
//! expire it before `s1 + t`. The argument needs both syncs on one connection: a
//! follower that dropped out loses the touches it had not yet reported, and a
//! reconnection does not reliably touch the session at the leader (seen in that test: a
//! pair across a reconnection proved a touch that never reached the leader). So any
//! change of the connection's state forgets every earlier sync.
//!
//! The follower records the touch when `s1` *reaches* it, which a slow network can make
//! as late as `s1`'s completion `c1` (the client cannot tell when in between). So the pair
//! gap is counted from `c1`, not from `s1`: a `s2` sent at least two ticks after `c1` is
//! forwarded at least two ticks after the touch, with a PING and its answer in between.
//! Counted from the send times, a `s1` held up in the network until just before `s2` went
//! out proved a touch no PING had reported yet (found by a review).
//!
//! The heartbeat therefore sends a `sync` every [`interval`] and keeps the send and
//! completion times of the completed ones; the session is trusted until `s1 + t -
//! margin`, where `s1` is the send time of the latest completed sync that completed at
//! least a pair gap before the latest completed one was sent. When that moment passes
//! without a newer proof, the session is declared lost.

use std::collections::VecDeque;
use std::sync::Weak;
use std::time::Duration;

use futures::FutureExt as _;
use tokio::time::Instant;

use crate::session::{Health, Shared};

/// How much of the session timeout `t` the lost signal keeps in hand before the earliest
/// moment the leader may expire the session: max(0.15·`t`, 100 ms), for the last round
/// trip, scheduler delay and timer skew.
pub(crate) fn margin(t: Duration) -> Duration {
    (t * 3 / 20).max(dlock_core::lost_margin(t))
}

/// How often the heartbeat sends a `sync`: `t`/16.
pub(crate) fn interval(t: Duration) -> Duration {
    t / 16
}

/// How long after an earlier sync completed a later one must be sent for the later one
/// to prove the earlier one's touch reached the leader: two ticks (the leader PINGs every
/// half tick, and the touch must be reported before the later sync is forwarded), at most
/// `t`/2. A tick stated smaller than the ensemble's makes this too short to prove
/// anything: the adapter takes the larger of a stated and a probed tick.
pub(crate) fn pair_gap(t: Duration, tick: Option<Duration>) -> Duration {
    tick.map_or(t / 2, |tick| (tick * 2).min(t / 2))
}

/// What a server's `conf` four-letter word tells about the quorum's timing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ServerConf {
    /// `tickTime`.
    pub(crate) tick: Duration,
    /// `syncLimit` × `tickTime`: how long a follower cut off from its leader keeps
    /// serving its clients before it notices. `None` on a standalone server, which has no
    /// leader to be cut off from.
    pub(crate) follower_detection: Option<Duration>,
}

/// Asks the servers (`host:port` each) for their timing with the `conf` four-letter
/// word, over TLS when `tls` is given, all at once (blocking, one thread per server; a
/// second at most). The first answer wins; `None` if no server answers it.
///
/// All at once because a server that is down and drops the SYN holds its probe for the
/// whole limit: asked in turn, each such server listed before a live one added half a
/// second to every connect.
pub(crate) fn probe_conf(
    hosts: &[String],
    tls: Option<&std::sync::Arc<rustls::ClientConfig>>,
) -> Option<ServerConf> {
    let limit = Duration::from_millis(500);
    let (tx, rx) = std::sync::mpsc::channel();
    for host in hosts {
        let (tx, host, tls) = (tx.clone(), host.clone(), tls.cloned());
        // Detached: a probe still waiting on a dead server ends within its limit, and
        // its answer, if any, goes nowhere.
        std::thread::spawn(move || {
            let conf = crate::security::four_letter(&host, b"conf", tls.as_ref(), limit)
                .ok()
                .and_then(|out| parse_conf(&out));
            let _ = tx.send(conf);
        });
    }
    drop(tx);
    rx.iter().flatten().next()
}

/// The `tickTime=N` and `syncLimit=N` lines of a `conf` answer.
fn parse_conf(conf: &str) -> Option<ServerConf> {
    let field = |name: &str| -> Option<u32> {
        conf.lines()
            .find_map(|l| l.trim().strip_prefix(name))
            .and_then(|v| v.trim().parse().ok())
            .filter(|n| *n > 0)
    };
    let tick = Duration::from_millis(u64::from(field("tickTime=")?));
    Some(ServerConf {
        tick,
        follower_detection: field("syncLimit=").map(|n| tick * n),
    })
}

/// Whether a session of timeout `t` is comfortably longer than the time a cut-off
/// follower keeps serving (`syncLimit` × `tickTime`): the rule is `t` ≥ 2 × `syncLimit` ×
/// `tickTime`. Behind a cut-off follower the client learns nothing until the follower
/// drops it, then needs a reconnection and a fresh pair of syncs (two ticks apart) before
/// the heartbeat can prove the session again, and the lost signal fires
/// max(0.15·`t`, 100 ms) before the earliest expiry; with `t` under twice the follower's
/// detection time, that leaves no room and every follower partition costs the session.
pub(crate) fn session_outlasts_follower_detection(t: Duration, conf: &ServerConf) -> bool {
    conf.follower_detection.is_none_or(|d| t >= d * 2)
}

/// Until when a session of timeout `t` created by a connect request sent at `requested`
/// is trusted before any `sync` has confirmed it.
pub(crate) fn first_deadline(t: Duration, requested: Instant) -> Instant {
    requested + t - margin(t)
}

/// The leader-side expiry the client can prove, from the send times of completed syncs.
#[derive(Debug)]
pub(crate) struct LeaderLease {
    t: Duration,
    gap: Duration,
    /// Send and completion times of completed syncs, oldest first; only what a later
    /// pair may need.
    confirmed: VecDeque<(Instant, Instant)>,
    /// Until when the session is trusted.
    deadline: Instant,
}

impl LeaderLease {
    /// A lease for a session of timeout `t` created by a connect request sent at
    /// `requested` (the leader created the session after that, so it lives until at least
    /// `requested + t`).
    pub(crate) fn new(t: Duration, gap: Duration, requested: Instant) -> Self {
        LeaderLease {
            t,
            gap,
            confirmed: VecDeque::new(),
            deadline: first_deadline(t, requested),
        }
    }

    /// Until when the session is trusted.
    pub(crate) fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Forgets every completed sync: the connection changed, so none of them pairs with a
    /// later one. The deadline already proven stands.
    pub(crate) fn reconnected(&mut self) {
        self.confirmed.clear();
    }

    /// Records a `sync` sent at `sent` that completed at `completed`.
    pub(crate) fn confirmed(&mut self, sent: Instant, completed: Instant) {
        let pair_gap = self.gap;
        // The latest earlier sync that completed at least a pair gap before this one was
        // sent proves a touch at its send time.
        if let Some((proven, _)) = self
            .confirmed
            .iter()
            .rev()
            .find(|(_, done)| sent.saturating_duration_since(*done) >= pair_gap)
            .copied()
        {
            self.deadline = self.deadline.max(proven + self.t - margin(self.t));
            // Syncs sent before `proven` can never prove a later deadline.
            while self.confirmed.front().is_some_and(|(s, _)| *s < proven) {
                self.confirmed.pop_front();
            }
        }
        self.confirmed.push_back((sent, completed));
    }
}

/// Why a session is lost whose leader-proven deadline passed.
pub(crate) const UNCONFIRMED: &str =
    "no ZooKeeper leader has confirmed the session for too long: it may expire on the \
     leader within the safety margin (the server answering this client may be cut off \
     from the leader, or this client's runtime did not run its heartbeat in time)";

/// Sends a `sync` every [`interval`] until the session ends, and declares the session
/// lost when the leader-proven deadline passes. `requested` is when the connect request
/// was sent; `states` tells of reconnections; `seeds` are syncs (send and completion
/// times) completed on the connection `states` watches before the heartbeat started.
pub(crate) async fn run(
    shared: Weak<Shared>,
    t: Duration,
    requested: Instant,
    mut states: zookeeper_client::StateWatcher,
    tick: Option<Duration>,
    seeds: Vec<(Instant, Instant)>,
) {
    let mut lease = LeaderLease::new(t, pair_gap(t, tick), requested);
    for (sent, completed) in seeds {
        lease.confirmed(sent, completed);
    }
    // The deadline every synchronous look at the session compares the clock with, moved
    // only while it has not passed (a reader may already have been told "lost": false).
    let publish = |lease: &LeaderLease| {
        shared.upgrade().is_none_or(|s| {
            s.deadline
                .extend(lease.deadline().into_std(), Instant::now().into_std())
        })
    };
    let every = interval(t);
    // True if the connection's state changed since the last look (a watch coalesces
    // values, but `changed` still fires for a Disconnected -> SyncConnected round).
    let mut moved = move || states.changed().now_or_never().is_some();
    loop {
        let Some(client) = shared
            .upgrade()
            .and_then(|s| (*s.health.borrow() == Health::Live).then(|| s.client.lock().clone()))
            .flatten()
        else {
            return;
        };
        if moved() {
            lease.reconnected();
        }
        let sent = Instant::now();
        let answered = tokio::time::timeout_at(lease.deadline(), client.sync("/")).await;
        let completed = Instant::now();
        drop(client);
        if moved() {
            lease.reconnected();
        } else if let Ok(Ok(())) = answered {
            // A sync answered after the deadline proves nothing any more: once passed,
            // the deadline stays passed (see `SharedDeadline`).
            if completed < lease.deadline() {
                lease.confirmed(sent, completed);
            }
        }
        if !publish(&lease) || Instant::now() >= lease.deadline() {
            if let Some(shared) = shared.upgrade() {
                shared.conclude(Health::Lost(UNCONFIRMED.to_owned()));
            }
            return;
        }
        tokio::time::sleep_until((sent + every).min(lease.deadline())).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(2);

    #[test]
    fn the_margin_is_at_least_a_tenth_and_100_ms() {
        assert_eq!(margin(Duration::from_secs(2)), Duration::from_millis(300));
        assert_eq!(
            margin(Duration::from_millis(400)),
            Duration::from_millis(100)
        );
        for ms in [200u64, 1_000, 4_000, 30_000] {
            let t = Duration::from_millis(ms);
            assert!(margin(t) >= t / 10 && margin(t) >= Duration::from_millis(100));
        }
    }

    #[test]
    fn the_pair_gap_is_two_ticks_at_most_half_a_session() {
        assert_eq!(pair_gap(T, None), T / 2);
        assert_eq!(
            pair_gap(T, Some(Duration::from_millis(200))),
            Duration::from_millis(400)
        );
        assert_eq!(pair_gap(T, Some(Duration::from_secs(2))), T / 2);
        assert_eq!(
            parse_conf("clientPort=2181\ntickTime=200\nmaxClientCnxns=60\n").map(|c| c.tick),
            Some(Duration::from_millis(200))
        );
        assert_eq!(
            parse_conf("conf is not executed because it is not in the whitelist."),
            None
        );
    }

    /// A server that answers `conf` the way ZooKeeper does: the settings, then close.
    fn conf_server() -> String {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr").to_string();
        std::thread::spawn(move || {
            use std::io::{Read, Write};
            for mut conn in listener.incoming().flatten() {
                let mut word = [0u8; 4];
                if conn.read_exact(&mut word).is_ok() && &word == b"conf" {
                    let _ = conn.write_all(b"tickTime=200\nsyncLimit=5\n");
                }
            }
        });
        addr
    }

    /// Servers that are down and drop the SYN, listed first, do not delay the answer of
    /// the live one: asked in turn, the eight below would have taken 4 s.
    #[test]
    fn dead_servers_listed_first_do_not_delay_the_conf_probe() {
        let holes: Vec<_> = (0..8)
            .map(|_| dlock_testkit::BlackHole::new().expect("black hole"))
            .collect();
        let mut hosts: Vec<String> = holes.iter().map(|h| h.addr()).collect();
        hosts.push(conf_server());
        let start = std::time::Instant::now();
        let conf = probe_conf(&hosts, None).expect("the live server's conf");
        assert_eq!(conf.tick, Duration::from_millis(200));
        assert_eq!(conf.follower_detection, Some(Duration::from_secs(1)));
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(
            probe_conf(&hosts[..2], None),
            None,
            "no live server, no conf"
        );
    }

    #[test]
    fn conf_gives_the_follower_detection_time_and_the_rule_checks_it() {
        let conf = parse_conf("tickTime=200\ninitLimit=20\nsyncLimit=10\n").expect("conf");
        assert_eq!(conf.tick, Duration::from_millis(200));
        assert_eq!(conf.follower_detection, Some(Duration::from_secs(2)));
        assert!(!session_outlasts_follower_detection(
            Duration::from_secs(2),
            &conf
        ));
        assert!(!session_outlasts_follower_detection(
            Duration::from_millis(3_999),
            &conf
        ));
        assert!(session_outlasts_follower_detection(
            Duration::from_secs(4),
            &conf
        ));
        let standalone = parse_conf("tickTime=200\n").expect("conf");
        assert!(session_outlasts_follower_detection(
            Duration::from_millis(400),
            &standalone
        ));
    }

    #[test]
    fn a_fresh_lease_trusts_the_connect_request_until_its_margin() {
        let start = Instant::now();
        let lease = LeaderLease::new(T, T / 2, start);
        assert_eq!(lease.deadline(), start + T - margin(T));
    }

    #[test]
    fn only_a_pair_of_syncs_half_a_session_apart_extends_the_lease() {
        let start = Instant::now();
        let mut lease = LeaderLease::new(T, T / 2, start);
        let first = lease.deadline();
        let ms = |n: u64| start + Duration::from_millis(n);
        // Syncs closer together than t/2 prove nothing beyond the first one's send.
        lease.confirmed(ms(100), ms(110));
        lease.confirmed(ms(500), ms(510));
        assert_eq!(lease.deadline(), first);
        // 1,110 ms is 1,000 ms after the 100 ms sync completed: that one is proven touched.
        lease.confirmed(ms(1_110), ms(1_120));
        let proven = ms(100) + T - margin(T);
        assert_eq!(lease.deadline(), proven.max(first));
        // A later pair moves it on; the deadline never moves back.
        lease.confirmed(ms(1_600), ms(1_610));
        assert_eq!(
            lease.deadline(),
            start + Duration::from_millis(500) + T - margin(T)
        );
    }

    #[test]
    fn a_reconnection_forgets_the_syncs_before_it() {
        let start = Instant::now();
        let mut lease = LeaderLease::new(T, T / 2, start);
        let first = lease.deadline();
        let ms = |n: u64| start + Duration::from_millis(n);
        lease.confirmed(ms(100), ms(100));
        lease.reconnected();
        // 1,100 ms would pair with the 100 ms sync, which came before the reconnection.
        lease.confirmed(ms(1_100), ms(1_100));
        assert_eq!(lease.deadline(), first);
        lease.confirmed(ms(2_100), ms(2_100));
        assert_eq!(
            lease.deadline(),
            start + Duration::from_millis(1_100) + T - margin(T)
        );
    }

    #[test]
    fn a_steady_heartbeat_stays_ahead_of_its_deadline() {
        // Syncs every t/16 that each take up to t/16 to answer: the deadline, checked at
        // each send, is always comfortably ahead (never tripped by a healthy session).
        let start = Instant::now();
        let mut lease = LeaderLease::new(T, T / 2, start);
        let mut worst = T;
        for k in 1..200u32 {
            let sent = start + interval(T) * k;
            let answered = sent + interval(T);
            assert!(lease.deadline() > answered, "tripped at sync {k}");
            worst = worst.min(lease.deadline() - answered);
            lease.confirmed(sent, answered);
        }
        // About 0.16 t: the pair gap counted from completions costs one slow answer
        // (t/16 here) of the 0.2 t that counting from send times left.
        assert!(worst >= T * 3 / 20, "headroom fell to {worst:?}");
    }

    /// A sync held up in the network until just before the next one was sent proves
    /// nothing, however far apart the two were sent: the follower may have recorded its
    /// touch only just before forwarding the next one, with no PING in between to report
    /// it to the leader. The gap is counted from the earlier one's completion.
    #[test]
    fn a_pair_counts_from_the_earlier_syncs_completion() {
        let start = Instant::now();
        let mut lease = LeaderLease::new(T, T / 2, start);
        let first = lease.deadline();
        let ms = |n: u64| start + Duration::from_millis(n);
        // Sent at 100 ms, answered only at 1,050 ms; the next sent at 1,150 ms, 1,050 ms
        // after the first was sent (a pair by send times) but 100 ms after it completed.
        lease.confirmed(ms(100), ms(1_050));
        lease.confirmed(ms(1_150), ms(1_160));
        assert_eq!(lease.deadline(), first, "a touch proven by a slow sync");
        // Sent a pair gap after the slow one completed: now it is proven.
        lease.confirmed(ms(2_050), ms(2_060));
        assert_eq!(lease.deadline(), (ms(100) + T - margin(T)).max(first));
    }

    /// A borrowed session (no tick known: a pair gap of t/2) is proven by syncs every
    /// interval for a pair gap before the heartbeat starts; seeded with them, the
    /// heartbeat keeps its deadline ahead. Started from none, it could prove nothing
    /// newer than the first sync before that sync's deadline (0.85 t) passed.
    #[test]
    fn a_heartbeat_seeded_with_the_proof_keeps_a_borrowed_session() {
        let start = Instant::now();
        let rtt = Duration::from_millis(5);
        let gap = pair_gap(T, None);
        let mut proof = vec![(start, start + rtt)];
        while proof[proof.len() - 1].0 < proof[0].1 + gap {
            let sent = proof[proof.len() - 1].0 + interval(T);
            proof.push((sent, sent + rtt));
        }
        let began = proof[proof.len() - 1].1;
        let run = |seeds: &[(Instant, Instant)]| {
            let mut lease = LeaderLease::new(T, gap, start);
            for (s, c) in seeds {
                lease.confirmed(*s, *c);
            }
            for k in 0..100u32 {
                let sent = began + interval(T) * k;
                if lease.deadline() <= sent + rtt {
                    return Some(k);
                }
                lease.confirmed(sent, sent + rtt);
            }
            None
        };
        assert_eq!(run(&proof), None, "the seeded heartbeat lost the session");
        assert!(
            run(&[]).is_some(),
            "unseeded, it keeps the session (the test proves nothing)"
        );
    }
}
