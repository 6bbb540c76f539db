"""The routes over the loaded models (tag "system"): the list, a model's ids, its live quality, its rollout (which
version serves, a candidate's canary or shadow), the migration of its entities' states, and the reload.

Every one but the list and the reload names a model (/v1/models/{model}/...), of any task: what differs by task
comes from the task's plug-in (tasks.py). PUT, DELETE and the POSTs are admin routes (access.py)."""

from dataclasses import asdict
from typing import Annotated

from fastapi import APIRouter, Query, Request
from fastapi import Path as PathParam

from ..errors import InvalidInput, UnknownModel, problem
from ..gate import GateConfig, decide, evidence_of
from ..lifespan import reload_models
from ..registry import TASKS
from ..rollouts import Rollout
from ..schemas import (
    Migrated,
    MigrateRequest,
    ModelIds,
    ModelList,
    Quality,
    Reloaded,
    RolloutRequest,
    RolloutStatus,
)
from ..tasks import plugin, stateful_task
from .common import JsonRoute, answer

router = APIRouter(route_class=JsonRoute)


def unpinned(model: str) -> str:
    """A model's name from a route's path that acts on the model as a whole (its rollout, its quality): a pin
    (`name@version`, or the X-Model-Version header, which the middleware turns into one) is refused, not ignored."""
    name, at, version = model.partition("@")
    if at:
        raise InvalidInput("model", f"this route acts on model {name!r} as a whole, not on one version: name it "
                                    f"without a pin ({name!r}, not {model!r}; no X-Model-Version header)")
    return name


@router.get("/v1/models", tags=["system"], summary="Loaded models: names, versions, tasks, held-out metrics",
            responses=answer(ModelList, {"models": [{
                "name": "deep_gpcm", "version": "1", "latest": True, "family": "deep_gpcm", "task": "knowledge_tracing",
                "n_cats": 4, "vocabulary": 20, "metrics": {"qwk": 0.61, "ordinal_accuracy": 0.79}}],
                "refused": [], "errors": {}}))
async def models(request: Request) -> dict:
    registry = request.app.state.registry
    latest = registry.latest()
    details = request.app.state.access.is_admin(request.scope)  # (as /readyz: refusals' paths and messages)
    report = registry.report
    # each model's task adds its own fields (TaskFields.shown); one it shares takes the place listed here (n_cats:
    # knowledge tracing's response categories, 0 for the other tasks, as the list has always said)
    return {"models": [{"name": m.name, "version": m.version, "latest": latest.get(m.name) is m, "family": m.family,
                        "task": m.task, "n_cats": 0, "vocabulary": len(m.ids), **m.extra.shown(),
                        "metrics": m.manifest.get("metrics", {}).get("test", {})} for m in registry.models()],
            "refused": [r.as_dict(details) for r in report.refused],
            "errors": report.errors if details else report.summaries()}


@router.get("/v1/models/{model}/ids", tags=["system"],
            summary="The ids a model knows (questions or items), a page at a time, and the version answering",
            responses=answer(ModelIds, {"model": "deep_gpcm", "version": "2", "task": "knowledge_tracing",
                              "vocabulary": "questions", "total": 3, "offset": 0, "limit": 2, "ids": ["17", "18"],
                              "next_offset": 2}, 404))


async def model_ids(request: Request, model: Annotated[str, PathParam(
                        description="model name; `name@version` (or the X-Model-Version header) pins a version")],
                    offset: Annotated[int, Query(ge=0, description="ids to skip")] = 0,
                    limit: Annotated[int, Query(ge=1, le=10_000, description="ids in this page")] = 1000) -> dict:
    m = request.app.state.registry.get(model)
    kind = TASKS[m.task].vocabulary
    end = min(offset + limit, len(m.ids))
    return {"model": m.name, "version": m.version, "task": m.task, "vocabulary": kind, "total": len(m.ids),
            "offset": offset, "limit": limit, "ids": m.ids[offset:end],
            "next_offset": end if end < len(m.ids) else None}


