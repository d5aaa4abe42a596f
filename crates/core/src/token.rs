//! Fencing tokens: numbers a lock's grants carry, in grant order where the backend can
//! give one.
//!
//! A storage service that accepts a write only with a token at least as high as the
//! highest it has seen rejects a paused former holder's late write (Kleppmann's fencing).
//! Each backend makes its tokens differently, and the order they give differs with it:
//! - ZooKeeper: the entry's `czxid`, the zxid of the transaction that created it, assigned
//!   by the leader and committed by a quorum.
//! - etcd: the entry key's create revision, the cluster-wide revision committed by Raft.
//! - Redis, one master (also behind Sentinel): the enqueue script, atomic on the server,
//!   gives the entry the lock's token counter + 1, floored at the server clock in
//!   microseconds (a new entry into an empty queue takes the clock alone). The counter
//!   goes with an idle lock and expires with the lease, so across an idle lock, a
//!   restart without persistence or a failover to a replica that missed the last writes
//!   only the clock floor keeps tokens growing: they grow as long as the server's clock
//!   never steps back (after a failover: the new server's clock is not behind the old
//!   one's by more than the failover took).
//! - Redlock: every master that takes the entry draws its own token the same way, and the
//!   entry's token is the highest of those. The masters' counters are independent, so
//!   after a master restart or a partition a later holder can get a *smaller* token:
//!   Redlock tokens give no order to fence with.

use std::fmt;

/// A fencing token. On ZooKeeper and etcd, a later exclusive grant of a lock (mutex,
/// semaphore-mutex, write lock) always has a larger token than every earlier one; on one
/// Redis master only as long as the server's clock does not step back, and on Redlock
/// not at all (see the module docs).
///
/// Read holds are not ordered with the writes around them: a read placed beside its
/// write by `RwLock::downgrade` takes a new, larger token, while it keeps the write's
/// place in the queue, so the writer granted after it can hold a smaller token than that
/// read. Storage that fences readers as well as writers would refuse that writer: fence
/// with write tokens only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct FencingToken(u64);

impl FencingToken {
    /// Wraps a raw token from a backend.
    pub const fn new(raw: u64) -> Self {
        FencingToken(raw)
    }

    /// The raw number, for storing beside the protected data.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<FencingToken> for u64 {
    fn from(t: FencingToken) -> u64 {
        t.0
    }
}

/// The storage side of fencing: remembers the highest token seen and accepts a write only
/// if its token is at least that high. Thread-safe. Use it as the model for the check
/// your own storage makes (`UPDATE ... WHERE token <= $new`).
#[derive(Debug, Default)]
pub struct FenceGate {
    highest: parking_lot::Mutex<Option<FencingToken>>,
}

impl FenceGate {
    /// A gate that has seen no token yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Accepts `token` (and remembers it) if it is not older than every token seen;
    /// returns false for a stale token.
    pub fn admit(&self, token: FencingToken) -> bool {
        let mut highest = self.highest.lock();
        match *highest {
            Some(h) if token < h => false,
            _ => {
                *highest = Some(token);
                true
            }
        }
    }

    /// The highest token admitted so far.
    pub fn highest(&self) -> Option<FencingToken> {
        *self.highest.lock()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gate_rejects_stale_tokens() {
        let g = FenceGate::new();
        assert!(g.admit(FencingToken::new(5)));
        assert!(g.admit(FencingToken::new(5)));
        assert!(g.admit(FencingToken::new(9)));
        assert!(!g.admit(FencingToken::new(7)));
        assert_eq!(g.highest(), Some(FencingToken::new(9)));
    }
}
