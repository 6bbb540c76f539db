"""Next-item sessions' requests and answers (importable without FastAPI: the Python client uses them too), and
examples of the answers (the OpenAPI document's)."""

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

from ..schemas import MAX_ID, Answer, EventId, ExternalId, IdText, Rebuilt, Strict, UnusedTime, deleted

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



# -- answers --------------------------------------------------------------------------------------------------------
class Item(Answer):
    item_id: str
    score: float = Field(description="the model's score (higher: more likely next); not a probability")


SOURCE = Field(description="model: the model's own list; cold_start:<model>: a session with no click yet, answered "
                           "by NEXTSTEP_COLD_START_MODEL")


class SessionAnswer(Rebuilt):
    session_id: str
    model: str
    version: str = Field(description="the version that answered")
    state_version: int
    events_total: int


class SessionEventsAnswer(SessionAnswer):
    events_absorbed: int
    events_skipped: int = Field(description="clicks whose event_id was applied before (replays)")
    unknown_items_skipped: int = Field(description="unknown item ids left out (unknown_items=skip)")
    unknown_item_ids: list[str] | None = Field(None, description="item ids stepped through the unknown row "
                                                                 "(present only then)")
    recommendations: list[Item] | None
    source: str | None = Field(None, description="with recommendations: " + SOURCE.description)


class SessionRecommendAnswer(SessionAnswer):
    source: str = SOURCE
    items: list[Item]


class ScoredSession(Answer):
    session_id: str | None
    events: int = Field(description="clicks stepped")
    source: str = SOURCE
    items: list[Item]
    unknown_item_ids: list[str] | None = None


class SessionBatchAnswer(Answer):
    model: str
    version: str
    sessions: list[ScoredSession]


class SessionSummary(SessionAnswer):
    exists: bool
    last_update: float | None
    recent_items: list[str] = Field(description="the session's last clicks the state remembers, oldest first")


SessionDeleted = deleted("session")


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
