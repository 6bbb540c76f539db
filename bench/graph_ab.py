"""Two ONNX Runtime sessions of one graph (two exports of the same model) timed alternately: the shared part of
bench/kt_graph_ab.py and bench/srs_predict_graph.py --compare, which differ only in how they feed a graph."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from nextstep.service.registry import session_options


def median_us(session: ort.InferenceSession, feed: dict, calls: int) -> float:
    for _ in range(50):
        session.run(None, feed)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def open_pair(old: Path, new: Path, name: str) -> tuple[dict[str, ort.InferenceSession], dict[str, int]]:
    """({"old", "new"}: the graph `name` of each artifact opened with the service's session options, its nodes)."""
    sessions, nodes = {}, {}
    for label, folder in (("old", old), ("new", new)):
        path = folder / f"{name}.onnx"
        sessions[label] = ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])
        nodes[label] = len(onnx.load(str(path)).graph.node)
    return sessions, nodes


def alternate(sessions: dict[str, ort.InferenceSession], feeds: dict[str, dict], calls: int, rounds: int
              ) -> tuple[float, dict[str, list[float]], float]:
    """(the largest difference between the two sessions' outputs, each round's median us per label, the median of
    the per-round new/old ratios); which goes first alternates round by round."""
    a, b = (sessions[k].run(None, feeds[k]) for k in ("old", "new"))
    diff = max(float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) for x, y in zip(a, b, strict=True))
    runs = {"old": [], "new": []}
    for r in range(rounds):
        for label in ("old", "new") if r % 2 == 0 else ("new", "old"):
            runs[label].append(median_us(sessions[label], feeds[label], calls))
    return diff, runs, statistics.median(n / o for o, n in zip(runs["old"], runs["new"], strict=True))
