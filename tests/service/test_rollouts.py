"""Rollouts (issue 35, parts 2 and 3): with NEXTSTEP_NEW_VERSIONS=manual a new version is loaded but serves no one
until a rollout names it; a canary puts it on a stable, hash-chosen fraction of learners, the same on two replicas
sharing one Redis; promote and abort; no learner loses history. Real HTTP, real ONNX Runtime, a real Redis."""

import asyncio
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from nextstep.service.redis_store import RedisStore
from nextstep.service.registry import ModelRegistry
from nextstep.service.rollouts import Rollout, Rollouts, in_fraction
from nextstep.service.runtime import Engines
from nextstep.service.settings import Settings
from nextstep.service.srs.service import SpacedRepetition
from nextstep.service.srs.stored import Review, schema_hash
from tests.service.srs.test_srs_upgrades import CARD_SIZE, DAY, answers, close, reviews_of, same_record, summary
from tests.service.srs.test_srs_upgrades import add_version as srs_version
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
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
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
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
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


def test_flashcard_users_take_a_canary(tmp_path, redis_url, serve):
    """Flashcard models: a canary answers each user by their hash; the versions share the users' stored reviews, so
    a user moving between versions keeps every review; live quality scores the candidate's reviews under its
    role."""
    add_version(tmp_path, "time_aware", "1", 2026)
    add_version(tmp_path, "time_aware", "2", 2027)
    users = [f"user-{i}" for i in range(12)]
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/models/time_aware/rollout").json()["serving"] == "2"
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
        assert quality == {"1": "serving", "2": "inactive"}  # (the version promoted away serves no one)


# -- flashcard shadows --------------------------------------------------------------------------------------------
def add_flashcards(root: Path, version: str, year: int, nudge: float = 0.0, size: int | None = None) -> None:
    """root/time_aware/<version>: the bundled demo model, created in `year`; `nudge` added to its drift gain in the
    predict graphs, `predict` and its twin `predict_memory` (a learned weight: its P(recall) differs; the schedule
    graph is the demo's), `size` its window (another layout; the card window, which the graph fixes, is kept). Its
    users' evidence pins the network's weight at 1, as test_srs_upgrades.add_version's does: states followed through
    other windows or versions are held to be the same, and the evidence that their network's answers add up is
    not."""
    if size is not None:
        srs_version(root, version, year, size)
    else:
        add_version(root, "time_aware", version, year)
        path = root / "time_aware" / version / "manifest.json"
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps({**manifest, "evidence": {**manifest["evidence"], "prior": 50.0,
                                                             "halflife_scored_reviews": None}}))
    for name in ("predict", "predict_memory") if nudge else ():
        path = root / "time_aware" / version / f"{name}.onnx"
        graph = onnx.load(path)
        (gain,) = [t for t in graph.graph.initializer if t.name == "model.drift_gain"]
        # only the drift's own product, gain * m / (w + prior): the exporter shares the gain's initializer with every
        # constant of its value (4.0 is also FSRS-6's Easy rating in `predict`), and those stay
        made = {out: node.op_type for node in graph.graph.node for out in node.output}
        (mul,) = [node for node in graph.graph.node if node.op_type == "Mul" and gain.name in node.input
                  and any(made.get(i) == "Div" for i in node.input)]
        graph.graph.initializer.append(numpy_helper.from_array(numpy_helper.to_array(gain) + np.float32(nudge),
                                                               "nudged_drift_gain"))
        mul.input[list(mul.input).index(gain.name)] = "nudged_drift_gain"
        onnx.save(graph, path)


def scored(reviews: list[dict], day_start_hour: float = 4.0) -> np.ndarray:
    """Which reviews the protocol scores: those of a card last reviewed on an earlier scheduler day."""
    last: dict[str, float] = {}
    out = []
    for r in reviews:
        day = (r["time"] - day_start_hour * 3600) // 86400
        out.append(r["card_id"] in last and last[r["card_id"]] < day)
        last[r["card_id"]] = day
    return np.array(out)


