"""Knowledge tracing, protocol-neutral: absorb events, predict, rank next items, summarise, delete.

A learner's key `kt:<model>:<student>` holds their event log (each event's time, response and question id as the
app sent it) and a state per model version (its schema hash covers the version and the state layout, so a state
written by one version is never read by another). A version whose state lags the log (new, or another version took
the latest events) folds the events it lacks in first, through its own graphs: every version answers from the
learner's whole logged history (`rebuilt_from_events` counts the events so folded in). Absorbing
events is optimistic concurrency: read (state, version), step the model through the new events, write
with compare-and-set; on a conflict, re-read and redo. Event ids make replays idempotent: ids already
applied (in the store's window) and repeated ids within a request are skipped.

Question ids the version never saw (added to the app after training): with NEXTSTEP_UNKNOWN_QUESTIONS=answer (the
default) and a version trained with an unknown row (its manifest's `unknown` section), they are stepped and predicted
through that row, their predictions say `"known": false`, an events answer lists them (`unknown_question_ids`), and
they are counted (`on_unknown`); otherwise they are a 422 naming the field. Either way the log keeps the id as sent,
so a version that knows it steps it through its own row when it rebuilds the state.

Models with memory banks (SimAKT, banks.py): a request takes the active bank once, when it starts, feeds its
projected keys and values to every step and predict call as shared inputs, and names its version
(`bank_version`). Stepping folds the bank into the state, so the stored blob ends with the 8-byte tag of the
bank version it was folded with; a request whose bank differs first re-encodes the state's chunks with its own
bank (the `rebase` graph) and stores the result (an events request with its events; a read with a
compare-and-set of its own, which may lose a race to a writer that stores a state as new). Their predictions
are [P(wrong), P(right)] without theta, alpha and beta (the graphs output none).
"""

import functools
import time
from dataclasses import dataclass

import numpy as np

from ..core import UP_TO_DATE, Behind, Change, StatefulTask, operation
from ..errors import InvalidInput, UnknownId, UnknownModel
from ..gate import log_losses
from ..quality import Quality
from ..registry import LoadedModel, ModelRegistry, TaskFields, TaskSpec, register_task
from ..runtime import Engines
from ..settings import DEFAULT_LIMITS, BatchLimits
from ..state import LogRow, StateStore, StoredState
from ..writes import batched
from .banks import Bank, Banks, InProcessBankStore, check_banks


@dataclass(frozen=True, slots=True)
class KtFields(TaskFields):
    """A knowledge-tracing model's own fields (LoadedModel.extra)."""

    n_cats: int  # response categories
    banks: dict | None  # SimAKT: the manifest's `banks` (heads, inputs, keys, explain, default, dir); with heads,
    # predict and step_predict take the projected banks (`keys`) and bank_project makes them from `inputs`

    def shown(self) -> dict:
        return {"n_cats": self.n_cats}


def _check(name: str, manifest: dict, graphs: dict, fail, inside) -> dict:
    try:
        n_cats = int(manifest["responses"]["n_cats"])
    except (KeyError, TypeError, ValueError):
        raise fail("manifest responses.n_cats missing or not an integer") from None
    banks = check_banks(manifest.get("banks"), graphs, fail)
    if banks:  # SimAKT: the folder of its memory banks (banks.py reads it at startup and reload)
        inside(banks["dir"], "banks")
    return {"extra": KtFields(n_cats, banks)}


SPEC = register_task(TaskSpec("knowledge_tracing", ("step", "predict", "step_predict"), "questions", True, _check,
                              optional=("bank_project", "rebase")))
# (optional, SimAKT's: banks -> their keys and values; a state folded with one bank -> the state with another)


@dataclass(frozen=True)
class Event:
    question_id: str
    response: int
    event_id: str | None = None
    time: float | None = None  # unix seconds the app gave; None: when the service received it


def log_row(event: Event, now: float) -> LogRow:
    """An event as the learner's log keeps it: the response (one byte), then the question id as the app sent it."""
    return LogRow(now if event.time is None else event.time, bytes([event.response]) + event.question_id.encode())


def logged_event(row: LogRow) -> Event:
    return Event(row.payload[1:].decode(), row.payload[0], time=row.time)


@dataclass(frozen=True)
class PairedTurn:
    """A gated rollout's turn (gate.py): the log position of the fresh events of the version that answered them
    (`serving`: the serving version under a shadow, the candidate under a canary), and what it scores them from (its
    state before them, its bank), so that the other version's turn scores both on the same events of the log."""

    since: int
    serving: LoadedModel
    state: dict
    bank: Bank | None


