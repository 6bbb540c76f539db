"""HTTP routes for next-item sessions: thin wrappers over nextstep.service.sessions.SessionRecommender."""

from typing import Annotated, Literal

from fastapi import APIRouter, Depends, Path, Request
from pydantic import ConfigDict, Field, StrictInt, StrictStr

from ..sessions import Click, SessionRecommender
from .common import JsonRoute, Strict, too_many

router = APIRouter(prefix="/v1/sessions/{model}", tags=["next item"], route_class=JsonRoute)

Id = Annotated[StrictStr | StrictInt,
               Field(description="an external item id as the app knows it (string or integer; not true, not 1.0)")]
SessionId = Annotated[str, Field(min_length=1, max_length=200, examples=["visit-7"])]
K = Annotated[int, Field(ge=1, le=1000, description="how many items (at most the model's top_k)")]
ExcludeSeen = Annotated[bool, Field(description="leave out items this session already clicked (its last 64)")]
Unknown = Annotated[Literal["error", "skip"],
                    Field(description="an item id the model does not know: a 422 (error) or left out (skip)")]


async def recommender(request: Request) -> SessionRecommender:
    return request.app.state.sessions


Recommender = Annotated[SessionRecommender, Depends(recommender)]
ModelName = Annotated[str, Path(description="model name, e.g. gru4rec; gru4rec@1 (or the X-Model-Version "
                                            "header) pins a version, else the latest good one",
                                examples=["gru4rec"])]
SessionPath = Annotated[str, Path(min_length=1, max_length=200, description="the session id")]


class ClickIn(Strict):
    item_id: Id
    event_id: Annotated[str | None, Field(max_length=200, description="replays of an id are applied once")] = None
    timestamp: Annotated[float | None, Field(description="unix seconds; recorded by the app, not used")] = None


class ClicksIn(Strict):
    session_id: SessionId
    events: Annotated[list[ClickIn], Field(min_length=1)]
    recommend_k: Annotated[int | None, Field(ge=1, le=1000, description="also recommend this many after")] = None
    exclude_seen: ExcludeSeen = True
    unknown_items: Unknown = "error"

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "session_id": "visit-7", "events": [{"item_id": "214536502", "event_id": "c-1"}], "recommend_k": 5}]})


class RecommendIn(Strict):
    session_id: SessionId
    k: K = 20
    exclude_seen: ExcludeSeen = True

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"session_id": "visit-7", "k": 5}]})


class SessionIn(Strict):
    session_id: Annotated[str | None, Field(max_length=200)] = None
    item_ids: list[Id]


class BatchIn(Strict):
    sessions: Annotated[list[SessionIn], Field(min_length=1)]
    k: K = 20
    exclude_seen: ExcludeSeen = True
    unknown_items: Unknown = "error"

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "sessions": [{"session_id": "a", "item_ids": ["214536502", "214536506"]}], "k": 5}]})


@router.post("/events", summary="Fold a session's new clicks into its state (and recommend)")
async def post_events(model: ModelName, body: ClicksIn, rec: Recommender, request: Request) -> dict:
    too_many("events", len(body.events), request.app.state.settings.max_events)
    clicks = [Click(str(e.item_id), e.event_id) for e in body.events]
    return await rec.absorb(model, body.session_id, clicks, recommend_k=body.recommend_k,
                            exclude_seen=body.exclude_seen, unknown_items=body.unknown_items)


@router.post("/recommend", summary="The k items the session most likely clicks next, with scores")
async def post_recommend(model: ModelName, body: RecommendIn, rec: Recommender) -> dict:
    return await rec.recommend(model, body.session_id, body.k, body.exclude_seen)


@router.post("/batch", summary="Stateless recommendations for many whole sessions (nothing is stored)")
async def post_batch(model: ModelName, body: BatchIn, rec: Recommender, request: Request) -> dict:
    settings = request.app.state.settings
    too_many("sessions", len(body.sessions), settings.max_batch_students)
    for i, s in enumerate(body.sessions):
        too_many(f"sessions[{i}].item_ids", len(s.item_ids), settings.max_events)
    sessions = [(s.session_id, [str(i) for i in s.item_ids]) for s in body.sessions]
    return await rec.score_sessions(model, sessions, body.k, body.exclude_seen, body.unknown_items)


@router.get("/{session_id}", summary="Summary of a session's stored state")
async def get_session(model: ModelName, session_id: SessionPath, rec: Recommender) -> dict:
    return await rec.summary(model, session_id)


@router.delete("/{session_id}", summary="Delete a session's state and replay window")
async def delete_session(model: ModelName, session_id: SessionPath, rec: Recommender) -> dict:
    return {"session_id": session_id, "deleted": await rec.delete(model, session_id)}
