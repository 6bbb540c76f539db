"""HTTP routes for spaced repetition: thin wrappers over nextstep.service.srs.service.SpacedRepetition."""

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from pydantic import AfterValidator, ConfigDict, Field, StrictInt, StrictStr, StringConstraints

from ..routes.common import MAX_ID, EventId, IdText, Int64, JsonRoute, Strict, answer, not_ahead, path_id, too_many
from ..tasks import Shared, TaskPlugin
from .export import EXPORT
from .service import SPEC, SpacedRepetition
from .simulate import SIMULATE_MAX_DAYS, SIMULATE_MAX_RETENTIONS, SIMULATE_RETENTIONS
from .stored import MS_LOOKING, Review

router = APIRouter(prefix="/v1/srs/{model}", tags=["spaced repetition"], route_class=JsonRoute)


def _seconds(value: float) -> float:
    if value > MS_LOOKING:
        raise ValueError(f"{value!r} looks like milliseconds: times are unix seconds")
    return value


CardId = Annotated[IdText | Int64,
                   Field(description=f"the app's card id: a string of 1 to {MAX_ID} characters or an integer "
                                     "(\"12\" and 12 are the same card)", examples=["card-17"])]
DeckId = Annotated[Annotated[StrictStr, StringConstraints(max_length=MAX_ID)] | Int64,
                   Field(description="the card's deck (\"\": no deck; cards without a deck count as one deck)")]
UnixSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False, description="unix time in seconds (not ms)",
                                     examples=[1767225600.0], json_schema_extra={"maximum": MS_LOOKING}),
                        AfterValidator(_seconds)]  # (the maximum checked here, to say why: milliseconds)
UserId = Annotated[IdText, Field(description=f"the user's id: any string of 1 to {MAX_ID} characters",
                                 examples=["user-42"])]
UserPath = Annotated[str, path_id("user")]
ModelName = Annotated[str, Path(description="model name of an srs model, e.g. time_aware; time_aware@1 (or the "
                                            "X-Model-Version header) pins a version, else the latest good one",
                                examples=["time_aware"])]


async def service(request: Request) -> SpacedRepetition:
    return request.app.state.srs


Srs = Annotated[SpacedRepetition, Depends(service)]


class SrsReview(Strict):
    card_id: CardId
    deck_id: DeckId = ""
    time: Annotated[UnixSeconds, Field(description="unix time in seconds (not ms), at most "
                                                   "NEXTSTEP_MAX_CLOCK_SKEW_SECONDS (a day by default) ahead of the "
                                                   "server's clock")]
    rating: Annotated[StrictInt, Field(ge=1, le=4, description="1 Again, 2 Hard, 3 Good, 4 Easy")]
    duration: Annotated[float | None, Field(ge=0, le=1e6, allow_inf_nan=False,
                                            description="answer time in seconds; null: unknown")] = None
    state: Annotated[StrictInt | None, Field(ge=0, le=3, description="the card's state before the review: "
                                                                      "0 new, 1 learning, 2 review, 3 relearning; "
                                                                      "null: unknown")] = None
    event_id: EventId = None


class SrsQuery(Strict):
    card_id: CardId
    deck_id: DeckId = ""
    time: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None


class SrsReviewsRequest(Strict):
    user_id: UserId
    reviews: Annotated[list[SrsReview], Field(min_length=1, description="in time order, none before the user's "
                                                                       "last stored review")]
    predict: Annotated[SrsQuery | None, Field(description="also predict this review afterwards")] = None
    day_start_hour_utc: Annotated[float | None, Field(
        ge=0, lt=24, allow_inf_nan=False,
        description="the hour (UTC) at which this user's scheduler day starts: Anki's 'next day starts at' in the "
                    "user's time zone (4 am in UTC-5 is 9). FSRS-6 counts days by it; stored for the user from these "
                    "reviews on. Default: the user's stored one, else the model's day_start_hour")] = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "user_id": "user-42",
        "reviews": [{"card_id": "card-17", "deck_id": "spanish", "time": 1767225600.0, "rating": 3,
                     "duration": 6.5, "event_id": "r-1001"}],
        "predict": {"card_id": "card-18", "deck_id": "spanish"}}]})


