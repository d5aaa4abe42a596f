//! `cargo xtask demo`: the stock-deduction scenario that distributed locks exist for.
//!
//! A shop has `stock` items in a shared counter (a file). `workers` OS processes buy one
//! item at a time: read the counter, and if it is positive, write it back minus one and
//! record the sale. Run once with every purchase inside `dlock exec stock-demo`, and once
//! without a lock; the second run oversells because read-modify-write races.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use dlock_testkit::ClusterSpec;
use indicatif::{ProgressBar, ProgressStyle};

use crate::flags::{DemoArgs, WorkerArgs};

const STOCK_FILE: &str = "stock";
const SALES_FILE: &str = "sales.log";
/// Exit code of `demo-buy` when the counter is at 0: the worker stops.
const SOLD_OUT: i32 = 3;
/// Lock held around each purchase.
const LOCK_NAME: &str = "stock-demo";

pub(crate) fn run(root: &Path, args: &DemoArgs) -> anyhow::Result<i32> {
    // Keep the ZooKeeper alive until the end; dropping it stops the server.
    let (url, _zk) = match &args.url {
        Some(url) => (url.clone(), None),
        None => {
            let cluster = start_zookeeper(root, args.offset.value)?;
            let url = format!("zk://{}", cluster.addrs(dlock_testkit::Backend::Zookeeper));
            (url, Some(cluster))
        }
    };
    let dlock = build_dlock(root)?;
    crate::header(&format!(
        "{} workers buy {} items; every purchase is `dlock --url {url} exec {LOCK_NAME} -- xtask demo-buy`",
        args.workers, args.stock
    ));
    let locked = sell(args, Some((&dlock, &url)))?;
    crate::header(&format!(
        "the same {} workers, no lock (every purchase is `xtask demo-buy`)",
        args.workers
    ));
    let unlocked = sell(args, None)?;

    println!();
    println!(
        "{:<14} | {:>5} | {:>8} | {:>10}",
        "run", "sold", "oversold", "stock left"
    );
    println!("{:-<14}-+-{:->5}-+-{:->8}-+-{:->10}", "", "", "", "");
    for (name, r) in [("with dlock", &locked), ("without lock", &unlocked)] {
        println!(
            "{:<14} | {:>5} | {:>8} | {:>10}",
            name,
            r.sold,
            r.oversold(args.stock),
            r.stock_left
        );
    }
    println!();

    let mut ok = true;
    if locked.oversold(args.stock) != 0 || locked.stock_left != 0 {
        eprintln!(
            "FAIL: the locked run sold {} of {} items",
            locked.sold, args.stock
        );
        ok = false;
    }
    match check_tokens(&locked.tokens) {
        Ok(()) => println!(
            "fencing tokens of the locked run strictly increase ({} purchases, {} .. {})",
            locked.tokens.len(),
            locked.tokens.first().copied().unwrap_or(0),
            locked.tokens.last().copied().unwrap_or(0)
        ),
        Err(e) => {
            eprintln!("FAIL: {e}");
            ok = false;
        }
    }
    if unlocked.oversold(args.stock) > 0 {
        println!(
            "without the lock, {} items that did not exist were sold",
            unlocked.oversold(args.stock)
        );
    } else {
        println!("without the lock this run happened not to oversell; the race is still there");
    }
    Ok(if ok { 0 } else { 1 })
}

fn start_zookeeper(root: &Path, offset: u16) -> anyhow::Result<dlock_testkit::Cluster> {
    let mut spec = ClusterSpec {
        zk: 1,
        etcd: 0,
        redis: 0,
        sentinel_replicas: 0,
        redis_cluster: false,
        port_offset: offset,
        state_path: Some(
            crate::target_dir(root)
                .join("dlock-cluster")
                .join("demo.json"),
        ),
        base_dir: None,
        secure: false,
    };
    crate::cluster::start_with_progress(&mut spec, crate::cluster::fallback_offsets(offset))
}

pub(crate) fn build_dlock(root: &Path) -> anyhow::Result<PathBuf> {
    crate::header("cargo build -p dlock-cli --bin dlock");
    let status = crate::cargo()
        .current_dir(root)
        .args(["build", "-p", "dlock-cli", "--bin", "dlock"])
        .status()
        .context("running cargo build")?;
    if !status.success() {
        bail!("building the dlock CLI failed ({status})");
    }
    let bin = crate::target_dir(root).join("debug").join("dlock");
    if !bin.exists() {
        bail!("{} missing after the build", bin.display());
    }
    Ok(bin)
}

