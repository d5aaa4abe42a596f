//! Bring your own client: each adapter built on the application's own client
//! (`from_client`), handed to `Client::from_backend`, locks with clients that connected
//! from a URL, leaves the application's connection open when it closes, and leaves no
//! entry behind. Real servers only: the point is the client libraries' own clients.

use std::time::Duration;

use dlock::{BackendUrl, Client, Error, Servers, SessionOptions};

use crate::support::{client, eventually, unique, Kind};

const GENEROUS: Duration = Duration::from_secs(30);

/// The application's own connection, kept to check that dlock leaves it working.
enum App {
    #[cfg(feature = "zookeeper")]
    Zk(dlock::backends::zookeeper_client::Client),
    #[cfg(feature = "etcd")]
    Etcd(Box<dlock::backends::etcd_client::Client>),
    #[cfg(feature = "redis")]
    Redis(Vec<dlock::backends::fred::clients::Client>),
}

impl App {
    /// One request of the application's own, on its own connection: what it would do
    /// beside its locks. Panics if the connection no longer works.
    async fn still_works(&mut self, key: &str) {
        match self {
            #[cfg(feature = "zookeeper")]
            App::Zk(zk) => {
                use dlock::backends::zookeeper_client as zkc;
                let path = format!("/{}", key.replace('/', "-"));
                let opts = zkc::CreateMode::Ephemeral.with_acls(zkc::Acls::anyone_all());
                zk.create(&path, b"app", &opts)
                    .await
                    .expect("the application's ZooKeeper session still creates");
                let (data, _) = zk.get_data(&path).await.expect("and reads");
                assert_eq!(data, b"app");
                zk.delete(&path, None).await.expect("and deletes");
            }
            #[cfg(feature = "etcd")]
            App::Etcd(etcd) => {
                etcd.put(key, "app", None)
                    .await
                    .expect("the application's etcd client still writes");
                let got = etcd.get(key, None).await.expect("and reads");
                assert_eq!(got.kvs()[0].value(), b"app");
                etcd.delete(key, None).await.expect("and deletes");
            }
            #[cfg(feature = "redis")]
            App::Redis(clients) => {
                use dlock::backends::fred::prelude::KeysInterface;
                for c in clients.iter() {
                    let () = c
                        .set(key, "app", None, None, false)
                        .await
                        .expect("the application's fred client still writes");
                    let got: String = c.get(key).await.expect("and reads");
                    assert_eq!(got, "app");
                    let _: i64 = c.del(key).await.expect("and deletes");
                }
            }
        }
    }
}

/// Connects the application's own client for `url` and builds dlock's backend on it,
/// handed to [`Client::from_backend`].
async fn own(url: &str, opts: SessionOptions) -> (App, Client) {
    let parsed = BackendUrl::parse(url).expect("test URL");
    match parsed.servers {
        #[cfg(feature = "zookeeper")]
        Servers::ZooKeeper { hosts, chroot } => {
            use dlock::backends::{zookeeper_client as zkc, ZkBackend, ZkOptions};
            let mut connect = hosts.join(",");
            if let Some(root) = chroot {
                connect.push_str(&root);
            }
            let zk = zkc::Client::connector()
                .with_session_timeout(Duration::from_secs(4))
                .connect(&connect)
                .await
                .expect("the application's ZooKeeper session");
            // The test cluster's tickTime, so the lost signal is not needlessly early.
            let zk_opts = ZkOptions::default().with_tick_time(Duration::from_millis(200));
            let backend = ZkBackend::from_client(zk.clone(), opts, zk_opts)
                .await
                .expect("dlock on the application's session");
            (App::Zk(zk), Client::from_backend(backend))
        }
        #[cfg(feature = "etcd")]
        Servers::Etcd { hosts } => {
            use dlock::backends::{etcd_client, EtcdBackend};
            let etcd = etcd_client::Client::connect(hosts, None)
                .await
                .expect("the application's etcd client");
            let backend = EtcdBackend::from_client(etcd.clone(), opts)
                .await
                .expect("dlock on the application's client");
            (App::Etcd(Box::new(etcd)), Client::from_backend(backend))
        }
        #[cfg(feature = "redis")]
        servers @ (Servers::Redis { .. }
        | Servers::Redlock { .. }
        | Servers::RedisSentinel { .. }
        | Servers::RedisCluster { .. }) => {
            use dlock::backends::fred::prelude::{Builder, ClientLike, Config, ServerConfig};
            use dlock::backends::RedisBackend;
            let connect = |config: Config| async move {
                let c = Builder::from_config(config).build().expect("fred client");
                c.init()
                    .await
                    .expect("the application's fred client connects");
                c
            };
            let single =
                |hp: &str| Config::from_url(&format!("redis://{hp}")).expect("fred config");
            match servers {
                Servers::Redis { host, database } => {
                    let mut config = single(&host);
                    config.database = Some(database);
                    let c = connect(config).await;
                    let backend = RedisBackend::from_client(c.clone(), opts)
                        .await
                        .expect("dlock on the application's client");
                    (App::Redis(vec![c]), Client::from_backend(backend))
                }
                Servers::Redlock { hosts } => {
                    let mut clients = Vec::new();
                    for h in &hosts {
                        clients.push(connect(single(h)).await);
                    }
                    let backend = RedisBackend::from_redlock_clients(clients.clone(), opts)
                        .await
                        .expect("dlock on the application's clients");
                    (App::Redis(clients), Client::from_backend(backend))
                }
                Servers::RedisSentinel { sentinels, service } => {
                    let hosts = sentinels
                        .iter()
                        .map(|s| {
                            let (h, p) = s.rsplit_once(':').expect("host:port");
                            (h.to_owned(), p.parse::<u16>().expect("port"))
                        })
                        .collect();
                    let c = connect(Config {
                        server: ServerConfig::new_sentinel(hosts, service),
                        ..Config::default()
                    })
                    .await;
                    let backend = RedisBackend::from_client(c.clone(), opts)
                        .await
                        .expect("dlock on the application's Sentinel client");
                    (App::Redis(vec![c]), Client::from_backend(backend))
                }
                Servers::RedisCluster { seeds } => {
                    let hosts = seeds
                        .iter()
                        .map(|s| {
                            let (h, p) = s.rsplit_once(':').expect("host:port");
                            (h.to_owned(), p.parse::<u16>().expect("port"))
                        })
                        .collect();
                    let c = connect(Config {
                        server: ServerConfig::new_clustered(hosts),
                        ..Config::default()
                    })
                    .await;
                    let backend = RedisBackend::from_client(c.clone(), opts)
                        .await
                        .expect("dlock on the application's cluster client");
                    (App::Redis(vec![c]), Client::from_backend(backend))
                }
                _ => unreachable!("matched above"),
            }
        }
        #[allow(unreachable_patterns)]
        other => panic!("no client library for {other:?} in this build"),
    }
}

