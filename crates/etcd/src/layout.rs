//! Where entries live in etcd's key space, and how a key and its value become an [`Entry`].
//!
//! The layout is chosen so that etcd's own lock (`etcdctl lock NAME`, Go's
//! `concurrency.Mutex`, the server's v3lock service) and dlock exclude each other on the
//! same name. etcd's lock puts its key at `NAME/<lease id in lowercase hex>` and treats
//! *every* key under the prefix `NAME/` as a contender, ordered by create revision. So:
//!
//! | entry | key |
//! | --- | --- |
//! | mutex (`EntryKind::Lock`) | `NAME/<lease hex>`: exactly etcd's key |
//! | a second mutex contender of the same client on the same name | `NAME/<lease hex>-<ticket uuid>` |
//! | read lock | `NAME/<lease hex>-<ticket uuid>-r` |
//! | write lock | `NAME/<lease hex>-<ticket uuid>-w` |
//! | semaphore entry (ranked: the first N hold) | `NAME/permits/<lease hex>-<ticket uuid>-l` |
//! | Curator's layout, not written by the recipes on etcd: semaphore lease | `NAME/leases/<lease hex>-<ticket uuid>-l` |
//! | Curator's layout: semaphore's internal mutex | `NAME/locks/<lease hex>` |
//! | election candidate (`EntryKind::Candidate`) | `NAME/<lease hex>`: exactly the key of Go's `concurrency.Election` |
//! | a second candidate of the same client in the same election | `NAME/<lease hex>-<ticket uuid>` |
//!
//! A queue is the set of keys *directly* under its prefix: the semaphore's `permits/...`
//! keys are one level deeper than `NAME/...` and never appear in the root queue. etcd's
//! lock does not filter by depth, so it also waits for those deeper keys: that only makes
//! it more careful, never less.
//!
//! The value of a dlock key is `dlock1 <ticket uuid> <beside revision>\n` followed by the
//! caller's data. etcd's lock writes an empty value; a key without the header is read as
//! a foreign mutex contender whose whole value is its data. A candidate's value is its
//! data alone, as Go's `concurrency.Election` writes its proposal, so `etcdctl elect -l`
//! prints it; read back, a candidate is a [`EntryKind::Lock`] entry (the two layouts are
//! one: etcd's election and mutex keys cannot be told apart) without a ticket in its
//! value (`crate::claims` says how a retried enqueue copes).
//!
//! Everything in this module is pure, so the parsing is unit-tested without a server.

use dlock_core::entry::sort_queue;
use dlock_core::{Entry, EntryKind, FencingToken, QueuePath, Ticket};

/// The start of every value dlock writes.
const MAGIC: &[u8] = b"dlock1 ";

/// The key prefix of queue `q` under `namespace` (empty for none):
/// `<namespace>NAME/` or `<namespace>NAME/sub/`.
pub(crate) fn queue_prefix(namespace: &str, q: &QueuePath) -> String {
    // Appended, not formatted: this runs for every request that names a queue.
    let lock = q.lock.as_str();
    let sub_len = q.sub.map_or(0, str::len);
    let mut s = String::with_capacity(namespace.len() + lock.len() + sub_len + 2);
    s.push_str(namespace);
    s.push_str(lock);
    if let Some(sub) = q.sub {
        s.push('/');
        s.push_str(sub);
    }
    s.push('/');
    s
}

/// [`entry_key`] without a prefix: the entry's name.
#[cfg(test)]
pub(crate) fn entry_name(lease: i64, ticket: &Ticket, kind: EntryKind, primary: bool) -> String {
    entry_key("", lease, ticket, kind, primary)
}

/// The key a ticket's entry takes: `prefix` (its queue's) and the entry's name,
/// `<lease hex>-<ticket>` and a kind marker (`-r`, `-w`, `-l`; none for a lock or a
/// candidate), built in one string, since this runs for every enqueue.
///
/// `primary` asks for etcd's own mutex (or election) key, `<lease hex>`; it is only
/// meaningful for [`EntryKind::Lock`] and [`EntryKind::Candidate`], since the other kinds
/// always carry their ticket.
pub(crate) fn entry_key(
    prefix: &str,
    lease: i64,
    ticket: &Ticket,
    kind: EntryKind,
    primary: bool,
) -> String {
    use std::fmt::Write as _;
    let t = ticket.as_str();
    let mut s = String::with_capacity(prefix.len() + 16 + 1 + t.len() + 2);
    s.push_str(prefix);
    // Writing to a `String` cannot fail.
    let _ = write!(s, "{lease:x}");
    let tail = match kind {
        EntryKind::Lock | EntryKind::Candidate if primary => return s,
        EntryKind::Lock | EntryKind::Candidate => "",
        EntryKind::Read => "-r",
        EntryKind::Write => "-w",
        EntryKind::Lease => "-l",
    };
    s.push('-');
    s.push_str(t);
    s.push_str(tail);
    s
}

