//! Redlock mode against independent masters (`DLOCK_TEST_REDLOCK=h:p,h:p,...`), plus a
//! fault test on five private redis-server processes this test starts and kills itself
//! (run when `DLOCK_TEST_REDLOCK` is set).

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use dlock_core::{decide, Backend, Decision, EntryKind, Error, Position};
use dlock_redis::RedisBackend;
use fred::prelude::KeysInterface;

const LONG: Duration = Duration::from_secs(30);

fn masters(var: &str) -> Vec<String> {
    var.split(',').map(|s| s.trim().to_owned()).collect()
}

async fn connect_redlock(addrs: &[String], lease: Duration) -> Arc<RedisBackend> {
    RedisBackend::connect_redlock(addrs, opts(lease))
        .await
        .expect("connect to the redlock masters")
}

#[tokio::test]
async fn redlock_fifo_and_clean_up_on_every_master() {
    init_tracing();
    let Some(list) = endpoint("DLOCK_TEST_REDLOCK", "redlock_fifo") else {
        return;
    };
    let addrs = masters(&list);
    let a = connect_redlock(&addrs, LONG).await;
    let b = connect_redlock(&addrs, LONG).await;
    assert_eq!(a.kind(), "redlock");
    let q = fresh_queue("redlock-fifo");
    let ea = a
        .enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"a",
        )
        .await
        .expect("a enqueues");
    assert_eq!(decide(&ea.queue, &ea.mine.name), Decision::Acquired);
    assert!(ea.mine.token.is_some());
    let eb = b
        .enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"b",
        )
        .await
        .expect("b enqueues");
    assert!(eb.mine.seq > ea.mine.seq, "b behind a");
    assert!(
        matches!(decide(&eb.queue, &eb.mine.name), Decision::Wait(e) if e.name == ea.mine.name)
    );
    // The same entry name exists on every master.
    for addr in &addrs {
        let insp = inspector(addr).await;
        let key = format!("dlock:{{{}}}:e:{}", q.lock, ea.mine.name);
        assert!(key_exists(&insp, &key).await, "a's entry on {addr}");
    }
    let waiter = spawn_wait_gone(&b, &q, &ea.mine);
    a.remove(&q, &ea.mine).await.expect("a releases");
    woken(waiter, Duration::from_secs(20), "b wakes").await;
    let now = b.queue(&q).await.expect("queue");
    assert_eq!(decide(&now, &eb.mine.name), Decision::Acquired);
    b.close().await.expect("close");
    a.close().await.expect("close");
    for addr in &addrs {
        let insp = inspector(addr).await;
        let left = scan_keys(
            &insp,
            &format!("dlock:{{{}}}*", glob_escape(q.lock.as_str())),
        )
        .await;
        assert!(left.is_empty(), "keys left on {addr}: {left:?}");
    }
}

#[tokio::test]
async fn redlock_concurrent_enqueues_agree_on_one_order() {
    init_tracing();
    let Some(list) = endpoint("DLOCK_TEST_REDLOCK", "redlock_concurrent_enqueues") else {
        return;
    };
    let addrs = masters(&list);
    let q = fresh_queue("redlock-race");
    let mut clients = Vec::new();
    for _ in 0..6 {
        clients.push(connect_redlock(&addrs, LONG).await);
    }
    let results = futures::future::join_all(clients.iter().map(|c| {
        let q = q.clone();
        async move { enqueue_lock(c, &q).await }
    }))
    .await;
    let mine: Vec<_> = results
        .into_iter()
        .map(|r| r.expect("every concurrent enqueue succeeds").mine)
        .collect();
    let mut seqs: Vec<u64> = mine.iter().map(|e| e.seq).collect();
    seqs.sort_unstable();
    seqs.dedup();
    assert_eq!(seqs.len(), 6, "distinct sequences: {seqs:?}");
    // Every client sees the same order, and exactly one entry holds.
    let first = clients[0].queue(&q).await.expect("queue");
    assert_eq!(first.len(), 6);
    for c in &clients[1..] {
        let view = c.queue(&q).await.expect("queue");
        assert_eq!(
            view.iter().map(|e| &e.name).collect::<Vec<_>>(),
            first.iter().map(|e| &e.name).collect::<Vec<_>>()
        );
    }
    let holders = mine
        .iter()
        .filter(|e| decide(&first, &e.name) == Decision::Acquired)
        .count();
    assert_eq!(holders, 1);
    for c in clients {
        c.close().await.expect("close");
    }
}

