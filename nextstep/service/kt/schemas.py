"""Knowledge tracing's requests and answers (importable without FastAPI: the Python client uses them too), and
examples of the answers (the OpenAPI document's)."""

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, StrictBool, StrictInt

from ..schemas import MAX_ID, Answer, EventId, ExternalId, IdText, Rebuilt, Strict, UnusedTime, deleted

Id = Annotated[ExternalId, Field(description=f"a question id as the app knows it: a string of 1 to {MAX_ID} "
                                             "characters or an integer (\"12\" and 12 are the same; not true, "
                                             "not 1.0)")]
StudentId = Annotated[IdText, Field(description=f"the student's id: any string of 1 to {MAX_ID} characters",
                                    examples=["student-42"])]



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



# -- answers --------------------------------------------------------------------------------------------------------
class Prediction(Answer):
    """A question's predicted response distribution; GPCM models add the IRT parameters behind it."""

    question_id: str
    probabilities: list[float] = Field(description="P(response = k) for k = 0..K-1")
    expected_response: float
    most_likely_response: int
    theta: float | None = Field(None, description="GPCM: the learner's ability as it bears on this question")
    alpha: float | None = Field(None, description="GPCM: the question's discrimination for this learner (> 0)")
    beta: list[float] | None = Field(None, description="GPCM: the question's K - 1 ordered thresholds")
    known: bool = Field(True, description="false: an id the version never saw, answered through its unknown row "
                                          "(present only then)")


class BankEntry(Answer):
    entry: int
    weight: float = Field(description="attention weight")
    type: str = Field(description="knn: a similar student's memory; cluster: a cluster's mean")
    student: str | None = Field(None, description="knn: the student the entry comes from")
    members: int | None = Field(None, description="cluster: students in it")


class Explanation(Answer):
    bank_version: str
    heads: dict[str, list[BankEntry]] = Field(description="each inter-student head's top entries")


class LearnerAnswer(Rebuilt):
    student_id: str
    model: str
    version: str = Field(description="the version that answered")
    bank_version: str | None = Field(None, description="models with memory banks: the bank version used")
    state_version: int = Field(description="the stored state's version (its compare-and-set counter)")


class KtEventsAnswer(LearnerAnswer):
    events_absorbed: int
    events_skipped: int = Field(description="events whose event_id was applied before (replays)")
    events_total: int = Field(description="events in the learner's history")
    unknown_question_ids: list[str] | None = Field(None, description="question ids answered through the unknown "
                                                                     "row (present only then)")
    predictions: list[Prediction] | None
    explanation: Explanation | None = None


class KtPredictAnswer(LearnerAnswer):
    events_total: int
    predictions: list[Prediction]
    explanation: Explanation | None = None


class RankedQuestion(Answer):
    question_id: str
    score: float = Field(description="fisher: the item information at the learner's state; target: P(full credit)")
    theta: float | None = None
    known: bool = True


class KtNextItemAnswer(LearnerAnswer):
    strategy: Literal["fisher", "target"]
    items: list[RankedQuestion]


class ScoredStudent(Answer):
    student_id: str
    events: int
    event_predictions: list[Prediction] = Field(description="each event's prediction from the state before it")
    predictions: list[Prediction] | None


class KtBatchAnswer(Answer):
    model: str
    version: str
    bank_version: str | None = None
    students: list[ScoredStudent]


class KtSummary(LearnerAnswer):
    exists: bool
    events_total: int
    last_update: float | None
    ability: float | None = Field(description="GPCM: the mean of theta over every question the model knows")
    ability_range: list[float] | None
    mean_p_right: float | None = Field(None, description="models without theta: mean P(full credit) over the "
                                                         "questions")
    p_right_range: list[float] | None = None


KtDeleted = deleted("student")


class BankHead(Answer):
    type: str
    entries: int
    students: int | None


class BankVersion(Answer):
    version: str
    loaded: bool = Field(description="loaded and projected on this replica")
    heads: dict[str, BankHead]
    provenance: dict


class BankVersions(Answer):
    model: str
    version: str
    active: str | None = Field(description="the version the fleet serves")
    serving: str | None = Field(description="the version this replica serves now")
    versions: list[BankVersion]


class BankActivated(Answer):
    model: str
    version: str
    bank_version: str
    previous: str | None


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
