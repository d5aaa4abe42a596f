//! Wire compatibility with Apache Curator 5.4, proved against the real thing: a Curator
//! client in a child JVM ([`Peer`]) and dlock contend for the same locks on the same
//! ZooKeeper, and each side must respect the other's nodes.

use std::collections::HashMap;
use std::time::Duration;

use dlock::{EntryKind, Error};
use tokio::sync::mpsc;

use crate::curator_peer::Peer;
use crate::support::{client, eventually, leftovers, unique};

const GENEROUS: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(500);

/// Polls until dlock sees `n` participants under `name`.
async fn participants_reach(c: &dlock::Client, name: &str, n: usize) {
    assert!(
        eventually(GENEROUS, || async {
            c.participants(name).await.map(|p| p.len()).unwrap_or(0) == n
        })
        .await,
        "{name} never reached {n} participants: {:?}",
        c.participants(name).await
    );
}

/// True for a Curator protected node name: `_c_<uuid>-<marker><10 digits>`.
fn curator_shaped(node: &str, marker: &str) -> bool {
    let Some(rest) = node.strip_prefix("_c_") else {
        return false;
    };
    let (uuid, tail) = rest.split_at(36.min(rest.len()));
    uuid.len() == 36
        && uuid.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        && tail
            .strip_prefix('-')
            .and_then(|t| t.strip_prefix(marker))
            .is_some_and(|seq| seq.len() == 10 && seq.bytes().all(|b| b.is_ascii_digit()))
}

/// InterProcessMutex and dlock's mutex exclude each other both ways, keep one FIFO queue,
/// and dlock's node names are the ones Curator itself creates. A chrooted dlock client
/// (`zk://hosts/chroot`) meets Curator at the chroot-prefixed path.
pub async fn mutex_interop(url: &str) {
    let Some(mut java) = Peer::start(url).await else {
        return;
    };
    let name = unique("cur-mutex");
    let path = format!("/{name}");
    let a = client(url).await;
    let b = client(url).await;
    let ma = a.mutex(&name).expect("name");

    // Curator holds: dlock times out, leaves nothing, and reads Curator's node.
    assert_eq!(java.cmd("j1", &format!("mutex {path}")).await, "ACQUIRED");
    match ma.lock_timeout(SHORT).await {
        Err(Error::Timeout(_)) => {}
        other => panic!("dlock got a lock Curator holds: {other:?}"),
    }
    assert!(matches!(ma.try_lock().await, Err(Error::WouldBlock)));
    let parts = a.participants(&name).await.expect("participants");
    assert_eq!(parts.len(), 1, "only Curator's node may remain: {parts:?}");
    assert_eq!(parts[0].entry.kind, EntryKind::Lock);
    assert!(
        parts[0].holds,
        "dlock must see Curator's node as the holder"
    );
    assert!(
        curator_shaped(&parts[0].entry.name, "lock-"),
        "{}",
        parts[0].entry.name
    );

    // Curator releases: dlock gets it; now Curator counts dlock's node and times out.
    assert_eq!(java.cmd("j1", "release").await, "RELEASED");
    let mut g = ma
        .lock_timeout(GENEROUS)
        .await
        .expect("dlock after Curator");
    assert_eq!(
        java.cmd("j2", &format!("participants {path}")).await,
        "PARTICIPANTS 1"
    );
    assert_eq!(
        java.cmd("j2", &format!("mutex {path} 500")).await,
        "TIMEOUT"
    );
    let children = java.cmd("j2", &format!("children {path}")).await;
    let node = children.strip_prefix("CHILDREN ").expect("children");
    assert_eq!(node, g.entry().name, "Curator lists exactly dlock's node");
    assert!(curator_shaped(node, "lock-"), "dlock's node {node}");

    // One FIFO queue across both: Curator queues first, then dlock; Curator goes first.
    java.send("j3", &format!("mutex {path}")).await;
    participants_reach(&a, &name, 2).await;
    let mb = b.mutex(&name).expect("name");
    let late = tokio::spawn(async move {
        let g = mb.lock_timeout(GENEROUS).await;
        (g, b)
    });
    participants_reach(&a, &name, 3).await;
    g.release().await.expect("release");
    assert_eq!(java.reply("j3").await, "ACQUIRED");
    assert!(
        !late.is_finished(),
        "the dlock waiter overtook the Curator waiter queued before it"
    );
    assert_eq!(java.cmd("j3", "release").await, "RELEASED");
    let (gb, b) = late.await.expect("task");
    let mut gb = gb.expect("dlock after the Curator waiter");
    assert!(gb.token() > g.token());
    gb.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "entries left"
    );

    // A chroot: dlock's `m` under zk://hosts/<path>-ns is Curator's `<path>-ns/m`.
    let chrooted = match url.split_once('?') {
        Some((base, query)) => format!("{base}{path}-ns?{query}"),
        None => format!("{url}{path}-ns"),
    };
    let c = client(&chrooted).await;
    let mut gc = c.mutex("m").expect("name").lock().await.expect("lock");
    assert_eq!(
        java.cmd("j4", &format!("mutex {path}-ns/m 500")).await,
        "TIMEOUT"
    );
    gc.release().await.expect("release");
    assert_eq!(
        java.cmd("j4", &format!("mutex {path}-ns/m 30000")).await,
        "ACQUIRED"
    );
    assert_eq!(java.cmd("j4", "release").await, "RELEASED");

    java.quit().await;
    for x in [a, b, c] {
        x.close().await.expect("close");
    }
}

