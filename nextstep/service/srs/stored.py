"""How a flashcard user's reviews are stored (the service's part: service.py).

State per user, under `srs:<model>:<schema>:<user>` (the schema hash covers the storage layout and the
window sizes, not the model version: the reviews are data, and a new version reading windows of the same
sizes goes on from them; see schema_hash):

Each stored review is a fixed 42-byte row (`ROW`): its sequence number within the user's log (0, 1, ...;
the review count is the next one), the card and deck as int64, the time, the duration, rating and state, and
FSRS-6's error on it (below).

Ids. The graph only compares card and deck ids for equality, so the service maps its string ids to int64
with a stable hash (`id_hash`: the first 8 bytes of BLAKE2b, as a signed little-endian integer). Two ids
collide with probability about n^2 / 2^65 for n distinct ids of one user (1e-12 at 5,000 cards), and a
collision would only make the model treat two cards (or decks) as one. The card's field is its string id,
so the stored histories themselves never mix.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InvalidInput
from ..registry import LoadedModel
from ..state import StoredState
from .schemas import MS_LOOKING

ROW = np.dtype([("seq", "<i8"), ("card", "<i8"), ("deck", "<i8"), ("time", "<f8"), ("duration", "<f4"),
                ("rating", "i1"), ("state", "i1"), ("error", "<f4")])  # packed: 42 bytes

HEADER_V3 = np.dtype([("cards", "<i8"), ("drift", "<f8", (2,))])  # distinct cards reviewed, drift sums (m, w)

HEADER_TAG = -6  # the first field of a v6 header (v5's is -5, v4's -4, a v3 header's a card count, >= 0)

N_PARAMS = 21

HEADER_V4 = np.dtype([("tag", "<i8"), ("cards", "<i8"), ("drift", "<f8", (2,)), ("scored", "<i8"),
                      ("w", "<f8", (N_PARAMS,)), ("fitted_on", "<i8"), ("fitted_scored", "<i8"), ("fitted_at", "<f8")])

HEADER_V5 = np.dtype(HEADER_V4.descr + [("day_start", "<f8")])  # v4 and the user's day boundary (NaN: the model's)

HEADER = np.dtype(HEADER_V5.descr + [("evidence", "<f8")])  # v5 and the user's evidence (NaN: the model's prior)

# The layout of the reviews stored per user (below): part of the state key's schema hash together with the
# window sizes. Change it whenever this module changes how it stores reviews.
STATE_LAYOUT = "srs-reviews-v3: card count (i8) and drift sums (2 f8), recent block and per-card fields of rows " \
    "(seq i8, card i8, deck i8, time f8, duration f4, rating i1, state i1, error f4); ids as signed BLAKE2b-64"

def schema_hash(name: str, size: int, card_size: int) -> str:
    """A user's stored state is their raw reviews, not model tensors: any version of a model that reads windows
    of the same sizes can use it, so the hash covers the storage layout and the window sizes but not the
    version (a new version keeps its users' histories; one with other window sizes starts afresh)."""
    return hashlib.sha256(json.dumps([name, STATE_LAYOUT, size, card_size]).encode()).hexdigest()[:12]

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


# fsrs-rs 0.9's default FSRS-6 parameters (nextstep/models/fsrs.py's DEFAULT_W), for an artifact whose manifest has
# none (the service does not import the model's package, which needs torch)
DEFAULT_FSRS6 = (0.212, 1.2931, 2.3065, 8.2956, 6.4133, 0.8334, 3.0194, 0.001, 1.8722, 0.1666, 0.796, 1.4835, 0.0614,
                 0.2629, 1.6483, 0.6014, 1.8729, 0.5425, 0.0912, 0.0658, 0.1542)

def manifest_params(manifest: dict) -> tuple[float, ...]:
    """The FSRS-6 parameters a user of a model starts with: its manifest's `fsrs6.parameters`, else fsrs-rs's
    defaults."""
    w = (manifest.get("fsrs6") or {}).get("parameters")
    return tuple(float(x) for x in w) if w and len(w) == N_PARAMS else DEFAULT_FSRS6

def default_params(model: LoadedModel) -> tuple[float, ...]:
    """manifest_params of `model`'s manifest, as its fields hold them since it was loaded (SrsFields.fsrs6)."""
    return model.extra.fsrs6

def evidence_prior(model: LoadedModel) -> float:
    """The evidence a new user of `model` starts with: the manifest's `evidence.prior` (0 without a mixture)."""
    return float((model.manifest.get("evidence") or {}).get("prior", 0.0))

def default_day_start(model: LoadedModel) -> float:
    """Seconds after 00:00 UTC at which a user's scheduler days start unless told: the manifest's
    `model_config.day_start_hour` (the one user's own for a single-user artifact), else 4 (Anki's rollover)."""
    return float((model.manifest.get("model_config") or {}).get("day_start_hour", 4.0)) * 3600.0

async def _done(answer: dict) -> dict:
    return answer
