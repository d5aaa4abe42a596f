//! The Redis adapter of dlock: [`RedisBackend`] implements [`dlock_core::Backend`] on
//! [fred](https://docs.rs/fred) 10, over one Redis master (given directly, or found
//! through Redis Sentinel and followed across failovers), over a Redis Cluster (each lock
//! on the master of its slot) or, in Redlock mode, over N independent masters.
//!
//! You usually reach it through the `dlock` facade (`redis://host:port`,
//! `redis+sentinel://s1:p1,s2:p2,s3:p3/mymaster`, `redis+cluster://n1:p1,n2:p2,...` or
//! `redlock://h1:p1,h2:p2,...`) and the recipes; use this crate directly only to build a
//! backend by hand: [`RedisBackend::connect`], [`RedisBackend::connect_sentinel`],
//! [`RedisBackend::connect_cluster`] or [`RedisBackend::connect_redlock`]; or on the
//! application's own fred clients:
//! [`RedisBackend::from_client`], [`RedisBackend::from_pool`],
//! [`RedisBackend::from_redlock_clients`]. The facade parses URLs (`dlock::BackendUrl`);
//! this crate takes addresses.
//!
//! ```no_run
//! use std::time::Duration;
//! use dlock_core::{decide, Backend, Decision, EntryKind, LockName, NameRules, Position,
//!                  QueuePath, SessionOptions, Ticket};
//! use dlock_redis::RedisBackend;
//!
//! # async fn demo() -> Result<(), dlock_core::Error> {
//! let opts = SessionOptions::default().with_session_timeout(Duration::from_secs(10));
//! let redis = RedisBackend::connect("127.0.0.1:6379", opts).await?;
//! let q = QueuePath::root(LockName::new("orders/42", dlock_redis::NAME_RULES)?);
//! // A ticket names this contender's entry; draw its 16 bytes at random.
//! # let random_bytes = [7u8; 16];
//! let ticket = Ticket::from_random_bytes(random_bytes);
//! let added = redis.enqueue(&q, &ticket, EntryKind::Lock, Position::Tail, b"me").await?;
//! if let Decision::Wait(ahead) = decide(&added.queue, &added.mine.name) {
//!     redis.wait_gone(&q, ahead).await?; // then decide again on a fresh `queue`
//! }
//! redis.remove(&q, &added.mine).await?;
//! # Ok(()) }
//! ```
//!
//! # The design decision: one Lua script per state change, one hash tag per lock
//! Redis has no sessions, sequential nodes or watches, so each is built from keys and
//! scripts: every change of a queue (enqueue with its sequence and token, remove, abandon,
//! renew) is one script over keys that share the lock's hash tag. A script runs atomically
//! on the server, so there is no check-then-act race and no `WATCH`/retry loop, and the
//! shared tag keeps every key of a lock in one Cluster slot.
//!
//! # Feature flags
//! None. fred is built with the features the scripts and subscriptions need.
//!
//! # Data model
//! Every key of a lock `L` carries the hash tag `{L}`, so all of them live in one Redis
//! Cluster slot and one Lua script can touch them all. For a queue (the lock itself, or
//! one of its sub-queues `:<sub>` such as the semaphore's `leases`):
//!
//! | key | type | what |
//! | --- | --- | --- |
//! | `dlock:{L}:q[:<sub>]` | sorted set | entry names scored by their sequence |
//! | `dlock:{L}:seq[:<sub>]` | string, `PX` = lease | Redlock only: the highest sequence this master accepted |
//! | `dlock:{L}:e[:<sub>]:<entry name>` | string, `PX` = lease | `<token> <creation ms (server clock)> <data>` |
//! | `dlock:{L}:token` | string, `PX` = lease | the lock's last fencing token |
//!
//! While a lock has one entry and nobody waits (the uncontended case), the fast path
//! keeps it as a string at the queue's own key instead: `dlock:{L}:q[:<sub>]` =
//! `<entry name> <token> <data>`, `PX` = lease (sequence = token; creation ms = token
//! µs / 1000). `SET NX` on that key is the exclusion (it fails whenever the lock has an
//! entry of either layout), and the enqueue of a second entry first moves the string
//! into the layout above (the same name, token, data and TTL). Every script checks the
//! key's type before it reads or changes the queue. Clients of one lock must all run a
//! dlock that knows this layout: an older one gets `WRONGTYPE` errors (never a grant)
//! from a lock held this way. Redlock and election candidates always use the queue
//! layout.
//!
//! On one master an entry's sequence is its token (tokens only grow, and the enqueue
//! script keeps it above every queued sequence), so no sequence counter is kept.
//!
//! Entry names follow Curator: `_c_<ticket uuid>-<marker><10-digit sequence>` (markers
//! `lock-`, `__READ__`, `__WRIT__`, `lease-`), so `dlock_core`'s parsing and ordering work
//! unchanged and a dropped enqueue is found again by its ticket. Channels:
//! `dlock:{L}:gone[:<sub>]:<entry name>` carries one message when that entry is removed
//! (only the waiter watching it wakes), `dlock:{L}:chg[:<sub>]` one per removal (for the
//! one semaphore contender that waits for a lease to go), `dlock:{L}:data[:<sub>]:<entry
//! name>` one per proclaim of that entry's value (for an election's observers).
//!
//! Every state change is one Lua script (enqueue, list, remove, abandon, renew, proclaim), sent with
//! `EVALSHA` and loaded on `NOSCRIPT`. The scripts build entry keys from prefixes instead
//! of declaring each key: they share the hash tag, so they are on the script's slot. The
//! queue's key lives at least as long as its longest-lived entry (`PEXPIRE ... GT`, so
//! **Redis 7.0 or later** is required); the counters carry a lease as TTL and are only
//! floors (see "Fencing tokens"), and they are deleted when their queue empties, so neither
//! an idle lock nor a crashed client leaves keys behind for longer than a lease. An
//! uncontended acquire + release runs 9 commands inside its two scripts (see the
//! `scripts` module for what each costs).
//!
//! The layout is Cluster-ready: every key a script touches, and every channel it
//! publishes on, carries the lock's hash tag, so each script names keys of one slot (see
//! "Redis Cluster").
//!
//! # Lifetime of an entry: the watchdog
//! An entry key expires one lease after its last renewal (the lease is
//! [`dlock_core::SessionOptions::session_timeout`], default 30 s). A background task,
//! like Redisson's watchdog, renews every live entry of this client every lease/3 with a
//! script that only extends entries that still exist. A renewal that finds its entry gone,
//! or no successful renewal *sent* within the lease less the Redlock drift allowance (1 %
//! plus 2 ms) and less [`dlock_core::lost_margin`] (max(10 % of the lease, 100 ms)),
//! fires that entry's [`dlock_core::Backend::lost`]: the server extended the key after
//! the renewal was sent, so it cannot expire it before that margin has passed. After
//! every reconnect the watchdog runs a round at once: a Redis restarted without persistence has silently forgotten every key. Removing or
//! abandoning an entry stops its renewal before the delete is sent, and dropping the
//! backend aborts the task, so no renewal outlives a release. A dead client's entries
//! expire by themselves; every listing drops members whose key has expired.
//!
//! # Wake-ups
//! `wait_gone` subscribes to the watched entry's channel first (a fred `SubscriberClient`
//! that re-subscribes after reconnects), then reads the remaining TTL of the entry's key
//! (gone: return) on the same subscriber connection, which speaks RESP3 so that it may
//! run commands besides pub/sub ones: the server answers the check only after the
//! SUBSCRIBE, so a removal the check does not see is published to a subscription in force
//! (fred resolves SUBSCRIBE once it is written; a check on the command connection could
//! overtake it and a removal in between went unheard). Then it
//! waits for the message (on one master it ends the wait without another round trip:
//! only that entry's removal or expiry is published on its channel) or a re-check
//! timer: just after that TTL runs out (an expiry
//! nobody publishes, a dead client's entry) and at the latest after lease/3 (a lost
//! message that no reconnect wake-up covered). So a waiter costs the server nothing while
//! it waits for a live holder, and a lost message or an unpublished expiry only delays it.
//! The remove script also says whether the removed entry was the head of its queue (no
//! other member scored up to its own); on one master a waiter told so holds the lock at
//! once ([`dlock_core::Backend::wait_gone_detail`],
//! [`dlock_core::driver::Snapshot::without_head`]), so a contended handoff is the holder's
//! remove and its message. Otherwise (and always under Redlock) a woken waiter lists only
//! the entries scored up to its own ([`dlock_core::Backend::queue_ahead`]), so a handoff
//! costs the same whatever the queue's length. Concurrent waiters on one channel share one subscription.
//! [`Stats::missed_wakeups`] counts the waits that only the timer ended.
//!
//! # Fencing tokens
//! Each entry gets the lock's last token + 1 from the enqueue script, floored at the server
//! clock in microseconds. The floor keeps tokens growing after the counter is deleted with
//! an idle lock, expires, or is lost in a restart without persistence, *provided the
//! server clock does not step back*. On one master tokens are as safe as the master's persistence and clock;
//! see Redlock for the multi-master case.
//!
//! # Sentinel
//! With [`RedisBackend::connect_sentinel`] the one master is whichever node the Sentinels
//! name: every (re)connection of the command and the subscriber client asks them and
//! checks `ROLE`; a `+switch-master` announcement from any Sentinel (a watcher connection
//! per Sentinel) and a `READONLY` reply (a demoted primary) force a reconnection, so the
//! commands, the watchdog and the pub/sub wake-ups all move to a promoted replica, also
//! when the old primary is still up. While a Sentinel reports the client's primary
//! objectively down (`+odown`) or fails it over (`+try-failover`), and after a switch
//! until both clients are verified on the announced primary, every script waits (up to
//! the command timeout, then `Unreachable`) and a removal message does not grant, so
//! renewals on a primary being replaced do not outlive the entry's copy on the promoted
//! replica. Scripts also wait, after connecting and after any reconnection of either
//! client or of a watcher, until a majority of the Sentinels given answer and the
//! newest configuration among their answers (the highest `config-epoch`) names the
//! primary both clients are on, without flagging it objectively down or being failed
//! over; a script counts only if its reply is read on the very connection checked (by
//! `CLIENT ID`), and an open fence's
//! primary is confirmed that way every second. So a
//! Sentinel that has not heard of a failover does not keep a client on the old primary
//! while one that has answers. List the whole Sentinel group: the majority is of the
//! Sentinels given. What this does not cover (renewals before `+odown` or before the
//! next confirmation, a failover no answering Sentinel has heard of yet) is in
//! [safety.md](https://github.com/dlock-rs/dlock/blob/main/docs/safety.md).
//! [`Stats::primary_switches`] counts the switches. The
//! watchdog's round right after the reconnection fires `lost()` for any held entry the
//! replica never received (replication is asynchronous); a replicated entry keeps its
//! lock. With [`dlock_core::SessionOptions::replicas`] (`?replicas=N`), a grant, a
//! renewal or a proclaim counts only once that many replicas acknowledged it (`WAIT`), so the holder
//! is told before the entry can end on a replica that did. Tokens stay monotonic across the failover through the clock floor, provided the
//! new primary's clock is not behind the old one's by more than the failover took
//! ([safety.md](https://github.com/dlock-rs/dlock/blob/main/docs/safety.md)).
//!
//! # Redis Cluster
//! With [`RedisBackend::connect_cluster`] (seed nodes of the cluster) the command and
//! subscriber clients are fred's cluster clients: one connection per master, each command
//! sent to the master of its first key's slot, `MOVED` and `ASK` followed. Every key and
//! channel of a lock carries the hash tag `{L}`, so one lock lives on one slot, on one
//! master, and behaves there as on one master: the same scripts, tokens, watchdog,
//! FIFO queue and `Gone::Head` handoffs. Locks are spread over the masters by their
//! names; a [`dlock_core::Backend::list_queues`] walks every master (`SCAN` on each).
//!
//! Wake-ups use Redis 7 **sharded pub/sub**: the scripts `SPUBLISH` on the lock's slot
//! and waiters `SSUBSCRIBE` there, so a release reaches only the subscribers of that
//! slot's master (and its replicas) instead of being broadcast over the cluster bus as a
//! plain `PUBLISH` is. fred waits for an `SSUBSCRIBE`'s confirmation, so the waiter's
//! existence check that follows it cannot overtake it. When a slot changes masters (a
//! failover, a migration) the old master drops the slot's sharded subscriptions; after
//! every change of the slot map either client sees, the subscriptions are renewed on
//! the new masters, the waiters re-check, and the watchdog runs a round at once, so a
//! held entry that the promoted replica never received fires `lost()`. A change the
//! clients have not yet seen (nothing of theirs touched the moved slot) is seen at the
//! latest by the next renewal (lease/3) or re-check timer.
//!
//! Fencing tokens stay increasing across a failover as with Sentinel: a token is above
//! the lock's replicated counter and floored at the slot master's clock in
//! microseconds, so a promoted replica that missed the last writes still hands out a
//! larger token, provided its clock is not behind the old master's by more than the
//! failover took.
//!
//! # Redlock
//! In Redlock mode (the algorithm of the Redis docs, as in redsync) an entry is written
//! with the same name on every master, and the enqueue succeeds once a majority took it
//! within its validity time (lease − elapsed − drift, measured with a monotonic clock);
//! otherwise it is taken back everywhere and the call fails with a typed error
//! ([`dlock_core::Error::Unreachable`] when masters are down), never hangs.
//!
//! Queue order is kept consistent across masters by agreeing on the sequence: the client
//! proposes one, and a master accepts it only if it is above every sequence it has handed
//! out (else it refuses and reports its counter, and the client proposes above every
//! counter reported, plus a random offset, after a short random pause, so that contenders
//! that split the masters do not collide again in lockstep; it gives up with
//! [`dlock_core::Error::Backend`] only after 64 proposals or a third of the lease). Every entry therefore has the same
//! sequence on every master that holds it, and any two majorities share a master, so a
//! later entry always sorts behind an earlier live one. A client's view of a queue is the
//! union of the live entries reported by a majority of masters; an entry left on a
//! minority only makes later entries wait until it expires, it never lets two in. The
//! watchdog renews on all masters and fires `lost()` once a majority no longer holds the
//! entry or none was renewed for a lease.
//!
//! **Redlock tokens are not safe fencing tokens.** The token returned is the highest of
//! the per-master counters, which is not linearizable: after a master restart or a
//! partition a later holder can receive a smaller token (Kleppmann, "How to do distributed
//! locking"). Use the ZooKeeper or etcd backend, or one Redis master, where fencing matters.
//!
//! # Failure model in short
//! Clients reconnect forever, at once and then backing off to every 200 ms (10, 20, 40,
//! 80, 160, 200 ms, 10 ms of jitter), so after a restart or failover every client is back
//! within milliseconds and a holder's watchdog check usually fires `lost()` before a
//! waiter is granted the forgotten lock.
//! Commands are never replayed after a reconnect (`max_command_attempts = 1`) and time out
//! after clamp(lease/2, 1 s, 5 s); connection trouble maps to
//! [`dlock_core::Error::Unreachable`], anything else the server says to
//! [`dlock_core::Error::Backend`].

#![deny(missing_docs)]

/// The lock-name rules of Redis: the shared rules, and no `{` or `}`, since the name
/// becomes the hash tag of every key of the lock.
pub const NAME_RULES: dlock_core::NameRules =
    dlock_core::NameRules::common().forbidding(&['{', '}']);

mod backend;
mod connect;
mod keys;
mod node;
mod pubsub;
mod redlock;
mod reply;
mod scripts;
mod tls;
mod watchdog;

pub use backend::{RedisBackend, Stats};
pub use connect::{DEFAULT_LEASE, MIN_LEASE};
/// The client crate this adapter is built on, so that an application handing its own
/// client to [`RedisBackend::from_client`] names the same version.
pub use fred;
pub use scripts::fast_path_lua;

#[cfg(test)]
mod name_rule_tests {
    use dlock_core::{Error, LockName};

    #[test]
    fn braces_are_refused_since_the_name_is_the_hash_tag() {
        assert!(matches!(
            LockName::new("a{b}", crate::NAME_RULES),
            Err(Error::InvalidName { .. })
        ));
        assert!(LockName::new("zookeeper/orders", crate::NAME_RULES).is_ok());
    }
}
