"""The knowledge-tracing run's warm start: deep_gpcm fits its IRT start on the fitting students alone (never the
validation or test ones), the start is validated as epoch 0, and the manifest records it."""

import json

import numpy as np
import pytest

import nextstep.models.deep_gpcm as deep_gpcm_module
from nextstep.training.data import Vocabulary, hide_ids
from nextstep.training.kt.data import load_dataset, split_students
from nextstep.training.kt.loop import TrainConfig
from nextstep.training.kt.run import train_model
from nextstep.training.kt.synthetic import write_gpcm_dataset

SMALL = {"key_dim": 8}


@pytest.mark.slow  # a whole run and export; the fast tier trains and exports deep_gpcm once (conftest `artifacts`)
def test_the_irt_fit_sees_the_fitting_students_only(tmp_path, monkeypatch):
    data = write_gpcm_dataset(tmp_path / "data", n_students=50, n_questions=10, seq_len_range=(15, 25), seed=4)
    seen = []

    def recording_fit(questions, responses, n_items, n_cats, **kw):
        seen.append((questions, responses))
        return fit(questions, responses, n_items, n_cats, **kw)

    fit = deep_gpcm_module.fit_gpcm
    monkeypatch.setattr(deep_gpcm_module, "fit_gpcm", recording_fit)
    cfg = TrainConfig(epochs=2, seed=3, model=SMALL)
    manifest = train_model("deep_gpcm", data, tmp_path / "out", cfg=cfg, progress=False, log=False)

    train, test = load_dataset(data)
    fitting, valid = split_students(train, cfg.valid_fraction, cfg.seed)
    vocab = Vocabulary.build(np.concatenate([s.questions for s in fitting.sequences]), cfg.min_question_count)
    # (as training sees them: the seeded share given through the unknown row included, so that it fits row 1 too)
    rows = hide_ids([vocab.encode(s.questions) for s in fitting.sequences], cfg.unknown_share, cfg.seed)
    (questions, responses), = seen  # one fit
    assert len(questions) == len(fitting) == manifest["data"]["n_train_students"]
    for q, r, s, expected in zip(questions, responses, fitting.sequences, rows, strict=True):  # the fitting students
        np.testing.assert_array_equal(q, expected)
        np.testing.assert_array_equal(r, s.responses)
    others = {tuple(s.responses) for s in valid.sequences + test.sequences}
    assert not others & {tuple(r) for r in responses}

    assert manifest["model_config"]["ability"] == "bayes" and manifest["model_config"]["irt_init"] is True
    assert manifest["training"]["warm_start"]["irt_init"]["max_error"] < 1e-3  # float32 least squares
    history = json.loads((tmp_path / "out" / "report" / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [0, 1, 2] and manifest["training"]["epochs_run"] == 2
    best = [h for h in history if h["best"]][-1]
    assert manifest["training"]["best_epoch"] == best["epoch"]
    assert manifest["metrics"]["valid"]["nll"] == best["valid_nll"]


def test_without_a_warm_start_there_is_no_epoch_0(artifact_tree):
    """The session's attention_gpcm run (tests/conftest.py): a Deep-GPCM without irt_init, one epoch."""
    run = artifact_tree / "attention_gpcm" / "1"
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["model_config"]["irt_init"] is False and manifest["train_config"]["epochs"] == 1
    history = json.loads((run / "report" / "metrics.json").read_text())["history"]
    assert [h["epoch"] for h in history] == [1] and "warm_start" not in manifest["training"]
