//! Turns Nagle's algorithm off on the client's connections to ZooKeeper.
//!
//! zookeeper-client 0.11 opens its `TcpStream` itself, never sets `TCP_NODELAY` and offers
//! no hook to do so. Nagle then holds the second of two pipelined requests (enqueue's
//! `create` and `get_children`) until the first is acknowledged, which eats most of the
//! pipelining gain. Rather than fork the crate, we look through this process's open file
//! descriptors after connect and after every reconnect, and set the option on each TCP
//! socket whose peer is one of the configured servers. Other clients in the process that
//! talk to the same servers get the option too, which only makes them faster.

use std::net::{SocketAddr, ToSocketAddrs};

/// Resolves the `host:port` list of a connect string (without chroot) to socket
/// addresses, skipping hosts that do not resolve. Blocking (DNS); run it off the runtime.
pub(crate) fn resolve(hosts: &str) -> Vec<SocketAddr> {
    hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .filter_map(|host| {
            let host = host.strip_prefix("tcp://").unwrap_or(host);
            let with_port = if has_port(host) {
                host.to_owned()
            } else {
                format!("{host}:2181")
            };
            match with_port.to_socket_addrs() {
                Ok(addrs) => Some(addrs.collect::<Vec<_>>()),
                Err(err) => {
                    tracing::debug!(%host, %err, "cannot resolve ZooKeeper host for TCP_NODELAY");
                    None
                }
            }
        })
        .flatten()
        .collect()
}

/// True if `host` ends in `:port` (an IPv6 literal must then be bracketed).
fn has_port(host: &str) -> bool {
    match host.rsplit_once(':') {
        Some((name, port)) => {
            !port.is_empty()
                && port.bytes().all(|b| b.is_ascii_digit())
                && (!name.contains(':') || name.ends_with(']'))
        }
        None => false,
    }
}

/// Sets `TCP_NODELAY` on every socket of this process connected to one of `servers`;
/// returns how many sockets it changed. A no-op returning 0 outside Linux.
pub(crate) fn apply(servers: &[SocketAddr]) -> usize {
    #[cfg(target_os = "linux")]
    {
        linux::apply(servers)
    }
    #[cfg(not(target_os = "linux"))]
    {
        let _ = servers;
        0
    }
}

#[cfg(target_os = "linux")]
mod linux {
    use std::net::SocketAddr;
    use std::os::fd::{BorrowedFd, RawFd};
    use std::os::unix::ffi::OsStrExt;

    use socket2::SockRef;

    pub(super) fn apply(servers: &[SocketAddr]) -> usize {
        let Ok(dir) = std::fs::read_dir("/proc/self/fd") else {
            return 0;
        };
        let mut changed = 0;
        for entry in dir.flatten() {
            let Some(fd) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<RawFd>().ok())
            else {
                continue;
            };
            // The link target names the kind of file; only sockets are worth a syscall.
            let is_socket = std::fs::read_link(entry.path())
                .map(|target| target.as_os_str().as_bytes().starts_with(b"socket:"))
                .unwrap_or(false);
            if is_socket && set_if_peer_is_server(fd, servers) {
                changed += 1;
            }
        }
        if changed > 0 {
            tracing::debug!(
                sockets = changed,
                "TCP_NODELAY set on ZooKeeper connections"
            );
        }
        changed
    }

    /// Sets TCP_NODELAY on `fd` if it is a TCP socket connected to one of `servers` and
    /// does not have it yet.
    #[allow(unsafe_code)]
    fn set_if_peer_is_server(fd: RawFd, servers: &[SocketAddr]) -> bool {
        // SAFETY: `borrow_raw` needs `fd` to stay open while the borrow lives; it lives
        // for the three syscalls below and nothing else. We do not own the descriptor, so
        // another thread may close it meanwhile: the syscalls then fail with EBADF, or,
        // if the number was reused at once, read the peer of an unrelated socket and set
        // the option only if that peer is also a ZooKeeper server. TCP_NODELAY changes
        // latency, never data, and no memory is accessed through the descriptor.
        let fd = unsafe { BorrowedFd::borrow_raw(fd) };
        let sock = SockRef::from(&fd);
        let Some(peer) = sock.peer_addr().ok().and_then(|a| a.as_socket()) else {
            return false;
        };
        let is_server = servers
            .iter()
            .any(|s| s.port() == peer.port() && s.ip().to_canonical() == peer.ip().to_canonical());
        if !is_server || sock.nodelay().unwrap_or(true) {
            return false;
        }
        sock.set_nodelay(true).is_ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ports_are_recognised() {
        assert!(has_port("127.0.0.1:2181"));
        assert!(has_port("[::1]:2181"));
        assert!(!has_port("zk1"));
        assert!(!has_port("::1"));
        assert!(!has_port("zk1:"));
    }

    #[test]
    fn resolves_literals_and_default_port() {
        let addrs = resolve("127.0.0.1:12181, tcp://127.0.0.2,[::1]:3");
        assert_eq!(
            addrs,
            vec![
                "127.0.0.1:12181".parse::<SocketAddr>().expect("addr"),
                "127.0.0.2:2181".parse().expect("addr"),
                "[::1]:3".parse().expect("addr"),
            ]
        );
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn sets_nodelay_on_matching_sockets_only() {
        use std::net::{TcpListener, TcpStream};
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let server = listener.local_addr().expect("addr");
        let other = TcpListener::bind("127.0.0.1:0").expect("bind");
        let a = TcpStream::connect(server).expect("connect");
        let b = TcpStream::connect(other.local_addr().expect("addr")).expect("connect");
        assert!(!a.nodelay().expect("get"));
        assert!(apply(&[server]) >= 1);
        assert!(a.nodelay().expect("get"));
        assert!(!b.nodelay().expect("get"));
    }
}
