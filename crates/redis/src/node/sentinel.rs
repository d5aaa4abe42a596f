//! Sentinel mode: following the primary the Sentinels name, and the fence that holds
//! scripts back while a failover may have replaced the primary this client is on.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::Error;
use fred::prelude::{Builder, ClientLike, Config, EventInterface, PubsubInterface, ServerConfig};
use fred::types::RespVersion;

use super::{access_error, builder, reconnect_policy, resubscribe_on_reconnect, Node, Tuning};

impl Node {
    /// Sentinel mode, however the node was built: a failover watch on every Sentinel
    /// given ([`Node::watch_sentinel`]), the switch follower ([`Node::follow_switches`])
    /// and the check that the clients are on the primary of the Sentinels' newest
    /// configuration ([`Node::check_primary`]), with the fence closed until that check passes.
    pub(super) fn watch_sentinels(
        &mut self,
        hosts: Vec<(String, u16)>,
        service: &str,
        tuning: Tuning,
        config: &Config,
    ) -> Result<(), Error> {
        self.fence.send_replace(Some(Fence::Unverified));
        let last = Arc::new(parking_lot::Mutex::new(None::<String>));
        // A Sentinel listed twice would count twice towards the majority.
        let mut seen = std::collections::HashSet::new();
        for (host, port) in hosts {
            if !seen.insert((host.clone(), port)) {
                continue;
            }
            let asker = asker(&host, port, tuning, config)?;
            // Refused credentials or a failed handshake show up here, not as answers.
            self.conn_errors.lock().push(asker.error_rx());
            self.askers.push(asker);
            self.watch_sentinel(host, port, service, tuning, config, last.clone())?;
        }
        for asker in &self.askers {
            self.watcher_tasks.push(asker.connect().abort_handle());
        }
        self.follow_switches();
        self.check_primary(service, tuning);
        Ok(())
    }

