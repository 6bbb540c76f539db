"""Time-aware training end to end on a generated review log: the CLI, protocol metrics, baselines, export parity."""

import json

import numpy as np
import pytest
import torch

from nextstep.cli import main
from nextstep.models.time_aware import TimeAwareConfig, TimeAwareTransformer
from nextstep.training.export import GraphModule, ParityError, check_parity, onnx_session
from nextstep.training.srs.eval import fit_fsrs6
from nextstep.training.srs.reviews import simulate_reviews, write_review_csv
from nextstep.training.srs.time_aware_export import INPUTS, TimeAwareExporter, export_time_aware
from nextstep.training.srs.time_aware_loop import ReviewTensors, TimeAwareTrainConfig, fit, predict, split_validation
from nextstep.training.srs.time_aware_run import load_time_aware, parity_inputs, tuning_split

pytestmark = pytest.mark.slow  # whole flashcard runs under the srs-benchmark protocol (make test-all)

SMALL = {"d_model": 16, "ffn_dim": 32, "window": 24, "card_window": 6}


@pytest.fixture(scope="module")
def log():
    return simulate_reviews(n_users=2, n_cards=60, n_days=80, seed=3)


@pytest.fixture(scope="module")
def artifact(tmp_path_factory, log):
    root = tmp_path_factory.mktemp("time_aware")
    write_review_csv(log, root / "reviews.csv")
    (root / "cfg.json").write_text(json.dumps({"max_epochs": 3, "batch_size": 128, "model": SMALL}))
    assert main(["train", "time_aware", "--data", str(root / "reviews.csv"), "--out", str(root / "out"),
                 "--config", str(root / "cfg.json"), "--quiet"]) == 0
    return root / "out"


def test_validation_rows_are_each_users_latest(log):
    rows = np.arange(len(log))
    train, valid = split_validation(log, rows, 0.1)
    assert len(train) + len(valid) == len(log) and not set(train) & set(valid)
    for u in range(log.n_users):
        lo, hi = log.offsets[u], log.offsets[u + 1]
        mine_train, mine_valid = train[(train >= lo) & (train < hi)], valid[(valid >= lo) & (valid < hi)]
        assert len(mine_valid) == (hi - lo) // 10 and mine_train.max() < mine_valid.min()


def test_fit_learns_and_never_trains_on_validation_rows(log):
    cfg = TimeAwareConfig(**SMALL)
    rt = ReviewTensors(log, cfg.window, cfg.card_window)
    rows = np.arange(len(log))
    model, info = fit(rt, rows, cfg, TimeAwareTrainConfig(max_epochs=4, batch_size=128))
    hist = info["history"]
    assert hist[-1]["train_loss"] < hist[0]["train_loss"]
    assert info["n_train"] + info["n_valid"] == len(log)
    out = predict(model, rt, rows[-50:])
    assert out["rating_probs"].shape == (50, 4) and np.allclose(out["rating_probs"].sum(1), 1, atol=1e-5)
    assert np.allclose(out["recall"], 1 - out["rating_probs"][:, 0], atol=1e-6)
    assert (out["duration_s"] >= 0).all()
    # the same seed gives the same model
    again, _ = fit(rt, rows, cfg, TimeAwareTrainConfig(max_epochs=4, batch_size=128))
    np.testing.assert_array_equal(predict(again, rt, rows[-50:])["recall"], out["recall"])


def test_cli_writes_protocol_metrics_baselines_and_a_parity_checked_artifact(artifact, log):
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["task"] == "srs" and manifest["parity"]["passed"]
    test = manifest["metrics"]["test"]
    for key in ("log_loss", "rmse_bins", "auc", "rating_ce", "duration_mae_s", "duration_rmse_s"):
        assert np.isfinite(test[key]), key
    assert test["n_scored"] > 100
    base = test["baselines"]
    assert {"fsrs6", "base_rate", "median_duration_by_grade"} <= set(base)
    assert np.isfinite(base["fsrs6"]["log_loss"]) and np.isfinite(base["base_rate"]["log_loss"])
    *folds, final = manifest["training"]["folds"]
    assert len(folds) == 5 and all(f["n_train"] < f["n_train"] + f["n_test"] for f in folds)
    assert [f["n_train"] for f in folds] == sorted(f["n_train"] for f in folds)  # time-ordered, growing
    # the exported model is fitted on every review; the folds are its evaluation
    assert final["fold"] == "all reviews (exported)" and final["n_train"] == len(log) > folds[-1]["n_train"]
    assert manifest["parity"]["recall_monotone_queries"] > 20 and manifest["parity"]["recall_rise_max"] <= 1e-6


