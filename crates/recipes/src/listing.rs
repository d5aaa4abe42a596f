//! [`LockSummary`]: the locks with holders or waiters, as [`crate::Client::locks`] lists
//! them, folded from the queues a backend finds ([`dlock_core::Backend::list_queues`]).

use std::collections::BTreeMap;
use std::fmt;

use dlock_core::driver::holders;
use dlock_core::{EntryKind, ListedQueue, LockName, NameRules};

use crate::semaphore::{permit_holders, LEASES, LOCKS, PERMITS};

/// What recipe a listed lock's entries belong to, as far as they tell.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum LockKind {
    /// Mutex entries only (Curator `lock-`; etcd's own lock keys too).
    Mutex,
    /// Read or write entries (Curator `__READ__` / `__WRIT__`).
    ReadWrite,
    /// A semaphore's `leases` or `locks` queue, or a ranked semaphore's `permits` (the
    /// semaphore-mutex too).
    Semaphore,
    /// Election candidates (Curator `LeaderLatch`'s `latch-`). Where a backend cannot
    /// tell a candidate from a mutex contender (etcd, whose election and mutex keys are
    /// one layout), an election lists as [`LockKind::Mutex`].
    Election,
}

impl LockKind {
    /// A short lower-case label: `mutex`, `rwlock`, `semaphore`, `election`.
    pub const fn label(self) -> &'static str {
        match self {
            LockKind::Mutex => "mutex",
            LockKind::ReadWrite => "rwlock",
            LockKind::Semaphore => "semaphore",
            LockKind::Election => "election",
        }
    }
}

impl fmt::Display for LockKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// One lock with at least one holder or waiter, as [`crate::Client::locks`] lists it.
/// More fields may come.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct LockSummary {
    /// The lock's name, as its users name it (no namespace, key prefix or chroot).
    pub name: LockName,
    /// What its entries say it is.
    pub kind: LockKind,
    /// Entries that hold it: the granted ones of its own queue (several readers at
    /// once), and every lease of a semaphore (as [`crate::Client::participants`] counts
    /// them). Where a semaphore contender adds its lease before it looks (every backend
    /// but ZooKeeper), the lease of the one contender waiting for a permit counts here
    /// too while it waits: a semaphore's count can exceed its permits by one. A ranked
    /// semaphore's (etcd's) first N entries hold, N being the count each entry was
    /// written with.
    pub holders: usize,
    /// Entries that wait: the rest of its own queue, every entry of a semaphore's
    /// internal `locks` queue (held only while acquiring a permit), and a ranked
    /// semaphore's entries past its first N.
    pub waiters: usize,
}

impl LockSummary {
    /// Holders and waiters together: every entry the lock has.
    pub fn entries(&self) -> usize {
        self.holders + self.waiters
    }
}

/// Which queue of a lock a listed path is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Own,
    Leases,
    Locks,
    Permits,
}

/// The lock a queue belongs to and which of its queues it is. `NAME/leases` holding
/// leases is a semaphore's (a lease entry is made by a semaphore only); `NAME/locks` is
/// taken for a semaphore's internal mutex, as [`crate::Client::participants`] takes it:
/// a mutex named `x/locks` cannot be told from it on any backend.
fn place(q: &ListedQueue) -> (&str, Part) {
    if let Some((lock, sub)) = q.path.rsplit_once('/') {
        if sub == LEASES && q.entries.iter().any(|e| e.kind == EntryKind::Lease) {
            return (lock, Part::Leases);
        }
        if sub == LOCKS {
            return (lock, Part::Locks);
        }
        if sub == PERMITS && q.entries.iter().any(|e| e.kind == EntryKind::Lease) {
            return (lock, Part::Permits);
        }
    }
    (q.path.as_str(), Part::Own)
}

