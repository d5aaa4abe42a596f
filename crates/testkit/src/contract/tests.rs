//! The contract tests every backend passes, each a function over a [`Connect`].
//!
//! Names are the ones [`backend_contract!`](crate::backend_contract) gives the generated
//! tests. Reads by a session other than the writer's go through [`eventually`]: the
//! contract lets a replica serving one session trail another session's write (a
//! ZooKeeper follower, an etcd member), never its own.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    decide, Decision, DynBackend, Entry, EntryKind, Error, Position, QueuePath, Ticket,
};
use futures::FutureExt;

use super::{add, eventually, fresh_name, fresh_queue, session, within, Connect};

pub use super::gone::{
    head_handoffs_keep_exclusion, wait_gone_detail_says_head_only_for_a_head_removal,
    wait_gone_detail_waits_while_the_entry_stays,
};

fn names(q: &[Entry]) -> Vec<&str> {
    q.iter().map(|e| e.name.as_str()).collect()
}

/// How long a wait that must not return is given to show that it does not.
const QUIET: Duration = Duration::from_millis(300);

/// `enqueue` adds the entry with its data, kind and a fencing token, and returns the
/// whole queue right after, in enqueue order; `queue` and `participants` read the same
/// queue back; `remove` is idempotent.
pub async fn enqueue_returns_the_queue_in_order_with_mine_and_a_token(connect: Connect) {
    let b = session(&connect).await;
    let q = fresh_queue(&*b, "enqueue");
    let mut mine = Vec::new();
    for i in 0..3 {
        let t = crate::ticket();
        let data = format!("me-{i}").into_bytes();
        let got = within(
            "enqueue",
            b.enqueue(&q, &t, EntryKind::Lock, Position::Tail, &data),
        )
        .await
        .expect("enqueue");
        assert!(
            got.mine.is_from(&t),
            "{:?} is not from its ticket",
            got.mine
        );
        assert_eq!(got.mine.kind, EntryKind::Lock);
        assert_eq!(got.mine.data, data);
        assert!(got.mine.token.is_some(), "no token: {:?}", got.mine);
        assert_eq!(got.queue.len(), i + 1, "the queue right after the add");
        assert_eq!(
            got.queue.last().map(|e| &e.name),
            Some(&got.mine.name),
            "mine is last"
        );
        assert!(
            got.queue.windows(2).all(|w| w[0].seq < w[1].seq),
            "not in order: {:?}",
            got.queue
        );
        let before: Vec<&str> = mine.iter().map(|e: &Entry| e.name.as_str()).collect();
        assert_eq!(names(&got.queue[..i]), before, "earlier entries, in order");
        mine.push(got.mine);
    }
    assert!(
        mine.windows(2).all(|w| w[0].token < w[1].token),
        "tokens grow: {mine:?}"
    );
    let listed = within("queue", b.queue(&q)).await.expect("queue");
    assert_eq!(names(&listed), names(&mine));
    let detail = within("participants", b.participants(&q))
        .await
        .expect("participants");
    assert_eq!(names(&detail), names(&mine));
    for (seen, e) in detail.iter().zip(&mine) {
        assert_eq!(seen.data, e.data, "participants shows the data");
        assert_eq!(seen.token, e.token, "participants shows the token");
        // Optional: etcd records no creation time.
        assert!(
            !matches!(seen.created_ms, Some(ms) if ms <= 1_600_000_000_000),
            "participants shows when it was created, if it says: {seen:?}"
        );
    }
    for e in &mine {
        within("remove", b.remove(&q, e)).await.expect("remove");
        within("remove again", b.remove(&q, e))
            .await
            .expect("remove is idempotent");
    }
    assert!(within("queue", b.queue(&q))
        .await
        .expect("queue")
        .is_empty());
    within("close", b.close()).await.expect("close");
}

