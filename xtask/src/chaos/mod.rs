//! `cargo xtask chaos`: what dlock does when the things distributed locks fail on happen,
//! on real servers with real processes.
//!
//! A run is a list of rounds; a round is one scenario on one backend, with every recipe
//! side by side ([`Recipe`]): per recipe, worker processes (two through the `dlock` CLI
//! and two through the library for the mutex and the election, two or three through the
//! library for the others) take their lock (or campaign and lead) again and again; each critical section logs its start, its
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
//!
//! Where to start: [`run`] plans the rounds and runs them, [`run_round`] one round. The
//! scenario catalogue and the round plan are in [`scenario`], the code that injects each
//! fault in [`inject`]; the workers, checker, store, proxy, late request and report have
//! a module each.

pub(crate) mod history;
mod inject;
mod late;
mod proxy;
mod report;
mod scenario;
mod store;
pub(crate) mod worker;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use dlock_testkit::{Cluster, ClusterSpec};
use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use self::history::{now_us, Fault, Record, Rules};
use self::inject::{inject_holder, inject_server, Links};
use self::late::LateRequest;
use self::proxy::Proxy;
use self::report::Row;
pub(crate) use self::scenario::Recipe;
use self::scenario::{plan, Round, Scenario};
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
            "unknown backend {s:?}: expected zk, etcd, redis, redlock, redis-sentinel or redis-cluster"
        )
    })
}

/// The client addresses of `kind`'s servers in `cluster` that its URL lists (a single
/// Redis master: only the first; a Redis Cluster: all six nodes, as seeds).
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
        redis_cluster: used.contains(&Kind::RedisCluster),
        port_offset: args.port_offset,
        state_path: Some(out_dir.join("cluster.json")),
        base_dir: None,
        secure: false,
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
    // A late request: each victim reaches etcd through its own frame proxies.
    let mut late: HashMap<u32, LateRequest> = HashMap::new();
    if scenario == Scenario::LateRequest {
        for v in groups.iter().flat_map(|g| g.victims.iter().copied()) {
            late.insert(v, LateRequest::start(rt, &addrs)?);
        }
    }
    // Replica promotion: every client reaches Redis through one address that moves to
    // the promoted replica, as a virtual IP (or Sentinel-aware clients) would.
    let vip = match scenario {
        Scenario::ReplicaPromotion | Scenario::WaitedPromotion => {
            let first = addrs.first().context("no Redis node")?;
            Some(Proxy::start(
                first.parse().with_context(|| format!("address {first}"))?,
            )?)
        }
        _ => None,
    };
    // Waited promotion: the slow workers (the holders a fault catches inside) reach
    // Redis through a door of their own that stays on the old primary when the address
    // everyone else uses moves, so they learn of the promotion only from their lease;
    // the fault moves it once their lease is over (see `inject_server`).
    let mut side: HashMap<u32, Proxy> = HashMap::new();
    if scenario == Scenario::WaitedPromotion {
        let first = addrs.first().context("no Redis node")?;
        let upstream: SocketAddr = first.parse().with_context(|| format!("address {first}"))?;
        for g in &groups {
            for &(id, slow) in &g.ids {
                if slow {
                    side.insert(id, Proxy::start(upstream)?);
                }
            }
        }
    }
    let mut primary = 1;
    if matches!(kind, Kind::Redis | Kind::Redlock) {
        inject::reset_redis(cluster)?;
    }
    if scenario == Scenario::WaitedPromotion {
        inject::attach_replica(cluster)?;
    }
    let url = match &vip {
        Some(v) => kind.url(&[v.addr().to_string()]),
        None => kind.url(&addrs),
    };
    // Clients that count a grant or a renewal only once the replica has it.
    let url = if scenario == Scenario::WaitedPromotion {
        format!("{url}?replicas=1")
    } else {
        url
    };

    let me = std::env::current_exe().context("locating the xtask binary")?;
    let mut workers = Workers(Vec::new());
    for g in &groups {
        for &(id, slow) in &g.ids {
            let worker_url = match (proxies.get(&id), late.get(&id), side.get(&id)) {
                (Some(ps), _, _) => {
                    kind.url(&ps.iter().map(|p| p.addr().to_string()).collect::<Vec<_>>())
                }
                (None, Some(l), _) => kind.url(&l.addrs()),
                (None, None, Some(door)) => {
                    format!("{}?replicas=1", kind.url(&[door.addr().to_string()]))
                }
                (None, None, None) => url.clone(),
            };
            let work = if slow {
                scenario.slow_work_ms()
            } else {
                FAST_WORK_MS
            };
            let mut cmd = Command::new(&me);
            if g.via(id) == "lib" && std::env::var_os("RUST_LOG").is_none() {
                // The library's debug log in each worker's log file: a failing round
                // (a stall above all, which no history line explains) prints its tail.
                cmd.env("RUST_LOG", WORKER_LOG);
            }
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
                let links = Links {
                    cuts: &proxies,
                    late: &late,
                };
                let hit = inject_holder(scenario, g, &mut workers, &links, victim, &mut rng)?;
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
                    eprintln!("{}", log_tails(&dir, g));
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
                &side,
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
                    eprintln!("{}", log_tails(&dir, g));
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
    drop(late);
    let closed = workers.closed();
    let mut rows = Vec::new();
    for (gi, g) in groups.iter().enumerate() {
        // Every client has gone: nothing may remain under the lock once the killed
        // clients' sessions have expired.
        let mut leaked = 0;
        for name in g.recipe.names(&g.name) {
            leaked += rt.block_on(leftovers(&url, &name, g.recipe))?;
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

/// What the library logs in a `lib` worker's log file unless `RUST_LOG` says otherwise.
const WORKER_LOG: &str =
    "warn,dlock=debug,dlock_core=debug,dlock_recipes=debug,dlock_etcd=debug,dlock_redis=debug,dlock_zookeeper=debug";

/// How many lines of each worker's log a liveness failure prints.
const TAIL_LINES: usize = 40;

/// The last lines of the logs of `g`'s workers, for a group that stopped making progress:
/// the round's directory is gone by the time anyone reads a CI log.
fn log_tails(dir: &std::path::Path, g: &Group) -> String {
    let mut out = String::new();
    for &(id, _) in &g.ids {
        let path = dir.join(format!("worker{id}.log"));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let from = lines.len().saturating_sub(TAIL_LINES);
        out.push_str(&format!(
            "  --- worker {id} ({}), last {} of {} lines of {}\n",
            g.via(id),
            lines.len() - from,
            lines.len(),
            path.display()
        ));
        for l in &lines[from..] {
            out.push_str("  | ");
            out.push_str(l);
            out.push('\n');
        }
    }
    out
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

/// Entries left under `name` once every client has gone, after waiting out the sessions
/// of the killed ones. For an election, a leader the election itself still reports
/// counts too, whatever layout its candidacies take.
async fn leftovers(url: &str, name: &str, recipe: Recipe) -> anyhow::Result<usize> {
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
        let mut left = parts.len();
        if left == 0 && recipe == Recipe::Election {
            let leader = client
                .election(name)
                .context("naming the election")?
                .leader()
                .await
                .with_context(|| format!("reading the leader of {name}"))?;
            left = usize::from(leader.is_some());
        }
        if left == 0 || Instant::now() > deadline {
            break left;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let _ = client.close().await;
    Ok(left)
}
