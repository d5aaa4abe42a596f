//! The contract of [`Gone::Head`], the answer of `wait_gone_detail` that lets a woken
//! waiter skip its listing ([`Snapshot::without_head`]).
//!
//! A backend may never say it (the trait's default says [`Gone::Unknown`]); one that does
//! must say it only when nothing else was queued with a sequence up to the removed
//! entry's when it went. Said once too often, a waiter takes the lock beside a holder,
//! so both tests here check only that side, on every backend; a backend's own tests
//! check that it does say it where it should.

use std::future::Future;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use dlock_core::driver::Snapshot;
use dlock_core::{Decision, DynBackend, Entry, EntryKind, Gone, Position, QueuePath};

use super::{add, session, within, Connect, LONG};

/// How long a wait is given to arm before the change it waits for is made. The answers
/// checked here must hold whether or not it was armed in time.
const ARM: std::time::Duration = std::time::Duration::from_millis(300);

/// Waits on `gone` from `b`, makes the changes of `act` once the wait has had time to
/// arm, and returns what the wait said.
async fn answer_to(
    b: &Arc<dyn DynBackend>,
    q: &QueuePath,
    gone: &Entry,
    act: impl Future<Output = ()>,
) -> Gone {
    let waiter = {
        let (b, q, gone) = (b.clone(), q.clone(), gone.clone());
        tokio::spawn(async move { b.wait_gone_detail(&q, &gone).await })
    };
    tokio::time::sleep(ARM).await;
    act.await;
    within("the wait ends", waiter)
        .await
        .expect("join")
        .expect("wait_gone_detail")
}

