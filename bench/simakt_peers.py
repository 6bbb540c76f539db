"""What other students' answers to the same question add to a trained SimAKT, measured before building a head.

    python bench/simakt_peers.py ARTIFACT --data DIR [--seed N] [--temperatures 1 0.3 0.1]

Training students only, split as training splits them (`--seed`, 10% validation students): the fit students
are the peers, the validation students are scored. Both are cut into chunks of the model's window, each
from a fresh state (the window rule with one cache). For every validation interaction (question q, position
t) the peers are every fit interaction with the same question row (for data without problem ids: the same
skill), and two numbers summarise them:

    plain      the mean of their responses
    weighted   the mean of their responses weighted by softmax(cos(h, h_peer) / temperature), where h is the
               model's question-specific knowledge read-out (what the answer MLP reads) before the answer, the
               student's at t and the peer's at the time the peer answered q

each as smoothed log-odds, with log(1 + peers); and the same two means of what the model expected of those
peers (its P(right) for each peer interaction, from the same pass), so that the difference says where the
model over- or underrates the question for students like this one. A logistic regression on [the model's
logit, features] is fitted on one half of the validation students (by student) and scored on the other, and
the other way round; the mean of the two halves' AUCs, against the model's logit alone on the same halves, says
how much the peers carry that the model does not. The test file is never read.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score

from nextstep.training.data import Vocabulary
from nextstep.training.kt.data import load_dataset, split_students
from nextstep.training.kt.simakt_export import load_simakt
from nextstep.training.kt.simakt_run import trajectories


@torch.no_grad()
def encode(model, trajs, students: list[str]) -> dict[str, np.ndarray]:
    """Per interaction: question row, response, logit, h (the read-out for the question asked), and which of
    the sorted distinct `students` (one id per trajectory) it belongs to."""
    number = {s: i for i, s in enumerate(sorted(set(students)))}
    out = {k: [] for k in ("q", "r", "logit", "h", "who")}
    for start in range(0, len(trajs), 64):
        part = trajs[start:start + 64]
        T = max(len(q) for q, _ in part)
        Q, R = np.zeros((len(part), T), np.int64), np.zeros((len(part), T), np.int64)
        M = np.zeros((len(part), T), bool)
        for i, (q, r) in enumerate(part):
            Q[i, :len(q)], R[i, :len(q)], M[i, :len(q)] = q, r, True
        q, r, m = torch.from_numpy(Q), torch.from_numpy(R), torch.from_numpy(M)
        o = model(q, r)
        h = model.read(model.embed(q), o.knowledge)
        out["q"].append(Q[M]), out["r"].append(R[M]), out["logit"].append(o.logits[m].numpy())
        who = [number[s] for s in students[start:start + 64]]
        out["h"].append(h[m].numpy()), out["who"].append(np.repeat(who, M.sum(1)))
    return {k: np.concatenate(v) for k, v in out.items()}


def log_odds(mean: np.ndarray, n: np.ndarray, prior: float, k: float = 2.0) -> np.ndarray:
    p = (np.nan_to_num(mean) * n + prior * k) / (n + k)
    return np.log(p / (1 - p))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("artifact")
    p.add_argument("--data", required=True)
    p.add_argument("--seed", type=int, default=0, help="the training run's seed (its validation split)")
    p.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.3, 0.1])
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    model, manifest = load_simakt(Path(args.artifact))
    model.eval()
    vocab = Vocabulary.from_json(json.loads((Path(args.artifact) / manifest["vocabularies"]["questions"]).read_text()))
    train, _ = load_dataset(args.data)
    fit_ds, valid_ds = split_students(train, 0.1, args.seed)
    peers = encode(model, *trajectories(fit_ds, vocab, model.cfg.window))
    val = encode(model, *trajectories(valid_ds, vocab, model.cfg.window))
    y, base = val["r"], val["logit"]
    order = np.argsort(peers["q"], kind="stable")
    qs, resp = peers["q"][order], peers["r"][order].astype(np.float64)
    expect = 1 / (1 + np.exp(-peers["logit"][order].astype(np.float64)))
    lo, hi = np.searchsorted(qs, val["q"], "left"), np.searchsorted(qs, val["q"], "right")
    n = (hi - lo).astype(np.float64)
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    keys, query = unit(peers["h"][order]), unit(val["h"])
    plain = np.array([resp[a:b].mean() if b > a else np.nan for a, b in zip(lo, hi, strict=True)])
    plain_e = np.array([expect[a:b].mean() if b > a else np.nan for a, b in zip(lo, hi, strict=True)])
    prior = float(resp.mean())
    half = val["who"] % 2  # by student: all of a student's chunks on one side

    def per_half(pred) -> float:  # the mean of the two halves' AUCs (pooling two fitted maps would blur them)
        return float(np.mean([roc_auc_score(y[half == h], pred[half == h]) for h in (0, 1)]))

    def crossfit(*features) -> float:
        X = np.column_stack([base, *features])
        pred = np.zeros(len(y))
        for h in (0, 1):
            fitted = LogisticRegression(max_iter=1000).fit(X[half != h], y[half != h])
            pred[half == h] = fitted.predict_proba(X[half == h])[:, 1]
        return per_half(pred)

    print(f"| {Path(args.data).name} | peers found for {np.mean(n > 0):.1%} of {len(y):,} validation interactions, "
          f"median {np.median(n):.0f} |")
    print("| features | validation AUC (mean of the two halves, each cross-fitted) |\n|---|---|")
    print(f"| the model's logit | {per_half(base):.4f} (pooled: {roc_auc_score(y, base):.4f}) |")
    print(f"| + plain peer mean | {crossfit(log_odds(plain, n, prior), np.log1p(n)):.4f} |")
    print(f"| + plain peer mean and what the model expected of them | "
          f"{crossfit(log_odds(plain, n, prior), log_odds(plain_e, n, prior), np.log1p(n)):.4f} |")
    for tau in args.temperatures:
        weighted, weighted_e = np.full(len(y), np.nan), np.full(len(y), np.nan)
        for i, (a, b) in enumerate(zip(lo, hi, strict=True)):
            if b > a:
                s = keys[a:b] @ query[i] / tau
                w = np.exp(s - s.max())
                weighted[i], weighted_e[i] = (w * resp[a:b]).sum() / w.sum(), (w * expect[a:b]).sum() / w.sum()
        answers = [log_odds(weighted, n, prior), log_odds(plain, n, prior)]
        both = crossfit(*answers, np.log1p(n))
        print(f"| + similarity-weighted peer mean, temperature {tau:g} (and the plain mean) | {both:.4f} |")
        four = crossfit(*answers, log_odds(weighted_e, n, prior), log_odds(plain_e, n, prior), np.log1p(n))
        print(f"| + both means and what the model expected of the same peers, temperature {tau:g} | {four:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