/// Two sessions queue first come, first served; the waiter's `wait_gone` on the holder
/// stays pending while it holds and returns once it is removed.
pub async fn fifo_across_two_sessions_and_wait_gone_wakes_on_removal(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "fifo");
    let ea = add(&*a, &q, EntryKind::Lock, "a enqueues").await;
    assert_eq!(decide(&ea.queue, &ea.mine.name), Decision::Acquired);
    let eb = add(&*b, &q, EntryKind::Lock, "b enqueues").await;
    assert_eq!(
        names(&eb.queue),
        vec![ea.mine.name.as_str(), eb.mine.name.as_str()]
    );
    let blocker = match decide(&eb.queue, &eb.mine.name) {
        Decision::Wait(e) => e.clone(),
        other => panic!("b must wait for a, got {other:?}"),
    };
    assert_eq!(blocker.name, ea.mine.name);
    assert!(eb.mine.token > ea.mine.token, "b's token above a's");

    let waiter = {
        let (b, q) = (b.clone(), q.clone());
        tokio::spawn(async move { b.wait_gone(&q, &blocker).await })
    };
    tokio::time::sleep(QUIET).await;
    assert!(!waiter.is_finished(), "wait_gone returned while a holds");
    within("a releases", a.remove(&q, &ea.mine))
        .await
        .expect("a releases");
    within("b wakes", waiter)
        .await
        .expect("join")
        .expect("wait_gone");
    let now = within("queue", b.queue(&q)).await.expect("queue");
    assert_eq!(decide(&now, &eb.mine.name), Decision::Acquired);
    within("remove again", a.remove(&q, &ea.mine))
        .await
        .expect("a second remove succeeds");
    within("b releases", b.remove(&q, &eb.mine))
        .await
        .expect("b releases");
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// A waiter woken by `wait_gone_behind`: its own entry, deleted from outside before the
/// entry ahead of it went, is never said to be queued (`Woken::mine_queued`) and
/// `still_queued` reports it gone; left alone, `still_queued` reports it there. (Without
/// the first two, the waiter would hold beside whoever queued after the deletion.)
pub async fn still_queued_answers_for_the_moment_of_the_wake(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let c = session(&connect).await;
    let q = fresh_queue(&*a, "still");
    for deleted in [false, true] {
        let head = add(&*a, &q, EntryKind::Lock, "a enqueues").await.mine;
        let mine = add(&*b, &q, EntryKind::Lock, "b enqueues").await.mine;
        let waiter = {
            let (b, q, head, mine) = (b.clone(), q.clone(), head.clone(), mine.clone());
            tokio::spawn(async move { b.wait_gone_behind(&q, &head, &mine).await })
        };
        tokio::time::sleep(QUIET).await;
        if deleted {
            within("c deletes b's entry", c.remove(&q, &mine))
                .await
                .expect("remove from outside");
        }
        within("a releases", a.remove(&q, &head))
            .await
            .expect("a releases");
        let woken = within("b wakes", waiter)
            .await
            .expect("join")
            .expect("wait_gone_behind");
        assert!(
            !(deleted && woken.mine_queued),
            "wait_gone_behind said a waiter's entry deleted before the wake was queued"
        );
        let there = within("still_queued", b.still_queued(&q, &mine))
            .await
            .expect("still_queued");
        assert_eq!(
            there, !deleted,
            "still_queued after the wake, b's entry deleted from outside: {deleted}"
        );
        within("b releases", b.remove(&q, &mine))
            .await
            .expect("b releases");
    }
    for s in [a, b, c] {
        within("close", s.close()).await.expect("close");
    }
}

