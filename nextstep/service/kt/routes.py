"""HTTP routes for knowledge tracing: thin wrappers over nextstep.service.kt.service.KnowledgeTracer."""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Request
from pydantic import ConfigDict, Field, StrictBool, StrictInt

from ..routes.common import (
    MAX_ID,
    EventId,
    ExternalId,
    IdText,
    JsonRoute,
    Strict,
    UnusedTime,
    answer,
    not_ahead,
    path_id,
    too_many,
)
from ..tasks import Shared, TaskPlugin
from .banks import Banks, make_bank_store
from .export import EXPORT
from .service import SPEC, Event, KnowledgeTracer

router = APIRouter(prefix="/v1/kt/{model}", tags=["knowledge tracing"], route_class=JsonRoute)

Id = Annotated[ExternalId, Field(description=f"a question id as the app knows it: a string of 1 to {MAX_ID} "
                                             "characters or an integer (\"12\" and 12 are the same; not true, "
                                             "not 1.0)")]
StudentId = Annotated[IdText, Field(description=f"the student's id: any string of 1 to {MAX_ID} characters",
                                    examples=["student-42"])]
StudentPath = Annotated[str, path_id("student")]


async def tracer(request: Request) -> KnowledgeTracer:
    # async on purpose: FastAPI runs a plain `def` dependency in a worker thread, ~0.1 ms a request
    return request.app.state.tracer


Tracer = Annotated[KnowledgeTracer, Depends(tracer)]
ModelName = Annotated[str, Path(description="model name, e.g. deep_gpcm; deep_gpcm@1 (or the X-Model-Version "
                                            "header) pins a version, else the latest good one",
                                examples=["deep_gpcm"])]
EXPLAIN = "models with memory banks (SimAKT): each inter-student head's top 5 bank entries by attention weight"
Explain = Annotated[StrictBool, Field(description=EXPLAIN)]


class KtEvent(Strict):
    question_id: Id
    response: Annotated[StrictInt, Field(ge=0, description="ordinal response 0..K-1 (0/1 for right/wrong; an "
                                                           "integer: true is not 1)")]
    event_id: EventId = None
    timestamp: UnusedTime = None


class KtEventsRequest(Strict):
    student_id: StudentId
    events: Annotated[list[KtEvent], Field(min_length=1)]
    predict_question_ids: Annotated[list[Id] | None, Field(description="predict these after the events")] = None
    explain: Explain = False

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "student_id": "student-42",
        "events": [{"question_id": "17", "response": 2, "event_id": "e-1001"}],
        "predict_question_ids": ["18"]}]})


class KtPredictRequest(Strict):
    student_id: StudentId
    question_ids: Annotated[list[Id], Field(min_length=1)]
    explain: Explain = False

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"student_id": "student-42", "question_ids": ["18", "19"]}]})


class KtNextItemRequest(Strict):
    student_id: StudentId
    candidate_question_ids: Annotated[list[Id] | None, Field(description="default: every known question")] = None
    strategy: Literal["fisher", "target"] = "fisher"
    target: Annotated[float, Field(gt=0, lt=1, description="for strategy=target: wanted P(full credit)")] = 0.7
    k: Annotated[StrictInt, Field(ge=1, le=1000, description="how many questions to return")] = 10

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"student_id": "student-42", "strategy": "fisher", "k": 5}]})


class KtBankVersionRequest(Strict):
    version: Annotated[IdText, Field(description="a bank version GET /banks lists")]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"version": "v2"}]})


class KtSequence(Strict):
    student_id: StudentId
    events: list[KtEvent]
    predict_question_ids: list[Id] | None = None


class KtBatchRequest(Strict):
    students: Annotated[list[KtSequence], Field(min_length=1)]

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"students": [
        {"student_id": "a", "events": [{"question_id": "17", "response": 1}], "predict_question_ids": ["18"]}]}]})


# examples of the answers (a deep_gpcm model: four response categories, IRT parameters)
PREDICTION = {"question_id": "18", "probabilities": [0.325, 0.348, 0.227, 0.1], "expected_response": 1.102,
              "most_likely_response": 1, "theta": 0.286, "alpha": 0.707, "beta": [0.192, 0.89, 1.443]}
