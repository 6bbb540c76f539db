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

No `onnx` package here (the service installs ONNX Runtime only): the graph is written at the protobuf wire level
(onnx_wire.py), copying the step graph's bytes and writing the few messages around them. Before it is used, the fold
graph is checked against stepping a few events from the initial state (`check`); where it cannot be built, opened or
does not agree, `build_fold` says why (FoldUnavailable) and the model keeps stepping event by event.
"""

from pathlib import Path

import numpy as np
import onnxruntime as ort

from .onnx_wire import (
    field_bytes,
    field_int,
    first_field,
    node_bytes,
    open_made,
    read_fields,
    renamed,
    tensor_dims,
    tensor_info,
    value_name,
)

FOLD = "fold"  # the graph's name among a model's sessions (LoadedModel.sessions) and in the metrics
EVENTS = "events"  # the name of the events axis


class FoldUnavailable(Exception):
    """Why an artifact gets no fold graph (it steps event by event)."""


def fold_model(step: bytes, state: list[str], prefix: str = "fold/") -> tuple[bytes, list[str], str]:
    """(the fold graph, serialised, of a serialised step graph that takes the state tensors `state` and whose first
    outputs are their next values, in that order; the names of the step's per-event inputs; the prefix of the fold
    graph's own names). FoldUnavailable when the step graph does not fit."""
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

    k = len(events)
    attributes = [field_bytes(1, "body") + field_int(20, 5) + field_bytes(6, body),
                  field_bytes(1, "num_scan_inputs") + field_int(20, 2) + field_int(3, k),
                  field_bytes(1, "scan_input_axes") + field_int(20, 7) + b"".join(field_int(8, 1) for _ in range(k))]
    scan = node_bytes("Scan", [prefix + n for n in state + events], [prefix + value_name(o) for o in outputs], "fold",
                 attributes)
    outer_inputs = []
    for name in inputs:  # in the step's order
        if name in events:
            elem_type, dims = tensor_dims(inputs[name])
            outer_inputs.append(tensor_info(prefix + name, elem_type, [dims[0], field_bytes(2, EVENTS), *dims[1:]]))
        elif name in state:
            outer_inputs.append(renamed(inputs[name], prefix + name))
        else:
            outer_inputs.append(inputs[name])
    outer = (field_bytes(1, scan) + field_bytes(2, FOLD) + b"".join(field_bytes(11, v) for v in outer_inputs)
             + b"".join(field_bytes(12, renamed(o, prefix + value_name(o))) for o in outputs))
    kept = b"".join(raw for n, _, raw in model if n in (1, 8, 25))  # ir_version, opset_import, functions
    return kept + field_bytes(2, "nextstep fold") + field_bytes(7, outer), events, prefix


ONNX_TYPES = {"tensor(int64)": np.int64, "tensor(int32)": np.int32, "tensor(float)": np.float32,
              "tensor(double)": np.float64, "tensor(float16)": np.float16, "tensor(bool)": np.bool_}


BANK_ROWS = 256  # entries of a check's zero bank: more than any KNN head's k (SimAKT's own is 15)


def _example(value: ort.NodeArg, shape: list[int], fill: int) -> np.ndarray:
    dtype = ONNX_TYPES.get(value.type)
    if dtype is None:
        raise FoldUnavailable(f"input {value.name!r} is of type {value.type}")
    return np.full(shape, fill, dtype=dtype)


def check(fold: ort.InferenceSession, step: ort.InferenceSession, initial: dict[str, np.ndarray],
          events: list[str], prefix: str, n: int = 3, tolerance: float = 1e-5) -> None:
    """Fold `n` events from the initial state, and step them one at a time: FoldUnavailable unless the states agree
    within `tolerance`. Every per-event input is 1 (the unknown row, response 1); an input without the batch axis
    (a bank) is zeros, each named axis of size BANK_ROWS (a KNN head's k neighbours need as many entries)."""
    state = {name: value[None] for name, value in initial.items()}
    feeds, shared = {}, {}
    for value in step.get_inputs():
        dims = [d if isinstance(d, int) else None for d in value.shape]
        if value.name in events:
            feeds[value.name] = _example(value, [1, n, *(d or 1 for d in dims[1:])], 1)
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
    those inputs), checked against the step graph's session (`check`); FoldUnavailable saying why not."""
    made = {}

    def make() -> bytes:
        proto, made["events"], made["prefix"] = fold_model(Path(step_path).read_bytes(), state)
        return proto

    session = open_made(make, lambda fold: check(fold, step, initial, made["events"], made["prefix"]),
                        Path(step_path).parent, options, FoldUnavailable, "step graph")
    return session, made["events"], made["prefix"]
