"""Export SimAKT: ONNX + TorchScript graphs with the memory banks as inputs, parity, banks, manifest.

    bank_project.onnx   raw banks -> position-weighted keys and values per active inter-student head: the
                        service runs it once per bank version, so a new bank needs no new export
    step.onnx           (window_questions, window_responses, seen, question, response) -> next state
    predict.onnx        (state, questions (B, M), bank keys/values) -> probs (B, M, 2), explain_<head> (B, M_bank)
    step_predict.onnx   both in one call
    *.pt                TorchScript of the same graphs
    banks/<version>/    the banks (banks.py) and their provenance
    vocab_questions.json, state_*.npy, weights.pt, manifest.json  as for every knowledge-tracing artifact

Parity is checked at export on held-out trajectories: the full teacher-forced pass vs stepping the state
and predicting (eager), vs TorchScript, vs ONNX Runtime, all with the same banks. A miss fails the export.
"""

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models.simakt import SimAKT, SimAKTConfig
from .banks import Bank, save_banks
from .export import (
    ENGINE_TOLERANCE,
    OPSET,
    STEP_TOLERANCE,
    ParityError,
    StepGraph,
    _export_onnx,
    _json_default,
    _trace,
    io,
    load_weights,
    onnx_session,
    save_initial_state,
)

STATE = ("window_questions", "window_responses", "seen")


def bank_input_names(model: SimAKT) -> list[str]:
    return [f"bank_{h.spec.name}_{part}" for h in model.heads for part in ("states", "lengths")]


def bank_kv_names(model: SimAKT) -> list[str]:
    return [f"bank_{h.spec.name}_{part}" for h in model.heads for part in ("keys", "values")]


def explain_names(model: SimAKT) -> list[str]:
    return [f"explain_{h.spec.name}" for h in model.heads]


def _pairs(flat) -> list[tuple]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


class BankProjectGraph(nn.Module):
    def __init__(self, model: SimAKT):
        super().__init__()
        self.model = model

    def forward(self, *banks):
        return tuple(t for kv in self.model.bank_keys(_pairs(banks)) for t in kv)


def _answer(out) -> tuple:
    p = torch.sigmoid(out.logits)
    return (torch.stack([1 - p, p], dim=-1), *out.inter_weights)


class PredictGraph(nn.Module):
    def __init__(self, model: SimAKT):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        state, questions, kv = inputs[:3], inputs[3], inputs[4:]
        return _answer(self.model.readout(tuple(state), questions, _pairs(kv)))


class StepPredictGraph(nn.Module):
    def __init__(self, model: SimAKT):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        state, question, response, questions, kv = inputs[:3], inputs[3], inputs[4], inputs[5], inputs[6:]
        state = self.model.step(tuple(state), question, response)
        return (*state, *_answer(self.model.readout(state, questions, _pairs(kv))))


def _run(session, feeds: dict) -> list[np.ndarray]:
    return session.run(None, {i.name: feeds[i.name] for i in session.get_inputs()})


def check_parity(model: SimAKT, banks: list[Bank], questions: torch.Tensor, responses: torch.Tensor, graphs: dict,
                 scripted: dict) -> dict:
    """Max abs differences: full pass vs step-by-step (eager), eager vs TorchScript, eager vs ONNX Runtime."""
    B, T = questions.shape
    raw = [t for b in banks for t in b.tensors()]
    diffs = {"full_vs_step": 0.0, "eager_vs_torchscript": 0.0, "eager_vs_onnxruntime": 0.0}

    def worse(key, a, b):
        diffs[key] = max(diffs[key], float(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b)).max()))

    with torch.no_grad():
        kv = model.bank_keys(_pairs(raw))
        flat_kv = [t for pair in kv for t in pair]
        onnx_kv = _run(graphs["bank_project"], dict(zip(bank_input_names(model), [t.numpy() for t in raw],
                                                         strict=True))) if raw else []
        ts_kv = scripted["bank_project"](*raw) if raw else ()
        for a, b, c in zip(flat_kv, onnx_kv, ts_kv, strict=True):
            worse("eager_vs_onnxruntime", a, b)
            worse("eager_vs_torchscript", a, c)
        kv_feeds = dict(zip(bank_kv_names(model), [t.numpy() for t in flat_kv], strict=True))
        full = torch.sigmoid(model(questions, responses, kv).logits)
        state = ts_state = model.init_state(B)
        ort_state = dict(zip(STATE, [t.numpy() for t in state], strict=True))
        for t in range(T):
            q, r, qm = questions[:, t], responses[:, t], questions[:, t:t + 1]
            eager = _answer(model.readout(state, qm, kv))
            worse("full_vs_step", eager[0][:, 0, 1], full[:, t])
            for a, b in zip(eager, scripted["predict"](*ts_state, qm, *flat_kv), strict=True):
                worse("eager_vs_torchscript", a, b)
            for a, b in zip(eager, _run(graphs["predict"], {**ort_state, "questions": qm.numpy(), **kv_feeds}),
                            strict=True):
                worse("eager_vs_onnxruntime", a, b)
            feeds = {**ort_state, "question": q.numpy(), "response": r.numpy(), "questions": qm.numpy(), **kv_feeds}
            state = model.step(state, q, r)
            after = (*state, *_answer(model.readout(state, qm, kv)))
            for a, b in zip(after, _run(graphs["step_predict"], feeds), strict=True):
                worse("eager_vs_onnxruntime", a, b)
            ts_state = scripted["step"](*ts_state, q, r)
            ort_state = dict(zip(STATE, _run(graphs["step"], feeds), strict=True))
        for a, b, c in zip(state, ts_state, ort_state.values(), strict=True):
            worse("eager_vs_torchscript", a, b)
            worse("eager_vs_onnxruntime", a, c)
    diffs["passed"] = (diffs["full_vs_step"] <= STEP_TOLERANCE and diffs["eager_vs_torchscript"] <= ENGINE_TOLERANCE
                       and diffs["eager_vs_onnxruntime"] <= ENGINE_TOLERANCE)
    diffs.update(batch=B, steps=T, step_tolerance=STEP_TOLERANCE, engine_tolerance=ENGINE_TOLERANCE)
    return diffs


