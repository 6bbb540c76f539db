"""Issue 38's "no user worse than FSRS-6 with default parameters", on FSRS-6 alone: can a user's own past reviews say
when their fitted parameters are worse than the defaults? Per user of a data folder, under the evaluation's protocol
(its time-series folds, each fold's parameters fitted by fsrs-rs on the reviews before it), three ways to pick the
parameters a fold's test reviews are predicted with:

    fitted    the protocol's fit on all the fold's training reviews (the baseline the issue's goals are against)
    default   fsrs-rs's default parameters
    chosen    the fit, unless the defaults predicted the user's latest training reviews (the last --holdout of their
              scored ones) better than a fit on the reviews before those did: then the defaults
    ensemble  the fit's and the defaults' recall averaged in logits, with weight --weight on the fit

and each user's log loss under each (the cards' FSRS-6 memory from all their earlier reviews, as the protocol's).
Prints one line a user, then how many users each leaves worse than the defaults. A few seconds for the sixteen users.

    python bench/srs_param_choice.py ../shared/data/srs [--holdout 0.2] [--weight 0.5]
"""

from __future__ import annotations

import argparse

import numpy as np

from nextstep.training.srs.eval import (
    _CardHistories,
    _user_blocks,
    evaluate_predictions,
    fit_fsrs6,
    fsrs6_fixed_predictions,
    fsrs6_predictions,
    fsrs6_retrievability,
    log_loss,
    protocol_folds,
    scored_mask,
    user_index,
)
from nextstep.training.srs.reviews import read_review_data


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return np.log(p / (1 - p))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("data", help="a folder of users' review data, as `nextstep evaluate --data` reads it")
    parser.add_argument("--holdout", type=float, default=0.2, help="share of a fold's scored training reviews")
    parser.add_argument("--weight", type=float, default=0.5, help="the fit's weight in the ensemble")
    args = parser.parse_args()
    import fsrs_rs_python as fsrs

    log = read_review_data(args.data)
    folds = protocol_folds(log)
    fitted = fsrs6_predictions(log, folds)
    default = [float(x) for x in fsrs.DEFAULT_PARAMETERS]
    p_default = fsrs6_fixed_predictions(log, folds, default)
    hist, scored = _CardHistories(log), scored_mask(log)
    has_history = hist.pos > 0
    elapsed = np.maximum(np.asarray(log.elapsed_days), 0).astype(np.float64)
    y = np.asarray(log.rating) > 1

    def recall(w: list[float], rows: np.ndarray) -> np.ndarray:
        states = fsrs.FSRS(w).memory_state_batch([hist.item(r, False) for r in rows])
        return fsrs6_retrievability(elapsed[rows], np.array([s.stability for s in states]), w[20])

    p_chosen, choice = fitted.p_recall.copy(), {}
    for k, u, train, test in _user_blocks(log, folds):
        rows = np.sort(train)
        known = rows[scored[rows] & has_history[rows]]
        cut = int(len(known) * (1 - args.holdout))
        if len(known) - cut < 20:  # too few to judge: the fit
            choice[k, u] = "fit"
            continue
        held = known[cut:]
        early = fit_fsrs6(log, rows[rows < held[0]], hist=hist)
        if log_loss(y[held], recall(default, held)) < log_loss(y[held], recall(early, held)):
            choice[k, u] = "default"
            mine = test[has_history[test]]
            if mine.size:
                p_chosen[mine] = recall(default, mine)
        else:
            choice[k, u] = "fit"
    blended = 1 / (1 + np.exp(-(args.weight * _logit(fitted.p_recall) + (1 - args.weight) * _logit(p_default))))
    p_ensemble = np.where(np.isnan(fitted.p_recall), np.nan, blended)
    owner = user_index(log)
    ways = {"fitted": fitted.p_recall, "default": p_default, "chosen": p_chosen, "ensemble": p_ensemble}
    worse = {way: [] for way in ways}
    for u, name in enumerate(log.user_ids):
        mine = [(tr[owner[tr] == u], te[owner[te] == u]) for tr, te in folds]
        loss = {way: evaluate_predictions(log, mine, p).get("log_loss") for way, p in ways.items()}
        if loss["fitted"] is None or not np.isfinite(loss["fitted"]):
            continue
        for way in ways:
            if loss[way] > loss["default"]:
                worse[way].append(name)
        picks = "".join("d" if choice.get((k, u)) == "default" else "f" for k in range(len(folds)))
        print(f"{name[-32:]:32s} " + "  ".join(f"{way} {loss[way]:.4f}" for way in ways)
              + f"  chosen per fold: {picks}")
    for way in ("fitted", "chosen", "ensemble"):
        print(f"worse than the defaults with {way}: {len(worse[way])} users {worse[way]}")


if __name__ == "__main__":
    main()
