//! The cluster state file and per-node operations: kill, stop, continue, restart (who
//! leads is asked in [`crate::leaders`]).

use std::collections::HashMap;
use std::fmt;
use std::fs::OpenOptions;
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::str::FromStr;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use serde::{Deserialize, Serialize};

use crate::config::SENTINEL_SERVICE;
use crate::error::io_ctx;
use crate::probe::{etcd_healthy_over, redis_ping_over, redis_query_over, zk_mode_over, ZkMode};
use crate::process::{self, is_alive, is_stopped, proc_stat};
use crate::{Endpoints, Error, Result};

/// How long a restarted node may take to answer its readiness probe. Generous: the machine
/// has two cores shared with compilers.
const READY_TIMEOUT: Duration = Duration::from_secs(90);

/// How long a SIGKILLed process may take to disappear.
const DEATH_TIMEOUT: Duration = Duration::from_secs(20);

/// One server kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// Apache ZooKeeper.
    Zookeeper,
    /// etcd (v3 API).
    Etcd,
    /// Redis: an independent master (the single-master and Redlock endpoints).
    Redis,
    /// A Redis of the Sentinel-monitored group: node 1 starts as the primary, the others
    /// as its replicas; after a failover any of them may be the primary
    /// ([`State::sentinel_primary`] says which).
    #[serde(rename = "redis-ha")]
    RedisHa,
    /// A Redis Sentinel watching the [`Backend::RedisHa`] group.
    Sentinel,
    /// A node of the Redis Cluster: six nodes, created as three masters with one replica
    /// each (which replica follows which master `redis-cli --cluster create` decides;
    /// after a failover any node may be a master: see [`State::redis_cluster_master_of`]).
    #[serde(rename = "redis-cluster")]
    RedisCluster,
}

impl Backend {
    /// All server kinds, in the order clusters start them.
    pub const ALL: [Backend; 6] = [
        Backend::Zookeeper,
        Backend::Etcd,
        Backend::Redis,
        Backend::RedisHa,
        Backend::Sentinel,
        Backend::RedisCluster,
    ];

    /// The short name used in URLs, directories and messages: `zk`, `etcd`, `redis`,
    /// `redis-ha`, `sentinel`, `redis-cluster`.
    pub fn short(self) -> &'static str {
        match self {
            Backend::Zookeeper => "zk",
            Backend::Etcd => "etcd",
            Backend::Redis => "redis",
            Backend::RedisHa => "redis-ha",
            Backend::Sentinel => "sentinel",
            Backend::RedisCluster => "redis-cluster",
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Backend::Zookeeper => "zookeeper",
            Backend::Etcd => "etcd",
            Backend::Redis => "redis",
            Backend::RedisHa => "redis-ha",
            Backend::Sentinel => "sentinel",
            Backend::RedisCluster => "redis-cluster",
        })
    }
}

impl FromStr for Backend {
    type Err = String;

    /// Accepts `zk`, `zookeeper`, `etcd`, `redis`, `redis-ha`, `sentinel`,
    /// `redis-cluster` (any case).
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "zk" | "zookeeper" => Ok(Backend::Zookeeper),
            "etcd" => Ok(Backend::Etcd),
            "redis" => Ok(Backend::Redis),
            "redis-ha" => Ok(Backend::RedisHa),
            "sentinel" => Ok(Backend::Sentinel),
            "redis-cluster" => Ok(Backend::RedisCluster),
            other => Err(format!(
                "unknown backend {other:?} (expected zk, etcd, redis, redis-ha, sentinel or redis-cluster)"
            )),
        }
    }
}

/// One server process as recorded in the state file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Server {
    /// Which server this is.
    pub backend: Backend,
    /// Node id, 1-based, unique per backend.
    pub id: u32,
    /// Client address, `127.0.0.1:PORT`.
    pub addr: String,
    /// PID of the current incarnation (updated by [`State::restart`]).
    pub pid: u32,
    /// Start time of that PID in clock ticks since boot (`/proc/PID/stat` field 22). A PID
    /// whose start time differs is a different process and is never signalled.
    pub start_time: u64,
    /// The node's own directory: working directory, config, data and log live here.
    pub data_dir: PathBuf,
    /// stdout and stderr of every incarnation, appended.
    pub log_path: PathBuf,
    /// The full command line; [`State::restart`] runs exactly this again.
    pub argv: Vec<String>,
    /// For a server of a secured cluster, the PKI directory ([`crate::secure::Pki`]) whose
    /// client certificate its probes present over TLS; `None` for a plain server (and in
    /// state files written before secured clusters existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tls: Option<PathBuf>,
}

