"""Spaced repetition (task "srs"), protocol-neutral: record reviews, predict a review, schedule cards.

The model (nextstep/models/time_aware.py, exported by nextstep/training/srs/time_aware_export.py) is one
stateless graph, `predict`, that answers a query (card, deck, time) from a window of the user's earlier
reviews. Which reviews make the window is `nextstep.review_window.select` (the query card's last
`card_size` reviews plus the user's most recent ones, up to `size`), the rule training used; this module
only keeps enough of each user's log to apply it, and calls it. Every prediction (`predict`, a review's FSRS-6
error for the drift, a shadow's score) runs `predict`'s twin `predict_memory` where the artifact has it
(`_predict`): each card's FSRS-6 memory computed with fsrs-rs from the same rows (nextstep/card_memory.py) instead
of by the recurrence inside the graph, half the graph's cost at the default sizes, the same answer; `schedule` keeps
the recurrence in its graph.

State per user, under `srs:<model>:<schema>:<user>` (the schema hash covers the storage layout and the
window sizes, not the model version: the reviews are data, and a new version reading windows of the same
sizes goes on from them; see schema_hash):

* the blob: a header, followed by the user's last `size` reviews (the recent block), oldest first. The header
  (`HEADER`, layout v6) holds a tag (-6), the number of distinct cards reviewed (int64), the user's drift sums (m, w)
  (two float64, TimeAwareTransformer.drift_update), the number of scored reviews recorded, the user's own FSRS-6
  parameters with their provenance (`Fit`: the 21 weights, the reviews they were fitted on, the scored count then,
  when), their scheduler day boundary (seconds after 00:00 UTC; NaN: the model's) and their evidence for the network
  over FSRS-6's defaults (below; NaN: the model's prior). Older headers still read: a v5 header (`HEADER_V5`, tag -5)
  has no evidence, a v4 header (tag -4) no day boundary either, a v3 header (`HEADER_V3`, before per-user parameters:
  the card count and the drift only, its first field a count >= 0) has the artifact's default parameters too; the
  user's next write stores v6;
* a companion field per card id (state.py's `fields`): that card's last `card_size` reviews.

Each stored review is a fixed 42-byte row (`ROW`): its sequence number within the user's log (0, 1, ...;
the review count is the next one), the card and deck as int64, the time, the duration, rating and state, and
FSRS-6's error on it (below).

Other layouts. The stored reviews are the user's log (issue 37): a version whose window sizes differ from those of
the version that stored them finds no state under its own schema, and builds one (`_rebuild`, `carried`) from the
user's state under the newest other layout of the model that has one (`layouts`: the schemas of the model's other
loaded versions, newest first): the reviews held there (the recent block and every card's field, each once by
sequence number) laid out for its windows, with the header's card count, drift sums, scored count and FSRS-6
parameters carried over, written with the store's compare-and-set (a first write under the layout takes the rebuilt
reviews with it; a read stores it by itself, `_carry`). The answer says `rebuilt_from_events` (the reviews read; 0
otherwise) and, where the new windows are larger, `reviews_not_held` (the user's reviews the old layout no longer
held). With windows no larger, every review the new layout keeps was held, and the state equals the one the same
reviews recorded under the new layout give (each review's FSRS-6 error depends on its card's last `card_size`
reviews only, so with the same card window the errors and the drift are the same too); with larger windows the new
recent block has gaps, which `window` leaves out, until `size` newer reviews fill it. Only the first write under a
layout rebuilds: a layout that already holds a state for the user never looks at the others. A migration
(`to_migrate`, `catch_up`: POST /v1/models/{model}/migrate, `nextstep states migrate`) rebuilds every user of the
other layouts ahead of their first request; `delete` removes the user under every layout.
A request reads the blob and only the fields of the cards it names, in one round trip, and writes them
back with one compare-and-set, so the cost of a request does not grow with the number of cards a user has.
The review count is the store's event counter.

Shadow rollouts (issue 35). After each write through the serving version for a user in a shadow's fraction, the
candidate takes a turn off the request path (core.StatefulTask.shadow, `follow_log`), from what the write queued
(`ShadowTurn`: the reviews, each one's window just before it, the user's state before the write). Of the serving
layout, the candidate shares the user's reviews: its turn is its P(recall) of each review the serving version's was
scored on, from the same window, drift sums and FSRS-6 parameters (its own defaults before a fit), recorded with role
"shadow"; nothing is stored. Of another layout, the candidate's own state of the user takes the reviews as a write
through it would (its windows, its drift sums; the user's parameters as the serving layout holds them; the event
ids), scored the same way; a state that does not end where the serving one did before the write (none yet, a turn
dropped or failed, a shadow stopped and started again) is first rebuilt from the serving layout's state as it was
just before the write (keeping the reviews it held, if it is part of the same history), so that every turn is scored;
if the serving state has moved on since, the turn stores nothing and the user's next one rebuilds. A turn that
waited while the candidate began answering the user (a canary, a promotion: on any replica) puts the write's reviews
before those the candidate took meanwhile, which are recorded again after them. While such a candidate is a canary,
its states of the users outside its fraction keep up the same way, unscored (`keep_up`: a shadow's states stay ready
through a canary to the promotion). An abort leaves those states as they are, no longer
following. A promotion finds each user of the fraction ready as of their last turn; one whose last turn was dropped
or failed, and who has written nothing since, has a state without the reviews of that write, which the promoted
version goes on from (a layout holding a state never looks at the others).

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

Parameters. Each user's FSRS-6 parameters are an input of both graphs (`fsrs_w`): one artifact serves every
user with their own memory model. A new user starts from the manifest's `fsrs6.parameters` (fsrs-rs's defaults
for an artifact trained across users). They are refitted off the request path, from the user's stored reviews, by
fsrs-rs (`refit`): once the user has at least NEXTSTEP_SRS_REFIT_MIN_SCORED scored reviews, and again whenever
NEXTSTEP_SRS_REFIT_EVERY_SCORED more have arrived since the last fit. The service does it itself
(NEXTSTEP_SRS_REFIT=auto): a write that leaves the user due a fit queues them for the replica's refit worker
(srs_refit.py's RefitWorker: a bounded queue, one fit at a time in a process of its own, under the store's lease of
the user); `nextstep srs refit` runs it for every user or those named. The fit is the evaluation protocol's
(`srs_eval.fit_fsrs6`) on the reviews the store holds: the recent block and each card's last `card_size` reviews (a
card with more starts its history at the oldest kept). The new parameters are written with a compare-and-set of the
header alone (reviews recorded meanwhile are kept).

Day boundary. FSRS-6 counts intervals in the user's scheduler days, and a review is scored when its card was last
reviewed on an earlier one: days that start at Anki's "next day starts at" hour in the user's time zone. Both graphs
take each user's boundary (`day_start`, seconds after 00:00 UTC). An app tells it with the user's reviews
(`day_start_hour_utc`); it is kept in the header (`Fit.day_start`) from those reviews on, and a user never told has
the manifest's `model_config.day_start_hour` (04:00 UTC for a model trained across users).

Ids. The graph only compares card and deck ids for equality, so the service maps its string ids to int64
with a stable hash (`id_hash`: the first 8 bytes of BLAKE2b, as a signed little-endian integer). Two ids
collide with probability about n^2 / 2^65 for n distinct ids of one user (1e-12 at 5,000 cards), and a
collision would only make the model treat two cards (or decks) as one. The card's field is its string id,
so the stored histories themselves never mix.

Writes. Reviews must come in time order (equal times are fine), within a request and after the user's last
stored review; an older one is a 422 naming it and nothing is written. Event ids make replays idempotent
(the store's replay window, NEXTSTEP_MAX_EVENT_IDS ids per user); a replay that has left the window is
refused by the time order (unless it has the last review's very time) rather than counted twice. Users
live for years: their store's TTL, NEXTSTEP_SRS_TTL_SECONDS, is two years by default, refreshed by every
review recorded (0: never expire).

Scheduling (`schedule`) is one batched call of the `schedule` graph: the model's recall is a forgetting curve,
monotone in the time since the card's last review, and the graph inverts it in closed form. No card waits longer
than the maximum interval (NEXTSTEP_SRS_MAX_INTERVAL_DAYS) after its last review.

Simulation (`simulate`): the expected workload of several desired retentions over the next days, for the user's
whole deck (`read_all`: every card's field) or the cards given; srs_simulate.py says how, with the model's own
intervals and answer times measured on a sample of the deck (two graph calls, whatever its size).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import json
import math
import time as _time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np

from ...card_memory import AVAILABLE as CARD_MEMORY
from ...card_memory import UNSEEN, card_memory
from ...review_window import drift_sums, evidence_sums, select
from ..core import Change, StatefulTask, operation
from ..errors import InvalidInput, TooLarge, UnknownModel
from ..quality import Quality
from ..registry import ONNX_DTYPES, LoadedModel, TaskFields, TaskSpec, register_task
from ..state import StoredState
from .simulate import DEFAULT_FIRST, DEFAULT_RECALLED, FSRS6, MIN_PATHS, ModelCurve, shares
from .simulate import simulate as run_simulation

ROW = np.dtype([("seq", "<i8"), ("card", "<i8"), ("deck", "<i8"), ("time", "<f8"), ("duration", "<f4"),
                ("rating", "i1"), ("state", "i1"), ("error", "<f4")])  # packed: 42 bytes
HEADER_V3 = np.dtype([("cards", "<i8"), ("drift", "<f8", (2,))])  # distinct cards reviewed, drift sums (m, w)
HEADER_TAG = -6  # the first field of a v6 header (v5's is -5, v4's -4, a v3 header's a card count, >= 0)
N_PARAMS = 21
HEADER_V4 = np.dtype([("tag", "<i8"), ("cards", "<i8"), ("drift", "<f8", (2,)), ("scored", "<i8"),
                      ("w", "<f8", (N_PARAMS,)), ("fitted_on", "<i8"), ("fitted_scored", "<i8"), ("fitted_at", "<f8")])
HEADER_V5 = np.dtype(HEADER_V4.descr + [("day_start", "<f8")])  # v4 and the user's day boundary (NaN: the model's)
HEADER = np.dtype(HEADER_V5.descr + [("evidence", "<f8")])  # v5 and the user's evidence (NaN: the model's prior)
MS_LOOKING = 1e11  # a time above this is milliseconds (as seconds it is after the year 5100)
SIMULATE_MAX_DAYS = 3650  # the longest simulation a request may ask for
SIMULATE_MAX_RETENTIONS = 10
SIMULATE_RETENTIONS = (0.5, 0.99)  # the desired retentions a simulation takes (Anki's slider: 0.70 to 0.99)
SIMULATE_MAX_WORK = 20_000_000  # card-days x retentions a simulation may cover (5,000 cards, 365 days, 10 retentions)
SIMULATE_SAMPLE_ROWS = 32  # schedule-graph rows a simulation runs on a sample of the deck: 16 cards x 2 retentions
# fsrs-rs 0.9's default FSRS-6 parameters (nextstep/models/fsrs.py's DEFAULT_W), for an artifact whose manifest has
# none (the service does not import the model's package, which needs torch)
DEFAULT_FSRS6 = (0.212, 1.2931, 2.3065, 8.2956, 6.4133, 0.8334, 3.0194, 0.001, 1.8722, 0.1666, 0.796, 1.4835, 0.0614,
                 0.2629, 1.6483, 0.6014, 1.8729, 0.5425, 0.0912, 0.0658, 0.1542)
MAX_CELLS = 1 << 13  # rows x window columns per ONNX Runtime call: a big schedule goes in several calls, so
# that requests queued meanwhile (the calls share one ONNX Runtime thread) wait for one call, not all of them
# what the service feeds the predict graph (an exporter may prune inputs: a subset is fine) and reads back
INPUTS = {"hist_card": "int64", "hist_deck": "int64", "hist_time": "float64", "hist_rating": "int64",
          "hist_duration": "float32", "hist_state": "int64", "hist_valid": "bool", "hist_error": "float32",
          "drift": "float32", "fsrs_w": "float32", "day_start": "float64", "evidence": "float32",
          "card": "int64", "deck": "int64", "time": "float64"}
OUTPUTS = ("rating_probs", "recall", "duration_s", "fsrs_recall", "scored")
# where the model mixes its network with FSRS-6's defaults by the user's evidence (the manifest's `evidence`): the two
# forecasters' P(recall) of each review, which the evidence adds up (TimeAwareTransformer.evidence_update)
MIXTURE_OUTPUTS = ("network_recall", "default_recall")
SCHEDULE_OUTPUTS = ("recall", "log_wait_days", "duration_s")  # the schedule graph (inputs: INPUTS + retention)
# predict with the query card's FSRS-6 memory as an input (INPUTS + memory (B, 2) float32, nextstep/card_memory.py),
# where an artifact has it: every prediction runs it (SpacedRepetition._predict)
MEMORY_GRAPH = "predict_memory"
# The layout of the reviews stored per user (below): part of the state key's schema hash together with the
# window sizes. Change it whenever this module changes how it stores reviews.
STATE_LAYOUT = "srs-reviews-v3: card count (i8) and drift sums (2 f8), recent block and per-card fields of rows " \
    "(seq i8, card i8, deck i8, time f8, duration f4, rating i1, state i1, error f4); ids as signed BLAKE2b-64"
_PAD = {"card": (0, np.int64), "deck": (0, np.int64), "time": (0.0, np.float64), "rating": (1, np.int64),
        "duration": (0.0, np.float32), "state": (-1, np.int64), "error": (np.nan, np.float32)}  # the hist_* inputs


def schema_hash(name: str, size: int, card_size: int) -> str:
    """A user's stored state is their raw reviews, not model tensors: any version of a model that reads windows
    of the same sizes can use it, so the hash covers the storage layout and the window sizes but not the
    version (a new version keeps its users' histories; one with other window sizes starts afresh)."""
    return hashlib.sha256(json.dumps([name, STATE_LAYOUT, size, card_size]).encode()).hexdigest()[:12]


@dataclass(frozen=True, slots=True)
class SrsFields(TaskFields):
    """A flashcard model's own fields (LoadedModel.extra)."""

    window: tuple[int, int]  # (size, card_size) of the review window the model reads

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
    return {"extra": SrsFields(window), "schema": schema_hash(name, *window)}


# no state tensors, no vocabulary: the service keeps raw reviews and feeds them as a window; ids are hashed
SPEC = register_task(TaskSpec("srs", ("predict", "schedule"), None, False, _check, optional=(MEMORY_GRAPH,)))


def id_hash(value: str) -> int:
    """A string id as the int64 the graph compares: the first 8 bytes of BLAKE2b, signed little-endian."""
    return int.from_bytes(hashlib.blake2b(value.encode(), digest_size=8).digest(), "little", signed=True)


def check_time(value: float, field: str) -> float:
    """Unix seconds: finite, >= 0, and not a millisecond timestamp."""
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(field, f"{value!r} is not a unix time in seconds (finite, >= 0)")
    if value > MS_LOOKING:
        raise InvalidInput(field, f"{value!r} looks like milliseconds: times are unix seconds")
    return value


@dataclass(frozen=True)
class Review:
    card_id: str
    time: float  # unix seconds
    rating: int  # 1..4
    deck_id: str = ""
    duration: float | None = None  # seconds; None unknown
    state: int | None = None  # 0..3; None unknown
    event_id: str | None = None


@dataclass(frozen=True)
class Fit:
    """A user's FSRS-6: their parameters, `w` None until a fit (the model's defaults), the reviews the fit used, the
    scored reviews the user had recorded by then (the next fit is due refit_every_scored after them), and when it
    was made (unix seconds); and their scheduler day boundary in seconds after 00:00 UTC, which FSRS-6 counts days
    by (told by the app with their reviews, never fitted; None: the model's `day_start_hour`)."""

    w: tuple[float, ...] | None = None
    fitted_on: int = 0
    fitted_scored: int = 0
    fitted_at: float | None = None
    day_start: float | None = None


NO_FIT = Fit()


@dataclass
class History:
    """What one read returns for a user: the recent block, the fields read, the card count, the drift sums, the
    stored state, the scored reviews recorded (-1: unknown, a v3 header) and the user's FSRS-6 parameters."""

    stored: StoredState
    recent: np.ndarray  # ROW, oldest first, at most `size`
    cards: dict[str, np.ndarray]  # card id -> ROW, that card's last `card_size` reviews (only the cards read)
    n_cards: int
    drift: np.ndarray  # (2,) float64: (m, w)
    scored: int = 0
    fit: Fit = NO_FIT
    # the user's evidence for the network over FSRS-6's defaults (nats; TimeAwareTransformer.evidence_update), NaN
    # before any was recorded (the model's prior)
    evidence: float = math.nan

    def evidence_of(self, model: LoadedModel) -> float:
        """The user's evidence, or the model's prior (the manifest's `evidence.prior`; 0 for a model without it)."""
        return self.evidence if not math.isnan(self.evidence) else evidence_prior(model)

    def params(self, model: LoadedModel) -> np.ndarray:
        """(21,) float32: the user's FSRS-6 parameters, or the model's defaults before a fit."""
        return np.asarray(self.fit.w if self.fit.w is not None else default_params(model), dtype=np.float32)

    def day_start(self, model: LoadedModel) -> float:
        """Seconds after 00:00 UTC at which the user's scheduler days start: their own (`Fit.day_start`), else the
        model's `day_start_hour`."""
        return self.fit.day_start if self.fit.day_start is not None else default_day_start(model)

    def blob(self) -> bytes:
        """The stored form of this history's header and recent block (`_encode`; the fields are stored apart)."""
        return _encode(self.recent, self.n_cards, self.drift, self.scored, self.fit, self.evidence)

    @property
    def count(self) -> int:  # reviews so far = the next sequence number
        return int(self.recent["seq"][-1]) + 1 if len(self.recent) else 0

    @property
    def last_time(self) -> float | None:
        return float(self.recent["time"][-1]) if len(self.recent) else None


@dataclass(frozen=True)
class Moved:
    """A user's state for a layout, rebuilt from their state under another layout of the model (`carried`): the
    key it came from, the history (every card's field), the fields to write, and what the answer says of it."""

    source: str
    history: History
    fields: dict[str, bytes]
    said: dict


NOT_REBUILT = {"rebuilt_from_events": 0}


@dataclass(frozen=True)
class ShadowTurn:
    """A serving write's reviews, for a shadow rollout's candidate to follow (`follow_log`, off the request path):
    the serving layout (`schema`), the user's history before the write (its recent block, the fields of the cards
    written that had one, its header), the reviews written (ROW, errors NaN), their card ids and event ids, each
    one's window just before it under the serving layout, and which of them live quality scored for the serving
    version. `keep_up`: a canary's turn (SpacedRepetition.keep_up): unscored, for a state the candidate has."""

    schema: str
    before: History
    new: np.ndarray
    cards: tuple[str, ...]
    event_ids: tuple[str, ...]
    windows: tuple[np.ndarray, ...]
    scored: np.ndarray
    keep_up: bool = False

    @classmethod
    def of(cls, model: LoadedModel, history: History, new: np.ndarray, reviews: Sequence[Review],
           windows: Sequence[np.ndarray], scored: np.ndarray) -> ShadowTurn:
        cards = tuple(r.card_id for r in reviews)
        own = {card: history.cards[card] for card in dict.fromkeys(cards) if card in history.cards}
        rows = new.copy()
        rows["error"] = np.nan
        return cls(model.schema, replace(history, cards=own),
                   rows, cards, tuple(r.event_id for r in reviews if r.event_id is not None), tuple(windows),
                   scored)


def _same_row(a: np.void, b: np.void) -> bool:
    """Whether two stored rows are one review (its sequence number, card, time and rating)."""
    return all(a[name] == b[name] for name in ("seq", "card", "time", "rating"))


def _holds(rows: np.ndarray, row: np.void) -> bool:
    """Whether `rows` (ROW, in sequence order) hold that review."""
    at = np.searchsorted(rows["seq"], row["seq"])
    return bool(at < len(rows) and _same_row(rows[at], row))


def _merged(own: StoredState, recent: np.ndarray, fields: Mapping[str, bytes]
            ) -> tuple[np.ndarray, dict[str, bytes]] | None:
    """The reviews a lagging state holds (`own`, its whole record) and those another layout holds (its recent block
    and fields), together as a recent block and fields for `carried`, if they are one history: the state's last
    review is among the others. None if not."""
    from .refit import stored_rows

    lagging = _decode(StoredState(own.version, own.events, own.updated, own.blob))
    if not len(lagging.recent) or not _holds(stored_rows(recent, fields), lagging.recent[-1]):
        return None
    return (np.concatenate([lagging.recent, recent]),
            {card: own.fields.get(card, b"") + fields.get(card, b"") for card in {*own.fields, *fields}})


def _took(own: StoredState, held: np.ndarray, since: float) -> tuple[np.ndarray, list[str], StoredState] | None:
    """Of a candidate's state (`own`, its whole record), the reviews it took itself after those it shares with the
    serving layout (`held`: the reviews that holds, ROW in sequence order), where they are its last ones, all in its
    recent block, none before `since` (the time of the serving write's last review): those reviews (ROW), their
    card ids, and the record without them. None where it is not so (no such reviews; or another history)."""
    mine = _decode(StoredState(own.version, own.events, own.updated, own.blob))
    shared = np.array([_holds(held, row) for row in mine.recent], dtype=bool)
    if not len(shared) or shared.all() or not shared[0]:
        return None
    start = int(np.argmin(shared))  # (the first not shared)
    rows = mine.recent[start:]
    ids = {id_hash(card): card for card in own.fields}
    cards = [ids.get(int(card)) for card in rows["card"]]
    if shared[start:].any() or len(rows) != mine.count - int(rows["seq"][0]) or None in cards \
            or rows["time"].min() < since:
        return None
    first = int(rows["seq"][0])
    kept = {card: _rows(value)[_rows(value)["seq"] < first].tobytes() for card, value in own.fields.items()}
    return rows, cards, StoredState(own.version, own.events, own.updated,
                                    replace(mine, recent=mine.recent[:start]).blob(),
                                    fields=kept)


def _rows(blob: bytes | None, offset: int = 0) -> np.ndarray:
    if not blob:
        return np.zeros(0, dtype=ROW)
    if (len(blob) - offset) % ROW.itemsize:
        raise ValueError(f"stored reviews of {len(blob) - offset} bytes are not whole {ROW.itemsize}-byte rows")
    return np.frombuffer(blob, dtype=ROW, offset=offset)


def _decode(stored: StoredState) -> History:
    if stored.blob is None:
        return History(stored, np.zeros(0, dtype=ROW), {}, 0, np.zeros(2))
    blob = stored.blob
    tag = int(np.frombuffer(blob, dtype="<i8", count=1)[0]) if len(blob) >= 8 else 0
    with_params = tag in (HEADER_TAG, -5, -4)  # v6, v5 or v4 (v5: v4 and the day boundary; v6: and the evidence)
    layout = {HEADER_TAG: HEADER, -5: HEADER_V5, -4: HEADER_V4}.get(tag, HEADER_V3)
    if len(blob) < layout.itemsize:
        raise ValueError(f"stored reviews of {len(blob)} bytes are shorter than their {layout.itemsize}-byte header")
    header = np.frombuffer(blob, dtype=layout, count=1)[0]
    cards = {card: _rows(value) for card, value in stored.fields.items()}
    if not with_params:  # v3: before per-user parameters: the defaults, scored reviews unknown
        return History(stored, _rows(blob, layout.itemsize), cards, int(header["cards"]),
                       np.array(header["drift"], dtype=np.float64), -1)
    fitted = int(header["fitted_on"]) > 0
    day_start = float(header["day_start"]) if tag in (HEADER_TAG, -5) and not np.isnan(header["day_start"]) else None
    fit = Fit(tuple(float(x) for x in header["w"]), int(header["fitted_on"]), int(header["fitted_scored"]),
              float(header["fitted_at"]), day_start) if fitted else Fit(day_start=day_start)
    return History(stored, _rows(blob, layout.itemsize), cards, int(header["cards"]),
                   np.array(header["drift"], dtype=np.float64), int(header["scored"]), fit,
                   float(header["evidence"]) if tag == HEADER_TAG else math.nan)


def _encode(recent: np.ndarray, n_cards: int, drift: np.ndarray, scored: int = 0, fit: Fit = NO_FIT,
            evidence: float = math.nan) -> bytes:
    header = np.zeros(1, dtype=HEADER)
    header["tag"], header["cards"], header["drift"], header["scored"] = HEADER_TAG, n_cards, drift, scored
    header["evidence"] = evidence
    if fit.w is not None:
        header["w"], header["fitted_on"], header["fitted_scored"] = fit.w, fit.fitted_on, fit.fitted_scored
        header["fitted_at"] = fit.fitted_at if fit.fitted_at is not None else np.nan
    header["day_start"] = fit.day_start if fit.day_start is not None else np.nan
    return header.tobytes() + np.ascontiguousarray(recent, dtype=ROW).tobytes()


async def _done(answer: dict) -> dict:
    return answer


def default_params(model: LoadedModel) -> tuple[float, ...]:
    """The FSRS-6 parameters a user of `model` starts with: the manifest's `fsrs6.parameters`, else fsrs-rs's
    defaults."""
    w = (model.manifest.get("fsrs6") or {}).get("parameters")
    return tuple(float(x) for x in w) if w and len(w) == N_PARAMS else DEFAULT_FSRS6


def evidence_prior(model: LoadedModel) -> float:
    """The evidence a new user of `model` starts with: the manifest's `evidence.prior` (0 without a mixture)."""
    return float((model.manifest.get("evidence") or {}).get("prior", 0.0))


def default_day_start(model: LoadedModel) -> float:
    """Seconds after 00:00 UTC at which a user's scheduler days start unless told: the manifest's
    `model_config.day_start_hour` (the one user's own for a single-user artifact), else 4 (Anki's rollover)."""
    return float((model.manifest.get("model_config") or {}).get("day_start_hour", 4.0)) * 3600.0


def window(model: LoadedModel, history: History, card_id: str) -> np.ndarray:
    """The rows (ROW, oldest first) the model sees for a query on `card_id` after the user's reviews so far,
    chosen by review_window.select from the recent block and the card's own rows."""
    size, card_size = model.extra.window
    n, recent = history.count, history.recent
    card_rows = history.cards.get(card_id, np.zeros(0, dtype=ROW))
    seqs = select(card_rows["seq"], n, size, card_size)
    first_recent = n - len(recent)
    if len(recent) != min(n, size) or (len(recent) and int(recent["seq"][0]) != first_recent):
        # a state rebuilt from narrower windows (`carried`) lacks reviews the store no longer held, until newer
        # ones replace them: the window is the rows it has of those the rule picks
        held = np.concatenate([card_rows, recent])
        _, first = np.unique(held["seq"], return_index=True)
        held = held[first]
        return held[np.isin(held["seq"], seqs)]
    older = seqs[seqs < first_recent]  # only the card's rows can be older than the recent block
    at = np.searchsorted(card_rows["seq"], older)
    if len(older) and not np.array_equal(card_rows["seq"][np.minimum(at, len(card_rows) - 1)], older):
        raise RuntimeError(f"stored reviews of card {card_id!r} lack rows {older.tolist()} that the window needs")
    return np.concatenate([card_rows[at], recent[seqs[seqs >= first_recent] - first_recent]])


def _tail(rows: np.ndarray, size: int) -> np.ndarray:
    """The rows (ROW, in sequence order) of the user's last `size` reviews: the recent block."""
    return rows[rows["seq"] > rows["seq"][-1] - size] if len(rows) else rows


def carried(recent: np.ndarray, fields: Mapping[str, bytes], window: tuple[int, int]
            ) -> tuple[np.ndarray, dict[str, np.ndarray], int]:
    """A user's stored reviews under another layout (its recent block and every card's field) laid out for `window`
    (size, card_size): (the new recent block: the reviews held of the last `size`; each card's new field: the
    reviews held of its last `card_size`; how many distinct reviews were held). A card's reviews are those of its
    field and those of the recent block with its id's hash. Where the new windows are no larger than the old,
    every review they keep was held, and the result is what the new layout would have stored."""
    from .refit import stored_rows

    rows = stored_rows(recent, fields)  # every review held, once, in sequence order
    size, card_size = window
    order = np.argsort(rows["card"], kind="stable")  # by card, each card's in sequence order
    by_card = rows["card"][order]
    cards = {}
    for card in fields:
        h = id_hash(card)
        own = rows[order[np.searchsorted(by_card, h, "left"):np.searchsorted(by_card, h, "right")]]
        cards[card] = own[max(len(own) - card_size, 0):] if card_size else own[:0]
    return _tail(rows, size), cards, len(rows)


def _log_loss(p: np.ndarray, recalled: np.ndarray) -> np.ndarray:
    """-log P(the outcome) with P(recall) p clipped to [1e-6, 1 - 1e-6] (TimeAwareTransformer's recall_log_loss)."""
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-6, 1 - 1e-6)
    return -np.where(recalled, np.log(p), np.log1p(-p))


