//! Fault injection: what a round does to the holders (SIGKILL, SIGSTOP, a proxy cut) and
//! to the servers (leader kill, pause and nftables cut, Redis restart, clock jump, replica
//! promotion, Sentinel failover, Redis Cluster failover, master kill and slot reshard),
//! and the waits that tell the fault took.

use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use dlock_testkit::{Backend, Cluster};
use nix::sys::signal::Signal;
use rand::rngs::StdRng;
use rand::Rng as _;

use super::history::{self, now_us, Fault, Mode, Record};
use super::late::LateRequest;
use super::proxy::Proxy;
use super::scenario::{Recipe, Scenario};
use super::{wait_for, Group, Kind, Workers, SESSION, WAIT};

/// How long a late request is held at most, waiting for its sender to hold again.
const LATE_HOLD_MAX: Duration = Duration::from_secs(30);

/// True once a worker other than `victim` began a section after `t`.
fn other_began(records: &[Record], victim: u32, t: u64) -> bool {
    records.iter().any(
        |r| matches!(r, Record::Begin { worker, at_us, .. } if *worker != victim && *at_us > t),
    )
}

fn victim_lost_after(records: &[Record], victim: u32, t: u64) -> bool {
    records.iter().any(
        |r| matches!(r, Record::Lost { worker, at_us, .. } if *worker == victim && *at_us >= t),
    )
}

/// True while `worker` is inside a section begun after `since` that writes to the fenced
/// store (any section, for a semaphore's permit holders, which never write). Waiting for
/// a fresh section puts the fault near its start: a fault that hits a section about to
/// end tests little.
fn inside_writing(records: &[Record], worker: u32, recipe: Recipe, since: u64) -> bool {
    history::sections(records).iter().any(|s| {
        s.worker == worker
            && s.start_us > since
            && s.end_us.is_none()
            && (s.mode == Mode::Exclusive || recipe == Recipe::Semaphore)
    })
}

/// A holder fault as injected.
pub(super) struct Hit {
    pub(super) fault: Fault,
    /// A paused holder was inside a section that writes to the fenced store: its late
    /// write must reach the store.
    pub(super) exercised_fence: bool,
}

impl Hit {
    /// A fault at `t` on `victim` after which no lost signal is expected (the holder
    /// died, or only a request of it was delayed) and no late write either.
    fn unsignalled(t: u64, victim: u32) -> Hit {
        Hit {
            fault: Fault {
                at_us: t,
                victim: Some(victim),
                signal_from_us: None,
                paused: false,
                measure_margin: false,
            },
            exercised_fence: false,
        }
    }
}

/// How the victims reach the servers, where a holder fault goes through them.
pub(super) struct Links<'a> {
    /// `client-cut`: each victim's cuttable proxies.
    pub(super) cuts: &'a HashMap<u32, Vec<Proxy>>,
    /// `late-request`: each victim's frame proxies.
    pub(super) late: &'a HashMap<u32, LateRequest>,
}

