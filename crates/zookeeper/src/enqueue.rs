//! Enqueue and its recovery: the create (a `multi` for a downgrade's read entry and for
//! `enqueue_removing`), the lookup by ticket of a create whose reply was lost (Curator's
//! protected mode), and the queue's parents created as containers on the way.

use dlock_core::entry::{format_zk_seq, sort_queue};
use dlock_core::{
    Enqueued, Entry, EntryKind, Error, FencingToken, Position, QueuePath, Result, Ticket,
};
use futures::FutureExt;
use zookeeper_client as zk;

use crate::backend::{parse_queue, retry, znode, ZkBackend};
use crate::errors::{is_connection_loss, map_err};

/// How often enqueue re-creates its entry after the parent vanished or the connection
/// dropped before it gives up. Each retry needs a concurrent deletion or a reconnect, so
/// the bound is never reached in practice; it only turns a livelock into an error.
const MAX_ENQUEUE_ATTEMPTS: usize = 8;

impl ZkBackend {
    pub(crate) async fn enqueue_inner(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        at: Position<'_>,
        data: &[u8],
    ) -> Result<Enqueued> {
        let client = self.handle()?;
        let parent = znode(q);
        let (name, mode) = match at {
            Position::Tail => (
                ticket.name_prefix(kind),
                zk::CreateMode::EphemeralSequential,
            ),
            // Curator's downgrade: a non-sequential node carrying the writer's sequence.
            Position::Beside(writer) => (
                format!("{}{}", ticket.name_prefix(kind), format_zk_seq(writer.seq)),
                zk::CreateMode::Ephemeral,
            ),
        };
        let sequential = matches!(mode, zk::CreateMode::EphemeralSequential);
        let path = format!("{parent}/{name}");
        // A downgrade's read entry is created in one multi with a check that its write
        // entry still exists: a write deleted from outside fails the multi, and no read
        // entry takes a dead writer's place. (The write is this session's ephemeral, and a
        // session is never replaced, so existing means ours.)
        let writer_path = match at {
            Position::Beside(writer) => Some(format!("{parent}/{}", writer.name)),
            Position::Tail => None,
        };
        let options = mode.with_acls(self.acls);
        // Set when a create's reply was lost: it may have happened on the server.
        let mut maybe_created = false;
        for _ in 0..MAX_ENQUEUE_ATTEMPTS {
            if std::mem::take(&mut maybe_created) {
                // Curator's protected mode: find the entry by the ticket in its name. The
                // listing is ordered after the lost create, so if it is absent now it was
                // never made and creating again cannot duplicate it.
                if let Some((stat, mine)) = self.find_own(&client, &parent, ticket, kind).await? {
                    let names = retry(|| client.list_children(&parent))
                        .await
                        .map_err(|e| map_err("enqueue: listing the queue", e))?;
                    return build_enqueued(names, mine, &stat, data);
                }
            }
            // Both requests are written when called, in this order, so the listing is taken
            // right after the create on the server: one round trip for both.
            let create = match &writer_path {
                None => client
                    .create(&path, data, &options)
                    .map(|r| r.map(|(stat, seq)| (stat, Some(seq))))
                    .boxed(),
                Some(writer_path) => {
                    let mut multi = client.new_multi_writer();
                    multi
                        .add_check_version(writer_path, -1)
                        .and_then(|()| multi.add_create(&path, data, &options))
                        .map_err(|e| map_err("enqueue: building the multi", e))?;
                    multi
                        .commit()
                        .map(|r| match r {
                            Ok(results) => match results.into_iter().nth(1) {
                                Some(zk::MultiWriteResult::Create { stat, .. }) => Ok((stat, None)),
                                _ => Err(zk::Error::UnexpectedError(
                                    "the server's multi reply has no create result".into(),
                                )),
                            },
                            Err(zk::MultiWriteError::OperationFailed {
                                index: 0,
                                source: zk::Error::NoNode,
                            }) => Err(zk::Error::BadVersion),
                            Err(e) => Err(e.into()),
                        })
                        .boxed()
                }
            };
            let list = client.get_children(&parent);
            let (created, listed) = futures::join!(create, list);
            let (stat, mine) = match created {
                Ok((stat, Some(seq))) => (stat, format!("{name}{seq}")),
                // ZooKeeper before 3.9 answers a create inside a multi without its stat
                // (ZOOKEEPER-4026); the token is the czxid, so read it.
                Ok((stat, None)) if stat.is_invalid() => {
                    match retry(|| client.check_stat(&path)).await {
                        Ok(Some(stat)) => (stat, name.clone()),
                        Ok(None) => {
                            return Err(Error::LockLost(format!(
                                "entry {path} vanished right after it was created"
                            )))
                        }
                        Err(err) => return Err(map_err("enqueue: reading the entry", err)),
                    }
                }
                Ok((stat, None)) => (stat, name.clone()),
                // Only the multi's check of the write entry fails so: a version of -1
                // matches any node that exists.
                Err(zk::Error::BadVersion) if writer_path.is_some() => {
                    return Err(Error::LockLost(format!(
                        "the write entry beside which the read entry was asked for is gone from {parent}"
                    )))
                }
                Err(zk::Error::NoNode) => {
                    // The parent was never created, or its container was reaped while empty.
                    self.make_parent(&client, &parent).await?;
                    continue;
                }
                Err(zk::Error::NodeExists) if !sequential => {
                    // A retried Beside create whose first reply was lost: ours if our session owns it.
                    let (_, stat) = retry(|| client.get_data(&path))
                        .await
                        .map_err(|e| map_err("enqueue: reading an existing entry", e))?;
                    if stat.ephemeral_owner != self.session_id.0 {
                        return Err(Error::backend(
                            "enqueue",
                            format!("entry {path} already exists and belongs to another session"),
                        ));
                    }
                    (stat, name.clone())
                }
                Err(err) if is_connection_loss(&err) => {
                    tracing::debug!(%err, "connection lost during create; looking for the entry");
                    maybe_created = true;
                    continue;
                }
                Err(err) => return Err(map_err("enqueue", err)),
            };
            let names = match listed {
                Ok((names, _)) if names.contains(&mine) => names,
                _ => retry(|| client.list_children(&parent))
                    .await
                    .map_err(|e| map_err("enqueue: listing the queue", e))?,
            };
            return build_enqueued(names, mine, &stat, data);
        }
        Err(Error::backend(
            "enqueue",
            format!(
                "gave up after {MAX_ENQUEUE_ATTEMPTS} attempts: the queue's parent kept \
                 vanishing or the connection kept dropping"
            ),
        ))
    }