def shadow_quality(http: httpx.Client, shadow: int, timeout: float = 20.0) -> dict[str, dict]:
    """/quality's versions once the shadow has scored `shadow` reviews (its turns run after the answers)."""
    deadline = time.monotonic() + timeout
    while True:
        quality = {q["version"]: q for q in http.get("/v1/models/time_aware/quality").json()["versions"]}
        if any(q["role"] == "shadow" and q["scored"] >= shadow for q in quality.values()) \
                or time.monotonic() > deadline:
            return quality
        time.sleep(0.05)


def shadow_turns(http: httpx.Client, turns: int, timeout: float = 20.0) -> int:
    """nextstep_shadow_total{outcome="done"} once it reaches `turns` (or the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        done = [line for line in http.get("/metrics").text.splitlines()
                if line.startswith('nextstep_shadow_total{model="time_aware",outcome="done"}')]
        count = int(float(done[0].split()[-1])) if done else 0
        if count >= turns or time.monotonic() > deadline:
            return count
        time.sleep(0.05)


def test_a_flashcard_shadow_scores_the_same_reviews_as_the_serving_version(tmp_path, redis_url, serve):
    """A 100% shadow of version 2 (another drift gain, one window layout): every answer is version 1's;
    /quality scores both versions on the same reviews, and the shadow's log loss is the mean -ln P(the outcome) over
    them, each P the one version 2, pinned, predicted just before the review was recorded (1e-6)."""
    add_flashcards(tmp_path, "1", 2026)
    users = {f"user-{u}": reviews_of(40 + u, 16, 5, tag=str(u)) for u in range(3)}
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        add_flashcards(tmp_path, "2", 2027, nudge=0.5)
        assert http.post("/v1/models/reload").status_code == 200
        put = http.put("/v1/models/time_aware/rollout", json={"candidate": "2", "mode": "shadow", "fraction": 1.0})
        assert put.status_code == 200, put.text
        losses, mask = [], []
        for user, reviews in users.items():
            for review in reviews:
                p = http.post("/v1/srs/time_aware@2/predict", json={
                    "user_id": user, "card_id": review["card_id"], "deck_id": review["deck_id"],
                    "time": review["time"]}).json()["p_recall"]
                reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": user, "reviews": [review]})
                assert reply.status_code == 200 and reply.json()["version"] == "1", reply.text  # never the shadow
                losses.append(-np.log(p if review["rating"] > 1 else 1 - p))
            mask.extend(scored(reviews))
        mask = np.array(mask)
        quality = shadow_quality(http, mask.sum())
        assert 0 < mask.sum() < len(mask)
        assert [(quality[v]["role"], quality[v]["scored"]) for v in ("1", "2")] == \
            [("serving", mask.sum()), ("shadow", mask.sum())]
        assert quality["2"]["log_loss"] == pytest.approx(np.mean(np.array(losses)[mask]), abs=1e-6)
        assert abs(quality["1"]["log_loss"] - quality["2"]["log_loss"]) > 1e-3  # (another model)
        assert shadow_turns(http, len(mask)) == len(mask)  # one turn per write


def test_a_flashcard_shadow_covers_its_fraction_and_stops_at_an_abort(tmp_path, redis_url, serve):
    """A 50% shadow scores the reviews of the users whose hash falls in the fraction, and only theirs; an abort
    stops it: the reviews recorded afterwards are scored for the serving version alone."""
    add_flashcards(tmp_path, "1", 2026)
    add_flashcards(tmp_path, "2", 2027, nudge=0.5)
    users = {f"user-{u}": reviews_of(60 + u, 12, 4, tag=str(u)) for u in range(12)}
    chosen = {u for u in users if in_fraction("time_aware", u, 0.5)}
    assert 0 < len(chosen) < len(users)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.put("/v1/models/time_aware/rollout", json={"candidate": "1", "mode": "shadow",
                                                              "fraction": 0.5}).status_code == 200
        for user, reviews in users.items():
            assert http.post("/v1/srs/time_aware/reviews", json={"user_id": user, "reviews": reviews[:8]}) \
                .json()["version"] == "2"
        every = sum(int(scored(r)[:8].sum()) for r in users.values())
        theirs = sum(int(scored(users[u])[:8].sum()) for u in chosen)
        quality = shadow_quality(http, theirs)
        assert [(quality[v]["role"], quality[v]["scored"]) for v in ("1", "2")] == \
            [("shadow", theirs), ("serving", every)]
        assert shadow_turns(http, len(chosen)) == len(chosen)

        assert http.delete("/v1/models/time_aware/rollout").json()["candidate"] is None
        for user, reviews in users.items():
            assert http.post("/v1/srs/time_aware/reviews", json={"user_id": user, "reviews": reviews[8:]}) \
                .status_code == 200
        time.sleep(0.5)
        quality = {q["version"]: q for q in http.get("/v1/models/time_aware/quality").json()["versions"]}
        assert quality["1"]["scored"] == theirs  # (its role now: serving no one)
        assert quality["2"]["scored"] == sum(int(scored(r).sum()) for r in users.values())
        assert shadow_turns(http, len(chosen), timeout=0) == len(chosen)


def same_stored(url: str, a: str, b: str) -> None:
    """The same stored state at keys a and b: header, recent block and every card's field (test_srs_upgrades), but
    for the evidence (carried over when a state is rebuilt from another layout's)."""
    async def read():
        store = RedisStore(url, ttl_seconds=None)
        try:
            return [await store.read_all(key) for key in (a, b)]
        finally:
            await store.close()

    same_record(*asyncio.run(read()), evidence=False)


@pytest.mark.parametrize("size", [16, 64])
def test_a_flashcard_shadow_of_another_layout_keeps_its_own_state_and_serves_it_once_promoted(
        size, tmp_path, redis_url, serve):
    """Version 2 reads windows of `size` reviews where version 1 reads 32. In a 100% shadow, version 2's own state of
    each user takes the reviews version 1 records: a user stored before the shadow is rebuilt from the reviews
    version 1 held just before their first shadowed write, and one whose reviews went on while the shadow was stopped
    is rebuilt at their next shadowed write (keeping what it held: wider windows lose nothing). A twin model (the
    demo with version 2's windows, under another name) takes the same requests live: each state is the twin's, and
    the shadow's scores are those of the twin's version 2, which took the requests made while the shadow ran (its
    version 1 took the others; they share the reviews). Then a 50% canary: version 2 answers one user, and its state
    of the other keeps up with the reviews version 1 records; once promoted, version 2 answers both from their
    states, rebuilding nothing."""
    add_flashcards(tmp_path, "1", 2026)
    for version in ("1", "2"):
        shutil.copytree(tmp_path / "time_aware" / "1", tmp_path / "twin" / version)
        manifest = json.loads((tmp_path / "twin" / version / "manifest.json").read_text())
        (tmp_path / "twin" / version / "manifest.json").write_text(json.dumps({
            **manifest, "version": version, "window": {"size": size, "card_size": CARD_SIZE}}))
    layout, twin_schema = (schema_hash(name, size, CARD_SIZE) for name in ("time_aware", "twin"))
    users = {"early": reviews_of(80, 80, 8, tag="e"), "new": reviews_of(81, 60, 8, tag="n")}
    assert in_fraction("time_aware", "early", 0.5) and not in_fraction("time_aware", "new", 0.5)
    before = {"early": 20, "new": 0}  # reviews recorded before the shadow starts
    chunk = {"early": 1, "new": 4}  # reviews a request
    shadow = {"candidate": "2", "mode": "shadow", "fraction": 1.0}
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:

        followed = [0]  # shadow turns done so far

        def record(user: str, lo: int, hi: int, shadowed: bool, version: str = "1") -> int:
            """The user's reviews lo:hi through the version answering them and the twin; the requests made. A
            shadowed request waits for its turn: a turn that finds the user written again since leaves the scoring
            to the rebuild of their next turn (unscored; docs/decisions.md), which a loaded machine would make
            happen here at random."""
            twin = "twin@2" if shadowed else "twin@1"
            for at in range(lo, hi, chunk[user]):
                body = {"user_id": user, "reviews": users[user][at:min(at + chunk[user], hi)]}
                reply = http.post("/v1/srs/time_aware/reviews", json=body)
                assert reply.status_code == 200 and reply.json()["version"] == version, reply.text
                assert http.post(f"/v1/srs/{twin}/reviews", json=body).status_code == 200
                if shadowed:
                    followed[0] += 1
                    assert shadow_turns(http, followed[0]) == followed[0]
            return len(range(lo, hi, chunk[user]))

        record("early", 0, before["early"], False)
        srs_version(tmp_path, "2", 2027, size)
        assert http.post("/v1/models/reload").status_code == 200
        assert http.put("/v1/models/time_aware/rollout", json=shadow).status_code == 200
        turns = 0
        for lo, hi, shadowed in ((0, 20, True), (20, 30, False), (30, 50, True)):
            if not shadowed:  # stopped: the reviews go on without it
                assert http.delete("/v1/models/time_aware/rollout").status_code == 200
            for user in users:
                turns += shadowed * record(user, before[user] + lo, before[user] + hi, shadowed)
            if not shadowed:
                assert http.put("/v1/models/time_aware/rollout", json=shadow).status_code == 200
        assert shadow_turns(http, turns) == turns == 50
        twin = {q["version"]: q for q in http.get("/v1/models/twin/quality").json()["versions"]}["2"]
        quality = shadow_quality(http, twin["scored"])
        assert (quality["2"]["role"], quality["2"]["scored"]) == ("shadow", twin["scored"])
        assert twin["scored"] == sum(int(scored(r)[before[u]:before[u] + 20].sum() + scored(r)[
            before[u] + 30:before[u] + 50].sum()) for u, r in users.items())
        for name in ("log_loss", "brier"):
            assert quality["2"][name] == pytest.approx(twin[name], abs=1e-6)
        assert quality["1"]["scored"] == sum(int(scored(r[:before[u] + 50]).sum()) for u, r in users.items())
        for user in users:
            same_stored(redis_url, f"srs:time_aware:{layout}:{user}", f"srs:twin:{twin_schema}:{user}")

        assert http.put("/v1/models/time_aware/rollout", json={"candidate": "2", "fraction": 0.5}).status_code == 200
        kept_up = record("new", before["new"] + 50, before["new"] + 60, False)
        record("early", before["early"] + 50, before["early"] + 60, False, version="2")
        assert shadow_turns(http, turns + kept_up) == turns + kept_up == 53
        for user in users:
            same_stored(redis_url, f"srs:time_aware:{layout}:{user}", f"srs:twin:{twin_schema}:{user}")
        assert http.post("/v1/models/time_aware/rollout/promote").json()["serving"] == "2"
        for user, reviews in users.items():
            got = summary(http, "time_aware", user)
            assert (got["version"], got["rebuilt_from_events"], got["reviews_total"]) == ("2", 0, len(reviews))
            cards = sorted({r["card_id"] for r in reviews})
            at = reviews[-1]["time"] + DAY
            promoted, live = (answers(http, model, user, cards, at) for model in ("time_aware", "twin@2"))
            close([{k: v for k, v in a.items() if k not in ("model", "version")} for a in promoted],
                  [{k: v for k, v in a.items() if k not in ("model", "version")} for a in live])


def test_an_aborted_flashcard_shadow_leaves_its_states_and_a_migration_brings_them_up_to_date(
        tmp_path, redis_url, serve):
    """After an abort, version 2's states (of another layout) no longer follow: a user who goes on reviewing has a
    state there without those reviews, which version 2 would go on from. A migration to version 2 brings it up to
    date (the user's state there is a part of their history, which went on under version 1): it is then the state of
    a user whose same reviews went to version 2 from the start; a second walk finds nothing to do."""
    add_flashcards(tmp_path, "1", 2026)
    srs_version(tmp_path, "2", 2025, 16)  # (older: version 1 serves)
    layout = schema_hash("time_aware", 16, CARD_SIZE)
    reviews = reviews_of(90, 30, 6, tag="a")
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.put("/v1/models/time_aware/rollout", json={"candidate": "2", "mode": "shadow",
                                                              "fraction": 1.0}).status_code == 200
        for lo in range(0, 30, 5):
            if lo == 15:
                assert http.delete("/v1/models/time_aware/rollout").status_code == 200
                assert shadow_turns(http, 3) == 3
            for user, model in (("u", "time_aware"), ("twin", "time_aware@2")):
                reply = http.post(f"/v1/srs/{model}/reviews", json={"user_id": user, "reviews": reviews[lo:lo + 5]})
                assert reply.status_code == 200, reply.text
        assert summary(http, "time_aware@2", "u")["reviews_total"] == 15  # (stale: what the shadow took)
        walk = http.post("/v1/models/time_aware/migrate", json={"version": "2"}).json()
        assert (walk["done"], walk["entities"], walk["rebuilt"], walk["events"], walk["lagging"]) == (True, 1, 1, 15, 0)
        same_stored(redis_url, f"srs:time_aware:{layout}:u", f"srs:time_aware:{layout}:twin")
        again = http.post("/v1/models/time_aware/migrate", json={"version": "2"}).json()
        assert (again["entities"], again["rebuilt"], again["events"]) == (1, 0, 0)
        assert summary(http, "time_aware@2", "u")["reviews_total"] == 30


def test_a_shadow_turn_still_queued_when_its_candidate_starts_answering_loses_no_review(tmp_path, redis_url):
    """A shadow of another layout becomes a canary (or is promoted) while turns of a user's last writes wait in the
    queue (any replica's): the candidate answers the user's next reviews from its state, which lacks those writes'.
    When the turns come, their reviews go before the ones the candidate took (as they came), which are recorded
    again after them: the state is the one all the reviews recorded through version 2 in order give. The service
    object itself, over a real Redis, its shadow queue followed by hand, so the turns wait for certain."""
    add_flashcards(tmp_path, "1", 2026)
    srs_version(tmp_path, "2", 2025, 16)  # (older: version 1 serves)
    layout = schema_hash("time_aware", 16, CARD_SIZE)
    reviews = [Review(r["card_id"], r["time"], r["rating"], r["deck_id"], r.get("duration"), r.get("state"),
                      r["event_id"]) for r in reviews_of(91, 12, 4, tag="q")]

    async def scenario() -> None:
        store = RedisStore(redis_url, ttl_seconds=None)
        registry = ModelRegistry(tmp_path, new_versions="manual")
        registry.reload()
        srs = SpacedRepetition(registry, store, Engines(8, 0.0))
        srs.rollouts, srs.shadows = Rollouts(None), asyncio.Queue(100)

        async def follow(turns: int) -> None:
            for _ in range(turns):
                name, version, user, turn = srs.shadows.get_nowait()
                assert await srs.follow_log(registry.get(name, version), user, turn)

        try:
            await srs.rollouts.put("time_aware", Rollout("1", "2", "shadow", 1.0))
            for i, r in enumerate(reviews[:6]):
                assert (await srs.add_reviews("time_aware", "u", [r]))["version"] == "1"
                if i < 3:
                    await follow(1)  # (the last three writes' turns wait)
            assert (await store.get(srs.key(registry.get("time_aware@2"), "u"))).events == 3
            await srs.rollouts.put("time_aware", Rollout("1", "2", "canary", 1.0))
            for r in reviews[6:9]:
                assert (await srs.add_reviews("time_aware", "u", [r]))["version"] == "2"
            await follow(3)  # (the three writes' turns version 1 took before the canary)
            await srs.rollouts.put("time_aware", Rollout("2"))  # promoted (the service's rollouts set it serving)
            registry.set_serving({"time_aware": "2"})
            assert (await srs.add_reviews("time_aware", "u", reviews[9:]))["version"] == "2"
            for r in reviews:
                await srs.add_reviews("time_aware@2", "twin", [r])
            assert srs.shadows.empty()
        finally:
            await store.close()

    asyncio.run(scenario())
    same_stored(redis_url, f"srs:time_aware:{layout}:u", f"srs:time_aware:{layout}:twin")


# -- the lifecycle under restarts, withdrawals and a fleet learning of a change (issue 55) --------------------------
def test_manual_versions_keep_the_fleets_choice_across_a_restart(tmp_path, redis_url, serve):
    """With no rollout ever set, the version serving is the fleet's from the first reload: versions 2 and 3 copied in
    and reloaded, a replica restarted serves 1, as the other does, not the newest; a replica that has not read that
    choice yet says it is not ready."""
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual",
                        reload_refresh_seconds=0.2)
    with serve(settings) as a_url, httpx.Client(base_url=a_url, timeout=30) as a:
        with serve(settings) as b_url, httpx.Client(base_url=b_url, timeout=30) as b:
            add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
            add_version(tmp_path, "deep_gpcm", "3", 2028, nudge=-5.0)
            assert a.post("/v1/models/reload").status_code == 200
            time.sleep(0.6)  # (b follows the reload generation)
            assert [h.get("/v1/models/deep_gpcm/rollout").json()["serving"] for h in (a, b)] == ["1", "1"]
        with serve(settings) as b_url, httpx.Client(base_url=b_url, timeout=30) as b:  # b restarted
            assert b.get("/readyz").status_code == 200
            for http in (a, b):
                assert http.get("/v1/models/deep_gpcm/rollout").json()["serving"] == "1"
                assert {http.get(f"/v1/kt/deep_gpcm/students/{e}").json()["version"] for e in LEARNERS} == {"1"}


