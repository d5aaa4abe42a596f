//! Uncontended enqueue + remove cycles per second on one client.
//!
//! ```text
//! cargo run --release -p dlock-redis --example bench -- 127.0.0.1:6379 [cycles] [tasks]
//! cargo run --release -p dlock-redis --example bench -- h1:p1,h2:p2,h3:p3   (Redlock)
//! ```
//! Each task uses its own lock, so nobody waits: this measures the round trips of the
//! enqueue script (add + list) and the remove script.

use std::time::{Duration, Instant};

use dlock_core::{Backend, EntryKind, LockName, Position, QueuePath, SessionOptions};
use dlock_redis::RedisBackend;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let addrs = args.next().unwrap_or_else(|| "127.0.0.1:6379".to_owned());
    let cycles: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5000);
    let tasks: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(30));
    // One address is one master; several are independent masters for Redlock.
    let masters: Vec<String> = addrs.split(',').map(str::to_owned).collect();
    let backend = match masters.as_slice() {
        [one] => RedisBackend::connect(one, opts).await?,
        _ => RedisBackend::connect_redlock(&masters, opts).await?,
    };
    let started = Instant::now();
    let mut handles = Vec::new();
    for t in 0..tasks {
        let b = backend.clone();
        let q = QueuePath::root(LockName::new(
            &format!("bench/{}/{t}", dlock_testkit::ticket().as_str()),
            dlock_redis::NAME_RULES,
        )?);
        handles.push(tokio::spawn(async move {
            for _ in 0..cycles {
                let e = b
                    .enqueue(
                        &q,
                        &dlock_testkit::ticket(),
                        EntryKind::Lock,
                        Position::Tail,
                        b"",
                    )
                    .await?;
                b.remove(&q, &e.mine).await?;
            }
            Ok::<_, dlock_core::Error>(())
        }));
    }
    for h in handles {
        h.await??;
    }
    let secs = started.elapsed().as_secs_f64();
    let total = cycles * tasks;
    println!(
        "{addrs}: {total} enqueue+remove cycles on {tasks} task(s) in {secs:.2} s = {:.0} cycles/s ({:.0} us/cycle per task)",
        total as f64 / secs,
        secs * 1e6 / cycles as f64
    );
    backend.close().await?;
    Ok(())
}
