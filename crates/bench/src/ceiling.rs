//! Ceilings: the fewest operations one acquire and one release must make on each
//! backend, with no recipe, through the client crates (Redis: the raw wire). Run in
//! the same invocation as the recipes, they say how far dlock is from the limit.
//!
//! - ZooKeeper: create(EPHEMERAL_SEQUENTIAL) + getChildren + delete on one session
//!   (the peers' `W0s`); latency = create + getChildren.
//! - etcd: Put + DeleteRange on one connection; latency = the put.
//! - Redis: `SET k tok NX PX 10000` + `EVALSHA` of the compare-and-delete script on one
//!   connection; latency = the SET.
//! - Redis through fred (`W0f`, and `W3f` with `--workers` workers on keys and clients
//!   of their own, only when `--only` names them): the same two commands sent by the
//!   client crate dlock's Redis adapter is built on, configured as the adapter
//!   configures it (one attempt, a command timeout). Beside rslock's W1 and W3 (the
//!   same two commands through redis-rs) they are the floor of what any lock on this
//!   client crate can reach: what they cost over the raw wire is the client's, not
//!   dlock's.
//! - Redis, dlock's own fast path through fred (`W0d`, and `W3d` with `--workers`
//!   workers on names of their own, only when `--only` names them): the adapter's two
//!   uncontended scripts (`ACQUIRE_SOLO`, `RELEASE_SOLO`) sent as `W0f` sends its
//!   commands, with no recipe and no adapter around them. Beside W1 (and W3) it splits
//!   dlock's cost into what its protocol on this client crate costs and what its own
//!   layers add.
//! - Redis, the cheapest acquire that reads the server's clock in the same atomic step as
//!   its `SET NX` without a script (`W0m`, and `W3m` with `--workers` workers, only when
//!   `--only` names them): `MULTI`, `SET NX PX`, `TIME`, `EXEC` in one round trip through
//!   fred's transactions, then rslock's release. Beside `W0d`/`W3d` it says whether a
//!   script-free acquire with a server-clock fencing token would lower the floor of
//!   dlock's protocol (it does not put the token into the value, so it is not a lock
//!   dlock could send as it stands).
//! - etcd, a semaphore without an internal mutex (`W4r`, only when `--only` names it):
//!   each worker keeps one key under the semaphore's prefix, created with its lease
//!   and read back with the whole prefix in one transaction; it holds a permit while
//!   fewer than `permits` keys were created before its own, and waits for deletes of
//!   those on one prefix watch it keeps armed (so always synced). Two synced writes per
//!   permit (the put, the delete), as a W2 handoff: what W4 could reach on etcd without
//!   Curator's layout (an internal mutex, a lease created under it).

use std::collections::HashSet;
use std::sync::Arc;
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
/// The label of the etcd semaphore without an internal mutex.
pub const ETCD_RANKED_WORKLOAD: &str = "W4r-etcd-ranked-semaphore";
/// The peers' workload label of the Redis ceiling.
pub const REDIS_WORKLOAD: &str = "W0-redis-setnx-evalsha";
/// The label of the same commands sent through fred.
pub const REDIS_FRED_WORKLOAD: &str = "W0f-redis-fred-setnx-evalsha";
/// The same with `--workers` workers, each on a key and a client of its own (W3's shape).
pub const REDIS_FRED_W3_WORKLOAD: &str = "W3f-redis-fred-setnx-evalsha";
/// The label of dlock's fast-path scripts sent through fred, one worker.
pub const REDIS_FRED_DLOCK_WORKLOAD: &str = "W0d-redis-fred-dlock-fast-path";
/// The same with `--workers` workers, each on a key and a client of its own (W3's shape).
pub const REDIS_FRED_DLOCK_W3_WORKLOAD: &str = "W3d-redis-fred-dlock-fast-path";
/// The label of the cheapest acquire that reads the server's clock atomically with its
/// `SET NX` without a script (`MULTI`, `SET NX PX`, `TIME`, `EXEC`), then rslock's
/// release, through fred, one worker.
pub const REDIS_FRED_MULTI_WORKLOAD: &str = "W0m-redis-fred-multi-setnx-time";
/// The same with `--workers` workers, each on a key and a client of its own (W3's shape).
pub const REDIS_FRED_MULTI_W3_WORKLOAD: &str = "W3m-redis-fred-multi-setnx-time";

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

