//! Session health: one background task per session turns the client's state changes into
//! one verdict that every operation and every `lost()` future reads.
//!
//! zookeeper-client reports `Expired` only once a server refuses the session, which during
//! a partition may be never (pitfall Z5). So the task also runs Curator's SUSPENDED → LOST
//! timer itself, see [`local_expiry_after`].

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use dlock_core::Error;
use parking_lot::Mutex;
use tokio::sync::watch;
use tokio::time::Instant;
use zookeeper_client as zk;

/// What the adapter knows about its session. Moves only from `Live` to one terminal value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Health {
    /// Connected, or disconnected for less than the local expiry time.
    Live,
    /// The session is gone or can no longer be trusted; the text says why.
    Lost(String),
    /// This process closed the session on purpose.
    Closed,
}

impl Health {
    /// The error an operation reports under this verdict, `None` while live.
    pub(crate) fn error(&self) -> Option<Error> {
        match self {
            Health::Live => None,
            Health::Lost(reason) => Some(Error::LockLost(reason.clone())),
            Health::Closed => Some(Error::Closed),
        }
    }
}

/// State shared by the backend handle, its operations and the session task.
#[derive(Debug)]
pub(crate) struct Shared {
    /// The only long-lived client handle. Taking it out and dropping it closes the session
    /// once in-flight operations (which hold short-lived clones) have ended.
    pub(crate) client: Mutex<Option<Arc<zk::Client>>>,
    /// The verdict; `lost()` futures and operation guards subscribe to it.
    pub(crate) health: watch::Sender<Health>,
    /// Set when the session is the application's ([`crate::ZkBackend::from_client`]):
    /// dropping our handle then does not end it, so what this backend created must be
    /// deleted by hand after a verdict ([`clean_up_after_loss`]).
    pub(crate) borrowed: Option<Borrowed>,
}

/// What a backend on a borrowed session keeps to delete its own entries.
#[derive(Debug, Clone)]
pub(crate) struct Borrowed {
    /// A handle that survives the verdict, used only to delete.
    pub(crate) client: zk::Client,
    /// The tickets of the entries this backend may still have: added before every
    /// create, removed once the entry is deleted.
    pub(crate) tickets: Arc<Mutex<HashSet<String>>>,
}

impl Shared {
    /// `borrowed`: the session is the application's, not ours to end.
    pub(crate) fn new(client: zk::Client, borrowed: bool) -> Self {
        let borrowed = borrowed.then(|| Borrowed {
            client: client.clone(),
            tickets: Arc::default(),
        });
        Shared {
            client: Mutex::new(Some(Arc::new(client))),
            health: watch::Sender::new(Health::Live),
            borrowed,
        }
    }

    /// Notes that an entry with `ticket` may be created (borrowed sessions only).
    pub(crate) fn track(&self, ticket: &str) {
        if let Some(b) = &self.borrowed {
            b.tickets.lock().insert(ticket.to_owned());
        }
    }

    /// Notes that the entry named `name` (or with ticket `name`) is gone.
    pub(crate) fn untrack(&self, name: &str) {
        if let Some(b) = &self.borrowed {
            let ticket = dlock_core::entry::protected_id(name).unwrap_or_else(|| name.to_owned());
            b.tickets.lock().remove(&ticket);
        }
    }

    /// Records a terminal verdict unless one is already recorded (the first cause wins),
    /// and drops the client handle so the session cannot outlive the verdict: a session
    /// declared lost locally must not come back later still holding its entries.
    pub(crate) fn conclude(&self, verdict: Health) {
        let changed = self.health.send_if_modified(|current| {
            if *current == Health::Live {
                *current = verdict.clone();
                true
            } else {
                false
            }
        });
        if changed {
            match &verdict {
                Health::Lost(reason) => tracing::warn!(%reason, "ZooKeeper session lost"),
                _ => tracing::debug!("ZooKeeper session closed"),
            }
        }
        // Dropped outside the lock: the last drop of a client wakes the session task.
        let client = self.client.lock().take();
        drop(client);
        // A borrowed session goes on after our verdict: if it comes back, it must not
        // keep entries whose holders were told they lost them. (On close, `close` deletes
        // them itself.)
        if let (true, Some(b), Health::Lost(_)) = (changed, &self.borrowed, &verdict) {
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(clean_up_after_loss(b.clone()));
            }
        }
    }

    /// The current verdict as an error, `None` while live.
    pub(crate) fn error(&self) -> Option<Error> {
        self.health.borrow().error()
    }
}

