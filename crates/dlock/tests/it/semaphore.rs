//! The counting semaphore's waits, on every backend, and etcd's ranked layout
//! ([`dlock_core::Hints::ranked_semaphore`]): one `permits` queue whose first N entries
//! hold, no internal mutex.

// The etcd-only test is not instantiated without the etcd feature.
#![cfg_attr(not(feature = "etcd"), allow(dead_code, unused_imports))]

use std::time::Duration;

use dlock::{Client, LockKind};

use crate::support::{client, eventually, leftovers, unique, Kind};

const GENEROUS: Duration = Duration::from_secs(30);
/// How long a freed permit may take to reach the waiter: far below the session (4 s
/// here) and the test's other limits, far above a wake-up.
const PROMPTLY: Duration = Duration::from_secs(3);

async fn clients(url: &str, n: usize) -> Vec<Client> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        out.push(client(url).await);
    }
    out
}

/// Asserts that `name` has no entry left (within [`GENEROUS`]), then closes `cs`.
async fn nothing_left_then_close(cs: Vec<Client>, name: &str) {
    assert!(
        eventually(GENEROUS, || async { leftovers(&cs[0], name).await == 0 }).await,
        "nothing left"
    );
    for c in cs {
        c.close().await.expect("close");
    }
}

/// Three permits held in turn by A, B and C, and D waiting: B, neither the first nor
/// the last holder, gives its permit back, and D gets it while A and C still hold. With
/// Curator's layout the internal mutex's holder waits on every lease; in the ranked one
/// D waits on each of the three entries ahead of it (a wait on the nearest alone would
/// leave D waiting for C).
pub async fn a_waiter_gets_the_permit_any_holder_gives_back(_kind: Kind, url: &str) {
    let name = unique("sem-any");
    let cs = clients(url, 4).await;
    let mut held = Vec::new();
    for c in &cs[..3] {
        let sem = c.semaphore(&name, 3).expect("name");
        held.push(
            sem.acquire_timeout(GENEROUS)
                .await
                .expect("one of three permits"),
        );
    }
    let sem = cs[3].semaphore(&name, 3).expect("name");
    let waiter = tokio::spawn(async move { sem.acquire_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { leftovers(&cs[0], &name).await >= 4 }).await,
        "the fourth contender queued"
    );
    assert!(
        !waiter.is_finished(),
        "no permit for a fourth while three hold"
    );
    let mut b = held.remove(1);
    b.release().await.expect("B gives its permit back");
    let mut d = tokio::time::timeout(PROMPTLY, waiter)
        .await
        .expect("D gets B's permit while A and C still hold")
        .expect("task")
        .expect("permit");
    for g in &held {
        g.verify().await.expect("A and C still hold theirs");
    }
    d.release().await.expect("release");
    for g in &mut held {
        g.release().await.expect("release");
    }
    nothing_left_then_close(cs, &name).await;
}

/// A queue longer than a waiter watches: two permits held, twenty waiters of one client
/// queued behind them (on etcd each waiter sees at most eight entries ahead of it by
/// watch, and the rest only by listing again). Every waiter gets a permit, never more
/// than two hold at once, and nothing is left.
pub async fn a_long_semaphore_queue_hands_every_permit_on(_kind: Kind, url: &str) {
    use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
    use std::sync::Arc;
    const WAITERS: usize = 20;
    let name = unique("sem-long");
    let cs = clients(url, 2).await;
    let sem = cs[0].semaphore(&name, 2).expect("name");
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(
            sem.acquire_timeout(GENEROUS)
                .await
                .expect("one of two permits"),
        );
    }
    let inside = Arc::new(AtomicUsize::new(0));
    let peak = Arc::new(AtomicUsize::new(0));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..WAITERS {
        let sem = cs[1].semaphore(&name, 2).expect("name");
        let (inside, peak) = (inside.clone(), peak.clone());
        tasks.spawn(async move {
            let mut g = sem.acquire_timeout(GENEROUS).await?;
            peak.fetch_max(inside.fetch_add(1, SeqCst) + 1, SeqCst);
            tokio::time::sleep(Duration::from_millis(5)).await;
            inside.fetch_sub(1, SeqCst);
            g.release().await
        });
    }
    assert!(
        eventually(GENEROUS, || async {
            leftovers(&cs[0], &name).await >= 2 + WAITERS
        })
        .await,
        "every waiter queued"
    );
    assert!(
        tasks.len() == WAITERS && inside.load(SeqCst) == 0,
        "nobody inside while two hold"
    );
    for g in &mut held {
        g.release().await.expect("release");
    }
    let mut served = 0;
    while let Some(r) = tasks.join_next().await {
        r.expect("task").expect("a waiter's permit");
        served += 1;
    }
    assert_eq!(served, WAITERS);
    let peak = peak.load(SeqCst);
    assert!((1..=2).contains(&peak), "{peak} held at once of 2 permits");
    nothing_left_then_close(cs, &name).await;
}

