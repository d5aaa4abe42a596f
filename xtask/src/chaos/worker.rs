//! The processes the chaos runs fault: workers that take the lock again and again, each
//! time running one critical section that logs its start and end and writes to the
//! fenced store with its fencing token.
//!
//! Two kinds, so both the CLI and the library are exercised:
//! - `--via cli`: every section is `dlock exec NAME -- xtask chaos-section`, a fresh
//!   process with the token in `$DLOCK_TOKEN`;
//! - `--via lib`: one process with one client, `Mutex::lock_timeout`, and the section run
//!   on a blocking thread while a task watches the guard's lost signal.
//!
//! The section never looks at the lost signal between its work and its write: a pause
//! right after such a check is exactly what fencing exists for.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{bail, Context as _};

use super::history::{self, now_us, Record, WriteOutcome};
use super::store;
use crate::flags::{ChaosSectionArgs, ChaosWorkerArgs, SectionParams};

/// How long one acquire may wait before the worker checks its stop file again.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs one critical section holding `token`.
pub(crate) fn section(p: &SectionParams, token: u64) -> anyhow::Result<WriteOutcome> {
    let pid = std::process::id();
    let begin = Record::Begin {
        worker: p.worker,
        pid,
        token,
        at_us: now_us(),
    };
    history::append(&p.history, &begin.line())?;
    // The work: a deadline-based sleep, so time spent stopped counts and a resumed
    // section goes straight on to its write.
    std::thread::sleep(Duration::from_millis(p.work_ms));
    let write = store::write(&p.store, token, p.worker);
    let end = Record::End {
        worker: p.worker,
        pid,
        token,
        at_us: now_us(),
        write,
    };
    history::append(&p.history, &end.line())?;
    Ok(write)
}

/// `xtask chaos-section`: one section under `dlock exec`, token from `$DLOCK_TOKEN`.
///
/// `dlock exec` sends SIGTERM when its lock's lost signal fires; the section then logs
/// its end as `killed`, so the history knows exactly when it stopped.
pub(crate) fn chaos_section(args: &ChaosSectionArgs) -> anyhow::Result<i32> {
    let token: u64 = std::env::var("DLOCK_TOKEN")
        .context("DLOCK_TOKEN is not set: run this under `dlock exec`")?
        .parse()
        .context("DLOCK_TOKEN is not a number")?;
    let p = args.section.clone();
    ctrlc::set_handler(move || {
        let end = Record::End {
            worker: p.worker,
            pid: std::process::id(),
            token,
            at_us: now_us(),
            write: WriteOutcome::Killed,
        };
        let _ = history::append(&p.history, &end.line());
        std::process::exit(143);
    })
    .context("installing the SIGTERM handler")?;
    section(&args.section, token)?;
    Ok(0)
}

/// `xtask chaos-worker`: sections until the stop file appears.
pub(crate) fn worker(args: &ChaosWorkerArgs) -> anyhow::Result<i32> {
    let session = humantime::parse_duration(&args.session_timeout)
        .with_context(|| format!("--session-timeout {:?}", args.session_timeout))?;
    match args.via.as_str() {
        "cli" => cli_worker(args),
        "lib" => lib_worker(args, session),
        other => bail!("--via {other:?}: expected cli or lib"),
    }
}

fn lost(p: &SectionParams, reason: &str) {
    let rec = Record::Lost {
        worker: p.worker,
        at_us: now_us(),
        reason: reason.to_string(),
    };
    if let Err(e) = history::append(&p.history, &rec.line()) {
        eprintln!("chaos worker {}: {e:#}", p.worker);
    }
}

fn stopped(stop: &Path) -> bool {
    stop.exists()
}