impl Server {
    /// True when this incarnation is alive (a stopped process is alive; a zombie is not).
    pub fn is_running(&self) -> bool {
        is_alive(self.pid, self.start_time)
    }

    /// True when this incarnation is stopped by SIGSTOP.
    pub fn is_stopped(&self) -> bool {
        is_stopped(self.pid, self.start_time)
    }

    /// Probes the client port once: `srvr` mode, `/health`, or `PING` (over TLS with the
    /// cluster's client certificate for a secured server, as the Redis administrator).
    pub fn is_ready(&self, timeout: Duration) -> bool {
        let tls = self.tls.as_deref();
        match self.backend {
            Backend::Zookeeper => self.zk_mode(timeout).is_some(),
            Backend::Etcd => etcd_healthy_over(&self.addr, tls, timeout),
            Backend::Redis | Backend::RedisHa | Backend::Sentinel | Backend::RedisCluster => {
                redis_ping_over(&self.addr, tls, timeout)
            }
        }
    }

    /// The mode this ZooKeeper node reports in `srvr` ([`crate::zk_mode`]), over TLS for a
    /// secured node.
    pub fn zk_mode(&self, timeout: Duration) -> Option<ZkMode> {
        zk_mode_over(&self.addr, self.tls.as_deref(), timeout)
    }

    /// One Redis command to this node ([`crate::redis_query`]); for a secured node over
    /// TLS, logged in as the administrator.
    pub fn redis_query(&self, args: &[&str], timeout: Duration) -> Option<String> {
        redis_query_over(&self.addr, self.tls.as_deref(), args, timeout)
    }

    /// The last `lines` lines of the log, for error messages.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log_path).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Starts this server's argv in its data dir as a new process group, so it outlives the
    /// process that started it and a Ctrl-C in the terminal does not reach it.
    pub(crate) fn spawn(&mut self) -> Result<Child> {
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(io_ctx(format!("opening {}", self.log_path.display())))?;
        let log_err = log
            .try_clone()
            .map_err(io_ctx(format!("duplicating {}", self.log_path.display())))?;
        let (program, args) = self.argv.split_first().ok_or_else(|| {
            Error::InvalidSpec(format!(
                "{} node {} has an empty argv",
                self.backend, self.id
            ))
        })?;
        let child = Command::new(program)
            .args(args)
            .current_dir(&self.data_dir)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .process_group(0)
            .spawn()
            .map_err(io_ctx(format!("starting {}", self.argv.join(" "))))?;
        self.pid = child.id();
        // The stat exists as soon as fork returned; a process that already exited (bad
        // argv) leaves a zombie whose stat is still readable until we wait.
        self.start_time = proc_stat(self.pid).map(|s| s.start_time).unwrap_or(0);
        Ok(child)
    }
}

/// The default state file: `<workspace>/target/dlock-cluster/state.json`.
///
/// `workspace` is the directory holding the root `Cargo.toml`.
pub fn default_state_path(workspace: &Path) -> PathBuf {
    workspace
        .join("target")
        .join("dlock-cluster")
        .join("state.json")
}

/// A running (or once running) set of servers, loadable from another process.
///
/// The JSON file holds every [`Server`] with its argv, so any process can find, signal and
/// restart nodes. Methods that change a PID write the file back when the state has a path.
#[derive(Debug, Serialize, Deserialize)]
pub struct State {
    /// The temporary directory holding every node's data dir; deleted by [`State::down`].
    pub root_dir: PathBuf,
    /// The port offset the cluster was started with.
    pub port_offset: u16,
    /// Every server, in start order.
    pub servers: Vec<Server>,
    /// The PKI directory of a secured cluster ([`State::pki`]); `None` for a plain one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pki_dir: Option<PathBuf>,
    /// Where this state is saved, if anywhere.
    #[serde(skip)]
    path: Option<PathBuf>,
    /// Handles of the servers this process spawned, to reap them promptly after a kill.
    #[serde(skip)]
    children: HashMap<(Backend, u32), Child>,
}

