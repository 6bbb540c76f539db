"""The model registry: every artifact under `<artifacts_dir>/<name>/<version>/`, validated and opened.

An artifact is addressed by its directory: `name` and `version` are the two directory names (the
manifest's own `name` and `version` are kept in `manifest`), so an operator can copy an artifact to a
new version directory.

`load()` builds a complete new snapshot and swaps it in with one assignment: readers see the old set or
the new one, never a mix, and a request holding a `LoadedModel` keeps a working model across reloads.
A reload is all-or-nothing per artifact and never takes away what was serving:

* a broken artifact is refused (`refused`: which, why, what serves instead); the version of that directory
  that was serving keeps serving, the same LoadedModel object, and so does the model's `latest`: a model
  never falls back to an older version because its newer one broke;
* a model whose whole directory vanished, or none of whose versions load any more, keeps what it served
  (each such version reported as refused); one model's fault never touches another model;
* a version directory deleted while its model keeps other good versions is withdrawn (`withdrawn`): the
  operator's way to take a version out of service without a restart;
* at startup (nothing served yet) a model whose newest version is refused serves its newest good version,
  and the refusal is reported like any other (log, `refused`, /readyz, the metric).

`get("name@version")` pins a version; "name" alone is the latest good version (docs/decisions.md).

Every file a manifest names must resolve (symlinks too) inside its artifact's directory; one that does not refuses
the artifact ("path outside the artifact") before anything opens it. A refusal has a `reason` for the log and the
admin (the directory, the file, ONNX Runtime's message) and a `summary` for anyone (the kind of fault: no paths,
no library messages).

A model with state also gets a fold graph, made from its step graph once the artifact passed every check (fold.py:
a run of events in one ONNX Runtime call); an artifact whose step graph cannot be folded serves without one, stepping
event by event, and the reason is logged once: it is never refused for it.

No torch here: the service reads artifacts with ONNX Runtime only.
"""

import hashlib
import json
import logging
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import onnxruntime as ort

from .errors import UnknownId, UnknownModel
from .fold import FOLD, FoldUnavailable, build_fold

log = logging.getLogger(__name__)

MANIFEST_KEYS = ("name", "version", "family", "task", "created", "graphs")  # every task
ONNX_DTYPES = {"tensor(float)": "float32", "tensor(double)": "float64", "tensor(int64)": "int64",
               "tensor(int32)": "int32", "tensor(bool)": "bool", "tensor(float16)": "float16"}


@dataclass(frozen=True)
class TaskSpec:
    """What one task (kt.py, sessions.py, srs.py) needs of an artifact; each task module registers its own
    (`register_task`). `check(name, manifest, graphs, fail, inside)` runs once the graphs are open (`name`: the
    model's directory name; `graphs`: per graph, its inputs as [(name, ONNX type)] and its output names; `inside(
    relative path, part)`: the path, unless it leads outside the artifact) and returns {"extra": the task's own
    fields (a TaskFields), "schema": a state key hash of its own} (either may be left out), or raises
    `fail(message)`."""

    name: str
    graphs: tuple[str, ...]  # the graphs the service runs
    vocabulary: str | None  # the manifest's `vocabularies` key mapping external ids to rows; None: no vocabulary
    state: bool  # whether the model has state tensors (without: the manifest need not list any)
    check: Callable[[str, dict, dict, Callable[[str], Exception], Callable[[str, str], Path]], dict]
    optional: tuple[str, ...] = ()  # graphs opened (and checked) when the manifest has them
    scores: str = "probabilities"  # what live quality records of its events: "probabilities" or "ranking" (quality.py)


class TaskFields:
    """A task's own fields of a model (`LoadedModel.extra`: knowledge tracing's response categories and memory
    banks, flashcards' window sizes), made by its TaskSpec's check. `shown` is what GET /v1/models lists of them,
    beside the fields every model has."""

    __slots__ = ()

    def shown(self) -> dict:
        return {}


NO_FIELDS = TaskFields()


TASKS: dict[str, TaskSpec] = {}


def register_task(spec: TaskSpec) -> TaskSpec:
    TASKS[spec.name] = spec
    return spec


def tasks() -> dict[str, TaskSpec]:
    """Every task's spec (TASKS), its service module imported first (service/__init__.py's register_tasks)."""
    from . import register_tasks

    register_tasks()
    return TASKS


