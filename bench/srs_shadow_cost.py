"""What a flashcard shadow turn costs (issue 35), in process, over a real Redis, without HTTP: the median time of a
serving write of one review (`SpacedRepetition.add_reviews`, what the user waits for) and of the shadow turn it
queues (`follow_log`, off the request path), for a candidate of the same window layout (version 2: the demo with its
drift gain raised; the turn scores the review, storing nothing) and of another layout (version 3: windows of 16
reviews where version 1 reads 32; the turn also appends the review to the candidate's own state of the user), and
of a user's first turn of another layout (their state rebuilt from the serving layout's first).

Each of --users users records --reviews reviews of 8 cards, about a day apart, one a write, each write's turn
followed at once (so the candidate's state is current, as a keeping-up shadow's is); the first --warmup writes of
each user are not timed. A review of a card last reviewed on an earlier day is scored: the turns are timed apart by
whether their review is (a same-layout turn of an unscored one does nothing).

    python bench/srs_shadow_cost.py [--users 50] [--reviews 40] [--warmup 10] [--json OUT]

Requires redis-server on PATH.
"""

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from rollout_walkthrough import add_flashcards
from service_load import machine_info, run_in_tempdir, start_redis

T0 = 1_767_225_600.0


def run(args, work: Path, procs) -> int:
    from nextstep.service.redis_store import RedisStore
    from nextstep.service.registry import ModelRegistry
    from nextstep.service.rollouts import Rollout, Rollouts
    from nextstep.service.runtime import Engines
    from nextstep.service.srs.service import SpacedRepetition
    from nextstep.service.srs.stored import Review

    machine = machine_info()
    print(f"machine: {machine['cpu']}, load average {machine['load_avg_at_start']} at start", file=sys.stderr)
    port, _ = start_redis(procs, work)
    artifacts = work / "artifacts"
    add_flashcards(artifacts, "1", 2026, 0.0, None)
    add_flashcards(artifacts, "2", 2025, 1.0, None)  # (older: version 1 serves)
    add_flashcards(artifacts, "3", 2024, 0.0, 16)
    rng = np.random.default_rng(0)

    async def measure() -> dict:
        store = RedisStore(f"redis://127.0.0.1:{port}/0", ttl_seconds=None)
        registry = ModelRegistry(artifacts, new_versions="manual")
        registry.reload()
        srs = SpacedRepetition(registry, store, Engines(32, 0.0))
        srs.rollouts, srs.shadows = Rollouts(None), asyncio.Queue(100)
        out = {}
        timings = {c: {"write": [], True: [], False: [], "first": []} for c in ("2", "3")}
        try:
            for u in range(args.users):
                for candidate in ("2", "3"):  # (interleaved: the machine's load falls on both alike)
                    await srs.rollouts.put("time_aware", Rollout("1", candidate, "shadow", 1.0))
                    user, at, took = f"{candidate}-user-{u}", T0, timings[candidate]
                    for i in range(args.reviews):
                        at += float(rng.exponential(86400.0))
                        review = Review(f"c{rng.integers(8)}", at, 1 if rng.random() < 0.15 else 3)
                        t0 = time.perf_counter()
                        await srs.add_reviews("time_aware", user, [review])
                        t1 = time.perf_counter()
                        name, version, entity, queued = srs.shadows.get_nowait()
                        assert await srs.follow_log(registry.get(name, version), entity, queued)
                        t2 = time.perf_counter()
                        if i == 0:
                            took["first"].append(t2 - t1)
                        elif i >= args.warmup:
                            took["write"].append(t1 - t0)
                            took[bool(queued.scored.any())].append(t2 - t1)
            for candidate, took in timings.items():
                layout = "same layout" if candidate == "2" else "another layout"
                row = out[layout] = {
                    "write_ms": statistics.median(took["write"]) * 1e3, "writes": len(took["write"]),
                    "turn_scored_ms": statistics.median(took[True]) * 1e3, "scored_turns": len(took[True]),
                    "turn_unscored_ms": statistics.median(took[False]) * 1e3 if took[False] else None,
                    "first_turn_ms": statistics.median(took["first"]) * 1e3}
                print(f"{layout}: write {row['write_ms']:.2f} ms (median of {row['writes']}); shadow turn "
                      f"{row['turn_scored_ms']:.2f} ms scored ({row['scored_turns']}), "
                      f"{row['turn_unscored_ms'] or 0:.2f} ms not ({len(took[False])}); a user's first turn "
                      f"{row['first_turn_ms']:.2f} ms")
        finally:
            await store.close()
        return out

    result = {"machine": machine, "users": args.users, "reviews": args.reviews, **asyncio.run(measure())}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--reviews", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "nextstep-srs-shadow-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
