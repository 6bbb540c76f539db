"""Knowledge tracing's batching, training (`fit`) and batched evaluation, on the shared loop (training/loop.py).

Knowledge-tracing sequences arrive as (question indices, responses) pairs already mapped through the vocabulary.
Training cuts long sequences into chunks of `max_len` (each chunk starts from the initial memory,
as DKVMN does); evaluation by default runs every sequence whole, as the service sees a learner.
Batches group sequences of similar length so that padding costs little.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..data import MIN_COUNT, UNKNOWN_SHARE, check_unknown_options
from ..loop import Counted, print_line, print_row, train_epochs

Encoded = tuple[np.ndarray, np.ndarray]  # (question indices, responses), int64, same length


@dataclass
class TrainConfig:
    epochs: int = 60  # upper bound; early stopping usually ends sooner
    batch_size: int = 32
    lr: float = 3e-3  # Adam
    weight_decay: float = 0.0
    grad_clip: float = 10.0  # max global gradient norm
    max_len: int = 200  # training chunk length
    eval_max_len: int | None = None  # None: evaluate whole sequences (as served)
    valid_fraction: float = 0.1  # share of TRAINING students held out for early stopping
    patience: int = 8  # epochs without validation improvement before stopping
    lr_patience: int = 2  # epochs without improvement before the learning rate is halved
    # the weights validated, kept and exported are an exponential moving average of the trained ones, this decay per
    # step (None: the trained weights themselves); docs/decisions.md
    average: float | None = None
    monitor: str = "nll"  # validation metric for early stopping and the best checkpoint (see LOWER_IS_BETTER)
    loss: str = "ce"  # CombinedLoss spec, e.g. "ce" or "ce=0.6,qwk=0.2,focal=0.2"
    seed: int = 0
    model: dict = field(default_factory=dict)  # GPCMConfig overrides
    # the unknown row (1), which answers questions added after training: a question the fitting students answered
    # fewer times than min_question_count shares it, and a seeded unknown_share of the fitting interactions is given
    # through it (docs/guide/training.md, "Questions added after training")
    min_question_count: int = MIN_COUNT
    unknown_share: float = UNKNOWN_SHARE

    def __post_init__(self):
        check_unknown_options(self.min_question_count, self.unknown_share)
        if self.epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {self.epochs}")
        if not 0 < self.valid_fraction < 1:
            raise ValueError(f"valid_fraction must be in (0, 1): early stopping needs validation students, "
                             f"got {self.valid_fraction}")
        if self.average is not None and not 0 < self.average < 1:
            raise ValueError(f"average (a decay per step) must be in (0, 1), got {self.average}")
        if self.monitor not in MONITORS:
            raise ValueError(f"monitor must be one of {sorted(MONITORS)}, got {self.monitor!r}")


# validation metrics that can drive early stopping: True if lower is better
MONITORS = {"nll": True, "mae": True, "categorical_accuracy": False, "ordinal_accuracy": False, "qwk": False,
            "auc": False}


def chunk(seqs: list[Encoded], max_len: int | None) -> list[Encoded]:
    if max_len is None:
        return [s for s in seqs if len(s[0])]
    return [(q[i:i + max_len], r[i:i + max_len]) for q, r in seqs for i in range(0, len(q), max_len)]


def batches(seqs: list[Encoded], batch_size: int, rng: np.random.Generator | None = None):
    """Yield (questions, responses, mask) tensors (B, T); length-sorted, batch order shuffled by rng."""
    order = np.argsort([len(q) for q, _ in seqs], kind="stable")
    groups = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    if rng is not None:
        rng.shuffle(groups)
    for group in groups:
        T = max(len(seqs[i][0]) for i in group)
        q = np.zeros((len(group), T), dtype=np.int64)
        r = np.zeros((len(group), T), dtype=np.int64)
        mask = np.zeros((len(group), T), dtype=bool)
        for row, i in enumerate(group):
            n = len(seqs[i][0])
            q[row, :n], r[row, :n], mask[row, :n] = seqs[i][0], seqs[i][1], True
        yield torch.from_numpy(q), torch.from_numpy(r), torch.from_numpy(mask)


@torch.no_grad()
def predict_sequences(model, seqs: list[Encoded], batch_size: int = 128, max_len: int | None = None,
                      batcher: Callable = batches) -> dict:
    """Teacher-forced predictions at every real position: probs (N, K), targets, questions, and whatever else the
    model's output holds per position (the IRT families' theta, alpha and beta; DKT-style models output log_probs
    alone)."""
    model.eval()
    out = {"probs": [], "targets": [], "questions": []}
    for q, r, mask in batcher(chunk(seqs, max_len), batch_size):
        pred = model(q, r)
        out["probs"].append(pred.log_probs.exp()[mask].numpy())
        out["targets"].append(r[mask].numpy())
        out["questions"].append(q[mask].numpy())
        for name, value in _fields(pred).items():  # theta, alpha, beta where the model gives them
            if name != "log_probs" and isinstance(value, torch.Tensor):
                out.setdefault(name, []).append(value[mask].numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def _fields(out) -> dict:
    """A model output's fields by name (a NamedTuple's, or an object's attributes)."""
    return out._asdict() if isinstance(out, tuple) else vars(out)


def fit(model, train: list[Encoded], valid: list[Encoded], cfg: TrainConfig, *, batcher: Callable, loss: Callable,
        metrics: Callable, checkpoint: Path | None = None, progress: bool = True, log: bool = True,
        validate_start: bool = False) -> list[dict]:
    """Train with Adam, halving the learning rate and stopping early on validation `cfg.monitor`; leaves the
    best weights loaded (and saved to `checkpoint`). Returns the per-epoch history (see `train_epochs`).
    `validate_start`: the starting weights (a warm start) compete with the epochs' (history row 0).

    The family's parts (families.py): `batcher(seqs, batch_size, rng)` as `batches`, `loss(cfg.loss, n_cats)`
    the loss over the model's whole output, `loss(out, targets, mask)` (kt/losses.py's OutputLoss), `metrics(probs,
    targets)` the validation metrics."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    loss_fn = loss(cfg.loss, model.cfg.n_cats)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    chunks = chunk(train, cfg.max_len)

    def step(batch):
        q, r, mask = batch
        return loss_fn(model(q, r), r, mask), int(mask.sum())

    def validate():
        pred = predict_sequences(model, valid, max_len=cfg.eval_max_len, batcher=batcher)
        return metrics(pred["probs"], pred["targets"])

    n_batches = math.ceil(len(chunks) / cfg.batch_size)  # a batcher's groups: batch_size sequences, the last fewer
    return train_epochs(model, cfg.epochs, lambda epoch: Counted(batcher(chunks, cfg.batch_size, rng), n_batches),
                        step, optimizer=opt, grad_clip=cfg.grad_clip, validate=validate,
                        monitor=f"valid_{cfg.monitor}", lower_is_better=MONITORS[cfg.monitor], patience=cfg.patience,
                        lr_schedule=torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5,
                                                                               patience=cfg.lr_patience),
                        checkpoint=checkpoint, progress=progress, report=print_row if log else None,
                        validate_start=validate_start, average=cfg.average, say=print_line if log else None)
