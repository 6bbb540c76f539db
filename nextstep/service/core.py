"""The stateful core every task (kt.py, sessions.py, srs.py) is built on: per-entity state in the store,
events folded in through the step graph, compare-and-set, an answer.

A task subclasses `StatefulTask` with its TASK (the registry's task name) and PREFIX (of its state keys:
`<prefix>:<model>:<schema>:<entity>`), and says only what differs: how a request's events become graph
feeds, how its blob is laid out, and what it answers. What they share lives here:

* `operation` - each public operation counts itself in the engines while it runs, so that a request alone in
  the service runs its graphs inline (runtime.Engines).
* `write` - the write protocol (writes.py): the per-key lock, compare-and-set attempts with backoff, and the
  replayed-id filter; the task's `attempt` turns (stored state, fresh events) into a new blob and an answer.
* `fold` - step a state through events, one graph call each; the last event's call also answers a query
  when the task passes a combined graph (step_predict, step_recommend): one call instead of two.
"""

import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .registry import LoadedModel, ModelRegistry
from .runtime import Engines
from .state import StateStore, StoredState
from .writes import Writers, batched, unapplied


def operation(method):
    """A task's public operation: counted in the engines while it runs (Engines.operations; a plain counter,
    not a context manager: this runs on every request)."""
    @functools.wraps(method)
    async def counted(self, *args, **kwargs):
        engines = self.engines
        engines.operations += 1
        try:
            return await method(self, *args, **kwargs)
        finally:
            engines.operations -= 1
    return counted


@dataclass
class Change:
    """What one attempt of a write decided: the new blob (None: nothing to write, answer from what was
    read), the events it adds to the count, companion fields to write, and the answer once written."""

    blob: bytes | None
    answer: Callable[[StoredState], Awaitable[dict]]
    added: int = 0
    fields: Mapping[str, bytes] = field(default_factory=dict)


class StatefulTask:
    TASK: str
    PREFIX: str

    def __init__(self, registry: ModelRegistry, store: StateStore, engines: Engines, *, cas_retries: int = 100,
                 on_retry=None):
        self.registry, self.store, self.engines = registry, store, engines
        self.writers = Writers(cas_retries, on_retry)

    def model(self, name: str) -> LoadedModel:
        return self.registry.get(name, task=self.TASK)

    def key(self, model: LoadedModel, entity: str) -> str:
        return f"{self.PREFIX}:{model.name}:{model.schema}:{entity}"

    async def delete(self, model_name: str, entity: str) -> bool:
        model = self.model(model_name)
        return await self.store.delete(self.key(model, entity))

    async def write(self, model: LoadedModel, key: str, what: str, event_ids: Sequence[str | None],
                    attempt: Callable[[StoredState, list[int], list[str]], Awaitable[Change]],
                    fields: Sequence[str] = ()) -> dict:
        """Apply a request's events to the entity at `key` (`what` names it in a conflict): read the state, the
        companion `fields` and which event ids were applied, in one round trip; `attempt(stored, positions of
        the events to apply, their ids)` -> a Change; compare-and-set; on a lost race, again. The answer of
        the attempt that was written."""
        async with self.writers.lock(key):
            tries = 0
            while True:  # (not `async for` over a generator: see Writers.backoff)
                await self.writers.backoff(tries, what)
                tries += 1
                stored, already = await self.store.read(key, [i for i in event_ids if i is not None], fields=fields)
                fresh, fresh_ids = unapplied(event_ids, already)
                change = await attempt(stored, fresh, fresh_ids)
                written = stored
                if change.blob is not None:
                    written = await self.store.compare_and_set(key, stored.version, change.blob, change.added,
                                                               fresh_ids, fields=change.fields)
                    if written is None:
                        self.writers.lost(model)
                        continue
                return await change.answer(written)

    async def fold(self, model: LoadedModel, state: dict[str, np.ndarray], events: Sequence[dict[str, np.ndarray]],
                   combined: str | None = None, query: dict[str, np.ndarray] | None = None,
                   shared: dict[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], list | None]:
        """(the state after the events, each a dict of step feeds; the query outputs of the `combined` graph,
        which takes the last event with `query`, or None when there is none or no event). `shared`: inputs
        without a batch axis, given to every graph that takes them (SimAKT's banks)."""
        outputs = None
        for n, feeds in enumerate(events):
            if combined is not None and n == len(events) - 1:
                outs = await self.engines.run(model, combined, {**batched(state), **feeds, **query}, shared=shared)
                outputs = outs[len(model.state_spec):]
            else:
                outs = await self.engines.run(model, "step", {**batched(state), **feeds}, shared=shared)
            state = {s["name"]: o[0] for s, o in zip(model.state_spec, outs, strict=False)}
        return state, outputs
