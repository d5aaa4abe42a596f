//! The history every critical section appends to, and the checker that reads it back.
//!
//! Every worker process writes one line per event with `O_APPEND` and a single `write`, so
//! lines from concurrent processes never interleave. Times are microseconds of the
//! machine's real-time clock: all processes run on one machine, so their clocks agree.
//!
//! - `B <worker> <pid> <token> <us>`: a critical section began (the lock was held);
//! - `E <worker> <pid> <token> <us> <ok|stale|err>`: it ended, with what the fenced store
//!   said to its write;
//! - `L <worker> <us> <reason>`: the worker saw its lock's lost signal.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context as _;

/// Microseconds since the Unix epoch, by the real-time clock every process shares.
pub(crate) fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// Appends one line to the history in a single `write`, so concurrent appends from other
/// processes never tear it.
pub(crate) fn append(path: &Path, line: &str) -> anyhow::Result<()> {
    let mut text = line.trim_end().to_string();
    text.push('\n');
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .with_context(|| format!("opening history {}", path.display()))?;
    f.write_all(text.as_bytes())
        .with_context(|| format!("appending to {}", path.display()))
}

/// What the fenced store answered to a section's write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WriteOutcome {
    /// The store accepted the write.
    Accepted,
    /// The store refused it: its token was older than one it had seen.
    Rejected,
    /// The store could not be reached.
    Failed,
    /// The section was stopped (SIGTERM from `dlock exec` on its lost signal) before it
    /// knew the store's answer.
    Killed,
}

impl WriteOutcome {
    pub(crate) fn label(self) -> &'static str {
        match self {
            WriteOutcome::Accepted => "ok",
            WriteOutcome::Rejected => "stale",
            WriteOutcome::Failed => "err",
            WriteOutcome::Killed => "killed",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "ok" => Some(WriteOutcome::Accepted),
            "stale" => Some(WriteOutcome::Rejected),
            "err" => Some(WriteOutcome::Failed),
            "killed" => Some(WriteOutcome::Killed),
            _ => None,
        }
    }
}

/// One history line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Record {
    Begin {
        worker: u32,
        pid: u32,
        token: u64,
        at_us: u64,
    },
    End {
        worker: u32,
        pid: u32,
        token: u64,
        at_us: u64,
        write: WriteOutcome,
    },
    Lost {
        worker: u32,
        at_us: u64,
        reason: String,
    },
}

impl Record {
    pub(crate) fn line(&self) -> String {
        match self {
            Record::Begin {
                worker,
                pid,
                token,
                at_us,
            } => format!("B {worker} {pid} {token} {at_us}"),
            Record::End {
                worker,
                pid,
                token,
                at_us,
                write,
            } => format!("E {worker} {pid} {token} {at_us} {}", write.label()),
            Record::Lost {
                worker,
                at_us,
                reason,
            } => format!("L {worker} {at_us} {}", reason.replace('\n', " ")),
        }
    }

    /// Parses one line; `None` for anything malformed (a line cut short by a SIGKILL
    /// cannot happen with single writes, but the checker must not trust its input).
    pub(crate) fn parse(line: &str) -> Option<Record> {
        let mut w = line.split_whitespace();
        let tag = w.next()?;
        let worker = w.next()?.parse().ok()?;
        match tag {
            "B" | "E" => {
                let pid = w.next()?.parse().ok()?;
                let token = w.next()?.parse().ok()?;
                let at_us = w.next()?.parse().ok()?;
                if tag == "B" {
                    Some(Record::Begin {
                        worker,
                        pid,
                        token,
                        at_us,
                    })
                } else {
                    let write = WriteOutcome::parse(w.next()?)?;
                    Some(Record::End {
                        worker,
                        pid,
                        token,
                        at_us,
                        write,
                    })
                }
            }
            "L" => {
                let at_us = w.next()?.parse().ok()?;
                Some(Record::Lost {
                    worker,
                    at_us,
                    reason: w.collect::<Vec<_>>().join(" "),
                })
            }
            _ => None,
        }
    }
}

/// Reads every well-formed record of a history file (an absent file is an empty history).
pub(crate) fn read(path: &Path) -> anyhow::Result<Vec<Record>> {
    match std::fs::read_to_string(path) {
        Ok(text) => Ok(text.lines().filter_map(Record::parse).collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(e).with_context(|| format!("reading {}", path.display())),
    }
}

/// One critical section, as reconstructed from its `B` and `E` lines.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Section {
    pub(crate) worker: u32,
    pub(crate) token: u64,
    pub(crate) start_us: u64,
    /// `None` when the section never logged its end (its process was killed).
    pub(crate) end_us: Option<u64>,
}

