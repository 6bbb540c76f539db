"""Per-entity model state, shared by every replica of the service.

Each entity (a learner) has a small opaque state (tensors serialised to bytes by the caller), a
version and a count of absorbed events. Writers never lock: they read, compute, then
`compare_and_set` against the version they read; on a conflict they re-read and retry, so
concurrent events for one entity are all applied and none is lost (optimistic concurrency).

Events may carry ids. The ids applied to a key are kept (newest `max_event_ids` of them: the
de-duplication window) so a replayed event can be recognised with `seen` and skipped. Checking
`seen` and then writing is race-free because the write is conditional on the version: if another
writer applied the same id in between, the version moved and the CAS fails.

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

    @property
    def exists(self) -> bool:
        return self.version > 0


ABSENT = StoredState(version=0, events=0, updated=None, blob=None)


@runtime_checkable
class StateStore(Protocol):
    async def get(self, key: str) -> StoredState: ...

    async def read(self, key: str, event_ids: Sequence[str] = (), fields: Sequence[str] = ()
                   ) -> tuple[StoredState, set[str]]:
        """`get` and `seen` together, in one round trip where the backend allows. With `fields`, the state's
        `fields` holds those of the named companion fields that exist, read atomically with the state."""
        ...

    async def read_all(self, key: str) -> StoredState:
        """The state with every companion field it has (its `fields`), read atomically: for the rare operation that
        needs an entity's whole record (a flashcard user's every card), not for the per-request path."""
        ...

    async def seen(self, key: str, event_ids: Sequence[str]) -> set[str]:
        """Which of `event_ids` were already applied to `key` (within the de-duplication window)."""
        ...

    async def compare_and_set(
        self, key: str, expected_version: int, blob: bytes, added_events: int, event_ids: Sequence[str] = (),
        fields: Mapping[str, bytes] | None = None,
    ) -> StoredState | None:
        """Atomically, if the current version == `expected_version`: write `blob`, version + 1,
        events += `added_events`, updated = now, record `event_ids`, set the companion `fields` given (others
        are kept), refresh the TTL, and return the new state. Otherwise write nothing and return None
        (re-read and retry). `StoreUnavailable`: nothing was written; its subclass `OutcomeUnknown`: the write
        was sent but not answered, and may have been applied (whole), or may yet be (core.StatefulTask._resolve)."""
        ...

    async def delete(self, key: str) -> bool:
        """Remove the state, its companion fields and its event ids; True if there was something to remove."""
        ...

    async def ping(self) -> None:
        """Raise `StoreUnavailable` if the store cannot be reached."""
        ...

    async def close(self) -> None: ...


def _check_settings(ttl_seconds: float | None, max_event_ids: int) -> None:
    if ttl_seconds is not None and not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds must be > 0 or None (no expiry), got {ttl_seconds!r}")
    if max_event_ids < 0:
        raise ValueError(f"max_event_ids must be >= 0, got {max_event_ids!r}")


# --------------------------------------------------------------------------------------------------
# In-process store
# --------------------------------------------------------------------------------------------------


@dataclass
class _Entry:
    version: int = 0
    events: int = 0
    updated: float | None = None
    blob: bytes | None = None
    ids: dict[str, None] = field(default_factory=dict)  # applied ids, insertion order = oldest first
    fields: dict[str, bytes] = field(default_factory=dict)  # companion fields
    expires_at: float = math.inf  # time.monotonic() deadline


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
        clock: Callable[[], float] = time.time,  # wall clock for `updated`
    ) -> None:
        _check_settings(ttl_seconds, max_event_ids)
        self._ttl = ttl_seconds
        self._max_ids = max_event_ids
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

    async def get(self, key: str) -> StoredState:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return ABSENT
            return StoredState(entry.version, entry.events, entry.updated, entry.blob)

    async def seen(self, key: str, event_ids: Sequence[str]) -> set[str]:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            return set() if entry is None else {i for i in event_ids if i in entry.ids}

    async def read(self, key: str, event_ids: Sequence[str] = (), fields: Sequence[str] = ()
                   ) -> tuple[StoredState, set[str]]:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return ABSENT, set()
            values = {f: entry.fields[f] for f in fields if f in entry.fields}
            state = StoredState(entry.version, entry.events, entry.updated, entry.blob, values)
            return state, {i for i in event_ids if i in entry.ids}

    async def read_all(self, key: str) -> StoredState:
        async with self._lock:
            entry = self._live(key, time.monotonic())
            if entry is None:
                return ABSENT
            return StoredState(entry.version, entry.events, entry.updated, entry.blob, dict(entry.fields))

    async def compare_and_set(
        self, key: str, expected_version: int, blob: bytes, added_events: int, event_ids: Sequence[str] = (),
        fields: Mapping[str, bytes] | None = None,
    ) -> StoredState | None:
        async with self._lock:
            now = time.monotonic()
            self._sweep(now)
            entry = self._live(key, now) or _Entry()
            if entry.version != expected_version:
                return None
            entry.version += 1
            entry.events += added_events
            entry.updated = self._clock()
            entry.blob = bytes(blob)
            if fields:
                entry.fields.update((str(name), bytes(value)) for name, value in fields.items())
            for event_id in event_ids:
                entry.ids.setdefault(event_id, None)  # a replayed id keeps its original place
            while len(entry.ids) > self._max_ids:  # trim the oldest beyond the window
                del entry.ids[next(iter(entry.ids))]
            entry.expires_at = now + self._ttl if self._ttl is not None else math.inf
            self._data[key] = entry
            return StoredState(entry.version, entry.events, entry.updated, entry.blob)

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

# The replay window in Redis: the 8-byte fingerprints (BLAKE2b-64) of the newest `max_event_ids` event ids,
# twice: in a STRING `<key>:ring`, oldest overwritten first (slot = n mod max_ids, n = hash field `ids`, the ids
# ever recorded), which says what to forget; and in a HASH `<key>:ids` of up to 256 buckets (field = the
# fingerprint's first byte, value = its fingerprints concatenated), which answers "seen?" from one bucket
# (about max_ids / 256 fingerprints, read with HMGET and scanned here) instead of the whole window. About
# 18 B per id instead of ~105 in a sorted set (docs/decisions.md). A fingerprint only counts where it starts on
# an 8-byte boundary.
_FIND_LUA = r"""
local function find(s, fp)
  local at = string.find(s, fp, 1, true)
  while at and (at - 1) % 8 ~= 0 do at = string.find(s, fp, at + 1, true) end
  return at
