"""One time-aware run end to end: read a review log, evaluate under the srs-benchmark protocol, export.

    for each of the protocol's 5 time-ordered folds (srs_eval.protocol_folds):
        fit on the fold's training reviews (its latest 10% early-stop the fit), predict its test block
    metrics.test  = the pooled test blocks' log_loss, rmse_bins, auc, rating_ce, duration_mae_s, duration_rmse_s
    metrics.test.baselines = FSRS-6, base rate and median durations on the same folds (srs_eval.evaluate_baselines)

The exported model is fitted afterwards on all of the user's reviews, by the same rule (its latest 10%
early-stop the fit): the fold figures are its evaluation, as a model fitted on less data. Within the
evaluation, nothing in a test block is ever trained on or used for early stopping; it serves only as history
for later predictions, as it would in the app.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from ...models.time_aware import TimeAwareConfig, TimeAwareTransformer, Window
from ..data import compression, fingerprint
from ..export import load_weights
from ..families import family, restore
from ..loop import duration as in_words
from ..loop import print_line
from .eval import (
    bin_features,
    evaluate_baselines,
    evaluate_predictions,
    fsrs6_fixed_predictions,
    fsrs6_predictions,
    log_loss,
    median_duration_predictions,
    protocol_folds,
    rmse_bins,
    scored_mask,
    user_index,
)
from .reviews import ReviewLog, read_review_data
from .time_aware_export import export_time_aware
from .time_aware_loop import ReviewTensors, TimeAwareTrainConfig, fit, predict


def model_config(tcfg: TimeAwareTrainConfig, log: ReviewLog) -> TimeAwareConfig:
    """The model's configuration: `tcfg.model`'s overrides, and the user's day boundary (scheduler days, which
    FSRS's intervals count) from the log where it knows one and the overrides do not set it."""
    overrides = dict(tcfg.model)
    starts = set(log.day_start_hours().values())
    if "day_start_hour" not in overrides and len(starts) == 1:
        overrides["day_start_hour"] = starts.pop()
    return TimeAwareConfig(**overrides)


def cross_validate(log: ReviewLog, cfg: TimeAwareConfig, tcfg: TimeAwareTrainConfig, n_splits: int = 5,
                   progress: bool = True, final: bool = True,
                   say: Callable[[str], None] | None = None) -> tuple[dict, TimeAwareTransformer, ReviewTensors, list]:
    """Fit one model per protocol fold; return the pooled metrics, a model (fitted on every review when `final`,
    else the last fold's) and the per-fold info. `say(line)` is told, after the first fit, how long the others will
    take."""
    folds = protocol_folds(log, n_splits)
    if not folds or not len(folds[-1][1]):
        raise ValueError(f"{log.path}: too few scored reviews for {n_splits} time-ordered folds")
    sizes = [len(train) for train, _ in folds] + ([len(log)] if final else [])  # the reviews of each fit
    rt = ReviewTensors(log, cfg.window, cfg.card_window, cfg.day_start_hour)
    p_recall = np.full(len(log), np.nan)
    p_rating = np.full((len(log), 4), np.nan)
    duration = np.full(len(log), np.nan)
    fold_info, model = [], None
    for k, (train, test) in enumerate(folds):
        model, info = fit(rt, train, cfg, tcfg, log_progress=_report(f"fold {k + 1}/{len(folds)}", progress))
        rt.set_evidence(model)  # the evidence of the model as served (with its mixture)
        out = predict(model, rt, test)
        p_recall[test], p_rating[test], duration[test] = out["recall"], out["rating_probs"], out["duration_s"]
        fold_info.append({"fold": k + 1, "n_train": int(len(train)), "n_test": int(len(test)),
                          "epochs": len(info["history"]), "best_valid_loss": info["best_valid_loss"],
                          "seconds": round(info["seconds"], 1)})
        if say is not None and k == 0 and len(sizes) > 1:
            say(f"evaluation: fold 1 of {len(folds)} took {in_words(info['seconds'])}; the {len(sizes) - 1} other "
                f"fits take about {in_words(info['seconds'] * sum(sizes[1:]) / max(sizes[0], 1))} more at its pace "
                "(a fit's time grows with its reviews)")
    metrics = evaluate_predictions(log, folds, p_recall, p_rating, duration)
    if final:  # the model to export: every review
        model, info = fit(rt, np.arange(len(log), dtype=np.int64), cfg, tcfg,
                          log_progress=_report("all reviews", progress))
        fold_info.append({"fold": "all reviews (exported)", "n_train": len(log), "epochs": len(info["history"]),
                          "best_valid_loss": info["best_valid_loss"], "seconds": round(info["seconds"], 1)})
    return metrics, model, rt, fold_info


