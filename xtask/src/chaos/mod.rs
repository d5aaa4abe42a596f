//! `cargo xtask chaos`: what dlock does when the things distributed locks fail on happen,
//! on real servers with real processes.
//!
//! A run is a list of rounds; a round is one scenario on one backend, with every recipe
//! side by side ([`Recipe`]): per recipe, worker processes (two through the `dlock` CLI
//! and two through the library for the mutex, two or three through the library for the
//! others) take their lock again and again; each critical section logs its start, its
//! end and how it held ([`history`]) and writes to its recipe's fenced store ([`store`])
//! with its token. Inject the faults, let the workers run on, stop them, check that no
//! entry is left under any lock, and check each history: overlaps of two holders, token
//! order, stale writes the store accepted, lost signals and their margin before the next
//! grant, recovery time. Any overlap, token-order violation, stale write accepted or
//! entry left fails the run.
//!
//! Every random choice (a round's scenario, its victims, when in a section the fault
//! hits, how long a pause lasts) comes from the round's seed, printed with the round; a
//! failing round prints the command that replays it. The table goes to stdout
//! (markdown), `target/chaos/summary.json` (one row per backend x scenario x recipe) and,
//! for a full run, `docs/safety.md`.

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
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use self::history::{now_us, Fault, Mode, Record, Rules};
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
pub(crate) const SLOW_WORK_MS: u64 = 300;

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
    ClientCut,
    LeaderKill,
    LeaderPause,
    LeaderCut,
    ServerRestart,
    ClockJump,
    ReplicaPromotion,
    SentinelFailover,
}

impl Scenario {
    const ALL: [Scenario; 10] = [
        Scenario::HolderKill,
        Scenario::HolderPause,
        Scenario::ClientCut,
        Scenario::LeaderKill,
        Scenario::LeaderPause,
        Scenario::LeaderCut,
        Scenario::ServerRestart,
        Scenario::ClockJump,
        Scenario::ReplicaPromotion,
        Scenario::SentinelFailover,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Scenario::HolderKill => "holder-kill",
            Scenario::HolderPause => "holder-pause",
            Scenario::ClientCut => "client-cut",
            Scenario::LeaderKill => "leader-kill",
            Scenario::LeaderPause => "leader-pause",
            Scenario::LeaderCut => "leader-cut",
            Scenario::ServerRestart => "server-restart",
            Scenario::ClockJump => "clock-jump",
            Scenario::ReplicaPromotion => "replica-promotion",
            Scenario::SentinelFailover => "sentinel-failover",
        }
    }

    fn describe(self) -> &'static str {
        match self {
            Scenario::HolderKill => "SIGKILL the holder (its process group) inside its section",
            Scenario::HolderPause => {
                "SIGSTOP the holder inside its section past two sessions, SIGCONT; the fenced store judges its late write"
            }
            Scenario::ClientCut => {
                "a loopback proxy between the holder and the servers stops forwarding past the session"
            }
            Scenario::LeaderKill => {
                "SIGKILL the server leader (ZooKeeper, etcd 3-node), restart it"
            }
            Scenario::LeaderPause => {
                "SIGSTOP the server leader (ZooKeeper, etcd 3-node) past two sessions, SIGCONT"
            }
            Scenario::LeaderCut => {
                "cut the ZooKeeper leader off from the quorum (nftables) past two sessions, heal"
            }
            Scenario::ServerRestart => {
                "restart Redis node 1 without persistence while a holder is inside"
            }
            Scenario::ClockJump => {
                "Redis node 1 expires keys as if its clock jumped forward by 1.5 sessions (every TTL shortened at once) while a holder is inside"
            }
            Scenario::ReplicaPromotion => {
                "promote a Redis replica that never saw the lock (its replication link cut, then the primary killed)"
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
            Scenario::LeaderKill | Scenario::LeaderPause => matches!(kind, Kind::Zk | Kind::Etcd),
            Scenario::LeaderCut => kind == Kind::Zk,
            Scenario::ServerRestart | Scenario::ClockJump => {
                matches!(kind, Kind::Redis | Kind::Redlock)
            }
            Scenario::ReplicaPromotion => kind == Kind::Redis,
            // The Sentinel group is there for its failover; the holder faults behave as
            // on `redis`, and a proxy in front of the Sentinels would not cut the data
            // connection.
            Scenario::SentinelFailover => kind == Kind::RedisSentinel,
            Scenario::HolderKill | Scenario::HolderPause | Scenario::ClientCut => {
                kind != Kind::RedisSentinel
            }
        }
    }

    /// Whether the fault hits one worker per recipe (else the servers, under everyone).
    fn hits_holders(self) -> bool {
        matches!(
            self,
            Scenario::HolderKill | Scenario::HolderPause | Scenario::ClientCut
        )
    }

    /// Whether `kind` promises mutual exclusion under this fault. One Redis server
    /// (`redis://`, and `redis+sentinel://`, whose replication is asynchronous) does not
    /// when it forgets its keys: a restart without persistence, a replica promoted before
    /// it saw the lock. Redlock keeps its majority when one master of five restarts.
    fn guaranteed_on(self, kind: Kind) -> bool {
        !matches!(
            (self, kind),
            (Scenario::ServerRestart, Kind::Redis)
                | (Scenario::ClockJump, Kind::Redis)
                | (Scenario::ReplicaPromotion, Kind::Redis)
                | (Scenario::SentinelFailover, Kind::RedisSentinel)
        )
    }

    /// How long a slow worker's section works: past the session where the fault must
    /// catch the holder inside for longer than that.
    fn slow_work_ms(self) -> u64 {
        match self {
            Scenario::ClientCut
            | Scenario::ServerRestart
            | Scenario::ClockJump
            | Scenario::ReplicaPromotion
            | Scenario::SentinelFailover => 2 * SESSION.as_millis() as u64,
            _ => SLOW_WORK_MS,
        }
    }
}

