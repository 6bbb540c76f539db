"""The fold graph: an artifact's own `step` graph wrapped in an ONNX `Scan`, so that a run of events is folded into a
state in one ONNX Runtime call (StatefulTask.fold) instead of one call per event.

Made when the registry opens an artifact, from the step graph as exported (nothing is re-exported: every artifact,
old ones included, gets one):

    fold(fold/<state>..., fold/<event input> [batch, events, ...]..., <shared input>...) -> fold/<state output>...

* the state inputs and outputs are the step's, named `fold/<name>` (`PREFIX`): the Scan's state variables;
* each per-event input of the step (question and response; item) gains an `events` axis after the batch axis: a
  Scan input over axis 1, so the batch axis stays first and the micro-batcher can put requests with the same number
  of events in one run (different counts never share one: the axis is part of the batcher's key);
* a step input without the state's batch axis (SimAKT's projected banks) is an input of the fold graph under its
  own name, and the Scan body reads it from the outer scope (an ONNX subgraph may) instead of taking it each event;
* the step's outputs after the state (none today) are left out.

The Scan body is the step graph itself, nodes, weights and names unchanged (its inputs reordered, state first, the
shared ones taken out): the fold computes what stepping event by event computes. The outer graph's own names carry
the prefix because a subgraph may not redefine a name of its outer graph.

Where it can, the registry takes the hoisted fold instead (`hoisted_fold_model`): what the step computes from an
event alone (its embeddings, projections, attention over fixed keys) runs once for all the events, before the Scan,
with the events flattened into the batch axis, and only the nodes that read the state stay in the body. The state
is the same to rounding (every row of a step graph is its own); deep_gpcm's body keeps 23 of its 46 nodes (4 of 33
since its ability grid broadcasts instead of being expanded to the state's batch), and a rebuild of 8,900 events took
0.45 and 0.60 of the time in two interleaved runs (bench/event_log.py). A step graph that cannot be split (a node
with a subgraph, nothing per event outside the state's reach) is folded whole.

No `onnx` package here (the service installs ONNX Runtime only): the graph is written at the protobuf wire level
(onnx_wire.py), copying the step graph's bytes and writing the few messages around them. Before it is used, the fold
graph is checked against stepping a few events from the initial state (`check`); where it cannot be built, opened or
does not agree, `build_fold` says why (FoldUnavailable) and the model keeps stepping event by event.
"""

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .onnx_wire import (
    field_bytes,
    field_int,
    first_field,
    has_subgraph,
    int64_tensor,
    node_bytes,
    node_io,
    open_made,
    read_fields,
    renamed,
    tensor_dims,
    tensor_info,
    value_name,
)

log = logging.getLogger(__name__)
FOLD = "fold"  # the graph's name among a model's sessions (LoadedModel.sessions) and in the metrics
EVENTS = "events"  # the name of the events axis


class FoldUnavailable(Exception):
    """Why an artifact gets no fold graph (it steps event by event)."""


@dataclass(frozen=True)
class _Step:
    """A step graph as the fold graphs take it apart (`_parsed`)."""

    model: list  # the ModelProto's fields
    parts: list  # the GraphProto's fields
    inputs: dict[str, bytes]  # input name -> ValueInfoProto (weights left out)
    outputs: list[bytes]  # the next state's ValueInfoProtos, in the state's order
    state: list[str]
    events: list[str]  # the per-event inputs (those with the state's batch axis)
    opset: int
    prefix: str


