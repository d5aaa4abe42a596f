//! [`FrameDrop`]: a loopback proxy in front of a cleartext HTTP/2 (gRPC) server that
//! swallows chosen request messages, so a test can make the server leave one stream
//! unanswered while the connection and every other stream on it go on.
//!
//! That is what an etcd member did to a keep-alive stream's first renewal under load
//! (stop 35: sent, never answered, the member's other answers still arriving). No packet
//! rule can stage it: a dropped packet stalls the whole connection, since TCP delivers in
//! order. This proxy works a layer up. It forwards the server's bytes unchanged and reads
//! the client's as HTTP/2 frames: after the connection preface, each frame is a 9-byte
//! header (24-bit length, type, flags, stream id) and its payload. A DATA frame whose
//! payload the test's rule picks is not forwarded, while the budget lasts; every other
//! frame is. Only DATA frames are ever dropped: HEADERS frames carry the connection's
//! header compression state, which the server must see in full and in order.
//!
//! The server never sees the swallowed message and so never answers it; the stream stays
//! open. (It also never returns the flow-control window the message used, a few bytes of
//! the connection's 64 KiB or more: harmless for a test.)

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// HTTP/2's client connection preface (RFC 9113 §3.4), forwarded as it is.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The DATA frame type (RFC 9113 §6.1).
const DATA: u8 = 0x0;

/// The test's rule: whether to swallow a DATA frame of this stream with this payload.
type Picks = Box<dyn Fn(u32, &[u8]) -> bool + Send + Sync>;

/// Which client messages to swallow: the test's rule, and how many more it may take.
struct Rule {
    picks: Picks,
    budget: AtomicUsize,
    dropped: AtomicUsize,
}

impl Rule {
    /// Whether to swallow a DATA frame of `stream` with this payload; counts it if so.
    fn takes(&self, stream: u32, payload: &[u8]) -> bool {
        if !(self.picks)(stream, payload) {
            return false;
        }
        let took = self
            .budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |b| b.checked_sub(1))
            .is_ok();
        if took {
            self.dropped.fetch_add(1, Ordering::SeqCst);
        }
        took
    }
}

/// A loopback proxy to one HTTP/2 server that swallows up to `budget` client DATA frames
/// its rule picks. Dropping it closes the listener and every proxied connection.
pub struct FrameDrop {
    addr: SocketAddr,
    rule: Arc<Rule>,
    accept: JoinHandle<()>,
}

impl FrameDrop {
    /// Listens on a fresh loopback port and proxies each connection to `upstream`
    /// (`host:port`). `picks` sees each DATA frame the client sends: its stream id (each
    /// gRPC call is one stream, numbered per connection) and its payload (for gRPC: the
    /// 5-byte message prefix, then the message); of those it picks, the first `budget`
    /// are swallowed.
    ///
    /// # Errors
    /// The listener cannot be bound.
    pub async fn start(
        upstream: &str,
        budget: usize,
        picks: impl Fn(u32, &[u8]) -> bool + Send + Sync + 'static,
    ) -> std::io::Result<FrameDrop> {
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await?;
        let addr = listener.local_addr()?;
        let rule = Arc::new(Rule {
            picks: Box::new(picks),
            budget: AtomicUsize::new(budget),
            dropped: AtomicUsize::new(0),
        });
        let upstream = upstream.to_owned();
        let accept = tokio::spawn({
            let rule = rule.clone();
            async move {
                // Owned here: aborting the accept task drops the set, which aborts every
                // connection's pumps.
                let mut connections = JoinSet::new();
                while let Ok((client, _)) = listener.accept().await {
                    connections.spawn(proxy(client, upstream.clone(), rule.clone()));
                    // Reap the finished ones so a long test does not keep them all.
                    while connections.try_join_next().is_some() {}
                }
            }
        });
        Ok(FrameDrop { addr, rule, accept })
    }

    /// `127.0.0.1:<port>`, for the client to connect to instead of the server.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// How many DATA frames were swallowed so far.
    pub fn dropped(&self) -> usize {
        self.rule.dropped.load(Ordering::SeqCst)
    }
}

impl Drop for FrameDrop {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Proxies one connection until either side closes it or breaks the framing.
async fn proxy(client: TcpStream, upstream: String, rule: Arc<Rule>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    // Frames go out one by one in two writes each: without NODELAY the second would
    // wait for the first one's ACK.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (mut client_rx, mut client_tx) = client.into_split();
    let (mut server_rx, mut server_tx) = server.into_split();
    let down = async move {
        let _ = tokio::io::copy(&mut server_rx, &mut client_tx).await;
        let _ = client_tx.shutdown().await;
    };
    let up = async move {
        let _ = client_frames(&mut client_rx, &mut server_tx, &rule).await;
        let _ = server_tx.shutdown().await;
    };
    // One direction ending ends the connection: the other side sees it closed.
    tokio::select! {
        () = down => {}
        () = up => {}
    }
}

/// Copies the client's preface, then its frames one by one, leaving out the DATA frames
/// the rule takes. Returns when the client closes the connection (or sends a frame cut
/// short) or the server cannot be written to.
async fn client_frames(
    from: &mut tokio::net::tcp::OwnedReadHalf,
    to: &mut tokio::net::tcp::OwnedWriteHalf,
    rule: &Rule,
) -> std::io::Result<()> {
    let mut preface = [0u8; PREFACE.len()];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    let mut header = [0u8; 9];
    let mut payload = Vec::new();
    loop {
        from.read_exact(&mut header).await?;
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        payload.resize(len, 0);
        from.read_exact(&mut payload).await?;
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & !(1 << 31);
        if header[3] == DATA && rule.takes(stream, &payload) {
            continue;
        }
        to.write_all(&header).await?;
        to.write_all(&payload).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame the rule picks is swallowed while the budget lasts; the rest pass,
    /// byte for byte, and the preface first.
    #[tokio::test]
    async fn swallows_picked_data_frames_within_the_budget() {
        let server = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream = server.local_addr().expect("addr").to_string();
        let drop = FrameDrop::start(&upstream, 1, |_, p| p == b"drop me")
            .await
            .expect("proxy");
        let mut client = TcpStream::connect(drop.addr()).await.expect("connect");
        let (mut seen, _) = server.accept().await.expect("accept");

        let frame = |kind: u8, stream: u32, payload: &[u8]| {
            let len = u32::try_from(payload.len())
                .expect("short payload")
                .to_be_bytes();
            let mut f = vec![len[1], len[2], len[3], kind, 0];
            f.extend_from_slice(&stream.to_be_bytes());
            f.extend_from_slice(payload);
            f
        };
        let kept = frame(DATA, 1, b"keep me");
        let headers = frame(0x1, 3, b"drop me");
        let mut sent = PREFACE.to_vec();
        sent.extend(frame(DATA, 1, b"drop me"));
        sent.extend(&kept);
        sent.extend(&headers); // not DATA: forwarded whatever its payload
        sent.extend(frame(DATA, 5, b"drop me")); // over the budget: forwarded
        client.write_all(&sent).await.expect("send");
        client.shutdown().await.expect("close");

        let mut got = Vec::new();
        seen.read_to_end(&mut got).await.expect("read");
        let mut want = PREFACE.to_vec();
        want.extend(&kept);
        want.extend(&headers);
        want.extend(frame(DATA, 5, b"drop me"));
        assert_eq!(got, want);
        assert_eq!(drop.dropped(), 1);
    }
}
