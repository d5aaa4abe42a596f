//! Running the benchmarks: dlock-bench against our own servers (plus `redis-benchmark` as
//! the Redis wire ceiling) or inside the peer harness, collecting their result lines.

use std::fmt::Write as _;
use std::io::{BufRead as _, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{bail, Context as _};
use dlock_testkit::ClusterSpec;
use indicatif::ProgressBar;

use super::parse::parse_line;
use crate::flags::BenchArgs;

/// Builds dlock-bench in release mode and returns its path.
pub(super) fn build_bench(root: &Path, release: bool) -> anyhow::Result<PathBuf> {
    crate::header(&format!(
        "cargo build{} --bin dlock-bench",
        if release { " --release" } else { "" }
    ));
    let mut cmd = crate::cargo();
    cmd.current_dir(root)
        .args(["build", "-p", "dlock-bench", "--bin", "dlock-bench"]);
    if release {
        cmd.arg("--release");
    }
    let status = cmd.status().context("running cargo build")?;
    if !status.success() {
        bail!("building dlock-bench failed ({status})");
    }
    Ok(crate::target_dir(root)
        .join(if release { "release" } else { "debug" })
        .join("dlock-bench"))
}

/// Runs `cmd`, echoing comment lines to stderr under a progress bar and collecting
/// result lines.
fn run_collect(
    mut cmd: Command,
    bar: &ProgressBar,
    expected_runs: u64,
) -> anyhow::Result<(Vec<String>, bool)> {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stdin(Stdio::null())
        .spawn()
        .context("starting the benchmark")?;
    let mut lines = Vec::new();
    if let Some(out) = child.stdout.take() {
        for line in BufReader::new(out).lines() {
            let line = line.context("reading benchmark output")?;
            if let Some(row) = parse_line(&line) {
                bar.set_message(format!(
                    "{} {} {}",
                    row.get("peer").map(String::as_str).unwrap_or(""),
                    row.get("workload").map(String::as_str).unwrap_or(""),
                    row.get("ops_s")
                        .map(|v| format!("{v} ops/s"))
                        .unwrap_or_default()
                ));
                if !line.starts_with("SUMMARY") {
                    lines.push(line);
                }
            } else if let Some(rest) = line.strip_prefix("# run=") {
                // run.sh: "# run=K PEER loadavg=..." starts the next peer of a repeat.
                if let Some(k) = rest
                    .split_whitespace()
                    .next()
                    .and_then(|k| k.parse::<u64>().ok())
                {
                    bar.set_position(k.saturating_sub(1).min(expected_runs));
                }
                bar.println(line);
            }
        }
    }
    let status = child.wait().context("waiting for the benchmark")?;
    Ok((lines, status.success()))
}

/// Our own servers: ZooKeeper 1, etcd 1, Redis 5 (Redlock), with `--redis-cluster` a
/// six-node Redis Cluster; dlock-bench and redis-benchmark.
pub(super) fn run_own(
    root: &Path,
    args: &BenchArgs,
    bin: &Path,
    bar: &ProgressBar,
) -> anyhow::Result<(Vec<String>, bool)> {
    let mut spec = ClusterSpec {
        zk: 1,
        etcd: 1,
        redis: 5,
        redis_cluster: args.redis_cluster,
        ..ClusterSpec::default()
    };
    let base = args.port_offset;
    spec.port_offset = base;
    let cluster = crate::cluster::start_with_progress(
        &mut spec,
        (1..40u16).map(|i| base.saturating_add(i * 50)),
    )?;
    let e = cluster.endpoints();
    let w6_peers = if args.failovers > 0 {
        w6_peer_flags(
            root,
            e.zk.as_deref().map(first_addr),
            e.etcd.as_deref().map(first_addr),
        )
    } else {
        Vec::new()
    };
    let mut lines = Vec::new();
    let mut ok = true;
    for r in 1..=args.repeats {
        bar.set_position(u64::from(r - 1));
        let mut cmd = Command::new(bin);
        cmd.args([
            "--duration",
            &args.duration.to_string(),
            "--workers",
            &args.workers.to_string(),
        ])
        .args([
            "--leases",
            &args.leases.to_string(),
            "--prefix",
            &format!("xtask-bench-r{r}"),
        ]);
        for (flag, v) in [
            ("--zk", &e.zk),
            ("--etcd", &e.etcd),
            ("--redis", &e.redis),
            ("--redlock", &e.redlock),
            ("--redis-cluster", &e.redis_cluster),
        ] {
            if let Some(v) = v {
                cmd.args([flag, v]);
            }
        }
        if args.scale {
            cmd.arg("--scale");
        }
        if args.failovers > 0 {
            cmd.args(["--failovers", &args.failovers.to_string()]);
            for p in &w6_peers {
                cmd.args(["--w6-peer", p]);
            }
        }
        let (l, good) = run_collect(cmd, bar, u64::from(args.repeats))?;
        ok &= good;
        lines.extend(l.into_iter().map(|l| format!("run={r} {l}")));
        if let Some(redis) = &e.redis {
            lines.extend(
                redis_benchmark(redis)
                    .into_iter()
                    .map(|l| format!("run={r} {l}")),
            );
        }
    }
    cluster.down().context("tearing the bench cluster down")?;
    Ok((lines, ok))
}

/// `redis-benchmark -c 1 -P 1` of SET NX PX and the release script: the Redis wire ceiling.
fn redis_benchmark(addr: &str) -> Vec<String> {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return Vec::new();
    };
    let lua = "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end";
    let tests: [(&str, Vec<&str>); 2] = [
        (
            "SET-NX-PX",
            vec!["SET", "lockbench:rb", "tok", "NX", "PX", "10000"],
        ),
        (
            "EVAL-release",
            vec!["EVAL", lua, "1", "lockbench:rb", "tok"],
        ),
    ];
    let mut out = Vec::new();
    for (label, cmd) in tests {
        let r = Command::new("redis-benchmark")
            .args([
                "-h", host, "-p", port, "-c", "1", "-P", "1", "-n", "20000", "--csv",
            ])
            .args(&cmd)
            .output();
        let Ok(r) = r else { continue };
        // CSV: "test","rps","avg_latency_ms","min","p50","p95","p99","max". The test name
        // (the Lua script) has commas of its own, so the fields are counted from the end.
        for l in String::from_utf8_lossy(&r.stdout).lines().skip(1) {
            let f: Vec<&str> = l.trim().trim_matches('"').split("\",\"").collect();
            if let [.., rps, _avg, _min, p50, _p95, p99, max] = f.as_slice() {
                if rps.parse::<f64>().is_ok() {
                    out.push(format!(
                        "peer=redis-benchmark workload={label} ops_s={rps} p50_ms={p50} p99_ms={p99} max_ms={max} n=20000 note=c1_P1"
                    ));
                }
            }
        }
    }
    out
}

