"""Mini-batching, the training loop with early stopping and checkpoints, and batched evaluation.

Sequences arrive as (question indices, responses) pairs already mapped through the vocabulary.
Training cuts long sequences into chunks of `max_len` (each chunk starts from the initial memory,
as DKVMN does); evaluation by default runs every sequence whole, as the service sees a learner.
Batches group sequences of similar length so that padding costs little.
"""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from .losses import CombinedLoss
from .metrics import ordinal_metrics

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
    monitor: str = "nll"  # validation metric for early stopping and the best checkpoint (see LOWER_IS_BETTER)
    loss: str = "ce"  # CombinedLoss spec, e.g. "ce" or "ce=0.6,qwk=0.2,focal=0.2"
    seed: int = 0
    model: dict = field(default_factory=dict)  # GPCMConfig overrides

    def __post_init__(self):
        if self.epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {self.epochs}")
        if not 0 < self.valid_fraction < 1:
            raise ValueError(f"valid_fraction must be in (0, 1): early stopping needs validation students, "
                             f"got {self.valid_fraction}")
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
def predict_sequences(model, seqs: list[Encoded], batch_size: int = 128, max_len: int | None = None) -> dict:
    """Teacher-forced predictions at every real position: probs (N, K), targets, questions, theta, alpha."""
    model.eval()
    out = {"probs": [], "targets": [], "questions": [], "theta": [], "alpha": []}
    for q, r, mask in batches(chunk(seqs, max_len), batch_size):
        pred = model(q, r)
        out["probs"].append(pred.log_probs.exp()[mask].numpy())
        out["targets"].append(r[mask].numpy())
        out["questions"].append(q[mask].numpy())
        for irt in ("theta", "alpha"):  # the GPCM families' IRT outputs; DKT has none
            if getattr(pred, irt, None) is not None:
                out[irt].append(getattr(pred, irt)[mask].numpy())
    return {k: np.concatenate(v) for k, v in out.items() if v}


def evaluate(model, seqs: list[Encoded], max_len: int | None = None) -> dict[str, float]:
    pred = predict_sequences(model, seqs, max_len=max_len)
    return ordinal_metrics(pred["probs"], pred["targets"])


def fit(model, train: list[Encoded], valid: list[Encoded], cfg: TrainConfig, checkpoint: Path | None = None,
        progress: bool = True, log: bool = True) -> list[dict]:
    """Train with Adam and early stopping on validation `cfg.monitor`; leaves the best weights loaded.

    `progress` shows a bar per epoch; `log` prints one line per epoch.
    Returns the per-epoch history (train loss, validation metrics, seconds)."""
    torch.manual_seed(cfg.seed)
    rng = np.random.default_rng(cfg.seed)
    loss_fn = CombinedLoss.from_spec(cfg.loss, model.cfg.n_cats)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sign = 1.0 if MONITORS[cfg.monitor] else -1.0  # minimise sign * metric
    schedule = torch.optim.lr_scheduler.ReduceLROnPlateau(opt, factor=0.5, patience=cfg.lr_patience)
    chunks = chunk(train, cfg.max_len)
    n_batches = math.ceil(len(chunks) / cfg.batch_size)
    history, best, best_state, stale = [], math.inf, None, 0
    for epoch in range(1, cfg.epochs + 1):
        model.train()
        start, total, count = time.perf_counter(), 0.0, 0
        bar = tqdm(batches(chunks, cfg.batch_size, rng), total=n_batches, desc=f"epoch {epoch}",
                   disable=not progress, leave=False)
        for q, r, mask in bar:
            out = model(q, r)
            cum = out.cum_logits[mask] if getattr(out, "cum_logits", None) is not None else None
            loss = loss_fn(out.log_probs[mask], r[mask], cum)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            n = int(mask.sum())
            total, count = total + loss.item() * n, count + n
            bar.set_postfix(loss=f"{total / count:.4f}")
        valid_metrics = evaluate(model, valid, cfg.eval_max_len)
        row = {"epoch": epoch, "train_loss": total / max(count, 1), "seconds": time.perf_counter() - start,
               **{f"valid_{k}": v for k, v in valid_metrics.items()}}
        row["lr"] = opt.param_groups[0]["lr"]
        history.append(row)
        score = sign * valid_metrics[cfg.monitor]
        schedule.step(score)
        improved = score < best - 1e-5
        row["best"] = improved
        if log:
            tqdm.write(f"epoch {epoch:3d}  loss {row['train_loss']:.4f}  valid {cfg.monitor} {sign * score:.4f}  "
                       f"acc {valid_metrics['categorical_accuracy']:.4f}  qwk {valid_metrics['qwk']:.4f}"
                       + (f"  auc {valid_metrics['auc']:.4f}" if "auc" in valid_metrics else "")
                       + f"  {row['seconds']:.0f}s" + ("  *" if improved else ""))
        if improved:
            best, stale = score, 0
            best_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
            if checkpoint is not None:
                torch.save({"epoch": epoch, "state_dict": best_state, "valid": valid_metrics}, checkpoint)
        else:
            stale += 1
            if stale >= cfg.patience:
                break
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return history
