//! The `dlock` command line tool: run a command while holding a distributed lock, and
//! show who holds and waits for a lock.
//!
//! Exit codes (a contract for scripts): the command's own exit code when it ran;
//! 75 timed out; 69 backend unreachable; 64 bad usage, name or URL; 70 lock lost while
//! the command ran (the command got SIGTERM, or the hold could not be confirmed on the
//! server once the command had exited); 126/127 command not executable / not found.

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand};
use dlock::{exit_code, Client, Error, LockGuard, MultiGuard, SessionOptions};

/// Distributed locks from the shell, over ZooKeeper, etcd and Redis.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, about, long_about = None)]
struct Cli {
    /// Backend URL: zk://h:p[,h:p][/chroot], etcd://h:p[,h:p], redis://h:p, redlock://h:p,h:p,h:p
    #[arg(long, global = true, env = "DLOCK_URL")]
    url: Option<String>,

    /// How long a crashed or paused holder keeps the lock (ZooKeeper session timeout, etcd
    /// lease TTL, Redis lease), e.g. 10s. Default: 10s on ZooKeeper, 60s on etcd, 30s on Redis.
    #[arg(long, global = true, value_parser = parse_duration)]
    session_timeout: Option<Duration>,

    /// How long connecting may take before giving up with exit code 69.
    #[arg(long, global = true, value_parser = parse_duration, default_value = "5s")]
    connect_timeout: Duration,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Acquire NAME, run CMD with DLOCK_TOKEN and DLOCK_NAME set, release, exit with CMD's code.
    Exec(ExecArgs),
    /// Acquire every NAME all-or-nothing (in name order), run CMD, release all.
    Multi(MultiArgs),
    /// Show the holders and waiters of NAME in queue order.
    Status(StatusArgs),
    /// Ask the holders of NAME to release it (cooperative, Curator's Revoker): only
    /// holders that took it revocably (`exec --revocable`, Curator's makeRevocable) react.
    Revoke(RevokeArgs),
}

#[derive(Debug, Args)]
struct RevokeArgs {
    /// The lock name.
    name: String,
}

#[derive(Debug, Args)]
struct ExecArgs {
    /// The lock name, e.g. orders/42.
    name: String,
    /// Give up after this long (exit 75), e.g. 500ms, 2s, 1m. Default: wait forever.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Take the read side of a read/write lock.
    #[arg(long, conflicts_with_all = ["write", "permits", "non_reentrant"])]
    read: bool,
    /// Take the write side of a read/write lock.
    #[arg(long, conflicts_with_all = ["permits", "non_reentrant"])]
    write: bool,
    /// Take one permit of a semaphore of N permits.
    #[arg(long, value_name = "N", conflicts_with = "non_reentrant")]
    permits: Option<u32>,
    /// Use the non-reentrant semaphore-mutex recipe.
    #[arg(long)]
    non_reentrant: bool,
    /// Let others ask for the lock (`dlock revoke NAME`, Curator's Revoker): on such a
    /// request the command gets SIGTERM, and dlock exits with its code once it ended.
    #[arg(long, conflicts_with_all = ["read", "write", "permits", "non_reentrant"])]
    revocable: bool,
    /// The command and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    cmd: Vec<String>,
}

#[derive(Debug, Args)]
struct MultiArgs {
    /// The lock names (mutexes).
    #[arg(required = true, num_args = 1..)]
    names: Vec<String>,
    /// Give up after this long (exit 75). Default: wait forever.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// The command and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    cmd: Vec<String>,
}

#[derive(Debug, Args)]
struct StatusArgs {
    /// The lock name.
    name: String,
    /// Print JSON instead of a table.
    #[arg(long)]
    json: bool,
}

fn parse_duration(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 500ms, 2s, 1m: {e}"))
}

