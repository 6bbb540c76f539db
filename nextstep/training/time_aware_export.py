"""The time-aware transformer through the export harness (export.py): the `predict` readout over a window.

    predict(hist_card, hist_deck, hist_time, hist_rating, hist_duration, hist_state, hist_valid,
            card, deck, time) -> rating_probs (B, 4), recall (B,), duration_s (B,)

The state is a window of the user's latest reviews (the hist_* inputs, (B, H), left-padded with hist_valid
False, in time order); the service keeps raw reviews and selects each query's window with
`nextstep.review_window.select`, the rule training used, so only the readout is exported (no step graph, no
state files). Card/deck ids are only compared for equality, so any int64 coding works (the service hashes
its string ids). Times are unix seconds (float64), durations seconds (float32, NaN unknown), states 0..3 or -1.

Parity walks real review sequences no longer than the window: stepping reviews into the window and reading
out vs the full teacher-forced pass, and eager vs TorchScript vs ONNX Runtime. A miss fails the export.
"""

from __future__ import annotations

from pathlib import Path

from ..models.time_aware import TimeAwareTransformer, Window, expected_duration
from .export import Exporter, export

INPUTS = ("hist_card", "hist_deck", "hist_time", "hist_rating", "hist_duration", "hist_state", "hist_valid",
          "card", "deck", "time")


class TimeAwareExporter(Exporter):
    event = ("card", "deck", "time", "rating", "duration", "review_state")
    query = ("card", "deck", "time")
    step_graph = False
    state_files = False

    def answer(self, state, card, deck, time):
        p = self.model.readout(state, card, deck, time)
        return {"rating_probs": p.rating_probs, "recall": p.recall, "duration_s": expected_duration(p.log_duration)}

    def walk(self, sequence):
        for t in range(sequence[0].shape[1]):
            yield tuple(x[:, t] for x in sequence[:6]), tuple(x[:, t] for x in sequence[:3])

    def full(self, sequence):
        p = self.model(Window(*sequence))
        return p.rating_probs, p.log_duration

    def stepped(self, state, query):
        p = self.model.readout(state, *query)
        return p.rating_probs, p.log_duration

    def dims(self, dim):
        history = dim("history")  # the window's rows: one axis shared by every hist_* input
        return {name: {1: history} for name in INPUTS[:7]}

    def manifest(self):
        return {"window": {"size": self.model.cfg.window, "card_size": self.model.cfg.card_window}}


def export_time_aware(model: TimeAwareTransformer, out_dir: Path, *, manifest: dict, sequence: Window) -> dict:
    """sequence: (B >= 2, T) real reviews, each row's earlier reviews all before it (T is cut to the window)."""
    T = min(sequence.card.shape[1], model.cfg.window)
    return export(TimeAwareExporter(model), out_dir, manifest=manifest, sequence=tuple(x[:, :T] for x in sequence))



