"""`nextstep score --engine ray`: the scoring of nextstep/scoring.py on Ray Data, for inputs that one core is too
slow for (the extra `ray`: ray[data] and pyarrow).

    files (JSONL parts: read_text; Parquet parts: read_parquet)
      -> map_batches(_ScoreBatch): a pool of actors, each opening the artifact once (scoring.Scorer) and scoring
         its batches of students, one row per student, through the same code as the single-process command
      -> part files in a directory (JSONL: the very lines the single-process command writes; Parquet: the same
         fields and values, scoring.result_schema)

The output directory is written under a hidden name next to it and renamed into place when every student is
scored, so a failure leaves the previous output as it was and no partial one. Ray is started locally
(`ray.init(num_cpus=workers + 1)`, no dashboard; see `start`) unless RAY_ADDRESS names a cluster to join; on a
cluster, the artifact, input and output paths must be the same shared paths on every node.
"""

import importlib.util
import logging
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("RAY_DATA_LOG_LEVEL", "WARNING")  # read when ray.data is imported: no per-run INFO lines
if importlib.util.find_spec("aiohttp") is None and "fsspec.implementations.http" not in sys.modules:
    # Ray Data (2.60) lists Parquet inputs in several threads, each importing fsspec's HTTP filesystem; without
    # aiohttp that import fails, a thread racing the failing one gets an ImportError Ray does not expect, and the
    # read waits forever. Marked absent, the module fails every import the same way (ModuleNotFoundError, which
    # Ray takes for "no HTTP filesystem"). Only when aiohttp is missing, where that filesystem cannot work anyway.
    sys.modules["fsspec.implementations.http"] = None

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import ray  # noqa: E402
from ray.data.block import BlockAccessor  # noqa: E402
from ray.data.datasource import BlockBasedFileDatasink  # noqa: E402

from . import scoring
from .service.registry import LoadedModel


class _ScoreBatch:
    """A Ray Data actor: opens the artifact once, then turns batches of input rows into result rows."""

    def __init__(self, artifact: str, input_format: str, output_format: str):
        self.scorer = scoring.Scorer.open(artifact)
        self.input_format, self.output_format = input_format, output_format
        self.schema = scoring.result_schema(self.scorer.model)

    def _students(self, batch: pa.Table):
        if self.input_format == "jsonl":  # read_text rows: {"text": line, "path": file}
            for line, path in zip(batch.column("text").to_pylist(), batch.column("path").to_pylist(), strict=True):
                student = scoring.parse_line(line, path)
                if student is not None:
                    yield path, student
        else:
            paths = batch.column("path").to_pylist()
            rows = batch.drop_columns(["path"]).to_pylist()
            for path, row in zip(paths, rows, strict=True):
                yield path, scoring.parse_record(row, path)

    def __call__(self, batch: pa.Table) -> pa.Table:
        results = []
        for path, student in self._students(batch):
            try:
                results.append(self.scorer.score(student))
            except scoring.ScoringError as exc:
                raise scoring.ScoringError(f"{path}: {exc}") from None
        if self.output_format == "jsonl":
            return pa.table({"line": pa.array([scoring.to_line(r) for r in results], pa.string())})
        return scoring.to_table(results, self.schema)


class _PartFiles(BlockBasedFileDatasink):
    """One file per write task: JSONL lines as the single-process command writes them, or a Parquet file.
    Counts the students written (on the driver, when the write completes)."""

    def __init__(self, path: str, output_format: str):
        super().__init__(path, file_format=output_format)
        self.output_format = output_format
        self.students = 0

    def write_block_to_file(self, block: BlockAccessor, file) -> None:
        table = block.to_arrow()
        if self.output_format == "jsonl":
            file.write("".join(line + "\n" for line in table.column("line").to_pylist()).encode())
        else:
            pq.write_table(table, file)

    def on_write_complete(self, write_result) -> None:
        super().on_write_complete(write_result)
        self.students = write_result.num_rows


