"""The scored step graphs: an artifact's `predict` graph asked for the event's own question, and its `step` (or
`step_predict`) graph, as one graph, so that live quality (quality.py) gets what the version predicted for an event
from the state before it in the same ONNX Runtime call that steps the event, not in a second call after the answer.

Made when the registry opens a knowledge-tracing artifact (with live quality on), from the graphs as exported:

    scored_step(<state>..., question, response, <shared>...)
        -> <state next>..., scored/<predict's first output>                     (batch, 1, K): P(each response)
    scored_step_predict(<state>..., question, response, questions, <shared>...)
        -> <state next>..., <step_predict's query outputs>..., scored/<predict's first output>

* the step graph is copied unchanged: its inputs are the scored graph's inputs (with the inputs of predict's own, such
  as SimAKT's answer banks), its outputs come first;
* the predict graph's nodes and weights follow, every name prefixed `scored/` except the state and shared inputs
  it reads (the step's own) and the weights it has in common with the step graph (the same bytes: the step's copy
  serves both); its `questions` input is the step's `question` reshaped to (batch, 1);
* only the predict graph's first output is kept (ONNX Runtime leaves out the nodes nothing kept needs).

The predict graph must have no subgraphs (If, Loop, Scan: their names would need renaming inside) and no local
functions, and the two graphs the same default opset and IR version; otherwise, or where the scored graph does not
agree with running the two graphs one after the other (`check`), `build_scored` says why (ScoredUnavailable) and
live quality scores that model with a second call after the answer, as before.
"""

from pathlib import Path

import numpy as np
import onnxruntime as ort

from ..fold import BANK_ROWS, ONNX_TYPES
from ..onnx_wire import (
    field_bytes,
    field_int,
    first_field,
    has_subgraph,
    node_bytes,
    open_made,
    read_fields,
    value_name,
    varint,
)
from ..registry import say_once, session_options

SCORED = {"step": "scored_step", "step_predict": "scored_step_predict"}  # graph -> its scored graph's name
INT64 = 7  # TensorProto.DataType


class ScoredUnavailable(Exception):
    """Why a model gets no scored step graphs (live quality scores it with a second call)."""


