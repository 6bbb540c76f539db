"""gap_shrink in training (issue 38 part 4): the network is fitted on its own curve, the rule (no weights) is on
the model a run returns. Fast: one tiny simulated user, one epoch."""

import numpy as np
import torch

from nextstep.models.time_aware import TimeAwareConfig
from nextstep.training.srs.reviews import simulate_reviews
from nextstep.training.srs.time_aware_loop import ReviewTensors, TimeAwareTrainConfig, fit

SMALL = {"d_model": 16, "ffn_dim": 32, "window": 24, "card_window": 6}


def test_gap_shrink_shapes_the_returned_model_not_the_fit():
    """The same seed with gap_shrink on and off gives the same weights; only the on model's config says so, and on is
    the default."""
    log = simulate_reviews(n_users=1, n_cards=12, n_days=12, reviews_per_day=8, seed=1)
    rows = np.arange(len(log))
    out = {}
    for on in (True, False):
        cfg = TimeAwareConfig(**SMALL, gap_shrink=on)
        model, _ = fit(ReviewTensors(log, cfg.window, cfg.card_window), rows, cfg,
                       TimeAwareTrainConfig(max_epochs=1, batch_size=128, calibrate=False, threads=1))
        assert model.cfg.gap_shrink is on
        out[on] = model.state_dict()
    for name, value in out[True].items():
        torch.testing.assert_close(value, out[False][name], atol=0, rtol=0)
    assert TimeAwareConfig().gap_shrink
