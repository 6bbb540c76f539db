"""The traffic as training data: every entity's event log written as the files `nextstep train` reads.

`export_events` walks the store's keys of one model (state.py's `scan`: one page at a time, every primary of a
Redis Cluster) and writes each entity's logged events, oldest first, to a train or a test file, chosen by a hash
of the entity id (the same entity always falls on the same side, whoever exports, and a larger test fraction
only moves entities from train to test). Nothing but one entity's log is held in memory.

* knowledge tracing: `<model>_train.csv.gz` and `<model>_test.csv.gz`, the long format (data.py: learner_id,
  question_id, response, timestamp; ids as the app sent them), and `metadata.json` with the model's number of
  response categories;
* sessions: `<model>_train_full.tsv.gz` and `<model>_test.tsv.gz`, GRU4Rec's TSV (SessionId, ItemId, Time);
* flashcards: `<model>_train.csv.gz` and `<model>_test.csv.gz`, the review-log CSV that `nextstep train time_aware`
  reads (training/srs/reviews.py: user_id, card_id, deck_id, review_time, rating, state, duration, day_offset), from
  the reviews the store holds for each user (srs.py: the recent block and every card's field, each review once, in the
  order they were recorded); `day_offset` counts the user's scheduler days from their first review's, by the day
  boundary the app told (srs.py's `Fit.day_start`; never told: 04:00 UTC, what the reader assumes without the
  column), so training reads each user's boundary back.

Times are the logged ones (whole seconds). Events trimmed from a log (NEXTSTEP_MAX_LOGGED_EVENTS,
NEXTSTEP_LOG_MAX_AGE_SECONDS) are not in it: the summary counts them (`not_in_log`).

A flashcard user's reviews are their stored state under a window layout (`srs:<model>:<schema>:<user>`), not a log:
the export takes each user's state under the newest layout that has one (`schemas`, newest first: the model's
versions under the artifacts directory, `srs_schemas`; then any other layout found in the store). Card and deck ids
are written as the service codes them (srs.id_hash: the int64 the model compares; the CSV's ids are integers), times
as stored (unix seconds, exact), durations in ms (empty when unknown), the state empty when unknown. The store keeps a
user's last `size` reviews and each card's last `card_size`: the summary counts the reviews it no longer holds
(`not_held`: sequence numbers missing), which the files lack.
"""

from __future__ import annotations

import csv
import glob
import gzip
import hashlib
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .kt import logged_event
from .state import LogRow, StateStore, StoredState


@dataclass(frozen=True)
class Layout:
    prefix: str  # of the task's keys (core.StatefulTask.PREFIX)
    train: str  # file names, {model} filled in
    test: str
    delimiter: str
    header: tuple[str, ...]
    row: Callable[[str, LogRow], list]  # (entity id, logged event) -> the file's row


def _kt_row(entity: str, row: LogRow) -> list:
    event = logged_event(row)
    return [entity, event.question_id, event.response, int(row.time)]


def _session_row(entity: str, row: LogRow) -> list:
    return [entity, row.payload.decode(), int(row.time)]


LAYOUTS = {
    "knowledge_tracing": Layout("kt", "{model}_train.csv.gz", "{model}_test.csv.gz", ",",
                                ("learner_id", "question_id", "response", "timestamp"), _kt_row),
    "next_item": Layout("sess", "{model}_train_full.tsv.gz", "{model}_test.tsv.gz", "\t",
                        ("SessionId", "ItemId", "Time"), _session_row),
}


SRS_HEADER = ("user_id", "card_id", "deck_id", "review_time", "rating", "state", "duration", "day_offset")
DEFAULT_DAY_START_S = 4 * 3600.0  # a user's day boundary when the app never told one (reviews.py's default)
SRS_FILES = ("{model}_train.csv.gz", "{model}_test.csv.gz")
EXPORTED = (*LAYOUTS, "srs")  # the tasks whose traffic exports


def srs_schemas(artifacts: Path, model: str) -> list[str]:
    """The schemas (srs.schema_hash) of the window layouts of a flashcard model's versions under `artifacts`, newest
    version (manifest `created`) first, each once: read from the manifests, no graph loaded."""
    from .srs import schema_hash

    found = []
    for path in artifacts.glob(f"{glob.escape(model)}/*/manifest.json"):
        try:
            manifest = json.loads(path.read_text())
            window = manifest["window"]
            found.append((str(manifest.get("created")), path.parent.name,
                          schema_hash(model, int(window["size"]), int(window["card_size"]))))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # (not a flashcard artifact this export can use)
    return list(dict.fromkeys(schema for *_, schema in sorted(found, reverse=True)))


