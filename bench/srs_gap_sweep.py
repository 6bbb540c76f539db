"""Not a speed bench: the flashcard network's settings that hold no weights (how far past the longest gap its rows
show its own curve is trusted, `gap_shrink` and `gap_factor`; how far in time it may move FSRS-6's curve,
`interval_ratio_max` and `interval_ratio_min`; its mixture with FSRS-6's defaults, `evidence_prior` and
`evidence_halflife`), scored on users it never saw. For each fold of a
bench/srs_user_folds.sh run, the fold's model scored on its held-out users with each variant, the protocol's FSRS-6
fits made once for all of them; then, for each fold, the variant the other three folds' users prefer (nested: a
user's own figure never chooses its variant).

    python bench/srs_gap_sweep.py runs/hide_s0 --variants '{"gap_factor": 1}' '{"gap_shrink": false}' \
        '{"gap_shrink": false, "interval_ratio_max": 2}' --json runs/hide_s0/sweep.json
    python bench/srs_gap_sweep.py runs/hide_s0 --report runs/hide_s0/sweep.json   # the tables again

A variant may also set one of the model's learned scalars outright (a buffer, e.g. '{"deck_drift_gain": 0}': the
deck's drift off). The intervals of a variant: bench/srs_intervals.py --set KEY=VALUE ... --export-to NEW.
"""

from __future__ import annotations

import argparse
import json
import statistics as st
import sys
from pathlib import Path


def sweep(run: Path, variants: list[str]) -> dict:
    """{fold: {variant: evaluate's users list}} for every fold of `run`; each variant a JSON object of settings."""
    import torch

    from nextstep.training.export import load_weights
    from nextstep.training.families import restore
    from nextstep.training.srs.reviews import read_review_data
    from nextstep.training.srs.time_aware_run import ProtocolBaselines, score_on_users

    out = {}
    for fold in sorted(p for p in run.glob("f[0-9]") if (p / "model" / "manifest.json").exists()):
        model, _ = load_weights(fold / "model", restore)
        log = read_review_data(fold / "test")
        base = ProtocolBaselines(log)
        trained = model.cfg.to_dict()
        out[fold.name] = {}
        learned = {name: value.clone() for name, value in model.named_buffers()}
        for v in variants:
            given = json.loads(v)
            weights = {k: given.pop(k) for k in list(given) if k in learned}  # a learned scalar set outright
            model.cfg = type(model.cfg)(**{**trained, **given})
            with torch.no_grad():
                for name, value in learned.items():
                    getattr(model, name).copy_(torch.full_like(value, weights[name]) if name in weights else value)
            out[fold.name][v] = score_on_users(model, log, base)["users"]
            print(f"{fold.name} {v}: {rel(out[fold.name][v]):+.2%}", file=sys.stderr, flush=True)
    return out


def rel(users: list[dict]) -> float:
    """Mean over users of (model / FSRS-6 per user - 1) in log loss."""
    return st.mean(u["log_loss"] / u["fsrs6"]["log_loss"] - 1 for u in users)


def report(result: dict) -> None:
    folds = list(result)
    values = list(result[folds[0]])
    print("| variant | " + " | ".join(folds) + " | all users: mean of (model / FSRS-6 - 1) | "
          "worse than FSRS-6 default |")
    print("|---|" + "---|" * (len(folds) + 2))
    for v in values:
        every = [u for f in folds for u in result[f][v]]
        worse = sum(u["log_loss"] > u["fsrs6_default"]["log_loss"] for u in every)
        per_fold = " | ".join(f"{rel(result[f][v]):+.2%}" for f in folds)
        print(f"| {v} | {per_fold} | {rel(every):+.2%} | {worse} |")
    if len(folds) < 2:  # (one fold: no other folds' users to choose on)
        return
    chosen = []
    for f in folds:  # nested: chosen on the other folds' users
        others = {v: rel([u for g in folds if g != f for u in result[g][v]]) for v in values}
        best = min(values, key=others.__getitem__)
        chosen += result[f][best]
        print(f"{f}: chosen on the other folds' users: {best} ({others[best]:+.2%} there)")
    print(f"nested choice, every user scored with the value the others chose: {rel(chosen):+.2%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="a bench/srs_user_folds.sh output folder (f1..f4 with model, test)")
    parser.add_argument("--variants", nargs="+", default=['{}'],
                        help="JSON objects of model settings without weights (or learned scalars, set outright), each "
                             "applied to the trained model")
    parser.add_argument("--json", type=Path, help="write the per-user results here")
    parser.add_argument("--report", type=Path, help="print the tables of an earlier --json and stop")
    args = parser.parse_args(argv)
    if args.report:
        report(json.loads(args.report.read_text()))
        return
    result = sweep(args.run, args.variants)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    report(result)


if __name__ == "__main__":
    main()