def describe_reviews(log: ReviewLog) -> str:
    """The log's line on the data: what was read as what, and how many users, reviews and cards."""
    cards = len(np.unique(np.stack([user_index(log), log.card]), axis=1).T) if len(log) else 0
    users = f"{log.n_users} user{'s' * (log.n_users != 1)}"
    if log.meta.get("format") == "users":
        kinds = ", ".join(f"{n} {fmt}" for fmt, n in Counter(log.meta["formats"].values()).items())
        read = f"{log.path} read as a folder of {users} ({kinds})"
    else:
        packed = " (gzip)" if log.meta.get("format") != "anki" and compression(log.path) == "gzip" else ""
        read = f"{log.path} read as {log.meta.get('format')}{packed}: {users}"
    return f"data: {read}: {len(log)} reviews of {cards} cards"


def describe_plan(log: ReviewLog, n_splits: int, tcfg: TimeAwareTrainConfig, baselines: bool) -> str:
    """The line saying, before any fit, what the run will fit: the protocol's folds and the exported model, or (with
    cross_validate false) the exported model alone; how to skip the folds; the users the folds leave out."""
    if not tcfg.cross_validate:
        return (f"training: the exported model alone, on all {len(log)} reviews (cross_validate is false: no "
                "protocol folds; `nextstep evaluate` measures it on other users)")
    line = (f"evaluation: the protocol's {n_splits} time-ordered folds, a fit each on the reviews before its test "
            f"block, then the exported model's fit on all {len(log)} reviews ({n_splits + 1} fits of at most "
            f"{tcfg.max_epochs} epochs{', then FSRS-6 and the other baselines on the same folds' if baselines else ''})"
            '; {"cross_validate": false} in --config fits the exported model alone')
    scored = np.bincount(user_index(log)[scored_mask(log)], minlength=log.n_users)
    few = [name for name, n in zip(log.user_ids, scored, strict=True) if n < n_splits + 1]
    if few:
        line += (f"; {len(few)} of the {log.n_users} users {'has' if len(few) == 1 else 'have'} fewer than "
                 f"{n_splits + 1} scored reviews (of a card seen on an earlier day): the folds leave them out, the "
                 f"exported model does not ({', '.join(few[:5])}{', ...' if len(few) > 5 else ''})")
    return line


def _report(label: str, progress: bool):
    def report(h):
        if progress:
            valid = f"valid {h['valid_loss']:.4f}" if "valid_loss" in h else "no validation rows"
            print(f"{label} epoch {h['epoch']}: train {h['train_loss']:.4f} {valid} ({h['seconds']:.0f} s)",
                  flush=True)
    return report


def parity_inputs(rt: ReviewTensors, n: int = 4, length: int = 24) -> Window:
    """n real review sequences of `length` reviews (spread over the log) for the export parity walk."""
    starts = np.linspace(0, max(len(rt.card) - length, 0), n).astype(np.int64)
    idx = torch.from_numpy(np.minimum(starts[:, None] + np.arange(length), len(rt.card) - 1))
    return Window(rt.card[idx], rt.deck[idx], rt.time[idx], rt.rating[idx], rt.duration[idx], rt.state[idx],
                  torch.ones(idx.shape, dtype=torch.bool))


def train_entry(entry, data: str | Path, out_dir: str | Path, *, cfg: TimeAwareTrainConfig | None = None,
                **options) -> dict:
    """The registry's run (families.py: `(entry, data, out, *, cfg, **options)`): the only flashcard family's."""
    return train_time_aware(data, out_dir, cfg=cfg, **options)


