"""Review-log readers: the review-log CSV, py-fsrs logs, Anki collections, the writer and the dispatcher; and,
when the shared data is present, agreement with the CSVs converted from the real sources."""

import csv
import gzip
import json
import lzma
import sqlite3
import zipfile

import numpy as np
import pytest

from nextstep.cli import main
from nextstep.training.data import DataFormatError, default_data_dir
from nextstep.training.srs.reviews import (
    STATE_UNKNOWN,
    ReviewLog,
    read_anki_collection,
    read_py_fsrs_csv,
    read_review_csv,
    read_review_data,
    read_reviews,
    read_users,
    simulate_reviews,
    write_review_csv,
)

CRT = 1609473600  # 2021-01-01 04:00 UTC: the collection's day 0 starts here (v1: crt is the day start)
HOUR_MS, DAY_MS = 3_600_000, 86_400_000
DECK_A, DECK_B = 1, 1600000000000


def write(path, text):
    path.write_text(text)
    return path


def make_collection(path, revlog, cards, conf=None, max_taken=60):
    """A minimal Anki collection: the col, notes, cards and revlog tables with the columns Anki has."""
    con = sqlite3.connect(path)
    con.executescript("""
        CREATE TABLE col (id integer primary key, crt integer not null, mod integer not null, scm integer not null,
            ver integer not null, dty integer not null, usn integer not null, ls integer not null,
            conf text not null, models text not null, decks text not null, dconf text not null, tags text not null);
        CREATE TABLE notes (id integer primary key, guid text not null, mid integer not null, mod integer not null,
            usn integer not null, tags text not null, flds text not null, sfld integer not null,
            csum integer not null, flags integer not null, data text not null);
        CREATE TABLE cards (id integer primary key, nid integer not null, did integer not null, ord integer not null,
            mod integer not null, usn integer not null, type integer not null, queue integer not null,
            due integer not null, ivl integer not null, factor integer not null, reps integer not null,
            lapses integer not null, left integer not null, odue integer not null, odid integer not null,
            flags integer not null, data text not null);
        CREATE TABLE revlog (id integer primary key, cid integer not null, usn integer not null,
            ease integer not null, ivl integer not null, lastIvl integer not null, factor integer not null,
            time integer not null, type integer not null);
    """)
    decks = {str(DECK_A): {"name": "Default", "conf": 1}, str(DECK_B): {"name": "Maths", "conf": 1}}
    con.execute("INSERT INTO col VALUES (1, ?, 0, 0, 11, 0, 0, 0, ?, '{}', ?, ?, '{}')",
                (CRT, json.dumps(conf or {}), json.dumps(decks), json.dumps({"1": {"maxTaken": max_taken}})))
    for cid, did in cards.items():
        con.execute("INSERT INTO notes VALUES (?, '', 0, 0, 0, '', '', 0, 0, 0, '')", (cid + 5,))
        con.execute("INSERT INTO cards VALUES (?, ?, ?, 0, 0, 0, 2, 2, 0, 1, 2500, 1, 0, 0, 0, 0, 0, '')",
                    (cid, cid + 5, did))
    for rid, cid, ease, kind, msec in revlog:
        con.execute("INSERT INTO revlog VALUES (?, ?, 0, ?, 1, 0, 2500, ?, ?)", (rid, cid, ease, msec, kind))
    con.commit()
    con.close()
    return path


def at(day, hours, minutes=0):
    """Unix ms `hours` (+ minutes) after the start of the collection's day `day`."""
    return CRT * 1000 + day * DAY_MS + hours * HOUR_MS + minutes * 60_000


# (revlog id = time ms, card id, ease, type, answer time ms)
REVLOG = [
    (at(0, 1), 101, 1, 0, 8000),  # new card, Again
    (at(0, 1, 2), 101, 2, 0, 4000),  # learning, v1 three buttons: ease 2 is Good
    (at(0, 3), 201, 3, 0, 3000),  # new card in the other deck, ease 3 = Easy on a v1 learning row
    (at(0, 23, 59), 102, 2, 0, 5000),  # 03:59 UTC the next calendar day, still day 0 (rollover at 4)
    (at(1, 0, 1), 102, 3, 1, 6000),  # 2 minutes later but past the rollover: elapsed 1 day
    (at(1, 2), 101, 0, 4, 0),  # manual reschedule (ease 0): skipped
    (at(2, 5), 201, 3, 3, 2000),  # filtered-deck cram review: skipped
    (at(3, 5), 101, 1, 1, 600000),  # review lapse (time capped by Anki at 60 s, here above it)
    (at(3, 5, 1), 101, 2, 2, 1500),  # relearning, v1: ease 2 is Good
    (at(5, 0), 999, 1, 0, 2500),  # a card deleted since: no row in cards
    (at(10, 12), 201, 4, 1, 1200),  # review, Easy
]
CARDS = {101: DECK_A, 102: DECK_A, 201: DECK_B}


@pytest.fixture
def collection(tmp_path):
    return make_collection(tmp_path / "collection.anki2", REVLOG, CARDS)


