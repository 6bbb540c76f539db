"""Spaced-repetition evaluation: the srs-benchmark protocol, its metrics and reference baselines.

The protocol (open-spaced-repetition/srs-benchmark, `other.py` / `model_processors.py`):

- Each user is evaluated on their own reviews, in time order, with scikit-learn's `TimeSeriesSplit(n_splits=5)`:
  six blocks, the first of which is only ever trained on; fold k trains on everything before block k+1 and
  tests on block k+1; the predictions of the five test blocks are pooled.
- A review is *scored* when its card was last reviewed on an earlier scheduler day (elapsed_days > 0); the
  target is y = 1 when the rating is above Again. Same-day (short-term) reviews and first reviews are history
  only.
- srs-benchmark passes TimeSeriesSplit the scored reviews alone (its feature table keeps rows with delta_t > 0,
  each carrying its full card history), and fsrs-rs's `evaluate_with_time_series_splits` splits the same
  one-item-per-scored-review list. `protocol_folds(split_on="scored")` (the default) therefore draws the block
  boundaries over the scored reviews and extends each block over the unscored rows up to the next block, so
  fold k trains on every review (scored or not) before its test block. `split_on="rows"` draws the boundaries
  over all of the user's reviews instead. (fsrs-rs's own splitter gives the n % 6 leftover items to the last
  test block where scikit-learn gives them to the first training block; otherwise the two agree.)
- Metrics: log loss, RMSE(bins) and AUC of P(recall) on the scored test reviews. RMSE(bins) groups reviews by
  interval, review number and lapse count, each on a geometric grid (`rmse_bins`), and takes the
  count-weighted RMSE between mean y and mean p per bin. With several users this module pools all test
  reviews; `by_user` adds srs-benchmark's per-user averages weighted by scored reviews.

Also measured on the same scored test reviews: 4-class cross-entropy of P(rating), and the error of a predicted
answer time in seconds (reviews with a known, uncapped duration).

Baselines fitted per fold on that fold's training rows of the same user: FSRS-6 fitted by fsrs-rs
(`fsrs6_predictions`), the constant base rate, the median answer time by grade (given the true grade, as
anki-time-benchmark's anchor does) and without it, and FSRS-6 recall split over the user's Hard/Good/Easy
shares for P(rating). `evaluate_baselines` runs them all; `evaluate_predictions` scores any model's
per-review predictions on the same folds.

Run `python -m nextstep.training.srs.eval --data DIR` for the baselines of one data set as JSON.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from nextstep.training.metrics import roc_auc
from nextstep.training.srs.reviews import ReviewLog

__all__ = [
    "FSRS6Predictions",
    "base_rate_predictions",
    "bin_features",
    "duration_errors",
    "duration_mask",
    "evaluate_baselines",
    "evaluate_predictions",
    "fit_fsrs6",
    "fit_fsrs6_by_user",
    "fsrs6_fixed_predictions",
    "fsrs6_predictions",
    "fsrs6_rating_predictions",
    "fsrs6_retrievability",
    "log_loss",
    "median_duration_predictions",
    "protocol_folds",
    "rating_ce",
    "recall_metrics",
    "rmse_bins",
    "scored_mask",
    "time_series_folds",
    "user_index",
]

Fold = tuple[np.ndarray, np.ndarray]  # (train rows, test rows), int64 row indices into the log
SPLIT_UNITS = ("scored", "rows")
PROB_CLIP = 1e-12  # probabilities are clipped to [PROB_CLIP, 1 - PROB_CLIP] inside logarithms

# RMSE(bins) grid: value x falls in bin floor(log(x) / log(base)) (fsrs-optimizer `rmse_matrix`, fsrs-rs
# `FSRSItem::r_matrix_index`, whose keys are round(2.48 * 3.62^k, 2), round(1.99 * 1.89^k), round(1.65 * 1.73^k);
# distinct k give distinct keys there, so grouping by k is the same partition).
DELTA_T_BASE, REVIEW_NUMBER_BASE, LAPSE_BASE = 3.62, 1.89, 1.73


# ----------------------------------------------------------------------------------------------- folds


def time_series_folds(n: int, n_splits: int = 5) -> list[Fold]:
    """scikit-learn's `TimeSeriesSplit(n_splits).split` over n items in order, as index arrays.

    Every test block holds n // (n_splits + 1) items; the first training block also takes the remainder,
    so the test blocks end at n. Raises ValueError, as scikit-learn does, when n < n_splits + 1.
    """
    if n_splits < 2:
        raise ValueError(f"n_splits must be at least 2, got {n_splits}")
    if n < n_splits + 1:
        raise ValueError(f"cannot split {n} items into {n_splits + 1} blocks")
    size = n // (n_splits + 1)
    idx = np.arange(n, dtype=np.int64)
    return [(idx[:start], idx[start : start + size]) for start in range(n - n_splits * size, n, size)]


def user_index(log: ReviewLog) -> np.ndarray:
    """The user number of every review (int64, length len(log))."""
    return np.repeat(np.arange(log.n_users, dtype=np.int64), np.diff(log.offsets))


def scored_mask(log: ReviewLog) -> np.ndarray:
    """Reviews the protocol scores: the card's previous review was on an earlier scheduler day."""
    return np.asarray(log.elapsed_days) > 0


