"""Does a better answer ever make the model think less of the learner? Measured on held-out students.

    python -m nextstep.training.kt.answer_order ARTIFACT --data DIR [--students test|valid] [--steps 200]

At every step of every sequence the model's state (the streaming API, as served) takes each possible answer in turn;
for each pair of neighbouring answers k < k+1 the read-outs after them are compared, on the question just answered
and on the next question of the sequence. A share is the fraction of steps where some better answer gives a lower
theta (or a lower expected score, sum_k k P(k)) by more than `tolerance`. An ordered model (the Bayes ability) has
none; DKT-like read-outs are known to have some (Yeung & Yeung, "Addressing two problems in deep knowledge tracing
via prediction-consistent regularization", L@S 2018).
"""

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from ..families import family
from .data import split_students
from .run import encode, load_model


@torch.no_grad()
def answer_order(model, sequences: list[tuple[np.ndarray, np.ndarray]], steps: int | None = None,
                 batch_size: int = 256, tolerance: float = 1e-4) -> dict:
    """Shares of steps (and the worst falls) where a better answer lowers theta or the expected score, on the
    question answered ("same") and on the next one ("next"). `steps`: the first that many of each sequence."""
    model.eval()
    sequences = sorted(sequences, key=lambda s: -len(s[0]))  # batches of like lengths
    falls: dict[str, list[np.ndarray]] = {}
    for start in range(0, len(sequences), batch_size):
        group = sequences[start:start + batch_size]
        length = max(len(q) for q, _ in group) if steps is None else min(steps, max(len(q) for q, _ in group))
        q = np.zeros((len(group), length), np.int64)
        r = np.zeros((len(group), length), np.int64)
        real = np.zeros((len(group), length), bool)
        for i, (qs, rs) in enumerate(group):
            n = min(len(qs), length)
            q[i, :n], r[i, :n], real[i, :n] = qs[:n], rs[:n], True
        q, r = torch.from_numpy(q), torch.from_numpy(r)
        state = model.init_state(len(group))
        for t in range(length):
            after = [model.step(state, q[:, t], torch.full_like(q[:, t], k)) for k in range(model.cfg.n_cats)]
            for where, column, live in (("same", t, real[:, t]), ("next", t + 1, real[:, t + 1] if t + 1 < length
                                                                    else np.zeros(len(group), bool))):
                if not live.any():
                    continue
                outs = [model.readout(s, q[:, column].unsqueeze(1)) for s in after]  # live: column < length
                expected = torch.stack([(o.log_probs.exp()[:, 0] * torch.arange(o.log_probs.shape[-1])).sum(-1)
                                        for o in outs], -1)
                _fall(falls, f"{where}_expected_score", expected, live)
                if getattr(outs[0], "theta", None) is not None:
                    _fall(falls, f"{where}_theta", torch.stack([o.theta[:, 0] for o in outs], -1), live)
            state = model.step(state, q[:, t], r[:, t])
    result = {}
    for name, values in falls.items():
        v = np.concatenate(values)
        result[name] = {"share": float(np.mean(v > tolerance)), "worst": float(v.max()), "steps": int(len(v))}
    return result


def _fall(falls: dict, name: str, values: torch.Tensor, live: np.ndarray) -> None:
    """values (B, K) after each answer -> the largest fall from an answer to the next better one, per live row."""
    drop = (values[:, :-1] - values[:, 1:]).max(-1).values.numpy()
    falls.setdefault(name, []).append(drop[live])


def held_out(artifact: str | Path, data_dir: str | Path, students: str) -> tuple:
    """(model, encoded sequences) of an artifact's test students, or of its run's validation students (the same
    split of the training file, from the manifest's seed and valid_fraction)."""
    model, vocab, manifest = load_model(artifact)
    read, *_ = family(manifest["name"]).parts()
    train_ds, test_ds = read(data_dir, None)
    if students == "valid":
        cfg = manifest["train_config"]
        _, test_ds = split_students(train_ds, cfg["valid_fraction"], cfg["seed"])
    return model, encode(test_ds, vocab)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact")
    parser.add_argument("--data", required=True)
    parser.add_argument("--students", choices=("test", "valid"), default="test")
    parser.add_argument("--steps", type=int, default=None, help="the first STEPS of each sequence (default all)")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    torch.set_num_threads(1)
    model, sequences = held_out(args.artifact, args.data, args.students)
    print(json.dumps(answer_order(model, sequences, args.steps), indent=1))


if __name__ == "__main__":
    main()