/// A backend on the application's client shares the lock with a client from a URL,
/// leaves the application's connection working through and after its own close, and
/// its close removes what it held and what it waited for.
pub async fn own_client_shares_locks_and_leaves_the_connection_open(_kind: Kind, url: &str) {
    let name = unique("own");
    let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(4));
    let (mut app, mine) = own(url, opts).await;
    let other = client(url).await;
    app.still_works(&unique("app-key")).await;

    // Exclusion both ways, one FIFO queue, growing tokens.
    let mut g = mine.mutex(&name).expect("name").lock().await.expect("lock");
    assert!(
        matches!(
            other.mutex(&name).expect("name").try_lock().await,
            Err(Error::WouldBlock)
        ),
        "a URL client got in while the application's client held the lock"
    );
    let first = g.token();
    g.release().await.expect("release");
    let mut g2 = other
        .mutex(&name)
        .expect("name")
        .lock()
        .await
        .expect("lock");
    assert!(
        matches!(
            mine.mutex(&name).expect("name").try_lock().await,
            Err(Error::WouldBlock)
        ),
        "the application's client got in while a URL client held the lock"
    );
    assert!(g2.token() > first, "tokens must grow across clients");
    g2.release().await.expect("release");

    // Close while holding one lock and waiting for another: both entries go, and the
    // application's connection stays open.
    let held = unique("own-held");
    let wanted = unique("own-wanted");
    let _h = mine.mutex(&held).expect("name").lock().await.expect("lock");
    let mut blocker = other
        .mutex(&wanted)
        .expect("name")
        .lock()
        .await
        .expect("lock");
    let waiter = {
        let m = mine.mutex(&wanted).expect("name");
        tokio::spawn(async move { m.lock_timeout(GENEROUS).await.map(|_| ()) })
    };
    assert!(
        eventually(GENEROUS, || async {
            other
                .participants(&wanted)
                .await
                .map(|p| p.len())
                .unwrap_or(0)
                == 2
        })
        .await,
        "the application's client never queued"
    );
    mine.close().await.expect("close dlock's side");
    // What stays: nothing of `held`; of `wanted`, only the URL client's hold.
    for (n, stays) in [(&held, 0), (&wanted, 1)] {
        let left = other.participants(n).await.expect("participants");
        assert_eq!(
            left.len(),
            stays,
            "{n}: dlock's close left entries behind: {left:?}"
        );
    }
    let _ = waiter.await;
    app.still_works(&unique("app-key")).await;
    blocker.release().await.expect("release");
    other.close().await.expect("close");
}
