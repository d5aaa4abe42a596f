//! A grant that reaches the client after its session ended is never handed out.
//!
//! A reply held up by a partition can arrive once the server has expired the session
//! and its entry, and has let the next contender in (the chaos run's etcd follower cut
//! produced it: a downgrade's read was granted 0.1 ms after its lease was found gone,
//! while another worker wrote). The acquire must fail with `LockLost` then, as its
//! session's lost signal has already fired.
//!
//! In memory, where the reply's delay and the expiry can be placed exactly: the enqueue
//! is applied at once, its reply comes 1.5 s later, and the server expires the session
//! in between.

use std::sync::Arc;
use std::time::Duration;

use dlock::{Client, DynBackend, Error, SessionOptions};
use dlock_testkit::mem::MemServer;

const SESSION: Duration = Duration::from_millis(500);
const REPLY_DELAY: Duration = Duration::from_millis(1_500);

async fn connect(server: &Arc<MemServer>) -> (Client, dlock_testkit::mem::SessionId) {
    let opts = SessionOptions::default().with_session_timeout(SESSION);
    let backend = server
        .connect(opts)
        .await
        .unwrap_or_else(|e| panic!("connect to the in-memory server: {e}"));
    let id = backend.session();
    (Client::new(backend as Arc<dyn DynBackend>), id)
}

/// Starts `acquire` with every reply delayed, expires the session once the server has
/// applied the enqueue, and checks the grant is refused and the lock is free for others.
async fn refused_after_expiry<F, Fut>(what: &str, acquire: F)
where
    F: FnOnce(Client) -> Fut,
    Fut: std::future::Future<Output = dlock::Result<dlock::LockGuard>> + Send + 'static,
{
    let server = MemServer::new();
    let (a, session) = connect(&server).await;
    server.delay_replies(session, REPLY_DELAY);
    let attempt = tokio::spawn(acquire(a.clone()));
    // The enqueue is applied at once; its reply is on its way.
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        server.expire_session(session),
        "{what}: the session was alive"
    );
    let got = attempt.await.expect("the acquire task");
    match got {
        Err(Error::LockLost(_)) => {}
        Err(other) => panic!("{what}: expected LockLost, got {other:?}"),
        Ok(g) => panic!(
            "{what}: granted token {} after the server expired the session",
            g.token().get()
        ),
    }
    let (b, _) = connect(&server).await;
    let other = b.mutex("late/grant").expect("name");
    let mut g = tokio::time::timeout(Duration::from_secs(5), other.lock())
        .await
        .expect("another client gets the lock")
        .expect("lock");
    g.release().await.expect("release");
}

#[tokio::test]
async fn a_mutex_grant_that_arrives_after_expiry_is_refused() {
    refused_after_expiry("mutex", |c| async move {
        let m = c.mutex("late/grant")?;
        m.lock().await
    })
    .await;
}

#[tokio::test]
async fn a_downgrade_that_arrives_after_expiry_is_refused() {
    let server = MemServer::new();
    let (a, session) = connect(&server).await;
    let rw = a.rwlock("late/grant").expect("name");
    let write = rw.write().await.expect("write");
    server.delay_replies(session, REPLY_DELAY);
    let attempt = {
        let rw = rw.clone();
        async move { rw.downgrade(&write).await }
    };
    let attempt = tokio::spawn(attempt);
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(server.expire_session(session), "the session was alive");
    match attempt.await.expect("the downgrade task") {
        Err(Error::LockLost(_)) => {}
        Err(other) => panic!("downgrade: expected LockLost, got {other:?}"),
        Ok(g) => panic!(
            "downgrade: read granted (token {}) after the server expired the session",
            g.token().get()
        ),
    }
    let (b, _) = connect(&server).await;
    let mut w = tokio::time::timeout(
        Duration::from_secs(5),
        b.rwlock("late/grant").expect("name").write(),
    )
    .await
    .expect("another client gets the write lock")
    .expect("write");
    w.release().await.expect("release");
}
