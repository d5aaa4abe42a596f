//! KV clients kept for reuse.
//!
//! etcd-client's calls take `&mut KvClient`, so concurrent requests each need a client
//! of their own, and cloning one allocates (its request buffer's sender). A clone and
//! drop per request was about 2.8k instructions per lock in W3, a get and put back here
//! 1.0k (callgrind): a client that finished its request goes back for the next one.

use std::sync::Arc;

use etcd_client::KvClient;
use parking_lot::Mutex;

/// At most this many idle clients are kept: enough for the requests a backend has in
/// flight at once in practice; a burst beyond it clones, and drops the extra clients.
const KEEP: usize = 64;

/// A source of KV clients on one connection.
pub(crate) struct KvPool {
    proto: KvClient,
    idle: Mutex<Vec<KvClient>>,
}

impl KvPool {
    pub(crate) fn new(proto: KvClient) -> Arc<Self> {
        Arc::new(KvPool {
            proto,
            idle: Mutex::new(Vec::new()),
        })
    }

    /// Runs one request on a client of the pool and returns its answer. Every request
    /// of the adapter goes through here. The client goes back for reuse only once `call`
    /// has answered: a future dropped before that (a timeout, a cancelled caller) may
    /// have left its client mid-call, and drops it with itself.
    pub(crate) async fn with<T>(&self, call: impl AsyncFnOnce(&mut KvClient) -> T) -> T {
        let taken = self.idle.lock().pop();
        let mut kv = taken.unwrap_or_else(|| self.proto.clone());
        // etcd-client's request futures are kilobytes (tonic's): boxed where they are
        // made, the futures that await this one stay small instead of each copying them.
        let answer = Box::pin(call(&mut kv)).await;
        let mut idle = self.idle.lock();
        if idle.len() < KEEP {
            idle.push(kv);
        }
        answer
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A pool on a client that never connects: etcd-client connects lazily, and these
    /// calls never touch the network.
    async fn pool() -> Arc<KvPool> {
        let client = etcd_client::Client::connect(["http://127.0.0.1:1"], None)
            .await
            .expect("a lazy client");
        KvPool::new(client.kv_client())
    }

    fn idle(pool: &KvPool) -> usize {
        pool.idle.lock().len()
    }

    #[tokio::test]
    async fn an_answered_call_returns_its_client() {
        let pool = pool().await;
        assert_eq!(pool.with(async |_| 7).await, 7);
        assert_eq!(idle(&pool), 1);
        // The next call reuses it: none is made, none is left over.
        assert_eq!(pool.with(async |_| 8).await, 8);
        assert_eq!(idle(&pool), 1);
    }

    #[tokio::test]
    async fn a_call_dropped_before_its_answer_drops_its_client() {
        let pool = pool().await;
        pool.with(async |_| ()).await;
        assert_eq!(idle(&pool), 1);
        // Takes the idle client, then is dropped mid-call by the timeout.
        let cut = tokio::time::timeout(
            Duration::from_millis(10),
            pool.with(async |_| std::future::pending::<()>().await),
        )
        .await;
        assert!(cut.is_err(), "the call never answers");
        assert_eq!(idle(&pool), 0, "a client dropped mid-call is not reused");
    }

    #[tokio::test]
    async fn at_most_keep_clients_stay_idle() {
        let pool = pool().await;
        // KEEP + 3 calls in flight at once, each on a client of its own.
        let gate = tokio::sync::Barrier::new(KEEP + 3);
        let calls = (0..KEEP + 3).map(|_| {
            pool.with(async |_| {
                gate.wait().await;
            })
        });
        futures::future::join_all(calls).await;
        assert_eq!(idle(&pool), KEEP);
    }
}