class SrsPredictRequest(Strict):
    user_id: UserId
    card_id: CardId
    deck_id: DeckId = ""
    time: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"user_id": "user-42", "card_id": "card-17", "deck_id": "spanish", "time": 1767312000.0}]})


class SrsCard(Strict):
    card_id: CardId
    deck_id: DeckId = ""


class SrsScheduleRequest(Strict):
    user_id: UserId
    cards: Annotated[list[SrsCard], Field(min_length=1)]
    desired_retention: Annotated[float, Field(gt=0, lt=1, description="the recall probability to review at")]
    now: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None
    horizon_days: Annotated[float, Field(gt=0, le=36500, description="search no further than this")] = 36500.0

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "user_id": "user-42", "cards": [{"card_id": "card-17", "deck_id": "spanish"}], "desired_retention": 0.9}]})


Retention = Annotated[float, Field(ge=SIMULATE_RETENTIONS[0], le=SIMULATE_RETENTIONS[1], allow_inf_nan=False)]


class SrsSimulateRequest(Strict):
    user_id: UserId
    cards: Annotated[list[SrsCard] | None, Field(
        description="the deck to simulate (cards without a stored review are new); default: every card the user "
                    "has reviewed")] = None
    new_cards: Annotated[StrictInt, Field(ge=0, description="never-reviewed cards to add to the deck")] = 0
    new_cards_per_day: Annotated[StrictInt, Field(ge=0, le=10_000, description="new cards introduced a day, in "
                                                                                "order, from today")] = 20
    days: Annotated[StrictInt, Field(ge=1, le=SIMULATE_MAX_DAYS, description="days to simulate from today")] = 365
    desired_retentions: Annotated[list[Retention], Field(min_length=1, max_length=SIMULATE_MAX_RETENTIONS,
                                                         description="the retentions to compare (distinct)")] = \
        [0.7, 0.75, 0.8, 0.85, 0.9, 0.95]
    now: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**32 - 1, description="the simulation's random seed: the same "
                                                                     "request gives the same answer")] = 0

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "user_id": "user-42", "days": 365, "new_cards": 200, "new_cards_per_day": 10,
        "desired_retentions": [0.8, 0.85, 0.9, 0.95]}]})


# examples of the answers
PREDICTION = {"card_id": "card-17", "deck_id": "spanish", "time": 1767312000.0,
              "p_rating": {"1": 0.053, "2": 0.216, "3": 0.416, "4": 0.315}, "p_recall": 0.947,
              "expected_duration_s": 5.8, "history_used": 1, "card_reviews": 1}
USER = {"user_id": "user-42", "model": "time_aware", "version": "1"}
REVIEWS = {**USER, "applied": 1, "replayed": 0, "reviews_total": 1, "last_review_time": 1767225600.0,
           "state_version": 1, "rebuilt_from_events": 0,
           "prediction": {**PREDICTION, "card_id": "card-18", "card_reviews": 0}}
PREDICT = {**USER, "reviews_total": 1, "rebuilt_from_events": 0, **PREDICTION}
SCHEDULE = {**USER, "now": 1767312000.0, "desired_retention": 0.9, "horizon_days": 36500.0,
            "max_interval_days": 1825.0, "reviews_total": 1, "rebuilt_from_events": 0,
            "cards": [{"card_id": "card-17", "deck_id": "spanish", "status": "scheduled", "due": 1767657600.0,
                       "interval_days": 4.0, "p_recall_at_due": 0.9, "expected_duration_s": 5.9}]}
