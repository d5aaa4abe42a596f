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
    /// The channel every removal from the queue is published on: `dlock:{L}:chg[:sub]`.
    pub changed: String,
}

impl QueueKeys {
    /// Built on every enqueue and release, so with plain appends ([`key`]): six `format!`
    /// calls cost about 7k instructions per build (callgrind), a sizeable part of an
    /// uncontended acquire + release on the client.
    ///
    /// `prefix` goes in front of every name (`?prefix=`; empty for none).
    pub fn new(prefix: &str, q: &QueuePath) -> Self {
        QueueKeys {
            queue: key(prefix, q, "q", q.sub, ""),
            seq: key(prefix, q, "seq", q.sub, ""),
            token: key(prefix, q, "token", None, ""),
            entry_prefix: key(prefix, q, "e", q.sub, ":"),
            gone_prefix: key(prefix, q, "gone", q.sub, ":"),
            changed: key(prefix, q, "chg", q.sub, ""),
        }
    }

    /// Just the queue's sorted-set key (what live entries are filed under), without
    /// building the other names.
    pub fn queue_key(prefix: &str, q: &QueuePath) -> String {
        key(prefix, q, "q", q.sub, "")
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

/// `<prefix>dlock:{<lock>}:<what>[:<sub>]<suffix>`.
fn key(prefix: &str, q: &QueuePath, what: &str, sub: Option<&str>, suffix: &str) -> String {
    let lock = q.lock.as_str();
    let sub_len = sub.map_or(0, |s| s.len() + 1);
    let mut s =
        String::with_capacity(prefix.len() + 9 + lock.len() + what.len() + sub_len + suffix.len());
    s.push_str(prefix);
    s.push_str("dlock:{");
    s.push_str(lock);
    s.push_str("}:");
    s.push_str(what);
    if let Some(sub) = sub {
        s.push(':');
        s.push_str(sub);
    }
    s.push_str(suffix);
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::LockName;

    #[test]
    fn keys_share_the_hash_tag() {
        let lock = LockName::new("orders/42", crate::NAME_RULES).expect("valid");
        let k = QueueKeys::new("", &QueuePath::sub(lock.clone(), "leases"));
        assert_eq!(k.queue, "dlock:{orders/42}:q:leases");
        assert_eq!(
            QueueKeys::queue_key("", &QueuePath::sub(lock.clone(), "leases")),
            k.queue
        );
        assert_eq!(k.token, "dlock:{orders/42}:token");
        assert_eq!(k.entry("x"), "dlock:{orders/42}:e:leases:x");
        let r = QueueKeys::new("", &QueuePath::root(lock.clone()));
        assert_eq!(r.queue, "dlock:{orders/42}:q");
        assert_eq!(QueueKeys::queue_key("", &QueuePath::root(lock)), r.queue);
        assert_eq!(r.gone_channel("x"), "dlock:{orders/42}:gone:x");
        assert_eq!(
            (&k.seq, &k.entry_prefix, &k.gone_prefix, &k.changed),
            (
                &"dlock:{orders/42}:seq:leases".to_owned(),
                &"dlock:{orders/42}:e:leases:".to_owned(),
                &"dlock:{orders/42}:gone:leases:".to_owned(),
                &"dlock:{orders/42}:chg:leases".to_owned()
            )
        );
        assert_eq!(
            (&r.seq, &r.token, &r.entry_prefix, &r.changed),
            (
                &"dlock:{orders/42}:seq".to_owned(),
                &"dlock:{orders/42}:token".to_owned(),
                &"dlock:{orders/42}:e:".to_owned(),
                &"dlock:{orders/42}:chg".to_owned()
            )
        );
        for key in [&r.queue, &r.seq, &r.token, &k.queue, &k.seq] {
            assert_eq!(
                fred::util::redis_keyslot(key.as_bytes()),
                fred::util::redis_keyslot(b"{orders/42}")
            );
        }
    }
}
