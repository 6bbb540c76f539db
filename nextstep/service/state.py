"""Per-entity model state, shared by every replica of the service.

Each entity (a learner) has a small opaque state (tensors serialised to bytes by the caller), a
version and a count of absorbed events. Writers never lock: they read, compute, then
`compare_and_set` against the version they read; on a conflict they re-read and retry, so
concurrent events for one entity are all applied and none is lost (optimistic concurrency).

Events may carry ids. The ids applied to a key are kept (newest `max_event_ids` of them: the
de-duplication window) so a replayed event can be recognised with `seen` and skipped. Checking
`seen` and then writing is race-free because the write is conditional on the version: if another
writer applied the same id in between, the version moved and the CAS fails.

Each key also holds its *event log* (since November 2026): the events applied to it, as the task encoded them
(`LogRow`: a time and a payload), appended by the same compare-and-set that writes the state, so the log is the
entity's history and every state is a function of it. A key holds one state per *schema* (a model version's state
layout, `schema=`), all sharing one log, one event count and one replay window: a state records how many logged
events it reflects (`logged`), and one that lags the log (another version wrote, or it never existed) is caught up
by its task from `log()` before it is used (core.py). The log is bounded by a count and an age (`max_rows`,
`max_age_seconds`); events trimmed from it stay in every state that had folded them.

A key may also hold *companion fields*: named byte strings written by the same compare-and-set as the
blob and read, by name, in the same round trip (`read(..., fields=...)`). They let an entity keep data
that is large in total but read a little at a time (the spaced-repetition task keeps each card's recent
reviews in one field, so a read costs the cards asked for, not all of them).

Two stores share this contract:

* `RedisStore`     -- the deployment store; any replica serves any learner, restarts lose nothing.
* `InProcessStore` -- the embedded default when no Redis URL is configured (tests, one process).

docs/architecture.md describes the keys and what each request costs in Redis round trips.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

from .redis_clients import Client, RedisOptions, connect, is_noscript

DEFAULT_MAX_EVENT_IDS = 10_000


@dataclass(frozen=True)
class StoredState:
    version: int  # 0 when the key does not exist; +1 on every successful write
    events: int  # number of events absorbed so far
    updated: float | None  # unix seconds of the last write, None when absent
    blob: bytes | None  # the serialised state, None when absent
    fields: Mapping[str, bytes] = field(default_factory=dict, compare=False)  # companion fields asked for by
    # `read(fields=...)` that exist; empty otherwise (not part of equality: a state is its version and blob)
    logged: int = 0  # the key's logged events this state reflects (it was written when the log held that many)
    total: int = 0  # events ever logged for the key (every schema's writes)
    base: int = 0  # how many of them were trimmed from the log (the oldest); the log holds total - base

    @property
    def exists(self) -> bool:
        return self.version > 0

    @property
    def behind(self) -> int:
        """Logged events this state has not folded in."""
        return self.total - self.logged


@dataclass(frozen=True)
class LogRow:
    """One logged event: its time (unix seconds, whole seconds kept) and the task's encoding of it."""

    time: float
    payload: bytes


def encode_rows(rows: Sequence[LogRow]) -> list[bytes]:
    """Each row as stored: 4-byte big-endian whole seconds, then the payload."""
    return [min(max(int(row.time), 0), 0xFFFFFFFF).to_bytes(4, "big") + row.payload for row in rows]


def decode_rows(data: Sequence[bytes]) -> list[LogRow]:
    return [LogRow(float(int.from_bytes(item[:4], "big")), bytes(item[4:])) for item in data]


ABSENT = StoredState(version=0, events=0, updated=None, blob=None)


