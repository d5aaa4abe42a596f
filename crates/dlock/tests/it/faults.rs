//! Faults seen from outside: a paused holder process, etcd's own `etcdctl lock` on the
//! same names, an etcd leader killed under a held lock.
//!
//! The leader-kill test changes the shared cluster that other tests in this binary use at
//! the same time, so it keeps its window short and always restarts the node (also when it
//! fails, through [`Revive`]). The `etcdctl` tests talk to one endpoint only, so they and
//! the leader kill take [`ETCD_FAULTS`] and never overlap.

// The etcd-only tests are not instantiated without the etcd feature.
#![cfg_attr(not(feature = "etcd"), allow(dead_code, unused_imports))]

use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dlock::SessionOptions;
use dlock_testkit::{Backend, State};

use crate::support::{
    client, dlock, dlock_exec_true, eventually, holder_entry, leftovers, tempdir, unique, Kind,
};

pub(crate) const GENEROUS: Duration = Duration::from_secs(60);

/// Held by the tests that kill an etcd member and by those that use one etcd endpoint.
pub(crate) static ETCD_FAULTS: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Sends `sig` (e.g. `STOP`) to every process of the group `pgid`.
pub(crate) fn signal_group(pgid: u32, sig: &str) {
    let st = Command::new("kill")
        .args([&format!("-{sig}"), "--", &format!("-{pgid}")])
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -{sig} -{pgid} failed: {st}");
}

/// Start time (clock ticks since boot) of `pid`, or `None` if no such process runs. Compared
/// with an earlier reading, it tells "the same process" from "a new one that got the PID".
pub(crate) fn start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces and parentheses; fields after the
    // last ')' are plain. Start time is field 22, the 20th after the name.
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // fields[0] is the state (field 3); a zombie has exited already.
    if fields.first() == Some(&"Z") {
        return None;
    }
    fields.get(19)?.parse().ok()
}

/// SIGCONTs the process group it names when dropped: a test that stopped a group never
/// leaves it stopped, whatever fails in between.
struct Cont(u32);

impl Drop for Cont {
    fn drop(&mut self) {
        let _ = Command::new("kill")
            .args(["-CONT", "--", &format!("-{}", self.0)])
            .status();
    }
}

/// Waits (polling, up to `limit`) for `child` to exit and returns its status, or `None`.
pub(crate) async fn wait_exit(
    child: &mut Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => return Some(st),
            Ok(None) => {}
            Err(e) => panic!("waiting for a child: {e}"),
        }
        if tokio::time::Instant::now() >= deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The end of a test where another client took the lock from a holder that lost it: the
/// new holder's hold survived whatever the old one did on waking, it releases, nothing is
/// left of the lock, and the test's client and directory go.
pub(crate) async fn next_holder_undisturbed(
    mut g: dlock::LockGuard,
    c: dlock::Client,
    name: &str,
    dir: &Path,
) {
    assert!(!g.is_lost(), "the next holder's hold must survive");
    g.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, name).await == 0 }).await,
        "entries left under {name}"
    );
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(dir);
}

/// A `sh -c` script for [`spawn_exec`]: the command records its PID in the file `$1`
/// (written beside it and renamed, so a reader never sees half of it), then becomes
/// `sleep` under that same PID.
pub(crate) const RECORD_PID_AND_SLEEP: &str =
    "echo $$ > \"$1.tmp\"; mv \"$1.tmp\" \"$1\"; exec sleep 600";

/// The PID a command recorded in `file`, once it has (see [`RECORD_PID_AND_SLEEP`]).
pub(crate) async fn recorded_pid(file: &Path) -> u32 {
    assert!(
        eventually(GENEROUS, || async { file.exists() }).await,
        "the holder never ran its command"
    );
    std::fs::read_to_string(file)
        .expect("pid file")
        .trim()
        .parse()
        .expect("pid")
}