def train_time_aware(data: str | Path, out_dir: str | Path, *, cfg: TimeAwareTrainConfig | None = None,
                     n_splits: int = 5, day_columns: str = "check", duration_cap_s: float | None = None,
                     baselines: bool = True, progress: bool = True, log_lines: bool = True) -> dict:
    """Evaluate under the protocol (with the baselines side by side), export a model fitted on all reviews.
    `log_lines`: the lines on the data read, what will be fitted and, after the first fold, how long the rest takes
    (`progress`: each epoch's line)."""
    tcfg = cfg or TimeAwareTrainConfig()
    started = time.perf_counter()
    log = read_review_data(data, day_columns=day_columns, duration_cap_s=duration_cap_s)
    say = print_line if log_lines else None
    if say is not None:
        say(describe_reviews(log))
        say(describe_plan(log, n_splits, tcfg, baselines))
    mcfg = model_config(tcfg, log)
    if tcfg.cross_validate:
        metrics, model, rt, folds = cross_validate(log, mcfg, tcfg, n_splits, progress, say=say)
    else:  # the exported model only: its evaluation is `nextstep evaluate` on users it never saw
        rt = ReviewTensors(log, mcfg.window, mcfg.card_window, mcfg.day_start_hour)
        model, info = fit(rt, np.arange(len(log), dtype=np.int64), mcfg, tcfg,
                          log_progress=_report("all reviews", progress))
        metrics, baselines = {"skipped": "cross_validate is false: evaluate on other users (nextstep evaluate)"}, False
        folds = [{"fold": "all reviews (exported)", "n_train": len(log), "epochs": len(info["history"]),
                  "best_valid_loss": info["best_valid_loss"], "seconds": round(info["seconds"], 1)}]
    model_seconds = time.perf_counter() - started
    if baselines:
        t0 = time.perf_counter()
        metrics["baselines"] = evaluate_baselines(log, n_splits)
        metrics["baselines"]["seconds"] = round(time.perf_counter() - t0, 1)
    out_dir = Path(out_dir)
    files = log.meta.get("files") or ([log.path] if log.path else [])  # a folder of users: each user's file
    manifest = {
        "name": "time_aware",
        "version": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "data": {"path": str(data), "file": log.path, "fingerprint": fingerprint(*files) if files else None,
                 "n_users": log.n_users, "users": list(log.user_ids), "n_reviews": len(log),
                 "day_columns": day_columns,
                 "duration_cap_s": log.meta.get("duration_cap_s", log.meta.get("duration_cap_s_by_user")),
                 "protocol": f"srs-benchmark: per-user TimeSeriesSplit({n_splits}) over scored reviews"},
        "metrics": {"test": metrics},
        "train_config": asdict(tcfg),
        "training": {"folds": folds, "seconds": round(model_seconds, 1), "torch": torch.__version__,
                     "exported_model": "fitted on all reviews (the folds' figures are its evaluation)"},
    }
    return export_time_aware(model, out_dir, manifest=manifest, sequence=parity_inputs(rt))


def load_time_aware(artifact_dir: str | Path) -> tuple[TimeAwareTransformer, dict]:
    return load_weights(artifact_dir, restore)


USER_METRICS = ("log_loss", "rmse_bins", "auc", "duration_mae_s")


def evaluate_time_aware(artifact_dir: str | Path, data: str | Path, *, n_splits: int = 5, day_columns: str = "check",
                        duration_cap_s: float | None = None) -> dict:
    """Score an exported model, as it is (the network frozen, no refitting of it), on the protocol's test blocks of
    another review log (e.g. users it never saw): every earlier review is history, as in serving. For each user and
    fold, the user's FSRS-6 parameters are fitted by fsrs-rs on that user's training reviews of the fold (the
    baseline's own fit, the same folds), the drifts run under them, and the test block is predicted.

    The pooled metrics (as `evaluate_predictions` gives them) plus `users`: per user, the model's log_loss,
    rmse_bins, auc and duration_mae_s, next to FSRS-6 fitted per user on the same folds (`fsrs6`), FSRS-6 with
    fsrs-rs's default parameters (`fsrs6_default`) and the user's median answer time as the prediction
    (`median_duration_mae_s`); and `mean`: the unweighted mean over users of each. `skipped_users`: the users left
    out, name -> why (data the reader refused, too few scored reviews for the folds), each also said on standard
    error as it is met."""
    model, _ = load_time_aware(artifact_dir)
    skipped: dict[str, str] = {}
    log = read_review_data(data, day_columns=day_columns, duration_cap_s=duration_cap_s, skipped=skipped)
    result = score_on_users(model, log, ProtocolBaselines(log, n_splits))
    for name, why in result["skipped_users"].items():
        print(f"skipped {name}: {why}", file=sys.stderr, flush=True)
    result["skipped_users"] = {**skipped, **result["skipped_users"]}
    return result