def _parsed(step: bytes, state: list[str], prefix: str) -> _Step:
    while prefix.encode() in step:  # (a name of the step graph's could clash with the outer graph's)
        prefix = "_" + prefix
    model = list(read_fields(step))
    graph = next((value for n, value, _ in model if n == 7), None)
    if graph is None:
        raise FoldUnavailable("the step graph's file holds no graph")
    opset = max((first_field(value, 2, 0) for n, value, _ in model
                 if n == 8 and first_field(value, 1, b"") in (b"", b"ai.onnx")),
                default=0)
    if opset < 9:
        raise FoldUnavailable(f"the step graph's opset {opset} has no Scan over axis 1 (opset 9 on)")
    parts = list(read_fields(graph))
    weights = {first_field(value, 8, b"").decode() for n, value, _ in parts if n == 5}
    inputs = {value_name(value): value for n, value, _ in parts if n == 11 and value_name(value) not in weights}
    outputs = [value for n, value, _ in parts if n == 12]
    if not set(state) <= set(inputs):
        raise FoldUnavailable(f"the step graph lacks the state inputs {sorted(set(state) - set(inputs))}")
    if len(outputs) < len(state):
        raise FoldUnavailable(f"the step graph has {len(outputs)} outputs for {len(state)} state tensors")
    outputs = outputs[:len(state)]
    for name, out in zip(state, outputs, strict=True):
        (in_type, in_dims), (out_type, out_dims) = tensor_dims(inputs[name]), tensor_dims(out)
        if in_type != out_type or len(in_dims) != len(out_dims):
            raise FoldUnavailable(f"the step graph's output {value_name(out)!r} is not of state {name!r}'s type and "
                                  "rank")
    _, dims = tensor_dims(inputs[state[0]])
    batch = first_field(dims[0], 2) if dims else None
    if not batch:
        raise FoldUnavailable(f"state {state[0]!r} has no named batch axis first")

    def batched(value: bytes) -> bool:
        dims = tensor_dims(value)[1]
        return bool(dims) and first_field(dims[0], 2) == batch

    events = [name for name, value in inputs.items() if name not in state and batched(value)]
    if not events:
        raise FoldUnavailable("the step graph takes no per-event input")
    return _Step(model, parts, inputs, outputs, state, events, opset, prefix)


def _outer_inputs(step: _Step) -> list[bytes]:
    """The fold graph's inputs, in the step's order: the state's and the events' prefixed, the events' with an
    `events` axis after the batch axis; a shared input (a bank) under its own name."""
    out = []
    for name, value in step.inputs.items():
        if name in step.events:
            elem_type, dims = tensor_dims(value)
            out.append(tensor_info(step.prefix + name, elem_type, [dims[0], field_bytes(2, EVENTS), *dims[1:]]))
        elif name in step.state:
            out.append(renamed(value, step.prefix + name))
        else:
            out.append(value)
    return out


def _scan(step: _Step, body: bytes, scanned: list[str]) -> bytes:
    """The Scan node over the events axis (1) of the outer tensors `scanned`, from the prefixed state."""
    p, k = step.prefix, len(scanned)
    attributes = [field_bytes(1, "body") + field_int(20, 5) + field_bytes(6, body),
                  field_bytes(1, "num_scan_inputs") + field_int(20, 2) + field_int(3, k),
                  field_bytes(1, "scan_input_axes") + field_int(20, 7) + b"".join(field_int(8, 1) for _ in range(k))]
    return node_bytes("Scan", [p + n for n in step.state] + scanned, [p + value_name(o) for o in step.outputs],
                      "fold", attributes)


def _model(step: _Step, nodes: list[bytes], weights: bytes = b"") -> bytes:
    """The fold graph's model: the step's IR version, opsets and functions around a graph of `nodes` and `weights`
    (TensorProto fields), the prefixed state as outputs."""
    outer = (b"".join(field_bytes(1, node) for node in nodes) + field_bytes(2, FOLD) + weights
             + b"".join(field_bytes(11, v) for v in _outer_inputs(step))
             + b"".join(field_bytes(12, renamed(o, step.prefix + value_name(o))) for o in step.outputs))
    kept = b"".join(raw for n, _, raw in step.model if n in (1, 8, 25))  # ir_version, opset_import, functions
    return kept + field_bytes(2, "nextstep fold") + field_bytes(7, outer)


