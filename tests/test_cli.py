"""The `nextstep` command line end to end on small generated data: train -> artifact + report, evaluate
re-measures the same metrics, --config is checked, and binary data sets get an AUC."""

import contextlib
import gzip
import io
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nextstep.cli import main
from nextstep.demo import BUNDLED
from nextstep.training.kt.synthetic import write_gpcm_dataset
from tests.cli_script import RUN_CLI, hide

ORDINAL_KEYS = {"categorical_accuracy", "ordinal_accuracy", "qwk", "mae", "nll"}
BINARY_UNMEASURED = {"ordinal_accuracy", "qwk"}
SMALL_MODEL = {"model": {"memory_size": 8, "key_dim": 8, "value_dim": 16, "summary_dim": 8}}


def _train(argv: list[str]) -> tuple[int, str]:
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        code = main(argv)
    return code, buffer.getvalue()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    data = write_gpcm_dataset(root / "data", n_students=60, n_questions=15, seq_len_range=(20, 30), seed=3)
    out = root / "models" / "deep_gpcm" / "v1"
    config = root / "small.json"  # a small memory keeps the run fast; also exercises --config
    config.write_text(json.dumps(SMALL_MODEL))
    code, printed = _train(["train", "deep_gpcm", "--data", str(data), "--out", str(out), "--epochs", "3",
                            "--config", str(config), "--quiet", "--json", str(root / "train.json")])
    return data, out, code, printed


@pytest.mark.slow  # a whole training run and export
def test_train_writes_an_artifact_with_test_metrics_and_a_report(trained):
    data, out, code, printed = trained
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    test = manifest["metrics"]["test"]
    assert set(test) >= ORDINAL_KEYS
    assert "auc" not in test  # four categories: no binary AUC
    n_test = sum(int(line) for line in (data / "synthetic_60_15_4_test.txt").read_text().splitlines()[::3])
    assert test["n"] == n_test and manifest["data"]["n_test_students"] == 12
    assert 0 <= test["categorical_accuracy"] <= test["ordinal_accuracy"] <= 1
    assert 0 <= test["mae"] <= 3 and -1 <= test["qwk"] <= 1
    assert 0 < test["nll"] < 5  # and finite
    assert manifest["family"] == "deep_gpcm" and manifest["data"]["n_cats"] == 4
    assert manifest["model_config"]["value_dim"] == 16
    assert manifest["train_config"]["model"] == SMALL_MODEL["model"]
    assert manifest["training"]["epochs_run"] == 3 and manifest["train_config"]["epochs"] == 3
    assert manifest["parity"]["passed"] is True
    for f in ("step.onnx", "predict.onnx", "step.pt", "predict.pt", "weights.pt", "state_value_memory.npy"):
        assert (out / f).is_file(), f
    assert not (out / "checkpoint.pt").exists()

    report = out / "report"
    metrics = json.loads((report / "metrics.json").read_text())
    assert metrics["test"] == test
    assert [h["epoch"] for h in metrics["history"]] == [0, 1, 2, 3]  # 0: the warm start (ordinal data)
    for png in ("learning_curves.png", "confusion_matrix.png", "calibration.png"):
        content = (report / png).read_bytes()
        assert content.startswith(b"\x89PNG\r\n\x1a\n") and len(content) > 1000, png

    shown = json.loads((out.parents[2] / "train.json").read_text())  # --json: what the command wrote
    assert shown["artifact"] == str(out)
    assert shown["metrics"] == manifest["metrics"] and shown["parity"] == manifest["parity"]
    # it ends with a summary, not a JSON dump: the test metrics next to the base rate's, the artifact, how to serve it
    assert "{" not in printed
    last = printed.splitlines()[-3:]
    assert last[0] == (f"test: nll {test['nll']:.4f} (base rate {manifest['metrics']['baseline']['nll']:.4f})  qwk "
                       f"{test['qwk']:.4f} (base rate {manifest['metrics']['baseline']['qwk']:.4f})")
    assert re.fullmatch(rf"artifact: {re.escape(str(out))} \(the run took [\d a-z]+\)", last[1]), last
    assert last[2] == (f"serve it: nextstep serve --artifacts {out.parents[1]} (every MODEL/VERSION folder under it: "
                       "this one is model 'deep_gpcm', version 'v1')")
    # before training it said how long training may run
    assert "training: up to 3 epochs, stopping once 8 in a row bring no better valid_nll" in printed
    assert re.search(r"\ntraining: epoch 1 took \d+ s; the 2 other epochs take at most \d+ s more", printed)


