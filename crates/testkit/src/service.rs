//! The lock services dlock's tests and `cargo xtask chaos` run against, by name.

use crate::config::SENTINEL_SERVICE;
use crate::env::{ENV_ETCD, ENV_REDIS, ENV_REDIS_CLUSTER, ENV_REDIS_SENTINEL, ENV_REDLOCK, ENV_ZK};
use crate::{Backend, Endpoints};

/// A lock service as a dlock user names it in a URL: one backend, or one way of using the
/// Redis servers (a single master, a Redlock set, a Sentinel group, a Redis Cluster).
///
/// One list, so a test suite and the chaos runner cannot disagree on which services exist,
/// which `DLOCK_TEST_*` variable carries each one's endpoints, or how its URL is spelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LockService {
    /// ZooKeeper, `zk://h:p,h:p,h:p`.
    Zk,
    /// etcd, `etcd://h:p,h:p,h:p`.
    Etcd,
    /// One Redis master, `redis://h:p`.
    Redis,
    /// Independent Redis masters used as a Redlock set, `redlock://h:p,h:p,...`.
    Redlock,
    /// The primary of a Sentinel group, `redis+sentinel://h:p,h:p,h:p/mymaster`.
    RedisSentinel,
    /// A Redis Cluster through its nodes, `redis+cluster://h:p,h:p,...`.
    RedisCluster,
}

impl LockService {
    /// Every service, in the order runs report them.
    pub const ALL: [LockService; 6] = [
        LockService::Zk,
        LockService::Etcd,
        LockService::Redis,
        LockService::Redlock,
        LockService::RedisSentinel,
        LockService::RedisCluster,
    ];