/// A recipe under faults: each runs beside the others, on a lock of its own, with its own
/// workers, history and fenced store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recipe {
    Mutex,
    /// The mutex, each section on a nested re-entry of the hold.
    ReentrantMutex,
    SemaphoreMutex,
    /// Writers that downgrade to a read hold, and readers.
    RwLock,
    /// Holders never above its permits.
    Semaphore,
    /// Two mutexes taken all-or-nothing.
    MultiLock,
}

impl Recipe {
    const ALL: [Recipe; 6] = [
        Recipe::Mutex,
        Recipe::ReentrantMutex,
        Recipe::SemaphoreMutex,
        Recipe::RwLock,
        Recipe::Semaphore,
        Recipe::MultiLock,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Recipe::Mutex => "mutex",
            Recipe::ReentrantMutex => "reentrant-mutex",
            Recipe::SemaphoreMutex => "semaphore-mutex",
            Recipe::RwLock => "rwlock",
            Recipe::Semaphore => "semaphore",
            Recipe::MultiLock => "multi-lock",
        }
    }

    pub(crate) fn parse(s: &str) -> anyhow::Result<Recipe> {
        Recipe::ALL
            .into_iter()
            .find(|r| r.label() == s.trim())
            .with_context(|| {
                format!("unknown recipe {s:?}: expected mutex, reentrant-mutex, semaphore-mutex, rwlock, semaphore or multi-lock")
            })
    }

    /// The semaphore's permits (1 for the exclusive recipes).
    fn permits(self) -> u32 {
        match self {
            Recipe::Semaphore => 2,
            _ => 1,
        }
    }

    /// The lock names its workers take (the multi-lock's two parts).
    fn names(self, base: &str) -> Vec<String> {
        match self {
            Recipe::MultiLock => vec![format!("{base}/a"), format!("{base}/b")],
            _ => vec![base.to_string()],
        }
    }

    /// Its workers: (via, slow). The slow ones are the victims. The mutex has CLI workers
    /// too; a semaphore of two permits has three workers, so one always waits.
    fn workers(self) -> &'static [(&'static str, bool)] {
        match self {
            Recipe::Mutex => &[("cli", true), ("cli", false), ("lib", true), ("lib", false)],
            Recipe::Semaphore => &[("lib", true), ("lib", false), ("lib", false)],
            _ => &[("lib", true), ("lib", false)],
        }
    }
}

