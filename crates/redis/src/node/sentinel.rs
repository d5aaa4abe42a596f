//! Sentinel mode: following the primary the Sentinels name, and the fence that holds
//! scripts back while a failover may have replaced the primary this client is on.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use dlock_core::Error;
use fred::prelude::{Builder, ClientLike, Config, EventInterface, PubsubInterface, ServerConfig};
use fred::types::RespVersion;

use super::{builder, reconnect_policy, resubscribe_on_reconnect, Node, Tuning};

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
        for (host, port) in hosts {
            self.askers.push(asker(&host, port, tuning, config)?);
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
    /// announced) takes locks that another client holds on the new primary. So before
    /// its first script, and after every reconnection of either client to another
    /// server than the one last checked, the fence stays closed until a majority of the
    /// Sentinels given answer and the newest configuration among their answers
    /// ([`newest_primary`]) names the primary both clients are on: then it opens. If it
    /// names another server, the switch follower moves the clients there; if fewer than
    /// a majority answer, they are asked again every 100 ms, doubling up to 2 s.
    fn check_primary(&mut self, service: &str, tuning: Tuning) {
        let a = recheck_on_reconnect(&self.client, "commands", &self.fence, &self.verified);
        let b = recheck_on_reconnect(&self.sub, "subscriber", &self.fence, &self.verified);
        self.watcher_tasks
            .extend([a.abort_handle(), b.abort_handle()]);
        let (fence, client, sub) = (self.fence.clone(), self.client.clone(), self.sub.clone());
        let (askers, verified) = (self.askers.clone(), self.verified.clone());
        let (service, addr) = (service.to_owned(), self.addr.clone());
        let needed = askers.len() / 2 + 1;
        let task = tokio::spawn(async move {
            let mut rx = fence.subscribe();
            let unverified = |f: &Option<Fence>| matches!(f, Some(Fence::Unverified));
            loop {
                while !unverified(&rx.borrow_and_update()) {
                    if rx.changed().await.is_err() {
                        return;
                    }
                }
                let mut pause = Duration::from_millis(100);
                let mut warned = false;
                while unverified(&fence.borrow()) {
                    let (c, s) = (connected_to(&client), connected_to(&sub));
                    if c.is_none() || s.is_none() {
                        // Still (re)connecting: nothing to check yet.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        continue;
                    }
                    let named =
                        newest_primary(&askers, &service, needed, tuning.attempt_timeout).await;
                    let Some(primary) = named else {
                        if !warned {
                            warned = true;
                            tracing::warn!(service = %addr, needed, "fewer than a majority of the Sentinels answered; commands stay held back, asking again");
                        }
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(Duration::from_secs(2));
                        continue;
                    };
                    let (c, s) = (connected_to(&client), connected_to(&sub));
                    if c.as_deref() == Some(primary.as_str())
                        && s.as_deref() == Some(primary.as_str())
                    {
                        *verified.lock() = Some(primary.clone());
                        let opened =
                            fence.send_if_modified(|f| unverified(f).then(|| *f = None).is_some());
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

    /// Sentinel mode: `Err(Unreachable)` unless the command client is connected to the
    /// primary last checked ([`Node::check_primary`]), so that a script that ran
    /// anywhere else, on a connection made after the last check, is not counted (a
    /// renewal or a grant on an old primary would be one nobody else sees). The fence
    /// is closed then, so the next script waits for the check. Always `Ok` outside
    /// Sentinel mode.
    pub(super) fn check_landed(&self, what: &str) -> Result<(), Error> {
        if self.askers.is_empty() {
            return Ok(());
        }
        let at = connected_to(&self.client);
        let checked = self.verified.lock().clone();
        if at.is_some() && at == checked {
            return Ok(());
        }
        if at.is_some() {
            self.fence
                .send_if_modified(|f| f.is_none().then(|| *f = Some(Fence::Unverified)).is_some());
        }
        Err(Error::Unreachable(format!(
            "redis at {} while {what}: the command may have run on {}, not on the primary the Sentinels named ({}); it does not count",
            self.addr,
            at.as_deref().unwrap_or("a connection that dropped"),
            checked.as_deref().unwrap_or("none checked yet"),
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
        let opened = tokio::time::timeout_at(deadline, rx.wait_for(Option::is_none)).await;
        if matches!(opened, Ok(Ok(_))) {
            return Ok(());
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
    /// 2 s) until the clients land on the announced primary or another switch comes.
    pub(super) fn follow_switches(&mut self) {
        let (fence, client, sub) = (self.fence.clone(), self.client.clone(), self.sub.clone());
        let mut rx = fence.subscribe();
        let (addr, verified) = (self.addr.clone(), self.verified.clone());
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
                    let (c, s) = (connected_to(&client), connected_to(&sub));
                    if on(c.clone()) && on(s.clone()) {
                        *verified.lock() = Some(target.clone());
                        let opened =
                            fence.send_if_modified(|f| current(f).then(|| *f = None).is_some());
                        if opened {
                            tracing::info!(service = %addr, primary = %target, "both clients are on the new primary; commands go on");
                        }
                        break;
                    }
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
    pub fn fenced(&self) -> bool {
        self.fence.borrow().is_some()
            || (!self.askers.is_empty()
                && connected_to(&self.sub).as_deref() != self.verified.lock().as_deref())
    }
}

/// The Sentinel channels that close the fence, besides `+switch-master`.
pub(super) const FENCE_CHANNELS: [&str; 3] = ["+odown", "-odown", "+try-failover"];

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
    /// configuration since they connected or last reconnected to another server
    /// ([`Node::check_primary`]).
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

/// The primary (`host:port`) for `service` in the newest configuration (the highest
/// `config-epoch`) among the Sentinels behind `askers`, asked all at once with
/// `SENTINEL MASTER`, each for at most `per` (one not connected counts as no answer at
/// once); `None` unless at least `needed` of them answer.
///
/// The newest, not the most named: the Sentinels that did not lead a failover learn of
/// it from the leader's hello messages (every 2 s), so right after a promotion most of
/// them may still name the old primary, while a Sentinel cut off from the others keeps
/// naming it for good. A failover raises the epoch, and the Sentinels themselves let
/// the higher epoch win.
async fn newest_primary(
    askers: &[fred::prelude::Client],
    service: &str,
    needed: usize,
    per: Duration,
) -> Option<String> {
    let answers = futures::future::join_all(askers.iter().map(|a| async move {
        if !a.is_connected() {
            return None;
        }
        let asked = a.custom::<Vec<String>, _>(
            fred::types::CustomCommand::new_static("SENTINEL", None, false),
            vec!["MASTER", service],
        );
        let fields = tokio::time::timeout(per, asked).await.ok()?.ok()?;
        let field = |name: &str| {
            fields
                .chunks_exact(2)
                .find(|kv| kv[0] == name)
                .map(|kv| kv[1].as_str())
        };
        let epoch: u64 = field("config-epoch")?.parse().ok()?;
        Some((epoch, format!("{}:{}", field("ip")?, field("port")?)))
    }))
    .await;
    let answered: Vec<(u64, String)> = answers.into_iter().flatten().collect();
    if answered.len() < needed {
        return None;
    }
    answered
        .into_iter()
        .max_by_key(|(epoch, _)| *epoch)
        .map(|(_, primary)| primary)
}

/// Closes the fence ([`Fence::Unverified`]) whenever `client` reconnects to another
/// server than the primary last checked ([`Node::check_primary`]).
fn recheck_on_reconnect<C: EventInterface>(
    client: &C,
    which: &'static str,
    fence: &Arc<tokio::sync::watch::Sender<Option<Fence>>>,
    verified: &Arc<parking_lot::Mutex<Option<String>>>,
) -> tokio::task::JoinHandle<fred::prelude::FredResult<()>> {
    let (fence, verified) = (fence.clone(), verified.clone());
    client.on_reconnect(move |server| {
        let (fence, verified) = (fence.clone(), verified.clone());
        async move {
            let at = format!("{}:{}", server.host, server.port);
            if verified.lock().as_deref() != Some(at.as_str()) {
                let closed = fence
                    .send_if_modified(|f| f.is_none().then(|| *f = Some(Fence::Unverified)).is_some());
                if closed {
                    tracing::info!(client = which, server = %at, "reconnected to a server not checked as the primary; holding commands back until the Sentinels confirm it");
                }
            }
            Ok(())
        }
    })
}
