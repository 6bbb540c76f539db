"""Next-item models (GRU4Rec, MRN, popularity, Markov) through the export harness (export.py).

    step.onnx / step.pt           (*state, item (B,)) -> next state
    recommend.onnx / .pt          (*state, exclude (B, S)) -> items (B, top_k) rows, scores (B, top_k)
    step_recommend.onnx           both in one call: what the service runs per event
    state_<name>.npy, vocab_items.json (external item id -> model row; rows 0/1: padding, unknown), weights.pt

`exclude` holds rows never to return (the session's items, for exclude_seen), padded with 0; rows 0 and 1 are
never returned. When fewer than top_k rows remain, the last slots have score -inf: they are not
recommendations. Parity compares top-k answers through scores: the scores returned must be the eager top-k
scores in order, and every returned row's eager score must equal the score returned, so tied rows may come
back in either order; a row that is padding, unknown or excluded counts as a bad row.
"""

import json
from pathlib import Path

import numpy as np
import torch

from ...models.next_item import NextItemModel
from ..export import Exporter, export

TASK = "next_item"


class NextItemExporter(Exporter):
    event = ("item",)
    query = ("exclude",)
    readout_name = "recommend"

    def __init__(self, model: NextItemModel, vocab_json: dict, top_k: int = 100):
        super().__init__(model)
        self.vocab_json, self.k = vocab_json, min(top_k, model.n_items - 2)

    def answer(self, state, exclude):
        items, scores = self.model.readout(state, exclude, self.k)
        return {"items": items, "scores": scores}

    def walk(self, sequence):
        (items,) = sequence
        for t in range(items.shape[1]):  # recommend with the item about to be clicked already excluded
            yield (items[:, t],), (items[:, :t + 1],)

    def full(self, sequence):
        (items,) = sequence  # forward's row t has seen items[:, :t + 1]; before the first, the initial state
        first = self.model.scores(self.model.init_state(items.shape[0])).unsqueeze(1)
        return (torch.cat([first, self.model(items)[:, :-1]], 1),)

    def stepped(self, state, query):
        return (self.model.scores(state),)

    def dims(self, dim):
        return {"exclude": {1: dim("n_exclude")}}

    def compare(self, state, query, eager, engine):
        scores, (exclude,) = self.model.scores(state), query
        top = eager["scores"]
        rows, values = (torch.as_tensor(np.asarray(x)) for x in engine)
        real, finite = torch.isfinite(values), torch.isfinite(top)  # -inf: an empty slot, naming no row
        bad = int((real != finite).sum())
        bad += int(((rows < 2) | (rows.unsqueeze(2) == exclude.unsqueeze(1)).any(2))[real].sum())
        if not real.any():
            return 0.0, bad
        return max((values - scores.gather(1, rows))[real].abs().max().item(),
                   (values - top)[real & finite].abs().max().item()), bad

    def config(self):
        # a learned model has its config; a count model's tables are its weights, their size its only setting
        return super().config() if hasattr(self.model, "cfg") else {"n_items": self.model.n_items}

    def manifest(self):
        return {"top_k": self.k, "vocabularies": {"items": "vocab_items.json"}}

    def write(self, out_dir):
        (out_dir / "vocab_items.json").write_text(json.dumps(self.vocab_json))

    @classmethod
    def from_artifact(cls, model, artifact_dir, manifest):
        return cls(model, json.loads((artifact_dir / manifest["vocabularies"]["items"]).read_text()),
                   manifest["top_k"])


def export_next_item(model: NextItemModel, out_dir: Path, *, manifest: dict, vocab_json: dict,
                     parity_sessions: torch.Tensor, top_k: int = 100) -> dict:
    """parity_sessions: (B, T) held-out item rows >= 2."""
    return export(NextItemExporter(model, vocab_json, top_k), out_dir, manifest=manifest, sequence=(parity_sessions,))
