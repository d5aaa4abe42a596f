//! Readiness probes over plain TCP or TLS: ZooKeeper `srvr`, etcd `GET /health`, Redis
//! `PING`, and one-shot Redis commands for the Sentinel group.
//!
//! The TLS path (a secured cluster, see [`crate::secure`]) presents the cluster's client
//! certificate and trusts only its CA, with rustls: no `openssl` process per probe.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::secure::{Pki, REDIS_ADMIN_PASSWORD, REDIS_ADMIN_USER};

/// The role a ZooKeeper node reports in `srvr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ZkMode {
    /// A single-node server.
    Standalone,
    /// The ensemble leader.
    Leader,
    /// A follower of a leader (serving).
    Follower,
    /// A non-voting observer (serving).
    Observer,
}

impl ZkMode {
    fn parse(srvr: &str) -> Option<ZkMode> {
        let mode = srvr.lines().find_map(|l| l.strip_prefix("Mode: "))?;
        match mode.trim() {
            "standalone" => Some(ZkMode::Standalone),
            "leader" => Some(ZkMode::Leader),
            "follower" => Some(ZkMode::Follower),
            "observer" => Some(ZkMode::Observer),
            _ => None,
        }
    }
}

/// A TCP connection to `addr` with read and write timeouts.
fn connect(addr: &str, timeout: Duration) -> std::io::Result<TcpStream> {
    let sock: SocketAddr = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("no address for {addr}")))?;
    let stream = TcpStream::connect_timeout(&sock, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    Ok(stream)
}

/// A mutual-TLS client configuration: trusts the certificates in `ca` only, presents
/// `cert` with `key`.
pub(crate) fn tls_config(
    ca: &Path,
    cert: &Path,
    key: &Path,
) -> std::io::Result<Arc<rustls::ClientConfig>> {
    let bad = |what: &Path, e: rustls::pki_types::pem::Error| {
        std::io::Error::other(format!("reading {}: {e}", what.display()))
    };
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(ca).map_err(|e| bad(ca, e))? {
        roots
            .add(c.map_err(|e| bad(ca, e))?)
            .map_err(std::io::Error::other)?;
    }
    let chain = CertificateDer::pem_file_iter(cert)
        .map_err(|e| bad(cert, e))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(cert, e))?;
    let key_der = PrivateKeyDer::from_pem_file(key).map_err(|e| bad(key, e))?;
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::aws_lc_rs::default_provider(),
    ))
    .with_safe_default_protocol_versions()
    .map_err(std::io::Error::other)?
    .with_root_certificates(roots)
    .with_client_auth_cert(chain, key_der)
    .map_err(std::io::Error::other)?;
    Ok(Arc::new(config))
}

/// A TLS stream to `addr` (verified as the IP or host name in it) with the client
/// certificate of `pki`.
fn connect_tls(
    addr: &str,
    pki: &Path,
    timeout: Duration,
) -> std::io::Result<rustls::StreamOwned<rustls::ClientConnection, TcpStream>> {
    let files = Pki::in_dir(pki);
    let config = tls_config(&files.ca, &files.cert, &files.key)?;
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_owned();
    let name = ServerName::try_from(host).map_err(std::io::Error::other)?;
    let conn = rustls::ClientConnection::new(config, name).map_err(std::io::Error::other)?;
    let mut stream = rustls::StreamOwned::new(conn, connect(addr, timeout)?);
    // Finish the handshake now, so a refused certificate fails here.
    while stream.conn.is_handshaking() {
        stream.conn.complete_io(&mut stream.sock)?;
    }
    Ok(stream)
}

/// Sends `request` over TCP, or TLS with the client certificate of the PKI in `tls`, and
/// reads until the server closes the connection or `timeout` passes.
fn exchange_over(
    addr: &str,
    tls: Option<&Path>,
    request: &[u8],
    timeout: Duration,
) -> std::io::Result<String> {
    match tls {
        None => exchange_on(connect(addr, timeout)?, request),
        Some(pki) => exchange_on(connect_tls(addr, pki, timeout)?, request),
    }
}

/// Sends `request` and reads until the server closes the connection or `timeout` passes.
fn exchange(addr: &str, request: &[u8], timeout: Duration) -> std::io::Result<String> {
    exchange_over(addr, None, request, timeout)
}

