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
    /// Prefix of per-entry value channels, published on when a proclaim replaces the
    /// entry's value: `dlock:{L}:data[:sub]:` + entry name.
    pub data_prefix: String,
}

impl QueueKeys {
    /// Built on every enqueue and release, so with plain appends ([`key`]): six `format!`
    /// calls cost about 7k instructions per build (callgrind), a sizeable part of an
    /// uncontended acquire + release on the client.
    ///
    /// `prefix` goes in front of every name (`?prefix=`; empty for none).
    pub fn new(prefix: &str, q: &QueuePath) -> Self {
        Self::of(prefix, q.lock.as_str(), q.sub)
    }

    /// The names of the queue `sub` (`None`: the lock's own) of the lock named `lock`.
    pub fn of(prefix: &str, lock: &str, sub: Option<&str>) -> Self {
        QueueKeys {
            queue: key(prefix, lock, "q", sub, ""),
            seq: key(prefix, lock, "seq", sub, ""),
            token: key(prefix, lock, "token", None, ""),
            entry_prefix: key(prefix, lock, "e", sub, ":"),
            gone_prefix: key(prefix, lock, "gone", sub, ":"),
            changed: key(prefix, lock, "chg", sub, ""),
            data_prefix: key(prefix, lock, "data", sub, ":"),
        }
    }

    /// Just the queue's sorted-set key (what live entries are filed under), without
    /// building the other names.
    pub fn queue_key(prefix: &str, q: &QueuePath) -> String {
        key(prefix, q.lock.as_str(), "q", q.sub, "")
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

    pub fn data_channel(&self, name: &str) -> String {
        format!("{}{name}", self.data_prefix)
    }
}

/// The `SCAN` pattern of the queue keys of every lock whose name starts with
/// `name_prefix`: `<prefix>dlock:{<name_prefix>*}:q*`, with the glob characters of both
/// prefixes escaped. A name has no `}`, so the `*` inside the braces cannot run past the
/// hash tag, and after it only the queue keys (`:q`, `:q:<sub>`) start with `:q`.
pub(crate) fn queue_scan_pattern(prefix: &str, name_prefix: &str) -> String {
    format!(
        "{}dlock:{{{}*}}:q*",
        glob_escape(prefix),
        glob_escape(name_prefix)
    )
}

fn glob_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        if matches!(c, '*' | '?' | '[' | ']' | '\\') {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

/// The lock name and sub-queue of a queue key (the inverse of [`QueueKeys::of`]'s
/// `queue`), or `None` for any other key.
pub(crate) fn parse_queue_key<'k>(
    prefix: &str,
    key: &'k str,
) -> Option<(&'k str, Option<&'k str>)> {
    let rest = key.strip_prefix(prefix)?.strip_prefix("dlock:{")?;
    let (lock, what) = rest.split_once('}')?;
    match what.strip_prefix(":q")? {
        "" => Some((lock, None)),
        sub => {
            let sub = sub.strip_prefix(':')?;
            (!sub.is_empty() && !sub.contains(':')).then_some((lock, Some(sub)))
        }
    }
    .filter(|(lock, _)| !lock.is_empty())
}

/// `<prefix>dlock:{<lock>}:<what>[:<sub>]<suffix>`.
fn key(prefix: &str, lock: &str, what: &str, sub: Option<&str>, suffix: &str) -> String {
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
    fn queue_keys_are_scanned_and_parsed_back() {
        assert_eq!(queue_scan_pattern("", ""), "dlock:{*}:q*");
        assert_eq!(
            queue_scan_pattern("app*1:", "jobs/[x]?"),
            "app\\*1:dlock:{jobs/\\[x\\]\\?*}:q*"
        );
        let lock = LockName::new("orders/42", crate::NAME_RULES).expect("valid");
        for (prefix, sub) in [("", None), ("app1:", Some("leases")), ("p:", Some("locks"))] {
            let q = QueuePath {
                lock: lock.clone(),
                sub,
            };
            let k = QueueKeys::new(prefix, &q);
            assert_eq!(parse_queue_key(prefix, &k.queue), Some(("orders/42", sub)));
            assert_eq!(QueueKeys::of(prefix, "orders/42", sub), k);
            // None of the lock's other keys is a queue key.
            for other in [
                &k.seq,
                &k.token,
                &k.entry("lock-0000000001"),
                &k.changed,
                &k.data_channel("lock-0000000001"),
            ] {
                assert_eq!(parse_queue_key(prefix, other), None, "{other}");
            }
        }
        assert_eq!(parse_queue_key("app1:", "dlock:{x}:q"), None);
        assert_eq!(parse_queue_key("", "dlock:{}:q"), None);
        assert_eq!(parse_queue_key("", "dlock:{x}:qq"), None);
    }

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
        assert_eq!(r.data_channel("x"), "dlock:{orders/42}:data:x");
        assert_eq!(k.data_channel("x"), "dlock:{orders/42}:data:leases:x");
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
        for key in [
            &r.queue,
            &r.seq,
            &r.token,
            &k.queue,
            &k.seq,
            &r.data_channel("x"),
        ] {
            assert_eq!(
                fred::util::redis_keyslot(key.as_bytes()),
                fred::util::redis_keyslot(b"{orders/42}")
            );
        }
    }
}
