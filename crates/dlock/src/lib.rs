//! Distributed locks for Rust: the locks one process gets from `std::sync`, for services
//! that run on many machines — over ZooKeeper, etcd or Redis, behind one API.
//!
//! # Where to start
//! [`connect`] a [`Client`] from a URL, then take a recipe from it:
//!
//! ```no_run
//! # async fn demo() -> Result<(), dlock::Error> {
//! let client = dlock::connect("zk://127.0.0.1:2181").await?;
//! let mutex = client.mutex("orders/42")?;
//! let mut guard = mutex.lock().await?;
//! // Hand the fencing token to the storage you protect.
//! println!("holding with token {}", guard.token());
//! guard.release().await?;
//! # Ok(()) }
//! ```
//!
//! - [`Mutex`] (reentrant, fair), [`SemaphoreMutex`] (non-reentrant), [`RwLock`]
//!   (downgrade, no writer starvation), [`Semaphore`] (N permits), [`MultiLock`]
//!   (all-or-nothing) — Apache Curator's five recipes, on every backend;
//! - every guard has a fencing token ([`LockGuard::token`]) and a lost signal
//!   ([`LockGuard::lost`]); every acquire is cancellation-safe.
//!
//! # Backends and URLs
//! | URL | backend | feature |
//! |---|---|---|
//! | `zk://h:p[,h:p...][/chroot]` | ZooKeeper, wire-compatible with Curator | `zookeeper` |
//! | `etcd://h:p[,h:p...]` | etcd, layout shared with etcd's lock | `etcd` |
//! | `redis://h:p[/db]` | one Redis server (database `db`, default 0), watchdog leases | `redis` |
//! | `redlock://h:p,h:p,h:p[,...]` | Redlock over independent Redis masters | `redis` |
//! | `redis+sentinel://h:p[,h:p...]/service` | the primary of a Sentinel-monitored Redis, followed across failovers | `redis` |
//! | `redis+cluster://h:p[,h:p...]` | a Redis Cluster (seed nodes), each lock on its slot's master, followed across failovers | `redis` |
//!
//! A URL whose backend this build leaves out gives [`Error::InvalidUrl`] saying which
//! feature is missing. [`connect_env`] reads the URL from `DLOCK_URL`.
//!
//! The query takes the TLS files (`ca`, `cert`, `key`, `server_name`, on the TLS
//! schemes), a key prefix on Redis (`prefix`) or namespace on etcd (`namespace`), and,
//! on `redis://` and `redis+sentinel://`, `replicas=N`: a grant or a renewal counts only
//! once N replicas acknowledged it ([`SessionOptions::replicas`]).
//!
//! # Feature flags
//! - `zookeeper` (default): the ZooKeeper backend, `dlock-zookeeper`.
//! - `etcd` (default): the etcd backend, `dlock-etcd`.
//! - `redis` (default): the Redis (single master, Sentinel or Cluster) and Redlock backends,
//!   `dlock-redis`.
//!
//! Turn off the backends you do not use with `default-features = false`. The `dlock`
//! command line tool is its own crate, `dlock-cli`: this library pulls in no CLI
//! dependency.
//!
//! # Cancel safety and session loss
//! Every acquire may be dropped at any await point: its queue entry is removed (in the
//! background if need be). Every lock lives as long as the client's session; when the
//! session ends, a waiting acquire returns [`Error::LockLost`] and a held guard's
//! [`LockGuard::lost`] fires. The methods of [`dlock_recipes::Mutex`] and the other
//! recipes say so one by one, with the Curator / etcd / Redisson call each matches.
//!
//! # Errors and exit codes
//! One error enum, [`Error`], for every backend: lost, timeout, would-block, invalid input
//! and unreachable are distinct variants. [`exit_code`] maps them to the CLI's exit codes
//! (75 timeout, 69 unreachable, 64 bad usage, 70 lock lost).
//!
//! # The design decision
//! The protocol (naming, ordering, which entry to watch) lives in one sans-I/O crate,
//! `dlock-core`; adapters only move bytes and implement the `Backend` trait; recipes are
//! written once over its object-safe form, `DynBackend`. So every recipe has the same
//! semantics on every backend, and the facade can pick the backend at run time from a URL
//! (`Arc<dyn DynBackend>`). See
//! [ARCHITECTURE.md](https://github.com/dlock-rs/dlock/blob/main/docs/ARCHITECTURE.md); for choosing a backend,
//! [choosing-a-backend.md](https://github.com/dlock-rs/dlock/blob/main/docs/choosing-a-backend.md).

#![deny(missing_docs)]

mod url;

