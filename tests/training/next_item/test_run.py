"""A next-item run end to end on a small generated data set: train, evaluate, export, re-measure, CLI."""

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch

from nextstep.cli import main
from nextstep.training.next_item.gru4rec_loop import GRU4RecTrainConfig
from nextstep.training.next_item.run import evaluate_next_item, load_next_item, train_next_item
from nextstep.training.next_item.sessions import subset, write_gru4rec_tsv, zipf_sessions

pytestmark = pytest.mark.slow  # whole next-item runs for every family (make test-all)

KEYS = ("recall@1", "recall@5", "recall@10", "recall@20", "mrr@20", "ndcg@20")


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("sessions")
    data = zipf_sessions(300, 60, (2, 9), follow=0.7, seed=0)
    train, test = subset(data, np.arange(250)), subset(data, np.arange(250, 300))
    write_gru4rec_tsv(train, d / "demo_train_full.txt")
    write_gru4rec_tsv(test, d / "demo_test.txt")
    write_gru4rec_tsv(subset(train, np.arange(200)), d / "demo_train_tr.txt")
    write_gru4rec_tsv(subset(train, np.arange(200, 250)), d / "demo_train_valid.txt")
    return d


@pytest.fixture(scope="module")
def artifacts(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("artifacts")
    cfg = GRU4RecTrainConfig(epochs=2, n_sample=16, model={"layers": (12,)})
    return {name: (out / name, train_next_item(name, data_dir, out / name, cfg=cfg if name == "gru4rec" else None,
                                               progress=False, log=False, top_k=10))
            for name in ("gru4rec", "popularity", "markov")}


@pytest.mark.parametrize("name", ["gru4rec", "popularity", "markov"])
def test_artifact_has_graphs_metrics_and_passed_parity(artifacts, data_dir, name):
    out, manifest = artifacts[name]
    assert manifest["task"] == "next_item" and manifest["family"] == name and manifest["top_k"] == 10
    assert manifest["parity"]["passed"] and manifest["parity"]["bad_rows"] == 0
    for f in ("step.onnx", "recommend.onnx", "step_recommend.onnx", "step.pt", "recommend.pt", "weights.pt",
              "vocab_items.json", "manifest.json"):
        assert (out / f).exists(), f
    test = manifest["metrics"]["test"]
    assert all(0 <= test[k] <= 1 for k in KEYS)
    assert manifest["data"]["split"] == "test" and manifest["data"]["eval_file"].endswith("demo_test.txt")
    again = evaluate_next_item(out, data_dir)
    assert all(again[k] == pytest.approx(test[k]) for k in KEYS)  # re-measured from the saved artifact


def test_onnx_runtime_serves_the_offline_models_top_k(artifacts):
    out, manifest = artifacts["gru4rec"]
    model, vocab, _ = load_next_item(out)
    session = ort.InferenceSession(str(out / "step_recommend.onnx"), providers=["CPUExecutionProvider"])
    raw = vocab.ids[:5]
    rows = vocab.encode(np.array(raw))
    state = {s["name"]: np.load(out / s["file"])[None] for s in manifest["state"]}
    for t, row in enumerate(rows):
        feeds = {**state, "item": np.array([row]), "exclude": rows[None, :t + 1]}
        *new_state, top, scores = session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})
        state = dict(zip(state, new_state, strict=True))
    with torch.no_grad():
        offline = model(torch.from_numpy(rows)[None])[0, -1]
    offline[:2] = -np.inf
    offline[torch.from_numpy(rows)] = -np.inf
    expected = torch.topk(offline, 10)
    np.testing.assert_allclose(scores[0], expected.values.numpy(), atol=1e-5)
    assert set(top[0].tolist()) == set(expected.indices.tolist())


def test_gru4rec_beats_popularity_on_data_with_sequential_signal(artifacts):
    recall = {n: artifacts[n][1]["metrics"]["test"]["recall@5"] for n in artifacts}
    assert recall["gru4rec"] > recall["popularity"] and recall["markov"] > recall["popularity"]


def test_valid_flag_never_reads_the_test_file(data_dir, tmp_path):
    manifest = train_next_item("popularity", data_dir, tmp_path / "p", valid=True, progress=False, log=False)
    assert manifest["data"]["split"] == "valid" and "valid" in manifest["metrics"] and "test" not in manifest["metrics"]
    assert manifest["data"]["train_file"].endswith("demo_train_tr.txt")
    assert manifest["data"]["eval_file"].endswith("demo_train_valid.txt")


