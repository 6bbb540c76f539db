"""The flashcard workload simulator: expected daily reviews and minutes over the next N days at several desired
retentions, for one user's deck (numpy only; `SpacedRepetition.simulate` feeds it).

The idea is FSRS's workload-versus-retention simulator: every card goes forward in time, reviewed whenever its
scheduler says, recalled with its predicted probability, and its memory state updated by the outcome; summed over
the deck, that is the day-by-day workload each desired retention costs. What NextStep puts in:

* The memory state between simulated reviews is FSRS-6's (`FSRS6`) with the artifact's own parameters (the curve
  its network corrects), started for each card from its stored reviews exactly as the network's anchor is (the
  card's last `card_size` reviews, the same recurrence: nextstep/models/fsrs.py), and updated after each simulated
  review by FSRS-6's rules at the recall the model predicted for it.
* The model's own forgetting curve sets the intervals and the recall: the service asks the `schedule` graph, on a
  sample of the deck's cards, when each card's predicted recall falls to the lowest and to the highest desired
  retention, and fits to the median ratios of those intervals to FSRS-6's one power curve of FSRS-6's form,
  R = (1 + f' t / (stretch S))^-decay' with f' = 0.9^(-1/decay') - 1 and S the card's FSRS-6 stability (`ModelCurve`:
  the model's curve, as far as two points on it say, for every card of the deck). Every simulated interval is where
  that curve falls to the retention, and a review's recall is that curve at its gap (so a card reviewed on time is
  recalled with probability the desired retention, as the model predicts). Running the graph on every card at
  every step would be exact but costs 0.1-0.5 ms a row on one CPU core: a 5,000-card deck could not be answered in
  a fraction of a second.
* The cost of a review is the model's predicted answer time at the due (the schedule graph's `duration_s`, averaged
  over the sample) at that retention; a new card's first review costs what the model predicts for a card the user
  has never reviewed.
* Ratings: a recalled review is Hard, Good or Easy and a new card's first review Again to Easy, with the shares of
  the user's own recent reviews (smoothed towards DEFAULT_* with PRIOR_REVIEWS pseudo-reviews).

Each card is simulated as `replicas` independent paths (at least MIN_PATHS paths per retention, so a small deck's
figures are not one coin toss per card); the figures are the paths' means. Intervals are whole scheduler days, at
least 1 (same-day relearning steps are not simulated) and at most the service's maximum interval. Seeded: the same
request gives the same answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

S_MIN, S_MAX = 0.001, 36500.0  # nextstep/models/fsrs.py's clamp
DEFAULT_FIRST = (0.25, 0.10, 0.50, 0.15)  # P(Again, Hard, Good, Easy) of a first review, when the user cannot say
DEFAULT_RECALLED = (0.20, 0.65, 0.15)  # P(Hard, Good, Easy) of a recalled review, likewise
PRIOR_REVIEWS = 20.0  # the weight of those defaults against the user's own shares, in reviews
MIN_PATHS = 2000  # simulated paths per retention, at least (a small deck's cards are replicated)
MAX_REPLICAS = 64


@dataclass(frozen=True)
class ModelCurve:
    """A power forgetting curve of FSRS-6's form on a card's FSRS-6 stability S: R(t) = (1 + f t / (stretch S))^-decay,
    f = 0.9^(-1/decay) - 1. stretch 1 with FSRS-6's decay is FSRS-6's own curve."""

    stretch: float
    decay: float

    @property
    def factor(self) -> float:
        return 0.9 ** (-1.0 / self.decay) - 1.0

    def interval(self, stability, retention):
        """Days after which R falls to `retention`."""
        return self.stretch * stability / self.factor * (np.power(retention, -1.0 / self.decay) - 1.0)

    def retrievability(self, days, stability):
        return np.power(1.0 + self.factor * np.maximum(days, 0.0) / (self.stretch * stability), -self.decay)

    @classmethod
    def through(cls, fsrs: FSRS6, retentions, ratios) -> ModelCurve:
        """The curve whose intervals at two retentions are `ratios` times FSRS-6's (one retention: FSRS-6's decay,
        stretched). Its decay is kept within DECAY_RANGE, the range the model's own decay correction spans."""
        (r1, *rest), (q1, *more) = retentions, ratios
        d = fsrs.decay
        if rest and rest[0] != r1:
            r2, q2 = rest[0], more[0]

            def spread(decay: float) -> float:  # c(r1) / c(r2) with c(r) = r^(-1/decay) - 1: falls as decay grows
                return (r1 ** (-1.0 / decay) - 1.0) / (r2 ** (-1.0 / decay) - 1.0)

            target = q1 / q2 * spread(fsrs.decay)
            lo, hi = DECAY_RANGE
            for _ in range(60):  # bisection on log decay
                mid = math.sqrt(lo * hi)
                lo, hi = (mid, hi) if spread(mid) > target else (lo, mid)
            d = math.sqrt(lo * hi)
        unit = cls(1.0, d)
        stretch = q1 * float(fsrs.interval(1.0, r1)) / float(unit.interval(1.0, r1))
        return cls(stretch, d)


