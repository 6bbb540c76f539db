"""`nextstep retrain` end to end (issue 60, parts 3 and 4): a served model's logged traffic becomes its next version,
trained with the serving version's settings, started as a gated shadow of every learner; a traffic too small to
train on is refused in one line saying by how much. Real Redis, the service under uvicorn, the CLI as a user runs it."""

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from nextstep import demo
from nextstep.client import Client
from nextstep.service.settings import Settings
from tests.service.conftest import RedisProcess, serving


@pytest.fixture
def served(tmp_path):
    """(artifacts dir with deep_gpcm/1, the demo model; the service's URL, manual versions; its Redis URL)."""
    redis = RedisProcess(tmp_path / "redis")
    redis.start()
    artifacts = tmp_path / "artifacts"
    shutil.copytree(demo.BUNDLED / "deep_gpcm" / "demo", artifacts / "deep_gpcm" / "1")
    manifest = artifacts / "deep_gpcm" / "1" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": "1"}))
    try:
        with serving(Settings(artifacts_dir=artifacts, redis_url=redis.url, new_versions="manual",
                              reload_refresh_seconds=0.2)) as url:
            yield artifacts, url, redis.url
    finally:
        redis.stop()


def traffic(url: str, learners: int, events: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with Client(url) as client:
        ids = client.models.ids("deep_gpcm").ids
        for i in range(learners):
            client.kt.events("deep_gpcm", f"learner-{i}", [
                {"question_id": rng.choice(ids), "response": rng.randrange(4)} for _ in range(events)])


def retrain(artifacts, url, redis_url, *extra) -> subprocess.CompletedProcess:
    env = {**os.environ, "NEXTSTEP_REDIS_URL": redis_url, "NEXTSTEP_ARTIFACTS_DIR": str(artifacts)}
    return subprocess.run([sys.executable, "-m", "nextstep.cli", "retrain", "--model", "deep_gpcm", "--url", url,
                           *extra], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_retrain_trains_the_next_version_on_the_traffic_and_starts_it_as_a_gated_shadow(served, tmp_path):
    artifacts, url, redis_url = served
    traffic(url, learners=30, events=12)
    done = retrain(artifacts, url, redis_url, "--json", str(tmp_path / "summary.json"))
    assert done.returncode == 0, done.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["version"] == "2" and summary["serving"] == "1" and summary["family"] == "deep_gpcm"
    assert sum(summary["traffic"]["entities"].values()) == 30 and sum(summary["traffic"]["events"].values()) == 360
    manifest = json.loads((artifacts / "deep_gpcm" / "2" / "manifest.json").read_text())
    served_settings = json.loads((artifacts / "deep_gpcm" / "1" / "manifest.json").read_text())["train_config"]
    assert manifest["train_config"]["model"] == served_settings["model"]  # the serving version's settings
    assert manifest["parity"]["passed"] and summary["metrics"] == manifest["metrics"]["test"]
    assert "started as a gated shadow of every entity over version 1" in done.stdout, done.stdout
    with Client(url) as client:
        rollout = client.models.rollout("deep_gpcm")
        assert (rollout.candidate, rollout.mode, rollout.fraction) == ("2", "shadow", 1.0)
        assert rollout.gate is not None and rollout.gate.decision == "continue"
        traffic(url, learners=3, events=4)  # the shadow follows, and the gate counts the pairs
        assert client.kt.predict("deep_gpcm", "learner-0", ["3"]).version == "1"


def test_a_traffic_too_small_to_train_on_is_refused_saying_by_how_much(served):
    artifacts, url, redis_url = served
    traffic(url, learners=3, events=5)
    done = retrain(artifacts, url, redis_url)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message == ("retrain deep_gpcm: the traffic is too small to train on: 3 entities (10 needed: 7 more) and "
                       "15 events (100 needed: 85 more); let it grow and run retrain again"), done.stderr
    assert sorted(p.name for p in (artifacts / "deep_gpcm").iterdir()) == ["1"]  # nothing written
