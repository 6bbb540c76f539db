"""The answer-order measurement: it finds no fall where the model is ordered by construction, it sees falls either
way (a model and its mirror image share the steps between them), and it scores an artifact's own held-out students."""

import json

import pytest
import torch

from nextstep.models.deep_gpcm import GPCMConfig, deep_gpcm
from nextstep.training.kt.answer_order import answer_order, held_out, main

TINY = {"n_questions": 20, "memory_size": 3, "key_dim": 8, "value_dim": 16, "summary_dim": 8}


def sequences(n: int, n_cats: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 15, (n,), generator=g)
    return [(torch.randint(2, TINY["n_questions"], (int(t),), generator=g).numpy(),
             torch.randint(0, n_cats, (int(t),), generator=g).numpy()) for t in lengths]


def test_the_bayes_ability_never_falls():
    torch.manual_seed(0)
    model = deep_gpcm(GPCMConfig(**TINY, n_cats=4))  # ordinal data: the Bayes filter, ordered by construction
    result = answer_order(model, sequences(12, 4), batch_size=5)
    assert set(result) == {f"{w}_{m}" for w in ("same", "next") for m in ("theta", "expected_score")}
    for name, found in result.items():
        assert found["share"] == 0.0, name
    assert result["same_theta"]["steps"] == sum(len(q) for q, _ in sequences(12, 4))
    assert result["next_theta"]["steps"] == result["same_theta"]["steps"] - 12  # a last step has no next question


def test_a_model_and_its_mirror_image_fall_on_different_steps():
    torch.manual_seed(1)
    model = deep_gpcm(GPCMConfig(**TINY, n_cats=2, learner_dim=4))
    seqs = sequences(20, 2, seed=2)
    before = answer_order(model, seqs, tolerance=0.0)
    with torch.no_grad():  # theta -> -theta: every rise becomes a fall
        model.head.ability.weight.neg_()
        model.head.ability.bias.neg_()
    after = answer_order(model, seqs, tolerance=0.0)
    for where in ("same", "next"):
        a, b = before[f"{where}_theta"]["share"], after[f"{where}_theta"]["share"]
        assert 0 < a < 1 and 0 < b < 1 and 0.99 <= a + b <= 1.0, (where, a, b)


def test_an_artifacts_validation_students_are_its_runs(artifacts, capsys):
    """On the session's deep_gpcm artifact (trained by train_model, tests/conftest.py)."""
    root, data = artifacts
    art = root / "deep_gpcm" / "v1"
    manifest = json.loads((art / "manifest.json").read_text())
    _, valid = held_out(art, data, "valid")
    _, test = held_out(art, data, "test")
    assert len(valid) == manifest["data"]["n_valid_students"] and len(test) == manifest["data"]["n_test_students"]
    assert len(valid) > 0 and len(test) > 0
    main([str(art), "--data", str(data), "--students", "valid", "--steps", "5"])
    assert '"same_theta"' in capsys.readouterr().out
    with pytest.raises(SystemExit):  # no steps is no measurement: refused, not an empty answer
        main([str(art), "--data", str(data), "--steps", "0"])
    assert "--steps must be at least 1" in capsys.readouterr().err