/// The command a `dlock` process ran, which `dlock` starts as the leader of a process
/// group of its own: killing dlock's group (a crash, as the SIGKILL tests do) leaves it
/// running, so its group is killed when this is dropped, if the process is still the
/// one recorded (same PID, same start time).
pub(crate) struct Orphan {
    pid: u32,
    start: Option<u64>,
}

impl Orphan {
    pub(crate) fn new(pid: u32) -> Self {
        Orphan {
            pid,
            start: start_time(pid),
        }
    }
}

impl Drop for Orphan {
    fn drop(&mut self) {
        if self.start.is_some() && start_time(self.pid) == self.start {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.pid)])
                .status();
        }
    }
}

/// A child this test started as the leader of its own process group; if it still runs
/// when this is dropped (a failed assertion), the whole group is killed, so no command it
/// started (a shell polling for a gate file, `sleep 600`) outlives the test.
pub(crate) struct Reap(pub(crate) Child);

impl Drop for Reap {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.0.id())])
                .status();
            let _ = self.0.wait();
        }
    }
}

/// Starts `dlock <args> -- sh -c <script> sh <script_args>` as the leader of its own
/// process group, its stderr into `errfile`, reaped (with its group) when dropped.
pub(crate) fn spawn_exec(
    args: &[&str],
    script: &str,
    script_args: &[&Path],
    errfile: &Path,
) -> Reap {
    spawn_exec_env(args, &[], script, script_args, errfile)
}

/// [`spawn_exec`] with `env` added to dlock's environment.
pub(crate) fn spawn_exec_env(
    args: &[&str],
    env: &[(&str, &str)],
    script: &str,
    script_args: &[&Path],
    errfile: &Path,
) -> Reap {
    let holder = dlock()
        .envs(env.iter().copied())
        .args(args)
        .args(["--", "sh", "-c", script, "sh"])
        .args(script_args)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(errfile).expect("stderr file"))
        .process_group(0)
        .spawn()
        .expect("spawn holder");
    Reap(holder)
}

/// A `dlock exec` whose process group is SIGSTOPped far past its session timeout loses the
/// lock to another client meanwhile; once continued, its lost signal fires, it SIGTERMs
/// its command and exits 70, and the command is gone.
pub async fn cli_paused_holder_exits_70(_kind: Kind, url: &str) {
    let name = unique("paused");
    let dir = tempdir("paused");
    let pidfile = dir.join("child.pid");
    let errfile = dir.join("dlock.err");
    let session = Duration::from_secs(2);
    // The command records its PID, then becomes `sleep` under that same PID.
    let mut holder = spawn_exec(
        &["--url", url, "--session-timeout", "2s", "exec", &name],
        RECORD_PID_AND_SLEEP,
        &[&pidfile],
        &errfile,
    );
    let pgid = holder.0.id();
    let child_pid = recorded_pid(&pidfile).await;
    let child_start = start_time(child_pid).expect("the command runs");
    // Connected before the pause, so the only slow thing while paused is the lock.
    let c = client(url).await;
    let m = c.mutex(&name).expect("name");
    assert!(
        matches!(m.try_lock().await, Err(dlock::Error::WouldBlock)),
        "the lock must be held by the dlock process before the pause"
    );

    signal_group(pgid, "STOP");
    let paused_at = tokio::time::Instant::now();
    // Whatever happens below, the group must not stay stopped.
    let cont = Cont(pgid);
    let got = m.lock_timeout(GENEROUS).await;
    let g = got.unwrap_or_else(|e| {
        panic!("another client must get the lock of a paused holder after its session: {e}")
    });
    // Keep the holder paused well past its timeout (3x), so its own clock also says so.
    tokio::time::sleep_until(paused_at + 3 * session).await;
    drop(cont);

    let status = wait_exit(&mut holder.0, GENEROUS).await;
    let err = std::fs::read_to_string(&errfile).unwrap_or_default();
    let status =
        status.unwrap_or_else(|| panic!("dlock did not exit after SIGCONT; stderr: {err}"));
    assert_eq!(
        status.code(),
        Some(70),
        "dlock must exit 70 when the lock is lost under its command; stderr: {err}"
    );
    assert!(
        err.contains("stopping the command"),
        "the exit must come from the lost signal: {err}"
    );
    assert!(
        eventually(GENEROUS, || async {
            start_time(child_pid) != Some(child_start)
        })
        .await,
        "the command (pid {child_pid}) outlived the lost lock"
    );
    // The new holder was never disturbed by the old one waking up.
    next_holder_undisturbed(g, c, &name, &dir).await;
}

