"""What the Python client adds to a call (issue 57): one KT event with one prediction, sequentially, against the
service serving the bundled demo deep_gpcm (its own process, one worker, state in a real Redis), sent by a bare
httpx.Client post (the JSON answer decoded to a dict) and by nextstep.client.Client (the event given an id, the
answer parsed into its typed model), in interleaved rounds; the median of each round's p50, and the ratio.

    python bench/client_overhead.py [--rounds 7] [--requests 300]

Needs redis-server on PATH.
"""

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx
from machine import machine  # bench/machine.py (the script's directory is on sys.path)
from service_load import BenchError, run_in_tempdir, start_redis, start_service

from nextstep import demo
from nextstep.client import Client


def p50_ms(call, n: int) -> float:
    times = []
    for i in range(n):
        start = time.perf_counter()
        call(i)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def run(args, work: Path, procs) -> int:
    redis_port, _ = start_redis(procs, work)
    url, _ = start_service(procs, work, demo.BUNDLED, redis_port)
    with httpx.Client(base_url=url, timeout=10) as http, Client(url, timeout=10) as client:
        ids = client.models.ids("deep_gpcm").ids
        tag = uuid.uuid4().hex[:8]

        def bare(i: int) -> None:
            reply = http.post("/v1/kt/deep_gpcm/events", json={
                "student_id": f"bare-{tag}-{i % 20}", "events": [
                    {"question_id": ids[i % len(ids)], "response": i % 4, "event_id": uuid.uuid4().hex}],
                "predict_question_ids": [ids[(i + 1) % len(ids)]]})
            if reply.status_code != 200:
                raise BenchError(f"bare httpx: {reply.status_code} {reply.text}")
            reply.json()

        def typed(i: int) -> None:
            client.kt.events("deep_gpcm", f"client-{tag}-{i % 20}",
                             [{"question_id": ids[i % len(ids)], "response": i % 4}],
                             predict_question_ids=[ids[(i + 1) % len(ids)]])

        p50_ms(bare, 50), p50_ms(typed, 50)  # (warm-up: connections, the learners' first states)
        bares, typeds = [], []
        for r in range(args.rounds):  # alternating which goes first, so that drifts fall on both
            order = [(bare, bares), (typed, typeds)] if r % 2 == 0 else [(typed, typeds), (bare, bares)]
            for call, into in order:
                into.append(p50_ms(call, args.requests))
    b, t = statistics.median(bares), statistics.median(typeds)
    print(f"machine: {machine()}")
    print(f"one KT event + one prediction, sequential, {args.rounds} rounds x {args.requests} requests each:")
    print(f"  bare httpx p50        {b:.3f} ms   (rounds: {', '.join(f'{x:.3f}' for x in bares)})")
    print(f"  nextstep.client p50   {t:.3f} ms   (rounds: {', '.join(f'{x:.3f}' for x in typeds)})")
    print(f"  client / bare         {t / b:.3f}  (goal: at most 1.10)")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--requests", type=int, default=300, help="timed requests per round and client")
    args = parser.parse_args()
    return run_in_tempdir(run, args, "client-overhead-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
