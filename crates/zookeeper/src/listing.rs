//! `list_queues` on ZooKeeper: a walk of the znode tree under a name prefix. A znode
//! whose children include lock entries (Curator's names: `…lock-`, `…__READ__…`,
//! `…__WRIT__…`, `…lease-…`) is a queue; entries are ephemeral and have no children, so
//! the walk descends into the other children only.

use dlock_core::{Entry, ListedQueue, Result};
use futures::StreamExt;
use zookeeper_client as zk;

use crate::backend::{parse_queue, retry, ZkBackend};
use crate::errors::map_err;

/// How many `getChildren` of one level of the walk are in flight at once.
const PARALLEL: usize = 8;

/// Where a walk for `prefix` starts: the directory it lists first (relative, `""` for the
/// root) and the start its children's names must have. `orders/4` lists `/orders` for
/// children starting with `4`; `orders/` all of `/orders`; `ord` the root's `ord…`.
pub(crate) fn walk_start(prefix: &str) -> (&str, &str) {
    prefix.rsplit_once('/').unwrap_or(("", prefix))
}

/// `dir/child`, or `child` at the root.
fn join(dir: &str, child: &str) -> String {
    if dir.is_empty() {
        child.to_owned()
    } else {
        format!("{dir}/{child}")
    }
}

impl ZkBackend {
    /// The walk: one `sync` through the leader, then one `getChildren` per znode under
    /// the prefix, level by level. The root's `zookeeper` tree is ZooKeeper's own and is
    /// skipped; a subtree this client may not list (`NoAuth`) is left out with a
    /// warning; one deleted during the walk is simply gone.
    pub(crate) async fn list_queues_inner(&self, prefix: &str) -> Result<Vec<ListedQueue>> {
        let client = self.handle()?;
        let (dir, partial) = walk_start(prefix);
        let dir_path = format!("/{dir}");
        // Like `participants`: an operator must see what any client was told it holds,
        // not the possibly lagging view of this session's server.
        match retry(|| client.sync(&dir_path)).await {
            Ok(()) | Err(zk::Error::NoNode) => {}
            Err(err) => return Err(map_err("syncing before listing locks", err)),
        }
        let children = match retry(|| client.list_children(&dir_path)).await {
            Ok(names) => names,
            Err(zk::Error::NoNode) => return Ok(Vec::new()),
            Err(err) => return Err(map_err("listing locks", err)),
        };
        // The start directory's own entries are a queue whose path is shorter than the
        // prefix: never listed.
        let mut frontier: Vec<String> = children
            .iter()
            .filter(|c| c.starts_with(partial) && Entry::from_name(c.as_str()).is_none())
            .filter(|c| !(dir.is_empty() && c.as_str() == "zookeeper"))
            .map(|c| join(dir, c))
            .collect();
        let mut out = Vec::new();
        while !frontier.is_empty() {
            let level: Vec<(String, std::result::Result<Vec<String>, zk::Error>)> =
                futures::stream::iter(std::mem::take(&mut frontier))
                    .map(|rel| {
                        let client = &client;
                        async move {
                            let path = format!("/{rel}");
                            let listed = retry(|| client.list_children(&path)).await;
                            (rel, listed)
                        }
                    })
                    .buffer_unordered(PARALLEL)
                    .collect()
                    .await;
            for (rel, listed) in level {
                let names = match listed {
                    Ok(names) => names,
                    Err(zk::Error::NoNode) => continue,
                    Err(zk::Error::NoAuth) => {
                        tracing::warn!(znode = %format!("/{rel}"), "not allowed to list its children: left out of the listing");
                        continue;
                    }
                    Err(err) => return Err(map_err("listing locks", err)),
                };
                let (entries, dirs): (Vec<String>, Vec<String>) = names
                    .into_iter()
                    .partition(|n| Entry::from_name(n.as_str()).is_some());
                frontier.extend(dirs.iter().map(|d| join(&rel, d)));
                if !entries.is_empty() {
                    out.push(ListedQueue::new(rel, parse_queue(entries)));
                }
            }
        }
        out.sort_by(|a, b| a.path.cmp(&b.path));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn walks_start_at_the_prefix_directory() {
        assert_eq!(walk_start(""), ("", ""));
        assert_eq!(walk_start("ord"), ("", "ord"));
        assert_eq!(walk_start("orders/4"), ("orders", "4"));
        assert_eq!(walk_start("orders/"), ("orders", ""));
        assert_eq!(walk_start("a/b/c"), ("a/b", "c"));
        assert_eq!(join("", "x"), "x");
        assert_eq!(join("a/b", "x"), "a/b/x");
    }
}
