//! Reads behind a follower that trails the leader, on a real 3-node ensemble.
//!
//! Needs `DLOCK_TEST_STATE` (the state file of `cargo xtask cluster up --zk 3`), root and
//! `nft` (the follower is cut off from its leader with nftables). Without a 3-node
//! ensemble the test prints `SKIPPED` and passes.

use std::time::Duration;

use dlock_core::SessionOptions;
use dlock_core::{Backend, EntryKind, Error, LockName, Position, QueuePath};
use dlock_testkit::Backend as Server;
use dlock_zookeeper::ZkBackend;

/// Generous bound for anything that should happen "soon": a hang fails the test, a slow
/// machine does not.
const LONG: Duration = Duration::from_secs(60);

/// Held through each test that cuts a follower off: they would pick the same follower,
/// and one cut (or the re-join it sets off) would pull the other's connection away.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Two sessions under one fresh chroot: `a` on a follower only, `b` on the leader.
struct Setup {
    a: std::sync::Arc<ZkBackend>,
    b: std::sync::Arc<ZkBackend>,
    follower_pid: u32,
    quorum_port: u16,
}

/// Connects the two sessions; `None` (after printing `SKIPPED`) without a 3-node ensemble.
async fn setup() -> Option<Setup> {
    let state = dlock_testkit::require_state()?;
    if state.servers_of(Server::Zookeeper).count() < 3 {
        eprintln!("SKIPPED: a follower partition needs a 3-node ZooKeeper ensemble");
        return None;
    }
    let leader = tokio::task::block_in_place(|| state.wait_leader(Server::Zookeeper, LONG))
        .expect("a ZooKeeper leader");
    let follower = state
        .servers_of(Server::Zookeeper)
        .map(|s| s.id)
        .find(|id| *id != leader)
        .expect("a follower");
    let f = state.server(Server::Zookeeper, follower).expect("follower");
    let l = state.server(Server::Zookeeper, leader).expect("leader");
    // A follower another test cut off may still be re-joining: wait until it serves as
    // a follower again, so its quorum connection is the one `cut` finds.
    let deadline = std::time::Instant::now() + LONG;
    while dlock_testkit::zk_mode(&f.addr, Duration::from_secs(2))
        != Some(dlock_testkit::ZkMode::Follower)
    {
        assert!(
            std::time::Instant::now() < deadline,
            "ZooKeeper {} did not serve as a follower within {LONG:?}",
            f.addr
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (quorum_port, _) = state.zk_peer_ports(leader);

    let chroot = format!("/dlock-it/{}", uuid::Uuid::new_v4());
    // A session long enough that neither the heartbeat nor the leader ends it while the
    // follower is cut off: the answer must come from the sync, not from a lost session.
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(20));
    let connect = |addr: String| {
        let url = format!("{addr}{chroot}");
        let opts = opts.clone();
        async move {
            tokio::time::timeout(LONG, ZkBackend::connect(&url, opts))
                .await
                .expect("connect in time")
                .unwrap_or_else(|e| panic!("connect {url}: {e}"))
        }
    };
    Some(Setup {
        a: connect(f.addr.clone()).await,
        b: connect(l.addr.clone()).await,
        follower_pid: f.pid,
        quorum_port,
    })
}

impl Setup {
    /// Cuts `a`'s follower off from the leader (only its quorum connection; the leader
    /// and the other follower stay a quorum, and both clients still reach their servers).
    fn cut(&self) -> dlock_testkit::NetCut {
        let ports = dlock_testkit::connections_of(self.follower_pid, self.quorum_port)
            .expect("follower sockets");
        assert!(
            !ports.is_empty(),
            "the follower has no connection to the leader's quorum port {}",
            self.quorum_port
        );
        let pairs: Vec<(u16, u16)> = ports.iter().map(|p| (*p, self.quorum_port)).collect();
        dlock_testkit::NetCut::new(&pairs, &[]).expect("cut the follower off")
    }

    /// Whether `a`'s server answers, without a sync, that `path` exists.
    async fn follower_shows(&self, path: &str) -> bool {
        let raw = self.a.client().expect("client");
        matches!(raw.check_stat(path).await, Ok(Some(_)))
    }
}

fn queue() -> QueuePath {
    QueuePath::root(LockName::new("trailing", dlock_zookeeper::NAME_RULES).expect("name"))
}

/// A follower cut off from its leader still answers reads from its own, now stale, tree
/// until it notices the cut (syncLimit × tickTime). `contains` (what `LockGuard::verify`
/// asks) must not say "still there" about an entry the leader has already deleted: it
/// syncs through the leader first, so it answers only once the follower has caught up
/// (or the session is declared lost). The unsynced read is checked first to show the
/// follower really is stale, so the test cannot pass by a race won.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn verify_behind_a_cut_off_follower_does_not_see_a_deleted_entry() {
    let _serial = SERIAL.lock().await;
    let Some(s) = setup().await else {
        return;
    };
    let q = queue();
    let mine =
        s.a.enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"",
        )
        .await
        .expect("enqueue")
        .mine;
    assert!(
        s.a.contains(&q, &mine).await.expect("contains"),
        "own entry"
    );

    let cut = s.cut();
    // The leader and the other follower are a quorum: the delete commits without `a`'s.
    s.b.remove(&q, &mine)
        .await
        .expect("delete through the leader");
    // The client is rooted at the chroot.
    let path = format!("/trailing/{}", mine.name);
    assert!(
        s.follower_shows(&path).await,
        "precondition: the cut-off follower should still show the deleted entry"
    );

    let verdict = tokio::time::timeout(LONG, s.a.contains(&q, &mine)).await;
    cut.heal().expect("heal the cut");
    eprintln!("contains behind the cut-off follower: {verdict:?}");
    match verdict {
        Ok(Ok(false)) | Ok(Err(Error::LockLost(_))) => {}
        Ok(Ok(true)) => panic!(
            "contains said the entry is still there, though the leader had deleted it \
             (the follower answered from its stale tree)"
        ),
        Ok(Err(e)) => panic!("contains failed with an unexpected error: {e}"),
        Err(_) => panic!("contains did not answer within {LONG:?}"),
    }
    let _ = s.a.close().await;
    let _ = s.b.close().await;
}

