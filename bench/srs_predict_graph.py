"""What the flashcard `predict` graph costs in ONNX Runtime alone, by how many of the card's own reviews it reads
FSRS-6's state from (`card_window`): FSRS-6's recurrence runs inside the graph, one unrolled step per review.

For each card window, a time-aware model of the given sizes (random weights, which do not change the cost) is exported
through the real export (parity checks included) into a temporary folder, and its `predict` graph is timed with the
service's session options (one intra-op thread, every graph optimisation): batch 1, a full window whose last
`card_window` rows include the query card's reviews, median of --calls calls, --rounds rounds interleaved.

    python bench/srs_predict_graph.py [--card-windows 1 4 16] [--sizes '{"d_model": 16, ...}'] [--calls 500]
                                      [--rounds 2]
    python bench/srs_predict_graph.py --compare OLD NEW [--calls 500] [--rounds 6]
    python bench/srs_predict_graph.py --node-floor [--calls 500]

Default sizes: the bundled demo's (window 32, d_model 16, one layer). Prints nodes and median microseconds per
card window, of `predict` and of its twin `predict_memory`, which takes the card's FSRS-6 memory as an input (the
service computes it with fsrs-rs, nextstep/srs/card_memory.py) instead of running the recurrence, and predict's cost per
review of the card (a straight line through the first and last). About a minute an export on this machine.

`--compare OLD NEW` times two existing exports of the same model (`nextstep export OLD --out NEW` with another
version of the exporter, say) instead: `predict`, `predict_memory` and `schedule` (retention 0.9) of each, on the
same feeds, the two alternating within each round (which goes first alternates too); prints nodes, each round's
median and the median of the NEW/OLD ratios.

`--node-floor` times chains of 1, 300 and 600 elementwise nodes on a (1, 64) tensor: what a node costs when its work
is nothing, so how much of a graph's time its node count alone sets.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch
from graph_ab import alternate, median_us, open_pair  # bench/ (the script's directory is on sys.path)

from nextstep.models.time_aware import TimeAwareConfig, TimeAwareTransformer, Window
from nextstep.service.registry import session_options
from nextstep.srs.card_memory import card_memory
from nextstep.training.srs.time_aware_export import export_time_aware

DEMO_SIZES = {"d_model": 16, "n_layers": 1, "card_heads": 2, "deck_heads": 1, "global_heads": 1, "ffn_dim": 32,
              "t2v_dim": 4, "window": 32}


def reviews(batch: int, length: int, seed: int = 0) -> Window:
    """Review sequences in time order over a few cards and decks (what the export's parity checks walk)."""
    g = torch.Generator().manual_seed(seed)
    card = torch.randint(0, 12, (batch, length), generator=g)
    t = 1.7e9 + torch.sort(torch.rand(batch, length, generator=g, dtype=torch.float64) * 200 * 86400, -1).values
    return Window(card, card % 3, t, torch.randint(1, 5, (batch, length), generator=g),
                  torch.rand(batch, length, generator=g) * 20, torch.randint(0, 4, (batch, length), generator=g),
                  torch.ones(batch, length, dtype=torch.bool))


def export(sizes: dict, out: Path) -> TimeAwareTransformer:
    torch.manual_seed(0)
    model = TimeAwareTransformer(TimeAwareConfig(**sizes)).eval()
    with torch.no_grad():  # corrections away from zero, so that no branch of the graph is constant
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    export_time_aware(model, out, manifest={"name": "bench", "version": "1", "family": "time_aware", "task": "srs"},
                      sequence=reviews(2, model.cfg.window))
    return model


def feeds(model: TimeAwareTransformer, session: ort.InferenceSession) -> dict[str, np.ndarray]:
    H, C = model.cfg.window, model.cfg.card_window
    rng = np.random.default_rng(0)
    t = 1.7e9 + np.sort(rng.uniform(0, 200 * 86400, H))
    card = rng.integers(100, 140, H)
    card[H - 2 * C::2] = 7  # C of the query card's reviews among the latest rows
    f = {"hist_card": card, "hist_deck": card % 3, "hist_time": t, "hist_rating": rng.integers(1, 5, H),
         "hist_duration": rng.uniform(2, 20, H).astype(np.float32), "hist_state": rng.integers(0, 4, H),
         "hist_valid": np.ones(H, bool), "hist_error": rng.uniform(-0.5, 0.5, H).astype(np.float32)}
    f = {k: v[None] for k, v in f.items()}
    f.update(drift=np.float32([[-0.3, 4.0]]), fsrs_w=model.fsrs_w.float().numpy()[None], card=np.int64([7]),
             deck=np.int64([1]), time=np.float64([t[-1] + 5 * 86400]), day_start=np.float64([4 * 3600.0]),
             evidence=np.float32([0.5]))  # (the mixture with FSRS-6's defaults: both forecasters count)
    kept = {i.name for i in session.get_inputs()}
    return {k: v for k, v in f.items() if k in kept}


def memory_feed(model: TimeAwareTransformer, session: ort.InferenceSession, feed: dict) -> dict:
    """`feed` plus the query card's FSRS-6 memory (and the defaults' stability), as the service computes them, where
    the session takes them (`predict_memory`)."""
    kept = {i.name for i in session.get_inputs()}
    if "memory" not in kept:
        return feed
    h, c = {k: v[0] for k, v in feed.items()}, model.cfg.card_window
    rows = h["hist_card"], h["hist_time"], h["hist_rating"], 7
    feed = {**feed, "memory": np.float32([card_memory(*rows, h["fsrs_w"], float(h["day_start"]), c)])}
    if "default_stability" in kept:  # (with the mixture)
        default = card_memory(*rows, model.fsrs_w.float().numpy(), float(h["day_start"]), c)
        feed["default_stability"] = np.float32([default[0]])
    return feed


def compare(old: Path, new: Path, calls: int, rounds: int) -> None:
    from nextstep.training.srs.time_aware_export import restore_time_aware

    saved = torch.load(old / "weights.pt", weights_only=True)
    model = restore_time_aware(saved["family"], saved["config"], saved["state_dict"]).eval()
    for name in ("predict", "predict_memory", "schedule"):
        sessions, nodes = open_pair(old, new, name)
        feed = memory_feed(model, sessions["old"], feeds(model, sessions["old"]))
        if name == "schedule":
            feed = {**feed, "retention": np.float32([0.9])}
        diff, runs, ratio = alternate(sessions, {k: {i.name: feed[i.name] for i in s.get_inputs()}
                                                 for k, s in sessions.items()}, calls, rounds)
        print(f"{name:14s} nodes {nodes['old']:5d} -> {nodes['new']:5d}; max |new - old| {diff:.1e}; median us: "
              f"old {', '.join(f'{x:.0f}' for x in runs['old'])}; new {', '.join(f'{x:.0f}' for x in runs['new'])}; "
              f"new/old {ratio:.3f}", flush=True)


def node_floor(calls: int, rounds: int) -> None:
    """What a node costs ONNX Runtime when its work is nothing: chains of 1, 300 and 600 elementwise nodes (Add, Mul,
    Sub by turns, a constant operand) on a (1, 64) float32, the service's session options but no graph optimisation
    (nothing to fold away), alternating; the slope per node, the floor under a graph of that many nodes."""
    import onnx.helper as oh

    def chain(n: int) -> bytes:
        nodes, prev = [], "x"
        for i in range(n):
            nodes.append(oh.make_node(("Add", "Mul", "Sub")[i % 3], [prev, "c"], [f"y{i}"]))
            prev = f"y{i}"
        graph = oh.make_graph(nodes, "chain", [oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1, 64])],
                              [oh.make_tensor_value_info(prev, onnx.TensorProto.FLOAT, [1, 64])],
                              [onnx.numpy_helper.from_array(np.full(64, 1.0001, np.float32), "c")])
        return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 17)]).SerializeToString()

    options = session_options(1)
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sessions = {n: ort.InferenceSession(chain(n), options, providers=["CPUExecutionProvider"]) for n in (1, 300, 600)}
    feed = {"x": np.ones((1, 64), np.float32)}
    runs = {n: [] for n in sessions}
    for r in range(rounds):
        for n in (sorted(sessions) if r % 2 == 0 else sorted(sessions, reverse=True)):
            runs[n].append(median_us(sessions[n], feed, calls))
    median = {n: statistics.median(x) for n, x in runs.items()}
    for n, x in runs.items():
        print(f"{n:4d} nodes: median {', '.join(f'{v:.1f}' for v in x)} us")
    print(f"per node: {(median[600] - median[1]) / 599:.3f} us (the floor of a 600-node graph: "
          f"{median[600] - median[1]:.0f} us beyond one call)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--compare", nargs=2, type=Path, metavar=("OLD", "NEW"),
                        help="time two exports of one model instead (artifact directories)")
    parser.add_argument("--node-floor", action="store_true",
                        help="what a node costs ONNX Runtime when its work is nothing (chains of 1 to 600 nodes)")
    parser.add_argument("--card-windows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--sizes", type=json.loads, default=DEMO_SIZES, help="TimeAwareConfig fields, as JSON")
    parser.add_argument("--calls", type=int, default=500)
    parser.add_argument("--rounds", type=int, help="rounds (default 2; 6 with --compare)")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 6 if args.compare else 2
    torch.set_num_threads(1)
    if args.compare:
        return compare(*args.compare, args.calls, args.rounds)
    if args.node_floor:
        return node_floor(args.calls, max(args.rounds, 4))
    graphs = {}
    with tempfile.TemporaryDirectory(prefix="srs-predict-graph-") as tmp:
        for c in args.card_windows:
            model = export({**args.sizes, "card_window": c}, Path(tmp) / str(c))
            for name in ("predict", "predict_memory"):
                path = Path(tmp) / str(c) / f"{name}.onnx"
                session = ort.InferenceSession(str(path), session_options(1), providers=["CPUExecutionProvider"])
                feed = memory_feed(model, session, feeds(model, session))
                graphs[c, name] = (len(onnx.load(str(path)).graph.node), session, feed)
        runs = {key: [] for key in graphs}
        for _ in range(args.rounds):
            for key, (_, session, feed) in graphs.items():
                runs[key].append(median_us(session, feed, args.calls))
    for (c, name), (nodes, _, _) in graphs.items():
        print(f"card window {c:3d}, {name:14s}: {nodes:5d} nodes, median {', '.join(f'{x:.0f}' for x in runs[c, name])}"
              " us")
    lo, hi = min(args.card_windows), max(args.card_windows)
    if hi > lo:
        per_node = (graphs[hi, "predict"][0] - graphs[lo, "predict"][0]) / (hi - lo)
        per_us = (statistics.median(runs[hi, "predict"]) - statistics.median(runs[lo, "predict"])) / (hi - lo)
        print(f"predict, per review of the card: {per_node:.0f} nodes, {per_us:.1f} us")


if __name__ == "__main__":
    main()
