"""Session data for next-item models: readers, the GRU4Rec split layout, and the Zipf generator of seed 002.

Three on-disk layouts, each read into a `SessionData` (events grouped by session, each session's events
in time order, sessions ordered by their first event's time):

* ``gru4rec``    -- GRU4Rec / session-rec TSV with header ``SessionId<TAB>ItemId<TAB>Time`` (unix seconds).
* ``diginetica`` -- the raw Diginetica item views: ``session_id;user_id;item_id;timeframe;eventdate``.
* ``csv``        -- any CSV with named session, item and time columns (``--session-col`` etc.).

Item ids are integers (as in all three sources), session ids any text of at most `MAX_ID_CHARS` characters; a
malformed row raises `DataFormatError` naming the file, line and column. A file may be gzipped
(``rsc15_train_full.tsv.gz``; found by its first bytes); another compression is refused, naming it. Raw item ids
map to model rows through `data.Vocabulary` (row 0 padding, row 1 unknown, both never recommended).
"""

from __future__ import annotations

import csv
import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data import DataFormatError, Vocabulary, base_name, check_id, csv_rows, open_text

SESSION_FORMATS = ("gru4rec", "diginetica", "csv")


@dataclass
class SessionData:
    """Events grouped by session: session i is items[offsets[i]:offsets[i+1]], in time order."""

    session_ids: list[str]
    items: np.ndarray  # int64 raw item ids (or model rows after `encode`)
    times: np.ndarray  # float64 seconds
    offsets: np.ndarray  # int64, len(session_ids) + 1
    path: str = ""
    notes: dict = field(default_factory=dict)  # how it was read, for the log (e.g. how a file was split)

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
        for line_no, row in enumerate(csv_rows(path, reader, header), start=2):
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
            name = check_id(path, line_no, row[si].strip(), "a session id", session_col)
            keys.append(sessions.setdefault(name, len(sessions)))
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
        header = [h.strip() for h in next(csv_rows(path, csv.reader(f, delimiter=delimiter)), [])]
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


TEST_TIME_SHARE = 0.1  # one file to split: the sessions starting in this last share of its time span are the test


def load_session_split(data: str | os.PathLike, valid: bool = False, fmt: str | None = None,
                       **csv_columns) -> tuple[SessionData, SessionData]:
    """(train, test) of `--data`: a session data set directory in GRU4Rec's layout, `*_train_full` / `*_test`, or
    with valid=True the tuning split `*_train_tr` / `*_train_valid` carved from the training data. One file is split
    by time (the sessions starting in the last TEST_TIME_SHARE of its time span are the test sessions, and the
    notes say so): a raw file given itself or alone in its directory (Diginetica sample, a CSV), or a
    `*_train_full` file without a `*_test` file beside it (what `nextstep events export --test-fraction 0`
    writes)."""
    data = Path(data)
    if data.is_file():
        return _split_one(data, "csv", valid, fmt, csv_columns, "one data file")
    files = sorted(p for p in data.iterdir() if p.is_file() and not p.name.startswith("."))
    if any(_stem(p).endswith("_train_full") for p in files):
        if not valid and not any(_stem(p).endswith("_test") for p in files):
            return _split_one(_find(data, "_train_full"), "gru4rec", valid, fmt, csv_columns,
                              "no *_test file beside it")
        names = ("_train_tr", "_train_valid") if valid else ("_train_full", "_test")
        train, test = (_find(data, n) for n in names)
        reader = _reader(fmt or "gru4rec", csv_columns)
        return reader(train), reader(test)
    if len(files) != 1:
        raise FileNotFoundError(f"{data}: expected *_train_full/*_test files or a single raw file, found "
                                f"{[p.name for p in files]}")
    return _split_one(files[0], "csv", valid, fmt, csv_columns, "one data file")


def _split_one(path: Path, default_fmt: str, valid: bool, fmt: str | None, csv_columns: dict,
               why: str) -> tuple[SessionData, SessionData]:
    """`load_session_split` of one file, split by time (twice with valid=True: its training part again)."""
    guess = "diginetica" if "item-views" in path.name else default_fmt
    train, test = split_by_time(_reader(fmt or guess, csv_columns)(path), TEST_TIME_SHARE)
    if valid:
        train, test = split_by_time(train, TEST_TIME_SHARE)
    share = f"{TEST_TIME_SHARE:.0%}"
    test.notes["split"] = train.notes["split"] = (f"{path.name}: {why}: the sessions starting in the last {share} "
                                                  f"of its time span are the {'validation' if valid else 'test'} "
                                                  "sessions")
    return train, test


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