def fold_model(step: bytes, state: list[str], prefix: str = "fold/") -> tuple[bytes, list[str], str]:
    """(the fold graph, serialised, of a serialised step graph that takes the state tensors `state` and whose first
    outputs are their next values, in that order; the names of the step's per-event inputs; the prefix of the fold
    graph's own names). FoldUnavailable when the step graph does not fit."""
    step_ = _parsed(step, state, prefix)
    parts, inputs, outputs, events, prefix = step_.parts, step_.inputs, step_.outputs, step_.events, step_.prefix
    # the body: the step graph, its inputs state first then events (the shared ones: the outer graph's), its outputs
    # the next state
    body_outputs, extra_nodes = [], []
    for out in outputs:
        if value_name(out) in inputs:  # a state passed through unchanged: a value of its own, as Scan needs
            passed = f"{prefix}{value_name(out)}/next"
            extra_nodes.append(field_bytes(1, node_bytes("Identity", [value_name(out)], [passed])))
            out = renamed(out, passed)
        body_outputs.append(out)
    body = (b"".join(raw for n, _, raw in parts if n not in (11, 12)) + b"".join(extra_nodes)
            + b"".join(field_bytes(11, inputs[name]) for name in state + events)
            + b"".join(field_bytes(12, out) for out in body_outputs))

    scan = _scan(step_, body, [prefix + n for n in events])
    return _model(step_, [scan]), events, prefix


INT64_MAX = 2 ** 63 - 1
ELEMENT_TYPES = {"tensor(float)": 1, "tensor(uint8)": 2, "tensor(int8)": 3, "tensor(int32)": 6, "tensor(int64)": 7,
                 "tensor(bool)": 9, "tensor(float16)": 10, "tensor(double)": 11}  # ONNX Runtime's -> TensorProto's


def hoisting(step: _Step) -> tuple[list[bytes], list[bytes], list[str]]:
    """How the step graph splits around the Scan (`hoisted_fold_model`): (the nodes that do not read the state,
    computed for every event at once before the Scan; the nodes left in its body; the tensors of the first that the
    body reads, taken one event at a time). A Shape or Size of an event's tensor stays in the body (it would see
    every event as the batch). FoldUnavailable where nothing per event can be hoisted or the graph does not allow
    it (a node with a subgraph, whose outer-scope reads a node's inputs do not list; sparse weights; opset below 10,
    without Slice's inputs)."""
    if step.opset < 10:
        raise FoldUnavailable(f"opset {step.opset}: no Slice with inputs (10 on) to reshape the events with")
    if any(n == 15 for n, _, _ in step.parts):
        raise FoldUnavailable("the step graph has sparse weights")
    in_body, per_event = set(step.state), set(step.events)
    hoisted, body = [], []
    for n, node, _ in step.parts:
        if n != 1:
            continue
        if has_subgraph(node):
            raise FoldUnavailable("a node of the step graph has a subgraph (If, Loop, Scan)")
        inputs, outputs, op = node_io(node)
        if any(i in in_body for i in inputs) or op in ("Shape", "Size") and any(i in per_event for i in inputs):
            body.append(node)
            in_body.update(outputs)
        else:
            hoisted.append(node)
            if any(i in per_event for i in inputs):
                per_event.update(outputs)
    if not any(set(node_io(node)[0]) & per_event for node in hoisted):
        raise FoldUnavailable("every node of the step graph reads the state")
    read = [i for node in body for i in node_io(node)[0]] + [value_name(o) for o in step.outputs]
    return hoisted, body, list(dict.fromkeys(t for t in read if t in per_event))


def probe_model(step: bytes, tensors: list[str]) -> bytes:
    """The step graph with `tensors` among its outputs (names alone: ONNX Runtime infers their types)."""
    extra = b"".join(field_bytes(12, field_bytes(1, t)) for t in tensors)
    return b"".join(field_bytes(7, value + extra) if n == 7 else raw for n, value, raw in read_fields(step))


