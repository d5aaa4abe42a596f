//! The session: one etcd lease per client, kept alive in the background, and the signal
//! that tells every entry on it when it can no longer be trusted.
//!
//! etcd-client's keep-alive stream does not reconnect by itself, and a `message()` on a
//! stream whose server stalled may never return. The keep-alive task therefore re-opens
//! the stream after every failure, bounds every wait with a timeout, and declares the
//! session lost on its own clock: once no keep-alive has been acknowledged for a whole TTL
//! (counted from when the last acknowledged request was *sent*, which is never later than
//! the server's own renewal), the server may have expired the lease, so every entry on it
//! is reported lost before the server can hand its lock to anyone else.

use std::sync::Arc;
use std::time::Duration;

use dlock_core::{Error, SharedDeadline};
use etcd_client::{LeaseClient, LeaseKeepAliveStream, LeaseKeeper};
use tokio::sync::watch;
use tokio::time::{sleep, sleep_until, timeout, Instant};
use tracing::Instrument;

/// What the session is, as every entry on it sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    /// The lease is being renewed.
    Alive,
    /// The lease expired, was revoked, or could not be renewed for a whole TTL.
    Lost(String),
    /// The client closed the session (the lease was revoked on purpose).
    Closed,
}

impl State {
    fn to_error(&self) -> Error {
        match self {
            State::Alive => Error::Closed,
            State::Lost(why) => Error::LockLost(why.clone()),
            State::Closed => Error::Closed,
        }
    }
}

/// One lease and its keep-alive task. Dropping it stops the task, which then revokes the
/// lease (best effort), so a dropped client does not keep its locks for a whole TTL.
#[derive(Debug)]
pub(crate) struct Session {
    id: i64,
    ttl: Duration,
    state: Arc<watch::Sender<State>>,
    /// When the keep-alive task will declare the session lost unless a renewal is
    /// acknowledged first: [`Session::lost_now`] reads it, so a loss is known on time
    /// even where that task has not been run since (a starved runtime).
    deadline: Arc<SharedDeadline>,
    /// Dropped (or sent `true`) to stop the keep-alive task.
    stop: watch::Sender<bool>,
}

impl Session {
    /// Grants a lease of `ttl` (whole seconds, at least one) and starts keeping it alive.
    /// The caller bounds the whole call with its connect timeout.
    pub(crate) async fn start(lease: LeaseClient, ttl: Duration) -> Result<Arc<Self>, Error> {
        let secs = i64::try_from(ttl.as_secs_f64().ceil() as u64)
            .unwrap_or(i64::MAX)
            .max(1);
        let granted_at = Instant::now();
        // Until the connect timeout (the caller's bound): a grant that failed to reach any
        // server was never applied, so trying again cannot leave a second lease.
        let resp = crate::errors::retrying(Duration::from_secs(3600), || {
            let mut lease = lease.clone();
            async move { lease.grant(secs, None).await }
        })
        .await
        .map_err(|e| crate::errors::map("granting the session lease", e))?;
        if !resp.error().is_empty() || resp.ttl() <= 0 {
            return Err(Error::backend(
                "granting the session lease",
                format!("server refused: ttl {} {}", resp.ttl(), resp.error()),
            ));
        }
        let id = resp.id();
        // The server may raise the TTL (to 1.5 x its election timeout); trust its answer.
        let ttl = Duration::from_secs(u64::try_from(resp.ttl()).unwrap_or(1));
        let state = Arc::new(watch::channel(State::Alive).0);
        let (stop, stop_rx) = watch::channel(false);
        let deadline = Arc::new(SharedDeadline::unset(granted_at.into_std()));
        let session = Arc::new(Session {
            id,
            ttl,
            state,
            deadline: deadline.clone(),
            stop,
        });
        let mut task = KeepAlive {
            lease,
            id,
            ttl,
            acked_at: granted_at,
            state: session.state.clone(),
            shared_deadline: deadline,
            stop: stop_rx,
        };
        // The first deadline, before the task first runs (a busy runtime may not get to
        // it soon); none was set, so it cannot have lapsed.
        let _ = task.acked(granted_at);
        let span =
            tracing::debug_span!(parent: None, "etcd.keepalive", lease = format_args!("{id:x}"));
        tokio::spawn(task.run().instrument(span));
        tracing::debug!(
            lease = format_args!("{id:x}"),
            ?ttl,
            "session lease granted"
        );
        Ok(session)
    }

    /// The lease id.
    pub(crate) fn id(&self) -> i64 {
        self.id
    }

    /// The TTL the server granted.
    pub(crate) fn ttl(&self) -> Duration {
        self.ttl
    }

