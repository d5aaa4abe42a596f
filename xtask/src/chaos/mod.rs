//! `cargo xtask chaos`: what dlock does when the things distributed locks fail on happen,
//! on real servers with real processes.
//!
//! Per backend and scenario: start four worker processes (two through the `dlock` CLI,
//! two through the library) that take one lock again and again; each critical section
//! logs its start and end ([`history`]) and writes to a fenced store ([`store`]) with its
//! token. Inject the fault, let the workers run on, stop them, check that no entry is
//! left under the lock, and check the history: overlaps, token order, stale writes the
//! store accepted, lost signals, recovery time. The table goes to stdout (markdown),
//! `target/chaos/summary.json` and, for a full run, `docs/safety.md`.

mod history;
mod proxy;
mod report;
mod store;
pub(crate) mod worker;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use dlock_testkit::{Backend, Cluster, ClusterSpec};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use self::history::{now_us, Fault, Record};
use self::proxy::Proxy;
use self::report::Row;
use self::store::Store;
use crate::flags::ChaosArgs;

/// Session timeout of every client: short, so a scenario takes seconds, and long enough
/// for two loaded cores to keep sessions alive between faults.
const SESSION: Duration = Duration::from_secs(2);

/// Work inside a section of a "fast" and a "slow" worker. Slow workers are the victims:
/// their sections are long enough to be caught inside.
const FAST_WORK_MS: u64 = 30;
const SLOW_WORK_MS: u64 = 300;

/// Generous bound for anything that should happen within a few session timeouts.
const WAIT: Duration = Duration::from_secs(60);

/// A lock service under test: the one list dlock's own tests use too.
pub(crate) use dlock_testkit::LockService as Kind;

/// Parses a `--backend` value.
fn parse_kind(s: &str) -> anyhow::Result<Kind> {
    Kind::parse(s).ok_or_else(|| {
        anyhow::anyhow!(
            "unknown backend {s:?}: expected zk, etcd, redis, redlock or redis-sentinel"
        )
    })
}

/// The client addresses of `kind`'s servers in `cluster` that its URL lists (a single
/// Redis master: only the first).
fn cluster_addrs(kind: Kind, cluster: &Cluster) -> Vec<String> {
    let all = cluster.servers_of(kind.server()).map(|s| s.addr.clone());
    match kind {
        Kind::Redis => all.take(1).collect(),
        _ => all.collect(),
    }
}

/// Whether this build of dlock has the backend: a URL of a missing feature fails at once
/// with `InvalidUrl`, before any connection attempt.
async fn available(kind: Kind) -> bool {
    let url = kind.url(&[
        "127.0.0.1:1".into(),
        "127.0.0.1:2".into(),
        "127.0.0.1:3".into(),
    ]);
    let opts = dlock::SessionOptions::default().with_connect_timeout(Duration::from_millis(1));
    !matches!(
        dlock::connect_with(&url, opts).await,
        Err(dlock::Error::InvalidUrl { .. })
    )
}

/// A fault scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    HolderKill,
    HolderPause,
    HolderPauseUnfenced,
    LeaderKill,
    ServerRestart,
    ReplicaPromotion,
    ClientCut,
    SentinelFailover,
}

