//! The environment contract between `cargo xtask integration` and the tests.

use std::path::PathBuf;

use crate::State;

/// ZooKeeper connect string, e.g. `127.0.0.1:2181,127.0.0.1:2182,127.0.0.1:2183`.
pub const ENV_ZK: &str = "DLOCK_TEST_ZK";
/// etcd endpoints, e.g. `127.0.0.1:2379,127.0.0.1:2479,127.0.0.1:2579`.
pub const ENV_ETCD: &str = "DLOCK_TEST_ETCD";
/// One Redis master, e.g. `127.0.0.1:6379`.
pub const ENV_REDIS: &str = "DLOCK_TEST_REDIS";
/// Comma list of independent Redis masters for Redlock.
pub const ENV_REDLOCK: &str = "DLOCK_TEST_REDLOCK";
/// The Sentinel group: its Sentinels and the service name,
/// `127.0.0.1:6393,127.0.0.1:6394,127.0.0.1:6395/mymaster` (the facade URL is
/// `redis+sentinel://` followed by this).
pub const ENV_REDIS_SENTINEL: &str = "DLOCK_TEST_REDIS_SENTINEL";
/// Every node of the Redis Cluster, `127.0.0.1:6396,...,127.0.0.1:6401` (the facade URL
/// is `redis+cluster://` followed by this: every node is a seed).
pub const ENV_REDIS_CLUSTER: &str = "DLOCK_TEST_REDIS_CLUSTER";
/// Path of the cluster state JSON, for fault tests.
pub const ENV_STATE: &str = "DLOCK_TEST_STATE";

/// The secured ZooKeeper as a full URL with credentials and TLS files,
/// `zks://dlock-app:PASSWORD@127.0.0.1:P?ca=PATH&cert=PATH&key=PATH`
/// ([`crate::State::secure_env`]).
pub const ENV_SECURE_ZK: &str = "DLOCK_TEST_SECURE_ZK";
/// The secured etcd, `etcds://dlock-app:PASSWORD@h:p,h:p?ca=...&cert=...&key=...`.
pub const ENV_SECURE_ETCD: &str = "DLOCK_TEST_SECURE_ETCD";
/// One secured Redis master, `rediss://dlock-app:PASSWORD@h:p?ca=...&cert=...&key=...`.
pub const ENV_SECURE_REDIS: &str = "DLOCK_TEST_SECURE_REDIS";
/// The secured Redlock masters, `redlocks://dlock-app:PASSWORD@h:p,h:p,h:p?ca=...`.
pub const ENV_SECURE_REDLOCK: &str = "DLOCK_TEST_SECURE_REDLOCK";
/// A secured Sentinel group: its Sentinels and service name,
/// `rediss+sentinel://dlock-app:PASSWORD@h:p,h:p,h:p/mymaster?ca=...&cert=...&key=...`.
pub const ENV_SECURE_REDIS_SENTINEL: &str = "DLOCK_TEST_SECURE_REDIS_SENTINEL";
/// A secured Redis Cluster, `rediss+cluster://dlock-app:PASSWORD@h:p,...?ca=...`.
pub const ENV_SECURE_REDIS_CLUSTER: &str = "DLOCK_TEST_SECURE_REDIS_CLUSTER";
/// Path of the secured cluster's state JSON (its PKI is [`crate::State::pki`]).
pub const ENV_SECURE_STATE: &str = "DLOCK_TEST_SECURE_STATE";

/// Directory where tests that start their own servers put their state files (see
/// [`scratch_state_path`]); `cargo xtask integration` sets it and kills whatever those
/// files record when the run ends or is interrupted.
pub const ENV_CLUSTER_DIR: &str = "DLOCK_TEST_CLUSTER_DIR";

/// The state file a test should give [`crate::ClusterSpec::state_path`] when it starts
/// servers of its own: `$DLOCK_TEST_CLUSTER_DIR/test-<label>-<pid>.json`, or a file in
/// the system temp dir outside xtask.
///
/// A test killed by a signal cannot run its teardown; recording its servers here lets
/// xtask (or [`reap_scratch_clusters`]) kill them afterwards.
pub fn scratch_state_path(label: &str) -> PathBuf {
    let file = format!("test-{label}-{}.json", std::process::id());
    match var(ENV_CLUSTER_DIR) {
        Some(dir) => PathBuf::from(dir).join(file),
        None => std::env::temp_dir().join(format!("dlock-testkit-{file}")),
    }
}