def _parity_batch(trajs, window: int, n: int = 4, length: int = 48) -> tuple[torch.Tensor, torch.Tensor]:
    chosen = sorted(trajs, key=lambda s: -len(s[0]))[:n]
    length = min(length, window)
    q = torch.from_numpy(np.stack([np.resize(s[0], length) for s in chosen]))
    r = torch.from_numpy(np.stack([np.resize(s[1], length) for s in chosen]))
    return q, r


def export_graphs(model: SimAKT, out_dir: Path, banks: list[Bank]) -> tuple[dict, dict, dict]:
    """Write the ONNX and TorchScript graphs; return (manifest graph entries, ORT sessions, TorchScript)."""
    model = model.eval()
    state = model.init_state(2)
    q, r = torch.tensor([2, 3]).clamp(max=model.cfg.n_questions - 1), torch.tensor([0, 1])
    qs = q.view(2, 1).repeat(1, 2)
    raw = [t for b in banks for t in b.tensors()]
    with torch.no_grad():
        kv = [t for pair in model.bank_keys(_pairs(raw)) for t in pair]
    batch, n_query = torch.export.Dim("batch"), torch.export.Dim("n_questions")
    # a head's bank size is one dimension shared by its states and lengths, and by its keys and values
    kv_dims = [d for i in range(len(banks)) for d in ({1: torch.export.Dim(f"bank_{i}_m", min=2)},) * 2]
    bank_dims = [d for i in range(len(banks)) for d in ({0: torch.export.Dim(f"bank_{i}_m", min=2)},) * 2]
    state_dyn = [{0: batch}, {0: batch}, {0: batch}]
    kvn, expl = bank_kv_names(model), explain_names(model)
    step_out = [f"{n}_next" for n in STATE]
    specs = {
        "step": (StepGraph(model), (*state, q, r), [*STATE, "question", "response"], step_out,
                 [*state_dyn, {0: batch}, {0: batch}]),
        "predict": (PredictGraph(model), (*state, qs, *kv), [*STATE, "questions", *kvn], ["probs", *expl],
                    [*state_dyn, {0: batch, 1: n_query}, *kv_dims]),
        "step_predict": (StepPredictGraph(model), (*state, q, r, qs, *kv), [*STATE, "question", "response",
                         "questions", *kvn], [*step_out, "probs", *expl],
                         [*state_dyn, {0: batch}, {0: batch}, {0: batch, 1: n_query}, *kv_dims]),
    }
    if banks:
        specs["bank_project"] = (BankProjectGraph(model), tuple(raw), bank_input_names(model), kvn, bank_dims)
    entries, sessions, scripted = {}, {}, {}
    for name, (graph, example, inputs, outputs, dyn) in specs.items():
        _export_onnx(graph, example, inputs, outputs, out_dir / f"{name}.onnx", dyn)
        sessions[name] = onnx_session(out_dir / f"{name}.onnx")
        entries[name] = {"onnx": f"{name}.onnx", **io(sessions[name])}
        if name != "step_predict":
            scripted[name] = _trace(graph, example, out_dir / f"{name}.pt")
            entries[name]["torchscript"] = f"{name}.pt"
    return entries, sessions, scripted


def export_simakt(model: SimAKT, out_dir: Path, *, manifest: dict, vocab_json: dict, banks: list[Bank],
                  bank_provenance: dict | None, parity) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    entries, sessions, scripted = export_graphs(model, out_dir, banks)
    q, r = _parity_batch(parity, model.cfg.window)
    result = check_parity(model, banks, q, r, sessions, scripted)
    if not result["passed"]:
        raise ParityError(f"exported SimAKT graphs disagree with the model: {result}")
    spec = model.state_spec()
    save_initial_state(model, spec, out_dir)
    (out_dir / "vocab_questions.json").write_text(json.dumps(vocab_json))
    torch.save({"state_dict": model.state_dict(), "config": asdict(model.cfg), "family": model.family},
               out_dir / "weights.pt")
    bank_version = None
    if banks:
        bank_version = manifest["version"]
        save_banks(banks, out_dir / "banks" / bank_version, bank_provenance)
    manifest = {
        **manifest, "family": model.family, "model_config": asdict(model.cfg), "similarity": model.sim.to_dict(),
        "state": spec, "graphs": entries, "vocabularies": {"questions": "vocab_questions.json"},
        "banks": {"heads": [h.spec.name for h in model.heads], "inputs": bank_input_names(model),
                  "keys": bank_kv_names(model), "explain": explain_names(model), "default": bank_version,
                  "dir": "banks"},
        "weights": "weights.pt", "onnx_opset": OPSET, "parity": result,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=_json_default))
    return manifest


def load_simakt(artifact_dir: str | Path) -> tuple[SimAKT, dict]:
    return load_weights(artifact_dir, lambda family, config: SimAKT(SimAKTConfig(**config)))
