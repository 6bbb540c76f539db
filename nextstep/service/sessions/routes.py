"""HTTP routes for next-item sessions: thin wrappers over nextstep.service.sessions.service.SessionRecommender."""

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from ..routes.common import JsonRoute, answer, not_ahead, path_id, too_many
from ..tasks import Shared, TaskPlugin
from .export import EXPORT
from .schemas import (
    BATCH,
    EVENTS,
    RECOMMEND,
    SUMMARY,
    SessionBatchAnswer,
    SessionBatchRequest,
    SessionDeleted,
    SessionEventsAnswer,
    SessionEventsRequest,
    SessionRecommendAnswer,
    SessionRecommendRequest,
    SessionSummary,
)
from .service import SPEC, Click, SessionRecommender

router = APIRouter(prefix="/v1/sessions/{model}", tags=["next item"], route_class=JsonRoute)

async def recommender(request: Request) -> SessionRecommender:
    return request.app.state.sessions


Recommender = Annotated[SessionRecommender, Depends(recommender)]
ModelName = Annotated[str, Path(description="model name, e.g. gru4rec; gru4rec@1 (or the X-Model-Version "
                                            "header) pins a version, else the latest good one",
                                examples=["gru4rec"])]
SessionPath = Annotated[str, path_id("session")]


@router.post("/events", summary="Fold a session's new clicks into its state (and recommend)",
             responses=answer(SessionEventsAnswer, EVENTS, 404, 409, 503))
async def post_events(model: ModelName, body: SessionEventsRequest, rec: Recommender, request: Request) -> dict:
    too_many("events", len(body.events), request.app.state.settings.max_events)
    not_ahead(request, [e.timestamp for e in body.events], "events[{i}].timestamp")
    clicks = [Click(str(e.item_id), e.event_id, e.timestamp) for e in body.events]
    return await rec.absorb(model, body.session_id, clicks, recommend_k=body.recommend_k,
                            exclude_seen=body.exclude_seen, unknown_items=body.unknown_items)


@router.post("/recommend", summary="The k items the session most likely clicks next, with scores",
             responses=answer(SessionRecommendAnswer, RECOMMEND, 404, 503))
async def post_recommend(model: ModelName, body: SessionRecommendRequest, rec: Recommender) -> dict:
    return await rec.recommend(model, body.session_id, body.k, body.exclude_seen)


@router.post("/batch", summary="Stateless recommendations for many whole sessions (nothing is stored)",
             responses=answer(SessionBatchAnswer, BATCH, 404))
async def post_batch(model: ModelName, body: SessionBatchRequest, rec: Recommender, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("sessions", len(body.sessions), settings.max_batch_students)  # (clicks: the recommender's own limits)
    sessions = [(s.session_id, [str(i) for i in s.item_ids]) for s in body.sessions]
    return await rec.score_sessions(model, sessions, body.k, body.exclude_seen, body.unknown_items)


@router.get("/{session_id:path}", summary="Summary of a session's stored state",
            responses=answer(SessionSummary, SUMMARY, 404, 422, 503))
async def get_session(model: ModelName, session_id: SessionPath, rec: Recommender) -> dict:
    return await rec.summary(model, session_id)


@router.delete("/{session_id:path}", summary="Delete a session's state and replay window",
               responses=answer(SessionDeleted, {"session_id": "visit-7", "deleted": True}, 404, 422, 503))
async def delete_session(model: ModelName, session_id: SessionPath, rec: Recommender) -> dict:
    return {"session_id": session_id, "deleted": await rec.delete(model, session_id)}


def _recommender(app: Shared, store) -> SessionRecommender:
    settings = app.settings
    return SessionRecommender(app.registry, store, app.engines, quality=app.quality, cas_retries=settings.cas_retries,
                              limits=settings.batch_limits(), cold_start_model=settings.cold_start_model,
                              on_retry=app.on_retry, unknown_items=settings.unknown_questions,
                              on_unknown=app.metrics.on_unknown)


# sessions expire much sooner than learners: after NEXTSTEP_SESSION_TTL_SECONDS idle (the session timeout)
TASK = TaskPlugin(SPEC, SessionRecommender, router, "sessions", build=_recommender,
                  store=lambda s: {"ttl_seconds": s.session_ttl_seconds, "log": s.log_bounds()}, export=EXPORT)
