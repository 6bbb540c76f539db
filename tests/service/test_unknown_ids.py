"""Questions and items added after training (issue 37 part 6): with the default setting an id the model never saw is
answered through the version's unknown row, trained for it, flagged `"known": false` and counted in
nextstep_unknown_ids_total; NEXTSTEP_UNKNOWN_QUESTIONS=error keeps the 422 naming the field, and so does a version
trained before the row existed (a copy of the demo artifact without its manifest's unknown section). The log keeps
the id as the app sent it, so a version that knows it rebuilds the learner's state through its own row. Real
training (tiny), real ONNX Runtime, real HTTP, a real Redis; the fast tests use the tiny models every test run
trains (tests/conftest.py, test_sessions_api.py)."""

import json
import re
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

import nextstep
from nextstep.service.settings import Settings
from nextstep.training.kt.loop import TrainConfig
from nextstep.training.kt.run import load_model, train_model
from nextstep.training.kt.synthetic import write_gpcm_dataset
from nextstep.training.next_item.run import load_next_item

DEMO = Path(nextstep.__file__).parent / "demo_artifacts"
TINY = {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8, "irt_init": False}


def unknown_count(http: httpx.Client, model: str, version: str, task: str) -> float:
    text = http.get("/metrics").text
    found = re.search(rf'nextstep_unknown_ids_total{{model="{model}",task="{task}",version="{version}"}} (\S+)', text)
    return float(found.group(1)) if found else 0.0


def test_an_unknown_question_is_answered_by_the_trained_row(artifacts, redis_url, serve):
    """The run's tiny deep_gpcm (tests/conftest.py), trained with the default unknown row."""
    art, _ = artifacts
    model, vocab, manifest = load_model(art / "deep_gpcm" / "v1")
    assert manifest["unknown"]["answers"] and manifest["unknown"]["interactions"] > 0
    events = [{"question_id": "3", "response": 2, "event_id": "a"}, {"question_id": "new-q", "response": 0,
                                                                      "event_id": "b"}]
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        before = unknown_count(http, "deep_gpcm", "v1", "knowledge_tracing")
        reply = http.post("/v1/kt/deep_gpcm/events", json={"student_id": "s", "events": events,
                                                           "predict_question_ids": ["new-q", "3"]})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["events_absorbed"] == 2 and body["unknown_question_ids"] == ["new-q"]
        assert body["predictions"][0]["known"] is False and "known" not in body["predictions"][1]
        # what the PyTorch model gives with the unknown id at row 1, stepped over the same events
        with torch.no_grad():
            q = torch.tensor([[vocab.encode(np.array([3]))[0], 1, 1]])
            expected = model(q, torch.tensor([[2, 0, 0]])).log_probs.exp()[0, 2].numpy()
        np.testing.assert_allclose(body["predictions"][0]["probabilities"], expected, atol=1e-5)
        # a replay is not counted again; the event (1) and the predicted question (1) were
        http.post("/v1/kt/deep_gpcm/events", json={"student_id": "s", "events": events})
        assert unknown_count(http, "deep_gpcm", "v1", "knowledge_tracing") == before + 2
        predicted = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": ["new-q"]}).json()
        assert predicted["predictions"][0]["known"] is False
        ranked = http.post("/v1/kt/deep_gpcm/next-item", json={"student_id": "s", "candidate_question_ids":
                                                               ["3", "new-q"], "k": 2}).json()
        assert {i["question_id"]: i.get("known", True) for i in ranked["items"]} == {"3": True, "new-q": False}
        batch = http.post("/v1/kt/deep_gpcm/batch", json={"students": [{"student_id": "x", "events": events}]})
        assert [p.get("known", True) for p in batch.json()["students"][0]["event_predictions"]] == [True, False]
        assert unknown_count(http, "deep_gpcm", "v1", "knowledge_tracing") == before + 5


