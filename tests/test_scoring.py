"""`nextstep score` on both engines: the single-process loop (the default) and Ray Data (`--engine ray`), on the
bundled deep_gpcm demo model (real exported ONNX graphs) and a real local Ray instance (2 CPUs, no dashboard).

Parity is exact: both engines run nextstep/scoring.py's Scorer, so every student's JSONL line is the same bytes,
and its Parquet row holds the same values."""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from nextstep.cli import main
from nextstep.demo import BUNDLED
from tests.cli_script import cli_without

ROOT = Path(__file__).resolve().parents[1]
VOCAB = [str(q) for q in json.loads((BUNDLED / "deep_gpcm" / "demo" / "vocab_questions.json").read_text())["ids"]]


def _students(n: int, seed: int = 0) -> list[dict]:
    """Records as a user would write them: ids as strings or integers, a learner with no events, some with
    questions to predict after their history."""
    rng = random.Random(seed)
    records = []
    for s in range(n):
        events = [{"question_id": rng.choice(VOCAB), "response": rng.randrange(4)} for _ in range(rng.randrange(1, 25))]
        if s in (5, 7):  # no history: s5 still asks for predictions (from the initial state), s7 does not
            events = []
        if s % 3 == 0:
            for e in events:
                e["question_id"] = int(e["question_id"])
        record = {"student_id": f"s{s}" if s % 2 else s, "events": events}
        if s % 4 == 1:
            record["predict_question_ids"] = rng.sample(VOCAB, 3)
        records.append(record)
    return records


def _write_parts(directory: Path, records: list[dict], parts: int) -> Path:
    directory.mkdir()
    for p in range(parts):
        lines = [json.dumps(r) for r in records[p::parts]]
        if p == 0:
            lines.insert(1, "   ")  # a blank line is skipped by both engines
        (directory / f"part-{p}.jsonl").write_text("\n".join(lines) + "\n")
    return directory


def _score(*argv: str) -> None:
    assert main(["score", *argv, "--model", "deep_gpcm", "--artifacts", str(BUNDLED), "--quiet"]) == 0


def _lines(directory: Path, suffix: str = ".jsonl") -> list[str]:
    files = sorted(directory.glob(f"*{suffix}"))
    assert files, f"no {suffix} files in {directory}"
    return [line for f in files for line in f.read_text().splitlines()]


@pytest.fixture(scope="module")
def records():
    return _students(40)


@pytest.fixture(scope="module")
def single(tmp_path_factory, records):
    """The single-process command's output on JSONL parts: {student_id: line}."""
    root = tmp_path_factory.mktemp("single")
    parts = _write_parts(root / "in", records, 3)
    _score(str(parts), "--output", str(root / "scored.jsonl"))
    lines = (root / "scored.jsonl").read_text().splitlines()
    return parts, {json.loads(line)["student_id"]: line for line in lines}


def test_single_process_reads_parts_in_order_and_scores_every_student(single, records):
    parts, by_id = single
    assert len(by_id) == len(records)
    files = sorted(parts.glob("*.jsonl"))
    expected = [str(json.loads(line)["student_id"]) for f in files for line in f.read_text().splitlines()
                if line.strip()]
    assert list(by_id) == expected  # file order, then line order
    assert json.loads(by_id["s7"]) == {"student_id": "s7", "events": 0, "event_predictions": [], "predictions": None}
    fresh = json.loads(by_id["s5"])
    assert fresh["events"] == 0 and len(fresh["predictions"]) == 3
    for line in by_id.values():
        result = json.loads(line)
        assert len(result["event_predictions"]) == result["events"]
        for p in result["event_predictions"]:
            assert abs(sum(p["probabilities"]) - 1) < 1e-5 and {"theta", "alpha", "beta"} <= set(p)
    with_predictions = [json.loads(by_id[str(r["student_id"])]) for r in records if r.get("predict_question_ids")]
    assert with_predictions and all(len(r["predictions"]) == 3 for r in with_predictions)


def test_single_process_reads_a_file_of_any_other_suffix_as_jsonl(tmp_path, single, capsys):
    parts, by_id = single
    text = tmp_path / "histories.txt"
    text.write_text((parts / "part-1.jsonl").read_text())
    _score(str(text))
    lines = capsys.readouterr().out.splitlines()
    assert lines and lines == [by_id[str(json.loads(line)["student_id"])] for line in lines]


