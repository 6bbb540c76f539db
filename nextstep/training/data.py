"""What every task's data shares: where the data lives, opening data files (plain or gzipped), their errors,
the fingerprint of a run's files, the one `Vocabulary` (raw id <-> model row) and the unknown row.

The task's readers are in its subpackage: kt/data.py (knowledge-tracing data sets), next_item/sessions.py
(session logs), srs/reviews.py (review logs).
"""

from __future__ import annotations

import contextlib
import csv
import gzip
import hashlib
import itertools
import os
import re
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

DATA_DIR_ENV = "NEXTSTEP_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def default_data_dir() -> Path:
    """The shared data directory: ``$NEXTSTEP_DATA_DIR``, else ``<repo root>/../shared/data``."""
    return Path(os.environ.get(DATA_DIR_ENV) or _REPO_ROOT.parent / "shared" / "data")


class DataFormatError(ValueError):
    """A data file does not follow its format; the message says where and why."""

    def __init__(self, path: str | os.PathLike, line_no: int, what: str, got: object, note: str = "") -> None:
        self.path, self.line_no, self.what, self.got, self.note = str(path), line_no, what, got, note
        super().__init__(f"{path}:{line_no}: expected {what}, got {_shown(got)}" + (f" ({note})" if note else ""))

    def __reduce__(self):  # keep the exception picklable (e.g. across DataLoader workers)
        return type(self), (self.path, self.line_no, self.what, self.got, self.note)


SHOWN_CHARS = 80  # what an error quotes of a value: a 100,000-character field would make a 100 KB message


def _shown(got: object) -> str:
    text = repr(got)
    if len(text) <= SHOWN_CHARS:
        return text
    size = f"{len(got):,} characters" if isinstance(got, str) else f"{len(text):,} characters as written"
    return f"{text[:SHOWN_CHARS - 20]}... ({size})"


# ----------------------------------------------------------------------------- line parsing helpers


# the first bytes of compressed files: gzip is read, the others are named in the error
MAGIC = ((b"\x1f\x8b", "gzip"), (b"\x28\xb5\x2f\xfd", "zstd"), (b"\xfd7zXZ\x00", "xz"), (b"PK\x03\x04", "zip"),
         (b"PK\x05\x06", "zip"), (b"\x04\x22\x4d\x18", "lz4"), (b"7z\xbc\xaf\x27\x1c", "7z"),
         *((b"BZh%d" % level, "bzip2") for level in range(1, 10)))
COMPRESSED_SUFFIXES = (".gz", ".gzip", ".zst", ".bz2", ".xz", ".zip", ".lz4", ".7z")


def compression(path: str | os.PathLike) -> str | None:
    """The compression a file's first bytes show ("gzip", "zstd", ...), or None for a plain file."""
    with open(path, "rb") as f:
        head = f.read(8)
    return next((name for magic, name in MAGIC if head.startswith(magic)), None)


@contextlib.contextmanager
def open_text(path: str | os.PathLike):
    """A data file opened as text for the csv module (a byte-order mark is skipped): plain or gzipped, whatever
    its name; another compression, or a gzip file cut short, is a `DataFormatError` saying so, and so are bytes
    that are not UTF-8 met while reading it (naming their line, which the decoder does not know)."""
    kind = compression(path)
    if kind not in (None, "gzip"):
        raise DataFormatError(path, 1, "a plain or gzipped text file", f"{kind}-compressed data",
                              "decompress it first, or gzip it: only gzip is read")
    try:
        with _open(path, kind, "rt") as f:
            yield f
    except (EOFError, zlib.error, gzip.BadGzipFile) as exc:
        raise DataFormatError(path, 1, "a whole gzip file", str(exc), "the file is damaged or cut short") from None
    except UnicodeDecodeError:
        line_no, byte, at = _first_undecodable(path, kind)
        raise DataFormatError(path, line_no, "UTF-8 text", byte, f"byte {at + 1} of the line; save the file as "
                                                                  "UTF-8") from None


def _open(path: str | os.PathLike, kind: str | None, mode: str):
    """A plain or gzipped file, as text ("rt": UTF-8, a byte-order mark skipped) or bytes ("rb")."""
    text = {"newline": "", "encoding": "utf-8-sig"} if mode == "rt" else {}
    return gzip.open(path, mode, **text) if kind == "gzip" else open(path, mode.rstrip("t"), **text)  # noqa: SIM115


