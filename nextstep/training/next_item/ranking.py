"""Next-item evaluation, the official GRU4Rec protocol (../shared/data/README.md).

Every event after the first of a test session is a target; the model scores ALL items known from
training (rows 0 and 1, padding and unknown, are never candidates); the target's rank is conservative,
rank = #{items whose score >= the target's score}, so ties count against the model; each test
session starts from the initial state. Recall@K, MRR@K and NDCG@K are averaged over targets.
"""

import numpy as np
import torch

from .sessions import SessionData

KS = (1, 5, 10, 20)
N_RESERVED = 2  # rows 0 (padding) and 1 (unknown item)


def rank_metrics(ranks: np.ndarray, ks: tuple[int, ...] = KS) -> dict:
    """Recall@K, MRR@K (reciprocal rank, 0 beyond K) and NDCG@K (one relevant item) from 1-based ranks."""
    ranks = np.asarray(ranks, dtype=np.float64)
    if not len(ranks):
        raise ValueError("no targets to evaluate")
    out = {}
    for k in ks:
        hit = ranks <= k
        out[f"recall@{k}"] = float(hit.mean())
        out[f"mrr@{k}"] = float(np.where(hit, 1.0 / ranks, 0.0).mean())
        out[f"ndcg@{k}"] = float(np.where(hit, 1.0 / np.log2(ranks + 1.0), 0.0).mean())
    out["n_targets"] = len(ranks)
    return out


def conservative_ranks(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """scores (N, V) over all rows, targets (N,) rows -> ranks (N,) among rows 2..V-1, ties counted. A target of the
    unknown row (an item too rare in training for a row of its own) is never recommended: ranked past every item."""
    if torch.isnan(scores).any():
        raise ValueError("the model produced NaN scores")
    candidates = scores[:, N_RESERVED:]
    target = scores.gather(1, targets.view(-1, 1))
    ranks = (candidates >= target).sum(1)
    return torch.where(targets < N_RESERVED, candidates.shape[1] + 1, ranks)


@torch.no_grad()
def session_ranks(model, data: SessionData, max_cells: int = 2_000_000) -> np.ndarray:
    """Ranks of every target of every session (data already encoded to model rows).

    model.forward(items (B, T)) must return scores (B, T, V) where row t has seen items[:, :t+1] only;
    sessions are batched by length, each from the initial state (the model's forward starts there)."""
    model.eval()
    lengths = data.lengths()
    order = np.argsort(lengths, kind="stable")
    ranks = []
    i = 0
    while i < len(order):
        V = getattr(model, "n_items", 1)
        n = max(1, max_cells // (int(lengths[order[i]]) * V))
        n = max(1, max_cells // (int(lengths[order[min(i + n, len(order)) - 1]]) * V))  # longest in the chunk
        chunk = order[i:i + n]
        T = int(lengths[chunk].max())
        items = np.zeros((len(chunk), T), dtype=np.int64)
        for row, s in enumerate(chunk):
            seq = data.session(s)
            items[row, :len(seq)] = seq
        x = torch.from_numpy(items)
        scores = model(x[:, :-1])  # (B, T-1, V): after items[:t+1], predict items[t+1]
        targets = x[:, 1:]
        mask = targets != 0
        ranks.append(conservative_ranks(scores[mask], targets[mask]).numpy())
        i += len(chunk)
    return np.concatenate(ranks)


def evaluate_sessions(model, data: SessionData, ks: tuple[int, ...] = KS) -> dict:
    return rank_metrics(session_ranks(model, data), ks)


def popularity_metrics(train_rows: np.ndarray, data: SessionData, n_rows: int, ks: tuple[int, ...] = KS) -> dict:
    """What `evaluate_sessions` gives the popularity model (the training clicks' counts, `train_rows` of `n_rows`
    model rows) on `data` (encoded), from the counts alone: every target's rank is the same whatever the session
    did, so no item is scored per target. The next-item runs' baseline."""
    counts = np.bincount(train_rows, minlength=n_rows).astype(np.float64)
    candidates = np.sort(counts[N_RESERVED:])
    is_target = np.ones(data.n_events, dtype=bool)
    is_target[data.offsets[:-1]] = False  # every click after a session's first
    targets = data.items[is_target]
    ranks = len(candidates) - np.searchsorted(candidates, counts[targets], side="left")  # ties count against it
    return rank_metrics(np.where(targets < N_RESERVED, len(candidates) + 1, ranks), ks)
