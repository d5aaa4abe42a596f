//! Lock names: one validated, slash-separated name per lock, checked against the rules of
//! the backend that will store it.
//!
//! A name like `orders/42` means the znode `/orders/42` on ZooKeeper (the path a Curator
//! user passes), the key prefix `orders/42/` on etcd and the hash tag `{orders/42}` on
//! Redis. Validation happens once, before any round trip, so a bad name never leaves
//! anything behind on a server.

use std::fmt;
use std::sync::Arc;

use crate::error::{Error, NameError};

/// The rules a backend puts on lock names, beyond those every backend shares.
///
/// Every name is checked for what any backend needs: not empty, no control or private-use
/// characters, no empty, `.` or `..` segment (so the prefix of one lock is never the
/// prefix of another), at most [`NameRules::MAX_LEN`] bytes. A backend adds what its
/// storage needs on top: a first segment it reserves (ZooKeeper's `/zookeeper` tree),
/// characters it cannot take in a name (Redis's `{` and `}`, which would break the hash
/// tag). Each adapter publishes its rules; the core names no backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NameRules {
    reserved: Option<&'static str>,
    forbidden: &'static [char],
    entry_like_refused: bool,
}

impl NameRules {
    /// The longest name accepted, in bytes. ZooKeeper's limit leaves room for the
    /// chroot, a sub-directory and a 60-byte entry name under its 1 MiB packet limit;
    /// every backend keeps the same limit so a name valid on one backend is valid on all
    /// whose extra rules it meets.
    pub const MAX_LEN: usize = 1024;

    /// Only the rules every backend shares (etcd needs no more).
    pub const fn common() -> Self {
        NameRules {
            reserved: None,
            forbidden: &[],
            entry_like_refused: false,
        }
    }

    /// These rules, and a name may not be `root` nor start with the segment `root`.
    pub const fn reserving(self, root: &'static str) -> Self {
        NameRules {
            reserved: Some(root),
            ..self
        }
    }

    /// These rules, and no segment of a name may have the form of a queue entry's name
    /// ([`NameError::EntryLike`]). For a backend whose sub-lock lives inside the lock
    /// above it (ZooKeeper: `a/lock-0000000001` is a child node of `a`, listed with
    /// `a`'s entries), where such a segment would be a phantom entry of that lock.
    pub const fn refusing_entry_like_segments(self) -> Self {
        NameRules {
            entry_like_refused: true,
            ..self
        }
    }

    /// These rules, and a name may contain none of `chars`.
    pub const fn forbidding(self, chars: &'static [char]) -> Self {
        NameRules {
            forbidden: chars,
            ..self
        }
    }
}

impl Default for NameRules {
    fn default() -> Self {
        NameRules::common()
    }
}

/// A lock name that passed validation. Always without leading or trailing `/`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LockName(Arc<str>);

impl LockName {
    /// Validates `name` against `rules`. A leading or trailing `/` is dropped, so `/a/b`
    /// and `a/b` name the same lock.
    ///
    /// # Errors
    /// [`Error::InvalidName`] saying what is wrong with the name.
    pub fn new(name: &str, rules: NameRules) -> Result<Self, Error> {
        Self::check(name, rules).map_err(|reason| Error::InvalidName {
            name: name.to_owned(),
            reason,
        })
    }

    fn check(name: &str, rules: NameRules) -> Result<Self, NameError> {
        if let Some(pos) = name.bytes().position(|b| b.is_ascii_control()) {
            return Err(NameError::ControlChar(pos));
        }
        if let Some(c) = name.chars().find(|c| {
            ('\u{7f}'..='\u{9f}').contains(c)
                || ('\u{e000}'..='\u{f8ff}').contains(c)
                || ('\u{fff0}'..='\u{ffff}').contains(c)
        }) {
            return Err(NameError::BadChar(c));
        }
        let trimmed = name.trim_matches('/');
        if trimmed.is_empty() {
            return Err(NameError::Empty);
        }
        if trimmed.len() > NameRules::MAX_LEN {
            return Err(NameError::TooLong {
                len: trimmed.len(),
                max: NameRules::MAX_LEN,
            });
        }
        if trimmed
            .split('/')
            .any(|seg| seg.is_empty() || seg == "." || seg == "..")
        {
            return Err(NameError::BadSegment);
        }
        if rules.entry_like_refused {
            // The first segment sits under no lock, so it shadows nothing.
            if let Some(seg) = trimmed
                .split('/')
                .skip(1)
                .find(|seg| crate::entry::parse_name(seg).is_some())
            {
                return Err(NameError::EntryLike(seg.to_owned()));
            }
        }
        if let Some(root) = rules.reserved {
            if trimmed.split('/').next() == Some(root) {
                return Err(NameError::Reserved(root));
            }
        }
        if let Some(c) = trimmed.chars().find(|c| rules.forbidden.contains(c)) {
            return Err(NameError::BadChar(c));
        }
        Ok(LockName(Arc::from(trimmed)))
    }

