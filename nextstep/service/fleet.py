"""Reloads that reach every replica sharing one Redis: a generation counter, followed by each process.

    nextstep:{fleet}:reload-generation   STRING (integer)  INCR'd by every reload a replica performs on request

`POST /v1/models/reload` reloads the process that receives it, then increments the generation (one INCR; the key
has a hash tag of its own, so it is one slot on a Redis Cluster). Every process reads the generation at most every
`refresh_seconds` (NEXTSTEP_RELOAD_REFRESH_SECONDS, 2 s), in one background task started with the app, and when it
moved since the process last saw it, runs the same reload the route runs (registry rescan in a worker thread,
metrics, bank preparation). A reload is seconds of work in a thread, so it is never run by a request: the request
path costs nothing, and an idle replica follows too. The price is that the fleet reaches the new set within
`refresh_seconds` plus one reload's duration after the route answers.

The generation a process has seen is read at startup (the artifacts it loaded then are the newest). The reload
route sets it to the value its INCR returns only when that is the next one (no other replica's reload went
unseen in between); otherwise the next check reloads again, which is harmless: a reload of unchanged artifacts
keeps what serves. A failed check is tried again after the interval; it never fails a request. A Redis outage is
logged by the client (redis_clients.Health: a line when it starts, one when it ends, a reminder a minute), not by
each check; any other failure (a reload that raises) is logged with its traceback once, then at most once a minute
while it lasts, and its end is logged too. With no Redis configured (the in-process store) there is no fleet:
`generation` is None, nothing runs in the background, and the route answers `"fleet_generation": null`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from .errors import StoreUnavailable

if TYPE_CHECKING:  # (no Redis client at import: offline scoring runs without one)
    from .redis_clients import Client

log = logging.getLogger(__name__)
REMIND_SECONDS = 60.0  # a failure that lasts is logged again at most this often


class FleetReloads:
    def __init__(self, client: Client | None, *, refresh_seconds: float = 2.0, key_prefix: str = "nextstep"):
        self.client, self.refresh = client, refresh_seconds
        self.key = f"{key_prefix}:{{fleet}}:reload-generation"
        self.seen: int | None = None  # the generation this process's models correspond to; None: not read yet
        self._task: asyncio.Task | None = None

    async def _read(self) -> int:
        (value,) = await self.client.execute("reload generation", (("GET", self.key),))
        return int(value) if value is not None else 0

    async def start(self, reload: Callable[[], Awaitable[object]]) -> None:
        """Read the generation the freshly loaded models correspond to, then follow it in the background."""
        if self.client is None:
            return
        try:
            self.seen = await self._read()
        except StoreUnavailable as exc:  # the first successful check below adopts the generation, reloading once
            log.warning("reload generation not read at startup (%s); following it from the next check", exc)
        except Exception:
            log.exception("reload generation not read at startup; following it from the next check")
        self._task = asyncio.create_task(self._follow(reload), name="nextstep-fleet-reloads")

    async def announce(self) -> int | None:
        """After a reload on request: tell the fleet (INCR). The new generation, or None (no Redis, or it failed:
        logged; this process reloaded all the same)."""
        if self.client is None:
            return None
        try:
            (generation,) = await self.client.execute("reload generation", (("INCR", self.key),),
                                                      idempotent=False, write=True)
        except StoreUnavailable as exc:
            log.warning("reload done here, but the other replicas were not told (%s): reload each one directly", exc)
            return None
        except Exception:
            log.exception("reload done here, but the other replicas were not told (reload each one directly)")
            return None
        if self.seen is not None and generation == self.seen + 1:
            self.seen = generation  # this reload was the only one since: no need to run it again here
        return generation

    async def check(self, reload: Callable[[], Awaitable[object]]) -> bool:
        """One check: reload if the generation moved. Whether it reloaded. Raises what the read raises."""
        generation = await self._read()
        if generation == self.seen:
            return False
        log.info("reload generation %s -> %s: reloading the models", self.seen, generation)
        await reload()
        self.seen = generation  # (the value read before the reload: one made meanwhile is seen next time)
        return True

    async def _follow(self, reload: Callable[[], Awaitable[object]]) -> None:
        failing, remind_at = None, 0.0  # the failure being logged (its first time), the next reminder's time
        while True:
            await asyncio.sleep(self.refresh)
            try:
                await self.check(reload)
            except asyncio.CancelledError:
                raise
            except StoreUnavailable:  # keep serving what is loaded; try again after the interval (the outage is
                continue  # the client's to log)
            except Exception as exc:  # keep serving what is loaded; try again after the interval
                now = time.monotonic()
                if failing is None:
                    log.exception("reload generation not followed; trying again every %g s", self.refresh)
                    failing, remind_at = now, now + REMIND_SECONDS
                elif now >= remind_at:
                    log.warning("reload generation still not followed after %.0f s: %s", now - failing, exc)
                    remind_at = now + REMIND_SECONDS
                continue
            if failing is not None:
                log.warning("reload generation followed again after %.0f s", time.monotonic() - failing)
                failing = None

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
