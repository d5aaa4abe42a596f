//! `cargo xtask integration`: servers up, `DLOCK_TEST_*` exported, every test run, then every
//! example of `examples/` on every backend, servers down, whatever happens.

use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::Path;
use std::process::Stdio;

use anyhow::Context as _;
use dlock_testkit::{ClusterSpec, Endpoints, State, ENV_CLUSTER_DIR};

use crate::flags::IntegrationArgs;

pub(crate) fn run(root: &Path, args: &IntegrationArgs) -> anyhow::Result<i32> {
    run_with(root, args, false)
}

/// As [`run`]; with `bench_smoke`, a passing test run is followed by the dlock-bench
/// smoke pass against the same servers (what `cargo xtask ci` does).
pub(crate) fn run_with(
    root: &Path,
    args: &IntegrationArgs,
    bench_smoke: bool,
) -> anyhow::Result<i32> {
    let cluster_dir = crate::target_dir(root).join("dlock-cluster");
    let state_path = cluster_dir.join("integration.json");
    // Servers of tests that a signal killed last time, then the same on our way out.
    let reaped = dlock_testkit::reap_scratch_clusters(&cluster_dir);
    if reaped > 0 {
        eprintln!("xtask: stopped {reaped} cluster(s) left by killed tests");
    }
    crate::teardown::on_signal_reap(&cluster_dir);
    if state_path.exists() {
        // Only a run that was SIGKILLed leaves this file behind; its servers are ours.
        eprintln!("xtask: stopping servers left by an interrupted integration run");
        if let Ok(old) = State::load(&state_path) {
            old.down().context("stopping leftover servers")?;
        }
    }
    let (zk, etcd, redis) = if args.single { (1, 1, 1) } else { (3, 3, 5) };
    let mut spec = ClusterSpec {
        zk,
        etcd,
        redis,
        // Always: the Sentinel failover tests need it, and a CI run must not skip them.
        sentinel_replicas: 1,
        // Always, for the same reason: the backend-generic suite runs on it.
        redis_cluster: true,
        port_offset: args.offset.value,
        state_path: Some(state_path.clone()),
        base_dir: None,
        secure: false,
    };
    crate::header(&format!(
        "integration: ZooKeeper {zk}, etcd {etcd}, Redis {redis}, Sentinel group (primary, replica, 3 Sentinels), Redis Cluster (3 masters, 3 replicas), port offset {}",
        spec.port_offset
    ));
    // Dropped on every way out of this function, panics included: kills the servers.
    let from = spec.port_offset;
    let cluster =
        crate::cluster::start_with_progress(&mut spec, crate::cluster::fallback_offsets(from))?;
    let endpoints = cluster.endpoints();
    for (name, value) in endpoints.to_env() {
        eprintln!("  {name}={value}");
    }
    // The secured variant of every backend (TLS, users, access control) beside it, for
    // the `secure_*` tests: one node each is enough, they test the connection, not the
    // quorum. Dropped (killed) on every way out, as `cluster` is.
    let secure_state = cluster_dir.join("integration-secure.json");
    if let Ok(old) = State::load(&secure_state) {
        old.down().context("stopping leftover secured servers")?;
    }
    let mut secure_spec = ClusterSpec {
        zk: 1,
        etcd: 1,
        redis: 5,
        sentinel_replicas: 1,
        // One secured Redis Cluster (TLS on client ports, bus and replication; ACL users
        // on every node), shared by every `secure_*` test: about 3 s of start-up.
        redis_cluster: true,
        // 50 above the plain cluster's offset (every port of the two layouts differs),
        // so the run stays within the ports of the caller's `--port-offset`; further up
        // in steps of 100 when one is taken.
        port_offset: spec.port_offset.saturating_add(50),
        state_path: Some(secure_state),
        base_dir: None,
        secure: true,
    };
    crate::header(
        "integration: the secured servers (ZooKeeper, etcd, 5 Redis masters, a Sentinel group, a Redis Cluster; TLS, users, ACLs)",
    );
    let secure = crate::cluster::start_with_progress(
        &mut secure_spec,
        crate::cluster::fallback_offsets(spec.port_offset.saturating_add(50)),
    )?;
    let secure_env = secure.secure_env();
    for (name, value) in &secure_env {
        eprintln!("  {name}={}", dlock::BackendUrl::redact(value));
    }
    let mut outcome =
        run_all(root, &endpoints, &secure_env, &cluster_dir).and_then(|mut counts| {
            // The examples assert their own invariants; run them once per backend, in the
            // same cluster, once the tests are green.
            if counts.exit_code == 0 && counts.failed == 0 {
                let ex =
                    crate::examples::run_with(root, &crate::examples::example_urls(&endpoints))?;
                counts.passed += ex.passed;
                counts.failed += ex.failed;
                counts.ignored += ex.skipped;
                if ex.failed > 0 {
                    counts.exit_code = 1;
                }
            }
            Ok(counts)
        });
    if bench_smoke {
        if let Ok(counts) = &mut outcome {
            if counts.exit_code == 0 && counts.failed == 0 {
                match crate::bench::smoke(root, &endpoints) {
                    Ok(true) => {}
                    Ok(false) => counts.exit_code = 1,
                    Err(e) => {
                        eprintln!("xtask: bench smoke pass could not run: {e:#}");
                        counts.exit_code = 1;
                    }
                }
            }
        }
    }
    dlock_testkit::reap_scratch_clusters(&cluster_dir);
    secure.down().context("tearing the secured servers down")?;
    cluster.down().context("tearing the cluster down")?;
    let counts = outcome?;
    // A plain closing line, after the teardown chatter, that any log reader can count.
    println!(
        "integration: {} passed, {} failed, {} skipped",
        counts.passed, counts.failed, counts.ignored
    );
    Ok(counts.exit_code)
}