/// Pairs `B` and `E` lines into sections, in start order.
pub(crate) fn sections(records: &[Record]) -> Vec<Section> {
    let mut open: HashMap<(u32, u32, u64), usize> = HashMap::new();
    let mut out: Vec<Section> = Vec::new();
    for r in records {
        match r {
            Record::Begin {
                worker,
                pid,
                token,
                at_us,
            } => {
                open.insert((*worker, *pid, *token), out.len());
                out.push(Section {
                    worker: *worker,
                    token: *token,
                    start_us: *at_us,
                    end_us: None,
                });
            }
            Record::End {
                worker,
                pid,
                token,
                at_us,
                ..
            } => {
                if let Some(i) = open.remove(&(*worker, *pid, *token)) {
                    out[i].end_us = Some(*at_us);
                }
            }
            Record::Lost { .. } => {}
        }
    }
    out.sort_by_key(|s| s.start_us);
    out
}

/// True while `worker` is inside a section it has not finished.
pub(crate) fn in_section(records: &[Record], worker: u32) -> bool {
    sections(records)
        .iter()
        .any(|s| s.worker == worker && s.end_us.is_none())
}

/// One injected fault, as the orchestrator saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fault {
    /// When the fault began (kill, stop, cut).
    pub(crate) at_us: u64,
    /// The worker it hit, if it hit one; its own sections do not count as recovery.
    pub(crate) victim: Option<u32>,
    /// From when the victim's lost signal is timed: the resume of a paused holder, the
    /// start of a cut. `None` when no lost signal is expected (the holder is dead).
    pub(crate) signal_from_us: Option<u64>,
}

/// What the checker found in one scenario run.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Sections begun.
    pub(crate) sections: u64,
    /// Sections that never logged an end (their process was killed).
    pub(crate) unfinished: u64,
    /// Pairs of sections of different workers whose time intervals intersect.
    pub(crate) overlaps: u64,
    /// Sections whose token is not above the token of a section that ended before it
    /// began.
    pub(crate) token_violations: u64,
    /// Lost signals the workers saw.
    pub(crate) lost_signals: u64,
    /// Per fault: from its reference point to the victim's first lost signal, in ms.
    pub(crate) lost_latency_ms: Vec<Option<u64>>,
    /// Per fault: from the fault to the first section another worker began, in ms.
    pub(crate) recovery_ms: Vec<Option<u64>>,
}

impl Verdict {
    /// The slowest recovery, or `None` if some fault never recovered or none was injected.
    pub(crate) fn worst_recovery_ms(&self) -> Option<u64> {
        if self.recovery_ms.iter().any(Option::is_none) {
            return None;
        }
        self.recovery_ms.iter().flatten().copied().max()
    }
}

