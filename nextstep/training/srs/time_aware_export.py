"""The time-aware transformer through the export harness (export.py): the `predict` readout over a window.

    predict(hist_card, hist_deck, hist_time, hist_rating, hist_duration, hist_state, hist_valid, hist_error, drift,
            fsrs_w, day_start, evidence, card, deck, time)
        -> rating_probs (B, 4), recall (B,), duration_s (B,), fsrs_recall (B,), scored (B,)
           [, network_recall (B,), default_recall (B,): with the mixture]
    schedule(hist_*, drift, fsrs_w, day_start, evidence, card, deck, time, retention)
        -> recall (B,), log_wait_days (B,), duration_s (B,)
    predict_memory(hist_*, drift, fsrs_w, day_start, evidence, card, deck, time, memory [, default_stability])
        -> predict's outputs

`fsrs_w` (B, 21) float32 is each row's user's FSRS-6 parameters, fitted on that user's own reviews (the service keeps
them in the user's state and refits them, `nextstep srs refit`); a user without a fit gets the manifest's
`fsrs6.parameters` (the model's `fsrs_w` buffer: fsrs-rs's defaults, or those of the one collection a single-user
artifact was trained on). One artifact serves every user with their own parameters.

`day_start` (B,) float64 is each row's user's scheduler day boundary, in seconds after 00:00 UTC (Anki's "next day
starts at" hour in the user's time zone): FSRS-6 counts intervals in these days, and a review is `scored` when its
card was last reviewed on an earlier one. A user without one gets the manifest's `model_config.day_start_hour`.

`drift` (B, 2) float32 is the user's drift sums (TimeAwareTransformer.drift_offset): after each review, the
service adds FSRS-6's error on it, rating > 1 minus the `fsrs_recall` that predict answered for it just before,
when `scored` (TimeAwareTransformer.drift_update; the manifest's `drift` gives the constants). The same error is
stored with the review and comes back as its `hist_error` (NaN when not `scored`): the deck's drift reads it.

`evidence` (B,) float32 is the user's evidence for the network over FSRS-6 with the default parameters (the
manifest's `evidence`, only where the config's `evidence_prior` is set; otherwise the graphs do not take it): the
served recall is sigmoid(evidence) network_recall + sigmoid(-evidence) default_recall, and after each scored review
the service adds the defaults' log loss on it minus the network's (TimeAwareTransformer.evidence_update).

`schedule` is the forgetting curve's inverse (TimeAwareTransformer.schedule): for each card, how long from `time`
until P(recall) falls to `retention` (log(1 + days); 0: due now), with the recall and answer time at that moment.

The state is a window of the user's latest reviews (the hist_* inputs, (B, H), left-padded with hist_valid
False, in time order); the service keeps raw reviews and selects each query's window with
`nextstep.srs.review_window.select`, the rule training used, so only the readout is exported (no step graph, no
state files). Card/deck ids are only compared for equality, so any int64 coding works (the service hashes
its string ids). Times are unix seconds (float64), durations seconds (float32, NaN unknown), states 0..3 or -1.

`predict_memory` is `predict` with the query card's FSRS-6 (stability, difficulty) after its reviews in the window
as an input, `memory` (B, 2) float32, instead of FSRS-6's recurrence over them inside the graph (one unrolled step
per review of the card: about 0.2 ms of predict's 0.5 ms at the default sizes); the service computes it with
fsrs-rs (nextstep/srs/card_memory.py); for a card without a review in the window the graph reads none of it. With the
mixture it also takes `default_stability` (B,) float32, the card's stability under the default parameters.

Parity walks real review sequences no longer than the window: stepping reviews into the window and reading
out vs the full teacher-forced pass, and eager vs TorchScript vs ONNX Runtime. The exported predict graph must
also keep its promise (`properties`): on every prefix of those sequences, with the next review's card as the
query, P(recall) never rises over 64 elapsed times from 1 minute to 10 years, and `predict_memory` fed
card_memory's fsrs-rs memory (any, for a card without a review) answers as `predict` does (within the engines'
tolerance). A miss fails the export.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ...models.time_aware import TimeAwareConfig, TimeAwareTransformer, Window, expected_duration
from ...srs.card_memory import UNSEEN, card_memory
from ..export import ENGINE_TOLERANCE, Exporter, Graph, export

INPUTS = ("hist_card", "hist_deck", "hist_time", "hist_rating", "hist_duration", "hist_state", "hist_valid",
          "hist_error", "drift", "fsrs_w", "day_start", "evidence", "card", "deck", "time")
N_STATE = 12  # the window's eight fields, the drift, the user's FSRS-6 parameters, day boundary and evidence
MIXTURE_OUTPUTS = ("network_recall", "default_recall")  # where the model mixes in FSRS-6's defaults


MONOTONE_POINTS = 64  # elapsed times per query in the export's monotonicity check, 1 minute to 10 years
MONOTONE_SPAN_S = 10 * 365.25 * 86400.0
MONOTONE_TOLERANCE = 1e-6  # float32 rounding of a flat curve


class TimeAwareExporter(Exporter):
    event = ("card", "deck", "time", "rating", "duration", "review_state")
    query = ("card", "deck", "time")
    step_graph = False
    state_files = False

    @property
    def mixing(self) -> bool:
        return self.model.cfg.evidence_prior is not None

    def answer(self, state, card, deck, time, memory=None, default_stability=None):
        p = self.model.readout(state, card, deck, time, memory, default_stability)
        out = {"rating_probs": p.rating_probs, "recall": p.recall, "duration_s": expected_duration(p.log_duration),
               "fsrs_recall": p.fsrs_recall, "scored": p.scored}
        return {**out, "network_recall": p.network_recall, "default_recall": p.default_recall} if self.mixing else out

    def walk(self, sequence):
        for t in range(sequence[0].shape[1]):
            yield tuple(x[:, t] for x in sequence[:6]), tuple(x[:, t] for x in sequence[:3])

    def full(self, sequence):
        p = self.model(Window(*sequence))
        return p.rating_probs, p.log_duration

    def stepped(self, state, query):
        p = self.model.readout(state, *query)
        return p.rating_probs, p.log_duration

    def graphs(self, sequence):
        graphs = super().graphs(sequence)
        readout = graphs[0]
        batch = readout.dynamic[-1]  # `time`'s axes: the batch
        retention = torch.linspace(0.5, 0.97, readout.example[-1].shape[0], dtype=torch.float32)
        state, query = readout.example[:N_STATE], readout.example[N_STATE:]
        memory = (self.model.card_memory(state, *query),)
        if self.mixing:  # and the card's stability under the default parameters
            memory += (self.model.card_memory(state, *query, default=True)[:, 0],)
        given = ["memory", "default_stability"][:len(memory)]
        return [*graphs, Graph("schedule", "extra", [*INPUTS, "retention"], ["recall", "log_wait_days", "duration_s"],
                               (*readout.example, retention), [*readout.dynamic, batch],
                               fn=lambda *inputs: self.model.schedule(inputs[:N_STATE], *inputs[N_STATE:])),
                Graph("predict_memory", "extra", [*INPUTS, *given], readout.outputs, (*readout.example, *memory),
                      [*readout.dynamic, *[batch] * len(memory)],
                      fn=lambda *inputs: tuple(self.answer(inputs[:N_STATE], *inputs[N_STATE:]).values()))]

    def properties(self, sessions, sequence):
        predict, twin = sessions["predict"], sessions["predict_memory"]
        kept, twin_kept = {i.name for i in predict.get_inputs()}, {i.name for i in twin.get_inputs()}
        apart = 0.0
        B, T = sequence[0].shape
        rng = np.random.default_rng(0)
        offsets = np.sort(np.exp(rng.uniform(np.log(60.0), np.log(MONOTONE_SPAN_S), MONOTONE_POINTS)))
        worst, queries = 0.0, 0
        for b in range(B):
            for t in range(1, T):
                rows = [x[b, :t].numpy() for x in sequence]  # the t reviews before the query, all valid
                feeds = dict(zip(INPUTS[:8], [np.repeat(r[None], len(offsets), 0) for r in rows[:6]]
                                 + [np.ones((len(offsets), t), dtype=bool),
                                    np.tile(np.float32([-0.3, np.nan, 0.2])[np.arange(t) % 3], (len(offsets), 1))],
                                 strict=True))
                feeds["drift"] = np.tile(np.array([[-1.0, 4.0]], dtype=np.float32), (len(offsets), 1))
                feeds["fsrs_w"] = np.tile(self.model.fsrs_w.float().numpy()[None], (len(offsets), 1))
                feeds["day_start"] = np.full(len(offsets), self.model.cfg.day_start_hour * 3600.0)
                feeds["evidence"] = np.full(len(offsets), 0.5, dtype=np.float32)  # both forecasters count
                feeds.update(card=np.full(len(offsets), sequence[0][b, t].item()),
                             deck=np.full(len(offsets), sequence[1][b, t].item()),
                             time=rows[2][-1] + offsets)
                outputs = predict.run(None, {k: v for k, v in feeds.items() if k in kept})
                recall = outputs[[o.name for o in predict.get_outputs()].index("recall")]
                worst, queries = max(worst, float(np.diff(recall).max())), queries + 1
                memory = card_memory(rows[0], rows[2], rows[3], int(feeds["card"][0]), feeds["fsrs_w"][0],
                                     float(feeds["day_start"][0]), self.model.cfg.card_window)
                # the twin fed fsrs-rs's memory (UNSEEN for a card without a review) answers as predict does
                fed = {"memory": np.tile(np.float32(memory or UNSEEN), (len(offsets), 1))}
                if "default_stability" in twin_kept:  # the same under the default parameters
                    default = card_memory(rows[0], rows[2], rows[3], int(feeds["card"][0]),
                                          self.model.fsrs_w.float().numpy(), float(feeds["day_start"][0]),
                                          self.model.cfg.card_window)
                    fed["default_stability"] = np.full(len(offsets), (default or UNSEEN)[0], dtype=np.float32)
                given = twin.run(None, {**{k: v for k, v in feeds.items() if k in twin_kept}, **fed})
                apart = max(apart, *(float(np.abs(a.astype(np.float64) - b).max())
                                     for a, b in zip(given, outputs, strict=True)))
        return {"recall_rise_max": worst, "recall_monotone_queries": queries,
                "memory_vs_predict_max": apart,  # on every one of those queries
                "passed": worst <= MONOTONE_TOLERANCE and apart <= ENGINE_TOLERANCE}

    def dims(self, dim):
        history = dim("history")  # the window's rows: one axis shared by every hist_* input
        return {name: {1: history} for name in INPUTS[:8]}

    def manifest(self):
        m = self.model
        return {"window": {"size": m.cfg.window, "card_size": m.cfg.card_window},
                "fsrs6": {"parameters": [round(float(x), 6) for x in m.fsrs_w], "blend": round(float(m.blend), 6),
                          "per_user": True,
                          "about": "the FSRS-6 curve the network corrects, with each user's own parameters (the "
                                   "graphs' fsrs_w input); `parameters` are those a user starts with before a fit on "
                                   "their own reviews; recall logit = FSRS-6 + blend * (network - FSRS-6) + drift "
                                   "offset"},
                "drift": {"halflife_scored_reviews": m.cfg.drift_halflife, "prior_reviews": m.cfg.drift_prior,
                          "gain": round(float(m.drift_gain), 6),
                          "deck_gain": round(float(m.deck_drift_gain), 6),
                          "about": "drift (m, w): FSRS-6's errors y - fsrs_recall on the user's scored reviews, "
                                   "m <- a m + error, w <- a w + 1 with a = 0.5^(1 / halflife); recall logit offset "
                                   "gain * m / (w + prior), plus deck_gain times the same mean over the window's "
                                   "rows of the query's deck with an error (hist_error)"},
                **({"evidence": {"prior": m.cfg.evidence_prior, "halflife_scored_reviews": m.cfg.evidence_halflife,
                                 "about": "the user's evidence E for the network over FSRS-6 with `fsrs6.parameters`: "
                                          "recall = sigmoid(E) network_recall + sigmoid(-E) default_recall; after "
                                          "a scored review E <- a E + loss(default_recall) - loss(network_recall), "
                                          "log losses with P clipped to [1e-6, 1 - 1e-6], a = 0.5^(1 / halflife) "
                                          "(1: no halflife); a new user starts at the prior"}}
                   if self.mixing else {})}


# terms added after the first exports, each with what an artifact saved before it had of it: nothing
_ADDED_TERMS = {"drift_gain": 0.0, "deck_drift_gain": 0.0}  # config key and buffer of the same name
_ADDED_BUFFERS = {"duration_shift": 0.0}
# settings without weights added after the first exports, each with the value artifacts saved before it had
_ADDED_SETTINGS = {"gap_factor": 1.0, "interval_ratio_max": None, "interval_ratio_min": None, "evidence_prior": None,
                   "evidence_halflife": None}


def restore_time_aware(family: str, config: dict, weights: dict) -> TimeAwareTransformer:
    """The model of a weights.pt, also one saved before the user's drift, the deck's drift or the answer time's
    median shift existed: a missing gain or shift is 0 (the term off), as that model was; anything else missing
    is the strict load's error."""
    config = {**_ADDED_TERMS, **_ADDED_SETTINGS, **config}
    weights = {**{k: torch.tensor(float(config[k])) for k in _ADDED_TERMS},
               **{k: torch.tensor(v) for k, v in _ADDED_BUFFERS.items()}, **weights}
    model = TimeAwareTransformer(TimeAwareConfig(**config))
    model.load_state_dict(weights)
    return model


def export_time_aware(model: TimeAwareTransformer, out_dir: Path, *, manifest: dict, sequence: Window) -> dict:
    """sequence: (B >= 2, T) real reviews, each row's earlier reviews all before it (T is cut to the window)."""
    T = min(sequence.card.shape[1], model.cfg.window)
    return export(TimeAwareExporter(model), out_dir, manifest=manifest,
                  sequence=tuple(x[:, :T] for x in sequence[:7]))  # raw reviews: stepping adds their errors



