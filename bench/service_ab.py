"""Knowledge-tracing events of two or more code trees, interleaved: each tree's own service and demo deep_gpcm, run
side by side, and short wrk runs that alternate between them, so that this machine's slow and fast spells fall on
every tree alike.

    python bench/service_ab.py OLD_TREE NEW_TREE [...] [--rounds 20] [--duration 1]

A tree is a checkout of this repository (`git worktree add /tmp/old 182efa6`); its service runs with the tree on
PYTHONPATH and its bundled nextstep/demo_artifacts/deep_gpcm/demo, over a redis-server of its own
(bench/service_load.py's machinery: one worker, no persistence, no keys). After 2 s of warm-up each, every round
runs, per tree (the order reversed every other round), POST /v1/kt/deep_gpcm/events (one event, one prediction) at 1
connection, then at 32. Prints per tree the median over rounds of the 1-connection p50 and of req/s at 32
connections, and for each tree after the first its ratios to the first: of the medians, and the median of the
per-round ratios (paired: the runs of one round are seconds apart).
"""

import argparse
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

import service_load as sl

EVENTS = "/v1/kt/deep_gpcm/events"


@contextlib.contextmanager
def environment(**values):
    saved = dict(os.environ)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs="+", type=Path)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--duration", type=float, default=1.0, help="seconds per wrk run")
    args = parser.parse_args()
    procs = sl.Processes()
    with tempfile.TemporaryDirectory(prefix="service-ab-") as tmp:
        try:
            served = []
            for n, tree in enumerate(args.trees):
                work = Path(tmp) / f"tree{n}"
                work.mkdir()
                root, art, _ = sl.prepare_artifacts(str(tree.resolve() / "nextstep/demo_artifacts/deep_gpcm/demo"),
                                                    work)
                questions, n_cats = sl.artifact_vocab(art)
                port, _ = sl.start_redis(procs, work)
                with environment(PYTHONPATH=str(tree.resolve())):
                    base, _ = sl.start_service(procs, work, root, port)
                one, many = work / "c1.lua", work / "c32.lua"
                one.write_text(sl.events_lua(questions, n_cats, "c1", 1))
                many.write_text(sl.events_lua(questions, n_cats, "c32", 64))
                sl.run_wrk(base + EVENTS, many, 2, 32, 2)  # warm-up
                served.append((base, one, many))
            p50 = [[] for _ in served]
            rps = [[] for _ in served]
            for r in range(args.rounds):
                order = range(len(served)) if r % 2 == 0 else reversed(range(len(served)))
                for n in order:
                    base, one, many = served[n]
                    p50[n].append(sl.run_wrk(base + EVENTS, one, 1, 1, args.duration)["p50_us"])
                    rps[n].append(sl.run_wrk(base + EVENTS, many, 2, 32, args.duration)["rps"])
                    print(f"round {r + 1} {str(args.trees[n]):30s} p50 {p50[n][-1]:6.0f} us   {rps[n][-1]:6.0f} req/s",
                          flush=True)
        finally:
            procs.stop_all()
    print(f"{args.rounds} rounds of {args.duration:g} s per run; medians over rounds")
    for n, tree in enumerate(args.trees):
        print(f"  {str(tree):30s} p50 at 1 connection {statistics.median(p50[n]):6.0f} us   "
              f"req/s at 32 connections {statistics.median(rps[n]):6.0f}")
    for n in range(1, len(args.trees)):
        paired_p50 = statistics.median(a / b for a, b in zip(p50[n], p50[0], strict=True))
        paired_rps = statistics.median(a / b for a, b in zip(rps[n], rps[0], strict=True))
        print(f"  {args.trees[n]} / {args.trees[0]}: p50 {statistics.median(p50[n]) / statistics.median(p50[0]):.3f}x "
              f"(paired {paired_p50:.3f}x), req/s {statistics.median(rps[n]) / statistics.median(rps[0]):.3f}x "
              f"(paired {paired_rps:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
