"""Each family's search space for `nextstep tune` (training/tune.py): the ranges an expert would search, as
`Param`s over its training config (a model setting is "model.NAME"). A registry entry names its space
("module:NAME", families.py `space`); this module imports neither optuna nor torch.

Trial 0 of a study is the defaults: every parameter at the base config's value (the family's defaults, or the
--config a tune starts from). A parameter whose value is None is left unset, so the family's own default applies
(a default that depends on the data, as Deep-GPCM's memory size); a base value outside a parameter's choices or
range joins them, so that trial 0 is always exactly the base config.
"""

from dataclasses import dataclass, fields, replace
from typing import Any


@dataclass(frozen=True)
class Param:
    name: str  # a training config field, or "model.FIELD" for a model setting
    kind: str  # "float" (values: low, high[, step]), "log" (a float on a log scale: low, high), "int" (low, high[,
    # step]) or "choice" (values: the choices)
    values: tuple
    default: Any = None  # the family's default (None: unset, the family's own)
    when: tuple[str, Any] | None = None  # searched only while the named parameter has this value
    as_list: bool = False  # the value is a one-element list (GRU4Rec's layers: one layer of this size)


@dataclass(frozen=True)
class Space:
    params: tuple[Param, ...]
    note: str = ""  # what the space leaves out, or why it is small

    def with_base(self, cfg) -> "Space":
        """The space whose defaults are the base training config `cfg`'s values (choices and ranges widened to
        hold a value outside them)."""
        out = []
        for p in self.params:
            value = base_value(cfg, p)
            if p.kind == "choice":
                values = p.values if value in p.values else (*p.values, value)
            elif value is None:
                values = p.values
            else:
                low, high, *step = p.values
                on_grid = not step or abs((value - low) / step[0] - round((value - low) / step[0])) < 1e-9
                values = (low, high, *step) if low <= value <= high and on_grid else \
                    (min(low, value), max(high, value))
            out.append(replace(p, values=values, default=value))
        return replace(self, params=tuple(out))

    def defaults(self) -> dict:
        """Trial 0's parameters: each at its default, those whose condition the defaults do not meet left out."""
        chosen = {p.name: p.default for p in self.params}
        return {p.name: p.default for p in self.params if p.when is None or chosen.get(p.when[0]) == p.when[1]}

    def suggest(self, trial) -> dict:
        """A trial's training config overrides (model settings under "model"), drawn from an optuna trial."""
        chosen: dict = {}
        for p in self.params:
            if p.when is not None and chosen.get(p.when[0]) != p.when[1]:
                continue
            if p.kind == "choice":
                chosen[p.name] = trial.suggest_categorical(p.name, list(p.values))
            elif p.kind == "log":
                chosen[p.name] = trial.suggest_float(p.name, p.values[0], p.values[1], log=True)
            elif p.kind == "float":
                step = p.values[2] if len(p.values) > 2 else None
                chosen[p.name] = trial.suggest_float(p.name, p.values[0], p.values[1], step=step)
            else:
                step = p.values[2] if len(p.values) > 2 else 1
                chosen[p.name] = trial.suggest_int(p.name, p.values[0], p.values[1], step=step)
        return overrides(self, chosen)


def overrides(space: Space, params: dict) -> dict:
    """Training config overrides of a trial's parameters: None left unset, model settings under "model"."""
    out: dict = {}
    kinds = {p.name: p for p in space.params}
    for name, value in params.items():
        if value is None:
            continue
        if isinstance(value, float):
            value = float(f"{value:.10g}")  # a stepped float's 0.8500000000000001 as 0.85
        if kinds.get(name) is not None and kinds[name].as_list:
            value = [value]
        if name.startswith("model."):
            out.setdefault("model", {})[name.removeprefix("model.")] = value
        else:
            out[name] = value
    return out


def base_value(cfg, p: Param):
    """The base config's value of a parameter (a model setting the base does not set: the parameter's default)."""
    if p.name.startswith("model."):
        value = getattr(cfg, "model", {}).get(p.name.removeprefix("model."), p.default)
    else:
        value = getattr(cfg, p.name) if p.name in {f.name for f in fields(cfg)} else p.default
    if p.as_list and isinstance(value, (list, tuple)):
        value = value[0] if len(value) == 1 else p.default
    return value


def apply(cfg, overrides: dict):
    """The training config with `overrides` over it (model settings merged into its model dict)."""
    top = {k: v for k, v in overrides.items() if k != "model"}
    if "model" in overrides or hasattr(cfg, "model"):
        top["model"] = {**getattr(cfg, "model", {}), **overrides.get("model", {})}
    return replace(cfg, **top)


# ----------------------------------------------------------------------------- the spaces

LR_DECAY = (Param("weight_decay", "choice", (0.0, 1e-6, 1e-5, 1e-4), 0.0),
            Param("average", "choice", (None, 0.99, 0.999), None))  # the weights' moving average (kt/loop.py)

