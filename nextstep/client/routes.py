"""The API's routes as the client calls them: one method per route, grouped by task (`client.kt`, `client.sessions`,
`client.srs`) and for the models and the service (`client.models`, `client.system`), named as the routes are. Each
method builds a `Call` (what to send, the answer's model, whether sending it again is safe) and hands it to its
client's `send`: the synchronous client answers the parsed answer, the asynchronous one an awaitable of it.

Every write of events (`kt.events`, `sessions.events`, `srs.reviews`) gives each event without an `event_id` one
the client makes (a random UUID), before the first attempt: every attempt then carries the same ids, so that the
service applies each event once however many attempts reach it."""

import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import quote

from pydantic import BaseModel

from ..service import schemas
from ..service.kt import schemas as kt
from ..service.sessions import schemas as rec
from ..service.srs import schemas as srs

# a call's retry rule. "always": sending it again changes nothing that the first did not (reads, stateless scoring,
# PUT and DELETE, writes of events with ids); "unsent": only when no attempt can have reached the service's state
Repeat = Literal["always", "unsent"]


@dataclass(frozen=True)
class Call:
    method: str
    path: str
    answer: type[BaseModel]
    body: dict | None = None
    params: dict | None = None
    repeat: Repeat = "always"


def segment(value: str) -> str:
    """An id as one path segment: percent-encoded, slashes and dots too (a client would drop "." and ".." segments)."""
    return quote(str(value), safe="").replace(".", "%2E")


def given(**fields) -> dict:
    """A request body of the fields given (None: not given, so that the service's default applies)."""
    return {k: v for k, v in fields.items() if v is not None}


def plain(item: Mapping | BaseModel) -> dict:
    """An event or a query as the API takes it: a dict shaped like the API's, or the request model's object."""
    if isinstance(item, BaseModel):
        return item.model_dump(mode="json", exclude_none=True)
    return dict(item)


def with_ids(events: Iterable[Mapping | BaseModel]) -> list[dict]:
    """The events as dicts, each without an event_id given one (kept by every attempt of the call)."""
    out = []
    for event in events:
        event = plain(event)
        if event.get("event_id") is None:
            event["event_id"] = uuid.uuid4().hex
        out.append(event)
    return out


class Routes:
    """A group of routes; `send` is the client's (it pins versions, retries and parses)."""

    def __init__(self, send: Callable[[Call], Any], model_path: Callable[[str], str]):
        self._send, self._model = send, model_path


class KnowledgeTracing(Routes):
    """/v1/kt/{model}/...: learners answering questions."""

    def _path(self, model: str, rest: str) -> str:
        return f"/v1/kt/{self._model(model)}/{rest}"

    def events(self, model: str, student_id: str, events: Iterable[Mapping | kt.KtEvent],
               predict_question_ids: list | None = None, explain: bool | None = None) -> kt.KtEventsAnswer:
        """Fold a learner's new responses into their state (and predict these questions afterwards)."""
        return self._send(Call("POST", self._path(model, "events"), kt.KtEventsAnswer, given(
            student_id=student_id, events=with_ids(events), predict_question_ids=predict_question_ids,
            explain=explain)))

    def predict(self, model: str, student_id: str, question_ids: list, explain: bool | None = None
                ) -> kt.KtPredictAnswer:
        return self._send(Call("POST", self._path(model, "predict"), kt.KtPredictAnswer, given(
            student_id=student_id, question_ids=question_ids, explain=explain)))

    def next_item(self, model: str, student_id: str, candidate_question_ids: list | None = None,
                  strategy: Literal["fisher", "target"] | None = None, target: float | None = None,
                  k: int | None = None) -> kt.KtNextItemAnswer:
        return self._send(Call("POST", self._path(model, "next-item"), kt.KtNextItemAnswer, given(
            student_id=student_id, candidate_question_ids=candidate_question_ids, strategy=strategy, target=target,
            k=k)))

    def batch(self, model: str, students: Iterable[Mapping | kt.KtSequence]) -> kt.KtBatchAnswer:
        """Stateless scoring of whole sequences (nothing is stored)."""
        return self._send(Call("POST", self._path(model, "batch"), kt.KtBatchAnswer,
                               {"students": [plain(s) for s in students]}))

    def student(self, model: str, student_id: str) -> kt.KtSummary:
        return self._send(Call("GET", self._path(model, f"students/{segment(student_id)}"), kt.KtSummary))

    def delete_student(self, model: str, student_id: str) -> BaseModel:
        return self._send(Call("DELETE", self._path(model, f"students/{segment(student_id)}"), kt.KtDeleted))

    def banks(self, model: str) -> kt.BankVersions:
        return self._send(Call("GET", self._path(model, "banks"), kt.BankVersions))

    def activate_bank(self, model: str, version: str) -> kt.BankActivated:
        return self._send(Call("PUT", self._path(model, "banks/active"), kt.BankActivated, {"version": version}))


