"""Rollouts: which version of a model serves, and a candidate version on a stable fraction of its entities.

A rollout is kept per model in one Redis hash shared by the fleet, one field per model (a JSON object):

    nextstep:{rollouts}   HASH  <model> -> {"serving": "1", "candidate": "2", "mode": "canary", "fraction": 0.1,
                                            "updated": <unix seconds>}

* `serving` is the version requests without a pin get (the registry's `latest`: ModelRegistry.set_serving);
* with a `candidate` in mode `canary`, an entity (learner, session, user) whose hash falls below `fraction` gets the
  candidate instead: `in_fraction` hashes the model name and the entity id (BLAKE2b), so the same entity gets the
  same version on every replica and every request, and raising the fraction only adds entities;
* in mode `shadow`, the candidate answers no one: after each write through the serving version for an entity in
  the fraction, the candidate's own state of that entity follows the event log (a bounded queue, off the request
  path: core.StatefulTask.shadow), scoring the new events for live quality (role "shadow");
* `promote` makes the candidate the serving version for everyone; `abort` drops the candidate;
* a shadow with a `gate` is promoted or aborted by live evidence (gate.py), by whichever replica sees the decision.

Every replica reads the hash every `refresh_seconds` (NEXTSTEP_RELOAD_REFRESH_SECONDS) in a background task. A
change takes effect on every replica at one moment, `effective` (its `updated` time plus two `refresh_seconds`: by
then every replica has read it, even one whose reads run late): until then each keeps the rollout it had, so no
entity sees the two versions alternate while the fleet learns of it (to within the replicas' clock skew), and the
route that made the change answers once it is in effect (docs/decisions.md, "A rollout takes effect at one
moment"). A replica that starts, or that missed the change through a Redis outage, applies what it reads at once.

With NEXTSTEP_NEW_VERSIONS=manual the choice of the serving version must outlive every process: `adopt` stores the
version each model serves when no rollout names one yet (HSETNX: the first replica's choice is everyone's), at
startup and at every reload, so a replica restarted after new versions were copied in serves what the fleet serves,
not the newest. Without Redis the rollouts live in the process. A model with no rollout serves by the registry's
rule (its newest version; with `manual`, the version that served before a new one was added).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from .errors import StoreUnavailable

if TYPE_CHECKING:  # (no Redis client at import: offline scoring runs without one)
    from .redis_clients import Client

log = logging.getLogger(__name__)
MODES = ("canary", "shadow")
READS = 2  # refresh intervals from a change to its effect: one for every replica's next read, one for a late read
RETRY_SECONDS = 0.25  # a read that failed is tried again this soon (a slow Redis must not make a replica miss one)


@dataclass(frozen=True)
class Rollout:
    serving: str
    candidate: str | None = None
    mode: str | None = None
    fraction: float = 0.0
    updated: float | None = None
    effective: float | None = None  # when every replica applies it (None: at once; a rollout stored before this)
    gate: dict | None = None  # a gated rollout's settings (gate.py GateConfig's fields); None: decided by hand
    ramp: list | None = None  # a gated canary's fractions, each taken at a promote decision of the one before

    def version_for(self, model: str, entity: str) -> str | None:
        """The candidate for an entity in its fraction, else None (the serving version answers)."""
        if self.candidate is not None and self.mode == "canary" and in_fraction(model, entity, self.fraction):
            return self.candidate
        return None


def in_fraction(model: str, entity: str, fraction: float) -> bool:
    """Whether an entity falls in the first `fraction` of a model's entities: the first 8 bytes of BLAKE2b of
    "<model>\\0<entity>" as a fraction of 2^64, below `fraction`."""
    digest = hashlib.blake2b(f"{model}\0{entity}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2.0 ** 64


class Rollouts:
    def __init__(self, client: Client | None, *, refresh_seconds: float = 2.0, key_prefix: str = "nextstep",
                 clock: Callable[[], float] = time.time):
        self.client, self.refresh, self.clock = client, refresh_seconds, clock
        self.key = f"{key_prefix}:{{rollouts}}"
        self.current: dict[str, Rollout] = {}  # this process's view: model -> rollout
        self.pending: dict[str, Rollout] = {}  # changes read but not in effect yet: model -> rollout
        self.read = client is None  # whether this process applied the fleet's rollouts once (/readyz waits for it)
        self._apply: Callable[[dict[str, Rollout]], Awaitable[None]] | None = None
        self._task: asyncio.Task | None = None

    @property
    def delay(self) -> float:
        """Seconds from a change to its effect: READS refresh intervals (0 without Redis: one process)."""
        return READS * self.refresh if self.client is not None else 0.0

    async def _read(self) -> dict[str, Rollout]:
        if self.client is None:
            return dict(self.current)
        (reply,) = await self.client.execute("rollouts", (("HGETALL", self.key),))
        pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
        out = {}
        for name, value in pairs:
            name = name.decode() if isinstance(name, bytes) else name
            try:
                out[name] = Rollout(**json.loads(value))
            except (TypeError, ValueError):
                log.error("rollout of %s in Redis is not one this version reads: ignored", name)
        return out

    def _due(self, read: dict[str, Rollout], now: float) -> tuple[dict[str, Rollout], dict[str, Rollout]]:
        """(what to apply now: each model's rollout as read, except a change not yet effective, for which the one
        applied stays; the changes not yet effective)."""
        out, pending = {}, {}
        for model, rollout in read.items():
            if rollout.effective is not None and rollout.effective > now and self.read:
                pending[model] = rollout
                if model in self.current:
                    out[model] = self.current[model]
                continue
            out[model] = rollout
        return out, pending

    async def _use(self, rollouts: dict[str, Rollout]) -> None:
        self.current = rollouts
        if self._apply is not None:
            await self._apply(rollouts)

    async def start(self, apply: Callable[[dict[str, Rollout]], Awaitable[None]]) -> None:
        """Read the rollouts, apply them (`await apply(model -> rollout)`), and follow them in the background."""
        self._apply = apply
        if self.client is None:
            return
        with contextlib.suppress(StoreUnavailable):
            await self._use(await self._read())  # (a starting replica applies even a change not yet effective)
            self.read = True
        self._task = asyncio.create_task(self._follow(), name="nextstep-rollouts")

    async def check(self) -> float | None:
        """One check: read the rollouts and apply those in effect. When the next pending change takes effect."""
        rollouts, pending = self._due(await self._read(), self.clock())
        self.pending = pending
        if rollouts != self.current or not self.read:
            await self._use(rollouts)
        self.read = True
        return min((r.effective for r in pending.values()), default=None)

    async def _follow(self) -> None:
        wait = self.refresh
        while True:
            await asyncio.sleep(wait)
            wait = self.refresh
            try:
                pending = await self.check()
            except asyncio.CancelledError:
                raise
            except StoreUnavailable:  # (the client logs the outage) keep serving what was applied; read again
                wait = min(self.refresh, RETRY_SECONDS)  # soon: a change may be about to take effect
                continue
            except Exception:
                log.exception("rollouts not followed; trying again in %g s", self.refresh)
                continue
            if pending is not None:  # wake when it takes effect
                wait = min(wait, max(pending - self.clock(), 0.0) + 0.01)

    async def put(self, model: str, rollout: Rollout | None) -> None:
        """Store a model's rollout (None: remove it) for the fleet; return once it is in effect here (every replica
        applies it at the same moment: `effective`)."""
        if rollout is not None:
            now = self.clock()
            rollout = Rollout(**{**asdict(rollout), "updated": now, "effective": now + self.delay})
        if self.client is not None:
            command = ("HSET", self.key, model, json.dumps(asdict(rollout))) if rollout is not None \
                else ("HDEL", self.key, model)
            await self.client.execute("rollouts", (command,), idempotent=False, write=True)
            if rollout is not None:
                self.pending[model] = rollout
                await asyncio.sleep(max(rollout.effective - self.clock(), 0.0))
                self.pending.pop(model, None)
        rollouts = {**self.current, model: rollout} if rollout is not None else \
            {k: v for k, v in self.current.items() if k != model}
        await self._use(rollouts)

    async def adopt(self, serving: dict[str, str]) -> None:
        """Manual new versions: store `serving` (model -> the version it serves) for each model no rollout names yet,
        unless another replica stored one first (HSETNX), and apply what the fleet holds then. Raises what the
        store raises (a model then keeps its process's choice until the next reload or check)."""
        missing = {m: v for m, v in serving.items() if m not in self.current}
        if not missing or self.client is None:  # (one process: the registry keeps its own choice)
            return
        now = self.clock()
        await self.client.execute("rollouts", [("HSETNX", self.key, m, json.dumps(asdict(Rollout(
            v, updated=now, effective=now)))) for m, v in sorted(missing.items())], idempotent=False, write=True)
        read = await self._read()
        # (a model adopted now is in effect at once; a change pending for another model stays pending)
        await self._use({**self._due(read, self.clock())[0], **{m: read[m] for m in missing if m in read}})

    def version_for(self, model: str, entity: str) -> str | None:
        """The version that answers an entity: a canary's candidate in its fraction, else the serving version; None
        without a rollout. A change in effect by the clock counts already, before this process's follow loop (or the
        route that made it) wakes to apply it: every replica switches at the same moment, however busy."""
        rollout = self.pending.get(model)  # (empty but for the seconds before a change takes effect)
        if rollout is None or self.clock() < rollout.effective:
            rollout = self.current.get(model)
            if rollout is None:
                return None
        return rollout.version_for(model, entity) or rollout.serving

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
