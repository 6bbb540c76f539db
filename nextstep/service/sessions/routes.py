"""HTTP routes for next-item sessions: thin wrappers over nextstep.service.sessions.service.SessionRecommender."""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Request
from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

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
from .export import EXPORT
from .service import SPEC, Click, SessionRecommender

router = APIRouter(prefix="/v1/sessions/{model}", tags=["next item"], route_class=JsonRoute)

Id = Annotated[ExternalId, Field(description=f"an item id as the app knows it: a string of 1 to {MAX_ID} "
                                             "characters or an integer (not true, not 1.0)")]
SessionId = Annotated[IdText, Field(description=f"the session's id: any string of 1 to {MAX_ID} characters",
                                    examples=["visit-7"])]
K = Annotated[StrictInt, Field(ge=1, le=1000, description="how many items (at most the model's top_k)")]
ExcludeSeen = Annotated[StrictBool, Field(description="leave out items this session already clicked (its last 64)")]
Unknown = Annotated[Literal["answer", "error", "skip"] | None,
                    Field(description="an item id the model does not know (added after training): stepped through "
                                      "the model's unknown row and listed in unknown_item_ids (answer), a 422 "
                                      "(error), or left out (skip); null: the service's NEXTSTEP_UNKNOWN_QUESTIONS "
                                      "(answer unless set to error). A version trained without an unknown row "
                                      "answers 422 for answer")]


async def recommender(request: Request) -> SessionRecommender:
    return request.app.state.sessions


Recommender = Annotated[SessionRecommender, Depends(recommender)]
ModelName = Annotated[str, Path(description="model name, e.g. gru4rec; gru4rec@1 (or the X-Model-Version "
                                            "header) pins a version, else the latest good one",
                                examples=["gru4rec"])]
SessionPath = Annotated[str, path_id("session")]


class SessionClick(Strict):
    item_id: Id
    event_id: EventId = None
    timestamp: UnusedTime = None


class SessionEventsRequest(Strict):
    session_id: SessionId
    events: Annotated[list[SessionClick], Field(min_length=1)]
    recommend_k: Annotated[StrictInt | None, Field(ge=1, le=1000, description="also recommend this many after")] = None
    exclude_seen: ExcludeSeen = True
    unknown_items: Unknown = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "session_id": "visit-7", "events": [{"item_id": "214536502", "event_id": "c-1"}], "recommend_k": 5}]})


class SessionRecommendRequest(Strict):
    session_id: SessionId
    k: K = 20
    exclude_seen: ExcludeSeen = True

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"session_id": "visit-7", "k": 5}]})


class SessionSequence(Strict):
    session_id: Annotated[StrictStr | None, Field(max_length=MAX_ID, description="echoed in the answer")] = None
    item_ids: list[Id]


class SessionBatchRequest(Strict):
    sessions: Annotated[list[SessionSequence], Field(min_length=1)]
    k: K = 20
    exclude_seen: ExcludeSeen = True
    unknown_items: Unknown = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "sessions": [{"session_id": "a", "item_ids": ["214536502", "214536506"]}], "k": 5}]})


# examples of the answers
ITEMS = [{"item_id": "214536506", "score": 5.349}, {"item_id": "214536500", "score": 2.817}]
EVENTS = {"session_id": "visit-7", "model": "gru4rec", "version": "1", "state_version": 1, "events_absorbed": 1,
          "events_skipped": 0, "unknown_items_skipped": 0, "events_total": 1, "rebuilt_from_events": 0,
          "recommendations": ITEMS, "source": "model"}
RECOMMEND = {"session_id": "visit-7", "model": "gru4rec", "version": "1", "state_version": 1, "events_total": 1,
             "rebuilt_from_events": 0, "source": "model", "items": ITEMS}
BATCH = {"model": "gru4rec", "version": "1", "sessions": [{"session_id": "a", "events": 2, "source": "model",
                                                           "items": ITEMS}]}
SUMMARY = {"session_id": "visit-7", "model": "gru4rec", "version": "1", "exists": True, "state_version": 1,
           "events_total": 1, "rebuilt_from_events": 0, "last_update": 1767225600.0, "recent_items": ["214536502"]}


@router.post("/events", summary="Fold a session's new clicks into its state (and recommend)",
             responses=answer(EVENTS, 404, 409, 503))
async def post_events(model: ModelName, body: SessionEventsRequest, rec: Recommender, request: Request) -> dict:
    too_many("events", len(body.events), request.app.state.settings.max_events)
    not_ahead(request, [e.timestamp for e in body.events], "events[{i}].timestamp")
    clicks = [Click(str(e.item_id), e.event_id, e.timestamp) for e in body.events]
    return await rec.absorb(model, body.session_id, clicks, recommend_k=body.recommend_k,
                            exclude_seen=body.exclude_seen, unknown_items=body.unknown_items)


@router.post("/recommend", summary="The k items the session most likely clicks next, with scores",
             responses=answer(RECOMMEND, 404, 503))
async def post_recommend(model: ModelName, body: SessionRecommendRequest, rec: Recommender) -> dict:
    return await rec.recommend(model, body.session_id, body.k, body.exclude_seen)


@router.post("/batch", summary="Stateless recommendations for many whole sessions (nothing is stored)",
             responses=answer(BATCH, 404))
async def post_batch(model: ModelName, body: SessionBatchRequest, rec: Recommender, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("sessions", len(body.sessions), settings.max_batch_students)  # (clicks: the recommender's own limits)
    sessions = [(s.session_id, [str(i) for i in s.item_ids]) for s in body.sessions]
    return await rec.score_sessions(model, sessions, body.k, body.exclude_seen, body.unknown_items)


@router.get("/{session_id:path}", summary="Summary of a session's stored state",
            responses=answer(SUMMARY, 404, 422, 503))
async def get_session(model: ModelName, session_id: SessionPath, rec: Recommender) -> dict:
    return await rec.summary(model, session_id)


@router.delete("/{session_id:path}", summary="Delete a session's state and replay window",
               responses=answer({"session_id": "visit-7", "deleted": True}, 404, 422, 503))
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