/// Kills the servers recorded in every `test-*.json` state file in `dir` and deletes
/// those files; returns how many clusters it took down. Clusters whose processes are
/// already gone are just removed.
pub fn reap_scratch_clusters(dir: &std::path::Path) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut n = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with("test-") && name.ends_with(".json") {
            match State::load(entry.path()) {
                Ok(state) => {
                    if let Err(e) = state.down() {
                        eprintln!("dlock-testkit: tearing down {name}: {e}");
                    }
                    n += 1;
                }
                Err(_) => {
                    let _ = std::fs::remove_file(entry.path());
                }
            }
        }
    }
    n
}

/// Where the test servers are. Each field is `None` when that backend is not running.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoints {
    /// [`ENV_ZK`].
    pub zk: Option<String>,
    /// [`ENV_ETCD`].
    pub etcd: Option<String>,
    /// [`ENV_REDIS`].
    pub redis: Option<String>,
    /// [`ENV_REDLOCK`].
    pub redlock: Option<String>,
    /// [`ENV_REDIS_SENTINEL`].
    pub redis_sentinel: Option<String>,
    /// [`ENV_REDIS_CLUSTER`].
    pub redis_cluster: Option<String>,
    /// [`ENV_STATE`].
    pub state: Option<PathBuf>,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

impl Endpoints {
    /// Reads the `DLOCK_TEST_*` variables; empty values count as missing.
    pub fn from_env() -> Endpoints {
        Endpoints {
            zk: var(ENV_ZK),
            etcd: var(ENV_ETCD),
            redis: var(ENV_REDIS),
            redlock: var(ENV_REDLOCK),
            redis_sentinel: var(ENV_REDIS_SENTINEL),
            redis_cluster: var(ENV_REDIS_CLUSTER),
            state: var(ENV_STATE).map(PathBuf::from),
        }
    }

    /// The variables to export for these endpoints (only the ones present).
    pub fn to_env(&self) -> Vec<(&'static str, String)> {
        let mut vars = Vec::new();
        let pairs = [
            (ENV_ZK, &self.zk),
            (ENV_ETCD, &self.etcd),
            (ENV_REDIS, &self.redis),
            (ENV_REDLOCK, &self.redlock),
            (ENV_REDIS_SENTINEL, &self.redis_sentinel),
            (ENV_REDIS_CLUSTER, &self.redis_cluster),
        ];
        for (name, value) in pairs {
            if let Some(v) = value {
                vars.push((name, v.clone()));
            }
        }
        if let Some(p) = &self.state {
            vars.push((ENV_STATE, p.display().to_string()));
        }
        vars
    }

    /// The Sentinel group as a facade URL, `redis+sentinel://a,b,c/mymaster`.
    ///
    /// Not part of [`Endpoints::urls`]: the examples and the benchmark smoke pass run on
    /// those, and the Sentinel group is there for failover tests.
    pub fn sentinel_url(&self) -> Option<String> {
        self.redis_sentinel
            .as_ref()
            .map(|v| format!("redis+sentinel://{v}"))
    }

    /// The Redis Cluster as a facade URL, `redis+cluster://a,b,c,d,e,f`; like
    /// [`Endpoints::sentinel_url`], not part of [`Endpoints::urls`].
    pub fn cluster_url(&self) -> Option<String> {
        self.redis_cluster
            .as_ref()
            .map(|v| format!("redis+cluster://{v}"))
    }

    /// The endpoints as URLs for the `dlock` CLI and humans: `zk://a,b,c`, `etcd://a,b,c`,
    /// `redis://a`, `redlock://a,b,c,d,e`.
    pub fn urls(&self) -> Vec<String> {
        let mut urls = Vec::new();
        let pairs = [
            ("zk", &self.zk),
            ("etcd", &self.etcd),
            ("redis", &self.redis),
            ("redlock", &self.redlock),
        ];
        for (scheme, value) in pairs {
            if let Some(v) = value {
                urls.push(format!("{scheme}://{v}"));
            }
        }
        urls
    }
}

/// True when `CI` is set to something other than empty, `0` or `false`.
fn in_ci() -> bool {
    var("CI").is_some_and(|v| v != "0" && !v.eq_ignore_ascii_case("false"))
}

