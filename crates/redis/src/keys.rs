//! Key and channel names. Every key of one lock carries the hash tag `{<lock name>}`, so
//! all of them hash to one Redis Cluster slot and one Lua script may touch them all.

use dlock_core::QueuePath;

/// The keys and channels of one queue.
///
/// Only the queue's key is built at once: the uncontended fast path sends it alone, and
/// building the other six names on every acquire cost about 1.5k instructions (seven
/// allocations) of the client's work per lock. They are built on first use, from the
/// queue's key, which holds every part of them.
#[derive(Debug, Clone)]
pub(crate) struct QueueKeys {
    /// Sorted set of entry names scored by sequence: `dlock:{L}:q[:sub]`.
    pub queue: String,
    /// Where `queue`'s `q` is: every other name is `queue[..at]`, its own word, then
    /// `queue[at + 1..]` (`:sub` or nothing).
    at: usize,
    rest: std::sync::OnceLock<Names>,
}

/// The names besides the queue's key ([`QueueKeys`]).
#[derive(Debug, Clone)]
struct Names {
    seq: String,
    token: String,
    entry_prefix: String,
    gone_prefix: String,
    changed: String,
    data_prefix: String,
}

/// Every other name is a function of the queue's key.
impl PartialEq for QueueKeys {
    fn eq(&self, other: &Self) -> bool {
        self.queue == other.queue
    }
}

impl Eq for QueueKeys {}

impl QueueKeys {
    /// Built on every enqueue and release, so with plain appends ([`key`]).
    ///
    /// `prefix` goes in front of every name (`?prefix=`; empty for none).
    pub fn new(prefix: &str, q: &QueuePath) -> Self {
        Self::of(prefix, q.lock.as_str(), q.sub)
    }

    /// The names of the queue `sub` (`None`: the lock's own) of the lock named `lock`.
    pub fn of(prefix: &str, lock: &str, sub: Option<&str>) -> Self {
        QueueKeys {
            queue: key(prefix, lock, "q", sub, ""),
            at: prefix.len() + "dlock:{".len() + lock.len() + "}:".len(),
            rest: std::sync::OnceLock::new(),
        }
    }

    fn names(&self) -> &Names {
        self.rest.get_or_init(|| {
            let (head, tail) = (&self.queue[..self.at], &self.queue[self.at + 1..]);
            let name = |what: &str, tail: &str, suffix: &str| concat(&[head, what, tail, suffix]);
            Names {
                seq: name("seq", tail, ""),
                token: name("token", "", ""),
                entry_prefix: name("e", tail, ":"),
                gone_prefix: name("gone", tail, ":"),
                changed: name("chg", tail, ""),
                data_prefix: name("data", tail, ":"),
            }
        })
    }

    /// The queue's sequence counter: `dlock:{L}:seq[:sub]`.
    pub fn seq(&self) -> &str {
        &self.names().seq
    }

    /// The lock's fencing-token counter, shared by its sub-queues: `dlock:{L}:token`.
    pub fn token(&self) -> &str {
        &self.names().token
    }

    /// Prefix of entry keys: `dlock:{L}:e[:sub]:` + entry name.
    pub fn entry_prefix(&self) -> &str {
        &self.names().entry_prefix
    }

    /// Prefix of per-entry removal channels: `dlock:{L}:gone[:sub]:` + entry name.
    pub fn gone_prefix(&self) -> &str {
        &self.names().gone_prefix
    }

    /// The channel every removal from the queue is published on: `dlock:{L}:chg[:sub]`.
    pub fn changed(&self) -> &str {
        &self.names().changed
    }

    /// Prefix of per-entry value channels, published on when a proclaim replaces the
    /// entry's value: `dlock:{L}:data[:sub]:` + entry name.
    pub fn data_prefix(&self) -> &str {
        &self.names().data_prefix
    }

    /// Just the queue's sorted-set key (what live entries are filed under), without
    /// building the other names.
    pub fn queue_key(prefix: &str, q: &QueuePath) -> String {
        key(prefix, q.lock.as_str(), "q", q.sub, "")
    }