/// Regression (benchmark W5 on Redlock: `backend error: adding an entry`): eight clients
/// enqueue at the same moment, round after round, so that their sequence proposals
/// collide on the masters. Every enqueue must succeed, and every round must end with one
/// order all clients agree on.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn redlock_eight_contending_enqueuers_agree_every_round() {
    init_tracing();
    let Some(list) = endpoint("DLOCK_TEST_REDLOCK", "redlock_eight_contending_enqueuers") else {
        return;
    };
    let addrs = masters(&list);
    const CLIENTS: usize = 8;
    const ROUNDS: usize = 40;
    let q = fresh_queue("redlock-contend");
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        clients.push(connect_redlock(&addrs, LONG).await);
    }
    // Free-running first, as the benchmark's workers: enqueue and remove in a loop.
    let mut tasks = Vec::new();
    for c in &clients {
        let (c, q) = (c.clone(), q.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0..ROUNDS {
                let added = enqueue_lock(&c, &q)
                    .await
                    .map_err(|e| format!("enqueue {i}: {e}"))?;
                c.remove(&q, &added.mine)
                    .await
                    .map_err(|e| format!("remove {i}: {e}"))?;
            }
            Ok::<(), String>(())
        }));
    }
    for t in tasks {
        if let Err(e) = t.await.expect("join") {
            panic!("a free-running contender failed: {e}");
        }
    }
    // Then in lockstep rounds, checking the order every client sees.
    for round in 0..ROUNDS {
        let results = futures::future::join_all(clients.iter().map(|c| {
            let q = q.clone();
            async move { enqueue_lock(c, &q).await }
        }))
        .await;
        let mine: Vec<_> = results
            .into_iter()
            .map(|r| match r {
                Ok(e) => e.mine,
                Err(e) => panic!("round {round}: a contending enqueue failed: {e}"),
            })
            .collect();
        let mut seqs: Vec<u64> = mine.iter().map(|e| e.seq).collect();
        seqs.sort_unstable();
        seqs.dedup();
        assert_eq!(
            seqs.len(),
            CLIENTS,
            "round {round}: distinct sequences {seqs:?}"
        );
        let first = clients[0].queue(&q).await.expect("queue");
        assert_eq!(first.len(), CLIENTS, "round {round}: every entry listed");
        for c in &clients[1..] {
            let view = c.queue(&q).await.expect("queue");
            assert_eq!(
                view.iter().map(|e| &e.name).collect::<Vec<_>>(),
                first.iter().map(|e| &e.name).collect::<Vec<_>>(),
                "round {round}: one order for every client"
            );
        }
        let holders = mine
            .iter()
            .filter(|e| decide(&first, &e.name) == Decision::Acquired)
            .count();
        assert_eq!(holders, 1, "round {round}: exactly one holder");
        futures::future::join_all(clients.iter().zip(&mine).map(|(c, e)| {
            let q = q.clone();
            async move { c.remove(&q, e).await.expect("remove") }
        }))
        .await;
    }
    for c in clients {
        c.close().await.expect("close");
    }
    // Nothing is left behind by the refused proposals on any master.
    for addr in &addrs {
        let insp = inspector(addr).await;
        let left = scan_keys(
            &insp,
            &format!("dlock:{{{}}}*", glob_escape(q.lock.as_str())),
        )
        .await;
        assert!(left.is_empty(), "keys left on {addr}: {left:?}");
    }
}

#[tokio::test]
async fn redlock_works_with_two_masters_down_and_fails_typed_with_three() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDLOCK", "redlock_two_down_three_down").is_none() {
        return;
    }
    let mut servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let addrs: Vec<String> = servers.iter().map(TestServer::addr).collect();
    let a = connect_redlock(&addrs, Duration::from_secs(3)).await;
    let b = connect_redlock(&addrs, Duration::from_secs(3)).await;
    let q = fresh_queue("redlock-faults");
    let ea = enqueue_lock(&a, &q)
        .await
        .expect("a enqueues with all masters up");
    servers[0].kill();
    servers[1].kill();
    let eb = tokio::time::timeout(Duration::from_secs(30), enqueue_lock(&b, &q))
        .await
        .expect("no hang")
        .expect("b enqueues with 3 of 5 masters");
    assert!(
        matches!(decide(&eb.queue, &eb.mine.name), Decision::Wait(e) if e.name == ea.mine.name)
    );
    // a still holds: its watchdog keeps a majority renewed past the 3 s lease.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let view = b.queue(&q).await.expect("queue with 3 masters");
    assert_eq!(decide(&view, &ea.mine.name), Decision::Acquired);
    a.remove(&q, &ea.mine)
        .await
        .expect("a releases with 3 masters");
    tokio::time::timeout(Duration::from_secs(30), b.wait_gone(&q, &ea.mine))
        .await
        .expect("no hang")
        .expect("wait_gone");
    let view = b.queue(&q).await.expect("queue");
    assert_eq!(decide(&view, &eb.mine.name), Decision::Acquired);
    let lost = b.lost(&q, &eb.mine);

    servers[2].kill();
    let err = tokio::time::timeout(Duration::from_secs(60), enqueue_lock(&a, &q))
        .await
        .expect("enqueue with 2 of 5 masters returns instead of hanging")
        .expect_err("no majority");
    eprintln!("redlock with 3 of 5 down: enqueue said: {err}");
    assert!(matches!(err, Error::Unreachable(_)), "{err:?}");
    let err = tokio::time::timeout(Duration::from_secs(60), a.queue(&q))
        .await
        .expect("no hang")
        .expect_err("no majority to list");
    assert!(matches!(err, Error::Unreachable(_)), "{err:?}");
    // b's held entry can no longer be renewed on a majority: lost() fires.
    let reason = tokio::time::timeout(Duration::from_secs(60), lost)
        .await
        .expect("lost() fires without a majority");
    eprintln!("redlock with 3 of 5 down: lost() said: {reason}");
    assert!(matches!(reason, Error::LockLost(_)), "{reason:?}");
    let _ = tokio::time::timeout(Duration::from_secs(30), a.close()).await;
    let _ = tokio::time::timeout(Duration::from_secs(30), b.close()).await;
}

