"""What every route module shares: strict request bodies, the per-request size limits, and `JsonRoute`, the
route class of every router (the fast path of routes that take a JSON body)."""

import asyncio
import email.message

from fastapi import Request, Response
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
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


class JsonRoute(APIRoute):
    """A route whose JSON body skips FastAPI's request machinery (dependency solving, validation of a parsed
    dict, the response model, jsonable_encoder: about 0.2 ms a request). The raw body is validated by
    pydantic-core in one call against the route's own body model, the endpoint itself is called (path
    parameters as the router matched them, its `Request`, and its dependencies, each an `async def` of the
    request alone), and its answer is encoded by pydantic-core. Errors the endpoint raises go to the app's
    exception handlers, as on the regular path. Anything unusual (not JSON, a body that does not validate)
    takes FastAPI's regular handler, from the same bytes, so every 4xx is the one FastAPI gives. A route
    outside this pattern (no body, other parameters) only has the regular handler."""

    def get_route_handler(self):
        regular = super().get_route_handler()
        plan = self._plan()
        if plan is None:
            return regular
        endpoint, body_model, body_name, path_names, request_name, dependencies = plan
        status = self.status_code or 200

        async def handler(request: Request) -> Response:
            if _json(request.headers.get("content-type")):
                try:
                    body = body_model.model_validate_json(await request.body())
                except ValidationError:
                    body = None
                if body is not None:
                    kwargs = {name: request.path_params[name] for name in path_names}
                    kwargs[body_name] = body
                    if request_name:
                        kwargs[request_name] = request
                    for name, call in dependencies:
                        kwargs[name] = await call(request)
                    return Response(to_json(await endpoint(**kwargs)), status, media_type="application/json")
            return await regular(request)  # (request.body() is cached: FastAPI reads the same bytes)

        return handler

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
