//! Who leads right now: the ZooKeeper and etcd leaders, the Sentinel group's primary,
//! and the waits for an election or a failover to settle.

use std::process::{Command, Stdio};
use std::time::Duration;

use crate::config::SENTINEL_SERVICE;
use crate::error::io_ctx;
use crate::probe::ZkMode;
use crate::secure::{etcdctl_root_args, Pki};
use crate::state::{poll, Backend, Server, State};
use crate::{Error, Result};

impl State {
    /// The id of the ZooKeeper node that reports `Mode: leader` right now (or `standalone`
    /// for a one-node cluster), or `None` during an election. Stopped and dead nodes are
    /// not asked.
    pub fn zk_leader(&self) -> Option<u32> {
        self.live(Backend::Zookeeper)
            .find(|s| {
                matches!(
                    s.zk_mode(Duration::from_secs(1)),
                    Some(ZkMode::Leader | ZkMode::Standalone)
                )
            })
            .map(|s| s.id)
    }

    /// The id of the etcd member that is leader according to the live members, or `None`
    /// when none of them reports one right now (election in progress, or all too slow).
    ///
    /// Uses `etcdctl endpoint status -w json` against live nodes only with short dial and
    /// command timeouts: a dead endpoint would otherwise cost seconds per call.
    pub fn etcd_leader(&self) -> Result<Option<u32>> {
        let live: Vec<&Server> = self.live(Backend::Etcd).collect();
        if live.is_empty() {
            return Ok(None);
        }
        // A secured member speaks https, wants the client certificate and, with auth
        // enabled, a user.
        let tls = live.iter().find_map(|s| s.tls.as_ref());
        let endpoints = live
            .iter()
            .map(|s| match tls {
                Some(_) => format!("https://{}", s.addr),
                None => s.addr.clone(),
            })
            .collect::<Vec<_>>()
            .join(",");
        let mut args = vec![
            format!("--endpoints={endpoints}"),
            "--dial-timeout=300ms".into(),
            "--command-timeout=1s".into(),
        ];
        if let Some(dir) = tls {
            args.extend(etcdctl_root_args(&Pki::in_dir(dir)));
        }
        args.extend(["endpoint", "status", "-w", "json"].map(String::from));
        let out = Command::new("etcdctl")
            .args(&args)
            .env("ETCDCTL_API", "3")
            .stdin(Stdio::null())
            .output()
            .map_err(io_ctx("running etcdctl endpoint status"))?;
        // With one slow member etcdctl exits non-zero but still prints the others' status.
        let stdout = String::from_utf8_lossy(&out.stdout);
        Ok(parse_etcd_leader(&stdout).and_then(|leader_addr| {
            live.iter()
                .find(|s| s.addr == leader_addr || leader_addr.ends_with(&s.addr))
                .map(|s| s.id)
        }))
    }

