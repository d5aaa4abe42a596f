//! No herd, counted: every waiter runs on its own counting wrapper around one real
//! ZooKeeper session, so the test knows exactly how many times each waiter was woken
//! (`wait_gone` completed) and re-read the queue (`queue` called). Counts, not timing.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock::{DynBackend, LockGuard, Result};
use dlock_testkit::tap::{Call, Tap, Tapped};
use tokio::sync::{mpsc, oneshot};

use crate::support::{client, eventually, leftovers, unique};

const GENEROUS: Duration = Duration::from_secs(60);

/// Counts what one waiter does through its backend.
#[derive(Default)]
pub struct Counting {
    /// `queue()` and `queue_ahead()` calls: re-checks after a wake-up.
    pub queue_calls: AtomicUsize,
    /// `wait_gone()`, `wait_gone_detail()` and `wait_gone_behind()` calls: watches armed.
    pub waits_begun: AtomicUsize,
    /// Their completions: wake-ups.
    pub waits_done: AtomicUsize,
    /// `wait_changed()` calls (the semaphore's lease wait; a mutex never uses it).
    pub changed_calls: AtomicUsize,
}

impl Counting {
    fn snapshot(&self) -> (usize, usize, usize, usize) {
        (
            self.queue_calls.load(Ordering::SeqCst),
            self.waits_begun.load(Ordering::SeqCst),
            self.waits_done.load(Ordering::SeqCst),
            self.changed_calls.load(Ordering::SeqCst),
        )
    }
}

impl Tap for Counting {
    fn begin(&self, call: Call) -> Result<()> {
        let counter = match call {
            Call::Queue | Call::QueueAhead => &self.queue_calls,
            Call::WaitGone | Call::WaitGoneDetail | Call::WaitGoneBehind => &self.waits_begun,
            Call::WaitChanged => &self.changed_calls,
            _ => return Ok(()),
        };
        counter.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }

