"""The fold graph (nextstep/service/fold.py): an artifact's own step graph in an ONNX Scan folds a run of events into
a state in one ONNX Runtime call, and the state equals stepping the events one step call each (1e-5), for every
family with state; `StatefulTask.fold` takes it for runs of two events or more, keeps the step_predict /
step_recommend call for the last event when asked, and a model whose step graph cannot be folded steps event by
event. Real ONNX Runtime on the bundled demo artifacts and models trained for real (the session fixtures)."""

import asyncio
import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import nextstep
from nextstep.service.core import StatefulTask
from nextstep.service.fold import FOLD, FoldUnavailable, fold_model
from nextstep.service.registry import LoadedModel, ModelRegistry, load_artifact
from nextstep.service.runtime import Engines

DEMO = Path(nextstep.__file__).parent / "demo_artifacts"


def demo(family: str, fold: bool = True) -> LoadedModel:
    return load_artifact(DEMO / family / "demo", fold=fold)


def events_of(model: LoadedModel, rng: np.random.Generator, rows: int, n: int) -> dict[str, np.ndarray]:
    """(rows, n) of each per-event input: known rows, with about one event in four at the unknown row 1 (and row 0's
    first event too), responses in range."""
    out = {}
    for name in model.fold_events:
        if name == "response":
            out[name] = rng.integers(0, model.extra.n_cats, (rows, n))
        else:
            ids = rng.integers(2, len(model.ids) + 2, (rows, n))
            ids[rng.random((rows, n)) < 0.25] = 1
            ids[0, 0] = 1
            out[name] = ids
    return out


def stepped(model: LoadedModel, state: dict[str, np.ndarray], events: dict[str, np.ndarray]) -> list[np.ndarray]:
    """The batched state after the events, one step graph call each."""
    names = [s["name"] for s in model.state_spec]
    for t in range(next(iter(events.values())).shape[1]):
        outs = model.sessions["step"].run(None, {**state, **{k: v[:, t] for k, v in events.items()}})
        state = dict(zip(names, outs, strict=False))
    return [state[n] for n in names]


def folded(model: LoadedModel, state: dict[str, np.ndarray], events: dict[str, np.ndarray]) -> list[np.ndarray]:
    p = model.fold_prefix
    return model.sessions[FOLD].run(None, {**{p + k: v for k, v in state.items()},
                                           **{p + k: v for k, v in events.items()}})


