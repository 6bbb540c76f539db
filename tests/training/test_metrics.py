import math

import numpy as np
import pytest

from nextstep.training.metrics import (
    calibration_curve,
    confusion_matrix,
    expected_value,
    ordinal_metrics,
    quadratic_weighted_kappa,
    roc_auc,
)

# K = 4, four items. argmax per row: 0, 2, 2, 1 against targets 0, 1, 2, 3.
PROBS = np.array(
    [
        [0.7, 0.1, 0.1, 0.1],  # y=0, pred 0, |err| 0, p_y 0.7
        [0.1, 0.3, 0.5, 0.1],  # y=1, pred 2, |err| 1, p_y 0.3
        [0.1, 0.2, 0.6, 0.1],  # y=2, pred 2, |err| 0, p_y 0.6
        [0.2, 0.5, 0.1, 0.2],  # y=3, pred 1, |err| 2, p_y 0.2
    ]
)
TARGETS = np.array([0, 1, 2, 3])


def test_confusion_matrix_rows_are_truth():
    C = confusion_matrix(TARGETS, PROBS.argmax(1), 4)
    expected = np.zeros((4, 4), dtype=int)
    expected[0, 0] = expected[1, 2] = expected[2, 2] = expected[3, 1] = 1
    np.testing.assert_array_equal(C, expected)


def test_qwk_by_hand():
    # O has ones at (0,0), (1,2), (2,2), (3,1); W = (i-j)^2 / 9.
    # sum(W*O) = (0 + 1 + 0 + 4) / 9 = 5/9.
    # Marginals: true [1,1,1,1], pred [1,1,2,0]; E[i, j] = pred_j / 4 = [.25, .25, .5, 0] in every row.
    # sum_j E[i,j] (i-j)^2 = .25 i^2 + .25 (i-1)^2 + .5 (i-2)^2:
    #   i=0: 0 + .25 + 2 = 2.25; i=1: .25 + 0 + .5 = .75; i=2: 1 + .25 + 0 = 1.25; i=3: 2.25 + 1 + .5 = 3.75
    # total 8, so sum(W*E) = 8/9 and kappa = 1 - (5/9) / (8/9) = 3/8.
    assert quadratic_weighted_kappa(TARGETS, PROBS.argmax(1), 4) == pytest.approx(3 / 8)


def test_ordinal_metrics_by_hand():
    m = ordinal_metrics(PROBS, TARGETS)
    assert set(m) == {"categorical_accuracy", "ordinal_accuracy", "qwk", "mae", "nll", "n"}
    assert m["categorical_accuracy"] == pytest.approx(2 / 4)  # errors 0,1,0,2 -> two exact
    assert m["ordinal_accuracy"] == pytest.approx(3 / 4)  # three within one category
    assert m["mae"] == pytest.approx((0 + 1 + 0 + 2) / 4)
    assert m["qwk"] == pytest.approx(3 / 8)
    # nll = -(ln .7 + ln .3 + ln .6 + ln .2) / 4 = -ln(.0252) / 4 ~= 0.92022
    assert m["nll"] == pytest.approx(-math.log(0.7 * 0.3 * 0.6 * 0.2) / 4)
    assert m["nll"] == pytest.approx(0.92022, abs=1e-5)
    assert m["n"] == 4


def test_perfect_predictions_give_qwk_one():
    y = np.array([0, 1, 2, 3, 3, 1])
    probs = np.eye(4)[y] * 0.97 + 0.01  # rows sum to 1, argmax == y
    m = ordinal_metrics(probs, y)
    assert m["qwk"] == pytest.approx(1.0)
    assert m["categorical_accuracy"] == 1.0 and m["mae"] == 0.0


def test_qwk_undefined_is_zero():
    # A single class on both sides: sum(W*E) = 0, kappa undefined.
    assert quadratic_weighted_kappa(np.array([2, 2, 2]), np.array([2, 2, 2]), 4) == 0.0
    assert quadratic_weighted_kappa(np.array([], dtype=int), np.array([], dtype=int), 4) == 0.0


