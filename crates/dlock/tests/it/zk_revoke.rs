//! Cooperative revocation (Curator's Revoker): a holder that took the lock revocably is
//! asked to release by writing `__REVOKE__` into its node. Checked dlock to dlock, Curator
//! to dlock, dlock to Curator, and through the CLI.

use std::time::Duration;

use dlock::Error;

use crate::curator_peer::Peer;
use crate::support::{client, eventually, leftovers, unique};

const GENEROUS: Duration = Duration::from_secs(60);

/// dlock to dlock: `Client::revoke` reaches a `lock_revocable` holder, which releases,
/// and the revoker gets the lock. A plain holder is asked too but does not notice, and a
/// waiter queued behind it is not disturbed by the payload change.
pub async fn revoke_between_dlock_clients(url: &str) {
    let name = unique("revoke");
    let a = client(url).await;
    let b = client(url).await;
    let mut g = a
        .mutex(&name)
        .expect("name")
        .lock_revocable_timeout(GENEROUS)
        .await
        .expect("lock");
    assert!(
        g.entry().data.is_empty(),
        "revocable entries carry no payload"
    );
    let requested = g.revoke_requested();
    tokio::pin!(requested);
    assert!(
        futures::poll!(&mut requested).is_pending(),
        "a revocation nobody asked for"
    );
    assert_eq!(b.revoke(&name).await.expect("revoke"), 1);
    tokio::time::timeout(GENEROUS, requested)
        .await
        .expect("the holder was asked")
        .expect("revoke_requested");
    g.release().await.expect("release");
    let mut gb = b
        .mutex(&name)
        .expect("name")
        .lock_timeout(GENEROUS)
        .await
        .expect("lock");

    // A plain holder with a waiter behind it: the request changes the holder's payload,
    // the waiter keeps waiting on it and gets the lock once it is released.
    let am = a.mutex(&name).expect("name");
    let waiter = tokio::spawn(async move { am.lock_timeout(GENEROUS).await });
    assert!(
        eventually(GENEROUS, || async { leftovers(&b, &name).await == 2 }).await,
        "the waiter never queued"
    );
    assert_eq!(a.revoke(&name).await.expect("revoke"), 1);
    assert!(matches!(
        a.mutex(&name).expect("name").try_lock().await,
        Err(Error::WouldBlock)
    ));
    assert!(
        !waiter.is_finished(),
        "a revocation request let a waiter in"
    );
    gb.release().await.expect("release");
    let mut gw = waiter.await.expect("task").expect("waiter after release");
    gw.release().await.expect("release");
    assert_eq!(a.revoke(&name).await.expect("revoke"), 0, "nobody holds it");
    a.close().await.expect("close");
    b.close().await.expect("close");
}

/// Curator's `Revoker.attemptRevoke` on a dlock holder's node reaches
/// `revoke_requested`; dlock's `Client::revoke` reaches a Curator holder made revocable
/// with `makeRevocable`, whose listener releases.
pub async fn revoke_interop_with_curator(url: &str) {
    let Some(mut java) = Peer::start(url).await else {
        return;
    };
    let name = unique("cur-revoke");
    let path = format!("/{name}");
    let a = client(url).await;

    // Curator revokes dlock.
    let mut g = a
        .mutex(&name)
        .expect("name")
        .lock_revocable_timeout(GENEROUS)
        .await
        .expect("lock");
    java.send("j1", &format!("mutex {path}")).await;
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 2 }).await,
        "the Curator waiter never queued"
    );
    let node = format!("{path}/{}", g.entry().name);
    assert_eq!(
        java.cmd("r", &format!("revoke {node}")).await,
        "REVOKE_SENT"
    );
    tokio::time::timeout(GENEROUS, g.revoke_requested())
        .await
        .expect("Curator's request reached dlock")
        .expect("revoke_requested");
    g.release().await.expect("release");
    assert_eq!(java.reply("j1").await, "ACQUIRED");
    assert_eq!(java.cmd("j1", "release").await, "RELEASED");

    // dlock revokes Curator.
    assert_eq!(
        java.cmd("j2", &format!("revocable {path}")).await,
        "ACQUIRED"
    );
    let m = a.mutex(&name).expect("name");
    assert!(matches!(m.try_lock().await, Err(Error::WouldBlock)));
    assert_eq!(a.revoke(&name).await.expect("revoke"), 1);
    assert_eq!(java.reply("j2").await, "REVOKE_REQUESTED");
    assert_eq!(java.reply("j2").await, "RELEASED");
    let mut g = m
        .lock_timeout(GENEROUS)
        .await
        .expect("lock after revocation");
    g.release().await.expect("release");
    assert!(
        eventually(GENEROUS, || async { leftovers(&a, &name).await == 0 }).await,
        "entries left"
    );
    java.quit().await;
    a.close().await.expect("close");
}