UNKNOWN_MODES = ("answer", "error")  # NEXTSTEP_UNKNOWN_QUESTIONS


def unknown_refusal(model: LoadedModel, mode: str, what: str) -> str:
    """Why an unknown id is refused (the 422's detail after the id): the setting, or a version without the row."""
    if mode == "error":
        return "(NEXTSTEP_UNKNOWN_QUESTIONS=error)"
    return (f"(version {model.version} was trained without an unknown-{what} row to answer ids added after training: "
            "retrain it to answer them)")


def question_rows(model: LoadedModel, ids: list[str], field: str, mode: str) -> tuple[np.ndarray, list[int]]:
    """(model indices of external ids, the positions of ids the model does not know). mode "answer": an unknown id
    takes the unknown row, trained for it, where the version has one; else, or with mode "error", an unknown id is
    InvalidInput naming `field[i]`."""
    if mode == "answer" and model.unknown_row:
        return model.rows(ids)
    try:
        return model.index(ids, field), []
    except UnknownId as exc:
        i = ids.index(str(exc.value))
        raise InvalidInput(field.replace("[]", f"[{i}]"), f"unknown question id {exc.value!r} for model {model.name} "
                                                          f"{unknown_refusal(model, mode, 'question')}") from None


def irt(model: LoadedModel) -> bool:
    """Whether the predict graph gives theta, alpha and beta after the probabilities (the GPCM families)."""
    return model.output_names["predict"][1:4] == ["theta", "alpha", "beta"]


def predictions(model: LoadedModel, question_ids: list[str], outputs: list[np.ndarray],
                unknown: list[int] = ()) -> list[dict]:
    """Rows of the predict outputs (probs, and theta, alpha, beta where the model has them; batch row 0) as
    JSON-ready dicts; the rows at `unknown` (ids answered by the unknown row) say `"known": false`."""
    # Python floats in one call per array; for a few categories plain Python beats numpy's per-call cost
    probs = outputs[0][0].tolist()
    categories = range(model.extra.n_cats)
    rows = [{"question_id": qid, "probabilities": p, "expected_response": sum(k * v for k, v in enumerate(p)),
             "most_likely_response": max(categories, key=p.__getitem__)}  # the first of equal maxima, as argmax
            for qid, p in zip(question_ids, probs, strict=True)]
    if irt(model):
        for row, theta, alpha, beta in zip(rows, *(o[0].tolist() for o in outputs[1:4]), strict=True):
            row.update(theta=theta, alpha=alpha, beta=beta)
    for i in unknown:
        rows[i]["known"] = False
    return rows


def explanation(model: LoadedModel, bank: Bank, outputs: list[np.ndarray], top: int = 5) -> dict:
    """Each inter-student head's `top` bank entries by attention weight at the learner's latest position (the
    graph's explain_<head> outputs; entries of weight 0 left out: none before the first event)."""
    named = dict(zip(model.output_names["predict"], outputs, strict=True))
    heads = {}
    for head, name in zip(model.extra.banks["heads"], model.extra.banks["explain"], strict=True):
        weights = named[name][0]
        order = np.argsort(-weights, kind="stable")[:top]
        heads[head] = [{"entry": int(i), "weight": float(weights[i]), **bank.entries[head][i]}
                       for i in order if weights[i] > 0]
    return {"bank_version": bank.version, "heads": heads}


