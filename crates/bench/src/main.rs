//! `dlock-bench`: dlock's recipes under the peers' workloads, beside each backend's raw
//! protocol ceiling, against servers you give it. Prints one line per result in the
//! format of the peer harness (`/work/shared/peers`, `docs/benchmarks.md`), so its
//! output can be pooled with Curator's, kazoo's, redis-py's, rslock's and etcd's.
//!
//! ```text
//! dlock-bench --zk 127.0.0.1:22181 --etcd 127.0.0.1:22379 --redis 127.0.0.1:23379 \
//!             --duration 3 --workers 8 --leases 3 --prefix lockbench-rust-r1
//! ```
//!
//! Every backend flag may be omitted. Peers: `dlock-zk`, `dlock-etcd`, `dlock-redis`,
//! `dlock-redlock` (with `--redlock h:p,h:p,h:p`), `dlock-redis-cluster` (with
//! `--redis-cluster h:p,...`, seed nodes of a Redis Cluster), `ceiling-zk`, `ceiling-etcd`,
//! `ceiling-redis`. A backend this build of the facade leaves out prints
//! `status=skipped`; a workload that fails prints `status=failed` and the exit code is 1.
//!
//! Workloads (identical to the peers'): W1 one client, one name; W2 N workers on one
//! name with an in-memory holder flag and unlocked counter; W3 N workers, one name each;
//! W4 N workers on a semaphore of `--leases` permits; W5 N workers on a read/write lock,
//! 90 % reads (`peak_readers` = most readers inside at once). `--scale` adds S1 (server
//! operations per release with 10..1000 waiters queued on a mutex, `S1-waiters`, and on a
//! semaphore of `--leases` permits, `S1-permits`), S2 (memory per held lock,
//! measured in a process of its own) and, on Redis, S3 (the server's `INFO commandstats`
//! cost of an uncontended acquire + release, dlock's beside rslock's protocol). `--failovers N` adds W6, leader failover: three
//! candidate processes in one election, the leader SIGKILLed N times, the time to the next
//! leader's announcement (p50/p99), for every backend and every `--w6-peer` command
//! (`etcdctl elect`, Curator's `LeaderLatch`; see [`failover`]).

mod ceiling;
mod failover;
mod harness;
mod resp;
mod scale;
mod workloads;

use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;

use crate::harness::{line, run_workers, status_line, Outcome, Shared, Worker};
use crate::scale::OpCounter;
use crate::workloads::{DlockWorker, Recipe};

