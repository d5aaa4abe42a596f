//! Command-line flags of every task.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// dlock developer tasks.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) task: Task,
}

#[derive(Debug, Subcommand)]
pub(crate) enum Task {
    /// Start, inspect or stop real servers on 127.0.0.1 (`cluster --secure`: secured
    /// servers of every backend, left running, their URLs printed).
    Cluster(ClusterArgs),
    /// Start servers, export DLOCK_TEST_*, run every workspace test, tear down.
    Integration(IntegrationArgs),
    /// What CI runs: fmt check, clippy -D warnings, rustdoc -D warnings, the publish
    /// checks, then integration (which also runs the examples).
    Ci(IntegrationArgs),
    /// The publish checks of `ci` alone, no servers: every dependency's rust-version
    /// against the declared one, `cargo deny check licenses bans`, `cargo package`.
    PublishCheck(PublishCheckArgs),
    /// Run every example of examples/ once against real servers (its own single-node
    /// cluster, or the given URLs).
    Examples(ExamplesArgs),
    /// The stock-deduction demo: 8 processes sell 300 items with and without dlock.
    Demo(DemoArgs),
    /// Benchmark: dlock-bench (and with --peers the peer harness) to a markdown table of
    /// ratios, JSON under target/bench/ and an SVG chart.
    Bench(BenchArgs),
    /// One demo worker process: buys until sold out (internal).
    #[command(hide = true)]
    DemoWorker(WorkerArgs),
    /// One purchase: read the counter, decrement it, log the sale (internal).
    #[command(hide = true)]
    DemoBuy(BuyArgs),
    /// Fault injection on real servers and processes, every recipe side by side; prints
    /// the backend x scenario x recipe table and fails on any overlap of two holders.
    Chaos(ChaosArgs),
    /// Seeded simulation: every recipe over the in-memory backend under drawn fault
    /// schedules, on virtual time; fails on any overlap, token-order violation or leftover
    /// entry and prints the seed that replays it.
    Sim(SimArgs),
    /// One chaos worker process: takes the lock again and again (internal).
    #[command(hide = true)]
    ChaosWorker(ChaosWorkerArgs),
    /// One chaos critical section, run by `dlock exec` (internal).
    #[command(hide = true)]
    ChaosSection(ChaosSectionArgs),
}

/// Port offset shared by every task that starts servers.
#[derive(Debug, Clone, Args)]
pub(crate) struct PortOffset {
    /// Added to every default port (ZK 2181, etcd 2379, Redis 6379, ...), so several
    /// developers can run clusters on one machine.
    #[arg(long = "port-offset", env = "DLOCK_PORT_OFFSET", default_value_t = 0)]
    pub(crate) value: u16,
}

/// `cargo xtask cluster`: a subcommand, or `--secure` alone.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true, arg_required_else_help = true)]
pub(crate) struct ClusterArgs {
    #[command(subcommand)]
    pub(crate) cmd: Option<ClusterCmd>,
    /// Start one secured server of each backend (TLS with a throwaway CA, users, access
    /// control: ZooKeeper, etcd, five Redis masters, a Sentinel group, a Redis Cluster),
    /// leave them running and print their URLs: `cluster up --secure --redis 5 --sentinel
    /// --redis-cluster` with the state file `target/dlock-cluster/secure.json`.
    #[arg(long)]
    pub(crate) secure: bool,
    #[command(flatten)]
    pub(crate) offset: PortOffset,
}

#[derive(Debug, Subcommand)]
pub(crate) enum ClusterCmd {
    /// Start servers and leave them running; prints their URLs.
    Up(UpArgs),
    /// Kill every server recorded in the state file and delete its data.
    Down(StateArg),
    /// Show every recorded server: pid alive, ready, ZooKeeper mode, etcd leader.
    Status(StateArg),
}

