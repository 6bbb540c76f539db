"""A new model version answers from each entity's whole logged history (issue 37): after version 2 becomes latest,
a learner's or session's next answer equals what version 2 gives when stepped over every logged event, and a pinned
older version catches up with events version 2 took. Real artifacts (the bundled demo models; version 2 starts from
another initial state, so the versions' answers differ), real HTTP, the in-process store and a real Redis."""

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

import nextstep
from nextstep.service.settings import Settings

DEMO = Path(nextstep.__file__).parent / "demo_artifacts"


def add_version(root: Path, family: str, version: str, year: int, nudge: float = 0.0) -> None:
    """root/<family>/<version>: the bundled demo artifact, created in `year`, its initial state tilted by `nudge`
    (not a constant shift: deep_gpcm's initial state is a log prior over an ability grid, blind to a constant)."""
    out = root / family / version
    shutil.copytree(DEMO / family / "demo", out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                   "created": f"{year}-01-01T00:00:00Z"}))
    for spec in manifest["state"]:
        path = out / spec["file"]
        state = np.load(path)
        np.save(path, state + (nudge * np.linspace(-1, 1, state.size)).reshape(state.shape).astype(state.dtype))


@pytest.fixture(params=["in-process", "redis"])
def store_url(request) -> str | None:
    return request.getfixturevalue("redis_url") if request.param == "redis" else None


def probabilities(body: dict) -> np.ndarray:
    return np.array([p["probabilities"] for p in body["predictions"]])


def test_a_learner_keeps_their_history_across_versions(tmp_path, store_url, serve):
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    rng = np.random.default_rng(0)
    events = [{"question_id": str(q), "response": int(r), "event_id": f"e{i}", "timestamp": 1.7e9 + 60 * i}
              for i, (q, r) in enumerate(zip(rng.integers(0, 20, 40), rng.integers(0, 4, 40), strict=True))]
    asked = ["3", "7", "11"]

    def replayed(http: httpx.Client, model: str, history: list[dict]) -> np.ndarray:
        """What `model` gives when stepped over the whole history from its initial state (nothing stored)."""
        body = http.post(f"/v1/kt/{model}/batch", json={"students": [
            {"student_id": "x", "events": history, "predict_question_ids": asked}]}).json()
        return np.array([p["probabilities"] for p in body["students"][0]["predictions"]])

    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        for start in range(0, 40, 10):
            assert http.post("/v1/kt/deep_gpcm/events", json={
                "student_id": "ada", "events": events[start:start + 10]}).status_code == 200
        v1 = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert (v1["version"], v1["events_total"], v1["rebuilt_from_events"]) == ("1", 40, 0)

        add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
        assert http.post("/v1/models/reload").status_code == 200
        v2 = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert (v2["version"], v2["events_total"], v2["rebuilt_from_events"]) == ("2", 40, 40)
        np.testing.assert_allclose(probabilities(v2), replayed(http, "deep_gpcm@2", events), atol=1e-5)
        assert np.abs(probabilities(v2) - probabilities(v1)).max() > 1e-3  # the versions differ
        again = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert again["rebuilt_from_events"] == 0 and again["predictions"] == v2["predictions"]  # stored once

        # version 2 takes an event (a replayed id changes nothing); version 1, pinned, catches up with it
        more = {"question_id": "5", "response": 2, "event_id": "e40"}
        reply = http.post("/v1/kt/deep_gpcm/events", json={
            "student_id": "ada", "events": [events[0], more], "predict_question_ids": asked}).json()
        assert (reply["events_absorbed"], reply["events_skipped"], reply["events_total"]) == (1, 1, 41)
        np.testing.assert_allclose(probabilities(reply), replayed(http, "deep_gpcm@2", [*events, more]), atol=1e-5)
        old = http.post("/v1/kt/deep_gpcm@1/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert (old["version"], old["events_total"], old["rebuilt_from_events"]) == ("1", 41, 1)
        np.testing.assert_allclose(probabilities(old), replayed(http, "deep_gpcm@1", [*events, more]), atol=1e-5)

        # delete: every version's state and the log
        assert http.delete("/v1/kt/deep_gpcm/students/ada").status_code == 200
        for model in ("deep_gpcm", "deep_gpcm@1"):
            gone = http.get(f"/v1/kt/{model}/students/ada").json()
            assert (gone["exists"], gone["events_total"], gone["rebuilt_from_events"]) == (False, 0, 0)


def test_a_session_keeps_its_clicks_across_versions(tmp_path, store_url, serve):
    add_version(tmp_path, "gru4rec", "1", 2026)
    ids = json.loads((DEMO / "gru4rec" / "demo" / "vocab_items.json").read_text())["ids"]
    clicks = [str(i) for i in ids[:5]]
    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/v1/sessions/gru4rec/events", json={
            "session_id": "s", "events": [{"item_id": c} for c in clicks]}).status_code == 200
        add_version(tmp_path, "gru4rec", "2", 2027, nudge=0.3)
        assert http.post("/v1/models/reload").status_code == 200
        served = http.post("/v1/sessions/gru4rec/recommend", json={"session_id": "s", "k": 10}).json()
        assert (served["version"], served["events_total"], served["rebuilt_from_events"]) == ("2", 5, 5)
        batch = http.post("/v1/sessions/gru4rec/batch", json={"sessions": [{"item_ids": clicks}], "k": 10}).json()
        want = batch["sessions"][0]["items"]
        assert [i["item_id"] for i in served["items"]] == [i["item_id"] for i in want]
        np.testing.assert_allclose([i["score"] for i in served["items"]], [i["score"] for i in want], atol=1e-5)
