//! Shared plumbing of the dlock examples: the `--url` flag, which backends this build can
//! reach, a stand-in for the storage round trip the locks protect, and the invariant
//! report every example ends with.
//!
//! Every example in `src/bin/` is one real scenario, written only against the `dlock`
//! facade, and checks its own invariant: it prints `ok:` or `BROKEN:` for each check and
//! exits 1 if any is broken (0 otherwise; a dlock error exits with the CLI's code, see
//! [`dlock::exit_code`]). Several *instances* in one example stand for several machines:
//! each has its own [`dlock::Client`], so its own session, exactly as separate processes
//! would.
//!
//! ```sh
//! cargo xtask cluster up --zk 1 --etcd 1 --redis 1      # prints the URLs
//! cargo run -p dlock-examples --bin stock -- --url zk://127.0.0.1:2181
//! cargo xtask cluster down
//! ```
//!
//! | binary | scenario | invariant |
//! |---|---|---|
//! | `stock` | flash sale: instances deduct stock under a [`dlock::Mutex`] | sold = initial stock, oversold = 0 |
//! | `transfer` | bank transfers lock both accounts with a [`dlock::MultiLock`] | balances always sum to the initial total |
//! | `config_cache` | read-mostly config behind a [`dlock::RwLock`] | no torn read, no lost update, downgrade keeps writers out |
//! | `rate_limit` | an upstream API allows N concurrent calls: a [`dlock::Semaphore`] | never more than N calls at once; a crashed caller's permit comes back |
//! | `fenced_write` | a paused holder writes late with a stale token | the store rejects the stale write |
//! | `leader` | a singleton scheduler only the elected leader runs ([`dlock::Election`]), failover on a crash and on resignation | one scheduler at a time; the crashed leader's late dispatch (old term) is rejected |
//! | `cron/run-once.sh` | a cron job on three machines, through `dlock exec` | the job runs exactly once |
//!
//! `cargo xtask examples` runs them all against real servers; `cargo xtask integration`
//! (and so `cargo xtask ci`) runs them inside its cluster.

#![deny(missing_docs)]

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;
use std::time::Duration;

use dlock::{BackendUrl, Servers};

/// The exit code of an example asked to run on a backend this build leaves out (the
/// automake "skipped" convention). `cargo xtask examples` reports it as skipped.
pub const EXIT_SKIPPED: u8 = 77;

/// The flags every example takes.
#[derive(Debug, Clone, clap::Args)]
pub struct Common {
    /// Backend URL: `zk://h:p[,h:p][/chroot]`, `etcd://h:p[,h:p]`, `redis://h:p` or
    /// `redlock://h:p,h:p,h:p`. Defaults to $DLOCK_URL.
    #[arg(long, env = "DLOCK_URL")]
    pub url: String,
}

/// True if this build of the examples can talk to the backend `url` names.
///
/// # Errors
/// [`dlock::Error::InvalidUrl`] for a malformed URL.
pub fn compiled_in(url: &str) -> Result<bool, dlock::Error> {
    // Bound to names: with every feature on, `cfg!` arms would all be `true` literals.
    let (zookeeper, etcd, redis) = (
        cfg!(feature = "zookeeper"),
        cfg!(feature = "etcd"),
        cfg!(feature = "redis"),
    );
    Ok(match BackendUrl::parse(url)?.servers {
        Servers::ZooKeeper { .. } => zookeeper,
        Servers::Etcd { .. } => etcd,
        Servers::Redis { .. }
        | Servers::Redlock { .. }
        | Servers::RedisSentinel { .. }
        | Servers::RedisCluster { .. } => redis,
        _ => false,
    })
}

/// Runs one example: skips (exit [`EXIT_SKIPPED`]) when the backend is not compiled in,
/// runs `scenario` with the URL, prints its report and turns it into the exit code.
pub async fn run<F, Fut>(example: &str, common: &Common, scenario: F) -> ExitCode
where
    F: FnOnce(String) -> Fut,
    Fut: Future<Output = Result<Report, dlock::Error>>,
{
    match compiled_in(&common.url) {
        Ok(true) => {}
        Ok(false) => {
            eprintln!(
                "SKIPPED: {example}: this build of the examples has no feature for {}",
                common.url
            );
            return ExitCode::from(EXIT_SKIPPED);
        }
        Err(e) => {
            eprintln!("{example}: {e}");
            return ExitCode::from(code(&e));
        }
    }
    println!("{example} on {}", common.url);
    match scenario(common.url.clone()).await {
        Ok(report) => report.finish(example),
        Err(e) => {
            eprintln!("{example}: {e}");
            ExitCode::from(code(&e))
        }
    }
}