class ArtifactError(Exception):
    """An artifact directory that cannot be served; the message names the directory and the fault. `kind` is the
    kind of fault and `summary` says it with what part it is in ("graph failed to load (step)"): words that
    name no path and quote no library, safe to show any client."""

    def __init__(self, message: str, kind: str = "manifest invalid", part: str | None = None):
        super().__init__(message)
        self.kind = kind
        self.summary = f"{kind} ({part})" if part else kind


@dataclass(eq=False)
class LoadedModel:
    name: str  # directory names: <artifacts_dir>/<name>/<version>/
    version: str
    family: str
    task: str
    path: Path
    manifest: dict
    state_spec: list[dict]  # [{name, shape (per entity), dtype, file, ...}] in the order the graphs take them
    initial_state: dict[str, np.ndarray]  # per entity (no batch axis), read-only
    ids: list[str]  # external question / item ids in index order: model index = position + 2 (0 padding, 1 unknown)
    schema: str  # hash of (name, version, state layout): part of every state key (a task may hash otherwise:
    # srs hashes its stored layout and window sizes, not the version)
    sessions: dict[str, ort.InferenceSession]  # the task's graphs, by name (and "fold", made from "step": fold.py)
    input_names: dict[str, list[str]]  # per graph, in the session's order
    output_names: dict[str, list[str]]  # per graph, in the session's order
    state_nbytes: int  # size of one serialised state
    extra: TaskFields = NO_FIELDS  # the task's own fields (its TaskSpec's check: kt.KtFields, srs.SrsFields)
    fold_events: tuple[str, ...] = ()  # the step's per-event inputs, which the fold graph takes (fold.py); () if none
    fold_prefix: str = ""  # of the fold graph's names for the state and the per-event inputs
    no_fold: str | None = None  # why a model with state has no fold graph (it steps event by event)
    _index: dict[str, int] = field(init=False, repr=False)
    # whether row 1 was trained to answer the ids the model never saw (the manifest's `unknown` section says so:
    # `answers`; an artifact trained before that section existed has an untrained row 1)
    unknown_row: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._index = {qid: i + 2 for i, qid in enumerate(self.ids)}
        unknown = self.manifest.get("unknown")
        self.unknown_row = isinstance(unknown, dict) and unknown.get("answers") is True

    def rows(self, ids: Sequence[str | int]) -> tuple[np.ndarray, list[int]]:
        """(model indices of external ids with every unknown id at the unknown row 1, the positions of those ids)."""
        index = self._index
        out = np.empty(len(ids), dtype=np.int64)
        unknown = []
        for i, qid in enumerate(ids):
            row = index.get(str(qid))
            if row is None:
                row = 1
                unknown.append(i)
            out[i] = row
        return out, unknown

    def lookup(self, ids: Sequence[str]) -> np.ndarray:
        """Model indices (int64) of external ids as the log keeps them (strings), -1 where the model does not know
        one: many ids at once, for rebuilding a state from a log."""
        get = self._index.get
        return np.fromiter((get(qid, -1) for qid in ids), dtype=np.int64, count=len(ids))

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


_told: set[tuple[str, str]] = set()  # (artifact, why) of the models without a fold graph, logged once


def say_once(path: Path, why: str, so: str) -> str:
    """Log once per artifact why it serves without a graph the service makes at load, and what it does instead."""
    if (str(path), why) not in _told:
        _told.add((str(path), why))
        log.warning("artifact %s: %s; %s", path, why, so)
    return why


def _fold(path: Path, spec: list[dict], sessions: dict, input_names: dict, output_names: dict, onnx_path: Path,
          initial: dict[str, np.ndarray], intra_op_threads: int) -> dict:
    """Open the fold graph made from the step graph (fold.py) as sessions["fold"]: LoadedModel's fold fields; where
    there is none, why (`no_fold`), logged once per artifact. Never refuses the artifact: it steps event by event."""
    try:
        session, events, prefix = build_fold(onnx_path, [s["name"] for s in spec], session_options(intra_op_threads),
                                     sessions["step"], initial)
    except FoldUnavailable as e:
        return {"no_fold": say_once(path, f"no fold graph: {e}", "its rebuilds step the events one graph call each")}
    sessions[FOLD] = session
    input_names[FOLD] = [i.name for i in session.get_inputs()]
    output_names[FOLD] = [o.name for o in session.get_outputs()]
    return {"fold_events": tuple(events), "fold_prefix": prefix}


