"""Service settings, from the environment (prefix NEXTSTEP_) or a .env file."""

import importlib
import importlib.util
import itertools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from .errors import TooLarge
from .state import LogBounds


@dataclass(frozen=True)
class BatchLimits:
    """What one stateless batch request (kt/batch, sessions/batch) may cost: its work is one or two graph calls per
    event, so its events are bounded per student (or session) and in all, and the questions it predicts in all."""

    events: int = 1_000  # per student or session (NEXTSTEP_MAX_EVENTS)
    batch_events: int = 2_000  # summed over the request (NEXTSTEP_MAX_BATCH_EVENTS)
    questions: int = 2_000  # predicted questions summed over the request (NEXTSTEP_MAX_QUESTIONS)

    def check(self, listed: str, events: Sequence[int], events_field: str, questions: Sequence[int] = (),
              questions_field: str = "") -> None:
        """TooLarge (413) naming the first field over a limit: `listed[i].events_field` for one item, `listed` for
        the request's total."""
        for i, n in enumerate(events):
            if n > self.events:
                raise TooLarge(f"{listed}[{i}].{events_field}", f"{n} items; at most {self.events} each "
                                                                 "(NEXTSTEP_MAX_EVENTS)")
        if sum(events) > self.batch_events:
            raise TooLarge(listed, f"{sum(events)} events in one batch request; at most {self.batch_events} "
                                   "(NEXTSTEP_MAX_BATCH_EVENTS): split it into several requests")
        if sum(questions) > self.questions:
            i = next(i for i, n in enumerate(itertools.accumulate(questions)) if n > self.questions)
            raise TooLarge(f"{listed}[{i}].{questions_field}", f"{sum(questions)} questions to predict in one batch "
                                                                f"request; at most {self.questions} "
                                                                "(NEXTSTEP_MAX_QUESTIONS)")


DEFAULT_LIMITS = BatchLimits()
MIN_KEY_LENGTH = 16  # characters of an API key (docs/decisions.md, "API keys")


class SettingsError(ValueError):
    """Settings that cannot be served: one line naming each setting at fault and why, never its value (a key)."""


def _key_faults(keys: list[str]) -> str | None:
    """What is wrong with a list of API keys, in words that never show a key; None when nothing is."""
    for i, key in enumerate(keys, 1):
        which = f"key {i} of {len(keys)}"
        if not key.strip():
            return f"{which} is empty (a stray comma, or \"\" in a JSON list)"
        if not all("!" <= c <= "~" for c in key):  # (a header value loses its outer spaces; no client sends these)
            return f"{which} holds a space or a character other than printable ASCII"
        if len(key) < MIN_KEY_LENGTH:
            return (f"{which} has {len(key)} characters, fewer than {MIN_KEY_LENGTH} (make keys with e.g. "
                    "`openssl rand -hex 24`)")
    return None


