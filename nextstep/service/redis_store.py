"""The deployment state store: `RedisStore`, state.py's contract in Redis (one node, a cluster or Sentinel).

Every replica serves any entity and a restart loses nothing; the keys and each operation's round trips are in
docs/architecture.md."""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from .errors import shown
from .redis_clients import Client, RedisOptions, connect, is_noscript
from .state import (
    ABSENT,
    DEFAULT_LOG_BOUNDS,
    DEFAULT_MAX_EVENT_IDS,
    LogBounds,
    LogRow,
    StoredState,
    check_store_settings,
    decode_rows,
    encode_rows,
)

# The replay window in Redis: the newest `max_event_ids` event ids of a key, as 7 bytes of each id's fingerprint
# (BLAKE2b-64's first 7), kept in two keys. A HASH `<key>:seen` of up to 256 buckets: field = the fingerprint's first
# byte, value = the other 6 bytes of each id that byte leads, concatenated in the order they were recorded; it
# answers "seen?" from one bucket (about max_ids / 256 entries, read with HMGET and scanned here). A STRING
# `<key>:order`, a ring of one byte per id, slot = n mod max_ids (n = the meta hash's `recorded`, the ids ever
# recorded in this layout): each id's bucket, which says what to forget. Ids enter a bucket in order and leave the
# window oldest first, so the window's oldest id is always the first entry of its bucket: forgetting it drops that
# bucket's first 6 bytes, no search. About 9 B per id at a full window of 10,000 (docs/decisions.md).
# An entry only counts where it starts at a multiple of 6.
#
# The layout before it (until November 2026) kept the whole 8-byte fingerprint twice: in a STRING `<key>:ring` and in
# a HASH `<key>:ids` of buckets by the first byte (8-byte entries), counted by the meta hash's `ids`. A key still in
# it (`ids` present) is read in both layouts and converted by its next compare-and-set (below).
_ENTRY = 6  # bytes of a bucket entry

_FIND_LUA = f"local W = {_ENTRY}\n" + r"""
local function find(s, entry)
  local at = string.find(s, entry, 1, true)
  while at and (at - 1) % W ~= 0 do at = string.find(s, entry, at + 1, true) end
  return at
end
"""

