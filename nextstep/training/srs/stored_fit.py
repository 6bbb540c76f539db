"""FSRS-6 fitted on one flashcard user's stored reviews: what the service's refit runs (service/srs_refit.py).

It lives outside the service package so that the process the service fits in (fsrs-rs holds the GIL for the whole
fit: service/srs_refit.py) imports numpy, fsrs-rs and the evaluation protocol only, not the service.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Due:
    """Whether a user with a number of scored reviews is due a fit: a first one once they have `min_scored`, then
    again once `every_scored` more have arrived since the last (`fitted_scored`: the scored reviews it saw; None:
    not fitted yet). A plain value, so that it travels to a fitting process."""

    min_scored: int
    every_scored: int
    fitted_scored: int | None = None

    def __call__(self, scored: int) -> bool:
        if self.fitted_scored is None:
            return scored >= self.min_scored
        return scored - self.fitted_scored >= self.every_scored


def review_log(rows: np.ndarray, day_start_hour: float):
    """The rows (service/srs.py's ROW) as a one-user ReviewLog: elapsed_days counted in scheduler days (a day
    starts at day_start_hour UTC, as the model's days do), -1 on a card's first stored review."""
    from .reviews import ReviewLog

    n = len(rows)
    card = rows["card"].astype(np.int64)
    day = np.floor((rows["time"].astype(np.float64) - day_start_hour * 3600.0) / 86400.0).astype(np.int64)
    order = np.lexsort((np.arange(n), card))
    same = np.r_[False, card[order][1:] == card[order][:-1]]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[same]] = order[np.flatnonzero(same) - 1]
    elapsed = np.where(prev >= 0, day - day[np.maximum(prev, 0)], -1).astype(np.int64)
    return ReviewLog(["user"], np.array([0, n], dtype=np.int64), card, rows["deck"].astype(np.int64),
                     rows["time"].astype(np.float64), rows["rating"].astype(np.int64),
                     rows["duration"].astype(np.float32), rows["state"].astype(np.int64), elapsed)


def fit_stored(rows: np.ndarray, day_start_hour: float,
               due: bool | Callable[[int], bool] = True) -> tuple[list[float] | None, int]:
    """(FSRS-6's 21 parameters fitted on the rows, or None when `due(scored)` says no; the number of
    scored reviews the fit sees). `due` is True, or a callable of the scored count (`Due`)."""
    from .eval import fit_fsrs6, scored_mask

    log = review_log(rows, day_start_hour)
    scored = int(scored_mask(log).sum())
    if callable(due) and not due(scored):
        return None, scored
    return [float(x) for x in fit_fsrs6(log, np.arange(len(log), dtype=np.int64))], scored
