"""Session data for next-item models: readers, the GRU4Rec split layout, and the Zipf generator of seed 002.

Three on-disk layouts, each read into a `SessionData` (events grouped by session, each session's events
in time order, sessions ordered by their first event's time):

* ``gru4rec``    -- GRU4Rec / session-rec TSV with header ``SessionId<TAB>ItemId<TAB>Time`` (unix seconds).
* ``diginetica`` -- the raw Diginetica item views: ``session_id;user_id;item_id;timeframe;eventdate``.
* ``csv``        -- any CSV with named session, item and time columns (``--session-col`` etc.).

Item ids are integers (as in all three sources); a malformed row raises `DataFormatError` naming the
file, line and column. A file may be gzipped (``rsc15_train_full.tsv.gz``; found by its first bytes); another
compression is refused, naming it. Raw item ids map to model rows through `data.Vocabulary` (row 0 padding, row 1
unknown, both never recommended).
"""

from __future__ import annotations

import csv
import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..data import DataFormatError, Vocabulary, base_name, open_text

SESSION_FORMATS = ("gru4rec", "diginetica", "csv")


@dataclass
class SessionData:
    """Events grouped by session: session i is items[offsets[i]:offsets[i+1]], in time order."""

    session_ids: list[str]
    items: np.ndarray  # int64 raw item ids (or model rows after `encode`)
    times: np.ndarray  # float64 seconds
    offsets: np.ndarray  # int64, len(session_ids) + 1
    path: str = ""

    def __len__(self) -> int:
        return len(self.session_ids)

    @property
    def n_events(self) -> int:
        return len(self.items)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def session(self, i: int) -> np.ndarray:
        return self.items[self.offsets[i]:self.offsets[i + 1]]

    def encode(self, vocab: Vocabulary, drop_unknown: bool = True) -> SessionData:
        """Items as model rows. drop_unknown: remove events whose item the vocabulary lacks (the
        official evaluation protocol drops test items unseen in training), then sessions left with
        fewer than two events (no target)."""
        rows = vocab.encode(self.items)
        keep = rows != Vocabulary.UNKNOWN if drop_unknown else np.ones(len(rows), bool)
        return _group(np.repeat(np.arange(len(self)), self.lengths())[keep], rows[keep], self.times[keep],
                      self.session_ids, self.path, min_length=2 if drop_unknown else 1)


def _group(session_keys: np.ndarray, items: np.ndarray, times: np.ndarray, names: list[str], path: str,
           min_length: int = 1) -> SessionData:
    """Sort events by (session, time) (stable, so equal times keep file order), order sessions by their
    first event's time, and drop sessions shorter than min_length."""
    order = np.lexsort((times, session_keys))  # stable
    keys, items, times = session_keys[order], items[order], times[order]
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]]) if len(keys) else np.zeros(0, np.int64)
    ends = np.r_[starts[1:], len(keys)].astype(np.int64)
    good = (ends - starts) >= min_length
    starts, ends = starts[good], ends[good]
    by_time = np.argsort(times[starts], kind="stable")
    starts, ends = starts[by_time], ends[by_time]
    index = np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)]) if len(starts) else \
        np.zeros(0, np.int64)
    offsets = np.r_[0, np.cumsum(ends - starts)].astype(np.int64)
    return SessionData([names[k] for k in keys[starts]], items[index].astype(np.int64),
                       times[index].astype(np.float64), offsets, path)


