"""Export SimAKT: ONNX + TorchScript graphs with the memory banks as inputs, parity, banks, manifest.

    bank_project.onnx   raw banks -> position-weighted keys and values per active inter-student head: the
                        service runs it once per bank version, so a new bank needs no new export
    step.onnx           (state, question, response, bank keys/values) -> next state (block 3 reads the banks)
    predict.onnx        (state, questions (B, M), bank keys/values) -> probs (B, M, 2), explain_<head> (B, M_bank)
    step_predict.onnx   both in one call
    rebase.onnx         (seen, chunk_questions, chunk_responses, bank keys/values) -> the state encoded afresh
                        from the chunks with these banks (a state folded with another bank version)
    *.pt                TorchScript of the same graphs (not step_predict)
    banks/<version>/    the banks (banks.py) and their provenance
    vocab_questions.json, state_*.npy, weights.pt, manifest.json  as for every knowledge-tracing artifact

Parity is checked at export on held-out trajectories long enough to cross chunk boundaries: the full pass
under the window rule (`SimAKT.chunked`) vs stepping the state and predicting (eager; within
FLOAT16_TOLERANCE when block 3's cache is float16), vs TorchScript, vs ONNX Runtime, all with the same banks.
A miss fails the export.
"""

import json
from pathlib import Path

import numpy as np
import torch

from ...models.simakt import SimAKT
from ..export import STEP_TOLERANCE, Graph, export, load_weights
from ..families import restore
from .banks import Bank, load_banks, save_banks
from .export import KTExporter

REBASE_INPUTS = ("seen", "chunk_questions", "chunk_responses")  # the state tensors rebase reads


def bank_input_names(model: SimAKT) -> list[str]:
    """bank_project's inputs: block 3's raw banks."""
    return [f"bank_{h.spec.name}_{part}" for h in model.heads for part in ("states", "lengths")]


def bank_kv_names(model: SimAKT) -> list[str]:
    """bank_project's outputs: block 3's keys and values (the step, rebase and predict graphs take them)."""
    return [f"bank_{h.spec.name}_{part}" for h in model.heads for part in ("keys", "values")]


def answer_input_names(model: SimAKT) -> list[str]:
    """The answer heads' banks as the predict graphs take them (no projection: they are built projected)."""
    return [f"bank_{h.spec.name}_{part}" for h in model.answerers for part in h.parts]


def explain_names(model: SimAKT) -> list[str]:
    return [f"explain_{h.spec.name}" for h in model.heads]


# P(right), the full pass vs stepping with block 3's cache in float16 (docs/results.md: at most 1.4e-4 and
# 2.5e-4 over the test learners of dtransformer_assist09 and dkvmn_assist2009_updated)
FLOAT16_TOLERANCE = 1e-3


def _pairs(flat) -> list[tuple]:
    return [(flat[i], flat[i + 1]) for i in range(0, len(flat), 2)]


def _banks(model: SimAKT, flat) -> list[tuple]:
    """Flat bank tensors (block 3's keys and values, then each answer head's parts) -> one tuple per head."""
    n = 2 * len(model.heads)
    out, rest = _pairs(flat[:n]), list(flat[n:])
    for head in model.answerers:
        out.append(tuple(rest[:len(head.parts)]))
        rest = rest[len(head.parts):]
    return out


