//! The scenario catalogue: the fault scenarios and the recipes they run on, which
//! backends each scenario applies to, and the seeded plan of a run's rounds.

use anyhow::Context as _;
use rand::rngs::StdRng;
use rand::{Rng as _, SeedableRng as _};

use super::{Kind, SESSION, SLOW_WORK_MS};

/// A fault scenario.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Scenario {
    HolderKill,
    HolderPause,
    ClientCut,
    LateRequest,
    LeaderKill,
    LeaderPause,
    LeaderCut,
    FollowerCut,
    ServerRestart,
    ClockJump,
    ReplicaPromotion,
    WaitedPromotion,
    SentinelFailover,
    SentinelPartition,
    SentinelSplit,
    ClusterFailover,
    MasterKill,
    SlotReshard,
}

impl Scenario {
    pub(super) const ALL: [Scenario; 18] = [
        Scenario::HolderKill,
        Scenario::HolderPause,
        Scenario::ClientCut,
        Scenario::LateRequest,
        Scenario::LeaderKill,
        Scenario::LeaderPause,
        Scenario::LeaderCut,
        Scenario::FollowerCut,
        Scenario::ServerRestart,
        Scenario::ClockJump,
        Scenario::ReplicaPromotion,
        Scenario::WaitedPromotion,
        Scenario::SentinelFailover,
        Scenario::SentinelPartition,
        Scenario::SentinelSplit,
        Scenario::ClusterFailover,
        Scenario::MasterKill,
        Scenario::SlotReshard,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Scenario::HolderKill => "holder-kill",
            Scenario::HolderPause => "holder-pause",
            Scenario::ClientCut => "client-cut",
            Scenario::LateRequest => "late-request",
            Scenario::LeaderKill => "leader-kill",
            Scenario::LeaderPause => "leader-pause",
            Scenario::LeaderCut => "leader-cut",
            Scenario::FollowerCut => "follower-cut",
            Scenario::ServerRestart => "server-restart",
            Scenario::ClockJump => "clock-jump",
            Scenario::ReplicaPromotion => "replica-promotion",
            Scenario::WaitedPromotion => "waited-promotion",
            Scenario::SentinelFailover => "sentinel-failover",
            Scenario::SentinelPartition => "sentinel-partition",
            Scenario::SentinelSplit => "sentinel-split",
            Scenario::ClusterFailover => "cluster-failover",
            Scenario::MasterKill => "master-kill",
            Scenario::SlotReshard => "slot-reshard",
        }
    }

    pub(super) fn describe(self) -> &'static str {
        match self {
            Scenario::HolderKill => "SIGKILL the holder (its process group) inside its section",
            Scenario::HolderPause => {
                "SIGSTOP the holder inside its section past two sessions, SIGCONT; the fenced store judges its late write"
            }
            Scenario::ClientCut => {
                "a loopback proxy between the holder and the servers stops forwarding past the session"
            }
            Scenario::LateRequest => {
                "a proxy between the holder and etcd holds its next request that names the lock (its release, most often) past the client's timeout, and lets it reach the server once the holder is inside a later section"
            }
            Scenario::LeaderKill => {
                "SIGKILL the server leader (ZooKeeper, etcd 3-node), restart it"
            }
            Scenario::LeaderPause => {
                "SIGSTOP the server leader (ZooKeeper, etcd 3-node) past two sessions, SIGCONT"
            }
            Scenario::LeaderCut => {
                "cut the leader off from the quorum past two sessions, heal (ZooKeeper: nftables on its quorum and election ports; etcd: on its peer port and, by cgroup, what it dials)"
            }
            Scenario::FollowerCut => {
                "cut a follower off from the leader past two sessions, its clients still reach it, heal (ZooKeeper: its quorum connection; etcd: all its peer traffic)"
            }
            Scenario::ServerRestart => {
                "restart Redis node 1 without persistence while a holder is inside"
            }
            Scenario::ClockJump => {
                "Redis node 1 expires keys as if its clock jumped forward by 1.5 sessions (every TTL shortened at once) while a holder is inside"
            }
            Scenario::ReplicaPromotion => {
                "promote a Redis replica that never saw the lock (its replication link cut, then the primary killed)"
            }
            Scenario::WaitedPromotion => {
                "clients with ?replicas=1: cut a Redis replica's replication link while a holder is inside, SIGKILL the primary after a renewal the replica missed, promote the replica; the old primary comes back as its replica"
            }
            Scenario::SentinelFailover => {
                "SIGKILL the Sentinel group's primary while a holder is inside; Sentinels promote the replica, clients follow"
            }
            Scenario::SentinelPartition => {
                "while a holder is inside, cut the Sentinel group's primary off from two Sentinels, which promote the replica, and the Sentinel the clients list first off from them and the replica, so it keeps naming the old primary, which stays up, a master, reachable by every client; heal after two sessions"
            }
            Scenario::SentinelSplit => {
                "while a holder is inside, cut the Sentinel group's primary off from its replica and every Sentinel, which promote the replica; the old primary stays up, a master, reachable by every client, and what is renewed or taken there until the Sentinels' +odown never reaches the promoted replica; heal after two sessions"
            }
            Scenario::ClusterFailover => {
                "CLUSTER FAILOVER on the replica of the lock's master while a holder is inside (a manual failover: the replica catches up first)"
            }
            Scenario::MasterKill => {
                "SIGKILL the Redis Cluster master of the lock's slot while a holder is inside; its replica is promoted, the old master rejoins as a replica"
            }
            Scenario::SlotReshard => {
                "move the lock's slot to another Redis Cluster master while a holder is inside and others wait (IMPORTING/MIGRATING, one MIGRATE per key)"
            }
        }
    }

    pub(super) fn parse(s: &str) -> anyhow::Result<Scenario> {
        Scenario::ALL
            .into_iter()
            .find(|sc| sc.label() == s.trim())
            .with_context(|| format!("unknown scenario {s:?}; `cargo xtask chaos --list`"))
    }

    pub(super) fn applies_to(self, kind: Kind) -> bool {
        match self {
            Scenario::LeaderKill | Scenario::LeaderPause => matches!(kind, Kind::Zk | Kind::Etcd),
            Scenario::LeaderCut | Scenario::FollowerCut => matches!(kind, Kind::Zk | Kind::Etcd),
            Scenario::ServerRestart | Scenario::ClockJump => {
                matches!(kind, Kind::Redis | Kind::Redlock)
            }
            Scenario::ReplicaPromotion | Scenario::WaitedPromotion => kind == Kind::Redis,
            // The Sentinel group is there for its failover; the holder faults behave as
            // on `redis`, and a proxy in front of the Sentinels would not cut the data
            // connection.
            Scenario::SentinelFailover | Scenario::SentinelPartition | Scenario::SentinelSplit => {
                kind == Kind::RedisSentinel
            }
            Scenario::ClusterFailover | Scenario::MasterKill | Scenario::SlotReshard => {
                kind == Kind::RedisCluster
            }
            Scenario::HolderKill | Scenario::HolderPause => kind != Kind::RedisSentinel,
            // Per-holder proxies cannot cut a Redis Cluster client: it connects to the
            // addresses the nodes announce in the slot map, not to its seeds, and a node
            // announces one address (`cluster-announce-ip/port`) for every client.
            Scenario::ClientCut => !matches!(kind, Kind::RedisSentinel | Kind::RedisCluster),
            // One request of a connection held while the others go on needs a protocol
            // of independent streams (HTTP/2): ZooKeeper and Redis answer a connection's
            // requests in order, so holding one holds all.
            Scenario::LateRequest => kind == Kind::Etcd,
        }
    }

    /// Whether the fault hits one worker per recipe (else the servers, under everyone).
    pub(super) fn hits_holders(self) -> bool {
        matches!(
            self,
            Scenario::HolderKill
                | Scenario::HolderPause
                | Scenario::ClientCut
                | Scenario::LateRequest
        )
    }

    /// Whether `kind` promises mutual exclusion under this fault. One Redis server
    /// (`redis://`, and `redis+sentinel://` and `redis+cluster://`, whose replication is
    /// asynchronous) does not when it forgets its keys: a restart without persistence, a
    /// replica promoted before it saw the lock (a Redis Cluster master killed, a Sentinel
    /// group's primary cut off from its replica while its clients still reach it). A manual
    /// `CLUSTER FAILOVER` and a slot migration lose nothing, so they promise it. Redlock keeps its majority when one master of five restarts. An
    /// etcd server with etcd#15247 (before 3.4.31 / 3.5.13) does not when its leader
    /// pauses past a lease: the resumed old leader revokes leases their clients kept
    /// alive elsewhere, so a holder's entry goes before its lost signal can fire.
    /// `waited-promotion` is `replica-promotion` with clients that wait for the replica
    /// (`?replicas=1`): what the replica did not acknowledge never counted, so it
    /// promises exclusion.
    pub(super) fn guaranteed_on(self, kind: Kind) -> bool {
        match (self, kind) {
            (Scenario::ServerRestart, Kind::Redis)
            | (Scenario::ClockJump, Kind::Redis)
            | (Scenario::ReplicaPromotion, Kind::Redis)
            | (Scenario::SentinelFailover, Kind::RedisSentinel)
            | (Scenario::SentinelSplit, Kind::RedisSentinel)
            | (Scenario::MasterKill, Kind::RedisCluster) => false,
            (Scenario::LeaderPause, Kind::Etcd) => !etcd_revokes_live_leases(),
            _ => true,
        }
    }

    /// How long a slow worker's section works: past the session where the fault must
    /// catch the holder inside for longer than that.
    pub(super) fn slow_work_ms(self) -> u64 {
        match self {
            Scenario::ClientCut
            | Scenario::ServerRestart
            | Scenario::ClockJump
            | Scenario::ReplicaPromotion
            | Scenario::WaitedPromotion
            | Scenario::SentinelFailover
            | Scenario::SentinelPartition
            | Scenario::SentinelSplit
            | Scenario::ClusterFailover
            | Scenario::MasterKill
            | Scenario::SlotReshard => 2 * SESSION.as_millis() as u64,
            _ => SLOW_WORK_MS,
        }
    }
}