/// What the test run reported.
#[derive(Debug, Default, PartialEq, Eq)]
struct Counts {
    passed: u64,
    failed: u64,
    ignored: u64,
    exit_code: i32,
}

impl Counts {
    /// Adds one libtest summary line (`test result: ok. 3 passed; 0 failed; 1 ignored; ...`).
    fn add_line(&mut self, line: &str) {
        let Some(rest) = line.strip_prefix("test result: ") else {
            return;
        };
        for part in rest.split(';') {
            let words: Vec<&str> = part.split_whitespace().collect();
            // "ok. 3 passed" or " 0 failed": the number is the word before the label.
            if let [.., n, label] = words.as_slice() {
                let Ok(n) = n.parse::<u64>() else { continue };
                match *label {
                    "passed" => self.passed += n,
                    "failed" => self.failed += n,
                    "ignored" => self.ignored += n,
                    _ => {}
                }
            }
        }
    }
}

/// Every unit, property and integration test in one run, then the doc tests (which
/// `--all-targets` leaves out), stopping at the first failure.
fn run_all(
    root: &Path,
    endpoints: &Endpoints,
    secure_env: &[(&'static str, String)],
    cluster_dir: &Path,
) -> anyhow::Result<Counts> {
    let mut env = endpoints.to_env();
    env.extend(secure_env.iter().cloned());
    env.push((ENV_CLUSTER_DIR, cluster_dir.display().to_string()));
    let mut counts = run_tests(
        root,
        &env,
        &["--workspace", "--all-targets", "--", "--test-threads", "2"],
    )?;
    if counts.exit_code == 0 && counts.failed == 0 {
        let doc = run_tests(root, &env, &["--workspace", "--doc"])?;
        counts.passed += doc.passed;
        counts.failed += doc.failed;
        counts.ignored += doc.ignored;
        counts.exit_code = doc.exit_code;
    }
    if counts.exit_code == 0 && counts.passed == 0 {
        eprintln!("xtask: cargo test ran no test");
        counts.exit_code = 1;
    }
    Ok(counts)
}

fn run_tests(root: &Path, env: &[(&str, String)], args: &[&str]) -> anyhow::Result<Counts> {
    crate::header(&format!("cargo test {}", args.join(" ")));
    let mut child = crate::cargo()
        .current_dir(root)
        .arg("test")
        .args(args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .process_group(0)
        .spawn()
        .context("starting cargo test")?;
    crate::teardown::set_child_group(child.id());
    let mut counts = Counts::default();
    if let Some(stdout) = child.stdout.take() {
        let mut out = std::io::stdout().lock();
        for line in BufReader::new(stdout).lines() {
            let line = line.context("reading cargo test output")?;
            counts.add_line(&line);
            writeln!(out, "{line}").context("writing to stdout")?;
        }
    }
    let status = child.wait().context("waiting for cargo test")?;
    crate::teardown::set_child_group(0);
    counts.exit_code = status.code().unwrap_or(1);
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sums_libtest_summary_lines() {
        let mut c = Counts::default();
        c.add_line("test result: ok. 21 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 0.01s");
        c.add_line("test result: FAILED. 3 passed; 2 failed; 1 ignored; 0 measured; 0 filtered out; finished in 1.2s");
        c.add_line("test foo ... ok");
        c.add_line("running 3 tests");
        assert_eq!((c.passed, c.failed, c.ignored), (24, 2, 1));
    }
}
