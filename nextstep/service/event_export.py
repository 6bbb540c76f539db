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

The files are written into a hidden folder beside `out` and moved into it only once the walk is over: an export that
fails (Redis unavailable, the process killed) leaves nothing that looks like data. When the hash leaves one part
empty although there are two entities or more (a small traffic), the entity nearest the split moves to it, so that
train and test both hold someone; a single entity goes to train, and no test file is written (`nextstep train` then
holds some of its training learners out itself).

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
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .kt.service import logged_event
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
    from .srs.stored import schema_hash

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
    from .srs.refit import stored_rows
    from .srs.stored import _decode

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


def _draw(entity: str) -> int:
    """The entity's draw: the first 8 bytes of BLAKE2b of its id, as an integer below 2^64."""
    return int.from_bytes(hashlib.blake2b(entity.encode(), digest_size=8).digest(), "big")


def in_test(entity: str, test_fraction: float) -> bool:
    """Whether the entity falls in the test part: its draw as a fraction of 2^64 below `test_fraction`."""
    return _draw(entity) < test_fraction * 2.0 ** 64


def _move_entity(source: Path, empty: Path, entity: str, delimiter: str) -> None:
    """Move an entity's rows (first column) from one written file into the other, which holds only its header (both
    gzipped, rows in log order)."""
    with gzip.open(source, "rt", encoding="utf-8", newline="") as f:
        header, *rows = list(csv.reader(f, delimiter=delimiter))
    for path, take in ((source, [r for r in rows if r[0] != entity]), (empty, [r for r in rows if r[0] == entity])):
        text, writer = _writer(path, delimiter)
        with text:
            writer.writerow(header)
            writer.writerows(take)


def _install(partial: Path, out: Path) -> None:
    """Move the finished files of `partial` into `out` (made if missing; each file whole, by a rename), then
    remove `partial`."""
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(partial.iterdir()):
        os.replace(path, out / path.name)
    partial.rmdir()


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
    final = {"train": out / names[0].format(model=model)}
    if test_fraction > 0:  # (none asked for: no empty test file, which training would refuse)
        final["test"] = out / names[1].format(model=model)
    taken = [p.name for p in [*final.values(), out / "metadata.json"] if p.exists()]
    if taken:
        raise FileExistsError(f"{out} already holds {', '.join(taken)}: export into an empty folder")
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"  # (hidden: never read as a data set)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        summary = await _export(store, task, layout, model, partial, {p: partial / f.name for p, f in final.items()},
                                delimiter, test_fraction, n_cats, schemas, page, progress)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _install(partial, out)
    summary["files"] = {part: str(out / Path(path).name) for part, path in summary["files"].items()}
    return summary


async def _export(store: StateStore, task: str, layout: Layout | None, model: str, partial: Path,
                  paths: dict[str, Path], delimiter: str, test_fraction: float, n_cats: int | None,
                  schemas: list[str], page: int, progress: Callable[[dict], None] | None) -> dict:
    """`export_events` into the folder `partial`: the walk, then the parts balanced (the module's docstring)."""
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
        nearest: dict[str, tuple[int, str, int] | None] = {"train": None, "test": None}
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
                draw = _draw(entity)  # (the entities nearest the split on either side: `balanced` moves one)
                if part == "train" and (nearest["train"] is None or draw < nearest["train"][0]) \
                        or part == "test" and (nearest["test"] is None or draw > nearest["test"][0]):
                    nearest[part] = (draw, entity, len(rows))
            if progress is not None:
                progress({"entities": sum(entities.values()), "events": sum(events.values())})
            if cursor == "0":
                break
    finally:
        for text, _ in files.values():
            text.close()
    summary = {"model": model, "task": task}
    if "test" in paths and sum(entities.values()) >= 2 and 0 in entities.values():  # (a small traffic)
        short = "test" if entities["test"] == 0 else "train"
        other = "train" if short == "test" else "test"
        _, entity, n = nearest[other]
        _move_entity(paths[other], paths[short], entity, delimiter)
        entities[other], entities[short], events[other], events[short] = entities[other] - 1, 1, events[other] - n, n
        summary["note"] = (f"every entity fell in {other} by the hash: {entity!r}, the nearest the split, moved to "
                           f"{short} so that both hold one")
    elif "test" in paths and entities["test"] == 0:  # one entity, or none: nothing to test on
        paths["test"].unlink()
        del paths["test"], entities["test"], events["test"]
        summary["note"] = "no test file: a single entity (or none) was logged; nextstep train holds out its own"
    if task == "knowledge_tracing" and n_cats:
        (partial / "metadata.json").write_text(json.dumps({"n_cats": int(n_cats)}) + "\n")
    return {**summary, "files": {part: str(path) for part, path in paths.items()},
            "entities": entities, "events": events, "not_held" if layout is None else "not_in_log": missing,
            "seconds": round(time.monotonic() - started, 3)}
