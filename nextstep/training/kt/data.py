"""Readers for knowledge-tracing data sets.

Four on-disk layouts are supported, each read into the same in-memory form (a `KTDataset` of
per-student `Sequence`s holding RAW ids, exactly as in the file):

* ``three_line``   -- DKVMN / deep-gpcm: records of 3 lines: length / question ids / responses.
* ``pykt``         -- pykt-toolkit CSV: header ``fold,uid,concepts,responses[,...]`` with quoted lists.
* ``dtransformer`` -- DTransformer: a length line, then one line per field listed in ``datasets.toml``.
* ``long_csv``     -- one interaction per row: learner, question, response and time columns (names in
  `LONG_COLUMNS`), optionally skill and event ids; ids are any text.

Any of them may be gzipped (found by its first bytes, whatever the file is named); another compression is
refused, naming it. Every malformed line raises `DataFormatError` naming the file, the 1-based line number,
what was expected and what was found. Mapping raw ids to embedding rows is the job of `Vocabulary`: ids
are integers where a file's ids all are (three-line, pykt, DTransformer; a long CSV whose ids are all
integers as written), else text.
"""

from __future__ import annotations

import csv
import datetime as dt
import gzip
import hashlib
import io
import itertools
import json
import os
import re
import tomllib
from collections.abc import Iterator
from collections.abc import Sequence as AbcSequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data import DataFormatError, base_name, check_id, compression, csv_rows, id_array, open_text

FORMATS = ("three_line", "pykt", "dtransformer", "long_csv")
# K, the number of response categories, is at most this: a file's K sizes every model's response tables, and one
# stray response of 1,000,000 would have them take gigabytes
MAX_CATEGORIES = 100
CATEGORIES_NOTE = f"responses are categories 0..K-1 with K at most {MAX_CATEGORIES}: bin a finer score first"


# eq=False: arrays do not support tuple comparison/hashing, so sequences compare by identity.
@dataclass(frozen=True, eq=False)
class Sequence:
    """One student's interactions, in time order, with ids exactly as in the file."""

    student_id: str
    questions: np.ndarray  # raw question / skill ids: int64, or str where the file's ids are text
    responses: np.ndarray  # int64 categories 0..K-1
    problems: np.ndarray | None = None  # int64 raw problem ids (DTransformer ``pid``) when present
    skills: np.ndarray | None = None  # raw skill ids of a long CSV's skill column ("" where a row has none)

    def __post_init__(self) -> None:
        object.__setattr__(self, "responses", np.asarray(self.responses, dtype=np.int64))
        for name in ("questions", "problems", "skills"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, id_array(value))
        n = len(self.questions)
        if len(self.responses) != n or any(v is not None and len(v) != n for v in (self.problems, self.skills)):
            raise ValueError(f"sequence {self.student_id!r}: fields have different lengths")

    def __len__(self) -> int:
        return len(self.questions)


@dataclass
class KTDataset:
    sequences: list[Sequence]
    n_cats: int  # K, the number of response categories (2 for binary data)
    path: str
    fmt: str  # one of FORMATS
    notes: dict = field(default_factory=dict)  # how it was read, for the log and the manifest (e.g. the columns)

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def n_interactions(self) -> int:
        return sum(len(s.questions) for s in self.sequences)


# ----------------------------------------------------------------------------- line parsing helpers


def _read_lines(path: Path) -> list[str]:
    with open_text(path) as f:
        return f.read().splitlines()


def _parse_ints(path: Path, line_no: int, text: str, what: str, count: int | None = None) -> np.ndarray:
    """Parse a comma-separated integer list; spaces and trailing commas are tolerated."""
    tokens = [t.strip() for t in text.split(",")]
    while tokens and tokens[-1] == "":
        tokens.pop()
    values = []
    for token in tokens:
        try:
            values.append(int(token))
        except ValueError:
            raise DataFormatError(path, line_no, f"integer {what}", token) from None
        if not -(2**63) <= values[-1] < 2**63:
            raise DataFormatError(path, line_no, f"integer {what} within int64", token)
    if count is not None and len(values) != count:
        raise DataFormatError(path, line_no, f"{count} comma-separated {what}", len(values))
    return np.asarray(values, dtype=np.int64)


