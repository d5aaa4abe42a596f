//! Readiness probes over plain TCP: ZooKeeper `srvr`, etcd `GET /health`, Redis `PING`,
//! and one-shot Redis commands for the Sentinel group.

use std::io::{BufRead, BufReader, Read, Write};
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

/// Sends one Redis command (`args` as a RESP array) to `addr` and returns the reply
/// flattened to lines: a simple or bulk string as its text (a bulk string may span several
/// lines, as `INFO` does), an integer as its digits, an array as its elements' lines in
/// order, nil as nothing. A Redis error reply is `-ERR ...`. `None` when the server is
/// unreachable or the reply is cut or malformed.
///
/// Enough to ask a Sentinel or a replica how the group looks (`SENTINEL REPLICAS`,
/// `INFO replication`, `ROLE`) without spawning `redis-cli`.
pub fn redis_query(addr: &str, args: &[&str], timeout: Duration) -> Option<String> {
    let sock: SocketAddr = addr.to_socket_addrs().ok()?.next()?;
    let mut stream = TcpStream::connect_timeout(&sock, timeout).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.set_write_timeout(Some(timeout)).ok()?;
    let mut request = format!("*{}\r\n", args.len());
    for a in args {
        request.push_str(&format!("${}\r\n{a}\r\n", a.len()));
    }
    stream.write_all(request.as_bytes()).ok()?;
    let mut reader = BufReader::new(stream);
    let mut out = Vec::new();
    read_reply(&mut reader, &mut out, 0)?;
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
