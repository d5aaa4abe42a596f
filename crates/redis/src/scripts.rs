//! The Lua scripts: every state change is one of these, run atomically by the server.
//!
//! Each script takes the same three keys, all under the lock's hash tag so that the script
//! runs on one Redis Cluster slot: `KEYS[1]` the queue's sorted set, `KEYS[2]` its
//! sequence counter (Redlock proposals only), `KEYS[3]` the lock's token counter. Entry
//! keys and channels are built inside the script from prefixes passed in `ARGV`, because
//! their names depend on the sequence the script itself draws (they share the hash tag,
//! so they live on the same slot; see the crate docs).
//!
//! Scripts are sent with `EVALSHA` and loaded on `NOSCRIPT` (fred's
//! `Script::evalsha_with_reload`), so a server restart that forgets them costs one extra
//! round trip, never a replayed write: a `NOSCRIPT` reply means the script did not run.
//! (On a cluster the reload is an `EVAL`, which goes to the slot's master.)
//!
//! # What each script costs
//! Every command a script runs is server time on the lock's hot path (and a `calls` count
//! in `INFO commandstats`), so the scripts run only what the state change needs:
//! - an uncontended acquire + release is 4 commands in two small scripts of their own
//!   (`ACQUIRE_SOLO`: TIME and one SET NX PX of the lock's one key; `RELEASE_SOLO`: GET
//!   and DEL, publishing nothing), where the queue layout took 9 in the general scripts.
//!   The queue (sorted set, entry keys, counters) is made only when a second entry
//!   arrives, or a client watches the entry (`UNSOLO`). Measured with callgrind on
//!   redis-server 7.0.15: about 67k instructions per pair (75k when `RELEASE_SOLO`
//!   matched the holder's name and `ACQUIRE_SOLO` took the lease as an argument, 83k
//!   with the release's publish, 176k before the fast path) against 33.5k for the
//!   `SET NX PX` + compare-and-delete pair of rslock and redis-py; what is left is the
//!   cost of running a script at all, twice, and `TIME` (see docs/benchmarks.md, S3);
//! - nothing is published when an entry is added: the queue channel is read only by
//!   `wait_changed`, whose caller waits for leases to go, never to come;
//! - a removal tells the waiter watching the entry whether it was the head of the queue
//!   (`removed head`), so on one master a contended handoff is the remove and its message,
//!   with no listing by the woken waiter;
//! - a queue's keys need no TTL bookkeeping beyond `PEXPIRE <queue> <lease> GT` (Redis
//!   7.0+): the counters are written with `PX <lease>` and are floors, not the truth (the
//!   token is floored at the server clock, a Redlock proposal must be above every queued
//!   sequence), so their expiring early is harmless;
//! - on one master an entry's sequence *is* its token, so no sequence counter is kept;
//! - a woken waiter lists only the entries scored up to its own (`ZRANGEBYSCORE`), so
//!   its re-check costs O(entries ahead of it), not O(queue), and the enqueue lists the
//!   queue without reading each entry, so n waiters queue in O(n) commands, not O(n²);
//! - nothing is published for an entry that did not exist (an idempotent second remove).

use fred::types::scripts::Script;

/// Helpers shared by every script.
///
/// `ent` splits an entry value `<token> <created ms> <data>`. `live` lists the queue (or
/// with `upto`, only the members scored up to it) and lazily drops members whose entry key
/// expired (a dead client's entry), publishing `expired` on their gone-channel so that a
/// waiter watching one wakes at once instead of at its re-check timer. `tidy` deletes the
/// counters once the queue is empty so that an idle lock leaves no key behind. `solo`
/// reads the lock's lone entry when `KEYS[1]` holds one (a string, see [`SOLO`]), and
/// fails the script, before it writes anything, when that string is not
/// `<name> <token digits> <data>` (the caller gets a typed backend error), and
/// `unsolo` moves it into the queue layout (entry key, sorted-set member, the same TTL:
/// a key in its last millisecond, `PTTL` 0, keeps 1 ms, not a new lease; only a key
/// without any TTL, which dlock never writes, gets the lease) before a second entry joins
/// it: every script that reads or changes the queue checks
/// `KEYS[1]`'s type first, because the sorted-set commands fail on a string. `num`
/// writes a whole number below 2^53 in decimal (with `pad`, a `%0Nd` format with N at
/// most ten, applied to numbers below 10^9 only: larger ones have ten digits or more),
/// formatting nine digits at a time so that a 32-bit C `long` holds each part (see
/// [`ENQUEUE`]). Its carry line never fires below 2^53 (`n / 1e9` is rounded to nearest,
/// and the quotient's distance to the next integer, at least 1e-9, exceeds half its ulp
/// there, about 0.93e-9): it is kept because that margin is thin, and costs a compare.
const PRELUDE: &str = r#"
local function ent(v)
  local i = string.find(v, ' ', 1, true)
  local j = i and string.find(v, ' ', i + 1, true)
  if not j then return v, '0', '' end
  return string.sub(v, 1, i - 1), string.sub(v, i + 1, j - 1), string.sub(v, j + 1)
