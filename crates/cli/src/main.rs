//! The `dlock` command line tool: run a command while holding a distributed lock, and
//! show who holds and waits for a lock.
//!
//! Exit codes (a contract for scripts): the command's own exit code when it ran
//! (`exec`, `multi`, `elect`); `status` and `leader` 0 when held / led, 3 when not;
//! 75 timed out; 69 backend unreachable; 64 bad usage, name or URL; 70 lock lost while
//! the command ran (the command's process group got SIGTERM, then SIGKILL after
//! `--kill-after`, or the hold could not be confirmed on the server once the command had
//! exited); 126/127 command not executable / not found; 128 + N when signal N (SIGHUP,
//! SIGINT, SIGQUIT, SIGTERM) ended the wait for the lock (nothing ran, the entry is
//! removed).

use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::{Args, Parser, Subcommand};
use dlock::{exit_code, Client, Error, LockGuard, MultiGuard, SessionOptions};

use crate::child::{Outcome, Run};
use crate::out::{say, show};
use crate::signals::Signals;

mod child;
mod out;
mod signals;

/// Distributed locks from the shell, over ZooKeeper, etcd and Redis.
#[derive(Debug, Parser)]
#[command(name = "dlock", version, about, long_about = None)]
struct Cli {
    /// Backend URL: zk://h:p[,h:p][/chroot], etcd://h:p[,h:p], redis://h:p[/db], redlock://h:p,h:p,h:p,
    /// redis+sentinel://h:p[,h:p]/service, redis+cluster://h:p[,h:p]; TLS with zks://, etcds://,
    /// rediss://, redlocks://, rediss+sentinel://, rediss+cluster:// and
    /// ?ca=PATH&cert=PATH&key=PATH&server_name=NAME; credentials as
    /// USER:PASSWORD@ or USER@ with the password in DLOCK_PASSWORD
    #[arg(long, global = true, env = "DLOCK_URL", hide_env_values = true)]
    url: Option<String>,

    /// How long a crashed or paused holder keeps the lock (ZooKeeper session timeout, etcd
    /// lease TTL, Redis lease), e.g. 10s. Default: 10s on ZooKeeper, 60s on etcd, 30s on Redis.
    #[arg(long, global = true, value_parser = parse_duration)]
    session_timeout: Option<Duration>,

    /// How long connecting may take before giving up with exit code 69.
    #[arg(long, global = true, value_parser = parse_duration, default_value = "5s")]
    connect_timeout: Duration,

    /// When the lock is lost under the command: how long its process group (the command
    /// and everything it started) has between SIGTERM and SIGKILL. Default: half the lost
    /// signal's lead on the next holder (max(10% of the session timeout, 100ms) / 2), at
    /// most 5s; a longer one can let a command that outlives SIGTERM overlap the next
    /// holder (warned of).
    #[arg(long, global = true, value_parser = parse_duration)]
    kill_after: Option<Duration>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Acquire NAME, run CMD with DLOCK_TOKEN and DLOCK_NAME set, release, exit with CMD's code.
    Exec(ExecArgs),
    /// Acquire every NAME all-or-nothing (in name order), run CMD, release all.
    Multi(MultiArgs),
    /// Show the holders and waiters of NAME in queue order; exit 0 if it is held, 3 if
    /// not.
    Status(StatusArgs),
    /// List the locks that have holders or waiters, sorted by name: every lock, or those
    /// whose name starts with PREFIX. Exit 0, also when there are none.
    List(ListArgs),
    /// Ask the holders of NAME to release it (cooperative, Curator's Revoker): only
    /// holders that took it revocably (`exec --revocable`, Curator's makeRevocable) react.
    Revoke(RevokeArgs),
    /// Campaign in election NAME with VALUE, then run CMD while leading, with DLOCK_NAME,
    /// DLOCK_TERM and DLOCK_VALUE set; resign and exit with CMD's code. On loss of the
    /// leadership CMD's process group gets SIGTERM and dlock exits 70; not elected within
    /// --timeout: 75.
    Elect(ElectArgs),
    /// Print the leader of election NAME (value and term); exit 0 when there is one, 3
    /// when there is none. With --watch, one line per change until interrupted.
    Leader(LeaderArgs),
}

