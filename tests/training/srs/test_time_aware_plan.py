"""What a flashcard run says before and while it fits (the data read, the folds it will fit and how to skip them,
the time the rest takes), and the users an evaluation leaves out, by name and why."""

import gzip

import numpy as np

from nextstep.models.time_aware import TimeAwareConfig, TimeAwareTransformer
from nextstep.training.srs.reviews import read_review_data, simulate_reviews, write_review_csv
from nextstep.training.srs.time_aware_loop import TimeAwareTrainConfig
from nextstep.training.srs.time_aware_run import (
    ProtocolBaselines,
    cross_validate,
    describe_plan,
    describe_reviews,
    score_on_users,
)

SMALL = TimeAwareConfig(d_model=16, ffn_dim=32, n_layers=1, t2v_dim=4, window=16, card_window=4)


def two_users(tmp_path):
    """A folder of two users' folders: a user with a few weeks of reviews, and one with a single day's."""
    log = simulate_reviews(n_users=1, n_cards=30, n_days=30, seed=1)
    first_day = simulate_reviews(n_users=1, n_cards=30, n_days=1, seed=2)
    for name, user in (("alice", log), ("bob", first_day)):
        (tmp_path / "users" / name).mkdir(parents=True)
        write_review_csv(user, tmp_path / "users" / name / "revlogs.csv")
    (tmp_path / "users" / "carol").mkdir()
    (tmp_path / "users" / "carol" / "revlogs.csv").write_text("user_id,card_id\n")  # no review_time, no rating
    return tmp_path / "users"


def test_the_data_line_says_what_was_read_as_what(tmp_path):
    """`train time_aware` printed no `data: ... read as` line, as the other families do."""
    log = simulate_reviews(n_users=2, n_cards=20, n_days=10, seed=0)
    path = write_review_csv(log, tmp_path / "reviews.csv")
    (tmp_path / "reviews.csv.gz").write_bytes(gzip.compress(path.read_bytes()))
    assert describe_reviews(read_review_data(path)) == (f"data: {path} read as review_csv: 2 users: {len(log)} "
                                                        "reviews of 40 cards")
    packed = describe_reviews(read_review_data(tmp_path / "reviews.csv.gz"))
    assert packed.startswith(f"data: {tmp_path / 'reviews.csv.gz'} read as review_csv (gzip): 2 users: ")
    folder = describe_reviews(read_review_data(two_users(tmp_path)))
    assert folder.startswith(f"data: {tmp_path / 'users'} read as a folder of 2 users (2 review_csv): ")


def test_the_plan_says_what_will_be_fitted_how_to_skip_the_folds_and_whom_they_leave_out(tmp_path):
    """Five folds and a final fit ran by default, 44 minutes on one collection under load, and nothing said so."""
    skipped = {}
    log = read_review_data(two_users(tmp_path), skipped=skipped)
    assert list(skipped) == ["carol"]
    line = describe_plan(log, 5, TimeAwareTrainConfig(max_epochs=30), baselines=True)
    assert line.startswith(f"evaluation: the protocol's 5 time-ordered folds, a fit each on the reviews before its "
                           f"test block, then the exported model's fit on all {len(log)} reviews (6 fits of at most "
                           "30 epochs, then FSRS-6 and the other baselines on the same folds); "
                           '{"cross_validate": false} in --config fits the exported model alone; 1 of the 2 users '
                           "has fewer than 6 scored reviews (of a card seen on an earlier day): the folds leave them "
                           "out, the exported model does not (bob)")
    assert describe_plan(log, 5, TimeAwareTrainConfig(cross_validate=False), baselines=True) == (
        f"training: the exported model alone, on all {len(log)} reviews (cross_validate is false: no protocol folds; "
        "`nextstep evaluate` measures it on other users)")


def test_after_the_first_fold_the_run_says_how_long_the_other_fits_take():
    log = simulate_reviews(n_users=1, n_cards=20, n_days=20, seed=0)
    said = []
    cross_validate(log, SMALL, TimeAwareTrainConfig(max_epochs=1, threads=1), n_splits=2, progress=False,
                   say=said.append)
    assert len(said) == 1 and said[0].startswith("evaluation: fold 1 of 2 took ") and \
        said[0].endswith(" more at its pace (a fit's time grows with its reviews)") and "the 2 other fits" in said[0]


def test_an_evaluation_names_the_users_it_leaves_out_and_why(tmp_path):
    """`evaluate` on a folder of users left out a small collection without a word."""
    skipped = {}
    log = read_review_data(two_users(tmp_path), skipped=skipped)
    result = score_on_users(TimeAwareTransformer(SMALL).eval(), log, ProtocolBaselines(log, 5))
    bob = int(np.diff(log.offsets)[log.user_ids.index("bob")])
    assert [u["user"] for u in result["users"]] == ["alice"]
    assert result["skipped_users"] == {"bob": f"0 scored reviews (of a card seen on an earlier day) among its {bob}; "
                                              "the protocol's 5 folds need at least 6"}
    assert "revlogs.csv:1: expected a review-log CSV header" in skipped["carol"]  # (said as it was met)
