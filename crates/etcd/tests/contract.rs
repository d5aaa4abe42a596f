//! The backend contract (`dlock_testkit::contract`) on etcd (`DLOCK_TEST_ETCD`).

use dlock_etcd::EtcdBackend;
use dlock_testkit::contract::{connect_fn, Connect};

fn connect(endpoints: String) -> Connect {
    let endpoints: Vec<String> = endpoints.split(',').map(|s| s.trim().to_owned()).collect();
    connect_fn(move |opts| {
        let endpoints = endpoints.clone();
        async move { EtcdBackend::connect(&endpoints, opts).await }
    })
}

dlock_testkit::backend_contract! {
    endpoint: dlock_testkit::ENV_ETCD,
    connect: connect,
    supports: [],
}