def test_qwk_maximal_disagreement_is_minus_one():
    # true [0, 3], pred [3, 0]: sum(W*O) = 2 (two items at distance 3, weight 1);
    # E = outer([1,0,0,1], [1,0,0,1]) / 2 -> sum(W*E) = (.5 + .5) * 1 = 1; kappa = 1 - 2/1 = -1.
    assert quadratic_weighted_kappa(np.array([0, 3]), np.array([3, 0]), 4) == pytest.approx(-1.0)


def test_roc_auc_with_ties_counts_half_pairs():
    y = np.array([0, 0, 1, 1, 1])
    s = np.array([0.1, 0.4, 0.4, 0.8, 0.4])
    # 3 positives x 2 negatives = 6 pairs. Positive 0.4 (twice): beats 0.1 (1), ties 0.4 (1/2) -> 1.5 each.
    # Positive 0.8 beats both -> 2. Total (1.5 + 1.5 + 2) / 6 = 5/6.
    assert roc_auc(y, s) == pytest.approx(5 / 6)
    assert roc_auc(y, -s) == pytest.approx(1 / 6)
    assert math.isnan(roc_auc(np.array([1, 1]), np.array([0.2, 0.3])))


def test_binary_metrics_add_auc_and_accuracy():
    probs = np.array([[0.9, 0.1], [0.6, 0.4], [0.6, 0.4], [0.2, 0.8], [0.6, 0.4]])
    y = np.array([0, 0, 1, 1, 1])
    m = ordinal_metrics(probs, y)
    # Scores are the same as in the tie example above.
    assert m["auc"] == pytest.approx(5 / 6)
    # argmax: 0, 0, 0, 1, 0 -> correct for items 0, 1, 3.
    assert m["accuracy"] == m["categorical_accuracy"] == pytest.approx(3 / 5)
    # K = 2: every error is within one category (ordinal accuracy 1 whatever the model) and QWK is a plain kappa:
    # neither is reported
    assert set(m) == {"categorical_accuracy", "accuracy", "auc", "mae", "nll", "n"}


def test_calibration_curve_counts_every_category():
    probs = np.array([[0.62, 0.28, 0.10], [0.15, 0.25, 0.60], [0.05, 0.85, 0.10]])
    y = np.array([0, 1, 1])
    # 9 (row, category) pairs, 4 bins [0,.25) [.25,.5) [.5,.75) [.75,1]:
    #   bin 0: .10(0) .15(0) .05(0) .10(0)  -> count 4, mean .10, observed 0
    #   bin 1: .28(0) .25(1)                -> count 2, mean .265, observed .5
    #   bin 2: .62(1) .60(0)                -> count 2, mean .61, observed .5
    #   bin 3: .85(1)                       -> count 1, mean .85, observed 1
    mean_pred, observed, counts = calibration_curve(probs, y, n_bins=4)
    np.testing.assert_array_equal(counts, [4, 2, 2, 1])
    np.testing.assert_allclose(mean_pred, [0.10, 0.265, 0.61, 0.85])
    np.testing.assert_allclose(observed, [0.0, 0.5, 0.5, 1.0])


def test_calibration_curve_empty_bins_are_nan_and_one_is_last_bin():
    mean_pred, observed, counts = calibration_curve(np.array([[0.0, 1.0]]), np.array([1]), n_bins=5)
    np.testing.assert_array_equal(counts, [1, 0, 0, 0, 1])
    assert np.isnan(mean_pred[2]) and np.isnan(observed[2])
    assert observed[4] == 1.0 and observed[0] == 0.0


def test_expected_value():
    # Row 0: 0*.7 + 1*.1 + 2*.1 + 3*.1 = 0.6; row 3: .5 + .2 + .6 = 1.3
    np.testing.assert_allclose(expected_value(PROBS)[[0, 3]], [0.6, 1.3])


def test_bad_labels_are_rejected():
    with pytest.raises(ValueError):
        ordinal_metrics(PROBS, np.array([0, 1, 2, 4]))
    with pytest.raises(ValueError):
        ordinal_metrics(PROBS, np.array([0, 1, 2]))
