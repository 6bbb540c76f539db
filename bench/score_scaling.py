"""`nextstep score` throughput: the single-process engine next to Ray Data (`--engine ray`) with 1..N workers, in
one run, on one generated input (students of random histories over the model's questions, in JSONL or Parquet
parts).

Reported per configuration, medians over --repeats runs: wall seconds, students/s, events/s, and events/s per core
(the single-process engine uses one core; Ray, one core per scoring worker: its driver and its reading/writing
task are not counted). Ray's costs outside the scoring are shown apart: starting Ray (`ray.init`, once) and a
run's fixed cost (the median wall time of scoring one student: actor pool start, each actor opening the artifact,
planning, writing), which every run pays again. Every Ray output is compared with the single-process output
(the same lines, byte for byte, or the same Parquet values).

    python bench/score_scaling.py [--students 4000] [--events 20,80] [--parts 8] [--format jsonl|parquet]
                                  [--workers 1,2] [--repeats 3] [--batch-size 64]
                                  [--artifacts nextstep/demo_artifacts] [--model deep_gpcm] [--json OUT]
"""

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from nextstep import scoring  # noqa: E402
from nextstep.cli import main as cli  # noqa: E402


def write_input(directory: Path, model, n: int, events: tuple[int, int], parts: int, fmt: str, seed: int) -> int:
    """`n` students in `parts` files; returns the number of events."""
    rng = random.Random(seed)
    records, total = [], 0
    for s in range(n):
        length = rng.randint(*events)
        total += length
        records.append({"student_id": f"s{s}", "events": [{"question_id": rng.choice(model.ids),
                                                           "response": rng.randrange(model.extra.n_cats)}
                                                          for _ in range(length)]})
    directory.mkdir(parents=True)
    for p in range(parts):
        chunk = records[p::parts]
        if fmt == "parquet":
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.Table.from_pylist(chunk), directory / f"part-{p:03d}.parquet")
        else:
            (directory / f"part-{p:03d}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in chunk))
    return total


def rows_of(path: Path, fmt: str) -> list:
    """The scored students at `path` (a file or a directory of parts), in a comparable, sorted form."""
    files = sorted(path.glob(f"*.{fmt}")) if path.is_dir() else [path]
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return sorted(json.dumps(r) for f in files for r in pq.read_table(f).to_pylist())
    return sorted(line for f in files for line in f.read_text().splitlines())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--students", type=int, default=4000)
    parser.add_argument("--events", default="20,80", help="events per student: uniform in MIN,MAX")
    parser.add_argument("--parts", type=int, default=8, help="input files")
    parser.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl", help="of the input and output")
    parser.add_argument("--workers", default="1,2", help="Ray worker counts to measure")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--artifacts", default=str(ROOT / "nextstep" / "demo_artifacts"))
    parser.add_argument("--model", default="deep_gpcm")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    lo, hi = (int(x) for x in args.events.split(","))
    model, _ = scoring.resolve(args.artifacts, args.model)
    work = Path(tempfile.mkdtemp(prefix="score-scaling-"))
    try:
        inputs = work / "in"
        n_events = write_input(inputs, model, args.students, (lo, hi), args.parts, args.format, args.seed)
        one = work / "one"
        write_input(one, model, 1, (lo, hi), 1, args.format, args.seed)
        print(f"input: {args.students} students, {n_events} events in {args.parts} {args.format} parts; model "
              f"{model.name}/{model.version}; {os.cpu_count()} CPUs here", flush=True)
        common = ["--model", args.model, "--artifacts", args.artifacts, "--quiet", "--output-format", args.format]
        results = []

        def measure(label: str, cores: int, argv: list[str], output: Path) -> list[float]:
            walls = []
            for _ in range(args.repeats):
                started = time.perf_counter()
                assert cli(["score", str(inputs), *common, *argv, "--output", str(output)]) == 0
                walls.append(time.perf_counter() - started)
            wall = statistics.median(walls)
            row = {"engine": label, "cores": cores, "wall_s": wall, "walls_s": walls,
                   "students_per_s": args.students / wall, "events_per_s": n_events / wall,
                   "events_per_s_per_core": n_events / wall / cores}
            results.append(row)
            print(f"{label:18s} cores {cores}  median {wall:7.2f} s  {row['students_per_s']:8.0f} students/s  "
                  f"{row['events_per_s']:9.0f} events/s  {row['events_per_s_per_core']:9.0f} events/s/core  "
                  f"(runs: {', '.join(f'{w:.2f}' for w in walls)})", flush=True)
            return walls

        single_out = work / f"single.{args.format}"
        measure("single-process", 1, [], single_out)
        reference = rows_of(single_out, args.format)

        import ray

        from nextstep import ray_scoring

        started = time.perf_counter()
        ray_scoring.start(max(workers))
        startup = time.perf_counter() - started
        print(f"ray start (ray.init, {int(ray.cluster_resources()['CPU'])} logical CPUs): {startup:.2f} s", flush=True)
        fixed = {}
        for w in workers:
            out = work / f"ray{w}"
            walls = []
            for _ in range(args.repeats):  # one student: what a run costs besides scoring
                started = time.perf_counter()
                assert cli(["score", str(one), *common, "--engine", "ray", "--workers", str(w),
                            "--output", str(work / "ray-one")]) == 0
                walls.append(time.perf_counter() - started)
            fixed[w] = statistics.median(walls)
            print(f"ray fixed cost per run, {w} workers (1 student): median {fixed[w]:.2f} s", flush=True)
            measure(f"ray ({w} workers)", w, ["--engine", "ray", "--workers", str(w),
                                              "--batch-size", str(args.batch_size)], out)
            same = rows_of(out, args.format) == reference
            results[-1].update(fixed_cost_s=fixed[w], same_as_single=same)
            print(f"  output {'identical to' if same else 'DIFFERS FROM'} the single-process output", flush=True)
        summary = {"students": args.students, "events": n_events, "parts": args.parts, "format": args.format,
                   "model": f"{model.name}/{model.version}", "cpus": os.cpu_count(), "repeats": args.repeats,
                   "batch_size": args.batch_size, "ray_startup_s": startup, "results": results}
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=2))
        ray.shutdown()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
