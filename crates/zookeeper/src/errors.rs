//! Mapping zookeeper-client errors into [`dlock_core::Error`] at the adapter boundary.

use dlock_core::Error;
use zookeeper_client as zk;

/// Maps an error of an operation on an established session. `context` says what dlock
/// was doing.
///
/// The session's end is the lock's end ([`Error::LockLost`]); a missing server is
/// [`Error::Unreachable`]; everything else keeps the client error as its source.
pub(crate) fn map_err(context: &str, err: zk::Error) -> Error {
    match err {
        zk::Error::SessionExpired | zk::Error::SessionMoved => {
            Error::LockLost(format!("{context}: ZooKeeper session expired"))
        }
        zk::Error::AuthFailed => {
            Error::LockLost(format!("{context}: ZooKeeper authentication failed"))
        }
        zk::Error::ClientClosed => Error::Closed,
        zk::Error::ConnectionLoss | zk::Error::Timeout | zk::Error::NoHosts => {
            Error::Unreachable(format!("{context}: {err}"))
        }
        other => Error::backend(context.to_owned(), other),
    }
}

/// Maps an error of the initial connect.
pub(crate) fn connect_error(connect_string: &str, err: zk::Error) -> Error {
    match err {
        zk::Error::BadArguments(reason) => Error::InvalidUrl {
            url: connect_string.to_owned(),
            reason: (*reason).to_owned(),
        },
        zk::Error::ConnectionLoss | zk::Error::Timeout | zk::Error::NoHosts => Error::Unreachable(
            format!("no ZooKeeper server of {connect_string:?} answered: {err}"),
        ),
        other => map_err("connecting", other),
    }
}