def _check_responses(path: Path, line_no: int, responses: np.ndarray, n_cats: int | None) -> None:
    """Responses must lie in 0..K-1 (below MAX_CATEGORIES when K is still to be inferred)."""
    bad = (responses < 0) | (responses >= (n_cats or MAX_CATEGORIES))
    if bad.any():
        value = int(responses[bad.argmax()])
        if n_cats is not None:
            raise DataFormatError(path, line_no, f"responses in 0..{n_cats - 1}", value)
        if value < 0:
            raise DataFormatError(path, line_no, "responses >= 0", value)
        raise DataFormatError(path, line_no, f"responses below {MAX_CATEGORIES}", value, CATEGORIES_NOTE)


def _records(path: Path, field_names: AbcSequence[str]) -> Iterator[tuple[int, list[np.ndarray]]]:
    """Yield (line number of the length line, one int array per field) for length-prefixed records.

    Blank lines between records and at the end of the file are skipped; a record cut short by
    the end of the file is an error.
    """
    lines = _read_lines(path)
    end = len(lines)
    while end and not lines[end - 1].strip():
        end -= 1
    i = 0
    while i < end:
        if not lines[i].strip():
            i += 1
            continue
        length_text = lines[i].strip().rstrip(",").strip()
        try:
            length = int(length_text)
        except ValueError:
            length = 0
        if length <= 0:
            raise DataFormatError(path, i + 1, "a positive integer sequence length", length_text)
        arrays = []
        for j, name in enumerate(field_names, start=1):
            if i + j >= end:
                raise DataFormatError(path, i + j + 1, f"a line of {name}", "end of file")
            arrays.append(_parse_ints(path, i + j + 1, lines[i + j], name, count=length))
        yield i + 1, arrays
        i += 1 + len(field_names)


# ----------------------------------------------------------------------------- readers


def read_three_line(path: str | os.PathLike, n_cats: int | None = None) -> KTDataset:
    """Read length / question ids / responses records. ``n_cats=None`` infers K = max response + 1 (>= 2)."""
    path = Path(path)
    sequences: list[Sequence] = []
    max_response = 1
    for index, (line_no, (questions, responses)) in enumerate(_records(path, ("question ids", "responses"))):
        _check_responses(path, line_no + 2, responses, n_cats)
        max_response = max(max_response, int(responses.max()))
        sequences.append(Sequence(f"{path.stem}:{index}", questions, responses))
    return KTDataset(sequences, n_cats or max_response + 1, str(path), "three_line")


# what each DTransformer field holds, for messages: "expected 200 comma-separated responses (s)"
DTRANSFORMER_FIELDS = {"pid": "problem ids", "q": "skill ids", "s": "responses", "it": "interval times",
                       "at": "answer times"}


def read_dtransformer(
    path: str | os.PathLike, fields: AbcSequence[str] = ("pid", "q", "s"), n_cats: int = 2
) -> KTDataset:
    """Read DTransformer records; ``q`` is the skill id, ``s`` the response, ``pid`` the problem id."""
    path, fields = Path(path), list(fields)
    if "q" not in fields or "s" not in fields:
        raise ValueError(f"DTransformer fields must include 'q' and 's', got {fields}")
    sequences: list[Sequence] = []
    labels = [f"{DTRANSFORMER_FIELDS.get(name, 'values')} ({name})" for name in fields]
    for index, (line_no, arrays) in enumerate(_records(path, labels)):
        by_name = dict(zip(fields, arrays, strict=True))  # other fields (it, at, ...) are ignored
        _check_responses(path, line_no + 1 + fields.index("s"), by_name["s"], n_cats)
        sequences.append(Sequence(f"{path.stem}:{index}", by_name["q"], by_name["s"], by_name.get("pid")))
    return KTDataset(sequences, n_cats, str(path), "dtransformer")


