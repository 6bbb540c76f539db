"""The scrape stays bounded: whatever names and paths clients send, /metrics holds the same series."""

import httpx

from nextstep.service.settings import Settings


def _series(text: str) -> set[str]:
    """Each sample's name and labels (the value left out)."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")}


def _requests(i: int) -> list[tuple[str, str, dict | None]]:
    """One of each kind of request a client could vary without bound: unknown model names on every task's
    routes (valid and invalid bodies), and paths no route matches."""
    name = f"zz-{i}"
    return [
        ("POST", f"/v1/kt/{name}/events", {"student_id": "s", "events": [{"question_id": 3, "response": 1}]}),
        ("POST", f"/v1/kt/{name}/predict", {"student_id": "s", "question_ids": [3]}),
        ("POST", f"/v1/kt/{name}/events", {"student_id": "s", "events": []}),  # 422
        ("GET", f"/v1/kt/{name}/students/s{i}", None),
        ("POST", f"/v1/sessions/{name}/events", {"session_id": "v", "events": [{"item_id": 1}]}),
        ("DELETE", f"/v1/sessions/{name}/v{i}", None),
        ("POST", f"/v1/srs/{name}/predict", {"user_id": "u", "card_id": "c"}),
        ("GET", f"/no/such/path/{i}", None),
        ("POST", f"/v1/kt/{name}/events/more/{i}", {}),
    ]


def test_unknown_names_and_paths_add_no_series(artifacts, redis_url, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        ok = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": [3]})
        assert ok.status_code == 200, ok.text
        for method, path, body in _requests(0):  # every kind once, so that its series exist
            assert http.request(method, path, json=body).status_code in (404, 405, 422)
        http.get("/metrics")  # (a scrape is counted once it has answered: the next one shows it)
        before = _series(http.get("/metrics").text)
        statuses = set()
        for i in range(1, 1001):
            method, path, body = _requests(i)[i % 9]
            statuses.add(http.request(method, path, json=body).status_code)
        after = _series(http.get("/metrics").text)
    assert statuses <= {404, 405, 422} and 404 in statuses
    assert after == before, sorted(after ^ before)[:10]
    assert not [s for s in after if "zz-" in s or "/no/such" in s or "/more/" in s]
    # a loaded model keeps its own label, and the route its template
    assert any('model="deep_gpcm",route="/v1/kt/{model}/predict",status="200"' in s for s in after)
    assert any('model="",route="/v1/kt/{model}/events",status="404"' in s for s in after)
    assert any('route="unmatched"' in s for s in after)