impl State {
    /// An empty state rooted at `root_dir`, saved to `path` if given.
    pub(crate) fn new(root_dir: PathBuf, port_offset: u16, path: Option<PathBuf>) -> State {
        State {
            root_dir,
            port_offset,
            servers: Vec::new(),
            pki_dir: None,
            path,
            children: HashMap::new(),
        }
    }

    /// The ZooKeeper quorum and election ports of node `id` (where followers reach the
    /// leader, and where leader election runs), for cutting them with [`crate::NetCut`].
    pub fn zk_peer_ports(&self, id: u32) -> (u16, u16) {
        crate::ports::zk_peer_ports(id, self.port_offset)
    }

    /// The etcd peer port of node `id` (where the other members dial it), for
    /// [`crate::NetCut::isolate`].
    pub fn etcd_peer_port(&self, id: u32) -> u16 {
        crate::ports::etcd_peer_port(id, self.port_offset)
    }

    /// Reads a state file written by `cargo xtask cluster up` or [`crate::Cluster::start`].
    pub fn load(path: impl AsRef<Path>) -> Result<State> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path)
            .map_err(io_ctx(format!("reading state file {}", path.display())))?;
        let mut state: State = serde_json::from_str(&text).map_err(|source| Error::StateFile {
            path: path.to_path_buf(),
            source,
        })?;
        state.path = Some(path.to_path_buf());
        Ok(state)
    }

    /// Where this state is saved, if anywhere.
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }

    /// Writes the state file atomically (temp file + rename); a no-op without a path.
    pub fn save(&self) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io_ctx(format!("creating {}", dir.display())))?;
        }
        let text = serde_json::to_string_pretty(self).map_err(|source| Error::StateFile {
            path: path.clone(),
            source,
        })?;
        let tmp = path.with_extension(format!("json.tmp{}", std::process::id()));
        std::fs::write(&tmp, text).map_err(io_ctx(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(io_ctx(format!("renaming to {}", path.display())))
    }

    /// Writes one server's record into the state file, keeping every other record as the
    /// file has it (another process may have updated those).
    fn record(&self, server: &Server) -> Result<()> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let mut on_disk = match State::load(path) {
            Ok(state) => state,
            Err(_) => return self.save(),
        };
        match on_disk
            .servers
            .iter_mut()
            .find(|s| s.backend == server.backend && s.id == server.id)
        {
            Some(slot) => *slot = server.clone(),
            None => on_disk.servers.push(server.clone()),
        }
        on_disk.save()
    }

    /// The server `id` of `backend`.
    pub fn server(&self, backend: Backend, id: u32) -> Result<&Server> {
        self.servers
            .iter()
            .find(|s| s.backend == backend && s.id == id)
            .ok_or(Error::UnknownServer { backend, id })
    }

    fn server_index(&self, backend: Backend, id: u32) -> Result<usize> {
        self.servers
            .iter()
            .position(|s| s.backend == backend && s.id == id)
            .ok_or(Error::UnknownServer { backend, id })
    }

    /// The servers of one backend, by id.
    pub fn servers_of(&self, backend: Backend) -> impl Iterator<Item = &Server> {
        self.servers.iter().filter(move |s| s.backend == backend)
    }

    /// Comma-separated client addresses of one backend (`127.0.0.1:2181,127.0.0.1:2182`).
    pub fn addrs(&self, backend: Backend) -> String {
        self.servers_of(backend)
            .map(|s| s.addr.as_str())
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The endpoints of this cluster, in the `DLOCK_TEST_*` format.
    ///
    /// `redis` is the first Redis node; `redlock` lists all Redis nodes when there are
    /// more than one; `redis_sentinel` lists the Sentinels and the service name
    /// (`h:p,h:p,h:p/mymaster`) when the cluster has a Sentinel group; `redis_cluster`
    /// every node of the Redis Cluster (all are seeds) when it has one; `state` is this
    /// state's file.
    ///
    /// A secured cluster has none of these (every field `None`): plain clients cannot
    /// talk to it, so its endpoints are only the full URLs of [`State::secure_env`].
    pub fn endpoints(&self) -> Endpoints {
        if self.pki_dir.is_some() {
            return Endpoints::default();
        }
        let non_empty = |s: String| (!s.is_empty()).then_some(s);
        let redis: Vec<&Server> = self.servers_of(Backend::Redis).collect();
        Endpoints {
            zk: non_empty(self.addrs(Backend::Zookeeper)),
            etcd: non_empty(self.addrs(Backend::Etcd)),
            redis: redis.first().map(|s| s.addr.clone()),
            redlock: (redis.len() > 1).then(|| self.addrs(Backend::Redis)),
            redis_sentinel: non_empty(self.addrs(Backend::Sentinel))
                .map(|s| format!("{s}/{SENTINEL_SERVICE}")),
            redis_cluster: non_empty(self.addrs(Backend::RedisCluster)),
            state: self.path.clone(),
        }
    }

    pub(crate) fn push_spawned(&mut self, mut server: Server) -> Result<()> {
        let child = server.spawn()?;
        self.children.insert((server.backend, server.id), child);
        self.servers.push(server);
        self.save()
    }

    /// SIGKILLs node `id` of `backend` and waits until it is gone (or a zombie).
    ///
    /// A node that is already dead is fine. The node stays in the state so it can be
    /// [`State::restart`]ed; its data dir is kept.
    pub fn kill(&mut self, backend: Backend, id: u32) -> Result<()> {
        let idx = self.server_index(backend, id)?;
        self.servers[idx] = self.current(backend, id)?;
        let (pid, start) = (self.servers[idx].pid, self.servers[idx].start_time);
        process::signal(pid, start, Signal::SIGKILL)?;
        self.reap(backend, id, pid)?;
        process::wait_dead(pid, start, DEATH_TIMEOUT)
    }

    /// Reaps our child handle of node `id` if we hold one (prompt, and leaves no zombie).
    fn reap(&mut self, backend: Backend, id: u32, pid: u32) -> Result<()> {
        if let Some(mut child) = self.children.remove(&(backend, id)) {
            if child.id() == pid {
                child
                    .wait()
                    .map_err(io_ctx(format!("waiting for pid {pid}")))?;
            } else {
                // An older incarnation, killed before; collect it if it is done.
                let _ = child.try_wait();
            }
        }
        Ok(())
    }

    /// The freshest record of node `id`: the state file's when there is one (another
    /// process may have restarted the node and recorded its new PID), else our own.
    fn current(&self, backend: Backend, id: u32) -> Result<Server> {
        let on_disk = self
            .path
            .as_ref()
            .and_then(|p| State::load(p).ok())
            .and_then(|st| st.server(backend, id).ok().cloned());
        match on_disk {
            Some(server) => Ok(server),
            None => self.server(backend, id).cloned(),
        }
    }

    /// SIGSTOPs node `id` of `backend` (a hang: connections stay open, nothing answers) and
    /// waits until the kernel reports it stopped.
    pub fn stop(&self, backend: Backend, id: u32) -> Result<()> {
        let s = &self.current(backend, id)?;
        if process::signal(s.pid, s.start_time, Signal::SIGSTOP)?
            && !process::wait_stopped(s.pid, s.start_time, Duration::from_secs(10))
        {
            return Err(Error::Command {
                command: format!("SIGSTOP pid {}", s.pid),
                detail: "process did not enter the stopped state".into(),
            });
        }
        Ok(())
    }

    /// SIGCONTs node `id` of `backend` after [`State::stop`].
    pub fn cont(&self, backend: Backend, id: u32) -> Result<()> {
        let s = &self.current(backend, id)?;
        process::signal(s.pid, s.start_time, Signal::SIGCONT)?;
        Ok(())
    }

    /// Starts node `id` of `backend` again with the same argv and data dir, records the new
    /// PID (saving the state file), and waits until it answers its readiness probe.
    ///
    /// A node that is still running is killed first, so this is also "bounce the node".
    /// For an ensemble member, readiness means it rejoined a quorum.
    pub fn restart(&mut self, backend: Backend, id: u32) -> Result<()> {
        self.kill(backend, id)?;
        let idx = self.server_index(backend, id)?;
        let child = {
            let _guard = crate::cluster::spawn_lock();
            let child = self.servers[idx].spawn()?;
            self.record(&self.servers[idx])?;
            child
        };
        self.children.insert((backend, id), child);
        self.wait_ready(backend, id, READY_TIMEOUT)
    }

    /// Waits until node `id` of `backend` answers its readiness probe.
    ///
    /// Fails early with [`Error::Exited`] when the process dies meanwhile.
    pub fn wait_ready(&self, backend: Backend, id: u32, timeout: Duration) -> Result<()> {
        let s = self.server(backend, id)?;
        poll(
            timeout,
            Duration::from_millis(100),
            || {
                if !s.is_running() {
                    return Err(Error::Exited {
                        backend,
                        id,
                        log_tail: s.log_tail(20),
                    });
                }
                Ok(s.is_ready(Duration::from_secs(1)).then_some(()))
            },
            || Error::NotReady {
                backend,
                id,
                addr: s.addr.clone(),
                waited_secs: timeout.as_secs(),
                log_tail: s.log_tail(20),
            },
        )
    }

    /// Live (running and not stopped) servers of one backend.
    pub(crate) fn live(&self, backend: Backend) -> impl Iterator<Item = &Server> {
        self.servers_of(backend)
            .filter(|s| s.is_running() && !s.is_stopped())
    }

    /// Kills every server (SIGKILL, then reap or poll until gone), deletes the data
    /// directory and the state file.
    ///
    /// Processes whose recorded start time no longer matches are left alone: they are
    /// someone else's.
    pub fn down(mut self) -> Result<()> {
        self.down_in_place()
    }

    pub(crate) fn down_in_place(&mut self) -> Result<()> {
        let mut first_error = None;
        self.merge_from_file();
        // Signal everything first so etcd members do not wait on each other, then wait.
        for s in &self.servers {
            if let Err(e) = process::signal(s.pid, s.start_time, Signal::SIGKILL) {
                first_error.get_or_insert(e);
            }
        }
        let servers = self.servers.clone();
        for s in &servers {
            let waited = self
                .reap(s.backend, s.id, s.pid)
                .and_then(|()| process::wait_dead(s.pid, s.start_time, DEATH_TIMEOUT));
            if let Err(e) = waited {
                first_error.get_or_insert(e);
            }
        }
        // Only delete what we created: a directory named like ours.
        let ours = self
            .root_dir
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("dlock-cluster-"));
        if ours && self.root_dir.exists() {
            if let Err(e) = std::fs::remove_dir_all(&self.root_dir) {
                first_error.get_or_insert(Error::Io {
                    context: format!("removing {}", self.root_dir.display()),
                    source: e,
                });
            }
        }
        if let Some(path) = &self.path {
            match std::fs::remove_file(path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    first_error.get_or_insert(Error::Io {
                        context: format!("removing {}", path.display()),
                        source: e,
                    });
                }
            }
        }
        self.servers.clear();
        match first_error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl State {
    /// Adds the servers the state file records that this in-memory state does not know:
    /// another process (a fault test) may have restarted a node and written its new PID
    /// there. Both incarnations are then killed; the start-time guard makes killing a
    /// stale one a no-op.
    fn merge_from_file(&mut self) {
        let Some(path) = &self.path else { return };
        let Ok(on_disk) = State::load(path) else {
            return;
        };
        for server in on_disk.servers {
            let known = self
                .servers
                .iter()
                .any(|s| s.pid == server.pid && s.start_time == server.start_time);
            if !known {
                self.servers.push(server);
            }
        }
    }
}

