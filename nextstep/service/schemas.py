"""The shapes of the API that every part shares, importable without FastAPI, ONNX Runtime or numpy (the Python
client, nextstep/client, builds on them): ids, the strict request base, the answer base, and the answers of the
system routes and of the routes over the loaded models. Each task's own shapes are in its package's schemas.py.

Answers are declared for the OpenAPI document and the client; the service does not validate what it answers
against them (it encodes its answers directly, bench/answer_models.py measures what validating would cost), and
tests/service/test_answers.py checks every route's real answers against them instead."""

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, StringConstraints, create_model

MAX_ID = 200  # characters of any id: students, sessions, users, questions, items, cards, decks, events

# An id is opaque: any string of 1 to MAX_ID characters (in a path, percent-encoded: "org/42" -> org%2F42), or an
# integer id as JSON numbers carry it, bounded like a string one ("12" and 12 are the same id)
IdText = Annotated[StrictStr, StringConstraints(min_length=1, max_length=MAX_ID)]
Int64 = Annotated[StrictInt, Field(ge=-(2**63), le=2**63 - 1)]
ExternalId = IdText | Int64
EventId = Annotated[IdText | None, Field(description="replays of an id are applied once")]
# a time the app records and the model does not use: still a unix time, so that no NaN or year 1e300 is taken in
UnusedTime = Annotated[float | None, Field(ge=0, allow_inf_nan=False,
                                           description="unix seconds, at most NEXTSTEP_MAX_CLOCK_SKEW_SECONDS (a day "
                                                       "by default) ahead of the server's clock; kept as the event's "
                                                       "time in the event log (default: when it arrived), not used "
                                                       "by the models")]


class Strict(BaseModel):
    """A request body that refuses unknown fields (a typo is a 422, not silently ignored) and converts nothing:
    true is not 1, 1 is not true, "1.5" is not a number (strict mode; an integer is still a valid float)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class Answer(BaseModel):
    """An answer of the service. A field a later service adds is kept (`model_extra`), not refused, so that a
    client keeps working against a newer service; a field that is absent from an answer is its default (None)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)


class Rebuilt(Answer):
    """What an answer says of the logged events its version folded in before answering (a version whose state
    lagged the entity's event log: new, or another version took the latest events)."""

    rebuilt_from_events: int = Field(description="logged events folded into this version's state for this answer")
    events_not_in_log: int | None = Field(None, description="events this version lacks that the log no longer "
                                                            "holds (its bounds): left out")
    events_not_understood: int | None = Field(None, description="logged events naming an id or a response this "
                                                                "version does not know: left out")


# -- the system routes -----------------------------------------------------------------------------------------------
class Health(Answer):
    status: Literal["ok"]


class Refusal(Answer):
    """An artifact the last load refused, and what became of it."""

    model: str
    version: str
    path: str | None = Field(None, description="its directory (admins only)")
    reason: str = Field(description="why (for a client that is not an admin: the kind of fault only)")
    kind: str = Field(description="the kind of fault")
    kept: bool = Field(description="the version was serving, and keeps serving as it was loaded before")
    serving: str | None = Field(description="the model's version serving now; null: the model is not served")
    outcome: str = Field(description="what serves, in words")


class Ready(Answer):
    status: Literal["ready"]
    models: int = Field(description="model versions loaded")
    serving: dict[str, str] = Field(description="each model's version serving")
    refused: list[Refusal]


# -- the routes over the loaded models -------------------------------------------------------------------------------
class MigrateRequest(Strict):
    version: Annotated[IdText, Field(description="the version to bring up to date (default: the latest)")] = "latest"
    cursor: Annotated[IdText, Field(description="\"0\" to start; then the cursor of the previous answer")] = "0"
    limit: Annotated[StrictInt, Field(ge=1, le=5000, description="entities in this page (about)")] = 500

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [{"version": "2", "cursor": "0"}]})


class GateRequest(Strict):
    auto: bool = Field(True, description="apply the decision (promote or abort) without an operator; false: show it")
    alpha: Annotated[float | None, Field(gt=0, lt=1, description="the sequential test's error rate (default: "
                                                                 "NEXTSTEP_GATE_ALPHA, 0.05)")] = None
    min_gain: Annotated[float | None, Field(ge=-1, le=1, description="nats per event the candidate must gain to be "
                                                                     "promoted (default: NEXTSTEP_GATE_MIN_GAIN, 0); "
                                                                     "below 0, a margin: promoted when no worse than "
                                                                     "it")] = None
    min_events: Annotated[StrictInt | None, Field(ge=2, description="paired events before any decision (default: "
                                                                    "NEXTSTEP_GATE_MIN_EVENTS, 100)")] = None
    min_learners: Annotated[StrictInt | None, Field(ge=2, description="learners before any decision (default: "
                                                                      "NEXTSTEP_GATE_MIN_LEARNERS, 30)")] = None


