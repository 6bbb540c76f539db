"""Training the time-aware transformer on review logs: windows, batches, the loss, early stopping, prediction.

Every review is a query, answered from its window (review_window.select: the card's last reviews plus the
user's most recent ones), exactly as the service will answer it. The loss is the CORAL loss of the
rating plus `duration_weight` times the squared error of log(1 + seconds) where the duration is known.
Early stopping watches that loss on validation reviews: the latest `valid_fraction` of each user's
training reviews, which are never trained on.

Each user's FSRS-6 parameters are an input of the network (the state's `fsrs_w`), fitted by fsrs-rs on that user's
training reviews only (`fit`: `srs_eval.fit_fsrs6_by_user`), as the service fits them on the user's stored reviews:
one network is trained across many users, each with their own memory parameters.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from ...models.fsrs import DEFAULT_W
from ...models.time_aware import (
    TimeAwareConfig,
    TimeAwareTransformer,
    Window,
    coral_loss,
    expected_duration,
    recall_log_loss,
)
from ...srs.review_window import drift_sums, evidence_sums, user_windows
from ..loop import train_epochs
from .eval import _CardHistories, duration_mask, fit_fsrs6_by_user
from .reviews import ReviewLog


@dataclass
class TimeAwareTrainConfig:
    lr: float = 2e-3
    weight_decay: float = 1e-4
    batch_size: int = 256
    max_epochs: int = 30
    patience: int = 3
    duration_weight: float = 0.5
    # each training query's window shows no review states with this probability, and independently no answer times
    # (`hide_fields`): the service takes reviews without either (state -1, duration NaN), as an app may send them,
    # and a network that never saw a window without them answers such a user from weights training never moved
    # (docs/decisions.md)
    hide_fields: float = 0.1
    valid_fraction: float = 0.1
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"  # e.g. "cuda" for sweeps; the reported figures are CPU runs
    calibrate: bool = True  # fit the curve's blend with FSRS-6 and the thresholds' (scale, shift) on validation
    blend_prior: float = 20.0  # calibrate: the prior, in reviews, that the network's curve adds nothing to FSRS-6's
    # calibrate: the weight of the prior that the drifts' gains are the model's configured ones (drift_gain,
    # deck_drift_gain): a penalty drift_gain_prior * (gain - configured)^2 each, next to the summed CORAL loss
    drift_gain_prior: float = 0.3
    # calibrate: also fit Platt's (scale, shift) of the threshold logits on the validation reviews (with at least
    # 200); off by default: fitted on the latest training reviews it fixes a level that the drifts follow better
    platt: bool = False
    # early stopping watches the validation reviews the protocol scores (the card last seen on an earlier day),
    # not the same-day learning steps, which dominate small collections and pull the curve away from FSRS-6
    valid_scored: bool = True
    # evaluate under the protocol's folds on the training data before fitting the exported model (False: fit the
    # exported model only, and measure it on other users with `nextstep evaluate`, e.g. for many users' data)
    cross_validate: bool = True
    model: dict = field(default_factory=dict)  # TimeAwareConfig overrides

    def to_dict(self) -> dict:
        return asdict(self)


class ReviewTensors:
    """A review log as tensors plus every review's window (global row numbers, -1 padding), each user's FSRS-6
    parameters (`set_params`) and scheduler day boundary: the log's (``meta["day_start_ms"]``), else
    `day_start_hour` UTC."""

    def __init__(self, log: ReviewLog, window: int, card_window: int, day_start_hour: float = 4.0):
        self.log = log
        hours = log.day_start_hours()
        self.user_day_start = np.array([hours.get(u, day_start_hour) * 3600.0 for u in log.user_ids],
                                       dtype=np.float64)  # seconds after 00:00 UTC
        self.day_start = torch.from_numpy(np.repeat(self.user_day_start, np.diff(log.offsets)))
        self.card = torch.from_numpy(log.card.astype(np.int64))
        self.deck = torch.from_numpy(log.deck.astype(np.int64))
        self.time = torch.from_numpy(log.time.astype(np.float64))
        self.rating = torch.from_numpy(log.rating.astype(np.int64))
        self.duration = torch.from_numpy(log.duration.astype(np.float32))
        self.state = torch.from_numpy(log.state.astype(np.int64))
        parts = []
        for u in range(log.n_users):
            lo, hi = int(log.offsets[u]), int(log.offsets[u + 1])
            win = user_windows(log.card[lo:hi], window, card_window)
            parts.append(np.where(win >= 0, win + lo, -1))
        self.windows = torch.from_numpy(np.concatenate(parts) if parts else np.zeros((0, window), np.int64))
        self.drift = torch.zeros(len(log), 2)  # each review's drift sums before it (set_drift)
        self.error = torch.full((len(log),), math.nan)  # FSRS-6's error on each review, NaN unscored (set_drift)
        self.evidence: torch.Tensor | None = None  # each review's evidence before it (set_evidence); None: no mixture
        self.set_params(np.tile(np.asarray(DEFAULT_W, dtype=np.float32), (log.n_users, 1)))
        self._hist = None

    @property
    def hist(self) -> _CardHistories:
        """Every card's reviews for fsrs-rs (built once, for every fit of users' parameters)."""
        if self._hist is None:
            self._hist = _CardHistories(self.log)
        return self._hist

    def set_params(self, per_user: np.ndarray) -> None:
        """Each user's FSRS-6 parameters (n_users, 21): every review of the user reads them (then `set_drift`)."""
        per_user = np.asarray(per_user, dtype=np.float32).reshape(self.log.n_users, -1)
        self.user_params = per_user
        self.params = torch.from_numpy(np.repeat(per_user, np.diff(self.log.offsets), axis=0).reshape(-1, 21))

    @torch.no_grad()
    def set_drift(self, model: TimeAwareTransformer, batch: int = 4096) -> None:
        """Every review's FSRS-6 error (the window's `error` field) and drift sums (m, w) before it under each user's
        FSRS-6 parameters (`set_params`): each user's reviews in time order, each answered from its window as the
        service answers it, then added up by `drift_sums`."""
        p, scored = torch.zeros(len(self.card)), torch.zeros(len(self.card), dtype=torch.bool)
        for lo in range(0, len(self.card), batch):
            rows = torch.arange(lo, min(lo + batch, len(self.card)))
            w, card, deck, t = self.batch(rows)
            pred = model.readout(w, card, deck, t)  # FSRS-6's outputs read the parameters, not the drift or errors
            p[rows], scored[rows] = pred.fsrs_recall, pred.scored
        error = ((self.rating > 1).float() - p).numpy().astype(np.float64)
        self.error = torch.from_numpy(np.where(scored.numpy(), error, np.nan).astype(np.float32))
        scored = scored.numpy()
        bounds = self.log.offsets.astype(np.int64)
        self.drift = torch.from_numpy(np.concatenate(
            [drift_sums(error[lo:hi], scored[lo:hi], model.cfg.drift_halflife)[:-1]
             for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)] or [np.zeros((0, 2))])).float()

    @torch.no_grad()
    def set_evidence(self, model: TimeAwareTransformer, batch: int = 4096) -> None:
        """Every review's evidence before it (TimeAwareTransformer.evidence_update), after `set_drift`: each user's
        reviews in time order, each answered from its window as the service answers it (its drift sums, FSRS-6
        parameters), then added up by `evidence_sums`. Without the model's mixture: none."""
        if model.cfg.evidence_prior is None:
            self.evidence = None
            return
        self.evidence = torch.zeros(len(self.card))  # (any: the forecasters it weighs do not read it)
        gain, scored = torch.zeros(len(self.card), dtype=torch.float64), torch.zeros(len(self.card), dtype=torch.bool)
        for lo in range(0, len(self.card), batch):
            rows = torch.arange(lo, min(lo + batch, len(self.card)))
            pred = model.readout(*self.batch(rows))
            gain[rows] = recall_log_loss(pred.default_recall, self.rating[rows]) - recall_log_loss(pred.network_recall,
                                                                                       self.rating[rows])
            scored[rows] = pred.scored
        prior = model.evidence_constants()[0]
        bounds = self.log.offsets.astype(np.int64)
        self.evidence = torch.from_numpy(np.concatenate(
            [evidence_sums(gain.numpy()[lo:hi], scored.numpy()[lo:hi], model.cfg.evidence_halflife, prior)[:-1]
             for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)] or [np.zeros(0)])).float()

    def batch(self, rows: torch.Tensor, device: str = "cpu") -> tuple[tuple, torch.Tensor, torch.Tensor, torch.Tensor]:
        idx = self.windows[rows]
        valid = idx >= 0
        # trim columns that are padding in every window of the batch
        first = int(valid.any(0).nonzero()[0]) if bool(valid.any()) else idx.shape[1] - 1
        idx, valid = idx[:, first:], valid[:, first:]
        at = idx.clamp(min=0)
        state = (self.card[at], self.deck[at], self.time[at], self.rating[at], self.duration[at], self.state[at], valid,
                 self.error[at], self.drift[rows], self.params[rows], self.day_start[rows],
                 *(() if self.evidence is None else (self.evidence[rows],)))
        out = (state, self.card[rows], self.deck[rows], self.time[rows])
        if device != "cpu":
            out = (tuple(x.to(device) for x in state), *(x.to(device) for x in out[1:]))
        return out


