"""Refitting a flashcard user's FSRS-6 parameters from their stored reviews (off the request path).

`SpacedRepetition.refit` reads a user's stored reviews (the recent block and every card's field), and
`fit_stored` (training/srs/stored_fit.py) turns them into a one-user review log and fits FSRS-6 on it with fsrs-rs
exactly as the evaluation protocol fits a user's training reviews (`nextstep.training.srs.eval.fit_fsrs6`: every
scored review with an earlier review of its card, as an FSRSItem of its card's reviews up to it). The store keeps
each card's last `card_size` reviews, so a card with more starts its history at the oldest one kept; on a user whose
cards all have at most `card_size` reviews, the fit equals the protocol's on the same reviews
(tests/service/test_srs_refit.py).

Two ways run it; each user is fitted under the store's lease of their key (state.py's `lease`), so that two workers
(replicas, the command) never fit the same user at once, and a fit is written with a compare-and-set of the header
alone (reviews recorded meanwhile are kept):

* in the service (`RefitWorker`, NEXTSTEP_SRS_REFIT=auto): a write that leaves a user due a fit (`refit_due`) queues
  them (`offer`: a bounded queue of NEXTSTEP_SRS_REFIT_QUEUE users; a user already waiting is one turn; a full queue
  drops the user, who is queued again by their next review), and one worker per replica fits them one at a time.
  The fit runs in a process of its own (one, started on the first fit): fsrs-rs's `compute_parameters` holds the
  GIL from start to end (0.15 s for 28,000 scored reviews; bench/srs_refit_cost.py), so in a thread it would stall
  every request of the replica for that long. Outcomes are counted (nextstep_srs_refits_total): done; skipped
  (another worker holds the lease, or the user was no longer due: another replica fitted them first); dropped;
  failed.
* `nextstep srs refit --model NAME` (`refit_all`) for every user of the model (the store's walk over its keys, every
  primary of a Redis Cluster) or those named: a batch, e.g. after the service ran with NEXTSTEP_SRS_REFIT=off.

This module needs fsrs_rs_python and numpy only (no torch): the service image has both.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import socket
from collections.abc import Callable, Mapping

import numpy as np

from ..training.srs.stored_fit import Due, fit_stored, review_log  # noqa: F401 (where they were before)

logger = logging.getLogger(__name__)
LEASE_MS = 300_000  # how long a worker holds a user's refit lease (a fit takes well under a second)
OUTCOMES = ("done", "skipped", "dropped", "failed")  # nextstep_srs_refits_total's


def stored_rows(recent: np.ndarray, fields: Mapping[str, bytes]) -> np.ndarray:
    """Every review the store holds for a user (ROW), each once, in the order they were recorded."""
    parts = [recent] + [np.frombuffer(v, dtype=recent.dtype) for v in fields.values() if v]  # (srs.ROW)
    rows = np.concatenate(parts)
    _, first = np.unique(rows["seq"], return_index=True)
    return rows[first]  # (sorted by seq)


def owner() -> str:
    """Who holds a lease: this process, on this machine."""
    return f"{socket.gethostname()}:{os.getpid()}"


def fitting_process() -> concurrent.futures.ProcessPoolExecutor:
    """One process to fit in, started on the first fit: spawned, not forked (the service has threads: ONNX
    Runtime's, the store's), and it imports fsrs-rs and the protocol's fit only (training/srs/stored_fit.py)."""
    return concurrent.futures.ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))


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

    def __init__(self, srs, size: int, on_outcome: Callable[[str, str], None] = lambda model, outcome: None,
                 executor: concurrent.futures.Executor | None = None):
        self.srs, self.on_outcome = srs, on_outcome
        self.queue: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue(maxsize=size)
        self.waiting: set[tuple[str, str, str]] = set()  # (model, version, user) in the queue
        self.owner = owner()
        self.executor = executor if executor is not None else fitting_process()
        srs.fit_executor, srs.refits = self.executor, self

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
        """Fit the users queued, one at a time, until cancelled (then the fitting process is stopped, once the fit
        it runs, if any, is over)."""
        try:
            while True:
                turn = await self.queue.get()
                self.waiting.discard(turn)  # (a write from now on may queue them again)
                self.on_outcome(turn[0], await self.turn(*turn))
        finally:
            self.srs.refits = None
            await asyncio.shield(asyncio.to_thread(self.executor.shutdown, True, cancel_futures=True))

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
            return "done" if result.get("refitted") else "skipped"
        except asyncio.CancelledError:
            raise
        except concurrent.futures.process.BrokenProcessPool:  # the fitting process died (e.g. killed for memory)
            logger.exception("the refit of user %r of %s@%s lost its fitting process; starting another", user_id,
                             name, version)
            self.executor = srs.fit_executor = fitting_process()
            return "failed"
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
