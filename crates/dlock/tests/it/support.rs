//! Shared helpers: endpoints from the environment, clients, polling.

use std::future::Future;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

use std::sync::{Arc, OnceLock};

use dlock::{Client, DynBackend, SessionOptions};
use dlock_testkit::mem::MemServer;
use dlock_testkit::LockService;

/// Which backend a test instance runs on: one of testkit's services (the list shared
/// with `cargo xtask chaos`), or the in-memory backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// ZooKeeper.
    Zk,
    /// etcd.
    Etcd,
    /// One Redis master.
    Redis,
    /// Redlock over independent Redis masters.
    Redlock,
    /// The primary of a Redis Sentinel group.
    RedisSentinel,
    /// A Redis Cluster (three masters, three replicas).
    RedisCluster,
    /// dlock-testkit's `MemBackend` on one process-wide `MemServer`: no server, no
    /// endpoint, never skipped.
    Mem,
}

impl Kind {
    /// The real service behind this kind, `None` for [`Kind::Mem`].
    pub fn service(self) -> Option<LockService> {
        match self {
            Kind::Zk => Some(LockService::Zk),
            Kind::Etcd => Some(LockService::Etcd),
            Kind::Redis => Some(LockService::Redis),
            Kind::Redlock => Some(LockService::Redlock),
            Kind::RedisSentinel => Some(LockService::RedisSentinel),
            Kind::RedisCluster => Some(LockService::RedisCluster),
            Kind::Mem => None,
        }
    }
}

/// The URL [`url`] gives [`Kind::Mem`]: only [`client`] understands it (`dlock::connect`
/// and the CLI do not), so a test that needs a real URL cannot run on mem by mistake.
pub const MEM_URL: &str = "mem://process";

/// The one in-memory server of this test process.
fn mem_server() -> &'static Arc<MemServer> {
    static SERVER: OnceLock<Arc<MemServer>> = OnceLock::new();
    SERVER.get_or_init(MemServer::new)
}

/// The session timeout the tests use on every backend: short, so crash tests finish
/// quickly, but long enough for a loaded 2-core machine not to expire live sessions.
pub const SESSION_TIMEOUT: Duration = Duration::from_secs(4);

/// The backend URL for `kind`, or `None` (with a loud message) when the endpoints are
/// not exported. Under CI a missing endpoint fails the test instead: CI must never pass
/// by skipping.
pub fn url(kind: Kind) -> Option<String> {
    let Some(kind) = kind.service() else {
        return Some(MEM_URL.to_owned());
    };
    match std::env::var(kind.env_var()) {
        Ok(v) if !v.is_empty() => Some(kind.url_of_endpoint(&v)),
        _ => {
            if std::env::var_os("CI").is_some() {
                panic!(
                    "{} is not set but CI is: run the tests through `cargo xtask integration`",
                    kind.env_var()
                );
            }
            // Written to the process's stderr directly: the test harness captures
            // `eprintln!`, and a skip must be seen.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "SKIPPED: {} not set (run through `cargo xtask integration`)",
                kind.env_var()
            );
            None
        }
    }
}

/// The URL of the secured variant of `kind`'s server (`DLOCK_TEST_SECURE_*`: TLS, the
/// allowed user's credentials, the test CA), or `None` (loudly; a failure under CI) when
/// it is not exported. ZooKeeper's gets the chroot `/dlock-secure` if it has none: the
/// ACL of a chroot made by the allowed user is what refuses other identities there.
pub fn secure_url(kind: Kind) -> Option<String> {
    let var = kind.service()?.secure_env_var();
    match std::env::var(var) {
        // ZooKeeper without the client certificate: it would add the certificate's x509
        // identity, shared by every test client, to the "creator" of every node.
        Ok(v) if !v.is_empty() => Some(match kind {
            Kind::Zk => without_client_cert(&with_zk_chroot(&v, "/dlock-secure")),
            _ => v,
        }),
        _ => {
            skip_or_fail(&format!(
                "{var} is not set (run through `cargo xtask integration`)"
            ));
            None
        }
    }
}

