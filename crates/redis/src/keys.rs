//! Key and channel names. Every key of one lock carries the hash tag `{<lock name>}`, so
//! all of them hash to one Redis Cluster slot and one Lua script may touch them all.

use dlock_core::QueuePath;

/// The keys and channels of one queue.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct QueueKeys {
    /// Sorted set of entry names scored by sequence: `dlock:{L}:q[:sub]`.
    pub queue: String,
    /// The queue's sequence counter: `dlock:{L}:seq[:sub]`.
    pub seq: String,
    /// The lock's fencing-token counter, shared by its sub-queues: `dlock:{L}:token`.
    pub token: String,
    /// Prefix of entry keys: `dlock:{L}:e[:sub]:` + entry name.
    pub entry_prefix: String,
    /// Prefix of per-entry removal channels: `dlock:{L}:gone[:sub]:` + entry name.
    pub gone_prefix: String,
    /// The channel every add and removal in the queue is published on: `dlock:{L}:chg[:sub]`.
    pub changed: String,
}

impl QueueKeys {
    pub fn new(q: &QueuePath) -> Self {
        let base = format!("dlock:{{{}}}", q.lock.as_str());
        let sub = q.sub.map(|s| format!(":{s}")).unwrap_or_default();
        QueueKeys {
            queue: format!("{base}:q{sub}"),
            seq: format!("{base}:seq{sub}"),
            token: format!("{base}:token"),
            entry_prefix: format!("{base}:e{sub}:"),
            gone_prefix: format!("{base}:gone{sub}:"),
            changed: format!("{base}:chg{sub}"),
        }
    }

    /// Just the queue's sorted-set key (what live entries are filed under), without
    /// building the other names.
    pub fn queue_key(q: &QueuePath) -> String {
        match q.sub {
            Some(sub) => format!("dlock:{{{}}}:q:{sub}", q.lock.as_str()),
            None => format!("dlock:{{{}}}:q", q.lock.as_str()),
        }
    }

    /// The three keys every script takes, in script order.
    pub fn script_keys(&self) -> Vec<String> {
        vec![self.queue.clone(), self.seq.clone(), self.token.clone()]
    }

    pub fn entry(&self, name: &str) -> String {
        format!("{}{name}", self.entry_prefix)
    }

    pub fn gone_channel(&self, name: &str) -> String {
        format!("{}{name}", self.gone_prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::{LockName, NameRules};

    #[test]
    fn keys_share_the_hash_tag() {
        let lock = LockName::new("orders/42", NameRules::Redis).expect("valid");
        let k = QueueKeys::new(&QueuePath::sub(lock.clone(), "leases"));
        assert_eq!(k.queue, "dlock:{orders/42}:q:leases");
        assert_eq!(
            QueueKeys::queue_key(&QueuePath::sub(lock.clone(), "leases")),
            k.queue
        );
        assert_eq!(k.token, "dlock:{orders/42}:token");
        assert_eq!(k.entry("x"), "dlock:{orders/42}:e:leases:x");
        let r = QueueKeys::new(&QueuePath::root(lock.clone()));
        assert_eq!(r.queue, "dlock:{orders/42}:q");
        assert_eq!(QueueKeys::queue_key(&QueuePath::root(lock)), r.queue);
        assert_eq!(r.gone_channel("x"), "dlock:{orders/42}:gone:x");
        for key in [&r.queue, &r.seq, &r.token, &k.queue, &k.seq] {
            assert_eq!(
                fred::util::redis_keyslot(key.as_bytes()),
                fred::util::redis_keyslot(b"{orders/42}")
            );
        }
    }
}