    /// Creates an entry at the tail of `q` and deletes `gone` from `gone_q` in one
    /// `multi`: one synced write, atomic, so after a lost reply either both happened
    /// (the entry is found by its ticket) or neither.
    #[allow(clippy::too_many_arguments)]
    pub(crate) async fn enqueue_removing_inner(
        &self,
        q: &QueuePath,
        ticket: &Ticket,
        kind: EntryKind,
        data: &[u8],
        gone_q: &QueuePath,
        gone: &Entry,
    ) -> Result<Entry> {
        let client = self.handle()?;
        let parent = znode(q);
        let path = format!("{parent}/{}", ticket.name_prefix(kind));
        let gone_path = format!("{}/{}", znode(gone_q), gone.name);
        let options = zk::CreateMode::EphemeralSequential.with_acls(self.acls);
        let mut maybe_done = false;
        for _ in 0..MAX_ENQUEUE_ATTEMPTS {
            if std::mem::take(&mut maybe_done) {
                if let Some((stat, mine)) = self.find_own(&client, &parent, ticket, kind).await? {
                    return entry_with_stat(mine, &stat, data);
                }
            }
            let mut multi = client.new_multi_writer();
            multi
                .add_create(&path, data, &options)
                .and_then(|()| multi.add_delete(&gone_path, None))
                .map_err(|e| map_err("enqueue_removing: building the multi", e))?;
            match multi.commit().await {
                Ok(results) => {
                    let Some(zk::MultiWriteResult::Create {
                        path: created,
                        stat,
                    }) = results.into_iter().next()
                    else {
                        return Err(Error::backend(
                            "enqueue_removing",
                            "the server's multi reply has no create result",
                        ));
                    };
                    let mine = created.rsplit('/').next().unwrap_or(&created).to_owned();
                    // ZooKeeper before 3.9 answers a create inside a multi without its stat
                    // (ZOOKEEPER-4026); the token is the czxid, so read it.
                    let stat = if stat.is_invalid() {
                        let own = format!("{parent}/{mine}");
                        match retry(|| client.check_stat(&own)).await {
                            Ok(Some(stat)) => stat,
                            Ok(None) => {
                                return Err(Error::LockLost(format!(
                                    "entry {own} vanished right after it was created"
                                )))
                            }
                            Err(err) => {
                                return Err(map_err("enqueue_removing: reading the entry", err))
                            }
                        }
                    } else {
                        stat
                    };
                    return entry_with_stat(mine, &stat, data);
                }
                Err(zk::MultiWriteError::OperationFailed {
                    index: 0,
                    source: zk::Error::NoNode,
                }) => {
                    self.make_parent(&client, &parent).await?;
                }
                Err(zk::MultiWriteError::OperationFailed {
                    index: 1,
                    source: zk::Error::NoNode,
                }) => {
                    return Err(Error::LockLost(format!(
                        "held entry {gone_path} vanished before it was handed on"
                    )))
                }
                Err(zk::MultiWriteError::RequestFailed { source })
                    if is_connection_loss(&source) =>
                {
                    tracing::debug!(err = %source, "connection lost during the multi; looking for the entry");
                    maybe_done = true;
                }
                Err(err) => return Err(map_err("enqueue_removing", err.into())),
            }
        }
        Err(Error::backend(
            "enqueue_removing",
            format!(
                "gave up after {MAX_ENQUEUE_ATTEMPTS} attempts: the queue's parent kept \
                 vanishing or the connection kept dropping"
            ),
        ))
    }