def protocol_folds(log: ReviewLog, n_splits: int = 5, split_on: str = "scored") -> list[Fold]:
    """The protocol's folds over all users: fold k joins every user's k-th training and test rows.

    split_on="scored" (srs-benchmark, fsrs-rs): the user's scored reviews are split by `time_series_folds`;
    test block k runs from its first scored review up to the next block's first scored review (the last
    block to the user's last review), so it holds exactly the k-th block of scored reviews plus the unscored
    reviews between them; training rows are all the user's reviews before the block. split_on="rows": the
    split is drawn over all of the user's reviews. Users with fewer than n_splits + 1 units (scored reviews,
    or reviews) have no folds and are left out, as TimeSeriesSplit cannot split them. Rows come back sorted.
    """
    if split_on not in SPLIT_UNITS:
        raise ValueError(f"split_on must be one of {SPLIT_UNITS}, got {split_on!r}")
    scored = scored_mask(log)
    train: list[list[np.ndarray]] = [[] for _ in range(n_splits)]
    test: list[list[np.ndarray]] = [[] for _ in range(n_splits)]
    for u in range(log.n_users):
        lo, hi = int(log.offsets[u]), int(log.offsets[u + 1])
        units = lo + (np.flatnonzero(scored[lo:hi]) if split_on == "scored" else np.arange(hi - lo))
        if units.size < n_splits + 1:
            continue
        starts = [int(units[te[0]]) for _, te in time_series_folds(units.size, n_splits)] + [hi]
        for k in range(n_splits):
            train[k].append(np.arange(lo, starts[k], dtype=np.int64))
            test[k].append(np.arange(starts[k], starts[k + 1], dtype=np.int64))
    def joined(parts: list[np.ndarray]) -> np.ndarray:
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    return [(joined(tr), joined(te)) for tr, te in zip(train, test, strict=True)]


def _user_blocks(log: ReviewLog, folds: list[Fold]) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
    """(fold, user, the user's training rows, the user's test rows) for every user with test rows in a fold."""
    for k, (train, test) in enumerate(folds):
        train, test = np.sort(np.asarray(train, dtype=np.int64)), np.sort(np.asarray(test, dtype=np.int64))
        tr_at, te_at = np.searchsorted(train, log.offsets), np.searchsorted(test, log.offsets)
        for u in np.flatnonzero(te_at[1:] > te_at[:-1]):
            yield k, int(u), train[tr_at[u] : tr_at[u + 1]], test[te_at[u] : te_at[u + 1]]


def _test_rows(log: ReviewLog, folds: list[Fold]) -> np.ndarray:
    rows = np.concatenate([np.asarray(te, dtype=np.int64) for _, te in folds]) if folds else np.zeros(0, np.int64)
    if np.unique(rows).size != rows.size:
        raise ValueError("test blocks overlap: a review is in more than one fold's test rows")
    return np.sort(rows)


# -------------------------------------------------------------------------------------------- features


def _card_order(log: ReviewLog) -> tuple[np.ndarray, np.ndarray]:
    """A row order grouping each (user, card)'s reviews together in time order, and where each group starts."""
    n = len(log)
    order = np.lexsort((np.arange(n), np.asarray(log.card), user_index(log)))
    users, cards = user_index(log)[order], np.asarray(log.card)[order]
    starts = np.ones(n, dtype=bool)
    starts[1:] = (users[1:] != users[:-1]) | (cards[1:] != cards[:-1])
    return order, starts


