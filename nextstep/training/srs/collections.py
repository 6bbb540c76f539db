"""Flashcards for every user: the flashcard model against FSRS-6 on several users' collections, with its training
settings chosen leave-one-collection-out, so that no collection's figures come from settings tuned on it.

    python -m nextstep.training.srs.collections --data ../shared/data/srs --out OUT [--seeds 0 1 2]

1. Collections: every `anki_small/*/collection.anki2` is imported as `nextstep import-anki` does (read-only) into
   OUT/imported/NAME.csv and read back from there; AnkiMath (answer times capped at 500 s, as its data README
   says) and the py-fsrs log are read as they are.
2. Tuning: every candidate setting (CANDIDATES) on every collection's tuning split (time_aware_run.tuning_split:
   score the second, third and fourth sixths, each fitted on the reviews before it; the protocol's last two test
   blocks are never looked at),
   as the ratio of its log loss to FSRS-6's on the same split.
3. For each collection, the candidate with the lowest mean ratio over the *other* collections is its setting.
4. Evaluation: each collection under the srs-benchmark protocol (5 time-ordered folds) with its setting, for
   every seed, next to FSRS-6, the base rate and the median answer time fitted in the same run on the same folds.

Writes OUT/tuning.json, OUT/results.json and OUT/table.md.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .eval import evaluate_baselines
from .reviews import ReviewLog, read_anki_collection, read_reviews, write_review_csv
from .time_aware_loop import TimeAwareTrainConfig
from .time_aware_run import cross_validate, model_config, tuning_split


def _candidate(gain: float, deck_gain: float, prior: float, platt: bool) -> dict:
    """The drifts' gains before calibration (the user's, the deck's), the weight of the prior that holds them there,
    and whether calibration also fits Platt's scale and shift on the latest training reviews."""
    return {"model": {"drift_gain": gain, "deck_drift_gain": deck_gain}, "drift_gain_prior": prior, "platt": platt}


# the settings leave-one-collection-out chooses among (TimeAwareTrainConfig overrides), in the order they were added
CANDIDATES = {
    "g4_p0.03": _candidate(4.0, 0.0, 0.03, True),
    "g3_d2_p0.03": _candidate(3.0, 2.0, 0.03, True),
    "g2_d3_p0.03": _candidate(2.0, 3.0, 0.03, True),
    "g3_d2_p0.03_noplatt": _candidate(3.0, 2.0, 0.03, False),
    "g4_p0.03_noplatt": _candidate(4.0, 0.0, 0.03, False),
    "g4_p0.3_noplatt": _candidate(4.0, 0.0, 0.3, False),
    "g4_p3_noplatt": _candidate(4.0, 0.0, 3.0, False),
    "g3_d2_p3_noplatt": _candidate(3.0, 2.0, 3.0, False),
    "g3_d2_p0.3_noplatt": _candidate(3.0, 2.0, 0.3, False),
    "g4_d1_p0.3_noplatt": _candidate(4.0, 1.0, 0.3, False),
}


@dataclass
class Collection:
    name: str
    log: ReviewLog
    source: str


def collections(data: Path, out: Path) -> list[Collection]:
    """The six users: AnkiMath, the py-fsrs log and every anki_small collection (imported into out/imported)."""
    found = []
    if (data / "ankimath").is_dir():
        found.append(Collection("ankimath", read_reviews(data / "ankimath", duration_cap_s=500.0),
                                str(data / "ankimath")))
    josh = sorted((data / "py_fsrs_josh").glob("review_logs_*.csv"))
    if josh:
        found.append(Collection("py_fsrs_josh", read_reviews(josh[0]), str(josh[0])))
    for anki in sorted((data / "anki_small").glob("*/collection.anki2")):
        csv = out / "imported" / f"{anki.parent.name}.csv"
        csv.parent.mkdir(parents=True, exist_ok=True)
        write_review_csv(read_anki_collection(anki), csv)
        found.append(Collection(anki.parent.name, read_reviews(csv), str(anki)))
    return found


def _config(name: str, seed: int) -> TimeAwareTrainConfig:
    return TimeAwareTrainConfig(seed=seed, **CANDIDATES[name])