/// What an entry name says about its entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ParsedName {
    pub(crate) kind: EntryKind,
    /// The lease the key is bound to, if the name follows etcd's `<lease hex>` start.
    pub(crate) lease: Option<i64>,
    /// The ticket uuid in the name, if it has one.
    pub(crate) ticket: Option<String>,
}

/// Parses an entry name. Returns `None` for a key deeper than the queue (it belongs to a
/// sub-queue or another lock); any other name is an entry, and one dlock did not write is
/// read as a mutex contender, as etcd's lock reads it.
pub(crate) fn parse_name(name: &str) -> Option<ParsedName> {
    if name.is_empty() || name.contains('/') {
        return None;
    }
    let foreign = ParsedName {
        kind: EntryKind::Lock,
        lease: None,
        ticket: None,
    };
    let (head, rest) = match name.split_once('-') {
        Some((h, r)) => (h, Some(r)),
        None => (name, None),
    };
    let Some(lease) = parse_lease_hex(head) else {
        return Some(foreign);
    };
    let Some(rest) = rest else {
        return Some(ParsedName {
            kind: EntryKind::Lock,
            lease: Some(lease),
            ticket: None,
        });
    };
    let (uuid, kind) = match rest.len() {
        36 => (rest, EntryKind::Lock),
        38 => {
            // `get`, not indexing: anyone who may write under the lock's prefix can store
            // a name whose 36th byte falls inside a multi-byte character (then foreign).
            let (Some(uuid), Some(suffix)) = (rest.get(..36), rest.get(36..)) else {
                return Some(foreign);
            };
            let kind = match suffix {
                "-r" => EntryKind::Read,
                "-w" => EntryKind::Write,
                "-l" => EntryKind::Lease,
                _ => return Some(foreign),
            };
            (uuid, kind)
        }
        _ => return Some(foreign),
    };
    if !is_uuid(uuid) {
        return Some(foreign);
    }
    Some(ParsedName {
        kind,
        lease: Some(lease),
        ticket: Some(uuid.to_owned()),
    })
}

/// A lease id as etcd's Go client prints it (`%x`): lowercase hex of a positive id.
fn parse_lease_hex(s: &str) -> Option<i64> {
    if s.is_empty() || s.len() > 16 || !s.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return None;
    }
    i64::from_str_radix(s, 16).ok().filter(|id| *id > 0)
}

fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// The value dlock stores: a header naming the ticket (so a retried enqueue recognises its
/// own key) and, for a downgrade's read entry, the revision of the write it sits beside.
/// A candidate's value is `data` alone, as Go's `concurrency.Election` stores its
/// proposal.
pub(crate) fn encode_value(
    ticket: &Ticket,
    kind: EntryKind,
    beside: Option<u64>,
    data: &[u8],
) -> Vec<u8> {
    encode_value_for(ticket.as_str(), kind, beside, data)
}

/// [`encode_value`] for a ticket given by its uuid text.
pub(crate) fn encode_value_for(
    ticket: &str,
    kind: EntryKind,
    beside: Option<u64>,
    data: &[u8],
) -> Vec<u8> {
    if kind == EntryKind::Candidate {
        return data.to_vec();
    }
    let header = format!("{ticket} {}\n", beside.unwrap_or(0));
    let mut v = Vec::with_capacity(MAGIC.len() + header.len() + data.len());
    v.extend_from_slice(MAGIC);
    v.extend_from_slice(header.as_bytes());
    v.extend_from_slice(data);
    v
}

/// A decoded value.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Value<'a> {
    pub(crate) ticket: Option<&'a str>,
    pub(crate) beside: Option<u64>,
    pub(crate) data: &'a [u8],
}