const EX_USAGE: u8 = 64;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let _ = e.print();
                return ExitCode::SUCCESS;
            }
            // One line, as scripts expect, not clap's multi-line usage dump.
            let msg = e.to_string();
            let line = msg
                .lines()
                .take_while(|l| !l.starts_with("Usage:"))
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .collect::<Vec<_>>()
                .join(" ");
            eprintln!("dlock: {}", line.trim_start_matches("error: "));
            return ExitCode::from(EX_USAGE);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            // The client crates' own warnings (fred's "command canceled after quit" while
            // the CLI closes its connection) are noise beside dlock's one-line messages;
            // DLOCK_LOG shows them when wanted.
            tracing_subscriber::EnvFilter::try_from_env("DLOCK_LOG")
                .unwrap_or_else(|_| "warn,fred=error".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock: cannot start the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    let code = rt.block_on(run(cli));
    // Do not wait for background tasks (a dropped guard's release has been awaited).
    rt.shutdown_timeout(Duration::from_millis(200));
    ExitCode::from(code)
}

async fn run(cli: Cli) -> u8 {
    match run_inner(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("dlock: {e}");
            u8::try_from(exit_code(&e)).unwrap_or(1)
        }
    }
}

async fn run_inner(cli: Cli) -> Result<u8, Error> {
    let url = cli.url.clone().ok_or_else(|| Error::InvalidUrl {
        url: String::new(),
        reason: "no backend URL: pass --url or set DLOCK_URL".into(),
    })?;
    let mut opts = SessionOptions::default().with_connect_timeout(cli.connect_timeout);
    if let Some(t) = cli.session_timeout {
        opts = opts.with_session_timeout(t);
    }
    // Validate everything we can before any round trip.
    dlock::BackendUrl::parse(&url)?;
    let client = dlock::connect_with(&url, opts).await?;
    let code = match cli.command {
        Command::Exec(a) => exec(&client, a).await,
        Command::Multi(a) => multi(&client, a).await,
        Command::Status(a) => status(&client, a).await,
        Command::Revoke(a) => revoke(&client, a).await,
    };
    let _ = client.close().await;
    code
}

async fn exec(client: &Client, a: ExecArgs) -> Result<u8, Error> {
    let name = client.lock_name(&a.name)?;
    if a.revocable {
        return exec_revocable(client, a, name).await;
    }
    let mut guard: LockGuard = if a.read {
        client.rwlock(name.as_str())?.read(a.timeout).await?
    } else if a.write {
        client.rwlock(name.as_str())?.write(a.timeout).await?
    } else if let Some(n) = a.permits {
        client
            .semaphore(name.as_str(), n)?
            .acquire(a.timeout)
            .await?
    } else if a.non_reentrant {
        client
            .semaphore_mutex(name.as_str())?
            .lock(a.timeout)
            .await?
    } else {
        let m = client.mutex(name.as_str())?;
        match a.timeout {
            Some(t) => m.lock_timeout(t).await?,
            None => m.lock().await?,
        }
    };
    let token = guard.token().to_string();
    let lost = guard.lost();
    let outcome = run_child(
        &a.cmd,
        &[("DLOCK_TOKEN", token), ("DLOCK_NAME", name.to_string())],
        lost,
    )
    .await;
    let verified = confirm(&outcome, guard.verify()).await;
    let released = guard.release().await;
    finish(outcome, verified, released)
}

async fn exec_revocable(client: &Client, a: ExecArgs, name: dlock::LockName) -> Result<u8, Error> {
    let mut guard = client
        .mutex(name.as_str())?
        .lock_revocable(a.timeout)
        .await?;
    let token = guard.token().to_string();
    let lost = guard.lost();
    let revoked = guard.revoke_requested();
    let outcome = run_child_revocable(
        &a.cmd,
        &[("DLOCK_TOKEN", token), ("DLOCK_NAME", name.to_string())],
        lost,
        revoked,
    )
    .await;
    let verified = confirm(&outcome, guard.verify()).await;
    let released = guard.release().await;
    finish(outcome, verified, released)
}

