"""Flashcards' traffic as training data (event_export.py): each user's stored reviews, in the order they were
recorded, as the review-log CSV that `nextstep train time_aware` reads (reviews.py: user_id, card_id, deck_id,
review_time, rating, state, duration, day_offset); `day_offset` counts the user's scheduler days from their first
review's, by the day boundary the app told (stored.py's `Fit.day_start`; never told: 04:00 UTC, what the reader
assumes without the column), so training reads each user's boundary back.

A flashcard user's reviews are their stored state under a window layout (`srs:<model>:<schema>:<user>`), not a log:
the export takes each user's state under the newest layout that has one (`schemas`, newest first: the model's
versions under the artifacts directory, `srs_schemas`; then any other layout found in the store). Card and deck ids
are written as the service codes them (srs.id_hash: the int64 the model compares; the CSV's ids are integers), times
as stored (unix seconds, exact), durations in ms (empty when unknown), the state empty when unknown. The store keeps a
user's last `size` reviews and each card's last `card_size`: the summary counts the reviews it no longer holds
(`not_held`: sequence numbers missing), which the files lack.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..event_export import manifests
from ..state import StateStore, StoredState
from ..tasks import Export
from .stored import schema_hash

DEFAULT_DAY_START_S = 4 * 3600.0  # a user's day boundary when the app never told one (reviews.py's default)


def srs_schemas(artifacts: Path | None, model: str) -> list[str]:
    """The schemas (stored.schema_hash) of the window layouts of a flashcard model's versions under `artifacts`,
    newest version first, each once."""
    found = []
    for manifest in manifests(artifacts, model):
        try:
            window = manifest["window"]
            found.append(schema_hash(model, int(window["size"]), int(window["card_size"])))
        except (KeyError, TypeError, ValueError):
            continue  # (not a flashcard artifact this export can use)
    return list(dict.fromkeys(found))


def _duration_ms(seconds: float) -> str:
    """A stored duration (float32 seconds) in ms as the reader takes it back to the same float32; "" when unknown."""
    if np.isnan(seconds):
        return ""
    ms = float(seconds) * 1000.0
    return str(round(ms)) if np.float32(round(ms) / 1000.0) == np.float32(seconds) else repr(ms)


def _srs_rows(user: str, stored: StoredState) -> tuple[list[list], int]:
    """(the CSV rows of a user's stored reviews, in the order they were recorded; how many of their reviews the
    store no longer holds)."""
    from .refit import stored_rows
    from .stored import _decode

    history = _decode(StoredState(stored.version, stored.events, stored.updated, stored.blob))
    rows = stored_rows(history.recent, stored.fields) if len(history.recent) else history.recent
    start = history.fit.day_start if history.fit.day_start is not None else DEFAULT_DAY_START_S
    days = np.floor((rows["time"].astype(np.float64) - start) / 86400.0).astype(np.int64)
    if len(days):
        days -= days.min()  # (day 0: the first review's)
    out = [[user, int(r["card"]), int(r["deck"]), repr(float(r["time"])), int(r["rating"]),
            "" if int(r["state"]) < 0 else int(r["state"]), _duration_ms(r["duration"]), int(day)]
           for r, day in zip(rows, days, strict=True)]
    return out, history.count - len(rows)


@dataclass(frozen=True)
class ReviewExport(Export):
    """A user's stored reviews under the newest layout that holds them: `schemas`, the model's versions' (newest
    first), then the layout of the key found."""

    prefix: str = "srs"
    files: tuple[str, str] = ("{model}_train.csv.gz", "{model}_test.csv.gz")
    delimiter: str = ","
    header: tuple[str, ...] = ("user_id", "card_id", "deck_id", "review_time", "rating", "state", "duration",
                               "day_offset")
    schemas: tuple[str, ...] = ()
    lacking = "not_held"

    def for_model(self, artifacts: Path | None, model: str) -> ReviewExport:
        return replace(self, schemas=tuple(srs_schemas(artifacts, model)))

    def entity(self, rest: str) -> str:
        return rest.partition(":")[2]  # (<schema>:<user>)

    async def rows(self, store: StateStore, prefix: str, rest: str, entity: str) -> tuple[list[list], int] | None:
        schema = rest.partition(":")[0]
        for source in [*self.schemas, schema] if schema not in self.schemas else self.schemas:
            state = await store.read_all(f"{prefix}{source}:{entity}")
            if state.exists and state.blob:
                return _srs_rows(entity, state)
        return None


EXPORT = ReviewExport()
