//! [`Tapped`]: a real backend with a test's [`Tap`] on every call, to count calls, fail
//! chosen ones, or hold a lost future up, without writing the whole trait out again.
//!
//! Every method goes to the inner backend unchanged (the optional ones too, so a
//! backend's own `proclaim` or `serving_node` is kept); the tap sees each call as it is
//! made, may answer it with an error instead, and sees it complete.
//!
//! ```no_run
//! # async fn demo(inner: std::sync::Arc<dyn dlock_core::DynBackend>) {
//! use std::sync::atomic::{AtomicUsize, Ordering};
//! use dlock_testkit::tap::{Call, Tap, Tapped};
//!
//! /// Counts the queue reads.
//! #[derive(Default)]
//! struct Reads(AtomicUsize);
//!
//! impl Tap for Reads {
//!     fn begin(&self, call: Call) -> dlock_core::Result<()> {
//!         if call == Call::Queue {
//!             self.0.fetch_add(1, Ordering::SeqCst);
//!         }
//!         Ok(())
//!     }
//! }
//!
//! let backend = Tapped::new(inner, Reads::default());
//! let reads = backend.tap().0.load(Ordering::SeqCst);
//! # let _ = reads;
//! # }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::{
    Backend, Capability, DynBackend, Enqueued, Entry, EntryKind, Error, Gone, Hints, ListedQueue,
    NameRules, Position, QueuePath, Result, Ticket, Woken,
};
use futures::future::BoxFuture;

/// A backend call a [`Tap`] is told of, by the [`Backend`] method's name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[allow(missing_docs)] // each variant is the method of the same name
pub enum Call {
    Enqueue,
    EnqueueRemoving,
    Queue,
    QueueAhead,
    Contains,
    StillQueued,
    WaitGone,
    WaitGoneDetail,
    WaitGoneBehind,
    WaitChanged,
    Remove,
    Abandon,
    ReadValue,
    SetData,
    Proclaim,
    WaitDataChanged,
    Participants,
    ListQueues,
    Health,
    Close,
}

/// What a test does to the calls of a [`Tapped`] backend. Every method has a default
/// that changes nothing.
pub trait Tap: Send + Sync + 'static {
    /// Called when `call` is made, before it reaches the backend (a call decided at the
    /// call, as a server refusing it would). An error is answered in its place and the
    /// backend never sees the call.
    ///
    /// # Errors
    /// Whatever the test injects.
    fn begin(&self, call: Call) -> Result<()> {
        let _ = call;
        Ok(())
    }

    /// Called when an admitted `call` completes, whatever its result (not when its
    /// future is dropped first): for a wait, the moment it woke.
    fn end(&self, call: Call) {
        let _ = call;
    }

    /// The lost future the backend handed out for an entry, to hand on: wrap it to
    /// watch or hold up its polls.
    fn lost(&self, signal: BoxFuture<'static, Error>) -> BoxFuture<'static, Error> {
        signal
    }

    /// Awaited when a `wait_gone_behind` on `gone` has woken, before its wake-up is
    /// handed to the caller: hold it back to deliver the wake-ups of several watches in
    /// another order than the server's (as a lagging watch stream or a task not polled
    /// in between would). The call's [`Tap::end`] is told when the result is handed on.
    fn hold_wake(&self, gone: &Entry, woken: &Result<Woken>) -> BoxFuture<'static, ()> {
        let _ = (gone, woken);
        Box::pin(async {})
    }
}

/// A real backend with `T` on every call. See the [module](self) docs.
pub struct Tapped<T> {
    inner: Arc<dyn DynBackend>,
    tap: T,
}

impl<T: Tap> Tapped<T> {
    /// `inner` with `tap` on its calls.
    pub fn new(inner: Arc<dyn DynBackend>, tap: T) -> Arc<Self> {
        Arc::new(Tapped { inner, tap })
    }

    /// The tap, to read what it recorded.
    pub fn tap(&self) -> &T {
        &self.tap
    }
}

/// `$call` to the inner backend (bound to `$b` in `$make`) through the tap:
/// [`Tap::begin`] asked at the call, the call made only if it admits it, and [`Tap::end`]
/// told when it completes. (A macro: a helper method's `impl Future` cannot name every
/// lifetime the trait method's future captures.)
macro_rules! through {
    ($self:ident, $call:expr, |$b:ident| $make:expr) => {{
        let call = $call;
        let admitted = $self.tap.begin(call);
        async move {
            admitted?;
            let $b = &*$self.inner;
            let out = $make.await;
            $self.tap.end(call);
            out
        }
    }};
}