/// How long a command waits for what it takes (a lock, every lock, the leadership):
/// `--timeout` and `--try`, parsed the same on `exec`, `multi` and `elect`. The help below
/// is `exec`'s; `multi` and `elect` reword it for what they take (`mut_arg`), so each
/// command's help says what `0` and `--try` mean there.
#[derive(Debug, Args)]
struct Wait {
    /// Give up after this long (exit 75), e.g. 500ms, 2s, 1m. Default: wait forever.
    /// `0` asks once: a free lock is taken, a held one exits 75 at once.
    #[arg(long, value_parser = parse_duration)]
    timeout: Option<Duration>,
    /// Take the lock only if it is free now, else exit 75 at once (`--timeout 0`).
    #[arg(long = "try", conflicts_with = "timeout")]
    try_only: bool,
}

impl Wait {
    /// How long to wait: `None` forever; `--try` is a zero timeout, which asks once.
    fn limit(&self) -> Option<Duration> {
        if self.try_only {
            Some(Duration::ZERO)
        } else {
            self.timeout
        }
    }
}

#[derive(Debug, Args)]
#[command(
    mut_arg("timeout", |a| a.help(
        "Give up after this long (exit 75), e.g. 500ms, 2s, 1m. Default: wait forever. \
         `0` asks once: lead now if nobody else does, else exit 75 at once"
    )),
    mut_arg("try_only", |a| a.help(
        "Lead only if nobody leads now, else exit 75 at once (`--timeout 0`)"
    )),
)]
struct ElectArgs {
    /// The election name, e.g. jobs/scheduler.
    name: String,
    /// What this candidate stands with: others see it as the leader's value
    /// (`dlock leader NAME`).
    #[arg(long)]
    value: String,
    #[command(flatten)]
    wait: Wait,
    /// The command and its arguments.
    #[arg(last = true, required = true, num_args = 1..)]
    cmd: Vec<String>,
}

#[derive(Debug, Args)]
struct LeaderArgs {
    /// The election name.
    name: String,
    /// Print one JSON object (`{"name":..,"value":..,"term":..}`; value and term are
    /// null when nobody leads) instead of a line.
    #[arg(long)]
    json: bool,
    /// Keep printing: the leader now, then one line (or object) per change, until
    /// interrupted.
    #[arg(long)]
    watch: bool,
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
    #[command(flatten)]
    wait: Wait,
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
#[command(
    mut_arg("timeout", |a| a.help(
        "Give up after this long (exit 75). Default: wait forever. `0` asks once"
    )),
    mut_arg("try_only", |a| a.help(
        "Take the locks only if each is free now, else exit 75 at once (`--timeout 0`)"
    )),
)]
struct MultiArgs {
    /// The lock names (mutexes).
    #[arg(required = true, num_args = 1..)]
    names: Vec<String>,
    #[command(flatten)]
    wait: Wait,
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

#[derive(Debug, Args)]
struct ListArgs {
    /// A plain string prefix of lock names: `orders/` lists the locks below `orders`,
    /// `orders/4` also `orders/42`. Default: every lock.
    prefix: Option<String>,
    /// Print a JSON array instead of a table.
    #[arg(long)]
    json: bool,
}

/// The longest duration a flag takes: a year, as `SessionOptions` takes. Longer ones
/// (humantime reads up to `u64::MAX` seconds) would overflow the clock arithmetic of
/// deadlines and retries.
const MAX_DURATION: Duration = dlock::SessionOptions::MAX_TIMEOUT;

fn parse_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s)
        .map_err(|e| format!("{s:?} is not a duration like 500ms, 2s, 1m: {e}"))?;
    if d > MAX_DURATION {
        return Err(format!(
            "{s:?} is longer than a year, the longest duration taken"
        ));
    }
    Ok(d)
}

