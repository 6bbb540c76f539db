"""`nextstep tune` (training/tune.py, training/spaces.py): every family's space and a two-trial study of it end to
end on tiny generated data; trial 0 is the defaults; the study never opens the test file; a study resumes; its
config is what `train --config` takes; --jobs 2."""

import json
import os
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest

optuna = pytest.importorskip("optuna")

from nextstep.cli import main  # noqa: E402
from nextstep.training import tune  # noqa: E402
from nextstep.training.families import FAMILIES  # noqa: E402
from nextstep.training.loop import epoch_hook, train_epochs  # noqa: E402
from nextstep.training.spaces import apply, overrides  # noqa: E402

GPCM = {"epochs": 1, "max_len": 40, "model": {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8}}
# each family's data (generator, its settings) and the small base config its study starts from
CASES = {
    "deep_gpcm": ("kt", GPCM),
    "attention_gpcm": ("kt", {**GPCM, "model": {**GPCM["model"], "window": 8}}),
    "coral_gpcm": ("kt", GPCM),
    "dkt": ("kt", {"epochs": 1, "max_len": 40, "model": {"hidden": 8, "embed_dim": 8}}),
    "simakt": ("problems", {"epochs": 1, "bank_folds": 2, "model": {"d_model": 16, "n_heads": 2, "n_know": 2,
                                                                    "window": 16}}),
    "gru4rec": ("sessions", {"epochs": 2, "n_sample": 16, "model": {"layers": [16]}}),
    "mrn": ("sessions", {"epochs": 2, "curriculum": [[1, 1, 2], [1, 2, 4]], "model": {"dim": 8}}),
    "popularity": ("sessions", {}),
    "markov": ("sessions", {}),
    "time_aware": ("reviews", {"max_epochs": 1, "batch_size": 128, "cross_validate": False,
                               "model": {"d_model": 16, "n_layers": 1, "ffn_dim": 32, "t2v_dim": 4, "window": 24,
                                         "card_window": 6}}),
}


def write_data(kind: str, root: Path) -> tuple[Path, Path | None]:
    """(the data set, its test file) of a kind, generated with fixed seeds."""
    if kind == "kt":
        from nextstep.training.kt.synthetic import write_gpcm_dataset

        data = write_gpcm_dataset(root / "kt", n_students=60, n_questions=12, seq_len_range=(10, 25), seed=7)
        return data, next(data.glob("*test*"))
    if kind == "problems":
        from nextstep.training.kt.synthetic import write_problem_dataset

        data = write_problem_dataset(root / "problems", n_train=40, n_test=10, length=(5, 30))
        return data, next(p for p in Path(data).iterdir() if "test" in p.name)
    if kind == "sessions":
        from nextstep.training.next_item.sessions import write_zipf_split

        data = write_zipf_split(root / "sessions", n_sessions=240, n_items=40, length_range=(2, 8), follow=0.7,
                                seed=0)
        return data, data / "demo_test.txt"
    from nextstep.training.srs.reviews import write_simulated_reviews

    return write_simulated_reviews(root / "reviews", n_users=1, n_cards=30, n_days=40, seed=7), None


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune_data")
    return {kind: write_data(kind, root) for kind in ("kt", "sessions")}


OPENED: list[str] = []
_RECORD = [False]


def _audit(event, args):
    if _RECORD[0] and event == "open" and isinstance(args[0], (str, os.PathLike)):
        OPENED.append(os.path.realpath(args[0]))


sys.addaudithook(_audit)


def recorded(monkeypatch) -> dict:
    """Record every file Python opens; `marks["study"]` is how many were opened when the study ended."""
    OPENED.clear()
    marks = {}
    real = tune.run_study

    def run_study(*args, **kwargs):
        try:
            return real(*args, **kwargs)
        finally:
            marks["study"] = len(OPENED)

    monkeypatch.setattr(tune, "run_study", run_study)
    _RECORD[0] = True
    return marks


@pytest.fixture(autouse=True)
def _stop_recording():
    yield
    _RECORD[0] = False


def test_every_family_has_a_space_and_trial_0_is_its_defaults():
    for entry in FAMILIES.values():
        assert entry.space, f"{entry.name} has no search space"
        base = entry.read_train_config(None)
        space = tune.space_of(entry, base)
        defaults = space.defaults()
        # the suggestions of a trial fixed at the defaults are the defaults' overrides...
        assert space.suggest(optuna.trial.FixedTrial(defaults)) == overrides(space, defaults)
        # ...and they change nothing: every field is the family's default
        cfg = apply(base, overrides(space, defaults))
        model_defaults = {f.name: f.default for f in fields(entry.resolve("config"))}
        for key, value in vars(cfg).items():
            if key == "model":
                for name, v in value.items():
                    want = model_defaults[name]
                    assert (tuple(v) if isinstance(v, list) else v) == want, (entry.name, name, v, want)
            else:
                assert value == getattr(base, key), (entry.name, key)