/// A `dlock exec` that loses its lock stops everything its command started, not only the
/// command: the command runs in a process group of its own, which gets SIGTERM and, after
/// `--kill-after`, SIGKILL. Here the command is a shell whose two background children
/// would outlive it: one that dies on SIGTERM, one that ignores it. Before, dlock
/// signalled only the shell: both children kept running after dlock exited 70.
pub async fn cli_lost_lock_stops_the_whole_process_group(_kind: Kind, url: &str) {
    let name = unique("group");
    let dir = tempdir("group");
    let pids = dir.join("pids");
    let errfile = dir.join("dlock.err");
    let session = Duration::from_secs(2);
    let mut holder = spawn_exec(
        &[
            "--url",
            url,
            "--session-timeout",
            "2s",
            "--kill-after",
            "1s",
            "exec",
            &name,
        ],
        "sleep 600 & a=$!; (trap '' TERM; exec sleep 601) & b=$!; \
         echo \"$a $b\" > \"$1.tmp\"; mv \"$1.tmp\" \"$1\"; wait",
        &[&pids],
        &errfile,
    );
    let dlock_pid = holder.0.id();
    assert!(
        eventually(GENEROUS, || async { pids.exists() }).await,
        "the holder never ran its command"
    );
    let children: Vec<(u32, u64)> = std::fs::read_to_string(&pids)
        .expect("pid file")
        .split_whitespace()
        .map(|p| {
            let pid: u32 = p.parse().expect("pid");
            (pid, start_time(pid).expect("the background child runs"))
        })
        .collect();
    assert_eq!(children.len(), 2);
    // Pause dlock alone (the command and its children go on), far past its session, so
    // that it finds its lock lost when it resumes.
    signal_group(dlock_pid, "STOP");
    let cont = Cont(dlock_pid);
    tokio::time::sleep(3 * session).await;
    drop(cont);
    let status = wait_exit(&mut holder.0, GENEROUS).await;
    let err = std::fs::read_to_string(&errfile).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("dlock did not exit; stderr: {err}"));
    assert_eq!(status.code(), Some(70), "stderr: {err}");
    // Checked as soon as dlock has exited: by then nothing of the group may run. (An
    // orphan may stay a zombie until PID 1 reaps it; a zombie runs nothing.)
    for (pid, start) in &children {
        assert_ne!(
            start_time(*pid),
            Some(*start),
            "process {pid} of the command's group outlived dlock's exit 70"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
    for (pid, _) in children {
        let _ = Command::new("kill")
            .args(["-KILL", &pid.to_string()])
            .status();
    }
}

/// The first endpoint of an `etcd://a,b,c` URL, for `etcdctl`.
pub(crate) fn first_endpoint(url: &str) -> String {
    let hosts = url.strip_prefix("etcd://").expect("an etcd URL");
    hosts.split(',').next().expect("an endpoint").to_owned()
}

/// `etcdctl lock NAME CMD...` on the first endpoint, stdout piped.
fn etcdctl_lock(url: &str, name: &str, cmd: &[&str]) -> Reap {
    let child = Command::new("etcdctl")
        .env("ETCDCTL_API", "3")
        .arg(format!("--endpoints={}", first_endpoint(url)))
        // `--`: etcdctl would read the command's own flags (`sh -c`) as its flags.
        .args(["lock", name, "--"])
        .args(cmd)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .expect("spawn etcdctl (Debian package etcd-client)");
    Reap(child)
}

/// Waits until `path` exists.
async fn wait_file(path: &Path) -> bool {
    eventually(GENEROUS, || async { path.exists() }).await
}

/// Output of a finished child whose stdout and stderr were piped.
fn output_of(child: &mut Reap) -> (String, String) {
    use std::io::Read;
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut s) = child.0.stdout.take() {
        let _ = s.read_to_string(&mut out);
    }
    if let Some(mut s) = child.0.stderr.take() {
        let _ = s.read_to_string(&mut err);
    }
    (out, err)
}

