"""Flashcards' requests and answers (importable without FastAPI: the Python client uses them too), and examples of
the answers (the OpenAPI document's)."""

from typing import Annotated, Literal

from pydantic import AfterValidator, ConfigDict, Field, StrictInt, StrictStr, StringConstraints

from ..schemas import MAX_ID, Answer, EventId, IdText, Int64, Rebuilt, Strict, deleted

MS_LOOKING = 1e11  # a time above this is milliseconds (as seconds it is after the year 5100)
SIMULATE_MAX_DAYS = 3650  # the longest simulation a request may ask for
SIMULATE_MAX_RETENTIONS = 10
SIMULATE_RETENTIONS = (0.5, 0.99)  # the desired retentions a simulation takes (Anki's slider: 0.70 to 0.99)


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



# -- answers --------------------------------------------------------------------------------------------------------
class CardPrediction(Answer):
    card_id: str
    deck_id: str
    time: float = Field(description="the review's time the prediction is for")
    p_rating: dict[str, float] = Field(description="P(rating) for ratings \"1\" (Again) to \"4\" (Easy)")
    p_recall: float = Field(description="P(rating > 1)")
    expected_duration_s: float
    history_used: int = Field(description="the user's reviews the model read")
    card_reviews: int = Field(description="of which, this card's")


class UserAnswer(Rebuilt):
    user_id: str
    model: str
    version: str = Field(description="the version that answered")
    reviews_total: int


class SrsReviewsAnswer(UserAnswer):
    applied: int
    replayed: int = Field(description="reviews whose event_id was applied before (replays)")
    last_review_time: float | None
    state_version: int
    prediction: CardPrediction | None


class SrsPredictAnswer(UserAnswer, CardPrediction):
    pass


class ScheduledCard(Answer):
    card_id: str
    deck_id: str
    status: Literal["scheduled", "new", "due_now", "max_interval", "beyond_horizon"]
    due: float = Field(description="unix seconds")
    interval_days: float = Field(description="from now")
    p_recall_at_due: float
    expected_duration_s: float


class SrsScheduleAnswer(UserAnswer):
    now: float
    desired_retention: float
    horizon_days: float
    max_interval_days: float
    cards: list[ScheduledCard]


class Curve(Answer):
    stretch: float
    decay: float


class RetentionOutlook(Answer):
    desired_retention: float
    reviews_per_day: list[float]
    minutes_per_day: list[float]
    total_reviews: float
    total_minutes: float
    mean_minutes_per_day: float
    recalled_at_end: float = Field(description="cards expected to be recalled on the last day")
    interval_ratio_to_fsrs6: float
    seconds_per_review: float


class SrsSimulateAnswer(UserAnswer):
    now: float
    days: int
    cards: int = Field(description="cards in the deck (reviewed ones)")
    new_cards: int
    new_cards_introduced: int
    new_cards_per_day: int
    seconds_per_new_card: float
    sampled_cards: int = Field(description="cards the model's curve was fitted on")
    model_curve: Curve
    replicas: int
    seed: int
    max_interval_days: int
    retentions: list[RetentionOutlook]


class FsrsParameters(Answer):
    w: list[float] = Field(description="the user's FSRS-6 parameters (the model's defaults until fitted)")
    fitted_on: int = Field(description="reviews they were fitted on; 0: not fitted yet")
    fitted_at: float | None
    scored_reviews: int | None
    day_start_hour_utc: float
    day_start_told: bool = Field(description="the app gave the user's day start (else the model's)")


class Evidence(Answer):
    nats: float | None
    network_weight: float
    about: str


class SrsSummary(UserAnswer):
    exists: bool
    last_review_time: float | None
    cards: int
    state_version: int
    last_update: float | None
    parameters: FsrsParameters
    evidence: Evidence | None = None


SrsDeleted = deleted("user")


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