/// One round: a scenario on a backend, every random choice drawn from `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Round {
    kind: Kind,
    scenario: Scenario,
    seed: u64,
}

/// Round `i`'s seed: `seed` itself for round 0, so a printed round seed replays alone.
fn round_seed(seed: u64, i: u32) -> u64 {
    if i == 0 {
        return seed;
    }
    // SplitMix64's mixer: well-spread seeds from consecutive indexes.
    let mut z = seed.wrapping_add(u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rounds of a run: with `rounds`, round i runs backend i (mod the backends) and a
/// scenario drawn from its seed; without, every backend x scenario once.
fn plan(kinds: &[Kind], scenarios: &[Scenario], seed: u64, rounds: Option<u32>) -> Vec<Round> {
    match rounds {
        Some(n) => (0..n)
            .filter_map(|i| {
                let kind = kinds[i as usize % kinds.len()];
                let seed = round_seed(seed, i);
                let fits: Vec<Scenario> = scenarios
                    .iter()
                    .copied()
                    .filter(|s| s.applies_to(kind))
                    .collect();
                if fits.is_empty() {
                    return None;
                }
                let scenario = fits[StdRng::seed_from_u64(seed).gen_range(0..fits.len())];
                Some(Round {
                    kind,
                    scenario,
                    seed,
                })
            })
            .collect(),
        None => {
            let mut out = Vec::new();
            let mut i = 0;
            for &kind in kinds {
                for &scenario in scenarios.iter().filter(|s| s.applies_to(kind)) {
                    out.push(Round {
                        kind,
                        scenario,
                        seed: round_seed(seed, i),
                    });
                    i += 1;
                }
            }
            out
        }
    }
}

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
    let recipes: Vec<Recipe> = if args.recipes.is_empty() {
        Recipe::ALL.to_vec()
    } else {
        args.recipes
            .iter()
            .map(|r| Recipe::parse(r))
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
    } else {
        Scenario::ALL.to_vec()
    };
    if kinds.is_empty() {
        bail!("no backend to run");
    }
    let seed = args
        .seed
        .unwrap_or_else(|| now_us() ^ u64::from(std::process::id()));
    let rounds = args
        .rounds
        .or(args.short.then(|| u32::try_from(kinds.len()).unwrap_or(1)));
    let plan = plan(&kinds, &scenarios, seed, rounds);
    if plan.is_empty() {
        bail!("no scenario asked applies to the backends asked");
    }
    let out_dir = crate::target_dir(root).join("chaos");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let dlock = crate::demo::build_dlock(root)?;

    let used: Vec<Kind> = kinds
        .iter()
        .copied()
        .filter(|k| plan.iter().any(|r| r.kind == *k))
        .collect();
    let mut spec = ClusterSpec {
        zk: if used.contains(&Kind::Zk) { 3 } else { 0 },
        etcd: if used.contains(&Kind::Etcd) { 3 } else { 0 },
        redis: if used.contains(&Kind::Redlock) {
            5
        } else if used.contains(&Kind::Redis) {
            // A second node to promote in replica-promotion.
            2
        } else {
            0
        },
        sentinel_replicas: u32::from(used.contains(&Kind::RedisSentinel)),
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
        "chaos: seed {seed}, {} round(s), recipes {}",
        plan.len(),
        recipes
            .iter()
            .map(|r| r.label())
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
        recipes,
    };
    let mut rows: Vec<Row> = Vec::new();
    let mut failures = Vec::new();
    for (i, round) in plan.iter().enumerate() {
        crate::header(&format!(
            "chaos round {i}: {} on {} (seed {})",
            round.scenario.label(),
            round.kind.label(),
            round.seed
        ));
        let replay = format!(
            "cargo xtask chaos --backend {} --scenario {} --seed {}{}",
            round.kind.label(),
            round.scenario.label(),
            round.seed,
            if args.recipes.is_empty() {
                String::new()
            } else {
                format!(" --recipe {}", args.recipes.join(","))
            }
        );
        let found = match run_round(&ctx, &rt, &mut cluster, *round) {
            Ok(got) => {
                let mut found = Vec::new();
                for row in got {
                    eprintln!("{}", report::row_line(&row));
                    found.extend(row.failures());
                    report::merge(&mut rows, row);
                }
                found
            }
            Err(e) => vec![format!(
                "{} on {}: {e:#}",
                round.scenario.label(),
                round.kind.label()
            )],
        };
        if !found.is_empty() {
            for f in &found {
                eprintln!("xtask chaos: FAILED {f}");
            }
            eprintln!("xtask chaos: replay this round with: {replay}");
            failures.extend(found.into_iter().map(|f| format!("{f} (replay: {replay})")));
        }
    }
    cluster.down().context("tearing the cluster down")?;
    let markdown = report::markdown(&rows, &notes, seed, plan.len());
    println!("{markdown}");
    report::write_summary(&out_dir.join("summary.json"), &rows)?;
    eprintln!("summary: {}", out_dir.join("summary.json").display());
    if !args.short && !args.no_docs && rounds.is_none() {
        let doc = root.join("docs").join("safety.md");
        report::update_doc(&doc, &markdown)?;
        eprintln!("updated {}", doc.display());
    }
    if failures.is_empty() {
        Ok(0)
    } else {
        eprintln!(
            "\nxtask chaos: {} check(s) failed (seed {seed}):",
            failures.len()
        );
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
    recipes: Vec<Recipe>,
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

/// One recipe's lock, workers, history and store in a round.
struct Group {
    recipe: Recipe,
    name: String,
    history: PathBuf,
    store: Store,
    /// Its workers' ids, and whether each is slow (a victim candidate).
    ids: Vec<(u32, bool)>,
    /// The workers the round's holder faults hit, in order.
    victims: Vec<u32>,
    faults: Vec<Fault>,
    /// A paused library holder's late write must reach the store and be rejected:
    /// without one, the run did not exercise what fencing is for.
    expects_stale_write: bool,
}

impl Group {
    fn records(&self) -> anyhow::Result<Vec<Record>> {
        history::read(&self.history)
    }

    fn ends_after(&self, after: u64) -> anyhow::Result<usize> {
        Ok(self
            .records()?
            .iter()
            .filter(|r| matches!(r, Record::End { at_us, .. } if *at_us > after))
            .count())
    }

    fn via(&self, id: u32) -> &'static str {
        let k = (id % 10) as usize;
        self.recipe.workers().get(k).map(|w| w.0).unwrap_or("lib")
    }
}

/// Runs one round: every recipe's workers side by side, the faults, the checks; one row
/// per recipe.
fn run_round(
    ctx: &Ctx,
    rt: &tokio::runtime::Runtime,
    cluster: &mut Cluster,
    round: Round,
) -> anyhow::Result<Vec<Row>> {
    let Round {
        kind,
        scenario,
        seed,
    } = round;
    let mut rng = StdRng::seed_from_u64(seed);
    let dir = ctx
        .out_dir
        .join(format!("{}-{}", kind.label(), scenario.label()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let stop_path = dir.join("stop");
    let addrs = cluster_addrs(kind, cluster);

    let mut groups = Vec::new();
    for (g, &recipe) in ctx.recipes.iter().enumerate() {
        let ids: Vec<(u32, bool)> = recipe
            .workers()
            .iter()
            .enumerate()
            .map(|(k, &(_, slow))| (g as u32 * 10 + k as u32, slow))
            .collect();
        let slow: Vec<u32> = ids.iter().filter(|w| w.1).map(|w| w.0).collect();
        // Holder faults: every slow worker in a full run; one drawn at random otherwise.
        let victims = if !scenario.hits_holders() {
            Vec::new()
        } else if ctx.short || slow.len() == 1 {
            vec![slow[rng.gen_range(0..slow.len())]]
        } else {
            slow
        };
        groups.push(Group {
            recipe,
            name: format!(
                "chaos/{}/{}/{}",
                scenario.label(),
                recipe.label(),
                std::process::id()
            ),
            history: dir.join(format!("{}.history.log", recipe.label())),
            store: Store::start(true)?,
            ids,
            victims,
            faults: Vec::new(),
            expects_stale_write: false,
        });
    }

    // Each victim reaches the servers through its own proxies, so a cut hits only it.
    let mut proxies: HashMap<u32, Vec<Proxy>> = HashMap::new();
    if scenario == Scenario::ClientCut {
        for v in groups.iter().flat_map(|g| g.victims.iter().copied()) {
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
        None => kind.url(&addrs),
    };

    let me = std::env::current_exe().context("locating the xtask binary")?;
    let mut workers = Workers(Vec::new());
    for g in &groups {
        for &(id, slow) in &g.ids {
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
                .args(["--via", g.via(id)])
                .arg("--dlock")
                .arg(&ctx.dlock)
                .args(["--url", &worker_url, "--name", &g.name])
                .args(["--recipe", g.recipe.label()])
                .args(["--permits", &g.recipe.permits().to_string()])
                .arg("--session-timeout")
                .arg(format!("{}ms", SESSION.as_millis()))
                .arg("--stop")
                .arg(&stop_path)
                .args(["--worker", &id.to_string()])
                .args(["--store", &g.store.addr().to_string()])
                .arg("--history")
                .arg(&g.history)
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
    }

    let started = now_us();
    for g in &groups {
        wait_for(
            &format!("4 warm-up sections of {}", g.recipe.label()),
            WAIT,
            || Ok(g.ends_after(0)? >= 4),
        )?;
    }

    let mut notes = Vec::new();
    if scenario.hits_holders() {
        for (gi, g) in groups.iter_mut().enumerate() {
            let victims = g.victims.clone();
            for victim in victims {
                let hit = inject_holder(scenario, g, &mut workers, &proxies, victim, &mut rng)?;
                if hit.exercised_fence && g.via(victim) == "lib" {
                    g.expects_stale_write = true;
                }
                g.faults.push(hit.fault);
                let after = now_us();
                let r = wait_for(
                    &format!("4 sections of {} after the fault", g.recipe.label()),
                    WAIT,
                    || Ok(g.ends_after(after)? >= 4),
                );
                if let Err(e) = r {
                    notes.push((gi, format!("{e:#} (alive workers {:?})", workers.alive())));
                }
            }
        }
    } else {
        let count = if ctx.short { 1 } else { 2 };
        for _ in 0..count {
            // The fault waits until this recipe's victim is inside, where that matters.
            let anchor = rng.gen_range(0..groups.len());
            let slow: Vec<u32> = groups[anchor]
                .ids
                .iter()
                .filter(|w| w.1)
                .map(|w| w.0)
                .collect();
            let victim = slow[rng.gen_range(0..slow.len())];
            let fault = inject_server(
                scenario,
                kind,
                cluster,
                &groups,
                &groups[anchor],
                vip.as_ref(),
                &mut primary,
                victim,
                &mut rng,
            )?;
            for (gi, g) in groups.iter_mut().enumerate() {
                let mut f = fault.clone();
                if gi != anchor {
                    f.victim = None;
                    f.measure_margin = false;
                }
                g.faults.push(f);
            }
            let after = now_us();
            for (gi, g) in groups.iter().enumerate() {
                let r = wait_for(
                    &format!("4 sections of {} after the fault", g.recipe.label()),
                    WAIT,
                    || Ok(g.ends_after(after)? >= 4),
                );
                if let Err(e) = r {
                    notes.push((gi, format!("{e:#} (alive workers {:?})", workers.alive())));
                }
            }
        }
    }

    // Many sections per recipe, whatever the faults left running. A shortfall is
    // reported, not failed: the faults themselves were checked above.
    let want = if ctx.short { 10 } else { 20 };
    for g in &groups {
        if let Err(e) = wait_for(
            &format!("{want} sections of {} in all", g.recipe.label()),
            WAIT,
            || Ok(g.ends_after(0)? >= want),
        ) {
            eprintln!("  note: {e:#}");
        }
    }
    std::fs::write(&stop_path, "").context("writing the stop file")?;
    let killed = workers.finish(WAIT);
    let run_end = now_us();
    drop(proxies);
    let closed = workers.closed();
    let mut rows = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        // Every client has gone: nothing may remain under the lock once the killed
        // clients' sessions have expired.
        let mut leaked = 0;
        for name in g.recipe.names(&g.name) {
            leaked += rt.block_on(leftovers(&url, &name))?;
        }
        let rules = Rules {
            permits: g.recipe.permits(),
            pause_hold_us: u64::try_from(SESSION.as_micros() / 2).unwrap_or(u64::MAX),
        };
        let verdict = history::check(&g.records()?, &g.faults, &closed, run_end, rules);
        let mut row_notes: Vec<String> = notes
            .iter()
            .filter(|(i, _)| *i == gi)
            .map(|(_, n)| n.clone())
            .collect();
        let mine: Vec<u32> = killed
            .iter()
            .copied()
            .filter(|id| g.ids.iter().any(|w| w.0 == *id))
            .collect();
        if !mine.is_empty() {
            row_notes.push(format!("workers {mine:?} did not stop and were killed"));
        }
        rows.push(Row {
            scenario: scenario.label().to_string(),
            backend: kind.label().to_string(),
            recipe: g.recipe.label().to_string(),
            guaranteed: scenario.guaranteed_on(kind),
            expects_stale_write: g.expects_stale_write,
            verdict,
            store: g.store.stats(),
            leaked,
            faults: g.faults.len(),
            seconds: (run_end.saturating_sub(started)) / 1_000_000,
            seeds: vec![seed],
            notes: row_notes,
        });
    }
    Ok(rows)
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

/// True while `worker` is inside a section begun after `since` that writes to the fenced
/// store (any section, for a semaphore's permit holders, which never write). Waiting for
/// a fresh section puts the fault near its start: a fault that hits a section about to
/// end tests little.
fn inside_writing(records: &[Record], worker: u32, recipe: Recipe, since: u64) -> bool {
    history::sections(records).iter().any(|s| {
        s.worker == worker
            && s.start_us > since
            && s.end_us.is_none()
            && (s.mode == Mode::Exclusive || recipe == Recipe::Semaphore)
    })
}

/// A holder fault as injected.
struct Hit {
    fault: Fault,
    /// A paused holder was inside a section that writes to the fenced store: its late
    /// write must reach the store.
    exercised_fence: bool,
}

/// Injects one holder fault of `scenario` on `victim` (of `group`), at a moment inside its
/// section drawn from `rng`, and waits until the lock serves another worker.
fn inject_holder(
    scenario: Scenario,
    group: &Group,
    workers: &mut Workers,
    proxies: &HashMap<u32, Vec<Proxy>>,
    victim: u32,
    rng: &mut StdRng,
) -> anyhow::Result<Hit> {
    let h = || group.records();
    let recipe = group.recipe;
    let since = now_us();
    wait_for("the victim inside a new section", WAIT, || {
        Ok(inside_writing(&h()?, victim, recipe, since))
    })?;
    // When in the section the fault hits: the slow section lasts at least 300 ms.
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..150)));
    let inside = inside_writing(&h()?, victim, recipe, since);
    match scenario {
        Scenario::HolderKill => {
            let t = now_us();
            workers.signal(victim, Signal::SIGKILL)?;
            eprintln!("  {}: killed worker {victim}", recipe.label());
            wait_for("another holder after the kill", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            })?;
            Ok(Hit {
                fault: Fault {
                    at_us: t,
                    victim: Some(victim),
                    signal_from_us: None,
                    paused: false,
                    measure_margin: false,
                },
                exercised_fence: false,
            })
        }
        Scenario::HolderPause => {
            let t = now_us();
            workers.signal(victim, Signal::SIGSTOP)?;
            let stopped = Instant::now();
            let taken = wait_for("another holder while paused", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            });
            // Stay paused past two sessions whatever happened, like a long GC pause.
            let min = 2 * SESSION + Duration::from_millis(rng.gen_range(1000..2000));
            if let Some(rest) = min.checked_sub(stopped.elapsed()) {
                std::thread::sleep(rest);
            }
            let resumed = now_us();
            workers.signal(victim, Signal::SIGCONT)?;
            eprintln!(
                "  {}: paused worker {victim} for {:.1?}",
                recipe.label(),
                stopped.elapsed()
            );
            taken?;
            // The resumed section finishes (its write is judged by the store) or its
            // dlock stops it.
            wait_for("the resumed section to end", WAIT, || {
                Ok(!history::in_section(&h()?, victim) || !workers.alive().contains(&victim))
            })?;
            Ok(Hit {
                fault: Fault {
                    at_us: t,
                    victim: Some(victim),
                    signal_from_us: Some(resumed),
                    paused: true,
                    measure_margin: false,
                },
                exercised_fence: inside && recipe != Recipe::Semaphore,
            })
        }
        Scenario::ClientCut => {
            let ps = proxies.get(&victim).context("victim without proxies")?;
            let t = now_us();
            for p in ps {
                p.cut();
            }
            eprintln!(
                "  {}: cut worker {victim} off from the servers",
                recipe.label()
            );
            let r = wait_for("the victim's lost signal and another holder", WAIT, || {
                let recs = h()?;
                // A victim still inside its section must be told; one whose section
                // ended first had nothing to lose.
                Ok(other_began(&recs, victim, t)
                    && (victim_lost_after(&recs, victim, t) || !history::in_section(&recs, victim)))
            });
            for p in ps {
                p.restore();
            }
            r?;
            Ok(Hit {
                fault: Fault {
                    at_us: t,
                    victim: Some(victim),
                    signal_from_us: Some(t),
                    paused: false,
                    // A free permit may go to another worker at once: the margin is a
                    // mutual-exclusion measure (the permit count is checked instead).
                    measure_margin: recipe != Recipe::Semaphore,
                },
                exercised_fence: false,
            })
        }
        other => bail!("{} is not a holder fault", other.label()),
    }
}

/// Waits until every group's lock served a worker (other than `victim`) after `t`.
fn wait_all_recovered(groups: &[Group], victim: u32, t: u64, what: &str) -> anyhow::Result<()> {
    for g in groups {
        wait_for(&format!("{what} ({})", g.recipe.label()), WAIT, || {
            Ok(other_began(&g.records()?, victim, t))
        })?;
    }
    Ok(())
}

/// Injects one server fault of `scenario` (for the Redis ones, while `victim` of
/// `anchor` is inside its section) and waits until every lock serves a worker again.
// Each argument is a different handle of the run (servers, groups, proxy, randomness);
// bundling them would only rename the list.
#[allow(clippy::too_many_arguments)]
fn inject_server(
    scenario: Scenario,
    kind: Kind,
    cluster: &mut Cluster,
    groups: &[Group],
    anchor: &Group,
    vip: Option<&Proxy>,
    primary: &mut u32,
    victim: u32,
    rng: &mut StdRng,
) -> anyhow::Result<Fault> {
    let h = || anchor.records();
    let recipe = anchor.recipe;
    let since = now_us();
    let wait_inside = |what: &str| {
        wait_for(what, WAIT, || {
            Ok(inside_writing(&h()?, victim, recipe, since))
        })
    };
    let long = 2 * SESSION + Duration::from_millis(rng.gen_range(1000..2000));
    let server_wide = |t: u64| Fault {
        at_us: t,
        victim: None,
        signal_from_us: None,
        paused: false,
        measure_margin: false,
    };
    // A fault under a holder that keeps running: it must be told before anyone else is
    // let in.
    let under_victim = |t: u64| Fault {
        at_us: t,
        victim: Some(victim),
        signal_from_us: Some(t),
        paused: false,
        measure_margin: recipe != Recipe::Semaphore,
    };
    match scenario {
        Scenario::LeaderKill => {
            let server = kind.server();
            let leader = cluster.wait_leader(server, WAIT)?;
            let t = now_us();
            cluster.kill(server, leader)?;
            eprintln!("  killed {server} leader (node {leader})");
            let recovered =
                wait_all_recovered(groups, u32::MAX, t, "a holder after the leader kill");
            cluster.restart(server, leader)?;
            eprintln!("  restarted node {leader}");
            recovered?;
            Ok(server_wide(t))
        }
        Scenario::LeaderPause => {
            let server = kind.server();
            let leader = cluster.wait_leader(server, WAIT)?;
            let t = now_us();
            cluster.stop(server, leader)?;
            std::thread::sleep(long);
            cluster.cont(server, leader)?;
            eprintln!("  paused {server} leader (node {leader}) for {long:.1?}");
            wait_all_recovered(groups, u32::MAX, t, "a holder after the leader pause")?;
            cluster.wait_leader(server, WAIT)?;
            Ok(server_wide(t))
        }
        Scenario::LeaderCut => {
            let leader = cluster.wait_leader(Backend::Zookeeper, WAIT)?;
            let (lq, le) = cluster.zk_peer_ports(leader);
            let pid = cluster.server(Backend::Zookeeper, leader)?.pid;
            // Connections the leader opened to the others' election ports, besides
            // everything to or from its own quorum and election ports.
            let mut pairs = Vec::new();
            let others: Vec<u32> = cluster
                .servers_of(Backend::Zookeeper)
                .map(|s| s.id)
                .filter(|id| *id != leader)
                .collect();
            for other in others {
                let (_, oe) = cluster.zk_peer_ports(other);
                for p in dlock_testkit::connections_of(pid, oe)? {
                    pairs.push((p, oe));
                }
            }
            let t = now_us();
            let cut = dlock_testkit::NetCut::new(&pairs, &[lq, le])?;
            std::thread::sleep(long);
            cut.heal()?;
            eprintln!(
                "  cut the ZooKeeper leader (node {leader}) off from the quorum for {long:.1?}"
            );
            wait_all_recovered(groups, u32::MAX, t, "a holder after the leader cut")?;
            cluster.wait_leader(Backend::Zookeeper, WAIT)?;
            Ok(server_wide(t))
        }
        Scenario::ServerRestart => {
            wait_inside("the victim inside its section")?;
            let t = now_us();
            cluster.restart(Backend::Redis, 1)?;
            eprintln!("  restarted Redis node 1 (no persistence) under worker {victim}");
            wait_all_recovered(groups, victim, t, "another holder after the restart")?;
            Ok(under_victim(t))
        }
        Scenario::ClockJump => {
            wait_inside("the victim inside its section")?;
            let addr = cluster.server(Backend::Redis, 1)?.addr.clone();
            let jump_ms = (SESSION * 3 / 2).as_millis().to_string();
            let t = now_us();
            // What a forward jump of the server's wall clock does to locks: every key
            // with a TTL expires that much sooner, all at once. (libfaketime, which would
            // jump the clock itself, crashes Debian's redis-server at start.)
            redis_cli(&addr, &["EVAL", JUMP_SCRIPT, "0", &jump_ms])?;
            eprintln!(
                "  jumped Redis node 1's expiry clock forward {jump_ms} ms under worker {victim}"
            );
            wait_all_recovered(groups, victim, t, "another holder after the jump")?;
            Ok(under_victim(t))
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
            let recovered =
                wait_all_recovered(groups, victim, t, "another holder on the promoted replica");
            // The old primary comes back empty, ready to be the next round's replica.
            cluster.restart(Backend::Redis, p)?;
            recovered?;
            Ok(under_victim(t))
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
            let recovered =
                wait_all_recovered(groups, victim, t, "another holder after the failover");
            // Back only after the promotion (an empty master brought back earlier would
            // be kept as the primary), and whole again before the next fault.
            cluster.restart(Backend::RedisHa, primary)?;
            cluster.wait_sentinel_group(WAIT)?;
            recovered?;
            Ok(under_victim(t))
        }
        other => bail!("{} is not a server fault", other.label()),
    }
}

/// Shortens the TTL of every key by `ARGV[1]` ms (deleting those it would take past zero),
/// as a forward jump of the server's clock would. The chaos servers hold nothing else.
const JUMP_SCRIPT: &str = "local n = 0 \
    for _, k in ipairs(redis.call('KEYS', '*')) do \
      local t = redis.call('PTTL', k) \
      if t > 0 then \
        if t <= tonumber(ARGV[1]) then redis.call('DEL', k) \
        else redis.call('PEXPIRE', k, t - tonumber(ARGV[1])) end \
        n = n + 1 \
      end \
    end \
    return n";

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