/// etcd's own lock and dlock exclude each other on one name: while `etcdctl lock NAME`
/// runs its command, `dlock exec NAME --timeout 500ms` exits 75; once etcdctl's command
/// ends, dlock gets the lock.
pub async fn etcdctl_lock_blocks_dlock(_kind: Kind, url: &str) {
    let _one = ETCD_FAULTS.lock().await;
    let name = unique("etcdctl-first");
    let dir = tempdir("etcdctl-first");
    let (held, go) = (dir.join("held"), dir.join("go"));
    let script = "touch \"$0\"; while [ ! -e \"$1\" ]; do sleep 0.1; done";
    let mut etcdctl = etcdctl_lock(
        url,
        &name,
        &[
            "sh",
            "-c",
            script,
            held.to_str().expect("utf-8 path"),
            go.to_str().expect("utf-8 path"),
        ],
    );
    assert!(wait_file(&held).await, "etcdctl never got the lock");
    // dlock sees etcd's key as the one holder of the name.
    let c = client(url).await;
    let parts = c.participants(&name).await.expect("participants");
    assert_eq!(parts.len(), 1, "{parts:?}");
    assert!(parts[0].holds, "{parts:?}");

    let out = dlock_exec_true(url, &name, "500ms")
        .output()
        .expect("run dlock");
    assert_eq!(
        out.status.code(),
        Some(75),
        "dlock must time out while etcdctl holds the lock; stderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The timed-out dlock left nothing in etcd's queue.
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 1 }).await,
        "the timed-out dlock left an entry behind"
    );

    std::fs::write(&go, "").expect("open the gate");
    let st = wait_exit(&mut etcdctl.0, GENEROUS).await;
    let (_, err) = output_of(&mut etcdctl);
    assert_eq!(
        st.and_then(|s| s.code()),
        Some(0),
        "etcdctl lock failed: {err}"
    );
    let st = dlock_exec_true(url, &name, "60s")
        .status()
        .expect("run dlock");
    assert_eq!(
        st.code(),
        Some(0),
        "dlock must get the lock etcdctl released"
    );
    assert!(eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await);
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The reverse: while `dlock exec NAME` runs its command, `etcdctl lock NAME` queues behind
/// it and runs its own command only after dlock's has ended. The order is read from one
/// file both commands append to.
pub async fn dlock_blocks_etcdctl_lock(_kind: Kind, url: &str) {
    let _one = ETCD_FAULTS.lock().await;
    let name = unique("dlock-first");
    let dir = tempdir("dlock-first");
    let (log, go) = (dir.join("log"), dir.join("go"));
    let holder = dlock()
        .args(["--url", url, "exec", &name, "--", "sh", "-c"])
        .arg(
            "echo dlock-start >> \"$0\"; while [ ! -e \"$1\" ]; do sleep 0.1; done; \
             echo dlock-end >> \"$0\"",
        )
        .arg(&log)
        .arg(&go)
        .stdout(Stdio::null())
        .process_group(0)
        .spawn()
        .expect("spawn dlock");
    let mut holder = Reap(holder);
    assert!(wait_file(&log).await, "dlock never got the lock");

    let c = client(url).await;
    let log_s = log.to_str().expect("utf-8 path");
    let mut etcdctl = etcdctl_lock(
        url,
        &name,
        &["sh", "-c", "echo got; echo etcdctl >> \"$0\"", log_s],
    );
    // etcdctl's key is queued behind dlock's.
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 2 }).await,
        "etcdctl never queued on {name}"
    );
    let parts = c.participants(&name).await.expect("participants");
    assert!(
        parts[0].holds && !parts[1].holds,
        "dlock holds, etcdctl waits: {parts:?}"
    );
    assert!(
        matches!(etcdctl.0.try_wait(), Ok(None)),
        "etcdctl must wait while dlock holds the lock"
    );
    assert_eq!(
        std::fs::read_to_string(&log).expect("log"),
        "dlock-start\n",
        "etcdctl ran its command while dlock held the lock"
    );

    std::fs::write(&go, "").expect("open the gate");
    let st = wait_exit(&mut holder.0, GENEROUS).await;
    assert_eq!(st.and_then(|s| s.code()), Some(0), "dlock exec failed");
    let st = wait_exit(&mut etcdctl.0, GENEROUS).await;
    let (out, err) = output_of(&mut etcdctl);
    assert_eq!(st.and_then(|s| s.code()), Some(0), "etcdctl failed: {err}");
    assert!(
        out.contains("got"),
        "etcdctl's command did not run: {out:?} {err}"
    );
    assert_eq!(
        std::fs::read_to_string(&log).expect("log"),
        "dlock-start\ndlock-end\netcdctl\n",
        "etcdctl's command must run after dlock's has ended"
    );
    assert!(eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await);
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The cluster state for fault tests, or `None` (loudly; a failure under `CI`).
fn state() -> Option<State> {
    let path = match std::env::var("DLOCK_TEST_STATE") {
        Ok(p) if !p.is_empty() => p,
        _ => {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "DLOCK_TEST_STATE is not set but CI is: run through `cargo xtask integration`"
                );
            }
            skip("DLOCK_TEST_STATE not set (run through `cargo xtask integration`)");
            return None;
        }
    };
    Some(State::load(&path).unwrap_or_else(|e| panic!("loading {path}: {e}")))
}

