//! The history every critical section appends to, and the checker that reads it back.
//!
//! Every worker process writes one line per event with `O_APPEND` and a single `write`, so
//! lines from concurrent processes never interleave. Times are microseconds of the
//! machine's real-time clock: all processes run on one machine, so their clocks agree.
//!
//! - `B <worker> <pid> <token> <us> <x|s|p>`: a critical section began, holding the lock
//!   exclusively (`x`), shared (`s`, a read lock) or as one of a semaphore's permits (`p`);
//! - `E <worker> <pid> <token> <us> <ok|stale|err|killed|none>`: it ended, with what the
//!   fenced store said to its write (`none`: a shared section writes nothing);
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
    /// The section did not write: it held the lock shared (a read lock, a permit), and a
    /// store fenced by one highest token cannot judge holders that may overlap.
    None,
}

/// How a section held its lock, which decides who may hold it beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// Alone: a mutex, a write lock, a multi-lock.
    Exclusive,
    /// With other shared holders, never with an exclusive one: a read lock.
    Shared,
    /// One of a semaphore's permits: at most `permits` at once.
    Permit,
}

impl Mode {
    pub(crate) fn label(self) -> &'static str {
        match self {
            Mode::Exclusive => "x",
            Mode::Shared => "s",
            Mode::Permit => "p",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "x" => Some(Mode::Exclusive),
            "s" => Some(Mode::Shared),
            "p" => Some(Mode::Permit),
            _ => None,
        }
    }

    /// Whether holders in these two modes, of two different workers, may not overlap
    /// (permits are counted separately).
    fn conflicts(self, other: Mode) -> bool {
        !matches!(
            (self, other),
            (Mode::Shared, Mode::Shared) | (Mode::Permit, Mode::Permit)
        )
    }
}

