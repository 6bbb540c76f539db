"""The event log's costs: Redis bytes per learner, and the rebuild of a new version's state from the log.

Starts a real redis-server (the machinery of bench/service_load.py) and drives the knowledge-tracing task in this
process (nextstep.service.kt.KnowledgeTracer over a RedisStore and ONNX Runtime with one thread: the service's
path without HTTP), serving the bundled deep_gpcm demo artifact as version 1 and a copy as version 2:

    bytes      learners with 200 and 10,000 events (one per request, each with an event id like "ada-000123"
               and a question id of the demo's vocabulary, as the app sent them), then MEMORY USAGE of every key
               of the learner: its meta hash, version 1's state, the log and the replay window
    rebuild    learners with 200 and 1,000 logged events (through version 1); the first predict through version
               2 folds them all in (one call of the fold graph, nextstep/service/fold.py; with --per-event, one step
               graph call each, as before the fold graph) and stores the state: its median time over --learners
               learners (and the CPU time of this process, which a loaded machine inflates less), against a
               predict on a state already up to date
    migrate    --migrate-learners learners of 50 events through version 1, then every page of a migration to
               version 2 (KnowledgeTracer.migrate, as `nextstep states migrate` runs it): learners and events a second
    export     every learner above written by the event export (the long CSV, gzipped): events a second

    python bench/event_log.py [--learners 5] [--migrate-learners 500] [--per-event] [--json OUT]

The p50 cost of an event with the log against without is bench/service_load.py's 1-connection run on this code and
on the commit before the log (docs/scaling.md gives both and the commands).
"""

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from service_load import BenchError, machine_info, run_in_tempdir, start_redis

DEMO = Path(__file__).resolve().parent.parent / "nextstep" / "demo_artifacts" / "deep_gpcm" / "demo"


def artifacts(root: Path) -> Path:
    for version, created in (("1", "2026-01-01"), ("2", "2027-01-01")):
        out = root / "deep_gpcm" / version
        shutil.copytree(DEMO, out)
        manifest = json.loads((out / "manifest.json").read_text())
        (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                       "created": f"{created}T00:00:00Z"}))
    return root