/// A recipe under faults: each runs beside the others, on a lock of its own, with its own
/// workers, history and fenced store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Recipe {
    Mutex,
    /// The mutex, each section on a nested re-entry of the hold.
    ReentrantMutex,
    SemaphoreMutex,
    /// Writers that downgrade to a read hold, and readers.
    RwLock,
    /// Holders never above its permits.
    Semaphore,
    /// Two mutexes taken all-or-nothing.
    MultiLock,
    /// Leader election: candidates campaign, and the leader's section writes with its
    /// term as the fencing token (CLI workers through `dlock elect`).
    Election,
}

impl Recipe {
    pub(crate) const ALL: [Recipe; 7] = [
        Recipe::Mutex,
        Recipe::ReentrantMutex,
        Recipe::SemaphoreMutex,
        Recipe::RwLock,
        Recipe::Semaphore,
        Recipe::MultiLock,
        Recipe::Election,
    ];

    pub(crate) fn label(self) -> &'static str {
        match self {
            Recipe::Mutex => "mutex",
            Recipe::ReentrantMutex => "reentrant-mutex",
            Recipe::SemaphoreMutex => "semaphore-mutex",
            Recipe::RwLock => "rwlock",
            Recipe::Semaphore => "semaphore",
            Recipe::MultiLock => "multi-lock",
            Recipe::Election => "election",
        }
    }

    pub(crate) fn parse(s: &str) -> anyhow::Result<Recipe> {
        Recipe::ALL
            .into_iter()
            .find(|r| r.label() == s.trim())
            .with_context(|| {
                format!("unknown recipe {s:?}: expected mutex, reentrant-mutex, semaphore-mutex, rwlock, semaphore, multi-lock or election")
            })
    }

    /// The semaphore's permits (1 for the exclusive recipes).
    pub(super) fn permits(self) -> u32 {
        match self {
            Recipe::Semaphore => 2,
            _ => 1,
        }
    }

    /// The lock names its workers take (the multi-lock's two parts).
    pub(super) fn names(self, base: &str) -> Vec<String> {
        match self {
            Recipe::MultiLock => vec![format!("{base}/a"), format!("{base}/b")],
            _ => vec![base.to_string()],
        }
    }

    /// Its workers: (via, slow). The slow ones are the victims. The mutex and the election
    /// have CLI workers too (`dlock exec`, `dlock elect`); a semaphore of two permits has
    /// three workers, so one always waits.
    pub(super) fn workers(self) -> &'static [(&'static str, bool)] {
        match self {
            Recipe::Mutex | Recipe::Election => {
                &[("cli", true), ("cli", false), ("lib", true), ("lib", false)]
            }
            Recipe::Semaphore => &[("lib", true), ("lib", false), ("lib", false)],
            _ => &[("lib", true), ("lib", false)],
        }
    }
}