fn code(e: &dlock::Error) -> u8 {
    u8::try_from(dlock::exit_code(e)).unwrap_or(1)
}

/// The checks of one example run.
#[derive(Debug, Default)]
pub struct Report {
    broken: Vec<String>,
}

impl Report {
    /// An empty report.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one invariant: prints `ok: what` when `holds`, `BROKEN: what` otherwise.
    pub fn check(&mut self, holds: bool, what: impl Display) {
        if holds {
            println!("  ok: {what}");
        } else {
            println!("  BROKEN: {what}");
            self.broken.push(what.to_string());
        }
    }

    /// Prints an observation that is not an invariant (counts, peaks).
    pub fn note(&self, what: impl Display) {
        println!("  note: {what}");
    }

    /// True if every check so far held.
    pub fn all_ok(&self) -> bool {
        self.broken.is_empty()
    }

    /// Prints the verdict; exit code 0 if every check held, 1 otherwise.
    pub fn finish(self, example: &str) -> ExitCode {
        if self.broken.is_empty() {
            println!("{example}: PASS");
            ExitCode::SUCCESS
        } else {
            println!(
                "{example}: FAIL ({} invariant(s) broken)",
                self.broken.len()
            );
            ExitCode::from(1)
        }
    }
}

/// A lock-name prefix unique to this run, so runs against a shared cluster (or a rerun
/// after a crash left entries behind) never queue behind each other.
pub fn run_id() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    format!("{}-{nanos:08x}", std::process::id())
}

/// Stands in for one round trip to the storage the lock protects (a database row, a Redis
/// key, a file on NFS). The await is what lets unlocked read-modify-write cycles
/// interleave, as they do in production.
pub async fn storage_round_trip() {
    tokio::time::sleep(Duration::from_millis(1)).await;
}

/// A small deterministic pseudo-random generator (xorshift64*), so the examples need no
/// extra dependency and a run can be replayed from its seed.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (0 is replaced by a fixed non-zero seed).
    pub fn new(seed: u64) -> Self {
        Rng(if seed == 0 {
            0x9E37_79B9_7F4A_7C15
        } else {
            seed
        })
    }

    /// A number in `0..n` (`0` when `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        let x = self.0.wrapping_mul(0x2545_F491_4F6C_DD1D);
        if n == 0 {
            0
        } else {
            x % n
        }
    }
}

/// Awaits every task, turning a panicked task into an error instead of a panic here.
///
/// # Errors
/// The first task's error, or [`dlock::Error::Backend`] if a task panicked.
pub async fn join_all<T>(
    tasks: Vec<tokio::task::JoinHandle<Result<T, dlock::Error>>>,
) -> Result<Vec<T>, dlock::Error> {
    let mut out = Vec::with_capacity(tasks.len());
    let mut first_err = None;
    for t in tasks {
        match t.await {
            Ok(Ok(v)) => out.push(v),
            Ok(Err(e)) => {
                first_err.get_or_insert(e);
            }
            Err(join) => {
                first_err.get_or_insert(dlock::Error::backend("example task", join.to_string()));
            }
        }
    }
    match first_err {
        Some(e) => Err(e),
        None => Ok(out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_stays_in_range_and_replays() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..1000 {
            let x = a.below(6);
            assert!(x < 6);
            assert_eq!(x, b.below(6));
        }
        assert_eq!(Rng::new(1).below(0), 0);
    }

    #[test]
    fn report_fails_on_a_broken_check() {
        let mut r = Report::new();
        r.check(true, "fine");
        assert!(r.all_ok());
        r.check(false, "broken");
        assert!(!r.all_ok());
    }

    #[test]
    fn compiled_in_follows_features() {
        assert_eq!(
            compiled_in("zk://127.0.0.1:2181").ok(),
            Some(cfg!(feature = "zookeeper"))
        );
        assert_eq!(
            compiled_in("etcd://127.0.0.1:2379").ok(),
            Some(cfg!(feature = "etcd"))
        );
        assert!(compiled_in("ftp://x:1").is_err());
    }
}