@pytest.mark.slow  # a whole training run and export
def test_evaluate_prints_the_manifest_test_metrics(trained, capsys):
    data, out, _, _ = trained
    assert main(["evaluate", str(out), "--data", str(data)]) == 0
    measured = json.loads(capsys.readouterr().out)
    expected = json.loads((out / "manifest.json").read_text())["metrics"]["test"]
    assert set(measured) == set(expected)
    for key, value in expected.items():
        assert math.isclose(measured[key], value, rel_tol=0, abs_tol=1e-6), (key, measured[key], value)


def test_config_with_an_unknown_key_is_refused(tmp_path):
    data = write_gpcm_dataset(tmp_path / "data", n_students=20, n_questions=5, seq_len_range=(5, 8), seed=3)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"epochs": 1, "learning_rate": 0.01}))
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as caught:
        main(["train", "deep_gpcm", "--data", str(data), "--out", str(out), "--config", str(config)])
    message = str(caught.value.code)
    assert "learning_rate" in message and "unknown keys ['learning_rate']" in message
    assert caught.value.code != 0
    assert not out.exists()


def test_config_with_an_unknown_model_key_is_refused_before_training(tmp_path):
    data = write_gpcm_dataset(tmp_path / "data", n_students=20, n_questions=5, seq_len_range=(5, 8), seed=3)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"epochs": 1, "model": {"memry_size": 8}}))
    out = tmp_path / "never"
    # TrainConfig keys are checked by the CLI; model keys by GPCMConfig (a TypeError naming the key)
    with pytest.raises((SystemExit, TypeError)) as caught:
        main(["train", "deep_gpcm", "--data", str(data), "--out", str(out), "--config", str(config)])
    assert "memry_size" in str(caught.value)
    assert not out.exists()


@pytest.mark.parametrize("text, says", [
    ("[1, 2]", "a JSON object is expected"),
    ('{"model": [1]}', "a JSON object is expected"),
    ("{epochs: 1}", "Expecting property name"),
    (None, "No such file"),
])
def test_a_config_file_that_is_not_a_config_object_is_refused_naming_the_file(tmp_path, text, says):
    config = tmp_path / "config.json"
    if text is not None:
        config.write_text(text)
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as caught:  # the data is never read: a missing data folder is not reached
        main(["train", "deep_gpcm", "--data", str(tmp_path / "no-data"), "--out", str(out), "--config", str(config)])
    message = str(caught.value.code)
    assert message.startswith(f"--config {config}: ") and says in message, message
    assert not out.exists()


