"""Spaced repetition (task "srs"), protocol-neutral: record reviews, predict a review, schedule cards.

The model (nextstep/models/time_aware.py, exported by nextstep/training/srs/time_aware_export.py) is one
stateless graph, `predict`, that answers a query (card, deck, time) from a window of the user's earlier
reviews. Which reviews make the window is `nextstep.srs.review_window.select` (the query card's last
`card_size` reviews plus the user's most recent ones, up to `size`), the rule training used; this module
only keeps enough of each user's log to apply it, and calls it. Every prediction (`predict`, a review's FSRS-6
error for the drift, a shadow's score) runs `predict`'s twin `predict_memory` where the artifact has it
(`_predict`): each card's FSRS-6 memory computed with fsrs-rs from the same rows (nextstep/srs/card_memory.py) instead
of by the recurrence inside the graph, half the graph's cost at the default sizes, the same answer; `schedule` keeps
the recurrence in its graph.

The parts: how a user's reviews are stored (stored.py), the windows and graph feeds built from them (windows.py),
other window layouts and migration (layouts.py), shadow rollouts (shadow.py), refits (refit.py) and the simulation
of a deck (simulate.py); this module holds the task's spec and the operations.

Drift. Each recorded review the protocol scores (its card last reviewed on an earlier scheduler day) adds
FSRS-6's error on it to the user's drift sums: the predict graph answers every new review from its window
just before it (one batched call per request) with FSRS-6's own recall (`fsrs_recall`) and whether it is
`scored`; predict and schedule then feed the sums (the graph's `drift` input). Each review also keeps its own
error (NaN when not scored), which the graph reads back with the window (`hist_error`): the deck's drift is the
same mean over the window's reviews of the query's deck. The sums and errors are computed under the
FSRS-6 parameters of the version that recorded the review; a new version goes on from them (they estimate the
same thing: how far the user is from FSRS-6 lately).

Evidence. Where the model mixes its network with FSRS-6 at the default parameters (the manifest's `evidence`; the
predict graph's `network_recall` and `default_recall`), each scored review adds the defaults' log loss on it minus
the network's to the user's evidence (decayed by the manifest's halflife; `evidence_sums`), which every graph takes
(`evidence`): the served P(recall) is sigmoid(evidence) times the network's plus the rest times the defaults'. A
write of several reviews answers them twice: once for FSRS-6's errors, once more with the drift sums and errors just
before each, as stepping does, for the network's forecasts. Like the drift, the evidence is carried to a new version
and to another layout as it is (it sums over all of the user's reviews, which no layout holds).

Day boundary. FSRS-6 counts intervals in the user's scheduler days, and a review is scored when its card was last
reviewed on an earlier one: days that start at Anki's "next day starts at" hour in the user's time zone. Both graphs
take each user's boundary (`day_start`, seconds after 00:00 UTC). An app tells it with the user's reviews
(`day_start_hour_utc`); it is kept in the header (`Fit.day_start`) from those reviews on, and a user never told has
the manifest's `model_config.day_start_hour` (04:00 UTC for a model trained across users).

Writes. Reviews must come in time order (equal times are fine), within a request and after the user's last
stored review; an older one is a 422 naming it and nothing is written. Event ids make replays idempotent
(the store's replay window, NEXTSTEP_MAX_EVENT_IDS ids per user); a replay that has left the window is
refused by the time order (unless it has the last review's very time) rather than counted twice. Users
live for years: their store's TTL, NEXTSTEP_SRS_TTL_SECONDS, is two years by default, refreshed by every
review recorded (0: never expire).

Scheduling (`schedule`) is one batched call of the `schedule` graph: the model's recall is a forgetting curve,
monotone in the time since the card's last review, and the graph inverts it in closed form. No card waits longer
than the maximum interval (NEXTSTEP_SRS_MAX_INTERVAL_DAYS) after its last review.
"""

from __future__ import annotations

