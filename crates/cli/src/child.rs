//! Running the command under the lock: in a process group of its own, so that stopping it
//! stops everything it started.
//!
//! A command is often a shell (`sh -c '...'`) whose children do the work. Signalling only
//! the shell leaves those children running after dlock has exited 70 and the lock has a
//! new holder: exactly the two writers the lock exists to prevent. So the command leads a
//! new process group, every signal goes to the whole group, and on a lost lock dlock sends
//! SIGTERM, waits until every process of the group is gone or the grace period
//! (`--kill-after`) has passed, and then sends SIGKILL to whatever is left. The same
//! holds when the command exits by itself: whatever it left running in its group (`sh -c
//! 'job &'`) is stopped before dlock releases the lock, so no process of the group runs
//! after the release.
//!
//! Two more things follow from the group of its own. A stopped process keeps a signal
//! pending until it is continued, so every signal dlock sends the group is followed by
//! SIGCONT (a command stopped by SIGTTIN would otherwise never see the SIGTERM, and dlock
//! would wait for it forever). And the terminal's job control reaches only dlock's group:
//! on Ctrl-Z dlock stops the command's group before it stops itself, and once continued
//! lets the group go on only if the hold was not lost while dlock was stopped (killed
//! with SIGKILL otherwise, without running again: the next holder may already be in).

use std::time::Duration;

use dlock::Error;

use crate::out::say;
use crate::signals::{self, Signals};

/// How the child ended.
pub(crate) enum Outcome {
    Exited(u8),
    Lost(Error),
    SpawnFailed(u8, String),
}

/// How a command is run: its argv, its extra environment, how long its process group
/// has between SIGTERM and SIGKILL, and how to ask whether the hold is lost right now
/// (the guard's `is_lost`, which also reads the session's deadline: the lost signal of a
/// process that was stopped fires only once the task keeping the session has run).
pub(crate) struct Run<'a> {
    pub(crate) cmd: &'a [String],
    pub(crate) env: &'a [(&'a str, String)],
    pub(crate) kill_after: Duration,
    pub(crate) is_lost: &'a dyn Fn() -> bool,
}

