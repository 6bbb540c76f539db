"""Export a next-item model (GRU4Rec, MRN, popularity, Markov) as streaming graphs, with parity checks.

    manifest.json                 task "next_item": state tensors, graphs and their I/O, top_k, vocabulary
    step.onnx / step.pt           (*state, item (B,)) -> next state
    recommend.onnx / .pt          (*state, exclude (B, S)) -> items (B, top_k) rows, scores (B, top_k)
    step_recommend.onnx           both in one call: what the service runs per event
    state_<name>.npy              initial value of each per-session state tensor
    vocab_items.json              external item id -> model row (rows 0/1: padding, unknown)
    weights.pt                    state dict + config, for offline evaluation

`exclude` holds rows never to return (the session's items, for exclude_seen), padded with 0; rows 0
and 1 are never returned. When fewer than top_k rows remain, the last slots have score -inf: they are
not recommendations. Parity is checked at export on held-out sessions: the full-session forward
pass vs stepping (a real check for models with their own forward, like MRN; for GRU4Rec and the count
models forward IS the step loop, and the tests compare its training path instead), and eager vs
TorchScript vs ONNX Runtime top-k: the scores returned must be the eager top-k scores in order, and every
returned row's eager score must equal the score returned (so tied rows may come back in either order).
"""

import json
from dataclasses import asdict, is_dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models.next_item import NextItemModel
from .export import (
    ENGINE_TOLERANCE,
    OPSET,
    STEP_TOLERANCE,
    ParityError,
    _export_onnx,
    _json_default,
    _trace,
    io,
    onnx_session,
    save_initial_state,
)

TASK = "next_item"


class StepGraph(nn.Module):
    def __init__(self, model: NextItemModel):
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        *state, item = inputs
        return tuple(self.model.step(tuple(state), item))


class RecommendGraph(nn.Module):
    def __init__(self, model: NextItemModel, k: int):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, *inputs):
        *state, exclude = inputs
        return self.model.readout(tuple(state), exclude, self.k)


class StepRecommendGraph(nn.Module):
    def __init__(self, model: NextItemModel, k: int):
        super().__init__()
        self.model, self.k = model, k

    def forward(self, *inputs):
        *state, item, exclude = inputs
        state = self.model.step(tuple(state), item)
        return (*state, *self.model.readout(state, exclude, self.k))


def _feed(session, values: dict) -> dict:
    """Only the inputs the ONNX graph kept (the exporter prunes unused ones, e.g. popularity's state)."""
    return {i.name: values[i.name] for i in session.get_inputs()}


def check_parity(model: NextItemModel, sessions: torch.Tensor, k: int, step_ts, recommend_ts, step_onnx,
                 recommend_onnx, fused_onnx) -> dict:
    """sessions (B, T) item rows >= 2 (held out). Returns max differences; `passed` says if all are in tolerance."""
    names = [s["name"] for s in model.state_spec()]
    B, T = sessions.shape
    diffs = {"full_vs_step": 0.0, "eager_vs_torchscript": 0.0, "eager_vs_onnxruntime": 0.0, "bad_rows": 0}

    def compare(key, scores_eager, top_eager, rows, values):
        """Returned (rows, scores) vs eager: the scores must be the eager top-k scores, in order, and each
        returned row must have the score returned for it (so tied rows may come back in either order). A
        score of -inf marks an empty slot (fewer than k rows left after exclusion)."""
        rows, values = torch.as_tensor(np.asarray(rows)), torch.as_tensor(np.asarray(values))
        real, finite_eager = torch.isfinite(values), torch.isfinite(top_eager)
        diffs["bad_rows"] += int((real != finite_eager).sum())
        if real.any():
            both = real & finite_eager
            diffs[key] = max(diffs[key], (values - scores_eager.gather(1, rows))[real].abs().max().item(),
                             (values - top_eager)[both].abs().max().item())
        return rows.masked_fill(~real, 2 ** 62)  # an empty slot names no row

    with torch.no_grad():
        full = model(sessions)
        eager, ts = model.init_state(B), model.init_state(B)
        ort_state = {n: t.numpy() for n, t in zip(names, model.init_state(B), strict=True)}
        for t in range(T):
            item, exclude = sessions[:, t], sessions[:, :t + 1]
            fused = fused_onnx.run(None, _feed(fused_onnx, {**ort_state, "item": item.numpy(),
                                                            "exclude": exclude.numpy()}))
            eager = model.step(eager, item)
            scores = model.scores(eager)
            diffs["full_vs_step"] = max(diffs["full_vs_step"], (scores - full[:, t]).abs().max().item())
            rows_e, values_e = model.readout(eager, exclude, k)
            rows_e = rows_e.masked_fill(~torch.isfinite(values_e), 2 ** 62)
            ts = step_ts(*ts, item)
            rows_t = compare("eager_vs_torchscript", scores, values_e, *recommend_ts(*ts, exclude))
            ort_state = dict(zip(names, step_onnx.run(None, _feed(step_onnx, {**ort_state, "item": item.numpy()})),
                                 strict=True))
            feeds = _feed(recommend_onnx, {**ort_state, "exclude": exclude.numpy()})
            rows_o = compare("eager_vs_onnxruntime", scores, values_e, *recommend_onnx.run(None, feeds))
            rows_f = compare("eager_vs_onnxruntime", scores, values_e, *fused[len(names):])
            for a, b in zip(eager, fused[:len(names)], strict=True):
                diffs["eager_vs_onnxruntime"] = max(diffs["eager_vs_onnxruntime"],
                                                    float(np.abs(a.numpy().astype(np.float64) - b).max()))
            for rows in (rows_e, rows_t, rows_o, rows_f):  # never padding, unknown or an excluded row
                bad = (rows < 2) | (rows.unsqueeze(2) == exclude.unsqueeze(1)).any(2)
                diffs["bad_rows"] += int(bad.sum())
    diffs["passed"] = (diffs["full_vs_step"] <= STEP_TOLERANCE and diffs["eager_vs_torchscript"] <= ENGINE_TOLERANCE
                       and diffs["eager_vs_onnxruntime"] <= ENGINE_TOLERANCE and diffs["bad_rows"] == 0)
    diffs.update(batch=B, steps=T, step_tolerance=STEP_TOLERANCE, engine_tolerance=ENGINE_TOLERANCE)
    return diffs


