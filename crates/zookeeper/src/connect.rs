//! Opening a ZooKeeper session: the connect string and chroot, the negotiated timeout and
//! its safety rule, the session watcher and the leader heartbeat.

use std::sync::Arc;

use dlock_core::{Error, Result, SessionOptions};
use futures::FutureExt as _;
use zookeeper_client as zk;

use crate::backend::{ZkBackend, DEFAULT_SESSION_TIMEOUT};
use crate::errors::{connect_error, map_err};
use crate::session::{connection_timeout, watch_session, Shared};
use crate::ZkOptions;

/// Why a ZooKeeper backend refuses [`SessionOptions::replicas`].
pub(crate) const ZK_QUORUM: &str =
    "ZooKeeper answers a write only once a quorum of its servers has it, whatever the setting";

/// How often `from_client` takes its proof again when the connection changed during it,
/// before it gives up: each retry needs another reconnection within one proof.
const PROOF_ATTEMPTS: usize = 4;

impl ZkBackend {
    /// Connects to ZooKeeper with the default [`ZkOptions`].
    ///
    /// `connect_string` is `host:port[,host:port...][/chroot]`, as for the Java client. A
    /// chroot that does not exist yet is created (as persistent nodes). The session asks
    /// for [`SessionOptions::session_timeout`], or [`DEFAULT_SESSION_TIMEOUT`].
    ///
    /// Must be called inside a tokio runtime: a task watching the session is spawned.
    ///
    /// # Errors
    /// - [`Error::Unreachable`] if no server answered within
    ///   [`SessionOptions::connect_timeout`].
    /// - [`Error::InvalidUrl`] if the connect string or chroot is malformed.
    /// - [`Error::Backend`] if the chroot could not be created.
    pub async fn connect(connect_string: &str, opts: SessionOptions) -> Result<Arc<ZkBackend>> {
        Self::connect_with(connect_string, opts, ZkOptions::default()).await
    }

