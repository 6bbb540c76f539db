"""The time-aware causal transformer for flashcard reviews (seed 003): next rating and answer time.

A query is a review about to happen: (card, deck, time). The model answers it from a window of the same
user's earlier reviews (nextstep/srs/review_window.py picks them), each given by its raw fields only: card,
deck, time, rating, duration and state. Every feature is computed here, in the forward pass, so training
and serving cannot disagree (the seed computed them outside the model):

- per history row j, from the rows before it in the window: the interval since the previous review of
  its card, its review number and the lapses of its card so far;
- per (query, row j): the time from j to the reference time (below), whether j is the query's card, or
  another card of its deck; times are always relative and on a log scale, never raw epoch seconds (the seed
  fed 1.7e9-sized timestamps to Time2Vec);
- for the query: what the rows say about its card and the user at the reference time, the card's last review
  (or, for a card with no row, the user's last): the card's review and lapse counts, its last rating, interval
  and answer time, reviews of other cards since, reviews that day. Nothing the query's own time would change.

Layers (seed sections 2-4, with one change): the seed's decoder-only stack feeds review t's own rating
into row t, so a row can never be used as the query for its own rating. Here the query is a row of its
own, built from query features, and it cross-attends to the history rows, which carry their outcomes.
Each layer is multi-head attention from the query to the rows with head groups and their masks:

- card heads: only rows of the query's card, with a learnable decay bias w * exp(-lambda * dt_days);
- deck heads: only rows of other cards of the query's deck;
- global heads: every row, with a per-head bias -slope * (number of rows after it) for recency;

plus a learned "nothing here" slot per head, so a new card (no rows for its card heads) is well defined.
Time2Vec (one linear and K-1 periodic terms) encodes log hours of the row times relative to the reference.

Outputs. P(recall) is a forgetting curve of the time since the card's last review that never rises
(`curve`, `_recall_logit`), anchored on FSRS-6 (fsrs.py): the card's FSRS-6 stability and difficulty follow from
its reviews in the window and the user's 21 FSRS-6 parameters (`fsrs_w`, fitted by fsrs-rs on the training
reviews), and the network corrects that curve: a factor on the stability and on the decay, a ceiling, minus
non-negative "drops" at fixed times from 5 minutes to a year, and terms of the query's time that can only lower
recall as time passes (scheduler days since, time since the user's last review) or only fall away (same day,
reviews today), each with a weight >= 0. Every correction starts at nothing, so an untrained model is FSRS-6;
after training, `blend` (fitted on held-out reviews, with a prior towards 0) mixes the network's curve with
FSRS-6's own, so a user with few reviews gets FSRS-6 and one with many gets what the network learned. The user's
drift adds one more term, the same at every elapsed time: `drift_gain` times a recency-weighted mean of FSRS-6's
errors on the user's earlier scored reviews (`drift_offset`; docs/decisions.md), so a user who lately recalls more
(or less) than FSRS-6 expects gets a curve shifted up (or down); and the deck's drift one more, `deck_drift_gain`
times the same mean over the window's scored rows of the query's deck (`deck_drift_sums`: each row carries
FSRS-6's error on it), for a deck that is going better or worse than the user's others. The query state never
sees the query's time, so the curve is monotone by construction, and `schedule` inverts it for a desired
retention. A card with no review in the window has no curve: its recall does not depend on time.
CORAL rating head: P(rating > k) = sigmoid(s - b_k) with s = logit P(recall) and b_1 = 0 < b_2 < b_3; with
`adaptive_gaps` (the default) the gaps are predicted from the state, still positive, so the probabilities stay
rank-consistent while the Hard/Good/Easy split can differ from what the recall alone implies. A duration head predicts
log(1 + seconds) from the state and the recall logit, shifted after training (`duration_shift`) so that the
answer time it gives is the held-out answer times' median.

Scheduler days (FSRS-6's intervals, "same day", the reviews the drift scores) start at each user's own boundary
(`Query.day_start`, the state's `day_start`: Anki's rollover in the user's time zone, as their data count days), not
at one hour for every user (docs/decisions.md).

The streaming contract (streaming.py): the state is a window of raw reviews, each with FSRS-6's error on it, and the
user's drift sums (m, w), FSRS-6 parameters and day boundary; `step` adds FSRS-6's error on a review to the sums
(`drift_update`) and appends the review with it (`row_error`); `readout` answers a batch of states with one query
each (the serving path: only the query row is computed), and also answers FSRS-6's own recall and whether the
protocol scores the review (what `drift_update` needs); `forward` predicts every review of a sequence at once with
causal masks (the seed's training view), both drifts included. The two agree whenever the window holds all earlier
reviews, which a test checks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from ..srs.review_window import drift_decay
from . import fsrs

N_STATES = 5  # 0 new, 1 learning, 2 review, 3 relearning, 4 unknown
DAY = 86400.0
_NEG = -1e9  # masked logits (finite, so a fully masked row stays NaN-free; the null slot is always open)


@dataclass
class TimeAwareConfig:
    d_model: int = 64
    n_layers: int = 2
    card_heads: int = 2
    deck_heads: int = 1
    global_heads: int = 1
    ffn_dim: int = 128
    t2v_dim: int = 8
    dropout: float = 0.1
    window: int = 64  # rows a query sees (review_window.select); tuning: docs/decisions.md
    card_window: int = 16  # of which at most this many are the query card's own last reviews
    # scheduler days start at this hour UTC (Anki's default rollover) for a user whose own boundary is not given (each
    # user's is an input: Query.day_start, the state's `day_start`)
    day_start_hour: float = 4.0
    # CORAL gaps b_1 - b_2, b_2 - b_3 predicted from the state (still ordered) instead of constant (the seed);
    # constant gaps tie the Hard/Good/Easy split to the recall score (docs/decisions.md)
    adaptive_gaps: bool = True
    # the user's drift (docs/decisions.md): an exponentially weighted mean of FSRS-6's recent errors on the user's
    # scored reviews, each review's weight halving every `drift_halflife` scored reviews after it, shrunk towards 0
    # by `drift_prior` pseudo-reviews; `drift_gain` (fitted on held-out reviews) turns it into a recall logit offset
    drift_halflife: float = 10.0
    drift_prior: float = 2.0
    drift_gain: float = 4.0  # the gain before calibration fits it, and the value calibration's prior pulls towards
    # the deck's drift: the same mean over the window's scored rows of the query's deck (each row carries FSRS-6's
    # error on it, `Window.error`), a row's weight halving every `drift_halflife` such rows after it; its own gain
    deck_drift_gain: float = 1.0
    # Rules without weights, applied to the model a training run returns (it fits and calibrates the network on its
    # own curve), so a trained model can be exported again with others (bench/srs_intervals.py --set):
    # - gap_shrink: past G, gap_factor times the longest gap between two reviews of a card among the rows a query
    #   sees (at least a day), the network's curve falls as FSRS-6's does from there:
    #   R(t) = R_net(min(t, G)) * R_FSRS(t) / R_FSRS(G) (issue 38, part 4; the default until the bound below)
    # - interval_ratio_max, interval_ratio_min: how far in time the network and the drifts may move FSRS-6's curve
    #   (the user's parameters): R_FSRS(t / min) <= R(t) <= R_FSRS(t / max), so the time to any recall, and so any
    #   interval, is at most max and at least min times FSRS-6's (before calibration); None: no bound.
    # The default, at most twice FSRS-6's and no shrink, was chosen on folds over users (docs/results.md, "Bounding
    # the served intervals by FSRS-6's"; docs/decisions.md); 1.99, not 2, so that a card on the bound is served
    # inside twice FSRS-6's interval, not a fraction of a second past it (the schedule's due is found to ~5e-7)
    gap_shrink: bool = False
    gap_factor: float = 1.0
    interval_ratio_max: float | None = 1.99
    interval_ratio_min: float | None = None
    # - evidence_prior, evidence_halflife: the served P(recall) is a Bayesian mixture of two forecasters, the network
    #   (everything above) and FSRS-6 with the default parameters (`fsrs_w`), weighted by the user's evidence E, the
    #   log loss of FSRS-6's defaults minus the network's on the user's scored reviews (`evidence_update`): weight
    #   sigmoid(E) on the network, sigmoid(-E) on the defaults. A new user starts at `evidence_prior` nats; each
    #   review's evidence, and the prior's, halves every `evidence_halflife` scored reviews after it (None: no decay),
    #   so the weight follows what the user's recent reviews say. evidence_prior None: no
    #   mixture (the network alone; what training sees). A user for whom the defaults forecast better moves to them
    #   within a few nats of evidence, so the model is never much worse for a user than FSRS-6's defaults
    evidence_prior: float | None = 2.0
    evidence_halflife: float | None = 140.0

    @property
    def n_heads(self) -> int:
        return self.card_heads + self.deck_heads + self.global_heads

    def to_dict(self) -> dict:
        return asdict(self)


class Window(NamedTuple):
    """A batch of windows: (B, H) history rows, left-padded (valid False), in time order (features rely on it)."""

    card: torch.Tensor  # int64
    deck: torch.Tensor  # int64
    time: torch.Tensor  # float64 unix seconds
    rating: torch.Tensor  # int64 1..4 (anything on padding)
    duration: torch.Tensor  # float32 seconds, NaN when unknown
    state: torch.Tensor  # int64 0..3, -1 unknown
    valid: torch.Tensor  # bool
    # float32 FSRS-6's error on each row when it was recorded (rating > 1 minus its fsrs_recall), NaN where the
    # protocol does not score it; None: no errors known (the deck's drift is 0)
    error: torch.Tensor | None = None


WINDOW_DTYPES = ("int64", "int64", "float64", "int64", "float32", "int64", "bool", "float32")  # Window's fields


class Query(NamedTuple):
    card: torch.Tensor  # (B, Q) int64
    deck: torch.Tensor  # (B, Q) int64
    time: torch.Tensor  # (B, Q) float64
    drift: torch.Tensor | None = None  # (B, Q, 2) float32: the user's drift sums (m, w) before the query; None: 0
    # (B, 21) float32: each row's user's FSRS-6 parameters (fitted on that user's reviews); None: the model's
    # `fsrs_w` (the defaults a user without a fit gets)
    params: torch.Tensor | None = None
    # (B,) float64: each row's user's scheduler day boundary, seconds after 00:00 UTC (Anki's rollover hour in the
    # user's time zone); None: the config's day_start_hour for every row
    day_start: torch.Tensor | None = None
    # (B, Q, 2) float32: each query card's FSRS-6 (stability, difficulty) after its reviews in the window, as
    # `card_memory` computes them (the service gets them from fsrs-rs, nextstep/srs/card_memory.py); None: computed here
    memory: torch.Tensor | None = None
    # (B, Q) float32: the user's evidence for the network over FSRS-6's defaults before the query (nats; see the
    # config's evidence_prior); None: no mixture
    evidence: torch.Tensor | None = None
    # (B, Q) float32: each query card's FSRS-6 stability after its reviews in the window under the default parameters
    # (`fsrs_w`), as `card_memory` computes them; None: computed here (read only with `evidence`)
    default_stability: torch.Tensor | None = None


DRIFT_DTYPE = "float32"
N_PARAMS = 21  # FSRS-6's parameters, one set per user: part of the state, an input of every graph


class Prediction(NamedTuple):
    rating_probs: torch.Tensor  # (..., 4) P(rating = 1..4)
    recall: torch.Tensor  # (...) P(rating > 1)
    log_duration: torch.Tensor  # (...) predicted log(1 + seconds)
    threshold_logits: torch.Tensor  # (..., 3) s + b_k, for the CORAL loss
    fsrs_recall: torch.Tensor  # (...) FSRS-6's own P(recall) (no network, no drift): the drift's reference
    scored: torch.Tensor  # (...) bool: the card was last reviewed on an earlier scheduler day (the drift counts it)
    # (...) the network's P(recall) before the mixture with FSRS-6's defaults, and theirs (0 for a card without a
    # review in the window): the two forecasters the evidence weighs (`evidence_update`); recall is their mixture
    network_recall: torch.Tensor
    default_recall: torch.Tensor


class Time2Vec(nn.Module):
    """t2v(x)[0] = w_0 x + p_0, t2v(x)[k] = sin(w_k x + p_k), applied to a scalar per element."""

    def __init__(self, dim: int):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(0.2, 2.0, dim))
        self.p = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.unsqueeze(-1) * self.w + self.p
        return torch.cat([z[..., :1], torch.sin(z[..., 1:])], dim=-1)


def _log1p(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(x.clamp(min=0))


def _logit_of_log(log_p: torch.Tensor) -> torch.Tensor:
    """logit(p) from log p <= 0 (float64: near p = 1, 1 - p cancels in float32 and engines part), at most 20.7
    (p = 1, as FSRS-6 gives on the day of a review, is capped at 1 - 1e-9)."""
    log_p = log_p.clamp(max=-1e-9)
    return log_p - torch.log(-torch.expm1(log_p))


def _logaddexp(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """log(exp(a) + exp(b)), stable (ONNX has no LogAddExp)."""
    top = torch.maximum(a, b)
    return top + torch.log1p(torch.exp(-(a - b).abs()))


def recall_log_loss(p: torch.Tensor, rating: torch.Tensor) -> torch.Tensor:
    """float64 -log P(the outcome): recalled (rating > 1) with probability p, clipped to [1e-6, 1 - 1e-6]."""
    p = p.double().clamp(1e-6, 1 - 1e-6)
    return -torch.where(rating > 1, torch.log(p), torch.log1p(-p))


def _pick(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x (B, H) at index (B, Q) -> (B, Q)."""
    return torch.gather(x, 1, index)