GPCM_COMMON = (
    Param("lr", "log", (1e-3, 1e-2), 3e-3),
    Param("batch_size", "choice", (16, 32, 64, 128), 32),
    *LR_DECAY,
    Param("model.memory_size", "choice", (None, 10, 20, 50), None),  # None: by the data (models/deep_gpcm.py)
    Param("model.key_dim", "choice", (10, 20, 50), 20),
    Param("model.value_dim", "choice", (25, 50, 100, 200), 50),
    Param("model.summary_dim", "choice", (25, 50, 100), 50),
    Param("model.dropout", "float", (0.0, 0.5, 0.05), 0.0),
)
# the learner state: a GRU over the interactions beside the memory ("memory" ability; None: 50 on binary data)
LEARNER = Param("model.learner_dim", "choice", (None, 0, 25, 50, 100), None)

DEEP_GPCM = Space((*GPCM_COMMON, LEARNER))
CORAL_GPCM = Space((*GPCM_COMMON, LEARNER))
ATTENTION_GPCM = Space(GPCM_COMMON, note="the attention window and heads are left at their defaults")

DKT = Space((
    Param("lr", "log", (1e-3, 1e-2), 3e-3),
    Param("batch_size", "choice", (16, 32, 64, 128), 32),
    *LR_DECAY,
    Param("model.hidden", "choice", (50, 100, 200, 300), 200),
    Param("model.embed_dim", "choice", (50, 100, 200), 200),
    Param("model.layers", "choice", (1, 2), 1),
    Param("model.dropout", "float", (0.0, 0.5, 0.05), 0.2),
))

SIMAKT = Space((
    Param("lr", "log", (3e-4, 3e-3), 1e-3),
    Param("batch_size", "choice", (16, 32, 64), 32),
    Param("lambda_cl", "choice", (0.0, 0.1), 0.0),
    Param("model.d_model", "choice", (64, 128, 256), 128),
    Param("model.n_know", "choice", (8, 16, 32), 16),
    Param("model.dropout", "float", (0.0, 0.4, 0.05), 0.2),
), note="the similarity heads (--similarity-config) are not searched: a tune of SimAKT tunes its DTransformer")

# GRU4Rec: the official paropt.py's parameters, its ranges narrowed where a CPU epoch would take too long (layers up
# to 512, not 1024); bpreg and ELU only with bpr-max, logQ only with cross-entropy
GRU4REC = Space((
    Param("loss", "choice", ("cross-entropy", "bpr-max"), "cross-entropy"),
    Param("model.layers", "choice", (64, 100, 128, 192, 256, 384, 512), 100, as_list=True),
    Param("batch_size", "choice", (32, 48, 64, 96, 128, 192, 256), 32),
    Param("lr", "log", (0.01, 0.5), 0.2),
    Param("momentum", "float", (0.0, 0.9, 0.05), 0.2),
    Param("model.dropout_embed", "float", (0.0, 0.5, 0.05), 0.0),
    Param("model.dropout_hidden", "float", (0.0, 0.7, 0.05), 0.4),
    Param("n_sample", "choice", (0, 128, 256, 512, 1024, 2048), 512),
    Param("sample_alpha", "float", (0.0, 1.0, 0.05), 0.5),
    Param("logq", "choice", (0.0, 1.0), 1.0, when=("loss", "cross-entropy")),
    Param("bpreg", "float", (0.0, 2.0, 0.05), 1.0, when=("loss", "bpr-max")),
    Param("elu_param", "choice", (0.0, 0.5, 1.0), 0.0, when=("loss", "bpr-max")),
    Param("model.constrained_embedding", "choice", (True, False), True),
    Param("model.embedding", "choice", (0, 64, 128, 256), 0, when=("model.constrained_embedding", False)),
), note="epochs stay at the config's (10, as the official tuning keeps them)")

MRN = Space((
    Param("lr", "log", (0.01, 0.2), 0.05),
    Param("lr_final", "choice", (0.1, 0.3, 1.0), 0.1),
    Param("batch_size", "choice", (512, 1024, 2048), 1024),
    Param("model.dim", "choice", (16, 32, 64), 32),
    Param("model.temperature", "float", (0.1, 0.5, 0.05), 0.2),
))

# counted models: popularity has nothing that changes its ranking (an empty space: the study is trial 0, the
# defaults); Markov the width of its successor lists
POPULARITY = Space((), note="nothing to search: the ranking is the training clicks' counts")
MARKOV = Space((Param("width", "choice", (20, 50, 100, 200), 100),),
               note="only the successor lists' width: a first-order chain has nothing else")

# flashcards: what the earlier tunings over users varied (docs/results.md, issues 15, 19 and 38)
TIME_AWARE = Space((
    Param("lr", "log", (5e-4, 1e-2), 2e-3),
    Param("weight_decay", "choice", (0.0, 1e-5, 1e-4, 1e-3), 1e-4),
    Param("batch_size", "choice", (128, 256, 512), 256),
    Param("hide_fields", "float", (0.0, 0.3, 0.05), 0.1),
    Param("duration_weight", "float", (0.0, 1.0, 0.1), 0.5),
    Param("blend_prior", "choice", (5.0, 10.0, 20.0, 40.0), 20.0),
    Param("model.d_model", "choice", (32, 64, 128), 64),
    Param("model.n_layers", "choice", (1, 2, 3), 2),
    Param("model.ffn_dim", "choice", (64, 128, 256), 128),
    Param("model.dropout", "float", (0.0, 0.3, 0.05), 0.1),
))