    /// Connects like [`ZkBackend::connect`], with adapter-specific options.
    ///
    /// # Errors
    /// As [`ZkBackend::connect`].
    pub async fn connect_with(
        connect_string: &str,
        opts: SessionOptions,
        zk_opts: ZkOptions,
    ) -> Result<Arc<ZkBackend>> {
        let (hosts, chroot) = split_chroot(connect_string);
        if hosts.trim().is_empty() {
            return Err(Error::InvalidUrl {
                url: connect_string.to_owned(),
                reason: "no ZooKeeper host given".into(),
            });
        }
        let timeout = opts.session_timeout_or(DEFAULT_SESSION_TIMEOUT);
        // The leader created the session after this: it lives at least a session timeout
        // from here (the heartbeat's first proof).
        let requested = tokio::time::Instant::now();
        let acls = crate::security::acls(&opts);
        let attempt = connection_timeout(&opts, timeout);
        let (connector, tls) = crate::security::configure(
            zk::Client::connector()
                .with_session_timeout(timeout)
                .with_connection_timeout(attempt),
            &opts,
        )?;
        let connecting = async move {
            if tls {
                connector.secure_connect(hosts).await
            } else {
                connector.connect(hosts).await
            }
        };
        let connected = match tokio::time::timeout(opts.connect_limit(), connecting).await {
            Err(_elapsed) => Err(Error::Unreachable(format!(
                "no ZooKeeper server of {hosts:?} answered within {:?}",
                opts.connect_limit()
            ))),
            Ok(Err(err)) => Err(connect_error(connect_string, err)),
            Ok(Ok(client)) => Ok(client),
        };
        let client = match connected {
            Ok(client) => client,
            // zookeeper-client retries a failed handshake without saying why.
            Err(Error::Unreachable(why)) if opts.tls.is_some() => {
                return Err(crate::security::diagnose_unreachable(hosts, &opts, why).await)
            }
            Err(e) => return Err(e),
        };

        let conf = {
            let hosts = hosts.to_owned();
            let tls = opts.tls.as_ref().and_then(crate::security::client_config);
            tokio::task::spawn_blocking(move || {
                let named: Vec<String> = hosts
                    .split(',')
                    .map(|h| {
                        let h = h.trim();
                        let h = h
                            .trim_start_matches("tcp+tls://")
                            .trim_start_matches("tcp://");
                        // ZooKeeper's default port, as the client assumes it.
                        if h.contains(':') {
                            h.to_owned()
                        } else {
                            format!("{h}:2181")
                        }
                    })
                    .collect();
                crate::heartbeat::probe_conf(&named, tls.as_ref())
            })
            .await
            .unwrap_or_default()
        };
        // The larger of a stated and a probed tick: one stated too small would make the
        // heartbeat's pair gap shorter than the leader's PING period, and prove touches
        // the leader never heard of.
        let tick = match (zk_opts.tick_time, conf.map(|c| c.tick)) {
            (Some(stated), Some(probed)) => {
                if stated != probed {
                    tracing::warn!(
                        stated = ?stated,
                        probed = ?probed,
                        "ZkOptions::tick_time differs from the servers' tickTime: using the larger"
                    );
                }
                Some(stated.max(probed))
            }
            (stated, probed) => stated.or(probed),
        };
        let negotiated = client.session_timeout();
        match conf {
            None if zk_opts.tick_time.is_some() => tracing::warn!(
                session_timeout = ?negotiated,
                "no ZooKeeper server answered `conf` (4lw.commands.whitelist), so the adapter \
                 cannot check the ensemble's syncLimit: make sure the session timeout is at \
                 least 2 x syncLimit x tickTime, or a follower cut off from its leader costs \
                 every session behind it"
            ),
            None => tracing::warn!(
                session_timeout = ?negotiated,
                "no ZooKeeper server answered `conf` (add it to 4lw.commands.whitelist, or set \
                 ZkOptions::tick_time): assuming tickTime is half the session timeout, so the \
                 lost signal will also fire on leader elections and reconnections; and make \
                 sure the session timeout is at least 2 x syncLimit x tickTime of the \
                 ensemble, or a follower cut off from its leader costs every session behind it"
            ),
            Some(c) if !crate::heartbeat::session_outlasts_follower_detection(negotiated, &c) => {
                tracing::warn!(
                    session_timeout = ?negotiated,
                    follower_detection = ?c.follower_detection,
                    "the negotiated ZooKeeper session timeout is shorter than 2 x syncLimit x \
                     tickTime: a follower cut off from its leader serves its clients for \
                     syncLimit x tickTime while the leader may expire their sessions, so every \
                     such partition will cost the session and its locks (the lost signal \
                     still fires before the leader can grant them elsewhere); ask for a \
                     session timeout of at least 2 x syncLimit x tickTime, or lower syncLimit \
                     (and raise maxSessionTimeout if the server caps the request)"
                );
            }
            Some(_) => {}
        }
        let client = match chroot {
            None => client,
            Some(root) => {
                let rooted = client.clone().chroot(root).map_err(|_| Error::InvalidUrl {
                    url: connect_string.to_owned(),
                    reason: format!("invalid chroot {root:?}"),
                })?;
                let persistent = zk::CreateMode::Persistent.with_acls(acls);
                let mkdir = client.mkdir(root, &persistent);
                match tokio::time::timeout(opts.connect_limit(), mkdir).await {
                    Ok(Ok(())) => {}
                    Ok(Err(err)) => return Err(map_err("creating the chroot", err)),
                    Err(_elapsed) => {
                        return Err(Error::Unreachable(format!(
                            "creating the chroot {root:?} took longer than {:?}",
                            opts.connect_limit()
                        )))
                    }
                }
                rooted
            }
        };

        Ok(Self::assemble(
            client,
            requested,
            tick,
            Some(attempt),
            acls,
            None,
        ))
    }

