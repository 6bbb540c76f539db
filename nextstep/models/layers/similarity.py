"""Inter-student heads of SimAKT's block 3: attention from a student's state to a memory bank of past students.

A memory bank is built offline (nextstep/training/kt/banks.py) from the complete trajectories of training
students, encoded by the trained model: entry m is a sequence of interaction states S_m[0..L) (d) with a
valid length. Every head type is one subclass of `BankHead`, registered by name, that answers two questions:

- `select(summaries, spec, seed)` (offline, numpy): which training trajectories make up each bank entry
  (k-means clusters for "cluster", farthest-first samples for "knn");
- `weights(q, keys)` (in the graph): how strongly the student's query at each position weighs each entry.

What they share: the position-weighted keys and values. At position t (the student has answered t + 1
questions) entry m is summarised as a weighted mean of its projected states,

    w(i, t) = decay^(t - i)                       for i <= t   (what the entry did at the same stage)
    w(i, t) = future_weight * decay^(i - t - 1)   for i > t    (what the entry went on to do)

over the entry's valid positions. The entry's future is a past student's, never the current student's.
The sums are exponential moving averages, computed for every t at once with cumulative sums in float64
(the seed's per-student, per-position Python loops, vectorised). They depend on the bank and the weights
only, so the service computes them once per bank version (`project`), not per request.

A new similarity module: subclass BankHead, implement `select` and `weights`, decorate with
`@register("name")`, and name it in a configuration (or give "type": "package.module:ClassName").
"""

import importlib
import math
from typing import ClassVar

import numpy as np
import torch
from torch import nn

REGISTRY: dict[str, type["BankHead"]] = {}


def register(name: str, registry: dict | None = None):
    """Class decorator: the head type `name` in `registry` (block 3's REGISTRY unless given)."""
    def add(cls):
        (REGISTRY if registry is None else registry)[name] = cls
        cls.kind = name
        return cls
    return add


def head_class(type_name: str, registry: dict | None = None, base: type | None = None) -> type:
    """The class registered under a type name, or a subclass of `base` named "package.module:ClassName" (block 3's
    heads by default; answer_head_class for the heads at the answer)."""
    registry, base = (REGISTRY, BankHead) if registry is None else (registry, base)
    if type_name in registry:
        return registry[type_name]
    if ":" in type_name:
        module, _, cls_name = type_name.partition(":")
        try:
            cls = getattr(importlib.import_module(module), cls_name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"cannot load {base.__name__} {type_name!r}: {e}") from None
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ValueError(f"{type_name!r} is not a {base.__name__} subclass")
        return cls
    raise ValueError(f"unknown {base.__name__} type {type_name!r}; registered: {sorted(registry)}, or "
                     f"'package.module:ClassName'")


def position_weighted(states: torch.Tensor, lengths: torch.Tensor, decay: float, future_weight: float) -> torch.Tensor:
    """states (M, L, e), lengths (M,) -> (L, M, e): entry m summarised at each position t (module docstring)."""
    M, L, _ = states.shape
    x = states.double()
    i = torch.arange(L, device=states.device, dtype=torch.float64)
    valid = (i[None, :] < lengths[:, None]).double()  # (M, L)
    x = x * valid[..., None]
    up, down = decay ** i, decay ** (-i)  # decay in [0.5, 1] and L <= 256: both fit float64 easily
    past = (x * down[:, None]).cumsum(1) * up[:, None]  # sum_{i<=t} decay^(t-i) x_i
    past_w = (valid * down).cumsum(1) * up
    scaled, scaled_w = x * up[:, None], valid * up
    future = (scaled.sum(1, keepdim=True) - scaled.cumsum(1)) * (down / decay)[:, None]  # sum_{i>t} decay^(i-t-1) x_i
    future_w = (scaled_w.sum(1, keepdim=True) - scaled_w.cumsum(1)) * (down / decay)
    mean = (past + future_weight * future) / (past_w + future_weight * future_w).clamp(min=1e-300)[..., None]
    return mean.to(states.dtype).transpose(0, 1)


