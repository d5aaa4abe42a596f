//! [`FrameDrop`]: a loopback proxy in front of a cleartext HTTP/2 (gRPC) server that
//! swallows chosen messages, so a test can make one stream go unanswered, or deaf, while
//! the connection and every other stream on it go on.
//!
//! That is what an etcd member did to a keep-alive stream's first renewal under load
//! (sent, never answered, the member's other answers still arriving). No packet rule can
//! stage it: a dropped packet stalls the whole connection, since TCP delivers in order.
//! This proxy works a layer up. It reads both directions as HTTP/2 frames (after the
//! client's connection preface, each frame is a 9-byte header: 24-bit length, type,
//! flags, stream id; then its payload) and forwards every frame, except the DATA frames
//! the test's rule picks, while the budget lasts. Only DATA frames are ever dropped:
//! HEADERS frames carry the connection's header compression state, which each side must
//! see in full and in order.
//!
//! A swallowed request is never seen by the server, so never answered; a swallowed
//! answer or event never reaches the client. The stream stays open either way. (The
//! receiver also never returns the flow-control window the dropped bytes used, a few
//! bytes of the connection's 64 KiB or more: harmless for a test.)

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{JoinHandle, JoinSet};

/// HTTP/2's client connection preface (RFC 9113 §3.4), forwarded as it is.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The DATA frame type (RFC 9113 §6.1).
const DATA: u8 = 0x0;

/// Which way a frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Sent by the client: a request message.
    Client,
    /// Sent by the server: an answer, or a stream's event.
    Server,
}

/// A DATA frame on its way, as the rule sees it.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// Who sent it.
    pub from: Side,
    /// Its stream: each gRPC call is one stream, numbered by the client per connection
    /// (odd numbers), the same in both directions.
    pub stream: u32,
    /// Its payload. For gRPC: a 5-byte prefix (compressed flag, big-endian length), then
    /// the protobuf message, when the message fits one frame (small ones do).
    pub payload: &'a [u8],
}

/// The test's rule: whether to swallow this frame.
type Picks = Box<dyn Fn(&Frame<'_>) -> bool + Send + Sync>;

/// Which frames to swallow: the test's rule, and how many more it may take.
struct Rule {
    picks: Picks,
    budget: AtomicUsize,
    dropped: AtomicUsize,
}

impl Rule {
    /// Whether to swallow `frame`; counts it if so.
    fn takes(&self, frame: &Frame<'_>) -> bool {
        if !(self.picks)(frame) {
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

/// A loopback proxy to one HTTP/2 server that swallows up to `budget` DATA frames its
/// rule picks, either way. Dropping it closes the listener and every proxied connection.
pub struct FrameDrop {
    addr: SocketAddr,
    rule: Arc<Rule>,
    accept: JoinHandle<()>,
}

impl FrameDrop {
    /// Listens on a fresh loopback port and proxies each connection to `upstream`
    /// (`host:port`). `picks` sees each DATA frame, either way ([`Frame`]); of those it
    /// picks, the first `budget` are swallowed.
    ///
    /// # Errors
    /// The listener cannot be bound.
    pub async fn start(
        upstream: &str,
        budget: usize,
        picks: impl Fn(&Frame<'_>) -> bool + Send + Sync + 'static,
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
    let down = async {
        let _ = frames(Side::Server, &mut server_rx, &mut client_tx, &rule).await;
        let _ = client_tx.shutdown().await;
    };
    let up = async {
        let _ = frames(Side::Client, &mut client_rx, &mut server_tx, &rule).await;
        let _ = server_tx.shutdown().await;
    };
    // One direction ending ends the connection: the other side sees it closed.
    tokio::select! {
        () = down => {}
        () = up => {}
    }
}

/// Copies one direction frame by frame (the client's preface first), leaving out the
/// DATA frames the rule takes. Returns when the sender closes the connection (or sends a
/// frame cut short) or the receiver cannot be written to.
async fn frames(
    from: Side,
    rx: &mut OwnedReadHalf,
    tx: &mut OwnedWriteHalf,
    rule: &Rule,
) -> std::io::Result<()> {
    if from == Side::Client {
        let mut preface = [0u8; PREFACE.len()];
        rx.read_exact(&mut preface).await?;
        tx.write_all(&preface).await?;
    }
    let mut header = [0u8; 9];
    let mut payload = Vec::new();
    loop {
        rx.read_exact(&mut header).await?;
        let len = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        payload.resize(len, 0);
        rx.read_exact(&mut payload).await?;
        // The stream id's top bit is reserved.
        let stream = u32::from_be_bytes([header[5], header[6], header[7], header[8]]) & !(1 << 31);
        let frame = Frame {
            from,
            stream,
            payload: &payload,
        };
        if header[3] == DATA && rule.takes(&frame) {
            continue;
        }
        tx.write_all(&header).await?;
        tx.write_all(&payload).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = u32::try_from(payload.len())
            .expect("short payload")
            .to_be_bytes();
        let mut f = vec![len[1], len[2], len[3], kind, 0];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    /// The DATA frames the rule picks are swallowed, either way, while the budget lasts;
    /// everything else passes byte for byte, the client's preface first.
    #[tokio::test]
    async fn swallows_picked_data_frames_both_ways_within_the_budget() {
        let server = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream = server.local_addr().expect("addr").to_string();
        // Client frames on stream 1 and server frames on stream 3 saying "drop me".
        let picks = |f: &Frame<'_>| {
            f.payload == b"drop me"
                && match f.from {
                    Side::Client => f.stream == 1,
                    Side::Server => f.stream == 3,
                }
        };
        let proxy = FrameDrop::start(&upstream, 2, picks).await.expect("proxy");
        let mut client = TcpStream::connect(proxy.addr()).await.expect("connect");
        let (mut far, _) = server.accept().await.expect("accept");

        let mut sent = PREFACE.to_vec();
        sent.extend(frame(DATA, 1, b"drop me"));
        sent.extend(frame(DATA, 1, b"keep me"));
        sent.extend(frame(0x1, 1, b"drop me")); // HEADERS: never dropped
        sent.extend(frame(DATA, 3, b"drop me")); // the client's on stream 3: not picked
        client.write_all(&sent).await.expect("send");
        let mut want = PREFACE.to_vec();
        want.extend(frame(DATA, 1, b"keep me"));
        want.extend(frame(0x1, 1, b"drop me"));
        want.extend(frame(DATA, 3, b"drop me"));
        let mut got = vec![0; want.len()];
        far.read_exact(&mut got).await.expect("the server reads");
        assert_eq!(got, want);

        let mut answered = frame(0x4, 0, b""); // SETTINGS
        answered.extend(frame(DATA, 3, b"drop me")); // the budget's second
        answered.extend(frame(DATA, 3, b"drop me")); // over the budget: forwarded
        answered.extend(frame(DATA, 1, b"answer"));
        far.write_all(&answered).await.expect("answer");
        let mut want = frame(0x4, 0, b"");
        want.extend(frame(DATA, 3, b"drop me"));
        want.extend(frame(DATA, 1, b"answer"));
        let mut got = vec![0; want.len()];
        client.read_exact(&mut got).await.expect("the client reads");
        assert_eq!(got, want);
        assert_eq!(proxy.dropped(), 2);
    }
}