/// Calls `probe` every `every` until it yields a value (or an error, which ends the wait)
/// or `timeout` has passed; then the error is `timed_out()`. The probe always runs at
/// least once.
pub(crate) fn poll<T>(
    timeout: Duration,
    every: Duration,
    mut probe: impl FnMut() -> Result<Option<T>>,
    timed_out: impl FnOnce() -> Error,
) -> Result<T> {
    let started = Instant::now();
    loop {
        if let Some(v) = probe()? {
            return Ok(v);
        }
        if started.elapsed() > timeout {
            return Err(timed_out());
        }
        std::thread::sleep(every);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_state(path: PathBuf) -> State {
        let mut state = State::new(PathBuf::from("/tmp/dlock-cluster-test"), 7, Some(path));
        state.servers.push(Server {
            backend: Backend::Zookeeper,
            id: 1,
            addr: "127.0.0.1:2188".into(),
            pid: 4242,
            start_time: 99,
            data_dir: "/tmp/dlock-cluster-test/zk1".into(),
            log_path: "/tmp/dlock-cluster-test/zk1/out.log".into(),
            argv: vec!["java".into(), "-cp".into(), "x".into(), String::new()],
            tls: None,
        });
        state.servers.push(Server {
            backend: Backend::Redis,
            id: 1,
            addr: "127.0.0.1:6386".into(),
            pid: 4243,
            start_time: 100,
            data_dir: "/tmp/dlock-cluster-test/redis1".into(),
            log_path: "/tmp/dlock-cluster-test/redis1/out.log".into(),
            argv: vec!["redis-server".into()],
            tls: None,
        });
        state
    }

    #[test]
    fn state_file_round_trips() {
        let dir = std::env::temp_dir().join(format!("dlock-testkit-rt-{}", std::process::id()));
        let path = dir.join("nested").join("state.json");
        let state = sample_state(path.clone());
        state.save().expect("save");
        let loaded = State::load(&path).expect("load");
        assert_eq!(loaded.servers, state.servers);
        assert_eq!(loaded.root_dir, state.root_dir);
        assert_eq!(loaded.port_offset, 7);
        assert_eq!(loaded.path(), Some(path.as_path()));
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(text.contains("\"backend\": \"zookeeper\""), "{text}");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn load_reports_bad_json_with_the_path() {
        let path =
            std::env::temp_dir().join(format!("dlock-testkit-bad-{}.json", std::process::id()));
        std::fs::write(&path, "{not json").expect("write");
        let err = State::load(&path).expect_err("must fail");
        assert!(matches!(err, Error::StateFile { .. }), "{err}");
        assert!(err.to_string().contains(&path.display().to_string()));
        std::fs::remove_file(&path).expect("cleanup");
    }

    #[test]
    fn endpoints_follow_the_env_contract() {
        let mut state = sample_state(PathBuf::from("/x/state.json"));
        let e = state.endpoints();
        assert_eq!(e.zk.as_deref(), Some("127.0.0.1:2188"));
        assert_eq!(e.etcd, None);
        assert_eq!(e.redis.as_deref(), Some("127.0.0.1:6386"));
        assert_eq!(e.redlock, None, "one Redis is no Redlock set");
        let mut second = state.servers[1].clone();
        second.id = 2;
        second.addr = "127.0.0.1:6387".into();
        state.servers.push(second);
        assert_eq!(
            state.endpoints().redlock.as_deref(),
            Some("127.0.0.1:6386,127.0.0.1:6387")
        );
    }

    #[test]
    fn unknown_server_is_a_typed_error() {
        let mut state = sample_state(PathBuf::from("/x/state.json"));
        assert!(matches!(
            state.kill(Backend::Etcd, 1),
            Err(Error::UnknownServer {
                backend: Backend::Etcd,
                id: 1
            })
        ));
    }

    #[test]
    fn backend_names_parse() {
        assert_eq!("zk".parse::<Backend>(), Ok(Backend::Zookeeper));
        assert_eq!("ZooKeeper".parse::<Backend>(), Ok(Backend::Zookeeper));
        assert_eq!("etcd".parse::<Backend>(), Ok(Backend::Etcd));
        assert!("mysql".parse::<Backend>().is_err());
    }
}
