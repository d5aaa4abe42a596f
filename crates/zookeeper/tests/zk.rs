//! Integration tests of `ZkBackend` through the `Backend` trait, against a real ZooKeeper.
//!
//! Endpoint from env `DLOCK_TEST_ZK` (`host:port[,host:port...]`). When it is missing the
//! tests print `SKIPPED` and pass, unless env `CI` is set, where they fail. Every test
//! works under its own random chroot, so tests run in parallel and never see each other.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    decide, Backend, Decision, Enqueued, Entry, EntryKind, Error, LockName, Position, QueuePath,
    SessionOptions, Ticket,
};
use dlock_zookeeper::ZkBackend;
use zookeeper_client as zk;

/// Generous bound for anything that should happen "soon": a hang fails the test, a slow
/// machine does not.
const LONG: Duration = Duration::from_secs(30);

// TODO(lead): move to dlock-testkit.
fn zk_hosts() -> Option<String> {
    match std::env::var("DLOCK_TEST_ZK") {
        Ok(v) if !v.trim().is_empty() => Some(v.trim().to_owned()),
        _ => {
            if std::env::var_os("CI").is_some() {
                panic!("DLOCK_TEST_ZK is not set, and CI is set: the ZooKeeper tests must run");
            }
            eprintln!("SKIPPED: DLOCK_TEST_ZK not set; ZooKeeper integration test not run");
            None
        }
    }
}

fn fresh_chroot() -> String {
    format!("/dlock-it/{}", uuid::Uuid::new_v4())
}

fn opts() -> SessionOptions {
    SessionOptions::default().with_session_timeout(Duration::from_secs(4))
}

async fn connect(hosts: &str, chroot: &str) -> Arc<ZkBackend> {
    within(ZkBackend::connect(&format!("{hosts}{chroot}"), opts()))
        .await
        .expect("connect to ZooKeeper")
}

fn queue(name: &str) -> QueuePath {
    QueuePath::root(LockName::new(name, dlock_zookeeper::NAME_RULES).expect("valid name"))
}

async fn within<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(LONG, f)
        .await
        .expect("did not finish within 30 s")
}

/// Adds a fresh entry of `kind` at the tail of `q`, without data; panics (naming `what`)
/// if that fails.
async fn add(b: &ZkBackend, q: &QueuePath, kind: EntryKind, what: &str) -> Enqueued {
    within(b.enqueue(q, &Ticket::new(), kind, Position::Tail, b""))
        .await
        .unwrap_or_else(|e| panic!("{what}: {e}"))
}