/// `abandon` must remove a ticket's entry even when its create was committed by the
/// leader but not yet applied by the session's server, as after a create whose reply was
/// lost and a reconnection to a trailing follower. Stand-in for that create: the other
/// session, on the leader, creates the entry under the same ticket while `a`'s follower
/// is cut off. Without a sync before its listing, `abandon` lists the follower's stale
/// tree, finds nothing, and leaves the entry queued forever (until that session ends).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_behind_a_cut_off_follower_removes_an_entry_it_had_not_applied() {
    let _serial = SERIAL.lock().await;
    let Some(s) = setup().await else {
        return;
    };
    let q = queue();
    // The queue's parent exists on every server before the cut.
    let first =
        s.a.enqueue(
            &q,
            &dlock_testkit::ticket(),
            EntryKind::Lock,
            Position::Tail,
            b"",
        )
        .await
        .expect("enqueue")
        .mine;

    let cut = s.cut();
    let ticket = dlock_testkit::ticket();
    let unseen =
        s.b.enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"")
            .await
            .expect("enqueue through the leader")
            .mine;
    let path = format!("/trailing/{}", unseen.name);
    assert!(
        !s.follower_shows(&path).await,
        "precondition: the cut-off follower should not have applied the create yet"
    );

    let outcome = tokio::time::timeout(LONG, s.a.abandon(&q, &ticket)).await;
    cut.heal().expect("heal the cut");
    eprintln!("abandon behind the cut-off follower: {outcome:?}");
    match outcome {
        Ok(Ok(())) => {}
        Ok(Err(e)) => panic!("abandon failed: {e}"),
        Err(_) => panic!("abandon did not finish within {LONG:?}"),
    }
    let left = s.b.queue(&q).await.expect("queue through the leader");
    assert!(
        !left.iter().any(|e| e.name == unseen.name),
        "abandon left the ticket's entry {} in the queue: it listed the follower's stale \
         tree",
        unseen.name
    );
    s.a.remove(&q, &first).await.expect("remove");
    let _ = s.a.close().await;
    let _ = s.b.close().await;
}

/// Collects everything the test's subscriber writes.
#[derive(Clone, Default)]
struct Captured(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if let Ok(mut out) = self.0.lock() {
            out.extend_from_slice(buf);
        }
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for Captured {
    type Writer = Captured;
    fn make_writer(&'a self) -> Captured {
        self.clone()
    }
}

/// A session shorter than 2 × syncLimit × tickTime (the test ensemble: 2 × 10 × 200 ms =
/// 4 s) is warned about at connect, naming the rule; a longer one is not.
#[tokio::test]
async fn a_session_shorter_than_twice_the_follower_detection_is_warned_about() {
    let Some(state) = dlock_testkit::require_state() else {
        return;
    };
    if state.servers_of(Server::Zookeeper).count() < 3 {
        eprintln!("SKIPPED: the rule concerns followers: needs a 3-node ZooKeeper ensemble");
        return;
    }
    let hosts: Vec<String> = state
        .servers_of(Server::Zookeeper)
        .map(|s| s.addr.clone())
        .collect();
    let hosts = hosts.join(",");
    let warned = |session: Duration| {
        let hosts = hosts.clone();
        async move {
            // Keep tracing's per-callsite interest from being decided by another
            // test's subscriber-less thread alone (it does while just one dispatcher
            // exists): with two alive, every decision asks this one too.
            let _second = tracing::Dispatch::new(tracing_subscriber::registry());
            let out = Captured::default();
            let subscriber = tracing_subscriber::fmt()
                .with_writer(out.clone())
                .with_max_level(tracing::Level::WARN)
                .with_ansi(false)
                .finish();
            let _default = tracing::subscriber::set_default(subscriber);
            let opts = SessionOptions::default().with_session_timeout(session);
            let zk = tokio::time::timeout(LONG, ZkBackend::connect(&hosts, opts))
                .await
                .expect("connect in time")
                .expect("connect");
            let _ = zk.close().await;
            let text = out.0.lock().map(|v| v.clone()).unwrap_or_default();
            String::from_utf8_lossy(&text).into_owned()
        }
    };
    let short = warned(Duration::from_secs(2)).await;
    assert!(
        short.contains("2 x syncLimit x tickTime"),
        "no warning for a 2 s session on a tick 200 ms, syncLimit 10 ensemble: {short:?}"
    );
    let long = warned(Duration::from_secs(6)).await;
    assert!(
        !long.contains("syncLimit"),
        "a 6 s session was warned about: {long:?}"
    );
}