class Sessions(Routes):
    """/v1/sessions/{model}/...: next-item sessions."""

    def _path(self, model: str, rest: str) -> str:
        return f"/v1/sessions/{self._model(model)}/{rest}"

    def events(self, model: str, session_id: str, events: Iterable[Mapping | rec.SessionClick],
               recommend_k: int | None = None, exclude_seen: bool | None = None,
               unknown_items: Literal["answer", "error", "skip"] | None = None) -> rec.SessionEventsAnswer:
        """Fold a session's new clicks into its state (and recommend `recommend_k` items afterwards)."""
        return self._send(Call("POST", self._path(model, "events"), rec.SessionEventsAnswer, given(
            session_id=session_id, events=with_ids(events), recommend_k=recommend_k, exclude_seen=exclude_seen,
            unknown_items=unknown_items)))

    def recommend(self, model: str, session_id: str, k: int | None = None, exclude_seen: bool | None = None
                  ) -> rec.SessionRecommendAnswer:
        return self._send(Call("POST", self._path(model, "recommend"), rec.SessionRecommendAnswer, given(
            session_id=session_id, k=k, exclude_seen=exclude_seen)))

    def batch(self, model: str, sessions: Iterable[Mapping | rec.SessionSequence], k: int | None = None,
              exclude_seen: bool | None = None, unknown_items: Literal["answer", "error", "skip"] | None = None
              ) -> rec.SessionBatchAnswer:
        return self._send(Call("POST", self._path(model, "batch"), rec.SessionBatchAnswer, given(
            sessions=[plain(s) for s in sessions], k=k, exclude_seen=exclude_seen, unknown_items=unknown_items)))

    def session(self, model: str, session_id: str) -> rec.SessionSummary:
        return self._send(Call("GET", self._path(model, segment(session_id)), rec.SessionSummary))

    def delete_session(self, model: str, session_id: str) -> BaseModel:
        return self._send(Call("DELETE", self._path(model, segment(session_id)), rec.SessionDeleted))


class SpacedRepetition(Routes):
    """/v1/srs/{model}/...: flashcard reviews, predictions, schedules."""

    def _path(self, model: str, rest: str) -> str:
        return f"/v1/srs/{self._model(model)}/{rest}"

    def reviews(self, model: str, user_id: str, reviews: Iterable[Mapping | srs.SrsReview],
                predict: Mapping | srs.SrsQuery | None = None, day_start_hour_utc: float | None = None
                ) -> srs.SrsReviewsAnswer:
        """Record a user's reviews, in time order (and predict a review afterwards)."""
        return self._send(Call("POST", self._path(model, "reviews"), srs.SrsReviewsAnswer, given(
            user_id=user_id, reviews=with_ids(reviews), predict=plain(predict) if predict is not None else None,
            day_start_hour_utc=day_start_hour_utc)))

    def predict(self, model: str, user_id: str, card_id, deck_id=None, time: float | None = None
                ) -> srs.SrsPredictAnswer:
        return self._send(Call("POST", self._path(model, "predict"), srs.SrsPredictAnswer, given(
            user_id=user_id, card_id=card_id, deck_id=deck_id, time=time)))

    def schedule(self, model: str, user_id: str, cards: Iterable[Mapping | srs.SrsCard], desired_retention: float,
                 now: float | None = None, horizon_days: float | None = None) -> srs.SrsScheduleAnswer:
        return self._send(Call("POST", self._path(model, "schedule"), srs.SrsScheduleAnswer, given(
            user_id=user_id, cards=[plain(c) for c in cards], desired_retention=desired_retention, now=now,
            horizon_days=horizon_days)))

    def simulate(self, model: str, user_id: str, cards: Iterable[Mapping | srs.SrsCard] | None = None,
                 **options) -> srs.SrsSimulateAnswer:
        """`options`: new_cards, new_cards_per_day, days, desired_retentions, now, seed (the route's fields)."""
        return self._send(Call("POST", self._path(model, "simulate"), srs.SrsSimulateAnswer, given(
            user_id=user_id, cards=[plain(c) for c in cards] if cards is not None else None, **options)))

    def user(self, model: str, user_id: str) -> srs.SrsSummary:
        return self._send(Call("GET", self._path(model, f"users/{segment(user_id)}"), srs.SrsSummary))

    def delete_user(self, model: str, user_id: str) -> BaseModel:
        return self._send(Call("DELETE", self._path(model, f"users/{segment(user_id)}"), srs.SrsDeleted))