def hoisted_fold_model(step_: _Step, split: tuple[list[bytes], list[bytes], list[str]], types: dict[str, int]
                       ) -> tuple[bytes, list[str], str]:
    """The fold graph as `fold_model`'s, with what the step computes from an event alone (embeddings, projections,
    attention over fixed keys: `hoisting`) computed for all the events at once, before the Scan, and only what
    reads the state left in its body: the events flattened into the batch axis (batch x events rows), each hoisted
    tensor the body reads (elem types `types`, probed: `probe_model`) reshaped back to (batch, events, ...) and
    scanned over its events axis. Every row of a step graph is its own (the micro-batcher relies on it), so the
    hoisted nodes compute for batch x events rows what the step computes for each: the same state, to rounding.
    `step_` is the parsed step graph (`_parsed`), `split` its `hoisting` (made once by the caller)."""
    hoisted, body_nodes, scanned = split
    p, state = step_.prefix, step_.state
    inside = {t: f"{p}in/{t}" for t in scanned}  # (a body input may not reuse an outer graph's name)

    def renamed_inputs(node: bytes) -> bytes:
        return b"".join(field_bytes(1, inside.get(v.decode(), v.decode())) if n == 1 else raw
                        for n, v, raw in read_fields(node))

    made = {o for node in body_nodes for o in node_io(node)[1]}
    body, outputs = [renamed_inputs(node) for node in body_nodes], []
    for out in step_.outputs:
        name = value_name(out)
        if name not in made:  # (the next state read from elsewhere: a value of its own, as Scan needs)
            body.append(node_bytes("Identity", [inside.get(name, name)], [f"{p}{name}/next"]))
            out = renamed(out, f"{p}{name}/next")
        outputs.append(out)
    body_graph = (b"".join(field_bytes(1, node) for node in body) + field_bytes(2, "fold body")
                  + b"".join(field_bytes(11, step_.inputs[name]) for name in state)
                  + b"".join(field_bytes(11, field_bytes(1, inside[t]) + field_bytes(2, field_bytes(1, field_int(
                      1, types[t])))) for t in scanned)
                  + b"".join(field_bytes(12, out) for out in outputs))

    axis0 = [field_bytes(1, "axis") + field_int(20, 2) + field_int(3, 0)]
    nodes = []
    for name in step_.events:  # (batch, events, ...) -> (batch x events, ...): the hoisted nodes' batch
        nodes += [node_bytes("Shape", [p + name], [f"{p}shape/{name}"]),
                  node_bytes("Slice", [f"{p}shape/{name}", f"{p}2", f"{p}end", f"{p}0"], [f"{p}rest/{name}"]),
                  node_bytes("Concat", [f"{p}-1", f"{p}rest/{name}"], [f"{p}flat/{name}"], attributes=axis0),
                  node_bytes("Reshape", [p + name, f"{p}flat/{name}"], [name])]
    nodes += [node_bytes("Shape", [p + step_.events[0]], [f"{p}shape/events"]),
              node_bytes("Slice", [f"{p}shape/events", f"{p}0", f"{p}2", f"{p}0"], [f"{p}batch_events"]),
              *hoisted]
    for t in scanned:  # (batch x events, ...) -> (batch, events, ...): scanned over the events axis
        nodes += [node_bytes("Shape", [t], [f"{p}shape/{t}"]),
                  node_bytes("Slice", [f"{p}shape/{t}", f"{p}1", f"{p}end", f"{p}0"], [f"{p}rest/{t}"]),
                  node_bytes("Concat", [f"{p}batch_events", f"{p}rest/{t}"], [f"{p}unflat/{t}"], attributes=axis0),
                  node_bytes("Reshape", [t, f"{p}unflat/{t}"], [f"{p}scan/{t}"])]
    nodes.append(_scan(step_, body_graph, [f"{p}scan/{t}" for t in scanned]))
    weights = b"".join(raw for n, _, raw in step_.parts if n == 5) + b"".join(
        field_bytes(5, int64_tensor(f"{p}{v}" if v != INT64_MAX else f"{p}end", [v]))
        for v in (-1, 0, 1, 2, INT64_MAX))
    return _model(step_, nodes, weights), step_.events, p


ONNX_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(double)": np.float64, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


BANK_ROWS = 256  # entries of a check's zero bank: more than any KNN head's k (SimAKT's own is 15)


def _example(value: ort.NodeArg, shape: list[int], fill: int) -> np.ndarray:
    dtype = ONNX_TYPES.get(value.type)
    if dtype is None:
        raise FoldUnavailable(f"input {value.name!r} is of type {value.type}")
    return np.full(shape, fill, dtype=dtype)


