"""The traffic as training data: every entity's event log written as the files `nextstep train` reads.

`export_events` walks the store's keys of one model (state.py's `scan`: one page at a time, every primary of a
Redis Cluster) and writes each entity's logged events, oldest first, to a train or a test file, chosen by a hash
of the entity id (the same entity always falls on the same side, whoever exports, and a larger test fraction
only moves entities from train to test). Nothing but one entity's log is held in memory.

* knowledge tracing: `<model>_train.csv.gz` and `<model>_test.csv.gz`, the long format (data.py: learner_id,
  question_id, response, timestamp; ids as the app sent them), and `metadata.json` with the model's number of
  response categories;
* sessions: `<model>_train_full.tsv.gz` and `<model>_test.tsv.gz`, GRU4Rec's TSV (SessionId, ItemId, Time).

Times are the logged ones (whole seconds). Events trimmed from a log (NEXTSTEP_MAX_LOGGED_EVENTS,
NEXTSTEP_LOG_MAX_AGE_SECONDS) are not in it: the summary counts them (`not_in_log`).
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .kt import logged_event
from .state import LogRow, StateStore


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
                        n_cats: int | None = None, page: int = 500,
                        progress: Callable[[dict], None] | None = None) -> dict:
    """Write the logs of `model`'s entities under `out` (which must not hold files of an earlier export) and return
    what was written: {"model", "task", "files", "entities": {"train", "test"}, "events": {"train", "test"},
    "not_in_log", "seconds"} (no test part when `test_fraction` is 0). `progress` is called with the running
    counts after each page."""
    if task not in LAYOUTS:
        raise ValueError(f"task {task!r} has no event export; expected one of {sorted(LAYOUTS)}")
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    layout = LAYOUTS[task]
    out.mkdir(parents=True, exist_ok=True)
    paths = {"train": out / layout.train.format(model=model)}
    if test_fraction > 0:  # (none asked for: no empty test file, which training would refuse)
        paths["test"] = out / layout.test.format(model=model)
    taken = [p.name for p in paths.values() if p.exists()]
    if taken:
        raise FileExistsError(f"{out} already holds {', '.join(taken)}: export into an empty folder")
    started = time.monotonic()
    entities, events, not_in_log = dict.fromkeys(paths, 0), dict.fromkeys(paths, 0), 0
    prefix = f"{layout.prefix}:{model}:"
    files = {part: _writer(path, layout.delimiter) for part, path in paths.items()}
    try:
        for _, writer in files.values():
            writer.writerow(layout.header)
        cursor, seen = "0", set()
        while True:
            cursor, keys = await store.scan(prefix, cursor, page)
            for key in keys:
                entity = key[len(prefix):]
                if entity in seen:  # (a walk may return a key twice)
                    continue
                seen.add(entity)
                base, rows = await store.log(key)
                if not rows and not base:
                    continue
                part = "test" if in_test(entity, test_fraction) else "train"
                writer = files[part][1]
                for row in rows:
                    writer.writerow(layout.row(entity, row))
                entities[part] += 1
                events[part] += len(rows)
                not_in_log += base
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
            "entities": entities, "events": events, "not_in_log": not_in_log,
            "seconds": round(time.monotonic() - started, 3)}
