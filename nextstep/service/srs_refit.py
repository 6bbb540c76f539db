"""Refitting a flashcard user's FSRS-6 parameters from their stored reviews (off the request path).

`SpacedRepetition.refit` reads a user's stored reviews (the recent block and every card's field), and
`fit_stored` turns them into a one-user review log and fits FSRS-6 on it with fsrs-rs exactly as the evaluation
protocol fits a user's training reviews (`nextstep.training.srs.eval.fit_fsrs6`: every scored review with an
earlier review of its card, as an FSRSItem of its card's reviews up to it). The store keeps each card's last
`card_size` reviews, so a card with more starts its history at the oldest one kept; on a user whose cards all have
at most `card_size` reviews, the fit equals the protocol's on the same reviews (tests/service/test_srs_refit.py).

`nextstep srs refit --model NAME` runs it for every user of the model (the store's walk over its keys, every
primary of a Redis Cluster) or those named; each user is fitted under the store's lease of their key (state.py's
`lease`), so that two workers never fit the same user at once, and a fit is written with a compare-and-set of the
header alone. This module needs fsrs_rs_python and numpy only (no
torch): the service image has both.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np

LEASE_MS = 300_000  # how long a worker holds a user's refit lease (a fit takes seconds)


def stored_rows(recent: np.ndarray, fields: Mapping[str, bytes]) -> np.ndarray:
    """Every review the store holds for a user (ROW), each once, in the order they were recorded."""
    parts = [recent] + [np.frombuffer(v, dtype=recent.dtype) for v in fields.values() if v]  # (srs.ROW)
    rows = np.concatenate(parts)
    _, first = np.unique(rows["seq"], return_index=True)
    return rows[first]  # (sorted by seq)


def review_log(rows: np.ndarray, day_start_hour: float):
    """The rows as a one-user ReviewLog: elapsed_days counted in scheduler days (a day starts at day_start_hour
    UTC, as the model's days do), -1 on a card's first stored review."""
    from ..training.srs.reviews import ReviewLog

    n = len(rows)
    card = rows["card"].astype(np.int64)
    day = np.floor((rows["time"].astype(np.float64) - day_start_hour * 3600.0) / 86400.0).astype(np.int64)
    order = np.lexsort((np.arange(n), card))
    same = np.r_[False, card[order][1:] == card[order][:-1]]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[same]] = order[np.flatnonzero(same) - 1]
    elapsed = np.where(prev >= 0, day - day[np.maximum(prev, 0)], -1).astype(np.int64)
    return ReviewLog(["user"], np.array([0, n], dtype=np.int64), card, rows["deck"].astype(np.int64),
                     rows["time"].astype(np.float64), rows["rating"].astype(np.int64),
                     rows["duration"].astype(np.float32), rows["state"].astype(np.int64), elapsed)


def fit_stored(rows: np.ndarray, day_start_hour: float,
               due: bool | Callable[[int], bool] = True) -> tuple[list[float] | None, int]:
    """(FSRS-6's 21 parameters fitted on the rows, or None when `due(scored)` says no; the number of
    scored reviews the fit sees). `due` is True, or a callable of the scored count (SpacedRepetition.refit_due)."""
    from ..training.srs.eval import fit_fsrs6, scored_mask

    log = review_log(rows, day_start_hour)
    scored = int(scored_mask(log).sum())
    if callable(due) and not due(scored):
        return None, scored
    return [float(x) for x in fit_fsrs6(log, np.arange(len(log), dtype=np.int64))], scored


async def refit_all(srs, model_name: str, users: list[str] | None = None, *, force: bool = False,
                    log: Callable[[str], None] = print) -> list[dict]:
    """Refit every user of the model (or those named) whose fit is due; one line per user refitted, failed or held by
    another worker."""
    import json
    import os
    import socket

    model = srs.model(model_name)
    owner = f"{socket.gethostname()}:{os.getpid()}"
    done, tried = [], set()
    async for page in _pages(srs, model, users):
        for user in page:
            if user in tried:  # (a walk may meet a key twice)
                continue
            tried.add(user)
            key = srs.key(model, user)
            if not await srs.store.lease(key, owner, LEASE_MS):
                done.append({"user_id": user, "refitted": False, "reason": "another worker holds its lease"})
                log(json.dumps(done[-1]))
                continue
            try:
                result = await srs.refit(model_name, user, force=force)
            except Exception as exc:  # one user's failure must not stop the others
                result = {"user_id": user, "refitted": False, "reason": f"failed: {exc}"}
            finally:
                await srs.store.release(key, owner)
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
