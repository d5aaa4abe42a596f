//! [`BlackHole`]: a loopback address whose TCP connects hang, for tests of what a client
//! does when one server's handshake stalls.
//!
//! A stalled connect is what a client meets when a server's listen queue overflows or a
//! SYN is lost: the kernel retransmits the SYN after 1 s, 3 s, 7 s, and a client that
//! gives one attempt its whole connect timeout never tries the next server. The black
//! hole makes that stall certain instead of rare: it listens with a backlog of 0, fills
//! its accept queue with one connection of its own and never accepts, so the kernel drops
//! every further SYN (the listener's `ListenOverflows`) until the black hole is dropped.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};

use socket2::{Domain, Socket, Type};

/// Where it listens: `127.0.0.0`, loopback on Linux like all of 127/8, and before
/// `127.0.0.1` in byte order, so a client that sorts its seeds tries it first.
const HOST: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 0);

/// A listening loopback port whose accept queue is full: every connect to it hangs (no
/// SYN-ACK) until this value is dropped.
pub struct BlackHole {
    addr: SocketAddr,
    // Kept, never read: the listener keeps the port, the stream keeps its queue full.
    _listener: Socket,
    _filler: TcpStream,
}

impl BlackHole {
    /// Binds a fresh port on `127.0.0.0` and fills its accept queue.
    pub fn new() -> std::io::Result<BlackHole> {
        let listener = Socket::new(Domain::IPV4, Type::STREAM, None)?;
        listener.bind(&SocketAddr::from((HOST, 0)).into())?;
        // Linux counts a backlog of 0 as room for one connection: the filler takes it.
        listener.listen(0)?;
        let addr = listener
            .local_addr()?
            .as_socket()
            .ok_or_else(|| std::io::Error::other("the black hole has no IP address"))?;
        let filler = TcpStream::connect(addr)?;
        Ok(BlackHole {
            addr,
            _listener: listener,
            _filler: filler,
        })
    }

    /// `127.0.0.0:<port>`, for a server list.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// A connect to the black hole does not complete: it times out, it is not refused.
    #[test]
    fn connects_hang_until_they_time_out() {
        let hole = BlackHole::new().expect("black hole");
        let start = Instant::now();
        let r = TcpStream::connect_timeout(&hole.addr, Duration::from_millis(300));
        let err = r.expect_err("a connect to the black hole completed");
        assert_eq!(err.kind(), std::io::ErrorKind::TimedOut, "{err}");
        assert!(start.elapsed() >= Duration::from_millis(300));
    }
}
