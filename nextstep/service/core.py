"""The stateful core every task (kt.py, sessions.py, srs.py) is built on: per-entity state in the store,
events folded in through the step graph, compare-and-set, an answer.

A task subclasses `StatefulTask` with its TASK (the registry's task name) and PREFIX (of its keys:
`<prefix>:<model>:<entity>`, one per entity whatever the model version, holding the entity's event log and a state
per version's schema; state.py), and says only what differs: how a request's events become graph feeds and log
rows, how its blob is laid out, and what it answers. What they share lives here:

* `operation` - each public operation counts itself in the engines while it runs, so that a request alone in
  the service runs its graphs inline (runtime.Engines).
* `write` - the write protocol (writes.py): the per-key lock, compare-and-set attempts with backoff, and the
  replayed-id filter; the task's `attempt` turns (stored state, fresh events) into a new blob and an answer. A
  compare-and-set whose answer was lost (sent, then a timeout or a dropped connection: OutcomeUnknown) is resolved
  by reading the store once it answers (`_resolve`); when that cannot tell, the request fails with OutcomeUnknown
  (503 outcome-unknown), whose message tells the client to retry with the same event ids.
* `behind` - the logged events a version's state has not folded in (another version took them, or the state never
  existed: a new version's first request for an entity rebuilds its state from the log); the task folds them in
  before the request's own events, and the compare-and-set holds only if the log did not move meanwhile.
* `fold` - step a state through events: in one call of the model's fold graph (its step graph in an ONNX Scan,
  fold.py), or one step graph call each where it has none; the last event's call also answers a query when the task
  passes a combined graph (step_predict, step_recommend): one call instead of two.
* `model(name, entity)` - the version that answers an entity: a canary rollout's candidate for the entities in its
  fraction (rollouts.py); `shadow` queues a shadow rollout's candidate to follow an entity's log after a write
  (`run_shadows`, `follow_log`), off the request path.
* `migrate` - a page of entities (`to_migrate`: by default `entities`, the store's scan) caught up with their logs
  for a version (`catch_up`), for `nextstep states migrate` and POST /v1/models/{model}/migrate.
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from .errors import OutcomeUnknown, StoreUnavailable, UnknownModel
from .fold import FOLD
from .gate import Evidence, Gate, GateConfig, decide, evidence_of
from .registry import LoadedModel, ModelRegistry
from .rollouts import Rollout, Rollouts, in_fraction
from .runtime import Engines
from .state import LogRow, StateStore, StoredState
from .writes import Writers, batched, unapplied

log = logging.getLogger(__name__)

_GATE_TASKS: set = set()  # rollout changes a gate started, kept until done


def next_step(rollout: Rollout, decision: str) -> Rollout:
    """What a gate's decision makes of its rollout: abort, the serving version alone; promote, the candidate serving
    everyone, unless the rollout ramps (a canary's next fraction, gated afresh)."""
    if decision == "abort":
        return Rollout(rollout.serving)
    later = [f for f in rollout.ramp or () if f > rollout.fraction]
    if rollout.mode == "canary" and later:
        return Rollout(rollout.serving, rollout.candidate, "canary", later[0], gate=rollout.gate, ramp=rollout.ramp)
    return Rollout(rollout.candidate)


FOLD_FROM = 2  # events from which `fold` takes the fold graph (one event: the step graph, as a live event is stepped)


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
    rows: Sequence[LogRow] = ()  # the log rows of the events applied (their order)


@dataclass(frozen=True)
class Behind:
    """What a version's state lacks of the entity's history: the logged events it has not folded in, oldest first,
    and how many more it lacks that the log no longer holds (trimmed past its bounds)."""

    rows: Sequence[LogRow] = ()
    missing: int = 0


UP_TO_DATE = Behind()


class StatefulTask:
    TASK: str
    PREFIX: str
    rollouts: Rollouts | None = None  # a canary's candidate answers the entities in its fraction (rollouts.py)
    shadows: asyncio.Queue | None = None  # (model, candidate version, entity, log position) for a shadow to follow
    on_shadow: Callable[[str, str], None] = staticmethod(lambda model, outcome: None)  # (model, done/dropped/failed)
    gate: Gate | None = None  # the evidence of gated shadows (gate.py)
    on_gate: Callable[[str, Evidence], None] = staticmethod(lambda model, evidence: None)  # (a metric)

    def __init__(self, registry: ModelRegistry, store: StateStore, engines: Engines, *, cas_retries: int = 100,
                 on_retry=None):
        self.registry, self.store, self.engines = registry, store, engines
        self.writers = Writers(cas_retries, on_retry)

    def model(self, name: str, entity: str | None = None) -> LoadedModel:
        """The version that answers `name` (a pinned `name@version` as named); for an entity, the one its model's
        rollout names: the candidate of a canary when the entity falls in its fraction, else the serving version."""
        model = self.registry.get(name, task=self.TASK)
        if entity is not None and self.rollouts is not None and "@" not in name:
            candidate = self.rollouts.version_for(model.name, entity)
            if candidate is not None and candidate != model.version:
                with contextlib.suppress(UnknownModel):  # (a version withdrawn meanwhile: the registry's latest)
                    return self.registry.get(model.name, candidate, task=self.TASK)
        return model

    def key(self, model: LoadedModel, entity: str) -> str:
        """The entity's key: its log, and a state per model version (`schema`)."""
        return f"{self.PREFIX}:{model.name}:{entity}"

    def schema(self, model: LoadedModel) -> str:
        return model.schema

    async def behind(self, key: str, stored: StoredState) -> Behind:
        """The logged events `stored` lacks (read from the log only when it lags)."""
        if stored.behind <= 0:
            return UP_TO_DATE
        base, rows = await self.store.log(key)
        start = stored.logged if stored.exists else 0
        rows = rows[max(start - base, 0):max(stored.total - base, 0)]  # (the log may have moved since: the CAS says)
        return Behind(rows, max(base - start, 0))

    def shadow(self, model: LoadedModel, entity: str, written: StoredState, events: int,
               turn: Callable[[], object] | None = None) -> None:
        """After a write (`written`) that logged `events` events for an entity through the serving `model`: when a
        shadow rollout covers the entity, queue its candidate to follow (`follow_log`), off the request path, scoring
        from the first of those events on; a full queue drops the turn (counted): the candidate catches up unscored
        on its next one. After a write through a gated canary's candidate, the serving version follows the same way
        (the gate pairs both versions on every event). `turn`: makes what the task's `follow_log` takes instead of the
        log position of the first of those events (flashcards: the reviews written, srs.ShadowTurn), called only when
        a turn is queued."""
        rollout = self.rollouts.current.get(model.name) if self.rollouts is not None else None
        if rollout is None or rollout.candidate is None or not events or self.shadows is None:
            return
        if rollout.mode == "canary" and rollout.gate is not None and model.version == rollout.candidate:
            # a gated canary: the serving version follows the canary's entities, scored on the same events
            self.queue_turn(model.name, rollout.serving, entity, turn or (lambda: written.total - events))
            return
        if (rollout.mode != "shadow" or rollout.candidate == model.version
                or not in_fraction(model.name, entity, rollout.fraction)):
            return
        self.queue_turn(model.name, rollout.candidate, entity, turn or (lambda: written.total - events))

    def queue_turn(self, name: str, candidate: str, entity: str, make: Callable[[], object]) -> None:
        """Queue a turn of `candidate` for `entity`, with what `make` makes for its `follow_log` (called only when
        there is room: a full queue drops the turn, counted)."""
        if self.shadows.full():
            self.on_shadow(name, "dropped")
        else:
            self.shadows.put_nowait((name, candidate, entity, make()))

    def background(self, settings, metrics) -> list[asyncio.Task]:
        """The tasks the service runs beside the requests (lifespan.py starts them and cancels them at shutdown):
        none here; a task that has some says so (srs: the refit worker)."""
        return []

    async def loaded(self, models: list[LoadedModel]) -> None:
        """After the models were loaded, at startup and at every reload (lifespan.py): what the task prepares from
        them (knowledge tracing: SimAKT's memory banks). Nothing here."""

    async def close(self) -> None:
        """At shutdown, after the requests: what the task holds open (knowledge tracing: the banks' store)."""

    async def follow_log(self, model: LoadedModel, entity: str, since: int) -> bool:
        """A shadow's turn: the entity's state for `model` caught up with its log and stored, the logged events from
        log position `since` on scored for live quality (role "shadow"; those before it are folded unscored). Whether
        it was stored (or already current). (`since` is what `shadow`'s `turn` made, for a task that passes one.)"""
        raise NotImplementedError

    @staticmethod
    def _split(stored: StoredState, behind: Behind, since: int) -> int:
        """How many of the rows a state lacks come before log position `since` (folded unscored)."""
        first = max(stored.logged if stored.exists else 0, stored.base)  # the log position of behind.rows[0]
        return min(len(behind.rows), max(0, since - first))

    async def run_shadows(self, size: int) -> None:
        """The shadow worker: follows what `shadow` queues, one at a time, until cancelled."""
        self.shadows = asyncio.Queue(maxsize=size)
        while True:
            name, version, entity, since = await self.shadows.get()
            try:
                model = self.registry.get(name, version, task=self.TASK)
                for _ in range(3):  # (another write came first: again, from the log as it is now)
                    if await self.follow_log(model, entity, since):
                        break
                self.on_shadow(name, "done")
            except asyncio.CancelledError:
                raise
            except UnknownModel:  # the candidate was withdrawn meanwhile
                self.on_shadow(name, "failed")
            except Exception:
                log.exception("shadow %s@%s did not follow %r", name, version, entity)
                self.on_shadow(name, "failed")

    def gated(self, name: str) -> bool:
        """Whether model `name` has a gated rollout now (a turn then carries what pairs both versions: gate.py)."""
        rollout = self.rollouts.current.get(name) if self.rollouts is not None else None
        return rollout is not None and rollout.gate is not None and self.gate is not None

    async def pair(self, follower: LoadedModel, entity: str, followed: np.ndarray, answered: np.ndarray) -> None:
        """A follower's turn under a gate: each event's loss through the follower and through the version that
        answered it, added to the evidence as the candidate's minus the serving version's (a shadow: the candidate
        follows the serving version; a gated canary: the serving version follows the candidate)."""
        rollout = self.rollouts.current.get(follower.name) if self.rollouts is not None else None
        if rollout is not None:
            sign = 1.0 if follower.version == rollout.candidate else -1.0
            await self.gate_evidence(follower.name, rollout.candidate, entity, sign * (followed - answered))

    async def gate_evidence(self, name: str, candidate: str, entity: str, differences: np.ndarray) -> str | None:
        """Add an entity's paired loss differences (candidate's minus serving's, on the same events) to the gated
        rollout of `name` whose candidate is `candidate`; its decision, which the first replica to see it applies
        (gate.py). None: no gate covers that candidate now."""
        rollout = self.rollouts.current.get(name) if self.rollouts is not None else None
        if (rollout is None or rollout.gate is None or rollout.candidate != candidate or self.gate is None
                or not len(differences)):
            return None
        config = GateConfig(**rollout.gate)
        key = self.gate.key(name, candidate, rollout.updated)
        fields = await self.gate.add(key, entity, differences)
        evidence = evidence_of(fields, config.alpha)
        self.on_gate(name, evidence)
        decision = decide(evidence, config)
        if decision == "continue" or "decision" in fields:
            return decision
        record = {"decision": decision, **evidence.as_dict(), "candidate": candidate, "serving": rollout.serving,
                  "at": time.time(), "applied": config.auto, "mode": rollout.mode, "fraction": rollout.fraction}
        if await self.gate.claim(key, name, record):
            log.warning("gate of %s: %s version %s over %s after %d paired events (mean difference %.4f, interval "
                        "%s)", name, decision, candidate, rollout.serving, evidence.n, evidence.mean,
                        evidence.interval)
            if config.auto:  # (off the shadow worker: a rollout change answers once it is in effect)
                change = next_step(rollout, decision)
                task = asyncio.create_task(self.rollouts.put(name, change), name=f"nextstep-gate-{name}")
                _GATE_TASKS.add(task)
                task.add_done_callback(_GATE_TASKS.discard)
        return decision

    def role(self, model: LoadedModel) -> str:
        """What a version is to its model now: "canary" (a rollout's candidate), else "serving"."""
        rollout = self.rollouts.current.get(model.name) if self.rollouts is not None else None
        return rollout.mode if rollout is not None and rollout.candidate == model.version and rollout.mode \
            else "serving"

    async def entities(self, model: LoadedModel, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """A step of a walk over the entities that have a log or a state for `model`'s name (state.py's `scan`)."""
        prefix = self.key(model, "")
        following, keys = await self.store.scan(prefix, cursor, count)
        return following, [k[len(prefix):] for k in keys]

    async def to_migrate(self, model: LoadedModel, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """A step of a walk over the entities a migration to `model` visits (`migrate`): those of `entities`, unless
        the task finds them elsewhere."""
        return await self.entities(model, cursor, count)

    async def catch_up(self, model: LoadedModel, entity: str) -> tuple[int, bool]:
        """Fold into the entity's state for `model` the logged events it lacks, and store it: (events folded,
        whether the stored state is now current: False when another write came first)."""
        raise NotImplementedError

    async def migrate(self, model: LoadedModel, cursor: str = "0", count: int = 500, tries: int = 3) -> dict:
        """One page of a migration to `model`'s version: each entity of the page (`to_migrate`) caught up with its
        log and stored (`catch_up`, again when another write came first, up to `tries`). Safe while serving and
        from any number of processes: every write is a compare-and-set that holds only if the log did not move;
        a second walk finds nothing to do for the entities the first brought up to date."""
        following, entities = await self.to_migrate(model, cursor, count)
        rebuilt = events = lagging = 0
        for entity in entities:
            for _ in range(tries):
                folded, current = await self.catch_up(model, entity)
                if current:
                    break
            rebuilt += bool(folded and current)
            events += folded if current else 0
            lagging += not current
        return {"model": model.name, "version": model.version, "cursor": following, "done": following == "0",
                "entities": len(entities), "rebuilt": rebuilt, "events": events, "lagging": lagging}

    async def delete(self, model_name: str, entity: str) -> bool:
        model = self.model(model_name)
        return await self.store.delete(self.key(model, entity))

    async def write(self, model: LoadedModel, key: str, what: str, event_ids: Sequence[str | None],
                    attempt: Callable[[StoredState, list[int], list[str], Behind], Awaitable[Change]],
                    fields: Sequence[str] = ()) -> dict:
        """Apply a request's events to the entity at `key` (`what` names it in a conflict) for `model`'s version:
        read its state, the companion `fields` and which event ids were applied, in one round trip (and the log when
        the state lags it); `attempt(stored, positions of the events to apply, their ids, what the state lacks)` -> a
        Change; compare-and-set (with the Change's log rows, if the log is still as read); on a lost race, again.
        The answer of the attempt that was written."""
        schema = self.schema(model)
        async with self.writers.lock(key):
            tries = 0
            while True:  # (not `async for` over a generator: see Writers.backoff)
                await self.writers.backoff(tries, what)
                tries += 1
                stored, already = await self.store.read(key, [i for i in event_ids if i is not None], fields=fields,
                                                        schema=schema)
                fresh, fresh_ids = unapplied(event_ids, already)
                change = await attempt(stored, fresh, fresh_ids, await self.behind(key, stored))
                written = stored
                if change.blob is not None:
                    try:
                        written = await self.store.compare_and_set(
                            key, stored.version, change.blob, change.added, fresh_ids, fields=change.fields,
                            schema=schema, rows=change.rows, expected_total=stored.total)
                    except OutcomeUnknown as unknown:
                        written = await self._resolve(key, schema, stored, change, fresh_ids,
                                                      len(fresh) - len(fresh_ids), unknown)
                    if written is None:
                        self.writers.lost(model)
                        continue
                return await change.answer(written)

    async def _resolve(self, key: str, schema: str, stored: StoredState, change: Change, fresh_ids: list[str],
                       without_ids: int, unknown: OutcomeUnknown) -> StoredState | None:
        """After a compare-and-set at `stored.version` whose answer was lost: the state it wrote if it was applied,
        None if it was not and never will be (the write loop goes on), else OutcomeUnknown telling the client what
        to do. The lost write can apply only at `stored.version` (now, or when a hung server wakes up), whole or
        not at all (one script), so: one of its event ids in the store means it ran; the version moved past it
        without them means it never will; still at that version, it is sent once more, and whichever copy runs
        first applies while the other finds the version moved. With no event id nothing tells it from another
        writer's once the version moved: then the outcome stays unknown."""
        for _ in range(2):  # a read, a second copy, a read: bounded by the store's timeouts
            if not unknown.resolvable:
                break
            try:
                now, seen = await self.store.read(key, fresh_ids[:1], schema=schema)
                if seen:  # it ran: what it wrote
                    total = stored.total + len(change.rows)
                    return now if now.version == stored.version + 1 else \
                        StoredState(stored.version + 1, stored.events + change.added, None, change.blob, {}, total,
                                    total, now.base)
                if now.version != stored.version or now.total != stored.total:
                    if fresh_ids:
                        return None
                    break
                written = await self.store.compare_and_set(
                    key, stored.version, change.blob, change.added, fresh_ids, fields=change.fields, schema=schema,
                    rows=change.rows, expected_total=stored.total)
            except OutcomeUnknown as again:
                unknown = again
                break
            except StoreUnavailable:  # (the store still does not answer)
                break
            if written is not None:
                return written
            if not fresh_ids:
                break
        advice = "retry the request with the same event ids: an event id is applied at most once"
        if without_ids:
            advice += (f"; its {without_ids} event(s) without an event_id may have been applied, and are applied "
                       "again by a retry")
        raise OutcomeUnknown(f"{unknown}; {advice}", resolvable=False) from unknown

    async def fold_columns(self, model: LoadedModel, state: dict[str, np.ndarray], columns: dict[str, np.ndarray],
                           shared: dict[str, np.ndarray] | None = None) -> dict[str, np.ndarray]:
        """The state after n events given as columns: each step input's values for the events, events first (shape
        (n, ...)); through the fold graph in one call where the model has one and n is at least FOLD_FROM, else
        through the step graph one call each. (A log's events, decoded at once: no per-event dict.)"""
        n = len(next(iter(columns.values()))) if columns else 0
        names = [s["name"] for s in model.state_spec]
        if n >= FOLD_FROM and model.fold_events:
            p = model.fold_prefix
            feeds = {p + name: value[None] for name, value in state.items()}
            for name in model.fold_events:  # (batch, events, ...): one entity's events on the axis after its batch
                feeds[p + name] = columns[name][None]
            return dict(zip(names, (o[0] for o in await self.engines.run(model, FOLD, feeds, shared=shared)),
                            strict=True))
        for i in range(n):
            feeds = {k: v[i:i + 1] for k, v in columns.items()}
            outs = await self.engines.run(model, "step", {**batched(state), **feeds}, shared=shared)
            state = {name: o[0] for name, o in zip(names, outs, strict=False)}
        return state

    async def fold(self, model: LoadedModel, state: dict[str, np.ndarray], events: Sequence[dict[str, np.ndarray]],
                   combined: str | None = None, query: dict[str, np.ndarray] | None = None,
                   shared: dict[str, np.ndarray] | None = None) -> tuple[dict[str, np.ndarray], list | None]:
        """(the state after the events, each a dict of step feeds; the query outputs of the `combined` graph,
        which takes the last event with `query`, or None when there is none or no event). `shared`: inputs
        without a batch axis, given to every graph that takes them (SimAKT's banks). The events before a `combined`
        one (all of them without) go through the fold graph in one call where the model has one and there are at
        least FOLD_FROM of them, else through the step graph one call each."""
        names = [s["name"] for s in model.state_spec]
        ahead = events[:-1] if combined is not None else events
        if len(ahead) >= FOLD_FROM and model.fold_events:
            state = await self.fold_columns(model, state, {name: np.concatenate([e[name] for e in ahead])
                                                           for name in model.fold_events}, shared)
        else:  # (a live event: one step call, nothing stacked)
            for feeds in ahead:
                outs = await self.engines.run(model, "step", {**batched(state), **feeds}, shared=shared)
                state = {name: o[0] for name, o in zip(names, outs, strict=False)}
        outputs = None
        if combined is not None and events:
            outs = await self.engines.run(model, combined, {**batched(state), **events[-1], **query}, shared=shared)
            state, outputs = {name: o[0] for name, o in zip(names, outs, strict=False)}, outs[len(names):]
        return state, outputs