/// Injects one holder fault of `scenario` on `victim` (of `group`), at a moment inside its
/// section drawn from `rng`, and waits until the lock serves another worker.
pub(super) fn inject_holder(
    scenario: Scenario,
    group: &Group,
    workers: &mut Workers,
    links: &Links<'_>,
    victim: u32,
    rng: &mut StdRng,
) -> anyhow::Result<Hit> {
    let h = || group.records();
    let recipe = group.recipe;
    let since = now_us();
    wait_for("the victim inside a new section", WAIT, || {
        Ok(inside_writing(&h()?, victim, recipe, since))
    })?;
    // When in the section the fault hits: the slow section lasts at least 300 ms.
    std::thread::sleep(Duration::from_millis(rng.gen_range(0..150)));
    let inside = inside_writing(&h()?, victim, recipe, since);
    match scenario {
        Scenario::HolderKill => {
            let t = now_us();
            workers.signal(victim, Signal::SIGKILL)?;
            eprintln!("  {}: killed worker {victim}", recipe.label());
            wait_for("another holder after the kill", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            })?;
            Ok(Hit::unsignalled(t, victim))
        }
        Scenario::HolderPause => {
            let t = now_us();
            workers.signal(victim, Signal::SIGSTOP)?;
            let stopped = Instant::now();
            let taken = wait_for("another holder while paused", WAIT, || {
                Ok(other_began(&h()?, victim, t))
            });
            // Stay paused past two sessions whatever happened, like a long GC pause.
            let min = 2 * SESSION + Duration::from_millis(rng.gen_range(1000..2000));
            if let Some(rest) = min.checked_sub(stopped.elapsed()) {
                std::thread::sleep(rest);
            }
            let resumed = now_us();
            workers.signal(victim, Signal::SIGCONT)?;
            eprintln!(
                "  {}: paused worker {victim} for {:.1?}",
                recipe.label(),
                stopped.elapsed()
            );
            taken?;
            // The resumed section finishes (its write is judged by the store) or its
            // dlock stops it.
            wait_for("the resumed section to end", WAIT, || {
                Ok(!history::in_section(&h()?, victim) || !workers.alive().contains(&victim))
            })?;
            Ok(Hit {
                fault: Fault {
                    at_us: t,
                    victim: Some(victim),
                    signal_from_us: Some(resumed),
                    paused: true,
                    measure_margin: false,
                },
                exercised_fence: inside && recipe != Recipe::Semaphore,
            })
        }
        Scenario::ClientCut => {
            let ps = links.cuts.get(&victim).context("victim without proxies")?;
            let t = now_us();
            for p in ps {
                p.cut();
            }
            eprintln!(
                "  {}: cut worker {victim} off from the servers",
                recipe.label()
            );
            let r = wait_for("the victim's lost signal and another holder", WAIT, || {
                let recs = h()?;
                // A victim still inside its section must be told; one whose section
                // ended first had nothing to lose.
                Ok(other_began(&recs, victim, t)
                    && (victim_lost_after(&recs, victim, t) || !history::in_section(&recs, victim)))
            });
            for p in ps {
                p.restore();
            }
            r?;
            Ok(Hit {
                fault: Fault {
                    at_us: t,
                    victim: Some(victim),
                    signal_from_us: Some(t),
                    paused: false,
                    // A free permit may go to another worker at once: the margin is a
                    // mutual-exclusion measure (the permit count is checked instead).
                    measure_margin: recipe != Recipe::Semaphore,
                },
                exercised_fence: false,
            })
        }
        Scenario::LateRequest => {
            let l = links
                .late
                .get(&victim)
                .context("victim without frame proxies")?;
            // Half the time the next enqueue (its put carries dlock's value header; an
            // election candidate's value is bare, so there the next request naming it).
            let enqueue = recipe != Recipe::Election && rng.gen_bool(0.5);
            let t = now_us();
            l.arm(&group.name, if enqueue { b"dlock1 " } else { b"" });
            wait_for("a request of the victim held", WAIT, || Ok(l.caught()))?;
            let held_at = now_us();
            eprintln!(
                "  {}: holding {} of worker {victim}: {}",
                recipe.label(),
                if enqueue {
                    "the next enqueue"
                } else {
                    "a request"
                },
                l.held_message()
            );
            // The client gives the request up (its timeout) and goes on. A held release
            // (or other request) arrives once the victim holds again, where a late
            // delete does the most harm; a held enqueue once the victim has held and
            // released again, so its put lands after the entry's removal. A victim that
            // does not get that far within the bound (others ahead, or it died) gets the
            // request late all the same.
            let again = wait_for("the victim in a later section", LATE_HOLD_MAX, || {
                let recs = h()?;
                Ok(if enqueue {
                    history::sections(&recs)
                        .iter()
                        .any(|s| s.worker == victim && s.start_us > held_at && s.end_us.is_some())
                } else {
                    inside_writing(&recs, victim, recipe, held_at)
                })
            });
            if enqueue && again.is_ok() {
                // A section's end is logged before its release is sent: let the
                // release reach the server first.
                std::thread::sleep(Duration::from_millis(200));
            }
            l.release();
            eprintln!(
                "  {}: let worker {victim}'s request through after {:.1} s{}",
                recipe.label(),
                (now_us() - held_at) as f64 / 1e6,
                match (again.is_ok(), enqueue) {
                    (true, true) => ", after the worker held and released again",
                    (true, false) => ", with the worker inside a later section",
                    (false, _) => "",
                }
            );
            Ok(Hit::unsignalled(t, victim))
        }
        other => bail!("{} is not a holder fault", other.label()),
    }
}

/// Waits until every group's lock served a worker (other than `victim`) after `t`.
fn wait_all_recovered(groups: &[Group], victim: u32, t: u64, what: &str) -> anyhow::Result<()> {
    for g in groups {
        wait_for(&format!("{what} ({})", g.recipe.label()), WAIT, || {
            Ok(other_began(&g.records()?, victim, t))
        })?;
    }
    Ok(())
}

