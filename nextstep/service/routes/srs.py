"""HTTP routes for spaced repetition: thin wrappers over nextstep.service.srs.SpacedRepetition."""

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Request
from pydantic import AfterValidator, ConfigDict, Field, StrictInt, StrictStr, StringConstraints

from ..srs import MS_LOOKING, Review, SpacedRepetition
from .common import JsonRoute, Strict, too_many

router = APIRouter(prefix="/v1/srs/{model}", tags=["spaced repetition"], route_class=JsonRoute)


def _seconds(value: float) -> float:
    if value > MS_LOOKING:
        raise ValueError(f"{value!r} looks like milliseconds: times are unix seconds")
    return value


NonEmpty = Annotated[StrictStr, StringConstraints(min_length=1, max_length=200)]
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]  # an integer id is bounded like a string one
CardId = Annotated[NonEmpty | Int64,
                   Field(description="the app's card id (string or integer: \"12\" and 12 are the same card)",
                         examples=["card-17"])]
DeckId = Annotated[Annotated[StrictStr, StringConstraints(max_length=200)] | Int64,
                   Field(description="the card's deck (\"\": no deck; cards without a deck count as one deck)")]
UnixSeconds = Annotated[float, Field(ge=0, allow_inf_nan=False, description="unix time in seconds (not ms)",
                                     examples=[1767225600.0], json_schema_extra={"maximum": MS_LOOKING}),
                        AfterValidator(_seconds)]  # (the maximum checked here, to say why: milliseconds)
UserId = Annotated[str, Field(min_length=1, max_length=200, examples=["user-42"])]
UserPath = Annotated[str, Path(min_length=1, max_length=200, description="the user id")]
ModelName = Annotated[str, Path(description="model name of an srs model, e.g. time_aware; time_aware@1 (or the "
                                            "X-Model-Version header) pins a version, else the latest good one",
                                examples=["time_aware"])]


async def service(request: Request) -> SpacedRepetition:
    return request.app.state.srs


Srs = Annotated[SpacedRepetition, Depends(service)]


class ReviewIn(Strict):
    card_id: CardId
    deck_id: DeckId = ""
    time: UnixSeconds
    rating: Annotated[StrictInt, Field(ge=1, le=4, description="1 Again, 2 Hard, 3 Good, 4 Easy")]
    duration: Annotated[float | None, Field(ge=0, le=1e6, allow_inf_nan=False,
                                            description="answer time in seconds; null: unknown")] = None
    state: Annotated[StrictInt | None, Field(ge=0, le=3, description="the card's state before the review: "
                                                                      "0 new, 1 learning, 2 review, 3 relearning; "
                                                                      "null: unknown")] = None
    event_id: Annotated[str | None, Field(max_length=200, description="replays of an id are applied once")] = None


class QueryIn(Strict):
    card_id: CardId
    deck_id: DeckId = ""
    time: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None


class ReviewsIn(Strict):
    user_id: UserId
    reviews: Annotated[list[ReviewIn], Field(min_length=1, description="in time order, none before the user's "
                                                                       "last stored review")]
    predict: Annotated[QueryIn | None, Field(description="also predict this review afterwards")] = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "user_id": "user-42",
        "reviews": [{"card_id": "card-17", "deck_id": "spanish", "time": 1767225600.0, "rating": 3,
                     "duration": 6.5, "event_id": "r-1001"}],
        "predict": {"card_id": "card-18", "deck_id": "spanish"}}]})


class PredictIn(Strict):
    user_id: UserId
    card_id: CardId
    deck_id: DeckId = ""
    time: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"user_id": "user-42", "card_id": "card-17", "deck_id": "spanish", "time": 1767312000.0}]})


class CardIn(Strict):
    card_id: CardId
    deck_id: DeckId = ""


class ScheduleIn(Strict):
    user_id: UserId
    cards: Annotated[list[CardIn], Field(min_length=1)]
    desired_retention: Annotated[float, Field(gt=0, lt=1, description="the recall probability to review at")]
    now: Annotated[UnixSeconds | None, Field(description="default: now (or the last review, if later)")] = None
    horizon_days: Annotated[float, Field(gt=0, le=36500, description="search no further than this")] = 36500.0

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{
        "user_id": "user-42", "cards": [{"card_id": "card-17", "deck_id": "spanish"}], "desired_retention": 0.9}]})


def _review(r: ReviewIn) -> Review:
    return Review(card_id=str(r.card_id), time=r.time, rating=r.rating, deck_id=str(r.deck_id), duration=r.duration,
                  state=r.state, event_id=r.event_id)


@router.post("/reviews", summary="Record a user's reviews (and predict a review afterwards)")
async def post_reviews(model: ModelName, body: ReviewsIn, srs: Srs, request: Request) -> dict:
    too_many("reviews", len(body.reviews), request.app.state.settings.max_events)
    query = (str(body.predict.card_id), str(body.predict.deck_id), body.predict.time) if body.predict else None
    return await srs.add_reviews(model, body.user_id, [_review(r) for r in body.reviews], query)


@router.post("/predict", summary="P(rating), P(recall) and expected answer time of a review of one card")
async def post_predict(model: ModelName, body: PredictIn, srs: Srs) -> dict:
    return await srs.predict(model, body.user_id, str(body.card_id), str(body.deck_id), body.time)


@router.post("/schedule", summary="When each card's predicted recall falls to the desired retention")
async def post_schedule(model: ModelName, body: ScheduleIn, srs: Srs, request: Request) -> dict:
    too_many("cards", len(body.cards), request.app.state.settings.srs_max_schedule_cards)
    return await srs.schedule(model, body.user_id, [(str(c.card_id), str(c.deck_id)) for c in body.cards],
                              body.desired_retention, body.now, body.horizon_days)


@router.get("/users/{user_id}", summary="Summary of a user's stored reviews")
async def get_user(model: ModelName, user_id: UserPath, srs: Srs) -> dict:
    return await srs.summary(model, user_id)


@router.delete("/users/{user_id}", summary="Delete a user's reviews and replay window")
async def delete_user(model: ModelName, user_id: UserPath, srs: Srs) -> dict:
    return {"user_id": user_id, "deleted": await srs.delete(model, user_id)}
