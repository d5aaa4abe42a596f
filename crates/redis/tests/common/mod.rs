//! Shared test helpers: endpoints from the environment (skip or fail when missing),
//! private throw-away Redis servers for fault tests, and a raw inspection client.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Backend, Enqueued, Entry, EntryKind, Error, LockName, Position, QueuePath, SessionOptions,
};
use dlock_redis::RedisBackend;
use fred::prelude::{Builder, ClientLike, Config, KeysInterface};

/// Reads `var`; when it is missing, panics if `CI` is set, otherwise prints a loud SKIPPED
/// line and returns `None`.
pub fn endpoint(var: &str, test: &str) -> Option<String> {
    match std::env::var(var) {
        Ok(v) if !v.trim().is_empty() => Some(v.trim().to_owned()),
        _ => {
            if std::env::var_os("CI").is_some() {
                panic!("{test}: {var} is not set, and CI is: refusing to skip");
            }
            eprintln!("SKIPPED: {test}: {var} not set");
            None
        }
    }
}

pub fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_test_writer()
        .try_init();
}

/// A fresh lock queue for one test, so that tests sharing a server never meet.
pub fn fresh_queue(test: &str) -> QueuePath {
    let name = format!("test/{test}/{}", dlock_testkit::ticket().as_str());
    QueuePath::root(LockName::new(&name, dlock_redis::NAME_RULES).expect("valid test lock name"))
}

pub fn opts(lease: Duration) -> SessionOptions {
    SessionOptions::default()
        .with_session_timeout(lease)
        .with_connect_timeout(Duration::from_secs(5))
}

pub async fn connect(addr: &str, lease: Duration) -> Arc<RedisBackend> {
    RedisBackend::connect(addr, opts(lease))
        .await
        .expect("connect to redis")
}

/// The enqueue most tests make: a lock entry at the tail of `q`, a new ticket, no data.
pub async fn enqueue_lock(b: &RedisBackend, q: &QueuePath) -> Result<Enqueued, Error> {
    b.enqueue(
        q,
        &dlock_testkit::ticket(),
        EntryKind::Lock,
        Position::Tail,
        b"",
    )
    .await
}

/// `b.wait_gone(q, entry)` in a task of its own, for a test that acts while it waits.
pub fn spawn_wait_gone(
    b: &Arc<RedisBackend>,
    q: &QueuePath,
    entry: &Entry,
) -> tokio::task::JoinHandle<Result<(), Error>> {
    let (b, q, entry) = (b.clone(), q.clone(), entry.clone());
    tokio::spawn(async move { b.wait_gone(&q, &entry).await })
}

/// Waits at most `limit` for a [`spawn_wait_gone`] task to end; panics with `what` if it
/// does not, or if the wait failed.
pub async fn woken(
    waiter: tokio::task::JoinHandle<Result<(), Error>>,
    limit: Duration,
    what: &str,
) {
    tokio::time::timeout(limit, waiter)
        .await
        .expect(what)
        .expect("join")
        .expect("wait_gone");
}

/// A plain fred client for looking at keys behind the backend's back.
pub async fn inspector(addr: &str) -> fred::prelude::Client {
    let c = Builder::from_config(Config::from_url(&format!("redis://{addr}")).expect("url"))
        .build()
        .expect("build inspector");
    c.init().await.expect("inspector connects");
    c
}

/// Every key matching `pattern` (SCAN, so it works on a busy server).
pub async fn scan_keys(c: &fred::prelude::Client, pattern: &str) -> Vec<String> {
    let mut cursor = "0".to_owned();
    let mut out = Vec::new();
    loop {
        let (next, keys): (String, Vec<String>) = c
            .custom(
                fred::cmd!("SCAN"),
                vec![
                    cursor.clone(),
                    "MATCH".into(),
                    pattern.into(),
                    "COUNT".into(),
                    "1000".into(),
                ],
            )
            .await
            .expect("scan");
        out.extend(keys);
        if next == "0" {
            return out;
        }
        cursor = next;
    }
}

pub async fn key_exists(c: &fred::prelude::Client, key: &str) -> bool {
    let n: i64 = c.exists(key).await.expect("exists");
    n > 0
}

/// Escapes glob characters of a lock name for SCAN MATCH.
pub fn glob_escape(s: &str) -> String {
    s.chars()
        .flat_map(|c| match c {
            '*' | '?' | '[' | ']' | '\\' => vec!['\\', c],
            c => vec![c],
        })
        .collect()
}

/// Polls `cond` every 50 ms until it holds or `limit` passes; returns whether it held.
pub async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = tokio::time::Instant::now() + limit;
    loop {
        if cond().await {
            return true;
        }
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A private redis-server owned by one test, on a free port, persistence off. Killed by
/// its own PID (never by name), on drop too.
pub struct TestServer {
    pub port: u16,
    dir: PathBuf,
    child: Option<Child>,
    /// `--replicaof 127.0.0.1 <port>` for a replica ([`TestServer::start_replica_of`]).
    replica_of: Option<u16>,
}

impl TestServer {
    pub fn start() -> TestServer {
        Self::start_with(None)
    }

    /// A replica of `primary`, once its replication link is up.
    pub fn start_replica_of(primary: &TestServer) -> TestServer {
        let r = Self::start_with(Some(primary.port));
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let info = dlock_testkit::redis_query(
                &r.addr(),
                &["INFO", "replication"],
                Duration::from_secs(1),
            )
            .unwrap_or_default();
            if info.contains("master_link_status:up") {
                return r;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the replica on {} did not link to {}: {info}",
                r.port,
                primary.port
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    fn start_with(replica_of: Option<u16>) -> TestServer {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
            l.local_addr().expect("local addr").port()
        };
        let dir =
            std::env::temp_dir().join(format!("dlock-redis-test-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let mut s = TestServer {
            port,
            dir,
            child: None,
            replica_of,
        };
        s.restart();
        s
    }

    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts (again) on the same port, with an empty data set.
    pub fn restart(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--loglevel",
                "warning",
                "--dir",
            ])
            .arg(&self.dir)
            .args(self.replica_of.iter().flat_map(|p| {
                [
                    "--replicaof".to_owned(),
                    "127.0.0.1".to_owned(),
                    p.to_string(),
                ]
            }))
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn redis-server (is it installed?)");
        self.child = Some(child);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server on {} did not start",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// This server's PID.
    pub fn pid(&self) -> u32 {
        self.child.as_ref().expect("server running").id()
    }

    /// Sends `signal` (e.g. `STOP`, `CONT`) to this server by PID.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("server running").id();
        let ok = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(pid.to_string())
            .status()
            .expect("run kill")
            .success();
        assert!(ok, "kill -{signal} {pid}");
    }

    /// SIGKILL by PID and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if self.child.is_some() {
            // A stopped server must be continued to die promptly on SIGKILL's reap.
            let _ = Command::new("kill")
                .arg("-CONT")
                .arg(
                    self.child
                        .as_ref()
                        .map(|c| c.id().to_string())
                        .unwrap_or_default(),
                )
                .status();
        }
        self.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The queue key of `q`, whose slot is the lock's.
pub fn queue_key(q: &QueuePath) -> String {
    format!("dlock:{{{}}}:q", q.lock.as_str())
}

/// A fresh queue whose slot the master `master` serves.
pub fn queue_on(state: &dlock_testkit::State, master: u32, test: &str) -> QueuePath {
    for _ in 0..10_000 {
        let q = fresh_queue(test);
        if state.redis_cluster_master_of(&queue_key(&q)).ok() == Some(master) {
            return q;
        }
    }
    panic!("no lock name found on master {master}");
}