def test_single_process_parquet_in_and_out_hold_the_same_values(tmp_path, single):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    parts, by_id = single
    rows = [json.loads(line) for f in sorted(parts.glob("*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]
    for r in rows:  # Parquet columns have one type: ids as strings
        r["student_id"] = str(r["student_id"])
        r["events"] = [{"question_id": str(e["question_id"]), "response": e["response"]} for e in r["events"]]
        r.setdefault("predict_question_ids", None)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "students.parquet")
    _score(str(tmp_path / "students.parquet"), "--output", str(tmp_path / "scored.parquet"))
    scored = [without_null_known(row) for row in pq.read_table(tmp_path / "scored.parquet").to_pylist()]
    assert scored == [json.loads(line) for line in by_id.values()]


def without_null_known(row: dict) -> dict:
    """A Parquet result row as its JSONL line: `known` is null in Parquet where JSONL leaves it out (known)."""
    for key in ("event_predictions", "predictions"):
        for p in row.get(key) or ():
            if p.get("known") is None:
                p.pop("known", None)
    return row


# -- Ray Data ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ray_local():
    ray = pytest.importorskip("ray")
    pytest.importorskip("pyarrow")
    # a small object store: the tests move kilobytes, and CI containers may have a small /dev/shm
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, object_store_memory=128 * 2**20)
    yield ray
    ray.shutdown()


@pytest.mark.slow
def test_ray_jsonl_parts_are_the_single_process_lines(ray_local, single, tmp_path, capsys):
    parts, by_id = single
    out = tmp_path / "scored"
    # small batches: several batches per file (2 CPUs: one scoring worker, one for reading and writing)
    _score(str(parts), "--engine", "ray", "--batch-size", "4", "--output", str(out))
    assert f"scored {len(by_id)} students with deep_gpcm on Ray (1 worker," in capsys.readouterr().err
    lines = _lines(out)
    assert sorted(lines) == sorted(by_id.values())  # byte for byte, each student once
    assert not any(p.name.startswith(".") for p in tmp_path.iterdir())


@pytest.mark.slow
def test_ray_parquet_parts_in_and_out_match_the_single_process_scores(ray_local, single, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    parts, by_id = single
    rows = [json.loads(line) for f in sorted(parts.glob("*.jsonl")) for line in f.read_text().splitlines()
            if line.strip()]
    for r in rows:
        r["student_id"] = str(r["student_id"])
        r["events"] = [{"question_id": str(e["question_id"]), "response": e["response"]} for e in r["events"]]
        r.setdefault("predict_question_ids", None)
    (tmp_path / "in").mkdir()
    for p in range(2):
        pq.write_table(pa.Table.from_pylist(rows[p::2]), tmp_path / "in" / f"part-{p}.parquet")
    out = tmp_path / "scored"
    _score(str(tmp_path / "in" / "*.parquet"), "--engine", "ray", "--batch-size", "8", "--output", str(out),
           "--output-format", "parquet")
    files = sorted(out.glob("*.parquet"))
    assert files
    scored = [without_null_known(row) for f in files for row in pq.read_table(f).to_pylist()]
    assert sorted(scored, key=lambda r: r["student_id"]) == \
        sorted((json.loads(line) for line in by_id.values()), key=lambda r: r["student_id"])


@pytest.mark.slow
def test_ray_failure_names_the_student_and_keeps_the_previous_output(ray_local, tmp_path, capsys):
    good = _write_parts(tmp_path / "good", _students(6), 2)
    out = tmp_path / "scored"
    _score(str(good), "--engine", "ray", "--output", str(out))
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    bad = _students(6)
    bad[4]["events"] = [{"question_id": VOCAB[0], "response": 9}]  # 9: not a response of 4 categories
    bad_parts = _write_parts(tmp_path / "bad", bad, 2)
    with pytest.raises(SystemExit) as caught:
        _score(str(bad_parts), "--engine", "ray", "--output", str(out))
    message = str(caught.value.code)
    assert "student '4'" in message and "9 is outside 0..3" in message and "\n" not in message
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad", "good", "scored"]  # no partial directory left


# -- without the extra -------------------------------------------------------------------------------------------

HIDE_RAY = cli_without("ray")


def test_engine_ray_without_the_extra_is_one_line_naming_it(tmp_path):
    histories = _write_parts(tmp_path / "in", _students(2), 1)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEXTSTEP_")}, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-c", HIDE_RAY, "score", str(histories), "--model", "deep_gpcm",
                             "--artifacts", str(BUNDLED), "--engine", "ray", "--output", str(tmp_path / "out")],
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert "nextstep score --engine ray needs ray (the 'ray' extra)" in line
    assert "pip install -c constraints.txt -e '.[ray]'" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("record, says", [
    ({"student_id": "s", "events": [{"question_id": "1", "response": 1}], "predict_question_ids": "12"},
     "predict_question_ids: a list, not str"),  # it was read as the ids "1" and "2"
    ({"student_id": "s", "events": [{"question_id": "1", "response": 1.9}]}, "events[0].response: an integer"),
    ({"student_id": "s", "events": [{"question_id": "1", "response": True}]}, "events[0].response: an integer"),
    ({"student_id": None, "events": []}, "student_id: a string or integer id, not NoneType"),  # it became "None"
    ({"student_id": "s", "events": [{"question_id": 1.0, "response": 1}]}, "events[0].question_id"),
    ({"student_id": "s", "events": "1,2"}, "events: a list"),
    ({"student_id": "s", "events": [[1, 2]]}, "events[0]: a JSON object"),
])
def test_a_record_is_read_with_the_batch_routes_types_converting_nothing(record, says):
    from nextstep import scoring

    with pytest.raises(scoring.ScoringError, match=r"in\.jsonl:3: ") as caught:
        scoring.parse_line(json.dumps(record), "in.jsonl:3")
    assert says in str(caught.value)


def test_jsonl_input_may_start_with_a_bom_and_must_be_utf8(tmp_path):
    from nextstep import scoring

    good = tmp_path / "bom.jsonl"
    good.write_bytes(b"\xef\xbb\xbf" + json.dumps({"student_id": 7, "events": []}).encode() + b"\r\n")
    assert list(scoring.read_students([good], "jsonl")) == [("7", [], None)]
    bad = tmp_path / "latin1.jsonl"
    first = json.dumps({"student_id": "s", "events": []}).encode()
    bad.write_bytes(first + b"\n" + '{"student_id": "é"}'.encode("latin-1"))
    with pytest.raises(scoring.ScoringError, match=r"latin1\.jsonl:2: not UTF-8"):
        list(scoring.read_students([bad], "jsonl"))
