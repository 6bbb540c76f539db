"""The windows of a user's reviews the flashcard graphs read, and the feeds built from them: the rule of
nextstep.srs.review_window applied to what the store holds (stored.py), with the user's parameters, drift and evidence.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from ...srs.review_window import select
from ..registry import LoadedModel
from .stored import ROW, History, Review, id_hash

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

# predict with the query card's FSRS-6 memory as an input (INPUTS + memory (B, 2) float32, nextstep/srs/card_memory.py),
# where an artifact has it: every prediction runs it (SpacedRepetition._predict)
MEMORY_GRAPH = "predict_memory"

_PAD = {"card": (0, np.int64), "deck": (0, np.int64), "time": (0.0, np.float64), "rating": (1, np.int64),
        "duration": (0.0, np.float32), "state": (-1, np.int64), "error": (np.nan, np.float32)}  # the hist_* inputs
_PAD_ROW = np.array(tuple(_PAD[name][0] if name in _PAD else -1 for name in ROW.names), dtype=ROW)  # a pad cell




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
    split = int(np.searchsorted(seqs, first_recent))  # only the card's rows can be older than the recent block
    older = seqs[:split]
    at = np.searchsorted(card_rows["seq"], older)
    if split and not (card_rows["seq"].take(np.minimum(at, len(card_rows) - 1)) == older).all():
        raise RuntimeError(f"stored reviews of card {card_id!r} lack rows {older.tolist()} that the window needs")
    # (one array filled by take, not np.concatenate: numpy promotes a structured dtype field by field in Python)
    out = np.empty(len(seqs), dtype=ROW)
    out[:split] = card_rows.take(at)
    out[split:] = recent.take(seqs[split:] - first_recent)
    return out

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
    rows = np.empty((len(windows), width), dtype=ROW)  # the windows right-aligned in one array, then each column
    rows[...] = _PAD_ROW
    valid = np.zeros((len(windows), width), dtype=bool)
    for i, w in enumerate(windows):
        if w.dtype != ROW:  # (structured arrays of other dtypes would be assigned field by position)
            raise TypeError(f"window {i} is of dtype {w.dtype}, not ROW")
        if len(w):
            rows[i, width - len(w):] = w
            valid[i, width - len(w):] = True
    out = {f"hist_{name}": rows[name].astype(dtype) for name, (_, dtype) in _PAD.items()}
    out["hist_valid"] = valid
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
