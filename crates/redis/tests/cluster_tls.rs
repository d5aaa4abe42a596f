//! A Redis Cluster that speaks only TLS, with ACL users on every node (a secured testkit
//! cluster of this test's own, since one test redirects a master's slots to an impostor):
//! fred's cluster client, seeded with one node, reaches every master it discovers at the
//! TLS ports `CLUSTER SLOTS` reports, and verifies the certificate of each one.

mod common;

use std::io::Read as _;
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use dlock_core::{Backend, Credentials, Error, TlsOptions};
use dlock_redis::RedisBackend;
use dlock_testkit::secure::{Pki, APP_PASSWORD, APP_USER, NOBODY_USER};
use dlock_testkit::{key_slot, Backend as Server, Cluster, ClusterSpec};

const WAIT: Duration = Duration::from_secs(60);

/// A secured cluster (TLS only, ACL users) with only the Redis Cluster, at a free offset.
async fn secured_cluster(label: &'static str) -> Cluster {
    init_tracing();
    dlock_testkit::ensure_installed().expect("server packages installed");
    // Offsets 25 above the plain tests' scratch clusters (`o + 100 + k * 150`).
    let base = std::env::var("DLOCK_PORT_OFFSET")
        .ok()
        .and_then(|v| v.parse::<u16>().ok())
        .map_or(20_125, |o| o + 125);
    let mut spec = ClusterSpec {
        zk: 0,
        etcd: 0,
        redis: 0,
        sentinel_replicas: 0,
        redis_cluster: true,
        secure: true,
        state_path: Some(dlock_testkit::scratch_state_path(label)),
        ..ClusterSpec::default()
    };
    tokio::task::spawn_blocking(move || {
        Cluster::start_at_free_offset(&mut spec, (0..100u16).map(|k| base + k * 150))
    })
    .await
    .expect("start task")
    .expect("a secured Redis Cluster of our own")
}

/// The application user over TLS with the cluster's CA and client certificate.
fn app_opts(pki: &Pki) -> dlock_core::SessionOptions {
    opts(Duration::from_secs(10))
        .with_tls(
            TlsOptions::new()
                .with_ca(&pki.ca)
                .with_client_cert(&pki.cert, &pki.key),
        )
        .with_credentials(Credentials::new(APP_USER, APP_PASSWORD))
}

/// Every node, replica or master, has the ACL users. Seeded with one master only, the
/// client takes a lock on every master's slots: it reached the other two at the ports
/// `CLUSTER SLOTS` names, which are TLS ports (the nodes have no plain port), logged in
/// as the ACL user there too; each lock's keys are in its slot on its master.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_seed_reaches_every_master_at_its_tls_port() {
    let cluster = secured_cluster("cluster-tls-discovery").await;
    let state = cluster.state();
    let pki = state.pki().expect("a secured cluster");
    let masters = state.redis_cluster_masters().expect("masters");
    assert_eq!(masters.len(), 3, "{masters:?}");
    let seed = state
        .server(Server::RedisCluster, masters[0])
        .expect("seed")
        .clone();
    // What the client will be told: every master at its (TLS-only) client port.
    let slots = seed
        .redis_query(&["CLUSTER", "SLOTS"], Duration::from_secs(2))
        .expect("CLUSTER SLOTS");
    for &m in &masters {
        let addr = &state.server(Server::RedisCluster, m).expect("master").addr;
        let port = addr.rsplit_once(':').expect("host:port").1;
        assert!(
            slots.lines().any(|l| l == port),
            "CLUSTER SLOTS does not name {addr}: {slots}"
        );
        assert!(
            !dlock_testkit::redis_ping(addr, Duration::from_secs(1)),
            "{addr} answers in plain text"
        );
    }

    // The same users on every node, masters and replicas (ACLs are per node).
    for node in state.servers_of(Server::RedisCluster) {
        let dry = |user: &str, args: &[&str]| {
            let mut cmd = vec!["ACL", "DRYRUN", user];
            cmd.extend(args);
            node.redis_query(&cmd, Duration::from_secs(2))
                .unwrap_or_default()
        };
        assert_eq!(
            dry(APP_USER, &["SET", "dlock:{x}:q", "v"]),
            "OK",
            "{}",
            node.addr
        );
        assert_eq!(dry(APP_USER, &["CLUSTER", "SLOTS"]), "OK", "{}", node.addr);
        assert!(
            dry(APP_USER, &["SET", "other:x", "v"]).contains("no permissions"),
            "{}",
            node.addr
        );
        assert!(
            dry(NOBODY_USER, &["SET", "dlock:{x}:q", "v"]).contains("no permissions"),
            "{}",
            node.addr
        );
    }

    let b = RedisBackend::connect_cluster(std::slice::from_ref(&seed.addr), app_opts(&pki))
        .await
        .expect("connect with one seed");
    for &m in &masters {
        let q = queue_on(state, m, "cluster-tls-discovery");
        let e = enqueue_lock(&b, &q)
            .await
            .expect("enqueue on a discovered master");
        let server = state.server(Server::RedisCluster, m).expect("master");
        // The lock's keys (one string key on the fast path, or the queue) are in its slot,
        // on its master.
        let slot = key_slot(&queue_key(&q)).to_string();
        let keys = server.redis_query(
            &["CLUSTER", "COUNTKEYSINSLOT", &slot],
            Duration::from_secs(2),
        );
        assert!(
            keys.as_deref().is_some_and(|n| n != "0"),
            "nothing of {} in slot {slot} on its master {}: {keys:?}",
            q.lock.as_str(),
            server.addr
        );
        b.remove(&q, &e.mine).await.expect("remove");
    }
    b.close().await.expect("close");
    drop(cluster);
}

