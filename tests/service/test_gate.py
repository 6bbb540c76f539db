"""The gate (issue 60, part 1): a gated shadow (or canary) scores both versions on the same events, keeps an
anytime-valid confidence sequence of their mean loss difference in Redis, and promotes or aborts the candidate
itself; every replica sees the one decision. The arithmetic on a small case by hand, its error rate when looked at
after every event, and the whole loop through real HTTP, real ONNX Runtime and a real Redis."""

import asyncio
import json
import math
import shutil
import time

import httpx
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from nextstep.service.gate import Evidence, GateConfig, confidence_sequence, decide, learner_spread, log_losses
from nextstep.service.settings import Settings
from tests.service.test_state import _wait_for
from tests.service.test_upgrades import add_version, learner_events


def test_the_confidence_sequence_of_a_small_case_by_hand():
    d = np.array([0.5, -0.25, 1.0, 0.25])  # n 4, mean 0.375, variance 0.203125 (population): spread 0.8125
    ev = confidence_sequence(len(d), d.sum(), 4 * 0.203125, alpha=0.05, optimized_at=10)
    r2 = (-2 * math.log(0.05) + math.log(1 - 2 * math.log(0.05))) / 10  # (5.99146 + 1.94469) / 10 = 0.793615
    inner = 4 * 0.203125 * r2 + 1
    radius = math.sqrt(2 * inner / (16 * r2) * math.log(math.sqrt(inner) / 0.05))
    assert ev.n == 4 and ev.mean == pytest.approx(0.375)
    assert ev.interval == pytest.approx((0.375 - radius, 0.375 + radius), abs=1e-12)
    # by hand: inner 1.644812, sqrt(2 * 1.644812 / (16 * 0.793615) * ln(1.282502 / 0.05)) = sqrt(0.259069 * 3.24456)
    assert radius == pytest.approx(0.91682, abs=1e-4)
    # the same four as two learners, [0.5, -0.25] (S 0.25) and [1.0, 0.25] (S 1.25): (0.25 - 0.75)^2 + (1.25 - 0.75)^2
    assert learner_spread(0.375, 0.25 ** 2 + 1.25 ** 2, 2 * 0.25 + 2 * 1.25, 2 ** 2 + 2 ** 2) == pytest.approx(0.5)
    # one event a learner: the events' own spread
    assert learner_spread(0.375, (d ** 2).sum(), d.sum(), 4) == pytest.approx(4 * 0.203125)
    config = GateConfig(min_events=3)
    assert decide(Evidence(200, -0.2, (-0.3, -0.1), 40), config) == "promote"
    assert decide(Evidence(200, -0.2, (-0.3, -0.1), 40), GateConfig(min_gain=0.15)) == "continue"  # gain not sure
    assert decide(Evidence(200, 0.2, (0.1, 0.3), 40), config) == "abort"
    assert decide(Evidence(200, 0.0, (-0.1, 0.1), 40), config) == "continue"
    assert decide(Evidence(2, -0.2, (-0.3, -0.1), 40), config) == "continue"  # (before min_events)
    assert decide(Evidence(200, -0.2, (-0.3, -0.1), 29), config) == "continue"  # (before min_learners)
    assert log_losses(np.array([[0.25, 0.75], [1.0, 0.0]]), np.array([1, 1])) == pytest.approx(
        [-math.log(0.75), -math.log(1e-7)])


@pytest.mark.parametrize("store", ["in-process", "redis"])
def test_evidence_added_in_pieces_by_two_replicas_sums_to_the_learners_own(store, redis_url):
    """Each addition's change to the learners' sums is exact in the store's order, so pieces of one learner's
    differences added by two Gate objects (two replicas) give the sums of the learners' totals."""
    from nextstep.service.gate import Gate, evidence_of
    from nextstep.service.redis_clients import connect

    async def run() -> dict:
        client = connect(redis_url, {}) if store == "redis" else None
        a, b = Gate(client), Gate(client) if client is not None else None
        b = b or a  # (in-process: one process holds the evidence)
        for gate, entity, part in ((a, "x", [0.5]), (b, "y", [1.0, 0.25]), (b, "x", [-0.25]), (a, "z", [0.0])):
            fields = await gate.add("k", entity, np.array(part))
        if client is not None:
            await client.close()
        return fields

    fields = asyncio.run(run())
    totals, counts = np.array([0.25, 1.25, 0.0]), np.array([2, 2, 1])
    assert float(fields["n"]) == 5 and float(fields["sum"]) == pytest.approx(1.5)
    assert float(fields["ss"]) == pytest.approx((totals ** 2).sum())
    assert float(fields["ns"]) == pytest.approx((counts * totals).sum())
    assert float(fields["nn"]) == pytest.approx((counts ** 2).sum())
    ev = evidence_of(fields, 0.05)
    assert ev.mean == pytest.approx(0.3)


