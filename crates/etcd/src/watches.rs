//! One watch stream per client, shared by every watch the client arms.
//!
//! etcd serves any number of watches on one gRPC stream. Opening a stream per waiter (what
//! `WatchClient::watch` does) costs a gRPC call, an HTTP/2 stream and a server goroutine
//! pair per wait; with a thousand waiters queued on one client that is a thousand streams.
//! Here a client opens one stream, on first use, and multiplexes every watch over it:
//! a create is one message on the stream, a cancel another.
//!
//! Routing: etcd handles the requests of one stream in order and answers each create
//! with one `created` response, in the same order, before any event of that watch. So
//! the k-th `created` answer belongs to the k-th create sent; the writer task queues the
//! route of a create just before it sends it, and the reader task pops it when the answer
//! comes, then routes events by the watch id the server assigned. No client-chosen ids
//! are needed (etcd before 3.4 ignores them).
//!
//! A broken stream ends every watch on it (their receivers close, which the callers
//! report as [`dlock_core::Error::Unreachable`] and re-arm); the next watch opens a new
//! stream. So does a stream that leaves a create unanswered for a request timeout: the
//! connection may be fine while that one stream is not, and without being given up it
//! would take every later watch of the client.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use etcd_client::{
    WatchClient, WatchOptions, WatchRequestSender, WatchResponse, WatchResponseStream,
};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::errors::retrying;

/// What the writer task sends on the stream.
enum Cmd {
    Create(Vec<u8>, WatchOptions, mpsc::UnboundedSender<WatchResponse>),
    Cancel(i64),
}

/// Where answers go: the routes of creates not answered yet, in send order, and the
/// routes of created watches by id.
#[derive(Default)]
struct Routes {
    pending: VecDeque<mpsc::UnboundedSender<WatchResponse>>,
    by_id: HashMap<i64, mpsc::UnboundedSender<WatchResponse>>,
}

struct Shared {
    routes: parking_lot::Mutex<Routes>,
    dead: AtomicBool,
    /// Tells the reader to let the stream go (a permit, so a kill before it waits counts).
    stop: tokio::sync::Notify,
}

impl Shared {
    /// Ends every watch on the stream: their receivers see the end of their channel, and
    /// the reader stops reading, which resets the stream on the server.
    fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        {
            let mut r = self.routes.lock();
            r.pending.clear();
            r.by_id.clear();
        }
        self.stop.notify_one();
    }
}

/// One open stream.
struct Mux {
    shared: Arc<Shared>,
    cmds: mpsc::UnboundedSender<Cmd>,
}

/// The client's watch streams: one live at a time, opened on first use.
pub(crate) struct Watches {
    client: WatchClient,
    request_timeout: Duration,
    current: parking_lot::Mutex<Option<Arc<Mux>>>,
    /// How many streams were opened.
    opened: std::sync::atomic::AtomicU64,
    /// How many watches were asked for.
    armed: std::sync::atomic::AtomicU64,
    /// Serialises opening a stream, so concurrent first watches share one.
    opening: tokio::sync::Mutex<()>,
}

/// One watch on the shared stream. Dropping it cancels the watch on the server.
pub(crate) struct Watch {
    rx: mpsc::UnboundedReceiver<WatchResponse>,
    mux: Arc<Mux>,
    id: Option<i64>,
}

impl Watches {
    pub(crate) fn new(client: WatchClient, request_timeout: Duration) -> Self {
        Watches {
            client,
            request_timeout,
            current: parking_lot::Mutex::new(None),
            opened: std::sync::atomic::AtomicU64::new(0),
            armed: std::sync::atomic::AtomicU64::new(0),
            opening: tokio::sync::Mutex::new(()),
        }
    }

    fn live(&self) -> Option<Arc<Mux>> {
        self.current
            .lock()
            .as_ref()
            .filter(|m| !m.shared.dead.load(Ordering::Acquire))
            .cloned()
    }

    /// Arms a watch on `key` with `opts`. The returned watch's first message is its
    /// `created` answer (see [`Watch::created`]).
    pub(crate) async fn watch(
        &self,
        key: &str,
        opts: WatchOptions,
    ) -> Result<Watch, etcd_client::Error> {
        self.armed.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = mpsc::unbounded_channel();
        let mut tx = Some(tx);
        for _ in 0..2 {
            if let Some(mux) = self.live() {
                let Some(t) = tx.take() else { break };
                match mux
                    .cmds
                    .send(Cmd::Create(key.as_bytes().to_vec(), opts.clone(), t))
                {
                    Ok(()) => return Ok(Watch { rx, mux, id: None }),
                    // The writer ended: the stream is gone. Open another.
                    Err(mpsc::error::SendError(Cmd::Create(_, _, t))) => {
                        mux.shared.kill();
                        tx = Some(t);
                    }
                    Err(_) => unreachable!("a create was sent"),
                }
            }
            let _opening = self.opening.lock().await;
            if self.live().is_some() {
                continue;
            }
            let Some(t) = tx.take() else { break };
            let mux = self.open(key, opts.clone(), t).await?;
            self.opened.fetch_add(1, Ordering::Relaxed);
            *self.current.lock() = Some(mux.clone());
            return Ok(Watch { rx, mux, id: None });
        }
        Err(etcd_client::Error::WatchError(
            "the shared watch stream closed while a watch was being armed".into(),
        ))
    }

