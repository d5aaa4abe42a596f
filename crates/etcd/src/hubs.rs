//! Queue watches kept armed between waits: one per client and queue, shared by the
//! client's waiters on that queue (`wait_gone_tracking_once` in `waits.rs`).
//!
//! Why: a watch armed for one wait is often left *unsynced* by etcd 3.4. The server reads
//! its revision before it registers the watcher, and when a write lands in between (on a
//! busy queue, often) the watcher starts behind and is caught up by a loop that runs
//! every 100 ms, so the delete it waits for can reach it that late. Waiters cover that
//! with re-reads every 5 ms for the first 55 ms; measured on W2 (8 workers, one name, one
//! etcd), 226 of 3,725 wakes (6 %) still came from a re-read, each up to 5 ms late on the
//! handoff chain, and without the re-reads W2 ran at less than half its rate. A watch
//! that stays armed is caught up once and from then on sent each event as it is
//! committed (unless the server's buffer for the stream fills, which a waiter's
//! once-per-TTL re-read still covers), and a waiter that joins it costs no watch create,
//! no cancel and no re-read.
//!
//! What a subscriber may rely on: every message of the watch that the hub passes on
//! after [`Hub::subscribe`] returns reaches it, in order, and every event of a revision
//! above the `covered` revision `subscribe` returned comes in such a message (a message's
//! events are never above its header's revision, and etcd sends a watcher's events in
//! revision order). So a read at or above `covered`, plus the messages, shows every
//! change: exactly what a watch armed before the read gives. When the watch ends
//! (stream broken, cancelled by the server) every subscriber's feed closes and the hub
//! is forgotten; the next waiter arms a new one.
//!
//! The read need not be the waiter's own: the client's enqueue transactions read the
//! whole queue anyway, and offer that read to the queue's hub ([`Hub::offer`]); a
//! subscriber gets the newest one if its revision is at or above `covered` (the feed
//! then holds every change after it), and uses it if it shows the entry waited on (an
//! older read would say that entry is gone). A W2 wait then costs the server nothing but
//! the enqueue it follows: 3.0 -> 2.1 server requests per lock.
//!
//! A hub nobody subscribed to for a while ([`LINGER`] to twice that) cancels its watch:
//! an idle client does not keep receiving a busy queue's deletes.

use std::collections::HashMap;
use std::sync::{Arc, Weak};
use std::time::Duration;

use etcd_client::{GetResponse, WatchResponse};
use tokio::sync::mpsc;
use tokio::time::Instant;

use crate::reads::header_rev;
use crate::watches::Watch;

/// How long a hub without subscribers keeps its watch: at least this, at most twice.
/// A worker that takes the same lock again within it joins the armed watch.
pub(crate) const LINGER: Duration = Duration::from_secs(2);

type HubMap = parking_lot::Mutex<HashMap<String, Arc<Hub>>>;

/// The client's hubs, by queue prefix.
pub(crate) type Hubs = Arc<HubMap>;

/// One armed whole-queue watch (deletes only) and its subscribers.
pub(crate) struct Hub {
    /// When the watch was armed: the server may have left it unsynced for a while.
    pub(crate) armed_at: Instant,
    /// The revision the watch starts after (its `created` answer's header).
    pub(crate) watch_rev: i64,
    state: parking_lot::Mutex<State>,
}

struct State {
    /// The highest header revision of a message passed on so far (at first
    /// `watch_rev`).
    covered: i64,
    /// The newest read of the whole queue this client's enqueue transactions made, with
    /// the transaction's revision ([`Hub::offer`]).
    snapshot: Option<(i64, Arc<GetResponse>)>,
    subs: Vec<mpsc::UnboundedSender<Arc<WatchResponse>>>,
    /// Whether someone subscribed since the last idle check.
    used: bool,
    /// The watch ended or was let go: nobody may subscribe any more.
    dead: bool,
}

/// What [`Hub::subscribe`] gives.
pub(crate) struct Joined {
    pub(crate) sub: Sub,
    /// Every event above this revision comes through `sub`.
    pub(crate) covered: i64,
    /// A read of the whole queue at a revision at or above `covered`, if one was offered.
    pub(crate) snapshot: Option<(i64, Arc<GetResponse>)>,
}

/// A subscriber's feed: the hub's messages from its subscription on.
pub(crate) struct Sub {
    rx: mpsc::UnboundedReceiver<Arc<WatchResponse>>,
}