/// What one run left behind.
#[derive(Debug)]
struct Outcome {
    sold: u64,
    stock_left: u64,
    tokens: Vec<u64>,
}

impl Outcome {
    fn oversold(&self, stock: u64) -> u64 {
        self.sold.saturating_sub(stock)
    }
}

fn sell(args: &DemoArgs, lock: Option<(&Path, &str)>) -> anyhow::Result<Outcome> {
    let shop = std::env::temp_dir().join(format!(
        "dlock-demo-{}-{}",
        std::process::id(),
        if lock.is_some() { "locked" } else { "unlocked" }
    ));
    let _ = std::fs::remove_dir_all(&shop);
    std::fs::create_dir_all(&shop).with_context(|| format!("creating {}", shop.display()))?;
    write_stock(&shop, args.stock)?;
    std::fs::write(shop.join(SALES_FILE), "").context("creating the sales log")?;

    let me = std::env::current_exe().context("locating the xtask binary")?;
    let mut workers: Vec<Child> = Vec::new();
    for _ in 0..args.workers {
        let mut cmd = Command::new(&me);
        cmd.arg("demo-worker").arg("--dir").arg(&shop);
        if let Some((dlock, url)) = lock {
            cmd.arg("--dlock").arg(dlock).arg("--url").arg(url);
        }
        workers.push(
            cmd.stdin(Stdio::null())
                .spawn()
                .context("starting a worker")?,
        );
    }

    let bar = ProgressBar::new(args.stock).with_style(
        ProgressStyle::with_template("{prefix:>14} [{bar:40}] {pos}/{len} sold  {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_prefix(if lock.is_some() {
        "with dlock"
    } else {
        "without lock"
    });
    let started = Instant::now();
    let mut failures = Vec::new();
    while !workers.is_empty() {
        show_sold(&bar, args.stock, sales(&shop)?.len() as u64);
        let mut still = Vec::new();
        for mut w in workers {
            match w.try_wait().context("polling a worker")? {
                Some(status) if !status.success() => failures.push(status),
                Some(_) => {}
                None => still.push(w),
            }
        }
        workers = still;
        std::thread::sleep(Duration::from_millis(50));
    }
    let lines = sales(&shop)?;
    show_sold(&bar, args.stock, lines.len() as u64);
    bar.finish();
    eprintln!("  {} purchases in {:.1?}", lines.len(), started.elapsed());
    if !failures.is_empty() {
        bail!(
            "{} worker(s) failed ({:?}); shop left in {}",
            failures.len(),
            failures,
            shop.display()
        );
    }
    let tokens = if lock.is_some() {
        lines
            .iter()
            .map(|l| parse_token(l).with_context(|| format!("sale without a token: {l:?}")))
            .collect::<anyhow::Result<Vec<u64>>>()?
    } else {
        Vec::new()
    };
    let outcome = Outcome {
        sold: lines.len() as u64,
        stock_left: read_stock(&shop)?,
        tokens,
    };
    let _ = std::fs::remove_dir_all(&shop);
    Ok(outcome)
}

/// Moves the bar; past the stock (an oversell) the bar grows so "450/450" shows it.
fn show_sold(bar: &ProgressBar, stock: u64, sold: u64) {
    bar.set_length(stock.max(sold));
    bar.set_position(sold);
}

/// `xtask demo-worker`: buys until the shop is sold out. Each purchase is its own process.
pub(crate) fn worker(args: &WorkerArgs) -> anyhow::Result<i32> {
    let me = std::env::current_exe().context("locating the xtask binary")?;
    loop {
        let mut cmd = match (&args.dlock, &args.url) {
            (Some(dlock), Some(url)) => {
                let mut c = Command::new(dlock);
                c.arg("--url")
                    .arg(url)
                    .arg("exec")
                    .arg(LOCK_NAME)
                    .arg("--timeout")
                    .arg("120s")
                    .arg("--")
                    .arg(&me);
                c
            }
            (None, None) => Command::new(&me),
            _ => bail!("--dlock and --url go together"),
        };
        let status = cmd
            .arg("demo-buy")
            .arg(&args.dir)
            .stdin(Stdio::null())
            .status()
            .context("running a purchase")?;
        match status.code() {
            Some(0) => {}
            Some(SOLD_OUT) => return Ok(0),
            _ => {
                eprintln!("worker {}: purchase failed: {status}", std::process::id());
                return Ok(status.code().unwrap_or(1));
            }
        }
    }
}