def read_pykt_csv(path: str | os.PathLike, n_cats: int = 2) -> KTDataset:
    """Read a pykt CSV; positions whose concept or response is -1 (padding) are dropped."""
    path = Path(path)
    sequences: list[Sequence] = []
    with open_text(path) as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        id_col = "concepts" if "concepts" in header else "questions"
        if id_col not in header or "responses" not in header:
            what = "a CSV header with 'concepts' (or 'questions') and 'responses' columns"
            raise DataFormatError(path, 1, what, ",".join(header) or "end of file")
        for row in csv_rows(path, reader, header):
            line_no = reader.line_num
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise DataFormatError(path, line_no, f"{len(header)} columns", len(row))
            cells = dict(zip(header, row, strict=True))
            questions = _parse_ints(path, line_no, cells[id_col], id_col)
            responses = _parse_ints(path, line_no, cells["responses"], "responses", count=len(questions))
            keep = (questions != -1) & (responses != -1)
            questions, responses = questions[keep], responses[keep]
            _check_responses(path, line_no, responses, n_cats)
            if len(questions):
                student = cells.get("uid", "").strip() or f"{path.stem}:{len(sequences)}"
                sequences.append(Sequence(student, questions, responses))
    return KTDataset(sequences, n_cats, str(path), "pykt")


# the long format's columns: each role's accepted header names, the preferred first (matched ignoring case, with
# spaces and hyphens read as underscores); the learner, question, response and time columns are required
LONG_COLUMNS = {
    "learner": ("learner_id", "user_id", "student_id", "anon_student_id", "uid", "learner", "user", "student"),
    "question": ("question_id", "item_id", "problem_id", "exercise_id", "question", "item", "problem"),
    "response": ("correct", "response", "score", "is_correct", "correct_first_attempt"),
    "time": ("timestamp", "time", "start_time", "first_transaction_time", "order_id"),
    "skill": ("skill_id", "concept_id", "kc_id", "skill", "concept", "kc"),
    "event": ("event_id", "interaction_id"),
}
LONG_REQUIRED = ("learner", "question", "response", "time")
_INT_ID = re.compile(r"-?(?:0|[1-9][0-9]{0,18})")  # an integer as Python writes it: "12", not "012" or "+12"


def _header_key(name: str) -> str:
    return re.sub(r"[\s-]+", "_", name.strip().lower())


def long_columns(header: AbcSequence[str]) -> dict[str, int]:
    """{role: column index} of the long-format columns a header has (the first accepted name of each role)."""
    keys = [_header_key(h) for h in header]
    found = {}
    for role, names in LONG_COLUMNS.items():
        index = next((keys.index(n) for n in names if n in keys), None)
        if index is not None:
            found[role] = index
    return found


def _delimiter(first_line: str) -> str:
    return "\t" if "\t" in first_line and "," not in first_line else ","


def _int_ids(texts: list[str]) -> np.ndarray | None:
    """Ids as int64 when every one is an integer as Python writes it (so "12" is the id 12 of the other formats
    and the service's, and int ids keep their numeric order), else None: they are text."""
    if all(_INT_ID.fullmatch(t) for t in texts):
        values = [int(t) for t in texts]
        if all(-(2**63) <= v < 2**63 for v in values):
            return np.asarray(values, dtype=np.int64)
    return None


def _take_ids(texts: list[str], ints: np.ndarray | None, rows: np.ndarray) -> np.ndarray:
    """The ids of `rows`: int64 where the file's are integers (`_int_ids`), else text, padded only to the longest
    of these rows' ids (numpy pads every text of an array to its longest: one array of the file's would make a
    single long id cost its length on every row)."""
    return ints[rows] if ints is not None else np.asarray([texts[i] for i in rows.tolist()], dtype=str)


