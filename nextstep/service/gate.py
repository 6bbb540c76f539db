"""The gate: a shadow rollout decided by live evidence, with an anytime-valid sequential test.

A gated shadow scores both versions on the same events: for each event of a learner in the shadow's fraction, the
candidate's loss and the serving version's loss on it (knowledge tracing: log loss of the observed response;
sessions: 1 - 1/rank of the clicked item, sessions/service.py rank_loss; flashcards: log loss of recall on each review
live quality scores, srs/shadow.py), each from its own state before the event.
Their difference d = loss(candidate) - loss(serving) is one paired observation; the gate keeps,
for the mean difference mu, an asymptotic confidence sequence (Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas,
"Time-uniform central limit theory and asymptotic confidence sequences", 2021, built on Robbins' normal mixture as in
Howard, Ramdas, McAuliffe and Sekhon, "Time-uniform, nonparametric, nonasymptotic confidence sequences", 2021):

    mu_t +- sqrt( 2 (V_t r^2 + 1) / (t^2 r^2) * log( sqrt(V_t r^2 + 1) / alpha ) )

with mu_t the mean of the first t differences, V_t the estimated variance of their sum, and r^2 = (-2 log alpha +
log(1 - 2 log alpha)) / T the mixture's width, chosen to be tightest near T events (OPTIMIZED_AT). The paper's V_t is
t times the differences' variance, right for independent ones; a learner's differences are not (measured on real
learners, bench/gate_error_rates.py: 18% false decisions at alpha 0.05 with it), so V_t here is the cluster-robust
sum over learners of (S_l - n_l mu_t)^2 (`learner_spread`), which counts learners, not events. The sequence covers
mu at every t at once with probability about 1 - alpha, so it may be read after every event: a decision taken the
first time it excludes a value has error rate at most alpha however often it was looked at (where a fixed-n test
read after every event is not). The decision (`decide`): the interval wholly below -min_gain (the candidate's loss
lower by at least min_gain): promote; wholly above 0: abort; else continue. Not before `min_events` differences
from `min_learners` learners (the approximation is asymptotic in the learners: looking from 5 of them on, 9% of
simulated null replays decided, from 10 4.8%, from 30 1.8%; tests/service/test_gate.py's clustered case).

The evidence is the fleet's: five sums per gated rollout in one Redis hash (and each learner's own two beside), added to
atomically by whichever replica scores the events, so every replica computes the same interval; the first replica
to see a decision claims it (HSETNX), applies it to the rollout, and records it with its evidence.

    nextstep:{gate}:<model>:<candidate>:<rollout updated>           HASH  n, sum, ss, ns, nn, learners, decision
    nextstep:{gate}:<model>:<candidate>:<rollout updated>:entities  HASH  <entity>:s, <entity>:n
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from .redis_clients import Client

log = logging.getLogger(__name__)
OPTIMIZED_AT = 1000  # events at which the confidence sequence is tightest (its mixture's width)
EPS = 1e-7  # predicted probabilities are clipped to [EPS, 1]: a log loss is at most 16.1 nats
DECISIONS = ("promote", "abort", "continue")


@dataclass(frozen=True)
class GateConfig:
    auto: bool = True  # apply a decision (promote, abort) itself; False: only show it
    alpha: float = 0.05
    min_gain: float = 0.0  # nats per event the candidate must gain to be promoted
    min_events: int = 100  # no decision before this many paired events
    min_learners: int = 30  # nor before this many learners: the spread is estimated from their sums


@dataclass(frozen=True)
class Evidence:
    n: int
    mean: float | None
    interval: tuple[float, float] | None
    learners: int = 0

    def as_dict(self) -> dict:
        return {"events": self.n, "learners": self.learners, "mean_difference": self.mean,
                "interval": list(self.interval) if self.interval else None}


def confidence_sequence(n: int, total: float, spread: float, alpha: float, optimized_at: int = OPTIMIZED_AT
                        ) -> Evidence:
    """The asymptotic confidence sequence for the mean of n differences given by their sum and `spread`, the
    variance of that sum as estimated from the data: for independent differences n times their variance; for
    differences that come in learners (correlated within one), the learners' own, `learner_spread`."""
    if n < 2:
        return Evidence(n, total / n if n else None, None)
    mean = total / n
    r2 = (-2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))) / optimized_at
    inner = max(spread, 0.0) * r2 + 1
    radius = math.sqrt(2 * inner / (n * n * r2) * math.log(math.sqrt(inner) / alpha))
    return Evidence(n, mean, (mean - radius, mean + radius))


def learner_spread(mean: float, sum_sq: float, cross: float, count_sq: float) -> float:
    """The cluster-robust estimate of the variance of a sum of differences that come in learners: sum over learners
    of (S_l - n_l mean)^2, from sum S_l^2, sum n_l S_l and sum n_l^2 (S_l: a learner's sum, n_l: their count).
    Events of one learner are correlated (the same person, the same two models' habits), so the sum varies with the
    number of learners, not of events; with one event a learner it is the events' own spread."""
    return sum_sq - 2 * mean * cross + mean * mean * count_sq