    fn end(&self, call: Call) {
        if matches!(
            call,
            Call::WaitGone | Call::WaitGoneDetail | Call::WaitGoneBehind
        ) {
            self.waits_done.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// One waiter: its counters, the channel that tells it to release, and its task.
struct Waiter {
    counts: Arc<Tapped<Counting>>,
    release: Option<oneshot::Sender<()>>,
    task: tokio::task::JoinHandle<()>,
}

/// What a waiter wants.
#[derive(Clone, Copy)]
enum Want {
    Lock,
    Read,
    Write,
}

/// Starts a waiter on its own counting wrapper over `inner`, and waits until its entry
/// is in the queue (so queue order is spawn order). It reports its index on `acquired`
/// once it holds, and releases when told.
async fn spawn_waiter(
    inner: &Arc<dyn DynBackend>,
    observer: &dlock::Client,
    name: &str,
    want: Want,
    index: usize,
    acquired: &mpsc::UnboundedSender<usize>,
) -> Waiter {
    let before = observer
        .participants(name)
        .await
        .expect("participants")
        .len();
    let counts = Tapped::new(inner.clone(), Counting::default());
    let c = dlock::Client::new(counts.clone() as Arc<dyn DynBackend>);
    let (release, released) = oneshot::channel::<()>();
    let (name2, acquired) = (name.to_owned(), acquired.clone());
    let task = tokio::spawn(async move {
        let g: Result<LockGuard> = match want {
            Want::Lock => c.mutex(&name2).expect("name").lock_timeout(GENEROUS).await,
            Want::Read => c.rwlock(&name2).expect("name").read_timeout(GENEROUS).await,
            Want::Write => {
                c.rwlock(&name2)
                    .expect("name")
                    .write_timeout(GENEROUS)
                    .await
            }
        };
        let mut g = g.unwrap_or_else(|e| panic!("waiter {index}: {e}"));
        let _ = acquired.send(index);
        let _ = released.await;
        g.release().await.expect("release");
    });
    assert!(
        eventually(GENEROUS, || async {
            observer
                .participants(name)
                .await
                .map(|p| p.len())
                .unwrap_or(0)
                == before + 1
        })
        .await,
        "waiter {index} never queued"
    );
    Waiter {
        counts,
        release: Some(release),
        task,
    }
}

fn total_woken(ws: &[Waiter]) -> usize {
    ws.iter()
        .map(|w| w.counts.tap().waits_done.load(Ordering::SeqCst))
        .sum()
}

/// 50 waiters queue on one mutex behind a holder. Each release wakes at most two
/// waiters: the next in line, which then holds without listing the queue, and the one
/// after it, which lists the queue while the next one holds (so its own turn needs no
/// listing either). After the k-th release at most 2k waiters have been woken, and at the
/// end every waiter armed at most two watches, was woken at most twice and listed the
/// queue at most once; the first waiter, with only the holder ahead, never listed it (a
/// herd would wake every waiter on every release: 1 275 wake-ups).
pub async fn mutex_queue_of_50(url: &str) {
    const N: usize = 50;
    let name = unique("herd");
    let base = client(url).await;
    let inner = base.backend().clone();
    let mut holder = base.mutex(&name).expect("name").lock().await.expect("lock");
    let (tx, mut acquired) = mpsc::unbounded_channel();
    let mut ws = Vec::with_capacity(N);
    for i in 0..N {
        ws.push(spawn_waiter(&inner, &base, &name, Want::Lock, i, &tx).await);
    }
    assert_eq!(total_woken(&ws), 0, "a waiter woke while the holder held");
    holder.release().await.expect("release");
    for k in 0..N {
        let next = tokio::time::timeout(GENEROUS, acquired.recv())
            .await
            .expect("the queue stalled")
            .expect("waiters alive");
        assert_eq!(next, k, "FIFO: waiter {k} must be next");
        let woken = total_woken(&ws);
        assert!(
            (k + 1..=2 * (k + 1)).contains(&woken),
            "after release {k}, {woken} wake-ups: between {} and {} expected",
            k + 1,
            2 * (k + 1)
        );
        if let Some(r) = ws[k].release.take() {
            let _ = r.send(());
        }
    }
    for (i, w) in ws.iter_mut().enumerate() {
        (&mut w.task).await.expect("waiter task");
        let (queue, begun, done, changed) = w.counts.tap().snapshot();
        // Waiter 0 had only the holder ahead: its listing answered the handoff. The
        // others listed once, when the entry two ahead went (the exact split between
        // their two watches depends on which notification came first).
        let limits = if i == 0 { (1, 1, 0) } else { (2, 2, 1) };
        assert!(
            begun >= 1 && begun <= limits.0 && done >= 1 && done <= limits.1,
            "waiter {i}: {begun} watches armed, {done} wake-ups"
        );
        assert_eq!(
            (queue, changed),
            (limits.2, 0),
            "waiter {i}: queue re-reads, lease waits"
        );
    }
    assert!(
        eventually(GENEROUS, || async { leftovers(&base, &name).await == 0 }).await,
        "entries left"
    );
    base.close().await.expect("close");
}

/// A writer holds; 10 readers queue behind it, then a writer, then 5 more readers.
/// Releasing the first writer lets all 10 readers in and wakes only them; the queued
/// writer wakes once, when the last reader ahead of it goes; the 5 late readers wake
/// once, when that writer goes.
pub async fn readers_behind_writer(url: &str) {
    let name = unique("herd-rw");
    let base = client(url).await;
    let inner = base.backend().clone();
    let mut w1 = base
        .rwlock(&name)
        .expect("name")
        .write()
        .await
        .expect("write");
    let (tx, mut acquired) = mpsc::unbounded_channel();
    let mut ws = Vec::new();
    for i in 0..10 {
        ws.push(spawn_waiter(&inner, &base, &name, Want::Read, i, &tx).await);
    }
    ws.push(spawn_waiter(&inner, &base, &name, Want::Write, 10, &tx).await);
    for i in 11..16 {
        ws.push(spawn_waiter(&inner, &base, &name, Want::Read, i, &tx).await);
    }

    w1.release().await.expect("release");
    let mut first: Vec<usize> = Vec::new();
    for _ in 0..10 {
        first.push(recv(&mut acquired).await);
    }
    first.sort_unstable();
    assert_eq!(first, (0..10).collect::<Vec<_>>(), "the 10 readers get in");
    for (i, w) in ws.iter().enumerate() {
        let (queue, begun, done, _) = w.counts.tap().snapshot();
        if i < 10 {
            assert_eq!((begun, done, queue), (1, 1, 0), "reader {i}");
        } else {
            assert_eq!(
                (done, queue),
                (0, 0),
                "waiter {i} woken by the writer's release"
            );
        }
    }

    // Release the readers oldest first: the writer watches the youngest reader ahead of
    // it, so only the last of these releases wakes it.
    for w in ws.iter_mut().take(10) {
        if let Some(r) = w.release.take() {
            let _ = r.send(());
        }
        (&mut w.task).await.expect("reader task");
    }
    assert_eq!(recv(&mut acquired).await, 10, "the queued writer is next");
    assert_eq!(
        ws[10].counts.tap().snapshot().2,
        1,
        "the writer woke once for ten reader releases"
    );
    for (i, w) in ws.iter().enumerate().skip(11) {
        assert_eq!(
            w.counts.tap().snapshot().2,
            0,
            "late reader {i} woken early"
        );
    }

    if let Some(r) = ws[10].release.take() {
        let _ = r.send(());
    }
    let mut late: Vec<usize> = Vec::new();
    for _ in 11..16 {
        late.push(recv(&mut acquired).await);
    }
    late.sort_unstable();
    assert_eq!(late, (11..16).collect::<Vec<_>>());
    for w in ws.iter_mut().skip(10) {
        if let Some(r) = w.release.take() {
            let _ = r.send(());
        }
        (&mut w.task).await.expect("task");
    }
    for (i, w) in ws.iter().enumerate() {
        let (queue, begun, done, changed) = w.counts.tap().snapshot();
        // The first readers decide from their listing (one writer ahead). The writer
        // re-reads once: a write stood ahead of it, and that write's holder could have
        // put a downgrade read ahead. The late readers' listing still named the first
        // writer too, so they list once more.
        let rereads = usize::from(i >= 10);
        assert_eq!(
            (begun, done, queue, changed),
            (1, 1, rereads, 0),
            "waiter {i}: one watch, one wake-up, {rereads} re-reads"
        );
    }
    assert!(
        eventually(GENEROUS, || async { leftovers(&base, &name).await == 0 }).await,
        "entries left"
    );
    base.close().await.expect("close");
}

/// The next waiter index reported as acquired.
async fn recv(rx: &mut mpsc::UnboundedReceiver<usize>) -> usize {
    tokio::time::timeout(GENEROUS, rx.recv())
        .await
        .expect("the queue stalled")
        .expect("waiters alive")
}