use std::sync::Arc;

pub use dlock_core::{lost_margin, Credentials, Secret, TlsOptions};
#[doc(inline)]
pub use dlock_core::{
    Backend, Capability, DynBackend, Entry, EntryKind, Error, FenceGate, FencingToken, LockName,
    NameError, Result, SessionOptions,
};
pub use dlock_recipes::{
    semaphore, Election, Leader, Leadership, LockGuard, LockKind, LockSummary, MultiGuard,
    MultiLock, Part, Participant, RevocableGuard, Semaphore, SemaphoreMutex, TicketSource,
};
pub use url::{BackendUrl, Servers, PASSWORD_ENV};

/// The adapters of this build's backends, to build a backend yourself: above all on the
/// application's own client (bring your own client), handed to [`Client::from_backend`].
/// Each re-exports the client crate it is built on, so the application names the same
/// version.
///
/// ```no_run
/// # #[cfg(feature = "etcd")]
/// # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
/// use dlock::backends::{etcd_client, EtcdBackend};
/// let etcd = etcd_client::Client::connect(["127.0.0.1:2379"], None).await?;
/// let backend = EtcdBackend::from_client(etcd.clone(), dlock::SessionOptions::default()).await?;
/// let client = dlock::Client::from_backend(backend);
/// let mut guard = client.mutex("orders/42")?.lock().await?;
/// guard.release().await?;
/// client.close().await?; // revokes dlock's lease; `etcd` stays connected
/// # Ok(()) }
/// ```
pub mod backends {
    #[cfg(feature = "etcd")]
    pub use dlock_etcd::{etcd_client, EtcdBackend};
    #[cfg(feature = "redis")]
    pub use dlock_redis::{fred, RedisBackend};
    #[cfg(feature = "zookeeper")]
    pub use dlock_zookeeper::{zookeeper_client, ZkBackend, ZkOptions};
}

// The protocol core (queue order, drivers, the `Backend` contract's helper types) is not
// re-exported wholesale: backend authors depend on `dlock-core` itself, and what a user
// of locks needs is re-exported by name above.

/// A session on a backend chosen at run time; see [`dlock_recipes::Client`].
pub type Client = dlock_recipes::Client<dyn DynBackend>;
/// A reentrant fair mutex; see [`dlock_recipes::Mutex`].
pub type Mutex = dlock_recipes::Mutex<dyn DynBackend>;
/// A read/write lock; see [`dlock_recipes::RwLock`].
pub type RwLock = dlock_recipes::RwLock<dyn DynBackend>;

/// The environment variable [`connect_env`] and the CLI read the URL from.
pub const URL_ENV: &str = "DLOCK_URL";

/// Connects to the backend named by `url` with default session settings.
///
/// # Errors
/// [`Error::InvalidUrl`] for a malformed URL or a backend this build leaves out;
/// [`Error::Unreachable`] if no server answers within the connect timeout.
pub async fn connect(url: &str) -> Result<Client> {
    connect_with(url, SessionOptions::default()).await
}

/// Connects to the backend named by the `DLOCK_URL` environment variable.
///
/// # Errors
/// [`Error::InvalidUrl`] if it is unset; otherwise as [`connect`].
pub async fn connect_env() -> Result<Client> {
    let url = std::env::var(URL_ENV).map_err(|_| Error::InvalidUrl {
        url: String::new(),
        reason: format!("{URL_ENV} is not set"),
    })?;
    connect(&url).await
}

/// Connects to the backend named by `url` with the given session settings.
///
/// TLS settings, credentials and a namespace set on `opts` take precedence over the
/// URL's (its TLS scheme and query, its userinfo, `?prefix=` / `?namespace=`), and so
/// do replicas set on `opts` (non-zero: 0 is the default and takes the URL's
/// `?replicas=`).
///
/// # Errors
/// As [`connect`], and [`Error::Unauthenticated`], [`Error::PermissionDenied`] or
/// [`Error::Tls`] when a secured server refuses the client.
pub async fn connect_with(url: &str, mut opts: SessionOptions) -> Result<Client> {
    let parsed = BackendUrl::parse(url)?;
    if opts.tls.is_none() {
        opts.tls = parsed.tls;
    }
    if opts.credentials.is_none() {
        opts.credentials = parsed.credentials;
    }
    if opts.namespace.is_none() {
        opts.namespace = parsed.namespace;
    }
    if opts.replicas == 0 {
        opts.replicas = parsed.replicas;
    }
    let backend = open(url, parsed.servers, opts).await?;
    Ok(Client::new(backend))
}

