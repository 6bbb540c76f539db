"""The model registry on real trained artifacts: loading, "latest", id mapping, state bytes, broken
artifacts, and reloads that never pull a model from under a request."""

import json
import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest

from nextstep.service.errors import UnknownId, UnknownModel
from nextstep.service.registry import ArtifactError, LoadedModel, ModelRegistry, load_artifact


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
    assert attention.family == "attention_gpcm" and attention.task == "knowledge_tracing"
    assert attention.extra.n_cats == 4
    assert [s["name"] for s in attention.state_spec] == ["value_memory", "attention_window", "interaction_count"]
    assert set(attention.sessions) == {"step", "predict", "step_predict", "fold"}  # (fold: made from step, fold.py)
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


# -- reloads are all-or-nothing per artifact; pins ------------------------------------------------------------

def corrupt_graph(artifact: Path, graph: str = "step_predict") -> None:
    path = artifact / f"{graph}.onnx"
    path.write_bytes(path.read_bytes()[:200])  # a truncated protobuf


def test_a_broken_serving_version_keeps_serving_the_object_loaded_before(scratch):
    reg = ModelRegistry(scratch)
    assert reg.load() == {}
    held, attention = reg.get("deep_gpcm"), reg.get("attention_gpcm")
    assert held.version == "2"
    corrupt_graph(scratch / "deep_gpcm" / "2")

    report = reg.reload()
    assert [(r.model, r.version, r.kept, r.serving) for r in report.refused] == [("deep_gpcm", "2", True, "2")]
    assert "step_predict" in report.refused[0].reason and report.refused[0].outcome == "deep_gpcm/2 keeps serving"
    assert reg.errors == {str(scratch / "deep_gpcm" / "2"): report.refused[0].reason}
    assert reg.get("deep_gpcm") is held and reg.get("deep_gpcm@2") is held  # no fall back to version 1
    assert report.serving == {"attention_gpcm": "1", "deep_gpcm": "2"} and report.withdrawn == ()
    assert reg.get("attention_gpcm") is not attention  # the others were loaded afresh, untouched by the fault
    replay(held, [("1", 3)], ["4"])  # and the kept one still runs

    shutil.copy(scratch / "deep_gpcm" / "1" / "step_predict.onnx", scratch / "deep_gpcm" / "2")  # mended
    report = reg.reload()
    assert report.refused == () and reg.errors == {}
    assert reg.get("deep_gpcm").version == "2" and reg.get("deep_gpcm") is not held


def test_a_model_whose_only_version_broke_or_whose_directory_vanished_keeps_serving(scratch):
    reg = ModelRegistry(scratch)
    reg.load()
    attention = reg.get("attention_gpcm")
    deep = {v: reg.get("deep_gpcm", v) for v in ("1", "2")}
    (scratch / "attention_gpcm" / "1" / "manifest.json").write_text("{not json")
    shutil.move(scratch / "deep_gpcm", scratch / ".deep_gpcm")  # the whole model directory gone

    report = reg.reload()
    assert [(r.model, r.version, r.kept) for r in report.refused] == [
        ("attention_gpcm", "1", True), ("deep_gpcm", "1", True), ("deep_gpcm", "2", True)]
    assert "JSON" in report.refused[0].reason and report.refused[1].reason.endswith("directory missing")
    assert reg.get("attention_gpcm") is attention
    assert all(reg.get("deep_gpcm", v) is m for v, m in deep.items()) and reg.get("deep_gpcm") is deep["2"]
    assert report.withdrawn == ()


def test_a_new_broken_version_leaves_latest_alone_and_a_deleted_one_is_withdrawn(scratch):
    reg = ModelRegistry(scratch)
    reg.load()
    held = reg.get("deep_gpcm")
    shutil.copytree(scratch / "deep_gpcm" / "2", scratch / "deep_gpcm" / "3")
    edit_manifest(scratch / "deep_gpcm" / "3", created="3000-01-01T00:00:00Z", vocabularies=["not", "a", "dict"])
    report = reg.reload()
    assert [(r.version, r.kept, r.serving) for r in report.refused] == [("3", False, "2")]
    assert "vocabularies" in report.refused[0].reason
    assert reg.get("deep_gpcm").version == "2"
    with pytest.raises(UnknownModel, match=r"no version '3'; available: 1, 2 \(latest 2\); version '3' was refused"):
        reg.get("deep_gpcm@3")

    shutil.rmtree(scratch / "deep_gpcm" / "3")
    shutil.rmtree(scratch / "deep_gpcm" / "2")  # the operator takes version 2 out of service
    report = reg.reload()
    assert report.refused == () and report.withdrawn == ("deep_gpcm/2",) and report.serving["deep_gpcm"] == "1"
    assert reg.get("deep_gpcm").version == "1" and held.version == "2"


