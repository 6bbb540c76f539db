"""Next-item sessions' own settings (settings.py's Settings composes every task's): NEXTSTEP_SESSION_TTL_SECONDS,
NEXTSTEP_COLD_START_MODEL."""

from pydantic import BaseModel, Field


class SessionSettings(BaseModel):
    session_ttl_seconds: float | None = Field(default=1800, gt=0)  # next-item sessions: idle timeout
    cold_start_model: str | None = None  # next-item model answering sessions with no click yet (e.g. popularity)


SETTINGS = SessionSettings