/// Injects one server fault of `scenario` (for the Redis ones, while `victim` of
/// `anchor` is inside its section) and waits until every lock serves a worker again.
// Each argument is a different handle of the run (servers, groups, proxy, randomness);
// bundling them would only rename the list.
#[allow(clippy::too_many_arguments)]
pub(super) fn inject_server(
    scenario: Scenario,
    kind: Kind,
    cluster: &mut Cluster,
    groups: &[Group],
    anchor: &Group,
    vip: Option<&Proxy>,
    side: &HashMap<u32, Proxy>,
    primary: &mut u32,
    victim: u32,
    rng: &mut StdRng,
) -> anyhow::Result<Fault> {
    let h = || anchor.records();
    let recipe = anchor.recipe;
    let since = now_us();
    let wait_inside = |what: &str| {
        wait_for(what, WAIT, || {
            Ok(inside_writing(&h()?, victim, recipe, since))
        })
    };
    let long = 2 * SESSION + Duration::from_millis(rng.gen_range(1000..2000));
    let server_wide = |t: u64| Fault {
        at_us: t,
        victim: None,
        signal_from_us: None,
        paused: false,
        measure_margin: false,
    };
    // A fault under a holder that keeps running: it must be told before anyone else is
    // let in.
    let under_victim = |t: u64| Fault {
        at_us: t,
        victim: Some(victim),
        signal_from_us: Some(t),
        paused: false,
        measure_margin: recipe != Recipe::Semaphore,
    };
    // A fault that loses nothing (a manual failover, a slot moved): the holder keeps its
    // hold, so no lost signal is expected, and its own later sections are no recovery.
    let kept = |t: u64| Fault {
        at_us: t,
        victim: Some(victim),
        signal_from_us: None,
        paused: false,
        measure_margin: false,
    };
    match scenario {
        Scenario::LeaderKill => {
            let server = kind.server();
            let leader = cluster.wait_leader(server, WAIT)?;
            let t = now_us();
            cluster.kill(server, leader)?;
            eprintln!("  killed {server} leader (node {leader})");
            let recovered =
                wait_all_recovered(groups, u32::MAX, t, "a holder after the leader kill");
            cluster.restart(server, leader)?;
            eprintln!("  restarted node {leader}");
            recovered?;
            Ok(server_wide(t))
        }
        Scenario::LeaderPause => {
            let server = kind.server();
            let leader = cluster.wait_leader(server, WAIT)?;
            let t = now_us();
            cluster.stop(server, leader)?;
            std::thread::sleep(long);
            cluster.cont(server, leader)?;
            eprintln!("  paused {server} leader (node {leader}) for {long:.1?}");
            wait_all_recovered(groups, u32::MAX, t, "a holder after the leader pause")?;
            cluster.wait_leader(server, WAIT)?;
            Ok(server_wide(t))
        }
        Scenario::LeaderCut if kind == Kind::Etcd => {
            let leader = cluster.wait_leader(Backend::Etcd, WAIT)?;
            let t = now_us();
            let cut = isolate_etcd(cluster, leader)?;
            let said = format!("cut the etcd leader (node {leader}) off from its peers");
            keep_cut(cluster, Backend::Etcd, cut, long, groups, t, &said)?;
            Ok(server_wide(t))
        }
        Scenario::FollowerCut if kind == Kind::Etcd => {
            // A follower on its own: its clients still reach it, but it can neither
            // forward their keep-alives to the leader nor hear it; their lost signal must
            // fire before the leader expires their leases.
            let leader = cluster.wait_leader(Backend::Etcd, WAIT)?;
            let follower = cluster
                .servers_of(Backend::Etcd)
                .map(|s| s.id)
                .find(|id| *id != leader)
                .context("an etcd follower")?;
            let t = now_us();
            let cut = isolate_etcd(cluster, follower)?;
            let said =
                format!("cut etcd follower {follower} off from its peers (leader: node {leader})");
            keep_cut(cluster, Backend::Etcd, cut, long, groups, t, &said)?;
            Ok(server_wide(t))
        }
        Scenario::LeaderCut => {
            let leader = cluster.wait_leader(Backend::Zookeeper, WAIT)?;
            let (lq, le) = cluster.zk_peer_ports(leader);
            let pid = cluster.server(Backend::Zookeeper, leader)?.pid;
            // Connections the leader opened to the others' election ports, besides
            // everything to or from its own quorum and election ports.
            let mut pairs = Vec::new();
            let others: Vec<u32> = cluster
                .servers_of(Backend::Zookeeper)
                .map(|s| s.id)
                .filter(|id| *id != leader)
                .collect();
            for other in others {
                let (_, oe) = cluster.zk_peer_ports(other);
                for p in dlock_testkit::connections_of(pid, oe)? {
                    pairs.push((p, oe));
                }
            }
            let t = now_us();
            let cut = dlock_testkit::NetCut::new(&pairs, &[lq, le])?;
            let said = format!("cut the ZooKeeper leader (node {leader}) off from the quorum");
            keep_cut(cluster, Backend::Zookeeper, cut, long, groups, t, &said)?;
            Ok(server_wide(t))
        }
        Scenario::FollowerCut => {
            // A follower cut off from the leader keeps answering its clients' pings until
            // it notices (syncLimit x tickTime), while the leader expires their sessions
            // after the session timeout: its clients must be told by their own heartbeat.
            let leader = cluster.wait_leader(Backend::Zookeeper, WAIT)?;
            let (lq, _) = cluster.zk_peer_ports(leader);
            let follower = cluster
                .servers_of(Backend::Zookeeper)
                .map(|s| s.id)
                .find(|id| *id != leader)
                .context("a ZooKeeper follower")?;
            let pid = cluster.server(Backend::Zookeeper, follower)?.pid;
            // Right after an election (an earlier round's leader fault) a follower may
            // still be connecting to its new leader: wait for the connection to cut.
            let mut pairs: Vec<(u16, u16)> = Vec::new();
            wait_for(
                &format!("follower {follower} connected to the leader's quorum port {lq}"),
                WAIT,
                || {
                    pairs = dlock_testkit::connections_of(pid, lq)?
                        .into_iter()
                        .map(|p| (p, lq))
                        .collect();
                    Ok(!pairs.is_empty())
                },
            )?;
            let t = now_us();
            let cut = dlock_testkit::NetCut::new(&pairs, &[])?;
            let said =
                format!("cut ZooKeeper follower {follower} off from the leader (node {leader})");
            keep_cut(cluster, Backend::Zookeeper, cut, long, groups, t, &said)?;
            Ok(server_wide(t))
        }
        Scenario::ServerRestart => {
            wait_inside("the victim inside its section")?;
            let t = now_us();
            cluster.restart(Backend::Redis, 1)?;
            eprintln!("  restarted Redis node 1 (no persistence) under worker {victim}");
            wait_all_recovered(groups, victim, t, "another holder after the restart")?;
            Ok(under_victim(t))
        }
        Scenario::ClockJump => {
            wait_inside("the victim inside its section")?;
            let addr = cluster.server(Backend::Redis, 1)?.addr.clone();
            let jump_ms = (SESSION * 3 / 2).as_millis().to_string();
            let t = now_us();
            // What a forward jump of the server's wall clock does to locks: every key
            // with a TTL expires that much sooner, all at once. (libfaketime, which would
            // jump the clock itself, crashes Debian's redis-server at start.)
            redis_cli(&addr, &["EVAL", JUMP_SCRIPT, "0", &jump_ms])?;
            eprintln!(
                "  jumped Redis node 1's expiry clock forward {jump_ms} ms under worker {victim}"
            );
            wait_all_recovered(groups, victim, t, "another holder after the jump")?;
            Ok(under_victim(t))
        }
        Scenario::ReplicaPromotion => {
            let vip = vip.context("replica promotion without its proxy")?;
            let p = *primary;
            let r = if p == 1 { 2 } else { 1 };
            let p_addr = cluster.server(Backend::Redis, p)?.addr.clone();
            let r_addr = cluster.server(Backend::Redis, r)?.addr.clone();
            let link = replicate_through_link(&p_addr, &r_addr)?;
            // From here the replica sees none of the primary's writes.
            link.cut();
            let stopped = now_us();
            // The victim must hold an entry it created after the stop: its next section
            // after one that ended after the stop (every section is a new entry).
            wait_for(
                "the victim inside a section it queued for after the replica stopped",
                WAIT,
                || {
                    let secs = history::sections(&h()?);
                    let Some(first_end) = secs
                        .iter()
                        .filter(|s| s.worker == victim)
                        .filter_map(|s| s.end_us.filter(|&e| e > stopped))
                        .min()
                    else {
                        return Ok(false);
                    };
                    Ok(secs.iter().any(|s| {
                        s.worker == victim && s.start_us > first_end && s.end_us.is_none()
                    }))
                },
            )?;
            let t = now_us();
            cluster.kill(Backend::Redis, p)?;
            redis_cli(&r_addr, &["REPLICAOF", "NO", "ONE"])?;
            drop(link);
            vip.retarget(
                r_addr
                    .parse()
                    .with_context(|| format!("address {r_addr}"))?,
            )?;
            eprintln!(
                "  killed primary (node {p}) under worker {victim}; promoted node {r}, which never saw the hold"
            );
            *primary = r;
            let recovered =
                wait_all_recovered(groups, victim, t, "another holder on the promoted replica");
            // The old primary comes back empty, ready to be the next round's replica.
            cluster.restart(Backend::Redis, p)?;
            recovered?;
            Ok(under_victim(t))
        }
        Scenario::WaitedPromotion => {
            // `replica-promotion` with clients that wait for the replica (`?replicas=1`):
            // once the link is cut no grant or renewal counts, so the holder must be told
            // before its entry ends on the replica, which is then promoted.
            let vip = vip.context("waited promotion without its proxy")?;
            let p = *primary;
            let r = if p == 1 { 2 } else { 1 };
            let p_addr = cluster.server(Backend::Redis, p)?.addr.clone();
            let r_addr = cluster.server(Backend::Redis, r)?.addr.clone();
            let link = replicate_through_link(&p_addr, &r_addr)?;
            // Cut as the victim's section begins, so that it is still inside (its
            // sections last two sessions) when the others can take the lock.
            let armed = now_us();
            wait_for("the victim entering a section", WAIT, || {
                Ok(history::sections(&h()?)
                    .iter()
                    .any(|s| s.worker == victim && s.start_us > armed && s.end_us.is_none()))
            })?;
            link.cut();
            let t = now_us();
            // A whole session while the link is cut: the primary extends the holders'
            // entries (a renewal round every third of it), the replica never sees it,
            // and its copy of each ends one session after the last renewal it has.
            std::thread::sleep(SESSION);
            // The holders' door goes dark with the old primary: they reach no server
            // until it leads to the promoted one, a session later, so nothing but their
            // own lease tells them the lock is gone.
            for door in side.values() {
                door.cut();
            }
            cluster.kill(Backend::Redis, p)?;
            redis_cli(&r_addr, &["REPLICAOF", "NO", "ONE"])?;
            drop(link);
            let killed = now_us();
            // The promoted node needs a replica before the clients can take anything
            // there (they wait for one): the old primary comes back at once, empty, as
            // its replica (the next fault's link, or the round's end, replaces that).
            redis_cli(&r_addr, &["CONFIG", "SET", "repl-diskless-sync-delay", "0"])?;
            cluster.restart(Backend::Redis, p)?;
            let (host, port) = r_addr.rsplit_once(':').context("address")?;
            redis_cli(&p_addr, &["REPLICAOF", host, port])?;
            wait_for(
                "the old primary replicating the promoted node",
                WAIT,
                || {
                    Ok(redis_cli(&p_addr, &["INFO", "replication"])?
                        .contains("master_link_status:up"))
                },
            )?;
            let r_sock: std::net::SocketAddr = r_addr
                .parse()
                .with_context(|| format!("address {r_addr}"))?;
            // Everyone but the slow workers (the holders) moves, and can take what the
            // promoted node no longer has; a holder that counted renewals only the old
            // primary saw still believes it holds: two holders.
            vip.retarget(r_sock)?;
            eprintln!(
                "  cut the replica link under worker {victim}, killed primary (node {p}) {} ms later; promoted node {r}, its replica again {} ms after the kill",
                (killed - t) / 1000,
                (now_us() - killed) / 1000
            );
            // Past the longest lease a holder can count on, the holders move too.
            std::thread::sleep(SESSION);
            for door in side.values() {
                door.retarget(r_sock)?;
                door.restore();
            }
            *primary = r;
            wait_all_recovered(groups, victim, t, "another holder on the promoted replica")?;
            Ok(under_victim(t))
        }
        Scenario::SentinelFailover => {
            let primary = cluster.wait_sentinel_group(WAIT)?;
            wait_inside("the victim inside its section")?;
            let t = now_us();
            cluster.kill(Backend::RedisHa, primary)?;
            let promoted = cluster.wait_failover(primary, WAIT)?;
            eprintln!(
                "  killed the primary (node {primary}) under worker {victim}; the Sentinels promoted node {promoted} after {} ms",
                (now_us() - t) / 1000
            );
            let recovered =
                wait_all_recovered(groups, victim, t, "another holder after the failover");
            // Back only after the promotion (an empty master brought back earlier would
            // be kept as the primary) and once every Sentinel sees the promoted node up
            // (else a spurious second failover can promote the empty node), and whole
            // again before the next fault.
            cluster.wait_sentinels_see_primary_up(WAIT)?;
            cluster.restart(Backend::RedisHa, primary)?;
            cluster.wait_sentinel_group(WAIT)?;
            recovered?;
            Ok(under_victim(t))
        }
        Scenario::SentinelPartition => {
            // The old primary stays up and a master, and the stale Sentinel names it:
            // a client left there, or sent there on a (re)connection, takes locks that
            // others hold on the promoted replica unless it checks with the Sentinels.
            // Replication is left up, so what the holder did before the promotion
            // reaches the replica: nothing is lost, and nobody may overlap.
            let old = cluster.wait_sentinel_group(WAIT)?;
            let replica = cluster
                .servers_of(Backend::RedisHa)
                .find(|s| s.id != old)
                .context("a replica in the Sentinel group")?
                .clone();
            let primary_port = port_of(&cluster.server(Backend::RedisHa, old)?.addr)?;
            let replica_port = port_of(&replica.addr)?;
            let sentinels: Vec<(u32, u32, u16)> = cluster
                .servers_of(Backend::Sentinel)
                .map(|s| Ok((s.id, s.pid, port_of(&s.addr)?)))
                .collect::<anyhow::Result<_>>()?;
            if sentinels.len() < 3 {
                bail!("sentinel-partition needs three Sentinels");
            }
            // The first the clients' URL lists (the state's order): a client that
            // connects during the cut asks it first and is sent to the old primary.
            let stale = 0;
            let aware: Vec<(u32, u32, u16)> = sentinels
                .iter()
                .enumerate()
                .filter(|(i, _)| *i != stale)
                .map(|(_, s)| *s)
                .collect();
            let (stale_id, stale_pid, stale_port) = sentinels[stale];
            wait_inside("the victim inside its section")?;
            let t = now_us();
            let mut cuts = Vec::new();
            let mut peers: Vec<u16> = aware.iter().map(|s| s.2).collect();
            peers.push(replica_port);
            cuts.push(dlock_testkit::NetCut::isolate(stale_pid, &[], &peers));
            for (_, pid, _) in &aware {
                cuts.push(dlock_testkit::NetCut::isolate(
                    *pid,
                    &[],
                    &[stale_port, primary_port],
                ));
            }
            let aware_sentinel = cluster.server(Backend::Sentinel, aware[0].0)?.clone();
            let said = |ms| {
                eprintln!(
                    "  cut the primary (node {old}) off from Sentinels {} and {} and Sentinel {stale_id} off from them and the replica under worker {victim}; node {} promoted after {ms} ms, the old primary still up",
                    aware[0].0, aware[1].0, replica.id
                )
            };
            promote_behind_cuts(
                cuts,
                &aware_sentinel,
                &replica,
                long,
                "the Sentinel partition",
                t,
                said,
            )?;
            let recovered =
                wait_all_recovered(groups, u32::MAX, t, "a holder after the Sentinel partition");
            // The old primary rejoins as the new one's replica, and the stale Sentinel
            // learns the new primary, before the next fault.
            cluster.wait_sentinel_group(WAIT)?;
            recovered?;
            Ok(server_wide(t))
        }
        Scenario::SentinelSplit => {
            // The primary loses its replica and every Sentinel, not its clients: what a
            // holder renews or takes there before the Sentinels' +odown closes the
            // clients' fences never reaches the replica they promote, where the entry
            // runs out one lease after its last replicated renewal. Replication's
            // asynchrony, with a window of down-after-milliseconds: not guaranteed.
            let old = cluster.wait_sentinel_group(WAIT)?;
            let replica = cluster
                .servers_of(Backend::RedisHa)
                .find(|s| s.id != old)
                .context("a replica in the Sentinel group")?
                .clone();
            let primary_port = port_of(&cluster.server(Backend::RedisHa, old)?.addr)?;
            let sentinels: Vec<(u32, u32)> = cluster
                .servers_of(Backend::Sentinel)
                .map(|s| (s.id, s.pid))
                .collect();
            let watcher = cluster
                .server(
                    Backend::Sentinel,
                    sentinels.first().context("a Sentinel")?.0,
                )?
                .clone();
            wait_inside("the victim inside its section")?;
            let t = now_us();
            let mut cuts = vec![dlock_testkit::NetCut::isolate(
                replica.pid,
                &[],
                &[primary_port],
            )];
            for (_, pid) in &sentinels {
                cuts.push(dlock_testkit::NetCut::isolate(*pid, &[], &[primary_port]));
            }
            let said = |ms| {
                eprintln!(
                    "  cut the primary (node {old}) off from its replica and every Sentinel under worker {victim}; node {} promoted after {ms} ms, the old primary still up",
                    replica.id
                )
            };
            promote_behind_cuts(cuts, &watcher, &replica, long, "the primary's cut", t, said)?;
            let recovered =
                wait_all_recovered(groups, u32::MAX, t, "a holder after the primary's cut");
            // The old primary rejoins as the new one's replica before the next fault.
            cluster.wait_sentinel_group(WAIT)?;
            recovered?;
            Ok(server_wide(t))
        }
        Scenario::ClusterFailover => {
            let slot = lock_slot(anchor)?;
            let master = cluster.redis_cluster_master_of_slot(slot)?;
            let replica = cluster.redis_cluster_replica_of(master)?;
            let r_addr = cluster.server(Backend::RedisCluster, replica)?.addr.clone();
            wait_inside("the victim inside its section")?;
            let t = now_us();
            // Without FORCE: the master stops its clients until the replica has caught
            // up, so nothing acknowledged is lost and the holder keeps its hold.
            redis_cli(&r_addr, &["CLUSTER", "FAILOVER"])?;
            wait_for(&format!("node {replica} serving slot {slot}"), WAIT, || {
                Ok(cluster.redis_cluster_master_of_slot(slot).ok() == Some(replica))
            })?;
            eprintln!(
                "  CLUSTER FAILOVER on node {replica} (replica of node {master}, slot {slot}) under worker {victim}: master after {} ms",
                (now_us() - t) / 1000
            );
            wait_all_recovered(groups, victim, t, "another holder after the failover")?;
            cluster.wait_redis_cluster_ok(WAIT)?;
            Ok(kept(t))
        }
        Scenario::MasterKill => {
            let slot = lock_slot(anchor)?;
            let master = cluster.redis_cluster_master_of_slot(slot)?;
            let replica = cluster.redis_cluster_replica_of(master)?;
            let m_addr = cluster.server(Backend::RedisCluster, master)?.addr.clone();
            wait_inside("the victim inside its section")?;
            let t = now_us();
            cluster.kill(Backend::RedisCluster, master)?;
            wait_for(
                &format!("node {replica} promoted for slot {slot}"),
                WAIT,
                || Ok(cluster.redis_cluster_master_of_slot(slot).ok() == Some(replica)),
            )?;
            eprintln!(
                "  killed master node {master} (slot {slot}) under worker {victim}; its replica node {replica} promoted after {} ms",
                (now_us() - t) / 1000
            );
            let recovered =
                wait_all_recovered(groups, victim, t, "another holder after the promotion");
            // Back from its nodes.conf, as a replica of the promoted node: the cluster
            // whole again before the next fault.
            cluster.restart(Backend::RedisCluster, master)?;
            wait_for(&format!("node {master} back as a replica"), WAIT, || {
                Ok(redis_cli(&m_addr, &["ROLE"]).is_ok_and(|r| r.lines().next() == Some("slave")))
            })?;
            cluster.wait_redis_cluster_ok(WAIT)?;
            recovered?;
            Ok(under_victim(t))
        }
        Scenario::SlotReshard => {
            let slot = lock_slot(anchor)?;
            let from = cluster.redis_cluster_master_of_slot(slot)?;
            let others: Vec<u32> = cluster
                .redis_cluster_masters()?
                .into_iter()
                .filter(|m| *m != from)
                .collect();
            if others.is_empty() {
                bail!("no other master to move slot {slot} to");
            }
            let to = others[rng.gen_range(0..others.len())];
            // How long the slot stays migrating before its first key moves: new entries
            // meanwhile get TRYAGAIN (their keys would straddle the two nodes).
            let hold = Duration::from_millis(rng.gen_range(300..1500));
            wait_inside("the victim inside its section")?;
            let t = now_us();
            let moved =
                cluster.redis_cluster_move_slot(slot, to, hold, Duration::from_millis(20))?;
            if moved == 0 {
                bail!(
                    "slot {slot} held no key of {}: not the lock's slot",
                    anchor.name
                );
            }
            eprintln!(
                "  moved slot {slot} ({moved} keys) from node {from} to node {to} under worker {victim} in {} ms (migrating {hold:.1?} before the first key)",
                (now_us() - t) / 1000
            );
            wait_all_recovered(groups, victim, t, "another holder after the reshard")?;
            cluster.wait_redis_cluster_ok(WAIT)?;
            Ok(kept(t))
        }
        other => bail!("{} is not a server fault", other.label()),
    }
}