class ProtocolBaselines:
    """What scoring a model on a review log needs besides the model, computed once for any number of models: the
    protocol's folds, FSRS-6 fitted per user and fold by fsrs-rs (the baseline, and the parameters the model runs
    under), FSRS-6 with fsrs-rs's default parameters, and the user's median answer time."""

    def __init__(self, log: ReviewLog, n_splits: int = 5):
        import fsrs_rs_python as fsrs_rs

        self.log, self.folds = log, protocol_folds(log, n_splits)
        self.fitted = fsrs6_predictions(log, self.folds)
        self.default_w = [float(x) for x in fsrs_rs.DEFAULT_PARAMETERS]
        self.p_default = fsrs6_fixed_predictions(log, self.folds, self.default_w)
        self.median = median_duration_predictions(log, self.folds, by_grade=False)


def score_on_users(model: TimeAwareTransformer, log: ReviewLog, base: ProtocolBaselines) -> dict:
    """evaluate_time_aware's result for a model already loaded (see there; `skipped_users` holds the users the
    protocol's folds leave out)."""
    folds, fitted = base.folds, base.fitted
    rt = ReviewTensors(log, model.cfg.window, model.cfg.card_window, model.cfg.day_start_hour)
    p_recall, p_rating, duration = np.full(len(log), np.nan), np.full((len(log), 4), np.nan), np.full(len(log), np.nan)
    for k, (_, test) in enumerate(folds):
        per_user = np.tile(np.asarray(base.default_w), (log.n_users, 1))
        for (fold, u), w in fitted.parameters.items():
            if fold == k:
                per_user[u] = w
        rt.set_params(per_user)
        rt.set_drift(model)  # the drifts under this fold's parameters
        rt.set_evidence(model)  # and the evidence for the network over FSRS-6's defaults (with the mixture)
        out = predict(model, rt, np.sort(test))
        rows = np.sort(test)
        p_recall[rows], p_rating[rows], duration[rows] = out["recall"], out["rating_probs"], out["duration_s"]
    result = evaluate_predictions(log, folds, p_recall, p_rating, duration)
    owner = user_index(log)
    users, skipped = [], {}
    scored, reviews = np.bincount(owner[scored_mask(log)], minlength=log.n_users), np.diff(log.offsets)
    for u, name in enumerate(log.user_ids):
        mine = [(tr[owner[tr] == u], te[owner[te] == u]) for tr, te in folds]
        model_m = evaluate_predictions(log, mine, p_recall, duration_s=duration) if sum(len(te) for _, te in mine) \
            else {}
        if not model_m.get("n_scored"):
            skipped[name] = (f"{scored[u]} scored reviews (of a card seen on an earlier day) among its {reviews[u]}; "
                             f"the protocol's {len(folds)} folds need at least {len(folds) + 1}")
            continue
        fsrs6_m = evaluate_predictions(log, mine, fitted.p_recall)
        default_m = evaluate_predictions(log, mine, base.p_default)
        median_m = evaluate_predictions(log, mine, duration_s=base.median)
        users.append({"user": name, "scored": int(model_m["n_scored"]),
                      **{key: model_m.get(key) for key in USER_METRICS},
                      "fsrs6": {key: fsrs6_m.get(key) for key in USER_METRICS[:3]},
                      "fsrs6_default": {key: default_m.get(key) for key in USER_METRICS[:3]},
                      "median_duration_mae_s": median_m.get("duration_mae_s")})
    result["users"] = users
    result["mean"] = _user_means(users)
    result["skipped_users"] = skipped
    return result


