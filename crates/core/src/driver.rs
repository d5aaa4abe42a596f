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
///
/// A write and a read of one sequence are a held write and its owner's downgrade read
/// (only [`crate::Position::Beside`] gives two entries one sequence), so neither keeps
/// the other out, whichever of the two sorts first (the name decides that, and the
/// names' uuids are random).
pub fn conflicts(earlier: &Entry, later: &Entry) -> bool {
    match later.kind {
        EntryKind::Read => earlier.kind.is_exclusive() && earlier.seq != later.seq,
        EntryKind::Write => !(earlier.kind == EntryKind::Read && earlier.seq == later.seq),
        EntryKind::Lock | EntryKind::Lease | EntryKind::Candidate => true,
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

/// A waiter's view of its queue between two listings: the last listing, minus the
/// entries reported gone since. It lets a waiter whose watched entry went take the lock
/// without listing the queue again, which takes a round trip off the handoff.
///
/// Why that is sound: the listing was taken after the waiter's own entry was added, so
/// every entry added later went to the tail, behind it (the [`crate::Backend`] contract:
/// sequence numbers grow in the order entries are added). The set of entries ahead of the
/// waiter can therefore only shrink, with one exception: a read created beside its owner's
/// held write ([`crate::Position::Beside`], the downgrade) takes that write's sequence
/// number and so lands ahead. It conflicts only with a waiter that is not a read, and only
/// if a write stood ahead of it. So if the watched entry was the only conflicting one
/// ahead, its removal grants the lock, unless such a read could have appeared.
///
/// A listing usually names more than one entry ahead (a queue of eight), and when the
/// watched one goes the others may or may not have gone before it (released, or
/// cancelled while waiting): only a fresh listing tells. So an exclusive waiter also
/// watches [`Snapshot::next_blocker`], the entry ahead of the one it waits on, and lists
/// the queue again when that one goes: while the entry it waits on holds the lock, not
/// after, so the handoff itself needs no read.
#[derive(Debug, Clone)]
pub struct Snapshot {
    queue: Vec<Entry>,
    /// True if a downgrade read that conflicts with the waiter may since have been added
    /// ahead of it: the waiter is not a read, and a write stood ahead of it in the listing.
    beside_possible: bool,
}

impl Snapshot {
    /// The waiter `mine`'s view from a fresh listing `queue` (in queue order), taken after
    /// `mine` was added.
    pub fn new(queue: Vec<Entry>, mine: &str) -> Self {
        let beside_possible = beside_possible(&queue, mine);
        Snapshot {
            queue,
            beside_possible,
        }
    }

    /// The queue as the waiter knows it.
    pub fn queue(&self) -> &[Entry] {
        &self.queue
    }

    /// [`decide`] on the queue as the waiter knows it.
    pub fn decide(&self, mine: &str) -> Decision<'_> {
        decide(&self.queue, mine)
    }

    /// For an exclusive waiter that waits on the entry [`Snapshot::decide`] names: the
    /// conflicting entry ahead of that one, whose removal is the moment to list the queue
    /// again (see the type's docs). `None` for a read (its blockers are writes, whose
    /// removal lets many readers in at once: a second watch there would wake a crowd),
    /// when nothing else is ahead, and when [`Snapshot::without`] could not grant the
    /// lock anyway (a downgrade read may appear ahead).
    pub fn next_blocker(&self, mine: &str) -> Option<&Entry> {
        if self.beside_possible {
            return None;
        }
        let idx = self.queue.iter().position(|e| e.name == mine)?;
        let me = &self.queue[idx];
        if me.kind == EntryKind::Read {
            return None;
        }
        let mut ahead = self.queue[..idx].iter().rev().filter(|e| conflicts(e, me));
        ahead.next()?;
        ahead.next()
    }

    /// Records that `gone` (the entry the waiter watched) left the queue. True if `mine`
    /// now holds the lock: `gone` was the only conflicting entry ahead of it in the
    /// listing and no downgrade read can have appeared ahead since. False means only a
    /// fresh listing can tell.
    pub fn without(&mut self, gone: &str, mine: &str) -> bool {
        self.queue.retain(|e| e.name != gone);
        !self.beside_possible && decide(&self.queue, mine) == Decision::Acquired
    }

    /// Records that `gone` (the entry the waiter watched) left the queue while it was the
    /// head: no other entry was queued with a sequence number up to its own
    /// ([`crate::Gone::Head`]). True if `mine` now holds the lock; false means only a
    /// fresh listing can tell (and a `gone` missing from the view always says false).
    ///
    /// Why that needs no listing even when the view named other entries ahead of `gone`:
    /// those had all left by then. Whatever is ahead of `mine` now was either in the view
    /// between `gone` and `mine` (entries ahead only leave), or is a downgrade's read
    /// beside a write that was queued when `gone` went. Such a write sat behind `gone` (nothing
    /// was at or ahead of it), so it is in the view between `gone` and `mine` too. For
    /// the waiter `gone` was the nearest conflicting entry ahead: an exclusive waiter has
    /// nothing between the two, a read only reads there. Either way it holds the lock.
    pub fn without_head(&mut self, gone: &str, mine: &str) -> bool {
        let Some(seq) = self.queue.iter().find(|e| e.name == gone).map(|e| e.seq) else {
            return false;
        };
        self.queue.retain(|e| e.seq > seq);
        // A downgrade read can now appear ahead only beside a write still in the view.
        self.beside_possible = beside_possible(&self.queue, mine);
        !self.beside_possible && decide(&self.queue, mine) == Decision::Acquired
    }
}

/// True if a downgrade read that conflicts with `mine` may appear ahead of it: `mine` is
/// not a read, and a write stands ahead of it in `queue`.
fn beside_possible(queue: &[Entry], mine: &str) -> bool {
    match queue.iter().position(|e| e.name == mine) {
        Some(idx) => {
            queue[idx].kind != EntryKind::Read
                && queue[..idx].iter().any(|e| e.kind == EntryKind::Write)
        }
        None => false,
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
/// semaphore's internal mutex sees `lease_count` leases in all, its own included (created,
/// or about to be); it holds a permit once `lease_count <= max_leases`, and otherwise
/// waits for any lease to go. Only that one contender ever waits on the leases, so a
/// returned lease wakes exactly one waiter.
pub fn lease_granted(lease_count: usize, max_leases: u32) -> bool {
    lease_count <= max_leases as usize
}

/// What a ranked semaphore's contender does next ([`permit_decision`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermitDecision {
    /// Fewer than the permits' count of entries are ahead: it holds a permit.
    Granted,
    /// Its own entry is not in the listing.
    Missing,
    /// Wait until one of these entries goes: the entries just ahead of its own (at
    /// least the `permits` nearest), nearest last.
    Wait(Vec<Entry>),
}

/// The ranked semaphore rule ([`crate::Hints::ranked_semaphore`]): in a queue sorted in
/// the backend's order (`queue`, or any part of it that holds `mine` and every entry
/// ahead of it), the entry named `mine` holds a permit while fewer than `permits`
/// entries are ahead of it. Since a new entry always sorts last, the entries ahead only
/// go, so a granted entry stays granted and at most `permits` entries hold at once.
///
/// Otherwise it waits for one of the `permits` entries just ahead to go: while those
/// are all there, at least `permits` are ahead whatever happens further up, so no
/// other change can free a permit for it. It may watch more: the nearest `watch`
/// entries ahead if `watch` is larger, so that, all of them armed at once, it need not
/// arm another each time one goes (each change then wakes up to `watch` waiters). A
/// permit count of 0 never grants (the wait is then on nothing, forever).
pub fn permit_decision(queue: &[Entry], mine: &str, permits: u32, watch: usize) -> PermitDecision {
    let Some(at) = queue.iter().position(|e| e.name == mine) else {
        return PermitDecision::Missing;
    };
    let permits = permits as usize;
    if at < permits {
        return PermitDecision::Granted;
    }
    PermitDecision::Wait(queue[at - permits.max(watch).min(at)..at].to_vec())
}

/// What a ranked semaphore's contender does next, knowing which entries it already
/// watches ([`permit_next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PermitNext {
    /// Fewer than the permits' count of entries are ahead: it holds a permit.
    Granted,
    /// Its own entry is not in the listing.
    Missing,
    /// Keep waiting, after arming a watch on each of these entries (none: the watches
    /// already armed suffice).
    Wait(Vec<Entry>),
    /// List the queue again and decide on that listing: the view has entries nobody told
    /// this contender about for a while, and it has too few watches left to wait on.
    Relist,
}

/// The ranked semaphore's waiter, step by step: [`permit_decision`] on its `view`, plus
/// when to arm watches and when to list the queue again. `watching` says whether an
/// entry's watch is armed (and has not reported yet); `fresh` is whether `view` is a
/// listing not yet acted on since (an enqueue's or a relisting's), not one kept up to date
/// only by the deletes it was told of.
///
/// A view kept up by its watches is exact only for the entries watched: one further
/// ahead may have gone without this contender being told. So it does not arm watches
/// on the strength of such a view (each would find an entry long gone, and the next one
/// after it, one by one: a cost growing with the queue, measured at 282 server requests
/// per release with 300 waiters). While at least `permits` watched entries are ahead of
/// it, no permit can come free for it before one of them goes, so it waits on them as
/// they are. With fewer, it lists the queue again, once, and arms from that listing.
/// The grant itself is decided on the view alone, an over-count of who is ahead, so
/// the rule stays [`permit_decision`]'s.
pub fn permit_next(
    view: &[Entry],
    mine: &str,
    permits: u32,
    watch: usize,
    watching: impl Fn(&str) -> bool,
    fresh: bool,
) -> PermitNext {
    let ahead = match permit_decision(view, mine, permits, watch) {
        PermitDecision::Granted => return PermitNext::Granted,
        PermitDecision::Missing => return PermitNext::Missing,
        PermitDecision::Wait(ahead) => ahead,
    };
    let new: Vec<Entry> = ahead.into_iter().filter(|e| !watching(&e.name)).collect();
    if new.is_empty() || fresh {
        return PermitNext::Wait(new);
    }
    let watched_ahead = view
        .iter()
        .take_while(|e| e.name != mine)
        .filter(|e| watching(&e.name))
        .count();
    if watched_ahead >= (permits as usize).max(1) {
        PermitNext::Wait(Vec::new())
    } else {
        PermitNext::Relist
    }
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

    /// A downgraded write holds whether its read sorts after it or before it (status
    /// output showed it waiting when the read's uuid sorted first).
    #[test]
    fn a_downgraded_write_holds_whichever_of_the_two_sorts_first() {
        for read_name in ["00-read-beside", "zz-read-beside"] {
            let mut q = vec![entry(EntryKind::Write, 3), entry(EntryKind::Read, 4)];
            let mut r = entry(EntryKind::Read, 3);
            r.name = read_name.into();
            q.push(r);
            sort_queue(&mut q);
            let held: Vec<&str> = holders(&q).iter().map(|e| e.name.as_str()).collect();
            let mut want = vec![
                read_name,
                q.iter()
                    .find(|e| e.kind == EntryKind::Write)
                    .map(|e| e.name.as_str())
                    .unwrap_or(""),
            ];
            want.sort_unstable();
            let mut held_sorted = held.clone();
            held_sorted.sort_unstable();
            assert_eq!(held_sorted, want, "{read_name}: {held:?}");
            // The later reader still waits for the write.
            let later = q
                .iter()
                .find(|e| e.seq == 4)
                .map(|e| e.name.clone())
                .unwrap_or_default();
            assert!(matches!(decide(&q, &later), Decision::Wait(e) if e.kind == EntryKind::Write));
        }
    }

    #[test]
    fn snapshot_rereads_only_when_a_downgrade_may_sit_ahead() {
        // Writer 1 holds, writer 2 waits on it, then writer 1 downgrades.
        let mut sim = Sim::new();
        sim.add(EntryKind::Write);
        sim.add(EntryKind::Write);
        let (w1, w2) = (sim.arrival[0].clone(), sim.arrival[1].clone());
        assert_eq!(sim.state[&w2], Some(w1.clone()));
        sim.downgrade(&w1);
        sim.remove(&w1);
        // Writer 2's listing cannot tell about the read beside writer 1: it lists again
        // and waits on that read instead of taking the lock beside it.
        assert_eq!(sim.blocker_rereads, 1);
        let beside = format!("f0{}", EntryKind::Read.marker());
        assert_eq!(sim.state[&w2], Some(beside.clone()));
        sim.remove(&beside);
        assert_eq!(sim.state[&w2], None);
    }

    #[test]
    fn mutex_handoff_needs_no_listing() {
        let q = vec![
            entry(EntryKind::Lock, 1),
            entry(EntryKind::Lock, 2),
            entry(EntryKind::Lock, 3),
        ];
        let mut view = Snapshot::new(q.clone(), "e3lock-");
        assert_eq!(view.decide("e3lock-"), Decision::Wait(&q[1]));
        assert_eq!(view.next_blocker("e3lock-"), Some(&q[0]));
        // Entry 2 went, but entry 1 may still be there (2 may have been cancelled).
        assert!(!view.without("e2lock-", "e3lock-"));
        // From a listing with one entry ahead, its removal is the handoff.
        let mut view = Snapshot::new(q[1..].to_vec(), "e3lock-");
        assert_eq!(view.next_blocker("e3lock-"), None);
        assert!(view.without("e2lock-", "e3lock-"));
        // Readers never take a second watch.
        let rq = vec![
            entry(EntryKind::Write, 1),
            entry(EntryKind::Write, 2),
            entry(EntryKind::Read, 3),
        ];
        assert_eq!(
            Snapshot::new(rq, "e3__READ__").next_blocker("e3__READ__"),
            None
        );
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
        /// The holder of a write at this index (mod the write holders) downgrades.
        Downgrade(usize),
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
            1 => any::<usize>().prop_map(Step::Downgrade),
        ]
    }

    /// A simulated backend with watches, driven as `dlock-recipes`' acquire loop drives a
    /// real one: each waiter keeps a [`Snapshot`] (its last listing), watches the entry
    /// `decide` names and, if exclusive, also [`Snapshot::next_blocker`]. A removal wakes
    /// only the waiters watching the removed entry: one whose blocker went asks
    /// [`Snapshot::without`] and lists the queue again only if that says so; one whose
    /// next blocker went lists the queue again. The model checks that what the waiters
    /// believe always matches a fresh decision (no missed release, exclusion), counts
    /// wake-ups that let nobody in, and counts listings taken after each kind of wake-up.
    struct Sim {
        queue: Vec<Entry>,
        next_seq: u64,
        /// name -> Some(watched name) while waiting, None once acquired.
        state: HashMap<String, Option<String>>,
        /// name -> its second watch (the next blocker), while it has one.
        second: HashMap<String, String>,
        views: HashMap<String, Snapshot>,
        arrival: Vec<String>,
        grants: Vec<String>,
        /// Wake-ups by the watched blocker's removal.
        wakeups: usize,
        useless_wakeups: usize,
        /// Listings a waiter took because its blocker went and its snapshot could not
        /// grant the lock: the read on the handoff's critical path.
        blocker_rereads: usize,
        /// Wake-ups (each one listing) by the next blocker's removal.
        second_wakeups: usize,
    }

    impl Sim {
        fn new() -> Self {
            Sim {
                queue: Vec::new(),
                next_seq: 0,
                state: HashMap::new(),
                second: HashMap::new(),
                views: HashMap::new(),
                arrival: Vec::new(),
                grants: Vec::new(),
                wakeups: 0,
                useless_wakeups: 0,
                blocker_rereads: 0,
                second_wakeups: 0,
            }
        }

        /// A fresh listing for `name`, then its decision and watches.
        fn evaluate(&mut self, name: &str) {
            let view = Snapshot::new(self.queue.clone(), name);
            let watch = match view.decide(name) {
                Decision::Acquired => None,
                Decision::Wait(e) => Some(e.name.clone()),
                Decision::Missing => unreachable!("evaluated entries are queued"),
            };
            match view.next_blocker(name) {
                Some(e) if watch.is_some() => {
                    self.second.insert(name.to_owned(), e.name.clone());
                }
                _ => {
                    self.second.remove(name);
                }
            }
            self.views.insert(name.to_owned(), view);
            self.set(name, watch);
        }

        fn set(&mut self, name: &str, watch: Option<String>) {
            if watch.is_none() && self.state.get(name) != Some(&None) {
                self.grants.push(name.to_owned());
            }
            self.state.insert(name.to_owned(), watch);
        }

        fn add(&mut self, kind: EntryKind) {
            let e = entry(kind, self.next_seq);
            self.next_seq += 1;
            let name = e.name.clone();
            self.queue.push(e);
            self.arrival.push(name.clone());
            self.evaluate(&name);
        }

        /// The holder of write `w` takes a read beside it (the downgrade): same sequence
        /// number, so it lands ahead of every waiter queued behind the write.
        fn downgrade(&mut self, w: &str) {
            let Some(writer) = self.queue.iter().find(|e| e.name == w).cloned() else {
                return;
            };
            let mut r = entry(EntryKind::Read, writer.seq);
            // Sorts after its writer (`e...`), so `holders` counts both as holding.
            r.name = format!("f{}{}", writer.seq, EntryKind::Read.marker());
            if self.queue.iter().any(|e| e.name == r.name) {
                return;
            }
            let name = r.name.clone();
            self.queue.push(r);
            sort_queue(&mut self.queue);
            self.evaluate(&name);
        }

        fn remove(&mut self, name: &str) {
            self.queue.retain(|e| e.name != name);
            self.state.remove(name);
            self.second.remove(name);
            self.views.remove(name);
            let woken: Vec<String> = self
                .state
                .iter()
                .filter(|(_, w)| w.as_deref() == Some(name))
                .map(|(n, _)| n.clone())
                .collect();
            for n in woken {
                self.wakeups += 1;
                // The acquire loop drops its second watch once its blocker went.
                self.second.remove(&n);
                let view = self.views.get_mut(&n).expect("waiters have a view");
                if view.without(name, &n) {
                    self.set(&n, None);
                } else {
                    self.blocker_rereads += 1;
                    self.evaluate(&n);
                }
                if self.state.get(&n) != Some(&None) {
                    self.useless_wakeups += 1;
                }
            }
            let second: Vec<String> = self
                .second
                .iter()
                .filter(|(_, w)| w.as_str() == name)
                .map(|(n, _)| n.clone())
                .collect();
            for n in second {
                self.second_wakeups += 1;
                self.evaluate(&n);
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
            if let Some(w) = held.iter().find(|e| e.kind.is_exclusive()) {
                // Only the writer's own downgrade read (same sequence) may hold beside it.
                prop_assert!(
                    held.iter().all(|e| e.name == w.name || e.seq == w.seq),
                    "a reader holds beside a writer: {:?}",
                    held
                );
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
            // Every waiter watches one entry queued ahead of it, and at most one more
            // ahead of that; only waiters have a second watch.
            for w in self.waiters() {
                let watched = self.state[&w].clone().unwrap_or_default();
                let wi = self.queue.iter().position(|e| e.name == w);
                let ti = self.queue.iter().position(|e| e.name == watched);
                prop_assert!(matches!((ti, wi), (Some(t), Some(i)) if t < i));
                if let Some(second) = self.second.get(&w) {
                    let si = self.queue.iter().position(|e| &e.name == second);
                    prop_assert!(matches!((si, ti), (Some(s), Some(t)) if s < t));
                }
            }
            prop_assert!(self
                .second
                .keys()
                .all(|n| self.state.get(n).is_some_and(Option::is_some)));
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
                    Step::Downgrade(i) => {
                        let writers: Vec<String> = sim
                            .holders()
                            .into_iter()
                            .filter(|h| sim.queue.iter().any(|e| &e.name == h && e.kind == EntryKind::Write))
                            .collect();
                        if !writers.is_empty() {
                            let w = writers[i % writers.len()].clone();
                            sim.downgrade(&w);
                        }
                    }
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
            let rereads_before = sim.blocker_rereads;
            let second_before = sim.second_wakeups;
            let mut releases = 0;
            while !sim.queue.is_empty() {
                let h = sim.holders();
                prop_assert_eq!(h.len(), 1);
                sim.remove(&h[0]);
                releases += 1;
                sim.check()?;
            }
            // No handoff waited for a listing: each next holder had listed the queue
            // while its predecessor held. And a release woke at most one waiter beside
            // the one it let in.
            prop_assert_eq!(sim.blocker_rereads, rereads_before);
            prop_assert!(sim.second_wakeups - second_before <= releases);
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
            prop_assert_eq!((sim.blocker_rereads, sim.second_wakeups), (0, 0));
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

    /// The listing-free handoff decision as [`Snapshot`] makes it: a waiter whose view is
    /// `queue` learns that `gone`, an entry ahead of it, left.
    fn granted_after_gone(queue: &[Entry], mine: &str, gone: &str) -> bool {
        let Some(idx) = queue.iter().position(|e| e.name == mine) else {
            return false;
        };
        if !queue[..idx].iter().any(|e| e.name == gone) {
            return false;
        }
        Snapshot::new(queue.to_vec(), mine).without(gone, mine)
    }

    #[test]
    fn granted_after_gone_cases() {
        let q = vec![
            entry(EntryKind::Lock, 1),
            entry(EntryKind::Lock, 2),
            entry(EntryKind::Lock, 3),
        ];
        // The only one ahead left: held, no re-read.
        assert!(granted_after_gone(&q[1..], &q[2].name, &q[1].name));
        // Someone else is still ahead: re-read.
        assert!(!granted_after_gone(&q, &q[2].name, &q[1].name));
        // `gone` was not ahead of mine, or mine is not in the view: re-read.
        assert!(!granted_after_gone(&q[1..], &q[1].name, &q[2].name));
        assert!(!granted_after_gone(&q[1..], "nope", &q[1].name));

        // A writer waits behind a writer. The holder downgrades (a read beside its write),
        // then releases the write: the read now blocks the waiting writer, although the
        // waiter's view never listed it. So a write ahead always means a re-read.
        let w = vec![entry(EntryKind::Write, 1), entry(EntryKind::Write, 2)];
        assert!(!granted_after_gone(&w, &w[1].name, &w[0].name));
        // A reader behind that writer is let in: a read beside it never conflicts.
        let r = vec![entry(EntryKind::Write, 1), entry(EntryKind::Read, 2)];
        assert!(granted_after_gone(&r, &r[1].name, &r[0].name));
        // A reader with a second writer ahead keeps waiting.
        let r2 = vec![
            entry(EntryKind::Write, 1),
            entry(EntryKind::Write, 2),
            entry(EntryKind::Read, 3),
        ];
        assert!(!granted_after_gone(&r2, &r2[2].name, &r2[1].name));
        // Readers ahead of a reader never matter.
        let r3 = vec![
            entry(EntryKind::Read, 1),
            entry(EntryKind::Write, 2),
            entry(EntryKind::Read, 3),
        ];
        assert!(granted_after_gone(&r3, &r3[2].name, &r3[1].name));
    }

    #[test]
    fn head_removal_grants_past_a_stale_view() {
        // Mutex: the view lists 1 and 2 ahead of 3; 1 left unseen, then 2 went as the
        // head. `without` cannot tell, `without_head` can.
        let q = vec![
            entry(EntryKind::Lock, 1),
            entry(EntryKind::Lock, 2),
            entry(EntryKind::Lock, 3),
        ];
        assert!(!Snapshot::new(q.clone(), &q[2].name).without(&q[1].name, &q[2].name));
        assert!(Snapshot::new(q.clone(), &q[2].name).without_head(&q[1].name, &q[2].name));
        // An entry the view does not list says nothing.
        assert!(!Snapshot::new(q.clone(), &q[2].name).without_head("nope", &q[2].name));

        // Writers: a write ahead no longer forces a listing once the head went.
        let w = vec![
            entry(EntryKind::Write, 1),
            entry(EntryKind::Write, 2),
            entry(EntryKind::Write, 3),
        ];
        assert!(!Snapshot::new(w.clone(), &w[2].name).without(&w[1].name, &w[2].name));
        assert!(Snapshot::new(w.clone(), &w[2].name).without_head(&w[1].name, &w[2].name));

        // A reader watching its nearest writer, readers between: let in.
        let r = vec![
            entry(EntryKind::Write, 1),
            entry(EntryKind::Read, 2),
            entry(EntryKind::Write, 3),
            entry(EntryKind::Read, 4),
            entry(EntryKind::Read, 5),
        ];
        assert!(Snapshot::new(r.clone(), &r[4].name).without_head(&r[2].name, &r[4].name));
        // A writer behind those readers is not: they hold now.
        let mut rw = r.clone();
        rw.push(entry(EntryKind::Write, 6));
        assert!(!Snapshot::new(rw.clone(), &rw[5].name).without_head(&rw[2].name, &rw[5].name));
    }

    #[test]
    fn a_downgrade_beside_the_watched_write_is_never_a_head_removal() {
        // Writer 1 holds, writer 2 waits on it; writer 1 downgrades, then releases its
        // write. The read beside it shares sequence 1, so the removal was not a head
        // removal: the sim reports it as unknown and writer 2 lists again.
        let mut sim = ViewSim {
            heads: true,
            ..ViewSim::default()
        };
        sim.add(entry(EntryKind::Write, 1));
        sim.add(entry(EntryKind::Write, 2));
        sim.downgrade(0);
        let w1 = sim.queue[0].name.clone();
        sim.remove(&w1);
        assert!(
            !sim.woken[0].3,
            "removal beside a downgrade read reported as head"
        );
        sim.run_woken(0);
        assert_eq!(sim.rereads, 1);
        assert!(sim.waiting.contains_key("e2__WRIT__"));
        sim.check_quiet().expect("beliefs match the queue");
    }

    /// The acquire loop of a backend whose queues grow at the tail, with wake-ups
    /// delivered late: a waiter keeps the queue view it last read; a removal only marks
    /// the waiters watching the removed entry as woken, and each woken waiter runs later,
    /// after any other steps, deciding with [`granted_after_gone`] on its old view or
    /// reading the queue afresh when that says no. Write holders may downgrade (a read
    /// beside their write), the one way an entry joins ahead of earlier waiters.
    ///
    /// With `heads`, a removal also reports whether the removed entry was the head (no
    /// other entry queued with a sequence up to its own, as [`crate::Gone::Head`] says),
    /// and a woken waiter told so decides with [`Snapshot::without_head`] instead.
    #[derive(Default)]
    struct ViewSim {
        heads: bool,
        queue: Vec<Entry>,
        next_seq: u64,
        /// Waiters: name -> (watched name, the view it decided on).
        waiting: HashMap<String, (String, Vec<Entry>)>,
        /// Woken waiters not yet run: (name, the entry that went, its old view, whether
        /// it went as the head).
        woken: Vec<(String, String, Vec<Entry>, bool)>,
        held: Vec<String>,
        /// Write holders that already placed a read beside their write.
        downgraded: Vec<String>,
        rereads: usize,
        skips: usize,
    }

    #[derive(Debug, Clone)]
    enum ViewStep {
        Add(EntryKind),
        Release(usize),
        Cancel(usize),
        Downgrade(usize),
        RunWoken(usize),
    }

    fn view_step() -> impl Strategy<Value = ViewStep> {
        prop_oneof![
            3 => prop_oneof![Just(EntryKind::Lock), Just(EntryKind::Read), Just(EntryKind::Write)]
                .prop_map(ViewStep::Add),
            3 => any::<usize>().prop_map(ViewStep::Release),
            1 => any::<usize>().prop_map(ViewStep::Cancel),
            1 => any::<usize>().prop_map(ViewStep::Downgrade),
            3 => any::<usize>().prop_map(ViewStep::RunWoken),
        ]
    }

    impl ViewSim {
        /// Decides on a fresh view of the queue (after an enqueue or a re-read).
        fn decide_fresh(&mut self, name: &str) {
            let view = self.queue.clone();
            match decide(&view, name) {
                Decision::Acquired => self.held.push(name.to_owned()),
                Decision::Wait(b) => {
                    let b = b.name.clone();
                    self.waiting.insert(name.to_owned(), (b, view));
                }
                Decision::Missing => unreachable!("only queued entries decide"),
            }
        }

        fn add(&mut self, e: Entry) {
            let name = e.name.clone();
            self.queue.push(e);
            sort_queue(&mut self.queue);
            self.decide_fresh(&name);
        }

        fn remove(&mut self, name: &str) {
            // What the removal script sees atomically: nothing else at or ahead of it.
            let head = match self.queue.iter().find(|e| e.name == name) {
                Some(gone) => self
                    .queue
                    .iter()
                    .all(|e| e.name == name || e.seq > gone.seq),
                None => false,
            };
            self.queue.retain(|e| e.name != name);
            self.held.retain(|h| h != name);
            self.waiting.remove(name);
            self.woken.retain(|(w, _, _, _)| w != name);
            let hit: Vec<String> = self
                .waiting
                .iter()
                .filter(|(_, (watched, _))| watched == name)
                .map(|(w, _)| w.clone())
                .collect();
            for w in hit {
                if let Some((_, view)) = self.waiting.remove(&w) {
                    self.woken
                        .push((w, name.to_owned(), view, head && self.heads));
                }
            }
        }

        fn run_woken(&mut self, i: usize) {
            if self.woken.is_empty() {
                return;
            }
            let (w, gone, view, head) = self.woken.remove(i % self.woken.len());
            let granted = if head {
                Snapshot::new(view, &w).without_head(&gone, &w)
            } else {
                granted_after_gone(&view, &w, &gone)
            };
            if granted {
                self.skips += 1;
                self.held.push(w);
            } else {
                self.rereads += 1;
                self.decide_fresh(&w);
            }
        }

        fn downgrade(&mut self, i: usize) {
            let writers: Vec<Entry> = self
                .queue
                .iter()
                .filter(|e| {
                    e.kind == EntryKind::Write
                        && self.held.contains(&e.name)
                        && !self.downgraded.contains(&e.name)
                })
                .cloned()
                .collect();
            if writers.is_empty() {
                return;
            }
            let w = &writers[i % writers.len()];
            self.downgraded.push(w.name.clone());
            let mut r = entry(EntryKind::Read, w.seq);
            r.name = format!("{}-beside", w.name);
            self.add(r);
        }

        fn check(&self) -> Result<(), TestCaseError> {
            // Nobody believes it holds unless a fresh decision agrees: a skipped re-read
            // never lets anyone in early.
            let truth: Vec<&str> = holders(&self.queue)
                .iter()
                .map(|e| e.name.as_str())
                .collect();
            for h in &self.held {
                prop_assert!(
                    truth.contains(&h.as_str()),
                    "{} believes it holds; queue {:?}",
                    h,
                    self.queue
                );
            }
            // Mutual exclusion, a downgrade's read beside its own write excepted.
            let held: Vec<&Entry> = self
                .queue
                .iter()
                .filter(|e| self.held.contains(&e.name))
                .collect();
            for a in &held {
                for b in &held {
                    if a.name != b.name && (a.kind.is_exclusive() || b.kind.is_exclusive()) {
                        prop_assert_eq!(a.seq, b.seq, "{:?} and {:?} hold together", a, b);
                    }
                }
            }
            // A waiter watches an entry ahead of it that is still queued or whose
            // removal woke it.
            for (w, (watched, _)) in &self.waiting {
                let wi = self.queue.iter().position(|e| &e.name == w);
                let ti = self.queue.iter().position(|e| &e.name == watched);
                prop_assert!(
                    matches!((ti, wi), (Some(t), Some(i)) if t < i),
                    "{} watches {}",
                    w,
                    watched
                );
            }
            Ok(())
        }

        /// With no wake-up pending, what everyone believes is exactly the truth.
        fn check_quiet(&self) -> Result<(), TestCaseError> {
            let mut truth: Vec<String> = holders(&self.queue)
                .iter()
                .map(|e| e.name.clone())
                .collect();
            truth.sort();
            let mut believed = self.held.clone();
            believed.sort();
            prop_assert_eq!(truth, believed);
            Ok(())
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(512))]

        #[test]
        fn skipping_the_reread_never_grants_early(
            heads in any::<bool>(),
            steps in prop::collection::vec(view_step(), 1..100),
        ) {
            let mut sim = ViewSim { heads, ..ViewSim::default() };
            for s in steps {
                match s {
                    ViewStep::Add(kind) => {
                        let e = entry(kind, sim.next_seq);
                        sim.next_seq += 1;
                        sim.add(e);
                    }
                    ViewStep::Release(i) => {
                        if !sim.held.is_empty() {
                            let n = sim.held[i % sim.held.len()].clone();
                            sim.remove(&n);
                        }
                    }
                    ViewStep::Cancel(i) => {
                        let mut w: Vec<String> = sim.waiting.keys().cloned().collect();
                        if !w.is_empty() {
                            w.sort();
                            let n = w[i % w.len()].clone();
                            sim.remove(&n);
                        }
                    }
                    ViewStep::Downgrade(i) => sim.downgrade(i),
                    ViewStep::RunWoken(i) => sim.run_woken(i),
                }
                sim.check()?;
            }
            // Drain: run every pending wake-up, then release holders until empty.
            let mut rounds = 0;
            loop {
                while !sim.woken.is_empty() {
                    sim.run_woken(0);
                    sim.check()?;
                }
                sim.check_quiet()?;
                if sim.queue.is_empty() {
                    break;
                }
                prop_assert!(!sim.held.is_empty(), "queue non-empty but nobody holds: deadlock");
                let h = sim.held[0].clone();
                sim.remove(&h);
                sim.check()?;
                rounds += 1;
                prop_assert!(rounds < 1000);
            }
        }

        #[test]
        fn handoff_to_the_only_waiter_needs_no_reread(n in 1usize..60) {
            // The case the skip exists for: each waiter queues behind the holder alone
            // (two contenders taking turns), so the holder's release lets it in with no
            // read of the queue.
            let mut sim = ViewSim::default();
            for i in 0..n {
                let e = entry(EntryKind::Lock, sim.next_seq);
                sim.next_seq += 1;
                sim.add(e);
                if i > 0 {
                    let h = sim.held[0].clone();
                    sim.remove(&h);
                    sim.run_woken(0);
                    sim.check()?;
                    sim.check_quiet()?;
                }
            }
            prop_assert_eq!(sim.rereads, 0);
            prop_assert_eq!(sim.skips, n - 1);
        }

        #[test]
        fn a_stale_view_rereads_once_per_handoff(n in 2usize..60) {
            // Everyone queued at once: each view lists every earlier entry, so the skip
            // never applies and each handoff costs exactly one re-read, as before.
            let mut sim = ViewSim::default();
            for _ in 0..n {
                let e = entry(EntryKind::Lock, sim.next_seq);
                sim.next_seq += 1;
                sim.add(e);
            }
            while !sim.queue.is_empty() {
                prop_assert_eq!(sim.held.len(), 1);
                let h = sim.held[0].clone();
                sim.remove(&h);
                sim.run_woken(0);
                sim.check()?;
            }
            // The second waiter's view held only the first: it skips.
            prop_assert_eq!(sim.skips, 1);
            prop_assert_eq!(sim.rereads, n - 2);
        }

        #[test]
        fn a_head_removal_needs_no_reread(
            kinds in prop::collection::vec(prop_oneof![Just(EntryKind::Lock), Just(EntryKind::Write)], 2..60),
            cancels in prop::collection::vec(any::<usize>(), 0..10),
        ) {
            // Everyone queued at once, some waiters cancelled, then every release is
            // reported as a head removal: no handoff lists the queue again, however stale
            // the views, and the lock goes in queue order.
            let mut sim = ViewSim { heads: true, ..ViewSim::default() };
            for k in kinds {
                let e = entry(k, sim.next_seq);
                sim.next_seq += 1;
                sim.add(e);
            }
            for c in cancels {
                let mut w: Vec<String> = sim.waiting.keys().cloned().collect();
                if w.len() > 1 {
                    w.sort();
                    let n = w[c % w.len()].clone();
                    sim.remove(&n);
                    // A cancelled waiter's successor was woken by a non-head removal.
                    while !sim.woken.is_empty() {
                        sim.run_woken(0);
                    }
                    sim.check()?;
                }
            }
            let rereads = sim.rereads;
            while !sim.queue.is_empty() {
                prop_assert_eq!(sim.held.len(), 1);
                let h = sim.held[0].clone();
                prop_assert_eq!(&h, &sim.queue[0].name);
                sim.remove(&h);
                while !sim.woken.is_empty() {
                    sim.run_woken(0);
                }
                sim.check()?;
                sim.check_quiet()?;
            }
            prop_assert_eq!(sim.rereads, rereads);
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

    #[test]
    fn permit_decision_grants_the_first_permits_and_waits_on_the_ones_just_ahead() {
        let q: Vec<Entry> = (1..=5).map(|s| entry(EntryKind::Lease, s)).collect();
        assert_eq!(
            permit_decision(&q, "e2lease-", 3, 0),
            PermitDecision::Granted
        );
        assert_eq!(
            permit_decision(&q, "e3lease-", 3, 0),
            PermitDecision::Granted
        );
        let PermitDecision::Wait(w) = permit_decision(&q, "e5lease-", 3, 0) else {
            panic!("the fifth of three permits waits");
        };
        let names: Vec<&str> = w.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(names, ["e2lease-", "e3lease-", "e4lease-"]);
        let PermitDecision::Wait(w) = permit_decision(&q, "e5lease-", 3, 8) else {
            panic!("still waits");
        };
        assert_eq!(w.len(), 4, "watching more: every entry ahead, no more");
        assert_eq!(
            permit_decision(&q, "e9lease-", 3, 0),
            PermitDecision::Missing
        );
        assert!(
            matches!(permit_decision(&q, "e1lease-", 0, 0), PermitDecision::Wait(w) if w.is_empty())
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(1000))]
        /// The ranked semaphore as its contenders run it: each one lists the queue when it
        /// enqueues, then only learns of deletes of the entries it waits on, late and in
        /// any order, and decides on its own (stale) view. Never more than `permits` hold;
        /// once every notice is delivered, the first `permits` entries all hold.
        #[test]
        fn ranked_permits_never_exceed_the_count(
            permits in 1u32..4,
            watch in 0usize..6,
            ops in prop::collection::vec((0u8..3, any::<prop::sample::Index>()), 1..120),
        ) {
            let mut live: Vec<Entry> = Vec::new();
            let mut cs: HashMap<String, Contender> = HashMap::new();
            let mut next = 1u64;
            for (op, pick) in ops {
                match op {
                    0 => {
                        let e = entry(EntryKind::Lease, next);
                        next += 1;
                        live.push(e.clone());
                        let c = Contender::enqueued(&live, permits, watch);
                        cs.insert(e.name, c);
                    }
                    1 if !live.is_empty() => {
                        // A holder releases or a waiter gives up: every contender waiting
                        // on it is told, later.
                        let gone = live.remove(pick.index(live.len())).name;
                        cs.remove(&gone);
                        for c in cs.values_mut() {
                            if c.waiting_on.contains(&gone) {
                                c.notices.push(gone.clone());
                            }
                        }
                    }
                    _ => {
                        // One notice reaches one contender.
                        let mut names: Vec<String> = cs
                            .iter()
                            .filter(|(_, c)| !c.notices.is_empty())
                            .map(|(n, _)| n.clone())
                            .collect();
                        names.sort();
                        if !names.is_empty() {
                            let name = names[pick.index(names.len())].clone();
                            cs.get_mut(&name).expect("listed").deliver(&name, &live, permits, watch);
                        }
                    }
                }
                let holding = cs.values().filter(|c| c.granted).count();
                prop_assert!(holding <= permits as usize, "{} hold {} permits", holding, permits);
            }
            // Deliver everything: the first `permits` live entries hold.
            while let Some(name) = cs
                .iter()
                .find(|(_, c)| !c.notices.is_empty())
                .map(|(n, _)| n.clone())
            {
                cs.get_mut(&name).expect("listed").deliver(&name, &live, permits, watch);
                let holding = cs.values().filter(|c| c.granted).count();
                prop_assert!(holding <= permits as usize);
            }
            for (i, e) in live.iter().enumerate() {
                prop_assert_eq!(cs[&e.name].granted, i < permits as usize, "entry {} of {}", i, live.len());
            }
        }
    }

    /// A ranked semaphore's contender as the recipe runs it ([`permit_next`]), with what
    /// it cost: watches armed and relistings.
    struct Contender {
        view: Vec<Entry>,
        granted: bool,
        /// Whether `view` is a listing not acted on since.
        fresh: bool,
        /// Entries this one was told went, not yet acted on.
        notices: Vec<String>,
        waiting_on: Vec<String>,
        arms: usize,
        relists: usize,
    }
    impl Contender {
        /// A contender whose enqueue listed `live` (its own entry last).
        fn enqueued(live: &[Entry], permits: u32, watch: usize) -> Self {
            let mut c = Contender {
                view: live.to_vec(),
                granted: false,
                fresh: true,
                notices: Vec::new(),
                waiting_on: Vec::new(),
                arms: 0,
                relists: 0,
            };
            let name = live.last().expect("its own entry").name.clone();
            c.decide(&name, live, permits, watch);
            c
        }

        /// Applies the rule to this contender's view and arms its waits (a wait
        /// on an entry already gone is told at once), listing the queue again
        /// when the rule asks.
        fn decide(&mut self, name: &str, live: &[Entry], permits: u32, watch: usize) {
            loop {
                let watching = |n: &str| self.waiting_on.iter().any(|w| w == n);
                match permit_next(&self.view, name, permits, watch, watching, self.fresh) {
                    PermitNext::Granted => self.granted = true,
                    PermitNext::Missing => unreachable!("a live contender's view has it"),
                    PermitNext::Relist => {
                        self.relists += 1;
                        self.view = live.to_vec();
                        self.fresh = true;
                        continue;
                    }
                    PermitNext::Wait(w) => {
                        for e in w {
                            self.arms += 1;
                            if !live.iter().any(|l| l.name == e.name) {
                                self.notices.push(e.name.clone());
                            }
                            self.waiting_on.push(e.name);
                        }
                    }
                }
                self.fresh = false;
                return;
            }
        }

        /// Acts on its oldest notice: drops that entry from its view, decides.
        fn deliver(&mut self, name: &str, live: &[Entry], permits: u32, watch: usize) {
            let gone = self.notices.remove(0);
            self.view.retain(|e| e.name != gone);
            self.waiting_on.retain(|n| *n != gone);
            if !self.granted {
                self.decide(name, live, permits, watch);
            }
        }
    }

    /// A ranked semaphore's queue handed on in order, every notice delivered at once:
    /// after the set-up (each waiter's enqueue and its first watches), what the handoffs
    /// cost the waiters (watches armed and relistings) stays within one per release,
    /// whatever the queue's length. Each waiter's view goes stale further ahead than it
    /// watches; arming from it chased entries long gone one by one.
    #[test]
    fn a_ranked_handoff_costs_the_same_whatever_the_queue_behind_it() {
        let (permits, watch) = (3u32, 8usize);
        for waiters in [10u64, 100, 400] {
            let mut live = Vec::new();
            let mut cs: HashMap<String, (Contender, usize)> = HashMap::new();
            for seq in 1..=u64::from(permits) + waiters {
                let e = entry(EntryKind::Lease, seq);
                live.push(e.clone());
                let c = Contender::enqueued(&live, permits, watch);
                let setup = c.arms + c.relists;
                cs.insert(e.name, (c, setup));
            }
            let (mut releases, mut cost) = (0usize, 0usize);
            while !live.is_empty() {
                let gone = live.remove(0).name;
                let (c, setup) = cs.remove(&gone).expect("a contender per entry");
                assert!(c.granted, "{gone} released without holding");
                releases += 1;
                cost += c.arms + c.relists - setup;
                for (c, _) in cs.values_mut() {
                    if c.waiting_on.contains(&gone) {
                        c.notices.push(gone.clone());
                    }
                }
                while let Some(name) = cs
                    .iter()
                    .find(|(_, (c, _))| !c.notices.is_empty())
                    .map(|(n, _)| n.clone())
                {
                    let (c, _) = cs.get_mut(&name).expect("listed");
                    c.deliver(&name, &live, permits, watch);
                }
                for (i, e) in live.iter().enumerate() {
                    assert_eq!(
                        cs[&e.name].0.granted,
                        i < permits as usize,
                        "entry {i} of {}",
                        live.len()
                    );
                }
            }
            assert!(
                cost <= releases,
                "{waiters} waiters: {cost} watches and relistings for {releases} releases"
            );
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
                4 => (0usize..4, 0u64..20, any::<[u8; 16]>()).prop_map(|(k, seq, id)| {
                    let t = Ticket::from_random_bytes(id);
                    format!("{}{}", t.name_prefix(EntryKind::ALL[k]), format_seq(seq))
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
