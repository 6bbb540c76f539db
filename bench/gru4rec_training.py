"""GRU4Rec training throughput (events per second) at the official reference settings.

Trains NextStep's GRU4Rec on a session data set's training file with the settings the issue names
for the official code's reference run (cross-entropy, hidden 100, batch 32, 512 extra negatives,
sample_alpha 0.5, dropout 0.4 on the hidden layer, learning rate 0.2, momentum 0.2, logQ on; these are
GRU4RecTrainConfig's defaults) and prints the events per second of every epoch, their median, and the
ratio to the 12,000 events/s target (the official PyTorch code ran at 8,000-12,000 on this machine's CPU).
Reading the data and building the vocabulary are not timed; each epoch's time covers batching,
negative sampling, forward, backward and the optimiser step. With --evaluate it also scores the test
file with the official protocol at the end (not timed).

    python bench/gru4rec_training.py [--data ../shared/data/rec/rsc15_100k] [--epochs 3] [--threads 1]
                                     [--evaluate] [--json OUT]
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from machine import machine  # bench/machine.py (the script's directory is on sys.path)

from nextstep.models.gru4rec import GRU4Rec, GRU4RecConfig
from nextstep.training.data import Vocabulary, default_data_dir
from nextstep.training.next_item.gru4rec_loop import GRU4RecTrainConfig, fit_gru4rec
from nextstep.training.next_item.ranking import evaluate_sessions
from nextstep.training.next_item.sessions import load_session_split

TARGET = 12_000


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(default_data_dir() / "rec" / "rsc15_100k"))
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--loss", default="cross-entropy")
    parser.add_argument("--evaluate", action="store_true", help="score the test file afterwards")
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if not Path(args.data).is_dir():
        print(f"no data set at {args.data} (set --data or NEXTSTEP_DATA_DIR)", file=sys.stderr)
        return 2
    train, test = load_session_split(args.data)
    vocab = Vocabulary.build(train.items)
    cfg = GRU4RecTrainConfig(epochs=args.epochs, threads=args.threads, loss=args.loss)
    torch.manual_seed(cfg.seed)
    model = GRU4Rec(GRU4RecConfig(n_items=len(vocab), **cfg.model))
    history = fit_gru4rec(model, train.encode(vocab, drop_unknown=False), cfg, progress=False, log=False)
    rates = [round(h["targets_per_second"], 1) for h in history]
    result = {
        "machine": machine(), "torch": torch.__version__, "data": args.data, "train_events": train.n_events,
        "settings": {k: v for k, v in vars(cfg).items() if k != "model"} | {"model": vars(model.cfg)},
        "events_per_second": rates, "median_events_per_second": statistics.median(rates),
        "target": TARGET, "ratio_to_target": round(statistics.median(rates) / TARGET, 3),
    }
    if args.evaluate:
        metrics = evaluate_sessions(model, test.encode(vocab))
        result["test"] = {k: round(metrics[k], 4) for k in ("recall@20", "mrr@20")}
    print(json.dumps(result, indent=2, default=str))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
