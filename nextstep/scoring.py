"""Offline knowledge-tracing scoring (`nextstep score`): one code path, two drivers.

What is shared, whichever engine runs it:

* reading: `input_files` turns the input (a file, a directory of part files, or a glob) into files of one
  format; `parse_student` turns one record (a JSONL line's object, a Parquet row) into (student_id, events,
  predict_question_ids), with the same checks for both;
* scoring: `Scorer` opens one artifact with ONNX Runtime and replays each student's whole history through the
  service's own `KnowledgeTracer.score_sequences` (the `POST .../batch` route's code, without HTTP): the same
  graphs and the same numbers as the service;
* writing: `to_line` (a JSONL line) and `result_schema` / `to_table` (Parquet rows of that very content).

The drivers: the single-process loop in nextstep/cli.py (the default) and Ray Data in nextstep/ray_scoring.py
(`--engine ray`), whose workers each open a `Scorer` once and score batches of rows.

Input records: {"student_id", "events": [{"question_id", "response", "event_id"?}], "predict_question_ids"?}, one
per JSONL line or Parquet row (Parquet: `events` a list of structs, `predict_question_ids` a list of strings),
or (single file, single process only) a CSV of student_id, question_id, response in time order.
"""

import asyncio
import glob
import json
import numbers
from collections.abc import Iterable, Iterator
from pathlib import Path

from .service.errors import InvalidInput
from .service.kt.service import Event, KnowledgeTracer, irt
from .service.memory_store import InProcessStore
from .service.registry import LoadedModel, ModelRegistry, load_artifact
from .service.runtime import Engines

Student = tuple[str, list[Event], list[str] | None]
PART_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet"}  # what a directory's parts may be


def file_format(path: Path) -> str:
    """csv or parquet by the suffix; anything else is read as JSONL (as `nextstep score` always has)."""
    return {".csv": "csv", ".parquet": "parquet"}.get(path.suffix.lower(), "jsonl")


class ScoringError(Exception):
    """A fault in the input (a record that does not parse, a student the model refuses): one line for the user."""


# -- reading -----------------------------------------------------------------------------------------------------

def input_files(spec: str) -> tuple[list[Path], str]:
    """(the files to read, in name order; their format: jsonl, parquet or csv) for a file, a directory (its
    *.jsonl / *.ndjson / *.parquet files; hidden ones skipped) or a glob. Files of mixed formats, several CSV
    files, or none at all are a ScoringError."""
    path = Path(spec)
    if path.is_file():
        files = [path]
    elif path.is_dir():
        files = sorted(p for p in path.iterdir() if p.is_file() and not p.name.startswith(".")
                       and p.suffix.lower() in PART_SUFFIXES)
        if not files:
            raise ScoringError(f"no .jsonl, .ndjson or .parquet files in the directory {spec}")
    elif glob.has_magic(spec):
        files = sorted(Path(p) for p in glob.glob(spec) if Path(p).is_file())
        if not files:
            raise ScoringError(f"no files match {spec}")
    else:
        raise ScoringError(f"no input file {spec}")
    formats = {file_format(p) for p in files}
    if len(formats) > 1:
        raise ScoringError(f"{spec}: files of several formats ({', '.join(sorted(formats))}); give one at a time")
    fmt = formats.pop()
    if fmt == "csv" and len(files) > 1:
        raise ScoringError(f"{spec}: CSV is read one file at a time (a student's rows may span files); "
                           "give one file, or JSONL / Parquet parts with one record per student")
    return files, fmt


def _id(value, field: str) -> str:
    """An id as the batch route takes it: a string or an integer (not a bool, a float or null)."""
    if isinstance(value, str) or (isinstance(value, numbers.Integral) and not isinstance(value, bool)):
        return str(value)
    raise TypeError(f"{field}: a string or integer id, not {type(value).__name__}")