def test_promote_refuses_a_candidate_that_was_withdrawn(tmp_path, redis_url, serve):
    """A canary of 2, its folder moved away and reloaded: promote is a 422 naming the candidate, and Redis keeps 1
    serving; 2 put back and reloaded goes on as the canary, not as the version serving everyone."""
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
    add_version(tmp_path, "deep_gpcm", "3", 2028)  # (a third version keeps the model alive without 2)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual",
                        reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.put("/v1/models/deep_gpcm/rollout", json={"candidate": "2", "fraction": 0.3}).status_code == 200
        serving = http.get("/v1/models/deep_gpcm/rollout").json()["serving"]
        shutil.move(tmp_path / "deep_gpcm" / "2", tmp_path / "parked")
        assert http.post("/v1/models/reload").json()["withdrawn"] == ["deep_gpcm/2"]
        refused = http.post("/v1/models/deep_gpcm/rollout/promote")
        assert refused.status_code == 422 and refused.json()["field"] == "candidate", refused.text
        assert "not loaded" in refused.json()["detail"]
        stored = Rollout(**json.loads(asyncio.run(_hget(redis_url, "deep_gpcm"))))
        assert (stored.serving, stored.candidate) == (serving, "2")
        shutil.move(tmp_path / "parked", tmp_path / "deep_gpcm" / "2")
        assert http.post("/v1/models/reload").status_code == 200
        rollout = http.get("/v1/models/deep_gpcm/rollout").json()
        assert (rollout["serving"], rollout["candidate"], rollout["mode"]) == (serving, "2", "canary")


