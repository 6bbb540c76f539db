"""routes/common.py: which routes take the JSON fast path (JsonRoute), and that it leaves FastAPI's 4xx alone."""

import httpx
import pytest

from nextstep.service.kt import routes as kt
from nextstep.service.routes.common import JsonRoute
from nextstep.service.sessions import routes as sessions
from nextstep.service.settings import Settings
from nextstep.service.srs import routes as srs

STATEFUL = {("POST", p) for p in ("/v1/kt/{model}/events", "/v1/kt/{model}/predict", "/v1/kt/{model}/next-item",
                                  "/v1/sessions/{model}/events", "/v1/sessions/{model}/recommend",
                                  "/v1/srs/{model}/reviews", "/v1/srs/{model}/predict", "/v1/srs/{model}/schedule")}


def test_every_stateful_route_has_the_fast_path():
    planned = {(method, route.path) for router in (kt.router, sessions.router, srs.router) for route in router.routes
               for method in route.methods if isinstance(route, JsonRoute) and route._plan() is not None}
    assert planned >= STATEFUL, STATEFUL - planned
    # routes without a body keep FastAPI's handler (their path parameters are validated there)
    assert ("GET", "/v1/kt/{model}/students/{student_id:path}") not in planned


@pytest.mark.parametrize("path, body, field", [
    ("/v1/kt/deep_gpcm/predict", {"student_id": "s", "question_ids": []}, "question_ids"),
    ("/v1/sessions/gru/recommend", {"session_id": "v", "k": 0}, "k"),
    ("/v1/srs/fsrs/predict", {"user_id": "u", "card_id": "c", "time": 1.7e12}, "time"),
])
def test_what_the_fast_path_cannot_take_is_a_4xx_naming_the_field(artifacts, serve, path, body, field):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        invalid = http.post(path, json=body)
        assert invalid.status_code == 422 and invalid.json()["field"] == field, invalid.text
        assert invalid.json()["detail"].startswith(f"{field}: ") and invalid.json()["errors"][0]["field"] == field
        plain = http.post(path, content=httpx.Request("POST", "/", json=body).content,
                          headers={"content-type": "text/plain"})
        assert plain.status_code == 415 and plain.json()["field"] == "Content-Type", plain.text
        unparsable = http.post(path, content=b"{", headers={"content-type": "application/json"})
        assert unparsable.status_code == 422 and unparsable.json()["errors"][0]["type"] == "json_invalid"


BODY_ROUTES = sorted((method, route.path) for router in (kt.router, sessions.router, srs.router)
                     for route in router.routes for method in route.methods if route.dependant.body_params)


def test_every_json_route_says_what_is_wrong_with_the_content_type_or_the_json(artifacts, serve):
    assert len(BODY_ROUTES) == 12, BODY_ROUTES  # simulate made it 12
    art, _ = artifacts
    cases = [  # (headers, body, status, words the detail must hold)
        ({}, b"{}", 415, ["Content-Type", "application/json", "missing"]),
        ({"content-type": "text/plain"}, b"{}", 415, ["application/json", "'text/plain'"]),
        ({"content-type": "application/x-www-form-urlencoded"}, b"a=1", 415, ["application/json"]),
        ({"content-type": "text/" + "x" * 5000}, b"{}", 415, ["application/json", "characters)"]),
        ({"content-type": "application/json"}, b"", 422, ["empty"]),
        ({"content-type": "application/json"}, b'{"student_id": "\xff\xfe"}', 422, ["not valid UTF-8"]),
        ({"content-type": "application/json"}, b"[" * 5000 + b"]" * 5000, 422, ["nested too deeply"]),
        ({"content-type": "application/json"}, b'{"a": 1,}', 422, ["not valid JSON", "line 1"]),
        ({"content-type": "application/json"}, b"[]", 422, []),
    ]
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        for method, template in BODY_ROUTES:
            path = template.format(model="deep_gpcm")
            for headers, body, status, words in cases:
                reply = http.request(method, path, content=body, headers=headers)
                problem = reply.json()
                assert reply.status_code == status, (method, path, headers, body[:20], reply.text)
                assert reply.headers["content-type"] == "application/problem+json"
                assert problem["field"] == ("Content-Type" if status == 415 else "body"), (path, problem)
                assert all(w in problem["detail"] for w in words), (path, problem)
                assert len(reply.content) < 1000, (path, len(reply.content))
            for content_type in ("application/json; charset=utf-8", "application/merge-patch+json"):
                reply = http.request(method, path, content=b"{}", headers={"content-type": content_type})
                assert reply.status_code == 422 and reply.json()["errors"][0]["type"] == "missing", reply.text