#[tokio::test]
async fn redlock_connects_with_a_master_down_and_uses_it_once_it_is_back() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDLOCK", "redlock_master_down_at_connect").is_none() {
        return;
    }
    let mut servers: Vec<TestServer> = (0..3).map(|_| TestServer::start()).collect();
    let addrs: Vec<String> = servers.iter().map(TestServer::addr).collect();
    servers[2].kill();
    let b = tokio::time::timeout(
        Duration::from_secs(30),
        RedisBackend::connect_redlock(
            &addrs,
            opts(LONG).with_connect_timeout(Duration::from_secs(2)),
        ),
    )
    .await
    .expect("no hang")
    .expect("2 of 3 masters are a majority");
    servers[2].restart();
    let insp = inspector(&addrs[2]).await;
    let q = fresh_queue("redlock-late-master");
    // Once the late master is connected, new entries land on it too.
    assert!(
        eventually(Duration::from_secs(20), || async {
            let e = enqueue_lock(&b, &q)
                .await
                .expect("enqueue with a majority")
                .mine;
            let key = format!("dlock:{{{}}}:e:{}", q.lock, e.name);
            let there = key_exists(&insp, &key).await;
            b.remove(&q, &e).await.expect("remove");
            there
        })
        .await,
        "the master that was down at connect time is used once it is back"
    );
    b.close().await.expect("close");
}

/// Each master mints its own token for an entry (its counter, floored at its clock), and
/// the enqueue reports the highest. A read that the master holding that highest token
/// does not answer in time shows a lower one for the same entry. `contains` (what
/// `LockGuard::verify` asks) must still find the entry: it once compared tokens on
/// Redlock too and reported a live hold as lost (a `dlock exec` exited 70 under CI).
#[tokio::test]
async fn redlock_contains_an_entry_whatever_token_a_read_shows() {
    init_tracing();
    if endpoint("DLOCK_TEST_REDLOCK", "redlock_contains_token_view").is_none() {
        return;
    }
    let servers: Vec<TestServer> = (0..5).map(|_| TestServer::start()).collect();
    let addrs: Vec<String> = servers.iter().map(TestServer::addr).collect();
    let a = connect_redlock(&addrs, Duration::from_secs(10)).await;
    // Masters that ran the script in the same microsecond mint the same token; the test
    // needs one master alone at the top, so it queues again until it has one.
    let mut found_case = None;
    for round in 0..10 {
        let q = fresh_queue("redlock-token-view");
        let e = enqueue_lock(&a, &q)
            .await
            .expect("enqueue with every master up");
        let token = e.mine.token.expect("a token").get();
        // Each master's own token for the entry: the first word of the entry's value.
        let mut minted = Vec::new();
        for s in &servers {
            let c = inspector(&s.addr()).await;
            let keys = scan_keys(&c, &format!("*:e:{}", glob_escape(&e.mine.name))).await;
            assert_eq!(keys.len(), 1, "the entry on {}: {keys:?}", s.addr());
            let v: String = c.get(&keys[0]).await.expect("entry value");
            let t: u64 = v
                .split(' ')
                .next()
                .and_then(|w| w.parse().ok())
                .expect("token word");
            minted.push(t);
        }
        assert_eq!(
            minted.iter().max(),
            Some(&token),
            "the enqueue reports the highest token"
        );
        if minted.iter().filter(|&&t| t == token).count() == 1 {
            found_case = Some((q, e, token, minted));
            break;
        }
        eprintln!("round {round}: the highest token was minted twice; again");
        a.remove(&q, &e.mine).await.expect("remove");
    }
    let (q, e, token, minted) = found_case.expect("one master alone at the top in 10 rounds");
    let top = minted
        .iter()
        .position(|&t| t == token)
        .expect("the top master");
    servers[top].signal("STOP");
    let view = a.queue(&q).await;
    let found = a.contains(&q, &e.mine).await;
    servers[top].signal("CONT");
    let shown = view
        .expect("queue with 4 of 5 masters")
        .iter()
        .find(|x| x.name == e.mine.name)
        .and_then(|x| x.token)
        .map(|t| t.get());
    assert!(
        shown.is_some_and(|t| t < token),
        "without its top master a read shows a lower token: {shown:?} vs {token}"
    );
    assert!(
        found.expect("contains"),
        "the held entry must be found whatever token a read shows"
    );
    a.remove(&q, &e.mine).await.expect("remove");
    assert!(
        !a.contains(&q, &e.mine).await.expect("contains"),
        "a removed entry must not be found"
    );
    let _ = tokio::time::timeout(LONG, a.close()).await;
}
