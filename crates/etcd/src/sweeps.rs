//! Sweeps: taking back an entry that a late copy of an enqueue put back after the entry
//! was removed.
//!
//! An enqueue's transaction is retried when an attempt goes unanswered, and an
//! unanswered attempt is not a failed one. A member that forwarded it to a leader that
//! then stopped hands the proposal on when that leader resumes, possibly seconds later,
//! and the new leader applies it: after the retry, and maybe after the entry was granted
//! and released. The put-if-absent then creates the key again, under this client's lease,
//! which is still alive. Nobody holds that entry and nobody will release it; every other
//! contender waits behind it for as long as this client lives (seen in `cargo xtask
//! chaos`, leader-pause on etcd, and in `etcd_late_enqueue_leaves_no_orphan`).
//!
//! So when an entry whose enqueue had an unanswered attempt is removed, a sweep watches
//! its key for as long as the session lives, and deletes exactly (by create revision) any
//! copy of it that appears: a value naming the same ticket, or, for the raw values that
//! name none, a key no contender of this client claims. A late copy cannot land once the
//! lease is gone, so the session's end ends the sweep.
//!
//! An enqueue that gives up its mutex key because a copy kept coming back to it (it
//! deleted one and found another) sweeps that key the same way, once it no longer claims
//! it (`claims.rs`).

use std::sync::atomic::Ordering;
use std::sync::Weak;
use std::time::Duration;

use dlock_core::FencingToken;
use etcd_client::{EventType, GetOptions, KeyValue};

use crate::backend::EtcdBackend;
use crate::claims::Pending;
use crate::layout;

/// At most this many sweeps per client; past it, a removal is not swept (and says so).
/// Each costs one watch on the client's shared stream.
const MAX_SWEEPS: usize = 1024;

impl EtcdBackend {
    /// Starts the sweep of `p`'s key, just removed, if its session is still alive.
    pub(crate) fn sweep_later(&self, p: &Pending, ticket: &str) {
        let Some(session) = self.session_of(p.lease) else {
            return;
        };
        if !session.is_alive() || self.closed.load(Ordering::Acquire) {
            return;
        }
        if self.sweeps.fetch_add(1, Ordering::AcqRel) >= MAX_SWEEPS {
            self.sweeps.fetch_sub(1, Ordering::AcqRel);
            tracing::warn!(key = %p.key, "too many sweeps running; a late copy of this enqueue would not be taken back");
            return;
        }
        tracing::debug!(key = %p.key, ticket, "an attempt of this entry's enqueue went unanswered; sweeping its key while the session lives");
        let lost = session.lost();
        let (me, key, ticket) = (self.me.clone(), p.key.clone(), ticket.to_owned());
        tokio::spawn(async move {
            tokio::select! {
                _ = lost => {}
                () = sweep(me.clone(), &key, &ticket) => {}
            }
            if let Some(b) = me.upgrade() {
                b.sweeps.fetch_sub(1, Ordering::AcqRel);
            }
        });
    }

    /// Deletes `kv` if it is a late copy of `ticket`'s entry under `key`.
    async fn take_back(&self, key: &str, ticket: &str, kv: &KeyValue) {
        if kv.key() != key.as_bytes() {
            return;
        }
        let ours = match layout::decode_value(kv.value()).ticket {
            Some(t) => t == ticket,
            // A raw value names no ticket; the key is this lease's own, so if no
            // contender of this client claims it, nobody does.
            None => !self.claimed(key),
        };
        let Ok(rev) = u64::try_from(kv.create_revision()) else {
            return;
        };
        if !ours {
            return;
        }
        tracing::warn!(
            key,
            token = rev,
            "a late copy of an enqueue put this entry back after its removal; taking it back"
        );
        if let Err(e) = self.remove_exact(key, Some(FencingToken::new(rev))).await {
            tracing::debug!(key, error = %e, "taking back a late entry failed; the sweep goes on");
        }
    }
}

/// Watches `key` and takes back every late copy of `ticket`'s entry, until the backend
/// is closed or dropped (the caller also stops it when the session ends). Holds the
/// backend only while it reads or deletes, never while it waits.
async fn sweep(me: Weak<EtcdBackend>, key: &str, ticket: &str) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let Some(b) = me.upgrade() else { return };
        if b.closed.load(Ordering::Acquire) {
            return;
        }
        // Arm first, then read at or after the watch's start: a copy that lands is then
        // either in the read or reported by the watch.
        let armed = match b.arm(key, false, false).await {
            Ok((watch, rev)) => match b.fresh_get(key, GetOptions::new(), rev).await {
                Ok(read) => {
                    for kv in read.kvs() {
                        b.take_back(key, ticket, kv).await;
                    }
                    Some(watch)
                }
                Err(_) => None,
            },
            Err(_) => None,
        };
        drop(b);
        if let Some(mut watch) = armed {
            backoff = Duration::from_millis(100);
            while let Some(m) = watch.message().await {
                if m.canceled() {
                    break;
                }
                for e in m.events() {
                    if e.event_type() != EventType::Put {
                        continue;
                    }
                    let (Some(kv), Some(b)) = (e.kv(), me.upgrade()) else {
                        continue;
                    };
                    b.take_back(key, ticket, kv).await;
                }
            }
        }
        // The stream broke or the server is away: arm again, from a read.
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}
