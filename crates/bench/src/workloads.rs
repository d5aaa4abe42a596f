//! dlock's recipes under the peers' workloads W1-W5, through the facade (`dlock::connect_with`),
//! each worker with its own [`dlock::Client`] (its own session / connection).

use std::sync::Arc;
use std::time::{Duration, Instant};

use dlock::{Client, SessionOptions};
use futures::future::BoxFuture;
use futures::FutureExt as _;

use crate::harness::{Shared, Worker};

/// Share of W5 iterations that take the read lock.
pub const W5_READ_PERCENT: u32 = 90;

/// Which recipe a worker loops on.
pub enum Recipe {
    /// [`dlock::Mutex`]: W1, W2 (with the shared section), W3.
    Mutex { shared: Option<Arc<Shared>> },
    /// [`dlock::Semaphore`] with `leases` permits: W4.
    Semaphore { shared: Arc<Shared>, leases: u32 },
    /// [`dlock::RwLock`], [`W5_READ_PERCENT`] % reads: W5.
    RwLock { shared: Arc<Shared>, seed: u64 },
}

enum Lock {
    Mutex(dlock::Mutex),
    Semaphore(dlock::Semaphore),
    RwLock(dlock::RwLock),
}

/// One worker: its own client and its recipe.
pub struct DlockWorker {
    client: Client,
    lock: Lock,
    recipe: Recipe,
}

/// Connects one client to `url`.
///
/// # Errors
/// The facade's error: `InvalidUrl` for a backend this build leaves out.
pub async fn connect(url: &str, session: Duration) -> dlock::Result<Client> {
    dlock::connect_with(url, SessionOptions::default().with_session_timeout(session)).await
}

impl DlockWorker {
    /// Connects a client and makes the recipe on `name`.
    ///
    /// # Errors
    /// Connect errors and invalid names, as text.
    pub async fn new(
        url: &str,
        session: Duration,
        name: &str,
        recipe: Recipe,
    ) -> Result<DlockWorker, String> {
        let client = connect(url, session)
            .await
            .map_err(|e| format!("connect {url}: {e}"))?;
        let lock = match &recipe {
            Recipe::Mutex { .. } => client.mutex(name).map(Lock::Mutex),
            Recipe::Semaphore { leases, .. } => {
                client.semaphore(name, *leases).map(Lock::Semaphore)
            }
            Recipe::RwLock { .. } => client.rwlock(name).map(Lock::RwLock),
        };
        match lock {
            Ok(lock) => Ok(DlockWorker {
                client,
                lock,
                recipe,
            }),
            Err(e) => {
                let _ = client.close().await;
                Err(format!("{name}: {e}"))
            }
        }
    }
}

/// xorshift64: a fixed, cheap read/write mix per worker, the same in every run.
fn next(seed: &mut u64) -> u64 {
    let mut x = *seed;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    *seed = x;
    x
}

impl Worker for DlockWorker {
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>> {
        async move {
            let t = Instant::now();
            let (mut guard, read) = match (&self.lock, &mut self.recipe) {
                (Lock::Mutex(m), _) => (m.lock().await, false),
                (Lock::Semaphore(s), _) => (s.acquire().await, false),
                (Lock::RwLock(rw), Recipe::RwLock { seed, .. }) => {
                    if next(seed) % 100 < u64::from(W5_READ_PERCENT) {
                        (rw.read().await, true)
                    } else {
                        (rw.write().await, false)
                    }
                }
                (Lock::RwLock(_), _) => return Err("rwlock worker without rwlock recipe".into()),
            };
            let d = t.elapsed();
            let guard_ref = guard.as_mut().map_err(|e| format!("acquire: {e}"))?;
            match &self.recipe {
                Recipe::Mutex { shared: Some(s) } => s.mutex_section(),
                Recipe::Mutex { shared: None } => {}
                Recipe::Semaphore { shared, leases } => shared.sem_section(*leases),
                Recipe::RwLock { shared, .. } => {
                    if read {
                        shared.read_enter();
                        // Lets the other readers' tasks run while this one is inside, so
                        // shared holds can show up in the peak.
                        tokio::task::yield_now().await;
                        shared.read_exit();
                    } else {
                        shared.write_section();
                    }
                }
            }
            guard_ref
                .release()
                .await
                .map_err(|e| format!("release: {e}"))?;
            Ok(d)
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async move {
            let _ = self.client.close().await;
        }
        .boxed()
    }
}