    /// The three keys every script takes, in script order.
    pub fn script_keys(&self) -> Vec<String> {
        vec![
            self.queue.clone(),
            self.seq().to_owned(),
            self.token().to_owned(),
        ]
    }

    pub fn entry(&self, name: &str) -> String {
        format!("{}{name}", self.entry_prefix())
    }

    pub fn gone_channel(&self, name: &str) -> String {
        format!("{}{name}", self.gone_prefix())
    }

    pub fn data_channel(&self, name: &str) -> String {
        format!("{}{name}", self.data_prefix())
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
    let (colon, sub) = sub.map_or(("", ""), |s| (":", s));
    concat(&[prefix, "dlock:{", lock, "}:", what, colon, sub, suffix])
}

/// `parts` joined by appends into one allocation of the right size.
fn concat(parts: &[&str]) -> String {
    let mut s = String::with_capacity(parts.iter().map(|p| p.len()).sum());
    for p in parts {
        s.push_str(p);
    }
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
                k.seq(),
                k.token(),
                k.entry("lock-0000000001").as_str(),
                k.changed(),
                k.data_channel("lock-0000000001").as_str(),
            ] {
                assert_eq!(parse_queue_key(prefix, other), None, "{other}");
            }
        }
        assert_eq!(parse_queue_key("app1:", "dlock:{x}:q"), None);
        assert_eq!(parse_queue_key("", "dlock:{}:q"), None);
        assert_eq!(parse_queue_key("", "dlock:{x}:qq"), None);
    }

    /// The names built on first use from the queue's key are exactly the ones [`key`]
    /// builds, whatever the prefix holds (braces, colons, multi-byte characters).
    #[test]
    fn lazy_names_are_the_ones_built_in_full() {
        for prefix in ["", "app1:", "a{b}:", "x}:q:", "é:"] {
            for sub in [None, Some("leases")] {
                let k = QueueKeys::of(prefix, "orders/42", sub);
                let full = |what: &str, sub: Option<&str>, suffix: &str| {
                    key(prefix, "orders/42", what, sub, suffix)
                };
                assert_eq!(k.queue, full("q", sub, ""));
                assert_eq!(k.seq(), full("seq", sub, ""));
                assert_eq!(k.token(), full("token", None, ""));
                assert_eq!(k.entry_prefix(), full("e", sub, ":"));
                assert_eq!(k.gone_prefix(), full("gone", sub, ":"));
                assert_eq!(k.changed(), full("chg", sub, ""));
                assert_eq!(k.data_prefix(), full("data", sub, ":"));
            }
        }
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
        assert_eq!(k.token(), "dlock:{orders/42}:token");
        assert_eq!(k.entry("x"), "dlock:{orders/42}:e:leases:x");
        let r = QueueKeys::new("", &QueuePath::root(lock.clone()));
        assert_eq!(r.queue, "dlock:{orders/42}:q");
        assert_eq!(QueueKeys::queue_key("", &QueuePath::root(lock)), r.queue);
        assert_eq!(r.gone_channel("x"), "dlock:{orders/42}:gone:x");
        assert_eq!(r.data_channel("x"), "dlock:{orders/42}:data:x");
        assert_eq!(k.data_channel("x"), "dlock:{orders/42}:data:leases:x");
        assert_eq!(
            (k.seq(), k.entry_prefix(), k.gone_prefix(), k.changed()),
            (
                "dlock:{orders/42}:seq:leases",
                "dlock:{orders/42}:e:leases:",
                "dlock:{orders/42}:gone:leases:",
                "dlock:{orders/42}:chg:leases"
            )
        );
        assert_eq!(
            (r.seq(), r.token(), r.entry_prefix(), r.changed()),
            (
                "dlock:{orders/42}:seq",
                "dlock:{orders/42}:token",
                "dlock:{orders/42}:e:",
                "dlock:{orders/42}:chg"
            )
        );
        for key in [
            r.queue.as_str(),
            r.seq(),
            r.token(),
            k.queue.as_str(),
            k.seq(),
            r.data_channel("x").as_str(),
        ] {
            assert_eq!(
                fred::util::redis_keyslot(key.as_bytes()),
                fred::util::redis_keyslot(b"{orders/42}")
            );
        }
    }
}
