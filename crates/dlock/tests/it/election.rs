//! Leader election (`Client::election`), written once and run on every backend and on
//! `mem` by `all_backends!`.

use std::sync::Arc;
use std::time::Duration;

use dlock::{Capability, Error, Leader};
use futures::{FutureExt, StreamExt};

use crate::support::{client, eventually, leftovers, unique, Kind, Occupancy};

const GENEROUS: Duration = Duration::from_secs(30);

/// Waits until `name` has `n` entries: a campaign that must be queued before the next
/// one starts is, without guessing how long its enqueue takes.
pub(crate) async fn queued(c: &dlock::Client, name: &str, n: usize) {
    assert!(
        eventually(GENEROUS, || async { leftovers(c, name).await == n }).await,
        "expected {n} candidates of {name}, found {}",
        leftovers(c, name).await
    );
}

/// Four sessions campaign again and again: never two leaders at once, and every term
/// larger than the one before (except on Redlock, whose tokens are not ordered).
pub async fn one_leader_at_a_time_and_terms_grow(kind: Kind, url: &str) {
    let name = unique("elect-excl");
    let occ = Arc::new(Occupancy::default());
    let terms = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut tasks = Vec::new();
    for i in 0..4 {
        let c = client(url).await;
        let (name, occ, terms) = (name.clone(), occ.clone(), terms.clone());
        tasks.push(tokio::spawn(async move {
            let e = c.election(&name).expect("name");
            for round in 0..5 {
                let value = format!("candidate-{i}-{round}");
                let l = e
                    .campaign_timeout(&value, GENEROUS)
                    .await
                    .expect("campaign");
                occ.enter();
                terms.lock().expect("poisoned").push(l.term().get());
                assert_eq!(l.value(), value.as_bytes());
                tokio::time::sleep(Duration::from_millis(5)).await;
                occ.leave();
                l.resign().await.expect("resign");
            }
            c.close().await.expect("close");
        }));
    }
    for t in tasks {
        t.await.expect("task");
    }
    assert_eq!(occ.peak(), 1, "two leaders at once");
    let seen = std::mem::take(&mut *terms.lock().expect("poisoned"));
    assert_eq!(seen.len(), 20);
    assert!(
        matches!(kind, Kind::Redlock) || seen.windows(2).all(|w| w[0] < w[1]),
        "terms must strictly increase from leader to leader: {seen:?}"
    );
}

/// A leader's resignation hands the lead to the candidates in the order they
/// campaigned.
pub async fn resign_hands_over_in_fifo_order(_kind: Kind, url: &str) {
    let name = unique("elect-fifo");
    let a = client(url).await;
    let first = a
        .election(&name)
        .expect("name")
        .campaign("a")
        .await
        .expect("campaign");
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    let mut clients = Vec::new();
    let mut tasks = Vec::new();
    for (n, label) in ["b", "c", "d"].into_iter().enumerate() {
        let c = client(url).await;
        let e = c.election(&name).expect("name");
        let tx = tx.clone();
        tasks.push(tokio::spawn(async move {
            let l = e.campaign_timeout(label, GENEROUS).await.expect("campaign");
            tx.send(label).expect("send");
            l.resign().await.expect("resign");
        }));
        queued(&a, &name, n + 2).await;
        clients.push(c);
    }
    assert!(rx.try_recv().is_err(), "a candidate led beside the leader");
    first.resign().await.expect("resign");
    let mut order = Vec::new();
    for _ in 0..3 {
        let label = tokio::time::timeout(GENEROUS, rx.recv())
            .await
            .expect("handover in time")
            .expect("label");
        order.push(label);
    }
    assert_eq!(order, ["b", "c", "d"], "leadership must pass in FIFO order");
    for t in tasks {
        t.await.expect("task");
    }
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "entries left after every resignation"
    );
    for c in clients {
        c.close().await.expect("close");
    }
    a.close().await.expect("close");
}

