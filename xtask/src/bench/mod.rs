//! `cargo xtask bench`: dlock-bench beside the peers, summarised as a markdown table of
//! ratios (dlock/peer, dlock/ceiling) against the targets, JSON under `target/bench/`
//! and an SVG chart.
//!
//! Three sources of result lines:
//! - default: start ZooKeeper 1 + etcd 1 + Redis 5 (testkit), run `dlock-bench` (release)
//!   `--repeats` times, plus `redis-benchmark -c 1 -P 1` as the Redis wire ceiling;
//! - `--peers DIR`: run `DIR/run.sh` (the peer harness: Curator, kazoo, redis-py, rslock,
//!   etcd's lock) with `RUST_BENCH_CMD` set to dlock-bench, so dlock runs interleaved
//!   with the peers against the same servers;
//! - `--from FILE`: re-summarise a saved raw file of result lines.
//!
//! Where to start: [`run`] picks the source of result lines and ties the steps together.
//! `runner.rs` starts the servers and runs the benchmarks, `parse.rs` turns the result lines
//! into medians, `render.rs` writes the markdown table, the JSON and the SVG chart.

mod parse;
mod render;
mod runner;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressStyle};

use crate::flags::BenchArgs;
use parse::{check_herd, check_smoke, parse_line, summarise, Row};
use render::markdown;
use runner::{build_bench, run_own, run_peers};

pub(crate) fn run(root: &Path, args: &BenchArgs) -> anyhow::Result<i32> {
    let out_dir = crate::target_dir(root).join("bench");
    std::fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let (lines, ok) = if let Some(from) = &args.from {
        let text =
            std::fs::read_to_string(from).with_context(|| format!("reading {}", from.display()))?;
        (
            text.lines()
                .filter(|l| parse_line(l).is_some() && !l.starts_with("SUMMARY"))
                .map(str::to_owned)
                .collect(),
            true,
        )
    } else {
        let bin = build_bench(root, true)?;
        let bar = ProgressBar::new(u64::from(args.repeats));
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] run {pos}/{len} {wide_msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.enable_steady_tick(Duration::from_millis(200));
        let r = if let Some(peers) = &args.peers {
            run_peers(root, args, &bin, peers, &bar)
        } else {
            run_own(root, args, &bin, &bar)
        };
        bar.finish_and_clear();
        r?
    };
    let rows: Vec<Row> = lines.iter().filter_map(|l| parse_line(l)).collect();
    let sums = summarise(&rows);
    let md = markdown(&sums);
    println!("{md}");
    render::write_files(&out_dir, args, &lines, &sums, &md)?;
    Ok(if ok { 0 } else { 1 })
}

/// `cargo xtask ci`'s smoke pass: dlock-bench for a fraction of a second against the
/// integration servers; the lines must parse with no violation. Then the herd check:
/// `S1` with 20 and 200 waiters queued on a mutex and on a semaphore, whose server
/// requests per release must not grow with the queue ([`check_herd`]). Counts of
/// server requests, never a timed assertion.
pub(crate) fn smoke(root: &Path, endpoints: &dlock_testkit::Endpoints) -> anyhow::Result<bool> {
    let bin = build_bench(root, false)?;
    // The first node of each cluster is enough; Redlock gets every master.
    let first = |v: &Option<String>| {
        v.as_ref()
            .map(|s| s.split(',').next().unwrap_or(s).to_owned())
    };
    let servers: Vec<(&str, String)> = [
        ("--zk", first(&endpoints.zk)),
        ("--etcd", first(&endpoints.etcd)),
        ("--redis", first(&endpoints.redis)),
        ("--redlock", endpoints.redlock.clone()),
    ]
    .into_iter()
    .filter_map(|(flag, v)| v.map(|v| (flag, v)))
    .collect();
    let run = |args: &[&str]| -> anyhow::Result<(bool, Vec<String>)> {
        let mut cmd = Command::new(&bin);
        cmd.args(args);
        for (flag, v) in &servers {
            cmd.args([flag, v.as_str()]);
        }
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .context("running dlock-bench")?;
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<String> = text.lines().map(str::to_owned).collect();
        for l in &lines {
            eprintln!("  {l}");
        }
        if !out.status.success() {
            eprintln!("dlock-bench: exit status {}", out.status);
        }
        Ok((out.status.success(), lines))
    };
    crate::header("dlock-bench smoke pass (--duration 0.2)");
    let (ok, lines) = run(&[
        "--duration",
        "0.2",
        "--workers",
        "3",
        "--leases",
        "2",
        "--prefix",
        "xtask-smoke",
    ])?;
    match check_smoke(&lines) {
        Ok(n) if ok => eprintln!("dlock-bench smoke: {n} dlock workloads ran, 0 violations"),
        Ok(_) => return Ok(false),
        Err(e) => {
            eprintln!("dlock-bench smoke failed: {e:#}");
            return Ok(false);
        }
    }
    crate::header("dlock-bench herd check (S1, 20 and 200 waiters)");
    let (ok, lines) = run(&[
        "--only",
        "S1",
        "--waiters",
        "20,200",
        "--leases",
        "2",
        "--prefix",
        "xtask-herd",
    ])?;
    match check_herd(&lines) {
        Ok(n) if ok => {
            eprintln!("dlock-bench herd check: {n} queues, requests per release flat");
            Ok(true)
        }
        Ok(_) => Ok(false),
        Err(e) => {
            eprintln!("dlock-bench herd check failed: {e:#}");
            Ok(false)
        }
    }
}