def _false_decisions(d: np.ndarray, sizes: int, learners_spread: bool, alpha: float = 0.05) -> float:
    """The share of replays (rows of d, learners of `sizes` events one after another) whose sequence excludes 0
    at some event from the 100th and the 30th learner (the gate's defaults)."""
    replays, t = d.shape
    n = np.arange(1, t + 1)
    s = d.cumsum(1)
    mean = s / n
    if learners_spread:
        blocks = d.reshape(replays, -1, sizes)
        within = blocks.cumsum(2).reshape(replays, t)  # the current learner's sum so far
        k = np.arange(t) % sizes + 1.0
        totals = blocks.sum(2)
        done_ss = np.concatenate([np.zeros((replays, 1)), (totals ** 2).cumsum(1)[:, :-1]], 1).repeat(sizes, 1)
        done_s = np.concatenate([np.zeros((replays, 1)), totals.cumsum(1)[:, :-1]], 1).repeat(sizes, 1)
        done_n = (np.arange(t) // sizes) * sizes
        spread = learner_spread(mean, done_ss + within ** 2, sizes * done_s + k * within,
                                done_n * sizes + k ** 2)
    else:
        spread = n * np.maximum((d ** 2).cumsum(1) / n - mean ** 2, 0)
    r2 = (-2 * math.log(alpha) + math.log(1 - 2 * math.log(alpha))) / 1000
    inner = np.maximum(spread, 0) * r2 + 1
    radius = np.sqrt(2 * inner / (n ** 2 * r2) * np.log(np.sqrt(inner) / alpha))
    return float((np.abs(mean) > radius)[:, max(99, 30 * sizes - 1):].any(1).mean())


def test_looked_at_after_every_event_it_keeps_its_error_rate():
    """No true difference, read after every event from the 100th, 400 replays of 3,000 events. Independent,
    heavy-tailed differences: the sequence decides in at most alpha of them (with the slack of 400 replays), a
    fixed-sample 95% interval read the same way far more often. Differences that come in learners of 20 correlated
    events (each learner's own offset, its sign at random): the sequence counting learners keeps alpha from its 30th
    learner on, one counting events as if independent does not (what real learners showed,
    bench/gate_error_rates.py)."""
    rng = np.random.default_rng(0)
    d = rng.standard_t(5, size=(400, 3000))
    n = np.arange(1, 3001)
    mean, var = d.cumsum(1) / n, np.maximum((d ** 2).cumsum(1) / n - (d.cumsum(1) / n) ** 2, 0)
    assert _false_decisions(d, 1, learners_spread=False) <= 0.07
    assert _false_decisions(d, 1, learners_spread=True) <= 0.07  # (one event a learner: the same sequence)
    assert (np.abs(mean) > 1.96 * np.sqrt(var / n))[:, 99:].any(1).mean() > 0.15
    offsets = rng.normal(0, 0.6, size=(400, 150, 1)) * rng.choice([-1, 1], size=(400, 150, 1))
    clustered = (offsets + rng.standard_t(5, size=(400, 150, 20))).reshape(400, 3000)
    assert _false_decisions(clustered, 20, learners_spread=True) <= 0.07
    assert _false_decisions(clustered, 20, learners_spread=False) > 0.15


def flattened(root, version: str, year: int) -> None:
    """deep_gpcm/<version>: the demo model with every question's P(k | theta) on the ability grid set to 1/4 (as a
    discrimination of 0 gives), so that it predicts every response with probability 1/4: the best forecast of learners
    who answer uniformly at random, as `learner_events`' do, where the demo model, confident, is worse on nearly every
    event. (The export looks the item side up in tables, BayesGPCM.for_serving: `model.log_lik`, log P(k | theta_g).)"""
    add_version(root, "deep_gpcm", version, year)
    for graph in ("predict", "step_predict"):
        path = root / "deep_gpcm" / version / f"{graph}.onnx"
        model = onnx.load(path)
        (table,) = [t for t in model.graph.initializer if t.name == "model.log_lik"]
        table.CopyFrom(numpy_helper.from_array(np.full(list(table.dims), math.log(0.25), dtype=np.float32), table.name))
        onnx.save(model, path)


def _put(http, candidate: str, **gate) -> dict:
    reply = http.put("/v1/models/deep_gpcm/rollout", json={"candidate": candidate, "mode": "shadow",
                                                           "fraction": 1.0, "gate": gate})
    assert reply.status_code == 200, reply.text
    return reply.json()


def _drive(replicas: list[httpx.Client], learners: dict[str, list[dict]], until, timeout: float = 30.0) -> dict:
    """Each learner's events in one request, the learners alternately through the replicas, until `until(rollout)`
    holds."""
    deadline = time.monotonic() + timeout
    for i, (learner, events) in enumerate(learners.items()):
        reply = replicas[i % len(replicas)].post("/v1/kt/deep_gpcm/events", json={"student_id": learner,
                                                                                  "events": events})
        assert reply.status_code == 200, reply.text
    while time.monotonic() < deadline:
        rollout = replicas[0].get("/v1/models/deep_gpcm/rollout").json()
        if until(rollout):
            return rollout
        time.sleep(0.1)
    raise AssertionError(f"the gate did not decide: {rollout}")


@pytest.mark.parametrize("better", [False, True], ids=["worse-aborted", "better-promoted"])
def test_a_gated_shadow_decides_by_itself_and_every_replica_sees_the_one_decision(tmp_path, redis_url, serve, better):
    """Version "good" predicts 1/4 for every response (`flattened`), the best forecast of these learners, who answer
    at random; "bad" is the demo model as trained, worse on them. As the candidate, "bad" is aborted; as the serving
    version, the candidate "good" is promoted; by the service, on the evidence of both replicas, once."""
    serving, candidate = ("bad", "good") if better else ("good", "bad")
    for version, year in ((serving, 2027), (candidate, 2026)):
        if version == "good":
            flattened(tmp_path, version, year)
        else:
            add_version(tmp_path, "deep_gpcm", version, year)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    learners = learner_events(60, 8, seed=5)
    with serve(settings) as a, serve(settings) as b, httpx.Client(base_url=a, timeout=30) as http_a, \
            httpx.Client(base_url=b, timeout=30) as http_b:
        assert http_a.get("/v1/models/deep_gpcm/rollout").json()["serving"] == serving
        put = _put(http_a, candidate, min_events=30, min_learners=10)
        assert put["gate"]["decision"] == "continue" and put["gate"]["events"] == 0
        rollout = _drive([http_a, http_b], learners, lambda r: r["candidate"] is None)
        (decision,) = rollout["decisions"]  # one decision, though both replicas added evidence
        assert decision["decision"] == ("promote" if better else "abort") and decision["applied"]
        assert decision["candidate"] == candidate and decision["events"] >= 30
        low, high = decision["interval"]
        assert (high < 0) if better else (low > 0)
        winner = candidate if better else serving
        for http in (http_a, http_b):  # each replica follows the fleet's rollout every 0.2 s (longer on a busy machine)
            _wait_for(lambda: http.get("/v1/models/deep_gpcm/rollout").json()["candidate"] is None,  # noqa: B023
                      "the replica to follow the decided rollout")
            seen = http.get("/v1/models/deep_gpcm/rollout").json()
            assert seen["serving"] == winner and seen["candidate"] is None and seen["decisions"] == [decision]
        answered = http_b.post("/v1/kt/deep_gpcm/predict", json={"student_id": "learner-0", "question_ids": ["3"]})
        assert answered.json()["version"] == winner
        metrics = http_a.get("/metrics").text + http_b.get("/metrics").text
        assert 'nextstep_gate{model="deep_gpcm",stat="events"}' in metrics


def test_an_equal_candidate_is_neither_promoted_nor_aborted(tmp_path, redis_url, serve):
    """The same model as version 2: every paired difference is 0 (to float32 rounding), the interval holds 0."""
    add_version(tmp_path, "deep_gpcm", "1", 2027)
    add_version(tmp_path, "deep_gpcm", "2", 2026)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        _put(http, "2", min_events=10, min_learners=5)
        rollout = _drive([http], learner_events(20, 8, seed=6), lambda r: r["gate"]["events"] == 160)
        gate = rollout["gate"]
        assert gate["decision"] == "continue" and abs(gate["mean_difference"]) < 1e-6  # (float32 noise)
        assert gate["interval"][0] < 0 < gate["interval"][1] and rollout["candidate"] == "2"
        assert "decisions" not in rollout or rollout["decisions"] == []


def test_a_gated_canary_ramps_up_at_each_promotion_and_then_serves_everyone(tmp_path, redis_url, serve):
    """A canary of the better version ("good") at half the learners, ramp [0.5, 1.0]: the serving version follows
    the canary's learners, so every event is paired; the first promote moves it to every learner, gated afresh;
    the second makes it the serving version."""
    flattened(tmp_path, "good", 2026)
    add_version(tmp_path, "deep_gpcm", "bad", 2027)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        reply = http.put("/v1/models/deep_gpcm/rollout", json={"candidate": "good", "mode": "canary", "fraction": 0.5,
                                                               "ramp": [0.5, 1.0], "gate": {"min_events": 30,
                                                                                               "min_learners": 10}})
        assert reply.status_code == 200, reply.text
        assert reply.json()["ramp"] == [0.5, 1.0]
        stepped = _drive([http], learner_events(60, 8, seed=7), lambda r: r["fraction"] == 1.0)
        (first,) = stepped["decisions"]
        assert (first["decision"], first["mode"], first["fraction"]) == ("promote", "canary", 0.5)
        assert stepped["candidate"] == "good" and stepped["gate"]["events"] < 30  # new evidence at the new step
        done = _drive([http], {f"more-{k}": v for k, v in learner_events(40, 8, seed=8).items()},
                      lambda r: r["candidate"] is None)
        assert done["serving"] == "good" and [d["fraction"] for d in done["decisions"]] == [1.0, 0.5]
        assert all(d["decision"] == "promote" and d["interval"][1] < 0 for d in done["decisions"])


def test_a_gated_session_shadow_aborts_a_candidate_that_ranks_the_next_click_worse(tmp_path, redis_url, serve,
                                                                                   rec_artifacts):
    """Sessions: GRU4Rec trained on sessions with a successor signal serves; the popularity model of the same data is
    the shadow. Both rank each click from their states before it (the loss: 1 - 1/rank); popularity ranks the next
    click worse, and the gate aborts it by itself."""
    for name, version, year in (("gru4rec", "gru", 2027), ("popularity", "pop", 2026)):
        out = tmp_path / "gru4rec" / version
        shutil.copytree(rec_artifacts / name / "1", out)
        manifest = json.loads((out / "manifest.json").read_text())
        (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                       "created": f"{year}-01-01T00:00:00Z"}))
    from nextstep.training.next_item.sessions import zipf_sessions

    data = zipf_sessions(200, 60, (4, 9), follow=0.7, seed=1)
    sessions = [[str(item) for item in data.session(i)] for i in range(len(data))]
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        put = http.put("/v1/models/gru4rec/rollout", json={"candidate": "pop", "mode": "shadow", "fraction": 1.0,
                                                           "gate": {"min_events": 30, "min_learners": 10}})
        assert put.status_code == 200, put.text
        for k, items in enumerate(sessions):
            reply = http.post("/v1/sessions/gru4rec/events", json={"session_id": f"s{k}", "events": [
                {"item_id": item} for item in items]})
            assert reply.status_code == 200, reply.text
        deadline = time.monotonic() + 30
        while (rollout := http.get("/v1/models/gru4rec/rollout").json())["candidate"] is not None:
            assert time.monotonic() < deadline, rollout
            time.sleep(0.1)
        (decision,) = rollout["decisions"]
        assert decision["decision"] == "abort" and decision["interval"][0] > 0 and rollout["serving"] == "gru"


