"""End to end: real HTTP (uvicorn on a loopback port) into the app, real ONNX Runtime, real Redis."""

import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch

from nextstep.service.settings import Settings
from nextstep.training.kt.data import load_dataset
from nextstep.training.kt.run import load_model
from tests.service.conftest import ODD_IDS, encoded


def offline_predictions(artifact: Path, questions: list[int], responses: list[int]) -> np.ndarray:
    """The PyTorch model's teacher-forced probabilities for the next question after each prefix."""
    model, vocab, _ = load_model(artifact)
    q = torch.from_numpy(vocab.encode(np.array(questions)))[None]
    r = torch.tensor(responses)[None]
    with torch.no_grad():
        return model(q, r).log_probs.exp()[0].numpy()


def test_served_predictions_equal_the_offline_model(artifacts, store_url, serve):
    art, data = artifacts
    _, test = load_dataset(data)
    seq = test.sequences[0]
    questions, responses = seq.questions.tolist(), seq.responses.tolist()
    expected = offline_predictions(art / "deep_gpcm" / "v1", questions, responses)
    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, httpx.Client(base_url=url) as http:
        for t in range(len(questions) - 1):
            body = {"student_id": "learner-1", "events": [{"question_id": questions[t], "response": responses[t]}],
                    "predict_question_ids": [questions[t + 1]]}
            reply = http.post("/v1/kt/deep_gpcm/events", json=body)
            assert reply.status_code == 200, reply.text
            got = np.array(reply.json()["predictions"][0]["probabilities"])
            np.testing.assert_allclose(got, expected[t + 1], atol=1e-5)
        summary = http.get("/v1/kt/deep_gpcm/students/learner-1").json()
        assert summary["events_total"] == len(questions) - 1
        # the stateless batch route replays the same history to the same answer
        batch = http.post("/v1/kt/deep_gpcm/batch", json={"students": [{
            "student_id": "x", "events": [{"question_id": q, "response": r}
                                         for q, r in zip(questions[:-1], responses[:-1], strict=True)],
            "predict_question_ids": [questions[-1]]}]}).json()
        np.testing.assert_allclose(batch["students"][0]["predictions"][0]["probabilities"], expected[-1], atol=1e-5)


def test_state_survives_a_restart(artifacts, redis_url, serve):
    art, _ = artifacts
    settings = Settings(artifacts_dir=art, redis_url=redis_url)
    body = {"student_id": "s", "events": [{"question_id": 3, "response": 2}, {"question_id": 4, "response": 0}]}
    with serve(settings) as url:
        httpx.post(f"{url}/v1/kt/deep_gpcm/events", json=body).raise_for_status()
        before = httpx.post(f"{url}/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": [5]}).json()
    with serve(settings) as url:  # a new process-equivalent: nothing in memory, all from Redis
        after = httpx.post(f"{url}/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": [5]}).json()
    assert after["events_total"] == 2
    assert after["predictions"] == before["predictions"]


@pytest.mark.slow
def test_no_lost_updates_and_replays_change_nothing(artifacts, store_url, serve):
    art, _ = artifacts
    clients, per_client = 50, 40

    async def drive(url: str, replay: bool) -> None:
        async def client(c: int):  # a connection each (one pool of 50 scans all of them per request: slow)
            async with httpx.AsyncClient(base_url=url, timeout=30) as http:
                for i in range(per_client):
                    body = {"student_id": "busy", "events": [
                        {"question_id": 2 + (c + i) % 10, "response": (c * i) % 4, "event_id": f"{c}-{i}"}]}
                    reply = await http.post("/v1/kt/deep_gpcm/events", json=body)
                    assert reply.status_code == 200, reply.text
                    assert reply.json()["events_absorbed"] == (0 if replay else 1)

        await asyncio.gather(*(client(c) for c in range(clients)))

    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url:
        asyncio.run(drive(url, replay=False))
        first = httpx.get(f"{url}/v1/kt/deep_gpcm/students/busy").json()
        assert first["events_total"] == clients * per_client == 2000
        asyncio.run(drive(url, replay=True))
        again = httpx.get(f"{url}/v1/kt/deep_gpcm/students/busy").json()
        assert again["events_total"] == 2000 and again["state_version"] == first["state_version"]


