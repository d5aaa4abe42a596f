//! Queue entries: what each contender adds under a lock, how it is named, and how the
//! queue is ordered.
//!
//! Names follow Apache Curator 5.x so that Java services and dlock share one queue:
//! `_c_<uuid>-lock-0000000007` for a mutex, `…-__READ__…` / `…-__WRIT__…` for the
//! read/write lock (one shared sequence), `…-lease-…` for semaphore leases, `…-latch-…`
//! for a leader-election candidate (Curator's `LeaderLatch`). The
//! `_c_<uuid>-` "protected" prefix lets a contender find its own entry after a create
//! whose reply was lost. Order is by the sequence part only, never by the whole name:
//! the uuid in front would otherwise decide the order.

use std::cmp::Ordering;
use std::fmt;
use std::sync::Arc;

use crate::token::FencingToken;

/// What an entry asks for.
///
/// Exhaustive on purpose: every adapter maps each kind to its wire layout, and a new
/// kind must fail their builds until they do, not fall into a catch-all arm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EntryKind {
    /// A mutex contender (Curator `lock-`).
    Lock,
    /// A read-lock contender (Curator `__READ__`).
    Read,
    /// A write-lock contender (Curator `__WRIT__`).
    Write,
    /// A semaphore lease (Curator `lease-`).
    Lease,
    /// A leader-election candidate (Curator `LeaderLatch`'s `latch-`): exclusive like
    /// [`EntryKind::Lock`], and its payload is the candidate's value as it is, with
    /// nothing around it, on every backend. Curator's `LeaderLatch` writes its
    /// participant id there, and etcd's `concurrency.Election` its proposal.
    Candidate,
}

impl EntryKind {
    /// Every kind, in a fixed order.
    pub const ALL: [EntryKind; 5] = [
        EntryKind::Lock,
        EntryKind::Read,
        EntryKind::Write,
        EntryKind::Lease,
        EntryKind::Candidate,
    ];

    /// The marker Curator puts between the protected prefix and the sequence number.
    pub const fn marker(self) -> &'static str {
        match self {
            EntryKind::Lock => "lock-",
            EntryKind::Read => "__READ__",
            EntryKind::Write => "__WRIT__",
            EntryKind::Lease => "lease-",
            EntryKind::Candidate => "latch-",
        }
    }

    /// True for entries that exclude everyone queued behind them.
    pub const fn is_exclusive(self) -> bool {
        matches!(
            self,
            EntryKind::Lock | EntryKind::Write | EntryKind::Candidate
        )
    }

    /// A short lower-case label, for status output.
    pub const fn label(self) -> &'static str {
        match self {
            EntryKind::Lock => "lock",
            EntryKind::Read => "read",
            EntryKind::Write => "write",
            EntryKind::Lease => "lease",
            EntryKind::Candidate => "candidate",
        }
    }
}

impl fmt::Display for EntryKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// The unique id a contender picks before it creates its entry. It goes into the entry's
/// name (Curator's protected prefix), so a create whose reply was lost, or whose future
/// was dropped, can still be found and removed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Ticket(Arc<str>);

impl Ticket {
    /// The ticket whose id is the version-4 uuid (as Curator uses) made of `random`, with
    /// its version and variant bits set. The caller draws the bytes (`dlock-recipes` from
    /// the operating system, a simulation from its seed): the core reads no randomness,
    /// so the same bytes always make the same ticket.
    pub fn from_random_bytes(random: [u8; 16]) -> Self {
        Ticket(Arc::from(
            uuid::Builder::from_random_bytes(random)
                .into_uuid()
                .hyphenated()
                .encode_lower(&mut uuid::Uuid::encode_buffer()) as &str,
        ))
    }

    /// The id text, a hyphenated uuid.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Curator's protected prefix for this ticket: `_c_<uuid>-`.
    pub fn protected_prefix(&self) -> String {
        self.prefix_then("", "")
    }

    /// The name prefix a sequential create should use for `kind`:
    /// `_c_<uuid>-lock-`; the server appends the 10-digit sequence.
    pub fn name_prefix(&self, kind: EntryKind) -> String {
        self.prefix_then(kind.marker(), "")
    }

    /// The entry of `kind` this ticket names with the sequence `digits`
    /// (`<name_prefix(kind)><digits>`), as [`Entry::from_name`] reads that name, without
    /// searching the name for its kind: the caller made it. `None` unless `digits` is 1
    /// to 20 decimal digits. A backend that learns a new entry's sequence from the
    /// server (the Redis fast path) builds the entry with this on every acquire.
    pub fn entry(&self, kind: EntryKind, digits: &str) -> Option<Entry> {
        let seq = plain_seq(digits)?;
        Some(Entry {
            name: self.prefix_then(kind.marker(), digits),
            kind,
            seq,
            token: None,
            ticket: Some(self.0.to_string()),
            created_ms: None,
            data: Vec::new(),
        })
    }

