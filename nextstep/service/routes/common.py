"""What every route module shares: path ids, the per-request size limits, the answers and errors routes declare,
and `JsonRoute`, the route class of every route (the fast path of routes that take a JSON body)."""

import asyncio
import contextlib
import email.message
import functools
import re
import time
from collections.abc import Sequence

from fastapi import Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from pydantic_core import to_json

from ..errors import InvalidInput, TooLarge, UnsupportedMediaType
from ..schemas import MAX_ID


def path_id(what: str) -> Path:
    """An id as the last path segment(s) of a route (declared `{name:path}`, so an id may hold "/")."""
    return Path(min_length=1, max_length=MAX_ID,
                description=f"the {what} id, 1 to {MAX_ID} characters, percent-encoded (org/42 -> org%2F42)")


# what each error status of the API means; routes list theirs with `problems(...)`, and openapi.py adds 401 to
# every protected route and 413, 415 and 422 to every route that takes a body
PROBLEMS = {
    401: "Missing or invalid X-API-Key header (when the service has API keys).",
    404: "No loaded model of that name for this task.",
    409: "Other writers to the same entity kept winning the compare-and-set; retrying is safe.",
    413: "The body is over the size limit, or a list has more items than a request may.",
    415: "The Content-Type header is missing or not application/json.",
    422: "The request is not valid: `field` names the offending one (every fault under `errors`); invalid JSON, "
         "unknown ids and values the model cannot take are 422 too.",
    503: "The state store is unavailable; `type` says what became of the request. "
         "`urn:nextstep:problem:store-unavailable`: the store could not be reached, or refused the operation; "
         "nothing was changed: retry later. `urn:nextstep:problem:outcome-unknown`: a write was sent, and the store "
         "stopped answering before confirming it; it may have been applied, or may still be. Repeat the same "
         "request: events with an `event_id` are applied at most once, events without one may be applied twice "
         "(repeating a DELETE is safe).",
}


def problems(*statuses: int) -> dict:
    """A route's `responses`: each status with what it means (openapi.py gives each the Problem schema)."""
    return {status: {"description": PROBLEMS[status]} for status in statuses}


def answer(model: type[BaseModel], example: dict, *statuses: int) -> dict:
    """A route's `responses`: its 200 answer's schema (`model`, declared for the OpenAPI document only: the answer
    is not validated against it, schemas.py) with an example, and `problems(*statuses)`. Every route is a
    JsonRoute, whose answers FastAPI neither validates nor describes by a schema of its own."""
    return {200: {"model": model, "description": "Successful Response",
                  "content": {"application/json": {"example": example}}}, **problems(*statuses)}


def too_many(field: str, n: int, limit: int) -> None:
    if n > limit:
        raise TooLarge(field, f"{n} items; at most {limit} per request")


def not_ahead(request: Request, times: Sequence[float | None], field: str) -> None:
    """A 422 naming the first of a request's `times` (unix seconds; None: not given) that is more than
    NEXTSTEP_MAX_CLOCK_SKEW_SECONDS ahead of the server's clock, as `field.format(i=its position)`. Such a time is a
    clock or unit error, and a review at it would refuse every later review at the right time (they are kept in
    time order). Times a request asks about (a prediction's, a schedule's `now`) may be any: they record nothing."""
    skew = request.app.state.settings.max_clock_skew_seconds
    now = time.time()
    for i, value in enumerate(times):
        if value is not None and value > now + skew:
            raise InvalidInput(field.format(i=i), f"{value!r} is {value - now:.0f} s ahead of the server's clock "
                                                  f"({now:.0f}); at most {skew:g} s is taken "
                                                  "(NEXTSTEP_MAX_CLOCK_SKEW_SECONDS): times are unix seconds")