def test_at_startup_a_broken_newest_version_serves_the_newest_good_one_and_says_so(scratch):
    corrupt_graph(scratch / "deep_gpcm" / "2", "step")
    (scratch / "attention_gpcm" / "1" / "manifest.json").write_text("[]")
    reg = ModelRegistry(scratch)
    report = reg.reload()
    assert [(r.model, r.version, r.kept, r.serving) for r in report.refused] == [
        ("attention_gpcm", "1", False, None), ("deep_gpcm", "2", False, "1")]
    assert [r.outcome for r in report.refused] == ["attention_gpcm is not served", "deep_gpcm serves version 1"]
    assert reg.get("deep_gpcm").version == "1" and report.serving == {"deep_gpcm": "1"}
    with pytest.raises(UnknownModel):
        reg.get("attention_gpcm")


@pytest.mark.parametrize("fault", ["vocab_not_utf8", "state_not_npy", "inputs_not_a_list", "graphs_a_string"])
def test_faults_load_artifact_did_not_foresee_are_refusals_not_a_failed_load(scratch, fault):
    path = scratch / "deep_gpcm" / "2"
    manifest = json.loads((path / "manifest.json").read_text())
    if fault == "vocab_not_utf8":
        (path / manifest["vocabularies"]["questions"]).write_bytes(b"\xff\xfe not text")
    elif fault == "state_not_npy":
        (path / manifest["state"][0]["file"]).write_bytes(b"garbage")
    elif fault == "inputs_not_a_list":
        edit_manifest(path, graphs={g: {**v, "inputs": "x"} for g, v in manifest["graphs"].items()})
    else:
        edit_manifest(path, graphs="step predict step_predict")
    reg = ModelRegistry(scratch)
    errors = reg.load()
    assert list(errors) == [str(path)] and errors[str(path)].startswith(str(path))
    assert [(m.name, m.version) for m in reg.models()] == [("attention_gpcm", "1"), ("deep_gpcm", "1")]


def test_a_pin_names_a_version_and_an_unknown_one_lists_the_versions(registry):
    assert registry.get("deep_gpcm@1").version == "1" and registry.get("deep_gpcm@2") is registry.get("deep_gpcm")
    assert registry.get("deep_gpcm@1", task="knowledge_tracing") is registry.get("deep_gpcm", "1")
    assert registry.latest()["deep_gpcm"] is registry.get("deep_gpcm")
    for pin in ("deep_gpcm@7", "deep_gpcm@", "deep_gpcm@1@1"):
        with pytest.raises(UnknownModel, match=r"has no version .*available: 1, 2 \(latest 2\)"):
            registry.get(pin)
    with pytest.raises(UnknownModel, match="no model 'gru4rec'"):
        registry.get("gru4rec@1")
    with pytest.raises(UnknownModel, match="not a next_item one"):
        registry.get("deep_gpcm@1", task="next_item")


# -- files a manifest names stay inside its artifact ---------------------------------------------------------------

@pytest.mark.parametrize("where", ["absolute", "dot-dot", "symlink", "symlinked-directory"])
def test_a_graph_outside_the_artifact_is_refused_even_a_good_one(scratch, tmp_path, where):
    """A manifest that names a graph elsewhere (absolute, ../, or a link that leads out): before, a good graph there
    was loaded and served."""
    path = scratch / "deep_gpcm" / "2"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(path / "step.onnx", elsewhere / "step.onnx")
    manifest = json.loads((path / "manifest.json").read_text())
    if where == "absolute":
        manifest["graphs"]["step"]["onnx"] = str(elsewhere / "step.onnx")
    elif where == "dot-dot":
        manifest["graphs"]["step"]["onnx"] = os.path.relpath(elsewhere / "step.onnx", path)
    elif where == "symlink":
        (path / "step.onnx").unlink()
        (path / "step.onnx").symlink_to(elsewhere / "step.onnx")
    else:
        (path / "graphs").symlink_to(elsewhere, target_is_directory=True)
        manifest["graphs"]["step"]["onnx"] = "graphs/step.onnx"
    edit_manifest(path, graphs=manifest["graphs"])
    with pytest.raises(ArtifactError) as refused:
        load_artifact(path)
    assert refused.value.kind == "path outside the artifact" and refused.value.summary == (
        "path outside the artifact (step graph)")
    assert str(path) in str(refused.value)  # the log's and the admin's message names the directory and the file