/// Decodes a value; one without dlock's header is all data.
pub(crate) fn decode_value(v: &[u8]) -> Value<'_> {
    let plain = Value {
        ticket: None,
        beside: None,
        data: v,
    };
    let Some(rest) = v.strip_prefix(MAGIC) else {
        return plain;
    };
    let Some(nl) = rest.iter().position(|b| *b == b'\n') else {
        return plain;
    };
    let Ok(header) = std::str::from_utf8(&rest[..nl]) else {
        return plain;
    };
    let Some((ticket, beside)) = header.split_once(' ') else {
        return plain;
    };
    let Ok(beside) = beside.parse::<u64>() else {
        return plain;
    };
    if !is_uuid(ticket) {
        return plain;
    }
    Value {
        ticket: Some(ticket),
        beside: (beside > 0).then_some(beside),
        data: &rest[nl + 1..],
    }
}

/// One key/value as read from etcd, reduced to what the layout needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawKv<'a> {
    pub(crate) key: &'a [u8],
    pub(crate) value: &'a [u8],
    pub(crate) create_revision: i64,
}

/// Builds the entry for one key of the queue with prefix `prefix`, or `None` if the key is
/// not directly in that queue.
pub(crate) fn entry_from_kv(prefix: &str, kv: RawKv<'_>) -> Option<Entry> {
    let name = kv.key.strip_prefix(prefix.as_bytes())?;
    let name = std::str::from_utf8(name).ok()?;
    let parsed = parse_name(name)?;
    let value = decode_value(kv.value);
    let rev = u64::try_from(kv.create_revision).ok()?;
    // Only a read entry may sit beside a writer; anything else claiming it is ignored so a
    // foreign value cannot move an exclusive entry ahead in the queue.
    let seq = match (parsed.kind, value.beside) {
        (EntryKind::Read, Some(b)) => b,
        _ => rev,
    };
    Some(Entry {
        name: name.to_owned(),
        kind: parsed.kind,
        seq,
        token: Some(FencingToken::new(rev)),
        ticket: parsed.ticket.or_else(|| value.ticket.map(str::to_owned)),
        created_ms: None,
        data: value.data.to_vec(),
    })
}

/// The queue `prefix` from a range read of it, in queue order.
pub(crate) fn queue_from_kvs<'a>(
    prefix: &str,
    kvs: impl IntoIterator<Item = RawKv<'a>>,
) -> Vec<Entry> {
    let mut q: Vec<Entry> = kvs
        .into_iter()
        .filter_map(|kv| entry_from_kv(prefix, kv))
        .collect();
    sort_queue(&mut q);
    q
}

/// The queue path (relative to `namespace`) and the entry of one key of a listing, or
/// `None` unless the key is a lock entry bound to the lease its name starts with, as
/// every key dlock and etcd's own lock write is (`lease` is the key's lease, 0 for none).
/// Any key under a lock counts as a contender when a lock is taken, but a listing of a
/// shared etcd must not show every directory of configuration keys as a lock.
pub(crate) fn listed_entry(namespace: &str, kv: RawKv<'_>, lease: i64) -> Option<(String, Entry)> {
    let rel = std::str::from_utf8(kv.key.strip_prefix(namespace.as_bytes())?).ok()?;
    let (path, name) = rel.rsplit_once('/')?;
    if path.is_empty() || parse_name(name)?.lease != Some(lease) {
        return None;
    }
    let entry = entry_from_kv(&format!("{namespace}{path}/"), kv)?;
    Some((path.to_owned(), entry))
}

/// The queues of a listing, from its keys with their leases: each queue's entries in
/// queue order, queues sorted by path.
pub(crate) fn listed_queues<'a>(
    namespace: &str,
    kvs: impl IntoIterator<Item = (RawKv<'a>, i64)>,
) -> Vec<dlock_core::ListedQueue> {
    let mut by_path: std::collections::BTreeMap<String, Vec<Entry>> = Default::default();
    for (kv, lease) in kvs {
        if let Some((path, entry)) = listed_entry(namespace, kv, lease) {
            by_path.entry(path).or_default().push(entry);
        }
    }
    by_path
        .into_iter()
        .map(|(path, mut entries)| {
            sort_queue(&mut entries);
            dlock_core::ListedQueue::new(path, entries)
        })
        .collect()
}

/// The end of the key range of every key starting with `start` (etcd's prefix end:
/// the last byte below 0xff incremented, what follows it dropped), and the key to start
/// at: `\0` with the end `\0` for "every key" when `start` is empty.
pub(crate) fn prefix_range(start: &[u8]) -> (Vec<u8>, Vec<u8>) {
    if start.is_empty() {
        return (vec![0], vec![0]);
    }
    let mut end = start.to_vec();
    while let Some(&last) = end.last() {
        if last < 0xff {
            *end.last_mut().expect("not empty") += 1;
            return (start.to_vec(), end);
        }
        end.pop();
    }
    (start.to_vec(), vec![0])
}