class SimAKTExporter(KTExporter):
    """KT graphs whose steps and readouts also take the banks' keys and values (shared inputs), the readouts
    outputting each head's weights over its bank (explain_<head>), plus rebase and bank_project (raw banks ->
    keys and values)."""

    def __init__(self, model: SimAKT, vocab_json: dict, banks: list[Bank], bank_provenance: dict | None,
                 version: str):
        super().__init__(model, vocab_json)
        self.banks, self.bank_provenance, self.version = banks, bank_provenance, version
        self.raw = [t for b in banks[:len(model.heads)] for t in b.tensors()]  # bank_project's inputs
        with torch.no_grad():
            self.kv = [t for bank in model.bank_keys([b.tensors() for b in banks]) for t in bank]
        self.step_shared = len(bank_kv_names(model))  # block 3's keys and values; the answer heads' banks only answer
        self.step_tolerance = FLOAT16_TOLERANCE if model.cfg.cache_dtype == "float16" else STEP_TOLERANCE

    def parity_sequence(self, sequence):
        """Cut or repeated to window + window / caches + 8 interactions (artifacts exported before the cached state
        walked 48): every cache then starts a new chunk at least once."""
        W = self.model.cfg.window
        length = W + W // self.model.cfg.caches + 8
        return tuple(torch.from_numpy(np.stack([np.resize(row, length) for row in x.numpy()])) for x in sequence)

    def advance(self, state, event, shared):
        return self.model.step(state, *event, _pairs(shared))

    def answer(self, state, questions, *kv):
        out = self.model.readout(state, questions, _banks(self.model, kv))
        p = torch.sigmoid(out.logits)
        return {"probs": torch.stack([1 - p, p], dim=-1), **dict(zip(explain_names(self.model), out.inter_weights,
                                                                       strict=True))}

    def shared(self):
        return dict(zip(bank_kv_names(self.model) + answer_input_names(self.model), self.kv, strict=True))

    def full(self, sequence):
        return (torch.sigmoid(self.model.chunked(*sequence, _banks(self.model, self.kv))),)

    def stepped(self, state, query):
        return (torch.sigmoid(self.model.readout(state, *query, _banks(self.model, self.kv)).logits)[:, 0],)

    def dims(self, dim):
        # a head's bank size is one dimension shared by its keys and values (and by its raw states and lengths);
        # an answer head's entries are one dimension of its per-entry parts (its per-question parts are fixed)
        sizes = [dim(f"bank_{i}_m", min=head.min_entries) for i, head in enumerate(self.model.heads)]
        entries = {f"bank_{h.spec.name}_{part}": {0: dim(f"bank_{h.spec.name}_n", min=2)}
                   for h in self.model.answerers for part in h.entry_parts}
        return {**super().dims(dim), **{n: {1: sizes[i // 2]} for i, n in enumerate(bank_kv_names(self.model))},
                **{n: {0: sizes[i // 2]} for i, n in enumerate(bank_input_names(self.model))}, **entries}

    def graphs(self, sequence):
        """The KT graphs, rebase (from the step graph's example state) and, with banks, bank_project."""
        graphs = super().graphs(sequence)
        step = next(g for g in graphs if g.kind == "step")
        kv = bank_kv_names(self.model)
        inputs = [*REBASE_INPUTS, *kv]
        rebase = Graph("rebase", "extra", inputs, [f"{s['name']}_next" for s in self.model.state_spec()],
                       tuple(step.example[step.inputs.index(n)] for n in inputs),
                       [step.dynamic[step.inputs.index(n)] for n in inputs],
                       fn=lambda seen, questions, responses, *kv: self.model.rebase(seen, questions, responses,
                                                                                    _pairs(kv)))
        return graphs + [rebase]

    def extra_graphs(self):
        if not self.model.heads:
            return []
        dims = self.dims(torch.export.Dim)
        names = bank_input_names(self.model)
        return [Graph("bank_project", "extra", names, bank_kv_names(self.model), tuple(self.raw),
                      [dims[n] for n in names],
                      fn=lambda *raw: tuple(t for head, bank in zip(self.model.heads, _pairs(raw), strict=True)
                                            for t in head.project(*bank)))]

    def manifest(self):
        model = self.model
        return {**super().manifest(), "similarity": model.sim.to_dict(),
                "banks": {"heads": [h.spec.name for h in model.heads], "inputs": bank_input_names(model),
                          "keys": bank_kv_names(model), "explain": explain_names(model),
                          "answer_heads": [h.spec.name for h in model.answerers],
                          "answer_inputs": answer_input_names(model),
                          "default": self.version if self.banks else None, "dir": "banks"}}

    def write(self, out_dir):
        super().write(out_dir)
        if self.banks:
            save_banks(self.banks, out_dir / "banks" / self.version, self.bank_provenance)

    @classmethod
    def from_artifact(cls, model, artifact_dir, manifest):
        vocab = json.loads((artifact_dir / manifest["vocabularies"]["questions"]).read_text())
        version = manifest["banks"]["default"]
        if not version:
            return cls(model, vocab, [], None, manifest["version"])
        bank_dir = artifact_dir / manifest["banks"]["dir"] / version
        provenance = json.loads((bank_dir / "provenance.json").read_text())
        provenance.pop("banks")  # save_banks writes it again
        return cls(model, vocab, load_banks(bank_dir, model), provenance, version)


def _parity_batch(trajs, n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The n longest trajectories, cut to the shortest of them (parity_sequence sets the length)."""
    chosen = sorted(trajs, key=lambda s: -len(s[0]))[:n]
    length = min(len(s[0]) for s in chosen)
    return tuple(torch.from_numpy(np.stack([s[i][:length] for s in chosen])) for i in (0, 1))


def export_simakt(model: SimAKT, out_dir: Path, *, manifest: dict, vocab_json: dict, banks: list[Bank],
                  bank_provenance: dict | None, parity) -> dict:
    """parity: held-out sequences (question rows, responses); the longest few are walked (parity_sequence)."""
    exporter = SimAKTExporter(model, vocab_json, banks, bank_provenance, manifest["version"])
    return export(exporter, out_dir, manifest=manifest, sequence=_parity_batch(parity))


def load_simakt(artifact_dir: str | Path) -> tuple[SimAKT, dict]:
    return load_weights(artifact_dir, restore)
