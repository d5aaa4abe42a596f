//! The Redis Cluster of a test cluster: forming it from its six started nodes, waiting
//! until it serves every slot, and asking it which node serves a key.

use std::process::Command;
use std::time::Duration;

use crate::state::poll;
use crate::{Backend, Error, Result, State};

/// One line of `CLUSTER NODES`, the fields the tests need.
#[derive(Debug, Clone, PartialEq, Eq)]
struct NodeLine {
    /// The node's cluster id (40 hex digits).
    node_id: String,
    /// `ip:port` of its client port.
    addr: String,
    /// A master (not flagged `fail`)?
    master: bool,
    /// Flagged `fail` or `fail?` by the node asked.
    failing: bool,
    /// For a replica, its master's node id.
    master_id: Option<String>,
    /// The slot ranges a master serves.
    slots: Vec<(u16, u16)>,
}

/// Parses a `CLUSTER NODES` reply:
/// `<id> <ip:port@bus[,hostname]> <flags> <master|-> <ping> <pong> <epoch> <link> <slot>...`.
fn parse_nodes(reply: &str) -> Vec<NodeLine> {
    reply
        .lines()
        .filter_map(|line| {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() < 8 {
                return None;
            }
            let addr = f[1].split('@').next()?.to_owned();
            let flags: Vec<&str> = f[2].split(',').collect();
            let failing = flags.iter().any(|x| *x == "fail" || *x == "fail?");
            let slots = f[8..]
                .iter()
                // Importing/migrating markers look like `[123->-id]`: not served.
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some((a.parse().ok()?, b.parse().ok()?)),
                    None => s.parse().ok().map(|n| (n, n)),
                })
                .collect();
            Some(NodeLine {
                node_id: f[0].to_owned(),
                addr,
                master: flags.contains(&"master"),
                failing,
                master_id: (f[3] != "-").then(|| f[3].to_owned()),
                slots,
            })
        })
        .collect()
}

/// The hash slot of `key` (CRC16/XMODEM of its hash tag, or of the whole key, mod 16384),
/// as the server computes it.
pub fn key_slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tagged = bytes.iter().position(|&b| b == b'{').and_then(|open| {
        let close = bytes[open + 1..].iter().position(|&b| b == b'}')?;
        (close > 0).then(|| &bytes[open + 1..open + 1 + close])
    });
    let mut crc: u16 = 0;
    for &b in tagged.unwrap_or(bytes) {
        crc ^= u16::from(b) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc % 16384
}

/// One slot moved from one master to another the way `redis-cli --cluster reshard` moves
/// it, one step at a time, so that a test can act between the steps: [`SlotMove::begin`]
/// (`CLUSTER SETSLOT <slot> IMPORTING` on the target, then `MIGRATING` on the source),
/// [`SlotMove::migrate`] (`MIGRATE ... KEYS` of chosen keys, which leaves the slot's keys
/// split between the two nodes: the source answers `ASK` for a key it no longer has and
/// `TRYAGAIN` for a multi-key command over keys it has only some of), and
/// [`SlotMove::finish`] (the rest of the keys, then `SETSLOT <slot> NODE <target>` on the
/// target, the source and every other master).
///
/// Dropped before [`SlotMove::assign`] (a failing test), it finishes the move, so that a
/// shared cluster is not left with a slot half moved.
#[derive(Debug)]
pub struct SlotMove {
    /// The slot being moved.
    pub slot: u16,
    /// `ip:port` of the master that served the slot.
    pub from: String,
    /// `ip:port` of the master that will.
    pub to: String,
    from_id: String,
    to_id: String,
    assigned: std::sync::atomic::AtomicBool,
}

/// One cluster node's answer to `args`, or an error naming the command and the reply.
fn cluster_cmd(addr: &str, args: &[&str]) -> Result<String> {
    let reply = crate::redis_query(addr, args, Duration::from_secs(10));
    match reply {
        Some(r) if !r.starts_with('-') => Ok(r),
        other => Err(Error::Command {
            command: format!("{addr}: {}", args.join(" ")),
            detail: other.unwrap_or_else(|| "no answer".into()),
        }),
    }
}

