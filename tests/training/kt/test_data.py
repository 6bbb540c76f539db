"""Tests for nextstep.training.data: readers, error messages, layout detection, splits, vocabulary."""

from __future__ import annotations

import bz2
import csv
import gzip
import lzma
import zipfile
from pathlib import Path

import numpy as np
import pytest

from nextstep.training.data import MAX_ID_CHARS, DataFormatError, Vocabulary, default_data_dir
from nextstep.training.kt.data import (
    MAX_CATEGORIES,
    KTDataset,
    Sequence,
    detect_format,
    find_split_files,
    load_dataset,
    read_dtransformer,
    read_long_csv,
    read_pykt_csv,
    read_three_line,
    split_students,
    write_long_csv,
)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def assert_error(exc: pytest.ExceptionInfo, name: str, line_no: int, expected: str) -> None:
    message = str(exc.value)
    assert f"{name}:{line_no}:" in message, message
    assert f"expected {expected}" in message, message


# ----------------------------------------------------------------------------- happy paths


def test_three_line_with_trailing_commas_spaces_and_blank_lines(tmp_path):
    path = write(tmp_path / "toy_train.csv", "3\n5, 7,5,\n1,0,1,\n2\n9,10\n0,1\n\n\n")
    ds = read_three_line(path)
    assert (ds.fmt, ds.n_cats, len(ds), ds.n_interactions) == ("three_line", 2, 2, 5)
    first = ds.sequences[0]
    assert first.student_id == "toy_train:0"
    assert first.questions.dtype == np.int64 and first.questions.tolist() == [5, 7, 5]
    assert first.responses.tolist() == [1, 0, 1] and first.problems is None


def test_three_line_infers_ordinal_k_or_takes_it_given(tmp_path):
    path = write(tmp_path / "t.txt", "4\n0,1,2,3\n0,3,2,1\n")
    assert read_three_line(path).n_cats == 4
    assert read_three_line(path, n_cats=5).n_cats == 5
    assert read_three_line(write(tmp_path / "z.txt", "2\n1,2\n0,0\n")).n_cats == 2  # at least 2


def test_pykt_csv_reads_uid_and_drops_padding(tmp_path):
    text = (
        "fold,uid,concepts,responses,cidxs\n"
        '0,u1,"3,4,5","1,0,1","0,1,2"\n'
        '1,u2,"6,-1,7,-1","0,1,1,-1","3,4,5,6"\n'
    )
    ds = read_pykt_csv(write(tmp_path / "train_valid.csv", text))
    assert [s.student_id for s in ds.sequences] == ["u1", "u2"]
    assert ds.sequences[1].questions.tolist() == [6, 7] and ds.sequences[1].responses.tolist() == [0, 1]
    assert (ds.fmt, ds.n_cats, ds.n_interactions) == ("pykt", 2, 5)


def test_dtransformer_fields_in_order(tmp_path):
    path = write(tmp_path / "train.txt", "2\n100,101\n5,6\n1,0\n1\n102\n7\n1\n")
    ds = read_dtransformer(path, fields=("pid", "q", "s"))
    s = ds.sequences[0]
    assert (s.problems.tolist(), s.questions.tolist(), s.responses.tolist()) == ([100, 101], [5, 6], [1, 0])
    assert s.student_id == "train:0" and ds.fmt == "dtransformer"
    other = write(tmp_path / "other.txt", "2\n5,6\n1,0\n100,101\n3,4\n9,9\n")
    s = read_dtransformer(other, fields=("q", "s", "pid", "it", "at")).sequences[0]
    assert (s.questions.tolist(), s.responses.tolist(), s.problems.tolist()) == ([5, 6], [1, 0], [100, 101])
    qs_only = write(tmp_path / "qs.txt", "1\n5\n1\n")
    assert read_dtransformer(qs_only, fields=("q", "s")).sequences[0].problems is None


# ----------------------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    ("text", "line_no", "expected"),
    [
        ("2\n1,2\n0,1\nx\n1\n0\n", 4, "a positive integer sequence length"),
        ("0\n\n\n", 1, "a positive integer sequence length"),
        ("3\n1,2\n0,1,1\n", 2, "3 comma-separated question ids"),
        ("2\n1,2\n0,1,1\n", 3, "2 comma-separated responses"),
        ("2\n1,a\n0,1\n", 2, "integer question ids"),
        ("2\n1,2\n0,1.5\n", 3, "integer responses"),
        ("2\n1,2\n0,-1\n", 3, "responses >= 0"),
        ("2\n1,2\n0,1\n2\n3,4\n", 6, "a line of responses"),
        ("2\n1,99999999999999999999\n0,1\n", 2, "integer question ids within int64"),  # was an OverflowError
    ],
)
def test_three_line_errors_name_file_line_and_expectation(tmp_path, text, line_no, expected):
    path = write(tmp_path / "bad_train.txt", text)
    with pytest.raises(DataFormatError) as exc:
        read_three_line(path)
    assert_error(exc, "bad_train.txt", line_no, expected)


