"""Reloads, version pins and the ids listing over real HTTP: the app under uvicorn, real ONNX graphs of the three
tasks (deep_gpcm, gru4rec, time_aware), state in a real redis-server."""

import json
import shutil
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from nextstep.demo import BUNDLED, MODELS
from nextstep.service.settings import Settings
from tests.service.test_upgrades import add_version

T0 = 1.7e9


@pytest.fixture(scope="module")
def tree(artifact_tree, tmp_path_factory) -> Path:
    """deep_gpcm/1 and /2 (the newer, trained for real: the session's artifact_tree), gru4rec/1 and time_aware/1
    (the bundled demo models, trained and exported for real by `make demo-artifacts`): one model of each task."""
    art = tmp_path_factory.mktemp("reload") / "artifacts"
    for version in ("1", "2"):
        shutil.copytree(artifact_tree / "deep_gpcm" / version, art / "deep_gpcm" / version,
                        ignore=shutil.ignore_patterns("report", "*.pt"))
    for name in ("gru4rec", "time_aware"):
        shutil.copytree(BUNDLED / name / "demo", art / name / "1")
    return art


@pytest.fixture
def root(tree, tmp_path) -> Path:
    """A private copy of the tree that a test may break."""
    shutil.copytree(tree, tmp_path / "artifacts", ignore=shutil.ignore_patterns("*.pt"))
    return tmp_path / "artifacts"


def scrape(http: httpx.Client, name: str) -> dict[str, float]:
    """{labels: value} of one metric family in /metrics."""
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name):].rsplit(" ", 1)
            out[labels] = float(value)
    return out


class Client(threading.Thread):
    """Requests one route as fast as answers come, checking each answer; counts statuses."""

    def __init__(self, url: str, kind: str, n: int, stop: threading.Event):
        super().__init__(daemon=True)
        self.url, self.kind, self.n, self.stop = url, kind, n, stop
        self.codes: Counter[int] = Counter()
        self.failures: list[str] = []
        self.versions: set[str] = set()

    def request(self, http: httpx.Client, i: int) -> httpx.Response:
        entity = f"{self.kind}-{self.n}"
        if self.kind == "kt":
            return http.post("/v1/kt/deep_gpcm/events", json={
                "student_id": entity, "events": [{"question_id": i % 12, "response": i % 4, "event_id": f"e{i}"}],
                "predict_question_ids": [(i + 1) % 12]})
        if self.kind == "sessions":
            return http.post("/v1/sessions/gru4rec/events", json={
                "session_id": entity, "events": [{"item_id": 1 + i % 20, "event_id": f"c{i}"}], "recommend_k": 3,
                "exclude_seen": False})
        return http.post("/v1/srs/time_aware/reviews", json={
            "user_id": entity, "reviews": [{"card_id": f"card-{i % 7}", "time": T0 + 3600 * i, "rating": 1 + i % 4,
                                            "event_id": f"r{i}"}],
            "predict": {"card_id": f"card-{(i + 1) % 7}"}})

    def run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=30) as http:
            i = 0
            while not self.stop.is_set():
                reply = self.request(http, i)
                self.codes[reply.status_code] += 1
                if reply.status_code != 200:
                    self.failures.append(f"{self.kind} {reply.status_code} {reply.text[:300]}")
                    continue
                body = reply.json()
                self.versions.add(body["version"])
                total = body["reviews_total"] if self.kind == "srs" else body["events_total"]
                if total != i + 1:  # the entity's stored state carried on across every reload
                    self.failures.append(f"{self.kind}: request {i} found {total} events stored")
                i += 1


