"""The one export and parity harness: a streaming model (models/streaming.py) -> graphs, state, manifest.

The artifact directory is the contract between training and serving (docs/architecture.md):

    manifest.json                 what the service needs: state tensors, graphs and their I/O, vocabularies
    <graph>.onnx, <graph>.pt      ONNX (dynamo exporter, opset 18) and TorchScript of each graph
    state_<name>.npy              the initial value of each per-entity state tensor (one entity)
    parity.npz                    the held-out sequences parity was checked on (what `reexport` checks again)
    weights.pt                    PyTorch state dict + config + family, to evaluate, fine-tune or re-export

A task describes its graphs with an `Exporter` (in its subpackage: kt/export.py, kt/simakt_export.py,
next_item/export.py, srs/time_aware_export.py). Every graph wraps one function of the streaming contract:

    step           (*state, *event) -> *state_next                     `Exporter.event` names the event inputs
                   (+ the first `step_shared` shared inputs)
    readout        (*state, *query, *shared) -> outputs                `answer` names the outputs
    step_readout   (*state, *event, *query, *shared) -> *state_next, outputs   one call per serving event
    extra          a family's own function of its shared data (SimAKT's bank_project)

Parity is checked here, once for every family, on real held-out sequences (B, T): walking t = 0 .. T-1, the
eager readout before event t against the eager full pass (`forward`) at t (<= the exporter's step_tolerance,
STEP_TOLERANCE unless a family states its own), every exported graph in TorchScript and ONNX Runtime against
eager PyTorch on the same inputs, the state included, and the readout of each engine's own stepped state along
the sequence (all <= ENGINE_TOLERANCE). An export that misses fails with ParityError.
"""

import json
import logging
import pickle
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from ..models.streaming import State, StreamingModel, state_names

OPSET = 18
STEP_TOLERANCE = 1e-5  # full-sequence pass vs stepping through it, eager
ENGINE_TOLERANCE = 1e-4  # eager vs TorchScript vs ONNX Runtime
PARITY_FILE = "parity.npz"


class ParityError(RuntimeError):
    """The exported graphs do not compute what the PyTorch model computes."""


@dataclass
class Graph:
    """One exported graph: the contract function it wraps, its I/O names, example inputs and dynamic axes."""

    name: str  # file stem and manifest key
    kind: str  # "step", "readout", "step_readout" or "extra"
    inputs: list[str]
    outputs: list[str]
    example: tuple
    dynamic: list[dict]  # per input: {axis: torch.export.Dim}
    torchscript: bool = True  # also write <name>.pt
    fn: Callable | None = None  # kind "extra": inputs -> tuple of outputs


