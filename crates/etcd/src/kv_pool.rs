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
