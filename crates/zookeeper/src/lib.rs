//! tmp
#![deny(missing_docs)]
mod backend;
mod errors;
mod nodelay;
mod session;

pub use backend::{ZkBackend, DEFAULT_SESSION_TIMEOUT};
pub use zookeeper_client as zk;

/// Adapter-specific connect options; [`ZkOptions::default`] is right for almost everyone.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkOptions {
    /// Set `TCP_NODELAY` on the session's connections (Linux only; a no-op elsewhere).
    /// Default `true`. Turning it off only makes sense to measure what it buys.
    pub tcp_nodelay: bool,
}

impl Default for ZkOptions {
    fn default() -> Self {
        ZkOptions { tcp_nodelay: true }
    }
}

impl ZkOptions {
    /// Sets [`ZkOptions::tcp_nodelay`].
    pub fn with_tcp_nodelay(mut self, on: bool) -> Self {
        self.tcp_nodelay = on;
        self
    }
}