/// A loud skip line, written past libtest's output capture.
fn skip(why: &str) {
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {why}");
}

/// Restarts a killed node when dropped, so a failing test never leaves the shared cluster
/// one member short.
struct Revive {
    state: Option<State>,
    backend: Backend,
    id: u32,
}

impl Revive {
    fn state(&mut self) -> &mut State {
        self.state.as_mut().expect("state present until revived")
    }

    /// Restarts the node and waits until it answers its readiness probe.
    fn revive(mut self) -> dlock_testkit::Result<()> {
        let mut state = self.state.take().expect("state present until revived");
        state.restart(self.backend, self.id)
    }
}

impl Drop for Revive {
    fn drop(&mut self) {
        if let Some(mut state) = self.state.take() {
            if let Err(e) = state.restart(self.backend, self.id) {
                eprintln!("restarting {} node {} failed: {e}", self.backend, self.id);
            }
        }
    }
}

/// SIGKILL of the etcd leader while a lock is held with a 10 s lease and another client
/// waits: the holder's lost signal does not fire, its release succeeds, the waiter gets
/// the lock with a larger token; then the node is restarted and rejoins.
pub async fn etcd_leader_kill_keeps_the_lock(_kind: Kind, url: &str) {
    let Some(state) = state() else { return };
    if state.servers_of(Backend::Etcd).count() < 3 {
        skip("etcd leader kill needs a 3-member cluster");
        return;
    }
    let _one = ETCD_FAULTS.lock().await;
    let name = unique("leader-kill");
    let opts = || SessionOptions::default().with_session_timeout(Duration::from_secs(10));
    let a = dlock::connect_with(url, opts())
        .await
        .expect("connect holder");
    let b = dlock::connect_with(url, opts())
        .await
        .expect("connect waiter");
    let mut g = a.mutex(&name).expect("name").lock().await.expect("lock");
    let holder_token = g.token();
    let mb = b.mutex(&name).expect("name");
    let waiter = tokio::spawn(async move {
        let r = mb.lock_timeout(GENEROUS).await;
        (r, b)
    });
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 2 }).await,
        "the waiter never queued"
    );

    let leader = tokio::task::block_in_place(|| state.wait_leader(Backend::Etcd, GENEROUS))
        .expect("an etcd leader");
    let mut revive = Revive {
        state: Some(state),
        backend: Backend::Etcd,
        id: leader,
    };
    tokio::task::block_in_place(|| revive.state().kill(Backend::Etcd, leader))
        .expect("kill the etcd leader");
    let new_leader =
        tokio::task::block_in_place(|| revive.state().wait_leader(Backend::Etcd, GENEROUS))
            .expect("the survivors elect a leader");
    assert_ne!(new_leader, leader);
    // The survivors serve this client again.
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 2 }).await,
        "the queue is not readable after the failover"
    );
    assert!(
        !g.is_lost(),
        "the holder's lost signal fired on a leader change"
    );
    assert!(
        !waiter.is_finished(),
        "the waiter must not get the lock while the holder holds it"
    );
    g.release().await.expect("release after the failover");
    let (r, b) = waiter.await.expect("waiter task");
    let mut gb = r.expect("the waiter proceeds after the release");
    assert!(gb.token() > holder_token);
    gb.release().await.expect("waiter release");

    tokio::task::block_in_place(|| revive.revive()).expect("restart the killed member");
    assert!(eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await);
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// A loss the holder has not noticed yet when its command ends still gives exit code 70:
/// here another client deletes the holder's entry on the server while the command runs,
/// and the command exits at once, well before any keep-alive could tell the holder.
/// Without the check at the end, dlock would exit 0 and the script would trust a critical
/// section that another holder may have overlapped.
pub async fn cli_unnoticed_loss_exits_70(_kind: Kind, url: &str) {
    let name = unique("vanish");
    let dir = tempdir("vanish");
    let started = dir.join("started");
    let go = dir.join("go");
    let errfile = dir.join("dlock.err");
    let mut holder = spawn_exec(
        &["--url", url, "exec", &name],
        "touch \"$1\"; while [ ! -e \"$2\" ]; do sleep 0.05; done",
        &[&started, &go],
        &errfile,
    );
    assert!(
        eventually(GENEROUS, || async { started.exists() }).await,
        "the holder never ran its command"
    );
    let c = client(url).await;
    let (q, entry) = holder_entry(&c, &name).await;
    c.backend()
        .remove(&q, &entry)
        .await
        .expect("delete the holder's entry from outside");
    std::fs::write(&go, b"").expect("gate");

    let status = wait_exit(&mut holder.0, GENEROUS).await;
    let err = std::fs::read_to_string(&errfile).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("dlock did not exit; stderr: {err}"));
    assert_eq!(
        status.code(),
        Some(70),
        "a hold that vanished under the command must exit 70; stderr: {err}"
    );
    // Another client gets the lock at once: nothing of the old hold is left.
    let mut g = c
        .mutex(&name)
        .expect("name")
        .lock_timeout(GENEROUS)
        .await
        .expect("lock after the vanished hold");
    g.release().await.expect("release");
    assert_eq!(leftovers(&c, &name).await, 0, "entries left under {name}");
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether `kind` promises that every new leader's term is higher than the last one's
/// (Redlock's tokens are not ordered across masters: docs/fencing.md).
fn terms_ordered(kind: Kind) -> bool {
    kind != Kind::Redlock
}