def test_a_base_config_outside_the_space_is_trial_0_as_it_is():
    entry = FAMILIES["gru4rec"]
    base = apply(entry.read_train_config(None), {"batch_size": 50, "lr": 0.9, "model": {"layers": [7, 7]}})
    space = tune.space_of(entry, base)
    defaults = space.defaults()
    assert defaults["batch_size"] == 50 and defaults["lr"] == 0.9
    cfg = apply(base, space.suggest(optuna.trial.FixedTrial(defaults)))
    assert cfg.batch_size == 50 and cfg.lr == 0.9


def _case(name: str, tmp_path: Path, data: dict) -> tuple[Path, Path | None, dict]:
    kind, base = CASES[name]
    dataset, test_file = data[kind] if kind in data else write_data(kind, tmp_path)
    return dataset, test_file, base


@pytest.mark.parametrize("name", list(CASES))
def test_a_two_trial_study_starts_from_the_defaults_and_never_opens_the_test_file(name, tmp_path, data):
    dataset, test_file, base = _case(name, tmp_path, data)
    OPENED.clear()
    _RECORD[0] = True
    summary = tune.run_study(name, dataset, tmp_path / "study", base=base, trials=2, timeout=120, progress=False)
    _RECORD[0] = False
    if test_file is not None:
        assert os.path.realpath(test_file) not in OPENED, "the study opened the test file"
        assert any(p.startswith(os.path.realpath(dataset)) for p in OPENED)  # (the recording works)
    empty = not FAMILIES[name].resolve("space").params
    assert summary["trials"]["complete"] + summary["trials"]["pruned"] == (1 if empty else 2)
    assert summary["defaults"]["trial"] == 0 and summary["defaults"]["value"] is not None
    study = optuna.load_study(study_name=summary["study"], storage=f"sqlite:///{tmp_path / 'study' / 'study.db'}")
    assert study.trials[0].params == summary["defaults"]["params"]
    better = max if summary["direction"] == "maximize" else min
    assert summary["best"]["value"] == better(t.value for t in study.trials if t.value is not None)


# the whole command (the final training and export included) of one family per training run (kt/run.py's, which
# attention_gpcm, coral_gpcm and dkt share with deep_gpcm; SimAKT's; next_item/run.py's, each of its trainers); the
# slow tier all but two. The others' studies run above. Not time_aware's (2.3 min, CI's longest call): its two-trial
# study runs above, and its final training and export through the CLI in tests/test_retrain.py
SHARES_A_RUN = {"attention_gpcm", "coral_gpcm", "dkt"}  # kt/run.py's, held by deep_gpcm
END_TO_END = [n for n in CASES if n not in SHARES_A_RUN | {"time_aware"}]  # a new family is in by default
FAST_END_TO_END = {"gru4rec", "popularity"}


@pytest.mark.parametrize("name", [n if n in FAST_END_TO_END else pytest.param(n, marks=pytest.mark.slow)
                                  for n in END_TO_END])
def test_tune_trains_the_best_on_the_whole_training_file_and_tests_it_once(name, tmp_path, monkeypatch, data):
    dataset, test_file, base = _case(name, tmp_path, data)
    (tmp_path / "base.json").write_text(json.dumps(base))
    out = tmp_path / "art"
    marks = recorded(monkeypatch)
    assert main(["tune", name, "--data", str(dataset), "--out", str(out), "--trials", "2", "--timeout", "120",
                 "--config", str(tmp_path / "base.json"), "--quiet", "--save-config",
                 str(tmp_path / "best.json")]) == 0
    _RECORD[0] = False
    if test_file is not None:
        test_file = os.path.realpath(test_file)
        assert test_file not in OPENED[:marks["study"]], "the study opened the test file"
        assert test_file in OPENED[marks["study"]:], "the final model was not tested"
    manifest = json.loads((out / "manifest.json").read_text())
    study = manifest["study"]
    assert study["defaults"]["trial"] == 0 and study["defaults"]["value"] is not None
    assert study["best"]["value"] >= study["defaults"]["value"] if study["direction"] == "maximize" else \
        study["best"]["value"] <= study["defaults"]["value"]
    assert study["test"] == manifest["metrics"].get("test", manifest["metrics"].get("valid"))
    for file in ("trials.csv", "report.html", "config.json", "study.db"):
        assert (out / file).is_file(), file
    assert "plotly" in (out / "report.html").read_text()[:2_000_000]
    # the best settings are a config `train --config` takes, with the base's settings kept
    config = json.loads((tmp_path / "best.json").read_text())
    cfg = FAMILIES[name].read_train_config(str(tmp_path / "best.json"))
    for key, value in base.items():
        if key != "model":
            assert getattr(cfg, key) == value
    assert config == json.loads((out / "config.json").read_text())
    if name == "gru4rec":  # `train --config` of it makes the same model
        assert main(["train", name, "--data", str(dataset), "--out", str(tmp_path / "again"), "--config",
                     str(tmp_path / "best.json"), "--quiet"]) == 0
        again = json.loads((tmp_path / "again" / "manifest.json").read_text())
        assert again["train_config"] == manifest["train_config"]
        assert again["metrics"]["test"]["recall@20"] == pytest.approx(manifest["metrics"]["test"]["recall@20"])


