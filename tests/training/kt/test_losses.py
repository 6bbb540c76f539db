import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from nextstep.training.kt.losses import (
    CombinedLoss,
    class_weights,
    coral_loss,
    cross_entropy,
    cumulative_logits_from_log_probs,
    focal_loss,
    qwk_loss,
    weighted_ordinal_loss,
)
from nextstep.training.metrics import quadratic_weighted_kappa

ALL_LOSSES = {
    "ce": cross_entropy,
    "focal": focal_loss,
    "qwk": lambda lp, t: qwk_loss(lp, t, 4),
    "coral": lambda lp, t: coral_loss(cumulative_logits_from_log_probs(lp), t),
    "weighted_ordinal": lambda lp, t: weighted_ordinal_loss(lp, t, torch.tensor([1.0, 2.0, 1.0, 0.5])),
}


def _batch(n=32, k=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, k, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, k, (n,), generator=g)
    return logits, targets


def _log(probs):
    return torch.tensor(probs, dtype=torch.float64).log()


def test_cross_entropy_matches_nll_loss():
    logits, t = _batch()
    lp = F.log_softmax(logits, -1)
    torch.testing.assert_close(cross_entropy(lp, t), F.nll_loss(lp, t))
    # Leading dims are flattened.
    torch.testing.assert_close(cross_entropy(lp.view(4, 8, 4), t.view(4, 8)), F.nll_loss(lp, t))


def test_focal_gamma_zero_is_ce_and_hand_value():
    logits, t = _batch()
    lp = F.log_softmax(logits, -1)
    torch.testing.assert_close(focal_loss(lp, t, gamma=0.0), cross_entropy(lp, t))
    # p_t = .5: (1 - .5)^2 * ln 2 = .25 ln 2; alpha scales linearly.
    lp1 = _log([[0.5, 0.25, 0.25]])
    y = torch.tensor([0])
    assert focal_loss(lp1, y).item() == pytest.approx(0.25 * math.log(2))
    assert focal_loss(lp1, y, alpha=0.5).item() == pytest.approx(0.125 * math.log(2))


def test_qwk_loss_small_when_right_large_when_wrong():
    t = torch.tensor([0, 1, 2, 3, 1, 2])
    right = F.log_softmax(20.0 * F.one_hot(t, 4).double(), -1)
    wrong = F.log_softmax(20.0 * F.one_hot(3 - t, 4).double(), -1)
    assert qwk_loss(right, t, 4).item() < 1e-6
    assert qwk_loss(wrong, t, 4).item() > 1.0  # kappa < 0
    uniform = torch.full((6, 4), math.log(0.25), dtype=torch.float64)
    assert qwk_loss(uniform, t, 4).item() == pytest.approx(1.0, abs=1e-6)  # chance level


def test_qwk_loss_equals_one_minus_hard_qwk_for_confident_predictions():
    t = torch.tensor([0, 1, 2, 3])
    pred = torch.tensor([0, 2, 2, 1])  # the metrics hand example: kappa 3/8
    lp = F.log_softmax(40.0 * F.one_hot(pred, 4).double(), -1)
    hard = quadratic_weighted_kappa(t.numpy(), pred.numpy(), 4)
    assert hard == pytest.approx(3 / 8)
    assert qwk_loss(lp, t, 4).item() == pytest.approx(1 - hard, abs=1e-6)


def test_cumulative_logits_from_log_probs():
    # p = [.1, .2, .3, .4]: P(Y>0) = .9, P(Y>1) = .7, P(Y>2) = .4 -> logits ln 9, ln(7/3), ln(2/3).
    z = cumulative_logits_from_log_probs(_log([[0.1, 0.2, 0.3, 0.4]]))
    torch.testing.assert_close(
        z, torch.tensor([[math.log(9), math.log(7 / 3), math.log(2 / 3)]], dtype=torch.float64)
    )
    # A certain category gives P(Y>k) in {0, 1}, clamped to logit(1e-7) = -ln((1-1e-7)/1e-7) ~ -16.118.
    z = cumulative_logits_from_log_probs(_log([[0.0, 1.0, 0.0, 0.0]]))
    lim = math.log((1 - 1e-7) / 1e-7)
    torch.testing.assert_close(z, torch.tensor([[lim, -lim, -lim]], dtype=torch.float64))


def test_coral_loss_hand_example():
    # K = 4, y = 1 -> labels [y > k] = [1, 0, 0] for logits [2, 0, -1]:
    #   -ln sigmoid(2) = ln(1 + e^-2) ~ .126928; -ln(1 - sigmoid(0)) = ln 2 ~ .693147;
    #   -ln(1 - sigmoid(-1)) = ln(1 + e^-1) ~ .313262; mean over thresholds ~ .377779.
    z = torch.tensor([[2.0, 0.0, -1.0]], dtype=torch.float64)
    expected = (math.log1p(math.exp(-2)) + math.log(2) + math.log1p(math.exp(-1))) / 3
    assert coral_loss(z, torch.tensor([1])).item() == pytest.approx(expected)
    assert expected == pytest.approx(0.377779, abs=1e-6)


