//! Pub/sub wake-ups: the channels waiters listen on (shared per channel, subscribed once,
//! unsubscribed in batches), message dispatch, and the waiters' re-check timers.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use fred::prelude::Value;
use futures::future::join_all;
use parking_lot::Mutex;
use tokio::sync::Notify;
use tracing::{debug, warn};

use crate::backend::Shared;

/// How long after an entry key's expiry its watcher re-checks it (server and client
/// clocks tick apart; a re-check that finds the key still there just waits again).
const GONE_MARGIN: Duration = Duration::from_millis(5);

/// How long a channel left without waiters stays subscribed, so that the channels of
/// many waits share one UNSUBSCRIBE. A listener that comes back meanwhile reuses it.
const UNSUBSCRIBE_BATCH: Duration = Duration::from_millis(20);

/// One pub/sub channel some waiters of this client listen on.
#[derive(Debug)]
pub(crate) struct Chan {
    waiters: usize,
    notify: Arc<Notify>,
    /// A message arrived on the channel (not just a reconnect wake-up). On a gone-channel
    /// that means the entry is gone: names are never reused, and only its removal or
    /// expiry is published there.
    heard: Arc<AtomicBool>,
    /// The message said the entry went as the head of its queue (`removed head`: see the
    /// remove script). Set before `heard`.
    head: Arc<AtomicBool>,
    /// The entry the message named behind the removed head, live at that moment
    /// (`removed head <name>`). Set before `heard`.
    next: Arc<Mutex<Option<String>>>,
    /// Set once the channel's SUBSCRIBE went out: `true` if it was also confirmed then.
    ready: Arc<tokio::sync::OnceCell<bool>>,
}

impl Shared {
    pub(crate) fn dispatch(&self, channel: &str, payload: &Value) {
        let chan = self.chans.lock().get(channel).map(|c| {
            (
                c.notify.clone(),
                c.heard.clone(),
                c.head.clone(),
                c.next.clone(),
            )
        });
        if let Some((n, heard, head, next)) = chan {
            self.counters.messages.fetch_add(1, Ordering::Relaxed);
            // A removal message lets a waiter skip its listing (one master only), so
            // it counts as one only if the subscriber is on the connection checked on
            // the primary (Sentinel mode: see `Node::fenced`). Judged here, as fred
            // hands it over, not when the waiter reads it, by which time the subscriber
            // may be back on the checked primary while the message came from
            // elsewhere. (fred queues messages briefly before this; one queued from an
            // unchecked connection that is checked by the time it is handed over
            // counts.)
            let trusted = || self.mode == crate::backend::Mode::Single && !self.nodes[0].fenced();
            if let Some(p) = payload.as_str().filter(|_| trusted()) {
                if let Some(rest) = p.strip_prefix("removed head") {
                    if let Some(behind) = rest.strip_prefix(' ') {
                        *next.lock() = Some(behind.to_owned());
                    }
                    head.store(true, Ordering::SeqCst);
                }
            }
            heard.store(true, Ordering::SeqCst);
            n.notify_waiters();
        }
    }

    /// Waits for a message on the waiter's channel or the re-check timer; true if the
    /// timer ended the wait.
    pub(crate) async fn wait_notified(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
    ) -> bool {
        self.wait_notified_for(notified, self.recheck).await
    }

    /// Waits for a message on the waiter's channel or the timer given; true if the timer
    /// ended the wait.
    pub(crate) async fn wait_notified_for(
        &self,
        notified: std::pin::Pin<&mut tokio::sync::futures::Notified<'_>>,
        timer: Duration,
    ) -> bool {
        tokio::select! {
            _ = notified => false,
            _ = tokio::time::sleep(timer) => true,
        }
    }

    /// When a `wait_gone` re-checks an entry whose key has `ttl_ms` left (-1: no TTL):
    /// just after the key expires, and at the latest after lease/3.
    pub(crate) fn gone_recheck(&self, ttl_ms: i64) -> Duration {
        let period = self.lease / 3;
        match u64::try_from(ttl_ms) {
            Ok(ms) => period.min(Duration::from_millis(ms) + GONE_MARGIN),
            Err(_) => period,
        }
    }

    /// Counts a wait that ended on a timer re-check as a missed wake-up.
    pub(crate) fn count_recheck(&self, by_timer: bool) {
        if by_timer {
            self.counters.missed_wakeups.fetch_add(1, Ordering::Relaxed);
            debug!("a waiter's message never came; its re-check timer found the change");
        }
    }

    pub(crate) fn wake_all_waiters(&self) {
        for c in self.chans.lock().values() {
            c.notify.notify_waiters();
        }
    }