    /// The name without leading or trailing slash, e.g. `orders/42`.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LockName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks a prefix of lock names, as a listing takes it, and returns it normalised: a
/// leading `/` dropped, as from a name. `""` (or `/`) is every name. The prefix is a
/// plain string prefix: `orders/4` covers `orders/42` and `orders/4/x`, `orders/42/` only
/// the names below `orders/42`. What comes before a trailing `/` must be a valid name
/// (its last segment may be a partial one), so a prefix no valid name starts with is
/// refused rather than listed as empty.
///
/// # Errors
/// [`Error::InvalidName`] saying what is wrong with the prefix.
pub fn name_prefix(prefix: &str, rules: NameRules) -> Result<String, Error> {
    let p = prefix.trim_start_matches('/');
    if p.is_empty() {
        return Ok(String::new());
    }
    let body = p.strip_suffix('/').unwrap_or(p);
    if body.is_empty() || body.ends_with('/') {
        return Err(Error::InvalidName {
            name: prefix.to_owned(),
            reason: NameError::BadSegment,
        });
    }
    LockName::new(body, rules).map_err(|e| match e {
        Error::InvalidName { reason, .. } => Error::InvalidName {
            name: prefix.to_owned(),
            reason,
        },
        other => other,
    })?;
    Ok(p.to_owned())
}

/// One queue of entries under a lock: the lock itself, or one of its sub-directories
/// (the semaphore's `leases` and `locks`, as Curator lays them out).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct QueuePath {
    /// The lock the queue belongs to.
    pub lock: LockName,
    /// A sub-directory under the lock, or `None` for the lock's own directory.
    pub sub: Option<&'static str>,
}

impl QueuePath {
    /// The queue directly under `lock`.
    pub fn root(lock: LockName) -> Self {
        QueuePath { lock, sub: None }
    }

    /// The queue in `lock`'s sub-directory `sub`.
    pub fn sub(lock: LockName, sub: &'static str) -> Self {
        QueuePath {
            lock,
            sub: Some(sub),
        }
    }

    /// The path relative to the backend's root, e.g. `orders/42/leases`.
    pub fn relative(&self) -> String {
        match self.sub {
            Some(sub) => format!("{}/{}", self.lock, sub),
            None => self.lock.to_string(),
        }
    }
}

