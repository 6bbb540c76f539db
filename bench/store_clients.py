"""Which Redis client the state stores use on one node: the service's own pipelined client (resp) or redis-py's pool,
and the code before redis_clients.py (a git revision) as the baseline; all interleaved in one run.

    python bench/store_clients.py [--rounds 5] [--duration 5] [--baseline main] [--json OUT]

0. In process: the commands of one KT event (the read's five HMGET/HGET, the compare-and-set's EVALSHA with a
   1,952-byte state) encoded by resp.pack (hiredis's encoder) and by resp.pack_python; medians of 20,000.
1. In process: `RedisStore` read (state + replay bucket, one round trip) and compare-and-set (EVALSHA), one caller,
   for each client (`?client=resp`, `?client=redis-py`), alternating, `--rounds` x 2,000 of each; medians.
2. Over HTTP: one redis-server; one `nextstep serve` per variant (this tree with client=resp, with client=redis-py,
   and the `--baseline` revision exported with `git archive` into the temp dir); wrk -t1 -c1 POST /v1/kt/.../events
   (bench/service_load.py's script), `--duration` s per variant per round, variants in turn, `--rounds` rounds; the
   median of the per-round p50s (and p99s) per variant. Optional: `--wait-replicas 1` adds a variant writing with
   WAIT 1 against a replica of the server (redis-py), for the cost of durability.

Uses the bundled demo deep_gpcm (nextstep/demo_artifacts) unless --artifact is given. Needs wrk, redis-server, git.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import service_load as sl  # bench/service_load.py (the script's directory is on sys.path)

ROOT = Path(__file__).resolve().parent.parent


def encoding(n: int = 20000) -> dict:
    from nextstep.service.resp import pack, pack_python

    key = "nextstep:{kt:deep_gpcm:student-1}"
    commands = [("HMGET", f"{key}:s:7a85aa79d3fc", "version", "events", "updated", "blob", "logged"),
                ("HMGET", key, "total", "base", "recorded", "ids"), ("HMGET", f"{key}:seen", b"\xf7"),
                ("HMGET", f"{key}:ids", b"\xf7"), ("HGET", f"{key}:s:7a85aa79d3fc", "version"),
                ("EVALSHA", "cf924fa06c652503072749e660879432931b6fb7", 8, key, f"{key}:s:7a85aa79d3fc",
                 f"{key}:order", f"{key}:s:7a85aa79d3fc:fields", f"{key}:log", f"{key}:seen", f"{key}:ids",
                 f"{key}:ring", 3, -1, os.urandom(1952), 1, repr(time.time()), 15552000000, 10000, 100000, 50000,
                 -1, "s:7a85aa79d3fc", 0, 1, b"k\x10.\xf1\x013", b"\xf7lO\xeb\xcb\xb7E")]
    out = {}
    for name, encode in (("pack (hiredis)", pack), ("pack_python", pack_python)):
        times = []
        for _ in range(n):
            start = time.perf_counter()
            for command in commands:
                encode(*command)
            times.append(time.perf_counter() - start)
        out[name] = statistics.median(times) * 1e6
    return out


def roundtrips(url: str, rounds: int, n: int = 2000) -> dict:
    sys.path.insert(0, str(ROOT))
    from nextstep.service.redis_store import RedisStore

    async def body() -> dict:
        stores = {c: RedisStore(f"{url}?client={c}", ttl_seconds=None, key_prefix=f"rt-{c}")
                  for c in ("resp", "redis-py")}
        times: dict[str, list[float]] = {f"{c} {op}": [] for c in stores for op in ("read", "cas")}
        try:
            for store in stores.values():
                await store.compare_and_set("k", 0, b"x" * 600, 1, ["e0"])
            for _ in range(rounds):
                for c, store in stores.items():
                    version = (await store.get("k")).version
                    t = time.perf_counter()
                    for i in range(n):
                        await store.read("k", [f"q{i}"])
                    t1 = time.perf_counter()
                    for i in range(n):
                        await store.compare_and_set("k", version + i, b"y" * 600, 1, [f"r{version + i}"])
                    t2 = time.perf_counter()
                    times[f"{c} read"].append((t1 - t) / n * 1e3)
                    times[f"{c} cas"].append((t2 - t1) / n * 1e3)
        finally:
            for store in stores.values():
                await store.close()
        return {k: statistics.median(v) for k, v in times.items()} | {"rounds": times}

    try:
        import uvloop

        return uvloop.run(body())
    except ImportError:
        return asyncio.run(body())


def start_service(procs: sl.Processes, work: Path, name: str, code: Path, artifacts: Path, redis_url: str,
                  extra: dict) -> str:
    import httpx

    port = sl.free_port()
    env = dict(os.environ, PYTHONPATH=str(code), NEXTSTEP_REDIS_URL=redis_url, NEXTSTEP_ARTIFACTS_DIR=str(artifacts),
               NEXTSTEP_API_KEYS="", **extra)
    argv = [sys.executable, "-m", "nextstep.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
            "--artifacts", str(artifacts)]
    log = work / f"service-{name}.log"
    proc = procs.start(f"serve {name}", argv, log, env=env, cwd=work)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise sl.BenchError(f"{name} exited:\n{sl.tail(log)}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return base
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise sl.BenchError(f"{name} not ready:\n{sl.tail(log)}")
        time.sleep(0.1)


def start_replica(procs: sl.Processes, work: Path, primary_port: int) -> int:
    import redis

    port = sl.free_port()
    (work / "replica").mkdir()
    procs.start("replica", ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                            "--appendonly", "no", "--dir", str(work / "replica"), "--replicaof", "127.0.0.1",
                            str(primary_port)], work / "replica.log")
    client = redis.Redis(port=port, socket_timeout=1)
    deadline = time.monotonic() + 15
    while True:
        try:
            if client.info("replication").get("master_link_status") == "up":
                return port
        except redis.exceptions.ConnectionError:
            pass
        if time.monotonic() > deadline:
            raise sl.BenchError("the replica did not sync")
        time.sleep(0.05)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--artifact", default=str(ROOT / "nextstep" / "demo_artifacts"))
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of wrk per variant per round")
    parser.add_argument("--baseline", default="main", help="git revision of the code before (empty: none)")
    parser.add_argument("--wait-replicas", type=int, default=0, help="also a variant with WAIT (a replica runs)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    procs = sl.Processes()
    results: dict = {"machine": sl.machine_info(), "args": vars(args)}
    with tempfile.TemporaryDirectory(prefix="store-clients-") as tmp:
        work = Path(tmp)
        try:
            redis_port, _ = sl.start_redis(procs, work)
            url = f"redis://127.0.0.1:{redis_port}/0"
            results["encoding_us"] = enc = encoding()
            print("in process, one KT event's six commands encoded, median us:",
                  ", ".join(f"{k} {v:.1f}" for k, v in enc.items()))
            rt = roundtrips(url, args.rounds)
            results["roundtrips_ms"] = rt
            print("in process, one caller, median ms per call over", args.rounds, "rounds (interleaved):")
            for k in ("resp read", "redis-py read", "resp cas", "redis-py cas"):
                print(f"  {k:15s} {rt[k]:.4f}")
            artifacts, art, origin = sl.prepare_artifacts(args.artifact, work)
            question_ids, n_cats = sl.artifact_vocab(art)
            variants = {"resp": (ROOT, {"NEXTSTEP_REDIS_CLIENT": "resp"}),
                        "redis-py": (ROOT, {"NEXTSTEP_REDIS_CLIENT": "redis-py"})}
            if args.baseline:
                old = work / "baseline"
                old.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.baseline, "nextstep"],
                                         capture_output=True, check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(old)], input=archive, check=True)
                variants = {f"baseline {args.baseline}": (old, {}), **variants}
            if args.wait_replicas:
                start_replica(procs, work, redis_port)
                variants[f"redis-py WAIT {args.wait_replicas}"] = (
                    ROOT, {"NEXTSTEP_REDIS_CLIENT": "redis-py",
                           "NEXTSTEP_REDIS_WAIT_REPLICAS": str(args.wait_replicas)})
            bases = {name: start_service(procs, work, name.replace(" ", "_"), code, artifacts, url, extra)
                     for name, (code, extra) in variants.items()}
            script = work / "c1.lua"
            script.write_text(sl.events_lua(question_ids, n_cats, "c1", 1))
            for base in bases.values():  # warm-up
                sl.run_wrk(f"{base}/v1/kt/{sl.MODEL}/events", script, 1, 1, 1)
            runs: dict[str, list[dict]] = {name: [] for name in bases}
            for r in range(args.rounds):
                for name, base in bases.items():
                    res = sl.run_wrk(f"{base}/v1/kt/{sl.MODEL}/events", script, 1, 1, args.duration)
                    runs[name].append({k: res[k] for k in ("p50_us", "p99_us", "rps", "errors")})
                print(f"round {r + 1}: " + ", ".join(f"{n} p50 {runs[n][-1]['p50_us'] / 1000:.3f} ms"
                                                     for n in bases), flush=True)
            print(f"\nPOST /v1/kt/{sl.MODEL}/events, wrk -t1 -c1, {args.duration:g} s x {args.rounds} rounds, "
                  "variants interleaved; median of the rounds:")
            summary = {}
            for name, rows in runs.items():
                summary[name] = {k: statistics.median(row[k] for row in rows) for k in ("p50_us", "p99_us", "rps")}
                summary[name]["errors"] = sum(row["errors"] for row in rows)
                print(f"  {name:22s} p50 {summary[name]['p50_us'] / 1000:.3f} ms  p99 "
                      f"{summary[name]['p99_us'] / 1000:.3f} ms  {summary[name]['rps']:.0f} req/s  "
                      f"errors {summary[name]['errors']}")
            results["http"] = {"summary": summary, "rounds": runs, "artifact": origin}
        finally:
            procs.stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