const EX_USAGE: u8 = 64;
/// `dlock status` on a lock nobody holds (`systemctl is-active`'s "inactive").
const STATUS_FREE: u8 = 3;

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
            // Clap quotes the offending argument: a URL given where a command was
            // expected (`--url` forgotten) must not print its password.
            let line = dlock::BackendUrl::redact_in(line.trim_start_matches("error: "));
            say!("dlock: {line}");
            return ExitCode::from(EX_USAGE);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            // The client crates' own warnings (fred's "command canceled after quit" while
            // the CLI closes its connection) are noise beside dlock's one-line messages;
            // so is dlock-etcd's connect-time warning about an etcd with etcd#15247, which
            // a one-shot process would repeat on every run (docs/cli.md names it).
            // DLOCK_LOG shows them when wanted.
            tracing_subscriber::EnvFilter::try_from_env("DLOCK_LOG")
                .unwrap_or_else(|_| "warn,fred=error,dlock_etcd::server_version=error".into()),
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
            say!("dlock: cannot start the runtime: {e}");
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
            say!("dlock: {e}");
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
    let kill_after = kill_after(cli.kill_after, client.session_timeout(), &cli.command);
    let code = match cli.command {
        Command::Exec(a) => exec(&client, a, kill_after).await,
        Command::Multi(a) => multi(&client, a, kill_after).await,
        Command::Status(a) => status(&client, a).await,
        Command::List(a) => list(&client, a).await,
        Command::Revoke(a) => revoke(&client, a).await,
        Command::Elect(a) => elect(&client, a, kill_after).await,
        Command::Leader(a) => leader(&client, a).await,
    };
    let _ = client.close().await;
    code
}

/// The longest default grace between SIGTERM and SIGKILL.
const MAX_DEFAULT_KILL_AFTER: Duration = Duration::from_secs(5);

/// The grace between SIGTERM and SIGKILL: `--kill-after`, or half the lead the lost signal
/// has on the next holder ([`dlock::lost_margin`] of the session: no backend fires it
/// later), at most [`MAX_DEFAULT_KILL_AFTER`]. The other half is for dlock to notice and
/// for the kernel to tear the group down. A longer `--kill-after` is the user's to set,
/// with a warning for the commands that run one: the group can then run beside the
/// next holder.
fn kill_after(given: Option<Duration>, session: Duration, command: &Command) -> Duration {
    let lead = dlock::lost_margin(session);
    let Some(given) = given else {
        return (lead / 2).min(MAX_DEFAULT_KILL_AFTER);
    };
    if given > lead / 2
        && matches!(
            command,
            Command::Exec(_) | Command::Multi(_) | Command::Elect(_)
        )
    {
        say!(
            "dlock: warning: --kill-after {} is more than half the lost signal's lead on the next holder ({}): a command that outlives SIGTERM can run beside the next holder",
            humantime::format_duration(given),
            humantime::format_duration(lead)
        );
    }
    given
}

async fn exec(client: &Client, a: ExecArgs, kill_after: Duration) -> Result<u8, Error> {
    let name = client.lock_name(&a.name)?;
    // From here on a signal ends the wait cleanly or reaches the command's group; it no
    // longer kills dlock alone (crate::signals).
    let mut signals = Signals::install();
    if a.revocable {
        return exec_revocable(client, a, name, kill_after, signals).await;
    }
    let mut guard = match signals.or_signal(take(client, &a, &name)).await {
        Ok(taken) => taken?,
        Err(n) => return Ok(interrupted(n)),
    };
    let token = guard.token().to_string();
    let lost = guard.lost();
    let env = [("DLOCK_TOKEN", token), ("DLOCK_NAME", name.to_string())];
    let is_lost = || guard.is_lost();
    let run = Run {
        cmd: &a.cmd,
        env: &env,
        kill_after,
        is_lost: &is_lost,
    };
    let outcome = child::run(&run, lost, None, &mut signals).await;
    let verified = confirm(&outcome, guard.verify()).await;
    let released = guard.release().await;
    finish(outcome, verified, released)
}

