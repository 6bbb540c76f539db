"""The event log's costs: Redis bytes per learner, and the rebuild of a new version's state from the log.

Starts a real redis-server (the machinery of bench/service_load.py) and drives the knowledge-tracing task in this
process (nextstep.service.kt.service.KnowledgeTracer over a RedisStore and ONNX Runtime with one thread: the service's
path without HTTP), serving the bundled deep_gpcm demo artifact (or --artifact, named by its family; SimAKT with
its default memory banks) as version 1 and a copy as version 2:

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
    window     the replay window alone, through RedisStore (no model): MEMORY USAGE of windows of 200, 1,000 and
               the default 10,000 ids; at the full one, --window-ops reads of one new id and as many writes of one
               (each forgetting the oldest), --window-rounds times: the Redis CPU per read and per write (the
               script's time from INFO commandstats, which counts waits for the CPU too, and the server's
               used_cpu). With --baseline (another checkout's nextstep/service/redis_store.py) the same for that
               store, on the same server, the two alternating round by round (ABBA), with the median of each
               round's ratio to the baseline's round beside it; and the cost of this store's first write to a
               full window the baseline wrote (the move of an old layout), over --window-moves windows

    python bench/event_log.py [--artifact DIR] [--learners 5] [--migrate-learners 500] [--per-event] [--json OUT]
    python bench/event_log.py --only window [--baseline OTHER/nextstep/service/redis_store.py]
    python bench/event_log.py --only rebuild --rebuild-sizes 1000 10000 100000

The p50 cost of an event with the log against without is bench/service_load.py's 1-connection run on this code and
on the commit before the log (docs/scaling.md gives both and the commands).
"""

import argparse
import asyncio
import importlib.util
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from service_load import BenchError, machine_info, run_in_tempdir, start_redis

DEMO = Path(__file__).resolve().parent.parent / "nextstep" / "demo_artifacts" / "deep_gpcm" / "demo"


def artifacts(root: Path, artifact: Path, name: str) -> Path:
    for version, created in (("1", "2026-01-01"), ("2", "2027-01-01")):
        out = root / name / version
        shutil.copytree(artifact, out)
        manifest = json.loads((out / "manifest.json").read_text())
        (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                       "created": f"{created}T00:00:00Z"}))
    return root


async def measure(args, work: Path, redis_port: int) -> dict:
    import redis

    from nextstep.service.kt.banks import Banks, InProcessBankStore
    from nextstep.service.kt.service import Event, KnowledgeTracer
    from nextstep.service.redis_store import RedisStore
    from nextstep.service.registry import ModelRegistry
    from nextstep.service.runtime import Engines
    from nextstep.service.state import DEFAULT_LOG_BOUNDS, LogBounds

    name = args.name
    root = artifacts(work / "artifacts", Path(args.artifact), name)
    registry = ModelRegistry(root, intra_op_threads=1, fold_graphs=not args.per_event)
    registry.reload()
    # (the log's bound raised past the largest rebuild measured: a learner's whole history stays in it)
    store = RedisStore(f"redis://127.0.0.1:{redis_port}/0", ttl_seconds=None,
                       log=LogBounds(max(DEFAULT_LOG_BOUNDS.max_rows, *args.rebuild_sizes), None))
    engines = Engines(64, 0.0)
    banks = Banks(InProcessBankStore())  # (SimAKT's memory banks: each version's default, as the service loads them)
    await banks.prepare(registry.models())
    tracer = KnowledgeTracer(registry, store, engines, banks=banks)
    questions = registry.get(f"{name}@1").ids
    rng = np.random.default_rng(0)
    raw = redis.Redis(host="127.0.0.1", port=redis_port)

    async def feed(student: str, n: int) -> None:
        qs, rs = rng.integers(0, len(questions), n), rng.integers(0, 2, n)
        for start in range(0, n, 1_000):  # (requests of at most NEXTSTEP_MAX_EVENTS events)
            await tracer.absorb(f"{name}@1", student, [Event(questions[qs[i]], int(rs[i]), f"{student}-{i:06d}")
                                                       for i in range(start, min(start + 1_000, n))])

    def bytes_of(student: str) -> dict:
        keys = sorted(raw.scan_iter(match=f"nextstep:{{kt:{name}:{student}}}*"))
        sizes = {k.decode().rsplit("}", 1)[1] or "(meta)": raw.memory_usage(k, samples=0) for k in keys}
        return {"keys": sizes, "total": sum(sizes.values())}

    out = {"bytes": {}, "rebuild": {}, "migrate": {}, "export": {}, "window": {}}
    try:
        if args.only == "window":
            out["window"] = await window_cost(args, redis_port, raw)
            return out
        for n in (200, 10_000) if args.only != "rebuild" else ():
            await feed(f"bytes{n}", n)
            b = bytes_of(f"bytes{n}")
            out["bytes"][n] = {**b, "per_event": b["total"] / n}
            print(f"  {n:6d} events: {b['total']:8d} B in all ({b['total'] / n:.1f} B per event): {b['keys']}")
        for n in args.rebuild_sizes:
            first, cpu, again = [], [], []
            for k in range(args.learners):
                student = f"rebuild{n}-{k}"
                await feed(student, n)
                t0, c0 = time.perf_counter(), time.process_time()
                answer = await tracer.predict(name, student, [questions[0]])
                first.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                if answer["version"] != "2" or answer["rebuilt_from_events"] != n:
                    raise BenchError(f"expected a rebuild of {n} events through version 2, got {answer}")
                t0 = time.perf_counter()
                answer = await tracer.predict(name, student, [questions[0]])
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
        if args.only == "rebuild":
            return out
        # migrate: --migrate-learners learners of 50 events through version 1, then every page to version 2
        n_learners, n_events = args.migrate_learners, 50
        for k in range(n_learners):
            qs, rs = rng.integers(0, len(questions), n_events), rng.integers(0, 2, n_events)
            await tracer.absorb(f"{name}@1", f"migrate-{k}", [Event(questions[qs[i]], int(rs[i]))
                                                                for i in range(n_events)])
        target = registry.get(name, "2")
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
        exported = await export_events(store, "knowledge_tracing", name, work / "export", test_fraction=0.2)
        seconds = time.perf_counter() - t0
        events = sum(exported["events"].values())
        out["export"] = {**exported, "events_per_second": events / seconds}
        print(f"  export: {sum(exported['entities'].values())} learners, {events} events in {seconds:.1f} s "
              f"({events / seconds:.0f} events/s)")
        out["window"] = await window_cost(args, redis_port, raw)
    finally:
        await engines.close()
        await store.close()
        raw.close()
    return out