/// Checks a history. An unfinished section (its process was killed) ends at the first
/// sign that it was over: the worker's next section or lost signal, or the time in
/// `closed` when the worker's process was known to be gone; failing all, `run_end_us`.
pub(crate) fn check(
    records: &[Record],
    faults: &[Fault],
    closed: &HashMap<u32, u64>,
    run_end_us: u64,
) -> Verdict {
    let secs = sections(records);
    let next_sign = |s: &Section| {
        records
            .iter()
            .filter_map(|r| match r {
                Record::Begin { worker, at_us, .. } | Record::Lost { worker, at_us, .. }
                    if *worker == s.worker && *at_us > s.start_us =>
                {
                    Some(*at_us)
                }
                _ => None,
            })
            .chain(closed.get(&s.worker).copied().filter(|&c| c >= s.start_us))
            .min()
    };
    let ends: Vec<u64> = secs
        .iter()
        .map(|s| s.end_us.or_else(|| next_sign(s)).unwrap_or(run_end_us))
        .collect();
    let end_of = |i: usize| ends[i];
    let mut v = Verdict {
        sections: secs.len() as u64,
        unfinished: secs.iter().filter(|s| s.end_us.is_none()).count() as u64,
        ..Verdict::default()
    };
    // Overlaps: `secs` is in start order, so only later sections that start before this
    // one ends can intersect it.
    for (i, a) in secs.iter().enumerate() {
        let a_end = end_of(i);
        for b in &secs[i + 1..] {
            if b.start_us >= a_end {
                break;
            }
            if b.worker != a.worker {
                v.overlaps += 1;
            }
        }
    }
    // Token order: sweep sections in start order, folding in every section that ended
    // before the current one began.
    let mut by_end: Vec<(u64, u64)> = secs
        .iter()
        .enumerate()
        .map(|(i, s)| (end_of(i), s.token))
        .collect();
    by_end.sort_unstable();
    let mut ended = 0;
    let mut max_ended_token: Option<u64> = None;
    for s in &secs {
        while ended < by_end.len() && by_end[ended].0 <= s.start_us {
            max_ended_token = max_ended_token.max(Some(by_end[ended].1));
            ended += 1;
        }
        if max_ended_token.is_some_and(|t| s.token <= t) {
            v.token_violations += 1;
        }
    }
    let lost: Vec<(u32, u64)> = records
        .iter()
        .filter_map(|r| match r {
            Record::Lost { worker, at_us, .. } => Some((*worker, *at_us)),
            _ => None,
        })
        .collect();
    v.lost_signals = lost.len() as u64;
    for f in faults {
        let recovered = secs
            .iter()
            .find(|s| s.start_us > f.at_us && Some(s.worker) != f.victim)
            .map(|s| (s.start_us - f.at_us) / 1000);
        v.recovery_ms.push(recovered);
        let latency = match (f.victim, f.signal_from_us) {
            (Some(victim), Some(from)) => lost
                .iter()
                .find(|(w, at)| *w == victim && *at >= f.at_us)
                .map(|(_, at)| at.saturating_sub(from) / 1000),
            _ => None,
        };
        v.lost_latency_ms.push(latency);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(worker: u32, token: u64, at_us: u64) -> Record {
        Record::Begin {
            worker,
            pid: 100 + worker,
            token,
            at_us,
        }
    }

    fn e(worker: u32, token: u64, at_us: u64) -> Record {
        Record::End {
            worker,
            pid: 100 + worker,
            token,
            at_us,
            write: WriteOutcome::Accepted,
        }
    }

    #[test]
    fn lines_round_trip_and_garbage_is_dropped() {
        let recs = [
            b(1, 7, 10),
            e(1, 7, 20),
            Record::Lost {
                worker: 3,
                at_us: 99,
                reason: "session expired".into(),
            },
        ];
        for r in &recs {
            assert_eq!(Record::parse(&r.line()).as_ref(), Some(r));
        }
        for bad in [
            "",
            "B",
            "B 1 2 3",
            "X 1 2 3 4",
            "E 1 2 3 4 maybe",
            "B x 2 3 4",
        ] {
            assert_eq!(Record::parse(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn a_clean_history_has_no_findings() {
        let recs = [
            b(1, 1, 0),
            e(1, 1, 10),
            b(2, 2, 10),
            e(2, 2, 20),
            b(1, 3, 25),
        ];
        let v = check(&recs, &[], &HashMap::from([(1, 30)]), 1000);
        assert_eq!(v.sections, 3);
        assert_eq!(v.unfinished, 1);
        assert_eq!(v.overlaps, 0);
        assert_eq!(v.token_violations, 0);
    }

    #[test]
    fn a_paused_holder_overlaps_the_next_one() {
        // Worker 1 pauses inside its section; 2 and 3 take the lock meanwhile.
        let recs = [
            b(1, 5, 0),
            b(2, 6, 3_000_000),
            e(2, 6, 3_100_000),
            b(3, 7, 3_200_000),
            e(3, 7, 3_300_000),
            e(1, 5, 6_000_000),
            Record::Lost {
                worker: 1,
                at_us: 6_050_000,
                reason: "lost".into(),
            },
        ];
        let faults = [Fault {
            at_us: 1_000,
            victim: Some(1),
            signal_from_us: Some(6_000_000),
        }];
        let v = check(&recs, &faults, &HashMap::new(), 10_000_000);
        assert_eq!(v.overlaps, 2);
        assert_eq!(v.token_violations, 0, "tokens still grow in start order");
        assert_eq!(v.lost_signals, 1);
        assert_eq!(v.lost_latency_ms, vec![Some(50)]);
        assert_eq!(v.recovery_ms, vec![Some(2_999)]);
        assert_eq!(v.worst_recovery_ms(), Some(2_999));
    }

    #[test]
    fn a_killed_holder_ends_at_its_kill_and_a_reset_counter_is_a_violation() {
        let recs = [b(1, 9, 0), b(2, 1, 5_000), e(2, 1, 6_000)];
        let closed = HashMap::from([(1, 4_000)]);
        let v = check(&recs, &[], &closed, 100_000);
        assert_eq!(v.overlaps, 0, "the killed section ended at the kill");
        assert_eq!(v.token_violations, 1, "token 1 after token 9");
        let v = check(&recs, &[], &HashMap::new(), 100_000);
        assert_eq!(
            v.overlaps, 1,
            "without a known end it lasts to the run's end"
        );
    }

    #[test]
    fn an_unrecovered_fault_has_no_worst_recovery() {
        let recs = [b(1, 1, 0), e(1, 1, 10)];
        let faults = [Fault {
            at_us: 50,
            victim: None,
            signal_from_us: None,
        }];
        let v = check(&recs, &faults, &HashMap::new(), 100);
        assert_eq!(v.recovery_ms, vec![None]);
        assert_eq!(v.worst_recovery_ms(), None);
        assert!(in_section(&[b(4, 1, 0)], 4));
        assert!(!in_section(&[b(4, 1, 0), e(4, 1, 5)], 4));
    }
}