impl WriteOutcome {
    pub(crate) fn label(self) -> &'static str {
        match self {
            WriteOutcome::Accepted => "ok",
            WriteOutcome::Rejected => "stale",
            WriteOutcome::Failed => "err",
            WriteOutcome::Killed => "killed",
            WriteOutcome::None => "none",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        match s {
            "ok" => Some(WriteOutcome::Accepted),
            "stale" => Some(WriteOutcome::Rejected),
            "err" => Some(WriteOutcome::Failed),
            "killed" => Some(WriteOutcome::Killed),
            "none" => Some(WriteOutcome::None),
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
        mode: Mode,
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
                mode,
            } => format!("B {worker} {pid} {token} {at_us} {}", mode.label()),
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
                    let mode = Mode::parse(w.next()?)?;
                    Some(Record::Begin {
                        worker,
                        pid,
                        token,
                        at_us,
                        mode,
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
    pub(crate) mode: Mode,
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
                mode,
            } => {
                open.insert((*worker, *pid, *token), out.len());
                out.push(Section {
                    worker: *worker,
                    token: *token,
                    mode: *mode,
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
    /// The victim's process was stopped (SIGSTOP) at `at_us`: see [`Rules::pause_hold_us`].
    pub(crate) paused: bool,
    /// The victim keeps running and must be told by its lost signal before anyone else
    /// is let in: the margin between the two is measured (a cut, a server that forgot).
    pub(crate) measure_margin: bool,
}

/// What a history is checked against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Rules {
    /// A semaphore's permits: more [`Mode::Permit`] holders at once is an overlap.
    pub(crate) permits: u32,
    /// How long a holder stopped inside its section still counts as holding. A stopped
    /// process does nothing, and no lock service can tell it anything; what it does once
    /// resumed is the fenced store's to judge. But until its session can have expired it
    /// is the holder: its last renewal was at most a third of a session before the stop,
    /// so a grant to anyone else within half a session of the stop is an overlap.
    pub(crate) pause_hold_us: u64,
}

/// What the checker found in one history.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Verdict {
    /// Sections begun.
    pub(crate) sections: u64,
    /// Sections that never logged an end (their process was killed).
    pub(crate) unfinished: u64,
    /// Sections that began while a holder of another worker they may not share the lock
    /// with still held it (for permits: while `permits` others held one). A holder holds
    /// from its `B` line until the first of: its `E` line, its lost signal, its process's
    /// end, and for a stopped holder [`Rules::pause_hold_us`] after the stop.
    pub(crate) overlaps: u64,
    /// Exclusive sections whose token is not above the token of an exclusive section
    /// that ended before it began.
    pub(crate) token_violations: u64,
    /// Lost signals the workers saw.
    pub(crate) lost_signals: u64,
    /// Per fault: from its reference point to the victim's first lost signal, in ms.
    pub(crate) lost_latency_ms: Vec<Option<u64>>,
    /// Per fault: from the fault to the first section another worker began, in ms.
    pub(crate) recovery_ms: Vec<Option<u64>>,
    /// Per fault that measures it: from the victim's lost signal to the next section
    /// another worker began, in ms; negative when the other began first.
    pub(crate) lost_margin_ms: Vec<i64>,
}

impl Verdict {
    /// The slowest recovery, or `None` if some fault never recovered or none was injected.
    pub(crate) fn worst_recovery_ms(&self) -> Option<u64> {
        if self.recovery_ms.iter().any(Option::is_none) {
            return None;
        }
        self.recovery_ms.iter().flatten().copied().max()
    }

    /// The smallest lost-signal margin measured, if any fault measured one.
    pub(crate) fn lost_margin_ms_min(&self) -> Option<i64> {
        self.lost_margin_ms.iter().copied().min()
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
    rules: Rules,
) -> Verdict {
    let secs = sections(records);
    let lost: Vec<(u32, u64)> = records
        .iter()
        .filter_map(|r| match r {
            Record::Lost { worker, at_us, .. } => Some((*worker, *at_us)),
            _ => None,
        })
        .collect();
    // The first sign that a section's hold was over, besides its own end line.
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
    let hold_end: Vec<u64> = secs
        .iter()
        .map(|s| {
            let mut end = match (s.end_us, next_sign(s)) {
                (Some(e), Some(n)) => e.min(n),
                (Some(e), None) => e,
                (None, Some(n)) => n,
                (None, None) => run_end_us,
            };
            for f in faults
                .iter()
                .filter(|f| f.paused && f.victim == Some(s.worker))
            {
                if s.start_us <= f.at_us && f.at_us < end {
                    end = end.min(f.at_us + rules.pause_hold_us);
                }
            }
            end
        })
        .collect();
    let mut v = Verdict {
        sections: secs.len() as u64,
        unfinished: secs.iter().filter(|s| s.end_us.is_none()).count() as u64,
        lost_signals: lost.len() as u64,
        ..Verdict::default()
    };
    // Overlaps: `secs` is in start order; each section is checked against the holds
    // begun before it that have not ended when it begins.
    for (j, b) in secs.iter().enumerate() {
        let holding: Vec<&Section> = secs[..j]
            .iter()
            .enumerate()
            .filter(|(i, a)| hold_end[*i] > b.start_us && a.worker != b.worker)
            .map(|(_, a)| a)
            .collect();
        let conflict = holding.iter().any(|a| a.mode.conflicts(b.mode));
        let permits_taken = holding.iter().filter(|a| a.mode == Mode::Permit).count();
        if conflict || (b.mode == Mode::Permit && permits_taken >= rules.permits as usize) {
            v.overlaps += 1;
        }
    }
    // Token order, among exclusive holds: sweep in start order, folding in every one that
    // ended before the current one began.
    let mut by_end: Vec<(u64, u64)> = secs
        .iter()
        .enumerate()
        .filter(|(_, s)| s.mode == Mode::Exclusive)
        .map(|(i, s)| (hold_end[i], s.token))
        .collect();
    by_end.sort_unstable();
    let mut ended = 0;
    let mut max_ended_token: Option<u64> = None;
    for s in secs.iter().filter(|s| s.mode == Mode::Exclusive) {
        while ended < by_end.len() && by_end[ended].0 <= s.start_us {
            max_ended_token = max_ended_token.max(Some(by_end[ended].1));
            ended += 1;
        }
        if max_ended_token.is_some_and(|t| s.token <= t) {
            v.token_violations += 1;
        }
    }
    for f in faults {
        let next_other = secs
            .iter()
            .find(|s| s.start_us > f.at_us && Some(s.worker) != f.victim)
            .map(|s| s.start_us);
        v.recovery_ms
            .push(next_other.map(|at| (at - f.at_us) / 1000));
        let victim_lost = f.victim.and_then(|victim| {
            lost.iter()
                .find(|(w, at)| *w == victim && *at >= f.at_us)
                .map(|(_, at)| *at)
        });
        v.lost_latency_ms
            .push(match (victim_lost, f.signal_from_us) {
                (Some(at), Some(from)) => Some(at.saturating_sub(from) / 1000),
                _ => None,
            });
        // The margin counts only while the victim was still inside a section at the
        // fault: one that ended by itself before anyone else came in had nothing to lose.
        let inside = f.victim.is_some_and(|victim| {
            secs.iter().any(|s| {
                s.worker == victim && s.start_us <= f.at_us && s.end_us.is_none_or(|e| e > f.at_us)
            })
        });
        if f.measure_margin && inside {
            if let (Some(l), Some(g)) = (victim_lost, next_other) {
                let ms = (i64::try_from(g).unwrap_or(i64::MAX)
                    - i64::try_from(l).unwrap_or(i64::MAX))
                    / 1000;
                v.lost_margin_ms.push(ms);
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    const RULES: Rules = Rules {
        permits: 1,
        pause_hold_us: 1_000_000,
    };

    fn bm(worker: u32, token: u64, at_us: u64, mode: Mode) -> Record {
        Record::Begin {
            worker,
            pid: 100 + worker,
            token,
            at_us,
            mode,
        }
    }

    fn b(worker: u32, token: u64, at_us: u64) -> Record {
        bm(worker, token, at_us, Mode::Exclusive)
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

    fn lost(worker: u32, at_us: u64) -> Record {
        Record::Lost {
            worker,
            at_us,
            reason: "lost".into(),
        }
    }

    fn fault(at_us: u64, victim: u32) -> Fault {
        Fault {
            at_us,
            victim: Some(victim),
            signal_from_us: Some(at_us),
            paused: false,
            measure_margin: true,
        }
    }

    #[test]
    fn lines_round_trip_and_garbage_is_dropped() {
        let recs = [
            b(1, 7, 10),
            bm(2, 8, 11, Mode::Shared),
            bm(3, 9, 12, Mode::Permit),
            e(1, 7, 20),
            lost(3, 99),
        ];
        for r in &recs {
            assert_eq!(Record::parse(&r.line()).as_ref(), Some(r));
        }
        for bad in [
            "",
            "B",
            "B 1 2 3",
            "B 1 2 3 4",
            "B 1 2 3 4 q",
            "X 1 2 3 4",
            "E 1 2 3 4 maybe",
            "B x 2 3 4 x",
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
        let v = check(&recs, &[], &HashMap::from([(1, 30)]), 1000, RULES);
        assert_eq!(v.sections, 3);
        assert_eq!(v.unfinished, 1);
        assert_eq!(v.overlaps, 0);
        assert_eq!(v.token_violations, 0);
    }

    #[test]
    fn two_holders_at_once_are_an_overlap_whatever_their_tokens() {
        // Increasing tokens held at once are still two holders.
        let recs = [b(1, 5, 0), b(2, 6, 50), e(2, 6, 60), e(1, 5, 100)];
        let v = check(&recs, &[], &HashMap::new(), 1000, RULES);
        assert_eq!(v.overlaps, 1);
        assert_eq!(v.token_violations, 0);
        // A shared holder beside an exclusive one too; two shared ones are fine.
        let recs = [
            bm(1, 5, 0, Mode::Shared),
            bm(2, 6, 10, Mode::Shared),
            bm(3, 7, 20, Mode::Exclusive),
            e(1, 5, 100),
            e(2, 6, 100),
            e(3, 7, 100),
        ];
        let v = check(&recs, &[], &HashMap::new(), 1000, RULES);
        assert_eq!(v.overlaps, 1, "only the writer beside the readers");
    }

    #[test]
    fn permits_overlap_only_above_the_limit() {
        let p = |w, t, at| bm(w, t, at, Mode::Permit);
        let recs = [
            p(1, 1, 0),
            p(2, 2, 10),
            e(1, 1, 50),
            p(3, 3, 60),
            p(4, 4, 70),
        ];
        let two = Rules {
            permits: 2,
            ..RULES
        };
        let v = check(&recs, &[], &HashMap::new(), 1000, two);
        assert_eq!(v.overlaps, 1, "the fourth came in while 2 and 3 held");
        assert_eq!(v.token_violations, 0, "permits have no token order");
    }

    #[test]
    fn a_lost_signal_ends_the_hold_and_its_margin_is_measured() {
        // Worker 1 is cut off at 1_000; it is told at 2_000_000; 2 comes in 500 ms later.
        let recs = [
            b(1, 5, 0),
            lost(1, 2_000_000),
            b(2, 6, 2_500_000),
            e(2, 6, 2_600_000),
            e(1, 5, 3_000_000),
        ];
        let v = check(
            &recs,
            &[fault(1_000, 1)],
            &HashMap::new(),
            10_000_000,
            RULES,
        );
        assert_eq!(v.overlaps, 0, "the victim's hold ended at its lost signal");
        assert_eq!(v.lost_margin_ms, vec![500]);
        assert_eq!(v.lost_latency_ms, vec![Some(1_999)]);
        // Told too late: a negative margin, and an overlap.
        let recs = [
            b(1, 5, 0),
            b(2, 6, 1_900_000),
            lost(1, 2_000_000),
            e(2, 6, 2_600_000),
        ];
        let v = check(
            &recs,
            &[fault(1_000, 1)],
            &HashMap::new(),
            10_000_000,
            RULES,
        );
        assert_eq!(v.overlaps, 1);
        assert_eq!(v.lost_margin_ms_min(), Some(-100));
    }

    #[test]
    fn a_paused_holder_holds_for_the_pause_hold_then_the_fence_judges_it() {
        let paused = |at_us| Fault {
            at_us,
            victim: Some(1),
            signal_from_us: Some(6_000_000),
            paused: true,
            measure_margin: false,
        };
        // Worker 1 is stopped at 1_000; 2 and 3 come in after the pause hold.
        let recs = [
            b(1, 5, 0),
            b(2, 6, 3_000_000),
            e(2, 6, 3_100_000),
            b(3, 7, 3_200_000),
            e(3, 7, 3_300_000),
            e(1, 5, 6_000_000),
            lost(1, 6_050_000),
        ];
        let v = check(&recs, &[paused(1_000)], &HashMap::new(), 10_000_000, RULES);
        assert_eq!(v.overlaps, 0);
        assert_eq!(v.token_violations, 0);
        assert_eq!(v.lost_signals, 1);
        assert_eq!(v.lost_latency_ms, vec![Some(50)]);
        assert_eq!(v.recovery_ms, vec![Some(2_999)]);
        assert!(v.lost_margin_ms.is_empty(), "a pause measures no margin");
        // Let in 0.5 s after the stop: within the pause hold, an overlap.
        let recs = [
            b(1, 5, 0),
            b(2, 6, 500_000),
            e(2, 6, 600_000),
            e(1, 5, 6_000_000),
        ];
        let v = check(&recs, &[paused(1_000)], &HashMap::new(), 10_000_000, RULES);
        assert_eq!(v.overlaps, 1);
    }

    #[test]
    fn a_killed_holder_ends_at_its_kill_and_a_reset_counter_is_a_violation() {
        let recs = [b(1, 9, 0), b(2, 1, 5_000), e(2, 1, 6_000)];
        let closed = HashMap::from([(1, 4_000)]);
        let v = check(&recs, &[], &closed, 100_000, RULES);
        assert_eq!(v.overlaps, 0, "the killed section ended at the kill");
        assert_eq!(v.token_violations, 1, "token 1 after token 9");
        let v = check(&recs, &[], &HashMap::new(), 100_000, RULES);
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
            paused: false,
            measure_margin: false,
        }];
        let v = check(&recs, &faults, &HashMap::new(), 100, RULES);
        assert_eq!(v.recovery_ms, vec![None]);
        assert_eq!(v.worst_recovery_ms(), None);
        assert!(in_section(&[b(4, 1, 0)], 4));
        assert!(!in_section(&[b(4, 1, 0), e(4, 1, 5)], 4));
    }
}
