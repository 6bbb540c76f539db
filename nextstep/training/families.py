"""The family registry: one entry per model family, and the only place that lists them.

An entry names, as "module:attribute" paths resolved on first use (so that `nextstep --help` imports no torch
and no entry imports another family's code):

- the model class, implementing the streaming contract (nextstep/models/streaming.py), and its config dataclass;
- the training config dataclass (`--config FILE` is checked against it, model settings under "model");
- the run that reads the data, trains, evaluates on held-out data and exports, and the evaluation that re-scores
  an exported artifact;
- the parts those use: the data reader, the batcher, the loss and the metrics (None where a family has none;
  signatures are the task's own). A run shared by several families takes them from the entry of the family it
  runs: the knowledge-tracing run all four, the next-item run its reader and metrics (GRU4Rec's and MRN's batcher
  and loss sit inside their own fit). A family's own run (SimAKT, time-aware) uses its parts directly;
- its options of `nextstep train NAME` (`Option`: its help, how argparse reads it, the training config field or
  the run's keyword it sets; the CLI adds each entry's as they are), the evaluate options it takes and the keyword
  each becomes, and the data formats its reader takes (what `nextstep train NAME --help` lists).

The CLI's `train`, `evaluate` and `export` are built from this table. A new family is a model file, an entry
here, a config and its tests.
"""

import argparse
import json
import types
import typing
from dataclasses import KW_ONLY, dataclass, field, fields
from functools import reduce
from importlib import import_module
from pathlib import Path
from typing import get_type_hints

KT, NEXT_ITEM, SRS = "nextstep.training.kt", "nextstep.training.next_item", "nextstep.training.srs"
KT_RUN = f"{KT}.run"
# the formats of each reader, as its module names them (data.FORMATS, sessions.SESSION_FORMATS, the review readers'
# meta["format"]); written out here so that `nextstep --help` imports neither numpy nor torch
KT_FORMATS = ("three_line", "pykt", "dtransformer", "long_csv")
SESSION_FORMATS = ("gru4rec", "diginetica", "csv")
REVIEW_FORMATS = ("review_csv", "py_fsrs", "anki")
# what `train NAME --data` takes, by the family's reader (its --help says it)
KT_DATA = ("a data set directory holding *train* and *test* files, or one data file, whose learners are split 80/20 "
           "by a hash of their id (the file itself, a directory's only data file, or a *train* file with no *test* "
           "file beside it); plain or gzipped")
SESSION_DATA = ("a data set directory holding *_train_full and *_test files, or one file split by time, the sessions "
                "starting in its last 10%% the test (the file itself, a directory's only file, or a *_train_full file "
                "with no *_test file beside it); plain or gzipped")
REVIEW_DATA = ("a review log (a review-log CSV, plain or gzipped; an Anki collection.anki2 or .colpkg backup; a "
               "py-fsrs CSV), a directory holding one user's, or a directory of users' directories at any depth (each "
               "read as one user; one whose data are refused is skipped, saying why)")
PARTS = ("reader", "batcher", "loss", "metrics")
# config fields that come from the data or other files, never from --config
DERIVED = {"n_questions", "n_cats", "n_items", "n_skills", "n_problems", "similarity"}
# training config fields that must be above 0 wherever a family has them (a 0 or negative one fails only later,
# after the data is read, with a message that names no field)
POSITIVE = {"lr", "batch_size", "max_len", "eval_max_len", "epochs", "max_epochs", "patience"}
_JSON_TYPES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "an object",
               list: "a list"}


