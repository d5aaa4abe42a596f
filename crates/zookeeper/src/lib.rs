//! The ZooKeeper backend of dlock: [`dlock_core::Backend`] on one ZooKeeper session,
//! laid out exactly as Apache Curator 5 lays out its locks, so Java services using Curator
//! and Rust services using dlock can share the same locks.
//!
//! Most users reach this crate through the `dlock` facade (a `zk://` URL); use it directly
//! when you build on the `Backend` trait yourself.
//!
//! # Where to start
//! - [`ZkBackend::connect`] opens a session (`"host:port,host:port/chroot"`) and returns an
//!   `Arc<ZkBackend>` that any number of locks and tasks share;
//!   [`ZkBackend::from_client`] builds one on the application's own session instead.
//! - [`ZkOptions`] holds the adapter's own settings; [`DEFAULT_SESSION_TIMEOUT`] (10 s) is
//!   used when [`dlock_core::SessionOptions`] does not set one.
//! - [`ZkBackend::client`] hands out the underlying [`zookeeper_client::Client`] for
//!   guarded writes or inspection (naming its types takes a dependency on the same
//!   zookeeper-client version as this crate's).
//!
//! # Layout (Curator-compatible)
//! Lock `orders/42` is the znode `/orders/42` under the chroot; a semaphore's queues are
//! `/orders/42/leases` and `/orders/42/locks`. Each contender is an `EPHEMERAL_SEQUENTIAL`
//! child named `_c_<uuid>-lock-0000000007` (`__READ__`, `__WRIT__`, `lease-` for the other
//! kinds); parents are created on demand as `CONTAINER` nodes, which the server deletes
//! once empty. A write holder's read entry (downgrade) is an `EPHEMERAL` node carrying the
//! writer's sequence number. The fencing token is the entry's `czxid`: the zxid of the
//! transaction that created it, which only grows across the whole ensemble.
//!
//! Enqueue is one round trip: the `create` and the `get_children` of the parent are written
//! back to back without waiting (zookeeper-client fixes request order at call time).
//! zookeeper-client 0.11 never sets `TCP_NODELAY` and offers no way to, so Nagle's
//! algorithm holds the second request until the first is acknowledged, usually by its
//! reply: pipelining saves less than it could. The adapter leaves the client's sockets
//! alone; `docs/benchmarks.md` has the measured cost.
//!
//! # The design decision: the adapter declares loss itself, before the server can
//! The server expires a session a session timeout `t` after it last heard from the
//! client, and another contender may take the lock at once. The client hears of it only
//! when a server tells it, or (zookeeper-client) when it gives up reconnecting 1.4·`t`
//! after the last reply: during a partition, both come too late.
//! So one task per session watches the connection state, and when the connection has been
//! down until 0.8·`t` after the last reply (the client notices a silent connection after
//! its connection timeout, at most 0.4·`t`) it declares every entry of the session lost: `lost()` futures
//! complete with [`dlock_core::Error::LockLost`], in-flight and later operations fail with
//! it instead of hanging, and the session is closed so it cannot come back holding entries.
//! Curator waits a full `t` after SUSPENDED, which can be 0.4·`t` after the server already
//! gave the lock away.
//!
//! A healthy connection is not enough either: the server answering the client may be a
//! follower cut off from the leader, which keeps answering pings (for syncLimit ×
//! tickTime) while the leader expires the session. So a second task sends a `sync` every
//! `t`/16; a completed `sync` travels through the leader, and two of them on one
//! connection at least two ticks apart prove the leader touched the session at the
//! earlier one (see the `heartbeat` module; the tick comes from the servers' `conf`, from
//! [`ZkOptions::tick_time`], or is taken as `t`/2). The session is declared lost once no such proof is newer than
//! `t` − max(0.15·`t`, 100 ms): the lost signal fires at least max(0.15·`t`, 100 ms)
//! before the leader can expire the session and grant the lock elsewhere. This assumes,
//! as ZooKeeper's own minimum session does, that the session timeout is at least two
//! ticks (`tickTime`); a session shorter than that is not safe against a partition
//! between the servers. Exactly: the margin is `max(3·t/20, max(t/10, 100 ms))`, that is
//! max(0.15·`t`, 100 ms) (300 ms for a 2 s session, 1.5 s for the default 10 s), counted
//! from the send time of the latest sync the leader is proven to have seen.
//!
//! **Session timeout versus the quorum's failure detection.** A follower cut off from
//! its leader notices only after `syncLimit` × `tickTime`, and until then it keeps its
//! clients connected; only then do they reconnect elsewhere and prove the session again
//! (a fresh pair of syncs two ticks apart). For a session to outlive such a partition, the
//! lost signal's deadline (0.85·`t` after the last proof) must leave room for all of that,
//! so the rule is: **session timeout ≥ 2 × `syncLimit` × `tickTime`**. At connect the
//! adapter reads the negotiated session timeout and, when the servers answer `conf`
//! (`4lw.commands.whitelist`), their `tickTime` and `syncLimit`, and logs a
//! `tracing::warn!` when the rule does not hold (and, when `conf` is not answered, one
//! that names the rule for the user to ensure). Below the rule locks stay safe, the lost
//! signal still fires before the leader can expire the session, but every follower
//! partition costs the session and its locks.
//!
//! **Reads go through the leader where a stale answer would be unsafe.** A follower
//! answers reads from its own tree, which may trail the leader (and does, for a while,
//! when it is cut off from it). So `contains` (what `LockGuard::verify` asks), the
//! lookup of a create whose reply was lost, and `abandon`'s listing each issue a `sync`
//! on the queue's znode first: they never say "still there" about an entry the leader
//! already deleted, nor miss an entry it already created.
//!
//! # Example
//! ```no_run
//! use dlock_core::{decide, Backend, Decision, EntryKind, LockName, NameRules, Position, QueuePath,
//!                  SessionOptions, Ticket};
//! use dlock_zookeeper::ZkBackend;
//!
//! # async fn demo() -> dlock_core::Result<()> {
//! let zk = ZkBackend::connect("127.0.0.1:2181/myapp", SessionOptions::default()).await?;
//! let q = QueuePath::root(LockName::new("orders/42", dlock_zookeeper::NAME_RULES)?);
//! // A ticket names this contender's entry; draw its 16 bytes at random.
//! # let random_bytes = [7u8; 16];
//! let ticket = Ticket::from_random_bytes(random_bytes);
//! let mut done = zk.enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"worker-1").await?;
//! loop {
//!     match decide(&done.queue, &done.mine.name) {
//!         Decision::Acquired => break,
//!         Decision::Wait(ahead) => {
//!             let ahead = ahead.clone();
//!             zk.wait_gone(&q, &ahead).await?;
//!             done.queue = zk.queue(&q).await?;
//!         }
//!         Decision::Missing => return Err(dlock_core::Error::LockLost("entry vanished".into())),
//!     }
//! }
//! println!("holding orders/42 with fencing token {:?}", done.mine.token);
//! zk.remove(&q, &done.mine).await?;
//! zk.close().await?;
//! # Ok(()) }
//! ```
//!
//! # Errors and retries
//! - A request cut off by a dropped or reset connection is sent again once the
//!   client has reconnected, when doing so is safe: every read, `remove`, `abandon`, and
//!   enqueue's `create`, which first looks for its entry by ticket (Curator's protected
//!   mode) so a create whose reply was lost is never duplicated.
//! - Once the session is lost (expired, closed by someone else, or disconnected past the
//!   local limit above) every operation, including ones already waiting, fails with
//!   [`dlock_core::Error::LockLost`]; after [`dlock_core::Backend::close`] they fail with
//!   [`dlock_core::Error::Closed`].
//! - A server that stays unreachable gives [`dlock_core::Error::Unreachable`]; anything
//!   else the server refuses is [`dlock_core::Error::Backend`] with the client's error as
//!   its source.
//! - `read_value` reads the data of the lock's own znode; empty data counts as "not set"
//!   (`None`), since the container node created on demand carries none.
//!
//! # Feature flags
//! None. The crate always builds zookeeper-client with its `tokio` feature (without it,
//! connecting panics at run time) and needs a tokio runtime.
//!
//! # Cancel safety
//! Every future may be dropped. A dropped `enqueue` may still create its entry (the request
//! is on the wire once the future was first polled); `abandon` with the same ticket removes
//! it, since it lists the queue after that create on the same session.
#![deny(missing_docs)]
/// The lock-name rules of ZooKeeper: the shared rules, no name under the reserved
/// `/zookeeper` tree, and no segment with the form of a queue entry's name
/// (`jobs/lock-0000000001` would be a child node of `jobs`, which `jobs`' queue would
/// list as an entry nobody removes).
pub const NAME_RULES: dlock_core::NameRules = dlock_core::NameRules::common()
    .reserving("zookeeper")
    .refusing_entry_like_segments();