SIMULATE = {**USER, "now": 1767312000.0, "days": 3, "cards": 412, "new_cards": 200, "new_cards_introduced": 30,
            "new_cards_per_day": 10, "seconds_per_new_card": 14.2, "sampled_cards": 24,
            "model_curve": {"stretch": 1.08, "decay": 0.19}, "replicas": 5, "seed": 0,
            "max_interval_days": 1825, "reviews_total": 2210, "rebuilt_from_events": 0,
            "retentions": [{"desired_retention": 0.9, "reviews_per_day": [61.4, 38.2, 35.0],
                            "minutes_per_day": [9.1, 5.9, 5.5], "total_reviews": 134.6, "total_minutes": 20.5,
                            "mean_minutes_per_day": 6.83, "recalled_at_end": 391.7, "interval_ratio_to_fsrs6": 1.12,
                            "seconds_per_review": 7.9}]}
SUMMARY = {**USER, "exists": True, "reviews_total": 1, "last_review_time": 1767225600.0, "cards": 1,
           "state_version": 1, "last_update": 1767225601.0, "rebuilt_from_events": 0,
           "parameters": {"w": [0.212, 1.2931, 2.3065, 8.2956, 6.4133, 0.8334, 3.0194, 0.001, 1.8722, 0.1666, 0.796,
                                1.4835, 0.0614, 0.2629, 1.6483, 0.6014, 1.8729, 0.5425, 0.0912, 0.0658, 0.1542],
                          "fitted_on": 0, "fitted_at": None, "scored_reviews": 0, "day_start_hour_utc": 4.0,
                          "day_start_told": False},
           "evidence": {"nats": 2.0, "network_weight": 0.8808,
                        "about": "log loss of FSRS-6 with the default parameters minus the network's on the user's "
                                 "scored reviews, recent ones counting most; P(recall) = network_weight * the "
                                 "network's + (1 - network_weight) * the defaults'"}}


def _review(r: SrsReview) -> Review:
    return Review(card_id=str(r.card_id), time=r.time, rating=r.rating, deck_id=str(r.deck_id), duration=r.duration,
                  state=r.state, event_id=r.event_id)


@router.post("/reviews", summary="Record a user's reviews (and predict a review afterwards)",
             responses=answer(REVIEWS, 404, 409, 503))
async def post_reviews(model: ModelName, body: SrsReviewsRequest, srs: Srs, request: Request) -> dict:
    too_many("reviews", len(body.reviews), request.app.state.settings.max_events)
    not_ahead(request, [r.time for r in body.reviews], "reviews[{i}].time")  # (a query's time may be any)
    query = (str(body.predict.card_id), str(body.predict.deck_id), body.predict.time) if body.predict else None
    day_start = None if body.day_start_hour_utc is None else body.day_start_hour_utc * 3600.0
    return await srs.add_reviews(model, body.user_id, [_review(r) for r in body.reviews], query, day_start)


@router.post("/predict", summary="P(rating), P(recall) and expected answer time of a review of one card",
             responses=answer(PREDICT, 404, 503))
async def post_predict(model: ModelName, body: SrsPredictRequest, srs: Srs) -> dict:
    return await srs.predict(model, body.user_id, str(body.card_id), str(body.deck_id), body.time)


@router.post("/schedule", summary="When each card's predicted recall falls to the desired retention",
             responses=answer(SCHEDULE, 404, 503))
async def post_schedule(model: ModelName, body: SrsScheduleRequest, srs: Srs, request: Request) -> dict:
    too_many("cards", len(body.cards), request.app.state.settings.srs_max_schedule_cards)
    return await srs.schedule(model, body.user_id, [(str(c.card_id), str(c.deck_id)) for c in body.cards],
                              body.desired_retention, body.now, body.horizon_days)


@router.post("/simulate", summary="Expected daily reviews and minutes over the next days at several desired "
                                  "retentions, for a user's deck", responses=answer(SIMULATE, 404, 413, 503))
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
            responses=answer(SUMMARY, 404, 422, 503))
async def get_user(model: ModelName, user_id: UserPath, srs: Srs) -> dict:
    return await srs.summary(model, user_id)


@router.delete("/users/{user_id:path}", summary="Delete a user's reviews and replay window",
               responses=answer({"user_id": "user-42", "deleted": True}, 404, 422, 503))
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