def _long_time(text: str) -> float:
    """A number (unix time, or any increasing count such as an order id) or an ISO 8601 time (naive: UTC)."""
    try:
        value = float(text)
    except ValueError:
        stamp = dt.datetime.fromisoformat(text)
        value = (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)).timestamp()
    if not np.isfinite(value):
        raise ValueError(text)
    return value


def _long_response(text: str) -> int:
    value = float(text)  # "1" or "1.0"; 0.5 is no category
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


def _bad_response(path: Path, line_no: int, value: int, n_cats: int | None, column: str) -> DataFormatError:
    """The error for a response outside 0..K-1 (K given) or 0..MAX_CATEGORIES-1 (K still to be inferred)."""
    if n_cats is not None:
        return DataFormatError(path, line_no, f"a response in 0..{n_cats - 1} (column {column!r})", value)
    if value < 0:
        return DataFormatError(path, line_no, f"a response >= 0 (column {column!r})", value)
    return DataFormatError(path, line_no, f"a response below {MAX_CATEGORIES} (column {column!r})", value,
                           CATEGORIES_NOTE)


def read_long_csv(path: str | os.PathLike, n_cats: int | None = None) -> KTDataset:
    """Read one interaction per row (header names: `LONG_COLUMNS`; comma- or tab-separated).

    Each learner's rows are sorted by time (stable: equal times keep file order); learners are ordered by their
    first interaction's time (equal times: file order), so the order of the rows does not matter. A row whose
    event id repeats one of the same learner's is a replay, dropped as the service drops it. Responses are
    integers 0..K-1 (``n_cats=None`` infers K = max response + 1, at least 2; K is at most MAX_CATEGORIES); ids are
    at most MAX_ID_CHARS characters."""
    path = Path(path)
    learners: dict[str, int] = {}
    keys, questions, responses, times, skills, events = [], [], [], [], [], []
    with open_text(path) as f:
        first = f.readline()
        delimiter = _delimiter(first)
        header = [h.strip() for h in next(csv.reader([first], delimiter=delimiter), [])]
        cols = long_columns(header)
        missing = [role for role in LONG_REQUIRED if role not in cols]
        if missing:
            accepted = "; ".join(f"{role}: {' / '.join(LONG_COLUMNS[role][:3])}..." for role in missing)
            raise DataFormatError(path, 1, f"a header with learner, question, response and time columns (missing "
                                           f"{accepted})", delimiter.join(header) or "end of file")
        names = {role: header[i] for role, i in cols.items()}
        reader = csv.reader(f, delimiter=delimiter)
        for row in csv_rows(path, reader, header, lines_before=1):
            line_no = reader.line_num + 1
            if not any(cell.strip() for cell in row):
                continue
            if len(row) != len(header):
                raise DataFormatError(path, line_no, f"{len(header)} columns", len(row))
            cell = {role: row[i].strip() for role, i in cols.items()}
            for role in ("learner", "question"):
                check_id(path, line_no, cell[role], f"a {role} id", names[role])
            for role in ("skill", "event"):  # optional: a row may leave them empty
                if cell.get(role):
                    check_id(path, line_no, cell[role], f"a {role} id", names[role])
            try:
                response = _long_response(cell["response"])
            except ValueError:
                raise DataFormatError(path, line_no, f"an integer response (column {names['response']!r})",
                                      cell["response"]) from None
            if not 0 <= response < (n_cats or MAX_CATEGORIES):
                raise _bad_response(path, line_no, response, n_cats, names["response"])
            try:
                times.append(_long_time(cell["time"]))
            except (ValueError, OverflowError):
                raise DataFormatError(path, line_no, f"a number or an ISO 8601 time (column {names['time']!r})",
                                      cell["time"]) from None
            keys.append(learners.setdefault(cell["learner"], len(learners)))
            questions.append(cell["question"])
            responses.append(response)
            skills.append(cell.get("skill", ""))
            events.append(cell.get("event", ""))
    if not keys:
        raise DataFormatError(path, 2, "at least one interaction", "an empty file")
    keep = np.ones(len(keys), dtype=bool)
    seen: set[tuple[int, str]] = set()
    for i, (key, event) in enumerate(zip(keys, events, strict=True)):
        if event:
            keep[i] = (key, event) not in seen
            seen.add((key, event))
    q_ints, s_ints = _int_ids(questions), (_int_ids(skills) if "skill" in cols else None)
    key_arr, time_arr = np.asarray(keys, dtype=np.int64), np.asarray(times, dtype=np.float64)
    resp_arr = np.asarray(responses, dtype=np.int64)
    rows = np.flatnonzero(keep)
    order = rows[np.lexsort((time_arr[rows], key_arr[rows]))]  # by learner, then time; lexsort is stable
    starts = np.flatnonzero(np.r_[True, key_arr[order][1:] != key_arr[order][:-1]])
    ends = np.r_[starts[1:], len(order)]
    by_first_time = np.argsort(time_arr[order][starts], kind="stable")  # learners in key (file) order on ties
    names_by_key = list(learners)
    sequences = []
    for g in by_first_time:
        index = order[starts[g]:ends[g]]
        sequences.append(Sequence(names_by_key[int(key_arr[index[0]])], _take_ids(questions, q_ints, index),
                                  resp_arr[index], skills=_take_ids(skills, s_ints, index) if "skill" in cols
                                  else None))
    notes = {"columns": names}
    if len(rows) < len(keys):
        notes["replays_dropped"] = len(keys) - len(rows)
    return KTDataset(sequences, n_cats or max(2, int(resp_arr.max()) + 1), str(path), "long_csv", notes)