/// A TLS listener that presents a self-signed certificate for 127.0.0.1 (an issuer no
/// client of the test trusts), counting the connections it gets, the handshakes that
/// complete and the bytes of application data it receives (an `AUTH` with the password,
/// if a client trusted it).
struct Impostor {
    port: u16,
    dialled: Arc<AtomicUsize>,
    handshakes: Arc<AtomicUsize>,
    received: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
}

impl Impostor {
    /// With a self-signed certificate for 127.0.0.1 and localhost.
    fn self_signed() -> Impostor {
        let ck = rcgen::generate_simple_self_signed(vec![
            "127.0.0.1".to_owned(),
            "localhost".to_owned(),
        ])
        .expect("self-signed certificate");
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(ck.signing_key.serialize_der());
        Impostor::start(vec![ck.cert.der().clone()], key.into())
    }

    /// With the cluster's own server certificate: a node the client trusts.
    fn trusted(pki: &Pki) -> Impostor {
        use rustls::pki_types::pem::PemObject as _;
        let certs = rustls::pki_types::CertificateDer::pem_file_iter(&pki.server_cert)
            .expect("server certificate")
            .collect::<Result<Vec<_>, _>>()
            .expect("server certificate parses");
        let key =
            rustls::pki_types::PrivateKeyDer::from_pem_file(&pki.server_key).expect("server key");
        Impostor::start(certs, key)
    }

    fn start(
        certs: Vec<rustls::pki_types::CertificateDer<'static>>,
        key: rustls::pki_types::PrivateKeyDer<'static>,
    ) -> Impostor {
        let config = rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::aws_lc_rs::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .expect("server config");
        let config = Arc::new(config);
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        listener.set_nonblocking(true).expect("nonblocking");
        let port = listener.local_addr().expect("addr").port();
        let imp = Impostor {
            port,
            dialled: Arc::default(),
            handshakes: Arc::default(),
            received: Arc::default(),
            stop: Arc::default(),
        };
        let (dialled, handshakes, received, stop) = (
            imp.dialled.clone(),
            imp.handshakes.clone(),
            imp.received.clone(),
            imp.stop.clone(),
        );
        std::thread::spawn(move || {
            while !stop.load(Ordering::SeqCst) {
                let Ok((sock, _)) = listener.accept() else {
                    std::thread::sleep(Duration::from_millis(20));
                    continue;
                };
                dialled.fetch_add(1, Ordering::SeqCst);
                let (config, handshakes, received) =
                    (config.clone(), handshakes.clone(), received.clone());
                std::thread::spawn(move || {
                    let _ = sock.set_nonblocking(false);
                    let _ = sock.set_read_timeout(Some(Duration::from_secs(5)));
                    let Ok(conn) = rustls::ServerConnection::new(config) else {
                        return;
                    };
                    let mut tls = rustls::StreamOwned::new(conn, sock);
                    let mut buf = [0u8; 1024];
                    // The first read drives the handshake; it fails when the client
                    // rejects the certificate (an alert) or hangs up.
                    while let Ok(n) = tls.read(&mut buf) {
                        if !tls.conn.is_handshaking() {
                            handshakes.fetch_add(1, Ordering::SeqCst);
                        }
                        if n == 0 {
                            break;
                        }
                        received.fetch_add(n, Ordering::SeqCst);
                    }
                });
            }
        });
        imp
    }
}

