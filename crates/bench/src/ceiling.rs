//! Ceilings: the fewest operations one acquire and one release must make on each
//! backend, with no recipe, through the client crates (Redis: the raw wire). Run in
//! the same invocation as the recipes, they say how far dlock is from the limit.
//!
//! - ZooKeeper: create(EPHEMERAL_SEQUENTIAL) + getChildren + delete on one session
//!   (the peers' `W0s`); latency = create + getChildren.
//! - etcd: Put + DeleteRange on one connection; latency = the put.
//! - Redis: `SET k tok NX PX 10000` + `EVALSHA` of the compare-and-delete script on one
//!   connection; latency = the SET.

use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use futures::FutureExt as _;
use zookeeper_client as zk;

use crate::harness::Worker;
use crate::resp::{Conn, Reply};

/// The peers' workload label of the ZooKeeper ceiling.
pub const ZK_WORKLOAD: &str = "W0s-zk-createseq-getchildren-delete";
/// The peers' workload label of the etcd ceiling.
pub const ETCD_WORKLOAD: &str = "W0-etcd-put-delete";
/// The peers' workload label of the Redis ceiling.
pub const REDIS_WORKLOAD: &str = "W0-redis-setnx-evalsha";

/// The compare-and-delete every Redis lock releases with (redis-py's, rslock's).
const RELEASE_LUA: &str =
    "if redis.call('get',KEYS[1])==ARGV[1] then return redis.call('del',KEYS[1]) else return 0 end";

/// ZooKeeper: one session, one parent.
pub struct ZkRaw {
    c: zk::Client,
    root: String,
}

impl ZkRaw {
    /// Connects (session timeout 30 s, as Curator) and makes the parent `/<name>`.
    ///
    /// # Errors
    /// Connect or create errors, as text.
    pub async fn connect(addr: &str, name: &str) -> Result<ZkRaw, String> {
        let c = zk::Client::connector()
            .with_session_timeout(Duration::from_secs(30))
            .connect(addr)
            .await
            .map_err(|e| format!("zookeeper connect {addr}: {e}"))?;
        let root = format!("/{name}");
        let persistent = zk::CreateMode::Persistent.with_acls(zk::Acls::anyone_all());
        match c.mkdir(&root, &persistent).await {
            Ok(()) | Err(zk::Error::NodeExists) => {}
            Err(e) => return Err(format!("zookeeper mkdir {root}: {e}")),
        }
        Ok(ZkRaw { c, root })
    }
}

impl Worker for ZkRaw {
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>> {
        async move {
            let es = zk::CreateMode::EphemeralSequential.with_acls(zk::Acls::anyone_all());
            let prefix = format!("{}/lock-", self.root);
            let t = Instant::now();
            let (_, seq) = self
                .c
                .create(&prefix, b"", &es)
                .await
                .map_err(|e| format!("zookeeper create: {e}"))?;
            self.c
                .get_children(&self.root)
                .await
                .map_err(|e| format!("zookeeper getChildren: {e}"))?;
            let d = t.elapsed();
            self.c
                .delete(&format!("{prefix}{seq}"), None)
                .await
                .map_err(|e| format!("zookeeper delete: {e}"))?;
            Ok(d)
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async move {
            let _ = self.c.delete(&self.root, None).await;
        }
        .boxed()
    }
}

/// etcd: one client, one key.
pub struct EtcdRaw {
    c: etcd_client::Client,
    key: String,
}

impl EtcdRaw {
    /// Connects to `addr` (`host:port`).
    ///
    /// # Errors
    /// The connect error, as text.
    pub async fn connect(addr: &str, key: &str) -> Result<EtcdRaw, String> {
        let opts = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(5));
        let c = etcd_client::Client::connect([format!("http://{addr}")], Some(opts))
            .await
            .map_err(|e| format!("etcd connect {addr}: {e}"))?;
        Ok(EtcdRaw {
            c,
            key: key.to_owned(),
        })
    }
}

impl Worker for EtcdRaw {
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>> {
        async move {
            let t = Instant::now();
            self.c
                .put(self.key.as_str(), "v", None)
                .await
                .map_err(|e| format!("etcd put: {e}"))?;
            let d = t.elapsed();
            self.c
                .delete(self.key.as_str(), None)
                .await
                .map_err(|e| format!("etcd delete: {e}"))?;
            Ok(d)
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async {}.boxed()
    }
}

/// Redis: one connection, the release script loaded once.
pub struct RedisRaw {
    c: Conn,
    key: String,
    sha: Vec<u8>,
}

impl RedisRaw {
    /// Connects and loads the release script.
    ///
    /// # Errors
    /// Connect or `SCRIPT LOAD` errors, as text.
    pub async fn connect(addr: &str, key: &str) -> Result<RedisRaw, String> {
        let mut c = Conn::connect(addr).await?;
        let sha = match c.cmd(&[b"SCRIPT", b"LOAD", RELEASE_LUA.as_bytes()]).await? {
            Reply::Bulk(Some(sha)) => sha,
            other => return Err(format!("SCRIPT LOAD answered {other:?}")),
        };
        Ok(RedisRaw {
            c,
            key: key.to_owned(),
            sha,
        })
    }
}

impl Worker for RedisRaw {
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>> {
        async move {
            let key = self.key.as_bytes();
            let t = Instant::now();
            let r = self
                .c
                .cmd(&[b"SET", key, b"tok", b"NX", b"PX", b"10000"])
                .await?;
            let d = t.elapsed();
            if r != Reply::Simple("OK".into()) {
                return Err(format!("SET NX PX did not take the free key: {r:?}"));
            }
            match self
                .c
                .cmd(&[b"EVALSHA", &self.sha, b"1", key, b"tok"])
                .await?
            {
                Reply::Int(1) => Ok(d),
                other => Err(format!("release script answered {other:?}")),
            }
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async {}.boxed()
    }
}
