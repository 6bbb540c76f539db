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
