"""Rolling out a model, end to end (issue 35): version 1 serving; version 2 as a 100% shadow, then a 20% canary,
then promoted; live quality of both versions at each stage; no learner loses an event. Also the cost of a shadow:
the p50 latency and throughput of events through one connection with a 100% shadow against none.

Runs the service in this process (uvicorn on a loopback port, NEXTSTEP_NEW_VERSIONS=manual) over a real redis-server,
on the bundled deep_gpcm demo artifact as version 1 and a copy whose initial state is tilted as version 2 (so the
versions' predictions differ). Each stage sends every learner --events events (one per request, with a prediction
asked, as an app does), then prints GET /v1/models/deep_gpcm/quality.

With --model time_aware, the same for flashcard users, on the bundled time_aware demo: each request records one
review and predicts another card; version 2 is the demo with its drift gain raised (one window layout: the shadow
only scores), or with --window N reading windows of N reviews (another layout: the shadow keeps its own state of each
user, whose bytes in Redis are printed after the shadow stage); no user loses a review.

    python bench/rollout_walkthrough.py [--model time_aware [--window 16]] [--learners 200] [--events 10]
                                        [--json OUT]

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
SRS_DEMO = ROOT / "nextstep" / "demo_artifacts" / "time_aware" / "demo"
T0 = 1_767_225_600.0  # the flashcard users' first review (2026-01-01 UTC)


def add_flashcards(root: Path, version: str, year: int, nudge: float, window: int | None) -> None:
    """time_aware/<version>: the demo; `nudge` added to the predict graphs' drift gain, `window` its window size."""
    import onnx
    from onnx import numpy_helper

    out = root / "time_aware" / version
    shutil.copytree(SRS_DEMO, out)
    manifest = json.loads((out / "manifest.json").read_text())
    if window:
        manifest["window"] = {**manifest["window"], "size": window}
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                   "created": f"{year}-01-01T00:00:00Z"}))
    for name in ("predict", "predict_memory") if nudge else ():
        graph = onnx.load(out / f"{name}.onnx")
        (gain,) = [t for t in graph.graph.initializer if t.name == "model.drift_gain"]
        # the drift's own product only (the exporter shares the gain's 4.0 with FSRS-6's Easy rating in `predict`)
        made = {o: node.op_type for node in graph.graph.node for o in node.output}
        (mul,) = [node for node in graph.graph.node if node.op_type == "Mul" and gain.name in node.input
                  and any(made.get(i) == "Div" for i in node.input)]
        graph.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(gain) + np.float32(nudge),
                                                               "nudged_drift_gain"))
        mul.input[list(mul.input).index(gain.name)] = "nudged_drift_gain"
        onnx.save(graph, out / f"{name}.onnx")