/// The lease an entry is bound to, read from its name.
pub(crate) fn lease_of(entry: &Entry) -> Option<i64> {
    parse_name(&entry.name).and_then(|p| p.lease)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dlock_core::LockName;

    fn kv<'a>(key: &'a str, value: &'a [u8], rev: i64) -> RawKv<'a> {
        RawKv {
            key: key.as_bytes(),
            value,
            create_revision: rev,
        }
    }

    #[test]
    fn names_round_trip() {
        let t = dlock_testkit::ticket();
        let lease = 0x694d_7a1b_2c3d_4e5f;
        assert_eq!(
            entry_name(lease, &t, EntryKind::Lock, true),
            "694d7a1b2c3d4e5f"
        );
        // A candidate's key is Go's election key, which is etcd's mutex key: it reads
        // back as a mutex contender.
        assert_eq!(
            entry_name(lease, &t, EntryKind::Candidate, true),
            "694d7a1b2c3d4e5f"
        );
        for kind in EntryKind::ALL {
            let name = entry_name(lease, &t, kind, false);
            let p = parse_name(&name).expect("parses");
            let read_back = match kind {
                EntryKind::Candidate => EntryKind::Lock,
                other => other,
            };
            assert_eq!(p.kind, read_back, "{name}");
            assert_eq!(p.lease, Some(lease));
            assert_eq!(p.ticket.as_deref(), Some(t.as_str()));
        }
        let p = parse_name("694d7a1b2c3d4e5f").expect("parses");
        assert_eq!(
            (p.kind, p.lease, p.ticket),
            (EntryKind::Lock, Some(lease), None)
        );
        // The layout other clients and older versions read, exactly.
        for (kind, tail) in [
            (EntryKind::Lock, ""),
            (EntryKind::Candidate, ""),
            (EntryKind::Read, "-r"),
            (EntryKind::Write, "-w"),
            (EntryKind::Lease, "-l"),
        ] {
            let expected = format!("694d7a1b2c3d4e5f-{}{tail}", t.as_str());
            assert_eq!(entry_name(lease, &t, kind, false), expected);
            assert_eq!(
                entry_key("app/m/", lease, &t, kind, false),
                format!("app/m/{expected}")
            );
        }
        assert_eq!(
            entry_key("app/m/", lease, &t, EntryKind::Lock, true),
            "app/m/694d7a1b2c3d4e5f"
        );
    }

    #[test]
    fn foreign_and_deep_names() {
        // etcdctl's key is a mutex contender; so is anything else at depth one.
        for name in ["xyz", "694d-zz", "abc-1234", "ABC", "-", "0"] {
            let p = parse_name(name).expect("an entry");
            assert_eq!(p.kind, EntryKind::Lock, "{name}");
            assert_eq!(p.ticket, None, "{name}");
        }
        assert_eq!(parse_name("leases/694d-x-l"), None);
        assert_eq!(parse_name(""), None);
        // 38 bytes after the lease, the 36th inside a two-byte character: anyone may
        // store such a key under a lock's prefix (it used to panic every reader).
        let odd = format!("1-{}\u{e9}b", "a".repeat(35));
        let p = parse_name(&odd).expect("an entry");
        assert_eq!((p.kind, p.ticket), (EntryKind::Lock, None));
    }

    #[test]
    fn listings_keep_lease_bound_lock_keys() {
        let t = dlock_testkit::ticket();
        let lease = 0x694d_7a1b_2c3d_4e5f_i64;
        let key = |path: &str, kind, primary| {
            format!("app1/{path}/{}", entry_name(lease, &t, kind, primary))
        };
        let (m1, m2) = (
            key("m", EntryKind::Lock, true),
            key("m", EntryKind::Write, false),
        );
        let lease_key = key("s/leases", EntryKind::Lease, false);
        let etcdctl = format!("app1/e/{lease:x}");
        let (other, bare) = (
            key("other", EntryKind::Lock, true),
            key("bare", EntryKind::Lock, true),
        );
        let outside = format!("app2/n/{lease:x}");
        let keys = [
            (kv(&m2, b"", 7), lease),
            (kv(&m1, b"", 5), lease),
            (kv(&lease_key, b"", 6), lease),
            // etcd's own lock key: its name is its lease.
            (kv(&etcdctl, b"", 8), lease),
            // A configuration key, a key on another lease than its name says, a key on
            // no lease, a key outside the namespace: no lock entries.
            (kv("app1/config/db/url", b"x", 9), lease),
            (kv(&other, b"", 10), lease + 1),
            (kv(&bare, b"", 11), 0),
            (kv(&outside, b"", 12), lease),
        ];
        let listed = listed_queues("app1/", keys);
        let got: Vec<(&str, Vec<u64>)> = listed
            .iter()
            .map(|q| (q.path.as_str(), q.entries.iter().map(|e| e.seq).collect()))
            .collect();
        assert_eq!(
            got,
            [("e", vec![8]), ("m", vec![5, 7]), ("s/leases", vec![6])]
        );
        assert_eq!(listed[2].entries[0].kind, EntryKind::Lease);
    }

    #[test]
    fn prefix_ranges() {
        assert_eq!(prefix_range(b""), (vec![0], vec![0]));
        assert_eq!(prefix_range(b"ab"), (b"ab".to_vec(), b"ac".to_vec()));
        assert_eq!(prefix_range(b"a\xff"), (b"a\xff".to_vec(), b"b".to_vec()));
        assert_eq!(prefix_range(b"\xff\xff"), (b"\xff\xff".to_vec(), vec![0]));
    }

    #[test]
    fn values_round_trip() {
        let t = dlock_testkit::ticket();
        let v = encode_value(&t, EntryKind::Lock, Some(42), b"host:1 pid 7\nmore");
        let d = decode_value(&v);
        assert_eq!(d.ticket, Some(t.as_str()));
        assert_eq!(d.beside, Some(42));
        assert_eq!(d.data, b"host:1 pid 7\nmore");
        let v = encode_value(&t, EntryKind::Lock, None, b"");
        assert_eq!(decode_value(&v).beside, None);
        for plain in [&b""[..], b"dlock1 x", b"dlock1 nope 3\nd", b"hello"] {
            let d = decode_value(plain);
            assert_eq!((d.ticket, d.data), (None, plain), "{plain:?}");
        }
    }

    #[test]
    fn queue_prefix_is_the_namespace_and_the_relative_path() {
        let name = LockName::new("orders/42", crate::NAME_RULES).expect("valid");
        for (ns, q) in [
            ("", QueuePath::root(name.clone())),
            ("app/", QueuePath::root(name.clone())),
            ("app/", QueuePath::sub(name, "leases")),
        ] {
            assert_eq!(queue_prefix(ns, &q), format!("{ns}{}/", q.relative()));
        }
    }

    #[test]
    fn queue_filters_depth_and_sorts_beside() {
        let name = LockName::new("orders/42", crate::NAME_RULES).expect("valid");
        let prefix = queue_prefix("", &QueuePath::root(name));
        assert_eq!(prefix, "orders/42/");
        let t = dlock_testkit::ticket();
        let w = format!(
            "orders/42/{}",
            entry_name(0x10, &t, EntryKind::Write, false)
        );
        let r_name = entry_name(0x10, &t, EntryKind::Read, false);
        let r = format!("orders/42/{r_name}");
        let r_val = encode_value(&t, EntryKind::Read, Some(5), b"");
        let q = queue_from_kvs(
            &prefix,
            [
                kv("orders/42/1a", b"", 3),
                kv(&w, b"", 5),
                kv("orders/42/leases/10-x-l", b"", 6),
                kv("orders/42/20", b"", 7),
                kv(&r, &r_val, 9),
                kv("orders/420/30", b"", 10),
            ],
        );
        let seqs: Vec<u64> = q.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, vec![3, 5, 5, 7]);
        // The read sorts beside its writer (same seq; the name breaks the tie).
        let read = q
            .iter()
            .find(|e| e.name == r_name)
            .expect("read entry listed");
        assert_eq!(read.seq, 5);
        assert_eq!(read.token, Some(FencingToken::new(9)));
        assert_eq!(read.ticket.as_deref(), Some(t.as_str()));
        // A candidate's value is its data alone, as Go's election writes it.
        assert_eq!(
            encode_value(&t, EntryKind::Candidate, None, b"host-a:8080"),
            b"host-a:8080"
        );
        // A beside claim on an exclusive entry is ignored.
        let v = encode_value(&t, EntryKind::Lock, Some(1), b"");
        let e = entry_from_kv(&prefix, kv("orders/42/99", &v, 12)).expect("entry");
        assert_eq!(e.seq, 12);
    }
}
