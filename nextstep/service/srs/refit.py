"""Refitting a flashcard user's FSRS-6 parameters from their stored reviews (off the request path).

`SpacedRepetition.refit` reads a user's stored reviews (the recent block and every card's field), and
`fit_stored` (nextstep/srs/stored_fit.py) turns them into a one-user review log and fits FSRS-6 on it with fsrs-rs
exactly as the evaluation protocol fits a user's training reviews (`nextstep.training.srs.eval.fit_fsrs6`: every
scored review with an earlier review of its card, as an FSRSItem of its card's reviews up to it). The store keeps
each card's last `card_size` reviews, so a card with more starts its history at the oldest one kept; on a user whose
cards all have at most `card_size` reviews, the fit equals the protocol's on the same reviews
(tests/service/test_refit.py).

Two ways run it; each user is fitted under the store's lease of their key (state.py's `lease`), so that two workers
(replicas, the command) never fit the same user at once, and a fit is written with a compare-and-set of the header
alone (reviews recorded meanwhile are kept):

* in the service (`RefitWorker`, NEXTSTEP_SRS_REFIT=auto): a write that leaves a user due a fit (`refit_due`) queues
  them (`offer`: a bounded queue of NEXTSTEP_SRS_REFIT_QUEUE users; a user already waiting is one turn; a full queue
  drops the user, who is queued again by their next review), and one worker per replica fits them one at a time.
  The fit runs in a process of its own (`FitProcess`, started on the first fit): fsrs-rs's `compute_parameters`
  holds the GIL from start to end (0.15 s for a user of 38,000 reviews; bench/srs_refit_cost.py), so in a thread it
  would stall every request of the replica for that long. Each turn is counted (nextstep_srs_refits_total): done;
  skipped (another worker holds the user's lease: they are queued again by their next review); not_due (by their
  turn nothing was left to fit: a fit made after they were queued saw their reviews, they were deleted, or the
  version that queued them was withdrawn); dropped (the queue was full); failed (logged).
* `nextstep srs refit --model NAME` (`refit_all`) for every user of the model (the store's walk over its keys, every
  primary of a Redis Cluster) or those named: a batch, e.g. after the service ran with NEXTSTEP_SRS_REFIT=off.

This module needs fsrs_rs_python and numpy only (no torch): the service image has both.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import socket
import sys
import time as _time
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import numpy as np

# (here too for srs.py, event_export.py and the tests: the service asks this module)
from ...srs.stored_fit import Due, fit_held, fit_stored, review_log, stored_rows  # noqa: F401
from ..core import Change
from ..errors import UnknownModel
from ..state import StoredState
from .stored import Fit, _decode, _done

logger = logging.getLogger(__name__)
LEASE_MS = 300_000  # how long a worker holds a user's refit lease (a fit takes well under a second)
OUTCOMES = ("done", "skipped", "not_due", "dropped", "failed")  # nextstep_srs_refits_total's
FIT_TIMEOUT_S = 120.0  # a fit running longer is stopped, and counted failed: well within the lease


def owner() -> str:
    """Who holds a lease: this process, on this machine."""
    return f"{socket.gethostname()}:{os.getpid()}"


class _Ended(RuntimeError):
    """The fitting process ended before it answered."""


class FitProcess:
    """A process of its own that the service fits in (`python -m nextstep.srs.stored_fit`: numpy, fsrs-rs
    and the protocol's fit, no service code), started on the first fit and again after one died or overran; each
    fit is a pickle of `fit_held`'s arguments down its stdin and one of its answer back up its stdout, one at a
    time (the rows are put together there too: a user's thousands of cards take milliseconds). Not
    multiprocessing's pools: their spawned children first import the parent's main script, which a script
    that starts the service without an `if __name__ == "__main__":` guard would run again; and a fork of the
    service would copy its threads' locks (ONNX Runtime's, the store's)."""

    def __init__(self, timeout_s: float = FIT_TIMEOUT_S):
        self.timeout_s = timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()

    @property
    def pid(self) -> int | None:
        """The process's id while it runs (None before the first fit, and once stopped)."""
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def fit(self, recent: np.ndarray, fields: Mapping[str, bytes], day_start_hour: float,
                  due) -> tuple[list[float] | None, int, int]:
        """`fit_held(recent, fields, day_start_hour, due)`, run in the process (once more in a fresh one if the
        process had ended, e.g. killed for memory)."""
        request = (recent, dict(fields), day_start_hour, due)
        async with self._lock:
            for again in (True, False):
                try:
                    return await asyncio.wait_for(self._call(request), self.timeout_s)
                except _Ended:
                    await self.close()
                    if not again:
                        raise
                except TimeoutError:
                    await self.close()
                    raise RuntimeError(f"the fit took longer than {self.timeout_s:g} s: stopped") from None
                except BaseException:  # (an answer half read, a cancellation: the next fit starts a fresh process)
                    await self.close()
                    raise

    async def _call(self, request: tuple) -> tuple[list[float] | None, int, int]:
        if self._proc is None or self._proc.returncode is not None:
            import nextstep

            home = str(Path(nextstep.__file__).resolve().parent.parent)  # (this very package, wherever it came from)
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [home, os.environ.get("PYTHONPATH")]))}
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "nextstep.srs.stored_fit", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env)
        proc = self._proc
        data = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            proc.stdin.write(len(data).to_bytes(8, "little") + data)
            await proc.stdin.drain()
            size = int.from_bytes(await proc.stdout.readexactly(8), "little")
            ok, answer = pickle.loads(await proc.stdout.readexactly(size))
        except (asyncio.IncompleteReadError, ConnectionError):
            raise _Ended(f"the fitting process ended (exit status {await proc.wait()})") from None
        if not ok:
            raise RuntimeError(f"the fit failed: {answer}")
        return answer

    async def close(self) -> None:
        """Stop the process (it ends by itself once its stdin closes; killed if it does not within 5 s)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(Exception):
            proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 5.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


def start_refits(srs, settings, metrics) -> list[asyncio.Task]:
    """The service's refit worker for the flashcard service `srs` (lifespan.py, at startup): none when
    NEXTSTEP_SRS_REFIT is off, or fsrs-rs is not installed (said once in the log)."""
    if settings.srs_refit == "off":
        return []
    try:
        import fsrs_rs_python  # noqa: F401
    except ImportError:
        logger.warning("NEXTSTEP_SRS_REFIT=auto, but fsrs_rs_python is not installed: flashcard users' FSRS-6 "
                       "parameters are not refitted by the service (install it, or run `nextstep srs refit` "
                       "where it is)")
        return []
    worker = RefitWorker(srs, settings.srs_refit_queue,
                         lambda model, outcome: metrics.srs_refits.labels(model, outcome).inc())
    return [asyncio.create_task(worker.run(), name="srs-refit")]


class RefitWorker:
    """The in-service refit (the module's docstring): `offer` queues a user after a write, `run` fits them."""

    def __init__(self, srs, size: int, on_outcome: Callable[[str, str], None] = lambda model, outcome: None):
        self.srs, self.on_outcome = srs, on_outcome
        self.queue: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue(maxsize=size)
        self.waiting: set[tuple[str, str, str]] = set()  # (model, version, user) in the queue
        self.owner = owner()
        self.fitter = FitProcess()
        srs.fitter, srs.refits = self.fitter, self

    def offer(self, model, user_id: str, scored: int, fit) -> None:
        """After a write of `user_id`'s reviews through `model` (their scored reviews now: `scored`, -1 unknown;
        their fit): queue them when a fit is due (unknown: the refit counts them), unless they wait already; a full
        queue drops them (counted): their next review queues them again."""
        if scored >= 0 and not self.srs.refit_due(scored, fit):
            return
        turn = (model.name, model.version, user_id)  # (the version that wrote: its layout's key)
        if turn in self.waiting:
            return
        try:
            self.queue.put_nowait(turn)
        except asyncio.QueueFull:
            self.on_outcome(model.name, "dropped")
            return
        self.waiting.add(turn)

    async def run(self) -> None:
        """Fit the users queued, one at a time, until cancelled (then the fitting process is stopped)."""
        try:
            while True:
                turn = await self.queue.get()
                self.waiting.discard(turn)  # (a write from now on may queue them again)
                self.on_outcome(turn[0], await self.turn(*turn))
        finally:
            self.srs.refits = self.srs.fitter = None
            await self.fitter.close()

    async def turn(self, name: str, version: str, user_id: str) -> str:
        """One user's refit under their lease: its outcome."""
        srs = self.srs
        try:
            key = srs.key(srs.registry.get(name, version, task=srs.TASK), user_id)
            if not await srs.store.lease(key, self.owner, LEASE_MS):
                return "skipped"  # another replica (or `nextstep srs refit`) is fitting them
            try:
                result = await srs.refit(f"{name}@{version}", user_id)
            finally:
                with contextlib.suppress(Exception):  # (else it lapses by itself)
                    await srs.store.release(key, self.owner)
            return "done" if result.get("refitted") else "not_due"  # (no reviews, or none new since the last fit)
        except asyncio.CancelledError:
            raise
        except UnknownModel:  # the version was withdrawn meanwhile: their next review (another version) queues them
            return "not_due"
        except Exception:
            logger.exception("the refit of user %r of %s@%s failed", user_id, name, version)
            return "failed"

async def refit_all(srs, model_name: str, users: list[str] | None = None, *, force: bool = False,
                    log: Callable[[str], None] = print) -> list[dict]:
    """Refit every user of the model (or those named) whose fit is due; one line per user refitted, failed or held by
    another worker."""
    import json

    model = srs.model(model_name)
    holder = owner()
    done, tried = [], set()
    async for page in _pages(srs, model, users):
        for user in page:
            if user in tried:  # (a walk may meet a key twice)
                continue
            tried.add(user)
            key = srs.key(model, user)
            if not await srs.store.lease(key, holder, LEASE_MS):
                done.append({"user_id": user, "refitted": False, "reason": "another worker holds its lease"})
                log(json.dumps(done[-1]))
                continue
            try:
                result = await srs.refit(model_name, user, force=force)
            except Exception as exc:  # one user's failure must not stop the others
                result = {"user_id": user, "refitted": False, "reason": f"failed: {exc}"}
            finally:
                await srs.store.release(key, holder)
            done.append(result)
            if result.get("refitted") or str(result.get("reason", "")).startswith("failed"):
                log(json.dumps({k: v for k, v in result.items() if k != "w"}))
    return done


async def _pages(srs, model, users: list[str] | None):
    """The users named, or every user with a state under the model's layout, a page at a time (the store's walk:
    every primary of a Redis Cluster)."""
    if users is not None:
        yield users
        return
    cursor = "0"
    while True:
        cursor, page = await srs.entities(model, cursor)
        yield page
        if cursor == "0":
            return


class Refits:
    """SpacedRepetition's part that refits each user's FSRS-6 parameters, off the request path: the worker (a
    write that leaves a user due a fit queues them), `refit` (the worker's turn, and `nextstep srs refit`'s)."""

    def refit_due(self, scored: int, fit: Fit) -> bool:
        """Whether a user with `scored` scored reviews and this fit is due one: a first fit once they have
        refit_min_scored, then again every refit_every_scored more."""
        return self._fit_due(fit)(scored)

    def _fit_due(self, fit: Fit):
        return Due(self.refit_min_scored, self.refit_every_scored, None if fit.w is None else fit.fitted_scored)

    def background(self, settings, metrics) -> list:
        """The tasks this service runs beside the requests (lifespan.py starts them, and cancels them at shutdown):
        the refit worker (refit.start_refits; none when NEXTSTEP_SRS_REFIT is off)."""
        return start_refits(self, settings, metrics)

    async def refit(self, model_name: str, user_id: str, *, force: bool = False, now: float | None = None) -> dict:
        """Fit the user's FSRS-6 parameters on their stored reviews (refit.fit_held: the evaluation protocol's
        fit, fsrs-rs, in `fitter`) when one is due (`refit_due`; `force`: whatever the counts), and store them
        with a compare-and-set of the header (reviews recorded meanwhile stay). Not a request's work: the refit
        worker (refit.RefitWorker) and `nextstep srs refit` run it. Returns what it did."""
        model = self.model(model_name, user_id)
        key = self.key(model, user_id)
        header = _decode(await self.store.get(key))
        if not header.stored.exists and (await self._carry(model, user_id, header.stored))["rebuilt_from_events"]:
            header = _decode(await self.store.get(key))  # (rebuilt from another layout's state)
        out = {"user_id": user_id, "model": model.name, "refitted": False}
        if not header.stored.exists:
            return {**out, "reason": "no reviews"}
        if not force and header.scored >= 0 and not self.refit_due(header.scored, header.fit):
            return {**out, "reason": "not due", "scored_reviews": header.scored}
        stored = await self.store.read_all(key)
        history = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
        day_start = history.day_start(model) / 3600.0
        known = history.scored >= 0  # (a v3 header does not know the user's scored reviews: the fit counts them)
        fit_args = (history.recent, stored.fields, day_start, True if force or known else self._fit_due(history.fit))
        w, scored, held = await (self.fitter.fit(*fit_args) if self.fitter is not None else
                                 asyncio.to_thread(fit_held, *fit_args))
        if w is None:
            return {**out, "reason": "not due", "scored_reviews": scored}
        # due again `refit_every_scored` scored reviews after those recorded now (the fit may see fewer: the store
        # keeps each card's last card_size reviews; counted against those, every write would be due)
        fit = Fit(tuple(float(x) for x in w), held, history.scored if known else scored,
                  _time.time() if now is None else float(now))

        async def attempt(current: StoredState, *_) -> Change:
            latest = _decode(current)
            if not current.exists or latest.count < fit.fitted_on:  # deleted (and maybe begun again) meanwhile
                return Change(None, lambda _: _done({**out, "reason": "deleted meanwhile"}))
            blob = replace(latest, scored=latest.scored if latest.scored >= 0 else scored,
                           fit=replace(fit, day_start=latest.fit.day_start)).blob()  # (a boundary told meanwhile stays)
            return Change(blob, lambda written: _done({**out, "refitted": True, "fitted_on": fit.fitted_on,
                                                       "scored_reviews": scored, "w": list(fit.w),
                                                       "state_version": written.version}))

        return await self.write(model, key, f"user {user_id!r}", [], attempt)
