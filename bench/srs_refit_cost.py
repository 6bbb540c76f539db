"""What the service's own refit of a flashcard user costs (issue 38, part 1), and what it costs the requests beside it.

1. Fit time: `fit_stored` (fsrs-rs, the protocol's fit) on the reviews the store keeps for a user (the recent
   block and each card's last `card_window` reviews, under the window given) of the first N reviews of a collection
   (--data: a review file or folder nextstep reads; default: a generated one), N from --sizes; in this process, and
   whether fsrs-rs holds the GIL while it fits: a thread that sleeps 1 ms in a loop records its longest wake-up gap
   during the fit (a gap as long as the fit: the GIL was held throughout).
2. The service's event loop during one refit of a big user: `SpacedRepetition.refit` of a user whose stored record
   holds what the store keeps of the first --big reviews (written straight into a real redis-server), with the fit
   in the service's fitting process (FitProcess) and in a thread; a coroutine that sleeps 1 ms in a loop records its
   longest wake-up gap (what every request of the replica would wait at worst).
3. Requests while it fits: the service (the bundled demo artifact, a real redis-server, one uvicorn worker, launched
   as its own process) with NEXTSTEP_SRS_REFIT_MIN_SCORED and _EVERY_SCORED at 1, so that every review written to
   the big user queues a refit of them; the big user holds the first --big reviews of the collection. One client
   thread writes a scored review of the big user in a loop (each write: a refit), another times
   POST /predict of a small user one after the other for --seconds. Three modes, interleaved over --rounds rounds:
   `off` (no refits: the baseline), `process` (the service's way: the fit in a process of its own) and `thread`
   (the fit in a thread of the service's process: fitting_process replaced, for this comparison only). Prints the
   predict latency (p50, p99, max) and the refits done (nextstep_srs_refits_total) per mode.

    python bench/srs_refit_cost.py [--data FILE_OR_DIR] [--sizes 1000,5000,38093] [--window 32,4] [--big 38093]
                                   [--seconds 10] [--rounds 2] [--json OUT]

Needs fsrs_rs_python and redis-server.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
from service_load import Processes, free_port, machine_info, run_in_tempdir, start_redis, tail

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "nextstep" / "demo_artifacts"
MODEL = "time_aware"
LAUNCH = """
import asyncio, sys
from nextstep.service import srs_refit
if sys.argv[1] == "thread":  # the comparison only: the service fits in a process of its own
    class InThread:
        pid = None
        async def fit(self, *args):
            return await asyncio.to_thread(srs_refit.fit_held, *args)
        async def close(self):
            pass
    srs_refit.FitProcess = InThread
from nextstep.service.server import run
from nextstep.service.settings import Settings
run(host="127.0.0.1", port=int(sys.argv[2]), workers=1, access_log=False, settings=Settings())
"""


def collection(path: str | None):
    from nextstep.training.srs.reviews import read_reviews, simulate_reviews

    if path:
        log = read_reviews(path)
        return log.take(np.arange(log.offsets[1]), log.user_ids[:1], log.offsets[:2]), path
    return simulate_reviews(n_users=1, n_cards=2000, n_days=400, reviews_per_day=100, seed=0), "generated"


def kept_rows(log, n: int, window: tuple[int, int]) -> np.ndarray:
    """The ROW rows the store keeps of the first n reviews: the last `size`, and each card's last `card_size`."""
    from nextstep.service.srs.stored import ROW

    size, card_size = window
    card = np.asarray(log.card[:n])
    rows = np.zeros(n, dtype=ROW)
    rows["seq"], rows["card"], rows["deck"] = np.arange(n), card, np.asarray(log.deck[:n])
    rows["time"], rows["rating"] = np.asarray(log.time[:n]), np.asarray(log.rating[:n])
    rows["duration"], rows["state"], rows["error"] = np.asarray(log.duration[:n]), np.asarray(log.state[:n]), np.nan
    order = np.lexsort((np.arange(n), card))
    rank_from_end = np.empty(n, dtype=np.int64)  # 0: the card's last review
    starts = np.r_[0, np.flatnonzero(np.diff(card[order])) + 1, n]
    for lo, hi in zip(starts[:-1], starts[1:], strict=True):
        rank_from_end[order[lo:hi]] = np.arange(hi - lo)[::-1]
    keep = (rank_from_end < card_size) | (np.arange(n) >= n - size)
    return rows[keep]


def longest_gap(fn) -> tuple[float, float]:
    """(seconds fn took, the longest wake-up gap in ms of a thread sleeping 1 ms in a loop meanwhile)."""
    gaps, stop = [], threading.Event()

    def ticker():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    thread = threading.Thread(target=ticker)
    thread.start()
    time.sleep(0.05)
    start = time.perf_counter()
    fn()
    took = time.perf_counter() - start
    stop.set()
    thread.join()
    return took, max(gaps) * 1e3