    /// The name reports and file names use (`zookeeper`, `redis-sentinel`, ...).
    pub fn label(self) -> &'static str {
        match self {
            LockService::Zk => "zookeeper",
            LockService::Etcd => "etcd",
            LockService::Redis => "redis",
            LockService::Redlock => "redlock",
            LockService::RedisSentinel => "redis-sentinel",
            LockService::RedisCluster => "redis-cluster",
        }
    }

    /// The facade's URL scheme for this service.
    pub fn scheme(self) -> &'static str {
        match self {
            LockService::Zk => "zk",
            LockService::Etcd => "etcd",
            LockService::Redis => "redis",
            LockService::Redlock => "redlock",
            LockService::RedisSentinel => "redis+sentinel",
            LockService::RedisCluster => "redis+cluster",
        }
    }

    /// The environment variable `cargo xtask integration` exports this service's
    /// endpoints in.
    pub fn env_var(self) -> &'static str {
        match self {
            LockService::Zk => ENV_ZK,
            LockService::Etcd => ENV_ETCD,
            LockService::Redis => ENV_REDIS,
            LockService::Redlock => ENV_REDLOCK,
            LockService::RedisSentinel => ENV_REDIS_SENTINEL,
            LockService::RedisCluster => ENV_REDIS_CLUSTER,
        }
    }

    /// The kind of server whose client addresses this service's URL lists: for a Sentinel
    /// group that is the Sentinels, not the data nodes.
    pub fn server(self) -> Backend {
        match self {
            LockService::Zk => Backend::Zookeeper,
            LockService::Etcd => Backend::Etcd,
            LockService::Redis | LockService::Redlock => Backend::Redis,
            LockService::RedisSentinel => Backend::Sentinel,
            LockService::RedisCluster => Backend::RedisCluster,
        }
    }

    /// Parses a label or scheme (`zk`, `zookeeper`, `etcd`, `redis`, `redlock`,
    /// `redis-sentinel`, `sentinel`, `redis-cluster`, `cluster`), ignoring case and
    /// surrounding blanks.
    pub fn parse(s: &str) -> Option<LockService> {
        Some(match s.trim().to_ascii_lowercase().as_str() {
            "zk" | "zookeeper" => LockService::Zk,
            "etcd" => LockService::Etcd,
            "redis" => LockService::Redis,
            "redlock" => LockService::Redlock,
            "redis-sentinel" | "redis+sentinel" | "sentinel" => LockService::RedisSentinel,
            "redis-cluster" | "redis+cluster" | "cluster" => LockService::RedisCluster,
            _ => return None,
        })
    }

    /// The facade URL for servers at `addrs` (client addresses of [`Self::server`]s). A
    /// single Redis master takes only the first address.
    pub fn url(self, addrs: &[String]) -> String {
        let addrs = match self {
            LockService::Redis => &addrs[..addrs.len().min(1)],
            _ => addrs,
        };
        match self {
            LockService::RedisSentinel => {
                format!("{}://{}/{SENTINEL_SERVICE}", self.scheme(), addrs.join(","))
            }
            _ => format!("{}://{}", self.scheme(), addrs.join(",")),
        }
    }

    /// This service's endpoints in `endpoints` (in the `DLOCK_TEST_*` format), if present.
    pub fn endpoint(self, endpoints: &Endpoints) -> Option<&str> {
        match self {
            LockService::Zk => endpoints.zk.as_deref(),
            LockService::Etcd => endpoints.etcd.as_deref(),
            LockService::Redis => endpoints.redis.as_deref(),
            LockService::Redlock => endpoints.redlock.as_deref(),
            LockService::RedisSentinel => endpoints.redis_sentinel.as_deref(),
            LockService::RedisCluster => endpoints.redis_cluster.as_deref(),
        }
    }

    /// The facade URL for an endpoint string in the `DLOCK_TEST_*` format (which for a
    /// Sentinel group already ends in the service name).
    pub fn url_of_endpoint(self, endpoint: &str) -> String {
        format!("{}://{endpoint}", self.scheme())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_and_schemes_parse_back() {
        for s in LockService::ALL {
            assert_eq!(LockService::parse(s.label()), Some(s));
            assert_eq!(LockService::parse(s.scheme()), Some(s));
            assert_eq!(
                LockService::parse(&format!(" {} ", s.label().to_uppercase())),
                Some(s)
            );
        }
        assert_eq!(LockService::parse("consul"), None);
    }

    #[test]
    fn urls_name_the_right_servers() {
        let a: Vec<String> = ["127.0.0.1:1", "127.0.0.1:2"].map(String::from).to_vec();
        assert_eq!(LockService::Redis.url(&a), "redis://127.0.0.1:1");
        assert_eq!(
            LockService::Redlock.url(&a),
            "redlock://127.0.0.1:1,127.0.0.1:2"
        );
        assert_eq!(
            LockService::RedisSentinel.url(&a),
            format!("redis+sentinel://127.0.0.1:1,127.0.0.1:2/{SENTINEL_SERVICE}")
        );
        assert_eq!(LockService::Zk.url_of_endpoint("h:1,h:2"), "zk://h:1,h:2");
    }

    #[test]
    fn an_endpoint_comes_from_its_own_variable() {
        let e = Endpoints {
            zk: Some("z".into()),
            etcd: None,
            redis: Some("r".into()),
            redlock: None,
            redis_sentinel: Some("s/mymaster".into()),
            redis_cluster: Some("c1,c2".into()),
            state: None,
        };
        assert_eq!(LockService::Zk.endpoint(&e), Some("z"));
        assert_eq!(LockService::Etcd.endpoint(&e), None);
        assert_eq!(LockService::Redis.endpoint(&e), Some("r"));
        assert_eq!(LockService::RedisSentinel.endpoint(&e), Some("s/mymaster"));
        assert_eq!(LockService::RedisCluster.endpoint(&e), Some("c1,c2"));
        let distinct: std::collections::HashSet<_> =
            LockService::ALL.iter().map(|s| s.env_var()).collect();
        assert_eq!(distinct.len(), LockService::ALL.len());
    }
}
