//! TLS, digest authentication and the ACL of the nodes dlock creates.
//!
//! With credentials the session authenticates as `digest` `user:password`, and every
//! node it creates carries "creator: all, world: read" (Curator's
//! `authorization("digest", ...)` with its default ACL provider shares them). Readers
//! (`dlock status`, a Curator client without the credentials) still see the queue; only
//! the same identity can add to, change or delete it. ZooKeeper checks DELETE and CREATE
//! on the parent, so the lock's parents carry this ACL too.
//!
//! ZooKeeper's digest scheme cannot tell a wrong password: it authenticates any pair as
//! the identity `digest:user:hash(password)`. A wrong password is a different identity,
//! refused ([`Error::PermissionDenied`]) by the ACL of nodes the right one created. So
//! the protection starts once the first node exists: create the chroot (or run dlock once
//! with the right credentials) before other clients connect.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Error, Result, SessionOptions};
use zookeeper_client as zk;

/// Creator (the authenticated identity): all; anyone: read.
static CREATOR_ALL_WORLD_READ: [zk::Acl; 2] = [
    zk::Acl::new_const(zk::Permission::ALL, "auth", ""),
    zk::Acl::new_const(zk::Permission::READ, "world", "anyone"),
];

/// The ACL of every node this session creates: "creator: all, world: read" with
/// credentials, open to anyone (as before) without.
pub(crate) fn acls(opts: &SessionOptions) -> zk::Acls<'static> {
    acls_for(opts.credentials.is_some())
}

/// The ACL of every node dlock creates on a session that has (or has not)
/// authenticated with digest credentials.
pub(crate) fn acls_for(digest: bool) -> zk::Acls<'static> {
    if digest {
        zk::Acls::new(&CREATOR_ALL_WORLD_READ)
    } else {
        zk::Acls::anyone_all()
    }
}

/// Adds TLS and digest authentication from `opts` to `connector`, and says whether the
/// hosts are to be dialled over TLS.
///
/// # Errors
/// [`Error::Tls`] for a CA, certificate or key that cannot be read or parsed;
/// [`Error::InvalidUrl`] for settings zookeeper-client does not have (`server_name`) or
/// credentials without a user.
pub(crate) fn configure(
    mut connector: zk::Connector,
    opts: &SessionOptions,
) -> Result<(zk::Connector, bool)> {
    if opts.namespace.is_some() {
        return Err(Error::InvalidUrl {
            url: String::new(),
            reason: "ZooKeeper keeps applications apart with a chroot (zk://h:p/app), not a \
                     namespace"
                .into(),
        });
    }
    opts.refuse_replicas(crate::connect::ZK_QUORUM)?;
    if let Some(c) = &opts.credentials {
        let user = c.user.as_deref().ok_or_else(|| Error::InvalidUrl {
            url: String::new(),
            reason: "ZooKeeper digest authentication needs a user: give USER:PASSWORD@".into(),
        })?;
        let auth = format!("{user}:{}", c.password.expose());
        connector = connector.with_auth("digest", auth.as_bytes());
    }
    let Some(tls) = &opts.tls else {
        return Ok((connector, false));
    };
    if tls.server_name.is_some() {
        return Err(Error::InvalidUrl {
            url: String::new(),
            reason: "server_name is not supported on ZooKeeper (zookeeper-client verifies the \
                     host it dials); connect by the name the certificate carries"
                .into(),
        });
    }
    // zookeeper-client builds its rustls config with the process's default provider.
    let _ = rustls::crypto::aws_lc_rs::default_provider().install_default();
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read_to_string(path)
            .map_err(|e| Error::Tls(format!("reading {what} {}: {e}", path.display())))
    };
    let ca = match &tls.ca {
        Some(path) => read("the CA bundle", path)?,
        None => system_roots()?,
    };
    let mut options = zk::TlsOptions::new()
        .with_pem_ca(&ca)
        .map_err(|e| Error::Tls(format!("the CA bundle: {e}")))?;
    if let (Some(cert), Some(key)) = (&tls.cert, &tls.key) {
        options = options
            .with_pem_identity(
                &read("the client certificate", cert)?,
                &read("the client key", key)?,
            )
            .map_err(|e| Error::Tls(format!("the client certificate and key: {e}")))?;
    }
    Ok((connector.with_tls(options), true))
}

/// The system's CA bundle as PEM: zookeeper-client takes PEM text only.
fn system_roots() -> Result<String> {
    const BUNDLES: [&str; 4] = [
        "/etc/ssl/certs/ca-certificates.crt",
        "/etc/pki/tls/certs/ca-bundle.crt",
        "/etc/ssl/ca-bundle.pem",
        "/etc/ssl/cert.pem",
    ];
    let from_env = std::env::var("SSL_CERT_FILE").ok();
    let found = from_env
        .iter()
        .map(String::as_str)
        .chain(BUNDLES)
        .find_map(|p| std::fs::read_to_string(p).ok());
    found.ok_or_else(|| Error::Tls("no system CA bundle found; give the CA with ?ca=PATH".into()))
}