impl Scenario {
    const ALL: [Scenario; 8] = [
        Scenario::HolderKill,
        Scenario::HolderPause,
        Scenario::HolderPauseUnfenced,
        Scenario::LeaderKill,
        Scenario::ServerRestart,
        Scenario::ReplicaPromotion,
        Scenario::ClientCut,
        Scenario::SentinelFailover,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Scenario::HolderKill => "holder-kill",
            Scenario::HolderPause => "holder-pause",
            Scenario::HolderPauseUnfenced => "holder-pause-unfenced",
            Scenario::LeaderKill => "leader-kill",
            Scenario::ServerRestart => "server-restart",
            Scenario::ReplicaPromotion => "replica-promotion",
            Scenario::ClientCut => "client-cut",
            Scenario::SentinelFailover => "sentinel-failover",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Scenario::HolderKill => "SIGKILL the holder (its process group) inside its section",
            Scenario::HolderPause => {
                "SIGSTOP the holder inside its section past its session, SIGCONT; fenced store"
            }
            Scenario::HolderPauseUnfenced => "the same pause; the store accepts every write",
            Scenario::LeaderKill => {
                "SIGKILL the server leader (ZooKeeper, etcd 3-node), restart it"
            }
            Scenario::ServerRestart => {
                "restart Redis node 1 without persistence while a holder is inside"
            }
            Scenario::ReplicaPromotion => {
                "promote a Redis replica that never saw the lock (its replication link cut, then the primary killed)"
            }
            Scenario::ClientCut => {
                "a loopback proxy between the holder and the servers stops forwarding past the session"
            }
            Scenario::SentinelFailover => {
                "SIGKILL the Sentinel group's primary while a holder is inside; Sentinels promote the replica, clients follow"
            }
        }
    }

    fn parse(s: &str) -> anyhow::Result<Scenario> {
        Scenario::ALL
            .into_iter()
            .find(|sc| sc.label() == s.trim())
            .with_context(|| format!("unknown scenario {s:?}; `cargo xtask chaos --list`"))
    }

    fn applies_to(self, kind: Kind) -> bool {
        match self {
            Scenario::LeaderKill => matches!(kind, Kind::Zk | Kind::Etcd),
            Scenario::ServerRestart => matches!(kind, Kind::Redis | Kind::Redlock),
            Scenario::ReplicaPromotion => kind == Kind::Redis,
            // The Sentinel group is there for its failover; the holder faults behave as
            // on `redis`, and a proxy in front of the Sentinels would not cut the data
            // connection.
            Scenario::SentinelFailover => kind == Kind::RedisSentinel,
            _ => kind != Kind::RedisSentinel,
        }
    }

    fn fenced(self) -> bool {
        self != Scenario::HolderPauseUnfenced
    }

    /// How long a slow worker's section works: past the session where the fault must
    /// catch the holder inside for longer than that.
    fn slow_work_ms(self) -> u64 {
        match self {
            Scenario::ClientCut
            | Scenario::ServerRestart
            | Scenario::ReplicaPromotion
            | Scenario::SentinelFailover => 2 * SESSION.as_millis() as u64,
            _ => SLOW_WORK_MS,
        }
    }
}

/// The four workers of every run: (id, via, slow).
const WORKERS: [(u32, &str, bool); 4] = [
    (0, "cli", true),
    (1, "cli", false),
    (2, "lib", true),
    (3, "lib", false),
];

