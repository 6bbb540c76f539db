"""The FastAPI app: wiring, errors, API keys, body limits, metrics, and the system routes.

    create_app(settings) -> FastAPI        (`nextstep serve`, or `uvicorn --factory nextstep.service.app:create_app`)
"""

import asyncio
import hmac
import inspect
import logging
import re
import time
from contextlib import asynccontextmanager
from importlib.resources import files
from typing import Annotated, Literal
from urllib.parse import quote, unquote_to_bytes

from fastapi import FastAPI, Query, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ConfigDict, Field, StrictInt
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware

from .banks import Banks, make_bank_store
from .core import StatefulTask
from .errors import KIND, STATUS, InvalidInput, StoreUnavailable, UnknownModel, problem, shown
from .fleet import FleetReloads
from .kt import KnowledgeTracer
from .metrics import Metrics
from .openapi import complete
from .quality import Quality
from .redis_clients import connect
from .registry import TASKS, LoadReport, ModelRegistry
from .rollouts import Rollout, Rollouts
from .routes import kt as kt_routes
from .routes import sessions as session_routes
from .routes import srs as srs_routes
from .routes.common import IdText, JsonRoute, Strict, answer
from .runtime import Engines
from .server import is_loopback
from .sessions import SessionRecommender
from .settings import Settings
from .srs import SpacedRepetition
from .state import make_store

log = logging.getLogger("nextstep.service")
# the docs pages' scripts, styles and icon, served from the fastapi-offline package (no CDN: /docs works offline)
DOCS_ASSETS, DOCS_FILES = "/docs/assets", ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js",
                                           "favicon.png")
OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/redoc",
              *(f"{DOCS_ASSETS}/{name}" for name in DOCS_FILES)}
PIN_HEADER = "X-Model-Version"
_PINNED_PREFIXES = {"kt", "sessions", "srs", "models"}  # /v1/<prefix>/{model}/...


def _undecodable(scope):
    """A 422 for a path whose percent-escapes are not UTF-8 (the server decodes them with replacement characters,
    so `%FE` and `%FF` would both name the id "\ufffd"), else None. Called only when the path holds U+FFFD."""
    raw = scope.get("raw_path")
    if raw is None:
        return None
    try:
        unquote_to_bytes(raw.split(b"?", 1)[0]).decode("utf-8")
    except UnicodeDecodeError:
        return problem(422, "path: its percent-escapes are not UTF-8 (encode ids as UTF-8 before escaping them)",
                       "path", "invalid-request")
    return None


def _slashed_model(scope):
    """A 404 for a path whose `{model}` segment holds an encoded slash (`/v1/sessions/a%2Fb/events`), else None.
    The router sees the decoded path, where "a/b" is two segments: a route with an id of several segments would
    take it (`/v1/sessions/{model}/{session_id:path}`: model "a", session "b/events", and so a 405 for a POST). No
    model name holds a '/' (it is a directory). Called only when the raw path holds a percent-escape."""
    parts = scope.get("raw_path", b"").split(b"?", 1)[0].split(b"/")
    if len(parts) < 4 or parts[1] != b"v1" or parts[2].decode("latin-1") not in _PINNED_PREFIXES:
        return None
    if b"%2f" not in parts[3].lower():
        return None
    name = unquote_to_bytes(parts[3]).decode("utf-8", "replace")
    return problem(404, f"no model {shown(name)}: a model name holds no '/' (the path's model segment has an encoded "
                        "slash, %2F)", "model", "unknown-model")


def _pin(scope, version: bytes):
    """X-Model-Version: the path's `{model}` segment becomes `name@version`, before routing, so that the routes,
    the metrics and the registry see one form of a pin. None, or the problem to answer: a malformed version, or
    one that contradicts a pin in the path."""
    parts = scope["path"].split("/")
    if len(parts) < 5 or parts[1] != "v1" or parts[2] not in _PINNED_PREFIXES:
        return None  # no model in this path: the header means nothing here
    try:
        pin = version.decode("ascii")
    except UnicodeDecodeError:
        pin = ""
    if not pin or len(pin) > 200 or not pin.isprintable() or any(c in pin for c in "/@ "):
        return problem(422, f"{PIN_HEADER}: a version directory name (printable ASCII, no '/', '@' or space, "
                       "at most 200 characters)", PIN_HEADER, "invalid-request")
    name, at, given = parts[3].partition("@")
    if at and given != pin:
        return problem(422, f"{PIN_HEADER}: {pin!r} contradicts the path's pin {parts[3]!r}", PIN_HEADER,
                       "invalid-request")
    parts[3] = f"{name}@{pin}"
    scope["path"] = "/".join(parts)
    scope["raw_path"] = quote(scope["path"]).encode()
    return None