/// The cluster node id of the node at `addr` (`CLUSTER MYID`).
pub fn redis_cluster_node_id(addr: &str) -> Result<String> {
    cluster_cmd(addr, &["CLUSTER", "MYID"]).map(|r| r.trim().to_owned())
}

/// The client addresses of the masters (not flagged failing) that the node at `addr` knows.
pub fn redis_cluster_masters(addr: &str) -> Result<Vec<String>> {
    let nodes = cluster_cmd(addr, &["CLUSTER", "NODES"])?;
    Ok(parse_nodes(&nodes)
        .into_iter()
        .filter(|n| n.master && !n.failing)
        .map(|n| n.addr)
        .collect())
}

impl SlotMove {
    /// Marks `slot` importing on `to` and migrating on `from`, in that order (as
    /// redis-cli does: a source that answers `ASK` before the target accepts `ASKING`
    /// would send clients to a node that refuses them).
    pub fn begin(slot: u16, from: &str, to: &str) -> Result<SlotMove> {
        let m = SlotMove {
            slot,
            from: from.to_owned(),
            to: to.to_owned(),
            from_id: redis_cluster_node_id(from)?,
            to_id: redis_cluster_node_id(to)?,
            assigned: false.into(),
        };
        let s = slot.to_string();
        cluster_cmd(to, &["CLUSTER", "SETSLOT", &s, "IMPORTING", &m.from_id])?;
        cluster_cmd(from, &["CLUSTER", "SETSLOT", &s, "MIGRATING", &m.to_id])?;
        Ok(m)
    }

    /// Up to `n` keys of the slot still on the source (`CLUSTER GETKEYSINSLOT`).
    pub fn keys_left(&self, n: usize) -> Result<Vec<String>> {
        let r = cluster_cmd(
            &self.from,
            &[
                "CLUSTER",
                "GETKEYSINSLOT",
                &self.slot.to_string(),
                &n.to_string(),
            ],
        )?;
        Ok(r.lines()
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect())
    }

    /// Moves `keys` (of this slot) to the target in one `MIGRATE ... KEYS` (atomic per
    /// key: a key is on one node or the other, with its TTL). A key already gone (moved
    /// or expired) is skipped by the server.
    pub fn migrate(&self, keys: &[String]) -> Result<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let (host, port) = self.to.rsplit_once(':').ok_or_else(|| Error::Command {
            command: "MIGRATE".into(),
            detail: format!("bad target address {}", self.to),
        })?;
        let mut args = vec!["MIGRATE", host, port, "", "0", "5000", "KEYS"];
        args.extend(keys.iter().map(String::as_str));
        let r = cluster_cmd(&self.from, &args)?;
        if r != "OK" && r != "NOKEY" {
            return Err(Error::Command {
                command: format!("{}: MIGRATE {} keys", self.from, keys.len()),
                detail: r,
            });
        }
        Ok(())
    }

    /// Migrates every key left, `batch` at a time (`redis-cli`'s `--cluster-pipeline`);
    /// returns how many it moved. The slot stays migrating: the source now answers `ASK`
    /// for every key of it, until [`SlotMove::assign`].
    pub fn migrate_rest(&self, batch: usize) -> Result<usize> {
        let mut moved = 0;
        loop {
            let keys = self.keys_left(batch)?;
            if keys.is_empty() {
                return Ok(moved);
            }
            moved += keys.len();
            self.migrate(&keys)?;
        }
    }

    /// Assigns the slot to the target: `SETSLOT NODE` on the target first, then the
    /// source, then every other master the target knows, as redis-cli does. From here the
    /// source answers `MOVED` for the slot.
    pub fn assign(&self) -> Result<()> {
        let s = self.slot.to_string();
        let node = [
            "CLUSTER",
            "SETSLOT",
            s.as_str(),
            "NODE",
            self.to_id.as_str(),
        ];
        cluster_cmd(&self.to, &node)?;
        self.assigned
            .store(true, std::sync::atomic::Ordering::SeqCst);
        // A master that has just given up its last slot becomes a replica of the node
        // that took it (Redis 7, `cluster-allow-replica-migration`), and a replica refuses
        // `SETSLOT`: it takes the slot map from its master, so the refusal is no error.
        let tell = |addr: &str| match cluster_cmd(addr, &node) {
            Err(Error::Command { detail, .. }) if detail.contains("only with masters") => Ok(()),
            other => other.map(|_| ()),
        };
        tell(&self.from)?;
        for m in redis_cluster_masters(&self.to)? {
            if m != self.to && m != self.from {
                tell(&m)?;
            }
        }
        Ok(())
    }

    /// [`SlotMove::migrate_rest`], then [`SlotMove::assign`]: the rest of the move in one
    /// go. Returns how many keys it moved.
    pub fn finish(&self, batch: usize) -> Result<usize> {
        let moved = self.migrate_rest(batch)?;
        self.assign()?;
        Ok(moved)
    }
}