def tune(found: list[Collection], log_line=print) -> dict:
    """{candidate: {collection: tuning-split result}}."""
    table: dict = {}
    for cand in CANDIDATES:
        for c in found:
            t0 = time.perf_counter()
            r = tuning_split(c.log, cfg=_config(cand, 0))
            r["ratio"] = r["log_loss"] / r["fsrs6_log_loss"]
            r["seconds"] = round(time.perf_counter() - t0, 1)
            table.setdefault(cand, {})[c.name] = r
            log_line(f"tuning {cand} {c.name}: log loss {r['log_loss']:.4f} vs FSRS-6 {r['fsrs6_log_loss']:.4f} "
                     f"({r['ratio'] - 1:+.2%}, {r['seconds']:.0f} s)")
    return table


def choose(tuning: dict, names: list[str]) -> dict[str, str]:
    """Each collection's setting: the candidate with the lowest mean ratio over the other collections."""
    def score(cand: str, left_out: str) -> float:
        return float(np.mean([tuning[cand][n]["ratio"] for n in names if n != left_out]))
    return {n: min(tuning, key=lambda cand: score(cand, n)) for n in names}


def evaluate(c: Collection, setting: str, seeds: list[int], log_line=print) -> dict:
    runs = []
    for seed in seeds:
        tcfg = _config(setting, seed)
        t0 = time.perf_counter()
        metrics, _, _, folds = cross_validate(c.log, model_config(tcfg, c.log), tcfg, progress=False, final=False)
        metrics["seconds"] = round(time.perf_counter() - t0, 1)
        metrics["seed"] = seed
        runs.append(metrics)
        log_line(f"{c.name} seed {seed}: log loss {metrics['log_loss']:.4f} rmse {metrics['rmse_bins']:.4f} "
                 f"({metrics['seconds']:.0f} s)")
    return {"setting": setting, "source": c.source, "n_reviews": len(c.log), "runs": runs,
            "baselines": evaluate_baselines(c.log)}


def _mean(runs: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in runs]))


def table(results: dict) -> str:
    lines = ["| collection | reviews (scored) | setting | log loss (3 seeds) | FSRS-6 | vs FSRS-6 | RMSE(bins) "
             "| FSRS-6 | AUC | FSRS-6 | duration MAE s | median |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    rel, rmse, rmse_f = [], [], []
    for name, r in results.items():
        runs, f = r["runs"], r["baselines"]["fsrs6"]
        ll = [x["log_loss"] for x in runs]
        rel.append(np.mean(ll) / f["log_loss"] - 1)
        rmse.append(_mean(runs, "rmse_bins"))
        rmse_f.append(f["rmse_bins"])
        lines.append(
            f"| {name} | {r['n_reviews']:,} ({f['n_scored']:,}) | {r['setting']} | {np.mean(ll):.4f} "
            f"({min(ll):.4f}-{max(ll):.4f}) | {f['log_loss']:.4f} | {rel[-1]:+.1%} | {rmse[-1]:.4f} | "
            f"{f['rmse_bins']:.4f} | {_mean(runs, 'auc'):.3f} | {f['auc']:.3f} | "
            f"{_mean(runs, 'duration_mae_s'):.1f} | {r['baselines']['median_duration']['duration_mae_s']:.1f} |")
    lines.append(f"| mean | | | | | {np.mean(rel):+.1%} | {np.mean(rmse):.4f} | {np.mean(rmse_f):.4f} | | | | |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", default="../shared/data/srs", help="the srs data folder (default %(default)s)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--only", nargs="+", help="evaluate only these collections (tuning still uses all)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    found = collections(Path(args.data), out)
    if len(found) < 2:
        raise SystemExit(f"srs_collections: {args.data} holds {len(found)} collection(s); leaving one out needs two")

    def log_line(text: str) -> None:
        print(text, flush=True)

    tuning_file = out / "tuning.json"
    if tuning_file.exists():  # a re-run evaluates again with the same tuning
        tuning = json.loads(tuning_file.read_text())
    else:
        tuning = tune(found, log_line)
        tuning_file.write_text(json.dumps(tuning, indent=1))
    chosen = choose(tuning, [c.name for c in found])
    results = {c.name: evaluate(c, chosen[c.name], args.seeds, log_line)  # smallest first
               for c in sorted(found, key=lambda c: len(c.log)) if not args.only or c.name in args.only}
    (out / "results.json").write_text(json.dumps({"chosen": chosen, "results": results}, indent=1))
    (out / "table.md").write_text(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
