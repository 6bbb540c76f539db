"""What live quality costs an event (issue 35, part 1), in process, without HTTP or Redis noise:

1. ONNX Runtime alone, on the bundled deep_gpcm demo artifact: the `predict`, `step_predict` and the service's
   scored `step_predict` graph (nextstep/service/kt/scored.py: `predict` asked for the event's own question, then
   `step_predict`, as one graph): what one call saves against two.
2. `KnowledgeTracer.absorb` of one event with one prediction asked (what bench/service_load.py sends), interleaved
   rounds over the in-process store, median per event: live quality off; on (the service's way: the scored graph
   steps and scores the event in one call); and on without scored graphs (a job after each answer runs the
   `predict` call in the engines' executor: how a model without them is scored). Every event is checked to have
   been scored.

    python bench/live_quality_cost.py [--rounds 3] [--events 3000]
"""

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "nextstep" / "demo_artifacts"


def graphs(repeats: int) -> dict:
    from nextstep.service.registry import load_artifact
    from nextstep.service.writes import batched

    model = load_artifact(DEMO / "deep_gpcm" / "demo", scored=True)
    state = batched(model.initial_state)
    q, r, qs = np.array([2]), np.array([1]), np.array([[3]])
    feeds = {"predict": {**state, "questions": q[:, None]},
             "step_predict": {**state, "question": q, "response": r, "questions": qs},
             "scored_step_predict": {**state, "question": q, "response": r, "questions": qs}}
    out = {}
    for name, feed in feeds.items():
        session = model.sessions[name]
        for _ in range(200):
            session.run(None, feed)
        t0 = time.perf_counter()
        for _ in range(repeats):
            session.run(None, feed)
        out[name] = (time.perf_counter() - t0) / repeats * 1e6
    return out


async def absorb(rounds: int, events: int) -> dict:
    from nextstep.service.kt.service import Event, KnowledgeTracer
    from nextstep.service.memory_store import InProcessStore
    from nextstep.service.metrics import Metrics
    from nextstep.service.quality import Quality
    from nextstep.service.registry import ModelRegistry
    from nextstep.service.runtime import Engines

    registries = {"scored": ModelRegistry(DEMO, scored_graphs=True), "apart": ModelRegistry(DEMO)}
    for registry in registries.values():
        registry.reload()
    engines = Engines(64, 0.0)
    metrics = Metrics()
    ids = registries["apart"].get("deep_gpcm").ids
    medians: dict[str, list[float]] = {"off": [], "on": [], "on, a job after the answer": []}
    try:
        for _ in range(rounds):
            for side in medians:
                registry = registries["scored" if side == "on" else "apart"]
                quality = Quality(None, on_record=metrics.on_live_scores) if side != "off" else None
                if quality is not None:
                    await quality.start()  # (its worker scores after each answer, as in the service)
                tracer = KnowledgeTracer(registry, InProcessStore(ttl_seconds=None), engines, quality=quality)
                took = []
                for i in range(events):
                    t0 = time.perf_counter()
                    await tracer.absorb("deep_gpcm", f"s{i % 50}", [Event(str(ids[i % len(ids)]), i % 4)],
                                        [str(ids[(i + 1) % len(ids)])])
                    took.append(time.perf_counter() - t0)
                medians[side].append(statistics.median(took[events // 6:]) * 1e6)
                if quality is not None:
                    await quality.drain()
                    scored = (await quality.report("deep_gpcm", [("demo", "serving")], 3600))[0]["scored"]
                    if scored != events:
                        raise SystemExit(f"scored {scored} of {events} events")
                    await quality.close()
    finally:
        await engines.close()
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3000, help="calls per graph (default 3000)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    g = graphs(args.repeats)
    print("ONNX Runtime, mean per call (us): " + ", ".join(f"{k} {v:.0f}" for k, v in
                                                                                g.items()))
    print(f"  predict + step_predict as two calls: {g['predict'] + g['step_predict']:.0f} us; scored graph: "
          f"{g['scored_step_predict']:.0f} us")
    m = asyncio.run(absorb(args.rounds, args.events))
    print("absorb of one event with one prediction, in process (median per event, us): "
          + "; ".join(f"{side} {[round(x) for x in v]}" for side, v in m.items()))
    off = statistics.median(m["off"])
    for side in list(m)[1:]:
        on = statistics.median(m[side])
        print(f"  median of rounds: off {off:.0f} us, {side} {on:.0f} us: +{on - off:.0f} us "
              f"({(on / off - 1) * 100:+.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
