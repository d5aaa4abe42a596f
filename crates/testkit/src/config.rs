//! Server configurations and command lines, as pure functions so they are unit-tested.
//!
//! Timings are shortened for tests (see the infra notes): ZooKeeper tickTime 200 ms so a
//! session can expire in 400 ms; etcd heartbeat 20 ms / election 200 ms so failover takes
//! well under a second and the minimum lease TTL is 1 s.

use std::fmt::Write as _;
use std::path::Path;

use crate::ports::{client_port, etcd_peer_port, zk_peer_ports};
use crate::secure::{
    redis_cluster_user_args, redis_user_args, Pki, APP_PASSWORD, APP_USER, NOBODY_PASSWORD,
    NOBODY_USER, REDIS_ADMIN_PASSWORD, REDIS_ADMIN_USER, SENTINEL_CLIENT_ACL,
};
use crate::Backend;

/// The ZooKeeper server jar from Debian's `zookeeper` package; its manifest classpath pulls
/// in every dependency.
pub const ZK_JAR: &str = "/usr/share/java/zookeeper.jar";

/// Optional SLF4J binding, so the server logs to its log file instead of staying silent.
const SLF4J_SIMPLE_JAR: &str = "/usr/share/java/slf4j-simple.jar";

/// Renders `zoo.cfg` for node `id` of an ensemble of `nodes` (1 = standalone).
pub fn zoo_cfg(id: u32, nodes: u32, offset: u16, data_dir: &Path) -> String {
    let mut cfg = String::new();
    cfg.push_str("tickTime=200\n");
    if nodes > 1 {
        cfg.push_str("initLimit=20\nsyncLimit=10\n");
    }
    cfg.push_str("minSessionTimeout=400\nmaxSessionTimeout=60000\n");
    let _ = writeln!(cfg, "dataDir={}", data_dir.display());
    cfg.push_str("clientPortAddress=127.0.0.1\n");
    let _ = writeln!(
        cfg,
        "clientPort={}",
        client_port(Backend::Zookeeper, id, offset)
    );
    // Without this the Jetty admin server binds 8080 on all interfaces and two clusters clash.
    cfg.push_str("admin.enableServer=false\n");
    cfg.push_str("4lw.commands.whitelist=*\n");
    if nodes > 1 {
        for n in 1..=nodes {
            let (quorum, election) = zk_peer_ports(n, offset);
            let _ = writeln!(cfg, "server.{n}=127.0.0.1:{quorum}:{election}");
        }
    }
    cfg
}

