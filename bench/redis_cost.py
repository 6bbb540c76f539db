"""What one request costs Redis and the service, and what one entity costs Redis's memory: the figures behind
docs/scaling.md.

    python bench/redis_cost.py [--artifacts ROOT] [--entities 100] [--json OUT]

1. The artifacts: `--artifacts ROOT` holding deep_gpcm/, gru4rec/ and time_aware/ (<name>/<version>/manifest.json);
   without it, the three are trained here at their families' DEFAULT sizes (state sizes are what matter, not
   accuracy: one or two epochs on the generated data the bundled demo models use; about two minutes).
2. A redis-server on a free loopback port (no persistence) and `nextstep serve` (one worker), as
   bench/service_load.py starts them.
3. Per task, one connection, requests one after another:
   * knowledge tracing: --entities learners x 200 events, one event per `events` request (no prediction), then
     one `predict` of one question per learner; then one more learner with 10,000 events (1,000 a request), the
     full replay window at the default NEXTSTEP_MAX_EVENT_IDS;
   * sessions: --entities x 10 sessions x 10 clicks, one click per `events` request with `recommend_k` 20;
   * flashcards: --entities users x 300 reviews over 60 cards (several days apart), one review per `reviews`
     request, then one `predict` per user.
   For the last quarter of the writes (entities at their final size) and for the reads: Redis commands per
   request (INFO commandstats, reset before the phase), bytes in and out of Redis per request (INFO stats),
   Redis CPU per request (INFO cpu) and the service's CPU per request (/proc), and the wall time per request.
4. Memory: Redis's used_memory after the task's writes over the number of entities, and MEMORY USAGE of one
   entity's keys.

Requires redis-server on PATH (and torch when it trains the artifacts). Figures depend on the machine; the
command and the machine are printed with them.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from machine import machine  # bench/machine.py
from service_load import BenchError, Processes, cpu_seconds, start_redis, start_service

T0 = 1_767_225_600.0  # 2026-01-01, unix seconds


def build_artifacts(root: Path, work: Path) -> None:
    """deep_gpcm, gru4rec and time_aware at their families' default sizes, on the demo's generated data."""
    import numpy as np

    from nextstep.training.families import FAMILIES
    from nextstep.training.kt.loop import TrainConfig
    from nextstep.training.kt.run import train_model
    from nextstep.training.kt.synthetic import write_gpcm_dataset
    from nextstep.training.next_item.gru4rec_loop import GRU4RecTrainConfig
    from nextstep.training.next_item.run import train_next_item
    from nextstep.training.next_item.sessions import subset, write_gru4rec_tsv, zipf_sessions
    from nextstep.training.srs.reviews import simulate_reviews, write_review_csv
    from nextstep.training.srs.time_aware_loop import TimeAwareTrainConfig
    from nextstep.training.srs.time_aware_run import train_time_aware

    data = {name: FAMILIES[name].demo.generated for name in ("deep_gpcm", "gru4rec", "time_aware")}  # the recipes'
    kt = work / "kt"
    write_gpcm_dataset(kt, **{**data["deep_gpcm"], "n_questions": 200})
    train_model("deep_gpcm", kt, root / "deep_gpcm" / "1", cfg=TrainConfig(epochs=1), progress=False, log=False)
    sessions = zipf_sessions(**{**data["gru4rec"], "n_items": 2000, "n_sessions": 2000})
    rec = work / "rec"
    rec.mkdir(parents=True)
    n_train = len(sessions) * 5 // 6
    write_gru4rec_tsv(subset(sessions, np.arange(n_train)), rec / "bench_train_full.txt")
    write_gru4rec_tsv(subset(sessions, np.arange(n_train, len(sessions))), rec / "bench_test.txt")
    train_next_item("gru4rec", rec, root / "gru4rec" / "1", cfg=GRU4RecTrainConfig(epochs=1), progress=False,
                    log=False)
    srs = work / "srs"
    srs.mkdir(parents=True)
    reviews = write_review_csv(simulate_reviews(**data["time_aware"]), srs / "reviews.csv")
    train_time_aware(reviews, root / "time_aware" / "1", cfg=TimeAwareTrainConfig(max_epochs=1, threads=1),
                     n_splits=2, baselines=False, progress=False)


class Meter:
    """Redis's and the service's counters around a phase of requests."""

    def __init__(self, redis_port: int, service_pid: int):
        import redis

        self.r = redis.Redis(host="127.0.0.1", port=redis_port, socket_timeout=5)
        self.pid = service_pid

    def start(self) -> None:
        self.r.config_resetstat()
        self.before = self._counters()

    def _counters(self) -> dict:
        stats, cpu = self.r.info("stats"), self.r.info("cpu")
        return {"in": stats["total_net_input_bytes"], "out": stats["total_net_output_bytes"],
                "redis_cpu": cpu["used_cpu_user"] + cpu["used_cpu_sys"],
                "service_cpu": (cpu_seconds(self.pid) or {"total": float("nan")})["total"],
                "wall": time.perf_counter()}

    def stop(self, requests: int) -> dict:
        after = self._counters()
        calls = {name.removeprefix("cmdstat_"): int(v["calls"])
                 for name, v in self.r.info("commandstats").items()}
        calls.pop("config|resetstat", None)
        calls.pop("info", None)  # (this meter's own)
        d = {k: after[k] - self.before[k] for k in after}
        return {"requests": requests,
                "commands_per_request": {k: round(v / requests, 3) for k, v in sorted(calls.items())},
                "round_trips_note": "a pipeline or a script is one round trip however many commands it holds",
                "bytes_to_redis": round(d["in"] / requests), "bytes_from_redis": round(d["out"] / requests),
                "redis_cpu_ms": round(1e3 * d["redis_cpu"] / requests, 4),
                "service_cpu_ms": round(1e3 * d["service_cpu"] / requests, 4),
                "wall_ms": round(1e3 * d["wall"] / requests, 4)}

    def memory(self, pattern: str, entities: int, baseline: int) -> dict:
        used = self.r.info("memory")["used_memory"]
        keys = sorted(self.r.scan_iter(match=pattern, count=1000))
        one = keys[0][:keys[0].index(b"}") + 1] if keys else b""  # an entity's keys share its {hash tag}
        own = [k for k in keys if k.startswith(one)] if one else []
        return {"used_memory_per_entity": round((used - baseline) / entities),
                "keys_per_entity": round(len(keys) / entities, 2),
                "memory_usage_one_entity": sum(self.r.memory_usage(k, samples=0) or 0 for k in own),
                "one_entity_keys": [k.decode() for k in own]}


def post(http: httpx.Client, path: str, body: dict) -> dict:
    r = http.post(path, json=body)
    if r.status_code != 200:
        raise BenchError(f"{path}: {r.status_code} {r.text[:300]}")
    return r.json()


def ids(http: httpx.Client, model: str) -> list[str]:
    return post_get(http, f"/v1/models/{model}/ids?limit=10000")["ids"]


def post_get(http: httpx.Client, path: str) -> dict:
    r = http.get(path)
    if r.status_code != 200:
        raise BenchError(f"{path}: {r.status_code} {r.text[:300]}")
    return r.json()


def metered_rounds(meter: Meter, rounds: int, one_round) -> dict:
    """Run `one_round(t)` for t = 0 .. rounds - 1 (each returns its request count) and meter the last quarter, by
    then every entity's state is at its full size."""
    measured_from, measured = rounds * 3 // 4, 0
    for t in range(rounds):
        if t == measured_from:
            meter.start()
        done = one_round(t)
        measured += done if t >= measured_from else 0
    return meter.stop(measured)