async def measure(args, work: Path, redis_port: int) -> dict:
    import redis

    from nextstep.service.kt import Event, KnowledgeTracer
    from nextstep.service.redis_store import RedisStore
    from nextstep.service.registry import ModelRegistry
    from nextstep.service.runtime import Engines

    root = artifacts(work / "artifacts")
    registry = ModelRegistry(root, intra_op_threads=1, fold_graphs=not args.per_event)
    registry.reload()
    store = RedisStore(f"redis://127.0.0.1:{redis_port}/0", ttl_seconds=None)
    engines = Engines(64, 0.0)
    tracer = KnowledgeTracer(registry, store, engines)
    questions = registry.get("deep_gpcm@1").ids
    rng = np.random.default_rng(0)
    raw = redis.Redis(host="127.0.0.1", port=redis_port)

    async def feed(student: str, n: int) -> None:
        qs, rs = rng.integers(0, len(questions), n), rng.integers(0, 2, n)
        for i in range(n):
            await tracer.absorb("deep_gpcm@1", student, [Event(questions[qs[i]], int(rs[i]), f"{student}-{i:06d}")])

    def bytes_of(student: str) -> dict:
        keys = sorted(raw.scan_iter(match=f"nextstep:{{kt:deep_gpcm:{student}}}*"))
        sizes = {k.decode().rsplit("}", 1)[1] or "(meta)": raw.memory_usage(k, samples=0) for k in keys}
        return {"keys": sizes, "total": sum(sizes.values())}

    out = {"bytes": {}, "rebuild": {}, "migrate": {}, "export": {}}
    try:
        for n in (200, 10_000):
            await feed(f"bytes{n}", n)
            b = bytes_of(f"bytes{n}")
            out["bytes"][n] = {**b, "per_event": b["total"] / n}
            print(f"  {n:6d} events: {b['total']:8d} B in all ({b['total'] / n:.1f} B per event): {b['keys']}")
        for n in (200, 1_000):
            first, cpu, again = [], [], []
            for k in range(args.learners):
                student = f"rebuild{n}-{k}"
                await feed(student, n)
                t0, c0 = time.perf_counter(), time.process_time()
                answer = await tracer.predict("deep_gpcm", student, [questions[0]])
                first.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                if answer["version"] != "2" or answer["rebuilt_from_events"] != n:
                    raise BenchError(f"expected a rebuild of {n} events through version 2, got {answer}")
                t0 = time.perf_counter()
                answer = await tracer.predict("deep_gpcm", student, [questions[0]])
                again.append(time.perf_counter() - t0)
                if answer["rebuilt_from_events"] != 0:
                    raise BenchError("the rebuilt state was not stored")
            out["rebuild"][n] = {"first_predict_ms": [t * 1000 for t in first],
                                 "median_ms": statistics.median(first) * 1000,
                                 "cpu_median_ms": statistics.median(cpu) * 1000,
                                 "up_to_date_median_ms": statistics.median(again) * 1000}
            print(f"  rebuild of {n:5d} events: first predict through version 2, median "
                  f"{out['rebuild'][n]['median_ms']:.1f} ms ({args.learners} learners; this process's CPU "
                  f"{out['rebuild'][n]['cpu_median_ms']:.1f} ms); then "
                  f"{out['rebuild'][n]['up_to_date_median_ms']:.2f} ms")
        # migrate: --migrate-learners learners of 50 events through version 1, then every page to version 2
        n_learners, n_events = args.migrate_learners, 50
        for k in range(n_learners):
            qs, rs = rng.integers(0, len(questions), n_events), rng.integers(0, 2, n_events)
            await tracer.absorb("deep_gpcm@1", f"migrate-{k}", [Event(questions[qs[i]], int(rs[i]))
                                                                for i in range(n_events)])
        target = registry.get("deep_gpcm", "2")
        t0 = time.perf_counter()
        cursor, rebuilt, folded = "0", 0, 0
        while True:
            page = await tracer.migrate(target, cursor, 500)
            rebuilt, folded = rebuilt + page["rebuilt"], folded + page["events"]
            cursor = page["cursor"]
            if page["done"]:
                break
        seconds = time.perf_counter() - t0
        out["migrate"] = {"learners_rebuilt": rebuilt, "events_folded": folded, "seconds": seconds,
                          "learners_per_second": rebuilt / seconds, "events_per_second": folded / seconds}
        print(f"  migrate to version 2: {rebuilt} learners ({n_learners} of {n_events} events, and the bytes "
              f"learners), {folded} events in {seconds:.1f} s: {rebuilt / seconds:.0f} learners/s, "
              f"{folded / seconds:.0f} events/s")
        from nextstep.service.event_export import export_events

        t0 = time.perf_counter()
        exported = await export_events(store, "knowledge_tracing", "deep_gpcm", work / "export", test_fraction=0.2)
        seconds = time.perf_counter() - t0
        events = sum(exported["events"].values())
        out["export"] = {**exported, "events_per_second": events / seconds}
        print(f"  export: {sum(exported['entities'].values())} learners, {events} events in {seconds:.1f} s "
              f"({events / seconds:.0f} events/s)")
    finally:
        await engines.close()
        await store.close()
        raw.close()
    return out


def run(args, work: Path, procs) -> int:
    machine = machine_info()
    print(f"machine: {machine['cpu']}, load average {machine['load_avg_at_start']} at start; rebuilds "
          f"{'one step graph call per event' if args.per_event else 'through the fold graph'}")
    redis_port, _ = start_redis(procs, work)
    result = {"machine": machine, "per_event": args.per_event, **asyncio.run(measure(args, work, redis_port))}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--learners", type=int, default=5, help="learners per rebuild size (default 5)")
    parser.add_argument("--migrate-learners", type=int, default=500, help="learners migrated (default 500)")
    parser.add_argument("--per-event", action="store_true",
                        help="no fold graphs: rebuild and migrate with one step graph call per event")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "nextstep-event-log-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
