//! The one error type of the testkit.

use std::path::PathBuf;

/// Everything that can go wrong while installing, starting, probing or signalling servers.
///
/// Each variant says which server or file it is about, so a failed test run prints a
/// message a developer can act on without reading the testkit's source.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An I/O operation failed; `context` says which one and on what.
    #[error("{context}: {source}")]
    Io {
        /// What was being done, e.g. "writing /tmp/x/zoo.cfg".
        context: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The state file could not be parsed or written as JSON.
    #[error("state file {path}: {source}")]
    StateFile {
        /// The state file.
        path: PathBuf,
        /// The JSON error.
        source: serde_json::Error,
    },
    /// A port the cluster needs is already bound by another process.
    #[error("ports already in use on 127.0.0.1: {ports:?} (another cluster running? try a different --port-offset / DLOCK_PORT_OFFSET)")]
    PortsInUse {
        /// The ports that could not be bound.
        ports: Vec<u16>,
    },
    /// The requested cluster shape is not supported.
    #[error("invalid cluster spec: {0}")]
    InvalidSpec(String),
    /// No server with that backend and id is recorded in the state.
    #[error("no {backend} node with id {id} in the cluster state")]
    UnknownServer {
        /// The backend asked for.
        backend: crate::Backend,
        /// The node id asked for.
        id: u32,
    },
    /// A server did not become ready in time.
    #[error(
        "{backend} node {id} ({addr}) not ready after {waited_secs} s; last log lines:\n{log_tail}"
    )]
    NotReady {
        /// Backend of the server.
        backend: crate::Backend,
        /// Node id.
        id: u32,
        /// Client address.
        addr: String,
        /// How long we waited.
        waited_secs: u64,
        /// The end of the server's log file, to say why.
        log_tail: String,
    },
    /// A server process exited while we waited for it to become ready.
    #[error("{backend} node {id} exited during startup; last log lines:\n{log_tail}")]
    Exited {
        /// Backend of the server.
        backend: crate::Backend,
        /// Node id.
        id: u32,
        /// The end of the server's log file.
        log_tail: String,
    },
    /// Sending a signal failed for a reason other than "no such process".
    #[error("signal {signal} to pid {pid}: {source}")]
    Signal {
        /// The signal name.
        signal: &'static str,
        /// Target pid.
        pid: u32,
        /// The errno.
        source: nix::Error,
    },
    /// A process did not die after SIGKILL within the wait limit.
    #[error("pid {pid} still alive {waited_secs} s after SIGKILL")]
    Unkillable {
        /// The pid.
        pid: u32,
        /// How long we waited.
        waited_secs: u64,
    },
    /// An external command (apt-get, etcdctl) failed.
    #[error("command `{command}` failed: {detail}")]
    Command {
        /// The command line.
        command: String,
        /// Exit status and stderr.
        detail: String,
    },
}

/// Result alias with the testkit [`enum@Error`].
pub type Result<T> = std::result::Result<T, Error>;

/// Builds a `map_err` closure that wraps an `io::Error` with a context string.
pub(crate) fn io_ctx(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Error {
    let context = context.into();
    move |source| Error::Io { context, source }
}

impl Error {
    /// Whether this failure means a port of the cluster was taken by someone else: found
    /// busy before starting, or named by a server's log as the reason it exited or never
    /// became ready. Such a start can succeed at another port offset.
    pub fn is_port_conflict(&self) -> bool {
        match self {
            Error::PortsInUse { .. } => true,
            Error::Exited { log_tail, .. } | Error::NotReady { log_tail, .. } => log_tail
                .to_ascii_lowercase()
                .contains("address already in use"),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Backend;

    #[test]
    fn port_conflicts_are_told_apart_from_other_failures() {
        assert!(Error::PortsInUse { ports: vec![2181] }.is_port_conflict());
        let exited = |log_tail: &str| Error::Exited {
            backend: Backend::Redis,
            id: 1,
            log_tail: log_tail.to_owned(),
        };
        assert!(exited(
            "Warning: Could not create server TCP listening socket 127.0.0.1:6379: bind: Address already in use"
        )
        .is_port_conflict());
        let not_ready = Error::NotReady {
            backend: Backend::Etcd,
            id: 1,
            addr: "127.0.0.1:2379".to_owned(),
            waited_secs: 30,
            log_tail: "listen tcp 127.0.0.1:2380: bind: address already in use".to_owned(),
        };
        assert!(not_ready.is_port_conflict());
        assert!(!exited("Unable to access datadir").is_port_conflict());
        assert!(!Error::InvalidSpec("zk: 2".to_owned()).is_port_conflict());
    }
}