    /// Opens a stream whose first create is `key`/`opts` for route `first`, and starts
    /// its writer and reader tasks.
    async fn open(
        &self,
        key: &str,
        opts: WatchOptions,
        first: mpsc::UnboundedSender<WatchResponse>,
    ) -> Result<Arc<Mux>, etcd_client::Error> {
        let shared = Arc::new(Shared {
            routes: parking_lot::Mutex::new(Routes::default()),
            dead: AtomicBool::new(false),
            stop: tokio::sync::Notify::new(),
        });
        shared.routes.lock().pending.push_back(first);
        let stream = retrying(self.request_timeout, || {
            let (mut w, opts) = (self.client.clone(), opts.clone());
            async move { w.watch(key, Some(opts)).await }
        })
        .await;
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                shared.kill();
                return Err(e);
            }
        };
        let (sender, responses) = stream.split();
        let (cmds, cmd_rx) = mpsc::unbounded_channel();
        let span = tracing::debug_span!(parent: None, "etcd.watch_stream");
        tokio::spawn(write_loop(sender, cmd_rx, shared.clone()).instrument(span.clone()));
        tokio::spawn(read_loop(responses, shared.clone(), cmds.downgrade()).instrument(span));
        tracing::debug!("shared watch stream opened");
        Ok(Arc::new(Mux { shared, cmds }))
    }

    /// How many watch streams were opened so far.
    pub(crate) fn opened(&self) -> u64 {
        self.opened.load(Ordering::Relaxed)
    }

    /// How many watches were asked for so far.
    pub(crate) fn armed(&self) -> u64 {
        self.armed.load(Ordering::Relaxed)
    }

    /// Drops the current stream; watches on it end once their handles are dropped.
    pub(crate) fn close(&self) {
        if let Some(m) = self.current.lock().take() {
            m.shared.kill();
        }
    }
}

impl Watch {
    /// The next answer for this watch, or `None` once the stream is gone.
    pub(crate) async fn message(&mut self) -> Option<WatchResponse> {
        let m = self.rx.recv().await?;
        if m.created() && self.id.is_none() {
            self.id = Some(m.watch_id());
        }
        Some(m)
    }

    /// Gives up the stream this watch was sent on: every watch on it ends, and the next
    /// watch the client arms opens a new stream. For a stream that left a create
    /// unanswered (the backend's `arm`), which would otherwise take every later watch.
    pub(crate) fn give_up_stream(&self) {
        self.mux.shared.kill();
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        // A watch dropped before it read its `created` answer: once the channel is
        // closed, either that answer is buffered here (its id is known), or the reader
        // will fail to deliver it and cancel the watch itself.
        let id = self.id.or_else(|| {
            self.rx.close();
            let mut found = None;
            while let Ok(m) = self.rx.try_recv() {
                if m.created() && !m.canceled() {
                    found = Some(m.watch_id());
                }
            }
            found
        });
        if let Some(id) = id {
            self.mux.shared.routes.lock().by_id.remove(&id);
            let _ = self.mux.cmds.send(Cmd::Cancel(id));
        }
    }
}

async fn write_loop(
    mut sender: WatchRequestSender,
    mut cmds: mpsc::UnboundedReceiver<Cmd>,
    shared: Arc<Shared>,
) {
    while let Some(cmd) = cmds.recv().await {
        if shared.dead.load(Ordering::Acquire) {
            // The stream was given up (or broke): nothing more goes to it, not even a
            // cancel, which a stalled stream would never take (the request channel
            // would fill and this task hang). Dropping a create's route ends that
            // watch at once; the server drops the rest with the stream.
            break;
        }
        let sent = match cmd {
            Cmd::Create(key, opts, route) => {
                // Queued before it is sent, so the reader finds it when the answer comes.
                shared.routes.lock().pending.push_back(route);
                sender.watch(key, Some(opts)).await
            }
            Cmd::Cancel(id) => sender.cancel(id).await,
        };
        if let Err(e) = sent {
            tracing::debug!(error = %e, "shared watch stream: send failed");
            shared.kill();
            break;
        }
    }
    // Every handle is gone (or the stream broke): dropping `sender` ends the stream.
}

async fn read_loop(
    mut responses: WatchResponseStream,
    shared: Arc<Shared>,
    cmds: mpsc::WeakUnboundedSender<Cmd>,
) {
    loop {
        let next = tokio::select! {
            next = responses.message() => next,
            () = shared.stop.notified() => {
                tracing::debug!("shared watch stream given up");
                break;
            }
        };
        let m = match next {
            Ok(Some(m)) => m,
            Ok(None) => {
                tracing::debug!("shared watch stream ended");
                break;
            }
            Err(e) => {
                tracing::debug!(error = %e, "shared watch stream failed");
                break;
            }
        };
        let id = m.watch_id();
        let (created, canceled) = (m.created(), m.canceled());
        let mut cancel = false;
        {
            let mut r = shared.routes.lock();
            if created {
                match r.pending.pop_front() {
                    Some(route) => {
                        let delivered = route.send(m).is_ok();
                        if !canceled {
                            if delivered {
                                r.by_id.insert(id, route);
                            } else {
                                cancel = true;
                            }
                        }
                    }
                    None => cancel = !canceled,
                }
            } else if canceled {
                if let Some(route) = r.by_id.remove(&id) {
                    let _ = route.send(m);
                }
            } else {
                // Progress notifications (id -1) and events of watches already let go
                // have no route.
                let failed = r.by_id.get(&id).map(|route| route.send(m).is_err());
                if failed == Some(true) {
                    r.by_id.remove(&id);
                    cancel = true;
                }
            }
        }
        if cancel {
            // Its handle is gone: cancel it on the server.
            match cmds.upgrade() {
                Some(c) => {
                    let _ = c.send(Cmd::Cancel(id));
                }
                None => break,
            }
        }
    }
    shared.kill();
}