async def _hget(url: str, model: str) -> bytes:
    from nextstep.service.redis_clients import connect

    client = connect(url)
    try:
        (value,) = await client.execute("test", (("HGET", "nextstep:{rollouts}", model),))
        return value
    finally:
        await client.close()


def test_a_rollout_takes_effect_on_every_replica_at_one_moment(tmp_path, redis_url, serve):
    """Two replicas read alternately while a canary is put on one of them: no learner is answered by the candidate
    and then by the serving version again (each replica's reader sees 1 until the change's moment, then 2, and no
    answer of 1 was asked for after an answer of 2 had come back from either replica); once the PUT answers, both
    replicas give the candidate to every learner in the fraction. The same for the abort."""
    import threading

    add_version(tmp_path, "deep_gpcm", "1", 2026)
    add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
    canary = [e for e in LEARNERS if in_fraction("deep_gpcm", e, 0.5)][:6]
    # (a busy CI machine: reads of Redis given time, and a change 3 s ahead, so that each replica reads it in time)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual",
                        reload_refresh_seconds=1.5, redis_timeout_seconds=2.0)
    with serve(settings) as a_url, serve(settings) as b_url, httpx.Client(base_url=a_url, timeout=30) as a, \
            httpx.Client(base_url=b_url, timeout=30) as b:
        assert b.put("/v1/models/deep_gpcm/rollout", json={"candidate": "1", "fraction": 0.0}).status_code == 200
        for step, (body, after) in enumerate((({"candidate": "1", "fraction": 0.5}, "1"), (None, "2"))):
            # (replica -> learner -> (asked, answered, version) in the reader's order; the two readers' answers are
            # ordered only by their times: one asked before the moment may come back after the other's reply)
            seen: dict[str, dict[str, list[tuple[float, float, str]]]] = {u: {e: [] for e in canary}
                                                                          for u in (a_url, b_url)}
            done = threading.Event()

            def read(http: httpx.Client, seen: dict[str, list[tuple[float, float, str]]],
                     done: threading.Event) -> None:
                while not done.is_set():
                    for e in canary:
                        asked = time.monotonic()
                        version = http.get(f"/v1/kt/deep_gpcm/students/{e}").json()["version"]
                        seen[e].append((asked, time.monotonic(), version))
                    time.sleep(0.01)  # (readers that leave the replicas' event loops some room)

            readers = [threading.Thread(target=read, args=(httpx.Client(base_url=u), seen[u], done))
                       for u in (a_url, b_url)]
            for t in readers:
                t.start()
            try:
                time.sleep(0.2)
                changed = a.put("/v1/models/deep_gpcm/rollout", json=body) if body else \
                    a.delete("/v1/models/deep_gpcm/rollout")
                assert changed.status_code == 200, changed.text
                assert {h.get(f"/v1/kt/deep_gpcm/students/{e}").json()["version"] for h in (a, b)
                        for e in canary} == {after}
                time.sleep(0.2)
            finally:
                done.set()
                for t in readers:
                    t.join()
            before = "2" if after == "1" else "1"
            for e in canary:
                for u in (a_url, b_url):
                    versions = [v for _, _, v in seen[u][e]]
                    flips = sum(x != y for x, y in zip(versions, versions[1:], strict=False))
                    assert versions[0] == before and versions[-1] == after and flips == 1, (step, u, e, versions)
                answers = [r for u in (a_url, b_url) for r in seen[u][e]]
                last_old_asked = max(asked for asked, _, v in answers if v == before)
                first_new_back = min(back for _, back, v in answers if v == after)
                assert last_old_asked < first_new_back, (step, e, last_old_asked, first_new_back)