/// The peer harness (`DIR/run.sh`) with dlock-bench as its `rust` peer.
pub(super) fn run_peers(
    root: &Path,
    args: &BenchArgs,
    bin: &Path,
    peers: &Path,
    bar: &ProgressBar,
) -> anyhow::Result<(Vec<String>, bool)> {
    let run_sh = peers.join("run.sh");
    if !run_sh.exists() {
        bail!("{} not found", run_sh.display());
    }
    let work = crate::target_dir(root).join("bench").join("peers");
    std::fs::create_dir_all(&work)?;
    let rust_cmd = format!(
        "{} --zk \"$ZK_ADDR\" --etcd \"$ETCD_ADDR\" --redis \"$REDIS_ADDR\" --duration \"$DURATION\" \
         --workers \"$WORKERS\" --leases \"$LEASES\" --prefix \"$RUN_PREFIX\"{}",
        bin.display(),
        if args.scale { " --scale" } else { "" }
    );
    let mut rust_cmd = rust_cmd;
    if args.failovers > 0 {
        // W6 inside the harness too, its peers on the harness's servers.
        let _ = write!(rust_cmd, " --failovers {}", args.failovers);
        for p in w6_peer_flags(root, Some("$ZK_ADDR"), Some("$ETCD_ADDR")) {
            let _ = write!(rust_cmd, " --w6-peer \"{}\"", p.replace('"', "\\\""));
        }
    }
    eprintln!("RUST_BENCH_CMD={rust_cmd}");
    // The peer folder may be read-only: its venv and rust-peers build go under target/.
    let venv = work.join("venv");
    let rp_target = work.join("rust-target");
    let mut cmd = if args.netns {
        prepare_offline(&venv, &rp_target, peers)?;
        let mut c = Command::new("unshare");
        c.args([
            "-n",
            "sh",
            "-c",
            "ip link set lo up && exec bash \"$0\" \"$@\"",
        ])
        .arg(&run_sh);
        c
    } else {
        let mut c = Command::new("bash");
        c.arg(&run_sh);
        c
    };
    if let Some(list) = &args.peer_list {
        cmd.args(list.split([' ', ',']).filter(|p| !p.is_empty()));
    }
    cmd.env("RUST_BENCH_CMD", &rust_cmd)
        .env("REPEATS", args.repeats.to_string())
        .env("DURATION", args.duration.to_string())
        .env("WORKERS", args.workers.to_string())
        .env("LEASES", args.leases.to_string())
        .env("VENV", &venv)
        .env("VENV_ETCD3", work.join("venv-etcd3"))
        .env("CARGO_TARGET_DIR", &rp_target);
    let (lines, ok) = run_collect(cmd, bar, u64::from(args.repeats))?;
    let raw = work.join("raw-results.txt");
    let mut f = std::fs::File::create(&raw)?;
    for l in &lines {
        writeln!(f, "{l}")?;
    }
    eprintln!("raw result lines: {}", raw.display());
    Ok((lines, ok))
}

