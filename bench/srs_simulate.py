"""The flashcard workload simulator's latency: POST /v1/srs/time_aware/simulate for one user's whole deck.

Starts a real redis-server and `nextstep serve` with one worker (bench/service_load.py's machinery), serving a
time-aware artifact: by default one exported here as bench/srs_load.py does (window 256, card window 32, random
weights: the weights do not change the cost), or the srs artifact given with --artifact. It records one user's
reviews: --cards cards (5,000 by default), each reviewed --reviews-per-card times over the last 40 days, in 20 decks,
through POST /reviews. Then it times --requests simulate requests for that user's every stored card over --days days
(365) at the route's default six desired retentions (0.7 to 0.95), after --warmup untimed ones, one at a time from
the client (wall time per request: HTTP, the Redis read of every card, the two graph calls on the sample, the
simulation and the JSON answer). Prints the median, p90 and max, the service's own handler time and the reviews the
simulation went through (its cost grows with them: a model that stretches intervals, as random weights may, makes
fewer), then the whole result as JSON (also to --json OUT). Goal (issue 38): the median within 200 ms.

    python bench/srs_simulate.py [--artifact DIR] [--cards 5000] [--reviews-per-card 3] [--days 365]
                                 [--requests 30] [--warmup 3] [--json OUT]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from service_load import (
    BenchError,
    Processes,
    machine_info,
    metrics_snapshot,
    run_in_tempdir,
    start_redis,
    start_service,
)
from srs_load import BUILD, MODEL

DECKS = 20
CHUNK = 1000  # reviews per POST (NEXTSTEP_MAX_EVENTS' default)


STEPS = (0, 2, 7, 16, 30)  # the days of a card's reviews after its first (a young deck: short intervals, many
# reviews to simulate, the heavier case)


def reviews(n_cards: int, per_card: int, now: float) -> list[dict]:
    """n_cards x per_card (at most 5) reviews over the 40 days before `now`, in time order: card c's k-th review on
    day c % 10 + STEPS[k] (days from the start); one review in seven is Again, one in five of the rest Hard."""
    start = now - 40 * 86400.0
    out = []
    for c in range(n_cards):
        for k in range(min(per_card, len(STEPS))):
            day = c % 10 + STEPS[k]
            n = c * 7 + k
            out.append({"card_id": f"card-{c}", "deck_id": f"deck-{c % DECKS}",
                        "time": start + day * 86400.0 + (c * 7 % 36000), "rating": 1 if n % 7 == 0 else
                        (2 if n % 5 == 0 else 3), "duration": 4.0 + n % 9})
    return sorted(out, key=lambda r: r["time"])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", help="an srs artifact directory (default: export one here, random weights)")
    parser.add_argument("--cards", type=int, default=5000)
    parser.add_argument("--reviews-per-card", type=int, default=3)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "nextstep-srs-simulate-")


def run(args, work: Path, procs: Processes) -> int:
    artifacts = work / "artifacts"
    (artifacts / MODEL).mkdir(parents=True)
    if args.artifact:
        art = artifacts / MODEL / "given"
        art.symlink_to(Path(args.artifact).resolve(), target_is_directory=True)
    else:
        art = artifacts / MODEL / "bench"
        print("exporting a time-aware model (window 256, card window 32, random weights) ...", flush=True)
        done = subprocess.run([sys.executable, "-c", BUILD, str(art)], capture_output=True, text=True)
        if done.returncode:
            raise BenchError(f"export failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    manifest = json.loads((art / "manifest.json").read_text())
    redis_port, _ = start_redis(procs, work)
    base, _ = start_service(procs, work, artifacts, redis_port)
    now = time.time()
    log = reviews(args.cards, args.reviews_per_card, now)
    started = time.perf_counter()
    body = {"user_id": "bench", "days": args.days}
    with httpx.Client(base_url=base, timeout=120) as http:
        for lo in range(0, len(log), CHUNK):
            reply = http.post(f"/v1/srs/{MODEL}/reviews", json={"user_id": "bench", "reviews": log[lo:lo + CHUNK]})
            if reply.status_code != 200:
                raise BenchError(f"loading the user failed: {reply.status_code} {reply.text[:500]}")
        loaded = time.perf_counter() - started
        print(f"one user, {args.cards} cards x {args.reviews_per_card} reviews loaded in {loaded:.1f} s", flush=True)
        for _ in range(args.warmup):
            first = http.post(f"/v1/srs/{MODEL}/simulate", json=body)
            if first.status_code != 200:
                raise BenchError(f"simulate failed: {first.status_code} {first.text[:500]}")
        answer = first.json()
        if answer["cards"] != args.cards:
            raise BenchError(f"simulate saw {answer['cards']} cards, not {args.cards}")
        before = metrics_snapshot(base)
        times = []
        for _ in range(args.requests):
            t0 = time.perf_counter()
            reply = http.post(f"/v1/srs/{MODEL}/simulate", json=body)
            times.append((time.perf_counter() - t0) * 1000)
            if reply.status_code != 200:
                raise BenchError(f"simulate failed: {reply.status_code} {reply.text[:500]}")
        after = metrics_snapshot(base)

    def delta(name: str) -> float:
        return sum(v - before.get(k, 0.0) for k, v in after.items()
                   if k[0] == name and dict(k[1]).get("route") == "/v1/srs/{model}/simulate")

    handler = 1000 * delta("nextstep_request_seconds_sum") / max(1.0, delta("nextstep_request_seconds_count"))
    ordered = sorted(times)
    simulated = sum(r["total_reviews"] for r in answer["retentions"])  # the simulation's cost grows with these
    summary = {"median_ms": statistics.median(times), "p90_ms": ordered[int(0.9 * (len(ordered) - 1))],
               "min_ms": ordered[0], "max_ms": ordered[-1], "handler_mean_ms": handler,
               "simulated_reviews_per_request": simulated}
    print(f"simulate, {args.cards} cards x {args.days} days x {len(answer['retentions'])} retentions "
          f"({answer['sampled_cards']} cards sampled, {answer['replicas']} replica(s), {simulated:,.0f} reviews "
          f"simulated in all), {args.requests} requests: "
          f"median {summary['median_ms']:.1f} ms, p90 {summary['p90_ms']:.1f} ms, max {summary['max_ms']:.1f} ms; "
          f"inside the service {handler:.1f} ms per request", flush=True)
    for r in answer["retentions"]:
        print(f"  retention {r['desired_retention']:.2f}: {r['total_reviews'] / args.days:7.1f} reviews a day, "
              f"{r['mean_minutes_per_day']:6.1f} min a day, {r['recalled_at_end']:7.0f} cards recalled at the end "
              f"(interval ratio to FSRS-6 {r['interval_ratio_to_fsrs6']:.2f}, {r['seconds_per_review']:.1f} s a "
              "review)", flush=True)
    results = {"machine": machine_info(), "model": {"window": manifest.get("window"),
                                                   "artifact": str(args.artifact or "exported here, random weights")},
               "cards": args.cards, "reviews_per_card": args.reviews_per_card, "days": args.days,
               "retentions": [r["desired_retention"] for r in answer["retentions"]], "load_seconds": loaded,
               "times_ms": times, "summary": summary, "goal": {"median_ms_at_most": 200,
                                                               "met": summary["median_ms"] <= 200}}
    print(json.dumps(results, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