def write_long_csv(ds: KTDataset, path: str | os.PathLike, *, question_prefix: str = "", learner_prefix: str = "s",
                   start: float = 1.6e9) -> Path:
    """Write a data set in the long format, gzipped when ``path`` ends in .gz: columns learner_id, question_id,
    correct, timestamp, event_id, one row per interaction, rows in time order across learners (learner i's t-th
    interaction at ``start + 86400 t + i``: the learners' order is kept, their rows interleaved).

    Question ids are written as ``question_prefix`` + the id: with a prefix they are text, which the vocabulary
    numbers in natural order, as it numbers the integer ids (`Vocabulary.build`)."""
    path = Path(path)
    rows = [(start + 86400.0 * t + i, i, t) for i, s in enumerate(ds.sequences) for t in range(len(s))]
    rows.sort()
    digits = len(str(len(ds.sequences) - 1))
    # mtime=0: the same data gives the same bytes
    raw = gzip.GzipFile(path, "wb", mtime=0) if path.name.endswith(".gz") else open(path, "wb")  # noqa: SIM115
    with io.TextIOWrapper(raw, encoding="utf-8", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["learner_id", "question_id", "correct", "timestamp", "event_id"])
        for n, (time, i, t) in enumerate(rows):
            s = ds.sequences[i]
            question = s.questions[t]
            question = f"{question_prefix}{question}"
            writer.writerow([f"{learner_prefix}{i:0{digits}d}", question, int(s.responses[t]), f"{time:.0f}",
                             f"e{n}"])
    return path


# ----------------------------------------------------------------------------- format and layout detection


def _fits_records(lines: list[str], n_fields: int) -> bool:
    """True if ``lines`` (a file's first lines) parse as records of 1 length line + n_fields id lines."""
    i = 0
    while i < len(lines):
        length_text = lines[i].strip().rstrip(",").strip()
        if not length_text.isdigit() or int(length_text) == 0:
            return False
        for line in lines[i + 1 : i + 1 + n_fields]:  # a record cut by the sniff window is checked partly
            tokens = line.strip().rstrip(",").split(",")
            if len(tokens) != int(length_text) or not all(t.strip().lstrip("-").isdigit() for t in tokens):
                return False
        i += 1 + n_fields
    return True


