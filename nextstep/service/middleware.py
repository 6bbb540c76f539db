"""The service's middleware: one plain ASGI layer (`ServiceMiddleware`) in a short stack (`Service`).

Before routing, a request is checked in this order: its API key and role (access.py), its body's size (413), a
path whose escapes are not UTF-8 (422) or whose `{model}` segment holds an encoded slash (404), and the
X-Model-Version header, which becomes a pin in the path (`name@version`). Then the router; every exception it
raises is mapped to its problem document here (handlers.py), and each request is counted (metrics.py).
"""

import inspect
import time
from urllib.parse import quote, unquote_to_bytes

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.middleware.errors import ServerErrorMiddleware

from .access import Access, admin_route
from .errors import problem, shown
from .metrics import Metrics
from .settings import Settings

# the docs pages' scripts, styles and icon, served from the fastapi-offline package (no CDN: /docs works offline)
DOCS_ASSETS, DOCS_FILES = "/docs/assets", ("swagger-ui-bundle.js", "swagger-ui.css", "redoc.standalone.js",
                                           "favicon.png")
OPEN_PATHS = {"/healthz", "/readyz", "/metrics", "/docs", "/openapi.json", "/redoc",
              *(f"{DOCS_ASSETS}/{name}" for name in DOCS_FILES)}
PIN_HEADER = "X-Model-Version"
PINNED = frozenset({"models"})  # /v1/models/{model}/...; create_app adds each task's prefix (tasks.py)


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


def _slashed_model(scope, pinned: frozenset[str]):
    """A 404 for a path whose `{model}` segment holds an encoded slash (`/v1/sessions/a%2Fb/events`), else None.
    The router sees the decoded path, where "a/b" is two segments: a route with an id of several segments would
    take it (`/v1/sessions/{model}/{session_id:path}`: model "a", session "b/events", and so a 405 for a POST). No
    model name holds a '/' (it is a directory). Called only when the raw path holds a percent-escape."""
    parts = scope.get("raw_path", b"").split(b"?", 1)[0].split(b"/")
    if len(parts) < 4 or parts[1] != b"v1" or parts[2].decode("latin-1") not in pinned:
        return None
    if b"%2f" not in parts[3].lower():
        return None
    name = unquote_to_bytes(parts[3]).decode("utf-8", "replace")
    return problem(404, f"no model {shown(name)}: a model name holds no '/' (the path's model segment has an encoded "
                        "slash, %2F)", "model", "unknown-model")


def _pin(scope, version: bytes, pinned: frozenset[str]):
    """X-Model-Version: the path's `{model}` segment becomes `name@version`, before routing, so that the routes,
    the metrics and the registry see one form of a pin. None, or the problem to answer: a malformed version, or
    one that contradicts a pin in the path."""
    parts = scope["path"].split("/")
    if len(parts) < 5 or parts[1] != "v1" or parts[2] not in pinned:
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


def _too_large(limit: int) -> JSONResponse:
    return problem(413, f"request body over {limit} bytes", "body", "too-large")


class ServiceMiddleware:
    """The service's one middleware, as plain ASGI: API keys and roles (`access`), the body size limit, request
    metrics, and the app's exception handlers (errors.py's table, FastAPI's for HTTPException and validation).
    The metrics' route and model come from what the router set on this same scope (the route's template, its
    path parameter). Exceptions are mapped here, in place of Starlette's ExceptionMiddleware (`Service`): the
    routes' own handling reads the same tables from the scope, as Starlette's routes do."""

    def __init__(self, app, *, settings: Settings, metrics: Metrics, handlers: dict, access: Access | None = None,
                 pinned: frozenset[str] = PINNED):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.access = access or Access(settings)
        self.pinned = pinned  # /v1/<prefix>/{model}/...: the paths X-Model-Version pins (every task's, and models)
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
            refused = _slashed_model(scope, self.pinned)
            if refused is not None:
                return await self.refuse(refused, scope, receive, send)
        pin = headers.get(b"x-model-version")
        if pin is not None:  # (one dict lookup on the fast path; the pin's work only when there is one)
            refused = _pin(scope, pin, self.pinned)
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
                                access=self.state.access, pinned=self.state.pinned)
        last_resort = self.exception_handlers.get(500) or self.exception_handlers.get(Exception)
        return ServerErrorMiddleware(app, handler=last_resort, debug=self.debug)
