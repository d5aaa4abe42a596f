//! Queue drivers: pure functions of (the ordered queue, my entry) that say whether I hold
//! the lock, and if not, the one entry I must watch.
//!
//! The watched entry is the nearest one ahead of me that conflicts with me. That choice
//! has two properties the property tests below check on random interleavings:
//! - no release is ever missed: whenever my entry could be granted, the entry I watch
//!   is gone, so my watch has fired;
//! - no herd: a removal wakes only the waiters that watch it, and every waiter watches
//!   exactly one entry.
//!
//! Conflicts: a `lock`/`write` entry conflicts with every entry ahead of it; a `read`
//! entry conflicts only with `lock`/`write` entries ahead of it, except a write with its
//! own sequence number, which is its owner's write being downgraded (the read entry is
//! created beside it, as Curator does). Semaphore leases are counted, not queued: see
//! [`lease_granted`].

use crate::entry::{Entry, EntryKind};

/// What the driver decided for one entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<'a> {
    /// The entry holds the lock.
    Acquired,
    /// The entry waits; re-run the driver once this entry is gone.
    Wait(&'a Entry),
    /// The entry is not in the queue: it was removed (session expired, or someone
    /// deleted it). The attempt must start over or report the lock lost.
    Missing,
}

/// True if `earlier`, queued ahead of `later`, keeps `later` from holding the lock.
pub fn conflicts(earlier: &Entry, later: &Entry) -> bool {
    match later.kind {
        EntryKind::Read => earlier.kind.is_exclusive() && earlier.seq != later.seq,
        EntryKind::Lock | EntryKind::Write | EntryKind::Lease => true,
    }
}

/// Decides for the entry named `mine` in `queue`, which must be in queue order
/// ([`crate::entry::sort_queue`]).
pub fn decide<'a>(queue: &'a [Entry], mine: &str) -> Decision<'a> {
    let Some(idx) = queue.iter().position(|e| e.name == mine) else {
        return Decision::Missing;
    };
    let me = &queue[idx];
    match queue[..idx].iter().rev().find(|e| conflicts(e, me)) {
        Some(blocker) => Decision::Wait(blocker),
        None => Decision::Acquired,
    }
}

/// The entries of `queue` (in queue order) that hold the lock now. Used for status
/// output and by the property tests.
pub fn holders(queue: &[Entry]) -> Vec<&Entry> {
    queue
        .iter()
        .filter(|e| matches!(decide(queue, &e.name), Decision::Acquired))
        .collect()
}

