"""The family registry: every entry resolves, names a class that implements the streaming contract for its
task and the parts its runs use, and offers only options the command line has."""

import dataclasses
import json
import re
import typing

import pytest

from nextstep.cli import ALL_OPTIONS, build_parser, main
from nextstep.service.registry import tasks
from nextstep.training.families import FAMILIES, by_task, family
from nextstep.training.kt.loop import TrainConfig
from nextstep.training.kt.run import train_model
from nextstep.training.kt.synthetic import write_gpcm_dataset

COUNTED = {"popularity", "markov"}  # counted in one pass over the training split: no batches, nothing minimised


@pytest.mark.parametrize("entry", FAMILIES.values(), ids=lambda f: f.name)
def test_every_entry_resolves_to_what_it_says(entry):
    model = entry.resolve("model")
    if not isinstance(model, type):  # a builder choosing among classes (deep_gpcm): its return type is the base
        model = typing.get_type_hints(model)["return"]
    assert model.family == entry.name and model.task == entry.task in tasks()
    for member in ("state_spec", "init_state", "step", "readout", "forward"):
        assert callable(getattr(model, member)), member
    for what in ("config", "train_config"):
        assert dataclasses.is_dataclass(entry.resolve(what)), what
    for what in ("train", "evaluate", "exporter") + (("restorer",) if entry.restorer else ()):
        assert callable(entry.resolve(what)), what
    reader, batcher, loss, metrics = entry.parts()
    assert callable(reader) and callable(metrics)
    if entry.name in COUNTED:
        assert batcher is None and loss is None
    else:
        assert callable(batcher) and callable(loss)
    assert set(entry.train_options) <= set(ALL_OPTIONS["train"])
    assert set(entry.evaluate_options) <= set(ALL_OPTIONS["evaluate"])
    train_fields = entry.config_fields("train_config")
    assert set(entry.flags) <= train_fields, set(entry.flags) - train_fields