def test_three_line_response_out_of_range_for_given_k(tmp_path):
    path = write(tmp_path / "k.txt", "2\n1,2\n0,1\n2\n1,2\n0,4\n")
    with pytest.raises(DataFormatError) as exc:
        read_three_line(path, n_cats=4)
    assert_error(exc, "k.txt", 6, "responses in 0..3")
    assert exc.value.line_no == 6 and exc.value.got == 4
    assert isinstance(exc.value, ValueError)


def test_pykt_errors(tmp_path):
    missing = write(tmp_path / "nocol.csv", 'fold,uid,concepts\n0,1,"1,2"\n')
    with pytest.raises(DataFormatError) as exc:
        read_pykt_csv(missing)
    assert_error(exc, "nocol.csv", 1, "a CSV header with 'concepts' (or 'questions') and 'responses' columns")

    mismatch = write(tmp_path / "mm.csv", 'fold,uid,concepts,responses\n0,1,"1,2","1,0"\n0,2,"1,2","1"\n')
    with pytest.raises(DataFormatError) as exc:
        read_pykt_csv(mismatch)
    assert_error(exc, "mm.csv", 3, "2 comma-separated responses")

    out_of_range = write(tmp_path / "oor.csv", 'fold,uid,concepts,responses\n0,1,"1,2","1,2"\n')
    with pytest.raises(DataFormatError) as exc:
        read_pykt_csv(out_of_range)
    assert_error(exc, "oor.csv", 2, "responses in 0..1")

    short_row = write(tmp_path / "short.csv", 'fold,uid,concepts,responses\n0,1,"1,2"\n')
    with pytest.raises(DataFormatError) as exc:
        read_pykt_csv(short_row)
    assert_error(exc, "short.csv", 2, "4 columns")


def test_dtransformer_errors(tmp_path):
    truncated = write(tmp_path / "train.txt", "2\n100,101\n5,6\n1,0\n2\n100,101\n5,6\n")
    with pytest.raises(DataFormatError) as exc:
        read_dtransformer(truncated)
    assert_error(exc, "train.txt", 8, "a line of responses (s)")
    bad = write(tmp_path / "test.txt", "2\n100,101\n5,6\n1,2\n")
    with pytest.raises(DataFormatError) as exc:
        read_dtransformer(bad)
    assert_error(exc, "test.txt", 4, "responses in 0..1")
    with pytest.raises(ValueError, match="'q' and 's'"):
        read_dtransformer(bad, fields=("pid", "q"))


# ----------------------------------------------------------------------------- detection and layouts


def test_detect_format(tmp_path):
    assert detect_format(write(tmp_path / "a.txt", "2\n1,2\n0,1\n3\n1,2,3\n0,0,1,\n")) == "three_line"
    assert detect_format(write(tmp_path / "b.txt", "2\n9,8\n1,2\n0,1\n1\n7\n3\n1\n")) == "dtransformer"
    assert detect_format(write(tmp_path / "c.csv", 'fold,uid,concepts,responses\n0,1,"1","0"\n')) == "pykt"
    with pytest.raises(DataFormatError):
        detect_format(write(tmp_path / "d.txt", "2\n1\n"))  # a length-2 record with a 1-item line


def make_layout(root: Path, kind: str) -> Path:
    """Small directories laid out like each real data set."""
    rec3 = "2\n1,2\n0,1\n3\n2,3,4\n1,1,0,\n"
    if kind == "dkvmn":
        d = root / "dkvmn_assist2009_updated"
        write(d / "assist2009_updated_train.csv", rec3)
        write(d / "assist2009_updated_test.csv", rec3)
        for i in range(1, 6):
            write(d / f"assist2009_updated_valid{i}.csv", rec3)
        write(d / "assist2009_updated_qid_sid", "1\t1\n")
    elif kind == "deepgpcm":
        d = root / "deepgpcm_synthetic_6_5_4"
        write(d / "synthetic_6_5_4_train.txt", "2\n0,4\n0,1\n")  # K=4 in metadata, not visible here
        write(d / "synthetic_6_5_4_test.txt", "1\n3\n2\n")
        write(d / "metadata.json", '{"n_cats": 4}')
    elif kind == "pykt":
        d = root / "pykt_assist2015"
        write(d / "train_valid.csv", 'fold,uid,concepts,responses\n0,7,"1,2","0,1"\n1,8,"3","1"\n')
        write(d / "test.csv", 'fold,uid,concepts,responses,cidxs\n-1,9,"1","1","0"\n')
        write(d / "keyid2idx.json", "{}")
    else:
        d = root / "dtransformer_assist09"
        toml = '[assist09]\ninputs = ["pid", "q", "s"]\n[assist17]\ninputs = ["q", "s", "pid", "it", "at"]\n'
        write(d / "datasets.toml", toml)
        write(d / "train.txt", "2\n100,101\n5,6\n1,0\n")
        write(d / "test.txt", "1\n102\n7\n1\n")
    return d


