"""The demo models: what `make run` (`nextstep serve --demo`) serves when ./artifacts is empty, and what
`nextstep demo` trains.

    python -m nextstep.demo                 # = make demo-artifacts: rebuild nextstep/demo_artifacts/ (needs torch)
    python -m nextstep.demo --out DIR       # build them elsewhere (the tests compare such a build with the bundle)

Each family's registry entry (nextstep/training/families.py) carries its demo recipe, where it has one: the data
generator and its settings (fixed seeds; never a real data set), the training settings and the run's keywords.
This module builds a recipe (`build_one`): it generates the data, trains through the family's run and exports
with the family's exporter (parity checked). The bundled models are the recipes marked `bundled`, one per task
the service answers, reduced to what the service reads: manifest, ONNX graphs (without the exporter's per-node
debug metadata), initial state, vocabulary. Weights, TorchScript, parity inputs and reports are left out; the
command rebuilds them.

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

from .training.families import FAMILIES, load

BUNDLED = Path(__file__).with_name("demo_artifacts")
VERSION = "demo"
COMMAND = "python -m nextstep.demo  (make demo-artifacts)"
MODELS = tuple(name for name, entry in FAMILIES.items() if entry.demo and entry.demo.bundled)  # one per task


def build_one(entry, data: Path, out: Path, epochs: int | None = None) -> dict:
    """Build a family's demo recipe: generate its data into `data`, train through its run into `out` (exported,
    parity checked); return the manifest. epochs: instead of the recipe's, where the family takes --epochs."""
    recipe = entry.demo
    path = load(recipe.data)(data, **recipe.generated)
    fields = entry.config_fields("train_config")
    settings = {**recipe.training, **({"epochs": epochs} if epochs and "epochs" in entry.flags else {})}
    cfg = entry.resolve("train_config")(**{k: v for k, v in settings.items() if k in fields})
    options = {k: v for k, v in settings.items() if k not in fields} | recipe.run
    if entry.progress:
        options[entry.progress] = False
    return entry.resolve("train")(entry, path, out, cfg=cfg, **options)


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
    recipe = FAMILIES[name].demo
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
        "built_by": COMMAND, "generated_data": json.loads(json.dumps(recipe.generated)),
        "training": json.loads(json.dumps(recipe.training)),
        "left_out": "weights.pt, TorchScript graphs, parity inputs and report: rebuild with the command to get them"})
    (dst / "manifest.json").write_text(json.dumps(kept, indent=2) + "\n")
    return kept


def build(out: Path, work: Path | None = None, log=print) -> dict[str, dict]:
    """Build the bundled demo models into out/NAME/demo (replacing what is there); return their manifests."""
    out = Path(out)
    with tempfile.TemporaryDirectory(prefix="nextstep-demo-") as tmp:
        work = Path(work or tmp)
        manifests = {}
        for name in MODELS:
            log(f"building {name} ...")
            artifact = work / "artifacts" / name
            manifest = build_one(FAMILIES[name], work / "data" / name, artifact)
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