end
"""

# KEYS[1] state hash, KEYS[2] buckets, KEYS[3] ring, KEYS[4] companion fields.
# ARGV: expected_version, blob, added_events, now, ttl_ms (0 = no expiry), max_ids, n_fields,
#       n_fields (name, value) pairs, fingerprints...
_CAS_LUA = _FIND_LUA + r"""
local function forget(fp)
  local field = string.sub(fp, 1, 1)
  local bucket = redis.call('HGET', KEYS[2], field)
  local at = bucket and find(bucket, fp)
  if not at then return end
  bucket = string.sub(bucket, 1, at - 1) .. string.sub(bucket, at + 8)
  if #bucket == 0 then redis.call('HDEL', KEYS[2], field) else redis.call('HSET', KEYS[2], field, bucket) end
end

local version = tonumber(redis.call('HGET', KEYS[1], 'version') or '0')
if version ~= tonumber(ARGV[1]) then return false end
version = version + 1
local events = redis.call('HINCRBY', KEYS[1], 'events', ARGV[3])
redis.call('HSET', KEYS[1], 'version', version, 'blob', ARGV[2], 'updated', ARGV[4])
local first_fp = 8 + 2 * tonumber(ARGV[7])
for i = 8, first_fp - 1, 2 do redis.call('HSET', KEYS[4], ARGV[i], ARGV[i + 1]) end
if #ARGV >= first_fp then
  local width = tonumber(ARGV[6])
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
    local bucket = redis.call('HGET', KEYS[2], string.sub(fp, 1, 1)) or ''
    if not find(bucket, fp) then  -- a replayed id keeps its place
      local slot = (n % width) * 8
      if n >= width then forget(redis.call('GETRANGE', KEYS[3], slot, slot + 7)) end  -- the oldest
      local field = string.sub(fp, 1, 1)  -- (re-read: forgetting may have changed this bucket)
      redis.call('HSET', KEYS[2], field, (redis.call('HGET', KEYS[2], field) or '') .. fp)
      redis.call('SETRANGE', KEYS[3], slot, fp)
      n = n + 1
      if n == width then  -- just filled: rewrite it at its exact size (growing left up to 2x spare room)
        redis.call('SET', KEYS[3], redis.call('GET', KEYS[3]))
      end
    end
  end
  redis.call('HSET', KEYS[1], 'ids', n)