pub(crate) fn run(root: &Path, args: &ChaosArgs) -> anyhow::Result<i32> {
    if args.list {
        for s in Scenario::ALL {
            println!("{:<22} {}", s.label(), s.describe());
        }
        return Ok(0);
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the runtime")?;
    let asked: Vec<Kind> = if args.backends.is_empty() {
        Kind::ALL.to_vec()
    } else {
        args.backends
            .iter()
            .map(|b| parse_kind(b))
            .collect::<anyhow::Result<_>>()?
    };
    let mut kinds = Vec::new();
    let mut notes = Vec::new();
    for k in asked {
        if rt.block_on(available(k)) {
            kinds.push(k);
        } else {
            let note = format!(
                "{}: not run, this build of dlock has no such backend yet",
                k.label()
            );
            eprintln!("xtask chaos: {note}");
            notes.push(note);
        }
    }
    let scenarios: Vec<Scenario> = if !args.scenarios.is_empty() {
        args.scenarios
            .iter()
            .map(|s| Scenario::parse(s))
            .collect::<anyhow::Result<_>>()?
    } else if args.short {
        // The failover runs only on redis-sentinel, where nothing else does.
        vec![
            Scenario::HolderKill,
            Scenario::HolderPause,
            Scenario::SentinelFailover,
        ]
    } else {
        Scenario::ALL.to_vec()
    };
    if kinds.is_empty() {
        bail!("no backend to run");
    }
    let out_dir = crate::target_dir(root).join("chaos");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let dlock = crate::demo::build_dlock(root)?;

    let mut spec = ClusterSpec {
        zk: if kinds.contains(&Kind::Zk) { 3 } else { 0 },
        etcd: if kinds.contains(&Kind::Etcd) { 3 } else { 0 },
        redis: if kinds.contains(&Kind::Redlock) {
            5
        } else if kinds.contains(&Kind::Redis) {
            // A second node to promote in replica-promotion.
            2
        } else {
            0
        },
        sentinel_replicas: u32::from(kinds.contains(&Kind::RedisSentinel)),
        port_offset: args.port_offset,
        state_path: Some(out_dir.join("cluster.json")),
        base_dir: None,
    };
    if let Some(path) = &spec.state_path {
        if path.exists() {
            eprintln!("xtask chaos: stopping servers left by an interrupted chaos run");
            if let Ok(old) = dlock_testkit::State::load(path) {
                old.down().context("stopping leftover servers")?;
            }
        }
    }
    crate::header(&format!(
        "chaos: backends {}, scenarios {}",
        kinds
            .iter()
            .map(|k| k.label())
            .collect::<Vec<_>>()
            .join(", "),
        scenarios
            .iter()
            .map(|s| s.label())
            .collect::<Vec<_>>()
            .join(", ")
    ));
    // Dropped on every way out, panics included: kills the servers.
    let base = args.port_offset;
    let mut cluster = crate::cluster::start_with_progress(
        &mut spec,
        (1..100u16).map(|k| base.saturating_add(k * 37)),
    )?;
    let ctx = Ctx {
        dlock,
        out_dir: out_dir.clone(),
        short: args.short,
    };
    let mut rows = Vec::new();
    let mut failures = Vec::new();
    for &kind in &kinds {
        for &scenario in &scenarios {
            if !scenario.applies_to(kind) {
                continue;
            }
            crate::header(&format!("chaos: {} on {}", scenario.label(), kind.label()));
            match run_one(&ctx, &rt, &mut cluster, kind, scenario) {
                Ok(row) => {
                    eprintln!("{}", report::row_line(&row));
                    failures.extend(row.failures());
                    rows.push(row);
                }
                Err(e) => {
                    let msg = format!("{} on {}: {e:#}", scenario.label(), kind.label());
                    eprintln!("xtask chaos: FAILED {msg}");
                    failures.push(msg);
                }
            }
        }
    }
    cluster.down().context("tearing the cluster down")?;
    let markdown = report::markdown(&rows, &notes);
    println!("{markdown}");
    report::write_summary(&out_dir.join("summary.json"), &rows)?;
    eprintln!("summary: {}", out_dir.join("summary.json").display());
    if !args.short && !args.no_docs {
        let doc = root.join("docs").join("safety.md");
        report::update_doc(&doc, &markdown)?;
        eprintln!("updated {}", doc.display());
    }
    if failures.is_empty() {
        Ok(0)
    } else {
        eprintln!("\nxtask chaos: {} check(s) failed:", failures.len());
        for f in &failures {
            eprintln!("  - {f}");
        }
        Ok(1)
    }
}

struct Ctx {
    dlock: PathBuf,
    out_dir: PathBuf,
    short: bool,
}

/// One worker process (group).
struct Worker {
    id: u32,
    child: Child,
    pgid: i32,
    /// When it was killed or seen to exit.
    gone_at: Option<u64>,
    stopped: bool,
}

/// The running workers; dropping this kills whatever is left.
struct Workers(Vec<Worker>);

impl Workers {
    fn get(&mut self, id: u32) -> anyhow::Result<&mut Worker> {
        self.0
            .iter_mut()
            .find(|w| w.id == id)
            .with_context(|| format!("no worker {id}"))
    }

    fn signal(&mut self, id: u32, sig: Signal) -> anyhow::Result<()> {
        let w = self.get(id)?;
        killpg(Pid::from_raw(w.pgid), sig).with_context(|| format!("{sig} to worker {id}"))?;
        match sig {
            Signal::SIGSTOP => w.stopped = true,
            Signal::SIGCONT => w.stopped = false,
            Signal::SIGKILL => {
                w.gone_at = Some(now_us());
                let _ = w.child.wait();
            }
            _ => {}
        }
        Ok(())
    }

    fn alive(&mut self) -> Vec<u32> {
        let mut ids = Vec::new();
        for w in &mut self.0 {
            if w.gone_at.is_none() && matches!(w.child.try_wait(), Ok(None)) {
                ids.push(w.id);
            }
        }
        ids
    }

    /// Waits for every worker to exit (after the stop file), killing stragglers.
    fn finish(&mut self, limit: Duration) -> Vec<u32> {
        let started = Instant::now();
        let mut killed = Vec::new();
        for w in &mut self.0 {
            if w.gone_at.is_some() {
                continue;
            }
            loop {
                match w.child.try_wait() {
                    Ok(Some(_)) | Err(_) => {
                        w.gone_at = Some(now_us());
                        break;
                    }
                    Ok(None) if started.elapsed() > limit => {
                        let _ = killpg(Pid::from_raw(w.pgid), Signal::SIGKILL);
                        let _ = w.child.wait();
                        w.gone_at = Some(now_us());
                        killed.push(w.id);
                        break;
                    }
                    Ok(None) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        }
        // A CLI worker's `dlock` and section run in its group; make sure none outlives it.
        for w in &self.0 {
            let _ = killpg(Pid::from_raw(w.pgid), Signal::SIGKILL);
        }
        killed
    }

    fn closed(&self) -> HashMap<u32, u64> {
        self.0
            .iter()
            .filter_map(|w| w.gone_at.map(|t| (w.id, t)))
            .collect()
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        for w in &mut self.0 {
            if w.stopped {
                let _ = killpg(Pid::from_raw(w.pgid), Signal::SIGCONT);
            }
            let _ = killpg(Pid::from_raw(w.pgid), Signal::SIGKILL);
            let _ = w.child.wait();
        }
    }
}

fn run_one(
    ctx: &Ctx,
    rt: &tokio::runtime::Runtime,
    cluster: &mut Cluster,
    kind: Kind,
    scenario: Scenario,
) -> anyhow::Result<Row> {
    let dir = ctx
        .out_dir
        .join(format!("{}-{}", kind.label(), scenario.label()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let history_path = dir.join("history.log");
    let stop_path = dir.join("stop");
    let name = format!("chaos/{}/{}", scenario.label(), std::process::id());
    let addrs = cluster_addrs(kind, cluster);
    let url = kind.url(&addrs);
    let store = Store::start(scenario.fenced())?;

    // Victims: the CLI slow worker first, then the library one.
    let victims: Vec<u32> = match (scenario, ctx.short) {
        (Scenario::LeaderKill, true) => vec![u32::MAX],
        (Scenario::LeaderKill, false) => vec![u32::MAX, u32::MAX],
        (Scenario::HolderKill, true) => vec![0],
        (_, true) => vec![2],
        (_, false) => vec![0, 2],
    };
    // Each victim reaches the servers through its own proxies, so a cut hits only it.
    let mut proxies: HashMap<u32, Vec<Proxy>> = HashMap::new();
    if scenario == Scenario::ClientCut {
        for &v in &victims {
            let mut ps = Vec::new();
            for a in &addrs {
                let upstream: SocketAddr = a.parse().with_context(|| format!("address {a}"))?;
                ps.push(Proxy::start(upstream)?);
            }
            proxies.insert(v, ps);
        }
    }

    // Replica promotion: every client reaches Redis through one address that moves to
    // the promoted replica, as a virtual IP (or Sentinel-aware clients) would.
    let vip = match scenario {
        Scenario::ReplicaPromotion => {
            let first = addrs.first().context("no Redis node")?;
            Some(Proxy::start(
                first.parse().with_context(|| format!("address {first}"))?,
            )?)
        }
        _ => None,
    };
    let mut primary = 1;
    let url = match &vip {
        Some(v) => kind.url(&[v.addr().to_string()]),
        None => url,
    };
    let me = std::env::current_exe().context("locating the xtask binary")?;
    let mut workers = Workers(Vec::new());
    for (id, via, slow) in WORKERS {
        let worker_url = match proxies.get(&id) {
            Some(ps) => kind.url(&ps.iter().map(|p| p.addr().to_string()).collect::<Vec<_>>()),
            None => url.clone(),
        };
        let work = if slow {
            scenario.slow_work_ms()
        } else {
            FAST_WORK_MS
        };
        let mut cmd = Command::new(&me);
        cmd.arg("chaos-worker")
            .args(["--via", via])
            .arg("--dlock")
            .arg(&ctx.dlock)
            .args(["--url", &worker_url, "--name", &name])
            .arg("--session-timeout")
            .arg(format!("{}ms", SESSION.as_millis()))
            .arg("--stop")
            .arg(&stop_path)
            .args(["--worker", &id.to_string()])
            .args(["--store", &store.addr().to_string()])
            .arg("--history")
            .arg(&history_path)
            .args(["--work-ms", &work.to_string()])
            .stdin(Stdio::null())
            .stderr(Stdio::from(
                std::fs::File::create(dir.join(format!("worker{id}.log")))
                    .context("creating a worker log")?,
            ))
            .process_group(0);
        let child = cmd.spawn().context("starting a worker")?;
        let pgid = i32::try_from(child.id()).context("pid")?;
        workers.0.push(Worker {
            id,
            child,
            pgid,
            gone_at: None,
            stopped: false,
        });
    }

    let started = now_us();
    let h = || history::read(&history_path);
    let ends = |after: u64| -> anyhow::Result<usize> {
        Ok(h()?
            .iter()
            .filter(|r| matches!(r, Record::End { at_us, .. } if *at_us > after))
            .count())
    };
    wait_for("8 warm-up sections", WAIT, || Ok(ends(0)? >= 8))?;

    let mut faults = Vec::new();
    let mut notes = Vec::new();
    for &victim in &victims {
        let fault = inject(
            scenario,
            kind,
            cluster,
            &mut workers,
            &proxies,
            vip.as_ref(),
            &mut primary,
            victim,
            &history_path,
        )?;
        faults.push(fault);
        // Let the others run a few sections after the fault.
        let after = now_us();
        let alive = workers.alive();
        let r = wait_for("8 sections after the fault", WAIT, || Ok(ends(after)? >= 8));
        if let Err(e) = r {
            notes.push(format!("{e:#} (alive workers {alive:?})"));
        }
    }

    // Many sections per run, whatever the faults left running.
    let want = if ctx.short { 20 } else { 50 };
    // A shortfall is reported, not failed: the faults themselves were checked above.
    if let Err(e) = wait_for(&format!("{want} sections in all"), WAIT, || {
        Ok(ends(0)? >= want)
    }) {
        eprintln!("  note: {e:#}");
    }
    std::fs::write(&stop_path, "").context("writing the stop file")?;
    let killed = workers.finish(WAIT);
    if !killed.is_empty() {
        notes.push(format!("workers {killed:?} did not stop and were killed"));
    }
    let run_end = now_us();
    // Every client has gone: nothing may remain under the lock once the killed clients'
    // sessions have expired.
    let leaked = rt.block_on(leftovers(&url, &name))?;
    let records = h()?;
    let verdict = history::check(&records, &faults, &workers.closed(), run_end);
    drop(proxies);
    Ok(Row {
        scenario: scenario.label().to_string(),
        backend: kind.label().to_string(),
        fenced: scenario.fenced(),
        // Only the library victim writes without looking at its lost signal; with it in
        // the run, a late write must reach the store.
        expects_stale_write: matches!(
            scenario,
            Scenario::HolderPause | Scenario::HolderPauseUnfenced
        ) && victims.contains(&2),
        verdict,
        store: store.stats(),
        leaked,
        faults: faults.len(),
        seconds: (run_end.saturating_sub(started)) / 1_000_000,
        notes,
    })
}

/// Polls `cond` every 20 ms until it holds or `limit` passes.
fn wait_for(
    what: &str,
    limit: Duration,
    mut cond: impl FnMut() -> anyhow::Result<bool>,
) -> anyhow::Result<()> {
    let started = Instant::now();
    loop {
        if cond()? {
            return Ok(());
        }
        if started.elapsed() > limit {
            bail!("timed out after {limit:?} waiting for {what}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// True once a worker other than `victim` began a section after `t`.
fn other_began(records: &[Record], victim: u32, t: u64) -> bool {
    records.iter().any(
        |r| matches!(r, Record::Begin { worker, at_us, .. } if *worker != victim && *at_us > t),
    )
}

fn victim_lost_after(records: &[Record], victim: u32, t: u64) -> bool {
    records.iter().any(
        |r| matches!(r, Record::Lost { worker, at_us, .. } if *worker == victim && *at_us >= t),
    )
}

/// Injects one fault of `scenario` and waits until the lock serves another worker.
// Each argument is a different handle of the run (servers, processes, proxies, history);
// bundling them would only rename the list.
#[allow(clippy::too_many_arguments)]
fn inject(
    scenario: Scenario,
    kind: Kind,
    cluster: &mut Cluster,
    workers: &mut Workers,
    proxies: &HashMap<u32, Vec<Proxy>>,
    vip: Option<&Proxy>,
    primary: &mut u32,
    victim: u32,
    history_path: &Path,
) -> anyhow::Result<Fault> {
    let h = || history::read(history_path);
    let wait_inside = |what: &str| wait_for(what, WAIT, || Ok(history::in_section(&h()?, victim)));
    match scenario {
        Scenario::HolderKill => {
            wait_inside("the victim inside its section")?;
            let t = now_us();
            workers.signal(victim, Signal::SIGKILL)?;
            eprintln!("  killed worker {victim} inside its section");
            wait_for("another holder after the kill", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            })?;
            Ok(Fault {
                at_us: t,
                victim: Some(victim),
                signal_from_us: None,
            })
        }
        Scenario::HolderPause | Scenario::HolderPauseUnfenced => {
            wait_inside("the victim inside its section")?;
            let t = now_us();
            workers.signal(victim, Signal::SIGSTOP)?;
            let stopped = Instant::now();
            let taken = wait_for("another holder while paused", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            });
            // Stay paused past two sessions whatever happened, like a long GC pause.
            let min = 2 * SESSION + Duration::from_secs(1);
            if let Some(rest) = min.checked_sub(stopped.elapsed()) {
                std::thread::sleep(rest);
            }
            let resumed = now_us();
            workers.signal(victim, Signal::SIGCONT)?;
            eprintln!(
                "  paused worker {victim} for {:.1?} inside its section",
                stopped.elapsed()
            );
            taken?;
            // The resumed section finishes (its write is judged by the store) or its
            // dlock stops it.
            wait_for("the resumed section to end", WAIT, || {
                Ok(!history::in_section(&h()?, victim) || !workers.alive().contains(&victim))
            })?;
            Ok(Fault {
                at_us: t,
                victim: Some(victim),
                signal_from_us: Some(resumed),
            })
        }
        Scenario::LeaderKill => {
            let server = kind.server();
            let leader = cluster.wait_leader(server, WAIT)?;
            let t = now_us();
            cluster.kill(server, leader)?;
            eprintln!("  killed {server} leader (node {leader})");
            let recovered = wait_for("a holder after the leader kill", WAIT, || {
                Ok(other_began(&h()?, u32::MAX, t))
            });
            cluster.restart(server, leader)?;
            eprintln!("  restarted node {leader}");
            recovered?;
            Ok(Fault {
                at_us: t,
                victim: None,
                signal_from_us: None,
            })
        }
        Scenario::ServerRestart => {
            wait_inside("the victim inside its section")?;
            let t = now_us();
            cluster.restart(Backend::Redis, 1)?;
            eprintln!("  restarted Redis node 1 (no persistence) under worker {victim}");
            wait_for("another holder after the restart", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            })?;
            Ok(Fault {
                at_us: t,
                victim: Some(victim),
                signal_from_us: Some(t),
            })
        }
        Scenario::ReplicaPromotion => {
            let vip = vip.context("replica promotion without its proxy")?;
            let p = *primary;
            let r = if p == 1 { 2 } else { 1 };
            let p_addr = cluster.server(Backend::Redis, p)?.addr.clone();
            let r_addr = cluster.server(Backend::Redis, r)?.addr.clone();
            // The replica follows the primary through a proxy, so the stream can be cut
            // for real. A SIGSTOP of the replica would not do: the kernel keeps taking
            // the stream into the stopped process's socket buffer, and the replica
            // applies all of it when it resumes, holds included.
            let link = Proxy::start(
                p_addr
                    .parse()
                    .with_context(|| format!("address {p_addr}"))?,
            )?;
            let link_addr = link.addr();
            redis_cli(&p_addr, &["CONFIG", "SET", "repl-diskless-sync-delay", "0"])?;
            redis_cli(
                &r_addr,
                &[
                    "REPLICAOF",
                    &link_addr.ip().to_string(),
                    &link_addr.port().to_string(),
                ],
            )?;
            wait_for("the replica in sync", WAIT, || {
                Ok(redis_cli(&r_addr, &["INFO", "replication"])?.contains("master_link_status:up"))
            })?;
            // From here the replica sees none of the primary's writes.
            link.cut();
            let stopped = now_us();
            // The victim must hold an entry it created after the stop: its next section
            // after one that ended after the stop (every section is a new entry).
            wait_for(
                "the victim inside a section it queued for after the replica stopped",
                WAIT,
                || {
                    let secs = history::sections(&h()?);
                    let Some(first_end) = secs
                        .iter()
                        .filter(|s| s.worker == victim)
                        .filter_map(|s| s.end_us.filter(|&e| e > stopped))
                        .min()
                    else {
                        return Ok(false);
                    };
                    Ok(secs.iter().any(|s| {
                        s.worker == victim && s.start_us > first_end && s.end_us.is_none()
                    }))
                },
            )?;
            let t = now_us();
            cluster.kill(Backend::Redis, p)?;
            redis_cli(&r_addr, &["REPLICAOF", "NO", "ONE"])?;
            drop(link);
            vip.retarget(
                r_addr
                    .parse()
                    .with_context(|| format!("address {r_addr}"))?,
            )?;
            eprintln!(
                "  killed primary (node {p}) under worker {victim}; promoted node {r}, which never saw the hold"
            );
            *primary = r;
            let recovered = wait_for("another holder on the promoted replica", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            });
            // The old primary comes back empty, ready to be the next round's replica.
            cluster.restart(Backend::Redis, p)?;
            recovered?;
            Ok(Fault {
                at_us: t,
                victim: Some(victim),
                signal_from_us: Some(t),
            })
        }
        Scenario::SentinelFailover => {
            let primary = cluster.wait_sentinel_group(WAIT)?;
            wait_inside("the victim inside its section")?;
            let t = now_us();
            cluster.kill(Backend::RedisHa, primary)?;
            let promoted = cluster.wait_failover(primary, WAIT)?;
            eprintln!(
                "  killed the primary (node {primary}) under worker {victim}; the Sentinels promoted node {promoted} after {} ms",
                (now_us() - t) / 1000
            );
            let recovered = wait_for("another holder after the failover", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            });
            // Back only after the promotion (an empty master brought back earlier would
            // be kept as the primary), and whole again before the next fault.
            cluster.restart(Backend::RedisHa, primary)?;
            cluster.wait_sentinel_group(WAIT)?;
            recovered?;
            Ok(Fault {
                at_us: t,
                victim: Some(victim),
                // The lost signal is measured from the kill.
                signal_from_us: Some(t),
            })
        }
        Scenario::ClientCut => {
            let ps = proxies.get(&victim).context("victim without proxies")?;
            wait_inside("the victim inside its section")?;
            let t = now_us();
            for p in ps {
                p.cut();
            }
            eprintln!("  cut worker {victim} off from the servers");
            let r = wait_for("the victim's lost signal and another holder", WAIT, || {
                let recs = h()?;
                Ok(other_began(&recs, victim, t) && victim_lost_after(&recs, victim, t))
            });
            for p in ps {
                p.restore();
            }
            r?;
            Ok(Fault {
                at_us: t,
                victim: Some(victim),
                signal_from_us: Some(t),
            })
        }
    }
}

/// Runs `redis-cli` against `addr` and returns its output; a Redis error is an error.
fn redis_cli(addr: &str, args: &[&str]) -> anyhow::Result<String> {
    let (host, port) = addr.rsplit_once(':').context("address")?;
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", port])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running redis-cli")?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() || text.starts_with("ERR") {
        bail!("redis-cli -p {port} {}: {text}", args.join(" "));
    }
    Ok(text)
}

/// Entries left under `name` once every client has gone, after waiting out the sessions
/// of the killed ones.
async fn leftovers(url: &str, name: &str) -> anyhow::Result<usize> {
    let opts = dlock::SessionOptions::default().with_session_timeout(SESSION);
    let client = dlock::connect_with(url, opts)
        .await
        .with_context(|| format!("connecting to {url} for the leak check"))?;
    let deadline = Instant::now() + SESSION * 5 + Duration::from_secs(10);
    let left = loop {
        let parts = client
            .participants(name)
            .await
            .with_context(|| format!("reading the participants of {name}"))?;
        if parts.is_empty() || Instant::now() > deadline {
            break parts.len();
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = client.close().await;
    Ok(left)
}
