"""Next-item sessions, protocol-neutral: absorb clicks, recommend, score many sessions, summarise, delete.

A session's key `sess:<model>:<session>` holds its log of clicks (time and item id) and a state per model
version (core.py: a version whose state lags the log folds the clicks it lacks in first): the model's state tensors
followed by the rows of the last `SEEN` items the session clicked (int64, 0-padded), so that any replica
can leave seen items out of a recommendation. Absorbing clicks is the same optimistic loop as knowledge
tracing (read, step the model, compare-and-set; event ids make replays idempotent), on a store whose TTL
is the session timeout.

Unknown item ids (added to the catalogue after training), by the request's `unknown_items`, else the service's
setting (NEXTSTEP_UNKNOWN_QUESTIONS): "answer" (the default) steps the session through the version's unknown row,
trained for it (an answer lists them in `unknown_item_ids`; a version without such a row refuses them, 422), "error"
is a 422 naming the field, and "skip" leaves them out, the session going on from the last known item (what the
offline evaluation protocol does). An unknown item is never recommended (it is in no catalogue the model has), and the
log keeps its id, so a later version that knows it steps it through its own row. A session that has absorbed nothing
yet is cold: if a cold-start model is configured (e.g. `popularity`), it answers.
"""

import functools
import time
from dataclasses import dataclass

import numpy as np

from ..core import UP_TO_DATE, Behind, Change, StatefulTask, operation
from ..errors import InvalidInput, UnknownId, UnknownModel
from ..quality import Quality
from ..registry import LoadedModel, ModelRegistry, TaskSpec, register_task
from ..runtime import Engines
from ..settings import DEFAULT_LIMITS, BatchLimits
from ..state import LogRow, StateStore, StoredState
from ..writes import batched

SEEN = 64  # items remembered per session for exclude_seen
UNKNOWN_ROW = 1  # the row of every item the version does not know (never recommended, never remembered as seen)
_SEEN_BYTES = SEEN * 8


def _check(name: str, manifest: dict, graphs: dict, fail, inside) -> dict:
    if not isinstance(manifest.get("top_k"), int) or manifest["top_k"] < 1:
        raise fail("manifest top_k missing or not a positive integer")
    return {}


SPEC = register_task(TaskSpec("next_item", ("step", "recommend", "step_recommend"), "items", True, _check,
                              scores="ranking"))


@dataclass(frozen=True)
class Click:
    item_id: str
    event_id: str | None = None
    time: float | None = None  # unix seconds the app gave; None: when the service received it


@dataclass(frozen=True)
class PairedTurn:
    """A gated rollout's turn (gate.py): the log position of the clicks the answering version took (`serving`: the
    serving version under a shadow, the candidate under a canary), its state before them and whether the session had
    clicked before, so that the other version's turn ranks both on the same clicks of the log."""

    since: int
    serving: LoadedModel
    state: dict
    clicked_before: bool


def rank_loss(ranks: list[float]) -> np.ndarray:
    """The gate's loss of a click: 1 - 1/rank of the clicked item in the list the state before it recommends (0 for
    the first item, 1 when it is not listed): its mean difference between two versions is their MRR's."""
    return 1.0 - 1.0 / np.asarray(ranks, dtype=np.float64)