end
local ttl = tonumber(ARGV[5])
for _, k in ipairs(KEYS) do
  if ttl > 0 then redis.call('PEXPIRE', k, ttl) else redis.call('PERSIST', k) end
end
return {version, events}
"""

_FIELDS = (b"version", b"events", b"updated", b"blob")


def _fingerprint(event_id: str) -> bytes:
    return hashlib.blake2b(event_id.encode(), digest_size=8).digest()


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


def _state(reply: list) -> StoredState:
    version, events, updated, blob = reply
    if version is None:
        return ABSENT
    return StoredState(int(version), int(events), float(updated), blob)


class RedisStore:
    """State in Redis: a HASH per key (version/events/updated/blob, and `ids`: how many event ids were
    ever recorded), a HASH `<key>:fields` of its companion fields (only where some were written), and the
    replay window of the newest `max_event_ids` applied event ids, kept as 8-byte
    fingerprints in `<key>:ids` (a HASH of 256 buckets, for lookups) and `<key>:ring` (a STRING, the
    order in which they are forgotten); all of them share the TTL. A fingerprint is BLAKE2b-64 of the id: a
    new id is taken for a replay only if its fingerprint equals one of the window's, about
    `max_event_ids / 2**64` (5e-16 at 10,000) per event.

    Redis keys are `<key_prefix>:{<key>}`, `<key_prefix>:{<key>}:ids`, `<key_prefix>:{<key>}:ring` and
    `<key_prefix>:{<key>}:fields`:
    the braces are a Redis Cluster hash tag, putting the keys of one operation in one slot (one node), and they
    also keep a caller key ending in ":ids" from colliding with another key's window.

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
        socket_timeout: float | None = None,  # shorthand for options.socket_timeout and connect_timeout
        options: RedisOptions | None = None,
        client: Client | None = None,
        key_prefix: str = "nextstep",
        clock: Callable[[], float] = time.time,  # `updated` comes from here, passed to the script
    ) -> None:
        _check_settings(ttl_seconds, max_event_ids)
        self._ttl_ms = 0 if ttl_seconds is None else max(1, round(ttl_seconds * 1000))
        self._max_ids = max_event_ids
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
                         for name, lua in (("cas", _CAS_LUA),)}

    def _keys(self, key: str) -> tuple[str, str, str, str]:
        """The state hash, the replay window's buckets and its ring, the companion fields."""
        state = f"{self._prefix}:{{{key}}}"
        return state, f"{state}:ids", f"{state}:ring", f"{state}:fields"

    async def _call(self, what: str, *commands: tuple) -> list:
        """Read-only (or idempotent) commands in one write; their replies."""
        return await self._execute(what, commands)

    async def get(self, key: str) -> StoredState:
        state_key = self._keys(key)[0]
        (reply,) = await self._execute("get", (("HMGET", state_key, *_FIELDS),))
        return _state(reply)

    async def _eval(self, what: str, name: str, keys: tuple[str, ...], args: Sequence) -> object:
        """The script by its digest; NOSCRIPT (a restarted or flushed server) -> EVAL, which loads it again. A write:
        never retried once sent (the client's rule), and acknowledged by `wait_replicas` replicas where asked."""
        sha, lua = self._scripts[name]
        (reply,) = await self._execute(what, (("EVALSHA", sha, len(keys), *keys, *args),), idempotent=False,
                                       write=True)
        if is_noscript(reply):
            (reply,) = await self._execute(what, (("EVAL", lua, len(keys), *keys, *args),), idempotent=False,
                                           write=True)
        return reply

    async def seen(self, key: str, event_ids: Sequence[str]) -> set[str]:
        if not event_ids:
            return set()
        fingerprints = [_fingerprint(i) for i in event_ids]
        (buckets,) = await self._execute("seen", (("HMGET", self._keys(key)[1], *(f[:1] for f in fingerprints)),))
        return _in_window(event_ids, fingerprints, buckets)

    async def read(self, key: str, event_ids: Sequence[str] = (), fields: Sequence[str] = ()
                   ) -> tuple[StoredState, set[str]]:
        state_key, ids_key, _, fields_key = self._keys(key)
        if fields:
            return await self._read_fields(state_key, ids_key, fields_key, event_ids, fields)
        if not event_ids:
            (reply,) = await self._execute("read", (("HMGET", state_key, *_FIELDS),))
            return _state(reply), set()
        fingerprints = [_fingerprint(i) for i in event_ids]
        reply, buckets = await self._execute("read", (("HMGET", state_key, *_FIELDS),  # one round trip
                                                      ("HMGET", ids_key, *(f[:1] for f in fingerprints))))
        return _state(reply), _in_window(event_ids, fingerprints, buckets)

    async def _read_fields(self, state_key: str, ids_key: str, fields_key: str, event_ids: Sequence[str],
                           fields: Sequence[str]) -> tuple[StoredState, set[str]]:
        """The state, the seen ids and the companion fields in one MULTI/EXEC: one round trip (the commands go
        in one write), and one point in time, so the fields always belong to the version read."""
        fingerprints = [_fingerprint(i) for i in event_ids]
        commands = [("HMGET", state_key, *_FIELDS)]
        if fingerprints:
            commands.append(("HMGET", ids_key, *(f[:1] for f in fingerprints)))
        commands.append(("HMGET", fields_key, *fields))
        replies = await self._execute("read", commands, atomic=True)
        state, values = _state(replies[0]), replies[-1]
        seen = _in_window(event_ids, fingerprints, replies[1]) if fingerprints else set()
        if state.version == 0:
            return state, seen
        found = {name: value for name, value in zip(fields, values, strict=True) if value is not None}
        return StoredState(state.version, state.events, state.updated, state.blob, found), seen

    async def read_all(self, key: str) -> StoredState:
        state_key, _, _, fields_key = self._keys(key)
        reply, values = await self._execute("read all", (("HMGET", state_key, *_FIELDS), ("HGETALL", fields_key)),
                                            atomic=True)
        state = _state(reply)
        if state.version == 0:
            return state
        values = dict(zip(values[::2], values[1::2], strict=True)) if isinstance(values, list) else values
        found = {(k.decode() if isinstance(k, bytes) else k): v for k, v in values.items()}
        return StoredState(state.version, state.events, state.updated, state.blob, found)

    async def compare_and_set(
        self, key: str, expected_version: int, blob: bytes, added_events: int, event_ids: Sequence[str] = (),
        fields: Mapping[str, bytes] | None = None,
    ) -> StoredState | None:
        now = self._clock()
        pairs = [part for name, value in (fields or {}).items() for part in (str(name), bytes(value))]
        args = (expected_version, blob, added_events, repr(now), self._ttl_ms, self._max_ids, len(pairs) // 2,
                *pairs, *(_fingerprint(i) for i in event_ids))
        reply = await self._eval("compare_and_set", "cas", self._keys(key), args)
        if reply is None:
            return None
        version, events = reply
        return StoredState(int(version), int(events), now, bytes(blob))

    async def delete(self, key: str) -> bool:
        (removed,) = await self._execute("delete", (("DEL", *self._keys(key)),), write=True)
        return removed > 0

    async def ping(self) -> None:
        await self._execute("ping", (("PING",),))

    async def close(self) -> None:
        if self._owned:
            await self.client.close()


def make_store(
    redis_url: str | None, *, ttl_seconds: float | None, max_event_ids: int = DEFAULT_MAX_EVENT_IDS,
    options: RedisOptions | None = None, client: Client | None = None,
) -> StateStore:
    """`RedisStore` when a URL (or a client) is given, else the embedded `InProcessStore`."""
    if redis_url or client is not None:
        return RedisStore(redis_url, ttl_seconds=ttl_seconds, max_event_ids=max_event_ids, options=options,
                          client=client)
    return InProcessStore(ttl_seconds=ttl_seconds, max_event_ids=max_event_ids)