@pytest.mark.parametrize("argv, says", [
    (["train", "dkt", "--data", "{tmp}/no-such-dir"], "nextstep train: data set not found: "),
    (["train", "deep_gpcm", "--data", "{tmp}"], "expected exactly one *train* and one *test*"),
    (["train", "deep_gpcm", "--data", "{tmp}", "--out", "{tmp}/in.jsonl"], "is a file, not an artifact directory"),
    # an artifact already there is refused before any data is read, unless --force; other files even with it
    (["train", "deep_gpcm", "--data", "{tmp}/no-such-dir", "--out", "{bundled}/deep_gpcm/demo"],
     "holds an artifact already; --force replaces it"),
    (["train", "deep_gpcm", "--data", "{tmp}/no-such-dir", "--out", "{tmp}", "--force"],
     "is a folder holding other files, not an artifact"),
    (["evaluate", "{tmp}/.artifact.partial-123", "--data", "{tmp}"], "is an unfinished training run"),
    (["evaluate", "{bundled}/deep_gpcm/demo", "--data", "{tmp}"], "names no weights file, so it holds graphs only"),
    (["banks", "build", "{bundled}/deep_gpcm/demo", "--data", "{tmp}", "--version", "../../escaped"],
     "--version '../../escaped' must be a folder name"),
    (["banks", "build", "{bundled}/deep_gpcm/demo", "--data", "{tmp}"], "is a deep_gpcm artifact; only simakt"),
    (["export", "{bundled}/deep_gpcm/demo", "--out", "{tmp}"], "exists and is not an empty directory"),
    (["score", "{tmp}/in.jsonl", "--model", "deep_gpcm", "--artifacts", "{bundled}", "--output", "{tmp}"],
     "is a directory; give a file"),
])
def test_a_users_mistake_is_one_line_naming_it_and_writes_nothing(tmp_path, argv, says):
    (tmp_path / "in.jsonl").write_text(json.dumps({"student_id": "s", "events": []}) + "\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    argv = [a.format(tmp=tmp_path, bundled=BUNDLED) for a in argv]
    with pytest.raises(SystemExit) as caught:
        main(argv)
    message = str(caught.value.code)
    assert says in message and "\n" not in message, message
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written beside the inputs
    assert not (BUNDLED / "deep_gpcm" / "demo" / "banks").exists()


@pytest.mark.parametrize("argv", [
    ["evaluate", "a", "--data", "d", "--max-len", "0"],  # 0 was taken as "not given": whole sequences
    ["evaluate", "a", "--data", "d", "--duration-cap-s", "0"],
    ["train", "deep_gpcm", "--data", "d", "--epochs", "0"],
    ["serve", "--port", "99999"],  # uvicorn listened on a random port while saying 99999
    ["serve", "--workers", "0"],
    ["score", "x", "--model", "m", "--batch-size", "0"],
])
def test_an_option_out_of_range_is_a_usage_error(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    option = next(a for a in argv if a.startswith("--") and a not in ("--data", "--model"))
    assert f"argument {option}" in capsys.readouterr().err


def test_import_anki_never_writes_over_the_collection(tmp_path):
    from tests.training.srs.test_reviews import CARDS, REVLOG, make_collection

    collection = make_collection(tmp_path / "collection.anki2", REVLOG, CARDS)
    before = collection.read_bytes()
    with pytest.raises(SystemExit, match="is the collection itself"):
        main(["import-anki", str(collection), "--out", str(tmp_path / "." / "collection.anki2")])
    assert collection.read_bytes() == before


def _write_binary(data_dir, seed: int = 0) -> int:
    """A tiny three-line data set with 0/1 responses; returns the number of test interactions."""
    rng = np.random.default_rng(seed)
    data_dir.mkdir()
    easy = {101: 0.9, 102: 0.8, 103: 0.5, 104: 0.3, 105: 0.15}
    n_test = 0
    for split, n_students in (("train", 20), ("test", 6)):
        lines = []
        for _ in range(n_students):
            length = int(rng.integers(8, 15))
            questions = rng.choice(list(easy), size=length)
            responses = (rng.random(length) < np.array([easy[q] for q in questions])).astype(int)
            lines += [str(length), ",".join(map(str, questions)), ",".join(map(str, responses))]
            n_test += length if split == "test" else 0
        (data_dir / f"x_{split}.txt").write_text("\n".join(lines) + "\n")
    return n_test


@pytest.fixture(scope="module")
def replaced(tmp_path_factory, trained):
    """A copy of `trained`'s artifact, then a coral_gpcm run on right/wrong data into its folder: refused, then
    with --force. (folder, test interactions, the manifest before, the manifest after the refusal, the forced run's
    exit code)."""
    root = tmp_path_factory.mktemp("replaced")
    data = root / "binary"
    n_test = _write_binary(data)
    config = root / "small.json"
    config.write_text(json.dumps(SMALL_MODEL))
    out = root / "models" / "artifact"
    shutil.copytree(trained[1], out)
    before = (out / "manifest.json").read_text()
    argv = ["train", "coral_gpcm", "--data", str(data), "--out", str(out), "--epochs", "2", "--config", str(config),
            "--quiet"]
    with pytest.raises(SystemExit, match="holds an artifact already; --force replaces it"):
        main(argv)
    refused = (out / "manifest.json").read_text()
    code, _ = _train([*argv, "--force"])
    return out, n_test, before, refused, code


@pytest.mark.slow  # a whole training run and export
def test_binary_data_gets_an_auc(replaced):
    out, n_test, _, _, code = replaced
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    test = manifest["metrics"]["test"]
    # right/wrong data: an AUC, and no ordinal accuracy (1.0 whatever the model) or QWK, which say nothing there
    assert set(test) >= ORDINAL_KEYS - BINARY_UNMEASURED | {"auc", "accuracy"}
    assert not BINARY_UNMEASURED & set(test) and not BINARY_UNMEASURED & set(manifest["metrics"]["valid"])
    assert 0 <= test["auc"] <= 1 and test["n"] == n_test
    assert test["accuracy"] == test["categorical_accuracy"]
    assert manifest["data"]["n_cats"] == 2 and manifest["data"]["format"] == "three_line"
    assert manifest["model_config"]["n_cats"] == 2
    assert manifest["model_config"]["memory_size"] == 8  # the --config model overrides were used
    assert manifest["graphs"]["predict"]["outputs"][0]["shape"][-1] == 2
    assert "auc" in manifest["metrics"]["valid"]


# -- the long format: one interaction per row, ids as text, gzip ------------------------------------------------

SMALL_DKT = {"model": {"hidden": 16, "embed_dim": 8}}


@pytest.mark.slow  # two whole runs; the fast tier reads a long CSV as the same sequences (test_data.py)
def test_a_data_set_in_the_long_format_trains_to_the_same_metrics_as_in_its_own(tmp_path):
    """The same three-line data set as a gzipped long CSV with text ids ("q101") trains to the same metrics and
    weights with the same seed; the log names the format read. (With the same ids the long CSV reads as the very
    same sequences: tests/training/kt/test_data.py.)"""
    import torch

    from nextstep.training.kt.data import load_dataset, write_long_csv

    native = tmp_path / "native"
    _write_binary(native)
    train, test = load_dataset(native)
    (tmp_path / "text").mkdir()
    write_long_csv(train, tmp_path / "text" / "x_train.csv.gz", question_prefix="q")
    write_long_csv(test, tmp_path / "text" / "x_test.csv.gz", question_prefix="q")
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_DKT))
    runs = {}
    for name in ("native", "text"):
        out = tmp_path / f"out_{name}"
        code, printed = _train(["train", "dkt", "--data", str(tmp_path / name), "--out", str(out), "--epochs", "2",
                                "--seed", "3", "--config", str(config), "--quiet"])
        assert code == 0
        runs[name] = (json.loads((out / "manifest.json").read_text()), printed,
                      json.loads((out / "vocab_questions.json").read_text())["ids"],
                      torch.load(out / "weights.pt", weights_only=False))
    manifest, printed, ids, weights = runs["native"]
    assert "read as three_line: 20 training and 6 test sequences" in printed
    assert ids == [101, 102, 103, 104, 105]
    other, other_printed, other_ids, other_weights = runs["text"]
    assert other["metrics"] == manifest["metrics"]
    assert other_ids == [f"q{i}" for i in ids]  # what the service matches question ids against
    state, other_state = weights["state_dict"], other_weights["state_dict"]
    assert state.keys() == other_state.keys() and all(torch.equal(state[k], other_state[k]) for k in state)
    assert "read as long_csv (gzip): 20 training and 6 test sequences" in other_printed
    assert other["data"]["format"] == "long_csv" and other["data"]["compression"] == "gzip"
    assert other["data"]["columns"]["learner"] == "learner_id"


