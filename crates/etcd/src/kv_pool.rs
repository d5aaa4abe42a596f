//! KV clients kept for reuse.
//!
//! etcd-client's calls take `&mut KvClient`, so concurrent requests each need a client
//! of their own, and cloning one allocates (its request buffer's sender). A clone and
//! drop per request was about 2.8k instructions per lock in W3, a get and put back here
//! 1.0k (callgrind): a client that finished its request goes back for the next one.

use std::ops::{Deref, DerefMut};
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

    /// A client for one request. Call [`PooledKv::done`] once its request has an
    /// answer: only then does it go back for reuse (a request dropped halfway may have
    /// left the client mid-call, and such a client is simply dropped).
    pub(crate) fn get(self: &Arc<Self>) -> PooledKv {
        let kv = self.idle.lock().pop().unwrap_or_else(|| self.proto.clone());
        PooledKv {
            kv: Some(kv),
            pool: self.clone(),
            finished: false,
        }
    }
}

/// A client taken from a [`KvPool`]; back to it on drop once [`PooledKv::done`].
pub(crate) struct PooledKv {
    kv: Option<KvClient>,
    pool: Arc<KvPool>,
    finished: bool,
}

impl PooledKv {
    /// Marks the client's request answered, so the client can serve another.
    pub(crate) fn done(&mut self) {
        self.finished = true;
    }
}

impl Deref for PooledKv {
    type Target = KvClient;

    fn deref(&self) -> &KvClient {
        // Only `Drop` takes it out.
        self.kv
            .as_ref()
            .expect("a pooled client is present until dropped")
    }
}

impl DerefMut for PooledKv {
    fn deref_mut(&mut self) -> &mut KvClient {
        self.kv
            .as_mut()
            .expect("a pooled client is present until dropped")
    }
}

impl Drop for PooledKv {
    fn drop(&mut self) {
        if let (true, Some(kv)) = (self.finished, self.kv.take()) {
            let mut idle = self.pool.idle.lock();
            if idle.len() < KEEP {
                idle.push(kv);
            }
        }
    }
}