/// The value of `name`, or the skip/fail rule when it is missing.
///
/// # Panics
/// When the variable is missing and `CI` is set: a CI run that silently skipped the real
/// server tests would be a green build that tested nothing.
fn require(name: &str) -> Option<String> {
    if let Some(v) = var(name) {
        return Some(v);
    }
    if in_ci() {
        panic!(
            "{name} is not set but CI is: server tests must run in CI. Run them through `cargo xtask integration` (or `cargo xtask ci`), which starts the servers and exports {name}."
        );
    }
    // Straight to the process's stderr: libtest captures `eprintln!`, and a skip must be
    // seen even when the test passes.
    use std::io::Write as _;
    let _ = writeln!(
        std::io::stderr(),
        "SKIPPED: {name} not set (run through cargo xtask integration)"
    );
    None
}

/// The ZooKeeper connect string from [`ENV_ZK`], or `None` after printing a loud
/// `SKIPPED` line. Call it first in a test and `return` on `None`.
///
/// # Panics
/// When the variable is missing and env `CI` is set.
pub fn require_zk() -> Option<String> {
    require(ENV_ZK)
}

/// The etcd endpoints from [`ENV_ETCD`]; same skip/fail rule as [`require_zk`].
///
/// # Panics
/// When the variable is missing and env `CI` is set.
pub fn require_etcd() -> Option<String> {
    require(ENV_ETCD)
}

/// The single Redis master from [`ENV_REDIS`]; same skip/fail rule as [`require_zk`].
///
/// # Panics
/// When the variable is missing and env `CI` is set.
pub fn require_redis() -> Option<String> {
    require(ENV_REDIS)
}

/// The comma list of Redlock masters from [`ENV_REDLOCK`]; same skip/fail rule as
/// [`require_zk`]. `--single` integration runs have one Redis and do not set it.
///
/// # Panics
/// When the variable is missing and env `CI` is set.
pub fn require_redlock() -> Option<String> {
    require(ENV_REDLOCK)
}

/// The Sentinel group from [`ENV_REDIS_SENTINEL`] (`h:p,h:p,h:p/<service>`); same
/// skip/fail rule as [`require_zk`].
///
/// # Panics
/// When the variable is missing and env `CI` is set.
pub fn require_redis_sentinel() -> Option<String> {
    require(ENV_REDIS_SENTINEL)
}

/// The Redis Cluster's nodes from [`ENV_REDIS_CLUSTER`]; same skip/fail rule as
/// [`require_zk`].
///
/// # Panics
/// When the variable is missing and env `CI` is set.
pub fn require_redis_cluster() -> Option<String> {
    require(ENV_REDIS_CLUSTER)
}

/// The loaded cluster [`State`] from [`ENV_STATE`], for fault tests; same skip/fail rule
/// as [`require_zk`].
///
/// # Panics
/// When the variable is missing and env `CI` is set, or when the file named by it cannot
/// be loaded (a broken harness must fail the test, not skip it).
pub fn require_state() -> Option<State> {
    let path = require(ENV_STATE)?;
    match State::load(&path) {
        Ok(state) => Some(state),
        Err(e) => panic!("{ENV_STATE}={path} cannot be loaded: {e}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_env_list_only_present_backends() {
        let e = Endpoints {
            zk: Some("127.0.0.1:2181,127.0.0.1:2182".into()),
            etcd: None,
            redis: Some("127.0.0.1:6379".into()),
            redlock: Some("127.0.0.1:6379,127.0.0.1:6380".into()),
            redis_sentinel: Some("127.0.0.1:6393,127.0.0.1:6394/mymaster".into()),
            redis_cluster: None,
            state: Some(PathBuf::from("/t/state.json")),
        };
        assert_eq!(
            e.urls(),
            vec![
                "zk://127.0.0.1:2181,127.0.0.1:2182".to_string(),
                "redis://127.0.0.1:6379".to_string(),
                "redlock://127.0.0.1:6379,127.0.0.1:6380".to_string(),
            ]
        );
        assert_eq!(
            e.sentinel_url().as_deref(),
            Some("redis+sentinel://127.0.0.1:6393,127.0.0.1:6394/mymaster")
        );
        let env = e.to_env();
        assert_eq!(env.len(), 5);
        assert!(env.contains(&(
            ENV_REDIS_SENTINEL,
            "127.0.0.1:6393,127.0.0.1:6394/mymaster".to_string()
        )));
        assert!(env.contains(&(ENV_STATE, "/t/state.json".to_string())));
        assert!(!env.iter().any(|(k, _)| *k == ENV_ETCD));
    }
}
