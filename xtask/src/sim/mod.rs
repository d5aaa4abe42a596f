//! `cargo xtask sim`: every recipe over the in-memory backend (`dlock_testkit::mem`)
//! under seeded fault schedules (dropped and late replies and watch events, workers cut
//! off, waiters' entries deleted from outside), on virtual time, checked by the chaos suite's checker
//! for mutual exclusion, permit bounds, reader/writer rules and token order, and for
//! entries left behind.
//!
//! Where to start: [`run`] loops over the seeds; [`world::run_seed`] is one seed: its
//! servers, workers, faults and verdict. A seed runs on a current-thread runtime with
//! paused time, so it takes milliseconds and a failing seed replays exactly
//! (`cargo xtask sim --seed N --seeds 1`).

mod world;

use anyhow::bail;

use crate::chaos::Recipe;
use crate::flags::SimArgs;

/// `cargo xtask sim`: runs `--seeds` seeds from `--seed`, each recipe in turn; fails on
/// the first seed with a violation, after printing how to replay it.
pub(crate) fn run(args: &SimArgs) -> anyhow::Result<()> {
    let recipes: Vec<Recipe> = match &args.recipe {
        Some(r) => vec![Recipe::parse(r)?],
        None => Recipe::ALL.to_vec(),
    };
    let started = std::time::Instant::now();
    let mut sections = 0u64;
    let mut faults = 0u64;
    let mut deleted = 0u64;
    let mut per_recipe = vec![0u64; recipes.len()];
    for i in 0..args.seeds {
        let seed = args.seed.wrapping_add(i);
        let which = (seed % recipes.len() as u64) as usize;
        let recipe = recipes[which];
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .start_paused(true)
            .build()?;
        let outcome = rt.block_on(world::run_seed(seed, recipe))?;
        sections += outcome.sections;
        faults += outcome.faults;
        deleted += outcome.deleted;
        per_recipe[which] += 1;
        if !outcome.violations.is_empty() {
            for v in &outcome.violations {
                eprintln!("sim: seed {seed} ({}): {v}", recipe.label());
            }
            bail!(
                "sim: seed {seed} failed; replay it with: cargo xtask sim --seed {seed} --seeds 1 --recipe {}",
                recipe.label()
            );
        }
    }
    let counts: Vec<String> = recipes
        .iter()
        .zip(&per_recipe)
        .map(|(r, n)| format!("{} {n}", r.label()))
        .collect();
    println!(
        "sim: {} seeds from {} ({}): {sections} sections, {faults} partitions, {deleted} waiters' entries deleted from outside, 0 violations, in {:.1?}",
        args.seeds,
        args.seed,
        counts.join(", "),
        started.elapsed()
    );
    println!("sim: {} passed, 0 failed", args.seeds);
    Ok(())
}
