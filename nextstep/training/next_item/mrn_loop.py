"""Training MRN (seed 004) with a real straight-through estimator.

Teacher forcing: a mini-batch is a set of whole sessions of similar length, padded; the model's full
pass `forward(items[:, :-1])` scores every item after each prefix (hard, discrete forward), and the
loss at each real position t (target items[:, t + 1], rows >= 2 only) is

    L = NLL + lambda_contrastive * max(0, margin - s_target + max_{j != target} s_j)
        + lambda_l2 * ||E||_F^2 / V

with s the model's scores (score_j = S_j / tau + b_j), NLL = -log softmax(s)_target over all item
rows j >= 2 (no sampling: one (positions, V) product per path is cheap enough), and the hard negative
of the contrastive term taken over all items too. The L2 term is normalised by the number of rows V,
so lambda_l2 is a per-item weight. Gradients reach the embeddings E through the straight-through
estimators of round/mod and the Gaussian surrogate of the exact match (see models/mrn.py).
Losses are averaged over positions; Adam, its learning rate falling linearly from lr to lr * lr_final
over the epochs.

Curriculum over K and L (seed section 5.5): `curriculum` lists stages [epochs, K, L]; they run first,
in order, with the model's active K and L capped at the stage's values; the remaining epochs (of
`epochs` in all) run with the model's own K and L.
"""

from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from ...models.mrn import MRN
from ..data import ITEM_UNKNOWN_SHARE, check_unknown_options
from ..loop import print_line, print_row, train_epochs
from .sessions import SessionData


@dataclass
class MRNTrainConfig:
    # epochs and lr_final: the setting validated with the family's model defaults (models/mrn.py FAMILY_DEFAULTS,
    # configs/mrn_rsc15_transition.json); the seed's were 8 and 1.0 (configs/mrn_seed.json)
    epochs: int = 12
    batch_size: int = 1024  # target positions per mini-batch (sessions are grouped to about this many)
    lr: float = 0.05
    lr_final: float = 0.1  # the last epoch's learning rate as a fraction of lr, linear in between (1: constant)
    lambda_contrastive: float = 0.0
    margin: float = 1.0
    lambda_l2: float = 0.0
    curriculum: list = field(default_factory=lambda: [[1, 1, 2], [1, 2, 4]])  # [epochs, K, L] stages
    seed: int = 0
    threads: int = 1
    model: dict = field(default_factory=dict)  # MRNConfig overrides
    # the unknown row (1), which stands for items added after training (next_item_run.py): items clicked fewer times
    # share it, and a seeded share of the training clicks goes through it
    min_item_count: int = 1
    unknown_share: float = ITEM_UNKNOWN_SHARE

    def __post_init__(self):
        check_unknown_options(self.min_item_count, self.unknown_share)
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "lr_final", "lambda_contrastive", "margin", "lambda_l2"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.curriculum = [list(map(int, stage)) for stage in self.curriculum]
        for stage in self.curriculum:
            if len(stage) != 3 or min(stage) < 1:
                raise ValueError(f"curriculum stages are [epochs, K, L] of positive integers, got {stage}")


def length_batches(lengths: np.ndarray, positions: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Sessions (>= 2 events) grouped by length into batches of about `positions` targets, shuffled."""
    usable = np.flatnonzero(lengths >= 2)
    order = usable[np.lexsort((rng.random(len(usable)), lengths[usable]))]
    batches, start = [], 0
    while start < len(order):
        per = max(1, positions // max(int(lengths[order[start]]) - 1, 1))
        end = min(start + per, len(order))
        per = max(1, positions // max(int(lengths[order[end - 1]]) - 1, 1))  # the longest decides
        end = min(start + per, len(order))
        batches.append(order[start:end])
        start = end
    return [batches[i] for i in rng.permutation(len(batches))]


def pad(data: SessionData, sessions: np.ndarray) -> torch.Tensor:
    lengths = data.lengths()[sessions]
    out = np.zeros((len(sessions), int(lengths.max())), np.int64)
    for row, s in enumerate(sessions):
        out[row, :lengths[row]] = data.session(s)
    return torch.from_numpy(out)


def mrn_loss(model: MRN, items: torch.Tensor, cfg: MRNTrainConfig) -> tuple[torch.Tensor, dict]:
    """Mean loss over the real positions of a padded batch (B, T) of sessions, and its parts."""
    scores = model(items[:, :-1])[..., 2:]  # (B, T-1, V-2): item rows only
    target = items[:, 1:]
    mask = target >= 2
    s, y = scores[mask], target[mask] - 2
    nll = F.cross_entropy(s, y)
    parts = {"nll": nll.item()}
    loss = nll
    if cfg.lambda_contrastive:
        positive = s.gather(1, y.view(-1, 1)).squeeze(1)
        negative = s.scatter(1, y.view(-1, 1), float("-inf")).max(1).values
        contrastive = F.relu(cfg.margin - positive + negative).mean()
        loss = loss + cfg.lambda_contrastive * contrastive
        parts["contrastive"] = contrastive.item()
    if cfg.lambda_l2:
        loss = loss + cfg.lambda_l2 * model.E.pow(2).sum() / model.n_items
    return loss, parts


def train_mrn(entry, cfg: MRNTrainConfig, train: SessionData, n_items: int, progress: bool, log: bool):
    """MRN's fit as its registry entry names it: (model, history) on encoded sessions; the entry's builder sets the
    family's defaults."""
    torch.manual_seed(cfg.seed)
    model = entry.build({"n_items": n_items, "seed": cfg.seed, **cfg.model})
    return model, fit_mrn(model, train, cfg, progress=progress, log=log)


def fit_mrn(model: MRN, train: SessionData, cfg: MRNTrainConfig, progress: bool = True,
            log: bool = True) -> list[dict]:
    """Train in place on encoded sessions for cfg.epochs (no validation, no early stopping); return one row
    per epoch (see loop.train_epochs): the stage's K and L, train_loss and its parts per target."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    rng = np.random.default_rng(cfg.seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    lengths = train.lengths()
    schedule = [(K, L) for epochs, K, L in cfg.curriculum for _ in range(epochs)]
    full = (model.cfg.parallel, model.cfg.history)

    def stage(epoch: int) -> dict:
        K, L = schedule[epoch - 1] if epoch <= len(schedule) else full
        model.k_active, model.l_active = min(K, full[0]), min(L, full[1])
        done = (epoch - 1) / max(cfg.epochs - 1, 1)
        for group in optimizer.param_groups:
            group["lr"] = cfg.lr * (1.0 - done * (1.0 - cfg.lr_final))
        return {"K": model.k_active, "L": model.l_active}

    def step(sessions):
        items = pad(train, sessions)
        loss, parts = mrn_loss(model, items, cfg)
        n = int((items[:, 1:] >= 2).sum())
        return loss, n, {key: value * n for key, value in {"loss": loss.item(), **parts}.items()}

    try:
        return train_epochs(model, cfg.epochs, lambda epoch: length_batches(lengths, cfg.batch_size, rng), step,
                            optimizer=optimizer, before_epoch=stage, progress=progress,
                            report=print_row if log else None, say=print_line if log else None)
    finally:
        model.k_active, model.l_active = full