def test_cli_trains_and_evaluates_next_item_models(data_dir, tmp_path, capsys):
    assert main(["train", "markov", "--data", str(data_dir), "--out", str(tmp_path / "m"), "--quiet", "--json",
                 str(tmp_path / "m.json")]) == 0
    printed = json.loads((tmp_path / "m.json").read_text())
    assert set(KEYS) <= set(printed["metrics"]["test"])
    # the log's data line, and the summary: the model's metrics next to popularity's (counted, not trained)
    lines = capsys.readouterr().out.splitlines()
    test, baseline = printed["metrics"]["test"], printed["metrics"]["baseline"]
    assert lines[0].startswith(f"data: {data_dir / 'demo_train_full.txt'} and {data_dir / 'demo_test.txt'}: ")
    assert lines[-3] == (f"test: recall@20 {test['recall@20']:.4f} (popularity {baseline['recall@20']:.4f})  mrr@20 "
                         f"{test['mrr@20']:.4f} (popularity {baseline['mrr@20']:.4f})")
    assert main(["evaluate", str(tmp_path / "m"), "--data", str(data_dir)]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["recall@20"] == pytest.approx(printed["metrics"]["test"]["recall@20"])
    with pytest.raises(SystemExit, match="does not apply"):
        main(["train", "markov", "--data", str(data_dir), "--out", str(tmp_path / "x"), "--loss", "bpr"])
    with pytest.raises(SystemExit, match="loss must be one of"):
        main(["train", "gru4rec", "--data", str(data_dir), "--out", str(tmp_path / "y"), "--loss", "top1"])


def test_a_test_file_with_nothing_to_score_is_refused_before_training(data_dir, tmp_path):
    data = zipf_sessions(40, 20, (2, 5), seed=1)
    odd = tmp_path / "odd"
    odd.mkdir()
    write_gru4rec_tsv(data, odd / "x_train_full.txt")
    (odd / "x_test.txt").write_text("SessionId\tItemId\tTime\n1\t999\t1\n1\t998\t2\n2\t5\t3\n")  # unseen items
    with pytest.raises(ValueError, match="x_test.txt: no session there has two clicks on items the training"):
        train_next_item("gru4rec", odd, tmp_path / "never", progress=False, log=False)
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("config", [{"constrained_embedding": False, "embedding": 0},
                                    {"constrained_embedding": False, "embedding": 8, "layers": (8, 6)},
                                    {"dropout_embed": 0.2, "dropout_hidden": 0.3}])
def test_every_gru4rec_input_mode_exports_with_parity(config, tmp_path):
    from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
    from nextstep.training.next_item.export import export_next_item

    torch.manual_seed(0)
    model = GRU4Rec(GRU4RecConfig(n_items=30, **{"layers": (8,), **config}))
    manifest = export_next_item(model, tmp_path, manifest={"name": "x", "version": "1", "created": "now"},
                                vocab_json={"ids": list(range(28))}, parity_sessions=torch.randint(2, 30, (4, 6)),
                                top_k=10)
    assert manifest["parity"]["passed"] and len(manifest["state"]) == len(model.cfg.layers)


def test_parity_check_fails_on_an_engine_that_returns_the_wrong_top_k(tmp_path):
    from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
    from nextstep.training.export import check_parity, onnx_session
    from nextstep.training.next_item.export import NextItemExporter, export_next_item

    torch.manual_seed(0)
    model = GRU4Rec(GRU4RecConfig(n_items=30, layers=(8,))).eval()
    sessions = torch.randint(2, 30, (4, 6))
    export_next_item(model, tmp_path, manifest={"name": "x", "version": "1", "created": "now"},
                     vocab_json={"ids": list(range(28))}, parity_sessions=sessions, top_k=5)
    exporter = NextItemExporter(model, {}, top_k=5)
    graphs = exporter.graphs((sessions,))
    scripted = {n: torch.jit.load(str(tmp_path / f"{n}.pt")) for n in ("step", "recommend")}
    onnx = {n: onnx_session(tmp_path / f"{n}.onnx") for n in ("step", "recommend", "step_recommend")}

    def worst(*inputs):  # the k lowest rows, each with its true score: consistent, but not the top k
        *state, exclude = inputs
        scores = model.scores(tuple(state))
        values, rows = torch.topk(scores[:, 2:], 5, largest=False)
        return rows + 2, values

    engines = {"torchscript": scripted, "onnxruntime": onnx}
    assert check_parity(exporter, graphs, engines, (sessions,))["passed"]
    bad = check_parity(exporter, graphs, {**engines, "torchscript": {**scripted, "recommend": worst}}, (sessions,))
    assert not bad["passed"] and bad["eager_vs_torchscript"] > 1e-3


def test_reexport_from_weights_writes_the_same_artifact(artifacts, tmp_path):
    from nextstep.training.export import reexport
    from nextstep.training.families import restore
    from nextstep.training.next_item.export import NextItemExporter

    out, manifest = artifacts["gru4rec"]
    manifest = json.loads(json.dumps(manifest))
    reexport(out, tmp_path, NextItemExporter, restore)
    again = json.loads((tmp_path / "manifest.json").read_text())
    assert again["parity"]["passed"] and again["parity"]["bad_rows"] == 0
    for key in ("name", "version", "task", "family", "model_config", "top_k", "vocabularies", "metrics", "graphs",
                "state"):
        assert again[key] == manifest[key], key
    assert (tmp_path / "vocab_items.json").read_text() == (out / "vocab_items.json").read_text()