def network_weight(evidence):
    """The mixture's weight on the network for evidence E (nats): sigmoid(E); FSRS-6's defaults get the rest."""
    return 1.0 / (1.0 + np.exp(-np.asarray(evidence, dtype=np.float64)))


def _width(rows: int, size: int) -> int:
    """Columns to pad a window of `rows` (<= size) to: the next power of two, at least 8 and at most `size`, so
    that requests with windows of similar lengths can share an ONNX Runtime call."""
    return max(1, min(size, 1 << max(3, (max(rows, 1) - 1).bit_length())))


def history_feeds(windows: Sequence[np.ndarray], width: int, drift: np.ndarray,
                  params: np.ndarray | None = None, day_start: float | None = None,
                  evidence: float | None = None) -> dict[str, np.ndarray]:
    """The graph's hist_* inputs for these windows, each left-padded (hist_valid False) to `width` columns, and the
    user's drift sums (2,), FSRS-6 parameters (21,), day boundary (seconds after 00:00 UTC) and evidence for every
    window (parameters, day boundary or evidence None: not fed, the graph's defaults, for a test's graph without the
    input; a graph exported before the day boundary or the evidence was an input ignores it)."""
    out = {f"hist_{name}": np.full((len(windows), width), fill, dtype=dtype) for name, (fill, dtype) in _PAD.items()}
    out["hist_valid"] = np.zeros((len(windows), width), dtype=bool)
    for i, w in enumerate(windows):
        if len(w):
            for name in _PAD:
                out[f"hist_{name}"][i, width - len(w):] = w[name]
            out["hist_valid"][i, width - len(w):] = True
    out["drift"] = np.tile(np.asarray(drift, dtype=np.float32), (len(windows), 1))
    if params is not None:
        out["fsrs_w"] = np.tile(np.asarray(params, dtype=np.float32), (len(windows), 1))
    if day_start is not None:
        out["day_start"] = np.full(len(windows), day_start, dtype=np.float64)
    if evidence is not None:
        out["evidence"] = np.full(len(windows), evidence, dtype=np.float32)
    return out