def detect_format(path: str | os.PathLike) -> str:
    """Guess a file's format ("three_line", "pykt", "dtransformer" or "long_csv") from its first lines."""
    with open_text(path) as f:
        head = [line.strip() for line in itertools.islice(f, 64)]
    head = [line for line in head if line]
    if not head:
        raise DataFormatError(path, 1, "a knowledge-tracing data file", "empty file")
    if any(c.isalpha() for c in head[0]):  # a CSV header
        header = [_header_key(h) for h in next(csv.reader([head[0]], delimiter=_delimiter(head[0])))]
        if "responses" in header and ("concepts" in header or "questions" in header):
            return "pykt"
        if all(role in long_columns(header) for role in LONG_REQUIRED):
            return "long_csv"
        raise DataFormatError(path, 1, "a pykt header (concepts or questions, responses) or a long-format one "
                                       "(learner, question, response and time columns)", head[0][:80])
    for n_fields in range(2, 9):  # the smallest record size that fits wins (2 fields = three-line)
        if _fits_records(head, n_fields):
            return "three_line" if n_fields == 2 else "dtransformer"
    raise DataFormatError(path, 1, "three-line, DTransformer, pykt CSV or long CSV records", head[0][:60])


def _dtransformer_fields(data_dir: Path, train: Path) -> list[str]:
    """Field order from ``datasets.toml``: the section named by the directory's suffix, else the
    only field list that parses the train file cleanly."""
    toml_path = data_dir / "datasets.toml"
    if not toml_path.exists():
        return ["pid", "q", "s"]
    sections = {name: list(t.get("inputs", [])) for name, t in tomllib.loads(toml_path.read_text()).items()}
    named = [name for name in sections if data_dir.name.endswith(name)]
    if named:
        return sections[max(named, key=len)]
    parsing = []
    for fields in {tuple(f) for f in sections.values()}:
        try:
            read_dtransformer(train, fields)
            parsing.append(list(fields))
        except (DataFormatError, ValueError):
            continue
    if len(parsing) != 1:
        raise ValueError(
            f"{toml_path}: cannot choose a section for {data_dir.name}; field lists that "
            f"parse {train.name}: {parsing}; sections: {sections}"
        )
    return parsing[0]


def _reader_kwargs(data_dir: Path, train: Path, fmt: str) -> dict:
    if fmt == "dtransformer":
        return {"fields": _dtransformer_fields(data_dir, train)}
    meta = data_dir / "metadata.json"
    if fmt in ("three_line", "long_csv") and meta.exists():  # deep-gpcm sets record K, which a file may not show
        n_cats = json.loads(meta.read_text()).get("n_cats")
        if n_cats:
            if isinstance(n_cats, bool) or not isinstance(n_cats, int) or not 2 <= n_cats <= MAX_CATEGORIES:
                raise ValueError(f"{meta}: n_cats must be an integer from 2 to {MAX_CATEGORIES}, got {n_cats!r}")
            return {"n_cats": n_cats}
    return {}


DATA_SUFFIXES = (".csv", ".txt", ".tsv")


def data_files(data_dir: Path) -> list[Path]:
    """The data files of a directory: *.csv, *.txt and *.tsv, plain or compressed (*.csv.gz), not hidden."""
    return sorted(p for p in data_dir.iterdir() if p.is_file() and not p.name.startswith(".")
                  and base_name(p).lower().endswith(DATA_SUFFIXES))


def _named(files: list[Path]) -> tuple[list[Path], list[Path]]:
    train = [p for p in files if "train" in p.name.lower()]
    test = [p for p in files if "test" in p.name.lower() and "train" not in p.name.lower()]
    return train, test