def _list(value, field: str) -> list:
    if not isinstance(value, list):  # a string would be read as a list of one-character ids
        raise TypeError(f"{field}: a list, not {type(value).__name__}")
    return value


def parse_student(record) -> Student:
    """(student_id, events, predict_question_ids or None) of one record; ValueError, KeyError or TypeError when it
    is not {"student_id", "events": [{"question_id", "response", "event_id"?}], "predict_question_ids"?}, with the
    batch route's types: nothing is converted (1.9 is no response, "12" no list of ids, null no id)."""
    if not isinstance(record, dict):
        raise TypeError(f"a JSON object, not {type(record).__name__}")
    events = []
    for i, e in enumerate(_list(record["events"], "events")):
        if not isinstance(e, dict):
            raise TypeError(f"events[{i}]: a JSON object, not {type(e).__name__}")
        response = e["response"]
        if not isinstance(response, numbers.Integral) or isinstance(response, bool):
            raise TypeError(f"events[{i}].response: an integer, not {type(response).__name__}")
        event_id = e.get("event_id")
        events.append(Event(_id(e["question_id"], f"events[{i}].question_id"), int(response),
                            None if event_id is None else _id(event_id, f"events[{i}].event_id")))
    asked = record.get("predict_question_ids")
    predict = None if asked is None else [_id(q, f"predict_question_ids[{i}]")
                                          for i, q in enumerate(_list(asked, "predict_question_ids"))] or None
    return _id(record["student_id"], "student_id"), events, predict


RECORD = "expected a JSON object with student_id and events [{question_id, response}]"


def parse_line(line: str, where: str) -> Student | None:
    """A JSONL line's student (None for a blank line); a ScoringError naming `where` (file:line) otherwise."""
    if not line.strip():
        return None
    try:
        return parse_student(json.loads(line))
    except (ValueError, KeyError, TypeError) as exc:
        raise ScoringError(f"{where}: {RECORD}: {exc}") from None


def parse_record(record, where: str) -> Student:
    """A Parquet row's (as a dict) student; a ScoringError naming `where` otherwise."""
    try:
        return parse_student(record)
    except (ValueError, KeyError, TypeError) as exc:
        raise ScoringError(f"{where}: {RECORD}: {exc}") from None


def parse_rows(rows: Iterable[dict], where: str, start: int = 0) -> Iterator[Student]:
    """Students of Parquet rows (as dicts); a ScoringError naming `where` and the row's position (from `start`)."""
    for i, row in enumerate(rows, start=start):
        yield parse_record(row, f"{where}: row {i}")


def _read_csv(path: Path) -> Iterator[Student]:
    import csv

    students: dict[str, list] = {}
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        missing = {"student_id", "question_id", "response"} - set(reader.fieldnames or [])
        if missing:
            raise ScoringError(f"{path}: missing columns {sorted(missing)}")
        for line, row in enumerate(reader, start=2):
            if None in (row["student_id"], row["question_id"], row["response"]):
                raise ScoringError(f"{path}:{line}: expected student_id, question_id and response, got a short row")
            try:
                students.setdefault(row["student_id"], []).append(Event(row["question_id"], int(row["response"])))
            except ValueError:
                raise ScoringError(f"{path}:{line}: expected an integer response, got {row['response']!r}") from None
    yield from ((sid, events, None) for sid, events in students.items())


def read_students(files: list[Path], fmt: str) -> Iterator[Student]:
    """The students of `files` (from input_files) in file order, then record order."""
    for path in files:
        if fmt == "csv":
            yield from _read_csv(path)
        elif fmt == "parquet":
            import pyarrow.parquet as pq

            offset = 0
            for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
                rows = batch.to_pylist()
                yield from parse_rows(rows, str(path), offset)
                offset += len(rows)
        else:
            with path.open("rb") as f:
                for line_no, raw in enumerate(f, start=1):
                    try:
                        line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a BOM is no content
                    except UnicodeDecodeError as exc:
                        raise ScoringError(f"{path}:{line_no}: not UTF-8 text: {exc.reason}") from None
                    student = parse_line(line, f"{path}:{line_no}")
                    if student is not None:
                        yield student