def user_feeds(model: LoadedModel, windows: Sequence[np.ndarray], history: History) -> dict[str, np.ndarray]:
    """history_feeds for these windows of one user, padded to a shared width (`_width` of the longest), with the
    user's drift sums, FSRS-6 parameters, day boundary and evidence from `history`."""
    return history_feeds(windows, _width(max(len(w) for w in windows), model.extra.window[0]), history.drift,
                         history.params(model), history.day_start(model), history.evidence_of(model))


def _new_rows(reviews: Sequence[Review], first_seq: int) -> np.ndarray:
    rows = np.zeros(len(reviews), dtype=ROW)
    rows["seq"] = np.arange(first_seq, first_seq + len(reviews))
    rows["card"] = [id_hash(r.card_id) for r in reviews]
    rows["deck"] = [id_hash(r.deck_id) for r in reviews]
    rows["time"] = [r.time for r in reviews]
    rows["duration"] = [np.nan if r.duration is None else r.duration for r in reviews]
    rows["rating"] = [r.rating for r in reviews]
    rows["state"] = [-1 if r.state is None else r.state for r in reviews]
    rows["error"] = np.nan  # until `_drift` knows it
    return rows


def check_reviews(reviews: Sequence[Review], field: str = "reviews") -> None:
    """What a review must be, whatever the stored history: the field of the first fault is named."""
    previous = -math.inf
    for i, r in enumerate(reviews):
        at = f"{field}[{i}]"
        if not r.card_id:
            raise InvalidInput(f"{at}.card_id", "must not be empty")
        if not isinstance(r.rating, int) or not 1 <= r.rating <= 4:
            raise InvalidInput(f"{at}.rating", f"{r.rating!r} is not a rating 1..4 (Again, Hard, Good, Easy)")
        check_time(r.time, f"{at}.time")
        if r.time < previous:
            raise InvalidInput(f"{at}.time", f"{r.time!r} is before the previous review's {previous!r}: reviews "
                                             "must be in time order")
        previous = r.time
        if r.duration is not None and not (math.isfinite(r.duration) and 0 <= r.duration <= 1e6):
            raise InvalidInput(f"{at}.duration", f"{r.duration!r} is not a duration in seconds (0..1e6)")
        if r.state is not None and not 0 <= r.state <= 3:
            raise InvalidInput(f"{at}.state", f"{r.state!r} is not a card state 0..3")