/// `url` without its `cert` and `key` query parameters.
pub fn without_client_cert(url: &str) -> String {
    let Some((base, query)) = url.split_once('?') else {
        return url.to_owned();
    };
    let kept: Vec<&str> = query
        .split('&')
        .filter(|p| !p.starts_with("cert=") && !p.starts_with("key="))
        .collect();
    if kept.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{}", kept.join("&"))
    }
}

/// `url` with `chroot` as its path when it has none.
fn with_zk_chroot(url: &str, chroot: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap_or(("zks", url));
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(end);
    if tail.starts_with('/') {
        return url.to_owned();
    }
    format!("{scheme}://{authority}{chroot}{tail}")
}

/// A fresh client (its own session) on `url`; on [`MEM_URL`], a session on the
/// process's in-memory server.
pub async fn client(url: &str) -> Client {
    client_with(
        url,
        SessionOptions::default().with_session_timeout(SESSION_TIMEOUT),
    )
    .await
}

/// [`client`] with the caller's session options (a longer session, say).
pub async fn client_with(url: &str, opts: SessionOptions) -> Client {
    if url == MEM_URL {
        let backend = mem_server()
            .connect(opts)
            .await
            .unwrap_or_else(|e| panic!("connect to the in-memory server: {e}"));
        return Client::new(backend as Arc<dyn DynBackend>);
    }
    // A connect that times out is tried again, twice: these tests are about locks, not
    // connect latency, and on CI's two cores the secured six-node Redis Cluster (a TLS
    // handshake per node, dozens of tests connecting at once) once took longer than the
    // connect timeout. Any other error fails at once.
    let mut attempt = 1;
    loop {
        match dlock::connect_with(url, opts.clone()).await {
            Ok(client) => return client,
            Err(dlock::Error::Unreachable(why)) if attempt < 3 => {
                eprintln!("connect {url}: attempt {attempt} timed out ({why}); trying again");
                attempt += 1;
            }
            Err(e) => panic!("connect {url}: {e}"),
        }
    }
}

/// A lock name no other test (or earlier run) uses.
pub fn unique(prefix: &str) -> String {
    format!("dlock-test/{prefix}-{}-{}", std::process::id(), uuid_like())
}

fn uuid_like() -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{}", t, N.fetch_add(1, Ordering::Relaxed))
}

/// Polls `cond` until it holds or `limit` passes; returns whether it held. Used to wait
/// for conditions with a generous limit, never to assert on speed.
pub async fn eventually<F, Fut>(limit: Duration, mut cond: F) -> bool
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
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

/// The queue of lock `name` and its one holder's entry, as another client sees them:
/// what a test needs to act on the holder's entry from outside.
pub async fn holder_entry(c: &Client, name: &str) -> (dlock_core::QueuePath, dlock::Entry) {
    let held: Vec<_> = c
        .participants(name)
        .await
        .expect("participants")
        .into_iter()
        .filter(|p| p.holds)
        .collect();
    assert_eq!(held.len(), 1, "one holder expected: {held:?}");
    let q = dlock_core::QueuePath::root(c.lock_name(name).expect("name"));
    (q, held[0].entry.clone())
}

/// Number of entries left under `name` in every queue of every recipe.
pub async fn leftovers(c: &Client, name: &str) -> usize {
    c.participants(name)
        .await
        .map(|p| p.len())
        .unwrap_or(usize::MAX)
}

/// Tests that take servers down (fault tests) must not run while other tests use the
/// same cluster: every test holds this shared, a fault test holds it exclusively. The
/// harness runs tests on several threads of one process, each with its own runtime;
/// tokio's lock is runtime-agnostic.
static CLUSTER: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

/// Held by every ordinary test for its whole run.
pub async fn cluster_shared() -> tokio::sync::RwLockReadGuard<'static, ()> {
    CLUSTER.read().await
}

