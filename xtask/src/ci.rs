//! `cargo xtask ci`: the whole gate, fail fast: fmt, clippy, rustdoc (warnings denied),
//! the publish checks (rust-version against the dependencies', `cargo deny check licenses
//! bans`, `cargo package`; see [`crate::publish`]), the seeded simulation (10,000 seeds over the in-memory backend), then integration (tests, doc tests, the examples, a dlock-bench smoke pass whose
//! speeds are never asserted, and a herd check on server request counts), the demo, then the short chaos run. `.ci/run` calls
//! exactly this.

use std::path::Path;

use anyhow::Context as _;

use crate::flags::{ChaosArgs, IntegrationArgs};

pub(crate) fn run(root: &Path, args: &IntegrationArgs) -> anyhow::Result<i32> {
    let steps: [(&str, &[&str]); 2] = [
        (
            "cargo fmt --all -- --check",
            &["fmt", "--all", "--", "--check"],
        ),
        (
            "cargo clippy --workspace --all-targets -- -D warnings",
            &[
                "clippy",
                "--workspace",
                "--all-targets",
                "--",
                "-D",
                "warnings",
            ],
        ),
    ];
    for (title, cargo_args) in steps {
        crate::header(title);
        let status = crate::cargo()
            .current_dir(root)
            .args(cargo_args)
            .status()
            .with_context(|| format!("running {title}"))?;
        if !status.success() {
            eprintln!("xtask ci: `{title}` failed ({status})");
            return Ok(status.code().unwrap_or(1));
        }
    }
    // Rustdoc with warnings denied: broken intra-doc links and bad doc markup fail CI.
    let title = "RUSTDOCFLAGS=-D warnings cargo doc --workspace --no-deps";
    crate::header(title);
    let status = crate::cargo()
        .current_dir(root)
        .args(["doc", "--workspace", "--no-deps"])
        .env("RUSTDOCFLAGS", "-D warnings")
        .status()
        .with_context(|| format!("running {title}"))?;
    if !status.success() {
        eprintln!("xtask ci: `{title}` failed ({status})");
        return Ok(status.code().unwrap_or(1));
    }
    // The crates stay publishable: an honest rust-version, licenses and duplicates, and
    // every publishable crate packs and builds from its package.
    let code = crate::publish::run(root, &[])?;
    if code != 0 {
        return Ok(code);
    }
    // The seeded simulation: every recipe over the in-memory backend under drawn faults,
    // 10,000 seeds on virtual time (about 20 s), before anything needs a server.
    crate::header("cargo xtask sim --seeds 10000");
    crate::sim::run(&crate::flags::SimArgs {
        seeds: 10_000,
        seed: 0,
        recipe: None,
    })?;
    let code = crate::integration::run_with(root, args, true)?;
    if code != 0 {
        return Ok(code);
    }
    // The README's main job, end to end: it checks its own result (no oversell,
    // increasing tokens) and fails otherwise.
    crate::header("cargo xtask demo --stock 100");
    let demo = crate::flags::DemoArgs {
        url: None,
        stock: 100,
        workers: 8,
        offset: args.offset.clone(),
    };
    let code = crate::demo::run(root, &demo)?;
    if code != 0 {
        return Ok(code);
    }
    // The short chaos run: one seeded random round per backend this build has, every
    // recipe, on its own servers far from the integration ports and below the
    // ephemeral ones (see `ChaosArgs::port_offset`).
    crate::header("cargo xtask chaos --short");
    crate::chaos::run(
        root,
        &ChaosArgs {
            backends: Vec::new(),
            scenarios: Vec::new(),
            recipes: Vec::new(),
            seed: None,
            rounds: None,
            list: false,
            short: true,
            no_docs: true,
            port_offset: args.offset.value.saturating_add(25_000),
        },
    )
}