    /// Sentinel mode: the task that keeps [`Fence::Unverified`]: fred connects (and
    /// reconnects) to whichever primary the first Sentinel that answers names, and a
    /// Sentinel cut off from the others names the old primary after a failover, which
    /// still answers as a master while it is cut off from the Sentinels too. A client
    /// that lands there with nothing to tell it (it connected after the switch was
    /// announced, or its watchers were reconnecting then) takes locks that another
    /// client holds on the new primary. So before its first script, and after every
    /// reconnection of either client (to any server, the one last checked included: the
    /// Sentinels may have moved the primary while this client was away) or of a Sentinel
    /// watcher (it may have missed the switch), the fence stays closed until a majority
    /// of the Sentinels given answer and the newest configuration among their answers
    /// ([`newest_primary`]) names the primary both clients are on, with no answer
    /// reporting that primary objectively down or being failed over: then it opens. If
    /// it names another server, the switch follower moves the clients there; otherwise
    /// they are asked again every 100 ms, doubling up to 2 s. A reconnection while the
    /// Sentinels are being asked voids their answers. While the fence is open they are
    /// asked again every [`CONFIRM_EVERY`], and an answer that does not confirm the
    /// primary last checked (fewer than a majority, another server, or this one flagged)
    /// closes it: a client whose watchers all missed a failover is not told otherwise.
    fn check_primary(&mut self, service: &str, tuning: Tuning) {
        let (fence, verified, reconnects) = (
            self.fence.clone(),
            self.verified.clone(),
            self.reconnects.clone(),
        );
        let (client, sub) = (self.client.clone(), self.sub.clone());
        // Not on the connection already checked: the switch follower's own
        // reconnections, reported after it opened the fence, and a first connection
        // reported after the check. (A server restart can repeat a `CLIENT ID`: see
        // safety.md.)
        let on_checked = |which: &'static str| {
            let (client, sub, verified) = (client.clone(), sub.clone(), verified.clone());
            move |_first: bool| {
                let checked = verified.lock().clone();
                match which {
                    "commands" => checked.is_some_and(|c| c.has_client(connection(&client))),
                    _ => checked.is_some_and(|c| c.has_sub(connection(&sub))),
                }
            }
        };
        let rechecks = [
            recheck_on_reconnect(
                self.client.reconnect_rx(),
                "commands".into(),
                on_checked("commands"),
                &fence,
                vec![reconnects.clone()],
            ),
            recheck_on_reconnect(
                self.sub.reconnect_rx(),
                "subscriber".into(),
                on_checked("subscriber"),
                &fence,
                vec![reconnects.clone()],
            ),
        ];
        self.watcher_tasks.extend(rechecks);
        let (askers, refusal) = (self.askers.clone(), self.check_refusal.clone());
        let (service, addr) = (service.to_owned(), self.addr.clone());
        let needed = askers.len() / 2 + 1;
        let task = tokio::spawn(async move {
            let mut rx = fence.subscribe();
            let unverified = |f: &Option<Fence>| matches!(f, Some(Fence::Unverified));
            loop {
                while !unverified(&rx.borrow_and_update()) {
                    match tokio::time::timeout(CONFIRM_EVERY, rx.changed()).await {
                        Ok(Ok(())) => continue,
                        Ok(Err(_)) => return,
                        Err(_) if fence.borrow().is_some() => continue,
                        Err(_) => {}
                    }
                    // Open for a while: every watcher may have missed a failover
                    // (cut off without a reset), so ask again.
                    let named =
                        newest_primary(&askers, &service, needed, tuning.attempt_timeout).await;
                    let checked = verified.lock().clone();
                    let confirmed = match &named {
                        Named::Primary(p) => checked.is_some_and(|c| c.primary == *p),
                        Named::TooFew | Named::Failing(_) | Named::Refused(_) => false,
                    };
                    if !confirmed {
                        let closed = fence.send_if_modified(|f| {
                            f.is_none().then(|| *f = Some(Fence::Unverified)).is_some()
                        });
                        if closed {
                            tracing::warn!(service = %addr, why = %named, "the Sentinels no longer confirm the primary this client is on; holding commands back");
                        }
                    }
                }
                let mut pause = Duration::from_millis(100);
                let mut warned = false;
                let since = tokio::time::Instant::now();
                while unverified(&fence.borrow()) {
                    let before = reconnects.load(Ordering::SeqCst);
                    let (c0, s0) = (connection(&client), connection(&sub));
                    if c0.is_none() || s0.is_none() {
                        // Still (re)connecting: nothing to check yet.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    let named =
                        newest_primary(&askers, &service, needed, tuning.attempt_timeout).await;
                    let primary = match named {
                        Named::Primary(p) => p,
                        Named::Refused(e) => {
                            tracing::warn!(service = %addr, error = %e, "a Sentinel refused the primary check");
                            *refusal.lock() = Some(e);
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_secs(2));
                            continue;
                        }
                        inconclusive => {
                            // Not at once: right after connecting, the askers' own
                            // connections are often still being made (an unconnected
                            // asker counts as no answer), and a command line tool would
                            // print the warning on every run; the next tries, 100 ms
                            // apart and doubling, settle it.
                            if !warned && since.elapsed() >= INCONCLUSIVE_WARN_AFTER {
                                warned = true;
                                tracing::warn!(service = %addr, needed, why = %inconclusive, "the Sentinels' answers do not confirm a primary; commands stay held back, asking again");
                            }
                            tokio::time::sleep(pause).await;
                            pause = (pause * 2).min(Duration::from_secs(2));
                            continue;
                        }
                    };
                    let (c, s) = (connection(&client), connection(&sub));
                    if c != c0 || s != s0 {
                        // A connection changed while the Sentinels were asked (fred
                        // reports it only afterwards): their answers may predate it.
                        continue;
                    }
                    let on = |x: &Option<(String, Option<i64>)>| {
                        x.as_ref().is_some_and(|(at, _)| *at == primary)
                    };
                    if on(&c) && on(&s) {
                        let checked = Checked {
                            primary: primary.clone(),
                            client: c.and_then(|(_, id)| id),
                            sub: s.and_then(|(_, id)| id),
                        };
                        // Under the fence's lock, so that a reconnection handler (which
                        // counts first, then closes an open fence) either voids this
                        // check or closes the fence it opens.
                        let opened = fence.send_if_modified(|f| {
                            let current =
                                unverified(f) && reconnects.load(Ordering::SeqCst) == before;
                            if current {
                                *verified.lock() = Some(checked.clone());
                                *f = None;
                            }
                            current
                        });
                        if opened {
                            tracing::debug!(service = %addr, %primary, "the Sentinels' newest configuration names the primary both clients are on");
                        }
                    } else {
                        let moved = fence.send_if_modified(|f| {
                            unverified(f)
                                .then(|| {
                                    *f = Some(Fence::Switching {
                                        target: primary.clone(),
                                        generation: 1,
                                    })
                                })
                                .is_some()
                        });
                        if moved {
                            tracing::warn!(service = %addr, %primary, commands = ?c, subscriber = ?s, "connected elsewhere than the primary of the Sentinels' newest configuration (the Sentinel asked first has not heard of a failover?); reconnecting");
                        }
                    }
                }
            }
        });
        self.watcher_tasks.push(task.abort_handle());
    }

    /// Sentinel mode: `Err(Unreachable)` unless the command client's connection is the
    /// one last checked on the primary ([`Node::check_primary`]), so that a script that
    /// ran anywhere else, or on a newer connection (even to the same server: the
    /// Sentinels may have moved the primary while this client was away), is not
    /// counted: a renewal or a grant on an old primary would be one nobody else sees.
    /// The fence is closed then, so the next script waits for the check. Always `Ok`
    /// outside Sentinel mode.
    pub(super) fn check_landed(&self, what: &str) -> Result<(), Error> {
        if self.askers.is_empty() {
            return Ok(());
        }
        let at = connection(&self.client);
        let checked = self.verified.lock().clone();
        if checked.as_ref().is_some_and(|c| c.has_client(at.clone())) {
            return Ok(());
        }
        if at.is_some() {
            self.fence
                .send_if_modified(|f| f.is_none().then(|| *f = Some(Fence::Unverified)).is_some());
        }
        Err(Error::Unreachable(format!(
            "redis at {} while {what}: the command may have run on {}, not on the connection checked on the primary the Sentinels named ({}); it does not count",
            self.addr,
            at.map_or_else(|| "a connection that dropped".to_owned(), |(a, _)| format!("another connection to {a}")),
            checked.map_or_else(|| "none checked yet".to_owned(), |c| c.primary),
        )))
    }

    /// Sentinel mode: waits until [`Node::check_primary`] has opened the fence after
    /// connecting, or `deadline` passes.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when the fence is still closed at `deadline` (fewer than a
    /// majority of the Sentinels answered, the clients are not yet on the primary they
    /// name, or a failover is under way).
    pub(super) async fn wait_checked(&self, deadline: tokio::time::Instant) -> Result<(), Error> {
        let mut rx = self.fence.subscribe();
        loop {
            // In slices, to report a refusal (credentials, an ACL without `SENTINEL
            // MASTER`) as soon as a Sentinel gives one.
            let slice = (tokio::time::Instant::now() + Duration::from_millis(50)).min(deadline);
            let opened = tokio::time::timeout_at(slice, rx.wait_for(Option::is_none)).await;
            if matches!(opened, Ok(Ok(_))) {
                return Ok(());
            }
            if let Some(refusal) = self.refused() {
                return Err(refusal);
            }
            if let Some(typed) = self.check_refusal.lock().as_ref().and_then(access_error) {
                return Err(typed);
            }
            if tokio::time::Instant::now() >= deadline {
                break;
            }
        }
        let why = self
            .fence
            .borrow()
            .as_ref()
            .map_or_else(|| "closed".to_owned(), ToString::to_string);
        Err(Error::Unreachable(format!("redis at {}: {why}", self.addr)))
    }

    /// Subscribes to `+switch-master`, `+odown` and `-odown` on one Sentinel and keeps
    /// the node's fence ([`Fence`]) by what they say about `service`:
    /// - `+odown` of the primary this client is on closes the fence: the Sentinels may
    ///   be promoting a replica, and whatever this client does on the old primary from
    ///   then on (a renewal that extends a hold, a grant) may never reach the new one,
    ///   which would expire the hold on its own clock and let another client in;
    /// - `-odown` of that primary hands it to the primary check (no failover took
    ///   place, unless another Sentinel carries one on);
    /// - `+switch-master` keeps it closed until both clients are verified on the
    ///   announced primary ([`Node::follow_switches`] reconnects them).
    ///
    /// Without the switch a client stays on a primary that the Sentinels replaced but
    /// that is still up (a manual `SENTINEL FAILOVER`, or a primary cut off from the
    /// Sentinels): it keeps answering as a master until the Sentinels demote it, and
    /// meanwhile new clients are sent to the new primary — two holders of one lock.
    /// Every Sentinel publishes the switch; `last` keeps the three from reconnecting
    /// three times for one switch. The watcher reaches the Sentinel with `base`'s TLS
    /// settings and credentials.
    pub(super) fn watch_sentinel(
        &mut self,
        host: String,
        port: u16,
        service: &str,
        tuning: Tuning,
        base: &Config,
        last: Arc<parking_lot::Mutex<Option<String>>>,
    ) -> Result<(), Error> {
        let config = Config {
            server: ServerConfig::new_centralized(host.clone(), port),
            fail_fast: false,
            version: RespVersion::RESP2,
            ..base.clone()
        };
        let mut b = Builder::from_config(config);
        b.with_connection_config(|c| {
            c.connection_timeout = tuning.attempt_timeout;
            c.internal_command_timeout = tuning.command_timeout;
            c.max_command_attempts = 1;
        })
        .set_policy(reconnect_policy());
        let watcher = b.build_subscriber_client().map_err(|e| {
            Error::backend(
                format!("configuring a Sentinel watcher for {host}:{port}"),
                e,
            )
        })?;
        // fred reports only "failed to connect to all sentinel nodes" on the clients that go
        // through the Sentinels; the watcher's own errors say why (WRONGPASS, a
        // certificate), so the connect listens to them too.
        self.conn_errors.lock().push(watcher.error_rx());
        // A watcher that was away may have missed a switch: check the primary again.
        // (Not on its first connection: the primary check that opens the fence runs
        // after the Sentinels are asked anyway, and the next confirmation covers a
        // switch between it and this watcher's subscription.)
        self.watcher_tasks.push(recheck_on_reconnect(
            watcher.reconnect_rx(),
            format!("watcher of sentinel {host}:{port}"),
            |first| first,
            &self.fence,
            vec![self.reconnects.clone(), self.watcher_reconnects.clone()],
        ));
        self.watcher_tasks.push(watcher.connect().abort_handle());
        self.watcher_tasks.push(resubscribe_on_reconnect(
            &watcher,
            format!("sentinel {host}:{port}"),
            true,
        ));
        let mut rx = watcher.message_rx();
        let (w, client) = (watcher.clone(), self.client.clone());
        let (service, switches) = (service.to_owned(), self.switches.clone());
        let (watching, fence) = (self.watching.clone(), self.fence.clone());
        let task = tokio::spawn(async move {
            use tokio::sync::broadcast::error::RecvError;
            // Subscribe once connected; the managed subscription is renewed after every
            // reconnection of the watcher.
            while !w.is_connected() {
                let _ =
                    tokio::time::timeout(Duration::from_millis(100), w.wait_for_connect()).await;
            }
            // fred reports SUBSCRIBE done once written, not once the Sentinel processed
            // it; that gap is far below the seconds a failover takes. (A confirming PING
            // is not used here: on this connection it can be answered by the error of the
            // re-subscription that fred sends at the same moment.)
            // One channel per SUBSCRIBE: a Sentinel's ACL that allows only
            // `+switch-master` refuses a SUBSCRIBE naming any other channel as a whole.
            match w.subscribe("+switch-master").await {
                Ok(()) => watching.send_modify(|n| *n += 1),
                Err(e) => {
                    tracing::warn!(sentinel = %format!("{host}:{port}"), error = %e, "cannot watch the Sentinel for failovers")
                }
            }
            for channel in FENCE_CHANNELS {
                if let Err(e) = w.subscribe(channel).await {
                    tracing::warn!(sentinel = %format!("{host}:{port}"), %channel, error = %e, "cannot hear this Sentinel's failover starts; a switch is still followed");
                }
            }
            loop {
                let msg = match rx.recv().await {
                    Ok(m) => m,
                    Err(RecvError::Lagged(_)) => continue,
                    Err(RecvError::Closed) => return,
                };
                let text = msg.value.as_string().unwrap_or_default();
                let mut words = text.split(' ');
                let channel = msg.channel.to_string();
                if channel != "+switch-master" {
                    // "master <service> <ip> <port> [#quorum q/n]"
                    if words.next() != Some("master") || words.next() != Some(service.as_str()) {
                        continue;
                    }
                    let (Some(ip), Some(port)) = (words.next(), words.next()) else {
                        continue;
                    };
                    let down = format!("{ip}:{port}");
                    // Only the primary this client is on (or none: a reconnect could land
                    // there) concerns it.
                    let ours = || connected_to(&client).is_none_or(|on| on == down);
                    if channel == "+odown" && ours() {
                        let closed = fence.send_if_modified(|f| {
                            matches!(f, None | Some(Fence::Unverified))
                                .then(|| *f = Some(Fence::Down(down.clone())))
                                .is_some()
                        });
                        if closed {
                            tracing::warn!(%service, primary = %down, "a Sentinel reports the primary down; holding commands back until it is up again or the failover is followed");
                        }
                    } else if channel == "+try-failover" && ours() {
                        // Also a manual `SENTINEL FAILOVER`, which no `+odown` announces.
                        let closed = fence.send_if_modified(|f| {
                            matches!(f, None | Some(Fence::Unverified | Fence::Down(_)))
                                .then(|| *f = Some(Fence::Failover(down.clone())))
                                .is_some()
                        });
                        if closed {
                            tracing::warn!(%service, primary = %down, "the Sentinels started a failover; holding commands back until it is followed");
                        }
                    } else if channel == "-odown" {
                        // Opened by the primary check: one Sentinel's `-odown` while
                        // others carry a failover on does not let commands go on.
                        let opened = fence.send_if_modified(|f| {
                            (*f == Some(Fence::Down(down.clone())))
                                .then(|| *f = Some(Fence::Unverified))
                                .is_some()
                        });
                        if opened {
                            tracing::info!(%service, primary = %down, "a Sentinel sees the primary up again; commands go on once the Sentinels' newest configuration names it");
                        }
                    }
                    continue;
                }
                // "<service> <old ip> <old port> <new ip> <new port>"
                if words.next() != Some(service.as_str()) {
                    continue;
                }
                let new_primary = words.skip(2).collect::<Vec<_>>().join(":");
                {
                    let mut seen = last.lock();
                    if seen.as_deref() == Some(new_primary.as_str()) {
                        continue;
                    }
                    *seen = Some(new_primary.clone());
                }
                switches.fetch_add(1, Ordering::Relaxed);
                tracing::info!(%service, primary = %new_primary, "Sentinel switched the primary; reconnecting");
                fence.send_modify(|f| {
                    let generation = match f {
                        Some(Fence::Switching { generation, .. }) => *generation + 1,
                        _ => 1,
                    };
                    *f = Some(Fence::Switching {
                        target: new_primary.clone(),
                        generation,
                    });
                });
            }
        });
        self.watcher_tasks.push(task.abort_handle());
        self.watchers.push(watcher);
        Ok(())
    }

    /// Sentinel mode: the task that follows each `+switch-master` ([`Fence::Switching`]):
    /// it makes both clients reconnect (fred asks the Sentinels, in the order given, for
    /// the primary) and opens the fence once both are connected to the announced
    /// primary. A Sentinel that has not heard of the failover (cut off from the others,
    /// or slow) names the old primary, which still answers as a master if only the
    /// Sentinels lost it: then the clients are not where the Sentinels put the primary,
    /// so the fence stays closed, commands fail as unreachable and holds run out at
    /// their deadlines, and the reconnect is tried again (every 100 ms, doubling up to
    /// 2 s) until the clients land on the announced primary or another switch comes; after
    /// [`FENCE_VALVE`] without landing there (that primary may have failed in turn, its
    /// switch lost) the fence is handed to the primary check.
    pub(super) fn follow_switches(&mut self) {
        let (fence, client, sub) = (self.fence.clone(), self.client.clone(), self.sub.clone());
        let mut rx = fence.subscribe();
        let (addr, verified) = (self.addr.clone(), self.verified.clone());
        let watcher_reconnects = self.watcher_reconnects.clone();
        let task = tokio::spawn(async move {
            loop {
                let (target, generation) = loop {
                    let now = rx.borrow_and_update().clone();
                    match now {
                        Some(Fence::Switching { target, generation }) => {
                            break (target, generation)
                        }
                        Some(closed @ (Fence::Down(_) | Fence::Failover(_))) => {
                            // A failover start with neither its end nor `-odown` heard
                            // (a watcher reconnecting at that moment misses them) would
                            // hold everything back for good: give up after a while.
                            if let Ok(changed) =
                                tokio::time::timeout(FENCE_VALVE, rx.changed()).await
                            {
                                if changed.is_err() {
                                    return;
                                }
                                continue;
                            }
                            let opened = fence.send_if_modified(|f| {
                                (f.as_ref() == Some(&closed))
                                    .then(|| *f = Some(Fence::Unverified))
                                    .is_some()
                            });
                            if opened {
                                tracing::warn!(service = %addr, fence = %closed, "no failover followed within {FENCE_VALVE:?}; commands go on once the Sentinels' newest configuration names the primary this client is on");
                            }
                        }
                        // Open, or the primary check's to open.
                        None | Some(Fence::Unverified) => {
                            if rx.changed().await.is_err() {
                                return;
                            }
                        }
                    }
                };
                let current = |f: &Option<Fence>| matches!(f, Some(Fence::Switching { generation: g, .. }) if *g == generation);
                let mut pause = Duration::from_millis(100);
                let mut warned = false;
                let on = |c: Option<String>| c.as_deref() == Some(target.as_str());
                let started = tokio::time::Instant::now();
                let heard = watcher_reconnects.load(Ordering::SeqCst);
                loop {
                    // Only a client that is not there yet: fred asks the Sentinels in
                    // the order of the last `SENTINEL SENTINELS` answer, so moving one
                    // already on the target could send it back to a stale Sentinel.
                    let (c_on, s_on) = (on(connected_to(&client)), on(connected_to(&sub)));
                    let _ = futures::join!(
                        async {
                            if !c_on {
                                let _ = client.force_reconnection().await;
                            }
                        },
                        async {
                            if !s_on {
                                let _ = sub.force_reconnection().await;
                            }
                        }
                    );
                    if !current(&fence.borrow()) {
                        break;
                    }
                    let (c, s) = (connection(&client), connection(&sub));
                    let (c_at, s_at) = (
                        c.as_ref().map(|(a, _)| a.clone()),
                        s.as_ref().map(|(a, _)| a.clone()),
                    );
                    if on(c_at.clone()) && on(s_at.clone()) {
                        let checked = Checked {
                            primary: target.clone(),
                            client: c.and_then(|(_, id)| id),
                            sub: s.and_then(|(_, id)| id),
                        };
                        // A watcher that was away meanwhile may have missed a later
                        // switch: then the Sentinels decide ([`Node::check_primary`]).
                        let missed = watcher_reconnects.load(Ordering::SeqCst) != heard;
                        let opened = fence.send_if_modified(|f| {
                            let now = current(f);
                            if now && missed {
                                *f = Some(Fence::Unverified);
                            } else if now {
                                *verified.lock() = Some(checked.clone());
                                *f = None;
                            }
                            now
                        });
                        if opened && !missed {
                            tracing::info!(service = %addr, primary = %target, "both clients are on the new primary; commands go on");
                        }
                        break;
                    }
                    if started.elapsed() >= FENCE_VALVE {
                        // The announced primary may have failed in turn with its own
                        // switch lost: let the check find the newest configuration.
                        let handed = fence.send_if_modified(|f| {
                            current(f).then(|| *f = Some(Fence::Unverified)).is_some()
                        });
                        if handed {
                            tracing::warn!(service = %addr, announced = %target, "not on the announced primary after {FENCE_VALVE:?}; asking the Sentinels for their newest configuration");
                        }
                        break;
                    }
                    let (c, s) = (c_at, s_at);
                    if !warned {
                        warned = true;
                        tracing::warn!(service = %addr, announced = %target, commands = ?c, subscriber = ?s, "reconnected elsewhere than the primary the Sentinels announced (a Sentinel asked first has not heard of the failover?); commands stay held back, retrying");
                    }
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
            }
        });
        self.watcher_tasks.push(task.abort_handle());
    }

    /// Waits, up to the command timeout, while the fence is closed (see [`Fence`]); an
    /// open fence (always, outside Sentinel mode) costs one read of it.
    ///
    /// # Errors
    /// [`Error::Unreachable`] when it stays closed for the whole timeout.
    pub(super) async fn pass_fence(&self, what: &str) -> Result<(), Error> {
        let why = match &*self.fence.borrow() {
            None => return Ok(()),
            Some(f) => f.to_string(),
        };
        let mut rx = self.fence.subscribe();
        let budget = self.cmd.timeout.unwrap_or(Duration::from_secs(5));
        let opened = matches!(
            tokio::time::timeout(budget, rx.wait_for(Option::is_none)).await,
            Ok(Ok(_))
        );
        if opened {
            Ok(())
        } else {
            Err(Error::Unreachable(format!(
                "redis at {} while {what}: {why}",
                self.addr
            )))
        }
    }

    /// Whether the fence is closed now (see [`Fence`]): a message heard on the
    /// subscriber may come from a primary the Sentinels are replacing, so it is not
    /// taken as the answer.
    ///
    /// In Sentinel mode the subscriber's connection must also be the one last checked
    /// on the primary ([`Node::check_primary`]): a newer one, even to the same server,
    /// may have carried messages from a server the Sentinels replaced.
    pub fn fenced(&self) -> bool {
        let closed = self.fence.borrow().is_some();
        closed
            || (!self.askers.is_empty()
                && !self
                    .verified
                    .lock()
                    .as_ref()
                    .is_some_and(|c| c.has_sub(connection(&self.sub))))
    }
}