@pytest.mark.parametrize(
    ("kind", "fmt", "kwargs", "train_name", "test_name"),
    [
        ("dkvmn", "three_line", {}, "assist2009_updated_train.csv", "assist2009_updated_test.csv"),
        ("deepgpcm", "three_line", {"n_cats": 4}, "synthetic_6_5_4_train.txt", "synthetic_6_5_4_test.txt"),
        ("pykt", "pykt", {}, "train_valid.csv", "test.csv"),
        ("dtransformer", "dtransformer", {"fields": ["pid", "q", "s"]}, "train.txt", "test.txt"),
    ],
)
def test_find_split_files_on_real_layouts(tmp_path, kind, fmt, kwargs, train_name, test_name):
    d = make_layout(tmp_path, kind)
    train, test, found_fmt, found_kwargs = find_split_files(d)
    assert (train.name, test.name, found_fmt, found_kwargs) == (train_name, test_name, fmt, kwargs)
    tr, te = load_dataset(d)
    assert tr.fmt == te.fmt == fmt and len(tr) >= 1 and len(te) >= 1
    if kind == "deepgpcm":
        assert tr.n_cats == te.n_cats == 4


def test_dtransformer_section_fallback_by_parsing(tmp_path):
    d = make_layout(tmp_path, "dtransformer").rename(tmp_path / "dt_unnamed")
    assert find_split_files(d)[3] == {"fields": ["pid", "q", "s"]}  # only 3-line records parse


def test_find_split_files_reports_ambiguity(tmp_path):
    d = make_layout(tmp_path, "dkvmn")
    write(d / "other_train.txt", "1\n1\n1\n")
    with pytest.raises(ValueError, match=r"other_train\.txt.*assist2009_updated_valid1\.csv"):
        find_split_files(d)
    with pytest.raises(FileNotFoundError):
        find_split_files(tmp_path / "nope")


def test_k_comes_from_the_train_file(tmp_path):
    write(tmp_path / "x_train.txt", "2\n1,2\n0,2\n")
    write(tmp_path / "x_test.txt", "1\n1\n1\n")
    train, test = load_dataset(tmp_path)
    assert train.n_cats == test.n_cats == 3
    write(tmp_path / "x_test.txt", "1\n1\n3\n")  # response 3 is outside the K = 3 the train file implies
    with pytest.raises(DataFormatError, match=r"x_test.txt:3: expected"):
        load_dataset(tmp_path)


def test_empty_split_file_is_a_clear_error(tmp_path):
    write(tmp_path / "x_train.txt", "2\n1,2\n0,2\n")
    write(tmp_path / "x_test.txt", "2\n1,2\n0,2\n")
    write(tmp_path / "x_train.txt", "\n")
    with pytest.raises(DataFormatError, match=r"x_train.txt:1: expected a knowledge-tracing data file"):
        load_dataset(tmp_path)


def test_a_format_that_does_not_fit_names_the_field_and_the_format_asked(tmp_path):
    """A three-line folder read with --format dtransformer said `expected 3 comma-separated s, got 1`."""
    write(tmp_path / "x_train.txt", "3\n1,2,3\n0,1,1\n2\n4,5\n1,0\n")
    write(tmp_path / "x_test.txt", "2\n1,2\n0,1\n")
    with pytest.raises(DataFormatError) as exc:
        load_dataset(tmp_path, fmt="dtransformer")  # pid = the ids, q = the responses, s = the next length line
    assert str(exc.value) == (f"{tmp_path / 'x_train.txt'}:4: expected 3 comma-separated responses (s), got 1 "
                              "(read as dtransformer, as asked; the files look like three_line)")


# ----------------------------------------------------------------------------- splits and vocabulary


def toy_dataset(n_students: int = 20) -> KTDataset:
    seqs = [Sequence(f"s{i % n_students}", np.arange(3), np.array([0, 1, 0])) for i in range(2 * n_students)]
    return KTDataset(seqs, 2, "toy", "pykt")


def test_split_students_deterministic_and_disjoint():
    ds = toy_dataset()
    train, valid = split_students(ds, 0.25, seed=3)
    again_train, again_valid = split_students(ds, 0.25, seed=3)
    ids = lambda d: [s.student_id for s in d.sequences]  # noqa: E731
    assert ids(train) == ids(again_train) and ids(valid) == ids(again_valid)
    assert not set(ids(train)) & set(ids(valid))
    # 5 of 20 students, each with both of its sequences
    assert len(set(ids(valid))) == 5 and len(train) + len(valid) == len(ds)
    assert set(ids(split_students(ds, 0.25, seed=4)[1])) != set(ids(valid))
    assert len(split_students(ds, 0.0, seed=0)[1]) == 0
    with pytest.raises(ValueError):
        split_students(ds, 1.0, seed=0)