def _duration_ms(seconds: float) -> str:
    """A stored duration (float32 seconds) in ms as the reader takes it back to the same float32; "" when unknown."""
    if np.isnan(seconds):
        return ""
    ms = float(seconds) * 1000.0
    return str(round(ms)) if np.float32(round(ms) / 1000.0) == np.float32(seconds) else repr(ms)


def _srs_rows(user: str, stored: StoredState) -> tuple[list[list], int]:
    """(the CSV rows of a user's stored reviews, in the order they were recorded; how many of their reviews the
    store no longer holds)."""
    from .srs import _decode
    from .srs_refit import stored_rows

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


def in_test(entity: str, test_fraction: float) -> bool:
    """Whether the entity falls in the test part: the first 8 bytes of BLAKE2b of its id, as a fraction of 2^64,
    below `test_fraction`."""
    digest = hashlib.blake2b(entity.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") < test_fraction * 2.0 ** 64


def _writer(path: Path, delimiter: str):
    raw = gzip.GzipFile(path, "wb", mtime=0)
    text = io.TextIOWrapper(raw, encoding="utf-8", newline="")
    return text, csv.writer(text, delimiter=delimiter, lineterminator="\n")


async def export_events(store: StateStore, task: str, model: str, out: Path, *, test_fraction: float = 0.2,
                        n_cats: int | None = None, schemas: list[str] = (), page: int = 500,
                        progress: Callable[[dict], None] | None = None) -> dict:
    """Write the logs of `model`'s entities (flashcards: each user's stored reviews, from the first of `schemas`
    that holds them, then any other layout's) under `out` (which must not hold files of an earlier export) and return
    what was written: {"model", "task", "files", "entities": {"train", "test"}, "events": {"train", "test"},
    "not_in_log" (flashcards: "not_held"), "seconds"} (no test part when `test_fraction` is 0). `progress` is called
    with the running counts after each page."""
    if task not in EXPORTED:
        raise ValueError(f"task {task!r} has no event export; expected one of {sorted(EXPORTED)}")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    layout = LAYOUTS.get(task)
    names, delimiter = (SRS_FILES, ",") if layout is None else ((layout.train, layout.test), layout.delimiter)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / names[0].format(model=model)}
    if test_fraction > 0:  # (none asked for: no empty test file, which training would refuse)
        paths["test"] = out / names[1].format(model=model)
    taken = [p.name for p in paths.values() if p.exists()]
    if taken:
        raise FileExistsError(f"{out} already holds {', '.join(taken)}: export into an empty folder")
    started = time.monotonic()
    entities, events, missing = dict.fromkeys(paths, 0), dict.fromkeys(paths, 0), 0
    prefix = f"{layout.prefix if layout else 'srs'}:{model}:"
    files = {part: _writer(path, delimiter) for part, path in paths.items()}

    async def entity_rows(key: str) -> tuple[str, list[list], int] | None:
        """(the entity, its rows, how many of its events the store no longer holds); None: seen, or nothing."""
        if layout is not None:
            entity = key[len(prefix):]
            if entity in seen:  # (a walk may return a key twice)
                return None
            seen.add(entity)
            base, rows = await store.log(key)
            return (entity, [layout.row(entity, row) for row in rows], base) if rows or base else None
        schema, _, user = key[len(prefix):].partition(":")
        if user in seen:  # (a walk may return a key twice; a user may be stored under several layouts)
            return None
        seen.add(user)
        for source in [*schemas, schema] if schema not in schemas else schemas:  # the newest layout that has them
            state = await store.read_all(f"{prefix}{source}:{user}")
            if state.exists and state.blob:
                return user, *_srs_rows(user, state)
        return None

    try:
        for _, writer in files.values():
            writer.writerow(layout.header if layout else SRS_HEADER)
        cursor, seen = "0", set()
        while True:
            cursor, keys = await store.scan(prefix, cursor, page)
            for key in keys:
                found = await entity_rows(key)
                if found is None:
                    continue
                entity, rows, lacking = found
                part = "test" if in_test(entity, test_fraction) else "train"
                files[part][1].writerows(rows)
                entities[part] += 1
                events[part] += len(rows)
                missing += lacking
            if progress is not None:
                progress({"entities": sum(entities.values()), "events": sum(events.values())})
            if cursor == "0":
                break
    finally:
        for text, _ in files.values():
            text.close()
    if task == "knowledge_tracing" and n_cats:
        (out / "metadata.json").write_text(json.dumps({"n_cats": int(n_cats)}) + "\n")
    return {"model": model, "task": task, "files": {part: str(path) for part, path in paths.items()},
            "entities": entities, "events": events, "not_held" if layout is None else "not_in_log": missing,
            "seconds": round(time.monotonic() - started, 3)}
