"""Session readers, the GRU4Rec split layout and the Zipf generator."""

import bz2
import csv
import gzip

import numpy as np
import pytest

from nextstep.training.data import DataFormatError, Vocabulary
from nextstep.training.next_item.sessions import (
    load_session_split,
    read_csv,
    read_diginetica,
    read_gru4rec_tsv,
    write_gru4rec_tsv,
    zipf_sessions,
)


def write(path, text):
    path.write_text(text)
    return path


def test_gru4rec_tsv_groups_sessions_sorts_by_time_and_orders_sessions_by_start(tmp_path):
    f = write(tmp_path / "x_train_full.txt", "SessionId\tItemId\tTime\n"
              "7\t10\t300.0\n5\t20\t100.0\n7\t11\t250.0\n5\t21\t150.0\n5\t22\t150.0\n")
    data = read_gru4rec_tsv(f)
    assert data.session_ids == ["5", "7"]  # session 5 starts first
    assert data.session(0).tolist() == [20, 21, 22]  # equal times keep file order
    assert data.session(1).tolist() == [11, 10]  # time order within the session
    assert data.offsets.tolist() == [0, 3, 5]
    assert data.n_events == 5


def test_bad_rows_name_file_line_and_column(tmp_path):
    f = write(tmp_path / "a.txt", "SessionId\tItemId\tTime\n1\t10\t1.0\n1\tabc\t2.0\n")
    with pytest.raises(DataFormatError, match=r"a.txt:3: expected an integer item id in column 'ItemId', got 'abc'"):
        read_gru4rec_tsv(f)
    f = write(tmp_path / "b.txt", "SessionId\tItemId\tTime\n1\t10\tnoon\n")
    with pytest.raises(DataFormatError, match=r"b.txt:2: expected a time in column 'Time'"):
        read_gru4rec_tsv(f)
    f = write(tmp_path / "c.txt", "Session\tItem\tTime\n1\t10\t1.0\n")
    with pytest.raises(DataFormatError, match=r"c.txt:1: expected a header with columns"):
        read_gru4rec_tsv(f)
    f = write(tmp_path / "d.txt", "SessionId\tItemId\tTime\n1\t10\n")
    with pytest.raises(DataFormatError, match=r"d.txt:2: expected 3"):
        read_gru4rec_tsv(f)
    f = write(tmp_path / "e.txt", "SessionId\tItemId\tTime\n")
    with pytest.raises(DataFormatError, match="at least one event"):
        read_gru4rec_tsv(f)


def test_diginetica_time_is_date_plus_timeframe(tmp_path):
    f = write(tmp_path / "train-item-views.csv", "session_id;user_id;item_id;timeframe;eventdate\n"
              "1;NA;81766;526309;2016-05-09\n1;NA;31331;1031018;2016-05-09\n2;NA;5;10;2016-05-08\n")
    data = read_diginetica(f)
    assert data.session_ids == ["2", "1"]
    assert data.session(1).tolist() == [81766, 31331]
    assert data.times[1] == pytest.approx(1462752000 + 526.309)


def test_generic_csv_with_named_columns_and_iso_times(tmp_path):
    f = write(tmp_path / "clicks.csv", "visit,sku,at\nA,3,2024-01-01T10:00:02\nA,4,2024-01-01T10:00:01\nB,3,5\n")
    data = read_csv(f, session_col="visit", item_col="sku", time_col="at")
    assert data.session_ids == ["B", "A"]
    assert data.session(1).tolist() == [4, 3]
    with pytest.raises(DataFormatError, match="header with columns"):
        read_csv(f)  # default column names are absent


def test_encode_drops_unknown_items_then_sessions_without_a_target():
    data = zipf_sessions(50, 30, (2, 6), seed=1)
    vocab = Vocabulary.build(data.items[data.items != data.items[0]])  # one item unknown
    enc = data.encode(vocab)
    assert (enc.items >= 2).all()
    assert enc.lengths().min() >= 2
    assert enc.n_events == sum(int((s != data.items[0]).sum()) for s in (data.session(i) for i in range(len(data)))
                               if (s != data.items[0]).sum() >= 2)


def test_split_layout_train_full_test_and_valid(tmp_path):
    data = zipf_sessions(40, 20, seed=0)
    for name in ("train_full", "test", "train_tr", "train_valid"):
        write_gru4rec_tsv(data, tmp_path / f"demo_{name}.txt")
    train, test = load_session_split(tmp_path)
    assert train.path.endswith("demo_train_full.txt") and test.path.endswith("demo_test.txt")
    train, valid = load_session_split(tmp_path, valid=True)
    assert train.path.endswith("demo_train_tr.txt") and valid.path.endswith("demo_train_valid.txt")
    assert np.array_equal(train.items, data.items)