/// The Sentinel channels that close the fence, besides `+switch-master`.
pub(super) const FENCE_CHANNELS: [&str; 3] = ["+odown", "-odown", "+try-failover"];

/// How long the primary check may stay inconclusive (too few Sentinels answering, or
/// answers flagging the primary) before it warns.
const INCONCLUSIVE_WARN_AFTER: Duration = Duration::from_secs(1);

/// How often an open fence's primary is confirmed again with the Sentinels
/// ([`Node::check_primary`]): a client whose watchers all missed a failover (cut off
/// from the Sentinels that carried it without a reset, so nothing reconnects) learns of
/// it within this much once most of the Sentinels it reaches know. Each confirmation
/// costs one `SENTINEL MASTER` per Sentinel.
pub(super) const CONFIRM_EVERY: Duration = Duration::from_secs(1);

/// How long a fence closed by `+odown` or `+try-failover` stays closed when neither
/// `-odown` nor `+switch-master` comes: a failover takes seconds once it starts
/// (`down-after-milliseconds` has passed by then), so this is only for a lost message.
pub(super) const FENCE_VALVE: Duration = Duration::from_secs(30);

/// Why a Sentinel-mode node holds its scripts back ([`Node::pass_fence`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Fence {
    /// A Sentinel reported the primary this client is on (`host:port`) objectively
    /// down: a failover may be promoting a replica. `-odown` hands it to the primary
    /// check ([`Fence::Unverified`]).
    Down(String),
    /// A Sentinel started a failover of that primary (`+try-failover`, also sent for a
    /// manual `SENTINEL FAILOVER`); only the switch opens it, or [`FENCE_VALVE`] hands it
    /// to the primary check.
    Failover(String),
    /// The Sentinels switched the primary to `target` (`host:port`); the clients are
    /// not yet verified on it. `generation` counts switches, so that the reconnect loop
    /// of an older one stops.
    Switching { target: String, generation: u64 },
    /// The clients have not been found on the primary of the Sentinels' newest
    /// configuration since either of them or a watcher last (re)connected, or the last
    /// confirmation did not find them there ([`Node::check_primary`]).
    Unverified,
}