class BankHead(nn.Module):
    """One inter-student head: its own key/value projections of the bank (d_model -> d_head) and a weighting."""

    kind: ClassVar[str] = "abstract"

    @property
    def min_entries(self) -> int:
        """The fewest bank entries the head's graphs take (the export declares it: a bank size its weighting needs
        more of would make the exporter capture the graph twice, first with too wide a range)."""
        return 2  # (one entry would be specialised away as a constant size)

    def __init__(self, d_model: int, d_head: int, spec):
        super().__init__()
        self.spec = spec
        self.d_head = d_head
        self.w_k = nn.Linear(d_model, d_head, bias=False)
        self.w_v = nn.Linear(d_model, d_head, bias=False)
        log_t = torch.tensor(math.log(spec.temperature))
        if spec.learn_temperature:
            self.log_temperature = nn.Parameter(log_t)
        else:
            self.register_buffer("log_temperature", log_t)

    @classmethod
    def select(cls, summaries: np.ndarray, spec, seed: int) -> list[np.ndarray]:
        """Offline: for each bank entry, the indices of the training trajectories it is made of."""
        raise NotImplementedError

    def weights(self, q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """q (B, T, dh), keys (T, M, dh) -> attention weights (B, T, M), each row summing to 1. Row (b, t) must
        depend on q[b, t] and keys[t] alone: streaming (`row`) weighs one row of many learners at once."""
        raise NotImplementedError

    def project(self, states: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bank (M, L, d), lengths (M,) -> position-weighted keys and values, each (L, M, dh)."""
        s = self.spec
        return (position_weighted(self.w_k(states), lengths, s.decay_factor, s.future_weight),
                position_weighted(self.w_v(states), lengths, s.decay_factor, s.future_weight))

    def forward(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """q (B, T, dh), keys/values (L, M, dh) -> (output (B, T, dh), weights (B, T, M))."""
        at = torch.arange(q.shape[1], device=q.device).clamp(max=keys.shape[0] - 1)  # beyond the bank: its end
        keys, values = keys[at], values[at]
        w = self.weights(q, keys)
        return torch.einsum("btm,tmd->btd", w, values), w

    def row(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, at: torch.Tensor):
        """One row per learner: q (N, dh) at positions at (N,), keys/values (L, M, dh) -> (output (N, dh),
        weights (N, M)); the rows go to `weights` as the positions of one sequence."""
        at = at.clamp(max=keys.shape[0] - 1)
        keys, values = keys[at], values[at]  # (N, M, dh)
        w = self.weights(q[None], keys)[0]
        return torch.einsum("nm,nmd->nd", w, values), w


def _farthest_first(x: np.ndarray, k: int, seed: int) -> np.ndarray:
    """k rows of x, each the farthest (Euclidean) from those already chosen; starts at a seeded random row.
    One vector update of every row's distance to the chosen set per pick: O(k n d)."""
    n = len(x)
    first = int(np.random.default_rng(seed).integers(n))
    chosen = [first]
    nearest = ((x - x[first]) ** 2).sum(1)
    for _ in range(min(k, n) - 1):
        nxt = int(nearest.argmax())
        chosen.append(nxt)
        nearest = np.minimum(nearest, ((x - x[nxt]) ** 2).sum(1))
    return np.asarray(chosen, dtype=np.int64)


def kmeans(x: np.ndarray, k: int, seed: int, iters: int = 100, restarts: int = 3) -> np.ndarray:
    """Cluster labels of the rows of x: Lloyd's algorithm from k-means++ seeds, the best of `restarts` by
    inertia (what scikit-learn's KMeans does, without its dependency). Vectorised: one (n, k) distance
    matrix per iteration; an emptied cluster is re-seeded at the row farthest from its centre."""
    rng = np.random.default_rng(seed)
    n = len(x)
    k = min(k, n)
    sq = (x * x).sum(1)
    best, best_inertia = None, np.inf
    for _ in range(restarts):
        centres = [x[rng.integers(n)]]
        nearest = ((x - centres[0]) ** 2).sum(1)
        for _ in range(k - 1):  # k-means++: the next seed with probability proportional to squared distance
            total = nearest.sum()
            i = rng.choice(n, p=nearest / total) if total > 0 else rng.integers(n)
            centres.append(x[i])
            nearest = np.minimum(nearest, ((x - x[i]) ** 2).sum(1))
        c = np.stack(centres)
        labels = None
        for _ in range(iters):
            dist = sq[:, None] + (c * c).sum(1)[None, :] - 2 * x @ c.T  # (n, k)
            new = dist.argmin(1)
            if labels is not None and (new == labels).all():
                break
            labels = new
            counts = np.bincount(labels, minlength=k)
            sums = np.zeros_like(c)
            np.add.at(sums, labels, x)
            empty = counts == 0
            c = np.where(empty[:, None], c, sums / np.maximum(counts, 1)[:, None])
            if empty.any():  # re-seed empty clusters at the worst-served rows
                far = np.argsort(-dist[np.arange(n), labels])[:int(empty.sum())]
                c[empty] = x[far]
        inertia = float(((x - c[labels]) ** 2).sum())
        if inertia < best_inertia:
            best, best_inertia = labels, inertia
    return best


@register("cluster")
class ClusterHead(BankHead):
    """Bank: k-means centroids of the trajectory summaries (each entry averages its members' states).
    Weights: softmax over every centroid of q . k / (sqrt(dh) temperature), or cosine / temperature."""

    @classmethod
    def select(cls, summaries, spec, seed):
        labels = kmeans(np.asarray(summaries, dtype=np.float64), spec.size, seed)
        groups = [np.flatnonzero(labels == c) for c in range(labels.max() + 1)]
        return [g for g in groups if len(g)]

    def weights(self, q, keys):
        if self.spec.similarity_metric == "cosine":
            q = nn.functional.normalize(q, dim=-1)
            keys = nn.functional.normalize(keys, dim=-1)
            scores = torch.einsum("btd,tmd->btm", q, keys)
        else:
            scores = torch.einsum("btd,tmd->btm", q, keys) / math.sqrt(self.d_head)
        return torch.softmax(scores / self.log_temperature.exp(), dim=-1)


@register("knn")
class KNNHead(BankHead):
    """Bank: `size` diverse trajectories chosen by farthest-first sampling of the summaries.
    Weights: the `k_neighbors` entries nearest to q (Euclidean), softmax(-distance / temperature)."""

    @classmethod
    def select(cls, summaries, spec, seed):
        return [np.array([i]) for i in _farthest_first(np.asarray(summaries, dtype=np.float64), spec.size, seed)]

    @property
    def min_entries(self) -> int:
        return max(2, self.spec.k_neighbors)  # (top-k of the bank)

    def weights(self, q, keys):
        sq = (q * q).sum(-1, keepdim=True) + (keys * keys).sum(-1)[None] - 2 * torch.einsum("btd,tmd->btm", q, keys)
        distance = sq.clamp(min=1e-12).sqrt()  # (B, T, M)
        near, index = torch.topk(-distance, self.spec.k_neighbors, dim=-1)  # the nearest; banks hold >= k
        w = torch.softmax(near / self.log_temperature.exp(), dim=-1)
        return torch.zeros_like(distance).scatter(-1, index, w)


# --------------------------------------------------------------------------------------------- answer-stage heads

ANSWER_REGISTRY: dict[str, type["AnswerHead"]] = {}


def answer_head_class(type_name: str) -> type["AnswerHead"]:
    return head_class(type_name, ANSWER_REGISTRY, AnswerHead)


class AnswerHead(nn.Module):
    """A head at the answer: it reads the knowledge read out for the question being asked (h, what the answer MLP
    reads) and that question, consults its bank, and adds a term to the answer's logit. Block 3's heads cannot
    condition on the question being predicted (block 4 reads positions before it); these can.

    `build(entries, n_rows, generator)` (offline) turns training students' interactions into the bank tensors
    (entries: "h" (N, d) the read-out before each answer, "rows" (N,) the question rows, "responses" (N,), and
    "expected" (N,) the model's P(right) from the answer MLP alone, without answer heads);
    `forward(h, questions, *bank)` -> the logit term (B, R). A head must add exactly 0 at initialisation (the
    model starts as its baseline) and may use the bank only (never the student's own answers, which the model's
    other parts already read causally)."""

    kind: ClassVar[str] = "abstract"
    parts: ClassVar[tuple[str, ...]] = ()  # the bank tensors' names, in the order forward takes them
    entry_parts: ClassVar[tuple[str, ...]] = ()  # those with a row per bank entry (the others: per question row)

    def __init__(self, d_model: int, spec):
        super().__init__()
        self.spec = spec

    def build(self, entries: dict[str, torch.Tensor], n_rows: int,
              generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError


@register("peers", ANSWER_REGISTRY)
class PeerAnswers(AnswerHead):
    """Other students' answers to the same question, weighted by how alike their knowledge of it was, next to
    what the model expected of them.

    Bank: for every question row, up to `size` training interactions on it (a seeded sample where there are
    more), each as its key k = unit(K h_peer) (h_peer: the peer's read-out for that question just before
    answering it; K a fixed random projection d -> d_key, so a bank depends on the encoder only), its response
    r and the answer MLP's P(right) for it, e (without answer heads, so a bank never depends on its own head);
    stored sorted by row with each row's first index and count, and the bank's mean response m.

    Answer for question q with read-out h: a = softmax over q's peers of cos(Q h, k) / temperature (Q learned,
    starting at K), and with n peers and smoothing 2 towards m, s(p) = logit((p n + 2 m) / (n + 2)) - logit(m):

        term = w . [s(sum a r), s(sum a e), s(mean r), s(mean e), log(1 + n)] + b   (w, b start at 0: the
                                                                                    baseline exactly)

    The pairs say how alike peers answered and how the model expected them to: where the model under- or
    overrates a question for students like this one (the question's difficulty shrunk by its regularisation,
    or a skill the read-out misses), the two differ. A question without peers (unseen in training) gets the
    constant b."""

    parts = ("keys", "responses", "expected", "first", "count", "mean")
    entry_parts = ("keys", "responses", "expected")

    def __init__(self, d_model: int, spec):
        super().__init__(d_model, spec)
        key_map = torch.empty(d_model, spec.d_key)
        nn.init.orthogonal_(key_map)
        self.register_buffer("key_map", key_map)
        self.query_map = nn.Parameter(key_map.clone())
        log_t = torch.tensor(math.log(spec.temperature))
        self.log_temperature = nn.Parameter(log_t) if spec.learn_temperature else None
        if self.log_temperature is None:
            self.register_buffer("fixed_log_temperature", log_t)
        self.mix = nn.Linear(5, 1)
        nn.init.zeros_(self.mix.weight)
        nn.init.zeros_(self.mix.bias)

    def temperature(self) -> torch.Tensor:
        """The softmax temperature over the peers' key similarities, learned or fixed by the spec."""
        return (self.log_temperature if self.log_temperature is not None else self.fixed_log_temperature).exp()

    def build(self, entries, n_rows, generator):
        """-> (keys (N', d_key), responses (N',), expected (N',), first (n_rows,), count (n_rows,), mean (1,)),
        at most `size` entries per row, sorted by row; float32 but for first and count."""
        rows = entries["rows"]
        order = torch.randperm(len(rows), generator=generator)  # which peers a row keeps where it has too many
        order = order[torch.sort(rows[order], stable=True).indices]
        sorted_rows = rows[order]
        count = torch.bincount(sorted_rows, minlength=n_rows)
        first = count.cumsum(0) - count
        rank = torch.arange(len(order)) - first[sorted_rows]
        keep = order[rank < self.spec.size]
        count = count.clamp(max=self.spec.size)
        keys = nn.functional.normalize(entries["h"][keep].float() @ self.key_map.cpu(), dim=-1)
        responses = entries["responses"][keep].float()
        mean = (responses.mean() if len(keep) else torch.tensor(0.5)).clamp(0.01, 0.99).reshape(1)
        return keys, responses, entries["expected"][keep].float(), count.cumsum(0) - count, count, mean

    def forward(self, h: torch.Tensor, questions: torch.Tensor, keys: torch.Tensor, responses: torch.Tensor,
                expected: torch.Tensor, first: torch.Tensor, count: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """h (B, R, d), questions (B, R) rows -> the logit term (B, R)."""
        return self.mix(self.features(h, questions, keys, responses, expected, first, count, mean)).squeeze(-1)

    def features(self, h: torch.Tensor, questions: torch.Tensor, keys: torch.Tensor, responses: torch.Tensor,
                 expected: torch.Tensor, first: torch.Tensor, count: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
        """What `mix` maps to the term: (B, R, 5)."""
        P = self.spec.size
        slot = torch.arange(P, device=h.device)
        n = count[questions]  # (B, R)
        valid = slot < n[..., None]  # (B, R, P)
        index = (first[questions][..., None] + slot).clamp(max=keys.shape[0] - 1)
        k, r, e = keys[index], responses[index], expected[index]  # (B, R, P, d_key), (B, R, P) twice
        q = nn.functional.normalize(h @ self.query_map, dim=-1)
        score = torch.einsum("brd,brpd->brp", q, k) / self.temperature()
        score = score.masked_fill(~valid, -1e4)
        a = torch.softmax(score, dim=-1) * valid
        plain = valid / n.clamp(min=1)[..., None]
        nf = n.to(h.dtype)
        centre = torch.log(mean / (1 - mean))

        def smoothed(p):
            s = (p * nf + 2 * mean) / (nf + 2)
            return torch.log(s / (1 - s)) - centre

        means = [smoothed((w * x).sum(-1)) for w in (a, plain) for x in (r, e)]
        return torch.stack([*means, torch.log1p(nf)], -1)