/// The semaphore rule (Curator's InterProcessSemaphoreV2): the contender that holds the
/// semaphore's internal mutex has created its lease and sees `lease_count` leases in all,
/// its own included; it holds a permit once `lease_count <= max_leases`, and otherwise
/// waits for any lease to go. Only that one contender ever waits on the leases, so a
/// returned lease wakes exactly one waiter.
pub fn lease_granted(lease_count: usize, max_leases: u32) -> bool {
    lease_count <= max_leases as usize
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::entry::sort_queue;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn entry(kind: EntryKind, seq: u64) -> Entry {
        Entry {
            name: format!("e{seq}{}", kind.marker()),
            kind,
            seq,
            token: None,
            created_ms: None,
            ticket: None,
            data: Vec::new(),
        }
    }

    #[test]
    fn mutex_queue() {
        let q = vec![
            entry(EntryKind::Lock, 1),
            entry(EntryKind::Lock, 2),
            entry(EntryKind::Lock, 3),
        ];
        assert_eq!(decide(&q, &q[0].name), Decision::Acquired);
        assert_eq!(decide(&q, &q[2].name), Decision::Wait(&q[1]));
        assert_eq!(decide(&q, "nope"), Decision::Missing);
    }

    #[test]
    fn readers_watch_nearest_writer() {
        let q = vec![
            entry(EntryKind::Read, 1),
            entry(EntryKind::Write, 2),
            entry(EntryKind::Read, 3),
            entry(EntryKind::Write, 4),
            entry(EntryKind::Read, 5),
        ];
        assert_eq!(decide(&q, &q[0].name), Decision::Acquired);
        assert_eq!(decide(&q, &q[1].name), Decision::Wait(&q[0]));
        assert_eq!(decide(&q, &q[2].name), Decision::Wait(&q[1]));
        assert_eq!(decide(&q, &q[4].name), Decision::Wait(&q[3]));
    }

    #[test]
    fn downgrade_read_sits_beside_its_writer() {
        // Writer 3 holds, writer 4 waits, the holder takes a read beside its write.
        let mut q = vec![entry(EntryKind::Write, 3), entry(EntryKind::Write, 4)];
        let mut r = entry(EntryKind::Read, 3);
        r.name = "zz-read-beside".into();
        q.push(r);
        sort_queue(&mut q);
        assert_eq!(decide(&q, "zz-read-beside"), Decision::Acquired);
        // The queued writer still waits, on the downgrade read once the write goes.
        q.retain(|e| !(e.kind == EntryKind::Write && e.seq == 3));
        assert_eq!(decide(&q, &q[1].name), Decision::Wait(&q[0]));
        assert_eq!(q[0].name, "zz-read-beside");
    }

    #[test]
    fn lease_rule() {
        assert!(lease_granted(3, 3));
        assert!(!lease_granted(4, 3));
    }

    /// One step of a random interleaving.
    #[derive(Debug, Clone)]
    enum Step {
        Add(EntryKind),
        /// Remove the holder at this index (mod the number of holders).
        Release(usize),
        /// Remove a waiter (a cancelled acquire) at this index.
        Cancel(usize),
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            3 => prop_oneof![Just(EntryKind::Lock), Just(EntryKind::Read), Just(EntryKind::Write)]
                .prop_map(Step::Add),
            3 => any::<usize>().prop_map(Step::Release),
            1 => any::<usize>().prop_map(Step::Cancel),
        ]
    }

    /// A simulated backend with watches: each waiter stores the entry it watches; a
    /// removal wakes only the waiters watching the removed entry, which re-run the
    /// driver. The model checks that what the waiters believe always matches a fresh
    /// decision (no missed release), and counts wake-ups that let nobody in.
    struct Sim {
        queue: Vec<Entry>,
        next_seq: u64,
        /// name -> Some(watched name) while waiting, None once acquired.
        state: HashMap<String, Option<String>>,
        arrival: Vec<String>,
        grants: Vec<String>,
        wakeups: usize,
        useless_wakeups: usize,
    }

    impl Sim {
        fn new() -> Self {
            Sim {
                queue: Vec::new(),
                next_seq: 0,
                state: HashMap::new(),
                arrival: Vec::new(),
                grants: Vec::new(),
                wakeups: 0,
                useless_wakeups: 0,
            }
        }

        fn evaluate(&mut self, name: &str) {
            let d = match decide(&self.queue, name) {
                Decision::Acquired => None,
                Decision::Wait(e) => Some(e.name.clone()),
                Decision::Missing => unreachable!("evaluated entries are queued"),
            };
            if d.is_none() && self.state.get(name) != Some(&None) {
                self.grants.push(name.to_owned());
            }
            self.state.insert(name.to_owned(), d);
        }

        fn add(&mut self, kind: EntryKind) {
            let e = entry(kind, self.next_seq);
            self.next_seq += 1;
            let name = e.name.clone();
            self.queue.push(e);
            self.arrival.push(name.clone());
            self.evaluate(&name);
        }

        fn remove(&mut self, name: &str) {
            self.queue.retain(|e| e.name != name);
            self.state.remove(name);
            let woken: Vec<String> = self
                .state
                .iter()
                .filter(|(_, w)| w.as_deref() == Some(name))
                .map(|(n, _)| n.clone())
                .collect();
            for n in woken {
                self.wakeups += 1;
                self.evaluate(&n);
                if self.state.get(&n) != Some(&None) {
                    self.useless_wakeups += 1;
                }
            }
        }

        fn holders(&self) -> Vec<String> {
            let mut h: Vec<String> = self
                .state
                .iter()
                .filter(|(_, w)| w.is_none())
                .map(|(n, _)| n.clone())
                .collect();
            h.sort();
            h
        }

        fn waiters(&self) -> Vec<String> {
            self.state
                .iter()
                .filter(|(_, w)| w.is_some())
                .map(|(n, _)| n.clone())
                .collect()
        }

        fn check(&self) -> Result<(), TestCaseError> {
            // What every waiter believes matches a fresh decision: no missed release.
            let mut truth: Vec<String> = holders(&self.queue)
                .iter()
                .map(|e| e.name.clone())
                .collect();
            truth.sort();
            prop_assert_eq!(
                &truth,
                &self.holders(),
                "believed holders differ from the queue"
            );
            // Mutual exclusion.
            let held: Vec<&Entry> = holders(&self.queue);
            let writers = held.iter().filter(|e| e.kind.is_exclusive()).count();
            prop_assert!(writers <= 1, "two writers hold: {:?}", held);
            if writers == 1 {
                prop_assert_eq!(held.len(), 1, "a reader holds beside a writer");
            }
            // No reader holds with an earlier writer still queued.
            for h in &held {
                let idx = self
                    .queue
                    .iter()
                    .position(|e| e.name == h.name)
                    .unwrap_or(0);
                prop_assert!(!self.queue[..idx].iter().any(|e| conflicts(e, h)));
            }
            // Every waiter watches exactly one entry that is queued ahead of it.
            for w in self.waiters() {
                let watched = self.state[&w].clone().unwrap_or_default();
                let wi = self.queue.iter().position(|e| e.name == w);
                let ti = self.queue.iter().position(|e| e.name == watched);
                prop_assert!(matches!((ti, wi), (Some(t), Some(i)) if t < i));
            }
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn random_interleavings_keep_the_invariants(steps in prop::collection::vec(step(), 1..80)) {
            let mut sim = Sim::new();
            for s in steps {
                match s {
                    Step::Add(kind) => sim.add(kind),
                    Step::Release(i) => {
                        let h = sim.holders();
                        if !h.is_empty() {
                            let n = h[i % h.len()].clone();
                            sim.remove(&n);
                        }
                    }
                    Step::Cancel(i) => {
                        let w = sim.waiters();
                        if !w.is_empty() {
                            let mut w = w;
                            w.sort();
                            let n = w[i % w.len()].clone();
                            sim.remove(&n);
                        }
                    }
                }
                sim.check()?;
            }
            // Every waiter acquires once everything ahead leaves: drain by releasing
            // holders until the queue is empty; the loop must make progress each time.
            let mut rounds = 0;
            while !sim.queue.is_empty() {
                let h = sim.holders();
                prop_assert!(!h.is_empty(), "queue non-empty but nobody holds: deadlock");
                sim.remove(&h[0]);
                sim.check()?;
                rounds += 1;
                prop_assert!(rounds < 1000);
            }
        }

        #[test]
        fn fifo_and_no_herd_for_exclusive_queues(n in 1usize..60, cancels in prop::collection::vec(any::<usize>(), 0..10)) {
            // During the release phase each release wakes exactly the one waiter it
            // lets in; only a cancelled waiter's successor wakes for nothing (it re-watches).
            let mut sim = Sim::new();
            for _ in 0..n {
                sim.add(EntryKind::Lock);
            }
            for c in cancels {
                let w = sim.waiters();
                if !w.is_empty() {
                    let mut w = w;
                    w.sort();
                    let victim = w[c % w.len()].clone();
                    sim.remove(&victim);
                    sim.check()?;
                }
            }
            let survivors: Vec<String> =
                sim.arrival.iter().filter(|a| sim.state.contains_key(*a)).cloned().collect();
            sim.grants.clear();
            sim.grants.push(sim.holders()[0].clone());
            while !sim.queue.is_empty() {
                let h = sim.holders();
                prop_assert_eq!(h.len(), 1);
                sim.remove(&h[0]);
                sim.check()?;
            }
            // Granted in arrival order.
            prop_assert_eq!(&sim.grants, &survivors);
            // A release wakes exactly the one waiter it lets in; a cancelled waiter's
            // successor is woken once and re-watches.
            prop_assert_eq!(sim.wakeups - sim.useless_wakeups, survivors.len() - 1);
            prop_assert!(sim.useless_wakeups <= n - survivors.len());
        }

        #[test]
        fn readers_are_let_in_together(readers in 1usize..20) {
            let mut sim = Sim::new();
            sim.add(EntryKind::Write);
            for _ in 0..readers {
                sim.add(EntryKind::Read);
            }
            sim.add(EntryKind::Write);
            let w = sim.holders()[0].clone();
            sim.remove(&w);
            sim.check()?;
            // One release let all readers in, woke only them, and not the second writer.
            prop_assert_eq!(sim.holders().len(), readers);
            prop_assert_eq!(sim.wakeups, readers);
            prop_assert_eq!(sim.useless_wakeups, 0);
        }
    }

    /// A simulation of the semaphore protocol (internal mutex + lease set): only the
    /// mutex holder waits on the leases; never more than `max` permits are held.
    #[derive(Debug, Clone)]
    enum SemStep {
        Arrive,
        Return(usize),
    }

    proptest! {
        #[test]
        fn semaphore_never_exceeds_permits(
            max in 1u32..5,
            steps in prop::collection::vec(prop_oneof![Just(SemStep::Arrive), any::<usize>().prop_map(SemStep::Return)], 1..100),
        ) {
            // Waiting contenders, in mutex-queue order; the head holds the mutex.
            let mut mutex_queue: std::collections::VecDeque<u64> = Default::default();
            let mut leases: Vec<u64> = Vec::new(); // lease entries, including the head's pending one
            let mut held: Vec<u64> = Vec::new();
            let mut next = 0u64;
            let mut lease_wakeups = 0usize;
            // Advance the head: create its lease, check the rule; granted heads release
            // the mutex and the next contender becomes head.
            let advance = |mq: &mut std::collections::VecDeque<u64>, leases: &mut Vec<u64>, held: &mut Vec<u64>| {
                while let Some(&head) = mq.front() {
                    if !leases.contains(&head) {
                        leases.push(head);
                    }
                    if lease_granted(leases.len(), max) {
                        held.push(head);
                        mq.pop_front();
                    } else {
                        break;
                    }
                }
            };
            for s in steps {
                match s {
                    SemStep::Arrive => {
                        mutex_queue.push_back(next);
                        next += 1;
                        advance(&mut mutex_queue, &mut leases, &mut held);
                    }
                    SemStep::Return(i) => {
                        if !held.is_empty() {
                            let who = held.remove(i % held.len());
                            leases.retain(|l| *l != who);
                            if !mutex_queue.is_empty() {
                                lease_wakeups += 1; // only the head watches the leases
                            }
                            advance(&mut mutex_queue, &mut leases, &mut held);
                        }
                    }
                }
                prop_assert!(held.len() <= max as usize);
                // Permits are never left idle while someone waits.
                if !mutex_queue.is_empty() {
                    prop_assert_eq!(held.len(), max as usize);
                }
                // Grants are in arrival order.
                let mut sorted = held.clone();
                sorted.sort_unstable();
                prop_assert!(mutex_queue.iter().all(|w| sorted.iter().all(|h| h < w)));
            }
            prop_assert!(lease_wakeups <= next as usize);
        }
    }

    proptest! {
        /// [`crate::Backend::queue_ahead`] may return only the entries up to mine (plus
        /// any of those behind it): the driver's answer must not change.
        #[test]
        fn decide_only_looks_ahead(
            kinds in prop::collection::vec(0usize..4, 1..40),
            seqs in prop::collection::vec(0u64..30, 40),
            pick in any::<prop::sample::Index>(),
            keep in prop::collection::vec(any::<bool>(), 40),
        ) {
            let mut q: Vec<Entry> = kinds
                .iter()
                .zip(&seqs)
                .enumerate()
                .map(|(i, (&k, &seq))| {
                    let mut e = entry(EntryKind::ALL[k], seq);
                    e.name = format!("{}-{i}", e.name);
                    e
                })
                .collect();
            sort_queue(&mut q);
            let at = pick.index(q.len());
            let mine = q[at].name.clone();
            let partial: Vec<Entry> = q
                .iter()
                .enumerate()
                .filter(|(i, _)| *i <= at || keep[*i])
                .map(|(_, e)| e.clone())
                .collect();
            let full = decide(&q, &mine).clone_names();
            prop_assert_eq!(decide(&partial, &mine).clone_names(), full);
            // And without mine, both say it is missing.
            let without: Vec<Entry> = partial.iter().filter(|e| e.name != mine).cloned().collect();
            prop_assert_eq!(decide(&without, &mine), Decision::Missing);
        }
    }

    impl Decision<'_> {
        /// The decision with the blocker named, for comparing across two queues.
        fn clone_names(&self) -> Option<Option<String>> {
            match self {
                Decision::Acquired => Some(None),
                Decision::Wait(e) => Some(Some(e.name.clone())),
                Decision::Missing => None,
            }
        }
    }

    mod fuzz {
        use super::*;
        use crate::entry::{format_seq, sort_queue, Ticket};

        /// An entry name: mostly well-formed (any kind, any sequence, shared sequences
        /// included), sometimes garbage that `Entry::from_name` must refuse.
        fn name() -> impl Strategy<Value = String> {
            prop_oneof![
                4 => (0usize..4, 0u64..20).prop_map(|(k, seq)| {
                    format!("{}{}", Ticket::new().name_prefix(EntryKind::ALL[k]), format_seq(seq))
                }),
                1 => any::<String>(),
            ]
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(1000))]

            /// Whatever a server lists (duplicates, shared sequence numbers, foreign
            /// names) and whatever entry the caller asks about, the driver answers without
            /// panicking, and a `Wait` always names an entry ahead of mine.
            #[test]
            fn driver_never_panics_on_any_queue(
                names in prop::collection::vec(name(), 0..30),
                pick in any::<prop::sample::Index>(),
                foreign in any::<String>(),
            ) {
                let mut queue: Vec<Entry> = names.into_iter().filter_map(Entry::from_name).collect();
                sort_queue(&mut queue);
                let mine = if queue.is_empty() { foreign } else { queue[pick.index(queue.len())].name.clone() };
                match decide(&queue, &mine) {
                    Decision::Acquired => prop_assert!(queue.iter().any(|e| e.name == mine)),
                    Decision::Wait(b) => {
                        let me = queue.iter().position(|e| e.name == mine).expect("mine is queued");
                        let at = queue.iter().position(|e| std::ptr::eq(e, b)).expect("blocker is queued");
                        prop_assert!(at < me);
                    }
                    Decision::Missing => prop_assert!(!queue.iter().any(|e| e.name == mine)),
                }
                let _ = holders(&queue);
            }
        }
    }
}
