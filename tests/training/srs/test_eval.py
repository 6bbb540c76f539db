"""The srs-benchmark protocol: folds, bin features, metrics by hand, FSRS-6 against fsrs-rs, baselines' leakage."""

import math
from pathlib import Path

import numpy as np
import pytest
from sklearn.model_selection import TimeSeriesSplit

from nextstep.training.srs import reviews
from nextstep.training.srs.eval import (
    base_rate_predictions,
    bin_features,
    duration_errors,
    duration_mask,
    evaluate_baselines,
    evaluate_predictions,
    fsrs6_predictions,
    fsrs6_rating_predictions,
    fsrs6_retrievability,
    log_loss,
    median_duration_predictions,
    protocol_folds,
    rating_ce,
    recall_metrics,
    rmse_bins,
    scored_mask,
    time_series_folds,
)
from nextstep.training.srs.reviews import STATE_UNKNOWN, ReviewLog

fsrs = pytest.importorskip("fsrs_rs_python")


def make_log(users, duration=None, meta=None):
    """users: one list per user of (card, rating, elapsed_days) in time order."""
    rows = [(u, *r) for u, rs in enumerate(users) for r in rs]
    n = len(rows)
    col = np.array([r[1:] for r in rows], dtype=np.int64).reshape(n, 3)
    offsets = np.cumsum([0] + [len(rs) for rs in users]).astype(np.int64)
    dur = np.full(n, 5.0, np.float32) if duration is None else np.asarray(duration, np.float32)
    return ReviewLog([str(u) for u in range(len(users))], offsets, col[:, 0], np.zeros(n, np.int64),
                     np.arange(n, dtype=np.float64) * 60.0, col[:, 1], dur, np.full(n, STATE_UNKNOWN, np.int64),
                     col[:, 2], "", dict(meta or {}))


def copy_log(log):
    return log.take(np.arange(len(log)), list(log.user_ids), log.offsets.copy())


