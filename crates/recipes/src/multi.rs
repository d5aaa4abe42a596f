//! [`MultiLock`]: several locks taken all-or-nothing (Curator's InterProcessMultiLock,
//! with a global order and one deadline).

use std::future::Future;
use std::time::Duration;

use dlock_core::{DynBackend, Error, FencingToken, LockName, Result};
use futures::future::FutureExt;
use tokio::time::Instant;

use crate::{Client, LockGuard};

/// One part of a multi-lock. More recipes may become parts.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Part {
    /// A reentrant [`crate::Mutex`].
    Mutex(LockName),
    /// The read side of an [`crate::RwLock`].
    Read(LockName),
    /// The write side of an [`crate::RwLock`].
    Write(LockName),
    /// A [`crate::SemaphoreMutex`].
    SemaphoreMutex(LockName),
    /// One permit of a [`crate::Semaphore`] of this many permits.
    Permit(LockName, u32),
}

impl Part {
    /// The lock this part names.
    pub fn name(&self) -> &LockName {
        match self {
            Part::Mutex(n)
            | Part::Read(n)
            | Part::Write(n)
            | Part::SemaphoreMutex(n)
            | Part::Permit(n, _) => n,
        }
    }
}

/// Several locks of any kinds, taken all-or-nothing.
///
/// Parts are always acquired in one global order (by name), so two multi-locks over
/// overlapping names cannot deadlock each other, whatever order their callers listed the
/// names in. One deadline covers the whole acquire. A failure or timeout part way
/// releases what was taken, in reverse order.
pub struct MultiLock<B: DynBackend + ?Sized = dyn DynBackend> {
    client: Client<B>,
    parts: Vec<Part>,
}

// Written out because a derive would demand `B: Clone + Debug`, which `dyn DynBackend` is not.
impl<B: DynBackend + ?Sized> Clone for MultiLock<B> {
    fn clone(&self) -> Self {
        MultiLock {
            client: self.client.clone(),
            parts: self.parts.clone(),
        }
    }
}

impl<B: DynBackend + ?Sized> std::fmt::Debug for MultiLock<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MultiLock")
            .field("parts", &self.parts)
            .finish()
    }
}

impl<B: DynBackend + ?Sized> MultiLock<B> {
    pub(crate) fn new(client: Client<B>) -> Self {
        MultiLock {
            client,
            parts: Vec::new(),
        }
    }

    /// Adds a part.
    pub fn with(mut self, part: Part) -> Self {
        self.parts.push(part);
        self
    }

