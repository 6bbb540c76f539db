"""Tests for nextstep.training.data: readers, error messages, layout detection, splits, vocabulary."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from nextstep.training.data import (
    DataFormatError,
    KTDataset,
    Sequence,
    Vocabulary,
    default_data_dir,
    detect_format,
    find_split_files,
    load_dataset,
    read_dtransformer,
    read_pykt_csv,
    read_three_line,
    split_students,
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
    write(tmp_path / "x_test.txt", "")
    with pytest.raises(DataFormatError, match=r"x_test.txt:1: expected at least one record"):
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
