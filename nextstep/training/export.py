"""Export a trained streaming model to ONNX and TorchScript, prove parity, write the manifest.

The artifact directory is the contract between training and serving (docs/architecture.md):

    manifest.json                 what the service needs: state tensors, graphs and their I/O, vocabularies
    step.onnx, predict.onnx       init_state is data (state_*.npy), step and predict are graphs
    step_predict.onnx             step then predict fused: one call per serving event
    step.pt, predict.pt           TorchScript of the same two functions
    state_<name>.npy              the initial value of each per-entity state tensor (one entity)
    vocab_questions.json          external question id -> model index
    weights.pt                    PyTorch state dict + config, to evaluate or fine-tune offline

Parity is checked here, at export, on real sequences when given: eager full-sequence vs eager
step-by-step vs TorchScript vs ONNX Runtime. An export that does not hold parity fails.
"""

import json
import logging
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from ..models.deep_gpcm import DeepGPCM

OPSET = 18
STEP_TOLERANCE = 1e-5  # full-sequence pass vs stepping through it, eager
ENGINE_TOLERANCE = 1e-4  # eager vs TorchScript vs ONNX Runtime
IRT_OUTPUTS = ("theta", "alpha", "beta")  # after the probabilities, for the families whose readout has them


def readout_outputs(out) -> tuple:
    """A knowledge-tracing readout as graph outputs: probabilities, then theta, alpha, beta where present."""
    return (out.log_probs.exp(), *(getattr(out, f) for f in IRT_OUTPUTS if getattr(out, f, None) is not None))


def readout_names(model) -> list[str]:
    with torch.no_grad():
        out = model.readout(model.init_state(1), torch.zeros(1, 1, dtype=torch.long))
    return ["probs", *(f for f in IRT_OUTPUTS if getattr(out, f, None) is not None)]


class ParityError(RuntimeError):
    """The exported graphs do not compute what the PyTorch model computes."""


