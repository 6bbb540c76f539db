"""Synthetic ordinal knowledge-tracing data from a Generalized Partial Credit Model (GPCM).

Each student has a fixed ability ``theta ~ N(0, 1)``; each item a discrimination
``alpha ~ LogNormal(0, 0.3)`` and K-1 ordered thresholds ``beta`` (a base difficulty b ~ N(0, 1),
then K-1 draws from N(b, 0.5), sorted). The response distribution is

    P(Y = k) ∝ exp( sum_{j<k} alpha * (theta - beta_j) ),   k = 0..K-1  (k = 0 has logit 0).

Random numbers are drawn with numpy's legacy ``RandomState`` in the same order as the public
deep-gpcm generator (``utils/data_gen.py``), so ``write_gpcm_dataset(dir)`` with the defaults
reproduces its ``synthetic_500_200_4`` set (seed 42) byte for byte:

1. theta (n_students normals), 2. alpha (n_questions log-normals), 3. per item: base difficulty,
then K-1 thresholds; 4. per student: length ~ randint(lo, hi) (hi exclusive), the items
(uniform with replacement), then one uniform per answer, inverted through the category CDF.
The first ``int(n_students * train_fraction)`` students form the train split, the rest the test split.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np

from nextstep.training.kt.data import Sequence


def gpcm_probs(theta: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> np.ndarray:
    """GPCM category probabilities, shape ``(..., K)``, for broadcastable theta (...), alpha (...),
    beta (..., K-1)."""
    theta = np.asarray(theta, dtype=np.float64)[..., None]
    alpha = np.asarray(alpha, dtype=np.float64)[..., None]
    steps = np.cumsum(alpha * (theta - np.asarray(beta, dtype=np.float64)), axis=-1)
    logits = np.concatenate([np.zeros(steps.shape[:-1] + (1,)), steps], axis=-1)
    expd = np.exp(logits - logits.max(axis=-1, keepdims=True))  # shift for numerical stability
    return expd / expd.sum(axis=-1, keepdims=True)


def generate_gpcm(
    n_students: int = 500,
    n_questions: int = 200,
    n_cats: int = 4,
    seq_len_range: tuple[int, int] = (100, 200),
    seed: int = 42,
    train_fraction: float = 0.8,
) -> dict:
    """Draw GPCM parameters and response sequences.

    Returns a dict with ``theta`` (n_students,), ``alpha`` (n_questions,), ``beta``
    (n_questions, n_cats-1), ``sequences`` (one `Sequence` per student, id = its index),
    ``train`` / ``test`` (the split of ``sequences``) and the generation settings.
    Sequence lengths are uniform on ``[lo, hi)`` (numpy ``randint`` convention).
    """
    lo, hi = seq_len_range
    if n_cats < 2 or not 0 < lo < hi:
        raise ValueError(f"need n_cats >= 2 and 0 < lo < hi, got {n_cats=}, {seq_len_range=}")
    rng = np.random.RandomState(seed)  # legacy generator: the stream the published set was drawn from
    theta = rng.normal(0.0, 1.0, n_students)
    alpha = rng.lognormal(0.0, 0.3, n_questions)
    beta = np.zeros((n_questions, n_cats - 1))
    for q in range(n_questions):
        base = rng.normal(0.0, 1.0)
        beta[q] = np.sort(rng.normal(base, 0.5, n_cats - 1))

    sequences = []
    for student in range(n_students):
        length = rng.randint(lo, hi)
        questions = rng.randint(0, n_questions, size=length)
        # Inverse-CDF sampling, one uniform per answer: what RandomState.choice(K, p=probs) does.
        cdf = np.cumsum(gpcm_probs(theta[student], alpha[questions], beta[questions]), axis=-1)
        cdf /= cdf[:, -1:]
        uniforms = rng.random_sample(length)
        responses = (cdf <= uniforms[:, None]).sum(axis=1)
        sequences.append(Sequence(str(student), questions, responses))

    n_train = int(n_students * train_fraction)
    return {
        "theta": theta,
        "alpha": alpha,
        "beta": beta,
        "sequences": sequences,
        "train": sequences[:n_train],
        "test": sequences[n_train:],
        "n_students": n_students,
        "n_questions": n_questions,
        "n_cats": n_cats,
        "seq_len_range": (lo, hi),
        "seed": seed,
    }


def _write_three_line(path: Path, sequences: list[Sequence]) -> None:
    with open(path, "w", newline="\n") as f:
        for s in sequences:
            f.write(f"{len(s)}\n{','.join(map(str, s.questions))}\n{','.join(map(str, s.responses))}\n")


def _dump_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2))  # deep-gpcm's json.dump(indent=2): no final newline


def write_gpcm_dataset(out_dir: str | os.PathLike, **kwargs) -> Path:
    """Generate (``**kwargs`` as for `generate_gpcm`) and write a deep-gpcm style data set into
    ``out_dir``: ``synthetic_{S}_{Q}_{K}_train.txt`` / ``_test.txt`` (three-line format),
    ``true_irt_parameters.json`` and ``metadata.json``. Returns ``out_dir``."""
    data = generate_gpcm(**kwargs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    S, Q, K = data["n_students"], data["n_questions"], data["n_cats"]
    name = f"synthetic_{S}_{Q}_{K}"
    _write_three_line(out / f"{name}_train.txt", data["train"])
    _write_three_line(out / f"{name}_test.txt", data["test"])

    theta, alpha, beta = data["theta"], data["alpha"], data["beta"]
    summary = lambda x: {"mean": float(np.mean(x)), "std": float(np.std(x))}  # noqa: E731
    _dump_json(
        out / "true_irt_parameters.json",
        {
            "student_abilities": {"theta": theta.tolist(), **summary(theta)},
            "question_params": {
                "discrimination": {"alpha": alpha.tolist(), **summary(alpha)},
                "difficulties": {
                    "beta": beta.tolist(),
                    "shape": list(beta.shape),
                    "description": f"{K - 1} thresholds per question",
                },
            },
            "model_info": {"model_type": "GPCM", "n_cats": K, "param_gen": "synthetic"},
        },
    )
    _dump_json(
        out / "metadata.json",
        {
            "dataset_name": name,
            "n_students": S,
            "n_questions": Q,
            "n_cats": K,
            "response_type": "ordered_categorical",
            "format": "new_format",
            "description": f"Synthetic GPCM data: {S} students, {Q} questions, {K} categories",
            "train_students": len(data["train"]),
            "test_students": len(data["test"]),
            "seq_len_range": list(data["seq_len_range"]),
        },
    )
    return out


def write_problem_dataset(out_dir: str | os.PathLike, *, n_train: int = 120, n_test: int = 40,
                          length: tuple[int, int] = (5, 60), n_skills: int = 7, seed: int = 0) -> Path:
    """A small binary data set in DTransformer's format (train.txt, test.txt: a length line, then problem,
    skill and response lines) for tests and benchmarks: each student has a Rasch ability, each skill a
    difficulty, each skill three problems (id = skill * 10 + 0..2)."""
    rng = np.random.default_rng(seed)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    difficulty = np.linspace(-1.5, 1.5, n_skills)
    for name, n in (("train.txt", n_train), ("test.txt", n_test)):
        lines = []
        for _ in range(n):
            L = int(rng.integers(*length))
            q = rng.integers(1, n_skills + 1, L)
            p = q * 10 + rng.integers(0, 3, L)
            r = (rng.random(L) < 1 / (1 + np.exp(difficulty[q - 1] - rng.normal()))).astype(int)
            lines += [str(L), ",".join(map(str, p)), ",".join(map(str, q)), ",".join(map(str, r))]
        (out / name).write_text("\n".join(lines) + "\n")
    return out


def replay_gpcm(name: str, artifact: Path, manifest: dict) -> list[str]:
    """What `nextstep demo` prints of a GPCM model trained on a generated set: its held-out metrics, then a learner
    replayed through the exported ONNX graphs as the service runs them (step per answer, then predict)."""
    from nextstep.training.export import onnx_session

    test = manifest["metrics"]["test"]
    lines = [f"{name:15s} test: accuracy {test['categorical_accuracy']:.3f}  qwk {test['qwk']:.3f}  "
             f"nll {test['nll']:.3f}   parity ok: {manifest['parity']['passed']}"]
    vocab = json.loads((artifact / manifest["vocabularies"]["questions"]).read_text())["ids"]
    step, predict = onnx_session(artifact / "step.onnx"), onnx_session(artifact / "predict.onnx")
    state = {s["name"]: np.load(artifact / s["file"])[None] for s in manifest["state"]}
    history = [(vocab[0], 3), (vocab[1], 2), (vocab[2], 3)]
    for qid, response in history:
        feeds = {**state, "question": np.array([vocab.index(qid) + 2]), "response": np.array([response])}
        outs = step.run(None, {i.name: feeds[i.name] for i in step.get_inputs()})
        state = dict(zip(state, outs, strict=True))
    feeds = {**state, "questions": np.array([[vocab.index(vocab[3]) + 2]])}
    probs, theta, alpha, beta = predict.run(None, {i.name: feeds[i.name] for i in predict.get_inputs()})
    lines.append(f"{'':15s} after {history}: P(response to {vocab[3]}) = {[round(float(p), 3) for p in probs[0, 0]]}, "
                 f"theta {theta[0, 0]:.2f}, alpha {alpha[0, 0]:.2f}, beta {[round(float(b), 2) for b in beta[0, 0]]}")
    return lines
