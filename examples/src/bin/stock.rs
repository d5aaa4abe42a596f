//! Stock deduction without oversell: a flash sale on several machines.
//!
//! The shop keeps the stock of one item in shared storage (in the article this example
//! follows, a Redis key `stock=300`, with etcd as the lock service). Every purchase is a
//! read-modify-write: read the stock, and if it is positive, write it back minus one and
//! record the sale. Without a lock two buyers read the same value and both sell the
//! last item. Here every purchase runs under one [`dlock::Mutex`], and the example checks
//! that exactly the initial stock was sold and not one item more.
//!
//! ```sh
//! cargo run -p dlock-examples --bin stock -- --url zk://127.0.0.1:2181
//! cargo run -p dlock-examples --bin stock -- --url zk://127.0.0.1:2181 --no-lock  # oversells, exits 1
//! ```

use std::process::ExitCode;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use clap::Parser;
use dlock::FencingToken;
use dlock_examples::{join_all, run_id, storage_round_trip, Common, Report};

#[derive(Debug, Parser)]
#[command(about = "Stock deduction without oversell, under a dlock mutex")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Items in stock at the start.
    #[arg(long, default_value_t = 40)]
    stock: i64,
    /// Machines (each its own dlock session).
    #[arg(long, default_value_t = 3)]
    instances: usize,
    /// Concurrent buyers per machine.
    #[arg(long, default_value_t = 3)]
    buyers: usize,
    /// Buy without the lock, to see the oversell the lock prevents (exits 1).
    #[arg(long)]
    no_lock: bool,
}

/// The shared storage: each read and each write is atomic on its own, as a Redis GET or
/// SET is, but a read followed by a write is not.
#[derive(Default)]
struct Shop {
    stock: StdMutex<i64>,
    /// Every sale, in the order it was written: (buyer, fencing token).
    sales: StdMutex<Vec<(String, Option<FencingToken>)>>,
}

impl Shop {
    async fn read_stock(&self) -> i64 {
        storage_round_trip().await;
        self.stock.lock().map(|s| *s).unwrap_or_default()
    }

    async fn write_stock(&self, v: i64) {
        storage_round_trip().await;
        if let Ok(mut s) = self.stock.lock() {
            *s = v;
        }
    }

    fn record_sale(&self, buyer: &str, token: Option<FencingToken>) {
        if let Ok(mut s) = self.sales.lock() {
            s.push((buyer.to_owned(), token));
        }
    }
}

/// One purchase attempt; false once sold out.
async fn buy(shop: &Shop, buyer: &str, token: Option<FencingToken>) -> bool {
    let left = shop.read_stock().await;
    if left <= 0 {
        return false;
    }
    shop.write_stock(left - 1).await;
    shop.record_sale(buyer, token);
    true
}

async fn buyer(
    shop: Arc<Shop>,
    mutex: Option<dlock::Mutex>,
    name: String,
) -> Result<usize, dlock::Error> {
    let mut bought = 0;
    loop {
        let more = match &mutex {
            Some(m) => {
                // A generous bound: a purchase that cannot get the lock in 60 s is an
                // outage, not contention, and should fail loudly (exit 75).
                let mut guard = m.lock_timeout(Duration::from_secs(60)).await?;
                let more = buy(&shop, &name, Some(guard.token())).await;
                guard.release().await?;
                more
            }
            None => buy(&shop, &name, None).await,
        };
        if !more {
            return Ok(bought);
        }
        bought += 1;
    }
}

async fn scenario(url: String, args: Args) -> Result<Report, dlock::Error> {
    let shop = Arc::new(Shop::default());
    *shop.stock.lock().map_err(|_| poisoned())? = args.stock;
    let lock_name = format!("examples/{}/shop/sku-1001/stock", run_id());

    let mut clients = Vec::new();
    let mut tasks = Vec::new();
    for i in 0..args.instances {
        // One client per machine: its own session, as a separate process would have.
        let client = dlock::connect(&url).await?;
        let mutex = if args.no_lock {
            None
        } else {
            Some(client.mutex(&lock_name)?)
        };
        for b in 0..args.buyers {
            tasks.push(tokio::spawn(buyer(
                shop.clone(),
                mutex.clone(),
                format!("machine-{i}/buyer-{b}"),
            )));
        }
        clients.push(client);
    }
    let per_buyer = join_all(tasks).await?;
    for c in &clients {
        c.close().await?;
    }

    let sales = shop.sales.lock().map_err(|_| poisoned())?.clone();
    let stock_left = *shop.stock.lock().map_err(|_| poisoned())?;
    let sold = sales.len() as i64;
    let mut r = Report::new();
    r.note(format!(
        "{} buyers on {} machines; purchases per buyer: {per_buyer:?}",
        args.instances * args.buyers,
        args.instances
    ));
    r.check(
        sold - args.stock <= 0,
        format!(
            "oversold = {} (sold {sold} of {} items)",
            (sold - args.stock).max(0),
            args.stock
        ),
    );
    r.check(
        sold == args.stock && stock_left == 0,
        format!("every item sold exactly once: sold {sold}, stock left {stock_left}"),
    );
    r.check(
        per_buyer.iter().sum::<usize>() as i64 == sold,
        "every successful purchase is in the sales log",
    );
    if !args.no_lock {
        let tokens: Vec<u64> = sales
            .iter()
            .filter_map(|(_, t)| t.map(|t| t.get()))
            .collect();
        r.check(
            tokens.len() == sales.len() && tokens.windows(2).all(|w| w[0] < w[1]),
            format!(
                "fencing tokens grow from sale to sale ({} .. {})",
                tokens.first().copied().unwrap_or(0),
                tokens.last().copied().unwrap_or(0)
            ),
        );
    }
    Ok(r)
}

fn poisoned() -> dlock::Error {
    dlock::Error::backend("stock example", "shop state poisoned by a panicked task")
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let common = args.common.clone();
    dlock_examples::run("stock", &common, |url| scenario(url, args)).await
}
