"""The flashcard training loop's window hiding (hide_fields): reviews without a state or an answer time, as an app may
send them, are part of what training shows the network."""

import math

import numpy as np
import torch

from nextstep.models.time_aware import TimeAwareConfig, TimeAwareTransformer, Window
from nextstep.training.srs.reviews import simulate_reviews
from nextstep.training.srs.time_aware_loop import ReviewTensors, _loss, hide_fields

SMALL = TimeAwareConfig(d_model=16, ffn_dim=32, window=24, card_window=6)


def windows(n: int = 4000):
    log = simulate_reviews(n_users=2, n_cards=60, n_days=80, seed=3)
    rt = ReviewTensors(log, SMALL.window, SMALL.card_window)
    return rt, rt.batch(torch.arange(min(n, len(log))))[0]


def test_hiding_blanks_whole_windows_states_and_answer_times_apart_at_the_share_asked():
    _, state = windows()
    torch.manual_seed(0)
    hidden = hide_fields(state, 0.25)
    no_state = (hidden[5] == -1).all(1)
    no_duration = torch.isnan(hidden[4]).all(1)
    for gone in (no_state, no_duration):
        assert abs(gone.float().mean().item() - 0.25) < 0.03
    assert 0.03 < (no_state & no_duration).float().mean().item() < 0.1  # drawn apart: about 0.25^2
    # every other window, and every other field, is as it was
    np.testing.assert_array_equal(hidden[5][~no_state], state[5][~no_state])
    np.testing.assert_array_equal(hidden[4][~no_duration], state[4][~no_duration])
    assert (state[5] >= 0).all() and not torch.isnan(state[4]).any()  # the simulated log has both everywhere
    for k in (0, 1, 2, 3, 6, 7, 8, 9):
        assert torch.equal(hidden[k], state[k]) or (torch.isnan(hidden[k]) == torch.isnan(state[k])).all()
    assert hide_fields(state, 0.0) is state


def test_only_hiding_trains_the_unknown_state_row_and_the_unknown_answer_time_weight():
    rt, _ = windows()
    rows = torch.arange(512)
    unknown = []
    for hide in (0.0, 0.5):
        torch.manual_seed(0)
        model = TimeAwareTransformer(SMALL)
        loss, _ = _loss(model, rt, rows, duration_weight=0.5, hide=hide)
        loss.backward()
        unknown.append((model.state_emb.weight.grad[4].abs().sum().item(),
                        model.row_num.weight.grad[:, -1].abs().sum().item()))  # the answer-time-unknown feature
    assert unknown[0] == (0.0, 0.0)
    assert unknown[1][0] > 0 and unknown[1][1] > 0
    assert not math.isnan(sum(unknown[1]))


def test_a_window_without_states_or_answer_times_is_a_valid_window():
    _, state = windows(64)
    torch.manual_seed(1)
    hidden = hide_fields(state, 1.0)
    model = TimeAwareTransformer(SMALL).eval()
    with torch.no_grad():
        pred = model.readout(Window(*hidden[:8]), hidden[0][:, -1], hidden[1][:, -1], hidden[2][:, -1] + 86400.0)
    assert torch.isfinite(pred.recall).all() and torch.isfinite(pred.log_duration).all()


def test_each_users_day_boundary_comes_from_their_data():
    """Every review carries its user's scheduler day boundary (seconds after 00:00 UTC): the log's own per user (an
    Anki collection's rollover, a CSV's day columns), else the model's default."""
    log = simulate_reviews(n_users=2, n_cards=20, n_days=10, seed=3)
    first, second = log.user_ids
    log.meta["day_start_ms"] = {first: 1_700_000_000_000 + 20 * 3_600_000}  # the second user's is not known
    rt = ReviewTensors(log, SMALL.window, SMALL.card_window, day_start_hour=4.0)
    expected = (1_700_000_000_000 % 86_400_000) / 1000.0 + 20 * 3600.0
    np.testing.assert_array_equal(rt.user_day_start, [expected % 86400.0, 4 * 3600.0])
    np.testing.assert_array_equal(rt.day_start.numpy(), np.repeat(rt.user_day_start, np.diff(log.offsets)))
    state = rt.batch(torch.arange(len(log)))[0]
    assert torch.equal(state[10], rt.day_start)  # what the model reads
