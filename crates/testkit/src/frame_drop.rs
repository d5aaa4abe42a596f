//! [`FrameDrop`]: a loopback proxy in front of a cleartext HTTP/2 (gRPC) server that
//! swallows or holds back chosen frames, so a test can make one stream go unanswered or
//! deaf, or one request arrive late, while the connection and every other stream on it
//! go on.
//!
//! That is what an etcd member did to a keep-alive stream's first renewal under load
//! (sent, never answered, the member's other answers still arriving). No packet rule can
//! stage it: a dropped packet stalls the whole connection, since TCP delivers in order.
//! This proxy works a layer up. It reads both directions as HTTP/2 frames (after the
//! client's connection preface, each frame is a 9-byte header: 24-bit length, type,
//! flags, stream id; then its payload) and asks the test's rule about each frame of a
//! stream: forward it, swallow it, or hold it until [`FrameDrop::release_held`]. Header
//! frames (HEADERS, CONTINUATION, PUSH_PROMISE) are always forwarded and never shown to
//! the rule: they carry the connection's header compression state, which each side must
//! see in full and in order. Connection frames (stream 0: SETTINGS, PING, GOAWAY, the
//! connection's WINDOW_UPDATE) are always forwarded too.
//!
//! A swallowed request is never seen by the server, so never answered; a swallowed
//! answer or event never reaches the client. A held request reaches the server when the
//! test releases it, late, as a request delayed in a network would: hold the stream's
//! later frames too (the client's RST_STREAM when it gives up) and the server still
//! serves it. (The receiver never returns the flow-control window that swallowed bytes
//! used, a few bytes of the connection's 64 KiB or more: harmless for a test.)

use std::net::{Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::{JoinHandle, JoinSet};

/// HTTP/2's client connection preface (RFC 9113 §3.4), forwarded as it is.
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// The DATA frame type (RFC 9113 §6.1): a gRPC message, or part of one.
pub const DATA: u8 = 0x0;
/// The frame types that carry header blocks (HEADERS, PUSH_PROMISE, CONTINUATION).
const HEADER_BLOCKS: [u8; 3] = [0x1, 0x5, 0x9];

/// Which way a frame goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Sent by the client: a request message.
    Client,
    /// Sent by the server: an answer, or a stream's event.
    Server,
}

/// A frame of a stream on its way, as the rule sees it.
#[derive(Debug, Clone, Copy)]
pub struct Frame<'a> {
    /// Who sent it.
    pub from: Side,
    /// Its type: [`DATA`], or RST_STREAM (0x3), WINDOW_UPDATE (0x8), PRIORITY (0x2).
    pub kind: u8,
    /// Its stream: each gRPC call is one stream, numbered by the client per connection
    /// (odd numbers), the same in both directions; never 0 here.
    pub stream: u32,
    /// Its payload. For a gRPC DATA frame: a 5-byte prefix (compressed flag, big-endian
    /// length), then the protobuf message, when the message fits one frame (small ones
    /// do).
    pub payload: &'a [u8],
}

/// What the proxy does with a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// Forward it now.
    Pass,
    /// Never forward it.
    Swallow,
    /// Keep it, and every frame held after it, until [`FrameDrop::release_held`].
    Hold,
}

