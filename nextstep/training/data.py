"""Readers for knowledge-tracing data sets.

Three on-disk layouts are supported, each read into the same in-memory form (a `KTDataset` of
per-student `Sequence`s holding RAW ids, exactly as in the file):

* ``three_line``   -- DKVMN / deep-gpcm: records of 3 lines: length / question ids / responses.
* ``pykt``         -- pykt-toolkit CSV: header ``fold,uid,concepts,responses[,...]`` with quoted lists.
* ``dtransformer`` -- DTransformer: a length line, then one line per field listed in ``datasets.toml``.

Every malformed line raises `DataFormatError` naming the file, the 1-based line number, what was
expected and what was found. Mapping raw ids to embedding rows is the job of `Vocabulary`.
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import os
import tomllib
from collections.abc import Iterable, Iterator
from collections.abc import Sequence as AbcSequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

FORMATS = ("three_line", "pykt", "dtransformer")
DATA_DIR_ENV = "NEXTSTEP_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """The shared data directory: ``$NEXTSTEP_DATA_DIR``, else ``<repo root>/../shared/data``."""
    return Path(os.environ.get(DATA_DIR_ENV) or _REPO_ROOT.parent / "shared" / "data")


class DataFormatError(ValueError):
    """A data file does not follow its format; the message says where and why."""

    def __init__(self, path: str | os.PathLike, line_no: int, what: str, got: object, note: str = "") -> None:
        self.path, self.line_no, self.what, self.got, self.note = str(path), line_no, what, got, note
        super().__init__(f"{path}:{line_no}: expected {what}, got {got!r}" + (f" ({note})" if note else ""))

    def __reduce__(self):  # keep the exception picklable (e.g. across DataLoader workers)
        return type(self), (self.path, self.line_no, self.what, self.got, self.note)


# eq=False: arrays do not support tuple comparison/hashing, so sequences compare by identity.
@dataclass(frozen=True, eq=False)
class Sequence:
    """One student's interactions, in time order, with ids exactly as in the file."""

    student_id: str
    questions: np.ndarray  # int64 raw question / skill ids
    responses: np.ndarray  # int64 categories 0..K-1
    problems: np.ndarray | None = None  # int64 raw problem ids (DTransformer ``pid``) when present

    def __post_init__(self) -> None:
        for name in ("questions", "responses", "problems"):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, np.asarray(value, dtype=np.int64))
        n = len(self.questions)
        if len(self.responses) != n or (self.problems is not None and len(self.problems) != n):
            raise ValueError(f"sequence {self.student_id!r}: fields have different lengths")

    def __len__(self) -> int:
        return len(self.questions)


@dataclass
class KTDataset:
    sequences: list[Sequence]
    n_cats: int  # K, the number of response categories (2 for binary data)
    path: str
    fmt: str  # one of FORMATS

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def n_interactions(self) -> int:
        return sum(len(s.questions) for s in self.sequences)


# ----------------------------------------------------------------------------- line parsing helpers


def _read_lines(path: Path) -> list[str]:
    with open(path, encoding="utf-8-sig") as f:  # utf-8-sig: tolerate a byte-order mark
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
    """Responses must lie in 0..K-1 (only non-negative when K is still to be inferred)."""
    high = np.iinfo(np.int64).max if n_cats is None else n_cats - 1
    bad = (responses < 0) | (responses > high)
    if bad.any():
        what = "responses >= 0" if n_cats is None else f"responses in 0..{high}"
        raise DataFormatError(path, line_no, what, int(responses[bad.argmax()]))


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
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.reader(f)
        header = [h.strip() for h in next(reader, [])]
        id_col = "concepts" if "concepts" in header else "questions"
        if id_col not in header or "responses" not in header:
            what = "a CSV header with 'concepts' (or 'questions') and 'responses' columns"
            raise DataFormatError(path, 1, what, ",".join(header) or "end of file")
        for row in reader:
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
    """Guess a file's format ("three_line", "pykt" or "dtransformer") from its first lines."""
    with open(path, encoding="utf-8-sig") as f:
        head = [line.strip() for line in itertools.islice(f, 64)]
    head = [line for line in head if line]
    if not head:
        raise DataFormatError(path, 1, "a knowledge-tracing data file", "empty file")
    if any(c.isalpha() for c in head[0]):
        return "pykt"  # a CSV header; read_pykt_csv checks its columns
    for n_fields in range(2, 9):  # the smallest record size that fits wins (2 fields = three-line)
        if _fits_records(head, n_fields):
            return "three_line" if n_fields == 2 else "dtransformer"
    raise DataFormatError(path, 1, "three-line, DTransformer or pykt CSV records", head[0][:60])


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
    if fmt == "three_line" and meta.exists():  # deep-gpcm sets record K, which a file may not show
        n_cats = json.loads(meta.read_text()).get("n_cats")
        if n_cats:
            return {"n_cats": int(n_cats)}
    return {}