def _type_error(value, hint) -> str | None:
    """What a JSON value of a config field should have been, or None when it fits the field's annotation (checked
    for plain JSON types and their unions with None; anything else is left to the config class)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union \
        else (hint,)
    plain = [typing.get_origin(o) or o for o in options]
    if not all(o is type(None) or o in _JSON_TYPES for o in plain):
        return None
    for o in plain:
        if o is type(None) and value is None or o is bool and isinstance(value, bool):
            return None
        if isinstance(value, bool):
            continue  # true is no number
        if o is float and isinstance(value, (int, float)) or o in (int, str, dict, list) and isinstance(value, o):
            return None
    return " or ".join(_JSON_TYPES.get(o, "null") for o in plain)


def load(path: str):
    """The object a "module:attribute" path names (attribute may be dotted: "module:Class.method")."""
    module, _, attribute = path.partition(":")
    return reduce(getattr, attribute.split("."), import_module(module))


def int_in(low: int, high: int | None = None):
    """An argparse type: an integer in [low, high] (out of it: argparse's usage error, naming the option)."""
    def parse(text: str) -> int:
        value = int(text)
        if value < low or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be {low} to {high}" if high is not None else
                                             f"must be at least {low}")
        return value
    parse.__name__ = "int"  # argparse names the type in its message for what int() refuses
    return parse


def above_zero(text: str) -> float:
    """An argparse type: a number above 0."""
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError("must be a number above 0")
    return value


@dataclass(frozen=True)
class Option:
    """An option of `nextstep train NAME` that not every family takes: an entry lists its own, in the order its
    help shows them, and the CLI adds them as they are (the others' too, hidden, so that one given to a family
    that does not take it is refused by name)."""
    name: str  # as a keyword: "day_columns" is --day-columns
    help: str
    keyword: str | tuple[str, str] | None = None  # the run's keyword it becomes, or (keyword, "module:function"
    # turning the option's value into the keyword's); None: a flag, setting the training config field of its name
    argparse: dict = field(default_factory=dict)  # how argparse reads it: type, choices, action

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def _format(formats: tuple[str, ...]) -> Option:
    return Option("format", "the data format, where detection is wrong", "fmt", {"choices": formats})


EPOCHS = Option("epochs", "training epochs, an upper bound where the family stops early (default: its config's)",
                argparse={"type": int_in(1)})
SEED = Option("seed", "random seed of the run (default: its config's, 0)", argparse={"type": int})
VALID = Option("valid", "train on *_train_tr and evaluate on *_train_valid (tuning; test unread)", "valid",
               {"action": "store_true"})


@dataclass(frozen=True)
class Demo:
    """A family's demo recipe: a small model trained on data generated with fixed seeds (nextstep/demo.py builds
    it: `python -m nextstep.demo` the bundled ones, `nextstep demo` every family that has a recipe)."""
    data: str  # "module:function" (directory, **generated) -> what the run reads (a data set directory or a file)
    generated: dict  # the generator's settings, seeds included
    training: dict  # training config fields (model settings under "model"), then keywords of the run: recorded
    run: dict = field(default_factory=dict)  # further keywords of the run, not recorded (what it logs or skips)
    bundled: bool = False  # one of the demo models bundled with the package (nextstep/demo_artifacts)
    show: str | None = None  # "module:function" (name, artifact dir, manifest) -> the lines `nextstep demo`
    # prints of it (default: its held-out metrics)