def _read_rows(path: Path, columns: tuple[str, str, str], delimiter: str, parse_time) -> SessionData:
    session_col, item_col, time_col = columns
    sessions: dict[str, int] = {}
    keys, items, times = [], [], []
    with open_text(path) as f:
        reader = csv.reader(f, delimiter=delimiter)
        header = next(reader, None)
        if header is None:
            raise DataFormatError(path, 1, f"a header with columns {list(columns)}", "an empty file")
        header = [h.strip() for h in header]
        missing = [c for c in columns if c not in header]
        if missing:
            raise DataFormatError(path, 1, f"a header with columns {list(columns)}", header)
        si, ii, ti = (header.index(c) for c in columns)
        for line_no, row in enumerate(reader, start=2):
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) < len(header):
                raise DataFormatError(path, line_no, f"{len(header)} {delimiter!r}-separated fields", len(row))
            try:
                item = int(row[ii])
            except ValueError:
                raise DataFormatError(path, line_no, f"an integer item id in column {item_col!r}", row[ii]) from None
            try:
                t = parse_time(row)
            except (ValueError, OverflowError):
                raise DataFormatError(path, line_no, f"a time in column {time_col!r}", row[ti]) from None
            if not np.isfinite(t):
                raise DataFormatError(path, line_no, f"a finite time in column {time_col!r}", row[ti])
            keys.append(sessions.setdefault(row[si].strip(), len(sessions)))
            items.append(item)
            times.append(t)
    if not items:
        raise DataFormatError(path, 2, "at least one event", "an empty file")
    return _group(np.asarray(keys, np.int64), np.asarray(items, np.int64), np.asarray(times, np.float64),
                  list(sessions), str(path))


def read_gru4rec_tsv(path: str | os.PathLike) -> SessionData:
    """GRU4Rec's TSV: ``SessionId ItemId Time``, time in unix seconds."""
    return _read_rows(Path(path), ("SessionId", "ItemId", "Time"), "\t", lambda row: float(row[2]))


def read_diginetica(path: str | os.PathLike) -> SessionData:
    """Raw Diginetica item views; time = event date (UTC midnight) + timeframe (ms since the session began)."""
    def parse(row):
        day = dt.datetime.strptime(row[4].strip(), "%Y-%m-%d").replace(tzinfo=dt.UTC).timestamp()
        return day + int(row[3]) / 1000.0
    return _read_rows(Path(path), ("session_id", "item_id", "timeframe"), ";", parse)


def read_csv(path: str | os.PathLike, session_col: str = "session_id", item_col: str = "item_id",
             time_col: str = "time", delimiter: str = ",") -> SessionData:
    """A CSV with named columns; times are numbers (unix seconds) or ISO 8601 timestamps."""
    path = Path(path)
    with open_text(path) as f:
        header = [h.strip() for h in next(csv.reader(f, delimiter=delimiter), [])]
    ti = header.index(time_col) if time_col in header else 0

    def parse(row):
        text = row[ti].strip()
        try:
            return float(text)
        except ValueError:
            stamp = dt.datetime.fromisoformat(text)
            return (stamp if stamp.tzinfo else stamp.replace(tzinfo=dt.UTC)).timestamp()
    return _read_rows(path, (session_col, item_col, time_col), delimiter, parse)


def write_gru4rec_tsv(data: SessionData, path: str | os.PathLike) -> None:
    with open(path, "w") as f:
        f.write("SessionId\tItemId\tTime\n")
        for i, name in enumerate(data.session_ids):
            for j in range(data.offsets[i], data.offsets[i + 1]):
                f.write(f"{name}\t{data.items[j]}\t{data.times[j]:.3f}\n")


def _stem(path: Path) -> str:
    """A file's name without its extension and compression suffix: ``x_train_full.tsv.gz`` -> ``x_train_full``."""
    return Path(base_name(path)).stem


def _find(data_dir: Path, suffix: str) -> Path:
    found = sorted(p for p in data_dir.iterdir() if p.is_file() and _stem(p).endswith(suffix))
    if len(found) != 1:
        raise FileNotFoundError(f"{data_dir}: expected one file named *{suffix}.*, found "
                                f"{[p.name for p in found] or 'none'}")
    return found[0]