def test_a_file_of_one_row_per_learner_is_one_line_saying_why(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    header = "user_id,item_id,correct,time\n"
    (data / "log_train.csv").write_text(header + "".join(f"row{i},q{i % 4},1,{i}\n" for i in range(30)))
    (data / "log_test.csv").write_text(header + "u,q1,1,1\nu,q2,0,2\n")
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as caught:
        main(["train", "dkt", "--data", str(data), "--out", str(out), "--quiet"])
    message = str(caught.value.code)
    assert "30 of 30 learners have a single interaction: this looks like one row per learner" in message
    assert "column 'user_id'" in message and "\n" not in message
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["data"]


@pytest.mark.parametrize("model, listed, not_listed, has_format", [
    ("dkt", ["three_line", "pykt", "dtransformer", "long_csv"], ["gru4rec", "diginetica", "review_csv"], True),
    ("deep_gpcm", ["long_csv"], ["gru4rec"], True),
    ("gru4rec", ["gru4rec", "diginetica", "csv"], ["long_csv", "three_line", "py_fsrs"], True),
    ("simakt", ["three_line", "long_csv"], ["gru4rec"], False),  # detected; it takes no --format
    ("time_aware", ["review_csv", "py_fsrs", "anki"], ["long_csv", "gru4rec"], False),
])
def test_each_familys_help_lists_only_the_formats_it_takes(model, listed, not_listed, has_format, capsys):
    """`--format csv` was listed in `train --help` for every model but refused for knowledge tracing."""
    with pytest.raises(SystemExit) as caught:
        main(["train", model, "--help"])
    assert caught.value.code == 0
    text = capsys.readouterr().out
    assert all(f in text for f in listed), text
    assert not any(f in text for f in not_listed), text
    assert ("--format" in text) == has_format
    # what the help leaves out is still refused by name, not as an unrecognised argument
    assert ("--valid" in text) == (model == "gru4rec") and ("--similarity-config" in text) == (model == "simakt")


def test_a_format_the_family_does_not_take_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit) as caught:
        main(["train", "dkt", "--data", str(tmp_path), "--format", "csv"])
    assert caught.value.code == 2
    assert "argument --format: invalid choice: 'csv' (choose from 'three_line', 'pykt', 'dtransformer', " \
           "'long_csv')" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="--format: not an option of train simakt"):
        main(["train", "simakt", "--data", str(tmp_path), "--format", "pykt"])


