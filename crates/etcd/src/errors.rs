//! The one place where etcd-client errors become [`dlock_core::Error`]s.
//!
//! The distinction callers act on: the servers could not be reached
//! ([`Error::Unreachable`]: retry, or wait for the session to be declared lost), the lease
//! behind an entry is gone ([`Error::LockLost`]), or the server refused the request
//! ([`Error::Backend`]).

use dlock_core::Error;
use etcd_client::Error as EtcdError;

/// Maps an etcd-client error from the operation described by `context`.
pub(crate) fn map(context: &str, e: EtcdError) -> Error {
    match &e {
        EtcdError::GRpcStatus(s) => {
            let msg = s.message();
            if msg.contains("lease not found") {
                return Error::LockLost(format!("{context}: the session's lease is gone ({msg})"));
            }
            // gRPC codes 1 (cancelled: how tower reports a request timeout), 4 (deadline
            // exceeded) and 14 (unavailable: no endpoint could take the request).
            let code: i32 = s.code().into();
            match code {
                1 | 4 | 14 => Error::Unreachable(format!("{context}: {msg}")),
                _ => Error::backend(context, e),
            }
        }
        EtcdError::TransportError(_) | EtcdError::IoError(_) => {
            Error::Unreachable(format!("{context}: {e}"))
        }
        EtcdError::LeaseKeepAliveError(m) if m.contains("not found") => {
            Error::LockLost(format!("{context}: the session's lease is gone"))
        }
        EtcdError::InvalidUri(_) | EtcdError::InvalidArgs(_) => Error::InvalidUrl {
            url: context.to_owned(),
            reason: e.to_string(),
        },
        _ => Error::backend(context, e),
    }
}