def simulate_user(rng, n_cards, n_days):
    """Reviews of n_cards cards over n_days: first review, sometimes same-day repeats, growing intervals."""
    events = []  # (day, order within day, card, rating, elapsed)
    for card in range(n_cards):
        day, last, stab = int(rng.integers(0, n_days // 3)), None, 1.0
        while day < n_days:
            elapsed = -1 if last is None else day - last
            if elapsed > 0:
                recall = math.exp(-elapsed / (3 * stab))
                rating = 1 if rng.random() > recall else int(rng.choice([2, 3, 4], p=[0.15, 0.7, 0.15]))
            else:
                rating = int(rng.choice([1, 3], p=[0.3, 0.7]))
            events.append((day, rng.random(), card, rating, elapsed))
            if rating == 1 and rng.random() < 0.7:  # a same-day relearning step
                events.append((day, rng.random() + 1, card, 3, 0))
            stab = max(1.0, stab * (0.5 if rating == 1 else 2.2 + rating - 3))
            last, day = day, day + max(1, int(round(stab * rng.uniform(0.6, 1.4))))
    events.sort()
    return [(c, r, e) for _, _, c, r, e in events]


def truncate_to_scored(rows, n_scored):
    """The shortest prefix of rows holding n_scored scored reviews."""
    count = np.cumsum([e > 0 for _, _, e in rows])
    return rows[: int(np.searchsorted(count, n_scored)) + 1]


# ------------------------------------------------------------------------------------------------ folds


@pytest.mark.parametrize("n", [6, 7, 13, 100, 1001])
def test_time_series_folds_are_sklearns(n):
    folds = time_series_folds(n, 5)
    expected = list(TimeSeriesSplit(n_splits=5).split(np.zeros(n)))
    assert len(folds) == 5
    for (tr, te), (etr, ete) in zip(folds, expected, strict=True):
        np.testing.assert_array_equal(tr, etr)
        np.testing.assert_array_equal(te, ete)


def test_time_series_folds_by_hand_and_too_few_items():
    folds = time_series_folds(13, 5)  # test size 2; the first training block takes 13 - 5 * 2 = 3
    assert [(len(tr), te.tolist()) for tr, te in folds] == [(3, [3, 4]), (5, [5, 6]), (7, [7, 8]), (9, [9, 10]),
                                                            (11, [11, 12])]
    with pytest.raises(ValueError):
        time_series_folds(5, 5)


def test_protocol_folds_split_each_users_scored_reviews():
    rng = np.random.default_rng(0)
    users = [simulate_user(rng, 6, 60), [(0, 3, -1), (0, 3, 2), (0, 3, 0)], simulate_user(rng, 4, 40)]
    log = make_log(users)
    folds = protocol_folds(log, 5, "scored")
    scored = scored_mask(log)
    for u in (0, 2):  # user 1 has one scored review: no folds
        lo, hi = int(log.offsets[u]), int(log.offsets[u + 1])
        pos = lo + np.flatnonzero(scored[lo:hi])
        blocks = time_series_folds(pos.size, 5)
        for (train, test), (btr, bte) in zip(folds, blocks, strict=True):
            tr, te = train[(train >= lo) & (train < hi)], test[(test >= lo) & (test < hi)]
            np.testing.assert_array_equal(te[scored[te]], pos[bte])  # the scored reviews of the block
            np.testing.assert_array_equal(tr, np.arange(lo, pos[bte[0]]))  # everything before it
            np.testing.assert_array_equal(tr[scored[tr]], pos[btr])
        tests = np.concatenate([t[(t >= lo) & (t < hi)] for _, t in folds])
        np.testing.assert_array_equal(tests, np.arange(pos[blocks[0][1][0]], hi))  # blocks tile the rest
    lo1, hi1 = log.offsets[1], log.offsets[2]
    assert not any(((f >= lo1) & (f < hi1)).any() for fold in folds for f in fold)


def test_protocol_folds_on_rows_split_all_reviews():
    rng = np.random.default_rng(1)
    log = make_log([simulate_user(rng, 5, 40), simulate_user(rng, 5, 40)])
    folds = protocol_folds(log, 5, "rows")
    for u in range(2):
        lo, hi = int(log.offsets[u]), int(log.offsets[u + 1])
        for (train, test), (btr, bte) in zip(folds, time_series_folds(hi - lo, 5), strict=True):
            np.testing.assert_array_equal(train[(train >= lo) & (train < hi)], lo + btr)
            np.testing.assert_array_equal(test[(test >= lo) & (test < hi)], lo + bte)


# --------------------------------------------------------------------------------------------- features


def test_bin_features_by_hand():
    # User 0, cards 7 and 8 interleaved; user 1 reuses card id 7 (a different card).
    user0 = [
        (7, 3, -1),  # first review: i 1, lapse 0
        (7, 1, 0),   # same day, Again: not a lapse (not long-term)
        (8, 3, -1),
        (7, 1, 2),   # long-term Again: i 2, lapse 0 (counts only earlier reviews)
        (7, 3, 0),   # same day: i 2, lapse 1
        (8, 1, 3),   # card 8: i 2, lapse 0
        (7, 4, 5),   # i 3, lapse 1
        (8, 3, 1),   # i 3, lapse 1
    ]
    user1 = [(7, 3, -1), (7, 3, 4)]  # i 1, 2; card 7's lapses of user 0 do not carry over
    delta_t, i, lapse = bin_features(make_log([user0, user1]))
    assert delta_t.tolist() == [-1, 0, -1, 2, 0, 3, 5, 1, -1, 4]
    assert i.tolist() == [1, 1, 1, 2, 2, 2, 3, 3, 1, 2]
    assert lapse.tolist() == [0, 0, 0, 0, 1, 0, 1, 1, 0, 0]


# ---------------------------------------------------------------------------------------------- metrics


def srs_benchmark_rmse_bins(y, p, delta_t, i, lapse):
    """fsrs-optimizer's rmse_matrix written out: rounded geometric keys, count-weighted RMSE of bin means."""
    groups = {}
    for row in zip(y, p, delta_t, i, lapse, strict=True):
        yy, pp, t, n, lp = row
        key = (round(2.48 * 3.62 ** math.floor(math.log(t) / math.log(3.62)), 2),
               round(1.99 * 1.89 ** math.floor(math.log(n) / math.log(1.89))),
               round(1.65 * 1.73 ** math.floor(math.log(lp) / math.log(1.73))) if lp else 0)
        groups.setdefault(key, []).append((yy, pp))
    total = sum(len(g) for g in groups.values())
    sq = sum(len(g) * (np.mean([a for a, _ in g]) - np.mean([b for _, b in g])) ** 2 for g in groups.values())
    return math.sqrt(sq / total)


def test_rmse_bins_by_hand():
    y = np.array([1, 0, 1, 1])
    p = np.array([0.9, 0.8, 0.7, 0.6])
    delta_t = np.array([1, 2, 5, 1])  # bins floor(log_3.62): 0, 0, 1, 0
    i = np.array([2, 2, 2, 4])  # floor(log_1.89): 1, 1, 1, 2
    lapse = np.array([0, 0, 1, 0])  # none, none, floor(log_1.73 1) = 0, none
    # Bins: {0, 1}: mean y .5, mean p .85, n 2; {2}: 1 vs .7; {3}: 1 vs .6.
    expected = math.sqrt((2 * 0.35**2 + 0.3**2 + 0.4**2) / 4)
    assert rmse_bins(y, p, delta_t, i, lapse) == pytest.approx(expected)
    assert rmse_bins(y, p, delta_t, i, lapse) == pytest.approx(srs_benchmark_rmse_bins(y, p, delta_t, i, lapse))


def test_rmse_bins_matches_the_reference_formula_on_random_reviews():
    rng = np.random.default_rng(2)
    n = 500
    y, p = rng.integers(0, 2, n), rng.uniform(0.05, 0.99, n)
    delta_t, i, lapse = rng.integers(1, 400, n), rng.integers(2, 60, n), rng.integers(0, 12, n)
    assert rmse_bins(y, p, delta_t, i, lapse) == pytest.approx(srs_benchmark_rmse_bins(y, p, delta_t, i, lapse))


def test_recall_metrics_by_hand_with_tied_scores():
    y = np.array([0, 1, 0, 1])
    p = np.array([0.5, 0.5, 0.2, 0.8])
    m = recall_metrics(y, p, np.ones(4, int), np.full(4, 2), np.zeros(4, int))
    assert m["log_loss"] == pytest.approx(-(math.log(0.5) + math.log(0.5) + math.log(0.8) + math.log(0.8)) / 4)
    # Positives {.5, .8} against negatives {.5, .2}: (.5,.5) ties count 1/2, the other three pairs 1.
    assert m["auc"] == pytest.approx(3.5 / 4)
    # One bin: mean y .5, mean p .5.
    assert m["rmse_bins"] == pytest.approx(0.0)
    assert log_loss(np.array([1]), np.array([1.0])) == pytest.approx(-math.log(1 - 1e-12), abs=1e-9)


def test_rating_ce_by_hand():
    p4 = np.array([[0.1, 0.2, 0.6, 0.1], [0.5, 0.1, 0.3, 0.1]])
    assert rating_ce(p4, np.array([3, 1])) == pytest.approx(-(math.log(0.6) + math.log(0.5)) / 2)
    with pytest.raises(ValueError):
        rating_ce(p4, np.array([0, 1]))


def test_duration_metric_excludes_capped_unknown_first_and_unscored_reviews():
    log = make_log([[(0, 3, -1), (0, 3, 0), (0, 3, 2), (0, 1, 4), (0, 3, 3), (0, 3, 9)]],
                   duration=[10.0, 11.0, 500.0, np.nan, 30.0, 40.0], meta={"duration_cap_s": 500.0})
    mask = duration_mask(log)
    assert mask.tolist() == [False, False, False, False, True, True]  # first, same-day, capped, unknown
    mae, rmse = duration_errors(np.array([0, 0, 0, 0, 25.0, 50.0]), log.duration, mask)
    assert mae == pytest.approx(7.5) and rmse == pytest.approx(math.sqrt((25 + 100) / 2))
    log.meta.clear()
    assert duration_mask(log).tolist() == [False, False, True, False, True, True]  # no cap: 500 s counts


# ----------------------------------------------------------------------------------------------- FSRS-6


def test_fsrs6_forgetting_curve_matches_fsrs_rs():
    w = list(fsrs.DEFAULT_PARAMETERS)
    assert len(w) == 21
    model = fsrs.FSRS(w)
    for retention in (0.9, 0.8, 0.7):  # next_interval inverts the curve: R(interval) = desired retention
        interval = model.next_interval(10.0, retention, 3)
        assert fsrs6_retrievability(interval, 10.0, w[20]) == pytest.approx(retention, abs=1e-6)
    card = fsrs.Card()
    card.stability, card.difficulty, card.last_date, card.parameters = 10.0, 5.0, 0.0, w
    assert fsrs6_retrievability(7.0, 10.0, w[20]) == pytest.approx(card.retention_on(7.0), abs=1e-6)


def fsrs_rs_items(log):
    """One FSRSItem per scored review, in time order: its card's reviews up to and including it."""
    cards, items = {}, []
    for r in range(len(log)):
        history = cards.setdefault(int(log.card[r]), [])
        history.append(fsrs.FSRSReview(int(log.rating[r]), max(0, int(log.elapsed_days[r]))))
        if log.elapsed_days[r] > 0:
            items.append(fsrs.FSRSItem(list(history)))
    return items


def test_fsrs6_pipeline_reproduces_fsrs_rs_evaluate_with_time_series_splits():
    rng = np.random.default_rng(3)
    rows = truncate_to_scored(simulate_user(rng, 60, 200), 600)  # 600 = 6 * 100: fsrs-rs's and sklearn's
    log = make_log([rows])                                       # block boundaries coincide
    assert scored_mask(log).sum() == 600
    folds = protocol_folds(log)
    pred = fsrs6_predictions(log, folds)
    ours = evaluate_predictions(log, folds, pred.p_recall)
    ref = fsrs.evaluate_with_time_series_splits(fsrs_rs_items(log))
    assert ours["n_scored"] == 500
    assert ours["log_loss"] == pytest.approx(ref.log_loss, rel=1e-5)
    assert ours["rmse_bins"] == pytest.approx(ref.rmse_bins, rel=1e-4, abs=1e-6)
    assert "trained" in pred.fit_counts()


def test_fsrs6_prediction_ignores_later_reviews_and_depends_on_training_rows():
    rng = np.random.default_rng(4)
    log = make_log([simulate_user(rng, 40, 150)])
    folds = protocol_folds(log)
    base = fsrs6_predictions(log, folds).p_recall
    _, test = folds[2]
    cut = int(test[len(test) // 2])
    later = copy_log(log)
    later.rating[cut + 1 :] = np.where(later.rating[cut + 1 :] == 1, 3, 1)  # flip every later outcome
    changed = fsrs6_predictions(later, folds).p_recall
    upto = np.concatenate([t[t <= cut] for _, t in folds])
    np.testing.assert_array_equal(base[upto], changed[upto])
    assert not np.allclose(np.nan_to_num(base[test[test > cut]]), np.nan_to_num(changed[test[test > cut]]))

    train2, test2 = folds[2]
    earlier = copy_log(log)
    earlier.rating[train2] = np.where(earlier.rating[train2] == 1, 3, earlier.rating[train2])
    params_base = fsrs6_predictions(log, folds[2:3]).parameters[(0, 0)]
    params_changed = fsrs6_predictions(earlier, folds[2:3]).parameters[(0, 0)]
    assert not np.allclose(params_base, params_changed)


# -------------------------------------------------------------------------------------------- baselines


def test_base_rate_uses_the_folds_training_rows_only():
    rng = np.random.default_rng(5)
    log = make_log([simulate_user(rng, 20, 100)])
    folds = protocol_folds(log)
    p, p4 = base_rate_predictions(log, folds)
    scored = scored_mask(log)
    for train, test in folds:
        r = log.rating[train[scored[train]]]
        assert np.all(p[test] == np.mean(r > 1))
        np.testing.assert_allclose(p4[test], np.broadcast_to((np.bincount(r - 1, minlength=4) + 1) / (r.size + 4),
                                                             (test.size, 4)))
    flipped = copy_log(log)
    last_test = folds[-1][1]
    flipped.rating[last_test] = 1  # outcomes of the last test block never reach its own predictions
    p2, _ = base_rate_predictions(flipped, folds)
    np.testing.assert_array_equal(p[last_test], p2[last_test])


def test_median_duration_by_grade_uses_the_true_grade_and_training_rows():
    reviews_ = [(0, 3, -1), (0, 3, 1), (1, 3, -1), (1, 1, 2), (0, 3, 2), (1, 3, 3), (0, 1, 4), (1, 3, 5),
                (0, 3, 6), (1, 3, 7), (0, 1, 8), (1, 4, 9)]
    durations = [99, 4, 99, 20, 6, 8, 30, 700, 1, 1, 1, 1]  # first reviews (99) and the capped 700 are ignored
    log = make_log([reviews_], duration=durations, meta={"duration_cap_s": 600.0})
    folds = [(np.arange(8), np.arange(8, 12))]
    by_grade = median_duration_predictions(log, folds, by_grade=True)
    overall = median_duration_predictions(log, folds, by_grade=False)
    # Usable training rows: Good 4, 6, 8; Again 20, 30. Easy has none: the overall median 8.
    assert by_grade[8:].tolist() == [6.0, 6.0, 25.0, 8.0]
    assert overall[8:].tolist() == [8.0] * 4 and np.isnan(overall[:8]).all()


def test_fsrs6_rating_predictions_split_recall_over_smoothed_shares():
    log = make_log([[(0, 3, -1), (0, 2, 1), (0, 3, 2), (0, 4, 3), (0, 3, 4), (0, 1, 5), (0, 3, 6)]])
    folds = [(np.arange(5), np.arange(5, 7))]
    R = np.full(len(log), np.nan)
    R[5:] = [0.8, 0.6]
    p4 = fsrs6_rating_predictions(log, folds, R)
    shares = np.array([1 + 1, 2 + 1, 1 + 1]) / (4 + 3)  # training successes: Hard 1, Good 2, Easy 1
    np.testing.assert_allclose(p4[5], [0.2, *(0.8 * shares)])
    np.testing.assert_allclose(p4[5:].sum(axis=1), 1.0)


def test_evaluate_baselines_and_predictions_on_generated_reviews():
    rng = np.random.default_rng(6)
    log = make_log([simulate_user(rng, 25, 120), simulate_user(rng, 25, 120)], meta={"duration_cap_s": 60.0})
    log.duration = rng.gamma(2.0, 4.0, len(log)).astype(np.float32) + (log.rating == 1) * 5
    result = evaluate_baselines(log)
    assert result["protocol"]["n_users_evaluated"] == 2
    for name in ("fsrs6", "base_rate"):
        assert {"log_loss", "rmse_bins", "auc", "rating_ce", "by_user"} <= result[name].keys()
        assert result[name]["n_scored"] == result["protocol"]["n_scored"] > 0
    for name in ("median_duration_by_grade", "median_duration"):
        assert result[name]["n_duration"] > 0 and result[name]["duration_mae_s"] > 0
    assert sum(result["fsrs6"]["fits"].values()) == 10  # 2 users x 5 folds
    # A model's predictions go through the same function; a missing scored test prediction is an error.
    folds = protocol_folds(log)
    p = np.full(len(log), 0.9)
    assert evaluate_predictions(log, folds, p)["log_loss"] > 0
    _, test = folds[0]
    p[test[scored_mask(log)[test]][0]] = np.nan
    with pytest.raises(ValueError):
        evaluate_predictions(log, folds, p)


SHARED = Path(__file__).resolve().parents[4] / "shared" / "data" / "srs"


@pytest.mark.skipif(not hasattr(reviews, "read_reviews") or not (SHARED / "ankimath").is_dir(),
                    reason="needs the shared AnkiMath review log and reviews.read_reviews")
def test_fsrs6_on_ankimath_is_near_the_published_figures():
    log = reviews.read_reviews(SHARED / "ankimath")  # published: 0.1555 / 0.0220 with fsrs-rs's own boundaries
    folds = protocol_folds(log)
    m = evaluate_predictions(log, folds, fsrs6_predictions(log, folds).p_recall)
    assert m["log_loss"] == pytest.approx(0.1555, abs=0.001)
    assert m["rmse_bins"] == pytest.approx(0.0220, abs=0.001)


def test_the_baselines_command_reads_a_folder_of_users_as_one_log(tmp_path, capsys):
    """`python -m nextstep.training.srs.eval --data DIR` on a folder of users' folders gives what it gives on the same
    users in one review-log CSV (per-user folds: the users' names do not matter)."""
    import json

    from nextstep.training.srs.eval import main

    log = reviews.simulate_reviews(n_users=2, n_cards=30, n_days=40, seed=9)
    reviews.write_review_csv(log, tmp_path / "all.csv")
    for u in range(2):
        (tmp_path / "users" / f"u{u}").mkdir(parents=True)
        reviews.write_review_csv(log.user(u), tmp_path / "users" / f"u{u}" / "revlogs.csv")
    main(["--data", str(tmp_path / "all.csv")])
    one_file = json.loads(capsys.readouterr().out)
    main(["--data", str(tmp_path / "users")])
    folders = json.loads(capsys.readouterr().out)
    for model in ("fsrs6", "base_rate"):
        for key in ("n_scored", "log_loss", "rmse_bins"):
            assert folders[model][key] == pytest.approx(one_file[model][key], rel=1e-6), (model, key)


def test_each_users_parameters_are_fitted_on_that_users_reviews_alone():
    """fit_fsrs6_by_user: one fit per user on their rows among those given (the training rows), equal to fitting that
    user's log alone; a user with no rows keeps fsrs-rs's defaults."""
    fsrs = pytest.importorskip("fsrs_rs_python")
    from nextstep.training.srs.eval import fit_fsrs6, fit_fsrs6_by_user
    from nextstep.training.srs.reviews import simulate_reviews

    log = simulate_reviews(n_users=3, n_cards=100, n_days=50, reviews_per_day=25, seed=2)
    lo1, hi1 = int(log.offsets[1]), int(log.offsets[2])
    rows = np.r_[np.arange(0, int(log.offsets[1]) // 2), np.arange(lo1, hi1)]  # user 0's first half, all of user 1
    got = fit_fsrs6_by_user(log, rows)
    assert got.shape == (3, 21)
    u0 = log.user(0)
    np.testing.assert_allclose(got[0], fit_fsrs6(u0, np.arange(int(log.offsets[1]) // 2)), atol=1e-9)
    np.testing.assert_allclose(got[1], fit_fsrs6(log.user(1), np.arange(hi1 - lo1)), atol=1e-9)
    np.testing.assert_allclose(got[2], fsrs.DEFAULT_PARAMETERS, atol=1e-6)
    assert np.abs(got[0] - got[1]).max() > 1e-3