class SpacedRepetition(StatefulTask):
    TASK, PREFIX = SPEC.name, "srs"
    refits = None  # srs_refit.RefitWorker: queues users due a fit after a write (None: NEXTSTEP_SRS_REFIT off)
    fitter = None  # where `refit` runs fsrs-rs: srs_refit.FitProcess (the worker's), or None: a thread

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

    def layouts(self, model: LoadedModel) -> list[tuple[str, tuple[int, int]]]:
        """(schema, window) of the model's other stored layouts the registry knows (its loaded versions with other
        window sizes), newest version first, each once."""
        seen, out = {model.schema}, []
        versions = [m for m in self.registry.models() if m.name == model.name and m.task == self.TASK]
        for m in sorted(versions, key=lambda m: (str(m.manifest.get("created")), m.version), reverse=True):
            if m.schema not in seen:
                seen.add(m.schema)
                out.append((m.schema, m.extra.window))
        return out

    def _key_of(self, model: LoadedModel, schema: str, user_id: str) -> str:
        """The user's key under a layout (`schema`) of the model: `key` is the one of the model's own layout."""
        return f"{self.PREFIX}:{model.name}:{schema}:{user_id}"

    async def _rebuild(self, model: LoadedModel, user_id: str, target: StoredState) -> Moved | None:
        """The user's state for `model`'s layout (which has none: `target`) rebuilt from their state under the
        newest other layout that has one (`layouts`), or None when none has: its reviews laid out for this
        layout's windows (`carried`), its card count, drift sums, scored count and FSRS-6 parameters carried over.
        What the answer says: `rebuilt_from_events` (the reviews read), and, where this layout's windows are larger,
        `reviews_not_held`: the user's reviews the old layout no longer held (the new windows lack them until newer
        reviews replace them)."""
        for schema, old_window in self.layouts(model):
            source = self._key_of(model, schema, user_id)
            stored = await self.store.read_all(source)
            if not stored.exists or not stored.blob:
                continue
            old = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
            if not len(old.recent):
                continue
            recent, cards, held = carried(old.recent, stored.fields, model.extra.window)
            said = {"rebuilt_from_events": held}
            size, card_size = model.extra.window
            if (size > old_window[0] or card_size > old_window[1]) and old.count > held:
                said["reviews_not_held"] = old.count - held
            history = replace(old, stored=target, recent=recent, cards=cards)
            return Moved(source, history, {card: rows.tobytes() for card, rows in cards.items()}, said)
        return None

    async def _carry(self, model: LoadedModel, user_id: str, target: StoredState) -> dict:
        """Store the user's state for `model`'s layout (which has none: `target`) rebuilt from another layout's
        (`_rebuild`), with a compare-and-set that holds only if it still has none; what the answer says of it
        (`rebuilt_from_events` 0: nothing to rebuild, or another request stored a state first)."""
        moved = await self._rebuild(model, user_id, target)
        if moved is None:
            return NOT_REBUILT
        written = await self.store.compare_and_set(self.key(model, user_id), target.version, moved.history.blob(),
                                                   moved.history.count, fields=moved.fields)
        return moved.said if written is not None else NOT_REBUILT

    async def _history(self, model: LoadedModel, user_id: str, cards: Sequence[str]) -> tuple[History, dict]:
        """(the user's history for `model` with the fields of `cards`, what the answer says of a rebuild): a user
        without a state under this layout but with one under another has it rebuilt and stored first."""
        key = self.key(model, user_id)
        history = await self._read(key, cards)
        if history.stored.exists:
            return history, NOT_REBUILT
        said = await self._carry(model, user_id, history.stored)
        return (await self._read(key, cards) if said["rebuilt_from_events"] else history), said

    async def to_migrate(self, model: LoadedModel, cursor: str = "0", count: int = 500) -> tuple[str, list[str]]:
        """A step of a walk over the users stored under the model's other layouts (`layouts`), one layout after the
        other: the cursor is "<schema>/<the store's cursor>" ("0": start, and once the walk is over)."""
        schemas = [schema for schema, _ in self.layouts(model)]
        if cursor == "0":
            at, inner = 0, "0"
        else:
            schema, sep, inner = cursor.partition("/")
            if not sep or schema not in schemas:
                raise ValueError(f"not a migration cursor of model {model.name}: {cursor!r}")
            at = schemas.index(schema)
        if at >= len(schemas):
            return "0", []
        prefix = self._key_of(model, schemas[at], "")
        following, keys = await self.store.scan(prefix, inner, count)
        if following == "0":
            following = f"{schemas[at + 1]}/0" if at + 1 < len(schemas) else "0"
        else:
            following = f"{schemas[at]}/{following}"
        return following, [k[len(prefix):] for k in keys]

    async def catch_up(self, model: LoadedModel, entity: str) -> tuple[int, bool]:
        """A user stored under another layout given a state under `model`'s (rebuilt from the newest other layout
        that has one): (reviews it was rebuilt from, True). A user who has one already costs two reads, and has it
        brought up to date where it lags (`_refresh`): (reviews it took, whether it is stored)."""
        stored = await self.store.get(self.key(model, entity))
        if stored.exists:
            return await self._refresh(model, entity, stored)
        return (await self._carry(model, entity, stored))["rebuilt_from_events"], True

    async def _refresh(self, model: LoadedModel, user_id: str, stored: StoredState) -> tuple[int, bool]:
        """The user's state under `model`'s layout (`stored`) brought up to date with their state under the newest
        other layout that has one, where it lags it: that one has more reviews, among them this one's last (the same
        history, which went on under the other layout: a shadow's state after an abort, or after a dropped turn; a
        user back on an older layout). The reviews of both, laid out for this layout's windows (`carried`), with the
        other's header, stored with a compare-and-set. (reviews it took, False when another write came first.)"""
        for schema, _ in self.layouts(model):
            source = self._key_of(model, schema, user_id)
            other = await self.store.get(source)
            if other.exists and other.blob:
                break
        else:
            return 0, True
        if _decode(other).count <= _decode(stored).count:
            return 0, True
        whole = await self.store.read_all(source)
        theirs = _decode(StoredState(whole.version, whole.events, whole.updated, whole.blob))
        own = await self.store.read_all(self.key(model, user_id))
        merged = _merged(own, theirs.recent, whole.fields)
        if merged is None:  # (another history: left as it is)
            return 0, True
        recent, cards, _ = carried(*merged, model.extra.window)
        written = await self.store.compare_and_set(
            self.key(model, user_id), own.version, replace(theirs, recent=recent).blob(), theirs.count - own.events,
            fields={card: rows.tobytes() for card, rows in cards.items()})
        return (theirs.count - own.events, True) if written is not None else (0, False)

    async def delete(self, model_name: str, entity: str) -> bool:
        """Delete the user's reviews under every layout of the model the registry knows (else another layout's would
        be rebuilt on their next request)."""
        model = self.model(model_name)
        keys = [self.key(model, entity)] + [self._key_of(model, schema, entity) for schema, _ in self.layouts(model)]
        return any([await self.store.delete(key) for key in keys])

    async def _run(self, model: LoadedModel, hist: dict[str, np.ndarray], which: np.ndarray, cards: np.ndarray,
                   decks: np.ndarray, times: np.ndarray, graph: str = "predict", background: bool = False,
                   **extra: np.ndarray) -> dict[str, np.ndarray]:
        """The graph's outputs for queries (cards[i], decks[i], times[i], and extra[name][i]) on the windows
        hist[which[i]], in calls of at most MAX_CELLS history cells (a big schedule neither builds nor runs one
        huge batch). `background`: work no request waits for (a shadow's turn), never run inline."""
        names = [o.name for o in model.sessions[graph].get_outputs()]
        step = max(1, MAX_CELLS // hist["hist_valid"].shape[1])
        parts = []
        for lo in range(0, len(which), step):
            rows = which[lo:lo + step]
            feed = {name: value[rows] for name, value in hist.items()}
            feed.update(card=cards[lo:lo + step], deck=decks[lo:lo + step], time=times[lo:lo + step],
                        **{name: value[lo:lo + step] for name, value in extra.items()})
            outs = await self.engines.run(model, graph, feed, background=background)
            parts.append(dict(zip(names, outs, strict=True)))
        return {name: np.concatenate([p[name] for p in parts]) for name in names}

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
        out = await self._predict(model, [rows], hist, np.zeros(1, dtype=np.int64),
                                  np.array([id_hash(card_id)]), np.array([id_hash(deck_id)]),
                                  np.array([at], dtype=np.float64))
        probs = out["rating_probs"][0].tolist()
        return {"card_id": card_id, "deck_id": deck_id, "time": at,
                "p_rating": {str(k + 1): p for k, p in enumerate(probs)}, "p_recall": float(out["recall"][0]),
                "expected_duration_s": float(out["duration_s"][0]), "history_used": len(rows),
                "card_reviews": int(np.count_nonzero(rows["card"] == id_hash(card_id)))}

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
                                         scored_now)
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

    @operation
    async def simulate(self, model_name: str, user_id: str, cards: list[tuple[str, str]] | None, retentions:
                       list[float], days: int, new_cards: int = 0, new_cards_per_day: int = 20,
                       now: float | None = None, seed: int = 0, max_cards: int = 10_000) -> dict:
        """Expected reviews and minutes a day over the next `days` days at each desired retention, for the user's
        deck: `cards` (their stored reviews; a card without any is new), or every card the user has reviewed when
        None, plus `new_cards` never-reviewed cards; new cards are introduced `new_cards_per_day` a day
        (srs_simulate.py: FSRS-6 between reviews, stretched to the model's own intervals, the model's answer
        times)."""
        model = self.model(model_name, user_id)
        if not 1 <= len(retentions) <= SIMULATE_MAX_RETENTIONS:
            raise InvalidInput("desired_retentions", f"{len(retentions)} retentions; 1 to {SIMULATE_MAX_RETENTIONS}")
        low, high = SIMULATE_RETENTIONS
        for i, r in enumerate(retentions):
            if not low <= r <= high:
                raise InvalidInput(f"desired_retentions[{i}]", f"{r!r} is not a retention {low}..{high}")
        if len(set(retentions)) != len(retentions):
            raise InvalidInput("desired_retentions", "the retentions must differ")
        if not 1 <= days <= SIMULATE_MAX_DAYS:
            raise InvalidInput("days", f"{days!r} is not a number of days 1..{SIMULATE_MAX_DAYS}")
        if new_cards < 0 or new_cards_per_day < 0:
            raise InvalidInput("new_cards" if new_cards < 0 else "new_cards_per_day", "must be >= 0")
        if cards is not None:
            for i, (card, _) in enumerate(cards):
                if not card:
                    raise InvalidInput(f"cards[{i}].card_id", "must not be empty")
        if model.extra.window[1] == 0 and cards is None:
            raise InvalidInput("cards", "this model keeps no per-card reviews (card window 0): give the cards")
        if now is not None:
            check_time(now, "now")
        key = self.key(model, user_id)

        async def read() -> tuple[StoredState, list[str]]:
            if cards is None:  # every card the user has: their fields, decoded together below
                stored = await self.store.read_all(key)
                return stored, list(stored.fields)
            asked = list(dict.fromkeys(c for c, _ in cards))
            return (await self.store.read(key, fields=asked))[0], asked

        stored, asked = await read()
        said = NOT_REBUILT
        if not stored.exists:
            said = await self._carry(model, user_id, stored)
            if said["rebuilt_from_events"]:
                stored, asked = await read()
        history = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
        fields = stored.fields
        reviewed = [c for c in asked if fields.get(c)]
        data = [fields[c] for c in reviewed]
        n_new = new_cards + len(asked) - len(reviewed)
        if len(reviewed) + n_new > max_cards:
            raise TooLarge("cards", f"{len(reviewed)} reviewed and {n_new} new cards; at most {max_cards} per "
                                    "simulation (NEXTSTEP_SRS_MAX_SIMULATE_CARDS): give the cards to simulate")
        paths = max(len(reviewed) + n_new, MIN_PATHS)  # a small deck is simulated as several replicas
        if paths * len(retentions) * days > SIMULATE_MAX_WORK:
            raise InvalidInput("days", f"{days} days x {len(retentions)} retentions x {paths} cards (at least "
                                       f"{MIN_PATHS}) is over {SIMULATE_MAX_WORK:,}: simulate fewer days, retentions "
                                       "or cards")
        now = self._query_time(history, now, "now")
        fsrs = FSRS6.of(history.params(model).astype(np.float64))  # the user's own parameters
        day_start = history.day_start(model)

        def day(t) -> np.ndarray:
            return np.floor((np.asarray(t, dtype=np.float64) - day_start) / 86400.0)

        # every reviewed card's rows at once: its last card_size reviews, the rows the network's FSRS-6 anchor reads
        lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
        if np.any(lengths % ROW.itemsize):
            raise ValueError(f"stored reviews of user {user_id!r} are not whole {ROW.itemsize}-byte rows")
        lengths //= ROW.itemsize
        rows = np.frombuffer(b"".join(data), dtype=ROW)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        width = int(lengths.max()) if len(lengths) else 1
        owner = np.repeat(np.arange(len(reviewed)), lengths)
        column = width - lengths[owner] + np.arange(len(rows)) - starts[owner]
        rating, when = np.ones((len(reviewed), width)), np.zeros((len(reviewed), width))
        present = np.zeros((len(reviewed), width), dtype=bool)
        rating[owner, column], when[owner, column], present[owner, column] = rows["rating"], day(rows["time"]), True
        stability, difficulty = fsrs.memory_state(rating, when, present)
        last_time = rows["time"][ends - 1] if len(reviewed) else np.zeros(0)
        last_day = (day(last_time) - day(now)).astype(np.int64)
        retention = np.asarray(retentions, dtype=np.float64)
        curve, review_s, new_s, sampled = await self._calibrate(model, history, (rows, starts, ends), reviewed,
                                                                 stability, last_time, now, retention, fsrs, seed)
        ratio = curve.interval(1.0, retention) / fsrs.interval(1.0, retention)
        recent = history.recent
        first = np.bincount(recent["rating"][recent["state"] == 0].astype(np.int64) - 1, minlength=4)[:4]
        recalled = np.bincount(recent["rating"][recent["rating"] > 1].astype(np.int64) - 2, minlength=3)[:3]
        max_interval = max(1, int(self.max_interval_days))
        out = run_simulation(fsrs, retentions=retention, days=days, curve=curve, review_s=review_s, new_s=new_s,
                             stability=stability, difficulty=difficulty, last_day=last_day, n_new=n_new,
                             new_per_day=new_cards_per_day, first_shares=shares(first, DEFAULT_FIRST),
                             recalled_shares=shares(recalled, DEFAULT_RECALLED), max_interval=max_interval, seed=seed)
        results = []
        for j, r in enumerate(retentions):
            reviews, minutes = out["reviews"][j], out["seconds"][j] / 60.0
            results.append({
                "desired_retention": r, "reviews_per_day": np.round(reviews, 3).tolist(),
                "minutes_per_day": np.round(minutes, 3).tolist(), "total_reviews": float(reviews.sum()),
                "total_minutes": float(minutes.sum()), "mean_minutes_per_day": float(minutes.mean()),
                "recalled_at_end": float(out["recalled_at_end"][j]),
                "interval_ratio_to_fsrs6": float(ratio[j]), "seconds_per_review": float(review_s[j])})
        return {"user_id": user_id, "model": model.name, "version": model.version, "now": now, "days": days,
                "cards": len(reviewed), "new_cards": n_new, "new_cards_introduced": int(out["introduced"]),
                "new_cards_per_day": new_cards_per_day, "seconds_per_new_card": new_s, "sampled_cards": sampled,
                "model_curve": {"stretch": curve.stretch, "decay": curve.decay},
                "replicas": int(out["replicas"]), "seed": seed, "max_interval_days": max_interval,
                "reviews_total": history.stored.events, **said, "retentions": results}

    async def _calibrate(self, model: LoadedModel, history: History, deck: tuple[np.ndarray, np.ndarray, np.ndarray],
                         reviewed: list[str], stability: np.ndarray, last_time: np.ndarray, now: float,
                         retention: np.ndarray, fsrs: FSRS6, seed: int) -> tuple[ModelCurve, np.ndarray, float, int]:
        """The model's own curve and answer times on a sample of the deck: (the model's forgetting curve on FSRS-6's
        stability (srs_simulate.ModelCurve) through the median ratios of the model's intervals to FSRS-6's at the
        lowest and the highest retention asked for; seconds per review at each retention (the model's answer time at
        the due, averaged over the sample, interpolated between those two linearly in log(r^(-1/decay) - 1)); seconds
        for a new card's first review; the number of cards sampled). Two graph calls of at most
        SIMULATE_SAMPLE_ROWS + 1 rows, whatever the deck's size."""
        probes = np.unique(retention[[np.argmin(retention), np.argmax(retention)]])
        take = min(len(reviewed), max(1, SIMULATE_SAMPLE_ROWS // len(probes)))
        pick = np.sort(np.random.default_rng(seed).choice(len(reviewed), size=take, replace=False)) if take else \
            np.zeros(0, dtype=np.int64)
        fresh = "\x00simulate: a card never reviewed"
        rows, starts, ends = deck  # every reviewed card's stored rows, card i's at starts[i]:ends[i]
        own = {i: rows[starts[i]:ends[i]] for i in pick}
        windows = [window(model, replace(history, cards={reviewed[i]: own[i]}), reviewed[i]) for i in pick]
        windows.append(window(model, history, fresh))
        hist = user_feeds(model, windows, history)
        new = await self._predict(model, windows, hist, np.array([take]), np.array([id_hash(fresh)]),
                                  np.array([id_hash("")]), np.array([now], dtype=np.float64))
        new_s = float(new["duration_s"][0])
        if not take:
            return ModelCurve(1.0, fsrs.decay), np.full(len(retention), new_s), new_s, 0
        which = np.tile(np.arange(take), len(probes))
        ids = np.array([id_hash(reviewed[i]) for i in pick], dtype=np.int64)
        decks = np.array([own[i]["deck"][-1] for i in pick], dtype=np.int64)
        out = await self._run(model, hist, which, ids[which], decks[which], np.full(len(which), now), graph="schedule",
                              retention=np.repeat(probes, take).astype(np.float32))
        since = np.tile((now - last_time[pick]) / 86400.0, len(probes))
        s_card = np.tile(stability[pick], len(probes))
        wait = np.expm1(out["log_wait_days"].astype(np.float64))
        # each card's ratio: where the model schedules it, its interval over FSRS-6's; where it is due already, the
        # stretch of FSRS-6's curve that passes through the model's recall now (the interval alone would only bound it)
        ratio = (since + wait) / np.maximum(fsrs.interval(s_card, np.repeat(probes, take)), 1e-9)
        p_now = np.clip(out["recall"].astype(np.float64), 1e-6, 1 - 1e-6)
        through = fsrs.factor * since / (s_card * (np.power(p_now, -1.0 / fsrs.decay) - 1.0))
        ratio = np.where(wait > 0, ratio, np.where(since > 0, through, np.nan)).reshape(len(probes), take)
        median = [float(np.median(r[np.isfinite(r)])) if np.isfinite(r).any() else 1.0 for r in ratio]
        curve = ModelCurve.through(fsrs, [float(r) for r in probes], [max(m, 1e-6) for m in median])
        seconds = out["duration_s"].astype(np.float64).reshape(len(probes), take).mean(axis=1)
        if len(probes) == 1:
            return curve, np.full(len(retention), seconds[0]), new_s, take

        def scale(r):
            return np.log(np.power(r, -1.0 / fsrs.decay) - 1.0)

        at = (scale(retention) - scale(probes[0])) / (scale(probes[1]) - scale(probes[0]))
        return curve, seconds[0] + at * (seconds[1] - seconds[0]), new_s, take

    @staticmethod
    def _due(card: tuple[str, str], status: str, now: float, due: float, recall, duration) -> dict:
        return {"card_id": card[0], "deck_id": card[1], "status": status, "due": float(due),
                "interval_days": (float(due) - now) / 86400.0, "p_recall_at_due": float(recall),
                "expected_duration_s": float(duration)}

    # ------------------------------------------------------------------ shadow rollouts (off the request path)

    def keep_up(self, model: LoadedModel, user_id: str, events: int, turn: Callable[[], ShadowTurn]) -> None:
        """After a write of `events` reviews through `model` while a candidate of another layout is a canary (the
        write's user outside its fraction): queue a turn for the candidate (`follow_log`, as a shadow's, unscored)
        in which its state of the user, if it has one (a shadow's, say), takes the reviews, so that it has them if
        the candidate serves the user later (a wider fraction, a promotion). A user it has no state for is rebuilt
        from the serving layout's on their first request to it. A full queue drops the turn (counted)."""
        rollout = self.rollouts.current.get(model.name) if self.rollouts is not None else None
        if (rollout is None or rollout.mode != "canary" or rollout.candidate in (None, model.version) or not events
                or self.shadows is None):
            return
        try:
            candidate = self.registry.get(model.name, rollout.candidate, task=self.TASK)
        except UnknownModel:  # (withdrawn meanwhile)
            return
        if candidate.schema == model.schema:  # (the reviews are shared)
            return
        self.queue_turn(model.name, rollout.candidate, user_id, lambda: replace(turn(), keep_up=True))

    async def follow_log(self, model: LoadedModel, user_id: str, turn: ShadowTurn) -> bool:
        """A shadow turn: the candidate `model`'s P(recall) of the reviews a serving write recorded (`turn`), each
        from its window just before it, scored for live quality (role "shadow") on the reviews the serving version's
        were scored on. Of the serving layout, the reviews are shared: scoring is all there is to do, from the
        windows the serving version read, under the user's drift sums and FSRS-6 parameters as they were. Of
        another layout, the candidate's own state of the user takes the reviews too (`_follow`). Whether its state
        was stored (or had nothing to store)."""
        new, scored = turn.new, turn.scored
        if model.schema != turn.schema:
            return await self._follow(model, user_id, turn)
        if scored.any():
            windows = turn.windows
            hist = user_feeds(model, windows, turn.before)
            out = await self._predict(model, windows, hist, np.arange(len(new)),
                                      *(np.ascontiguousarray(new[f]) for f in ("card", "deck", "time")),
                                      background=True)
            self._score_shadow(model, out["recall"].astype(np.float64), new, scored)
        return True

    async def _follow(self, model: LoadedModel, user_id: str, turn: ShadowTurn) -> bool:
        """A shadow turn of a candidate of another layout: the reviews appended to its state of the user, as a write
        through it would append them (its windows, its drift, the user's FSRS-6 parameters as the serving layout
        holds them), with their event ids, and its P(recall) of each scored. A state that does not end where the
        serving one did before the write (none yet, a turn dropped, a shadow stopped and started again) is rebuilt
        first from the serving layout's state as it was before the write (`_before_write`); when that state has
        moved on since, the turn stores nothing and the user's next one rebuilds. A state that took reviews of its
        own after the write's place (the candidate began answering the user, a canary or a promotion, while this
        turn waited) has them recorded again after the write's (`_took`), so that none is lost. A compare-and-set on
        the candidate's key: whether it held. A canary's turn (`keep_up`) stores nothing for a user the candidate
        has no state of, and scores nothing."""
        key, new = self.key(model, user_id), turn.new
        first = int(new["seq"][0])
        stored, _ = await self.store.read(key, fields=list(dict.fromkeys(turn.cards)))
        if turn.keep_up and not stored.exists:
            return True
        history, fields, took = _decode(stored), {}, None
        if stored.exists and history.count >= first + len(new) and _holds(history.recent, new[-1]):
            return True  # (it has them: rebuilt after the write)
        before = turn.before.recent
        if not (stored.exists and history.count == first
                and (_same_row(history.recent[-1], before[-1]) if len(before) else not len(history.recent))):
            rebuilt = await self._before_write(model, user_id, turn, stored)
            if rebuilt is None:
                return True
            history, fields, took = rebuilt
        history = replace(history, fit=turn.before.fit)  # the parameters and day boundary the serving layout holds
        after, touched, recall = await self._append(model, history, new, turn.cards)
        if took is not None:  # (the candidate's own reviews, after the write's)
            rows, cards = took
            rows = rows.copy()
            rows["seq"] = np.arange(after.count, after.count + len(rows))
            after, later, _ = await self._append(model, after, rows, cards)
            touched.update(later)
        written = await self.store.compare_and_set(key, stored.version, after.blob(), after.count - stored.events,
                                                   list(turn.event_ids),
                                                   fields={**fields, **{c: r.tobytes() for c, r in touched.items()}})
        if written is None:
            return False
        if not turn.keep_up:
            self._score_shadow(model, recall, new, turn.scored)
        return True

    async def _before_write(self, model: LoadedModel, user_id: str, turn: ShadowTurn, target: StoredState
                            ) -> tuple[History, dict[str, bytes], tuple[np.ndarray, list[str]] | None] | None:
        """The user's state under `model`'s layout as it would have been just before the serving write of `turn`
        (its state `target` is missing or lags), the fields to write, and the reviews that state took itself
        after the write's place (`_took`: to record again after the write's; None: none). The state: the
        reviews the serving layout held then, with those the lagging state holds if it is a part of the same history
        (its last review, but for those it took, among those held then; else it is replaced, its other cards
        emptied), laid out for this layout's windows (`carried`), with
        the serving header as it was. The reviews held then: the recent block and the written cards' fields as the
        turn kept them, and every other card's field as the serving layout holds it now, which the write left as
        it was. None when the serving state holds other reviews than those up to the write's now (another write came
        since: its own turn rebuilds; or none)."""
        now = await self.store.read_all(self._key_of(model, turn.schema, user_id))
        source = _decode(StoredState(now.version, now.events, now.updated, now.blob))  # (the fields as they are)
        new, b = turn.new, turn.before
        first = int(new["seq"][0])
        if source.count != first + len(new) or not _holds(source.recent, new[-1]):
            return None
        written = set(turn.cards)
        held = {card: rows for card, rows in now.fields.items() if card not in written}
        held.update({card: rows.tobytes() for card, rows in b.cards.items()})
        recent, emptied, took = b.recent, {}, None
        if target.exists:
            from .refit import stored_rows

            own = await self.store.read_all(self.key(model, user_id))
            took = _took(own, stored_rows(b.recent, held), float(new["time"][-1]))
            merged = _merged(own if took is None else took[2], b.recent, held)  # (wider windows keep what it held)
            if merged is not None:
                recent, held = merged
            else:
                emptied, took = {card: b"" for card in own.fields if card not in held}, None
        recent, cards, _ = carried(recent, held, model.extra.window)
        if (int(recent["seq"][-1]) + 1 if len(recent) else 0) != first:
            return None
        return (replace(b, stored=target, recent=recent, cards=cards),
                {**emptied, **{card: rows.tobytes() for card, rows in cards.items()}}, took and took[:2])

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

    def _score_shadow(self, model: LoadedModel, recall: np.ndarray, new: np.ndarray, scored: np.ndarray) -> None:
        """Live quality of a shadow: its P(recall) of the reviews the serving version's was scored on."""
        keep = scored & ~np.isnan(recall)
        if self.quality is not None and keep.any():
            p = recall[keep]
            self.quality.record(model.name, model.version, np.stack([1 - p, p], axis=1),
                                (new["rating"][keep] > 1).astype(np.int64), "shadow")

    # ------------------------------------------------------------------ refits (off the request path)

    def refit_due(self, scored: int, fit: Fit) -> bool:
        """Whether a user with `scored` scored reviews and this fit is due one: a first fit once they have
        refit_min_scored, then again every refit_every_scored more."""
        return self._fit_due(fit)(scored)

    def _fit_due(self, fit: Fit):
        from ...training.srs.stored_fit import Due

        return Due(self.refit_min_scored, self.refit_every_scored, None if fit.w is None else fit.fitted_scored)

    def background(self, settings, metrics) -> list:
        """The tasks this service runs beside the requests (lifespan.py starts them, and cancels them at shutdown):
        the refit worker (srs_refit.start_refits; none when NEXTSTEP_SRS_REFIT is off)."""
        from .refit import start_refits

        return start_refits(self, settings, metrics)

    async def refit(self, model_name: str, user_id: str, *, force: bool = False, now: float | None = None) -> dict:
        """Fit the user's FSRS-6 parameters on their stored reviews (srs_refit.fit_held: the evaluation protocol's
        fit, fsrs-rs, in `fitter`) when one is due (`refit_due`; `force`: whatever the counts), and store them
        with a compare-and-set of the header (reviews recorded meanwhile stay). Not a request's work: the refit
        worker (srs_refit.RefitWorker) and `nextstep srs refit` run it. Returns what it did."""
        from .refit import fit_held

        model = self.model(model_name, user_id)
        key = self.key(model, user_id)
        header = _decode(await self.store.get(key))
        if not header.stored.exists and (await self._carry(model, user_id, header.stored))["rebuilt_from_events"]:
            header = _decode(await self.store.get(key))  # (rebuilt from another layout's state)
        out = {"user_id": user_id, "model": model.name, "refitted": False}
        if not header.stored.exists:
            return {**out, "reason": "no reviews"}
        if not force and header.scored >= 0 and not self.refit_due(header.scored, header.fit):
            return {**out, "reason": "not due", "scored_reviews": header.scored}
        stored = await self.store.read_all(key)
        history = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
        day_start = history.day_start(model) / 3600.0
        known = history.scored >= 0  # (a v3 header does not know the user's scored reviews: the fit counts them)
        fit_args = (history.recent, stored.fields, day_start, True if force or known else self._fit_due(history.fit))
        w, scored, held = await (self.fitter.fit(*fit_args) if self.fitter is not None else
                                 asyncio.to_thread(fit_held, *fit_args))
        if w is None:
            return {**out, "reason": "not due", "scored_reviews": scored}
        # due again `refit_every_scored` scored reviews after those recorded now (the fit may see fewer: the store
        # keeps each card's last card_size reviews; counted against those, every write would be due)
        fit = Fit(tuple(float(x) for x in w), held, history.scored if known else scored,
                  _time.time() if now is None else float(now))

        async def attempt(current: StoredState, *_) -> Change:
            latest = _decode(current)
            if not current.exists or latest.count < fit.fitted_on:  # deleted (and maybe begun again) meanwhile
                return Change(None, lambda _: _done({**out, "reason": "deleted meanwhile"}))
            blob = replace(latest, scored=latest.scored if latest.scored >= 0 else scored,
                           fit=replace(fit, day_start=latest.fit.day_start)).blob()  # (a boundary told meanwhile stays)
            return Change(blob, lambda written: _done({**out, "refitted": True, "fitted_on": fit.fitted_on,
                                                       "scored_reviews": scored, "w": list(fit.w),
                                                       "state_version": written.version}))

        return await self.write(model, key, f"user {user_id!r}", [], attempt)

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