mod backend;
mod connect;
mod enqueue;
mod errors;
mod heartbeat;
mod listing;
mod security;
mod session;

pub use backend::{ZkBackend, DEFAULT_SESSION_TIMEOUT};
/// The client crate this adapter is built on, so that an application handing its own
/// session to [`ZkBackend::from_client`] names the same version.
pub use zookeeper_client;

/// Adapter-specific connect options; [`ZkOptions::default`] is right for almost everyone.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct ZkOptions {
    /// The servers' `tickTime`, which bounds how often a follower reports its clients'
    /// activity to the leader; the lost signal's proof of a live session depends on it
    /// (see the crate docs). Default `None`: asked of the servers with the `conf`
    /// four-letter word at connect, and if no server answers it (`conf` not in
    /// `4lw.commands.whitelist`), taken as half the session timeout, the most ZooKeeper
    /// allows; the lost signal is then safe but fires during any leader election or
    /// reconnection. Set it when `conf` is not whitelisted. A value given and a value
    /// the servers answer: the larger is used. Never state it smaller than the
    /// ensemble's (over an application's own client nothing is asked, so the value given
    /// is trusted): the proof would then count touches the leader never heard of.
    pub tick_time: Option<std::time::Duration>,
}

impl ZkOptions {
    /// Sets [`ZkOptions::tick_time`].
    pub fn with_tick_time(mut self, tick: std::time::Duration) -> Self {
        self.tick_time = Some(tick);
        self
    }
}

#[cfg(test)]
mod name_rule_tests {
    use dlock_core::{Error, LockName};

    #[test]
    fn the_reserved_tree_is_refused_and_the_rest_accepted() {
        assert!(matches!(
            LockName::new("zookeeper/quota", crate::NAME_RULES),
            Err(Error::InvalidName { .. })
        ));
        assert!(LockName::new("zookeeper-like/a{b}", crate::NAME_RULES).is_ok());
    }
}