/// InterProcessReadWriteLock and dlock's RwLock: writers exclude readers both ways,
/// readers of both share, one queue orders both (a Curator reader waits behind a dlock
/// writer queued before it, and the reverse), and a dlock downgrade keeps a queued
/// Curator writer out.
pub async fn rwlock_interop(url: &str) {
    let Some(mut java) = Peer::start(url).await else {
        return;
    };
    let name = unique("cur-rw");
    let path = format!("/{name}");
    let a = client(url).await;
    let b = client(url).await;
    let rw = a.rwlock(&name).expect("name");

    // A Curator writer blocks dlock readers and writers.
    assert_eq!(java.cmd("w1", &format!("write {path}")).await, "ACQUIRED");
    assert!(matches!(
        rw.read_timeout(SHORT).await,
        Err(Error::Timeout(_))
    ));
    assert!(matches!(rw.try_read().await, Err(Error::WouldBlock)));
    assert!(matches!(rw.try_write().await, Err(Error::WouldBlock)));
    let parts = a.participants(&name).await.expect("participants");
    assert_eq!(parts.len(), 1, "{parts:?}");
    assert_eq!(parts[0].entry.kind, EntryKind::Write);
    assert_eq!(java.cmd("w1", "release").await, "RELEASED");

    // Readers of both sides share; writers of both sides are kept out.
    let mut r = rw.read_timeout(GENEROUS).await.expect("dlock read");
    assert!(curator_shaped(&r.entry().name, "__READ__"));
    assert_eq!(
        java.cmd("r1", &format!("read {path} 30000")).await,
        "ACQUIRED",
        "a Curator reader must share with a dlock reader"
    );
    let rb = b.rwlock(&name).expect("name");
    let mut r2 = rb
        .read_timeout(GENEROUS)
        .await
        .expect("second dlock reader");
    assert_eq!(
        java.cmd("w2", &format!("write {path} 500")).await,
        "TIMEOUT"
    );
    let third = client(url).await;
    let rw3 = third.rwlock(&name).expect("name");
    assert!(matches!(rw3.try_write().await, Err(Error::WouldBlock)));
    assert_eq!(java.cmd("r1", "release").await, "RELEASED");
    r.release().await.expect("release");
    r2.release().await.expect("release");

    // A dlock writer blocks Curator readers and writers.
    let mut w = rw.write_timeout(GENEROUS).await.expect("dlock write");
    assert!(curator_shaped(&w.entry().name, "__WRIT__"));
    assert_eq!(java.cmd("r2", &format!("read {path} 500")).await, "TIMEOUT");
    assert_eq!(
        java.cmd("w3", &format!("write {path} 500")).await,
        "TIMEOUT"
    );

    // One queue: a Curator writer queued behind the dlock writer, then a dlock reader
    // behind it. Releasing the dlock writer lets the Curator writer in, not the reader.
    java.send("w4", &format!("write {path}")).await;
    participants_reach(&a, &name, 2).await;
    let reader = tokio::spawn(async move {
        let g = rb.read_timeout(GENEROUS).await;
        (g, b)
    });
    participants_reach(&a, &name, 3).await;
    w.release().await.expect("release");
    assert_eq!(java.reply("w4").await, "ACQUIRED");
    assert!(
        !reader.is_finished(),
        "a dlock reader got in while the Curator writer queued before it holds"
    );
    // And the reverse: a Curator reader queued behind a waiting dlock writer waits too.
    let rw2 = a.rwlock(&name).expect("name");
    let writer = tokio::spawn(async move { rw2.write_timeout(GENEROUS).await });
    participants_reach(&a, &name, 3).await;
    assert_eq!(java.cmd("r3", &format!("read {path} 500")).await, "TIMEOUT");
    assert_eq!(java.cmd("w4", "release").await, "RELEASED");
    let (g, b) = reader.await.expect("task");
    let mut g = g.expect("dlock reader after the Curator writer");
    assert!(
        !writer.is_finished(),
        "the dlock writer got in beside a reader"
    );
    g.release().await.expect("release");
    let mut gw = writer.await.expect("task").expect("dlock writer");
    gw.release().await.expect("release");

    // Downgrade: dlock holds write and takes read; a Curator writer queued meanwhile
    // must not get in when the dlock write is released, only after the read.
    let mut w = rw.write_timeout(GENEROUS).await.expect("dlock write");
    java.send("w5", &format!("write {path}")).await;
    participants_reach(&a, &name, 2).await;
    let mut r = rw.downgrade(&w).await.expect("downgrade read");
    w.release().await.expect("release write");
    // Not a timing assertion: give the Curator writer ample chance to (wrongly) get in.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        java.try_reply("w5"),
        None,
        "the Curator writer got in during a dlock downgrade"
    );
    r.release().await.expect("release read");
    assert_eq!(java.reply("w5").await, "ACQUIRED");
    assert_eq!(java.cmd("w5", "release").await, "RELEASED");
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "entries left"
    );
    java.quit().await;
    for x in [a, b, third] {
        x.close().await.expect("close");
    }
}

