"""The model registry on real trained artifacts: loading, "latest", id mapping, state bytes, broken
artifacts, and reloads that never pull a model from under a request."""

import json
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from nextstep.service.errors import UnknownId, UnknownModel
from nextstep.service.registry import ArtifactError, LoadedModel, ModelRegistry


def edit_manifest(artifact: Path, **changes) -> dict:
    manifest = json.loads((artifact / "manifest.json").read_text())
    manifest.update(changes)
    (artifact / "manifest.json").write_text(json.dumps(manifest))
    return manifest


@pytest.fixture(scope="module")
def registry(artifact_tree) -> ModelRegistry:
    registry = ModelRegistry(artifact_tree)
    assert registry.load() == {}
    return registry


@pytest.fixture
def scratch(artifact_tree, tmp_path) -> Path:
    """A private copy of the artifacts tree that a test may break."""
    shutil.copytree(artifact_tree, tmp_path / "artifacts", ignore=shutil.ignore_patterns("report", "*.pt"))
    return tmp_path / "artifacts"


def replay(model: LoadedModel, events: list[tuple[str, int]], ask: list[str]) -> list[np.ndarray]:
    """Fold events into a fresh state through the step_predict graph; return its last outputs."""
    state = {k: v[None] for k, v in model.initial_state.items()}
    outputs = []
    for qid, response in events:
        feeds = {**state, "question": model.index([qid], "question"), "response": np.array([response]),
                 "questions": model.index(ask, "questions")[None]}
        outputs = model.sessions["step_predict"].run(None, {n: feeds[n] for n in model.input_names["step_predict"]})
        state = dict(zip(state, outputs[:len(state)], strict=True))
    return outputs


def test_loads_every_artifact(registry):
    assert [(m.name, m.version) for m in registry.models()] == [
        ("attention_gpcm", "1"), ("deep_gpcm", "1"), ("deep_gpcm", "2")]
    assert registry.errors == {}
    attention = registry.get("attention_gpcm", "1")
    assert attention.family == "attention_gpcm" and attention.task == "knowledge_tracing" and attention.n_cats == 4
    assert [s["name"] for s in attention.state_spec] == ["value_memory", "attention_window", "interaction_count"]
    assert set(attention.sessions) == {"step", "predict", "step_predict"}
    assert attention.input_names["step_predict"] == [
        "value_memory", "attention_window", "interaction_count", "question", "response", "questions"]
    assert attention.ids == [str(i) for i in range(12)]
    for s in attention.state_spec:
        value = attention.initial_state[s["name"]]
        assert list(value.shape) == s["shape"] and value.dtype == np.dtype(s["dtype"])
        assert not value.flags.writeable
    assert attention.state_nbytes == 4 * 8 * 4 + 2 * 4 * 8 * 4 + 8


def test_latest_is_the_newest_created_then_the_highest_version(registry, scratch):
    assert registry.get("deep_gpcm").version == "2"  # created in 2999
    assert registry.get("deep_gpcm", "1").version == "1"
    assert registry.get("attention_gpcm").version == "1"
    # a tie on "created" goes to the higher version string
    created = json.loads((scratch / "deep_gpcm" / "2" / "manifest.json").read_text())["created"]
    shutil.copytree(scratch / "deep_gpcm" / "2", scratch / "deep_gpcm" / "3")
    shutil.copytree(scratch / "deep_gpcm" / "2", scratch / "deep_gpcm" / "0")
    reg = ModelRegistry(scratch)
    assert reg.load() == {}
    assert reg.get("deep_gpcm").version == "3"
    edit_manifest(scratch / "deep_gpcm" / "0", created=created.replace("2999", "3000"))
    reg.load()
    assert reg.get("deep_gpcm").version == "0"


def test_versions_have_distinct_state_schemas(registry):
    schemas = {m.schema for m in registry.models()}
    assert len(schemas) == 3
    reloaded = ModelRegistry(registry.artifacts_dir)
    reloaded.load()
    assert [m.schema for m in reloaded.models()] == [m.schema for m in registry.models()]  # stable across loads


def test_question_index_accepts_strings_and_ints(registry):
    model = registry.get("deep_gpcm")
    assert model.index(["3", 3, np.int64(3)], "questions").tolist() == [5, 5, 5]
    assert model.index([0, "11"], "questions").dtype == np.int64
    assert model.index([0, "11"], "questions").tolist() == [2, 13]
    assert model.index([], "questions").shape == (0,)
    with pytest.raises(UnknownId) as info:
        model.index([1, "nope"], "next_questions")
    assert info.value.field == "next_questions" and info.value.value == "nope"
    assert "next_questions" in str(info.value) and "nope" in str(info.value)
    with pytest.raises(UnknownId):
        model.index([12], "question")