impl<T: Tap> Backend for Tapped<T> {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }
    fn name_rules(&self) -> NameRules {
        self.inner.name_rules()
    }
    fn session_timeout(&self) -> Duration {
        self.inner.session_timeout()
    }
    fn hints(&self) -> Hints {
        self.inner.hints()
    }
    fn supports(&self, capability: Capability) -> bool {
        self.inner.supports(capability)
    }
    fn enqueue(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> impl Future<Output = Result<Enqueued>> + Send {
        through!(self, Call::Enqueue, |b| b
            .enqueue(q, ticket, kind, at, data))
    }
    fn enqueue_removing(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> impl Future<Output = Result<Entry>> + Send {
        through!(self, Call::EnqueueRemoving, |b| {
            b.enqueue_removing(q, ticket, kind, data, gone_q, gone)
        })
    }
    fn queue(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        through!(self, Call::Queue, |b| b.queue(q))
    }
    fn queue_ahead(
        &self,
        q: &QueuePath,
        mine: &Entry,
    ) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        through!(self, Call::QueueAhead, |b| b.queue_ahead(q, mine))
    }
    fn contains(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<bool>> + Send {
        through!(self, Call::Contains, |b| b.contains(q, entry))
    }
    fn still_queued(
        &self,
        q: &QueuePath,
        entry: &Entry,
    ) -> impl Future<Output = Result<bool>> + Send {
        through!(self, Call::StillQueued, |b| b.still_queued(q, entry))
    }
    fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::WaitGone, |b| b.wait_gone(q, entry))
    }
    fn wait_gone_detail(
        &self,
        q: &QueuePath,
        entry: &Entry,
    ) -> impl Future<Output = Result<Gone>> + Send {
        through!(self, Call::WaitGoneDetail, |b| b.wait_gone_detail(q, entry))
    }
    fn wait_gone_behind(
        &self,
        q: &QueuePath,
        entry: &Entry,
        mine: &Entry,
    ) -> impl Future<Output = Result<Woken>> + Send {
        through!(self, Call::WaitGoneBehind, |b| async move {
            let woken = b.wait_gone_behind(q, entry, mine).await;
            self.tap.hold_wake(entry, &woken).await;
            woken
        })
    }
    fn wait_changed(
        &self,
        q: &QueuePath,
        seen: &[Entry],
    ) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::WaitChanged, |b| b.wait_changed(q, seen))
    }
    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::Remove, |b| b.remove(q, entry))
    }
    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::Abandon, |b| b.abandon(q, ticket))
    }
    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        self.tap.lost(self.inner.lost(q, entry))
    }
    /// The inner backend's answer: a look, not a signal handed out, so [`Tap::lost`]
    /// does not see it.
    fn lost_now(&self, q: &QueuePath, entry: &Entry) -> Option<Error> {
        self.inner.lost_now(q, entry)
    }
    fn read_value(&self, q: &QueuePath) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        through!(self, Call::ReadValue, |b| b.read_value(q))
    }
    fn set_data(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::SetData, |b| b.set_data(q, entry, data))
    }
    fn proclaim(
        &self,
        q: &QueuePath,
        entry: &Entry,
        data: &[u8],
    ) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::Proclaim, |b| b.proclaim(q, entry, data))
    }
    fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> impl Future<Output = Result<Option<Vec<u8>>>> + Send {
        through!(self, Call::WaitDataChanged, |b| {
            b.wait_data_changed(q, entry, seen)
        })
    }
    fn serving_node(&self, q: &QueuePath) -> Option<String> {
        self.inner.serving_node(q)
    }
    fn participants(&self, q: &QueuePath) -> impl Future<Output = Result<Vec<Entry>>> + Send {
        through!(self, Call::Participants, |b| b.participants(q))
    }
    fn list_queues(&self, prefix: &str) -> impl Future<Output = Result<Vec<ListedQueue>>> + Send {
        through!(self, Call::ListQueues, |b| b.list_queues(prefix))
    }
    fn health(&self) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::Health, |b| b.health())
    }
    fn close(&self) -> impl Future<Output = Result<()>> + Send {
        through!(self, Call::Close, |b| b.close())
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use dlock_core::{LockName, SessionOptions};

    use super::*;
    use crate::mem::MemServer;

    /// Fails the first `remove`, counts every begin and end.
    #[derive(Default)]
    struct OneFailedRemove {
        failed: AtomicUsize,
        begun: AtomicUsize,
        ended: AtomicUsize,
    }

    impl Tap for OneFailedRemove {
        fn begin(&self, call: Call) -> Result<()> {
            self.begun.fetch_add(1, Ordering::SeqCst);
            if call == Call::Remove && self.failed.fetch_add(1, Ordering::SeqCst) == 0 {
                return Err(Error::Unreachable("injected".into()));
            }
            Ok(())
        }
        fn end(&self, _: Call) {
            self.ended.fetch_add(1, Ordering::SeqCst);
        }
    }

    #[tokio::test]
    async fn a_refused_call_never_reaches_the_backend_and_the_rest_go_through() {
        let server = MemServer::new();
        let mem = server
            .connect(SessionOptions::default())
            .await
            .expect("session");
        let tapped = Tapped::new(mem.clone(), OneFailedRemove::default());
        let q =
            QueuePath::root(LockName::new("tap/one", Backend::name_rules(&*tapped)).expect("name"));
        let ticket = Ticket::from_random_bytes([7; 16]);
        let added = Backend::enqueue(&*tapped, &q, &ticket, EntryKind::Lock, Position::Tail, b"")
            .await
            .expect("enqueue");
        let entry = added.mine.clone();

        let refused = Backend::remove(&*tapped, &q, &entry).await;
        assert!(matches!(refused, Err(Error::Unreachable(_))), "{refused:?}");
        assert_eq!(
            Backend::queue(&*mem, &q).await.expect("queue").len(),
            1,
            "the refused remove reached the backend"
        );
        Backend::remove(&*tapped, &q, &entry)
            .await
            .expect("the second remove");
        assert!(Backend::queue(&*mem, &q).await.expect("queue").is_empty());

        let tap = tapped.tap();
        assert_eq!(tap.begun.load(Ordering::SeqCst), 3);
        assert_eq!(
            tap.ended.load(Ordering::SeqCst),
            2,
            "only admitted calls end"
        );
    }
}
