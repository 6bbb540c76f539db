"""`make_store`: the state store a Redis URL (or client) names, else the in-process one (state.py's contract)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .memory_store import InProcessStore
from .state import DEFAULT_LOG_BOUNDS, DEFAULT_MAX_EVENT_IDS, LogBounds, StateStore

if TYPE_CHECKING:
    from .redis_clients import Client, RedisOptions


def make_store(
    redis_url: str | None, *, ttl_seconds: float | None, max_event_ids: int = DEFAULT_MAX_EVENT_IDS,
    log: LogBounds = DEFAULT_LOG_BOUNDS, options: RedisOptions | None = None, client: Client | None = None,
) -> StateStore:
    """`RedisStore` when a URL (or a client) is given, else the embedded `InProcessStore`."""
    if redis_url or client is not None:
        from .redis_store import RedisStore  # (here: no Redis client at import)

        return RedisStore(redis_url, ttl_seconds=ttl_seconds, max_event_ids=max_event_ids, log=log, options=options,
                          client=client)
    return InProcessStore(ttl_seconds=ttl_seconds, max_event_ids=max_event_ids, log=log)