#[derive(Debug, Args)]
pub(crate) struct UpArgs {
    /// ZooKeeper nodes.
    #[arg(long, default_value_t = 1, value_parser = quorum_size)]
    pub(crate) zk: u32,
    /// etcd members.
    #[arg(long, default_value_t = 1, value_parser = quorum_size)]
    pub(crate) etcd: u32,
    /// Independent Redis masters (5 = a Redlock set).
    #[arg(long, default_value_t = 1, value_parser = redis_count)]
    pub(crate) redis: u32,
    /// Also a Sentinel group: a Redis primary, one replica and three Sentinels
    /// (`redis+sentinel://.../mymaster`, `DLOCK_TEST_REDIS_SENTINEL`).
    #[arg(long)]
    pub(crate) sentinel: bool,
    /// Also a Redis Cluster: six nodes, three masters with one replica each
    /// (`redis+cluster://...`, `DLOCK_TEST_REDIS_CLUSTER`; with `--secure`,
    /// `rediss+cluster://...`, `DLOCK_TEST_SECURE_REDIS_CLUSTER`).
    #[arg(long = "redis-cluster")]
    pub(crate) redis_cluster: bool,
    /// Secured servers: TLS (a CA made for this cluster), users and access control; prints
    /// `zks://`, `etcds://`, `rediss://`, `redlocks://` (and `rediss+sentinel://`,
    /// `rediss+cluster://`) URLs.
    #[arg(long)]
    pub(crate) secure: bool,
    #[command(flatten)]
    pub(crate) offset: PortOffset,
    #[command(flatten)]
    pub(crate) state: StateArg,
}

/// ZooKeeper / etcd node counts: none, one, or a three-node quorum.
fn quorum_size(s: &str) -> Result<u32, String> {
    match s {
        "0" | "1" | "3" => s.parse().map_err(|e| format!("{e}")),
        _ => Err(format!("{s:?}: expected 0, 1 or 3")),
    }
}

/// Redis node counts: none, one, or a five-master Redlock set.
fn redis_count(s: &str) -> Result<u32, String> {
    match s {
        "0" | "1" | "5" => s.parse().map_err(|e| format!("{e}")),
        _ => Err(format!("{s:?}: expected 0, 1 or 5")),
    }
}

#[derive(Debug, Args)]
pub(crate) struct PublishCheckArgs {
    /// Only these checks (default: all, in this order: msrv, deny, package).
    #[arg(value_enum)]
    pub(crate) steps: Vec<crate::publish::Step>,
}

