//! The one place where etcd-client errors become [`dlock_core::Error`]s.
//!
//! The distinction callers act on: the servers could not be reached
//! ([`Error::Unreachable`]: retry, or wait for the session to be declared lost), the lease
//! behind an entry is gone ([`Error::LockLost`]), or the server refused the request
//! ([`Error::Backend`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Error, SessionOptions, TlsOptions};
use etcd_client::Error as EtcdError;
use rustls::pki_types::ServerName;
use tokio::time::{sleep, Instant};

/// Maps an etcd-client error from the operation described by `context`.
pub(crate) fn map(context: &str, e: EtcdError) -> Error {
    if let Some(typed) = access_error(context, &e) {
        return typed;
    }
    match &e {
        EtcdError::GRpcStatus(s) => {
            let msg = s.message();
            if msg.contains("lease not found") {
                return Error::LockLost(format!("{context}: the session's lease is gone ({msg})"));
            }
            // gRPC codes 1 (cancelled: how tower reports a request timeout), 4 (deadline
            // exceeded) and 14 (unavailable: no endpoint could take the request).
            if is_unavailable(&e) {
                return Error::Unreachable(format!("{context}: {msg}"));
            }
            let code: i32 = s.code().into();
            match code {
                1 | 4 => Error::Unreachable(format!("{context}: {msg}")),
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

/// The typed error for a refusal by etcd's auth or by TLS, if `e` is one: gRPC
/// `Unauthenticated` and etcd's "authentication failed" (sent as `InvalidArgument`) are
/// [`Error::Unauthenticated`], `PermissionDenied` is [`Error::PermissionDenied`], and a
/// connection that failed in the TLS handshake (its cause names a certificate) is
/// [`Error::Tls`].
fn access_error(context: &str, e: &EtcdError) -> Option<Error> {
    if let EtcdError::GRpcStatus(s) = e {
        let msg = s.message();
        let code: i32 = s.code().into();
        if code == 16
            || msg.contains("authentication failed")
            || msg.contains("invalid auth token")
            || msg.contains("user name is empty")
        {
            return Some(Error::Unauthenticated(format!("{context}: {msg}")));
        }
        if code == 7 || msg.contains("permission denied") {
            return Some(Error::PermissionDenied(format!("{context}: {msg}")));
        }
    }
    // The cause of a failed handshake is a few sources down (transport, hyper, rustls).
    let chain = dlock_core::error::chain(e);
    let tls_words = [
        "certificate",
        "CertificateRequired",
        "HandshakeFailure",
        "tls handshake",
    ];
    if tls_words.iter().any(|w| chain.contains(w)) {
        return Some(Error::Tls(format!("{context}: {chain}")));
    }
    None
}

/// The error for a TLS connect that got nowhere: [`Error::Tls`] when a handshake of our
/// own with the first endpoint is refused on a certificate, else [`Error::Unreachable`]
/// with `why`.
///
/// etcd-client hides why: a server that requires a client certificate
/// (`--client-cert-auth`) and got none ends the connection with a TLS alert that only
/// the client's background connection task sees, and the request fails as "transport
/// error" or "operation was canceled", like a server that is down. That is a setting to
/// fix (exit 78), not a server to wait for (exit 69), as on ZooKeeper
/// (`diagnose_unreachable` there) and Redis (fred reports the handshake's error).
pub(crate) async fn diagnose_unreachable(
    endpoints: &[String],
    opts: &SessionOptions,
    why: String,
) -> Error {
    if let (Some(tls), Some(first)) = (opts.tls.clone(), endpoints.first()) {
        let host = first
            .trim()
            .trim_start_matches("https://")
            .trim_start_matches("http://")
            .to_owned();
        let wait = opts.connect_limit().min(Duration::from_secs(2));
        let diagnosis = tokio::task::spawn_blocking(move || handshake_refusal(&host, &tls, wait));
        if let Ok(Some(e)) = diagnosis.await {
            return e;
        }
    }
    Error::Unreachable(why)
}

/// Why a TLS exchange with `host` (`host:port`) fails on a certificate, if it does: one
/// handshake with the connect's own settings (blocking, at most `timeout` per step), then
/// HTTP/2's preface, since a TLS 1.3 server refuses a missing client certificate only
/// after the client's side of the handshake, in an alert on the first read. `None` for
/// anything else (refused connection, timeout, an answer): the caller's `Unreachable`
/// stands.
fn handshake_refusal(host: &str, tls: &TlsOptions, timeout: Duration) -> Option<Error> {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;

    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = dlock_core::tls_client::client_config(
        tls,
        provider,
        |p| std::fs::read(p),
        || rustls_native_certs::load_native_certs().certs,
    )
    .ok()?;
    config.alpn_protocols = vec![b"h2".to_vec()];
    let (name, _port) = host.rsplit_once(':')?;
    let name = ServerName::try_from(name.trim_matches(['[', ']']).to_owned()).ok()?;
    let addr = host.to_socket_addrs().ok()?.next()?;
    let mut sock = std::net::TcpStream::connect_timeout(&addr, timeout).ok()?;
    sock.set_read_timeout(Some(timeout)).ok()?;
    sock.set_write_timeout(Some(timeout)).ok()?;
    let mut conn = rustls::ClientConnection::new(Arc::new(config), name).ok()?;
    let mut stream = rustls::Stream::new(&mut conn, &mut sock);
    let failed = match stream.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n") {
        Err(e) => e,
        Ok(()) => stream.read(&mut [0u8; 64]).err()?,
    };
    let text = failed.to_string();
    let tls_words = [
        "certificate",
        "Certificate",
        "alert",
        "handshake",
        "Handshake",
    ];
    tls_words
        .iter()
        .any(|w| text.contains(w))
        .then(|| Error::Tls(format!("etcd at {host}: {text}")))
}

/// True for an error that says no server took the request: etcd-client spreads requests
/// over every endpoint, including dead ones, and a request sent to a dead endpoint fails
/// at once with `Unavailable` instead of moving on to a live one.
///
/// A status of code `Unknown` that carries a source is the client's own report of a
/// connection that broke under the request (the server never sends a source); etcd's
/// "no leader", "leader changed" and "request timed out" are `Unavailable`.
fn is_unavailable(e: &EtcdError) -> bool {
    match e {
        EtcdError::GRpcStatus(s) => {
            let code = i32::from(s.code());
            code == 14 || (code == 2 && std::error::Error::source(s).is_some())
        }
        EtcdError::TransportError(_) => true,
        _ => false,
    }
}

/// Runs `op` again while it fails with [`is_unavailable`] or does not answer within a
/// third of `budget`, for up to `budget`: this is the failover between endpoints, and
/// what gets a request past a leader election (a write forwarded to a leader that died
/// is never answered). Only idempotent operations go through it: every dlock write is a
/// put-if-absent keyed by the ticket or a delete, so a late first attempt and its retry
/// have the effect of one.
pub(crate) async fn retrying<T, F, Fut>(budget: Duration, mut op: F) -> Result<T, EtcdError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, EtcdError>>,
{
    let deadline = Instant::now() + budget;
    let per_try = (budget / 3).max(Duration::from_millis(500)).min(budget);
    let mut attempt = 0u32;
    loop {
        let result = match tokio::time::timeout(per_try, op()).await {
            Ok(r) => r,
            Err(_) => Err(EtcdError::IoError(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("no answer within {per_try:?}"),
            ))),
        };
        match result {
            Err(e) if (is_unavailable(&e) || is_timeout(&e)) && Instant::now() < deadline => {
                tracing::debug!(attempt, error = %e, "request failed; trying again");
                // The first retries are immediate: the balancer likely picks a live
                // endpoint next. Back off only if every endpoint seems down.
                if attempt >= 3 {
                    sleep(Duration::from_millis(10u64 << (attempt - 3).min(6))).await;
                }
                attempt += 1;
            }
            other => return other,
        }
    }
}

fn is_timeout(e: &EtcdError) -> bool {
    matches!(e, EtcdError::IoError(io) if io.kind() == std::io::ErrorKind::TimedOut)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_by_meaning() {
        let lost = map(
            "x",
            EtcdError::LeaseKeepAliveError("lease not found".into()),
        );
        assert!(matches!(lost, Error::LockLost(_)), "{lost:?}");
        let bad = map("h:p", EtcdError::InvalidArgs("empty endpoints".into()));
        assert!(matches!(bad, Error::InvalidUrl { .. }), "{bad:?}");
        let io = map(
            "x",
            EtcdError::IoError(std::io::ErrorKind::ConnectionRefused.into()),
        );
        assert!(matches!(io, Error::Unreachable(_)), "{io:?}");
        let down = map(
            "x",
            EtcdError::GRpcStatus(tonic::Status::unavailable("tcp connect error")),
        );
        assert!(matches!(down, Error::Unreachable(_)), "{down:?}");
        let slow = map(
            "x",
            EtcdError::GRpcStatus(tonic::Status::cancelled("Timeout expired")),
        );
        assert!(matches!(slow, Error::Unreachable(_)), "{slow:?}");
        let gone = map(
            "x",
            EtcdError::GRpcStatus(tonic::Status::not_found(
                "etcdserver: requested lease not found",
            )),
        );
        assert!(matches!(gone, Error::LockLost(_)), "{gone:?}");
        let denied = map(
            "x",
            EtcdError::GRpcStatus(tonic::Status::permission_denied("no")),
        );
        assert!(matches!(denied, Error::PermissionDenied(_)), "{denied:?}");
        let refused = map(
            "x",
            EtcdError::GRpcStatus(tonic::Status::invalid_argument(
                "etcdserver: authentication failed, invalid user ID or password",
            )),
        );
        assert!(matches!(refused, Error::Unauthenticated(_)), "{refused:?}");
        let other = map("x", EtcdError::WatchError("boom".into()));
        assert!(matches!(other, Error::Backend { .. }), "{other:?}");
    }

    #[tokio::test]
    async fn retries_only_unavailable() {
        let mut calls = 0;
        let r: Result<(), EtcdError> = retrying(Duration::from_secs(5), || {
            calls += 1;
            let n = calls;
            async move {
                if n < 3 {
                    Err(EtcdError::GRpcStatus(tonic::Status::unavailable("down")))
                } else {
                    Err(EtcdError::WatchError("final".into()))
                }
            }
        })
        .await;
        assert!(matches!(r, Err(EtcdError::WatchError(_))));
        assert_eq!(calls, 3);
    }
}
