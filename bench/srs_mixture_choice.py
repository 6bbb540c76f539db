"""Not a speed bench: the flashcard model's mixture with FSRS-6 (`evidence_prior`, `evidence_halflife`), chosen by
folds over users, and other mixtures of the same forecasters, without scoring each variant through the model again.

For each fold of one or more bench/srs_user_folds.sh runs, the fold's model runs once over every review of its
held-out users under each protocol fold's FSRS-6 parameters (as `nextstep evaluate` does), and the per-review
forecasts are kept (FOLD/forecasts.npz): the network's P(recall) (`net`), FSRS-6 with the user's fitted parameters
(`fsrs`) and with the defaults (`default`), and the network run with the default parameters in place of the user's
(`net_default`). A variant is then a Bayesian mixture of some of them: each forecaster's weight is
softmax(prior + the user's decayed log-likelihood of its forecasts) over the user's scored reviews before the one
predicted, as TimeAwareTransformer.evidence_update keeps it for two. `{"net": 2, "default": 0}` with halflife 140 is
the model as served (checked against FOLD/eval_on.json where the fold has one). Each variant's per-user log loss,
the protocol's, then the nested choice: each fold scored with the variant the other folds' users prefer.

    python bench/srs_mixture_choice.py runs/ep_s0 runs/ep_s1 runs/ep_s2 --json runs/mixture_choice.json
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics as st
import sys
from pathlib import Path

import numpy as np

FORECASTERS = ("net", "fsrs", "default", "net_default")


def forecasts(fold: Path, base) -> dict:
    """The fold model's forecasts over every review of its test users, one row per protocol fold (cached)."""
    cache = fold / "forecasts.npz"
    if cache.exists():
        return dict(np.load(cache))
    import torch

    from nextstep.training.export import load_weights
    from nextstep.training.families import restore
    from nextstep.training.srs.time_aware_loop import ReviewTensors

    model, _ = load_weights(fold / "model", restore)
    model.eval()
    served = model.cfg.evidence_prior, model.cfg.evidence_halflife  # (None for a model exported before the mixture)
    model.cfg = dataclasses.replace(model.cfg, evidence_prior=0.0)  # so that readout computes the defaults' forecast
    log = base.log
    rt = ReviewTensors(log, model.cfg.window, model.cfg.card_window, model.cfg.day_start_hour)

    def run(per_user: np.ndarray) -> dict:
        rt.set_params(per_user)
        rt.set_drift(model)
        rt.evidence = torch.zeros(len(log))  # (the forecasters do not read it; it makes readout compute the defaults')
        out = {k: np.empty(len(log)) for k in ("net", "fsrs", "default", "scored")}
        with torch.no_grad():
            for lo in range(0, len(log), 2048):
                rows = torch.arange(lo, min(lo + 2048, len(log)))
                pred = model.readout(*rt.batch(rows))
                got = pred.network_recall, pred.fsrs_recall, pred.default_recall, pred.scored
                for k, v in zip(("net", "fsrs", "default", "scored"), got, strict=True):
                    out[k][rows.numpy()] = v.double().numpy()
        return out

    default = np.tile(np.asarray(base.default_w), (log.n_users, 1))
    per_fold = []
    for k in range(len(base.folds)):
        per_user = default.copy()
        for (f, u), w in base.fitted.parameters.items():
            if f == k:
                per_user[u] = w
        per_fold.append(run(per_user))
    net_default = run(default)["net"]
    result = {k: np.stack([p[k] for p in per_fold]) for k in ("net", "fsrs", "default", "scored")}
    result["scored"] = result["scored"] > 0
    result["served"] = np.asarray([np.nan if x is None else x for x in served], dtype=np.float64)
    result["net_default"] = np.tile(net_default, (len(base.folds), 1))
    np.savez(cache, **result)
    return result