/// Takes what `exec`'s flags name: the read or write side, a permit, the semaphore-mutex
/// or the reentrant mutex, within `--timeout` if given.
async fn take(client: &Client, a: &ExecArgs, name: &dlock::LockName) -> Result<LockGuard, Error> {
    let timeout = a.wait.limit();
    if a.read {
        let rw = client.rwlock(name.as_str())?;
        match timeout {
            Some(t) => rw.read_timeout(t).await,
            None => rw.read().await,
        }
    } else if a.write {
        let rw = client.rwlock(name.as_str())?;
        match timeout {
            Some(t) => rw.write_timeout(t).await,
            None => rw.write().await,
        }
    } else if let Some(n) = a.permits {
        let s = client.semaphore(name.as_str(), n)?;
        match timeout {
            Some(t) => s.acquire_timeout(t).await,
            None => s.acquire().await,
        }
    } else if a.non_reentrant {
        let m = client.semaphore_mutex(name.as_str())?;
        match timeout {
            Some(t) => m.lock_timeout(t).await,
            None => m.lock().await,
        }
    } else {
        let m = client.mutex(name.as_str())?;
        match timeout {
            Some(t) => m.lock_timeout(t).await,
            None => m.lock().await,
        }
    }
}

/// A wait for the lock that signal `n` ended: the acquire was dropped (its entry is
/// removed, at the latest when `run_inner` closes the client) and nothing ran.
fn interrupted(n: libc::c_int) -> u8 {
    say!(
        "dlock: {} while waiting for the lock; nothing was run",
        signals::name(n)
    );
    signals::interrupted_code(n)
}

async fn exec_revocable(
    client: &Client,
    a: ExecArgs,
    name: dlock::LockName,
    kill_after: Duration,
    mut signals: Signals,
) -> Result<u8, Error> {
    let m = client.mutex(name.as_str())?;
    let taken = signals
        .or_signal(async {
            match a.wait.limit() {
                Some(t) => m.lock_revocable_timeout(t).await,
                None => m.lock_revocable().await,
            }
        })
        .await;
    let mut guard = match taken {
        Ok(taken) => taken?,
        Err(n) => return Ok(interrupted(n)),
    };
    let token = guard.token().to_string();
    let lost = guard.lost();
    let revoked = guard.revoke_requested();
    let env = [("DLOCK_TOKEN", token), ("DLOCK_NAME", name.to_string())];
    let is_lost = || guard.is_lost();
    let run = Run {
        cmd: &a.cmd,
        env: &env,
        kill_after,
        is_lost: &is_lost,
    };
    let outcome = run_child_revocable(&run, lost, revoked, &mut signals).await;
    let verified = confirm(&outcome, guard.verify()).await;
    let released = guard.release().await;
    finish(outcome, verified, released)
}

/// [`child::run`], and on a revocation request SIGTERM the command's group and wait for
/// it: its exit code is dlock's.
async fn run_child_revocable(
    run: &Run<'_>,
    lost: impl std::future::Future<Output = Error>,
    revoked: impl std::future::Future<Output = Result<(), Error>>,
    signals: &mut Signals,
) -> Outcome {
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let watch = async move {
        match revoked.await {
            Ok(()) => {
                say!("dlock: revocation requested; stopping the command");
                let _ = tx.send(());
            }
            // The lock ended another way (lost, released): the lost signal covers it.
            Err(e) => tracing::debug!(error = %e, "revocation watch ended"),
        }
        std::future::pending::<std::convert::Infallible>().await
    };
    tokio::select! {
        outcome = child::run(run, lost, Some(rx), signals) => outcome,
        never = watch => match never {},
    }
}