ADMIN_METHODS = {"PUT", "PATCH", "DELETE"}  # bank swaps, deletes of learners, sessions and users


def admin_route(method: str, path: str) -> bool:
    """Whether a request needs the admin role: every PUT, PATCH and DELETE, and POSTs under /v1/models/ (reload)."""
    return method in ADMIN_METHODS or (method == "POST" and path.startswith("/v1/models/"))


def _matches(given: bytes, keys: list[bytes]) -> bool:
    """Whether `given` is one of `keys`, comparing with every key in constant time (no early exit)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


class Access:
    """Who may call what: API keys and roles, and the loopback rule (docs/decisions.md, "Access"). `check` decides
    a request; `is_admin` whether a request would pass an admin route's check, which is who sees the service's
    details (artifact paths, ONNX Runtime's and Redis's messages) where the others see the kind of fault."""

    def __init__(self, settings: Settings):
        self.keys = [k.encode() for k in settings.api_keys]
        self.admin_keys = [k.encode() for k in settings.admin_keys]
        self.on = bool(self.keys or self.admin_keys)

    def check(self, scope, given: bytes | None, admin: bool):
        """None if the request may go on, else the problem to answer. With keys set, a request needs one (401); an
        admin route needs an admin key (403), or, while no admin key is set, a loopback client. With no keys at
        all, everything but the admin routes is open, and those are served to loopback clients only (403)."""
        route = f"{scope['method']} {scope['path'][:120]}"  # (a path may be long: not echoed whole)
        if self.on:
            if not given:  # (no key is empty: settings.py refuses one, and an empty header is no key)
                return problem(401, f"{'missing' if given is None else 'empty'} X-API-Key header", "X-API-Key",
                               "unauthorized")
            is_admin = _matches(given, self.admin_keys)
            if not is_admin and not _matches(given, self.keys):
                return problem(401, "invalid X-API-Key", "X-API-Key", "unauthorized")
            if not admin or is_admin:
                return None
            if self.admin_keys:
                return problem(403, f"{route} needs an admin key (NEXTSTEP_ADMIN_KEYS); "
                                    "this key has no admin role", "X-API-Key", "forbidden")
        client = scope.get("client")
        if is_loopback(client[0] if client else None):
            return None
        return problem(403, f"{route} is an admin route: with NEXTSTEP_ADMIN_KEYS unset it "
                            "is served to loopback clients only; set NEXTSTEP_ADMIN_KEYS and send one as X-API-Key",
                       "NEXTSTEP_ADMIN_KEYS", "forbidden")

    def is_admin(self, scope) -> bool:
        return self.check(scope, dict(scope["headers"]).get(b"x-api-key"), admin=True) is None  # (as __call__ reads it)


# what of a state store's message is withheld from clients that are not admins: where the store is (URLs, host:port,
# addresses); what went wrong (READONLY, a timeout, a certificate) stays
_STORE_AT = re.compile(r" at (?:rediss?|unix)(?:\+\w+)?://\S*?(?=:? |$)")
_ADDRESS = re.compile(r"\b(?:rediss?|unix)(?:\+\w+)?://\S*|\(\s*'[^']*',\s*\d+[^)]*\)|\[[0-9A-Fa-f:.]+\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|(?<![\w.])[A-Za-z][\w.-]*:\d{2,5}\b")


def _store_fault(exc: Exception, details: bool) -> str:
    """A state store's failure as a 503 says it: the exception's message, without where the store is unless
    `details` (an admin)."""
    text = str(exc) or type(exc).__name__
    return text if details else _ADDRESS.sub("(address withheld)", _STORE_AT.sub("", text))


class _Throttled:
    """A warning logged at most once per `every` seconds, with a count of those held back (a Redis outage fails
    every request: one line each would flood the log)."""

    def __init__(self, every: float = 10.0):
        self.every, self.next, self.held = every, 0.0, 0

    def warning(self, message: str, *args) -> None:
        now = time.monotonic()
        if now < self.next:
            self.held += 1
            return
        if self.held:
            message, args = message + " (and %d more since the last such line)", (*args, self.held)
        log.warning(message, *args)
        self.next, self.held = now + self.every, 0


def _too_large(limit: int) -> JSONResponse:
    return problem(413, f"request body over {limit} bytes", "body", "too-large")


# what pydantic adds to an error's location for the member of a union it tried (`IdText | Int64`: one error for
# "constrained-str" and one for "constrained-int"): a validator's name, never a field of the API (snake_case)
_UNION_MEMBER = re.compile(r"[a-z]+(-[a-z]+)+(\[.*\])?|[a-z]+\[.*\]|str|int|float|bool|bytes|none", re.S)


def _field(loc, kind: str = "", member: list | None = None) -> str | None:
    """A validation error's location as one field name: ("body", "events", 0, "response") -> events[0].response;
    ("body",), the body as a whole -> body. A union member's name is left out (events[0].question_id, not
    events[0].question_id.constrained-str; `member` gets it), but not the name of an unknown key (`kind`
    extra_forbidden), which is the client's own."""
    parts = list(loc or ())
    if len(parts) > 1 and parts[0] in ("body", "path", "query", "header"):
        parts = parts[1:]
    own = len(parts) - 1 if kind == "extra_forbidden" else len(parts)
    name = ""
    for n, p in enumerate(parts):
        if isinstance(p, int):
            name += f"[{p}]"
        elif 0 < n < own and _UNION_MEMBER.fullmatch(p):
            if member is not None:
                member.append(p)
        else:
            name += f".{p}" if name else str(p)
    return name or None