/// Starts `dlock elect NAME --value VALUE` with a 2 s session, whose command records its
/// PID in `pidfile` and then sleeps; returns it once the command runs, with that PID.
async fn spawn_leader(url: &str, name: &str, value: &str, dir: &Path) -> (Reap, u32) {
    let pidfile = dir.join("child.pid");
    let leader = spawn_exec(
        &[
            "--url",
            url,
            "--session-timeout",
            "2s",
            "elect",
            name,
            "--value",
            value,
        ],
        RECORD_PID_AND_SLEEP,
        &[&pidfile],
        &dir.join("dlock.err"),
    );
    let child_pid = recorded_pid(&pidfile).await;
    (leader, child_pid)
}

/// A `dlock elect` leader whose process group is SIGSTOPped past its session loses the
/// lead to the next candidate (with a higher term where terms are ordered); once
/// continued, its lost signal fires, it SIGTERMs its command and exits 70, the command is
/// gone, and the new leader keeps the lead.
pub async fn cli_paused_leader_exits_70(kind: Kind, url: &str) {
    let name = unique("paused-leader");
    let dir = tempdir("paused-leader");
    let session = Duration::from_secs(2);
    let (mut leader, child_pid) = spawn_leader(url, &name, "paused", &dir).await;
    let child_start = start_time(child_pid).expect("the command runs");
    let pgid = leader.0.id();
    let c = client(url).await;
    let election = c.election(&name).expect("name");
    let first = election
        .leader()
        .await
        .expect("leader")
        .expect("the dlock elect process leads");
    assert_eq!(first.value_str(), Some("paused"));

    signal_group(pgid, "STOP");
    let paused_at = tokio::time::Instant::now();
    let cont = Cont(pgid);
    let next = election
        .campaign_timeout("next", GENEROUS)
        .await
        .unwrap_or_else(|e| {
            panic!("the next candidate must lead once the paused leader's session ends: {e}")
        });
    if terms_ordered(kind) {
        assert!(
            next.term() > first.term,
            "the new term {} must be higher than the paused leader's {}",
            next.term(),
            first.term
        );
    }
    tokio::time::sleep_until(paused_at + 3 * session).await;
    drop(cont);

    let status = wait_exit(&mut leader.0, GENEROUS).await;
    let err = std::fs::read_to_string(dir.join("dlock.err")).unwrap_or_default();
    let status =
        status.unwrap_or_else(|| panic!("dlock elect did not exit after SIGCONT; stderr: {err}"));
    assert_eq!(
        status.code(),
        Some(70),
        "dlock elect must exit 70 when leadership is lost under its command; stderr: {err}"
    );
    assert!(
        err.contains("stopping the command"),
        "the exit must come from the lost signal: {err}"
    );
    assert!(
        eventually(GENEROUS, || async {
            start_time(child_pid) != Some(child_start)
        })
        .await,
        "the command (pid {child_pid}) outlived the lost leadership"
    );
    // The old leader waking up disturbed nobody.
    next.verify().await.expect("the new leader still leads");
    let now = election.leader().await.expect("leader").expect("a leader");
    assert_eq!(now.value_str(), Some("next"));
    next.resign().await.expect("resign");
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "entries left under {name}"
    );
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A `dlock elect` leader SIGKILLed with its command: the next candidate leads once the
/// dead process's session ends (with a higher term where terms are ordered), and nothing
/// of the dead leader is left.
pub async fn cli_killed_leader_is_replaced(kind: Kind, url: &str) {
    let name = unique("killed-leader");
    let dir = tempdir("killed-leader");
    let (mut leader, child_pid) = spawn_leader(url, &name, "killed", &dir).await;
    // dlock's command outlives the SIGKILL of dlock's group below, as after a crash.
    let _command = Orphan::new(child_pid);
    let c = client(url).await;
    let election = c.election(&name).expect("name");
    let first = election
        .leader()
        .await
        .expect("leader")
        .expect("the dlock elect process leads");
    assert_eq!(first.value_str(), Some("killed"));
    signal_group(leader.0.id(), "KILL");
    assert!(
        wait_exit(&mut leader.0, GENEROUS).await.is_some(),
        "the killed leader did not exit"
    );
    let next = election
        .campaign_timeout("next", GENEROUS)
        .await
        .unwrap_or_else(|e| {
            panic!("the next candidate must lead once the dead leader's session ends: {e}")
        });
    if terms_ordered(kind) {
        assert!(
            next.term() > first.term,
            "the new term {} must be higher than the killed leader's {}",
            next.term(),
            first.term
        );
    }
    let now = election.leader().await.expect("leader").expect("a leader");
    assert_eq!(now.value_str(), Some("next"));
    assert_eq!(
        c.participants(&name).await.map(|p| p.len()).ok(),
        Some(1),
        "only the new leader's candidacy is left"
    );
    next.resign().await.expect("resign");
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "entries left under {name}"
    );
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}
