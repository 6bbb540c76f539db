"""What every test shares, in one process or in several (pytest-xdist, `make test`'s `-n auto`).

* Under xdist each worker runs torch (and what the tests spawn) on one thread: the workers already take the cores.
* `build_once(name, build)` -- a folder of things that are slow to make (trained and exported models), made once per
  test run and shared by the workers: the first worker to ask builds it while holding a file lock, the others wait
  and read what it built. The folder is read-only by convention: a test that changes files copies it first.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... in an xdist worker; None in a plain run

if WORKER:
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")


def pytest_configure(config: pytest.Config) -> None:
    if WORKER and "torch" in sys.modules:  # imported before this file (a plugin): its thread pool is already made
        sys.modules["torch"].set_num_threads(1)


# The files that take longest (most of it training and exporting models), slowest first (measured 2026-11-27 on
# the 2-core development machine, both tiers; test_tune and test_retrain, 3-4 min each, and the Redis Cluster tests
# added 2026-12-03). Under xdist they are handed out first, so that no worker is left with one of them while the
# others have finished; the Makefile's --no-loadscope-reorder keeps this order (xdist would otherwise start with the
# files that hold most tests).
FIRST = (
    "tests/service/kt/test_simakt_api.py",
    "tests/training/test_export.py",
    "tests/training/test_tune.py",
    "tests/test_retrain.py",
    "tests/training/srs/test_time_aware_run.py",
    "tests/service/srs/test_srs_api.py",
    "tests/test_cli.py",
    "tests/training/kt/test_simakt_run.py",
    "tests/service/kt/test_families_served.py",  # builds kt_families early: test_fold, handed out later, reads it
    "tests/service/test_reload.py",
    "tests/service/test_cluster.py",  # (make test-all only: about 1.5 min alone, 2.5 beside two busy cores)
    "tests/service/test_replicas.py",
    "tests/service/kt/test_kt_api.py",
    "tests/service/test_demo_served.py",
    "tests/training/kt/test_warm_start.py",
    "tests/training/kt/test_answer_order.py",
    "tests/training/next_item/test_mrn_loop.py",
    "tests/training/test_families.py",
    "tests/service/sessions/test_sessions_api.py",
    "tests/service/test_quality.py",
    "tests/service/test_upgrades.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if WORKER:  # a stable sort: each file's tests, and the other files, stay in their order
        rank = {path: n for n, path in enumerate(FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(FIRST)))


@pytest.fixture(scope="session")
def build_once(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, Callable[[Path], None]], Path]:
    """`build_once(name, build)`: the folder `name` after `build(folder)` filled it, once per test run.

    In a plain run the folder is a fresh temporary one. Under xdist it lies in the folder the workers' temporary
    folders share (the run's own, `getbasetemp().parent`); a lock file beside it makes the other workers wait for
    the first. A build that failed is retried by the next worker that asks (and fails there too, with its error)."""

    def once(name: str, build: Callable[[Path], None]) -> Path:
        if not WORKER:
            folder = tmp_path_factory.mktemp(name)
            build(folder)
            return folder
        from filelock import FileLock

        shared = tmp_path_factory.getbasetemp().parent
        folder, done = shared / f"shared-{name}", shared / f"shared-{name}.done"
        with FileLock(str(shared / f"shared-{name}.lock")):
            if not done.exists():
                shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
                folder.mkdir()
                build(folder)
                done.touch()
        return folder

    return once


# -- the bundled demo models built again ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def demo_rebuilt(build_once) -> Path:
    """The demo models built again from scratch as `make demo-artifacts` does (generated data, fixed seeds, one
    thread): out/<name>/demo as bundled, work/artifacts/<name> each run's whole artifact (its weights too); once per
    run (the slow tier: about 3 min), read-only."""
    def build(root: Path) -> None:
        import torch

        from nextstep import demo

        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            demo.build(root / "out", work=root / "work", log=lambda line: None)
        finally:
            torch.set_num_threads(threads)

    return build_once("demo-rebuilt", build)


# -- a SimAKT trained for real: measured by tests/training/kt/test_simakt_run.py, served by test_simakt_api.py ------
SIMAKT_SIMILARITY = {"intra_heads": 6, "inter_heads": [{"type": "cluster", "size": 6},
                                                       {"type": "knn", "size": 10, "k_neighbors": 3}],
                     "answer_heads": [{"type": "peers", "size": 8, "d_key": 8}]}
SIMAKT_SMALL = {"d_model": 32, "n_heads": 8, "n_know": 4, "window": 32}


@pytest.fixture(scope="session")
def simakt_trained(build_once) -> Path:
    """root/data (generated DTransformer-format problems, 100 training and 30 test students) and root/artifact: a
    small SimAKT (SIMAKT_SMALL; a cluster and a KNN head in block 3, the peers head at the answer) trained for real
    through `train_simakt` (two epochs, answer heads refitted, 3 bank folds) and exported; once per run (an export
    of about 1.5 min), read-only: copy it to change it."""
    def build(root: Path) -> None:
        from nextstep.training.kt.simakt_run import SimAKTTrainConfig, train_simakt
        from nextstep.training.kt.synthetic import write_problem_dataset

        data = write_problem_dataset(root / "data", n_train=100, n_test=30, length=(5, 50))
        train_simakt(data, root / "artifact", cfg=SimAKTTrainConfig(epochs=2, model=SIMAKT_SMALL,
                                                                    refit_answer_heads=True, bank_folds=3),
                     similarity=SIMAKT_SIMILARITY, log=lambda *_: None)

    return build_once("simakt", build)


# -- every knowledge-tracing family but SimAKT trained small: served by test_families_served.py, folded by test_fold.py
KT_TINY = {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8, "embed_dim": 8, "n_heads": 2, "window": 4,
           "hidden": 8}  # small sizes for whichever of these settings a family's config has


@pytest.fixture(scope="session")
def kt_families(build_once) -> tuple[Path, Path]:
    """(artifacts dir holding <family>/1, data dir): each knowledge-tracing family of the registry but SimAKT (which
    needs banks) trained for real at KT_TINY's sizes for one epoch on generated GPCM data (40 students, 12 questions,
    seed 11) and exported, parity passed; once per run, read-only."""
    def build(root: Path) -> None:
        from nextstep.training.families import by_task
        from nextstep.training.kt.loop import TrainConfig
        from nextstep.training.kt.run import train_model
        from nextstep.training.kt.synthetic import write_gpcm_dataset

        data = write_gpcm_dataset(root / "data", n_students=40, n_questions=12, seq_len_range=(10, 14), seed=11)
        for entry in by_task("knowledge_tracing"):
            if entry.name == "simakt":
                continue
            small = {k: v for k, v in KT_TINY.items() if k in entry.config_fields()}
            manifest = train_model(entry.name, data, root / "artifacts" / entry.name / "1",
                                   cfg=TrainConfig(epochs=1, model=small), progress=False, log=False)
            assert manifest["parity"]["passed"], (entry.name, manifest["parity"])

    root = build_once("kt-families", build)
    return root / "artifacts", root / "data"


# -- a knowledge-tracing model trained for real: served by the service tests, measured by the training tests ---------
SMALL = {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8}


@pytest.fixture(scope="session")
def artifacts(build_once) -> tuple[Path, Path]:
    """(artifacts dir holding deep_gpcm/v1, data dir): a tiny deep_gpcm trained for real on generated data (ordinal,
    4 categories; seed 0, validation fraction 0.1) and exported; once per run, read-only: copy it to change it."""
    def build(root: Path) -> None:
        from nextstep.training.kt.loop import TrainConfig
        from nextstep.training.kt.run import train_model
        from nextstep.training.kt.synthetic import write_gpcm_dataset

        data = write_gpcm_dataset(root / "data", n_students=40, n_questions=12, seq_len_range=(12, 16), seed=5)
        train_model("deep_gpcm", data, root / "artifacts" / "deep_gpcm" / "v1",
                    cfg=TrainConfig(epochs=2, model=SMALL), progress=False, log=False)

    root = build_once("kt", build)
    return root / "artifacts", root / "data"


@pytest.fixture(scope="session")
def artifact_tree(build_once, artifacts) -> Path:
    """deep_gpcm/1 (the session's `artifacts` model), deep_gpcm/2 (a copy marked newer) and attention_gpcm/1 (tiny,
    trained for real on the same data, one epoch, no warm start); once per run, read-only: copy it to change it."""
    kt, data = artifacts
    small = dict(memory_size=4, key_dim=8, value_dim=8, summary_dim=8, embed_dim=8, n_heads=2, window=4)

    def build(root: Path) -> None:
        import json

        from nextstep.training.kt.loop import TrainConfig
        from nextstep.training.kt.run import train_model

        tree = root / "artifacts"
        train_model("attention_gpcm", data, tree / "attention_gpcm" / "1", cfg=TrainConfig(epochs=1, model=small),
                    progress=False, log=False)
        for version in ("1", "2"):
            shutil.copytree(kt / "deep_gpcm" / "v1", tree / "deep_gpcm" / version)
        path = tree / "deep_gpcm" / "2" / "manifest.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "created": "2999-01-01T00:00:00Z",
                                    "version": "2"}))

    return build_once("service-artifacts", build) / "artifacts"