class SessionRecommender(StatefulTask):
    TASK, PREFIX = SPEC.name, "sess"

    def __init__(self, registry: ModelRegistry, store: StateStore, engines: Engines, *, cas_retries: int = 100,
                 cold_start_model: str | None = None, on_retry=None, limits: BatchLimits = DEFAULT_LIMITS,
                 unknown_items: str = "answer", on_unknown=None, quality: Quality | None = None):
        super().__init__(registry, store, engines, cas_retries=cas_retries, on_retry=on_retry)
        self.cold_start_model = cold_start_model
        self.limits = limits
        if unknown_items not in ("answer", "error"):
            raise ValueError(f"unknown_items must be 'answer' or 'error', got {unknown_items!r}")
        self.unknown_items = unknown_items  # what a request that does not say does
        self.on_unknown = on_unknown  # (model, count): clicks stepped through the unknown row (a metric)
        self.quality = quality  # live ranks of each click in the list recommended before it (None: not scored)

    # ------------------------------------------------------------------ state blob: model state + seen rows

    @staticmethod
    def _decode(model: LoadedModel, stored: StoredState) -> tuple[dict[str, np.ndarray], np.ndarray]:
        if stored.blob is None:
            return model.initial_state, np.zeros(SEEN, dtype=np.int64)
        blob = stored.blob
        seen = np.frombuffer(blob, dtype="<i8", count=SEEN, offset=len(blob) - _SEEN_BYTES).astype(np.int64)
        return model.deserialize(blob[:len(blob) - _SEEN_BYTES]), seen

    @staticmethod
    def _encode(model: LoadedModel, state: dict[str, np.ndarray], seen: np.ndarray) -> bytes:
        return model.serialize(state) + seen.astype("<i8").tobytes()

    def _rows(self, model: LoadedModel, clicks: list[Click], unknown: str | None, field: str) -> list[int | None]:
        """Model rows of the clicked items: for an unknown item the unknown row (1) when unknown (None: the setting) is
        "answer" and the version has that row trained, None when it is "skip", else InvalidInput. `field` names item i
        in an error, e.g. "events[{i}].item_id"."""
        mode = unknown or self.unknown_items
        rows: list[int | None] = []
        for i, c in enumerate(clicks):
            try:
                rows.append(int(model.index([c.item_id], "item")[0]))
            except UnknownId:
                if mode == "answer" and model.unknown_row:
                    rows.append(UNKNOWN_ROW)
                    continue
                if mode != "skip":
                    why = ("unknown_items=error" if unknown else "NEXTSTEP_UNKNOWN_QUESTIONS=error") \
                        if mode == "error" else (f"version {model.version} was trained without an unknown-item row to "
                                                 "answer items added after training")
                    raise InvalidInput(field.format(i=i),
                                       f"unknown item id {c.item_id!r} for model {model.name} ({why}; pass "
                                       "unknown_items=skip to leave unknown items out)") from None
                rows.append(None)
        return rows

    def _count(self, model: LoadedModel, rows: list[int | None]) -> None:
        """Count the clicks stepped through the unknown row (the metric), once the answer is made."""
        n = sum(r == UNKNOWN_ROW for r in rows)
        if n and self.on_unknown is not None:
            self.on_unknown(model, n)

    @staticmethod
    def _items(model: LoadedModel, outs: list, k: int) -> list[dict]:
        """The top k of a recommend graph's outputs (rows and scores last), without padding or excluded rows."""
        rows, scores = outs[-2][0], outs[-1][0]
        return [{"item_id": model.ids[r - 2], "score": float(s)}
                for r, s in zip(rows[:k].tolist(), scores[:k].tolist(), strict=True) if s != float("-inf")]

    async def _top(self, model: LoadedModel, feeds: dict, k: int) -> list[dict]:
        return self._items(model, await self.engines.run(model, "recommend", feeds), k)

    def _check_k(self, model: LoadedModel, k: int) -> None:
        if not 1 <= k <= model.manifest["top_k"]:
            raise InvalidInput("k", f"must be between 1 and {model.manifest['top_k']} for model {model.name}")

    @staticmethod
    def _exclude(seen: np.ndarray, exclude_seen: bool) -> np.ndarray:
        return (seen if exclude_seen else np.zeros(1, dtype=np.int64))[None]

    # ------------------------------------------------------------------ operations

    @operation
    async def absorb(self, model_name: str, session_id: str, clicks: list[Click], *, recommend_k: int | None = None,
                     exclude_seen: bool = True, unknown_items: str | None = None) -> dict:
        """Apply clicks in order (skipping replayed event ids); optionally recommend afterwards, one round trip."""
        model = self.model(model_name, session_id)
        if recommend_k is not None:
            self._check_k(model, recommend_k)
        rows = self._rows(model, clicks, unknown_items, "events[{i}].item_id")

        async def attempt(stored: StoredState, to_apply: list[int], fresh_ids: list[str],
                          behind: Behind = UP_TO_DATE) -> Change:
            state, seen = self._decode(model, stored)
            state, seen, caught = await self._catch_up(model, state, seen, behind)
            fresh = [rows[i] for i in to_apply if rows[i] is not None]
            for row in fresh:
                seen = _remember(seen, row)
            new_unknown = list(dict.fromkeys(clicks[i].item_id for i in to_apply if rows[i] == UNKNOWN_ROW))
            query = {"exclude": self._exclude(seen, exclude_seen)} if recommend_k is not None else None
            before, clicked_before = state, stored.events + caught > 0  # (scored after the answer)
            state, outs = await self.fold(model, state, [{"item": np.array([row], dtype=np.int64)} for row in fresh],
                                          "step_recommend" if query else None, query)
            unknown = len(to_apply) - len(fresh)

            async def answer(written: StoredState) -> dict:
                if self.quality is not None and len(fresh) == 1 and clicked_before:  # (once: the attempt written)
                    role = self.role(model)  # (a session's first click is not ranked: no list came before it)
                    self.quality.pend(model.name, (id(model), role), (before, fresh[0]),
                                      functools.partial(self._score_each, model, role))
                elif self.quality is not None and len(fresh) > 1:
                    self.quality.later(model.name, functools.partial(
                        self._score, model, before, clicked_before, fresh, self.role(model)))
                self.shadow(model, session_id, written, len(fresh),
                            turn=lambda: self._turn(model, written.total - len(fresh), before, clicked_before))
                self._count(model, fresh)  # (once: the attempt that was written)
                result = {"session_id": session_id, "model": model.name, "version": model.version,
                          "state_version": written.version, "events_absorbed": len(fresh),
                          "events_skipped": len(clicks) - len(fresh) - unknown, "unknown_items_skipped": unknown,
                          "events_total": written.events, "rebuilt_from_events": caught,
                          **({"unknown_item_ids": new_unknown} if new_unknown else {}), "recommendations": None}
                if recommend_k is not None:
                    if outs is None:  # no new click: answer from the stored state
                        items, source = await self._recommend(model, state, seen, written.events, recommend_k,
                                                              exclude_seen)
                    else:
                        items, source = self._items(model, outs, recommend_k), "model"
                    result.update(recommendations=items, source=source)
                return result

            # unknown clicks with ids still record their ids; every click is logged, known or not
            now = time.time()
            return Change(self._encode(model, state, seen) if fresh_ids or fresh or behind.rows else None, answer,
                          len(fresh) + caught, rows=[LogRow(now if clicks[i].time is None else clicks[i].time,
                                                            clicks[i].item_id.encode()) for i in to_apply])

        return await self.write(model, self.key(model, session_id), f"session {session_id!r}",
                                [c.event_id for c in clicks], attempt)

    async def _score(self, model: LoadedModel, state: dict[str, np.ndarray], clicked_before: bool, fresh: list[int],
                     role: str) -> None:
        """Live quality of clicks already answered (`_fold_scored` from the state before the first), recorded.
        Run after the answer."""
        _, _, ranks = await self._fold_scored(model, state, clicked_before, fresh, None, keep_state=False)
        self.quality.record_ranks(model.name, model.version, ranks, role)

    async def _score_each(self, model: LoadedModel, role: str, items: list[tuple[dict[str, np.ndarray], int]]
                          ) -> None:
        """Live quality of single clicks already answered (`Quality.pend`: one version's, in one role), together:
        each (state before, clicked row) a row of one `recommend` call over every item, ranked as `_fold_scored`
        ranks a first fresh click; recorded."""
        feeds = {name: np.stack([state[name] for state, _ in items]) for name in items[0][0]}
        feeds["exclude"] = np.zeros((len(items), 1), dtype=np.int64)
        outs = await self.engines.run(model, "recommend", feeds, background=True)
        ranks = _ranks(outs[-2], outs[-1], np.array([row for _, row in items]))
        self.quality.record_ranks(model.name, model.version, ranks.tolist(), role)

    async def _fold_scored(self, model: LoadedModel, state: dict[str, np.ndarray], clicked_before: bool,
                           fresh: list[int], query: dict | None, keep_state: bool = True):
        """`fold` through the fresh clicks that also gives, for live quality (quality.py), each click's rank in the
        list the state before it recommends, as the offline protocol ranks it (ranking.py): not after the session's
        first click, over every item (seen ones included), ties counted against the model; inf when the item is not
        in the list (the manifest's top_k). The first fresh click's list from a `recommend` call (none for a
        session's first click), each later one's from the `step_recommend` call that steps the click before it;
        the last click's call answers the request's `query` (or is a plain step). Its graph calls never run inline
        on the event loop (it runs after answers: scoring jobs and shadows). Without `keep_state` (a scoring job) the
        last click's plain step is not run, and the state returned is None."""
        everything = {"exclude": np.zeros((1, 1), dtype=np.int64)}
        n_state = len(model.state_spec)
        ranks = []
        if clicked_before:
            outs = await self.engines.run(model, "recommend", {**batched(state), **everything}, background=True)
            ranks.append(_rank(outs[-2][0], outs[-1][0], fresh[0]))
        outputs = None
        for j, row in enumerate(fresh):
            feeds = {**batched(state), "item": np.array([row], dtype=np.int64)}
            last = j == len(fresh) - 1
            ask = query if last else everything
            if ask is None:
                if not keep_state:  # (the last click's plain step: its state is not wanted)
                    return None, outputs, ranks
                outs = await self.engines.run(model, "step", feeds, background=True)
            else:
                outs = await self.engines.run(model, "step_recommend", {**feeds, **ask}, background=True)
                if last:
                    outputs = outs
                else:
                    ranks.append(_rank(outs[-2][0], outs[-1][0], fresh[j + 1]))
            state = {spec["name"]: o[0] for spec, o in zip(model.state_spec, outs[:n_state], strict=True)}
        return state, outputs, ranks

    async def _catch_up(self, model: LoadedModel, state: dict[str, np.ndarray], seen: np.ndarray, behind: Behind
                        ) -> tuple[dict[str, np.ndarray], np.ndarray, int]:
        """The state and seen rows with the logged clicks they lack folded in (clicks on items this version does not
        know are left out, as unknown_items=skip does); how many were folded."""
        # an unknown item goes through the unknown row where a live click would (the setting), else is left out
        if not behind.rows:  # (every live click: nothing to decode, no array to make)
            return state, seen, 0
        rows = model.lookup([row.payload.decode() for row in behind.rows])
        if self.unknown_items == "answer" and model.unknown_row:
            rows[rows < 0] = UNKNOWN_ROW
        known = rows[rows >= 0]
        seen = _remember_all(seen, known.tolist())
        if len(known):
            state = await self.fold_columns(model, state, {"item": known})
        return state, seen, len(known)

    async def _current(self, model: LoadedModel, session_id: str):
        """(the stored record, state, seen rows, clicks folded in from the log); a caught-up state is stored if
        nothing was written meanwhile."""
        key = self.key(model, session_id)
        stored = await self.store.get(key, schema=self.schema(model))
        state, seen = self._decode(model, stored)
        behind = await self.behind(key, stored)
        state, seen, caught = await self._catch_up(model, state, seen, behind)
        if stored.behind > 0:
            stored = await self.store.compare_and_set(key, stored.version, self._encode(model, state, seen), caught,
                                                      schema=self.schema(model), expected_total=stored.total) or stored
        return stored, state, seen, caught

    def _turn(self, serving: LoadedModel, since: int, state: dict, clicked_before: bool) -> int | PairedTurn:
        """What a shadow's turn takes: the log position of the fresh clicks, with what pairs them under a gate."""
        return PairedTurn(since, serving, state, clicked_before) if self.gated(serving.name) else since

    async def follow_log(self, model: LoadedModel, entity: str, since: int | PairedTurn) -> bool:
        turn, since = (since, since.since) if isinstance(since, PairedTurn) else (None, since)
        key, schema = self.key(model, entity), self.schema(model)
        stored = await self.store.get(key, schema=schema)
        if stored.behind <= 0:
            return True
        behind = await self.behind(key, stored)
        state, seen = self._decode(model, stored)
        split = self._split(stored, behind, since)
        state, seen, caught = await self._catch_up(model, state, seen, Behind(behind.rows[:split], behind.missing))
        clicks = [Click(row.payload.decode()) for row in behind.rows[split:]]
        mode = "answer" if self.unknown_items == "answer" and model.unknown_row else "skip"  # as live clicks were
        fresh = [r for r in self._rows(model, clicks, mode, "") if r is not None]
        ranks: list[float] = []
        if fresh:
            state, _, ranks = await self._fold_scored(model, state, stored.events + caught > 0, fresh, None)
            for row in fresh:
                seen = _remember(seen, row)
        written = await self.store.compare_and_set(key, stored.version, self._encode(model, state, seen),
                                                   caught + len(fresh), schema=schema, expected_total=stored.total)
        if written is not None and ranks and self.quality is not None:
            self.quality.record_ranks(model.name, model.version, ranks, "shadow")
        if written is not None and ranks and turn is not None:
            await self._pair(model, entity, turn, clicks, fresh, ranks)
        return written is not None

    async def _pair(self, follower: LoadedModel, entity: str, turn: PairedTurn, clicks: list[Click],
                    fresh: list[int], ranks: list[float]) -> None:
        """The gate's evidence of a turn: every click the follower ranked from the turn's log position on, ranked by
        the answering version too from the state the turn carries, through the same clicks; each click's rank loss
        through the candidate minus through the serving version. A turn whose clicks the two versions do not both
        take (an item one of them skips) adds nothing."""
        mode = "answer" if self.unknown_items == "answer" and turn.serving.unknown_row else "skip"
        rows = [r for r in self._rows(turn.serving, clicks, mode, "") if r is not None]
        if not self.gated(follower.name) or len(rows) != len(fresh):
            return
        _, _, answered = await self._fold_scored(turn.serving, turn.state, turn.clicked_before, rows, None,
                                                 keep_state=False)
        if len(answered) != len(ranks):
            return
        await self.pair(follower, entity, rank_loss(ranks), rank_loss(answered))

    async def catch_up(self, model: LoadedModel, entity: str) -> tuple[int, bool]:
        stored, _, _, caught = await self._current(model, entity)
        return caught, stored.behind == 0

    async def _recommend(self, model, state, seen, events, k, exclude_seen) -> tuple[list[dict], str]:
        if events == 0 and self.cold_start_model and self.cold_start_model != model.name:
            try:
                cold = self.model(self.cold_start_model)
            except UnknownModel:
                cold = None
            if cold is not None:
                items = await self._top(cold, {**batched(cold.initial_state),
                                               "exclude": np.zeros((1, 1), dtype=np.int64)},
                                        min(k, cold.manifest["top_k"]))
                return items, f"cold_start:{cold.name}"
        feeds = {**batched(state), "exclude": self._exclude(seen, exclude_seen)}
        return await self._top(model, feeds, k), "model"

    @operation
    async def recommend(self, model_name: str, session_id: str, k: int, exclude_seen: bool = True) -> dict:
        model = self.model(model_name, session_id)
        self._check_k(model, k)
        stored, state, seen, caught = await self._current(model, session_id)
        items, source = await self._recommend(model, state, seen, stored.events, k, exclude_seen)
        return {"session_id": session_id, "model": model.name, "version": model.version,
                "state_version": stored.version, "events_total": stored.events, "rebuilt_from_events": caught,
                "source": source, "items": items}

    async def summary(self, model_name: str, session_id: str) -> dict:
        model = self.model(model_name, session_id)
        stored, _, seen, caught = await self._current(model, session_id)
        return {"session_id": session_id, "model": model.name, "version": model.version,
                "exists": stored.blob is not None, "state_version": stored.version, "events_total": stored.events,
                "rebuilt_from_events": caught,
                "last_update": stored.updated, "recent_items": [model.ids[r - 2] for r in seen.tolist() if r >= 2]}

    async def score_sessions(self, model_name: str, sessions: list[tuple[str | None, list[str]]], k: int,
                             exclude_seen: bool = True, unknown_items: str | None = None) -> dict:
        """Stateless: replay each session from the initial state and recommend after its last click. Within `limits`
        (413 naming the field), checked before any work."""
        self.limits.check("sessions", [len(items) for _, items in sessions], "item_ids")
        model = self.model(model_name)
        self._check_k(model, k)
        results, stepped = [], []
        for s, (session_id, item_ids) in enumerate(sessions):
            given = self._rows(model, [Click(i) for i in item_ids], unknown_items, f"sessions[{s}].item_ids[{{i}}]")
            rows = [r for r in given if r is not None]
            stepped += rows
            unknown = list(dict.fromkeys(i for i, r in zip(item_ids, given, strict=True) if r == UNKNOWN_ROW))
            seen = np.zeros(SEEN, dtype=np.int64)
            for row in rows:
                seen = _remember(seen, row)
            state, _ = await self.fold(model, model.initial_state, [{"item": np.array([row])} for row in rows])
            items, source = await self._recommend(model, state, seen, len(rows), k, exclude_seen)
            results.append({"session_id": session_id, "events": len(rows), "source": source, "items": items,
                            **({"unknown_item_ids": unknown} if unknown else {})})
        self._count(model, stepped)
        return {"model": model.name, "version": model.version, "sessions": results}


