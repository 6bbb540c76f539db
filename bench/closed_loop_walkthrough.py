"""The closed loop, end to end (issue 60; docs/guide/upgrading.md, "Close the loop"): a model serves real learners,
`nextstep retrain` trains its next version on the logged traffic and starts it as a gated shadow, and the service
promotes or aborts it by itself on the evidence, which this prints as it narrows.

1. version 1 of deep_gpcm: trained with `nextstep train` on --seed-learners training learners of --data (a small
   start, as a new deployment has);
2. the service (`nextstep serve`, NEXTSTEP_NEW_VERSIONS=manual) on a real redis-server; --traffic learners of the
   data set's training file (not those of step 1) send their events through the Python client, one request per
   --chunk events, each with a prediction asked;
3. `nextstep retrain --model deep_gpcm --url ...`: the traffic exported, version 2 trained with version 1's settings,
   the service reloaded, version 2 a gated shadow of every learner;
4. the held-out learners (the data set's test file) send their events the same way until the gate decides; the
   gate's evidence is printed after each --report learners; then the decision, and which version serves.

    python bench/closed_loop_walkthrough.py --data ../shared/data/kt/dkvmn_assist2009_updated
                                            [--seed-learners 150] [--traffic 1500] [--epochs 3] [--chunk 10]

Requires redis-server on PATH; trains twice (a few minutes on 2 cores).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from service_load import BenchError, free_port, run_in_tempdir, start_redis, tail

from nextstep.client import Client, Retry

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "deep_gpcm_assistments09.json"


def three_line(path: Path) -> list[list[str]]:
    lines = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return [lines[i:i + 3] for i in range(0, len(lines) - len(lines) % 3, 3)]


def events_of(record: list[str]) -> list[dict]:
    return [{"question_id": q, "response": int(r)} for q, r in zip(record[1].split(","), record[2].split(","),
                                                                    strict=True) if q]


def send(client: Client, learners: list[tuple[str, list[dict]]], chunk: int, every=None) -> int:
    sent = 0
    for n, (learner, events) in enumerate(learners, 1):
        for start in range(0, len(events), chunk):
            part = events[start:start + chunk]
            client.kt.events("deep_gpcm", learner, part, predict_question_ids=[part[-1]["question_id"]])
            sent += len(part)
        if every is not None and every(n):
            break
    return sent


def run(args, work: Path, procs) -> int:
    data = Path(args.data)
    (train_file,) = [p for p in data.iterdir() if "train" in p.name]
    (test_file,) = [p for p in data.iterdir() if "test" in p.name]
    records = three_line(train_file)
    seed, traffic = records[:args.seed_learners], records[args.seed_learners:args.seed_learners + args.traffic]
    start = work / "start"
    start.mkdir()
    (start / train_file.name).write_text("".join("\n".join(r) + "\n" for r in seed))
    (start / test_file.name).write_bytes(test_file.read_bytes())
    config = work / "config.json"
    config.write_text(json.dumps({**json.loads(CONFIG.read_text()), "epochs": args.epochs}))
    artifacts = work / "artifacts"
    print(f"1. version 1: deep_gpcm trained on {len(seed)} learners", flush=True)
    subprocess.run([sys.executable, "-m", "nextstep.cli", "train", "deep_gpcm", "--data", str(start), "--out",
                    str(artifacts / "deep_gpcm" / "1"), "--config", str(config), "--quiet"], check=True)
    redis_port, _ = start_redis(procs, work)
    port = free_port()
    env = {**os.environ, "NEXTSTEP_REDIS_URL": f"redis://127.0.0.1:{redis_port}/0",
           "NEXTSTEP_ARTIFACTS_DIR": str(artifacts), "NEXTSTEP_NEW_VERSIONS": "manual", "NEXTSTEP_API_KEYS": "",
           "NEXTSTEP_RELOAD_REFRESH_SECONDS": "0.5"}
    log = work / "service.log"
    procs.start("nextstep serve", [sys.executable, "-m", "nextstep.cli", "serve", "--host", "127.0.0.1", "--port",
                                   str(port)], log, env=env, cwd=work)
    url = f"http://127.0.0.1:{port}"
    with Client(url, retry=Retry(attempts=60, backoff=0.2, max_backoff=1.0), timeout=30) as client:
        deadline = time.monotonic() + 120
        while True:
            try:
                client.system.ready()
                break
            except Exception as exc:  # (not up yet)
                if time.monotonic() > deadline:
                    raise BenchError(f"the service did not get ready: {exc}\n{tail(log)}") from None
                time.sleep(0.5)
        learners = [(f"traffic-{i}", events_of(r)) for i, r in enumerate(traffic)]
        t0 = time.monotonic()
        n = send(client, learners, args.chunk)
        print(f"2. traffic: {len(learners)} learners, {n} events through version 1 in {time.monotonic() - t0:.0f} s",
              flush=True)
        print("3. nextstep retrain --model deep_gpcm --url ...", flush=True)
        done = subprocess.run([sys.executable, "-m", "nextstep.cli", "retrain", "--model", "deep_gpcm", "--url", url],
                              capture_output=True, text=True, env=env)
        print(done.stdout.rstrip(), flush=True)
        if done.returncode != 0:
            raise BenchError(f"retrain failed:\n{done.stderr[-3000:]}")
        held_out = [(f"held-out-{i}", events_of(r)) for i, r in enumerate(three_line(test_file))]
        print(f"4. held-out learners ({len(held_out)}) until the gate decides:", flush=True)

        def report(k: int) -> bool:
            if k % args.report:
                return False
            rollout = client.models.rollout("deep_gpcm")
            if rollout.gate is not None:
                g = rollout.gate
                interval = "none yet" if g.interval is None else f"[{g.interval[0]:+.4f}, {g.interval[1]:+.4f}]"
                print(f"   after {k:4d} learners: {g.events:6d} paired events, mean difference "
                      f"{(g.mean_difference or 0):+.4f} nats, interval {interval}: {g.decision}", flush=True)
            return rollout.candidate is None

        send(client, held_out, args.chunk, every=report)
        time.sleep(3)  # (a decision takes effect two refresh intervals after it is made)
        rollout = client.models.rollout("deep_gpcm")
        for d in rollout.decisions:
            print(f"   decision: {d.decision} version {d.candidate} over {d.serving} after {d.events} paired events, "
                  f"mean difference {d.mean_difference:+.4f}, interval [{d.interval[0]:+.4f}, {d.interval[1]:+.4f}]"
                  f"{' (applied)' if d.applied else ''}")
        print(f"   serving now: version {rollout.serving}; candidate: {rollout.candidate}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", required=True, help="a DKVMN three-line data set")
    parser.add_argument("--seed-learners", type=int, default=150)
    parser.add_argument("--traffic", type=int, default=1500)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--chunk", type=int, default=10, help="events per request")
    parser.add_argument("--report", type=int, default=50, help="print the gate's evidence after this many learners")
    args = parser.parse_args()
    return run_in_tempdir(run, args, "closed-loop-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