/// What one semaphore contender reported: `Acquired(contender, lease node name)`.
#[derive(Debug)]
enum Event {
    Acquired(String, String),
    Released(String),
}

/// InterProcessSemaphoreV2 and dlock's Semaphore share 3 permits: 3 Curator and 3 dlock
/// contenders, two rounds each, each holding until told to let go. Every contender
/// counts as a holder from its own "acquired" report until its release has completed,
/// so the count can only over-estimate. The reports come from two processes, so a new
/// holder's report can overtake the report of the release that let it in: a fourth
/// holder is accepted only while a release is in flight and the releaser's lease node
/// is already gone from the server. The count must reach 3 and must at some point mix
/// both sides. The server agrees: never more than 3 + 1 waiting lease nodes.
pub async fn semaphore_interop(url: &str) {
    const PERMITS: usize = 3;
    const ROUNDS: usize = 2;
    let Some(mut java) = Peer::start(url).await else {
        return;
    };
    let name = unique("cur-sem");
    let path = format!("/{name}");
    let c = client(url).await;
    let (tx, mut events) = mpsc::unbounded_channel();
    let mut release: HashMap<String, mpsc::UnboundedSender<()>> = HashMap::new();
    let mut remaining: HashMap<String, usize> = HashMap::new();
    for i in 0..PERMITS {
        let id = format!("d{i}");
        let (rtx, mut rrx) = mpsc::unbounded_channel::<()>();
        release.insert(id.clone(), rtx);
        remaining.insert(id.clone(), ROUNDS);
        let sem = c.semaphore(&name, PERMITS as u32).expect("name");
        let tx = tx.clone();
        tokio::spawn(async move {
            for _ in 0..ROUNDS {
                let mut g = sem.acquire_timeout(Duration::from_secs(120)).await;
                let ok = g.is_ok();
                let node = g
                    .as_ref()
                    .map(|g| g.entry().name.clone())
                    .unwrap_or_default();
                let _ = tx.send(Event::Acquired(id.clone(), node));
                if rrx.recv().await.is_none() || !ok {
                    return;
                }
                if let Ok(g) = g.as_mut() {
                    g.release().await.expect("release");
                }
                let _ = tx.send(Event::Released(id.clone()));
            }
        });
    }
    let java_acquire = format!("sem {path} {PERMITS}");
    for i in 0..PERMITS {
        let id = format!("j{i}");
        remaining.insert(id.clone(), ROUNDS);
        java.send(&id, &java_acquire).await;
    }

    let mut live: Vec<String> = Vec::new();
    let mut nodes: HashMap<String, String> = HashMap::new();
    let mut releasing: Option<String> = None;
    let (mut peak, mut mixed, mut acquisitions) = (0, false, 0);
    loop {
        let active = remaining.values().filter(|r| **r > 0).count();
        if active == 0 {
            break;
        }
        if releasing.is_none() && live.len() == active.min(PERMITS) {
            // Settled: the server shows the holders' leases plus at most one waiter's.
            let leases = c
                .participants(&name)
                .await
                .expect("participants")
                .iter()
                .filter(|p| p.queue == "leases")
                .count();
            assert!(leases <= PERMITS + 1, "{leases} lease nodes");
            let who = live[0].clone();
            if who.starts_with('j') {
                java.send(&who, "release").await;
            } else if let Some(r) = release.get(&who) {
                r.send(()).expect("dlock contender alive");
            }
            releasing = Some(who);
        }
        let event = tokio::time::timeout(Duration::from_secs(120), async {
            tokio::select! {
                line = java.next_line() => {
                    let (id, text) = line.expect("the Curator peer exited");
                    if let Some(node) = text.strip_prefix("ACQUIRED ") {
                        let node = node.rsplit('/').next().unwrap_or(node).to_owned();
                        Event::Acquired(id, node)
                    } else {
                        assert_eq!(text, "RELEASED", "unexpected reply of {id}");
                        Event::Released(id)
                    }
                }
                e = events.recv() => e.expect("dlock contenders alive"),
            }
        })
        .await
        .unwrap_or_else(|_| panic!("no progress; holders {live:?}"));
        match event {
            Event::Acquired(id, node) => {
                acquisitions += 1;
                nodes.insert(id.clone(), node);
                live.push(id);
                let mut holding = live.len();
                if holding > PERMITS {
                    let overtaken = match &releasing {
                        Some(r) => {
                            let gone = &nodes[r];
                            !c.participants(&name)
                                .await
                                .expect("participants")
                                .iter()
                                .any(|p| p.queue == "leases" && p.entry.name == *gone)
                        }
                        None => false,
                    };
                    assert!(overtaken, "more holders than permits: {live:?}");
                    holding -= 1;
                }
                assert!(holding <= PERMITS, "more holders than permits: {live:?}");
                peak = peak.max(holding);
                mixed |= live.iter().any(|h| h.starts_with('j'))
                    && live.iter().any(|h| h.starts_with('d'));
            }
            Event::Released(id) => {
                assert_eq!(releasing.as_deref(), Some(id.as_str()));
                releasing = None;
                live.retain(|h| *h != id);
                let left = remaining.get_mut(&id).expect("known contender");
                *left -= 1;
                if *left > 0 && id.starts_with('j') {
                    java.send(&id, &java_acquire).await;
                }
            }
        }
    }
    assert_eq!(acquisitions, 2 * PERMITS * ROUNDS);
    assert_eq!(peak, PERMITS, "the peak must reach the permits");
    assert!(
        mixed,
        "Curator and dlock never held permits at the same time"
    );
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "entries left"
    );

    // InterProcessSemaphoreMutex (a one-lease semaphore) against dlock's SemaphoreMutex.
    let sm = c.semaphore_mutex(&name).expect("name");
    assert_eq!(
        java.cmd("m1", &format!("semmutex {path}")).await,
        "ACQUIRED"
    );
    assert!(matches!(sm.try_lock().await, Err(Error::WouldBlock)));
    assert_eq!(java.cmd("m1", "release").await, "RELEASED");
    let mut g = sm
        .lock_timeout(GENEROUS)
        .await
        .expect("dlock semaphore-mutex");
    assert_eq!(
        java.cmd("m2", &format!("semmutex {path} 500")).await,
        "TIMEOUT"
    );
    g.release().await.expect("release");
    java.quit().await;
    c.close().await.expect("close");
}