# KEYS[1] meta, KEYS[2] the schema's state, KEYS[3] order, KEYS[4] companion fields, KEYS[5] log, KEYS[6] buckets,
# KEYS[7] the old layout's ring, KEYS[8] its buckets.
# ARGV: expected_version, expected_total (-1: any), blob, added_events, now, ttl_ms (0 = no expiry), max_ids,
#       max_rows, keep_rows, min_time (-1: any age), schema marker (a meta field naming the schema; '' for
#       schema ''), n_fields, n_fields (name, value) pairs, n_rows, rows (encoded), fingerprints (7 bytes each)...
_CAS_LUA = _FIND_LUA + r"""
local function forget(field)  -- the window's oldest id: the first entry of its bucket
  local bucket = redis.call('HGET', KEYS[6], field)
  if not bucket then return end
  if #bucket <= W then redis.call('HDEL', KEYS[6], field)
  else redis.call('HSET', KEYS[6], field, string.sub(bucket, W + 1)) end
end

local state = redis.call('HMGET', KEYS[2], 'version', 'events')
local version = tonumber(state[1] or '0')
if version ~= tonumber(ARGV[1]) then return false end
local meta = redis.call('HMGET', KEYS[1], 'total', 'base', 'recorded', 'ids')  -- ids: a window in the old layout
local total = tonumber(meta[1] or '0')
if tonumber(ARGV[2]) >= 0 and total ~= tonumber(ARGV[2]) then return false end
version = version + 1
local first_row = 14 + 2 * tonumber(ARGV[12])
local n_rows = tonumber(ARGV[first_row - 1])
local first_fp = first_row + n_rows
for i = first_row, first_fp - 1, 4000 do  -- (Lua unpacks about 8,000 values at most)
  redis.call('RPUSH', KEYS[5], unpack(ARGV, i, math.min(i + 3999, first_fp - 1)))
end
total = total + n_rows
local base = tonumber(meta[2] or '0')
if total - base > tonumber(ARGV[8]) then  -- past the count bound: the oldest go, down to keep_rows
  local drop = total - base - tonumber(ARGV[9])
  redis.call('LTRIM', KEYS[5], drop, -1)
  base = base + drop
end
local min_time = tonumber(ARGV[10])
while min_time >= 0 and base < total do  -- then any older than the age bound
  local h = redis.call('LINDEX', KEYS[5], 0)
  if not h then break end
  local t = ((string.byte(h, 1) * 256 + string.byte(h, 2)) * 256 + string.byte(h, 3)) * 256 + string.byte(h, 4)
  if t >= min_time then break end
  redis.call('LPOP', KEYS[5])
  base = base + 1
end
local counts = {'total', total, 'base', base}  -- the meta's fields written (one HSET)
if ARGV[11] ~= '' then counts[5], counts[6] = ARGV[11], 1 end
local events = tonumber(state[2] or '0') + tonumber(ARGV[4])
redis.call('HSET', KEYS[2], 'version', version, 'events', events, 'blob', ARGV[3], 'updated', ARGV[5], 'logged', total)
for i = 13, first_row - 2, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
local old_n = meta[4]
if #ARGV >= first_fp or old_n then
  local width = tonumber(ARGV[7])
  local n = tonumber(meta[3] or '0')
  local held = redis.call('STRLEN', KEYS[3])
  if held ~= math.min(n, width) then
    if width == 0 or held == 0 or n < held then  -- none, or its count or ring is gone (an older release deleted
      -- the key beside this layout's keys): the window starts afresh
      redis.call('DEL', KEYS[3], KEYS[6])
      n = 0
    else  -- the window was made smaller or larger: forget all but the newest `width`, keep them oldest first
      local ring, kept = redis.call('GET', KEYS[3]) or '', {}
      for j = n - held, n - 1 do
        local field = string.sub(ring, j % held + 1, j % held + 1)
        if j < n - width then forget(field) else kept[#kept + 1] = field end
      end
      redis.call('SET', KEYS[3], table.concat(kept))
      n = #kept
    end
  end
  local function record(field, entry)
    local bucket = redis.call('HGET', KEYS[6], field) or ''
    if find(bucket, entry) then return end  -- a replayed id keeps its place
    local slot = n % width
    if n >= width then  -- the oldest goes
      local oldest = redis.call('GETRANGE', KEYS[3], slot, slot)
      if oldest == field then bucket = string.sub(bucket, W + 1) else forget(oldest) end
    end
    redis.call('HSET', KEYS[6], field, bucket .. entry)
    redis.call('SETRANGE', KEYS[3], slot, field)
    n = n + 1
    if n == width then  -- just filled: rewrite it at its exact size (growing left up to 2x spare room)
      redis.call('SET', KEYS[3], redis.call('GET', KEYS[3]))
    end
  end
  if old_n then  -- the old layout's ids join the window (each fingerprint's first 7 bytes), oldest first
    local ring = redis.call('GET', KEYS[7]) or ''
    local old_held, old_total = #ring / 8, tonumber(old_n)
    if n == 0 and width > 0 then  -- no window in this layout yet: built at once, by two passes in C (string.gsub)
      local order = string.gsub(ring, '(.).......', '%1')  -- the ring's first bytes: the ids' buckets
      local start = old_total % math.max(old_held, 1)
      order = string.sub(order, start + 1) .. string.sub(order, 1, start)  -- oldest first
      local drop = {}  -- per bucket, its oldest entries beyond the window's newest `width`
      for j = 1, #order - width do
        local field = string.sub(order, j, j)
        drop[field] = (drop[field] or 0) + 1
      end
      local buckets, args = redis.call('HGETALL', KEYS[8]), {}
      for k = 1, #buckets, 2 do  -- each bucket's fingerprints, oldest first: their bytes 2 to 7
        local entries = string.sub(string.gsub(buckets[k + 1], '.(......).', '%1'), (drop[buckets[k]] or 0) * W + 1)
        if #entries > 0 then
          args[#args + 1] = buckets[k]
          args[#args + 1] = entries
        end
      end
      if #args > 0 then redis.call('HSET', KEYS[6], unpack(args)) end
      n = math.min(#order, width)
      if n > 0 then redis.call('SET', KEYS[3], string.sub(order, -n)) end
    elseif width > 0 then  -- (an older release wrote beside this layout during a rolling upgrade)
      for j = math.max(old_total - old_held, old_total - width), old_total - 1 do
        local at = (j % old_held) * 8
        record(string.sub(ring, at + 1, at + 1), string.sub(ring, at + 2, at + 1 + W))
      end
    end
    redis.call('DEL', KEYS[7], KEYS[8])
    redis.call('HDEL', KEYS[1], 'ids')
  end
  if width > 0 then
    for i = first_fp, #ARGV do record(string.sub(ARGV[i], 1, 1), string.sub(ARGV[i], 2, 1 + W)) end
  end
  if n > 0 then
    counts[#counts + 1] = 'recorded'
    counts[#counts + 1] = n
  elseif meta[3] then
    redis.call('HDEL', KEYS[1], 'recorded')
  end
end
redis.call('HSET', KEYS[1], unpack(counts))
local ttl = tonumber(ARGV[6])
for i = 1, 6 do
  if ttl > 0 then redis.call('PEXPIRE', KEYS[i], ttl) else redis.call('PERSIST', KEYS[i]) end
end
return {version, events, total, base}
"""

