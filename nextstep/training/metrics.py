"""Evaluation metrics for ordinal (K-category) response prediction.

Numpy only, so that evaluation and the serving side never need torch or sklearn.
Hard predictions are the argmax category (first index on ties, as in torch).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "calibration_curve",
    "confusion_matrix",
    "expected_value",
    "ordinal_metrics",
    "quadratic_weighted_kappa",
    "roc_auc",
]

ORDINAL_ONLY = ("ordinal_accuracy", "qwk")  # measured when there are more than two categories: on right/wrong data
# every error is within one category (ordinal accuracy 1) and QWK is a plain kappa, which says nothing more
BINARY_ONLY = ("auc", "accuracy")  # measured on right/wrong data (K = 2)


def _labels(y: np.ndarray, n_cats: int, name: str) -> np.ndarray:
    """Validate integer labels in [0, n_cats): a silent out-of-range label corrupts every count."""
    y = np.asarray(y).reshape(-1)
    if y.dtype == bool:
        y = y.astype(np.int64)
    if y.size and (not np.issubdtype(y.dtype, np.integer) or y.min() < 0 or y.max() >= n_cats):
        raise ValueError(f"{name} must be integers in [0, {n_cats}); got {y.dtype} in [{y.min()}, {y.max()}]")
    return y.astype(np.int64)


def confusion_matrix(y_true: np.ndarray, y_pred: np.ndarray, n_cats: int) -> np.ndarray:
    """Counts C[i, j] of items with true category i predicted as j (int64, shape (K, K))."""
    t = _labels(y_true, n_cats, "y_true")
    p = _labels(y_pred, n_cats, "y_pred")
    if t.shape != p.shape:
        raise ValueError(f"y_true and y_pred differ in length: {t.shape} vs {p.shape}")
    return np.bincount(t * n_cats + p, minlength=n_cats * n_cats).reshape(n_cats, n_cats)


def quadratic_weighted_kappa(y_true: np.ndarray, y_pred: np.ndarray, n_cats: int) -> float:
    """Cohen's kappa with quadratic disagreement weights (i-j)^2/(K-1)^2.

    kappa = 1 - sum(W*O) / sum(W*E), E = outer(true marginal, pred marginal) / N.
    Returns 0.0 where kappa is undefined (no items, K < 2, or sum(W*E) == 0, e.g. a single
    class on both sides), which is the "no better than chance" value.
    """
    O = confusion_matrix(y_true, y_pred, n_cats).astype(np.float64)
    n = O.sum()
    if n == 0 or n_cats < 2:
        return 0.0
    idx = np.arange(n_cats)
    W = (idx[:, None] - idx[None, :]) ** 2 / (n_cats - 1) ** 2
    E = np.outer(O.sum(axis=1), O.sum(axis=0)) / n
    denom = float((W * E).sum())
    if denom <= 0.0:
        return 0.0
    return float(1.0 - (W * O).sum() / denom)


def roc_auc(y_true: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC via the Mann-Whitney U statistic with average ranks (a tied pair counts 1/2).

    Returns nan when either class is absent, since AUC is then undefined.
    """
    y = _labels(y_true, 2, "y_true")
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    if s.shape != y.shape:
        raise ValueError(f"y_true and scores differ in length: {y.shape} vs {s.shape}")
    n_pos = int(y.sum())
    n_neg = y.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    _, inverse, counts = np.unique(s, return_inverse=True, return_counts=True)
    # Tied values occupy ranks start..end (1-based); each gets their mean, end - (count - 1) / 2.
    avg_rank = np.cumsum(counts) - (counts - 1) / 2.0
    rank_sum_pos = avg_rank[inverse][y == 1].sum()
    return float((rank_sum_pos - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def calibration_curve(
    probs: np.ndarray, targets: np.ndarray, n_bins: int = 10
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Reliability diagram over all (row, category) pairs, one-vs-rest for every category.

    Each pair contributes predicted probability p[i, k] and outcome [y_i == k]. Bins are
    n_bins equal-width intervals of [0, 1] (1.0 falls in the last bin). Returns arrays of
    length n_bins: mean predicted probability, observed frequency (both nan for empty
    bins) and the int64 count per bin (sums to N*K).
    """
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must have shape (N, K), got {p.shape}")
    y = _labels(targets, p.shape[1], "targets")
    outcome = (y[:, None] == np.arange(p.shape[1])[None, :]).astype(np.float64).ravel()
    p = p.ravel()
    bins = np.clip(np.floor(p * n_bins).astype(np.int64), 0, n_bins - 1)
    counts = np.bincount(bins, minlength=n_bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_pred = np.bincount(bins, weights=p, minlength=n_bins) / counts
        observed = np.bincount(bins, weights=outcome, minlength=n_bins) / counts
    return mean_pred, observed, counts


def expected_value(probs: np.ndarray) -> np.ndarray:
    """Expected category sum_k k p_k per row: a continuous score that respects the order."""
    p = np.asarray(probs, dtype=np.float64)
    return p @ np.arange(p.shape[-1], dtype=np.float64)


def ordinal_metrics(probs: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Summary metrics for predicted category distributions probs (N, K) against targets (N,).

    Keys: categorical_accuracy, mae (of the argmax category), nll (mean -log p_y, p clipped at
    1e-12), n; plus ordinal_accuracy (within one category) and qwk when K > 2, auc (of
    probs[:, 1]) and accuracy when K == 2 (ORDINAL_ONLY, BINARY_ONLY). Means over zero items are nan.
    """
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2 or p.shape[1] < 2:
        raise ValueError(f"probs must have shape (N, K) with K >= 2, got {p.shape}")
    K = p.shape[1]
    y = _labels(targets, K, "targets")
    if y.shape[0] != p.shape[0]:
        raise ValueError(f"probs has {p.shape[0]} rows but targets has {y.shape[0]}")
    n = y.shape[0]
    pred = p.argmax(axis=1)
    err = np.abs(pred - y)

    def mean(x: np.ndarray) -> float:
        return float(x.mean()) if n else float("nan")

    out = {"categorical_accuracy": mean(err == 0)}
    if K > 2:
        out["ordinal_accuracy"] = mean(err <= 1)
        out["qwk"] = quadratic_weighted_kappa(y, pred, K)
    out.update(mae=mean(err.astype(np.float64)), nll=mean(-np.log(np.clip(p[np.arange(n), y], 1e-12, None))),
               n=float(n))
    if K == 2:
        out["auc"] = roc_auc(y, p[:, 1])
        out["accuracy"] = out["categorical_accuracy"]
    return out