/// The Redis Cluster slot of `g`'s lock (of its first part, for a multi-lock): every key
/// of a lock carries the hash tag `{<name>}`, the queue key is `dlock:{<name>}:q`.
/// Under the nftables `cuts` (made just before, at `t`): waits until `sentinel` names
/// `replica` the primary, tells it with `said` (ms since `t`), and keeps the cuts for
/// `long`; then heals every cut that was made, on every path. Fails if a cut failed (with
/// its own error), the promotion did not come, or a heal failed.
fn promote_behind_cuts(
    cuts: Vec<dlock_testkit::Result<dlock_testkit::NetCut>>,
    sentinel: &dlock_testkit::Server,
    replica: &dlock_testkit::Server,
    long: Duration,
    what: &str,
    t: u64,
    said: impl FnOnce(u64),
) -> anyhow::Result<()> {
    let promoted = match cuts.iter().find_map(|c| c.as_ref().err()) {
        Some(e) => Err(anyhow::anyhow!("making {what}: {e}")),
        None => wait_for(
            &format!(
                "Sentinel {} naming node {} the primary",
                sentinel.id, replica.id
            ),
            WAIT,
            || {
                Ok(sentinel
                    .redis_query(
                        &[
                            "SENTINEL",
                            "GET-MASTER-ADDR-BY-NAME",
                            dlock_testkit::SENTINEL_SERVICE,
                        ],
                        Duration::from_secs(1),
                    )
                    .is_some_and(|r| r.lines().collect::<Vec<_>>().join(":") == replica.addr))
            },
        )
        .map(|()| {
            said((now_us() - t) / 1000);
            std::thread::sleep(long);
        }),
    };
    let mut healed = Ok(());
    for c in cuts.into_iter().flatten() {
        let h = c.heal();
        if healed.is_ok() {
            healed = h.with_context(|| format!("healing {what}"));
        }
    }
    promoted?;
    healed
}