def fit_times(log, sizes: list[int], window: tuple[int, int], day_start: float) -> list[dict]:
    from nextstep.srs.stored_fit import fit_stored, review_log
    from nextstep.training.srs.eval import scored_mask

    out = []
    for n in sizes:
        n = min(n, len(log))
        rows = kept_rows(log, n, window)
        scored = int(scored_mask(review_log(rows, day_start)).sum())
        fit_stored(rows, day_start)  # (warm)
        runs = [longest_gap(lambda rows=rows: fit_stored(rows, day_start)) for _ in range(3)]
        took = statistics.median(r[0] for r in runs)
        gap = statistics.median(r[1] for r in runs)
        out.append({"reviews": n, "stored_rows": len(rows), "scored": scored, "fit_s": round(took, 4),
                    "longest_gap_ms": round(gap, 1)})
        print(f"  {n:>6} reviews -> {len(rows):>6} kept ({scored} scored): fit {took * 1e3:7.1f} ms, longest gap of "
              f"a 1 ms sleeper meanwhile {gap:6.1f} ms", flush=True)
    return out


def loop_stalls(log, big: int, redis_port: int, refits: int = 10) -> list[dict]:
    """Part 2: the longest event-loop stall during each of `refits` refits of the big user, per way of fitting."""
    import asyncio

    from nextstep.service.redis_store import RedisStore
    from nextstep.service.registry import ModelRegistry
    from nextstep.service.srs.refit import FitProcess
    from nextstep.service.srs.service import SpacedRepetition
    from nextstep.service.srs.stored import _encode

    registry = ModelRegistry(DEMO)
    registry.reload()
    model = registry.get(MODEL)
    size, card_size = model.extra.window
    rows = kept_rows(log, big, (size, card_size))
    fields = {f"c{c}": rows[rows["card"] == c][-card_size:].tobytes() for c in np.unique(rows["card"])}
    recent = rows[rows["seq"] > rows["seq"][-1] - size]

    async def stall(coro) -> tuple[float, float]:
        gaps, done = [], asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0.02)
        start = time.perf_counter()
        out = await coro
        took = time.perf_counter() - start
        done.set()
        await task
        assert out["refitted"], out
        return took, max(gaps) * 1e3

    async def main() -> list[dict]:
        store = RedisStore(f"redis://127.0.0.1:{redis_port}/0", ttl_seconds=None)
        srs = SpacedRepetition(registry, store, None)
        key = srs.key(model, "stall")
        await store.delete(key)
        assert await store.compare_and_set(key, 0, _encode(recent, len(fields), np.zeros(2), big), big, fields=fields)
        out = []
        process = FitProcess()
        try:
            srs.fitter = process
            took, gap = await stall(srs.refit(MODEL, "stall", force=True))
            print(f"  the first refit starts the fitting process: {took * 1e3:.0f} ms, longest event-loop stall "
                  f"{gap:.1f} ms", flush=True)
            for i in range(refits):  # interleaved: the machine's load moves
                for way, fitter in (("process", process), ("thread", None)):
                    srs.fitter = fitter
                    took, gap = await stall(srs.refit(MODEL, "stall", force=True))
                    out.append({"way": way, "refit": i, "s": round(took, 4), "longest_stall_ms": round(gap, 1)})
        finally:
            await process.close()
            await store.close()
        for way in ("process", "thread"):
            mine = [o for o in out if o["way"] == way]
            stalls = sorted(o["longest_stall_ms"] for o in mine)
            print(f"  {way:>7}: refit median {statistics.median(o['s'] for o in mine) * 1e3:5.0f} ms; longest "
                  f"event-loop stall median {statistics.median(stalls):5.1f} ms, max {stalls[-1]:5.1f} ms "
                  f"({len(mine)} refits)", flush=True)
        return out

    print(f"2. the event loop during a refit of a user of {big} reviews ({len(rows)} stored rows, {len(fields)} "
          f"cards; demo window {size},{card_size}):", flush=True)
    return asyncio.run(main())


def as_reviews(log, lo: int, hi: int) -> list[dict]:
    return [{"card_id": f"c{int(log.card[i])}", "deck_id": f"d{int(log.deck[i])}", "time": float(log.time[i]),
             "rating": int(log.rating[i])} for i in range(lo, hi)]


def refits(http) -> dict[str, float]:
    prefix = f'nextstep_srs_refits_total{{model="{MODEL}",outcome="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
            if line.startswith(prefix)}