/// A client of the etcd at `addr` (`host:port`), as every etcd ceiling connects.
async fn etcd_connect(addr: &str) -> Result<etcd_client::Client, String> {
    let opts = etcd_client::ConnectOptions::new().with_connect_timeout(Duration::from_secs(5));
    etcd_client::Client::connect([format!("http://{addr}")], Some(opts))
        .await
        .map_err(|e| format!("etcd connect {addr}: {e}"))
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
        let c = etcd_connect(addr).await?;
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

/// etcd, a semaphore without an internal mutex: one worker (client, lease, key, kept
/// watch) of it.
pub struct EtcdRanked {
    c: etcd_client::Client,
    prefix: String,
    key: String,
    lease: i64,
    permits: usize,
    stream: etcd_client::WatchStream,
    shared: Arc<crate::harness::Shared>,
}

impl EtcdRanked {
    /// Connects to `addr`, grants a lease and arms the prefix watch (deletes only).
    ///
    /// # Errors
    /// A failed connect, grant or watch, as text.
    pub async fn connect(
        addr: &str,
        prefix: &str,
        permits: u32,
        shared: Arc<crate::harness::Shared>,
    ) -> Result<EtcdRanked, String> {
        use etcd_client::{WatchFilterType, WatchOptions};
        let mut c = etcd_connect(addr).await?;
        let lease = c
            .lease_grant(60, None)
            .await
            .map_err(|e| format!("etcd lease: {e}"))?
            .id();
        let prefix = format!("{prefix}/");
        let stream = c
            .watch(
                prefix.as_str(),
                Some(
                    WatchOptions::new()
                        .with_prefix()
                        .with_filters([WatchFilterType::NoPut]),
                ),
            )
            .await
            .map_err(|e| format!("etcd watch: {e}"))?;
        Ok(EtcdRanked {
            key: format!("{prefix}{lease:x}"),
            c,
            prefix,
            lease,
            permits: permits as usize,
            stream,
            shared,
        })
    }
}

impl Worker for EtcdRanked {
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>> {
        use etcd_client::{Compare, CompareOp, GetOptions, PutOptions, SortOrder, SortTarget};
        use etcd_client::{Txn, TxnOp, TxnOpResponse};
        async move {
            let t = Instant::now();
            let list = || {
                TxnOp::get(
                    self.prefix.as_str(),
                    Some(
                        GetOptions::new()
                            .with_prefix()
                            .with_keys_only()
                            .with_sort(SortTarget::Create, SortOrder::Ascend),
                    ),
                )
            };
            let txn = Txn::new()
                .when([Compare::create_revision(
                    self.key.as_str(),
                    CompareOp::Equal,
                    0,
                )])
                .and_then([
                    TxnOp::put(
                        self.key.as_str(),
                        "",
                        Some(PutOptions::new().with_lease(self.lease)),
                    ),
                    list(),
                ])
                .or_else([list()]);
            let resp = self
                .c
                .txn(txn)
                .await
                .map_err(|e| format!("etcd txn: {e}"))?;
            let rev = resp.header().map_or(0, |h| h.revision());
            let mut ahead: HashSet<Vec<u8>> = HashSet::new();
            for op in resp.op_responses() {
                if let TxnOpResponse::Get(g) = op {
                    for kv in g.kvs() {
                        if kv.key() == self.key.as_bytes() {
                            break;
                        }
                        ahead.insert(kv.key().to_vec());
                    }
                }
            }
            // Every delete after the read comes on the kept watch, in order.
            while ahead.len() >= self.permits {
                let msg = self
                    .stream
                    .message()
                    .await
                    .map_err(|e| format!("etcd watch: {e}"))?
                    .ok_or("etcd watch ended")?;
                for ev in msg.events() {
                    if let Some(kv) = ev.kv() {
                        if kv.mod_revision() > rev {
                            ahead.remove(kv.key());
                        }
                    }
                }
            }
            let d = t.elapsed();
            self.shared.sem_section(self.permits as u32);
            self.c
                .delete(self.key.as_str(), None)
                .await
                .map_err(|e| format!("etcd delete: {e}"))?;
            Ok(d)
        }
        .boxed()
    }

    fn close(mut self: Box<Self>) -> BoxFuture<'static, ()> {
        async move {
            let _ = self.c.lease_revoke(self.lease).await;
        }
        .boxed()
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

/// What [`RedisFred`] sends per acquire + release.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FredCommands {
    /// `SET NX PX` and the compare-and-delete script: rslock's pair (`W0f`).
    Rslock,
    /// The adapter's fast-path scripts (`W0d`), as it loads them for a 10 s lease.
    DlockFastPath,
    /// `SET NX PX` and `TIME` in one `MULTI`/`EXEC`, then rslock's compare-and-delete
    /// (`W0m`): a server-clock token read atomically with the `SET NX` with no script.
    /// The token does not go into the value (a transaction cannot compute one command's
    /// argument from another's reply), so this is a floor, not a lock dlock could send.
    MultiTime,
}

/// The name prefix a [`FredCommands::DlockFastPath`] entry carries, in the adapter's
/// form and length (`Ticket::name_prefix`: the protected ticket, then `lock-`).
const FAST_PATH_PREFIX: &str = "_c_01234567-89ab-cdef-0123-456789abcdef-lock-";

/// Redis through fred: one client, its scripts loaded once, every command sent with the
/// options dlock's adapter sends its own with (one attempt, a 5 s timeout).
pub struct RedisFred {
    c: fred::prelude::Client,
    opts: fred::types::config::Options,
    key: String,
    commands: FredCommands,
    /// The release script (`Rslock`), or the acquire script (`DlockFastPath`).
    sha: String,
    /// The fast path's release script.
    release_sha: String,
}

impl RedisFred {
    /// Connects and loads the scripts `commands` sends.
    ///
    /// # Errors
    /// Connect or `SCRIPT LOAD` errors, as text.
    pub async fn connect(
        addr: &str,
        key: &str,
        commands: FredCommands,
    ) -> Result<RedisFred, String> {
        use fred::prelude::{ClientLike as _, LuaInterface as _};
        let config = fred::prelude::Config::from_url(&format!("redis://{addr}"))
            .map_err(|e| format!("fred config {addr}: {e}"))?;
        let timeout = Duration::from_secs(5);
        let c = fred::prelude::Builder::from_config(config)
            .with_performance_config(|p| p.default_command_timeout = timeout)
            .with_connection_config(|c| {
                c.connection_timeout = timeout;
                c.internal_command_timeout = timeout;
                c.max_command_attempts = 1;
            })
            .build()
            .map_err(|e| format!("fred client {addr}: {e}"))?;
        c.init()
            .await
            .map_err(|e| format!("fred connect {addr}: {e}"))?;
        let (first, second) = match commands {
            FredCommands::Rslock | FredCommands::MultiTime => {
                (RELEASE_LUA.to_owned(), String::new())
            }
            FredCommands::DlockFastPath => dlock_redis::fast_path_lua(10_000),
        };
        let sha: String = c
            .script_load(first)
            .await
            .map_err(|e| format!("fred SCRIPT LOAD: {e}"))?;
        let release_sha: String = if second.is_empty() {
            String::new()
        } else {
            c.script_load(second)
                .await
                .map_err(|e| format!("fred SCRIPT LOAD: {e}"))?
        };
        let opts = fred::types::config::Options {
            max_attempts: Some(1),
            timeout: Some(timeout),
            ..Default::default()
        };
        Ok(RedisFred {
            c,
            opts,
            key: key.to_owned(),
            commands,
            sha,
            release_sha,
        })
    }
}

impl Worker for RedisFred {
    fn iter(&mut self) -> BoxFuture<'_, Result<Duration, String>> {
        use fred::prelude::{ClientLike as _, KeysInterface as _, LuaInterface as _};
        use fred::types::{Expiration, SetOptions};
        async move {
            let c = self.c.with_options(&self.opts);
            let t = Instant::now();
            if self.commands == FredCommands::DlockFastPath {
                let token: Option<String> = c
                    .evalsha(
                        self.sha.as_str(),
                        self.key.as_str(),
                        fred::types::Value::from(FAST_PATH_PREFIX),
                    )
                    .await
                    .map_err(|e| format!("fast-path acquire: {e}"))?;
                let d = t.elapsed();
                let Some(token) = token else {
                    return Err("the fast-path acquire did not take the free key".into());
                };
                let value = format!("{FAST_PATH_PREFIX}{token} {token} ");
                let n: i64 = c
                    .evalsha(self.release_sha.as_str(), self.key.as_str(), value)
                    .await
                    .map_err(|e| format!("fast-path release: {e}"))?;
                if n != 1 {
                    return Err(format!("fast-path release answered {n}"));
                }
                return Ok(d);
            }
            let d = if self.commands == FredCommands::MultiTime {
                use fred::prelude::TransactionInterface as _;
                let trx = c.multi();
                let queued: Result<(), _> = trx
                    .set(
                        self.key.as_str(),
                        "tok",
                        Some(Expiration::PX(10_000)),
                        Some(SetOptions::NX),
                        false,
                    )
                    .await;
                queued.map_err(|e| format!("MULTI SET NX PX: {e}"))?;
                let queued: Result<(), _> = trx
                    .custom(
                        fred::types::CustomCommand::new_static("TIME", None, false),
                        Vec::<String>::new(),
                    )
                    .await;
                queued.map_err(|e| format!("MULTI TIME: {e}"))?;
                let (set, time): (Option<String>, Vec<String>) = trx
                    .exec(true)
                    .await
                    .map_err(|e| format!("MULTI/EXEC: {e}"))?;
                if set.as_deref() != Some("OK") || time.len() != 2 {
                    return Err(format!(
                        "MULTI/EXEC did not take the free key: {set:?} {time:?}"
                    ));
                }
                t.elapsed()
            } else {
                let r: Option<String> = c
                    .set(
                        self.key.as_str(),
                        "tok",
                        Some(Expiration::PX(10_000)),
                        Some(SetOptions::NX),
                        false,
                    )
                    .await
                    .map_err(|e| format!("SET NX PX: {e}"))?;
                if r.as_deref() != Some("OK") {
                    return Err(format!("SET NX PX did not take the free key: {r:?}"));
                }
                t.elapsed()
            };
            let n: i64 = c
                .evalsha(self.sha.as_str(), self.key.as_str(), "tok")
                .await
                .map_err(|e| format!("release script: {e}"))?;
            if n != 1 {
                return Err(format!("release script answered {n}"));
            }
            Ok(d)
        }
        .boxed()
    }

    fn close(self: Box<Self>) -> BoxFuture<'static, ()> {
        async move {
            use fred::prelude::ClientLike as _;
            let _ = self.c.quit().await;
        }
        .boxed()
    }
}
