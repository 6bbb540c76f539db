"""Write a knowledge-tracing data set in the long format: one interaction per row, gzipped, ids as text.

    python scripts/kt_to_long_csv.py ../shared/data/kt/dkvmn_assist2009_updated /tmp/assist2009_long

Reads DIR as `nextstep train` does (train and test files found by name, format detected) and writes
OUT/NAME_train.csv.gz and OUT/NAME_test.csv.gz (columns learner_id, question_id, correct, timestamp, event_id;
rows in time order across learners), and OUT/metadata.json with K. Question ids become `--prefix` + the id
("q12"), learner ids "s" + the learner's place. `nextstep train MODEL --data OUT` then trains on the same
interactions as `--data DIR` (docs/results.md, "the long format"). OUT must be new or empty; DIR is only read.
"""

import argparse
import json
import sys
from pathlib import Path

from nextstep.training.kt.data import load_dataset, write_long_csv


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="a knowledge-tracing data set directory")
    parser.add_argument("out", help="the directory to write (new or empty)")
    parser.add_argument("--prefix", default="q", help='text put before every question id (default "q"; "" keeps '
                                                      "the ids as they are)")
    args = parser.parse_args()
    data, out = Path(args.data), Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty")
    train, test = load_dataset(data)
    out.mkdir(parents=True, exist_ok=True)
    for ds, split in ((train, "train"), (test, "test")):
        path = write_long_csv(ds, out / f"{data.name}_{split}.csv.gz", question_prefix=args.prefix)
        print(f"{path}: {len(ds)} learners, {ds.n_interactions} interactions (from {ds.path}, {ds.fmt})")
    (out / "metadata.json").write_text(json.dumps({"n_cats": train.n_cats}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
