"""Rollouts (issue 35, parts 2 and 3): with NEXTSTEP_NEW_VERSIONS=manual a new version is loaded but serves no one
until a rollout names it; a canary puts it on a stable, hash-chosen fraction of learners, the same on two replicas
sharing one Redis; promote and abort; no learner loses history. Real HTTP, real ONNX Runtime, a real Redis."""

import json
import time

import httpx
import numpy as np

from nextstep.service.rollouts import in_fraction
from nextstep.service.settings import Settings
from tests.service.test_upgrades import DEMO, add_version, learner_events

LEARNERS = [f"learner-{i}" for i in range(40)]


def test_the_hash_is_stable_and_a_larger_fraction_only_adds_entities():
    chosen = {f: {e for e in LEARNERS * 5 if in_fraction("m", e, f)} for f in (0.0, 0.2, 0.5, 1.0)}
    assert chosen[0.0] == set() and chosen[1.0] == set(LEARNERS)
    assert chosen[0.2] <= chosen[0.5] and 0 < len(chosen[0.2]) < len(chosen[0.5]) < len(LEARNERS)
    assert in_fraction("m", "x", 0.5) == in_fraction("m", "x", 0.5)
    assert {e for e in LEARNERS if in_fraction("other", e, 0.5)} != chosen[0.5]  # a model's own draw


def test_manual_versions_wait_then_a_canary_a_promotion_and_an_abort_on_two_replicas(tmp_path, redis_url, serve):
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    events = learner_events(len(LEARNERS), 3)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual",
                        reload_refresh_seconds=0.2)
    with serve(settings) as a_url, serve(settings) as b_url, httpx.Client(base_url=a_url, timeout=30) as a, \
            httpx.Client(base_url=b_url, timeout=30) as b:

        def versions(http: httpx.Client) -> dict[str, str]:
            return {learner: http.get(f"/v1/kt/deep_gpcm/students/{learner}").json()["version"]
                    for learner in LEARNERS}

        for learner, history in zip(LEARNERS, events.values(), strict=True):
            assert a.post("/v1/kt/deep_gpcm/events", json={"student_id": learner, "events": history[:2]}) \
                .status_code == 200
        add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
        assert a.post("/v1/models/reload").status_code == 200
        time.sleep(1)  # (b follows the reload generation)
        for http in (a, b):
            rollout = http.get("/v1/models/deep_gpcm/rollout").json()
            assert (rollout["serving"], rollout["candidate"], rollout["versions"]) == ("1", None, ["1", "2"])
        assert set(versions(b).values()) == {"1"}  # loaded, serving no one

        put = a.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "mode": "canary", "fraction": 0.3})
        assert put.status_code == 200, put.text
        assert (put.json()["candidate"], put.json()["fraction"]) == ("2", 0.3)
        canary = {e for e in LEARNERS if in_fraction("deep_gpcm", e, 0.3)}
        assert 0 < len(canary) < len(LEARNERS)
        assert {e for e, v in versions(a).items() if v == "2"} == canary
        time.sleep(1)  # b reads the rollout within its refresh interval
        assert versions(b) == versions(a)
        reply = b.post("/v1/kt/deep_gpcm/events", json={"student_id": sorted(canary)[0], "events": [
            {"question_id": "3", "response": 1}], "predict_question_ids": ["3"]}).json()
        assert (reply["version"], reply["events_total"]) == ("2", 3)  # the candidate goes on from the whole log

        assert a.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "fraction": 0.6}).status_code == 200
        wider = {e for e, v in versions(a).items() if v == "2"}
        assert canary < wider  # only added
        quality = b.get("/v1/models/deep_gpcm/quality").json()["versions"]  # (b scored it: flushed by its read)
        assert {q["version"]: q["role"] for q in quality} == {"1": "serving", "2": "canary"}
        assert next(q for q in quality if q["version"] == "2")["scored"] == 1

        assert a.delete("/v1/models/deep_gpcm/rollout").json()["candidate"] is None
        assert set(versions(a).values()) == {"1"}
        assert a.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "fraction": 0.1}).status_code == 200
        promoted = a.post("/v1/models/deep_gpcm/rollout/promote").json()
        assert (promoted["serving"], promoted["candidate"]) == ("2", None)
        time.sleep(1)
        for http in (a, b):
            seen = versions(http)
            assert set(seen.values()) == {"2"}
        totals = [a.get(f"/v1/kt/deep_gpcm/students/{e}").json()["events_total"] for e in LEARNERS]
        assert sum(totals) == 2 * len(LEARNERS) + 1  # no learner lost an event at any step

        bad = [a.put("/v1/models/deep_gpcm/rollout", json={"candidate": "9", "fraction": 0.1}),
               a.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "fraction": 0.1}),
               a.put("/v1/models/deep_gpcm/rollout", json={"candidate": "1", "fraction": 1.5}),
               a.post("/v1/models/deep_gpcm/rollout/promote")]
        assert [r.status_code for r in bad] == [422] * 4, [r.text for r in bad]
        assert [r.json()["field"] for r in bad] == ["candidate", "candidate", "fraction", "model"]


def test_rollouts_need_manual_new_versions(tmp_path, serve):
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    add_version(tmp_path, "deep_gpcm", "2", 2027)
    with serve(Settings(artifacts_dir=tmp_path)) as url, httpx.Client(base_url=url) as http:
        assert http.get("/v1/models/deep_gpcm/rollout").json()["serving"] == "2"  # auto: the newest serves
        reply = http.put("/v1/models/deep_gpcm/rollout", json={"candidate": "1", "fraction": 0.5})
        assert reply.status_code == 422 and "NEXTSTEP_NEW_VERSIONS=manual" in reply.json()["detail"]