def start(workers: int | None) -> int:
    """Start Ray quietly (or join the cluster RAY_ADDRESS names); the scoring workers to run. Each holds a CPU for
    the whole run; Ray's reading and writing tasks need one more, or they would wait for a CPU forever: a local
    instance gets `workers` + 1 CPUs (reading and writing are light; the extra one is mostly idle), and on a
    cluster of C CPUs, at most C - 1 workers score (the default)."""
    if not ray.is_initialized():
        quiet = {"include_dashboard": False, "log_to_driver": False, "logging_level": logging.WARNING}
        if os.environ.get("RAY_ADDRESS"):
            ray.init(**quiet)
        else:
            ray.init(num_cpus=(workers or os.cpu_count() or 1) + 1, **quiet)
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False
    context.print_on_execution_start = False
    context.raise_original_map_exception = True  # a worker's ScoringError reaches the driver as one (see _user_error)
    logging.getLogger("ray").setLevel(logging.ERROR)  # Ray Data's notes on its own settings: not the user's concern
    cpus = int(ray.cluster_resources().get("CPU", 0))
    if cpus < 2:
        raise scoring.ScoringError(f"Ray has {cpus} CPU: scoring needs 2 at least (a worker, and reading/writing)")
    if workers and workers > cpus - 1:
        raise scoring.ScoringError(f"--workers {workers}: Ray has {cpus} CPUs; each worker holds one and reading "
                                   f"and writing need one more: at most {cpus - 1}")
    return workers or cpus - 1


def _user_error(exc: BaseException) -> scoring.ScoringError | None:
    """The ScoringError a worker raised, unwrapped (a RayTaskError(ScoringError) keeps it as its `cause`)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, scoring.ScoringError) and not isinstance(exc, ray.exceptions.RayError):  # not the wrapper
            return exc
        cause = getattr(exc, "cause", None)  # RayTaskError keeps the worker's exception here
        exc = cause if isinstance(cause, BaseException) else (exc.__cause__ or exc.__context__)
    return None


def score(model: LoadedModel, files: list[Path], input_format: str, output: Path, output_format: str, *,
          workers: int | None = None, batch_size: int = 64) -> dict:
    """Score every student of `files` into part files under the directory `output` (replaced only when all are
    scored). Returns {"students", "workers", "seconds" (after Ray started), "startup_seconds"}."""
    if input_format not in ("jsonl", "parquet"):
        raise scoring.ScoringError(f"--engine ray reads JSONL or Parquet parts (one record per student), not "
                                   f"{input_format}")
    if output.exists() and not output.is_dir():
        raise scoring.ScoringError(f"--engine ray writes a directory of part files: {output} is a file")
    started = time.perf_counter()
    workers = start(workers)
    ready = time.perf_counter()
    paths = [str(p.resolve()) for p in files]
    if input_format == "jsonl":  # lines; parsing them is the workers' job (scoring.parse_line)
        ds = ray.data.read_text(paths, include_paths=True)
    else:
        ds = ray.data.read_parquet(paths, include_paths=True)
    ds = ds.map_batches(_ScoreBatch, fn_constructor_args=(str(model.path), input_format, output_format),
                        batch_size=batch_size, batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=workers),
                        num_cpus=1)
    # (fewer input blocks than workers, e.g. one small file: some workers idle, which Ray warns about at length)
    warnings.filterwarnings("ignore", message="The minimum number of concurrent actors", category=UserWarning)
    partial = output.with_name(f".{output.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    sink = _PartFiles(str(partial.resolve()), output_format)
    try:
        ds.write_datasink(sink)
    except Exception as exc:
        shutil.rmtree(partial, ignore_errors=True)
        error = _user_error(exc)
        if error is not None:
            # the first line: our message (Ray adds lines about its retries to the exception's text)
            raise scoring.ScoringError(str(error).splitlines()[0]) from None
        raise
    if not partial.is_dir():  # no student at all: Ray leaves no directory
        partial.mkdir(parents=True)
    old = output.with_name(f".{output.name}.old")
    if output.exists():
        shutil.rmtree(old, ignore_errors=True)
        output.rename(old)
    partial.rename(output)
    shutil.rmtree(old, ignore_errors=True)
    return {"students": sink.students, "workers": workers, "seconds": time.perf_counter() - ready,
            "startup_seconds": ready - started}
