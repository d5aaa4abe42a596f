//! `cargo xtask examples`: every example of `examples/` once, on every backend URL (a
//! Redis Cluster's `redis+cluster://` included).
//!
//! Each example asserts its own invariant and exits 0 when it holds, 1 when it is broken,
//! 77 when this build of the examples has no feature for the URL's backend (skipped), or
//! a dlock error code. `cargo xtask integration` runs the same step inside its cluster.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context as _};
use dlock_testkit::ClusterSpec;

use crate::flags::ExamplesArgs;

/// The Rust examples, in the order they run.
const EXAMPLES: [&str; 7] = [
    "stock",
    "transfer",
    "config_cache",
    "rate_limit",
    "fenced_write",
    "leader",
    "metrics",
];
/// The exit code an example uses for "backend not compiled in".
const SKIPPED: i32 = 77;

/// What the examples step reported.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tally {
    pub(crate) passed: u64,
    pub(crate) failed: u64,
    pub(crate) skipped: u64,
}

pub(crate) fn run(root: &Path, args: &ExamplesArgs) -> anyhow::Result<i32> {
    let tally = if args.url.is_empty() {
        let mut spec = ClusterSpec {
            zk: 1,
            etcd: 1,
            redis: 1,
            sentinel_replicas: 0,
            redis_cluster: true,
            port_offset: args.offset.value,
            state_path: Some(
                crate::target_dir(root)
                    .join("dlock-cluster")
                    .join("examples.json"),
            ),
            base_dir: None,
            secure: false,
        };
        // Dropping the cluster (on every way out) stops its servers.
        let from = spec.port_offset;
        let cluster =
            crate::cluster::start_with_progress(&mut spec, crate::cluster::fallback_offsets(from))?;
        let tally = run_with(root, &example_urls(&cluster.endpoints()));
        cluster.down().context("tearing the cluster down")?;
        tally?
    } else {
        run_with(root, &args.url)?
    };
    Ok(if tally.failed == 0 && tally.passed > 0 {
        0
    } else {
        1
    })
}

/// The URLs the examples run on: every backend's, and the Redis Cluster's when there is
/// one ([`dlock_testkit::Endpoints::urls`] leaves it out, as it does the Sentinel group).
pub(crate) fn example_urls(endpoints: &dlock_testkit::Endpoints) -> Vec<String> {
    let mut urls = endpoints.urls();
    urls.extend(endpoints.cluster_url());
    urls
}

/// Builds the examples and the CLI, runs each example on each URL, prints a summary line.
pub(crate) fn run_with(root: &Path, urls: &[String]) -> anyhow::Result<Tally> {
    crate::header("cargo build -p dlock-cli --bin dlock -p dlock-examples --bins");
    let status = crate::cargo()
        .current_dir(root)
        .args([
            "build",
            "-p",
            "dlock-cli",
            "--bin",
            "dlock",
            "-p",
            "dlock-examples",
            "--bins",
        ])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building the examples failed ({status})");
    }
    let bin_dir = crate::target_dir(root).join("debug");
    let mut tally = Tally::default();
    for url in urls {
        let mut skipped = false;
        for (i, example) in EXAMPLES.iter().enumerate() {
            crate::header(&format!("example {example} --url {url}"));
            let status = Command::new(bin_dir.join(example))
                .args(["--url", url])
                .env_remove("DLOCK_URL")
                .status()
                .with_context(|| format!("running example {example}"))?;
            match status.code() {
                Some(0) => tally.passed += 1,
                Some(SKIPPED) => {
                    // This build cannot reach the backend: neither can the rest, nor the
                    // CLI the cron example uses. Count them all as skipped.
                    eprintln!("SKIPPED: the examples on {url}: backend not compiled in");
                    tally.skipped += (EXAMPLES.len() - i) as u64 + 1;
                    skipped = true;
                    break;
                }
                _ => {
                    eprintln!("xtask: example {example} on {url} failed ({status})");
                    tally.failed += 1;
                }
            }
        }
        if skipped {
            continue;
        }
        crate::header(&format!("example cron/run-once.sh {url}"));
        let status = Command::new("bash")
            .arg(root.join("examples").join("cron").join("run-once.sh"))
            .arg(url)
            .env("DLOCK_BIN", bin_dir.join("dlock"))
            .env_remove("DLOCK_URL")
            .status()
            .context("running examples/cron/run-once.sh")?;
        if status.success() {
            tally.passed += 1;
        } else {
            eprintln!("xtask: example cron/run-once.sh on {url} failed ({status})");
            tally.failed += 1;
        }
    }
    println!(
        "examples: {} passed, {} failed, {} skipped",
        tally.passed, tally.failed, tally.skipped
    );
    Ok(tally)
}
