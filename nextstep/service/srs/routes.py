"""HTTP routes for spaced repetition: thin wrappers over nextstep.service.srs.service.SpacedRepetition."""

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request

from ..routes.common import JsonRoute, answer, not_ahead, path_id, too_many
from ..tasks import Shared, TaskPlugin
from .export import EXPORT
from .schemas import (
    PREDICT,
    REVIEWS,
    SCHEDULE,
    SIMULATE,
    SUMMARY,
    SrsDeleted,
    SrsPredictAnswer,
    SrsPredictRequest,
    SrsReview,
    SrsReviewsAnswer,
    SrsReviewsRequest,
    SrsScheduleAnswer,
    SrsScheduleRequest,
    SrsSimulateAnswer,
    SrsSimulateRequest,
    SrsSummary,
)
from .service import SPEC, SpacedRepetition
from .stored import Review

router = APIRouter(prefix="/v1/srs/{model}", tags=["spaced repetition"], route_class=JsonRoute)


UserPath = Annotated[str, path_id("user")]
ModelName = Annotated[str, Path(description="model name of an srs model, e.g. time_aware; time_aware@1 (or the "
                                            "X-Model-Version header) pins a version, else the latest good one",
                                examples=["time_aware"])]


async def service(request: Request) -> SpacedRepetition:
    return request.app.state.srs


Srs = Annotated[SpacedRepetition, Depends(service)]


def _review(r: SrsReview) -> Review:
    return Review(card_id=str(r.card_id), time=r.time, rating=r.rating, deck_id=str(r.deck_id), duration=r.duration,
                  state=r.state, event_id=r.event_id)


@router.post("/reviews", summary="Record a user's reviews (and predict a review afterwards)",
             responses=answer(SrsReviewsAnswer, REVIEWS, 404, 409, 503))
async def post_reviews(model: ModelName, body: SrsReviewsRequest, srs: Srs, request: Request) -> dict:
    too_many("reviews", len(body.reviews), request.app.state.settings.max_events)
    not_ahead(request, [r.time for r in body.reviews], "reviews[{i}].time")  # (a query's time may be any)
    query = (str(body.predict.card_id), str(body.predict.deck_id), body.predict.time) if body.predict else None
    day_start = None if body.day_start_hour_utc is None else body.day_start_hour_utc * 3600.0
    return await srs.add_reviews(model, body.user_id, [_review(r) for r in body.reviews], query, day_start)


@router.post("/predict", summary="P(rating), P(recall) and expected answer time of a review of one card",
             responses=answer(SrsPredictAnswer, PREDICT, 404, 503))
async def post_predict(model: ModelName, body: SrsPredictRequest, srs: Srs) -> dict:
    return await srs.predict(model, body.user_id, str(body.card_id), str(body.deck_id), body.time)


@router.post("/schedule", summary="When each card's predicted recall falls to the desired retention",
             responses=answer(SrsScheduleAnswer, SCHEDULE, 404, 503))
async def post_schedule(model: ModelName, body: SrsScheduleRequest, srs: Srs, request: Request) -> dict:
    too_many("cards", len(body.cards), request.app.state.settings.srs_max_schedule_cards)
    return await srs.schedule(model, body.user_id, [(str(c.card_id), str(c.deck_id)) for c in body.cards],
                              body.desired_retention, body.now, body.horizon_days)


@router.post("/simulate", summary="Expected daily reviews and minutes over the next days at several desired "
                                  "retentions, for a user's deck",
             responses=answer(SrsSimulateAnswer, SIMULATE, 404, 413, 503))
async def post_simulate(model: ModelName, body: SrsSimulateRequest, srs: Srs, request: Request) -> dict:
    limit = request.app.state.settings.srs_max_simulate_cards
    if body.cards is not None:
        too_many("cards", len(body.cards), limit)
    too_many("new_cards", body.new_cards, limit)
    cards = [(str(c.card_id), str(c.deck_id)) for c in body.cards] if body.cards is not None else None
    return await srs.simulate(model, body.user_id, cards, list(body.desired_retentions), body.days, body.new_cards,
                              body.new_cards_per_day, body.now, body.seed, max_cards=limit)


@router.get("/users/{user_id:path}", summary="Summary of a user's stored reviews and their own FSRS-6 "
                                            "parameters (`fitted_on` 0: the model's defaults, not fitted yet)",
            responses=answer(SrsSummary, SUMMARY, 404, 422, 503))
async def get_user(model: ModelName, user_id: UserPath, srs: Srs) -> dict:
    return await srs.summary(model, user_id)


@router.delete("/users/{user_id:path}", summary="Delete a user's reviews and replay window",
               responses=answer(SrsDeleted, {"user_id": "user-42", "deleted": True}, 404, 422, 503))
async def delete_user(model: ModelName, user_id: UserPath, srs: Srs) -> dict:
    return {"user_id": user_id, "deleted": await srs.delete(model, user_id)}


def _service(app: Shared, store) -> SpacedRepetition:
    settings = app.settings
    return SpacedRepetition(app.registry, store, app.engines, quality=app.quality, cas_retries=settings.cas_retries,
                            max_interval_days=settings.srs_max_interval_days,
                            refit_min_scored=settings.srs_refit_min_scored,
                            refit_every_scored=settings.srs_refit_every_scored, on_retry=app.on_retry)


# users keep their reviews for years: NEXTSTEP_SRS_TTL_SECONDS idle (two years; 0: never). The stored reviews are the
# user's log, shared by every version of a layout: a migration rebuilds them for a version with other window sizes
# (SpacedRepetition.to_migrate, catch_up), and a shadow of another layout keeps its own (SpacedRepetition.follow_log)
TASK = TaskPlugin(SPEC, SpacedRepetition, router, "srs", build=_service,
                  store=lambda s: {"ttl_seconds": s.srs_ttl_seconds or None}, export=EXPORT)