def _one_per_field(listed: list[dict], members: list[list]) -> list[dict]:
    """The errors of one union's members (consecutive, on the same field) as one: the error of the members
    that took the value's type (a string too long: the string member's), or else what each member expected
    ("Input should be a valid string or a valid integer")."""
    merged, i = [], 0
    while i < len(listed):
        j = i + 1
        while members[i] and j < len(listed) and members[j] and listed[j]["field"] == listed[i]["field"]:
            j += 1
        group = listed[i:j]
        fitting = [e for e in group if not (e["type"].endswith("_type") or e["type"] == "none_required")]
        if len(group) == 1:
            merged.append(group[0])
        elif fitting:
            merged.append({**fitting[0], "message": "; ".join(dict.fromkeys(e["message"] for e in fitting))})
        else:
            wanted = dict.fromkeys(e["message"].removeprefix("Input should be ") for e in group)
            merged.append({**group[0], "message": "Input should be " + " or ".join(wanted)})
        i = j
    return merged


def _validation_problem(errors: list[dict]) -> JSONResponse:
    """FastAPI's validation errors as one problem document: `detail` and `field` from the first, every one under
    `errors` as {field, message, type}, one per field of a union (`_one_per_field`). The inputs are never echoed
    (an id may be megabytes long)."""
    members = [[] for _ in errors]  # each error's union members, if any
    listed = [{"field": _field(e.get("loc"), str(e.get("type", "")), member), "message": str(e.get("msg", "")),
               "type": str(e.get("type", ""))} for e, member in zip(errors, members, strict=True)]
    listed = _one_per_field(listed, members)
    first = listed[0] if listed else {"field": None, "message": "invalid request"}
    detail = f"{first['field']}: {first['message']}" if first["field"] else first["message"]
    return problem(422, detail, first["field"], "invalid-request", errors=listed)


