//! Starting a whole cluster, and the guard that tears it down.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::{
    etcd_argv, redis_argv, redis_ha_argv, secure_etcd_argv, secure_redis_argv,
    secure_redis_ha_argv, secure_sentinel_conf, secure_zk_argv, secure_zoo_cfg, sentinel_argv,
    sentinel_conf, zk_argv, zoo_cfg, SENTINELS, SENTINEL_SERVICE,
};
use crate::error::io_ctx;
use crate::ports::{client_port, ports_in_use, MAX_PORT_OFFSET};
use crate::secure::{pki_dir, setup_etcd_auth, Pki};
use crate::{Backend, Error, Result, Server, State};

/// How long a fresh cluster may take to become ready. Measured: 3–4 s for 11 servers under
/// load; the margin is for a machine busy compiling.
const START_TIMEOUT: Duration = Duration::from_secs(120);

static SPAWN_LOCK: Mutex<()> = Mutex::new(());

/// Serialises "spawn a server and record it in the state file".
///
/// A signal handler that tears a cluster down from its state file takes this lock first
/// and never releases it (it exits the process), so no server can be spawned after the
/// handler read the file and before the process ends: nothing is left running unrecorded.
pub fn spawn_lock() -> MutexGuard<'static, ()> {
    SPAWN_LOCK
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The shape of a cluster to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// ZooKeeper nodes: 0, 1 (standalone) or an ensemble of up to 5.
    pub zk: u32,
    /// etcd members: 0 to 5.
    pub etcd: u32,
    /// Independent Redis masters: 0 to 10.
    pub redis: u32,
    /// Replicas of the Sentinel group: 0 (no group) to 2. With 1 or more the cluster also
    /// runs a Redis primary ([`Backend::RedisHa`] node 1), these replicas (nodes 2..) and
    /// three Sentinels ([`Backend::Sentinel`], quorum 2) that fail over in seconds.
    pub sentinel_replicas: u32,
    /// Also a Redis Cluster of [`crate::CLUSTER_NODES`] nodes ([`Backend::RedisCluster`]):
    /// three masters with one replica each, formed and serving every slot before
    /// [`Cluster::start`] returns. In a secured cluster it speaks only TLS, on its client
    /// ports, its bus and its replication links, with the same ACL users on every node
    /// ([`crate::secure_redis_cluster_argv`]).
    pub redis_cluster: bool,
    /// Added to every port of the default layout (see [`crate::client_port`]).
    pub port_offset: u16,
    /// Where to write the state file; `None` keeps the state in memory only.
    pub state_path: Option<PathBuf>,
    /// Parent of the cluster's temporary directory; `None` means the system temp dir.
    pub base_dir: Option<PathBuf>,
    /// Start every server secured (see [`crate::secure`]): a fresh PKI in
    /// `<root_dir>/pki/`, TLS-only client ports that check client certificates,
    /// authentication and access control.
    pub secure: bool,
}

impl Default for ClusterSpec {
    /// One node of each backend at the default ports, state in memory only.
    fn default() -> Self {
        ClusterSpec {
            zk: 1,
            etcd: 1,
            redis: 1,
            sentinel_replicas: 0,
            redis_cluster: false,
            port_offset: 0,
            state_path: None,
            base_dir: None,
            secure: false,
        }
    }
}

impl ClusterSpec {
    fn validate(&self) -> Result<()> {
        if self.zk > 5 || self.etcd > 5 || self.redis > 10 || self.sentinel_replicas > 2 {
            return Err(Error::InvalidSpec(format!(
                "at most 5 ZooKeeper, 5 etcd, 10 Redis nodes and 2 Sentinel-group replicas (asked {}/{}/{}/{})",
                self.zk, self.etcd, self.redis, self.sentinel_replicas
            )));
        }
        if self.port_offset > MAX_PORT_OFFSET {
            return Err(Error::InvalidSpec(format!(
                "port offset {} above the maximum {MAX_PORT_OFFSET}",
                self.port_offset
            )));
        }
        Ok(())
    }
}

/// A started cluster. Dropping it kills every server and deletes its data, unless
/// [`Cluster::detach`]ed; it dereferences to its [`State`] for fault injection.
#[derive(Debug)]
pub struct Cluster {
    state: State,
    detached: bool,
}

