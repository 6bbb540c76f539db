"""The Python client of a NextStep service: `pip install nextstep[client]` (httpx and pydantic; no torch, no ONNX
Runtime, no FastAPI).

    from nextstep.client import Client

    with Client("http://localhost:8000", api_key="...") as client:
        answer = client.kt.events("deep_gpcm", "student-42", [{"question_id": "17", "response": 2}],
                                  predict_question_ids=["18"])

One method per route (routes.py), answers typed with the service's own models (nextstep/service/schemas.py and each
task's schemas.py), and retries that never lose or double an event (transport.py): every event gets an id before the
first attempt, and every attempt sends the same ids. `AsyncClient` is the same over asyncio. docs/guide/client.md."""

from .errors import (
    InvalidRequest,
    NextStepError,
    NotFound,
    OutcomeUnknown,
    ProblemError,
    Unauthorized,
    Unavailable,
)
from .transport import AsyncClient, Client, Retry

__all__ = ["AsyncClient", "Client", "InvalidRequest", "NextStepError", "NotFound", "OutcomeUnknown", "ProblemError",
           "Retry", "Unauthorized", "Unavailable"]