    /// `_c_<uuid>-` + `tail` + `more`, by appends into one allocation of the right size:
    /// built on every acquire, where `format!`'s machinery cost more than the copying
    /// (callgrind: about 2.5k instructions a call).
    fn prefix_then(&self, tail: &str, more: &str) -> String {
        let mut s = String::with_capacity(
            PROTECTED_PREFIX.len() + self.0.len() + 1 + tail.len() + more.len(),
        );
        s.push_str(PROTECTED_PREFIX);
        s.push_str(&self.0);
        s.push('-');
        s.push_str(tail);
        s.push_str(more);
        s
    }
}

/// The payload Curator's `Revoker.attemptRevoke` writes into a holder's entry to ask it
/// to release. Revocation is cooperative: a holder that does not watch its entry never
/// notices.
pub const REVOKE_MESSAGE: &[u8] = b"__REVOKE__";

/// The start of every protected name.
pub const PROTECTED_PREFIX: &str = "_c_";

/// Length of `_c_` + a hyphenated uuid + `-`.
const PROTECTED_LEN: usize = 3 + 36 + 1;

/// A parsed entry name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParsedName {
    /// The kind read from the marker.
    pub kind: EntryKind,
    /// The sequence number after the marker.
    pub seq: u64,
    /// The uuid of the protected prefix, if the name has one.
    pub protected_id: Option<String>,
}

/// Parses an entry name such as `_c_1fbf573b-3050-4ba4-a162-7ea7e63924ae-lock-0000000000`
/// or a bare `lock-0000000003`. The marker is searched from the end, as Curator does, so
/// a name containing the marker twice still parses.
///
/// Returns `None` for names that are not lock entries (a foreign child, a sub-directory
/// such as `leases`); such children never take part in the order.
///
/// ZooKeeper's sequence is the parent's `cversion`, a signed 32-bit counter of child
/// creations and deletions: after 2³¹ of them it wraps, and the server names the next
/// entries `…-2147483648` up to `…-000000001` (`%010d` of a negative int). Such a
/// sequence is read as its unsigned 32-bit value (2³¹ to 2³² − 1), which continues the
/// order across the wrap: `lock-2147483647` is followed by `lock--2147483648`, read as
/// 2³¹. (Curator compares the text after the marker and sorts those names first, so a
/// queue shared with Curator clients breaks at this first wrap.) The second wrap, from
/// 2³² − 1 back to 0, is caught by the ZooKeeper adapter, which refuses a new entry
/// whose queue still holds entries from before it (within the limits its
/// `refuse_across_the_wrap` gives).
pub fn parse_name(name: &str) -> Option<ParsedName> {
    EntryKind::ALL.iter().find_map(|&kind| {
        let at = name.rfind(kind.marker())?;
        let digits = &name[at + kind.marker().len()..];
        let seq = match digits.strip_prefix('-') {
            Some(neg) => wrapped_seq(neg)?,
            None => plain_seq(digits)?,
        };
        Some(ParsedName {
            kind,
            seq,
            protected_id: protected_id(name),
        })
    })
}

/// Up to 20 decimal digits, nothing else.
fn plain_seq(digits: &str) -> Option<u64> {
    if digits.is_empty() || digits.len() > 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// The digits after the `-` of a wrapped ZooKeeper sequence (`-2147483648` to
/// `-000000001`), as the unsigned 32-bit value of that negative int. Only the spelling
/// the server writes (`%010d`) is read: `-0000000001` is not an entry name.
fn wrapped_seq(digits: &str) -> Option<u64> {
    let magnitude = plain_seq(digits)?;
    if magnitude == 0 || magnitude > 1 << 31 || format!("{magnitude:09}") != digits {
        return None;
    }
    Some((1 << 32) - magnitude)
}

/// The uuid of a protected name (`_c_<uuid>-...`), if it has one.
pub fn protected_id(name: &str) -> Option<String> {
    let rest = name.strip_prefix(PROTECTED_PREFIX)?;
    if name.len() < PROTECTED_LEN || name.as_bytes()[PROTECTED_LEN - 1] != b'-' {
        return None;
    }
    let id = &rest[..36];
    uuid::Uuid::parse_str(id).ok()?;
    Some(id.to_owned())
}

/// Formats a sequence number as ZooKeeper does: ten digits, zero padded.
pub fn format_seq(seq: u64) -> String {
    format!("{seq:010}")
}

/// Formats a ZooKeeper sequence as the server writes it into a name: the inverse of
/// [`parse_name`]'s reading, so a value from 2³¹ to 2³² − 1 (a wrapped counter) comes
/// out negative, `%010d` of the signed 32-bit int.
pub fn format_zk_seq(seq: u64) -> String {
    match u32::try_from(seq) {
        Ok(v) => format!("{:010}", v as i32),
        Err(_) => format_seq(seq),
    }
}

/// One contender in a queue, as read from the backend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// The entry's name within its queue (a znode name, the last part of a key).
    pub name: String,
    /// What the entry asks for.
    pub kind: EntryKind,
    /// Its place in the queue: the ZooKeeper sequence, the etcd create revision, the
    /// Redis queue counter. Unique within one queue except for a downgrade's read
    /// entry, which shares its writer's number.
    pub seq: u64,
    /// The fencing token the entry carries, where the backend reports it on listing.
    pub token: Option<FencingToken>,
    /// The uuid of the ticket that created it, if known.
    pub ticket: Option<String>,
    /// When the server created the entry, in Unix milliseconds, where the backend
    /// records it (for status output only: never used for a decision).
    pub created_ms: Option<i64>,
    /// The entry's payload (Curator writes the client's address; dlock writes an owner
    /// description).
    pub data: Vec<u8>,
}

