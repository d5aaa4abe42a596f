//! Mapping zookeeper-client errors into [`dlock_core::Error`] at the adapter boundary.

use dlock_core::Error;
use zookeeper_client as zk;

/// True if `err` means the connection dropped before the reply came, so the request may or
/// may not have run. zookeeper-client fails in-flight requests with the error that broke
/// the connection: `ConnectionLoss` on a clean close, but a `Custom` error wrapping the
/// I/O error on a reset (a killed server) or its own "no response" timeout. Without the
/// TLS and SASL features, which this crate does not enable, `Custom` has no other source.
pub(crate) fn is_connection_loss(err: &zk::Error) -> bool {
    matches!(err, zk::Error::ConnectionLoss | zk::Error::Custom(_))
}

/// Maps an error of an operation on an established session. `context` says what dlock
/// was doing.
///
/// The session's end is the lock's end ([`Error::LockLost`]); a missing server is
/// [`Error::Unreachable`]; everything else keeps the client error as its source.
pub(crate) fn map_err(context: &str, err: zk::Error) -> Error {
    if let Some(typed) = crate::security::access_error(context, &err) {
        return typed;
    }
    match err {
        zk::Error::SessionExpired | zk::Error::SessionMoved => {
            Error::LockLost(format!("{context}: ZooKeeper session expired"))
        }
        zk::Error::AuthFailed => {
            Error::LockLost(format!("{context}: ZooKeeper authentication failed"))
        }
        zk::Error::ClientClosed => Error::Closed,
        zk::Error::Timeout | zk::Error::NoHosts => Error::Unreachable(format!("{context}: {err}")),
        err if is_connection_loss(&err) => Error::Unreachable(format!("{context}: {err}")),
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
        zk::Error::AuthFailed => Error::Unauthenticated(format!(
            "ZooKeeper at {connect_string:?} refused the credentials"
        )),
        ref e if crate::security::access_error("connecting", e).is_some() => {
            map_err("connecting", err)
        }
        zk::Error::ConnectionLoss | zk::Error::Timeout | zk::Error::NoHosts => Error::Unreachable(
            format!("no ZooKeeper server of {connect_string:?} answered: {err}"),
        ),
        other => map_err("connecting", other),
    }
}
