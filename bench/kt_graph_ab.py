"""Two knowledge-tracing artifacts' graphs in ONNX Runtime alone, interleaved: what an export change does to the one
call a served event pays for, without HTTP, Redis or the service's Python.

    python bench/kt_graph_ab.py OLD NEW [--graphs step_predict step predict] [--calls 2000] [--rounds 6]

OLD and NEW are artifact directories of the same family and sizes (the bundled deep_gpcm demo of two checkouts, say:
`git worktree add /tmp/old 3b552d6`, then OLD = /tmp/old/nextstep/demo_artifacts/deep_gpcm/demo). Each graph is
opened with the service's session options (one intra-op thread, every graph optimisation) and fed as one served
event feeds it: batch 1, the artifact's initial state (its state_*.npy), question and response 1 (any known id and
category), one question asked. Per round the two sessions run --calls calls each (which goes first alternates); prints
each graph's nodes, the largest difference between the two answers, each round's median and the median of the
NEW/OLD ratios (paired: the two runs of a round are a second apart).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np
import onnxruntime as ort
from graph_ab import alternate, open_pair  # bench/ (the script's directory is on sys.path)


def feed(artifact: Path, session: ort.InferenceSession) -> dict[str, np.ndarray]:
    state = {s["name"]: np.load(artifact / s["file"])[None] for s in json.loads(
        (artifact / "manifest.json").read_text())["state"]}
    out = {}
    for i in session.get_inputs():
        if i.name in state:
            out[i.name] = state[i.name]
        elif i.type != "tensor(int64)":
            raise SystemExit(f"{artifact}: input {i.name} ({i.type}) is neither a state nor an index")
        else:  # an event's question or response (batch), or the questions asked (batch, n)
            out[i.name] = np.ones([1] * len(i.shape), np.int64)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("old", type=Path)
    parser.add_argument("new", type=Path)
    parser.add_argument("--graphs", nargs="+", default=["step_predict", "step", "predict"])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    for name in args.graphs:
        sessions, nodes = open_pair(args.old, args.new, name)
        inputs = {label: feed(folder, sessions[label]) for label, folder in (("old", args.old), ("new", args.new))}
        diff, runs, ratio = alternate(sessions, inputs, args.calls, args.rounds)
        print(f"{name:13s} nodes {nodes['old']:4d} -> {nodes['new']:4d}; max |new - old| {diff:.1e}; median us: "
              f"old {statistics.median(runs['old']):.1f}, new {statistics.median(runs['new']):.1f}; "
              f"new/old paired {ratio:.3f}", flush=True)


if __name__ == "__main__":
    main()
