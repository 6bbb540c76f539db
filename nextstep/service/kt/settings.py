"""Knowledge tracing's own settings (settings.py's Settings composes every task's): NEXTSTEP_STATE_TTL_SECONDS,
NEXTSTEP_BANK_REFRESH_SECONDS."""

from pydantic import BaseModel, Field


class KtSettings(BaseModel):
    state_ttl_seconds: float | None = Field(default=180 * 24 * 3600, gt=0)  # idle states expire
    bank_refresh_seconds: float = Field(default=1.0, ge=0)  # SimAKT: how stale a replica's active bank version may be


SETTINGS = KtSettings