impl Entry {
    /// Whether `seen`, the token the server reports for an entry of this name, can be
    /// this entry's: they are equal where both are known. Another value means the name
    /// was taken again by a newer entry.
    pub fn token_matches(&self, seen: Option<FencingToken>) -> bool {
        match (self.token, seen) {
            (Some(mine), Some(seen)) => mine == seen,
            _ => true,
        }
    }

    /// Builds an entry from a Curator-style name, or `None` if the name is not an entry.
    pub fn from_name(name: impl Into<String>) -> Option<Self> {
        let name = name.into();
        let parsed = parse_name(&name)?;
        Some(Entry {
            kind: parsed.kind,
            seq: parsed.seq,
            ticket: parsed.protected_id,
            token: None,
            created_ms: None,
            data: Vec::new(),
            name,
        })
    }

    /// True if `ticket` created this entry.
    pub fn is_from(&self, ticket: &Ticket) -> bool {
        self.ticket.as_deref() == Some(ticket.as_str())
    }
}

/// Queue order: by sequence, then by name so the order is total. The name tie-break only
/// matters for a downgrade's read entry, which sorts beside its writer.
pub fn queue_order(a: &Entry, b: &Entry) -> Ordering {
    a.seq.cmp(&b.seq).then_with(|| a.name.cmp(&b.name))
}