end
local function solo()
  if redis.call('TYPE', KEYS[1]).ok ~= 'string' then return nil end
  local v = redis.call('GET', KEYS[1])
  if not string.find(v, '^[^ ]+ %d+ ') then
    return error('dlock: malformed solo entry at ' .. KEYS[1])
  end
  local i = string.find(v, ' ', 1, true)
  local j = string.find(v, ' ', i + 1, true)
  return string.sub(v, 1, i - 1), string.sub(v, i + 1, j - 1), string.sub(v, j + 1)
end
local function unsolo(ep, lease)
  local name, tok, data = solo()
  if not name then return end
  local ttl = redis.call('PTTL', KEYS[1])
  if ttl == -1 then ttl = lease elseif ttl < 1 then ttl = 1 end
  redis.call('DEL', KEYS[1])
  redis.call('SET', ep .. name, tok .. ' ' .. string.sub(tok, 1, -4) .. ' ' .. data, 'PX', ttl)
  redis.call('ZADD', KEYS[1], tok, name)
  redis.call('PEXPIRE', KEYS[1], ttl)
end
local function num(n, pad)
  if n < 1e9 then return string.format(pad or '%d', n) end
  local hi = math.floor(n / 1e9)
  local lo = n - hi * 1e9
  if lo < 0 then hi, lo = hi - 1, lo + 1e9 elseif lo >= 1e9 then hi, lo = hi + 1, lo - 1e9 end
  return string.format('%d%09d', hi, lo)
end
local function tidy()
  if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[2], KEYS[3]) end
end
local function drop(ep, gp, qc, name, why)
  local n = redis.call('DEL', ep .. name)
  local z = redis.call('ZREM', KEYS[1], name)
  if n + z > 0 then
    redis.call('PUBLISH', gp .. name, why)
    redis.call('PUBLISH', qc, name)
  end
  return n