def scored_model(predict: bytes, step: bytes, asked: str = "questions", event: str = "question",
                 prefix: str = "scored/") -> tuple[bytes, str]:
    """(the scored graph, serialised, of a serialised predict graph whose input `asked` (batch, n) takes the step
    graph's input `event` (batch,); the name of its score output). ScoredUnavailable when the graphs do not fit."""
    while prefix.encode() in predict or prefix.encode() in step:  # (a name of theirs could clash with ours)
        prefix = "_" + prefix
    p_model, s_model = list(read_fields(predict)), list(read_fields(step))

    def top(model: list, number: int) -> list:
        return [value for n, value, _ in model if n == number]

    if not top(p_model, 7) or not top(s_model, 7):
        raise ScoredUnavailable("a graph file holds no graph")
    if top(p_model, 25):
        raise ScoredUnavailable("the predict graph has local functions")

    def default_opset(model: list) -> int:
        return max((first_field(v, 2, 0) for v in top(model, 8) if first_field(v, 1, b"") in (b"", b"ai.onnx")),
                   default=0)

    if default_opset(p_model) != default_opset(s_model) or top(p_model, 1) != top(s_model, 1):
        raise ScoredUnavailable("the predict and step graphs differ in opset or IR version")
    if default_opset(s_model) < 5:
        raise ScoredUnavailable("opset below 5 (no Reshape with a shape input)")
    s_domains = {first_field(v, 1, b"") for v in top(s_model, 8)}
    if any(first_field(v, 1, b"") not in s_domains for v in top(p_model, 8)):
        raise ScoredUnavailable("the predict graph uses an operator domain the step graph does not import")

    p_graph, s_graph = list(read_fields(top(p_model, 7)[0])), list(read_fields(top(s_model, 7)[0]))
    if any(n == 15 for n, _, _ in p_graph):
        raise ScoredUnavailable("the predict graph has sparse weights")
    p_weights = {first_field(v, 8, b"").decode() for n, v, _ in p_graph if n == 5}
    s_weights = {first_field(v, 8, b"").decode() for n, v, _ in s_graph if n == 5}
    p_inputs = [value_name(v) for n, v, _ in p_graph if n == 11 and value_name(v) not in p_weights]
    s_inputs = {value_name(v) for n, v, _ in s_graph if n == 11 and value_name(v) not in s_weights}
    if asked not in p_inputs or event not in s_inputs:
        raise ScoredUnavailable(f"no predict input {asked!r} or no step input {event!r}")
    kept = set(p_inputs) - {asked}  # the state and shared inputs predict reads (the step's, or inputs of their own)
    extra = [raw for n, v, raw in p_graph if n == 11 and value_name(v) in kept - s_inputs]  # (SimAKT's answer banks)

    # a predict weight with the very bytes of a step weight is read from the step's (the two graphs were exported from
    # one model: one copy in memory, and ONNX Runtime may share the work that reads it)
    def content(tensor: bytes) -> bytes:
        return b"".join(raw for m, _, raw in read_fields(tensor) if m not in (8, 12))  # (all but name and doc)

    s_contents = {content(v): first_field(v, 8, b"").decode() for n, v, _ in s_graph if n == 5}
    alias = {first_field(v, 8, b"").decode(): s_contents.get(content(v)) for n, v, _ in p_graph if n == 5}
    alias = {name: same for name, same in alias.items() if same is not None}

    def rename(name: str) -> str:
        return name if not name or name in kept else alias.get(name, prefix + name)

    nodes = []
    for n, value, _ in p_graph:
        if n != 1:
            continue
        if has_subgraph(value):
            raise ScoredUnavailable("the predict graph has a subgraph (If, Loop or Scan)")
        out = b""
        for m, v, raw in read_fields(value):
            if m in (1, 2):
                out += field_bytes(m, rename(v.decode()))
            elif m == 3:
                out += field_bytes(3, prefix + v.decode())
            else:
                out += raw
        nodes.append(field_bytes(1, out))
    weights = [field_bytes(5, b"".join(field_bytes(8, rename(v.decode())) if m == 8 else raw
                                       for m, v, raw in read_fields(value)))
               for n, value, _ in p_graph if n == 5 and first_field(value, 8, b"").decode() not in alias]
    outputs = [value for n, value, _ in p_graph if n == 12]
    if not outputs:
        raise ScoredUnavailable("the predict graph has no output")
    score = rename(value_name(outputs[0]))
    score_info = field_bytes(1, score) + b"".join(raw for m, _, raw in read_fields(outputs[0]) if m != 1)
    shape = (field_int(1, 2) + field_int(2, INT64) + field_bytes(7, varint(-1) + varint(1))
             + field_bytes(8, prefix + "shape"))
    reshape = field_bytes(1, node_bytes("Reshape", [event, prefix + "shape"], [prefix + asked], prefix + "reshape"))
    graph = (reshape + b"".join(nodes) + b"".join(raw for _, _, raw in s_graph) + b"".join(weights)
             + field_bytes(5, shape) + b"".join(extra) + field_bytes(12, score_info))
    kept_model = b"".join(raw for n, _, raw in s_model if n in (1, 8, 25))  # ir_version, opset_import, functions
    return kept_model + field_bytes(2, "nextstep scored") + field_bytes(7, graph), score


