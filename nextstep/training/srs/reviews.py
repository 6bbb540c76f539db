"""Flashcard review logs: the in-memory form every SRS reader produces, and the readers.

Three sources, each read into a `ReviewLog` (users contiguous, each user's reviews in time order):

* the review-log CSV -- named columns ``user_id, card_id, review_time, rating`` (required) and
  ``deck_id, duration, state, day_offset, elapsed_days`` (optional); other columns are ignored.
  `write_review_csv` writes it. `read_review_csv`.
* a raw py-fsrs log  -- ``card_id, review_rating, review_time`` (ISO 8601 with a UTC offset)
  ``[, review_duration]`` (ms), one user. `read_py_fsrs_csv`.
* an Anki collection -- ``collection.anki2``, the SQLite file itself, or a ``.colpkg`` backup / ``.apkg`` package
  as Anki writes it (a zip archive; the collection inside is read, the archive is not unpacked beside it).
  `read_anki_collection`.

`read_reviews` picks the reader for a file or a data set directory. The CSVs may be gzipped (found by their
first bytes); another compression is refused, naming it.

Days. ``elapsed_days`` counts scheduler days, not 24-hour periods: a day starts at a fixed hour, and a
review's day is the number of such boundaries passed since the user's day 0 (``day_offset``). Each reader
records, per user, the unix time in ms at which day 0 starts (``meta["day_start_ms"]``) when one fixed
boundary describes the data; `ReviewLog.day_offsets` recomputes the day offsets from it. Where a source
gives no days, they are computed with the boundary at ``day_start_hour`` (4 am) in a zone
``utc_offset_hours`` from UTC (0), and day 0 is the day of the user's first review.

Every malformed row raises `DataFormatError` naming the file, the 1-based line and the column.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import os
import re
import shutil
import sqlite3
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..data import DataFormatError, base_name, check_id, csv_rows, open_text

STATE_UNKNOWN = -1  # state column absent (py-fsrs logs)
STATE_NEW, STATE_LEARNING, STATE_REVIEW, STATE_RELEARNING = 0, 1, 2, 3

REVIEW_CSV_REQUIRED = ("user_id", "card_id", "review_time", "rating")
REVIEW_CSV_OPTIONAL = ("deck_id", "duration", "state", "day_offset", "elapsed_days")
PY_FSRS_REQUIRED = ("card_id", "review_rating", "review_time")
DAY_MS = 86_400_000
MS_THRESHOLD = 1e11  # a review_time above this is in milliseconds (as seconds it would be after the year 5000)
DAY_SLACK = 1.5  # `check`: elapsed_days may differ from the time since the previous review by less than this
DAY_COLUMN_MODES = ("check", "trust", "ignore")
ANKI_REVIEW_TYPES = (0, 1, 2)  # learn, review, relearn; 3 filtered (cram), 4 manual, 5 rescheduled are skipped
SQLITE_MAGIC = b"SQLite format 3\x00"
ZIP_MAGIC = b"PK\x03\x04"
# the collection inside an Anki package (.colpkg, .apkg), newest format first: Anki 2.1.50+ writes
# collection.anki21b (zstd-compressed SQLite) and, beside it, a collection.anki2 stub that only asks for a newer
# Anki; 2.1.x before that wrote collection.anki21 (plain SQLite) next to such a stub; older ones collection.anki2
ANKI_PACKAGE_MEMBERS = ("collection.anki21b", "collection.anki21", "collection.anki2")
ANKI_PACKAGE_SUFFIXES = (".colpkg", ".apkg")


@dataclass
class ReviewLog:
    """Reviews of one or more users; users are contiguous, each user's reviews in time order.

    User u's reviews are rows offsets[u]:offsets[u+1]. Times are unix seconds (float64); durations
    seconds (float32, NaN when unknown); ratings 1..4 (Again, Hard, Good, Easy); state is the card's
    state before the review (0 new, 1 learning, 2 review, 3 relearning, -1 unknown); elapsed_days is
    the number of scheduler days since the card's previous review (-1 on its first review), as the
    srs-benchmark protocol defines it (day boundaries, not 24-hour periods).
    """

    user_ids: list[str]
    offsets: np.ndarray  # int64, len(user_ids) + 1
    card: np.ndarray  # int64 raw card ids
    deck: np.ndarray  # int64 raw deck ids (0 when the source has no decks)
    time: np.ndarray  # float64 unix seconds
    rating: np.ndarray  # int64 1..4
    duration: np.ndarray  # float32 seconds
    state: np.ndarray  # int64 0..3 or STATE_UNKNOWN
    elapsed_days: np.ndarray  # int64, -1 on a card's first review
    path: str = ""
    meta: dict = field(default_factory=dict)  # e.g. {"duration_cap_s": 500.0}

    def __len__(self) -> int:
        return len(self.card)

    @property
    def n_users(self) -> int:
        return len(self.user_ids)

    def user(self, u: int) -> ReviewLog:
        """User u's reviews alone."""
        lo, hi = int(self.offsets[u]), int(self.offsets[u + 1])
        return self.take(np.arange(lo, hi), [self.user_ids[u]], np.array([0, hi - lo], dtype=np.int64))

    def take(self, rows: np.ndarray, user_ids: list[str], offsets: np.ndarray) -> ReviewLog:
        return ReviewLog(user_ids, offsets, self.card[rows], self.deck[rows], self.time[rows], self.rating[rows],
                         self.duration[rows], self.state[rows], self.elapsed_days[rows], self.path, dict(self.meta))

    def duration_caps(self) -> np.ndarray:
        """Each review's answer-time cap in seconds (inf where none): ``meta["duration_cap_s_by_user"]`` (a log of
        several sources, `concat_users`) or the log's one ``meta["duration_cap_s"]``."""
        by_user = self.meta.get("duration_cap_s_by_user")
        if by_user is None:
            cap = self.meta.get("duration_cap_s")
            return np.full(len(self), np.inf if cap is None else float(cap))
        caps = [np.inf if by_user.get(u) is None else float(by_user[u]) for u in self.user_ids]
        return np.repeat(np.asarray(caps, dtype=np.float64), np.diff(self.offsets))

    def day_start_hours(self) -> dict[str, float]:
        """Each user's scheduler day boundary in hours after 00:00 UTC (``meta["day_start_ms"]`` modulo a day), for
        the users whose boundary the log knows."""
        return {u: int(ms) % DAY_MS / 3_600_000 for u, ms in (self.meta.get("day_start_ms") or {}).items()}

    def day_offsets(self) -> np.ndarray | None:
        """Each review's day (int64, day 0 = the user's day 0), from ``meta["day_start_ms"]``; None when
        some user's day boundary is unknown (e.g. a CSV whose day_offset column fits no fixed boundary)."""
        starts = self.meta.get("day_start_ms") or {}
        if any(u not in starts for u in self.user_ids):
            return None
        days = np.empty(len(self), dtype=np.int64)
        for u, name in enumerate(self.user_ids):
            lo, hi = int(self.offsets[u]), int(self.offsets[u + 1])
            days[lo:hi] = (_ms(self.time[lo:hi]) - int(starts[name])) // DAY_MS
        return days


