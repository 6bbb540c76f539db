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

MODELS = ("deep_gpcm", "gru4rec", "time_aware")  # a demo model of each task


def served_model(tmp_path, model: str):
    """(artifacts dir with <model>/1, the demo model; the service's URL, manual versions; its Redis URL)."""
    redis = RedisProcess(tmp_path / "redis")
    redis.start()
    artifacts = tmp_path / "artifacts"
    shutil.copytree(demo.BUNDLED / model / "demo", artifacts / model / "1")
    manifest = artifacts / model / "1" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "version": "1"}))
    try:
        with serving(Settings(artifacts_dir=artifacts, redis_url=redis.url, new_versions="manual",
                              reload_refresh_seconds=0.2)) as url:
            yield artifacts, url, redis.url
    finally:
        redis.stop()


@pytest.fixture
def served(tmp_path):
    yield from served_model(tmp_path, "deep_gpcm")


def traffic(url: str, learners: int, events: int, seed: int = 0, model: str = "deep_gpcm") -> None:
    """`learners` entities of the model's task with `events` events each: learners' responses, sessions' clicks,
    flashcard users' reviews (over a few weeks, some cards reviewed on several days)."""
    rng = random.Random(seed)
    with Client(url) as client:
        ids = client.models.ids(model).ids if model != "time_aware" else []
        for i in range(learners):
            if model == "deep_gpcm":
                client.kt.events(model, f"learner-{i}", [
                    {"question_id": rng.choice(ids), "response": rng.randrange(4)} for _ in range(events)])
            elif model == "gru4rec":
                client.sessions.events(model, f"session-{seed}-{i}", [{"item_id": rng.choice(ids)}
                                                                      for _ in range(events)])
            else:
                times = sorted(1.7e9 + rng.uniform(0, 30 * 86400) for _ in range(events))
                client.srs.reviews(model, f"user-{seed}-{i}", [{"card_id": f"card-{rng.randrange(5)}", "time": t,
                                                         "rating": rng.choice([1, 3, 3, 3, 4])} for t in times])


def retrain(artifacts, url, redis_url, *extra, model: str = "deep_gpcm") -> subprocess.CompletedProcess:
    env = {**os.environ, "NEXTSTEP_REDIS_URL": redis_url, "NEXTSTEP_ARTIFACTS_DIR": str(artifacts)}
    return subprocess.run([sys.executable, "-m", "nextstep.cli", "retrain", "--model", model, "--url", url,
                           *extra], capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("model", MODELS)
def test_retrain_trains_the_next_version_on_the_traffic_and_starts_it_as_a_gated_shadow(tmp_path, model):
    for artifacts, url, redis_url in served_model(tmp_path, model):
        traffic(url, learners=30, events=12, model=model)
        done = retrain(artifacts, url, redis_url, "--json", str(tmp_path / "summary.json"), model=model)
        assert done.returncode == 0, done.stderr
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert summary["version"] == "2" and summary["serving"] == "1" and summary["model"] == model
        assert sum(summary["traffic"]["entities"].values()) == 30
        assert sum(summary["traffic"]["events"].values()) == 360
        manifest = json.loads((artifacts / model / "2" / "manifest.json").read_text())
        served_settings = json.loads((artifacts / model / "1" / "manifest.json").read_text())["train_config"]
        assert manifest["train_config"]["model"] == served_settings["model"]  # the serving version's settings
        assert manifest["parity"]["passed"] and summary["metrics"] == manifest["metrics"]["test"]
        assert "started as a gated shadow of every entity over version 1" in done.stdout, done.stdout
        with Client(url) as client:
            rollout = client.models.rollout(model)
            assert (rollout.candidate, rollout.mode, rollout.fraction) == ("2", "shadow", 1.0)
            assert rollout.gate is not None and rollout.gate.decision == "continue"
            traffic(url, learners=3, events=4, seed=1, model=model)  # the shadow follows, the gate counts the pairs
            assert client.models.rollout(model).serving == "1"


def test_a_traffic_too_small_to_train_on_is_refused_saying_by_how_much(served):
    artifacts, url, redis_url = served
    traffic(url, learners=3, events=5)
    done = retrain(artifacts, url, redis_url)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message == ("retrain deep_gpcm: the traffic is too small to train on: 3 entities (10 needed: 7 more) and "
                       "15 events (100 needed: 85 more); let it grow and run retrain again"), done.stderr
    assert sorted(p.name for p in (artifacts / "deep_gpcm").iterdir()) == ["1"]  # nothing written
