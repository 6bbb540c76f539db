"""The scored step graphs (nextstep/service/kt/scored.py): the predict graph asked for the event's question and the step
(or step_predict) graph in one ONNX Runtime call, for live quality."""

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

import nextstep
from nextstep.service.kt.scored import SCORED, ScoredUnavailable, scored_model
from nextstep.service.registry import LoadedModel, ModelRegistry, load_artifact

DEMO = Path(nextstep.__file__).parent / "demo_artifacts"


def started(model: LoadedModel, rng: np.random.Generator, rows: int) -> dict[str, np.ndarray]:
    """A batch of `rows` different states: the initial state stepped through 5 random events per row."""
    names = [s["name"] for s in model.state_spec]
    state = {n: np.repeat(model.initial_state[n][None], rows, axis=0) for n in names}
    for _ in range(5):
        outs = model.sessions["step"].run(None, {**state, "question": rng.integers(1, len(model.ids) + 2, rows),
                                                 "response": rng.integers(0, model.extra.n_cats, rows)})
        state = dict(zip(names, outs, strict=False))
    return state


def test_the_scored_graphs_answer_what_predict_then_step_answer():
    """deep_gpcm, a batch of 3 different states, events at known questions and at the unknown row 1: the scored
    step graph gives the step graph's next state and, last, the predict graph's P(each response) for the event's own
    question from the state before it; the scored step_predict graph also gives step_predict's answers to the query.
    Both are valid ONNX (onnx.checker)."""
    model = load_artifact(DEMO / "deep_gpcm" / "demo", scored=True)
    assert model.no_scored is None and set(SCORED.values()) <= set(model.sessions)
    rng = np.random.default_rng(3)
    state = started(model, rng, 3)
    event = {"question": np.array([1, 2, len(model.ids) + 1]), "response": rng.integers(0, model.extra.n_cats, 3)}
    query = {"questions": rng.integers(1, len(model.ids) + 2, (3, 2))}
    before = model.sessions["predict"].run(None, {**state, "questions": event["question"][:, None]})[0]
    assert before.shape == (3, 1, model.extra.n_cats)
    for graph, feeds in (("step", {}), ("step_predict", query)):
        want = model.sessions[graph].run(None, {**state, **event, **feeds}) + [before]
        got = model.sessions[SCORED[graph]].run(None, {**state, **event, **feeds})
        assert model.output_names[SCORED[graph]] == model.output_names[graph] + ["scored/probs"]
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)

    onnx = pytest.importorskip("onnx")
    for graph in SCORED:
        proto, score = scored_model((model.path / "predict.onnx").read_bytes(),
                                    (model.path / f"{graph}.onnx").read_bytes())
        assert score == "scored/probs"
        onnx.checker.check_model(onnx.load_from_string(proto), full_check=True)


def test_scored_graphs_are_made_only_when_asked_and_only_for_knowledge_tracing():
    assert "scored_step" not in load_artifact(DEMO / "deep_gpcm" / "demo").sessions  # (live quality off)
    for family in ("gru4rec", "time_aware"):
        model = load_artifact(DEMO / family / "demo", scored=True)
        assert not set(SCORED.values()) & set(model.sessions) and model.no_scored is None


def test_graphs_that_cannot_be_scored_together_serve_without_said_once(tmp_path, caplog):
    """A predict graph of another opset than the step graph's: the artifact serves, without scored graphs (live
    quality scores it with a second call), saying why once however often it is loaded."""
    onnx = pytest.importorskip("onnx")
    art = tmp_path / "deep_gpcm" / "1"
    shutil.copytree(DEMO / "deep_gpcm" / "demo", art)
    predict = onnx.load(art / "predict.onnx")
    opset = next(o for o in predict.opset_import if o.domain in ("", "ai.onnx"))
    opset.version += 1
    onnx.save(predict, art / "predict.onnx")
    with pytest.raises(ScoredUnavailable, match="opset"):
        scored_model((art / "predict.onnx").read_bytes(), (art / "step.onnx").read_bytes())

    registry = ModelRegistry(tmp_path, scored_graphs=True)
    with caplog.at_level(logging.WARNING, logger="nextstep.service.registry"):
        assert registry.load() == {}
        assert registry.load() == {}
    model = registry.get("deep_gpcm")
    assert not set(SCORED.values()) & set(model.sessions) and "opset" in model.no_scored
    said = [r.getMessage() for r in caplog.records if "no scored step graphs" in r.getMessage()]
    assert len(said) == 1 and str(art) in said[0]


def test_a_predict_graph_with_a_subgraph_is_refused():
    """Names inside an If / Loop / Scan body would need renaming too: such a predict graph is not scored together."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper

    body = helper.make_graph([helper.make_node("Identity", ["value_memory"], ["y"])], "body", [],
                             [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["c"], value=helper.make_tensor("c", TensorProto.BOOL, [], [True])),
         helper.make_node("If", ["c"], ["probs"], then_branch=body, else_branch=body)], "predict",
        [helper.make_tensor_value_info("value_memory", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("questions", TensorProto.INT64, ["batch", 1])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, None)])
    predict = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    step = load_artifact(DEMO / "deep_gpcm" / "demo").path / "step.onnx"
    predict.ir_version = onnx.load(step).ir_version
    predict.opset_import[0].version = next(o.version for o in onnx.load(step).opset_import if o.domain == "")
    with pytest.raises(ScoredUnavailable, match="subgraph"):
        scored_model(predict.SerializeToString(), step.read_bytes())