def find_split_files(data_dir: str | os.PathLike) -> tuple[Path, Path, str, dict]:
    """Find (train file, test file, format, reader kwargs) in a data set directory by file names.

    Train files contain "train" (e.g. ``train_valid.csv``), test files "test"; ``valid*`` files
    that are not train files, and metadata (.json/.toml), are ignored.
    """
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"data set directory not found: {data_dir}")
    files = sorted(p for p in data_dir.iterdir() if p.is_file() and p.suffix.lower() in {".csv", ".txt"})
    train = [p for p in files if "train" in p.name.lower()]
    test = [p for p in files if "test" in p.name.lower() and "train" not in p.name.lower()]
    if len(train) != 1 or len(test) != 1:
        raise ValueError(
            f"{data_dir}: expected exactly one *train* and one *test* data file, found train="
            f"{[p.name for p in train]}, test={[p.name for p in test]} among {[p.name for p in files]}"
        )
    fmt = detect_format(train[0])
    return train[0], test[0], fmt, _reader_kwargs(data_dir, train[0], fmt)


_READERS = {"three_line": read_three_line, "pykt": read_pykt_csv, "dtransformer": read_dtransformer}


def load_dataset(data_dir: str | os.PathLike, fmt: str | None = None) -> tuple[KTDataset, KTDataset]:
    """Load (train, test) from a data set directory; ``fmt`` overrides format detection."""
    train_path, test_path, detected, kwargs = find_split_files(data_dir)
    used = detected
    if fmt is not None and fmt != detected:
        if fmt not in _READERS:
            raise ValueError(f"unknown format {fmt!r}; expected one of {FORMATS}")
        used, kwargs = fmt, _reader_kwargs(Path(data_dir), train_path, fmt)
    read = _READERS[used]
    try:
        train = read(train_path, **kwargs)
        # K comes from the training file (or metadata): a test response outside it is a format error
        test = read(test_path, **{**kwargs, "n_cats": train.n_cats})
    except DataFormatError as exc:
        if used == detected:
            raise
        note = f"read as {fmt}, as asked; the files look like {detected}"
        raise DataFormatError(exc.path, exc.line_no, exc.what, exc.got, note) from None
    for ds in (train, test):
        if not ds.sequences:
            raise DataFormatError(ds.path, 1, "at least one record", "an empty file")
    return train, test


def fingerprint(*paths: str | os.PathLike) -> str:
    """A short content hash of data files (provenance in manifests)."""
    digest = hashlib.sha256()
    for p in paths:
        digest.update(Path(p).read_bytes())
    return digest.hexdigest()[:16]


def split_students(ds: KTDataset, valid_fraction: float, seed: int) -> tuple[KTDataset, KTDataset]:
    """Split by student (all of a student's sequences go to one side); deterministic for a seed."""
    if not 0.0 <= valid_fraction < 1.0:
        raise ValueError(f"valid_fraction must be in [0, 1), got {valid_fraction}")
    students = list(dict.fromkeys(s.student_id for s in ds.sequences))  # first-appearance order
    order = np.random.default_rng(seed).permutation(len(students))
    n_valid = int(round(valid_fraction * len(students)))
    valid_ids = {students[i] for i in order[:n_valid]}
    train = [s for s in ds.sequences if s.student_id not in valid_ids]
    valid = [s for s in ds.sequences if s.student_id in valid_ids]
    return KTDataset(train, ds.n_cats, ds.path, ds.fmt), KTDataset(valid, ds.n_cats, ds.path, ds.fmt)


# ----------------------------------------------------------------------------- vocabulary


@dataclass
class Vocabulary:
    """Raw id <-> model index. Index 0 is padding, 1 an unknown id, known ids take 2..len-1."""

    ids: list[int]  # known raw ids in index order (index = position + 2)
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    _rows: np.ndarray = field(init=False, repr=False, compare=False)

    PAD = 0
    UNKNOWN = 1

    def __post_init__(self) -> None:
        self.ids = [int(i) for i in self.ids]
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("Vocabulary ids must be unique")
        order = np.argsort(np.asarray(self.ids, dtype=np.int64), kind="stable")
        self._keys = np.asarray(self.ids, dtype=np.int64)[order]  # sorted ids, for binary search
        self._rows = order.astype(np.int64) + 2  # model index of each sorted id

    @classmethod
    def build(cls, ids: Iterable[int]) -> Vocabulary:
        arr = ids if isinstance(ids, np.ndarray) else np.fromiter(ids, dtype=np.int64)
        return cls(np.unique(np.asarray(arr, dtype=np.int64)).tolist())

    def encode(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64)
        if not len(self._keys):
            return np.full(ids.shape, self.UNKNOWN, dtype=np.int64)
        pos = np.clip(np.searchsorted(self._keys, ids), 0, len(self._keys) - 1)
        return np.where(self._keys[pos] == ids, self._rows[pos], self.UNKNOWN).astype(np.int64)

    def __len__(self) -> int:
        return len(self.ids) + 2

    def to_json(self) -> dict:
        return {"ids": list(self.ids)}

    @classmethod
    def from_json(cls, d: dict) -> Vocabulary:
        return cls(list(d["ids"]))