/// `wait_gone` on an entry already removed, by its own session or another, or in a
/// queue that never existed, returns at once.
pub async fn wait_gone_returns_at_once_when_already_gone(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "gone");
    let e = add(&*a, &q, EntryKind::Lock, "enqueue").await;
    within("remove", a.remove(&q, &e.mine))
        .await
        .expect("remove");
    within("wait_gone, own session", a.wait_gone(&q, &e.mine))
        .await
        .expect("wait_gone on a gone entry");
    within("wait_gone, other session", b.wait_gone(&q, &e.mine))
        .await
        .expect("wait_gone on a gone entry");
    let nowhere = fresh_queue(&*a, "gone-nowhere");
    within("wait_gone, missing queue", b.wait_gone(&nowhere, &e.mine))
        .await
        .expect("wait_gone in a queue that does not exist");
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// Each exclusive holder in turn, alternating between two sessions, gets a token above
/// every earlier one.
pub async fn tokens_strictly_increase_across_sessions(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "tokens");
    let mut tokens = Vec::new();
    for i in 0..8 {
        let (who, kind) = if i % 2 == 0 {
            (&a, EntryKind::Lock)
        } else {
            (&b, EntryKind::Write)
        };
        let done = add(&**who, &q, kind, "enqueue").await;
        assert_eq!(decide(&done.queue, &done.mine.name), Decision::Acquired);
        tokens.push(done.mine.token.expect("a token"));
        within("remove", who.remove(&q, &done.mine))
            .await
            .expect("remove");
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing: {tokens:?}"
    );
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// An entry added at the tail sorts after every entry already in its queue, whoever
/// added those and whatever left in between: what a ranked semaphore's rule rests on
/// (`Hints::ranked_semaphore`: the entries ahead of a waiter only ever go). Checked on
/// a semaphore's sub-queue, with leases from two sessions and removals from the head,
/// the middle and the tail.
pub async fn a_new_entry_sorts_after_every_entry_in_its_queue(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = QueuePath::sub(fresh_name(&*a, "sorts-last"), "permits");
    let mut live: Vec<(Arc<dyn DynBackend>, Entry)> = Vec::new();
    for i in 0..12usize {
        let who = if i % 2 == 0 { &a } else { &b };
        let done = add(&**who, &q, EntryKind::Lease, "enqueue").await;
        let last = done.queue.last().map(|e| e.name.clone());
        assert_eq!(
            last.as_deref(),
            Some(done.mine.name.as_str()),
            "entry {i} sorts last"
        );
        assert!(
            done.queue
                .iter()
                .all(|e| e.name == done.mine.name || e.seq < done.mine.seq),
            "entry {i} has the highest sequence: {:?}",
            done.queue.iter().map(|e| e.seq).collect::<Vec<_>>()
        );
        live.push((who.clone(), done.mine));
        if i % 3 == 2 {
            // Remove the head, then the middle, then the tail, in turn.
            let at = match (i / 3) % 3 {
                0 => 0,
                1 => live.len() / 2,
                _ => live.len() - 1,
            };
            let (owner, e) = live.remove(at);
            within("remove", owner.remove(&q, &e))
                .await
                .expect("remove");
        }
    }
    for (owner, e) in &live {
        within("remove", owner.remove(&q, e)).await.expect("remove");
    }
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// A read entry `Beside` a held write shares the write's sequence, sorts right beside
/// it, ahead of a writer queued later, and holds at once; it has a token of its own.
pub async fn beside_read_sorts_beside_its_writer(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "beside");
    let w = add(&*a, &q, EntryKind::Write, "writer").await;
    assert_eq!(decide(&w.queue, &w.mine.name), Decision::Acquired);
    let later = add(&*b, &q, EntryKind::Write, "later writer").await;
    let t = crate::ticket();
    let r = within(
        "read beside",
        a.enqueue(&q, &t, EntryKind::Read, Position::Beside(&w.mine), b""),
    )
    .await
    .expect("read beside");
    assert!(r.mine.is_from(&t));
    assert_eq!(r.mine.kind, EntryKind::Read);
    assert_eq!(r.mine.seq, w.mine.seq, "shares its writer's sequence");
    assert!(r.mine.token.is_some(), "no token: {:?}", r.mine);
    let pos = |name: &str| {
        r.queue
            .iter()
            .position(|e| e.name == name)
            .unwrap_or_else(|| panic!("{name} missing from {:?}", r.queue))
    };
    let (pw, pr, pl) = (pos(&w.mine.name), pos(&r.mine.name), pos(&later.mine.name));
    assert_eq!(pw.abs_diff(pr), 1, "read entry not beside its writer");
    assert!(pl > pw && pl > pr, "later writer sorted before the pair");
    assert_eq!(decide(&r.queue, &r.mine.name), Decision::Acquired);
    assert!(matches!(
        decide(&r.queue, &later.mine.name),
        Decision::Wait(_)
    ));
    // The writer leaves: the read still holds, the later writer waits for it.
    within("remove writer", a.remove(&q, &w.mine))
        .await
        .expect("remove writer");
    let now = within("queue", a.queue(&q)).await.expect("queue");
    assert_eq!(
        names(&now),
        vec![r.mine.name.as_str(), later.mine.name.as_str()]
    );
    assert_eq!(decide(&now, &r.mine.name), Decision::Acquired);
    assert!(matches!(decide(&now, &later.mine.name), Decision::Wait(e) if e.name == r.mine.name));
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// A `Beside` read whose writer is gone is refused with [`Error::LockLost`] and leaves
/// no entry behind.
pub async fn beside_a_gone_writer_is_refused_and_leaves_nothing(connect: Connect) {
    let a = session(&connect).await;
    let q = fresh_queue(&*a, "beside-gone");
    let w = add(&*a, &q, EntryKind::Write, "writer").await;
    within("remove writer", a.remove(&q, &w.mine))
        .await
        .expect("remove writer");
    let t = crate::ticket();
    let got = within(
        "read beside a gone writer",
        a.enqueue(&q, &t, EntryKind::Read, Position::Beside(&w.mine), b""),
    )
    .await;
    assert!(matches!(got, Err(Error::LockLost(_))), "got {got:?}");
    assert!(
        within("participants", a.participants(&q))
            .await
            .expect("participants")
            .is_empty(),
        "the refused read left an entry"
    );
    within("abandon", a.abandon(&q, &t))
        .await
        .expect("abandon the refused ticket");
    within("close", a.close()).await.expect("close");
}

/// `abandon` removes the one entry its ticket created and nothing else; it succeeds for
/// a ticket abandoned twice, one that created nothing, and a queue that does not exist.
pub async fn abandon_removes_exactly_the_tickets_entry(connect: Connect) {
    let a = session(&connect).await;
    let q = fresh_queue(&*a, "abandon");
    let tickets: Vec<Ticket> = (0..3).map(|_| crate::ticket()).collect();
    let mut entries = Vec::new();
    for t in &tickets {
        let done = within(
            "enqueue",
            a.enqueue(&q, t, EntryKind::Lock, Position::Tail, b""),
        )
        .await
        .expect("enqueue");
        entries.push(done.mine);
    }
    within("abandon", a.abandon(&q, &tickets[1]))
        .await
        .expect("abandon");
    let left = within("queue", a.queue(&q)).await.expect("queue");
    assert_eq!(
        names(&left),
        vec![entries[0].name.as_str(), entries[2].name.as_str()]
    );
    within("abandon again", a.abandon(&q, &tickets[1]))
        .await
        .expect("abandon again");
    within("abandon unknown", a.abandon(&q, &crate::ticket()))
        .await
        .expect("abandon a ticket that created nothing");
    let nowhere = fresh_queue(&*a, "abandon-nowhere");
    within(
        "abandon in a missing queue",
        a.abandon(&nowhere, &tickets[0]),
    )
    .await
    .expect("abandon in a queue that does not exist");
    assert_eq!(
        names(&within("queue", a.queue(&q)).await.expect("queue")),
        vec![entries[0].name.as_str(), entries[2].name.as_str()]
    );
    within("close", a.close()).await.expect("close");
}

/// Enqueues dropped at every stage (before the first poll's request, in flight, after a
/// short timer, many at once) and then abandoned by their tickets leave no entry, and the
/// session still takes the lock at once afterwards.
pub async fn dropped_enqueues_then_abandon_leave_nothing(connect: Connect) {
    let a = session(&connect).await;
    let observer = session(&connect).await;
    let q = fresh_queue(&*a, "dropped");
    // Make the queue exist once, so most drops happen around the add itself.
    let first = add(&*a, &q, EntryKind::Lock, "enqueue").await;
    within("remove", a.remove(&q, &first.mine))
        .await
        .expect("remove");
    let kinds = [EntryKind::Lock, EntryKind::Read, EntryKind::Write];
    let (mut dropped, mut finished) = (0usize, 0usize);
    for i in 0..120u64 {
        let t = crate::ticket();
        let kind = kinds[i as usize % kinds.len()];
        let outcome = {
            let mut enqueue = a.enqueue(&q, &t, kind, Position::Tail, b"x");
            match i % 4 {
                // Polled once (which may send the request) and dropped.
                0 => enqueue.as_mut().now_or_never(),
                // Polled a few times across yields.
                1 | 2 => {
                    let mut done = None;
                    for _ in 0..i % 4 {
                        if let Some(r) = enqueue.as_mut().now_or_never() {
                            done = Some(r);
                            break;
                        }
                        tokio::task::yield_now().await;
                    }
                    done
                }
                // A short timer, up to 3 ms.
                _ => tokio::time::timeout(Duration::from_micros((i * 397) % 3000), enqueue)
                    .await
                    .ok(),
            }
        };
        match outcome {
            Some(r) => {
                r.expect("enqueue");
                finished += 1;
            }
            None => dropped += 1,
        }
        within("abandon", a.abandon(&q, &t)).await.expect("abandon");
        within("abandon again", a.abandon(&q, &t))
            .await
            .expect("abandon is idempotent");
    }
    // Many at once: spawned enqueues cut off by timers, abandoned after all have ended.
    let mut batch = Vec::new();
    for i in 0..20u64 {
        let t = crate::ticket();
        let (a, q, t2) = (a.clone(), q.clone(), t.clone());
        batch.push((
            t,
            tokio::spawn(async move {
                let budget = Duration::from_micros((i * 811) % 4000);
                tokio::time::timeout(
                    budget,
                    a.enqueue(&q, &t2, EntryKind::Lock, Position::Tail, b""),
                )
                .await
                .is_ok()
            }),
        ));
    }
    let mut tickets = Vec::new();
    for (t, h) in batch {
        if within("join", h).await.expect("join") {
            finished += 1;
        } else {
            dropped += 1;
        }
        tickets.push(t);
    }
    for t in &tickets {
        within("abandon", a.abandon(&q, t)).await.expect("abandon");
    }
    eprintln!("{dropped} enqueues dropped mid-flight, {finished} completed; all abandoned");
    assert!(
        dropped > 0,
        "no enqueue was dropped: the test tested nothing"
    );
    let left = within("queue", a.queue(&q)).await.expect("queue");
    assert!(left.is_empty(), "entries left behind: {left:?}");
    eventually("the observer sees nothing left", || async {
        observer
            .participants(&q)
            .await
            .expect("participants")
            .is_empty()
    })
    .await;
    let again = add(&*a, &q, EntryKind::Lock, "enqueue after the abandons").await;
    assert_eq!(names(&again.queue), vec![again.mine.name.as_str()]);
    assert_eq!(decide(&again.queue, &again.mine.name), Decision::Acquired);
    within("close", a.close()).await.expect("close");
    within("close", observer.close()).await.expect("close");
}

/// `queue_ahead` of an entry holds every entry the full queue has ahead of it and the
/// entry itself, in order, so `decide` answers the same on both; `contains` agrees with
/// the queue for present, removed and never-queued entries.
pub async fn queue_ahead_and_contains_agree_with_queue(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "ahead");
    let mut mine = Vec::new();
    for (i, kind) in [
        EntryKind::Write,
        EntryKind::Read,
        EntryKind::Read,
        EntryKind::Lock,
        EntryKind::Write,
    ]
    .into_iter()
    .enumerate()
    {
        let who = if i % 2 == 0 { &a } else { &b };
        mine.push((who.clone(), add(&**who, &q, kind, "enqueue").await.mine));
    }
    let full = within("queue", a.queue(&q)).await.expect("queue");
    assert_eq!(full.len(), mine.len());
    for (who, e) in &mine {
        let ahead = within("queue_ahead", who.queue_ahead(&q, e))
            .await
            .expect("queue_ahead");
        let at = full
            .iter()
            .position(|x| x.name == e.name)
            .expect("in the full queue");
        assert_eq!(
            names(&ahead[..=at.min(ahead.len() - 1)]),
            names(&full[..=at]),
            "queue_ahead of {} is not the full queue up to it",
            e.name
        );
        assert!(
            ahead
                .windows(2)
                .all(|w| (w[0].seq, &w[0].name) < (w[1].seq, &w[1].name)),
            "queue_ahead out of order: {ahead:?}"
        );
        let by_name = |d: Decision<'_>| match d {
            Decision::Wait(x) => format!("wait {}", x.name),
            other => format!("{other:?}"),
        };
        assert_eq!(
            by_name(decide(&ahead, &e.name)),
            by_name(decide(&full, &e.name))
        );
        assert!(
            within("contains", who.contains(&q, e))
                .await
                .expect("contains"),
            "{} is queued",
            e.name
        );
    }
    let (who, gone) = &mine[1];
    within("remove", who.remove(&q, gone))
        .await
        .expect("remove");
    assert!(
        !within("contains", who.contains(&q, gone))
            .await
            .expect("contains"),
        "a removed entry is not contained"
    );
    eventually("the other session sees the removal", || async {
        !a.contains(&q, gone).await.expect("contains")
    })
    .await;
    let nowhere = fresh_queue(&*a, "ahead-nowhere");
    assert!(
        !within("contains", a.contains(&nowhere, &mine[0].1))
            .await
            .expect("contains in a missing queue"),
        "contained in a queue that does not exist"
    );
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// `close` fires `lost` of the session's entries with an error that counts as lost, is
/// idempotent, and a later `enqueue` fails with [`Error::Closed`] (reads may still be
/// answered: etcd's `queue` after `close` lists the queue); a lost future made after
/// `close` completes at its first poll. `lost_now` answers as a lost future made then
/// does at its first poll: nothing while held, the reason once closed.
pub async fn close_fires_lost_and_later_calls_fail_typed(connect: Connect) {
    let a = session(&connect).await;
    let q = fresh_queue(&*a, "closed");
    let e = add(&*a, &q, EntryKind::Lock, "enqueue").await;
    assert!(
        a.lost(&q, &e.mine).now_or_never().is_none(),
        "held: not lost"
    );
    let now = a.lost_now(&q, &e.mine);
    assert!(now.is_none(), "lost_now of a held entry gave {now:?}");
    let lost = a.lost(&q, &e.mine);
    within("close", a.close()).await.expect("close");
    within("close again", a.close())
        .await
        .expect("close is idempotent");
    let err = within("lost after close", lost).await;
    assert!(err.is_lost(), "lost() after close gave {err:?}");
    let later = within(
        "enqueue after close",
        a.enqueue(&q, &crate::ticket(), EntryKind::Lock, Position::Tail, b""),
    )
    .await;
    assert!(
        matches!(later, Err(Error::Closed)),
        "enqueue after close gave {later:?}"
    );
    // The recipes peek at a loss with `lost_now`, which answers as a fresh lost future
    // does at its first poll.
    let err = a
        .lost(&q, &e.mine)
        .now_or_never()
        .expect("a lost future made after close completes at its first poll");
    assert!(err.is_lost(), "lost() of a closed session gave {err:?}");
    let now = a
        .lost_now(&q, &e.mine)
        .expect("lost_now after close gives the reason");
    assert!(now.is_lost(), "lost_now of a closed session gave {now:?}");
    // Also from a task whose tokio budget is spent, where a lost future's first poll
    // may answer `Pending` whatever it knows.
    super::spend_task_budget();
    let spent = a.lost_now(&q, &e.mine);
    assert!(
        spent.as_ref().is_some_and(Error::is_lost),
        "lost_now of a closed session, budget spent, gave {spent:?}"
    );
}