def test_a_shadow_follows_every_learner_without_answering_and_is_scored_on_the_same_events(
        tmp_path, redis_url, serve):
    """Issue 35, part 4: a 100% shadow of version 2: every answer is version 1's; version 2's own state of each
    learner follows their log off the request path (a pinned read of it then rebuilds nothing and equals its replay);
    /quality scores both versions on the same events."""
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
    history = learner_events(8, 6, seed=3)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual")
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/models/deep_gpcm/rollout").json()["serving"] == "2"  # (both new at start: the newest)
        assert http.put("/v1/models/deep_gpcm/rollout", json={"candidate": "1", "mode": "shadow",
                                                              "fraction": 1.0}).status_code == 200
        for learner, events in history.items():
            for part in (events[:2], events[2:]):
                reply = http.post("/v1/kt/deep_gpcm/events", json={"student_id": learner, "events": part})
                assert reply.json()["version"] == "2"  # the shadow never answers
        deadline = time.monotonic() + 10
        while True:
            quality = {q["version"]: q for q in http.get("/v1/models/deep_gpcm/quality").json()["versions"]}
            if quality["1"]["scored"] == 48 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert (quality["2"]["role"], quality["2"]["scored"]) == ("serving", 48)
        assert (quality["1"]["role"], quality["1"]["scored"]) == ("shadow", 48)
        assert quality["1"]["log_loss"] != quality["2"]["log_loss"]
        for learner, events in history.items():
            shadowed = http.post("/v1/kt/deep_gpcm@1/predict", json={"student_id": learner, "question_ids": ["3"]})
            assert shadowed.json()["rebuilt_from_events"] == 0  # its state followed the log
            replay = http.post("/v1/kt/deep_gpcm@1/batch", json={"students": [
                {"student_id": "x", "events": events, "predict_question_ids": ["3"]}]}).json()
            np.testing.assert_allclose(shadowed.json()["predictions"][0]["probabilities"],
                                       replay["students"][0]["predictions"][0]["probabilities"], atol=1e-5)
        assert 'nextstep_shadow_total{model="deep_gpcm",outcome="done"} 16.0' in http.get("/metrics").text


def test_sessions_take_a_shadow_then_a_canary(tmp_path, redis_url, serve):
    """The same rollouts for next-item sessions: a 100% shadow ranks every click after a session's first for both
    versions (the same clicks), answering with version 1 only; then a 50% canary answers each session by its hash."""
    add_version(tmp_path, "gru4rec", "1", 2026)
    add_version(tmp_path, "gru4rec", "2", 2027, nudge=0.3)
    items = [str(i) for i in json.loads((DEMO / "gru4rec" / "demo" / "vocab_items.json").read_text())["ids"][:12]]
    sessions = {f"s{i}": [{"item_id": items[(3 * i + t) % 12]} for t in range(4)] for i in range(10)}
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual")
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.put("/v1/models/gru4rec/rollout", json={"candidate": "1", "mode": "shadow", "fraction": 1.0}) \
            .status_code == 200
        for session, clicks in sessions.items():
            for click in clicks:
                reply = http.post("/v1/sessions/gru4rec/events", json={"session_id": session, "events": [click]})
                assert reply.json()["version"] == "2"
        deadline = time.monotonic() + 10
        while True:
            quality = {q["version"]: q for q in http.get("/v1/models/gru4rec/quality").json()["versions"]}
            if quality["1"]["scored"] == 30 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [(quality[v]["role"], quality[v]["scored"]) for v in ("1", "2")] == [("shadow", 30), ("serving", 30)]
        assert http.put("/v1/models/gru4rec/rollout", json={"candidate": "1", "fraction": 0.5}).status_code == 200
        for session in sessions:
            got = http.post("/v1/sessions/gru4rec/recommend", json={"session_id": session, "k": 3}).json()
            assert got["version"] == ("1" if in_fraction("gru4rec", session, 0.5) else "2")
            assert got["events_total"] == 4


def test_flashcard_users_take_a_canary_and_shadows_are_refused(tmp_path, redis_url, serve):
    """Flashcard models: a canary answers each user by their hash; the versions share the users' stored reviews, so
    a user moving between versions keeps every review; a shadow is refused (its versions keep no state of their
    own); live quality scores the candidate's reviews under its role."""
    add_version(tmp_path, "time_aware", "1", 2026)
    add_version(tmp_path, "time_aware", "2", 2027)
    users = [f"user-{i}" for i in range(12)]
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual")
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/models/time_aware/rollout").json()["serving"] == "2"
        shadow = http.put("/v1/models/time_aware/rollout", json={"candidate": "1", "mode": "shadow", "fraction": 1})
        assert shadow.status_code == 422 and shadow.json()["field"] == "mode"
        assert http.put("/v1/models/time_aware/rollout", json={"candidate": "1", "fraction": 0.5}).status_code == 200
        for user in users:
            reviews = [{"card_id": f"c{k}", "deck_id": "d", "time": 1.77e9 + 86400 * (3 * k + j), "rating": 3}
                       for j in range(2) for k in range(2)]
            reviews.sort(key=lambda r: r["time"])
            reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": user, "reviews": reviews}).json()
            assert reply["version"] == ("1" if in_fraction("time_aware", user, 0.5) else "2")
        assert http.post("/v1/models/time_aware/rollout/promote").status_code == 200
        assert {http.get(f"/v1/srs/time_aware/users/{u}").json()["reviews_total"] for u in users} == {4}
        quality = {q["version"]: q["role"] for q in http.get("/v1/models/time_aware/quality").json()["versions"]}
        assert quality == {"1": "serving", "2": "serving"}