def load_session_split(data_dir: str | os.PathLike, valid: bool = False, fmt: str | None = None,
                       **csv_columns) -> tuple[SessionData, SessionData]:
    """(train, test) of a session data set directory in GRU4Rec's layout: `*_train_full` / `*_test`,
    or with valid=True the tuning split `*_train_tr` / `*_train_valid` carved from the training data.
    A directory holding a single raw file (Diginetica sample, a CSV) is split by time: the sessions
    starting in the last 10% of the time span are the test sessions."""
    data_dir = Path(data_dir)
    files = sorted(p for p in data_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    if any(_stem(p).endswith("_train_full") for p in files):
        names = ("_train_tr", "_train_valid") if valid else ("_train_full", "_test")
        train, test = (_find(data_dir, n) for n in names)
        reader = _reader(fmt or "gru4rec", csv_columns)
        return reader(train), reader(test)
    if len(files) != 1:
        raise FileNotFoundError(f"{data_dir}: expected *_train_full/*_test files or a single raw file, found "
                                f"{[p.name for p in files]}")
    guess = "diginetica" if "item-views" in files[0].name else "csv"
    data = _reader(fmt or guess, csv_columns)(files[0])
    train, test = split_by_time(data, 0.1)
    return split_by_time(train, 0.1) if valid else (train, test)


def _reader(fmt: str, csv_columns: dict):
    if fmt == "gru4rec":
        return read_gru4rec_tsv
    if fmt == "diginetica":
        return read_diginetica
    if fmt == "csv":
        return lambda p: read_csv(p, **csv_columns)
    raise ValueError(f"unknown session format {fmt!r}; expected one of {SESSION_FORMATS}")


def split_by_time(data: SessionData, test_fraction: float) -> tuple[SessionData, SessionData]:
    """Sessions that start in the last `test_fraction` of the time span go to the second part."""
    starts = data.times[data.offsets[:-1]]
    cut = starts.min() + (1 - test_fraction) * (starts.max() - starts.min())
    return subset(data, np.flatnonzero(starts < cut)), subset(data, np.flatnonzero(starts >= cut))


def subset(data: SessionData, sessions: np.ndarray) -> SessionData:
    lengths = data.lengths()[sessions]
    index = np.concatenate([np.arange(data.offsets[i], data.offsets[i + 1]) for i in sessions]) \
        if len(sessions) else np.zeros(0, np.int64)
    return SessionData([data.session_ids[i] for i in sessions], data.items[index], data.times[index],
                       np.r_[0, np.cumsum(lengths)].astype(np.int64), data.path)


def write_zipf_split(directory: str | os.PathLike, **kwargs) -> Path:
    """Generate sessions (``**kwargs`` as for `zipf_sessions`) and write them as a data set directory the
    next-item run reads: the first five sixths to ``demo_train_full.txt``, the rest to ``demo_test.txt``
    (GRU4Rec's TSV). Returns the directory."""
    sessions = zipf_sessions(**kwargs)
    n_train = len(sessions.session_ids) * 5 // 6
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    write_gru4rec_tsv(subset(sessions, np.arange(n_train)), out / "demo_train_full.txt")
    write_gru4rec_tsv(subset(sessions, np.arange(n_train, len(sessions.session_ids))), out / "demo_test.txt")
    return out


def zipf_sessions(n_sessions: int, n_items: int, length_range: tuple[int, int] = (2, 10), exponent: float = 0.8,
                  follow: float = 0.0, seed: int = 0) -> SessionData:
    """Seed 002 section 6.3: items drawn with weight 1 / rank^exponent, session lengths uniform in
    length_range (inclusive). follow > 0 adds sequential signal for tests: with that probability the next
    item is a fixed successor of the previous one (item i -> (7 i + 3) mod n_items)."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, n_items + 1) ** exponent
    p = weights / weights.sum()
    lengths = rng.integers(length_range[0], length_range[1] + 1, size=n_sessions)
    items = rng.choice(n_items, size=int(lengths.sum()), p=p)
    offsets = np.r_[0, np.cumsum(lengths)].astype(np.int64)
    if follow > 0:
        jump = rng.random(len(items)) < follow
        for s in range(n_sessions):
            for j in range(offsets[s] + 1, offsets[s + 1]):
                if jump[j]:
                    items[j] = (7 * items[j - 1] + 3) % n_items
    times = np.concatenate([1.6e9 + s * 3600.0 + np.arange(n) * 30.0 for s, n in enumerate(lengths)])
    return SessionData([str(s + 1) for s in range(n_sessions)], items.astype(np.int64) + 1, times, offsets)
