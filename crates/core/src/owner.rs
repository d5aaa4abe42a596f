//! Reentrancy: how many times each owner holds each lock.
//!
//! Curator counts per Java thread; in async Rust a lock is held by a task, which may run
//! on any thread. The owner is therefore an opaque [`OwnerId`] chosen by the caller: the
//! recipes use the current tokio task's id, or the thread outside a task.

use std::collections::HashMap;
use std::hash::Hash;

/// Who holds a lock, for reentrancy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum OwnerId {
    /// A tokio task, by its task id's numeric form.
    Task(u64),
    /// A thread outside any task.
    Thread(std::thread::ThreadId),
    /// An explicit owner chosen by the caller (e.g. one per request).
    Named(String),
}

/// Hold counts per (lock, owner), shared by all guards of one client. Thread-safe.
///
/// `V` is what the first acquisition stored (the entry that holds the lock); later
/// re-entries reuse it, so a reentrant lock has one entry on the server however often
/// its owner re-enters, as with Curator.
#[derive(Debug)]
pub struct HoldCounts<K, V> {
    inner: parking_lot::Mutex<HashMap<(K, OwnerId), (usize, V)>>,
}

impl<K, V> Default for HoldCounts<K, V> {
    fn default() -> Self {
        HoldCounts {
            inner: parking_lot::Mutex::new(HashMap::new()),
        }
    }
}

impl<K: Eq + Hash + Clone, V: Clone> HoldCounts<K, V> {
    /// An empty table.
    pub fn new() -> Self {
        Self::default()
    }

    /// If `owner` already holds `key`, counts one more hold and returns the stored value.
    pub fn reenter(&self, key: &K, owner: &OwnerId) -> Option<V> {
        let mut map = self.inner.lock();
        let slot = map.get_mut(&(key.clone(), owner.clone()))?;
        slot.0 += 1;
        Some(slot.1.clone())
    }

    /// The value stored for `owner`'s hold of `key`, without counting a hold.
    pub fn get(&self, key: &K, owner: &OwnerId) -> Option<V> {
        self.inner
            .lock()
            .get(&(key.clone(), owner.clone()))
            .map(|s| s.1.clone())
    }

    /// Records the first hold of `key` by `owner`.
    pub fn first(&self, key: K, owner: OwnerId, value: V) {
        self.inner.lock().insert((key, owner), (1, value));
    }

    /// Counts one release. Returns `Some(value)` when that was the last hold (the caller
    /// must now release the entry), `None` while holds remain.
    ///
    /// # Errors
    /// `Err(())` if `owner` does not hold `key`.
    #[allow(clippy::result_unit_err)]
    pub fn release(&self, key: &K, owner: &OwnerId) -> Result<Option<V>, ()> {
        let mut map = self.inner.lock();
        let k = (key.clone(), owner.clone());
        let slot = map.get_mut(&k).ok_or(())?;
        slot.0 -= 1;
        if slot.0 == 0 {
            Ok(map.remove(&k).map(|(_, v)| v))
        } else {
            Ok(None)
        }
    }

    /// Forgets every hold of `key` by `owner` (the lock was lost), returning the value.
    pub fn forget(&self, key: &K, owner: &OwnerId) -> Option<V> {
        self.inner
            .lock()
            .remove(&(key.clone(), owner.clone()))
            .map(|(_, v)| v)
    }

    /// How many times `owner` holds `key` (0 if not at all).
    pub fn count(&self, key: &K, owner: &OwnerId) -> usize {
        self.inner
            .lock()
            .get(&(key.clone(), owner.clone()))
            .map_or(0, |s| s.0)
    }

    /// True if any owner holds `key`.
    pub fn held_by_anyone(&self, key: &K) -> bool {
        self.inner.lock().keys().any(|(k, _)| k == key)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_reentry_and_release() {
        let h: HoldCounts<&str, u32> = HoldCounts::new();
        let me = OwnerId::Task(1);
        let other = OwnerId::Task(2);
        assert_eq!(h.reenter(&"a", &me), None);
        h.first("a", me.clone(), 7);
        assert_eq!(h.reenter(&"a", &me), Some(7));
        assert_eq!(h.reenter(&"a", &other), None);
        assert_eq!(h.count(&"a", &me), 2);
        assert_eq!(h.release(&"a", &me), Ok(None));
        assert_eq!(h.release(&"a", &me), Ok(Some(7)));
        assert_eq!(h.release(&"a", &me), Err(()));
        assert!(!h.held_by_anyone(&"a"));
    }
}