class Models(Routes):
    """/v1/models/...: the loaded models, their ids, live quality, rollouts, migration and the reload (the routes
    that change anything need an admin key where the service has keys)."""

    def list(self) -> schemas.ModelList:
        return self._send(Call("GET", "/v1/models", schemas.ModelList))

    def ids(self, model: str, offset: int | None = None, limit: int | None = None) -> schemas.ModelIds:
        return self._send(Call("GET", f"/v1/models/{self._model(model)}/ids", schemas.ModelIds,
                               params=given(offset=offset, limit=limit)))

    # (rollouts and quality act on a model as a whole: never pinned)
    def quality(self, model: str, window: int | None = None) -> schemas.Quality:
        return self._send(Call("GET", f"/v1/models/{segment(model)}/quality", schemas.Quality,
                               params=given(window=window)))

    def rollout(self, model: str) -> schemas.RolloutStatus:
        return self._send(Call("GET", f"/v1/models/{segment(model)}/rollout", schemas.RolloutStatus))

    def set_rollout(self, model: str, candidate: str, fraction: float,
                    mode: Literal["canary", "shadow"] | None = None,
                    gate: Mapping | schemas.GateRequest | None = None) -> schemas.RolloutStatus:
        """PUT the model's rollout: `candidate` answers (canary) or shadows `fraction` of the entities; a shadow with
        a `gate` ({} for the service's defaults) is promoted or aborted by the evidence."""
        return self._send(Call("PUT", f"/v1/models/{segment(model)}/rollout", schemas.RolloutStatus,
                               given(candidate=candidate, mode=mode, fraction=fraction,
                                     gate=plain(gate) if gate is not None else None)))

    def promote(self, model: str) -> schemas.RolloutStatus:
        # (not repeated once sent: a second promote after the first took effect would be refused, not ignored)
        return self._send(Call("POST", f"/v1/models/{segment(model)}/rollout/promote", schemas.RolloutStatus,
                               repeat="unsent"))

    def abort(self, model: str) -> schemas.RolloutStatus:
        return self._send(Call("DELETE", f"/v1/models/{segment(model)}/rollout", schemas.RolloutStatus))

    def migrate(self, model: str, version: str | None = None, cursor: str | None = None, limit: int | None = None
                ) -> schemas.Migrated:
        """One page of a migration; call again with the answer's `cursor` until `done`."""
        return self._send(Call("POST", f"/v1/models/{segment(model)}/migrate", schemas.Migrated,
                               given(version=version, cursor=cursor, limit=limit)))

    def reload(self) -> schemas.Reloaded:
        return self._send(Call("POST", "/v1/models/reload", schemas.Reloaded))


class System(Routes):
    def health(self) -> schemas.Health:
        return self._send(Call("GET", "/healthz", schemas.Health))

    def ready(self) -> schemas.Ready:
        return self._send(Call("GET", "/readyz", schemas.Ready))