class StepGraph(nn.Module):
    """(*state, question (B,), response (B,)) -> next state tensors, for any knowledge-tracing streaming model
    (DeepGPCM, SimAKT)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        *state, question, response = inputs
        return tuple(self.model.step(tuple(state), question, response))


class StepPredictGraph(nn.Module):
    """(*state, question (B,), response (B,), questions (B, M)) -> (*next state, probs, theta, alpha, beta).

    One serving event (fold in what the learner just did, then answer for the next questions) in one
    ONNX Runtime call instead of two."""

    def __init__(self, model: DeepGPCM):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        *state, question, response, questions = inputs
        state = self.model.step(tuple(state), question, response)
        out = self.model.readout(state, questions)
        return (*state, *readout_outputs(out))


class PredictGraph(nn.Module):
    """(*state, questions (B, M)) -> probs (B, M, K), theta (B, M), alpha (B, M), beta (B, M, K-1)."""

    def __init__(self, model: DeepGPCM):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        *state, questions = inputs
        out = self.model.readout(tuple(state), questions)
        return readout_outputs(out)


def _export_onnx(graph: nn.Module, example: tuple, names: list[str], outputs: list[str], path: Path,
                 dynamic: list[dict]) -> None:
    for noisy in ("onnxscript", "torch.onnx", "onnx_ir"):  # the exporter logs every folding decision
        logging.getLogger(noisy).setLevel(logging.ERROR)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(graph, example, input_names=names, output_names=outputs,
                                    dynamic_shapes=(tuple(dynamic),), opset_version=OPSET, dynamo=True,
                                    verbose=False)
    program.save(str(path))


def _trace(graph: nn.Module, example: tuple, path: Path) -> torch.jit.ScriptModule:
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(graph, example, check_trace=False)
    traced.save(str(path))
    return traced


def onnx_session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def check_parity(model: DeepGPCM, questions: torch.Tensor, responses: torch.Tensor, step_ts, predict_ts,
                 step_onnx: ort.InferenceSession, predict_onnx: ort.InferenceSession,
                 fused_onnx: ort.InferenceSession) -> dict:
    """Run one batch of sequences (B, T) through every engine; return max abs differences of all outputs."""
    names = [s["name"] for s in model.state_spec()]
    step_inputs = [i.name for i in step_onnx.get_inputs()]
    predict_inputs = [i.name for i in predict_onnx.get_inputs()]
    fused_inputs = [i.name for i in fused_onnx.get_inputs()]
    B, T = questions.shape
    with torch.no_grad():
        full = model(questions, responses)
        full = readout_outputs(full)
        eager, ts = model.init_state(B), model.init_state(B)
        ort_state = {n: t.numpy() for n, t in zip(names, model.init_state(B), strict=True)}
        diffs = {"full_vs_step": 0.0, "eager_vs_torchscript": 0.0, "eager_vs_onnxruntime": 0.0}
        for t in range(T):
            q, r = questions[:, t], responses[:, t]
            qm = q.unsqueeze(1)
            stepped = model.readout(eager, qm)
            stepped = readout_outputs(stepped)
            scripted = predict_ts(*ts, qm)
            feeds = {**ort_state, "questions": qm.numpy()}
            onnx_out = predict_onnx.run(None, {k: feeds[k] for k in predict_inputs})
            for a, b, c, f in zip(stepped, scripted, onnx_out, full, strict=True):
                diffs["full_vs_step"] = max(diffs["full_vs_step"], (a[:, 0] - f[:, t]).abs().max().item())
                diffs["eager_vs_torchscript"] = max(diffs["eager_vs_torchscript"], (a - b).abs().max().item())
                diffs["eager_vs_onnxruntime"] = max(diffs["eager_vs_onnxruntime"],
                                                    float(np.abs(a.numpy() - c).max()))
            feeds = {**ort_state, "question": q.numpy(), "response": r.numpy(), "questions": qm.numpy()}
            fused = fused_onnx.run(None, {k: feeds[k] for k in fused_inputs})
            eager = model.step(eager, q, r)
            after = model.readout(eager, qm)
            for a, c in zip((*eager, *readout_outputs(after)), fused, strict=True):
                diffs["eager_vs_onnxruntime"] = max(diffs["eager_vs_onnxruntime"],
                                                    float(np.abs(a.numpy().astype(np.float64) - c).max()))
            ts = step_ts(*ts, q, r)
            ort_state = dict(zip(names, step_onnx.run(None, {k: feeds[k] for k in step_inputs}), strict=True))
        for a, c in zip(eager, ort_state.values(), strict=True):  # the final states must agree too
            diffs["eager_vs_onnxruntime"] = max(diffs["eager_vs_onnxruntime"],
                                                float(np.abs(a.numpy().astype(np.float64) - c).max()))
    diffs["passed"] = (diffs["full_vs_step"] <= STEP_TOLERANCE
                       and diffs["eager_vs_torchscript"] <= ENGINE_TOLERANCE
                       and diffs["eager_vs_onnxruntime"] <= ENGINE_TOLERANCE)
    diffs.update(batch=B, steps=T, step_tolerance=STEP_TOLERANCE, engine_tolerance=ENGINE_TOLERANCE)
    return diffs


def export_artifact(model: DeepGPCM, out_dir: Path, *, manifest: dict, vocab_json: dict,
                    parity_questions: torch.Tensor, parity_responses: torch.Tensor) -> dict:
    """Write graphs, state, vocabulary and manifest into out_dir; raise ParityError if parity fails.

    `manifest` carries the caller's fields (name, version, metrics, data provenance...); the graph,
    state and parity sections are added here."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    spec = model.state_spec()
    names = [s["name"] for s in spec]
    example_state = model.init_state(2)
    last = model.cfg.n_questions - 1  # example ids must exist even for a one-item vocabulary
    q, r = torch.tensor([min(2, last), min(3, last)]), torch.tensor([0, 1])
    batch = torch.export.Dim("batch")
    n_query = torch.export.Dim("n_questions")
    state_dyn = [{0: batch} for _ in spec]

    step_names, step_outs = [*names, "question", "response"], [f"{n}_next" for n in names]
    predict_names = [*names, "questions"]
    _export_onnx(StepGraph(model), (*example_state, q, r), step_names, step_outs, out_dir / "step.onnx",
                 [*state_dyn, {0: batch}, {0: batch}])
    _export_onnx(PredictGraph(model), (*example_state, q.view(2, 1).repeat(1, 2)), predict_names,
                 readout_names(model), out_dir / "predict.onnx", [*state_dyn, {0: batch, 1: n_query}])
    _export_onnx(StepPredictGraph(model), (*example_state, q, r, q.view(2, 1).repeat(1, 2)),
                 [*step_names, "questions"], [*step_outs, *readout_names(model)], out_dir / "step_predict.onnx",
                 [*state_dyn, {0: batch}, {0: batch}, {0: batch, 1: n_query}])
    step_ts = _trace(StepGraph(model), (*example_state, q, r), out_dir / "step.pt")
    predict_ts = _trace(PredictGraph(model), (*example_state, q.view(2, 1)), out_dir / "predict.pt")
    step_onnx, predict_onnx = onnx_session(out_dir / "step.onnx"), onnx_session(out_dir / "predict.onnx")
    fused_onnx = onnx_session(out_dir / "step_predict.onnx")

    parity = check_parity(model, parity_questions, parity_responses, step_ts, predict_ts, step_onnx, predict_onnx,
                          fused_onnx)
    if not parity["passed"]:
        raise ParityError(f"exported graphs disagree with the model: {parity}")

    save_initial_state(model, spec, out_dir)
    (out_dir / "vocab_questions.json").write_text(json.dumps(vocab_json))
    torch.save({"state_dict": model.state_dict(), "config": asdict(model.cfg), "family": model.family},
               out_dir / "weights.pt")

    manifest = {
        **manifest,
        "family": model.family,
        "model_config": asdict(model.cfg),
        "state": spec,
        "graphs": {
            "step": {"onnx": "step.onnx", "torchscript": "step.pt", **io(step_onnx)},
            "predict": {"onnx": "predict.onnx", "torchscript": "predict.pt", **io(predict_onnx)},
            "step_predict": {"onnx": "step_predict.onnx", **io(fused_onnx)},
        },
        "vocabularies": {"questions": "vocab_questions.json"},
        "weights": "weights.pt",
        "onnx_opset": OPSET,
        "parity": parity,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=_json_default))
    return manifest


