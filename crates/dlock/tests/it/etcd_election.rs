//! Wire compatibility of dlock's election with Go's `concurrency.Election`, proved
//! against the real `etcdctl elect` (Debian's etcd-client, etcd 3.4): a candidate is the
//! key `NAME/<lease hex>` whose value is the proposal alone, ordered by create revision.

// The etcd-only tests are not instantiated without the etcd feature.
#![cfg_attr(not(feature = "etcd"), allow(dead_code, unused_imports))]

use std::process::Stdio;
use std::time::Duration;

use dlock::Error;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use crate::election::queued;
use crate::faults::{first_endpoint, ETCD_FAULTS};
use crate::support::{client, eventually, leftovers, unique, Kind};

const GENEROUS: Duration = Duration::from_secs(30);
const SHORT: Duration = Duration::from_millis(500);

/// One `etcdctl elect` process and the lines it prints. Killed when dropped.
struct Etcdctl {
    child: Child,
    lines: mpsc::UnboundedReceiver<String>,
    /// Every line read so far.
    seen: Vec<String>,
}

impl Etcdctl {
    /// `etcdctl elect ARGS...` on the first endpoint of `url`.
    fn elect(url: &str, args: &[&str]) -> Etcdctl {
        let mut child = Command::new("etcdctl")
            .env("ETCDCTL_API", "3")
            .arg(format!("--endpoints={}", first_endpoint(url)))
            .arg("elect")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn etcdctl (Debian package etcd-client)");
        let stdout = child.stdout.take().expect("piped stdout");
        let (tx, lines) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            let mut out = BufReader::new(stdout).lines();
            while let Ok(Some(line)) = out.next_line().await {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Etcdctl {
            child,
            lines,
            seen: Vec::new(),
        }
    }

    /// Waits up to `limit` for a line equal to `want`; the lines before it are skipped.
    async fn prints(&mut self, want: &str, limit: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            match tokio::time::timeout_at(deadline, self.lines.recv()).await {
                Ok(Some(line)) => {
                    let found = line == want;
                    self.seen.push(line);
                    if found {
                        return true;
                    }
                }
                Ok(None) | Err(_) => return false,
            }
        }
    }

    /// Every line printed so far.
    fn printed(&mut self) -> Vec<String> {
        while let Ok(line) = self.lines.try_recv() {
            self.seen.push(line);
        }
        self.seen.clone()
    }

    /// SIGTERM, as a user's Ctrl-C: `etcdctl elect` resigns (or withdraws) and exits.
    async fn stop(mut self) -> Option<i32> {
        if let Some(pid) = self.child.id() {
            let _ = std::process::Command::new("kill")
                .args(["-TERM", &pid.to_string()])
                .status();
        }
        tokio::time::timeout(GENEROUS, self.child.wait())
            .await
            .ok()?
            .ok()?
            .code()
    }
}

/// `etcdctl elect NAME PROPOSAL` and dlock's election exclude each other in both
/// directions and hand over to each other; `etcdctl elect -l NAME` shows the values
/// dlock campaigns with and proclaims (the raw value, no dlock header), and dlock's
/// `leader()` shows etcdctl's proposal.
pub async fn etcdctl_elect_interop(_kind: Kind, url: &str) {
    let _one = ETCD_FAULTS.lock().await;
    let name = unique("etcdctl-elect");
    let a = client(url).await;
    let b = client(url).await;
    let ea = a.election(&name).expect("name");
    let eb = b.election(&name).expect("name");

    // etcdctl leads: dlock cannot, leaves nothing, and names etcdctl's proposal.
    let mut go1 = Etcdctl::elect(url, &[&name, "go-1"]);
    assert!(
        go1.prints("go-1", GENEROUS).await,
        "etcdctl was never elected"
    );
    assert!(matches!(
        ea.try_campaign("dlock-a").await,
        Err(Error::WouldBlock)
    ));
    match ea.campaign_timeout("dlock-a", SHORT).await {
        Err(Error::Timeout(_)) => {}
        other => panic!("dlock was elected while etcdctl leads: {other:?}"),
    }
    let leader = ea.leader().await.expect("leader").expect("etcdctl leads");
    assert_eq!(leader.value_str(), Some("go-1"));
    assert_eq!(
        leftovers(&a, &name).await,
        1,
        "the timed-out dlock left a key"
    );

    let mut observer = Etcdctl::elect(url, &["-l", &name]);
    assert!(
        observer.prints("go-1", GENEROUS).await,
        "elect -l never named go-1"
    );

    // dlock queues behind etcdctl, and leads once etcdctl resigns.
    let waiting = tokio::spawn({
        let eb = eb.clone();
        async move { eb.campaign("dlock-b").await }
    });
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 2 }).await,
        "dlock's candidate never queued"
    );
    tokio::time::sleep(SHORT).await;
    assert!(
        !waiting.is_finished(),
        "dlock was elected while etcdctl led"
    );
    assert_eq!(
        go1.stop().await,
        Some(0),
        "etcdctl elect did not resign cleanly"
    );
    let lead = tokio::time::timeout(GENEROUS, waiting)
        .await
        .expect("dlock elected after etcdctl resigned")
        .expect("task")
        .expect("campaign");
    // Go's Leader/Observe read dlock's value as it is: no dlock header around it.
    assert!(
        observer.prints("dlock-b", GENEROUS).await,
        "elect -l never named dlock-b"
    );
    lead.proclaim("dlock-b2").await.expect("proclaim on etcd");
    assert!(
        observer.prints("dlock-b2", GENEROUS).await,
        "elect -l never showed the proclaimed value"
    );
    let seen = ea.leader().await.expect("leader").expect("dlock leads");
    assert_eq!(
        (seen.value_str(), seen.term),
        (Some("dlock-b2"), lead.term())
    );

    // etcdctl queues behind dlock: it must not be elected while dlock leads.
    let mut go2 = Etcdctl::elect(url, &[&name, "go-2"]);
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 2 }).await,
        "etcdctl's candidate never queued"
    );
    assert!(
        !go2.prints("go-2", Duration::from_secs(2)).await,
        "etcdctl was elected while dlock led"
    );
    lead.verify().await.expect("dlock still leads");
    lead.resign().await.expect("resign");
    assert!(
        go2.prints("go-2", GENEROUS).await,
        "etcdctl never led after dlock resigned"
    );
    let seen = eb.leader().await.expect("leader").expect("etcdctl leads");
    assert_eq!(seen.value_str(), Some("go-2"));
    assert!(matches!(
        eb.try_campaign("dlock-b").await,
        Err(Error::WouldBlock)
    ));
    assert_eq!(
        go2.stop().await,
        Some(0),
        "etcdctl elect did not resign cleanly"
    );
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "keys left behind"
    );
    let shown = observer.printed();
    assert!(
        shown.iter().all(|l| !l.starts_with("dlock1 ")),
        "elect -l showed dlock's value header: {shown:?}"
    );
    let _ = observer.stop().await;
}