    /// The id of the [`Backend::RedisHa`] node that every live Sentinel names as the
    /// primary (`SENTINEL GET-MASTER-ADDR-BY-NAME`) and that itself answers `ROLE` with
    /// `master`; `None` while they disagree, during a failover, or without a Sentinel
    /// group. Stopped and dead Sentinels are not asked.
    pub fn sentinel_primary(&self) -> Option<u32> {
        let t = Duration::from_secs(1);
        let mut answer: Option<String> = None;
        let mut asked = 0;
        for s in self.live(Backend::Sentinel) {
            let reply = s.redis_query(
                &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_SERVICE],
                t,
            )?;
            let mut parts = reply.lines();
            let addr = format!("{}:{}", parts.next()?, parts.next()?);
            if answer.as_ref().is_some_and(|a| *a != addr) {
                return None;
            }
            answer = Some(addr);
            asked += 1;
        }
        if asked == 0 {
            return None;
        }
        let addr = answer?;
        let node = self.live(Backend::RedisHa).find(|s| s.addr == addr)?;
        let role = node.redis_query(&["ROLE"], t)?;
        (role.lines().next() == Some("master")).then_some(node.id)
    }

    /// Waits until the Sentinels agree on a primary other than node `old` of the
    /// [`Backend::RedisHa`] group (see [`State::sentinel_primary`]) and returns its id:
    /// the end of a failover.
    pub fn wait_failover(&self, old: u32, timeout: Duration) -> Result<u32> {
        poll(
            timeout,
            Duration::from_millis(100),
            || Ok(self.sentinel_primary().filter(|&id| id != old)),
            || {
                Error::Command {
                command: "wait for a Sentinel failover".into(),
                detail: format!(
                    "the Sentinels did not agree on a new primary (other than node {old}) within {} s",
                    timeout.as_secs()
                ),
            }
            },
        )
    }

    /// Waits until every live Sentinel sees the primary up: `SENTINEL MASTER` reports
    /// flags exactly `master` and a ping answered within the last 500 ms.
    ///
    /// Call it after [`State::wait_failover`] and before restarting the old primary.
    /// Right after `+switch-master` the Sentinels' links to the new primary are fresh,
    /// and one that misses `down-after-milliseconds` (1 s) on a loaded machine marks it
    /// down: with the old primary back as an empty master, that spurious failover
    /// promotes the empty node and loses the group's data (seen in the secured Sentinel
    /// self-test in 6 of 21 runs before this wait).
    pub fn wait_sentinels_see_primary_up(&self, timeout: Duration) -> Result<()> {
        let t = Duration::from_secs(1);
        let up = |reply: &str| {
            let fields: Vec<&str> = reply.lines().collect();
            let field = |name: &str| {
                fields
                    .chunks(2)
                    .find(|kv| kv.first() == Some(&name))
                    .and_then(|kv| kv.get(1).copied())
            };
            field("flags") == Some("master")
                && field("last-ok-ping-reply")
                    .and_then(|ms| ms.parse::<u64>().ok())
                    .is_some_and(|ms| ms <= 500)
        };
        poll(
            timeout,
            Duration::from_millis(100),
            || {
                let mut sentinels = self.live(Backend::Sentinel).peekable();
                let any = sentinels.peek().is_some();
                let all_up = sentinels.all(|s| {
                    s.redis_query(&["SENTINEL", "MASTER", SENTINEL_SERVICE], t)
                        .is_some_and(|r| up(&r))
                });
                Ok((any && all_up).then_some(()))
            },
            || {
                Error::Command {
                command: "wait for every Sentinel to see the primary up".into(),
                detail: format!(
                    "some Sentinel did not report the primary up (flags master, a ping answered within 500 ms) within {} s",
                    timeout.as_secs()
                ),
            }
            },
        )
    }

    /// Waits until the Sentinel group is whole: the Sentinels agree on a primary, every
    /// other running [`Backend::RedisHa`] node is its replica with the link up, and every
    /// live Sentinel lists each of those replicas as healthy (flags exactly `slave`), so a
    /// next failover has a replica to promote. Returns the primary's id.
    ///
    /// A restarted old primary comes back as an empty master; the Sentinels turn it into
    /// a replica after their next `INFO` poll of it (up to about 10 s).
    pub fn wait_sentinel_group(&self, timeout: Duration) -> Result<u32> {
        let t = Duration::from_secs(1);
        let whole = || {
            self.sentinel_primary().filter(|&primary| {
                let replicas: Vec<&Server> = self
                    .live(Backend::RedisHa)
                    .filter(|s| s.id != primary)
                    .collect();
                let linked = replicas.iter().all(|r| {
                    r.redis_query(&["INFO", "replication"], t).is_some_and(|i| {
                        i.contains("role:slave") && i.contains("master_link_status:up")
                    })
                });
                linked
                    && self.live(Backend::Sentinel).all(|sentinel| {
                        let listed = sentinel
                            .redis_query(&["SENTINEL", "REPLICAS", SENTINEL_SERVICE], t)
                            .map(|r| healthy_replicas(&r))
                            .unwrap_or_default();
                        replicas.iter().all(|r| listed.contains(&r.addr))
                    })
            })
        };
        poll(
            timeout,
            Duration::from_millis(200),
            || Ok(whole()),
            || Error::Command {
                command: "wait for the Sentinel group to be whole".into(),
                detail: format!(
                    "no agreed primary with every replica linked and known within {} s",
                    timeout.as_secs()
                ),
            },
        )
    }

    /// Polls [`State::zk_leader`], [`State::etcd_leader`] or, for [`Backend::RedisHa`],
    /// [`State::sentinel_primary`] until a leader shows up.
    ///
    /// Independent Redis masters and Sentinels have no leader; asking for one is
    /// [`Error::InvalidSpec`].
    pub fn wait_leader(&self, backend: Backend, timeout: Duration) -> Result<u32> {
        poll(
            timeout,
            Duration::from_millis(100),
            || match backend {
                Backend::Zookeeper => Ok(self.zk_leader()),
                Backend::Etcd => self.etcd_leader(),
                Backend::RedisHa => Ok(self.sentinel_primary()),
                Backend::Redis | Backend::Sentinel | Backend::RedisCluster => Err(
                    Error::InvalidSpec(format!("{backend} nodes have no leader")),
                ),
            },
            || Error::Command {
                command: format!("wait for {backend} leader"),
                detail: format!("no leader after {} s", timeout.as_secs()),
            },
        )
    }
}