def mixture(f: dict, spec: dict, halflife: float | None, log, base) -> np.ndarray:
    """P(recall) (N,) on every test review: the Bayesian mixture of the forecasters in `spec` (name: prior in nats),
    each user's weights from their scored reviews before the one predicted, under the test block's protocol fold."""
    from scipy.signal import lfilter

    from nextstep.srs.review_window import drift_decay
    from nextstep.training.srs.eval import user_index

    a = drift_decay(halflife) if halflife else 1.0
    y = np.asarray(log.rating) > 1
    owner = user_index(log)
    out = np.full(len(log), np.nan)
    names = list(spec)
    prior = np.asarray([spec[n] for n in names], dtype=np.float64)
    for k, (_, test) in enumerate(base.folds):
        p = np.stack([np.clip(f[n][k], 1e-6, 1 - 1e-6) for n in names])  # (J, N)
        loglik = np.where(y, np.log(p), np.log1p(-p))
        scored = f["scored"][k]
        for u in np.unique(owner[test]):
            lo, hi = log.offsets[u], log.offsets[u + 1]
            s = scored[lo:hi]
            gains = loglik[:, lo:hi][:, s]  # (J, m): the scored reviews' log-likelihoods, in time order
            # L after the i-th scored review: a^i prior + sum_{j<=i} a^(i-j) gain_j
            total = np.concatenate([prior[:, None], lfilter([1.0], [1.0, -a], gains, axis=1,
                                                            zi=(a * prior)[:, None])[0]], axis=1)
            before = np.concatenate([[0], np.cumsum(s)])[:-1]  # scored reviews before each row
            rows = test[(test >= lo) & (test < hi)]
            L = total[:, before[rows - lo]]  # (J, r)
            w = np.exp(L - L.max(0))
            w /= w.sum(0)
            out[rows] = (w * p[:, rows]).sum(0)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="bench/srs_user_folds.sh output folders (one per seed)")
    parser.add_argument("--priors", nargs="+", type=float, default=[0.0, 1.0, 2.0, 3.0])
    parser.add_argument("--halflives", nargs="+", default=["70", "140", "none"])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    from nextstep.models.time_aware import TimeAwareConfig
    from nextstep.training.srs.eval import evaluate_predictions, log_loss, scored_mask, user_index
    from nextstep.training.srs.reviews import read_review_data
    from nextstep.training.srs.time_aware_run import ProtocolBaselines

    defaults = TimeAwareConfig()
    default_mix = ({"net": defaults.evidence_prior, "default": 0.0}, defaults.evidence_halflife)
    halflives = [None if h == "none" else float(h) for h in args.halflives]
    variants = {}
    for prior, h in itertools.product(args.priors, halflives):
        variants[f"net+default prior {prior:g} halflife {h}"] = ({"net": prior, "default": 0.0}, h)
        variants[f"net+net_default+default prior {prior:g} halflife {h}"] = (
            {"net": prior, "net_default": prior, "default": 0.0}, h)
    for alone in FORECASTERS:
        variants[f"{alone} alone"] = ({alone: 0.0}, None)
    result: dict = {}  # {run: {fold: {variant: [user rows]}}}
    for fold_name in ("f1", "f2", "f3", "f4"):
        folds = [r / fold_name for r in args.runs if (r / fold_name / "model" / "manifest.json").exists()]
        if not folds:
            continue
        log = read_review_data(folds[0] / "test")
        base = ProtocolBaselines(log)
        owner, y = user_index(log), np.asarray(log.rating) > 1
        tested = np.sort(np.concatenate([te for _, te in base.folds]))
        tested = tested[scored_mask(log)[tested]]  # the rows the protocol scores (evaluate_predictions')
        users = []
        for u, user in enumerate(log.user_ids):
            mine = tested[owner[tested] == u]
            if len(mine):
                users.append({"user": user, "scored": len(mine), "rows": mine,
                              "fsrs6": log_loss(y[mine], base.fitted.p_recall[mine]),
                              "fsrs6_default": log_loss(y[mine], base.p_default[mine])})
        for fold in folds:
            f = forecasts(fold, base)
            served = json.loads((fold / "eval_on.json").read_text())["users"] if (fold / "eval_on.json").exists() \
                else None
            rows = result.setdefault(str(fold.parent), {}).setdefault(fold_name, {})
            shipped = None  # P(recall) with the mixture at the config's defaults, where the grid holds it
            for name, (spec, h) in variants.items():
                p = mixture(f, spec, h, log, base)
                if (spec, h) == default_mix:
                    shipped = p
                rows[name] = [{"user": r["user"], "scored": r["scored"],
                               "log_loss": log_loss(y[r["rows"]], p[r["rows"]]),
                               "fsrs6": r["fsrs6"], "fsrs6_default": r["fsrs6_default"],
                               "vs_default_se": _paired_se(y[r["rows"]], p[r["rows"]], base.p_default[r["rows"]])}
                              for r in users]
            if served:
                # the replay of the model as it was scored (with its mixture or without) against its scoring
                prior, h = f["served"]
                key = "net alone" if np.isnan(prior) else f"net+default prior {prior:g} halflife {h}"
                mine = {r["user"]: r["log_loss"] for r in rows[key]}
                gap = max(abs(mine[s["user"]] - s["log_loss"]) for s in served)
                print(f"{fold}: replay of the served mixture vs eval_on.json: largest gap {gap:.2e}", file=sys.stderr)
                # FOLD/mix_on.json: `nextstep evaluate`'s users with the mixture at the config's defaults
                p = shipped if shipped is not None else mixture(f, *default_mix, log, base)
                mixed = []
                for row in served:
                    u = log.user_ids.index(row["user"])
                    m = evaluate_predictions(log, [(tr[owner[tr] == u], te[owner[te] == u]) for tr, te in base.folds],
                                             p)
                    mixed.append({**row, **{k: m[k] for k in ("log_loss", "rmse_bins", "auc")}})
                (fold / "mix_on.json").write_text(json.dumps({"mixture": {"evidence_prior": default_mix[0]["net"],
                                                                          "evidence_halflife": default_mix[1]},
                                                              "users": mixed}, indent=1))
            print(f"{fold}: done", file=sys.stderr, flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    report(result)


def _paired_se(y: np.ndarray, p: np.ndarray, q: np.ndarray) -> float:
    """The standard error of the mean per-review difference in log loss between forecasts p and q."""
    def loss(x):
        x = np.clip(x, 1e-12, 1 - 1e-12)
        return -np.where(y, np.log(x), np.log1p(-x))
    d = loss(p) - loss(q)
    return float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else float("nan")


def rel(users: list[dict]) -> float:
    return st.mean(u["log_loss"] / u["fsrs6"] - 1 for u in users)


def report(result: dict) -> None:
    """Per seed and over seeds: each variant's mean of (model / FSRS-6 per user - 1), the users worse than the
    defaults, and the nested choice (each fold with the variant the other folds' users prefer)."""
    for run, by_fold in result.items():
        folds = list(by_fold)
        variants = list(by_fold[folds[0]])
        print(f"\n{run} ({', '.join(folds)})\n\n| variant | mean of (model / FSRS-6 - 1) | worse than the defaults |")
        print("|---|---|---|")
        for v in variants:
            every = [u for f in folds for u in by_fold[f][v]]
            worse = [u["user"].split("_")[0] for u in every if u["log_loss"] > u["fsrs6_default"]]
            print(f"| {v} | {rel(every):+.2%} | {len(worse)} {' '.join(worse)} |")
        if len(folds) < 2:
            continue
        for family in ("net+default", "net+net_default+default"):
            candidates = [v for v in variants if v.startswith(family + " prior")]
            chosen = []
            for f in folds:
                others = {v: rel([u for g in folds if g != f for u in by_fold[g][v]]) for v in candidates}
                best = min(candidates, key=others.__getitem__)
                chosen += by_fold[f][best]
                print(f"{family} {f}: the other folds choose {best}")
            worse = [u["user"].split("_")[0] for u in chosen if u["log_loss"] > u["fsrs6_default"]]
            print(f"{family}, nested: {rel(chosen):+.2%}, worse than the defaults: {worse}")
    runs = list(result)
    folds = sorted({f for r in runs for f in result[r]})
    variants = list(result[runs[0]][folds[0]])
    print(f"\nPooled over {len(runs)} runs: each fold's variant chosen on the other folds' users of every run")
    for family in ("net+default", "net+net_default+default"):
        candidates = [v for v in variants if v.startswith(family + " prior")]
        chosen = {r: [] for r in runs}
        for f in folds:
            others = {v: rel([u for r in runs for g in result[r] if g != f for u in result[r][g][v]])
                      for v in candidates}
            best = min(candidates, key=others.__getitem__)
            print(f"  {family} {f}: {best} ({others[best]:+.2%} on the others)")
            for r in runs:
                chosen[r] += result[r].get(f, {}).get(best, [])
        for r in runs:
            worse = [f"{u['user'].split('_')[0]} {u['log_loss'] / u['fsrs6_default'] - 1:+.1%} "
                     f"(paired SE {u['vs_default_se'] / u['fsrs6_default']:.1%})"
                     for u in chosen[r] if u["log_loss"] > u["fsrs6_default"]]
            print(f"  {family}, {r}: {rel(chosen[r]):+.2%} over {len(chosen[r])} users; worse than the defaults: "
                  f"{worse}")
        everyone = {v: rel([u for r in runs for g in result[r] for u in result[r][g][v]]) for v in candidates}
        best = min(candidates, key=everyone.__getitem__)
        print(f"  {family}: chosen on every fold (the default to ship): {best} ({everyone[best]:+.2%})")


if __name__ == "__main__":
    main()
