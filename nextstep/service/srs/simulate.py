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
from dataclasses import dataclass, replace

import numpy as np

from ..core import operation
from ..errors import InvalidInput, TooLarge
from ..registry import LoadedModel
from ..state import StoredState
from .layouts import NOT_REBUILT
from .schemas import SIMULATE_MAX_DAYS, SIMULATE_MAX_RETENTIONS, SIMULATE_RETENTIONS
from .stored import ROW, History, _decode, check_time, id_hash
from .windows import user_feeds, window

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



SIMULATE_MAX_WORK = 20_000_000  # card-days x retentions a simulation may cover (5,000 cards, 365 days, 10 retentions)

SIMULATE_SAMPLE_ROWS = 32  # schedule-graph rows a simulation runs on a sample of the deck: 16 cards x 2 retentions


class Simulations:
    """SpacedRepetition's `simulate`: the workload of several desired retentions over a user's deck."""

    @operation
    async def simulate(self, model_name: str, user_id: str, cards: list[tuple[str, str]] | None, retentions:
                       list[float], days: int, new_cards: int = 0, new_cards_per_day: int = 20,
                       now: float | None = None, seed: int = 0, max_cards: int = 10_000) -> dict:
        """Expected reviews and minutes a day over the next `days` days at each desired retention, for the user's
        deck: `cards` (their stored reviews; a card without any is new), or every card the user has reviewed when
        None, plus `new_cards` never-reviewed cards; new cards are introduced `new_cards_per_day` a day
        (simulate.py: FSRS-6 between reviews, stretched to the model's own intervals, the model's answer
        times)."""
        model = self.model(model_name, user_id)
        if not 1 <= len(retentions) <= SIMULATE_MAX_RETENTIONS:
            raise InvalidInput("desired_retentions", f"{len(retentions)} retentions; 1 to {SIMULATE_MAX_RETENTIONS}")
        low, high = SIMULATE_RETENTIONS
        for i, r in enumerate(retentions):
            if not low <= r <= high:
                raise InvalidInput(f"desired_retentions[{i}]", f"{r!r} is not a retention {low}..{high}")
        if len(set(retentions)) != len(retentions):
            raise InvalidInput("desired_retentions", "the retentions must differ")
        if not 1 <= days <= SIMULATE_MAX_DAYS:
            raise InvalidInput("days", f"{days!r} is not a number of days 1..{SIMULATE_MAX_DAYS}")
        if new_cards < 0 or new_cards_per_day < 0:
            raise InvalidInput("new_cards" if new_cards < 0 else "new_cards_per_day", "must be >= 0")
        if cards is not None:
            for i, (card, _) in enumerate(cards):
                if not card:
                    raise InvalidInput(f"cards[{i}].card_id", "must not be empty")
        if model.extra.window[1] == 0 and cards is None:
            raise InvalidInput("cards", "this model keeps no per-card reviews (card window 0): give the cards")
        if now is not None:
            check_time(now, "now")
        key = self.key(model, user_id)

        async def read() -> tuple[StoredState, list[str]]:
            if cards is None:  # every card the user has: their fields, decoded together below
                stored = await self.store.read_all(key)
                return stored, list(stored.fields)
            asked = list(dict.fromkeys(c for c, _ in cards))
            return (await self.store.read(key, fields=asked))[0], asked

        stored, asked = await read()
        said = NOT_REBUILT
        if not stored.exists:
            said = await self._carry(model, user_id, stored)
            if said["rebuilt_from_events"]:
                stored, asked = await read()
        history = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
        fields = stored.fields
        reviewed = [c for c in asked if fields.get(c)]
        data = [fields[c] for c in reviewed]
        n_new = new_cards + len(asked) - len(reviewed)
        if len(reviewed) + n_new > max_cards:
            raise TooLarge("cards", f"{len(reviewed)} reviewed and {n_new} new cards; at most {max_cards} per "
                                    "simulation (NEXTSTEP_SRS_MAX_SIMULATE_CARDS): give the cards to simulate")
        paths = max(len(reviewed) + n_new, MIN_PATHS)  # a small deck is simulated as several replicas
        if paths * len(retentions) * days > SIMULATE_MAX_WORK:
            raise InvalidInput("days", f"{days} days x {len(retentions)} retentions x {paths} cards (at least "
                                       f"{MIN_PATHS}) is over {SIMULATE_MAX_WORK:,}: simulate fewer days, retentions "
                                       "or cards")
        now = self._query_time(history, now, "now")
        fsrs = FSRS6.of(history.params(model).astype(np.float64))  # the user's own parameters
        day_start = history.day_start(model)

        def day(t) -> np.ndarray:
            return np.floor((np.asarray(t, dtype=np.float64) - day_start) / 86400.0)

        # every reviewed card's rows at once: its last card_size reviews, the rows the network's FSRS-6 anchor reads
        lengths = np.fromiter(map(len, data), dtype=np.int64, count=len(data))
        if np.any(lengths % ROW.itemsize):
            raise ValueError(f"stored reviews of user {user_id!r} are not whole {ROW.itemsize}-byte rows")
        lengths //= ROW.itemsize
        rows = np.frombuffer(b"".join(data), dtype=ROW)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        width = int(lengths.max()) if len(lengths) else 1
        owner = np.repeat(np.arange(len(reviewed)), lengths)
        column = width - lengths[owner] + np.arange(len(rows)) - starts[owner]
        rating, when = np.ones((len(reviewed), width)), np.zeros((len(reviewed), width))
        present = np.zeros((len(reviewed), width), dtype=bool)
        rating[owner, column], when[owner, column], present[owner, column] = rows["rating"], day(rows["time"]), True
        stability, difficulty = fsrs.memory_state(rating, when, present)
        last_time = rows["time"][ends - 1] if len(reviewed) else np.zeros(0)
        last_day = (day(last_time) - day(now)).astype(np.int64)
        retention = np.asarray(retentions, dtype=np.float64)
        curve, review_s, new_s, sampled = await self._calibrate(model, history, (rows, starts, ends), reviewed,
                                                                 stability, last_time, now, retention, fsrs, seed)
        ratio = curve.interval(1.0, retention) / fsrs.interval(1.0, retention)
        recent = history.recent
        first = np.bincount(recent["rating"][recent["state"] == 0].astype(np.int64) - 1, minlength=4)[:4]
        recalled = np.bincount(recent["rating"][recent["rating"] > 1].astype(np.int64) - 2, minlength=3)[:3]
        max_interval = max(1, int(self.max_interval_days))
        out = simulate(fsrs, retentions=retention, days=days, curve=curve, review_s=review_s, new_s=new_s,
                             stability=stability, difficulty=difficulty, last_day=last_day, n_new=n_new,
                             new_per_day=new_cards_per_day, first_shares=shares(first, DEFAULT_FIRST),
                             recalled_shares=shares(recalled, DEFAULT_RECALLED), max_interval=max_interval, seed=seed)
        results = []
        for j, r in enumerate(retentions):
            reviews, minutes = out["reviews"][j], out["seconds"][j] / 60.0
            results.append({
                "desired_retention": r, "reviews_per_day": np.round(reviews, 3).tolist(),
                "minutes_per_day": np.round(minutes, 3).tolist(), "total_reviews": float(reviews.sum()),
                "total_minutes": float(minutes.sum()), "mean_minutes_per_day": float(minutes.mean()),
                "recalled_at_end": float(out["recalled_at_end"][j]),
                "interval_ratio_to_fsrs6": float(ratio[j]), "seconds_per_review": float(review_s[j])})
        return {"user_id": user_id, "model": model.name, "version": model.version, "now": now, "days": days,
                "cards": len(reviewed), "new_cards": n_new, "new_cards_introduced": int(out["introduced"]),
                "new_cards_per_day": new_cards_per_day, "seconds_per_new_card": new_s, "sampled_cards": sampled,
                "model_curve": {"stretch": curve.stretch, "decay": curve.decay},
                "replicas": int(out["replicas"]), "seed": seed, "max_interval_days": max_interval,
                "reviews_total": history.stored.events, **said, "retentions": results}

    async def _calibrate(self, model: LoadedModel, history: History, deck: tuple[np.ndarray, np.ndarray, np.ndarray],
                         reviewed: list[str], stability: np.ndarray, last_time: np.ndarray, now: float,
                         retention: np.ndarray, fsrs: FSRS6, seed: int) -> tuple[ModelCurve, np.ndarray, float, int]:
        """The model's own curve and answer times on a sample of the deck: (the model's forgetting curve on FSRS-6's
        stability (simulate.ModelCurve) through the median ratios of the model's intervals to FSRS-6's at the
        lowest and the highest retention asked for; seconds per review at each retention (the model's answer time at
        the due, averaged over the sample, interpolated between those two linearly in log(r^(-1/decay) - 1)); seconds
        for a new card's first review; the number of cards sampled). Two graph calls of at most
        SIMULATE_SAMPLE_ROWS + 1 rows, whatever the deck's size."""
        probes = np.unique(retention[[np.argmin(retention), np.argmax(retention)]])
        take = min(len(reviewed), max(1, SIMULATE_SAMPLE_ROWS // len(probes)))
        pick = np.sort(np.random.default_rng(seed).choice(len(reviewed), size=take, replace=False)) if take else \
            np.zeros(0, dtype=np.int64)
        fresh = "\x00simulate: a card never reviewed"
        rows, starts, ends = deck  # every reviewed card's stored rows, card i's at starts[i]:ends[i]
        own = {i: rows[starts[i]:ends[i]] for i in pick}
        windows = [window(model, replace(history, cards={reviewed[i]: own[i]}), reviewed[i]) for i in pick]
        windows.append(window(model, history, fresh))
        hist = user_feeds(model, windows, history)
        new = await self._predict(model, windows, hist, np.array([take]), np.array([id_hash(fresh)]),
                                  np.array([id_hash("")]), np.array([now], dtype=np.float64))
        new_s = float(new["duration_s"][0])
        if not take:
            return ModelCurve(1.0, fsrs.decay), np.full(len(retention), new_s), new_s, 0
        which = np.tile(np.arange(take), len(probes))
        ids = np.array([id_hash(reviewed[i]) for i in pick], dtype=np.int64)
        decks = np.array([own[i]["deck"][-1] for i in pick], dtype=np.int64)
        out = await self._run(model, hist, which, ids[which], decks[which], np.full(len(which), now), graph="schedule",
                              retention=np.repeat(probes, take).astype(np.float32))
        since = np.tile((now - last_time[pick]) / 86400.0, len(probes))
        s_card = np.tile(stability[pick], len(probes))
        wait = np.expm1(out["log_wait_days"].astype(np.float64))
        # each card's ratio: where the model schedules it, its interval over FSRS-6's; where it is due already, the
        # stretch of FSRS-6's curve that passes through the model's recall now (the interval alone would only bound it)
        ratio = (since + wait) / np.maximum(fsrs.interval(s_card, np.repeat(probes, take)), 1e-9)
        p_now = np.clip(out["recall"].astype(np.float64), 1e-6, 1 - 1e-6)
        through = fsrs.factor * since / (s_card * (np.power(p_now, -1.0 / fsrs.decay) - 1.0))
        ratio = np.where(wait > 0, ratio, np.where(since > 0, through, np.nan)).reshape(len(probes), take)
        median = [float(np.median(r[np.isfinite(r)])) if np.isfinite(r).any() else 1.0 for r in ratio]
        curve = ModelCurve.through(fsrs, [float(r) for r in probes], [max(m, 1e-6) for m in median])
        seconds = out["duration_s"].astype(np.float64).reshape(len(probes), take).mean(axis=1)
        if len(probes) == 1:
            return curve, np.full(len(retention), seconds[0]), new_s, take

        def scale(r):
            return np.log(np.power(r, -1.0 / fsrs.decay) - 1.0)

        at = (scale(retention) - scale(probes[0])) / (scale(probes[1]) - scale(probes[0]))
        return curve, seconds[0] + at * (seconds[1] - seconds[0]), new_s, take
