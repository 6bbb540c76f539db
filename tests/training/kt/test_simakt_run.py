import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from nextstep.cli import main
from nextstep.training.data import Vocabulary
from nextstep.training.kt.banks import build_banks, load_banks
from nextstep.training.kt.data import load_dataset
from nextstep.training.kt.simakt_ablation import table
from nextstep.training.kt.simakt_export import load_simakt
from nextstep.training.kt.simakt_run import (
    build_artifact_banks,
    build_vocab,
    encode_questions,
    split_folds,
    trajectories,
    vocab_json,
    vocab_tables,
)

pytestmark = pytest.mark.slow  # whole SimAKT runs with banks (make test-all)


@pytest.fixture(scope="module")
def run(simakt_trained, tmp_path_factory):
    """(data, artifact, manifest): conftest's trained SimAKT, copied (a test rebuilds banks, rewrites the data)."""
    root = tmp_path_factory.mktemp("simakt")
    shutil.copytree(simakt_trained, root, dirs_exist_ok=True)
    out = root / "artifact"
    return root / "data", out, json.loads((out / "manifest.json").read_text())


def test_a_run_reports_binary_test_metrics_and_exports_with_parity(run):
    _, out, manifest = run
    test = manifest["metrics"]["test"]
    assert {"auc", "accuracy", "nll"} <= set(test) and 0.5 < test["auc"] <= 1 and test["nll"] > 0
    parity = manifest["parity"]
    assert parity["passed"] and parity["steps"] == 32 + 16 + 8  # past both caches' first restart
    assert parity["full_vs_step"] <= parity["step_tolerance"] and parity["eager_vs_onnxruntime"] <= 1e-4
    assert set(manifest["graphs"]) == {"step", "predict", "step_predict", "rebase", "bank_project"}
    banks = ["bank_cluster_keys", "bank_cluster_values", "bank_knn_keys", "bank_knn_values"]
    peers = [f"bank_peers_{p}" for p in ("keys", "responses", "expected", "first", "count", "mean")]
    for graph in ("step", "rebase"):  # block 3 reads its banks when a row is added; the answer head's: only answers
        assert [i["name"] for i in manifest["graphs"][graph]["inputs"]][-4:] == banks, graph
    for graph in ("predict", "step_predict"):
        assert [i["name"] for i in manifest["graphs"][graph]["inputs"]][-10:] == banks + peers, graph
    assert manifest["banks"]["answer_heads"] == ["peers"] and manifest["banks"]["answer_inputs"] == peers
    assert (out / "banks" / manifest["banks"]["default"] / "provenance.json").exists()


def test_answer_heads_are_refitted_on_validation_students_and_nothing_else_moves(run):
    """The manifest keeps the cross-fitted estimate that decided the refit, its log loss and the test figures
    before it; a refit moves only the answer head's output map and temperature, and is kept only where the
    estimate says it pays (checked by refitting a copy whose map was spoiled, then the refitted one again)."""
    from nextstep.training.kt.simakt_run import refit_answer_heads, sequences

    data, out, manifest = run
    refit = manifest["metrics"]["answer_refit"]
    assert refit["nll_after"] <= refit["nll_before"] and refit["interactions"] > 0
    assert refit["applied"] == (refit["crossfit"]["auc_refit"] > refit["crossfit"]["auc_end_to_end"])
    assert 0.5 < refit["test_end_to_end"]["auc"] <= 1
    model, _ = load_simakt(out)
    train, _ = load_dataset(data)
    vocab = Vocabulary.from_json(json.loads((out / "vocab_questions.json").read_text()))
    trajs, ids = trajectories(train, vocab, model.cfg.window)
    with torch.no_grad():
        model.answerers[0].mix.weight.copy_(torch.tensor([[-3.0, 0, -3.0, 0, 0]]))  # reads the peers backwards
    before = {k: v.clone() for k, v in model.state_dict().items()}
    held = {s.student_id for s in train.sequences[:20]}
    others = [i for i, sid in enumerate(ids) if sid not in held]  # the bank holds none of the refit's students
    bank = build_banks(model, [trajs[i] for i in others], [ids[i] for i in others])
    again = refit_answer_heads(model, sequences(train, vocab)[:20], bank)
    assert again["applied"] and again["crossfit"]["auc_refit"] > again["crossfit"]["auc_end_to_end"]
    assert again["nll_after"] < again["nll_before"]
    assert again["maps"]["peers"]["mix"] == pytest.approx(model.answerers[0].mix.weight.flatten().tolist(), abs=1e-6)
    assert again["maps"]["peers"]["temperature"] == pytest.approx(model.answerers[0].temperature().item(), rel=1e-5)
    moved = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    assert moved <= {"answer_heads.peers.mix.weight", "answer_heads.peers.mix.bias",
                     "answer_heads.peers.log_temperature"} and "answer_heads.peers.mix.weight" in moved
    refitted = {k: v.clone() for k, v in model.state_dict().items()}
    third = refit_answer_heads(model, sequences(train, vocab)[:20], bank)
    if not third["applied"]:  # not applied: nothing moves, the loss is the one it had
        assert all(torch.equal(v, refitted[k]) for k, v in model.state_dict().items())
        assert third["nll_after"] == third["nll_before"]


