"""The family registry: one entry per model family, and the only place that lists them.

An entry names, as "module:attribute" paths resolved on first use (so that `nextstep --help` imports no torch
and no entry imports another family's code):

- the model class, implementing the streaming contract (nextstep/models/streaming.py), and its config dataclass;
- the training config dataclass (`--config FILE` is checked against it, model settings under "model");
- the run that reads the data, trains, evaluates on held-out data and exports (the family's data reader, batcher,
  loss and metrics live behind it), and the evaluation that re-scores an exported artifact;
- which command-line options apply, and the keyword each becomes.

The CLI's `train`, `evaluate` and `export` are built from this table. A new family is a model file, an entry
here, a config and its tests.
"""

from dataclasses import dataclass, field, fields
from importlib import import_module

KT_RUN = "nextstep.training.run"


@dataclass(frozen=True)
class Family:
    name: str
    task: str  # knowledge_tracing | next_item | srs: which service routes answer it
    model: str  # "module:Class" of the nn.Module
    config: str  # "module:Class" of its config dataclass
    train_config: str  # "module:Class" of the training config dataclass
    train: str  # "module:function": (data, out, *, cfg, **options) -> manifest; `named`: the name comes first
    exporter: str  # "module:Class" of its Exporter (training/export.py): the graphs, parity and files of an artifact
    evaluate: str  # "module:function": (artifact, data, **options) -> metrics
    help: str
    named: bool = True  # train takes the family name as its first argument
    train_options: dict = field(default_factory=dict)  # CLI option -> keyword of train, or (keyword, "module:
    # function" turning the option's value into the keyword's)
    evaluate_options: dict = field(default_factory=dict)  # CLI option -> keyword of evaluate
    flags: tuple[str, ...] = ("epochs", "seed")  # CLI flags that set training config fields
    progress: str | None = "progress"  # train's keyword for showing progress (False with --quiet)
    restorer: str | None = None  # "module:function" (name, config, weights) -> model; default: build + load
    user_error: str | None = None  # "module:Class" of the errors in what a user gave (a message, not a traceback)

    def resolve(self, what: str):
        """The object an entry's path names: `resolve("model")` is the class."""
        module, _, attribute = getattr(self, what).partition(":")
        return getattr(import_module(module), attribute)

    def build(self, config: dict):
        """An untrained model from a config dict (a manifest's or weights.pt's `config`)."""
        return self.resolve("model")(self.resolve("config")(**config))

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


def _kt(name: str, model: str, config: str, help: str) -> Family:
    return Family(name, "knowledge_tracing", model, config, "nextstep.training.loop:TrainConfig",
                  f"{KT_RUN}:train_model", "nextstep.training.export:KTExporter", f"{KT_RUN}:evaluate_artifact", help,
                  train_options={"format": "fmt"}, evaluate_options={"format": "fmt", "max_len": "max_len"})


def _next_item(name: str, model: str, config: str, train_config: str, help: str, restorer: str | None = None,
               flags: tuple[str, ...] = ("epochs", "seed")) -> Family:
    return Family(name, "next_item", model, config, train_config, "nextstep.training.next_item_run:train_next_item",
                  "nextstep.training.next_item_export:NextItemExporter",
                  "nextstep.training.next_item_run:evaluate_next_item", help, restorer=restorer,
                  train_options={"format": "fmt", "valid": "valid"},
                  evaluate_options={"format": "fmt", "valid": "valid"}, flags=flags)


GPCM = "nextstep.models.deep_gpcm"
COUNTS = "nextstep.training.next_item_run:CountConfig"
FAMILIES: dict[str, Family] = {f.name: f for f in (
    _kt("deep_gpcm", f"{GPCM}:DeepGPCM", f"{GPCM}:GPCMConfig", "DKVMN memory with a GPCM (IRT) output"),
    _kt("attention_gpcm", f"{GPCM}:AttentionGPCM", f"{GPCM}:GPCMConfig", "Deep-GPCM with attention-refined writes"),
    _kt("coral_gpcm", f"{GPCM}:CORALGPCM", f"{GPCM}:GPCMConfig", "Deep-GPCM blended with CORAL thresholds"),
    _kt("dkt", "nextstep.models.dkt:DKT", "nextstep.models.dkt:DKTConfig", "Deep Knowledge Tracing (an LSTM)"),
    Family("simakt", "knowledge_tracing", "nextstep.models.simakt:SimAKT", "nextstep.models.simakt:SimAKTConfig",
           "nextstep.training.simakt_run:SimAKTTrainConfig", "nextstep.training.simakt_run:train_simakt",
           "nextstep.training.simakt_export:SimAKTExporter",
           "nextstep.training.simakt_run:evaluate_simakt", "DTransformer + heads over similar students' memory banks",
           named=False, evaluate_options={"banks": "bank_version"}, flags=("epochs", "seed", "device"), progress=None,
           train_options={"similarity_config": ("similarity", "nextstep.training.simakt_run:load_similarity")},
           user_error="nextstep.models.simakt:ConfigError"),
    _next_item("gru4rec", "nextstep.models.gru4rec:GRU4Rec", "nextstep.models.gru4rec:GRU4RecConfig",
               "nextstep.training.gru4rec_loop:GRU4RecTrainConfig", "GRU4Rec (session-based RNN)",
               flags=("epochs", "seed", "loss")),
    _next_item("mrn", "nextstep.models.mrn:MRN", "nextstep.models.mrn:MRNConfig",
               "nextstep.training.mrn_loop:MRNTrainConfig", "MRN (modular reasoning over the session)"),
    _next_item("popularity", "nextstep.models.next_item:Popularity", COUNTS, COUNTS, "training click counts",
               restorer="nextstep.training.next_item_export:restore_counts", flags=("seed",)),
    _next_item("markov", "nextstep.models.next_item:Markov", COUNTS, COUNTS, "first-order Markov chain",
               restorer="nextstep.training.next_item_export:restore_counts", flags=("seed",)),
    Family("time_aware", "srs", "nextstep.models.time_aware:TimeAwareTransformer",
           "nextstep.models.time_aware:TimeAwareConfig", "nextstep.training.time_aware_loop:TimeAwareTrainConfig",
           "nextstep.training.time_aware_run:train_time_aware", "nextstep.training.time_aware_export:TimeAwareExporter",
           "nextstep.training.time_aware_run:evaluate_time_aware",
           "flashcards: rating and answer time (time-aware transformer)", named=False, flags=("seed",),
           train_options={"day_columns": "day_columns", "duration_cap_s": "duration_cap_s"},
           evaluate_options={"day_columns": "day_columns", "duration_cap_s": "duration_cap_s"}),
)}


def family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise ValueError(f"unknown model family {name!r}; expected one of {sorted(FAMILIES)}") from None


def restore(name: str, config: dict, weights: dict):
    """The model of a weights.pt (its family's name, config and state dict): what export.load_weights takes."""
    return family(name).restore(config, weights)


def by_task(task: str) -> list[Family]:
    return [f for f in FAMILIES.values() if f.task == task]
