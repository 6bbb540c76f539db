"""Reference predictors on a GPCM synthetic set whose true item parameters are known.

    python bench/gpcm_references.py [--data ../shared/data/kt/deepgpcm_synthetic_500_200_4]

- bayes: knows every item's alpha and beta, infers the learner's ability online (grid posterior with the
  N(0, 1) prior the generator used) and predicts with the posterior predictive. No causal predictor can
  beat it in expectation; a trained model should come close.
- oracle: also knows the learner's true theta.
- fitted IRT: a plain GPCM fitted on the training file (joint MAP: per-student theta with an N(0, 1)
  prior, per-item log-alpha and ordered thresholds, L-BFGS; `nextstep.models.layers.irt.fit_gpcm`, which also
  warm-starts deep_gpcm), then the same online Bayesian ability inference as `bayes` with the fitted items.
  The strongest honest baseline here: it is the model that generated the data, so a neural knowledge tracer
  should approach it, not beat it.
- item majority: the most frequent response per item in the training file (for the no-model floor).
Prints the metrics of each on the test file, as `nextstep train` reports them.
"""

import argparse
import json
from pathlib import Path

import numpy as np

from nextstep.models.layers.irt import fit_gpcm
from nextstep.training.kt.data import load_dataset
from nextstep.training.kt.synthetic import gpcm_probs
from nextstep.training.metrics import ordinal_metrics

GRID = np.linspace(-5, 5, 401)  # ability values for the posterior


def bayes_predictions(sequences, alpha, beta, grid=GRID):
    log_prior = -0.5 * grid**2
    probs, targets = [], []
    for s in sequences:
        log_post = log_prior.copy()
        for q, r in zip(s.questions, s.responses, strict=True):
            p = gpcm_probs(grid, np.full_like(grid, alpha[q]), np.repeat(beta[q][None], len(grid), 0))  # (G, K)
            w = np.exp(log_post - log_post.max())
            probs.append((w / w.sum()) @ p)
            targets.append(r)
            log_post += np.log(p[:, r])
    return np.array(probs), np.array(targets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=Path("../shared/data/kt/deepgpcm_synthetic_500_200_4"))
    args = parser.parse_args()
    train, test = load_dataset(args.data)
    truth = json.loads((args.data / "true_irt_parameters.json").read_text())
    alpha = np.asarray(truth["question_params"]["discrimination"]["alpha"])
    beta = np.asarray(truth["question_params"]["difficulties"]["beta"])
    theta = np.asarray(truth["student_abilities"]["theta"])
    K = test.n_cats

    rows = {"bayes (true items, online ability)": bayes_predictions(test.sequences, alpha, beta)}
    # the generator writes students in order: the test file holds the last len(test) of them
    first_test = len(theta) - len(test)
    oracle = [gpcm_probs(np.full(len(s), theta[first_test + i]), alpha[s.questions], beta[s.questions])
              for i, s in enumerate(test.sequences)]
    rows["oracle (true items and ability)"] = (np.concatenate(oracle),
                                               np.concatenate([s.responses for s in test.sequences]))
    fitted_alpha, fitted_beta = fit_gpcm([s.questions for s in train.sequences], [s.responses for s in train.sequences],
                                         len(alpha), K)
    rows["fitted IRT (train file) + online ability"] = bayes_predictions(test.sequences, fitted_alpha, fitted_beta)
    counts = np.zeros((len(alpha), K))
    for s in train.sequences:
        np.add.at(counts, (s.questions, s.responses), 1)
    majority = np.eye(K)[counts.argmax(1)] * 0.97 + 0.01  # a little mass elsewhere keeps NLL finite
    rows["per-item majority"] = (np.concatenate([majority[s.questions] for s in test.sequences]),
                                 np.concatenate([s.responses for s in test.sequences]))
    print(f"{'predictor':44s} {'cat.acc':>8s} {'ord.acc':>8s} {'QWK':>7s} {'MAE':>7s} {'NLL':>7s}")
    for name, (p, y) in rows.items():
        m = ordinal_metrics(p, y)
        print(f"{name:44s} {m['categorical_accuracy']:8.3f} {m['ordinal_accuracy']:8.3f} {m['qwk']:7.3f} "
              f"{m['mae']:7.3f} {m['nll'] if 'majority' not in name else float('nan'):7.3f}")


if __name__ == "__main__":
    main()