def kt(http, meter: Meter, n: int, events: int = 200, long_events: int = 10_000) -> dict:
    questions = ids(http, "deep_gpcm")
    baseline = meter.r.info("memory")["used_memory"]

    def one_round(t: int) -> int:
        for s in range(n):
            q = questions[(s * 7 + t * 13) % len(questions)]
            post(http, "/v1/kt/deep_gpcm/events", {"student_id": f"learner-{s}", "events": [
                {"question_id": q, "response": (s + t) % 4, "event_id": f"e-{s}-{t}"}]})
        return n

    writes = metered_rounds(meter, events, one_round)
    memory = meter.memory("nextstep:{kt:deep_gpcm:*", n, baseline)
    meter.start()
    for s in range(n):
        post(http, "/v1/kt/deep_gpcm/predict", {"student_id": f"learner-{s}", "question_ids": [questions[s % 7]]})
    read = meter.stop(n)
    # one learner at the full replay window (NEXTSTEP_MAX_EVENT_IDS, 10,000 ids by default): 1,000 events a request
    before = meter.r.info("memory")["used_memory"]
    for b in range(long_events // 1000):
        post(http, "/v1/kt/deep_gpcm/events", {"student_id": "long-learner", "events": [
            {"question_id": questions[(b * 1000 + i) % len(questions)], "response": i % 4, "event_id": f"l-{b}-{i}"}
            for i in range(1000)]})
    long = meter.memory("nextstep:{kt:deep_gpcm:long-learner}*", 1, before)
    return {"entity": f"a learner after {events} events", "write": writes, "read": read, "memory": memory,
            f"memory_after_{long_events}_events": long}


def sessions(http, meter: Meter, n: int, clicks: int = 10) -> dict:
    items = ids(http, "gru4rec")
    baseline = meter.r.info("memory")["used_memory"]
    sessions = [f"visit-{s}" for s in range(n * 10)]

    def one_round(t: int) -> int:
        for i, s in enumerate(sessions):
            post(http, "/v1/sessions/gru4rec/events", {"session_id": s, "recommend_k": 20, "events": [
                {"item_id": items[(i * 31 + t * 7) % len(items)], "event_id": f"c-{t}"}]})
        return len(sessions)

    writes = metered_rounds(meter, clicks, one_round)
    memory = meter.memory("nextstep:{sess:gru4rec:*", len(sessions), baseline)
    return {"entity": f"a session after {clicks} clicks", "write": writes, "memory": memory}


def flashcards(http, meter: Meter, n: int, reviews: int = 300, cards: int = 60) -> dict:
    baseline = meter.r.info("memory")["used_memory"]

    def one_round(t: int) -> int:
        for u in range(n):
            card = (t * 7 + u) % cards
            when = T0 + 3600 * 6 * t + 60 * u  # a review every 6 hours, each card about every 15 days
            post(http, "/v1/srs/time_aware/reviews", {"user_id": f"user-{u}", "reviews": [
                {"card_id": f"c-{card}", "deck_id": f"d-{card % 5}", "time": when, "rating": 1 + (t + u) % 4,
                 "duration": 4.0 + (t % 9), "event_id": f"r-{t}"}]})
        return n

    writes = metered_rounds(meter, reviews, one_round)
    memory = meter.memory("nextstep:{srs:time_aware:*", n, baseline)
    meter.start()
    for u in range(n):
        post(http, "/v1/srs/time_aware/predict", {"user_id": f"user-{u}", "card_id": f"c-{u % cards}",
                                                  "time": T0 + 3600 * 6 * reviews})
    return {"entity": f"a user after {reviews} reviews of {cards} cards", "write": writes, "read": meter.stop(n),
            "memory": memory}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifacts", help="root holding deep_gpcm/, gru4rec/, time_aware/ (default: train them)")
    parser.add_argument("--entities", type=int, default=100, help="learners and users (sessions: 10x as many)")
    parser.add_argument("--json", help="write the results here too")
    args = parser.parse_args(argv)
    procs = Processes()
    results = {"command": "python bench/" + " ".join([Path(__file__).name, *sys.argv[1:]]), "machine": machine()}
    with tempfile.TemporaryDirectory(prefix="nextstep-redis-cost-") as tmp:
        work = Path(tmp)
        try:
            root = Path(args.artifacts).resolve() if args.artifacts else work / "artifacts"
            if not args.artifacts:
                print("training the three models at their default sizes (1 epoch each) ...", flush=True)
                build_artifacts(root, work)
            redis_port, _ = start_redis(procs, work)
            base, service = start_service(procs, work, root, redis_port)
            meter = Meter(redis_port, service.pid)
            with httpx.Client(base_url=base, timeout=30) as http:
                for name, run in (("knowledge tracing", kt), ("sessions", sessions), ("flashcards", flashcards)):
                    print(f"{name} ...", flush=True)
                    results[name] = run(http, meter, args.entities)
                    print(json.dumps(results[name], indent=1), flush=True)
        except BenchError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        finally:
            procs.stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