fn exchange_on(mut stream: impl Read + Write, request: &[u8]) -> std::io::Result<String> {
    stream.write_all(request)?;
    stream.flush()?;
    let mut buf = Vec::new();
    // A read timeout after some data is fine: Redis keeps the connection open.
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            // A TLS peer that closes without close_notify, after answering.
            Err(e) if !buf.is_empty() && e.kind() == std::io::ErrorKind::UnexpectedEof => break,
            Err(e) if !buf.is_empty() && is_timeout(&e) => break,
            Err(e) => return Err(e),
        }
        if request == b"PING\r\n" && buf.ends_with(b"\r\n") {
            break;
        }
    }
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

fn is_timeout(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
    )
}

/// The mode a ZooKeeper node at `addr` reports, or `None` when it is unreachable or not
/// serving (for example an ensemble member without quorum).
///
/// `ruok` is not used: it answers `imok` even without a quorum.
pub fn zk_mode(addr: &str, timeout: Duration) -> Option<ZkMode> {
    zk_mode_over(addr, None, timeout)
}

/// As [`zk_mode`], over TLS with the client certificate of the PKI in `tls` when given
/// (four-letter words work on ZooKeeper's TLS port).
pub fn zk_mode_over(addr: &str, tls: Option<&Path>, timeout: Duration) -> Option<ZkMode> {
    exchange_over(addr, tls, b"srvr", timeout)
        .ok()
        .and_then(|r| ZkMode::parse(&r))
}

/// True when the etcd member at `addr` answers `GET /health` with `"health":"true"`
/// (it has a leader and no alarms).
pub fn etcd_healthy(addr: &str, timeout: Duration) -> bool {
    etcd_healthy_over(addr, None, timeout)
}

/// As [`etcd_healthy`], over HTTPS with the client certificate of the PKI in `tls` when
/// given (etcd answers `/health` without credentials, also with auth enabled).
pub fn etcd_healthy_over(addr: &str, tls: Option<&Path>, timeout: Duration) -> bool {
    let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    exchange_over(addr, tls, request.as_bytes(), timeout)
        .map(|r| r.starts_with("HTTP/1.") && r.contains("\"health\":\"true\""))
        .unwrap_or(false)
}

/// True when the Redis server at `addr` answers `PING` with `+PONG`.
pub fn redis_ping(addr: &str, timeout: Duration) -> bool {
    exchange(addr, b"PING\r\n", timeout)
        .map(|r| r.starts_with("+PONG"))
        .unwrap_or(false)
}

/// As [`redis_ping`]; with `tls`, over TLS and logged in as the administrator (a secured
/// Redis answers an anonymous `PING` with `-NOAUTH`).
pub fn redis_ping_over(addr: &str, tls: Option<&Path>, timeout: Duration) -> bool {
    match tls {
        None => redis_ping(addr, timeout),
        Some(_) => redis_query_over(addr, tls, &["PING"], timeout).as_deref() == Some("PONG"),
    }
}

/// Opens a TLS connection to `addr` that trusts only the certificates in `ca` and presents
/// `cert`/`key`, completes the handshake and closes it: `Ok` when both sides accepted.
///
/// For tests of the secured cluster's PKI (a client trusting another CA must fail). A
/// server that checks the client certificate only after its side of the handshake
/// (TLS 1.3) may still refuse the connection afterwards; this does not wait for that.
pub fn tls_handshake(
    addr: &str,
    ca: &Path,
    cert: &Path,
    key: &Path,
    timeout: Duration,
) -> std::io::Result<()> {
    let config = tls_config(ca, cert, key)?;
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h).to_owned();
    let name = ServerName::try_from(host).map_err(std::io::Error::other)?;
    let mut conn = rustls::ClientConnection::new(config, name).map_err(std::io::Error::other)?;
    let mut sock = connect(addr, timeout)?;
    while conn.is_handshaking() {
        conn.complete_io(&mut sock)?;
    }
    Ok(())
}

/// Sends one Redis command (`args` as a RESP array) to `addr` and returns the reply
/// flattened to lines: a simple or bulk string as its text (a bulk string may span several
/// lines, as `INFO` does), an integer as its digits, an array as its elements' lines in
/// order, nil as nothing. A Redis error reply is `-ERR ...`. `None` when the server is
/// unreachable or the reply is cut or malformed.
///
/// Enough to ask a Sentinel or a replica how the group looks (`SENTINEL REPLICAS`,
/// `INFO replication`, `ROLE`) without spawning `redis-cli`.
pub fn redis_query(addr: &str, args: &[&str], timeout: Duration) -> Option<String> {
    redis_query_over(addr, None, args, timeout)
}