fn lock_slot(g: &Group) -> anyhow::Result<u16> {
    let name = g
        .recipe
        .names(&g.name)
        .into_iter()
        .next()
        .context("a lock name")?;
    Ok(dlock_testkit::key_slot(&format!("dlock:{{{name}}}:q")))
}

/// Shortens the TTL of every key by `ARGV[1]` ms (deleting those it would take past zero),
/// as a forward jump of the server's clock would. The chaos servers hold nothing else.
const JUMP_SCRIPT: &str = "local n = 0 \
    for _, k in ipairs(redis.call('KEYS', '*')) do \
      local t = redis.call('PTTL', k) \
      if t > 0 then \
        if t <= tonumber(ARGV[1]) then redis.call('DEL', k) \
        else redis.call('PEXPIRE', k, t - tonumber(ARGV[1])) end \
        n = n + 1 \
      end \
    end \
    return n";

/// Keeps `cut` for `long`, heals it, says what it was, and waits until every lock
/// served a worker again and `server` has a leader.
fn keep_cut(
    cluster: &Cluster,
    server: Backend,
    cut: dlock_testkit::NetCut,
    long: Duration,
    groups: &[Group],
    t: u64,
    said: &str,
) -> anyhow::Result<()> {
    std::thread::sleep(long);
    cut.heal()?;
    eprintln!("  {said} for {long:.1?}");
    wait_all_recovered(groups, u32::MAX, t, &format!("a holder after: {said}"))?;
    cluster.wait_leader(server, WAIT)?;
    Ok(())
}