/// Against a led election: `try_campaign` is `WouldBlock`, a timed-out or dropped
/// campaign withdraws its candidacy, and nothing is left behind.
pub async fn cancelled_campaigns_leave_nothing(_kind: Kind, url: &str) {
    let name = unique("elect-cancel");
    let holder = client(url).await;
    let other = client(url).await;
    let leader = holder
        .election(&name)
        .expect("name")
        .campaign("leader")
        .await
        .expect("campaign");
    let e = other.election(&name).expect("name");
    assert!(
        matches!(e.try_campaign("x").await, Err(Error::WouldBlock)),
        "try_campaign on a led election"
    );
    assert!(matches!(
        e.campaign_timeout("x", Duration::ZERO).await,
        Err(Error::Timeout(d)) if d.is_zero()
    ));
    match e.campaign_timeout("x", Duration::from_millis(200)).await {
        Err(Error::Timeout(d)) => assert_eq!(d, Duration::from_millis(200)),
        other => panic!("expected Timeout, got {other:?}"),
    }
    assert_eq!(
        leftovers(&holder, &name).await,
        1,
        "only the leader remains"
    );
    for i in 0..60u64 {
        if i % 2 == 0 {
            let r = e.campaign_timeout("x", Duration::from_millis(i % 7)).await;
            assert!(matches!(r, Err(Error::Timeout(_))), "attempt {i}: {r:?}");
        } else {
            let mut fut = Box::pin(e.campaign("x"));
            for _ in 0..(i % 5) {
                if (&mut fut).now_or_never().is_some() {
                    panic!("won a led election");
                }
                tokio::task::yield_now().await;
            }
            drop(fut);
        }
    }
    leader.resign().await.expect("resign");
    assert!(
        eventually(GENEROUS, || async { leftovers(&holder, &name).await == 0 }).await,
        "cancelled campaigns left {} entries",
        leftovers(&holder, &name).await
    );
    holder.close().await.expect("close");
    other.close().await.expect("close");
}