#[derive(Debug, Args)]
pub(crate) struct StateArg {
    /// State file (default: `<workspace>/target/dlock-cluster/state.json`).
    #[arg(long = "state", env = "DLOCK_CLUSTER_STATE")]
    pub(crate) path: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub(crate) struct IntegrationArgs {
    /// One node of each backend instead of ZooKeeper 3 + etcd 3 + Redis 5.
    #[arg(long)]
    pub(crate) single: bool,
    #[command(flatten)]
    pub(crate) offset: PortOffset,
}

#[derive(Debug, Args)]
pub(crate) struct BenchArgs {
    /// Run this peer harness folder's run.sh (e.g. /work/shared/peers) with dlock-bench
    /// as its RUST_BENCH_CMD, instead of starting servers here.
    #[arg(long)]
    pub(crate) peers: Option<PathBuf>,
    /// With --peers: run run.sh in a fresh network namespace (`unshare -n`, needs root),
    /// so its fixed ports cannot clash with servers already running on this machine.
    #[arg(long, requires = "peers")]
    pub(crate) netns: bool,
    /// With --peers: only these peers of run.sh (space or comma separated, e.g.
    /// "curator kazoo redis-py rust-peers rust"); default all.
    #[arg(long, requires = "peers")]
    pub(crate) peer_list: Option<String>,
    /// Summarise a saved file of result lines instead of running anything.
    #[arg(long, conflicts_with = "peers")]
    pub(crate) from: Option<PathBuf>,
    /// Seconds per workload.
    #[arg(long, default_value_t = 3.0)]
    pub(crate) duration: f64,
    /// Workers of W2-W5.
    #[arg(long, default_value_t = 8)]
    pub(crate) workers: u32,
    /// Semaphore permits of W4.
    #[arg(long, default_value_t = 3)]
    pub(crate) leases: u32,
    /// Interleaved repeats; the report takes medians.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    pub(crate) repeats: u32,
    /// Also run the scale checks (S1 waiters, S2 held locks).
    #[arg(long)]
    pub(crate) scale: bool,
    /// Also start a six-node Redis Cluster and run `dlock-redis-cluster` on it (without
    /// --peers).
    #[arg(long)]
    pub(crate) redis_cluster: bool,
    /// W6, leader failover: SIGKILL the leader this many times per backend, and the same
    /// for `etcdctl elect` and Curator's `LeaderLatch` (when etcdctl, javac and the
    /// Curator jars are installed). 0 leaves W6 out.
    #[arg(long, default_value_t = 0)]
    pub(crate) failovers: u32,
    /// Port offset of the servers this starts (without --peers); the next free offsets
    /// 50 apart are tried when its ports are taken.
    #[arg(long = "port-offset", default_value_t = 1000)]
    pub(crate) port_offset: u16,
    /// Where to write the SVG chart (default target/bench/bench.svg).
    #[arg(long)]
    pub(crate) svg: Option<PathBuf>,
    /// Title of the chart.
    #[arg(long, default_value = "dlock vs peers, same invocation")]
    pub(crate) title: String,
}

#[derive(Debug, Args)]
pub(crate) struct ExamplesArgs {
    /// Run against these backend URLs (repeatable) instead of starting a cluster.
    #[arg(long)]
    pub(crate) url: Vec<String>,
    #[command(flatten)]
    pub(crate) offset: PortOffset,
}

#[derive(Debug, Args)]
pub(crate) struct DemoArgs {
    /// Use this lock service instead of starting a ZooKeeper (e.g. zk://127.0.0.1:2181).
    #[arg(long)]
    pub(crate) url: Option<String>,
    /// Items in stock at the start.
    #[arg(long, default_value_t = 300)]
    pub(crate) stock: u64,
    /// Concurrent worker processes.
    #[arg(long, default_value_t = 8)]
    pub(crate) workers: u32,
    #[command(flatten)]
    pub(crate) offset: PortOffset,
}

#[derive(Debug, Args)]
pub(crate) struct WorkerArgs {
    /// The shop directory (counter and sales log).
    #[arg(long)]
    pub(crate) dir: PathBuf,
    /// Path of the `dlock` binary; without it the worker buys with no lock.
    #[arg(long)]
    pub(crate) dlock: Option<PathBuf>,
    /// Lock service URL for `dlock --url`.
    #[arg(long)]
    pub(crate) url: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct BuyArgs {
    /// The shop directory (counter and sales log).
    pub(crate) dir: PathBuf,
}

#[derive(Debug, Args)]
pub(crate) struct SimArgs {
    /// How many seeds to run (consecutive, from `--seed`).
    #[arg(long, default_value_t = 1000)]
    pub(crate) seeds: u64,
    /// The first seed; a failing seed is printed with the command that replays it.
    #[arg(long, default_value_t = 0)]
    pub(crate) seed: u64,
    /// One recipe only (mutex, reentrant-mutex, semaphore-mutex, rwlock, semaphore,
    /// multi-lock, election); default: each seed runs the next recipe in turn.
    #[arg(long)]
    pub(crate) recipe: Option<String>,
}

#[derive(Debug, Args)]
pub(crate) struct ChaosArgs {
    /// Backends to run (zk, etcd, redis, redlock, redis-sentinel, redis-cluster; repeat or
    /// comma-separate). Default: all this build of dlock supports.
    #[arg(long = "backend", value_delimiter = ',')]
    pub(crate) backends: Vec<String>,
    /// Scenarios to run (repeat or comma-separate). Default: all. See `--list`.
    #[arg(long = "scenario", value_delimiter = ',')]
    pub(crate) scenarios: Vec<String>,
    /// List the scenarios and exit.
    #[arg(long)]
    pub(crate) list: bool,
    /// Recipes to run (repeat or comma-separate): mutex, reentrant-mutex,
    /// semaphore-mutex, rwlock, semaphore, multi-lock, election. Default: all, side by
    /// side.
    #[arg(long = "recipe", value_delimiter = ',')]
    pub(crate) recipes: Vec<String>,
    /// The seed every random choice (scenario, victim, timing) is drawn from; printed
    /// when not given. A failing round prints the command that replays it.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// Randomized rounds instead of the whole backend x scenario matrix: round i runs
    /// backend i (mod the backends asked) and draws its scenario, victims and timing
    /// from its own seed (round 0's seed is `--seed`).
    #[arg(long)]
    pub(crate) rounds: Option<u32>,
    /// The CI version: one randomized round per backend, one fault per victim.
    #[arg(long)]
    pub(crate) short: bool,
    /// Leave docs/safety.md alone (the short run never touches it).
    #[arg(long)]
    pub(crate) no_docs: bool,
    /// Added to every default server port; far from the integration suite's by default,
    /// and below the kernel's ephemeral ports (32768 and up on Linux): a node killed and
    /// restarted there could find its port taken as the source port of a client's
    /// connection (a leader-kill round failed that way, `bind: address already in use`).
    #[arg(long = "port-offset", default_value_t = 25_000)]
    pub(crate) port_offset: u16,
}

#[derive(Debug, Args)]
pub(crate) struct ChaosWorkerArgs {
    /// `cli` (every section is a `dlock exec` or `dlock elect` process) or `lib` (one
    /// process, the library).
    #[arg(long)]
    pub(crate) via: String,
    /// Path of the `dlock` binary, for `--via cli`.
    #[arg(long)]
    pub(crate) dlock: Option<PathBuf>,
    /// Lock service URL.
    #[arg(long)]
    pub(crate) url: String,
    /// Lock name.
    #[arg(long)]
    pub(crate) name: String,
    /// Session timeout, e.g. 2s.
    #[arg(long)]
    pub(crate) session_timeout: String,
    /// The recipe the worker takes: mutex, reentrant-mutex, semaphore-mutex, rwlock,
    /// semaphore, multi-lock or election (`--via cli`: mutex through `dlock exec`, election
    /// through `dlock elect`).
    #[arg(long, default_value = "mutex")]
    pub(crate) recipe: String,
    /// The semaphore's permits (`--recipe semaphore`).
    #[arg(long, default_value_t = 2)]
    pub(crate) permits: u32,
    #[command(flatten)]
    pub(crate) section: SectionParams,
    /// The worker stops before its next section once this file exists.
    #[arg(long)]
    pub(crate) stop: PathBuf,
}

/// What one critical section does: log, work, write to the fenced store, log.
#[derive(Debug, Clone, Args)]
pub(crate) struct SectionParams {
    /// Worker number.
    #[arg(long = "worker")]
    pub(crate) worker: u32,
    /// `127.0.0.1:PORT` of the fenced store.
    #[arg(long)]
    pub(crate) store: String,
    /// The history file every section appends to.
    #[arg(long)]
    pub(crate) history: PathBuf,
    /// How long the section works before it writes.
    #[arg(long)]
    pub(crate) work_ms: u64,
}

#[derive(Debug, Args)]
pub(crate) struct ChaosSectionArgs {
    #[command(flatten)]
    pub(crate) section: SectionParams,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory as _;

