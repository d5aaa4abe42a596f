//! Real-server test infrastructure for dlock.
//!
//! dlock's integration tests run against real ZooKeeper, etcd and Redis servers, never
//! mocks. This crate starts them as plain child processes on 127.0.0.1 with throwaway data
//! directories, records every process in a JSON state file so another process (a test,
//! `cargo xtask cluster status`, a second shell) can find, kill, stop and restart them, and
//! tells tests where the servers are.
//!
//! # Where to start
//! - Writing a test that needs a server: call [`require_zk`], [`require_etcd`],
//!   [`require_redis`], [`require_redlock`] or [`require_redis_sentinel`] at the top. They return the endpoint that
//!   `cargo xtask integration` exported, or skip loudly (fail under `CI`) when it is missing.
//! - Writing or instantiating the backend contract: [`contract`] holds the tests every
//!   `Backend` passes, and [`backend_contract!`] generates them for one backend.
//! - Naming a service in a test or a runner: [`LockService`] maps each one to its
//!   `DLOCK_TEST_*` variable, URL scheme and servers.
//! - Writing a fault test: [`require_state`] loads the [`State`] of the running cluster;
//!   [`State::kill`], [`State::stop`], [`State::cont`], [`State::restart`],
//!   [`State::zk_leader`], [`State::etcd_leader`] and [`State::sentinel_primary`] act on
//!   single nodes; [`State::wait_failover`] waits for the Sentinels to promote a replica;
//!   [`NetCut`] drops the packets of chosen connections between servers (a partition;
//!   [`NetCut::isolate`] cuts a server off from its peers whatever ports it dials from)
//!   and [`connections_of`] finds them.
//! - Starting servers yourself: build a [`ClusterSpec`] (state file from
//!   [`scratch_state_path`]) and call [`Cluster::start_at_free_offset`] with the port
//!   offsets it may use, or [`Cluster::start`] at a fixed one. The returned [`Cluster`] kills its servers when dropped unless you
//!   [`Cluster::detach`] it.
//! - Testing against secured servers (TLS with client certificates, authentication,
//!   access control): set [`ClusterSpec::secure`]. [`secure`] names the users, their
//!   passwords and the Redis ACL ([`secure::REDIS_APP_ACL`]); [`State::pki`] gives the
//!   certificate files ([`secure::Pki`]); [`State::secure_url`] builds the `zks://`,
//!   `etcds://`, `rediss://`, `redlocks://` or `rediss+sentinel://` URL for a
//!   [`secure::Caller`] (the app user,
//!   an authenticated user without rights, a wrong password, a foreign CA, no client
//!   certificate); [`State::secure_env`] lists the `DLOCK_TEST_SECURE_*` variables
//!   ([`ENV_SECURE_ZK`] ...) that `cargo xtask integration` exports. Probes, restarts and
//!   leader queries ([`Server::zk_mode`], [`Server::redis_query`]) speak TLS to secured
//!   servers by themselves.
//!
//! ```no_run
//! // A test that needs ZooKeeper: skips loudly without `DLOCK_TEST_ZK`, fails under `CI`.
//! let Some(zk) = dlock_testkit::require_zk() else { return };
//! println!("testing against {zk}");
//!
//! // A fault test loads the running cluster (then kills, stops or restarts its nodes).
//! if let Some(state) = dlock_testkit::require_state() {
//!     println!("{} servers recorded", state.servers.len());
//! }
//! ```
//!
//! - Testing recipes with no server at all, or under seeded faults on a virtual clock:
//!   [`mem::MemServer`] and its [`mem::MemBackend`] sessions.
//! - Making an HTTP/2 (gRPC) server leave one chosen request unanswered, one stream's
//!   answers undelivered, or a request arrive late, while its connection goes on:
//!   [`FrameDrop`].
//! - Counting a backend's calls, failing chosen ones or holding up a lost signal, on a
//!   real backend or the in-memory one: [`tap::Tapped`] with your [`tap::Tap`].
//!
//! # Feature flags
//! None. The crate is `publish = false`: it serves dlock's tests and `cargo xtask`.
//!
//! # The design decision
//! Servers are identified by PID *and* process start time (from `/proc/PID/stat`), never by
//! name: other sessions on the same machine run the same servers on other ports, and a PID
//! recorded in a stale state file may have been reused. Nothing here ever signals a process
//! whose start time does not match the one recorded when it was spawned.

#![deny(missing_docs)]

mod blackhole;
mod cluster;
mod config;
pub mod contract;
mod env;
mod error;
pub mod frame_drop;
mod install;
mod leaders;
pub mod mem;
mod netcut;
mod ports;
mod probe;
mod process;
mod redis_cluster;
pub mod secure;
mod service;
mod state;
pub mod tap;

pub use blackhole::BlackHole;
pub use cluster::{spawn_lock, Cluster, ClusterSpec};
pub use config::{
    etcd_argv, redis_argv, redis_cluster_argv, redis_ha_argv, secure_etcd_argv, secure_redis_argv,
    secure_redis_cluster_argv, secure_redis_ha_argv, secure_sentinel_conf, secure_zk_argv,
    secure_zoo_cfg, sentinel_argv, sentinel_conf, zk_argv, zoo_cfg, CLUSTER_NODES,
    CLUSTER_NODE_TIMEOUT_MS, NETTY_CODEC_JAR, SENTINELS, SENTINEL_QUORUM, SENTINEL_SERVICE, ZK_JAR,
};
pub use env::{
    reap_scratch_clusters, require_etcd, require_redis, require_redis_cluster,
    require_redis_sentinel, require_redlock, require_state, require_zk, scratch_state_path,
    Endpoints, ENV_CLUSTER_DIR, ENV_ETCD, ENV_REDIS, ENV_REDIS_CLUSTER, ENV_REDIS_SENTINEL,
    ENV_REDLOCK, ENV_SECURE_ETCD, ENV_SECURE_REDIS, ENV_SECURE_REDIS_CLUSTER,
    ENV_SECURE_REDIS_SENTINEL, ENV_SECURE_REDLOCK, ENV_SECURE_STATE, ENV_SECURE_ZK, ENV_STATE,
    ENV_ZK,
};
pub use error::{Error, Result};
pub use frame_drop::FrameDrop;
pub use install::{ensure_installed, missing_prerequisites, APT_PACKAGES};
pub use netcut::{connections_of, NetCut};
pub use ports::{client_port, ports_in_use, MAX_PORT_OFFSET};

/// The version the `etcd` binary on the PATH reports (`etcd --version`, e.g. `3.4.23`), or
/// an empty string when it cannot be run or read: the servers the testkit starts are that
/// binary.
pub fn etcd_version() -> String {
    std::process::Command::new("etcd")
        .arg("--version")
        .output()
        .ok()
        .and_then(|out| {
            String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
                l.strip_prefix("etcd Version: ")
                    .map(|v| v.trim().to_owned())
            })
        })
        .unwrap_or_default()
}

/// A fresh random ticket, for tests that call a backend directly (the recipes draw their
/// own, from their client's ticket source).
pub fn ticket() -> dlock_core::Ticket {
    dlock_core::Ticket::from_random_bytes(rand::random())
}
pub use probe::{
    etcd_healthy, etcd_healthy_over, redis_ping, redis_ping_over, redis_query, redis_query_over,
    tls_handshake, zk_mode, zk_mode_over, ZkMode,
};
pub use redis_cluster::{
    key_slot, redis_cluster_masters, redis_cluster_node_id, redis_error_count, SlotMove,
};
pub use service::LockService;
pub use state::{default_state_path, Backend, Server, State};
