//! A loopback TCP proxy that can stop forwarding: a client cut off from its servers
//! without touching the servers or any network outside 127.0.0.0/8.
//!
//! While cut, connections stay open and bytes already read wait in the proxy, exactly as
//! a partition looks to both ends (no RST, no FIN): the client only learns from its own
//! timeouts. New connections are accepted but not connected upstream until restored.

use std::io::{Read as _, Write as _};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context as _;

const POLL: Duration = Duration::from_millis(5);

struct Shared {
    /// Where new connections go; [`Proxy::retarget`] moves it, like a virtual IP.
    upstream: Mutex<SocketAddr>,
    forwarding: AtomicBool,
    stop: AtomicBool,
    /// Every socket the proxy opened, to shut down on drop.
    sockets: Mutex<Vec<TcpStream>>,
}

impl Shared {
    /// Blocks while cut; false once the proxy is stopping.
    fn wait_forwarding(&self) -> bool {
        while !self.forwarding.load(Ordering::SeqCst) {
            if self.stop.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(POLL);
        }
        !self.stop.load(Ordering::SeqCst)
    }

    fn track(&self, s: &TcpStream) {
        if let Ok(c) = s.try_clone() {
            self.sockets
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(c);
        }
    }
}

/// One proxy in front of one server; dropping it closes every connection through it.
pub(crate) struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
}

impl Proxy {
    /// Listens on an ephemeral loopback port and forwards to `upstream`.
    pub(crate) fn start(upstream: SocketAddr) -> anyhow::Result<Proxy> {
        anyhow::ensure!(
            upstream.ip().is_loopback(),
            "the proxy only forwards to loopback addresses, not {upstream}"
        );
        let listener = TcpListener::bind("127.0.0.1:0").context("binding a proxy")?;
        let addr = listener.local_addr().context("proxy address")?;
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            forwarding: AtomicBool::new(true),
            stop: AtomicBool::new(false),
            sockets: Mutex::new(Vec::new()),
        });
        let s = Arc::clone(&shared);
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if s.stop.load(Ordering::SeqCst) {
                    break;
                }
                let Ok(client) = conn else { continue };
                let s = Arc::clone(&s);
                std::thread::spawn(move || connect(client, &s));
            }
        });
        Ok(Proxy { addr, shared })
    }

    pub(crate) fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops forwarding in both directions.
    pub(crate) fn cut(&self) {
        self.shared.forwarding.store(false, Ordering::SeqCst);
    }

    /// Forwards again, including what waited during the cut.
    pub(crate) fn restore(&self) {
        self.shared.forwarding.store(true, Ordering::SeqCst);
    }

    /// Sends new connections to `upstream` and closes every open one, as a virtual IP
    /// moving to a promoted replica does: clients reconnect and land on the new server.
    pub(crate) fn retarget(&self, upstream: SocketAddr) -> anyhow::Result<()> {
        anyhow::ensure!(
            upstream.ip().is_loopback(),
            "the proxy only forwards to loopback addresses, not {upstream}"
        );
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = upstream;
        for s in self
            .shared
            .sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
        Ok(())
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_secs(1));
        for s in self
            .shared
            .sockets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

fn connect(client: TcpStream, shared: &Arc<Shared>) {
    shared.track(&client);
    if !shared.wait_forwarding() {
        return;
    }
    let upstream = *shared.upstream.lock().unwrap_or_else(|p| p.into_inner());
    let Ok(server) = TcpStream::connect_timeout(&upstream, Duration::from_secs(2)) else {
        let _ = client.shutdown(Shutdown::Both);
        return;
    };
    shared.track(&server);
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (Ok(c2), Ok(s2)) = (client.try_clone(), server.try_clone()) else {
        return;
    };
    let up = Arc::clone(shared);
    std::thread::spawn(move || pipe(client, server, &up));
    pipe(s2, c2, shared);
}

/// Copies `from` to `to` until either side closes, holding bytes while cut.
fn pipe(mut from: TcpStream, mut to: TcpStream, shared: &Shared) {
    let mut buf = [0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !shared.wait_forwarding() || to.write_all(&buf[..n]).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn forwards_holds_while_cut_and_delivers_after_restore() {
        let server = TcpListener::bind("127.0.0.1:0").expect("bind");
        let upstream = server.local_addr().expect("addr");
        std::thread::spawn(move || {
            for conn in server.incoming() {
                let Ok(mut c) = conn else { continue };
                let mut buf = [0u8; 64];
                while let Ok(n) = c.read(&mut buf) {
                    if n == 0 || c.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        });
        let proxy = Proxy::start(upstream).expect("proxy");
        let mut c = TcpStream::connect(proxy.addr()).expect("connect");
        // Generous for the first echo (a handful of OS threads on a busy machine); the
        // short timeout only for the read that must see nothing.
        c.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        let mut buf = [0u8; 4];
        c.write_all(b"ping").expect("write");
        c.read_exact(&mut buf).expect("echo");
        assert_eq!(&buf, b"ping");
        proxy.cut();
        c.set_read_timeout(Some(Duration::from_millis(300)))
            .expect("timeout");
        c.write_all(b"held").expect("write while cut");
        assert!(
            c.read_exact(&mut buf).is_err(),
            "nothing gets through a cut"
        );
        proxy.restore();
        c.set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        c.read_exact(&mut buf).expect("delivered after restore");
        assert_eq!(&buf, b"held");
        assert!(Proxy::start("10.0.0.1:1".parse().expect("addr")).is_err());
        // Retargeting closes the open connection; a new one reaches the new upstream.
        let other = TcpListener::bind("127.0.0.1:0").expect("bind");
        proxy
            .retarget(other.local_addr().expect("addr"))
            .expect("retarget");
        assert!(
            matches!(c.read(&mut buf), Ok(0) | Err(_)),
            "old connection closed"
        );
        let _c2 = TcpStream::connect(proxy.addr()).expect("connect");
        other
            .accept()
            .expect("the new upstream gets the connection");
    }
}
