"""A reload reaches every app sharing one Redis (fleet.py): two apps under uvicorn on one real redis-server, a real
trained deep_gpcm artifact; no mocks. tests/service/test_replicas.py checks the same through HAProxy with three
`nextstep serve` processes."""

import shutil
import time
from pathlib import Path

import httpx
import pytest

from nextstep.service.settings import Settings
from tests.service.conftest import add_model_version, served_versions

REFRESH = 0.5


@pytest.fixture
def root(artifacts, tmp_path) -> Path:
    """A private copy of deep_gpcm/v1 that a test adds versions to."""
    art, _ = artifacts
    shutil.copytree(art, tmp_path / "artifacts", ignore=shutil.ignore_patterns("*.pt", "report"))
    return tmp_path / "artifacts"


def wait_for(predicate, timeout: float, what: str) -> float:
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, f"{what}: not within {timeout} s"
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_reload_on_one_app_reaches_the_other_within_the_interval(root, redis_url, serve):
    settings = Settings(artifacts_dir=root, redis_url=redis_url, reload_refresh_seconds=REFRESH)
    with serve(settings) as a, serve(settings) as b:
        assert served_versions(a) == served_versions(b) == {"v1"}
        add_model_version(root, "v2")
        reply = httpx.post(f"{a}/v1/models/reload", timeout=30)
        assert reply.status_code == 200, reply.text
        assert reply.json()["fleet_generation"] == 1 and "deep_gpcm/v2" in reply.json()["models"]
        assert served_versions(a) == {"v1", "v2"}  # the app that reloaded: at once
        took = wait_for(lambda: served_versions(b) == {"v1", "v2"}, REFRESH + 5, "the other app reloaded")
        print(f"the other app served v2 {took:.2f} s after the reload answered (refresh {REFRESH} s)")
        # the other app reloaded once, the first one did not reload again (its own INCR was the next generation)
        time.sleep(2 * REFRESH)
        counts = [_reloads(url) for url in (a, b)]
        assert counts == [1, 1], counts
        # and the other way round, with a refused artifact: 409 as before, the fleet told all the same
        (root / "deep_gpcm" / "broken").mkdir()
        (root / "deep_gpcm" / "broken" / "manifest.json").write_text("{not json")
        reply = httpx.post(f"{b}/v1/models/reload", timeout=30)
        assert reply.status_code == 409 and reply.json()["fleet_generation"] == 2, reply.text
        wait_for(lambda: _reloads(a, "refused") == 1, REFRESH + 5, "the first app followed the second reload")
        assert served_versions(a) == {"v1", "v2"}


def _reloads(url: str, outcome: str = "ok") -> int:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    line = next((x for x in text.splitlines() if x.startswith("nextstep_reloads_total{") and
                 f'outcome="{outcome}"' in x), None)
    return int(float(line.rsplit(" ", 1)[1])) if line else 0


def test_redis_down_fails_no_request_and_the_checks_go_on(root, redis_process, serve):
    settings = Settings(artifacts_dir=root, redis_url=redis_process.url, reload_refresh_seconds=REFRESH)
    with serve(settings) as a, serve(settings) as b:
        redis_process.stop()
        time.sleep(3 * REFRESH)  # several failed checks, logged
        assert served_versions(b) == {"v1"}  # requests that need no Redis answer as before
        add_model_version(root, "v2")
        reply = httpx.post(f"{a}/v1/models/reload", timeout=30)
        assert reply.status_code == 200, reply.text  # reloaded here; the fleet could not be told
        assert reply.json()["fleet_generation"] is None and served_versions(a) == {"v1", "v2"}
        assert served_versions(b) == {"v1"}
        redis_process.start()  # empty: the generation reads 0, as seen before it went down; a reload tells it again
        add_model_version(root, "v3")
        reply = httpx.post(f"{a}/v1/models/reload", timeout=30)
        assert reply.status_code == 200 and reply.json()["fleet_generation"] == 1, reply.text
        wait_for(lambda: served_versions(b) == {"v1", "v2", "v3"}, REFRESH + 5, "the checks went on after the outage")


def test_without_redis_a_reload_is_this_process_only(root, serve):
    with serve(Settings(artifacts_dir=root)) as a:
        add_model_version(root, "v2")
        reply = httpx.post(f"{a}/v1/models/reload", timeout=30)
        assert reply.status_code == 200 and reply.json()["fleet_generation"] is None, reply.text
        assert served_versions(a) == {"v1", "v2"}
