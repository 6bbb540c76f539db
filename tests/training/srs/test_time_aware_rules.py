"""Rules without weights in training (issue 38 part 4): the network is fitted on its own curve, the rules are on
the model a run returns. Fast: one tiny simulated user, one epoch."""

import numpy as np
import torch

from nextstep.models.time_aware import TimeAwareConfig
from nextstep.training.srs.reviews import simulate_reviews
from nextstep.training.srs.time_aware_loop import ReviewTensors, TimeAwareTrainConfig, fit

SMALL = {"d_model": 16, "ffn_dim": 32, "window": 24, "card_window": 6}


def test_rules_without_weights_shape_the_returned_model_not_the_fit():
    """The same seed with gap_shrink on and off, and with interval ratio bounds, gives the same weights; only the
    returned model's config says which rules it answers with."""
    log = simulate_reviews(n_users=1, n_cards=12, n_days=12, reviews_per_day=8, seed=1)
    rows = np.arange(len(log))
    out = []
    for rules in ({"gap_shrink": True}, {"gap_shrink": False},
                  {"gap_shrink": False, "interval_ratio_max": 2.0, "interval_ratio_min": 0.5}):
        cfg = TimeAwareConfig(**SMALL, **rules)
        model, _ = fit(ReviewTensors(log, cfg.window, cfg.card_window), rows, cfg,
                       TimeAwareTrainConfig(max_epochs=1, batch_size=128, calibrate=False, threads=1))
        assert {k: getattr(model.cfg, k) for k in rules} == rules
        out.append(model.state_dict())
    for other in out[1:]:
        for name, value in out[0].items():
            torch.testing.assert_close(value, other[name], atol=0, rtol=0)
