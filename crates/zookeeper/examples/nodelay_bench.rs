//! Measures what TCP_NODELAY buys the pipelined enqueue: uncontended lock cycles
//! (enqueue + remove) per second, with and without the option, on one task and on eight
//! tasks sharing one session.
//!
//! ```text
//! DLOCK_TEST_ZK=127.0.0.1:2181 cargo run --release -p dlock-zookeeper --example nodelay_bench [cycles]
//! ```
//!
//! Prints figures only; timings on a shared machine vary, so nothing is asserted.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock_core::{Backend, EntryKind, LockName, Position, QueuePath, SessionOptions};
use dlock_zookeeper::{ZkBackend, ZkOptions};

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let hosts = std::env::var("DLOCK_TEST_ZK").unwrap_or_else(|_| "127.0.0.1:2181".into());
    let cycles: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(2000);
    anyhow::ensure!(cycles >= 8, "need at least 8 cycles");
    let root = format!("/dlock-bench/{}", uuid::Uuid::new_v4());
    println!("{cycles} cycles per run against {hosts}{root}");
    let rounds: usize = std::env::args()
        .nth(2)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(3);
    for round in 0..rounds {
        for nodelay in [false, true] {
            let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(10));
            let b = ZkBackend::connect_with(
                &format!("{hosts}{root}"),
                opts,
                ZkOptions::default().with_tcp_nodelay(nodelay),
            )
            .await?;
            let (p10, p50) = latency(&b, cycles).await?;
            let one = run(&b, 1, cycles).await?;
            let eight = run(&b, 8, cycles).await?;
            println!(
                "round {round} nodelay={nodelay:<5}  cycle p10 {p10:>4} µs  p50 {p50:>4} µs   \
                 1 task: {one:>5.0} cycles/s   8 tasks: {eight:>5.0} cycles/s"
            );
            b.close().await?;
        }
    }
    Ok(())
}

/// Times `cycles` sequential enqueue+remove cycles one by one; returns the 10th and 50th
/// percentile in µs. Percentiles shrug off the load spikes of a shared machine that
/// swamp a throughput figure.
async fn latency(b: &Arc<ZkBackend>, cycles: usize) -> anyhow::Result<(u128, u128)> {
    let q = QueuePath::root(LockName::new("bench/latency", dlock_zookeeper::NAME_RULES)?);
    let mut samples = Vec::with_capacity(cycles);
    for _ in 0..cycles {
        let start = Instant::now();
        let done = b
            .enqueue(
                &q,
                &dlock_testkit::ticket(),
                EntryKind::Lock,
                Position::Tail,
                b"",
            )
            .await?;
        b.remove(&q, &done.mine).await?;
        samples.push(start.elapsed().as_micros());
    }
    samples.sort_unstable();
    Ok((samples[samples.len() / 10], samples[samples.len() / 2]))
}

/// Runs `cycles` enqueue+remove cycles spread over `tasks` tasks, each on its own lock;
/// returns cycles per second.
async fn run(b: &Arc<ZkBackend>, tasks: usize, cycles: usize) -> anyhow::Result<f64> {
    let start = Instant::now();
    let mut handles = Vec::new();
    for i in 0..tasks {
        let b = b.clone();
        let n = cycles / tasks;
        handles.push(tokio::spawn(async move {
            let q = QueuePath::root(LockName::new(
                &format!("bench/{i}"),
                dlock_zookeeper::NAME_RULES,
            )?);
            for _ in 0..n {
                let t = dlock_testkit::ticket();
                let done = b
                    .enqueue(&q, &t, EntryKind::Lock, Position::Tail, b"")
                    .await?;
                b.remove(&q, &done.mine).await?;
            }
            anyhow::Ok(n)
        }));
    }
    let mut total = 0;
    for h in handles {
        total += h.await??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}
