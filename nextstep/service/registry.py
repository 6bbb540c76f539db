"""The model registry: every artifact under `<artifacts_dir>/<name>/<version>/`, validated and opened.

An artifact is addressed by its directory: `name` and `version` are the two directory names (the
manifest's own `name` and `version` are kept in `manifest`), so an operator can copy an artifact to a
new version directory. A broken artifact is reported in `errors` and skipped; the others serve.

`load()` builds a complete new snapshot and swaps it in with one assignment: readers see the old set or
the new one, never a mix, and a request holding a `LoadedModel` keeps a working model across reloads.

No torch here: the service reads artifacts with ONNX Runtime only.
"""

import hashlib
import json
import logging
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import UnknownId, UnknownModel

log = logging.getLogger(__name__)

# per task: the graphs the service runs, the vocabulary that maps external ids to model rows, and whether the
# model has state tensors. A task without state or vocabulary (srs: the service keeps raw reviews and feeds
# them as a window; ids are hashed, not looked up) needs neither manifest key.
TASKS = {
    "knowledge_tracing": {"graphs": ("step", "predict", "step_predict"), "vocabulary": "questions", "state": True,
                          "optional": ("bank_project",)},  # SimAKT: memory banks -> their keys and values
    "next_item": {"graphs": ("step", "recommend", "step_recommend"), "vocabulary": "items", "state": True},
    "srs": {"graphs": ("predict",), "vocabulary": None, "state": False},
}
MANIFEST_KEYS = ("name", "version", "family", "task", "created", "graphs")  # every task
# srs: what the service feeds the predict graph (an exporter may prune inputs: a subset is fine) and reads back
SRS_INPUTS = {"hist_card": "int64", "hist_deck": "int64", "hist_time": "float64", "hist_rating": "int64",
              "hist_duration": "float32", "hist_state": "int64", "hist_valid": "bool", "card": "int64",
              "deck": "int64", "time": "float64"}
SRS_OUTPUTS = ("rating_probs", "recall", "duration_s")
# The layout of the reviews the service stores per srs user (nextstep/service/srs.py): part of the state key's
# schema hash together with the window sizes. Change it whenever srs.py changes how it stores reviews.
SRS_STATE_LAYOUT = "srs-reviews-v1: card count, recent block and per-card fields of rows (seq i8, card i8, " \
    "deck i8, time f8, duration f4, rating i1, state i1); ids as signed BLAKE2b-64"
ONNX_DTYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(int64)": "int64",
               "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(float16)": "float16"}


class ArtifactError(Exception):
    """An artifact directory that cannot be served; the message names the directory and the fault."""


