//! The sans-I/O protocol core of dlock.
//!
//! This crate does no I/O, reads no clock, draws no randomness (a [`Ticket`] is made
//! from bytes the caller drew) and runs no async runtime: every function is a
//! deterministic function of its arguments, tested without servers. The adapters
//! (`dlock-zookeeper`, ...) talk to servers; the recipes (`dlock-recipes`) drive them
//! through the [`Backend`] trait defined here, held as [`DynBackend`].
//!
//! # Where to start
//! - [`entry`]: what a contender adds under a lock, its Curator-compatible name, and the
//!   queue order (by sequence, never by whole name).
//! - [`driver`]: given the ordered queue and my entry, am I the holder, and if not,
//!   which single entry do I watch. This is the fair-queue recipe every backend shares.
//! - [`Backend`]: the seam to the servers, with its contract; [`DynBackend`] is its
//!   object-safe form for a backend chosen at run time.
//! - [`Error`]: the one error enum, with distinct variants for timeout, lock lost, not
//!   held, invalid input, unreachable backend.
//! - [`FencingToken`], [`LockName`].
//! - [`security`]: TLS settings and credentials ([`Secret`] never prints).
//!
//! ```
//! use dlock_core::{decide, Decision, Entry, FenceGate};
//!
//! // A queue as a backend lists it: two mutex contenders, in sequence order.
//! let queue: Vec<Entry> = [
//!     "_c_1fbf573b-3050-4ba4-a162-7ea7e63924ae-lock-0000000007",
//!     "_c_ae920474-0000-4000-8000-000000000000-lock-0000000008",
//! ]
//! .into_iter()
//! .filter_map(Entry::from_name)
//! .collect();
//! assert_eq!(decide(&queue, &queue[0].name), Decision::Acquired);
//! // The second waits for exactly one entry: the first.
//! assert_eq!(decide(&queue, &queue[1].name), Decision::Wait(&queue[0]));
//!
//! // The storage side of fencing: a stale token is refused.
//! let gate = FenceGate::new();
//! assert!(gate.admit(dlock_core::FencingToken::new(42)));
//! assert!(!gate.admit(dlock_core::FencingToken::new(41)));
//! ```
//!
//! Most users want the `dlock` facade crate, which re-exports this crate's public types
//! and connects to a backend from a URL.
//!
//! # Feature flags
//! None. The crate depends on no async runtime and no client library.
//!
//! # The design decision
//! A waiter watches exactly one entry: the nearest one ahead of it that conflicts with
//! it. That one choice gives fairness, no thundering herd and no missed release; the
//! property tests in [`driver`] check all three over random interleavings.

#![deny(missing_docs)]

pub mod backend;
pub mod deadline;
pub mod driver;
pub mod entry;
pub mod error;
pub mod name;
pub mod security;
#[cfg(feature = "rustls")]
pub mod tls_client;
pub mod token;

pub use backend::{
    lost_margin, Backend, Capability, DynBackend, Enqueued, Gone, Hints, ListedQueue, Position,
    SessionOptions, Woken,
};
pub use deadline::SharedDeadline;
pub use driver::{decide, Decision};
pub use entry::{Entry, EntryKind, Ticket};
pub use error::{Error, NameError, Result};
pub use name::{name_prefix, LockName, NameRules, QueuePath};
pub use security::{Credentials, Secret, TlsOptions};
pub use token::{FenceGate, FencingToken};
