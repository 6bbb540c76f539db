"""Knowledge tracing, protocol-neutral: absorb events, predict, rank next items, summarise, delete.

A learner's state lives in the store under `kt:<model>:<schema>:<student>`; the schema hash covers the
model version and state layout, so a state written by one version is never read by another. Absorbing
events is optimistic concurrency: read (state, version), step the model through the new events, write
with compare-and-set; on a conflict, re-read and redo. Event ids make replays idempotent: ids already
applied (in the store's window) and repeated ids within a request are skipped.
"""

import weakref
from dataclasses import dataclass

import numpy as np

from .registry import LoadedModel, ModelRegistry, UnknownId
from .runtime import MicroBatcher
from .state import StateStore, StoredState
from .writes import Writers, batched, unapplied


class InvalidInput(ValueError):
    """A request the model cannot answer; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class TooLarge(InvalidInput):
    """More items in a request than the settings allow (HTTP 413)."""


@dataclass(frozen=True)
class Event:
    question_id: str
    response: int
    event_id: str | None = None


class Engines:
    """One micro-batcher per (loaded model, graph), created on first use. Keyed weakly by the model
    object, so a reload's replaced models (and their sessions) are released, and a new model can never
    inherit an old model's batcher."""

    def __init__(self, max_batch: int, max_wait_ms: float, on_batch=None):
        self.max_batch, self.max_wait_ms, self.on_batch = max_batch, max_wait_ms, on_batch
        self._batchers: weakref.WeakKeyDictionary[LoadedModel, dict[str, MicroBatcher]] = \
            weakref.WeakKeyDictionary()

    async def run(self, model: LoadedModel, graph: str, feeds: dict[str, np.ndarray], *,
                  alone: bool = False) -> list[np.ndarray]:
        """The graph's outputs for these feeds (batch axis first). `alone`: the caller is the only request in
        flight, so nobody could share the run: run it inline when the batcher is idle (no executor hop)."""
        graphs = self._batchers.get(model)
        if graphs is None:
            graphs = self._batchers[model] = {}
        batcher = graphs.get(graph)
        if batcher is None:
            name, on_batch = model.name, None  # capture the name only: the batcher must not keep the model alive
            if self.on_batch:
                def on_batch(rows, secs):
                    self.on_batch(name, graph, rows, secs)
            batcher = graphs[graph] = MicroBatcher(model.sessions[graph], max_batch=self.max_batch,
                                                   max_wait_ms=self.max_wait_ms, on_batch=on_batch)
        feeds = {n: feeds[n] for n in model.input_names[graph]}
        if alone:
            outputs = batcher.run_now(feeds)
            if outputs is not None:
                return outputs
        return await batcher.run(feeds)

    async def close(self) -> None:
        for graphs in list(self._batchers.values()):
            for batcher in graphs.values():
                await batcher.close()


def question_index(model: LoadedModel, ids: list[str], field: str) -> np.ndarray:
    """Model indices of external ids; an unknown id -> InvalidInput naming `field[i]`."""
    try:
        return model.index(ids, field)
    except UnknownId as exc:
        i = ids.index(str(exc.value))
        raise InvalidInput(field.replace("[]", f"[{i}]"),
                           f"unknown question id {exc.value!r} for model {model.name}") from None


def predictions(model: LoadedModel, question_ids: list[str], outputs: list[np.ndarray]) -> list[dict]:
    """Rows of the predict outputs (probs, theta, alpha, beta; batch row 0) as JSON-ready dicts."""
    # Python floats in one call per array; for a few categories plain Python beats numpy's per-call cost
    probs, theta, alpha, beta = (o[0].tolist() for o in outputs[:4])
    categories = range(model.n_cats)
    return [{"question_id": qid, "probabilities": p, "expected_response": sum(k * v for k, v in enumerate(p)),
             "most_likely_response": max(categories, key=p.__getitem__),  # the first of equal maxima, as argmax
             "theta": theta[i], "alpha": alpha[i], "beta": beta[i]}
            for i, (qid, p) in enumerate(zip(question_ids, probs, strict=True))]


