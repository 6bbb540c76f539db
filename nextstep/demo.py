"""The bundled demo models: what `make run` (`nextstep serve --demo`) serves when ./artifacts is empty.

    python -m nextstep.demo                 # = make demo-artifacts: rebuild nextstep/demo_artifacts/ (needs torch)
    python -m nextstep.demo --out DIR       # build them elsewhere (the tests compare such a build with the bundle)

Three tiny models, one per task the service answers, each trained for real on data generated here with fixed
seeds (never on a real data set), exported with its family's exporter (parity checked), then reduced to what
the service reads: manifest, ONNX graphs (without the exporter's per-node debug metadata), initial state,
vocabulary. Weights, TorchScript, parity inputs and reports are left out; the command rebuilds them.

    deep_gpcm   knowledge tracing   questions "0".."19", responses 0..3 (GPCM synthetic, 100 students)
    gru4rec     next item           items "1".."60" (Zipf sessions with a successor signal, 300 sessions)
    time_aware  flashcards          any card and deck ids (a simulated review log, one user, 40 cards)

The figures these models reach mean nothing: they exist so that every route answers out of the box. Serving
them needs only the `serve` extra (ONNX Runtime, no torch); building them needs the `train` extra.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

BUNDLED = Path(__file__).with_name("demo_artifacts")
VERSION = "demo"
COMMAND = "python -m nextstep.demo  (make demo-artifacts)"

# everything that decides what is built; the manifests record it under "demo"
KT_DATA = {"n_students": 100, "n_questions": 20, "seq_len_range": (20, 40), "seed": 7}
KT_TRAIN = {"epochs": 3, "max_len": 40, "model": {"memory_size": 8, "key_dim": 8, "value_dim": 16, "summary_dim": 8}}
SESSION_DATA = {"n_sessions": 300, "n_items": 60, "length_range": (2, 9), "follow": 0.7, "seed": 0}
SESSION_TRAIN = {"epochs": 2, "n_sample": 16, "seed": 0, "model": {"layers": (16,)}}
REVIEW_DATA = {"n_users": 1, "n_cards": 40, "n_days": 40, "seed": 7}
REVIEW_TRAIN = {"max_epochs": 2, "seed": 0, "threads": 1,
                "model": {"d_model": 16, "n_layers": 1, "ffn_dim": 32, "t2v_dim": 4, "window": 32, "card_window": 4}}
REVIEW_SPLITS = 2
MODELS = ("deep_gpcm", "gru4rec", "time_aware")


def _build_kt(data: Path, out: Path) -> dict:
    from .training.kt.loop import TrainConfig
    from .training.kt.run import train_model
    from .training.kt.synthetic import write_gpcm_dataset

    write_gpcm_dataset(data, **KT_DATA)
    return train_model("deep_gpcm", data, out, cfg=TrainConfig(**KT_TRAIN), progress=False, log=False)


def _build_sessions(data: Path, out: Path) -> dict:
    import numpy as np

    from .training.next_item.gru4rec_loop import GRU4RecTrainConfig
    from .training.next_item.run import train_next_item
    from .training.next_item.sessions import subset, write_gru4rec_tsv, zipf_sessions

    sessions = zipf_sessions(**SESSION_DATA)
    n_train = SESSION_DATA["n_sessions"] * 5 // 6
    data.mkdir(parents=True, exist_ok=True)
    write_gru4rec_tsv(subset(sessions, np.arange(n_train)), data / "demo_train_full.txt")
    write_gru4rec_tsv(subset(sessions, np.arange(n_train, len(sessions))), data / "demo_test.txt")
    return train_next_item("gru4rec", data, out, cfg=GRU4RecTrainConfig(**SESSION_TRAIN), progress=False, log=False,
                           top_k=30)


def _build_srs(data: Path, out: Path) -> dict:
    from .training.srs.reviews import simulate_reviews, write_review_csv
    from .training.srs.time_aware_loop import TimeAwareTrainConfig
    from .training.srs.time_aware_run import train_time_aware

    data.mkdir(parents=True, exist_ok=True)
    reviews = write_review_csv(simulate_reviews(**REVIEW_DATA), data / "reviews.csv")
    return train_time_aware(reviews, out, cfg=TimeAwareTrainConfig(**REVIEW_TRAIN), n_splits=REVIEW_SPLITS,
                            baselines=False, progress=False)


BUILDERS = {"deep_gpcm": (_build_kt, KT_DATA, KT_TRAIN), "gru4rec": (_build_sessions, SESSION_DATA, SESSION_TRAIN),
            "time_aware": (_build_srs, REVIEW_DATA, {**REVIEW_TRAIN, "n_splits": REVIEW_SPLITS})}


def slim_onnx(src: Path, dst: Path) -> None:
    """Copy an ONNX graph without the per-node metadata and doc strings the exporter adds for debugging (source
    locations, module paths): about 85% of a small graph's bytes. The nodes, initializers, inputs and outputs are
    untouched, so the graph computes exactly what the parity check measured."""
    import onnx

    model = onnx.load(str(src))

    def strip(nodes) -> None:
        for node in nodes:
            del node.metadata_props[:]
            node.doc_string = ""
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    strip(attr.g.node)
                for g in attr.graphs:
                    strip(g.node)

    strip(model.graph.node)
    for function in model.functions:
        strip(function.node)
    onnx.save(model, str(dst))


def served_copy(artifact: Path, dst: Path, manifest: dict, name: str) -> dict:
    """Copy what the service reads of an exported artifact into `dst`; return the manifest written there."""
    _, data_settings, train_settings = BUILDERS[name]
    dst.mkdir(parents=True, exist_ok=True)
    graphs = {}
    for g, spec in manifest["graphs"].items():
        slim_onnx(artifact / spec["onnx"], dst / spec["onnx"])
        graphs[g] = {k: v for k, v in spec.items() if k != "torchscript"}
    for s in manifest.get("state", []):
        shutil.copy2(artifact / s["file"], dst / s["file"])
    for vocab in manifest.get("vocabularies", {}).values():
        shutil.copy2(artifact / vocab, dst / vocab)
    kept = {k: v for k, v in manifest.items() if k not in ("weights", "report", "graphs")}
    kept["parity"] = {k: v for k, v in manifest["parity"].items() if k != "inputs"}
    kept["data"] = {k: v for k, v in manifest["data"].items()
                    if k not in ("dir", "path", "file", "train_file", "test_file", "eval_file")}
    kept.update(version=VERSION, graphs=graphs, demo={
        "built_by": COMMAND, "generated_data": json.loads(json.dumps(data_settings)),
        "training": json.loads(json.dumps(train_settings)),
        "left_out": "weights.pt, TorchScript graphs, parity inputs and report: rebuild with the command to get them"})
    (dst / "manifest.json").write_text(json.dumps(kept, indent=2) + "\n")
    return kept


def build(out: Path, work: Path | None = None, log=print) -> dict[str, dict]:
    """Build the three demo models into out/NAME/demo (replacing what is there); return their manifests."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="nextstep-demo-") as tmp:
        work = Path(work or tmp)
        manifests = {}
        for name in MODELS:
            builder = BUILDERS[name][0]
            log(f"building {name} ...")
            artifact = work / "artifacts" / name
            manifest = builder(work / "data" / name, artifact)
            target = out / name / VERSION
            if target.exists():
                shutil.rmtree(target)
            manifests[name] = served_copy(artifact, target, manifest, name)
            log(f"  {target}")
    return manifests


def require(module: str, extra: str, command: str) -> None:
    """Exit with a one-line message naming what to install when `module` cannot be imported."""
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        torch_first = ("pip install -c constraints.txt torch --extra-index-url https://download.pytorch.org/whl/cpu "
                       "(the CPU build), then ") if module == "torch" else ""
        raise SystemExit(f"{command} needs {module} (the '{extra}' extra), which is not installed: run `make setup`, "
                         f"or {torch_first}pip install -c constraints.txt -e '.[{extra}]'")

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nextstep.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(BUNDLED), help=f"where to write NAME/{VERSION}/ (default: the bundle)")
    args = parser.parse_args(argv)
    require("torch", "train", "building the demo models")
    build(Path(args.out), log=lambda line: print(line, file=sys.stderr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
