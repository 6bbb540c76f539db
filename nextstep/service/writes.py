"""The write protocol both tasks use for per-entity state (a learner, a session).

Writes are optimistic: read (state, version), step the model, compare-and-set. Within one process the
writers for one key also queue on an asyncio lock, because under heavy contention for one key pure
optimistic retries starve (each retry re-runs the model between read and write); across processes the
compare-and-set decides, and a loser backs off a little, randomly, and redoes its work. Event ids make
replays idempotent: ids the store already holds, and ids repeated within a request, are applied once.
"""

import asyncio
import random
import weakref
from collections.abc import Sequence

import numpy as np

from .errors import ConcurrencyConflict


class Writers:
    def __init__(self, retries: int, on_retry=None):
        self.retries, self.on_retry = retries, on_retry
        self._locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def lock(self, key: str) -> asyncio.Lock:
        """This process's lock for one key; it vanishes when no request holds it."""
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        return lock

    async def backoff(self, attempt: int, what: str) -> None:
        """Before attempt number `attempt` (0 first): nothing; before a retry, a short random sleep; once the
        retries run out, ConcurrencyConflict. A plain coroutine per attempt, not an async generator: a caller
        that returns from inside `async for` leaves the generator for asyncio to close in a task of its own,
        one per request (about 10 us under load)."""
        if attempt >= self.retries:
            raise ConcurrencyConflict(f"{what}: state changed under {self.retries} attempts")
        if attempt:
            await asyncio.sleep(random.uniform(0, min(0.001 * 2**attempt, 0.05)))

    def lost(self, model) -> None:
        if self.on_retry:
            self.on_retry(model)


def unapplied(event_ids: Sequence[str | None], already: set[str]) -> tuple[list[int], list[str]]:
    """(positions of the events to apply, their ids): events without an id always apply; an id the store
    already holds, or one repeated earlier in the request, does not."""
    fresh, fresh_ids = [], []
    for i, event_id in enumerate(event_ids):
        if event_id is not None:
            if event_id in already:
                continue
            already.add(event_id)
            fresh_ids.append(event_id)
        fresh.append(i)
    return fresh, fresh_ids


def batched(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """One entity's state with a batch axis of 1, as the graphs take it."""
    return {name: value[None] for name, value in state.items()}