impl Drop for SlotMove {
    fn drop(&mut self) {
        if !self.assigned.load(std::sync::atomic::Ordering::SeqCst) {
            if let Err(e) = self.finish(100) {
                eprintln!(
                    "dlock-testkit: finishing the move of slot {}: {e}",
                    self.slot
                );
            }
        }
    }
}

/// The number of `kind` error replies (`ASK`, `MOVED`, `TRYAGAIN`, ...) the node at `addr`
/// has sent since it started (`INFO errorstats`).
pub fn redis_error_count(addr: &str, kind: &str) -> u64 {
    let field = format!("errorstat_{kind}:count=");
    crate::redis_query(addr, &["INFO", "errorstats"], Duration::from_secs(5))
        .and_then(|i| {
            i.lines().find_map(|l| {
                l.strip_prefix(field.as_str())
                    .and_then(|v| v.split(',').next())
                    .and_then(|v| v.trim().parse().ok())
            })
        })
        .unwrap_or(0)
}

impl State {
    /// Forms the Redis Cluster from its started nodes (`redis-cli --cluster create ...
    /// --cluster-replicas 1 --cluster-yes`: three masters, each with one replica), then
    /// waits until it serves every slot ([`State::wait_redis_cluster_ok`]). The nodes of
    /// a secured cluster are reached over TLS with the PKI's client certificate, as the
    /// administrator.
    pub(crate) fn create_redis_cluster(&self, timeout: Duration) -> Result<()> {
        let addrs: Vec<String> = self
            .servers_of(Backend::RedisCluster)
            .map(|s| s.addr.clone())
            .collect();
        let tls = self
            .servers_of(Backend::RedisCluster)
            .find_map(|s| s.tls.clone());
        let mut cmd = Command::new("redis-cli");
        if let Some(dir) = tls {
            let pki = crate::secure::Pki::in_dir(dir);
            cmd.arg("--tls")
                .arg("--cacert")
                .arg(&pki.ca)
                .arg("--cert")
                .arg(&pki.cert)
                .arg("--key")
                .arg(&pki.key)
                .args(["--user", crate::secure::REDIS_ADMIN_USER])
                .args(["--pass", crate::secure::REDIS_ADMIN_PASSWORD])
                .arg("--no-auth-warning");
        }
        cmd.arg("--cluster").arg("create").args(&addrs).args([
            "--cluster-replicas",
            "1",
            "--cluster-yes",
        ]);
        let out = cmd.output().map_err(|e| Error::Command {
            command: "redis-cli --cluster create".into(),
            detail: e.to_string(),
        })?;
        let text = String::from_utf8_lossy(&out.stdout);
        // redis-cli exits 0 on some failures: read what it says.
        if !out.status.success() || !text.contains("All 16384 slots covered") {
            return Err(Error::Command {
                command: format!("redis-cli --cluster create {}", addrs.join(" ")),
                detail: format!("{text}{}", String::from_utf8_lossy(&out.stderr)),
            });
        }
        self.wait_redis_cluster_ok(timeout)
    }