/// The typed error for a refusal by ZooKeeper's ACLs or auth, or a TLS failure, if `err`
/// is one.
pub(crate) fn access_error(context: &str, err: &zk::Error) -> Option<Error> {
    match err {
        zk::Error::NoAuth => Some(Error::PermissionDenied(format!(
            "{context}: ZooKeeper refused the operation (NoAuth: the node's ACL does not \
             allow this identity)"
        ))),
        zk::Error::Custom(_) => {
            let text = dlock_core::error::chain(err);
            let tls = ["certificate", "tls", "TLS", "handshake"];
            tls.iter()
                .any(|w| text.contains(w))
                .then(|| Error::Tls(format!("{context}: {text}")))
        }
        _ => None,
    }
}

/// The rustls config zookeeper-client builds from the same settings, for this adapter's
/// own short TLS exchanges (four-letter words, the handshake diagnosis). `None` when a
/// file cannot be read or parsed: the client's connect reports that.
pub(crate) fn client_config(tls: &dlock_core::TlsOptions) -> Option<Arc<rustls::ClientConfig>> {
    use rustls::pki_types::pem::PemObject;
    use rustls::pki_types::CertificateDer;

    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    // The same bundle zookeeper-client is given (`configure`), not rustls-native-certs.
    let system_roots = || {
        let pem = system_roots().unwrap_or_default();
        CertificateDer::pem_slice_iter(pem.as_bytes())
            .filter_map(|c| c.ok())
            .collect()
    };
    dlock_core::tls_client::client_config(tls, provider, |p| std::fs::read(p), system_roots)
        .ok()
        .map(Arc::new)
}

/// Sends a four-letter word to `host` (`host:port`) and reads the answer until the
/// server closes, over TLS when `tls` is given (verified against the host's name).
pub(crate) fn four_letter(
    host: &str,
    word: &[u8],
    tls: Option<&Arc<rustls::ClientConfig>>,
    timeout: Duration,
) -> std::io::Result<String> {
    use std::io::{Read, Write};
    use std::net::ToSocketAddrs;

    let other = |m: &str| std::io::Error::other(m.to_owned());
    let addr = host
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| other("no address"))?;
    let mut sock = std::net::TcpStream::connect_timeout(&addr, timeout)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.set_write_timeout(Some(timeout))?;
    let mut out = Vec::new();
    match tls {
        None => {
            sock.write_all(word)?;
            let _ = sock.read_to_end(&mut out);
        }
        Some(config) => {
            let (name, _port) = host.rsplit_once(':').ok_or_else(|| other("no port"))?;
            let name =
                rustls::pki_types::ServerName::try_from(name.trim_matches(['[', ']']).to_owned())
                    .map_err(|e| other(&e.to_string()))?;
            let mut conn = rustls::ClientConnection::new(config.clone(), name)
                .map_err(|e| other(&e.to_string()))?;
            let mut stream = rustls::Stream::new(&mut conn, &mut sock);
            stream.write_all(word)?;
            // A TLS 1.3 server that wants a client certificate says so only now, in an
            // alert on the first read; a clean close after the answer is not an error.
            let mut buf = [0u8; 4096];
            loop {
                match stream.read(&mut buf) {
                    Ok(0) => break,
                    Ok(n) => out.extend_from_slice(&buf[..n]),
                    Err(e) if out.is_empty() => return Err(e),
                    Err(_) => break,
                }
            }
        }
    }
    Ok(String::from_utf8_lossy(&out).into_owned())
}

/// The error for a TLS connect that got no session: [`Error::Tls`] when a handshake of
/// our own with the first host fails on a certificate, else [`Error::Unreachable`] with
/// `why`.
pub(crate) async fn diagnose_unreachable(hosts: &str, opts: &SessionOptions, why: String) -> Error {
    if let Some(tls) = opts.tls.clone() {
        let first = hosts
            .split(',')
            .next()
            .unwrap_or_default()
            .trim()
            .to_owned();
        let wait = opts.connect_limit().min(Duration::from_secs(2));
        let diagnosis = tokio::task::spawn_blocking(move || diagnose_tls(&first, &tls, wait));
        if let Ok(Some(e)) = diagnosis.await {
            return e;
        }
    }
    Error::Unreachable(why)
}

/// Why TLS to `host` (`host:port`) fails, if it does: zookeeper-client retries a failed
/// handshake until the connect timeout without saying why, so after a timed-out connect
/// with TLS on, one exchange of our own (same CA and client certificate, blocking, at
/// most `timeout`) tells a certificate problem ([`Error::Tls`]) from a server that is
/// down (`None`: the caller's [`Error::Unreachable`] stands).
pub(crate) fn diagnose_tls(
    host: &str,
    tls: &dlock_core::TlsOptions,
    timeout: Duration,
) -> Option<Error> {
    let config = client_config(tls)?;
    let text = four_letter(host, b"ruok", Some(&config), timeout)
        .err()?
        .to_string();
    let tls_words = [
        "certificate",
        "Certificate",
        "handshake",
        "Handshake",
        "alert",
    ];
    tls_words
        .iter()
        .any(|w| text.contains(w))
        .then(|| Error::Tls(format!("ZooKeeper at {host}: {text}")))
}