@runtime_checkable
class StateStore(Protocol):
    async def get(self, key: str, *, schema: str = "") -> StoredState: ...

    async def read(self, key: str, event_ids: Sequence[str] = (), fields: Sequence[str] = (), *, schema: str = ""
                   ) -> tuple[StoredState, set[str]]:
        """`get` and `seen` together, in one round trip. With `fields`, the state's `fields` holds those of the
        named companion fields that exist, read atomically with the state."""
        ...

    async def read_all(self, key: str, *, schema: str = "") -> StoredState:
        """The state with every companion field it has (its `fields`), read atomically: for the rare operation that
        needs an entity's whole record (a flashcard user's every card), not for the per-request path."""
        ...

    async def seen(self, key: str, event_ids: Sequence[str]) -> set[str]:
        """Which of `event_ids` were already applied to `key` (within the de-duplication window)."""
        ...

    async def compare_and_set(
        self, key: str, expected_version: int, blob: bytes, added_events: int, event_ids: Sequence[str] = (),
        fields: Mapping[str, bytes] | None = None, *, schema: str = "", rows: Sequence[LogRow] = (),
        expected_total: int | None = None,
    ) -> StoredState | None:
        """Atomically, if the schema's state is at `expected_version` (and, given `expected_total`, the key's log
        holds that many events): write `blob`, version + 1, events += `added_events`, updated = now, append
        `rows` to the log (trimming it to its bounds), logged = the new total, record `event_ids`, set the
        companion `fields` given (others are kept), refresh the TTL, and return the new state. Otherwise write
        nothing and return None (re-read and retry). `StoreUnavailable`: nothing was written; its subclass
        `OutcomeUnknown`: the write was sent but not answered, and may have been applied (whole), or may yet be
        (core.StatefulTask._resolve)."""
        ...

    async def log(self, key: str) -> tuple[int, list[LogRow]]:
        """(how many logged events were trimmed before the first held, the held events oldest first)."""
        ...

    async def scan(self, prefix: str, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """A step of a walk over the keys that start with `prefix` and hold a log or a state: (the next cursor, "0"
        once the walk is over; about `count` keys, maybe none). A walk from "0" to "0" sees every key that existed
        throughout it, some maybe twice, in no particular order; on a Redis Cluster, every primary's."""
        ...

    async def delete(self, key: str) -> bool:
        """Remove every schema's state, the log, the companion fields and the event ids; True if there was
        something to remove."""
        ...

    async def ping(self) -> None:
        """Raise `StoreUnavailable` if the store cannot be reached."""
        ...

    async def close(self) -> None: ...


DEFAULT_MAX_LOGGED = 10_000


@dataclass(frozen=True)
class LogBounds:
    """How much of each key's history the log keeps: at most `max_rows` events (beyond it the oldest eighth goes
    at once, so that trimming is rare), none older than `max_age_seconds` (None: any age)."""

    max_rows: int = DEFAULT_MAX_LOGGED
    max_age_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {self.max_rows!r}")
        if self.max_age_seconds is not None and not self.max_age_seconds > 0:
            raise ValueError(f"max_age_seconds must be > 0 or None, got {self.max_age_seconds!r}")

    @property
    def keep(self) -> int:
        """Events kept when the count bound is passed."""
        return max(1, self.max_rows - self.max_rows // 8)


def _check_settings(ttl_seconds: float | None, max_event_ids: int) -> None:
    if ttl_seconds is not None and not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds must be > 0 or None (no expiry), got {ttl_seconds!r}")
    if max_event_ids < 0:
        raise ValueError(f"max_event_ids must be >= 0, got {max_event_ids!r}")


# --------------------------------------------------------------------------------------------------
# In-process store
# --------------------------------------------------------------------------------------------------


@dataclass
class _State:
    version: int = 0
    events: int = 0
    updated: float | None = None
    blob: bytes | None = None
    logged: int = 0
    fields: dict[str, bytes] = field(default_factory=dict)  # companion fields


@dataclass
class _Entry:
    states: dict[str, _State] = field(default_factory=dict)  # schema -> its state
    rows: list[LogRow] = field(default_factory=list)  # the log, oldest first
    total: int = 0
    base: int = 0
    ids: dict[str, None] = field(default_factory=dict)  # applied ids, insertion order = oldest first
    expires_at: float = math.inf  # time.monotonic() deadline


def _stored(entry: _Entry, state: _State | None, fields: Sequence[str] = ()) -> StoredState:
    if state is None:
        return replace(ABSENT, total=entry.total, base=entry.base)
    values = {f: state.fields[f] for f in fields if f in state.fields}
    return StoredState(state.version, state.events, state.updated, state.blob, values, state.logged, entry.total,
                       entry.base)


class InProcessStore:
    """A dict behind an asyncio.Lock, with the same semantics as `RedisStore`.

    TTLs use the monotonic clock (immune to wall-clock jumps) and are enforced lazily: an expired
    entry is dropped when touched, and a full sweep runs at most once per TTL period on writes so
    entities that never come back do not accumulate.
    """

    def __init__(
        self,
        *,
        ttl_seconds: float | None,
        max_event_ids: int = DEFAULT_MAX_EVENT_IDS,
        log: LogBounds = LogBounds(),
        clock: Callable[[], float] = time.time,  # wall clock for `updated`
    ) -> None:
        _check_settings(ttl_seconds, max_event_ids)
        self._ttl = ttl_seconds
        self._max_ids = max_event_ids
        self._bounds = log
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        self._lock = asyncio.Lock()
        self._next_sweep = time.monotonic() + (ttl_seconds or math.inf)

    def _live(self, key: str, now: float) -> _Entry | None:
        entry = self._data.get(key)
        if entry is not None and entry.expires_at <= now:
            del self._data[key]
            return None
        return entry

    def _sweep(self, now: float) -> None:
        if now >= self._next_sweep:
            self._data = {k: e for k, e in self._data.items() if e.expires_at > now}
            self._next_sweep = now + (self._ttl or math.inf)

    async def get(self, key: str, *, schema: str = "") -> StoredState:
        return (await self.read(key, schema=schema))[0]

    async def seen(self, key: str, event_ids: Sequence[str]) -> set[str]:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            return set() if entry is None else {i for i in event_ids if i in entry.ids}

    async def read(self, key: str, event_ids: Sequence[str] = (), fields: Sequence[str] = (), *, schema: str = ""
                   ) -> tuple[StoredState, set[str]]:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return ABSENT, set()
            return _stored(entry, entry.states.get(schema), fields), {i for i in event_ids if i in entry.ids}

    async def read_all(self, key: str, *, schema: str = "") -> StoredState:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return ABSENT
            state = entry.states.get(schema)
            return _stored(entry, state, list(state.fields) if state else ())

    async def compare_and_set(
        self, key: str, expected_version: int, blob: bytes, added_events: int, event_ids: Sequence[str] = (),
        fields: Mapping[str, bytes] | None = None, *, schema: str = "", rows: Sequence[LogRow] = (),
        expected_total: int | None = None,
    ) -> StoredState | None:
        async with self._lock:
            now = time.monotonic()
            self._sweep(now)
            entry = self._live(key, now) or _Entry()
            state = entry.states.get(schema) or _State()
            if state.version != expected_version or expected_total not in (None, entry.total):
                return None
            wall = self._clock()
            entry.rows.extend(LogRow(float(min(max(int(r.time), 0), 0xFFFFFFFF)), bytes(r.payload)) for r in rows)
            entry.total += len(rows)
            bounds, drop = self._bounds, 0
            if len(entry.rows) > bounds.max_rows:
                drop = len(entry.rows) - bounds.keep
            if bounds.max_age_seconds is not None:
                while drop < len(entry.rows) and entry.rows[drop].time < wall - bounds.max_age_seconds:
                    drop += 1
            del entry.rows[:drop]
            entry.base += drop
            state.version += 1
            state.events += added_events
            state.updated = wall
            state.blob = bytes(blob)
            state.logged = entry.total
            if fields:
                state.fields.update((str(name), bytes(value)) for name, value in fields.items())
            entry.states[schema] = state
            for event_id in event_ids:
                entry.ids.setdefault(event_id, None)  # a replayed id keeps its original place
            while len(entry.ids) > self._max_ids:  # trim the oldest beyond the window
                del entry.ids[next(iter(entry.ids))]
            entry.expires_at = now + self._ttl if self._ttl is not None else math.inf
            self._data[key] = entry
            return _stored(entry, state)

    async def log(self, key: str) -> tuple[int, list[LogRow]]:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            return (0, []) if entry is None else (entry.base, list(entry.rows))

    async def scan(self, prefix: str, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        if cursor != "0" and not cursor.startswith("k"):
            raise ValueError(f"not a scan cursor: {cursor!r}")
        after = cursor[1:] if cursor != "0" else None
        async with self._lock:
            now = time.monotonic()
            keys = sorted(k for k, e in self._data.items() if k.startswith(prefix) and e.expires_at > now
                          and (after is None or k > after))
        page = keys[:max(1, count)]
        return ("0" if len(keys) <= len(page) else "k" + page[-1]), page

    async def delete(self, key: str) -> bool:
        async with self._lock:
            if self._live(key, time.monotonic()) is None:
                return False
            del self._data[key]
            return True

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None


# --------------------------------------------------------------------------------------------------
# Redis store
# --------------------------------------------------------------------------------------------------

# The replay window in Redis: the 8-byte fingerprints (BLAKE2b-64) of the newest `max_event_ids` event ids of a
# key, twice: in a STRING `<key>:ring`, oldest overwritten first (slot = n mod max_ids, n = the meta hash's `ids`,
# the ids ever recorded), which says what to forget; and in a HASH `<key>:ids` of up to 256 buckets (field = the
# fingerprint's first byte, value = its fingerprints concatenated), which answers "seen?" from one bucket (about
# max_ids / 256 fingerprints, read with HMGET and scanned here) instead of the whole window: about 18 B per id
# (docs/decisions.md; scanning the ring alone costs 8 B per id but about 7 times the Redis CPU at a full window).
# A fingerprint only counts where it starts on an 8-byte boundary.
_FIND_LUA = r"""
local function find(s, fp)
  local at = string.find(s, fp, 1, true)
  while at and (at - 1) % 8 ~= 0 do at = string.find(s, fp, at + 1, true) end
  return at
end
"""

# KEYS[1] meta, KEYS[2] the schema's state, KEYS[3] companion fields, KEYS[4] buckets. ARGV: n_fields, field names,
# bucket names -> {the state's version, events, updated, blob, logged; the meta's total, base; fields; buckets}. One
# command (a pipeline of several would meet a loading or read-only server's refusals one by one), no writes (so a
# read-only replica runs it).
_READ_LUA = "#!lua flags=no-writes\n" + r"""
local out = redis.call('HMGET', KEYS[2], 'version', 'events', 'updated', 'blob', 'logged')
for _, v in ipairs(redis.call('HMGET', KEYS[1], 'total', 'base')) do out[#out + 1] = v end
local n_fields = tonumber(ARGV[1])
if n_fields > 0 then
  for _, v in ipairs(redis.call('HMGET', KEYS[3], unpack(ARGV, 2, n_fields + 1))) do out[#out + 1] = v end
end
if #ARGV > n_fields + 1 then
  for _, v in ipairs(redis.call('HMGET', KEYS[4], unpack(ARGV, n_fields + 2))) do out[#out + 1] = v end
end
return out
"""

# KEYS[1] meta, KEYS[2] the schema's state, KEYS[3] ring, KEYS[4] companion fields, KEYS[5] log, KEYS[6] buckets.
# ARGV: expected_version, expected_total (-1: any), blob, added_events, now, ttl_ms (0 = no expiry), max_ids,
#       max_rows, keep_rows, min_time (-1: any age), schema marker (a meta field naming the schema; '' for
#       schema ''), n_fields, n_fields (name, value) pairs, n_rows, rows (encoded), fingerprints...
_CAS_LUA = _FIND_LUA + r"""
local function forget(fp)
  local field = string.sub(fp, 1, 1)
  local bucket = redis.call('HGET', KEYS[6], field)
  local at = bucket and find(bucket, fp)
  if not at then return end
  bucket = string.sub(bucket, 1, at - 1) .. string.sub(bucket, at + 8)
  if #bucket == 0 then redis.call('HDEL', KEYS[6], field) else redis.call('HSET', KEYS[6], field, bucket) end
end

local version = tonumber(redis.call('HGET', KEYS[2], 'version') or '0')
if version ~= tonumber(ARGV[1]) then return false end
local total = tonumber(redis.call('HGET', KEYS[1], 'total') or '0')
if tonumber(ARGV[2]) >= 0 and total ~= tonumber(ARGV[2]) then return false end
version = version + 1
local first_row = 14 + 2 * tonumber(ARGV[12])
local n_rows = tonumber(ARGV[first_row - 1])
local first_fp = first_row + n_rows
if n_rows > 0 then redis.call('RPUSH', KEYS[5], unpack(ARGV, first_row, first_fp - 1)) end
total = total + n_rows
local base = tonumber(redis.call('HGET', KEYS[1], 'base') or '0')
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
redis.call('HSET', KEYS[1], 'total', total, 'base', base)
if ARGV[11] ~= '' then redis.call('HSET', KEYS[1], ARGV[11], 1) end
local events = redis.call('HINCRBY', KEYS[2], 'events', ARGV[4])
redis.call('HSET', KEYS[2], 'version', version, 'blob', ARGV[3], 'updated', ARGV[5], 'logged', total)
for i = 13, first_row - 2, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
if #ARGV >= first_fp then
  local width = tonumber(ARGV[7])
  local n = tonumber(redis.call('HGET', KEYS[1], 'ids') or '0')
  local held = redis.call('STRLEN', KEYS[3]) / 8
  if held > width then  -- the window was made smaller: forget all but the newest `width`, keep them oldest first
    local ring, kept = redis.call('GET', KEYS[3]), {}
    for j = n - held, n - 1 do
      local at = (j % held) * 8
      local fp = string.sub(ring, at + 1, at + 8)
      if j < n - width then forget(fp) else kept[#kept + 1] = fp end
    end
    redis.call('SET', KEYS[3], table.concat(kept))
    n = width
  end
  for i = first_fp, #ARGV do
    local fp = ARGV[i]
    local bucket = redis.call('HGET', KEYS[6], string.sub(fp, 1, 1)) or ''
    if not find(bucket, fp) then  -- a replayed id keeps its place
      local slot = (n % width) * 8
      if n >= width then forget(redis.call('GETRANGE', KEYS[3], slot, slot + 7)) end  -- the oldest
      local field = string.sub(fp, 1, 1)  -- (re-read: forgetting may have changed this bucket)
      redis.call('HSET', KEYS[6], field, (redis.call('HGET', KEYS[6], field) or '') .. fp)
      redis.call('SETRANGE', KEYS[3], slot, fp)
      n = n + 1
      if n == width then  -- just filled: rewrite it at its exact size (growing left up to 2x spare room)
        redis.call('SET', KEYS[3], redis.call('GET', KEYS[3]))
      end
    end
  end
  redis.call('HSET', KEYS[1], 'ids', n)
end
local ttl = tonumber(ARGV[6])
for _, k in ipairs(KEYS) do
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
end
return {version, events, total, base}
"""

# KEYS[1] meta, the ring, the fields of schema "", the log, the buckets; and every other schema's state and fields
_DELETE_LUA = r"""
local keys = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]}
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


def _in_window(event_ids: Sequence[str], fingerprints: list[bytes], buckets: list) -> set[str]:
    """The ids whose fingerprint is in its bucket, at an 8-byte boundary."""
    seen = set()
    for event_id, fp, bucket in zip(event_ids, fingerprints, buckets, strict=True):
        at = bucket.find(fp) if bucket else -1
        while at > 0 and at % 8:
            at = bucket.find(fp, at + 1)
        if at >= 0:
            seen.add(event_id)
    return seen


def _fingerprint(event_id: str) -> bytes:
    return hashlib.blake2b(event_id.encode(), digest_size=8).digest()


_REDIS_CURSOR = re.compile(r"[0-9]{1,20}(:[0-9]{1,20})?")  # one node's SCAN cursor; "<primary>:<cursor>" (cluster)


def _glob_escape(text: str) -> str:
    """`text` matched literally by a Redis glob pattern."""
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


def _int(value, default: int = 0) -> int:
    return default if value is None else int(value)


class RedisStore:
    """State in Redis. For a caller key K, under the Redis Cluster hash tag {K} (every key of an entity in one
    slot, and a caller key ending in ":ring" cannot collide with another key's window):

        <prefix>:{K}              HASH  the key's meta (total, base: its log's counts; ids: event ids ever
                                        recorded; s:<schema>: the schemas holding a state) and the state of
                                        schema "" (version, events, updated, blob, logged)
        <prefix>:{K}:s:<schema>   HASH  the state of another schema (a model version's layout)
        ...:fields                HASH  a state's companion fields (only where some were written)
        <prefix>:{K}:log          LIST  the event log, oldest first: each 4-byte big-endian seconds, the payload
        <prefix>:{K}:ring         STRING the replay window: the fingerprints of the newest `max_event_ids` ids
        <prefix>:{K}:ids          HASH  the same fingerprints in 256 buckets by their first byte (lookups)

    all refreshed to the TTL by each write (another schema's state keeps its own). A fingerprint is BLAKE2b-64 of the
    id: a new id is taken for a replay only if its fingerprint equals one of the window's, about
    `max_event_ids / 2**64` (5e-16 at 10,000) per event.

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
        log: LogBounds = LogBounds(),
        socket_timeout: float | None = None,  # shorthand for options.socket_timeout and connect_timeout
        options: RedisOptions | None = None,
        client: Client | None = None,
        key_prefix: str = "nextstep",
        clock: Callable[[], float] = time.time,  # `updated` comes from here, passed to the script
    ) -> None:
        _check_settings(ttl_seconds, max_event_ids)
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
                         for name, lua in (("cas", _CAS_LUA), ("read", _READ_LUA), ("delete", _DELETE_LUA))}

    def _keys(self, key: str, schema: str = "") -> tuple[str, str, str, str, str, str]:
        """The meta hash, the schema's state, the ring, the state's companion fields, the log, the buckets."""
        meta = f"{self._prefix}:{{{key}}}"
        state = f"{meta}:s:{schema}" if schema else meta
        return meta, state, f"{meta}:ring", f"{state}:fields", f"{meta}:log", f"{meta}:ids"

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
        """The state, the meta hash's log counts, the event ids' buckets and the fields asked for: one script, so one
        round trip and one point in time (the fields belong to the version read)."""
        meta, state_key, _, fields_key, _, ids_key = self._keys(key, schema)
        fingerprints = [_fingerprint(i) for i in event_ids]
        reply = await self._script(what, "read", (meta, state_key, fields_key, ids_key),
                                   (len(fields), *fields, *(f[:1] for f in fingerprints)), write=False)
        (version, events, updated, blob, logged, total, base), rest = reply[:7], reply[7:]
        seen = _in_window(event_ids, fingerprints, rest[len(fields):]) if fingerprints else set()
        total, base = _int(total), _int(base)
        if version is None:
            return replace(ABSENT, total=total, base=base), seen
        found = {name: value for name, value in zip(fields, rest[:len(fields)], strict=True) if value is not None}
        return StoredState(int(version), int(events), float(updated), blob, found, _int(logged), total, base), seen

    async def read_all(self, key: str, *, schema: str = "") -> StoredState:
        meta, state_key, _, fields_key, _, _ = self._keys(key, schema)
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
                len(pairs) // 2, *pairs, len(frames), *frames, *(_fingerprint(i) for i in event_ids))
        reply = await self._script("compare_and_set", "cas", self._keys(key, schema), args, write=True)
        if reply is None:
            return None
        version, events, total, base = (int(x) for x in reply)
        return StoredState(version, events, now, bytes(blob), {}, total, total, base)

    async def log(self, key: str) -> tuple[int, list[LogRow]]:
        meta, *_, log, _ = self._keys(key)
        base, items = await self._execute("log", (("HGET", meta, "base"), ("LRANGE", log, 0, -1)), atomic=True)
        return _int(base), decode_rows(items)

    async def scan(self, prefix: str, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """SCAN over the meta hashes `<prefix>:{K}` with K starting with `prefix` (every primary's on a cluster)."""
        if not _REDIS_CURSOR.fullmatch(cursor):
            raise ValueError(f"not a scan cursor: {cursor!r}")
        head = f"{self._prefix}:{{"
        pattern = _glob_escape(head + prefix) + "*}"
        following, names = await self.client.scan(cursor, pattern, count)
        keys = []
        for name in names:
            text = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
            if text.startswith(head) and text.endswith("}"):  # (a state of another schema ends otherwise)
                keys.append(text[len(head):-1])
        return following, keys

    async def delete(self, key: str) -> bool:
        meta, _, ring, fields, log, ids = self._keys(key)
        removed = await self._script("delete", "delete", (meta, ring, fields, log, ids), (), write=True)
        return removed > 0

    async def ping(self) -> None:
        await self._execute("ping", (("PING",),))

    async def close(self) -> None:
        if self._owned:
            await self.client.close()


def make_store(
    redis_url: str | None, *, ttl_seconds: float | None, max_event_ids: int = DEFAULT_MAX_EVENT_IDS,
    log: LogBounds = LogBounds(), options: RedisOptions | None = None, client: Client | None = None,
) -> StateStore:
    """`RedisStore` when a URL (or a client) is given, else the embedded `InProcessStore`."""
    if redis_url or client is not None:
        return RedisStore(redis_url, ttl_seconds=ttl_seconds, max_event_ids=max_event_ids, log=log, options=options,
                          client=client)
    return InProcessStore(ttl_seconds=ttl_seconds, max_event_ids=max_event_ids, log=log)