    /// Waits until every live Redis Cluster node reports `cluster_state:ok`, every live
    /// replica's link to its master is up, and every live node names the same master for
    /// every slot: the state after creation, a failover or a node's return.
    pub fn wait_redis_cluster_ok(&self, timeout: Duration) -> Result<()> {
        let t = Duration::from_secs(1);
        poll(
            timeout,
            Duration::from_millis(100),
            || {
                let mut views = Vec::new();
                for s in self.live(Backend::RedisCluster) {
                    let ok = s
                        .redis_query(&["CLUSTER", "INFO"], t)
                        .is_some_and(|i| i.contains("cluster_state:ok"));
                    let role = s
                        .redis_query(&["INFO", "replication"], t)
                        .unwrap_or_default();
                    let linked =
                        role.contains("role:master") || role.contains("master_link_status:up");
                    if !ok || !linked {
                        return Ok(None);
                    }
                    let nodes = s.redis_query(&["CLUSTER", "NODES"], t).unwrap_or_default();
                    let mut masters: Vec<(u16, u16, String)> = parse_nodes(&nodes)
                        .into_iter()
                        .filter(|n| n.master && !n.failing)
                        .flat_map(|n| {
                            n.slots
                                .into_iter()
                                .map(move |(a, b)| (a, b, n.addr.clone()))
                        })
                        .collect();
                    masters.sort();
                    views.push(masters);
                }
                let agreed = views.windows(2).all(|w| w[0] == w[1]);
                let covered = views.first().is_some_and(|v| {
                    v.iter().map(|(a, b, _)| u32::from(b - a) + 1).sum::<u32>() == 16384
                });
                Ok((agreed && covered).then_some(()))
            },
            || Error::Command {
                command: "wait for the Redis Cluster".into(),
                detail: format!(
                    "not ok after {} s\n{}",
                    timeout.as_secs(),
                    self.servers_of(Backend::RedisCluster)
                        .map(|s| format!("--- node {}:\n{}", s.id, s.log_tail(5)))
                        .collect::<Vec<_>>()
                        .join("\n")
                ),
            },
        )
    }

    /// The id of the [`Backend::RedisCluster`] node that serves `key`'s slot as master,
    /// as the first live node that answers sees it.
    pub fn redis_cluster_master_of(&self, key: &str) -> Result<u32> {
        self.redis_cluster_master_of_slot(key_slot(key))
    }

    /// The id of the [`Backend::RedisCluster`] node that serves `slot` as master, as the
    /// first live node that answers sees it.
    pub fn redis_cluster_master_of_slot(&self, slot: u16) -> Result<u32> {
        let lines = self.redis_cluster_nodes()?;
        let master = lines
            .iter()
            .find(|n| {
                n.master && !n.failing && n.slots.iter().any(|(a, b)| (*a..=*b).contains(&slot))
            })
            .ok_or_else(|| Error::Command {
                command: format!("find the master of slot {slot}"),
                detail: "no live master serves it".into(),
            })?;
        self.redis_cluster_id_of(&master.addr)
    }

    /// The id of a replica of the master node `master` (not flagged failing).
    pub fn redis_cluster_replica_of(&self, master: u32) -> Result<u32> {
        let master_addr = self.server(Backend::RedisCluster, master)?.addr.clone();
        let lines = self.redis_cluster_nodes()?;
        let master_id = lines
            .iter()
            .find(|n| n.addr == master_addr)
            .map(|n| n.node_id.clone())
            .ok_or_else(|| Error::Command {
                command: format!("find node {master_addr} in CLUSTER NODES"),
                detail: "not listed".into(),
            })?;
        let replica = lines
            .iter()
            .find(|n| !n.master && !n.failing && n.master_id.as_deref() == Some(master_id.as_str()))
            .ok_or_else(|| Error::Command {
                command: format!("find a replica of {master_addr}"),
                detail: "none listed".into(),
            })?;
        self.redis_cluster_id_of(&replica.addr)
    }

    /// The ids of the masters not flagged failing that serve at least one slot, as the
    /// first live node that answers sees them, in id order.
    pub fn redis_cluster_masters(&self) -> Result<Vec<u32>> {
        let mut ids = self
            .redis_cluster_nodes()?
            .iter()
            .filter(|n| n.master && !n.failing && !n.slots.is_empty())
            .map(|n| self.redis_cluster_id_of(&n.addr))
            .collect::<Result<Vec<u32>>>()?;
        ids.sort_unstable();
        Ok(ids)
    }