def test_vocabulary_round_trip_and_unknown():
    vocab = Vocabulary.build([30, 10, 20, 10])
    assert vocab.ids == [10, 20, 30] and len(vocab) == 5
    encoded = vocab.encode(np.array([[10, 30], [99, -5]]))
    assert encoded.dtype == np.int64 and encoded.tolist() == [[2, 4], [1, 1]]
    restored = Vocabulary.from_json(vocab.to_json())
    assert restored == vocab and restored.encode(np.array([20])).tolist() == [3]
    assert Vocabulary([]).encode(np.array([1, 2])).tolist() == [1, 1] and len(Vocabulary([])) == 2
    assert Vocabulary([7, 3]).encode(np.array([3, 7])).tolist() == [3, 2]  # index follows ids order


def test_text_ids_are_numbered_in_natural_order_and_matched_as_the_service_matches_them():
    vocab = Vocabulary.build(np.array(["q12", "q7", "b", "q7", "q100", "a2"]))
    assert vocab.ids == ["a2", "b", "q7", "q12", "q100"]  # digit runs compare as numbers
    assert vocab.encode(np.array(["q12", "q1", "b"])).tolist() == [5, 1, 3]
    assert Vocabulary.from_json(vocab.to_json()) == vocab
    # an id is its text: 12 and "12" are the same id, "012" another, in a text or an integer vocabulary
    text = Vocabulary(["12", "x"])
    assert text.encode(np.array([12, 5])).tolist() == [2, 1]
    numbers = Vocabulary.build([12, 3])
    assert numbers.ids == [3, 12] and numbers.numeric and not text.numeric
    assert numbers.encode(np.array(["12", "012", "3", "x"])).tolist() == [3, 1, 2, 1]
    with pytest.raises(ValueError, match="unique"):
        Vocabulary([12, "12"])


# ----------------------------------------------------------------------------- the long format


def test_long_csv_groups_learners_sorts_by_time_and_keeps_text_ids(tmp_path):
    path = write(tmp_path / "log.csv", (
        "user_id,item_id,score,time,skill_id,event_id\n"
        "u2,q7,1,300,algebra,e1\n"
        "u1,q12,0,200,,e2\n"
        "u2,q12,0,100,algebra,e3\n"
        "u1,q7,1,200,geometry,e4\n"   # the same time as u1's first row: file order
        "u2,q9,1,300,algebra,e5\n"    # the same time as u2's row of line 2
        "u2,q9,1,301,algebra,e5\n"    # a replay of u2's event e5: dropped
        "u1,q7,2,250,geometry,e5\n"   # e5 again, but u1's: kept
    ))
    ds = read_long_csv(path)
    assert (ds.fmt, ds.n_cats, ds.n_interactions) == ("long_csv", 3, 6)
    u2, u1 = ds.sequences  # ordered by first interaction: u2's at 100, u1's at 200
    assert (u2.student_id, u1.student_id) == ("u2", "u1")
    assert u2.questions.tolist() == ["q12", "q7", "q9"] and u2.responses.tolist() == [0, 1, 1]
    assert u1.questions.tolist() == ["q12", "q7", "q7"] and u1.responses.tolist() == [0, 1, 2]
    assert u1.skills.tolist() == ["", "geometry", "geometry"]
    assert ds.notes == {"columns": {"learner": "user_id", "question": "item_id", "response": "score",
                                    "time": "time", "skill": "skill_id", "event": "event_id"},
                        "replays_dropped": 1}


def test_long_csv_row_order_does_not_matter(tmp_path):
    rows = ["s1,3,1,10", "s1,1,0,11", "s2,2,1,5", "s2,3,0,20", "s1,2,1,12", "s3,1,1,7"]
    first = read_long_csv(write(tmp_path / "a.csv", "learner_id,question_id,correct,timestamp\n" + "\n".join(rows)))
    again = read_long_csv(write(tmp_path / "b.csv", "learner_id,question_id,correct,timestamp\n"
                                + "\n".join(reversed(rows))))
    for ds in (first, again):
        assert [s.student_id for s in ds.sequences] == ["s2", "s3", "s1"]
        assert [s.questions.tolist() for s in ds.sequences] == [[2, 3], [1], [3, 1, 2]]


@pytest.mark.parametrize(("ids", "dtype", "expected"), [
    (["12", "7", "-3"], np.int64, [12, 7, -3]),  # integers as written: the int ids of the other formats
    (["12", "07", "3"], str, ["12", "07", "3"]),  # "07" is not the integer 7: all of the file's ids stay text
    (["12", "x", "3"], str, ["12", "x", "3"]),
    (["1", "99999999999999999999", "2"], str, ["1", "99999999999999999999", "2"]),  # beyond int64: text
])
def test_long_csv_ids_are_integers_only_when_every_one_is(tmp_path, ids, dtype, expected):
    text = "student_id,problem_id,correct,order_id\n" + "".join(f"s,{q},1,{i}\n" for i, q in enumerate(ids))
    (s,) = read_long_csv(write(tmp_path / "x.csv", text)).sequences
    assert s.questions.dtype.kind == np.dtype(dtype).kind and s.questions.tolist() == expected