    /// True while the lease is being renewed.
    pub(crate) fn is_alive(&self) -> bool {
        *self.state.borrow() == State::Alive
    }

    /// The error an operation on a session that is no longer alive reports.
    pub(crate) fn dead_error(&self) -> Error {
        self.state.borrow().to_error()
    }

    /// What [`Session::lost`] made now would complete with, read directly (its first
    /// poll may answer `Pending` to a task whose tokio budget is spent).
    ///
    /// A deadline passed is a loss here even before the keep-alive task has run to
    /// declare it: on a starved runtime that task can run long after the server
    /// expired the lease and granted the lock to another client.
    pub(crate) fn lost_now(&self) -> Option<Error> {
        {
            let state = self.state.borrow();
            if *state != State::Alive {
                return Some(state.to_error());
            }
        }
        self.deadline
            .passed(Instant::now().into_std())
            .then(|| Error::LockLost(past_deadline(self.id, self.ttl)))
    }

    /// Completes with the reason once the session is no longer alive.
    pub(crate) fn lost(&self) -> impl std::future::Future<Output = Error> + Send + 'static {
        let mut rx = self.state.subscribe();
        async move {
            match rx.wait_for(|s| *s != State::Alive).await {
                Ok(s) => s.to_error(),
                // The session was dropped with its client: nothing holds the entries now.
                Err(_) => Error::Closed,
            }
        }
    }

    /// Marks the session closed and stops the keep-alive task; the caller revokes the lease.
    pub(crate) fn mark_closed(&self) {
        self.state.send_if_modified(|s| {
            if *s == State::Alive {
                *s = State::Closed;
                true
            } else {
                false
            }
        });
        let _ = self.stop.send(true);
    }
}

/// The keep-alive task's state.
struct KeepAlive {
    lease: LeaseClient,
    id: i64,
    ttl: Duration,
    /// When the last acknowledged keep-alive (or the grant) was sent.
    acked_at: Instant,
    state: Arc<watch::Sender<State>>,
    /// [`KeepAlive::deadline`], for [`Session::lost_now`].
    shared_deadline: Arc<SharedDeadline>,
    stop: watch::Receiver<bool>,
}

/// Why a session whose deadline passed with no renewal acknowledged is lost.
fn past_deadline(id: i64, ttl: Duration) -> String {
    format!(
        "no keep-alive of lease {id:x} was acknowledged within its TTL of {ttl:?} less the \
         {:?} safety margin",
        dlock_core::lost_margin(ttl)
    )
}

/// Why the keep-alive loop ended.
enum End {
    /// Asked to stop by `close`.
    Stopped,
    /// The client was dropped without `close`: revoke the lease on the way out.
    Dropped,
    /// The session is lost, for this reason.
    Lost(String),
}

impl KeepAlive {
    /// A keep-alive sent at `sent` (or the grant) was acknowledged: the deadline moves,
    /// unless it has passed (a reader may already have been told the session is lost:
    /// then it is).
    fn acked(&mut self, sent: Instant) -> Result<(), End> {
        self.acked_at = sent;
        if self
            .shared_deadline
            .extend(self.deadline().into_std(), Instant::now().into_std())
        {
            Ok(())
        } else {
            Err(End::Lost(past_deadline(self.id, self.ttl)))
        }
    }

    fn interval(&self) -> Duration {
        (self.ttl / 3).max(Duration::from_millis(100))
    }

    /// How long one renewal may go unanswered before it is sent again on a fresh stream:
    /// an interval, at least half a second.
    fn answer_wait(&self) -> Duration {
        self.interval().max(Duration::from_millis(500))
    }

    /// When the lost signal fires: [`dlock_core::lost_margin`] before the earliest moment
    /// the server may expire the lease (a whole TTL after the last acknowledged
    /// keep-alive was sent).
    fn deadline(&self) -> Instant {
        self.acked_at + self.ttl.saturating_sub(dlock_core::lost_margin(self.ttl))
    }

    async fn run(mut self) {
        let end = self.keep_alive().await;
        match end {
            End::Stopped => tracing::debug!("keep-alive stopped"),
            End::Dropped => {
                tracing::debug!("client dropped without close; revoking its lease");
                let _ = timeout(self.ttl, self.lease.revoke(self.id)).await;
            }
            End::Lost(why) => {
                // Marked before it is logged: a grant checked while the line is written
                // (a slow stderr takes a while) must already see the session lost.
                self.state.send_if_modified(|s| {
                    if *s == State::Alive {
                        *s = State::Lost(why.clone());
                        true
                    } else {
                        false
                    }
                });
                tracing::warn!(reason = %why, "etcd session lost");
                // The lease may still be alive on the server if only this client was cut
                // off; revoking it frees the locks for others as soon as possible.
                let _ = timeout(self.interval(), self.lease.revoke(self.id)).await;
            }
        }
    }