class KnowledgeTracer(StatefulTask):
    TASK, PREFIX = SPEC.name, "kt"

    def __init__(self, registry: ModelRegistry, store: StateStore, engines: Engines, *, cas_retries: int = 100,
                 on_retry=None, banks: Banks | None = None, limits: BatchLimits = DEFAULT_LIMITS,
                 unknown_questions: str = "answer", on_unknown=None, quality: Quality | None = None):
        super().__init__(registry, store, engines, cas_retries=cas_retries, on_retry=on_retry)
        self.banks = banks or Banks(InProcessBankStore())
        self.limits = limits
        if unknown_questions not in UNKNOWN_MODES:
            raise ValueError(f"unknown_questions must be one of {UNKNOWN_MODES}, got {unknown_questions!r}")
        self.unknown_questions = unknown_questions
        self.on_unknown = on_unknown  # (model, count): ids answered by the unknown row (a metric)
        self.quality = quality  # live scores of each event's prediction (None: not scored)

    async def loaded(self, models: list[LoadedModel]) -> None:
        await self.banks.prepare(models)  # publish the artifacts' bank versions, project the active ones

    async def close(self) -> None:
        await self.banks.close()

    def _rows(self, model: LoadedModel, ids: list[str], field: str) -> tuple[np.ndarray, list[int]]:
        """question_rows under this service's setting."""
        return question_rows(model, ids, field, self.unknown_questions)

    def _count(self, model: LoadedModel, n: int) -> None:
        """`n` ids answered through the unknown row (once the answer is made: a refused request counts none)."""
        if n and self.on_unknown is not None:
            self.on_unknown(model, n)

    @staticmethod
    def _bank_version(model: LoadedModel, bank: Bank | None) -> dict:
        """{"bank_version": ...} in every answer of a model with a banks section; nothing for the others."""
        return {"bank_version": bank.version if bank else None} if model.extra.banks is not None else {}

    def _explaining(self, model: LoadedModel, explain: bool) -> bool:
        if explain and not self.banks.uses_banks(model):
            raise InvalidInput("explain", f"model {model.name} has no memory banks to explain its predictions by")
        return explain

    def _bank_model(self, name: str) -> LoadedModel:
        model = self.model(name)
        if not self.banks.uses_banks(model):
            raise UnknownModel(f"model {name!r} has no memory banks")
        return model

    async def bank_versions(self, model_name: str) -> dict:
        model = self._bank_model(model_name)
        return {"model": model.name, "version": model.version, **await self.banks.versions(model)}

    async def activate_bank(self, model_name: str, version: str) -> dict:
        """Make `version` the active bank: loaded and projected here before the pointer moves."""
        model = self._bank_model(model_name)
        known = [v["version"] for v in (await self.banks.versions(model))["versions"]]
        if version not in known:
            raise InvalidInput("version", f"no bank version {version!r} for model {model.name}; known: {known}")
        previous = await self.banks.activate(model, version)
        return {"model": model.name, "version": model.version, "bank_version": version, "previous": previous}

    def _responses(self, model: LoadedModel, events: list[Event]) -> np.ndarray:
        for i, e in enumerate(events):
            if not 0 <= e.response < model.extra.n_cats:
                raise InvalidInput(f"events[{i}].response",
                                   f"{e.response} is outside 0..{model.extra.n_cats - 1} for model {model.name}")
        return np.array([e.response for e in events], dtype=np.int64)

    async def _decode(self, model: LoadedModel, stored: StoredState, bank: Bank | None
                      ) -> tuple[dict[str, np.ndarray], bool]:
        """(the stored state for this bank, whether it had to be rebased: folded with another bank version)."""
        if stored.blob is None:
            return model.initial_state, False
        if bank is None:
            return model.deserialize(stored.blob), False
        state = model.deserialize(stored.blob[:-len(bank.tag)])
        if stored.blob[-len(bank.tag):] == bank.tag:
            return state, False
        outs = await self.engines.run(model, "rebase", batched(state), shared=bank.kv)
        return {s["name"]: o[0] for s, o in zip(model.state_spec, outs, strict=True)}, True

    @staticmethod
    def _blob(model: LoadedModel, state: dict[str, np.ndarray], bank: Bank | None) -> bytes:
        return model.serialize(state) + (bank.tag if bank else b"")

    def _logged(self, model: LoadedModel, rows: list[LogRow]) -> tuple[np.ndarray, np.ndarray]:
        """(the model rows of logged events' questions, -1 where this version cannot step one: a question it does not
        know, unless it answers those through its unknown row as a live event would be; their responses), decoded
        all at once."""
        ids = [row.payload[1:].decode() for row in rows]
        responses = np.frombuffer(b"".join(row.payload[:1] for row in rows), dtype=np.uint8).astype(np.int64)
        if self.unknown_questions == "answer" and model.unknown_row:
            return model.rows(ids)[0], responses
        return model.lookup(ids), responses

    async def _catch_up(self, model: LoadedModel, state: dict[str, np.ndarray], behind: Behind, bank: Bank | None
                        ) -> tuple[dict[str, np.ndarray], dict]:
        """The state with the logged events it lacks folded in, and what the answer says about them: how many were
        folded (`rebuilt_from_events`), and, where some could not be, how many the log no longer holds and how many
        name a question this version does not know (left out)."""
        if not behind.rows:  # (every live event: nothing to decode, no array to make)
            return state, ({"rebuilt_from_events": 0, "events_not_in_log": behind.missing} if behind.missing
                           else {"rebuilt_from_events": 0})
        questions, responses = self._logged(model, behind.rows)
        known = (questions >= 0) & (responses < model.extra.n_cats)
        questions, responses = questions[known], responses[known]
        unknown = len(known) - len(questions)
        if len(questions):
            state = await self.fold_columns(model, state, {"question": questions, "response": responses},
                                            shared=bank.kv if bank else None)
        said = {"rebuilt_from_events": len(questions)}
        if behind.missing:
            said["events_not_in_log"] = behind.missing
        if unknown:
            said["events_not_understood"] = unknown
        return state, said

    async def _state(self, model: LoadedModel, student_id: str, bank: Bank | None):
        """(the stored state's record, the state for this bank, what the answer says of a catch-up); a state rebased
        or caught up with the log is stored if nothing was written meanwhile."""
        key = self.key(model, student_id)
        stored = await self.store.get(key, schema=self.schema(model))
        state, rebased = await self._decode(model, stored, bank)
        behind = await self.behind(key, stored)
        state, said = await self._catch_up(model, state, behind, bank)
        if rebased or stored.behind > 0:
            stored = await self.store.compare_and_set(key, stored.version, self._blob(model, state, bank),
                                                      said["rebuilt_from_events"], schema=self.schema(model),
                                                      expected_total=stored.total) or stored
        return stored, state, said

    async def _fold_scored(self, model: LoadedModel, state: dict[str, np.ndarray], questions: np.ndarray,
                           responses: np.ndarray, fresh: list[int], query: dict | None, bank: Bank | None,
                           background: bool = True, keep_state: bool = True):
        """`fold` through the fresh events that also gives what the model predicted for each event's question from
        the state before it, P(each response) (n, K), for live quality (quality.py): the first event's from a
        `predict` call, each later one's from the fused `step_predict` call that steps the event before it, asked
        for the next event's question; the last event's call answers the request's `query` (or is a plain step).
        One graph call more than `fold`, whatever the number of events; with `background` (it runs after answers:
        scoring jobs and shadows) never inline on the event loop. Without `keep_state` (a scoring job, which keeps
        only the predictions) the last event's plain step is not run, and the state returned is None."""
        shared = bank.kv if bank else None
        n_state = len(model.state_spec)
        first = fresh[0]
        ask = {"questions": questions[first:first + 1][None]}
        before = [(await self.engines.run(model, "predict", {**batched(state), **ask}, shared=shared,
                                          background=background))[0][0, 0]]
        outputs = None
        for j, i in enumerate(fresh):
            feeds = {**batched(state), "question": questions[i:i + 1], "response": responses[i:i + 1]}
            last = j == len(fresh) - 1
            ask = query if last else {"questions": questions[fresh[j + 1]:fresh[j + 1] + 1][None]}
            if ask is None:
                if not keep_state:  # (the last event's plain step: its state is not wanted)
                    return None, outputs, np.array(before)
                outs = await self.engines.run(model, "step", feeds, shared=shared, background=background)
            else:
                outs = await self.engines.run(model, "step_predict", {**feeds, **ask}, shared=shared,
                                              background=background)
                if last:
                    outputs = outs[n_state:]
                else:
                    before.append(outs[n_state][0, 0])
            state = {spec["name"]: o[0] for spec, o in zip(model.state_spec, outs, strict=False)}
        return state, outputs, np.array(before)

    async def _score(self, model: LoadedModel, state: dict[str, np.ndarray], questions: np.ndarray,
                     responses: np.ndarray, role: str, bank: Bank | None) -> None:
        """Live quality of events already answered: what the version predicted for each from the state before it
        (`_fold_scored` from the state before the first), recorded (quality.py). Run after the answer."""
        _, _, before = await self._fold_scored(model, state, questions, responses, list(range(len(questions))), None,
                                               bank, keep_state=False)
        self.quality.record(model.name, model.version, before, responses, role)

    async def _score_each(self, model: LoadedModel, role: str, bank: Bank | None,
                          items: list[tuple[dict[str, np.ndarray], np.int64, np.int64]]) -> None:
        """Live quality of single events already answered (`Quality.pend`: one version's, in one role, with one
        bank), together: each (state before, question, response) a row of one `predict` call, recorded."""
        feeds = {name: np.stack([state[name] for state, _, _ in items]) for name in items[0][0]}
        feeds["questions"] = np.array([question for _, question, _ in items], dtype=np.int64)[:, None]
        probs = (await self.engines.run(model, "predict", feeds, shared=bank.kv if bank else None,
                                        background=True))[0][:, 0]
        self.quality.record(model.name, model.version, probs, np.array([r for _, _, r in items]), role)

    def _turn(self, serving: LoadedModel, since: int, state: dict, bank: Bank | None) -> int | PairedTurn:
        """What a shadow's turn takes: the log position of the fresh events, with what pairs them under a gate."""
        return PairedTurn(since, serving, state, bank) if self.gated(serving.name) else since

    async def follow_log(self, model: LoadedModel, entity: str, since: int | PairedTurn) -> bool:
        turn, since = (since, since.since) if isinstance(since, PairedTurn) else (None, since)
        key, schema = self.key(model, entity), self.schema(model)
        stored = await self.store.get(key, schema=schema)
        if stored.behind <= 0:
            return True
        bank = await self.banks.current(model)
        behind = await self.behind(key, stored)
        state, _ = await self._decode(model, stored, bank)
        split = self._split(stored, behind, since)
        state, said = await self._catch_up(model, state, Behind(behind.rows[:split], behind.missing), bank)
        questions, responses = self._logged(model, behind.rows[split:])  # (as the live events were stepped)
        known = (questions >= 0) & (responses < model.extra.n_cats)
        questions, responses = questions[known], responses[known]
        before = None
        if len(questions):
            state, _, before = await self._fold_scored(model, state, questions, responses,
                                                       list(range(len(questions))), None, bank)
        written = await self.store.compare_and_set(key, stored.version, self._blob(model, state, bank),
                                                   said["rebuilt_from_events"] + len(questions), schema=schema,
                                                   expected_total=stored.total)
        if written is not None and before is not None and self.quality is not None:
            self.quality.record(model.name, model.version, before, responses, "shadow")
        if written is not None and before is not None and turn is not None:
            await self._pair(model, entity, turn, behind.rows[split:], known, before)
        return written is not None

    async def _pair(self, follower: LoadedModel, entity: str, turn: PairedTurn, rows: list[LogRow],
                    known: np.ndarray, scored: np.ndarray) -> None:
        """The gate's evidence of a turn: every event the follower scored from the turn's log position on (the
        answering version's fresh events, and those of its later writes when the follower's queue ran behind), each
        event's log loss through the candidate minus through the serving version, each from its own state before it:
        the answering version's from the state the turn carries, through the same log rows. Events one of the two
        cannot step are left out."""
        if not self.gated(follower.name):
            return
        questions, responses = self._logged(turn.serving, rows)
        answerable = (questions >= 0) & (responses < turn.serving.extra.n_cats)
        if not answerable.any():
            return
        _, _, answered = await self._fold_scored(turn.serving, turn.state, questions[answerable],
                                                 responses[answerable], list(range(int(answerable.sum()))), None,
                                                 turn.bank, keep_state=False)
        followed_loss, answered_loss = np.full(len(rows), np.nan), np.full(len(rows), np.nan)
        followed_loss[known] = log_losses(scored, responses[known])
        answered_loss[answerable] = log_losses(answered, responses[answerable])
        both = known & answerable
        await self.pair(follower, entity, followed_loss[both], answered_loss[both])

    async def catch_up(self, model: LoadedModel, entity: str) -> tuple[int, bool]:
        stored, _, said = await self._state(model, entity, await self.banks.current(model))
        return said["rebuilt_from_events"], stored.behind == 0

    async def _predict(self, model: LoadedModel, state: dict[str, np.ndarray], indices: np.ndarray,
                       bank: Bank | None = None):
        return await self.engines.run(model, "predict", {**batched(state), "questions": indices[None]},
                                      shared=bank.kv if bank else None)

    @operation
    async def absorb(self, model_name: str, student_id: str, events: list[Event],
                     predict_ids: list[str] | None = None, explain: bool = False) -> dict:
        """Apply events in order (skipping replayed ids) and optionally predict afterwards, in one round trip."""
        model = self.model(model_name, student_id)
        questions, unknown = self._rows(model, [e.question_id for e in events], "events[].question_id")
        responses = self._responses(model, events)
        predict_index, predict_unknown = self._rows(model, predict_ids, "predict_question_ids[]") if predict_ids \
            else (None, [])
        if self._explaining(model, explain) and predict_index is None:  # the weights do not depend on the question
            predict_index = np.array([2], dtype=np.int64)
        bank = await self.banks.current(model)  # this request's bank, to its end
        query = {"questions": predict_index[None]} if predict_index is not None else None
        unknown_set = set(unknown)

        async def attempt(stored: StoredState, fresh: list[int], _, behind: Behind = UP_TO_DATE) -> Change:
            steps = [{"question": questions[i:i + 1], "response": responses[i:i + 1]} for i in fresh]
            fresh_unknown = [i for i in fresh if i in unknown_set]
            state, rebased = await self._decode(model, stored, bank)
            state, said = await self._catch_up(model, state, behind, bank)
            before = state  # (the state the fresh events' predictions are scored from, after the answer)
            state, outputs = await self.fold(model, state, steps, "step_predict" if query else None, query or {},
                                             bank.kv if bank else None)
            now = time.time()

            async def answer(written: StoredState) -> dict:
                nonlocal outputs
                if self.quality is not None and len(fresh) == 1:  # (once: the attempt that was written)
                    role = self.role(model)
                    self.quality.pend(model.name, (id(model), role, id(bank)), (before, questions[fresh[0]],
                                      responses[fresh[0]]), functools.partial(self._score_each, model, role, bank))
                elif self.quality is not None and fresh:
                    self.quality.later(model.name, functools.partial(
                        self._score, model, before, questions[fresh], responses[fresh], self.role(model), bank))
                self.shadow(model, student_id, written, len(fresh),
                            turn=lambda: self._turn(model, written.total - len(fresh), before, bank))
                self._count(model, len(fresh_unknown) + len(predict_unknown))
                if predict_index is not None and outputs is None:  # no new event: predict from the stored state
                    outputs = await self._predict(model, state, predict_index, bank)
                return {"student_id": student_id, "model": model.name, "version": model.version,
                        **self._bank_version(model, bank), "state_version": written.version,
                        "events_absorbed": len(fresh), "events_skipped": len(events) - len(fresh),
                        "events_total": written.events, **said,
                        **({"unknown_question_ids": list(dict.fromkeys(events[i].question_id for i in fresh_unknown))}
                           if fresh_unknown else {}),
                        "predictions": predictions(model, predict_ids, outputs, predict_unknown) if predict_ids
                        else None,
                        **({"explanation": explanation(model, bank, outputs)} if explain else {})}

            return Change(self._blob(model, state, bank) if fresh or rebased or behind.rows else None, answer,
                          len(fresh) + said["rebuilt_from_events"],  # nothing new: no write
                          rows=[log_row(events[i], now) for i in fresh])

        return await self.write(model, self.key(model, student_id), f"student {student_id!r}",
                                [e.event_id for e in events], attempt)

    @operation
    async def predict(self, model_name: str, student_id: str, question_ids: list[str], explain: bool = False) -> dict:
        model = self.model(model_name, student_id)
        index, unknown = self._rows(model, question_ids, "question_ids[]")
        self._explaining(model, explain)
        bank = await self.banks.current(model)
        stored, state, said = await self._state(model, student_id, bank)
        outputs = await self._predict(model, state, index, bank)
        self._count(model, len(unknown))
        return {"student_id": student_id, "model": model.name, "version": model.version,
                **self._bank_version(model, bank), "state_version": stored.version, "events_total": stored.events,
                **said, "predictions": predictions(model, question_ids, outputs, unknown),
                **({"explanation": explanation(model, bank, outputs)} if explain else {})}

    @operation
    async def next_item(self, model_name: str, student_id: str, candidates: list[str] | None, strategy: str,
                        target: float, k: int) -> dict:
        """Rank candidate questions: maximum Fisher information at the learner's current state (GPCM: alpha^2
        Var(Y | theta); right/wrong without IRT outputs: Bernoulli p(1 - p)), or predicted probability of full
        credit closest to `target`."""
        model = self.model(model_name, student_id)
        candidates = candidates if candidates else model.ids
        index, unknown = self._rows(model, candidates, "candidate_question_ids[]")
        unknown = set(unknown)
        bank = await self.banks.current(model)
        stored, state, said = await self._state(model, student_id, bank)
        outputs = [o[0] for o in await self._predict(model, state, index, bank)]
        probs, with_irt = outputs[0], irt(model)
        categories = np.arange(model.extra.n_cats)
        if strategy == "fisher":
            mean = probs @ categories
            scores = probs @ categories**2 - mean**2  # Var(Y): p(1 - p) for right/wrong
            if with_irt:
                scores = outputs[2] ** 2 * scores  # GPCM item information at theta: alpha^2 Var(Y | theta)
            order = np.argsort(-scores, kind="stable")
        else:
            scores = probs[:, -1]
            order = np.argsort(np.abs(scores - target), kind="stable")
        ranked = [{"question_id": candidates[i], "score": float(scores[i]),
                   **({"theta": float(outputs[1][i])} if with_irt else {}),
                   **({"known": False} if i in unknown else {})} for i in order[:k]]
        self._count(model, len(unknown))
        return {"student_id": student_id, "model": model.name, "version": model.version,
                **self._bank_version(model, bank), "strategy": strategy, "state_version": stored.version, **said,
                "items": ranked}

    async def summary(self, model_name: str, student_id: str) -> dict:
        """The stored state's counts and the learner's ability: mean theta over the vocabulary (GPCM); a model
        without theta reports ability null and its mean predicted P(full credit) over the vocabulary instead."""
        model = self.model(model_name, student_id)
        bank = await self.banks.current(model)
        stored, state, said = await self._state(model, student_id, bank)
        index = np.arange(2, len(model.ids) + 2, dtype=np.int64)
        outputs = await self._predict(model, state, index, bank)
        if irt(model):
            theta = outputs[1][0]
            ability = {"ability": float(theta.mean()), "ability_range": [float(theta.min()), float(theta.max())]}
        else:
            p = outputs[0][0][:, -1]
            ability = {"ability": None, "ability_range": None, "mean_p_right": float(p.mean()),
                       "p_right_range": [float(p.min()), float(p.max())]}
        return {"student_id": student_id, "model": model.name, "version": model.version,
                **self._bank_version(model, bank), "exists": stored.blob is not None,
                "state_version": stored.version, "events_total": stored.events, "last_update": stored.updated,
                **said, **ability}

    async def score_sequences(self, model_name: str, students: list[tuple[str, list[Event], list[str] | None]]):
        """Stateless: replay each student's whole history from the initial state; nothing is stored. Each event's
        prediction (made before the event) comes out of the previous event's step_predict call: one graph call per
        event. Within `limits` (413 naming the field), checked before any work."""
        self.limits.check("students", [len(events) for _, events, _ in students], "events",
                          [len(ids or ()) for _, _, ids in students], "predict_question_ids")
        model = self.model(model_name)
        bank = await self.banks.current(model)
        shared = bank.kv if bank else None
        results, answered_unknown = [], 0
        for s, (student_id, events, predict_ids) in enumerate(students):
            try:
                questions, unknown = self._rows(model, [e.question_id for e in events], "events[].question_id")
                responses = self._responses(model, events)
            except InvalidInput as exc:
                raise InvalidInput(f"students[{s}].{exc.field}", str(exc).split(": ", 1)[1]) from None
            index, predict_unknown = self._rows(model, predict_ids, f"students[{s}].predict_question_ids[]") \
                if predict_ids else (None, [])
            unknown = set(unknown)
            answered_unknown += len(unknown) + len(predict_unknown)
            state, per_event, outputs = model.initial_state, [], None
            if events:
                outputs = await self._predict(model, state, questions[:1], bank)
            for i in range(len(events)):
                per_event.append(predictions(model, [events[i].question_id], outputs, [0] if i in unknown else [])[0])
                query = questions[i + 1:i + 2] if i + 1 < len(events) else index  # the next event's, or the final
                state, outputs = await self.fold(model, state, [{"question": questions[i:i + 1],
                                                                 "response": responses[i:i + 1]}],
                                                 "step_predict" if query is not None else None,
                                                 {"questions": query[None]} if query is not None else None, shared)
            final = None
            if predict_ids:
                if not events:
                    outputs = await self._predict(model, state, index, bank)
                final = predictions(model, predict_ids, outputs, predict_unknown)
            results.append({"student_id": student_id, "events": len(events), "event_predictions": per_event,
                            "predictions": final})
        self._count(model, answered_unknown)
        return {"model": model.name, "version": model.version, **self._bank_version(model, bank),
                "students": results}