impl std::fmt::Display for Fence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Fence::Down(p) => write!(
                f,
                "the Sentinels report the primary {p} down; held back until it is up again or the failover is followed"
            ),
            Fence::Failover(p) => write!(
                f,
                "the Sentinels are failing over the primary {p}; held back until the failover is followed"
            ),
            Fence::Switching { target, .. } => write!(
                f,
                "the Sentinels moved the primary to {target}; this client is not connected to it yet"
            ),
            Fence::Unverified => write!(
                f,
                "this client is not yet confirmed on the primary of the Sentinels' newest configuration"
            ),
        }
    }
}

/// The server `client` is connected to, as `host:port`, or `None` while it has no
/// connection.
pub(super) fn connected_to<C: ClientLike>(client: &C) -> Option<String> {
    client
        .active_connections()
        .first()
        .map(|s| format!("{}:{}", s.host, s.port))
}

/// A plain client of the Sentinel at `host:port`, with `base`'s TLS settings and
/// credentials, to ask it for the primary ([`newest_primary`]).
fn asker(
    host: &str,
    port: u16,
    tuning: Tuning,
    base: &Config,
) -> Result<fred::prelude::Client, Error> {
    let config = Config {
        server: ServerConfig::new_centralized(host, port),
        fail_fast: false,
        version: RespVersion::RESP2,
        database: None,
        ..base.clone()
    };
    builder(config, tuning).build().map_err(|e| {
        Error::backend(
            format!("configuring a Sentinel client for {host}:{port}"),
            e,
        )
    })
}

