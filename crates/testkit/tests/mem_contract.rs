//! The backend contract (`dlock_testkit::contract`) on the in-memory backend: the same
//! tests every adapter passes against its real servers, each on a fresh `MemServer`.

use std::time::Duration;

use dlock_testkit::contract::{connect_fn, Connect};
use dlock_testkit::mem::MemServer;

/// A factory on a server of its own: every session it opens shares that server, and its
/// replies take a millisecond, as over a network, so that an acquire can be dropped
/// between the server applying it and the reply (an in-memory call otherwise completes
/// at its first poll).
fn fresh_server() -> Connect {
    let server = MemServer::new();
    connect_fn(move |opts| {
        let server = server.clone();
        async move {
            let b = server.connect(opts).await?;
            server.delay_replies(b.session(), Duration::from_millis(1));
            Ok(b)
        }
    })
}

dlock_testkit::backend_contract! {
    connect: fresh_server(),
    supports: [revocation, shared_value],
}