# -- faults a user meets first: a wrong model name, no torch, progress in a log file ---------------------------

ROOT = Path(__file__).resolve().parents[1]
HIDE_TORCH = hide("torch")


def _cli(argv: list[str], *, without_torch: bool = False, **kwargs) -> subprocess.CompletedProcess:
    """`nextstep ARGV` in a fresh interpreter (optionally with torch unimportable), output captured."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEXTSTEP_")}, "PYTHONPATH": str(ROOT)}
    code = (HIDE_TORCH if without_torch else "") + RUN_CLI
    kwargs.setdefault("capture_output", True)
    return subprocess.run([sys.executable, "-c", code, *argv], text=True, env=env, timeout=300, **kwargs)


def _histories(path: Path, students: list[tuple[str, list[tuple[str, int]]]]) -> Path:
    path.write_text("".join(json.dumps({"student_id": s, "events": [{"question_id": q, "response": r}
                                                                      for q, r in events]}) + "\n"
                            for s, events in students))
    return path


@pytest.mark.parametrize("model, says", [
    ("no_such_model", "no model 'no_such_model'; available: deep_gpcm: demo; gru4rec: demo"),
    ("gru4rec", "model 'gru4rec' is a next_item model, not a knowledge_tracing one"),
    ("time_aware", "model 'time_aware' is a srs model, not a knowledge_tracing one"),
])
def test_score_with_an_unknown_or_wrong_task_model_is_one_line_and_leaves_no_file(tmp_path, model, says):
    histories = _histories(tmp_path / "histories.jsonl", [("s1", [("1", 2), ("2", 3)])])
    result = _cli(["score", str(histories), "--model", model, "--artifacts", str(BUNDLED),
                   "--output", str(tmp_path / "scored.jsonl")])
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.strip().count("\n") == 0, result.stderr  # one line, no traceback
    assert says in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["histories.jsonl"]


def test_score_replaces_its_output_only_when_every_student_is_scored(tmp_path):
    good = _histories(tmp_path / "good.jsonl", [("s1", [("1", 2), ("2", 3)]), ("s2", [("17", 0)])])
    out = tmp_path / "scored.jsonl"
    result = _cli(["score", str(good), "--model", "deep_gpcm", "--artifacts", str(BUNDLED), "--output", str(out)])
    assert result.returncode == 0, result.stderr
    scored = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["student_id"] for s in scored] == ["s1", "s2"]
    assert "\r" not in result.stderr and "scored 2 students with deep_gpcm" in result.stderr  # no bar in a pipe
    before = out.read_bytes()
    bad = _histories(tmp_path / "bad.jsonl", [("s1", [("1", 2)]), ("s2", [("1", 9)])])  # 9: not a response of 4
    result = _cli(["score", str(bad), "--model", "deep_gpcm", "--artifacts", str(BUNDLED), "--output", str(out)])
    assert result.returncode != 0 and "student 's2'" in result.stderr and "Traceback" not in result.stderr
    assert out.read_bytes() == before  # the earlier output is intact, not half overwritten
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "scored.jsonl"]


def test_hiding_torch_works():
    """The check below is real: in that interpreter torch cannot be imported."""
    result = subprocess.run([sys.executable, "-c", HIDE_TORCH + "import torch"], capture_output=True, text=True)
    assert result.returncode != 0 and "No module named 'torch' (hidden by the test)" in result.stderr


@pytest.mark.parametrize("argv", [["demo"], ["train", "deep_gpcm", "--data", "nowhere"],
                                  ["evaluate", "nowhere", "--data", "nowhere"]])
def test_commands_that_need_torch_say_what_to_install(argv):
    result = _cli(argv, without_torch=True)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert f"nextstep {argv[0]} needs torch" in line and "make setup" in line
    assert "pip install -c constraints.txt torch --extra-index-url https://download.pytorch.org/whl/cpu" in line


@pytest.mark.slow
def test_training_progress_in_a_log_file_is_one_line_per_epoch(tmp_path):
    """Output to a file (no terminal): one line per epoch, no progress-bar carriage returns."""
    data = write_gpcm_dataset(tmp_path / "data", n_students=40, n_questions=10, seq_len_range=(10, 20), seed=1)
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_MODEL))
    log = tmp_path / "train.log"
    with log.open("w") as f:
        result = _cli(["train", "deep_gpcm", "--data", str(data), "--out", str(tmp_path / "artifact"), "--epochs", "3",
                       "--config", str(config)], capture_output=False, stdout=f, stderr=subprocess.STDOUT)
    text = log.read_text()
    assert result.returncode == 0, text
    assert "\r" not in text
    lines = text.splitlines()
    epochs = [line for line in lines if line.startswith("epoch")]
    assert [int(line.split()[1]) for line in epochs] == [0, 1, 2, 3], text  # 0: the warm start
    # the warm start's fit (22-55 s on real data) is announced before it and timed after it
    warm = [i for i, line in enumerate(lines) if line.startswith("warm start: ")]
    assert len(warm) == 2 and warm[1] < lines.index(epochs[0]), text
    assert "fitting a GPCM" in lines[warm[0]] and re.fullmatch(r"warm start: done in \d+\.\d s", lines[warm[1]])
    assert all("valid_nll" in line and "targets/s" in line for line in epochs)


@pytest.mark.slow
def test_training_progress_on_a_terminal_is_a_bar(tmp_path):
    """On a terminal the loop keeps tqdm's bar (carriage-return updates) besides the epoch lines."""
    import fcntl
    import pty
    import struct
    import termios

    data = write_gpcm_dataset(tmp_path / "data", n_students=40, n_questions=10, seq_len_range=(10, 20), seed=1)
    config = tmp_path / "small.json"
    config.write_text(json.dumps(SMALL_MODEL))
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 0 columns: tqdm draws nothing
    with open(tmp_path / "stdout.log", "w") as out:
        proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, "train", "deep_gpcm", "--data", str(data), "--out",
                                 str(tmp_path / "artifact"), "--epochs", "2", "--config", str(config)],
                                stdout=out, stderr=terminal, text=True,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
    os.close(terminal)
    shown = b""
    while True:  # drain the terminal until the child closes it
        try:
            chunk = os.read(controller, 4096)
        except OSError:
            break
        if not chunk:
            break
        shown += chunk
    assert proc.wait(timeout=300) == 0
    os.close(controller)
    assert b"\r" in shown and b"epoch 1/2" in shown
    assert re.search(rb"epoch 1/2: +\d+%\|.*\| \d+/\d+ \[", shown), shown  # a total: the share done, time left


