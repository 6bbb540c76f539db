"""Rolling out a model, end to end (issue 35): version 1 serving; version 2 as a 100% shadow, then a 20% canary,
then promoted; live quality of both versions at each stage; no learner loses an event. Also the cost of a shadow:
the p50 latency and throughput of events through one connection with a 100% shadow against none.

Runs the service in this process (uvicorn on a loopback port, NEXTSTEP_NEW_VERSIONS=manual) over a real redis-server,
on the bundled deep_gpcm demo artifact as version 1 and a copy whose initial state is tilted as version 2 (so the
versions' predictions differ). Each stage sends every learner --events events (one per request, with a prediction
asked, as an app does), then prints GET /v1/models/deep_gpcm/quality.

    python bench/rollout_walkthrough.py [--learners 200] [--events 10] [--json OUT]

Requires redis-server on PATH.
"""

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from service_load import BenchError, machine_info, run_in_tempdir, start_redis

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "nextstep" / "demo_artifacts" / "deep_gpcm" / "demo"


def add_version(root: Path, version: str, year: int, nudge: float) -> None:
    out = root / "deep_gpcm" / version
    shutil.copytree(DEMO, out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                   "created": f"{year}-01-01T00:00:00Z"}))
    for spec in manifest["state"]:
        state = np.load(out / spec["file"])
        np.save(out / spec["file"], state + (nudge * np.linspace(-1, 1, state.size)).reshape(state.shape)
                .astype(state.dtype))


def run(args, work: Path, procs) -> int:
    import httpx

    sys.path.insert(0, str(ROOT / "tests" / "service"))
    from conftest import serving  # tests/service/conftest.py: the app under uvicorn in a thread

    from nextstep.service.settings import Settings

    machine = machine_info()
    print(f"machine: {machine['cpu']}, load average {machine['load_avg_at_start']} at start", file=sys.stderr)
    port, _ = start_redis(procs, work)
    artifacts = work / "artifacts"
    add_version(artifacts, "1", 2026, 0.0)
    questions = json.loads((DEMO / "vocab_questions.json").read_text())["ids"]
    rng = np.random.default_rng(0)
    learners = [f"learner-{i}" for i in range(args.learners)]
    ability = dict(zip(learners, rng.normal(size=len(learners)), strict=True))
    sent = dict.fromkeys(learners, 0)
    out: dict = {"machine": machine, "stages": {}}
    settings = Settings(artifacts_dir=artifacts, redis_url=f"redis://127.0.0.1:{port}/0", new_versions="manual",
                        reload_refresh_seconds=0.5)
    with serving(settings) as url, httpx.Client(base_url=url, timeout=30) as http:

        def events(stage: str) -> dict:
            """Each learner answers --events questions (responses drawn from their ability); the latency of each."""
            took, answered = [], {}
            started = time.perf_counter()
            for _ in range(args.events):
                for learner in learners:
                    q = str(questions[rng.integers(len(questions))])
                    response = int(np.clip(np.round(ability[learner] + 1.5 + rng.normal()), 0, 3))
                    t0 = time.perf_counter()
                    reply = http.post("/v1/kt/deep_gpcm/events", json={
                        "student_id": learner, "events": [{"question_id": q, "response": response}],
                        "predict_question_ids": [q]})
                    took.append(time.perf_counter() - t0)
                    if reply.status_code != 200:
                        raise BenchError(f"{stage}: {reply.status_code} {reply.text[:300]}")
                    sent[learner] += 1
                    version = reply.json()["version"]
                    answered[version] = answered.get(version, 0) + 1
            seconds = time.perf_counter() - started
            return {"requests": len(took), "answered_by": answered, "p50_ms": statistics.median(took) * 1000,
                    "requests_per_second": len(took) / seconds}

        def stage(name: str) -> None:
            load = events(name)
            time.sleep(1.5)  # (the shadow's queue drains; the replica flushes its scores)
            quality = http.get("/v1/models/deep_gpcm/quality", params={"window": 3600}).json()["versions"]
            out["stages"][name] = {**load, "quality": quality}
            print(f"\n{name}: answered by {load['answered_by']}; p50 {load['p50_ms']:.2f} ms, "
                  f"{load['requests_per_second']:.0f} requests/s")
            for q in quality:
                if q["scored"]:
                    print(f"  version {q['version']} ({q['role']}): scored {q['scored']}, log loss "
                          f"{q['log_loss']:.4f}, Brier {q['brier']:.4f}, AUC {q['auc']:.4f}")

        stage("1. version 1 serving")
        add_version(artifacts, "2", 2027, 5.0)
        if http.post("/v1/models/reload").json()["serving"]["deep_gpcm"] != "1":
            raise BenchError("version 2 served before a rollout named it")
        stage("2. version 1 serving, no rollout (version 2 loaded)")
        http.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "mode": "shadow", "fraction": 1.0})
        stage("3. version 2 as a 100% shadow")
        http.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "mode": "canary", "fraction": 0.2})
        stage("4. version 2 as a 20% canary")
        http.post("/v1/models/deep_gpcm/rollout/promote")
        stage("5. version 2 promoted")
        totals = {learner: http.get(f"/v1/kt/deep_gpcm/students/{learner}").json()["events_total"]
                  for learner in learners}
        lost = {learner: (sent[learner], totals[learner]) for learner in learners if totals[learner] != sent[learner]}
        out["lost_history"] = lost
        print(f"\nevery learner's events_total equals the events they sent: {not lost}")
        base, shadow = out["stages"]["2. version 1 serving, no rollout (version 2 loaded)"], \
            out["stages"]["3. version 2 as a 100% shadow"]
        out["shadow_cost"] = {"p50_ratio": shadow["p50_ms"] / base["p50_ms"],
                              "throughput_ratio": shadow["requests_per_second"] / base["requests_per_second"]}
        print(f"100% shadow against none (one connection): p50 {shadow['p50_ms']:.2f} against "
              f"{base['p50_ms']:.2f} ms (x{out['shadow_cost']['p50_ratio']:.2f}), throughput "
              f"x{out['shadow_cost']['throughput_ratio']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0 if not lost else 3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=200)
    parser.add_argument("--events", type=int, default=10, help="events per learner per stage (default 10)")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "nextstep-rollout-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