import functools
import math
import time as _time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ...srs.card_memory import AVAILABLE as CARD_MEMORY
from ...srs.card_memory import UNSEEN, card_memory
from ...srs.review_window import drift_sums, evidence_sums
from ..core import Change, StatefulTask, operation
from ..errors import InvalidInput
from ..quality import Quality
from ..registry import ONNX_DTYPES, LoadedModel, TaskFields, TaskSpec, register_task
from ..state import StoredState
from .layouts import NOT_REBUILT, Layouts
from .refit import Refits
from .shadow import Shadows, ShadowTurn
from .simulate import Simulations
from .stored import (
    DEFAULT_FSRS6,
    ROW,
    History,
    Review,
    _decode,
    _encode,
    check_reviews,
    check_time,
    default_params,
    id_hash,
    manifest_params,
    schema_hash,
)
from .windows import (
    INPUTS,
    MAX_CELLS,
    MEMORY_GRAPH,
    MIXTURE_OUTPUTS,
    OUTPUTS,
    SCHEDULE_OUTPUTS,
    _log_loss,
    _new_rows,
    _tail,
    network_weight,
    user_feeds,
    window,
)


@dataclass(frozen=True, slots=True)
class SrsFields(TaskFields):
    """A flashcard model's own fields (LoadedModel.extra)."""

    window: tuple[int, int]  # (size, card_size) of the review window the model reads
    fsrs6: tuple[float, ...] = DEFAULT_FSRS6  # the FSRS-6 parameters a user starts with (stored.manifest_params)

    def shown(self) -> dict:
        return {"window": {"size": self.window[0], "card_size": self.window[1]}}


def _check(name: str, manifest: dict, graphs: dict, fail, inside) -> dict:
    inputs, outputs = graphs["predict"]
    wrong = [(n, t) for n, t in inputs if n not in INPUTS or ONNX_DTYPES.get(t) != INPUTS[n]]
    if wrong:
        raise fail(f"predict graph takes {wrong}, which the service does not feed (it feeds {INPUTS})")
    if not set(OUTPUTS) <= set(outputs):
        raise fail(f"predict graph outputs {outputs}, the service needs {list(OUTPUTS)} (re-export with this "
                   "version)")
    inputs, outputs = graphs["schedule"]
    wrong = [(n, t) for n, t in inputs if ONNX_DTYPES.get(t) != {**INPUTS, "retention": "float32"}.get(n)]
    if wrong or list(outputs) != list(SCHEDULE_OUTPUTS):
        raise fail(f"schedule graph takes {inputs} and outputs {outputs}; the service feeds {INPUTS} and "
                   f"retention (float32) and reads {list(SCHEDULE_OUTPUTS)} (re-export with this version)")
    if MEMORY_GRAPH in graphs:
        inputs, outputs = graphs[MEMORY_GRAPH]
        wrong = [(n, t) for n, t in inputs
                 if ONNX_DTYPES.get(t) != {**INPUTS, "memory": "float32", "default_stability": "float32"}.get(n)]
        if wrong or ("memory", "tensor(float)") not in inputs or not set(OUTPUTS) <= set(outputs):
            raise fail(f"{MEMORY_GRAPH} graph takes {inputs} and outputs {outputs}; the service feeds {INPUTS} and "
                       f"memory (float32) and reads {list(OUTPUTS)} (re-export with this version)")
    w = manifest.get("window")
    try:
        window = (int(w["size"]), int(w["card_size"]))
    except (KeyError, TypeError, ValueError):
        raise fail(f"manifest window {w!r} is not {{size, card_size}} as integers") from None
    if window[0] < 1 or window[1] < 0:
        raise fail(f"manifest window {w!r}: size must be >= 1 and card_size >= 0")
    mixing = set(MIXTURE_OUTPUTS) <= set(graphs["predict"][1])
    evidence = manifest.get("evidence")
    if mixing and not (isinstance(evidence, dict) and isinstance(evidence.get("prior"), (int, float))
                       and (evidence.get("halflife_scored_reviews") is None
                            or isinstance(evidence["halflife_scored_reviews"], (int, float))
                            and evidence["halflife_scored_reviews"] > 0)):
        raise fail(f"predict graph outputs {list(MIXTURE_OUTPUTS)}, but manifest evidence {evidence!r} is not "
                   "{prior, halflife_scored_reviews} as numbers (re-export with this version)")
    halflife = (manifest.get("drift") or {}).get("halflife_scored_reviews")
    if not isinstance(halflife, (int, float)) or isinstance(halflife, bool) or not 0 < halflife < math.inf:
        raise fail(f"manifest drift.halflife_scored_reviews {halflife!r} is not a positive number (re-export "
                   "with this version)")
    return {"extra": SrsFields(window, manifest_params(manifest)), "schema": schema_hash(name, *window)}