    /// Registers a waiter on `channel`. With `confirm`, returns once the channel is
    /// subscribed on every master that answered (a master that did not is covered by the
    /// re-check timer); without, once the SUBSCRIBE is sent, and the caller's next command
    /// on the subscriber connection confirms it ([`Node::pttl_after_subscribe`](crate::node::Node::pttl_after_subscribe)).
    pub(crate) async fn listen(self: &Arc<Self>, channel: &str, confirm: bool) -> Listener {
        let (notify, heard, head, next, ready) = {
            let mut chans = self.chans.lock();
            let c = chans.entry(channel.to_owned()).or_insert_with(|| Chan {
                waiters: 0,
                notify: Arc::new(Notify::new()),
                heard: Arc::new(AtomicBool::new(false)),
                head: Arc::new(AtomicBool::new(false)),
                next: Arc::new(Mutex::new(None)),
                ready: Arc::new(tokio::sync::OnceCell::new()),
            });
            c.waiters += 1;
            (
                c.notify.clone(),
                c.heard.clone(),
                c.head.clone(),
                c.next.clone(),
                c.ready.clone(),
            )
        };
        let listener = Listener {
            shared: self.clone(),
            channel: channel.to_owned(),
            notify,
            heard,
            head,
            next,
        };
        let confirmed = *ready
            .get_or_init(|| async {
                // SUBSCRIBE is sent under the lock (so a late UNSUBSCRIBE of the same
                // channel never overtakes it) and confirmed outside it: waiters arming
                // many channels at once share round trips instead of queueing one each.
                let sent = {
                    let _ops = self.sub_ops.lock().await;
                    join_all(self.nodes.iter().map(|n| n.subscribe(channel))).await
                };
                let results = self
                    .gather(self.nodes.iter().zip(sent).map(|(n, sent)| async move {
                        sent?;
                        if confirm {
                            n.confirm_subscriptions().await?;
                        }
                        Ok(())
                    }))
                    .await;
                for r in results {
                    match r {
                        Ok(()) => {
                            self.counters.subscribes.fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => {
                            warn!(%channel, error = %e, "subscribe failed; falling back to the re-check timer")
                        }
                    }
                }
                confirm
            })
            .await;
        if confirm && !confirmed {
            // Another waiter subscribed the channel without confirming it (it confirms
            // with its own next command on the subscriber connection), and this one may
            // send its first command on the command connection: confirm here, or that
            // command could overtake the SUBSCRIBE and a message sent between the two
            // would be missed.
            let results = self
                .gather(self.nodes.iter().map(|n| n.confirm_subscriptions()))
                .await;
            for e in results.into_iter().filter_map(Result::err) {
                warn!(%channel, error = %e, "confirming a subscription failed; falling back to the re-check timer");
            }
        }
        listener
    }

    fn unlisten(self: &Arc<Self>, channel: String) {
        let last = {
            let mut chans = self.chans.lock();
            match chans.get_mut(&channel) {
                Some(c) => {
                    c.waiters = c.waiters.saturating_sub(1);
                    c.waiters == 0
                }
                None => false,
            }
        };
        if !last {
            return;
        }
        // Channels left without waiters are unsubscribed in batches, one UNSUBSCRIBE per
        // master for all that piled up during UNSUBSCRIBE_BATCH: a gone-channel serves
        // one wait, so one command per wait would otherwise follow every handoff.
        let Ok(h) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let first = {
            let mut idle = self.idle_chans.lock();
            idle.push(channel);
            idle.len() == 1
        };
        if !first {
            return;
        }
        let shared = self.clone();
        h.spawn(async move {
            tokio::time::sleep(UNSUBSCRIBE_BATCH).await;
            let _ops = shared.sub_ops.lock().await;
            let batch = std::mem::take(&mut *shared.idle_chans.lock());
            // A channel someone listens on again keeps its subscription (and its Chan).
            let gone: Vec<String> = {
                let mut chans = shared.chans.lock();
                batch
                    .into_iter()
                    .filter(|ch| match chans.get(ch) {
                        Some(c) if c.waiters == 0 => {
                            chans.remove(ch);
                            true
                        }
                        _ => false,
                    })
                    .collect()
            };
            if !gone.is_empty() && !shared.closed.load(Ordering::SeqCst) {
                for r in join_all(shared.nodes.iter().map(|n| n.unsubscribe_all(&gone))).await {
                    if let Err(e) = r {
                        debug!(channels = gone.len(), error = %e, "unsubscribe failed");
                    }
                }
            }
        });
    }
}

/// A waiter's registration on a channel; unsubscribes when the last one goes.
pub(crate) struct Listener {
    shared: Arc<Shared>,
    channel: String,
    pub(crate) notify: Arc<Notify>,
    pub(crate) heard: Arc<AtomicBool>,
    pub(crate) head: Arc<AtomicBool>,
    pub(crate) next: Arc<Mutex<Option<String>>>,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.shared.unlisten(std::mem::take(&mut self.channel));
    }
}