impl Cluster {
    /// Starts every server of `spec` and waits until all answer their readiness probe.
    ///
    /// Fails without starting anything when a port is taken ([`Error::PortsInUse`]) or the
    /// state file names a cluster that is still running. On any later failure the servers
    /// already started are killed before the error is returned.
    pub fn start(spec: &ClusterSpec) -> Result<Cluster> {
        spec.validate()?;
        if let Some(path) = &spec.state_path {
            if path.exists() {
                if let Ok(old) = State::load(path) {
                    if old.servers.iter().any(Server::is_running) {
                        return Err(Error::InvalidSpec(format!(
                            "the cluster recorded in {} is still running; take it down first (cargo xtask cluster down)",
                            path.display()
                        )));
                    }
                    // Its processes are gone (machine rebooted, killed by hand): drop
                    // its data dir and file before reusing the path.
                    old.down()?;
                }
            }
        }
        let busy = ports_in_use(spec);
        if !busy.is_empty() {
            return Err(Error::PortsInUse { ports: busy });
        }
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let base = spec.base_dir.clone().unwrap_or_else(std::env::temp_dir);
        let root = base.join(format!(
            "dlock-cluster-{}-{}-{nanos}",
            spec.port_offset,
            std::process::id()
        ));
        std::fs::create_dir_all(&root).map_err(io_ctx(format!("creating {}", root.display())))?;
        let mut cluster = Cluster {
            state: State::new(root, spec.port_offset, spec.state_path.clone()),
            detached: false,
        };
        // On error `cluster` drops here and kills what was started.
        let pki = if spec.secure {
            let pki = Pki::generate(pki_dir(&cluster.state.root_dir))?;
            cluster.state.pki_dir = Some(pki.dir.clone());
            Some(pki)
        } else {
            None
        };
        cluster.spawn_all(spec, pki.as_ref())?;
        for backend in Backend::ALL {
            let ids: Vec<u32> = cluster.state.servers_of(backend).map(|s| s.id).collect();
            for id in ids {
                cluster.state.wait_ready(backend, id, START_TIMEOUT)?;
            }
        }
        if let Some(pki) = &pki {
            if spec.etcd > 0 {
                let endpoints = cluster
                    .state
                    .servers_of(Backend::Etcd)
                    .map(|s| format!("https://{}", s.addr))
                    .collect::<Vec<_>>()
                    .join(",");
                setup_etcd_auth(&endpoints, pki)?;
            }
        }
        if spec.sentinel_replicas > 0 {
            cluster.start_sentinel_group(spec, pki.as_ref())?;
        }
        if spec.redis_cluster {
            cluster.state.create_redis_cluster(START_TIMEOUT)?;
        }
        Ok(cluster)
    }

    /// Starts `spec` at the first offset of `candidates` where it can bind every port, and
    /// records that offset in `spec.port_offset`.
    ///
    /// A free-port check and the servers' own binds are separate moments, and a port can
    /// be taken in between by anything on the machine (a client's ephemeral port, another
    /// test's server). So a start that fails because a port turned out busy, found by the
    /// check in [`Cluster::start`] or by a server that exited saying its address is in use,
    /// moves on to the next candidate; any other failure is returned as it is.
    pub fn start_at_free_offset(
        spec: &mut ClusterSpec,
        candidates: impl IntoIterator<Item = u16>,
    ) -> Result<Cluster> {
        let mut last = None;
        for off in candidates {
            if off > MAX_PORT_OFFSET {
                break;
            }
            spec.port_offset = off;
            match Cluster::start(spec) {
                Ok(cluster) => return Ok(cluster),
                Err(e) if e.is_port_conflict() => last = Some(e),
                Err(e) => return Err(e),
            }
        }
        Err(last.unwrap_or_else(|| {
            Error::InvalidSpec("no candidate port offset has every port free".to_owned())
        }))
    }