/// A semaphore sized by Curator's `SharedCount`: dlock reads the count Curator writes
/// (4-byte big-endian), both sides enforce it together, and when Curator raises it both
/// sides see the new size.
pub async fn shared_count_interop(url: &str) {
    let Some(mut java) = Peer::start(url).await else {
        return;
    };
    let name = unique("cur-shared");
    let count = format!("{name}-count");
    let (path, count_path) = (format!("/{name}"), format!("/{count}"));
    assert_eq!(
        java.cmd("c", &format!("count {count_path} 2")).await,
        "COUNT 2"
    );
    let c = client(url).await;
    let sem = dlock::Semaphore::with_shared_count(&c, &name, &count).expect("names");
    assert_eq!(sem.permits().await.expect("permits"), 2, "Curator's count");
    let mut p1 = sem.acquire_timeout(GENEROUS).await.expect("permit 1");
    let mut p2 = sem.acquire_timeout(GENEROUS).await.expect("permit 2");
    assert_eq!(
        java.cmd("j1", &format!("semshared {path} {count_path} 500"))
            .await,
        "TIMEOUT",
        "Curator must see dlock's two leases as the whole count"
    );
    assert!(matches!(sem.try_acquire().await, Err(Error::WouldBlock)));
    assert_eq!(
        java.cmd("c", &format!("count {count_path} 3")).await,
        "COUNT 3"
    );
    assert_eq!(sem.permits().await.expect("permits"), 3, "the raised count");
    let got = java
        .cmd("j1", &format!("semshared {path} {count_path} 30000"))
        .await;
    assert!(got.starts_with("ACQUIRED"), "{got}");
    assert!(
        matches!(sem.try_acquire().await, Err(Error::WouldBlock)),
        "three leases are the whole raised count"
    );
    assert_eq!(java.cmd("j1", "release").await, "RELEASED");
    p1.release().await.expect("release");
    p2.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&c, &name).await == 0 }).await,
        "entries left"
    );
    java.quit().await;
    c.close().await.expect("close");
}

