"""What every error becomes: the app's exception handlers, each answering a problem document (errors.py).

    install(app)   the handlers of errors.py's table, of FastAPI's validation errors and HTTPException, and the
                   last-resort 500; app.state.store_faults: the throttled log of the state store's faults
"""

import logging
import re
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from .errors import KIND, STATUS, problem

log = logging.getLogger("nextstep.service")


# what of a state store's message is withheld from clients that are not admins: where the store is (URLs, host:port,
# addresses); what went wrong (READONLY, a timeout, a certificate) stays
_STORE_AT = re.compile(r" at (?:rediss?|unix)(?:\+\w+)?://\S*?(?=:? |$)")
_ADDRESS = re.compile(r"\b(?:rediss?|unix)(?:\+\w+)?://\S*|\(\s*'[^']*',\s*\d+[^)]*\)|\[[0-9A-Fa-f:.]+\](?::\d+)?"
                      r"|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|(?<![\w.])[A-Za-z][\w.-]*:\d{2,5}\b")


def store_fault(exc: Exception, details: bool) -> str:
    """A state store's failure as a 503 says it: the exception's message, without where the store is unless
    `details` (an admin)."""
    text = str(exc) or type(exc).__name__
    return text if details else _ADDRESS.sub("(address withheld)", _STORE_AT.sub("", text))


class Throttled:
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


def validation_problem(errors: list[dict]) -> JSONResponse:
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


def install(app: FastAPI) -> None:
    """The app's exception handlers (ServiceMiddleware calls them; Service's stack has no ExceptionMiddleware). A
    503's detail names where the store is to admins only (`app.state.access`)."""
    store_faults = app.state.store_faults = Throttled()

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError):
        return validation_problem(exc.errors())

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException):  # the router's 404 and 405, and routes' own
        return problem(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    async def failed(request: Request, exc: Exception):  # errors.py: each error's status, field and kind
        cls = next(c for c in type(exc).__mro__ if c in STATUS)
        status = STATUS[cls]
        if status != 503:
            return problem(status, str(exc), exc.field, KIND[cls])
        store_faults.warning("state store unavailable: %s", exc)  # where it is: the log and admins only
        detail = store_fault(exc, request.app.state.access.is_admin(request.scope))
        return problem(status, f"state store unavailable: {detail}", exc.field, KIND[cls])

    for error in STATUS:
        app.add_exception_handler(error, failed)

    async def internal(request: Request, exc: Exception):  # the last resort (ServerErrorMiddleware): no details out
        return problem(500, "internal error; the service's log has the details")

    app.add_exception_handler(500, internal)