def test_files_named_outside_are_never_opened(scratch, tmp_path):
    """The issue's manifest: a vocabulary at ../../../../../etc/passwd was opened (and refused as malformed); an
    initial state elsewhere was loaded."""
    path = scratch / "deep_gpcm" / "2"
    edit_manifest(path, vocabularies={"questions": "../../../../../etc/passwd"})
    with pytest.raises(ArtifactError) as refused:
        load_artifact(path)
    assert refused.value.kind == "path outside the artifact" and "vocabulary" in refused.value.summary
    state = json.loads((path / "manifest.json").read_text())["state"]
    shutil.copy(path / state[0]["file"], tmp_path / "state.npy")
    edit_manifest(path, vocabularies={"questions": "vocab_questions.json"},
                  state=[{**state[0], "file": str(tmp_path / "state.npy")}, *state[1:]])
    with pytest.raises(ArtifactError) as refused:
        load_artifact(path)
    assert refused.value.summary == "path outside the artifact (initial state)"
    edit_manifest(path, state=state, banks={"heads": [], "inputs": [], "keys": [], "explain": [], "dir": "../.."})
    with pytest.raises(ArtifactError) as refused:  # SimAKT's memory banks are read from a folder it names
        load_artifact(path)
    assert refused.value.summary == "path outside the artifact (banks)"


def test_links_and_paths_that_stay_inside_load(scratch, tmp_path):
    """Inside is where a path resolves to: `sub/../step.onnx`, a link to a file of the artifact, and an artifact
    directory that is itself a link (the version directory resolved) all load."""
    path = scratch / "deep_gpcm" / "2"
    manifest = json.loads((path / "manifest.json").read_text())
    (path / "sub").mkdir()
    (path / "linked.onnx").symlink_to(path / "predict.onnx")
    manifest["graphs"]["step"]["onnx"] = "sub/../step.onnx"
    manifest["graphs"]["predict"]["onnx"] = "linked.onnx"
    edit_manifest(path, graphs=manifest["graphs"])
    assert load_artifact(path).version == "2"
    shutil.move(path, tmp_path / "stored-elsewhere")
    path.symlink_to(tmp_path / "stored-elsewhere", target_is_directory=True)
    assert load_artifact(path).version == "2"


def test_a_refusal_shows_clients_the_kind_of_fault_and_admins_the_details(scratch, tmp_path):
    """A serving version whose manifest now names a file outside keeps serving (a refusal like any other), and
    what a client that is not an admin sees of a refusal names no path and quotes no ONNX Runtime message."""
    reg = ModelRegistry(scratch)
    reg.load()
    held = reg.get("deep_gpcm")
    edit_manifest(scratch / "deep_gpcm" / "2", vocabularies={"questions": str(tmp_path / "vocab.json")})
    shutil.copytree(scratch / "attention_gpcm" / "1", scratch / "attention_gpcm" / "2")
    corrupt_graph(scratch / "attention_gpcm" / "2", "step")
    report = reg.reload()
    assert reg.get("deep_gpcm") is held
    (attention, deep) = report.refused
    assert (deep.kind, deep.summary, deep.kept) == ("path outside the artifact",
                                                    "path outside the artifact (vocabulary)", True)
    assert (attention.kind, attention.summary) == ("graph failed to load", "graph failed to load (step)")
    assert "step.onnx" in attention.reason and attention.reason.startswith(str(scratch))  # ONNX Runtime's words
    for r in report.refused:
        shown = r.as_dict(details=False)
        assert "path" not in shown and shown["reason"] == r.summary and shown["kind"] == r.kind
        assert str(scratch) not in json.dumps(shown) and "onnx" not in json.dumps(shown).lower()
        assert r.as_dict()["path"] == r.path and r.as_dict()["reason"] == r.reason
    assert report.summaries() == {"attention_gpcm/2": "graph failed to load (step)",
                                  "deep_gpcm/2": "path outside the artifact (vocabulary)"}
    with pytest.raises(UnknownModel) as unknown:  # a pin of a refused version says why, in the same words
        reg.get("attention_gpcm@2")
    assert str(unknown.value).endswith("version '2' was refused: graph failed to load (step)"), str(unknown.value)
