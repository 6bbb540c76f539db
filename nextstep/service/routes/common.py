"""What every route module shares: strict request bodies, the per-request size limits, and `JsonRoute`, the
route class of every route (the fast path of routes that take a JSON body)."""

import asyncio
import contextlib
import email.message
import functools

from fastapi import Request
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import to_json

from ..errors import TooLarge


class Strict(BaseModel):
    """A request body that refuses unknown fields (a typo is a 422, not silently ignored)."""

    model_config = ConfigDict(extra="forbid")


def too_many(field: str, n: int, limit: int) -> None:
    if n > limit:
        raise TooLarge(field, f"{n} items; at most {limit} per request")


def _json(content_type: str | None) -> bool:
    """Whether FastAPI reads a body of this content type as JSON (a missing one: no, strict_content_type)."""
    if not content_type:
        return False
    if content_type == "application/json":  # (what clients send; the rest parsed as FastAPI does)
        return True
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
    go to the app's exception handlers, as on the regular path. Anything unusual (not JSON, a body that does
    not validate) takes FastAPI's regular handling, from the same bytes, so every 4xx is the one FastAPI
    gives. A route outside this pattern (no body, other parameters) is handled by FastAPI alone. Every API route
    of the app is a JsonRoute (app.Service relies on it)."""

    async def handle(self, scope, receive, send) -> None:
        plan = self._fast
        if plan is None or scope["method"] not in self.methods:
            return await self._regular(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        endpoint, body_model, body_name, path_names, request_name, dependencies = plan
        parsed = None
        if _json(next((v.decode("latin-1") for k, v in scope["headers"] if k == b"content-type"), None)):
            with contextlib.suppress(ValidationError):
                parsed = body_model.model_validate_json(body)
        if parsed is None:  # FastAPI answers it, from the same bytes
            replayed = False

            async def replay():
                nonlocal replayed
                if replayed:  # then what the server says next (a disconnect)
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}

            return await self._regular(scope, replay, send)
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
