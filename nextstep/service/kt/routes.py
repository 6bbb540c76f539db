"""HTTP routes for knowledge tracing: thin wrappers over nextstep.service.kt.service.KnowledgeTracer."""

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from ..routes.common import JsonRoute, answer, not_ahead, path_id, too_many
from ..tasks import Shared, TaskPlugin
from .banks import Banks, make_bank_store
from .export import EXPORT
from .schemas import (
    ACTIVATED,
    BANKS,
    BATCH,
    EVENTS,
    NEXT_ITEM,
    PREDICT,
    SUMMARY,
    BankActivated,
    BankVersions,
    KtBankVersionRequest,
    KtBatchAnswer,
    KtBatchRequest,
    KtDeleted,
    KtEvent,
    KtEventsAnswer,
    KtEventsRequest,
    KtNextItemAnswer,
    KtNextItemRequest,
    KtPredictAnswer,
    KtPredictRequest,
    KtSummary,
)
from .service import SPEC, Event, KnowledgeTracer

router = APIRouter(prefix="/v1/kt/{model}", tags=["knowledge tracing"], route_class=JsonRoute)

StudentPath = Annotated[str, path_id("student")]


async def tracer(request: Request) -> KnowledgeTracer:
    # async on purpose: FastAPI runs a plain `def` dependency in a worker thread, ~0.1 ms a request
    return request.app.state.tracer


Tracer = Annotated[KnowledgeTracer, Depends(tracer)]
ModelName = Annotated[str, Path(description="model name, e.g. deep_gpcm; deep_gpcm@1 (or the X-Model-Version "
                                            "header) pins a version, else the latest good one",
                                examples=["deep_gpcm"])]
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
             description=IRT_OUTPUTS, responses=answer(KtEventsAnswer, EVENTS, 404, 409, 503))
async def post_events(model: ModelName, body: KtEventsRequest, kt: Tracer, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("events", len(body.events), settings.max_events)
    not_ahead(request, [e.timestamp for e in body.events], "events[{i}].timestamp")
    if body.predict_question_ids:
        too_many("predict_question_ids", len(body.predict_question_ids), settings.max_questions)
    ids = [str(q) for q in body.predict_question_ids] if body.predict_question_ids else None
    return await kt.absorb(model, body.student_id, _events(body.events), ids, body.explain)


@router.post("/predict", summary="Predicted response distribution, theta, alpha and beta per question",
             description=IRT_OUTPUTS, responses=answer(KtPredictAnswer, PREDICT, 404, 503))
async def post_predict(model: ModelName, body: KtPredictRequest, kt: Tracer, request: Request) -> dict:
    too_many("question_ids", len(body.question_ids), request.app.state.settings.max_questions)
    return await kt.predict(model, body.student_id, [str(q) for q in body.question_ids], body.explain)


@router.post("/next-item", summary="Rank questions by Fisher information or closeness to a target",
             description=IRT_OUTPUTS, responses=answer(KtNextItemAnswer, NEXT_ITEM, 404, 503))
async def post_next_item(model: ModelName, body: KtNextItemRequest, kt: Tracer, request: Request) -> dict:
    if body.candidate_question_ids:
        too_many("candidate_question_ids", len(body.candidate_question_ids), request.app.state.settings.max_questions)
    candidates = [str(q) for q in body.candidate_question_ids] if body.candidate_question_ids else None
    return await kt.next_item(model, body.student_id, candidates, body.strategy, body.target, body.k)


@router.post("/batch", summary="Stateless scoring of whole sequences (nothing is stored)",
             description=IRT_OUTPUTS, responses=answer(KtBatchAnswer, BATCH, 404, 503))
async def post_batch(model: ModelName, body: KtBatchRequest, kt: Tracer, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("students", len(body.students), settings.max_batch_students)  # (events: the tracer's own limits)
    for n, s in enumerate(body.students):
        not_ahead(request, [e.timestamp for e in s.events], f"students[{n}].events[{{i}}].timestamp")
    students = [(s.student_id, _events(s.events),
                 [str(q) for q in s.predict_question_ids] if s.predict_question_ids else None) for s in body.students]
    return await kt.score_sequences(model, students)


@router.get("/students/{student_id:path}", summary="Summary of a learner's stored state",
            description=IRT_OUTPUTS, responses=answer(KtSummary, SUMMARY, 404, 422, 503))
async def get_student(model: ModelName, student_id: StudentPath, kt: Tracer) -> dict:
    return await kt.summary(model, student_id)


@router.delete("/students/{student_id:path}", summary="Delete a learner's state and replay window",
               responses=answer(KtDeleted, {"student_id": "student-42", "deleted": True}, 404, 422, 503))
async def delete_student(model: ModelName, student_id: StudentPath, kt: Tracer) -> dict:
    return {"student_id": student_id, "deleted": await kt.delete(model, student_id)}


@router.get("/banks", summary="Memory bank versions (SimAKT): the active one, entries per head, provenance",
            responses=answer(BankVersions, BANKS, 404, 503))
async def get_banks(model: ModelName, kt: Tracer) -> dict:
    return await kt.bank_versions(model)


@router.put("/banks/active", summary="Switch the active memory bank version (loaded before the switch)",
            responses=answer(BankActivated, ACTIVATED, 404, 503))
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