/// One round: a scenario on a backend, every random choice drawn from `seed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Round {
    pub(super) kind: Kind,
    pub(super) scenario: Scenario,
    pub(super) seed: u64,
}

/// Round `i`'s seed: `seed` itself for round 0, so a printed round seed replays alone.
fn round_seed(seed: u64, i: u32) -> u64 {
    if i == 0 {
        return seed;
    }
    // SplitMix64's mixer: well-spread seeds from consecutive indexes.
    let mut z = seed.wrapping_add(u64::from(i).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// The rounds of a run: with `rounds`, round i runs backend i (mod the backends) and a
/// scenario drawn from its seed; without, every backend x scenario once.
pub(super) fn plan(
    kinds: &[Kind],
    scenarios: &[Scenario],
    seed: u64,
    rounds: Option<u32>,
) -> Vec<Round> {
    match rounds {
        Some(n) => (0..n)
            .filter_map(|i| {
                let kind = kinds[i as usize % kinds.len()];
                let seed = round_seed(seed, i);
                let fits: Vec<Scenario> = scenarios
                    .iter()
                    .copied()
                    .filter(|s| s.applies_to(kind))
                    .collect();
                if fits.is_empty() {
                    return None;
                }
                let scenario = fits[StdRng::seed_from_u64(seed).gen_range(0..fits.len())];
                Some(Round {
                    kind,
                    scenario,
                    seed,
                })
            })
            .collect(),
        None => {
            let mut out = Vec::new();
            let mut i = 0;
            for &kind in kinds {
                for &scenario in scenarios.iter().filter(|s| s.applies_to(kind)) {
                    out.push(Round {
                        kind,
                        scenario,
                        seed: round_seed(seed, i),
                    });
                    i += 1;
                }
            }
            out
        }
    }
}

/// Whether the `etcd` binary the suite starts has etcd#15247
/// ([`dlock_etcd::revokes_live_leases_on_leader_resume`]); asked once per run. A binary
/// whose version cannot be read counts as affected.
fn etcd_revokes_live_leases() -> bool {
    static AFFECTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AFFECTED.get_or_init(|| {
        dlock_etcd::revokes_live_leases_on_leader_resume(&dlock_testkit::etcd_version())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn redis_cluster_gets_its_own_faults_and_no_client_cut() {
        let on: Vec<Scenario> = Scenario::ALL
            .into_iter()
            .filter(|s| s.applies_to(Kind::RedisCluster))
            .collect();
        assert_eq!(
            on,
            [
                Scenario::HolderKill,
                Scenario::HolderPause,
                Scenario::ClusterFailover,
                Scenario::MasterKill,
                Scenario::SlotReshard,
            ]
        );
        for s in [
            Scenario::ClusterFailover,
            Scenario::MasterKill,
            Scenario::SlotReshard,
        ] {
            assert!(
                Kind::ALL
                    .into_iter()
                    .all(|k| s.applies_to(k) == (k == Kind::RedisCluster)),
                "{} on Redis Cluster only",
                s.label()
            );
            assert_eq!(Scenario::parse(s.label()).ok(), Some(s));
        }
        // A killed master's replica may have missed the hold (asynchronous replication),
        // as with Sentinel; a manual failover and a slot move lose nothing.
        assert!(!Scenario::MasterKill.guaranteed_on(Kind::RedisCluster));
        assert!(!Scenario::SentinelFailover.guaranteed_on(Kind::RedisSentinel));
        assert!(!Scenario::SentinelSplit.guaranteed_on(Kind::RedisSentinel));
        assert!(Scenario::SentinelPartition.guaranteed_on(Kind::RedisSentinel));
        assert!(Scenario::ClusterFailover.guaranteed_on(Kind::RedisCluster));
        assert!(Scenario::SlotReshard.guaranteed_on(Kind::RedisCluster));
        assert!(Scenario::HolderPause.guaranteed_on(Kind::RedisCluster));
        // The same promotion, once with clients that wait for the replica.
        assert!(!Scenario::ReplicaPromotion.guaranteed_on(Kind::Redis));
        assert!(Scenario::WaitedPromotion.guaranteed_on(Kind::Redis));
        assert!(Kind::ALL
            .into_iter()
            .all(|k| Scenario::WaitedPromotion.applies_to(k) == (k == Kind::Redis)));
    }

    #[test]
    fn a_short_run_of_every_backend_has_a_cluster_round() {
        let kinds = Kind::ALL.to_vec();
        for seed in 0..20 {
            let rounds = plan(&kinds, &Scenario::ALL, seed, Some(kinds.len() as u32));
            assert_eq!(rounds.len(), kinds.len());
            let cluster: Vec<&Round> = rounds
                .iter()
                .filter(|r| r.kind == Kind::RedisCluster)
                .collect();
            assert_eq!(cluster.len(), 1, "seed {seed}: {rounds:?}");
            assert!(cluster[0].scenario.applies_to(Kind::RedisCluster));
        }
    }
}