# -- scoring -----------------------------------------------------------------------------------------------------

def resolve(artifacts: str | Path, name: str) -> tuple[LoadedModel, dict[str, str]]:
    """(the knowledge-tracing model `name` (or name@version) under `artifacts`, as the service would pick it; the
    artifacts refused while loading). UnknownModel when there is none of that name and task."""
    registry = ModelRegistry(Path(artifacts))
    errors = registry.load()
    return registry.get(name, task=KnowledgeTracer.TASK), errors


class _OneModel:
    """The registry as KnowledgeTracer reads it (`get`), holding one model: a worker opens only its artifact."""

    def __init__(self, model: LoadedModel):
        self._model = model

    def get(self, name: str, version: str = "latest", task: str | None = None) -> LoadedModel:
        return self._model


class Scorer:
    """Whole histories through one model's graphs, one student at a time (no store: nothing is kept).

    One event loop, one in-process `KnowledgeTracer` with unbatched engines; each student is one operation, alone,
    so its graph calls run inline (runtime.Engines: no executor thread)."""

    def __init__(self, model: LoadedModel):
        self.model = model
        self._engines = Engines(max_batch=1, max_wait_ms=0)
        self._tracer = KnowledgeTracer(_OneModel(model), InProcessStore(ttl_seconds=None), self._engines)
        self._loop = asyncio.new_event_loop()

    @classmethod
    def open(cls, path: str | Path) -> "Scorer":
        """A scorer of the artifact at `path` (one ONNX Runtime session per graph, one intra-op thread each)."""
        return cls(load_artifact(Path(path), intra_op_threads=1))

    async def _score(self, student: Student) -> dict:
        self._engines.operations += 1  # one operation in progress: its graph calls run in this thread
        try:
            return (await self._tracer.score_sequences(self.model.name, [student]))["students"][0]
        finally:
            self._engines.operations -= 1

    def score(self, student: Student) -> dict:
        """{student_id, events, event_predictions, predictions} of one student, as `POST /v1/kt/{model}/batch`
        gives it (a question the model never saw is answered through its unknown row, `"known": false`, where the
        version has one); a student the model refuses (an unknown question of a version without that row, a response
        out of range, too many events) is a ScoringError naming the student."""
        try:
            return self._loop.run_until_complete(self._score(student))
        except InvalidInput as exc:  # (TooLarge is one too)
            raise ScoringError(f"student {student[0]!r}: {exc}") from None

    def close(self) -> None:
        self._loop.close()


# -- writing -----------------------------------------------------------------------------------------------------

def to_line(result: dict) -> str:
    """One JSONL line (without the newline) of a student's result."""
    return json.dumps(result)


def result_schema(model: LoadedModel):
    """The Arrow schema of a student's result for this model (theta, alpha, beta where its graphs give them; `known`
    false for a question answered through the unknown row, null for the others, which JSONL leaves out)."""
    import pyarrow as pa

    fields = [("question_id", pa.string()), ("probabilities", pa.list_(pa.float64())),
              ("expected_response", pa.float64()), ("most_likely_response", pa.int64())]
    if irt(model):
        fields += [("theta", pa.float64()), ("alpha", pa.float64()), ("beta", pa.list_(pa.float64()))]
    fields.append(("known", pa.bool_()))  # false: answered through the unknown row; null (JSONL: absent): known
    prediction = pa.list_(pa.struct(fields))
    return pa.schema([("student_id", pa.string()), ("events", pa.int64()), ("event_predictions", prediction),
                      ("predictions", prediction)])


def to_table(results: list[dict], schema):
    """Students' results as one Arrow table of `schema` (result_schema): the same values as their JSONL lines."""
    import pyarrow as pa

    return pa.Table.from_pylist(results, schema=schema)