/// [`run_child`], and on a revocation request SIGTERM the command and wait for it: its
/// exit code is dlock's.
async fn run_child_revocable(
    cmd: &[String],
    env: &[(&str, String)],
    lost: impl std::future::Future<Output = Error>,
    revoked: impl std::future::Future<Output = Result<(), Error>>,
) -> Outcome {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let watch = async move {
        match revoked.await {
            Ok(()) => {
                eprintln!("dlock: revocation requested; stopping the command");
                let _ = tx.send(());
            }
            // The lock ended another way (lost, released): the lost signal covers it.
            Err(e) => tracing::debug!(error = %e, "revocation watch ended"),
        }
        std::future::pending::<std::convert::Infallible>().await
    };
    tokio::select! {
        outcome = run_child_with(cmd, env, lost, Some(rx)) => outcome,
        never = watch => match never {},
    }
}

async fn multi(client: &Client, a: MultiArgs) -> Result<u8, Error> {
    let mut m = client.multi();
    for n in &a.names {
        m = m.mutex(n)?;
    }
    let mut guard: MultiGuard<dyn dlock::Backend> = m.acquire(a.timeout).await?;
    let tokens = guard
        .tokens()
        .iter()
        .map(|(n, t)| format!("{n}={t}"))
        .collect::<Vec<_>>()
        .join(",");
    let names = guard
        .tokens()
        .iter()
        .map(|(n, _)| n.to_string())
        .collect::<Vec<_>>()
        .join(",");
    let lost = guard.lost();
    let outcome = run_child(
        &a.cmd,
        &[("DLOCK_TOKEN", tokens), ("DLOCK_NAME", names)],
        lost,
    )
    .await;
    let verified = confirm(&outcome, guard.verify()).await;
    let released = guard.release().await;
    finish(outcome, verified, released)
}

/// How the child ended.
enum Outcome {
    Exited(u8),
    Lost(Error),
    SpawnFailed(u8, String),
}

/// After the command exited on its own, asks the server whether the lock is still held:
/// a loss the client had not noticed yet (a pause past the session, an entry deleted on
/// the server) must still turn into exit code 70, or a script would trust a critical
/// section that may have overlapped another holder's.
async fn confirm(
    outcome: &Outcome,
    verify: impl std::future::Future<Output = Result<(), Error>>,
) -> Result<(), Error> {
    match outcome {
        Outcome::Exited(_) => verify.await,
        Outcome::Lost(_) | Outcome::SpawnFailed(..) => Ok(()),
    }
}

fn finish(
    outcome: Outcome,
    verified: Result<(), Error>,
    released: Result<(), Error>,
) -> Result<u8, Error> {
    match outcome {
        Outcome::Lost(e) => Err(e),

        Outcome::SpawnFailed(code, msg) => {
            eprintln!("dlock: {msg}");
            Ok(code)
        }
        Outcome::Exited(code) => {
            if let Err(e) = verified {
                eprintln!(
                    "dlock: the command exited with {code}, but the lock was not held to the end: {e}"
                );
                return Err(lost_while_running(e));
            }
            if let Err(e) = released {
                // The command ran under the lock; a failed release only delays the next
                // holder until the session ends, so report it but keep the command's code.
                eprintln!("dlock: warning: release failed: {e}");
            }
            Ok(code)
        }
    }
}

/// Exit code 70 for any failed confirmation: a hold the server could not confirm is not
/// one a script may trust.
fn lost_while_running(e: Error) -> Error {
    if e.is_lost() {
        e
    } else {
        Error::LockLost(format!("the hold could not be confirmed: {e}"))
    }
}

async fn run_child(
    cmd: &[String],
    env: &[(&str, String)],
    lost: impl std::future::Future<Output = Error>,
) -> Outcome {
    run_child_with(cmd, env, lost, None).await
}

/// Runs the command until it exits; stops it on `lost`; forwards SIGTERM/SIGINT; and
/// sends it SIGTERM once when `stop` fires (a revocation request).
async fn run_child_with(
    cmd: &[String],
    env: &[(&str, String)],
    lost: impl std::future::Future<Output = Error>,
    stop: Option<tokio::sync::oneshot::Receiver<()>>,
) -> Outcome {
    let Some((prog, args)) = cmd.split_first() else {
        return Outcome::SpawnFailed(EX_USAGE, "no command given".into());
    };
    let mut command = tokio::process::Command::new(prog);
    command.args(args).kill_on_drop(true);
    for (k, v) in env {
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
    let mut sigterm =
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let mut sigint = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt()).ok();
    tokio::pin!(lost);
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
                    forward(&child, libc::SIGTERM);
                }
            }
            status = child.wait() => {
                return Outcome::Exited(match status {
                    Ok(s) => status_code(s),
                    Err(_) => 1,
                });
            }
            e = &mut lost => {
                eprintln!("dlock: {e}; stopping the command");
                terminate(&mut child).await;
                return Outcome::Lost(e);
            }
            _ = recv(&mut sigterm) => forward(&child, libc::SIGTERM),
            _ = recv(&mut sigint) => forward(&child, libc::SIGINT),
        }
    }
}