def add_version(root: Path, version: str, year: int, nudge: float, model: str = "deep_gpcm",
                window: int | None = None) -> None:
    if model == "time_aware":
        return add_flashcards(root, version, year, nudge, window)
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
    model, srs = args.model, args.model == "time_aware"
    add_version(artifacts, "1", 2026, 0.0, model)
    questions = [] if srs else json.loads((DEMO / "vocab_questions.json").read_text())["ids"]
    rng = np.random.default_rng(0)
    learners = [f"{'user' if srs else 'learner'}-{i}" for i in range(args.learners)]
    ability = dict(zip(learners, rng.normal(size=len(learners)), strict=True))
    sent = dict.fromkeys(learners, 0)
    clock = dict.fromkeys(learners, T0)  # each flashcard user's last review time
    out: dict = {"machine": machine, "model": model, "window": args.window, "stages": {}}
    settings = Settings(artifacts_dir=artifacts, redis_url=f"redis://127.0.0.1:{port}/0", new_versions="manual",
                        reload_refresh_seconds=0.5)
    with serving(settings) as url, httpx.Client(base_url=url, timeout=30) as http:

        def request(learner: str) -> tuple[str, dict]:
            """One learner's next request: a question answered (the response drawn from their ability) and a
            prediction asked; or a flashcard user's review of one of 15 cards, a day or so after their last (a lapse
            more likely for a weaker user), and a prediction of another card."""
            if srs:
                clock[learner] += float(rng.exponential(86400.0))
                card = int(rng.integers(15))
                rating = 1 if rng.random() < 0.15 + 0.1 * np.tanh(-ability[learner]) else 3
                return f"/v1/srs/{model}/reviews", {
                    "user_id": learner, "reviews": [{"card_id": f"c{card}", "time": clock[learner], "rating": rating}],
                    "predict": {"card_id": f"c{(card + 1) % 15}"}}
            q = str(questions[rng.integers(len(questions))])
            response = int(np.clip(np.round(ability[learner] + 1.5 + rng.normal()), 0, 3))
            return "/v1/kt/deep_gpcm/events", {"student_id": learner, "events": [
                {"question_id": q, "response": response}], "predict_question_ids": [q]}

        def events(stage: str) -> dict:
            """Each learner sends --events requests (`request`); the latency of each."""
            took, answered = [], {}
            started = time.perf_counter()
            for _ in range(args.events):
                for learner in learners:
                    path, body = request(learner)
                    t0 = time.perf_counter()
                    reply = http.post(path, json=body)
                    took.append(time.perf_counter() - t0)
                    if reply.status_code != 200:
                        raise BenchError(f"{stage}: {reply.status_code} {reply.text[:300]}")
                    sent[learner] += 1
                    version = reply.json()["version"]
                    answered[version] = answered.get(version, 0) + 1
            seconds = time.perf_counter() - started
            return {"requests": len(took), "answered_by": answered, "p50_ms": statistics.median(took) * 1000,
                    "requests_per_second": len(took) / seconds}

        def shadow_turns() -> dict[str, int]:
            """nextstep_shadow_total of the model, by outcome."""
            head = f'nextstep_shadow_total{{model="{model}",outcome="'
            return {line[len(head):].split('"')[0]: int(float(line.split()[-1]))
                    for line in http.get("/metrics").text.splitlines() if line.startswith(head)}

        def stage(name: str) -> None:
            turns = shadow_turns()
            load = events(name)
            started, seen = time.perf_counter(), None
            while time.perf_counter() - started < 300:  # the shadow's queue drains: its counts stop moving
                time.sleep(1.0)
                now = shadow_turns()
                if now == seen:
                    break
                seen = now
            load["drained_after_s"] = time.perf_counter() - started - 1.0  # (about: the last second moved nothing)
            load["shadow_turns"] = {k: v - turns.get(k, 0) for k, v in seen.items() if v - turns.get(k, 0)}
            reply = http.get(f"/v1/models/{model}/quality", params={"window": 3600})
            if reply.status_code != 200:
                raise BenchError(f"{name}: quality {reply.status_code} {reply.text[:300]}")
            quality = reply.json()["versions"]
            out["stages"][name] = {**load, "quality": quality}
            print(f"\n{name}: answered by {load['answered_by']}; p50 {load['p50_ms']:.2f} ms, "
                  f"{load['requests_per_second']:.0f} requests/s" +
                  (f"; shadow turns {load['shadow_turns']}, the last {load['drained_after_s']:.0f} s after the "
                   "last answer" if load["shadow_turns"] else ""))
            for q in quality:
                if q["scored"]:
                    print(f"  version {q['version']} ({q['role']}): scored {q['scored']}, log loss "
                          f"{q['log_loss']:.4f}, Brier {q['brier']:.4f}, AUC {q['auc']:.4f}")

        stage("1. version 1 serving")
        if srs:
            add_version(artifacts, "2", 2027, 0.0 if args.window else 1.0, model, args.window)
        else:
            add_version(artifacts, "2", 2027, 5.0)
        if http.post("/v1/models/reload").json()["serving"][model] != "1":
            raise BenchError("version 2 served before a rollout named it")
        stage("2. version 1 serving, no rollout (version 2 loaded)")
        http.put(f"/v1/models/{model}/rollout", json={"candidate": "2", "mode": "shadow", "fraction": 1.0})
        stage("3. version 2 as a 100% shadow")
        if srs:
            out["redis_bytes_per_user"] = layout_bytes(port, http, learners)
        http.put(f"/v1/models/{model}/rollout", json={"candidate": "2", "mode": "canary", "fraction": 0.2})
        stage("4. version 2 as a 20% canary")
        http.post(f"/v1/models/{model}/rollout/promote")
        stage("5. version 2 promoted")
        totals = {learner: http.get(f"/v1/srs/{model}/users/{learner}").json()["reviews_total"] if srs else
                  http.get(f"/v1/kt/deep_gpcm/students/{learner}").json()["events_total"] for learner in learners}
        lost = {learner: (sent[learner], totals[learner]) for learner in learners if totals[learner] != sent[learner]}
        out["lost_history"] = lost
        print(f"\nevery {'user' if srs else 'learner'}'s total equals what they sent: {not lost}")
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


def layout_bytes(port: int, http, users: list[str]) -> dict:
    """MEMORY USAGE of the flashcard users' keys under each version's layout, per user, after the shadow stage (its
    queue drained: the shadow's turns all done)."""
    import redis

    from nextstep.service.srs.stored import schema_hash

    models = [m for m in http.get("/v1/models").json()["models"] if m["name"] == "time_aware"]
    client = redis.Redis(host="127.0.0.1", port=port)
    out = {}
    for m in sorted(models, key=lambda m: m["version"]):
        schema = schema_hash("time_aware", m["window"]["size"], m["window"]["card_size"])
        keys = list(client.scan_iter(f"nextstep:{{srs:time_aware:{schema}:*", count=1000))  # (every key of a user)
        total = sum(client.memory_usage(k, samples=0) or 0 for k in keys)
        held = len({k.split(b"}")[0] for k in keys})  # (a user's keys share their hash tag)
        out[m["version"]] = {"window": m["window"], "users": held, "keys": len(keys),
                             "bytes_per_user": total / len(users)}
    shared = len({row["window"]["size"] for row in out.values()}) == 1
    for version, row in out.items():
        print(f"  layout of version {version} (window {row['window']['size']}): {row['users']} users, "
              f"{row['bytes_per_user']:.0f} B per user" + (" (one layout: shared)" if shared else ""))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("deep_gpcm", "time_aware"), default="deep_gpcm")
    parser.add_argument("--window", type=int, default=0, help="time_aware: version 2's window size (default: "
                                                               "version 1's, with its drift gain raised)")
    parser.add_argument("--learners", type=int, default=200)
    parser.add_argument("--events", type=int, default=10, help="events per learner per stage (default 10)")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "nextstep-rollout-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