/// Command-line flags: the contract the peer harness and outside comparisons rely on.
#[derive(Debug, Parser)]
#[command(
    name = "dlock-bench",
    about = "dlock's lock benchmark against given servers"
)]
struct Args {
    /// ZooKeeper `host:port[,host:port...]`.
    #[arg(long)]
    zk: Option<String>,
    /// etcd `host:port[,host:port...]`.
    #[arg(long)]
    etcd: Option<String>,
    /// One Redis master `host:port`.
    #[arg(long)]
    redis: Option<String>,
    /// Independent Redis masters for Redlock, `h:p,h:p,h:p` (at least 3).
    #[arg(long)]
    redlock: Option<String>,
    /// Seed nodes of a Redis Cluster, `h:p[,h:p...]` (`redis+cluster://`).
    #[arg(long = "redis-cluster")]
    redis_cluster: Option<String>,
    /// Seconds per workload.
    #[arg(long, default_value_t = 3.0)]
    duration: f64,
    /// Workers of W2-W5.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Semaphore permits of W4.
    #[arg(long, default_value_t = 3)]
    leases: u32,
    /// Prefix of every lock name and key, so runs do not meet.
    #[arg(long, default_value = "lockbench")]
    prefix: String,
    /// Only these workloads, comma separated (W0 = the ceilings; W0f and W3f = the Redis
    /// ceiling through fred, W0d and W3d = the Redis adapter's fast-path scripts through
    /// fred, W0m and W3m = MULTI/SET NX/TIME/EXEC and rslock's release through fred, the
    /// W0s on one worker and the W3s on `--workers` workers; W4r = an etcd semaphore
    /// without an internal mutex; these seven only when named here; W1..W6, S1, S2, S3).
    #[arg(long, value_delimiter = ',')]
    only: Option<Vec<String>>,
    /// Also run the scale checks S1, S2 and S3.
    #[arg(long)]
    scale: bool,
    /// S1: queue lengths to measure.
    #[arg(long, value_delimiter = ',', default_value = "10,100,1000")]
    waiters: Vec<usize>,
    /// S2: locks held at once by one client.
    #[arg(long, default_value_t = 10_000)]
    held: usize,
    /// W6 (leader failover): this many SIGKILLs of the leader per backend and peer. 0 (the
    /// default) leaves W6 out; `--only` must list W6 too when it is given.
    #[arg(long, default_value_t = 0)]
    failovers: usize,
    /// W6: the session timeout (seconds) of dlock's candidates; a failover cannot be
    /// shorter.
    #[arg(long = "w6-session", default_value_t = 2.0)]
    w6_session: f64,
    /// W6 beside another implementation: `NAME:SESSION_SECS:COMMAND`, a candidate run by
    /// `sh -c` with `{name}` (the election) and `{id}` replaced, that prints a line when
    /// it leads and leads until killed. Repeatable.
    #[arg(long = "w6-peer")]
    w6_peers: Vec<String>,
    /// Internal (W6): be one dlock candidate on this URL.
    #[arg(long = "w6-candidate", hide = true, requires = "w6_name")]
    w6_candidate: Option<String>,
    /// Internal (W6): the candidate's election.
    #[arg(long = "w6-name", hide = true)]
    w6_name: Option<String>,
    /// Internal (W6): the candidate's number, in its value.
    #[arg(long = "w6-id", hide = true, default_value_t = 0)]
    w6_id: u32,
    /// S3: uncontended acquire + release pairs whose server cost is measured (Redis).
    #[arg(long = "s3-pairs", default_value_t = 2000)]
    s3_pairs: usize,
    /// S2 in this process. Without it, S2 re-runs this binary with only S2 for the one
    /// backend: memory the earlier workloads freed is reused by the held locks, which
    /// hid their growth (a measured 0 B per lock).
    #[arg(long, hide = true)]
    s2_here: bool,
}

impl Args {
    fn wants(&self, w: &str) -> bool {
        if w == "W6" && self.failovers == 0 {
            return false;
        }
        if matches!(w, "W0f" | "W3f" | "W0d" | "W3d" | "W0m" | "W3m" | "W4r") {
            // Opt-in: not one of the peers' workloads, so the default output keeps its lines.
            return self.only.as_ref().is_some_and(|o| o.iter().any(|x| x == w));
        }
        match &self.only {
            Some(only) => only.iter().any(|o| o == w),
            None => !w.starts_with('S') || self.scale,
        }
    }

    fn w6_session(&self) -> Duration {
        Duration::from_secs_f64(self.w6_session)
    }
}

/// Prints result lines as they come and remembers whether any workload failed.
#[derive(Default)]
struct Sink {
    failed: bool,
}

impl Sink {
    fn emit(&mut self, l: String) {
        if l.contains(" status=failed ") {
            self.failed = true;
        }
        println!("{l}");
    }

    fn fail(&mut self, peer: &str, workload: &str, err: &str) {
        eprintln!("dlock-bench: {peer} {workload}: {err}");
        self.emit(status_line(peer, workload, "failed", err));
    }
}

/// Extra result fields computed from an outcome (violations, counters, ...).
type Check<'a> = dyn Fn(&Outcome) -> Vec<(&'static str, String)> + 'a;

