"""The gate: a shadow rollout decided by live evidence, with an anytime-valid sequential test.

A gated shadow scores both versions on the same events: for each event of a learner in the shadow's fraction, the
candidate's loss and the serving version's loss on it (log loss of the observed response), each from its own state
before the event. Their difference d = loss(candidate) - loss(serving) is one paired observation; the gate keeps,
for the mean difference mu, an asymptotic confidence sequence (Waudby-Smith, Arbour, Sinha, Kennedy and Ramdas,
"Time-uniform central limit theory and asymptotic confidence sequences", 2021, built on Robbins' normal mixture as in
Howard, Ramdas, McAuliffe and Sekhon, "Time-uniform, nonparametric, nonasymptotic confidence sequences", 2021):

    mu_t +- sqrt( 2 (t s_t^2 r^2 + 1) / (t^2 r^2) * log( sqrt(t s_t^2 r^2 + 1) / alpha ) )

with mu_t and s_t^2 the mean and variance of the first t differences, and r^2 = (-2 log alpha + log(1 - 2 log
alpha)) / T the mixture's width, chosen to be tightest near T events (OPTIMIZED_AT). The sequence covers mu at every t
at once with probability about 1 - alpha, so it may be read after every event: a decision taken the first time it
excludes a value has error rate at most alpha however often it was looked at (where a fixed-n test read after every
event is not). The decision (`decide`): the interval wholly below -min_gain (the candidate's loss lower by at least
min_gain): promote; wholly above 0: abort; else continue. Not before `min_events` differences (the approximation is
asymptotic).

The evidence is the fleet's: three sums per gated rollout (n, sum of d, sum of d^2) in one Redis hash, added to
atomically by whichever replica scores the events, so every replica computes the same interval; the first replica
to see a decision claims it (HSETNX), applies it to the rollout, and records it with its evidence.

    nextstep:{gate}:<model>:<candidate>:<rollout updated>   HASH  n, sum, sumsq, decision (JSON, once decided)
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


@dataclass(frozen=True)
class Evidence:
    n: int
    mean: float | None
    interval: tuple[float, float] | None

    def as_dict(self) -> dict:
        return {"events": self.n, "mean_difference": self.mean,
                "interval": list(self.interval) if self.interval else None}


def confidence_sequence(n: int, total: float, total_sq: float, alpha: float, optimized_at: int = OPTIMIZED_AT
                        ) -> Evidence:
    """The asymptotic confidence sequence for the mean of n differences given by their sum and sum of squares."""
    if n < 2:
        return Evidence(n, total / n if n else None, None)
    mean = total / n
    variance = max(total_sq / n - mean * mean, 0.0)
    r2 = (-2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))) / optimized_at
    inner = n * variance * r2 + 1
    radius = math.sqrt(2 * inner / (n * n * r2) * math.log(math.sqrt(inner) / alpha))
    return Evidence(n, mean, (mean - radius, mean + radius))


def decide(evidence: Evidence, config: GateConfig) -> str:
    """promote, abort or continue (module docstring)."""
    if evidence.interval is None or evidence.n < config.min_events:
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

    async def add(self, key: str, differences: np.ndarray) -> dict[str, str]:
        """Add paired differences to a rollout's evidence; its fields after (n, sum, sumsq, decision)."""
        n, s, ss = len(differences), float(differences.sum()), float((differences ** 2).sum())
        if self.client is None:
            fields = self._local.setdefault(key, {"n": "0", "sum": "0", "sumsq": "0"})
            for name, value in (("n", n), ("sum", s), ("sumsq", ss)):
                fields[name] = repr(float(fields[name]) + value)
            return dict(fields)
        replies = await self.client.execute("gate", (("HINCRBYFLOAT", key, "n", n), ("HINCRBYFLOAT", key, "sum", s),
                                                     ("HINCRBYFLOAT", key, "sumsq", ss), ("HGETALL", key)),
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
    return confidence_sequence(int(float(fields.get("n", 0))), float(fields.get("sum", 0)),
                               float(fields.get("sumsq", 0)), alpha)


def _fields(reply) -> dict[str, str]:
    pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
    return {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in pairs}