    /// Builds the backend on the application's own zookeeper-client session (bring your
    /// own client): every entry is an ephemeral node of that session, under its chroot.
    ///
    /// **Who owns what.** The session stays the application's: dlock never closes it.
    /// Because dropping dlock's handle then does not end it, dlock deletes what it made by
    /// hand: [`Backend::close`] deletes every entry of this backend (it waits for the
    /// server), and after a lost verdict (the session was cut off too long to be
    /// trusted, see the crate docs) dlock deletes them as soon as the session is
    /// connected again, so a session that comes back does not keep locks whose holders
    /// were told they lost them. `opts` is read only for its connect timeout; the
    /// session's timeout, TLS, authentication and chroot are the client's.
    ///
    /// **Access control.** If the session has authenticated with digest credentials
    /// (`Connector::with_auth("digest", ..)`), the nodes dlock creates get "creator: all,
    /// world: read", as with credentials in a URL; otherwise "anyone: all".
    ///
    /// **What dlock needs of the session.** A server of ZooKeeper 3.6 or later (it lists
    /// the session's own ephemerals to clean up). dlock cannot see the client's servers,
    /// so it cannot ask them for `tickTime`: set [`ZkOptions::tick_time`], or dlock
    /// assumes half the session timeout (safe, but the lost signal then also fires on
    /// leader elections). The lost signal needs a proof that the session is live on the
    /// leader, `sync`s every sixteenth of the session timeout until one is sent a pair gap
    /// (two ticks, at most half the session timeout) after the first completed, over one
    /// connection: this call waits that long (at least a sixteenth of the session), and
    /// again if the client reconnected meanwhile.
    ///
    /// # Errors
    /// [`Error::Unreachable`] if the session is not connected, a `sync` is not answered
    /// within `opts.connect_timeout`, the proof took so long that its deadline passed, or
    /// the client reconnected during each of four proofs; [`Error::LockLost`] if the
    /// session has expired, was closed or failed authentication, before or during the
    /// proof.
    ///
    /// [`Backend::close`]: dlock_core::Backend::close
    pub async fn from_client(
        client: zk::Client,
        opts: SessionOptions,
        zk_opts: ZkOptions,
    ) -> Result<Arc<ZkBackend>> {
        opts.refuse_replicas(ZK_QUORUM)?;
        let t = client.session_timeout();
        let state = client.state();
        if let Some(e) = unprovable(state) {
            return Err(e);
        }
        if state == zk::SessionState::Disconnected {
            return Err(not_read_write());
        }
        let limit = opts.connect_limit();
        let users = within(
            limit,
            "listing the session's identities",
            client.list_auth_users(),
        )
        .await?;
        let acls = crate::security::acls_for(users.iter().any(|u| u.scheme() == "digest"));
        // Prove the session live on the leader: two completed syncs a pair gap apart
        // (see `heartbeat`), so the first one's send time starts the lost signal's clock.
        // Both must go over one connection: a pair across a reconnection proves nothing
        // (the heartbeat forgets every sync at a change of state for the same reason),
        // so a pair the connection changed during is sent again. The syncs go every
        // heartbeat interval, not just two, and all of them seed the heartbeat: with a
        // pair gap of half the session (no tick known), a heartbeat starting from none
        // could prove nothing newer before the first deadline, 0.85 of the session after
        // the first sync, and declared the session lost there.
        let gap = crate::heartbeat::pair_gap(t, zk_opts.tick_time);
        let every = crate::heartbeat::interval(t);
        let mut attempts = 0;
        let (first, proof, states) = loop {
            let mut states = client.state_watcher();
            let first = tokio::time::Instant::now();
            let syncs = async {
                within(limit, "proving the session", client.sync("/")).await?;
                let mut proof = vec![(first, tokio::time::Instant::now())];
                loop {
                    let (last, _) = proof[proof.len() - 1];
                    tokio::time::sleep_until(last + every).await;
                    let sent = tokio::time::Instant::now();
                    within(limit, "proving the session", client.sync("/")).await?;
                    proof.push((sent, tokio::time::Instant::now()));
                    // Counted from the first sync's completion, not its send (see
                    // `heartbeat`).
                    if sent >= proof[0].1 + gap {
                        return Ok::<_, Error>(proof);
                    }
                }
            }
            .await;
            // A sync that failed because the connection changed is a proof to take again;
            // any other failure is the caller's.
            let changed = states.changed().now_or_never().is_some();
            match syncs {
                Ok(proof) if !changed => break (first, proof, states),
                Err(e) if !changed => return Err(e),
                _ => {}
            }
            // A proof sent while the client reconnects would be thrown away at the
            // reconnection: wait for it (bounded; a client still disconnected then fails
            // the next attempt's sync within the same limit).
            let mut now = client.state_watcher();
            let mut state = now.state();
            if state == zk::SessionState::Disconnected {
                if let Ok(s) = tokio::time::timeout(limit, now.changed()).await {
                    state = s;
                }
            }
            // The change may have been the session's end: that is a loss, not a server
            // out of reach, and no attempt after it can prove anything. A read-only
            // reconnection cannot prove it either, as at the start.
            if let Some(e) = unprovable(state) {
                return Err(e);
            }
            attempts += 1;
            if attempts == PROOF_ATTEMPTS {
                return Err(Error::Unreachable(format!(
                    "the connection to ZooKeeper changed during each of {PROOF_ATTEMPTS} \
                     attempts to prove the session at the leader"
                )));
            }
            tracing::info!(
                attempt = attempts,
                "the connection changed while the session was being proven; proving again"
            );
        };
        // Syncs slow enough to take the proof past the deadline it proves would hand out
        // a backend lost at birth.
        let mut lease = crate::heartbeat::LeaderLease::new(t, gap, first);
        for (sent, completed) in &proof {
            lease.confirmed(*sent, *completed);
        }
        if lease.deadline() <= tokio::time::Instant::now() {
            return Err(Error::Unreachable(format!(
                "ZooKeeper answered the syncs that prove the session too slowly: the proof \
                 took {:?} of a {t:?} session",
                first.elapsed()
            )));
        }
        if zk_opts.tick_time.is_none() {
            tracing::warn!(
                session_timeout = ?t,
                "dlock cannot ask the servers of an application's ZooKeeper client for \
                 tickTime: assuming half the session timeout (set ZkOptions::tick_time), so \
                 the lost signal will also fire on leader elections and reconnections"
            );
        }
        Ok(Self::assemble(
            client,
            first,
            zk_opts.tick_time,
            None,
            acls,
            Some((proof, states)),
        ))
    }