    /// Starts the primary, then its replicas, then the Sentinels, each step once the
    /// previous one is ready: Sentinels learn of replicas from the primary's `INFO`, which
    /// they poll every 10 s, so Sentinels started before the replicas are in sync would
    /// not know them for 10 s (and a failover meanwhile finds no replica to promote).
    /// Returns once every Sentinel lists every replica and reports a usable quorum.
    fn start_sentinel_group(&mut self, spec: &ClusterSpec, pki: Option<&Pki>) -> Result<()> {
        let off = spec.port_offset;
        let tls = pki.map(|p| p.dir.clone());
        let primary_port = client_port(Backend::RedisHa, 1, off);
        let nodes = 1 + spec.sentinel_replicas;
        for id in 1..=nodes {
            let dir = self.node_dir(Backend::RedisHa, id)?;
            let primary = (id > 1).then_some(primary_port);
            let argv = match pki {
                None => redis_ha_argv(id, primary, off, &dir),
                Some(pki) => secure_redis_ha_argv(id, primary, off, &dir, pki),
            };
            self.spawn(Backend::RedisHa, id, dir, argv, tls.clone())?;
            self.state.wait_ready(Backend::RedisHa, id, START_TIMEOUT)?;
        }
        for id in 2..=nodes {
            let replica = self.state.server(Backend::RedisHa, id)?.clone();
            self.wait_group(&format!("replica {} in sync", replica.addr), || {
                replica
                    .redis_query(&["INFO", "replication"], Duration::from_secs(1))
                    .is_some_and(|info| info.contains("master_link_status:up"))
            })?;
        }
        for id in 1..=SENTINELS {
            let dir = self.node_dir(Backend::Sentinel, id)?;
            let cfg = dir.join("sentinel.conf");
            let text = match pki {
                None => sentinel_conf(id, primary_port, off, &dir),
                Some(pki) => secure_sentinel_conf(id, primary_port, off, &dir, pki),
            };
            std::fs::write(&cfg, text).map_err(io_ctx(format!("writing {}", cfg.display())))?;
            self.spawn(Backend::Sentinel, id, dir, sentinel_argv(&cfg), tls.clone())?;
        }
        let replica_ports: Vec<String> = (2..=nodes)
            .map(|id| client_port(Backend::RedisHa, id, off).to_string())
            .collect();
        for id in 1..=SENTINELS {
            self.state
                .wait_ready(Backend::Sentinel, id, START_TIMEOUT)?;
            let sentinel = self.state.server(Backend::Sentinel, id)?.clone();
            let addr = sentinel.addr.clone();
            let t = Duration::from_secs(1);
            self.wait_group(
                &format!("Sentinel {addr} to know every replica and a quorum"),
                || {
                    let replicas = sentinel
                        .redis_query(&["SENTINEL", "REPLICAS", SENTINEL_SERVICE], t)
                        .unwrap_or_default();
                    let known = replica_ports
                        .iter()
                        .all(|p| replicas.lines().any(|l| l == p.as_str()));
                    known
                        && sentinel
                            .redis_query(&["SENTINEL", "CKQUORUM", SENTINEL_SERVICE], t)
                            .is_some_and(|r| r.starts_with(&format!("OK {SENTINELS} usable")))
                },
            )?;
        }
        Ok(())
    }

