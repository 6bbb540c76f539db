"""Knowledge-tracing models through the export harness (training/export.py): an event is (question, response), a
query the questions asked; the graphs are step, predict and step_predict."""

import json
from pathlib import Path

import torch

from ...models.streaming import StreamingModel
from ..export import Exporter, export

IRT_OUTPUTS = ("theta", "alpha", "beta")  # what a KT readout may add to probs


class KTExporter(Exporter):
    """Knowledge tracing: event (question, response), query questions (B, M) -> probs (B, M, K) and whichever
    of theta, alpha, beta the readout gives (the GPCM families do; DKT and SimAKT do not)."""

    event = ("question", "response")
    query = ("questions",)

    def __init__(self, model: StreamingModel, vocab_json: dict):
        super().__init__(model)
        self.vocab_json = vocab_json

    def answer(self, state, questions, *shared):
        return _kt_fields(self.model.readout(state, questions))

    def walk(self, sequence):
        questions, responses = sequence
        for t in range(questions.shape[1]):
            yield (questions[:, t], responses[:, t]), (questions[:, t:t + 1],)

    def full(self, sequence):
        return tuple(_kt_fields(self.model(*sequence)).values())

    def stepped(self, state, query):
        return tuple(x[:, 0] for x in self.answer(state, *query).values())

    def widen(self, query):
        return (query[0].repeat(1, 2),)

    def dims(self, dim):
        return {"questions": {1: dim("n_questions")}}

    def manifest(self):
        return {"vocabularies": {"questions": "vocab_questions.json"}}

    def write(self, out_dir):
        (out_dir / "vocab_questions.json").write_text(json.dumps(self.vocab_json))

    @classmethod
    def from_artifact(cls, model, artifact_dir, manifest):
        return cls(model, json.loads((artifact_dir / manifest["vocabularies"]["questions"]).read_text()))


def _kt_fields(out) -> dict[str, torch.Tensor]:
    return {"probs": out.log_probs.exp(), **{f: getattr(out, f) for f in IRT_OUTPUTS if getattr(out, f, None)
                                            is not None}}


def export_artifact(model: StreamingModel, out_dir: Path, *, manifest: dict, vocab_json: dict,
                    parity_questions: torch.Tensor, parity_responses: torch.Tensor) -> dict:
    """A knowledge-tracing model's artifact (graphs step, predict, step_predict); ParityError on a miss."""
    return export(KTExporter(model, vocab_json), out_dir, manifest=manifest,
                  sequence=(parity_questions, parity_responses))