/// Asks the Java peer, as `id`, until its latch's `hasLeadership()` is `want`.
async fn java_leads(java: &mut Peer, id: &str, want: bool) -> bool {
    let deadline = tokio::time::Instant::now() + GENEROUS;
    loop {
        let got = java.cmd(id, "leads").await;
        if got == format!("LEADS {want}") {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Curator's `LeaderLatch` and dlock's election on one path elect exactly one leader
/// between them, in both directions; each side's `getLeader()` / `leader()` names the
/// other's participant id (the node's data); dlock's candidates are `latch-` nodes as
/// Curator names them; a value dlock proclaims is the id Curator reads.
pub async fn leader_latch_interop(url: &str) {
    let Some(mut java) = Peer::start(url).await else {
        return;
    };
    let name = unique("cur-latch");
    let path = format!("/{name}");
    let a = client(url).await;
    let b = client(url).await;
    let ea = a.election(&name).expect("name");
    let eb = b.election(&name).expect("name");

    // Java leads: dlock cannot, leaves nothing, and names Java's participant id.
    assert_eq!(
        java.cmd("j1", &format!("latch {path} java-1")).await,
        "LEADER"
    );
    assert!(matches!(
        ea.try_campaign("dlock-a").await,
        Err(Error::WouldBlock)
    ));
    match ea.campaign_timeout("dlock-a", SHORT).await {
        Err(Error::Timeout(_)) => {}
        other => panic!("dlock was elected while Curator's latch leads: {other:?}"),
    }
    let leader = ea.leader().await.expect("leader").expect("Java leads");
    assert_eq!(leader.value_str(), Some("java-1"));
    assert!(curator_shaped(&leader.entry, "latch-"), "{}", leader.entry);
    participants_reach(&a, &name, 1).await;

    // dlock queues behind Java: Java still leads, and counts dlock's candidate.
    let waiting = tokio::spawn({
        let eb = eb.clone();
        async move { eb.campaign("dlock-b").await }
    });
    participants_reach(&a, &name, 2).await;
    let parts = a.participants(&name).await.expect("participants");
    assert!(
        parts.iter().all(
            |p| p.entry.kind == EntryKind::Candidate && curator_shaped(&p.entry.name, "latch-")
        ),
        "dlock's candidate must be a LeaderLatch node: {parts:?}"
    );
    assert_eq!(
        java.cmd("q", &format!("leader {path}")).await,
        "LEADER java-1 2"
    );
    assert!(!waiting.is_finished(), "dlock was elected while Java led");

    // Java's latch closes: dlock's candidate leads, and Java names it.
    assert_eq!(java.cmd("j1", "release").await, "RELEASED");
    let lead = tokio::time::timeout(GENEROUS, waiting)
        .await
        .expect("dlock elected after Java resigned")
        .expect("task")
        .expect("campaign");
    assert_eq!(
        java.cmd("q", &format!("leader {path}")).await,
        "LEADER dlock-b 1"
    );
    let seen = ea.leader().await.expect("leader").expect("dlock leads");
    assert_eq!(
        (seen.value_str(), seen.term),
        (Some("dlock-b"), lead.term())
    );
    // What dlock proclaims is the participant id Curator reads. (Before any Java latch
    // queues behind: a LeaderLatch's watch on the node ahead acts only on its deletion,
    // and a data change uses that one-shot watch up; see docs/election.md.)
    lead.proclaim("dlock-b2").await.expect("proclaim");
    assert_eq!(
        java.cmd("q", &format!("leader {path}")).await,
        "LEADER dlock-b2 1"
    );

    // A Java latch joins behind dlock: it must not lead while dlock does.
    assert_eq!(
        java.cmd("j2", &format!("latchstart {path} java-2")).await,
        "STARTED"
    );
    participants_reach(&a, &name, 2).await;
    assert_eq!(java.cmd("j2", "leads").await, "LEADS false");
    lead.verify().await.expect("dlock still leads");
    assert_eq!(
        java.cmd("q", &format!("leader {path}")).await,
        "LEADER dlock-b2 2"
    );

    // dlock resigns: the Java latch leads, and dlock names it.
    lead.resign().await.expect("resign");
    assert!(
        java_leads(&mut java, "j2", true).await,
        "Java never led after dlock resigned"
    );
    let seen = eb.leader().await.expect("leader").expect("Java leads");
    assert_eq!(seen.value_str(), Some("java-2"));
    assert!(matches!(
        eb.try_campaign("dlock-b").await,
        Err(Error::WouldBlock)
    ));

    assert_eq!(java.cmd("j2", "release").await, "RELEASED");
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "nodes left behind"
    );
    java.quit().await;
}