    /// Polls `ready` every 100 ms until it holds, failing with the group's log tails
    /// after [`START_TIMEOUT`].
    fn wait_group(&self, what: &str, mut ready: impl FnMut() -> bool) -> Result<()> {
        let started = std::time::Instant::now();
        while !ready() {
            if started.elapsed() > START_TIMEOUT {
                let logs = self
                    .state
                    .servers
                    .iter()
                    .filter(|s| matches!(s.backend, Backend::RedisHa | Backend::Sentinel))
                    .map(|s| format!("--- {} {}:\n{}", s.backend, s.id, s.log_tail(10)))
                    .collect::<Vec<_>>()
                    .join("\n");
                return Err(Error::Command {
                    command: format!("wait for {what}"),
                    detail: format!("not after {} s\n{logs}", START_TIMEOUT.as_secs()),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(())
    }

    fn spawn_all(&mut self, spec: &ClusterSpec, pki: Option<&Pki>) -> Result<()> {
        let tls = pki.map(|p| p.dir.clone());
        let off = spec.port_offset;
        for id in 1..=spec.zk {
            let dir = self.node_dir(Backend::Zookeeper, id)?;
            let data = dir.join("data");
            std::fs::create_dir_all(&data)
                .map_err(io_ctx(format!("creating {}", data.display())))?;
            if spec.zk > 1 {
                let myid = data.join("myid");
                std::fs::write(&myid, format!("{id}\n"))
                    .map_err(io_ctx(format!("writing {}", myid.display())))?;
            }
            let cfg = dir.join("zoo.cfg");
            let (text, argv) = match pki {
                None => (zoo_cfg(id, spec.zk, off, &data), zk_argv(&cfg)),
                Some(pki) => (
                    secure_zoo_cfg(id, spec.zk, off, &data, pki),
                    secure_zk_argv(&cfg),
                ),
            };
            std::fs::write(&cfg, text).map_err(io_ctx(format!("writing {}", cfg.display())))?;
            self.spawn(Backend::Zookeeper, id, dir.clone(), argv, tls.clone())?;
        }
        for id in 1..=spec.etcd {
            let dir = self.node_dir(Backend::Etcd, id)?;
            let data = dir.join("data");
            let argv = match pki {
                None => etcd_argv(id, spec.etcd, off, &data),
                Some(pki) => secure_etcd_argv(id, spec.etcd, off, &data, pki),
            };
            self.spawn(Backend::Etcd, id, dir, argv, tls.clone())?;
        }
        for id in 1..=spec.redis {
            let dir = self.node_dir(Backend::Redis, id)?;
            let argv = match pki {
                None => redis_argv(id, off, &dir),
                Some(pki) => secure_redis_argv(id, off, &dir, pki),
            };
            self.spawn(Backend::Redis, id, dir, argv, tls.clone())?;
        }
        if spec.redis_cluster {
            for id in 1..=crate::config::CLUSTER_NODES {
                let dir = self.node_dir(Backend::RedisCluster, id)?;
                let argv = match pki {
                    None => crate::config::redis_cluster_argv(id, off, &dir),
                    Some(pki) => crate::config::secure_redis_cluster_argv(id, off, &dir, pki),
                };
                self.spawn(Backend::RedisCluster, id, dir, argv, tls.clone())?;
            }
        }
        Ok(())
    }

    fn node_dir(&self, backend: Backend, id: u32) -> Result<PathBuf> {
        let dir = self.state.root_dir.join(format!("{}{id}", backend.short()));
        std::fs::create_dir_all(&dir).map_err(io_ctx(format!("creating {}", dir.display())))?;
        Ok(dir)
    }

    fn spawn(
        &mut self,
        backend: Backend,
        id: u32,
        dir: PathBuf,
        argv: Vec<String>,
        tls: Option<PathBuf>,
    ) -> Result<()> {
        let server = Server {
            backend,
            id,
            addr: format!(
                "127.0.0.1:{}",
                client_port(backend, id, self.state.port_offset)
            ),
            pid: 0,
            start_time: 0,
            log_path: dir.join("out.log"),
            data_dir: dir,
            argv,
            tls,
        };
        let _guard = spawn_lock();
        self.state.push_spawned(server)
    }

    /// The cluster's state (also reachable through `Deref`).
    pub fn state(&self) -> &State {
        &self.state
    }

    /// Leaves the servers running and returns their state, e.g. for `cluster up`.
    pub fn detach(mut self) -> State {
        self.detached = true;
        let root = self.state.root_dir.clone();
        let offset = self.state.port_offset;
        let path = self.state.path().map(PathBuf::from);
        std::mem::replace(&mut self.state, State::new(root, offset, path))
    }

    /// Kills every server and deletes the data, reporting the first error (dropping does
    /// the same but can only print errors).
    pub fn down(mut self) -> Result<()> {
        self.detached = true;
        self.state.down_in_place()
    }
}

impl Deref for Cluster {
    type Target = State;
    fn deref(&self) -> &State {
        &self.state
    }
}

impl DerefMut for Cluster {
    fn deref_mut(&mut self) -> &mut State {
        &mut self.state
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if !self.detached {
            if let Err(e) = self.state.down_in_place() {
                eprintln!("dlock-testkit: tearing the cluster down: {e}");
            }
        }
    }
}