end
local function live(ep, gp, qc, detail, upto)
  local m
  if upto then
    m = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', upto, 'WITHSCORES')
  else
    m = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  end
  local out = {}
  local dropped = false
  for i = 1, #m, 2 do
    local name = m[i]
    local v = redis.call('GET', ep .. name)
    if v then
      local t, c, d = ent(v)
      out[#out + 1] = name
      out[#out + 1] = m[i + 1]
      out[#out + 1] = t
      if detail then
        out[#out + 1] = c
        out[#out + 1] = d
      end
    else
      drop(ep, gp, qc, name, 'expired')
      dropped = true
    end
  end
  local top = 0
  if #m > 0 then top = tonumber(m[#m]) end
  -- The key exists iff a live member is left: dropping the last expired one deleted it.
  return out, top, #out > 0, dropped
end
"#;

/// The uncontended acquire, a script of its own so that it takes no argument it does
/// not use (each key and argument of an `EVALSHA` costs the server about 1k instructions
/// to hand to Lua): a lock with no entry takes its first as one string at the queue's
/// own key, `KEYS[1]` = `<name> <token> <data>` with the lease as its TTL (the sequence
/// is the token; the creation ms is the token's µs / 1000). There is no sorted set, no
/// entry key and no counter: `TIME` and one `SET NX PX`, where the queue layout takes
/// five commands. `SET NX` on the queue's key is also the exclusion: it fails whenever
/// the lock has any entry, solo (a string) or queued (a sorted set); the client then
/// sends [`ENQUEUE`], whose `unsolo` moves a solo entry into the queue layout before it
/// adds the second. The token is the server clock in µs, as the first entry of an empty
/// queue has always taken (see [`ENQUEUE`]).
///
/// `LEASE_MS` is replaced by the backend's lease, a constant of the backend, when the
/// scripts are built ([`Scripts::new`]), so it is not an argument. The microseconds are
/// padded to six digits only when they need it (one in ten calls): the padding's two
/// strings were about 1k instructions per acquire.
///
/// ARGV: name prefix, and the data only when there is any (most locks carry none).
/// Returns the token, or nil if the lock has an entry.
const ACQUIRE_SOLO: &str = r#"
local t = redis.call('TIME')
local us = t[2]
if #us < 6 then us = string.sub('00000' .. us, -6) end
local tok = t[1] .. us
if redis.call('SET', KEYS[1], ARGV[1] .. tok .. ' ' .. tok .. ' ' .. (ARGV[2] or ''), 'NX', 'PX', 'LEASE_MS') then
  return tok
end
return false
"#;

/// The release of an entry [`ACQUIRE_SOLO`] created: it goes with its one key. ARGV:
/// the entry's whole value as [`ACQUIRE_SOLO`] wrote it, `<name> <token> <data>`, which
/// the client knows, or only `<name> ` when the data is long (the client does not send
/// it back). Returns 1 (removed), 2 (removed, found by the name: the value differed from
/// the argument), 0 (not there: `KEYS[1]` is missing or another entry's solo string) or
/// -1: the lock is in the queue layout now (a second entry joined, or a watcher moved
/// it there with [`UNSOLO`]), so the client sends [`REMOVE`]. A string that is not a
/// solo entry fails the script (as `solo` does) and is left alone.
///
/// The common case is one comparison of two strings Lua has already interned (rslock's
/// own release), with no pattern matched and no string built: matching the holder's
/// name in the value instead cost about 6k instructions per acquire + release. A solo
/// string is written only by [`ACQUIRE_SOLO`]'s `SET NX` and never changed in place, so
/// the holder's value is exactly what it sent; a string that differs from it but
/// carries the holder's name (which no dlock client writes) is still the holder's and
/// is removed, as it was when the script matched names.
///
/// Nothing is published: a solo entry has no waiter (a contender's enqueue moves it into
/// the queue layout first) and no watcher (a client that watches it, with no entry of
/// its own, moves it there with [`UNSOLO`] once it listens), so a release that finds the
/// string finds nobody to tell. Measured with callgrind on redis-server 7.0.15, the
/// steps taken out of this script (per uncontended acquire + release, 91.2k instructions
/// at first): the queue channel's `PUBLISH` (-4.6k), the full pattern match of the
/// holder's own value, later the name match (-2.9k, then about -6k), and the
/// gone-channel's `PUBLISH` with its argument (see docs/benchmarks.md).
const RELEASE_SOLO: &str = r#"
local v = redis.pcall('GET', KEYS[1])
if v == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
if type(v) == 'table' then return -1 end
if not v then return 0 end
if not string.find(v, '^[^ ]+ %d+ ') then
  return error('dlock: malformed solo entry at ' .. KEYS[1])
end
local n = string.find(ARGV[1], ' ', 1, true)
if n and string.sub(v, 1, n) == string.sub(ARGV[1], 1, n) then
  redis.call('DEL', KEYS[1])
  return 2
end
return 0
"#;

/// A watcher's first step on an entry that may be the lock's solo one, once it listens
/// on the entry's gone-channel: moves that entry into the queue layout (`unsolo`), whose
/// removal ([`REMOVE`]) is published, where [`RELEASE_SOLO`] publishes nothing. Any
/// other entry, solo or queued, is left as it is. ARGV: entry-key prefix, lease ms,
/// name. Returns the entry key's `PTTL` afterwards (-2: the entry is gone).
const UNSOLO: &str = r#"
if solo() == ARGV[3] then unsolo(ARGV[1], ARGV[2]) end
return redis.call('PTTL', ARGV[1] .. ARGV[3])
"#;

/// [`REMOVE`]'s first step: a queue whose key holds a solo string (see
/// [`ACQUIRE_SOLO`]) has no sorted set to run [`REMOVE`] on. The named entry is that
/// string (removed as [`RELEASE_SOLO`] removes it) or is not there at all.
const SOLO_REMOVE: &str = r#"
if #ARGV == 4 and redis.call('TYPE', KEYS[1]).ok == 'string' then
  local v = redis.call('GET', KEYS[1])
  if not string.find(v, '^[^ ]+ %d+ ') then
    return error('dlock: malformed solo entry at ' .. KEYS[1])
  end
  if string.sub(v, 1, #ARGV[4] + 1) ~= ARGV[4] .. ' ' then return 0 end
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2] .. ARGV[4], 'removed head')
  redis.call('PUBLISH', ARGV[3], ARGV[4])
  return 1
end
"#;

/// Adds an entry and returns the queue in the same round trip.
///
/// The queue is listed without reading each entry (no token for the others, and an
/// expired entry not yet dropped is still listed): the driver needs only names and
/// sequences, and an expired entry ahead is found gone by its watcher's `wait_gone`,
/// whose next listing drops it. Reading every entry here made a queue of n waiters cost
/// O(n²) server work to build.
///
/// ARGV: entry-key prefix, gone-channel prefix, queue channel, name prefix
/// (`_c_<uuid>-<marker>`), lease ms, data, mode, proposed sequence, writer name.
/// Modes: `tail` (single master) takes the new token as the sequence: tokens only grow,
/// and it is kept above every queued sequence; `cas` accepts the proposed sequence only if
/// it is above the master's counter and every queued sequence, and otherwise returns
/// `{'REJECT', counter}` (Redlock: the same name on every master); `beside` reuses the
/// writer's sequence if the writer's entry still exists, otherwise returns `{'MISSING'}`.
///
/// The token is the lock's counter + 1, floored at the server clock in microseconds: the
/// counter is deleted with an idle lock (and lost by a restart without persistence), and
/// the floor keeps tokens growing across both. An empty queue has no counter (it went
/// with the queue's last entry), so `tail` into an empty queue takes the clock and leaves
/// the counter unwritten: while that entry is queued its sequence is the queue's top,
/// which every later token is above, and an entry queued behind it writes the counter.
///
/// The entry key is a string `<token> <created ms> <data>` with the lease as its TTL.
///
/// Numbers are written by `num` (the prelude's), not `%.0f`, which goes through glibc's
/// float printer (about 6 % of the server's instructions per uncontended acquire +
/// release, callgrind on redis-server), nor `%d` on the whole number: Lua 5.1 formats
/// `%d` through a C `long`, which is 32 bits on a 32-bit build and on Windows ports of
/// Redis, where a token of 16 digits would come out clamped or wrapped (every entry the
/// same sequence and token: order and tokens gone). `num` formats at most nine digits
/// per `%d`, exact for every integer below 2^53 (tokens, sequences, ms clocks) whatever
/// the `long`.
///
/// A `tail` enqueue is idempotent per ticket: when the queue already has a live entry
/// whose name starts with this ticket's prefix (tickets are drawn anew for every
/// acquire), that entry is returned and nothing is added. The script can run twice for
/// one request: on a cluster fred fails a command that was in flight on a connection it
/// found broken while following another command's `MOVED` with the same error it gives
/// a `MOVED` it did not follow, which [`crate::node`] takes as "not run" and sends again.
/// A second entry would queue the contender behind its own first one, unrenewed, until
/// that one's lease ran out. (An `ACQUIRE_SOLO` run twice returns nil the second time;
/// the client then sends this script, whose `unsolo` moves the first run's entry into
/// the queue, where it is found.) The entry found is given a whole lease again (and the
/// queue's key at least that): the client files it with the send time of the request
/// that found it, and counts its lease from then, while the first run, up to a command
/// timeout earlier, started the server's. Redlock's `cas` and `beside` are left as they were:
/// their sequence is the client's proposal, and a retry there is a new proposal.
///
/// Returns `{'OK', name, seq, token, created_ms, {name, seq, token, ...}}`.
const ENQUEUE: &str = r#"
local ep, gp, qc, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease, data, mode, p, writer = ARGV[5], ARGV[6], ARGV[7], ARGV[8], ARGV[9]
unsolo(ep, lease)
local cur
if mode == 'cas' then
  cur = tonumber(redis.call('GET', KEYS[2]) or '0')
  if tonumber(p) <= cur then return {'REJECT', num(cur)} end
elseif mode == 'beside' then
  if redis.call('EXISTS', ep .. writer) == 0 then return {'MISSING'} end
end
local m = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local out = {}
local again
for i = 1, #m, 2 do
  out[#out + 1] = m[i]
  out[#out + 1] = m[i + 1]
  out[#out + 1] = ''
  if mode == 'tail' and string.find(m[i], prefix, 1, true) == 1 then again = i end
end
if again then
  local v = redis.call('GET', ep .. m[again])
  if v then
    -- The client files the entry with this run's send time: its lease runs from now.
    redis.call('PEXPIRE', ep .. m[again], lease)
    redis.call('PEXPIRE', KEYS[1], lease, 'GT')
    local tok_s, now_s = ent(v)
    out[again + 2] = tok_s
    return {'OK', m[again], m[again + 1], tok_s, now_s, out}
  end
end
local top = 0
if #m > 0 then top = tonumber(m[#m]) end
local existed = #m > 0
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
-- An empty queue has no counter (it goes with the queue's last entry), so a tail entry
-- into one takes the clock, and the counter is first written by an entry queued behind.
local counted = existed or mode ~= 'tail'
local tok = now_us
if counted then
  local c = tonumber(redis.call('GET', KEYS[3]) or '0') + 1
  if tok < c then tok = c end
end
local seq
if mode == 'tail' then
  if tok <= top then tok = top + 1 end
  seq = tok
elseif mode == 'cas' then
  seq = tonumber(p)
  if seq <= top then return {'REJECT', num(top)} end
  redis.call('SET', KEYS[2], p, 'PX', lease)
else
  seq = tonumber(p)
end
local tok_s = num(tok)
local seq_s = num(seq)
local name = prefix .. num(seq, '%010d')
local now_s = num(now_ms)
if counted then redis.call('SET', KEYS[3], tok_s, 'PX', lease) end
redis.call('SET', ep .. name, tok_s .. ' ' .. now_s .. ' ' .. data, 'PX', lease)
redis.call('ZADD', KEYS[1], seq_s, name)
if existed then
  redis.call('PEXPIRE', KEYS[1], lease, 'GT')
else
  redis.call('PEXPIRE', KEYS[1], lease)
end
out[#out + 1] = name
out[#out + 1] = seq_s
out[#out + 1] = tok_s
return {'OK', name, seq_s, tok_s, now_s, out}
"#;

/// Lists the live queue. ARGV: entry-key prefix, gone-channel prefix, queue channel,
/// `1` for details (creation time and data), and a sequence to list only the members
/// scored up to it (empty: all). Returns `{name, seq, token[, created, data]...}`.
const LIST: &str = r#"
local upto = nil
if ARGV[5] and ARGV[5] ~= '' then upto = ARGV[5] end
local sname, stok, sdata = solo()
if sname then
  if upto and tonumber(stok) > tonumber(upto) then return {} end
  if ARGV[4] == '1' then return {sname, stok, stok, string.sub(stok, 1, -4), sdata} end
  return {sname, stok, stok}
end
local out, top, existed, dropped = live(ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1', upto)
if dropped then tidy() end
return out
"#;

/// Removes the named entries (remove: one name; idempotent). ARGV: entry-key prefix,
/// gone-channel prefix, queue channel, names... Publishes on each removed entry's
/// gone-channel so that only the waiter watching it wakes. Returns how many keys it
/// deleted (the client reads only that it succeeded).
///
/// The queue's only entry goes with the queue and the counters in one `DEL`. Its
/// gone-channel message is still sent: a waiter needs no entry of its own to watch one
/// (`Backend::wait_gone` takes any entry), and without the message it would wake only at
/// its re-check timer.
///
/// A single name is published as `removed head` when no other member was scored up to
/// its own (`dlock_core::Gone::Head`: its watcher needs no listing), otherwise as
/// `removed`. The first two members tell that and whether the queue is now empty, so the
/// check replaces `tidy`'s `EXISTS`: no command more than before. A member whose entry
/// key expired still counts as ahead, which only costs its watcher a listing. A head
/// removal with a second member also names it, `removed head <name>`, when its entry
/// key is there (one `EXISTS`): that entry was live at the removal, so its waiter, woken
/// by this message, needs no look-up of its own before it holds
/// (`RedisBackend::wait_gone_behind`).
const REMOVE: &str = r#"
if #ARGV == 4 then
  local name = ARGV[4]
  local m = redis.call('ZRANGE', KEYS[1], 0, 1, 'WITHSCORES')
  if m[1] == name and m[3] == nil then
    local n = redis.call('DEL', ARGV[1] .. name, KEYS[1], KEYS[2], KEYS[3])
    redis.call('PUBLISH', ARGV[2] .. name, 'removed head')
    redis.call('PUBLISH', ARGV[3], name)
    return n
  end
  local why = 'removed'
  if m[1] == name and tonumber(m[4]) > tonumber(m[2]) then
    why = 'removed head'
    if redis.call('EXISTS', ARGV[1] .. m[3]) == 1 then why = why .. ' ' .. m[3] end
  end
  local n = drop(ARGV[1], ARGV[2], ARGV[3], name, why)
  if m[1] == nil then redis.call('DEL', KEYS[2], KEYS[3]) end
  return n
end
local sname = solo()
if sname then
  for i = 4, #ARGV do
    if ARGV[i] == sname then
      redis.call('DEL', KEYS[1])
      redis.call('PUBLISH', ARGV[2] .. sname, 'removed head')
      redis.call('PUBLISH', ARGV[3], sname)
      return 1
    end
  end
  return 0
end
local n = 0
for i = 4, #ARGV do n = n + drop(ARGV[1], ARGV[2], ARGV[3], ARGV[i], 'removed') end
tidy()
return n
"#;

/// Removes every entry whose name starts with the ticket's protected prefix: the clean-up
/// after a dropped or failed enqueue. ARGV: entry-key prefix, gone-channel prefix, queue
/// channel, `_c_<uuid>-`. Returns how many members it removed.
const ABANDON: &str = r#"
local pre = ARGV[4]
local sname = solo()
if sname then
  if string.sub(sname, 1, #pre) ~= pre then return 0 end
  redis.call('DEL', KEYS[1])
  redis.call('PUBLISH', ARGV[2] .. sname, 'removed')
  redis.call('PUBLISH', ARGV[3], sname)
  return 1
end
local m = redis.call('ZRANGE', KEYS[1], 0, -1)
local n = 0
for i = 1, #m do
  if string.sub(m[i], 1, #pre) == pre then
    drop(ARGV[1], ARGV[2], ARGV[3], m[i], 'removed')
    n = n + 1
  end
end
tidy()
return n
"#;

/// The watchdog's renewal: re-arms the lease of each named entry that still exists, and
/// never re-creates one (a released entry stays released); the queue's key is kept alive
/// at least as long. ARGV: entry-key prefix, lease ms, names... Returns one 1 (renewed)
/// or 0 (gone) per name.
const RENEW: &str = r#"
local lease = ARGV[2]
local out = {}
local any = false
local sname = solo()
if sname then
  for i = 3, #ARGV do
    local ok = 0
    if ARGV[i] == sname and redis.call('PEXPIRE', KEYS[1], lease) == 1 then ok = 1 end
    out[#out + 1] = ok
  end
  return out
end
for i = 3, #ARGV do
  local ok = 0
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) and redis.call('PEXPIRE', ARGV[1] .. ARGV[i], lease) == 1 then
    ok = 1
    any = true
  end
  out[#out + 1] = ok
end
if any then redis.call('PEXPIRE', KEYS[1], lease, 'GT') end
return out
"#;

/// Replaces the value of one entry, only if it is still the entry the caller created and
/// it still leads its queue: an election leader's proclaim. ARGV: entry-key prefix,
/// gone-channel prefix, queue channel, name, token (empty: not compared), data,
/// data-channel prefix.
///
/// The entry is this one if its key exists, it is queued, and its token is the one its
/// enqueue wrote (names are never reused, so the token is a second guard only). It leads
/// if no live member is scored ahead of it (the live listing up to its own score, which
/// drops expired members on the way, as any listing does). Otherwise nothing is written
/// and the reply says why: `{'GONE'}` or `{'BEHIND', first}`.
///
/// The value is rewritten with `KEEPTTL`, so the lease the watchdog renews is untouched,
/// and its token and creation time are kept. The new value is published on the entry's
/// data channel so that a `wait_data_changed` wakes at once. Returns `{'OK'}`.
const PROCLAIM: &str = r#"
local ep, gp, qc, name, tok = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]
local data, dp = ARGV[6], ARGV[7]
local v = redis.call('GET', ep .. name)
-- An entry key exists only in the queue layout (a solo entry has none), so `KEYS[1]`
-- is a sorted set here, or gone.
if not v then return {'GONE'} end
local score = redis.call('ZSCORE', KEYS[1], name)
if not score then return {'GONE'} end
local t, c = ent(v)
if tok ~= '' and t ~= tok then return {'GONE'} end
local out, top, existed, dropped = live(ep, gp, qc, false, score)
if out[1] ~= name then return {'BEHIND', out[1] or ''} end
redis.call('SET', ep .. name, t .. ' ' .. c .. ' ' .. data, 'KEEPTTL')
redis.call('PUBLISH', dp .. name, 'proclaimed')
return {'OK'}
"#;

/// Reads one entry's token and data. ARGV: entry-key prefix, name. Returns
/// `{token, data}`, or nil if the entry is gone. A solo entry (the lock's one key) is
/// read from the queue's key.
const READ: &str = r#"
local sname, stok, sdata = solo()
if sname then
  if sname == ARGV[2] then return {stok, sdata} end
  return false
end
local v = redis.call('GET', ARGV[1] .. ARGV[2])
if not v then return false end
local t, c, d = ent(v)
return {t, d}
"#;

/// The uncontended fast path's two scripts as Lua source, as [`crate::RedisBackend`]
/// loads them for a lease of `lease_ms`: the acquire (`KEYS[1]` the lock's key, `ARGV`
/// the entry's name prefix and its data if any; returns the token, or nil if taken) and
/// the release (`KEYS[1]`, `ARGV[1]` the value the acquire wrote, `<prefix><token>
/// <token> <data>`; returns 1 when it removed it). Not for locking: for `dlock-bench`'s
/// floor of the fast path through fred alone (`--only W0d,W3d`), no recipe and no
/// adapter around it.
#[doc(hidden)]
pub fn fast_path_lua(lease_ms: u128) -> (String, String) {
    let s = Scripts::new(false, lease_ms);
    let lua = |s: &Script| s.lua().map(ToString::to_string).unwrap_or_default();
    (lua(&s.acquire_solo), lua(&s.release_solo))
}

/// The scripts, hashed once per backend.
#[derive(Debug, Clone)]
pub(crate) struct Scripts {
    pub enqueue: Script,
    pub list: Script,
    pub remove: Script,
    pub abandon: Script,
    pub renew: Script,
    /// One master only: the uncontended acquire ([`ACQUIRE_SOLO`]).
    pub acquire_solo: Script,
    /// One master only: the release of a solo entry ([`RELEASE_SOLO`]).
    pub release_solo: Script,
    /// One master only: a watcher's move of a solo entry into the queue layout
    /// ([`UNSOLO`]).
    pub unsolo: Script,
    pub proclaim: Script,
    pub read: Script,
}

impl Scripts {
    /// The scripts; `sharded` (a Redis Cluster) publishes with `SPUBLISH` instead of
    /// `PUBLISH`: a sharded message goes to the subscribers of the slot's master and its
    /// replicas only, where a plain one is broadcast over the whole cluster bus. Every
    /// channel a script publishes on carries the lock's hash tag, so it is on the
    /// script's own slot, as the server requires of a script's `SPUBLISH`.
    ///
    /// `lease_ms` is written into [`ACQUIRE_SOLO`] (digits only, so it cannot change
    /// the script's meaning): backends with different leases load different scripts.
    pub fn new(sharded: bool, lease_ms: u128) -> Self {
        let with = |head: &str, body: &str| {
            let lua = format!("{head}{PRELUDE}{body}");
            Script::from_lua(if sharded {
                lua.replace("redis.call('PUBLISH'", "redis.call('SPUBLISH'")
            } else {
                lua
            })
        };
        Scripts {
            enqueue: with("", ENQUEUE),
            list: with("", LIST),
            remove: with(SOLO_REMOVE, REMOVE),
            abandon: with("", ABANDON),
            renew: with("", RENEW),
            acquire_solo: Script::from_lua(ACQUIRE_SOLO.replace("LEASE_MS", &lease_ms.to_string())),
            release_solo: Script::from_lua(RELEASE_SOLO),
            unsolo: with("", UNSOLO),
            proclaim: with("", PROCLAIM),
            read: with("", READ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Scripts;

    /// Every publish of the cluster's scripts is sharded, and the others publish plainly.
    #[test]
    fn cluster_scripts_publish_sharded() {
        let plain = Scripts::new(false, 30_000);
        let sharded = Scripts::new(true, 30_000);
        for (p, s) in [
            (&plain.remove, &sharded.remove),
            (&plain.list, &sharded.list),
            (&plain.abandon, &sharded.abandon),
            (&plain.proclaim, &sharded.proclaim),
        ] {
            let (p, s) = (p.lua().expect("source"), s.lua().expect("source"));
            assert!(p.contains("redis.call('PUBLISH'") && !p.contains("SPUBLISH"));
            assert!(s.contains("redis.call('SPUBLISH'"));
            assert!(!s.contains("redis.call('PUBLISH'"));
        }
        // The uncontended pair publishes nothing at all (a solo entry has no listener),
        // and a watcher's move publishes sharded on a cluster, as the others do.
        for script in [
            &plain.acquire_solo,
            &plain.release_solo,
            &sharded.acquire_solo,
            &sharded.release_solo,
        ] {
            assert!(!script.lua().expect("source").contains("PUBLISH"));
        }
        let unsolo = sharded.unsolo.lua().expect("source");
        assert!(!unsolo.contains("redis.call('PUBLISH'"));
        assert_ne!(plain.remove.sha1(), sharded.remove.sha1());
    }

    /// No script formats a number with `string.format` but through the prelude's `num`,
    /// which hands `%d` nine digits at a time: Lua 5.1's `%d` goes through a C `long`,
    /// 32 bits on some builds, and tokens have 16 digits. (ENQUEUE wrote its token,
    /// sequence, name and clock with `%d` whole until a review found it.) It does not
    /// see a number joined with `..` (Lua's `%.14g`, 14 digits): by convention every
    /// `..` in the scripts joins strings (`TIME`'s fields, `ARGV`, `num`'s output).
    #[test]
    fn numbers_are_formatted_within_a_32_bit_long() {
        let s = Scripts::new(false, 30_000);
        let num = &super::PRELUDE[super::PRELUDE.find("local function num").expect("num")..];
        let num = &num[..num.find("\nend\n").expect("end of num")];
        for script in [
            &s.enqueue,
            &s.list,
            &s.remove,
            &s.abandon,
            &s.renew,
            &s.acquire_solo,
            &s.release_solo,
            &s.unsolo,
            &s.proclaim,
            &s.read,
        ] {
            let lua = script.lua().expect("source");
            let outside = lua.replace(num, "");
            assert!(
                !outside.contains("string.format") && !outside.contains("tostring"),
                "a number formatted outside num: {lua}"
            );
        }
    }

    /// `num` on a real server, against Rust's own decimal digits: around every power of
    /// ten it splits at, 2^31 and 2^32 (where a 32-bit `long` would break), today's
    /// microsecond clock and 2^53 - 1. Runs when `DLOCK_TEST_REDIS` is set.
    #[tokio::test]
    async fn num_writes_every_number_below_2_pow_53_exactly() {
        use fred::prelude::{ClientLike, Config, LuaInterface};
        let Ok(addr) = std::env::var("DLOCK_TEST_REDIS") else {
            eprintln!("DLOCK_TEST_REDIS not set: skipped");
            return;
        };
        let mut values: Vec<u64> = vec![0, 7, 2_147_483_647, 2_147_483_648, 4_294_967_296];
        for p in [9u32, 10, 12, 15] {
            let t = 10u64.pow(p);
            values.extend([t - 1, t, t + 1]);
        }
        values.extend([1_796_012_335_840_895, (1 << 53) - 1]);
        let client = fred::prelude::Builder::from_config(
            Config::from_url(&format!("redis://{addr}")).expect("url"),
        )
        .build()
        .expect("client");
        client.init().await.expect("connect");
        let lua = format!(
            "{}local out = {{}}\nfor i = 1, #ARGV do\n  out[#out + 1] = num(tonumber(ARGV[i]))\n  \
             if tonumber(ARGV[i]) < 1e9 then out[#out + 1] = num(tonumber(ARGV[i]), '%010d') end\n\
             end\nreturn out\n",
            super::PRELUDE
        );
        let args: Vec<String> = values.iter().map(u64::to_string).collect();
        let got: Vec<String> = client
            .eval(lua, Vec::<String>::new(), args)
            .await
            .expect("eval");
        let want: Vec<String> = values
            .iter()
            .flat_map(|v| {
                let mut w = vec![v.to_string()];
                if *v < 1_000_000_000 {
                    w.push(format!("{v:010}"));
                }
                w
            })
            .collect();
        assert_eq!(got, want);
        client.quit().await.expect("quit");
    }
}