/// `dlock exec --revocable` and `dlock revoke`: the holder's command gets SIGTERM, dlock
/// exits with the command's code, and the lock is free afterwards.
pub async fn cli_revoke(url: &str) {
    let name = unique("cli-revoke");
    let dir = std::env::temp_dir().join(unique("revoke").replace('/', "-"));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (started, termed) = (dir.join("started"), dir.join("termed"));
    let script =
        r#"trap 'echo term > "$2"; exit 42' TERM; echo up > "$1"; while :; do sleep 0.1; done"#;
    let dlock = || {
        let mut c = crate::support::dlock();
        c.args(["--url", url]);
        c
    };
    let mut holder = dlock()
        .args(["exec", "--revocable", &name, "--", "sh", "-c", script, "sh"])
        .arg(&started)
        .arg(&termed)
        .spawn()
        .expect("run dlock exec");
    assert!(
        eventually(GENEROUS, || async { started.exists() }).await,
        "the command never started"
    );
    let out = dlock()
        .args(["revoke", &name])
        .output()
        .expect("run dlock revoke");
    assert!(out.status.success(), "dlock revoke: {out:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("asked 1 holder"),
        "{out:?}"
    );
    let mut status = None;
    assert!(
        eventually(GENEROUS, || {
            status = holder.try_wait().expect("wait");
            let done = status.is_some();
            async move { done }
        })
        .await,
        "the revocable holder did not end"
    );
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(42),
        "the command's own code"
    );
    assert!(termed.exists(), "the command was not SIGTERMed");
    let c = client(url).await;
    let mut g = c
        .mutex(&name)
        .expect("name")
        .try_lock()
        .await
        .expect("free after the revoked holder ended");
    g.release().await.expect("release");
    c.close().await.expect("close");
    let _ = std::fs::remove_dir_all(&dir);
}

/// An election's leader is never asked to release: `revoke` on an election asks nobody,
/// and the leader's value (its entry's payload) is left as it was. (Before, it was
/// replaced by `__REVOKE__`, and a Curator `LeaderLatch` behind the leader lost its
/// one-shot watch on the leader's node to that data change.)
pub async fn revoke_never_asks_an_election_leader(url: &str) {
    let name = unique("revoke-elect");
    let a = client(url).await;
    let b = client(url).await;
    let leading = a
        .election(&name)
        .expect("name")
        .campaign("alpha")
        .await
        .expect("campaign");
    assert_eq!(
        b.revoke(&name).await.expect("revoke"),
        0,
        "an election leader was asked to release"
    );
    let seen = b
        .election(&name)
        .expect("name")
        .leader()
        .await
        .expect("leader")
        .expect("a leader");
    assert_eq!(
        seen.value_str(),
        Some("alpha"),
        "the leader's value was overwritten"
    );
    leading.verify().await.expect("still leading");
    leading.resign().await.expect("resign");
    a.close().await.expect("close");
    b.close().await.expect("close");
}