/// What the Sentinels' answers to the primary check ([`newest_primary`]) say.
#[derive(Debug)]
enum Named {
    /// The primary (`host:port`) of the newest configuration among a majority.
    Primary(String),
    /// Fewer than a majority answered.
    TooFew,
    /// An answer reports the newest configuration's primary (`host:port`) objectively
    /// down or being failed over: the leader of that failover may have promoted a
    /// replica already, unreachable from here, with the others not yet told.
    Failing(String),
    /// Fewer than a majority answered, and a Sentinel refused the question
    /// (credentials, ACL).
    Refused(fred::error::Error),
}

impl std::fmt::Display for Named {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Named::Primary(p) => write!(f, "the primary is {p}"),
            Named::TooFew => write!(f, "fewer than a majority of the Sentinels answered"),
            Named::Failing(p) => write!(
                f,
                "a Sentinel reports the primary {p} down or being failed over"
            ),
            Named::Refused(e) => write!(f, "a Sentinel refused: {e}"),
        }
    }
}

/// The primary for `service` in the newest configuration (the highest `config-epoch`)
/// among the Sentinels behind `askers`, asked all at once with `SENTINEL MASTER`, each
/// for at most `per` (one not connected counts as no answer at once); not a primary
/// unless at least `needed` of them answer and none of those naming it flags it
/// `o_down` or `failover_in_progress`.
///
/// The newest, not the most named: the Sentinels that did not lead a failover learn of
/// it from the leader's hello messages (every 2 s), so right after a promotion most of
/// them may still name the old primary, while a Sentinel cut off from the others keeps
/// naming it for good. A failover raises the epoch, and the Sentinels themselves let
/// the higher epoch win. Those that agreed the old primary is down flag it so until
/// they hear of the promotion, which is why a flagged answer is not taken.
async fn newest_primary(
    askers: &[fred::prelude::Client],
    service: &str,
    needed: usize,
    per: Duration,
) -> Named {
    let answers = futures::future::join_all(askers.iter().map(|a| async move {
        if !a.is_connected() {
            return None;
        }
        let asked = a.custom::<Vec<String>, _>(
            fred::types::CustomCommand::new_static("SENTINEL", None, false),
            vec!["MASTER", service],
        );
        let fields = match tokio::time::timeout(per, asked).await.ok()? {
            Ok(fields) => fields,
            Err(e) => return access_error(&e).map(|_| Err(e)),
        };
        let field = |name: &str| {
            fields
                .chunks_exact(2)
                .find(|kv| kv[0] == name)
                .map(|kv| kv[1].as_str())
        };
        let epoch: u64 = field("config-epoch")?.parse().ok()?;
        let failing = field("flags")?
            .split(',')
            .any(|f| f == "o_down" || f == "failover_in_progress");
        Some(Ok((
            epoch,
            format!("{}:{}", field("ip")?, field("port")?),
            failing,
        )))
    }))
    .await;
    // A refusal counts as no answer: it is the verdict only when it is why fewer
    // than a majority answered.
    let mut answered = Vec::new();
    let mut refused = None;
    for a in answers.into_iter().flatten() {
        match a {
            Ok(a) => answered.push(a),
            Err(e) => refused = refused.or(Some(e)),
        }
    }
    match (pick(&answered, needed), refused) {
        (Named::TooFew, Some(e)) => Named::Refused(e),
        (named, _) => named,
    }
}

