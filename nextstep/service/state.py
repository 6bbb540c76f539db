"""Per-entity model state, shared by every replica of the service.

Each entity (a learner) has a small opaque state (tensors serialised to bytes by the caller), a
version and a count of absorbed events. Writers never lock: they read, compute, then
`compare_and_set` against the version they read; on a conflict they re-read and retry, so
concurrent events for one entity are all applied and none is lost (optimistic concurrency).

Events may carry ids. The ids applied to a key are kept (newest `max_event_ids` of them: the
de-duplication window; 0 keeps none) so a replayed event can be recognised with `seen` and skipped. An id
recorded again while in the window keeps its place, and a window made larger or smaller keeps its newest ids.
Checking `seen` and then writing is race-free because the write is conditional on the version: if another
writer applied the same id in between, the version moved and the CAS fails. The in-process store keeps the ids
themselves; Redis keeps 56 bits of a hash of each, so there a new id is taken for a replay with a probability of
about `max_event_ids / 2**56` (redis_store.py).

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

* `RedisStore`     -- the deployment store; any replica serves any learner, restarts lose nothing (redis_store.py).
* `InProcessStore` -- the embedded default when no Redis URL is configured: tests, one process, offline scoring
                      (memory_store.py).

This module is the contract alone and imports no Redis client; stores.py's `make_store` makes the store a URL
names.

docs/architecture.md describes the keys and what each request costs in Redis round trips.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

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
        """Which of `event_ids` were already applied to `key` (within the de-duplication window: the newest
        `max_event_ids` ids recorded by `compare_and_set`, whatever the schema)."""
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

    async def lease(self, key: str, owner: str, ms: int) -> bool:
        """Take `key`'s lease for `owner` for `ms` milliseconds, unless another owner holds it: True when taken. A
        worker holds it while it works on the key off the request path (a flashcard user's refit), so that two
        workers, on any replicas, never work on one key at once; it lapses by itself if the worker dies."""
        ...

    async def release(self, key: str, owner: str) -> None:
        """Drop `key`'s lease if `owner` still holds it (one that lapsed and was taken since is left alone)."""
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


DEFAULT_LOG_BOUNDS = LogBounds()


def check_store_settings(ttl_seconds: float | None, max_event_ids: int) -> None:
    if ttl_seconds is not None and not ttl_seconds > 0:
        raise ValueError(f"ttl_seconds must be > 0 or None (no expiry), got {ttl_seconds!r}")
    if max_event_ids < 0:
        raise ValueError(f"max_event_ids must be >= 0, got {max_event_ids!r}")

