"""The traffic as training data: every entity's event log written as the files `nextstep train` reads.

`export_events` walks the store's keys of one model (state.py's `scan`: one page at a time, every primary of a
Redis Cluster) and writes each entity's logged events, oldest first, to a train or a test file, chosen by a hash
of the entity id (the same entity always falls on the same side, whoever exports, and a larger test fraction
only moves entities from train to test). Nothing but one entity's log is held in memory.

What a task's traffic exports as is its own (its TaskPlugin's `export`, an `Export`): the files, their header and
rows. Knowledge tracing and sessions write each entity's event log (`LogExport`: kt/export.py, sessions/export.py);
flashcards each user's stored reviews (srs/export.py).

The files are written into a hidden folder beside `out` and moved into it only once the walk is over: an export that
fails (Redis unavailable, the process killed) leaves nothing that looks like data. When the hash leaves one part
empty although there are two entities or more (a small traffic), the entity nearest the split moves to it, so that
train and test both hold someone; a single entity goes to train, and no test file is written (`nextstep train` then
holds some of its training learners out itself).

Times are the logged ones (whole seconds). Events trimmed from a log (NEXTSTEP_MAX_LOGGED_EVENTS,
NEXTSTEP_LOG_MAX_AGE_SECONDS) are not in it: the summary counts them (`not_in_log`).
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

from .state import LogRow, StateStore
from .tasks import Export, plugin, plugins


@dataclass(frozen=True)
class LogExport(Export):
    """Each entity's event log, oldest first, a row per event (`row`: (entity id, logged event) -> the row)."""

    prefix: str
    files: tuple[str, str]
    delimiter: str
    header: tuple[str, ...]
    row: Callable[[str, LogRow], list]

    async def rows(self, store: StateStore, prefix: str, rest: str, entity: str) -> tuple[list[list], int] | None:
        base, rows = await store.log(prefix + rest)
        return ([self.row(entity, row) for row in rows], base) if rows or base else None


def manifests(artifacts: Path | None, model: str) -> list[dict]:
    """The manifests of a model's versions under `artifacts`, newest version (manifest `created`) first; read as
    files, no graph loaded (one that does not read is left out)."""
    found = []
    for path in (artifacts.glob(f"{glob.escape(model)}/*/manifest.json") if artifacts is not None else ()):
        try:
            manifest = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(manifest, dict):
            found.append((str(manifest.get("created")), path.parent.name, manifest))
    return [m for *_, m in sorted(found, key=lambda f: f[:2], reverse=True)]


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
                        artifacts: Path | None = None, page: int = 500,
                        progress: Callable[[dict], None] | None = None) -> dict:
    """Write the traffic of `model`'s entities as its task exports it (its plugin's `Export`, for the model's versions
    under `artifacts`) under `out` (which must not hold files of an earlier export) and return what was written:
    {"model", "task", "files", "entities": {"train", "test"}, "events": {"train", "test"}, the export's `lacking`
    count, "seconds"} (no test part when `test_fraction` is 0). `progress` is called with the running counts after
    each page."""
    found = plugin(task)
    if found is None or found.export is None:
        raise ValueError(f"task {task!r} has no event export; expected one of "
                         f"{sorted(p.spec.name for p in plugins() if p.export is not None)}")
    export = found.export.for_model(artifacts, model)
    if not 0 <= test_fraction < 1:
        raise ValueError(f"test_fraction must be in [0, 1), got {test_fraction!r}")
    final = {"train": out / export.files[0].format(model=model)}
    if test_fraction > 0:  # (none asked for: no empty test file, which training would refuse)
        final["test"] = out / export.files[1].format(model=model)
    taken = [p.name for p in [*final.values(), *(out / name for name in export.beside())] if p.exists()]
    if taken:
        raise FileExistsError(f"{out} already holds {', '.join(taken)}: export into an empty folder")
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"  # (hidden: never read as a data set)
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    try:
        summary = await _export(store, task, export, model, partial,
                                {p: partial / f.name for p, f in final.items()}, test_fraction, page, progress)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    _install(partial, out)
    summary["files"] = {part: str(out / Path(path).name) for part, path in summary["files"].items()}
    return summary


async def _export(store: StateStore, task: str, export: Export, model: str, partial: Path, paths: dict[str, Path],
                  test_fraction: float, page: int, progress: Callable[[dict], None] | None) -> dict:
    """`export_events` into the folder `partial`: the walk, then the parts balanced (the module's docstring)."""
    started = time.monotonic()
    entities, events, missing = dict.fromkeys(paths, 0), dict.fromkeys(paths, 0), 0
    prefix = f"{export.prefix}:{model}:"
    files = {part: _writer(path, export.delimiter) for part, path in paths.items()}

    async def entity_rows(key: str) -> tuple[str, list[list], int] | None:
        """(the entity, its rows, how many of its events the store no longer holds); None: seen, or nothing."""
        rest = key[len(prefix):]
        entity = export.entity(rest)
        if entity in seen:  # (a walk may return a key twice; a flashcard user may be stored under several layouts)
            return None
        seen.add(entity)
        found = await export.rows(store, prefix, rest, entity)
        return (entity, *found) if found is not None else None

    try:
        for _, writer in files.values():
            writer.writerow(export.header)
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
        _move_entity(paths[other], paths[short], entity, export.delimiter)
        entities[other], entities[short], events[other], events[short] = entities[other] - 1, 1, events[other] - n, n
        summary["note"] = (f"every entity fell in {other} by the hash: {entity!r}, the nearest the split, moved to "
                           f"{short} so that both hold one")
    elif "test" in paths and entities["test"] == 0:  # one entity, or none: nothing to test on
        paths["test"].unlink()
        del paths["test"], entities["test"], events["test"]
        summary["note"] = "no test file: a single entity (or none) was logged; nextstep train holds out its own"
    for name, text in export.beside().items():
        (partial / name).write_text(text)
    return {**summary, "files": {part: str(path) for part, path in paths.items()},
            "entities": entities, "events": events, export.lacking: missing,
            "seconds": round(time.monotonic() - started, 3)}