def load_store(path: str):
    """Another checkout's redis_store.py, as a module of this package (its relative imports are this checkout's)."""
    spec = importlib.util.spec_from_file_location("nextstep.service._baseline_redis_store", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def window_cost(args, redis_port: int, raw) -> dict:
    from nextstep.service import redis_store
    from nextstep.service.state import DEFAULT_MAX_EVENT_IDS

    codes = {"this": redis_store}
    if args.baseline:
        codes = {"baseline": load_store(args.baseline), **codes}
    url, full, ops, key = f"redis://127.0.0.1:{redis_port}/0", DEFAULT_MAX_EVENT_IDS, args.window_ops, "learner"
    stores = {name: code.RedisStore(url, ttl_seconds=None, key_prefix=f"window-{name}", socket_timeout=10)
              for name, code in codes.items()}  # (timeout: a loaded machine may stall the server for a while)
    version = dict.fromkeys(stores, 0)

    async def fill(name: str, store, prefix: str, key: str = key, count: int = full) -> None:
        for start in range(0, count, 100):
            ids = [f"{prefix}{i:06d}" for i in range(start, min(start + 100, count))]
            await store.compare_and_set(key, version[name], b"x", len(ids), ids)
            version[name] += 1

    def used() -> tuple[int, float]:
        script = raw.info("commandstats").get("cmdstat_evalsha", {}).get("usec", 0)
        cpu = raw.info("cpu")
        return script, cpu["used_cpu_user"] + cpu["used_cpu_sys"]

    def window_bytes(prefix: str, key: str = key) -> dict:
        names = sorted(raw.scan_iter(match=f"{prefix}:{{{key}}}:*"))
        sizes = {n.decode().rsplit("}", 1)[1]: raw.memory_usage(n, samples=0) for n in names
                 if not n.decode().endswith(":log")}
        return {"keys": sizes, "total": sum(sizes.values())}

    out: dict = {"ops_per_round": ops, "rounds": args.window_rounds, "codes": {}}
    try:
        for name, store in stores.items():
            smaller = {}
            for count in (200, 1_000):  # windows not full: their bytes
                version[name] = 0
                await fill(name, store, "s-", f"size-{count}", count)
                smaller[count] = window_bytes(f"window-{name}", f"size-{count}")
            version[name] = 0
            await fill(name, store, "w-")
            out["codes"][name] = {"bytes": window_bytes(f"window-{name}"), "bytes_smaller": smaller, "read": [],
                                  "write": []}
            print(f"  windows of 200 and 1,000 ids, {name}: {smaller[200]['total']} B {smaller[200]['keys']}, "
                  f"{smaller[1_000]['total']} B {smaller[1_000]['keys']}")
        fresh = full
        for r in range(args.window_rounds):
            for name, store in list(stores.items())[::1 if r % 2 == 0 else -1]:  # (ABBA: drift cancels)
                ids = [f"w-{i:06d}" for i in range(fresh, fresh + ops)]
                for kind in ("read", "write"):
                    raw.config_resetstat()
                    _, cpu0 = used()
                    for event_id in ids:
                        if kind == "read":
                            await store.read(key, [event_id])
                        else:
                            if await store.compare_and_set(key, version[name], b"x", 1, [event_id]) is None:
                                raise BenchError("a window write was refused")
                            version[name] += 1
                    script, cpu1 = used()
                    out["codes"][name][kind].append({"script_us": script / ops, "server_cpu_us": (cpu1 - cpu0) / ops
                                                     * 1e6})
            fresh += ops
        for name, figures in out["codes"].items():
            if await stores[name].seen(key, [f"w-{fresh - 1:06d}", f"w-{fresh - full - 1:06d}"]) != {
                    f"w-{fresh - 1:06d}"}:
                raise BenchError(f"{name}: the window does not hold exactly the newest {full} ids")
            for kind in ("read", "write"):
                rounds = figures[kind]
                figures[f"{kind}_median"] = {m: statistics.median(r[m] for r in rounds) for m in rounds[0]}
            print(f"  window of {full} ids, {name}: {figures['bytes']['total']} B {figures['bytes']['keys']}; "
                  f"Redis per read {figures['read_median']['script_us']:.1f} us in the script "
                  f"({figures['read_median']['server_cpu_us']:.1f} us server CPU), per write "
                  f"{figures['write_median']['script_us']:.1f} us ({figures['write_median']['server_cpu_us']:.1f} us); "
                  f"medians of {args.window_rounds} rounds of {ops}")
        if args.baseline:  # each round's figure over the baseline's beside it: the machine's drift cancels
            out["this_over_baseline"] = {}
            for kind in ("read", "write"):
                for m in ("script_us", "server_cpu_us"):
                    ratios = sorted(a[m] / b[m] for a, b in zip(out["codes"]["this"][kind],
                                                                out["codes"]["baseline"][kind], strict=True))
                    q = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
                    out["this_over_baseline"][f"{kind}_{m}"] = {"median": statistics.median(ratios),
                                                                 "quartiles": [q[0], q[2]]}
                    print(f"  this store over the baseline, {kind}, {m}: median {statistics.median(ratios):.3f} "
                          f"(quartiles {q[0]:.3f}, {q[2]:.3f}) over {len(ratios)} paired rounds")
        if args.baseline:  # this store's first write to a full window the baseline wrote (--window-moves keys)
            moved = redis_store.RedisStore(url, ttl_seconds=None, key_prefix="window-baseline", socket_timeout=10)
            moves = []
            try:
                for k in range(args.window_moves):
                    name, key = "baseline", f"move-{k}"
                    version[name] = 0
                    await fill(name, stores[name], "m-", key)
                    raw.config_resetstat()
                    _, cpu0 = used()
                    if await moved.compare_and_set(key, version[name], b"x", 1, ["m-new"]) is None:
                        raise BenchError("the first write to the baseline's window was refused")
                    script, cpu1 = used()
                    moves.append({"script_us": script, "server_cpu_us": (cpu1 - cpu0) * 1e6})
                    if await moved.seen(key, ["m-000001", "m-000000", "m-new"]) != {"m-000001", "m-new"}:
                        raise BenchError("the moved window does not hold exactly the newest ids")
                after = window_bytes("window-baseline", key)
            finally:
                await moved.close()
            out["first_write_to_baseline_window"] = {
                "moves": moves, "median": {m: statistics.median(r[m] for r in moves) for m in moves[0]},
                "window_after": after}
            median = out["first_write_to_baseline_window"]["median"]
            print(f"  this store's first write to a full window the baseline wrote: {median['script_us']:.0f} us in "
                  f"the script ({median['server_cpu_us']:.0f} us server CPU), median of {len(moves)}; the window then "
                  f"{after['total']} B {after['keys']}")
    finally:
        for store in stores.values():
            await store.close()
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
    parser.add_argument("--rebuild-sizes", type=int, nargs="+", default=[200, 1_000],
                        help="events in the logs rebuilt (default 200 1000; e.g. 1000 10000 100000)")
    parser.add_argument("--migrate-learners", type=int, default=500, help="learners migrated (default 500)")
    parser.add_argument("--only", choices=("window", "rebuild"), help="run this part alone")
    parser.add_argument("--baseline", help="another checkout's nextstep/service/redis_store.py: its window measured "
                                           "beside this one's")
    parser.add_argument("--window-ops", type=int, default=1_000, help="reads and writes a round (default 1,000)")
    parser.add_argument("--window-rounds", type=int, default=20, help="rounds of them per store (default 20)")
    parser.add_argument("--window-moves", type=int, default=5, help="baseline windows moved by this store (default 5)")
    parser.add_argument("--artifact", default=str(DEMO),
                        help="a knowledge-tracing artifact served as versions 1 and 2 (default: the demo deep_gpcm)")
    parser.add_argument("--per-event", action="store_true",
                        help="no fold graphs: rebuild and migrate with one step graph call per event")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    args.name = json.loads((Path(args.artifact) / "manifest.json").read_text())["family"]  # (the model's name here)
    return run_in_tempdir(run, args, "nextstep-event-log-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
