//! Redis Cluster only: what the shared suite cannot say about a sharded server. A
//! multi-lock whose names hash to slots on different masters.

use std::time::{Duration, Instant};

use dlock::Error;
use dlock_testkit::{redis_query, Backend as Server, State};

use crate::support::{client, unique};

/// The queue key of lock `name` (no `?prefix=`): its slot is the lock's.
fn queue_key(name: &str) -> String {
    format!("dlock:{{{name}}}:q")
}

/// Three fresh lock names whose slots are served by three different masters, in name
/// order (the multi-lock's global order), with each one's master address.
fn names_on_three_masters(state: &State) -> Vec<(String, String)> {
    let mut picked: Vec<(String, u32)> = Vec::new();
    for _ in 0..10_000 {
        let n = unique("mcluster");
        let m = state
            .redis_cluster_master_of(&queue_key(&n))
            .expect("master of the slot");
        if picked.iter().all(|(_, pm)| *pm != m) {
            picked.push((n, m));
            if picked.len() == 3 {
                break;
            }
        }
    }
    assert_eq!(picked.len(), 3, "three names on three masters");
    picked.sort();
    picked
        .into_iter()
        .map(|(n, m)| {
            let addr = state
                .server(Server::RedisCluster, m)
                .expect("cluster node")
                .addr
                .clone();
            (n, addr)
        })
        .collect()
}

/// A multi-lock over three names in three slots on three masters: each part is queued on
/// its own slot's master (no slot is shared), the parts are taken all-or-nothing (one part
/// held elsewhere: nothing is left taken after the timeout), under one deadline (a part
/// freed part way does not restart the clock for the next), and two clients that list the
/// names in opposite orders never deadlock (the global order by name).
pub async fn multilock_spans_masters(url: &str) {
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    let parts = names_on_three_masters(&state);
    let names: Vec<String> = parts.iter().map(|(n, _)| n.clone()).collect();
    let (a, b) = (client(url).await, client(url).await);
    let multi = |c: &dlock::Client, order: &[usize]| {
        order
            .iter()
            .fold(c.multi(), |m, &i| m.mutex(&names[i]).expect("valid name"))
    };

    // Held: every part on its own master (each the lock's only entry, so the lock's one
    // key: the queue's, a string on the fast path, a sorted set once a second arrives).
    let mut g = multi(&a, &[2, 0, 1])
        .acquire_timeout(Duration::from_secs(30))
        .await
        .expect("multi-lock over three masters");
    assert_eq!(g.tokens().len(), 3);
    for (n, addr) in &parts {
        assert_eq!(
            redis_query(addr, &["EXISTS", &queue_key(n)], Duration::from_secs(2)).as_deref(),
            Some("1"),
            "{n}'s entry is on the master of its slot, {addr}"
        );
    }
    g.release().await.expect("release");

    // All or nothing: the middle part held elsewhere; the first (taken before it, in
    // name order) is given back after the timeout, the last was never taken.
    let mut middle = b.mutex(&names[1]).expect("n").lock().await.expect("hold");
    let r = multi(&a, &[1, 2, 0])
        .acquire_timeout(Duration::from_millis(800))
        .await;
    assert!(matches!(r, Err(Error::Timeout(_))), "{:?}", r.map(|_| ()));
    for i in [0, 2] {
        let mut free = b
            .mutex(&names[i])
            .expect("n")
            .try_lock()
            .await
            .unwrap_or_else(|e| panic!("{} left taken: {e}", names[i]));
        free.release().await.expect("release");
    }
    middle.release().await.expect("release");

    // One deadline: the first part held for most of it, the second for all of it. With a
    // timeout per part (Curator) the acquire would end one whole timeout after the first
    // part was freed; here it ends at the deadline.
    let timeout = Duration::from_secs(3);
    let first = b.mutex(&names[0]).expect("n").lock().await.expect("hold");
    let mut second = b.mutex(&names[1]).expect("n").lock().await.expect("hold");
    let release_first = tokio::spawn(async move {
        let mut first = first;
        tokio::time::sleep(Duration::from_millis(2500)).await;
        first.release().await.expect("release");
    });
    let started = Instant::now();
    let r = multi(&a, &[0, 1, 2]).acquire_timeout(timeout).await;
    let took = started.elapsed();
    assert!(matches!(r, Err(Error::Timeout(_))), "{:?}", r.map(|_| ()));
    assert!(
        took < timeout + Duration::from_millis(1500),
        "one deadline for every part: gave up after {took:?}, a timeout per part would be about 5.5 s"
    );
    release_first.await.expect("release task");
    second.release().await.expect("release");

    // Global order: opposite caller orders, no deadlock, every round all three.
    let mut tasks = Vec::new();
    for (c, order) in [(a, [0usize, 1, 2]), (b, [2, 1, 0])] {
        let m = multi(&c, &order);
        tasks.push(tokio::spawn(async move {
            for _ in 0..5 {
                let mut g = m
                    .acquire_timeout(Duration::from_secs(60))
                    .await
                    .expect("multi");
                assert_eq!(g.tokens().len(), 3);
                g.release().await.expect("release");
            }
            c
        }));
    }
    for t in tasks {
        tokio::time::timeout(Duration::from_secs(120), t)
            .await
            .expect("no deadlock")
            .expect("task")
            .close()
            .await
            .expect("close");
    }
}