@dataclass(eq=False)
class LoadedModel:
    name: str  # directory names: <artifacts_dir>/<name>/<version>/
    version: str
    family: str
    task: str
    path: Path
    manifest: dict
    n_cats: int  # response categories (knowledge tracing); 0 for next-item models
    state_spec: list[dict]  # [{name, shape (per entity), dtype, file, ...}] in the order the graphs take them
    initial_state: dict[str, np.ndarray]  # per entity (no batch axis), read-only
    ids: list[str]  # external question / item ids in index order: model index = position + 2 (0 padding, 1 unknown)
    schema: str  # hash of (name, version, state layout): part of every state key (srs: of the stored layout, not
    # the version; srs_schema_hash)
    sessions: dict[str, ort.InferenceSession]  # the task's graphs, by name
    input_names: dict[str, list[str]]  # per graph, in the session's order
    output_names: dict[str, list[str]]  # per graph, in the session's order
    state_nbytes: int  # size of one serialised state
    window: tuple[int, int] = (0, 0)  # srs: (size, card_size) of the review window the model reads; else (0, 0)
    banks: dict | None = None  # SimAKT: the manifest's `banks` (heads, inputs, keys, explain, default, dir); with
    # heads, predict and step_predict take the projected banks (`keys`) and bank_project makes them from `inputs`
    _index: dict[str, int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._index = {qid: i + 2 for i, qid in enumerate(self.ids)}

    def index(self, ids: Sequence[str | int], field: str = "question") -> np.ndarray:
        """Model indices (int64) of external ids; "12" and 12 are the same id. Unknown -> UnknownId(field, id)."""
        index = self._index
        out = np.empty(len(ids), dtype=np.int64)
        for i, qid in enumerate(ids):
            try:
                out[i] = index[str(qid)]
            except KeyError:
                raise UnknownId(field, qid) from None
        return out

    def serialize(self, state: dict[str, np.ndarray]) -> bytes:
        """One entity's state as raw little-endian bytes, tensors in spec order: always `state_nbytes` long."""
        parts = []
        for s in self.state_spec:
            value = np.asarray(state[s["name"]])
            if list(value.shape) != s["shape"]:
                raise ValueError(f"{self.name}/{self.version}: state {s['name']!r} has shape {list(value.shape)}, "
                                 f"expected {s['shape']} (one entity, no batch axis)")
            parts.append(value.astype(np.dtype(s["dtype"]).newbyteorder("<"), copy=False).tobytes())  # C order
        return b"".join(parts)

    def deserialize(self, blob: bytes) -> dict[str, np.ndarray]:
        """Inverse of `serialize`: read-only arrays viewing `blob`. A blob of the wrong size -> ValueError."""
        if len(blob) != self.state_nbytes:
            raise ValueError(f"{self.name}/{self.version}: state blob of {len(blob)} bytes, expected "
                             f"{self.state_nbytes} (schema {self.schema})")
        state, offset = {}, 0
        for s in self.state_spec:
            dtype = np.dtype(s["dtype"]).newbyteorder("<")
            count = math.prod(s["shape"])
            state[s["name"]] = np.frombuffer(blob, dtype=dtype, count=count, offset=offset).reshape(s["shape"])
            offset += count * dtype.itemsize
        return state


def session_options(intra_op_threads: int) -> ort.SessionOptions:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = intra_op_threads
    opts.inter_op_num_threads = 1
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3  # errors reach the caller as exceptions; keep ORT's own log quiet
    return opts


def schema_hash(name: str, version: str, spec: list[dict]) -> str:
    layout = [name, version, [[s["name"], list(s["shape"]), s["dtype"]] for s in spec]]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:12]


def srs_schema_hash(name: str, size: int, card_size: int) -> str:
    """An srs user's stored state is their raw reviews, not model tensors: any version of a model that reads
    windows of the same sizes can use it, so the hash covers the storage layout and the window sizes but not
    the version (a new version keeps its users' histories; one with other window sizes starts afresh)."""
    return hashlib.sha256(json.dumps([name, SRS_STATE_LAYOUT, size, card_size]).encode()).hexdigest()[:12]


