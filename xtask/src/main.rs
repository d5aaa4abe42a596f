//! `cargo xtask`: dlock's developer tasks, as an ordinary Rust binary (see
//! matklad/cargo-xtask). One module per task; flags live in [`flags`].
//!
//! - `cluster up|down|status`: real ZooKeeper / etcd / Redis servers on 127.0.0.1.
//! - `integration`: start servers, export `DLOCK_TEST_*`, run every test, tear down.
//! - `ci`: fmt check, clippy, rustdoc, the publish checks, integration (with the examples), a dlock-bench smoke pass and herd check. What `.ci/run` calls.
//! - `publish-check`: the publish checks of `ci` alone: rust-version, `cargo deny`, `cargo package`.
//! - `examples`: every example of `examples/` once against real servers.
//! - `demo`: the stock-deduction scenario, with and without the lock.
//! - `bench`: dlock-bench beside the peers; markdown table, JSON, SVG chart.
//! - `chaos`: faults on real servers and processes, the safety table (docs/safety.md).

mod bench;
mod chaos;
mod ci;
mod cluster;
mod demo;
mod examples;
mod flags;
mod integration;
mod publish;
mod sim;
mod teardown;

use std::path::{Path, PathBuf};
use std::process::Command;

use clap::Parser as _;

fn main() -> anyhow::Result<()> {
    let cli = flags::Cli::parse();
    let root = project_root();
    let code = match cli.task {
        flags::Task::Cluster(args) => cluster::run_args(&root, args)?,
        flags::Task::Integration(args) => integration::run(&root, &args)?,
        flags::Task::Ci(args) => ci::run(&root, &args)?,
        flags::Task::PublishCheck(args) => publish::run(&root, &args.steps)?,
        flags::Task::Demo(args) => demo::run(&root, &args)?,
        flags::Task::Bench(args) => bench::run(&root, &args)?,
        flags::Task::Examples(args) => examples::run(&root, &args)?,
        flags::Task::DemoWorker(args) => demo::worker(&args)?,
        flags::Task::DemoBuy(args) => demo::buy(&args.dir)?,
        flags::Task::Chaos(args) => chaos::run(&root, &args)?,
        flags::Task::Sim(args) => {
            sim::run(&args)?;
            0
        }
        flags::Task::ChaosWorker(args) => chaos::worker::worker(&args)?,
        flags::Task::ChaosSection(args) => chaos::worker::chaos_section(&args)?,
    };
    std::process::exit(code)
}

/// The workspace root: the parent of this crate's manifest directory.
fn project_root() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    manifest.parent().unwrap_or(manifest).to_path_buf()
}

/// The cargo that runs us (`$CARGO`), so sub-builds use the same toolchain.
fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// The target directory cargo builds into (`$CARGO_TARGET_DIR` or `<root>/target`).
fn target_dir(root: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|p| if p.is_absolute() { p } else { root.join(p) })
        .unwrap_or_else(|| root.join("target"))
}

/// Prints a step header, so a long CI log shows where each step starts.
fn header(text: &str) {
    eprintln!("\n==> {text}");
}