def test_redis_outage_gives_503_quickly_and_recovers(artifacts, redis_process, serve):
    art, _ = artifacts
    body = {"student_id": "s", "events": [{"question_id": 3, "response": 1}]}
    with serve(Settings(artifacts_dir=art, redis_url=redis_process.url)) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/readyz").status_code == 200
        redis_process.stop()
        for method, path, payload in (("GET", "/readyz", None), ("POST", "/v1/kt/deep_gpcm/events", body),
                                      ("GET", "/v1/kt/deep_gpcm/students/s", None)):
            start = time.monotonic()
            reply = http.request(method, path, json=payload)
            assert reply.status_code == 503, (path, reply.text)
            assert "unavailable" in reply.json()["detail"]
            assert time.monotonic() - start < 3
        assert http.get("/healthz").status_code == 200  # alive, just not ready
        redis_process.start()
        assert http.get("/readyz").status_code == 200
        assert http.post("/v1/kt/deep_gpcm/events", json=body).status_code == 200


@pytest.mark.parametrize("body,status,field", [
    ({"student_id": "s", "events": [{"question_id": 999, "response": 1}]}, 422, "events[0].question_id"),
    ({"student_id": "s", "events": [{"question_id": 3, "response": 1}, {"question_id": 3, "response": 9}]},
     422, "events[1].response"),
    ({"student_id": "s", "events": []}, 422, "events"),
    ({"student_id": "s", "events": [{"question_id": 3, "response": 1}] * 6}, 413, "events"),
    ({"student_id": "s", "events": "many"}, 422, "events"),
    ({"student_id": "s", "events": [{"question_id": 3, "response": "two"}]}, 422, "response"),
    ({"student_id": "s", "events": [{"question_id": 3, "response": 1}], "predict_question_ids": ["nope"]},
     422, "predict_question_ids[0]"),
    ({"events": [{"question_id": 3, "response": 1}]}, 422, "student_id"),
    # an empty event id would be recorded, and every later event with it dropped as a replay
    ({"student_id": "s", "events": [{"question_id": 3, "response": 1, "event_id": ""}]}, 422, "events[0].event_id"),
    ({"student_id": "s", "events": [{"question_id": 3, "response": 1, "timestamp": -1}]}, 422, "events[0].timestamp"),
])
def test_bad_input_is_a_4xx_naming_the_field(artifacts, body, status, field, serve):
    art, _ = artifacts
    # (unknown ids: a 422 with NEXTSTEP_UNKNOWN_QUESTIONS=error; test_unknown_ids.py has the default, answered)
    with serve(Settings(artifacts_dir=art, max_events=5, unknown_questions="error")) as url:
        reply = httpx.post(f"{url}/v1/kt/deep_gpcm/events", json=body)
    assert reply.status_code == status, reply.text
    assert field in reply.text


def test_unknown_model_api_keys_and_body_limit(artifacts, serve):
    art, _ = artifacts
    body = {"student_id": "s", "question_ids": [3]}
    k1, k2 = "key-one-0123456789abcdef", "key-two-0123456789abcdef"  # (keys are at least 16 characters)
    with serve(Settings(artifacts_dir=art, api_keys=[k1, k2], max_body_bytes=2048)) as url:
        assert httpx.post(f"{url}/v1/kt/deep_gpcm/predict", json=body).status_code == 401
        wrong = httpx.post(f"{url}/v1/kt/deep_gpcm/predict", json=body, headers={"X-API-Key": k2[::-1]})
        assert wrong.status_code == 401
        ok = httpx.post(f"{url}/v1/kt/deep_gpcm/predict", json=body, headers={"X-API-Key": k2})
        assert ok.status_code == 200
        missing = httpx.post(f"{url}/v1/kt/nope/predict", json=body, headers={"X-API-Key": k1})
        assert missing.status_code == 404 and "deep_gpcm" in missing.json()["detail"]
        big = {"student_id": "s", "question_ids": [3] * 2000}
        assert httpx.post(f"{url}/v1/kt/deep_gpcm/predict", json=big, headers={"X-API-Key": k1}).status_code == 413
        assert httpx.get(f"{url}/healthz").status_code == 200  # probes need no key

        def chunked(n: int):  # no content-length: the limit applies while the body streams in
            yield b'{"student_id": "s", "question_ids": ['
            yield b"3," * n
            yield b"3]}"

        for n, status in ((10, 200), (2000, 413)):
            reply = httpx.post(f"{url}/v1/kt/deep_gpcm/predict", content=chunked(n),
                               headers={"X-API-Key": k1, "content-type": "application/json"})
            assert reply.status_code == status, reply.text
        metrics = httpx.get(f"{url}/metrics").text
        assert 'nextstep_requests_total{model="deep_gpcm",route="/v1/kt/{model}/predict",status="200"} 2.0' in metrics