/// The command line that runs one ZooKeeper node from `cfg_path` in the foreground.
///
/// The container check interval is cut from 60 s to 1 s so tests can observe ZooKeeper
/// deleting empty Curator-style container parents.
pub fn zk_argv(cfg_path: &Path) -> Vec<String> {
    let mut classpath = ZK_JAR.to_string();
    if Path::new(SLF4J_SIMPLE_JAR).exists() {
        classpath.push(':');
        classpath.push_str(SLF4J_SIMPLE_JAR);
    }
    [
        "java",
        "-Xms32m",
        "-Xmx256m",
        "-XX:+UseSerialGC",
        "-Dznode.container.checkIntervalMs=1000",
        "-cp",
        &classpath,
        "org.apache.zookeeper.server.quorum.QuorumPeerMain",
        &cfg_path.display().to_string(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// Netty's codec classes, which ZooKeeper's TLS client port needs and `zookeeper.jar`'s
/// manifest classpath leaves out (Debian's `libnetty-java`). Without it the server
/// listens but every TLS connection fails with `NoClassDefFoundError:
/// io/netty/handler/codec/ByteToMessageDecoder`.
pub const NETTY_CODEC_JAR: &str = "/usr/share/java/netty-codec.jar";

/// [`zoo_cfg`] for a secured cluster: the client port speaks only TLS
/// (`secureClientPort`, no plain `clientPort`) through Netty, with the PEM key and trust
/// stores of `pki`, and takes a client certificate when one is offered
/// (`ssl.clientAuth=want`). Not `need`: ZooKeeper turns a client certificate into an
/// `x509` identity, and the "creator" ACL of a node covers every identity of its
/// creator, so with every test client presenting the one test certificate any client
/// would count as the creator of every node and the ACL tests would prove nothing.
/// Quorum traffic between ensemble members stays plain.
pub fn secure_zoo_cfg(id: u32, nodes: u32, offset: u16, data_dir: &Path, pki: &Pki) -> String {
    let mut cfg: String = zoo_cfg(id, nodes, offset, data_dir)
        .lines()
        .filter(|l| !l.starts_with("clientPortAddress=") && !l.starts_with("clientPort="))
        .map(|l| format!("{l}\n"))
        .collect();
    cfg.push_str("secureClientPortAddress=127.0.0.1\n");
    let _ = writeln!(
        cfg,
        "secureClientPort={}",
        client_port(Backend::Zookeeper, id, offset)
    );
    cfg.push_str("serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory\n");
    let _ = writeln!(cfg, "ssl.keyStore.location={}", pki.server_pem.display());
    cfg.push_str("ssl.keyStore.type=PEM\n");
    let _ = writeln!(cfg, "ssl.trustStore.location={}", pki.ca.display());
    cfg.push_str("ssl.trustStore.type=PEM\n");
    cfg.push_str("ssl.clientAuth=want\n");
    cfg
}

/// [`zk_argv`] with [`NETTY_CODEC_JAR`] on the classpath, for [`secure_zoo_cfg`].
pub fn secure_zk_argv(cfg_path: &Path) -> Vec<String> {
    let mut argv = zk_argv(cfg_path);
    if let Some(cp) = argv.iter().position(|a| a == "-cp") {
        argv[cp + 1] = format!("{}:{NETTY_CODEC_JAR}", argv[cp + 1]);
    }
    argv
}

/// [`etcd_argv`] for a secured cluster: `https://` client URLs with the server
/// certificate of `pki`, client certificates required (`--client-cert-auth`) and checked
/// against its CA. Peer URLs stay `http://` (peer TLS adds 2 s to every bootstrap).
/// Users, roles and `auth enable` come after the start (see [`crate::secure`]).
pub fn secure_etcd_argv(
    id: u32,
    nodes: u32,
    offset: u16,
    data_dir: &Path,
    pki: &Pki,
) -> Vec<String> {
    let plain = format!(
        "http://127.0.0.1:{}",
        client_port(Backend::Etcd, id, offset)
    );
    let mut argv: Vec<String> = etcd_argv(id, nodes, offset, data_dir)
        .into_iter()
        .map(|a| {
            if a == plain {
                a.replacen("http://", "https://", 1)
            } else {
                a
            }
        })
        .collect();
    argv.extend([
        "--cert-file".into(),
        pki.server_cert.display().to_string(),
        "--key-file".into(),
        pki.server_key.display().to_string(),
        "--trusted-ca-file".into(),
        pki.ca.display().to_string(),
        "--client-cert-auth".into(),
    ]);
    argv
}

/// [`redis_argv`] for a secured cluster: no plain port (`--port 0`), TLS on the client
/// port with the server certificate of `pki`, client certificates checked against its CA
/// when presented (`--tls-auth-clients optional`), and the ACL users of
/// [`crate::secure`], one rule per argument.
pub fn secure_redis_argv(id: u32, offset: u16, dir: &Path, pki: &Pki) -> Vec<String> {
    let mut argv = redis_argv(id, offset, dir);
    tls_only(&mut argv, client_port(Backend::Redis, id, offset), pki);
    argv.extend(redis_user_args());
    argv
}

/// Turns a plain Redis argv (`--port P` its second and third arguments) into one that
/// speaks only TLS, on `port`.
fn tls_only(argv: &mut Vec<String>, port: u16, pki: &Pki) {
    argv[2] = "0".into();
    argv.extend(redis_tls_args(port, pki));
}

/// Replication over TLS, logged in as [`REDIS_ADMIN_USER`] (any node may be a replica).
fn tls_replication_args() -> [String; 6] {
    [
        "--tls-replication".into(),
        "yes".into(),
        "--masteruser".into(),
        REDIS_ADMIN_USER.into(),
        "--masterauth".into(),
        REDIS_ADMIN_PASSWORD.into(),
    ]
}

/// `--tls-port` and the certificate flags of a secured Redis (or Sentinel).
fn redis_tls_args(port: u16, pki: &Pki) -> Vec<String> {
    vec![
        "--tls-port".into(),
        port.to_string(),
        "--tls-cert-file".into(),
        pki.server_cert.display().to_string(),
        "--tls-key-file".into(),
        pki.server_key.display().to_string(),
        "--tls-ca-cert-file".into(),
        pki.ca.display().to_string(),
        "--tls-auth-clients".into(),
        "optional".into(),
    ]
}

/// [`redis_ha_argv`] for a secured cluster: as [`secure_redis_argv`], plus replication
/// over TLS (`--tls-replication yes`, the server certificate as the replica's client
/// certificate) logged in as [`REDIS_ADMIN_USER`] (`--masteruser`/`--masterauth`, on
/// every node: any of them may become a replica after a failover).
pub fn secure_redis_ha_argv(
    id: u32,
    primary_port: Option<u16>,
    offset: u16,
    dir: &Path,
    pki: &Pki,
) -> Vec<String> {
    let mut argv = redis_ha_argv(id, primary_port, offset, dir);
    tls_only(&mut argv, client_port(Backend::RedisHa, id, offset), pki);
    argv.extend(tls_replication_args());
    argv.extend(redis_user_args());
    argv
}

/// [`sentinel_conf`] for a secured cluster: the Sentinel listens only on TLS
/// (`port 0`, `tls-port`), talks TLS to the group and to the other Sentinels
/// (`tls-replication yes`), logs in to the data nodes and to the other Sentinels as
/// [`REDIS_ADMIN_USER`], and has its own ACL users: the administrator, and
/// [`APP_USER`]/[`NOBODY_USER`] with [`SENTINEL_CLIENT_ACL`] (find the primary, hear
/// `+switch-master` and the failover starts; nothing else).
pub fn secure_sentinel_conf(
    id: u32,
    primary_port: u16,
    offset: u16,
    dir: &Path,
    pki: &Pki,
) -> String {
    let port = client_port(Backend::Sentinel, id, offset);
    let mut cfg = sentinel_conf(id, primary_port, offset, dir).replacen(
        &format!("port {port}\n"),
        "port 0\n",
        1,
    );
    let _ = writeln!(cfg, "tls-port {port}");
    let _ = writeln!(cfg, "tls-cert-file {}", pki.server_cert.display());
    let _ = writeln!(cfg, "tls-key-file {}", pki.server_key.display());
    let _ = writeln!(cfg, "tls-ca-cert-file {}", pki.ca.display());
    cfg.push_str("tls-auth-clients optional\ntls-replication yes\n");
    let _ = writeln!(
        cfg,
        "user {REDIS_ADMIN_USER} reset on >{REDIS_ADMIN_PASSWORD} ~* &* +@all"
    );
    let _ = writeln!(
        cfg,
        "user {APP_USER} reset on >{APP_PASSWORD} {SENTINEL_CLIENT_ACL}"
    );
    let _ = writeln!(
        cfg,
        "user {NOBODY_USER} reset on >{NOBODY_PASSWORD} {SENTINEL_CLIENT_ACL}"
    );
    let _ = writeln!(cfg, "sentinel sentinel-user {REDIS_ADMIN_USER}");
    let _ = writeln!(cfg, "sentinel sentinel-pass {REDIS_ADMIN_PASSWORD}");
    let _ = writeln!(
        cfg,
        "sentinel auth-user {SENTINEL_SERVICE} {REDIS_ADMIN_USER}"
    );
    let _ = writeln!(
        cfg,
        "sentinel auth-pass {SENTINEL_SERVICE} {REDIS_ADMIN_PASSWORD}"
    );
    cfg
}

/// The command line of etcd node `id` of a cluster of `nodes`.
pub fn etcd_argv(id: u32, nodes: u32, offset: u16, data_dir: &Path) -> Vec<String> {
    let client = format!(
        "http://127.0.0.1:{}",
        client_port(Backend::Etcd, id, offset)
    );
    let peer = format!("http://127.0.0.1:{}", etcd_peer_port(id, offset));
    let initial_cluster = (1..=nodes)
        .map(|n| format!("e{n}=http://127.0.0.1:{}", etcd_peer_port(n, offset)))
        .collect::<Vec<_>>()
        .join(",");
    vec![
        "etcd".into(),
        "--name".into(),
        format!("e{id}"),
        "--data-dir".into(),
        data_dir.display().to_string(),
        "--listen-client-urls".into(),
        client.clone(),
        "--advertise-client-urls".into(),
        client,
        "--listen-peer-urls".into(),
        peer.clone(),
        "--initial-advertise-peer-urls".into(),
        peer,
        "--initial-cluster".into(),
        initial_cluster,
        "--initial-cluster-state".into(),
        "new".into(),
        "--initial-cluster-token".into(),
        format!("dlock-test-{offset}"),
        "--heartbeat-interval=20".into(),
        "--election-timeout=200".into(),
        "--logger=zap".into(),
        "--log-outputs=stderr".into(),
    ]
}

/// The command line of Redis node `id`: an independent master without persistence, with
/// `DEBUG` enabled so tests can stall it (`DEBUG SLEEP`).
pub fn redis_argv(id: u32, offset: u16, dir: &Path) -> Vec<String> {
    vec![
        "redis-server".into(),
        "--port".into(),
        client_port(Backend::Redis, id, offset).to_string(),
        "--bind".into(),
        "127.0.0.1".into(),
        "--save".into(),
        String::new(),
        "--appendonly".into(),
        "no".into(),
        "--dir".into(),
        dir.display().to_string(),
        "--enable-debug-command".into(),
        "yes".into(),
        "--loglevel".into(),
        "warning".into(),
    ]
}

/// How many nodes the Redis Cluster has: three masters, one replica each.
pub const CLUSTER_NODES: u32 = 6;

/// How long a Redis Cluster node may be unreachable before the others count it as failed
/// and its replica takes over (`--cluster-node-timeout`, ms). Short so a failover test
/// takes seconds (a SIGKILLed master is replaced about 3 s later), long enough that a
/// machine busy compiling does not fail a live master over.
pub const CLUSTER_NODE_TIMEOUT_MS: u32 = 2000;

/// The command line of Redis Cluster node `id`: like [`redis_argv`] (no persistence,
/// `DEBUG` on) with cluster mode on, the bus on its own port in the layout
/// (`--cluster-port`, Redis 7.0+), the node's cluster state in `<dir>/nodes.conf` (a
/// restarted node rejoins from it, as a replica if it was failed over), and
/// `--repl-diskless-sync-delay 0` so a replica's first sync does not wait 5 s.
pub fn redis_cluster_argv(id: u32, offset: u16, dir: &Path) -> Vec<String> {
    let mut argv = redis_argv(id, offset, dir);
    argv[2] = client_port(Backend::RedisCluster, id, offset).to_string();
    argv.extend([
        "--cluster-enabled".into(),
        "yes".into(),
        "--cluster-port".into(),
        crate::ports::cluster_bus_port(id, offset).to_string(),
        "--cluster-config-file".into(),
        dir.join("nodes.conf").display().to_string(),
        "--cluster-node-timeout".into(),
        CLUSTER_NODE_TIMEOUT_MS.to_string(),
        "--repl-diskless-sync-delay".into(),
        "0".into(),
    ]);
    argv
}

/// [`redis_cluster_argv`] for a secured cluster: no plain port (`--port 0`), TLS on the
/// client port as [`secure_redis_argv`], TLS on the cluster bus too (`--tls-cluster yes`:
/// the nodes then announce their TLS ports in `CLUSTER SLOTS`) and for replication
/// (`--tls-replication yes`, logged in as [`REDIS_ADMIN_USER`]: any node may become a
/// replica), and the ACL users of [`crate::secure`] on every node (ACLs are per node, not
/// propagated), the application's with [`crate::secure::REDIS_CLUSTER_CLIENT_ACL`] added.
pub fn secure_redis_cluster_argv(id: u32, offset: u16, dir: &Path, pki: &Pki) -> Vec<String> {
    let mut argv = redis_cluster_argv(id, offset, dir);
    tls_only(
        &mut argv,
        client_port(Backend::RedisCluster, id, offset),
        pki,
    );
    argv.extend(["--tls-cluster".into(), "yes".into()]);
    argv.extend(tls_replication_args());
    argv.extend(redis_cluster_user_args());
    argv
}

/// How many Sentinels watch the Sentinel group (quorum [`SENTINEL_QUORUM`]).
pub const SENTINELS: u32 = 3;

/// Sentinels that must agree the primary is down before a failover starts.
pub const SENTINEL_QUORUM: u32 = 2;

/// The service (master) name the Sentinels monitor, as clients name it in
/// `redis+sentinel://h:p,h:p,h:p/mymaster`.
pub const SENTINEL_SERVICE: &str = "mymaster";

/// The command line of node `id` of the Sentinel-monitored group: like [`redis_argv`]
/// (no persistence, `DEBUG` on), plus `--repl-diskless-sync-delay 0` so a replica's first
/// full sync does not wait 5 s, and `--replicaof` the primary's port for a replica.
///
/// A restarted node runs this same argv: node 1 comes back as an empty master, so restart
/// it only after the Sentinels promoted another node (they then turn it into a replica);
/// brought back earlier, an empty master would be kept and its replicas would resync to
/// nothing.
pub fn redis_ha_argv(id: u32, primary_port: Option<u16>, offset: u16, dir: &Path) -> Vec<String> {
    let mut argv = redis_argv(id, offset, dir);
    argv[2] = client_port(Backend::RedisHa, id, offset).to_string();
    argv.extend(["--repl-diskless-sync-delay".into(), "0".into()]);
    if let Some(p) = primary_port {
        argv.extend(["--replicaof".into(), "127.0.0.1".into(), p.to_string()]);
    }
    argv
}

/// The config file of Sentinel `id` watching the primary at `primary_port`. Sentinel
/// rewrites this file (it records what it learns), so each Sentinel needs its own
/// writable copy.
///
/// Timings are cut for tests: the primary counts as down after 1 s without an answer,
/// and a failover that stalls is retried after 2 × 5 s; a SIGKILLed primary is replaced
/// in about 1.5–3 s.
pub fn sentinel_conf(id: u32, primary_port: u16, offset: u16, dir: &Path) -> String {
    let port = client_port(Backend::Sentinel, id, offset);
    format!(
        "port {port}\n\
         bind 127.0.0.1\n\
         dir {dir}\n\
         sentinel resolve-hostnames no\n\
         sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {primary_port} {SENTINEL_QUORUM}\n\
         sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n\
         sentinel failover-timeout {SENTINEL_SERVICE} 5000\n",
        dir = dir.display()
    )
}

/// The command line of a Sentinel reading (and rewriting) `cfg_path`. Debian's
/// `redis-server` binary is also the Sentinel; no separate package is needed.
pub fn sentinel_argv(cfg_path: &Path) -> Vec<String> {
    vec![
        "redis-server".into(),
        cfg_path.display().to_string(),
        "--sentinel".into(),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standalone_zoo_cfg_has_fast_timings_and_no_quorum() {
        let cfg = zoo_cfg(1, 1, 0, Path::new("/tmp/x/zk1/data"));
        assert!(cfg.contains("tickTime=200\n"));
        assert!(cfg.contains("minSessionTimeout=400\n"));
        assert!(cfg.contains("clientPort=2181\n"));
        assert!(cfg.contains("clientPortAddress=127.0.0.1\n"));
        assert!(cfg.contains("admin.enableServer=false\n"));
        assert!(cfg.contains("4lw.commands.whitelist=*\n"));
        assert!(cfg.contains("dataDir=/tmp/x/zk1/data\n"));
        assert!(!cfg.contains("server.1"));
        assert!(!cfg.contains("initLimit"));
    }

    #[test]
    fn ensemble_zoo_cfg_lists_every_peer_with_offset() {
        let cfg = zoo_cfg(2, 3, 10, Path::new("/d"));
        assert!(cfg.contains("clientPort=2192\n"));
        assert!(cfg.contains("server.1=127.0.0.1:2898:3898\n"));
        assert!(cfg.contains("server.2=127.0.0.1:2899:3899\n"));
        assert!(cfg.contains("server.3=127.0.0.1:2900:3900\n"));
        assert!(cfg.contains("initLimit=20\nsyncLimit=10\n"));
    }

    #[test]
    fn zk_argv_runs_quorum_peer_main_with_container_interval() {
        let argv = zk_argv(Path::new("/d/zoo.cfg"));
        assert_eq!(argv[0], "java");
        assert!(argv.contains(&"-Dznode.container.checkIntervalMs=1000".to_string()));
        let cp = argv
            .iter()
            .position(|a| a == "-cp")
            .expect("classpath flag");
        assert!(argv[cp + 1].starts_with(ZK_JAR));
        assert_eq!(
            argv[argv.len() - 2],
            "org.apache.zookeeper.server.quorum.QuorumPeerMain"
        );
        assert_eq!(argv[argv.len() - 1], "/d/zoo.cfg");
    }

    #[test]
    fn etcd_argv_names_all_members_and_uses_fast_timings() {
        let argv = etcd_argv(3, 3, 0, Path::new("/d/etcd3/data"));
        let joined = argv.join(" ");
        assert!(joined.contains("--name e3 "));
        assert!(joined.contains("--listen-client-urls http://127.0.0.1:2579 "));
        assert!(joined.contains("--listen-peer-urls http://127.0.0.1:2580 "));
        assert!(joined.contains(
            "--initial-cluster e1=http://127.0.0.1:2380,e2=http://127.0.0.1:2480,e3=http://127.0.0.1:2580 "
        ));
        assert!(joined.contains("--heartbeat-interval=20 --election-timeout=200"));
    }

    #[test]
    fn sentinel_group_configs_point_at_the_primary_with_short_timings() {
        let primary = redis_ha_argv(1, None, 400, Path::new("/d/redis-ha1"));
        assert_eq!(primary[2], "6790");
        assert!(!primary.contains(&"--replicaof".to_string()));
        let replica = redis_ha_argv(2, Some(6790), 400, Path::new("/d/redis-ha2"));
        assert_eq!(replica[2], "6791");
        assert!(replica.join(" ").ends_with("--replicaof 127.0.0.1 6790"));
        assert!(replica.join(" ").contains("--repl-diskless-sync-delay 0"));
        let conf = sentinel_conf(3, 6790, 400, Path::new("/d/sentinel3"));
        assert!(conf.contains("port 6795\n"), "{conf}");
        assert!(conf.contains("sentinel monitor mymaster 127.0.0.1 6790 2\n"));
        assert!(conf.contains("sentinel down-after-milliseconds mymaster 1000\n"));
        assert!(conf.contains("dir /d/sentinel3\n"));
        assert_eq!(
            sentinel_argv(Path::new("/d/s.conf")),
            vec!["redis-server", "/d/s.conf", "--sentinel"]
        );
    }

    #[test]
    fn secure_configs_listen_only_on_tls() {
        let pki = Pki::in_dir("/p");
        let cfg = secure_zoo_cfg(1, 1, 0, Path::new("/d"), &pki);
        assert!(!cfg.contains("clientPort="), "{cfg}");
        assert!(!cfg.contains("clientPortAddress="), "{cfg}");
        assert!(cfg.contains("secureClientPort=2181\n"));
        assert!(cfg.contains("secureClientPortAddress=127.0.0.1\n"));
        assert!(cfg.contains("ssl.keyStore.location=/p/server.pem\n"));
        assert!(cfg.contains("ssl.clientAuth=want\n"));
        let zk = secure_zk_argv(Path::new("/d/zoo.cfg"));
        assert!(zk.join(" ").contains(&format!(":{NETTY_CODEC_JAR} ")));

        let etcd = secure_etcd_argv(1, 1, 0, Path::new("/d"), &pki).join(" ");
        assert!(etcd.contains("--listen-client-urls https://127.0.0.1:2379 "));
        assert!(etcd.contains("--advertise-client-urls https://127.0.0.1:2379 "));
        assert!(etcd.contains("--listen-peer-urls http://127.0.0.1:2380 "));
        assert!(etcd.ends_with("--trusted-ca-file /p/ca.crt --client-cert-auth"));

        let redis = secure_redis_argv(1, 0, Path::new("/d"), &pki);
        assert_eq!(&redis[1..3], ["--port", "0"]);
        let tls = redis
            .iter()
            .position(|a| a == "--tls-port")
            .expect("tls port");
        assert_eq!(redis[tls + 1], "6379");
        assert!(redis
            .join(" ")
            .contains("--tls-auth-clients optional --user default reset on >"));

        // A cluster node: TLS on its client port, its bus and its replication, the
        // replication login, and `CLUSTER SLOTS`/`INFO` for the client users only.
        let node = secure_redis_cluster_argv(2, 0, Path::new("/d"), &pki);
        assert_eq!(&node[1..3], ["--port", "0"]);
        let joined = node.join(" ");
        assert!(joined.contains("--tls-port 6397 "), "{joined}");
        assert!(joined.contains("--cluster-enabled yes --cluster-port 6403 "));
        assert!(joined.contains(
            "--tls-cluster yes --tls-replication yes --masteruser default --masterauth admin-secret-1 "
        ));
        let users: Vec<&str> = joined.split("--user ").skip(1).collect();
        assert_eq!(users.len(), 3, "{joined}");
        assert!(!users[0].contains("+cluster|slots"), "{}", users[0]);
        for client in &users[1..] {
            assert!(
                client
                    .trim_end()
                    .ends_with("+wait +cluster|slots +cluster|info"),
                "{client}"
            );
        }
    }

    #[test]
    fn redis_argv_disables_persistence_and_enables_debug() {
        let argv = redis_argv(2, 5, Path::new("/d/redis2"));
        assert_eq!(argv[0], "redis-server");
        assert_eq!(argv[2], "6385");
        let save = argv.iter().position(|a| a == "--save").expect("--save");
        assert_eq!(argv[save + 1], "");
        let dbg = argv
            .iter()
            .position(|a| a == "--enable-debug-command")
            .expect("debug flag");
        assert_eq!(argv[dbg + 1], "yes");
    }
}