class Exporter:
    """How one task's models become graphs and how parity walks them. Subclasses set the names and hooks;
    `graphs` and the harness do the rest."""

    event: tuple[str, ...]  # step inputs after the state
    query: tuple[str, ...]  # readout inputs after the state
    readout_name = "predict"  # the readout graph; the fused graph is step_<readout_name>
    step_graph = True  # False: only readout graphs (the service keeps the state as raw rows)
    step_shared = 0  # how many of the shared inputs (the first ones) the step graphs take (SimAKT: block 3's banks)
    state_files = True  # state_<name>.npy and the manifest's `state` section
    step_tolerance = STEP_TOLERANCE  # full pass vs stepping; a family with a rounded state states its own

    def __init__(self, model: StreamingModel):
        serving = getattr(model.eval(), "for_serving", None)  # a family's faster form of the same step and readout
        self.model = serving() if serving else model  # (a serving form takes the model's mode: eval)

    # -- hooks --------------------------------------------------------------------------------------------
    def answer(self, state: State, *query_and_shared) -> dict[str, torch.Tensor]:
        """The readout graph's outputs, by name."""
        raise NotImplementedError

    def advance(self, state: State, event: tuple, shared: tuple) -> State:
        """The step graph's function: the state after one event (`shared`: the first `step_shared` shared inputs)."""
        return self.model.step(state, *event)

    def parity_sequence(self, sequence: tuple) -> tuple:
        """The held-out sequences parity walks (a family may lengthen them: SimAKT past its chunk boundaries)."""
        return sequence

    def walk(self, sequence: tuple) -> Iterator[tuple[tuple, tuple]]:
        """(event, query) at each position of the held-out sequences: the query is answered before the event."""
        raise NotImplementedError

    def full(self, sequence: tuple) -> tuple[torch.Tensor, ...]:
        """The teacher-forced full pass, (B, T, ...) tensors: at t what `stepped` gives before event t."""
        raise NotImplementedError

    def stepped(self, state: State, query: tuple) -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def dims(self, dim: Callable) -> dict[str, dict]:
        """Dynamic axes of inputs beyond the batch axis, by input name (state, event, query or shared)."""
        raise NotImplementedError

    def widen(self, query: tuple) -> tuple:
        """An example query with every dynamic axis >= 2 (the exporter specialises axes of size 1)."""
        return query

    def shared(self) -> dict[str, torch.Tensor]:
        """Inputs every readout graph takes after the query, without a batch axis (SimAKT's bank keys)."""
        return {}

    def extra_graphs(self) -> list[Graph]:
        return []

    def properties(self, sessions: dict[str, ort.InferenceSession], sequence: tuple) -> dict:
        """What the family promises of its exported graphs beyond parity, checked on the held-out sequences with
        ONNX Runtime (`sessions` by graph name): fields for the manifest's parity section, with `passed`. The harness
        runs it first on the eager graphs (EagerSession), so that a model that breaks a promise is refused in
        seconds."""
        return {}

    def compare(self, state: State, query: tuple, eager: dict, engine: list[np.ndarray]) -> tuple[float, int]:
        """(max abs difference of an engine's readout from eager, rows it got wrong)."""
        return max((_diff(a, b) for a, b in zip(eager.values(), engine, strict=True)), default=0.0), 0

    def config(self) -> dict:
        return asdict(self.model.cfg)

    def manifest(self) -> dict:
        """Task-specific manifest fields (task, vocabularies, top_k, banks...)."""
        return {}

    def write(self, out_dir: Path) -> None:
        """Task-specific files (vocabulary, banks)."""

    @classmethod
    def from_artifact(cls, model: StreamingModel, artifact_dir: Path, manifest: dict) -> "Exporter":
        """The exporter of an artifact's model with the artifact's own files (vocabulary, banks, top_k)."""
        return cls(model)

    # -- the graphs ------------------------------------------------------------------------------------------
    def graphs(self, sequence: tuple) -> list[Graph]:
        """Every graph, with examples taken from the first two held-out sequences stepped half way."""
        names = state_names(self.model)
        rows = tuple(x[:2] for x in sequence)
        walk = list(self.walk(rows))
        half = len(walk) // 2
        shared = self.shared()
        with torch.no_grad():
            state = self.model.init_state(2)
            for event, _ in walk[:half]:
                state = self.advance(state, event, tuple(shared.values())[:self.step_shared])
            state = tuple(state)
            event, query = walk[half][0], self.widen(walk[half][1])
            outputs = list(self.answer(state, *query, *shared.values()))
        batch = torch.export.Dim("batch")
        dims = self.dims(torch.export.Dim)
        state_dyn = [{0: batch, **dims.get(n, {})} for n in names]
        ev = [{0: batch, **dims.get(n, {})} for n in self.event]
        qu = [{0: batch, **dims.get(n, {})} for n in self.query]
        sh = [dims.get(n, {}) for n in shared]
        nxt = [f"{n}_next" for n in names]
        graphs = [Graph(self.readout_name, "readout", [*names, *self.query, *shared], outputs,
                        (*state, *query, *shared.values()), [*state_dyn, *qu, *sh])]
        if self.step_graph:
            into = dict(list(shared.items())[:self.step_shared])
            graphs = [Graph("step", "step", [*names, *self.event, *into], nxt, (*state, *event, *into.values()),
                            [*state_dyn, *ev, *sh[:len(into)]]),
                      *graphs,
                      Graph(f"step_{self.readout_name}", "step_readout", [*names, *self.event, *self.query, *shared],
                            [*nxt, *outputs], (*state, *event, *query, *shared.values()),
                            [*state_dyn, *ev, *qu, *sh], torchscript=False)]
        return graphs + self.extra_graphs()