@dataclass(frozen=True)
class Family:
    name: str
    task: str  # knowledge_tracing | next_item | srs: which service routes answer it
    model: str  # "module:Class" of the nn.Module, or "module:function" building one from its config
    config: str  # "module:Class" of its config dataclass
    train_config: str  # "module:Class" of the training config dataclass
    train: str  # "module:function": (entry, data, out, *, cfg, **options) -> manifest: the run gets the entry
    exporter: str  # "module:Class" of its Exporter (training/export.py): the graphs, parity and files of an artifact
    evaluate: str  # "module:function": (artifact, data, **options) -> metrics
    help: str
    _: KW_ONLY
    reader: str | None  # "module:function" reading a data set: the run's (train, test) or review log
    batcher: str | None  # "module:function" cutting training data into the batches of train_epochs
    loss: str | None  # "module:function" (or "module:Class.method") of the loss minimised
    metrics: str | None  # "module:function" scoring predictions on held-out data
    formats: tuple[str, ...] = ()  # the data formats its reader reads (detected; --format, where it takes one, picks)
    data: str = "a data set"  # what `train NAME --data` takes (its help)
    options: tuple[Option, ...] = (EPOCHS, SEED)  # its options of `nextstep train NAME`, with their help
    evaluate_options: dict = field(default_factory=dict)  # CLI option -> keyword of evaluate
    progress: str | None = "progress"  # train's keyword for showing progress (False with --quiet)
    restorer: str | None = None  # "module:function" (name, config, weights) -> model; default: build + load
    user_error: str | None = None  # "module:Class" of the errors in what a user gave (a message, not a traceback)
    fit: str | None = None  # "module:function" the task's shared run calls to build and train the model (next
    # item: (entry, cfg, train, n_items, progress, log) -> (model, history))
    banks: str | None = None  # "module:function" (artifact, data, version, seed) -> summary: `nextstep banks build`
    reads_clicks: bool = True  # False: the model's answer does not depend on the events (popularity), so no
    # training event is hidden as the unknown row
    demo: Demo | None = None  # its demo recipe (nextstep/demo.py), where it has one
    # a small untrained model of the family, for the tests every family is held to (tests/models/test_streaming.py):
    # a config dict for `build`, or "module:function" () -> model (a family fitted from counts)
    sample: dict | str | None = None
    # its search space for `nextstep tune` (training/tune.py): "module:NAME" of a spaces.Space, the ranges searched
    space: str | None = None

    @property
    def flags(self) -> tuple[str, ...]:
        """Its options that set training config fields (--epochs, --seed...)."""
        return tuple(o.name for o in self.options if o.keyword is None)

    @property
    def train_options(self) -> dict:
        """Its other options: option -> keyword of train, or (keyword, "module:function" converting the value)."""
        return {o.name: o.keyword for o in self.options if o.keyword is not None}

    def resolve(self, what: str):
        """The object an entry's path names: `resolve("model")` is the class; None for a part it has not."""
        path = getattr(self, what)
        return None if path is None else load(path)

    def parts(self) -> tuple:
        """(reader, batcher, loss, metrics), resolved."""
        return tuple(self.resolve(what) for what in PARTS)

    def build(self, config: dict):
        """An untrained model from a config dict (a manifest's or weights.pt's `config`)."""
        return self.resolve("model")(self.resolve("config")(**config))

    def sample_model(self):
        """The family's small sample model (`sample`)."""
        return self.build(self.sample) if isinstance(self.sample, dict) else self.resolve("sample")()

    def restore(self, config: dict, weights: dict):
        """The model of an artifact's weights.pt: `restorer(name, config, weights)` where the family names one
        (a model whose buffers' shapes come from its weights), else `build(config)` and its state dict."""
        if self.restorer:
            return self.resolve("restorer")(self.name, config, weights)
        model = self.build(config)
        model.load_state_dict(weights)
        return model

    def config_fields(self, what: str = "config") -> set[str]:
        return {f.name for f in fields(self.resolve(what))}

    def read_train_config(self, path: str | None, flags: dict | None = None):
        """The training config of `--config FILE` (JSON; model settings under "model"), with `flags` (training
        config fields set on the command line) over it. Unknown keys and bad values are a ValueError naming them,
        raised before any data is read."""
        try:
            values = json.loads(Path(path).read_text()) if path else {}
        except (OSError, ValueError) as exc:
            raise ValueError(f"--config {path}: {exc}") from None
        if not isinstance(values, dict) or not isinstance(values.get("model", {}), dict):
            raise ValueError(f"--config {path}: a JSON object is expected, with model settings as an object under "
                             '"model"')
        checks = [("", values, "train_config")] + ([("model.", values.get("model", {}), "config")]
                                                    if self.config else [])
        for where, given, what in checks:
            known = self.config_fields(what) - DERIVED
            unknown = sorted(set(given) - known)
            if unknown:
                raise ValueError(f"--config {path}: unknown keys {[where + k for k in unknown]}; "
                                 f"expected some of {sorted(known)}")
            hints = get_type_hints(self.resolve(what))
            for key, value in given.items():
                wrong = _type_error(value, hints.get(key))
                if wrong is None and key in POSITIVE and value is not None and not value > 0:
                    wrong = "a number above 0"
                if wrong:
                    raise ValueError(f"--config {path}: {where + key} must be {wrong}, not {value!r}")
        try:
            return self.resolve("train_config")(**{**values, **(flags or {})})
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{self.name} config: {exc}") from None