/// Cuts etcd member `id` off from the other members (not from its clients): etcd members
/// dial each other from ephemeral ports, so this needs [`dlock_testkit::NetCut::isolate`]
/// rather than a port cut.
fn isolate_etcd(cluster: &Cluster, id: u32) -> anyhow::Result<dlock_testkit::NetCut> {
    let pid = cluster.server(Backend::Etcd, id)?.pid;
    let peers: Vec<u16> = cluster
        .servers_of(Backend::Etcd)
        .map(|s| s.id)
        .filter(|other| *other != id)
        .map(|other| cluster.etcd_peer_port(other))
        .collect();
    Ok(dlock_testkit::NetCut::isolate(
        pid,
        &[cluster.etcd_peer_port(id)],
        &peers,
    )?)
}

/// `waited-promotion`: Redis node 2 replicates node 1 directly, in sync, before the
/// round's workers start: clients that wait for a replica grant nothing without one.
pub(super) fn attach_replica(cluster: &Cluster) -> anyhow::Result<()> {
    let primary = cluster.server(Backend::Redis, 1)?.addr.clone();
    let replica = cluster.server(Backend::Redis, 2)?.addr.clone();
    let (host, port) = primary.rsplit_once(':').context("address")?;
    redis_cli(&replica, &["REPLICAOF", host, port])?;
    wait_for("node 2 replicating node 1", WAIT, || {
        Ok(redis_cli(&replica, &["INFO", "replication"])?.contains("master_link_status:up"))
    })
}

