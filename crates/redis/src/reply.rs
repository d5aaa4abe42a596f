//! Parsing script replies into core types. A reply of an unexpected shape is an
//! [`Error::Backend`] (someone else's keys under our prefix, or a script/version mismatch),
//! never a panic.

use dlock_core::{Entry, Error, FencingToken};
use fred::prelude::Value;

fn malformed(what: &str) -> Error {
    Error::backend("parsing a script reply", format!("malformed reply: {what}"))
}

fn text(v: &Value) -> Option<String> {
    v.as_str().map(|s| s.into_owned())
}

fn number(v: &Value) -> Option<u64> {
    v.as_u64()
}

/// Parses `{name, seq, token[, created, data]...}`.
pub(crate) fn entries(v: Value, detail: bool) -> Result<Vec<Entry>, Error> {
    let items = match v {
        Value::Array(items) => items,
        Value::Null => Vec::new(),
        _ => return Err(malformed("queue listing is not an array")),
    };
    let width = if detail { 5 } else { 3 };
    if items.len() % width != 0 {
        return Err(malformed("queue listing has a ragged length"));
    }
    let mut out = Vec::with_capacity(items.len() / width);
    for chunk in items.chunks(width) {
        let name = text(&chunk[0]).ok_or_else(|| malformed("entry name"))?;
        // A member that does not parse as an entry name is not ours: skip it, as core
        // skips foreign children on ZooKeeper.
        let Some(mut e) = Entry::from_name(name) else {
            continue;
        };
        e.token = number(&chunk[2]).map(FencingToken::new);
        if detail {
            e.created_ms = chunk[3].as_i64();
            e.data = chunk[4].as_bytes().map(<[u8]>::to_vec).unwrap_or_default();
        }
        out.push(e);
    }
    Ok(out)
}

/// The reply of the enqueue script.
#[derive(Debug)]
pub(crate) enum Enqueue {
    /// Added: the new entry (without data) and the live queue.
    Added { mine: Entry, queue: Vec<Entry> },
    /// Redlock: the proposed sequence is not above this master's counter.
    Rejected { counter: u64 },
    /// The writer beside which a read entry was asked for is gone.
    Missing,
}

pub(crate) fn enqueue(v: Value) -> Result<Enqueue, Error> {
    let Value::Array(mut items) = v else {
        return Err(malformed("enqueue reply is not an array"));
    };
    let status = items.first().and_then(text).unwrap_or_default();
    match status.as_str() {
        "OK" if items.len() == 6 => {
            let list = items.pop().unwrap_or(Value::Null);
            let name = text(&items[1]).ok_or_else(|| malformed("entry name"))?;
            let mut mine = Entry::from_name(name.clone())
                .ok_or_else(|| malformed("created entry name does not parse"))?;
            mine.token = number(&items[3]).map(FencingToken::new);
            mine.created_ms = items[4].as_i64();
            Ok(Enqueue::Added {
                mine,
                queue: entries(list, false)?,
            })
        }
        "REJECT" if items.len() == 2 => Ok(Enqueue::Rejected {
            counter: number(&items[1]).ok_or_else(|| malformed("counter"))?,
        }),
        "MISSING" => Ok(Enqueue::Missing),
        _ => Err(malformed("unknown enqueue status")),
    }
}

/// Parses `ACQUIRE_SOLO`'s reply: the token as a number and as the decimal digits the
/// script wrote into the entry's name and value, or `None` (nil) when the lock has an
/// entry.
pub(crate) fn solo_token(v: Value) -> Result<Option<(u64, String)>, Error> {
    if v.is_null() {
        return Ok(None);
    }
    v.as_string()
        .filter(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|t| t.parse().ok().map(|n| Some((n, t))))
        .ok_or_else(|| malformed("solo acquire reply is not a token"))
}

/// Parses the renew script's `{0|1, ...}`.
pub(crate) fn renewed(v: Value, n: usize) -> Result<Vec<bool>, Error> {
    let items = match v {
        Value::Array(items) => items,
        Value::Null => Vec::new(),
        other => vec![other],
    };
    if items.len() != n {
        return Err(malformed("renew reply has the wrong length"));
    }
    Ok(items.iter().map(|v| v.as_i64() == Some(1)).collect())
}

/// The reply of the proclaim script.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Proclaim {
    /// Written.
    Done,
    /// The entry is gone (or another entry has its name): nothing written.
    Gone,
    /// The entry is queued behind `first`: it does not lead, nothing written.
    Behind { first: String },
}

pub(crate) fn proclaim(v: Value) -> Result<Proclaim, Error> {
    let Value::Array(items) = v else {
        return Err(malformed("proclaim reply is not an array"));
    };
    match items.first().and_then(text).as_deref() {
        Some("OK") => Ok(Proclaim::Done),
        Some("GONE") => Ok(Proclaim::Gone),
        Some("BEHIND") => Ok(Proclaim::Behind {
            first: items.get(1).and_then(text).unwrap_or_default(),
        }),
        _ => Err(malformed("unknown proclaim status")),
    }
}

/// One entry's token (if it parses) and data, as the read script reports them.
pub(crate) type EntryValue = (Option<u64>, Vec<u8>);

/// Parses the read script's `{token, data}` (nil: the entry is gone).
pub(crate) fn entry_value(v: Value) -> Result<Option<EntryValue>, Error> {
    match v {
        Value::Null => Ok(None),
        Value::Array(items) if items.len() == 2 => Ok(Some((
            number(&items[0]),
            items[1].as_bytes().map(<[u8]>::to_vec).unwrap_or_default(),
        ))),
        _ => Err(malformed("entry read is neither nil nor {token, data}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The solo acquire's token comes back with the digits the script wrote (the end of
    /// the entry's name and its value's second field); anything else is a typed error.
    #[test]
    fn solo_token_keeps_the_scripts_digits() {
        assert_eq!(solo_token(Value::Null).expect("nil"), None);
        assert_eq!(
            solo_token(Value::from("1795932003520063")).expect("token"),
            Some((1_795_932_003_520_063, "1795932003520063".to_owned()))
        );
        // An integer reply (a RESP3 server or a future script) is the same token.
        assert_eq!(
            solo_token(Value::Integer(1_795_932_003_520_063)).expect("integer"),
            Some((1_795_932_003_520_063, "1795932003520063".to_owned()))
        );
        for bad in ["", "12a", "-5", "1 2", "18446744073709551616"] {
            assert!(solo_token(Value::from(bad)).is_err(), "{bad:?}");
        }
    }
}
