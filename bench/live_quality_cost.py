"""What live quality costs an event (issue 35, part 1; issue 58), in process, without HTTP or Redis noise:

1. ONNX Runtime alone, on the bundled deep_gpcm demo artifact: the `predict` graph per row at batches of 1, 8 and
   64 rows: what scoring single events together (quality.py `pend`: one call with a row per event) saves against a
   call per event.
2. `KnowledgeTracer.absorb` of one event with one prediction asked (what bench/service_load.py sends), interleaved
   rounds over the in-process store: median time per event and the process's CPU time per event (every thread: the
   scoring calls run in the engines' executor), live quality off and on. Every event is checked to have been
   scored.

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
DEMO = ROOT / "nextstep" / "demo_artifacts" / "deep_gpcm" / "demo"


def graphs(repeats: int) -> dict[int, float]:
    """Per batch size: microseconds per row of one `predict` call."""
    from nextstep.service.registry import load_artifact

    model = load_artifact(DEMO)
    session = model.sessions["predict"]
    out = {}
    for rows in (1, 8, 64):
        feeds = {name: np.repeat(value[None], rows, axis=0) for name, value in model.initial_state.items()}
        feeds["questions"] = np.full((rows, 1), 3, dtype=np.int64)
        for _ in range(100):
            session.run(None, feeds)
        t0 = time.perf_counter()
        for _ in range(repeats):
            session.run(None, feeds)
        out[rows] = (time.perf_counter() - t0) / repeats / rows * 1e6
    return out


async def absorb(rounds: int, events: int) -> dict[str, tuple[list[float], list[float]]]:
    """Per side (off, on): each round's median time per event and CPU time per event, microseconds."""
    from nextstep.service.kt.service import Event, KnowledgeTracer
    from nextstep.service.memory_store import InProcessStore
    from nextstep.service.metrics import Metrics
    from nextstep.service.quality import Quality
    from nextstep.service.registry import ModelRegistry
    from nextstep.service.runtime import Engines

    registry = ModelRegistry(DEMO.parent.parent)
    registry.reload()
    engines = Engines(64, 0.0)
    metrics = Metrics()
    ids = registry.get("deep_gpcm").ids
    out: dict[str, tuple[list[float], list[float]]] = {"off": ([], []), "on": ([], [])}
    try:
        for _ in range(rounds):
            for side, (medians, cpus) in out.items():
                quality = Quality(None, on_record=metrics.on_live_scores) if side == "on" else None
                if quality is not None:
                    await quality.start()  # (its worker scores after the answers, as in the service)
                tracer = KnowledgeTracer(registry, InProcessStore(ttl_seconds=None), engines, quality=quality)
                took, cpu = [], time.process_time()
                for i in range(events):
                    t0 = time.perf_counter()
                    await tracer.absorb("deep_gpcm", f"s{i % 50}", [Event(str(ids[i % len(ids)]), i % 4)],
                                        [str(ids[(i + 1) % len(ids)])])
                    took.append(time.perf_counter() - t0)
                if quality is not None:
                    await quality.drain()
                cpus.append((time.process_time() - cpu) / events * 1e6)
                medians.append(statistics.median(took[events // 6:]) * 1e6)
                if quality is not None:
                    scored = (await quality.report("deep_gpcm", [("demo", "serving")], 3600))[0]["scored"]
                    if scored != events:
                        raise SystemExit(f"scored {scored} of {events} events")
                    await quality.close()
    finally:
        await engines.close()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--events", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3000, help="calls per graph (default 3000)")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    per_row = graphs(args.repeats)
    print("ONNX Runtime, predict, per row (us): " + ", ".join(f"{rows} rows a call {us:.1f}"
                                                             for rows, us in per_row.items()))
    m = asyncio.run(absorb(args.rounds, args.events))
    for side, (medians, cpus) in m.items():
        print(f"absorb of one event with one prediction, live quality {side}: median per event "
              f"{[round(x) for x in medians]} us, CPU per event {[round(x) for x in cpus]} us (rounds)")
    (off, off_cpu), (on, on_cpu) = ((statistics.median(a), statistics.median(b)) for a, b in m.values())
    print(f"  medians of rounds: time {on:.0f} against {off:.0f} us off ({(on / off - 1) * 100:+.0f}%), "
          f"CPU {on_cpu:.0f} against {off_cpu:.0f} us ({(on_cpu / off_cpu - 1) * 100:+.0f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