def find_split_files(data_dir: str | os.PathLike) -> tuple[Path, Path, str, dict]:
    """Find (train file, test file, format, reader kwargs) in a data set directory by file names.

    Train files contain "train" (e.g. ``train_valid.csv``), test files "test"; ``valid*`` files
    that are not train files, and metadata (.json/.toml), are ignored.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data set directory not found: {data_dir}")
    files = data_files(data_dir)
    train, test = _named(files)
    if len(train) != 1 or len(test) != 1:
        raise _layout_error(data_dir, files)
    fmt = detect_format(train[0])
    return train[0], test[0], fmt, _reader_kwargs(data_dir, train[0], fmt)


def _layout_error(data_dir: Path, files: list[Path]) -> ValueError:
    train, test = _named(files)
    return ValueError(f"{data_dir}: expected exactly one *train* and one *test* data file (or a *train* file "
                      f"alone, or one data file named neither, split by learner), found "
                      f"train={[p.name for p in train]}, test={[p.name for p in test]} among {[p.name for p in files]}")


def _layout(data: Path) -> tuple[Path, Path | None, str]:
    """(train file, test file, why there is none) of `--data`: a data set directory's *train* and *test* files, or
    the one file to split by learner (test None): a data file given itself, a directory's only data file named
    neither, or a directory's *train* file without a *test* file."""
    if data.is_file():
        return data, None, "one data file"
    if not data.is_dir():
        raise FileNotFoundError(f"data set not found: {data} (give a data set directory or a data file)")
    files = data_files(data)
    train, test = _named(files)
    if len(files) == 1 and not train and not test:
        return files[0], None, "one data file"
    if len(files) == 1 and train:
        return train[0], None, f"no *test* file beside {train[0].name}"
    if len(train) != 1 or len(test) != 1:
        raise _layout_error(data, files)
    return train[0], test[0], ""


def _holds_no_records(path: Path, fmt: str) -> bool:
    """Whether a data file holds nothing but blank lines (and a header, in the formats that have one)."""
    with open_text(path) as f:
        lines = (line for line in f if line.strip())
        if fmt in ("pykt", "long_csv"):
            next(lines, None)
        return next(lines, None) is None


READERS = {"three_line": read_three_line, "pykt": read_pykt_csv, "dtransformer": read_dtransformer,
            "long_csv": read_long_csv}
ONE_INTERACTION_SHARE = 0.9  # a file where more learners than this have a single interaction is refused ...
ONE_INTERACTION_MIN = 10  # ... once it has this many learners
SINGLE_FILE_TEST_PERCENT = 20  # one file to split: the learners whose id hashes below this are the test learners


def check_not_one_row_per_learner(ds: KTDataset) -> None:
    """Refuse a file whose learners nearly all have one interaction: a file of one interaction per row read as
    one learner per row (a pykt file of single values, a long CSV whose learner column is a row id)."""
    ones = sum(len(s) == 1 for s in ds.sequences)
    n = len(ds.sequences)
    if n < ONE_INTERACTION_MIN or ones <= ONE_INTERACTION_SHARE * n:
        return
    if ds.fmt == "long_csv":
        column = ds.notes.get("columns", {}).get("learner", "learner")
        raise ValueError(f"{ds.path}: {ones} of {n} learners have a single interaction: this looks like one row "
                         f"per learner (the long format needs one row per interaction, with the learner's id in "
                         f"column {column!r} on every row of theirs)")
    unit = "rows" if ds.fmt == "pykt" else "records"
    raise ValueError(f"{ds.path}: {ones} of {n} {unit} hold a single interaction: this looks like one interaction "
                     f"per row, read as {ds.fmt}, which needs one record per learner holding all of their answers "
                     f"(a file of one row per interaction is read in the long format: a CSV with learner, "
                     f"question, response and time columns)")


