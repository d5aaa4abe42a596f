//! Fencing tokens: numbers that only grow for a lock, across all its holders.
//!
//! A storage service that accepts a write only with a token at least as high as the
//! highest it has seen rejects a paused former holder's late write (Kleppmann's fencing).
//! Each backend draws tokens from its own linearizable order: the entry's `czxid` on
//! ZooKeeper, its create revision on etcd, an `INCR` inside the acquire script on Redis.

use std::fmt;

/// A fencing token. Two tokens of the same lock compare in the order the locks were
/// granted: a later holder always has a larger token.
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
