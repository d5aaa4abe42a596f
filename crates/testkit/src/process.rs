//! Signals and liveness by PID, with the start time as a guard against PID reuse.

use std::time::{Duration, Instant};

use nix::errno::Errno;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::{Error, Result};

/// What `/proc/PID/stat` says about a process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcStat {
    /// Field 3: R, S, D, T (stopped), t, Z (zombie), X (dead), ...
    pub(crate) state: char,
    /// Field 22: start time in clock ticks since boot; unique per process lifetime.
    pub(crate) start_time: u64,
}

/// Parses the text of `/proc/PID/stat`.
pub(crate) fn parse_stat(text: &str) -> Option<ProcStat> {
    // The command name (field 2) is in parentheses and may itself contain spaces and
    // parentheses, so split after the last ')'.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let state = fields.first()?.chars().next()?;
    // After ')' the fields start at field 3, so field 22 is index 19.
    let start_time = fields.get(19)?.parse().ok()?;
    Some(ProcStat { state, start_time })
}

/// The stat of `pid`, or `None` when there is no such process.
pub(crate) fn proc_stat(pid: u32) -> Option<ProcStat> {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|t| parse_stat(&t))
}

/// True when `pid` is the process started at `start_time` and has not exited.
///
/// A zombie counts as dead: PID 1 on this kind of machine reaps orphans a second or two
/// late, and `kill -0` succeeds on a zombie.
pub(crate) fn is_alive(pid: u32, start_time: u64) -> bool {
    matches!(proc_stat(pid), Some(s) if s.start_time == start_time && !matches!(s.state, 'Z' | 'X'))
}

/// True when the process is alive and stopped by a signal (SIGSTOP).
pub(crate) fn is_stopped(pid: u32, start_time: u64) -> bool {
    matches!(proc_stat(pid), Some(s) if s.start_time == start_time && matches!(s.state, 'T' | 't'))
}

/// Sends `signal` to `pid` if it still is the process started at `start_time`.
///
/// Returns `Ok(false)` when the process is already gone (nothing to do).
pub(crate) fn signal(pid: u32, start_time: u64, signal: Signal) -> Result<bool> {
    if !is_alive(pid, start_time) {
        return Ok(false);
    }
    let raw = i32::try_from(pid).map_err(|_| Error::Signal {
        signal: signal.as_str(),
        pid,
        source: Errno::EINVAL,
    })?;
    match kill(Pid::from_raw(raw), signal) {
        Ok(()) => Ok(true),
        Err(Errno::ESRCH) => Ok(false),
        Err(source) => Err(Error::Signal {
            signal: signal.as_str(),
            pid,
            source,
        }),
    }
}

/// Polls until the process is gone or a zombie, or `limit` passes.
pub(crate) fn wait_dead(pid: u32, start_time: u64, limit: Duration) -> Result<()> {
    let started = Instant::now();
    while is_alive(pid, start_time) {
        if started.elapsed() > limit {
            return Err(Error::Unkillable {
                pid,
                waited_secs: limit.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    Ok(())
}

/// Polls until the process shows as stopped (state T), or `limit` passes.
pub(crate) fn wait_stopped(pid: u32, start_time: u64, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() <= limit {
        if is_stopped(pid, start_time) {
            return true;
        }
        if !is_alive(pid, start_time) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_stat_with_parentheses_and_spaces_in_the_name() {
        let text = "1234 (my (weird) name) S 1 1234 1234 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 3 0 98765 1000 10";
        let stat = parse_stat(text).expect("parses");
        assert_eq!(stat.state, 'S');
        assert_eq!(stat.start_time, 98765);
    }

    #[test]
    fn rejects_truncated_stat() {
        assert_eq!(parse_stat("1 (x) S 1 2 3"), None);
        assert_eq!(parse_stat("garbage"), None);
    }

    #[test]
    fn this_process_is_alive_and_a_wrong_start_time_is_not() {
        let me = std::process::id();
        let stat = proc_stat(me).expect("own stat");
        assert!(is_alive(me, stat.start_time));
        assert!(!is_alive(me, stat.start_time + 1));
        // A mismatched start time must never be signalled.
        assert!(!signal(me, stat.start_time + 1, Signal::SIGKILL).expect("no error"));
    }
}
