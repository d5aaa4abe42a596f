//! Reads: the queue read, the revision floor no read may go back before (`observe`,
//! `fresh_get`), and the queue listings built on them.

use std::sync::atomic::Ordering;

use dlock_core::{Entry, ListedQueue, Result};
use etcd_client::{GetOptions, GetResponse, SortOrder, SortTarget};

use crate::backend::{request, EtcdBackend};
use crate::errors::map;
use crate::layout::{self, RawKv};

/// Keys per range read of a listing: a page of lock entries (a few hundred bytes each)
/// stays far below etcd's response size limits.
const LIST_PAGE: i64 = 1000;

pub(crate) fn queue_read() -> GetOptions {
    GetOptions::new()
        .with_prefix()
        .with_sort(SortTarget::Create, SortOrder::Ascend)
}

/// Whether `resp` has `entry` under `key`: the key, created at the entry's token (a key
/// re-created under the same name has a newer create revision).
pub(crate) fn holds_entry(resp: &GetResponse, key: &str, entry: &Entry) -> bool {
    resp.kvs().iter().any(|kv| {
        let created = u64::try_from(kv.create_revision()).ok();
        kv.key() == key.as_bytes()
            && entry.token_matches(created.map(dlock_core::FencingToken::new))
    })
}

pub(crate) fn raw(kv: &etcd_client::KeyValue) -> RawKv<'_> {
    RawKv {
        key: kv.key(),
        value: kv.value(),
        create_revision: kv.create_revision(),
    }
}

pub(crate) fn header_rev(h: Option<&etcd_client::ResponseHeader>) -> i64 {
    h.map(|h| h.revision()).unwrap_or(0)
}

impl EtcdBackend {
    /// Remembers that the cluster has reached revision `rev`.
    pub(crate) fn observe(&self, rev: i64) {
        self.seen_rev.fetch_max(rev, Ordering::AcqRel);
    }

    /// A read that reflects at least revision `floor` and everything this client has seen
    /// (its own writes, the deletes its watches reported), retried on another endpoint if
    /// one is down.
    ///
    /// It is first served by whichever member gets it, without a quorum round
    /// (serializable); only if that member lags behind the floor is it repeated as a
    /// linearizable read. A view at or after my own entry's revision is safe for the
    /// driver: it lists every entry still ahead of mine (entries are only ever added
    /// behind), so it can make me wait longer, never let me in early.
    pub(crate) async fn fresh_get(
        &self,
        key: &str,
        opts: GetOptions,
        floor: i64,
    ) -> std::result::Result<GetResponse, etcd_client::Error> {
        let floor = floor.max(self.seen_rev.load(Ordering::Acquire));
        let read = |opts: GetOptions| {
            request(&self.in_flight, self.request_timeout, move || {
                let opts = opts.clone();
                self.kv.with(async move |kv| kv.get(key, Some(opts)).await)
            })
        };
        let r = read(opts.clone().with_serializable()).await?;
        let rev = header_rev(r.header());
        if rev >= floor {
            self.observe(rev);
            return Ok(r);
        }
        let r = read(opts).await?;
        self.observe(header_rev(r.header()));
        Ok(r)
    }

    /// The queue as the cluster's quorum sees it now. Status output must show every
    /// entry that exists, even to a fresh client whose first serializable read could be
    /// served by a lagging member.
    pub(crate) async fn read_queue_linearizable(&self, prefix: &str) -> Result<Vec<Entry>> {
        let resp: GetResponse = request(&self.in_flight, self.request_timeout, move || {
            self.kv
                .with(async move |kv| kv.get(prefix, Some(queue_read())).await)
        })
        .await
        .map_err(|e| map(&format!("reading queue {prefix}"), e))?;
        self.observe(header_rev(resp.header()));
        Ok(layout::queue_from_kvs(prefix, resp.kvs().iter().map(raw)))
    }

    /// Every lock entry under `prefix` (after the namespace), grouped into queues: range
    /// reads of [`LIST_PAGE`] keys, the first linearizable and the others at its
    /// revision, so the whole listing is one view of the cluster however many pages it
    /// takes (unless that revision is compacted away meanwhile: then an error).
    pub(crate) async fn list_queues_inner(&self, prefix: &str) -> Result<Vec<ListedQueue>> {
        let start = format!("{}{prefix}", self.namespace);
        let (mut from, end) = layout::prefix_range(start.as_bytes());
        let mut rev = 0;
        let mut pages: Vec<GetResponse> = Vec::new();
        loop {
            let opts = GetOptions::new()
                .with_range(end.clone())
                .with_limit(LIST_PAGE)
                .with_revision(rev);
            let resp: GetResponse = request(&self.in_flight, self.request_timeout, || {
                let (key, opts) = (from.clone(), opts.clone());
                self.kv.with(async move |kv| kv.get(key, Some(opts)).await)
            })
            .await
            .map_err(|e| map(&format!("listing the locks under {start:?}"), e))?;
            if rev == 0 {
                rev = header_rev(resp.header());
                self.observe(rev);
            }
            let next = match resp.kvs().last() {
                Some(last) if resp.more() => {
                    let mut k = last.key().to_vec();
                    k.push(0);
                    Some(k)
                }
                _ => None,
            };
            pages.push(resp);
            match next {
                Some(k) => from = k,
                None => break,
            }
        }
        let kvs = pages
            .iter()
            .flat_map(|p| p.kvs())
            .map(|kv| (raw(kv), kv.lease()));
        Ok(layout::listed_queues(&self.namespace, kvs))
    }

    pub(crate) async fn read_queue(&self, prefix: &str) -> Result<(Vec<Entry>, i64)> {
        let resp: GetResponse = self
            .fresh_get(prefix, queue_read(), 0)
            .await
            .map_err(|e| map(&format!("reading queue {prefix}"), e))?;
        let rev = header_rev(resp.header());
        Ok((
            layout::queue_from_kvs(prefix, resp.kvs().iter().map(raw)),
            rev,
        ))
    }
}
