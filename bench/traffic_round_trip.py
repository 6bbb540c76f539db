"""The traffic as training data, end to end: a real data set replayed through the HTTP API, exported from the event
logs, and trained on, against training on the original files (issue 37, part 4).

1. The data set's train and test files are written in the long format (data.write_long_csv: learner i's t-th answer
   at 1.6e9 + 86400 t + i seconds, question ids as text "q12"), and model A is trained on them (`nextstep train`).
2. A real redis-server and the service (uvicorn in this process, model A as the served version) take every training
   learner's answers through POST /v1/kt/{model}/events, 1,000 at a time, in order, with their times.
3. `nextstep events export --test-fraction 0` writes the logs as a long CSV; the original test file is put next to it.
4. Model B is trained on the export with the same command, seed and config. The two runs' metrics are printed side by
   side, with whether their weights and graphs are the same bytes.

    python bench/traffic_round_trip.py --data ../shared/data/kt/dkvmn_assist2009_updated [--learners N]
        [--model dkt] [--config configs/dkt.json] [--epochs 3] [--seed 0] [--json OUT]

Requires redis-server on PATH and torch (training).
"""

import argparse
import csv
import gzip
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from service_load import BenchError, machine_info, run_in_tempdir, start_redis

ROOT = Path(__file__).resolve().parent.parent
CHUNK = 1_000  # events per request (the service's NEXTSTEP_MAX_EVENTS default)


def nextstep(*argv: str, env: dict | None = None) -> str:
    """A `nextstep` command in a child process (this interpreter); its stdout, or BenchError with its stderr."""
    done = subprocess.run([sys.executable, "-m", "nextstep.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, **(env or {})})
    if done.returncode:
        raise BenchError(f"nextstep {' '.join(argv[:2])} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def long_data(data: Path, out: Path, learners: int | None) -> None:
    """The data set in the long format (its first `learners` training learners when given, every test learner)."""
    from nextstep.training.kt.data import KTDataset, load_dataset, write_long_csv

    train, test = load_dataset(data)
    if learners:
        train = KTDataset(train.sequences[:learners], train.n_cats, train.path, train.fmt)
    out.mkdir(parents=True)
    name = data.name
    write_long_csv(train, out / f"{name}_train.csv.gz", question_prefix="q")
    write_long_csv(test, out / f"{name}_test.csv.gz", question_prefix="q", learner_prefix="t")
    (out / "metadata.json").write_text(json.dumps({"n_cats": train.n_cats}) + "\n")


def train(model: str, data: Path, out: Path, args) -> dict:
    argv = ["train", model, "--data", str(data), "--out", str(out), "--seed", str(args.seed), "--quiet"]
    if args.config:
        argv += ["--config", str(args.config)]
    if args.epochs:
        argv += ["--epochs", str(args.epochs)]
    started = time.monotonic()
    nextstep(*argv)
    manifest = json.loads((out / "manifest.json").read_text())
    return {"metrics": manifest["metrics"], "seconds": round(time.monotonic() - started, 1)}


def learners_of(path: Path) -> dict[str, list[dict]]:
    """Each learner's rows of a long CSV, in file order, as events with their times."""
    events: dict[str, list[dict]] = {}
    with gzip.open(path, "rt", newline="") as f:
        for row in csv.DictReader(f):
            events.setdefault(row["learner_id"], []).append({
                "question_id": row["question_id"], "response": int(row["correct"]),
                "timestamp": float(row["timestamp"])})
    return events


def replay(url: str, model: str, learners: dict[str, list[dict]]) -> dict:
    import httpx

    started, requests, sent = time.monotonic(), 0, 0
    with httpx.Client(base_url=url, timeout=120) as http:
        for learner, events in learners.items():
            for start in range(0, len(events), CHUNK):
                reply = http.post(f"/v1/kt/{model}/events",
                                  json={"student_id": learner, "events": events[start:start + CHUNK]})
                if reply.status_code != 200:
                    raise BenchError(f"replay of {learner}: {reply.status_code} {reply.text[:500]}")
                requests += 1
                sent += len(events[start:start + CHUNK])
    seconds = time.monotonic() - started
    return {"learners": len(learners), "events": sent, "requests": requests, "seconds": round(seconds, 1),
            "events_per_second": round(sent / seconds)}


def digests(artifact: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()[:16]
            for p in sorted(artifact.iterdir()) if p.suffix in (".pt", ".onnx")}


def run(args, work: Path, procs) -> int:
    sys.path.insert(0, str(ROOT / "tests" / "service"))
    from nextstep.service.settings import Settings

    machine = machine_info()
    print(f"machine: {machine['cpu']}, load average {machine['load_avg_at_start']} at start", file=sys.stderr)
    original = work / "original"
    long_data(Path(args.data), original, args.learners)
    print("training A on the original long CSV ...", file=sys.stderr)
    artifacts = work / "artifacts"
    a = train(args.model, original, artifacts / args.model / "1", args)

    port, _ = start_redis(procs, work)
    redis_url = f"redis://127.0.0.1:{port}/0"
    from conftest import serving  # tests/service/conftest.py: the app under uvicorn in a thread

    learners = learners_of(next(original.glob("*_train.csv.gz")))
    print(f"replaying {len(learners)} learners through HTTP ...", file=sys.stderr)
    with serving(Settings(artifacts_dir=artifacts, redis_url=redis_url)) as url:
        replayed = replay(url, args.model, learners)
    traffic = work / "traffic"
    env = {"NEXTSTEP_REDIS_URL": redis_url, "NEXTSTEP_ARTIFACTS_DIR": str(artifacts)}
    exported = json.loads(nextstep("events", "export", "--model", args.model, "--out", str(traffic),
                                   "--test-fraction", "0", "--quiet", env=env))
    shutil.copy(next(original.glob("*_test.csv.gz")), traffic / f"{args.model}_test.csv.gz")
    print("training B on the export ...", file=sys.stderr)
    b = train(args.model, traffic, work / "b", args)
    same = digests(artifacts / args.model / "1") == digests(work / "b")
    result = {"machine": machine, "data": args.data, "model": args.model, "seed": args.seed, "epochs": args.epochs,
              "replay": replayed, "export": exported, "original": a, "exported": b,
              "same_metrics": a["metrics"] == b["metrics"], "same_weights": same}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["same_metrics"] else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a knowledge-tracing data set directory")
    parser.add_argument("--learners", type=int, help="replay only the first N training learners (default: all)")
    parser.add_argument("--model", default="dkt", help="the family trained (default dkt)")
    parser.add_argument("--config", default=str(ROOT / "configs" / "dkt.json"), help="its config (default dkt's)")
    parser.add_argument("--epochs", type=int, help="epochs (default: the config's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "nextstep-round-trip-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
