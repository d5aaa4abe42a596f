//! The fixed port layout, shifted by one offset so several clusters can share a machine.
//!
//! Node ids start at 1. Layout at offset 0 (the servers' usual defaults):
//! ZooKeeper client 2181.., quorum 2888.., election 3888..; etcd client 2379/2479/2579,
//! peer 2380/2480/2580; Redis 6379..6388; the Sentinel group's primary and replicas
//! 6390..6392, its three Sentinels 6393..6395 (not 26379); the Redis Cluster's six nodes
//! 6396..6401 with their cluster bus ports 6402..6407 (not port + 10000): every port
//! stays below 6410 so the same offsets fit.

use std::net::TcpListener;

use crate::{Backend, ClusterSpec};

/// The largest accepted port offset: the highest port of the layout (6407) plus this stays
/// below 65536.
pub const MAX_PORT_OFFSET: u16 = 59_000;

/// The client port of node `id` (1-based) of `backend` at `offset`.
pub fn client_port(backend: Backend, id: u32, offset: u16) -> u16 {
    let i = id.saturating_sub(1) as u16;
    match backend {
        Backend::Zookeeper => 2181 + i + offset,
        Backend::Etcd => 2379 + 100 * i + offset,
        Backend::Redis => 6379 + i + offset,
        Backend::RedisHa => 6390 + i + offset,
        Backend::Sentinel => 6393 + i + offset,
        Backend::RedisCluster => 6396 + i + offset,
    }
}

/// The cluster bus port of Redis Cluster node `id` (`--cluster-port`).
pub(crate) fn cluster_bus_port(id: u32, offset: u16) -> u16 {
    6402 + id.saturating_sub(1) as u16 + offset
}

/// ZooKeeper quorum and election ports of node `id`.
pub(crate) fn zk_peer_ports(id: u32, offset: u16) -> (u16, u16) {
    let i = id.saturating_sub(1) as u16;
    (2888 + i + offset, 3888 + i + offset)
}

/// etcd peer port of node `id`.
pub(crate) fn etcd_peer_port(id: u32, offset: u16) -> u16 {
    let i = id.saturating_sub(1) as u16;
    2380 + 100 * i + offset
}

/// Every port a cluster of this shape binds.
pub(crate) fn spec_ports(spec: &ClusterSpec) -> Vec<u16> {
    let off = spec.port_offset;
    let mut ports = Vec::new();
    for id in 1..=spec.zk {
        ports.push(client_port(Backend::Zookeeper, id, off));
        // A standalone ZooKeeper binds no quorum ports.
        if spec.zk > 1 {
            let (q, e) = zk_peer_ports(id, off);
            ports.extend([q, e]);
        }
    }
    for id in 1..=spec.etcd {
        ports.push(client_port(Backend::Etcd, id, off));
        ports.push(etcd_peer_port(id, off));
    }
    for id in 1..=spec.redis {
        ports.push(client_port(Backend::Redis, id, off));
    }
    if spec.sentinel_replicas > 0 {
        for id in 1..=1 + spec.sentinel_replicas {
            ports.push(client_port(Backend::RedisHa, id, off));
        }
        for id in 1..=crate::config::SENTINELS {
            ports.push(client_port(Backend::Sentinel, id, off));
        }
    }
    if spec.redis_cluster {
        for id in 1..=crate::config::CLUSTER_NODES {
            ports.push(client_port(Backend::RedisCluster, id, off));
            ports.push(cluster_bus_port(id, off));
        }
    }
    ports
}

/// The ports of `spec` that something on 127.0.0.1 already listens on.
///
/// Checked by binding each one; a port in TIME_WAIT still binds, so this answers the
/// question that matters: would our server be able to listen there.
pub fn ports_in_use(spec: &ClusterSpec) -> Vec<u16> {
    spec_ports(spec)
        .into_iter()
        .filter(|&p| TcpListener::bind(("127.0.0.1", p)).is_err())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_documented_defaults() {
        assert_eq!(client_port(Backend::Zookeeper, 1, 0), 2181);
        assert_eq!(client_port(Backend::Zookeeper, 3, 0), 2183);
        assert_eq!(zk_peer_ports(2, 0), (2889, 3889));
        assert_eq!(client_port(Backend::Etcd, 1, 0), 2379);
        assert_eq!(client_port(Backend::Etcd, 3, 0), 2579);
        assert_eq!(etcd_peer_port(2, 0), 2480);
        assert_eq!(client_port(Backend::Redis, 5, 0), 6383);
        assert_eq!(client_port(Backend::Redis, 1, 100), 6479);
    }

    #[test]
    fn spec_ports_are_distinct_for_the_full_shape() {
        let spec = ClusterSpec {
            zk: 3,
            etcd: 3,
            redis: 10,
            sentinel_replicas: 2,
            redis_cluster: true,
            ..ClusterSpec::default()
        };
        let mut ports = spec_ports(&spec);
        assert_eq!(ports.len(), 9 + 6 + 10 + 3 + 3 + 12);
        ports.sort_unstable();
        ports.dedup();
        assert_eq!(ports.len(), 43);
        assert_eq!(client_port(Backend::Sentinel, 3, MAX_PORT_OFFSET), 65_395);
        assert_eq!(cluster_bus_port(6, MAX_PORT_OFFSET), 65_407);
    }

    #[test]
    fn a_bound_port_is_reported_in_use() {
        // Bind some free port, then ask for the offset that puts Redis 1 on it.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind an ephemeral port");
        let port = listener.local_addr().expect("local addr").port();
        if port < 6379 || port - 6379 > MAX_PORT_OFFSET {
            return; // The ephemeral range is above 6379 on Linux; nothing to check otherwise.
        }
        let spec = ClusterSpec {
            zk: 0,
            etcd: 0,
            redis: 1,
            port_offset: port - 6379,
            ..ClusterSpec::default()
        };
        assert_eq!(ports_in_use(&spec), vec![port]);
        drop(listener);
    }
}