def hide_fields(state: tuple, p: float) -> tuple:
    """A batch's windows (ReviewTensors.batch's state) with every row's review state unknown (-1) in a share `p` of
    the windows, and, drawn apart, every row's answer time unknown (NaN) in a share `p`: what a user whose app sends
    neither looks like to the network."""
    if p <= 0:
        return state
    batch = state[0].shape[0]
    no_state = (torch.rand(batch, 1, device=state[0].device) < p).expand_as(state[5])
    no_duration = (torch.rand(batch, 1, device=state[0].device) < p).expand_as(state[4])
    return (*state[:4], torch.where(no_duration, math.nan, state[4]), torch.where(no_state, -1, state[5]),
            *state[6:])


def _loss(model, rt: ReviewTensors, rows: torch.Tensor, duration_weight: float,
          device: str = "cpu", hide: float = 0.0) -> tuple[torch.Tensor, int]:
    w, card, deck, t = rt.batch(rows, device)
    w = hide_fields(w, hide)
    pred = model.readout(w, card, deck, t)
    loss = coral_loss(pred, rt.rating[rows].to(device))
    dur = rt.duration[rows].to(device)
    known = ~torch.isnan(dur)
    if duration_weight > 0 and bool(known.any()):
        target = torch.log1p(dur[known].clamp(min=0))
        loss = loss + duration_weight * ((pred.log_duration[known] - target) ** 2).mean()
    return loss, len(rows)