/// [`newest_primary`]'s verdict on the answers, each `(config-epoch, host:port,
/// flagged o_down or failover_in_progress)`.
fn pick(answered: &[(u64, String, bool)], needed: usize) -> Named {
    if answered.len() < needed {
        return Named::TooFew;
    }
    let Some((_, primary, _)) = answered.iter().max_by_key(|(epoch, _, _)| *epoch).cloned() else {
        return Named::TooFew;
    };
    if answered
        .iter()
        .any(|(_, p, failing)| *p == primary && *failing)
    {
        return Named::Failing(primary);
    }
    Named::Primary(primary)
}

/// Sentinel mode: the primary both clients were found on by the primary check or the
/// switch follower, and their connections there, by the `CLIENT ID` the server gave
/// each (fred asks it on every connection).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Checked {
    pub(super) primary: String,
    pub(super) client: Option<i64>,
    pub(super) sub: Option<i64>,
}

impl Checked {
    /// Whether `conn` ([`connection`]) is the command client's checked connection.
    pub(super) fn has_client(&self, conn: Option<(String, Option<i64>)>) -> bool {
        conn.is_some_and(|(at, id)| at == self.primary && id == self.client)
    }

    /// Whether `conn` ([`connection`]) is the subscriber's checked connection.
    pub(super) fn has_sub(&self, conn: Option<(String, Option<i64>)>) -> bool {
        conn.is_some_and(|(at, id)| at == self.primary && id == self.sub)
    }
}