/// Sorts a queue in place into [`queue_order`].
pub fn sort_queue(entries: &mut [Entry]) {
    entries.sort_by(queue_order);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn token_matches_where_both_are_known() {
        let mut e = Entry::from_name("x-lock-0000000001").expect("entry");
        assert!(e.token_matches(None));
        assert!(e.token_matches(Some(FencingToken::new(7))));
        e.token = Some(FencingToken::new(7));
        assert!(e.token_matches(Some(FencingToken::new(7))));
        assert!(!e.token_matches(Some(FencingToken::new(8))));
        assert!(e.token_matches(None));
    }

    #[test]
    fn parses_curator_names() {
        let p =
            parse_name("_c_1fbf573b-3050-4ba4-a162-7ea7e63924ae-lock-0000000031").expect("parse");
        assert_eq!(p.kind, EntryKind::Lock);
        assert_eq!(p.seq, 31);
        assert_eq!(
            p.protected_id.as_deref(),
            Some("1fbf573b-3050-4ba4-a162-7ea7e63924ae")
        );
        let r = parse_name("_c_ae920474-0000-4000-8000-000000000000-__READ__0000000004")
            .expect("parse");
        assert_eq!((r.kind, r.seq), (EntryKind::Read, 4));
        let c = parse_name("_c_0f4a4a2e-5bd6-4a8b-9d2e-3f6c1b2a9e77-latch-0000000012")
            .expect("parse a LeaderLatch node");
        assert_eq!((c.kind, c.seq), (EntryKind::Candidate, 12));
        assert!(EntryKind::Candidate.is_exclusive());
        let w = parse_name("x-__WRIT__0000000002").expect("parse");
        assert_eq!((w.kind, w.seq, w.protected_id), (EntryKind::Write, 2, None));
        assert_eq!(
            parse_name("lease-0000000009").map(|p| p.kind),
            Some(EntryKind::Lease)
        );
    }

    #[test]
    fn rejects_non_entries() {
        for name in [
            "leases",
            "locks",
            "lock-",
            "lock-12a",
            "",
            "__READ__x",
            "lock-123456789012345678901",
        ] {
            assert_eq!(parse_name(name), None, "{name}");
        }
    }

    #[test]
    fn ticket_prefix_round_trips() {
        let t = Ticket::from_random_bytes([0xab; 16]);
        assert_eq!(
            t,
            Ticket::from_random_bytes([0xab; 16]),
            "same bytes, same ticket"
        );
        assert_ne!(t, Ticket::from_random_bytes([0xac; 16]));
        let name = format!("{}{}", t.name_prefix(EntryKind::Write), format_seq(12));
        let e = Entry::from_name(name).expect("entry");
        assert!(e.is_from(&t));
        assert_eq!((e.kind, e.seq), (EntryKind::Write, 12));
    }

    #[test]
    fn orders_by_sequence_not_name() {
        let mut q: Vec<Entry> = [
            "_c_ffffffff-0000-4000-8000-000000000000-lock-0000000001",
            "_c_00000000-0000-4000-8000-000000000000-lock-0000000002",
            "_c_88888888-0000-4000-8000-000000000000-lock-0000000000",
        ]
        .into_iter()
        .filter_map(Entry::from_name)
        .collect();
        sort_queue(&mut q);
        assert_eq!(q.iter().map(|e| e.seq).collect::<Vec<_>>(), vec![0, 1, 2]);
    }

    /// ZooKeeper's counter wraps from 2147483647 to -2147483648: the order goes on
    /// across it (the names the server writes, read and written back).
    #[test]
    fn a_wrapped_zookeeper_sequence_sorts_after_the_last_positive_one() {
        let names = [
            "_c_00000000-0000-4000-8000-000000000000-lock--000000001",
            "_c_11111111-0000-4000-8000-000000000000-lock--2147483648",
            "_c_22222222-0000-4000-8000-000000000000-lock-2147483647",
            "_c_33333333-0000-4000-8000-000000000000-lock--2147483647",
        ];
        let mut q: Vec<Entry> = names.into_iter().filter_map(Entry::from_name).collect();
        assert_eq!(q.len(), 4, "every wrapped name parses");
        sort_queue(&mut q);
        let seqs: Vec<u64> = q.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            vec![(1 << 31) - 1, 1 << 31, (1 << 31) + 1, (1 << 32) - 1]
        );
        for e in &q {
            let tail = &e.name[e.name.rfind("lock-").expect("marker") + 5..];
            assert_eq!(
                format_zk_seq(e.seq),
                tail,
                "written back as the server wrote it"
            );
        }
        assert_eq!(format_zk_seq(7), "0000000007");
        for bad in [
            "lock--0",
            "lock--2147483649",
            "lock--00000001",
            "lock--0000000000",
            "lock---000000001",
            "lock--00000000001",
            "lock--0000000001",
            "lock--0999999999",
        ] {
            assert_eq!(parse_name(bad), None, "{bad}");
        }
    }

    proptest! {
        /// Every value ZooKeeper's signed counter takes is read back from the name the
        /// server makes of it, in the order the counter went.
        #[test]
        fn zookeeper_names_round_trip(v in any::<i32>()) {
            let name = format!("lock-{v:010}");
            let p = parse_name(&name).expect("parses");
            prop_assert_eq!(p.seq, u64::from(v as u32));
            prop_assert_eq!(format_zk_seq(p.seq), format!("{v:010}"));
        }

        #[test]
        fn parse_never_panics(s in "\\PC*") {
            let _ = parse_name(&s);
            let _ = protected_id(&s);
        }

        #[test]
        fn format_then_parse(seq in 0u64..10_000_000_000, k in 0usize..5, id in any::<[u8; 16]>()) {
            let kind = EntryKind::ALL[k];
            let t = Ticket::from_random_bytes(id);
            let e = Entry::from_name(format!("{}{}", t.name_prefix(kind), format_seq(seq))).expect("entry");
            prop_assert_eq!(e.kind, kind);
            prop_assert_eq!(e.seq, seq);
            prop_assert!(e.is_from(&t));
        }

        /// A ticket's entry is the one its name parses to, for any digits after the
        /// ticket's prefix: the same kind, sequence and ticket, or no entry at all.
        #[test]
        fn a_tickets_entry_is_its_parsed_name(digits in "[0-9]{0,22}|-?[0-9]{1,12}|\\PC{0,4}", k in 0usize..5, id in any::<[u8; 16]>()) {
            let kind = EntryKind::ALL[k];
            let t = Ticket::from_random_bytes(id);
            let parsed = Entry::from_name(format!("{}{digits}", t.name_prefix(kind)));
            match t.entry(kind, &digits) {
                Some(e) => prop_assert_eq!(Some(e), parsed),
                // Only a wrapped ZooKeeper sequence parses where a ticket's entry is
                // refused: no backend names its own new entry that way.
                None => prop_assert!(parsed.is_none() || digits.starts_with('-'), "{:?}", parsed),
            }
        }
    }
}
