//! Session health: one background task per session turns the client's state changes into
//! one verdict that every operation and every `lost()` future reads.
//!
//! zookeeper-client reports `Expired` only once a server refuses the session, which during
//! a partition may be never (pitfall Z5). So the task also runs Curator's SUSPENDED → LOST
//! timer itself, see [`local_expiry_after`].

use std::collections::HashSet;
use std::sync::{Arc, Weak};
use std::time::Duration;

use dlock_core::{Error, SharedDeadline};
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
    /// Until when a leader has been shown to keep the session (the heartbeat's
    /// [`crate::heartbeat::LeaderLease`]): the heartbeat declares the loss when it runs
    /// past it, and [`Shared::lost_now`] reads it so that a loss is known on time even
    /// where the heartbeat has not been run since (a starved runtime).
    pub(crate) deadline: SharedDeadline,
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
            deadline: SharedDeadline::unset(Instant::now().into_std()),
        }
    }

    /// What a lost future made now would answer at its first poll: the verdict, or a
    /// loss once the leader-proven deadline has passed, whether or not the heartbeat has
    /// run since to conclude it.
    pub(crate) fn lost_now(&self) -> Option<Error> {
        if let Some(e) = self.health.borrow().error() {
            return Some(e);
        }
        self.deadline
            .passed(Instant::now().into_std())
            .then(|| Error::LockLost(crate::heartbeat::UNCONFIRMED.to_owned()))
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
    // A create sent on the connection before the verdict may be committed by the
    // leader but not yet applied by the server this connection reached since: a `sync`
    // first makes the listing show it (a create from the old connection that the leader
    // has not taken yet is refused as `SessionMoved`, never applied later).
    b.client.sync("/").await?;
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
/// given the negotiated session timeout `t` and the connection timeout `c` dlock gave
/// the client (`None`: the application's client, taken to have the crate's default).
///
/// The server expires a session `t` after it last heard from the client. zookeeper-client
/// reports `Disconnected` once its connection has been silent for its connection timeout:
/// `c` when `c` ≤ 0.6·`t`, otherwise (and by default) 0.4·`t`, checked every eighth of
/// that. Waiting the full `t` after `Disconnected`, as Curator does, would declare the
/// loss long *after* another client may already hold the lock; the crate's own expiry
/// (1.4·`t` after the last reply) is later still. Waiting what is left of 0.8·`t`
/// declares it 0.80–0.875·`t` after the last reply: before the server can expire the
/// session, with at least an eighth of `t` left for the last round trip and scheduling
/// delay. A shorter `c` only makes the session `Disconnected` (and the client try
/// another server) sooner, never the loss later or earlier.
pub(crate) fn local_expiry_after(t: Duration, c: Option<Duration>) -> Duration {
    let silent = match c {
        Some(c) if c <= t * 3 / 5 => c,
        _ => t * 2 / 5,
    };
    (t * 4 / 5).saturating_sub(silent)
}

/// zookeeper-client's connection timeout for a session of requested timeout `t`: one
/// attempt's share of the connect timeout ([`dlock_core::SessionOptions::attempt_timeout`]),
/// and never more than the crate's own default of 0.4·`t`.
///
/// The crate gives one server its connection timeout to answer: by default 0.4·`t`, 4 s
/// at the default 10 s, 12 s at 30 s. A server that is down and drops the SYN then held
/// the connect for all of that, and with a 5 s connect timeout the next server was often
/// never tried. The same value is how long a connection may stay silent before the crate
/// reports `Disconnected` (it pings every 3/8 of it); [`local_expiry_after`] accounts
/// for it.
pub(crate) fn connection_timeout(opts: &dlock_core::SessionOptions, t: Duration) -> Duration {
    opts.attempt_timeout().min(t * 2 / 5)
}

/// Watches `states` until the session ends, recording the verdict in `shared`.
pub(crate) async fn watch_session(
    shared: Weak<Shared>,
    mut states: zk::StateWatcher,
    session_timeout: Duration,
    connection_timeout: Option<Duration>,
) {
    let grace = local_expiry_after(session_timeout, connection_timeout);
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
                            "disconnected from ZooKeeper for {grace:?} (0.8 of the \
                             {session_timeout:?} session timeout since the last reply): the \
                             server may expire the session at any moment"
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The grace after `Disconnected` is what is left of 0.8·`t` once the crate noticed
    /// the silence: after `c` when `c` ≤ 0.6·`t` (zookeeper-client's rule), else after
    /// its default 0.4·`t`.
    #[test]
    fn the_grace_is_what_is_left_of_four_fifths_of_the_session() {
        let t = Duration::from_secs(10);
        let ms = Duration::from_millis;
        // The application's client, and a connection timeout the crate ignores.
        assert_eq!(local_expiry_after(t, None), ms(4000));
        assert_eq!(local_expiry_after(t, Some(ms(6001))), ms(4000));
        assert_eq!(local_expiry_after(t, Some(t)), ms(4000));
        // Ones it uses: it notices sooner, the loss is declared at the same moment.
        assert_eq!(local_expiry_after(t, Some(ms(6000))), ms(2000));
        assert_eq!(local_expiry_after(t, Some(ms(4000))), ms(4000));
        assert_eq!(local_expiry_after(t, Some(ms(1667))), ms(6333));
    }

    /// An attempt's share of the connect timeout, capped at the crate's default.
    #[test]
    fn the_connection_timeout_is_an_attempt_capped_at_two_fifths_of_the_session() {
        let o = dlock_core::SessionOptions::default().with_connect_timeout(Duration::from_secs(6));
        assert_eq!(
            connection_timeout(&o, Duration::from_secs(30)),
            Duration::from_secs(2)
        );
        assert_eq!(
            connection_timeout(&o, Duration::from_secs(2)),
            Duration::from_millis(800)
        );
    }
}