def _user_means(users: list[dict]) -> dict:
    """The unweighted mean over users of every metric in `users`' rows (finite values only), and the model's log loss
    relative to each FSRS-6 (mean over users of model / FSRS-6 - 1)."""
    def mean(values) -> float | None:
        v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=np.float64)
        return float(v.mean()) if v.size else None

    out = {"users": len(users), **{key: mean(u[key] for u in users) for key in USER_METRICS},
           "median_duration_mae_s": mean(u["median_duration_mae_s"] for u in users)}
    for ref in ("fsrs6", "fsrs6_default"):
        out[ref] = {key: mean(u[ref][key] for u in users) for key in USER_METRICS[:3]}
        out[f"log_loss_vs_{ref}"] = mean(u["log_loss"] / u[ref]["log_loss"] - 1 for u in users
                                         if u[ref]["log_loss"])
    out["users_worse_than_fsrs6_default"] = sum(u["log_loss"] > u["fsrs6_default"]["log_loss"] for u in users)
    return out


TUNING_BLOCKS = (2, 3, 4)  # the sixths of the reviews that tuning scores, each fitted on every review before it


def tuning_split(log: ReviewLog, *, cfg: TimeAwareTrainConfig | None = None, blocks=TUNING_BLOCKS) -> dict:
    """The flashcard model's tuning split (docs/decisions.md): for each k in `blocks`, fit on the first k - 1 sixths
    of the reviews and score the scored reviews of the k-th; the figures pool every block. The protocol's last two
    test blocks (the fifth and sixth sixths) are never looked at, and several time-ordered blocks let drift over
    time show where one block would not. FSRS-6 is fitted and scored on the same blocks, for a figure comparable
    across collections.

        python -m nextstep.training.srs.time_aware_run --data DIR [--seed N] [--duration-cap-s S]
    """
    tcfg = cfg or TimeAwareTrainConfig()
    mcfg = model_config(tcfg, log)
    n = len(log)
    rt = ReviewTensors(log, mcfg.window, mcfg.card_window, mcfg.day_start_hour)
    rows, recall, fsrs, epochs = [], [], [], []
    for k in blocks:
        train = np.arange(n * (k - 1) // 6)
        scored = np.arange(n * (k - 1) // 6, n * k // 6)
        scored = scored[scored_mask(log)[scored]]
        if not len(train) or not len(scored):
            continue
        model, info = fit(rt, train, mcfg, tcfg)
        rt.set_evidence(model)
        rows.append(scored)
        recall.append(predict(model, rt, scored)["recall"])
        fsrs.append(fsrs6_predictions(log, [(train, scored)]).p_recall[scored])
        epochs.append(len(info["history"]))
    if not rows:
        raise ValueError(f"{log.path}: no scored reviews in the tuning blocks {list(blocks)}")
    scored, recall, fsrs = np.concatenate(rows), np.concatenate(recall), np.concatenate(fsrs)
    y = (log.rating[scored] > 1).astype(np.float64)
    delta_t, i, lapse = bin_features(log)
    bins = (delta_t[scored], i[scored], lapse[scored])
    return {"log_loss": log_loss(y, recall), "rmse_bins": rmse_bins(y, recall, *bins),
            "fsrs6_log_loss": log_loss(y, fsrs), "fsrs6_rmse_bins": rmse_bins(y, fsrs, *bins),
            "blocks": list(blocks), "n_scored": int(len(scored)), "epochs": epochs, "seed": tcfg.seed}


def main(argv: list[str] | None = None) -> None:
    """The tuning split of one review log, printed as JSON; `--config` takes a JSON file of TimeAwareTrainConfig
    fields (model settings under "model"), as `nextstep train time_aware --config` does."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description="the flashcard model's tuning split (see tuning_split)")
    parser.add_argument("--data", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--duration-cap-s", type=float)
    parser.add_argument("--config", help="JSON file of TimeAwareTrainConfig fields (the seed comes from --seed)")
    args = parser.parse_args(argv)
    try:
        cfg = family("time_aware").read_train_config(args.config, {"seed": args.seed})
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    print(json.dumps(tuning_split(read_review_data(args.data, duration_cap_s=args.duration_cap_s), cfg=cfg)))


if __name__ == "__main__":
    main()