class GroupedCrossAttention(nn.Module):
    """Multi-head attention from queries (B, Q, d) to rows (B, Q, H, d) with per-head-group masks and biases."""

    def __init__(self, cfg: TimeAwareConfig):
        super().__init__()
        d, h = cfg.d_model, cfg.n_heads
        if d % h:
            raise ValueError(f"d_model {d} is not divisible by the {h} heads")
        self.h, self.dk = h, d // h
        self.groups = (cfg.card_heads, cfg.deck_heads, cfg.global_heads)
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, d)
        self.null_kv = nn.Parameter(torch.randn(2, d) * 0.1)
        # card heads: w * exp(-lambda * dt_days), lambda = softplus(raw) > 0
        self.decay_w = nn.Parameter(torch.ones(cfg.card_heads))
        self.decay_raw = nn.Parameter(torch.full((cfg.card_heads,), math.log(math.expm1(0.1))))
        # global heads: -slope * rows after, slope = softplus(raw) >= 0
        self.slope_raw = nn.Parameter(torch.full((cfg.global_heads,), math.log(math.expm1(0.05))))
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, rows: torch.Tensor, rel: dict) -> torch.Tensor:
        B, Q, H, d = rows.shape
        q = self.q(x).view(B * Q, self.h, 1, self.dk)
        kv = self.kv(rows).view(B * Q, H, 2, self.h, self.dk)
        k, v = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (BQ, h, H, dk)
        logits = (q @ k.transpose(-1, -2)).view(B, Q, self.h, H) / math.sqrt(self.dk)
        nc, nd, ng = self.groups
        decay = F.softplus(self.decay_raw)[:, None]
        card_bias = self.decay_w[:, None] * torch.exp(-decay * rel["dt_days"].unsqueeze(-2))
        card = torch.where(rel["same_card"].unsqueeze(-2), card_bias, _NEG)
        deck = torch.where(rel["same_deck"].unsqueeze(-2), 0.0, _NEG).expand(B, Q, nd, H)
        glob = torch.where(rel["visible"].unsqueeze(-2),
                           -F.softplus(self.slope_raw)[:, None] * rel["after"].unsqueeze(-2), _NEG)
        logits = logits + torch.cat([card, deck, glob], dim=2)
        nk, nv = self.null_kv[0].view(self.h, self.dk), self.null_kv[1].view(self.h, self.dk)
        null_logit = (q.view(B, Q, self.h, self.dk) * nk).sum(-1, keepdim=True) / math.sqrt(self.dk)
        attn = self.drop(torch.softmax(torch.cat([null_logit, logits], dim=-1), dim=-1))  # (B, Q, h, 1 + H)
        out = attn[..., :1] * nv + (attn[..., 1:].reshape(B * Q, self.h, 1, H) @ v).view(B, Q, self.h, self.dk)
        return self.out(out.reshape(B, Q, d))