impl Sub {
    /// The next message, or `None` once the watch has ended.
    pub(crate) async fn message(&mut self) -> Option<Arc<WatchResponse>> {
        self.rx.recv().await
    }
}

impl Hub {
    /// Starts a hub on a `watch` armed just now (its `created` answer already read, at
    /// `watch_rev`) and returns it with its first subscriber; the hub is registered
    /// under `key` unless another is there already.
    pub(crate) fn start(
        hubs: &Hubs,
        key: String,
        watch: Watch,
        watch_rev: i64,
    ) -> (Arc<Hub>, Joined) {
        let hub = Arc::new(Hub {
            armed_at: Instant::now(),
            watch_rev,
            state: parking_lot::Mutex::new(State {
                covered: watch_rev,
                snapshot: None,
                subs: Vec::new(),
                used: true,
                dead: false,
            }),
        });
        let (tx, rx) = mpsc::unbounded_channel();
        hub.state.lock().subs.push(tx);
        {
            // Registered unless a live hub is there already (two first waiters armed at
            // once: the other's serves the next waiters, this one its own until idle).
            let mut map = hubs.lock();
            if map.get(&key).is_none_or(|h| h.state.lock().dead) {
                map.insert(key.clone(), hub.clone());
            }
        }
        tokio::spawn(run(hub.clone(), watch, Arc::downgrade(hubs), key));
        let joined = Joined {
            sub: Sub { rx },
            covered: watch_rev,
            snapshot: None,
        };
        (hub, joined)
    }

    /// Joins the hub: the feed, the `covered` revision (see the module docs) and, if the
    /// newest [`offer`](Self::offer)ed read of the queue is at or above it, that read
    /// with its revision: with the feed it shows every change, as a read made now
    /// would. `None` if the watch has ended.
    pub(crate) fn subscribe(&self) -> Option<Joined> {
        let mut s = self.state.lock();
        if s.dead {
            return None;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        s.subs.push(tx);
        s.used = true;
        let snapshot = s.snapshot.clone().filter(|(rev, _)| *rev >= s.covered);
        Some(Joined {
            sub: Sub { rx },
            covered: s.covered,
            snapshot,
        })
    }

    /// Offers a read of the whole queue made at revision `rev` (an enqueue
    /// transaction's, which reads the queue anyway) to later subscribers; the newest
    /// is kept.
    pub(crate) fn offer(&self, rev: i64, read: GetResponse) {
        let mut s = self.state.lock();
        if s.snapshot.as_ref().is_none_or(|(kept, _)| *kept < rev) {
            s.snapshot = Some((rev, Arc::new(read)));
        }
    }

    /// Ends every feed; nobody can subscribe after this.
    fn kill(&self) {
        let mut s = self.state.lock();
        s.dead = true;
        s.subs.clear();
    }
}

/// Passes the watch's messages on until it ends or the hub has been idle a while, then
/// drops the watch, which cancels it on the server.
async fn run(hub: Arc<Hub>, mut watch: Watch, hubs: Weak<HubMap>, key: String) {
    // However this task ends (its runtime may shut down under it), the hub dies with it,
    // so no waiter stays subscribed to a feed that nothing fills.
    let _ending = Ending {
        hub: hub.clone(),
        hubs,
        key,
    };
    let mut idle_check = tokio::time::interval_at(Instant::now() + LINGER, LINGER);
    idle_check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            m = watch.message() => {
                let Some(m) = m else { break };
                let m = Arc::new(m);
                let mut s = hub.state.lock();
                s.covered = s.covered.max(header_rev(m.header()));
                s.subs.retain(|tx| tx.send(m.clone()).is_ok());
                if m.canceled() {
                    break;
                }
            }
            _ = idle_check.tick() => {
                let mut s = hub.state.lock();
                s.subs.retain(|tx| !tx.is_closed());
                if s.subs.is_empty() && !s.used {
                    break;
                }
                s.used = false;
            }
        }
    }
}

/// Kills the hub (every feed ends) and forgets it, if it is still the registered one.
struct Ending {
    hub: Arc<Hub>,
    hubs: Weak<HubMap>,
    key: String,
}

impl Drop for Ending {
    fn drop(&mut self) {
        // Dead before it leaves the map: a waiter that finds it there and cannot
        // subscribe arms a new one.
        self.hub.kill();
        if let Some(hubs) = self.hubs.upgrade() {
            let mut map = hubs.lock();
            if map
                .get(&self.key)
                .is_some_and(|h| Arc::ptr_eq(h, &self.hub))
            {
                map.remove(&self.key);
            }
        }
    }
}