/// The server of `client`'s last connection (`host:port`) and that connection's `CLIENT
/// ID` there, or `None` before its first connection or while it is being replaced. IDs
/// grow on a server (until it restarts), so a new connection to the same server is told
/// from the old one. fred keeps a dropped connection listed until the next one is made,
/// which errs on the safe side: any later connection has another ID. fred lists a
/// connection only once the server gave its `CLIENT ID`, so Sentinel mode needs an ACL
/// that allows it (it is in `@connection`).
pub(super) fn connection<C: ClientLike + fred::prelude::ClientInterface>(
    client: &C,
) -> Option<(String, Option<i64>)> {
    let before = client.connection_ids();
    let at = connected_to(client)?;
    let after = client.connection_ids();
    (before == after).then(|| (at, after.values().next().copied()))
}

/// Closes an open fence ([`Fence::Unverified`]) on every reconnection `reconnects`
/// reports, but those `skip` (told whether it is the first) says to leave alone, and
/// counts the others in each of `counts`. A lagging receiver counts as a reconnection, and the task lives as long as
/// the client (fred's own listener ends on the first lag).
fn recheck_on_reconnect(
    mut reconnects: tokio::sync::broadcast::Receiver<fred::types::config::Server>,
    which: String,
    skip: impl Fn(bool) -> bool + Send + 'static,
    fence: &Arc<tokio::sync::watch::Sender<Option<Fence>>>,
    counts: Vec<Arc<std::sync::atomic::AtomicU64>>,
) -> tokio::task::AbortHandle {
    use tokio::sync::broadcast::error::RecvError;
    let fence = fence.clone();
    tokio::spawn(async move {
        let mut first = true;
        loop {
            let at = match reconnects.recv().await {
                Ok(server) => format!("{}:{}", server.host, server.port),
                Err(RecvError::Lagged(_)) => "a server (events lagged)".to_owned(),
                Err(RecvError::Closed) => return,
            };
            if skip(std::mem::take(&mut first)) {
                continue;
            }
            for c in &counts {
                c.fetch_add(1, Ordering::SeqCst);
            }
            let closed = fence
                .send_if_modified(|f| f.is_none().then(|| *f = Some(Fence::Unverified)).is_some());
            if closed {
                tracing::info!(client = %which, server = %at, "reconnected; holding commands back until the Sentinels confirm the primary");
            }
        }
    })
    .abort_handle()
}