@router.get("/v1/models/{model}/quality", tags=["system"],
            summary="Live quality of each version: its predictions scored on the events that followed",
            description="Knowledge tracing: for every event with a response, the prediction the version would "
                        "have made for it from the learner's state before it, scored when the event came: the mean "
                        "log loss and Brier score, the AUC of P(full credit) estimated from 200 buckets, and a "
                        "calibration table (predicted against observed share of full credit). Sessions: each "
                        "click after a session's first, ranked in the list the state before it recommends (every "
                        "item a candidate): `mrr` and `hit_rate` at 1, 5, 10 and 20. Flashcards: each scored review's "
                        "P(recall) from the user's reviews before it, as for knowledge tracing. Over the last "
                        "`window` seconds, every replica's scores added. Each version's `role` is what it is now "
                        "(`serving`; a candidate's `canary` or `shadow`; `inactive`: loaded, serving no one), and "
                        "its figures are those it earned in that role (an inactive version's: all it earned in the "
                        "window).",
            responses=answer(Quality, {"model": "deep_gpcm", "task": "knowledge_tracing", "window_seconds": 3600,
                                       "versions": [
                {"version": "2", "role": "serving", "scored": 1200, "log_loss": 0.512, "brier": 0.331,
                 "auc": 0.781, "calibration": [{"from": 0.0, "to": 0.1, "count": 40, "predicted": 0.06,
                                                "observed": 0.05}], "since": 1767225600.0}]}, 404))


async def quality(request: Request, model: Annotated[str, PathParam(description="model name")],
                  window: Annotated[int, Query(ge=60, le=90 * 86400, description="seconds back from now "
                                               "(minute buckets up to 6 hours, hour buckets past it)")] = 3600
                  ) -> dict:
    registry = request.app.state.registry
    latest = registry.get(unpinned(model))
    rollout = request.app.state.rollouts.current.get(latest.name)
    versions = [(m.version, "serving" if m is latest else rollout.mode if rollout and rollout.candidate == m.version
                 and rollout.mode else "inactive") for m in registry.models() if m.name == latest.name]
    return {"model": latest.name, "task": latest.task, "window_seconds": window,
            "versions": await request.app.state.quality.report(latest.name, versions, window,
                                                               TASKS[latest.task].scores)}


async def rollout_answer(request: Request, name: str) -> dict:
    registry = request.app.state.registry
    latest = registry.get(unpinned(name))
    rollout = request.app.state.rollouts.current.get(latest.name)
    answer = {"model": latest.name, "serving": latest.version,
              "new_versions": request.app.state.settings.new_versions,
              "candidate": rollout.candidate if rollout else None, "mode": rollout.mode if rollout else None,
              "fraction": rollout.fraction if rollout and rollout.candidate else None,
              "updated": rollout.updated if rollout else None,
              "versions": sorted(m.version for m in registry.models() if m.name == latest.name)}
    gate = request.app.state.gate
    if rollout is not None and rollout.gate is not None and rollout.candidate is not None:
        config = GateConfig(**rollout.gate)
        fields = await gate.read(gate.key(latest.name, rollout.candidate, rollout.updated))
        evidence = evidence_of(fields, config.alpha)
        answer["gate"] = {**asdict(config), "decision": decide(evidence, config), **evidence.as_dict()}
        if rollout.ramp:
            answer["ramp"] = rollout.ramp
    decisions = await gate.decisions(latest.name)
    if decisions:
        answer["decisions"] = decisions
    return answer


ROLLOUT_EXAMPLE = {"model": "deep_gpcm", "serving": "1", "new_versions": "manual", "candidate": "2",
                   "mode": "canary", "fraction": 0.1, "updated": 1767225600.0, "versions": ["1", "2"]}


@router.get("/v1/models/{model}/rollout", tags=["system"], summary="Which version serves, and a candidate's rollout",
            responses=answer(RolloutStatus, ROLLOUT_EXAMPLE, 404))


async def get_rollout(request: Request, model: Annotated[str, PathParam(description="model name")]) -> dict:
    return await rollout_answer(request, model)