def load_artifact(path: Path, *, intra_op_threads: int = 1) -> LoadedModel:
    """Validate and open one artifact directory; raise ArtifactError naming the directory and the fault."""

    def fail(what: str):
        return ArtifactError(f"{path}: {what}")

    try:
        manifest = json.loads((path / "manifest.json").read_text())
    except FileNotFoundError:
        raise fail("manifest.json missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"manifest.json is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise fail("manifest.json is not a JSON object")
    task = TASKS.get(str(manifest.get("task")))
    required = MANIFEST_KEYS + (("state",) if task is None or task["state"] else ()) \
        + (("vocabularies",) if task is None or task["vocabulary"] else ())
    missing = [k for k in required if k not in manifest]
    if missing:
        raise fail(f"manifest.json lacks {missing}")
    if task is None:
        raise fail(f"task {manifest['task']!r} is not one the service answers ({sorted(TASKS)})")

    def file(relative: str, what: str) -> Path:
        p = path / str(relative)
        if not p.is_file():
            raise fail(f"{what} file {relative!r} missing")
        return p

    # state: spec, initial values, serialised size
    spec = manifest.get("state", [])
    if not task["state"] and spec:
        raise fail(f"an {manifest['task']} model has no state tensors, the manifest lists {len(spec)}")
    initial, nbytes = {}, 0
    for s in spec:
        try:
            name, shape, dtype = s["name"], [int(d) for d in s["shape"]], np.dtype(s["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"state entry {s!r} is malformed ({e})") from None
        value = np.load(file(s.get("file", ""), f"initial state {name!r}"), allow_pickle=False)
        if list(value.shape) != shape or value.dtype != dtype:
            raise fail(f"initial state {name!r} is {value.dtype}{list(value.shape)}, manifest says {dtype}{shape}")
        value = np.array(value, order="C")  # (not ascontiguousarray: it turns 0-d into 1-d)
        value.flags.writeable = False
        initial[name] = value
        nbytes += value.nbytes

    # graphs: open each, check it takes what the manifest declares (and the state tensors)
    graphs, sessions, input_names, output_names = manifest["graphs"], {}, {}, {}
    optional = [g for g in task.get("optional", ()) if g in graphs]
    for g in (*task["graphs"], *optional):
        if g not in graphs or "onnx" not in graphs[g]:
            raise fail(f"manifest declares no {g!r} ONNX graph")
        onnx_path = file(graphs[g]["onnx"], f"{g} graph")
        try:
            session = ort.InferenceSession(str(onnx_path), session_options(intra_op_threads),
                                           providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own types for unreadable or invalid models
            raise fail(f"{g} graph {onnx_path.name} does not open: {e}") from None
        actual = [(i.name, i.type) for i in session.get_inputs()]
        declared = [(i["name"], i["dtype"]) for i in graphs[g].get("inputs", [])]
        if actual != declared:
            raise fail(f"{g} graph takes {actual}, manifest declares {declared}")
        types = dict(actual)
        for s in spec if g in task["graphs"] else ():  # (an optional graph, e.g. bank_project, takes no state)
            if ONNX_DTYPES.get(types.get(s["name"], "")) != s["dtype"]:
                raise fail(f"{g} graph has no {s['dtype']} input for state {s['name']!r}")
        declared_out = [o["name"] for o in graphs[g].get("outputs", [])]
        if [o.name for o in session.get_outputs()] != declared_out:
            raise fail(f"{g} graph outputs {[o.name for o in session.get_outputs()]}, manifest declares "
                       f"{declared_out}")
        if manifest["task"] == "srs":
            wrong = [(n, t) for n, t in actual if n not in SRS_INPUTS or ONNX_DTYPES.get(t) != SRS_INPUTS[n]]
            if wrong:
                raise fail(f"{g} graph takes {wrong}, which the service does not feed (it feeds {SRS_INPUTS})")
            if not set(SRS_OUTPUTS) <= set(declared_out):
                raise fail(f"{g} graph outputs {declared_out}, the service needs {list(SRS_OUTPUTS)}")
        sessions[g], input_names[g], output_names[g] = session, [name for name, _ in actual], declared_out

    # vocabulary and responses
    ids: list[str] = []
    kind = task["vocabulary"]
    if kind:
        vocab_file = file(manifest["vocabularies"].get(kind, ""), f"{kind} vocabulary")
        try:
            ids = [str(i) for i in json.loads(vocab_file.read_text())["ids"]]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise fail(f"{kind} vocabulary {vocab_file.name} is malformed ({e!r})") from None
        if len(set(ids)) != len(ids):
            raise fail(f"{kind} vocabulary {vocab_file.name} repeats ids")
    n_cats, window, banks = 0, (0, 0), None
    name, version = path.parent.name, path.name
    schema = schema_hash(name, version, spec)
    if manifest["task"] == "srs":
        w = manifest.get("window")
        try:
            window = (int(w["size"]), int(w["card_size"]))
        except (KeyError, TypeError, ValueError):
            raise fail(f"manifest window {w!r} is not {{size, card_size}} as integers") from None
        if window[0] < 1 or window[1] < 0:
            raise fail(f"manifest window {w!r}: size must be >= 1 and card_size >= 0")
        schema = srs_schema_hash(name, *window)
    elif manifest["task"] == "knowledge_tracing":
        try:
            n_cats = int(manifest["responses"]["n_cats"])
        except (KeyError, TypeError, ValueError):
            raise fail("manifest responses.n_cats missing or not an integer") from None
        banks = _check_banks(manifest.get("banks"), input_names, output_names, fail)
    elif not isinstance(manifest.get("top_k"), int) or manifest["top_k"] < 1:
        raise fail("manifest top_k missing or not a positive integer")

    return LoadedModel(
        name=name, version=version, family=str(manifest["family"]), task=str(manifest["task"]), path=path,
        manifest=manifest, n_cats=n_cats, state_spec=spec, initial_state=initial, ids=ids, schema=schema,
        sessions=sessions, input_names=input_names, output_names=output_names, state_nbytes=nbytes, window=window,
        banks=banks)


def _check_banks(banks, input_names: dict, output_names: dict, fail) -> dict | None:
    """The manifest's `banks` section (SimAKT), checked against the graphs; None when there is none."""
    if banks is None:
        return None
    try:
        heads, inputs, keys, explain = (list(banks[k]) for k in ("heads", "inputs", "keys", "explain"))
        default, folder = banks.get("default"), str(banks["dir"])
    except (KeyError, TypeError) as e:
        raise fail(f"manifest banks {banks!r} lacks or mangles {e}") from None
    if heads:
        if input_names.get("bank_project") != inputs or output_names.get("bank_project") != keys:
            raise fail(f"bank_project graph takes {input_names.get('bank_project')} and outputs "
                       f"{output_names.get('bank_project')}; manifest banks say {inputs} -> {keys}")
        if default is not None and not isinstance(default, str):
            raise fail(f"manifest banks.default {default!r} is not a version name")
    for g in ("predict", "step_predict"):
        if not set(keys) <= set(input_names[g]) or not set(explain) <= set(output_names[g]):
            raise fail(f"{g} graph does not take the bank tensors {keys} or output {explain}")
    return {"heads": heads, "inputs": inputs, "keys": keys, "explain": explain, "default": default, "dir": folder}


@dataclass(frozen=True)
class _Snapshot:
    models: dict[str, dict[str, LoadedModel]]  # name -> version -> model
    latest: dict[str, LoadedModel]  # name -> newest version
    errors: dict[str, str]  # artifact dir -> what is wrong


class ModelRegistry:
    def __init__(self, artifacts_dir: Path, *, intra_op_threads: int = 1):
        self.artifacts_dir = Path(artifacts_dir)
        self.intra_op_threads = intra_op_threads
        self._snapshot = _Snapshot({}, {}, {})
        self._loading = threading.Lock()  # one (re)scan at a time; readers never wait

    def load(self) -> dict[str, str]:
        """(Re)scan the artifacts directory; return {artifact dir: error} for the artifacts skipped."""
        with self._loading:
            models: dict[str, dict[str, LoadedModel]] = {}
            errors: dict[str, str] = {}
            dirs = sorted(p for p in self.artifacts_dir.glob("*/*") if p.is_dir()) if self.artifacts_dir.is_dir() \
                else []
            for path in dirs:
                if path.name.startswith(".") or path.parent.name.startswith("."):
                    continue
                try:
                    model = load_artifact(path, intra_op_threads=self.intra_op_threads)
                except ArtifactError as e:
                    errors[str(path)] = str(e)
                    log.warning("skipping artifact: %s", e)
                    continue
                models.setdefault(model.name, {})[model.version] = model
            latest = {name: max(versions.values(), key=lambda m: (str(m.manifest["created"]), m.version))
                      for name, versions in models.items()}
            self._snapshot = _Snapshot(models, latest, errors)  # the swap: one assignment
            return dict(errors)

    def get(self, name: str, version: str = "latest", task: str | None = None) -> LoadedModel:
        """The model of that name and version; with `task`, only a model of that task (else UnknownModel)."""
        snap = self._snapshot
        model = snap.latest.get(name) if version == "latest" else snap.models.get(name, {}).get(version)
        if model is None:
            available = "; ".join(f"{n}: {', '.join(sorted(v))}" for n, v in sorted(snap.models.items())) or "none"
            raise UnknownModel(f"no model {name!r} version {version!r}; available: {available}")
        if task is not None and model.task != task:
            raise UnknownModel(f"model {name!r} is a {model.task} model, not a {task} one")
        return model

    def models(self) -> list[LoadedModel]:
        snap = self._snapshot
        return [snap.models[n][v] for n in sorted(snap.models) for v in sorted(snap.models[n])]

    @property
    def errors(self) -> dict[str, str]:
        return dict(self._snapshot.errors)
