"""One route of two code trees called in process, interleaved: each tree's app in a worker process of its own (its code
on PYTHONPATH, the in-process state store: no sockets, no Redis), batches of calls alternating between the workers,
so that this machine's slow and fast spells fall on both alike. What it isolates is the service's own Python and
ONNX Runtime work for a request.

    python bench/route_ab.py OLD_TREE NEW_TREE [--task kt|session|srs] [--rounds 20] [--calls 300] [--artifact DIR]
                             [--second-env NAME=VALUE ...]

kt: POST /v1/kt/deep_gpcm/events (one event, one prediction, 20 students in turn), each tree's bundled demo
deep_gpcm. session: POST /v1/sessions/gru4rec/events (one click, recommend_k 20, 20 sessions in turn), each tree's
bundled demo gru4rec. srs: POST /v1/srs/time_aware/predict (10 users of 300 reviews each over 100 cards, loaded
first: full windows), one time-aware export for both trees: `--artifact` (an srs artifact directory), else one made
here as bench/srs_load.py makes its own (window 64, card window 16, random weights). Prints the median over rounds
of each worker's per-round median and CPU time per call (the process's, every thread: what a call leaves to the
executor, such as live quality's scoring, counts too), and the median of the per-round ratios (paired). The two
workers are alike but not the same process: run the trees in both orders (or a tree against itself) to see how far
the order alone moves it. `--second-env` sets an environment variable for the second worker only: a tree against
itself with one setting changed (`. . --second-env NEXTSTEP_LIVE_QUALITY=false`).
"""

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

HERE = Path(__file__).resolve().parent


async def call(app, path: str, body: dict) -> None:
    data = json.dumps(body).encode()
    sent = []
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "app": app,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]}

    async def receive():
        return {"type": "http.request", "body": data, "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    if sent[0]["status"] != 200:
        raise SystemExit(f"{path}: status {sent[0]['status']}: {sent}")


async def worker(task: str, artifacts: Path) -> None:
    """Load the app, then for each line N on stdin make N calls and print their median and the process's CPU time per
    call (every thread's: work the calls left to the executor counts too), in microseconds."""
    from nextstep.service.app import create_app
    from nextstep.service.settings import Settings

    sys.path.insert(0, str(HERE))
    import srs_load

    app = create_app(Settings(artifacts_dir=artifacts, redis_url=None))
    async with app.router.lifespan_context(app):
        if task == "kt":
            vocab = app.state.registry.get("deep_gpcm").ids
            path = "/v1/kt/deep_gpcm/events"

            def body(i: int) -> dict:
                return {"student_id": f"s{i % 20}", "predict_question_ids": [vocab[(i + 1) % len(vocab)]],
                        "events": [{"question_id": vocab[i % len(vocab)], "response": i % 4, "event_id": f"e{i}"}]}
        elif task == "session":
            items = app.state.registry.get("gru4rec").ids
            path = "/v1/sessions/gru4rec/events"

            def body(i: int) -> dict:
                return {"session_id": f"s{i % 20}", "events": [{"item_id": items[i * 13 % len(items)]}],
                        "recommend_k": 20}
        else:
            now = time.time()
            for u in range(10):
                await call(app, "/v1/srs/time_aware/reviews",
                           {"user_id": f"u{u}", "reviews": srs_load.user_reviews(u, 300, now)})
            path = "/v1/srs/time_aware/predict"

            def body(i: int) -> dict:
                card = i * 13 % srs_load.CARDS
                return {"user_id": f"u{i % 10}", "card_id": f"card-{card}", "deck_id": f"deck-{card % srs_load.DECKS}"}
        print("ready", flush=True)
        i = 0
        for line in sys.stdin:
            times, cpu = [], time.process_time()
            for _ in range(int(line)):
                i += 1
                start = time.perf_counter()
                await call(app, path, body(i))
                times.append(time.perf_counter() - start)
            print(statistics.median(times) * 1e6, (time.process_time() - cpu) / len(times) * 1e6, flush=True)


def artifacts_for(task: str, tree: Path, given: str | None, work: Path) -> Path:
    """An artifacts root holding the model the worker serves."""
    root = work / tree.name / "artifacts"
    if task in ("kt", "session"):
        model = "deep_gpcm" if task == "kt" else "gru4rec"
        (root / model).mkdir(parents=True)
        (root / model / "demo").symlink_to(tree / "nextstep" / "demo_artifacts" / model / "demo")
        return root
    (root / "time_aware").mkdir(parents=True)
    (root / "time_aware" / "bench").symlink_to(Path(given).resolve())
    return root


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trees", nargs=2, type=Path)
    parser.add_argument("--task", choices=("kt", "session", "srs"), default="kt")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--calls", type=int, default=300, help="calls per worker per round")
    parser.add_argument("--artifact", help="srs: a time-aware artifact directory (default: export one here)")
    parser.add_argument("--second-env", action="append", default=[], metavar="NAME=VALUE",
                        help="an environment variable of the second worker only (repeatable)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # (task, artifacts root): a worker's own run
    args = parser.parse_args()
    if args.worker:
        asyncio.run(worker(args.worker[0], Path(args.worker[1])))
        return 0
    with tempfile.TemporaryDirectory(prefix="route-ab-") as tmp:
        work = Path(tmp)
        given = args.artifact
        if args.task == "srs" and not given:
            import srs_load

            given = str(work / "export")
            subprocess.run([sys.executable, "-c", srs_load.BUILD, given, "64", "16"], check=True, capture_output=True)
        second = dict(item.split("=", 1) for item in args.second_env)
        workers = []
        for n, tree in enumerate(args.trees):
            tree = tree.resolve()
            root = artifacts_for(args.task, tree, given, work / str(n))
            workers.append(subprocess.Popen(
                [sys.executable, __file__, "a", "b", "--worker", args.task, str(root)], cwd=tmp, text=True,
                env={**os.environ, "PYTHONPATH": str(tree), **(second if n else {})}, stdin=subprocess.PIPE,
                stdout=subprocess.PIPE))
        try:
            for w in workers:
                if w.stdout.readline().strip() != "ready":
                    raise SystemExit("a worker did not start")
            medians, cpus = [[], []], [[], []]
            for r in range(args.rounds):
                for k in ((0, 1) if r % 2 == 0 else (1, 0)):
                    workers[k].stdin.write(f"{args.calls}\n")
                    workers[k].stdin.flush()
                    median, cpu = map(float, workers[k].stdout.readline().split())
                    medians[k].append(median)
                    cpus[k].append(cpu)
        finally:
            for w in workers:
                w.stdin.close()
                w.wait()
    print(f"{args.task}: {args.rounds} rounds of {args.calls} calls per tree, in process; medians over rounds")
    for tree, values, cpu in zip(args.trees, medians, cpus, strict=True):
        print(f"  {str(tree):30s} {statistics.median(values):8.1f} us   CPU {statistics.median(cpu):8.1f} us a call")
    for what, pair in (("median", medians), ("CPU", cpus)):
        paired = statistics.median(b / a for a, b in zip(*pair, strict=True))
        print(f"  {args.trees[1]} / {args.trees[0]}, {what}: "
              f"{statistics.median(pair[1]) / statistics.median(pair[0]):.3f}x (paired {paired:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