    /// Moves `slot` to the master `to` while clients keep using it, the way
    /// `redis-cli --cluster reshard` does (the steps of the `CLUSTER SETSLOT` reference):
    /// `IMPORTING` on the target, `MIGRATING` on the source, then each key in its own
    /// `MIGRATE` with `gap` between two (clients meanwhile get `ASK` for the moved keys,
    /// `TRYAGAIN` for a command over keys on both sides), then `SETSLOT ... NODE` on the
    /// target, the source and every other master. The slot stays migrating for `hold`
    /// before the first key moves. Returns how many keys moved; fails if the slot's
    /// master is `to` already.
    pub fn redis_cluster_move_slot(
        &self,
        slot: u16,
        to: u32,
        hold: Duration,
        gap: Duration,
    ) -> Result<usize> {
        let from = self.redis_cluster_master_of_slot(slot)?;
        if from == to {
            return Err(Error::Command {
                command: format!("move slot {slot} to node {to}"),
                detail: "that node serves it already".into(),
            });
        }
        let src = self.server(Backend::RedisCluster, from)?;
        let dst = self.server(Backend::RedisCluster, to)?;
        let step = SlotMove::begin(slot, &src.addr, &dst.addr)?;
        std::thread::sleep(hold);
        let mut moved = 0;
        loop {
            let keys = step.keys_left(100)?;
            if keys.is_empty() {
                break;
            }
            for k in keys {
                // One key per `MIGRATE` (`NOKEY`: it expired meanwhile).
                step.migrate(std::slice::from_ref(&k))?;
                moved += 1;
                std::thread::sleep(gap);
            }
        }
        step.assign()?;
        Ok(moved)
    }

    /// `CLUSTER NODES` of the first live node that answers, parsed.
    fn redis_cluster_nodes(&self) -> Result<Vec<NodeLine>> {
        self.live(Backend::RedisCluster)
            .find_map(|s| s.redis_query(&["CLUSTER", "NODES"], Duration::from_secs(1)))
            .map(|r| parse_nodes(&r))
            .filter(|l| !l.is_empty())
            .ok_or_else(|| Error::Command {
                command: "CLUSTER NODES".into(),
                detail: "no Redis Cluster node answered".into(),
            })
    }

    fn redis_cluster_id_of(&self, addr: &str) -> Result<u32> {
        self.servers_of(Backend::RedisCluster)
            .find(|s| s.addr == addr)
            .map(|s| s.id)
            .ok_or_else(|| Error::Command {
                command: format!("find the Redis Cluster node at {addr}"),
                detail: "not one of this cluster's nodes".into(),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_match_the_server() {
        // Values from `CLUSTER KEYSLOT` on Redis 7.0.
        assert_eq!(key_slot("dlock:{a}:q"), 15495);
        assert_eq!(key_slot("dlock:{res1}:q"), 9470);
        assert_eq!(key_slot("a"), 15495);
        // An empty tag hashes the whole key.
        assert_eq!(key_slot("{}a"), key_slot("{}a"));
        assert_ne!(key_slot("{}a"), key_slot("a"));
    }

    #[test]
    fn parses_cluster_nodes() {
        let reply = "\
a1 127.0.0.1:7001@7101 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@7102 master - 0 0 2 connected 5461-10922 [10923->-c3]
c3 127.0.0.1:7003@7103 master,fail - 0 0 3 connected
d4 127.0.0.1:7004@7104 slave a1 0 0 1 connected";
        let n = parse_nodes(reply);
        assert_eq!(n.len(), 4);
        assert_eq!(n[0].slots, vec![(0, 5460)]);
        assert_eq!(n[1].slots, vec![(5461, 10922)]);
        assert!(n[2].failing && n[2].master);
        assert_eq!(n[3].master_id.as_deref(), Some("a1"));
        assert_eq!(n[3].addr, "127.0.0.1:7004");
    }
}
