//! The etcd v3 backend of dlock.
//!
//! You probably want the `dlock` facade, which picks this backend for `etcd://` URLs; use
//! this crate directly only to build an [`EtcdBackend`] yourself and hand it to the
//! recipes.
//!
//! # Where to start
//! [`EtcdBackend::connect`] takes `host:port` endpoints and a
//! [`dlock_core::SessionOptions`], grants the session's lease and returns the
//! [`dlock_core::Backend`] the recipes drive ([`EtcdBackend::from_client`] builds one on
//! the application's own etcd client instead). The rest of the crate is the trait's
//! implementation:
//! - `layout`: the key layout (below), pure and unit-tested;
//! - `session`: the lease and its keep-alive task, and the lost signal;
//! - `claims`: the key each ticket's entry takes, the enqueue transaction (which also
//!   deletes the entry handed on, for `enqueue_removing`: one synced write for what
//!   Curator's semaphore order does in two), and the deletes that free a claimed key;
//! - `reads`: queue reads and the revision floor no read goes back before;
//! - `waits`: `wait_gone` and `wait_changed` on watches, and their retries;
//! - `watches`: the one watch stream every watch of a client shares;
//! - `hubs`: the whole-queue watches a client keeps armed between its mutex waits;
//! - `errors`: how etcd-client's errors map to [`dlock_core::Error`].
//!
//! # The design decision: etcd's own mutex keys
//! A dlock mutex entry is the very key etcd's `concurrency.Mutex` writes, so dlock,
//! `etcdctl lock` and Go services wait in one FIFO queue on the same name: teams can move
//! to dlock one service at a time. Everything below (the key layout, the ticketed key of a
//! second local contender, depth-limited queues) follows from keeping that promise.
//!
//! # Feature flags
//! None. etcd-client needs `protoc` at build time (`apt-get install protobuf-compiler`).
//!
//! # Layout: shared with etcd's own lock
//! A lock named `NAME` lives under the key prefix `NAME/`. A mutex entry is exactly the
//! key etcd's `concurrency.Mutex` (and so `etcdctl lock NAME` and the server's v3lock
//! service) would write for the same lease: `NAME/<lease id in lowercase hex>`, ordered
//! by create revision. dlock and etcd's lock therefore wait for each other on the same
//! name, in one FIFO queue.
//!
//! | entry | key | value |
//! | --- | --- | --- |
//! | mutex | `NAME/<lease hex>` | `dlock1 <ticket> 0\n<data>` (etcd's lock writes an empty value) |
//! | second mutex contender of the same client on `NAME` | `NAME/<lease hex>-<ticket uuid>` | as above |
//! | read lock | `NAME/<lease hex>-<ticket uuid>-r` | `dlock1 <ticket> <writer revision or 0>\n<data>` |
//! | write lock | `NAME/<lease hex>-<ticket uuid>-w` | as for a mutex |
//! | semaphore entry (a permit held or waited for) | `NAME/permits/<lease hex>-<ticket uuid>-l` | as for a mutex, `<data>` ending in ` permits=N` |
//!
//! The semaphore is ranked ([`dlock_core::Hints::ranked_semaphore`]): no internal mutex,
//! the first N keys of `NAME/permits/` by create revision hold a permit. Curator's
//! layout (`NAME/leases/`, `NAME/locks/`), which earlier builds wrote here too, is not
//! read: a semaphore name must not be shared with such a build.
//!
//! - A queue is the keys *directly* under its prefix; deeper keys (a semaphore's
//!   `permits/...`, the lock `NAME/sub`) are not part of it. etcd's lock does not filter by
//!   depth, so it also waits for those: it is more careful, never less.
//! - Any other key directly under `NAME/` (another client's etcd mutex key, say) counts as
//!   an exclusive mutex entry, as it does for etcd's lock.
//! - Every key is attached to the client's one lease, so it vanishes when the session
//!   does. Entry sequence numbers and fencing tokens are create revisions, which grow
//!   across the whole cluster; a downgrade's read entry stores its writer's revision in
//!   its value and sorts beside it.
//!
//! ## Two contenders of one client on one mutex
//! etcd's layout has room for one key per lease per name, and etcd's own Mutex simply lets
//! two contenders of one session share it, so they do not exclude each other. dlock never
//! shares a key: the first local contender on `NAME` takes `NAME/<lease hex>`, and any
//! other contender of the same client that arrives while that key is in use takes the
//! ticketed key `NAME/<lease hex>-<ticket>`. etcd's lock orders that key by create
//! revision like any other, so exclusion and FIFO order hold across dlock and etcd's lock
//! alike, and `try_lock` from the second contender still answers at once.
//!
//! # Fast handoff
//! etcd's Mutex waits for its predecessor with a watch that starts at a past revision.
//! The server serves such an *unsynced* watcher from a loop that runs every 100 ms, so
//! under contention etcd's lock hands off about ten times a second per waiter chain. dlock
//! opens its watch from "now" (no start revision), which the server treats as synced and
//! notifies as each delete commits, and then reads the predecessor's key at or after the
//! revision the watch starts after, so no delete is missed. A watch from now is still
//! unsynced if a write lands while the server registers it; unless the read proves
//! nothing was written since (one endpoint, same revision), the waiter re-reads its
//! predecessor's key every 5 ms for 55 ms after arming the watch instead of waiting for the
//! server's loop (1-3 % of watches under contention; without the re-reads they
//! stall for up to 100 ms).
//!
//! Every watch of a client shares one watch stream (a create and a cancel are one
//! message each), and create revisions only grow, so the entries ahead of a waiter can
//! only leave: a waiter whose predecessor was the last one in its way holds the lock as
//! soon as the delete is reported, with no further read
//! ([`dlock_core::driver::Snapshot`]). A waiter whose view still named entries ahead of
//! its predecessor needs a read to learn they left, since a delete alone does not tell a
//! release by the head from a cancelled waiter or an expired lease; except on a short
//! queue (at most 8 keys), whose waiters watch it whole: from one read of the queue and
//! every change after it they know whether the predecessor went as the head
//! ([`dlock_core::Gone::Head`]), and then hold the lock with no queue read either. The
//! same watch shows whether the waiter's own key was deleted from outside while it
//! waited (`wait_gone_behind`); a waiter woken any other way reads its own key once
//! before it holds (`still_queued`, served without a quorum round by a member that has
//! reached the delete it was told of). A queue
//! change is sent to at most those 8 watches however long the queue grows; behind them,
//! a waiter watches its predecessor's key alone. A handoff at the front of a queue costs
//! the holder's delete and one watch event.
//!
//! One client keeps at most 64 requests in flight; the rest wait for a slot before their
//! time budget starts, so a thousand acquires queued at once on one client do not time
//! out behind each other.
//!
//! Queue reads are served by whichever member receives them (serializable) when its
//! revision is at least the highest this client has seen, and repeated as linearizable
//! reads otherwise. Such a view may list entries that are already gone, never miss one
//! still ahead of mine, so it can only make a waiter wait longer, never let it in early.
//!
//! # Failover
//! etcd-client spreads requests over every endpoint given, dead ones included, and a
//! request that lands on a dead one fails at once. Every request dlock makes is
//! idempotent (a put-if-absent keyed by the ticket, a delete guarded by create revision, a
//! read), so it is retried, immediately and then with a short backoff, until it succeeds
//! or its budget (the connect timeout, at least 5 s) runs out; an attempt that gets no
//! answer within a third of the budget (a write forwarded to a leader that just died) is
//! retried too. Requests carry etcd's require-leader flag, so a member without a leader
//! refuses them at once instead of holding them. Broken watch streams are re-armed, and
//! so is one that leaves a watch's create unanswered for the budget while the connection
//! still serves the rest: it is given up and the watch armed on a new stream. A
//! keep-alive stream whose renewal goes unanswered for a third of the TTL (at least
//! 0.5 s; a loaded member was seen to leave one so) is replaced by a new one the same
//! way, well before the session's deadline. The etcd crate's tests stage both with the
//! test kit's `FrameDrop`.
//!
//! # Cancel safety
//! Every future may be dropped. An enqueue's transaction runs in its own task once sent;
//! [`dlock_core::Backend::abandon`] waits for its answer before deleting the key, so a
//! delete can never be overtaken by the put it was meant to undo.
//!
//! # Sessions
//! One lease per client, TTL [`DEFAULT_SESSION_TTL`] (etcd's Go default) unless
//! [`dlock_core::SessionOptions::session_timeout`] says otherwise, renewed every TTL/3 by
//! a background task that re-opens the keep-alive stream whenever it breaks. Once no
//! renewal *sent* in the last TTL − [`dlock_core::lost_margin`] (max(10 % of the TTL,
//! 100 ms)) has been acknowledged, or the server reports the lease gone,
//! [`dlock_core::Backend::lost`] completes for every entry on it: the server renewed the
//! lease after the request was sent, so it cannot expire it before that margin has
//! passed. The next acquire grants
//! a new lease. [`dlock_core::Backend::close`] revokes the lease.
//!
//! # What this crate never does
//! It never calls etcd's server-side `Lock` RPC: a cancelled call leaves a waiter key that
//! later becomes the owner with nobody to release it.