def test_an_interrupted_study_resumes_where_it_stopped(tmp_path, monkeypatch, data):
    dataset, _ = data["sessions"]
    base = CASES["gru4rec"][1]
    calls = []
    real = tune.SessionProblem.run

    def run(self, cfg, metric, report):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # Ctrl-C in the second trial
        return real(self, cfg, metric, report)

    monkeypatch.setattr(tune.SessionProblem, "run", run)
    with pytest.raises(KeyboardInterrupt):
        tune.run_study("gru4rec", dataset, tmp_path, base=base, trials=5, timeout=60, progress=False)
    monkeypatch.setattr(tune.SessionProblem, "run", real)
    summary = tune.run_study("gru4rec", dataset, tmp_path, base=base, trials=3, timeout=60, progress=False)
    assert summary["trials"]["total"] == 4  # trial 0, the interrupted one (failed), two more
    assert summary["trials"]["complete"] == 3 and summary["trials"]["fail"] == 1
    assert summary["trials"]["this_run"] == 2
    study = optuna.load_study(study_name=summary["study"], storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert [t.number for t in study.trials if t.user_attrs.get("defaults")] == [0]  # the defaults enqueued once
    # the same command with a larger budget goes on with the same study
    more = tune.run_study("gru4rec", dataset, tmp_path, base=base, trials=4, timeout=60, progress=False)
    assert more["study"] == summary["study"] and more["trials"]["complete"] == 4


def test_two_jobs_share_one_study(tmp_path, data):
    dataset, _ = data["sessions"]
    base = {**CASES["gru4rec"][1], "epochs": 6}
    summary = tune.run_study("gru4rec", dataset, tmp_path, base=base, trials=8, timeout=120, jobs=2, progress=False)
    assert summary["trials"]["complete"] + summary["trials"]["pruned"] >= 8
    assert summary["defaults"]["value"] is not None
    study = optuna.load_study(study_name=summary["study"], storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert len({t.user_attrs["worker"] for t in study.trials}) == 2  # both processes ran trials


def test_the_study_time_stops_a_running_trial_at_its_next_epoch_but_not_the_defaults(tmp_path, data):
    dataset, _ = data["sessions"]
    base = {**CASES["gru4rec"][1], "epochs": 40}
    summary = tune.run_study("gru4rec", dataset, tmp_path, base=base, timeout=1, progress=False)
    assert summary["trials"]["total"] == 1 and summary["defaults"]["value"] is not None  # trial 0 ran all 40
    summary = tune.run_study("gru4rec", dataset, tmp_path, base=base, timeout=1, progress=False)
    study = optuna.load_study(study_name=summary["study"], storage=f"sqlite:///{tmp_path / 'study.db'}")
    assert study.trials[0].last_step == 40
    assert study.trials[1].user_attrs.get("stopped") and study.trials[1].last_step < 40


def test_the_epoch_hook_sees_every_epoch_and_can_stop_the_training():
    import torch

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 2), torch.randn(8, 1)
    seen = []

    def hook(epoch, m, row):
        seen.append((epoch, m is model, "valid_loss" in row))
        if epoch == 3:
            raise StopIteration

    with epoch_hook(hook), pytest.raises(StopIteration):
        train_epochs(model, 10, lambda e: [0], lambda b: (((model(x) - y) ** 2).mean(), 8), optimizer=opt,
                     validate=lambda: {"loss": float(np.float64(1.0))}, progress=False)
    assert seen == [(1, True, True), (2, True, True), (3, True, True)]
    train_epochs(model, 2, lambda e: [0], lambda b: (((model(x) - y) ** 2).mean(), 8), optimizer=opt,
                 progress=False)  # outside the block: no hook
    assert len(seen) == 3


def test_a_storage_url_keeps_no_password():
    assert tune._public("postgresql://tuner:secret@db:5432/studies") == "postgresql://tuner:***@db:5432/studies"
    assert tune._public("sqlite:////tmp/a.db") == "sqlite:////tmp/a.db"
