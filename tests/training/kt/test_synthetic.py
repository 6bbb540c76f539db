"""Tests for nextstep.training.kt.synthetic: the GPCM generator and its deep-gpcm file layout."""

from __future__ import annotations

import json

import numpy as np
import pytest

from nextstep.training.data import default_data_dir
from nextstep.training.kt.data import load_dataset
from nextstep.training.kt.synthetic import generate_gpcm, gpcm_probs, write_gpcm_dataset

SMALL = {"n_students": 60, "n_questions": 15, "n_cats": 4, "seq_len_range": (20, 40), "seed": 7}


def test_gpcm_probs_match_the_definition():
    theta, alpha, beta = 0.3, 1.4, np.array([-1.0, 0.2, 1.5])
    logits = np.array([0.0] + [sum(alpha * (theta - b) for b in beta[:k]) for k in range(1, 4)])
    expected = np.exp(logits) / np.exp(logits).sum()
    np.testing.assert_allclose(gpcm_probs(theta, alpha, beta), expected, rtol=1e-12)
    batch = gpcm_probs(np.zeros(5), np.ones(5), np.tile(beta, (5, 1)))
    assert batch.shape == (5, 4)
    np.testing.assert_allclose(batch.sum(axis=1), 1.0)


def test_shapes_ranges_and_split():
    data = generate_gpcm(**SMALL)
    assert data["theta"].shape == (60,) and data["alpha"].shape == (15,) and data["beta"].shape == (15, 3)
    assert (data["alpha"] > 0).all()
    assert (np.diff(data["beta"], axis=1) >= 0).all()  # ordered thresholds
    assert len(data["train"]) == 48 and len(data["test"]) == 12
    assert data["train"] + data["test"] == data["sequences"]
    lengths = [len(s) for s in data["sequences"]]
    assert min(lengths) >= 20 and max(lengths) < 40
    questions = np.concatenate([s.questions for s in data["sequences"]])
    responses = np.concatenate([s.responses for s in data["sequences"]])
    assert questions.min() >= 0 and questions.max() < 15
    assert set(np.unique(responses)) == {0, 1, 2, 3}  # every category occurs


def test_reproducible_for_a_seed():
    a, b, c = generate_gpcm(**SMALL), generate_gpcm(**SMALL), generate_gpcm(**{**SMALL, "seed": 8})
    for x, y in zip(a["sequences"], b["sequences"], strict=True):
        assert np.array_equal(x.questions, y.questions) and np.array_equal(x.responses, y.responses)
    np.testing.assert_array_equal(a["beta"], b["beta"])
    assert not np.array_equal(a["theta"], c["theta"])


def test_responses_follow_the_model():
    data = generate_gpcm(n_students=300, n_questions=20, n_cats=3, seq_len_range=(50, 51), seed=1)
    observed, expected = np.zeros(3), np.zeros(3)
    for student, s in enumerate(data["sequences"]):
        observed += np.bincount(s.responses, minlength=3)
        probs = gpcm_probs(data["theta"][student], data["alpha"][s.questions], data["beta"][s.questions])
        expected += probs.sum(axis=0)
    np.testing.assert_allclose(observed / observed.sum(), expected / expected.sum(), atol=0.01)


def test_written_files_round_trip(tmp_path):
    out = write_gpcm_dataset(tmp_path / "syn", **SMALL)
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "metadata.json",
        "synthetic_60_15_4_test.txt",
        "synthetic_60_15_4_train.txt",
        "true_irt_parameters.json",
    ]
    train, test = load_dataset(out)
    assert (len(train), len(test), train.n_cats) == (48, 12, 4)
    params = json.loads((out / "true_irt_parameters.json").read_text())
    assert params["question_params"]["difficulties"]["shape"] == [15, 3]
    assert len(params["student_abilities"]["theta"]) == 60
    meta = json.loads((out / "metadata.json").read_text())
    assert (meta["train_students"], meta["test_students"], meta["seq_len_range"]) == (48, 12, [20, 40])


REAL = default_data_dir() / "kt" / "deepgpcm_synthetic_500_200_4"


@pytest.mark.skipif(not REAL.is_dir(), reason=f"real data not found at {REAL}")
def test_reproduces_published_deepgpcm_set_byte_for_byte(tmp_path):
    out = write_gpcm_dataset(tmp_path)  # defaults: 500 students, 200 items, K=4, lengths 100..199, seed 42
    for name in [
        "synthetic_500_200_4_train.txt",
        "synthetic_500_200_4_test.txt",
        "true_irt_parameters.json",
        "metadata.json",
    ]:
        assert (out / name).read_bytes() == (REAL / name).read_bytes(), name
