"""ONNX Runtime off the event loop, with micro-batching; `Engines`: one batcher per (model, graph).

Each request brings feeds with a leading batch axis (usually 1 row). A `MicroBatcher` keeps one
`session.run` in flight per session, in an executor thread; requests that arrive meanwhile queue up, and
the next run takes the queued requests whose feeds have the same names, non-batch shapes and dtypes,
concatenated along axis 0 up to `max_batch` rows. Every output is split back by rows, so every graph
output must have the batch axis first (true of the step / predict / step_predict graphs).

Shared inputs: a request may also bring `shared` feeds without a batch axis (SimAKT's projected memory
banks, (L, M, d_head)), given to the run as they are. Requests share a run only if their shared feeds are
the very same arrays (the key holds their ids, unique while the queued requests hold them), so requests
that use different bank versions never share a run.

Latency: a lone request is dispatched at once (no timer at low load); `run_now` runs one in the calling
thread when the batcher is idle, for callers that know nothing else is in flight (saves the thread hop).
Only when other requests are already queued does the batcher wait to fill the batch, and at most until
the oldest queued request has waited `max_wait_ms`: requests that queued behind a run in flight have
usually waited that long already and go at once. So batching adds at most `max_wait_ms` of queueing to any request; with
`max_wait_ms=0` it only takes what queued behind the previous run.

Errors: an exception from `session.run` reaches the caller as the original exception. When a batch of
several requests fails, each is run again alone, so one bad request (say an index out of range) fails
only its own caller.
"""

import asyncio
import concurrent.futures
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .registry import LoadedModel

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Request:
    feeds: dict[str, np.ndarray]
    shared: dict[str, np.ndarray]  # non-batched inputs, passed as they are
    key: tuple  # what must match to share a run: input names, non-batch shapes, dtypes; the shared arrays
    rows: int
    arrived: float  # loop.time()
    future: asyncio.Future


