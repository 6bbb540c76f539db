"""A flashcard's FSRS-6 memory (stability, difficulty) after its reviews in a window, from fsrs-rs.

The flashcard model's `predict` graph starts from FSRS-6: it runs FSRS-6's recurrence over the query card's last
`card_window` reviews in the window (TimeAwareTransformer._fsrs_state), one unrolled step per review, about 0.2 ms
of the graph's 0.5 ms at the default sizes. Its twin `predict_memory` (the same model, exported beside it) takes
that (stability, difficulty) as an input instead; this module computes it the same way with fsrs-rs, FSRS-6's
reference implementation (a few microseconds): the card's last `card_window` rows of the window, oldest first, the
first of them starting the card afresh, each later one `days` whole scheduler days after the one before (days start
`day_start` seconds after 00:00 UTC). The export checks that the two graphs agree along its parity sequences with
this function feeding the twin (time_aware_export.py), and the service uses it for every prediction
(service/srs.py). Used by the service and the export alike, so it imports no torch.
"""

from __future__ import annotations

import math

import numpy as np

try:  # (the `train` and `serve` extras install it; without it, card_memory answers None: the graph's own recurrence)
    import fsrs_rs_python as _fsrs_rs
except ImportError:  # an install without fsrs-rs
    _fsrs_rs = None

DAY = 86400.0
AVAILABLE = _fsrs_rs is not None  # whether fsrs-rs is installed (else every prediction runs `predict` itself)
# the memory to feed for a card without a review in its window: the graph does not read it (any finite value will do)
UNSEEN = (1.0, 5.0)


def card_memory(card: np.ndarray, time: np.ndarray, rating: np.ndarray, query_card: int, params,
                day_start: float, card_window: int) -> tuple[float, float] | None:
    """(stability, difficulty) of `query_card` after its reviews among a window's rows (card ids, unix times and
    ratings 1..4, oldest first, every row a review), or None when the window has none of its reviews (or ratings
    outside 1..4, which FSRS-6 does not define, or parameters fsrs-rs refuses, or no fsrs-rs installed): the caller
    then feeds UNSEEN for a card without reviews and runs the graph that computes the memory itself otherwise.
    `params`: FSRS-6's 21, as fsrs-rs fits them (the service's refits, an artifact's defaults; fsrs-rs clamps
    parameters outside its bounds, the graph does not, and the export's check would catch an artifact whose defaults
    are outside them)."""
    own = np.flatnonzero(np.asarray(card) == query_card)
    own = own[len(own) - min(len(own), max(card_window, 0)):]
    if not len(own) or _fsrs_rs is None:
        return None
    ratings = np.asarray(rating)[own].tolist()  # (plain Python below: a few reviews, where numpy's calls cost more)
    if min(ratings) < 1 or max(ratings) > 4:
        return None
    reviews, before = [], None
    for t, g in zip(np.asarray(time, dtype=np.float64)[own].tolist(), ratings, strict=True):
        day = math.floor((t - day_start) / DAY)  # the scheduler day, as the graph's floor((t - start) / DAY)
        reviews.append(_fsrs_rs.FSRSReview(int(g), 0 if before is None else max(day - before, 0)))
        before = day
    try:
        state = _fsrs_rs.FSRS(np.asarray(params, dtype=np.float64).tolist()).memory_state(
            _fsrs_rs.FSRSItem(reviews), None)
    except ValueError:  # parameters fsrs-rs refuses (NaN): the graph's own recurrence answers
        return None
    return float(state.stability), float(state.difficulty)