/// Before every round on the Redis nodes: each one running and a master, as every
/// round but `waited-promotion` expects, whatever a round before left (a
/// `waited-promotion` round leaves a replica behind, and one that failed halfway may
/// leave its old primary down).
pub(super) fn reset_redis(cluster: &mut Cluster) -> anyhow::Result<()> {
    let down: Vec<u32> = cluster
        .servers_of(Backend::Redis)
        .filter(|s| !s.is_running())
        .map(|s| s.id)
        .collect();
    for id in down {
        cluster.restart(Backend::Redis, id)?;
    }
    for s in cluster.servers_of(Backend::Redis) {
        redis_cli(&s.addr, &["REPLICAOF", "NO", "ONE"])?;
    }
    Ok(())
}

/// Makes the Redis node at `replica` replicate the one at `primary` through a loopback
/// proxy, so that the stream can be cut for real, and waits until it is in sync. A
/// SIGSTOP of the replica would not do: the kernel keeps taking the stream into the
/// stopped process's socket buffer, and the replica applies all of it when it resumes,
/// holds included.
fn replicate_through_link(primary: &str, replica: &str) -> anyhow::Result<Proxy> {
    let link = Proxy::start(
        primary
            .parse()
            .with_context(|| format!("address {primary}"))?,
    )?;
    let link_addr = link.addr();
    redis_cli(primary, &["CONFIG", "SET", "repl-diskless-sync-delay", "0"])?;
    redis_cli(
        replica,
        &[
            "REPLICAOF",
            &link_addr.ip().to_string(),
            &link_addr.port().to_string(),
        ],
    )?;
    wait_for("the replica in sync", WAIT, || {
        Ok(redis_cli(replica, &["INFO", "replication"])?.contains("master_link_status:up"))
    })?;
    Ok(link)
}

/// Runs `redis-cli` against `addr` and returns its output; a Redis error is an error.
fn redis_cli(addr: &str, args: &[&str]) -> anyhow::Result<String> {
    let (host, port) = addr.rsplit_once(':').context("address")?;
    let out = Command::new("redis-cli")
        .args(["-h", host, "-p", port])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .context("running redis-cli")?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    if !out.status.success() || text.starts_with("ERR") {
        bail!("redis-cli -p {port} {}: {text}", args.join(" "));
    }
    Ok(text)
}

/// The port of a `host:port` address.
fn port_of(addr: &str) -> anyhow::Result<u16> {
    addr.rsplit(':')
        .next()
        .and_then(|p| p.parse().ok())
        .with_context(|| format!("no port in {addr:?}"))
}