# ----------------------------------------------------------------------------- Anki


def test_anki_collection_field_by_field(collection):
    log = read_anki_collection(collection, user_id="7")
    assert log.user_ids == ["7"] and log.offsets.tolist() == [0, 9]
    kept = [r for r in REVLOG if r[3] in (0, 1, 2) and r[2] != 0]
    assert log.time.tolist() == [r[0] / 1000 for r in kept]
    assert log.card.tolist() == [101, 101, 201, 102, 102, 101, 101, 999, 201]
    assert log.deck.tolist() == [DECK_A, DECK_A, DECK_B, DECK_A, DECK_A, DECK_A, DECK_A, 0, DECK_B]
    assert log.rating.tolist() == [1, 3, 4, 3, 3, 1, 3, 1, 4]
    assert log.state.tolist() == [0, 1, 0, 0, 2, 2, 3, 0, 2]
    assert log.elapsed_days.tolist() == [-1, 0, -1, -1, 1, 3, 0, -1, 10]
    assert log.day_offsets().tolist() == [0, 0, 0, 0, 1, 3, 3, 5, 10]
    np.testing.assert_array_equal(log.duration, np.float32([8, 4, 3, 5, 6, 600, 1.5, 2.5, 1.2]))
    assert log.duration.dtype == np.float32 and log.time.dtype == np.float64
    assert log.meta["duration_cap_s"] == 60.0 and log.meta["sched_ver"] == 1
    assert log.meta["day_start_ms"] == {"7": CRT * 1000}
    assert log.meta["skipped"] == {"filtered deck (type 3)": 1, "manual reschedule (type 4)": 1}


def test_reading_a_collection_leaves_its_folder_as_it_was(tmp_path):
    """A WAL-mode collection (as Anki writes them), with a -wal file holding its last review, as Anki leaves it
    while open: the review is read, and nothing in the folder is added, removed or changed; a review of an
    unknown type is skipped and counted, not an error."""
    (tmp_path / "user").mkdir()
    path = make_collection(tmp_path / "user" / "collection.anki2", REVLOG[:-1], CARDS)
    con = sqlite3.connect(path)
    con.execute("PRAGMA journal_mode=WAL")
    con.execute("PRAGMA wal_autocheckpoint=0")
    rid, cid, ease, kind, msec = REVLOG[-1]
    con.execute("INSERT INTO revlog VALUES (?, ?, 0, ?, 1, 0, 2500, ?, ?)", (rid, cid, ease, msec, kind))
    con.execute("INSERT INTO revlog VALUES (?, ?, 0, ?, 1, 0, 2500, ?, ?)", (rid + 1, cid, 3, 1000, 9))
    con.commit()
    before = {p.name: p.read_bytes() for p in path.parent.iterdir()}
    assert path.name + "-wal" in before
    log = read_anki_collection(path)
    assert {p.name: p.read_bytes() for p in path.parent.iterdir()} == before
    assert log.time[-1] == rid / 1000 and log.meta["skipped"]["other type"] == 1
    con.close()


def test_anki_v2_ratings_are_the_ease_and_the_rollover_hour_moves_the_day_boundary(tmp_path):
    revlog = [(at(0, 1), 101, 2, 0, 1000), (at(0, 21, 30), 101, 2, 0, 1000), (at(0, 22, 30), 101, 3, 1, 1000)]
    path = make_collection(tmp_path / "c.anki2", revlog, CARDS, conf={"schedVer": 2, "rollover": 2})
    log = read_anki_collection(path)
    assert log.rating.tolist() == [2, 2, 3]  # four buttons everywhere
    assert log.day_offsets().tolist() == [0, 0, 1]  # day 1 starts 22 h after crt (02:00 next day)
    assert log.elapsed_days.tolist() == [-1, 0, 1]


