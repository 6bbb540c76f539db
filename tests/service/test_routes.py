"""routes/common.py: which routes take the JSON fast path (JsonRoute), and that it leaves FastAPI's 4xx alone."""

import httpx
import pytest

from nextstep.service.routes import kt, sessions, srs
from nextstep.service.routes.common import JsonRoute
from nextstep.service.settings import Settings

STATEFUL = {("POST", p) for p in ("/v1/kt/{model}/events", "/v1/kt/{model}/predict", "/v1/kt/{model}/next-item",
                                  "/v1/sessions/{model}/events", "/v1/sessions/{model}/recommend",
                                  "/v1/srs/{model}/reviews", "/v1/srs/{model}/predict", "/v1/srs/{model}/schedule")}


def test_every_stateful_route_has_the_fast_path():
    planned = {(method, route.path) for router in (kt.router, sessions.router, srs.router) for route in router.routes
               for method in route.methods if isinstance(route, JsonRoute) and route._plan() is not None}
    assert planned >= STATEFUL, STATEFUL - planned
    # routes without a body keep FastAPI's handler (their path parameters are validated there)
    assert ("GET", "/v1/kt/{model}/students/{student_id}") not in planned


@pytest.mark.parametrize("path, body, field", [
    ("/v1/kt/deep_gpcm/predict", {"student_id": "s", "question_ids": []}, "question_ids"),
    ("/v1/sessions/gru/recommend", {"session_id": "v", "k": 0}, "k"),
    ("/v1/srs/fsrs/predict", {"user_id": "u", "card_id": "c", "time": 1.7e12}, "time"),
])
def test_what_the_fast_path_cannot_take_gets_fastapis_answer(artifacts, serve, path, body, field):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        invalid = http.post(path, json=body)
        assert invalid.status_code == 422 and invalid.json()["field"] == field, invalid.text
        assert invalid.json()["detail"].startswith(f"{field}: ") and invalid.json()["errors"][0]["field"] == field
        plain = http.post(path, content=httpx.Request("POST", "/", json=body).content,
                          headers={"content-type": "text/plain"})
        assert plain.status_code == 422 and plain.json()["field"] == "body", plain.text
        unparsable = http.post(path, content=b"{", headers={"content-type": "application/json"})
        assert unparsable.status_code == 422 and unparsable.json()["errors"][0]["type"] == "json_invalid"
