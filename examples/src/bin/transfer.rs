//! Bank transfers that lock both accounts at once with a [`dlock::MultiLock`].
//!
//! A transfer reads two balances and writes both back; it must not interleave with
//! another transfer touching either account. Each teller locks *both* accounts
//! all-or-nothing (Curator's InterProcessMultiLock, the article's "bank transfer locks
//! both sides" case). Tellers name the two accounts in whatever order the transfer goes
//! (A→B and B→A), which deadlocks with naive nested locking; dlock's multi-lock takes
//! the parts in one global order, so it cannot. An auditor locks every account now and
//! then and checks that the money adds up.
//!
//! ```sh
//! cargo run -p dlock-examples --bin transfer -- --url zk://127.0.0.1:2181
//! cargo run -p dlock-examples --bin transfer -- --url zk://127.0.0.1:2181 --no-lock  # money vanishes, exits 1
//! ```

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use clap::Parser;
use dlock_examples::{join_all, run_id, storage_round_trip, Common, Report, Rng};

#[derive(Debug, Parser)]
#[command(about = "Bank transfers under a two-account dlock multi-lock")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Accounts in the bank.
    #[arg(long, default_value_t = 5)]
    accounts: u64,
    /// Opening balance of each account.
    #[arg(long, default_value_t = 100)]
    opening: i64,
    /// Machines (each its own dlock session), each running two tellers.
    #[arg(long, default_value_t = 3)]
    instances: usize,
    /// Transfers per teller.
    #[arg(long, default_value_t = 6)]
    transfers: usize,
    /// Transfer and audit without locks, to see the money the locks protect vanish
    /// (exits 1).
    #[arg(long)]
    no_lock: bool,
}

/// The ledger: one balance per account, each read and write atomic on its own (a row).
#[derive(Default)]
struct Ledger {
    balances: StdMutex<BTreeMap<u64, i64>>,
}

impl Ledger {
    async fn balance(&self, account: u64) -> Result<i64, dlock::Error> {
        storage_round_trip().await;
        Ok(*self.rows()?.get(&account).unwrap_or(&0))
    }

    async fn set_balance(&self, account: u64, v: i64) -> Result<(), dlock::Error> {
        storage_round_trip().await;
        self.rows()?.insert(account, v);
        Ok(())
    }

    fn rows(&self) -> Result<std::sync::MutexGuard<'_, BTreeMap<u64, i64>>, dlock::Error> {
        self.balances
            .lock()
            .map_err(|_| dlock::Error::backend("ledger", "poisoned by a panicked task"))
    }
}

fn account_lock(run: &str, account: u64) -> String {
    format!("examples/{run}/bank/account/{account}")
}

/// What one teller did.
#[derive(Debug, Default)]
struct Tally {
    done: usize,
    declined: usize,
}

async fn teller(
    client: dlock::Client,
    ledger: Arc<Ledger>,
    run: Arc<str>,
    accounts: u64,
    transfers: usize,
    seed: u64,
    lock: bool,
) -> Result<Tally, dlock::Error> {
    let mut rng = Rng::new(seed);
    let mut tally = Tally::default();
    for _ in 0..transfers {
        let from = rng.below(accounts);
        let to = (from + 1 + rng.below(accounts - 1)) % accounts;
        let amount = 1 + rng.below(40) as i64;
        // Listed as the transfer goes, from then to: the multi-lock reorders them.
        let mut both = match lock {
            true => Some(
                client
                    .multi()
                    .mutex(&account_lock(&run, from))?
                    .mutex(&account_lock(&run, to))?
                    .acquire_timeout(Duration::from_secs(60))
                    .await?,
            ),
            false => None,
        };
        let a = ledger.balance(from).await?;
        if a >= amount {
            let b = ledger.balance(to).await?;
            ledger.set_balance(from, a - amount).await?;
            ledger.set_balance(to, b + amount).await?;
            tally.done += 1;
        } else {
            tally.declined += 1;
        }
        if let Some(both) = &mut both {
            both.release().await?;
        }
    }
    Ok(tally)
}

/// Locks every account and sums the balances: a consistent snapshot mid-run.
async fn audit(
    client: &dlock::Client,
    ledger: &Ledger,
    run: &str,
    accounts: u64,
    lock: bool,
) -> Result<(i64, i64), dlock::Error> {
    let mut guard = None;
    if lock {
        let mut all = client.multi();
        for a in 0..accounts {
            all = all.mutex(&account_lock(run, a))?;
        }
        guard = Some(all.acquire_timeout(Duration::from_secs(60)).await?);
    }
    let mut sum = 0;
    let mut min = i64::MAX;
    for a in 0..accounts {
        let b = ledger.balance(a).await?;
        sum += b;
        min = min.min(b);
    }
    if let Some(g) = &mut guard {
        g.release().await?;
    }
    Ok((sum, min))
}

async fn scenario(url: String, args: Args) -> Result<Report, dlock::Error> {
    if args.accounts < 2 {
        return Err(dlock::Error::InvalidPermits(
            "a transfer needs at least 2 accounts".into(),
        ));
    }
    let run: Arc<str> = Arc::from(run_id());
    let ledger = Arc::new(Ledger::default());
    for a in 0..args.accounts {
        ledger.rows()?.insert(a, args.opening);
    }
    let total = args.opening * args.accounts as i64;

    let mut clients = Vec::new();
    let mut tellers = Vec::new();
    for i in 0..args.instances {
        let client = dlock::connect(&url).await?;
        for t in 0..2u64 {
            tellers.push(tokio::spawn(teller(
                client.clone(),
                ledger.clone(),
                run.clone(),
                args.accounts,
                args.transfers,
                1 + i as u64 * 2 + t,
                !args.no_lock,
            )));
        }
        clients.push(client);
    }

    let mut r = Report::new();
    // The auditor runs while the tellers work, on its own session.
    let auditor = dlock::connect(&url).await?;
    let mut audits = Vec::new();
    while tellers.iter().any(|t| !t.is_finished()) {
        audits.push(audit(&auditor, &ledger, &run, args.accounts, !args.no_lock).await?);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let tallies = join_all(tellers).await?;
    audits.push(audit(&auditor, &ledger, &run, args.accounts, !args.no_lock).await?);
    auditor.close().await?;
    for c in &clients {
        c.close().await?;
    }

    let done: usize = tallies.iter().map(|t| t.done).sum();
    let declined: usize = tallies.iter().map(|t| t.declined).sum();
    r.note(format!(
        "{done} transfers done, {declined} declined for lack of funds, {} audits",
        audits.len()
    ));
    r.check(
        done + declined == args.instances * 2 * args.transfers,
        "every transfer finished (no deadlock between opposite-order transfers)",
    );
    let bad_sums: Vec<i64> = audits
        .iter()
        .map(|(s, _)| *s)
        .filter(|s| *s != total)
        .collect();
    r.check(
        bad_sums.is_empty(),
        format!("every audit sums to the opening total {total} (wrong sums: {bad_sums:?})"),
    );
    r.check(
        audits.iter().all(|(_, min)| *min >= 0),
        "no account ever went negative",
    );
    let end: i64 = ledger.rows()?.values().sum();
    r.check(
        end == total,
        format!("closing balances sum to {end}, opening total {total}"),
    );
    Ok(r)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let common = args.common.clone();
    dlock_examples::run("transfer", &common, |url| scenario(url, args)).await
}
