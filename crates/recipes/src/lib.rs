//! dlock's lock recipes, written once over [`dlock_core::Backend`].
//!
//! # Where to start
//! Make a [`Client`] over a connected backend (the `dlock` facade does this from a URL),
//! then ask it for a recipe:
//! - [`Mutex`]: reentrant, fair (Curator's InterProcessMutex);
//! - [`SemaphoreMutex`]: non-reentrant (InterProcessSemaphoreMutex);
//! - [`RwLock`]: shared readers, exclusive writers, downgrade (InterProcessReadWriteLock);
//! - [`Semaphore`]: N permits (InterProcessSemaphoreV2);
//! - [`MultiLock`]: any mix of the above, all-or-nothing.
//!
//! Every acquire returns a [`LockGuard`] with a fencing token ([`LockGuard::token`]) and a
//! lost signal ([`LockGuard::lost`]).
//!
//! # The design decision
//! Recipes never know which backend they run on: they add an entry, ask the core's
//! driver whether it holds, and watch the one entry the driver names. So every recipe
//! is fair, herd-free and cancellation-safe on every backend at once, and a fix in one
//! place fixes all of them.
//!
//! # Cancel safety
//! Every acquire is cancel-safe: dropping its future removes its queue entry (in the
//! background, on the current tokio runtime). Dropping a guard releases it the same way.

#![deny(missing_docs)]

mod client;
mod guard;
mod multi;
mod mutex;
mod queue;
mod rwlock;
pub mod semaphore;

pub use client::{Client, Participant};
pub use guard::LockGuard;
pub use multi::{MultiGuard, MultiLock, Part};
pub use mutex::Mutex;
pub use rwlock::RwLock;
pub use semaphore::{Semaphore, SemaphoreMutex};

// Handles over `dyn Backend` (what the facade hands out) must be cloneable and printable,
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
    }
};
