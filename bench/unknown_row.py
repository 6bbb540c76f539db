"""The unknown row's settings (issue 37 part 6), validated on a validation split carved from the training file.

For each (min_question_count, unknown_share) it trains a knowledge-tracing family on DATA, then on the run's own
validation students (valid_fraction of the *training* learners, as early stopping uses them; the test file is read
by train_model for metrics.test, which is not looked at here) reports:

    valid                      the run's validation metrics (what the setting costs the known questions)
    at_masked_with_real_ids    AUC and NLL at a seeded 10% of the validation positions, every id its own row
    at_masked_through_unknown  the same positions with their question given as unknown (row 1): how an unknown
                               question is answered, against the base rate's NLL

    python bench/unknown_row.py --data ../shared/data/kt/dkvmn_assist2009_updated --model dkt --epochs 3 \\
        --config configs/dkt.json --out /tmp/unknown_row
"""

import argparse
import json
import time
from pathlib import Path

import numpy as np

from nextstep.training.data import hide_ids
from nextstep.training.kt.data import load_dataset, split_students
from nextstep.training.kt.loop import TrainConfig, batches, predict_sequences
from nextstep.training.kt.run import encode, load_model, train_model
from nextstep.training.metrics import ordinal_metrics

SETTINGS = ((1, 0.0), (5, 0.01), (5, 0.05))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True)
    parser.add_argument("--model", default="dkt")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--config", help="JSON training config (e.g. configs/dkt.json)")
    parser.add_argument("--out", required=True, help="where the artifacts go")
    args = parser.parse_args()
    base = json.loads(Path(args.config).read_text()) if args.config else {}
    for min_count, share in SETTINGS:
        started = time.time()
        cfg = TrainConfig(**{**base, "epochs": args.epochs}, min_question_count=min_count, unknown_share=share)
        out = Path(args.out) / f"{args.model}_{min_count}_{share}"
        run = train_model(args.model, args.data, out, cfg=cfg, progress=False, log=False)
        model, vocab, manifest = load_model(out)
        train_ds, _ = load_dataset(args.data)
        _, valid = split_students(train_ds, cfg.valid_fraction, cfg.seed)
        enc = encode(valid, vocab)
        masked = hide_ids([q for q, _ in enc], 0.1, seed=99)
        full = predict_sequences(model, enc, batcher=batches)
        hidden = predict_sequences(model, list(zip(masked, [r for _, r in enc], strict=True)), batcher=batches)
        assert np.array_equal(full["targets"], hidden["targets"])  # the same positions in the same order
        at = (hidden["questions"] == 1) & (full["questions"] >= 2)
        p = float(full["targets"].mean())

        def metrics(pred: dict, at: np.ndarray = at) -> dict:
            m = ordinal_metrics(pred["probs"][at], pred["targets"][at])
            return {k: round(m[k], 4) for k in ("auc", "nll")}
        print(json.dumps({
            "min_question_count": min_count, "unknown_share": share, "unknown": manifest["unknown"],
            "valid": {k: round(run["metrics"]["valid"][k], 4) for k in ("auc", "nll")},
            "masked_positions": int(at.sum()), "at_masked_with_real_ids": metrics(full),
            "at_masked_through_unknown": metrics(hidden),
            "base_rate_nll": round(-(p * np.log(p) + (1 - p) * np.log(1 - p)), 4),
            "seconds": round(time.time() - started)}), flush=True)


if __name__ == "__main__":
    main()