def forgetful(root, version: str, year: int, size: int | None = None) -> None:
    """time_aware/<version>: the demo flashcard model answering P(recall) 0.05 for every review (its network's, its
    FSRS-6 defaults' and their mixture's), far worse than the demo's on users who recall three reviews in four; with
    `size`, reading windows of that many rows (another layout: it keeps its own states of the users)."""
    from onnx import helper

    add_version(root, "time_aware", version, year)
    if size is not None:
        path = root / "time_aware" / version / "manifest.json"
        manifest = json.loads(path.read_text())
        path.write_text(json.dumps({**manifest, "window": {**manifest["window"], "size": size}}))
    for graph in ("predict", "predict_memory"):
        path = root / "time_aware" / version / f"{graph}.onnx"
        model = onnx.load(path)
        low = numpy_helper.from_array(np.array(0.05, dtype=np.float32), "forgetful_recall")
        zero = numpy_helper.from_array(np.array(0.0, dtype=np.float32), "forgetful_zero")
        model.graph.initializer.extend([low, zero])
        for name in ("recall", "network_recall", "default_recall"):
            for node in model.graph.node:
                node.output[:] = [f"{name}_model" if o == name else o for o in node.output]
            model.graph.node.extend([helper.make_node("Mul", [f"{name}_model", "forgetful_zero"], [f"{name}_zero"]),
                                     helper.make_node("Add", [f"{name}_zero", "forgetful_recall"], [name])])
        onnx.checker.check_model(model)
        onnx.save(model, path)