/// `wait_gone_detail` does not say [`Gone::Head`] for a waiter cancelled behind a holder,
/// for an entry already gone before the wait, for a write removed beside its downgrade's
/// read, whether that read was added before the wait or while it waits (just before the
/// write goes), nor for an entry behind such a write that goes while the read holds.
pub async fn wait_gone_detail_says_head_only_for_a_head_removal(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = super::fresh_queue(&*a, "gone-head");
    let remove = |e: Entry| {
        let (a, q) = (a.clone(), q.clone());
        async move { within("remove", a.remove(&q, &e)).await.expect("remove") }
    };
    let beside = |w: Entry| {
        let (a, q) = (a.clone(), q.clone());
        async move {
            within(
                "downgrade",
                a.enqueue(
                    &q,
                    &crate::ticket(),
                    EntryKind::Read,
                    Position::Beside(&w),
                    b"",
                ),
            )
            .await
            .expect("a read beside the write")
            .mine
        }
    };

    let l1 = add(&*a, &q, EntryKind::Lock, "l1").await.mine;
    let l2 = add(&*a, &q, EntryKind::Lock, "l2").await.mine;
    let l3 = add(&*a, &q, EntryKind::Lock, "l3").await.mine;
    let said = answer_to(&b, &q, &l2, remove(l2.clone())).await;
    assert_ne!(said, Gone::Head, "l2 was cancelled while l1 held");
    let said = within("wait on a gone entry", b.wait_gone_detail(&q, &l2))
        .await
        .expect("wait_gone_detail");
    assert_ne!(said, Gone::Head, "l2 was gone before the wait");
    remove(l1).await;
    remove(l3).await;

    // A write holds and has downgraded: its read holds beside it at its sequence.
    let w = add(&*a, &q, EntryKind::Write, "write").await.mine;
    let r = beside(w.clone()).await;
    let said = answer_to(&b, &q, &w, remove(w.clone())).await;
    assert_ne!(said, Gone::Head, "the write went beside its read");
    remove(r).await;

    // The downgrade happens while the wait is armed: the read joins ahead of nothing
    // the wait saw in its own read, and the write goes right after it.
    let w = add(&*a, &q, EntryKind::Write, "write").await.mine;
    let behind = add(&*a, &q, EntryKind::Write, "writer behind").await.mine;
    let downgrade = {
        let w = w.clone();
        async move {
            let r = beside(w.clone()).await;
            remove(w).await;
            r
        }
    };
    let read = Arc::new(parking_lot::Mutex::new(None));
    let said = answer_to(&b, &q, &w, {
        let read = read.clone();
        async move {
            *read.lock() = Some(downgrade.await);
        }
    })
    .await;
    assert_ne!(
        said,
        Gone::Head,
        "the write went beside the read added while waiting"
    );
    let r = read.lock().take().expect("the read was added");
    remove(r).await;
    remove(behind).await;

    // The same downgrade, with the wait on an entry behind the write: it goes while the
    // downgrade's read, which joined ahead of it while the wait was armed, still holds.
    let w = add(&*a, &q, EntryKind::Write, "write").await.mine;
    let l = add(&*a, &q, EntryKind::Lock, "lock behind the write")
        .await
        .mine;
    let said = answer_to(&b, &q, &l, {
        let (read, w, l) = (read.clone(), w.clone(), l.clone());
        async move {
            let r = beside(w.clone()).await;
            remove(w).await;
            remove(l).await;
            *read.lock() = Some(r);
        }
    })
    .await;
    assert_ne!(
        said,
        Gone::Head,
        "it went with the downgrade's read ahead of it"
    );
    let r = read.lock().take().expect("the read was added");
    remove(r).await;
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// In a long queue (a dozen entries), `wait_gone_detail` on an entry far from the head
/// stays pending while that entry stays, and returns once it goes, without
/// [`Gone::Head`] (entries are still queued ahead of it).
pub async fn wait_gone_detail_waits_while_the_entry_stays(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = super::fresh_queue(&*a, "gone-long");
    let mut queued = Vec::new();
    for i in 0..12 {
        queued.push(
            add(&*a, &q, EntryKind::Lock, &format!("entry {i}"))
                .await
                .mine,
        );
    }
    let far = queued[10].clone();
    let waiter = {
        let (b, q, far) = (b.clone(), q.clone(), far.clone());
        tokio::spawn(async move { b.wait_gone_detail(&q, &far).await })
    };
    tokio::time::sleep(ARM).await;
    assert!(
        !waiter.is_finished(),
        "the wait returned while its entry was queued"
    );
    within("remove", a.remove(&q, &far)).await.expect("remove");
    let said = within("the wait ends", waiter)
        .await
        .expect("join")
        .expect("wait_gone_detail");
    assert_ne!(said, Gone::Head, "ten entries were queued ahead of it");
    for e in queued.iter().filter(|e| e.name != far.name) {
        within("remove", a.remove(&q, e)).await.expect("remove");
    }
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// Readers, writers and exclusive locks of several sessions take one queue in turn as
/// the recipes do (a waiter told its blocker went as the head takes the lock without a
/// listing, [`Snapshot::without_head`]), write holders sometimes downgrading beside
/// their write: no two exclusive holders, and no reader beside a writer, ever.
/// Returns how many of the grants a head removal made, for a backend's own test to check
/// that it says [`Gone::Head`] at all.
pub async fn head_handoffs_keep_exclusion(connect: Connect) -> usize {
    const WORKERS: u64 = 5;
    const ROUNDS: u64 = 40;
    let first = session(&connect).await;
    let q = super::fresh_queue(&*first, "head-handoffs");
    let occupancy = Arc::new(Occupancy::default());
    let head_grants = Arc::new(AtomicUsize::new(0));
    let mut sessions = vec![first];
    for _ in 1..WORKERS {
        sessions.push(session(&connect).await);
    }
    let mut tasks = Vec::new();
    for (i, b) in sessions.iter().enumerate() {
        let (b, q, occupancy, head_grants) =
            (b.clone(), q.clone(), occupancy.clone(), head_grants.clone());
        tasks.push(tokio::spawn(async move {
            let mut x = 0x2545_F491_4F6C_DD1Du64 ^ (i as u64 + 1);
            for _ in 0..ROUNDS {
                let kind = match xorshift(&mut x) % 10 {
                    0..=3 => EntryKind::Write,
                    4..=6 => EntryKind::Read,
                    _ => EntryKind::Lock,
                };
                let (mine, by_head) = acquire_like_recipes(&*b, &q, kind).await;
                if by_head {
                    head_grants.fetch_add(1, Ordering::SeqCst);
                }
                occupancy.enter(kind);
                tokio::task::yield_now().await;
                if kind == EntryKind::Write && x.is_multiple_of(3) {
                    // Downgrade: a read beside the held write, then the write goes while
                    // others wait behind it: the one way an entry joins ahead of them.
                    let read = within(
                        "downgrade",
                        b.enqueue(
                            &q,
                            &crate::ticket(),
                            EntryKind::Read,
                            Position::Beside(&mine),
                            b"",
                        ),
                    )
                    .await
                    .expect("downgrade")
                    .mine;
                    // One step from writer to reader (+1 reader, -1 writer).
                    occupancy.change(1u64.wrapping_sub(Occupancy::unit(kind)));
                    within("remove write", b.remove(&q, &mine))
                        .await
                        .expect("remove write");
                    tokio::task::yield_now().await;
                    occupancy.leave(EntryKind::Read);
                    within("remove read", b.remove(&q, &read))
                        .await
                        .expect("remove read");
                } else {
                    occupancy.leave(kind);
                    within("remove", b.remove(&q, &mine)).await.expect("remove");
                }
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(LONG * 4, t)
            .await
            .expect("a worker finished in time")
            .expect("a worker did not panic");
    }
    for b in &sessions {
        within("close", b.close()).await.expect("close");
    }
    assert_eq!(occupancy.violations(), 0, "exclusion was broken");
    head_grants.load(Ordering::SeqCst)
}

/// Waits as the recipes do: keeps the [`Snapshot`] it last listed, and when its blocker
/// goes asks [`Snapshot::without_head`] (told [`Gone::Head`]) or [`Snapshot::without`]
/// before listing the entries ahead again. Returns the entry and whether the last wait
/// was granted without a listing because of a head removal. Panics (failing the test)
/// on a backend error or when the entry vanishes while it waits.
async fn acquire_like_recipes(b: &dyn DynBackend, q: &QueuePath, kind: EntryKind) -> (Entry, bool) {
    let added = within(
        "enqueue",
        b.enqueue(q, &crate::ticket(), kind, Position::Tail, b""),
    )
    .await
    .expect("enqueue");
    let mine = added.mine;
    let mut view = Snapshot::new(added.queue, &mine.name);
    loop {
        let blocker = match view.decide(&mine.name) {
            Decision::Acquired => return (mine, false),
            Decision::Missing => panic!("entry {} vanished while waiting", mine.name),
            Decision::Wait(blocker) => blocker.clone(),
        };
        let gone = within("wait", b.wait_gone_detail(q, &blocker))
            .await
            .expect("wait_gone_detail");
        let granted = match gone {
            Gone::Head => view.without_head(&blocker.name, &mine.name),
            Gone::Vanished => false,
            _ => view.without(&blocker.name, &mine.name),
        };
        if granted {
            return (mine, gone == Gone::Head);
        }
        let ahead = within("list", b.queue_ahead(q, &mine)).await.expect("list");
        view = Snapshot::new(ahead, &mine.name);
    }
}

/// Who is inside a read/write critical section: readers in the low 32 bits, exclusive
/// holders (writes, locks) above. Counts every moment the two kinds meet, or two
/// exclusive holders do.
#[derive(Default)]
pub struct Occupancy {
    inside: AtomicU64,
    violations: AtomicUsize,
}

impl Occupancy {
    /// The unit one holder of `kind` adds.
    pub fn unit(kind: EntryKind) -> u64 {
        if kind == EntryKind::Read {
            1
        } else {
            1 << 32
        }
    }

    /// Adds `delta` (wrapping, so a step from writer to reader is one change) and checks.
    pub fn change(&self, delta: u64) {
        let now = self
            .inside
            .fetch_add(delta, Ordering::SeqCst)
            .wrapping_add(delta);
        let (writers, readers) = (now >> 32, now & 0xFFFF_FFFF);
        if writers > 1 || (writers == 1 && readers > 0) {
            self.violations.fetch_add(1, Ordering::SeqCst);
        }
    }

    /// A holder of `kind` enters; checked.
    pub fn enter(&self, kind: EntryKind) {
        self.change(Self::unit(kind));
    }

    /// A holder of `kind` leaves.
    pub fn leave(&self, kind: EntryKind) {
        self.inside.fetch_sub(Self::unit(kind), Ordering::SeqCst);
    }

    /// How many times two holders met that may not share the lock.
    pub fn violations(&self) -> usize {
        self.violations.load(Ordering::SeqCst)
    }
}

/// A worker's own deterministic random sequence (xorshift64), so runs differ by worker
/// but not from one run to the next.
pub fn xorshift(x: &mut u64) -> u64 {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    *x
}