def load_weights(artifact_dir: Path, build) -> tuple[nn.Module, dict]:
    """(the model of an artifact's weights.pt, in eval mode; its manifest). `build(family, config dict)` makes
    the empty model."""
    manifest = json.loads((Path(artifact_dir) / "manifest.json").read_text())
    saved = torch.load(Path(artifact_dir) / manifest["weights"], weights_only=True)
    model = build(saved["family"], saved["config"])
    model.load_state_dict(saved["state_dict"])
    return model.eval(), manifest


def save_initial_state(model, spec: list[dict], out_dir: Path) -> None:
    """One entity's initial value of each state tensor as state_<name>.npy; records the file in `spec`."""
    with torch.no_grad():
        for s, tensor in zip(spec, model.init_state(1), strict=True):
            np.save(out_dir / f"state_{s['name']}.npy", tensor[0].numpy())
            s["file"] = f"state_{s['name']}.npy"


def io(session: ort.InferenceSession) -> dict:
    """A graph's real inputs and outputs, read back from ONNX Runtime (the exporter may prune inputs)."""
    return {"inputs": [{"name": i.name, "shape": i.shape, "dtype": i.type} for i in session.get_inputs()],
            "outputs": [{"name": o.name, "shape": o.shape, "dtype": o.type} for o in session.get_outputs()]}


def _json_default(x):
    if isinstance(x, np.generic):
        return x.item()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serialisable: {type(x)}")