@pytest.mark.parametrize("layout", ["same", "other"])
@pytest.mark.parametrize("mode", ["shadow", "canary"])
def test_a_gated_flashcard_rollout_is_decided_on_each_review_scored_by_both(tmp_path, redis_url, serve, mode, layout):
    """Flashcards: each review live quality scores is paired, the follower's P(recall) of it (the candidate's under a
    shadow; under a gated canary, the serving version's, following the canary's users) against the answering
    version's; of the same window layout from the same windows, of another from its own state of the user, which
    takes the reviews as they come. A shadow that forecasts forgetting for users who recall three reviews in four is
    aborted; the demo model as a canary over that one is promoted."""
    from tests.service.srs.test_srs_upgrades import reviews_of

    serving, candidate = ("good", "bad") if mode == "shadow" else ("bad", "good")
    add_version(tmp_path, "time_aware", "good", 2027 if serving == "good" else 2026)
    forgetful(tmp_path, "bad", 2027 if serving == "bad" else 2026, size=16 if layout == "other" else None)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert http.get("/v1/models/time_aware/rollout").json()["serving"] == serving
        put = http.put("/v1/models/time_aware/rollout", json={"candidate": candidate, "mode": mode, "fraction": 0.5
                                                              if mode == "canary" else 1.0,
                                                              "gate": {"min_events": 30, "min_learners": 8}})
        assert put.status_code == 200, put.text
        deadline = time.monotonic() + 60
        for user in range(40):
            reviews = reviews_of(user, 30, 6)
            for part in (reviews[:12], reviews[12:]):  # (a follower's first turn of a user, then a later one)
                reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": f"u{user}", "reviews": part})
                assert reply.status_code == 200, reply.text
        while (rollout := http.get("/v1/models/time_aware/rollout").json())["candidate"] is not None:
            assert time.monotonic() < deadline, rollout
            time.sleep(0.1)
        (decision,) = rollout["decisions"]
        want = "abort" if mode == "shadow" else "promote"
        assert decision["decision"] == want and decision["mode"] == mode and rollout["serving"] == "good"
        assert decision["learners"] >= 8 and decision["events"] >= 30
        assert decision["interval"][0] > 0 if want == "abort" else decision["interval"][1] < 0


def test_a_ramp_needs_a_gated_canary_rising_from_its_fraction(tmp_path, redis_url, serve):
    add_version(tmp_path, "deep_gpcm", "1", 2027)
    add_version(tmp_path, "deep_gpcm", "2", 2026)
    settings = Settings(artifacts_dir=tmp_path, redis_url=redis_url, new_versions="manual", reload_refresh_seconds=0.2)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        for body in ({"candidate": "2", "mode": "shadow", "fraction": 0.5, "ramp": [0.5, 1.0], "gate": {}},
                     {"candidate": "2", "mode": "canary", "fraction": 0.5, "ramp": [0.5, 1.0]},
                     {"candidate": "2", "mode": "canary", "fraction": 0.2, "ramp": [0.5, 1.0], "gate": {}},
                     {"candidate": "2", "mode": "canary", "fraction": 0.5, "ramp": [0.5, 0.4], "gate": {}}):
            reply = http.put("/v1/models/deep_gpcm/rollout", json=body)
            assert reply.status_code == 422 and reply.json()["field"] == "ramp", (body, reply.text)