def _kt(name: str, model: str, config: str, help: str, restorer: str | None = None,
        loss: str = f"{KT}.losses:OutputLoss", demo: Demo | None = None, sample: dict | None = None,
        space: str | None = None) -> Family:
    return Family(name, "knowledge_tracing", model, config, f"{KT}.loop:TrainConfig",
                  f"{KT_RUN}:train_model", f"{KT}.export:KTExporter", f"{KT_RUN}:evaluate_artifact", help,
                  reader=f"{KT}.data:load_dataset", batcher=f"{KT}.loop:batches",
                  # (TrainConfig.loss, n_cats) -> the loss over the model's whole output: (out, targets, mask)
                  loss=loss,
                  metrics="nextstep.training.metrics:ordinal_metrics", formats=KT_FORMATS, data=KT_DATA,
                  options=(_format(KT_FORMATS), EPOCHS, SEED),
                  evaluate_options={"format": "fmt", "max_len": "max_len"},
                  restorer=restorer, demo=demo, sample=sample, space=space)


def _next_item(name: str, model: str, config: str, train_config: str, help: str, *, fit: str, batcher: str | None,
               loss: str | None, restorer: str | None = None, options: tuple[Option, ...] = (EPOCHS, SEED),
               reads_clicks: bool = True, demo: Demo | None = None, sample: dict | str | None = None,
               space: str | None = None) -> Family:
    return Family(name, "next_item", model, config, train_config, f"{NEXT_ITEM}.run:train_next_item",
                  f"{NEXT_ITEM}.export:NextItemExporter",
                  f"{NEXT_ITEM}.run:evaluate_next_item", help,
                  reader=f"{NEXT_ITEM}.sessions:load_session_split", batcher=batcher, loss=loss,
                  metrics=f"{NEXT_ITEM}.ranking:evaluate_sessions", restorer=restorer, formats=SESSION_FORMATS,
                  data=SESSION_DATA,
                  options=(_format(SESSION_FORMATS), *options, VALID),
                  evaluate_options={"format": "fmt", "valid": "valid"}, fit=fit,
                  reads_clicks=reads_clicks, demo=demo, sample=sample, space=space)


def _counts(name: str, model: str, help: str, **kwargs) -> Family:
    # counted from the whole training split in one pass: no batches, nothing minimised
    return _next_item(name, f"nextstep.models.next_item:{model}", COUNTS, COUNTS, help, batcher=None, loss=None,
                      fit=f"{NEXT_ITEM}.counts:fit_{name}", restorer=f"{NEXT_ITEM}.counts:restore_{name}",
                      options=(SEED,), sample=f"{NEXT_ITEM}.counts:sample_{name}", **kwargs)


GPCM = "nextstep.models.deep_gpcm"
GPCM_LOSS = f"{KT}.losses:GPCMLoss"  # the CORAL variant's cumulative logits, the order penalty
COUNTS = f"{NEXT_ITEM}.counts:CountConfig"
SPACES = "nextstep.training.spaces"
GPCM_SAMPLE = {"n_questions": 12, "n_cats": 3, "window": 4}


def _gpcm_demo(model: dict | None = None, bundled: bool = False) -> Demo:
    # 100 generated learners of 20 questions, responses 0..3; `nextstep demo` replays a learner through the graphs
    return Demo(f"{KT}.synthetic:write_gpcm_dataset",
                {"n_students": 100, "n_questions": 20, "seq_len_range": (20, 40), "seed": 7},
                {"epochs": 3, "max_len": 40,
                 "model": {"memory_size": 8, "key_dim": 8, "value_dim": 16, "summary_dim": 8, **(model or {})}},
                run={"log": False}, bundled=bundled, show=f"{KT}.synthetic:replay_gpcm")


