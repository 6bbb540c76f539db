"""The test suite's own machinery (tests/conftest.py): a fixture's folder built once for every xdist worker, and the
list of the slowest files that xdist hands out first."""

import os
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIRST

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = '''
import os
import time

import pytest

from tests.conftest import build_once  # noqa: F401 (the fixture under test)


@pytest.fixture(scope="session")
def shared(build_once):
    def build(folder):
        time.sleep(1.0)  # the other worker asks meanwhile, and waits
        (folder / "built-by").write_text(os.environ["PYTEST_XDIST_WORKER"])
        with open(os.environ["BUILDS_LOG"], "a") as log:
            log.write("built\\n")

    return build_once("thing", build)
'''

TEST = '''
import os


def test_{name}(shared):
    with open(os.environ["READS_LOG"], "a") as log:
        log.write(os.environ["PYTEST_XDIST_WORKER"] + " " + (shared / "built-by").read_text() + "\\n")
'''


def test_two_workers_share_one_build(tmp_path):
    """Two test files on two workers ask for the same folder at once: one worker builds it, both read it."""
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(CONFTEST)
    for name in ("a", "b"):
        (suite / f"test_{name}.py").write_text(TEST.format(name=name))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
           "BUILDS_LOG": str(tmp_path / "builds"), "READS_LOG": str(tmp_path / "reads")}
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_ADDOPTS"):  # this test may itself run in a worker, or with options
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "xdist.plugin", "-n", "2", "--dist", "loadfile",
                           "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "base"), "-q", str(suite)],
                          cwd=suite, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "builds").read_text() == "built\n"
    reads = sorted((tmp_path / "reads").read_text().splitlines())
    builder = reads[0].split()[1]
    assert reads == [f"gw0 {builder}", f"gw1 {builder}"]


def test_the_files_handed_out_first_exist():
    assert len(set(FIRST)) == len(FIRST)
    for path in FIRST:
        assert (ROOT / path).is_file(), f"tests/conftest.py FIRST names {path}, which is not there"