#[allow(unused_variables)]
async fn open(url: &str, servers: Servers, opts: SessionOptions) -> Result<Arc<dyn DynBackend>> {
    let missing = |feature: &str| Error::InvalidUrl {
        url: BackendUrl::redact(url),
        reason: format!("this build of dlock has no `{feature}` feature"),
    };
    match servers {
        Servers::ZooKeeper { hosts, chroot } => {
            #[cfg(feature = "zookeeper")]
            {
                let connect = format!("{}{}", hosts.join(","), chroot.unwrap_or_default());
                let b: Arc<dyn DynBackend> =
                    dlock_zookeeper::ZkBackend::connect(&connect, opts).await?;
                Ok(b)
            }
            #[cfg(not(feature = "zookeeper"))]
            Err(missing("zookeeper"))
        }
        Servers::Etcd { hosts } => {
            #[cfg(feature = "etcd")]
            {
                let b: Arc<dyn DynBackend> = dlock_etcd::EtcdBackend::connect(&hosts, opts).await?;
                Ok(b)
            }
            #[cfg(not(feature = "etcd"))]
            Err(missing("etcd"))
        }
        Servers::Redis { host, database } => {
            #[cfg(feature = "redis")]
            {
                let b: Arc<dyn DynBackend> =
                    dlock_redis::RedisBackend::connect_database(&host, database, opts).await?;
                Ok(b)
            }
            #[cfg(not(feature = "redis"))]
            Err(missing("redis"))
        }
        Servers::Redlock { hosts } => {
            #[cfg(feature = "redis")]
            {
                let b: Arc<dyn DynBackend> =
                    dlock_redis::RedisBackend::connect_redlock(&hosts, opts).await?;
                Ok(b)
            }
            #[cfg(not(feature = "redis"))]
            Err(missing("redis"))
        }
        Servers::RedisSentinel { sentinels, service } => {
            #[cfg(feature = "redis")]
            {
                let b: Arc<dyn DynBackend> =
                    dlock_redis::RedisBackend::connect_sentinel(&sentinels, &service, opts).await?;
                Ok(b)
            }
            #[cfg(not(feature = "redis"))]
            Err(missing("redis"))
        }
        Servers::RedisCluster { seeds } => {
            #[cfg(feature = "redis")]
            {
                let b: Arc<dyn DynBackend> =
                    dlock_redis::RedisBackend::connect_cluster(&seeds, opts).await?;
                Ok(b)
            }
            #[cfg(not(feature = "redis"))]
            Err(missing("redis"))
        }
    }
}

/// The exit code the `dlock` CLI uses for an error (BSD sysexits): 75 (`EX_TEMPFAIL`)
/// for a timeout or a lock held elsewhere, 69 (`EX_UNAVAILABLE`) for an unreachable
/// backend, 64 (`EX_USAGE`) for a bad name, URL or argument or an ability the backend
/// lacks (`--revocable` off ZooKeeper), 70 (`EX_SOFTWARE`) for a lost
/// lock, 77 (`EX_NOPERM`) for credentials the server refuses or an operation it does not
/// allow, 78 (`EX_CONFIG`) for a TLS setup or verification failure, 1 otherwise.
pub fn exit_code(e: &Error) -> i32 {
    match e {
        Error::Timeout(_) | Error::WouldBlock => 75,
        Error::Unreachable(_) => 69,
        Error::InvalidName { .. }
        | Error::InvalidUrl { .. }
        | Error::InvalidPermits(_)
        | Error::WouldDeadlock(_)
        | Error::Unsupported { .. } => 64,
        Error::LockLost(_) | Error::Closed => 70,
        Error::Unauthenticated(_) | Error::PermissionDenied(_) => 77,
        Error::Tls(_) => 78,
        _ => 1,
    }
}

// Clients, recipes and guards move between tasks and threads: checked at compile time,
// so a change that makes one of them `!Send` or `!Sync` cannot slip in.
const _: () = {
    const fn send_sync_static<T: Send + Sync + 'static>() {}
    send_sync_static::<Client>();
    send_sync_static::<Mutex>();
    send_sync_static::<RwLock>();
    send_sync_static::<SemaphoreMutex>();
    send_sync_static::<Semaphore>();
    send_sync_static::<MultiLock>();
    send_sync_static::<Election>();
    send_sync_static::<Leadership>();
    send_sync_static::<LockGuard>();
    send_sync_static::<MultiGuard>();
    send_sync_static::<RevocableGuard>();
    send_sync_static::<Error>();
    send_sync_static::<BackendUrl>();
};

// The README's Rust example is compiled as a doc test, so it cannot rot.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
struct ReadmeDoctests;
