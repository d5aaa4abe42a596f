//! Curator's own lock-test scenarios that the shared suite does not cover, on ZooKeeper:
//! container parents reaped after use (`testContainerCleanup`), no orphaned semaphore
//! nodes after an interrupted acquire (`testInterruptAcquire`, CURATOR-462) or after a
//! waiter's lease node is deleted under it (`testNoOrphanedNodes`).

use std::sync::Arc;
use std::time::Duration;

use dlock::{DynBackend, Error, SessionOptions};
use dlock_zookeeper::ZkBackend;
use zookeeper_client as zk;

use crate::support::{eventually, leftovers, unique, zk_hosts, SESSION_TIMEOUT};

const GENEROUS: Duration = Duration::from_secs(60);

/// A dlock client on its own ZooKeeper session, plus the raw ZooKeeper handle of that
/// session for looking at the tree.
pub async fn zk_client(
    url: &str,
    session: Duration,
) -> (dlock::Client, Arc<ZkBackend>, zk::Client) {
    let b = ZkBackend::connect(
        zk_hosts(url),
        SessionOptions::default().with_session_timeout(session),
    )
    .await
    .unwrap_or_else(|e| panic!("connect {url}: {e}"));
    let raw = b.client().expect("session open");
    (dlock::Client::new(b.clone() as Arc<dyn DynBackend>), b, raw)
}

async fn exists(raw: &zk::Client, path: &str) -> bool {
    raw.check_stat(path).await.expect("exists").is_some()
}

/// Lease and internal-lock entries of semaphore `name`: `(leases, locks)`.
async fn sem_counts(c: &dlock::Client, name: &str) -> (usize, usize) {
    let parts = c.participants(name).await.expect("participants");
    let count = |q: &str| parts.iter().filter(|p| p.queue == q).count();
    (count("leases"), count("locks"))
}