# ----------------------------------------------------------------------------- shared helpers


def _ms(seconds: np.ndarray) -> np.ndarray:
    """Unix seconds -> integer milliseconds (the resolution every day computation uses)."""
    return np.round(np.asarray(seconds, dtype=np.float64) * 1000.0).astype(np.int64)


def _previous_of_card(user_row: np.ndarray, card: np.ndarray) -> np.ndarray:
    """For rows already in time order within each user: the row of the same user's previous review of the
    same card, -1 on the card's first review."""
    n = len(card)
    order = np.lexsort((np.arange(n), card, user_row))
    sorted_user, sorted_card = user_row[order], card[order]
    same = np.r_[False, (sorted_user[1:] == sorted_user[:-1]) & (sorted_card[1:] == sorted_card[:-1])]
    prev = np.full(n, -1, dtype=np.int64)
    prev[order[same]] = order[np.flatnonzero(same) - 1]
    return prev


def _elapsed(days: np.ndarray, prev: np.ndarray) -> np.ndarray:
    return np.where(prev >= 0, days - days[np.maximum(prev, 0)], -1).astype(np.int64)


def _days_from_time(time: np.ndarray, offsets: np.ndarray, user_ids: list[str], day_start_hour: float,
                    utc_offset_hours: float) -> tuple[np.ndarray, dict[str, int]]:
    """Day offsets with a boundary at day_start_hour local time (UTC + utc_offset_hours); each user's day 0
    is the day of their first review. Returns (days, {user: day 0 start in unix ms})."""
    shift = int(round((utc_offset_hours - day_start_hour) * 3_600_000))
    index = (_ms(time) + shift) // DAY_MS
    days = np.empty(len(time), dtype=np.int64)
    starts = {}
    for u, name in enumerate(user_ids):
        lo, hi = int(offsets[u]), int(offsets[u + 1])
        first = int(index[lo:hi].min()) if hi > lo else 0
        days[lo:hi] = index[lo:hi] - first
        starts[name] = first * DAY_MS - shift
    return days, starts


def _day_start_from_days(time: np.ndarray, days: np.ndarray) -> int | None:
    """A day 0 start S (unix ms) with (ms - S) // DAY_MS == days on every row, or None if none exists. Of the
    possible starts, the latest on a whole hour is chosen (else the latest)."""
    ms = _ms(time)
    lo = int(np.max(ms - DAY_MS * (days + 1))) + 1
    hi = int(np.min(ms - DAY_MS * days))
    if lo > hi:
        return None
    hour = hi // 3_600_000 * 3_600_000
    return hour if hour >= lo else hi


def _first_bad(path: Path, bad: np.ndarray, lines: np.ndarray, what, got) -> None:
    """Raise for the bad row that comes first in the file; what/got are functions of that row."""
    if bad.any():
        rows = np.flatnonzero(bad)
        row = int(rows[np.argmin(lines[rows])])
        raise DataFormatError(path, int(lines[row]), what(row), got(row))


