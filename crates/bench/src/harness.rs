//! The workload driver shared by every peer: workers on a barrier, a timed loop, the
//! acquire latency of every iteration, and the result line in the peers' format
//! (`/work/shared/peers/benchcommon.py`).

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use tokio::sync::Barrier;

/// Extra time a workload may take past its duration before it counts as failed (a
/// stuck acquire must end the run with a `status=failed` line, not hang the harness).
const GRACE: Duration = Duration::from_secs(120);

/// One worker: its own client (session / connection), made before the barrier.
pub trait Worker: Send + 'static {
    /// One iteration: acquire, critical section, release. Returns the time blocked in
    /// the acquire call.
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>>;
    /// Gives back the worker's session (its entries, leases, connections).
    fn close(self: Box<Self>) -> BoxFuture<'static, ()>;
}

/// In-memory state of the critical sections, touched only while a lock or a permit is
/// held, so overlapping holders show up as violations.
#[derive(Default)]
pub struct Shared {
    holder: AtomicU64,
    counter: AtomicU64,
    violations: AtomicU64,
    holders: AtomicI64,
    max_holders: AtomicI64,
    readers: AtomicI64,
    peak_readers: AtomicI64,
    writer: AtomicU64,
}

impl Shared {
    /// Mutex section: check and set the holder flag (finding it set is a violation),
    /// `counter += 1` as a separate load and store (overlapping holders lose updates),
    /// clear the flag.
    pub fn mutex_section(&self) {
        if self.holder.swap(1, SeqCst) != 0 {
            self.violations.fetch_add(1, SeqCst);
        }
        let c = self.counter.load(SeqCst);
        self.counter.store(c + 1, SeqCst);
        self.holder.store(0, SeqCst);
    }

    /// Semaphore section: count live holders; more than `leases` is a violation.
    pub fn sem_section(&self, leases: u32) {
        let h = self.holders.fetch_add(1, SeqCst) + 1;
        self.max_holders.fetch_max(h, SeqCst);
        if h > i64::from(leases) {
            self.violations.fetch_add(1, SeqCst);
        }
        self.holders.fetch_sub(1, SeqCst);
    }

    /// Read section, first half: a reader while a writer holds is a violation.
    pub fn read_enter(&self) {
        let r = self.readers.fetch_add(1, SeqCst) + 1;
        self.peak_readers.fetch_max(r, SeqCst);
        if self.writer.load(SeqCst) != 0 {
            self.violations.fetch_add(1, SeqCst);
        }
    }

    /// Read section, second half.
    pub fn read_exit(&self) {
        self.readers.fetch_sub(1, SeqCst);
    }

    /// Write section: a writer beside a reader or another writer is a violation; the
    /// counter checks writers exclude each other.
    pub fn write_section(&self) {
        if self.writer.swap(1, SeqCst) != 0 || self.readers.load(SeqCst) != 0 {
            self.violations.fetch_add(1, SeqCst);
        }
        let c = self.counter.load(SeqCst);
        self.counter.store(c + 1, SeqCst);
        self.writer.store(0, SeqCst);
    }

    /// Collisions seen so far.
    pub fn violations(&self) -> u64 {
        self.violations.load(SeqCst)
    }

    /// The unlocked counter's value.
    pub fn counter(&self) -> u64 {
        self.counter.load(SeqCst)
    }

    /// Most permits held at once.
    pub fn max_holders(&self) -> i64 {
        self.max_holders.load(SeqCst)
    }

    /// Most readers inside the read section at once.
    pub fn peak_readers(&self) -> i64 {
        self.peak_readers.load(SeqCst)
    }
}

/// What one workload measured.
pub struct Outcome {
    /// First worker's loop start to last worker's loop end, in seconds.
    pub secs: f64,
    /// Acquire latencies of all iterations of all workers, sorted, in ns.
    pub lat_ns: Vec<u64>,
    /// Iterations per worker.
    pub per_worker: Vec<usize>,
}

impl Outcome {
    /// Completed iterations.
    pub fn ops(&self) -> usize {
        self.lat_ns.len()
    }
}

