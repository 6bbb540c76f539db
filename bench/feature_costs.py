"""What each lifecycle feature costs a knowledge-tracing event (issue 58, part 3): POST /v1/kt/deep_gpcm/events
(one event and one prediction) p50 at one connection, and req/s and the CPU a request takes (the service's process,
every thread, and redis-server) at 32, with live quality off and on, and with a 100% shadow and a 50% canary of a
second version, interleaved in one run.

    python bench/feature_costs.py [--artifact DIR] [--duration 5] [--rounds 2] [--json OUT]

Two services on one redis-server (service_load.py's processes and wrk scripts), each `nextstep serve` with
NEXTSTEP_NEW_VERSIONS=manual over the same artifact as versions 1 and 2 (the demo deep_gpcm unless --artifact):
one with NEXTSTEP_LIVE_QUALITY=false, one with it on. The configurations, measured in the order
A B C D D C B A per round (each a 1-connection and a 32-connection wrk run):

    A  quality off, no rollout        (the event log alone: it cannot be turned off)
    B  quality on, no rollout         (the default)
    C  quality on, the other version a 100% shadow (each write queues its turn, off the request path)
    D  quality on, the other version a 50% canary  (half the learners answered by it)

Requires wrk and redis-server on PATH.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

import httpx
from machine import machine
from service_load import (
    MODEL,
    BenchError,
    artifact_vocab,
    events_lua,
    no_errors,
    run_in_tempdir,
    run_wrk,
    start_redis,
    start_service,
)

DEMO = Path(__file__).resolve().parents[1] / "nextstep" / "demo_artifacts" / MODEL / "demo"
CONFIGS = {"A": ("off", None), "B": ("on", None), "C": ("on", {"mode": "shadow", "fraction": 1.0}),
           "D": ("on", {"mode": "canary", "fraction": 0.5})}  # (the candidate: the version not serving)
LABELS = {"A": "quality off", "B": "quality on (default)", "C": "+ 100% shadow", "D": "+ 50% canary"}


def run(args, work: Path, procs) -> int:
    root = work / "artifacts"
    for version in ("1", "2"):
        shutil.copytree(Path(args.artifact), root / MODEL / version)
    question_ids, n_cats = artifact_vocab(root / MODEL / "1")
    redis_port, redis = start_redis(procs, work)
    bases, pids = {}, {}
    for quality in ("off", "on"):
        os.environ["NEXTSTEP_LIVE_QUALITY"] = "true" if quality == "on" else "false"
        os.environ["NEXTSTEP_NEW_VERSIONS"] = "manual"
        os.environ["NEXTSTEP_RELOAD_REFRESH_SECONDS"] = "0.5"
        (work / quality).mkdir()
        bases[quality], service = start_service(procs, work / quality, root, redis_port)
        pids[quality] = {"service": service.pid, "redis": redis.pid}
    scripts = {}
    for tag, pool in (("c1", 1), ("cN", 4 * args.connections // 2)):
        scripts[tag] = work / f"{tag}.lua"
        scripts[tag].write_text(events_lua(question_ids, n_cats, tag, pool))
    out = {"machine": machine(), "duration": args.duration, "runs": []}
    order = [c for _ in range(args.rounds) for c in "ABCDDCBA"]
    with httpx.Client(timeout=30) as http:
        for config in order:
            quality, rollout = CONFIGS[config]
            base = bases[quality]
            if rollout is not None:
                serving = http.get(f"{base}/v1/models/{MODEL}/rollout").json()["serving"]
                candidate = "1" if serving == "2" else "2"
                answer = http.put(f"{base}/v1/models/{MODEL}/rollout", json={"candidate": candidate, **rollout})
            else:
                answer = http.delete(f"{base}/v1/models/{MODEL}/rollout")
            if answer.status_code != 200:
                raise BenchError(f"rollout {rollout}: {answer.status_code} {answer.text}")
            url = f"{base}/v1/kt/{MODEL}/events"
            run_wrk(url, scripts["cN"], 2, args.connections, 1.0)  # warm-up
            single = no_errors(run_wrk(url, scripts["c1"], 1, 1, args.duration))
            loaded = no_errors(run_wrk(url, scripts["cN"], 2, args.connections, args.duration, pids[quality]))
            cpu = loaded["cpu_ms_per_request"]
            row = {"config": config, "p50_ms": single["p50_us"] / 1000, "rps": loaded["rps"],
                   "cpu_ms": cpu["service"] + cpu["redis"]}
            out["runs"].append(row)
            print(f"{config} {LABELS[config]:22s} p50 {row['p50_ms']:6.3f} ms   {row['rps']:7.0f} req/s "
                  f"at {args.connections}, CPU {row['cpu_ms']:.3f} ms a request", flush=True)
    fields = ("p50_ms", "rps", "cpu_ms")
    base = {f: statistics.median(r[f] for r in out["runs"] if r["config"] == "A") for f in fields}
    rounds = [out["runs"][i:i + 8] for i in range(0, len(out["runs"]), 8)]

    def paired(config: str, field: str) -> float:
        """The median over rounds of (config's two runs) / (A's two runs): A B C D D C B A cancels a steady drift."""
        return statistics.median(sum(r[field] for r in runs if r["config"] == config)
                                 / sum(r[field] for r in runs if r["config"] == "A") for runs in rounds)

    print("\nmedians, against A's median, and paired (the median over rounds of each round's ratio to its A runs):")
    out["medians"], out["paired"] = {}, {}
    for config in "ABCD":
        mid = out["medians"][config] = {f: statistics.median(r[f] for r in out["runs"] if r["config"] == config)
                                        for f in fields}
        pair = out["paired"][config] = {f: paired(config, f) for f in fields}
        print(f"| {config} | {LABELS[config]} | {mid['p50_ms']:.3f} ms ({mid['p50_ms'] / base['p50_ms']:.2f}x, "
              f"paired {pair['p50_ms']:.2f}x) | {mid['rps']:,.0f} ({mid['rps'] / base['rps']:.2f}x, paired "
              f"{pair['rps']:.2f}x) | {mid['cpu_ms']:.3f} ms ({mid['cpu_ms'] / base['cpu_ms']:.2f}x, paired "
              f"{pair['cpu_ms']:.2f}x) |")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=str(DEMO), help="a deep_gpcm artifact directory (default: the demo's)")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per wrk run (default 5)")
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of A B C D D C B A (default 2)")
    parser.add_argument("--json", help="write the figures to this file")
    return run_in_tempdir(run, parser.parse_args(argv), "nextstep-features-", needs=("wrk", "redis-server"))


if __name__ == "__main__":
    sys.exit(main())