# KEYS[1] a key's lease, ARGV[1] its owner: delete it only if that owner still holds it.
_RELEASE_LUA = r"""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""

# KEYS[1] meta, the order, the fields of schema "", the log, the buckets, the old layout's ring and buckets; and every
# other schema's state and fields
_DELETE_LUA = r"""
local keys = {unpack(KEYS)}
for _, f in ipairs(redis.call('HKEYS', KEYS[1])) do
  if string.sub(f, 1, 2) == 's:' then
    local state = KEYS[1] .. ':s:' .. string.sub(f, 3)
    keys[#keys + 1] = state
    keys[#keys + 1] = state .. ':fields'
  end
end
return redis.call('DEL', unpack(keys))
"""


_FIELDS = (b"version", b"events", b"updated", b"blob", b"logged")


def _holds(bucket: bytes | None, entry: bytes, width: int) -> bool:
    """Whether `entry` is in `bucket` at a multiple of `width`."""
    at = bucket.find(entry) if bucket else -1
    while at > 0 and at % width:
        at = bucket.find(entry, at + 1)
    return at >= 0


def _in_window(event_ids: Sequence[str], fingerprints: list[bytes], buckets: list, old_buckets: list) -> set[str]:
    """The ids found in their bucket: the 6 bytes after the field (at a multiple of 6), or, in the old layout's
    bucket, the whole 8-byte fingerprint (at a multiple of 8)."""
    return {event_id for event_id, fp, bucket, old in zip(event_ids, fingerprints, buckets, old_buckets, strict=True)
            if _holds(bucket, fp[1:1 + _ENTRY], _ENTRY) or _holds(old, fp, 8)}


def _fingerprint(event_id: str) -> bytes:
    """BLAKE2b-64 of the id: its first byte names the bucket, the next 6 are the entry (the old layout kept all 8)."""
    return hashlib.blake2b(event_id.encode(), digest_size=8).digest()


_READ_TRIES = 3  # pipelined reads of a key that writes moved in between, before one transaction

_REDIS_CURSOR = re.compile(r"[0-9]{1,20}(:[0-9]{1,20})?")  # one node's SCAN cursor; "<primary>:<cursor>" (cluster)


def _glob_escape(text: str) -> str:
    """`text` matched literally by a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _int(value, default: int = 0) -> int:
    return default if value is None else int(value)


class RedisStore:
    """State in Redis. For a caller key K, under the Redis Cluster hash tag {K} (every key of an entity in one
    slot, and a caller key ending in ":seen" cannot collide with another key's window):

        <prefix>:{K}              HASH  the key's meta (total, base: its log's counts; recorded: event ids ever
                                        recorded in the window; s:<schema>: the schemas holding a state) and the
                                        state of schema "" (version, events, updated, blob, logged)
        <prefix>:{K}:s:<schema>   HASH  the state of another schema (a model version's layout)
        ...:fields                HASH  a state's companion fields (only where some were written)
        <prefix>:{K}:log          LIST  the event log, oldest first: each 4-byte big-endian seconds, the payload
        <prefix>:{K}:seen         HASH  the replay window, the newest `max_event_ids` ids: up to 256 buckets by
                                        their fingerprint's first byte, 6 more bytes of it per id, oldest first
        <prefix>:{K}:order        STRING the same ids' buckets, one byte each, in a ring (which id to forget)

    all refreshed to the TTL by each write (another schema's state keeps its own). A fingerprint is BLAKE2b-64 of the
    id, and the window keeps its first 7 bytes: a new id is taken for a replay only if those 56 bits equal an id's
    of the window, about `max_event_ids / 2**56` (1.4e-13 at 10,000) per event. A key written before November 2026
    may still hold its window in the old layout (`:ring` and `:ids`, counted by the meta's `ids`): it is read too,
    and its next compare-and-set moves it into this one.

    The client (redis_clients.py) is chosen by the URL: one node, a cluster or a Sentinel-watched primary. Every
    operation either completes or raises `StoreUnavailable` within about `2 * socket_timeout` seconds per try
    (connect, then the reply); reads are retried after a connection failure, the compare-and-set only when it
    was certainly not sent, and once sent, a timeout or a lost connection raises `OutcomeUnknown` instead
    (docs/decisions.md). A store given a `client` shares it (and does not close it).
    """

    def __init__(
        self,
        url: str | None = None,
        *,
        ttl_seconds: float | None,
        max_event_ids: int = DEFAULT_MAX_EVENT_IDS,
        log: LogBounds = DEFAULT_LOG_BOUNDS,
        socket_timeout: float | None = None,  # shorthand for options.socket_timeout and connect_timeout
        options: RedisOptions | None = None,
        client: Client | None = None,
        key_prefix: str = "nextstep",
        clock: Callable[[], float] = time.time,  # `updated` comes from here, passed to the script
    ) -> None:
        check_store_settings(ttl_seconds, max_event_ids)
        self._ttl_ms = 0 if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        self._max_ids = max_event_ids
        self._bounds = log
        self._prefix = key_prefix
        self._clock = clock
        if client is None:
            options = options or RedisOptions()
            if socket_timeout is not None:
                options = replace(options, socket_timeout=socket_timeout, connect_timeout=socket_timeout)
            client, self._owned = connect(url, options), True
        else:
            self._owned = False
        self.client = client
        self._execute = client.execute
        self._scripts = {name: (hashlib.sha1(lua.encode()).hexdigest(), lua)
                         for name, lua in (("cas", _CAS_LUA), ("delete", _DELETE_LUA), ("release", _RELEASE_LUA))}

    def _keys(self, key: str, schema: str = "") -> tuple[str, str, str, str, str, str, str, str]:
        """The meta hash, the schema's state, the order, the state's companion fields, the log, the buckets; the old
        layout's ring and buckets."""
        meta = f"{self._prefix}:{{{key}}}"
        state = f"{meta}:s:{schema}" if schema else meta
        return (meta, state, f"{meta}:order", f"{state}:fields", f"{meta}:log", f"{meta}:seen", f"{meta}:ring",
                f"{meta}:ids")

    async def _script(self, what: str, name: str, keys: Sequence[str], args: Sequence, *, write: bool) -> object:
        """The script by its digest; NOSCRIPT (a restarted or flushed server) -> EVAL, which loads it again. A write
        is never retried once sent (the client's rule), and is acknowledged by `wait_replicas` replicas where asked."""
        sha, lua = self._scripts[name]
        flags = {"idempotent": not write, "write": write}
        (reply,) = await self._execute(what, (("EVALSHA", sha, len(keys), *keys, *args),), **flags)
        if is_noscript(reply):
            (reply,) = await self._execute(what, (("EVAL", lua, len(keys), *keys, *args),), **flags)
        return reply

    async def get(self, key: str, *, schema: str = "") -> StoredState:
        return (await self.read(key, schema=schema, what="get"))[0]

    async def seen(self, key: str, event_ids: Sequence[str]) -> set[str]:
        return (await self.read(key, event_ids, what="seen"))[1]

    async def read(self, key: str, event_ids: Sequence[str] = (), fields: Sequence[str] = (), *, schema: str = "",
                   what: str = "read") -> tuple[StoredState, set[str]]:
        """The state, the meta hash's log counts, the fields asked for and the event ids' buckets (this layout's and
        the old layout's), in one pipeline of HMGETs (one round trip), the state's version read again last: where it
        moved meanwhile (Redis ran another client's write between the reads), the pipeline goes again, and after
        _READ_TRIES as one MULTI/EXEC, so the fields always belong to the version read. A write of another schema
        between the reads is as if it came just after the first: the state is its own as read. Plain reads first, not
        a transaction: Redis refuses queued commands when it is out of memory, and reads must go on then. (A read
        script did this in one command at about 13 us of Redis's time, against about 3 for the pipeline.)"""
        meta, state_key, _, fields_key, _, buckets_key, _, old_buckets = self._keys(key, schema)
        fingerprints = [_fingerprint(i) for i in event_ids]
        commands = [("HMGET", state_key, *_FIELDS), ("HMGET", meta, "total", "base", "recorded", "ids")]
        if fields:
            commands.append(("HMGET", fields_key, *fields))
        if fingerprints:
            firsts = [f[:1] for f in fingerprints]
            commands += [("HMGET", buckets_key, *firsts), ("HMGET", old_buckets, *firsts)]
        commands.append(("HGET", state_key, "version"))
        for _ in range(_READ_TRIES):
            replies = await self._execute(what, commands)
            if replies[-1] == replies[0][0]:
                break
        else:  # (a key written without pause: one transaction, which cannot be cut into)
            replies = await self._execute(what, commands, atomic=True)
        (version, events, updated, blob, logged), (total, base, recorded, old) = replies[0], replies[1]
        seen = set()
        if fingerprints:  # (a layout's buckets count only where the meta counts its ids: `recorded`, `ids`)
            none = [None] * len(fingerprints)
            seen = _in_window(event_ids, fingerprints, replies[-3] if recorded is not None else none,
                              replies[-2] if old is not None else none)
        total, base = _int(total), _int(base)
        if version is None:
            return replace(ABSENT, total=total, base=base), seen
        found = {name: value for name, value in zip(fields, replies[2], strict=True) if value is not None} \
            if fields else {}
        return StoredState(int(version), int(events), float(updated), blob, found, _int(logged), total, base), seen

    async def read_all(self, key: str, *, schema: str = "") -> StoredState:
        meta, state_key, _, fields_key, *_ = self._keys(key, schema)
        reply, counts, values = await self._execute("read all", (
            ("HMGET", state_key, *_FIELDS), ("HMGET", meta, "total", "base"), ("HGETALL", fields_key)), atomic=True)
        (version, events, updated, blob, logged), (total, base) = reply, counts
        if version is None:
            return replace(ABSENT, total=_int(total), base=_int(base))
        values = dict(zip(values[::2], values[1::2], strict=True)) if isinstance(values, list) else values
        found = {(k.decode() if isinstance(k, bytes) else k): v for k, v in values.items()}
        return StoredState(int(version), int(events), float(updated), blob, found, _int(logged), _int(total),
                           _int(base))

    async def compare_and_set(
        self, key: str, expected_version: int, blob: bytes, added_events: int, event_ids: Sequence[str] = (),
        fields: Mapping[str, bytes] | None = None, *, schema: str = "", rows: Sequence[LogRow] = (),
        expected_total: int | None = None,
    ) -> StoredState | None:
        now = self._clock()
        bounds = self._bounds
        min_time = -1 if bounds.max_age_seconds is None else max(0, int(now - bounds.max_age_seconds))
        pairs = [part for name, value in (fields or {}).items() for part in (str(name), bytes(value))]
        frames = encode_rows(rows)
        args = (expected_version, -1 if expected_total is None else expected_total, blob, added_events, repr(now),
                self._ttl_ms, self._max_ids, bounds.max_rows, bounds.keep, min_time, f"s:{schema}" if schema else "",
                len(pairs) // 2, *pairs, len(frames), *frames, *(_fingerprint(i)[:1 + _ENTRY] for i in event_ids))
        reply = await self._script("compare_and_set", "cas", self._keys(key, schema), args, write=True)
        if reply is None:
            return None
        version, events, total, base = (int(x) for x in reply)
        return StoredState(version, events, now, bytes(blob), {}, total, total, base)

    async def log(self, key: str) -> tuple[int, list[LogRow]]:
        meta, *_, log, _, _, _ = self._keys(key)
        base, items = await self._execute("log", (("HGET", meta, "base"), ("LRANGE", log, 0, -1)), atomic=True)
        return _int(base), decode_rows(items)

    async def scan(self, prefix: str, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """SCAN over the meta hashes `<prefix>:{K}` with K starting with `prefix` (every primary's on a cluster)."""
        if not _REDIS_CURSOR.fullmatch(cursor) or any(int(part) >= 2 ** 64 for part in cursor.split(":")):
            raise ValueError(f"not a scan cursor: {shown(cursor)} (Redis's cursors are below 2^64)")
        head = f"{self._prefix}:{{"
        pattern = _glob_escape(head + prefix) + "*}"
        following, names = await self.client.scan(cursor, pattern, count)
        keys = []
        for name in names:
            text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            if text.startswith(head) and text.endswith("}"):  # (a state of another schema ends otherwise)
                keys.append(text[len(head):-1])
        return following, keys

    async def lease(self, key: str, owner: str, ms: int) -> bool:
        (reply,) = await self._execute("lease", (("SET", self._lease_key(key), owner, "NX", "PX", int(ms)),),
                                       idempotent=False, write=True)
        return reply not in (None, b"", "")

    async def release(self, key: str, owner: str) -> None:
        await self._script("release", "release", (self._lease_key(key),), (owner,), write=True)

    def _lease_key(self, key: str) -> str:
        return f"{self._prefix}:{{{key}}}:lease"  # (the key's slot; a scan skips it: it does not end with the tag)

    async def delete(self, key: str) -> bool:
        meta, _, order, fields, log, buckets, old_ring, old_buckets = self._keys(key)
        removed = await self._script("delete", "delete", (meta, order, fields, log, buckets, old_ring, old_buckets),
                                     (), write=True)
        return removed > 0

    async def ping(self) -> None:
        await self._execute("ping", (("PING",),))

    async def close(self) -> None:
        if self._owned:
            await self.client.close()
