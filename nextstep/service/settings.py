"""Service settings, from the environment (prefix NEXTSTEP_) or a .env file."""

import json
from pathlib import Path
from typing import Annotated

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="NEXTSTEP_", env_file=".env", extra="ignore")

    artifacts_dir: Path = Path("artifacts")  # <dir>/<model>/<version>/manifest.json
    redis_url: str | None = None  # unset: the in-process store (state lives and dies with the process)
    state_ttl_seconds: float | None = Field(default=180 * 24 * 3600, gt=0)  # idle states expire
    session_ttl_seconds: float | None = Field(default=1800, gt=0)  # next-item sessions: idle timeout
    # spaced-repetition users: idle expiry, refreshed by every review they record; 0 = never. Two years: a user who
    # reviews at all, even one card a year, keeps everything; one who has not reviewed for two years has left (and
    # has forgotten most of it), and Redis does not fill with abandoned histories.
    srs_ttl_seconds: float = Field(default=730 * 86400, ge=0)
    srs_max_schedule_cards: int = Field(default=100, ge=1)  # cards per srs schedule request
    cold_start_model: str | None = None  # next-item model answering sessions with no click yet (e.g. popularity)
    max_event_ids: int = Field(default=10_000, ge=1)  # replay protection window per entity
    # API keys (X-API-Key header). Normal keys may call every route but the admin ones; admin keys every route. With
    # no key of either kind set, nothing is authenticated (development), and the admin routes (model reload, bank
    # swaps, every DELETE) are served to loopback clients only: see docs/decisions.md, "Access".
    api_keys: Annotated[list[str], NoDecode] = []
    admin_keys: Annotated[list[str], NoDecode] = []
    max_batch: int = Field(default=64, ge=1)  # micro-batching: rows per ONNX Runtime call
    max_wait_ms: float = Field(default=1.0, ge=0)  # micro-batching: how long queued requests wait for company
    ort_threads: int = Field(default=1, ge=1)  # ONNX Runtime intra-op threads per session
    max_events: int = Field(default=1_000, ge=1)  # events per request
    max_questions: int = Field(default=2_000, ge=1)  # questions per predict / next-item request
    max_batch_students: int = Field(default=256, ge=1)  # students per stateless batch request
    max_body_bytes: int = Field(default=2_000_000, ge=1_024)
    header_timeout_seconds: float = Field(default=10.0, gt=0)  # a request's line and headers must arrive within this
    body_timeout_seconds: float = Field(default=30.0, gt=0)  # and its body within this after them (server.py)
    cas_retries: int = Field(default=100, ge=1)  # optimistic-concurrency retries before 409
    bank_refresh_seconds: float = Field(default=1.0, ge=0)  # SimAKT: how stale a replica's active bank version may be
    opentelemetry: bool = False  # FastAPI's native OpenTelemetry (needs a provider); /metrics is ours

    @field_validator("api_keys", "admin_keys", mode="before")
    @classmethod
    def _comma_separated(cls, value):
        if isinstance(value, str):  # NEXTSTEP_API_KEYS=key1,key2 (JSON lists work too); the same for ADMIN_KEYS
            value = value.strip()
            if value.startswith("["):
                return json.loads(value)
            return [k.strip() for k in value.split(",") if k.strip()]
        return value