    /// The backend on an established session; `requested` starts the lost signal's
    /// clock (the session lives on the leader at least a timeout from then). `attempt`
    /// is the connection timeout dlock gave the client it made, `None` for the
    /// application's own client (a borrowed session). `proof`: the syncs (send and
    /// completion times) that proved a borrowed session, which seed the heartbeat, and
    /// the state watcher they were checked with, so that a change of state since the
    /// first of them makes the heartbeat forget them.
    fn assemble(
        client: zk::Client,
        requested: tokio::time::Instant,
        tick: Option<std::time::Duration>,
        attempt: Option<std::time::Duration>,
        acls: zk::Acls<'static>,
        proof: Option<(
            Vec<(tokio::time::Instant, tokio::time::Instant)>,
            zk::StateWatcher,
        )>,
    ) -> Arc<ZkBackend> {
        let borrowed = attempt.is_none();
        let session_timeout = client.session_timeout();
        let session_id = client.session_id();
        let states = client.state_watcher();
        let (seeds, beat_states) = match proof {
            Some((syncs, watcher)) => (syncs, watcher),
            None => (Vec::new(), states.clone()),
        };
        let task_states = client.state_watcher();
        let shared = Arc::new(Shared::new(client, borrowed));
        // Set before the heartbeat first runs, which a busy runtime may not get to soon.
        shared.deadline.extend(
            crate::heartbeat::first_deadline(session_timeout, requested).into_std(),
            tokio::time::Instant::now().into_std(),
        );
        let task = tokio::spawn(watch_session(
            Arc::downgrade(&shared),
            task_states,
            session_timeout,
            attempt,
        ));
        let heartbeat = tokio::spawn(crate::heartbeat::run(
            Arc::downgrade(&shared),
            session_timeout,
            requested,
            beat_states,
            tick,
            seeds,
        ));
        let backend = Arc::new(ZkBackend {
            shared,
            states,
            session_timeout,
            session_id,
            watcher: task.abort_handle(),
            heartbeat: heartbeat.abort_handle(),
            acls,
        });
        tracing::info!(session = %session_id, ?session_timeout, borrowed, "ZooKeeper session established");
        backend
    }
}