def serve(procs: Processes, work: Path, mode: str, redis_port: int):
    import httpx

    port = free_port()
    env = dict(os.environ, NEXTSTEP_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0", NEXTSTEP_ARTIFACTS_DIR=str(DEMO),
               NEXTSTEP_SRS_REFIT="off" if mode == "off" else "auto", NEXTSTEP_SRS_REFIT_MIN_SCORED="1",
               NEXTSTEP_SRS_REFIT_EVERY_SCORED="1", NEXTSTEP_API_KEYS="", NEXTSTEP_LIVE_QUALITY="false")
    log = work / f"service-{mode}.log"
    proc = procs.start(f"service ({mode})", [sys.executable, "-c", LAUNCH, mode, str(port)], log, env=env, cwd=work)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the service exited:\n{tail(log)}")
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                return base, proc
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the service did not get ready:\n{tail(log)}")
        time.sleep(0.1)


def one_round(procs, work, mode: str, redis_port: int, log, big: int, seconds: float, user: str) -> dict:
    import httpx

    base, proc = serve(procs, work, mode, redis_port)
    try:
        with httpx.Client(base_url=base, timeout=30) as http:
            # the big user: loaded under `off` once (the reviews stay in Redis between rounds); a small user to predict
            if http.get(f"/v1/srs/{MODEL}/users/{user}").json()["reviews_total"] < big:
                for lo in range(0, big, 1000):
                    chunk = {"user_id": user, "reviews": as_reviews(log, lo, min(big, lo + 1000))}
                    reply = http.post(f"/v1/srs/{MODEL}/reviews", json=chunk)
                    assert reply.status_code == 200, reply.text
                small = {"user_id": "small", "reviews": as_reviews(log, 0, 50)}
                assert http.post(f"/v1/srs/{MODEL}/reviews", json=small).status_code == 200
            last = http.get(f"/v1/srs/{MODEL}/users/{user}").json()["last_review_time"]
            before = refits(http)
            stop = threading.Event()

            def writer():  # one scored review of the big user after another: each queues a refit of them
                nonlocal last
                with httpx.Client(base_url=base, timeout=30) as w:
                    i = 0
                    while not stop.is_set():
                        last += 86400.0 if i % 50 == 0 else 1.0
                        card = int(log.card[i % big])
                        reply = w.post(f"/v1/srs/{MODEL}/reviews", json={"user_id": user, "reviews": [
                            {"card_id": f"c{card}", "time": last, "rating": 3}]})
                        assert reply.status_code == 200, reply.text
                        i += 1
                        time.sleep(0.02)

            thread = threading.Thread(target=writer)
            thread.start()
            times = []
            t_end = time.monotonic() + seconds
            body = {"user_id": "small", "card_id": f"c{int(log.card[0])}", "deck_id": f"d{int(log.deck[0])}"}
            while time.monotonic() < t_end:
                start = time.perf_counter()
                reply = http.post(f"/v1/srs/{MODEL}/predict", json=body)
                times.append(time.perf_counter() - start)
                assert reply.status_code == 200, reply.text
            stop.set()
            thread.join()
            after = refits(http)
    finally:
        procs.procs.remove(next(p for p in procs.procs if p[1] is proc))
        proc.terminate()
        proc.wait(timeout=30)
        proc._bench_log.close()
    ms = np.array(times) * 1e3
    done = {k: after.get(k, 0) - before.get(k, 0) for k in set(after) | set(before)}
    return {"mode": mode, "requests": len(ms), "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2), "max_ms": round(float(ms.max()), 2), "refits": done}


def run(args, work: Path, procs: Processes) -> int:
    results = {"machine": machine_info()}
    log, source = collection(args.data)
    window = tuple(int(x) for x in args.window.split(","))
    print(f"collection: {source}, {len(log)} reviews; window (size, card_size) = {window}", flush=True)
    print("1. fit time (fit_stored, in this process):", flush=True)
    results["fits"] = fit_times(log, [int(s) for s in args.sizes.split(",")], window, 4.0)
    big = min(args.big, len(log))
    redis_port, _ = start_redis(procs, work)
    results["loop_stalls"] = loop_stalls(log, big, redis_port)
    print(f"3. predict latency while the service refits a user of {big} reviews again and again, "
          f"{args.seconds:g} s per mode and round:", flush=True)
    rounds = []
    for r in range(args.rounds):
        for mode in ("off", "process", "thread"):
            res = one_round(procs, work, mode, redis_port, log, big, args.seconds, "big")
            rounds.append({"round": r, **res})
            print(f"  round {r} {mode:>7}: {res['requests']:>5} predicts, p50 {res['p50_ms']:6.2f} ms, p99 "
                  f"{res['p99_ms']:6.2f} ms, max {res['max_ms']:7.2f} ms; refits {res['refits']}", flush=True)
    results["while_fitting"] = rounds
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="a review file or folder (default: a generated collection)")
    parser.add_argument("--sizes", default="1000,5000,38093", help="first N reviews to fit on, comma-separated")
    parser.add_argument("--window", default="32,4", help="size,card_size of the window the store keeps")
    parser.add_argument("--big", type=int, default=38093, help="reviews of the user the service refits")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    return run_in_tempdir(run, args, "srs-refit-", needs=("redis-server",))


if __name__ == "__main__":
    sys.exit(main())