/// etcd's ranked semaphore: a semaphore-mutex and a semaphore of three permits under one
/// name share one queue, and no holder shares it with as many others as its own count: while the semaphore-mutex holds,
/// nobody given three permits is let in beside it (a contender counting only its own
/// three was, found by a review); once it releases, two given three hold together;
/// a semaphore-mutex contender queued behind them waits until both are gone, and one
/// given three that comes while one of the two still holds does not pass it (counting
/// its own three only, it would: one entry ahead of the two before it). Curator's
/// layout (ZooKeeper, Redis, the in-memory backend) counts as Curator does, each
/// contender against its own count: see `Semaphore`'s docs.
pub async fn mixed_permit_counts_never_share_beyond_a_holders_count(_kind: Kind, url: &str) {
    let name = unique("sem-mixed");
    let cs = clients(url, 4).await;
    let mutex = cs[0].semaphore_mutex(&name).expect("name");
    let mut alone = mutex.lock_timeout(GENEROUS).await.expect("the mutex");
    let three = cs[1].semaphore(&name, 3).expect("name");
    let beside = three.acquire_timeout(Duration::from_millis(1500)).await;
    assert!(
        matches!(beside, Err(dlock::Error::Timeout(_))),
        "a permit of three beside the semaphore-mutex's holder: {:?}",
        beside.map(|g| g.token())
    );
    let (a, b) = (three.clone(), cs[2].semaphore(&name, 3).expect("name"));
    let first = tokio::spawn(async move { a.acquire_timeout(GENEROUS).await });
    let second = tokio::spawn(async move { b.acquire_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { leftovers(&cs[0], &name).await == 3 }).await,
        "both queued"
    );
    assert!(
        !first.is_finished() && !second.is_finished(),
        "nobody beside the semaphore-mutex's holder"
    );
    alone.release().await.expect("release");
    let mut first = tokio::time::timeout(PROMPTLY, first)
        .await
        .expect("a permit of three once the mutex is back")
        .expect("task")
        .expect("permit");
    let mut second = tokio::time::timeout(PROMPTLY, second)
        .await
        .expect("two of three together")
        .expect("task")
        .expect("permit");
    let next_mutex = cs[3].semaphore_mutex(&name).expect("name");
    let waiter = tokio::spawn(async move { next_mutex.lock_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { leftovers(&cs[0], &name).await == 3 }).await,
        "the semaphore-mutex contender queued"
    );
    second.release().await.expect("release");
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(
        !waiter.is_finished(),
        "the semaphore-mutex granted beside a permit still held"
    );
    let late = cs[1].semaphore(&name, 3).expect("name");
    let behind = late.acquire_timeout(Duration::from_millis(1500)).await;
    assert!(
        matches!(behind, Err(dlock::Error::Timeout(_))),
        "a permit of three passed the semaphore-mutex contender queued before it: {:?}",
        behind.map(|g| g.token())
    );
    first.release().await.expect("release");
    let mut last = tokio::time::timeout(PROMPTLY, waiter)
        .await
        .expect("the semaphore-mutex once both are back")
        .expect("task")
        .expect("the mutex");
    last.release().await.expect("release");
    nothing_left_then_close(cs, &name).await;
}

