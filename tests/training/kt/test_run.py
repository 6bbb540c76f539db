"""The knowledge-tracing run's lines and figures that need no training: the model's size, the base rate."""

import numpy as np
import pytest

from nextstep.training.families import family
from nextstep.training.kt.data import KTDataset, Sequence
from nextstep.training.kt.run import LARGE_VOCABULARY, base_rate, describe_model
from nextstep.training.metrics import ordinal_metrics


def test_the_model_line_gives_its_size_and_a_large_vocabulary_says_why_training_is_slow():
    """A million question ids loaded, then no epoch ended within minutes, and nothing said what to expect."""
    model = family("dkt").sample_model()
    n = sum(p.numel() for p in model.parameters())
    assert describe_model(model, 10, 5) == [
        f"model: {n:,} parameters ({n * 4 / 1024:.1f} KB; about {n * 16 / 1024:.1f} KB in training, with their "
        "gradients and Adam's moments); 10 questions have a row of their own"]
    _, warning = describe_model(model, LARGE_VOCABULARY + 1, 5)
    assert warning == (f"warning: {LARGE_VOCABULARY + 1:,} questions with a row of their own: every training step "
                       "updates all of them, so a step takes time in proportion to their number; a larger "
                       "min_question_count in --config (now 5) gives the rarer questions the shared unknown row")


def test_the_base_rate_scores_the_fitting_learners_response_shares():
    fit = KTDataset([Sequence("a", np.arange(4), np.array([0, 0, 0, 2]))], 3, "x_train.txt", "three_line")
    targets = np.array([0, 2, 1])
    shares = np.array([4, 1, 2]) / 7  # counts + 1
    baseline = base_rate(fit, targets, ordinal_metrics)
    assert baseline["name"] == "base rate" and baseline["categorical_accuracy"] == pytest.approx(1 / 3)
    assert baseline["nll"] == pytest.approx(-np.log(shares[targets]).mean())