def test_long_csv_header_names_iso_times_tabs_and_a_byte_order_mark(tmp_path):
    text = "\ufeffAnon Student Id\tQuestion-ID\tCorrect\tStart Time\n" \
           "a\tq1\t1.0\t2024-03-02T10:00:00\na\tq2\t0\t2024-03-02T09:00:00+00:00\n"
    ds = read_long_csv(write(tmp_path / "x.tsv", text))
    assert ds.sequences[0].questions.tolist() == ["q2", "q1"] and ds.sequences[0].responses.tolist() == [0, 1]
    assert ds.notes["columns"] == {"learner": "Anon Student Id", "question": "Question-ID", "response": "Correct",
                                   "time": "Start Time"}


@pytest.mark.parametrize(("text", "line_no", "expected"), [
    ("user_id,item_id,correct\nu,1,1\n", 1, "a header with learner, question, response and time columns "
                                            "(missing time: timestamp / time / start_time...)"),
    ("user_id,item_id,correct,time\nu,1,1,5\n,2,1,6\n", 3, "a learner id (column 'user_id')"),
    ("user_id,item_id,correct,time\nu,,1,5\n", 2, "a question id (column 'item_id')"),
    ("user_id,item_id,correct,time\nu,1,0.5,5\n", 2, "an integer response (column 'correct')"),
    ("user_id,item_id,correct,time\nu,1,-1,5\n", 2, "a response >= 0 (column 'correct')"),
    ("user_id,item_id,correct,time\nu,1,1,noon\n", 2, "a number or an ISO 8601 time (column 'time')"),
    ("user_id,item_id,correct,time\nu,1,1,nan\n", 2, "a number or an ISO 8601 time (column 'time')"),
    ("user_id,item_id,correct,time\nu,1,1\n", 2, "4 columns"),
    ("user_id,item_id,correct,time\n", 2, "at least one interaction"),
])
def test_long_csv_errors_name_file_line_and_column(tmp_path, text, line_no, expected):
    with pytest.raises(DataFormatError) as exc:
        read_long_csv(write(tmp_path / "bad_train.csv", text))
    assert_error(exc, "bad_train.csv", line_no, expected)


def test_long_csv_test_responses_are_checked_against_the_training_k(tmp_path):
    write(tmp_path / "x_train.csv", "user_id,item_id,correct,time\nu,a,1,1\nu,b,0,2\n")
    write(tmp_path / "x_test.csv", "user_id,item_id,correct,time\nv,a,1,1\nv,b,2,2\n")
    with pytest.raises(DataFormatError) as exc:
        load_dataset(tmp_path)
    assert_error(exc, "x_test.csv", 3, "a response in 0..1 (column 'correct')")


def test_detect_format_tells_pykt_from_long_and_names_both_otherwise(tmp_path):
    assert detect_format(write(tmp_path / "a.csv", "learner_id,question_id,correct,timestamp\n1,2,1,3\n")) == \
        "long_csv"
    assert detect_format(write(tmp_path / "b.csv", 'uid,questions,responses\n1,"1,2","0,1"\n')) == "pykt"
    with pytest.raises(DataFormatError, match="a pykt header .* or a long-format one"):
        detect_format(write(tmp_path / "c.csv", "who,what\n1,2\n"))


def test_a_file_of_one_interaction_per_learner_is_refused_saying_why(tmp_path):
    """A pykt-style file of one interaction per row trained as thousands of one-interaction students."""
    rows = "".join(f"{i},{i % 5},{i % 2},{i}\n" for i in range(40))  # the learner column is a row number
    write(tmp_path / "x_train.csv", "learner_id,question_id,correct,timestamp\n" + rows)
    write(tmp_path / "x_test.csv", "learner_id,question_id,correct,timestamp\n1,1,1,1\n1,2,0,2\n")
    with pytest.raises(ValueError) as exc:
        load_dataset(tmp_path)
    assert str(exc.value) == (f"{tmp_path / 'x_train.csv'}: 40 of 40 learners have a single interaction: this looks "
                              "like one row per learner (the long format needs one row per interaction, with the "
                              "learner's id in column 'learner_id' on every row of theirs)")
    pykt = tmp_path / "pykt"
    write(pykt / "train.csv", "uid,questions,responses\n" + "".join(f"u{i % 8},{i % 5},{i % 2}\n" for i in range(40)))
    write(pykt / "test.csv", 'uid,questions,responses\n9,"1,2","0,1"\n')
    with pytest.raises(ValueError, match=r"train.csv: 40 of 40 rows hold a single interaction: this looks like one "
                                         r"interaction per row, read as pykt, .* read in the long format"):
        load_dataset(pykt)
    more = "".join(f"{i},1,1,99\n" for i in range(5))  # 5 of 40 learners with a second interaction: read
    write(tmp_path / "x_train.csv", "learner_id,question_id,correct,timestamp\n" + rows + more)
    assert len(load_dataset(tmp_path)[0]) == 40


