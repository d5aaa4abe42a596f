//! The backend contract (`dlock_testkit::contract`) on the four Redis deployments: one
//! master (`DLOCK_TEST_REDIS`), Redlock over independent masters (`DLOCK_TEST_REDLOCK`),
//! the primary of a Sentinel group (`DLOCK_TEST_REDIS_SENTINEL`) and a Redis Cluster
//! (`DLOCK_TEST_REDIS_CLUSTER`).

/// One master.
mod single {
    use dlock_redis::RedisBackend;
    use dlock_testkit::contract::{connect_fn, Connect};

    fn connect(addr: String) -> Connect {
        connect_fn(move |opts| {
            let addr = addr.clone();
            async move { RedisBackend::connect(&addr, opts).await }
        })
    }

    dlock_testkit::backend_contract! {
        endpoint: dlock_testkit::ENV_REDIS,
        connect: connect,
        supports: [],
    }
}

/// Redlock: every entry on a majority of independent masters.
mod redlock {
    use dlock_redis::RedisBackend;
    use dlock_testkit::contract::{connect_fn, Connect};

    fn connect(masters: String) -> Connect {
        let masters: Vec<String> = masters.split(',').map(|s| s.trim().to_owned()).collect();
        connect_fn(move |opts| {
            let masters = masters.clone();
            async move { RedisBackend::connect_redlock(&masters, opts).await }
        })
    }

    dlock_testkit::backend_contract! {
        endpoint: dlock_testkit::ENV_REDLOCK,
        connect: connect,
        supports: [],
    }
}

/// The primary of a Sentinel group, found through its Sentinels.
mod sentinel {
    use dlock_redis::RedisBackend;
    use dlock_testkit::contract::{connect_fn, Connect};

    fn connect(group: String) -> Connect {
        let (hosts, service) = group.split_once('/').expect("h:p,.../service");
        let sentinels: Vec<String> = hosts.split(',').map(str::to_owned).collect();
        let service = service.to_owned();
        connect_fn(move |opts| {
            let (sentinels, service) = (sentinels.clone(), service.clone());
            async move { RedisBackend::connect_sentinel(&sentinels, &service, opts).await }
        })
    }

    dlock_testkit::backend_contract! {
        endpoint: dlock_testkit::ENV_REDIS_SENTINEL,
        connect: connect,
        supports: [],
    }
}

/// A Redis Cluster, through its nodes as seeds: each lock on its slot's master.
mod cluster {
    use dlock_redis::RedisBackend;
    use dlock_testkit::contract::{connect_fn, Connect};

    fn connect(nodes: String) -> Connect {
        let seeds: Vec<String> = nodes.split(',').map(|s| s.trim().to_owned()).collect();
        connect_fn(move |opts| {
            let seeds = seeds.clone();
            async move { RedisBackend::connect_cluster(&seeds, opts).await }
        })
    }

    dlock_testkit::backend_contract! {
        endpoint: dlock_testkit::ENV_REDIS_CLUSTER,
        connect: connect,
        supports: [],
    }
}