def test_the_rollout_routes_refuse_a_pin_and_quality_keeps_phases_apart(tmp_path, redis_url, serve):
    """A pin on a rollout route (in the path, or X-Model-Version) is a 422, never ignored; a candidate's canary row
    of /quality counts only what it earned as a canary (not its shadow phase), and a version that serves no one is
    `inactive`."""
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
    history = learner_events(6, 4, seed=3)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual",
                        reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        body = {"candidate": "1", "mode": "shadow", "fraction": 1.0}
        for reply in (http.put("/v1/models/deep_gpcm@1/rollout", json=body),
                      http.put("/v1/models/deep_gpcm/rollout", json=body, headers={"X-Model-Version": "1"}),
                      http.get("/v1/models/deep_gpcm@2/rollout"), http.post("/v1/models/deep_gpcm@1/rollout/promote"),
                      http.delete("/v1/models/deep_gpcm@1/rollout"), http.get("/v1/models/deep_gpcm@1/quality")):
            assert reply.status_code == 422 and reply.json()["field"] == "model", reply.text
        assert http.get("/v1/models/deep_gpcm/rollout").json()["candidate"] is None
        assert http.put("/v1/models/deep_gpcm/rollout", json=body).status_code == 200
        for learner, events in history.items():
            assert http.post("/v1/kt/deep_gpcm/events", json={"student_id": learner, "events": events[:2]}) \
                .status_code == 200

        def quality() -> dict[str, dict]:
            return {q["version"]: q for q in http.get("/v1/models/deep_gpcm/quality").json()["versions"]}

        deadline = time.monotonic() + 10
        while quality()["1"]["scored"] < 12 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (quality()["1"]["role"], quality()["1"]["scored"]) == ("shadow", 12)
        assert http.put("/v1/models/deep_gpcm/rollout", json={**body, "mode": "canary"}).status_code == 200
        assert [(q["role"], q["scored"]) for q in quality().values()] == [("canary", 0), ("serving", 12)]
        answered = {}
        for learner, events in history.items():
            answered[learner] = http.post("/v1/kt/deep_gpcm/events", json={"student_id": learner,
                                                                           "events": events[2:3]}).json()["version"]
        assert set(answered.values()) == {"1"}
        assert [(q["role"], q["scored"]) for q in quality().values()] == [("canary", 6), ("serving", 12)]
        assert http.post("/v1/models/deep_gpcm/rollout/promote").status_code == 200
        assert [(q["role"], q["scored"]) for q in quality().values()] == [("serving", 0), ("inactive", 12)]