#[cfg(test)]
mod tests {
    use super::{pick, Named};

    fn a(epoch: u64, at: &str, flagged: bool) -> (u64, String, bool) {
        (epoch, at.to_owned(), flagged)
    }

    #[test]
    fn the_newest_configuration_wins_over_the_most_named() {
        let answers = [
            a(3, "old:1", false),
            a(3, "old:1", false),
            a(4, "new:1", false),
        ];
        assert!(matches!(pick(&answers, 2), Named::Primary(p) if p == "new:1"));
    }

    #[test]
    fn fewer_than_needed_is_no_verdict() {
        assert!(matches!(pick(&[a(4, "new:1", false)], 2), Named::TooFew));
        assert!(matches!(pick(&[], 1), Named::TooFew));
    }

    #[test]
    fn a_flagged_primary_is_not_confirmed() {
        // The leader that promoted a replica is not among the answers; the others
        // flag the old primary down until they hear of the promotion.
        let answers = [a(3, "old:1", true), a(3, "old:1", false)];
        assert!(matches!(pick(&answers, 2), Named::Failing(p) if p == "old:1"));
        // A stale flag on an older configuration's primary does not matter.
        let answers = [a(3, "old:1", true), a(4, "new:1", false)];
        assert!(matches!(pick(&answers, 2), Named::Primary(p) if p == "new:1"));
    }
}