# no state tensors, no vocabulary: the service keeps raw reviews and feeds them as a window; ids are hashed
SPEC = register_task(TaskSpec("srs", ("predict", "schedule"), None, False, _check, optional=(MEMORY_GRAPH,)))




class SpacedRepetition(Layouts, Shadows, Refits, Simulations, StatefulTask):
    TASK, PREFIX = SPEC.name, "srs"
    refits = None  # refit.RefitWorker: queues users due a fit after a write (None: NEXTSTEP_SRS_REFIT off)
    fitter = None  # where `refit` runs fsrs-rs: refit.FitProcess (the worker's), or None: a thread

    def __init__(self, *args, max_interval_days: float = 1825.0, refit_min_scored: int = 32,
                 refit_every_scored: int = 100, quality: Quality | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.quality = quality  # live P(recall) of each scored review, from its window before it (None: not scored)
        self.max_interval_days = float(max_interval_days)  # NEXTSTEP_SRS_MAX_INTERVAL_DAYS
        self.refit_min_scored = int(refit_min_scored)  # NEXTSTEP_SRS_REFIT_MIN_SCORED
        self.refit_every_scored = int(refit_every_scored)  # NEXTSTEP_SRS_REFIT_EVERY_SCORED

    # a user's stored reviews are their log already (every version of the same layout reads them): one state per
    # layout, under a key of its own
    def key(self, model: LoadedModel, entity: str) -> str:
        return self._key_of(model, model.schema, entity)

    def schema(self, model: LoadedModel) -> str:
        return ""

    async def _read(self, key: str, cards: Sequence[str]) -> History:
        stored, _ = await self.store.read(key, fields=list(dict.fromkeys(cards)))
        return _decode(stored)

    # ------------------------------------------------------------------ other layouts of the model


    async def _run(self, model: LoadedModel, hist: dict[str, np.ndarray], which: np.ndarray, cards: np.ndarray,
                   decks: np.ndarray, times: np.ndarray, graph: str = "predict", background: bool = False,
                   **extra: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's outputs for queries (cards[i], decks[i], times[i], and extra[name][i]) on the windows
        hist[which[i]], in calls of at most MAX_CELLS history cells (a big schedule neither builds nor runs one
        huge batch). `background`: work no request waits for (a shadow's turn), never run inline."""
        names = [o.name for o in model.sessions[graph].get_outputs()]
        step = max(1, MAX_CELLS // hist["hist_valid"].shape[1])
        parts = []
        whole = len(which) <= step and len(which) == len(hist["hist_valid"]) \
            and bool((which == np.arange(len(which))).all())  # (hist as it is: a prediction, a review's windows)
        for lo in range(0, len(which), step):
            rows = which[lo:lo + step]
            feed = dict(hist) if whole else {name: value[rows] for name, value in hist.items()}
            feed.update(card=cards[lo:lo + step], deck=decks[lo:lo + step], time=times[lo:lo + step],
                        **{name: value[lo:lo + step] for name, value in extra.items()})
            outs = await self.engines.run(model, graph, feed, background=background)
            parts.append(dict(zip(names, outs, strict=True)))
        return parts[0] if len(parts) == 1 else {name: np.concatenate([p[name] for p in parts]) for name in names}

    async def _predict(self, model: LoadedModel, windows: Sequence[np.ndarray], hist: dict[str, np.ndarray],
                       which: np.ndarray, cards: np.ndarray, decks: np.ndarray, times: np.ndarray,
                       background: bool = False) -> dict[str, np.ndarray]:
        """`predict`'s outputs for queries (cards[i], decks[i], times[i]) on windows[which[i]] of one user, fed as
        `hist` (user_feeds): through `predict_memory` where the artifact has it, each card's FSRS-6 memory from
        fsrs-rs (card_memory, with the parameters and day boundary `hist` feeds; a card without a review in its
        window gets UNSEEN, which the graph does not read), else (no such graph, no fsrs-rs installed, parameters it
        refuses) `predict`."""
        given = {}
        if MEMORY_GRAPH in model.sessions and CARD_MEMORY:
            params, start, size = hist["fsrs_w"][0], float(hist["day_start"][0]), model.extra.window[1]
            # with the mixture, each card's stability under the default parameters too
            defaults = np.asarray(default_params(model), dtype=np.float32) \
                if "default_stability" in model.input_names[MEMORY_GRAPH] else None
            memory = np.tile(np.float32(UNSEEN), (len(which), 1))
            default_s = np.full(len(which), UNSEEN[0], dtype=np.float32)
            same = defaults is not None and np.array_equal(defaults, params)  # (a user without a fit: one call)
            for i, (w, card) in enumerate(zip(which, cards, strict=True)):
                rows = windows[w]
                got = card_memory(rows["card"], rows["time"], rows["rating"], int(card), params, start, size)
                if got is None and np.any(rows["card"] == card):  # (reviews it cannot take: the graph's own
                    break  # recurrence answers)
                if got is not None:
                    memory[i] = got
                    if defaults is not None:
                        default_s[i] = got[0] if same else card_memory(rows["card"], rows["time"], rows["rating"],
                                                                         int(card), defaults, start, size)[0]
            else:
                given = {"graph": MEMORY_GRAPH, "memory": memory,
                         **({"default_stability": default_s} if defaults is not None else {})}
        return await self._run(model, hist, which, cards, decks, times, background=background, **given)

    async def _answer(self, model: LoadedModel, history: History, card_id: str, deck_id: str,
                      at: float) -> dict:
        rows = window(model, history, card_id)
        hist = user_feeds(model, [rows], history)
        card = id_hash(card_id)
        out = await self._predict(model, [rows], hist, np.zeros(1, dtype=np.int64), np.array([card]),
                                  np.array([id_hash(deck_id)]), np.array([at], dtype=np.float64))
        probs = out["rating_probs"][0].tolist()
        return {"card_id": card_id, "deck_id": deck_id, "time": at,
                "p_rating": {str(k + 1): p for k, p in enumerate(probs)}, "p_recall": float(out["recall"][0]),
                "expected_duration_s": float(out["duration_s"][0]), "history_used": len(rows),
                "card_reviews": int(np.count_nonzero(rows["card"] == card))}

    async def _drift(self, model: LoadedModel, history: History, windows: list[np.ndarray], new: np.ndarray,
                     background: bool = False) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
        """(the drift sums after the new reviews (ROW), FSRS-6's error on each of them: NaN where not scored, the
        model's P(recall) of each from its window: NaN where not scored, for live quality, and the user's evidence
        after them: as it was for a model without the mixture), each answered from its window by one batched predict
        call (TimeAwareTransformer.drift_update, row_error, evidence_update) from the user's drift sums and evidence
        before them (`history`), under their FSRS-6 parameters and day boundary. With the mixture and several new
        reviews, a second call answers each with the drift sums and errors of the new ones before it, as stepping
        does (FSRS-6's errors do not depend on them; the network's forecasts, which the evidence adds up, do)."""
        drift = history.drift
        if not len(new):
            return drift, np.zeros(0, dtype=np.float32), np.zeros(0), history.evidence
        hist = user_feeds(model, windows, history)
        which, query = np.arange(len(new)), [np.ascontiguousarray(new[f]) for f in ("card", "deck", "time")]
        out = await self._predict(model, windows, hist, which, *query, background=background)
        errors = (new["rating"] > 1) - out["fsrs_recall"].astype(np.float64)
        sums = drift_sums(errors, out["scored"], float(model.manifest["drift"]["halflife_scored_reviews"]), drift)
        errors = np.where(out["scored"], errors, np.nan).astype(np.float32)
        if not set(MIXTURE_OUTPUTS) <= set(out):
            return (sums[-1], errors, np.where(out["scored"], out["recall"].astype(np.float64), np.nan),
                    history.evidence)  # (a version without the mixture leaves the evidence as it is)
        if len(new) > 1:  # the network as stepping answers each review: with the drift sums and errors just before it
            mine = dict(zip(new["seq"].tolist(), errors, strict=True))
            windows = [w.copy() for w in windows]
            for w in windows:
                for i in np.flatnonzero(np.isin(w["seq"], new["seq"])):
                    w["error"][i] = mine[int(w["seq"][i])]
            hist = {**user_feeds(model, windows, history), "drift": sums[:-1].astype(np.float32)}
            out = await self._predict(model, windows, hist, which, *query, background=background)
        recalled = new["rating"] > 1
        gains = _log_loss(out["default_recall"], recalled) - _log_loss(out["network_recall"], recalled)
        evidence = evidence_sums(gains, out["scored"], model.manifest["evidence"]["halflife_scored_reviews"],
                                 history.evidence_of(model))
        # the served P(recall) of each, as the graph mixes them, by the evidence just before it
        weight = network_weight(evidence[:-1])
        recall = weight * out["network_recall"] + (1 - weight) * out["default_recall"]
        return sums[-1], errors, np.where(out["scored"], recall, np.nan), float(evidence[-1])

    @staticmethod
    def _query_time(history: History, at: float | None, field: str) -> float:
        """`at`, checked against the user's last review; absent: now (or the last review, if that is later)."""
        last = history.last_time
        if at is None:
            return max(_time.time(), last) if last is not None else _time.time()
        check_time(at, field)
        if last is not None and at < last:
            raise InvalidInput(field, f"{at!r} is before the user's last review at {last!r}")
        return at

    # ------------------------------------------------------------------ operations

    @operation
    async def add_reviews(self, model_name: str, user_id: str, reviews: list[Review],
                          predict: tuple[str, str, float | None] | None = None, day_start: float | None = None) -> dict:
        """Append reviews (in time order, after the stored ones; replayed event ids are applied once) and
        optionally predict one query (card_id, deck_id, time) afterwards, in one read and one write. `day_start`:
        the user's scheduler day boundary (seconds after 00:00 UTC), stored from these reviews on."""
        model = self.model(model_name, user_id)
        check_reviews(reviews)
        if day_start is not None and not 0 <= day_start < 86400:
            raise InvalidInput("day_start_hour_utc", f"{day_start / 3600!r} is not an hour in [0, 24)")
        if predict is not None and not predict[0]:
            raise InvalidInput("predict.card_id", "must not be empty")
        size, card_size = model.extra.window
        asked = [r.card_id for r in reviews] + ([predict[0]] if predict is not None else [])

        async def attempt(stored: StoredState, fresh: list[int], *_) -> Change:
            history, said, carried_fields = _decode(stored), NOT_REBUILT, {}
            if not stored.exists:  # a first write under this layout: the user's state under another, if any
                moved = await self._rebuild(model, user_id, stored)
                if moved is not None:
                    history, said, carried_fields = moved.history, moved.said, moved.fields
                    ids = [reviews[i].event_id for i in fresh if reviews[i].event_id is not None]
                    applied = await self.store.seen(moved.source, ids) if ids else set()  # (its replay window)
                    fresh = [i for i in fresh if reviews[i].event_id not in applied]
            told = day_start is not None and day_start != history.fit.day_start  # a new day boundary
            if told:
                history = replace(history, fit=replace(history.fit, day_start=day_start))
            last = history.last_time
            if fresh and last is not None and reviews[fresh[0]].time < last:
                i = fresh[0]
                ahead = " (ahead of the server's clock: reviews at the right time are taken again once the clock " \
                        "passes it, or once the user's reviews are deleted)" if last > _time.time() else ""
                raise InvalidInput(f"reviews[{i}].time", f"{reviews[i].time!r} is before the user's last stored "
                                                         f"review at {last!r}{ahead}: reviews must be in time order")
            new = _new_rows([reviews[i] for i in fresh], history.count)
            added: dict[str, list[int]] = {}  # card id -> the positions in `new` of its reviews so far

            def field(card: str) -> np.ndarray:  # the card's field: its latest `card_size` rows, new ones included
                rows = np.concatenate([history.cards.get(card, np.zeros(0, dtype=ROW)), new[added.get(card, [])]])
                return rows[-card_size:] if card_size else rows[:0]

            windows = []  # each new review's window, before it (for FSRS-6's error on it: the drift)
            for j, i in enumerate(fresh):
                card = reviews[i].card_id
                before = replace(history, recent=_tail(np.concatenate([history.recent, new[:j]]), size),
                                 cards={card: field(card)})
                windows.append(window(model, before, card))
                added.setdefault(card, []).append(j)
            drift, new["error"], recall, evidence = await self._drift(model, history, windows, new)
            scored = history.scored + int(np.count_nonzero(~np.isnan(new["error"]))) if history.scored >= 0 else -1
            touched = {card: field(card) for card in added}  # after the errors: the fields carry them too
            n_cards = history.n_cards + sum(card not in history.cards for card in added)
            recent = _tail(np.concatenate([history.recent, new]), size)
            after = replace(history, recent=recent, cards={**history.cards, **touched}, n_cards=n_cards, drift=drift,
                            scored=scored, evidence=evidence)
            at = self._query_time(after, predict[2], "predict.time") if predict is not None else None  # before writing

            async def answer(written: StoredState) -> dict:
                scored_now = ~np.isnan(recall)
                if self.quality is not None and scored_now.any():  # (once: the attempt that was written)
                    p = recall[scored_now]
                    self.quality.record(model.name, model.version, np.stack([1 - p, p], axis=1),
                                        (new["rating"][scored_now] > 1).astype(np.int64), self.role(model))
                if self.refits is not None and fresh:  # a fit due now: the refit worker's, off the request path
                    self.refits.offer(model, user_id, scored, history.fit)
                turn = functools.partial(ShadowTurn.of, model, history, new, [reviews[i] for i in fresh], windows,
                                         recall)
                self.shadow(model, user_id, written, len(fresh), turn)
                self.keep_up(model, user_id, len(fresh), turn)
                return {"user_id": user_id, "model": model.name, "version": model.version,
                        "applied": len(fresh), "replayed": len(reviews) - len(fresh),
                        "reviews_total": written.events, "last_review_time": after.last_time,
                        "state_version": written.version, **said,
                        "prediction": await self._answer(model, after, predict[0], predict[1], at)
                        if predict is not None else None}

            moved = said["rebuilt_from_events"] > 0
            return Change(_encode(recent, n_cards, drift, scored, history.fit, evidence)
                          if fresh or moved or told else None,
                          answer,
                          len(fresh) + (history.count if moved else 0),
                          {**carried_fields, **{card: rows.tobytes() for card, rows in touched.items()}})

        return await self.write(model, self.key(model, user_id), f"user {user_id!r}", [r.event_id for r in reviews],
                                attempt, fields=list(dict.fromkeys(asked)))

    @operation
    async def predict(self, model_name: str, user_id: str, card_id: str, deck_id: str = "",
                      at: float | None = None) -> dict:
        """P(rating), P(recall) and the expected answer time of a review of `card_id` at `at` (default now)."""
        model = self.model(model_name, user_id)
        if not card_id:
            raise InvalidInput("card_id", "must not be empty")
        if at is not None:
            check_time(at, "time")
        history, said = await self._history(model, user_id, [card_id])
        at = self._query_time(history, at, "time")
        answer = await self._answer(model, history, card_id, deck_id, at)
        return {"user_id": user_id, "model": model.name, "version": model.version,
                "reviews_total": history.stored.events, **said, **answer}

    @operation
    async def schedule(self, model_name: str, user_id: str, cards: list[tuple[str, str]], retention: float,
                       now: float | None = None, horizon_days: float = 36500.0) -> dict:
        """Per card, the time at which the predicted recall falls to `retention`, from the model's forgetting curve
        in closed form (the `schedule` graph, TimeAwareTransformer.schedule): one batched call for every card.
        Status: `new` for a card with no review the model sees (due now), `due_now` when the recall is already at or
        below `retention` at `now`, `max_interval` when the curve would wait past the maximum interval
        (NEXTSTEP_SRS_MAX_INTERVAL_DAYS after the card's last review: due then, or now if that is past),
        `beyond_horizon` when it stays above it until the horizon (due = the horizon), else `scheduled`; at a due
        other than the curve's, the recall and answer time are the model's there."""
        model = self.model(model_name, user_id)
        if not cards:
            raise InvalidInput("cards", "at least one card is needed")
        if not 0 < retention < 1:
            raise InvalidInput("desired_retention", f"{retention!r} is not a probability strictly between 0 and 1")
        if not (math.isfinite(horizon_days) and 0 < horizon_days * 86400 <= 1e10):
            raise InvalidInput("horizon_days", f"{horizon_days!r} is not a horizon in days (0 < days <= 115740)")
        for i, (card, _) in enumerate(cards):
            if not card:
                raise InvalidInput(f"cards[{i}].card_id", "must not be empty")
        if now is not None:
            check_time(now, "now")
        history, said = await self._history(model, user_id, [c for c, _ in cards])
        now = self._query_time(history, now, "now")
        windows = [window(model, history, card) for card, _ in cards]
        hist = user_feeds(model, windows, history)
        n = len(cards)
        card_ids = np.array([id_hash(c) for c, _ in cards], dtype=np.int64)
        deck_ids = np.array([id_hash(d) for _, d in cards], dtype=np.int64)
        out = await self._run(model, hist, np.arange(n), card_ids, deck_ids, np.full(n, now),
                              graph="schedule", retention=np.full(n, retention, dtype=np.float32))
        wait = np.expm1(out["log_wait_days"].astype(np.float64)) * 86400.0
        last = np.array([w["time"][w["card"] == c].max() if np.any(w["card"] == c) else np.nan
                         for w, c in zip(windows, card_ids, strict=True)])  # the card's last review the model sees
        seen = np.isfinite(last)
        capped = seen & (now + wait > last + self.max_interval_days * 86400.0)
        horizon = now + horizon_days * 86400.0
        due = np.where(capped, np.maximum(last + self.max_interval_days * 86400.0, now), now + wait)
        status = np.where(~seen, "new", np.where(due > horizon, "beyond_horizon", np.where(
            capped, np.where(due > now, "max_interval", "due_now"), np.where(wait <= 0, "due_now", "scheduled"))))
        due = np.where(status == "beyond_horizon", horizon, np.where(status == "due_now", now, due))
        moved = np.flatnonzero((status == "beyond_horizon") | (status == "max_interval"))
        if len(moved):  # the recall and answer time at a due the curve did not choose
            at = await self._predict(model, windows, hist, moved, card_ids[moved], deck_ids[moved],
                                     due[moved])
            out["recall"][moved], out["duration_s"][moved] = at["recall"], at["duration_s"]
        now_due = np.flatnonzero(capped & (status == "due_now") & (wait > 0))
        if len(now_due):  # past the maximum interval already: the recall now, not at the curve's due
            at = await self._predict(model, windows, hist, now_due, card_ids[now_due], deck_ids[now_due],
                                     np.full(len(now_due), now))
            out["recall"][now_due], out["duration_s"][now_due] = at["recall"], at["duration_s"]
        results = [self._due(cards[i], str(status[i]), now, due[i], out["recall"][i], out["duration_s"][i])
                   for i in range(n)]
        return {"user_id": user_id, "model": model.name, "version": model.version, "now": now,
                "desired_retention": retention, "horizon_days": horizon_days,
                "max_interval_days": self.max_interval_days, "reviews_total": history.stored.events, **said,
                "cards": results}


    @staticmethod
    def _due(card: tuple[str, str], status: str, now: float, due: float, recall, duration) -> dict:
        return {"card_id": card[0], "deck_id": card[1], "status": status, "due": float(due),
                "interval_days": (float(due) - now) / 86400.0, "p_recall_at_due": float(recall),
                "expected_duration_s": float(duration)}

    # ------------------------------------------------------------------ shadow rollouts (off the request path)


    async def _append(self, model: LoadedModel, history: History, new: np.ndarray, cards: Sequence[str]
                      ) -> tuple[History, dict[str, np.ndarray], np.ndarray]:
        """The user's history after the reviews `new` (ROW, sequence numbers from history.count on; their card ids
        `cards`) under `model`'s layout, as add_reviews records them: (the history after; the fields of the cards
        reviewed, errors in; the model's P(recall) of each review from its window just before it, NaN where not
        scored). A shadow's work: its graph calls run in the background."""
        size, card_size = model.extra.window
        new = new.copy()
        added: dict[str, list[int]] = {}

        def field(card: str) -> np.ndarray:
            rows = np.concatenate([history.cards.get(card, np.zeros(0, dtype=ROW)), new[added.get(card, [])]])
            return rows[-card_size:] if card_size else rows[:0]

        windows = []
        for j, card in enumerate(cards):
            before = replace(history, recent=_tail(np.concatenate([history.recent, new[:j]]), size),
                             cards={card: field(card)})
            windows.append(window(model, before, card))
            added.setdefault(card, []).append(j)
        drift, new["error"], recall, evidence = await self._drift(model, history, windows, new, background=True)
        scored = history.scored + int(np.count_nonzero(~np.isnan(new["error"]))) if history.scored >= 0 else -1
        touched = {card: field(card) for card in added}
        n_cards = history.n_cards + sum(card not in history.cards for card in added)
        recent = _tail(np.concatenate([history.recent, new]), size)
        return (replace(history, recent=recent, cards={**history.cards, **touched}, n_cards=n_cards, drift=drift,
                        scored=scored, evidence=evidence), touched, recall)


    # ------------------------------------------------------------------ refits (off the request path)


    async def summary(self, model_name: str, user_id: str) -> dict:
        model = self.model(model_name, user_id)
        key = self.key(model, user_id)
        history = _decode(await self.store.get(key))
        said = NOT_REBUILT
        if not history.stored.exists:
            said = await self._carry(model, user_id, history.stored)
            if said["rebuilt_from_events"]:
                history = _decode(await self.store.get(key))
        stored = history.stored
        fit = history.fit
        return {"user_id": user_id, "model": model.name, "version": model.version, "exists": stored.exists,
                "reviews_total": stored.events, "last_review_time": history.last_time, "cards": history.n_cards,
                "state_version": stored.version, "last_update": stored.updated, **said,
                "parameters": {"w": [float(x) for x in (fit.w if fit.w is not None else default_params(model))],
                               "fitted_on": fit.fitted_on, "fitted_at": fit.fitted_at,
                               "scored_reviews": history.scored if history.scored >= 0 else None,
                               "day_start_hour_utc": history.day_start(model) / 3600.0,
                               "day_start_told": fit.day_start is not None},
                **({"evidence": self._evidence(history.evidence_of(model))} if "evidence" in model.manifest else {})}

    @staticmethod
    def _evidence(nats: float) -> dict:
        """The user's evidence for the network over FSRS-6's defaults, and the weight it gives the network."""
        return {"nats": nats, "network_weight": float(network_weight(nats)),
                "about": "log loss of FSRS-6 with the default parameters minus the network's on the user's scored "
                         "reviews, recent ones counting most; P(recall) = network_weight * the network's + "
                         "(1 - network_weight) * the defaults'"}