def _first_undecodable(path: str | os.PathLike, kind: str | None) -> tuple[int, bytes, int]:
    """(line number, the bytes, their offset in the line) of a file's first bytes that are not UTF-8. Lines are
    decoded one by one: no UTF-8 character holds a newline byte, so each line decodes as it would in the file."""
    with _open(path, kind, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                return line_no, raw[exc.start:exc.end], exc.start
    return 1, b"", 0  # (not reached: the text reader met them)


def base_name(path: str | os.PathLike) -> str:
    """A data file's name without a compression suffix (``x_train.csv.gz`` -> ``x_train.csv``)."""
    name = Path(path).name
    for suffix in COMPRESSED_SUFFIXES:
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return name


def fingerprint(*paths: str | os.PathLike) -> str:
    """A short content hash of data files (provenance in manifests)."""
    digest = hashlib.sha256()
    for p in paths:
        digest.update(Path(p).read_bytes())
    return digest.hexdigest()[:16]


# ----------------------------------------------------------------------------- CSV rows and ids

MAX_ID_CHARS = 256  # an id longer than this is refused: text ids are stored padded to the longest one (numpy)


def check_id(path: str | os.PathLike, line_no: int, text: str, what: str, column: str) -> str:
    """`text` when it is a non-empty id of at most MAX_ID_CHARS characters, else a `DataFormatError` naming
    `what` ("a question id") and the column."""
    if not text:
        raise DataFormatError(path, line_no, f"{what} (column {column!r})", "")
    if len(text) > MAX_ID_CHARS:
        raise DataFormatError(path, line_no, f"{what} of at most {MAX_ID_CHARS} characters (column {column!r})",
                              f"{len(text):,} characters")
    return text


def csv_rows(path: str | os.PathLike, reader, header: Sequence[str] = (), lines_before: int = 0) -> Iterator[list]:
    """The rows of a `csv.reader` over a data file. Where the csv module raises a bare `csv.Error` naming neither
    file nor line (a field past its size limit, a NUL byte), a `DataFormatError` names both, and for a field too
    long the column of `header` it falls in. `lines_before`: lines of the file read before the reader began."""
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            line_no = reader.line_num + lines_before
            if "field larger than field limit" not in str(exc):
                raise DataFormatError(path, line_no, "a CSV row", str(exc)) from None
            limit = csv.field_size_limit()
            column = _long_field_column(path, line_no, reader.dialect.delimiter, header, limit)
            raise DataFormatError(path, line_no, f"fields of at most {limit:,} characters{column}",
                                  "a longer one") from None
        yield row


def _long_field_column(path: str | os.PathLike, line_no: int, delimiter: str, header: Sequence[str],
                       limit: int) -> str:
    """" (column NAME)" of the first field of at least `limit` characters on a line, or "" where none is found (a
    field running over several lines)."""
    with open_text(path) as f:
        line = next(itertools.islice(f, line_no - 1, None), "")
    index = next((i for i, n in enumerate(_field_lengths(line, delimiter)) if n >= limit), None)
    if index is None:
        return ""
    return f" (column {header[index]!r})" if index < len(header) else f" (field {index + 1})"


def _field_lengths(line: str, delimiter: str) -> list[int]:
    """The length of each field of a CSV line: split at the delimiters outside double quotes."""
    lengths, n, quoted = [], 0, False
    for char in line.rstrip("\r\n"):
        if char == '"':
            quoted = not quoted
        elif char == delimiter and not quoted:
            lengths.append(n)
            n = 0
            continue
        n += 1
    return [*lengths, n]


# ----------------------------------------------------------------------------- vocabulary


def id_array(values) -> np.ndarray:
    """Raw ids as an array: int64 for numbers, str for text (an object array of mixed ids becomes text)."""
    arr = np.asarray(values)
    if arr.dtype.kind in "USO":
        return arr.astype(str)
    return np.asarray(values, dtype=np.int64)


def _natural(text: str) -> tuple:
    """A sort key comparing runs of digits as numbers ("q7" < "q12"); equal keys ("q7", "q07") by the text."""
    parts = re.split(r"([0-9]+)", text)  # text, digits, text, ...: the types alternate at the same places
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), text