def _feeds(session: ort.InferenceSession, state: dict[str, np.ndarray]) -> tuple[dict, dict]:
    """(per-row example feeds, shared ones) for a session: the state given; every other input with the state's
    batch axis 1 (the unknown row, response 1) with each other named axis 1; one without it (a bank) zeros, each
    named axis BANK_ROWS."""
    feeds, shared = {}, {}
    batch = next(v.shape[0] for v in session.get_inputs() if v.name in state)
    for value in session.get_inputs():
        if value.name in state:
            continue
        dtype = ONNX_TYPES.get(value.type)
        if dtype is None:
            raise ScoredUnavailable(f"input {value.name!r} is of type {value.type}")
        dims = list(value.shape)
        if dims and dims[0] == batch:
            feeds[value.name] = np.ones([1, *(d if isinstance(d, int) else 1 for d in dims[1:])], dtype)
        else:
            shared[value.name] = np.zeros([d if isinstance(d, int) else BANK_ROWS for d in dims], dtype)
    return feeds, shared


def check(scored: ort.InferenceSession, step: ort.InferenceSession, predict: ort.InferenceSession,
          initial: dict[str, np.ndarray], asked: str = "questions", event: str = "question",
          tolerance: float = 1e-5) -> None:
    """From the state one step after the initial state, the scored graph's outputs equal the step graph's and the
    predict graph's run apart (within `tolerance`); ScoredUnavailable otherwise."""
    state = {name: value[None] for name, value in initial.items()}
    feeds, shared = _feeds(scored, state)
    given = {**feeds, **shared}

    def run(session: ort.InferenceSession, state: dict[str, np.ndarray], **also) -> list[np.ndarray]:
        values = {**given, **state, **also}
        return session.run(None, {v.name: values[v.name] for v in session.get_inputs()})

    moved = run(step, state)
    state = {name: moved[i] for i, name in enumerate(initial)}
    want = run(step, state) + [run(predict, state, **{asked: feeds[event].reshape(-1, 1)})[0]]
    got = run(scored, state)
    if len(got) != len(want):
        raise ScoredUnavailable(f"the scored graph has {len(got)} outputs, not {len(want)}")
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.shape != w.shape or g.dtype != w.dtype or not np.allclose(
                g.astype(np.float64), w.astype(np.float64), rtol=tolerance, atol=tolerance, equal_nan=True):
            raise ScoredUnavailable(f"the scored graph's output {i} differs from the two graphs run apart")


def build_scored(predict_path: Path, step_path: Path, options: ort.SessionOptions, predict: ort.InferenceSession,
                 step: ort.InferenceSession, initial: dict[str, np.ndarray]) -> ort.InferenceSession:
    """The scored graph's session, checked (`check`); ScoredUnavailable saying why not."""
    if Path(predict_path).parent != Path(step_path).parent:
        raise ScoredUnavailable("the predict and step graphs are in different folders")
    return open_made(lambda: scored_model(Path(predict_path).read_bytes(), Path(step_path).read_bytes())[0],
                     lambda scored: check(scored, step, predict, initial), Path(step_path).parent, options,
                     ScoredUnavailable, "two graphs")


def open_scored(path: Path, graphs: dict, sessions: dict, input_names: dict, output_names: dict, inside,
            initial: dict[str, np.ndarray], intra_op_threads: int) -> dict:
    """Knowledge tracing's TaskSpec.scored: open the scored step graphs as sessions["scored_step"] and
    ["scored_step_predict"]; where there are none, why (`no_scored`), logged once per artifact. Never refuses the
    artifact: live quality scores it apart."""
    made = {}
    try:
        for graph, name in SCORED.items():
            made[name] = build_scored(inside(graphs["predict"]["onnx"], "predict graph"),
                                      inside(graphs[graph]["onnx"], f"{graph} graph"),
                                      session_options(intra_op_threads), sessions["predict"], sessions[graph], initial)
    except ScoredUnavailable as e:
        return {"no_scored": say_once(path, f"no scored step graphs: {e}",
                                       "live quality scores its events with a second graph call")}
    for name, session in made.items():
        sessions[name] = session
        input_names[name] = [i.name for i in session.get_inputs()]
        output_names[name] = [o.name for o in session.get_outputs()]
    return {}