DECAY_RANGE = (0.05, 1.0)  # TimeAwareTransformer.curve's decay: 0.05 + 0.95 sigmoid(...)


@dataclass(frozen=True)
class FSRS6:
    """FSRS-6's memory model in numpy (the recurrence of nextstep/models/fsrs.py), vectorised over cards."""

    w: np.ndarray  # (21,) float64

    @classmethod
    def of(cls, parameters) -> FSRS6:
        w = np.asarray(parameters, dtype=np.float64)
        if w.shape != (21,) or not np.all(np.isfinite(w)):
            raise ValueError(f"FSRS-6 needs 21 finite parameters, got {w.shape}")
        return cls(w)

    @property
    def decay(self) -> float:
        return float(self.w[20])

    @property
    def factor(self) -> float:
        return 0.9 ** (-1.0 / self.decay) - 1.0

    def initial_difficulty(self, rating: np.ndarray) -> np.ndarray:
        return self.w[4] - np.exp(self.w[5] * (rating - 1.0)) + 1.0

    def first(self, rating: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(S, D) after a card's first review."""
        return self.w[np.asarray(rating, dtype=np.int64) - 1], np.clip(self.initial_difficulty(rating), 1.0, 10.0)

    def retrievability(self, days: np.ndarray, stability: np.ndarray) -> np.ndarray:
        return np.power(1.0 + self.factor * np.maximum(days, 0.0) / stability, -self.decay)

    def interval(self, stability: np.ndarray, retention: np.ndarray) -> np.ndarray:
        """Days (real-valued) after which R falls to `retention`."""
        return stability / self.factor * (np.power(retention, -1.0 / self.decay) - 1.0)

    def next_difficulty(self, d: np.ndarray, rating: np.ndarray) -> np.ndarray:
        w = self.w
        lean = w[6] * (rating - 3.0) / 9.0
        d = d * (1 - w[7]) * (1 + lean) + w[7] * float(self.initial_difficulty(4.0)) - (1 - w[7]) * 10 * lean
        return np.clip(d, 1.0, 10.0)

    def next_stability(self, s: np.ndarray, d: np.ndarray, r: np.ndarray, rating: np.ndarray,
                       same_day: np.ndarray | None = None) -> np.ndarray:
        """S after a review with rating at retrievability r, difficulty d the one before the review."""
        w = self.w
        bonus = np.where(rating == 2, w[15], np.where(rating == 4, w[16], 1.0))
        recalled = s * (1 + np.exp(w[8]) * bonus * (11 - d) * np.power(s, -w[9]) * (np.exp((1 - r) * w[10]) - 1))
        forgot = np.minimum(w[11] * np.power(d, -w[12]) * (np.power(s + 1, w[13]) - 1) * np.exp((1 - r) * w[14]),
                            s / np.exp(w[17] * w[18]))
        new = np.where(rating == 1, forgot, recalled)
        if same_day is not None:
            short = s * np.maximum(np.exp(w[17] * (rating - 3 + w[18])) * np.power(s, -w[19]),
                                   (rating >= 2).astype(np.float64))
            new = np.where(same_day, short, new)
        return np.clip(new, S_MIN, S_MAX)

    def memory_state(self, rating: np.ndarray, day: np.ndarray, present: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(S, D) of each card after its reviews: rating, day (scheduler day numbers) and present (n, C), oldest
        first, each card's reviews a suffix of its row (left-padded). A row with no review gives (1, 5)."""
        n, c = rating.shape
        s, d = np.ones(n), np.full(n, 5.0)
        started = np.zeros(n, dtype=bool)
        last_day = np.zeros(n)
        for k in range(c):
            g, t, here = rating[:, k].astype(np.float64), day[:, k].astype(np.float64), present[:, k]
            s0, d0 = self.first(np.clip(g, 1, 4))
            gap = np.maximum(t - last_day, 0.0)
            r = self.retrievability(gap, s)
            go_on = here & started
            s_next = self.next_stability(s, d, r, g, same_day=gap == 0)
            d_next = self.next_difficulty(d, g)
            s = np.where(go_on, s_next, np.where(here, s0, s))
            d = np.where(go_on, d_next, np.where(here, d0, d))
            last_day = np.where(here, t, last_day)
            started |= here
        return s, d


def shares(counts: np.ndarray, default) -> np.ndarray:
    """A distribution from the user's counts, smoothed towards `default` by PRIOR_REVIEWS pseudo-reviews."""
    default = np.asarray(default, dtype=np.float64)
    counts = np.asarray(counts, dtype=np.float64)
    return (counts + PRIOR_REVIEWS * default) / (counts.sum() + PRIOR_REVIEWS)


def replicas(n_cards: int) -> int:
    return int(min(MAX_REPLICAS, max(1, -(-MIN_PATHS // max(n_cards, 1)))))


def simulate(fsrs: FSRS6, *, retentions: np.ndarray, days: int, curve: ModelCurve, review_s: np.ndarray,
             new_s: float, stability: np.ndarray, difficulty: np.ndarray, last_day: np.ndarray, n_new: int,
             new_per_day: int, first_shares: np.ndarray, recalled_shares: np.ndarray, max_interval: int,
             seed: int = 0) -> dict:
    """Expected reviews and seconds per day, and the cards expected to be recalled at the end, per retention.

    retentions, review_s: (R,) the desired retentions and the model's seconds per review at each; curve: the model's
    forgetting curve on FSRS-6's stability. stability, difficulty, last_day: the reviewed cards' FSRS-6 state and last
    review day
    (scheduler days relative to today, <= 0). n_new cards never reviewed are introduced `new_per_day` a day, in
    order, from today. Returns {"reviews": (R, days), "seconds": (R, days), "new": (R, days), "recalled_at_end":
    (R,), "replicas": K}."""
    rng = np.random.default_rng(seed)
    n_rev = len(stability)
    introduced = min(n_new, new_per_day * days) if new_per_day > 0 else 0
    n = n_rev + introduced
    n_ret = len(retentions)
    k = replicas(n)
    # path p: retention p // (k n), card p % n
    ret_of = np.repeat(np.arange(n_ret), k * n)
    card_of = np.tile(np.arange(n), n_ret * k)
    # float32 along the paths (twice as fast as float64 in numpy's power and exp, and what the model's graphs use)
    f32 = np.float32
    # the model's interval at a path's retention is coef * S; its recall after gap days (1 + x / stretch)^-decay',
    # x = f' gap / S
    coef = curve.interval(np.ones(n_ret), np.asarray(retentions, np.float64)).astype(f32)[ret_of]
    m_factor, m_decay, stretch = f32(curve.factor), f32(curve.decay), f32(curve.stretch)
    is_rev = card_of < n_rev
    s = np.concatenate([stability, np.ones(introduced)]).astype(f32)[card_of]
    d = np.concatenate([difficulty, np.full(introduced, 5.0)]).astype(f32)[card_of]
    last = np.concatenate([last_day, np.zeros(introduced, np.int64)])[card_of].astype(np.int64)
    fresh = ~is_rev
    due = np.where(is_rev, np.maximum(last + _days(coef * s, max_interval), 0),
                   (card_of - n_rev) // max(new_per_day, 1)).astype(np.int64)
    size = n_ret * days
    reviews, seconds, new = np.zeros(size), np.zeros(size), np.zeros(size)
    cost = np.asarray(review_s, np.float64)[ret_of]
    first_cum = np.cumsum(first_shares) / np.sum(first_shares)
    hard, good = (np.cumsum(recalled_shares) / np.sum(recalled_shares))[:2].astype(f32)  # Hard below, Easy above
    w = fsrs.w.astype(f32)
    grow, lapse_cap = np.exp(w[8]), np.exp(w[17] * w[18])
    bonuses = np.array([1, 1, w[15], 1, w[16]], dtype=f32)  # by rating: Hard's penalty, Easy's bonus
    d_target = f32(fsrs.initial_difficulty(4.0))  # difficulty's mean reversion target, D0(Easy)
    # the paths with a review to come, compacted: every step reviews each of them once, then drops those done
    act = np.flatnonzero(due < days)
    s_a, d_a, last_a, due_a, fresh_a = s[act], d[act], last[act], due[act], fresh[act]
    coef_a, cost_a, base_a = coef[act], cost[act], (ret_of[act] * days).astype(np.int64)
    while len(act):
        cell = base_a + due_a
        u = rng.random(len(act), dtype=f32)
        spent = cost_a
        if fresh_a.any():  # first reviews: a rating from the user's first-review shares, FSRS-6's initial state
            f = np.flatnonzero(fresh_a)
            g = np.minimum(1 + np.searchsorted(first_cum, u[f], side="right"), 4)
            s_f, d_f = fsrs.first(g)
            new += np.bincount(cell[f], minlength=size)
            spent = cost_a.copy()
            spent[f] = new_s
            o = np.flatnonzero(~fresh_a)
        else:
            f, o = None, slice(None)
        # later reviews: recalled with the model's probability, FSRS-6's update at that recall
        # (numpy's power, expm1 and searchsorted cost 2-6 times what exp(c log x), exp - 1 and two comparisons do)
        so, do = s_a[o], d_a[o]
        r = np.exp(-m_decay * np.log(1 + m_factor * (due_a[o] - last_a[o]).astype(f32) / (stretch * so)))
        uo = u[o]
        recalled = uo < r
        v = uo / r  # given a recall, uniform on [0, 1) and independent of it: the rating's draw
        go = np.where(recalled, f32(2) + (v >= hard) + (v >= good), f32(1))
        s_new = np.empty(len(r), dtype=f32)
        ok, lost = np.flatnonzero(recalled), np.flatnonzero(~recalled)
        s_ok, d_ok, g_ok = so[ok], do[ok], go[ok]
        bonus = bonuses[g_ok.astype(np.int64)]
        s_new[ok] = s_ok * (1 + grow * bonus * (11 - d_ok) * np.exp(-w[9] * np.log(s_ok))
                            * (np.exp((1 - r[ok]) * w[10]) - 1))
        s_lost, d_lost = so[lost], do[lost]
        s_new[lost] = np.minimum(w[11] * np.power(d_lost, -w[12]) * (np.power(s_lost + 1, w[13]) - 1)
                                 * np.exp((1 - r[lost]) * w[14]), s_lost / lapse_cap)
        lean = w[6] * (go - 3) / 9
        s_a[o] = np.clip(s_new, f32(S_MIN), f32(S_MAX))
        d_a[o] = np.clip(do * (1 - w[7]) * (1 + lean) + w[7] * d_target - (1 - w[7]) * 10 * lean, 1, 10)
        if f is not None:
            s_a[f], d_a[f], fresh_a[f] = s_f, d_f, False
        reviews += np.bincount(cell, minlength=size)
        seconds += np.bincount(cell, weights=spent, minlength=size)
        last_a = due_a
        due_a = due_a + _days(coef_a * s_a, max_interval)
        keep = due_a < days
        if not keep.all():  # done: their state at the end
            done = act[~keep]
            s[done], last[done], fresh[done] = s_a[~keep], last_a[~keep], False
            act, s_a, d_a, last_a, due_a, fresh_a, coef_a, cost_a, base_a = (
                x[keep] for x in (act, s_a, d_a, last_a, due_a, fresh_a, coef_a, cost_a, base_a))
    seen = ~fresh  # reviewed at least once, in the past or in the simulation
    r_end = np.where(seen, curve.retrievability((days - last).astype(np.float64), s.astype(np.float64)), 0.0)
    recalled_at_end = np.bincount(ret_of, weights=r_end, minlength=n_ret) / k
    shape = (n_ret, days)
    return {"reviews": reviews.reshape(shape) / k, "seconds": seconds.reshape(shape) / k,
            "new": new.reshape(shape) / k, "recalled_at_end": recalled_at_end, "replicas": k,
            "paths": len(ret_of), "introduced": introduced}


def _days(interval: np.ndarray, max_interval: int) -> np.ndarray:
    """Whole scheduler days, at least 1 and at most max_interval (NaN: 1)."""
    return np.rint(np.fmin(np.fmax(interval, 1.0), max_interval)).astype(np.int64)
