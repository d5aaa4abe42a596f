//! The processes the chaos runs fault: workers that take the lock again and again, each
//! time running one critical section that logs its start and end and writes to the
//! fenced store with its fencing token.
//!
//! Two kinds, so both the CLI and the library are exercised:
//! - `--via cli`: every section is `dlock exec NAME -- xtask chaos-section`, a fresh
//!   process with the token in `$DLOCK_TOKEN` (for the election, `dlock elect NAME
//!   --value V -- xtask chaos-section`, with the term in `$DLOCK_TERM`);
//! - `--via lib`: one process with one client taking one recipe ([`Recipe`]), and the
//!   section run on a blocking thread while a task watches the guard's lost signal.
//!
//! The section never looks at the lost signal between its work and its write: a pause
//! right after such a check is exactly what fencing exists for.

use std::io::{BufRead as _, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use anyhow::{bail, Context as _};

use super::history::{self, now_us, Mode, Record, WriteOutcome};
use super::store;
use super::Recipe;
use crate::flags::{ChaosSectionArgs, ChaosWorkerArgs, SectionParams};

/// How long one acquire may wait before the worker checks its stop file again.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(20);

/// Runs one critical section holding `token` in `mode`. Only an exclusive section writes
/// to the fenced store: holders that may overlap cannot be judged by one highest token.
pub(crate) fn section(p: &SectionParams, token: u64, mode: Mode) -> anyhow::Result<WriteOutcome> {
    begin(p, token, mode)?;
    work(p, token, mode)
}

/// Logs the start of a section.
fn begin(p: &SectionParams, token: u64, mode: Mode) -> anyhow::Result<()> {
    let begin = Record::Begin {
        worker: p.worker,
        pid: std::process::id(),
        token,
        at_us: now_us(),
        mode,
    };
    history::append(&p.history, &begin.line())
}

/// A begun section's work, write and end line.
fn work(p: &SectionParams, token: u64, mode: Mode) -> anyhow::Result<WriteOutcome> {
    let pid = std::process::id();
    // The work: a deadline-based sleep, so time spent stopped counts and a resumed
    // section goes straight on to its write.
    std::thread::sleep(Duration::from_millis(p.work_ms));
    let write = match mode {
        Mode::Exclusive => store::write(&p.store, token, p.worker),
        Mode::Shared | Mode::Permit => WriteOutcome::None,
    };
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

/// `xtask chaos-section`: one section under `dlock exec`, token from `$DLOCK_TOKEN`, or
/// under `dlock elect`, token from `$DLOCK_TERM` (the term is the leader's fencing token).
///
/// `dlock exec` and `dlock elect` send SIGTERM when their lost signal fires; the section
/// then logs its end as `killed`, so the history knows exactly when it stopped.
pub(crate) fn chaos_section(args: &ChaosSectionArgs) -> anyhow::Result<i32> {
    let (var, raw) = match std::env::var("DLOCK_TOKEN") {
        Ok(t) => ("DLOCK_TOKEN", t),
        Err(_) => (
            "DLOCK_TERM",
            std::env::var("DLOCK_TERM").context(
                "neither DLOCK_TOKEN nor DLOCK_TERM is set: run this under `dlock exec` or `dlock elect`",
            )?,
        ),
    };
    let token: u64 = raw
        .parse()
        .with_context(|| format!("{var} is not a number"))?;
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
    section(&args.section, token, Mode::Exclusive)?;
    Ok(0)
}

/// `xtask chaos-worker`: sections until the stop file appears.
pub(crate) fn worker(args: &ChaosWorkerArgs) -> anyhow::Result<i32> {
    let session = humantime::parse_duration(&args.session_timeout)
        .with_context(|| format!("--session-timeout {:?}", args.session_timeout))?;
    let recipe = Recipe::parse(&args.recipe)?;
    match args.via.as_str() {
        "cli" => cli_worker(args, recipe),
        "lib" => lib_worker(args, session, recipe),
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

/// The CLI command that runs one section: `dlock elect` for the election (the worker's
/// number as its value), `dlock exec` for the mutex.
fn cli_command(recipe: Recipe, worker: u32) -> anyhow::Result<Vec<String>> {
    match recipe {
        Recipe::Mutex => Ok(vec!["exec".into()]),
        Recipe::Election => Ok(vec![
            "elect".into(),
            "--value".into(),
            format!("worker-{worker}"),
        ]),
        other => bail!(
            "--via cli runs the mutex or the election, not {}",
            other.label()
        ),
    }
}

fn cli_worker(args: &ChaosWorkerArgs, recipe: Recipe) -> anyhow::Result<i32> {
    let dlock = args.dlock.as_ref().context("--via cli needs --dlock")?;
    let me = std::env::current_exe().context("locating the xtask binary")?;
    let p = &args.section;
    let command = cli_command(recipe, p.worker)?;
    while !stopped(&args.stop) {
        let mut child = Command::new(dlock)
            .arg("--url")
            .arg(&args.url)
            .arg("--session-timeout")
            .arg(&args.session_timeout)
            .arg(&command[0])
            .arg(&args.name)
            .args(&command[1..])
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
            .with_context(|| format!("running dlock {}", command[0]))?;
        // The CLI announces its lost signal on stderr the moment it fires; time it there,
        // not at exit, which waits for the release.
        let seen = child.stderr.take().map(|err| {
            let p = p.clone();
            let sub = command[0].clone();
            std::thread::spawn(move || {
                let mut seen = false;
                for line in BufReader::new(err).lines() {
                    let Ok(line) = line else { break };
                    if !seen && line.contains("stopping the command") {
                        seen = true;
                        lost(&p, &format!("dlock {sub}: {line}"));
                    }
                    eprintln!("{line}");
                }
                seen
            })
        });
        let status = child.wait().context("waiting for dlock")?;
        let seen = seen.is_some_and(|t| t.join().unwrap_or(false));
        match status.code() {
            Some(0) | Some(75) => {}
            Some(70) if seen => {}
            // Lost before the command started, or the message changed: count it anyway.
            Some(70) => lost(p, &format!("dlock {} exited 70: lock lost", command[0])),
            _ => {
                eprintln!("chaos worker {}: dlock {}: {status}", p.worker, command[0]);
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
    Ok(0)
}

fn lib_worker(args: &ChaosWorkerArgs, session: Duration, recipe: Recipe) -> anyhow::Result<i32> {
    // `RUST_LOG=dlock=debug cargo xtask chaos ..` puts the library's log in each worker's
    // log (stderr), timestamped like the history, for a failing round's post-mortem.
    if std::env::var_os("RUST_LOG").is_some() {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .try_init();
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    rt.block_on(lib_loop(args, session, recipe))?;
    rt.shutdown_timeout(Duration::from_millis(500));
    Ok(0)
}

/// Why one turn of the loop ended without all its sections.
enum Turn {
    /// The acquire timed out: check the stop file and try again.
    Again,
    /// Something broke (a lost session, an unreachable cluster): start over on a fresh
    /// client.
    Broken,
}

async fn lib_loop(args: &ChaosWorkerArgs, session: Duration, recipe: Recipe) -> anyhow::Result<()> {
    let p = &args.section;
    let opts = dlock::SessionOptions::default().with_session_timeout(session);
    let mut client: Option<dlock::Client> = None;
    let mut turn = 0u64;
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
        turn += 1;
        match one_turn(&c, args, recipe, turn).await {
            Ok(()) | Err(Turn::Again) => {}
            Err(Turn::Broken) => {
                let _ = tokio::time::timeout(Duration::from_secs(2), c.close()).await;
                client = None;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    if let Some(c) = client {
        let _ = tokio::time::timeout(Duration::from_secs(5), c.close()).await;
    }
    Ok(())
}

/// An acquire's error, sorted into what the loop does next.
fn acquire_failed(worker: u32, e: dlock::Error) -> Turn {
    match e {
        dlock::Error::Timeout(_) => Turn::Again,
        e => {
            eprintln!("chaos worker {worker}: acquire: {e}");
            Turn::Broken
        }
    }
}

/// One turn of `recipe`: acquire, run its section(s) while watching the lost signal,
/// release.
async fn one_turn(
    c: &dlock::Client,
    args: &ChaosWorkerArgs,
    recipe: Recipe,
    turn: u64,
) -> Result<(), Turn> {
    let p = &args.section;
    let w = p.worker;
    let name = args.name.as_str();
    let t = ACQUIRE_TIMEOUT;
    let named = |e: dlock::Error| {
        eprintln!("chaos worker {w}: {e}");
        Turn::Broken
    };
    match recipe {
        Recipe::Mutex => {
            let m = c.mutex(name).map_err(named)?;
            let g = m
                .lock_timeout(ACQUIRE_TIMEOUT)
                .await
                .map_err(|e| acquire_failed(w, e))?;
            held(p, g, Mode::Exclusive).await
        }
        Recipe::ReentrantMutex => {
            let m = c.mutex(name).map_err(named)?;
            let mut outer = m
                .lock_timeout(ACQUIRE_TIMEOUT)
                .await
                .map_err(|e| acquire_failed(w, e))?;
            // The section runs on a nested hold; the outer one is released after it.
            let inner = match outer.reenter() {
                Ok(g) => g,
                Err(e) => {
                    eprintln!("chaos worker {w}: re-entry: {e}");
                    let _ = outer.release().await;
                    return Err(Turn::Broken);
                }
            };
            let r = held(p, inner, Mode::Exclusive).await;
            let released = outer.release().await;
            r?;
            released.map_err(|_| Turn::Broken)
        }
        Recipe::SemaphoreMutex => {
            let m = c.semaphore_mutex(name).map_err(named)?;
            let g = m.lock_timeout(t).await.map_err(|e| acquire_failed(w, e))?;
            held(p, g, Mode::Exclusive).await
        }
        Recipe::RwLock => {
            let rw = c.rwlock(name).map_err(named)?;
            // The slow worker writes and downgrades; the others alternate reads and
            // writes, so readers meet readers, writers and downgraded writers.
            if p.work_ms < super::SLOW_WORK_MS && turn % 2 == 1 {
                let g = rw.read_timeout(t).await.map_err(|e| acquire_failed(w, e))?;
                return held(p, g, Mode::Shared).await;
            }
            let mut write = rw
                .write_timeout(t)
                .await
                .map_err(|e| acquire_failed(w, e))?;
            let lost = write.lost();
            let r = run_section(p, write.token().get(), Mode::Exclusive, lost, || {
                write.is_lost()
            })
            .await;
            let read = if r.is_ok() {
                rw.downgrade(&write).await.map_err(|e| {
                    eprintln!("chaos worker {w}: downgrade: {e}");
                    Turn::Broken
                })
            } else {
                Err(Turn::Broken)
            };
            let released = write.release().await;
            let read = read?;
            released.map_err(|_| Turn::Broken)?;
            r?;
            held(p, read, Mode::Shared).await
        }
        Recipe::Semaphore => {
            let s = c.semaphore(name, args.permits).map_err(named)?;
            let g = s
                .acquire_timeout(t)
                .await
                .map_err(|e| acquire_failed(w, e))?;
            held(p, g, Mode::Permit).await
        }
        Recipe::MultiLock => {
            let multi = c
                .multi()
                .mutex(&format!("{name}/a"))
                .and_then(|m| m.mutex(&format!("{name}/b")))
                .map_err(named)?;
            let mut g = multi
                .acquire_timeout(t)
                .await
                .map_err(|e| acquire_failed(w, e))?;
            // The store is fenced by the first part's token: every section holds it.
            let token = g
                .tokens()
                .iter()
                .find(|(n, _)| n.as_str().ends_with("/a"))
                .map(|(_, t)| t.get())
                .unwrap_or(0);
            let lost = g.lost();
            let r = run_section(p, token, Mode::Exclusive, lost, || g.is_lost()).await;
            let released = g.release().await;
            r?;
            released.map_err(|_| Turn::Broken)
        }
        Recipe::Election => {
            let election = c.election(name).map_err(named)?;
            let leadership = election
                .campaign_timeout(format!("worker-{w}"), t)
                .await
                .map_err(|e| acquire_failed(w, e))?;
            // The leader acts with its term as the fencing token: a deposed leader's late
            // write carries an older term than its successor's.
            let lost = leadership.lost();
            let r = run_section(p, leadership.term().get(), Mode::Exclusive, lost, || {
                leadership.is_lost()
            })
            .await;
            let resigned = leadership.resign().await;
            r?;
            resigned.map_err(|_| Turn::Broken)
        }
    }
}

/// Runs one section on `guard` and releases it.
async fn held(p: &SectionParams, mut guard: dlock::LockGuard, mode: Mode) -> Result<(), Turn> {
    let lost = guard.lost();
    let r = run_section(p, guard.token().get(), mode, lost, || guard.is_lost()).await;
    let released = guard.release().await;
    r?;
    released.map_err(|_| Turn::Broken)
}

/// Runs the section on a blocking thread while a task logs the lost signal the moment it
/// fires. `Err(Broken)` when the hold was lost: the worker starts over on a new session.
///
/// A hold already known lost is not begun on, as an application looks before it starts
/// (the no-look rule is for the gap between the work and the write): a hold can be lost
/// before its section, while the worker releases the write it downgraded from or in the
/// instant between the grant and the start. The check and the `B` line are made under
/// the lock the watcher logs its `L` line under, so a history never shows a section
/// begun after its own hold's lost signal: the checker ends a hold at the first `L`
/// after its `B`, and cannot tell an `L` just before it from an earlier hold's.
async fn run_section(
    p: &SectionParams,
    token: u64,
    mode: Mode,
    signal: impl std::future::Future<Output = dlock::Error> + Send + 'static,
    is_lost: impl Fn() -> bool,
) -> Result<(), Turn> {
    // True once this hold's `L` line is written.
    let logged = Arc::new(Mutex::new(false));
    let params = p.clone();
    let watcher = tokio::spawn({
        let logged = logged.clone();
        async move {
            let e = signal.await;
            let mut logged = logged.lock().unwrap_or_else(PoisonError::into_inner);
            if !*logged {
                *logged = true;
                lost(&params, &format!("lost signal: {e}"));
            }
        }
    });
    {
        let mut logged = logged.lock().unwrap_or_else(PoisonError::into_inner);
        if !*logged && is_lost() {
            *logged = true;
            lost(p, "lost before the section began");
        }
        let begun = if *logged {
            Err(())
        } else {
            begin(p, token, mode)
                .map_err(|e| eprintln!("chaos worker {}: section: {e:#}", p.worker))
        };
        if begun.is_err() {
            watcher.abort();
            return Err(Turn::Broken);
        }
    }
    let params = p.clone();
    let outcome = tokio::task::spawn_blocking(move || work(&params, token, mode)).await;
    // Decided under the watcher's lock, which is then closed: `abort` does not stop a
    // watcher already running on another thread, and an `L` it wrote after this
    // function returned could land after the next hold's `B` and end that hold (or be
    // written after the caller is gone). A loss found here is logged here, after the
    // section's `E`, which the checker reads as the hold's end either way.
    let was_lost = {
        let mut logged = logged.lock().unwrap_or_else(PoisonError::into_inner);
        let was_lost = *logged || is_lost();
        if !*logged && was_lost {
            lost(p, "lost signal by the section's end");
        }
        *logged = true;
        was_lost
    };
    watcher.abort();
    match outcome {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => eprintln!("chaos worker {}: section: {e:#}", p.worker),
        Err(e) => eprintln!("chaos worker {}: section panicked: {e}", p.worker),
    }
    if was_lost {
        Err(Turn::Broken)
    } else {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fresh history file in a directory of its own.
    fn params(test: &str) -> SectionParams {
        let dir = std::env::temp_dir().join(format!("dlock-worker-{test}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        SectionParams {
            worker: 7,
            // Never dialled: a shared section does not write to the store.
            store: "127.0.0.1:9".into(),
            history: dir.join("history.log"),
            work_ms: 0,
        }
    }

    #[tokio::test]
    async fn a_hold_known_lost_is_not_begun_on() {
        let p = params("known-lost");
        let gone = std::future::ready(dlock::Error::LockLost("the session expired".into()));
        let r = run_section(&p, 5, Mode::Shared, gone, || true).await;
        assert!(matches!(r, Err(Turn::Broken)));
        let records = history::read(&p.history).expect("history");
        assert!(
            !records.iter().any(|r| matches!(r, Record::Begin { .. })),
            "a section began on a hold already lost: {records:?}"
        );
        let lost = records
            .iter()
            .filter(|r| matches!(r, Record::Lost { .. }))
            .count();
        assert_eq!(lost, 1, "{records:?}");
        let _ = std::fs::remove_dir_all(p.history.parent().expect("dir"));
    }

    /// Whatever order the watcher's first poll (which finds the loss) and the check
    /// before the section fall in, no `B` follows the hold's own `L`: the checker ends a
    /// hold at the first `L` after its `B`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_section_never_begins_after_its_holds_lost_line() {
        for round in 0..200 {
            let p = params(&format!("race-{round}"));
            let found = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let signal = {
                let found = found.clone();
                async move {
                    found.store(true, std::sync::atomic::Ordering::SeqCst);
                    dlock::Error::LockLost("the session expired".into())
                }
            };
            let is_lost = || found.load(std::sync::atomic::Ordering::SeqCst);
            let r = run_section(&p, 5, Mode::Shared, signal, is_lost).await;
            let records = history::read(&p.history).expect("history");
            let lost_at = records
                .iter()
                .position(|r| matches!(r, Record::Lost { .. }));
            let begun_at = records
                .iter()
                .position(|r| matches!(r, Record::Begin { .. }));
            if let (Some(b), Some(l)) = (begun_at, lost_at) {
                assert!(b < l, "a section began after its hold's L: {records:?}");
            }
            if lost_at.is_some() {
                assert!(matches!(r, Err(Turn::Broken)), "{records:?}");
            }
            if matches!(r, Err(Turn::Broken)) {
                assert!(lost_at.is_some(), "broken without an L line: {records:?}");
            }
            let _ = std::fs::remove_dir_all(p.history.parent().expect("dir"));
        }
    }
}