def test_weighted_ordinal_hand_example():
    lp = _log([[0.1, 0.6, 0.2, 0.1], [0.5, 0.1, 0.1, 0.3]])
    t = torch.tensor([1, 3])
    w = torch.tensor([1.0, 2.0, 1.0, 1.0])
    # Item 0: argmax 1 = y, D = 0, factor w_1 = 2 -> 2 * -ln .6 ~ 1.021651
    # Item 1: argmax 0, y = 3, D = 3, factor 1 * (1 + .5 * 3) = 2.5 -> 2.5 * -ln .3 ~ 3.009932
    # Mean ~ 2.015792
    expected = (2 * -math.log(0.6) + 2.5 * -math.log(0.3)) / 2
    assert weighted_ordinal_loss(lp, t, w, 0.5).item() == pytest.approx(expected)
    assert expected == pytest.approx(2.015792, abs=1e-6)
    # Quadratic: D = 9 -> factor 1 + 4.5 = 5.5.
    expected_q = (2 * -math.log(0.6) + 5.5 * -math.log(0.3)) / 2
    assert weighted_ordinal_loss(lp, t, w, 0.5, distance="quadratic").item() == pytest.approx(expected_q)
    # Zero penalty and no weights is plain CE.
    torch.testing.assert_close(weighted_ordinal_loss(lp, t, None, 0.0), cross_entropy(lp, t))
    with pytest.raises(ValueError, match="distance"):
        weighted_ordinal_loss(lp, t, w, distance="huber")


def test_weighted_ordinal_gradient_is_scaled_ce_gradient():
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.0]], dtype=torch.float64, requires_grad=True)
    t = torch.tensor([3])  # argmax 1, D = 2 -> factor 1 + .5 * 2 = 2
    weighted_ordinal_loss(F.log_softmax(logits, -1), t, None, 0.5).backward()
    p = F.softmax(logits.detach(), -1)
    torch.testing.assert_close(logits.grad, 2.0 * (p - F.one_hot(t, 4)))


def test_class_weights():
    # N = 100, K = 3: 100 / (3 * [10, 30, 60]) = [3.333, 1.111, .5556]
    w = class_weights([10, 30, 60])
    torch.testing.assert_close(w, torch.tensor([10 / 3, 10 / 9, 5 / 9]))
    torch.testing.assert_close(class_weights([10, 30, 60], "sqrt_balanced"), w.sqrt())
    # Clamped: 100001 / (2 * 1) -> 100; an absent class -> 100 as well.
    torch.testing.assert_close(class_weights([1, 100000]), torch.tensor([100.0, 100001 / 200000]))
    assert class_weights([0, 5])[0].item() == 100.0
    with pytest.raises(ValueError):
        class_weights([1, 2], "inverse")


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_gradients_flow_and_are_finite(name):
    logits, t = _batch()
    loss = ALL_LOSSES[name](F.log_softmax(logits, -1), t)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all() and logits.grad.abs().sum() > 0


@pytest.mark.parametrize("name", sorted(ALL_LOSSES))
def test_empty_batch_is_zero_with_grad(name):
    logits = torch.zeros(0, 4, requires_grad=True)
    loss = ALL_LOSSES[name](F.log_softmax(logits, -1), torch.zeros(0, dtype=torch.long))
    assert loss.item() == 0.0 and loss.requires_grad
    loss.backward()


def test_combined_from_spec_matches_weighted_sum():
    logits, t = _batch()
    lp = F.log_softmax(logits, -1)
    torch.testing.assert_close(CombinedLoss.from_spec("ce", 4)(lp, t), cross_entropy(lp, t))
    combo = CombinedLoss.from_spec(" ce=0.6, qwk=0.2 ,focal=0.2", 4)
    assert combo.weights == {"ce": 0.6, "qwk": 0.2, "focal": 0.2}
    expected = 0.6 * cross_entropy(lp, t) + 0.2 * qwk_loss(lp, t, 4) + 0.2 * focal_loss(lp, t)
    torch.testing.assert_close(combo(lp, t), expected)
    assert CombinedLoss.from_spec({"coral": 1.0}, 4).weights == {"coral": 1.0}


def test_combined_coral_uses_cum_logits_when_given():
    logits, t = _batch()
    lp = F.log_softmax(logits, -1)
    loss = CombinedLoss.from_spec("coral", 4)
    torch.testing.assert_close(loss(lp, t), coral_loss(cumulative_logits_from_log_probs(lp), t))
    z = torch.zeros(32, 3, dtype=torch.float64)
    assert loss(lp, t, cum_logits=z).item() == pytest.approx(math.log(2))


def test_combined_weighted_ordinal_uses_class_weights():
    logits, t = _batch()
    lp = F.log_softmax(logits, -1)
    w = class_weights(np.bincount(t.numpy(), minlength=4))
    loss = CombinedLoss(4, {"weighted_ordinal": 1.0}, ordinal_penalty=1.0, class_weights=w)
    torch.testing.assert_close(loss(lp, t), weighted_ordinal_loss(lp, t, w, 1.0))


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ("ce=0.5,foo=0.5", "foo"),
        ("ce=-1", "ce"),
        ("ce=0,qwk=0", "zero"),
        ("ce=abc", "ce"),
        ("ce,ce=2", "twice"),
        ("", "zero"),
    ],
)
def test_combined_validation_errors(spec, match):
    with pytest.raises(ValueError, match=match):
        CombinedLoss.from_spec(spec, 4)


def test_combined_rejects_wrong_category_count():
    with pytest.raises(ValueError, match="categories"):
        CombinedLoss.from_spec("ce", 4)(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long))
