//! An in-memory backend: a [`MemServer`] shared by [`MemBackend`] sessions, with fault
//! hooks, for recipe tests and seeded simulations that need no real server.
//!
//! # What it models
//! The [`dlock_core::Backend`] contract, as the real adapters keep it:
//! - **Queues and tokens.** Entries named as Curator names them, in queues keyed by
//!   [`dlock_core::QueuePath`]; one global revision, strictly increasing, is each new
//!   entry's sequence and fencing token (as etcd's create revision), so a later grant
//!   always has a larger token.
//! - **Atomic steps.** Every call is applied whole under one lock: `enqueue` returns the
//!   queue right after its add, `enqueue_removing` adds and removes in one step, and a
//!   removal observes whether it removed the head ([`dlock_core::Gone::Head`]).
//! - **Tickets.** A retried `enqueue` of a ticket finds the entry it already added (as
//!   ZooKeeper's protected mode and etcd's put-if-absent do); `abandon` removes whatever
//!   the ticket added. `remove` succeeds on a missing entry and compares the token, so it
//!   never removes a newer entry of the same name.
//! - **Downgrade.** [`dlock_core::Position::Beside`] puts a read at its writer's sequence
//!   only if the writer is still queued and is this session's; otherwise
//!   [`dlock_core::Error::LockLost`] and nothing is put.
//! - **Sessions.** Entries are bound to their session and go when it closes or expires.
//!   The client heartbeats; the server expires a session its timeout after the last
//!   heartbeat it received; the client's `lost()` fires
//!   [`dlock_core::lost_margin`] before that, counted from when its last acknowledged
//!   heartbeat was sent. Every call after `close` fails with [`dlock_core::Error::Closed`].
//! - **Watches.** Armed and checked in one step (no missed wake-up); an event is sent only
//!   after its change is visible to reads; every wait also re-checks on a timer
//!   ([`MemBackend::recheck_interval`]), so a lost event only makes it late.
//! - **Values and payloads.** `read_value` (a semaphore's shared count, set with
//!   [`MemServer::set_value`]), `set_data` and `wait_data_changed` (revocation).
//!
//! # Faults
//! Per call: [`MemServer::drop_reply`], [`MemServer::delay_replies`],
//! [`MemServer::expire_session`], [`MemServer::partition`] / [`MemServer::heal`],
//! [`MemServer::lose_watch_event`], [`MemServer::delay_watch_events`]. Drawn: a
//! [`FaultPlan`] given to [`MemServer::with_faults`], replayed exactly by its seed under
//! `tokio::time::pause()` on a current-thread runtime.
//!
//! # What it does not model
//! Servers that fail (crash, restart with or without data, leader change, a follower
//! that trails), clock skew between client and server (both read one `tokio::time`),
//! wire formats and the real adapters' own code (their retries, syncs and scripts), and
//! other processes: it lives in one process, so nothing that needs the CLI or a second
//! process can run on it.
//!
//! ```
//! # async fn demo() -> dlock_core::Result<()> {
//! use std::sync::Arc;
//! use dlock_core::{DynBackend, SessionOptions};
//! use dlock_testkit::mem::MemServer;
//!
//! let server = MemServer::new();
//! let a = server.connect(SessionOptions::default()).await?;
//! let backend: Arc<dyn DynBackend> = a.clone();
//! // The recipes run on it as on any backend: `dlock::Client::new(backend)`.
//! server.partition(a.session()); // a fault: cut it off
//! # Ok(()) }
//! ```

mod client;
mod faults;
mod server;
#[cfg(test)]
mod tests;

use std::fmt;

pub use client::MemBackend;
pub use faults::FaultPlan;
pub use server::{MemServer, DEFAULT_SESSION_TIMEOUT};

/// A session on a [`MemServer`], as its fault hooks name it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct SessionId(pub(crate) u64);

impl SessionId {
    /// The session's number: 1 for the first session of a server, then counting up.
    pub fn get(self) -> u64 {
        self.0
    }
}

impl fmt::Display for SessionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}