def decide(evidence: Evidence, config: GateConfig) -> str:
    """promote, abort or continue (module docstring)."""
    if evidence.interval is None or evidence.n < config.min_events or evidence.learners < config.min_learners:
        return "continue"
    low, high = evidence.interval
    if high < -config.min_gain:
        return "promote"
    if low > 0:
        return "abort"
    return "continue"


def log_losses(probabilities: np.ndarray, responses: np.ndarray) -> np.ndarray:
    """Each event's log loss: -log P(the observed response), P clipped to [EPS, 1]."""
    p = probabilities[np.arange(len(responses)), responses]
    return -np.log(np.clip(p, EPS, 1.0))


class Gate:
    """The evidence of gated rollouts, in Redis (`client`) or in this process (None), and their decisions."""

    def __init__(self, client: Client | None, *, key_prefix: str = "nextstep", history: int = 50,
                 clock=time.time):
        self.client, self.prefix, self.history, self.clock = client, key_prefix, history, clock
        self._local: dict[str, dict[str, str]] = {}
        self._decided: dict[str, list[str]] = {}

    def key(self, model: str, candidate: str, started: float | None) -> str:
        return f"{self.prefix}:{{gate}}:{model}:{candidate}:{started!r}"

    def _history_key(self, model: str) -> str:
        return f"{self.prefix}:{{gate}}:{model}:history"

    async def add(self, key: str, entity: str, differences: np.ndarray) -> dict[str, str]:
        """Add an entity's paired differences to a rollout's evidence; its fields after (n, sum; ss, ns, nn: the
        learners' sums of S_l^2, n_l S_l and n_l^2, `learner_spread`'s; learners; decision). The entity's own
        running sum and count (a hash beside) come back from one atomic increment, so each addition's change to the
        learners' sums is exact in Redis's order, whichever replica makes it (the changes add up to the final
        sums)."""
        n, s = len(differences), float(differences.sum())
        mine = f"{key}:entities"
        if self.client is None:
            fields = self._local.setdefault(mine, {})
            fields[f"{entity}:s"] = repr(float(fields.get(f"{entity}:s", 0)) + s)
            fields[f"{entity}:n"] = repr(float(fields.get(f"{entity}:n", 0)) + n)
            s_after, n_after = float(fields[f"{entity}:s"]), float(fields[f"{entity}:n"])
        else:
            s_after, n_after = (float(v) for v in await self.client.execute(
                "gate", (("HINCRBYFLOAT", mine, f"{entity}:s", s), ("HINCRBYFLOAT", mine, f"{entity}:n", n)),
                atomic=True, idempotent=False, write=True))
        s_before, n_before = s_after - s, n_after - n
        changes = (("n", n), ("sum", s), ("ss", s_after ** 2 - s_before ** 2),
                   ("ns", n_after * s_after - n_before * s_before), ("nn", n_after ** 2 - n_before ** 2),
                   ("learners", 1 if n_before == 0 else 0))
        if self.client is None:
            fields = self._local.setdefault(key, {})
            for name, value in changes:
                fields[name] = repr(float(fields.get(name, 0)) + value)
            return dict(fields)
        replies = await self.client.execute(
            "gate", (*(("HINCRBYFLOAT", key, name, value) for name, value in changes), ("HGETALL", key)),
            atomic=True, idempotent=False, write=True)
        return _fields(replies[-1])

    async def read(self, key: str) -> dict[str, str]:
        if self.client is None:
            return dict(self._local.get(key, {}))
        (reply,) = await self.client.execute("gate", (("HGETALL", key),))
        return _fields(reply)

    async def claim(self, key: str, model: str, record: dict) -> bool:
        """Record a decision once per rollout (the first replica to claim it); True for that replica."""
        text = json.dumps(record)
        if self.client is None:
            fields = self._local.setdefault(key, {})
            if "decision" in fields:
                return False
            fields["decision"] = text
            self._decided.setdefault(model, []).insert(0, text)
            del self._decided[model][self.history:]
            return True
        (won,) = await self.client.execute("gate", (("HSETNX", key, "decision", text),), idempotent=False,
                                           write=True)
        if won:
            await self.client.execute("gate", (("LPUSH", self._history_key(model), text),
                                               ("LTRIM", self._history_key(model), 0, self.history - 1)),
                                      idempotent=False, write=True)
        return bool(won)

    async def decisions(self, model: str) -> list[dict]:
        """The model's gate decisions, newest first, each with its evidence."""
        if self.client is None:
            return [json.loads(t) for t in self._decided.get(model, [])]
        (reply,) = await self.client.execute("gate", (("LRANGE", self._history_key(model), 0, -1),))
        return [json.loads(t) for t in reply]


def evidence_of(fields: dict[str, str], alpha: float) -> Evidence:
    n, total = int(float(fields.get("n", 0))), float(fields.get("sum", 0))
    mean = total / n if n else 0.0
    spread = learner_spread(mean, float(fields.get("ss", 0)), float(fields.get("ns", 0)), float(fields.get("nn", 0)))
    ev = confidence_sequence(n, total, spread, alpha)
    return Evidence(ev.n, ev.mean, ev.interval, int(float(fields.get("learners", 0))))


def _fields(reply) -> dict[str, str]:
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in pairs}