/// The `ip:port` of every replica a flattened `SENTINEL REPLICAS` reply (see
/// [`crate::redis_query`]) lists with flags exactly `slave` (not down, not disconnected).
fn healthy_replicas(reply: &str) -> Vec<String> {
    let lines: Vec<&str> = reply.lines().collect();
    let mut out = Vec::new();
    let (mut ip, mut port, mut flags) = (None, None, None);
    let mut flush = |ip: &mut Option<&str>, port: &mut Option<&str>, flags: &mut Option<&str>| {
        if let (Some(i), Some(p), Some("slave")) = (ip.take(), port.take(), flags.take()) {
            out.push(format!("{i}:{p}"));
        }
    };
    for pair in lines.chunks(2) {
        let [k, v] = pair else { break };
        match *k {
            "name" => flush(&mut ip, &mut port, &mut flags),
            "ip" => ip = Some(v),
            "port" => port = Some(v),
            "flags" => flags = Some(v),
            _ => {}
        }
    }
    flush(&mut ip, &mut port, &mut flags);
    out
}

/// The endpoint whose member id equals the leader id in `etcdctl endpoint status -w json`.
fn parse_etcd_leader(json: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(json.trim()).ok()?;
    value.as_array()?.iter().find_map(|e| {
        let status = e.get("Status")?;
        let member = status.get("header")?.get("member_id")?.as_u64()?;
        let leader = status.get("leader")?.as_u64()?;
        (member == leader).then(|| e.get("Endpoint")?.as_str().map(str::to_string))?
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_etcdctl_status_json() {
        let json = r#"[{"Endpoint":"127.0.0.1:2379","Status":{"header":{"cluster_id":1,"member_id":11,"revision":5,"raft_term":2},"version":"3.4.23","dbSize":20480,"leader":12,"raftIndex":9,"raftTerm":2}},
                       {"Endpoint":"127.0.0.1:2479","Status":{"header":{"cluster_id":1,"member_id":12,"revision":5,"raft_term":2},"version":"3.4.23","dbSize":20480,"leader":12,"raftIndex":9,"raftTerm":2}}]"#;
        assert_eq!(parse_etcd_leader(json).as_deref(), Some("127.0.0.1:2479"));
        assert_eq!(parse_etcd_leader("[]"), None);
        assert_eq!(parse_etcd_leader("Error: context deadline exceeded"), None);
    }

    #[test]
    fn healthy_replicas_skips_down_ones() {
        let reply = "name\n127.0.0.1:6791\nip\n127.0.0.1\nport\n6791\nflags\nslave\n\
                     name\n127.0.0.1:6790\nip\n127.0.0.1\nport\n6790\nflags\ns_down,slave,disconnected";
        assert_eq!(healthy_replicas(reply), vec!["127.0.0.1:6791".to_string()]);
        assert!(healthy_replicas("").is_empty());
    }
}