@pytest.mark.parametrize("path, body, field", [
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": 1, "response": True}]},
     "events[0].response"),
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": 1, "response": 1.0}]},
     "events[0].response"),
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": 1, "response": "1"}]},
     "events[0].response"),
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": True, "response": 1}]},
     "events[0].question_id"),
    ("/v1/kt/deep_gpcm/events", {"student_id": 42, "events": [{"question_id": 1, "response": 1}]}, "student_id"),
    ("/v1/kt/deep_gpcm/batch", {"students": [{"student_id": "s", "events": [{"question_id": 1, "response": False}]}]},
     "students[0].events[0].response"),
    ("/v1/kt/deep_gpcm/predict", {"student_id": "s", "question_ids": [1], "explain": 1}, "explain"),
    ("/v1/kt/deep_gpcm/next-item", {"student_id": "s", "k": True}, "k"),
    ("/v1/kt/deep_gpcm/next-item", {"student_id": "s", "target": "0.5"}, "target"),
    ("/v1/sessions/gru4rec/recommend", {"session_id": "v", "exclude_seen": 0}, "exclude_seen"),
    ("/v1/sessions/gru4rec/recommend", {"session_id": "v", "k": 5.0}, "k"),
    ("/v1/sessions/gru4rec/events", {"session_id": "v", "events": [{"item_id": 1}], "recommend_k": True},
     "recommend_k"),
    ("/v1/srs/time_aware/reviews", {"user_id": "u", "reviews": [{"card_id": "c", "time": 1.7e9, "rating": True}]},
     "reviews[0].rating"),
    ("/v1/srs/time_aware/reviews", {"user_id": "u", "reviews": [{"card_id": "c", "time": True, "rating": 3}]},
     "reviews[0].time"),
    ("/v1/srs/time_aware/reviews", {"user_id": "u", "reviews": [
        {"card_id": "c", "time": 1.7e9, "rating": 3, "state": False}]}, "reviews[0].state"),
    ("/v1/srs/time_aware/schedule", {"user_id": "u", "cards": [{"card_id": "c"}], "desired_retention": True},
     "desired_retention"),
])
def test_booleans_integers_and_strings_are_not_interchangeable(artifacts, serve, path, body, field):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url:
        reply = httpx.post(f"{url}{path}", json=body)
    assert reply.status_code == 422 and reply.json()["field"].startswith(field), reply.text


def test_overlong_ids_are_refused_and_never_echoed(artifacts, serve):
    art, _ = artifacts
    huge, long = "q" * 1_500_000, "s" * 201
    bodies = [  # (path, body, the field named)
        ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": huge, "response": 1}]},
         "events[0].question_id"),
        ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": 1, "response": 1}],
                                     "predict_question_ids": [huge]}, "predict_question_ids[0]"),
        ("/v1/kt/deep_gpcm/events", {"student_id": long, "events": [{"question_id": 1, "response": 1}]},
         "student_id"),
        ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": 1, "response": 1,
                                                                    "event_id": huge}]}, "events[0].event_id"),
        ("/v1/kt/deep_gpcm/predict", {"student_id": "s", "question_ids": [1] + [int("9" * 400)]},
         "question_ids[1]"),
        ("/v1/sessions/gru4rec/events", {"session_id": huge, "events": [{"item_id": 1}]}, "session_id"),
        ("/v1/sessions/gru4rec/batch", {"sessions": [{"item_ids": [huge]}]}, "sessions[0].item_ids[0]"),
        ("/v1/srs/time_aware/predict", {"user_id": "u", "card_id": huge}, "card_id"),
        ("/v1/srs/time_aware/schedule", {"user_id": long, "cards": [{"card_id": "c"}], "desired_retention": 0.9},
         "user_id"),
    ]
    settings = Settings(artifacts_dir=art, max_body_bytes=4_000_000)
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        for path, body, field in bodies:
            reply = http.post(path, json=body)
            assert reply.status_code == 422 and reply.json()["field"].startswith(field), (path, reply.text[:500])
            assert len(reply.content) < 1000 and "qqqq" not in reply.text and "ssss" not in reply.text, path
        for path, field in (("/v1/kt/deep_gpcm/students/", "student_id"), ("/v1/sessions/gru4rec/", "session_id"),
                            ("/v1/srs/time_aware/users/", "user_id")):
            for method in ("GET", "DELETE"):
                reply = http.request(method, path + long)
                assert reply.status_code == 422 and reply.json()["field"] == field, (method, path, reply.text)
                assert "ssss" not in reply.text
        # a model name is not a bounded parameter (the fast path takes it as the router matched it): the
        # 404 shows it cut short
        reply = http.post(f"/v1/kt/{'m' * 20_000}/events", json={"student_id": "s", "events": [
            {"question_id": 1, "response": 1}]})
        assert reply.status_code == 404 and reply.json()["field"] == "model" and len(reply.content) < 3000


def test_a_value_shown_in_an_error_is_cut_short():
    from nextstep.service.errors import SHOWN, UnknownId, problem, shown

    assert shown("abc") == "'abc'"
    assert len(shown("x" * 10**6)) < SHOWN + 40 and shown("x" * 10**6).endswith("(1000002 characters)")
    assert len(str(UnknownId("question", "x" * 10**6))) < 200
    assert len(problem(422, "d" * 10**6).body) < 2200