/// Runs the command until it exits, then stops whatever it left running in its group;
/// stops its group on `lost`; passes SIGTERM, SIGINT, SIGHUP and SIGQUIT sent to dlock
/// (`signals`) on to its group; stops its group with dlock on a job-control stop (see the
/// module's docs); and sends its group SIGTERM once when `stop` fires (a revocation
/// request). Returns only when no process of the group runs any more, or SIGKILL was
/// sent to what was left of it.
pub(crate) async fn run(
    run: &Run<'_>,
    lost: impl std::future::Future<Output = Error>,
    stop: Option<tokio::sync::oneshot::Receiver<()>>,
    signals: &mut Signals,
) -> Outcome {
    let Some((prog, args)) = run.cmd.split_first() else {
        return Outcome::SpawnFailed(crate::EX_USAGE, "no command given".into());
    };
    tokio::pin!(lost);
    // A lock lost between its grant and here is not run under: the command would start
    // only to be stopped, after it may already have done something.
    if let Some(e) = known_loss(
        lost.as_mut(),
        run,
        "the session's deadline passed before the command started",
    ) {
        say!("dlock: {e}; the command was not started");
        return Outcome::Lost(e);
    }
    let mut command = tokio::process::Command::new(prog);
    // A group of its own (pgid = its pid), so that signals reach every process it starts.
    command.args(args).kill_on_drop(true).process_group(0);
    // SAFETY: the hook only calls signal(2), which is async-signal-safe, in the child.
    #[allow(unsafe_code)]
    unsafe {
        command.pre_exec(signals::restore_in_child);
    }
    for (k, v) in run.env {
        command.env(k, v);
    }
    let mut child = match command.spawn() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.kind() == std::io::ErrorKind::NotFound {
                127
            } else {
                126
            };
            return Outcome::SpawnFailed(code, format!("cannot run {prog:?}: {e}"));
        }
    };
    let group = child.id();
    let mut stop = stop;
    loop {
        tokio::select! {
            r = async {
                match stop.as_mut() {
                    Some(rx) => rx.await,
                    None => std::future::pending().await,
                }
            }, if stop.is_some() => {
                stop = None;
                if r.is_ok() {
                    signal_group(group, libc::SIGTERM);
                }
            }
            n = signals.recv() => {
                if !signals::is_stop(n) {
                    signal_group(group, n);
                    continue;
                }
                // A SIGCONT already came after this stop: it is cancelled, as the kernel
                // would have cancelled it (see `signals::stop_cancelled`).
                if signals::stop_cancelled() {
                    continue;
                }
                // Ctrl-Z: the group first, so that nothing of it runs while dlock, stopped,
                // renews nothing; then dlock itself, as the shell expects of its job.
                // (In an orphaned process group the kernel discards dlock's stop, and a
                // SIGCONT between these two lines cancels it: either way the group is
                // continued at once below.)
                signal_only(group, libc::SIGSTOP);
                signals::stop_self(n);
                // Continued. The session may have ended meanwhile, and another holder
                // started: then the group must not run again, not even for a SIGTERM grace.
                if let Some(e) =
                    known_loss(lost.as_mut(), run, "the session ended while dlock was stopped")
                {
                    say!("dlock: {e}; killing the stopped command");
                    kill(&mut child, group).await;
                    return Outcome::Lost(e);
                }
                signal_only(group, libc::SIGCONT);
            }
            status = child.wait() => {
                let code = match status {
                    Ok(s) => status_code(s),
                    Err(_) => 1,
                };
                // The leader is reaped: an empty group means nothing it started runs.
                if group_alive(group) {
                    say!("dlock: the command exited but left processes running in its group; stopping them before the release");
                    terminate(&mut child, group, run.kill_after).await;
                }
                return Outcome::Exited(code);
            }
            e = &mut lost => {
                say!("dlock: {e}; stopping the command");
                terminate(&mut child, group, run.kill_after).await;
                return Outcome::Lost(e);
            }
        }
    }
}

/// The loss known right now: the lost signal's error if it has fired, else `why` if the
/// guard's `is_lost` says so (its session deadline passed before the signal fired).
fn known_loss(
    lost: std::pin::Pin<&mut impl std::future::Future<Output = Error>>,
    run: &Run<'_>,
    why: &str,
) -> Option<Error> {
    futures::FutureExt::now_or_never(lost)
        .or_else(|| (run.is_lost)().then(|| Error::LockLost(why.to_owned())))
}

/// How long, after SIGKILL, [`terminate`] waits for the group's processes to be gone: a
/// killed process runs no more of its own code, but is listed as running until the
/// kernel has torn it down. Bounded, since an orphan's zombie waits for its reaper.
const KILL_SETTLE: Duration = Duration::from_secs(1);