/// An enqueue whose put was applied but whose answer was lost, retried: the retry finds
/// the candidate's key `NAME/<lease hex>` already there with a raw value (Go's layout
/// names no ticket), exactly as the first attempt left it. That state is made here by
/// putting the key as the first attempt did, on the session's own lease, with the value
/// being campaigned with; a candidate of another session then queues behind it, as one
/// that came while the answer was lost. The campaign must end with exactly one entry
/// under the key, with the right value, queued anew (behind the other candidate, with a
/// newer create revision than the first attempt's), and once both resign nothing is
/// left: no second key, no stray copy.
pub async fn lost_enqueue_reply_leaves_one_raw_candidate(_kind: Kind, url: &str) {
    #[cfg(feature = "etcd")]
    {
        use dlock::backends::{etcd_client, EtcdBackend};
        let hosts: Vec<String> = url
            .strip_prefix("etcd://")
            .expect("an etcd URL")
            .split(',')
            .map(str::to_owned)
            .collect();
        let opts = dlock::SessionOptions::default().with_session_timeout(GENEROUS);
        let backend = EtcdBackend::connect(&hosts, opts).await.expect("connect");
        let lease = backend.lease_id();
        let a = dlock::Client::from_backend(backend);
        let b = client(url).await;
        let mut raw = etcd_client::Client::connect(&hosts, None)
            .await
            .expect("etcd client");
        let name = unique("elect-lost-reply");
        let key = format!("{name}/{lease:x}");
        let first = raw
            .put(
                key.as_str(),
                "proposal-a",
                Some(etcd_client::PutOptions::new().with_lease(lease)),
            )
            .await
            .expect("the first attempt's put");
        let first_rev = first.header().map(|h| h.revision()).expect("a header");
        let eb = b.election(&name).expect("name");
        let lb = tokio::spawn(async move { eb.campaign("proposal-b").await });
        queued(&b, &name, 2).await;

        let ea = a.election(&name).expect("name");
        let campaign_a = tokio::spawn(async move { ea.campaign("proposal-a").await });
        // The first attempt's copy goes, so B leads; A's one entry waits behind it.
        let lb = tokio::time::timeout(GENEROUS, lb)
            .await
            .expect("B leads once the first attempt's copy is gone")
            .expect("task")
            .expect("campaign");
        queued(&b, &name, 2).await;
        let listing = raw
            .get(
                format!("{name}/"),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("get");
        let mine: Vec<_> = listing
            .kvs()
            .iter()
            .filter(|kv| kv.lease() == lease)
            .collect();
        assert_eq!(
            mine.len(),
            1,
            "one key of A's lease: {:?}",
            listing
                .kvs()
                .iter()
                .map(|kv| kv.key_str().unwrap_or("?").to_owned())
                .collect::<Vec<_>>()
        );
        assert_eq!(mine[0].key(), key.as_bytes(), "Go's election key");
        assert_eq!(
            mine[0].value(),
            b"proposal-a",
            "the raw value, as campaigned"
        );
        assert!(
            mine[0].create_revision() > first_rev,
            "queued anew: created at {} after the first attempt's {first_rev}",
            mine[0].create_revision()
        );
        assert_eq!(listing.kvs().len(), 2, "A's entry and B's");
        lb.resign().await.expect("resign");
        let la = tokio::time::timeout(GENEROUS, campaign_a)
            .await
            .expect("A leads after B")
            .expect("task")
            .expect("campaign");
        let seen = a.election(&name).expect("name").leader().await;
        let seen = seen.expect("leader").expect("a leader");
        assert_eq!(
            (seen.value_str(), seen.term),
            (Some("proposal-a"), la.term())
        );
        assert_eq!(
            la.term().get(),
            u64::try_from(mine[0].create_revision()).expect("a revision"),
            "the term is the one entry's create revision"
        );
        la.resign().await.expect("resign");
        assert!(
            eventually(GENEROUS, || async { leftovers(&b, &name).await == 0 }).await,
            "nothing left after both resigned"
        );
        let left = raw
            .get(
                format!("{name}/"),
                Some(etcd_client::GetOptions::new().with_prefix()),
            )
            .await
            .expect("get");
        assert!(left.kvs().is_empty(), "no stray key: {:?}", left.kvs());
        a.close().await.expect("close");
        b.close().await.expect("close");
    }
    #[cfg(not(feature = "etcd"))]
    let _ = url;
}