/// Deletes the entries of `b`'s tracked tickets that its session still has; returns how
/// many. Lists the session's own ephemerals (one request), so it costs nothing per lock.
pub(crate) async fn remove_tracked(b: &Borrowed) -> Result<usize, zk::Error> {
    if b.tickets.lock().is_empty() {
        return Ok(0);
    }
    let paths = b.client.list_ephemerals("/").await?;
    let mut removed = 0;
    for path in paths {
        let name = path.rsplit('/').next().unwrap_or(&path);
        let Some(ticket) = dlock_core::entry::protected_id(name) else {
            continue;
        };
        if !b.tickets.lock().contains(&ticket) {
            continue;
        }
        match b.client.delete(&path, None).await {
            Ok(()) => removed += 1,
            Err(zk::Error::NoNode) => {}
            Err(e) => return Err(e),
        }
    }
    b.tickets.lock().clear();
    Ok(removed)
}

/// After a local verdict on a borrowed session: once the session is connected again,
/// deletes what this backend left in it. Ends when done, or when the session ends (the
/// server then deletes them). Requests the session queued while disconnected are sent
/// before this one's on reconnection, so a create still in flight is listed too.
pub(crate) async fn clean_up_after_loss(b: Borrowed) {
    let mut states = b.client.state_watcher();
    loop {
        match states.peek_state() {
            zk::SessionState::SyncConnected => match remove_tracked(&b).await {
                Ok(n) => {
                    if n > 0 {
                        tracing::info!(entries = n, "removed the entries the application's ZooKeeper session kept after dlock declared it lost");
                    }
                    return;
                }
                Err(e) if crate::errors::is_connection_loss(&e) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "cannot remove dlock's entries from the application's ZooKeeper session; they stay until it ends");
                    return;
                }
            },
            zk::SessionState::Disconnected | zk::SessionState::ConnectedReadOnly => {}
            _ => return,
        }
        states.changed().await;
    }
}

/// How long the session may stay `Disconnected` before the adapter declares it lost,
/// given the negotiated session timeout `t`.
///
/// The server expires a session `t` after it last heard from the client. zookeeper-client
/// reports `Disconnected` only after 0.4·`t` without a reply (checked every `t`/20), so by
/// then 0.40–0.45·`t` of the server's budget is spent. Waiting the full `t` after
/// `Disconnected`, as Curator does, would declare the loss up to 0.45·`t` *after* another
/// client may already hold the lock; the crate's own expiry (1.4·`t` after the last reply)
/// is later still. Waiting 0.4·`t` declares it 0.80–0.85·`t` after the last reply: before
/// the server can expire the session, with 0.15·`t` left for the last round trip and
/// scheduling delay.
pub(crate) fn local_expiry_after(t: Duration) -> Duration {
    t * 2 / 5
}

/// Watches `states` until the session ends, recording the verdict in `shared`.
pub(crate) async fn watch_session(
    shared: Weak<Shared>,
    mut states: zk::StateWatcher,
    session_timeout: Duration,
) {
    let grace = local_expiry_after(session_timeout);
    let mut suspended_until: Option<Instant> = None;
    // The state the session is in now counts as the first change: it may already have
    // dropped its connection between connect and this task's start.
    let mut pending = Some(states.peek_state());
    loop {
        let state = match (pending.take(), suspended_until) {
            (Some(state), _) => state,
            (None, None) => states.changed().await,
            (None, Some(deadline)) => {
                tokio::select! {
                    state = states.changed() => state,
                    () = tokio::time::sleep_until(deadline) => {
                        let reason = format!(
                            "disconnected from ZooKeeper for {grace:?} (0.4 of the \
                             {session_timeout:?} session timeout): the server may expire the \
                             session at any moment"
                        );
                        if let Some(shared) = shared.upgrade() {
                            shared.conclude(Health::Lost(reason));
                        }
                        return;
                    }
                }
            }
        };
        let verdict = match state {
            zk::SessionState::Disconnected => {
                if suspended_until.is_none() {
                    tracing::warn!(?grace, "ZooKeeper connection lost; session suspended");
                    suspended_until = Some(Instant::now() + grace);
                }
                continue;
            }
            zk::SessionState::SyncConnected | zk::SessionState::ConnectedReadOnly => {
                if suspended_until.take().is_some() {
                    tracing::info!("ZooKeeper connection re-established; session resumed");
                }
                continue;
            }
            zk::SessionState::Expired => Health::Lost("ZooKeeper session expired".into()),
            zk::SessionState::AuthFailed => Health::Lost("ZooKeeper authentication failed".into()),
            zk::SessionState::Closed => Health::Lost("ZooKeeper session closed".into()),
        };
        if let Some(shared) = shared.upgrade() {
            shared.conclude(verdict);
        }
        return;
    }
}