class CoreSettings(BaseSettings):
    """The settings every task shares; each task's own are its package's (settings.py), and `Settings` is the
    whole."""

    # (hide_input_in_errors: a refused setting is named, its value never echoed: URLs and keys hold secrets)
    model_config = SettingsConfigDict(env_prefix="NEXTSTEP_", env_file=".env", extra="ignore",
                                      hide_input_in_errors=True)

    artifacts_dir: Path = Path("artifacts")  # <dir>/<model>/<version>/manifest.json
    # served while artifacts_dir holds no artifact; a reload that finds one there serves artifacts_dir alone
    # (`nextstep serve --demo` sets it to the bundled demo models)
    demo_artifacts_dir: Path | None = None
    redis_url: str | None = None  # unset: the in-process store (state lives and dies with the process)
    # How the service talks to Redis (redis_clients.py; a query parameter of the URL of the same meaning wins).
    # client: resp (the service's own pipelined client, one node), redis-py, or auto (resp for one node without
    # wait_replicas, else redis-py; cluster and Sentinel URLs always take redis-py). docs/decisions.md, "Redis clients".
    redis_client: str = Field(default="auto", pattern="^(auto|resp|redis-py)$")
    redis_timeout_seconds: float = Field(default=0.5, gt=0)  # a reply later than this: the server is hung (503)
    redis_connect_timeout_seconds: float = Field(default=0.5, gt=0)
    redis_pool_size: int = Field(default=64, ge=1)  # redis-py: connections per node
    redis_retries: int = Field(default=1, ge=0)  # retries of reads after a connection failure or timeout
    # durability: a write is acknowledged once this many replicas have it (WAIT), else a 503 after the timeout
    redis_wait_replicas: int = Field(default=0, ge=0)
    redis_wait_timeout_ms: int = Field(default=100, ge=1)
    # a question (knowledge tracing) or item (sessions) id the model never saw: answer it through the version's unknown
    # row, trained for it, flagged "known": false and counted (nextstep_unknown_ids_total); or error: a 422 naming the
    # field. A version trained without that row (before it existed) refuses them either way (docs/decisions.md)
    unknown_questions: str = Field(default="answer", pattern="^(answer|error)$")
    max_event_ids: int = Field(default=10_000, ge=1)  # replay protection window per entity
    # each learner's and session's event log (state.py), from which a new model version rebuilds its state: at most
    # this many events (past it the oldest eighth goes at once) and none older than the age (unset: any age). 10,000
    # events cost about 9 B each plus the question or item id's length (docs/scaling.md), and a rebuild steps every
    # one of them once per learner and version
    max_logged_events: int = Field(default=10_000, ge=1)
    log_max_age_seconds: float | None = Field(default=None, gt=0)
    # live quality (quality.py): each knowledge-tracing event scores the prediction the serving version would have
    # made for it (after the answer; single events together, one graph call for many); GET
    # /v1/models/{model}/quality and the nextstep_live_* metrics
    live_quality: bool = True
    # a model version added to the artifacts directory after the model served: `auto` makes it latest at the next
    # reload (the newest version serves); `manual` loads and validates it but serves it to no one until a rollout
    # names it (PUT /v1/models/{model}/rollout, then promote)
    new_versions: str = Field(default="auto", pattern="^(auto|manual)$")
    # a shadow rollout's candidate follows each learner's log off the request path, through a queue of this many
    # learners per task; when it is full a learner is skipped (nextstep_shadow_total{outcome="dropped"}) and caught up
    # unscored on its next turn
    shadow_queue: int = Field(default=1_000, ge=1)
    # a gated shadow (PUT rollout with "gate"): what a gate without its own settings takes (gate.py): the sequential
    # test's error rate, the gain in nats per event a promotion needs, the paired events and learners before any
    # decision
    gate_alpha: float = Field(default=0.05, gt=0, lt=1)
    gate_min_gain: float = Field(default=0.0, ge=0)
    gate_min_events: int = Field(default=100, ge=2)
    gate_min_learners: int = Field(default=30, ge=2)
    # how far ahead of the server's clock a time from a client may be (srs review times, event timestamps; a query's
    # time may be any): a day lets a device clock a time zone or a date off still sync, and a review taken at the
    # limit holds that user's later reviews (which must not be older) back for at most a day
    max_clock_skew_seconds: float = Field(default=86400.0, ge=0)
    # API keys (X-API-Key header). Normal keys may call every route but the admin ones; admin keys every route. With
    # no key of either kind set, nothing is authenticated (development), and the admin routes (model reload, bank
    # swaps, every DELETE) are served to loopback clients only: see docs/decisions.md, "Access". Each key is at
    # least MIN_KEY_LENGTH printable ASCII characters, and in one list only; anything else refuses to start.
    api_keys: Annotated[list[str], NoDecode] = []
    admin_keys: Annotated[list[str], NoDecode] = []
    max_batch: int = Field(default=64, ge=1)  # micro-batching: rows per ONNX Runtime call
    max_wait_ms: float = Field(default=1.0, ge=0)  # micro-batching: how long queued requests wait for company
    ort_threads: int = Field(default=1, ge=1)  # ONNX Runtime intra-op threads per session
    max_events: int = Field(default=1_000, ge=1)  # events per request
    max_questions: int = Field(default=2_000, ge=1)  # questions per predict / next-item request
    max_batch_students: int = Field(default=256, ge=1)  # students per stateless batch request
    # events per batch request, all students together: one graph call per event, about 0.1 ms each, so the largest
    # request takes a worker for a fraction of a second (docs/decisions.md)
    max_batch_events: int = Field(default=2_000, ge=1)
    max_body_bytes: int = Field(default=2_000_000, ge=1_024)
    # the request line and headers together, in bytes: a longer head is answered 431 and its connection closed
    # before it is read whole (server.py)
    max_header_bytes: int = Field(default=65_536, ge=1_024)
    header_timeout_seconds: float = Field(default=10.0, gt=0)  # a request's line and headers must arrive within this
    body_timeout_seconds: float = Field(default=30.0, gt=0)  # and its body within this after them (server.py)
    cas_retries: int = Field(default=100, ge=1)  # optimistic-concurrency retries before 409
    # a reload on one replica reaches every replica sharing the Redis within this (plus one reload's work): each
    # reads the reload generation this often (fleet.py)
    reload_refresh_seconds: float = Field(default=2.0, gt=0)
    opentelemetry: bool = False  # FastAPI's native OpenTelemetry (needs a provider); /metrics is ours

    def __init__(self, **values) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:  # one line naming each setting at fault (`nextstep serve` prints it)
            faults = []
            for error in exc.errors(include_url=False, include_input=False, include_context=False):
                message = error["msg"].removeprefix("Value error, ")
                if error["loc"]:  # (a model-wide fault names its settings itself)
                    where = "".join(f"[{p}]" for p in error["loc"][1:])  # the entry of a list: [0]
                    message = f"NEXTSTEP_{str(error['loc'][0]).upper()}{where}: {message}"
                faults.append(message)
            raise SettingsError("; ".join(faults)) from None

    def redis_options(self):
        from .redis_clients import RedisOptions

        return RedisOptions(client=self.redis_client, socket_timeout=self.redis_timeout_seconds,
                            connect_timeout=self.redis_connect_timeout_seconds, pool_size=self.redis_pool_size,
                            retries=self.redis_retries, wait_replicas=self.redis_wait_replicas,
                            wait_timeout_ms=self.redis_wait_timeout_ms)

    @model_validator(mode="after")
    def _redis_url_parses(self):
        """A malformed NEXTSTEP_REDIS_URL (scheme, port, database, parameters) is refused at start, not met later;
        the message shows the URL without its passwords."""
        if self.redis_url:
            from .redis_clients import parse_url

            try:
                parse_url(self.redis_url, self.redis_options())
            except ValueError as exc:
                raise ValueError(f"NEXTSTEP_REDIS_URL: {exc}") from None
        return self

    def batch_limits(self) -> BatchLimits:
        return BatchLimits(self.max_events, self.max_batch_events, self.max_questions)

    def log_bounds(self) -> LogBounds:
        return LogBounds(self.max_logged_events, self.log_max_age_seconds)

    @field_validator("api_keys", "admin_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        # NEXTSTEP_API_KEYS=key1,key2 or a JSON list; the same for ADMIN_KEYS. Empty (or unset): no keys. Every
        # entry is kept, empty ones too, so that `_keys` refuses them: a stray comma is a mistake to point out
        if isinstance(value, str):
            if value == "":
                return []
            if value.strip().startswith("["):
                try:
                    return json.loads(value)
                except json.JSONDecodeError:
                    raise ValueError("not a JSON list of keys (starts with '[' but does not parse)") from None
            return [k.strip() for k in value.split(",")]
        return value

    @field_validator("api_keys", "admin_keys")
    @classmethod
    def _keys(cls, keys: list[str]) -> list[str]:
        fault = _key_faults(keys)
        if fault:
            raise ValueError(fault)
        return keys

    @model_validator(mode="after")
    def _one_role_per_key(self):
        if set(self.api_keys) & set(self.admin_keys):
            raise ValueError("a key is in both NEXTSTEP_API_KEYS and NEXTSTEP_ADMIN_KEYS: give each key one role "
                             "(admin keys may call every route already)")
        return self


def _sections() -> tuple[type[BaseModel], ...]:
    """Each task's own settings (its package's settings.py, `SETTINGS`: a pydantic model of its fields), in
    TASK_MODULES's order; a task without one has none of its own."""
    from . import TASK_MODULES, package

    return tuple(importlib.import_module(f"{package(name)}.settings").SETTINGS for name in TASK_MODULES
                 if importlib.util.find_spec(f"{package(name)}.settings") is not None)


class Settings(CoreSettings, *_sections()):
    """Every NEXTSTEP_* setting: the shared ones and each task's (their names as the environment gives them:
    docs/guide/operations.md's table)."""