def _rank(rows: np.ndarray, scores: np.ndarray, row: int) -> float:
    """The 1-based rank of model row `row` in one list of a recommend graph (its rows and scores, the graph's last two
    outputs, best first), ties counted against the model (every listed item scored at least as high); inf when not
    listed."""
    return float(_ranks(rows[None], scores[None], np.array([row]))[0])


def _ranks(rows: np.ndarray, scores: np.ndarray, clicked: np.ndarray) -> np.ndarray:
    """`_rank` of clicked[i] in each list i (rows and scores (B, K)), at once: (B,) float64."""
    at = rows == clicked[:, None]
    first = at.argmax(1)
    score = np.take_along_axis(scores, first[:, None], 1)
    listed = at.any(1) & (score[:, 0] != -np.inf)
    return np.where(listed, (scores >= score).sum(1), np.inf).astype(np.float64)


def _remember_all(seen: np.ndarray, rows: list[int]) -> np.ndarray:
    """`_remember` of each row in turn, at once: the last SEEN distinct rows, the latest first, then what `seen` held
    of the others (a long log is not walked past its last SEEN distinct items)."""
    front, taken = [], set()
    for row in reversed(rows):
        if row != UNKNOWN_ROW and row not in taken:
            taken.add(row)
            front.append(row)
            if len(front) == SEEN:
                break
    return np.array((front + [r for r in seen.tolist() if r not in taken])[:SEEN], dtype=np.int64)


def _remember(seen: np.ndarray, row: int) -> np.ndarray:
    """The seen rows with `row` moved (or added) to the front, still SEEN long (the unknown row is not remembered:
    it is never recommended, and would push a real item out)."""
    if row == UNKNOWN_ROW:
        return seen
    return np.concatenate([[row], seen[seen != row][:SEEN - 1]]).astype(np.int64)