/// etcd's ranked semaphore: a waiter watches the entry with a smaller count that holds
/// its bound down, however far ahead. A semaphore-mutex's holder, then nine contenders
/// given ten permits: each waits for the mutex's holder alone; when it releases, all
/// nine hold at once. The ninth has nine entries ahead and watches the eight nearest
/// (and the bound's), so without its watch on the holder it would wait for one of the
/// other eight to go.
pub async fn a_smaller_count_far_ahead_is_watched(_kind: Kind, url: &str) {
    const WAITERS: usize = 9;
    let name = unique("sem-far");
    let cs = clients(url, 2).await;
    let mutex = cs[0].semaphore_mutex(&name).expect("name");
    let mut alone = mutex.lock_timeout(GENEROUS).await.expect("the mutex");
    let mut waiters = Vec::new();
    for i in 0..WAITERS {
        let sem = cs[1].semaphore(&name, 10).expect("name");
        waiters.push(tokio::spawn(
            async move { sem.acquire_timeout(GENEROUS).await },
        ));
        assert!(
            eventually(GENEROUS, || async {
                leftovers(&cs[0], &name).await == i + 2
            })
            .await,
            "waiter {i} queued in turn"
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        waiters.iter().all(|w| !w.is_finished()),
        "nobody beside the semaphore-mutex's holder"
    );
    alone.release().await.expect("release");
    let mut held = Vec::new();
    for (i, w) in waiters.into_iter().enumerate() {
        held.push(
            tokio::time::timeout(PROMPTLY, w)
                .await
                .unwrap_or_else(|_| panic!("waiter {i} of {WAITERS} once the mutex is back"))
                .expect("task")
                .expect("permit"),
        );
    }
    for g in &mut held {
        g.release().await.expect("release");
    }
    nothing_left_then_close(cs, &name).await;
}

/// etcd's semaphore is one ranked queue: every contender's entry is in `permits` (none
/// in Curator's `leases` or `locks`), the first two of a two-permit semaphore hold and
/// the third waits, as `participants` and the listing say; when the first holder
/// leaves, the waiter holds, with no write of its own.
pub async fn etcd_semaphore_is_one_ranked_queue(_kind: Kind, url: &str) {
    let name = unique("sem-ranked");
    let cs = clients(url, 3).await;
    let mut a = cs[0]
        .semaphore(&name, 2)
        .expect("name")
        .acquire_timeout(GENEROUS)
        .await
        .expect("A: a permit");
    let mut b = cs[1]
        .semaphore(&name, 2)
        .expect("name")
        .acquire_timeout(GENEROUS)
        .await
        .expect("B: a permit");
    let sem = cs[2].semaphore(&name, 2).expect("name");
    let waiter = tokio::spawn(async move { sem.acquire_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { leftovers(&cs[0], &name).await == 3 }).await,
        "C queued"
    );
    let ps = cs[0].participants(&name).await.expect("participants");
    let by_queue: Vec<(&str, bool)> = ps.iter().map(|p| (p.queue, p.holds)).collect();
    assert_eq!(
        by_queue,
        [("permits", true), ("permits", true), ("permits", false)],
        "one queue, the first two hold"
    );
    assert!(
        ps.iter()
            .all(|p| String::from_utf8_lossy(&p.entry.data).ends_with(" permits=2")),
        "each entry carries its count"
    );
    let listed: Vec<(String, LockKind, usize, usize)> = cs[0]
        .locks(&name)
        .await
        .expect("list")
        .into_iter()
        .map(|l| (l.name.as_str().to_owned(), l.kind, l.holders, l.waiters))
        .collect();
    assert_eq!(listed, [(name.clone(), LockKind::Semaphore, 2, 1)]);

    a.release().await.expect("A leaves");
    let mut c = tokio::time::timeout(PROMPTLY, waiter)
        .await
        .expect("C holds once A left")
        .expect("task")
        .expect("permit");
    let ps = cs[0].participants(&name).await.expect("participants");
    let holds: Vec<bool> = ps.iter().map(|p| p.holds).collect();
    assert_eq!(holds, [true, true], "B and C hold");
    b.release().await.expect("release");
    c.release().await.expect("release");
    nothing_left_then_close(cs, &name).await;
}

/// A permit waiter whose own entry is deleted from outside while it waits never takes a
/// permit from the view it had (the mutex's `a_waiter_whose_entry_went_is_never_granted`,
/// on a one-permit semaphore): when the holder gives its permit back, the waiter fails
/// with `LockLost` and the contender that queued after the deletion takes the permit
/// alone. Whichever of the waiter's entries the layout has (etcd's ranked permit, the
/// internal mutex of Curator's layout, its lease where it has one) is the one deleted.
pub async fn a_permit_waiter_whose_entry_went_is_never_granted(_kind: Kind, url: &str) {
    let name = unique("semgone");
    let cs = clients(url, 3).await;
    let entries = |c: &Client| {
        let name = name.clone();
        let c = c.clone();
        async move { c.participants(&name).await.expect("participants") }
    };
    let mut g = cs[0]
        .semaphore(&name, 1)
        .expect("name")
        .acquire()
        .await
        .expect("permit");
    let before = entries(&cs[0]).await;
    let sem_b = cs[1].semaphore(&name, 1).expect("name");
    let waiter = tokio::spawn(async move {
        sem_b
            .acquire_timeout(GENEROUS)
            .await
            .map(|g| g.token().get())
    });
    assert!(
        eventually(GENEROUS, || async {
            entries(&cs[0]).await.len() > before.len()
        })
        .await,
        "the waiter never queued"
    );
    let added: Vec<_> = entries(&cs[0])
        .await
        .into_iter()
        .filter(|p| !before.iter().any(|b| b.entry.name == p.entry.name))
        .collect();
    // Curator's order (add the lease, then look) leaves the waiter two entries: its
    // lease, which is what counts against the permits, and the internal mutex it holds.
    let target = added
        .iter()
        .find(|p| p.entry.kind == dlock::EntryKind::Lease)
        .or(added.first())
        .expect("the waiter's entry");
    assert!(added.len() <= 2, "the waiter's entries: {added:?}");
    let lock = cs[0].lock_name(&name).expect("name");
    let q = match target.queue {
        "" => dlock_core::QueuePath::root(lock),
        sub => dlock_core::QueuePath::sub(lock, sub),
    };
    cs[0]
        .backend()
        .remove(&q, &target.entry)
        .await
        .expect("delete the waiter's entry from outside");
    let sem_c = cs[2].semaphore(&name, 1).expect("name");
    let newcomer = tokio::spawn(async move { sem_c.acquire_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async {
            entries(&cs[0]).await.len() > before.len()
        })
        .await,
        "the newcomer never queued"
    );
    g.release().await.expect("release");
    let got = tokio::time::timeout(GENEROUS, waiter)
        .await
        .expect("the waiter finished")
        .expect("waiter task");
    assert!(
        matches!(got, Err(dlock::Error::LockLost(_))),
        "a waiter whose entry was deleted took the permit beside the newcomer: {got:?}"
    );
    let mut gc = tokio::time::timeout(GENEROUS, newcomer)
        .await
        .expect("the newcomer finished")
        .expect("newcomer task")
        .expect("the newcomer gets the permit");
    gc.release().await.expect("release");
    assert_eq!(
        leftovers(&cs[0], &name).await,
        0,
        "entries left under {name}"
    );
    for c in cs {
        c.close().await.expect("close");
    }
}

/// Holds back the wake-up of a ranked permit waiter's watch on one entry (`held`) until
/// its watch on another (`opens`) has woken, so the waiter hears of two removals in the
/// reverse of the server's order.
#[derive(Default)]
struct Reorder {
    held: std::sync::Mutex<Option<String>>,
    opens: std::sync::Mutex<Option<String>>,
    gate: std::sync::Arc<tokio::sync::Notify>,
    /// The held wake-up has arrived (and is waiting at the gate).
    arrived: std::sync::atomic::AtomicBool,
    /// `wait_gone_behind` calls made.
    watches: std::sync::atomic::AtomicUsize,
}

impl dlock_testkit::tap::Tap for Reorder {
    fn begin(&self, call: dlock_testkit::tap::Call) -> dlock::Result<()> {
        if call == dlock_testkit::tap::Call::WaitGoneBehind {
            self.watches
                .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(())
    }

    fn hold_wake(
        &self,
        gone: &dlock::Entry,
        _woken: &dlock::Result<dlock_core::Woken>,
    ) -> futures::future::BoxFuture<'static, ()> {
        let is = |slot: &std::sync::Mutex<Option<String>>| {
            slot.lock().expect("tap lock").as_deref() == Some(gone.name.as_str())
        };
        if is(&self.held) {
            self.arrived
                .store(true, std::sync::atomic::Ordering::SeqCst);
            let gate = self.gate.clone();
            Box::pin(async move { gate.notified().await })
        } else {
            if is(&self.opens) {
                // `notify_one` keeps a permit if the held wake-up has not reached the
                // gate yet, so the order holds either way.
                self.gate.notify_one();
            }
            Box::pin(async {})
        }
    }
}

/// A ranked permit waiter (etcd's semaphore, one permit) watches several entries ahead
/// of it at once, and each wake-up says whether its own entry was still queued when that
/// entry went. Here the waiter M hears of two removals in the reverse of their order:
/// W1's (cancelled while M was queued: "still queued") after H's (the holder's release,
/// which came after M's entry was deleted from outside: "not queued"). M must not take
/// the permit beside the newcomer N that queued after the deletion. Before, M kept only
/// the last wake-up's answer ("still queued"), skipped the check of its own entry and
/// held beside N; a grant without a fresh listing now needs every wake-up since the last
/// listing to have shown its entry queued. `connect` opens a session of a backend whose
/// semaphores are ranked.
pub async fn ranked_waiter_hearing_removals_out_of_order_is_not_granted<F, Fut>(connect: F)
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Client>,
{
    use std::sync::atomic::Ordering;
    let name = unique("semorder");
    let (h, w1, n) = (connect().await, connect().await, connect().await);
    let reorder =
        dlock_testkit::tap::Tapped::new(connect().await.backend().clone(), Reorder::default());
    assert!(
        dlock::DynBackend::hints(&*reorder).ranked_semaphore,
        "this test is for backends whose semaphores are ranked"
    );
    let m = Client::new(reorder.clone() as std::sync::Arc<dyn dlock::DynBackend>);
    let entries = || async { h.participants(&name).await.expect("participants") };

    let mut g = h
        .semaphore(&name, 1)
        .expect("name")
        .acquire()
        .await
        .expect("permit");
    let holder = entries().await[0].entry.name.clone();
    let sem_w1 = w1.semaphore(&name, 1).expect("name");
    let w1_task = tokio::spawn(async move { sem_w1.acquire().await.map(|_| ()) });
    assert!(eventually(GENEROUS, || async { entries().await.len() == 2 }).await);
    let w1_entry = entries().await[1].entry.name.clone();
    *reorder.tap().held.lock().expect("tap") = Some(w1_entry);
    *reorder.tap().opens.lock().expect("tap") = Some(holder);

    let sem_m = m.semaphore(&name, 1).expect("name");
    let m_task =
        tokio::spawn(async move { sem_m.acquire_timeout(GENEROUS).await.map(|g| g.token()) });
    assert!(
        eventually(GENEROUS, || async {
            reorder.tap().watches.load(Ordering::SeqCst) >= 2
        })
        .await,
        "M never watched both entries ahead of it"
    );
    let m_entry = entries().await[2].clone();

    // W1 leaves while M is queued: M's wake-up for it ("still queued") is held back.
    w1_task.abort();
    assert!(
        eventually(GENEROUS, || async {
            reorder.tap().arrived.load(Ordering::SeqCst)
        })
        .await,
        "M's watch never heard W1 go"
    );
    // M's entry goes from outside; N queues after it.
    let lock = h.lock_name(&name).expect("name");
    let q = match m_entry.queue {
        "" => dlock_core::QueuePath::root(lock),
        sub => dlock_core::QueuePath::sub(lock, sub),
    };
    h.backend()
        .remove(&q, &m_entry.entry)
        .await
        .expect("delete M's entry from outside");
    let sem_n = n.semaphore(&name, 1).expect("name");
    let n_task = tokio::spawn(async move { sem_n.acquire_timeout(GENEROUS).await });
    assert!(eventually(GENEROUS, || async { entries().await.len() == 2 }).await);

    // H gives its permit back: M hears of it ("not queued"), then of W1.
    g.release().await.expect("release");
    let mut gn = tokio::time::timeout(GENEROUS, n_task)
        .await
        .expect("N finished")
        .expect("N's task")
        .expect("N takes the permit");
    let got = tokio::time::timeout(GENEROUS, m_task)
        .await
        .expect("M finished")
        .expect("M's task");
    assert!(
        matches!(got, Err(dlock::Error::LockLost(_))),
        "M, whose entry was deleted, took the permit beside N: {got:?}"
    );
    gn.release().await.expect("release");
    assert!(eventually(GENEROUS, || async { entries().await.is_empty() }).await);
    for c in [h, w1, n, m] {
        c.close().await.expect("close");
    }
}
