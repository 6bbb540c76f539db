"""SimAKT's window rule on a data set's test file: test AUC of the full pass under each rule, and the served
stepping (the cached state, as the service runs it) against the full pass under the artifact's rule.

    python bench/simakt_window_rule.py ARTIFACT --data DIR [--caches 1 2 4] [--join-cut 200] [--step]
                                                [--json OUT]

Rules (SimAKT.chunked with `caches` set): 1 = every chunk of `window` starts afresh (the chunked evaluation
before the cached state, and the restart-every-window serving rule); 2 = two caches staggered by window / 2, the
prediction from the one with more history (the default); 4 = four caches staggered by window / 4. `--join-cut N`
joins each test sequence exactly N long with the one after it (DTransformer's ASSISTments 2009 files cut
students into sequences of at most 200, one after the other: an assumption about the file, stated with the
figures). `--step` walks every test sequence through `step` and `readout` (eager, the artifact's cache dtype)
and reports the largest difference in P(right) from the full pass under the artifact's rule, and its AUC.
"""

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from nextstep.training.data import Vocabulary
from nextstep.training.kt.banks import load_banks
from nextstep.training.kt.data import load_dataset
from nextstep.training.kt.loop import batches
from nextstep.training.kt.simakt_export import load_simakt
from nextstep.training.kt.simakt_run import bank_tensors, binary_metrics, predict, sequences


def join_cut(seqs: list, cut: int) -> list:
    """Each sequence exactly `cut` long joined with the next one (repeatedly)."""
    out = []
    for q, r in seqs:
        if out and len(out[-1][0]) % cut == 0 and out[-1][2]:
            pq, pr, _ = out.pop()
            q, r = np.concatenate([pq, q]), np.concatenate([pr, r])
        out.append((q, r, len(q) % cut == 0))
    return [(q, r) for q, r, _ in out]


@torch.no_grad()
def stepped(model, seqs, kv, batch_size: int = 128) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P(right) by stepping, by the full pass under the model's rule, responses) at every interaction."""
    walked, full, targets = [], [], []
    for q, r, mask in batches(seqs, batch_size):
        state, out = model.init_state(q.shape[0]), []
        for t in range(q.shape[1]):
            out.append(torch.sigmoid(model.readout(state, q[:, t:t + 1], kv).logits[:, 0]))
            state = model.step(state, q[:, t], r[:, t], kv)
        walked.append(torch.stack(out, 1)[mask].numpy())
        full.append(torch.sigmoid(model.chunked(q, r, kv))[mask].numpy())
        targets.append(r[mask].numpy())
    return np.concatenate(walked), np.concatenate(full), np.concatenate(targets)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact")
    parser.add_argument("--data", required=True)
    parser.add_argument("--caches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--join-cut", type=int, help="join each test sequence this long with the next one")
    parser.add_argument("--step", action="store_true", help="also walk the test sequences through step/readout")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    art = Path(args.artifact)
    model, manifest = load_simakt(art)
    banks = load_banks(art / manifest["banks"]["dir"] / manifest["banks"]["default"], model) if model.heads else []
    vocab = Vocabulary.from_json(json.loads((art / manifest["vocabularies"]["questions"]).read_text()))
    seqs = sequences(load_dataset(args.data)[1], vocab)
    if args.join_cut:
        seqs = join_cut(seqs, args.join_cut)
    lengths = np.array([len(q) for q, _ in seqs])
    W = model.cfg.window
    result = {"artifact": str(art), "data": args.data, "window": W, "join_cut": args.join_cut,
              "sequences": len(seqs), "interactions": int(lengths.sum()),
              "interactions_past_window": int(np.maximum(lengths - W, 0).sum()), "rules": {}}
    print(f"{len(seqs)} test sequences, {lengths.sum()} interactions, {result['interactions_past_window']} of them "
          f"past the first {W} of their sequence", flush=True)
    past = np.concatenate([np.nonzero(mask.numpy())[1] >= W for _, _, mask in batches(seqs, 64)])  # predict's order
    for caches in args.caches:
        ruled = copy.deepcopy(model)
        ruled.cfg.caches = caches
        started = time.perf_counter()
        probs, targets = predict(ruled, seqs, banks)
        m = binary_metrics(probs, targets)
        late = binary_metrics(probs[past], targets[past]) if past.any() else None
        result["rules"][caches] = {**m, "past_window": late}
        print(f"caches {caches}: auc {m['auc']:.4f}  accuracy {m['accuracy']:.4f}  nll {m['nll']:.4f}"
              + (f"; past the first {W}: auc {late['auc']:.4f}  nll {late['nll']:.4f}" if late else "")
              + f"  ({time.perf_counter() - started:.0f} s)", flush=True)
    if args.step:
        started = time.perf_counter()
        kv = model.bank_keys(bank_tensors(banks))
        walked, full, targets = stepped(model, seqs, kv)
        result["step"] = {"cache_dtype": model.cfg.cache_dtype, "caches": model.cfg.caches,
                          "max_abs_vs_full": float(np.abs(walked - full).max()),
                          "p99_abs_vs_full": float(np.quantile(np.abs(walked - full), 0.99)),
                          **{f"stepped_{k}": v for k, v in binary_metrics(walked, targets).items()}}
        print(f"stepping ({model.cfg.cache_dtype} cache, caches {model.cfg.caches}): max |P - full| "
              f"{result['step']['max_abs_vs_full']:.2e}, p99 {result['step']['p99_abs_vs_full']:.2e}, auc "
              f"{result['step']['stepped_auc']:.4f} ({time.perf_counter() - started:.0f} s)", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