def gzipped(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(text.encode(), mtime=0))
    return path


def test_gzip_is_read_whatever_the_file_is_named(tmp_path):
    rec = "2\n1,2\n0,1\n3\n2,3,4\n1,1,0,\n"
    gzipped(tmp_path / "x_train.txt.gz", rec)
    gzipped(tmp_path / "x_test.txt", rec)  # gzipped, not named so
    train, test = load_dataset(tmp_path)
    assert (train.fmt, train.n_interactions, test.n_interactions) == ("three_line", 5, 5)
    assert train.notes == test.notes == {"compression": "gzip"}
    long = tmp_path / "long"
    gzipped(long / "a_train.csv.gz", "user_id,item_id,correct,time\nu,q1,1,1\nu,q2,0,2\n")
    gzipped(long / "a_test.csv.gz", "user_id,item_id,correct,time\nv,q1,1,1\n")
    train, _ = load_dataset(long)
    assert train.fmt == "long_csv" and train.sequences[0].questions.tolist() == ["q1", "q2"]


@pytest.mark.parametrize(("name", "compress"), [
    ("zstd", lambda b: b"\x28\xb5\x2f\xfd" + b"\x00" * 8),  # a zstd frame's magic number
    ("bzip2", bz2.compress),
    ("xz", lzma.compress),
    ("zip", None),
])
def test_another_compression_is_refused_naming_it(tmp_path, name, compress):
    rec = b"2\n1,2\n0,1\n"
    train = tmp_path / "x_train.csv"
    if compress is None:
        with zipfile.ZipFile(train, "w") as z:
            z.writestr("x_train.csv", rec)
    else:
        train.write_bytes(compress(rec))
    write(tmp_path / "x_test.csv", rec.decode())
    with pytest.raises(DataFormatError) as exc:
        load_dataset(tmp_path)
    assert str(exc.value) == (f"{train}:1: expected a plain or gzipped text file, got '{name}-compressed data' "
                              "(decompress it first, or gzip it: only gzip is read)")


def test_a_gzip_file_cut_short_is_a_format_error(tmp_path):
    whole = gzip.compress(("user_id,item_id,correct,time\n" + "u,1,1,1\n" * 2000).encode())
    path = tmp_path / "x.csv.gz"
    path.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataFormatError, match="expected a whole gzip file.*the file is damaged or cut short"):
        read_long_csv(path)


def test_a_single_data_file_is_split_by_a_hash_of_the_learner_id(tmp_path):
    rows = "".join(f"u{i},q{i % 7},{i % 2},{t}\n" for i in range(200) for t in range(3))
    write(tmp_path / "log.csv", "user_id,item_id,correct,time\n" + rows)
    train, test = load_dataset(tmp_path)
    ids = lambda d: {s.student_id for s in d.sequences}  # noqa: E731
    assert not ids(train) & ids(test) and len(ids(train) | ids(test)) == 200
    assert 25 <= len(test) <= 55  # about 20%
    assert train.path == test.path and "split" in train.notes
    write(tmp_path / "log.csv", "user_id,item_id,correct,time\n" + "".join(reversed(rows.splitlines(True))))
    assert ids(load_dataset(tmp_path)[1]) == ids(test)  # the same learners, whatever the order of the rows
    write(tmp_path / "x_train.csv", "user_id,item_id,correct,time\nu,1,1,1\n")  # two files: names decide
    with pytest.raises(ValueError, match=r"expected exactly one \*train\* and one \*test\*"):
        load_dataset(tmp_path)


def test_write_long_csv_round_trips_with_text_ids(tmp_path):
    ds = read_three_line(write(tmp_path / "t.txt", "3\n5,17,5\n1,0,1\n2\n9,10\n0,1\n"))
    path = write_long_csv(ds, tmp_path / "t.csv.gz", question_prefix="q")
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    back = read_long_csv(path)
    assert [s.student_id for s in back.sequences] == ["s0", "s1"]
    assert [s.questions.tolist() for s in back.sequences] == [["q5", "q17", "q5"], ["q9", "q10"]]
    assert [s.responses.tolist() for s in back.sequences] == [[1, 0, 1], [0, 1]]
    same = read_long_csv(write_long_csv(ds, tmp_path / "same.csv"))  # the same ids: the same sequences
    assert [s.questions.tolist() for s in same.sequences] == [s.questions.tolist() for s in ds.sequences]
    assert [s.responses.tolist() for s in same.sequences] == [s.responses.tolist() for s in ds.sequences]
    assert same.sequences[0].questions.dtype == np.int64 and same.n_cats == ds.n_cats


# ----------------------------------------------------------------------------- real data (optional)