/// In a fresh network namespace run.sh has no internet: make its venv and build
/// rust-peers beforehand.
fn prepare_offline(venv: &Path, rp_target: &Path, peers: &Path) -> anyhow::Result<()> {
    let py = venv.join("bin").join("python");
    let has_pkgs = Command::new(&py)
        .args(["-c", "import kazoo, redis"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_pkgs {
        crate::header("python venv for the peers (kazoo==2.11.0 redis==8.1.0)");
        let ok = Command::new("python3")
            .args(["-m", "venv"])
            .arg(venv)
            .status()?
            .success()
            && Command::new(venv.join("bin").join("pip"))
                .args([
                    "install",
                    "-q",
                    "--disable-pip-version-check",
                    "kazoo==2.11.0",
                    "redis==8.1.0",
                ])
                .status()?
                .success();
        if !ok {
            bail!("creating the peers' venv failed");
        }
    }
    let manifest = peers.join("rust-peers").join("Cargo.toml");
    if manifest.exists() {
        crate::header("cargo build --release rust-peers");
        let st = crate::cargo()
            .args([
                "build",
                "--release",
                "--locked",
                "--quiet",
                "--manifest-path",
            ])
            .arg(&manifest)
            .env("CARGO_TARGET_DIR", rp_target)
            .status()?;
        if !st.success() {
            bail!("building rust-peers failed");
        }
    }
    Ok(())
}

/// The first address of a comma-separated list.
fn first_addr(list: &str) -> &str {
    list.split(',').next().unwrap_or(list)
}

/// The session of W6's peer candidates: dlock-bench's `--w6-session` default, so every
/// implementation is timed with the same session; `etcdctl elect` has no flag for it
/// and always runs on a 60 s lease.
const W6_SESSION_SECS: u32 = 2;

/// Curator's classpath from the Debian jars (as the peer harness's run.sh).
const CURATOR_CP: &[&str] = &[
    "curator-recipes.jar",
    "curator-framework.jar",
    "curator-client.jar",
    "zookeeper.jar",
    "zookeeper-jute.jar",
    "guava.jar",
    "slf4j-api.jar",
    "slf4j-nop.jar",
];

/// dlock-bench's `--w6-peer` values: `etcdctl elect` on `etcd`, Curator's `LeaderLatch`
/// (`crates/bench/peers/LeaderLatchCandidate.java`, compiled here) on `zk`. A peer whose
/// tools are missing is left out with a note.
fn w6_peer_flags(root: &Path, zk: Option<&str>, etcd: Option<&str>) -> Vec<String> {
    let mut out = Vec::new();
    if let Some(etcd) = etcd {
        if Command::new("etcdctl").arg("version").output().is_ok() {
            out.push(format!(
                "etcdctl-elect:60:env ETCDCTL_API=3 etcdctl --endpoints={etcd} elect {{name}} candidate-{{id}}"
            ));
        } else {
            eprintln!("xtask bench: W6 without etcdctl elect: etcdctl not found");
        }
    }
    if let Some(zk) = zk {
        match compile_latch(root) {
            Ok(cp) => out.push(format!(
                "curator-leaderlatch:{W6_SESSION_SECS}:java -Xmx256m -cp {cp} LeaderLatchCandidate {zk} {{name}} {} {{id}}",
                W6_SESSION_SECS * 1000
            )),
            Err(e) => eprintln!("xtask bench: W6 without Curator LeaderLatch: {e:#}"),
        }
    }
    out
}

/// Compiles the LeaderLatch candidate into `target/bench/classes`; returns the classpath
/// to run it with.
fn compile_latch(root: &Path) -> anyhow::Result<String> {
    let java = Path::new("/usr/share/java");
    let jars: Vec<String> = CURATOR_CP
        .iter()
        .map(|j| java.join(j))
        .filter(|p| p.exists())
        .map(|p| p.display().to_string())
        .collect();
    if jars.len() != CURATOR_CP.len() {
        bail!("the Curator jars are not all in /usr/share/java (libcurator-recipes-java)");
    }
    let classes = crate::target_dir(root).join("bench").join("classes");
    std::fs::create_dir_all(&classes)?;
    let src = root
        .join("crates")
        .join("bench")
        .join("peers")
        .join("LeaderLatchCandidate.java");
    let cp = jars.join(":");
    let st = Command::new("javac")
        .args(["-nowarn", "-d"])
        .arg(&classes)
        .args(["-cp", &cp])
        .arg(&src)
        .status()
        .context("running javac")?;
    if !st.success() {
        bail!("javac {} failed ({st})", src.display());
    }
    Ok(format!("{}:{cp}", classes.display()))
}