def _json(content_type: str | None) -> bool:
    """Whether a body of this content type is JSON: application/json, or application/*+json, with any
    parameters (a missing one: no, on every route)."""
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class JsonRoute(APIRoute):
    """A route whose JSON body skips FastAPI's request machinery (request objects, exit stacks, dependency
    solving, validation of a parsed dict, the response model, jsonable_encoder: about 0.2 ms a request). The
    raw body is validated by pydantic-core in one call against the route's own body model, the endpoint itself
    is called (path parameters as the router matched them, its `Request`, and its dependencies, each an
    `async def` of the request alone), and its answer is encoded by pydantic-core. Errors the endpoint raises
    go to the app's exception handlers, as on the regular path. A body not declared JSON is a 415 and one that
    does not validate a 422 (`invalid`: FastAPI's validation error, with the same fields), with no second parse.
    A route outside this pattern (no body, other parameters) is handled by FastAPI alone, after the same
    content-type check where it takes a body. Every API route of the app is a JsonRoute (app.Service relies
    on it). Its answers are declared in `responses` (`answer`), never validated nor re-encoded by FastAPI: a route
    of this class has no response model unless it names one."""

    def __init__(self, path: str, endpoint, *, response_model=None, **kwargs) -> None:
        # (FastAPI's default would take the endpoint's return annotation, `dict`, as the response model)
        super().__init__(path, endpoint, response_model=response_model, **kwargs)

    async def handle(self, scope, receive, send) -> None:
        plan = self._fast
        content_type = next((v for k, v in scope["headers"] if k == b"content-type"), None)
        if plan is None or scope["method"] not in self.methods:
            if self._takes_body and scope["method"] in self.methods:
                self._check(content_type)
            return await self._regular(scope, receive, send)
        if content_type != b"application/json":  # (what clients send: the one comparison on the fast path)
            self._check(content_type)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        endpoint, body_model, body_name, path_names, request_name, dependencies = plan
        try:
            parsed = body_model.model_validate_json(body)
        except ValidationError as exc:
            raise invalid(exc, body) from None
        request = Request(scope, receive)
        kwargs = {name: scope["path_params"][name] for name in path_names}
        kwargs[body_name] = parsed
        if request_name:
            kwargs[request_name] = request
        for name, call in dependencies:
            kwargs[name] = await call(request)
        payload = to_json(await endpoint(**kwargs))
        await send({"type": "http.response.start", "status": self.status_code or 200,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    @staticmethod
    def _check(content_type: bytes | None) -> None:
        text = content_type.decode("latin-1") if content_type is not None else None
        if not _json(text):
            raise UnsupportedMediaType(text)

    @functools.cached_property
    def _takes_body(self) -> bool:
        return bool(self.dependant.body_params)

    async def _regular(self, scope, receive, send) -> None:
        """FastAPI's own handling, with the exit stack its middleware stack would have put in the scope (it closes
        uploaded files; app.Service's stack has none)."""
        async with contextlib.AsyncExitStack() as files:
            scope["fastapi_middleware_astack"] = files
            await super().handle(scope, receive, send)

    @functools.cached_property
    def _fast(self):
        return self._plan()

    def _plan(self):
        """(endpoint, body model, its parameter, path parameters, request parameter, [(name, dependency)]), or
        None when this route is not one the fast path can call exactly as FastAPI would."""
        d = self.dependant
        if (len(d.body_params) != 1 or d.query_params or d.header_params or d.cookie_params
                or d.response_param_name or d.background_tasks_param_name or d.websocket_param_name
                or d.http_connection_param_name or d.security_scopes_param_name
                or not asyncio.iscoroutinefunction(self.endpoint)):
            return None
        body = d.body_params[0]
        if not (isinstance(body.field_info.annotation, type) and issubclass(body.field_info.annotation, BaseModel)):
            return None
        if any(p.field_info.annotation is not str or p.field_info.metadata for p in d.path_params):
            return None  # a constrained path parameter: FastAPI validates it
        dependencies = []
        for sub in d.dependencies:
            if (sub.path_params or sub.query_params or sub.header_params or sub.cookie_params or sub.body_params
                    or sub.dependencies or not sub.request_param_name or not asyncio.iscoroutinefunction(sub.call)):
                return None
            dependencies.append((sub.name, sub.call))
        return (self.endpoint, body.field_info.annotation, body.name, [p.name for p in d.path_params],
                d.request_param_name, dependencies)


def invalid(exc: ValidationError, body: bytes) -> RequestValidationError:
    """A body's validation error as FastAPI's (locations under "body"); a body that is not JSON at all is one
    error on `body` saying why: empty, not UTF-8, nested too deeply, or where the JSON breaks."""
    errors = exc.errors(include_url=False, include_input=False, include_context=False)
    if errors and errors[0]["type"] == "json_invalid":
        reason = str(exc.errors(include_url=False)[0].get("ctx", {}).get("error", "")) or errors[0]["msg"]
        try:
            body.decode("utf-8")
            utf8 = True
        except UnicodeDecodeError as bad:
            utf8, reason = False, f"the body is not valid UTF-8 (byte {bad.start})"
        if not body.strip():
            message = "the body is empty: expected a JSON object"
        elif not utf8:
            message = reason
        elif "recursion limit" in reason:
            message = f"the JSON is nested too deeply ({reason})"
        elif ("surrogate" in reason or "hex escape" in reason) and (lone := _lone_surrogate(body.decode())):
            message = lone
        else:
            message = f"the body is not valid JSON: {reason}"
        return RequestValidationError([{"loc": ("body",), "msg": message, "type": "json_invalid"}])
    return RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors])


_ESCAPE = re.compile(r"\\(?:u([0-9a-fA-F]{4})|.)", re.S)  # a JSON string's escapes, \\ among them


def _lone_surrogate(text: str) -> str | None:
    """Where a JSON text first escapes half of a UTF-16 surrogate pair without its other half (a \\ud800-\\udbff
    escape not followed by a \\udc00-\\udfff one, or the second kind alone), in words; None if it does not.
    pydantic-core (jiter) refuses such a string with "unexpected end of hex escape" or "lone leading surrogate"."""
    high = None  # a first half, waiting for its second
    for m in _ESCAPE.finditer(text):
        code = int(m.group(1), 16) if m.group(1) else -1
        if high is not None and not (0xDC00 <= code <= 0xDFFF and m.start() == high.end()):
            break
        if high is None and 0xD800 <= code <= 0xDFFF:
            high = m
            if code >= 0xDC00:
                break
        else:
            high = None
    if high is None:
        return None
    at = high.start()
    line, column = text.count("\n", 0, at) + 1, at - text.rfind("\n", 0, at)
    return (f"the body is not valid JSON: a lone surrogate {high.group(0)} at line {line}, column {column}: half of a "
            "UTF-16 surrogate pair (\\ud800-\\udbff, then \\udc00-\\udfff) without the other half encodes no character")