class Layer(nn.Module):
    def __init__(self, cfg: TimeAwareConfig):
        super().__init__()
        self.attn = GroupedCrossAttention(cfg)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.ffn = nn.Sequential(nn.Linear(cfg.d_model, cfg.ffn_dim), nn.GELU(), nn.Dropout(cfg.dropout),
                                 nn.Linear(cfg.ffn_dim, cfg.d_model))
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, rows, rel):
        x = self.norm1(x + self.drop(self.attn(x, rows, rel)))
        return self.norm2(x + self.drop(self.ffn(x)))


N_ROW_NUM = 7
N_QUERY_NUM = 13
DROP_CENTRES_H = [1 / 12, 1.0, 6.0, 24.0, 72.0, 168.0, 720.0, 2160.0, 8760.0]  # the curve's drops: 5 min to a year
DROP_WIDTH = 0.5  # in log(1 + hours)
ANY_CENTRES_H = [0.1, 1.0, 6.0, 24.0]  # time terms: hours since the user's last review
SCHEDULE_POINTS, SCHEDULE_LEVELS = 33, 5  # `schedule`: nested grids over log(1 + hours), 32^5 finer in the end
MAX_WAIT_DAYS = 1e6


class TimeAwareTransformer(nn.Module):
    family = "time_aware"
    task = "srs"

    def __init__(self, cfg: TimeAwareConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.rating_emb = nn.Embedding(5, d)  # 0 unused, 1..4
        self.state_emb = nn.Embedding(N_STATES, d)
        self.relation_emb = nn.Embedding(3, d)  # other card of another deck, same deck, same card
        self.row_num = nn.Linear(N_ROW_NUM, d)
        self.row_t2v = Time2Vec(cfg.t2v_dim)
        self.row_time = nn.Linear(cfg.t2v_dim, d)
        self.row_norm = nn.LayerNorm(d)
        self.q_num = nn.Sequential(nn.Linear(N_QUERY_NUM, d), nn.GELU(), nn.Linear(d, d // 2))
        self.q_last_rating = nn.Embedding(5, d)  # 0: card never seen in the window
        self.q_cat = nn.Linear(d, d - d // 2)
        self.q_norm = nn.LayerNorm(d)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.rating_w = nn.Linear(d, 1)  # a new card's recall logit (no curve)
        self.curve_head = nn.Linear(d, 3 + len(DROP_CENTRES_H))  # corrections to FSRS-6's S and decay, ceiling, drops
        # FSRS-6's 21 parameters (fsrs.py) a user starts with, before a fit on their own reviews: fsrs-rs's
        # defaults, or those training fitted (a single-user artifact). Each user's own parameters are an input
        # (the state's `fsrs_w`, Query.params); these are only the rows' default
        self.register_buffer("fsrs_w", torch.tensor(fsrs.DEFAULT_W))
        self.register_buffer("drop_centres", torch.log1p(torch.tensor(DROP_CENTRES_H)), persistent=False)
        self.register_buffer("any_centres", torch.log1p(torch.tensor(ANY_CENTRES_H)), persistent=False)
        self.time_head = nn.Linear(d, 1 + len(ANY_CENTRES_H) + 2)  # weights of _time_terms' rising, falling
        # every correction starts at (nearly) nothing: an untrained model is FSRS-6 (ceiling 0.9997, drops and
        # time weights 3e-4 each)
        nn.init.zeros_(self.time_head.weight)
        nn.init.constant_(self.time_head.bias, -8.0)
        nn.init.zeros_(self.curve_head.weight)
        with torch.no_grad():
            self.curve_head.bias.copy_(torch.tensor([0.0, 0.0, 8.0] + [-8.0] * len(DROP_CENTRES_H)))
            self.rating_w.bias.fill_(1.0)
        self.threshold_gaps = nn.Parameter(torch.tensor([1.0, 2.0]))
        if cfg.adaptive_gaps:
            self.gap_head = nn.Linear(d, 2)
            nn.init.zeros_(self.gap_head.weight)
            nn.init.zeros_(self.gap_head.bias)
        # (scale, shift) applied to the three threshold logits: identity while training, then fitted on held-out
        # reviews (time_aware_loop.calibrate); a positive scale keeps the thresholds ordered
        self.register_buffer("calibration", torch.tensor([1.0, 0.0]))
        # how much of the network's curve to trust against FSRS-6's own (recall logit = FSRS-6 + blend * (network -
        # FSRS-6)): 1 while training, then fitted on held-out reviews with a pull towards 0 (time_aware_loop)
        self.register_buffer("blend", torch.tensor(1.0))
        # logit offset per unit of drift (see `drift_offset`): cfg.drift_gain while training, then fitted on held-out
        # reviews with a pull towards it (time_aware_loop.calibrate)
        self.register_buffer("drift_gain", torch.tensor(float(cfg.drift_gain)))
        self.register_buffer("deck_drift_gain", torch.tensor(float(cfg.deck_drift_gain)))  # the same, for the deck
        # added to the duration head's log(1 + seconds): 0 while training, then fitted on held-out reviews so that the
        # predicted answer time is their median (time_aware_loop.calibrate)
        self.register_buffer("duration_shift", torch.tensor(0.0))
        self.duration = nn.Sequential(nn.Linear(d + 1, d), nn.GELU(), nn.Linear(d, 1))
        with torch.no_grad():
            self.duration[-1].bias.fill_(2.0)  # log(1 + ~7 s)

    # ---- features -------------------------------------------------------------------------------
    def _row_features(self, w: Window) -> torch.Tensor:
        """(B, H, N_ROW_NUM) per-row features from the rows before it in the window."""
        B, H = w.card.shape
        before = torch.ones(H, H, dtype=torch.bool, device=w.card.device).tril(-1)  # [j, k]: k < j
        prev = before & (w.card.unsqueeze(-1) == w.card.unsqueeze(-2)) & w.valid.unsqueeze(-2) & w.valid.unsqueeze(-1)
        # counts as float32 matrix products and maxima (exact for these small integers; ONNX Runtime's integer
        # and float64 reductions over (H, H) cost more than the rest of the graph at H = 256)
        prev_f = prev.float()
        n_prev = prev_f.sum(-1)
        lapses = (prev_f @ (w.rating == 1).float().unsqueeze(-1)).squeeze(-1)
        has_prev = n_prev > 0
        # the card's previous row is the latest such row (rows are in time order); times stay float64 until the
        # difference is taken, so no row's feature depends on another row's rounding
        index = torch.arange(1, H + 1, device=w.card.device, dtype=torch.float32)
        last = ((prev_f * index).amax(-1) - 1).clamp(min=0).long()  # (B, H)
        last_prev = torch.gather(w.time, 1, last)
        interval = torch.where(has_prev, (w.time - last_prev) / DAY, 0.0).float()
        dur = torch.nan_to_num(w.duration, nan=0.0)
        return torch.stack([
            _log1p(interval), _log1p(interval * 24), has_prev.float(), _log1p(n_prev), _log1p(lapses),
            _log1p(dur), torch.isnan(w.duration).float()], dim=-1)

    def day_start(self, day_start: torch.Tensor | None, time: torch.Tensor) -> torch.Tensor:
        """(B,) float64 seconds after 00:00 UTC at which each row's user's scheduler days start: the rows' own, or
        the config's `day_start_hour` for every row of `time` (B, Q)."""
        if day_start is not None:
            return day_start.double()
        return torch.full_like(time[:, 0], self.cfg.day_start_hour * 3600.0, dtype=torch.float64)

    @staticmethod
    def _day(t: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """The scheduler day of unix times t (B, ...) float64 for users whose days start `start` (B,) seconds after
        00:00 UTC."""
        return torch.floor((t - start.view(-1, *([1] * (t.dim() - 1)))) / DAY)

    def _core(self, w: Window, q: Query, visible: torch.Tensor) -> Prediction:
        """Predictions for queries (B, Q) over rows (B, H); visible (B, Q, H) says which rows each query sees."""
        x, ctx = self._encode(w, q, visible)
        ctx["drift"] = self._drift(w, q, ctx["visible"])
        return self._heads(x, ctx, ctx["elapsed"])

    def _encode(self, w: Window, q: Query, visible: torch.Tensor):
        """(query state x (B, Q, d), the context of the query's time terms: `elapsed` days since the card's last
        review, whether it has one (`seen`), the reference time, and what `_time_terms` needs).

        Nothing but the forgetting curve sees the query's time: the rows, the attention and the query features
        are all relative to a reference time, the card's last review (or, for a card with no row, the user's last
        review), so with the rows fixed, P(recall) is the curve evaluated at the time since the card's last
        review: monotone non-increasing in it by construction."""
        B, H = w.card.shape
        visible = visible & w.valid.unsqueeze(1)
        same_card = visible & (w.card.unsqueeze(1) == q.card.unsqueeze(-1))
        same_deck = visible & (w.deck.unsqueeze(1) == q.deck.unsqueeze(-1)) & ~same_card
        positions = torch.arange(H, device=w.card.device)
        n_card = same_card.sum(-1).float()
        seen = n_card > 0
        any_row = visible.any(-1)
        last_card = torch.where(same_card, positions, -1).amax(-1).clamp(min=0)  # (B, Q) the card's last row
        last_any = torch.where(visible, positions, -1).amax(-1).clamp(min=0)  # the user's last visible row
        ref = torch.where(seen, _pick(w.time, last_card), torch.where(any_row, _pick(w.time, last_any), q.time))
        start = self.day_start(q.day_start, q.time)  # (B,) each row's user's day boundary
        row_day, ref_day = self._day(w.time, start), self._day(ref, start)  # scheduler days: the rows, the reference
        params = self.params(q.params, B)  # (B, 21): each row's user's FSRS-6 parameters
        decay = params[:, 20:21]  # (B, 1): FSRS-6's decay w20 of each row's user
        # the other forecaster of the mixture: FSRS-6 with the default parameters, the card's stability under them
        default_s = q.default_stability if self.mixing(q) else None
        if q.memory is None and self.mixing(q) and default_s is None:  # both recurrences in one (half the nodes)
            both = self._fsrs_state(torch.cat([params, self.params(None, B)]), *(torch.cat([x, x]) for x in (
                w.rating, row_day, same_card, ref_day)))
            fsrs_s, fsrs_d, default_s = both[0][:B], both[1][:B], both[0][B:]
        elif q.memory is None:
            fsrs_s, fsrs_d = self._fsrs_state(params, w.rating, row_day, same_card, ref_day)
        else:
            fsrs_s, fsrs_d = q.memory[..., 0], q.memory[..., 1]
        if self.mixing(q) and default_s is None:
            default_s = self._fsrs_state(self.params(None, B), w.rating, row_day, same_card, ref_day)[0]
        mixing = {"default_s": default_s, "evidence": q.evidence} if self.mixing(q) else {}
        elapsed = torch.where(seen, ((q.time - ref) / DAY).clamp(min=0), 0.0)  # (B, Q) days, float64
        rel_days = ((ref.unsqueeze(-1) - w.time.unsqueeze(1)) / DAY).float()  # (B, Q, H): < 0 after the reference
        after = torch.flip(torch.cumsum(torch.flip(visible.long(), [-1]), -1), [-1]).float() - 1  # rows after j
        rel = {"dt_days": rel_days.clamp(min=0), "same_card": same_card, "same_deck": same_deck,
               "visible": visible, "after": after.clamp(min=0)}

        # rows: own features + time relative to the reference + relation to the query
        row_feats = self._row_features(w)
        row = (self.rating_emb(w.rating.clamp(1, 4)) + self.state_emb(torch.where(w.state < 0, 4, w.state))
               + self.row_num(row_feats))  # (B, H, d)
        relation = same_card.long() * 2 + same_deck.long()
        signed_hours = torch.sign(rel_days) * _log1p(rel_days.abs() * 24)
        rows = row.unsqueeze(1) + self.row_time(self.row_t2v(signed_hours)) + self.relation_emb(relation)
        rows = self.row_norm(rows)  # (B, Q, H, d)

        # query features: what the rows say about the card and the user at the reference time
        last_rating = torch.where(seen, _pick(w.rating, last_card), 0)
        dur = torch.nan_to_num(w.duration, nan=0.0)
        last_dur_card = torch.where(seen, _pick(dur, last_card), 0.0)
        last_interval = torch.where(seen, _pick(row_feats[..., 0], last_card), 0.0)
        lapses = (same_card & (w.rating == 1).unsqueeze(1)).sum(-1).float()
        last_dur_any = torch.where(any_row, _pick(dur, last_any), 0.0)
        later = (visible & (rel_days < 0)).sum(-1).float()  # reviews of other cards since the card's last one
        same_day = (visible & (row_day.unsqueeze(1) == ref_day.unsqueeze(-1))).sum(-1).float()
        n_deck = same_deck.sum(-1).float()
        gap_before = torch.where(seen, _pick(row_feats[..., 1], last_card), 0.0)  # log1p hours, card's last interval
        qnum = torch.stack([
            seen.float(), _log1p(n_card), _log1p(lapses), _log1p(last_dur_card), last_interval, gap_before,
            _log1p(last_dur_any), _log1p(later), _log1p(same_day), _log1p(n_deck),
            (n_card > 0).float() * (lapses / n_card.clamp(min=1)),
            torch.where(seen, torch.log(fsrs_s), 0.0), torch.where(seen, fsrs_d / 10, 0.0)], dim=-1)
        x = torch.cat([self.q_num(qnum), self.q_cat(self.q_last_rating(last_rating))], dim=-1)
        x = self.q_norm(x)

        for layer in self.layers:
            x = layer(x, rows, rel)
        lag = torch.where(any_row, ((_pick(w.time, last_any) - ref) / DAY).float().clamp(min=0), 0.0)
        return x, {"elapsed": elapsed, "seen": seen, "ref": ref, "ref_day": ref_day, "day_start": start, "lag": lag,
                   "visible": visible, "row_day": row_day, "curve": self.curve(x, fsrs_s, decay), "fsrs_s": fsrs_s,
                   "decay": decay,
                   "time_weight": F.softplus(self.time_head(x)),
                   "gap": self._longest_gap(row_feats, visible) * self.cfg.gap_factor, **mixing}

    def mixing(self, q: Query) -> bool:
        """Whether queries `q` get the mixture with FSRS-6's defaults: the config has it and the user's evidence is
        given."""
        return self.cfg.evidence_prior is not None and q.evidence is not None

    def params(self, params: torch.Tensor | None, batch: int) -> torch.Tensor:
        """(B, 21) FSRS-6 parameters: the rows' own, or the model's `fsrs_w` (the defaults) for every row."""
        return self.fsrs_w.unsqueeze(0).expand(batch, -1) if params is None else params

    def _fsrs_state(self, params: torch.Tensor, rating: torch.Tensor, row_day: torch.Tensor, same_card: torch.Tensor,
                    ref_day: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """FSRS-6's (stability, difficulty) of each query's card after its reviews in the window (B, Q): the card's
        last `card_window` rows at most (review_window keeps those), so a card with more reviews starts its state at
        the oldest of them. Days are scheduler days relative to the reference time's."""
        B, Q, H = same_card.shape
        C = self.cfg.card_window
        positions = torch.arange(H, device=same_card.device)
        rows = torch.where(same_card, positions, -1)
        rows = torch.cat([torch.full_like(rows[..., :1], -1).expand(B, Q, C), rows], -1)  # any H has C candidates
        rows = torch.flip(rows.topk(C, -1).values, [-1])  # (B, Q, C) the card's rows, oldest first, -1 for none
        at = rows.clamp(min=0).reshape(B, Q * C)
        card_rating = torch.gather(rating, 1, at).view(B, Q, C).float()
        day = (torch.gather(row_day, 1, at).view(B, Q, C) - ref_day.unsqueeze(-1)).float()
        return fsrs.memory_state(params.unsqueeze(1), card_rating, day, rows >= 0)  # (B, 1, 21): each row's user

    def _days(self, ctx: dict, elapsed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the scheduler day `elapsed` days after the reference (float64), whole scheduler days since it (float32)):
        both never fall as `elapsed` grows."""
        day = self._day(ctx["ref"] + elapsed.double() * DAY, ctx["day_start"])
        return day, (day - ctx["ref_day"]).clamp(min=0).float()

    def _time_terms(self, ctx: dict, elapsed: torch.Tensor, day: torch.Tensor,
                    days: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The query-time features, as functions of the days since the card's last review (`elapsed`, any shape
        ctx's (B, Q) broadcasts to): (rising (..., R): never fall as time passes; falling (..., F): never rise,
        for queries after the window's last review, as every query is)."""
        since_any = (elapsed - ctx["lag"]).clamp(min=0)  # days since the user's last review
        hours = torch.log1p(since_any * 24).unsqueeze(-1)
        rising = torch.cat([_log1p(days).unsqueeze(-1),
                            torch.sigmoid((hours - self.any_centres.to(hours.dtype)) / DROP_WIDTH).float()], -1)
        today = (ctx["visible"] & (ctx["row_day"].unsqueeze(1) == day.unsqueeze(-1))).sum(-1).float()
        falling = torch.stack([(days == 0).float(), _log1p(today)], -1)
        return rising, falling

    def curve(self, x: torch.Tensor, fsrs_s: torch.Tensor, decay: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The card's forgetting curve from the query state x and FSRS-6's stability of the card: (stability S in
        days, decay d, ceiling m, drops w):

            logit P(recall) = logit(m (1 + f n / S)^(-d)) - sum_k w_k sigmoid((log(1 + 24 t) - c_k) / s)

        after n whole scheduler days (FSRS's time) and t days, with f = 0.9^(-1/d) - 1 (FSRS-6's power curve: m * 0.9
        at n = S; the ceiling m < 1 allows slips) and w_k >= 0 at fixed centres c_k from 5 minutes to a year. S and
        d are FSRS-6's, each times a learned correction, so a model that has learned nothing is FSRS-6; every term
        only lowers recall as time passes, so the curve never rises, however the network sets S, d, m and w."""
        raw = self.curve_head(x)
        stability = fsrs_s * torch.exp(raw[..., 0].clamp(-6.0, 6.0))
        base = ((decay - 0.05) / 0.95).clamp(1e-4, 1 - 1e-4)  # the user's FSRS-6 decay (B, 1)
        decay = 0.05 + 0.95 * torch.sigmoid(torch.log(base) - torch.log1p(-base) + raw[..., 1])
        log_ceiling = F.logsigmoid(raw[..., 2].double())  # log m, exact near m = 1
        drops = F.softplus(raw[..., 3:])
        return stability, decay, log_ceiling, drops

    def _curve_logit(self, curve: tuple[torch.Tensor, ...], days: torch.Tensor, elapsed: torch.Tensor) -> torch.Tensor:
        """logit P(recall) on `curve` after `days` scheduler days and `elapsed` days (before calibration)."""
        stability, decay, log_ceiling, drops = curve
        log_p = log_ceiling + fsrs.log_retrievability(decay, stability, days).double()
        return _logit_of_log(log_p).float() - self._drops(drops, elapsed)

    def _drops(self, drops: torch.Tensor, elapsed: torch.Tensor) -> torch.Tensor:
        """The curve's drops after `elapsed` days: sum_k w_k sigmoid((log(1 + 24 t) - c_k) / s), never falling."""
        hours = torch.log1p(elapsed * 24).unsqueeze(-1)
        centres = self.drop_centres.to(hours.dtype)
        return (drops.to(hours.dtype) * torch.sigmoid((hours - centres) / DROP_WIDTH)).sum(-1)

    @staticmethod
    def _longest_gap(row_feats: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """(B, Q) float64 days: the longest interval between two reviews of one card among the rows each query sees,
        at least a day (`gap_shrink`'s G)."""
        interval = torch.expm1(row_feats[..., 0]).unsqueeze(1)  # (B, 1, H) days since the row card's previous review
        return torch.where(visible, interval, 0.0).amax(-1).clamp(min=1.0).double()

    def _network_logit(self, ctx: dict, elapsed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the network's logit P(recall) `elapsed` (float64) days after the card's last review, the whole scheduler
        days since it)."""
        day, days = self._days(ctx, elapsed)  # from float64 elapsed: the day a query falls on is exact
        elapsed = elapsed.float()
        rising, falling = self._time_terms(ctx, elapsed, day, days)
        weight = ctx["time_weight"].to(rising.dtype)
        n = rising.shape[-1]
        return (self._curve_logit(ctx["curve"], days, elapsed) - (weight[..., :n] * rising).sum(-1)
                + (weight[..., n:] * falling).sum(-1)), days

    def _recall_logit(self, ctx: dict, elapsed: torch.Tensor) -> torch.Tensor:
        """logit P(recall) (before calibration) of a seen card `elapsed` (float64) days after its last review: the
        network's curve, minus the rising time terms, plus the falling ones, each with a weight >= 0 from x
        (`time_head`): a sum of terms none of which rises with time; mixed with FSRS-6's own curve by `blend`.
        With `gap_shrink`, past the longest gap G the rows show, the network's curve is its value at G times FSRS-6's
        fall from G (still never rising); with `interval_ratio_max` / `_min`, the result is kept between FSRS-6's curve
        slowed and sped up in time by those factors."""
        if self.cfg.gap_shrink:
            capped = torch.minimum(elapsed, ctx["gap"])
            network, at_gap = self._network_logit(ctx, capped)
            _, days = self._days(ctx, elapsed)
            fall = (fsrs.log_retrievability(ctx["decay"], ctx["fsrs_s"], days)
                    - fsrs.log_retrievability(ctx["decay"], ctx["fsrs_s"], at_gap)).double().clamp(max=0.0)
            network = torch.where(elapsed > capped, _logit_of_log(F.logsigmoid(network.double()) + fall).float(),
                                  network)
        else:
            network, days = self._network_logit(ctx, elapsed)
        base = self._fsrs_logit(ctx, days)  # FSRS-6
        # blend in [0, 1]: two non-increasing curves, mixed; the drift offset does not depend on the query's time
        logit = base + self.blend * (network - base) + ctx["drift"]
        # FSRS-6 at the elapsed time over each ratio: non-increasing bounds, so the bounded curve still never rises
        # (in continuous days: in FSRS-6's whole scheduler days a bound would move with the hour of the last review),
        # never past FSRS-6's own curve, which counts whole days (so at blend 0 the curve is FSRS-6's, bounds or not)
        top, floor = self.cfg.interval_ratio_max, self.cfg.interval_ratio_min
        if top is not None:
            logit = torch.minimum(logit, torch.maximum(base, self._fsrs_logit(ctx, (elapsed / top).float())))
        if floor is not None:
            logit = torch.maximum(logit, torch.minimum(base, self._fsrs_logit(ctx, (elapsed / floor).float())))
        return logit

    @staticmethod
    def _fsrs_logit(ctx: dict, days: torch.Tensor) -> torch.Tensor:
        """FSRS-6's logit P(recall) after `days` days, with each query's card state and decay."""
        return _logit_of_log(fsrs.log_retrievability(ctx["decay"], ctx["fsrs_s"], days).double()).float()

    def _drift(self, w: Window, q: Query, visible: torch.Tensor) -> torch.Tensor:
        """(B, Q) both drifts' recall logit offset: the deck's over the rows each query sees (`visible`, with their
        errors), plus the user's from the query's drift sums (none: 0). The same at every elapsed time."""
        offset = self.deck_drift_gain * self.drift_mean(self.deck_drift_sums(w, q.deck, visible))
        return offset if q.drift is None else offset + self.drift_offset(q.drift)

    def drift_offset(self, drift: torch.Tensor) -> torch.Tensor:
        """The recall logit offset of the user's drift sums (..., 2) = (m, w): m the weighted sum of FSRS-6's errors
        (y - P(recall)) on the user's scored reviews so far, w the sum of their weights (each halves every
        `drift_halflife` scored reviews after it): gain * m / (w + drift_prior), a weighted mean shrunk towards 0."""
        return self.drift_gain * self.drift_mean(drift)

    def drift_mean(self, drift: torch.Tensor) -> torch.Tensor:
        """The drift sums' weighted mean error shrunk towards 0: m / (w + drift_prior) (the offset per unit of gain)."""
        return drift[..., 0] / (drift[..., 1] + self.cfg.drift_prior)

    def deck_drift_sums(self, w: Window, deck: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """(B, Q, 2): the deck's drift sums (m, w) for queries of `deck` (B, Q) over the rows each sees (B, Q, H):
        the rows of that deck with an error (scored), each weighted a^(such rows after it), a = drift_decay."""
        if w.error is None:
            return torch.zeros(*deck.shape, 2, device=deck.device)
        known = ~torch.isnan(w.error)
        counted = (visible & (w.deck.unsqueeze(1) == deck.unsqueeze(-1)) & known.unsqueeze(1)).float()
        after = counted.sum(-1, keepdim=True) - torch.cumsum(counted, -1)  # such rows after each row
        weight = counted * torch.exp(after * math.log(drift_decay(self.cfg.drift_halflife)))
        error = torch.where(known, w.error, 0.0).unsqueeze(1)
        return torch.stack([(weight * error).sum(-1), weight.sum(-1)], -1)

    def _fsrs_now(self, ctx: dict, elapsed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(FSRS-6's own P(recall) `elapsed` days after the card's last review, 0 for a card without one; whether
        the protocol scores such a review: the card's last review was on an earlier scheduler day)."""
        _, days = self._days(ctx, elapsed)
        p = torch.exp(fsrs.log_retrievability(ctx["decay"], ctx["fsrs_s"], days).double()).float()
        return torch.where(ctx["seen"], p, 0.0), ctx["seen"] & (days > 0)

    def drift_update(self, drift: torch.Tensor, pred: Prediction, rating: torch.Tensor) -> torch.Tensor:
        """The drift sums (B, 2) after a review with this rating that `pred` answered (before it was made)."""
        a = drift_decay(self.cfg.drift_halflife)
        error = (rating > 1).float() - pred.fsrs_recall
        m = torch.where(pred.scored, a * drift[:, 0] + error, drift[:, 0])
        w = torch.where(pred.scored, a * drift[:, 1] + 1.0, drift[:, 1])
        return torch.stack([m, w], dim=-1)

    def _heads(self, x: torch.Tensor, ctx: dict, elapsed: torch.Tensor) -> Prediction:
        recall_logit = torch.where(ctx["seen"], self._recall_logit(ctx, elapsed),
                                   self.rating_w(x).squeeze(-1))  # a new card: no curve, no time
        raw = self.threshold_gaps + self.gap_head(x) if self.cfg.adaptive_gaps else self.threshold_gaps
        gaps = F.softplus(raw)  # (..., 2) > 0
        s = recall_logit.unsqueeze(-1)
        g1, g2 = gaps[..., :1], gaps[..., 1:]
        tl = torch.cat([s, s - g1, s - g1 - g2], dim=-1)  # (..., 3), decreasing in k
        tl = tl * self.calibration[0] + self.calibration[1]
        network_recall = torch.sigmoid(tl[..., 0])
        default_recall = torch.zeros_like(network_recall)
        if "default_s" in ctx:
            default_logit, default_recall = self._default_logit(ctx, elapsed)
            if ctx["evidence"] is not None:  # every threshold moves with P(recall): the Hard/Good/Easy split stays
                mixed = self._mixture(tl[..., 0], default_logit, ctx["evidence"])
                tl = tl + torch.where(ctx["seen"], mixed - tl[..., 0], 0.0).unsqueeze(-1)
        above = torch.sigmoid(tl)  # P(rating > k), k = 1..3
        one = torch.ones_like(above[..., :1])
        zero = torch.zeros_like(above[..., :1])
        cum = torch.cat([one, above, zero], dim=-1)
        probs = (cum[..., :-1] - cum[..., 1:]).clamp(min=0)
        # answer time may depend on recall
        log_duration = self.duration(torch.cat([x, s], dim=-1)).squeeze(-1) + self.duration_shift
        return Prediction(probs, above[..., 0], log_duration, tl, *self._fsrs_now(ctx, elapsed), network_recall,
                          default_recall)

    def _default_logit(self, ctx: dict, elapsed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logit, P(recall)) of FSRS-6 with the default parameters `elapsed` days after the card's last review (P 0
        for a card without one)."""
        _, days = self._days(ctx, elapsed)
        log_p = fsrs.log_retrievability(self.fsrs_w[20], ctx["default_s"], days).double()
        return _logit_of_log(log_p).float(), torch.where(ctx["seen"], torch.exp(log_p).float(), 0.0)

    @staticmethod
    def _mixture(network: torch.Tensor, default: torch.Tensor, evidence: torch.Tensor) -> torch.Tensor:
        """logit of sigmoid(E) * P_network + sigmoid(-E) * P_default, from the two logits and the evidence E (float64
        inside: log-sum-exps of log-sigmoids, exact near P = 1). Two non-increasing curves mixed with weights that do
        not depend on the time: a non-increasing curve."""
        n, d, e = network.double(), default.double(), evidence.double()
        w_n, w_d = F.logsigmoid(e), F.logsigmoid(-e)
        log_p = _logaddexp(w_n + F.logsigmoid(n), w_d + F.logsigmoid(d))
        log_q = _logaddexp(w_n + F.logsigmoid(-n), w_d + F.logsigmoid(-d))
        return (log_p - log_q).float()

    def _served_logit(self, ctx: dict, elapsed: torch.Tensor) -> torch.Tensor:
        """The served logit P(recall) of a seen card `elapsed` days after its last review: calibrated, and mixed with
        FSRS-6's defaults by the evidence."""
        s = self._recall_logit(ctx, elapsed) * self.calibration[0] + self.calibration[1]
        return self._mixture(s, self._default_logit(ctx, elapsed)[0], ctx["evidence"])

    def evidence_update(self, evidence: torch.Tensor, pred: Prediction, rating: torch.Tensor) -> torch.Tensor:
        """The evidence (B,) after a review with this rating that `pred` answered (before it was made): where the
        protocol scores it, decayed by one scored review, plus FSRS-6's defaults' log loss on it minus the
        network's."""
        _, a = self.evidence_constants()
        gain = recall_log_loss(pred.default_recall, rating) - recall_log_loss(pred.network_recall, rating)
        return torch.where(pred.scored, a * evidence.double() + gain, evidence.double()).float()

    def evidence_constants(self) -> tuple[float, float]:
        """(the evidence a user starts with, the factor it decays by per scored review)."""
        halflife = self.cfg.evidence_halflife
        return float(self.cfg.evidence_prior or 0.0), drift_decay(halflife) if halflife else 1.0

    # ---- the streaming contract (streaming.py) ------------------------------------------------------
    # The state is a window of the user's latest reviews (each field (B, H), left-padded, in time order); the
    # service keeps raw reviews and picks each query's window with review_window.select, which `step` equals
    # while the card's own reviews are among the latest H.
    # The state is the window's eight fields (the seven raw ones and each row's FSRS-6 error) and the user's drift
    # sums (B, 2).
    def state_spec(self) -> list[dict]:
        H = self.cfg.window
        return [*({"name": f"hist_{name}", "shape": [H], "dtype": dtype, "init": "empty window"}
                  for name, dtype in zip(Window._fields, WINDOW_DTYPES, strict=True)),
                {"name": "drift", "shape": [2], "dtype": DRIFT_DTYPE, "init": "zeros"},
                {"name": "fsrs_w", "shape": [N_PARAMS], "dtype": "float32",
                 "init": "the model's fsrs_w (FSRS-6's parameters a user starts with)"},
                {"name": "day_start", "shape": [], "dtype": "float64",
                 "init": "the config's day_start_hour in seconds (the user's scheduler day boundary after 00:00 UTC)"},
                {"name": "evidence", "shape": [], "dtype": "float32",
                 "init": "the config's evidence_prior (the user's evidence for the network over FSRS-6's defaults)"}]

    def init_state(self, batch: int) -> tuple:
        H = self.cfg.window
        return (*(torch.zeros(batch, H, dtype=getattr(torch, d)) for d in WINDOW_DTYPES), torch.zeros(batch, 2),
                self.fsrs_w.float().unsqueeze(0).repeat(batch, 1),
                torch.full((batch,), self.cfg.day_start_hour * 3600.0, dtype=torch.float64),
                torch.full((batch,), self.evidence_constants()[0]))

    @staticmethod
    def row_error(pred: Prediction, rating: torch.Tensor) -> torch.Tensor:
        """FSRS-6's error on a review that `pred` answered (before it was made): rating > 1 minus its recall, NaN
        where the protocol does not score it (the window's `error` field; the drift sums add the same)."""
        return torch.where(pred.scored, (rating > 1).float() - pred.fsrs_recall, math.nan)

    def step(self, state, card, deck, time, rating, duration, review_state) -> tuple:
        """Append one review (each field (B,)) as the newest row, with FSRS-6's error on it (a full window drops its
        oldest), after adding that error to the drift when the protocol scores it (`drift_update`)."""
        pred = self.readout(state, card, deck, time)
        new = (card, deck, time, rating, duration, review_state, torch.ones_like(card, dtype=torch.bool),
               self.row_error(pred, rating))
        return (*(torch.cat([old[:, 1:], row.to(old.dtype).unsqueeze(1)], 1)
                  for old, row in zip(state[:8], new, strict=True)), self.drift_update(state[8], pred, rating),
                *state[9:11],  # the user's parameters and day boundary: unchanged by a review (a refit sets them)
                *(self.evidence_update(e, pred, rating) for e in state[11:12]))

    @staticmethod
    def _query(state, card: torch.Tensor, deck: torch.Tensor, time: torch.Tensor) -> tuple[Window, Query]:
        """(the window, one query (B, 1) per row) of a state: its drift sums (B, 2), the user's FSRS-6 parameters
        (B, 21), day boundary (B,) and evidence (B,) where it has them; a bare Window has no drift, the model's
        parameters and day boundary and no mixture, and so does a state saved before parameters (nine tensors), the
        day boundary (ten) or the evidence (eleven) were in it."""
        q = (card.unsqueeze(1), deck.unsqueeze(1), time.unsqueeze(1))
        if isinstance(state, Window):
            return state, Query(*q)
        return Window(*state[:8]), Query(*q, state[8].unsqueeze(1), state[9] if len(state) > 9 else None,
                                         state[10] if len(state) > 10 else None,
                                         evidence=state[11].unsqueeze(1) if len(state) > 11 else None)

    def readout(self, state, card: torch.Tensor, deck: torch.Tensor, time: torch.Tensor,
                memory: torch.Tensor | None = None, default_stability: torch.Tensor | None = None) -> Prediction:
        """One query per state: (B, H) rows and (B, 2) drift (or a bare Window: no drift), query (B,) -> outputs
        (B, ...). The serving path. `memory` (B, 2): the query cards' FSRS-6 (stability, difficulty) given
        (`card_memory`) rather than computed from the window (a card without a review in it reads none of it);
        `default_stability` (B,): the same stability under the default parameters (`card_memory` with them)."""
        w, q = self._query(state, card, deck, time)
        if memory is not None:
            q = q._replace(memory=memory.unsqueeze(1))
        if default_stability is not None:
            q = q._replace(default_stability=default_stability.unsqueeze(1))
        pred = self._core(w, q, w.valid.unsqueeze(1))
        return Prediction(*(t.squeeze(1) for t in pred))

    def card_memory(self, state, card: torch.Tensor, deck: torch.Tensor, time: torch.Tensor,
                    default: bool = False) -> torch.Tensor:
        """(B, 2) FSRS-6's (stability, difficulty) of each query's card (B,) after its reviews in the window (its
        last `card_window`): what `readout` computes inside, and what its `memory` stands in for (`default`: under
        the default parameters, what `default_stability` stands in for). Meaningless for a card without a review in
        the window."""
        w, q = self._query(state, card, deck, time)
        same_card = w.valid.unsqueeze(1) & (w.card.unsqueeze(1) == q.card.unsqueeze(-1))
        row_day = self._day(w.time, self.day_start(q.day_start, q.time))
        s, d = self._fsrs_state(self.params(None if default else q.params, w.card.shape[0]), w.rating, row_day,
                                same_card, row_day[:, -1:])  # (only day differences count: any reference day)
        return torch.stack([s, d], -1).squeeze(1)

    def schedule(self, state, card: torch.Tensor, deck: torch.Tensor, time: torch.Tensor,
                 retention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One query per window at `time` (now) with a desired retention per row: (P(recall) at the due, or now if
        that is past; log(1 + days from now to the due), 0 when due now; the expected answer time at that moment).
        The due is where the (calibrated) curve falls to the retention: the curve is monotone, so nested grids over
        log time find it, each SCHEDULE_POINTS points inside the last grid's crossing, for every row at once
        (5 levels: within 1e-6 of the log time, a few seconds at a month; a few graph nodes, where a bisection's
        many steps made the exported graph slow to build). A card without a review in the window is due now, and
        so is one already at or below the retention; one still above it after 10^6 days waits that long. Lower
        retention, later due, for every card."""
        w, q = self._query(state, card, deck, time)
        x, ctx = self._encode(w, q, w.valid.unsqueeze(1))
        ctx["drift"] = self._drift(w, q, ctx["visible"])
        elapsed, seen = ctx["elapsed"], ctx["seen"]
        scale, shift = self.calibration[0].double(), self.calibration[1].double()
        p = retention.double().clamp(1e-6, 1 - 1e-6).unsqueeze(1)
        if ctx.get("evidence") is not None:  # the served curve itself: calibrated, mixed with FSRS-6's defaults
            target, curve = torch.log(p) - torch.log1p(-p), self._served_logit
        else:  # the uncalibrated curve, at the uncalibrated logit of the due
            target, curve = (torch.log(p) - torch.log1p(-p) - shift) / scale, self._recall_logit
        lo = torch.log1p(elapsed.double() * 24)  # log(1 + hours since the last review): now ...
        hi = torch.full_like(lo, math.log1p(MAX_WAIT_DAYS * 24))  # ... and the longest wait
        grid = torch.linspace(0.0, 1.0, SCHEDULE_POINTS, dtype=torch.float64)
        for _ in range(SCHEDULE_LEVELS):  # the curve falls: the points above the target are a prefix of the grid
            step = (hi - lo) / (SCHEDULE_POINTS - 1)
            u = lo + (hi - lo) * grid  # (B, points)
            above = (curve(ctx, torch.expm1(u) / 24) > target).sum(-1, keepdim=True)
            lo = lo + step * (above - 1).clamp(min=0).double()
            hi = torch.minimum(lo + step, hi)
        now_above = curve(ctx, elapsed) > target
        days = torch.where(now_above & seen, torch.expm1(hi) / 24 - elapsed, 0.0).clamp(min=0.0)
        pred = self._heads(x, ctx, elapsed + days)
        return pred.recall.squeeze(1), torch.log1p(days).squeeze(1), expected_duration(pred.log_duration.squeeze(1))

    def forward(self, w: Window, params: torch.Tensor | None = None, day_start: torch.Tensor | None = None
                ) -> Prediction:
        """Teacher-forced: every row of (B, T) sequences predicted from the rows before it, each user's drift
        starting at zero before the first, with each sequence's user's FSRS-6 parameters `params` (B, 21) and day
        boundary `day_start` (B,) (None: the model's `fsrs_w`, the config's day_start_hour): outputs (B, T, ...)."""
        B, T = w.card.shape
        causal = torch.ones(T, T, dtype=torch.bool, device=w.card.device).tril(-1)  # [i, j]: j < i
        mixing = torch.zeros(B, T) if self.cfg.evidence_prior is not None else None  # (the evidence comes below)
        x, ctx = self._encode(w, Query(w.card, w.deck, w.time, None, params, day_start, evidence=mixing),
                              causal.unsqueeze(0).expand(B, T, T))
        p, scored = self._fsrs_now(ctx, ctx["elapsed"])
        scored = scored & w.valid
        n = torch.cumsum(scored.float(), -1)  # scored rows up to and including each row
        after = (n - scored.float()).unsqueeze(-1) - n.unsqueeze(-2)  # [i, j]: scored rows in j+1 .. i-1

        def weights(a: float) -> torch.Tensor:  # row j's weight at query i: a^(scored rows after j and before i)
            return torch.where(causal & scored.unsqueeze(-2), torch.pow(torch.full_like(after, a),
                                                                        after.clamp(min=0)), 0.0)

        weight = weights(drift_decay(self.cfg.drift_halflife))
        error = ((w.rating > 1).float() - p).unsqueeze(-1)
        drift = torch.cat([weight @ error, weight.sum(-1, keepdim=True)], -1)  # (B, T, 2)
        rows = w._replace(error=torch.where(scored, error.squeeze(-1), math.nan))  # each row's error, as stepping
        ctx["drift"] = self._drift(rows, Query(w.card, w.deck, w.time, drift, params, day_start), ctx["visible"])
        if mixing is None:
            return self._heads(x, ctx, ctx["elapsed"])
        ctx["evidence"] = None  # each row's forecasts unmixed, then each row's evidence from the rows before it
        pred = self._heads(x, ctx, ctx["elapsed"])
        prior, a = self.evidence_constants()
        gain = recall_log_loss(pred.default_recall, w.rating) - recall_log_loss(pred.network_recall, w.rating)
        gain = torch.where(scored, gain, 0.0).unsqueeze(-1)
        before = (n - scored.float()).double()  # scored rows before each row
        ctx["evidence"] = (prior * a ** before + (weights(a).double() @ gain).squeeze(-1)).float().detach()
        return self._heads(x, ctx, ctx["elapsed"])


def expected_duration(log_duration: torch.Tensor) -> torch.Tensor:
    """Seconds from the duration head's log(1 + seconds)."""
    return torch.expm1(log_duration).clamp(min=0)


def coral_loss(pred: Prediction, rating: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over k of BCE(P(rating > k), 1[rating > k]), averaged over reviews (optionally weighted)."""
    k = torch.arange(1, 4, device=rating.device)
    target = (rating.unsqueeze(-1) > k).float()
    loss = F.binary_cross_entropy_with_logits(pred.threshold_logits, target, reduction="none").sum(-1)
    if weight is None:
        return loss.mean()
    return (loss * weight).sum() / weight.sum().clamp(min=1e-9)
