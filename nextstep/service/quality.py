"""Live model quality: every prediction a version would have made for an event, scored on that event when it comes.

Knowledge tracing: before each event with a response, the version's P(each response) for the event's question, from
the learner's state before the event, computed after the answer, off the request path (`later`: a bounded queue, one
worker, its graph calls in the engines' executor). A request of one event hands its state before the event over
(`pend`); the events a version gets are scored together, one `predict` call with a row per event, when `BATCH` wait
or at the next flush. A request of several events is scored by a job of its own: from the state before them, one
`predict` call for the first and the fused `step_predict` call that steps each event for the next. The score of one
event:

* log loss: -ln P(the observed response), the quantity `nextstep evaluate` averages (its NLL);
* Brier score: the squared distance between the predicted distribution and the observed response (one-hot), summed
  over the responses (binary data: twice the usual binary Brier score);
* for the calibration table and the AUC: P(full credit) (the highest response; binary data: P(right)) against
  whether the response was full credit, counted in `BINS` fixed buckets of width 1/BINS.

A request only hands its events' predictions over (`record`: one list append); they are added up in batches, with
numpy, when they are flushed, reported or scraped, or once `SETTLE_AT` records wait (`settle`), so that the request
path pays nothing for the sums.

Sums, not means, are kept (per model, version and role), so that replicas and minutes add: in process, flushed every
`flush_seconds` into Redis hashes (a minute's and an hour's, `<prefix>:quality:{<model>}:<version>:m:<minute>` and
`:h:<hour>`, kept `MINUTE_TTL` and `HOUR_TTL`; `<version>@canary` and `<version>@shadow` for the scores a candidate
earned in that role, so that a canary's figures never mix in its shadow phase) by a background task, off the request
path. `report` adds the
buckets of a window (minutes up to `MINUTE_WINDOW`, hours past it). Without Redis the buckets stay in this process.
The same sums are Prometheus counters (metrics.py) with bounded labels: model, version and the role the version had
when it was scored (serving, canary).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Hashable, Iterable
from typing import TYPE_CHECKING

import numpy as np

from .errors import StoreUnavailable

if TYPE_CHECKING:  # (no Redis client at import: offline scoring runs without one)
    from .redis_clients import Client

log = logging.getLogger(__name__)

BATCH = 64  # pending events scored in one graph call (`pend`): a group is scored once it holds this many
SETTLE_AT = 4096  # records waiting that are added up at once, whatever the time (bounds the memory they hold)
BINS = 200  # P(full credit) buckets kept for the AUC and calibration (width 0.005)
TABLE_BINS = 10  # rows of the calibration table answered (each adds BINS // TABLE_BINS buckets)
MINUTE_TTL = 2 * 86400  # seconds a minute bucket is kept
HOUR_TTL = 90 * 86400
MINUTE_WINDOW = 6 * 3600  # windows up to this long are added from minute buckets, longer ones from hour buckets
MAX_WINDOW = 90 * 86400
EPS = 1e-12  # a predicted probability of 0 scores -ln(1e-12), not infinity

Key = tuple[str, str, str]  # (model, version, role)
ROLES = ("serving", "canary", "shadow")  # the roles a version is scored in


def event_scores(probs: np.ndarray, responses: np.ndarray) -> dict[str, np.ndarray]:
    """Each event's log loss, Brier score, P(full credit) and whether it was full credit, from the predicted
    distributions (n, K) and the observed responses (n,)."""
    probs = np.asarray(probs, dtype=np.float64)
    responses = np.asarray(responses, dtype=np.int64)
    rows = np.arange(len(responses))
    observed = probs[rows, responses]
    onehot = np.zeros_like(probs)
    onehot[rows, responses] = 1.0
    top = probs.shape[1] - 1
    return {"log_loss": -np.log(np.maximum(observed, EPS)), "brier": ((probs - onehot) ** 2).sum(1),
            "p_full": probs[:, top], "full": responses == top}


def fields_of(probs: np.ndarray, responses: np.ndarray) -> dict[str, float]:
    """The sums one batch of scored events adds: n, ll, br, and per bucket b: p<b> (full credit) and q<b> (not)."""
    probs = np.asarray(probs, dtype=np.float64)
    responses = np.asarray(responses, dtype=np.int64)
    if not len(responses):
        return {"n": 0.0, "ll": 0.0, "br": 0.0}
    observed = probs[np.arange(len(responses)), responses]
    top = probs.shape[1] - 1
    bucket = np.clip((probs[:, top] * BINS).astype(np.int64), 0, BINS - 1)
    counts = np.bincount(bucket + BINS * (responses == top), minlength=2 * BINS)  # q<b> first, then p<b>
    out = {("p" if i >= BINS else "q") + str(i % BINS): float(counts[i]) for i in np.flatnonzero(counts)}
    return {"n": float(len(responses)), "ll": float(-np.log(np.maximum(observed, EPS)).sum()),
            "br": float(((probs ** 2).sum(1) - 2.0 * observed + 1.0).sum()), **out}


HIT_KS = (1, 5, 10, 20)  # sessions: the hit rates kept (a click ranked within the first k recommended)


def ranking_fields(ranks: np.ndarray) -> dict[str, float]:
    """The sums a batch of scored clicks adds: n, rr (reciprocal ranks; 0 for a click not in the list) and h<k>
    (clicks ranked within the first k), from 1-based ranks (inf: not recommended)."""
    ranks = [float(r) for r in ranks]
    out = {"n": float(len(ranks)), "rr": sum(1.0 / r for r in ranks if math.isfinite(r))}
    out.update({f"h{k}": float(sum(r <= k for r in ranks)) for k in HIT_KS})
    return out


def summary(sums: dict[str, float], scores: str = "probabilities") -> dict:
    """The answer's figures from added sums, by the kind of scores a task records (its TaskSpec's `scores`).
    Probabilities (knowledge tracing, flashcards): means, the AUC estimated from the buckets (ties within a bucket
    count half), and the calibration table (TABLE_BINS rows: predicted mean and observed share of full credit).
    Ranking (sessions): the mean reciprocal rank of the clicked item in the recommended list and the hit rates at
    HIT_KS (the offline protocol's mrr@K and recall@k, K the list's length)."""
    n = sums.get("n", 0.0)
    if scores == "ranking":
        return {"scored": int(n), "mrr": sums.get("rr", 0.0) / n if n else None,
                "hit_rate": {str(k): sums.get(f"h{k}", 0.0) / n if n else None for k in HIT_KS}}
    pos = np.array([sums.get(f"p{b}", 0.0) for b in range(BINS)])
    neg = np.array([sums.get(f"q{b}", 0.0) for b in range(BINS)])
    centers = (np.arange(BINS) + 0.5) / BINS
    auc = None
    if pos.sum() > 0 and neg.sum() > 0:
        below = np.concatenate([[0.0], np.cumsum(neg)[:-1]])  # negatives in lower buckets
        auc = float((pos * (below + 0.5 * neg)).sum() / (pos.sum() * neg.sum()))
    table = []
    width = BINS // TABLE_BINS
    for r in range(TABLE_BINS):
        part = slice(r * width, (r + 1) * width)
        count = pos[part].sum() + neg[part].sum()
        table.append({"from": r / TABLE_BINS, "to": (r + 1) / TABLE_BINS, "count": int(count),
                      "predicted": float((centers[part] * (pos[part] + neg[part])).sum() / count) if count else None,
                      "observed": float(pos[part].sum() / count) if count else None})
    return {"scored": int(n), "log_loss": sums.get("ll", 0.0) / n if n else None,
            "brier": sums.get("br", 0.0) / n if n else None, "auc": auc, "calibration": table}


def _add(into: dict[str, float], fields: dict[str, float]) -> None:
    for name, value in fields.items():
        into[name] = into.get(name, 0.0) + value


class Quality:
    """Live scores per (model, version, role): `record` adds to this process's pending sums (no I/O); `flush`
    writes them to the buckets; `report` answers GET /v1/models/{model}/quality."""

    def __init__(self, client: Client | None, *, prefix: str = "nextstep", flush_seconds: float = 1.0,
                 clock: Callable[[], float] = time.time, on_record: Callable[[Key, dict], None] | None = None,
                 queue: int = 10_000, on_drop: Callable[[str], None] | None = None):
        self.client, self.prefix, self.flush_seconds, self.clock = client, prefix, flush_seconds, clock
        self.on_record, self.on_drop = on_record, on_drop
        self._queue_size = queue
        self._jobs: asyncio.Queue | None = None  # scoring jobs run after the answers (`later`)
        self._worker: asyncio.Task | None = None
        self._pending_scores: dict[Hashable, tuple[str, Callable, list]] = {}  # group -> (model, job, items): `pend`
        self._raw: list[tuple[Key, np.ndarray | list[float], np.ndarray | None]] = []  # records not added up yet
        self._pending: dict[Key, dict[str, float]] = defaultdict(dict)
        self._local: dict[str, dict[str, float]] = defaultdict(dict)  # bucket key -> sums (no Redis)
        self._since: dict[str, float] = {}  # bucket key -> the time of its first record (no Redis)
        self._task: asyncio.Task | None = None

    # -- writing -------------------------------------------------------------------------------------------
    def record(self, model: str, version: str, probs: np.ndarray, responses: np.ndarray, role: str = "serving"
               ) -> None:
        """Knowledge-tracing events (and flashcard reviews): the predicted distributions (n, K) and the observed
        responses (n,). Kept as they are until `settle`."""
        if len(responses):
            self._keep((model, version, role), probs, responses)

    def record_ranks(self, model: str, version: str, ranks: list[float], role: str = "serving") -> None:
        """Clicks: where each clicked item stood in the list recommended before it (1-based; inf: not in it)."""
        if len(ranks):
            self._keep((model, version, role), ranks, None)

    def _keep(self, key: Key, scores, responses) -> None:
        self._raw.append((key, scores, responses))
        if len(self._raw) >= SETTLE_AT:
            self.settle()

    def settle(self) -> None:
        """Add up the records kept since the last time: per (model, version, role) and kind, one batch (the
        distributions of one key share their number of responses), into the pending sums and the metrics."""
        raw, self._raw = self._raw, []
        groups: dict[tuple, list] = {}
        for key, scores, responses in raw:
            kind = None if responses is None else np.shape(scores)[-1]
            groups.setdefault((key, kind), []).append((scores, responses))
        for (key, kind), parts in groups.items():
            if kind is None:
                fields = ranking_fields([r for ranks, _ in parts for r in ranks])
            else:
                probs = np.concatenate([np.asarray(p, dtype=np.float64).reshape(-1, kind) for p, _ in parts])
                fields = fields_of(probs, np.concatenate([np.asarray(r).reshape(-1) for _, r in parts]))
            self._record(key, fields)

    def later(self, model: str, job: Callable[[], Awaitable[None]], requests: int = 1) -> None:
        """Run `job` (it computes scores and records them) after the answer, off the request path: a bounded queue
        and one worker, whose graph calls go through the engines' executor (the event loop stays free for
        requests). A full queue drops the job (`on_drop(model, requests)`: the events of those requests go
        unscored). Without a started worker the job is dropped too."""
        try:
            if self._jobs is None:
                raise asyncio.QueueFull
            self._jobs.put_nowait(job)
        except asyncio.QueueFull:
            if self.on_drop is not None:
                self.on_drop(model, requests)

    def pend(self, model: str, group: Hashable, item, job: Callable[[list], Awaitable[None]]) -> None:
        """Keep `item` (what one request's event is scored from) to be scored with the others of its `group` by one
        `job(items)` run `later`: once the group holds BATCH items, or at the next flush (every `flush_seconds`),
        whichever comes first. The items of a group must be scored by one call (the same model, role, bank)."""
        pending = self._pending_scores.get(group)
        if pending is None:
            pending = self._pending_scores[group] = (model, job, [])
        pending[2].append(item)
        if len(pending[2]) >= BATCH:
            self._due(group)

    def _due(self, group: Hashable) -> None:
        """Queue the pending items of this group (`pend`) for scoring."""
        model, job, items = self._pending_scores.pop(group)
        self.later(model, functools.partial(job, items), len(items))

    def _due_all(self) -> None:
        for group in list(self._pending_scores):
            self._due(group)

    async def _work(self) -> None:
        while True:
            job = await self._jobs.get()
            try:
                await job()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("a live-quality scoring job failed (its events go unscored)")
            finally:
                self._jobs.task_done()

    async def drain(self) -> None:
        """Score the pending items (`pend`) and wait for the scoring jobs queued so far."""
        self._due_all()
        if self._jobs is not None and self._worker is not None:
            await self._jobs.join()

    def _record(self, key: Key, fields: dict[str, float]) -> None:
        _add(self._pending[key], fields)
        if self.on_record is not None:
            self.on_record(key, fields)

    def _bucket(self, key: Key, kind: str, at: float) -> str:
        model, version, role = key
        step = 60 if kind == "m" else 3600
        scored = version if role == "serving" else f"{version}@{role}"
        return f"{self.prefix}:quality:{{{model}}}:{scored}:{kind}:{int(at // step) * step}"

    async def flush(self) -> None:
        """Write the pending sums to the current minute's and hour's buckets (kept pending if Redis fails)."""
        self.settle()
        pending, self._pending = self._pending, defaultdict(dict)
        now = self.clock()
        for key, fields in pending.items():
            buckets = [(self._bucket(key, "m", now), MINUTE_TTL), (self._bucket(key, "h", now), HOUR_TTL)]
            if self.client is None:
                for name, _ in buckets:
                    _add(self._local[name], fields)
                    self._since.setdefault(name, now)
                continue
            commands = [("HSETNX", name, "since", repr(now)) for name, _ in buckets]
            commands += [("HINCRBYFLOAT", name, field, repr(value)) for name, _ in buckets
                         for field, value in fields.items()]
            commands += [("EXPIRE", name, ttl) for name, ttl in buckets]
            try:
                await self.client.execute("quality flush", commands, idempotent=False, write=True)
            except StoreUnavailable as exc:  # (an OutcomeUnknown too: counted again at worst)
                log.warning("live quality not written (kept for the next flush): %s", exc)
                _add(self._pending[key], fields)

    async def start(self) -> None:
        async def loop() -> None:
            while True:
                await asyncio.sleep(self.flush_seconds)
                self._due_all()
                await self.flush()

        self._task = asyncio.create_task(loop())
        self._jobs = asyncio.Queue(maxsize=self._queue_size)
        self._worker = asyncio.create_task(self._work())

    async def close(self, grace_seconds: float = 5.0) -> None:
        """Score the pending items and the queued jobs (for at most `grace_seconds`: a shutdown does not wait on
        them longer), then stop the worker and the flushes and flush what was scored."""
        if self._worker is not None and not self._worker.done():
            self._due_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._jobs.join(), grace_seconds)
        for task in (self._worker, self._task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        with contextlib.suppress(StoreUnavailable):
            await self.flush()

    # -- reading ------------------------------------------------------------------------------------------
    async def report(self, model: str, versions: Iterable[tuple[str, str]], window: float,
                     scores: str = "probabilities") -> list[dict]:
        """Per (version, role) given: the summary of the scores the version earned in that role (any other role,
        `inactive`: in every role) in the buckets that end within the last `window` seconds, and `since`, the time
        of the first score they hold (null: none)."""
        await self.drain()  # this replica's latest scores too
        await self.flush()
        now = self.clock()
        kind, step = ("m", 60) if window <= MINUTE_WINDOW else ("h", 3600)
        first = int((now - window) // step) * step
        starts = range(first, int(now // step) * step + 1, step)
        out = []
        for version, role in versions:
            earned = (role,) if role in ROLES else ROLES  # (a version serving no one: all it earned)
            names = [self._bucket((model, version, r), kind, t) for r in earned for t in starts]
            sums: dict[str, float] = {}
            since = math.inf
            for fields in await self._read(names):
                if fields:
                    since = min(since, fields.pop("since", math.inf))
                    _add(sums, fields)
            out.append({"version": version, "role": role, **summary(sums, scores),
                        "since": None if since == math.inf else since})
        return out

    async def _read(self, names: list[str]) -> list[dict[str, float]]:
        if self.client is None:
            return [{**self._local[n], "since": self._since[n]} if n in self._local else {} for n in names]
        replies = await self.client.execute("quality", [("HGETALL", n) for n in names])
        out = []
        for reply in replies:
            pairs = reply.items() if isinstance(reply, dict) else zip(reply[::2], reply[1::2], strict=True)
            out.append({(k.decode() if isinstance(k, bytes) else k): float(v) for k, v in pairs})
        return out
