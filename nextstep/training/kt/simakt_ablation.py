"""SimAKT ablation: train every (similarity configuration, seed) on one data set, tabulate test metrics.

    python -m nextstep.training.kt.simakt_ablation --data DIR --out OUT \\
        --configs configs/simakt/none.json configs/simakt/cluster.json configs/simakt/knn.json \\
                  configs/simakt/dual.yaml --seeds 0 1 2 [--device cuda --jobs 4]

Each run is `train_simakt` without the export (the same training, banks and test evaluation as
`nextstep train simakt`); OUT/<config>_seed<k>.json holds its metrics and training time, OUT/table.md the
table: mean and (min-max) over seeds of test AUC, accuracy and NLL, and the mean training time.
Each run's log lines (epochs, the refit) are printed as they come, prefixed by configuration and seed.
"""

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path


def _one(data: str, config: str, seed: int, out: str, device: str, overrides: dict) -> dict:
    import torch

    from .simakt_run import SimAKTTrainConfig, load_similarity, train_simakt

    torch.set_num_threads(overrides.pop("threads", torch.get_num_threads()))
    name = Path(config.partition("#")[0]).stem
    path = Path(out) / f"{name}_seed{seed}.json"
    if path.exists():
        return json.loads(path.read_text())
    cfg = SimAKTTrainConfig(seed=seed, device=device, **overrides)
    lines = []

    def log(line: str) -> None:  # kept for the JSON and printed as it comes: a run takes up to 30 minutes
        lines.append(line)
        print(f"{name} seed {seed}: {line}", flush=True)
    result = train_simakt(data, None, cfg=cfg, similarity=load_similarity(config), export=False, log=log)
    row = {"config": name, "seed": seed, "device": device, "test": result["metrics"]["test"],
           "valid": result["metrics"]["valid"], "seconds": result["training"]["seconds"],
           "epochs": result["training"]["epochs_run"], "best_epoch": result["training"]["best_epoch"], "log": lines}
    path.write_text(json.dumps(row, indent=2))
    return row


def table(rows: list[dict]) -> str:
    out = ["| configuration | seeds | test AUC | accuracy | NLL | training time (s) |", "|---|---|---|---|---|---|"]
    for name in dict.fromkeys(r["config"] for r in rows):
        rs = [r for r in rows if r["config"] == name]

        def cell(key, rs=rs):
            v = [r["test"][key] for r in rs]
            return f"{statistics.mean(v):.4f} ({min(v):.4f}-{max(v):.4f})"
        secs = statistics.mean(r["seconds"] for r in rs)
        out.append(f"| {name} | {len(rs)} | {cell('auc')} | {cell('accuracy')} | {cell('nll')} | {secs:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--configs", nargs="+", required=True)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--device", default="cpu")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (processes)")
    p.add_argument("--threads", type=int, help="torch threads per run")
    p.add_argument("--train-config", help="JSON of SimAKTTrainConfig fields applied to every run")
    args = p.parse_args(argv)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    overrides = json.loads(Path(args.train_config).read_text()) if args.train_config else {}
    if args.threads:
        overrides["threads"] = args.threads
    jobs = [(args.data, c, s, args.out, args.device, dict(overrides)) for c in args.configs for s in args.seeds]
    started = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing

        with ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            rows = list(pool.map(_one, *zip(*jobs, strict=True)))
    else:
        rows = [_one(*j) for j in jobs]
    text = table(rows)
    (Path(args.out) / "table.md").write_text(text + "\n")
    print(text)
    print(f"{len(rows)} runs in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