@router.put("/v1/models/{model}/rollout", tags=["system"],
            summary="Put a candidate version on a stable fraction of the model's entities (canary)",
            description="Learners, sessions or users whose hash falls in the fraction get the candidate, on every "
                        "replica (within NEXTSTEP_RELOAD_REFRESH_SECONDS) and every request; raising the fraction "
                        "only adds entities. Their states move between versions through the event log, so no "
                        "learner loses history either way. Every answer names the version that answered.",
            responses=answer(RolloutStatus, ROLLOUT_EXAMPLE, 404, 422))


async def put_rollout(request: Request, model: Annotated[str, PathParam(description="model name")],
                      body: RolloutRequest) -> dict:
    registry, rollouts = request.app.state.registry, request.app.state.rollouts
    latest = registry.get(unpinned(model))
    if request.app.state.settings.new_versions != "manual":
        raise InvalidInput("model", "rollouts need NEXTSTEP_NEW_VERSIONS=manual: with auto, a new version "
                                    "serves everyone at the reload that loads it")
    try:
        registry.get(latest.name, body.candidate)
    except UnknownModel as exc:
        raise InvalidInput("candidate", str(exc)) from None
    rollout = rollouts.current.get(latest.name)
    serving = rollout.serving if rollout else latest.version
    if body.candidate == serving:
        raise InvalidInput("candidate", f"version {body.candidate} is the one serving {latest.name}")
    gate = None
    if body.ramp is not None:
        if body.gate is None or body.mode != "canary":
            raise InvalidInput("ramp", "a ramp moves a gated canary: give a gate and mode \"canary\"")
        if any(b <= a for a, b in zip(body.ramp, body.ramp[1:], strict=False)) or body.ramp[0] != body.fraction:
            raise InvalidInput("ramp", f"{body.ramp} must increase, from the rollout's fraction ({body.fraction})")
    if body.gate is not None:
        settings = request.app.state.settings
        if stateful_task(request.app, latest.task) is None:
            raise InvalidInput("gate", f"model {latest.name} is a {latest.task} model, whose shadows do not score "
                                       "both versions on the same events: decide its rollout by hand")
        gate = asdict(GateConfig(
            auto=body.gate.auto, alpha=body.gate.alpha if body.gate.alpha is not None else settings.gate_alpha,
            min_gain=body.gate.min_gain if body.gate.min_gain is not None else settings.gate_min_gain,
            min_events=body.gate.min_events if body.gate.min_events is not None else settings.gate_min_events,
            min_learners=body.gate.min_learners if body.gate.min_learners is not None
            else settings.gate_min_learners))
    await rollouts.put(latest.name, Rollout(serving, body.candidate, body.mode, body.fraction, gate=gate,
                                            ramp=body.ramp))
    return await rollout_answer(request, latest.name)


@router.post("/v1/models/{model}/rollout/promote", tags=["system"],
             summary="Make the candidate the version serving every entity",
             responses=answer(RolloutStatus, ROLLOUT_EXAMPLE, 404, 422))


async def promote_rollout(request: Request, model: Annotated[str, PathParam(description="model name")]) -> dict:
    registry = request.app.state.registry
    latest = registry.get(unpinned(model))
    rollout = request.app.state.rollouts.current.get(latest.name)
    if rollout is None or rollout.candidate is None:
        raise InvalidInput("model", f"model {latest.name} has no candidate to promote (PUT a rollout first)")
    try:  # (a candidate whose directory was withdrawn since: promoting it would serve what is not loaded)
        registry.get(latest.name, rollout.candidate)
    except UnknownModel:
        raise InvalidInput("candidate", f"version {rollout.candidate} of {latest.name} is not loaded (its "
                                        "directory was withdrawn, or refused at the last reload): put it back and "
                                        "reload, or abort the rollout (DELETE)") from None
    await request.app.state.rollouts.put(latest.name, Rollout(rollout.candidate))
    return await rollout_answer(request, latest.name)


