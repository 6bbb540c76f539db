"""Training losses for ordinal (K-category) response prediction.

Every loss takes log-probabilities (N, K) from a model's log-softmax (any leading shape is
flattened here too) and int64 targets (N,), and returns a scalar mean over N. Callers
drop masked positions; an empty batch gives a 0.0 that stays attached to the graph, so
``loss.backward()`` works for a batch with no valid positions.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "COMPONENTS",
    "CombinedLoss",
    "class_weights",
    "coral_loss",
    "cross_entropy",
    "cumulative_logits_from_log_probs",
    "focal_loss",
    "qwk_loss",
    "weighted_ordinal_loss",
]

COMPONENTS = ("ce", "focal", "qwk", "coral", "weighted_ordinal")

# Clamping P(Y > k) to [eps, 1 - eps] equals clamping its logit to [-L, L].
_CUM_EPS = 1e-7
_CUM_LOGIT_MAX = math.log((1.0 - _CUM_EPS) / _CUM_EPS)


def _flat(x: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., C) scores and (...) targets -> (N, C) and (N,) int64, checking they line up."""
    x = x.reshape(-1, x.shape[-1])
    t = targets.reshape(-1).long()
    if t.shape[0] != x.shape[0]:
        raise ValueError(f"{x.shape[0]} score rows but {t.shape[0]} targets")
    return x, t


def _mean(per_item: torch.Tensor) -> torch.Tensor:
    """Mean over items; 0.0 (still attached to the graph) for an empty batch instead of nan."""
    return per_item.sum() / max(per_item.numel(), 1)