fn names(q: &[Entry]) -> Vec<&str> {
    q.iter().map(|e| e.name.as_str()).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_returns_queue_in_sequence_order_with_mine() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let b = connect(&hosts, &root).await;
    let q = queue("orders/42");
    let tickets: Vec<Ticket> = (0..3).map(|_| Ticket::new()).collect();
    let mut last = None;
    for t in &tickets {
        let done = within(b.enqueue(&q, t, EntryKind::Lock, Position::Tail, b"owner"))
            .await
            .expect("enqueue");
        assert!(done.mine.is_from(t));
        assert!(done.mine.name.starts_with(&t.name_prefix(EntryKind::Lock)));
        assert_eq!(done.mine.data, b"owner");
        assert!(done.mine.token.is_some());
        assert!(done.queue.iter().any(|e| e.name == done.mine.name));
        last = Some(done);
    }
    let last = last.expect("three enqueues");
    assert_eq!(last.queue.len(), 3);
    let seqs: Vec<u64> = last.queue.iter().map(|e| e.seq).collect();
    assert!(
        seqs.windows(2).all(|w| w[0] < w[1]),
        "not in order: {seqs:?}"
    );
    for (entry, t) in last.queue.iter().zip(&tickets) {
        assert!(entry.is_from(t), "queue order differs from enqueue order");
    }
    // The same queue, read back, is the path a Curator user would pass: /orders/42.
    let raw = b.client().expect("client");
    let children = within(raw.list_children("/orders/42")).await.expect("list");
    assert_eq!(children.len(), 3);
    assert_eq!(within(b.queue(&q)).await.expect("queue"), {
        let mut plain = last.queue.clone();
        for e in &mut plain {
            e.token = None;
            e.created_ms = None;
            e.data.clear();
        }
        plain
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_sessions_queue_in_order_and_driver_decides() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let b = connect(&hosts, &root).await;
    let q = queue("m");
    let (ta, tb) = (Ticket::new(), Ticket::new());
    let ea = within(a.enqueue(&q, &ta, EntryKind::Lock, Position::Tail, b""))
        .await
        .expect("enqueue a");
    assert_eq!(decide(&ea.queue, &ea.mine.name), Decision::Acquired);
    let eb = within(b.enqueue(&q, &tb, EntryKind::Lock, Position::Tail, b""))
        .await
        .expect("enqueue b");
    assert_eq!(
        names(&eb.queue),
        vec![ea.mine.name.as_str(), eb.mine.name.as_str()]
    );
    let blocker = match decide(&eb.queue, &eb.mine.name) {
        Decision::Wait(e) => e.clone(),
        other => panic!("b should wait, got {other:?}"),
    };
    assert_eq!(blocker.name, ea.mine.name);

    let waiter = {
        let b = b.clone();
        let q = q.clone();
        tokio::spawn(async move { b.wait_gone(&q, &blocker).await })
    };
    within(a.remove(&q, &ea.mine)).await.expect("remove a");
    within(waiter).await.expect("join").expect("wait_gone");
    let now = within(b.queue(&q)).await.expect("queue");
    assert_eq!(decide(&now, &eb.mine.name), Decision::Acquired);
    // Removing twice is fine.
    within(a.remove(&q, &ea.mine)).await.expect("remove again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_gone_returns_at_once_when_gone_and_ignores_data_changes() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let b = connect(&hosts, &root).await;
    let q = queue("w");
    let ea = add(&a, &q, EntryKind::Lock, "enqueue").await;

    let waiter = {
        let (b, q, e) = (b.clone(), q.clone(), ea.mine.clone());
        tokio::spawn(async move { b.wait_gone(&q, &e).await })
    };
    // A data change (what Curator's revoker does) fires the data watch; wait_gone must
    // re-arm rather than return. The watch event reaches b before b's own later read of
    // the new data (ZooKeeper's ordering guarantee), so after that read plus a pause the
    // waiter would have finished if it treated the change as a removal.
    let path = format!("/w/{}", ea.mine.name);
    within(
        a.client()
            .expect("client")
            .set_data(&path, b"__REVOKE__", None),
    )
    .await
    .expect("set_data");
    let seen = within(b.participants(&q)).await.expect("participants");
    assert_eq!(seen[0].data, b"__REVOKE__");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiter.is_finished(), "wait_gone returned on a data change");

    within(a.remove(&q, &ea.mine)).await.expect("remove");
    within(waiter)
        .await
        .expect("join")
        .expect("wait_gone after remove");
    // Already gone: returns at once (bounded only by LONG).
    within(b.wait_gone(&q, &ea.mine))
        .await
        .expect("wait_gone on a gone entry");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_strictly_increase_across_sessions() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let b = connect(&hosts, &root).await;
    let q = queue("fenced");
    let mut tokens = Vec::new();
    for i in 0..6 {
        let who = if i % 2 == 0 { &a } else { &b };
        let done = add(who, &q, EntryKind::Lock, "enqueue").await;
        assert_eq!(decide(&done.queue, &done.mine.name), Decision::Acquired);
        tokens.push(done.mine.token.expect("token"));
        within(who.remove(&q, &done.mine)).await.expect("remove");
    }
    assert!(
        tokens.windows(2).all(|w| w[0] < w[1]),
        "tokens not increasing: {tokens:?}"
    );
    // The token is the znode's czxid, as participants reports it.
    let done = within(a.enqueue(&q, &Ticket::new(), EntryKind::Lock, Position::Tail, b"x"))
        .await
        .expect("enqueue");
    let seen = within(b.participants(&q)).await.expect("participants");
    assert_eq!(seen.len(), 1);
    assert_eq!(seen[0].token, done.mine.token);
    assert_eq!(seen[0].data, b"x");
    assert!(seen[0].created_ms.is_some_and(|ms| ms > 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn beside_entry_sorts_beside_its_writer() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let b = connect(&hosts, &root).await;
    let q = queue("rw");
    let ta = Ticket::new();
    let w = within(a.enqueue(&q, &ta, EntryKind::Write, Position::Tail, b""))
        .await
        .expect("writer");
    let later = add(&b, &q, EntryKind::Write, "later writer").await;
    let tr = Ticket::new();
    let r = within(a.enqueue(&q, &tr, EntryKind::Read, Position::Beside(&w.mine), b""))
        .await
        .expect("read beside");
    assert_eq!(r.mine.seq, w.mine.seq);
    assert_eq!(r.mine.kind, EntryKind::Read);
    assert_eq!(
        r.mine.name,
        format!(
            "{}{}",
            tr.name_prefix(EntryKind::Read),
            dlock_core::entry::format_seq(w.mine.seq)
        )
    );
    let pos = |name: &str| {
        r.queue
            .iter()
            .position(|e| e.name == name)
            .expect("present")
    };
    let (pw, pr, pl) = (pos(&w.mine.name), pos(&r.mine.name), pos(&later.mine.name));
    assert_eq!(pw.abs_diff(pr), 1, "read entry not beside its writer");
    assert!(pl > pw && pl > pr, "later writer sorted before the pair");
    assert_eq!(decide(&r.queue, &r.mine.name), Decision::Acquired);
    // The node is ephemeral but not sequential: its name is exactly what we asked for.
    let raw = b.client().expect("client");
    let (_, stat) = within(raw.get_data(&format!("/rw/{}", r.mine.name)))
        .await
        .expect("get_data");
    assert_eq!(stat.ephemeral_owner, a.session_id());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandon_removes_exactly_the_tickets_entry() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let q = queue("ab");
    let tickets: Vec<Ticket> = (0..3).map(|_| Ticket::new()).collect();
    for t in &tickets {
        within(a.enqueue(&q, t, EntryKind::Lock, Position::Tail, b""))
            .await
            .expect("enqueue");
    }
    within(a.abandon(&q, &tickets[1])).await.expect("abandon");
    let left = within(a.queue(&q)).await.expect("queue");
    assert_eq!(left.len(), 2);
    assert!(left[0].is_from(&tickets[0]));
    assert!(left[1].is_from(&tickets[2]));
    // Abandoning again, or a ticket that created nothing, or in a queue that does not
    // exist, succeeds.
    within(a.abandon(&q, &tickets[1]))
        .await
        .expect("abandon again");
    within(a.abandon(&q, &Ticket::new()))
        .await
        .expect("abandon unknown");
    within(a.abandon(&queue("nowhere"), &tickets[0]))
        .await
        .expect("abandon in missing queue");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_enqueues_then_abandon_leave_zero_children() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let q = queue("dropped/queue");
    // Make the parent exist once, so most drops happen around the pipelined create.
    let first = Ticket::new();
    within(a.enqueue(&q, &first, EntryKind::Lock, Position::Tail, b""))
        .await
        .expect("enqueue");
    within(a.abandon(&q, &first)).await.expect("abandon");

    let mut rng = uuid::Uuid::new_v4().as_u128() as u64 | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut completed = 0usize;
    let mut tickets = Vec::new();
    for round in 0..20 {
        let mut batch = Vec::new();
        for _ in 0..10 {
            let t = Ticket::new();
            let budget = Duration::from_micros(next() % 3000);
            let how = next() % 3;
            let (a, q, t2) = (a.clone(), q.clone(), t.clone());
            batch.push(tokio::spawn(async move {
                let enq = a.enqueue(&q, &t2, EntryKind::Lock, Position::Tail, b"");
                match how {
                    0 => tokio::time::timeout(budget, enq).await.is_ok(),
                    1 => {
                        tokio::select! {
                            r = enq => r.is_ok(),
                            () = tokio::task::yield_now() => false,
                        }
                    }
                    _ => {
                        tokio::select! {
                            r = enq => r.is_ok(),
                            () = tokio::time::sleep(budget) => false,
                        }
                    }
                }
            }));
            tickets.push(t);
        }
        for h in batch {
            if within(h).await.expect("join") {
                completed += 1;
            }
        }
        // Abandon this round's tickets; every fourth round leaves them for the final pass
        // so abandons also race with later creates.
        if round % 4 != 0 {
            for t in tickets.drain(..) {
                within(a.abandon(&q, &t)).await.expect("abandon");
            }
        }
    }
    for t in tickets.drain(..) {
        within(a.abandon(&q, &t)).await.expect("abandon");
    }
    let raw = a.client().expect("client");
    // The parent is a container: once empty, the server may reap it (every second in the
    // test cluster), and a reaped parent has no children either.
    let children = match within(raw.list_children("/dropped/queue")).await {
        Ok(c) => c,
        Err(zk::Error::NoNode) => Vec::new(),
        Err(e) => panic!("list: {e}"),
    };
    eprintln!("200 enqueues, {completed} completed before their drop point");
    assert_eq!(
        children,
        Vec::<String>::new(),
        "abandon left entries behind"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn session_closed_by_another_client_resolves_lost_and_fails_later_ops() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let q = queue("expire");
    let e = add(&a, &q, EntryKind::Lock, "enqueue").await;
    let lost = a.lost(&q, &e.mine);
    // The Java trick: a second client joins the session and closes it.
    let session = a.client().expect("client").session().clone();
    let thief = within(
        zk::Client::connector()
            .with_session(session)
            .with_session_timeout(Duration::from_secs(4))
            .connect(&hosts),
    )
    .await
    .expect("join session");
    drop(thief);
    let err = within(lost).await;
    assert!(matches!(err, Error::LockLost(_)), "lost() gave {err:?}");
    let later = within(a.enqueue(&q, &Ticket::new(), EntryKind::Lock, Position::Tail, b"")).await;
    assert!(
        matches!(later, Err(Error::LockLost(_))),
        "enqueue after loss gave {later:?}"
    );
    assert!(matches!(within(a.queue(&q)).await, Err(Error::LockLost(_))));
    // The entry went with the session.
    let b = connect(&hosts, &root).await;
    assert!(within(b.queue(&q)).await.expect("queue").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_survives_a_reaped_parent() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let q = queue("reaped/lock");
    let raw = a.client().expect("client");
    for round in 0..3 {
        let done = add(&a, &q, EntryKind::Lock, "enqueue").await;
        assert_eq!(done.queue.len(), 1, "round {round}");
        within(a.remove(&q, &done.mine)).await.expect("remove");
        // Do what ZooKeeper's container reaper does to an empty parent.
        match within(raw.delete("/reaped/lock", None)).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(err) => panic!("delete parent: {err}"),
        }
        assert!(within(a.queue(&q)).await.expect("queue").is_empty());
        assert_eq!(within(a.read_value(&q)).await.expect("read_value"), None);
    }
    // Parents are containers, as Curator creates them.
    add(&a, &q, EntryKind::Lock, "enqueue").await;
    let (_, stat) = within(raw.get_data("/reaped/lock")).await.expect("stat");
    assert_eq!(stat.ephemeral_owner, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn semaphore_sub_queues_and_shared_value() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let lock = LockName::new("sem", dlock_zookeeper::NAME_RULES).expect("valid");
    let leases = QueuePath::sub(lock.clone(), "leases");
    let done = within(a.enqueue(
        &leases,
        &Ticket::new(),
        EntryKind::Lease,
        Position::Tail,
        b"l",
    ))
    .await
    .expect("enqueue lease");
    assert_eq!(done.mine.kind, EntryKind::Lease);
    let raw = a.client().expect("client");
    let children = within(raw.list_children("/sem/leases"))
        .await
        .expect("list");
    assert_eq!(children, vec![done.mine.name.clone()]);
    // The lock's own node is not an entry and is ignored; its data is the shared value.
    let count = QueuePath::root(lock);
    assert_eq!(within(a.read_value(&count)).await.expect("read"), None);
    within(raw.set_data("/sem", b"\x00\x00\x00\x03", None))
        .await
        .expect("set_data");
    assert_eq!(
        within(a.read_value(&count)).await.expect("read"),
        Some(b"\x00\x00\x00\x03".to_vec())
    );
    assert!(within(a.queue(&count)).await.expect("queue").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_changed_sees_a_new_entry() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let b = connect(&hosts, &root).await;
    let q = queue("changes");
    // Different from what the caller saw: returns at once.
    let done = add(&a, &q, EntryKind::Lease, "enqueue").await;
    within(a.wait_changed(&q, &[]))
        .await
        .expect("differs at once");
    let seen = done.queue.clone();
    let waiter = {
        let (a, q) = (a.clone(), q.clone());
        tokio::spawn(async move { a.wait_changed(&q, &seen).await })
    };
    add(&b, &q, EntryKind::Lease, "enqueue b").await;
    within(waiter).await.expect("join").expect("wait_changed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_removes_entries_and_later_ops_fail() {
    let Some(hosts) = zk_hosts() else { return };
    let root = fresh_chroot();
    let a = connect(&hosts, &root).await;
    let b = connect(&hosts, &root).await;
    let q = queue("closing");
    let e = add(&a, &q, EntryKind::Lock, "enqueue").await;
    // b's server may be a follower that trails a's (ZooKeeper reads are in order per
    // session, not across sessions): b waits to see the entry come, and then go.
    within(async {
        while b.queue(&q).await.expect("queue").len() != 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let lost = a.lost(&q, &e.mine);
    within(a.close()).await.expect("close");
    within(a.close()).await.expect("close is idempotent");
    assert!(within(lost).await.is_lost());
    within(async {
        while !b.queue(&q).await.expect("queue").is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let later = within(a.enqueue(&q, &Ticket::new(), EntryKind::Lock, Position::Tail, b"")).await;
    assert!(matches!(later, Err(Error::Closed)), "got {later:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_server_is_a_typed_error() {
    // Needs no server: nothing listens on port 1.
    let opts = SessionOptions::default().with_connect_timeout(Duration::from_secs(2));
    let got = within(ZkBackend::connect("127.0.0.1:1", opts.clone())).await;
    assert!(matches!(got, Err(Error::Unreachable(_))), "got {got:?}");
    let got = within(ZkBackend::connect("/just-a-chroot", opts)).await;
    assert!(matches!(got, Err(Error::InvalidUrl { .. })), "got {got:?}");
}

/// A TCP proxy between the client and one server that can stop forwarding, to partition
/// the client without touching the server.
struct Proxy {
    addr: SocketAddr,
    frozen: Arc<AtomicBool>,
    /// Like `frozen`, for the server-to-client direction only: requests still arrive and
    /// run, their replies are lost.
    muted: Arc<AtomicBool>,
    /// Bumped to close every open connection; the flag says whether with a reset.
    cuts: tokio::sync::watch::Sender<(u64, bool)>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    /// Closes every connection open now: cleanly (the client reads EOF, as when a server
    /// shuts down) or with `reset` (a TCP RST, as when a server process is killed).
    fn cut(&self, reset: bool) {
        self.cuts.send_modify(|(n, r)| {
            *n += 1;
            *r = reset;
        });
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn start_proxy(target: String) -> Proxy {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind proxy");
    let addr = listener.local_addr().expect("addr");
    let frozen = Arc::new(AtomicBool::new(false));
    let flag = frozen.clone();
    let muted = Arc::new(AtomicBool::new(false));
    let mute = muted.clone();
    let cuts = tokio::sync::watch::Sender::new((0u64, false));
    let cut_rx = cuts.subscribe();
    let task = tokio::spawn(async move {
        let mut conns = tokio::task::JoinSet::new();
        while let Ok((mut inbound, _)) = listener.accept().await {
            let (flag, mute, target) = (flag.clone(), mute.clone(), target.clone());
            let mut cut = cut_rx.clone();
            cut.mark_unchanged();
            conns.spawn(async move {
                let reset = tokio::select! {
                    _ = cut.changed() => cut.borrow().1,
                    () = serve_conn(&mut inbound, target, flag, mute) => false,
                };
                if reset {
                    let _ = inbound.set_zero_linger();
                }
            });
        }
    });
    Proxy {
        addr,
        frozen,
        muted,
        cuts,
        task,
    }
}

async fn serve_conn(
    inbound: &mut tokio::net::TcpStream,
    target: String,
    flag: Arc<AtomicBool>,
    mute: Arc<AtomicBool>,
) {
    if flag.load(Ordering::SeqCst) {
        // Partitioned: accept, then never answer.
        std::future::pending::<()>().await;
    }
    let Ok(outbound) = tokio::net::TcpStream::connect(&target).await else {
        return;
    };
    let (mut ri, mut wi) = inbound.split();
    let (mut ro, mut wo) = outbound.into_split();
    let up = [&*flag];
    let down = [&*flag, &*mute];
    tokio::join!(pump(&mut ri, &mut wo, &up), pump(&mut ro, &mut wi, &down));
}

/// Copies `r` to `w` until EOF; once any of `stalls` is set, swallows what it reads and stalls.
async fn pump(
    r: &mut (impl tokio::io::AsyncRead + Unpin),
    w: &mut (impl tokio::io::AsyncWrite + Unpin),
    stalls: &[&AtomicBool],
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut buf = vec![0u8; 16384];
    loop {
        let n = r.read(&mut buf).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        if stalls.iter().any(|f| f.load(Ordering::SeqCst)) {
            std::future::pending::<()>().await;
        }
        if w.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partition_past_the_local_limit_is_declared_lost() {
    let Some(hosts) = zk_hosts() else { return };
    let first = hosts.split(',').next().expect("one host").to_owned();
    let proxy = start_proxy(first).await;
    let root = fresh_chroot();
    let a = within(ZkBackend::connect(
        &format!("{}{root}", proxy.addr),
        SessionOptions::default().with_session_timeout(Duration::from_secs(2)),
    ))
    .await
    .expect("connect through proxy");
    let q = queue("partitioned");
    let e = add(&a, &q, EntryKind::Lock, "enqueue").await;
    let lost = a.lost(&q, &e.mine);
    proxy.frozen.store(true, Ordering::SeqCst);
    // zookeeper-client itself never reports this: the server is unreachable, so nothing
    // says Expired. The adapter's own timers must: the disconnection timer, or the leader
    // heartbeat, whichever fires first.
    let err = within(lost).await;
    match &err {
        Error::LockLost(reason) => assert!(
            reason.contains("disconnected") || reason.contains("leader"),
            "{reason}"
        ),
        other => panic!("lost() gave {other:?}"),
    }
    // Requests queued by the client during the partition fail instead of hanging.
    assert!(matches!(within(a.queue(&q)).await, Err(Error::LockLost(_))));
    // Heal the partition: the session must not come back holding the entry.
    proxy.frozen.store(false, Ordering::SeqCst);
    let b = connect(&hosts, &root).await;
    within(async {
        while !b.queue(&q).await.expect("queue").is_empty() {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(matches!(within(a.queue(&q)).await, Err(Error::LockLost(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_cut_off_by_a_dropped_connection_are_resent() {
    let Some(hosts) = zk_hosts() else { return };
    let first = hosts.split(',').next().expect("one host").to_owned();
    let proxy = start_proxy(first).await;
    let root = fresh_chroot();
    let a = within(ZkBackend::connect(&format!("{}{root}", proxy.addr), opts()))
        .await
        .expect("connect through proxy");
    let q = queue("flaky");
    let e = add(&a, &q, EntryKind::Lock, "enqueue").await;
    for round in 0..4 {
        // Swallow the next requests, then hang up (odd rounds: reset): their replies never
        // come, so the client fails them and reconnects.
        proxy.frozen.store(true, Ordering::SeqCst);
        let (a2, q2) = (a.clone(), q.clone());
        let listing = tokio::spawn(async move { a2.queue(&q2).await });
        tokio::time::sleep(Duration::from_millis(200)).await;
        proxy.frozen.store(false, Ordering::SeqCst);
        proxy.cut(round % 2 == 1);
        let got = within(listing).await.expect("join");
        let got = got.unwrap_or_else(|err| panic!("round {round}: queue failed: {err}"));
        assert_eq!(names(&got), vec![e.mine.name.as_str()], "round {round}");
    }
    // The session survived the reconnects: the entry is still ours, and removable.
    within(a.remove(&q, &e.mine)).await.expect("remove");
    assert!(within(a.queue(&q)).await.expect("queue").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn enqueue_whose_reply_is_lost_finds_its_entry_instead_of_duplicating() {
    let Some(hosts) = zk_hosts() else { return };
    let first = hosts.split(',').next().expect("one host").to_owned();
    let proxy = start_proxy(first).await;
    let root = fresh_chroot();
    let a = within(ZkBackend::connect(&format!("{}{root}", proxy.addr), opts()))
        .await
        .expect("connect through proxy");
    let observer = connect(&hosts, &root).await;
    let q = queue("lost-reply");
    // Create the parent first, so the create below is the one whose reply is lost.
    let warm = Ticket::new();
    within(a.enqueue(&q, &warm, EntryKind::Lock, Position::Tail, b""))
        .await
        .expect("enqueue");
    for round in 0..3 {
        let t = Ticket::new();
        proxy.muted.store(true, Ordering::SeqCst);
        let (a2, q2, t2) = (a.clone(), q.clone(), t.clone());
        let enqueue = tokio::spawn(async move {
            a2.enqueue(&q2, &t2, EntryKind::Lock, Position::Tail, b"")
                .await
        });
        // The create runs on the server even though its reply is swallowed.
        within(async {
            while !observer
                .queue(&q)
                .await
                .expect("queue")
                .iter()
                .any(|e| e.is_from(&t))
            {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        proxy.muted.store(false, Ordering::SeqCst);
        proxy.cut(round % 2 == 0);
        let done = within(enqueue)
            .await
            .expect("join")
            .unwrap_or_else(|err| panic!("round {round}: enqueue failed: {err}"));
        assert!(done.mine.is_from(&t));
        assert!(done.mine.token.is_some());
        let mine: Vec<Entry> = within(observer.queue(&q))
            .await
            .expect("queue")
            .into_iter()
            .filter(|e| e.is_from(&t))
            .collect();
        assert_eq!(
            mine.len(),
            1,
            "round {round}: the ticket has {} entries",
            mine.len()
        );
        assert_eq!(mine[0].name, done.mine.name);
    }
}