def test_next_item_ranks_by_fisher_information_and_target(artifacts, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        http.post("/v1/kt/deep_gpcm/events", json={"student_id": "s", "events": [{"question_id": 3, "response": 3}]})
        fisher = http.post("/v1/kt/deep_gpcm/next-item", json={"student_id": "s", "k": 20}).json()["items"]
        scores = [i["score"] for i in fisher]
        assert scores == sorted(scores, reverse=True) and len(fisher) == 12
        target = http.post("/v1/kt/deep_gpcm/next-item", json={
            "student_id": "s", "strategy": "target", "target": 0.3, "candidate_question_ids": [2, 3, 4, 5]}).json()
        gaps = [abs(i["score"] - 0.3) for i in target["items"]]
        assert gaps == sorted(gaps) and {i["question_id"] for i in target["items"]} == {"2", "3", "4", "5"}
        # the ranking's scores are the served probabilities of full credit
        probs = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": [2]}).json()
        by_id = {i["question_id"]: i["score"] for i in target["items"]}
        assert by_id["2"] == pytest.approx(probs["predictions"][0]["probabilities"][-1], abs=1e-6)


def test_score_command_matches_the_offline_model(artifacts, tmp_path, capsys):
    import json

    from nextstep.cli import main

    art, data = artifacts
    _, test = load_dataset(data)
    seqs = test.sequences[:3]
    lines = [json.dumps({"student_id": s.student_id,
                         "events": [{"question_id": int(q), "response": int(r)}
                                    for q, r in zip(s.questions, s.responses, strict=True)]}) for s in seqs]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["score", str(tmp_path / "in.jsonl"), "--model", "deep_gpcm", "--artifacts", str(art),
                 "--output", str(tmp_path / "out.jsonl"), "--quiet"]) == 0
    scored = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [s["student_id"] for s in scored] == [s.student_id for s in seqs]
    for seq, result in zip(seqs, scored, strict=True):
        expected = offline_predictions(art / "deep_gpcm" / "v1", seq.questions.tolist(), seq.responses.tolist())
        got = np.array([p["probabilities"] for p in result["event_predictions"]])
        np.testing.assert_allclose(got, expected, atol=1e-5)
    (tmp_path / "bad.csv").write_text("student_id,question_id,response\na,3,x\n")
    with pytest.raises(SystemExit, match=r"bad.csv:2: expected an integer response"):
        main(["score", str(tmp_path / "bad.csv"), "--model", "deep_gpcm", "--artifacts", str(art), "--quiet"])


