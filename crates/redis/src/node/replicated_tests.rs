//! [`Node::replicated`] against a private primary and its replica: a `WAIT` answers for
//! its own connection's writes only, so one sent after a reconnection must not vouch
//! for writes made on the connection before. Runs when `DLOCK_TEST_REDIS` is set, as
//! the other tests on private servers do.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use dlock_core::Error;
use fred::prelude::{ClientInterface, ClientLike, KeysInterface, Value};
use tokio::time::Instant;

use super::{Node, Tuning};
use crate::tls::Access;

/// A redis-server on a free port, killed by its PID on drop.
struct Server {
    port: u16,
    child: Child,
    dir: std::path::PathBuf,
}

impl Server {
    fn start(replica_of: Option<u16>) -> Server {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let dir =
            std::env::temp_dir().join(format!("dlock-redis-unit-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut cmd = Command::new("redis-server");
        cmd.args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--dir"])
            .arg(&dir);
        if let Some(p) = replica_of {
            cmd.args(["--replicaof", "127.0.0.1", &p.to_string()]);
        }
        let child = cmd
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server did not start"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Server { port, child, dir }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Kills the node's command connection (`CLIENT KILL`, sent by `killer`) and waits
/// until fred has connected it again.
async fn reconnect(node: &Node, killer: &fred::prelude::Client) {
    let id: i64 = node.client.client_id().await.expect("CLIENT ID");
    let killed: Value = killer
        .custom(
            fred::types::CustomCommand::new_static("CLIENT", None, false),
            vec![Value::from("KILL"), Value::from("ID"), Value::from(id)],
        )
        .await
        .expect("CLIENT KILL");
    assert_eq!(
        killed,
        Value::Integer(1),
        "the node's connection was killed"
    );
    let back = Instant::now() + Duration::from_secs(10);
    while node
        .client
        .client_id::<i64>()
        .await
        .ok()
        .is_none_or(|new| new == id)
    {
        assert!(Instant::now() < back, "the node did not reconnect");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn a_wait_after_a_reconnection_vouches_for_nothing() {
    if std::env::var_os("DLOCK_TEST_REDIS").is_none() {
        eprintln!(
            "SKIPPED: a_wait_after_a_reconnection_vouches_for_nothing: DLOCK_TEST_REDIS not set"
        );
        return;
    }
    let primary = Server::start(None);
    let _replica = Server::start(Some(primary.port));
    let addr = format!("127.0.0.1:{}", primary.port);
    let tuning = Tuning {
        attempt_timeout: Duration::from_secs(1),
        command_timeout: Duration::from_secs(2),
        database: None,
    };
    let node = Node::start(&addr, tuning, &Access::default()).expect("node");
    node.wait_connected(Instant::now() + Duration::from_secs(10))
        .await
        .expect("connected");
    let wait = Duration::from_millis(500);
    // The replica is linked once a write on this connection is acknowledged.
    let linked = Instant::now() + Duration::from_secs(10);
    loop {
        let mark = node.mark();
        let _: () = node
            .client
            .set("k", "v", None, None, false)
            .await
            .expect("set");
        if node.replicated("a write", mark, 1, wait).await.is_ok() {
            break;
        }
        assert!(
            Instant::now() < linked,
            "the replica never acknowledged a write"
        );
    }

    // A reconnection between the write and its WAIT: the new connection has written
    // nothing, so WAIT there answers at once with every connected replica.
    let mark = node.mark();
    let _: () = node
        .client
        .set("k", "w", None, None, false)
        .await
        .expect("set");
    let killer = fred::prelude::Builder::from_config(
        fred::prelude::Config::from_url(&format!("redis://{addr}")).expect("url"),
    )
    .build()
    .expect("client");
    killer.init().await.expect("connect");
    reconnect(&node, &killer).await;
    let r = node.replicated("a write", mark, 1, wait).await;
    assert!(
        matches!(&r, Err(Error::Unreachable(m)) if m.contains("connection changed")),
        "a WAIT on a new connection vouched for a write of the old one: {r:?}"
    );

    // The same, where the new connection has the old one's server and ID (a server
    // restarted at the same address, or an address moved to another server, can hand
    // it out again): fred's reconnection announcement alone must refuse it.
    let mut mark = node.mark();
    let _: () = node
        .client
        .set("k", "x", None, None, false)
        .await
        .expect("set");
    reconnect(&node, &killer).await;
    mark.connection = super::sentinel::connection(&node.client);
    assert!(mark.connection.as_ref().is_some_and(|c| c.1.is_some()));
    let r = node.replicated("a write", mark, 1, wait).await;
    assert!(
        matches!(&r, Err(Error::Unreachable(m)) if m.contains("connection changed")),
        "a WAIT on a new connection with the old one's ID vouched for its write: {r:?}"
    );
    let _ = killer.quit().await;
    node.shutdown().await;
}