class ServiceMiddleware:
    """The service's one middleware, as plain ASGI: API keys and roles (`access`), the body size limit, request
    metrics, and the app's exception handlers (errors.py's table, FastAPI's for HTTPException and validation).
    The metrics' route and model come from what the router set on this same scope (the route's template, its
    path parameter). Exceptions are mapped here, in place of Starlette's ExceptionMiddleware (`Service`): the
    routes' own handling reads the same tables from the scope, as Starlette's routes do."""

    def __init__(self, app, *, settings: Settings, metrics: Metrics, handlers: dict, access: Access | None = None):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.access = access or Access(settings)
        self.classes = {k: v for k, v in handlers.items() if isinstance(k, type)}
        self.statuses = {k: v for k, v in handlers.items() if isinstance(k, int)}

    async def refuse(self, response, scope, receive, send) -> None:
        """Answer a request refused before routing (key, role, size, pin), counted under route "refused"."""
        await response(scope, receive, send)
        self.metrics.request_done("refused", "", response.status_code, 0.0)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        if scope["path"] not in OPEN_PATHS:
            admin = admin_route(scope["method"], scope["path"])
            if admin or self.access.on:
                refused = self.access.check(scope, headers.get(b"x-api-key"), admin)
                if refused is not None:
                    return await self.refuse(refused, scope, receive, send)
        limit = self.settings.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            return await self.refuse(_too_large(limit), scope, receive, send)
        if length is None and scope["method"] in ("POST", "PUT", "PATCH"):  # chunked: buffer within the limit
            chunks, size, more = [], 0, True
            while more:
                message = await receive()
                if message["type"] != "http.request":  # the client went away (or timed out) mid-body: a part of
                    return  # a body is no request, so nothing is applied and there is no one to answer
                chunks.append(message.get("body", b""))
                size += len(chunks[-1])
                more = message.get("more_body", False)
                if size > limit:
                    return await self.refuse(_too_large(limit), scope, receive, send)
            body = b"".join(chunks)

            async def receive():  # noqa: F811 - replay the buffered body
                return {"type": "http.request", "body": body, "more_body": False}

        if "\ufffd" in scope["path"]:
            refused = _undecodable(scope)
            if refused is not None:
                return await self.refuse(refused, scope, receive, send)
        raw = scope.get("raw_path")
        if raw is not None and 37 in raw:  # a "%" (an int: memchr; a bytes needle costs about a microsecond)
            refused = _slashed_model(scope)
            if refused is not None:
                return await self.refuse(refused, scope, receive, send)
        pin = headers.get(b"x-model-version")
        if pin is not None:  # (one dict lookup on the fast path; the pin's work only when there is one)
            refused = _pin(scope, pin)
            if refused is not None:
                return await self.refuse(refused, scope, receive, send)
        status = None

        async def send_and_record(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics = self.metrics
        metrics.serving += 1
        start = time.perf_counter()
        scope["starlette.exception_handlers"] = (self.classes, self.statuses)  # read by the routes' own handling
        try:
            await self.app(scope, receive, send_and_record)
        except Exception as exc:
            handler = self.statuses.get(exc.status_code) if isinstance(exc, HTTPException) else None
            handler = handler or next((self.classes[c] for c in type(exc).__mro__ if c in self.classes), None)
            if handler is None or status is not None:  # a bug, or too late to answer: ServerErrorMiddleware's 500
                raise
            response = handler(Request(scope, receive), exc)
            response = await response if inspect.isawaitable(response) else response
            await response(scope, receive, send_and_record)
            exc.__traceback__ = None  # (an exception instance raised again must not grow its traceback)
        finally:
            metrics.serving -= 1
            route = scope.get("route")  # set by the router on this same scope
            template = getattr(route, "path", "unmatched")
            model = scope.get("path_params", {}).get("model", "") if route is not None else ""
            metrics.request_done(template, model, status or 500, time.perf_counter() - start)


class Service(FastAPI):
    """FastAPI with a shorter middleware stack: Starlette's ServerErrorMiddleware (the last-resort 500), then
    `ServiceMiddleware`, then any middleware added with `add_middleware`, then the router. FastAPI's own stack
    also has Starlette's ExceptionMiddleware (ServiceMiddleware maps exceptions instead), an exit stack for
    closing uploaded files (every API route is a `JsonRoute`, which opens one where FastAPI's handling needs it,
    off the fast path: tests/service/test_app.py), and two layers that do nothing in this configuration (native
    OpenTelemetry when off, FastAPI's body limit when unset, which ServiceMiddleware enforces). Together those
    layers cost 10-15% of KT events throughput at 32 connections (docs/decisions.md)."""

    def build_middleware_stack(self):
        handlers = {k: v for k, v in self.exception_handlers.items() if k not in (500, Exception)}
        app = self.router
        for cls, args, kwargs in reversed(self.user_middleware):
            app = cls(app, *args, **kwargs)
        app = ServiceMiddleware(app, settings=self.state.settings, metrics=self.state.metrics, handlers=handlers,
                                access=self.state.access)
        last_resort = self.exception_handlers.get(500) or self.exception_handlers.get(Exception)
        return ServerErrorMiddleware(app, handler=last_resort, debug=self.debug)


async def reload_models(app: FastAPI) -> LoadReport:
    """Rescan the artifacts directory (in a worker thread), update the metrics, prepare the banks: what
    `POST /v1/models/reload` does, and what every other replica does when it sees the reload generation move
    (fleet.py)."""
    registry, metrics = app.state.registry, app.state.metrics
    report: LoadReport = await asyncio.to_thread(registry.reload)
    metrics.set_models(registry.models())
    metrics.set_refused(registry.report.refused)  # (the registry's newest: reloads may overlap)
    metrics.reloads.labels("refused" if report.refused else "ok").inc()
    await app.state.tracer.banks.prepare(registry.models())
    return report


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


class MigrateRequest(Strict):
    version: Annotated[IdText, Field(description="the version to bring up to date (default: the latest)")] = "latest"
    cursor: Annotated[IdText, Field(description="\"0\" to start; then the cursor of the previous answer")] = "0"
    limit: Annotated[StrictInt, Field(ge=1, le=5000, description="entities in this page (about)")] = 500

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"version": "2", "cursor": "0"}]})


class RolloutRequest(Strict):
    candidate: Annotated[IdText, Field(description="the version to try (a loaded one)")]
    mode: Annotated[Literal["canary", "shadow"], Field(
        description="canary: the candidate answers the entities in the fraction; shadow: it answers no one, and its "
                    "own state of each entity in the fraction follows their events, scored for live quality")
    ] = "canary"
    fraction: Annotated[float, Field(ge=0, le=1, description="share of the model's entities the candidate "
                                                             "answers, chosen by a hash of their id")]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"candidate": "2", "mode": "canary", "fraction": 0.1}]})