class RolloutRequest(Strict):
    candidate: Annotated[IdText, Field(description="the version to try (a loaded one)")]
    mode: Annotated[Literal["canary", "shadow"], Field(
        description="canary: the candidate answers the entities in the fraction; shadow: it answers no one, and its "
                    "own state of each entity in the fraction follows their events, scored for live quality")
    ] = "canary"
    fraction: Annotated[float, Field(ge=0, le=1, description="share of the model's entities the candidate "
                                                             "answers, chosen by a hash of their id")]
    gate: Annotated[GateRequest | None, Field(
        description="a rollout decided by live evidence: both versions scored on the same events, an anytime-valid "
                    "confidence sequence for the mean loss difference, promote or abort when it excludes no gain "
                    "(knowledge tracing: log loss; sessions: 1 - 1/rank of the click; flashcards: log loss of "
                    "recall)")] = None
    ramp: Annotated[list[Annotated[float, Field(gt=0, le=1)]] | None, Field(
        min_length=2, description="a gated canary's fractions, increasing, the first its `fraction`: each promote "
                                  "decision moves it to the next (gated afresh), the last to everyone")] = None

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"candidate": "2", "mode": "canary", "fraction": 0.1}]})


class SrsWindow(Answer):
    size: int = Field(description="the user's reviews the model reads")
    card_size: int = Field(description="of which, at most this many of the card's own")


class ModelInfo(Answer):
    name: str
    version: str
    latest: bool = Field(description="the version that serves (unless a rollout says otherwise)")
    family: str
    task: str = Field(description="which routes answer it: knowledge_tracing (/v1/kt), next_item (/v1/sessions), "
                                  "srs (/v1/srs)")
    n_cats: int = Field(description="knowledge tracing: response categories; 0 for the other tasks")
    vocabulary: int = Field(description="ids the model knows (questions, items; 0 for flashcards)")
    metrics: dict[str, Any] = Field(description="its held-out metrics, from its manifest")
    window: SrsWindow | None = None


class ModelList(Answer):
    models: list[ModelInfo]
    refused: list[Refusal]
    errors: dict[str, str] = Field(description="\"model/version\": why it was refused")


class ModelIds(Answer):
    model: str
    version: str
    task: str
    vocabulary: str = Field(description="what the ids are: questions or items")
    total: int
    offset: int
    limit: int
    ids: list[str]
    next_offset: int | None = Field(description="the offset of the next page; null: this is the last")


class CalibrationRow(Answer):
    from_: float = Field(alias="from")
    to: float
    count: int
    predicted: float | None
    observed: float | None


class VersionQuality(Answer):
    """A version's live quality in its role. Probabilities (knowledge tracing, flashcards): log loss, Brier, AUC,
    calibration; ranking (sessions): mrr and hit rates."""

    version: str
    role: Literal["serving", "canary", "shadow", "inactive"]
    scored: int
    since: float | None = Field(description="the time of the first score counted; null: none")
    log_loss: float | None = None
    brier: float | None = None
    auc: float | None = None
    calibration: list[CalibrationRow] | None = None
    mrr: float | None = None
    hit_rate: dict[str, float | None] | None = None


class Quality(Answer):
    model: str
    task: str
    window_seconds: int
    versions: list[VersionQuality]


class GateDecision(Answer):
    decision: Literal["promote", "abort", "continue"]
    events: int = Field(description="paired events scored")
    learners: int = Field(0, description="learners they came from")
    mean_difference: float | None = Field(description="mean of loss(candidate) - loss(serving), nats per event")
    interval: list[float] | None = Field(description="the confidence sequence's interval for it")


class GateStatus(GateDecision):
    auto: bool
    alpha: float
    min_gain: float
    min_events: int
    min_learners: int


class DecisionRecord(GateDecision):
    candidate: str
    serving: str
    at: float
    applied: bool = Field(description="the gate changed the rollout itself (auto)")
    mode: Literal["canary", "shadow"]
    fraction: float = Field(description="the rollout's fraction when it decided")


class RolloutStatus(Answer):
    model: str
    serving: str = Field(description="the version answering every entity outside a canary's fraction")
    new_versions: Literal["auto", "manual"]
    candidate: str | None
    mode: Literal["canary", "shadow"] | None
    fraction: float | None
    updated: float | None
    versions: list[str] = Field(description="the model's loaded versions")
    gate: GateStatus | None = None
    ramp: list[float] | None = None
    decisions: list[DecisionRecord] = Field(default_factory=list, description="the gate's decisions, newest first")


class Migrated(Answer):
    model: str
    version: str
    cursor: str = Field(description="pass it back for the next page")
    done: bool
    entities: int
    rebuilt: int
    events: int
    lagging: int = Field(description="entities whose state another write kept moving: walk again later")


class Reloaded(Answer):
    models: list[str] = Field(description="\"name/version\" of every loaded version")
    serving: dict[str, str]
    withdrawn: list[str]
    refused: list[Refusal]
    fleet_generation: int | None = Field(description="the reload announced to the other replicas; null: not told")
    errors: dict[str, str]


def deleted(entity: str) -> type[Answer]:
    """The answer of a DELETE of an entity's state: {"<entity>_id": ..., "deleted": ...}."""
    fields = {f"{entity}_id": (str, ...), "deleted": (bool, Field(description="whether there was a state"))}
    return create_model(f"{entity.capitalize()}Deleted", __base__=Answer, **fields)