# -- help, an artifact already there, Ctrl-C and what it leaves --------------------------------------------------

def _subparsers(parser):
    """(name, parser) of every command and subcommand."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield name, sub
                yield from ((f"{name} {n}", p) for n, p in _subparsers(sub))


def test_help_keeps_the_command_table_and_every_argument_says_what_it_is():
    from nextstep.cli import build_parser

    parser = build_parser()
    text = parser.format_help()  # the docstring's table was reflowed into one paragraph
    assert "\n    train        train a registered family" in text and "\n    demo         train small" in text
    bare = [f"{name}: {'/'.join(action.option_strings) or action.dest}" for name, sub in _subparsers(parser)
            for action in sub._actions if not action.help and action.dest != "help" and not action.choices]
    assert bare == []


@pytest.mark.slow  # a whole training run and export
def test_force_replaces_an_artifact_only_once_the_new_one_is_complete(replaced):
    """(The replacing run is test_binary_data_gets_an_auc's: another family on other data.)"""
    out, _, before, refused, code = replaced
    assert refused == before  # without --force: nothing written
    assert code == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["family"] == "coral_gpcm" and manifest["train_config"]["epochs"] == 2
    assert manifest["parity"]["passed"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["artifact"]  # no partial or replaced folder left


def _sigint_as_in_a_terminal() -> None:
    """The child's Ctrl-C as a terminal delivers it. A test run started in the background by a shell without job
    control inherits SIGINT ignored, and Python then never raises KeyboardInterrupt: the run would go on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow  # a whole training run and export
def test_ctrl_c_mid_training_is_one_line_and_leaves_no_artifact(tmp_path):
    """Ctrl-C printed a traceback and left OUT holding checkpoint.pt and no manifest, which serve and evaluate
    then met as a broken artifact."""
    data = write_gpcm_dataset(tmp_path / "data", n_students=40, n_questions=10, seq_len_range=(10, 20), seed=1)
    config = tmp_path / "small.json"
    config.write_text(json.dumps({**SMALL_MODEL, "patience": 500}))
    models = tmp_path / "models"
    out = models / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-c", RUN_CLI, "train", "deep_gpcm", "--data", str(data), "--out",
                             str(out), "--epochs", "500", "--config", str(config)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, preexec_fn=_sigint_as_in_a_terminal)
    try:
        for line in proc.stdout:  # interrupted once an epoch has ended (the checkpoint's moment)
            if line.startswith("epoch") and int(line.split()[1]) >= 1:
                break
        proc.send_signal(signal.SIGINT)
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert err.strip() == f"nextstep train: interrupted; nothing was written to {out}", err
    assert not out.exists() and sorted(p.name for p in models.iterdir()) == []  # no partial folder either


def test_evaluate_and_serve_explain_an_unfinished_run(tmp_path, capsys):
    """A run killed before its end (no Ctrl-C to clean up) leaves its hidden .OUT.partial-PID folder."""
    artifacts = tmp_path / "artifacts"
    partial = artifacts / "deep_gpcm" / ".v1.partial-4242"
    partial.mkdir(parents=True)
    (partial / "checkpoint.pt").write_bytes(b"")
    with pytest.raises(SystemExit) as caught:
        main(["evaluate", str(artifacts / "deep_gpcm" / "v1"), "--data", str(tmp_path)])
    assert f"an unfinished training run into it is in {partial}" in str(caught.value.code)
    with pytest.raises(SystemExit, match="no artifacts under"):  # serve stops there, having said why
        main(["serve", "--artifacts", str(artifacts)])
    err = capsys.readouterr().err
    assert "not served: 1 unfinished training run (interrupted, killed or still running" in err
    assert str(partial) in err


@pytest.mark.parametrize("monitor, data_kind", [("auc", "ordinal"), ("qwk", "binary")])
def test_a_monitor_the_data_does_not_measure_is_refused_before_training(tmp_path, monitor, data_kind):
    data = tmp_path / "data"
    if data_kind == "binary":
        _write_binary(data)
    else:
        write_gpcm_dataset(data, n_students=20, n_questions=5, seq_len_range=(5, 8), seed=1)
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**SMALL_MODEL, "monitor": monitor}))
    out = tmp_path / "never"
    with pytest.raises(SystemExit) as caught:
        main(["train", "deep_gpcm", "--data", str(data), "--out", str(out), "--config", str(config), "--quiet"])
    assert f"monitor {monitor!r} is not measured on data with" in str(caught.value.code)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "data"]


# -- data that is one file, a train file alone or too few learners; malformed files ---------------------------------

def _long_csv(path: Path, learners: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = "".join(f"u{i},q{t % 4},{(i + t) % 2},{t}\n" for i in range(learners) for t in range(6))
    path.write_bytes(gzip.compress(("user_id,item_id,correct,time\n" + rows).encode()))
    return path


@pytest.mark.parametrize("layout", ["a file", "a train file alone"])
def test_train_reads_one_file_split_by_learner_saying_so(tmp_path, capsys, layout):
    """`train --data FILE.csv.gz` said "data set directory not found" (the help says a file is taken), and what
    `events export --test-fraction 0` writes, a train file alone, could not be trained on. (A monitor the data does
    not measure stops the run once the data is read, before any training.)"""
    data = _long_csv(tmp_path / "export" / "m_train.csv.gz", 40)
    why = "one data file" if layout == "a file" else "no *test* file beside m_train.csv.gz"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"monitor": "qwk"}))
    with pytest.raises(SystemExit) as caught:
        main(["train", "dkt", "--data", str(data if layout == "a file" else data.parent), "--out",
              str(tmp_path / "never"), "--config", str(config), "--quiet"])
    assert f"monitor 'qwk' is not measured on data with 2 response categories ({data})" in str(caught.value.code)
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("data: ")]
    assert line.startswith(f"data: {data} read as long_csv (gzip): ") and line.endswith(
        f"; {why}: the learners whose id hashes into 20% of buckets are the test learners")


def test_too_few_training_learners_say_what_is_short_and_what_to_do(tmp_path):
    """A split of 4 training learners and 1 test learner said "need both" with no hint; 4 now train (one of them
    validates), 1 is refused saying why."""
    _long_csv(tmp_path / "data" / "x_train.csv.gz", 1)
    _long_csv(tmp_path / "data" / "x_test.csv.gz", 1)
    with pytest.raises(SystemExit) as caught:
        main(["train", "dkt", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "never"), "--quiet"])
    assert str(caught.value.code) == (f"nextstep train: {tmp_path / 'data' / 'x_train.csv.gz'}: 1 training learner, "
                                      "and training needs at least 2: one to fit, one to validate on for early "
                                      "stopping; give more learners (NEXTSTEP_TRACEBACK=1 shows where it was raised)")


def test_a_malformed_data_file_is_one_line_naming_the_file_line_and_column(tmp_path):
    """Bytes that are not UTF-8 named neither file nor line; a 10 MB field was a `_csv.Error` traceback."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "x_train.csv").write_bytes(b"user_id,item_id,correct,time\nu,q1,1,1\nu,q\xff,0,2\n")
    (data / "x_test.csv").write_text("user_id,item_id,correct,time\nv,q1,1,1\n")
    with pytest.raises(SystemExit) as caught:
        main(["train", "dkt", "--data", str(data), "--out", str(tmp_path / "never"), "--quiet"])
    assert str(caught.value.code).startswith(f"nextstep train: {data / 'x_train.csv'}:3: expected UTF-8 text, got "
                                             "b'\\xff' (byte 4 of the line; save the file as UTF-8)")
    (data / "x_train.csv").write_text("user_id,item_id,correct,time\nu,q1,1,1\nu," + "q" * 200_000 + ",0,2\n")
    with pytest.raises(SystemExit) as caught:
        main(["train", "dkt", "--data", str(data), "--out", str(tmp_path / "never"), "--quiet"])
    message = str(caught.value.code)
    assert message.startswith(f"nextstep train: {data / 'x_train.csv'}:3: expected fields of at most 131,072 "
                              "characters (column 'item_id')") and "\n" not in message


@pytest.mark.parametrize("metrics, first", [
    ({"valid": {"recall@20": 0.5, "mrr@20": 0.25}, "baseline": {"name": "popularity", "recall@20": 0.125}},
     "valid: recall@20 0.5000 (popularity 0.1250)  mrr@20 0.2500"),
    ({"test": {"log_loss": 0.3, "baselines": {"fsrs6": {"log_loss": 0.31}}}}, "test: log_loss 0.3000 (FSRS-6 0.3100)"),
    ({"test": {"skipped": "cross_validate is false: evaluate on other users (nextstep evaluate)"}},
     "test: cross_validate is false: evaluate on other users (nextstep evaluate)"),
])
def test_the_train_summary_of_each_task(metrics, first):
    from nextstep.cli import _train_summary

    lines = _train_summary(Path("artifacts/m/3"), {"metrics": metrics}, 75)
    assert lines == [first, "artifact: artifacts/m/3 (the run took 1 min 15 s)",
                     "serve it: nextstep serve --artifacts artifacts (every MODEL/VERSION folder under it: this one is "
                     "model 'm', version '3')"]