    /// Creates `parent` and its ancestors as container nodes, as Curator's
    /// `creatingParentContainersIfNeeded` does, so the server reaps them once empty.
    async fn make_parent(&self, client: &zk::Client, parent: &str) -> Result<()> {
        let container = zk::CreateMode::Container.with_acls(self.acls);
        match retry(|| client.mkdir(parent, &container)).await {
            Ok(()) | Err(zk::Error::NodeExists) => Ok(()),
            Err(zk::Error::NoNode) => Err(Error::backend(
                "enqueue: creating the queue's parents",
                "the chroot does not exist (deleted after connect?)",
            )),
            Err(err) => Err(map_err("enqueue: creating the queue's parents", err)),
        }
    }

    /// Finds the entry `ticket` created in `parent`, with its stat.
    async fn find_own(
        &self,
        client: &zk::Client,
        parent: &str,
        ticket: &Ticket,
        kind: EntryKind,
    ) -> Result<Option<(zk::Stat, String)>> {
        // The create whose reply was lost was not seen by this session, so a server this
        // session reconnected to may not have applied it yet: sync through the leader first.
        match retry(|| client.sync(parent)).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(err) => {
                return Err(map_err(
                    "enqueue: syncing before a lost create's lookup",
                    err,
                ))
            }
        }
        let names = match retry(|| client.list_children(parent)).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(None),
            Err(err) => return Err(map_err("enqueue: looking for a lost create", err)),
        };
        let prefix = ticket.name_prefix(kind);
        let Some(name) = names.into_iter().find(|n| n.starts_with(&prefix)) else {
            return Ok(None);
        };
        let path = format!("{parent}/{name}");
        match retry(|| client.get_data(&path)).await {
            Ok((_, stat)) => Ok(Some((stat, name))),
            Err(zk::Error::NoNode) => Ok(None),
            Err(err) => Err(map_err("enqueue: reading a recovered entry", err)),
        }
    }
}

fn build_enqueued(
    names: Vec<String>,
    mine: String,
    stat: &zk::Stat,
    data: &[u8],
) -> Result<Enqueued> {
    let me = entry_with_stat(mine, stat, data)?;
    let mut queue = parse_queue(names);
    refuse_across_the_wrap(&me, &queue)?;
    match queue.iter_mut().find(|e| e.name == me.name) {
        Some(slot) => *slot = me.clone(),
        None => {
            queue.push(me.clone());
            sort_queue(&mut queue);
        }
    }
    Ok(Enqueued { mine: me, queue })
}

/// How far above a new entry's sequence another entry of its listing can be and still
/// have been made after it: the listing is taken right after the create (or, after a lost
/// reply, once the client has reconnected), and no ZooKeeper makes 2²⁴ (16.7 million)
/// children in that time. An entry further above was made before the counter wrapped.
const MADE_SINCE: u64 = 1 << 24;

/// Fails the enqueue of `me` if its queue still holds entries made before ZooKeeper's
/// sequence counter went from 2³² − 1 (read from `-000000001`) back to 0.
///
/// A new entry is the newest of its queue, so every entry numbered above it by more than
/// [`MADE_SINCE`] is from before the wrap: sorted by number it would sort behind `me`
/// although it came first, and `me` would be granted beside the entry that holds.
/// Refused, `me` is abandoned by its caller and the acquire fails with a backend error,
/// which the caller may retry; no new entry gets a large number again, so the entries
/// from before the wrap drain, and once they have, entries are accepted. It happens once
/// per 2³² creations and deletions under one parent, and only if the parent (a
/// container, deleted by the server once it has been empty at a check) was never empty
/// in between. Not caught: an entry that lived through 2³² − 2²⁴ creations and deletions
/// under its parent (its number is then below the new one's again), and a semaphore's
/// lease, which is created in one `multi` with no listing (`enqueue_removing`). The
/// first wrap, at 2³¹, needs nothing in a queue of dlock clients only (see
/// `dlock_core::entry::parse_name`).
fn refuse_across_the_wrap(me: &Entry, queue: &[Entry]) -> Result<()> {
    match queue
        .iter()
        .find(|e| e.seq > me.seq.saturating_add(MADE_SINCE))
    {
        Some(older) => Err(Error::backend(
            "enqueue",
            format!(
                "ZooKeeper's sequence counter of this lock wrapped: entry {} was made before \
                 {} and would sort behind it; retry once the entries made before the wrap \
                 have gone",
                older.name, me.name
            ),
        )),
        None => Ok(()),
    }
}