def test_reload_under_load_drops_nothing_and_refuses_a_broken_artifact(artifacts, tmp_path, serve):
    import shutil

    art, _ = artifacts
    root = tmp_path / "artifacts"
    shutil.copytree(art, root)
    broken = root / "deep_gpcm" / "broken"
    shutil.copytree(art / "deep_gpcm" / "v1", broken)
    (broken / "step.onnx").write_bytes(b"not an onnx graph")

    async def load(url: str) -> list[int]:
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:
            async def ask(i: int) -> int:
                reply = await http.post("/v1/kt/deep_gpcm/predict", json={"student_id": f"s{i}", "question_ids": [3]})
                return reply.status_code

            async def reload() -> None:
                for n in range(3):
                    shutil.copytree(art / "deep_gpcm" / "v1", root / "deep_gpcm" / f"v{n + 2}")
                    reply = await http.post("/v1/models/reload")  # the broken artifact is refused each time
                    assert reply.status_code == 409 and [r["version"] for r in reply.json()["refused"]] == ["broken"]
                    assert f"deep_gpcm/v{n + 2}" in reply.json()["models"], reply.text  # the rest loaded

            codes, _ = await asyncio.gather(asyncio.gather(*(ask(i) for i in range(300))), reload())
            return codes

    with serve(Settings(artifacts_dir=root)) as url:
        codes = asyncio.run(load(url))
        models = httpx.get(f"{url}/v1/models").json()
    assert codes == [200] * 300
    assert sorted(m["version"] for m in models["models"]) == ["v1", "v2", "v3", "v4"]
    assert any("broken" in path and "step.onnx" in error for path, error in models["errors"].items())