class MicroBatcher:
    def __init__(self, session: ort.InferenceSession, *, max_batch: int = 64, max_wait_ms: float = 1.0,
                 executor: concurrent.futures.Executor | None = None,
                 on_batch: Callable[[int, float], None] | None = None):
        self.session = session
        self.max_batch = max_batch
        self.max_wait = max_wait_ms / 1000
        self.on_batch = on_batch
        self._owns_executor = executor is None
        self._executor = executor or concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="onnxruntime")
        self._queue: list[_Request] = []
        self._arrived: asyncio.Event | None = None  # set on every enqueue, so a gathering batch can wake early
        self._drainer: asyncio.Task | None = None  # runs while the queue is non-empty, then exits
        self._closed = False

    async def run(self, feeds: dict[str, np.ndarray], shared: dict[str, np.ndarray] | None = None
                  ) -> list[np.ndarray]:
        """This request's outputs (in the session's output order), each its own rows of the batch. `shared`:
        inputs without a batch axis, the same for every row (module docstring)."""
        feeds, rows = self._checked(feeds)
        shared = shared or {}
        key = (tuple((name, value.shape[1:], value.dtype.str) for name, value in sorted(feeds.items())),
               tuple((name, id(value)) for name, value in sorted(shared.items())))
        loop = asyncio.get_running_loop()
        request = _Request(feeds, shared, key, rows, loop.time(), loop.create_future())
        self._queue.append(request)
        if self._drainer is None or self._drainer.done():  # (made here so that they belong to the running loop)
            self._arrived = asyncio.Event()
            self._drainer = loop.create_task(self._drain())
        self._arrived.set()
        return await request.future

    def _checked(self, feeds: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], int]:
        if self._closed:
            raise RuntimeError("MicroBatcher is closed")
        feeds = {name: np.asarray(value) for name, value in feeds.items()}
        rows = {value.shape[0] if value.ndim else 0 for value in feeds.values()}
        if len(rows) != 1 or 0 in rows:
            raise ValueError(f"every feed needs the same leading batch axis of size >= 1; got shapes "
                             f"{ {n: v.shape for n, v in feeds.items()} }")
        return feeds, rows.pop()

    def run_now(self, feeds: dict[str, np.ndarray], shared: dict[str, np.ndarray] | None = None
                ) -> list[np.ndarray] | None:
        """Run one request right here, in the calling (event loop) thread, if the batcher is idle: nothing
        queued and no run in flight. None when it is busy (then `await run(feeds)`). For a caller that knows
        no other request is about to come (one request in the whole service): it saves the hop to the
        executor thread and back, about 0.1 ms, at the price of holding the loop for one session.run."""
        feeds, _ = self._checked(feeds)
        if self._queue or (self._drainer is not None and not self._drainer.done()):
            return None
        result = self._run_one(feeds, shared or {})
        if isinstance(result, BaseException):
            raise result
        return result

    async def close(self) -> None:
        """Refuse new requests, finish the queued ones, release the executor if this batcher made it."""
        self._closed = True
        if self._drainer is not None and not self._drainer.done():
            await self._drainer
        if self._owns_executor:
            self._executor.shutdown(wait=False)

    # -- the queue --------------------------------------------------------------------------------------

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queue:
            first = self._queue[0]
            if len(self._queue) > 1:  # under load: let the batch fill, bounded by the oldest request's wait
                await self._gather(first.key, first.arrived + self.max_wait)
            batch = self._take(first.key)
            if batch:
                try:
                    results = await loop.run_in_executor(self._executor, self._execute, batch)
                except Exception as e:  # e.g. the executor is shut down: nothing ran
                    results = [e] * len(batch)
                for request, result in zip(batch, results, strict=True):
                    if request.future.done():  # the caller went away (cancelled)
                        continue
                    if isinstance(result, BaseException):
                        request.future.set_exception(result)
                    else:
                        request.future.set_result(result)

    async def _gather(self, key: tuple, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while sum(r.rows for r in self._queue if r.key == key) < self.max_batch:
            remaining = deadline - loop.time()
            if remaining <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except TimeoutError:
                return

    def _take(self, key: tuple) -> list[_Request]:
        """Remove and return the oldest requests with this key, up to max_batch rows (at least one request)."""
        batch, rest, rows = [], [], 0
        for request in self._queue:
            if request.future.done():  # cancelled while queued
                continue
            if request.key == key and (not batch or rows + request.rows <= self.max_batch):
                batch.append(request)
                rows += request.rows
            else:
                rest.append(request)
        self._queue = rest
        return batch

    # -- in the executor thread -------------------------------------------------------------------------

    def _execute(self, batch: list[_Request]) -> list[list[np.ndarray] | BaseException]:
        if len(batch) == 1:
            return [self._run_one(batch[0].feeds, batch[0].shared)]
        feeds = {name: np.concatenate([r.feeds[name] for r in batch]) for name in batch[0].feeds}
        outputs = self._run_one(feeds, batch[0].shared)  # (the same shared arrays: they are in the key)
        if isinstance(outputs, BaseException):  # find the culprit: each request alone, errors to their own
            return [self._run_one(r.feeds, r.shared) for r in batch]
        bounds = np.cumsum([0] + [r.rows for r in batch])
        return [[out[start:stop] for out in outputs] for start, stop in zip(bounds[:-1], bounds[1:], strict=True)]

    def _run_one(self, feeds: dict[str, np.ndarray], shared: dict[str, np.ndarray]
                 ) -> list[np.ndarray] | BaseException:
        rows = next(iter(feeds.values())).shape[0]
        started = time.perf_counter()
        try:
            outputs = self.session.run(None, {**feeds, **shared} if shared else feeds)
        except Exception as e:
            return e
        finally:
            if self.on_batch is not None:
                try:
                    self.on_batch(rows, time.perf_counter() - started)
                except Exception:
                    log.exception("on_batch callback failed")
        bad = [o.shape for o in outputs if not o.ndim or o.shape[0] != rows]
        if bad:
            return RuntimeError(f"outputs without a leading batch axis of {rows} rows: {bad}")
        return outputs


class Engines:
    """One micro-batcher per (loaded model, graph), created on first use. Keyed weakly by the model
    object, so a reload's replaced models (and their sessions) are released, and a new model can never
    inherit an old model's batcher.

    Also the count of operations in progress (`operations`, kept by the stateful core for each request):
    while only one is, nobody could share its runs, so they run inline when the batcher is idle
    (`MicroBatcher.run_now`: no executor hop)."""

    def __init__(self, max_batch: int, max_wait_ms: float, on_batch=None):
        self.max_batch, self.max_wait_ms, self.on_batch = max_batch, max_wait_ms, on_batch
        self._batchers: weakref.WeakKeyDictionary[LoadedModel, dict[str, MicroBatcher]] = \
            weakref.WeakKeyDictionary()
        self.operations = 0  # requests in progress: the stateful core counts each of its operations here

    async def run(self, model: LoadedModel, graph: str, feeds: dict[str, np.ndarray], *,
                  shared: dict[str, np.ndarray] | None = None, background: bool = False) -> list[np.ndarray]:
        """The graph's outputs for these feeds (batch axis first). `shared`: inputs without a batch axis (a
        bank's keys and values), those the graph takes are given as they are. `background`: work no request waits
        for (live quality's scoring), never run inline on the event loop."""
        graphs = self._batchers.get(model)
        if graphs is None:
            graphs = self._batchers[model] = {}
        batcher = graphs.get(graph)
        if batcher is None:
            name, on_batch = model.name, None  # capture the name only: the batcher must not keep the model alive
            if self.on_batch:
                def on_batch(rows, secs):
                    self.on_batch(name, graph, rows, secs)
            batcher = graphs[graph] = MicroBatcher(model.sessions[graph], max_batch=self.max_batch,
                                                   max_wait_ms=self.max_wait_ms, on_batch=on_batch)
        shared = {n: shared[n] for n in model.input_names[graph] if n in shared} if shared else None
        feeds = {n: feeds[n] for n in model.input_names[graph] if not shared or n not in shared}
        if self.operations == 1 and not background:  # alone: nobody could share the run
            outputs = batcher.run_now(feeds, shared)
            if outputs is not None:
                return outputs
        return await batcher.run(feeds, shared)

    async def close(self) -> None:
        for graphs in list(self._batchers.values()):
            for batcher in graphs.values():
                await batcher.close()