/// Ten tasks lock and unlock a mutex; a semaphore and a read/write lock are used once.
/// Afterwards ZooKeeper's container manager (1 s interval in the test servers) removes
/// every parent dlock created, level by level, up to the lock's top node: dlock creates
/// parents as CONTAINER nodes, as Curator does.
pub async fn container_parents_are_reaped(url: &str) {
    let top = unique("containers");
    let (c, _b, raw) = zk_client(url, SESSION_TIMEOUT).await;
    let m = format!("{top}/m");
    let mut tasks = Vec::new();
    for _ in 0..10 {
        let mutex = c.mutex(&m).expect("name");
        tasks.push(tokio::spawn(async move {
            for _ in 0..3 {
                let mut g = mutex.lock_timeout(GENEROUS).await.expect("lock");
                g.release().await.expect("release");
            }
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    let mut p = c
        .semaphore(&format!("{top}/s"), 2)
        .expect("name")
        .acquire_timeout(GENEROUS)
        .await
        .expect("permit");
    assert!(exists(&raw, &format!("/{top}/s/leases")).await);
    p.release().await.expect("release");
    let rw = c.rwlock(&format!("{top}/rw")).expect("name");
    let mut r = rw.read_timeout(GENEROUS).await.expect("read");
    r.release().await.expect("release");
    let mut w = rw.write_timeout(GENEROUS).await.expect("write");
    w.release().await.expect("release");
    let top_path = format!("/{top}");
    assert!(
        eventually(GENEROUS, || async { !exists(&raw, &top_path).await }).await,
        "the lock's parents were never reaped: is ZooKeeper running with \
         -Dznode.container.checkIntervalMs=1000 and are they containers?"
    );
    // The raw handle shares the session; close waits for the last handle to go.
    drop(raw);
    c.close().await.expect("close");
}

/// A semaphore of one permit is held; one waiter holds the internal lock (it adds its
/// lease only once a permit is free, so it has none yet), a second waits on the internal
/// lock. Both acquires are dropped (task aborted): their lock nodes go, the holder's
/// lease stays, and the semaphore keeps working.
pub async fn semaphore_interrupted_acquire_leaves_no_orphans(url: &str) {
    let name = unique("sem-interrupt");
    let (c, _b, _) = zk_client(url, SESSION_TIMEOUT).await;
    let sem = c.semaphore(&name, 1).expect("name");
    let mut held = sem.acquire_timeout(GENEROUS).await.expect("permit");
    let (s1, s2) = (
        c.semaphore(&name, 1).expect("name"),
        c.semaphore(&name, 1).expect("name"),
    );
    let w1 = tokio::spawn(async move { s1.acquire().await });
    assert!(
        eventually(GENEROUS, || async { sem_counts(&c, &name).await == (1, 1) }).await,
        "first waiter never took the internal lock: {:?}",
        sem_counts(&c, &name).await
    );
    let w2 = tokio::spawn(async move { s2.acquire().await });
    assert!(
        eventually(GENEROUS, || async { sem_counts(&c, &name).await == (1, 2) }).await,
        "second waiter never queued on the internal lock: {:?}",
        sem_counts(&c, &name).await
    );
    w2.abort();
    w1.abort();
    assert!(w1.await.is_err_and(|e| e.is_cancelled()));
    assert!(w2.await.is_err_and(|e| e.is_cancelled()));
    assert!(
        eventually(GENEROUS, || async { sem_counts(&c, &name).await == (1, 0) }).await,
        "interrupted acquires left nodes: {:?}",
        sem_counts(&c, &name).await
    );
    held.release().await.expect("release");
    let mut again = sem.try_acquire().await.expect("the semaphore still works");
    again.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "entries left"
    );
    c.close().await.expect("close");
}

/// A waiter's internal-lock node is deleted by someone else while it waits for a
/// permit. The waiter adds its lease and removes that node in one ZooKeeper `multi`, so
/// once the permit frees up the multi fails as a whole: dlock reports a typed error
/// ([`Error::LockLost`]) instead of taking a permit without holding the internal lock,
/// and leaves nothing behind: no internal-lock node, no lease.
pub async fn semaphore_deleted_internal_lock_is_a_typed_error(url: &str) {
    let name = unique("sem-deleted");
    let (c, _b, raw) = zk_client(url, SESSION_TIMEOUT).await;
    let sem = c.semaphore(&name, 1).expect("name");
    let mut held = sem.acquire_timeout(GENEROUS).await.expect("permit");
    let s1 = c.semaphore(&name, 1).expect("name");
    let waiter = tokio::spawn(async move { s1.acquire_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { sem_counts(&c, &name).await == (1, 1) }).await,
        "the waiter never took the internal lock"
    );
    let victim = c
        .participants(&name)
        .await
        .expect("participants")
        .into_iter()
        .find(|p| p.queue == "locks")
        .expect("the waiter's internal-lock entry");
    raw.delete(&format!("/{name}/locks/{}", victim.entry.name), None)
        .await
        .expect("delete the waiter's internal-lock entry");
    held.release().await.expect("release");
    match waiter.await.expect("task") {
        Err(Error::LockLost(_)) => {}
        other => panic!("expected LockLost for a deleted internal-lock entry, got {other:?}"),
    }
    assert!(
        eventually(GENEROUS, || async { sem_counts(&c, &name).await == (0, 0) }).await,
        "orphaned nodes: {:?}",
        sem_counts(&c, &name).await
    );
    let mut again = sem.acquire_timeout(GENEROUS).await.expect("still works");
    again.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "entries left"
    );
    drop(raw);
    c.close().await.expect("close");
}

/// A lease added by someone who does not hold the internal mutex is still counted. Curator
/// lets that happen: an `InterProcessSemaphoreV2` contender whose session expires (a GC
/// pause) right after it took the internal mutex goes on to create its lease on a new
/// session without taking the mutex again, and stays safe itself because it counts the
/// leases after adding its own. dlock's contender on ZooKeeper lists the leases first and
/// adds its own only once a permit is free (one `multi` with the mutex node's removal).
/// Before, it took the outsider's arrival for a departure (any change of the lease set
/// woke it, and it assumed one had gone) and took a permit while every permit was held.
/// Now it counts the leases ahead of its own after adding it, and gives the lease back
/// and queues again when more than the permits are out.
pub async fn semaphore_lease_added_outside_the_mutex_is_counted(url: &str) {
    let name = unique("sem-outside");
    let (a, _ab, raw) = zk_client(url, SESSION_TIMEOUT).await;
    let (d, _db, _) = zk_client(url, SESSION_TIMEOUT).await;
    let mut held = a
        .semaphore(&name, 1)
        .expect("name")
        .acquire_timeout(GENEROUS)
        .await
        .expect("permit");
    let ds = d.semaphore(&name, 1).expect("name");
    let waiter = tokio::spawn(async move { ds.acquire_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { sem_counts(&a, &name).await == (1, 1) }).await,
        "the waiter never took the internal mutex: {:?}",
        sem_counts(&a, &name).await
    );
    // The lease a Curator contender creates (protected, ephemeral-sequential), here
    // without the internal mutex.
    let prefix = format!("/{name}/leases/_c_00000000-0000-4000-8000-000000000000-lease-");
    let opts = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
    let (_, seq) = raw
        .create(&prefix, b"outsider", &opts)
        .await
        .expect("create the outsider's lease");
    let outsider = format!("{prefix}{seq}");
    // Two leases are out of one permit: the waiter must not get one. (Before, it did
    // within one notification's round trip.)
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(
        !waiter.is_finished(),
        "a permit was granted while both leases of a one-permit semaphore were held: {:?}",
        waiter.await
    );
    // Both hand their permits back: the waiter gets one.
    raw.delete(&outsider, None)
        .await
        .expect("delete the outsider's lease");
    held.release().await.expect("release");
    let mut got = waiter
        .await
        .expect("waiter task")
        .expect("the waiter gets the permit once both are back");
    assert_eq!(sem_counts(&a, &name).await.0, 1, "one lease out");
    got.release().await.expect("release");
    drop(raw);
    a.close().await.expect("close");
    d.close().await.expect("close");
}
