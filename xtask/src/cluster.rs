//! `cargo xtask cluster up|down|status`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context as _;
use dlock_testkit::{
    default_state_path, ensure_installed, zk_mode, Backend, Cluster, ClusterSpec, State,
};
use indicatif::ProgressBar;

use crate::flags::{ClusterArgs, ClusterCmd, StateArg, UpArgs};

/// `cargo xtask cluster ...`: a subcommand, or `--secure` alone (`up --secure` with its
/// defaults and its own state file, so it can run beside a plain cluster).
pub(crate) fn run_args(root: &Path, args: ClusterArgs) -> anyhow::Result<i32> {
    match args.cmd {
        Some(cmd) => run(root, cmd),
        None => {
            let up_args = UpArgs {
                zk: 1,
                etcd: 1,
                redis: 5,
                sentinel: true,
                redis_cluster: true,
                secure: args.secure,
                offset: args.offset,
                state: StateArg {
                    path: Some(
                        root.join("target")
                            .join("dlock-cluster")
                            .join("secure.json"),
                    ),
                },
            };
            up(root, &up_args)
        }
    }
}

pub(crate) fn run(root: &Path, cmd: ClusterCmd) -> anyhow::Result<i32> {
    match cmd {
        ClusterCmd::Up(args) => up(root, &args),
        ClusterCmd::Down(args) => down(&state_path(root, &args)),
        ClusterCmd::Status(args) => status(&state_path(root, &args)),
    }
}

fn state_path(root: &Path, arg: &StateArg) -> PathBuf {
    arg.path.clone().unwrap_or_else(|| default_state_path(root))
}

/// Starts `spec` with a spinner on stderr, at its own port offset or, when a port there is
/// taken (before or while the servers bind), at the first of `fallbacks` where every port
/// is free; `spec.port_offset` ends as the offset used, and a move is reported on stderr.
/// Installs the server packages first, and registers the cluster for teardown on a signal.
pub(crate) fn start_with_progress(
    spec: &mut ClusterSpec,
    fallbacks: impl IntoIterator<Item = u16>,
) -> anyhow::Result<Cluster> {
    ensure_installed().context("installing the server packages")?;
    if let Some(path) = &spec.state_path {
        crate::teardown::on_signal_tear_down(path)?;
    }
    let group = if spec.sentinel_replicas > 0 {
        1 + spec.sentinel_replicas + dlock_testkit::SENTINELS
    } else {
        0
    };
    let redis_cluster = if spec.redis_cluster {
        dlock_testkit::CLUSTER_NODES
    } else {
        0
    };
    let n = spec.zk + spec.etcd + spec.redis + group + redis_cluster;
    let from = spec.port_offset;
    let spinner = ProgressBar::new_spinner().with_message(format!(
        "starting {n} servers (ZooKeeper {}, etcd {}, Redis {}, Sentinel group {group}, Redis Cluster {redis_cluster}) at port offset {from}",
        spec.zk, spec.etcd, spec.redis
    ));
    spinner.enable_steady_tick(Duration::from_millis(100));
    let result = Cluster::start_at_free_offset(spec, std::iter::once(from).chain(fallbacks));
    spinner.finish_and_clear();
    let cluster = result.context("starting the cluster")?;
    if spec.port_offset != from {
        eprintln!(
            "ports at offset {from} are taken; using port offset {} instead",
            spec.port_offset
        );
    }
    eprintln!("started {n} servers in {:.1?}", spinner.elapsed());
    Ok(cluster)
}

/// The offsets to fall back to from `from`, in steps of 100: for clusters whose ports only
/// need to be free, not fixed (a CI machine may run a distribution-started server on a
/// default port).
pub(crate) fn fallback_offsets(from: u16) -> impl Iterator<Item = u16> {
    (1..500u16).map(move |k| from.saturating_add(k * 100))
}

