"""What an export costs, step by step: a time-aware model of the tests' sizes (random weights) exported through the
real harness (nextstep/training/export.py), with timers around its steps: the ONNX export of each graph (torch's
dynamo exporter and the graph's clean-up), the TorchScript trace, the parity check and the model's promises.

    python bench/export_time.py [--rewrite] [--sizes '{"d_model": 16, ...}']

`--rewrite` cleans the graphs up as the exporter does by default (`torch.onnx.export(optimize=True)`: onnxscript's
`optimize_ir`, its pattern rewrite rules included), the way export.py did before `optimize_graph`; run both at once,
one per core, to compare them (each is one thread). Prints the seconds of each step, the parity result and each
graph's nodes. About 3 minutes on this machine.
"""

import argparse
import collections
import json
import tempfile
import time
from pathlib import Path

import onnx
import torch

import nextstep.training.export as harness
from nextstep.models.time_aware import TimeAwareConfig, TimeAwareTransformer
from nextstep.training.srs.reviews import simulate_reviews
from nextstep.training.srs.time_aware_export import TimeAwareExporter, export_time_aware
from nextstep.training.srs.time_aware_loop import ReviewTensors
from nextstep.training.srs.time_aware_run import parity_inputs

TEST_SIZES = {"d_model": 16, "ffn_dim": 32, "window": 24, "card_window": 6}  # tests/training/srs/test_time_aware_run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rewrite", action="store_true", help="with onnxscript's rewrite rules (optimize=True)")
    parser.add_argument("--sizes", type=json.loads, default=TEST_SIZES, help="TimeAwareConfig fields, as JSON")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = collections.defaultdict(float)

    def timed(name, fn):
        def run(*a, **k):
            start = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                seconds[name] += time.perf_counter() - start
        return run

    if args.rewrite:  # what `torch.onnx.export(optimize=True)` runs after the translation
        from onnxscript.optimizer import optimize_ir

        harness.optimize_graph = optimize_ir
    harness._export_onnx = timed("onnx export", harness._export_onnx)
    harness._trace = timed("torchscript", harness._trace)
    harness.check_parity = timed("parity", harness.check_parity)
    TimeAwareExporter.properties = timed("promises", TimeAwareExporter.properties)
    log = simulate_reviews(n_users=2, n_cards=60, n_days=80, seed=3)
    torch.manual_seed(0)
    model = TimeAwareTransformer(TimeAwareConfig(**args.sizes)).eval()
    sequence = parity_inputs(ReviewTensors(log, model.cfg.window, model.cfg.card_window))
    with tempfile.TemporaryDirectory(prefix="export-time-") as tmp:
        start = time.perf_counter()
        manifest = export_time_aware(model, Path(tmp), manifest={"name": "bench"}, sequence=sequence)
        total = time.perf_counter() - start
        nodes = {g: len(onnx.load(str(Path(tmp) / spec["onnx"])).graph.node) for g, spec in manifest["graphs"].items()}
    print(f"{'with' if args.rewrite else 'without'} the rewrite rules: {total:.1f} s in all; "
          + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
          + f"; parity passed: {manifest['parity']['passed']}; nodes {nodes}")


if __name__ == "__main__":
    main()
