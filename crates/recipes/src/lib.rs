//! dlock's lock recipes, written once over [`dlock_core::DynBackend`]: any
//! [`dlock_core::Backend`], or one chosen at run time.
//!
//! # Where to start
//! Make a [`Client`] over a connected backend (the `dlock` facade does this from a URL),
//! then ask it for a recipe:
//! - [`Mutex`]: reentrant, fair (Curator's InterProcessMutex);
//! - [`SemaphoreMutex`]: non-reentrant (InterProcessSemaphoreMutex);
//! - [`RwLock`]: shared readers, exclusive writers, downgrade (InterProcessReadWriteLock);
//! - [`Semaphore`]: N permits (InterProcessSemaphoreV2);
//! - [`MultiLock`]: any mix of the above, all-or-nothing;
//! - [`Election`]: leader election on the same fair queue, with a term, a value and a
//!   stream of leader changes (etcd's `concurrency.Election`).
//!
//! Every recipe acquires the same three ways, as tokio's locks do: wait
//! ([`Mutex::lock`], [`RwLock::read`] / [`RwLock::write`], [`Semaphore::acquire`],
//! [`MultiLock::acquire`]), wait at most a while (`lock_timeout`, `read_timeout`,
//! `write_timeout`, `acquire_timeout`: [`dlock_core::Error::Timeout`] after it), or not at
//! all (`try_lock`, `try_read`, `try_write`, `try_acquire`:
//! [`dlock_core::Error::WouldBlock`]). A zero timeout asks once, as a try does: a free lock
//! is taken, a held one fails at once. [`Semaphore::acquire_many`] takes n permits as one
//! [`MultiGuard`].
//!
//! Every acquire returns a [`LockGuard`] with a fencing token ([`LockGuard::token`]) and a
//! lost signal ([`LockGuard::lost`]). [`Mutex::lock_revocable`] returns a
//! [`RevocableGuard`] that others can ask to release ([`Client::revoke`], Curator's
//! revocation).
//!
//! ```no_run
//! use std::time::Duration;
//! use dlock_core::{DynBackend, Result};
//! use dlock_recipes::Client;
//!
//! // Works on any backend; the `dlock` facade builds the client from a URL.
//! async fn nightly_report<B: DynBackend + ?Sized>(client: &Client<B>) -> Result<()> {
//!     let mutex = client.mutex("reports/nightly")?;
//!     let mut guard = mutex.lock_timeout(Duration::from_secs(5)).await?;
//!     println!("holding {} with fencing token {}", guard.name(), guard.token());
//!     tokio::select! {
//!         () = make_report() => {}
//!         lost = guard.lost() => return Err(lost), // session gone: stop now
//!     }
//!     guard.release().await
//! }
//! # async fn make_report() {}
//! ```
//!
//! # Feature flags
//! None: the recipes need only `dlock-core` and tokio.
//!
//! # The design decision
//! Recipes never know which backend they run on: they add an entry, ask the core's
//! driver whether it holds, and watch the one entry the driver names. So every recipe
//! is fair, herd-free and cancellation-safe on every backend at once, and a fix in one
//! place fixes all of them.
//!
//! # Reentrancy
//! A hold is re-entered only by code that provably runs inside it: through the guard
//! ([`LockGuard::reenter`]) or inside a future the guard scopes ([`LockGuard::scope`]).
//! A sibling future of the holding task (`join!`, `select!`, `FuturesUnordered`) asks like
//! any other contender and waits, so two critical sections never share one hold (nor its
//! fencing token). A lost hold is never re-entered or downgraded: [`dlock_core::Error::LockLost`].
//!
//! # Tracing
//! Every acquire runs in a debug-level `dlock.acquire` span (fields `lock`, `kind`, and
//! once granted `token` and `wait_ms`, the time from the call to the grant); every
//! release in a `dlock.release` span (`lock`, `token`).
//!
//! # Metrics and health
//! Acquire outcomes, wait and hold times, lost holds and errors are recorded through the
//! [`metrics`](https://docs.rs/metrics) facade under the names [`metrics`](mod@metrics)
//! lists, labelled by backend and kind (never by lock name); install any exporter to see
//! them. [`Client::health`] answers whether the client can take locks now, for a
//! readiness probe.
//!
//! # Cancel safety
//! Every acquire is cancel-safe: dropping its future removes its queue entry (in the
//! background, on the tokio runtime the [`Client`] was made on, or if there is none or
//! it has shut down, the one the acquire ran on). Dropping a guard releases it the same
//! way.
//!
//! # Session loss
//! Every entry lives as long as its client's session (ZooKeeper session, etcd lease,
//! Redis lease). An acquire waiting when the session ends returns
//! [`dlock_core::Error::LockLost`]; a guard held when it ends fires
//! [`LockGuard::lost`], after which another client may hold the lock. Each method's
//! docs say the same for its case, and name the Curator / etcd / Redisson call it
//! matches.

#![deny(missing_docs)]

mod client;
mod election;
mod guard;
mod listing;
pub mod metrics;
mod multi;
mod mutex;
mod queue;
mod reentry;
mod rwlock;
pub mod semaphore;
mod tickets;

pub use client::{Client, Participant};
pub use election::{Election, Leader, Leadership};
pub use guard::{LockGuard, RevocableGuard};
pub use listing::{LockKind, LockSummary};
pub use multi::{MultiGuard, MultiLock, Part};
pub use mutex::Mutex;
pub use rwlock::RwLock;
pub use semaphore::{Semaphore, SemaphoreMutex};
pub use tickets::TicketSource;

// Handles over `dyn DynBackend` (what the facade hands out) must be cloneable and printable,
// so they can be shared between tasks.
const _: () = {
    fn clone_debug<T: Clone + std::fmt::Debug>() {}
    #[allow(dead_code)]
    fn handles_over_dyn_backend() {
        clone_debug::<Client>();
        clone_debug::<Mutex>();
        clone_debug::<RwLock>();
        clone_debug::<Semaphore>();
        clone_debug::<SemaphoreMutex>();
        clone_debug::<MultiLock>();
        clone_debug::<Election>();
    }
};