/// `close` removes every entry of the session at once (not after a session timeout),
/// and the other session's waiter then holds.
pub async fn close_removes_the_sessions_entries(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "closing");
    add(&*a, &q, EntryKind::Lock, "a enqueues").await;
    add(&*a, &q, EntryKind::Lock, "a enqueues again").await;
    let eb = add(&*b, &q, EntryKind::Lock, "b enqueues").await;
    assert!(matches!(
        decide(&eb.queue, &eb.mine.name),
        Decision::Wait(_)
    ));
    within("close", a.close()).await.expect("close");
    eventually("a's entries go with its session", || async {
        b.queue(&q).await.expect("queue").len() == 1
    })
    .await;
    let now = within("queue", b.queue(&q)).await.expect("queue");
    assert_eq!(names(&now), vec![eb.mine.name.as_str()]);
    assert_eq!(decide(&now, &eb.mine.name), Decision::Acquired);
    within("close", b.close()).await.expect("close");
}

/// `wait_changed` returns at once when the queue already differs from what the caller
/// saw, stays pending while it does not, and wakes on another session's removal and
/// (perhaps only by a periodic re-check) addition.
pub async fn wait_changed_wakes_on_a_removal_and_an_addition(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let q = fresh_queue(&*a, "changes");
    let e = add(&*a, &q, EntryKind::Lease, "enqueue").await;
    within("already different", a.wait_changed(&q, &[]))
        .await
        .expect("differs at once");
    eventually("b sees the lease", || async {
        b.queue(&q).await.expect("queue").len() == 1
    })
    .await;
    let seen = within("queue", b.queue(&q)).await.expect("queue");
    let waiter = {
        let (b, q, seen) = (b.clone(), q.clone(), seen.clone());
        tokio::spawn(async move { b.wait_changed(&q, &seen).await })
    };
    tokio::time::sleep(QUIET).await;
    assert!(
        !waiter.is_finished(),
        "wait_changed returned with no change"
    );
    within("remove", a.remove(&q, &e.mine))
        .await
        .expect("remove");
    within("woken by the removal", waiter)
        .await
        .expect("join")
        .expect("wait_changed");
    within("still different", b.wait_changed(&q, &seen))
        .await
        .expect("differs at once");

    eventually("b sees the removal", || async {
        b.queue(&q).await.expect("queue").is_empty()
    })
    .await;
    let waiter = {
        let (b, q) = (b.clone(), q.clone());
        tokio::spawn(async move { b.wait_changed(&q, &[]).await })
    };
    add(&*a, &q, EntryKind::Lease, "enqueue again").await;
    within("woken by the addition", waiter)
        .await
        .expect("join")
        .expect("wait_changed");
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// A sub-queue (`QueuePath::sub`) and its lock's root queue are independent: entries of
/// one never show in the other, the driver decides each alone, and `wait_changed` on one
/// ignores the other's traffic.
pub async fn sub_queues_are_independent(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let name = fresh_name(&*a, "sub");
    let root = QueuePath::root(name.clone());
    let leases = QueuePath::sub(name, "leases");
    let w = add(&*a, &root, EntryKind::Write, "writer").await;
    let l1 = add(&*a, &leases, EntryKind::Lease, "lease a").await;
    assert_eq!(names(&l1.queue), vec![l1.mine.name.as_str()]);
    let l2 = add(&*b, &leases, EntryKind::Lease, "lease b").await;
    assert_eq!(
        names(&l2.queue),
        vec![l1.mine.name.as_str(), l2.mine.name.as_str()]
    );
    let rq = within("root queue", a.queue(&root))
        .await
        .expect("root queue");
    assert_eq!(names(&rq), vec![w.mine.name.as_str()], "root: {rq:?}");
    assert_eq!(decide(&rq, &w.mine.name), Decision::Acquired);
    let lq = within("leases", b.queue(&leases)).await.expect("leases");
    assert!(lq.iter().all(|e| e.kind == EntryKind::Lease), "{lq:?}");

    let waiter = {
        let (b, leases, seen) = (b.clone(), leases.clone(), lq.clone());
        tokio::spawn(async move { b.wait_changed(&leases, &seen).await })
    };
    let other = add(&*a, &root, EntryKind::Lock, "root traffic").await;
    within("remove", a.remove(&root, &w.mine))
        .await
        .expect("remove");
    within("remove", a.remove(&root, &other.mine))
        .await
        .expect("remove");
    tokio::time::sleep(QUIET).await;
    assert!(
        !waiter.is_finished(),
        "root traffic woke a sub-queue waiter"
    );
    within("return a lease", a.remove(&leases, &l1.mine))
        .await
        .expect("return a lease");
    within("woken by the lease", waiter)
        .await
        .expect("join")
        .expect("wait_changed");
    assert_eq!(
        names(&within("leases", b.queue(&leases)).await.expect("leases")),
        vec![l2.mine.name.as_str()]
    );
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// Input a backend cannot honour gets a typed error and changes nothing: a `Beside`
/// entry that was never in the queue (it belongs to another queue) is
/// [`Error::LockLost`].
pub async fn bad_input_gets_typed_errors(connect: Connect) {
    let a = session(&connect).await;
    let q = fresh_queue(&*a, "bad-input");
    let elsewhere = fresh_queue(&*a, "bad-input-elsewhere");
    let w = add(&*a, &elsewhere, EntryKind::Write, "writer elsewhere").await;
    let got = within(
        "beside an entry of another queue",
        a.enqueue(
            &q,
            &crate::ticket(),
            EntryKind::Read,
            Position::Beside(&w.mine),
            b"",
        ),
    )
    .await;
    assert!(matches!(got, Err(Error::LockLost(_))), "got {got:?}");
    assert!(within("queue", a.queue(&q))
        .await
        .expect("queue")
        .is_empty());
    within("close", a.close()).await.expect("close");
}

/// `list_queues` finds every queue under a prefix that has entries, each with its
/// entries in queue order (what `queue` reads), sorted by path, sub-queues by their own
/// path; a prefix nothing starts with finds nothing; a queue whose entries all went is
/// no longer listed.
pub async fn list_queues_finds_the_queues_with_entries(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let name = fresh_name(&*a, "listing");
    let root = QueuePath::root(name.clone());
    let leases = QueuePath::sub(name, "leases");
    let (path, sub_path) = (root.relative(), leases.relative());
    let first = add(&*a, &root, EntryKind::Lock, "holder").await;
    let second = add(&*b, &root, EntryKind::Lock, "waiter").await;
    let lease = add(&*b, &leases, EntryKind::Lease, "lease").await;
    let listed = || async {
        within("list", a.list_queues(&path))
            .await
            .expect("list_queues")
    };
    eventually("both queues are listed", || async {
        listed()
            .await
            .iter()
            .map(|q| q.entries.len())
            .sum::<usize>()
            == 3
    })
    .await;
    let got = listed().await;
    let paths: Vec<&str> = got.iter().map(|q| q.path.as_str()).collect();
    assert_eq!(paths, vec![path.as_str(), sub_path.as_str()], "{got:?}");
    assert_eq!(
        names(&got[0].entries),
        vec![first.mine.name.as_str(), second.mine.name.as_str()],
        "the lock's entries in queue order"
    );
    assert_eq!(names(&got[1].entries), vec![lease.mine.name.as_str()]);
    let none = within("list", a.list_queues(&format!("{path}-nothing-here")))
        .await
        .expect("list_queues");
    assert!(none.is_empty(), "a prefix nothing starts with: {none:?}");

    within("remove", b.remove(&leases, &lease.mine))
        .await
        .expect("remove");
    eventually("the emptied sub-queue is no longer listed", || async {
        listed().await.len() == 1
    })
    .await;
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}

/// `enqueue_removing` adds the new entry (with a token above the removed one's) and
/// removes the held one, whose waiter wakes. Where the backend claims it as one atomic
/// step ([`dlock_core::Hints::atomic_enqueue_removing`]), an entry to remove that is
/// already gone fails it with [`Error::LockLost`] and adds nothing: the new entry exists
/// only if the removed one still did (what the semaphore's permit count rests on).
pub async fn enqueue_removing_adds_one_and_removes_the_other(connect: Connect) {
    let a = session(&connect).await;
    let b = session(&connect).await;
    let name = fresh_name(&*a, "enqueue-removing");
    let locks = QueuePath::sub(name.clone(), "locks");
    let leases = QueuePath::sub(name, "leases");
    let held = add(&*a, &locks, EntryKind::Lock, "a takes the mutex").await;
    let next = add(&*b, &locks, EntryKind::Lock, "b queues").await;
    let waiter = {
        let (b, locks, ahead) = (b.clone(), locks.clone(), held.mine.clone());
        tokio::spawn(async move { b.wait_gone(&locks, &ahead).await })
    };
    tokio::time::sleep(QUIET).await;
    assert!(!waiter.is_finished(), "b woke while a holds");
    let ticket = crate::ticket();
    let lease = within(
        "a takes a lease and hands the mutex on",
        a.enqueue_removing(&leases, &ticket, EntryKind::Lease, b"p", &locks, &held.mine),
    )
    .await
    .expect("enqueue_removing");
    assert_eq!(lease.kind, EntryKind::Lease);
    assert_eq!(lease.ticket.as_deref(), Some(ticket.as_str()));
    assert!(
        lease.token > held.mine.token,
        "the lease's token above the mutex entry's"
    );
    within("b wakes", waiter)
        .await
        .expect("join")
        .expect("wait_gone");
    let now = within("locks", a.queue(&locks)).await.expect("locks");
    assert_eq!(names(&now), vec![next.mine.name.as_str()]);
    let ls = within("leases", a.queue(&leases)).await.expect("leases");
    assert_eq!(names(&ls), vec![lease.name.as_str()]);
    // A listing may leave tokens out (a ZooKeeper child list has none); one it has agrees.
    assert!(
        ls[0].token.is_none() || ls[0].token == lease.token,
        "{ls:?}"
    );

    // The mutex entry is gone now: handing it on again must not take a second lease.
    let again = crate::ticket();
    let r = within(
        "hand on a gone entry",
        a.enqueue_removing(&leases, &again, EntryKind::Lease, b"p", &locks, &held.mine),
    )
    .await;
    if a.hints().atomic_enqueue_removing {
        assert!(
            matches!(r, Err(Error::LockLost(_))),
            "an atomic backend must refuse to hand on a gone entry, got {r:?}"
        );
        let ls = within("leases", a.queue(&leases)).await.expect("leases");
        assert_eq!(names(&ls), vec![lease.name.as_str()], "nothing added");
    } else if let Err(e) = &r {
        // The default enqueues first; a refusal is typed and the caller abandons.
        assert!(e.is_lost(), "a typed refusal, got {e}");
    }
    within("abandon", a.abandon(&leases, &again))
        .await
        .expect("abandon");
    within("return the lease", a.remove(&leases, &lease))
        .await
        .expect("return the lease");
    assert!(within("leases", a.queue(&leases))
        .await
        .expect("leases")
        .is_empty());
    within("b releases", b.remove(&locks, &next.mine))
        .await
        .expect("b releases");
    within("close", a.close()).await.expect("close");
    within("close", b.close()).await.expect("close");
}