@router.delete("/v1/models/{model}/rollout", tags=["system"],
               summary="Abort a rollout: the candidate serves no one; the serving version stays",
               responses=answer(RolloutStatus, ROLLOUT_EXAMPLE, 404))


async def abort_rollout(request: Request, model: Annotated[str, PathParam(description="model name")]) -> dict:
    latest = request.app.state.registry.get(unpinned(model))
    rollout = request.app.state.rollouts.current.get(latest.name)
    if rollout is not None and rollout.candidate is not None:
        await request.app.state.rollouts.put(latest.name, Rollout(rollout.serving))
    return await rollout_answer(request, latest.name)


@router.post("/v1/models/{model}/migrate", tags=["system"],
             summary="Bring a page of entities' state for a version up to date with their event logs",
             description="Each entity of the page (learners, sessions) gets its state for the version rebuilt "
                         "from its event log, as its first request to that version would, so that no request "
                         "waits for it after `latest` moves. Call again with the answer's `cursor` until "
                         "`done`: each call is one page, so the caller sets the pace, and a walk can stop and "
                         "resume anywhere; it is safe while serving, from any replica. Flashcard models: the "
                         "users stored under the model's other window layouts (its other loaded versions' window "
                         "sizes) each get a state for the version's layout rebuilt from their stored reviews; "
                         "versions of one layout share their users' reviews, and have no one to walk.",
             responses=answer(Migrated, {"model": "deep_gpcm", "version": "2", "cursor": "1792", "done": False,
                               "entities": 500, "rebuilt": 496, "events": 61390, "lagging": 0}, 404, 422))


async def migrate(request: Request, model: Annotated[str, PathParam(description="model name")],
                  body: MigrateRequest) -> dict:
    name, at, pin = model.partition("@")  # (a pin in the path, or the X-Model-Version header, names the version)
    if at and body.version not in ("latest", pin):
        raise InvalidInput("version", f"{body.version!r} contradicts the path's pin {model!r}")
    m = request.app.state.registry.get(name, pin if at else body.version)
    task = stateful_task(request.app, m.task)
    if task is None:
        raise InvalidInput("model", f"model {m.name} is a {m.task} model: {plugin(m.task).no_migrate}")
    try:
        return await task.migrate(m, body.cursor, body.limit)
    except ValueError as exc:
        raise InvalidInput("cursor", f"{exc}: pass \"0\" to start, then each answer's cursor") from None


RELOAD_EXAMPLE = {"models": ["deep_gpcm/1", "deep_gpcm/2"], "serving": {"deep_gpcm": "2"}, "withdrawn": [],
                  "refused": [], "fleet_generation": 7, "errors": {}}


@router.post("/v1/models/reload", tags=["system"],
             summary="Rescan the artifacts directory, here and (through Redis) on every replica (409: refused)",
             responses={**answer(Reloaded, RELOAD_EXAMPLE),
                        409: {"description": "artifacts refused: each named with its reason; what served before "
                                             "keeps serving (the other artifacts were loaded)",
                              "content": {"application/problem+json": {}}}})


async def reload(request: Request):
    registry = request.app.state.registry
    report = await reload_models(request.app)
    # the other replicas on this Redis follow within NEXTSTEP_RELOAD_REFRESH_SECONDS; null: not told
    # (no Redis, or it failed: the log says so)
    generation = await request.app.state.fleet.announce()
    details = request.app.state.access.is_admin(request.scope)  # (an admin route: always, as the rules stand)
    answer = {"models": [f"{m.name}/{m.version}" for m in registry.models()], "serving": report.serving,
              "withdrawn": list(report.withdrawn), "refused": [r.as_dict(details) for r in report.refused],
              "fleet_generation": generation}
    if not report.refused:
        return {**answer, "errors": {}}
    # the detail names each artifact and the kind of fault; the paths and messages are in `refused` and the log
    named = "; ".join(f"{r.model}/{r.version}: {r.summary} ({r.outcome})" for r in report.refused)
    return problem(409, f"{len(report.refused)} artifact(s) refused, the rest loaded: {named}", None,
                   "artifact-refused", **answer)
