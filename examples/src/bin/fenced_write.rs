//! A fenced write: the storage rejects a paused holder's late write by its stale token.
//!
//! No lock service can stop a process that was paused (a long GC, a frozen VM) from
//! writing after its session ended and someone else took the lock (Martin Kleppmann, "How
//! to do distributed locking", discussed in the article this example follows). The cure is
//! on the storage side: every write carries the holder's fencing token
//! ([`dlock::LockGuard::token`]) and the storage refuses a token lower than one it has
//! already seen. This example's storage is a tiny fenced store: the check and the write
//! happen under one storage-side lock, with [`dlock::FenceGate`] keeping the highest token
//! (in SQL it is one `UPDATE ... WHERE fence <= $token`, see docs/fencing.md).
//!
//! The story: machine A takes the lock and then "pauses"; its session ends, as a real pause
//! longer than the session timeout would end it (here the example closes A's session, so
//! the run takes milliseconds instead of a session timeout); B, waiting, gets the lock
//! with a higher token and writes; A wakes up and writes with its old token. The store
//! must keep B's write.
//!
//! ```sh
//! cargo run -p dlock-examples --bin fenced_write -- --url zk://127.0.0.1:2181
//! cargo run -p dlock-examples --bin fenced_write -- --url zk://127.0.0.1:2181 --no-fence  # stale write wins, exits 1
//! ```

use std::process::ExitCode;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use clap::Parser;
use dlock::{FenceGate, FencingToken};
use dlock_examples::{run_id, storage_round_trip, Common, Report};

#[derive(Debug, Parser)]
#[command(about = "A fenced store rejects a paused lock holder's stale write")]
struct Args {
    #[command(flatten)]
    common: Common,
    /// A store that does not check tokens, to see the stale write win (exits 1).
    #[arg(long)]
    no_fence: bool,
}

/// A write the store refused: its token is older than one it has seen.
#[derive(Debug)]
struct StaleToken {
    token: FencingToken,
    highest: Option<FencingToken>,
}

/// Storage that accepts a write only with a token at least as high as any it has seen.
#[derive(Default)]
struct FencedStore {
    /// Accept every write (what storage without fencing does).
    unchecked: bool,
    /// The gate and the value change together, under one storage-side lock: checking
    /// the token and then writing in two steps would let a stale write slip in between.
    inner: StdMutex<(FenceGate, Option<String>)>,
}

impl FencedStore {
    async fn write(&self, token: FencingToken, value: &str) -> Result<(), StaleToken> {
        storage_round_trip().await;
        let mut inner = self.inner.lock().map_err(|_| StaleToken {
            token,
            highest: None,
        })?;
        let (gate, stored) = &mut *inner;
        if !gate.admit(token) && !self.unchecked {
            return Err(StaleToken {
                token,
                highest: gate.highest(),
            });
        }
        *stored = Some(value.to_owned());
        Ok(())
    }

    fn value(&self) -> Option<String> {
        self.inner.lock().ok().and_then(|i| i.1.clone())
    }
}

async fn scenario(url: String, no_fence: bool) -> Result<Report, dlock::Error> {
    let name = format!("examples/{}/storage/daily-report", run_id());
    let store = Arc::new(FencedStore {
        unchecked: no_fence,
        ..FencedStore::default()
    });
    let mut r = Report::new();

    // Ordinary operation: holders one after another, each write accepted.
    let c = dlock::connect(&url).await?;
    let m = c.mutex(&name)?;
    let mut accepted = 0;
    for i in 0..3 {
        let mut g = m.lock().await?;
        if store
            .write(g.token(), &format!("report #{i}"))
            .await
            .is_ok()
        {
            accepted += 1;
        }
        g.release().await?;
    }
    r.check(accepted == 3, "holders in turn: every write accepted");

    // A takes the lock; B waits for it.
    let a = dlock::connect(&url).await?;
    let b = dlock::connect(&url).await?;
    let a_guard = a.mutex(&name)?.lock().await?;
    let a_token = a_guard.token();
    let b_mutex = b.mutex(&name)?;
    let b_store = store.clone();
    let b_waits = tokio::spawn(async move {
        let mut g = b_mutex.lock_timeout(Duration::from_secs(60)).await?;
        let t = g.token();
        let value = format!("B's report (token {t})");
        let write = b_store.write(t, &value).await;
        g.release().await?;
        Ok::<_, dlock::Error>((t, value, write.is_ok()))
    });

    // A pauses past its session: the server ends the session and frees the lock.
    a.close().await?;

    let (b_token, b_value, b_accepted) = match b_waits.await {
        Ok(r) => r?,
        Err(e) => return Err(dlock::Error::backend("B's task", e.to_string())),
    };
    r.check(
        b_token > a_token,
        format!("B's token {b_token} is higher than paused A's {a_token}"),
    );
    r.check(b_accepted, "B's write, under its lock, is accepted");

    // A wakes up. Its guard knows the lock is gone, but a process that checks and then
    // writes can still be paused between the two, so the store's check is what counts.
    let lost = tokio::time::timeout(Duration::from_secs(30), a_guard.lost()).await;
    r.check(lost.is_ok(), "A's guard reports the lock lost");
    match store.write(a_token, "A's report, written late").await {
        Err(StaleToken { token, highest }) => r.check(
            true,
            format!(
                "A's late write with token {token} is rejected (store has seen {})",
                highest.map_or("none".into(), |h| h.to_string())
            ),
        ),
        Ok(()) => r.check(false, "A's late write with a stale token is rejected"),
    }
    r.check(
        store.value().as_deref() == Some(b_value.as_str()),
        format!("the store keeps B's write: {:?}", store.value()),
    );
    drop(a_guard);
    b.close().await?;
    c.close().await?;
    Ok(r)
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    let no_fence = args.no_fence;
    dlock_examples::run("fenced_write", &args.common, |url| scenario(url, no_fence)).await
}