@pytest.mark.slow
def test_reload_refuses_broken_artifacts_under_load_and_what_was_serving_keeps_serving(root, redis_url, serve):
    stop = threading.Event()
    step_predict = (root / "deep_gpcm" / "2" / "step_predict.onnx").read_bytes()
    gru4rec_manifest = (root / "gru4rec" / "1" / "manifest.json").read_text()
    with serve(Settings(artifacts_dir=root, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        clients = [Client(url, kind, n, stop) for kind in ("kt", "sessions", "srs") for n in range(2)]
        for c in clients:
            c.start()
        while min(sum(c.codes.values()) for c in clients) < 5:
            time.sleep(0.05)

        # the newest deep_gpcm (serving) loses a graph, gru4rec's only version its manifest, time_aware its directory
        (root / "deep_gpcm" / "2" / "step_predict.onnx").write_bytes(step_predict[:300])
        (root / "gru4rec" / "1" / "manifest.json").write_text('{"name": "gru4rec", "task": ')
        shutil.move(root / "time_aware", root.parent / "time_aware-away")
        for _ in range(3):
            reply = http.post("/v1/models/reload", timeout=60)
            assert reply.status_code == 409, reply.text
            assert reply.headers["content-type"] == "application/problem+json"
            body = reply.json()
            assert body["type"] == "urn:nextstep:problem:artifact-refused" and body["title"] == "Conflict"
            refused = {(r["model"], r["version"]): r for r in body["refused"]}
            assert sorted(refused) == [("deep_gpcm", "2"), ("gru4rec", "1"), ("time_aware", "1")]
            assert all(r["kept"] for r in refused.values())
            assert "step_predict" in refused["deep_gpcm", "2"]["reason"]
            assert "JSON" in refused["gru4rec", "1"]["reason"]
            assert "directory missing" in refused["time_aware", "1"]["reason"]
            for name in ("deep_gpcm/2", "gru4rec/1", "time_aware/1"):
                assert name in body["detail"]
            assert body["serving"] == {"deep_gpcm": "2", "gru4rec": "1", "time_aware": "1"} and body["withdrawn"] == []
            assert body["models"] == ["deep_gpcm/1", "deep_gpcm/2", "gru4rec/1", "time_aware/1"]
            time.sleep(0.2)

        ready = http.get("/readyz")  # degraded, not unready: every model still serves
        assert ready.status_code == 200 and ready.json()["status"] == "ready", ready.text
        assert sorted((r["model"], r["version"]) for r in ready.json()["refused"]) == sorted(refused)
        assert scrape(http, "nextstep_artifacts_refused") == {
            '{kept="true",model="deep_gpcm",version="2"}': 1.0, '{kept="true",model="gru4rec",version="1"}': 1.0,
            '{kept="true",model="time_aware",version="1"}': 1.0}
        listed = http.get("/v1/models").json()
        assert sorted((r["model"], r["version"]) for r in listed["refused"]) == sorted(refused)
        assert [m["version"] for m in listed["models"] if m["latest"] and m["name"] == "deep_gpcm"] == ["2"]

        # mended: the next reload takes them afresh and says nothing is refused
        (root / "deep_gpcm" / "2" / "step_predict.onnx").write_bytes(step_predict)
        (root / "gru4rec" / "1" / "manifest.json").write_text(gru4rec_manifest)
        shutil.move(root.parent / "time_aware-away", root / "time_aware")
        reply = http.post("/v1/models/reload", timeout=60)
        assert reply.status_code == 200 and reply.json()["refused"] == [] and reply.json()["errors"] == {}, reply.text
        assert http.get("/readyz").json()["refused"] == []
        assert scrape(http, "nextstep_artifacts_refused") == {}
        assert scrape(http, "nextstep_reloads_total") == {'{outcome="refused"}': 3.0, '{outcome="ok"}': 1.0}
        n = sum(sum(c.codes.values()) for c in clients)
        while sum(sum(c.codes.values()) for c in clients) < n + 30:  # and requests go on after it
            time.sleep(0.05)
        stop.set()
        for c in clients:
            c.join(timeout=30)

    codes = sum((c.codes for c in clients), Counter())
    print(f"requests under reloads: {dict(codes)}; per client: "
          f"{[(c.kind, sum(c.codes.values())) for c in clients]}")
    assert [f for c in clients for f in c.failures] == []
    assert set(codes) == {200} and codes[200] >= 60
    assert {c.kind: c.versions for c in clients} == {"kt": {"2"}, "sessions": {"1"}, "srs": {"1"}}


def test_at_startup_a_broken_newest_version_serves_the_previous_one_loudly(root, serve):
    (root / "deep_gpcm" / "2" / "step.onnx").write_bytes(b"not an onnx graph")
    (root / "gru4rec" / "1" / "manifest.json").unlink()
    with serve(Settings(artifacts_dir=root)) as url, httpx.Client(base_url=url) as http:
        ready = http.get("/readyz")
        assert ready.status_code == 200, ready.text
        assert [(r["model"], r["version"], r["kept"], r["serving"]) for r in ready.json()["refused"]] == [
            ("deep_gpcm", "2", False, "1"), ("gru4rec", "1", False, None)]
        assert ready.json()["serving"] == {"deep_gpcm": "1", "time_aware": "1"}
        assert scrape(http, "nextstep_artifacts_refused") == {
            '{kept="false",model="deep_gpcm",version="2"}': 1.0, '{kept="false",model="gru4rec",version="1"}': 1.0}
        answer = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": [1]})
        assert answer.status_code == 200 and answer.json()["version"] == "1"
        pinned = http.post("/v1/kt/deep_gpcm@2/predict", json={"student_id": "s", "question_ids": [1]})
        assert pinned.status_code == 404 and "was refused" in pinned.json()["detail"], pinned.text
        gone = http.post("/v1/sessions/gru4rec/recommend", json={"session_id": "s"})
        assert gone.status_code == 404 and gone.json()["field"] == "model"
        assert http.post("/v1/models/reload", timeout=60).status_code == 409  # still there: still refused


def test_a_pin_picks_the_version_by_path_or_header(root, redis_url, serve):
    with serve(Settings(artifacts_dir=root, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        def events(path: str, event_id: str, **headers) -> httpx.Response:
            return http.post(path, headers=headers, json={
                "student_id": "pinned", "events": [{"question_id": 3, "response": 2, "event_id": event_id}]})

        assert events("/v1/kt/deep_gpcm/events", "a").json()["version"] == "2"
        # each version has its own state, caught up with the learner's log: event "a" is the learner's, applied once
        one = events("/v1/kt/deep_gpcm@1/events", "a").json()
        assert (one["version"], one["events_absorbed"], one["rebuilt_from_events"], one["events_total"]) == \
            ("1", 0, 1, 1)
        header = events("/v1/kt/deep_gpcm/events", "b", **{"X-Model-Version": "1"}).json()
        assert header["version"] == "1" and header["events_total"] == 2
        both = events("/v1/kt/deep_gpcm@1/events", "c", **{"X-Model-Version": "1"})
        assert both.status_code == 200 and both.json()["events_total"] == 3
        summary = http.get("/v1/kt/deep_gpcm%401/students/pinned")  # (an escaped @ is the same path)
        assert summary.status_code == 200 and summary.json()["version"] == "1", summary.text
        assert summary.json()["events_total"] == 3
        latest = http.get("/v1/kt/deep_gpcm/students/pinned").json()
        assert (latest["version"], latest["events_total"], latest["rebuilt_from_events"]) == ("2", 3, 2)

        unknown = events("/v1/kt/deep_gpcm@7/events", "d")
        assert unknown.status_code == 404 and unknown.json()["field"] == "model"
        assert unknown.json()["detail"] == "model 'deep_gpcm' has no version '7'; available: 1, 2 (latest 2)"
        by_header = events("/v1/kt/deep_gpcm/events", "d", **{"X-Model-Version": "7"})
        assert by_header.status_code == 404 and "no version '7'" in by_header.json()["detail"]
        clash = events("/v1/kt/deep_gpcm@1/events", "d", **{"X-Model-Version": "2"})
        assert clash.status_code == 422 and clash.json()["field"] == "X-Model-Version", clash.text
        for bad in ("", "a/b", "1@2", "x" * 201):
            reply = events("/v1/kt/deep_gpcm/events", "d", **{"X-Model-Version": bad})
            assert reply.status_code == 422 and reply.json()["field"] == "X-Model-Version", (bad, reply.text)

        session = http.post("/v1/sessions/gru4rec@1/recommend", json={"session_id": "s", "k": 2})
        assert session.status_code == 200 and session.json()["version"] == "1"
        srs = http.post("/v1/srs/time_aware/predict", headers={"X-Model-Version": "1"},
                        json={"user_id": "u", "card_id": "c", "time": T0})
        assert srs.status_code == 200 and srs.json()["version"] == "1", srs.text
        assert http.get("/healthz", headers={"X-Model-Version": "1"}).status_code == 200  # no model: no pin
        assert http.post("/v1/models/reload", headers={"X-Model-Version": "1"}, timeout=60).status_code == 200
        counted = scrape(http, "nextstep_requests_total")
        assert counted['{model="deep_gpcm",route="/v1/kt/{model}/events",status="200"}'] == 4.0  # under its name
        assert counted['{model="deep_gpcm",route="/v1/kt/{model}/events",status="404"}'] == 2.0


def test_the_ids_a_model_knows_page_by_page(root, serve):
    vocabulary = json.loads((root / "gru4rec" / "1" / "vocab_items.json").read_text())["ids"]
    with serve(Settings(artifacts_dir=root)) as url, httpx.Client(base_url=url) as http:
        ids, offset, pages = [], 0, 0
        while offset is not None:
            page = http.get("/v1/models/gru4rec/ids", params={"offset": offset, "limit": 7}).json()
            assert page["model"] == "gru4rec" and page["version"] == "1" and page["vocabulary"] == "items"
            assert page["total"] == len(vocabulary) and len(page["ids"]) <= 7
            ids += page["ids"]
            offset, pages = page["next_offset"], pages + 1
        assert ids == [str(i) for i in vocabulary] and pages == -(-len(vocabulary) // 7)

        kt = http.get("/v1/models/deep_gpcm@1/ids").json()
        assert (kt["version"], kt["vocabulary"], kt["total"], kt["ids"]) == ("1", "questions", 12, [
            str(i) for i in range(12)])
        assert http.get("/v1/models/deep_gpcm/ids", params={"limit": 2}).json()["version"] == "2"
        past = http.get("/v1/models/deep_gpcm/ids", params={"offset": 50}).json()
        assert past["ids"] == [] and past["next_offset"] is None and past["total"] == 12
        srs = http.get("/v1/models/time_aware/ids").json()  # flashcard ids are hashed: any id is known
        assert srs["vocabulary"] is None and srs["total"] == 0 and srs["ids"] == []
        for params in ({"limit": 0}, {"limit": 10_001}, {"offset": -1}, {"offset": "x"}):
            reply = http.get("/v1/models/deep_gpcm/ids", params=params)
            assert reply.status_code == 422 and reply.json()["field"] in params, (params, reply.text)
        missing = http.get("/v1/models/nobody/ids")
        assert missing.status_code == 404 and missing.json()["field"] == "model"
        assert http.get("/v1/models/deep_gpcm@9/ids").status_code == 404


USER, ADMIN = "user-key-5e1b0c8d7a", "admin-key-2f9a4c6e1d"
REMOTE = {"X-Forwarded-For": "203.0.113.9"}  # uvicorn trusts it from 127.0.0.1: a client behind a local proxy


def test_clients_that_are_not_admins_see_the_kind_of_fault_and_admins_the_details(root, serve, tmp_path):
    """/readyz (open to anyone), /v1/models and a pin's 404 (any key): the refused artifact by name and the kind of
    fault, no paths, no ONNX Runtime messages. Admins (an admin key; with no keys, a loopback client) see those too,
    and the reload's 409 names the kind of fault in its detail (the details are in its `refused`)."""
    (root / "deep_gpcm" / "2" / "step.onnx").write_bytes(b"not an onnx graph")
    summary = "graph failed to load (step)"
    with serve(Settings(artifacts_dir=root, api_keys=[USER], admin_keys=[ADMIN])) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        for headers in ({}, {"X-API-Key": USER}):
            ready = http.get("/readyz", headers=headers)
            assert ready.status_code == 200, ready.text
            assert ready.json()["refused"] == [{"model": "deep_gpcm", "version": "2", "reason": summary,
                                                "kind": "graph failed to load", "kept": False, "serving": "1",
                                                "outcome": "deep_gpcm serves version 1"}]
            shown = [ready.text]
            if headers:
                listed = http.get("/v1/models", headers=headers)
                assert listed.json()["refused"] == ready.json()["refused"], listed.text
                assert listed.json()["errors"] == {"deep_gpcm/2": summary}
                pinned = http.post("/v1/kt/deep_gpcm@2/predict", json={"student_id": "s", "question_ids": [1]},
                                   headers=headers)
                assert pinned.status_code == 404 and pinned.json()["detail"].endswith(f"was refused: {summary}")
                shown += [listed.text, pinned.text]
            for text in shown:
                assert str(root) not in text and "step.onnx" not in text and "ONNXRuntime" not in text, text
        admin = {"X-API-Key": ADMIN}
        for path in ("/readyz", "/v1/models"):
            (refused,) = http.get(path, headers=admin).json()["refused"]
            assert refused["path"] == str(root / "deep_gpcm" / "2") and "step.onnx" in refused["reason"]
        assert http.get("/v1/models", headers=admin).json()["errors"] == {
            str(root / "deep_gpcm" / "2"): refused["reason"]}
        reply = http.post("/v1/models/reload", headers=admin)
        assert reply.status_code == 409 and f"deep_gpcm/2: {summary} (deep_gpcm serves version 1)" in (
            reply.json()["detail"]), reply.text
        assert str(root) not in reply.json()["detail"] and reply.json()["refused"][0]["path"] == refused["path"]
    with serve(Settings(artifacts_dir=root)) as url, httpx.Client(base_url=url) as http:  # no keys
        assert http.get("/readyz", headers=REMOTE).json()["refused"][0]["reason"] == summary
        assert http.get("/readyz").json()["refused"][0]["path"] == refused["path"]  # loopback: the admin rule
    with serve(Settings(artifacts_dir=tmp_path / "empty")) as url, httpx.Client(base_url=url) as http:
        unready = http.get("/readyz", headers=REMOTE)
        assert unready.status_code == 503 and str(tmp_path) not in unready.text, unready.text
        assert "NEXTSTEP_ARTIFACTS_DIR" in unready.json()["detail"]
        assert str(tmp_path / "empty") in http.get("/readyz").json()["detail"]


def test_a_reload_serves_the_first_models_trained_in_place_of_the_demo(tmp_path, serve):
    """`nextstep serve --demo` on an empty artifacts directory serves the bundled demo models; a model trained into
    the directory then, and a reload, serve that directory alone (the demo models go, none reported refused)."""
    artifacts = tmp_path / "artifacts"
    artifacts.mkdir()
    settings = Settings(artifacts_dir=artifacts, demo_artifacts_dir=BUNDLED)
    with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
        assert {m["name"] for m in http.get("/v1/models").json()["models"]} == set(MODELS)
        add_version(artifacts, "deep_gpcm", "1", 2026)
        reply = http.post("/v1/models/reload")
        assert reply.status_code == 200 and reply.json()["refused"] == [], reply.text
        assert [(m["name"], m["version"]) for m in http.get("/v1/models").json()["models"]] == [("deep_gpcm", "1")]
        assert http.post("/v1/sessions/gru4rec/recommend", json={"session_id": "s", "k": 3}).status_code == 404
