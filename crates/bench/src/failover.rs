//! W6, leader failover: candidate processes campaign in one election; the bench SIGKILLs
//! the leader and times how long until the next candidate announces that it leads.
//!
//! The same driver measures every peer: a candidate is any process that prints a line on
//! stdout the moment it leads and then leads until killed (`dlock-bench --w6-candidate`,
//! `etcdctl elect NAME PROPOSAL`, a Curator `LeaderLatch`). The time runs from just before
//! the SIGKILL to the moment the bench reads the next leader's line, so it includes the
//! server noticing the dead session (its timeout), the handover to the next candidate and
//! that candidate's announcement, and excludes process start-up (candidates queue before
//! the kill; a replacement is started after each kill so two always wait).

use std::collections::HashMap;
use std::io::{BufRead as _, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::time::{Duration, Instant};

/// Candidates in the election at any time: the leader and two waiting.
const CANDIDATES: u32 = 3;

/// What W6 measured for one peer.
#[derive(Debug)]
pub struct Failover {
    /// SIGKILL of the leader to the next leader's announcement, per failover, sorted, ns.
    pub samples_ns: Vec<u64>,
    /// Announcements read while the announced leader was still alive: two candidates
    /// acting as leader at once.
    pub violations: u64,
}

/// The running candidates; dropping this kills every one left.
struct Pool<'a> {
    spawn: &'a dyn Fn(u32) -> Command,
    alive: HashMap<u32, Child>,
    next_id: u32,
    tx: Sender<(u32, Instant)>,
}

impl Pool<'_> {
    /// Starts candidate `next_id`; a thread sends `(id, when)` on its first stdout line
    /// and drains the rest, so a chatty candidate never blocks on a full pipe.
    fn start(&mut self) -> Result<(), String> {
        let id = self.next_id;
        self.next_id += 1;
        let mut child = (self.spawn)(id)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("starting candidate {id}: {e}"))?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| format!("candidate {id}: no stdout"))?;
        let tx = self.tx.clone();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(out).lines();
            if let Some(Ok(_)) = lines.next() {
                let _ = tx.send((id, Instant::now()));
            }
            for _ in lines {}
        });
        self.alive.insert(id, child);
        Ok(())
    }

    fn kill(&mut self, id: u32) -> Result<(), String> {
        let mut child = self
            .alive
            .remove(&id)
            .ok_or_else(|| format!("candidate {id} is not running"))?;
        // std's kill is SIGKILL on Unix: the candidate gets no chance to resign.
        child
            .kill()
            .map_err(|e| format!("SIGKILL to candidate {id}: {e}"))?;
        let _ = child.wait();
        Ok(())
    }
}

impl Drop for Pool<'_> {
    fn drop(&mut self) {
        for (_, mut c) in self.alive.drain() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Waits up to `limit` for the next announcement.
fn next_leader(rx: &Receiver<(u32, Instant)>, limit: Duration) -> Result<(u32, Instant), String> {
    rx.recv_timeout(limit).map_err(|e| match e {
        RecvTimeoutError::Timeout => format!("no candidate led within {limit:?}"),
        RecvTimeoutError::Disconnected => "every candidate is gone".to_owned(),
    })
}

/// Runs `failovers` failovers of candidates made by `spawn(id)`. `settle` is the pause
/// after each new leader before its kill (any announcement in it is a violation); a
/// failover slower than `limit` fails the run.
pub fn measure(
    spawn: &dyn Fn(u32) -> Command,
    failovers: usize,
    settle: Duration,
    limit: Duration,
) -> Result<Failover, String> {
    let (tx, rx) = mpsc::channel();
    let mut pool = Pool {
        spawn,
        alive: HashMap::new(),
        next_id: 0,
        tx,
    };
    for _ in 0..CANDIDATES {
        pool.start()?;
    }
    let mut leader = next_leader(&rx, limit)?.0;
    let mut samples_ns = Vec::with_capacity(failovers);
    let mut violations = 0;
    for _ in 0..failovers {
        let until = Instant::now() + settle;
        loop {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                // Another candidate leads while the leader lives.
                Ok(_) => violations += 1,
                Err(RecvTimeoutError::Timeout) => break,
                Err(RecvTimeoutError::Disconnected) => return Err("every candidate is gone".into()),
            }
        }
        let killed_at = Instant::now();
        pool.kill(leader)?;
        pool.start()?;
        let (next, at) = next_leader(&rx, limit)?;
        samples_ns.push(u64::try_from(at.duration_since(killed_at).as_nanos()).unwrap_or(u64::MAX));
        leader = next;
    }
    samples_ns.sort_unstable();
    Ok(Failover {
        samples_ns,
        violations,
    })
}