def test_anki_stored_utc_offsets_set_the_day_boundary(tmp_path):
    # created at 10:00 UTC on Jan 1 by a user at UTC-5 with rollover 4: days start at 09:00 UTC
    crt_shift = 6 * 3600 * 1000  # CRT is 04:00 UTC; the collection's crt here is 10:00 UTC
    revlog = [(at(1, 4, 59), 101, 3, 0, 1000), (at(1, 5, 1), 101, 3, 1, 1000)]  # Jan 2 08:59 and 09:01 UTC
    path = make_collection(tmp_path / "c.anki2", revlog, CARDS,
                           conf={"sched2021": True, "creationOffset": 300, "localOffset": 300})
    con = sqlite3.connect(path)
    con.execute("UPDATE col SET crt = ?", ((CRT * 1000 + crt_shift) // 1000,))
    con.commit()
    con.close()
    log = read_anki_collection(path)
    assert log.meta["sched_ver"] == 3 and log.day_offsets().tolist() == [0, 1]
    assert log.elapsed_days.tolist() == [-1, 1]


def test_anki_errors_are_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        read_anki_collection(tmp_path / "missing.anki2")
    with pytest.raises(DataFormatError, match=r"notsql.anki2:1: expected an Anki collection \(a SQLite database"):
        read_anki_collection(write(tmp_path / "notsql.anki2", "user_id,card_id\n"))
    with zipfile.ZipFile(tmp_path / "c.colpkg", "w") as z:
        z.writestr("collection.anki2", b"")
    with pytest.raises(DataFormatError, match=r"c.colpkg:1: expected an Anki collection \(SQLite\) in collection"):
        read_anki_collection(tmp_path / "c.colpkg")
    con = sqlite3.connect(tmp_path / "norevlog.anki2")
    con.execute("CREATE TABLE cards (id integer)")
    con.close()
    with pytest.raises(DataFormatError, match=r"expected an Anki collection with a 'revlog' table, got \['cards'\]"):
        read_anki_collection(tmp_path / "norevlog.anki2")
    bad = make_collection(tmp_path / "bad.anki2", REVLOG[:2] + [(at(0, 2), 101, 4, 0, 1000)], CARDS)
    with pytest.raises(DataFormatError, match=r"bad.anki2:3: expected ease in 1..3 on a v1 scheduler learning row"):
        read_anki_collection(bad)


# ----------------------------------------------------------------------------- Anki packages (.colpkg, .apkg)


def _proto_varint(value):
    out = bytearray()
    while True:
        out.append((value & 0x7F) | (0x80 if value > 0x7F else 0))
        value >>= 7
        if not value:
            return bytes(out)


def deck_config_blob(cap):
    """A DeckConfig.Config message as Anki 2.1.50+ stores it: learn steps (packed floats, field 1), new cards a day
    (varint, field 9), initial ease (fixed32, field 11), the answer-time cap (varint, field 24)."""
    steps = np.float32([1.0, 10.0]).tobytes()
    return (b"\x0a" + _proto_varint(len(steps)) + steps + _proto_varint(9 << 3) + _proto_varint(20)
            + _proto_varint(11 << 3 | 5) + np.float32(2.5).tobytes() + _proto_varint(24 << 3) + _proto_varint(cap))


def make_colpkg(path, revlog, cards, cap=45, member="collection.anki21b"):
    """A .colpkg as Anki 2.1.50+ writes it: meta, the collection (schema 18 style: col.dconf empty, the deck options
    in deck_config) as zstd-compressed SQLite in collection.anki21b, a stub collection.anki2 with no reviews and a
    note asking for a newer Anki, and media. member="collection.anki21": the older layout, plain SQLite."""
    import zstandard

    work = path.parent / f".{path.name}.parts"
    work.mkdir()
    inner = make_collection(work / "inner.anki2", revlog, cards)
    con = sqlite3.connect(inner)
    con.execute("UPDATE col SET dconf = '', ver = 18")
    con.execute("CREATE TABLE deck_config (id integer primary key not null, name text not null, "
                "mtime_secs integer not null, usn integer not null, config blob not null)")
    con.execute("INSERT INTO deck_config VALUES (1, 'Default', 0, 0, ?)", (deck_config_blob(cap),))
    con.commit()
    con.close()
    stub = make_collection(work / "stub.anki2", [], {})
    con = sqlite3.connect(stub)
    con.execute("INSERT INTO notes VALUES (1, '', 0, 0, 0, '', ?, 0, 0, 0, '')", ("Please update to the latest Anki",))
    con.commit()
    con.close()
    data = inner.read_bytes()
    if member.endswith("b"):  # streamed, as Anki writes it: no content size in the frame header
        compressor = zstandard.ZstdCompressor(write_content_size=False).compressobj()
        data = compressor.compress(data) + compressor.flush()
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("meta", b"\x08\x03")
        z.writestr(member, data)
        z.writestr("collection.anki2", stub.read_bytes())
        z.writestr("media", b"")
    return path


def test_colpkg_is_read_from_its_zstd_collection_not_the_stub(collection, tmp_path):
    package = make_colpkg(tmp_path / "backup-2024-01-02-03.04.05.colpkg", REVLOG, CARDS, cap=45)
    log = read_anki_collection(package, user_id="7")
    plain = read_anki_collection(collection, user_id="7")
    assert log.meta["package_member"] == "collection.anki21b"
    assert_same_log(plain, log)  # every review of the collection inside; the stub has none
    assert log.meta["duration_cap_s"] == 45.0  # from the deck_config table's protobuf (col.dconf is empty)
    assert log.path == str(package)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == [
        "backup-2024-01-02-03.04.05.colpkg", "collection.anki2"]  # nothing unpacked beside it
    assert read_reviews(package).meta["package_member"] == "collection.anki21b"
    folder = tmp_path / "user"
    folder.mkdir()
    package.rename(folder / package.name)
    assert_same_log(plain, read_reviews(folder, user_id="7"))  # a folder holding one backup
    legacy = make_colpkg(tmp_path / "legacy.colpkg", REVLOG, CARDS, member="collection.anki21")
    assert read_anki_collection(legacy).meta["package_member"] == "collection.anki21"
    assert len(read_anki_collection(legacy)) == len(plain)


def test_colpkg_faults_are_named(tmp_path):
    package = make_colpkg(tmp_path / "c.colpkg", REVLOG, CARDS)
    with zipfile.ZipFile(package) as z:
        parts = {name: z.read(name) for name in z.namelist()}
    cut = tmp_path / "cut.colpkg"
    with zipfile.ZipFile(cut, "w") as z:
        for name, data in parts.items():
            z.writestr(name, data[: len(data) // 2] if name == "collection.anki21b" else data)
    with pytest.raises(DataFormatError, match=r"cut.colpkg:1: expected collection.anki21b compressed with zstd"):
        read_anki_collection(cut)
    other = tmp_path / "other.colpkg"
    with zipfile.ZipFile(other, "w") as z:
        z.writestr("notes.txt", b"hello")
    with pytest.raises(DataFormatError, match=r"expected an Anki package holding one of \['collection.anki21b'"):
        read_anki_collection(other)
    with pytest.raises(DataFormatError, match="expected an Anki package"):
        read_anki_collection(write(tmp_path / "torn.colpkg", "PK\x03\x04 not really a zip"))


def test_deck_option_caps_of_newer_collections(tmp_path):
    for blob, cap in ((deck_config_blob(90), 90.0), (json.dumps({"maxTaken": 30}).encode(), 30.0), (b"\xff", None)):
        path = make_collection(tmp_path / f"c{cap}.anki2", REVLOG, CARDS)
        con = sqlite3.connect(path)
        con.execute("UPDATE col SET dconf = ''")
        con.execute("CREATE TABLE deck_config (id integer primary key, name text, mtime_secs integer, usn integer, "
                    "config blob)")
        con.execute("INSERT INTO deck_config VALUES (1, 'Default', 0, 0, ?)", (blob,))
        con.commit()
        con.close()
        assert read_anki_collection(path).meta.get("duration_cap_s") == cap


def test_cli_import_anki_reads_a_colpkg(tmp_path, capsys):
    package = make_colpkg(tmp_path / "backup.colpkg", REVLOG, CARDS)
    out = tmp_path / "reviews.csv"
    assert main(["import-anki", str(package), "--out", str(out)]) == 0
    assert capsys.readouterr().out.startswith(f"wrote 9 reviews of 4 cards to {out}")
    assert len(read_review_csv(out)) == 9


# ----------------------------------------------------------------------------- review-log CSV


def test_review_csv_groups_users_sorts_by_time_and_fills_defaults(tmp_path):
    f = write(tmp_path / "r.csv", "user_id,card_id,review_time,rating,duration,day_offset,note\n"
              "b,5,1600000100000,3,2000,0,x\n"
              "a,1,1600172800000,1,,2,x\n"
              "b,5,1600000000000,4,1500.5,0,x\n"
              "a,1,1600000000000,3,1000,0,x\n"
              "a,2,1600172800000,2,1000,2,x\n")
    log = read_review_csv(f)
    assert log.user_ids == ["b", "a"] and log.offsets.tolist() == [0, 2, 5]  # first appearance
    assert log.time.tolist() == [1600000000.0, 1600000100.0, 1600000000.0, 1600172800.0, 1600172800.0]
    assert log.card.tolist() == [5, 5, 1, 1, 2]  # equal times keep file order
    assert log.rating.tolist() == [4, 3, 3, 1, 2]
    assert log.elapsed_days.tolist() == [-1, 0, -1, 2, -1]  # from day_offset
    assert log.deck.tolist() == [0] * 5 and log.state.tolist() == [STATE_UNKNOWN] * 5
    np.testing.assert_array_equal(log.duration, np.float32([1.5005, 2.0, 1.0, np.nan, 1.0]))
    assert log.day_offsets().tolist() == [0, 0, 0, 2, 2]
    assert log.meta["time_unit"] == "ms" and "duration_cap_s" not in log.meta
    assert read_review_csv(f, duration_cap_s=60).meta["duration_cap_s"] == 60.0


def test_review_csv_in_seconds_computes_days_at_4am_utc(tmp_path):
    t0 = 1609473600 - 120  # 2021-01-01 03:58 UTC: day 0 (the day before the 4 am boundary)
    f = write(tmp_path / "r.csv", "user_id,card_id,review_time,rating\n"
              f"1,7,{t0},3\n1,7,{t0 + 60},3\n1,7,{t0 + 180},3\n1,8,{t0 + 86400 * 3},1\n")
    log = read_review_csv(f)
    assert log.meta["time_unit"] == "s" and log.time[0] == t0
    assert log.day_offsets().tolist() == [0, 0, 1, 3]
    assert log.elapsed_days.tolist() == [-1, 0, 1, -1]
    shifted = read_review_csv(f, day_start_hour=0, utc_offset_hours=-5)  # midnight at UTC-5: 05:00 UTC
    assert shifted.elapsed_days.tolist() == [-1, 0, 0, -1]


def test_review_csv_elapsed_days_checks_and_modes(tmp_path):
    header = "user_id,card_id,review_time,rating,elapsed_days\n"
    f = write(tmp_path / "r.csv", header + "1,7,1600000000,3,-1\n1,7,1600864000,3,0\n")  # 10 days later
    with pytest.raises(DataFormatError, match=r"r.csv:3: expected elapsed_days within 1.5 of the 10.00 days"):
        read_review_csv(f)
    assert read_review_csv(f, day_columns="trust").elapsed_days.tolist() == [-1, 0]
    assert read_review_csv(f, day_columns="ignore").elapsed_days.tolist() == [-1, 10]
    f = write(tmp_path / "s.csv", header + "1,7,1600000000,3,0\n")
    with pytest.raises(DataFormatError, match=r"s.csv:2: expected elapsed_days -1 on the card's first review"):
        read_review_csv(f)
    f = write(tmp_path / "t.csv", "user_id,card_id,review_time,rating,day_offset,elapsed_days\n"
              "1,7,1600000000,3,0,-1\n1,7,1600086400,3,1,2\n")
    with pytest.raises(DataFormatError, match=r"t.csv:3: expected elapsed_days equal to the day_offset difference"):
        read_review_csv(f)
    f = write(tmp_path / "u.csv", "user_id,card_id,review_time,rating,day_offset\n"
              "1,7,1600000000,3,1\n1,8,1600000100,3,0\n")
    with pytest.raises(DataFormatError, match=r"u.csv:3: expected a day_offset no smaller than"):
        read_review_csv(f)


@pytest.mark.parametrize("row, message", [
    ("1,7,1600000000000,5,0,100", r"r.csv:3: expected rating in 1..4 \(column 'rating'\), got '5'"),
    ("1,7,1600000000000,good,0,100", r"r.csv:3: expected rating in 1..4 \(column 'rating'\), got 'good'"),
    ("1,7,1600000000000,3,4,100", r"r.csv:3: expected state in 0..3 \(column 'state'\), got '4'"),
    ("1,7,1600000000000,3,0,-5", r"r.csv:3: expected a duration in ms >= 0 \(column 'duration'\), got '-5'"),
    ("1,7.5,1600000000000,3,0,100", r"r.csv:3: expected an integer card id \(column 'card_id'\), got '7.5'"),
    ("1,7,nan,3,0,100", r"r.csv:3: expected a finite unix time \(column 'review_time'\), got 'nan'"),
    ("1,7,1600000000,3,0,100", r"r.csv:3: expected a unix time in milliseconds like line 2's"),
    (",7,1600000000000,3,0,100", r"r.csv:3: expected a user id \(column 'user_id'\)"),
    ("1,7,1600000000000,3,0", r"r.csv:3: expected 6 comma-separated columns, got 5"),
])
def test_malformed_csv_rows_name_line_and_column(tmp_path, row, message):
    f = write(tmp_path / "r.csv", f"user_id,card_id,review_time,rating,state,duration\n1,7,1600000000000,3,0,100\n"
              f"{row}\n")
    with pytest.raises(DataFormatError, match=message):
        read_review_csv(f)


def test_csv_header_and_empty_file_errors(tmp_path):
    with pytest.raises(DataFormatError, match=r"h.csv:1: expected a CSV header with columns \['user_id'"):
        read_review_csv(write(tmp_path / "h.csv", "user,card_id,review_time,rating\n1,2,3,4\n"))
    with pytest.raises(DataFormatError, match=r"e.csv:2: expected at least one review"):
        read_review_csv(write(tmp_path / "e.csv", "user_id,card_id,review_time,rating\n"))


# ----------------------------------------------------------------------------- writer


def assert_same_log(a: ReviewLog, b: ReviewLog):
    assert a.user_ids == b.user_ids
    for name in ("offsets", "card", "deck", "time", "rating", "duration", "state", "elapsed_days"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert getattr(a, name).dtype == getattr(b, name).dtype, name
    days = a.day_offsets()
    assert (days is None and b.day_offsets() is None) or days.tolist() == b.day_offsets().tolist()


def test_write_then_read_round_trips(collection, tmp_path):
    log = read_anki_collection(collection)
    back = read_review_csv(write_review_csv(log, tmp_path / "a.csv"))
    assert_same_log(log, back)
    assert back.day_offsets() is not None
    # several users, unknown states, odd durations, no known day boundary for one user: no day_offset column
    two = ReviewLog(["u1", "u2"], np.array([0, 2, 3]), np.array([5, 5, 9]), np.array([0, 3, 3]),
                    np.array([1.6e9 + 0.001, 1.6e9 + 86400 * 2.5, 1.7e9]), np.array([1, 4, 2]),
                    np.float32([0.123456, np.nan, 7.0]), np.array([STATE_UNKNOWN, 2, 0]), np.array([-1, 2, -1]),
                    meta={"day_start_ms": {"u1": 0}})
    path = write_review_csv(two, tmp_path / "b.csv")
    assert path.read_text().splitlines()[0] == "user_id,card_id,deck_id,review_time,rating,state,duration,elapsed_days"
    assert_same_log(two, read_review_csv(path))


# ----------------------------------------------------------------------------- py-fsrs


def test_py_fsrs_csv(tmp_path):
    f = write(tmp_path / "review_logs.csv", "card_id,review_rating,review_time,review_duration\n"
              "11,3,2024-03-02T05:00:00+02:00,2500\n"  # 03:00 UTC: day 0 (before the 4 am UTC boundary)
              "11,1,2024-03-01T12:00:00.250000+00:00,1000\n"
              "12,4,2024-03-02T04:30:00+00:00,\n"
              "11,3,2024-03-02T04:00:00Z,None\n")
    log = read_py_fsrs_csv(f, user_id="josh")
    assert log.user_ids == ["josh"] and log.offsets.tolist() == [0, 4]
    assert log.time.tolist() == [1709294400.25, 1709348400.0, 1709352000.0, 1709353800.0]
    assert log.card.tolist() == [11, 11, 11, 12] and log.rating.tolist() == [1, 3, 3, 4]
    assert log.day_offsets().tolist() == [0, 0, 1, 1]
    assert log.elapsed_days.tolist() == [-1, 0, 1, -1]
    assert log.state.tolist() == [STATE_UNKNOWN] * 4 and log.deck.tolist() == [0] * 4
    np.testing.assert_array_equal(log.duration, np.float32([1.0, 2.5, np.nan, np.nan]))
    assert_same_log(log, read_review_csv(write_review_csv(log, tmp_path / "out.csv")))
    bad = write(tmp_path / "bad.csv", "card_id,review_rating,review_time\n1,3,2024-03-02T05:00:00\n")
    with pytest.raises(DataFormatError, match=r"bad.csv:2: expected an ISO 8601 time with a UTC offset"):
        read_py_fsrs_csv(bad)


# ----------------------------------------------------------------------------- dispatcher and CLI


def test_read_reviews_picks_the_reader(collection, tmp_path):
    assert read_reviews(collection).meta["format"] == "anki"
    assert read_reviews(tmp_path).meta["format"] == "anki"  # a directory holding one collection
    fsrs_dir = tmp_path / "fsrs"
    fsrs_dir.mkdir()
    write(fsrs_dir / "logs.csv", "card_id,review_rating,review_time,review_duration\n1,3,2024-03-01T12:00:00Z,5\n")
    assert read_reviews(fsrs_dir).meta["format"] == "py_fsrs"
    write_review_csv(read_anki_collection(collection), tmp_path / "revlogs.csv")
    assert read_reviews(tmp_path).meta["format"] == "review_csv"  # revlogs.csv first
    with pytest.raises(DataFormatError, match="py-fsrs"):
        read_reviews(write(tmp_path / "x.csv", "a,b\n1,2\n"))
    with pytest.raises(FileNotFoundError):
        read_reviews(tmp_path / "empty_dir_missing")


def test_gzipped_review_logs_are_read(collection, tmp_path):
    log = read_anki_collection(collection)
    plain = write_review_csv(log, tmp_path / "plain.csv")
    folder = tmp_path / "gz"
    folder.mkdir()
    (folder / "revlogs.csv.gz").write_bytes(gzip.compress(plain.read_bytes()))
    assert_same_log(log, read_reviews(folder))  # found by name in a directory, read as the review-log CSV
    assert_same_log(log, read_review_csv(folder / "revlogs.csv.gz"))
    fsrs = tmp_path / "fsrs.csv"  # gzipped, not named so
    fsrs.write_bytes(gzip.compress(b"card_id,review_rating,review_time\n1,3,2024-03-01T12:00:00Z\n"))
    assert read_reviews(fsrs).meta["format"] == "py_fsrs"
    xz = tmp_path / "revlogs.csv.xz"
    xz.write_bytes(lzma.compress(plain.read_bytes()))
    with pytest.raises(DataFormatError, match="expected a plain or gzipped text file, got 'xz-compressed data'"):
        read_reviews(xz)


def test_cli_import_anki(collection, tmp_path, capsys):
    out = tmp_path / "out" / "reviews.csv"
    assert main(["import-anki", str(collection), "--out", str(out), "--user-id", "42"]) == 0
    printed = capsys.readouterr().out
    # it says what the CSV holds: all 9 reviews read, the deleted card's among them, and what it left out
    log = read_review_csv(out)
    hour = int(log.meta["day_start_ms"]["42"]) % 86_400_000 / 3_600_000  # the boundary the CSV's day columns keep
    assert printed == (f"wrote 9 reviews of 4 cards to {out}: 8 in 2 decks and 1 of 1 deleted card (deck_id 0: "
                       "their deck is unknown); not written: 1 filtered deck (type 3), 1 manual reschedule "
                       f"(type 4)\nthe collection's days start at {int(hour):02d}:00 UTC: send "
                       f'"day_start_hour_utc": {hour:g} with this user\'s reviews\n')
    assert log.user_ids == ["42"] and len(log) == 9 and int((log.deck == 0).sum()) == 1
    with pytest.raises(SystemExit, match="import-anki: Anki collection not found"):
        main(["import-anki", str(tmp_path / "nope.anki2"), "--out", str(out)])


# ----------------------------------------------------------------------------- the shared data


SRS = default_data_dir() / "srs"
needs_ankimath = pytest.mark.skipif(not (SRS / "ankimath" / "collection.anki2").is_file(), reason="no AnkiMath data")
needs_josh = pytest.mark.skipif(not (SRS / "py_fsrs_josh" / "revlogs.csv").is_file(), reason="no py-fsrs data")


def read_columns(path):
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    return {k: np.array([r[k] for r in rows]) for k in rows[0]}


def first_appearance(ids):
    """Ids renumbered 0, 1, ... in order of first appearance (as the converters number cards)."""
    seen: dict[int, int] = {}
    return np.array([seen.setdefault(i, len(seen)) for i in ids.tolist()], dtype=np.int64)


@needs_ankimath
def test_ankimath_collection_reproduces_the_converted_csv():
    log = read_anki_collection(SRS / "ankimath" / "collection.anki2", user_id="1")
    ref = read_columns(SRS / "ankimath" / "revlogs.csv")
    assert len(log) == len(ref["review_time"]) == 38093
    assert log.user_ids == ["1"] and set(ref["user_id"]) == {"1"}
    assert np.array_equal(np.round(log.time * 1000).astype(np.int64), ref["review_time"].astype(np.int64))
    assert np.array_equal(first_appearance(log.card), ref["card_id"].astype(np.int64))  # cards renumbered
    # decks renumbered by first appearance too; the deleted cards' deck 0 happens to come first
    assert np.array_equal(first_appearance(log.deck), ref["deck_id"].astype(np.int64))
    for name, column in (("rating", "rating"), ("state", "state"), ("elapsed_days", "elapsed_days")):
        assert np.array_equal(getattr(log, name), ref[column].astype(np.int64)), name
    assert np.array_equal(log.day_offsets(), ref["day_offset"].astype(np.int64))
    assert np.array_equal(np.round(log.duration.astype(np.float64) * 1000), ref["duration"].astype(np.int64))
    assert log.meta["duration_cap_s"] == 500.0
    csv_log = read_review_csv(SRS / "ankimath" / "revlogs.csv")  # the checks pass on the converted file
    for name in ("time", "rating", "state", "elapsed_days", "duration"):
        assert np.array_equal(getattr(csv_log, name), getattr(log, name)), name
    assert np.array_equal(csv_log.day_offsets(), log.day_offsets())


@needs_josh
def test_py_fsrs_josh_rows_agree_with_the_converted_csv_but_its_days_do_not():
    raw = read_py_fsrs_csv(next((SRS / "py_fsrs_josh").glob("review_logs_*.csv")))
    ref = read_columns(SRS / "py_fsrs_josh" / "revlogs.csv")
    seconds = ref["review_time"].astype(np.int64)
    assert len(raw) == len(seconds) == 12580
    assert np.array_equal(np.floor(raw.time).astype(np.int64), seconds)  # the CSV keeps whole seconds
    assert np.array_equal(first_appearance(raw.card), ref["card_id"].astype(np.int64))
    assert np.array_equal(raw.rating, ref["rating"].astype(np.int64))
    assert np.array_equal(np.round(raw.duration.astype(np.float64) * 1000), ref["duration"].astype(np.int64))
    # The converter's day_offset is floor(t / 86_400_000) - floor(t0 / 86_400_000) with t in SECONDS (a unit
    # slip: seconds read as ms), so 190 days of reviews fall on days 0 and 1 and elapsed_days is mostly 0.
    assert np.array_equal(ref["day_offset"].astype(np.int64), seconds // DAY_MS - seconds[0] // DAY_MS)
    assert set(ref["day_offset"].tolist()) == {"0", "1"} and (raw.time[-1] - raw.time[0]) / 86400 > 190
    assert int((ref["elapsed_days"].astype(np.int64) > 0).sum()) == 380
    assert int((raw.elapsed_days > 0).sum()) == 6276  # real scheduler days, boundary 4 am UTC
    assert int((raw.elapsed_days != ref["elapsed_days"].astype(np.int64)).sum()) == 6257
    with pytest.raises(DataFormatError, match=r"revlogs.csv:\d+: expected elapsed_days within 1.5"):
        read_review_csv(SRS / "py_fsrs_josh" / "revlogs.csv")
    recomputed = read_review_csv(SRS / "py_fsrs_josh" / "revlogs.csv", day_columns="ignore")
    assert np.array_equal(recomputed.elapsed_days, raw.elapsed_days)


# ----------------------------------------------------------------------------- many users: --data DIR


def test_a_folder_of_users_at_any_depth_reads_each_and_skips_the_refused(collection, tmp_path):
    root = tmp_path / "users"
    (root / "anki" / "alice").mkdir(parents=True)
    make_collection(root / "anki" / "alice" / "collection.anki2", REVLOG, CARDS)
    (root / "anki" / "alice" / "backups").mkdir()  # an Anki profile's backups: the same user, not searched
    make_colpkg(root / "anki" / "alice" / "backups" / "backup-2024-01-01-00.00.00.colpkg", REVLOG, CARDS)
    (root / "bob").mkdir()
    make_colpkg(root / "bob" / "backup-2023-01-01-00.00.00.colpkg", REVLOG[:5], CARDS)
    make_colpkg(root / "bob" / "backup-2024-01-01-00.00.00.colpkg", REVLOG, CARDS)  # the latest is read
    (root / "deep" / "er" / "shared").mkdir(parents=True)
    two = simulate_reviews(n_users=2, n_cards=5, n_days=5, seed=3)
    write_review_csv(two, root / "deep" / "er" / "shared" / "revlogs.csv")
    (root / "broken").mkdir()
    write(root / "broken" / "revlogs.csv", "user_id,card_id,review_time,rating\n1,2,1700000000,9\n")
    (root / "two_collections").mkdir()
    for name in ("a.anki2", "b.anki2"):
        make_collection(root / "two_collections" / name, REVLOG, CARDS)
    (root / ".hidden").mkdir()
    make_collection(root / ".hidden" / "collection.anki2", REVLOG, CARDS)
    (root / "notes").mkdir()
    write(root / "notes" / "README.md", "no reviews here")
    lines = []
    users = read_users(root, log_line=lines.append)
    assert [name for name, _ in users] == ["anki/alice", "bob", "deep/er/shared:0", "deep/er/shared:1"]
    assert all(log.user_ids == [name] and log.n_users == 1 for name, log in users)
    assert [len(log) for _, log in users] == [9, 9, len(two.user(0)), len(two.user(1))]
    assert users[1][1].path.endswith("backup-2024-01-01-00.00.00.colpkg")
    assert len(lines) == 2 and lines[0].startswith("skipped broken: ") and "rating in 1..4" in lines[0]
    assert lines[1].startswith("skipped two_collections: ") and "one *.anki2" in lines[1]
    # --data: all of them in one log, each user with their own cap and day boundary
    log = read_review_data(root, log_line=lines.append)
    assert log.user_ids == [name for name, _ in users] and len(log) == sum(len(x) for _, x in users)
    assert log.duration_caps().tolist() == [60.0] * 9 + [45.0] * 9 + [np.inf] * (len(log) - 18)
    assert set(log.meta["day_start_ms"]) == {"anki/alice", "bob"}  # (the CSV has no fixed day boundary)
    np.testing.assert_array_equal(log.user(1).card, users[1][1].card)
    with pytest.raises(FileNotFoundError, match="no user's review data"):
        read_users(root / "notes")


def test_one_users_folder_reads_as_before(collection, tmp_path):
    assert_same_log(read_reviews(tmp_path), read_review_data(tmp_path))  # a user's folder: read_reviews, as today
    assert_same_log(read_reviews(collection), read_review_data(collection))
    assert [name for name, _ in read_users(tmp_path)] == [tmp_path.name]
    write(tmp_path / "revlogs.csv", "user_id,card_id,review_time,rating\n1,2,1700000000,9\n")
    with pytest.raises(DataFormatError, match="rating in 1..4"):  # its own data refused: an error, not a skip
        read_review_data(tmp_path)


def test_a_refused_revlogs_csv_falls_back_to_the_users_other_file(tmp_path):
    user = tmp_path / "users" / "josh"
    user.mkdir(parents=True)
    write(user / "revlogs.csv", "user_id,card_id,review_time,rating,day_offset,elapsed_days\n"
                                "0,1,1700000000,3,0,-1\n0,1,1702000000,3,0,0\n")  # 23 days apart, elapsed 0
    write(user / "review_logs_josh.csv", "card_id,review_rating,review_time\n1,3,2023-11-14T22:13:20Z\n"
                                         "1,3,2023-12-07T21:46:40Z\n")
    lines = []
    (name, log), = read_users(tmp_path / "users", log_line=lines.append)
    assert name == "josh" and log.meta["format"] == "py_fsrs" and log.elapsed_days.tolist() == [-1, 23]
    assert len(lines) == 1 and "elapsed_days" in lines[0] and lines[0].endswith("read review_logs_josh.csv instead")


def test_malformed_review_csv_bytes_fields_and_user_ids_name_the_file_line_and_column(tmp_path):
    limit = csv.field_size_limit()
    head = "user_id,card_id,review_time,rating\nu,1,1700000000000,3\n"
    path = tmp_path / "reviews.csv"
    path.write_text(head + "u,1," + "9" * (limit + 1) + ",3\n")
    with pytest.raises(DataFormatError, match=rf"reviews.csv:3: expected fields of at most {limit:,} characters "
                                              r"\(column 'review_time'\)"):
        read_reviews(path)
    path.write_text(head + "u" * 300 + ",1,1700000100000,3\n")
    with pytest.raises(DataFormatError, match=r"reviews.csv:3: expected a user id of at most 256 characters \(column "
                                              r"'user_id'\), got '300 characters'"):
        read_reviews(path)
    path.write_bytes(head.encode() + b"\xfe,1,1700000100000,3\n")
    with pytest.raises(DataFormatError, match=r"reviews.csv:3: expected UTF-8 text, got b'\\xfe' \(byte 1 of"):
        read_reviews(path)
