"""FSRS-6 fitted on one flashcard user's stored reviews: what the service's refit runs (service/srs/refit.py).

It lives outside the service and training packages: the service imports it (numpy only at import) without
importing training, and the process the service fits in (fsrs-rs holds the GIL for the whole fit:
service/srs/refit.py) imports numpy, fsrs-rs and the evaluation protocol's fit (training/srs/eval.py) only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Due:
    """Whether a user with a number of scored reviews is due a fit: a first one once they have `min_scored`, then
    again once `every_scored` more have arrived since the last (`fitted_scored`: the scored reviews it saw; None:
    not fitted yet). A plain value, so that it travels to a fitting process."""

    min_scored: int
    every_scored: int
    fitted_scored: int | None = None

    def __call__(self, scored: int) -> bool:
        if self.fitted_scored is None:
            return scored >= self.min_scored
        return scored - self.fitted_scored >= self.every_scored


def stored_rows(recent: np.ndarray, fields: Mapping[str, bytes]) -> np.ndarray:
    """Every review the store holds for a user (service/srs.py's ROW: their recent block, and each card's field of
    rows), each once, in the order they were recorded. One array over the joined bytes (a user's thousands of cards:
    milliseconds, where one array per card took a quarter of a second)."""
    size = recent.dtype.itemsize
    cut = next((card for card, v in fields.items() if len(v) % size), None)
    if cut is not None:
        raise ValueError(f"stored reviews of card {cut!r} ({len(fields[cut])} bytes) are not whole {size}-byte rows")
    rows = np.frombuffer(b"".join([np.ascontiguousarray(recent).tobytes(), *fields.values()]), dtype=recent.dtype)
    _, first = np.unique(rows["seq"], return_index=True)
    return rows[first]  # (sorted by seq)


def review_log(rows: np.ndarray, day_start_hour: float):
    """The rows (service/srs.py's ROW) as a one-user ReviewLog: elapsed_days counted in scheduler days (a day
    starts at day_start_hour UTC, as the model's days do), -1 on a card's first stored review."""
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
    scored reviews the fit sees). `due` is True, or a callable of the scored count (`Due`)."""
    from ..training.srs.eval import fit_fsrs6, scored_mask

    log = review_log(rows, day_start_hour)
    scored = int(scored_mask(log).sum())
    if callable(due) and not due(scored):
        return None, scored
    return [float(x) for x in fit_fsrs6(log, np.arange(len(log), dtype=np.int64))], scored


def fit_held(recent: np.ndarray, fields: Mapping[str, bytes], day_start_hour: float,
             due: bool | Callable[[int], bool] = True) -> tuple[list[float] | None, int, int]:
    """`fit_stored` on the reviews a user's stored record holds (`stored_rows`), and how many they are: what a refit
    hands the fitting process (the rows are put together there too, off the service's event loop)."""
    rows = stored_rows(recent, fields)
    return (*fit_stored(rows, day_start_hour, due), len(rows))


def _exactly(stream, n: int) -> bytes:
    data = stream.read(n)
    if len(data) != n:
        raise EOFError(f"{len(data)} of {n} bytes")
    return data


def serve_fits() -> None:
    """The service's fitting process (service/srs/refit.py's FitProcess): a request on stdin (8 bytes, its length
    little-endian, then the pickle of fit_held's arguments), its answer on stdout (the same framing: the pickle of
    (True, fit_held's result) or (False, what went wrong)), until stdin closes. Whatever else writes to stdout
    (a library's print) goes to stderr: stdout is the answers' alone."""
    import os
    import pickle
    import sys

    answers = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    requests = sys.stdin.buffer
    while True:
        head = requests.read(8)
        if len(head) < 8:  # (the service closed our stdin: it is done with us)
            return
        args = pickle.loads(_exactly(requests, int.from_bytes(head, "little")))
        try:
            answer = (True, fit_held(*args))
        except Exception as exc:  # (the service counts it failed; the process goes on)
            answer = (False, f"{type(exc).__name__}: {exc}")
        data = pickle.dumps(answer, protocol=pickle.HIGHEST_PROTOCOL)
        answers.write(len(data).to_bytes(8, "little") + data)
        answers.flush()


if __name__ == "__main__":
    serve_fits()
