"""The one training loop of every gradient-trained family (`train_epochs`), and knowledge tracing's
batching, training (`fit`) and batched evaluation.

Knowledge-tracing sequences arrive as (question indices, responses) pairs already mapped through the vocabulary.
Training cuts long sequences into chunks of `max_len` (each chunk starts from the initial memory,
as DKVMN does); evaluation by default runs every sequence whole, as the service sees a learner.
Batches group sequences of similar length so that padding costs little.
"""

import math
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

from .data import MIN_COUNT, UNKNOWN_SHARE, check_unknown_options

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


class Counted:
    """An epoch's batches and how many there are (a number, or a function counting them when asked): the total
    of the progress bar, which without it can show neither how far the epoch is nor when it ends."""

    def __init__(self, batches: Iterable, n: int | Callable[[], int]):
        self.batches, self.n = batches, n

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return self.n() if callable(self.n) else self.n


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
    """Teacher-forced predictions at every real position: probs (N, K), targets, questions, and theta and
    alpha where the model has them (the IRT families; DKT-style models output log_probs alone)."""
    model.eval()
    out = {"probs": [], "targets": [], "questions": []}
    for q, r, mask in batcher(chunk(seqs, max_len), batch_size):
        pred = model(q, r)
        out["probs"].append(pred.log_probs.exp()[mask].numpy())
        out["targets"].append(r[mask].numpy())
        out["questions"].append(q[mask].numpy())
        for name in ("theta", "alpha"):
            value = getattr(pred, name, None)
            if value is not None:
                out.setdefault(name, []).append(value[mask].numpy())
    return {k: np.concatenate(v) for k, v in out.items()}