FAMILIES: dict[str, Family] = {f.name: f for f in (
    _kt("deep_gpcm", f"{GPCM}:deep_gpcm", f"{GPCM}:GPCMConfig", "DKVMN memory with a GPCM (IRT) output",
        restorer=f"{GPCM}:restore", loss=GPCM_LOSS, demo=_gpcm_demo(bundled=True), sample=GPCM_SAMPLE,
        space=f"{SPACES}:DEEP_GPCM"),
    _kt("attention_gpcm", f"{GPCM}:AttentionGPCM", f"{GPCM}:GPCMConfig", "Deep-GPCM with attention-refined writes",
        loss=GPCM_LOSS, demo=_gpcm_demo({"window": 16}), sample=GPCM_SAMPLE, space=f"{SPACES}:ATTENTION_GPCM"),
    _kt("coral_gpcm", f"{GPCM}:CORALGPCM", f"{GPCM}:GPCMConfig", "Deep-GPCM blended with CORAL thresholds",
        loss=GPCM_LOSS, demo=_gpcm_demo(), sample=GPCM_SAMPLE, space=f"{SPACES}:CORAL_GPCM"),
    _kt("dkt", "nextstep.models.dkt:DKT", "nextstep.models.dkt:DKTConfig", "Deep Knowledge Tracing (an LSTM)",
        sample={"n_questions": 12, "n_cats": 3, "hidden": 8, "embed_dim": 8, "layers": 2}, space=f"{SPACES}:DKT"),
    Family("simakt", "knowledge_tracing", "nextstep.models.simakt:SimAKT", "nextstep.models.simakt:SimAKTConfig",
           f"{KT}.simakt_run:SimAKTTrainConfig", f"{KT}.simakt_run:train_entry",
           f"{KT}.simakt_export:SimAKTExporter",
           f"{KT}.simakt_run:evaluate_simakt", "DTransformer + heads over similar students' memory banks",
           reader=f"{KT}.data:load_dataset", batcher=f"{KT}.loop:batches",
           # the prediction loss; training adds the problem L2 and, with lambda_cl, the contrastive loss
           loss="torch.nn.functional:binary_cross_entropy_with_logits",
           metrics=f"{KT}.simakt_run:binary_metrics", formats=KT_FORMATS, data=KT_DATA,
           evaluate_options={"banks": "bank_version"}, progress=None,
           options=(EPOCHS, SEED,
                    Option("similarity_config", "JSON or YAML file of block 3's inter-student heads (FILE#name "
                           "picks one of several); default: none, the DTransformer baseline",
                           ("similarity", f"{KT}.simakt_run:load_similarity")),
                    Option("device", "torch device to train on (default cpu)")),
           user_error="nextstep.models.simakt:ConfigError", banks=f"{KT}.simakt_run:build_artifact_banks",
           sample={"n_questions": 12, "n_skills": 6, "d_model": 16, "n_heads": 2, "n_know": 2, "window": 8},
           space=f"{SPACES}:SIMAKT"),
    _next_item("gru4rec", "nextstep.models.gru4rec:GRU4Rec", "nextstep.models.gru4rec:GRU4RecConfig",
               f"{NEXT_ITEM}.gru4rec_loop:GRU4RecTrainConfig", "GRU4Rec (session-based RNN)",
               fit=f"{NEXT_ITEM}.gru4rec_loop:train_gru4rec", batcher=f"{NEXT_ITEM}.gru4rec_loop:session_parallel",
               loss=f"{NEXT_ITEM}.gru4rec_step:TrainStep",  # cross-entropy, bpr or bpr-max, hand-written gradients
               options=(EPOCHS, SEED, Option("loss", "training loss: cross-entropy, bpr or bpr-max")),
               # 300 Zipf sessions over 60 items with a successor signal, the last sixth held out
               demo=Demo(f"{NEXT_ITEM}.sessions:write_zipf_split",
                         {"n_sessions": 300, "n_items": 60, "length_range": (2, 9), "follow": 0.7, "seed": 0},
                         {"epochs": 2, "n_sample": 16, "seed": 0, "model": {"layers": (16,)}},
                         run={"log": False, "top_k": 30}, bundled=True),
               sample={"n_items": 8, "layers": (6,)}, space=f"{SPACES}:GRU4REC"),
    # the builder sets the family's defaults (a learned repeat channel, a transition head), the restorer keeps an
    # older artifact's config as it was trained (models/mrn.py)
    _next_item("mrn", "nextstep.models.mrn:mrn", "nextstep.models.mrn:MRNConfig",
               f"{NEXT_ITEM}.mrn_loop:MRNTrainConfig", "MRN (modular reasoning over the session)",
               fit=f"{NEXT_ITEM}.mrn_loop:train_mrn", batcher=f"{NEXT_ITEM}.mrn_loop:length_batches",
               loss=f"{NEXT_ITEM}.mrn_loop:mrn_loss",
               restorer="nextstep.models.mrn:restore", sample={"n_items": 8}, space=f"{SPACES}:MRN"),
    _counts("popularity", "Popularity", "training click counts", reads_clicks=False, space=f"{SPACES}:POPULARITY"),
    _counts("markov", "Markov", "first-order Markov chain", space=f"{SPACES}:MARKOV"),
    Family("time_aware", "srs", "nextstep.models.time_aware:TimeAwareTransformer",
           "nextstep.models.time_aware:TimeAwareConfig", f"{SRS}.time_aware_loop:TimeAwareTrainConfig",
           f"{SRS}.time_aware_run:train_entry", f"{SRS}.time_aware_export:TimeAwareExporter",
           f"{SRS}.time_aware_run:evaluate_time_aware",
           "flashcards: rating and answer time (time-aware transformer)",
           # named here, not yet taken from here (srs/time_aware_run.py imports its own); training adds to the CORAL
           # loss the squared error of log(1 + seconds)
           reader=f"{SRS}.reviews:read_reviews",
           batcher=f"{SRS}.time_aware_loop:ReviewTensors.batch",
           loss="nextstep.models.time_aware:coral_loss", metrics=f"{SRS}.eval:evaluate_predictions",
           formats=REVIEW_FORMATS, data=REVIEW_DATA,
           restorer=f"{SRS}.time_aware_export:restore_time_aware",
           options=(SEED,
                    Option("day_columns", "a review-log CSV's day_offset/elapsed_days columns are checked against "
                           "the times (default), recomputed from the times (ignore), or taken as they are (trust)",
                           "day_columns", {"choices": ["check", "ignore", "trust"]}),
                    Option("duration_cap_s", "the app's answer-time cap in seconds, when the CSV cannot say (Anki: "
                           "60 by default; capped answers are left out of the duration error)", "duration_cap_s",
                           {"type": above_zero})),
           evaluate_options={"day_columns": "day_columns", "duration_cap_s": "duration_cap_s"},
           # a simulated review log of one user and 40 cards; evaluated on 2 protocol splits, no baselines
           demo=Demo(f"{SRS}.reviews:write_simulated_reviews", {"n_users": 1, "n_cards": 40, "n_days": 40, "seed": 7},
                     {"max_epochs": 2, "seed": 0, "threads": 1,
                      "model": {"d_model": 16, "n_layers": 1, "ffn_dim": 32, "t2v_dim": 4, "window": 32,
                                "card_window": 4},
                      "n_splits": 2},
                     run={"baselines": False, "log_lines": False}, bundled=True),
           sample={"d_model": 16, "ffn_dim": 16, "window": 8, "card_window": 2}, space=f"{SPACES}:TIME_AWARE"),
)}


def family(name: "str | Family") -> Family:
    """The entry of a family name (an entry is returned as it is: a run takes either)."""
    if isinstance(name, Family):
        return name
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}") from None


def restore(name: str, config: dict, weights: dict):
    """The model of a weights.pt (its family's name, config and state dict): what export.load_weights takes."""
    return family(name).restore(config, weights)


def by_task(task: str) -> list[Family]:
    return [f for f in FAMILIES.values() if f.task == task]
