//! The Lua scripts: every state change is one of these, run atomically by the server.
//!
//! Each script takes the same three keys, all under the lock's hash tag so that the script
//! runs on one Redis Cluster slot: `KEYS[1]` the queue's sorted set, `KEYS[2]` its
//! sequence counter, `KEYS[3]` the lock's token counter. Entry keys and channels are built
//! inside the script from prefixes passed in `ARGV`, because their names depend on the
//! sequence the script itself draws (they share the hash tag, so they live on the same
//! slot; see the crate docs).
//!
//! Scripts are sent with `EVALSHA` and loaded on `NOSCRIPT` (fred's
//! `Script::evalsha_with_reload`), so a server restart that forgets them costs one extra
//! round trip, never a replayed write: a `NOSCRIPT` reply means the script did not run.

use fred::types::scripts::Script;

/// Helpers shared by every script.
///
/// `live` lists the queue and lazily drops members whose entry key expired (a dead
/// client's entry), publishing `expired` on their gone-channel so that a waiter watching
/// one wakes at once instead of at its re-check timer. `tidy` deletes the counters once
/// the queue is empty so that an idle lock leaves no key behind; `extend` keeps the
/// queue's keys alive at least as long as the longest-lived entry renewed through them.
const PRELUDE: &str = r#"
local function extend(lease)
  for i = 1, 3 do
    local ttl = redis.call('PTTL', KEYS[i])
    if ttl ~= -2 and ttl < lease then redis.call('PEXPIRE', KEYS[i], lease) end
  end
end
local function tidy()
  if redis.call('EXISTS', KEYS[1]) == 0 then redis.call('DEL', KEYS[2], KEYS[3]) end
end
local function drop(ep, gp, qc, name, why)
  local n = redis.call('DEL', ep .. name)
  redis.call('ZREM', KEYS[1], name)
  redis.call('PUBLISH', gp .. name, why)
  redis.call('PUBLISH', qc, name)
  return n
end
local function live(ep, gp, qc, detail)
  local m = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
  local out = {}
  for i = 1, #m, 2 do
    local name = m[i]
    local h
    if detail then
      h = redis.call('HMGET', ep .. name, 't', 'c', 'd')
    else
      h = redis.call('HMGET', ep .. name, 't')
    end
    if h[1] then
      out[#out + 1] = name
      out[#out + 1] = m[i + 1]
      out[#out + 1] = h[1]
      if detail then
        out[#out + 1] = h[2] or '0'
        out[#out + 1] = h[3] or ''
      end
    else
      drop(ep, gp, qc, name, 'expired')
    end
  end
  tidy()
  return out
end
"#;

/// Adds an entry and returns the live queue in the same round trip.
///
/// ARGV: entry-key prefix, gone-channel prefix, queue channel, name prefix
/// (`_c_<uuid>-<marker>`), lease ms, data, mode, proposed sequence, writer name.
/// Modes: `tail` draws the sequence with `INCR` (single master); `cas` accepts the
/// proposed sequence only if it is above every sequence this master has handed out, and
/// otherwise returns `{'REJECT', counter}` (Redlock: the same name on every master);
/// `beside` reuses the writer's sequence if the writer's entry still exists, otherwise
/// returns `{'MISSING'}`.
///
/// The token is `INCR` of the lock's counter, floored at the server clock in
/// microseconds: the counter is deleted with an idle lock (and lost by a restart without
/// persistence), and the floor keeps tokens growing across both.
///
/// Returns `{'OK', name, seq, token, created_ms, {name, seq, token, ...}}`.
const ENQUEUE: &str = r#"
local ep, gp, qc, prefix = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local lease, data, mode, p, writer = tonumber(ARGV[5]), ARGV[6], ARGV[7], ARGV[8], ARGV[9]
local seq
if mode == 'tail' then
  seq = redis.call('INCR', KEYS[2])
elseif mode == 'cas' then
  local cur = tonumber(redis.call('GET', KEYS[2]) or '0')
  seq = tonumber(p)
  if seq <= cur then return {'REJECT', cur} end
  redis.call('SET', KEYS[2], p)
else
  if redis.call('EXISTS', ep .. writer) == 0 then return {'MISSING'} end
  seq = tonumber(p)
end
local name = prefix .. string.format('%010d', seq)
local t = redis.call('TIME')
local now_us = tonumber(t[1]) * 1000000 + tonumber(t[2])
local now_ms = math.floor(now_us / 1000)
local tok = redis.call('INCR', KEYS[3])
if tok < now_us then
  tok = now_us
  redis.call('SET', KEYS[3], string.format('%.0f', tok))
end
redis.call('HSET', ep .. name, 't', string.format('%.0f', tok), 'c', string.format('%.0f', now_ms), 'd', data)
redis.call('PEXPIRE', ep .. name, lease)
redis.call('ZADD', KEYS[1], seq, name)
extend(lease)
redis.call('PUBLISH', qc, name)
return {'OK', name, seq, string.format('%.0f', tok), string.format('%.0f', now_ms), live(ep, gp, qc, false)}
"#;

/// Lists the live queue. ARGV: entry-key prefix, gone-channel prefix, queue channel,
/// `1` for details (creation time and data). Returns `{name, seq, token[, created, data]...}`.
const LIST: &str = r#"
return live(ARGV[1], ARGV[2], ARGV[3], ARGV[4] == '1')
"#;

/// Removes the named entries (remove: one name; idempotent). ARGV: entry-key prefix,
/// gone-channel prefix, queue channel, names... Publishes on each entry's gone-channel so
/// that only the waiter watching it wakes. Returns how many entry keys existed.
const REMOVE: &str = r#"
local n = 0
for i = 4, #ARGV do n = n + drop(ARGV[1], ARGV[2], ARGV[3], ARGV[i], 'removed') end
tidy()
return n
"#;

/// Removes every entry whose name starts with the ticket's protected prefix: the clean-up
/// after a dropped or failed enqueue. ARGV: entry-key prefix, gone-channel prefix, queue
/// channel, `_c_<uuid>-`. Returns how many members it removed.
const ABANDON: &str = r#"
local m = redis.call('ZRANGE', KEYS[1], 0, -1)
local pre = ARGV[4]
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
/// never re-creates one (a released entry stays released). ARGV: entry-key prefix, lease
/// ms, names... Returns one 1 (renewed) or 0 (gone) per name.
const RENEW: &str = r#"
local lease = tonumber(ARGV[2])
local out = {}
local any = false
for i = 3, #ARGV do
  local ok = 0
  if redis.call('ZSCORE', KEYS[1], ARGV[i]) and redis.call('PEXPIRE', ARGV[1] .. ARGV[i], lease) == 1 then
    ok = 1
    any = true
  end
  out[#out + 1] = ok
end
if any then extend(lease) end
return out
"#;

/// The scripts, hashed once per backend.
#[derive(Debug, Clone)]
pub(crate) struct Scripts {
    pub enqueue: Script,
    pub list: Script,
    pub remove: Script,
    pub abandon: Script,
    pub renew: Script,
}

impl Scripts {
    pub fn new() -> Self {
        let with = |body: &str| Script::from_lua(format!("{PRELUDE}{body}"));
        Scripts {
            enqueue: with(ENQUEUE),
            list: with(LIST),
            remove: with(REMOVE),
            abandon: with(ABANDON),
            renew: with(RENEW),
        }
    }
}