STATE = {"student_id": "student-42", "model": "deep_gpcm", "version": "1", "state_version": 3}
EVENTS = {**STATE, "events_absorbed": 1, "events_skipped": 0, "events_total": 3, "rebuilt_from_events": 0,
          "predictions": [PREDICTION]}
PREDICT = {**STATE, "events_total": 3, "rebuilt_from_events": 0,
           "predictions": [PREDICTION, {**PREDICTION, "question_id": "19"}]}
NEXT_ITEM = {"student_id": "student-42", "model": "deep_gpcm", "version": "1", "strategy": "fisher",
             "state_version": 3, "rebuilt_from_events": 0,
             "items": [{"question_id": "7", "score": 1.035, "theta": 0.291},
                       {"question_id": "2", "score": 0.72, "theta": 0.294}]}
BATCH = {"model": "deep_gpcm", "version": "1", "students": [{
    "student_id": "a", "events": 1, "event_predictions": [{**PREDICTION, "question_id": "17"}],
    "predictions": [PREDICTION]}]}
SUMMARY = {"student_id": "student-42", "model": "deep_gpcm", "version": "1", "exists": True, "state_version": 3,
           "events_total": 3, "last_update": 1767225600.0, "rebuilt_from_events": 0, "ability": 0.287,
           "ability_range": [0.272, 0.297]}
BANKS = {"model": "simakt", "version": "1", "active": "v2", "serving": "v2", "versions": [
    {"version": "v2", "loaded": True, "heads": {"knn": {"type": "knn", "entries": 512, "students": 40}},
     "provenance": {"created": "2026-01-01T00:00:00Z"}}]}
ACTIVATED = {"model": "simakt", "version": "1", "bank_version": "v2", "previous": "v1"}


# what each IRT output means (the OpenAPI descriptions of the routes that return them, and the README, say this)
IRT_OUTPUTS = """GPCM models (deep_gpcm, attention_gpcm, coral_gpcm) give, per question q asked about:

* `theta`: the learner's ability **as it bears on q**. The model reads its memory of the learner at q's
  concepts (attention over memory slots from q's embedding) and maps that read-out, and only it, to theta; two
  questions on different concepts therefore get different thetas from the same state. It is the person
  parameter of q's GPCM, on the scale of q's `beta`: P(Y = k) is proportional to exp(sum over j < k of
  alpha (theta - beta_j)).
* `alpha`: q's discrimination for this learner's state (> 0); `beta`: q's K - 1 ordered category thresholds,
  from q alone (the same for every learner).

The learner's one overall ability is `ability` on `GET /v1/kt/{model}/students/{id}`: the mean of theta over
every question the model knows, with its range (`ability_range`). Right/wrong models without IRT outputs (dkt,
simakt) give probabilities only.

A question id the model never saw (added after training) is answered through the model's unknown row, trained to be
an average question: its prediction (or ranked item) says `"known": false`, and an events answer lists such ids in
`unknown_question_ids`. With NEXTSTEP_UNKNOWN_QUESTIONS=error, or a version trained without that row, it is a 422
naming the field."""


def _events(items: list[KtEvent]) -> list[Event]:
    return [Event(str(e.question_id), e.response, e.event_id, e.timestamp) for e in items]


@router.post("/events", summary="Fold a learner's new responses into their state (and predict)",
             description=IRT_OUTPUTS, responses=answer(EVENTS, 404, 409, 503))