/// `xtask demo-buy DIR`: one purchase, deliberately racy without a lock.
pub(crate) fn buy(dir: &Path) -> anyhow::Result<i32> {
    let stock = read_stock(dir)?;
    if stock == 0 {
        return Ok(SOLD_OUT);
    }
    // Widen the window between read and write, as a real service's work would.
    std::thread::sleep(Duration::from_millis(2));
    write_stock(dir, stock - 1)?;
    let token = std::env::var("DLOCK_TOKEN").unwrap_or_else(|_| "-".into());
    let line = format!(
        "pid={} token={token} stock_before={stock}\n",
        std::process::id()
    );
    // O_APPEND with one write per line: concurrent appends do not interleave.
    let mut log = OpenOptions::new()
        .append(true)
        .open(dir.join(SALES_FILE))
        .context("opening the sales log")?;
    log.write_all(line.as_bytes())
        .context("recording the sale")?;
    Ok(0)
}

fn read_stock(dir: &Path) -> anyhow::Result<u64> {
    let path = dir.join(STOCK_FILE);
    let text =
        std::fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    text.trim()
        .parse()
        .with_context(|| format!("{} holds {text:?}, not a number", path.display()))
}

/// Replaces the counter atomically (write a private file, rename over), so a concurrent
/// reader sees the old or the new number, never a torn one.
fn write_stock(dir: &Path, n: u64) -> anyhow::Result<()> {
    let tmp = dir.join(format!("{STOCK_FILE}.{}", std::process::id()));
    std::fs::write(&tmp, format!("{n}\n")).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, dir.join(STOCK_FILE)).context("replacing the counter")
}

fn sales(dir: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(dir.join(SALES_FILE)).context("reading the sales log")?;
    Ok(text.lines().map(str::to_string).collect())
}

fn parse_token(line: &str) -> Option<u64> {
    line.split_whitespace()
        .find_map(|w| w.strip_prefix("token="))?
        .parse()
        .ok()
}

/// Fencing tokens must strictly increase in the order the purchases happened.
fn check_tokens(tokens: &[u64]) -> anyhow::Result<()> {
    if tokens.is_empty() {
        bail!("the locked run recorded no tokens");
    }
    if let Some(i) = tokens.windows(2).position(|w| w[1] <= w[0]) {
        bail!(
            "fencing tokens do not increase: purchase {} had {} after {}",
            i + 2,
            tokens[i + 1],
            tokens[i]
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_check_accepts_increasing_and_rejects_repeats() {
        assert!(check_tokens(&[1, 2, 7, 100]).is_ok());
        let err = check_tokens(&[1, 5, 5]).expect_err("repeat");
        assert!(
            err.to_string().contains("purchase 3 had 5 after 5"),
            "{err}"
        );
        assert!(check_tokens(&[3, 2]).is_err());
        assert!(check_tokens(&[]).is_err());
    }

    #[test]
    fn parses_tokens_from_sales_lines() {
        assert_eq!(parse_token("pid=12 token=4711 stock_before=3"), Some(4711));
        assert_eq!(parse_token("pid=12 token=- stock_before=3"), None);
    }

    #[test]
    fn buy_decrements_until_sold_out() {
        let dir = std::env::temp_dir().join(format!("dlock-demo-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        write_stock(&dir, 2).expect("stock");
        std::fs::write(dir.join(SALES_FILE), "").expect("log");
        assert_eq!(buy(&dir).expect("buy"), 0);
        assert_eq!(buy(&dir).expect("buy"), 0);
        assert_eq!(buy(&dir).expect("buy"), SOLD_OUT);
        assert_eq!(read_stock(&dir).expect("read"), 0);
        let lines = sales(&dir).expect("sales");
        assert_eq!(lines.len(), 2);
        assert!(lines[0].contains("stock_before=2"), "{}", lines[0]);
        assert!(lines[1].contains("stock_before=1"), "{}", lines[1]);
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
