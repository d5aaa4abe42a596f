//! The backend contract (`dlock_testkit::contract`) on ZooKeeper (`DLOCK_TEST_ZK`).

use dlock_testkit::contract::{connect_fn, Connect};
use dlock_zookeeper::ZkBackend;

fn connect(hosts: String) -> Connect {
    connect_fn(move |opts| {
        let hosts = hosts.clone();
        async move { ZkBackend::connect(&hosts, opts).await }
    })
}

dlock_testkit::backend_contract! {
    endpoint: dlock_testkit::ENV_ZK,
    connect: connect,
    supports: [revocation, shared_value],
}