/// SIGTERM to the whole group; once the group is empty, or `grace` has passed, SIGKILL
/// to whatever is left of it, and the command reaped (if it was not yet). Returns only
/// when no process of the group runs any more (or, past the grace, once SIGKILL was sent
/// and the group emptied or [`KILL_SETTLE`] passed: a process in uninterruptible sleep
/// dies when it wakes).
async fn terminate(child: &mut tokio::process::Child, group: Option<u32>, grace: Duration) {
    signal_group(group, libc::SIGTERM);
    let deadline = tokio::time::Instant::now() + grace;
    let mut leader_done = false;
    loop {
        if !leader_done {
            leader_done = matches!(child.try_wait(), Ok(Some(_)) | Err(_));
        }
        // The leader is reaped (by try_wait) before the group is probed, so an empty group
        // means every process it started has exited too.
        if leader_done && !group_alive(group) {
            return;
        }
        if tokio::time::Instant::now() >= deadline {
            kill(child, group).await;
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// SIGKILL to the whole group, the command reaped, and a wait of at most [`KILL_SETTLE`]
/// for the rest of the group to be gone.
async fn kill(child: &mut tokio::process::Child, group: Option<u32>) {
    signal_only(group, libc::SIGKILL);
    let _ = child.wait().await;
    let settle = tokio::time::Instant::now() + KILL_SETTLE;
    while group_alive(group) && tokio::time::Instant::now() < settle {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `sig` to every process of the command's group, then SIGCONT: a stopped process
/// (a command that read the terminal and got SIGTTIN, or one stopped from outside) keeps
/// a signal pending until it is continued, and dlock would wait for it without end.
fn signal_group(group: Option<u32>, sig: libc::c_int) {
    signal_only(group, sig);
    if sig != libc::SIGCONT {
        signal_only(group, libc::SIGCONT);
    }
}

/// Sends `sig` alone to every process of the command's group, with no SIGCONT after it
/// (SIGKILL and SIGSTOP need none; SIGCONT is the continuation itself).
fn signal_only(group: Option<u32>, sig: libc::c_int) {
    if let Some(pgid) = group.and_then(|g| libc::pid_t::try_from(g).ok()) {
        kill_group(pgid, sig);
    }
}

/// True if any process of the group still exists (a zombie included: it exited, but its
/// parent has not reaped it yet).
fn group_alive(group: Option<u32>) -> bool {
    match group.and_then(|g| libc::pid_t::try_from(g).ok()) {
        Some(pgid) => kill_group(pgid, 0),
        None => false,
    }
}

/// kill(2) on a process group; true if it reached at least one process.
#[allow(unsafe_code)]
fn kill_group(pgid: libc::pid_t, sig: libc::c_int) -> bool {
    if pgid <= 1 {
        return false;
    }
    // SAFETY: kill(2) takes plain integers and has no memory effects. The group is the one
    // our child leads: its id cannot be reused while any member lives, and signalling an
    // empty group only fails with ESRCH.
    unsafe { libc::kill(-pgid, sig) == 0 }
}

fn status_code(s: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        (None, None) => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_lock_lost_before_the_command_starts_runs_nothing() {
        // A program that does not exist: had dlock tried to start it, the outcome would
        // be a spawn failure (127), whatever the timing.
        let cmd = vec!["/nonexistent/dlock-test-command".to_owned()];
        let r = Run {
            cmd: &cmd,
            env: &[],
            kill_after: Duration::from_secs(1),
            is_lost: &|| false,
        };
        let lost = std::future::ready(Error::LockLost("the session expired".into()));
        match run(&r, lost, None, &mut Signals::install()).await {
            Outcome::Lost(e) => assert!(e.is_lost(), "{e:?}"),
            Outcome::Exited(code) => panic!("the command ran and exited {code}"),
            Outcome::SpawnFailed(code, why) => {
                panic!("the command was started on a lost lock: {code} {why}")
            }
        }
    }

    /// A hold whose session deadline passed while its lost signal has not fired yet (the
    /// task that fires it has not run): the command is not started either.
    #[tokio::test]
    async fn a_hold_past_its_deadline_runs_nothing() {
        let cmd = vec!["/nonexistent/dlock-test-command".to_owned()];
        let r = Run {
            cmd: &cmd,
            env: &[],
            kill_after: Duration::from_secs(1),
            is_lost: &|| true,
        };
        let lost = std::future::pending::<Error>();
        match run(&r, lost, None, &mut Signals::install()).await {
            Outcome::Lost(e) => assert!(e.is_lost(), "{e:?}"),
            Outcome::Exited(code) => panic!("the command ran and exited {code}"),
            Outcome::SpawnFailed(code, why) => {
                panic!("the command was started on a lost lock: {code} {why}")
            }
        }
    }
}