def test_gzipped_split_files_are_found_and_read(tmp_path):
    """Tmall_train_full.tsv.gz was not found (its stem is Tmall_train_full.tsv), and the error did not say why."""
    data = zipf_sessions(30, 20, seed=0)
    for name in ("train_full", "test"):
        plain = tmp_path / f"Tmall_{name}.tsv"
        write_gru4rec_tsv(data, plain)
        (tmp_path / f"Tmall_{name}.tsv.gz").write_bytes(gzip.compress(plain.read_bytes()))
        plain.unlink()
    train, test = load_session_split(tmp_path)
    assert train.path.endswith("Tmall_train_full.tsv.gz") and test.path.endswith("Tmall_test.tsv.gz")
    assert np.array_equal(train.items, data.items) and train.session_ids == data.session_ids
    other = tmp_path / "Tmall_test.tsv.gz"
    other.rename(tmp_path / "Tmall_test.tsv.bz2")
    (tmp_path / "Tmall_test.tsv.bz2").write_bytes(bz2.compress(b"SessionId\tItemId\tTime\n1\t2\t3\n"))
    with pytest.raises(DataFormatError, match=r"Tmall_test.tsv.bz2:1: expected a plain or gzipped text file, got "
                                              r"'bzip2-compressed data'"):
        load_session_split(tmp_path)


def test_single_raw_file_is_split_by_session_start_time(tmp_path):
    write_gru4rec_tsv(zipf_sessions(100, 20, seed=0), tmp_path / "all.tsv")
    with pytest.raises(DataFormatError):  # a TSV is not the default comma-separated CSV with named columns
        load_session_split(tmp_path)
    train, test = load_session_split(tmp_path, fmt="gru4rec")
    assert train.times[train.offsets[:-1]].max() < test.times[test.offsets[:-1]].min()
    assert len(train) + len(test) == 100


def test_zipf_generator_lengths_popularity_and_successors():
    data = zipf_sessions(500, 50, (3, 7), exponent=0.8, follow=1.0, seed=3)
    assert data.lengths().min() >= 3 and data.lengths().max() <= 7
    first = data.items[data.offsets[:-1]]
    assert np.bincount(first)[1] > np.bincount(first)[40]  # rank 1 is the most popular
    s = data.session(0) - 1
    assert all(s[j] == (7 * s[j - 1] + 3) % 50 for j in range(1, len(s)))  # follow=1: always the successor


def test_a_file_given_itself_or_a_train_full_file_alone_is_split_by_time(tmp_path):
    """`train --data FILE` was a NotADirectoryError; `events export --test-fraction 0` writes *_train_full alone."""
    data = zipf_sessions(100, 20, seed=0)
    write_gru4rec_tsv(data, tmp_path / "m_train_full.tsv")
    train, test = load_session_split(tmp_path)
    assert len(train) + len(test) == 100 and train.times[train.offsets[:-1]].max() < test.times[test.offsets[:-1]].min()
    assert train.notes["split"] == ("m_train_full.tsv: no *_test file beside it: the sessions starting in the last 10% "
                                    "of its time span are the test sessions")
    again, again_test = load_session_split(tmp_path / "m_train_full.tsv", fmt="gru4rec")
    assert again.session_ids == train.session_ids and again_test.session_ids == test.session_ids
    assert again.notes["split"].startswith("m_train_full.tsv: one data file: the sessions starting in the last 10%")


def test_malformed_rows_name_the_file_line_and_column(tmp_path):
    limit = csv.field_size_limit()
    head = "SessionId\tItemId\tTime\n1\t10\t1.0\n"
    with pytest.raises(DataFormatError, match=rf"a.txt:3: expected fields of at most {limit:,} characters \(column "
                                              r"'SessionId'\)"):
        read_gru4rec_tsv(write(tmp_path / "a.txt", head + "x" * (limit + 1) + "\t11\t2.0\n"))
    with pytest.raises(DataFormatError, match=r"b.txt:3: expected a session id of at most 256 characters \(column "
                                              r"'SessionId'\), got '257 characters'"):
        read_gru4rec_tsv(write(tmp_path / "b.txt", head + "x" * 257 + "\t11\t2.0\n"))
    (tmp_path / "c.txt").write_bytes(head.encode() + b"1\t1\xff1\t2.0\n")
    with pytest.raises(DataFormatError, match=r"c.txt:3: expected UTF-8 text, got b'\\xff' \(byte 4 of the line"):
        read_gru4rec_tsv(tmp_path / "c.txt")
