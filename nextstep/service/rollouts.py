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
* `promote` makes the candidate the serving version for everyone; `abort` drops the candidate.

Every replica reads the hash every `refresh_seconds` (NEXTSTEP_RELOAD_REFRESH_SECONDS) in a background task and
applies it; the replica that changes a rollout applies it at once. Without Redis the rollouts live in the process.
A model with no rollout serves by the registry's rule (NEXTSTEP_NEW_VERSIONS: its newest version, or with `manual`
the version that served before a new one was added).
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


@dataclass(frozen=True)
class Rollout:
    serving: str
    candidate: str | None = None
    mode: str | None = None
    fraction: float = 0.0
    updated: float | None = None

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
        self._apply: Callable[[dict[str, Rollout]], Awaitable[None]] | None = None
        self._task: asyncio.Task | None = None

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
            await self._use(await self._read())
        self._task = asyncio.create_task(self._follow(), name="nextstep-rollouts")

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.refresh)
            try:
                rollouts = await self._read()
            except asyncio.CancelledError:
                raise
            except StoreUnavailable:
                continue  # (the client logs the outage) keep serving what was applied
            except Exception:
                log.exception("rollouts not followed; trying again in %g s", self.refresh)
                continue
            if rollouts != self.current:
                await self._use(rollouts)

    async def put(self, model: str, rollout: Rollout | None) -> None:
        """Store a model's rollout (None: remove it) for the fleet, and apply it here at once."""
        if rollout is not None:
            rollout = Rollout(**{**asdict(rollout), "updated": self.clock()})
        if self.client is not None:
            command = ("HSET", self.key, model, json.dumps(asdict(rollout))) if rollout is not None \
                else ("HDEL", self.key, model)
            await self.client.execute("rollouts", (command,), idempotent=False, write=True)
        rollouts = {**self.current, model: rollout} if rollout is not None else \
            {k: v for k, v in self.current.items() if k != model}
        await self._use(rollouts)

    def version_for(self, model: str, entity: str) -> str | None:
        rollout = self.current.get(model)
        return rollout.version_for(model, entity) if rollout is not None else None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