def _grouped(user_key: np.ndarray, time: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row order, offsets): rows grouped by user key (0..U-1, the users' order) and sorted by time within
    each user; equal times keep file order."""
    order = np.lexsort((np.arange(len(time)), time, user_key))
    counts = np.bincount(user_key, minlength=int(user_key.max()) + 1 if len(user_key) else 0)
    return order, np.r_[0, np.cumsum(counts)].astype(np.int64)


# ----------------------------------------------------------------------------- the review-log CSV


def _cell_int(path: Path, line: int, text: str, column: str, what: str = "an integer") -> int:
    try:
        return int(text)
    except ValueError:
        raise DataFormatError(path, line, f"{what} (column {column!r})", text) from None


def _cell_float(path: Path, line: int, text: str, column: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not np.isfinite(value):
        raise DataFormatError(path, line, f"{what} (column {column!r})", text)
    return value


def _duration_ms(path: Path, line: int, text: str, column: str) -> float:
    if not text:
        return float("nan")
    value = _cell_float(path, line, text, column, "a duration in ms >= 0")
    if value < 0:
        raise DataFormatError(path, line, f"a duration in ms >= 0 (column {column!r})", text)
    return value


def _rating(path: Path, line: int, text: str, column: str) -> int:
    value = _cell_int(path, line, text, column, "rating in 1..4")
    if not 1 <= value <= 4:
        raise DataFormatError(path, line, f"rating in 1..4 (column {column!r})", text)
    return value


def _state(path: Path, line: int, text: str) -> int:
    value = _cell_int(path, line, text, "state", "state in 0..3")
    if not STATE_NEW <= value <= STATE_RELEARNING:
        raise DataFormatError(path, line, "state in 0..3 (column 'state')", text)
    return value


def _header(path: Path, reader, required: tuple[str, ...]) -> list[str]:
    header = next(csv_rows(path, reader), None)
    if header is None:
        raise DataFormatError(path, 1, f"a CSV header with columns {list(required)}", "an empty file")
    header = [h.strip() for h in header]
    if any(c not in header for c in required):
        raise DataFormatError(path, 1, f"a CSV header with columns {list(required)}", ",".join(header))
    return header


def _data_rows(path: Path, reader, header: list[str]):
    """Yield (line number, {column: stripped cell}) for non-blank rows."""
    for row in csv_rows(path, reader, header):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise DataFormatError(path, reader.line_num, f"{len(header)} comma-separated columns", len(row))
        yield reader.line_num, {name: cell.strip() for name, cell in zip(header, row, strict=True)}


def read_review_csv(path: str | os.PathLike, *, day_columns: str = "check", time_unit: str = "auto",
                    day_start_hour: float = 4, utc_offset_hours: float = 0,
                    duration_cap_s: float | None = None) -> ReviewLog:
    """Read the review-log CSV.

    Users are ordered by their first row in the file; each user's rows are sorted by time (stable: equal
    times keep file order). ``review_time`` is unix ms or seconds, decided once per file (``time_unit``
    "auto": from the first row, ms when above 1e11; every row must then agree) or forced with "ms" / "s".
    ``duration`` is in ms (empty or absent: NaN); a missing deck is 0, a missing (or empty) state
    `STATE_UNKNOWN`. Card and deck ids must be integers; the user id is any non-empty text of at most
    MAX_ID_CHARS characters.

    ``day_columns`` says what to do with the file's ``day_offset`` / ``elapsed_days``:

    * "check" (default) -- use them, and raise unless they are consistent: day offsets never decrease in
      time, elapsed_days equals the day offset difference, is -1 exactly on a card's first review, and lies
      within DAY_SLACK days of the real time since the card's previous review.
    * "trust" -- use them as given.
    * "ignore" -- recompute both from review_time (boundary at day_start_hour, utc_offset_hours from UTC).

    Without either column the days are computed as with "ignore"; with day_offset alone elapsed_days is its
    difference to the card's previous review. ``duration_cap_s`` (when given) goes to ``meta``.
    """
    path = Path(path)
    if day_columns not in DAY_COLUMN_MODES:
        raise ValueError(f"day_columns must be one of {DAY_COLUMN_MODES}, got {day_columns!r}")
    if time_unit not in ("auto", "ms", "s"):
        raise ValueError(f"time_unit must be 'auto', 'ms' or 's', got {time_unit!r}")
    users: dict[str, int] = {}
    cols: dict[str, list] = {k: [] for k in ("user", "card", "deck", "time", "rating", "state", "duration",
                                              "day", "elapsed", "line")}
    ms_unit, unit_line = (None if time_unit == "auto" else time_unit == "ms"), 0
    with open_text(path) as f:
        reader = csv.reader(f)
        header = _header(path, reader, REVIEW_CSV_REQUIRED)
        has = {c: c in header for c in REVIEW_CSV_OPTIONAL}
        for line, cells in _data_rows(path, reader, header):
            check_id(path, line, cells["user_id"], "a user id", "user_id")
            t = _cell_float(path, line, cells["review_time"], "review_time", "a finite unix time")
            if ms_unit is None:
                ms_unit, unit_line = t > MS_THRESHOLD, line
            elif time_unit == "auto" and (t > MS_THRESHOLD) != ms_unit:
                unit = "milliseconds" if ms_unit else "seconds"
                raise DataFormatError(path, line, f"a unix time in {unit} like line {unit_line}'s "
                                                  "(column 'review_time')", cells["review_time"])
            state = cells["state"] if has["state"] else ""
            cols["user"].append(users.setdefault(cells["user_id"], len(users)))
            cols["card"].append(_cell_int(path, line, cells["card_id"], "card_id", "an integer card id"))
            cols["deck"].append(_cell_int(path, line, cells["deck_id"], "deck_id", "an integer deck id")
                                if has["deck_id"] and cells["deck_id"] else 0)
            cols["time"].append(t)
            cols["rating"].append(_rating(path, line, cells["rating"], "rating"))
            cols["state"].append(_state(path, line, state) if state else STATE_UNKNOWN)
            cols["duration"].append(_duration_ms(path, line, cells["duration"], "duration") if has["duration"]
                                    else float("nan"))
            if has["day_offset"]:
                cols["day"].append(_cell_int(path, line, cells["day_offset"], "day_offset", "an integer day offset"))
            if has["elapsed_days"]:
                e = _cell_int(path, line, cells["elapsed_days"], "elapsed_days", "an integer >= -1")
                if e < -1:
                    raise DataFormatError(path, line, "an integer >= -1 (column 'elapsed_days')", cells["elapsed_days"])
                cols["elapsed"].append(e)
            cols["line"].append(line)
    if not cols["line"]:
        raise DataFormatError(path, 2, "at least one review", "an empty file")

    user_key = np.asarray(cols["user"], dtype=np.int64)
    time = np.asarray(cols["time"], dtype=np.float64) / (1000.0 if ms_unit else 1.0)
    order, offsets = _grouped(user_key, time)
    user_ids = list(users)
    user_row, time = user_key[order], time[order]
    card = np.asarray(cols["card"], dtype=np.int64)[order]
    lines = np.asarray(cols["line"], dtype=np.int64)[order]
    prev = _previous_of_card(user_row, card)
    file_days = np.asarray(cols["day"], dtype=np.int64)[order] if has["day_offset"] else None
    file_elapsed = np.asarray(cols["elapsed"], dtype=np.int64)[order] if has["elapsed_days"] else None
    meta: dict = {"format": "review_csv", "time_unit": "ms" if ms_unit else "s"}
    if duration_cap_s is not None:
        meta["duration_cap_s"] = float(duration_cap_s)

    if day_columns == "ignore" or (file_days is None and file_elapsed is None):
        days, meta["day_start_ms"] = _days_from_time(time, offsets, user_ids, day_start_hour, utc_offset_hours)
        elapsed = _elapsed(days, prev)
    else:
        elapsed = file_elapsed
        if file_days is not None:
            if day_columns == "check":
                earlier = np.r_[False, (file_days[1:] < file_days[:-1]) & (user_row[1:] == user_row[:-1])]
                _first_bad(path, earlier, lines, lambda r: "a day_offset no smaller than the user's previous "
                           f"review's, {file_days[r - 1]} (column 'day_offset')", lambda r: int(file_days[r]))
            from_days = _elapsed(file_days, prev)
            if elapsed is None:
                elapsed = from_days
            elif day_columns == "check":
                _first_bad(path, elapsed != from_days, lines,
                           lambda r: f"elapsed_days equal to the day_offset difference, {from_days[r]} "
                                     "(column 'elapsed_days')", lambda r: int(elapsed[r]))
            starts = {}
            for u, name in enumerate(user_ids):
                lo, hi = int(offsets[u]), int(offsets[u + 1])
                start = _day_start_from_days(time[lo:hi], file_days[lo:hi])
                if start is not None:
                    starts[name] = start
            meta["day_start_ms"] = starts
        if day_columns == "check":
            _check_elapsed(path, elapsed, prev, time, lines)

    duration = (np.asarray(cols["duration"], dtype=np.float64)[order] / 1000.0).astype(np.float32)
    return ReviewLog(user_ids, offsets, card, np.asarray(cols["deck"], dtype=np.int64)[order], time,
                     np.asarray(cols["rating"], dtype=np.int64)[order], duration,
                     np.asarray(cols["state"], dtype=np.int64)[order], elapsed.astype(np.int64), str(path), meta)


def _check_elapsed(path: Path, elapsed: np.ndarray, prev: np.ndarray, time: np.ndarray, lines: np.ndarray) -> None:
    first = prev < 0
    _first_bad(path, first & (elapsed != -1), lines,
               lambda r: "elapsed_days -1 on the card's first review (column 'elapsed_days')",
               lambda r: int(elapsed[r]))
    _first_bad(path, ~first & (elapsed < 0), lines,
               lambda r: "elapsed_days >= 0 after the card's first review (column 'elapsed_days')",
               lambda r: int(elapsed[r]))
    gap = np.where(first, 0.0, time - time[np.maximum(prev, 0)]) / 86400.0
    _first_bad(path, ~first & (np.abs(elapsed - gap) >= DAY_SLACK), lines,
               lambda r: f"elapsed_days within {DAY_SLACK} of the {gap[r]:.2f} days since the card's previous "
                         "review (column 'elapsed_days'; day_columns='ignore' recomputes the days from "
                         "review_time)", lambda r: int(elapsed[r]))


def _duration_text(seconds: float) -> str:
    """Milliseconds as written: an integer when that reads back to the same float32, else exact digits."""
    if np.isnan(seconds):
        return ""
    ms = float(seconds) * 1000.0
    whole = round(ms)
    return str(whole) if np.float32(whole / 1000.0) == np.float32(seconds) else repr(ms)


def write_review_csv(log: ReviewLog, path: str | os.PathLike) -> Path:
    """Write the review-log CSV: user_id, card_id, deck_id, review_time (unix ms), day_offset (only when every
    user's day boundary is known), rating, state (empty when unknown), duration (ms, empty when unknown),
    elapsed_days. `read_review_csv` reads it back to the same log (times to the millisecond)."""
    path = Path(path)
    days = log.day_offsets()
    times = _ms(log.time)
    columns = ["user_id", "card_id", "deck_id", "review_time", *(["day_offset"] if days is not None else []),
               "rating", "state", "duration", "elapsed_days"]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(columns)
        for u, name in enumerate(log.user_ids):
            for i in range(int(log.offsets[u]), int(log.offsets[u + 1])):
                state = int(log.state[i])
                writer.writerow([name, int(log.card[i]), int(log.deck[i]), int(times[i]),
                                 *([int(days[i])] if days is not None else []), int(log.rating[i]),
                                 "" if state == STATE_UNKNOWN else state, _duration_text(log.duration[i]),
                                 int(log.elapsed_days[i])])
    return path


# ----------------------------------------------------------------------------- py-fsrs


def _iso_seconds(path: Path, line: int, text: str) -> float:
    try:
        stamp = dt.datetime.fromisoformat(text)
    except ValueError:
        stamp = None
    if stamp is None or stamp.tzinfo is None:
        raise DataFormatError(path, line, "an ISO 8601 time with a UTC offset (column 'review_time')", text)
    return stamp.timestamp()


def read_py_fsrs_csv(path: str | os.PathLike, user_id: str = "0", *, day_start_hour: float = 4,
                     utc_offset_hours: float = 0) -> ReviewLog:
    """Read a raw py-fsrs review log (``card_id, review_rating, review_time[, review_duration]``) as one user.

    Rows are sorted by time (stable); states are unknown, the deck is 0, durations are ms (empty or
    "None": NaN), and the days are computed with the boundary at day_start_hour (UTC + utc_offset_hours).
    """
    path = Path(path)
    card, time, rating, duration, lines = [], [], [], [], []
    with open_text(path) as f:
        reader = csv.reader(f)
        header = _header(path, reader, PY_FSRS_REQUIRED)
        has_duration = "review_duration" in header
        for line, cells in _data_rows(path, reader, header):
            card.append(_cell_int(path, line, cells["card_id"], "card_id", "an integer card id"))
            rating.append(_rating(path, line, cells["review_rating"], "review_rating"))
            time.append(_iso_seconds(path, line, cells["review_time"]))
            text = cells["review_duration"] if has_duration else ""
            duration.append(_duration_ms(path, line, "" if text == "None" else text, "review_duration"))
            lines.append(line)
    if not lines:
        raise DataFormatError(path, 2, "at least one review", "an empty file")
    n = len(lines)
    order, offsets = _grouped(np.zeros(n, dtype=np.int64), np.asarray(time, dtype=np.float64))
    times, cards = np.asarray(time, dtype=np.float64)[order], np.asarray(card, dtype=np.int64)[order]
    days, starts = _days_from_time(times, offsets, [user_id], day_start_hour, utc_offset_hours)
    elapsed = _elapsed(days, _previous_of_card(np.zeros(n, dtype=np.int64), cards))
    return ReviewLog([user_id], offsets, cards, np.zeros(n, dtype=np.int64), times,
                     np.asarray(rating, dtype=np.int64)[order],
                     (np.asarray(duration, dtype=np.float64)[order] / 1000.0).astype(np.float32),
                     np.full(n, STATE_UNKNOWN, dtype=np.int64), elapsed, str(path),
                     {"format": "py_fsrs", "day_start_ms": starts})


# ----------------------------------------------------------------------------- Anki


def _anki_config(con: sqlite3.Connection, tables: set[str]) -> tuple[int, dict, float | None]:
    """(crt, collection config, answer-time cap in seconds or None). The config is col.conf (JSON) merged
    with the key/value `config` table of newer collections; the cap is the largest maxTaken in col.dconf."""
    crt, conf_text, dconf_text = con.execute("SELECT crt, conf, dconf FROM col").fetchone()
    try:
        config = dict(json.loads(conf_text or "{}"))
    except (ValueError, TypeError):
        config = {}
    if "config" in tables:
        for key, val in con.execute("SELECT key, val FROM config"):
            try:
                config[key] = json.loads(val)
            except ValueError:
                continue
    caps = []
    try:
        caps = [float(c["maxTaken"]) for c in json.loads(dconf_text or "{}").values() if "maxTaken" in c]
    except (ValueError, TypeError, AttributeError):
        caps = []
    if "deck_config" in tables:  # schema 14+: one row per deck option group, col.dconf left empty
        caps += [cap for (blob,) in con.execute("SELECT config FROM deck_config")
                 if (cap := _deck_config_cap(blob)) is not None]
    return int(crt), config, max(caps) if caps else None


CAP_ANSWER_TIME_FIELD = 24  # DeckConfig.Config.cap_answer_time_to_secs in Anki's deck_config.proto


def _deck_config_cap(blob) -> float | None:
    """The answer-time cap (seconds) of one deck_config row: JSON with maxTaken (schema 14, 15) or Anki's
    DeckConfig.Config protobuf message (schema 16+), whose field 24 is the cap; None when it says none."""
    if isinstance(blob, str):
        blob = blob.encode()
    if not isinstance(blob, bytes) or not blob:
        return None
    if blob[:1] == b"{":
        try:
            cap = json.loads(blob).get("maxTaken")
            return float(cap) if cap is not None else None
        except (ValueError, TypeError, AttributeError):
            return None
    found, i = None, 0
    try:
        while i < len(blob):
            key, i = _varint(blob, i)
            number, wire = key >> 3, key & 7
            if wire == 0:
                value, i = _varint(blob, i)
                if number == CAP_ANSWER_TIME_FIELD:
                    found = value
            elif wire == 1:
                i += 8
            elif wire == 2:
                length, i = _varint(blob, i)
                i += length
            elif wire == 5:
                i += 4
            else:
                return None
    except IndexError:
        return None
    return float(found) if found else None


def _varint(blob: bytes, i: int) -> tuple[int, int]:
    """A protobuf varint at blob[i:]: (value, the index after it)."""
    value = shift = 0
    while True:
        byte = blob[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def _anki_day_start_ms(crt: int, config: dict, sched_ver: int) -> int:
    """Unix ms at which the collection's day 0 starts.

    v1: days are whole 86400 s periods from crt (Anki set crt to the creation day's 4 am). v2: the same,
    moved to the rollover hour (config "rollover", default 4). Collections that store their UTC offsets
    (config "creationOffset" / "localOffset", minutes west of UTC): day n starts at the rollover hour of the
    n-th local date after the creation date, with the current offset held fixed (daylight saving changes
    are not replayed).
    """
    rollover = int(config.get("rollover", 4)) if sched_ver >= 2 else 4
    if "creationOffset" in config:
        creation_west = int(config["creationOffset"])
        local_west = int(config.get("localOffset", creation_west))
        creation_day = (crt - creation_west * 60 - rollover * 3600) // 86400
        return (creation_day * 86400 + local_west * 60 + rollover * 3600) * 1000
    return (crt + (rollover - 4) * 3600) * 1000


def _sched_ver(config: dict) -> int:
    if config.get("sched2021"):
        return 3
    return int(config.get("schedVer", 1))


def _zstd_decompress(src, out, path: Path, member: str) -> None:
    """Copy the zstd stream src into the file out (Anki's collection.anki21b)."""
    try:
        import zstandard
    except ImportError:
        raise DataFormatError(path, 1, f"a Python zstd module to read {member} (zstd-compressed)", "none installed",
                              "pip install zstandard (part of nextstep's train extra)") from None
    stream = zstandard.ZstdDecompressor().decompressobj()
    try:
        while chunk := src.read(1 << 20):
            out.write(stream.decompress(chunk))
    except zstandard.ZstdError as exc:
        raise DataFormatError(path, 1, f"{member} compressed with zstd", str(exc), "the backup is damaged") from None
    if not stream.eof:
        raise DataFormatError(path, 1, f"{member} compressed with zstd", "a frame cut short", "the backup is damaged")


def unpack_anki_package(path: str | os.PathLike, out: str | os.PathLike) -> str:
    """Write the collection (SQLite) of an Anki package -- a ``.colpkg`` backup or an ``.apkg`` -- to `out`; return
    the archive member it came from.

    The member is the newest format the archive holds (ANKI_PACKAGE_MEMBERS): ``collection.anki21b`` is
    zstd-compressed, the others are SQLite as they are; an older name beside a newer one is a stub Anki writes for
    old versions, and is not read."""
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as exc:
        raise DataFormatError(path, 1, "an Anki package (a zip archive)", str(exc)) from None
    with archive:
        names = set(archive.namelist())
        member = next((m for m in ANKI_PACKAGE_MEMBERS if m in names), None)
        if member is None:
            raise DataFormatError(path, 1, f"an Anki package holding one of {list(ANKI_PACKAGE_MEMBERS)}",
                                  sorted(names)[:20])
        try:
            with archive.open(member) as src, open(out, "wb") as dst:
                if member.endswith("b"):
                    _zstd_decompress(src, dst, path, member)
                else:
                    shutil.copyfileobj(src, dst)
        except (zipfile.BadZipFile, zlib.error, EOFError) as exc:
            raise DataFormatError(path, 1, f"a readable {member} in the archive", str(exc)) from None
    with open(out, "rb") as f:
        magic = f.read(len(SQLITE_MAGIC))
    if magic != SQLITE_MAGIC:
        raise DataFormatError(path, 1, f"an Anki collection (SQLite) in {member}", magic)
    return member


def read_anki_collection(path: str | os.PathLike, user_id: str = "0") -> ReviewLog:
    """Read the review history of an Anki collection: the ``collection.anki2`` SQLite file (read-only), or a
    ``.colpkg`` backup / ``.apkg`` package (a zip archive; `unpack_anki_package` picks the collection inside,
    ``meta["package_member"]`` names it).

    Rows of ``revlog`` in id (= review time, ms) order. Kept: types 0 learn, 1 review, 2 relearn with ease
    1..4; skipped: type 3 (filtered-deck / cram reviews), 4 (manual rescheduling), 5 (rescheduled) and
    ease 0, counted by reason in ``meta["skipped"]``; the file is read through a temporary copy, so nothing is
    written beside it (SQLite would add -wal and -shm files to a WAL-mode collection). Reviews of deleted cards
    (no row in ``cards``) are kept with deck 0. Rating = ease, except on
    learning and relearning rows of the old v1 scheduler, whose three buttons were Again / Good / Easy
    (ease 1, 2, 3 -> rating 1, 3, 4). State: type 0 on the card's first kept review is new (0), later type 0
    rows learning (1); type 1 review (2), type 2 relearning (3). Duration ms -> s; the deck options' answer
    time cap (``maxTaken`` in col.dconf, or the deck_config table of newer collections; the largest of them)
    is ``meta["duration_cap_s"]``. Card and deck ids are Anki's. Days: see `_anki_day_start_ms`; elapsed_days
    counts only kept rows.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Anki collection not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(len(SQLITE_MAGIC))
    if magic != SQLITE_MAGIC and magic[:4] != ZIP_MAGIC:
        raise DataFormatError(path, 1, "an Anki collection (a SQLite database file, or a .colpkg / .apkg zip "
                                       "archive)", magic)
    member = None
    # SQLite opens a WAL-mode database, even read-only, by creating -wal and -shm files beside it: read a copy
    # (with the -wal file, if Anki left one, so that its last reviews are there), and the user's folder stays as it is
    with tempfile.TemporaryDirectory(prefix="nextstep-anki-") as tmp:
        copy = Path(tmp) / "collection.anki2"
        if magic[:4] == ZIP_MAGIC:
            member = unpack_anki_package(path, copy)
        else:
            shutil.copyfile(path, copy)
            if Path(f"{path}-wal").is_file():
                shutil.copyfile(f"{path}-wal", f"{copy}-wal")
        con = sqlite3.connect(f"{copy.as_uri()}?mode=ro", uri=True)
        try:
            tables = {name for (name,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
            for table in ("revlog", "col", "cards"):
                if table not in tables:
                    raise DataFormatError(path, 1, f"an Anki collection with a {table!r} table", sorted(tables))
            crt, config, cap = _anki_config(con, tables)
            rows = con.execute("SELECT r.id, r.cid, r.ease, r.type, r.time, COALESCE(c.did, 0) FROM revlog AS r "
                               "LEFT JOIN cards AS c ON c.id = r.cid ORDER BY r.id").fetchall()
        except sqlite3.DatabaseError as exc:
            raise DataFormatError(path, 1, "a readable Anki collection", str(exc)) from None
        finally:
            con.close()
    table = np.asarray(rows, dtype=np.int64).reshape(-1, 6)
    rid, cid, ease, kind, msec, did = table.T
    position = np.arange(1, len(rid) + 1)  # the "line": the row's place in revlog id order

    def where(column: str):
        return lambda r: f"{column} (revlog row id {rid[r]})"

    keep = np.isin(kind, ANKI_REVIEW_TYPES) & (ease != 0)
    skipped = {reason: int(n) for reason, n in (
        ("filtered deck (type 3)", np.sum(kind == 3)), ("manual reschedule (type 4)", np.sum(kind == 4)),
        ("rescheduled (type 5)", np.sum(kind == 5)), ("other type", np.sum((kind < 0) | (kind > 5))),
        ("no answer (ease 0)", np.sum(np.isin(kind, ANKI_REVIEW_TYPES) & (ease == 0)))) if n}
    _first_bad(path, keep & ((ease < 0) | (ease > 4)), position, where("ease in 1..4"), lambda r: int(ease[r]))
    _first_bad(path, keep & (msec < 0), position, where("a time in ms >= 0"), lambda r: int(msec[r]))
    sched_ver = _sched_ver(config)
    three_buttons = keep & (sched_ver == 1) & (kind != 1)
    _first_bad(path, three_buttons & (ease == 4), position,
               where("ease in 1..3 on a v1 scheduler learning row"), lambda r: int(ease[r]))
    rating = np.where(three_buttons & (ease >= 2), ease + 1, ease)
    rid, cid, rating, kind, msec, did = (a[keep] for a in (rid, cid, rating, kind, msec, did))
    if not len(rid):
        raise DataFormatError(path, 1, "at least one review in the revlog table", "none")

    n = len(rid)
    prev = _previous_of_card(np.zeros(n, dtype=np.int64), cid)
    state = np.where((kind == 0) & (prev < 0), STATE_NEW, kind + 1).astype(np.int64)
    start = _anki_day_start_ms(crt, config, sched_ver)
    days = (rid - start) // DAY_MS
    meta = {"format": "anki", "sched_ver": sched_ver, "day_start_ms": {user_id: start}, "skipped": skipped}
    if member is not None:
        meta["package_member"] = member
    if cap is not None:
        meta["duration_cap_s"] = cap
    return ReviewLog([user_id], np.array([0, n], dtype=np.int64), cid, did, rid / 1000.0, rating.astype(np.int64),
                     (msec / 1000.0).astype(np.float32), state, _elapsed(days, prev), str(path), meta)


# ----------------------------------------------------------------------------- dispatch


def _csv_header(path: Path) -> list[str]:
    with open_text(path) as f:
        return [h.strip() for h in next(csv_rows(path, csv.reader(f)), [])]


REVIEW_FILE_NAMES = ("revlogs.csv", "revlogs.csv.gz")
ANKI_BACKUP_NAME = re.compile(r"backup-\d{4}-\d{2}-\d{2}-\d{2}\.\d{2}\.\d{2}\.colpkg")  # as Anki names them


def _visible_files(data_dir: Path) -> list[Path]:
    return sorted(p for p in data_dir.iterdir() if p.is_file() and not p.name.startswith("."))


def _pick_review_file(data_dir: Path) -> Path:
    """A user's folder's review data: its revlogs.csv, else its one *.anki2 collection, else its *.colpkg backup
    (of several, Anki's latest backup, which holds every review of the earlier ones), else its one py-fsrs CSV; a
    folder `nextstep events export` wrote: its train file (<model>_train.csv.gz, a review-log CSV of many users)."""
    for name in REVIEW_FILE_NAMES:
        if (data_dir / name).is_file():
            return data_dir / name
    files = _visible_files(data_dir)
    exported = [p for p in files if base_name(p).lower().endswith("_train.csv")
                and set(REVIEW_CSV_REQUIRED) <= set(_csv_header(p))]
    if len(exported) == 1:
        return exported[0]
    collections = [p for p in files if p.suffix.lower() == ".anki2"]
    if len(collections) == 1:
        return collections[0]
    backups = [p for p in files if p.suffix.lower() == ".colpkg"]
    if not collections and len(backups) == 1:
        return backups[0]
    if not collections and backups and all(ANKI_BACKUP_NAME.fullmatch(p.name) for p in backups):
        return backups[-1]  # backup-YYYY-MM-DD-HH.MM.SS: the names sort in time order
    fsrs = [p for p in files if base_name(p).lower().endswith(".csv") and set(PY_FSRS_REQUIRED) <= set(_csv_header(p))]
    if not collections and not backups and len(fsrs) == 1:
        return fsrs[0]
    raise FileNotFoundError(f"{data_dir}: expected revlogs.csv, one *.anki2 collection, a *.colpkg backup or one "
                            f"py-fsrs CSV; found {[p.name for p in files] or 'nothing'}")


def read_reviews(path: str | os.PathLike, *, user_id: str = "0", day_columns: str = "check",
                 day_start_hour: float = 4, utc_offset_hours: float = 0,
                 duration_cap_s: float | None = None) -> ReviewLog:
    """Read reviews from a file or a data set directory, choosing the reader.

    A directory: its ``revlogs.csv`` (or ``revlogs.csv.gz``) if present, else its one ``*.anki2`` collection,
    else its ``*.colpkg`` backup (the latest of Anki's backups, if several), else its one CSV in the py-fsrs
    format. A file: a SQLite file, ``*.anki2``, ``*.colpkg`` or ``*.apkg`` is an Anki collection; a CSV (plain or
    gzipped) is the review-log CSV or a py-fsrs log as its header says. A folder of many users' folders:
    `read_review_data`. user_id names the user of single-user
    sources (Anki, py-fsrs); day_columns and duration_cap_s (the app's answer-time cap, when the CSV cannot
    say) apply to the review-log CSV, day_start_hour and utc_offset_hours wherever days are computed.
    """
    path = Path(path)
    if path.is_dir():
        path = _pick_review_file(path)
    if not path.is_file():
        raise FileNotFoundError(f"review data not found: {path}")
    with open(path, "rb") as f:
        magic = f.read(len(SQLITE_MAGIC))
    if magic == SQLITE_MAGIC or path.suffix.lower() in (".anki2", *ANKI_PACKAGE_SUFFIXES):
        return read_anki_collection(path, user_id=user_id)
    header = _csv_header(path)
    if set(REVIEW_CSV_REQUIRED) <= set(header):
        return read_review_csv(path, day_columns=day_columns, day_start_hour=day_start_hour,
                               utc_offset_hours=utc_offset_hours, duration_cap_s=duration_cap_s)
    if set(PY_FSRS_REQUIRED) <= set(header):
        return read_py_fsrs_csv(path, user_id=user_id, day_start_hour=day_start_hour,
                                utc_offset_hours=utc_offset_hours)
    raise DataFormatError(path, 1, f"a review-log CSV header (columns {list(REVIEW_CSV_REQUIRED)}) or a py-fsrs "
                                   f"one (columns {list(PY_FSRS_REQUIRED)}), or an Anki collection",
                          ",".join(header))


def _holds_review_data(folder: Path) -> bool:
    """Whether a folder holds review data files of its own (then it is one user's folder, not a folder of them)."""
    return any(p.name.lower() in REVIEW_FILE_NAMES or p.suffix.lower() in (".anki2", ".colpkg")
               or base_name(p).lower().endswith(".csv") for p in _visible_files(folder))


READ_ERRORS = (DataFormatError, FileNotFoundError, OSError, ValueError)  # a user's data refused: skip the user


def read_users(path: str | os.PathLike, *, day_columns: str = "check", day_start_hour: float = 4,
               utc_offset_hours: float = 0, duration_cap_s: float | None = None,
               log_line=None, skipped: dict[str, str] | None = None) -> list[tuple[str, ReviewLog]]:
    """Every user's reviews under `path`, as (user name, that user's review log), in path order.

    A file, or a folder that holds review data itself (a user's folder), is read as `read_reviews` reads it, and a
    read error ends the call: that is `--data` on one user. Otherwise every folder below `path`, at any depth, that
    holds review data is one user's folder, read by `read_reviews` (its subfolders are not searched: an Anki
    profile's backups are not another user), and named by its path relative to `path`; one whose data are refused
    is skipped, with a line through `log_line` (default: standard error) saying why (and, with a `skipped` dict, the
    reason under its name there). A review-log CSV of several
    users gives each of them, named FOLDER:USER_ID. Hidden files and folders are passed over. No user found is a
    FileNotFoundError.
    """
    root = Path(path)
    options = {"day_columns": day_columns, "day_start_hour": day_start_hour, "utc_offset_hours": utc_offset_hours,
               "duration_cap_s": duration_cap_s}
    if root.is_file() or (root.is_dir() and _holds_review_data(root)):
        return _split_users(root.resolve().name if root.is_dir() else base_name(root), read_reviews(root, **options))
    if not root.is_dir():
        raise FileNotFoundError(f"review data not found: {root}")
    if log_line is None:
        def log_line(text: str) -> None:
            print(text, file=sys.stderr, flush=True)
    found: list[tuple[str, ReviewLog]] = []
    seen: set[Path] = set()

    def visit(folder: Path) -> None:
        real = folder.resolve()
        if real in seen:  # a link back up the tree
            return
        seen.add(real)
        if folder != root and _holds_review_data(folder):
            name = folder.relative_to(root).as_posix()
            try:
                found.extend(_split_users(name, _read_user_folder(folder, name, options, log_line)))
            except READ_ERRORS as exc:
                log_line(f"skipped {name}: {exc}")
                if skipped is not None:
                    skipped[name] = str(exc)
            return
        for sub in sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith(".")):
            visit(sub)

    visit(root)
    if not found:
        raise FileNotFoundError(f"{root}: no user's review data in it or in any folder below it (a folder holding "
                                "revlogs.csv, an *.anki2 collection, a *.colpkg backup or a py-fsrs CSV)")
    return found


def _read_user_folder(folder: Path, name: str, options: dict, log_line) -> ReviewLog:
    """`read_reviews(folder)`; when the file it picks is refused, the folder's other sources of the same reviews
    (its one *.anki2, its latest *.colpkg, its one py-fsrs CSV), the first that reads, with a line saying so;
    else the first refusal."""
    try:
        return read_reviews(folder, **options)
    except READ_ERRORS as first:
        files = _visible_files(folder)
        picked = next((folder / n for n in REVIEW_FILE_NAMES if (folder / n).is_file()), None)
        others = [[p for p in files if p.suffix.lower() == ".anki2"],
                  [p for p in files if p.suffix.lower() == ".colpkg"][-1:],
                  [p for p in files if base_name(p).lower().endswith(".csv") and p.name not in REVIEW_FILE_NAMES
                   and set(PY_FSRS_REQUIRED) <= set(_csv_header(p))]]
        for candidates in others:
            if len(candidates) != 1 or candidates[0] == picked:
                continue
            try:
                log = read_reviews(candidates[0], **options)
            except READ_ERRORS:
                continue
            log_line(f"{name}: {first}; read {candidates[0].name} instead")
            return log
        raise


def _split_users(name: str, log: ReviewLog) -> list[tuple[str, ReviewLog]]:
    """(name, that user's log, named `name`) per user: FOLDER:USER_ID where the log holds several users."""
    names = [name] if log.n_users == 1 else [f"{name}:{uid}" for uid in log.user_ids]
    out = []
    for u, new in enumerate(names):
        one = log if log.n_users == 1 else log.user(u)
        meta = dict(one.meta)
        if one.user_ids[0] in (meta.get("day_start_ms") or {}):
            meta["day_start_ms"] = {new: meta["day_start_ms"][one.user_ids[0]]}
        out.append((new, ReviewLog([new], one.offsets, one.card, one.deck, one.time, one.rating, one.duration,
                                   one.state, one.elapsed_days, one.path, meta)))
    return out


def concat_users(users: list[tuple[str, ReviewLog]], path: str = "") -> ReviewLog:
    """One review log of several users' logs (each of one user), the users named as given, in that order. Each
    user's answer-time cap is kept in ``meta["duration_cap_s_by_user"]`` (see `ReviewLog.duration_caps`), their
    day boundaries in ``meta["day_start_ms"]``, their source files in ``meta["files"]``."""
    names = [name for name, _ in users]
    if len(set(names)) != len(names):
        raise ValueError(f"user names repeat: {sorted(n for n in set(names) if names.count(n) > 1)}")
    if any(log.n_users != 1 for _, log in users):
        raise ValueError("concat_users takes one user per log (read_users splits logs of several users)")
    logs = [log for _, log in users]
    starts, caps = {}, {}
    for name, log in users:  # (a log's one user may go by another name in it: "0", say)
        start = (log.meta.get("day_start_ms") or {}).get(log.user_ids[0])
        if start is not None:
            starts[name] = start
        caps[name] = log.meta.get("duration_cap_s")
    meta = {"format": "users", "formats": {n: log.meta.get("format") for n, log in users}, "day_start_ms": starts,
            "duration_cap_s_by_user": caps, "files": list(dict.fromkeys(log.path for log in logs if log.path))}
    offsets = np.r_[0, np.cumsum([len(log) for log in logs])].astype(np.int64)

    def joined(attr: str) -> np.ndarray:
        return np.concatenate([getattr(log, attr) for log in logs])

    return ReviewLog(names, offsets, joined("card"), joined("deck"), joined("time"), joined("rating"),
                     joined("duration"), joined("state"), joined("elapsed_days"), path, meta)


def read_review_data(path: str | os.PathLike, *, day_columns: str = "check", day_start_hour: float = 4,
                     utc_offset_hours: float = 0, duration_cap_s: float | None = None, log_line=None,
                     skipped: dict[str, str] | None = None) -> ReviewLog:
    """`--data` of the flashcard commands: a file or one user's folder exactly as `read_reviews` reads it; a folder
    of many users' folders (`read_users`) as one log of all of them (`concat_users`), users that cannot be read
    skipped with a line saying why (and recorded in `skipped`, name -> why, where given)."""
    root = Path(path)
    options = {"day_columns": day_columns, "day_start_hour": day_start_hour, "utc_offset_hours": utc_offset_hours,
               "duration_cap_s": duration_cap_s}
    if root.is_file() or not root.is_dir() or _holds_review_data(root):
        return read_reviews(root, **options)
    users = read_users(root, log_line=log_line, skipped=skipped, **options)
    return concat_users(users, str(root))


def write_simulated_reviews(directory: str | os.PathLike, **kwargs) -> Path:
    """Generate a review log (``**kwargs`` as for `simulate_reviews`) and write it as ``reviews.csv`` in
    `directory`; returns the file (what the flashcard run reads)."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    return write_review_csv(simulate_reviews(**kwargs), Path(directory) / "reviews.csv")


def simulate_reviews(n_users: int = 2, n_cards: int = 40, n_decks: int = 3, n_days: int = 60,
                     reviews_per_day: int = 20, seed: int = 0) -> ReviewLog:
    """A small generated review log with a real forgetting signal, for tests and demos.

    Each card has a stability S (days) and a difficulty; recall after t days is 0.9 ** (t / S); a recall
    multiplies S by a factor that falls with difficulty, a lapse halves it; a card is due again after
    0.7 to 1.6 times S days. Each day a user reviews the
    cards that are due (new cards fill the rest of the day's budget), sometimes twice in a day. The
    rating is Again on a lapse, else Hard/Good/Easy by how far recall was from 1; the answer time grows
    with difficulty and lapses. Days start at 04:00 UTC, as the readers assume by default.
    """
    rng = np.random.default_rng(seed)
    t0 = 1_700_000_000 - (1_700_000_000 % 86400) + 4 * 3600
    rows: list[tuple] = []
    offsets = [0]
    for _ in range(n_users):
        stability = np.full(n_cards, 1.0)
        difficulty = rng.uniform(0, 1, n_cards)
        deck = rng.integers(1, n_decks + 1, n_cards)
        due = np.full(n_cards, np.inf)
        last = np.full(n_cards, np.nan)
        last_day = np.full(n_cards, -1)
        last_rating = np.zeros(n_cards, dtype=np.int64)
        introduced = 0
        for day in range(n_days):
            todo = list(np.flatnonzero(due <= day))
            while introduced < n_cards and len(todo) < reviews_per_day:
                todo.append(introduced)
                introduced += 1
            todo = todo[:reviews_per_day]
            if rng.random() < 0.5 and todo:  # a same-day repeat of a few cards
                todo += list(rng.choice(todo, size=min(3, len(todo)), replace=False))
            clock = t0 + day * 86400.0 + 3600 * rng.uniform(2, 12)
            for c in todo:
                clock += rng.uniform(5, 120)
                first = np.isnan(last[c])
                elapsed = 0.0 if first else (clock - last[c]) / 86400
                p = 1.0 if first else float(0.9 ** (elapsed / stability[c]))
                recalled = (rng.random() < 0.6) if first else (rng.random() < p)
                if not recalled:
                    rating, stability[c] = 1, max(0.5, stability[c] / 2)
                else:
                    rating = 2 if p < 0.75 or difficulty[c] > 0.85 else (4 if difficulty[c] < 0.2 else 3)
                    stability[c] *= 1.5 + 2.5 * (1 - difficulty[c]) * (1 if elapsed > 0.5 else 0.3)
                duration = float(np.round(rng.lognormal(np.log(3 + 12 * difficulty[c] + 8 * (rating == 1)), 0.4), 3))
                state = 0 if first else (3 if last_rating[c] == 1 else 2)  # before the review: relearning after a lapse
                elapsed_days = -1 if first else day - last_day[c]
                rows.append((c, deck[c], clock, rating, duration, state, elapsed_days))
                last[c], last_day[c], last_rating[c] = clock, day, rating
                due[c] = day + max(1, int(round(stability[c] * rng.uniform(0.7, 1.6))))
        offsets.append(len(rows))
    a = np.array(rows, dtype=np.float64).reshape(-1, 7)
    return ReviewLog([str(u) for u in range(n_users)], np.asarray(offsets, np.int64), a[:, 0].astype(np.int64),
                     a[:, 1].astype(np.int64), a[:, 2], a[:, 3].astype(np.int64), a[:, 4].astype(np.float32),
                     a[:, 5].astype(np.int64), a[:, 6].astype(np.int64), "simulated", {})