def export_next_item(model: NextItemModel, out_dir: Path, *, manifest: dict, vocab_json: dict,
                     parity_sessions: torch.Tensor, top_k: int = 100) -> dict:
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    k = min(top_k, model.n_items - 2)
    spec = model.state_spec()
    names = [s["name"] for s in spec]
    example_state = model.init_state(2)
    last = model.n_items - 1
    item = torch.tensor([min(2, last), last])
    exclude = torch.tensor([[min(2, last), 0], [last, min(3, last)]])
    batch, seen = torch.export.Dim("batch"), torch.export.Dim("n_exclude")
    state_dyn = [{0: batch} for _ in spec]
    step_names, step_outs = [*names, "item"], [f"{n}_next" for n in names]
    rec_outs = ["items", "scores"]
    _export_onnx(StepGraph(model), (*example_state, item), step_names, step_outs, out_dir / "step.onnx",
                 [*state_dyn, {0: batch}])
    _export_onnx(RecommendGraph(model, k), (*example_state, exclude), [*names, "exclude"], rec_outs,
                 out_dir / "recommend.onnx", [*state_dyn, {0: batch, 1: seen}])
    _export_onnx(StepRecommendGraph(model, k), (*example_state, item, exclude), [*step_names, "exclude"],
                 [*step_outs, *rec_outs], out_dir / "step_recommend.onnx",
                 [*state_dyn, {0: batch}, {0: batch, 1: seen}])
    step_ts = _trace(StepGraph(model), (*example_state, item), out_dir / "step.pt")
    recommend_ts = _trace(RecommendGraph(model, k), (*example_state, exclude), out_dir / "recommend.pt")
    sessions = {n: onnx_session(out_dir / f"{n}.onnx") for n in ("step", "recommend", "step_recommend")}
    parity = check_parity(model, parity_sessions, k, step_ts, recommend_ts, sessions["step"],
                          sessions["recommend"], sessions["step_recommend"])
    if not parity["passed"]:
        raise ParityError(f"exported graphs disagree with the model: {parity}")

    save_initial_state(model, spec, out_dir)
    (out_dir / "vocab_items.json").write_text(json.dumps(vocab_json))
    config = asdict(model.cfg) if is_dataclass(getattr(model, "cfg", None)) else {"n_items": model.n_items}
    torch.save({"state_dict": model.state_dict(), "config": config, "family": model.family}, out_dir / "weights.pt")

    manifest = {
        **manifest,
        "task": TASK,
        "family": model.family,
        "model_config": config,
        "state": spec,
        "top_k": k,
        "graphs": {
            "step": {"onnx": "step.onnx", "torchscript": "step.pt", **io(sessions["step"])},
            "recommend": {"onnx": "recommend.onnx", "torchscript": "recommend.pt", **io(sessions["recommend"])},
            "step_recommend": {"onnx": "step_recommend.onnx", **io(sessions["step_recommend"])},
        },
        "vocabularies": {"items": "vocab_items.json"},
        "weights": "weights.pt",
        "onnx_opset": OPSET,
        "parity": parity,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=_json_default))
    return manifest