/// Starts every worker on a barrier, loops for `duration`, and collects latencies.
/// Every worker is closed, also when one fails.
pub async fn run_workers(
    workers: Vec<Box<dyn Worker>>,
    duration: Duration,
) -> Result<Outcome, String> {
    let barrier = Arc::new(Barrier::new(workers.len()));
    let mut handles = Vec::with_capacity(workers.len());
    for mut w in workers {
        let barrier = barrier.clone();
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let start = Instant::now();
            let deadline = start + duration;
            let mut lat: Vec<u64> = Vec::with_capacity(16 * 1024);
            let mut now = start;
            let mut err = None;
            while now < deadline {
                match tokio::time::timeout(GRACE, w.iter()).await {
                    Ok(Ok(d)) => lat.push(u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)),
                    Ok(Err(e)) => {
                        err = Some(e);
                        break;
                    }
                    Err(_) => {
                        err = Some(format!("one iteration took longer than {GRACE:?}"));
                        break;
                    }
                }
                now = Instant::now();
            }
            w.close().await;
            (start, now, lat, err)
        }));
    }
    let mut joined = Vec::with_capacity(handles.len());
    for h in handles {
        joined.push(h.await.map_err(|e| format!("worker task: {e}"))?);
    }
    if let Some(e) = joined.iter().find_map(|r| r.3.clone()) {
        return Err(e);
    }
    let start = joined.iter().map(|r| r.0).min().ok_or("no worker")?;
    let end = joined.iter().map(|r| r.1).max().ok_or("no worker")?;
    let per_worker = joined.iter().map(|r| r.2.len()).collect();
    let mut lat_ns: Vec<u64> = joined.into_iter().flat_map(|r| r.2).collect();
    lat_ns.sort_unstable();
    Ok(Outcome {
        secs: end.duration_since(start).as_secs_f64(),
        lat_ns,
        per_worker,
    })
}

/// Nearest-rank percentile in milliseconds (as benchcommon.py's `pct`).
pub fn pct(sorted_ns: &[u64], q: f64) -> f64 {
    if sorted_ns.is_empty() {
        return f64::NAN;
    }
    // ceil(q * n) is at most n for q <= 1, so the cast cannot overflow.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    let rank = (q * sorted_ns.len() as f64).ceil() as usize;
    let idx = rank.max(1).min(sorted_ns.len()) - 1;
    sorted_ns[idx] as f64 / 1e6
}

/// The result line, field for field as benchcommon.py's `report`, then `extra`.
pub fn line(peer: &str, workload: &str, o: &Outcome, extra: &[(&str, String)]) -> String {
    let n = o.ops();
    let secs = if o.secs > 0.0 {
        o.secs
    } else {
        f64::MIN_POSITIVE
    };
    let mut s = format!(
        "peer={peer} workload={workload} ops_s={:.1} p50_ms={:.3} p99_ms={:.3} max_ms={:.3} n={n} secs={:.2} \
         workers={} per_worker_min={} per_worker_max={}",
        n as f64 / secs,
        pct(&o.lat_ns, 0.50),
        pct(&o.lat_ns, 0.99),
        pct(&o.lat_ns, 1.0),
        o.secs,
        o.per_worker.len(),
        o.per_worker.iter().min().copied().unwrap_or(0),
        o.per_worker.iter().max().copied().unwrap_or(0),
    );
    for (k, v) in extra {
        s.push_str(&format!(" {k}={v}"));
    }
    s
}

/// Makes free text a single `key=value` token: anything but `[A-Za-z0-9.,:()_-]` becomes `_`.
pub fn token(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || ".,:()_-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .take(120)
        .collect()
}

/// The line for a workload that could not run.
pub fn status_line(peer: &str, workload: &str, status: &str, reason: &str) -> String {
    format!(
        "peer={peer} workload={workload} status={status} reason={}",
        token(reason)
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<u64> = (1..=100).map(|i| i * 1_000_000).collect();
        assert_eq!(pct(&v, 0.5), 50.0);
        assert_eq!(pct(&v, 0.99), 99.0);
        assert_eq!(pct(&v, 1.0), 100.0);
        assert_eq!(pct(&[7_000_000], 0.5), 7.0);
        assert!(pct(&[], 0.5).is_nan());
    }

    #[test]
    fn line_has_the_peers_fields_in_order() {
        let o = Outcome {
            secs: 2.0,
            lat_ns: vec![1_000_000, 2_000_000, 3_000_000, 4_000_000],
            per_worker: vec![1, 3],
        };
        let l = line("dlock-zk", "W2", &o, &[("violations", "0".into())]);
        assert_eq!(
            l,
            "peer=dlock-zk workload=W2 ops_s=2.0 p50_ms=2.000 p99_ms=4.000 max_ms=4.000 n=4 secs=2.00 \
             workers=2 per_worker_min=1 per_worker_max=3 violations=0"
        );
    }

    #[test]
    fn shared_counts_collisions() {
        let s = Shared::default();
        s.mutex_section();
        assert_eq!((s.violations(), s.counter()), (0, 1));
        s.read_enter();
        s.write_section();
        s.read_exit();
        assert_eq!(s.violations(), 1);
        s.sem_section(0);
        assert_eq!(s.violations(), 2);
        assert_eq!(token("a b=c"), "a_b_c");
    }
}