impl fmt::Display for QueuePath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.relative())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rules shaped like the adapters' (each adapter's own tests check its constant).
    const ZK: NameRules = NameRules::common()
        .reserving("zookeeper")
        .refusing_entry_like_segments();
    const ETCD: NameRules = NameRules::common();
    const REDIS: NameRules = NameRules::common().forbidding(&['{', '}']);

    fn bad(name: &str, rules: NameRules) -> NameError {
        match LockName::new(name, rules) {
            Err(Error::InvalidName { reason, .. }) => reason,
            other => panic!("expected InvalidName for {name:?}, got {other:?}"),
        }
    }

    #[test]
    fn accepts_and_normalises() {
        let n = LockName::new("/a/b/", ZK).expect("valid");
        assert_eq!(n.as_str(), "a/b");
        assert_eq!(
            LockName::new("orders-42", REDIS).expect("valid").as_str(),
            "orders-42"
        );
    }

    #[test]
    fn rejects_bad_names() {
        assert_eq!(bad("", ZK), NameError::Empty);
        assert_eq!(bad("///", ETCD), NameError::Empty);
        assert_eq!(bad("a\0b", ETCD), NameError::ControlChar(1));
        assert_eq!(bad("a//b", ZK), NameError::BadSegment);
        assert_eq!(bad("a/../b", ZK), NameError::BadSegment);
        assert_eq!(bad("zookeeper/quota", ZK), NameError::Reserved("zookeeper"));
        // Where a sub-lock lives inside the lock above it (ZooKeeper), a segment that
        // lock would list as its own entry; elsewhere such a name is fine.
        for entry_like in [
            "jobs/lock-99999999999",
            "jobs/lock-0000000001",
            "jobs/_c_3f2a6c1e-8d4b-4c5e-9f1a-2b3c4d5e6f70-__READ__0000000007",
            "app/release-42",
            "latch-0000000003/x/lock-1",
        ] {
            assert!(
                matches!(bad(entry_like, ZK), NameError::EntryLike(_)),
                "{entry_like}"
            );
            LockName::new(entry_like, ETCD).unwrap_or_else(|e| panic!("{entry_like}: {e}"));
        }
        for fine in [
            "jobs/lock",
            "jobs/lock-x",
            "jobs/locks",
            "lock-1a",
            "a/lock-",
        ] {
            LockName::new(fine, ZK).unwrap_or_else(|e| panic!("{fine}: {e}"));
        }
        assert_eq!(bad("a{b}", REDIS), NameError::BadChar('{'));
        assert!(matches!(
            bad(&"x".repeat(2000), ETCD),
            NameError::TooLong { .. }
        ));
    }

    #[test]
    fn name_prefixes() {
        assert_eq!(name_prefix("", ZK).expect("all"), "");
        assert_eq!(name_prefix("/", ZK).expect("all"), "");
        assert_eq!(name_prefix("/orders/4", ZK).expect("ok"), "orders/4");
        assert_eq!(name_prefix("orders/", ETCD).expect("ok"), "orders/");
        let refused = |p: &str, rules| match name_prefix(p, rules) {
            Err(Error::InvalidName { name, reason }) => {
                assert_eq!(name, p);
                reason
            }
            other => panic!("expected InvalidName for {p:?}, got {other:?}"),
        };
        assert_eq!(refused("a//", ETCD), NameError::BadSegment);
        assert_eq!(refused("a//b", ETCD), NameError::BadSegment);
        assert_eq!(refused("zookeeper/", ZK), NameError::Reserved("zookeeper"));
        assert_eq!(refused("a{", REDIS), NameError::BadChar('{'));
        assert_eq!(refused("a\0", ETCD), NameError::ControlChar(1));
    }

    #[test]
    fn queue_paths() {
        let n = LockName::new("s", ZK).expect("valid");
        assert_eq!(QueuePath::root(n.clone()).relative(), "s");
        assert_eq!(QueuePath::sub(n, "leases").relative(), "s/leases");
    }

    mod fuzz {
        use super::*;
        use proptest::prelude::*;

        const RULES: [NameRules; 3] = [ZK, ETCD, REDIS];

        /// Names built from the characters validation cares about, so the interesting
        /// branches (segments, reserved prefix, braces, control bytes) are hit often.
        fn tricky_name() -> impl Strategy<Value = String> {
            prop::collection::vec(
                prop_oneof![
                    Just("/".to_string()),
                    Just(".".to_string()),
                    Just("..".to_string()),
                    Just("zookeeper".to_string()),
                    Just("{".to_string()),
                    Just("}".to_string()),
                    Just("\0".to_string()),
                    Just("\u{7f}".to_string()),
                    Just("é".to_string()),
                    "[a-z0-9_-]{1,8}",
                    any::<char>().prop_map(String::from),
                ],
                0..40,
            )
            .prop_map(|parts| parts.concat())
        }

        proptest! {
            #![proptest_config(ProptestConfig::with_cases(2000))]

            /// Any input gets `Ok` or a typed `InvalidName`, never a panic; an accepted
            /// name is normalised, within the limit, and valid again as it stands.
            #[test]
            fn any_name_is_accepted_normalised_or_refused(
                name in prop_oneof![any::<String>(), tricky_name()],
                r in 0usize..3,
            ) {
                let rules = RULES[r];
                match LockName::new(&name, rules) {
                    Ok(n) => {
                        let s = n.as_str();
                        prop_assert!(!s.is_empty());
                        prop_assert!(!s.starts_with('/') && !s.ends_with('/'));
                        prop_assert!(s.len() <= NameRules::MAX_LEN);
                        prop_assert!(!s.chars().any(char::is_control));
                        prop_assert!(s.split('/').all(|seg| !seg.is_empty() && seg != "." && seg != ".."));
                        let again = LockName::new(s, rules).ok();
                        prop_assert_eq!(again, Some(n.clone()));
                    }
                    Err(Error::InvalidName { name: given, .. }) => prop_assert_eq!(given, name),
                    Err(other) => prop_assert!(false, "unexpected error {other:?}"),
                }
            }
        }
    }
}