/// Folds the queues a backend listed under `prefix` into locks named under `prefix`,
/// sorted by name. A path that is no valid lock name under `rules` (a foreign node or
/// key) is left out.
pub(crate) fn summarize(
    prefix: &str,
    queues: &[ListedQueue],
    rules: NameRules,
) -> Vec<LockSummary> {
    let mut locks: BTreeMap<LockName, LockSummary> = BTreeMap::new();
    for q in queues.iter().filter(|q| !q.entries.is_empty()) {
        let (lock, part) = place(q);
        if !lock.starts_with(prefix) {
            continue;
        }
        let Ok(name) = LockName::new(lock, rules) else {
            tracing::debug!(path = %q.path, "listing: not a lock name, left out");
            continue;
        };
        let s = locks.entry(name.clone()).or_insert_with(|| LockSummary {
            name,
            kind: LockKind::Mutex,
            holders: 0,
            waiters: 0,
        });
        match part {
            Part::Own => {
                let held = holders(&q.entries).len();
                s.holders += held;
                s.waiters += q.entries.len() - held;
                if s.kind == LockKind::Mutex
                    && q.entries
                        .iter()
                        .any(|e| matches!(e.kind, EntryKind::Read | EntryKind::Write))
                {
                    s.kind = LockKind::ReadWrite;
                } else if s.kind == LockKind::Mutex
                    && q.entries.iter().any(|e| e.kind == EntryKind::Candidate)
                {
                    s.kind = LockKind::Election;
                }
            }
            Part::Leases => {
                s.holders += q.entries.len();
                s.kind = LockKind::Semaphore;
            }
            Part::Locks => {
                s.waiters += q.entries.len();
                s.kind = LockKind::Semaphore;
            }
            Part::Permits => {
                let held = permit_holders(&q.entries)
                    .into_iter()
                    .filter(|h| *h)
                    .count();
                s.holders += held;
                s.waiters += q.entries.len() - held;
                s.kind = LockKind::Semaphore;
            }
        }
    }
    locks.into_values().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::Entry;

    fn q(path: &str, entries: &[(EntryKind, u64)]) -> ListedQueue {
        ListedQueue::new(
            path,
            entries
                .iter()
                .map(|&(kind, seq)| {
                    Entry::from_name(format!("{}{}", kind.marker(), format_args!("{seq:010}")))
                        .expect("entry name")
                })
                .collect(),
        )
    }

    fn row(s: &LockSummary) -> (&str, LockKind, usize, usize) {
        (s.name.as_str(), s.kind, s.holders, s.waiters)
    }

    #[test]
    fn folds_semaphore_queues_and_counts_holders() {
        use EntryKind::*;
        let listed = [
            q("app/m", &[(Lock, 1), (Lock, 2), (Lock, 3)]),
            q("app/rw", &[(Read, 4), (Read, 5), (Write, 6), (Read, 7)]),
            q("app/s/leases", &[(Lease, 8), (Lease, 9)]),
            q("app/s/locks", &[(Lock, 10)]),
            // A mutex whose last segment is `leases`: its entries are no leases.
            q("app/x/leases", &[(Lock, 11)]),
            q("app/e", &[(Candidate, 12), (Candidate, 13)]),
            q("app/empty", &[]),
        ];
        let got = summarize("app/", &listed, NameRules::common());
        let rows: Vec<_> = got.iter().map(row).collect();
        assert_eq!(
            rows,
            [
                ("app/e", LockKind::Election, 1, 1),
                ("app/m", LockKind::Mutex, 1, 2),
                ("app/rw", LockKind::ReadWrite, 2, 2),
                ("app/s", LockKind::Semaphore, 2, 1),
                ("app/x/leases", LockKind::Mutex, 1, 0),
            ]
        );
        assert_eq!(got[2].entries(), 4);
    }

    #[test]
    fn keeps_only_locks_under_the_prefix_with_valid_names() {
        use EntryKind::*;
        let listed = [
            // The queue's path starts with the prefix, its lock's name does not.
            q("s/leases", &[(Lease, 1)]),
            q("s/locksmith", &[(Lock, 2)]),
            q("zookeeper/x", &[(Lock, 3)]),
        ];
        let rules = NameRules::common().reserving("zookeeper");
        let got = summarize("s/l", &listed, rules);
        let names: Vec<_> = got.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["s/locksmith"]);
        assert!(summarize("", &listed, rules)
            .iter()
            .all(|s| s.name.as_str() != "zookeeper/x"));
    }
}
