//! `dlock exec` and the signals and closed pipes a shell, a terminal or a supervisor
//! hands it: none of them may leave the command running without the lock, an entry in
//! the queue, or a panic in place of an exit code.

use std::process::{Command, Stdio};

use crate::faults::{spawn_exec, start_time, wait_exit, GENEROUS};
use crate::support::{client, dlock, eventually, leftovers, tempdir, unique, Kind};

/// Sends `sig` to one process (not its group).
fn signal_pid(pid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), &pid.to_string()])
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -{sig} {pid} failed: {st}");
}

/// The background child's pid and start time, once the command wrote it to `file`.
async fn background_child(file: &std::path::Path) -> (u32, u64) {
    let pid = crate::faults::recorded_pid(file).await;
    (pid, start_time(pid).expect("the background child runs"))
}

/// Waits for the `dlock exec` `holder` to exit and checks that it exited `code`, that the
/// command's background child (`child`: pid and start time) no longer runs, and that the
/// lock `name` has no entry left: released at once, not when the session ends. Returns
/// dlock's stderr.
async fn exits_leaving_nothing(
    holder: &mut std::process::Child,
    errfile: &std::path::Path,
    url: &str,
    name: &str,
    (pid, start): (u32, u64),
    code: i32,
) -> String {
    let status = wait_exit(holder, GENEROUS).await;
    let err = std::fs::read_to_string(errfile).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("dlock did not exit; stderr: {err}"));
    assert_eq!(
        status.code(),
        Some(code),
        "dlock did not exit with its command's code ({status}); stderr: {err}"
    );
    let outlived = start_time(pid) == Some(start);
    let _ = Command::new("kill")
        .args(["-KILL", &pid.to_string()])
        .status();
    assert!(
        !outlived,
        "the command's background child outlived dlock; stderr: {err}"
    );
    let c = client(url).await;
    assert_eq!(leftovers(&c, name).await, 0, "an entry was left behind");
    c.close().await.expect("close");
    err
}

/// SIGHUP (a closed terminal or ssh session) sent to `dlock` alone reaches the command's
/// process group, and dlock exits only once the group is gone, releasing the lock. Before,
/// SIGHUP killed dlock alone: the command, in a group of its own, ran on without the lock
/// and a second `dlock exec` got the lock once the session ended.
pub async fn cli_hangup_stops_the_command_before_dlock_exits(_kind: Kind, url: &str) {
    let name = unique("hup");
    let dir = tempdir("hup");
    let pid_file = dir.join("pid");
    let errfile = dir.join("dlock.err");
    let mut holder = spawn_exec(
        &["--url", url, "--session-timeout", "2s", "exec", &name],
        "sleep 600 & echo $! > \"$1.tmp\"; mv \"$1.tmp\" \"$1\"; wait",
        &[&pid_file],
        &errfile,
    );
    let (pid, start) = background_child(&pid_file).await;
    signal_pid(holder.0.id(), "HUP");
    // The shell died of the SIGHUP dlock passed on: 128 + 1, as a shell reports it.
    exits_leaving_nothing(&mut holder.0, &errfile, url, &name, (pid, start), 129).await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A command that exits leaving a process running in its group (`sh -c 'job &'`) does not
/// keep that process after the release: dlock stops it (SIGTERM, SIGKILL after
/// `--kill-after`), then releases and exits with the command's code. Before, dlock
/// released at once and the leftover ran on without the lock.
pub async fn cli_leftovers_of_the_command_stop_before_the_release(_kind: Kind, url: &str) {
    let name = unique("leftover");
    let dir = tempdir("leftover");
    let pid_file = dir.join("pid");
    let gate = dir.join("gate");
    let errfile = dir.join("dlock.err");
    // The shell exits (3) once the test has read its child's pid, opening `gate`.
    let mut holder = spawn_exec(
        &["--url", url, "--kill-after", "2s", "exec", &name],
        "sleep 600 & echo $! > \"$1.tmp\"; mv \"$1.tmp\" \"$1\"; \
         while [ ! -e \"$2\" ]; do sleep 0.05; done; exit 3",
        &[&pid_file, &gate],
        &errfile,
    );
    let (pid, start) = background_child(&pid_file).await;
    std::fs::write(&gate, b"").expect("gate");
    let err = exits_leaving_nothing(&mut holder.0, &errfile, url, &name, (pid, start), 3).await;
    assert!(err.contains("left processes running"), "stderr: {err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Ctrl-C (SIGINT) to a `dlock exec` still waiting for the lock ends the wait: its entry
/// leaves the queue at once (not when its session ends, here 30 s), nothing runs, and dlock
/// exits 130 (128 + SIGINT). Before, SIGINT killed dlock and its entry stayed queued,
/// blocking everyone behind it once it reached the head, until the session ended.
pub async fn cli_interrupted_waiter_leaves_the_queue(_kind: Kind, url: &str) {
    let name = unique("intr");
    let dir = tempdir("intr");
    let ran = dir.join("ran");
    let errfile = dir.join("dlock.err");
    let c = client(url).await;
    let mut g = c.mutex(&name).expect("n").lock().await.expect("lock");
    let mut waiter = spawn_exec(
        &["--url", url, "--session-timeout", "30s", "exec", &name],
        "touch \"$1\"",
        &[&ran],
        &errfile,
    );
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 2 }).await,
        "the waiter never queued"
    );
    signal_pid(waiter.0.id(), "INT");
    let status = wait_exit(&mut waiter.0, GENEROUS).await;
    let err = std::fs::read_to_string(&errfile).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("dlock did not exit; stderr: {err}"));
    assert_eq!(status.code(), Some(130), "{status}; stderr: {err}");
    assert!(err.contains("SIGINT while waiting"), "stderr: {err}");
    // Its entry is gone now: the session's 30 s are far away.
    assert_eq!(
        leftovers(&c, &name).await,
        1,
        "the interrupted waiter's entry is still queued"
    );
    g.release().await.expect("release");
    assert!(!ran.exists(), "the command ran");
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A closed stdout or stderr (`dlock status | head -0`, a log reader that died) changes
/// no exit code: before, the first line dlock printed panicked (exit 101), on the way to
/// stopping a command whose lock was lost as anywhere else.
pub async fn cli_closed_output_changes_no_exit_code(_kind: Kind, url: &str) {
    let name = unique("pipe");
    let c = client(url).await;
    let mut g = c.mutex(&name).expect("n").lock().await.expect("lock");
    let closed = || {
        let (reader, writer) = std::io::pipe().expect("pipe");
        drop(reader);
        writer
    };
    // Held by another: 75, its message to a stderr nobody reads.
    let st = dlock()
        .args(["--url", url, "exec", "--try", &name, "--", "true"])
        .stdout(Stdio::null())
        .stderr(closed())
        .status()
        .expect("run dlock");
    assert_eq!(st.code(), Some(75), "exec --try on a held lock: {st}");
    // Held: 0, its table to a stdout nobody reads.
    let st = dlock()
        .args(["--url", url, "status", &name])
        .stdout(closed())
        .stderr(Stdio::null())
        .status()
        .expect("run dlock");
    assert_eq!(st.code(), Some(0), "status of a held lock: {st}");
    g.release().await.expect("release");
    c.close().await.expect("close");
}
