"""Knowledge-tracing events (or session clicks) of two or more code trees, interleaved: each tree's own service and
demo model, run side by side, and short wrk runs that alternate between them, so that this machine's slow and fast
spells fall on every tree alike. `--second-env` sets an environment variable for the second tree's service only: a
tree against itself with one setting changed (`. . --task session --second-env NEXTSTEP_LIVE_QUALITY=false`).

    python bench/service_ab.py OLD_TREE NEW_TREE [...] [--rounds 20] [--duration 1] [--task kt|session]
                               [--second-env NAME=VALUE ...]

A tree is a checkout of this repository (`git worktree add /tmp/old 182efa6`); its service runs with the tree on
PYTHONPATH and its bundled nextstep/demo_artifacts/deep_gpcm/demo, over a redis-server of its own
(bench/service_load.py's machinery: one worker, no persistence, no keys). After 2 s of warm-up each, every round
runs, per tree (the order reversed every other round), POST /v1/kt/deep_gpcm/events (one event, one prediction) at 1
connection, then at 32; with --task session, POST /v1/sessions/gru4rec/events (one click, recommend_k 20) on the
tree's demo gru4rec, sessions new to each run. Prints per tree the median over rounds of the 1-connection p50, of
req/s at 32 connections and of the CPU time a request took at 32 connections (the service's process, every thread,
plus its redis-server's), and for each tree after the first its ratios to the first: of the medians, and the median
of the per-round ratios (paired: the runs of one round are seconds apart). The CPU a request takes moves less with
the machine's spells than its wall-clock figures do: when they disagree, a throughput gap that the CPU does not show
is the machine's.
"""

import argparse
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

import service_load as sl
from session_load import artifact_items, clicks_lua

EVENTS = {"kt": "/v1/kt/deep_gpcm/events", "session": "/v1/sessions/gru4rec/events"}


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
    parser.add_argument("--task", choices=sorted(EVENTS), default="kt")
    parser.add_argument("--second-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable for the second tree's service only (a tree against itself "
                             "with one setting changed)")
    args = parser.parse_args()
    procs = sl.Processes()
    with tempfile.TemporaryDirectory(prefix="service-ab-") as tmp:
        try:
            served = []
            for n, tree in enumerate(args.trees):
                work = Path(tmp) / f"tree{n}"
                work.mkdir()
                if args.task == "kt":
                    root, art, _ = sl.prepare_artifacts(
                        str(tree.resolve() / "nextstep/demo_artifacts/deep_gpcm/demo"), work)
                else:
                    root, art = work / "artifacts", work / "artifacts/gru4rec/demo"
                    art.parent.mkdir(parents=True)
                    art.symlink_to(tree.resolve() / "nextstep/demo_artifacts/gru4rec/demo", target_is_directory=True)
                port, redis = sl.start_redis(procs, work)
                second = dict(item.split("=", 1) for item in args.second_env) if n == 1 else {}
                with environment(PYTHONPATH=str(tree.resolve()), **second):
                    base, service = sl.start_service(procs, work, root, port)
                one, many = work / "c1.lua", work / "c32.lua"
                if args.task == "kt":
                    questions, n_cats = sl.artifact_vocab(art)
                    one.write_text(sl.events_lua(questions, n_cats, "c1", 1))
                    many.write_text(sl.events_lua(questions, n_cats, "c32", 64))
                else:
                    one.write_text(clicks_lua(artifact_items(art), 1, fresh=True))
                    many.write_text(clicks_lua(artifact_items(art), 64, fresh=True))
                sl.run_wrk(base + EVENTS[args.task], many, 2, 32, 2)  # warm-up
                served.append((base, one, many, {"service": service.pid, "redis": redis.pid}))
            p50 = [[] for _ in served]
            rps = [[] for _ in served]
            cpu = [[] for _ in served]  # ms a request, service and Redis, at 32 connections
            for r in range(args.rounds):
                order = range(len(served)) if r % 2 == 0 else reversed(range(len(served)))
                for n in order:
                    base, one, many, pids = served[n]
                    single = sl.no_errors(sl.run_wrk(base + EVENTS[args.task], one, 1, 1, args.duration))
                    loaded = sl.no_errors(sl.run_wrk(base + EVENTS[args.task], many, 2, 32, args.duration, pids))
                    p50[n].append(single["p50_us"])
                    rps[n].append(loaded["rps"])
                    cpu[n].append(loaded["cpu_ms_per_request"]["service"] + loaded["cpu_ms_per_request"]["redis"])
                    print(f"round {r + 1} {str(args.trees[n]):30s} p50 {p50[n][-1]:6.0f} us   {rps[n][-1]:6.0f} req/s"
                          f"   CPU {cpu[n][-1]:.3f} ms a request", flush=True)
        finally:
            procs.stop_all()
    print(f"{args.rounds} rounds of {args.duration:g} s per run; medians over rounds")
    for n, tree in enumerate(args.trees):
        print(f"  {str(tree):30s} p50 at 1 connection {statistics.median(p50[n]):6.0f} us   "
              f"req/s at 32 connections {statistics.median(rps[n]):6.0f}   "
              f"CPU {statistics.median(cpu[n]):.3f} ms a request")
    for n in range(1, len(args.trees)):
        ratios = [f"{name} {statistics.median(x[n]) / statistics.median(x[0]):.3f}x (paired "
                  f"{statistics.median(a / b for a, b in zip(x[n], x[0], strict=True)):.3f}x)"
                  for name, x in (("p50", p50), ("req/s", rps), ("CPU a request", cpu))]
        print(f"  {args.trees[n]} / {args.trees[0]}: " + ", ".join(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
