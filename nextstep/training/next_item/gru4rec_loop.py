"""Training GRU4Rec: session-parallel mini-batches, shared sampled negatives, Adagrad with momentum.

Session-parallel mini-batches (Hidasi et al. 2016): B slots each walk through one session; at every
step slot b feeds the current item of its session and is scored on the next one. When a session has no
next item, the slot takes the next session in the epoch's order and its hidden state is zeroed before
that session's first item; when no session is left the slot is dropped, so every event of every
session is trained on (the batch shrinks at the end of an epoch instead of the epoch ending early).
The reset mask is computed afresh at every step (never carried over), so no false resets.

Scores are computed only for the B targets of the step plus n_sample extra negatives drawn once per
step for the whole mini-batch from popularity^sample_alpha: a (B, B + n_sample) matrix whose diagonal
holds each slot's target. The whole catalogue is never scored in training.

The losses on that matrix and the gradients of a step are in gru4rec_step.py. A step whose only column is
its own target (the last slot of an epoch with n_sample = 0) has no negative: its state advances, but it
adds no loss.
"""

from dataclasses import dataclass, field

import numpy as np
import torch

from ...models.gru4rec import GRU4Rec
from ..data import ITEM_UNKNOWN_SHARE, check_unknown_options
from ..loop import Counted, print_line, print_row, train_epochs
from .gru4rec_step import LOSSES, TrainStep
from .sessions import SessionData