def fit(model, train: list[Encoded], valid: list[Encoded], cfg: TrainConfig, *, batcher: Callable, loss: Callable,
        metrics: Callable, checkpoint: Path | None = None, progress: bool = True, log: bool = True,
        validate_start: bool = False) -> list[dict]:
    """Train with Adam, halving the learning rate and stopping early on validation `cfg.monitor`; leaves the
    best weights loaded (and saved to `checkpoint`). Returns the per-epoch history (see `train_epochs`).
    `validate_start`: the starting weights (a warm start) compete with the epochs' (history row 0).

    The family's parts (families.py): `batcher(seqs, batch_size, rng)` as `batches`, `loss(cfg.loss, n_cats)`
    the loss module, `metrics(probs, targets)` the validation metrics."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    loss_fn = loss(cfg.loss, model.cfg.n_cats)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    chunks = chunk(train, cfg.max_len)

    def step(batch):
        q, r, mask = batch
        out = model(q, r)
        cum = getattr(out, "cum_logits", None)  # CORAL's cumulative logits; absent or None elsewhere
        value = loss_fn(out.log_probs[mask], r[mask], None if cum is None else cum[mask])
        penalty = getattr(out, "order_penalty", None)  # Deep-GPCM's, where its config asks for one
        if penalty is not None:
            value = value + penalty[mask].mean()
        return value, int(mask.sum())

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
                        validate_start=validate_start, average=cfg.average)


# ----------------------------------------------------------------------------- the shared loop

def train_epochs(model: torch.nn.Module, epochs: int, batches: Callable[[int], Iterable], step: Callable[[Any], tuple],
                 *, optimizer: torch.optim.Optimizer | None = None, grad_clip: float | None = None,
                 validate: Callable[[], dict] | None = None, monitor: str | None = None,
                 lower_is_better: bool = True, patience: int | None = None, min_delta: float = 1e-5,
                 lr_schedule=None, max_seconds: float | None = None, checkpoint: Path | None = None,
                 before_epoch: Callable[[int], dict | None] | None = None, progress: bool = True,
                 report: Callable[[dict], None] | None = None, validate_start: bool = False,
                 average: float | None = None) -> list[dict]:
    """Train `model` for up to `epochs` epochs; return one history row per epoch.

    Each epoch: `before_epoch(epoch)` (e.g. a curriculum stage; the dict it returns goes into the row),
    `model.train()`, then `step(batch)` for every batch of `batches(epoch)`. A step returns `(loss, n)`
    or `(loss, n, sums)`: `loss` the scalar tensor minimised (a mean over the batch's n targets), which the
    loop backpropagates, clips to `grad_clip` and hands to `optimizer`; `sums` the quantities to report,
    summed over the n targets (default {"loss": loss.item() * n}). A step that owns its update (no
    `optimizer`, e.g. GRU4Rec's hand-written gradients) returns `(None, n, sums)`.
    Then `validate()`, whose metrics enter the row as valid_<name>.

    Row: epoch, the before_epoch fields, train_<name> = sums[name] / targets, targets, seconds (the whole
    epoch, validation included), targets_per_second (training steps only), valid_* and, with an
    optimizer, lr; with a `monitor`, best.
    `monitor` names a row key (e.g. "valid_nll", "train_loss"); with one, the best epoch's weights are kept
    in memory (and saved to `checkpoint`) and loaded at the end, `lr_schedule.step(score)` sees the
    signed score after every epoch (lower is better), and training stops after `patience` epochs without
    an improvement of more than `min_delta`. Without one, training runs every epoch and keeps the last
    weights. `max_seconds`: no epoch is started that would, at the mean epoch time so far, end past it.
    `progress`: a bar per epoch, only when stderr is a terminal, with a total and a time left where `batches(epoch)`
    has a length (a list, or `Counted`); `report(row)` after every epoch (e.g.
    `print_row`, one line per epoch, readable in a log file).
    `validate_start` (with `validate` and a `monitor`): the starting weights are validated first (row 0: epoch 0,
    valid_*, best) and kept unless an epoch beats them, for a model that starts from a warm start.
    `average` (a decay per step, with an optimizer): an exponential moving average of the parameters is kept
    (torch.optim.swa_utils), and it is what each epoch validates, what the best epoch keeps and, without a
    monitor, what training returns; the optimizer goes on from the trained parameters."""
    sign = 1.0 if lower_is_better else -1.0
    history, best, best_state, stale = [], math.inf, None, 0
    started = time.perf_counter()
    if validate_start and validate is not None and monitor is not None:
        row = {"epoch": 0, **{f"valid_{name}": value for name, value in validate().items()}}
        row.update(targets=0, seconds=time.perf_counter() - started, targets_per_second=0.0, best=True)
        history.append(row)
        best, best_state = sign * row[monitor], {k: v.detach().clone() for k, v in model.state_dict().items()}
        if report is not None:
            report(row)
    bar = progress and sys.stderr.isatty()
    averaged = None
    if average is not None and optimizer is not None:
        averaged = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(average))
    for epoch in range(1, epochs + 1):
        t0 = time.perf_counter()
        row = {"epoch": epoch, **((before_epoch and before_epoch(epoch)) or {})}
        model.train()
        totals, count = {}, 0
        work = batches(epoch)
        if bar:
            work = tqdm(work, desc=f"epoch {epoch}/{epochs}", total=len(work) if hasattr(work, "__len__") else None,
                        unit="batch", leave=False, mininterval=1.0)
        for batch in work:
            out = step(batch)
            loss, n = out[0], out[1]
            if optimizer is not None:
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                if grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
                optimizer.step()
                if averaged is not None:
                    averaged.update_parameters(model)
            for name, value in (out[2] if len(out) > 2 else {"loss": loss.item() * n}).items():
                totals[name] = totals.get(name, 0.0) + value
            count += n
        train_seconds = time.perf_counter() - t0
        row.update({f"train_{name}": value / max(count, 1) for name, value in totals.items()})
        if not math.isfinite(row.get("train_loss", 0.0)):
            raise FloatingPointError(f"training diverged at epoch {epoch}: loss {row['train_loss']}")
        if averaged is not None:
            _swap_parameters(model, averaged.module)  # validate (and keep) the average
        metrics = validate() if validate is not None else {}
        row.update({f"valid_{name}": value for name, value in metrics.items()})
        row.update(targets=count, seconds=time.perf_counter() - t0, targets_per_second=count / train_seconds)
        if optimizer is not None:
            row["lr"] = optimizer.param_groups[0]["lr"]
        history.append(row)
        if monitor is not None:
            score = sign * row[monitor]
            if lr_schedule is not None:
                lr_schedule.step(score)
            row["best"] = score < best - min_delta
        if report is not None:
            report(row)
        if monitor is not None:
            if row["best"]:
                best, stale = score, 0
                best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                if checkpoint is not None:
                    torch.save({"epoch": epoch, "state_dict": best_state, "valid": metrics}, checkpoint)
            else:
                stale += 1
        if averaged is not None:
            _swap_parameters(model, averaged.module)  # train on from the trained parameters
        if monitor is not None and patience is not None and stale >= patience:
            break
        elapsed = time.perf_counter() - started
        if max_seconds is not None and elapsed + elapsed / epoch > max_seconds:
            break
    if best_state is not None:
        model.load_state_dict(best_state)
    elif averaged is not None:
        _swap_parameters(model, averaged.module)
    model.eval()
    return history


@torch.no_grad()
def _swap_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    """Exchange two models' parameter values in place (the same architecture); buffers stay."""
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        held = p.detach().clone()
        p.copy_(q)
        q.copy_(held)


ROW_BOOKKEEPING = ("epoch", "targets", "seconds", "targets_per_second", "best")


def describe(row: dict) -> str:
    """One line for an epoch's row: its losses, validation metrics and other numbers, time and speed."""
    numbers = "  ".join(f"{k} {v:.3g}" if k == "lr" else f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in row.items() if k not in ROW_BOOKKEEPING and k != "valid_n")
    return (f"epoch {row['epoch']:3d}  {numbers}  {row['seconds']:.0f}s  {row['targets_per_second']:.0f} targets/s"
            + ("  *" if row.get("best") else ""))


def print_row(row: dict) -> None:
    tqdm.write(describe(row))
    sys.stdout.flush()  # seen as the epoch ends, also in a log file