    /// Adds a mutex part by name.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn mutex(self, name: &str) -> Result<Self> {
        let n = self.client.lock_name(name)?;
        Ok(self.with(Part::Mutex(n)))
    }

    /// Adds a read-lock part by name.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn read(self, name: &str) -> Result<Self> {
        let n = self.client.lock_name(name)?;
        Ok(self.with(Part::Read(n)))
    }

    /// Adds a write-lock part by name.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn write(self, name: &str) -> Result<Self> {
        let n = self.client.lock_name(name)?;
        Ok(self.with(Part::Write(n)))
    }

    /// Adds a semaphore-mutex part by name.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn semaphore_mutex(self, name: &str) -> Result<Self> {
        let n = self.client.lock_name(name)?;
        Ok(self.with(Part::SemaphoreMutex(n)))
    }

    /// Adds a one-permit part of a semaphore of `permits` permits.
    ///
    /// # Errors
    /// [`Error::InvalidName`], [`Error::InvalidPermits`] for 0 permits.
    pub fn permit(self, name: &str, permits: u32) -> Result<Self> {
        if permits == 0 {
            return Err(Error::InvalidPermits(
                "a semaphore needs at least one permit".into(),
            ));
        }
        let n = self.client.lock_name(name)?;
        Ok(self.with(Part::Permit(n, permits)))
    }

    /// The parts in acquisition order, after checking that no lock is named twice.
    ///
    /// # Errors
    /// [`Error::WouldDeadlock`] if a name appears twice (taking the same lock twice in
    /// one multi-lock can only deadlock or be a mistake); [`Error::InvalidPermits`] if
    /// there are no parts.
    pub fn ordered_parts(&self) -> Result<Vec<Part>> {
        if self.parts.is_empty() {
            return Err(Error::InvalidPermits(
                "a multi-lock needs at least one lock".into(),
            ));
        }
        let mut parts = self.parts.clone();
        parts.sort_by(|a, b| a.name().cmp(b.name()).then_with(|| a.cmp(b)));
        if let Some(w) = parts.windows(2).find(|w| w[0].name() == w[1].name()) {
            return Err(Error::WouldDeadlock(format!(
                "the multi-lock names {} twice",
                w[0].name()
            )));
        }
        Ok(parts)
    }

    /// Takes every part, or none, waiting as long as it takes.
    ///
    /// # Errors
    /// [`Error::WouldDeadlock`] for a name given twice; the first part's error
    /// ([`Error::Timeout`] with the whole timeout, [`Error::LockLost`], ...) after the
    /// parts already taken have been released.
    ///
    /// # Cancel safety
    /// Cancel-safe: the parts taken so far are released in the background, the pending
    /// part's entry is removed.
    ///
    /// # Session loss
    /// A session that ends while a part is awaited fails the acquire with
    /// [`Error::LockLost`] after the parts taken are released. Once held,
    /// [`MultiGuard::lost`] fires when *any* part is lost.
    ///
    /// # Upstream
    /// Curator `InterProcessMultiLock.acquire()` (which takes the parts in the caller's
    /// order); Redisson `RedissonMultiLock.lock()`.
    pub async fn acquire(&self) -> Result<MultiGuard<B>> {
        self.acquire_with(None, false).await
    }

    /// Takes every part, or none, within `timeout`: one deadline covers all parts
    /// (Curator gives each part the whole timeout). A zero timeout asks once for each
    /// part: free parts are taken.
    ///
    /// # Errors
    /// [`Error::Timeout`] with the whole timeout, after the parts taken were released;
    /// as [`MultiLock::acquire`].
    ///
    /// # Cancel safety
    /// As [`MultiLock::acquire`].
    ///
    /// # Upstream
    /// Curator `InterProcessMultiLock.acquire(time, unit)`; Redisson
    /// `RedissonMultiLock.tryLock(waitTime, unit)`.
    pub async fn acquire_timeout(&self, timeout: Duration) -> Result<MultiGuard<B>> {
        self.acquire_with(Some(timeout), false).await
    }

    /// Takes every part only if each is free now; never waits.
    ///
    /// # Errors
    /// [`Error::WouldBlock`] from the first part that is not free, after the parts taken
    /// were released; as [`MultiLock::acquire`].
    ///
    /// # Cancel safety
    /// As [`MultiLock::acquire`].
    ///
    /// # Upstream
    /// Curator `InterProcessMultiLock.acquire(0, unit)`; Redisson `tryLock()`.
    pub async fn try_acquire(&self) -> Result<MultiGuard<B>> {
        self.acquire_with(None, true).await
    }

    async fn acquire_with(
        &self,
        timeout: Option<Duration>,
        try_only: bool,
    ) -> Result<MultiGuard<B>> {
        let parts = self.ordered_parts()?;
        // A timeout too long for the clock to add waits forever (as `Wait::timeout`).
        let deadline = timeout.and_then(|d| Instant::now().checked_add(d));
        let mut guards: Vec<LockGuard<B>> = Vec::with_capacity(parts.len());
        for part in &parts {
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            let r = if try_only {
                self.try_part(part).await
            } else {
                self.acquire_part(part, left).await
            };
            match r {
                Ok(g) => guards.push(g),
                Err(e) => {
                    let e = match (e, timeout) {
                        (Error::Timeout(_), Some(t)) => Error::Timeout(t),
                        (e, _) => e,
                    };
                    tracing::debug!(failed = %part.name(), error = %e, "multi-lock rolls back");
                    for mut g in guards.into_iter().rev() {
                        let _ = g.release().await;
                    }
                    return Err(e);
                }
            }
        }
        MultiGuard::granted(guards).await
    }

    async fn acquire_part(&self, part: &Part, left: Option<Duration>) -> Result<LockGuard<B>> {
        let c = &self.client;
        match part {
            Part::Mutex(n) => {
                let m = c.mutex(n.as_str())?;
                match left {
                    Some(d) => m.lock_timeout(d).await,
                    None => m.lock().await,
                }
            }
            Part::Read(n) => {
                let rw = c.rwlock(n.as_str())?;
                match left {
                    Some(d) => rw.read_timeout(d).await,
                    None => rw.read().await,
                }
            }
            Part::Write(n) => {
                let rw = c.rwlock(n.as_str())?;
                match left {
                    Some(d) => rw.write_timeout(d).await,
                    None => rw.write().await,
                }
            }
            Part::SemaphoreMutex(n) => {
                let m = c.semaphore_mutex(n.as_str())?;
                match left {
                    Some(d) => m.lock_timeout(d).await,
                    None => m.lock().await,
                }
            }
            Part::Permit(n, p) => {
                let s = c.semaphore(n.as_str(), *p)?;
                match left {
                    Some(d) => s.acquire_timeout(d).await,
                    None => s.acquire().await,
                }
            }
        }
    }

    async fn try_part(&self, part: &Part) -> Result<LockGuard<B>> {
        let c = &self.client;
        match part {
            Part::Mutex(n) => c.mutex(n.as_str())?.try_lock().await,
            Part::Read(n) => c.rwlock(n.as_str())?.try_read().await,
            Part::Write(n) => c.rwlock(n.as_str())?.try_write().await,
            Part::SemaphoreMutex(n) => c.semaphore_mutex(n.as_str())?.try_lock().await,
            Part::Permit(n, p) => c.semaphore(n.as_str(), *p)?.try_acquire().await,
        }
    }
}