def test_error_mode_and_an_untrained_row_keep_the_422(artifacts, rec_artifacts, redis_url, serve, tmp_path):
    root = tmp_path / "a"
    root.mkdir()
    (root / "deep_gpcm").symlink_to(artifacts[0] / "deep_gpcm", target_is_directory=True)
    (root / "gru4rec").symlink_to(rec_artifacts / "gru4rec", target_is_directory=True)
    old = root / "old_gpcm" / "1"
    shutil.copytree(DEMO / "deep_gpcm" / "demo", old)  # as if trained before the unknown row: no `unknown` section
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.pop("unknown", None)
    (old / "manifest.json").write_text(json.dumps(manifest))
    body = {"student_id": "s", "events": [{"question_id": "3", "response": 1}, {"question_id": "new-q",
                                                                                 "response": 0}]}
    with serve(Settings(artifacts_dir=root, redis_url=redis_url, unknown_questions="error")) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/kt/deep_gpcm/events", json=body)
        assert reply.status_code == 422 and reply.json()["field"] == "events[1].question_id", reply.text
        assert "NEXTSTEP_UNKNOWN_QUESTIONS=error" in reply.json()["detail"]
        reply = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": ["3", "new-q"]})
        assert reply.status_code == 422 and reply.json()["field"] == "question_ids[1]"
        known = load_next_item(rec_artifacts / "gru4rec" / "1")[1].ids[0]
        clicks = {"session_id": "v", "events": [{"item_id": known}, {"item_id": "no-such-item"}]}
        reply = http.post("/v1/sessions/gru4rec/events", json=clicks)
        assert reply.status_code == 422 and reply.json()["field"] == "events[1].item_id"
        assert http.get("/v1/kt/deep_gpcm/students/s").json()["events_total"] == 0  # nothing was applied
        assert http.get("/v1/sessions/gru4rec/v").json()["events_total"] == 0
    with serve(Settings(artifacts_dir=root, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        reply = http.post("/v1/kt/old_gpcm/events", json={"student_id": "s", "events": [
            {"question_id": "no-such-question", "response": 1}]})
        assert reply.status_code == 422 and reply.json()["field"] == "events[0].question_id"
        assert "trained without an unknown-question row" in reply.json()["detail"]


def test_an_unknown_item_in_a_session(rec_artifacts, redis_url, serve):
    """The run's tiny GRU4Rec (tests/service/conftest.py), trained with the default unknown row."""
    vocab, manifest = load_next_item(rec_artifacts / "gru4rec" / "1")[1:]
    assert manifest["unknown"]["answers"]
    known = str(vocab.ids[0])
    clicks = [{"item_id": known, "event_id": "c1"}, {"item_id": "no-such-item", "event_id": "c2"}]
    with serve(Settings(artifacts_dir=rec_artifacts, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        before = unknown_count(http, "gru4rec", "1", "next_item")
        reply = http.post("/v1/sessions/gru4rec/events", json={"session_id": "v", "events": clicks, "recommend_k": 30})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["events_absorbed"] == 2 and body["unknown_item_ids"] == ["no-such-item"]
        items = [i["item_id"] for i in body["recommendations"]]
        assert len(items) == 30 and "no-such-item" not in items and known not in items  # (known was seen)
        assert set(items) <= {str(i) for i in vocab.ids}
        assert unknown_count(http, "gru4rec", "1", "next_item") == before + 1
        summary = http.get("/v1/sessions/gru4rec/v").json()
        assert summary["events_total"] == 2 and summary["recent_items"] == [known]  # the unknown row is no item
        skipped = http.post("/v1/sessions/gru4rec/events", json={"session_id": "w", "events": clicks,
                                                                 "unknown_items": "skip"}).json()
        assert skipped["events_absorbed"] == 1 and skipped["unknown_items_skipped"] == 1
        refused = http.post("/v1/sessions/gru4rec/batch", json={"sessions": [{"item_ids": [known, "no-such-item"]}],
                                                                "unknown_items": "error"})
        assert refused.status_code == 422 and refused.json()["field"] == "sessions[0].item_ids[1]"
        batch = http.post("/v1/sessions/gru4rec/batch", json={"sessions": [{"item_ids": [known, "no-such-item"]}]})
        assert batch.json()["sessions"][0]["unknown_item_ids"] == ["no-such-item"]


@pytest.fixture(scope="module")
def two_versions(tmp_path_factory) -> Path:
    """deep_gpcm trained on questions 0..11 (version 1) and on 0..12 (version 2), each with its unknown row."""
    root = tmp_path_factory.mktemp("unknown")
    for version, n_questions in (("1", 12), ("2", 13)):
        data = write_gpcm_dataset(root / f"data{version}", n_students=30, n_questions=n_questions,
                                  seq_len_range=(8, 12), n_cats=2, seed=3)
        manifest = train_model("deep_gpcm", data, root / "deep_gpcm" / version,
                               cfg=TrainConfig(epochs=1, model=TINY, unknown_share=0.1), progress=False, log=False)
        assert manifest["parity"]["passed"] and manifest["unknown"]["answers"]
    return root


@pytest.mark.slow  # trains two models
def test_a_version_that_knows_the_id_rebuilds_through_its_own_row(two_versions, redis_url, serve, tmp_path):
    """Version 1 never saw question 12 and steps it through the unknown row; the log keeps "12", so version 2, which
    knows it, rebuilds the learner from the log through row 12's own embedding: the same as stepping it live."""
    shutil.copytree(two_versions / "deep_gpcm" / "1", tmp_path / "a" / "deep_gpcm" / "1")
    events = [{"question_id": q, "response": r, "event_id": f"e{i}"}
              for i, (q, r) in enumerate([("3", 1), ("12", 0), ("7", 1), ("12", 1)])]
    with serve(Settings(artifacts_dir=tmp_path / "a", redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        first = http.post("/v1/kt/deep_gpcm/events", json={"student_id": "ada", "events": events}).json()
        assert first["unknown_question_ids"] == ["12"]
        shutil.copytree(two_versions / "deep_gpcm" / "2", tmp_path / "a" / "deep_gpcm" / "2")
        assert http.post("/v1/models/reload").status_code == 200
        rebuilt = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": ["12", "3"]})
        body = rebuilt.json()
        assert body["version"] == "2" and body["rebuilt_from_events"] == 4, body
        assert all("known" not in p for p in body["predictions"])
        live = http.post("/v1/kt/deep_gpcm/events", json={"student_id": "bob", "events": events,
                                                          "predict_question_ids": ["12", "3"]}).json()
        assert "unknown_question_ids" not in live
        np.testing.assert_allclose([p["probabilities"] for p in body["predictions"]],
                                   [p["probabilities"] for p in live["predictions"]], atol=1e-5)
        manifest = json.loads((tmp_path / "a" / "deep_gpcm" / "2" / "manifest.json").read_text())
        assert manifest["unknown"]["min_count"] == 5