class GraphModule(nn.Module):
    """A graph as a module: the model is a submodule, so exporting and tracing see its weights."""

    def __init__(self, exporter: Exporter, graph: Graph):
        super().__init__()
        self.model, self.exporter, self.graph = exporter.model, exporter, graph
        self.n_state = len(state_names(exporter.model))
        self.n_shared = len(exporter.shared())  # a step_readout's last inputs; a step takes the first step_shared

    def forward(self, *inputs):
        kind = self.graph.kind
        if kind == "extra":
            return tuple(self.graph.fn(*inputs))
        state, rest = tuple(inputs[:self.n_state]), inputs[self.n_state:]
        if kind == "readout":
            return tuple(self.exporter.answer(state, *rest).values())
        n = len(self.exporter.event)
        shared = rest[n:] if kind == "step" else rest[len(rest) - self.n_shared:] if self.n_shared else ()
        state = tuple(self.exporter.advance(state, rest[:n], shared[:self.exporter.step_shared]))
        if kind == "step":
            return state
        return (*state, *self.exporter.answer(state, *rest[n:]).values())


# ----------------------------------------------------------------------------------------------- the harness

def export(exporter: Exporter, out_dir: Path, *, manifest: dict, sequence: tuple) -> dict:
    """Write every graph, the initial state, weights.pt, the task's files and manifest.json into out_dir;
    raise ParityError if any graph misses parity on `sequence` (held-out (B, T) tensors, B >= 2).

    `manifest` carries the caller's fields (name, version, metrics, data provenance...); the harness adds the
    graph, state, weights and parity sections and the exporter its own."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = exporter.model
    sequence = exporter.parity_sequence(sequence)
    graphs = exporter.graphs(sequence)
    early = exporter.properties({g.name: EagerSession(exporter, g) for g in graphs}, sequence)
    if not early.get("passed", True):  # the model itself breaks a promise: refused before minutes of export
        raise ParityError(f"the {model.family} model breaks its promises in eager PyTorch, before export: {early}")
    engines = {"torchscript": {}, "onnxruntime": {}}
    entries = {}
    for g in graphs:
        module = GraphModule(exporter, g)
        _export_onnx(module, g, out_dir / f"{g.name}.onnx")
        engines["onnxruntime"][g.name] = onnx_session(out_dir / f"{g.name}.onnx")
        entries[g.name] = {"onnx": f"{g.name}.onnx"}
        if g.torchscript:
            engines["torchscript"][g.name] = _trace(module, g.example, out_dir / f"{g.name}.pt")
            entries[g.name]["torchscript"] = f"{g.name}.pt"
        entries[g.name].update(io(engines["onnxruntime"][g.name]))

    parity = check_parity(exporter, graphs, engines, sequence)
    properties = exporter.properties(engines["onnxruntime"], sequence)
    parity.update(properties, passed=parity["passed"] and properties.get("passed", True))
    if not parity["passed"]:
        raise ParityError(f"exported {model.family} graphs disagree with the model: {parity}")

    spec = model.state_spec()
    if exporter.state_files:
        save_initial_state(model, spec, out_dir)
    exporter.write(out_dir)
    np.savez(out_dir / PARITY_FILE, *(x.numpy() for x in sequence))
    config = exporter.config()
    torch.save({"state_dict": model.state_dict(), "config": config, "family": model.family}, out_dir / "weights.pt")
    manifest = {
        **manifest,
        "task": model.task,
        "family": model.family,
        "model_config": config,
        **({"state": spec} if exporter.state_files else {}),
        "graphs": entries,
        **exporter.manifest(),
        "weights": "weights.pt",
        "onnx_opset": OPSET,
        "parity": {**parity, "inputs": PARITY_FILE},
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=_json_default))
    return manifest


def check_parity(exporter: Exporter, graphs: list[Graph], engines: dict[str, dict], sequence: tuple) -> dict:
    """Max abs differences: full pass vs stepping (eager), and eager vs each engine for every graph on the eager
    state and for the readout on the engine's own stepped state, along the held-out sequences. `engines` maps an
    engine name to its graphs by name (TorchScript modules or ONNX Runtime sessions; a graph an engine lacks is
    skipped)."""
    model, names = exporter.model, state_names(exporter.model)
    by_kind = {g.kind: g for g in graphs}
    diffs = {"full_vs_step": 0.0, "eager_vs_torchscript": 0.0, "eager_vs_onnxruntime": 0.0, "bad_rows": 0}

    def run(engine: str, g: Graph | None, values: dict) -> list[np.ndarray] | None:
        graph = engines[engine].get(g.name) if g else None
        if graph is None:
            return None
        if isinstance(graph, ort.InferenceSession):  # only the inputs the graph kept (unused ones are pruned)
            return graph.run(None, {i.name: _numpy(values[i.name]) for i in graph.get_inputs()})
        return [_numpy(x) for x in graph(*(values[n] for n in g.inputs))]

    def states(key: str, eager: State, engine: list | None) -> None:
        for a, b in zip(eager, engine or (), strict=engine is not None):
            diffs[key] = max(diffs[key], _diff(a, b))

    def answers(key: str, state: State, query: tuple, eager: dict, engine: list | None) -> None:
        if engine is not None:
            diff, bad = exporter.compare(state, query, eager, engine)
            diffs[key], diffs["bad_rows"] = max(diffs[key], diff), diffs["bad_rows"] + bad

    with torch.no_grad():
        for g in graphs:  # every graph on its own example inputs
            if g.kind == "extra":
                for engine in engines:
                    states(f"eager_vs_{engine}", g.fn(*g.example), run(engine, g, dict(zip(g.inputs, g.example,
                                                                                              strict=True))))
        shared = exporter.shared()
        full = exporter.full(sequence)
        B = sequence[0].shape[0]
        eager = tuple(model.init_state(B))
        held = {engine: eager for engine in engines}  # each engine's own state, as it stepped it
        steps = 0
        for t, (event, query) in enumerate(exporter.walk(sequence)):
            steps += 1
            for a, f in zip(exporter.stepped(eager, query), full, strict=True):
                diffs["full_vs_step"] = max(diffs["full_vs_step"], _diff(a, f[:, t]))
            before = exporter.answer(eager, *query, *shared.values())
            following = tuple(exporter.advance(eager, event, tuple(shared.values())[:exporter.step_shared]))
            after = exporter.answer(following, *query, *shared.values())
            inputs = {**dict(zip(exporter.event, event, strict=True)), **dict(zip(exporter.query, query, strict=True)),
                      **shared}
            fixed = {**dict(zip(names, eager, strict=True)), **inputs}
            for engine, state in held.items():
                key = f"eager_vs_{engine}"
                own = {**dict(zip(names, state, strict=True)), **inputs}
                answers(key, eager, query, before, run(engine, by_kind["readout"], own))
                fused = run(engine, by_kind.get("step_readout"), fixed)
                if fused is not None:
                    states(key, following, fused[:len(names)])
                    answers(key, following, query, after, fused[len(names):])
                states(key, following, run(engine, by_kind.get("step"), fixed))
                stepped = run(engine, by_kind.get("step"), own)
                held[engine] = following if stepped is None else tuple(torch.from_numpy(x) for x in stepped)
            eager = following
    diffs["passed"] = (diffs["full_vs_step"] <= exporter.step_tolerance
                       and diffs["eager_vs_torchscript"] <= ENGINE_TOLERANCE
                       and diffs["eager_vs_onnxruntime"] <= ENGINE_TOLERANCE and diffs["bad_rows"] == 0)
    diffs.update(batch=int(B), steps=steps, step_tolerance=exporter.step_tolerance, engine_tolerance=ENGINE_TOLERANCE)
    return diffs


def reexport(artifact_dir: Path, out_dir: Path, exporter: type[Exporter], build: Callable[[str, dict, dict], nn.Module]
             ) -> dict:
    """A fresh artifact from an artifact's weights.pt, with its manifest's fields, parity checked again on the
    held-out sequences the artifact was checked on. `exporter`: the task's Exporter class; `build(family,
    config, state dict)` the model (families.restore builds any family)."""
    artifact_dir = Path(artifact_dir)
    model, manifest = load_weights(artifact_dir, build)
    with np.load(artifact_dir / manifest["parity"]["inputs"]) as parity:
        sequence = tuple(torch.from_numpy(parity[f"arr_{i}"]) for i in range(len(parity.files)))
    return export(exporter.from_artifact(model, artifact_dir, manifest), out_dir, manifest=manifest,
                  sequence=sequence)


def load_weights(artifact_dir: Path, build: Callable[[str, dict, dict], nn.Module]) -> tuple[nn.Module, dict]:
    """(the model of an artifact's weights.pt, in eval mode; its manifest). `build(family, config, state dict)`
    makes the model with those weights."""
    manifest = json.loads((Path(artifact_dir) / "manifest.json").read_text())
    if not isinstance(manifest, dict) or not isinstance(manifest.get("weights"), str):
        raise ValueError(f"{artifact_dir}: its manifest names no weights file, so it holds graphs only (as the "
                         "bundled demo models do): it can be served, not evaluated or exported again")
    try:
        saved = torch.load(Path(artifact_dir) / manifest["weights"], weights_only=True)
        return build(saved["family"], saved["config"], saved["state_dict"]).eval(), manifest
    except (OSError, RuntimeError, KeyError, TypeError, pickle.UnpicklingError) as exc:
        raise ValueError(f"{Path(artifact_dir) / manifest['weights']}: not weights this version can read "
                         f"({type(exc).__name__}: {exc})") from None


# ----------------------------------------------------------------------------------------------- engines and files

class EagerSession:
    """A graph run by eager PyTorch behind ONNX Runtime's session interface (`get_inputs`, `get_outputs`, `run`),
    so that `Exporter.properties` can check the model's promises before the export spends minutes on its graphs."""

    def __init__(self, exporter: Exporter, graph: Graph):
        self.module, self.graph = GraphModule(exporter, graph), graph

    def get_inputs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n) for n in self.graph.inputs]

    def get_outputs(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(name=n) for n in self.graph.outputs]

    def run(self, names: list[str] | None, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with torch.no_grad():
            out = self.module(*(torch.from_numpy(np.asarray(feeds[n])) for n in self.graph.inputs))
        return [_numpy(x) for x in out]


def _softplus(self, beta: float = 1.0, threshold: float = 20.0):
    """aten.softplus at its defaults as ONNX's one Softplus node: the exporter's own translation spells out
    torch's beta and threshold in five nodes (Mul, Softplus, Div, Greater, Where) for every call, and a small graph's
    ONNX Runtime time is mostly per node. log(1 + e^x) is within float32 rounding of x past torch's threshold of 20,
    where torch returns x itself."""
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.nn import aten_softplus

    if beta == 1.0 and threshold == 20.0:
        return op.Softplus(self)
    return aten_softplus(self, beta, threshold)


def _export_onnx(module: nn.Module, g: Graph, path: Path) -> None:
    for noisy in ("onnxscript", "torch.onnx", "onnx_ir"):  # the exporter logs every folding decision
        logging.getLogger(noisy).setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, g.example, dynamic_shapes=(tuple(g.dynamic),), opset_version=OPSET,
                                    dynamo=True, optimize=False, verbose=False,
                                    custom_translation_table={torch.ops.aten.softplus.default: _softplus})
    optimize_graph(program.model)
    # named after the clean-up, as the exporter names them after its own (in order, as many as it kept): a state
    # passed through unchanged is then an Identity from the input to the output, each with its own name
    for value, name in zip(program.model.graph.inputs, g.inputs, strict=False):
        value.name = name
    for value, name in zip(program.model.graph.outputs, g.outputs, strict=False):
        value.name = name
    program.save(str(path))


def optimize_graph(model) -> None:
    """The exporter's graph clean-up (`torch.onnx.export(optimize=True)`: onnxscript's `optimize_ir`, which this
    follows pass by pass) without its pattern rewrite rules, in place on an onnx_ir model: functions inlined,
    constants folded (twice at most), dead nodes and duplicate initializers dropped, common subexpressions merged, a
    graph input returned as an output given an Identity. The rewrite rules took 73-90% of the optimizer's time and
    about a sixth of a time-aware export (bench/export_time.py, docs/decisions.md) for 2-16% fewer nodes and no
    faster ONNX Runtime session: the session rewrites the graph itself at load (ORT_ENABLE_ALL)."""
    import onnx_ir as ir
    import onnx_ir.passes.common as common
    from onnxscript.optimizer import fold_constants_ir

    common.InlinePass()(model)
    for _ in range(2):
        folded = fold_constants_ir(model, onnx_shape_inference=True).modified
        pruned = ir.passes.Sequential(common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(),
                                      common.RemoveUnusedOpsetsPass())(model).modified
        if not (folded or pruned):
            break
    ir.passes.Sequential(common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
                         common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
                         common.CommonSubexpressionEliminationPass(), common.OutputFixPass(),
                         common.NameFixPass())(model)


def _trace(module: nn.Module, example: tuple, path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(module, example, check_trace=False)
    traced.save(str(path))
    return traced


def onnx_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def save_initial_state(model: StreamingModel, spec: list[dict], out_dir: Path) -> None:
    """One entity's initial value of each state tensor as state_<name>.npy; records the file in `spec`."""
    with torch.no_grad():
        for s, tensor in zip(spec, model.init_state(1), strict=True):
            np.save(out_dir / f"state_{s['name']}.npy", tensor[0].numpy())
            s["file"] = f"state_{s['name']}.npy"


def io(session: ort.InferenceSession) -> dict:
    """A graph's real inputs and outputs, read back from ONNX Runtime (the exporter may prune inputs)."""
    return {"inputs": [{"name": i.name, "shape": i.shape, "dtype": i.type} for i in session.get_inputs()],
            "outputs": [{"name": o.name, "shape": o.shape, "dtype": o.type} for o in session.get_outputs()]}


def _numpy(x) -> np.ndarray:
    return x.detach().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def _diff(a, b) -> float:
    """Max abs difference; float16 values one rounding step apart count as equal (engines compute the value
    before rounding to slightly different float32 digits)."""
    a, b = _numpy(a), _numpy(b)
    half = np.float16 in (a.dtype, b.dtype)
    a, b = a.astype(np.float64), b.astype(np.float64)
    if a.shape != b.shape:
        return float("inf")
    both = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(a[~both], b[~both], equal_nan=True):  # inf, -inf and NaN must match exactly
        return float("inf")
    gap = np.abs(a[both] - b[both])
    if half:
        gap = np.maximum(gap - np.spacing(np.maximum(np.abs(a[both]), np.abs(b[both])).astype(np.float16)), 0.0)
    return float(gap.max(initial=0.0))


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")