def started(model: LoadedModel, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """A batch of `rows` different states: the initial state stepped through a few random events per row."""
    initial = {s["name"]: np.repeat(model.initial_state[s["name"]][None], rows, axis=0) for s in model.state_spec}
    return dict(zip(initial, stepped(model, initial, events_of(model, rng, rows, 5)), strict=True))


def assert_same_state(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=1e-5, atol=1e-5)


def assert_folds_as_it_steps(model: LoadedModel, n: int, rows: int = 3, seed: int = 0) -> None:
    assert model.no_fold is None and FOLD in model.sessions, model.no_fold
    rng = np.random.default_rng(seed)
    state = started(model, rng, rows)
    events = events_of(model, rng, rows, n)
    assert (events[model.fold_events[0]] == 1).any()  # some events are the unknown row
    assert_same_state(folded(model, state, events), stepped(model, state, events))


@pytest.mark.parametrize("n", [1, 2, 17, 200])
@pytest.mark.parametrize("family", ["deep_gpcm", "gru4rec"])
def test_the_fold_graph_equals_stepping_event_by_event(family, n):
    assert_folds_as_it_steps(demo(family), n)


def test_the_fold_graph_of_trained_models_equals_stepping(artifact_tree, rec_artifacts):
    """attention_gpcm: three state tensors, one an int64 count without per-entity axes; deep_gpcm, gru4rec and
    popularity (its state: the last item) trained for real."""
    registry = ModelRegistry(artifact_tree)
    registry.load()
    attention = registry.get("attention_gpcm")
    assert [s["shape"] for s in attention.state_spec][-1] == []
    for model in (attention, registry.get("deep_gpcm")):
        assert_folds_as_it_steps(model, 40, seed=1)
    sessions = ModelRegistry(rec_artifacts)
    sessions.load()
    for name in ("gru4rec", "popularity"):
        assert_folds_as_it_steps(sessions.get(name), 40, seed=2)


def test_the_fold_graph_is_valid_onnx_with_the_step_s_inputs_and_an_events_axis():
    onnx = pytest.importorskip("onnx")
    model = demo("deep_gpcm")
    proto, events, prefix = fold_model((DEMO / "deep_gpcm" / "demo" / "step.onnx").read_bytes(), ["value_memory"])
    parsed = onnx.load_from_string(proto)
    onnx.checker.check_model(parsed, full_check=True)
    assert events == ["question", "response"] and prefix == "fold/"
    assert model.input_names[FOLD] == ["fold/value_memory", "fold/question", "fold/response"]
    assert model.output_names[FOLD] == ["fold/value_memory_next"]
    shapes = {i.name: i.shape for i in model.sessions[FOLD].get_inputs()}
    assert shapes == {"fold/value_memory": ["batch", 8, 61], "fold/question": ["batch", "events"],
                      "fold/response": ["batch", "events"]}
    (scan,) = parsed.graph.node
    assert scan.op_type == "Scan"
    body = next(a.g for a in scan.attribute if a.name == "body")
    assert len(body.node) == len(onnx.load(DEMO / "deep_gpcm" / "demo" / "step.onnx").graph.node)  # the step's own


def test_the_fold_graph_computes_what_reads_no_state_for_all_events_before_the_scan():
    """deep_gpcm's step: of its 13 nodes, 9 read only the event (the question's slot weights and the response's
    log-likelihood on the grid, looked up in the export's tables); the registry's fold graph computes those for every
    event at once and scans the other 4 (the evidence added, shifted and floored), and it folds as it steps for
    several entities whose events differ (the tests above run this graph). The step graph whole in the Scan
    (`fold_model`, where hoisting is not possible) folds the same."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort

    from nextstep.service.fold import ELEMENT_TYPES, _parsed, hoisted_fold_model, hoisting, probe_model

    source = (DEMO / "deep_gpcm" / "demo" / "step.onnx").read_bytes()
    parsed = _parsed(source, ["value_memory"], "fold/")
    hoisted, body, scanned = hoisting(parsed)
    assert (len(hoisted), len(body)) == (9, 4) and scanned
    probe = ort.InferenceSession(probe_model(source, scanned), providers=["CPUExecutionProvider"])
    types = {o.name: ELEMENT_TYPES[o.type] for o in probe.get_outputs()}
    proto, events, prefix = hoisted_fold_model(parsed, (hoisted, body, scanned), types)
    onnx.checker.check_model(onnx.load_from_string(proto), full_check=True)
    model = demo("deep_gpcm")
    scan = onnx.load_from_string(proto).graph.node[-1]
    assert scan.op_type == "Scan" and len(next(a.g for a in scan.attribute if a.name == "body").node) == 4
    assert [i.name for i in model.sessions[FOLD].get_inputs()] == [prefix + n for n in ["value_memory", *events]]
    whole = ort.InferenceSession(fold_model(source, ["value_memory"])[0], providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    state, events = started(model, rng, 4), events_of(model, rng, 4, 50)
    want = stepped(model, state, events)
    assert_same_state(folded(model, state, events), want)
    assert_same_state(whole.run(None, {**{prefix + k: v for k, v in state.items()},
                                       **{prefix + k: v for k, v in events.items()}}), want)


def test_a_step_graph_whose_every_node_reads_the_state_is_folded_whole():
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    from nextstep.service.fold import _parsed, hoisting

    graph = helper.make_graph(
        [helper.make_node("Cast", ["question"], ["q"], to=TensorProto.FLOAT),
         helper.make_node("Add", ["memory", "q"], ["memory_next"])], "step",
        [helper.make_tensor_value_info("memory", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("question", TensorProto.INT64, ["batch"])],
        [helper.make_tensor_value_info("memory_next", TensorProto.FLOAT, ["batch"])])
    source = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    assert len(hoisting(_parsed(source, ["memory"], "fold/"))[0]) == 1  # the Cast reads the event alone
    graph.node[0].input[:] = ["memory"]  # now every node reads the state
    graph.node[0].output[:] = ["m"]
    graph.node[1].input[:] = ["m", "question"]
    source = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(FoldUnavailable, match="every node of the step graph reads the state"):
        hoisting(_parsed(source, ["memory"], "fold/"))


def kt_steps(model: LoadedModel, rng: np.random.Generator, n: int) -> list[dict[str, np.ndarray]]:
    """One learner's events as kt.py hands them to `fold`: a dict of (1,) feeds each."""
    events = events_of(model, rng, 1, n)
    return [{k: v[0, t:t + 1] for k, v in events.items()} for t in range(n)]


async def fold_counting(model: LoadedModel, events, combined=None, query=None):
    """(state, outputs, the graphs called in order) of StatefulTask.fold alone in its engines."""
    calls = []
    engines = Engines(64, 0.0, on_batch=lambda name, graph, rows, seconds: calls.append(graph))
    task = StatefulTask(None, None, engines)  # (fold needs neither the registry nor a store)
    try:
        state, outputs = await task.fold(model, model.initial_state, events, combined, query)
    finally:
        await engines.close()
    return state, outputs, calls


@pytest.mark.parametrize("n", [1, 2, 200])
def test_a_rebuild_is_one_fold_call_and_a_query_one_step_predict_call(n):
    model, fallback = demo("deep_gpcm"), demo("deep_gpcm", fold=False)
    assert FOLD not in fallback.sessions and fallback.no_fold is None  # (not asked for: no reason to give)
    events = kt_steps(model, np.random.default_rng(n), n)
    query = {"questions": np.array([[2, 1, 5]])}

    state, outputs, calls = asyncio.run(fold_counting(model, events))
    want, _, per_event = asyncio.run(fold_counting(fallback, events))
    assert outputs is None and calls == (["step"] if n == 1 else [FOLD]) and per_event == ["step"] * n
    assert_same_state(list(state.values()), list(want.values()))

    state, outputs, calls = asyncio.run(fold_counting(model, events, "step_predict", query))
    want_state, want, per_event = asyncio.run(fold_counting(fallback, events, "step_predict", query))
    assert calls == ([FOLD] if n > 2 else ["step"] * (n - 1)) + ["step_predict"]
    assert per_event == ["step"] * (n - 1) + ["step_predict"]
    assert_same_state(list(state.values()), list(want_state.values()))
    assert_same_state(outputs, want)


def test_sessions_fold_through_the_fold_graph():
    model, fallback = demo("gru4rec"), demo("gru4rec", fold=False)
    clicks = [{"item": np.array([row])} for row in np.random.default_rng(3).integers(1, len(model.ids) + 2, 30)]
    query = {"exclude": np.zeros((1, 1), dtype=np.int64)}
    state, outputs, calls = asyncio.run(fold_counting(model, clicks, "step_recommend", query))
    want_state, want, _ = asyncio.run(fold_counting(fallback, clicks, "step_recommend", query))
    assert calls == [FOLD, "step_recommend"]
    assert_same_state(list(state.values()), list(want_state.values()))
    np.testing.assert_array_equal(outputs[0], want[0])  # the recommended rows
    np.testing.assert_allclose(outputs[1], want[1], rtol=1e-5, atol=1e-5)


def test_folds_of_as_many_events_share_a_run_and_others_do_not():
    """The fold graph keeps the batch axis first: the micro-batcher puts two learners' folds of 20 events in one run
    (the same states as each alone), a fold of 21 events in a run of its own."""
    model = demo("deep_gpcm")
    rng = np.random.default_rng(4)
    histories = [kt_steps(model, rng, 20), kt_steps(model, rng, 20), kt_steps(model, rng, 21)]
    alone = [asyncio.run(fold_counting(model, h))[0] for h in histories]

    async def together():
        runs = []
        engines = Engines(64, 5.0, on_batch=lambda name, graph, rows, seconds: runs.append((graph, rows)))
        task = StatefulTask(None, None, engines)
        try:
            return await asyncio.gather(*(task.fold(model, model.initial_state, h) for h in histories)), runs
        finally:
            await engines.close()

    results, runs = asyncio.run(together())
    assert sorted(runs) == [(FOLD, 1), (FOLD, 2)]
    for (state, _), want in zip(results, alone, strict=True):
        assert_same_state(list(state.values()), list(want.values()))


def test_a_step_graph_that_cannot_fold_steps_event_by_event_said_once(tmp_path, caplog):
    """A step graph whose state has a fixed batch axis of 1 (no named batch axis to scan along): the artifact serves,
    without a fold graph, saying why once however often it is loaded; its rebuilds step event by event, to the
    same state."""
    onnx = pytest.importorskip("onnx")
    art = tmp_path / "deep_gpcm" / "1"
    shutil.copytree(DEMO / "deep_gpcm" / "demo", art)
    step = onnx.load(art / "step.onnx")
    for value in (step.graph.input[0], step.graph.output[0]):
        value.type.tensor_type.shape.dim[0].dim_value = 1
    onnx.save(step, art / "step.onnx")
    with pytest.raises(FoldUnavailable, match="no named batch axis"):
        fold_model((art / "step.onnx").read_bytes(), ["value_memory"])

    registry = ModelRegistry(tmp_path)
    with caplog.at_level(logging.WARNING, logger="nextstep.service.registry"):
        assert registry.load() == {}
        assert registry.load() == {}
    model = registry.get("deep_gpcm")
    assert FOLD not in model.sessions and model.fold_events == ()
    assert "no named batch axis" in model.no_fold
    said = [r.getMessage() for r in caplog.records if "no fold graph" in r.getMessage()]
    assert len(said) == 1 and str(art) in said[0]

    folding = demo("deep_gpcm")
    events = kt_steps(folding, np.random.default_rng(5), 30)
    state, _, calls = asyncio.run(fold_counting(model, events))
    want, _, _ = asyncio.run(fold_counting(folding, events))
    assert calls == ["step"] * 30
    assert_same_state(list(state.values()), list(want.values()))


def test_an_artifact_refused_for_its_manifest_makes_no_fold_graph(tmp_path):
    """The registry's checks come first: an artifact refused keeps being refused for its own fault."""
    art = tmp_path / "deep_gpcm" / "1"
    shutil.copytree(DEMO / "deep_gpcm" / "demo", art)
    manifest = json.loads((art / "manifest.json").read_text())
    manifest["graphs"]["step"]["inputs"][1]["name"] = "item"
    (art / "manifest.json").write_text(json.dumps(manifest))
    errors = ModelRegistry(tmp_path).load()
    assert list(errors) == [str(art)] and "manifest declares" in errors[str(art)]


@pytest.mark.slow  # trains and exports two more families (make test-all)
def test_every_other_family_with_state_folds_as_it_steps(build_once, kt_families, tmp_path):
    """DKT (two LSTM state tensors) and coral_gpcm (conftest's kt_families), MRN (three state tensors) and the Markov
    baseline, trained small for real: the families the fixtures above do not train."""
    def build(root: Path) -> None:
        from nextstep.training.next_item.mrn_loop import MRNTrainConfig
        from nextstep.training.next_item.run import train_next_item
        from nextstep.training.next_item.sessions import subset, write_gru4rec_tsv, zipf_sessions

        sessions = zipf_sessions(200, 40, (2, 8), follow=0.7, seed=1)
        write_gru4rec_tsv(subset(sessions, np.arange(160)), root / "demo_train_full.txt")
        write_gru4rec_tsv(subset(sessions, np.arange(160, 200)), root / "demo_test.txt")
        mrn = MRNTrainConfig(epochs=1, batch_size=128, curriculum=[[1, 1, 2]],
                             model=dict(dim=16, modulus=8, history=4, parallel=2, temperature=0.2, sigma=1.0,
                                        repeat=0.5))
        for name, cfg in (("mrn", mrn), ("markov", None)):
            train_next_item(name, root, root / "artifacts" / name / "1", cfg=cfg, progress=False, log=False,
                            top_k=20)

    artifacts = tmp_path / "artifacts"
    shutil.copytree(build_once("fold-families", build) / "artifacts", artifacts)
    for name in ("dkt", "coral_gpcm"):
        shutil.copytree(kt_families[0] / name, artifacts / name)
    registry = ModelRegistry(artifacts)
    assert registry.load() == {}
    for name in ("dkt", "coral_gpcm", "mrn", "markov"):
        model = registry.get(name)
        if model.state_spec:
            assert_folds_as_it_steps(model, 30, seed=6)
    assert len(registry.get("mrn").state_spec) == 3


def test_a_step_graph_reading_k_bank_entries_gets_a_fold_graph(tmp_path):
    """The fold graph's check feeds a bank input (no batch axis) of BANK_ROWS zero entries: a head that takes its
    k = 15 nearest entries, as SimAKT's full-size KNN head does, folds (the check once fed 8 and refused it)."""
    onnx = pytest.importorskip("onnx")
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from nextstep.service.fold import build_fold

    graph = helper.make_graph(
        [helper.make_node("TopK", ["bank", "k"], ["near", "near_at"], axis=0),
         helper.make_node("ReduceSum", ["near"], ["pulled"], keepdims=0),
         helper.make_node("Cast", ["question"], ["q"], to=TensorProto.FLOAT),
         helper.make_node("Add", ["memory", "q"], ["moved"]),
         helper.make_node("Add", ["moved", "pulled"], ["memory_next"])],
        "step",
        [helper.make_tensor_value_info("memory", TensorProto.FLOAT, ["batch"]),
         helper.make_tensor_value_info("question", TensorProto.INT64, ["batch"]),
         helper.make_tensor_value_info("bank", TensorProto.FLOAT, ["entries"])],
        [helper.make_tensor_value_info("memory_next", TensorProto.FLOAT, ["batch"])],
        [helper.make_tensor("k", TensorProto.INT64, [1], [15])])
    path = tmp_path / "step.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    step = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    session, events, prefix = build_fold(path, ["memory"], ort.SessionOptions(), step,
                                         {"memory": np.zeros((), np.float32)})
    assert events == ["question"]
    bank = np.arange(20, dtype=np.float32)  # the 15 largest: 5..19, summing to 180
    (memory,) = session.run(None, {prefix + "memory": np.zeros(1, np.float32),
                                   prefix + "question": np.array([[1, 2]]), "bank": bank})
    assert memory.tolist() == [1 + 180 + 2 + 180]
