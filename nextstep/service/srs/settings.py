"""Flashcards' own settings (settings.py's Settings composes every task's): NEXTSTEP_SRS_*."""

from pydantic import BaseModel, Field


class SrsSettings(BaseModel):
    # spaced-repetition users: idle expiry, refreshed by every review they record; 0 = never. Two years: a user who
    # reviews at all, even one card a year, keeps everything; one who has not reviewed for two years has left (and
    # has forgotten most of it), and Redis does not fill with abandoned histories.
    srs_ttl_seconds: float = Field(default=730 * 86400, ge=0)
    srs_max_schedule_cards: int = Field(default=100, ge=1)  # cards per srs schedule request
    # the longest interval a flashcard is scheduled (and simulated) at, in days from the card's last review. Five
    # years, not Anki's 36,500 days: no collection we hold shows a gap over 515 days (16 users, histories up to
    # 1,026 days), so an interval of many years is the model's extrapolation, and the costs are lopsided: capping a
    # card that would have waited 10 years costs one review in five years; letting it wait loses the card
    srs_max_interval_days: int = Field(default=1825, ge=1, le=36500)
    srs_max_simulate_cards: int = Field(default=10_000, ge=1)  # cards per srs simulate request (stored or given)
    # a flashcard user's FSRS-6 parameters are refitted from their stored reviews (off the request path) once they
    # have this many scored reviews (fsrs-rs fits only the initial stabilities below 64 items and keeps its defaults
    # below 8) ...
    srs_refit_min_scored: int = Field(default=32, ge=1)
    # ... and again whenever this many more have arrived since the last fit
    srs_refit_every_scored: int = Field(default=100, ge=1)
    # who refits them: `auto`, the service itself (a write that leaves a user due a fit queues them for the
    # replica's refit worker: one fit at a time, in a process of its own, under a lease per user; where fsrs-rs is
    # not installed it says so at startup and refits nothing); `off`, only `nextstep srs refit`. docs/decisions.md,
    # "Flashcard refits in the service"
    srs_refit: str = Field(default="auto", pattern="^(auto|off)$")
    # users waiting for the refit worker, per replica; past it a user is dropped (nextstep_srs_refits_total{outcome=
    # "dropped"}) and queued again by their next review
    srs_refit_queue: int = Field(default=1_000, ge=1)


SETTINGS = SrsSettings