/// The entry this session created as `mine`, with its token (the czxid) and payload.
fn entry_with_stat(mine: String, stat: &zk::Stat, data: &[u8]) -> Result<Entry> {
    let czxid = u64::try_from(stat.czxid).map_err(|_| {
        Error::backend(
            "enqueue",
            "the server returned no czxid for the created entry (ZooKeeper 3.5 or later is required)",
        )
    })?;
    let mut me = Entry::from_name(mine.as_str()).ok_or_else(|| {
        Error::backend(
            "enqueue",
            format!("created entry {mine:?} does not parse as an entry name"),
        )
    })?;
    me.token = Some(FencingToken::new(czxid));
    me.created_ms = Some(stat.ctime);
    me.data = data.to_vec();
    Ok(me)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn enqueued_includes_mine_with_token() {
        let t = dlock_testkit::ticket();
        let mine = format!("{}0000000002", t.name_prefix(EntryKind::Lock));
        let other = dlock_testkit::ticket();
        let names = vec![
            "leases".to_owned(),
            format!("{}0000000003", other.name_prefix(EntryKind::Lock)),
            format!("{}0000000001", other.name_prefix(EntryKind::Lock)),
        ];
        let done = build_enqueued(names, mine.clone(), &stat(), b"me").expect("built");
        assert_eq!(done.mine.token, Some(FencingToken::new(42)));
        let seqs: Vec<u64> = done.queue.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![1, 2, 3]);
        assert_eq!(done.queue[1].name, mine);
        assert_eq!(done.queue[1].data, b"me");
    }

    fn stat() -> zk::Stat {
        zk::Stat {
            czxid: 42,
            mzxid: 42,
            pzxid: 42,
            ctime: 7,
            mtime: 7,
            version: 0,
            cversion: 0,
            aversion: 0,
            ephemeral_owner: 1,
            data_length: 0,
            num_children: 0,
        }
    }

    /// Across the counter's first wrap (2³¹) the order goes on; across its second (2³²
    /// back to 0) an entry whose queue still holds older entries is refused, never
    /// granted ahead of them.
    #[test]
    fn an_entry_made_after_the_counter_wrapped_is_refused_while_older_ones_remain() {
        let (t, other) = (dlock_testkit::ticket(), dlock_testkit::ticket());
        let lock = |t: &Ticket, seq: &str| format!("{}{seq}", t.name_prefix(EntryKind::Lock));

        // First wrap: 2147483647 holds, the new entry is -2147483648 and queues behind.
        let mine = lock(&t, "-2147483648");
        let done = build_enqueued(vec![lock(&other, "2147483647")], mine.clone(), &stat(), b"")
            .expect("accepted across the first wrap");
        let order: Vec<&str> = done.queue.iter().map(|e| e.name.as_str()).collect();
        assert_eq!(
            order,
            vec![lock(&other, "2147483647").as_str(), mine.as_str()]
        );

        // Second wrap: -000000001 (2³² − 1) is still there when 0000000000 is made.
        let older = lock(&other, "-000000001");
        let err = build_enqueued(vec![older.clone()], lock(&t, "0000000000"), &stat(), b"")
            .expect_err("refused while an entry from before the wrap remains");
        let why = std::error::Error::source(&err).map(ToString::to_string);
        assert!(
            matches!(&err, Error::Backend { .. })
                && why.as_deref().is_some_and(|w| w.contains("wrapped")),
            "{err}: {why:?}"
        );
        // An entry made just after the new one (listed with it) is no sign of a wrap.
        build_enqueued(
            vec![lock(&other, "0000000009")],
            lock(&t, "0000000007"),
            &stat(),
            b"",
        )
        .expect("a newer entry in the listing is accepted");
        // Once the older entries are gone, entries are accepted again.
        build_enqueued(
            vec![lock(&other, "0000000001")],
            lock(&t, "0000000002"),
            &stat(),
            b"",
        )
        .expect("accepted once the older entries went");
    }
}