def stateful_task(app: FastAPI, task: str) -> StatefulTask | None:
    """The service of a task whose entities have event logs (knowledge tracing, sessions); None for flashcards."""
    return {"knowledge_tracing": app.state.tracer, "next_item": app.state.sessions}.get(task)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    metrics = Metrics()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        registry = ModelRegistry(settings.artifacts_dir, intra_op_threads=settings.ort_threads,
                                 new_versions=settings.new_versions)
        metrics.set_refused(registry.reload().refused)  # (the registry logs each refusal)
        metrics.set_models(registry.models())
        # one Redis client for the three state stores (its connections pipeline or pool their requests), one for
        # the banks (megabytes each, a longer timeout); the URL chooses one node, a cluster or Sentinel
        options = settings.redis_options()
        redis = connect(settings.redis_url, options) if settings.redis_url else None
        store = make_store(None, client=redis, ttl_seconds=settings.state_ttl_seconds,
                           max_event_ids=settings.max_event_ids, log=settings.log_bounds())
        engines = Engines(settings.max_batch, settings.max_wait_ms, metrics.on_batch)
        banks = Banks(make_bank_store(settings.redis_url, options), refresh_seconds=settings.bank_refresh_seconds)
        await banks.prepare(registry.models())  # publish the artifacts' bank versions, project the active ones
        app.state.registry, app.state.store = registry, store
        quality = app.state.quality = Quality(redis, on_record=metrics.on_live_scores,
                                              on_drop=lambda model: metrics.live_unscored.labels(model).inc())
        await quality.start()
        app.state.tracer = KnowledgeTracer(registry, TimedStore(store, metrics), engines,
                                           quality=quality if settings.live_quality else None,
                                           cas_retries=settings.cas_retries, banks=banks,
                                           limits=settings.batch_limits(),
                                           on_retry=lambda m: metrics.cas_retries.labels(m.name).inc(),
                                           unknown_questions=settings.unknown_questions,
                                           on_unknown=metrics.on_unknown)
        # sessions expire much sooner than learners: their own store (same Redis, its own TTL)
        session_store = make_store(None, client=redis, ttl_seconds=settings.session_ttl_seconds,
                                   max_event_ids=settings.max_event_ids, log=settings.log_bounds())
        app.state.sessions = SessionRecommender(registry, TimedStore(session_store, metrics), engines,
                                                quality=quality if settings.live_quality else None,
                                                cas_retries=settings.cas_retries, limits=settings.batch_limits(),
                                                cold_start_model=settings.cold_start_model,
                                                on_retry=lambda m: metrics.cas_retries.labels(m.name).inc(),
                                                unknown_items=settings.unknown_questions,
                                                on_unknown=metrics.on_unknown)
        # spaced-repetition users keep their reviews for years: their own store and TTL (two years idle by default)
        srs_store = make_store(None, client=redis, ttl_seconds=settings.srs_ttl_seconds or None,
                               max_event_ids=settings.max_event_ids)
        app.state.srs = SpacedRepetition(registry, TimedStore(srs_store, metrics), engines,
                                         quality=quality if settings.live_quality else None,
                                         cas_retries=settings.cas_retries,
                                         max_interval_days=settings.srs_max_interval_days,
                                         refit_min_scored=settings.srs_refit_min_scored,
                                         refit_every_scored=settings.srs_refit_every_scored,
                                         on_retry=lambda m: metrics.cas_retries.labels(m.name).inc())
        # rollouts (which version serves, a canary's candidate) are the fleet's, in Redis, followed by every replica
        rollouts = app.state.rollouts = Rollouts(redis, refresh_seconds=settings.reload_refresh_seconds)
        shadow_workers = []
        app.state.srs.rollouts = rollouts  # (canaries; a shadow needs a state of its own, which flashcards lack)
        for task in (app.state.tracer, app.state.sessions):
            task.rollouts = rollouts
            task.on_shadow = lambda model, outcome: metrics.shadow.labels(model, outcome).inc()
            shadow_workers.append(asyncio.create_task(task.run_shadows(settings.shadow_queue)))
        # (in a thread: set_serving waits for a reload in progress, which takes seconds)
        await rollouts.start(lambda current: asyncio.to_thread(
            registry.set_serving, {m: r.serving for m, r in current.items()}))
        # a reload on any replica reaches the others sharing this Redis within NEXTSTEP_RELOAD_REFRESH_SECONDS
        app.state.fleet = FleetReloads(redis, refresh_seconds=settings.reload_refresh_seconds)
        await app.state.fleet.start(lambda: reload_models(app))
        yield
        await app.state.fleet.close()
        await rollouts.close()
        for worker in shadow_workers:
            worker.cancel()
        await asyncio.gather(*shadow_workers, return_exceptions=True)
        await quality.close()
        await engines.close()
        await banks.close()
        await store.close()
        await session_store.close()
        await srs_store.close()
        if redis is not None:
            await redis.close()

    # FastAPI's native OpenTelemetry looks for a configured provider on every request (about 5 us) even when
    # there is none; the service's own metrics are Prometheus (/metrics), so it is on only when asked for
    otel = settings.opentelemetry
    app = Service(title="NextStep", version="0.1.0", lifespan=lifespan,
                  telemetry={"tracing": otel, "metrics": otel, "logs": otel}, docs_url=None, redoc_url=None,
                  description="Predicts what a learner does next, from state kept per learner: knowledge tracing "
                              "(the response to a question), next-item sessions (the next click) and flashcards (a "
                              "review's rating, recall and answer time, and when to review).")
    app.state.settings, app.state.metrics = settings, metrics
    access = app.state.access = Access(settings)
    store_faults = _Throttled()
    app.router.route_class = JsonRoute  # the system routes below too (Service's stack relies on it)
    # the task routes go first in the app's own route list: FastAPI's include_router would nest a router that
    # matches every request a second time, and the docs routes ahead of them would be tried on every request
    # (together about 20 us a request); these routers carry no settings of their own
    app.router.routes[:0] = [r for m in (kt_routes, session_routes, srs_routes) for r in m.router.routes]

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return _validation_problem(exc.errors())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # the router's 404 and 405, and routes' own
        return problem(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def failed(request: Request, exc: Exception):  # errors.py: each error's status, field and kind
        cls = next(c for c in type(exc).__mro__ if c in STATUS)
        status = STATUS[cls]
        if status != 503:
            return problem(status, str(exc), exc.field, KIND[cls])
        store_faults.warning("state store unavailable: %s", exc)  # where it is: the log and admins only
        detail = _store_fault(exc, access.is_admin(request.scope))
        return problem(status, f"state store unavailable: {detail}", exc.field, KIND[cls])

    for error in STATUS:
        app.add_exception_handler(error, failed)

    async def internal(request: Request, exc: Exception):  # the last resort (ServerErrorMiddleware): no details out
        return problem(500, "internal error; the service's log has the details")

    app.add_exception_handler(500, internal)

    def openapi() -> dict:  # FastAPI's document, completed once (openapi.py): errors, security, statuses
        if app.openapi_schema is None:
            app.openapi_schema = complete(FastAPI.openapi(app), OPEN_PATHS)
        return app.openapi_schema

    app.openapi = openapi
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")  # (behind a proxy that serves the app under a prefix)
        return get_swagger_ui_html(openapi_url=root + app.openapi_url, title=f"{app.title} - Swagger UI",
                                   swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
                                   swagger_ui_parameters={"validatorUrl": None})  # (its default is online)

    @app.get("/redoc", include_in_schema=False)
    async def redoc(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_redoc_html(openapi_url=root + app.openapi_url, title=f"{app.title} - ReDoc",
                              redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
                              redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png", with_google_fonts=False)

    @app.get("/healthz", tags=["system"], summary="The process is alive")
    async def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz", tags=["system"], summary="Models loaded and the state store reachable; refused artifacts")
    async def readyz(request: Request):  # (open: clients that are not admins see no paths or library messages)
        registry = request.app.state.registry
        models = registry.models()
        details = access.is_admin(request.scope)
        try:
            await asyncio.wait_for(request.app.state.store.ping(), timeout=2.0)
        except (StoreUnavailable, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                exc = StoreUnavailable("no answer to PING within 2 s")
            store_faults.warning("not ready: state store unavailable: %s", exc)
            return problem(503, f"state store unavailable: {_store_fault(exc, details)}")
        refused = [r.as_dict(details) for r in registry.report.refused]
        if not models:
            where = settings.artifacts_dir if details else "the artifacts directory (NEXTSTEP_ARTIFACTS_DIR)"
            return problem(503, f"no model loaded from {where}", refused=refused)
        # refused artifacts do not make a replica unready: what serves, serves (docs/decisions.md)
        return {"status": "ready", "models": len(models), "serving": registry.report.serving, "refused": refused}

    @app.get("/metrics", tags=["system"], summary="Prometheus metrics", response_class=PlainTextResponse)
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", tags=["system"], summary="Loaded models: names, versions, tasks, held-out metrics")
    async def models(request: Request) -> dict:
        registry = request.app.state.registry
        latest = registry.latest()
        details = access.is_admin(request.scope)  # (as /readyz: the refusals' paths and messages for admins)
        report = registry.report
        return {"models": [{"name": m.name, "version": m.version, "latest": latest.get(m.name) is m, "family": m.family,
                            "task": m.task, "n_cats": m.n_cats, "vocabulary": len(m.ids),
                            **({"window": {"size": m.window[0], "card_size": m.window[1]}} if m.window[0] else {}),
                            "metrics": m.manifest.get("metrics", {}).get("test", {})} for m in registry.models()],
                "refused": [r.as_dict(details) for r in report.refused],
                "errors": report.errors if details else report.summaries()}

    @app.get("/v1/models/{model}/ids", tags=["system"],
             summary="The ids a model knows (questions or items), a page at a time, and the version answering",
             responses=answer({"model": "deep_gpcm", "version": "2", "task": "knowledge_tracing",
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

    @app.get("/v1/models/{model}/quality", tags=["system"],
             summary="Live quality of each version: its predictions scored on the events that followed",
             description="Knowledge tracing: for every event with a response, the prediction the version would "
                         "have made for it from the learner's state before it, scored when the event came: the mean "
                         "log loss and Brier score, the AUC of P(full credit) estimated from 200 buckets, and a "
                         "calibration table (predicted against observed share of full credit). Sessions: each "
                         "click after a session's first, ranked in the list the state before it recommends (every "
                         "item a candidate): `mrr` and `hit_rate` at 1, 5, 10 and 20. Flashcards: each scored review's "
                         "P(recall) from the user's reviews before it, as for knowledge tracing. Over the last "
                         "`window` seconds, every replica's scores added.",
             responses=answer({"model": "deep_gpcm", "task": "knowledge_tracing", "window_seconds": 3600, "versions": [
                 {"version": "2", "role": "serving", "scored": 1200, "log_loss": 0.512, "brier": 0.331,
                  "auc": 0.781, "calibration": [{"from": 0.0, "to": 0.1, "count": 40, "predicted": 0.06,
                                                 "observed": 0.05}], "since": 1767225600.0}]}, 404))
    async def quality(request: Request, model: Annotated[str, PathParam(description="model name")],
                      window: Annotated[int, Query(ge=60, le=90 * 86400, description="seconds back from now "
                                                   "(minute buckets up to 6 hours, hour buckets past it)")] = 3600
                      ) -> dict:
        registry = request.app.state.registry
        latest = registry.get(model)
        rollout = request.app.state.rollouts.current.get(latest.name)
        versions = [(m.version, rollout.mode if rollout and rollout.candidate == m.version and rollout.mode
                     else "serving") for m in registry.models() if m.name == latest.name]
        return {"model": latest.name, "task": latest.task, "window_seconds": window,
                "versions": await request.app.state.quality.report(latest.name, versions, window, latest.task)}

    def rollout_answer(request: Request, name: str) -> dict:
        registry = request.app.state.registry
        latest = registry.get(name)
        rollout = request.app.state.rollouts.current.get(latest.name)
        return {"model": latest.name, "serving": latest.version, "new_versions": settings.new_versions,
                "candidate": rollout.candidate if rollout else None, "mode": rollout.mode if rollout else None,
                "fraction": rollout.fraction if rollout and rollout.candidate else None,
                "updated": rollout.updated if rollout else None,
                "versions": sorted(m.version for m in registry.models() if m.name == latest.name)}

    ROLLOUT_EXAMPLE = {"model": "deep_gpcm", "serving": "1", "new_versions": "manual", "candidate": "2",
                       "mode": "canary", "fraction": 0.1, "updated": 1767225600.0, "versions": ["1", "2"]}

    @app.get("/v1/models/{model}/rollout", tags=["system"], summary="Which version serves, and a candidate's rollout",
             responses=answer(ROLLOUT_EXAMPLE, 404))
    async def get_rollout(request: Request, model: Annotated[str, PathParam(description="model name")]) -> dict:
        return rollout_answer(request, model)

    @app.put("/v1/models/{model}/rollout", tags=["system"],
             summary="Put a candidate version on a stable fraction of the model's entities (canary)",
             description="Learners, sessions or users whose hash falls in the fraction get the candidate, on every "
                         "replica (within NEXTSTEP_RELOAD_REFRESH_SECONDS) and every request; raising the fraction "
                         "only adds entities. Their states move between versions through the event log, so no "
                         "learner loses history either way. Every answer names the version that answered.",
             responses=answer(ROLLOUT_EXAMPLE, 404, 422))
    async def put_rollout(request: Request, model: Annotated[str, PathParam(description="model name")],
                          body: RolloutRequest) -> dict:
        registry, rollouts = request.app.state.registry, request.app.state.rollouts
        latest = registry.get(model)
        if settings.new_versions != "manual":
            raise InvalidInput("model", "rollouts need NEXTSTEP_NEW_VERSIONS=manual: with auto, a new version "
                                        "serves everyone at the reload that loads it")
        if latest.task == "srs" and body.mode == "shadow":
            raise InvalidInput("mode", f"model {latest.name} is a flashcard model: its versions share each user's "
                                       "stored reviews and keep no state of their own to shadow; use a canary")
        try:
            registry.get(latest.name, body.candidate)
        except UnknownModel as exc:
            raise InvalidInput("candidate", str(exc)) from None
        rollout = rollouts.current.get(latest.name)
        serving = rollout.serving if rollout else latest.version
        if body.candidate == serving:
            raise InvalidInput("candidate", f"version {body.candidate} is the one serving {latest.name}")
        await rollouts.put(latest.name, Rollout(serving, body.candidate, body.mode, body.fraction))
        return rollout_answer(request, latest.name)

    @app.post("/v1/models/{model}/rollout/promote", tags=["system"],
              summary="Make the candidate the version serving every entity", responses=answer(ROLLOUT_EXAMPLE, 404,
                                                                                             422))
    async def promote_rollout(request: Request, model: Annotated[str, PathParam(description="model name")]) -> dict:
        latest = request.app.state.registry.get(model)
        rollout = request.app.state.rollouts.current.get(latest.name)
        if rollout is None or rollout.candidate is None:
            raise InvalidInput("model", f"model {latest.name} has no candidate to promote (PUT a rollout first)")
        await request.app.state.rollouts.put(latest.name, Rollout(rollout.candidate))
        return rollout_answer(request, latest.name)

    @app.delete("/v1/models/{model}/rollout", tags=["system"],
                summary="Abort a rollout: the candidate serves no one; the serving version stays",
                responses=answer(ROLLOUT_EXAMPLE, 404))
    async def abort_rollout(request: Request, model: Annotated[str, PathParam(description="model name")]) -> dict:
        latest = request.app.state.registry.get(model)
        rollout = request.app.state.rollouts.current.get(latest.name)
        if rollout is not None and rollout.candidate is not None:
            await request.app.state.rollouts.put(latest.name, Rollout(rollout.serving))
        return rollout_answer(request, latest.name)

    @app.post("/v1/models/{model}/migrate", tags=["system"],
              summary="Bring a page of entities' state for a version up to date with their event logs",
              description="Each entity of the page (learners, sessions) gets its state for the version rebuilt "
                          "from its event log, as its first request to that version would, so that no request "
                          "waits for it after `latest` moves. Call again with the answer's `cursor` until "
                          "`done`: each call is one page, so the caller sets the pace, and a walk can stop and "
                          "resume anywhere; it is safe while serving, from any replica. Flashcard models need "
                          "none: their versions share their users' stored reviews.",
              responses=answer({"model": "deep_gpcm", "version": "2", "cursor": "1792", "done": False,
                                "entities": 500, "rebuilt": 496, "events": 61390, "lagging": 0}, 404, 422))
    async def migrate(request: Request, model: Annotated[str, PathParam(description="model name")],
                      body: MigrateRequest) -> dict:
        m = request.app.state.registry.get(model, body.version)
        task = stateful_task(request.app, m.task)
        if task is None:
            raise InvalidInput("model", f"model {m.name} is a {m.task} model: its versions share their users' "
                                        "stored reviews, there is nothing to migrate")
        try:
            return await task.migrate(m, body.cursor, body.limit)
        except ValueError as exc:
            raise InvalidInput("cursor", f"{exc}: pass \"0\" to start, then each answer's cursor") from None

    @app.post("/v1/models/reload", tags=["system"],
              summary="Rescan the artifacts directory, here and (through Redis) on every replica (409: refused)",
              responses={409: {"description": "artifacts refused: each named with its reason; what served before "
                                              "keeps serving (the other artifacts were loaded)",
                               "content": {"application/problem+json": {}}}})
    async def reload(request: Request):
        registry = request.app.state.registry
        report = await reload_models(request.app)
        # the other replicas on this Redis follow within NEXTSTEP_RELOAD_REFRESH_SECONDS; null: not told
        # (no Redis, or it failed: the log says so)
        generation = await request.app.state.fleet.announce()
        details = access.is_admin(request.scope)  # (an admin route: always, as the rules stand)
        answer = {"models": [f"{m.name}/{m.version}" for m in registry.models()], "serving": report.serving,
                  "withdrawn": list(report.withdrawn), "refused": [r.as_dict(details) for r in report.refused],
                  "fleet_generation": generation}
        if not report.refused:
            return {**answer, "errors": {}}
        # the detail names each artifact and the kind of fault; the paths and messages are in `refused` and the log
        named = "; ".join(f"{r.model}/{r.version}: {r.summary} ({r.outcome})" for r in report.refused)
        return problem(409, f"{len(report.refused)} artifact(s) refused, the rest loaded: {named}", None,
                       "artifact-refused", **answer)

    return app