    /// Waits for `fut`, but no longer than the lease deadline and not past a stop.
    async fn bounded<F: std::future::Future>(&mut self, fut: F) -> Result<F::Output, End> {
        let deadline = self.deadline();
        tokio::select! {
            biased;
            r = self.stop.changed() => Err(match r {
                Ok(()) => End::Stopped,
                Err(_) => End::Dropped,
            }),
            _ = sleep_until(deadline) => Err(End::Lost(past_deadline(self.id, self.ttl))),
            out = fut => Ok(out),
        }
    }

    async fn keep_alive(&mut self) -> End {
        let mut lease = self.lease.clone();
        let mut backoff = Duration::from_millis(50);
        loop {
            let sent = Instant::now();
            // Opening the stream waits for the answer to its first renewal: no longer than
            // a renewal on an open stream waits ([`KeepAlive::answer_wait`]), then again
            // on a fresh stream, which the balancer may send to another member.
            let wait = self.answer_wait();
            let opened = match self.bounded(timeout(wait, lease.keep_alive(self.id))).await {
                Ok(Ok(r)) => r,
                Ok(Err(_elapsed)) => {
                    tracing::debug!(
                        ?wait,
                        "no answer to the keep-alive stream's first renewal; opening another"
                    );
                    continue;
                }
                Err(end) => return end,
            };
            match opened {
                Ok((keeper, stream)) => {
                    // Opening the stream sent a keep-alive and read a positive TTL back.
                    if let Err(end) = self.acked(sent) {
                        return end;
                    }
                    backoff = Duration::from_millis(50);
                    if let Err(end) = self.renew_on(keeper, stream).await {
                        return end;
                    }
                }
                Err(etcd_client::Error::LeaseKeepAliveError(m)) if m.contains("not found") => {
                    return End::Lost(format!("lease {:x} expired or was revoked", self.id));
                }
                Err(e) => {
                    tracing::debug!(error = %e, "opening the keep-alive stream failed");
                }
            }
            // The stream broke: find out whether the lease is still there before retrying.
            let mut lease2 = self.lease.clone();
            match self
                .bounded(timeout(self.interval(), lease2.time_to_live(self.id, None)))
                .await
            {
                Err(end) => return end,
                // etcd answers -1 for a lease it no longer has, and otherwise the time
                // left cut to whole seconds: 0 is a lease with under a second left (or
                // one just expired, which the next renewal finds gone), not a lost one.
                // The deadline still fires on time whatever this says.
                Ok(Ok(Ok(r))) if r.ttl() < 0 => {
                    return End::Lost(format!("lease {:x} expired (ttl {})", self.id, r.ttl()));
                }
                Ok(other) => {
                    tracing::debug!(
                        ok = matches!(other, Ok(Ok(_))),
                        "lease check after a broken keep-alive stream"
                    );
                }
            }
            if let Err(end) = self.bounded(sleep(backoff)).await {
                return end;
            }
            backoff = (backoff * 2).min(self.interval());
        }
    }

    /// Renews every `interval` on one stream until it fails. `Ok` asks for a new stream.
    async fn renew_on(
        &mut self,
        mut keeper: LeaseKeeper,
        mut stream: LeaseKeepAliveStream,
    ) -> Result<(), End> {
        loop {
            self.bounded(sleep(self.interval())).await?;
            let sent = Instant::now();
            if let Err(e) = keeper.keep_alive().await {
                tracing::debug!(error = %e, "keep-alive send failed; re-opening the stream");
                return Ok(());
            }
            let wait = self.answer_wait();
            match self.bounded(timeout(wait, stream.message())).await? {
                Ok(Ok(Some(r))) if r.ttl() > 0 => self.acked(sent)?,
                Ok(Ok(Some(r))) => {
                    return Err(End::Lost(format!(
                        "lease {:x} expired or was revoked (keep-alive ttl {})",
                        self.id,
                        r.ttl()
                    )))
                }
                Ok(Ok(None)) => {
                    tracing::debug!("keep-alive stream ended; re-opening");
                    return Ok(());
                }
                Ok(Err(e)) => {
                    tracing::debug!(error = %e, "keep-alive stream failed; re-opening");
                    return Ok(());
                }
                Err(_) => {
                    tracing::debug!("keep-alive answer timed out; re-opening the stream");
                    return Ok(());
                }
            }
        }
    }
}
