"""The one training loop of every gradient-trained family (`train_epochs`), the epoch's batches with their count
(`Counted`) and the lines it prints: what the training will run, each epoch's, the time the rest will take and,
in a log file, where a long epoch is. Each task's fit is in its subpackage (kt/loop.py, next_item/
gru4rec_loop.py, next_item/mrn_loop.py, srs/time_aware_loop.py)."""

import contextlib
import contextvars
import math
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from tqdm import tqdm

HEARTBEAT_SECONDS = 30.0  # without a progress bar, a line at most this often within an epoch says where it is
# told after every epoch's validation, (epoch, model, row), with the weights validated in the model: `nextstep tune`
# scores a trial's epochs on its validation split there and stops a hopeless trial (optuna.TrialPruned) or one past
# the study's time (training/tune.py); None outside a study
_EPOCH_HOOK: contextvars.ContextVar = contextvars.ContextVar("epoch_hook", default=None)


@contextlib.contextmanager
def epoch_hook(hook: Callable[[int, torch.nn.Module, dict], None]):
    """Within the block, every `train_epochs` calls `hook(epoch, model, row)` after each epoch's validation; an
    exception the hook raises ends the training there."""
    token = _EPOCH_HOOK.set(hook)
    try:
        yield
    finally:
        _EPOCH_HOOK.reset(token)


class Counted:
    """An epoch's batches and how many there are (a number, or a function counting them when asked): the total
    of the progress bar, which without it can show neither how far the epoch is nor when it ends."""

    def __init__(self, batches: Iterable, n: int | Callable[[], int]):
        self.batches, self.n = batches, n

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return self.n() if callable(self.n) else self.n


# ----------------------------------------------------------------------------- the shared loop

def train_epochs(model: torch.nn.Module, epochs: int, batches: Callable[[int], Iterable], step: Callable[[Any], tuple],
                 *, optimizer: torch.optim.Optimizer | None = None, grad_clip: float | None = None,
                 validate: Callable[[], dict] | None = None, monitor: str | None = None,
                 lower_is_better: bool = True, patience: int | None = None, min_delta: float = 1e-5,
                 lr_schedule=None, max_seconds: float | None = None, checkpoint: Path | None = None,
                 before_epoch: Callable[[int], dict | None] | None = None, progress: bool = True,
                 report: Callable[[dict], None] | None = None, validate_start: bool = False,
                 average: float | None = None, say: Callable[[str], None] | None = None) -> list[dict]:
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
    monitor, what training returns; the optimizer goes on from the trained parameters.
    `say(line)` (e.g. `print_line`) is told what the training will run before it starts (`plan`), after the first
    epoch how long the rest will take at most (`estimate`), and, where no progress bar is drawn (a log file), how far
    an epoch has got at most every HEARTBEAT_SECONDS (`heartbeat`): a long epoch is not silence."""
    sign = 1.0 if lower_is_better else -1.0
    history, best, best_state, stale = [], math.inf, None, 0
    started = time.perf_counter()
    if say is not None:
        say(plan(epochs, monitor if patience is not None else None, patience, max_seconds))
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
        elif say is not None:
            work = heartbeat(work, f"epoch {epoch}/{epochs}", say)
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
        if (hook := _EPOCH_HOOK.get()) is not None:
            hook(epoch, model, row)
        if say is not None and epoch == 1 and epochs > 1:
            say(estimate(row["seconds"], epochs - 1, monitor is not None and patience is not None,
                         None if max_seconds is None else max_seconds - (time.perf_counter() - started)))
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


def plan(epochs: int, monitor: str | None, patience: int | None, max_seconds: float | None) -> str:
    """The line saying what a training will run: its epochs, when it stops early, its time limit."""
    line = f"training: up to {epochs} epochs" if monitor else f"training: {epochs} epoch{'s' * (epochs != 1)}"
    if monitor:
        line += f", stopping once {patience} in a row bring no better {monitor} (the best epoch's weights are kept)"
    if max_seconds is not None:
        line += f"; no epoch is started that would end past {duration(max_seconds)}"
    return line


def estimate(first: float, left: int, early_stopping: bool, seconds_left: float | None) -> str:
    """The line after the first epoch (`first` seconds): how long the `left` other epochs take at its pace (at most,
    where early stopping may end them sooner or a time limit, `seconds_left` of it, cuts them)."""
    rest = first * left
    if seconds_left is not None and seconds_left < rest:
        return (f"training: epoch 1 took {duration(first)}; the time limit ends the training within "
                f"{duration(seconds_left)} more")
    if early_stopping:
        return (f"training: epoch 1 took {duration(first)}; the {left} other epochs take at most {duration(rest)} "
                "more at this pace (early stopping usually ends them sooner)")
    return f"training: epoch 1 took {duration(first)}; the other {left} take about {duration(rest)} more at this pace"


def heartbeat(batches: Iterable, label: str, say: Callable[[str], None]):
    """`batches` as they come, saying how far the epoch has got (and, where they are counted, the time it has left)
    whenever HEARTBEAT_SECONDS have passed since it started or since the last such line."""
    started = last = time.perf_counter()
    total = None
    for done, batch in enumerate(batches):
        now = time.perf_counter()
        if now - last >= HEARTBEAT_SECONDS and done:
            if total is None and hasattr(batches, "__len__"):
                total = len(batches)  # counted when first needed (a count may cost a pass over the data)
            spent = now - started
            where = f"batch {done} of {total}" if total else f"batch {done}"
            left = f", about {duration(spent / done * (total - done))} left in it" if total else ""
            say(f"training: {label} at {where} after {duration(spent)}{left}")
            last = now
        yield batch


def duration(seconds: float) -> str:
    """Seconds as a person reads them: 45 s, 3 min 10 s, 25 min, 2 h 5 min."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 600:
        return f"{seconds // 60} min {seconds % 60} s"
    if seconds < 3600:
        return f"{round(seconds / 60)} min"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


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


def print_line(text: str) -> None:
    """A line of the training log, at once (also in a log file) and clear of a progress bar's updates."""
    tqdm.write(text)
    sys.stdout.flush()


def print_row(row: dict) -> None:
    print_line(describe(row))
