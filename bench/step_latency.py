"""Per-event serving latency of the streaming GPCM models: one step() then one predict(), per engine.

For each model variant (random weights at the default GPCMConfig sizes) the model is exported once
with nextstep.training.kt.export.export_artifact (which also checks parity), then one serving step,

    state = step(state, question, response)      fold the observed interaction into the learner state
    predict(state, next_question[:, None])       answer for one question

is timed call by call for eager PyTorch, TorchScript (step.pt / predict.pt) and ONNX Runtime
(step.onnx / predict.onnx, one intra-op thread), at each batch size. The state returned by step is
fed back into the next call, so memory contents keep evolving as in a live service. All inputs are
prepared before timing; garbage collection is paused inside timed loops.

    python bench/step_latency.py [--questions 200] [--cats 4] [--repeats 2000] [--repeats-batched 300]
                                 [--warmup 200] [--batches 1,64]
                                 [--models deep_gpcm,attention_gpcm,coral_gpcm] [--learner-dim N] [--json OUT]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import os
import platform
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from machine import machine  # bench/machine.py (the script's directory is on sys.path)

from nextstep.models.deep_gpcm import MODELS, GPCMConfig
from nextstep.training.export import onnx_session
from nextstep.training.kt.export import export_artifact

TARGET_US = 100.0  # DeepGPCM ONNX Runtime batch-1 step+predict median budget (the target)
TARGET_MODEL = "deep_gpcm"
ENGINES = ("eager", "torchscript", "onnxruntime", "onnxruntime-fused")
SEED_SIZES = {"memory_size": 50, "key_dim": 50, "value_dim": 200, "summary_dim": 50}  # seed 000 defaults
POOL = 512  # distinct pre-built (question, response) inputs per batch size, cycled through


# -- quiet export ------------------------------------------------------------------------------------
@contextlib.contextmanager
def _silenced():
    """Send fd 1 and fd 2 (Python and C-level writes) to a temp file; replay it if the block raises."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
        failed = False
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                yield
        except BaseException:
            failed = True
            raise
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
            if failed:
                sink.seek(0)
                sys.stderr.write(sink.read().decode(errors="replace"))


def export_model(model, out_dir: Path, n_questions: int, n_cats: int, gen: torch.Generator) -> dict:
    parity_q = torch.randint(2, n_questions, (4, 20), generator=gen)
    parity_r = torch.randint(0, n_cats, (4, 20), generator=gen)
    with _silenced():
        return export_artifact(model, out_dir, manifest={"name": f"bench-{model.family}"}, vocab_json={},
                               parity_questions=parity_q, parity_responses=parity_r)


# -- engines: each gives init(B) -> state, step(state, q, r) -> state, predict(state, qm) -> outputs ----
class Eager:
    name = "eager"

    def __init__(self, model, art: Path):
        self.model = model

    def init(self, batch):
        return self.model.init_state(batch)

    def inputs(self, q, r, qm):
        return torch.from_numpy(q), torch.from_numpy(r), torch.from_numpy(qm)

    def step(self, state, q, r):
        return self.model.step(state, q, r)

    def predict(self, state, qm):
        return self.model.readout(state, qm)

    def probs(self, out):
        return out.log_probs.exp().numpy()


class TorchScript(Eager):
    name = "torchscript"

    def __init__(self, model, art: Path):
        self.model = model  # only for init_state
        self.step_ts = torch.jit.load(str(art / "step.pt"))
        self.predict_ts = torch.jit.load(str(art / "predict.pt"))

    def step(self, state, q, r):
        return self.step_ts(*state, q, r)

    def predict(self, state, qm):
        return self.predict_ts(*state, qm)

    def probs(self, out):
        return out[0].numpy()