KT_DIR = default_data_dir() / "kt"
# (train students, test students, total interactions) as given in the data README or counted there.
REAL_COUNTS = {
    "deepgpcm_synthetic_500_200_4": (400, 100, 75478),
    "dkvmn_assist2009_updated": (2921, 1230, 325637),
    "dkvmn_statics2011": (229, 104, 189297),
    "dtransformer_assist09": (3135, 1364, None),
    "pykt_assist2015": (15275, 3818, None),
}


@pytest.mark.skipif(not KT_DIR.is_dir(), reason=f"real data not found at {KT_DIR}")
@pytest.mark.parametrize("name", sorted(REAL_COUNTS))
def test_real_kt_datasets(name):
    n_train, n_test, n_total = REAL_COUNTS[name]
    train, test = load_dataset(KT_DIR / name)
    assert (len(train), len(test)) == (n_train, n_test)
    if n_total is not None:
        assert train.n_interactions + test.n_interactions == n_total
    assert train.n_cats == (4 if name.startswith("deepgpcm") else 2)


# ----------------------------------------------------------------------------- bounds on what a file can allocate

LONG_HEADER = "user_id,item_id,correct,time\n"
LONG_ROWS = "".join(f"u{i % 6},q{i % 5},{i % 2},{i}\n" for i in range(60))
FOUR_ROWS = "".join(LONG_ROWS.splitlines(keepends=True)[:4])  # lines 2 to 5: what follows is line 6


def test_a_response_past_the_category_bound_is_refused_naming_the_line_and_column(tmp_path):
    """One response of 1,000,000 made K = 1,000,001: every response table of that size, gigabytes."""
    with pytest.raises(DataFormatError) as exc:
        read_long_csv(write(tmp_path / "x.csv", LONG_HEADER + LONG_ROWS + "u1,q1,1000000,99\n"))
    assert str(exc.value) == (f"{tmp_path / 'x.csv'}:62: expected a response below {MAX_CATEGORIES} (column "
                              f"'correct'), got 1000000 (responses are categories 0..K-1 with K at most "
                              f"{MAX_CATEGORIES}: bin a finer score first)")
    assert read_long_csv(write(tmp_path / "y.csv", LONG_HEADER + "u,q,99,1\nu,r,0,2\n")).n_cats == MAX_CATEGORIES
    with pytest.raises(DataFormatError, match=r"x.txt:3: expected responses below 100, got 100 \(responses are"):
        read_three_line(write(tmp_path / "x.txt", "2\n1,2\n0,100\n"))
    with pytest.raises(DataFormatError, match=r"z.csv:2: expected an integer response \(column 'correct'\), got "
                                              r"'1e400'"):
        read_long_csv(write(tmp_path / "z.csv", LONG_HEADER + "u,q,1e400,1\n"))
    write(tmp_path / "meta" / "x_train.csv", LONG_HEADER + LONG_ROWS)
    write(tmp_path / "meta" / "x_test.csv", LONG_HEADER + LONG_ROWS)
    write(tmp_path / "meta" / "metadata.json", '{"n_cats": 1000000}')
    with pytest.raises(ValueError, match=r"metadata.json: n_cats must be an integer from 2 to 100, got 1000000"):
        load_dataset(tmp_path / "meta")


