"""HTTP routes for knowledge tracing: thin wrappers over nextstep.service.kt.KnowledgeTracer."""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Request
from pydantic import ConfigDict, Field, StrictInt, StrictStr

from ..kt import Event, KnowledgeTracer
from .common import JsonRoute, Strict, too_many

router = APIRouter(prefix="/v1/kt/{model}", tags=["knowledge tracing"], route_class=JsonRoute)

Id = Annotated[StrictStr | StrictInt,
               Field(description="an external id as the app knows it (string or integer; not true, not 1.0)")]
StudentId = Annotated[str, Field(min_length=1, max_length=200, examples=["student-42"])]
StudentPath = Annotated[str, Path(min_length=1, max_length=200, description="the student id")]


async def tracer(request: Request) -> KnowledgeTracer:
    # async on purpose: FastAPI runs a plain `def` dependency in a worker thread, ~0.1 ms a request
    return request.app.state.tracer


Tracer = Annotated[KnowledgeTracer, Depends(tracer)]
ModelName = Annotated[str, Path(description="model name, e.g. deep_gpcm; deep_gpcm@1 (or the X-Model-Version "
                                            "header) pins a version, else the latest good one",
                                examples=["deep_gpcm"])]
EXPLAIN = "models with memory banks (SimAKT): each inter-student head's top 5 bank entries by attention weight"


class EventIn(Strict):
    question_id: Id
    response: Annotated[int, Field(ge=0, description="ordinal response 0..K-1 (0/1 for right/wrong)")]
    event_id: Annotated[str | None, Field(max_length=200, description="replays of an id are applied once")] = None
    timestamp: Annotated[float | None, Field(description="unix seconds; recorded by the app, not used")] = None


class EventsIn(Strict):
    student_id: StudentId
    events: Annotated[list[EventIn], Field(min_length=1)]
    predict_question_ids: Annotated[list[Id] | None, Field(description="predict these after the events")] = None
    explain: Annotated[bool, Field(description=EXPLAIN)] = False

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "student_id": "student-42",
        "events": [{"question_id": "17", "response": 2, "event_id": "e-1001"}],
        "predict_question_ids": ["18"]}]})


class PredictIn(Strict):
    student_id: StudentId
    question_ids: Annotated[list[Id], Field(min_length=1)]
    explain: Annotated[bool, Field(description=EXPLAIN)] = False

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"student_id": "student-42", "question_ids": ["18", "19"]}]})


class NextItemIn(Strict):
    student_id: StudentId
    candidate_question_ids: Annotated[list[Id] | None, Field(description="default: every known question")] = None
    strategy: Literal["fisher", "target"] = "fisher"
    target: Annotated[float, Field(gt=0, lt=1, description="for strategy=target: wanted P(full credit)")] = 0.7
    k: Annotated[int, Field(ge=1, le=1000)] = 10

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"student_id": "student-42", "strategy": "fisher", "k": 5}]})


class BankVersionIn(Strict):
    version: Annotated[str, Field(min_length=1, max_length=200, description="a bank version GET /banks lists")]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"version": "v2"}]})


class SequenceIn(Strict):
    student_id: StudentId
    events: list[EventIn]
    predict_question_ids: list[Id] | None = None


class BatchIn(Strict):
    students: Annotated[list[SequenceIn], Field(min_length=1)]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"students": [
        {"student_id": "a", "events": [{"question_id": "17", "response": 1}], "predict_question_ids": ["18"]}]}]})


def _events(items: list[EventIn]) -> list[Event]:
    return [Event(str(e.question_id), e.response, e.event_id) for e in items]


@router.post("/events", summary="Fold a learner's new responses into their state (and predict)")
async def post_events(model: ModelName, body: EventsIn, kt: Tracer, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("events", len(body.events), settings.max_events)
    if body.predict_question_ids:
        too_many("predict_question_ids", len(body.predict_question_ids), settings.max_questions)
    ids = [str(q) for q in body.predict_question_ids] if body.predict_question_ids else None
    return await kt.absorb(model, body.student_id, _events(body.events), ids, body.explain)


@router.post("/predict", summary="Predicted response distribution, theta, alpha and beta per question")
async def post_predict(model: ModelName, body: PredictIn, kt: Tracer, request: Request) -> dict:
    too_many("question_ids", len(body.question_ids), request.app.state.settings.max_questions)
    return await kt.predict(model, body.student_id, [str(q) for q in body.question_ids], body.explain)


@router.post("/next-item", summary="Rank questions by Fisher information or closeness to a target")
async def post_next_item(model: ModelName, body: NextItemIn, kt: Tracer, request: Request) -> dict:
    if body.candidate_question_ids:
        too_many("candidate_question_ids", len(body.candidate_question_ids), request.app.state.settings.max_questions)
    candidates = [str(q) for q in body.candidate_question_ids] if body.candidate_question_ids else None
    return await kt.next_item(model, body.student_id, candidates, body.strategy, body.target, body.k)


@router.post("/batch", summary="Stateless scoring of whole sequences (nothing is stored)")
async def post_batch(model: ModelName, body: BatchIn, kt: Tracer, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("students", len(body.students), settings.max_batch_students)
    for i, s in enumerate(body.students):
        too_many(f"students[{i}].events", len(s.events), settings.max_events)
    students = [(s.student_id, _events(s.events),
                 [str(q) for q in s.predict_question_ids] if s.predict_question_ids else None) for s in body.students]
    return await kt.score_sequences(model, students)


@router.get("/students/{student_id}", summary="Summary of a learner's stored state")
async def get_student(model: ModelName, student_id: StudentPath, kt: Tracer) -> dict:
    return await kt.summary(model, student_id)


@router.delete("/students/{student_id}", summary="Delete a learner's state and replay window")
async def delete_student(model: ModelName, student_id: StudentPath, kt: Tracer) -> dict:
    return {"student_id": student_id, "deleted": await kt.delete(model, student_id)}


@router.get("/banks", summary="Memory bank versions (SimAKT): the active one, entries per head, provenance")
async def get_banks(model: ModelName, kt: Tracer) -> dict:
    return await kt.bank_versions(model)


@router.put("/banks/active", summary="Switch the active memory bank version (loaded before the switch)")
async def put_active_bank(model: ModelName, body: BankVersionIn, kt: Tracer) -> dict:
    return await kt.activate_bank(model, body.version)
