//! A read-mostly configuration behind a [`dlock::RwLock`].
//!
//! Services read the shared configuration all the time and change it rarely (the
//! article's "read-mostly resources such as caches and system configuration"). A
//! configuration is two records written one after the other — its version and its body —
//! so a reader that reads between the two writes sees a torn configuration. Readers hold
//! the read side, many at once; publishers hold the write side, alone. A publisher
//! *downgrades* after publishing (takes the read side, then drops the write side) to
//! check its own publication without letting the other publisher in between.
//!
//! Each reader keeps a local cache and reads the body only when the version moved: a read
//! that finds its cache current costs one round trip under the shared lock.
//!
//! ```sh
//! cargo run -p dlock-examples --bin config_cache -- --url zk://127.0.0.1:2181
//! cargo run -p dlock-examples --bin config_cache -- --url zk://127.0.0.1:2181 --no-lock  # torn reads, exits 1
//! ```

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use clap::Parser;
use dlock_examples::{join_all, run_id, storage_round_trip, Common, Report};

#[derive(Debug, Parser)]
#[command(about = "A read-mostly config behind a dlock read/write lock")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Readers (each on its own session).
    #[arg(long, default_value_t = 4)]
    readers: usize,
    /// Reads per reader.
    #[arg(long, default_value_t = 10)]
    reads: usize,
    /// Publications per publisher (there are two publishers).
    #[arg(long, default_value_t = 3)]
    updates: u64,
    /// Read and publish without the lock, to see torn reads and lost updates (exits 1).
    #[arg(long)]
    no_lock: bool,
}

/// The shared store: two records, each read or written atomically on its own.
#[derive(Default)]
struct Store {
    version: StdMutex<u64>,
    body: StdMutex<String>,
}

fn body_of(version: u64) -> String {
    format!(
        "feature-flags v{version}: checkout=on, search=v{}",
        version % 3
    )
}

impl Store {
    async fn read_version(&self) -> u64 {
        storage_round_trip().await;
        self.version.lock().map(|v| *v).unwrap_or(u64::MAX)
    }

    async fn read_body(&self) -> String {
        storage_round_trip().await;
        self.body.lock().map(|b| b.clone()).unwrap_or_default()
    }

    async fn publish(&self, version: u64) {
        storage_round_trip().await;
        if let Ok(mut v) = self.version.lock() {
            *v = version;
        }
        // The window a reader without the lock would fall into.
        storage_round_trip().await;
        if let Ok(mut b) = self.body.lock() {
            *b = body_of(version);
        }
    }
}

/// Readers inside the read side right now, and the most seen at once.
#[derive(Default)]
struct Gauge {
    now: AtomicUsize,
    peak: AtomicUsize,
}

#[derive(Debug, Default)]
struct ReaderTally {
    reads: usize,
    refreshes: usize,
    torn: usize,
}

async fn reader(
    rw: Option<dlock::RwLock>,
    store: Arc<Store>,
    gauge: Arc<Gauge>,
    reads: usize,
) -> Result<ReaderTally, dlock::Error> {
    let mut cache: Option<(u64, String)> = None;
    let mut t = ReaderTally::default();
    for _ in 0..reads {
        let mut guard = match &rw {
            Some(rw) => Some(rw.read_timeout(Duration::from_secs(60)).await?),
            None => None,
        };
        let inside = gauge.now.fetch_add(1, Ordering::SeqCst) + 1;
        gauge.peak.fetch_max(inside, Ordering::SeqCst);
        let version = store.read_version().await;
        if cache.as_ref().map(|(v, _)| *v) != Some(version) {
            let body = store.read_body().await;
            if body != body_of(version) {
                t.torn += 1;
            }
            cache = Some((version, body));
            t.refreshes += 1;
        }
        t.reads += 1;
        gauge.now.fetch_sub(1, Ordering::SeqCst);
        if let Some(g) = &mut guard {
            g.release().await?;
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(t)
}

#[derive(Debug, Default)]
struct PublisherTally {
    published: u64,
    downgrade_saw_own: u64,
}

async fn publisher(
    rw: Option<dlock::RwLock>,
    store: Arc<Store>,
    updates: u64,
) -> Result<PublisherTally, dlock::Error> {
    let mut t = PublisherTally::default();
    for _ in 0..updates {
        let mut write = match &rw {
            Some(rw) => Some(rw.write_timeout(Duration::from_secs(60)).await?),
            None => None,
        };
        // Next version = current + 1: a lost update would show as a short final count.
        let next = store.read_version().await + 1;
        store.publish(next).await;
        t.published += 1;
        // Downgrade: the read entry goes beside the write entry, so no queued writer
        // can publish between our write and our check.
        let mut read = match (&rw, &write) {
            (Some(rw), Some(w)) => Some(rw.downgrade(w).await?),
            _ => None,
        };
        if let Some(w) = &mut write {
            w.release().await?;
        }
        if store.read_version().await == next && store.read_body().await == body_of(next) {
            t.downgrade_saw_own += 1;
        }
        if let Some(r) = &mut read {
            r.release().await?;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    Ok(t)
}

async fn scenario(url: String, args: Args) -> Result<Report, dlock::Error> {
    let name = format!("examples/{}/config/feature-flags", run_id());
    let store = Arc::new(Store::default());
    {
        let mut b = store
            .body
            .lock()
            .map_err(|_| dlock::Error::backend("store", "poisoned"))?;
        *b = body_of(0);
    }
    let gauge = Arc::new(Gauge::default());
    let mut clients = Vec::new();
    let mut readers = Vec::new();
    for _ in 0..args.readers {
        let c = dlock::connect(&url).await?;
        let rw = if args.no_lock {
            None
        } else {
            Some(c.rwlock(&name)?)
        };
        readers.push(tokio::spawn(reader(
            rw,
            store.clone(),
            gauge.clone(),
            args.reads,
        )));
        clients.push(c);
    }
    let mut publishers = Vec::new();
    for _ in 0..2 {
        let c = dlock::connect(&url).await?;
        let rw = if args.no_lock {
            None
        } else {
            Some(c.rwlock(&name)?)
        };
        publishers.push(tokio::spawn(publisher(rw, store.clone(), args.updates)));
        clients.push(c);
    }
    let readers = join_all(readers).await?;
    let publishers = join_all(publishers).await?;
    for c in &clients {
        c.close().await?;
    }

    let mut r = Report::new();
    let reads: usize = readers.iter().map(|t| t.reads).sum();
    let refreshes: usize = readers.iter().map(|t| t.refreshes).sum();
    let torn: usize = readers.iter().map(|t| t.torn).sum();
    r.note(format!(
        "{reads} reads, {refreshes} of them went past the local cache; at most {} readers inside at once",
        gauge.peak.load(Ordering::SeqCst)
    ));
    r.check(torn == 0, format!("torn configurations read: {torn}"));
    let published: u64 = publishers.iter().map(|t| t.published).sum();
    let final_version = store.read_version().await;
    r.check(
        final_version == published && final_version == 2 * args.updates,
        format!("final version {final_version} = publications {published} (no lost update)"),
    );
    let own: u64 = publishers.iter().map(|t| t.downgrade_saw_own).sum();
    r.check(
        own == published,
        format!("after each downgrade the publisher read its own version ({own} of {published})"),
    );
    Ok(r)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let common = args.common.clone();
    dlock_examples::run("config_cache", &common, |url| scenario(url, args)).await
}
