//! A removal that fails never leaves a ghost behind a live session: a real backend, behind
//! a wrapper whose first removals fail as an unreachable server's would, still ends with
//! the entry gone while its session lives, so the next contender gets in.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use dlock::{Backend, DynBackend, Error, Result};
use dlock_core::entry::{Entry, EntryKind, Ticket};
use dlock_core::{Capability, Enqueued, Gone, Hints, ListedQueue, NameRules, Position, QueuePath};
use futures::future::BoxFuture;

use crate::support::{client, eventually, leftovers, unique, Kind};

/// More failures than the old background retry made (one release, then five): the entry
/// must still go.
const FAILURES: usize = 7;

/// Long enough for [`FAILURES`] retries at their longest back-off, far shorter than the
/// session that keeps the entry.
const WITHIN: Duration = Duration::from_secs(20);

/// A real backend whose first `remove` and `abandon` calls fail with
/// [`Error::Unreachable`] before they reach the server; every other call, and every
/// later removal, goes through unchanged.
struct FailingRemovals {
    inner: Arc<dyn DynBackend>,
    removes_to_fail: AtomicUsize,
    abandons_to_fail: AtomicUsize,
    removes_failed: AtomicUsize,
    abandons_failed: AtomicUsize,
}

impl FailingRemovals {
    fn new(inner: Arc<dyn DynBackend>, removes: usize, abandons: usize) -> Arc<Self> {
        Arc::new(FailingRemovals {
            inner,
            removes_to_fail: AtomicUsize::new(removes),
            abandons_to_fail: AtomicUsize::new(abandons),
            removes_failed: AtomicUsize::new(0),
            abandons_failed: AtomicUsize::new(0),
        })
    }

    /// Takes one failure from `budget` if any is left.
    fn fail(budget: &AtomicUsize, count: &AtomicUsize) -> bool {
        let took = budget
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if took {
            count.fetch_add(1, Ordering::SeqCst);
        }
        took
    }
}

impl Backend for FailingRemovals {
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
    async fn enqueue(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        self.inner.enqueue(q, ticket, kind, at, data).await
    }
    async fn enqueue_removing(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> Result<Entry> {
        self.inner
            .enqueue_removing(q, ticket, kind, data, gone_q, gone)
            .await
    }
    async fn queue(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        self.inner.queue(q).await
    }
    async fn queue_ahead(&self, q: &QueuePath, mine: &Entry) -> Result<Vec<Entry>> {
        self.inner.queue_ahead(q, mine).await
    }
    async fn contains(&self, q: &QueuePath, entry: &Entry) -> Result<bool> {
        self.inner.contains(q, entry).await
    }
    async fn wait_gone(&self, q: &QueuePath, entry: &Entry) -> Result<()> {
        self.inner.wait_gone(q, entry).await
    }
    async fn wait_gone_detail(&self, q: &QueuePath, entry: &Entry) -> Result<Gone> {
        self.inner.wait_gone_detail(q, entry).await
    }
    async fn wait_changed(&self, q: &QueuePath, seen: &[Entry]) -> Result<()> {
        self.inner.wait_changed(q, seen).await
    }
    fn remove(&self, q: &QueuePath, entry: &Entry) -> impl Future<Output = Result<()>> + Send {
        // Decided at the call, as a server refusing the request would.
        let fail = Self::fail(&self.removes_to_fail, &self.removes_failed);
        async move {
            if fail {
                return Err(Error::Unreachable("injected: remove".into()));
            }
            self.inner.remove(q, entry).await
        }
    }
    fn abandon(&self, q: &QueuePath, ticket: &Ticket) -> impl Future<Output = Result<()>> + Send {
        let fail = Self::fail(&self.abandons_to_fail, &self.abandons_failed);
        async move {
            if fail {
                return Err(Error::Unreachable("injected: abandon".into()));
            }
            self.inner.abandon(q, ticket).await
        }
    }
    fn lost(&self, q: &QueuePath, entry: &Entry) -> BoxFuture<'static, Error> {
        self.inner.lost(q, entry)
    }
    async fn read_value(&self, q: &QueuePath) -> Result<Option<Vec<u8>>> {
        self.inner.read_value(q).await
    }
    async fn set_data(&self, q: &QueuePath, entry: &Entry, data: &[u8]) -> Result<()> {
        self.inner.set_data(q, entry, data).await
    }
    async fn wait_data_changed(
        &self,
        q: &QueuePath,
        entry: &Entry,
        seen: &[u8],
    ) -> Result<Option<Vec<u8>>> {
        self.inner.wait_data_changed(q, entry, seen).await
    }
    async fn participants(&self, q: &QueuePath) -> Result<Vec<Entry>> {
        self.inner.participants(q).await
    }
    async fn list_queues(&self, prefix: &str) -> Result<Vec<ListedQueue>> {
        self.inner.list_queues(prefix).await
    }
    async fn health(&self) -> Result<()> {
        self.inner.health().await
    }

    async fn close(&self) -> Result<()> {
        self.inner.close().await
    }
}

/// A release whose removal fails again and again, and a waiter's clean-up that does the
/// same, both still remove their entries while the session lives: nobody waits behind a
/// ghost. (Before, the background retry gave up after five attempts and the entry stayed
/// under a session that kept being renewed.)
pub async fn failed_removals_keep_trying_while_the_session_lives(_kind: Kind, url: &str) {
    let name = unique("ghost");
    let real = client(url).await;
    let observer = client(url).await;
    let flaky = FailingRemovals::new(real.backend().clone(), FAILURES, FAILURES);
    let c = dlock::Client::new(flaky.clone() as Arc<dyn DynBackend>);

    // A held entry whose release keeps failing.
    let mut g = c.mutex(&name).expect("name").lock().await.expect("lock");
    let released = g.release().await;
    assert!(
        matches!(released, Err(Error::Unreachable(_))),
        "the injected failure should reach the caller: {released:?}"
    );
    assert!(
        eventually(WITHIN, || async { leftovers(&observer, &name).await == 0 }).await,
        "the released entry is still queued after {} failed removals (the session lives)",
        flaky.removes_failed.load(Ordering::SeqCst)
    );
    assert_eq!(flaky.removes_failed.load(Ordering::SeqCst), FAILURES);
    let mut next = observer
        .mutex(&name)
        .expect("name")
        .try_lock()
        .await
        .expect("the next contender gets in");

    // A waiter's entry whose clean-up keeps failing.
    let refused = c.mutex(&name).expect("name").try_lock().await;
    assert!(matches!(refused, Err(Error::WouldBlock)), "{refused:?}");
    assert!(
        eventually(WITHIN, || async { leftovers(&observer, &name).await == 1 }).await,
        "the refused waiter's entry is still queued after {} failed removals",
        flaky.abandons_failed.load(Ordering::SeqCst)
    );
    assert_eq!(flaky.abandons_failed.load(Ordering::SeqCst), FAILURES);
    next.release().await.expect("release");
    assert_eq!(leftovers(&observer, &name).await, 0);

    real.close().await.expect("close");
    observer.close().await.expect("close");
}