fn up(root: &Path, args: &UpArgs) -> anyhow::Result<i32> {
    let path = state_path(root, &args.state);
    let mut spec = ClusterSpec {
        zk: args.zk,
        etcd: args.etcd,
        redis: args.redis,
        sentinel_replicas: u32::from(args.sentinel),
        redis_cluster: args.redis_cluster,
        port_offset: args.offset.value,
        state_path: Some(path.clone()),
        base_dir: None,
        secure: args.secure,
    };
    // `up` starts at exactly the offset asked: the caller exports those ports.
    let state = start_with_progress(&mut spec, [])?.detach();
    if args.secure {
        // Full URLs: throwaway test passwords and this cluster's CA.
        for (name, url) in state.secure_env() {
            if name != dlock_testkit::ENV_SECURE_STATE {
                println!("{url}");
            }
        }
        eprintln!(
            "\nstate: {}\ndata and PKI: {}",
            path.display(),
            state.root_dir.display()
        );
        eprintln!("for tests, in this shell:");
        for (name, value) in state.secure_env() {
            eprintln!("  export {name}='{value}'");
        }
        eprintln!(
            "stop with: cargo xtask cluster down --state {}",
            path.display()
        );
        return Ok(0);
    }
    let endpoints = state.endpoints();
    for url in endpoints
        .urls()
        .into_iter()
        .chain(endpoints.sentinel_url())
        .chain(endpoints.cluster_url())
    {
        println!("{url}");
    }
    eprintln!(
        "\nstate: {}\ndata:  {}",
        path.display(),
        state.root_dir.display()
    );
    eprintln!("for tests, in this shell:");
    for (name, value) in endpoints.to_env() {
        eprintln!("  export {name}={value}");
    }
    eprintln!("stop with: cargo xtask cluster down");
    Ok(0)
}

fn down(path: &Path) -> anyhow::Result<i32> {
    if !path.exists() {
        eprintln!("no cluster recorded at {}", path.display());
        return Ok(0);
    }
    let state = State::load(path)?;
    let n = state.servers.len();
    state.down().context("tearing the cluster down")?;
    eprintln!(
        "stopped {n} servers, removed their data and {}",
        path.display()
    );
    Ok(0)
}

fn status(path: &Path) -> anyhow::Result<i32> {
    if !path.exists() {
        eprintln!("no cluster recorded at {}", path.display());
        return Ok(1);
    }
    let state = State::load(path)?;
    let etcd_leader = state.etcd_leader().unwrap_or(None);
    println!(
        "{:<10} {:>2}  {:<16} {:>8}  {:<8} {:<6} role",
        "backend", "id", "addr", "pid", "process", "ready"
    );
    let mut all_ready = true;
    for s in &state.servers {
        let process = if s.is_stopped() {
            "stopped"
        } else if s.is_running() {
            "alive"
        } else {
            "dead"
        };
        let ready = s.is_running() && !s.is_stopped() && s.is_ready(Duration::from_secs(1));
        all_ready &= ready;
        let role = match s.backend {
            Backend::Zookeeper if ready => zk_mode(&s.addr, Duration::from_secs(1))
                .map(|m| format!("{m:?}").to_lowercase())
                .unwrap_or_else(|| "not serving".into()),
            Backend::Etcd if etcd_leader == Some(s.id) => "leader".into(),
            Backend::Etcd if ready => "follower".into(),
            Backend::Redis if ready => "master".into(),
            Backend::RedisHa | Backend::RedisCluster if ready => {
                dlock_testkit::redis_query(&s.addr, &["ROLE"], Duration::from_secs(1))
                    .and_then(|r| r.lines().next().map(str::to_owned))
                    .map(|r| if r == "slave" { "replica".into() } else { r })
                    .unwrap_or_else(|| "-".into())
            }
            Backend::Sentinel if ready => "sentinel".into(),
            _ => "-".into(),
        };
        println!(
            "{:<10} {:>2}  {:<16} {:>8}  {:<8} {:<6} {role}",
            s.backend.to_string(),
            s.id,
            s.addr,
            s.pid,
            process,
            if ready { "yes" } else { "no" }
        );
    }
    println!();
    let endpoints = state.endpoints();
    for url in endpoints
        .urls()
        .into_iter()
        .chain(endpoints.sentinel_url())
        .chain(endpoints.cluster_url())
    {
        println!("{url}");
    }
    Ok(if all_ready { 0 } else { 1 })
}