class OnnxRuntime:
    name = "onnxruntime"

    def __init__(self, model, art: Path, manifest: dict):
        self.state_names = [s["name"] for s in manifest["state"]]
        self.initial = {s["name"]: np.load(art / s["file"]) for s in manifest["state"]}
        self.step_sess = onnx_session(art / "step.onnx")
        self.predict_sess = onnx_session(art / "predict.onnx")
        self.step_in = [i.name for i in self.step_sess.get_inputs()]
        self.predict_in = [i.name for i in self.predict_sess.get_inputs()]
        # state names each graph actually declares (predict may ignore part of the state)
        self.step_state = [n for n in self.state_names if n in self.step_in]
        self.predict_state = [n for n in self.state_names if n in self.predict_in]

    def init(self, batch):
        """The per-entity initial state from state_*.npy, repeated over the batch (what a service does)."""
        return {n: np.ascontiguousarray(np.repeat(self.initial[n][None], batch, axis=0)) for n in self.state_names}

    def inputs(self, q, r, qm):
        return q, r, qm

    def step(self, state, q, r):
        feeds = {n: state[n] for n in self.step_state}
        if "question" in self.step_in:
            feeds["question"] = q
        if "response" in self.step_in:
            feeds["response"] = r
        return dict(zip(self.state_names, self.step_sess.run(None, feeds), strict=True))

    def predict(self, state, qm):
        feeds = {n: state[n] for n in self.predict_state}
        feeds["questions"] = qm
        return self.predict_sess.run(None, feeds)

    def probs(self, out):
        return out[0]


class OnnxRuntimeFused(OnnxRuntime):
    """One serving event as ONE call of step_predict.onnx (what the service runs for events + predict)."""

    name = "onnxruntime-fused"

    def __init__(self, model, art: Path, manifest: dict):
        super().__init__(model, art, manifest)
        self.fused_sess = onnx_session(art / "step_predict.onnx")
        self.fused_in = [i.name for i in self.fused_sess.get_inputs()]
        self.n_state = len(self.state_names)

    def event(self, state, q, r, qm):
        feeds = {**state, "question": q, "response": r, "questions": qm}
        outs = self.fused_sess.run(None, {n: feeds[n] for n in self.fused_in})
        return dict(zip(self.state_names, outs[: self.n_state], strict=True))


# -- measurement -------------------------------------------------------------------------------------
def make_inputs(batch: int, n_questions: int, n_cats: int, rng: np.random.Generator):
    """POOL x (question (B,), response (B,), next question (B, 1)) int64, C-contiguous."""
    qs = rng.integers(2, n_questions, size=(POOL + 1, batch), dtype=np.int64)
    rs = rng.integers(0, n_cats, size=(POOL, batch), dtype=np.int64)
    return [(np.ascontiguousarray(qs[i]), np.ascontiguousarray(rs[i]), np.ascontiguousarray(qs[i + 1][:, None]))
            for i in range(POOL)]


def summarise(ns: np.ndarray, batch: int) -> dict:
    us = ns.astype(np.float64) / 1e3
    med = float(np.median(us))
    return {"median_us": med, "p90_us": float(np.percentile(us, 90)), "mean_us": float(us.mean()),
            "min_us": float(us.min()), "per_learner_us": med / batch, "calls": int(len(us))}


def measure(engine, batch: int, raw_inputs, warmup: int, iters: int) -> dict:
    inputs = [engine.inputs(q, r, qm) for q, r, qm in raw_inputs]
    n = len(inputs)
    step, predict, clock = engine.step, engine.predict, time.perf_counter_ns
    t_step = np.empty(iters, dtype=np.int64)
    t_pred = np.empty(iters, dtype=np.int64)
    with torch.no_grad():
        state = engine.init(batch)
        for i in range(warmup):
            q, r, qm = inputs[i % n]
            state = step(state, q, r)
            predict(state, qm)
        gc.collect()
        gc.disable()
        try:
            event = getattr(engine, "event", None)
            for i in range(iters):
                q, r, qm = inputs[(warmup + i) % n]
                if event is not None:  # fused: the whole event is one call, reported as step+predict only
                    t0 = clock()
                    state = event(state, q, r, qm)
                    t_step[i], t_pred[i] = clock() - t0, 0
                    continue
                t0 = clock()
                state = step(state, q, r)
                t1 = clock()
                predict(state, qm)
                t2 = clock()
                t_step[i] = t1 - t0
                t_pred[i] = t2 - t1
        finally:
            gc.enable()
    return {"step+predict": summarise(t_step + t_pred, batch), "step": summarise(t_step, batch),
            "predict": summarise(t_pred, batch)}