/// Held by a fault test for its whole run: no other test runs meanwhile.
pub async fn cluster_exclusive() -> tokio::sync::RwLockWriteGuard<'static, ()> {
    CLUSTER.write().await
}

/// The skip/fail rule for a prerequisite other than an endpoint (a JDK, a jar, a
/// three-node ensemble): under CI a missing prerequisite fails the test, otherwise the
/// test prints a loud `SKIPPED` line and returns.
pub fn skip_or_fail(what: &str) {
    if std::env::var_os("CI").is_some() {
        panic!("{what}, but CI is set: CI must run this test");
    }
    use std::io::Write;
    let _ = writeln!(std::io::stderr(), "SKIPPED: {what}");
}

/// The ZooKeeper connect string (`h:p,h:p,...`) without the `zk://` scheme.
pub fn zk_hosts(url: &str) -> &str {
    url.strip_prefix("zk://").unwrap_or(url)
}

/// The `dlock` binary (the `dlock-cli` crate) of this build: beside the test binary's
/// `deps/` directory. `cargo test --workspace` builds it before any test runs (the CLI
/// crate has integration tests of its own); a lone `cargo test -p dlock` needs
/// `cargo build -p dlock-cli` first.
pub fn dlock_bin() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("target/<profile>/deps");
    let bin = dir.join("dlock");
    assert!(
        bin.exists(),
        "{} is missing: build the CLI with `cargo build -p dlock-cli` (cargo test --workspace does)",
        bin.display()
    );
    bin
}

/// The `dlock` binary under test, with no `DLOCK_URL` from the caller's environment and
/// no stdin, so it can never wait on a terminal.
pub fn dlock() -> Command {
    use std::os::unix::process::CommandExt as _;
    let mut c = Command::new(dlock_bin());
    c.env_remove("DLOCK_URL").stdin(Stdio::null());
    // As from an interactive shell: the signals the tests send dlock at their default
    // dispositions, whatever this test process inherited (a runner started in the
    // background of a script has SIGINT and SIGQUIT ignored, `nohup` SIGHUP, and dlock
    // keeps a signal it was started with ignored).
    // SAFETY: the hook only calls signal(2), which is async-signal-safe, in the child.
    #[allow(unsafe_code)]
    unsafe {
        c.pre_exec(|| {
            for sig in [
                libc::SIGHUP,
                libc::SIGINT,
                libc::SIGQUIT,
                libc::SIGTERM,
                libc::SIGTSTP,
                libc::SIGTTIN,
                libc::SIGTTOU,
            ] {
                libc::signal(sig, libc::SIG_DFL);
            }
            Ok(())
        });
    }
    c
}

/// `dlock --url URL exec NAME --timeout TIMEOUT -- true`: takes the lock (or gives up after
/// `timeout`), runs nothing of note, releases.
pub fn dlock_exec_true(url: &str, name: &str, timeout: &str) -> Command {
    let mut c = dlock();
    c.args([
        "--url",
        url,
        "exec",
        name,
        "--timeout",
        timeout,
        "--",
        "true",
    ]);
    c
}

/// A fresh directory under the system temp dir, named after `prefix` and unique to this
/// run.
pub fn tempdir(prefix: &str) -> PathBuf {
    let d = std::env::temp_dir().join(unique(prefix).replace('/', "-"));
    std::fs::create_dir_all(&d).expect("tempdir");
    d
}

/// Counts holders inside one critical section and remembers the most seen at once.
#[derive(Default)]
pub struct Occupancy {
    now: std::sync::atomic::AtomicUsize,
    peak: std::sync::atomic::AtomicUsize,
}

impl Occupancy {
    pub fn enter(&self) {
        let n = self.now.fetch_add(1, std::sync::atomic::Ordering::SeqCst) + 1;
        self.peak.fetch_max(n, std::sync::atomic::Ordering::SeqCst);
    }
    pub fn leave(&self) {
        self.now.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
    pub fn peak(&self) -> usize {
        self.peak.load(std::sync::atomic::Ordering::SeqCst)
    }
}