fn cli_worker(args: &ChaosWorkerArgs) -> anyhow::Result<i32> {
    let dlock = args.dlock.as_ref().context("--via cli needs --dlock")?;
    let me = std::env::current_exe().context("locating the xtask binary")?;
    let p = &args.section;
    while !stopped(&args.stop) {
        let mut child = Command::new(dlock)
            .arg("--url")
            .arg(&args.url)
            .arg("--session-timeout")
            .arg(&args.session_timeout)
            .arg("exec")
            .arg(&args.name)
            .arg("--timeout")
            .arg(format!("{}s", ACQUIRE_TIMEOUT.as_secs()))
            .arg("--")
            .arg(&me)
            .arg("chaos-section")
            .arg("--worker")
            .arg(p.worker.to_string())
            .arg("--store")
            .arg(&p.store)
            .arg("--history")
            .arg(&p.history)
            .arg("--work-ms")
            .arg(p.work_ms.to_string())
            .stdin(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("running dlock exec")?;
        // The CLI announces its lost signal on stderr the moment it fires; time it there,
        // not at exit, which waits for the release.
        let seen = child.stderr.take().map(|err| {
            let p = p.clone();
            std::thread::spawn(move || {
                let mut seen = false;
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    if !seen && line.contains("stopping the command") {
                        seen = true;
                        lost(&p, &format!("dlock exec: {line}"));
                    }
                    eprintln!("{line}");
                }
                seen
            })
        });
        let status = child.wait().context("waiting for dlock exec")?;
        let seen = seen.is_some_and(|t| t.join().unwrap_or(false));
        match status.code() {
            Some(0) | Some(75) => {}
            Some(70) if seen => {}
            // Lost before the command started, or the message changed: count it anyway.
            Some(70) => lost(p, "dlock exec exited 70: lock lost"),
            _ => {
                eprintln!("chaos worker {}: dlock exec: {status}", p.worker);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    Ok(0)
}

fn lib_worker(args: &ChaosWorkerArgs, session: Duration) -> anyhow::Result<i32> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(lib_loop(args, session))?;
    rt.shutdown_timeout(Duration::from_millis(500));
    Ok(0)
}

async fn lib_loop(args: &ChaosWorkerArgs, session: Duration) -> anyhow::Result<()> {
    let p = &args.section;
    let opts = dlock::SessionOptions::default().with_session_timeout(session);
    let mut client: Option<dlock::Client> = None;
    while !stopped(&args.stop) {
        let c = match &client {
            Some(c) => c.clone(),
            None => match dlock::connect_with(&args.url, opts.clone()).await {
                Ok(c) => {
                    client = Some(c.clone());
                    c
                }
                Err(e) => {
                    eprintln!("chaos worker {}: connect: {e}", p.worker);
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    continue;
                }
            },
        };
        let mutex = c.mutex(&args.name).context("lock name")?;
        let mut guard = match mutex.lock_timeout(ACQUIRE_TIMEOUT).await {
            Ok(g) => g,
            Err(dlock::Error::Timeout(_)) => continue,
            Err(e) => {
                // Whatever broke (a lost session, an unreachable cluster), start over on a
                // fresh session.
                eprintln!("chaos worker {}: lock: {e}", p.worker);
                let _ = tokio::time::timeout(Duration::from_secs(2), c.close()).await;
                client = None;
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let token = guard.token().get();
        let signal = guard.lost();
        let params = p.clone();
        let watcher = tokio::spawn(async move {
            let e = signal.await;
            lost(&params, &format!("lost signal: {e}"));
        });
        let params = p.clone();
        let outcome = tokio::task::spawn_blocking(move || section(&params, token)).await;
        let was_lost = watcher.is_finished() || guard.is_lost();
        watcher.abort();
        let released = guard.release().await;
        match outcome {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => eprintln!("chaos worker {}: section: {e:#}", p.worker),
            Err(e) => eprintln!("chaos worker {}: section panicked: {e}", p.worker),
        }
        if was_lost || released.is_err() {
            let _ = tokio::time::timeout(Duration::from_secs(2), c.close()).await;
            client = None;
        }
    }
    if let Some(c) = client {
        let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
    }
    Ok(())
}
