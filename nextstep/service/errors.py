"""What a request can fail with, each error in one place with the HTTP answer the app gives it.

    UnknownModel        404  no loaded model of that name (or task)           field "model"
    UnknownId           422  an external id the model's vocabulary lacks      field: what the id is
    InvalidInput        422  a request the model cannot answer                field: the offending one
    TooLarge            413  more items than the settings allow               field: the list
    UnsupportedMediaType 415 a body that is not declared application/json    field "Content-Type"
    ConcurrencyConflict 409  compare-and-set kept losing to other writers
    StoreUnavailable    503  the state store cannot be reached, or refused: nothing was changed
    OutcomeUnknown      503  a write was sent, but its answer never came: it may have been applied

The task modules raise them without knowing HTTP; `app.py` answers each with `STATUS` and `field`, as an RFC 9457
problem document (`problem`): every 4xx and 5xx of the service has that one shape.
"""

from http import HTTPStatus

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

SHOWN = 64  # at most this many characters of a value from the request go back in an error
MAX_DETAIL = 2000  # and no problem's detail is longer than this
RETRY_AFTER_SECONDS = 1  # every 503 says when to try again (the client retries with the same event ids: core.py)


def shown(value) -> str:
    """A value from a request as an error message shows it: its repr, cut to SHOWN characters (an id may be
    megabytes long)."""
    text = repr(value)
    return text if len(text) <= SHOWN else f"{text[:SHOWN]}... ({len(text)} characters)"


class UnknownModel(KeyError):
    """No loaded model has this name or version; the message lists what is available."""

    field = "model"

    def __str__(self) -> str:  # KeyError would print the message in quotes
        return str(self.args[0])


class UnknownId(ValueError):
    """An external id the model's vocabulary does not hold."""

    def __init__(self, field: str, value):
        super().__init__(f"unknown {field} id {shown(value)}: not in the model's vocabulary")
        self.field = field
        self.value = value


class InvalidInput(ValueError):
    """A request the model cannot answer; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class TooLarge(InvalidInput):
    """More items in a request than the settings allow (HTTP 413)."""


class UnsupportedMediaType(InvalidInput):
    """A request body not declared as JSON (HTTP 415): missing or other Content-Type header."""

    def __init__(self, content_type: str | None):
        got = f"got {shown(content_type)}" if content_type else "the header is missing"
        super().__init__("Content-Type", f"expected application/json; {got}")


class ConcurrencyConflict(RuntimeError):
    """Compare-and-set kept failing: too many writers for one entity."""

    field = None


class StoreUnavailable(RuntimeError):
    """The backing store cannot be reached, or refused the operation; the message says why (without the server's
    address: that is in the log). Raised in bounded time. Nothing was changed, or (a delete, a bank write) the
    operation may be repeated as it is."""

    field = None


class OutcomeUnknown(StoreUnavailable):
    """A write was sent, and then the store stopped answering (a timeout, a lost connection) or too few replicas
    acknowledged it: it may have been applied, now or when the store wakes up, or not at all. Only a retry that
    the store can recognise is safe: one with the same event ids (core.py). `resolvable`: whether reading the
    store later tells (False when the write stands on the primary but is not replicated: WAIT)."""

    def __init__(self, message: str, *, resolvable: bool = True):
        super().__init__(message)
        self.resolvable = resolvable


def problem(status: int, detail: str, field: str | None = None, kind: str | None = None, *,
            headers: dict | None = None, **extra) -> JSONResponse:
    """An RFC 9457 problem document: `type` (`urn:nextstep:problem:<kind>`, or about:blank when the status says it
    all), `title` (the status's phrase), `status`, `detail` (what is wrong, in words), and `field` (the offending
    request field, header or path parameter) where there is one; `extra` adds members (e.g. `errors`). A 503 says
    when to try again (Retry-After)."""
    if len(detail) > MAX_DETAIL:  # (a safety net: the messages themselves show request values with `shown`)
        detail = f"{detail[:MAX_DETAIL]}... (cut)"
    body = {"type": f"urn:nextstep:problem:{kind}" if kind else "about:blank", "title": HTTPStatus(status).phrase,
            "status": status, "detail": detail}
    if field:
        body["field"] = field
    body.update(extra)
    if status == 503:  # (a store outage or a replica not ready yet: worth retrying, after a pause)
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS), **(headers or {})}
    return JSONResponse(body, status_code=status, headers=headers, media_type="application/problem+json")


# each error's `type` in its problem document
KIND = {UnknownModel: "unknown-model", UnknownId: "unknown-id", TooLarge: "too-large",
        UnsupportedMediaType: "unsupported-media-type", InvalidInput: "invalid-input", ConcurrencyConflict: "conflict",
        OutcomeUnknown: "outcome-unknown", StoreUnavailable: "store-unavailable"}

# the HTTP status of each error; a subclass comes before its base (the first match in the MRO wins)
STATUS = {UnknownModel: 404, UnknownId: 422, TooLarge: 413, UnsupportedMediaType: 415, InvalidInput: 422,
          ConcurrencyConflict: 409, OutcomeUnknown: 503, StoreUnavailable: 503}


class ProblemError(BaseModel):
    """One validation fault of a request."""

    field: str | None = Field(description="the offending field, e.g. events[0].response; null: the whole body")
    message: str
    type: str = Field(description="pydantic's error type, e.g. int_type, string_too_long, json_invalid")


class Problem(BaseModel):
    """An RFC 9457 problem document: the body of every 4xx and 5xx (media type application/problem+json)."""

    type: str = Field(description="urn:nextstep:problem:<kind>, or about:blank when the status says it all")
    title: str = Field(description="the HTTP status's phrase")
    status: int
    detail: str = Field(description="what is wrong, in words; request values shown cut short")
    field: str | None = Field(None, description="the offending field, header (X-API-Key, Content-Type) or path "
                                                "parameter, where there is one")
    errors: list[ProblemError] | None = Field(None, description="every validation fault (422 invalid-request)")

    model_config = ConfigDict(json_schema_extra={"examples": [{
        "type": "urn:nextstep:problem:invalid-request", "title": "Unprocessable Entity", "status": 422,
        "detail": "events[0].response: Input should be a valid integer", "field": "events[0].response",
        "errors": [{"field": "events[0].response", "message": "Input should be a valid integer",
                    "type": "int_type"}]}]})