async def post_events(model: ModelName, body: KtEventsRequest, kt: Tracer, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("events", len(body.events), settings.max_events)
    not_ahead(request, [e.timestamp for e in body.events], "events[{i}].timestamp")
    if body.predict_question_ids:
        too_many("predict_question_ids", len(body.predict_question_ids), settings.max_questions)
    ids = [str(q) for q in body.predict_question_ids] if body.predict_question_ids else None
    return await kt.absorb(model, body.student_id, _events(body.events), ids, body.explain)


@router.post("/predict", summary="Predicted response distribution, theta, alpha and beta per question",
             description=IRT_OUTPUTS, responses=answer(PREDICT, 404, 503))
async def post_predict(model: ModelName, body: KtPredictRequest, kt: Tracer, request: Request) -> dict:
    too_many("question_ids", len(body.question_ids), request.app.state.settings.max_questions)
    return await kt.predict(model, body.student_id, [str(q) for q in body.question_ids], body.explain)


@router.post("/next-item", summary="Rank questions by Fisher information or closeness to a target",
             description=IRT_OUTPUTS, responses=answer(NEXT_ITEM, 404, 503))
async def post_next_item(model: ModelName, body: KtNextItemRequest, kt: Tracer, request: Request) -> dict:
    if body.candidate_question_ids:
        too_many("candidate_question_ids", len(body.candidate_question_ids), request.app.state.settings.max_questions)
    candidates = [str(q) for q in body.candidate_question_ids] if body.candidate_question_ids else None
    return await kt.next_item(model, body.student_id, candidates, body.strategy, body.target, body.k)


@router.post("/batch", summary="Stateless scoring of whole sequences (nothing is stored)",
             description=IRT_OUTPUTS, responses=answer(BATCH, 404, 503))
async def post_batch(model: ModelName, body: KtBatchRequest, kt: Tracer, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("students", len(body.students), settings.max_batch_students)  # (events: the tracer's own limits)
    for n, s in enumerate(body.students):
        not_ahead(request, [e.timestamp for e in s.events], f"students[{n}].events[{{i}}].timestamp")
    students = [(s.student_id, _events(s.events),
                 [str(q) for q in s.predict_question_ids] if s.predict_question_ids else None) for s in body.students]
    return await kt.score_sequences(model, students)


@router.get("/students/{student_id:path}", summary="Summary of a learner's stored state",
            description=IRT_OUTPUTS, responses=answer(SUMMARY, 404, 422, 503))
async def get_student(model: ModelName, student_id: StudentPath, kt: Tracer) -> dict:
    return await kt.summary(model, student_id)


@router.delete("/students/{student_id:path}", summary="Delete a learner's state and replay window",
               responses=answer({"student_id": "student-42", "deleted": True}, 404, 422, 503))
async def delete_student(model: ModelName, student_id: StudentPath, kt: Tracer) -> dict:
    return {"student_id": student_id, "deleted": await kt.delete(model, student_id)}


@router.get("/banks", summary="Memory bank versions (SimAKT): the active one, entries per head, provenance",
            responses=answer(BANKS, 404, 503))
async def get_banks(model: ModelName, kt: Tracer) -> dict:
    return await kt.bank_versions(model)


@router.put("/banks/active", summary="Switch the active memory bank version (loaded before the switch)",
            responses=answer(ACTIVATED, 404, 503))
async def put_active_bank(model: ModelName, body: KtBankVersionRequest, kt: Tracer) -> dict:
    return await kt.activate_bank(model, body.version)


def _tracer(app: Shared, store) -> KnowledgeTracer:
    settings = app.settings
    # SimAKT's memory banks: megabytes each, in a store of their own (its client's longer timeout)
    banks = Banks(make_bank_store(settings.redis_url, settings.redis_options()),
                  refresh_seconds=settings.bank_refresh_seconds)
    return KnowledgeTracer(app.registry, store, app.engines, quality=app.quality, cas_retries=settings.cas_retries,
                           banks=banks, limits=settings.batch_limits(), on_retry=app.on_retry,
                           unknown_questions=settings.unknown_questions, on_unknown=app.metrics.on_unknown)


# learners' states expire after NEXTSTEP_STATE_TTL_SECONDS idle (180 days); their logs are bounded as set
TASK = TaskPlugin(SPEC, KnowledgeTracer, router, "tracer", build=_tracer,
                  store=lambda s: {"ttl_seconds": s.state_ttl_seconds, "log": s.log_bounds()}, export=EXPORT)
