//! The `late-request` fault: one request of a holder reaches etcd late, after its client
//! gave up on it and went on.
//!
//! Each victim reaches the etcd members through its own [`FrameDrop`] proxies (one per
//! member). Armed with the lock's name, they hold back the first request message that
//! names it (inside a section: the release, most often), or the first that also carries
//! dlock's value header (the next enqueue), and drop the rest of that request's stream
//! (the client's reset when it times out), while every other request and answer of the
//! connection goes on. The client's timeout fires, it retries or moves on; only once it
//! holds again (a held release) or has held and released again (a held enqueue) does
//! the held request reach the server, which serves it. This is the delay a congested network or a stalled member gives one
//! request. No packet rule stages it: TCP delivers a connection's bytes in order, so a
//! packet held back stalls every request behind it.
//!
//! What must hold: nothing the late request does lets two holders in, or leaves an entry
//! behind that blocks the lock. A late release delete that removed a later hold of the
//! same key did the first before the key was retired after an unanswered delete; a late
//! enqueue that put its entry back after the release would do the second without the
//! sweep that takes such copies back (see docs/safety.md).

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use anyhow::Context as _;
use dlock_testkit::frame_drop::{Action, Frame, Side, DATA};
use dlock_testkit::FrameDrop;

/// The rule's state, shared by one victim's proxies.
#[derive(Default)]
struct Target {
    /// While armed: the bytes a request must contain to be held (the lock's name).
    name: Mutex<Vec<u8>>,
    /// And these too, if not empty (a value header: an enqueue's put).
    also: Mutex<Vec<u8>>,
    /// The stream of the held request (0 for none): its later frames are dropped.
    stream: AtomicU32,
    /// The held request's message, for the log.
    message: Mutex<Vec<u8>>,
}

impl Target {
    fn action(&self, f: &Frame<'_>) -> Action {
        if f.from == Side::Server {
            return Action::Pass;
        }
        let held = self.stream.load(Ordering::SeqCst);
        // The held request's stream: its later DATA frames (the empty one that ends the
        // request, sent apart from the message) are held behind it, in order; the rest
        // (its reset on timeout, a window update) would tell the server to drop the
        // request, and are dropped. (Stream numbers are per connection: a frame of
        // another connection's stream of the same number is held or dropped too, one
        // more late request.)
        if held != 0 && f.stream == held {
            return if f.kind == DATA {
                Action::Hold
            } else {
                Action::Swallow
            };
        }
        if f.kind != DATA {
            return Action::Pass;
        }
        let has = |b: &[u8]| b.is_empty() || f.payload.windows(b.len()).any(|w| w == b);
        let mut name = self.name.lock().unwrap_or_else(|p| p.into_inner());
        let also = self.also.lock().unwrap_or_else(|p| p.into_inner());
        if !name.is_empty() && has(&name) && has(&also) {
            name.clear();
            self.stream.store(f.stream, Ordering::SeqCst);
            *self.message.lock().unwrap_or_else(|p| p.into_inner()) = f.payload.to_vec();
            return Action::Hold;
        }
        Action::Pass
    }
}

/// One victim's proxies to the etcd members.
pub(super) struct LateRequest {
    proxies: Vec<FrameDrop>,
    target: Arc<Target>,
}

impl LateRequest {
    /// Proxies to each of `upstreams` (`host:port`), on `rt`.
    pub(super) fn start(
        rt: &tokio::runtime::Runtime,
        upstreams: &[String],
    ) -> anyhow::Result<Self> {
        let target = Arc::new(Target::default());
        let mut proxies = Vec::new();
        for a in upstreams {
            let t = Arc::clone(&target);
            let p = rt
                .block_on(FrameDrop::start(a, move |f| t.action(f)))
                .with_context(|| format!("starting a frame proxy to {a}"))?;
            proxies.push(p);
        }
        Ok(LateRequest { proxies, target })
    }

    /// The proxies' addresses, in the order of the upstreams.
    pub(super) fn addrs(&self) -> Vec<String> {
        self.proxies.iter().map(FrameDrop::addr).collect()
    }

    /// Holds the next request that names `name` and, if not empty, contains `also`.
    pub(super) fn arm(&self, name: &str, also: &[u8]) {
        self.target.stream.store(0, Ordering::SeqCst);
        *self.target.also.lock().unwrap_or_else(|p| p.into_inner()) = also.to_vec();
        *self.target.name.lock().unwrap_or_else(|p| p.into_inner()) = name.as_bytes().to_vec();
    }

    /// Whether a request is held (or was, and has been let go).
    pub(super) fn caught(&self) -> bool {
        self.proxies.iter().any(|p| p.held() > 0)
    }

    /// The held request's message (gRPC framing and protobuf), its printable bytes
    /// kept, for the log: enough to tell a delete from a transaction by the keys in it.
    pub(super) fn held_message(&self) -> String {
        let m = self
            .target
            .message
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.iter()
            .skip(5)
            .map(|&b| if b.is_ascii_graphic() { b as char } else { '.' })
            .collect()
    }

    /// Lets the held request reach the server, and holds nothing more.
    pub(super) fn release(&self) {
        self.target
            .name
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        for p in &self.proxies {
            p.release_held();
        }
    }
}