def load_artifact(path: Path, *, intra_op_threads: int = 1, fold: bool = True) -> LoadedModel:
    """Validate and open one artifact directory; raise ArtifactError naming the directory and the fault. `fold`: also
    make the fold graph from the step graph (fold.py) for a model with state."""

    def fail(what: str, kind: str = "manifest invalid", part: str | None = None):
        # (the task modules' checks call fail(what): their faults are the manifest's)
        return ArtifactError(f"{path}: {what}", kind, part)

    root = path.resolve()

    def inside(relative: str, part: str) -> Path:
        """path / relative, unless it resolves (symlinks followed) outside the artifact's directory."""
        p = path / relative
        if not p.resolve().is_relative_to(root):
            raise fail(f"{part} file {relative!r} is outside the artifact's directory", "path outside the artifact",
                       part)
        return p

    try:
        manifest = json.loads(inside("manifest.json", "manifest").read_text())
    except FileNotFoundError:
        raise fail("manifest.json missing", "manifest missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise fail(f"manifest.json is not valid JSON: {e}") from None
    if not isinstance(manifest, dict):
        raise fail("manifest.json is not a JSON object")
    task = tasks().get(str(manifest.get("task")))  # (the task modules register theirs: service/__init__.py)
    required = MANIFEST_KEYS + (("state",) if task is None or task.state else ()) \
        + (("vocabularies",) if task is None or task.vocabulary else ())
    missing = [k for k in required if k not in manifest]
    if missing:
        raise fail(f"manifest.json lacks {missing}")
    if task is None:
        raise fail(f"task {manifest['task']!r} is not one the service answers ({sorted(tasks())})")

    def file(relative: str, what: str, part: str) -> Path:
        p = inside(str(relative), part)
        if not p.is_file():
            raise fail(f"{what} file {relative!r} missing", "file missing", part)
        return p

    # state: spec, initial values, serialised size
    spec = manifest.get("state", [])
    if not task.state and spec:
        raise fail(f"an {manifest['task']} model has no state tensors, the manifest lists {len(spec)}")
    initial, nbytes = {}, 0
    for s in spec:
        try:
            name, shape, dtype = s["name"], [int(d) for d in s["shape"]], np.dtype(s["dtype"])
        except (KeyError, TypeError, ValueError) as e:
            raise fail(f"state entry {s!r} is malformed ({e})") from None
        try:
            value = np.load(file(s.get("file", ""), f"initial state {name!r}", "initial state"), allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise fail(f"initial state {name!r} is not a readable .npy file ({e})", "initial state invalid") from None
        if list(value.shape) != shape or value.dtype != dtype:
            raise fail(f"initial state {name!r} is {value.dtype}{list(value.shape)}, manifest says {dtype}{shape}",
                       "initial state invalid")
        value = np.array(value, order="C")  # (not ascontiguousarray: it turns 0-d into 1-d)
        value.flags.writeable = False
        initial[name] = value
        nbytes += value.nbytes

    # graphs: open each, check it takes what the manifest declares (and the state tensors)
    graphs, sessions, input_names, output_names, opened = manifest["graphs"], {}, {}, {}, {}
    optional = [g for g in task.optional if g in graphs]
    for g in (*task.graphs, *optional):
        if g not in graphs or "onnx" not in graphs[g]:
            raise fail(f"manifest declares no {g!r} ONNX graph")
        onnx_path = file(graphs[g]["onnx"], f"{g} graph", f"{g} graph")
        try:
            session = ort.InferenceSession(str(onnx_path), session_options(intra_op_threads),
                                           providers=["CPUExecutionProvider"])
        except Exception as e:  # ORT raises its own types for unreadable or invalid models
            raise fail(f"{g} graph {onnx_path.name} does not open: {e}", "graph failed to load", g) from None
        actual = [(i.name, i.type) for i in session.get_inputs()]
        try:
            declared = [(i["name"], i["dtype"]) for i in graphs[g].get("inputs", [])]
            declared_out = [o["name"] for o in graphs[g].get("outputs", [])]
        except (KeyError, TypeError, AttributeError):
            raise fail(f"manifest's {g} graph inputs/outputs are not lists of {{name, dtype}}") from None
        mismatch = "graph does not match the manifest"
        if actual != declared:
            raise fail(f"{g} graph takes {actual}, manifest declares {declared}", mismatch, g)
        types = dict(actual)
        for s in spec if g in task.graphs else ():  # (an optional graph, e.g. bank_project, takes no state)
            if ONNX_DTYPES.get(types.get(s["name"], "")) != s["dtype"]:
                raise fail(f"{g} graph has no {s['dtype']} input for state {s['name']!r}", mismatch, g)
        if [o.name for o in session.get_outputs()] != declared_out:
            raise fail(f"{g} graph outputs {[o.name for o in session.get_outputs()]}, manifest declares "
                       f"{declared_out}", mismatch, g)
        sessions[g], input_names[g], output_names[g] = session, [name for name, _ in actual], declared_out
        opened[g] = (actual, declared_out)

    # vocabulary and responses
    ids: list[str] = []
    kind = task.vocabulary
    if kind:
        vocabularies = manifest["vocabularies"]
        if not isinstance(vocabularies, dict):
            raise fail(f"manifest vocabularies is not an object mapping kinds to files: {vocabularies!r}")
        vocab_file = file(vocabularies.get(kind, ""), f"{kind} vocabulary", "vocabulary")
        try:
            ids = [str(i) for i in json.loads(vocab_file.read_text())["ids"]]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
            raise fail(f"{kind} vocabulary {vocab_file.name} is malformed ({e!r})", "vocabulary invalid") from None
        if len(set(ids)) != len(ids):
            raise fail(f"{kind} vocabulary {vocab_file.name} repeats ids", "vocabulary invalid")
    name, version = path.parent.name, path.name
    fields = {"schema": schema_hash(name, version, spec), **task.check(name, manifest, opened, fail, inside)}
    if fold and spec and "step" in sessions:  # (after every check: a refused artifact makes none)
        fields |= _fold(path, spec, sessions, input_names, output_names, inside(graphs["step"]["onnx"], "step graph"),
                        initial, intra_op_threads)
    return LoadedModel(
        name=name, version=version, family=str(manifest["family"]), task=str(manifest["task"]), path=path,
        manifest=manifest, state_spec=spec, initial_state=initial, ids=ids, sessions=sessions,
        input_names=input_names, output_names=output_names, state_nbytes=nbytes, **fields)


@dataclass(frozen=True)
class Refusal:
    """An artifact directory the last load refused, and what serves in its place."""

    model: str  # <artifacts_dir>/<model>/<version>/
    version: str
    path: str
    reason: str  # names the directory and the fault: for the log and the admin
    kept: bool  # the version was serving and keeps serving (the object loaded before)
    serving: str | None  # the model's latest version serving now; None: the model is not served
    kind: str = "unexpected error"  # ArtifactError's kind and summary: for anyone (no paths, no library messages)
    summary: str = "unexpected error"

    @property
    def outcome(self) -> str:
        return (f"{self.model}/{self.version} keeps serving" if self.kept else
                f"{self.model} serves version {self.serving}" if self.serving else f"{self.model} is not served")

    def as_dict(self, details: bool = True) -> dict:
        """The refusal as the API shows it; without `details` (a client that is not an admin) `reason` is the
        summary and there is no `path`."""
        shown = {"path": self.path, "reason": self.reason} if details else {"reason": self.summary}
        return {"model": self.model, "version": self.version, **shown, "kind": self.kind, "kept": self.kept,
                "serving": self.serving, "outcome": self.outcome}


@dataclass(frozen=True)
class LoadReport:
    """What one load did: the refusals (see the module's docstring), the versions withdrawn (their directories
    deleted while the model keeps other versions), and each model's latest version after it."""

    refused: tuple[Refusal, ...]
    withdrawn: tuple[str, ...]  # "name/version"
    serving: dict[str, str]  # name -> latest version

    @property
    def errors(self) -> dict[str, str]:
        """{artifact dir: what is wrong}, as load() has always returned."""
        return {r.path: r.reason for r in self.refused}

    def summaries(self) -> dict[str, str]:
        """{"model/version": the kind of fault}: `errors` as any client may see it."""
        return {f"{r.model}/{r.version}": r.summary for r in self.refused}


@dataclass(frozen=True)
class _Snapshot:
    models: dict[str, dict[str, LoadedModel]]  # name -> version -> model
    latest: dict[str, LoadedModel]  # name -> newest good version
    report: LoadReport
    source: Path | None = None  # the directory scanned: the artifacts directory, or the demo models'


def _newest(versions: dict[str, LoadedModel]) -> LoadedModel:
    return max(versions.values(), key=lambda m: (str(m.manifest["created"]), m.version))


class ModelRegistry:
    """`new_versions`: "auto" (a model's latest is its newest good version) or "manual" (a version added after the
    model served keeps out of `latest` until a rollout names it: `set_serving`)."""

    def __init__(self, artifacts_dir: Path, *, intra_op_threads: int = 1, new_versions: str = "auto",
                 fold_graphs: bool = True, demo_dir: Path | None = None):
        if new_versions not in ("auto", "manual"):
            raise ValueError(f"new_versions must be 'auto' or 'manual', got {new_versions!r}")
        self.artifacts_dir = Path(artifacts_dir)
        # served while the artifacts directory holds no artifact (`nextstep serve --demo`); the first reload that
        # finds one there serves the artifacts directory alone
        self.demo_dir = Path(demo_dir) if demo_dir is not None else None
        self.intra_op_threads = intra_op_threads
        self.fold_graphs = fold_graphs  # False: no fold graphs, every rebuild steps event by event (tests, benches)
        self.new_versions = new_versions
        self._serving: dict[str, str] = {}  # name -> the version a rollout made latest (rollouts.py)
        self._snapshot = _Snapshot({}, {}, LoadReport((), (), {}))
        self._loading = threading.Lock()  # one (re)scan at a time; readers never wait

    def _latest(self, name: str, versions: dict[str, LoadedModel], before: dict[str, LoadedModel]) -> LoadedModel:
        """The version requests without a pin get: the one a rollout names, if loaded; else, with manual new
        versions, the one that was latest, if still loaded; else the newest."""
        named = versions.get(self._serving.get(name, ""))
        if named is not None:
            return named
        kept = before.get(name)
        if self.new_versions == "manual" and kept is not None and versions.get(kept.version) is not None:
            return versions[kept.version]
        return _newest(versions)

    def set_serving(self, serving: dict[str, str]) -> None:
        """Make these versions (name -> version) latest, where loaded, from now on and at every reload; a model left
        out goes back to the rule of `new_versions`."""
        with self._loading:
            self._serving = dict(serving)
            snap = self._snapshot
            latest = {name: self._latest(name, versions, snap.latest) for name, versions in snap.models.items()}
            report = replace(snap.report, serving={n: m.version for n, m in latest.items()})
            self._snapshot = _Snapshot(snap.models, latest, report, snap.source)

    def source(self) -> Path:
        """The directory a load scans: the artifacts directory, unless it holds no artifact and there is a demo."""
        if self.demo_dir is not None and not any(self.artifacts_dir.glob("*/*/manifest.json")):
            return self.demo_dir
        return self.artifacts_dir

    def _scan(self, source: Path) -> tuple[dict[str, dict[str, LoadedModel]],
                                           dict[str, dict[str, tuple[Path, ArtifactError]]]]:
        """(name -> version -> model opened now, name -> version -> (directory, why it was refused))."""
        loaded: dict[str, dict[str, LoadedModel]] = {}
        broken: dict[str, dict[str, tuple[Path, ArtifactError]]] = {}
        dirs = sorted(p for p in source.glob("*/*") if p.is_dir()) if source.is_dir() else []
        for path in dirs:
            if path.name.startswith(".") or path.parent.name.startswith("."):
                continue
            try:
                model = load_artifact(path, intra_op_threads=self.intra_op_threads, fold=self.fold_graphs)
            except ArtifactError as e:
                broken.setdefault(path.parent.name, {})[path.name] = (path, e)
                continue
            except Exception as e:  # a fault load_artifact did not foresee: still this artifact's alone
                log.exception("artifact %s: unexpected error while loading", path)
                broken.setdefault(path.parent.name, {})[path.name] = (
                    path, ArtifactError(f"{path}: {type(e).__name__}: {e}", "unexpected error"))
                continue
            loaded.setdefault(model.name, {})[model.version] = model
        return loaded, broken

    def load(self) -> dict[str, str]:
        """(Re)scan the artifacts directory; return {artifact dir: error} for the artifacts refused."""
        return self.reload().errors

    def reload(self) -> LoadReport:
        """(Re)scan the artifacts directory and swap the result in (rules: the module's docstring)."""
        with self._loading:
            before, source = self._snapshot, self.source()
            if before.source is not None and source != before.source:  # the demo gives way to trained models
                log.warning("serving the artifacts under %s in place of the demo models", source)
                before = _Snapshot({}, {}, before.report)
            loaded, broken = self._scan(source)
            models: dict[str, dict[str, LoadedModel]] = {}
            kept: set[tuple[str, str]] = set()
            missing: dict[tuple[str, str], Path] = {}
            withdrawn: list[str] = []
            for name in sorted(set(loaded) | set(before.models)):
                versions = dict(loaded.get(name, {}))
                old = before.models.get(name, {})
                for version, model in old.items():  # a serving version whose directory is now broken: keep it
                    if version in broken.get(name, {}):
                        versions[version] = model
                        kept.add((name, version))
                gone = [v for v in old if v not in versions]
                if gone and not versions:  # the model would vanish: keep all it served
                    for version in gone:
                        versions[version] = old[version]
                        kept.add((name, version))
                        missing[(name, version)] = old[version].path
                else:
                    withdrawn += [f"{name}/{v}" for v in sorted(gone)]
                if versions:
                    models[name] = versions
            latest = {name: self._latest(name, versions, before.latest) for name, versions in models.items()}
            refused = []
            for name in sorted(set(broken) | {n for n, _ in missing}):
                serving = latest[name].version if name in latest else None
                for version, (path, error) in sorted(broken.get(name, {}).items()):
                    refused.append(Refusal(name, version, str(path), str(error), (name, version) in kept, serving,
                                           error.kind, error.summary))
                for (n, version), path in sorted(missing.items()):
                    if n == name:
                        refused.append(Refusal(name, version, str(path), f"{path}: directory missing", True,
                                               serving, "directory missing", "directory missing"))
            report = LoadReport(tuple(refused), tuple(withdrawn), {n: m.version for n, m in latest.items()})
            for r in refused:
                log.error("artifact %s refused: %s; %s", r.path, r.reason, r.outcome)
            for w in withdrawn:
                log.warning("model version %s withdrawn: its directory was deleted", w)
            self._snapshot = _Snapshot(models, latest, report, source)  # the swap: one assignment
            return report

    def get(self, name: str, version: str = "latest", task: str | None = None) -> LoadedModel:
        """The model of that name and version (`name@version` pins one too); with `task`, only a model of that
        task (else UnknownModel, whose message lists the versions there are)."""
        snap = self._snapshot
        model = snap.latest.get(name) if version == "latest" else None  # the fast path: no pin
        if model is None:
            if version == "latest" and "@" in name:
                name, _, version = name.partition("@")
            model = self._pinned(snap, name, version)
        if task is not None and model.task != task:
            raise UnknownModel(f"model {name!r} is a {model.task} model, not a {task} one")
        return model

    @staticmethod
    def _pinned(snap: _Snapshot, name: str, version: str) -> LoadedModel:
        versions = snap.models.get(name)
        if versions is None:
            available = "; ".join(f"{n}: {', '.join(sorted(v))}" for n, v in sorted(snap.models.items())) or "none"
            raise UnknownModel(f"no model {name!r}; available: {available}")
        model = snap.latest[name] if version == "latest" else versions.get(version)
        if model is None:
            why = next((f"; version {version!r} was refused: {r.summary}" for r in snap.report.refused
                        if r.model == name and r.version == version), "")
            raise UnknownModel(f"model {name!r} has no version {version!r}; available: "
                               f"{', '.join(sorted(versions))} (latest {snap.latest[name].version}){why}")
        return model

    def models(self) -> list[LoadedModel]:
        snap = self._snapshot
        return [snap.models[n][v] for n in sorted(snap.models) for v in sorted(snap.models[n])]

    def latest(self) -> dict[str, LoadedModel]:
        """name -> the version served when a request names no version."""
        return dict(self._snapshot.latest)

    @property
    def report(self) -> LoadReport:
        """What the last load did (refusals stand until a load finds the directory good or gone)."""
        return self._snapshot.report

    @property
    def errors(self) -> dict[str, str]:
        return self._snapshot.report.errors