def test_the_cli_offers_every_family_and_only_them(capsys):
    parser = build_parser()
    for name in FAMILIES:
        args = parser.parse_args(["train", name, "--data", "d"])
        assert args.model == name and all(hasattr(args, option) for option in ALL_OPTIONS["train"])
    assert all(hasattr(parser.parse_args(["evaluate", "a", "--data", "d"]), o) for o in ALL_OPTIONS["evaluate"])
    with pytest.raises(SystemExit):
        parser.parse_args(["train", "nope", "--data", "d"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("entry", FAMILIES.values(), ids=lambda f: f.name)
def test_train_help_shows_the_entry_s_options_and_only_them(entry, capsys):
    """`train NAME --help` lists the options the entry carries, in its order, each with its help; the other
    families' options are not shown (given, they are refused by name: the test below)."""
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", entry.name, "--help"])
    shown = capsys.readouterr().out
    flags = re.findall(r"^  (--[a-z-]+)", shown, re.MULTILINE)
    assert flags == ["--data", "--out", "--force", *(o.flag for o in entry.options), "--config", "--quiet", "--json"]
    for option in entry.options:  # the help as argparse wraps it
        assert " ".join(option.help.split()) in " ".join(shown.split()), option.name


def test_each_entry_names_the_formats_its_reader_reads():
    """The formats `train NAME --help` lists are those of the family's reader, written out in the registry."""
    from nextstep.training.kt.data import FORMATS
    from nextstep.training.next_item.sessions import SESSION_FORMATS

    by_reader = {"nextstep.training.kt.data:load_dataset": FORMATS,
                 "nextstep.training.next_item.sessions:load_session_split": SESSION_FORMATS,
                 "nextstep.training.srs.reviews:read_reviews": ("review_csv", "py_fsrs", "anki")}
    for entry in FAMILIES.values():
        assert entry.formats == by_reader[entry.reader], entry.name


def test_unknown_family_and_tasks():
    with pytest.raises(ValueError, match="unknown model family 'nope'"):
        family("nope")
    assert {f.name for f in by_task("knowledge_tracing")} >= {"deep_gpcm", "dkt", "simakt"}
    assert {f.task for f in FAMILIES.values()} == set(tasks())


@pytest.mark.parametrize("argv,message", [
    (["train", "mrn", "--loss", "bpr"], "--loss does not apply to mrn"),
    (["train", "time_aware", "--epochs", "3"], "--epochs does not apply to time_aware"),
    (["train", "dkt", "--valid"], "--valid: not an option of train dkt"),
    (["train", "gru4rec", "--similarity-config", "x.json"], "--similarity-config: not an option of train gru4rec"),
])
def test_an_option_the_family_does_not_take_is_refused_before_any_data_is_read(argv, message, tmp_path):
    with pytest.raises(SystemExit, match=message):
        main([*argv, "--data", str(tmp_path / "nowhere")])


def no_loss(spec: str, n_cats: int):
    """A loss part other than the knowledge-tracing one: zero whatever TrainConfig.loss says (nothing to learn). It
    takes the model's whole output."""
    return lambda out, targets, mask: out.log_probs.sum() * 0.0


@pytest.mark.slow  # a whole run and export; the fast tier trains deep_gpcm through the same run (conftest `artifacts`)
def test_a_knowledge_tracing_run_trains_with_its_entry_s_loss(tmp_path, monkeypatch):
    monkeypatch.setitem(FAMILIES, "deep_gpcm", dataclasses.replace(family("deep_gpcm"), loss=f"{__name__}:no_loss"))
    data = write_gpcm_dataset(tmp_path / "data", n_students=20, n_questions=8, seq_len_range=(8, 12), seed=0)
    small = {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8}
    train_model("deep_gpcm", data, tmp_path / "out", cfg=TrainConfig(epochs=2, loss="ce", model=small),
                progress=False, log=False)
    history = json.loads((tmp_path / "out" / "report" / "metrics.json").read_text())["history"]
    assert history[0]["epoch"] == 0  # ordinal data: deep_gpcm warm-starts, and the start is validated too
    history = history[1:]
    assert [row["train_loss"] for row in history] == [0.0, 0.0]  # cross-entropy is never 0
    assert history[0]["valid_nll"] == history[1]["valid_nll"]  # and the weights never moved


@pytest.mark.parametrize("name, config, message", [
    ("deep_gpcm", {"epochs": "3"}, "epochs must be an integer, not '3'"),
    ("deep_gpcm", {"epochs": 2.5}, "epochs must be an integer, not 2.5"),
    ("deep_gpcm", {"lr": -1}, "lr must be a number above 0, not -1"),
    ("deep_gpcm", {"batch_size": 0}, "batch_size must be a number above 0, not 0"),
    ("deep_gpcm", {"model": {"memory_size": "20"}}, "model.memory_size must be an integer or null, not '20'"),
    ("deep_gpcm", {"model": {"dropout": True}}, "model.dropout must be a number, not True"),
    ("time_aware", {"calibrate": 1}, "calibrate must be true or false, not 1"),
    ("time_aware", {"max_epochs": 0}, "max_epochs must be a number above 0, not 0"),
    ("gru4rec", {"loss": 3}, "loss must be a string, not 3"),
])
def test_a_config_value_of_the_wrong_type_or_sign_is_refused_naming_its_field(tmp_path, name, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ValueError) as caught:
        family(name).read_train_config(str(path))
    assert str(caught.value) == f"--config {path}: {message}"


def test_every_shipped_config_still_reads():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.json"))
    assert configs
    for path in configs:  # some family reads it, and none refuses it but for keys it does not have
        read = []
        for entry in FAMILIES.values():
            try:
                read.append(entry.read_train_config(str(path)))
            except ValueError as exc:
                assert "unknown keys" in str(exc), (path.name, entry.name, str(exc))
        assert read, path.name