/// One dlock backend under test.
struct Target {
    peer: &'static str,
    url: String,
    session: Duration,
    counter: Option<OpCounter>,
    /// The command-line flag and value that select this backend alone (for S2's
    /// process of its own).
    flag: (&'static str, String),
}

fn first_host(list: &str) -> String {
    list.split(',').next().unwrap_or(list).to_owned()
}

fn main() -> ExitCode {
    let args = Args::parse();
    // Off unless asked: a trace is for finding where a workload's time goes (every line
    // carries a microsecond timestamp and the worker's span), never for a measured run.
    if let Ok(filter) = tracing_subscriber::EnvFilter::try_from_env("DLOCK_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_span_events(
                tracing_subscriber::fmt::format::FmtSpan::NEW
                    | tracing_subscriber::fmt::format::FmtSpan::CLOSE,
            )
            .with_writer(std::io::stderr)
            .init();
    }
    if !(args.w6_session > 0.0 && args.w6_session.is_finite()) {
        eprintln!("dlock-bench: --w6-session must be > 0");
        return ExitCode::from(2);
    }
    if let (Some(url), Some(name)) = (&args.w6_candidate, &args.w6_name) {
        return candidate(url, name, args.w6_session(), args.w6_id);
    }
    let peers: Result<Vec<failover::PeerSpec>, String> = args
        .w6_peers
        .iter()
        .map(|p| failover::PeerSpec::parse(p))
        .collect();
    let peers = match peers {
        Ok(p) => p,
        Err(e) => {
            eprintln!("dlock-bench: {e}");
            return ExitCode::from(2);
        }
    };
    if !(args.duration > 0.0 && args.duration.is_finite()) || args.workers == 0 {
        eprintln!("dlock-bench: --duration must be > 0 and --workers >= 1");
        return ExitCode::from(2);
    }
    if args.zk.is_none()
        && args.etcd.is_none()
        && args.redis.is_none()
        && args.redlock.is_none()
        && args.redis_cluster.is_none()
    {
        eprintln!(
            "dlock-bench: give at least one of --zk, --etcd, --redis, --redlock, --redis-cluster"
        );
        return ExitCode::from(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock-bench: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let failed = rt.block_on(run(args, peers));
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

async fn run(args: Args, w6_peers: Vec<failover::PeerSpec>) -> bool {
    let mut sink = Sink::default();
    let duration = Duration::from_secs_f64(args.duration);
    let prefix = args.prefix.trim_matches('/').to_owned();

    // ZooKeeper session 30 s (Curator's), etcd lease 60 s (the peers'), Redis 10 s (redis-py's TTL).
    let mut targets = Vec::new();
    if let Some(zk) = &args.zk {
        if args.wants("W0") {
            let w = ceiling::ZkRaw::connect(&first_host(zk), &format!("{prefix}-ceiling-zk")).await;
            run_ceiling(&mut sink, "ceiling-zk", ceiling::ZK_WORKLOAD, w, duration).await;
        }
        targets.push(Target {
            peer: "dlock-zk",
            url: format!("zk://{zk}"),
            session: Duration::from_secs(30),
            counter: Some(OpCounter::Zk(first_host(zk))),
            flag: ("--zk", zk.clone()),
        });
    }
    if let Some(etcd) = &args.etcd {
        if args.wants("W0") {
            let w = ceiling::EtcdRaw::connect(&first_host(etcd), &format!("{prefix}/ceiling-etcd"))
                .await;
            run_ceiling(
                &mut sink,
                "ceiling-etcd",
                ceiling::ETCD_WORKLOAD,
                w,
                duration,
            )
            .await;
        }
        if args.wants("W4r") {
            let shared = Arc::new(Shared::default());
            let mut ws = Vec::new();
            for _ in 0..args.workers {
                ws.push(
                    ceiling::EtcdRanked::connect(
                        &first_host(etcd),
                        &format!("{prefix}/ceiling-etcd-ranked"),
                        args.leases,
                        shared.clone(),
                    )
                    .await,
                );
            }
            let leases = args.leases;
            let check = |_: &Outcome| semaphore_checks(leases, &shared);
            run_one(
                &mut sink,
                "ceiling-etcd",
                ceiling::ETCD_RANKED_WORKLOAD,
                ws,
                duration,
                Some(&check),
                None,
            )
            .await;
        }
        targets.push(Target {
            peer: "dlock-etcd",
            url: format!("etcd://{etcd}"),
            session: Duration::from_secs(60),
            counter: Some(OpCounter::Etcd(first_host(etcd))),
            flag: ("--etcd", etcd.clone()),
        });
    }
    if let Some(redis) = &args.redis {
        if args.wants("W0") {
            let w = ceiling::RedisRaw::connect(redis, &format!("{prefix}:ceiling-redis")).await;
            run_ceiling(
                &mut sink,
                "ceiling-redis",
                ceiling::REDIS_WORKLOAD,
                w,
                duration,
            )
            .await;
        }
        // The fred workloads: rslock's pair, the adapter's fast path and the transaction
        // acquire, each on one worker (W0f, W0d, W0m: W1's shape) and on `--workers`
        // workers (W3f, W3d, W3m: W3's).
        let fred = [
            (
                "W0f",
                "ceiling-redis-fred",
                ceiling::REDIS_FRED_WORKLOAD,
                ceiling::FredCommands::Rslock,
                1,
            ),
            (
                "W3f",
                "ceiling-redis-fred",
                ceiling::REDIS_FRED_W3_WORKLOAD,
                ceiling::FredCommands::Rslock,
                args.workers,
            ),
            (
                "W0d",
                "ceiling-redis-fred-dlock",
                ceiling::REDIS_FRED_DLOCK_WORKLOAD,
                ceiling::FredCommands::DlockFastPath,
                1,
            ),
            (
                "W3d",
                "ceiling-redis-fred-dlock",
                ceiling::REDIS_FRED_DLOCK_W3_WORKLOAD,
                ceiling::FredCommands::DlockFastPath,
                args.workers,
            ),
            (
                "W0m",
                "ceiling-redis-fred-multi",
                ceiling::REDIS_FRED_MULTI_WORKLOAD,
                ceiling::FredCommands::MultiTime,
                1,
            ),
            (
                "W3m",
                "ceiling-redis-fred-multi",
                ceiling::REDIS_FRED_MULTI_W3_WORKLOAD,
                ceiling::FredCommands::MultiTime,
                args.workers,
            ),
        ];
        for (flag, peer, workload, commands, workers) in fred {
            if !args.wants(flag) {
                continue;
            }
            let mut built = Vec::new();
            for i in 0..workers {
                // One worker keeps the key name the ceiling always had.
                let key = if workers == 1 {
                    format!("{prefix}:{peer}")
                } else {
                    format!("{prefix}:{peer}-{i}")
                };
                built.push(ceiling::RedisFred::connect(redis, &key, commands).await);
            }
            run_one(&mut sink, peer, workload, built, duration, None, None).await;
        }
        if args.wants("S3") {
            run_s3(&mut sink, &args, redis, &prefix).await;
        }
        targets.push(Target {
            peer: "dlock-redis",
            url: format!("redis://{redis}"),
            session: Duration::from_secs(10),
            counter: Some(OpCounter::Redis(redis.clone())),
            flag: ("--redis", redis.clone()),
        });
    }
    match &args.redlock {
        Some(masters) => targets.push(Target {
            peer: "dlock-redlock",
            url: format!("redlock://{masters}"),
            session: Duration::from_secs(10),
            counter: None,
            flag: ("--redlock", masters.clone()),
        }),
        None if args.redis.is_some() => sink.emit(status_line(
            "dlock-redlock",
            "all",
            "skipped",
            "Redlock needs --redlock with 3 or more independent masters",
        )),
        None => {}
    }
    // No ceiling and no server-operation count: both read one server, and a cluster's
    // locks are spread over three masters.
    if let Some(nodes) = &args.redis_cluster {
        targets.push(Target {
            peer: "dlock-redis-cluster",
            url: format!("redis+cluster://{nodes}"),
            session: Duration::from_secs(10),
            counter: None,
            flag: ("--redis-cluster", nodes.clone()),
        });
    }
    for t in &targets {
        run_target(&mut sink, &args, &prefix, t, duration).await;
    }
    if args.wants("W6") {
        for p in &w6_peers {
            let name = format!("{prefix}/{}/w6", p.peer);
            let spec = p.clone();
            let spawn = move |id: u32| spec.command(&name, id);
            run_w6(
                &mut sink,
                &p.peer,
                spawn,
                failover::failovers_for(args.failovers, p.session),
                p.session,
            )
            .await;
        }
    }
    sink.failed
}

/// W6 for one peer: [`failover::measure`] on a blocking thread, then its line.
async fn run_w6(
    sink: &mut Sink,
    peer: &str,
    spawn: impl Fn(u32) -> std::process::Command + Send + 'static,
    failovers: usize,
    session: Duration,
) {
    // Settle: the new leader leads a while (an announcement meanwhile is a violation) and
    // the replacement candidate has time to queue. Limit: well past any session.
    let settle = Duration::from_secs(1);
    let limit = session * 3 + Duration::from_secs(30);
    let r =
        tokio::task::spawn_blocking(move || failover::measure(&spawn, failovers, settle, limit))
            .await;
    match r {
        Ok(Ok(f)) => sink.emit(failover::line(peer, &f, session)),
        Ok(Err(e)) => sink.fail(peer, "W6", &e),
        Err(e) => sink.fail(peer, "W6", &format!("W6 task: {e}")),
    }
}

/// `--w6-candidate`: campaign in `name`, print `leading term=T` the moment this process
/// leads, lead until killed. Exit 70 if the leadership is lost, 1 if it never came.
fn candidate(url: &str, name: &str, session: Duration, id: u32) -> ExitCode {
    use std::io::Write as _;
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dlock-bench candidate: tokio runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    rt.block_on(async {
        let led = async {
            let c = workloads::connect(url, session).await?;
            let election = c.election(name)?;
            let leadership = election.campaign(format!("candidate-{id}")).await?;
            Ok::<_, dlock::Error>((c, leadership))
        };
        match led.await {
            Ok((_client, leadership)) => {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "leading term={}", leadership.term());
                let _ = out.flush();
                drop(out);
                let e = leadership.lost().await;
                eprintln!("dlock-bench candidate {id}: {e}");
                ExitCode::from(70)
            }
            Err(e) => {
                eprintln!("dlock-bench candidate {id}: {e}");
                ExitCode::FAILURE
            }
        }
    })
}

/// Runs a backend's ceiling: one raw client, no recipe, no checks.
/// A semaphore workload's check fields: its permits, the violations and the most
/// holders seen at once.
fn semaphore_checks(leases: u32, shared: &Shared) -> Vec<(&'static str, String)> {
    vec![
        ("leases", leases.to_string()),
        ("violations", shared.violations().to_string()),
        ("max_holders", shared.max_holders().to_string()),
    ]
}

async fn run_ceiling<W: Worker>(
    sink: &mut Sink,
    peer: &str,
    workload: &str,
    worker: Result<W, String>,
    duration: Duration,
) {
    run_one(sink, peer, workload, vec![worker], duration, None, None).await;
}

/// Runs one workload whose workers were built (or failed to build) beforehand; closes
/// the built ones if another failed.
async fn run_one<W: Worker>(
    sink: &mut Sink,
    peer: &str,
    workload: &str,
    built: Vec<Result<W, String>>,
    duration: Duration,
    check: Option<&Check<'_>>,
    counter: Option<&OpCounter>,
) {
    let mut workers: Vec<Box<dyn Worker>> = Vec::with_capacity(built.len());
    let mut err = None;
    for w in built {
        match w {
            Ok(w) => workers.push(Box::new(w)),
            Err(e) => err = err.or(Some(e)),
        }
    }
    if let Some(e) = err {
        for w in workers {
            w.close().await;
        }
        sink.fail(peer, workload, &e);
        return;
    }
    // Server requests per iteration say where the time goes (round trips per acquire +
    // release); the few made by closing the sessions are counted too.
    let before = match counter {
        Some(c) => c.read().await.ok(),
        None => None,
    };
    match run_workers(workers, duration).await {
        Ok(o) => {
            let mut extra = check.map(|c| c(&o)).unwrap_or_default();
            if let (Some(c), Some(b)) = (counter, before) {
                if let Ok(a) = c.read().await {
                    extra.push((
                        "server_ops_per_op",
                        format!("{:.2}", a.saturating_sub(b) as f64 / o.ops().max(1) as f64),
                    ));
                }
            }
            sink.emit(line(peer, workload, &o, &extra));
        }
        Err(e) => sink.fail(peer, workload, &e),
    }
}

fn mutex_check(shared: &Shared, o: &Outcome) -> Vec<(&'static str, String)> {
    let counter = shared.counter();
    let counter_ok = counter == o.ops() as u64;
    vec![
        (
            "violations",
            (shared.violations() + u64::from(!counter_ok)).to_string(),
        ),
        ("counter", counter.to_string()),
        ("counter_ok", counter_ok.to_string()),
    ]
}

async fn run_target(sink: &mut Sink, args: &Args, prefix: &str, t: &Target, duration: Duration) {
    let peer = t.peer;
    // A backend the facade was built without is skipped, not failed.
    match workloads::connect(&t.url, t.session).await {
        Ok(c) => {
            let _ = c.close().await;
        }
        Err(e @ dlock::Error::InvalidUrl { .. }) => {
            sink.emit(status_line(peer, "all", "skipped", &e.to_string()));
            return;
        }
        Err(e) => {
            sink.fail(peer, "all", &format!("connect {}: {e}", t.url));
            return;
        }
    }
    let base = format!("{prefix}/{peer}");
    let n = args.workers;
    let build =
        |count: usize, name: Box<dyn Fn(usize) -> String>, recipe: Box<dyn Fn(usize) -> Recipe>| {
            let url = t.url.clone();
            let session = t.session;
            async move {
                let mut out = Vec::with_capacity(count);
                for i in 0..count {
                    out.push(DlockWorker::new(&url, session, &name(i), recipe(i)).await);
                }
                out
            }
        };

    if args.wants("W1") {
        let n1 = format!("{base}/w1");
        let ws = build(
            1,
            Box::new(move |_| n1.clone()),
            Box::new(|_| Recipe::Mutex { shared: None }),
        )
        .await;
        run_one(sink, peer, "W1", ws, duration, None, t.counter.as_ref()).await;
    }
    if args.wants("W2") {
        let shared = Arc::new(Shared::default());
        let (s, n2) = (shared.clone(), format!("{base}/w2"));
        let ws = build(
            n,
            Box::new(move |_| n2.clone()),
            Box::new(move |_| Recipe::Mutex {
                shared: Some(s.clone()),
            }),
        )
        .await;
        let check = |o: &Outcome| mutex_check(&shared, o);
        run_one(
            sink,
            peer,
            "W2",
            ws,
            duration,
            Some(&check),
            t.counter.as_ref(),
        )
        .await;
    }
    if args.wants("W3") {
        let b = base.clone();
        let ws = build(
            n,
            Box::new(move |i| format!("{b}/w3-{i}")),
            Box::new(|_| Recipe::Mutex { shared: None }),
        )
        .await;
        run_one(sink, peer, "W3", ws, duration, None, t.counter.as_ref()).await;
    }
    if args.wants("W4") {
        let shared = Arc::new(Shared::default());
        let (s, n4, leases) = (shared.clone(), format!("{base}/w4"), args.leases);
        let ws = build(
            n,
            Box::new(move |_| n4.clone()),
            Box::new(move |_| Recipe::Semaphore {
                shared: s.clone(),
                leases,
            }),
        )
        .await;
        let check = |_: &Outcome| semaphore_checks(leases, &shared);
        run_one(
            sink,
            peer,
            "W4",
            ws,
            duration,
            Some(&check),
            t.counter.as_ref(),
        )
        .await;
    }
    if args.wants("W5") {
        let shared = Arc::new(Shared::default());
        let (s, n5) = (shared.clone(), format!("{base}/w5"));
        let ws = build(
            n,
            Box::new(move |_| n5.clone()),
            Box::new(move |i| Recipe::RwLock {
                shared: s.clone(),
                seed: 0x9E37_79B9_7F4A_7C15 ^ (i as u64 + 1),
            }),
        )
        .await;
        let check = |_: &Outcome| {
            vec![
                ("read_pct", workloads::W5_READ_PERCENT.to_string()),
                ("violations", shared.violations().to_string()),
                ("peak_readers", shared.peak_readers().to_string()),
            ]
        };
        run_one(
            sink,
            peer,
            "W5",
            ws,
            duration,
            Some(&check),
            t.counter.as_ref(),
        )
        .await;
    }
    if args.wants("W6") {
        let exe = match std::env::current_exe() {
            Ok(exe) => exe,
            Err(e) => return sink.fail(peer, "W6", &format!("finding this binary: {e}")),
        };
        let (url, name) = (t.url.clone(), format!("{base}/w6"));
        let session = args.w6_session();
        let spawn = move |id: u32| {
            let mut c = std::process::Command::new(&exe);
            c.args(["--w6-candidate", &url, "--w6-name", &name])
                .args(["--w6-session", &session.as_secs_f64().to_string()])
                .args(["--w6-id", &id.to_string()]);
            c
        };
        run_w6(sink, peer, spawn, args.failovers, session).await;
    }
    if args.wants("S1") {
        run_s1(sink, args, t, &base).await;
    }
    if args.wants("S2") {
        run_s2(sink, args, t, &base).await;
    }
}

/// S3: the server cost of one uncontended acquire + release, dlock's against the
/// protocol rslock and redis-py use (`SET NX PX` + `EVALSHA` compare-and-delete, the
/// `ceiling-redis` loop), on the same server in the same run.
async fn run_s3(sink: &mut Sink, args: &Args, redis: &str, prefix: &str) {
    const W: &str = "S3-server-cost";
    let n = args.s3_pairs.max(1);
    let emit = |sink: &mut Sink, peer: &str, c: scale::ServerCost| {
        sink.emit(format!(
            "peer={peer} workload={W} pairs={n} server_usec_per_op={:.2} server_calls_per_op={:.2}",
            c.usec_per_op, c.calls_per_op
        ));
    };
    match ceiling::RedisRaw::connect(redis, &format!("{prefix}:s3-raw")).await {
        Ok(mut raw) => match scale::server_cost(redis, &["set", "evalsha"], n, &mut raw).await {
            Ok(c) => emit(sink, "ceiling-redis", c),
            Err(e) => sink.fail("ceiling-redis", W, &e),
        },
        Err(e) => sink.fail("ceiling-redis", W, &e),
    }
    let url = format!("redis://{redis}");
    let name = format!("{prefix}/dlock-redis/s3");
    let recipe = Recipe::Mutex { shared: None };
    match DlockWorker::new(&url, Duration::from_secs(10), &name, recipe).await {
        Ok(mut w) => {
            match scale::server_cost(redis, &["eval", "evalsha"], n, &mut w).await {
                Ok(c) => emit(sink, "dlock-redis", c),
                Err(e) => sink.fail("dlock-redis", W, &e),
            }
            Box::new(w).close().await;
        }
        Err(e) => sink.fail("dlock-redis", W, &e),
    }
}

async fn run_s1(sink: &mut Sink, args: &Args, t: &Target, base: &str) {
    let Some(counter) = &t.counter else {
        sink.emit(status_line(
            t.peer,
            "S1-waiters",
            "skipped",
            "no server counter for this backend",
        ));
        return;
    };
    let clients = (
        workloads::connect(&t.url, t.session).await,
        workloads::connect(&t.url, t.session).await,
    );
    let (holder, waiter) = match clients {
        (Ok(h), Ok(w)) => (h, w),
        (h, w) => {
            for c in [h, w].into_iter().flatten() {
                let _ = c.close().await;
            }
            sink.fail(t.peer, "S1-waiters", "connect failed");
            return;
        }
    };
    // The mutex (`S1-waiters`), then a semaphore of `--leases` permits (`S1-permits`).
    let permits = args.leases;
    for (workload, sem) in [("S1-waiters", false), ("S1-permits", true)] {
        for &n in &args.waiters {
            let (r, shape) = if sem {
                let name = format!("{base}/s1p-{n}");
                let r = scale::permit_waiters(&holder, &waiter, &name, permits, n, counter).await;
                (r, format!("permits={permits} "))
            } else {
                let name = format!("{base}/s1-{n}");
                (
                    scale::waiters(&holder, &waiter, &name, n, counter).await,
                    String::new(),
                )
            };
            match r {
                Ok((ops, releases, secs)) => sink.emit(format!(
                    "peer={} workload={workload} {shape}waiters={n} releases={releases} \
                     server_ops={ops} server_ops_per_release={:.2} secs={secs:.2} \
                     handoffs_s={:.1}",
                    t.peer,
                    ops as f64 / releases as f64,
                    releases as f64 / secs.max(1e-9),
                )),
                Err(e) => sink.fail(t.peer, workload, &format!("{n} waiters: {e}")),
            }
        }
    }
    let _ = holder.close().await;
    let _ = waiter.close().await;
}

async fn run_s2(sink: &mut Sink, args: &Args, t: &Target, base: &str) {
    if !args.s2_here {
        return run_s2_apart(sink, args, t).await;
    }
    let client = match workloads::connect(&t.url, t.session).await {
        Ok(c) => c,
        Err(e) => {
            sink.fail(t.peer, "S2-held-locks", &format!("connect: {e}"));
            return;
        }
    };
    match scale::held_locks(&client, &format!("{base}/s2"), args.held).await {
        Ok((before, held, secs)) => sink.emit(format!(
            "peer={} workload=S2-held-locks locks={} rss_before_kib={before} rss_held_kib={held} \
             bytes_per_lock={:.0} acquire_secs={secs:.2}",
            t.peer,
            args.held,
            held.saturating_sub(before) as f64 * 1024.0 / args.held.max(1) as f64,
        )),
        Err(e) => sink.fail(t.peer, "S2-held-locks", &e),
    }
    let _ = client.close().await;
}

/// Runs S2 for `t` in a fresh process of this binary and forwards its line.
async fn run_s2_apart(sink: &mut Sink, args: &Args, t: &Target) {
    const W: &str = "S2-held-locks";
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => return sink.fail(t.peer, W, &format!("finding this binary: {e}")),
    };
    let out = tokio::process::Command::new(exe)
        .args([t.flag.0, t.flag.1.as_str(), "--only", "S2", "--s2-here"])
        .args(["--held", &args.held.to_string(), "--prefix", &args.prefix])
        .stderr(std::process::Stdio::inherit())
        .output()
        .await;
    let out = match out {
        Ok(out) => out,
        Err(e) => return sink.fail(t.peer, W, &format!("running S2 apart: {e}")),
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let want = format!("peer={} workload={W} ", t.peer);
    match stdout.lines().find(|l| l.starts_with(&want)) {
        Some(line) => sink.emit(line.to_owned()),
        None => sink.fail(
            t.peer,
            W,
            &format!("the S2 process printed no result ({})", out.status),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The floors and prototypes are not the peers' workloads: a default run (the
    /// output outside scripts read) never prints them, and `--only` runs each named one.
    #[test]
    fn opt_in_workloads_run_only_when_named() {
        let opt_in = ["W0f", "W3f", "W0d", "W3d", "W0m", "W3m", "W4r"];
        let default = Args::parse_from(["dlock-bench"]);
        for w in opt_in {
            assert!(!default.wants(w), "{w} ran by default");
        }
        assert!(default.wants("W1") && default.wants("W3"));
        let named = Args::parse_from(["dlock-bench", "--only", "W3f,W3"]);
        assert!(named.wants("W3f") && named.wants("W3"));
        assert!(!named.wants("W0f") && !named.wants("W3d") && !named.wants("W1"));
    }
}