def agreement(engines, batch: int, raw_inputs) -> dict:
    """Max |probs - eager probs| after one identical step+predict from the initial state, per engine."""
    q, r, qm = raw_inputs[0]
    ref, diffs = None, {}
    with torch.no_grad():
        for eng in engines:
            tq, tr, tqm = eng.inputs(q, r, qm)
            probs = eng.probs(eng.predict(eng.step(eng.init(batch), tq, tr), tqm))
            if ref is None:
                ref = probs
            diffs[eng.name] = float(np.abs(probs - ref).max())
    return diffs


# -- report ------------------------------------------------------------------------------------------
def machine_info() -> dict:
    info = machine()
    cpu, usable = info["cpu"], info["usable_cpus"]
    load = info["load_avg"][0] if info["load_avg"] else None
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "usable_cpus": usable, "load_avg_1m_at_start": load,
            "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__, "onnxruntime": ort.__version__,
            "numpy": np.__version__, "torch_threads": torch.get_num_threads()}


def print_table(rows: list[dict]) -> None:
    head = f"{'model':<15} {'engine':<17} {'measures':<13} {'batch':>5} {'median us':>10} {'p90 us':>10} " \
           f"{'us/learner':>11}"
    print(head)
    print("-" * len(head))
    last = None
    for row in rows:
        if last is not None and row["model"] != last:
            print()
        last = row["model"]
        print(f"{row['model']:<15} {row['engine']:<17} {row['part']:<13} {row['batch']:>5} "
              f"{row['median_us']:>10.1f} {row['p90_us']:>10.1f} {row['per_learner_us']:>11.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--questions", type=int, default=200, help="question vocabulary (n_questions = this + 2)")
    p.add_argument("--cats", type=int, default=4, help="ordinal response categories K")
    p.add_argument("--repeats", type=int, default=2000, help="timed calls at batch 1")
    p.add_argument("--repeats-batched", type=int, default=300, help="timed calls at batch sizes > 1")
    p.add_argument("--warmup", type=int, default=200, help="untimed calls before timing")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated model families")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sizes", choices=["seed", "default"], default="seed",
                   help="model sizes: the seed document's (memory 50, key 50, value 200, summary 50) "
                        "or GPCMConfig's defaults (the tuned ones)")
    p.add_argument("--learner-dim", type=int, default=0,
                   help="GRU learner state beside the memory (GPCMConfig.learner_dim; deep_gpcm's default for K = 2 "
                        "is 50, the classes' own 0)")
    p.add_argument("--json", type=Path, help="write every number here")
    args = p.parse_args(argv)

    batches = [int(b) for b in args.batches.split(",") if b.strip()]
    families = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in families if m not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; known: {list(MODELS)}")

    torch.set_num_threads(1)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    logging.getLogger("onnxscript").setLevel(logging.ERROR)
    n_questions = args.questions + 2
    machine = machine_info()
    started = time.perf_counter()
    print(f"machine: {machine['cpu'] or 'unknown cpu'}; cpu_count={machine['cpu_count']} "
          f"(usable {machine['usable_cpus']}); python {machine['python']}, torch {machine['torch']} "
          f"({machine['torch_threads']} thread), onnxruntime {machine['onnxruntime']} (1 intra-op thread)")
    load = machine["load_avg_1m_at_start"]
    if load is not None:
        busy = load >= 0.5
        print(f"load average (1 min) before start: {load:.2f}"
              + ("  <- other work is running; expect inflated, noisier numbers" if busy else ""))
    print(f"settings: n_questions={n_questions}, K={args.cats}, {args.sizes} sizes, learner_dim {args.learner_dim}; "
          f"warmup {args.warmup}, "
          f"{args.repeats} timed calls at batch 1, {args.repeats_batched} at larger batches", flush=True)

    rows, exports, checks = [], {}, {}
    with tempfile.TemporaryDirectory(prefix="nextstep-bench-") as tmp:
        for fi, family in enumerate(families):
            torch.manual_seed(args.seed + fi)
            sizes = SEED_SIZES if args.sizes == "seed" else {}
            cfg = GPCMConfig(n_questions=n_questions, n_cats=args.cats, learner_dim=args.learner_dim, **sizes)
            model = MODELS[family](cfg).eval()
            art = Path(tmp) / family
            t0 = time.perf_counter()
            manifest = export_model(model, art, n_questions, args.cats, torch.Generator().manual_seed(args.seed))
            exports[family] = {"seconds": round(time.perf_counter() - t0, 2), "parity": manifest["parity"],
                               "parameters": sum(p.numel() for p in model.parameters())}
            print(f"[{family}] exported in {exports[family]['seconds']:.1f}s "
                  f"({exports[family]['parameters']:,} parameters, parity passed)", flush=True)
            engines = [Eager(model, art), TorchScript(model, art), OnnxRuntime(model, art, manifest),
                       OnnxRuntimeFused(model, art, manifest)]
            rng = np.random.default_rng(args.seed)
            checks[family] = {}
            for batch in batches:
                raw = make_inputs(batch, n_questions, args.cats, rng)
                checks[family][batch] = agreement(engines, batch, raw)
                iters = args.repeats if batch == 1 else args.repeats_batched
                for eng in engines:
                    res = measure(eng, batch, raw, args.warmup, iters)
                    parts = ["step+predict"] if hasattr(eng, "event") else ["step+predict", "step", "predict"]
                    for part in parts:
                        rows.append({"model": family, "engine": eng.name, "part": part, "batch": batch,
                                     "shown": part == "step+predict" or (eng.name == "onnxruntime" and batch == 1),
                                     **res[part]})
            print(f"[{family}] measured; max |probs - eager probs|: "
                  + "; ".join(f"batch {b}: " + ", ".join(f"{e} {d:.1e}" for e, d in c.items() if e != "eager")
                              for b, c in checks[family].items()), flush=True)

    order = {e: i for i, e in enumerate(ENGINES)}
    part_order = {"step+predict": 0, "step": 1, "predict": 2}
    shown = sorted((r for r in rows if r["shown"]),
                   key=lambda r: (families.index(r["model"]), order[r["engine"]], part_order[r["part"]], r["batch"]))
    print()
    print_table(shown)
    print()
    print("median/p90 are per call (microseconds); us/learner = median / batch. "
          "'step+predict' is one serving event: step(state, q, r) then predict(state, one question).")
    elapsed = time.perf_counter() - started

    target = next((r for r in rows if r["model"] == TARGET_MODEL and r["engine"] == "onnxruntime-fused"
                   and r["part"] == "step+predict" and r["batch"] == 1), None)
    if target is None:
        verdict = {"measured": False}
        line = f"TARGET: not measured (needs --models including {TARGET_MODEL} and --batches including 1)"
    else:
        ok = target["median_us"] <= TARGET_US
        verdict = {"measured": True, "median_us": target["median_us"], "target_us": TARGET_US, "met": ok}
        line = (f"TARGET: DeepGPCM ONNX Runtime (fused graph) batch-1 step+predict median = "
                f"{target['median_us']:.1f} us "
                f"{'<=' if ok else '>'} {TARGET_US:.0f} us -> {'MET' if ok else 'NOT MET'}")
    print(f"total time {elapsed:.0f}s")
    print(line)

    if args.json:
        for r in rows:
            r.pop("shown")
        out = {"machine": machine, "settings": {**vars(args), "json": str(args.json), "n_questions": n_questions,
                                                "batches": batches, "models": families},
               "exports": exports, "engine_agreement_max_abs_probs": checks, "results": rows,
               "target": verdict, "total_seconds": round(elapsed, 1)}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