def test_state_round_trips_through_fixed_size_bytes(registry):
    model = registry.get("attention_gpcm")
    rng = np.random.default_rng(0)
    state = {s["name"]: (rng.normal(size=s["shape"]) * 10).astype(s["dtype"]) for s in model.state_spec}
    blob = model.serialize(state)
    assert isinstance(blob, bytes) and len(blob) == model.state_nbytes
    assert len(model.serialize(model.initial_state)) == model.state_nbytes
    back = model.deserialize(blob)
    assert list(back) == [s["name"] for s in model.state_spec]
    for name, value in state.items():
        np.testing.assert_array_equal(back[name], value)
        assert back[name].dtype == value.dtype and back[name].shape == value.shape
    with pytest.raises(ValueError, match="bytes"):
        model.deserialize(blob[:-1])
    with pytest.raises(ValueError, match="shape"):
        model.serialize({**state, "value_memory": np.zeros((1, 4, 8), np.float32)})
    # a deserialised state feeds the graphs as is
    feeds = {k: v[None] for k, v in back.items()}
    feeds.update(question=np.array([2]), response=np.array([1]), questions=np.array([[2, 3]]))
    model.sessions["step_predict"].run(None, {n: feeds[n] for n in model.input_names["step_predict"]})


def test_broken_artifacts_are_reported_and_the_others_serve(scratch):
    shutil.copytree(scratch / "deep_gpcm" / "1", scratch / "broken" / "no_onnx")
    (scratch / "broken" / "no_onnx" / "predict.onnx").unlink()
    shutil.copytree(scratch / "deep_gpcm" / "1", scratch / "broken" / "bad_json")
    (scratch / "broken" / "bad_json" / "manifest.json").write_text("{not json")
    shutil.copytree(scratch / "attention_gpcm" / "1", scratch / "broken" / "bad_shape")
    manifest = json.loads((scratch / "broken" / "bad_shape" / "manifest.json").read_text())
    manifest["state"][1]["shape"] = [2, 5, 8]
    edit_manifest(scratch / "broken" / "bad_shape", state=manifest["state"])
    shutil.copytree(scratch / "deep_gpcm" / "1", scratch / "broken" / "no_key")
    manifest = json.loads((scratch / "broken" / "no_key" / "manifest.json").read_text())
    del manifest["graphs"]
    (scratch / "broken" / "no_key" / "manifest.json").write_text(json.dumps(manifest))
    (scratch / "broken" / "empty").mkdir()

    reg = ModelRegistry(scratch)
    errors = reg.load()
    assert errors == reg.errors
    assert sorted(errors) == sorted(str(scratch / "broken" / d)
                                    for d in ("no_onnx", "bad_json", "bad_shape", "no_key", "empty"))
    for directory, message in errors.items():
        assert message.startswith(directory)
    assert "predict.onnx" in errors[str(scratch / "broken" / "no_onnx")]
    assert "JSON" in errors[str(scratch / "broken" / "bad_json")]
    assert "attention_window" in errors[str(scratch / "broken" / "bad_shape")]
    assert "graphs" in errors[str(scratch / "broken" / "no_key")]
    assert "manifest.json missing" in errors[str(scratch / "broken" / "empty")]
    assert [(m.name, m.version) for m in reg.models()] == [
        ("attention_gpcm", "1"), ("deep_gpcm", "1"), ("deep_gpcm", "2")]
    with pytest.raises(UnknownModel):
        reg.get("broken")


def test_graph_that_disagrees_with_the_manifest_is_refused(scratch):
    from nextstep.service.registry import load_artifact

    path = scratch / "attention_gpcm" / "1"
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["graphs"]["step"]["inputs"][3]["name"] = "item"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match=r"step graph takes .*manifest declares"):
        load_artifact(path)


def test_unknown_model_lists_what_is_available(registry):
    with pytest.raises(UnknownModel) as info:
        registry.get("gru4rec")
    message = str(info.value)
    assert "gru4rec" in message and "attention_gpcm: 1" in message and "deep_gpcm: 1, 2" in message
    with pytest.raises(UnknownModel, match="'7'"):
        registry.get("deep_gpcm", "7")
    with pytest.raises(KeyError):  # UnknownModel is a KeyError
        registry.get("deep_gpcm", "7")


def test_missing_artifacts_dir_loads_nothing(tmp_path):
    reg = ModelRegistry(tmp_path / "nowhere")
    assert reg.load() == {} and reg.models() == []


def test_reload_swaps_atomically_and_old_models_keep_working(scratch):
    reg = ModelRegistry(scratch)
    assert reg.load() == {}
    held = reg.get("deep_gpcm")
    assert held.version == "2"
    expected = replay(held, [("1", 3), ("2", 0)], ["4", "5"])

    shutil.rmtree(scratch / "deep_gpcm" / "2")  # e.g. a bad version withdrawn
    failures: list[BaseException] = []
    stop = threading.Event()

    def reader():  # requests during reloads: always a complete, working set
        try:
            while not stop.is_set():
                model = reg.get("deep_gpcm")
                assert model.version in {"1", "2"}
                replay(model, [("1", 3)], ["4"])
                assert {m.name for m in reg.models()} == {"deep_gpcm", "attention_gpcm"}
        except BaseException as e:  # noqa: BLE001 -- reported to the test thread
            failures.append(e)

    threads = [threading.Thread(target=reader) for _ in range(2)]
    for t in threads:
        t.start()
    for _ in range(3):
        assert reg.load() == {}
    stop.set()
    for t in threads:
        t.join()
    assert not failures, failures

    assert reg.get("deep_gpcm").version == "1"
    assert [(m.name, m.version) for m in reg.models()] == [("attention_gpcm", "1"), ("deep_gpcm", "1")]
    # the model held across the reloads (its files are gone) still answers, and the same as before
    for a, b in zip(replay(held, [("1", 3), ("2", 0)], ["4", "5"]), expected, strict=True):
        np.testing.assert_array_equal(a, b)
