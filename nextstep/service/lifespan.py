"""What the app holds while it serves, made at startup and closed at shutdown (`lifespan`), and `reload_models`.

One Redis client for every task's state store (its connections pipeline or pool their requests); the URL chooses one
node, a cluster or Sentinel. Each task (tasks.py) gets a store of its own (its TTL, over the shared client), timed
per operation, and its service on app.state, which is told of the models at startup and at every reload (`loaded`:
knowledge tracing prepares SimAKT's banks, in a store of its own) and closed at shutdown.
"""

import asyncio
import gc
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI

from .errors import StoreUnavailable
from .fleet import FleetReloads
from .gate import Gate
from .metrics import Metrics
from .quality import Quality
from .redis_clients import connect
from .registry import LoadReport, ModelRegistry
from .rollouts import Rollouts
from .runtime import Engines
from .stores import make_store
from .tasks import Shared, plugins

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 10_000  # allocations (net of frees) of tracked objects between two young collections (Python: 700)


def collector_for_serving():
    """Python's cycle collector set for serving; returns what sets it back. What startup made (the models, routes and
    schemas: about 90,000 tracked objects) is frozen out of it (`gc.freeze`), so an old-generation collection no
    longer walks it (40-100 ms each, measured); and a young collection runs every YOUNG_THRESHOLD allocations instead
    of 700, which concurrent requests, each holding a few dozen objects across its awaits, crossed every 20 or so
    requests (docs/decisions.md). Requests make no lasting cycles (the collector found none in a load run), so
    memory is unchanged."""
    gc.collect()
    gc.freeze()
    thresholds = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, *thresholds[1:])

    def restore() -> None:
        gc.set_threshold(*thresholds)
        gc.unfreeze()

    return restore


async def reload_models(app: FastAPI) -> LoadReport:
    """Rescan the artifacts directory (in a worker thread), update the metrics, let each task prepare what it needs
    of the models (`loaded`): what `POST /v1/models/reload` does, and what every other replica does when it sees the
    reload generation move (fleet.py)."""
    registry, metrics = app.state.registry, app.state.metrics
    report: LoadReport = await asyncio.to_thread(registry.reload)
    metrics.set_models(registry.models())
    metrics.set_refused(registry.report.refused)  # (the registry's newest: reloads may overlap)
    metrics.reloads.labels("refused" if report.refused else "ok").inc()
    for service in app.state.services:
        await service.loaded(registry.models())
    await adopt_serving(app)
    return report


async def adopt_serving(app: FastAPI) -> None:
    """With manual new versions, store the version each model serves where no rollout names one yet, so that it
    outlives this process (rollouts.py, `adopt`); a store fault is logged, and the next reload tries again."""
    if app.state.settings.new_versions != "manual":
        return
    try:
        await app.state.rollouts.adopt({n: m.version for n, m in app.state.registry.latest().items()})
    except StoreUnavailable as exc:
        log.warning("the versions serving were not stored for the fleet (%s): the next reload tries again", exc)


class TimedStore:
    """The state store with each operation's latency recorded."""

    def __init__(self, store, metrics: Metrics):
        self._store, self._metrics = store, metrics

    def __getattr__(self, name):
        op = getattr(self._store, name)
        histogram = self._metrics.store_seconds.labels(name)

        async def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return await op(*args, **kwargs)
            finally:
                histogram.observe(time.perf_counter() - start)

        setattr(self, name, timed)  # built once per operation; later lookups skip __getattr__
        return timed


@asynccontextmanager
async def lifespan(app: FastAPI):
    settings, metrics = app.state.settings, app.state.metrics
    registry = ModelRegistry(settings.artifacts_dir, intra_op_threads=settings.ort_threads,
                             new_versions=settings.new_versions, demo_dir=settings.demo_artifacts_dir)
    metrics.set_refused(registry.reload().refused)  # (the registry logs each refusal)
    metrics.set_models(registry.models())
    options = settings.redis_options()
    redis = connect(settings.redis_url, options) if settings.redis_url else None
    engines = Engines(settings.max_batch, settings.max_wait_ms, metrics.on_batch)
    app.state.registry = registry
    quality = app.state.quality = Quality(redis, on_record=metrics.on_live_scores,
                                          on_drop=lambda model, n: metrics.live_unscored.labels(model).inc(n))
    await quality.start()
    shared = Shared(registry, engines, settings, metrics, quality if settings.live_quality else None)
    # each task's entities in a store of their own (same client, the task's TTL: learners keep their state for
    # months, sessions half an hour, flashcard users their reviews for years)
    stores = [make_store(None, client=redis, max_event_ids=settings.max_event_ids, **p.store(settings))
              for p in plugins()]
    app.state.store = stores[0]  # (/readyz pings it: every store shares the one client)
    services = [p.build(shared, TimedStore(store, metrics)) for p, store in zip(plugins(), stores, strict=True)]
    for p, service in zip(plugins(), services, strict=True):
        setattr(app.state, p.attr, service)
        await service.loaded(registry.models())
    app.state.services = services
    # rollouts (which version serves, a canary's candidate) are the fleet's, in Redis, followed by every replica
    rollouts = app.state.rollouts = Rollouts(redis, refresh_seconds=settings.reload_refresh_seconds)
    shadow_workers = []
    gate = app.state.gate = Gate(redis)  # gated shadows: their evidence and decisions, the fleet's (gate.py)
    for service in services:
        service.rollouts = rollouts  # canaries, and shadows: each task's candidate follows off the request path
        service.gate, service.on_gate = gate, metrics.on_gate
        service.on_shadow = lambda model, outcome: metrics.shadow.labels(model, outcome).inc()
        shadow_workers.append(asyncio.create_task(service.run_shadows(settings.shadow_queue)))
    # what a task runs beside its requests (the flashcard refit worker): started now, cancelled at shutdown
    background = [task for service in services for task in service.background(settings, metrics)]
    # (in a thread: set_serving waits for a reload in progress, which takes seconds)
    await rollouts.start(lambda current: asyncio.to_thread(
        registry.set_serving, {m: r.serving for m, r in current.items()}))
    await adopt_serving(app)  # (manual versions: what serves now is the fleet's choice, in Redis)
    # a reload on any replica reaches the others sharing this Redis within NEXTSTEP_RELOAD_REFRESH_SECONDS
    app.state.fleet = FleetReloads(redis, refresh_seconds=settings.reload_refresh_seconds)
    await app.state.fleet.start(lambda: reload_models(app))
    restore_collector = collector_for_serving()
    yield
    restore_collector()
    await app.state.fleet.close()
    await rollouts.close()
    for worker in shadow_workers + background:
        worker.cancel()
    await asyncio.gather(*shadow_workers, *background, return_exceptions=True)
    await quality.close()
    await engines.close()
    for service in services:
        await service.close()
    for store in stores:
        await store.close()
    if redis is not None:
        await redis.close()