    #[test]
    fn flags_are_consistent() {
        Cli::command().debug_assert();
    }

    /// The chaos servers' default ports, and the next offsets tried when one is taken,
    /// stay below Linux's ephemeral ports (32768 and up), where a restarted node's port
    /// can be held as the source port of some connection.
    #[test]
    fn chaos_ports_stay_below_the_ephemeral_range() {
        let cli = Cli::try_parse_from(["xtask", "chaos"]).expect("parses");
        let Task::Chaos(args) = cli.task else {
            panic!("wrong task: {cli:?}");
        };
        // The layout's highest port is a Redis Cluster bus port, 6407 + offset; the
        // cluster start moves up in steps of 100 when a port is taken.
        let highest = 6407 + u32::from(args.port_offset) + 10 * 100;
        assert!(highest < 32_768, "{highest}");
    }

    #[test]
    fn cluster_up_parses_shapes_and_rejects_others() {
        let cli = Cli::try_parse_from([
            "xtask",
            "cluster",
            "up",
            "--zk",
            "3",
            "--etcd",
            "0",
            "--redis",
            "5",
            "--port-offset",
            "100",
        ])
        .expect("parses");
        let Task::Cluster(ClusterArgs {
            cmd: Some(ClusterCmd::Up(up)),
            ..
        }) = cli.task
        else {
            panic!("wrong task: {cli:?}");
        };
        assert_eq!((up.zk, up.etcd, up.redis, up.offset.value), (3, 0, 5, 100));
        assert!(!up.secure);
        assert!(Cli::try_parse_from(["xtask", "cluster", "up", "--zk", "2"]).is_err());
        assert!(Cli::try_parse_from(["xtask", "cluster", "up", "--redis", "3"]).is_err());
        // `cluster --secure` alone, or `up --secure`; never beside a subcommand.
        let cli = Cli::try_parse_from(["xtask", "cluster", "--secure"]).expect("parses");
        let Task::Cluster(ClusterArgs {
            cmd: None,
            secure: true,
            ..
        }) = cli.task
        else {
            panic!("wrong task: {cli:?}");
        };
        let cli = Cli::try_parse_from(["xtask", "cluster", "up", "--secure"]).expect("parses");
        assert!(matches!(
            cli.task,
            Task::Cluster(ClusterArgs {
                cmd: Some(ClusterCmd::Up(UpArgs { secure: true, .. })),
                ..
            })
        ));
        assert!(Cli::try_parse_from(["xtask", "cluster", "up", "--secure", "--sentinel"]).is_ok());
        // A secured Redis Cluster: TLS on every node, ACL users on each.
        assert!(
            Cli::try_parse_from(["xtask", "cluster", "up", "--secure", "--redis-cluster"]).is_ok()
        );
        assert!(Cli::try_parse_from(["xtask", "cluster", "--secure", "up"]).is_err());
    }
}