def test_an_id_past_the_length_bound_is_refused_and_a_long_id_pads_no_other_learner(tmp_path):
    """A 100,000-character question id in 4,000 rows took 5.3 GB: numpy padded every row's id to it."""
    long_id = "q" * (MAX_ID_CHARS + 1)
    for column, row in (("item_id", f"u1,{long_id},1,7\n"), ("user_id", f"{long_id},q1,1,7\n")):
        with pytest.raises(DataFormatError) as exc:
            read_long_csv(write(tmp_path / "x.csv", LONG_HEADER + FOUR_ROWS + row))
        role = "question" if column == "item_id" else "learner"
        assert str(exc.value) == (f"{tmp_path / 'x.csv'}:6: expected a {role} id of at most {MAX_ID_CHARS} "
                                  f"characters (column {column!r}), got '{MAX_ID_CHARS + 1} characters'")
    longest = "q" * MAX_ID_CHARS
    ds = read_long_csv(write(tmp_path / "y.csv", LONG_HEADER + LONG_ROWS + f"u0,{longest},1,99\n"))
    widths = {s.student_id: s.questions.dtype.itemsize // 4 for s in ds.sequences}  # characters of the array's ids
    assert widths.pop("u0") == MAX_ID_CHARS and set(widths.values()) == {2}


def test_a_field_past_the_csv_limit_names_the_file_line_and_column(tmp_path):
    """A 10 MB field was a bare `_csv.Error: field larger than field limit (131072)` traceback."""
    limit = csv.field_size_limit()
    with pytest.raises(DataFormatError) as exc:
        read_long_csv(write(tmp_path / "x.csv", LONG_HEADER + FOUR_ROWS + "u1,q1," + "1" * (limit + 1) + ",5\n"))
    assert str(exc.value) == (f"{tmp_path / 'x.csv'}:6: expected fields of at most {limit:,} characters (column "
                              "'correct'), got 'a longer one'")
    with pytest.raises(DataFormatError, match=r"p.csv:3: expected fields of at most [\d,]+ characters \(column "
                                              r"'questions'\)"):
        read_pykt_csv(write(tmp_path / "p.csv", 'uid,questions,responses\n1,"1,2","0,1"\n2,"' + "1," * limit
                            + '1","0"\n'))


@pytest.mark.parametrize("packed", [False, True])
def test_bytes_that_are_not_utf8_name_the_file_and_the_line(tmp_path, packed):
    raw = (LONG_HEADER + FOUR_ROWS).encode() + b"u1,q\xe91,1,5\n" + LONG_ROWS.encode()
    path = tmp_path / ("x.csv.gz" if packed else "x.csv")
    path.write_bytes(gzip.compress(raw) if packed else raw)
    with pytest.raises(DataFormatError) as exc:
        load_dataset(path)
    assert str(exc.value) == (f"{path}:6: expected UTF-8 text, got b'\\xe9' (byte 5 of the line; save the file as "
                              "UTF-8)")


def test_a_long_value_is_shortened_in_the_message(tmp_path):
    with pytest.raises(DataFormatError) as exc:
        read_long_csv(write(tmp_path / "x.csv", LONG_HEADER + "u,q," + "7" * 100_000 + ".5,1\n"))
    message = str(exc.value)
    assert len(message) < 300 and message.endswith("... (100,002 characters)"), message


# ----------------------------------------------------------------------------- one file split by learner


def test_a_data_file_given_itself_is_split_by_a_hash_of_the_learner_id(tmp_path):
    """`train --data FILE.csv.gz` said "data set directory not found", though the help says a file is taken."""
    rows = "".join(f"u{i},q{i % 7},{i % 2},{t}\n" for i in range(50) for t in range(3))
    path = gzipped(tmp_path / "log.csv.gz", LONG_HEADER + rows)
    train, test = load_dataset(path)
    assert train.path == test.path == str(path) and len(train) + len(test) == 50 and len(test)
    assert train.notes["split"] == ("one data file: the learners whose id hashes into 20% of buckets are the test "
                                    "learners")
    (tmp_path / "dir").mkdir()
    path.rename(tmp_path / "dir" / "log.csv.gz")  # the same learners as the folder's only file
    assert [s.student_id for s in load_dataset(tmp_path / "dir")[1].sequences] == [s.student_id for s in test.sequences]
    with pytest.raises(FileNotFoundError, match=r"data set not found: .*nowhere.csv \(give a data set directory or a "
                                                r"data file\)"):
        load_dataset(tmp_path / "nowhere.csv")


def test_a_train_file_without_a_test_file_is_split_by_learner(tmp_path):
    """What `nextstep events export --test-fraction 0` writes (a train file and metadata.json) could not be trained
    on; nor an export whose few learners all hashed to train (an empty test file)."""
    rows = "".join(f"u{i},q{i % 7},{i % 2},{t}\n" for i in range(40) for t in range(3))
    gzipped(tmp_path / "m_train.csv.gz", LONG_HEADER + rows)
    write(tmp_path / "metadata.json", '{"n_cats": 3}')
    train, test = load_dataset(tmp_path)
    assert train.n_cats == 3 and len(train) + len(test) == 40 and len(test)
    assert train.notes["split"].startswith("no *test* file beside m_train.csv.gz: the learners whose id hashes ")
    gzipped(tmp_path / "m_test.csv.gz", LONG_HEADER)
    again, again_test = load_dataset(tmp_path)
    assert again.notes["split"].startswith("m_test.csv.gz holds no interactions: the learners whose id hashes ")
    assert [s.student_id for s in again_test.sequences] == [s.student_id for s in test.sequences]


def test_a_split_that_leaves_a_side_without_learners_says_what_to_give(tmp_path):
    write(tmp_path / "x_train.csv", LONG_HEADER + "u1,q1,1,1\nu1,q2,0,2\nu2,q1,1,3\n")  # neither hashes to test
    with pytest.raises(ValueError) as exc:
        load_dataset(tmp_path)
    assert str(exc.value) == (f"{tmp_path / 'x_train.csv'}: no *test* file beside x_train.csv, so its learners are "
                              "split into training and test learners by a hash of their id, and all 2 of its "
                              "learners fall in the training part: give more learners (about 20% fall in the test "
                              "part), or a *test* file of other learners beside a *train* file")


def test_split_students_holds_out_one_of_a_few_students():
    """4 training learners at valid_fraction 0.1 left none to validate on ("need both", no hint)."""
    fit, valid = split_students(toy_dataset(4), 0.1, seed=0)
    assert len({s.student_id for s in valid.sequences}) == 1 and len({s.student_id for s in fit.sequences}) == 3
    assert len(split_students(toy_dataset(1), 0.1, seed=0)[1]) == 0