async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
    match s {
        Some(s) => {
            s.recv().await;
        }
        None => std::future::pending::<()>().await,
    }
}

/// Passes a signal dlock received on to the command, which decides how to end; dlock
/// releases the lock once it has.
fn forward(child: &tokio::process::Child, sig: libc::c_int) {
    if let Some(pid) = child.id() {
        send_signal(pid, sig);
    }
}

/// SIGTERM, then SIGKILL if the command has not ended within 5 s.
async fn terminate(child: &mut tokio::process::Child) {
    forward(child, libc::SIGTERM);
    if tokio::time::timeout(Duration::from_secs(5), child.wait())
        .await
        .is_err()
    {
        let _ = child.kill().await;
    }
}

#[allow(unsafe_code)]
fn send_signal(pid: u32, sig: libc::c_int) {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return;
    };
    // SAFETY: kill(2) takes plain integers and has no memory effects; the pid is our
    // own child's, which we have not reaped yet (so it cannot have been reused).
    unsafe {
        libc::kill(pid, sig);
    }
}

fn status_code(s: std::process::ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    match (s.code(), s.signal()) {
        (Some(c), _) => u8::try_from(c).unwrap_or(1),
        (None, Some(sig)) => u8::try_from(128 + sig).unwrap_or(1),
        (None, None) => 1,
    }
}

async fn revoke(client: &Client, a: RevokeArgs) -> Result<u8, Error> {
    let asked = client.revoke(&a.name).await?;
    if asked == 0 {
        println!("{}: free (nobody to ask)", a.name);
    } else {
        println!("{}: asked {asked} holder(s) to release", a.name);
    }
    Ok(0)
}

async fn status(client: &Client, a: StatusArgs) -> Result<u8, Error> {
    let parts = client.participants(&a.name).await?;
    let now_ms = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0);
    if a.json {
        let rows: Vec<serde_json::Value> = parts
            .iter()
            .map(|p| {
                serde_json::json!({
                    "queue": p.queue,
                    "state": if p.holds { "holder" } else { "waiter" },
                    "kind": p.entry.kind.label(),
                    "entry": p.entry.name,
                    "sequence": p.entry.seq,
                    "token": p.entry.token.map(|t| t.get()),
                    "age_ms": p.entry.created_ms.map(|c| now_ms - c),
                    "owner": String::from_utf8_lossy(&p.entry.data),
                })
            })
            .collect();
        let doc = serde_json::json!({ "name": a.name, "participants": rows });
        println!("{doc}");
    } else if parts.is_empty() {
        println!("{}: free (no holders, no waiters)", a.name);
    } else {
        println!(
            "{:<7} {:<6} {:<5} {:>10} {:>12} {:>9}  owner",
            "state", "queue", "kind", "sequence", "token", "age"
        );
        for p in &parts {
            let age = p
                .entry
                .created_ms
                .map(|c| format!("{:.1}s", (now_ms - c) as f64 / 1000.0))
                .unwrap_or_else(|| "-".into());
            println!(
                "{:<7} {:<6} {:<5} {:>10} {:>12} {:>9}  {}",
                if p.holds { "holder" } else { "waiter" },
                if p.queue.is_empty() { "-" } else { p.queue },
                p.entry.kind.label(),
                p.entry.seq,
                p.entry
                    .token
                    .map(|t| t.to_string())
                    .unwrap_or_else(|| "-".into()),
                age,
                String::from_utf8_lossy(&p.entry.data),
            );
        }
    }
    Ok(0)
}