/// Why no sync can prove a session in `state`, whether it is over for good
/// ([`session_over`]) or connected read-only ([`not_read_write`]); `None` while it is
/// connected read-write or disconnected (the caller says what a disconnection means).
fn unprovable(state: zk::SessionState) -> Option<Error> {
    if state.is_terminated() {
        Some(session_over(state))
    } else if state == zk::SessionState::ConnectedReadOnly {
        Some(not_read_write())
    } else {
        None
    }
}

/// The error for an application's session that is not connected to a read-write server
/// (disconnected, or reconnected read-only), which no sync can prove.
fn not_read_write() -> Error {
    Error::Unreachable("the application's ZooKeeper session is not connected (read-write)".into())
}

/// The error for an application's session found over for good (`state`: expired, closed,
/// or its authentication failed): the session's end is the lock's end.
fn session_over(state: zk::SessionState) -> Error {
    Error::LockLost(format!(
        "the application's ZooKeeper session is over ({state})"
    ))
}

/// Splits `h:p,h:p/chroot` into hosts and chroot. A `/` that belongs to a `tcp://`
/// scheme is not the chroot. A bare `/` chroot is no chroot.
pub(crate) fn split_chroot(connect_string: &str) -> (&str, Option<&str>) {
    let bytes = connect_string.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b != b'/' {
            continue;
        }
        let scheme_slash = connect_string[..i].ends_with(':')
            || (connect_string[..i].ends_with(":/") && bytes.get(i + 1) != Some(&b'/'));
        if scheme_slash {
            continue;
        }
        let root = connect_string[i..].trim_end_matches('/');
        let root = if root.is_empty() { None } else { Some(root) };
        return (&connect_string[..i], root);
    }
    (connect_string, None)
}

/// `request` on the application's session, within `limit`.
async fn within<T>(
    limit: std::time::Duration,
    what: &'static str,
    request: impl std::future::Future<Output = std::result::Result<T, zk::Error>>,
) -> Result<T> {
    match tokio::time::timeout(limit, request).await {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(err)) => Err(map_err(what, err)),
        Err(_elapsed) => Err(Error::Unreachable(format!(
            "the application's ZooKeeper session did not answer within {limit:?} ({what})"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_chroot() {
        assert_eq!(split_chroot("a:1,b:2/x/y"), ("a:1,b:2", Some("/x/y")));
        assert_eq!(split_chroot("a:1/"), ("a:1", None));
        assert_eq!(split_chroot("a:1"), ("a:1", None));
        assert_eq!(
            split_chroot("tcp://a:1,tcp://b:2/r"),
            ("tcp://a:1,tcp://b:2", Some("/r"))
        );
        assert_eq!(split_chroot("a:1/r/"), ("a:1", Some("/r")));
    }
}