class KnowledgeTracer:
    def __init__(self, registry: ModelRegistry, store: StateStore, engines: Engines, *, cas_retries: int = 100,
                 on_retry=None):
        self.registry, self.store, self.engines = registry, store, engines
        self.writers = Writers(cas_retries, on_retry)
        self._absorbing = 0  # absorb calls in progress: at 1, inference runs inline (Engines.run(alone=True))

    def model(self, name: str) -> LoadedModel:
        return self.registry.get(name, task="knowledge_tracing")

    @staticmethod
    def key(model: LoadedModel, student_id: str) -> str:
        return f"kt:{model.name}:{model.schema}:{student_id}"

    def _responses(self, model: LoadedModel, events: list[Event]) -> np.ndarray:
        for i, e in enumerate(events):
            if not 0 <= e.response < model.n_cats:
                raise InvalidInput(f"events[{i}].response",
                                   f"{e.response} is outside 0..{model.n_cats - 1} for model {model.name}")
        return np.array([e.response for e in events], dtype=np.int64)

    @staticmethod
    def _decode(model: LoadedModel, stored: StoredState) -> dict[str, np.ndarray]:
        return model.deserialize(stored.blob) if stored.blob is not None else model.initial_state

    async def _state(self, model: LoadedModel, student_id: str):
        stored = await self.store.get(self.key(model, student_id))
        return stored, self._decode(model, stored)

    async def _predict(self, model: LoadedModel, state: dict[str, np.ndarray], indices: np.ndarray):
        return await self.engines.run(model, "predict", {**batched(state), "questions": indices[None]})

    async def absorb(self, model_name: str, student_id: str, events: list[Event],
                     predict_ids: list[str] | None = None) -> dict:
        """Apply events in order (skipping replayed ids) and optionally predict afterwards, in one round trip."""
        model = self.model(model_name)
        questions = question_index(model, [e.question_id for e in events], "events[].question_id")
        responses = self._responses(model, events)
        predict_index = question_index(model, predict_ids, "predict_question_ids[]") if predict_ids else None
        key = self.key(model, student_id)
        self._absorbing += 1
        try:
            async with self.writers.lock(key):
                return await self._absorb(model, student_id, key, events, questions, responses, predict_ids,
                                          predict_index)
        finally:
            self._absorbing -= 1

    async def _absorb(self, model, student_id, key, events, questions, responses, predict_ids, predict_index):
        event_ids = [e.event_id for e in events]
        async for _ in self.writers.attempts(f"student {student_id!r}"):
            stored, already = await self.store.read(key, [i for i in event_ids if i is not None])
            state = self._decode(model, stored)
            fresh, fresh_ids = unapplied(event_ids, already)
            outputs = None
            for n, i in enumerate(fresh):
                feeds = {**batched(state), "question": questions[i:i + 1], "response": responses[i:i + 1]}
                if n == len(fresh) - 1 and predict_index is not None:  # last event: step and predict in one call
                    outs = await self.engines.run(model, "step_predict", {**feeds, "questions": predict_index[None]},
                                                  alone=self._absorbing == 1)
                    outputs = outs[len(model.state_spec):]
                else:
                    outs = await self.engines.run(model, "step", feeds, alone=self._absorbing == 1)
                state = {s["name"]: o[0] for s, o in zip(model.state_spec, outs, strict=False)}
            if not fresh:  # nothing new: leave the store alone
                written = stored
            else:
                written = await self.store.compare_and_set(key, stored.version, model.serialize(state), len(fresh),
                                                           fresh_ids)
                if written is None:
                    self.writers.lost(model)
                    continue
            if predict_index is not None and outputs is None:
                outputs = await self._predict(model, state, predict_index)
            return {"student_id": student_id, "model": model.name, "version": model.version,
                    "state_version": written.version, "events_absorbed": len(fresh),
                    "events_skipped": len(events) - len(fresh), "events_total": written.events,
                    "predictions": predictions(model, predict_ids, outputs) if outputs is not None else None}

    async def predict(self, model_name: str, student_id: str, question_ids: list[str]) -> dict:
        model = self.model(model_name)
        index = question_index(model, question_ids, "question_ids[]")
        stored, state = await self._state(model, student_id)
        outputs = await self._predict(model, state, index)
        return {"student_id": student_id, "model": model.name, "version": model.version,
                "state_version": stored.version, "events_total": stored.events,
                "predictions": predictions(model, question_ids, outputs)}

    async def next_item(self, model_name: str, student_id: str, candidates: list[str] | None, strategy: str,
                        target: float, k: int) -> dict:
        """Rank candidate questions: maximum GPCM Fisher information at the learner's current ability, or
        predicted probability of full credit closest to `target`."""
        model = self.model(model_name)
        candidates = candidates if candidates else model.ids
        index = question_index(model, candidates, "candidate_question_ids[]")
        stored, state = await self._state(model, student_id)
        probs, theta, alpha, _ = (o[0] for o in (await self._predict(model, state, index))[:4])
        categories = np.arange(model.n_cats)
        if strategy == "fisher":
            # GPCM item information at theta: alpha^2 Var(Y | theta)
            mean = probs @ categories
            scores = alpha**2 * (probs @ categories**2 - mean**2)
            order = np.argsort(-scores, kind="stable")
        else:
            scores = probs[:, -1]
            order = np.argsort(np.abs(scores - target), kind="stable")
        ranked = [{"question_id": candidates[i], "score": float(scores[i]), "theta": float(theta[i])}
                  for i in order[:k]]
        return {"student_id": student_id, "model": model.name, "version": model.version, "strategy": strategy,
                "state_version": stored.version, "items": ranked}

    async def summary(self, model_name: str, student_id: str) -> dict:
        model = self.model(model_name)
        stored, state = await self._state(model, student_id)
        index = np.arange(2, len(model.ids) + 2, dtype=np.int64)
        theta = (await self._predict(model, state, index))[1][0]
        return {"student_id": student_id, "model": model.name, "version": model.version,
                "exists": stored.blob is not None, "state_version": stored.version, "events_total": stored.events,
                "last_update": stored.updated, "ability": float(theta.mean()),
                "ability_range": [float(theta.min()), float(theta.max())]}

    async def delete(self, model_name: str, student_id: str) -> bool:
        model = self.model(model_name)
        return await self.store.delete(self.key(model, student_id))

    async def score_sequences(self, model_name: str, students: list[tuple[str, list[Event], list[str] | None]]):
        """Stateless: replay each student's whole history from the initial state; nothing is stored."""
        model = self.model(model_name)
        results = []
        for s, (student_id, events, predict_ids) in enumerate(students):
            try:
                questions = question_index(model, [e.question_id for e in events], "events[].question_id")
                responses = self._responses(model, events)
            except InvalidInput as exc:
                raise InvalidInput(f"students[{s}].{exc.field}", str(exc).split(": ", 1)[1]) from None
            state, per_event = model.initial_state, []
            for i in range(len(events)):
                q = questions[i:i + 1]
                per_event.append(predictions(model, [events[i].question_id], await self._predict(model, state, q)))
                outs = await self.engines.run(model, "step", {**batched(state), "question": q,
                                                              "response": responses[i:i + 1]})
                state = {spec["name"]: o[0] for spec, o in zip(model.state_spec, outs, strict=True)}
            final = None
            if predict_ids:
                index = question_index(model, predict_ids, f"students[{s}].predict_question_ids[]")
                final = predictions(model, predict_ids, await self._predict(model, state, index))
            results.append({"student_id": student_id, "events": len(events),
                            "event_predictions": [p[0] for p in per_event], "predictions": final})
        return {"model": model.name, "version": model.version, "students": results}