//! # Example
//! ```no_run
//! use dlock_core::driver::{decide, Decision};
//! use dlock_core::{Backend, EntryKind, LockName, Position, QueuePath, SessionOptions, Ticket};
//! use dlock_etcd::EtcdBackend;
//!
//! # async fn run() -> Result<(), dlock_core::Error> {
//! let etcd = EtcdBackend::connect(&["127.0.0.1:2379".to_owned()], SessionOptions::default()).await?;
//! let q = QueuePath::root(LockName::new("orders/42", etcd.name_rules())?);
//! // A ticket names this contender's entry; draw its 16 bytes at random.
//! # let random_bytes = [7u8; 16];
//! let ticket = Ticket::from_random_bytes(random_bytes);
//! let mut e = etcd.enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"me").await?;
//! loop {
//!     let ahead = match decide(&e.queue, &e.mine.name) {
//!         Decision::Acquired => break,
//!         Decision::Wait(ahead) => ahead.clone(),
//!         Decision::Missing => return Err(dlock_core::Error::LockLost("session ended".into())),
//!     };
//!     etcd.wait_gone(&q, &ahead).await?;
//!     e.queue = etcd.queue(&q).await?;
//! }
//! // Held: `e.mine.token` is the fencing token. `etcdctl lock orders/42` waits now.
//! etcd.remove(&q, &e.mine).await?;
//! etcd.close().await
//! # }
//! ```

#![deny(missing_docs)]

/// The lock-name rules of etcd: the shared rules only (a key takes any UTF-8; segments
/// keep one lock's prefix from being another's).
pub const NAME_RULES: dlock_core::NameRules = dlock_core::NameRules::common();

mod backend;
mod claims;
mod errors;
mod hubs;
mod kv_pool;
mod layout;
mod reads;
mod server_version;
mod session;
mod sweeps;
mod waits;
mod watches;

pub use backend::{EtcdBackend, DEFAULT_SESSION_TTL};
/// The client crate this adapter is built on, so that an application handing its own
/// client to [`EtcdBackend::from_client`] names the same version.
pub use etcd_client;
pub use server_version::revokes_live_leases_on_leader_resume;

#[cfg(test)]
mod name_rule_tests {
    use dlock_core::LockName;

    #[test]
    fn only_the_shared_rules_apply() {
        assert!(LockName::new("zookeeper/a{b}", crate::NAME_RULES).is_ok());
        assert!(LockName::new("a//b", crate::NAME_RULES).is_err());
    }
}