/// Holds every part of a [`MultiLock`], or the permits of one
/// [`crate::Semaphore::acquire_many`].
#[derive(Debug)]
#[must_use = "the locks are released as soon as the guard is dropped"]
pub struct MultiGuard<B: DynBackend + ?Sized = dyn DynBackend> {
    guards: Vec<LockGuard<B>>,
}

impl<B: DynBackend + ?Sized> MultiGuard<B> {
    /// Hands out `guards` (a multi-lock's parts, or a semaphore's permits), just acquired one after the other, as one hold, unless a part
    /// taken earlier was lost while a later one was awaited: each grant checks only its
    /// own part, and where a loss is per entry (a Redis entry gone from its master) an
    /// earlier part can be lost while the rest are still held. Then every part is
    /// released and the acquire fails, as when a part cannot be taken.
    ///
    /// # Errors
    /// [`Error::LockLost`] naming the lost part.
    pub(crate) async fn granted(guards: Vec<LockGuard<B>>) -> Result<Self> {
        let Some(lost) = guards.iter().find(|g| g.is_lost()) else {
            return Ok(MultiGuard { guards });
        };
        let e = Error::LockLost(format!(
            "{} was lost while the other parts were being acquired",
            lost.name()
        ));
        tracing::debug!(error = %e, "multi-lock rolls back");
        for mut g in guards.into_iter().rev() {
            let _ = g.release().await;
        }
        Err(e)
    }

    /// Each part's guard, in acquisition order.
    pub fn guards(&self) -> &[LockGuard<B>] {
        &self.guards
    }

    /// Each part's lock name and fencing token, in acquisition order.
    pub fn tokens(&self) -> Vec<(LockName, FencingToken)> {
        self.guards
            .iter()
            .map(|g| (g.name().clone(), g.token()))
            .collect()
    }

    /// Completes once any part is lost (its session ended, or it could not be renewed):
    /// stop the critical section, since another client may hold that part from then on.
    /// Cancel-safe: dropping it loses nothing.
    pub fn lost(&self) -> impl Future<Output = Error> + Send + 'static {
        let all: Vec<_> = self.guards.iter().map(|g| g.lost().boxed()).collect();
        futures::future::select_all(all).map(|(e, _, _)| e)
    }

    /// True once any part's lost signal has fired, as [`LockGuard::is_lost`] answers for
    /// each: no round trip. Look before starting work under the locks; [`Self::lost`]
    /// is what to watch while it runs.
    pub fn is_lost(&self) -> bool {
        self.guards.iter().any(LockGuard::is_lost)
    }

    /// Asks the server whether every part is still held: [`LockGuard::verify`] for each.
    ///
    /// # Errors
    /// The first part that is lost or could not be confirmed.
    pub async fn verify(&self) -> Result<()> {
        for g in &self.guards {
            g.verify().await?;
        }
        Ok(())
    }

    /// Releases every part, in reverse order, even if some release fails.
    ///
    /// # Errors
    /// The first error met; every other part was still released. A part lost before the
    /// release gives [`Error::LockLost`], as [`LockGuard::release`] does.
    ///
    /// # Cancel safety
    /// If the future is dropped, the parts not yet released are released in the
    /// background when the guard is dropped.
    ///
    /// # Upstream
    /// Curator `InterProcessMultiLock.release()` (also reverse order, also keeps going
    /// after a failure and reports the first).
    pub async fn release(&mut self) -> Result<()> {
        let mut first = None;
        for g in self.guards.iter_mut().rev() {
            if let Err(e) = g.release().await {
                first.get_or_insert(e);
            }
        }
        first.map_or(Ok(()), Err)
    }
}
