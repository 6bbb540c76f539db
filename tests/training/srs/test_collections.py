"""Leave-one-collection-out: each collection's setting comes from the other collections only; the table."""

import json

import numpy as np

from nextstep.training.srs import collections as srs_collections
from nextstep.training.srs.collections import choose, table
from nextstep.training.srs.reviews import simulate_reviews, write_review_csv


def test_each_collection_gets_the_setting_best_on_the_others():
    ratio = {"a": {"x": 0.90, "y": 1.00, "z": 1.00}, "b": {"x": 1.20, "y": 0.98, "z": 0.99}}
    tuning = {cand: {n: {"ratio": r} for n, r in rows.items()} for cand, rows in ratio.items()}
    # x alone favours a; y and z favour b, so x (left out) gets b, and y, z get the mean of the rest
    assert choose(tuning, ["x", "y", "z"]) == {"x": "b", "y": "a", "z": "a"}
    tuning["a"]["x"]["ratio"] = 2.0  # what x says about a never decides x's own setting
    assert choose(tuning, ["x", "y", "z"])["x"] == "b"


def _result(ll, fsrs_ll, rmse, fsrs_rmse):
    runs = [{"log_loss": v, "rmse_bins": rmse, "auc": 0.7, "duration_mae_s": 5.0} for v in ll]
    return {"setting": "s", "n_reviews": 1000, "runs": runs,
            "baselines": {"fsrs6": {"log_loss": fsrs_ll, "rmse_bins": fsrs_rmse, "auc": 0.68, "n_scored": 400},
                          "median_duration": {"duration_mae_s": 9.0}}}


def test_table_has_a_row_per_collection_and_the_mean_gap():
    md = table({"x": _result([0.40, 0.42, 0.41], 0.43, 0.05, 0.06), "y": _result([0.20] * 3, 0.19, 0.03, 0.02)})
    rows = md.strip().splitlines()
    assert len(rows) == 5 and rows[2].startswith("| x |") and "0.4100 (0.4000-0.4200)" in rows[2]
    gap = np.mean([0.41 / 0.43 - 1, 0.20 / 0.19 - 1])
    assert f"{gap:+.1%}" in rows[-1] and "0.0400 | 0.0400" in rows[-1]


def test_one_run_tunes_leaves_one_out_and_writes_the_table(tmp_path):
    data = tmp_path / "srs"
    (data / "ankimath").mkdir(parents=True)
    write_review_csv(simulate_reviews(n_users=1, n_cards=40, n_days=60, seed=1), data / "ankimath" / "revlogs.csv")
    (data / "py_fsrs_josh").mkdir()
    write_review_csv(simulate_reviews(n_users=1, n_cards=40, n_days=60, seed=2),
                     data / "py_fsrs_josh" / "review_logs_sim.csv")
    model = {"d_model": 16, "ffn_dim": 32, "window": 16, "card_window": 4}
    small = {"max_epochs": 1, "batch_size": 128, "model": model}
    candidates = {"one": {**small, "lr": 1e-3}, "two": {**small, "lr": 2e-3}}
    out = tmp_path / "out"
    old = srs_collections.CANDIDATES
    srs_collections.CANDIDATES = candidates
    try:
        srs_collections.main(["--data", str(data), "--out", str(out), "--seeds", "0"])
    finally:
        srs_collections.CANDIDATES = old
    tuning = json.loads((out / "tuning.json").read_text())
    assert set(tuning) == {"one", "two"} and set(tuning["one"]) == {"ankimath", "py_fsrs_josh"}
    results = json.loads((out / "results.json").read_text())
    assert results["chosen"] == choose(tuning, ["ankimath", "py_fsrs_josh"])
    assert len((out / "table.md").read_text().strip().splitlines()) == 5
