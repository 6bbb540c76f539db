"""The embedded state store: `InProcessStore`, state.py's contract in one process's memory.

The store when no Redis URL is configured (tests, a single process) and the one offline scoring replays learners
through (scoring.py): it imports no Redis client."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from .state import (
    ABSENT,
    DEFAULT_LOG_BOUNDS,
    DEFAULT_MAX_EVENT_IDS,
    LogBounds,
    LogRow,
    StoredState,
    check_store_settings,
)


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
        log: LogBounds = DEFAULT_LOG_BOUNDS,
        clock: Callable[[], float] = time.time,  # wall clock for `updated`
    ) -> None:
        check_store_settings(ttl_seconds, max_event_ids)
        self._ttl = ttl_seconds
        self._max_ids = max_event_ids
        self._bounds = log
        self._clock = clock
        self._data: dict[str, _Entry] = {}
        self._leases: dict[str, tuple[str, float]] = {}  # key -> (owner, time.monotonic() deadline)
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

    async def lease(self, key: str, owner: str, ms: int) -> bool:
        now = time.monotonic()
        held = self._leases.get(key)
        if held is not None and held[1] > now:
            return False
        self._leases[key] = (owner, now + ms / 1000)
        return True

    async def release(self, key: str, owner: str) -> None:
        if self._leases.get(key, ("",))[0] == owner:
            del self._leases[key]

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
