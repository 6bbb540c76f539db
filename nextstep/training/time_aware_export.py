"""Export the time-aware transformer: the last-row `predict` over a stored window, ONNX + TorchScript, parity.

    predict(hist_card, hist_deck, hist_time, hist_rating, hist_duration, hist_state, hist_valid,
            card, deck, time) -> rating_probs (B, 4), recall (B,), duration_s (B,)

History inputs are (B, H), left-padded (hist_valid False) and in time order; card/deck ids are only
compared for equality, so any int64 coding works (the service hashes its string ids). Times are unix
seconds (float64), durations seconds (float32, NaN unknown), states 0..3 or -1. The service selects each
window with `nextstep.review_window.select`, the rule training used.

Parity is checked at export on real windows: eager vs TorchScript vs ONNX Runtime, and the last-row
predict against the full-sequence pass on windows that hold all earlier reviews. A miss fails the export.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models.time_aware import TimeAwareTransformer, Window, expected_duration
from .export import OPSET, ParityError, _export_onnx, _json_default, _trace, io, onnx_session

TASK = "srs"
INPUTS = ("hist_card", "hist_deck", "hist_time", "hist_rating", "hist_duration", "hist_state", "hist_valid",
          "card", "deck", "time")
OUTPUTS = ("rating_probs", "recall", "duration_s")
ENGINE_TOLERANCE = 1e-4
SEQUENCE_TOLERANCE = 1e-5


class PredictGraph(nn.Module):
    def __init__(self, model: TimeAwareTransformer):
        super().__init__()
        self.model = model

    def forward(self, *inputs):  # INPUTS, in order
        *history, card, deck, time = inputs
        p = self.model.readout(Window(*history), card, deck, time)
        return p.rating_probs, p.recall, expected_duration(p.log_duration)


def prefix_window(sequence: Window, i: int) -> Window:
    """Rows 0..i-1 of (B, T) sequences as windows left-padded to T (what a query at row i sees)."""
    B, T = sequence.card.shape
    fills = (0, 0, 0.0, 1, 0.0, -1, False)
    return Window(*(torch.cat([torch.full((B, T - i), f, dtype=x.dtype), x[:, :i]], dim=1)
                    for x, f in zip(sequence, fills, strict=True)))


def check_parity(model: TimeAwareTransformer, examples: tuple, sequence: Window, ts, session) -> dict:
    """examples: graph inputs (real windows); sequence: (B, T) full sequences for the last-row check."""
    diffs = {"eager_vs_torchscript": 0.0, "eager_vs_onnxruntime": 0.0, "last_row_vs_sequence": 0.0}
    with torch.no_grad():
        eager = PredictGraph(model)(*examples)
        script = ts(*examples)
        feed = {name: x.numpy() for name, x in zip(INPUTS, examples, strict=True)}
        onnx = session.run(list(OUTPUTS), feed)
        for a, b, c in zip(eager, script, onnx, strict=True):
            diffs["eager_vs_torchscript"] = max(diffs["eager_vs_torchscript"], float((a - b).abs().max()))
            diffs["eager_vs_onnxruntime"] = max(diffs["eager_vs_onnxruntime"],
                                                float(np.abs(a.numpy().astype(np.float64) - c).max()))
        full = model(sequence)
        T = sequence.card.shape[1]
        for i in range(T):
            w = prefix_window(sequence, i)
            last = model.readout(w, sequence.card[:, i], sequence.deck[:, i], sequence.time[:, i])
            d = max(float((last.rating_probs - full.rating_probs[:, i]).abs().max()),
                    float((last.log_duration - full.log_duration[:, i]).abs().max()))
            diffs["last_row_vs_sequence"] = max(diffs["last_row_vs_sequence"], d)
    diffs["passed"] = (diffs["eager_vs_torchscript"] <= ENGINE_TOLERANCE
                       and diffs["eager_vs_onnxruntime"] <= ENGINE_TOLERANCE
                       and diffs["last_row_vs_sequence"] <= SEQUENCE_TOLERANCE)
    diffs.update(batch=int(examples[0].shape[0]), window=int(examples[0].shape[1]), sequence_length=T,
                 engine_tolerance=ENGINE_TOLERANCE, sequence_tolerance=SEQUENCE_TOLERANCE)
    return diffs


def export_time_aware(model: TimeAwareTransformer, out_dir: Path, *, manifest: dict, examples: tuple,
                      sequence: Window) -> dict:
    """Write predict.onnx, predict.pt, weights.pt and manifest.json; raise ParityError on a parity miss.

    examples: graph inputs of a few real windows (at least 2 rows, so the batch axis is exported dynamic)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    graph = PredictGraph(model)
    batch, hist = torch.export.Dim("batch"), torch.export.Dim("history")
    dynamic = [{0: batch, 1: hist}] * 7 + [{0: batch}] * 3
    _export_onnx(graph, examples, list(INPUTS), list(OUTPUTS), out_dir / "predict.onnx", dynamic)
    ts = _trace(graph, examples, out_dir / "predict.pt")
    session = onnx_session(out_dir / "predict.onnx")
    parity = check_parity(model, examples, sequence, ts, session)
    if not parity["passed"]:
        raise ParityError(f"exported graphs disagree with the model: {parity}")
    torch.save({"state_dict": model.state_dict(), "config": asdict(model.cfg), "family": "time_aware"},
               out_dir / "weights.pt")
    manifest = {
        **manifest,
        "task": TASK,
        "family": "time_aware",
        "model_config": asdict(model.cfg),
        "window": {"size": model.cfg.window, "card_size": model.cfg.card_window},
        "graphs": {"predict": {"onnx": "predict.onnx", "torchscript": "predict.pt", **io(session)}},
        "weights": "weights.pt",
        "onnx_opset": OPSET,
        "parity": parity,
    }
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2, default=_json_default))
    return manifest
