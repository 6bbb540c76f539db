"""The flashcard workload simulator: expected daily reviews and minutes over the next N days at several desired
retentions, for one user's deck (numpy only; `SpacedRepetition.simulate` feeds it).

The idea is FSRS's workload-versus-retention simulator: every card goes forward in time, reviewed whenever its
scheduler says, recalled with its predicted probability, and its memory state updated by the outcome; summed over
the deck, that is the day-by-day workload each desired retention costs. What NextStep puts in:

* The memory model between simulated reviews is FSRS-6 (`FSRS6`) with the artifact's own parameters (the curve
  its network corrects), started for each card from its stored reviews exactly as the network's anchor is (the
  card's last `card_size` reviews, the same recurrence: nextstep/models/fsrs.py).
* The model's own forgetting curve sets the intervals: the service asks the `schedule` graph, on a sample of the
  deck's cards, when each card's predicted recall falls to each desired retention, and the median ratio of that
  interval to FSRS-6's for the same card is the deck's correction `kappa` at that retention. Every simulated interval
  is kappa times FSRS-6's, and a card's recall at a review is FSRS-6's curve stretched by kappa (so a card reviewed
  on time is recalled with probability about the desired retention, as the model predicts). Running the graph on
  every card at every step would be exact but costs 0.1-0.5 ms a row on one CPU core: a 5,000-card deck could not
  be answered in a fraction of a second.
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

from dataclasses import dataclass

import numpy as np

S_MIN, S_MAX = 0.001, 36500.0  # nextstep/models/fsrs.py's clamp
DEFAULT_FIRST = (0.25, 0.10, 0.50, 0.15)  # P(Again, Hard, Good, Easy) of a first review, when the user cannot say
DEFAULT_RECALLED = (0.20, 0.65, 0.15)  # P(Hard, Good, Easy) of a recalled review, likewise
PRIOR_REVIEWS = 20.0  # the weight of those defaults against the user's own shares, in reviews
MIN_PATHS = 2000  # simulated paths per retention, at least (a small deck's cards are replicated)
MAX_REPLICAS = 64


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


def simulate(fsrs: FSRS6, *, retentions: np.ndarray, days: int, kappa: np.ndarray, review_s: np.ndarray,
             new_s: float, stability: np.ndarray, difficulty: np.ndarray, last_day: np.ndarray, n_new: int,
             new_per_day: int, first_shares: np.ndarray, recalled_shares: np.ndarray, max_interval: int,
             seed: int = 0) -> dict:
    """Expected reviews and seconds per day, and the cards expected to be recalled at the end, per retention.

    retentions, kappa, review_s: (R,) the desired retentions, the model's interval ratio to FSRS-6 and its seconds
    per review at each. stability, difficulty, last_day: the reviewed cards' FSRS-6 state and last review day
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
    kap = np.asarray(kappa, f32)[ret_of]
    # the model's interval at a path's retention is coef * S: kappa times FSRS-6's S / f (r^(-1/decay) - 1)
    coef = kap * fsrs.interval(np.ones(n_ret), np.asarray(retentions, np.float64)).astype(f32)[ret_of]
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
    first_cum, recalled_cum = np.cumsum(first_shares), np.cumsum(recalled_shares)
    w, factor, decay = fsrs.w.astype(f32), f32(fsrs.factor), f32(fsrs.decay)
    grow, lapse_cap = np.exp(w[8]), np.exp(w[17] * w[18])
    d_target = f32(fsrs.initial_difficulty(4.0))  # difficulty's mean reversion target, D0(Easy)
    active = np.flatnonzero(due < days)
    while len(active):
        at = due[active]
        cell = ret_of[active] * days + at
        first = fresh[active]
        s_a, d_a = s[active], d[active]
        g = np.empty(len(active), dtype=f32)
        u = rng.random(len(active), dtype=f32)
        f = np.flatnonzero(first)
        if len(f):  # first reviews: a rating from the user's first-review shares, FSRS-6's initial state
            g[f] = 1 + np.searchsorted(first_cum, u[f] * first_cum[-1], side="right")
            s_a[f], d_a[f] = (x.astype(f32) for x in fsrs.first(np.minimum(g[f], 4)))
            fresh[active[f]] = False
            new += np.bincount(cell[f], minlength=size)
        o = np.flatnonzero(~first)
        if len(o):  # later reviews: recalled with the model's probability; FSRS-6's update at FSRS-6's own R
            x = factor * (at[o] - last[active[o]]).astype(f32) / s_a[o]
            recalled = u[o] < np.power(1.0 + x / kap[active[o]], -decay)
            r = np.power(1.0 + x, -decay)
            g[o] = np.where(recalled, 2 + np.minimum(np.searchsorted(recalled_cum, rng.random(len(o), dtype=f32)
                                                                     * recalled_cum[-1], side="right"), 2), 1)
            so, do, go = s_a[o], d_a[o], g[o]
            ok, lost = np.flatnonzero(recalled), np.flatnonzero(~recalled)
            bonus = np.where(go[ok] == 2, w[15], np.where(go[ok] == 4, w[16], f32(1)))
            s_new = np.empty(len(o), dtype=f32)
            s_new[ok] = so[ok] * (1 + grow * bonus * (11 - do[ok]) * np.power(so[ok], -w[9])
                                  * np.expm1((1 - r[ok]) * w[10]))
            s_new[lost] = np.minimum(w[11] * np.power(do[lost], -w[12]) * (np.power(so[lost] + 1, w[13]) - 1)
                                     * np.exp((1 - r[lost]) * w[14]), so[lost] / lapse_cap)
            s_a[o] = np.clip(s_new, f32(S_MIN), f32(S_MAX))
            lean = w[6] * (go - 3) / 9
            d_a[o] = np.clip(do * (1 - w[7]) * (1 + lean) + w[7] * d_target - (1 - w[7]) * 10 * lean, 1, 10)
        s[active], d[active] = s_a, d_a
        reviews += np.bincount(cell, minlength=size)
        seconds += np.bincount(cell, weights=np.where(first, new_s, cost[active]), minlength=size)
        last[active] = at
        due[active] = at + _days(coef[active] * s_a, max_interval)
        active = active[due[active] < days]
    seen = ~fresh  # reviewed at least once, in the past or in the simulation
    r_end = np.where(seen, fsrs.retrievability((days - last).astype(np.float64), kap.astype(np.float64) * s), 0.0)
    recalled_at_end = np.bincount(ret_of, weights=r_end, minlength=n_ret) / k
    shape = (n_ret, days)
    return {"reviews": reviews.reshape(shape) / k, "seconds": seconds.reshape(shape) / k,
            "new": new.reshape(shape) / k, "recalled_at_end": recalled_at_end, "replicas": k,
            "paths": len(ret_of), "introduced": introduced}


def _days(interval: np.ndarray, max_interval: int) -> np.ndarray:
    """Whole scheduler days, at least 1 and at most max_interval (NaN: 1)."""
    return np.rint(np.fmin(np.fmax(interval, 1.0), max_interval)).astype(np.int64)