@dataclass
class GRU4RecTrainConfig:
    loss: str = "cross-entropy"
    epochs: int = 10
    batch_size: int = 32
    lr: float = 0.2
    momentum: float = 0.2
    n_sample: int = 512  # extra negatives per step, shared by the mini-batch
    sample_alpha: float = 0.5  # negatives ~ popularity^alpha
    logq: float = 1.0  # logQ correction strength (cross-entropy); 0 turns it off
    bpreg: float = 1.0  # bpr-max score regularisation
    elu_param: float = 0.0  # bpr-max: ELU on the scores first (0: off)
    session_order: str = "random"  # "random" (reshuffled each epoch) or "time" (by session start)
    seed: int = 0
    threads: int = 1  # torch intra-op threads (0: torch default); 1 is fastest for these small matrices
    model: dict = field(default_factory=dict)  # GRU4RecConfig overrides
    # the unknown row (1), which stands for items added after training (next_item_run.py): items clicked fewer times
    # share it, and a seeded share of the training clicks goes through it
    min_item_count: int = 1
    unknown_share: float = ITEM_UNKNOWN_SHARE

    def __post_init__(self):
        check_unknown_options(self.min_item_count, self.unknown_share)
        if self.loss not in LOSSES:
            raise ValueError(f"loss must be one of {LOSSES}, got {self.loss!r}")
        if self.session_order not in ("random", "time"):
            raise ValueError(f"session_order must be 'random' or 'time', got {self.session_order!r}")
        for name in ("epochs", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("lr", "n_sample", "sample_alpha", "logq", "bpreg", "elu_param"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")


def session_parallel(offsets: np.ndarray, order: np.ndarray, batch_size: int):
    """Yield (positions, keep, reset) per step: `positions` (B,) index the input events (targets are the
    next positions); before using the hidden state, keep only rows `keep` (None: all) and then zero rows
    `reset` (None: none). `order` lists the sessions in the order they enter slots."""
    k = min(batch_size, len(order))
    start, end = offsets[order[:k]].copy(), offsets[order[:k] + 1].copy()
    upcoming = k
    keep, reset = None, np.ones(k, bool)
    while len(start):
        run = int((end - start).min()) - 1  # steps every slot can take before one of them needs a new session
        for i in range(run):
            yield start + i, keep, reset
            keep = reset = None
        start = start + max(run, 0)
        done = np.flatnonzero(end - start <= 1)
        new = order[upcoming:upcoming + len(done)]
        upcoming += len(new)
        fill, drop = done[:len(new)], done[len(new):]
        start[fill], end[fill] = offsets[new], offsets[new + 1]
        reset_rows = np.zeros(len(start), bool)
        reset_rows[fill] = True
        reset = reset_rows if reset is None else reset | reset_rows
        if len(drop):
            kept = np.ones(len(start), bool)
            kept[drop] = False
            keep = kept if keep is None else _compose(keep, kept)
            start, end, reset = start[kept], end[kept], reset[kept]


def carry(state: tuple[torch.Tensor, ...], keep: np.ndarray | None, reset: np.ndarray | None):
    """Apply one step's slot changes from `session_parallel` to a state: keep rows, then zero reset rows."""
    if keep is not None:
        keep_t = torch.from_numpy(keep)
        state = tuple(h[keep_t] for h in state)
    if reset is not None:
        reset_t = torch.from_numpy(reset).unsqueeze(1)
        state = tuple(h.masked_fill(reset_t, 0.0) for h in state)
    return state


def _compose(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    """Row selection `first` (over the old rows) followed by `second` (over the rows that survived it)."""
    out = np.zeros(len(first), bool)
    out[np.flatnonzero(first)[second]] = True
    return out


def sampling_probabilities(counts: np.ndarray, alpha: float) -> np.ndarray:
    """P(an extra negative is item j) ∝ count_j^alpha; items never clicked (padding, unknown) are never drawn."""
    weights = np.where(counts > 0, counts.astype(np.float64) ** alpha, 0.0)
    return weights / weights.sum()


class NegativeSampler:
    """Draws item rows with probability popularity^alpha, a cache of many steps at a time."""

    def __init__(self, counts: np.ndarray, alpha: float, n_sample: int, generator: torch.Generator,
                 cache_steps: int = 2048):
        self.cdf = torch.cumsum(torch.from_numpy(sampling_probabilities(counts, alpha)), 0)
        self.cdf[-1] = 1.0
        self.n_sample, self.cache_steps, self.generator = n_sample, cache_steps, generator
        self.cache, self.used = torch.empty(0, n_sample, dtype=torch.long), 0

    def draw(self) -> torch.Tensor:
        if self.used == len(self.cache):  # inverse-CDF sampling: much faster than torch.multinomial here
            u = torch.rand(self.cache_steps * self.n_sample, dtype=torch.float64, generator=self.generator)
            flat = torch.searchsorted(self.cdf, u, right=True).clamp_(max=len(self.cdf) - 1)
            self.cache, self.used = flat.view(self.cache_steps, self.n_sample), 0
        self.used += 1
        return self.cache[self.used - 1]


class LogQ:
    """The logQ correction of a step's columns, as in the official code: an in-batch target (drawn from
    the click distribution) is corrected by strength * log count, an extra negative (drawn from
    popularity^alpha) by strength * alpha * log count. (docs/decisions.md: this beat the log of each
    item's expected number of columns on validation MRR@20.)"""

    def __init__(self, counts: np.ndarray, sample_alpha: float, strength: float = 1.0):
        log_count = torch.from_numpy(np.log(np.maximum(counts, 1))).float()  # never-clicked rows are never columns
        self.target, self.sampled = strength * log_count, strength * sample_alpha * log_count

    def __call__(self, columns: torch.Tensor, n_targets: int) -> torch.Tensor:
        return torch.cat([self.target.index_select(0, columns[:n_targets]),
                          self.sampled.index_select(0, columns[n_targets:])])


class AdagradM(torch.optim.Optimizer):
    """Adagrad with momentum, the optimiser of the official GRU4Rec: acc += g², m = momentum · m −
    lr · g / sqrt(acc + eps), p += m (eps inside the root, as there). Sparse gradients (item embeddings)
    update only the rows they touch: their squared-gradient accumulators and momenta included, so an
    item's embedding does not keep drifting on momentum in steps where it was not seen."""

    def __init__(self, params, lr: float, momentum: float = 0.0, eps: float = 1e-6):
        super().__init__(params, {"lr": lr, "momentum": momentum, "eps": eps})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, mu, eps = group["lr"], group["momentum"], group["eps"]
            dense = []
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["acc"] = torch.zeros_like(p)
                    state["mom"] = torch.zeros_like(p)
                if p.grad.is_sparse:
                    self._sparse_step(p, p.grad.coalesce(), state, lr, mu, eps)
                else:
                    dense.append(p)
            if dense:  # one fused pass over all dense parameters
                grads = [p.grad for p in dense]
                accs = [self.state[p]["acc"] for p in dense]
                torch._foreach_addcmul_(accs, grads, grads)
                denom = torch._foreach_add(accs, eps)
                torch._foreach_sqrt_(denom)
                moms = [self.state[p]["mom"] for p in dense]
                torch._foreach_mul_(moms, mu)
                torch._foreach_addcdiv_(moms, grads, denom, value=-lr)
                torch._foreach_add_(dense, moms)

    @staticmethod
    def _sparse_step(p, grad, state, lr, mu, eps):
        rows, values = grad.indices()[0], grad.values()  # coalesced: each row once
        acc = state["acc"].index_select(0, rows).addcmul_(values, values)  # index_select: ~3x faster than [rows]
        state["acc"].index_copy_(0, rows, acc)
        update = state["mom"].index_select(0, rows).mul_(mu).addcdiv_(values, acc.add_(eps).sqrt_(), value=-lr)
        state["mom"].index_copy_(0, rows, update)
        p.index_add_(0, rows, update)


def train_gru4rec(entry, cfg: GRU4RecTrainConfig, train: SessionData, n_items: int, progress: bool, log: bool):
    """GRU4Rec's fit as its registry entry names it: (model, history) on encoded sessions."""
    torch.manual_seed(cfg.seed)
    model = entry.build({"n_items": n_items, **cfg.model})
    return model, fit_gru4rec(model, train, cfg, progress=progress, log=log)


def fit_gru4rec(model: GRU4Rec, train: SessionData, cfg: GRU4RecTrainConfig, progress: bool = True,
                log: bool = True) -> list[dict]:
    """Train in place on encoded sessions for cfg.epochs (no validation, no early stopping); return one
    row per epoch (see loop.train_epochs: train_loss per target, targets, targets_per_second)."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    generator = torch.Generator().manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    counts = np.bincount(train.items, minlength=model.n_items)
    sampler = NegativeSampler(counts, cfg.sample_alpha, cfg.n_sample, generator) if cfg.n_sample else None
    log_q = LogQ(counts, cfg.sample_alpha, cfg.logq) if cfg.loss == "cross-entropy" and cfg.logq > 0 else None
    items = torch.from_numpy(train.items)
    optimizer = AdagradM(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    step = TrainStep(model, cfg.loss, cfg.bpreg, cfg.elu_param, cfg.batch_size)
    state = ()  # the slots' hidden state, carried from step to step within an epoch

    def epoch_batches(epoch: int):
        nonlocal state
        order = rng.permutation(len(train)) if cfg.session_order == "random" else np.arange(len(train))
        state = model.init_state(min(cfg.batch_size, len(order)))
        # the number of steps depends on how the sessions pack into the slots: counted (a dry run, cheap next to
        # the epoch) only for a progress bar's total
        return Counted(session_parallel(train.offsets, order, cfg.batch_size),
                       lambda: sum(1 for _ in session_parallel(train.offsets, order, cfg.batch_size)))

    def train_step(batch):
        nonlocal state
        positions, keep, reset = batch
        state = carry(state, keep, reset)
        pos = torch.from_numpy(positions)
        inputs, target = items.index_select(0, pos), items.index_select(0, pos + 1)
        columns = target if sampler is None else torch.cat([target, sampler.draw()])
        if len(columns) < 2:  # one slot left and no sampled negatives: nothing to rank the target against
            with torch.no_grad():
                state = model.advance(state, inputs)
            return None, 0, {"loss": 0.0}
        loss, state = step(state, inputs, columns, None if log_q is None else log_q(columns, len(target)))
        optimizer.step()
        return None, len(target), {"loss": loss}

    return train_epochs(model, cfg.epochs, epoch_batches, train_step, progress=progress,
                        report=print_row if log else None, say=print_line if log else None)