def check(fold: ort.InferenceSession, step: ort.InferenceSession, initial: dict[str, np.ndarray],
          events: list[str], prefix: str, n: int = 3, tolerance: float = 1e-5, varied: bool = False) -> None:
    """Fold `n` events from the initial state, and step them one at a time: FoldUnavailable unless the states agree
    within `tolerance`. Every per-event input is 1 (the unknown row, response 1); with `varied`, two entities whose
    events alternate 1 and 0 out of step (what a graph that moves events between rows or steps gets wrong). An input
    without the batch axis (a bank) is zeros, each named axis of size BANK_ROWS (a KNN head's k neighbours need as
    many entries)."""
    rows = 2 if varied else 1
    state = {name: np.stack([value] * rows) for name, value in initial.items()}
    feeds, shared = {}, {}
    for value in step.get_inputs():
        dims = [d if isinstance(d, int) else None for d in value.shape]
        if value.name in events:
            feeds[value.name] = _example(value, [rows, n, *(d or 1 for d in dims[1:])], 1)
            if varied:
                flip = ((np.arange(rows)[:, None] + np.arange(n)[None]) % 2).astype(bool)
                feeds[value.name][flip] = 0
        elif value.name not in state:
            shared[value.name] = _example(value, [d or BANK_ROWS for d in dims], 0)
    stepped = state
    for t in range(n):
        outs = step.run(None, {**stepped, **{k: v[:, t] for k, v in feeds.items()}, **shared})
        stepped = dict(zip(state, outs, strict=False))
    folded = fold.run(None, {**{prefix + k: v for k, v in {**state, **feeds}.items()}, **shared})
    for name, got in zip(state, folded, strict=True):
        want = stepped[name]
        if got.shape != want.shape or got.dtype != want.dtype or not np.allclose(
                got.astype(np.float64), want.astype(np.float64), rtol=tolerance, atol=tolerance):
            raise FoldUnavailable(f"the fold graph's {name!r} after {n} events differs from stepping them")


def build_fold(step_path: Path, state: list[str], options: ort.SessionOptions, step: ort.InferenceSession,
               initial: dict[str, np.ndarray]) -> tuple[ort.InferenceSession, list[str], str]:
    """(the fold graph's session, the step's per-event inputs, the prefix of the fold graph's names for the state and
    those inputs), checked against the step graph's session (`check`): the hoisted one (`hoisted_fold_model`) where
    it can be made and agrees (with varied events too), else the step graph whole in the Scan (`fold_model`);
    FoldUnavailable saying why neither."""
    source, folder = Path(step_path).read_bytes(), Path(step_path).parent
    made = {}

    def hoisted() -> bytes:
        step_ = _parsed(source, state, "fold/")
        split = hoisting(step_)
        scanned = split[2]
        probe = open_made(lambda: probe_model(source, scanned), lambda session: None, folder, options,
                          FoldUnavailable, "step graph")
        types = {o.name: ELEMENT_TYPES.get(o.type, 0) for o in probe.get_outputs()}
        if not all(types.get(t) for t in scanned):
            raise FoldUnavailable(f"a hoisted tensor of a type the fold cannot declare: {types}")
        proto, made["events"], made["prefix"] = hoisted_fold_model(step_, split, types)
        return proto

    def whole() -> bytes:
        proto, made["events"], made["prefix"] = fold_model(source, state)
        return proto

    def checked(fold: ort.InferenceSession, varied: bool) -> None:
        check(fold, step, initial, made["events"], made["prefix"])
        if varied:
            check(fold, step, initial, made["events"], made["prefix"], n=5, varied=True)

    try:
        session = open_made(hoisted, lambda fold: checked(fold, True), folder, options, FoldUnavailable, "step graph")
    except FoldUnavailable as why:
        log.debug("%s: no hoisted fold graph (%s): the step graph whole in the Scan", step_path, why)
        session = open_made(whole, lambda fold: checked(fold, False), folder, options, FoldUnavailable, "step graph")
    return session, made["events"], made["prefix"]