@torch.no_grad()
def validation_loss(model, rt: ReviewTensors, rows: np.ndarray, cfg: TimeAwareTrainConfig) -> float:
    model.eval()
    total, n = 0.0, 0
    for lo in range(0, len(rows), 1024):
        loss, k = _loss(model, rt, torch.from_numpy(rows[lo:lo + 1024]), cfg.duration_weight, cfg.device)
        total += float(loss) * k
        n += k
    return total / max(n, 1)


def split_validation(log: ReviewLog, rows: np.ndarray, fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """The latest `fraction` of each user's rows (in `rows`) for validation, the rest for training."""
    user = np.searchsorted(log.offsets, rows, side="right") - 1
    train, valid = [], []
    for u in np.unique(user):
        mine = np.sort(rows[user == u])
        k = int(math.floor(len(mine) * fraction))
        train.append(mine[:len(mine) - k])
        valid.append(mine[len(mine) - k:])
    return (np.concatenate(train) if train else rows[:0]), (np.concatenate(valid) if valid else rows[:0])


def fit(rt: ReviewTensors, rows: np.ndarray, cfg: TimeAwareConfig, tcfg: TimeAwareTrainConfig,
        log_progress=None) -> tuple[TimeAwareTransformer, dict]:
    """Train on `rows` (global review numbers), early-stopping on their latest `valid_fraction` (on the
    training loss when no user has enough rows to hold any out). Each user's FSRS-6 parameters are fitted on that
    user's `rows` first, as the baseline is (`rt.set_params`, which predictions then read): the network learns
    corrections to each user's curve. The model's own `fsrs_w` stays fsrs-rs's defaults: a user the service has not
    fitted yet starts from them. The network is fitted and calibrated on its own curve at every elapsed time;
    the config's rules without weights (`gap_shrink`, `interval_ratio_max`, `interval_ratio_min`, the mixture with
    FSRS-6's defaults: `evidence_prior`) apply to the model returned, the one evaluated and exported (its evidence:
    `rt.set_evidence`) (docs/results.md, "Bounding the served intervals by FSRS-6's")."""
    if tcfg.threads:
        torch.set_num_threads(tcfg.threads)
    torch.manual_seed(tcfg.seed)
    rng = np.random.default_rng(tcfg.seed)
    train_rows, valid_rows = split_validation(rt.log, rows, tcfg.valid_fraction)
    watched = valid_rows[rt.log.elapsed_days[valid_rows] > 0] if tcfg.valid_scored else valid_rows
    watched = watched if len(watched) else valid_rows
    model = TimeAwareTransformer(replace(cfg, gap_shrink=False, interval_ratio_max=None, interval_ratio_min=None,
                                         evidence_prior=None))
    rt.set_params(fit_fsrs6_by_user(rt.log, np.sort(rows), hist=rt.hist))  # each user's curve the network corrects
    rt.set_drift(model)  # FSRS-6's errors under these parameters (the drift the rest of the fit reads)
    rt.set_evidence(model)  # none: the network is fitted and calibrated on its own
    model.to(tcfg.device)
    opt = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    start = time.perf_counter()

    def batches(epoch):
        order = rng.permutation(train_rows)
        return (torch.from_numpy(order[lo:lo + tcfg.batch_size]) for lo in range(0, len(order), tcfg.batch_size))

    monitor = "valid_loss" if len(valid_rows) else "train_loss"  # what early stopping watches
    history = train_epochs(model, tcfg.max_epochs, batches,
                           lambda batch: _loss(model, rt, batch, tcfg.duration_weight, tcfg.device,
                                               tcfg.hide_fields),
                           optimizer=opt, grad_clip=1.0,
                           validate=(lambda: {"loss": validation_loss(model, rt, watched, tcfg)})
                           if len(valid_rows) else None,
                           monitor=monitor, patience=tcfg.patience, progress=False, report=log_progress)
    model.cpu().eval()
    calibration = calibrate(model, rt, valid_rows, blend_prior=tcfg.blend_prior,
                            drift_gain_prior=tcfg.drift_gain_prior,
                            min_rows=200 if tcfg.platt else None) if tcfg.calibrate else None
    model.cfg = cfg  # the rules as configured, from here on
    best = [row for row in history if row["best"]][-1][monitor]
    return model, {"history": history, "best_valid_loss": best, "n_train": len(train_rows),
                   "n_valid": len(valid_rows), "calibration": calibration, "seconds": time.perf_counter() - start}


@torch.no_grad()
def _predictions(model, rt: ReviewTensors, rows: np.ndarray, batch: int = 1024):
    """The model's Prediction for each batch of `rows`, in order (no gradients)."""
    for lo in range(0, len(rows), batch):
        yield model.readout(*rt.batch(torch.from_numpy(rows[lo:lo + batch])))


def _threshold_logits(model: TimeAwareTransformer, rt: ReviewTensors, rows: np.ndarray, blend: float) -> torch.Tensor:
    """The threshold logits at this blend, without either drift (gains 0)."""
    model.blend.fill_(blend)
    kept = float(model.drift_gain), float(model.deck_drift_gain)
    model.drift_gain.fill_(0.0)
    model.deck_drift_gain.fill_(0.0)
    try:
        return torch.cat([p.threshold_logits for p in _predictions(model, rt, rows)]).double()
    finally:
        model.drift_gain.fill_(kept[0])
        model.deck_drift_gain.fill_(kept[1])


def _drift_means(model: TimeAwareTransformer, rt: ReviewTensors, rows: np.ndarray, batch: int = 1024) -> torch.Tensor:
    """(n, 2) float64: the user's and the deck's drift mean for each of `rows` (each drift's recall logit offset per
    unit of gain), from the drift sums and the window's errors, without running the network."""
    parts = []
    for lo in range(0, len(rows), batch):
        state, _, deck, _ = rt.batch(torch.from_numpy(rows[lo:lo + batch]))
        w = Window(*state[:8])
        deck_sums = model.deck_drift_sums(w, deck.unsqueeze(1), w.valid.unsqueeze(1)).squeeze(1)
        parts.append(torch.stack([model.drift_mean(state[8]), model.drift_mean(deck_sums)], -1))
    return torch.cat(parts).double() if parts else torch.zeros(0, 2, dtype=torch.float64)


def _fit(params: list[torch.Tensor], loss_fn) -> None:
    opt = torch.optim.LBFGS(params, max_iter=100, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        return loss

    opt.step(closure)


def calibrate(model: TimeAwareTransformer, rt: ReviewTensors, rows: np.ndarray, min_rows: int | None = 200,
              blend_prior: float = 20.0, min_blend_rows: int = 20, drift_gain_prior: float = 0.3) -> dict:
    """Fit, on held-out reviews the protocol would score (card last seen on an earlier day):

    - `blend`, how much of the network's curve to trust against FSRS-6's own, and the gains of the user's and the
      deck's drift: the CORAL loss of the mix, summed over the reviews, plus `blend_prior` * blend^2, a prior worth
      that many reviews that the network adds nothing, plus `drift_gain_prior` * (gain - the configured gain)^2 for
      each gain; blend 0 (FSRS-6's curve) and the configured gains with fewer than `min_blend_rows` reviews. Little
      data, little trust.
    - then (scale, shift) of the three threshold logits (Platt scaling): the model's own thresholds come from
      early-stopped training and drift with the seed; two parameters fitted on the latest reviews before the test
      block correct the overall level and spread. Left at the identity with fewer than `min_rows` reviews, or
      when `min_rows` is None.
    - and the answer time's `duration_shift` (`_duration_shift`).
    """
    rows = rows[rt.log.elapsed_days[rows] > 0]
    result = _calibrate_recall(model, rt, rows, min_rows, blend_prior, min_blend_rows, drift_gain_prior)
    return {**result, "duration_shift": _duration_shift(model, rt, rows, min_blend_rows)}


def _duration_shift(model: TimeAwareTransformer, rt: ReviewTensors, rows: np.ndarray, min_rows: int) -> float:
    """The shift of log(1 + seconds) that makes the predicted answer time the median of the held-out ones: the
    median of (log(1 + seconds) - prediction) over the reviews whose answer time the protocol scores. The head is
    fitted by squared error in log space (a mean there), while answer times are skewed and judged by their
    absolute error, which the median minimises. 0 with fewer than `min_rows` such reviews."""
    model.duration_shift.fill_(0.0)
    known = rows[duration_mask(rt.log)[rows]]
    if len(known) < min_rows:
        return 0.0
    predicted = torch.cat([p.log_duration for p in _predictions(model, rt, known)]).double().numpy()
    shift = float(np.median(np.log1p(rt.duration[known].double().clamp(min=0).numpy()) - predicted))
    model.duration_shift.fill_(shift)
    return shift


def _calibrate_recall(model: TimeAwareTransformer, rt: ReviewTensors, rows: np.ndarray, min_rows: int | None,
                      blend_prior: float, min_blend_rows: int, drift_gain_prior: float) -> dict:
    """`calibrate`'s blend, drifts' gains and Platt on the scored held-out `rows`."""
    model.calibration.copy_(torch.tensor([1.0, 0.0]))
    prior_gain = torch.tensor([model.cfg.drift_gain, model.cfg.deck_drift_gain], dtype=torch.float64)
    model.drift_gain.fill_(float(prior_gain[0]))
    model.deck_drift_gain.fill_(float(prior_gain[1]))
    if len(rows) < min_blend_rows:
        model.blend.fill_(0.0)
        return {"blend": 0.0, "drift_gain": prior_gain.tolist(), "platt": None, "rows": int(len(rows))}
    target = (rt.rating[rows].unsqueeze(-1) > torch.arange(1, 4)).double()
    network, fsrs = _threshold_logits(model, rt, rows, 1.0), _threshold_logits(model, rt, rows, 0.0)
    drift = _drift_means(model, rt, rows)  # the offsets add to every threshold logit alike
    raw = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    gain = prior_gain.clone().requires_grad_(True)

    def mixed():
        a = torch.sigmoid(raw - 2.0)  # starts at 0.12
        return fsrs + a * (network - fsrs) + (drift @ gain.clamp(min=0)).unsqueeze(-1), a

    def blend_loss():
        logits, a = mixed()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(logits, target, reduction="sum")
        return bce + blend_prior * a.square().sum() + drift_gain_prior * (gain - prior_gain).square().sum()

    _fit([raw, gain], blend_loss)
    with torch.no_grad():
        logits, a = mixed()
    blend, fitted_gain = float(a), gain.detach().clamp(min=0).tolist()
    model.blend.fill_(blend)
    model.drift_gain.fill_(fitted_gain[0])
    model.deck_drift_gain.fill_(fitted_gain[1])
    if min_rows is None or len(rows) < min_rows:
        return {"blend": blend, "drift_gain": fitted_gain, "platt": None, "rows": int(len(rows))}
    log_scale = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    shift = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    _fit([log_scale, shift], lambda: torch.nn.functional.binary_cross_entropy_with_logits(
        logits * log_scale.exp() + shift, target))
    scale, offset = float(log_scale.detach().exp()), float(shift.detach())
    model.calibration.copy_(torch.tensor([scale, offset]))
    return {"blend": blend, "drift_gain": fitted_gain, "platt": [scale, offset], "rows": int(len(rows))}


@torch.no_grad()
def predict(model: TimeAwareTransformer, rt: ReviewTensors, rows: np.ndarray, batch: int = 1024) -> dict:
    """P(rating = 1..4), P(recall) and expected seconds for every review in `rows` (numpy arrays)."""
    model.eval()
    probs, recall, dur = [], [], []
    for p in _predictions(model, rt, rows, batch):
        probs.append(p.rating_probs)
        recall.append(p.recall)
        dur.append(expected_duration(p.log_duration))
    if not probs:
        return {"rating_probs": np.zeros((0, 4)), "recall": np.zeros(0), "duration_s": np.zeros(0)}
    return {"rating_probs": torch.cat(probs).double().numpy(), "recall": torch.cat(recall).double().numpy(),
            "duration_s": torch.cat(dur).double().numpy()}
