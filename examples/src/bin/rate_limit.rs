//! An upstream API (or a database connection pool) that allows N calls at once, shared by
//! every machine through a [`dlock::Semaphore`].
//!
//! The partner API in this example accepts at most `--permits` concurrent calls from the
//! whole fleet and answers "429 Too Many Requests" beyond that (the article's "limit API
//! calls, database connection pools"). Every caller on every machine takes one permit of
//! the fleet-wide semaphore around each call. Then a machine dies while it holds a
//! permit: its session ends, its lease vanishes with it, and the fleet gets all N permits
//! back without anyone cleaning up (Redisson's RSemaphore would leak that permit).
//!
//! ```sh
//! cargo run -p dlock-examples --bin rate_limit -- --url zk://127.0.0.1:2181
//! cargo run -p dlock-examples --bin rate_limit -- --url zk://127.0.0.1:2181 --no-lock  # 429s, exits 1
//! ```

use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use clap::Parser;
use dlock_examples::{join_all, run_id, Common, Report};

#[derive(Debug, Parser)]
#[command(about = "A fleet-wide concurrency limit on an upstream API, with a dlock semaphore")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// Concurrent calls the upstream allows.
    #[arg(long, default_value_t = 3)]
    permits: u32,
    /// Machines (each its own dlock session).
    #[arg(long, default_value_t = 3)]
    instances: usize,
    /// Callers per machine.
    #[arg(long, default_value_t = 2)]
    callers: usize,
    /// Calls per caller.
    #[arg(long, default_value_t = 4)]
    calls: usize,
    /// Call without taking a permit, to see the upstream refuse calls (exits 1).
    #[arg(long)]
    no_lock: bool,
}

/// The partner API: counts calls in flight and refuses the ones over its limit.
struct Upstream {
    limit: usize,
    in_flight: AtomicUsize,
    peak: AtomicUsize,
    served: AtomicUsize,
    rejected_429: AtomicUsize,
}

impl Upstream {
    async fn call(&self) {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.peak.fetch_max(now, Ordering::SeqCst);
        if now > self.limit {
            self.rejected_429.fetch_add(1, Ordering::SeqCst);
        } else {
            // The call takes a while; that is why callers overlap.
            tokio::time::sleep(Duration::from_millis(5)).await;
            self.served.fetch_add(1, Ordering::SeqCst);
        }
        self.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

async fn caller(
    sem: Option<dlock::Semaphore>,
    upstream: Arc<Upstream>,
    calls: usize,
) -> Result<(), dlock::Error> {
    for _ in 0..calls {
        let mut permit = match &sem {
            Some(sem) => Some(sem.acquire_timeout(Duration::from_secs(60)).await?),
            None => None,
        };
        upstream.call().await;
        if let Some(p) = &mut permit {
            p.release().await?;
        }
    }
    Ok(())
}

async fn scenario(url: String, args: Args) -> Result<Report, dlock::Error> {
    let name = format!("examples/{}/partner-api/concurrency", run_id());
    let upstream = Arc::new(Upstream {
        limit: args.permits as usize,
        in_flight: AtomicUsize::new(0),
        peak: AtomicUsize::new(0),
        served: AtomicUsize::new(0),
        rejected_429: AtomicUsize::new(0),
    });
    let mut clients = Vec::new();
    let mut callers = Vec::new();
    for _ in 0..args.instances {
        let c = dlock::connect(&url).await?;
        let sem = if args.no_lock {
            None
        } else {
            Some(c.semaphore(&name, args.permits)?)
        };
        for _ in 0..args.callers {
            callers.push(tokio::spawn(caller(
                sem.clone(),
                upstream.clone(),
                args.calls,
            )));
        }
        clients.push(c);
    }
    join_all(callers).await?;

    let mut r = Report::new();
    let expected = args.instances * args.callers * args.calls;
    let served = upstream.served.load(Ordering::SeqCst);
    let rejected = upstream.rejected_429.load(Ordering::SeqCst);
    r.note(format!(
        "{served} calls served, at most {} in flight at once (limit {})",
        upstream.peak.load(Ordering::SeqCst),
        args.permits
    ));
    r.check(
        rejected == 0,
        format!("calls the upstream refused with 429: {rejected}"),
    );
    r.check(
        served == expected,
        format!("{served} of {expected} calls served"),
    );

    // A machine dies holding a permit. Closing its session is what the server sees when
    // it crashes (a real crash frees the permit after the session timeout instead).
    let doomed = dlock::connect(&url).await?;
    let held = doomed.semaphore(&name, args.permits)?.acquire().await?;
    doomed.close().await?;
    let lost = tokio::time::timeout(Duration::from_secs(30), held.lost()).await;
    r.check(
        lost.is_ok(),
        "the dead machine's guard reports its permit lost",
    );
    drop(held);
    // The survivors can take every permit again: nothing leaked.
    let survivor = clients
        .first()
        .ok_or_else(|| dlock::Error::InvalidPermits("no instance".into()))?
        .semaphore(&name, args.permits)?;
    let all = survivor
        .acquire_many_timeout(args.permits, Duration::from_secs(30))
        .await;
    r.check(
        all.as_ref().map(|g| g.guards().len()).ok() == Some(args.permits as usize),
        format!(
            "after the crash all {} permits can be taken again",
            args.permits
        ),
    );
    if let Ok(mut all) = all {
        all.release().await?;
    }
    for c in &clients {
        c.close().await?;
    }
    Ok(r)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let common = args.common.clone();
    dlock_examples::run("rate_limit", &common, |url| scenario(url, args)).await
}