def _cumsum_in_groups(values: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Inclusive running sum of values restarting at every group start (values in grouped order)."""
    total = np.cumsum(values)
    before_group = (total - values)[np.flatnonzero(starts)]
    return total - before_group[np.cumsum(starts) - 1]


def bin_features(log: ReviewLog) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(delta_t, i, lapse) of every review, the three RMSE(bins) coordinates (int64 arrays).

    delta_t: elapsed_days. i: 1 + the number of the card's reviews up to and including this one with
    elapsed_days > 0 (srs-benchmark recomputes `i` as `(elapsed_days > 0).cumsum() + 1` per card; fsrs-rs
    uses `long_term_review_cnt() + 1` of the item that ends with this review). lapse: the number of the card's
    earlier reviews rated Again with elapsed_days > 0 (srs-benchmark `count_lapse` over r_history/t_history,
    fsrs-rs `history().filter(rating == 1 && delta_t > 0)`); an Again on a first or same-day review is not a
    lapse. A card's history is its reviews by the same user.
    """
    order, starts = _card_order(log)
    elapsed = np.asarray(log.elapsed_days)[order]
    long_term = (elapsed > 0).astype(np.int64)
    lapse_flags = long_term * (np.asarray(log.rating)[order] == 1)
    i, lapse = np.empty(len(log), np.int64), np.empty(len(log), np.int64)
    i[order] = 1 + _cumsum_in_groups(long_term, starts)
    lapse[order] = _cumsum_in_groups(lapse_flags, starts) - lapse_flags
    return np.asarray(log.elapsed_days, dtype=np.int64).copy(), i, lapse


# --------------------------------------------------------------------------------------------- metrics


def log_loss(y: np.ndarray, p: np.ndarray) -> float:
    """Mean binary cross-entropy of P(y = 1) = p (p clipped to [1e-12, 1 - 1e-12]); nan for no items."""
    y = np.asarray(y, dtype=np.float64)
    p = np.clip(np.asarray(p, dtype=np.float64), PROB_CLIP, 1.0 - PROB_CLIP)
    if y.size == 0:
        return float("nan")
    return float(-np.mean(y * np.log(p) + (1.0 - y) * np.log(1.0 - p)))


def _geometric_bin(x: np.ndarray, base: float) -> np.ndarray:
    return np.floor(np.log(x) / np.log(base)).astype(np.int64)


def rmse_bins(y: np.ndarray, p: np.ndarray, delta_t: np.ndarray, i: np.ndarray, lapse: np.ndarray) -> float:
    """RMSE(bins) of fsrs-optimizer / srs-benchmark (`rmse_matrix`) and fsrs-rs (`evaluate`).

    Each review goes to the bin (floor(log_3.62 delta_t), floor(log_1.89 i), lapse bin), where the lapse bin
    is floor(log_1.73 lapse) for lapse > 0 and a bin of its own for lapse = 0. Per bin b with n_b reviews,
    mean outcome Y_b and mean prediction P_b: RMSE = sqrt(sum_b n_b (Y_b - P_b)^2 / sum_b n_b).
    delta_t and i must be >= 1 (scored reviews). nan for no items.
    """
    y, p = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    delta_t, i, lapse = (np.asarray(a, dtype=np.int64) for a in (delta_t, i, lapse))
    if y.size == 0:
        return float("nan")
    if delta_t.min() < 1 or i.min() < 1 or lapse.min() < 0:
        raise ValueError("RMSE(bins) needs delta_t >= 1, i >= 1 and lapse >= 0")
    lapse_bin = np.where(lapse > 0, _geometric_bin(np.maximum(lapse, 1), LAPSE_BASE), -1)
    keys = np.stack([_geometric_bin(delta_t, DELTA_T_BASE), _geometric_bin(i, REVIEW_NUMBER_BASE), lapse_bin], 1)
    _, inverse, counts = np.unique(keys, axis=0, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    mean_y = np.bincount(inverse, weights=y) / counts
    mean_p = np.bincount(inverse, weights=p) / counts
    return float(np.sqrt(np.sum(counts * (mean_y - mean_p) ** 2) / counts.sum()))


def recall_metrics(
    y: np.ndarray, p: np.ndarray, delta_t: np.ndarray, i: np.ndarray, lapse: np.ndarray
) -> dict[str, float]:
    """{"log_loss", "rmse_bins", "auc"} of P(recall) p against outcomes y (0/1) on scored reviews.

    delta_t, i, lapse are the reviews' `bin_features`. AUC is rank-based with tied scores averaged
    (`metrics.roc_auc`), nan when only one outcome occurs.
    """
    y = np.asarray(y).astype(np.int64)
    return {
        "log_loss": log_loss(y, p),
        "rmse_bins": rmse_bins(y, p, delta_t, i, lapse),
        "auc": roc_auc(y, p) if y.size else float("nan"),
    }


def rating_ce(p4: np.ndarray, rating: np.ndarray) -> float:
    """Mean -log P(observed rating) for P(rating) rows p4 (N, 4) over ratings 1..4 (clipped at 1e-12)."""
    p4 = np.asarray(p4, dtype=np.float64)
    rating = np.asarray(rating, dtype=np.int64)
    if p4.ndim != 2 or p4.shape[1] != 4 or p4.shape[0] != rating.shape[0]:
        raise ValueError(f"p4 must have shape (N, 4) with N = {rating.shape[0]}, got {p4.shape}")
    if rating.size == 0:
        return float("nan")
    if rating.min() < 1 or rating.max() > 4:
        raise ValueError("ratings must be 1..4")
    return float(-np.mean(np.log(np.clip(p4[np.arange(rating.size), rating - 1], PROB_CLIP, None))))


def duration_mask(log: ReviewLog) -> np.ndarray:
    """Reviews whose answer time is scored: scored, not a first review, duration known and below the cap.

    The cap is `log.meta["duration_cap_s"]` when present (a duration at or above it was clipped by the app), or each
    user's in a log of several sources (`ReviewLog.duration_caps`).
    """
    duration = np.asarray(log.duration, dtype=np.float64)
    mask = scored_mask(log) & (np.asarray(log.elapsed_days) >= 0) & np.isfinite(duration)
    return mask & (duration < log.duration_caps())


def duration_errors(pred_s: np.ndarray, true_s: np.ndarray, mask: np.ndarray) -> tuple[float, float]:
    """(MAE, RMSE) in seconds of predicted answer times over the reviews in mask; nan for none."""
    mask = np.asarray(mask, dtype=bool)
    err = np.asarray(pred_s, dtype=np.float64)[mask] - np.asarray(true_s, dtype=np.float64)[mask]
    if err.size == 0:
        return float("nan"), float("nan")
    if not np.all(np.isfinite(err)):
        raise ValueError("duration predictions are missing (nan) on reviews that are scored")
    return float(np.mean(np.abs(err))), float(np.sqrt(np.mean(err**2)))


def evaluate_predictions(
    log: ReviewLog,
    folds: list[Fold],
    p_recall: np.ndarray | None = None,
    p_rating: np.ndarray | None = None,
    duration_s: np.ndarray | None = None,
) -> dict:
    """The protocol's metrics of one model's per-review predictions on the scored reviews of the test blocks.

    p_recall (N,), p_rating (N, 4) over ratings 1..4 and duration_s (N,) are indexed by review row; rows
    outside the test blocks are ignored (nan there is fine), a nan on a scored test review is an error.
    Returns the metrics of what was given: log_loss, rmse_bins, auc (p_recall); rating_ce (p_rating);
    duration_mae_s, duration_rmse_s (duration_s); with n_scored, n_duration, and `by_user` (per-user
    metrics averaged with weights n_scored, as srs-benchmark reports) when more than one user is scored.
    """
    rows = _test_rows(log, folds)
    rows = rows[scored_mask(log)[rows]]
    rating = np.asarray(log.rating)[rows]
    y = (rating > 1).astype(np.int64)
    delta_t, i, lapse = (a[rows] for a in bin_features(log))
    users = user_index(log)[rows]
    out: dict = {"n_scored": int(rows.size)}

    def checked(a: np.ndarray, name: str, shape: tuple[int, ...]) -> np.ndarray:
        a = np.asarray(a, dtype=np.float64)
        if a.shape != (len(log), *shape):
            raise ValueError(f"{name} must have shape {(len(log), *shape)}, got {a.shape}")
        a = a[rows]
        if not np.all(np.isfinite(a)):
            raise ValueError(f"{name} is missing (nan) on {int((~np.isfinite(a)).any(axis=-1).sum())} scored reviews")
        return a

    if p_recall is not None:
        p = checked(p_recall, "p_recall", ())
        out.update(recall_metrics(y, p, delta_t, i, lapse))
        if np.unique(users).size > 1:
            per_user = [(int((users == u).sum()), recall_metrics(*(a[users == u] for a in (y, p, delta_t, i, lapse))))
                        for u in np.unique(users)]
            out["by_user"] = {
                key: _weighted_mean([m[key] for _, m in per_user], [w for w, _ in per_user])
                for key in ("log_loss", "rmse_bins", "auc")
            }
    if p_rating is not None:
        out["rating_ce"] = rating_ce(checked(p_rating, "p_rating", (4,)), rating)
    if duration_s is not None:
        keep = duration_mask(log)[rows]
        pred = np.asarray(duration_s, dtype=np.float64)
        if pred.shape != (len(log),):
            raise ValueError(f"duration_s must have shape {(len(log),)}, got {pred.shape}")
        mae, rmse = duration_errors(pred[rows], np.asarray(log.duration, dtype=np.float64)[rows], keep)
        out.update({"duration_mae_s": mae, "duration_rmse_s": rmse, "n_duration": int(keep.sum())})
    return out


def _weighted_mean(values: list[float], weights: list[int]) -> float:
    v, w = np.asarray(values, dtype=np.float64), np.asarray(weights, dtype=np.float64)
    ok = np.isfinite(v)
    return float(np.sum(v[ok] * w[ok]) / np.sum(w[ok])) if ok.any() else float("nan")


# ------------------------------------------------------------------------------------------- baselines


def base_rate_predictions(log: ReviewLog, folds: list[Fold]) -> tuple[np.ndarray, np.ndarray]:
    """Constant predictions per user and fold from the fold's scored training reviews of that user.

    P(recall) is their mean y (srs-benchmark's AVG model; 0.5 when there are none); P(rating) is their rating
    frequency with add-one (Laplace) smoothing, (count_r + 1) / (n + 4). Both nan outside the test rows.
    """
    scored = scored_mask(log)
    rating = np.asarray(log.rating)
    p = np.full(len(log), np.nan)
    p4 = np.full((len(log), 4), np.nan)
    for _, _, train, test in _user_blocks(log, folds):
        r = rating[train[scored[train]]]
        p[test] = float(np.mean(r > 1)) if r.size else 0.5
        p4[test] = (np.bincount(r - 1, minlength=4)[:4] + 1.0) / (r.size + 4.0)
    return p, p4


def _grade_shares(ratings: np.ndarray) -> np.ndarray:
    """Laplace-smoothed shares of Hard, Good, Easy among successful ratings: (count + 1) / (n + 3)."""
    good = ratings[ratings > 1]
    return (np.bincount(good - 2, minlength=3)[:3] + 1.0) / (good.size + 3.0)


def fsrs6_rating_predictions(log: ReviewLog, folds: list[Fold], p_recall: np.ndarray) -> np.ndarray:
    """P(rating) from a recall probability and the user's Hard/Good/Easy shares in the fold's training rows.

    P(Again) = 1 - R; P(r) = R * share_r for r in Hard, Good, Easy, shares from the user's scored training
    reviews rated above Again (`_grade_shares`). nan where p_recall is nan.
    """
    scored = scored_mask(log)
    rating = np.asarray(log.rating)
    R = np.asarray(p_recall, dtype=np.float64)
    p4 = np.full((len(log), 4), np.nan)
    for _, _, train, test in _user_blocks(log, folds):
        shares = _grade_shares(rating[train[scored[train]]])
        p4[test, 0] = 1.0 - R[test]
        p4[test, 1:] = R[test, None] * shares[None, :]
    return p4


def median_duration_predictions(log: ReviewLog, folds: list[Fold], by_grade: bool = True) -> np.ndarray:
    """Median answer time (seconds) of the user's training reviews, per grade or overall.

    Training reviews count when they are not a first review and their duration is known and below the
    answer-time cap (`ReviewLog.duration_caps`; same-day reviews included). by_grade=True predicts each test review
    with the median of its TRUE rating (anki-time-benchmark's "median by grade" anchor: it knows the grade, which a
    model predicting before the answer does not); a grade without training reviews falls back to the
    overall median. The overall median falls back to that of all users' training rows of the fold.
    """
    duration = np.asarray(log.duration, dtype=np.float64)
    rating = np.asarray(log.rating)
    usable = (np.asarray(log.elapsed_days) >= 0) & np.isfinite(duration) & (duration < log.duration_caps())
    pred = np.full(len(log), np.nan)
    fold_median = {}
    for k, (train, _) in enumerate(folds):
        d = duration[np.asarray(train, dtype=np.int64)][usable[train]]
        fold_median[k] = float(np.median(d)) if d.size else float("nan")
    for k, _, train, test in _user_blocks(log, folds):
        rows = train[usable[train]]
        overall = float(np.median(duration[rows])) if rows.size else fold_median[k]
        pred[test] = overall
        if by_grade:
            for g in range(1, 5):
                d = duration[rows[rating[rows] == g]]
                if d.size:
                    pred[test[rating[test] == g]] = float(np.median(d))
    return pred


def fsrs6_retrievability(t: np.ndarray, stability: np.ndarray, decay: float) -> np.ndarray:
    """FSRS-6 forgetting curve R(t) = (1 + factor * t / S)^(-decay), factor = 0.9^(-1/decay) - 1.

    decay is the 21st parameter w[20]; the factor makes R(S) = 0.9 (fsrs-rs `current_retrievability`).
    """
    factor = 0.9 ** (-1.0 / decay) - 1.0
    t = np.asarray(t, dtype=np.float64)
    return (1.0 + factor * t / np.asarray(stability, dtype=np.float64)) ** (-decay)


class _CardHistories:
    """Every review as an fsrs-rs FSRSReview, grouped per (user, card) in time order, to cut FSRSItems from.

    delta_t is max(elapsed_days, 0) in whole days, and 0 on the first review of a card in the log (fsrs-rs
    requires it and treats that review as the card's first), so same-day reviews enter with delta_t 0, as the
    short-term FSRS-5/6 models expect.
    """

    def __init__(self, log: ReviewLog):
        import fsrs_rs_python as fsrs

        self._fsrs = fsrs
        rating = np.asarray(log.rating)
        if len(log) and (rating.min() < 1 or rating.max() > 4):
            raise ValueError("ratings must be 1..4")
        order, starts = _card_order(log)
        first = np.flatnonzero(starts)
        group = np.cumsum(starts) - 1
        self.group, self.pos = np.empty(len(log), np.int64), np.empty(len(log), np.int64)
        self.group[order] = group
        self.pos[order] = np.arange(len(log)) - first[group]
        delta = np.maximum(np.asarray(log.elapsed_days)[order], 0)
        delta[starts] = 0
        reviews = [fsrs.FSRSReview(int(r), int(d)) for r, d in zip(rating[order], delta, strict=True)]
        self.cards = [reviews[a:b] for a, b in zip(first, [*first[1:], len(log)], strict=True)]

    def item(self, row: int, with_current: bool):
        """The card's reviews before this one, and this one when with_current."""
        g, p = self.group[row], self.pos[row]
        return self._fsrs.FSRSItem(self.cards[g][: p + 1 if with_current else p])


@dataclass
class FSRS6Predictions:
    """FSRS-6 recall probabilities per review (nan outside the test rows and on a card's first review).

    parameters[(fold, user)] are the fitted 21 weights; fit[(fold, user)] says how fsrs-rs fitted them:
    "trained" (all 21), "initial_stability_only" (fewer than 64 training items after its outlier filter:
    w0..w3 fitted, the rest default) or "default" (fewer than 8: the default parameters). n_no_history counts
    scored test reviews whose card has no earlier review in the log; they get the fold's base rate.
    """

    p_recall: np.ndarray
    parameters: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    fit: dict[tuple[int, int], str] = field(default_factory=dict)
    n_no_history: int = 0

    def fit_counts(self) -> dict[str, int]:
        return dict(Counter(self.fit.values()))


def _fit_kind(w: list[float], default: list[float]) -> str:
    w, d = np.asarray(w), np.asarray(default)
    if np.allclose(w, d):
        return "default"
    return "initial_stability_only" if np.allclose(w[4:], d[4:]) else "trained"


def fit_fsrs6(log: ReviewLog, rows: np.ndarray, enable_short_term: bool = True,
              hist: _CardHistories | None = None) -> list[float]:
    """FSRS-6's 21 parameters fitted by fsrs-rs (`compute_parameters`) on `rows`' scored reviews with an earlier
    review of their card, each an FSRSItem of its card's reviews up to and including it; the defaults when there
    are none (fsrs-rs itself falls back to partly default parameters on little data)."""
    import fsrs_rs_python as fsrs

    hist = hist or _CardHistories(log)
    rows = rows[scored_mask(log)[rows] & (hist.pos[rows] > 0)]
    if not rows.size:
        return list(fsrs.DEFAULT_PARAMETERS)
    items = [hist.item(r, True) for r in rows]
    return list(fsrs.FSRS(list(fsrs.DEFAULT_PARAMETERS)).compute_parameters(items,
                                                                            enable_short_term=enable_short_term))


def fit_fsrs6_by_user(log: ReviewLog, rows: np.ndarray, hist: _CardHistories | None = None) -> np.ndarray:
    """(n_users, 21): each user's FSRS-6 parameters fitted by `fit_fsrs6` on that user's reviews among `rows` alone
    (fsrs-rs's defaults for a user with none), as the baseline is fitted per user and fold."""
    import fsrs_rs_python as fsrs

    hist = hist or _CardHistories(log)
    rows = np.sort(np.asarray(rows, dtype=np.int64))
    at = np.searchsorted(rows, log.offsets)
    out = np.tile(np.asarray(fsrs.DEFAULT_PARAMETERS, dtype=np.float64), (log.n_users, 1))
    for u in range(log.n_users):
        mine = rows[at[u]:at[u + 1]]
        if mine.size:
            out[u] = fit_fsrs6(log, mine, hist=hist)
    return out


def fsrs6_fixed_predictions(log: ReviewLog, folds: list[Fold], w: list[float]) -> np.ndarray:
    """FSRS-6 with the same parameters `w` for every user (e.g. fsrs-rs's defaults) on the test rows of `folds`,
    as `fsrs6_predictions` predicts them (a card without an earlier review: the fold's base rate)."""
    import fsrs_rs_python as fsrs

    hist = _CardHistories(log)
    scored = scored_mask(log)
    has_history = hist.pos > 0
    elapsed = np.maximum(np.asarray(log.elapsed_days), 0).astype(np.float64)
    y = np.asarray(log.rating) > 1
    p = np.full(len(log), np.nan)
    model = fsrs.FSRS(list(w))
    for _, _, train, test in _user_blocks(log, folds):
        rows = test[has_history[test]]
        if rows.size:
            states = model.memory_state_batch([hist.item(r, False) for r in rows])
            stability = np.array([s.stability for s in states], dtype=np.float64)
            p[rows] = fsrs6_retrievability(elapsed[rows], stability, w[20])
        orphans = test[~has_history[test] & scored[test]]
        if orphans.size:
            y_train = y[train[scored[train]]]
            p[orphans] = float(y_train.mean()) if y_train.size else 0.5
    return p


def fsrs6_predictions(log: ReviewLog, folds: list[Fold], enable_short_term: bool = True) -> FSRS6Predictions:
    """FSRS-6 fitted by fsrs-rs (`compute_parameters`) per user and fold, predicting that fold's test rows.

    Training items are the user's scored training reviews, each as an FSRSItem of its card's reviews up to
    and including it (same-day reviews with delta_t 0), in time order: the items srs-benchmark's FSRS-rs
    model and fsrs-rs's own `evaluate_with_time_series_splits` train on. compute_parameters applies fsrs-rs's
    outlier filter and falls back to (partly) default parameters on little data (see `FSRS6Predictions`).
    A test review's memory state comes from all of its card's earlier reviews (earlier test reviews are
    history; only the parameters are restricted to training rows), and R = `fsrs6_retrievability` at
    t = elapsed_days (0 on same-day reviews).
    """
    import fsrs_rs_python as fsrs

    default = list(fsrs.DEFAULT_PARAMETERS)
    hist = _CardHistories(log)
    scored = scored_mask(log)
    has_history = hist.pos > 0
    elapsed = np.maximum(np.asarray(log.elapsed_days), 0).astype(np.float64)
    y = np.asarray(log.rating) > 1
    out = FSRS6Predictions(np.full(len(log), np.nan))
    for k, u, train, test in _user_blocks(log, folds):
        w = fit_fsrs6(log, train, enable_short_term, hist)
        out.parameters[(k, u)], out.fit[(k, u)] = w, _fit_kind(w, default)
        rows = test[has_history[test]]
        if rows.size:
            states = fsrs.FSRS(w).memory_state_batch([hist.item(r, False) for r in rows])
            stability = np.array([s.stability for s in states], dtype=np.float64)
            out.p_recall[rows] = fsrs6_retrievability(elapsed[rows], stability, w[20])
        orphans = test[~has_history[test] & scored[test]]
        if orphans.size:
            y_train = y[train[scored[train]]]
            out.p_recall[orphans] = float(y_train.mean()) if y_train.size else 0.5
            out.n_no_history += int(orphans.size)
    return out


def evaluate_baselines(log: ReviewLog, n_splits: int = 5, split_on: str = "scored") -> dict:
    """Every baseline's metrics under the protocol, in the form of `evaluate_predictions`.

    Keys: "protocol" (n_splits, split_on, users, test and scored counts), "fsrs6" (FSRS-6 recall metrics,
    rating_ce of FSRS-6 recall with the user's Hard/Good/Easy shares, and how each fold was fitted),
    "base_rate" (constant P(recall) and 4-class rating frequencies), "median_duration_by_grade" (given the
    true grade) and "median_duration" (without it). A model evaluated with `evaluate_predictions` on
    `protocol_folds(log, n_splits, split_on)` is comparable with every entry.
    """
    folds = protocol_folds(log, n_splits, split_on)
    tested_users = np.unique(user_index(log)[_test_rows(log, folds)])
    fsrs6 = fsrs6_predictions(log, folds)
    p_base, p4_base = base_rate_predictions(log, folds)
    p4_fsrs6 = fsrs6_rating_predictions(log, folds, fsrs6.p_recall)
    fsrs6_metrics = evaluate_predictions(log, folds, fsrs6.p_recall, p4_fsrs6)
    fsrs6_metrics.update({"fits": fsrs6.fit_counts(), "n_no_history": fsrs6.n_no_history})
    by_grade = median_duration_predictions(log, folds, by_grade=True)
    overall = median_duration_predictions(log, folds, by_grade=False)
    return {
        "protocol": {
            "n_splits": n_splits,
            "split_on": split_on,
            "n_users": log.n_users,
            "n_users_evaluated": int(tested_users.size),
            "n_reviews": len(log),
            "n_test_rows": int(sum(len(te) for _, te in folds)),
            "n_scored": fsrs6_metrics["n_scored"],
        },
        "fsrs6": fsrs6_metrics,
        "base_rate": evaluate_predictions(log, folds, p_base, p4_base),
        "median_duration_by_grade": evaluate_predictions(log, folds, duration_s=by_grade),
        "median_duration": evaluate_predictions(log, folds, duration_s=overall),
    }


# ------------------------------------------------------------------------------------------------- CLI


def _read_log(data: str, day_columns: str, duration_cap_s: float | None = None) -> ReviewLog:
    """--data as `nextstep train time_aware` reads it (one user's file or folder, or a folder of users' folders); a
    cap given applies to the one source's log, and in a folder of users to each user whose data cannot say."""
    from nextstep.training.srs.reviews import read_review_data

    log = read_review_data(data, day_columns=day_columns, duration_cap_s=duration_cap_s)
    if duration_cap_s is not None and "duration_cap_s_by_user" not in log.meta:
        log.meta["duration_cap_s"] = duration_cap_s
    return log


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m nextstep.training.srs.eval",
        description="Baselines of a review log under the srs-benchmark protocol, printed as JSON.",
    )
    parser.add_argument("--data", required=True, help="a review file, one user's folder, or a folder of users' "
                                                      "folders (reviews.read_review_data)")
    parser.add_argument("--n-splits", type=int, default=5)
    parser.add_argument("--split-on", choices=SPLIT_UNITS, default="scored",
                        help="draw the TimeSeriesSplit blocks over scored reviews (srs-benchmark) or all reviews")
    parser.add_argument("--day-columns", choices=("check", "trust", "ignore"), default="check",
                        help="what the review-log CSV reader does with day_offset / elapsed_days")
    parser.add_argument("--duration-cap-s", type=float, default=None,
                        help="answer-time cap of the source (durations at or above it are not scored)")
    args = parser.parse_args(argv)
    log = _read_log(args.data, args.day_columns, args.duration_cap_s)
    print(json.dumps(evaluate_baselines(log, args.n_splits, args.split_on), indent=2))


if __name__ == "__main__":
    main()