def test_events_fast_path_answers_like_the_route(artifacts, serve):
    """POST /events takes the route's fast path (routes/common.py, JsonRoute); what it cannot take goes to FastAPI:
    both must give the same answers, errors and metrics."""
    art, _ = artifacts
    body = {"student_id": "fast", "events": [{"question_id": 3, "response": 2, "event_id": "f-1"}],
            "predict_question_ids": [4, "5"]}
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        first = http.post("/v1/kt/deep_gpcm/events", json=body)
        assert first.status_code == 200 and first.headers["content-type"] == "application/json"
        got = first.json()
        assert (got["events_absorbed"], got["events_skipped"], got["state_version"]) == (1, 0, 1)
        assert [p["question_id"] for p in got["predictions"]] == ["4", "5"]
        assert abs(sum(got["predictions"][0]["probabilities"]) - 1) < 1e-5
        # the same body declared as another content type: 415, as on every JSON route
        plain = http.post("/v1/kt/deep_gpcm/events", content=json.dumps(body), headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and plain.json()["field"] == "Content-Type", plain.text
        # not JSON at all, and a body that fails validation: FastAPI's own 422 naming the place
        broken = http.post("/v1/kt/deep_gpcm/events", content=b'{"student_id": "fast", "events": [',
                           headers={"content-type": "application/json"})
        assert broken.status_code == 422 and "json" in broken.text.lower()
        extra = http.post("/v1/kt/deep_gpcm/events", json={**body, "surprise": 1})
        assert extra.status_code == 422 and "surprise" in extra.text
        # a replay through the fast path, and errors raised inside it go through the app's handlers
        again = http.post("/v1/kt/deep_gpcm/events", json=body).json()
        assert (again["events_absorbed"], again["events_skipped"], again["state_version"]) == (0, 1, 1)
        assert again["predictions"] == got["predictions"]
        missing = http.post("/v1/kt/nope/events", json=body)
        assert missing.status_code == 404 and missing.json()["field"] == "model"
        assert http.post("/v1/kt/deep_gpcm/events/", json=body).status_code in (307, 404)  # not this route
        metrics = http.get("/metrics").text
        route = 'route="/v1/kt/{model}/events"'
        assert f'nextstep_requests_total{{model="deep_gpcm",{route},status="200"}} 2.0' in metrics
        assert f'nextstep_requests_total{{model="deep_gpcm",{route},status="422"}} 2.0' in metrics
        assert f'nextstep_requests_total{{model="deep_gpcm",{route},status="415"}} 1.0' in metrics
        # "nope" is not a loaded model: no series of its own
        assert f'nextstep_requests_total{{model="",{route},status="404"}} 1.0' in metrics





def test_a_timestamp_that_is_not_a_time_is_refused(artifacts, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url:
        for token in ("NaN", "Infinity", "1e400"):  # JSON tokens Python's json module writes, and an overflow
            body = '{"student_id": "s", "events": [{"question_id": 3, "response": 1, "timestamp": ' + token + "}]}"
            reply = httpx.post(f"{url}/v1/kt/deep_gpcm/events", content=body,
                               headers={"content-type": "application/json"})
            assert reply.status_code == 422 and reply.json()["field"] == "events[0].timestamp", (token, reply.text)
        assert httpx.get(f"{url}/v1/kt/deep_gpcm/students/s").json()["events_total"] == 0


def test_a_body_cut_off_mid_stream_changes_nothing(artifacts, redis_url, serve):
    """A chunked body whose client goes away before the last chunk is no request: nothing is applied."""
    import socket
    from urllib.parse import urlsplit

    art, _ = artifacts
    body = b'{"student_id": "cut", "events": [{"question_id": 3, "response": 1}]}'
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url:
        address = urlsplit(url)
        with socket.create_connection((address.hostname, address.port), timeout=5) as conn:
            conn.sendall(b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                         b"transfer-encoding: chunked\r\n\r\n" + b"%x\r\n" % len(body) + body + b"\r\n")
            time.sleep(0.3)  # the whole JSON document has arrived; only the closing chunk is missing
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:  # had the partial body been applied, it would show within this
            state = httpx.get(f"{url}/v1/kt/deep_gpcm/students/cut").json()
            assert state["events_total"] == 0, state
            time.sleep(0.1)
        whole = httpx.post(f"{url}/v1/kt/deep_gpcm/events", content=body, headers={"content-type": "application/json"})
        assert whole.status_code == 200 and whole.json()["events_total"] == 1, whole.text


def test_a_path_whose_escapes_are_not_utf8_is_refused(artifacts, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        body = {"student_id": "\ufffd", "events": [{"question_id": 3, "response": 1}]}
        assert http.post("/v1/kt/deep_gpcm/events", json=body).status_code == 200
        for method in ("GET", "DELETE"):
            for path in ("/v1/kt/deep_gpcm/students/%FE", "/v1/kt/deep_gpcm/students/a%FFb"):
                reply = http.request(method, path)
                assert reply.status_code == 422 and reply.json()["field"] == "path", (method, path, reply.text)
        # the learner whose id really is U+FFFD is still there, and reachable by its own UTF-8 escapes
        kept = http.get("/v1/kt/deep_gpcm/students/%EF%BF%BD").json()
        assert kept["student_id"] == "\ufffd" and kept["events_total"] == 1, kept


def test_any_id_round_trips_through_write_read_and_delete(artifacts, redis_url, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        for n, sid in enumerate(ODD_IDS):
            body = {"student_id": sid, "events": [{"question_id": 3, "response": 1}] * (n % 3 + 1)}
            written = http.post("/v1/kt/deep_gpcm/events", json=body)
            assert written.status_code == 200 and written.json()["student_id"] == sid, written.text
        assert http.get("/v1/kt/deep_gpcm/students/org/42").json()["events_total"] == 1  # a "/" left as it is
        for n, sid in enumerate(ODD_IDS):
            read = http.get(f"/v1/kt/deep_gpcm/students/{encoded(sid)}")
            assert read.status_code == 200, (sid, read.text)
            assert read.json()["student_id"] == sid and read.json()["events_total"] == n % 3 + 1, (sid, read.json())
        for sid in ODD_IDS:
            gone = http.delete(f"/v1/kt/deep_gpcm/students/{encoded(sid)}")
            assert gone.status_code == 200 and gone.json() == {"student_id": sid, "deleted": True}, (sid, gone.text)
            after = http.get(f"/v1/kt/deep_gpcm/students/{encoded(sid)}").json()
            assert after["exists"] is False and after["events_total"] == 0, (sid, after)
        for reply in (http.post("/v1/kt/deep_gpcm/events", json={"student_id": "x" * 201, "events": [
                          {"question_id": 3, "response": 1}]}),
                      http.get(f"/v1/kt/deep_gpcm/students/{'x' * 201}"),
                      http.delete(f"/v1/kt/deep_gpcm/students/{'x' * 201}")):
            assert reply.status_code == 422 and reply.json()["field"] == "student_id", reply.text
            assert "x" * 201 not in reply.text


def test_a_read_only_replica_gives_503_naming_readonly_and_still_answers_reads(artifacts, redis_process, serve):
    """NEXTSTEP_REDIS_URL left on a replica (a failover): writes are 503 problems naming READONLY, nothing is
    written, reads still answer."""
    from tests.service.conftest import RedisProcess
    from tests.service.test_state import _contents, _make_replica, _sync

    art, _ = artifacts
    body = {"student_id": "s", "events": [{"question_id": 3, "response": 1, "event_id": "e1"}]}
    replica = RedisProcess(Path(str(redis_process.workdir) + "-replica"))
    replica.start()
    try:
        with serve(Settings(artifacts_dir=art, redis_url=redis_process.url)) as url:
            assert httpx.post(f"{url}/v1/kt/deep_gpcm/events", json=body).status_code == 200
        _make_replica(replica, redis_process)
        raw = _sync(replica.url)
        before = _contents(raw)
        with serve(Settings(artifacts_dir=art, redis_url=replica.url)) as url, httpx.Client(base_url=url) as http:
            for method, path, payload in (("POST", "/v1/kt/deep_gpcm/events",
                                           {**body, "events": [{**body["events"][0], "event_id": "e2"}]}),
                                          ("DELETE", "/v1/kt/deep_gpcm/students/s", None)):
                reply = http.request(method, path, json=payload)
                assert reply.status_code == 503, reply.text
                problem = reply.json()
                assert problem["type"] == "urn:nextstep:problem:store-unavailable" and "READONLY" in problem["detail"]
            assert http.get("/v1/kt/deep_gpcm/students/s").json()["events_total"] == 1
        assert _contents(raw) == before and len(before) >= 3
    finally:
        replica.stop()


def test_batch_cost_is_bounded_per_student_in_all_and_in_questions(artifacts, serve):
    """kt/batch costs a graph call per event: events per student, events in all and predicted questions in all are
    bounded (413 naming the field and the setting), checked before any work; within them the answer is the offline
    model's for every event."""
    art, data = artifacts
    _, test = load_dataset(data)
    seq = test.sequences[0]
    questions, responses = seq.questions.tolist(), seq.responses.tolist()
    expected = offline_predictions(art / "deep_gpcm" / "v1", questions, responses)

    def student(n: int, predict: int = 0) -> dict:
        return {"student_id": "x", "events": [{"question_id": questions[t % len(questions)],
                                               "response": responses[t % len(questions)]} for t in range(n)],
                "predict_question_ids": [questions[0]] * predict or None}

    settings = Settings(artifacts_dir=art, max_events=len(questions), max_batch_events=2 * len(questions),
                        max_questions=10)
    n = len(questions)
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        for students, field, setting in (([student(n), student(n + 1)], "students[1].events", ""),
                                         ([student(n)] * 3, "students", "NEXTSTEP_MAX_BATCH_EVENTS"),
                                         ([student(1, 6), student(1, 5)], "students[1].predict_question_ids",
                                          "NEXTSTEP_MAX_QUESTIONS")):
            reply = http.post("/v1/kt/deep_gpcm/batch", json={"students": students})
            assert reply.status_code == 413, reply.text
            assert reply.json()["field"] == field and setting in reply.json()["detail"], reply.text  # ("": the
            # route's own check, which does not name its setting, answers first)
        reply = http.post("/v1/kt/deep_gpcm/batch", json={"students": [student(n, 5), student(n, 5)]})
        assert reply.status_code == 200, reply.text
        for scored in reply.json()["students"]:
            got = [p["probabilities"] for p in scored["event_predictions"]]
            np.testing.assert_allclose(got, expected[:n], atol=1e-5)
        empty = http.post("/v1/kt/deep_gpcm/batch", json={"students": [
            {"student_id": "e", "events": [], "predict_question_ids": [questions[0]]}]}).json()["students"][0]
        np.testing.assert_allclose(empty["predictions"][0]["probabilities"], expected[0], atol=1e-5)