def test_banks_hold_training_students_only(run):
    data, out, manifest = run
    model, _ = load_simakt(out)
    prov = json.loads((out / "banks" / manifest["banks"]["default"] / "provenance.json").read_text())
    knn = next(b for b in prov["banks"] if b["type"] == "knn")
    sources = {s for entry in knn["sources"] for s in entry}
    assert sources and all(s.startswith("train:") for s in sources)  # student ids are "<file stem>:<index>"
    train, test = load_dataset(data)
    assert prov["n_students"] == len(train)  # every training student (fit and validation), nothing else
    # `banks build` never opens the test file: it works with the test file unreadable, and a test
    # student's trajectory cannot change a bank
    original = (data / "test.txt").read_bytes()
    (data / "test.txt").write_text("not a data file")
    try:
        built = build_artifact_banks(out, data, version="rebuilt", seed=3)
    finally:
        (data / "test.txt").write_bytes(original)
    assert built["students"] == len(train)
    vocab = Vocabulary.from_json(json.loads((out / "vocab_questions.json").read_text()))
    trajs, ids = trajectories(train, vocab, model.cfg.window)
    test_trajs, test_ids = trajectories(test, vocab, model.cfg.window)
    a = build_banks(model, trajs, ids, seed=3)
    b = build_banks(model, trajs, ids, seed=3)
    rebuilt = load_banks(out / "banks" / "rebuilt", model)
    arrays = lambda bank: [bank.states] if hasattr(bank, "states") else list(bank.parts.values())  # noqa: E731
    for x, y, z in zip(a, b, rebuilt, strict=True):
        assert all(np.array_equal(u, v) for u, v in zip(arrays(x), arrays(y), strict=True))
        assert all(np.allclose(u, v, atol=1e-6) for u, v in zip(arrays(x), arrays(z), strict=True))
    peers = next(e for e in prov["banks"] if e["head"] == "peers")
    assert peers["stage"] == "answer" and peers["students"] == len(train)
    with_test = build_banks(model, trajs + test_trajs, ids + test_ids, seed=3)
    assert any(any(s.startswith("test:") for s in src) for bank in with_test[:2] for src in bank.sources)  # can fail
    assert with_test[2].students == sorted(set(ids + test_ids)) and a[2].students == sorted(set(ids))
    with pytest.raises(FileExistsError):
        build_artifact_banks(out, data, version="rebuilt")


def test_evaluate_rescores_the_artifact_with_its_banks(run, capsys):
    data, out, manifest = run
    assert main(["evaluate", str(out), "--data", str(data)]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["auc"] == pytest.approx(manifest["metrics"]["test"]["auc"], abs=1e-6)
    assert result["bank_version"] == manifest["banks"]["default"]


@pytest.mark.parametrize("k", [2, 3, 5])
def test_cross_fitting_folds_split_by_student(k):
    ids = [f"s{i % 7}" for i in range(40)]
    folds = split_folds(ids, np.random.default_rng(0), k)
    assert len(folds) == k and sorted(sum(folds, [])) == list(range(40)) and all(folds)
    for a in range(k):
        for b in range(a):
            assert not {ids[i] for i in folds[a]} & {ids[i] for i in folds[b]}


def test_vocabulary_pairs_fall_back_to_the_skill():
    train, _ = load_dataset_from_lines(["3", "10,11,20", "1,1,2", "1,0,1"])
    vocab = build_vocab(train)
    assert vocab.ids == ["10:1", "11:1", "20:2", "1", "2"]
    rows = encode_questions(vocab, np.array([1, 2, 1, 9]), np.array([10, 99, 12, 10]))
    assert rows.tolist() == [2, 6, 5, 1]  # the pair; skill 2 alone; skill 1 alone; unknown skill
    skill, problem = vocab_tables(vocab)
    assert skill.tolist() == [0, 1, 2, 2, 3, 2, 3] and problem.tolist() == [0, 1, 2, 3, 4, 1, 1]
    written = json.loads(json.dumps(vocab_json(vocab, problems=True)))  # the artifact's vocab_questions.json
    assert written == {"ids": vocab.ids, "skills": [1, 2], "problems": [10, 11, 20],
                       "pairs": [[10, 1], [11, 1], [20, 2]]}
    assert Vocabulary.from_json(written) == vocab


def load_dataset_from_lines(lines, tmp=Path("/tmp")):
    import tempfile

    d = Path(tempfile.mkdtemp(dir=tmp))
    (d / "train.txt").write_text("\n".join(lines) + "\n")
    (d / "test.txt").write_text("\n".join(lines) + "\n")
    return load_dataset(d)


def test_cli_refuses_a_bad_similarity_file(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"intra_heads": 5, "inter_heads": [{"type": "cluster"}, {"type": "knn"}]}))
    with pytest.raises(SystemExit, match="intra_heads: 5 intra-student"):
        main(["train", "simakt", "--data", str(tmp_path), "--similarity-config", str(bad)])
    bad.write_text("intra_heads: 7\ninter_heads:\n  - type: knn\n    influence_weight: -2\n")
    yaml_file = tmp_path / "bad.yaml"
    bad.rename(yaml_file)
    with pytest.raises(SystemExit, match=r"inter_heads\[0\].influence_weight"):
        main(["train", "simakt", "--data", str(tmp_path), "--similarity-config", str(yaml_file)])
    (tmp_path / "train.json").write_text(json.dumps({"bank_folds": 1}))
    with pytest.raises(SystemExit, match="bank_folds"):
        main(["train", "simakt", "--data", str(tmp_path), "--config", str(tmp_path / "train.json")])


def test_ablation_table():
    rows = [{"config": "none", "test": {"auc": a, "accuracy": 0.7, "nll": 0.5}, "seconds": 10} for a in (0.8, 0.82)]
    text = table(rows)
    assert "| none | 2 | 0.8100 (0.8000-0.8200) | 0.7000 (0.7000-0.7000) |" in text