/// As [`redis_query`]; with `tls` (a secured cluster's PKI dir) over TLS with its client
/// certificate, logged in as the administrator ([`REDIS_ADMIN_USER`]) first. A refused
/// login is returned as its error reply (`-WRONGPASS ...`) instead of running `args`.
pub fn redis_query_over(
    addr: &str,
    tls: Option<&Path>,
    args: &[&str],
    timeout: Duration,
) -> Option<String> {
    match tls {
        None => redis_command(&mut BufReader::new(connect(addr, timeout).ok()?), args),
        Some(pki) => {
            let mut stream = BufReader::new(connect_tls(addr, pki, timeout).ok()?);
            let auth = redis_command(
                &mut stream,
                &["AUTH", REDIS_ADMIN_USER, REDIS_ADMIN_PASSWORD],
            )?;
            if auth != "OK" {
                return Some(auth);
            }
            redis_command(&mut stream, args)
        }
    }
}

/// Sends one command on `stream` and reads its reply (see [`redis_query`]).
fn redis_command<S: Read + Write>(stream: &mut BufReader<S>, args: &[&str]) -> Option<String> {
    let mut request = format!("*{}\r\n", args.len());
    for a in args {
        request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream.get_mut().write_all(request.as_bytes()).ok()?;
    stream.get_mut().flush().ok()?;
    let mut out = Vec::new();
    read_reply(stream, &mut out, 0)?;
    Some(out.join("\n"))
}

/// Reads one RESP2 reply into `out` (see [`redis_query`]); `depth` bounds nesting.
fn read_reply(r: &mut impl BufRead, out: &mut Vec<String>, depth: u32) -> Option<()> {
    if depth > 8 {
        return None;
    }
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let line = line.strip_suffix("\r\n")?;
    let (kind, rest) = line.split_at_checked(1)?;
    match kind {
        "+" | ":" => out.push(rest.to_owned()),
        "-" => out.push(line.to_owned()),
        "$" => {
            let len: i64 = rest.parse().ok()?;
            if len >= 0 {
                let mut buf = vec![0u8; usize::try_from(len).ok()? + 2];
                r.read_exact(&mut buf).ok()?;
                buf.truncate(buf.len() - 2);
                out.push(String::from_utf8_lossy(&buf).into_owned());
            }
        }
        "*" => {
            let n: i64 = rest.parse().ok()?;
            for _ in 0..n.max(0) {
                read_reply(r, out, depth + 1)?;
            }
        }
        _ => return None,
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_srvr_modes() {
        let srvr = "Zookeeper version: 3.8.0\nLatency min/avg/max: 0/0.0/0\nMode: follower\nNode count: 5\n";
        assert_eq!(ZkMode::parse(srvr), Some(ZkMode::Follower));
        assert_eq!(ZkMode::parse("Mode: leader\n"), Some(ZkMode::Leader));
        assert_eq!(
            ZkMode::parse("Mode: standalone\n"),
            Some(ZkMode::Standalone)
        );
        assert_eq!(
            ZkMode::parse("This ZooKeeper instance is not currently serving requests\n"),
            None
        );
    }

    #[test]
    fn probes_say_no_when_nothing_listens() {
        // Bind then drop to get a port that is very likely closed.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("ephemeral port")
            .port();
        let addr = format!("127.0.0.1:{port}");
        let t = Duration::from_millis(300);
        assert_eq!(zk_mode(&addr, t), None);
        assert!(!etcd_healthy(&addr, t));
        assert!(!redis_ping(&addr, t));
        assert_eq!(redis_query(&addr, &["PING"], t), None);
    }

    #[test]
    fn reads_nested_resp_replies() {
        let wire = b"*3\r\n$6\r\nmaster\r\n:42\r\n*2\r\n$-1\r\n+OK\r\n";
        let mut out = Vec::new();
        read_reply(&mut &wire[..], &mut out, 0).expect("parses");
        assert_eq!(out, vec!["master", "42", "OK"]);
        let mut out = Vec::new();
        assert_eq!(read_reply(&mut &b"$10\r\nshort\r\n"[..], &mut out, 0), None);
        let mut out = Vec::new();
        read_reply(&mut &b"-ERR no such master\r\n"[..], &mut out, 0).expect("error reply");
        assert_eq!(out, vec!["-ERR no such master"]);
    }
}