def _nll(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-item -log p_y."""
    return -log_probs.gather(1, targets.unsqueeze(1)).squeeze(1)


def cross_entropy(log_probs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean -log p_y (equals F.nll_loss, but 0.0 rather than nan on an empty batch)."""
    lp, t = _flat(log_probs, targets)
    return _mean(_nll(lp, t))


def focal_loss(
    log_probs: torch.Tensor, targets: torch.Tensor, gamma: float = 2.0, alpha: float = 1.0
) -> torch.Tensor:
    """alpha (1 - p_t)^gamma CE: down-weights items the model already gets right (gamma=0 is CE)."""
    lp, t = _flat(log_probs, targets)
    lp_t = lp.gather(1, t.unsqueeze(1)).squeeze(1)
    modulator = (1.0 - lp_t.exp()).clamp_min(0.0) ** gamma
    return _mean(alpha * modulator * -lp_t)


def _qwk_weights(n_cats: int, like: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(n_cats, dtype=like.dtype, device=like.device)
    return (idx[:, None] - idx[None, :]) ** 2 / (n_cats - 1) ** 2


def qwk_loss(log_probs: torch.Tensor, targets: torch.Tensor, n_cats: int, eps: float = 1e-7) -> torch.Tensor:
    """Differentiable 1 - QWK from the soft confusion matrix.

    O[i, j] = sum over items with y = i of p_j (expected counts), E = outer(marginals) / N,
    loss = sum(W*O) / (sum(W*E) + eps) with disagreement weights W = (i-j)^2/(K-1)^2; this
    is 1 - kappa (0 when perfect, about 1 at chance). It is a batch-level statistic: a batch
    holding a single true class gives 1 with zero gradient, so pair it with CE.
    """
    if n_cats < 2:
        raise ValueError(f"qwk_loss needs n_cats >= 2, got {n_cats}")
    lp, t = _flat(log_probs, targets)
    if lp.shape[1] != n_cats:
        raise ValueError(f"log_probs has {lp.shape[1]} categories, expected {n_cats}")
    n = lp.shape[0]
    if n == 0:
        return lp.sum() * 0.0
    p = lp.exp()
    onehot = F.one_hot(t, n_cats).to(p.dtype)
    O = onehot.T @ p / n  # normalised by N so eps is independent of batch size
    E = torch.outer(onehot.mean(0), p.mean(0))
    W = _qwk_weights(n_cats, p)
    return (W * O).sum() / ((W * E).sum() + eps)


def cumulative_logits_from_log_probs(log_probs: torch.Tensor) -> torch.Tensor:
    """(..., K) category log-probabilities -> (..., K-1) logits of P(Y > k), k = 0..K-2.

    Lets CORAL train models without a native cumulative head. Computed in log space,
    logit = log P(Y > k) - log P(Y <= k), which avoids the 1 - p cancellation; clamped to
    the logit of [1e-7, 1 - 1e-7] so that a certain category gives finite values.
    """
    upper = torch.logcumsumexp(log_probs.flip(-1), dim=-1).flip(-1)[..., 1:]  # log P(Y > k)
    lower = torch.logcumsumexp(log_probs, dim=-1)[..., :-1]  # log P(Y <= k)
    return (upper - lower).clamp(-_CUM_LOGIT_MAX, _CUM_LOGIT_MAX)


def coral_loss(cum_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over thresholds k of BCE(logit P(Y > k), [y > k]), then mean over items."""
    if cum_logits.shape[-1] < 1:
        raise ValueError("coral_loss needs at least one threshold (K >= 2)")
    z, t = _flat(cum_logits, targets)
    thresholds = torch.arange(z.shape[1], device=z.device)
    labels = (t.unsqueeze(1) > thresholds).to(z.dtype)
    per_item = F.binary_cross_entropy_with_logits(z, labels, reduction="none").mean(dim=1)
    return _mean(per_item)


def weighted_ordinal_loss(
    log_probs: torch.Tensor,
    targets: torch.Tensor,
    class_weights: torch.Tensor | None = None,
    ordinal_penalty: float = 0.5,
    distance: str = "linear",
) -> torch.Tensor:
    """w_y (1 + penalty * D(argmax, y)) * CE, averaged over items (seed 6.2.5).

    The factor scales the CE of items predicted far from the truth; argmax has no gradient,
    so the factor is a per-item constant. D is |j - k| ("linear") or (j - k)^2
    ("quadratic"). class_weights None means uniform weights.
    """
    if distance not in ("linear", "quadratic"):
        raise ValueError(f"distance must be 'linear' or 'quadratic', got {distance!r}")
    if ordinal_penalty < 0:
        raise ValueError(f"ordinal_penalty must be >= 0, got {ordinal_penalty}")
    lp, t = _flat(log_probs, targets)
    with torch.no_grad():
        d = (lp.argmax(dim=1) - t).abs().to(lp.dtype)
        if distance == "quadratic":
            d = d * d
        factor = 1.0 + ordinal_penalty * d
        if class_weights is not None:
            w = torch.as_tensor(class_weights, dtype=lp.dtype, device=lp.device)
            if w.shape != (lp.shape[1],):
                raise ValueError(f"class_weights must have shape ({lp.shape[1]},), got {tuple(w.shape)}")
            factor = factor * w[t]
    return _mean(factor * _nll(lp, t))


def class_weights(targets_counts: Sequence[float] | torch.Tensor, strategy: str = "balanced") -> torch.Tensor:
    """Per-class weights from class counts c_k: "balanced" N / (K c_k), or its square root.

    Clamped to [0.01, 100] so that a rare (or absent) class cannot dominate training.
    """
    c = torch.as_tensor(targets_counts, dtype=torch.float64).reshape(-1)
    if c.numel() == 0 or (c < 0).any() or c.sum() <= 0:
        raise ValueError("targets_counts must be non-negative with a positive total")
    if strategy not in ("balanced", "sqrt_balanced"):
        raise ValueError(f"strategy must be 'balanced' or 'sqrt_balanced', got {strategy!r}")
    w = c.sum() / (c.numel() * c)  # inf for an absent class, clamped below
    if strategy == "sqrt_balanced":
        w = w.sqrt()
    return w.clamp(0.01, 100.0).float()


class CombinedLoss(nn.Module):
    """Weighted sum of the losses above, e.g. {"ce": 0.6, "qwk": 0.2, "focal": 0.2}.

    Components with weight 0 are skipped. "coral" uses the model's cumulative logits when
    passed to forward, else converts the category log-probabilities.
    """

    def __init__(
        self,
        n_cats: int,
        weights: Mapping[str, float],
        *,
        focal_gamma: float = 2.0,
        ordinal_penalty: float = 0.5,
        class_weights: Sequence[float] | torch.Tensor | None = None,
    ):
        super().__init__()
        if n_cats < 2:
            raise ValueError(f"n_cats must be >= 2, got {n_cats}")
        for key, value in weights.items():
            if key not in COMPONENTS:
                raise ValueError(f"unknown loss component {key!r}; expected one of {COMPONENTS}")
            if not math.isfinite(float(value)) or value < 0:
                raise ValueError(f"loss weight for {key!r} must be finite and >= 0, got {value}")
        self.weights = {k: float(v) for k, v in weights.items() if v > 0}
        if not self.weights:
            raise ValueError(f"all loss weights are zero: {dict(weights)}")
        self.n_cats = n_cats
        self.focal_gamma = focal_gamma
        self.ordinal_penalty = ordinal_penalty
        cw = None if class_weights is None else torch.as_tensor(class_weights, dtype=torch.float32)
        if cw is not None and cw.shape != (n_cats,):
            raise ValueError(f"class_weights must have shape ({n_cats},), got {tuple(cw.shape)}")
        self.register_buffer("class_weights", cw)  # moves with .to(device)

    @classmethod
    def from_spec(cls, spec: str | Mapping[str, float], n_cats: int, **kwargs) -> CombinedLoss:
        """Build from "ce", "ce=0.6,qwk=0.2,focal=0.2" (a bare name means weight 1) or a dict."""
        if isinstance(spec, str):
            weights: dict[str, float] = {}
            for item in filter(None, (s.strip() for s in spec.split(","))):
                key, _, value = (part.strip() for part in item.partition("="))
                if key in weights:
                    raise ValueError(f"loss component {key!r} given twice in {spec!r}")
                try:
                    weights[key] = float(value) if value else 1.0
                except ValueError:
                    raise ValueError(f"bad weight for loss component {key!r}: {value!r}") from None
            spec = weights
        return cls(n_cats, spec, **kwargs)

    @property
    def spec(self) -> str:
        return ",".join(f"{k}={v:g}" for k, v in self.weights.items())

    def extra_repr(self) -> str:
        return f"n_cats={self.n_cats}, spec={self.spec!r}"

    def component(
        self,
        name: str,
        log_probs: torch.Tensor,
        targets: torch.Tensor,
        cum_logits: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One unweighted component, for logging the parts of the total."""
        if name == "ce":
            return cross_entropy(log_probs, targets)
        if name == "focal":
            return focal_loss(log_probs, targets, gamma=self.focal_gamma)
        if name == "qwk":
            return qwk_loss(log_probs, targets, self.n_cats)
        if name == "coral":
            z = cumulative_logits_from_log_probs(log_probs) if cum_logits is None else cum_logits
            return coral_loss(z, targets)
        if name == "weighted_ordinal":
            return weighted_ordinal_loss(log_probs, targets, self.class_weights, self.ordinal_penalty)
        raise ValueError(f"unknown loss component {name!r}")

    def forward(
        self, log_probs: torch.Tensor, targets: torch.Tensor, cum_logits: torch.Tensor | None = None
    ) -> torch.Tensor:
        if log_probs.shape[-1] != self.n_cats:
            raise ValueError(f"log_probs has {log_probs.shape[-1]} categories, expected {self.n_cats}")
        total = None
        for name, weight in self.weights.items():
            term = weight * self.component(name, log_probs, targets, cum_logits)
            total = term if total is None else total + term
        return total


class OutputLoss(nn.Module):
    """A knowledge-tracing family's loss over its model's whole output, as its registry entry names it:
    `OutputLoss(spec, n_cats)(out, targets, mask)`, the `CombinedLoss` of `spec` on the log-probabilities at the real
    positions (`mask`). A family whose output carries more for its loss says so in its own subclass."""

    def __init__(self, spec: str | Mapping[str, float], n_cats: int):
        super().__init__()
        self.combined = CombinedLoss.from_spec(spec, n_cats)

    def forward(self, out, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.combined(out.log_probs[mask], targets[mask])


class GPCMLoss(OutputLoss):
    """The Deep-GPCM families' loss over a `GPCMOutput`: the CORAL term takes the cumulative logits of an output that
    has them (the CORAL variant), and the order penalty its config asks for is added at the real positions."""

    def forward(self, out, targets: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        cum = out.cum_logits
        value = self.combined(out.log_probs[mask], targets[mask], None if cum is None else cum[mask])
        if out.order_penalty is not None:
            value = value + out.order_penalty[mask].mean()
        return value