def _hash_split(ds: KTDataset, why: str) -> tuple[KTDataset, KTDataset]:
    """(train, test) of one file's learners: a learner is a test learner when a hash of its id falls in the lowest
    SINGLE_FILE_TEST_PERCENT of 100 buckets (the same learners whatever the seed, the row order, or learners added
    later). `why` the file is split ("one data file") opens the note the log and the manifest show. A side left
    without learners is an error saying what to give."""
    def is_test(student: str) -> bool:
        bucket = int.from_bytes(hashlib.sha256(student.encode()).digest()[:8], "big") % 100
        return bucket < SINGLE_FILE_TEST_PERCENT
    test = {s.student_id for s in ds.sequences if is_test(s.student_id)}
    n = len({s.student_id for s in ds.sequences})
    if not test or len(test) == n:
        part = "test" if test else "training"
        side = f"its only learner falls in the {part} part" if n == 1 else \
            f"all {n} of its learners fall in the {part} part"
        raise ValueError(f"{ds.path}: {why}, so its learners are split into training and test learners by a hash of "
                         f"their id, and {side}: give more learners (about {SINGLE_FILE_TEST_PERCENT}% fall in the "
                         "test part), or a *test* file of other learners beside a *train* file")
    note = {"split": f"{why}: the learners whose id hashes into {SINGLE_FILE_TEST_PERCENT}% of buckets are the test "
                     "learners"}
    parts = ([s for s in ds.sequences if s.student_id not in test], [s for s in ds.sequences if s.student_id in test])
    return tuple(KTDataset(part, ds.n_cats, ds.path, ds.fmt, {**ds.notes, **note}) for part in parts)


def load_dataset(data: str | os.PathLike, fmt: str | None = None) -> tuple[KTDataset, KTDataset]:
    """Load (train, test) from `--data`, a data set directory or a data file; ``fmt`` overrides format detection.

    A directory's train and test files are found by name (*train*, *test*). One file is split by learner
    (`_hash_split`): a data file given itself, a directory's only data file named neither, a *train* file with no
    *test* file beside it (what `nextstep events export --test-fraction 0` writes) or with one that holds no
    interactions."""
    if fmt is not None and fmt not in READERS:
        raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    data = Path(data)
    train_path, test_path, why = _layout(data)
    detected = detect_format(train_path)
    used = fmt or detected
    kwargs = _reader_kwargs(data if data.is_dir() else data.parent, train_path, used)
    if test_path is not None and _holds_no_records(test_path, used):
        test_path, why = None, f"{test_path.name} holds no interactions"
    read = READERS[used]
    try:
        train = read(train_path, **kwargs)
        # K comes from the training file (or metadata): a test response outside it is a format error
        test = None if test_path is None else read(test_path, **{**kwargs, "n_cats": train.n_cats})
    except DataFormatError as exc:
        if used == detected:
            raise
        note = f"read as {fmt}, as asked; the files look like {detected}"
        raise DataFormatError(exc.path, exc.line_no, exc.what, exc.got, note) from None
    for ds in (train, test):
        if ds is not None and not ds.sequences:
            raise DataFormatError(ds.path, 1, "at least one record", "an empty file")
    check_not_one_row_per_learner(train)
    if test is None:
        train, test = _hash_split(train, why)
    else:
        check_not_one_row_per_learner(test)
    for ds in (train, test):
        if compression(ds.path) == "gzip":
            ds.notes["compression"] = "gzip"
    return train, test


def split_students(ds: KTDataset, valid_fraction: float, seed: int) -> tuple[KTDataset, KTDataset]:
    """Split by student (all of a student's sequences go to one side); deterministic for a seed. A fraction above 0
    holds out at least one student of two or more (4 students at 0.1 would otherwise hold out none)."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    students = list(dict.fromkeys(s.student_id for s in ds.sequences))  # first-appearance order
    order = np.random.default_rng(seed).permutation(len(students))
    n_valid = int(round(valid_fraction * len(students)))
    if valid_fraction > 0 and len(students) >= 2:
        n_valid = max(n_valid, 1)
    valid_ids = {students[i] for i in order[:n_valid]}
    train = [s for s in ds.sequences if s.student_id not in valid_ids]
    valid = [s for s in ds.sequences if s.student_id in valid_ids]
    return KTDataset(train, ds.n_cats, ds.path, ds.fmt), KTDataset(valid, ds.n_cats, ds.path, ds.fmt)
