//! Readiness probes over plain TCP: ZooKeeper `srvr`, etcd `GET /health`, Redis `PING`.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

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

/// Sends `request` and reads until the server closes the connection or `timeout` passes.
fn exchange(addr: &str, request: &[u8], timeout: Duration) -> std::io::Result<String> {
    let sock: SocketAddr = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| std::io::Error::other(format!("no address for {addr}")))?;
    let mut stream = TcpStream::connect_timeout(&sock, timeout)?;
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    stream.write_all(request)?;
    let mut buf = Vec::new();
    // A read timeout after some data is fine: Redis keeps the connection open.
    let mut chunk = [0u8; 4096];
    loop {
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
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
    exchange(addr, b"srvr", timeout)
        .ok()
        .and_then(|r| ZkMode::parse(&r))
}

/// True when the etcd member at `addr` answers `GET /health` with `"health":"true"`
/// (it has a leader and no alarms).
pub fn etcd_healthy(addr: &str, timeout: Duration) -> bool {
    let request = format!("GET /health HTTP/1.0\r\nHost: {addr}\r\n\r\n");
    exchange(addr, request.as_bytes(), timeout)
        .map(|r| r.starts_with("HTTP/1.") && r.contains("\"health\":\"true\""))
        .unwrap_or(false)
}

/// True when the Redis server at `addr` answers `PING` with `+PONG`.
pub fn redis_ping(addr: &str, timeout: Duration) -> bool {
    exchange(addr, b"PING\r\n", timeout)
        .map(|r| r.starts_with("+PONG"))
        .unwrap_or(false)
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
    }
}