/// `leader()` names the leader's value and term as the leader itself sees them, and
/// nobody once it resigned; `verify()` confirms a live leadership.
pub async fn leader_names_the_value_and_term(_kind: Kind, url: &str) {
    let name = unique("elect-leader");
    let a = client(url).await;
    let b = client(url).await;
    let eb = b.election(&name).expect("name");
    assert_eq!(eb.leader().await.expect("leader"), None, "nobody campaigns");
    let l = a
        .election(&name)
        .expect("name")
        .campaign("alpha")
        .await
        .expect("campaign");
    l.verify().await.expect("verify a live leadership");
    let seen = eb.leader().await.expect("leader").expect("a leader");
    assert_eq!(seen.value_str(), Some("alpha"));
    assert_eq!(seen.term, l.term());
    assert_eq!(seen.entry, l.entry().name);
    l.resign().await.expect("resign");
    assert_eq!(eb.leader().await.expect("leader"), None, "resigned");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// Whether `kind` has `Capability::Proclaim`.
fn proclaims_on(kind: Kind) -> bool {
    !matches!(kind, Kind::Redlock)
}

/// The next item of an observer, in time.
async fn next_leader(
    s: &mut futures::stream::BoxStream<'static, dlock::Result<Option<Leader>>>,
) -> Option<Leader> {
    tokio::time::timeout(GENEROUS, s.next())
        .await
        .expect("a change in time")
        .expect("the stream goes on")
        .expect("no error")
}

/// `observe()` yields the current leader first, then every change in order: nobody, A,
/// B after A resigns (B's value, proclaimed anew where the backend can), nobody. Where
/// `proclaim` is unsupported it fails at the call and changes nothing.
pub async fn observe_sees_every_change_in_order(kind: Kind, url: &str) {
    let name = unique("elect-observe");
    let watcher = client(url).await;
    let a = client(url).await;
    let b = client(url).await;
    let mut stream = watcher.election(&name).expect("name").observe();
    assert_eq!(next_leader(&mut stream).await, None, "nobody leads yet");

    let la = a
        .election(&name)
        .expect("name")
        .campaign("A")
        .await
        .expect("campaign");
    let seen = next_leader(&mut stream).await.expect("A leads");
    assert_eq!((seen.value_str(), seen.term), (Some("A"), la.term()));

    let eb = b.election(&name).expect("name");
    let campaign_b = tokio::spawn(async move { eb.campaign("B").await });
    queued(&watcher, &name, 2).await;
    let term_a = la.term();
    la.resign().await.expect("resign");
    let seen = next_leader(&mut stream).await.expect("B leads");
    assert_eq!(seen.value_str(), Some("B"), "B after A: {seen:?}");
    let lb = campaign_b.await.expect("task").expect("campaign");
    assert_eq!(seen.term, lb.term());
    assert!(
        matches!(kind, Kind::Redlock) || lb.term() > term_a,
        "the next leader's term is larger"
    );

    // Proclaim is there on ZooKeeper (the node's data), etcd (Go's guarded put), one
    // Redis master (alone, Sentinel's primary, a Cluster slot's master: one guarded
    // script) and mem; not on Redlock.
    let proclaims = b.backend().supports(Capability::Proclaim);
    assert_eq!(proclaims, proclaims_on(kind), "{kind:?}");
    if proclaims {
        lb.proclaim("B2").await.expect("proclaim");
        assert_eq!(lb.value(), b"B2");
        let seen = next_leader(&mut stream).await.expect("B still leads");
        assert_eq!((seen.value_str(), seen.term), (Some("B2"), lb.term()));
        let read = watcher.election(&name).expect("name").leader().await;
        assert_eq!(
            read.expect("leader").expect("a leader").value_str(),
            Some("B2")
        );
    } else {
        let e = lb
            .proclaim("B2")
            .await
            .expect_err("proclaim needs payloads");
        assert!(
            matches!(
                e,
                Error::Unsupported {
                    capability: Capability::Proclaim,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(lb.value(), b"B");
        let read = watcher.election(&name).expect("name").leader().await;
        assert_eq!(
            read.expect("leader").expect("a leader").value_str(),
            Some("B")
        );
    }

    lb.resign().await.expect("resign");
    assert_eq!(next_leader(&mut stream).await, None, "nobody leads after B");
    drop(stream);
    for c in [watcher, a, b] {
        c.close().await.expect("close");
    }
}

/// A leader whose session ends (its client closed) sees `lost()` fire, and already has
/// when the next candidate leads; `verify()` then fails with `LockLost`.
pub async fn lost_leadership_fires_before_the_next_leads(_kind: Kind, url: &str) {
    let name = unique("elect-lost");
    let a = client(url).await;
    let b = client(url).await;
    let la = a
        .election(&name)
        .expect("name")
        .campaign("a")
        .await
        .expect("campaign");
    let la = Arc::new(la);
    let eb = b.election(&name).expect("name");
    let watched = la.clone();
    let next = tokio::spawn(async move {
        let lb = eb.campaign_timeout("b", GENEROUS).await.expect("campaign");
        // The old leader must know it lost before the new one acts.
        assert!(watched.is_lost(), "B leads while A's lost() has not fired");
        lb
    });
    queued(&b, &name, 2).await;
    let lost = la.lost();
    assert!(!la.is_lost());
    a.close().await.expect("close");
    let e = tokio::time::timeout(GENEROUS, lost)
        .await
        .expect("lost fired");
    assert!(matches!(e, Error::LockLost(_)), "{e:?}");
    let lb = next.await.expect("task");
    assert!(matches!(la.verify().await, Err(Error::LockLost(_))));
    let seen = b.election(&name).expect("name").leader().await;
    assert_eq!(
        seen.expect("leader").expect("a leader").value_str(),
        Some("b")
    );
    lb.resign().await.expect("resign");
    b.close().await.expect("close");
}

/// A leader deposed from outside (its entry removed, so the next candidate leads) cannot
/// proclaim: the server-side guard refuses the write with `LockLost` and writes nothing
/// (etcd: the create-revision compare; Redis: the script's entry and head checks), the
/// new leader's value stands, and an observer goes from the old leader to the new one
/// and then to the new leader's proclaimed value, never to the stale one. On Redis a
/// queued entry that does not lead is refused too. Redlock refuses proclaim as
/// unsupported, before writing anything.
pub async fn deposed_leader_cannot_proclaim(kind: Kind, url: &str) {
    let name = unique("elect-deposed");
    let watcher = client(url).await;
    let a = client(url).await;
    let b = client(url).await;
    let ea = a.election(&name).expect("name");
    let q = dlock_core::QueuePath::root(ea.name().clone());
    let mut stream = watcher.election(&name).expect("name").observe();
    assert_eq!(next_leader(&mut stream).await, None, "nobody leads yet");
    let la = ea.campaign("a").await.expect("campaign");
    let seen = next_leader(&mut stream).await.expect("A leads");
    assert_eq!(seen.value_str(), Some("a"));
    let eb = b.election(&name).expect("name");
    let campaign_b = tokio::spawn(async move { eb.campaign("b").await });
    queued(&watcher, &name, 2).await;

    // Deposed: A's entry removed by someone else (an operator), so B leads while A's
    // client may not know yet.
    watcher
        .backend()
        .remove(&q, la.entry())
        .await
        .expect("remove A's entry from outside");
    let lb = tokio::time::timeout(GENEROUS, campaign_b)
        .await
        .expect("B leads in time")
        .expect("task")
        .expect("campaign");
    let seen = next_leader(&mut stream).await.expect("B leads");
    assert_eq!((seen.value_str(), seen.term), (Some("b"), lb.term()));

    let unsupported = |e: &Error| {
        matches!(
            e,
            Error::Unsupported {
                capability: Capability::Proclaim,
                ..
            }
        )
    };
    // The server's own guard, whatever A's client knows: straight to the backend.
    let guarded = matches!(
        kind,
        Kind::Etcd | Kind::Redis | Kind::RedisSentinel | Kind::RedisCluster | Kind::Redlock
    );
    if guarded {
        let e = a
            .backend()
            .proclaim(&q, la.entry(), b"stale")
            .await
            .expect_err("a deposed leader's proclaim is refused");
        assert!(
            matches!(e, Error::LockLost(_)) || (kind == Kind::Redlock && unsupported(&e)),
            "{kind:?}: {e:?}"
        );
    }
    let e = la
        .proclaim("stale")
        .await
        .expect_err("a deposed leader cannot proclaim");
    assert!(
        matches!(e, Error::LockLost(_)) || (kind == Kind::Redlock && unsupported(&e)),
        "{kind:?}: {e:?}"
    );
    assert_eq!(
        la.value(),
        b"a",
        "a refused proclaim changes nothing locally"
    );
    let read = watcher.election(&name).expect("name").leader().await;
    let read = read.expect("leader").expect("a leader");
    assert_eq!((read.value_str(), read.term), (Some("b"), lb.term()));
    let left = watcher.participants(&name).await.expect("participants");
    assert_eq!(left.len(), 1, "only B's entry: {left:?}");
    #[cfg(feature = "redis")]
    if kind == Kind::Redis {
        // Nothing written under A's gone entry either (a value set without its lease
        // would stay forever).
        let key = format!("dlock:{{{name}}}:e:{}", la.entry().name);
        assert_eq!(
            crate::redis_faults::redis_cli(url, &["EXISTS", &key]).trim(),
            "0",
            "{key} was written"
        );
    }

    if proclaims_on(kind) {
        lb.proclaim("b2").await.expect("proclaim");
        let seen = next_leader(&mut stream).await.expect("B still leads");
        assert_eq!((seen.value_str(), seen.term), (Some("b2"), lb.term()));
    }

    if matches!(kind, Kind::Redis | Kind::RedisSentinel | Kind::RedisCluster) {
        // Queued but not leading: refused, and its value stays as enqueued.
        let c = client(url).await;
        let ec = c.election(&name).expect("name");
        let behind = tokio::spawn(async move {
            let got = ec.campaign("c").await;
            (got, c)
        });
        queued(&watcher, &name, 2).await;
        let listed = watcher.backend().participants(&q).await.expect("listing");
        let waiting = listed
            .iter()
            .find(|e| e.name != lb.entry().name)
            .expect("C's entry")
            .clone();
        let e = b
            .backend()
            .proclaim(&q, &waiting, b"jump")
            .await
            .expect_err("an entry that does not lead cannot proclaim");
        assert!(matches!(e, Error::LockLost(_)), "{e:?}");
        let listed = watcher.backend().participants(&q).await.expect("listing");
        let still = listed
            .iter()
            .find(|e| e.name == waiting.name)
            .expect("C's entry");
        assert_eq!(still.data, b"c", "nothing written into C's entry");
        lb.resign().await.expect("resign");
        let (got, c) = tokio::time::timeout(GENEROUS, behind)
            .await
            .expect("C leads in time")
            .expect("task");
        let lc = got.expect("campaign");
        let seen = next_leader(&mut stream).await.expect("C leads");
        assert_eq!(seen.value_str(), Some("c"));
        lc.resign().await.expect("resign");
        c.close().await.expect("close");
    } else {
        lb.resign().await.expect("resign");
    }
    assert_eq!(
        next_leader(&mut stream).await,
        None,
        "nobody leads at the end"
    );
    drop(stream);
    for c in [watcher, a, b] {
        c.close().await.expect("close");
    }
}