/// A peer candidate command: `NAME:SESSION_SECS:COMMAND`, the command run by `sh -c` with
/// `{name}` (the election) and `{id}` (the candidate's number) replaced.
#[derive(Debug, Clone)]
pub struct PeerSpec {
    /// The `peer=` name of its result line.
    pub peer: String,
    /// The session (lease, TTL) its candidates run with, as the peer fixes it.
    pub session: Duration,
    /// The command template.
    pub command: String,
}

impl PeerSpec {
    /// Parses `NAME:SESSION_SECS:COMMAND`.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut parts = s.splitn(3, ':');
        let (Some(peer), Some(secs), Some(command)) = (parts.next(), parts.next(), parts.next())
        else {
            return Err(format!(
                "--w6-peer {s:?}: expected NAME:SESSION_SECS:COMMAND"
            ));
        };
        let secs: f64 = secs
            .parse()
            .map_err(|_| format!("--w6-peer {s:?}: {secs:?} is not a number of seconds"))?;
        if peer.is_empty() || command.trim().is_empty() || !(secs > 0.0 && secs.is_finite()) {
            return Err(format!(
                "--w6-peer {s:?}: expected NAME:SESSION_SECS:COMMAND"
            ));
        }
        Ok(Self {
            peer: peer.to_owned(),
            session: Duration::from_secs_f64(secs),
            command: command.to_owned(),
        })
    }

    /// The command of candidate `id` in election `name`: `exec`ed by the shell, so the
    /// SIGKILL reaches the candidate itself.
    pub fn command(&self, name: &str, id: u32) -> Command {
        let line = self
            .command
            .replace("{name}", name)
            .replace("{id}", &id.to_string());
        let mut c = Command::new("sh");
        c.arg("-c").arg(format!("exec {line}"));
        c
    }
}

/// How many failovers a peer with `session` runs: `asked`, but no more than fit in two
/// minutes of sessions and at least three (`etcdctl elect` has a fixed 60 s lease).
pub fn failovers_for(asked: usize, session: Duration) -> usize {
    let fit = (120.0 / session.as_secs_f64().max(0.001)).floor();
    // `fit` is a small positive whole number of failovers here.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let fit = fit.min(1e6) as usize;
    asked.min(fit.max(3))
}

/// The result line: `peer=P workload=W6 p50_ms p99_ms max_ms n`, then the session the
/// candidates ran with, the median less that session (the time beyond the server's
/// expiry), the violations and what was timed.
pub fn line(peer: &str, f: &Failover, session: Duration) -> String {
    let p50 = crate::harness::pct(&f.samples_ns, 0.50);
    format!(
        "peer={peer} workload=W6 p50_ms={p50:.3} p99_ms={:.3} max_ms={:.3} n={} session_s={:.1} \
         excess_p50_ms={:.3} violations={} note=sigkill_to_next_leader",
        crate::harness::pct(&f.samples_ns, 0.99),
        crate::harness::pct(&f.samples_ns, 1.0),
        f.samples_ns.len(),
        session.as_secs_f64(),
        p50 - session.as_secs_f64() * 1e3,
        f.violations,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peer_specs_parse_and_fill_in() {
        let p = PeerSpec::parse("etcdctl-elect:60:etcdctl --endpoints a:1 elect {name} c{id}")
            .expect("valid");
        assert_eq!(p.peer, "etcdctl-elect");
        assert_eq!(p.session, Duration::from_secs(60));
        let c = p.command("x/w6", 4);
        let args: Vec<_> = c
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(args, ["-c", "exec etcdctl --endpoints a:1 elect x/w6 c4"]);
        assert!(PeerSpec::parse("nope").is_err());
        assert!(PeerSpec::parse("a:x:cmd").is_err());
        assert!(PeerSpec::parse("a:0:cmd").is_err());
    }

    #[test]
    fn long_sessions_run_fewer_failovers() {
        assert_eq!(failovers_for(20, Duration::from_secs(2)), 20);
        assert_eq!(failovers_for(20, Duration::from_secs(60)), 3);
        assert_eq!(failovers_for(2, Duration::from_secs(60)), 2);
    }

    /// The driver against shell candidates that "lead" at once: every one announces while
    /// the first leads, so the settle window sees violations, and failovers are timed.
    #[test]
    fn announcements_during_a_lead_are_violations() {
        let spawn = |_id: u32| {
            let mut c = Command::new("sh");
            c.arg("-c").arg("echo leading; exec sleep 30");
            c
        };
        let f = measure(
            &spawn,
            2,
            Duration::from_millis(300),
            Duration::from_secs(10),
        )
        .expect("shell candidates");
        assert_eq!(f.samples_ns.len(), 2);
        assert!(f.violations >= 2, "two waiting candidates announced: {f:?}");
    }
}