@dataclass
class Vocabulary:
    """Raw id <-> model index. Index 0 is padding, 1 an unknown id, known ids take 2..len-1.

    Ids are integers, or text where any id is text. An id is matched as the service matches it, by its text: the
    id 12 and the text "12" are the same id (a text vocabulary finds 12, an integer one "12"); "012" is another.
    """

    ids: list[int] | list[str]  # known raw ids in index order (index = position + 2)
    _keys: np.ndarray = field(init=False, repr=False, compare=False)
    _rows: np.ndarray = field(init=False, repr=False, compare=False)
    _text: tuple[np.ndarray, np.ndarray] | None = field(init=False, repr=False, compare=False, default=None)

    PAD = 0
    UNKNOWN = 1

    def __post_init__(self) -> None:
        ids = list(self.ids)
        numeric = all(isinstance(i, (int, np.integer)) and not isinstance(i, bool) for i in ids)
        self.ids = [int(i) for i in ids] if numeric else [str(i) for i in ids]
        if len(set(self.ids)) != len(self.ids):
            raise ValueError("Vocabulary ids must be unique")
        keys = np.asarray(self.ids, dtype=np.int64 if numeric else str)
        order = np.argsort(keys, kind="stable")
        self._keys = keys[order]  # sorted ids, for binary search
        self._rows = order.astype(np.int64) + 2  # model index of each sorted id
        self._text = (self._keys, self._rows) if not numeric else None

    @property
    def numeric(self) -> bool:
        """True when the ids are integers."""
        return self._keys.dtype.kind == "i"

    @classmethod
    def build(cls, ids: Iterable[int] | Iterable[str], min_count: int = 1) -> Vocabulary:
        """The distinct ids in order: integers by value, text in natural order (runs of digits compared as
        numbers: "q7" before "q12"), so that ids that are numbers with a prefix are numbered as the numbers are.
        min_count: an id occurring fewer times than this is left out (it encodes to UNKNOWN, the row it shares with
        every id the model never saw)."""
        arr = ids if isinstance(ids, np.ndarray) else np.asarray(list(ids))
        arr = id_array(arr) if len(arr) else np.zeros(0, dtype=np.int64)
        unique, counts = np.unique(arr, return_counts=True)
        unique = unique[counts >= min_count].tolist()
        return cls(unique if arr.dtype.kind == "i" else sorted(unique, key=_natural))

    def _text_keys(self) -> tuple[np.ndarray, np.ndarray]:
        """(sorted ids as text, their rows): how text ids are looked up in an integer vocabulary."""
        if self._text is None:
            keys = np.asarray([str(i) for i in self.ids], dtype=str)
            order = np.argsort(keys, kind="stable")
            self._text = keys[order], order.astype(np.int64) + 2
        return self._text

    def encode(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids)
        text = ids.dtype.kind in "USO"
        if not text:
            ids = ids.astype(np.int64)
        if not len(self._keys):
            return np.full(ids.shape, self.UNKNOWN, dtype=np.int64)
        if self.numeric and not text:
            keys, rows = self._keys, self._rows
        else:
            (keys, rows), ids = self._text_keys(), ids.astype(str)
        pos = np.clip(np.searchsorted(keys, ids), 0, len(keys) - 1)
        return np.where(keys[pos] == ids, rows[pos], self.UNKNOWN).astype(np.int64)

    def __len__(self) -> int:
        return len(self.ids) + 2

    def to_json(self) -> dict:
        return {"ids": list(self.ids)}

    @classmethod
    def from_json(cls, d: dict) -> Vocabulary:
        return cls(list(d["ids"]))


# ----------------------------------------------------------------------------- the unknown row

MIN_COUNT = 5  # an id seen fewer times than this in the fitting data shares the unknown row (docs/decisions.md)
UNKNOWN_SHARE = 0.05  # and this share of the fitting interactions is given as unknown, so the row always trains
ITEM_UNKNOWN_SHARE = 0.01  # the same for next-item clicks (not validated: the smaller share, docs/decisions.md)


def check_unknown_options(min_count, share) -> None:
    """ValueError naming the option that is out of range (raised by the training configs, before any data)."""
    if isinstance(min_count, bool) or not isinstance(min_count, int) or min_count < 1:
        raise ValueError(f"min count must be an integer of at least 1 (1: every id seen keeps its row), got "
                         f"{min_count!r}")
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share < 1:
        raise ValueError(f"unknown_share must be a number in [0, 1), got {share!r}")


def hide_ids(rows: list[np.ndarray], share: float, seed: int) -> list[np.ndarray]:
    """The encoded id rows with a seeded random `share` of their known positions (>= 2) set to UNKNOWN: the
    interactions through which the unknown row learns an average item (new arrays; the inputs are not changed)."""
    if share <= 0:
        return rows
    rng = np.random.default_rng([seed, 37])
    out = []
    for r in rows:
        hide = (rng.random(len(r)) < share) & (r >= 2)
        out.append(np.where(hide, Vocabulary.UNKNOWN, r).astype(np.int64))
    return out


def unknown_record(vocab_ids: int, seen_ids: int, min_count: int, share: float, rows: list[np.ndarray],
                   answers: bool | None = None) -> dict:
    """The manifest's `unknown` section: how the unknown row (1) was trained. `interactions` is the number of fitting
    interactions given through it; `answers` whether the service may answer an id the model never saw through it:
    by default when it was trained (interactions > 0; else the service refuses unknown ids, 422)."""
    interactions = int(sum(int((r == Vocabulary.UNKNOWN).sum()) for r in rows))
    return {"row": Vocabulary.UNKNOWN, "min_count": min_count, "share": share, "rare_ids": seen_ids - vocab_ids,
            "interactions": interactions, "answers": interactions > 0 if answers is None else answers}
