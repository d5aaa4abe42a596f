//! Starting a whole cluster, and the guard that tears it down.

use std::ops::{Deref, DerefMut};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::config::{etcd_argv, redis_argv, zk_argv, zoo_cfg};
use crate::error::io_ctx;
use crate::ports::{client_port, ports_in_use, MAX_PORT_OFFSET};
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
    /// Added to every port of the default layout (see [`crate::client_port`]).
    pub port_offset: u16,
    /// Where to write the state file; `None` keeps the state in memory only.
    pub state_path: Option<PathBuf>,
    /// Parent of the cluster's temporary directory; `None` means the system temp dir.
    pub base_dir: Option<PathBuf>,
}

impl Default for ClusterSpec {
    /// One node of each backend at the default ports, state in memory only.
    fn default() -> Self {
        ClusterSpec {
            zk: 1,
            etcd: 1,
            redis: 1,
            port_offset: 0,
            state_path: None,
            base_dir: None,
        }
    }
}

impl ClusterSpec {
    fn validate(&self) -> Result<()> {
        if self.zk > 5 || self.etcd > 5 || self.redis > 10 {
            return Err(Error::InvalidSpec(format!(
                "at most 5 ZooKeeper, 5 etcd and 10 Redis nodes (asked {}/{}/{})",
                self.zk, self.etcd, self.redis
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
        cluster.spawn_all(spec)?;
        for backend in Backend::ALL {
            let ids: Vec<u32> = cluster.state.servers_of(backend).map(|s| s.id).collect();
            for id in ids {
                cluster.state.wait_ready(backend, id, START_TIMEOUT)?;
            }
        }
        Ok(cluster)
    }

    fn spawn_all(&mut self, spec: &ClusterSpec) -> Result<()> {
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
            std::fs::write(&cfg, zoo_cfg(id, spec.zk, off, &data))
                .map_err(io_ctx(format!("writing {}", cfg.display())))?;
            self.spawn(Backend::Zookeeper, id, dir.clone(), zk_argv(&cfg))?;
        }
        for id in 1..=spec.etcd {
            let dir = self.node_dir(Backend::Etcd, id)?;
            let argv = etcd_argv(id, spec.etcd, off, &dir.join("data"));
            self.spawn(Backend::Etcd, id, dir, argv)?;
        }
        for id in 1..=spec.redis {
            let dir = self.node_dir(Backend::Redis, id)?;
            let argv = redis_argv(id, off, &dir);
            self.spawn(Backend::Redis, id, dir, argv)?;
        }
        Ok(())
    }

    fn node_dir(&self, backend: Backend, id: u32) -> Result<PathBuf> {
        let dir = self.state.root_dir.join(format!("{}{id}", backend.short()));
        std::fs::create_dir_all(&dir).map_err(io_ctx(format!("creating {}", dir.display())))?;
        Ok(dir)
    }

    fn spawn(&mut self, backend: Backend, id: u32, dir: PathBuf, argv: Vec<String>) -> Result<()> {
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
