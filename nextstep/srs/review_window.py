"""Which past reviews the time-aware model sees when it predicts a review: one rule for training and serving.

The model (nextstep/models/time_aware.py) answers for a query (card, deck, time) from a window of at most
`size` earlier reviews of the same user. A window of the last `size` reviews alone would often lose the
query card's own history, the strongest signal of its memory, once the user has reviewed a few hundred
other cards since. So the window is

    the query card's last `card_size` reviews, plus the user's most recent other reviews up to `size`,

in time order. Reviews are named by their sequence number within the user's log (0, 1, ...). This module
is numpy only: the training code builds every query's window with it, and the service selects the
same rows from what it keeps in Redis (the user's last `size` reviews and each card's last `card_size`).

The user's drift sums (TimeAwareTransformer.drift_offset) are the model's other state, and `drift_sums` is
their one recurrence for training and the service alike (the model's own `drift_update` is its tensor form).
"""

from __future__ import annotations

import numpy as np


def select(card_seq: np.ndarray, n: int, size: int, card_size: int) -> np.ndarray:
    """Sequence numbers of the window for a query that follows reviews 0..n-1.

    card_seq: ascending sequence numbers (< n) of earlier reviews of the query's card; only the last
    `card_size` are used. Returns ascending sequence numbers, at most `size` of them.
    """
    card = np.asarray(card_seq, dtype=np.int64)[-card_size:] if card_size > 0 else np.zeros(0, np.int64)
    card = card[-size:]
    # recent block n-r..n-1 of length r: the union has r + #(card rows before n-r) rows; that count never
    # decreases as r grows, so take the largest r that keeps the union within `size`.
    r = min(n, size - len(card))
    while r < n and r + 1 + int(np.count_nonzero(card < n - r - 1)) <= size:
        r += 1
    older = card[card < n - r]
    return np.concatenate([older, np.arange(n - r, n, dtype=np.int64)])


def user_windows(card: np.ndarray, size: int, card_size: int) -> np.ndarray:
    """(n, size) windows for every review of one user's log as a query, left-padded with -1.

    Row i holds the sequence numbers `select` gives for review i (whose card is card[i]) after reviews 0..i-1.
    """
    n = len(card)
    out = np.full((n, size), -1, dtype=np.int64)
    seen: dict[int, list[int]] = {}
    for i in range(n):
        history = seen.setdefault(int(card[i]), [])
        rows = select(np.asarray(history[-card_size:], dtype=np.int64), i, size, card_size)
        if len(rows):
            out[i, size - len(rows):] = rows
        history.append(i)
    return out


def drift_decay(halflife: float) -> float:
    """The share of the drift sums left after one more scored review: a review's weight halves every `halflife`."""
    return 0.5 ** (1.0 / halflife)


def drift_sums(errors: np.ndarray, scored: np.ndarray, halflife: float, start=(0.0, 0.0)) -> np.ndarray:
    """(n + 1, 2) float64: the drift sums (m, w) before each of n reviews in time order and after the last, from
    `start`: at a scored review m <- a m + error, w <- a w + 1 (a = drift_decay(halflife)); others leave them."""
    a = drift_decay(halflife)
    m, w = (float(x) for x in start)
    out = np.empty((len(errors) + 1, 2))
    for i, (error, counted) in enumerate(zip(errors, scored, strict=True)):
        out[i] = m, w
        if counted:
            m, w = a * m + float(error), a * w + 1.0
    out[-1] = m, w
    return out


def evidence_sums(gains: np.ndarray, scored: np.ndarray, halflife: float | None, start: float) -> np.ndarray:
    """(n + 1,) float64: a user's evidence for the network over FSRS-6's defaults (TimeAwareTransformer.evidence_update)
    before each of n reviews in time order and after the last, from `start`: at a scored review E <- a E + gain, the
    defaults' log loss on it minus the network's (a = drift_decay(halflife); no halflife: 1); others leave it."""
    a = drift_decay(halflife) if halflife else 1.0
    e = float(start)
    out = np.empty(len(gains) + 1)
    for i, (gain, counted) in enumerate(zip(gains, scored, strict=True)):
        out[i] = e
        if counted:
            e = a * e + float(gain)
    out[-1] = e
    return out