/// The test's rule.
type Rule = Box<dyn Fn(&Frame<'_>) -> Action + Send + Sync>;

struct Shared {
    rule: Rule,
    swallowed: AtomicUsize,
    held: AtomicUsize,
    /// Bumped by [`FrameDrop::release_held`]: each pump then forwards what it holds.
    release: watch::Sender<u64>,
}

/// A loopback proxy to one HTTP/2 server that swallows or holds the frames its rule
/// picks, either way. Dropping it closes the listener and every proxied connection.
pub struct FrameDrop {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

impl FrameDrop {
    /// Listens on a fresh loopback port and proxies each connection to `upstream`
    /// (`host:port`), asking `rule` about every frame of a stream, either way
    /// ([`Frame`], [`Action`]).
    ///
    /// # Errors
    /// The listener cannot be bound.
    pub async fn start(
        upstream: &str,
        rule: impl Fn(&Frame<'_>) -> Action + Send + Sync + 'static,
    ) -> std::io::Result<FrameDrop> {
        let listener = TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            rule: Box::new(rule),
            swallowed: AtomicUsize::new(0),
            held: AtomicUsize::new(0),
            release: watch::channel(0).0,
        });
        let upstream = upstream.to_owned();
        let accept = tokio::spawn({
            let shared = shared.clone();
            async move {
                // Owned here: aborting the accept task drops the set, which aborts every
                // connection's pumps.
                let mut connections = JoinSet::new();
                while let Ok((client, _)) = listener.accept().await {
                    connections.spawn(proxy(client, upstream.clone(), shared.clone()));
                    // Reap the finished ones so a long test does not keep them all.
                    while connections.try_join_next().is_some() {}
                }
            }
        });
        Ok(FrameDrop {
            addr,
            shared,
            accept,
        })
    }

    /// `127.0.0.1:<port>`, for the client to connect to instead of the server.
    pub fn addr(&self) -> String {
        self.addr.to_string()
    }

    /// How many frames were swallowed so far.
    pub fn swallowed(&self) -> usize {
        self.shared.swallowed.load(Ordering::SeqCst)
    }

    /// How many frames were held so far (released or not).
    pub fn held(&self) -> usize {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// Forwards every frame held so far, in the order it came, each ahead of anything
    /// its connection sends that way after it. Frames the rule holds later are held
    /// again.
    pub fn release_held(&self) {
        self.shared.release.send_modify(|n| *n += 1);
    }
}

impl Drop for FrameDrop {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Proxies one connection until either side closes it or breaks the framing.
async fn proxy(client: TcpStream, upstream: String, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(&upstream).await else {
        return;
    };
    // Frames go out one by one in two writes each: without NODELAY the second would
    // wait for the first one's ACK.
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_rx, client_tx) = client.into_split();
    let (server_rx, server_tx) = server.into_split();
    // One direction ending ends the connection: the other side sees it closed.
    tokio::select! {
        () = pump(Side::Server, server_rx, client_tx, &shared) => {}
        () = pump(Side::Client, client_rx, server_tx, &shared) => {}
    }
}

/// One frame as read: its 9-byte header, then its payload.
type RawFrame = Vec<u8>;

/// Copies one direction frame by frame (the client's preface first), as the rule says.
/// Returns when the sender closes the connection (or sends a frame cut short) or the
/// receiver cannot be written to; then closes the receiver's side.
async fn pump(from: Side, rx: OwnedReadHalf, mut tx: OwnedWriteHalf, shared: &Shared) {
    // Frames are read by a task of their own, so a release is acted on while the
    // sender is quiet (a read cut off half-way would lose its bytes).
    let (frames, mut incoming) = mpsc::channel::<RawFrame>(64);
    let reader = tokio::spawn(read_frames(from, rx, frames));
    let mut release = shared.release.subscribe();
    let mut held: Vec<RawFrame> = Vec::new();
    // The client's first bytes are the preface, not a frame: forwarded as they are.
    let mut preface = from == Side::Client;
    loop {
        tokio::select! {
            f = incoming.recv() => {
                let Some(f) = f else { break };
                if std::mem::take(&mut preface) {
                    if tx.write_all(&f).await.is_err() {
                        break;
                    }
                    continue;
                }
                let kind = f[3];
                let stream = u32::from_be_bytes([f[5], f[6], f[7], f[8]]) & !(1 << 31);
                let action = if stream == 0 || HEADER_BLOCKS.contains(&kind) {
                    Action::Pass
                } else {
                    (shared.rule)(&Frame { from, kind, stream, payload: &f[9..] })
                };
                match action {
                    Action::Pass => {
                        if tx.write_all(&f).await.is_err() {
                            break;
                        }
                    }
                    Action::Swallow => {
                        shared.swallowed.fetch_add(1, Ordering::SeqCst);
                    }
                    Action::Hold => {
                        shared.held.fetch_add(1, Ordering::SeqCst);
                        held.push(f);
                    }
                }
            }
            changed = release.changed() => {
                if changed.is_err() {
                    break;
                }
                let mut failed = false;
                for f in held.drain(..) {
                    failed = failed || tx.write_all(&f).await.is_err();
                }
                if failed {
                    break;
                }
            }
        }
    }
    reader.abort();
    let _ = tx.shutdown().await;
}

/// Reads frames (after the client's preface, which goes out first as a frame of its
/// own) until the sender closes the connection or a frame is cut short.
async fn read_frames(from: Side, mut rx: OwnedReadHalf, frames: mpsc::Sender<RawFrame>) {
    let read = async {
        if from == Side::Client {
            let mut preface = vec![0u8; PREFACE.len()];
            rx.read_exact(&mut preface).await?;
            if frames.send(preface).await.is_err() {
                return Ok(());
            }
        }
        loop {
            let mut f = vec![0u8; 9];
            rx.read_exact(&mut f).await?;
            let len = u32::from_be_bytes([0, f[0], f[1], f[2]]) as usize;
            f.resize(9 + len, 0);
            rx.read_exact(&mut f[9..]).await?;
            if frames.send(f).await.is_err() {
                return Ok(());
            }
        }
    };
    let _: std::io::Result<()> = read.await;
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

    /// What the rule says is done, either way: swallowed frames never arrive, held ones
    /// arrive on release, ahead of what follows; header and connection frames pass
    /// whatever the rule would say, and the client's preface first.
    #[tokio::test]
    async fn swallows_and_holds_what_the_rule_says_both_ways() {
        let server = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let upstream = server.local_addr().expect("addr").to_string();
        let rule = |f: &Frame<'_>| match (f.from, f.payload) {
            (_, b"drop me") => Action::Swallow,
            (Side::Client, b"hold me") => Action::Hold,
            _ => Action::Pass,
        };
        let proxy = FrameDrop::start(&upstream, rule).await.expect("proxy");
        let mut client = TcpStream::connect(proxy.addr()).await.expect("connect");
        let (mut far, _) = server.accept().await.expect("accept");

        let mut sent = PREFACE.to_vec();
        sent.extend(frame(DATA, 1, b"drop me"));
        sent.extend(frame(DATA, 1, b"hold me"));
        sent.extend(frame(DATA, 1, b"keep me"));
        sent.extend(frame(0x1, 1, b"drop me")); // HEADERS: never the rule's
        sent.extend(frame(0x4, 0, b"drop me")); // stream 0: never the rule's
        client.write_all(&sent).await.expect("send");
        let mut want = PREFACE.to_vec();
        want.extend(frame(DATA, 1, b"keep me"));
        want.extend(frame(0x1, 1, b"drop me"));
        want.extend(frame(0x4, 0, b"drop me"));
        let mut got = vec![0; want.len()];
        far.read_exact(&mut got).await.expect("the server reads");
        assert_eq!(got, want);
        assert_eq!((proxy.swallowed(), proxy.held()), (1, 1));

        proxy.release_held();
        // Sent after the release: arrives after the held frame.
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        client
            .write_all(&frame(DATA, 3, b"after"))
            .await
            .expect("send");
        let mut want = frame(DATA, 1, b"hold me");
        want.extend(frame(DATA, 3, b"after"));
        let mut got = vec![0; want.len()];
        far.read_exact(&mut got).await.expect("the server reads");
        assert_eq!(got, want);

        let mut answered = frame(DATA, 3, b"drop me");
        answered.extend(frame(DATA, 1, b"answer"));
        far.write_all(&answered).await.expect("answer");
        let want = frame(DATA, 1, b"answer");
        let mut got = vec![0; want.len()];
        client.read_exact(&mut got).await.expect("the client reads");
        assert_eq!(got, want);
        assert_eq!(proxy.swallowed(), 2);
    }
}