def test_exported_graph_answers_like_the_model_for_any_batch_and_window(artifact, log):
    model, manifest = load_time_aware(artifact)
    session = onnx_session(artifact / "predict.onnx")
    assert [i.name for i in session.get_inputs()] == list(INPUTS)
    ts = torch.jit.load(str(artifact / "predict.pt"))
    for size in (5, 40):
        rt = ReviewTensors(log, size, 3)
        # each user's own FSRS-6 parameters, fed as an input (one user's the defaults, the other's fitted)
        rt.set_params(np.stack([model.fsrs_w.numpy(), fit_fsrs6(log, np.arange(len(log) // 2, len(log)))]))
        rt.day_start[int(log.offsets[1]):] = 20 * 3600.0  # and day boundary: the second user's days start at 20:00 UTC
        rt.set_evidence(model)  # and evidence for the network over FSRS-6's defaults
        assert rt.evidence is not None and float(rt.evidence.min()) < float(rt.evidence.max())
        rows = torch.cat([torch.arange(int(log.offsets[1]) - 4, int(log.offsets[1])), torch.arange(len(log) - 4,
                                                                                                  len(log))])
        w, card, deck, t = rt.batch(rows)
        inputs = (*w, card, deck, t)
        eager = TimeAwareExporter(model).answer(w, card, deck, t).values()
        onnx = session.run(None, {n: x.numpy() for n, x in zip(INPUTS, inputs, strict=True)})
        script = ts(*inputs)
        for a, b, c in zip(eager, onnx, script, strict=True):
            np.testing.assert_allclose(a.detach().numpy(), b, atol=1e-4)
            np.testing.assert_allclose(a.detach().numpy(), c.detach().numpy(), atol=1e-5)


def test_parity_check_catches_a_wrong_graph(artifact, log):
    model, _ = load_time_aware(artifact)
    other = TimeAwareExporter(TimeAwareTransformer(TimeAwareConfig(**SMALL)))  # different weights
    rt = ReviewTensors(log, SMALL["window"], SMALL["card_window"])
    sequence = tuple(parity_inputs(rt))[:7]  # the raw reviews (stepping adds their errors)
    exporter = TimeAwareExporter(model)
    graphs = exporter.graphs(sequence)
    with torch.no_grad():
        wrong_ts = torch.jit.trace(GraphModule(other, graphs[0]), graphs[0].example, check_trace=False)
    engines = {"torchscript": {"predict": wrong_ts},
               "onnxruntime": {"predict": onnx_session(artifact / "predict.onnx")}}
    result = check_parity(exporter, graphs, engines, sequence)
    assert not result["passed"] and result["eager_vs_torchscript"] > 1e-3
    assert result["eager_vs_onnxruntime"] <= 1e-4 and result["full_vs_step"] <= 1e-5


class Wavy(TimeAwareTransformer):
    """A model whose recall comes back with time (the elapsed days warped by a periodic term)."""

    def _heads(self, x, ctx, elapsed):
        return super()._heads(x, ctx, elapsed * (1.5 + torch.sin(elapsed)))


def test_export_refuses_a_model_whose_recall_rises_again(artifact, log, tmp_path):
    model, _ = load_time_aware(artifact)
    wavy = Wavy(model.cfg)
    wavy.load_state_dict(model.state_dict())
    sequence = parity_inputs(ReviewTensors(log, SMALL["window"], SMALL["card_window"]))
    with pytest.raises(ParityError, match="in eager PyTorch, before export.*recall_rise_max"):
        export_time_aware(wavy.eval(), tmp_path / "wavy", manifest={"name": "wavy"}, sequence=sequence)
    assert not list((tmp_path / "wavy").glob("*.onnx"))  # refused in seconds, before any graph was exported


def test_evaluate_scores_an_artifact_as_is_on_a_review_log(artifact, capsys):
    capsys.readouterr()
    assert main(["evaluate", str(artifact), "--data", str(artifact.parent / "reviews.csv")]) == 0
    result = json.loads(capsys.readouterr().out)
    trained = json.loads((artifact / "manifest.json").read_text())["metrics"]["test"]
    assert result["n_scored"] == trained["n_scored"]
    for key in ("log_loss", "rmse_bins", "auc", "rating_ce", "duration_mae_s"):
        assert np.isfinite(result[key]), key


def test_calibration_blends_with_fsrs6_and_is_a_positive_affine_map_fitted_on_held_out_reviews(log):
    from nextstep.models.time_aware import coral_loss
    from nextstep.training.srs.eval import duration_mask
    from nextstep.training.srs.time_aware_loop import calibrate

    cfg = TimeAwareConfig(**SMALL, deck_drift_gain=2.0)
    rt = ReviewTensors(log, cfg.window, cfg.card_window)
    # each user's first half trains (and fits that user's FSRS-6 parameters), each user's second half is held out
    user = np.searchsorted(log.offsets, np.arange(len(log)), side="right") - 1
    first = np.arange(len(log)) < (log.offsets[user] + log.offsets[user + 1]) // 2
    model, info = fit(rt, np.flatnonzero(first), cfg,
                      TimeAwareTrainConfig(max_epochs=2, batch_size=128, calibrate=False))
    assert info["calibration"] is None and model.calibration.tolist() == [1.0, 0.0] and float(model.blend) == 1.0
    held = np.flatnonzero(~first)
    held = held[log.elapsed_days[held] > 0]
    w, card, deck, t = rt.batch(torch.from_numpy(held))

    def logits(blend, user, deck_gain):
        model.blend.fill_(blend)
        model.drift_gain.fill_(user)
        model.deck_drift_gain.fill_(deck_gain)
        return model.readout(w, card, deck, t).threshold_logits

    with torch.no_grad():
        network, fsrs = logits(1.0, 0.0, 0.0), logits(0.0, 0.0, 0.0)
        user, deck_drift = logits(0.0, 1.0, 0.0) - fsrs, logits(0.0, 0.0, 1.0) - fsrs  # per unit of gain
        assert float(user.abs().max()) > 0.01 and float(deck_drift.abs().max()) > 0.01  # both drifts are in play
        result = calibrate(model, rt, held, blend_prior=20.0)
        after = model.readout(w, card, deck, t)
    a, (gain, deck_gain), (scale, shift) = result["blend"], result["drift_gain"], result["platt"]
    assert 0 <= a <= 1 and float(model.blend) == pytest.approx(a, abs=1e-7) and scale > 0
    assert gain >= 0 and float(model.drift_gain) == pytest.approx(gain, abs=1e-6)
    assert deck_gain >= 0 and float(model.deck_drift_gain) == pytest.approx(deck_gain, abs=1e-6)
    # the answer time is shifted to the held-out answer times' median (of those the protocol scores)
    known = torch.from_numpy(duration_mask(log)[held])
    residual = torch.log1p(rt.duration[torch.from_numpy(held)][known].double()) - after.log_duration[known].double()
    assert int(known.sum()) > 50 and result["duration_shift"] != 0.0
    assert abs(float(np.median(residual.numpy()))) < 1e-5
    mixed = fsrs + a * (network - fsrs) + gain * user + deck_gain * deck_drift
    torch.testing.assert_close(after.threshold_logits, mixed * scale + shift, atol=1e-4, rtol=1e-4)
    assert (after.threshold_logits[:, :-1] >= after.threshold_logits[:, 1:]).all()  # still ordered
    rating = rt.rating[torch.from_numpy(held)]
    assert coral_loss(after, rating) <= coral_loss(model.readout(w, card, deck, t)._replace(threshold_logits=fsrs),
                                                   rating) + 1e-6  # fitted on exactly these rows
    with torch.no_grad():  # a stronger prior trusts the network less; too few reviews: FSRS-6's curve, no Platt
        assert calibrate(model, rt, held, blend_prior=1e6)["blend"] < a + 1e-9
        assert calibrate(model, rt, held, drift_gain_prior=1e9)["drift_gain"] == pytest.approx([cfg.drift_gain,
                                                                                               cfg.deck_drift_gain])
        assert calibrate(model, rt, held[:10]) == {"blend": 0.0, "drift_gain": [cfg.drift_gain, cfg.deck_drift_gain],
                                                   "platt": None, "rows": 10, "duration_shift": 0.0}
    assert float(model.blend) == 0.0 and model.calibration.tolist() == [1.0, 0.0]


def test_tuning_split_never_scores_the_last_two_test_blocks(artifact, log):
    result = tuning_split(log, cfg=TimeAwareTrainConfig(max_epochs=1, batch_size=128, model=SMALL))
    assert result["blocks"] == [2, 3, 4] and 0 < result["n_scored"] <= len(log) * 4 // 6 - len(log) // 6
    for key in ("log_loss", "rmse_bins", "fsrs6_log_loss", "fsrs6_rmse_bins"):
        assert np.isfinite(result[key]), key


def test_the_tuning_split_command_takes_a_config_and_refuses_unknown_keys(tmp_path, log, capsys):
    from nextstep.training.srs.time_aware_run import main as tuning_main

    write_review_csv(log, tmp_path / "reviews.csv")
    (tmp_path / "cfg.json").write_text(json.dumps({"max_epochs": 1, "batch_size": 128, "model": SMALL}))
    tuning_main(["--data", str(tmp_path / "reviews.csv"), "--seed", "2", "--config", str(tmp_path / "cfg.json")])
    result = json.loads(capsys.readouterr().out)
    assert result["seed"] == 2 and result["epochs"] == [1, 1, 1]  # the config's one epoch per block
    for bad, key in (({"max_epoch": 1}, "'max_epoch'"), ({"model": {"d_modle": 16}}, "'model.d_modle'")):
        (tmp_path / "bad.json").write_text(json.dumps(bad))
        with pytest.raises(SystemExit, match=f"unknown keys \\[{key}\\]"):  # refused before the data is read
            tuning_main(["--data", str(tmp_path / "missing.csv"), "--config", str(tmp_path / "bad.json")])


def test_weights_saved_before_the_drifts_and_the_duration_shift_restore_with_those_terms_off(artifact, log):
    from nextstep.training.families import restore

    saved = torch.load(artifact / "weights.pt", weights_only=True)
    model = restore(saved["family"], saved["config"], saved["state_dict"]).eval()
    assert float(model.deck_drift_gain) > 0 or float(model.drift_gain) > 0  # the terms are in play as saved
    old_config = {k: v for k, v in saved["config"].items() if k not in ("drift_gain", "deck_drift_gain")}
    old_weights = {k: v for k, v in saved["state_dict"].items()
                   if k not in ("drift_gain", "deck_drift_gain", "duration_shift")}
    old = restore(saved["family"], old_config, old_weights).eval()
    assert (float(old.drift_gain), float(old.deck_drift_gain), float(old.duration_shift)) == (0.0, 0.0, 0.0)
    with torch.no_grad():
        for name in ("drift_gain", "deck_drift_gain", "duration_shift"):
            getattr(model, name).fill_(0.0)
        rt = ReviewTensors(log, SMALL["window"], SMALL["card_window"])
        rt.set_drift(model)
        batch = rt.batch(torch.arange(len(log) - 50, len(log)))
        torch.testing.assert_close(old.readout(*batch).rating_probs, model.readout(*batch).rating_probs)
    with pytest.raises(RuntimeError, match="Missing key"):  # anything else missing is still an error
        restore(saved["family"], saved["config"], {k: v for k, v in saved["state_dict"].items() if k != "blend"})


def test_evaluate_on_a_folder_of_users_scores_each_as_its_own_review_log(artifact, log, capsys):
    users = artifact.parent / "users"
    for u in range(log.n_users):  # each user in a folder of their own, one of them a level deeper
        folder = users / ("a" if u == 0 else "b/deeper") / f"user{u}"
        folder.mkdir(parents=True)
        write_review_csv(log.user(u), folder / "revlogs.csv")
    capsys.readouterr()
    assert main(["evaluate", str(artifact), "--data", str(users)]) == 0
    folders = json.loads(capsys.readouterr().out)
    assert main(["evaluate", str(artifact), "--data", str(artifact.parent / "reviews.csv")]) == 0
    one_file = json.loads(capsys.readouterr().out)
    for key in ("n_scored", "log_loss", "rmse_bins", "auc", "duration_mae_s"):
        assert folders[key] == pytest.approx(one_file[key], rel=1e-6), key
    # per user: the model next to FSRS-6 fitted per user on the same folds and FSRS-6's defaults; and their mean
    assert [u["user"] for u in folders["users"]] == ["a/user0", "b/deeper/user1"] and folders["mean"]["users"] == 2
    for row in folders["users"]:
        assert row["scored"] > 50
        for key in ("log_loss", "rmse_bins", "auc", "duration_mae_s", "median_duration_mae_s"):
            assert np.isfinite(row[key]), key
        for ref in ("fsrs6", "fsrs6_default"):
            assert {"log_loss", "rmse_bins", "auc"} <= set(row[ref]) and np.isfinite(row[ref]["log_loss"])
    assert folders["mean"]["log_loss"] == pytest.approx(np.mean([u["log_loss"] for u in folders["users"]]))
    assert np.isfinite(folders["mean"]["log_loss_vs_fsrs6"])
