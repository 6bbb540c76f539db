"""The streaming contract (streaming.py) for next-item models, and the two count baselines.

    init_state(B) -> state                  per-session tensors (state_spec() names them)
    step(state, items (B,)) -> state        fold in the item just clicked
    readout(state, exclude (B, S), k)       the k best rows and their scores, never rows 0/1 or `exclude`
    forward(items (B, T)) -> (B, T, V)      scores after each prefix: row t has seen items[:, :t+1] only
    scores(state) -> (B, V)                 what a family defines: a score for every item row

Rows 0 (padding) and 1 (unknown) exist in every model but are never recommended; `exclude` is padded
with 0, so a ragged list of already-seen items needs no mask.
"""

import numpy as np
import torch
from torch import nn

RESERVED = 2  # rows 0 (padding) and 1 (unknown)


class NextItemModel(nn.Module):
    family = "next_item"
    task = "next_item"
    n_items: int

    def state_spec(self) -> list[dict]:
        raise NotImplementedError

    def init_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def step(self, state: tuple[torch.Tensor, ...], items: torch.Tensor) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def scores(self, state: tuple[torch.Tensor, ...]) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, items: torch.Tensor) -> torch.Tensor:
        state = self.init_state(items.shape[0])
        out = []
        for t in range(items.shape[1]):
            state = self.step(state, items[:, t])
            out.append(self.scores(state))
        return torch.stack(out, 1)

    def readout(self, state: tuple[torch.Tensor, ...], exclude: torch.Tensor, k: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """(top item rows (B, k) int64, their scores (B, k)), best first; rows 0/1 and `exclude` left out."""
        return top_k(self.scores(state), exclude, k)


def top_k(scores: torch.Tensor, exclude: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    blocked = torch.full_like(scores[:, :RESERVED], float("-inf"))
    scores = torch.cat([blocked, scores[:, RESERVED:]], 1)
    scores = scores.scatter(1, exclude, torch.full_like(exclude, 0, dtype=scores.dtype) + float("-inf"))
    values, rows = torch.topk(scores, k, dim=1)
    return rows, values


class LastItemModel(NextItemModel):
    """A model whose whole session state is the last item clicked (row 0 before any click)."""

    def state_spec(self) -> list[dict]:
        return [{"name": "last_item", "shape": [], "dtype": "int64"}]

    def init_state(self, batch: int) -> tuple[torch.Tensor, ...]:
        return (torch.zeros(batch, dtype=torch.int64),)

    def step(self, state, items):
        return (items,)


class Popularity(LastItemModel):
    """Scores are training click counts, whatever the session did. State: the last item (unused)."""

    family = "popularity"

    def __init__(self, n_items: int, counts: torch.Tensor | None = None):
        super().__init__()
        self.n_items = n_items
        self.register_buffer("counts", torch.zeros(n_items) if counts is None else counts.float())

    @classmethod
    def fit(cls, items: np.ndarray, n_items: int) -> "Popularity":
        return cls(n_items, torch.from_numpy(np.bincount(items, minlength=n_items).astype(np.float32)))

    def scores(self, state):
        return self.counts.unsqueeze(0).expand(state[0].shape[0], -1)


class Markov(LastItemModel):
    """First-order Markov chain: the score of j after item i is the number of training transitions i -> j
    (consecutive clicks within a session), ties broken by popularity (a share < 1 of a count, so it never
    outweighs one transition); a session without a known last item gets the popularity ranking. Each row
    keeps its `width` most frequent successors, exact for any cut-off K <= width (an item beyond them ranks
    below `width` others)."""

    family = "markov"

    def __init__(self, n_items: int, successors: torch.Tensor, counts: torch.Tensor, popularity: torch.Tensor):
        super().__init__()
        self.n_items = n_items
        # float64: a share < 1 added to counts in the tens of thousands must survive the addition
        self.register_buffer("popularity", popularity.double())  # (V,) in [0, 1): the tie-breaker
        self.register_buffer("successors", successors.long())  # (V, width) rows, padded with 0
        self.register_buffer("counts", counts.double())  # (V, width), 0 where padded

    @classmethod
    def fit(cls, items: np.ndarray, offsets: np.ndarray, n_items: int, width: int = 100) -> "Markov":
        same = np.ones(len(items), bool)
        same[offsets[1:-1]] = False  # a session's first item has no predecessor in the session
        same[0] = False
        prev, nxt = items[:-1][same[1:]], items[1:][same[1:]]
        pairs, counts = np.unique(prev * n_items + nxt, return_counts=True)
        src, dst = pairs // n_items, pairs % n_items
        order = np.lexsort((-counts, src))  # by source, most frequent successor first
        src, dst, counts = src[order], dst[order], counts[order]
        starts = np.searchsorted(src, np.arange(n_items))
        rank = np.arange(len(src)) - starts[src]
        width = max(1, min(width, int(rank.max()) + 1 if len(rank) else 1))
        keep = rank < width
        succ = np.zeros((n_items, width), np.int64)
        cnt = np.zeros((n_items, width), np.float64)
        succ[src[keep], rank[keep]] = dst[keep]
        cnt[src[keep], rank[keep]] = counts[keep]
        clicks = np.bincount(items, minlength=n_items).astype(np.float64)
        popularity = torch.from_numpy(clicks / (clicks.max() + 1.0))
        return cls(n_items, torch.from_numpy(succ), torch.from_numpy(cnt), popularity)

    def scores(self, state):
        last = state[0]
        base = self.popularity.unsqueeze(0).expand(last.shape[0], -1)
        return base.scatter_add(1, self.successors[last], self.counts[last])