impl Drop for Impostor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// A master announces an impostor's port as its TLS port (`cluster-announce-tls-port`,
/// spread by the cluster bus to the seed's `CLUSTER SLOTS`): the client, seeded with a
/// genuine node it trusts, dials the impostor for that master's slots, rejects its
/// certificate, and fails with a typed `Tls` error; the impostor never completes a
/// handshake nor receives a byte (no `AUTH`, no password).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_discovered_node_with_an_untrusted_certificate_is_refused() {
    let cluster = secured_cluster("cluster-tls-impostor").await;
    let state = cluster.state();
    let pki = state.pki().expect("a secured cluster");
    let masters = state.redis_cluster_masters().expect("masters");
    let (seed_id, victim_id) = (masters[0], masters[1]);
    let seed = state
        .server(Server::RedisCluster, seed_id)
        .expect("seed")
        .clone();
    let victim = state
        .server(Server::RedisCluster, victim_id)
        .expect("victim")
        .clone();
    // Before the announcement: the testkit finds masters by the addresses they announce.
    let q = queue_on(state, victim_id, "cluster-tls-impostor");
    let t = Duration::from_secs(2);
    // Makes the victim announce `port` as its TLS port, and waits until the seed's
    // `CLUSTER SLOTS` says so.
    let announce = |port: u16| {
        let port = port.to_string();
        let (victim, seed) = (victim.clone(), seed.clone());
        async move {
            assert_eq!(
                victim
                    .redis_query(&["CONFIG", "SET", "cluster-announce-tls-port", &port], t)
                    .as_deref(),
                Some("OK")
            );
            assert!(
                eventually(WAIT, || async {
                    seed.redis_query(&["CLUSTER", "SLOTS"], t)
                        .is_some_and(|s| s.lines().any(|l| l == port))
                })
                .await,
                "the seed never announced port {port}"
            );
        }
    };
    // Connects seeded with `seed` only and tries the victim's queue: the first error.
    let attempt = || async {
        match RedisBackend::connect_cluster(std::slice::from_ref(&seed.addr), app_opts(&pki)).await
        {
            Err(e) => ("connect", e),
            Ok(b) => {
                let r = enqueue_lock(&b, &q).await;
                let _ = b.close().await;
                match r {
                    Ok(e) => panic!("a lock granted through an impostor: {e:?}"),
                    Err(e) => ("enqueue", e),
                }
            }
        }
    };

    // The control: an impostor with a certificate the client trusts gets the client's
    // handshake and its first commands, so the counters below can fail.
    let trusted = Impostor::trusted(&pki);
    announce(trusted.port).await;
    let (at, e) = attempt().await;
    eprintln!("with a trusted impostor, {at} failed with: {e:?}");
    assert!(
        trusted.handshakes.load(Ordering::SeqCst) > 0
            && trusted.received.load(Ordering::SeqCst) > 0,
        "the client did not talk to the trusted impostor: the test proves nothing"
    );
    drop(trusted);

    let impostor = Impostor::self_signed();
    announce(impostor.port).await;
    let (at, outcome) = attempt().await;
    eprintln!("with an untrusted impostor, {at} failed with: {outcome:?}");
    assert!(matches!(outcome, Error::Tls(_)), "{outcome:?}");
    assert_eq!(
        at, "connect",
        "the client connected with an untrusted node in its map"
    );
    assert!(
        impostor.dialled.load(Ordering::SeqCst) > 0,
        "the client never dialled the discovered node: the test proves nothing"
    );
    assert_eq!(
        impostor.handshakes.load(Ordering::SeqCst),
        0,
        "a handshake completed"
    );
    assert_eq!(
        impostor.received.load(Ordering::SeqCst),
        0,
        "the impostor got data"
    );
    drop(impostor);
    drop(cluster);
}