async fn multi(client: &Client, a: MultiArgs, kill_after: Duration) -> Result<u8, Error> {
    let mut m = client.multi();
    for n in &a.names {
        // `DLOCK_TOKEN` is `name=token,name=token`: a name with `,` or `=` would make
        // it ambiguous, and a script could fence with another lock's token.
        if n.contains([',', '=']) {
            return Err(Error::InvalidName {
                name: n.clone(),
                reason: dlock::NameError::BadChar(if n.contains(',') { ',' } else { '=' }),
            });
        }
        m = m.mutex(n)?;
    }
    let wait = a.wait.limit();
    let mut signals = Signals::install();
    let taken = signals
        .or_signal(async {
            match wait {
                Some(t) => m.acquire_timeout(t).await,
                None => m.acquire().await,
            }
        })
        .await;
    let mut guard: MultiGuard<dyn dlock::DynBackend> = match taken {
        Ok(taken) => taken?,
        Err(n) => return Ok(interrupted(n)),
    };
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
    let env = [("DLOCK_TOKEN", tokens), ("DLOCK_NAME", names)];
    let is_lost = || guard.is_lost();
    let run = Run {
        cmd: &a.cmd,
        env: &env,
        kill_after,
        is_lost: &is_lost,
    };
    let outcome = child::run(&run, lost, None, &mut signals).await;
    let verified = confirm(&outcome, guard.verify()).await;
    let released = guard.release().await;
    finish(outcome, verified, released)
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
            say!("dlock: {msg}");
            Ok(code)
        }
        Outcome::Exited(code) => {
            if let Err(e) = verified {
                say!(
                    "dlock: the command exited with {code}, but the lock was not held to the end: {e}"
                );
                return Err(lost_while_running(e));
            }
            if let Err(e) = released {
                // The command ran under the lock; a failed release only delays the next
                // holder until the session ends, so report it but keep the command's code.
                say!("dlock: warning: release failed: {e}");
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

async fn elect(client: &Client, a: ElectArgs, kill_after: Duration) -> Result<u8, Error> {
    let name = client.lock_name(&a.name)?;
    let election = client.election(name.as_str())?;
    let wait = a.wait.limit();
    let mut signals = Signals::install();
    let campaign = signals
        .or_signal(async {
            match wait {
                Some(t) => election.campaign_timeout(&a.value, t).await,
                None => election.campaign(&a.value).await,
            }
        })
        .await;
    let leadership = match campaign {
        Ok(led) => led?,
        Err(n) => return Ok(interrupted(n)),
    };
    let term = leadership.term().to_string();
    let lost = leadership.lost();
    let env = [
        ("DLOCK_NAME", name.to_string()),
        ("DLOCK_TERM", term),
        ("DLOCK_VALUE", a.value.clone()),
    ];
    let is_lost = || leadership.is_lost();
    let run = Run {
        cmd: &a.cmd,
        env: &env,
        kill_after,
        is_lost: &is_lost,
    };
    let outcome = child::run(&run, lost, None, &mut signals).await;
    let verified = confirm(&outcome, leadership.verify()).await;
    let resigned = leadership.resign().await;
    finish(outcome, verified, resigned)
}

/// The leader as one line (`NAME: VALUE (term T)`, `NAME: no leader`) or one JSON object;
/// false if stdout could not take it (its reader is gone).
fn show_leader(name: &str, leader: Option<&dlock::Leader>, json: bool) -> bool {
    if json {
        let doc = match leader {
            Some(l) => serde_json::json!({
                "name": name,
                "value": String::from_utf8_lossy(&l.value),
                "term": l.term.get(),
            }),
            None => serde_json::json!({ "name": name, "value": null, "term": null }),
        };
        show!("{doc}")
    } else {
        match leader {
            Some(l) => show!(
                "{name}: {} (term {})",
                String::from_utf8_lossy(&l.value),
                l.term
            ),
            None => show!("{name}: no leader"),
        }
    }
}

async fn leader(client: &Client, a: LeaderArgs) -> Result<u8, Error> {
    let name = client.lock_name(&a.name)?;
    let election = client.election(name.as_str())?;
    if a.watch {
        use futures::StreamExt;
        let mut changes = election.observe();
        while let Some(change) = changes.next().await {
            // Nobody reads any more (`dlock leader --watch | head -1`): done.
            if !show_leader(name.as_str(), change?.as_ref(), a.json) {
                break;
            }
        }
        return Ok(0);
    }
    let current = election.leader().await?;
    // The exit code is the answer; a line nobody could read changes nothing.
    let _ = show_leader(name.as_str(), current.as_ref(), a.json);
    Ok(if current.is_some() { 0 } else { STATUS_FREE })
}

async fn revoke(client: &Client, a: RevokeArgs) -> Result<u8, Error> {
    let asked = client.revoke(&a.name).await?;
    if asked == 0 {
        show!("{}: free (nobody to ask)", a.name);
    } else {
        show!("{}: asked {asked} holder(s) to release", a.name);
    }
    Ok(0)
}

/// One line per lock (holders, waiters, kind, then the name, which may contain spaces)
/// under a header, nothing at all when no lock is held or waited for; or a JSON array.
async fn list(client: &Client, a: ListArgs) -> Result<u8, Error> {
    let locks = client.locks(a.prefix.as_deref().unwrap_or("")).await?;
    if a.json {
        let rows: Vec<serde_json::Value> = locks
            .iter()
            .map(|l| {
                serde_json::json!({
                    "name": l.name.as_str(),
                    "kind": l.kind.label(),
                    "holders": l.holders,
                    "waiters": l.waiters,
                    "entries": l.entries(),
                })
            })
            .collect();
        show!("{}", serde_json::Value::Array(rows));
    } else if !locks.is_empty() {
        show!("{:>7} {:>7} {:<9} name", "holders", "waiters", "kind");
        for l in &locks {
            show!(
                "{:>7} {:>7} {:<9} {}",
                l.holders,
                l.waiters,
                l.kind.label(),
                l.name
            );
        }
    }
    Ok(0)
}

async fn status(client: &Client, a: StatusArgs) -> Result<u8, Error> {
    let parts = client.participants(&a.name).await?;
    // Where the lock lives, on backends where that depends on the lock (Redis Cluster).
    let node = client.serving_node(&a.name)?;
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
                    "age_ms": p.entry.created_ms.map(|c| now_ms.saturating_sub(c)),
                    "owner": String::from_utf8_lossy(&p.entry.data),
                })
            })
            .collect();
        let mut doc = serde_json::json!({ "name": a.name, "participants": rows });
        if let Some(node) = &node {
            doc["node"] = serde_json::json!(node);
        }
        show!("{doc}");
    } else if parts.is_empty() {
        show!("{}: free (no holders, no waiters)", a.name);
        if let Some(node) = &node {
            show!("served by {node}");
        }
    } else {
        if let Some(node) = &node {
            show!("served by {node}");
        }
        show!(
            "{:<7} {:<6} {:<5} {:>10} {:>12} {:>9}  owner",
            "state",
            "queue",
            "kind",
            "sequence",
            "token",
            "age"
        );
        for p in &parts {
            let age = p
                .entry
                .created_ms
                .map(|c| format!("{:.1}s", now_ms.saturating_sub(c) as f64 / 1000.0))
                .unwrap_or_else(|| "-".into());
            show!(
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
    // As `systemctl is-active`: a script asks "is it held?" by the exit code alone.
    Ok(if parts.iter().any(|p| p.holds) {
        0
    } else {
        STATUS_FREE
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exec_command() -> Command {
        Cli::try_parse_from(["dlock", "exec", "name", "--", "true"])
            .expect("exec args")
            .command
    }

    /// The default grace is half the lost signal's lead on the next holder (the core's
    /// `lost_margin`, max(10 % of the session, 100 ms)), at most 5 s; a grace given is kept.
    #[test]
    fn the_default_grace_is_half_the_lost_signals_lead() {
        let exec = exec_command();
        let s = Duration::from_secs;
        assert_eq!(kill_after(None, s(10), &exec), Duration::from_millis(500));
        assert_eq!(kill_after(None, s(30), &exec), Duration::from_millis(1500));
        assert_eq!(kill_after(None, s(2), &exec), Duration::from_millis(100));
        assert_eq!(
            kill_after(None, Duration::from_millis(500), &exec),
            Duration::from_millis(50)
        );
        assert_eq!(kill_after(None, s(3600), &exec), s(5));
        for session in [s(2), s(10), s(60), s(3600)] {
            assert!(kill_after(None, session, &exec) < dlock::lost_margin(session));
        }
        assert_eq!(kill_after(Some(s(20)), s(10), &exec), s(20));
    }
}
