"""The task plug-ins: what the app needs of each task, in one record (`TaskPlugin`), collected by `plugins()`.

Each task package's routes module, `<name>/routes.py` (service/__init__.py's TASK_MODULES), ends with its `TASK`:
the task's spec (the artifacts it serves), its service class (whose PREFIX starts its entities' state keys), its
router, its state store's settings (TTL, log bounds) and how its service is built from the settings. create_app
includes the routers, and lifespan.py makes each task's store and service from it; nothing else in the app names a
task.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fastapi import APIRouter, FastAPI

    from .core import StatefulTask
    from .metrics import Metrics
    from .quality import Quality
    from .registry import LoadedModel, ModelRegistry, TaskSpec
    from .runtime import Engines
    from .settings import Settings
    from .state import StateStore


@dataclass(frozen=True)
class Shared:
    """What the app makes once for every task (lifespan.py); a task's `build` takes what it needs of it."""

    registry: ModelRegistry
    engines: Engines
    settings: Settings
    metrics: Metrics
    quality: Quality | None  # live quality (None: NEXTSTEP_LIVE_QUALITY off)

    def on_retry(self, model: LoadedModel) -> None:
        """A lost compare-and-set, counted per model."""
        self.metrics.cas_retries.labels(model.name).inc()


class Export:
    """What a task's traffic exports as (its TaskPlugin's `export`; event_export.py writes it): the two files
    (`{model}` filled in), their delimiter and header, and per entity the rows (`rows`); `lacking` names the summary's
    count of the events the store no longer holds."""

    prefix: str  # of the task's keys (core.StatefulTask.PREFIX)
    files: tuple[str, str]  # train, test
    delimiter: str
    header: tuple[str, ...]
    lacking = "not_in_log"

    def for_model(self, artifacts: Path | None, model: str) -> Export:
        """This export for one model, from its versions' manifests under `artifacts` where it needs them."""
        return self

    def entity(self, rest: str) -> str:
        """The entity of a key, from what follows "<prefix>:<model>:"."""
        return rest

    async def rows(self, store: StateStore, prefix: str, rest: str, entity: str) -> tuple[list[list], int] | None:
        """(the entity's rows, how many of its events the store no longer holds); None: nothing to export."""
        raise NotImplementedError

    def beside(self) -> dict[str, str]:
        """Files written beside the data: {name: text}."""
        return {}


@dataclass(frozen=True)
class TaskPlugin:
    spec: TaskSpec  # the artifacts it serves (its service module registers it with the registry)
    service: type[StatefulTask]  # its service class: TASK (the spec's name), PREFIX (its state keys' prefix)
    router: APIRouter  # its routes, /v1/<prefix>/{model}/..., each a JsonRoute
    attr: str  # app.state.<attr>: the service its routes' dependency reads
    store: Callable[[Settings], dict]  # its state store's options from the settings (make_store: TTL, log bounds)
    build: Callable[[Shared, StateStore], StatefulTask]  # its service, over its store, from its settings
    # None where a migration brings an entity's state to a version (knowledge tracing and sessions: from the event
    # log; flashcards: from another window layout's stored reviews); else why there is none, as the refusals of
    # POST /v1/models/{model}/migrate ("is a <task> model: ...") says it
    no_migrate: str | None = None
    export: Export | None = None  # its traffic as training data (`nextstep events export`); None: it has none

    @property
    def path_prefix(self) -> str:
        """The path segment after /v1/ of its routes ("kt"): X-Model-Version pins the `{model}` after it."""
        return self.router.prefix.split("/")[2]


@functools.cache
def plugins() -> tuple[TaskPlugin, ...]:
    """Every task's plug-in, in TASK_MODULES's order (imported on first use: the routes modules import this one)."""
    from . import TASK_MODULES, package

    return tuple(importlib.import_module(f"{package(name)}.routes").TASK for name in TASK_MODULES)


def plugin(task: str) -> TaskPlugin | None:
    """The plug-in of a task (a manifest's `task`: knowledge_tracing, next_item, srs); None if none serves it."""
    return next((p for p in plugins() if p.spec.name == task), None)


def service(app: FastAPI, task: str) -> StatefulTask:
    """The running service of a task (app.state)."""
    return getattr(app.state, plugin(task).attr)


def stateful_task(app: FastAPI, task: str) -> StatefulTask | None:
    """The service of a task whose entities' states a migration brings to a version (`migrate`: knowledge tracing and
    sessions from their event logs, flashcards from another window layout's stored reviews); None for a task that
    refuses (`no_migrate`)."""
    found = plugin(task)
    return getattr(app.state, found.attr) if found is not None and found.no_migrate is None else None
