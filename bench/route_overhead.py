"""What one stateful request costs inside the service, without sockets: a KT event (one event + one prediction)
called straight into the ASGI app, through the router alone, and into the route's own handler, with the
in-process state store. The differences are the cost of the middleware stack and of routing.

    python bench/route_overhead.py [--artifact DIR] [--calls 4000]

Without --artifact it trains a tiny deep_gpcm on generated data first (about 10 s). Medians of the last two thirds
of the calls, in microseconds.
"""

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from nextstep.service.app import create_app
from nextstep.service.settings import Settings

PATH = "/v1/kt/{model}/events"


def _artifacts(given: str | None) -> tuple[Path, str]:
    if given:
        path = Path(given)
        return path.parent.parent, path.parent.name
    from nextstep.training.kt.loop import TrainConfig
    from nextstep.training.kt.run import train_model
    from nextstep.training.kt.synthetic import write_gpcm_dataset

    root = Path(tempfile.mkdtemp(prefix="route-overhead-"))
    data = write_gpcm_dataset(root / "data", n_students=40, n_questions=12, seq_len_range=(10, 15), seed=3)
    train_model("deep_gpcm", data, root / "artifacts" / "deep_gpcm" / "1", cfg=TrainConfig(epochs=1),
                progress=False, log=False)
    return root / "artifacts", "deep_gpcm"


async def measure(artifacts: Path, model: str, calls: int) -> dict[str, float]:
    app = create_app(Settings(artifacts_dir=artifacts, redis_url=None))
    async with app.router.lifespan_context(app):
        vocab = app.state.registry.get(model).ids
        route = next((r for r in app.router.routes if getattr(r, "path", "") == PATH), None)
        layers = {"whole app": app}
        if route is not None:  # (a service whose routes sit in a nested router: the whole app only)
            layers.update({"router": app.router, "route handler": lambda scope, receive, send: route.handle(
                {**scope, "path_params": {"model": model}}, receive, send)})
        result = {}
        for label, target in layers.items():
            times = []
            for i in range(calls):
                body = json.dumps({"student_id": f"s{i % 50}", "predict_question_ids": [vocab[1]], "events": [
                    {"question_id": vocab[0], "response": 1, "event_id": f"{label}-{i}"}]}).encode()
                path = PATH.format(model=model)
                scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
                         "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
                         "query_string": b"", "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "app": app,
                         "headers": [(b"content-type", b"application/json"),
                                     (b"content-length", str(len(body)).encode())]}
                sent = []

                async def receive(body=body):
                    return {"type": "http.request", "body": body, "more_body": False}

                async def send(message, sent=sent):
                    sent.append(message)

                start = time.perf_counter()
                await target(scope, receive, send)
                times.append(time.perf_counter() - start)
                if sent[0]["status"] != 200:
                    raise SystemExit(f"{label}: status {sent[0]['status']}: {sent}")
            result[label] = statistics.median(times[calls // 3:]) * 1e6
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--artifact", help="a knowledge-tracing artifact directory (ARTIFACTS/NAME/VERSION)")
    parser.add_argument("--calls", type=int, default=4000)
    args = parser.parse_args()
    artifacts, model = _artifacts(args.artifact)
    result = asyncio.run(measure(artifacts, model, args.calls))
    for label, micros in result.items():
        print(f"  {label:14s} {micros:7.1f} us per KT event (median)")
    if "router" in result:
        print(f"  middleware stack {result['whole app'] - result['router']:.1f} us, routing "
              f"{result['router'] - result['route handler']:.1f} us")


if __name__ == "__main__":
    main()
