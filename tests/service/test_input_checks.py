"""What a client may get wrong in a request, on every task, answered as a 4xx that says what and where (issue 36):
times ahead of the server's clock, values of the wrong type for an id that may be a string or an integer, lone
surrogates in the JSON, and a model name holding an encoded slash. On the bundled demo models (one per task)."""

import time

import httpx
import pytest

from nextstep.demo import BUNDLED
from nextstep.service.settings import Settings

YEAR_2100 = 4102444800.0


@pytest.fixture(scope="module")
def demo(serve):
    """(base URL of the demo models served in-process, a known question id, a known item id)."""
    with serve(Settings(artifacts_dir=BUNDLED)) as url, httpx.Client(base_url=url) as http:
        question = http.get("/v1/models/deep_gpcm/ids", params={"limit": 1}).json()["ids"][0]
        item = http.get("/v1/models/gru4rec/ids", params={"limit": 1}).json()["ids"][0]
        yield url, question, item


def test_a_review_ahead_of_the_clock_is_refused_and_locks_no_one_out(demo):
    url, _, _ = demo
    with httpx.Client(base_url=url) as http:
        ahead = http.post("/v1/srs/time_aware/reviews", json={"user_id": "far", "reviews": [
            {"card_id": "c", "time": time.time() - 60, "rating": 3}, {"card_id": "c", "time": YEAR_2100, "rating": 3}]})
        assert ahead.status_code == 422 and ahead.json()["field"] == "reviews[1].time", ahead.text
        assert "NEXTSTEP_MAX_CLOCK_SKEW_SECONDS" in ahead.json()["detail"] and "86400" in ahead.json()["detail"]
        assert http.get("/v1/srs/time_aware/users/far").json()["exists"] is False  # nothing of it was written
        # so the user's reviews at the right time go on being taken, one a little ahead (a client's clock) too
        for at in (time.time(), time.time() + 3600):
            reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": "far", "reviews": [
                {"card_id": "c", "time": at, "rating": 3}]})
            assert reply.status_code == 200, reply.text
        # asking about the future is no clock error: a prediction at a due the schedule gives, years ahead
        due = http.post("/v1/srs/time_aware/schedule", json={"user_id": "far", "cards": [{"card_id": "c"}],
                                                             "desired_retention": 0.5, "now": YEAR_2100}).json()
        assert due["cards"][0]["due"] >= YEAR_2100
        predicted = http.post("/v1/srs/time_aware/predict", json={"user_id": "far", "card_id": "c",
                                                                  "time": due["cards"][0]["due"]})
        assert predicted.status_code == 200, predicted.text
        batch = http.post("/v1/srs/time_aware/reviews", json={"user_id": "far", "reviews": [
            {"card_id": "c", "time": time.time() + 7200, "rating": 3}], "predict": {"card_id": "c", "time": YEAR_2100}})
        assert batch.status_code == 200, batch.text


@pytest.mark.parametrize("path, body, field", [
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [
        {"question_id": "Q", "response": 1}, {"question_id": "Q", "response": 1, "timestamp": 1e300}]},
     "events[1].timestamp"),
    ("/v1/kt/deep_gpcm/batch", {"students": [{"student_id": "a", "events": []}, {"student_id": "s", "events": [
        {"question_id": "Q", "response": 1, "timestamp": YEAR_2100}]}]}, "students[1].events[0].timestamp"),
    ("/v1/sessions/gru4rec/events", {"session_id": "v", "events": [{"item_id": "I", "timestamp": YEAR_2100}]},
     "events[0].timestamp"),
])
def test_an_event_timestamp_ahead_of_the_clock_is_refused(demo, path, body, field):
    url, question, item = demo
    text = httpx.Request("POST", "/", json=body).content.replace(b'"Q"', f'"{question}"'.encode())
    text = text.replace(b'"I"', f'"{item}"'.encode())
    with httpx.Client(base_url=url) as http:
        reply = http.post(path, content=text, headers={"content-type": "application/json"})
        assert reply.status_code == 422 and reply.json()["field"] == field, reply.text
        assert "NEXTSTEP_MAX_CLOCK_SKEW_SECONDS" in reply.json()["detail"]
        now = text.replace(str(YEAR_2100).encode(), str(time.time()).encode()).replace(b"1e+300", b"1e9")
        assert http.post(path, content=now, headers={"content-type": "application/json"}).status_code == 200


def test_the_clock_skew_is_a_setting(serve):
    with serve(Settings(artifacts_dir=BUNDLED, max_clock_skew_seconds=0)) as url, httpx.Client(base_url=url) as http:
        reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": [
            {"card_id": "c", "time": time.time() + 60, "rating": 3}]})
        assert reply.status_code == 422 and reply.json()["field"] == "reviews[0].time", reply.text
        assert http.post("/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": [
            {"card_id": "c", "time": time.time() - 1, "rating": 3}]}).status_code == 200
    # a user whose last review was stored ahead of the clock (as before the limit): the 422 says so, and the way out
    with serve(Settings(artifacts_dir=BUNDLED, max_clock_skew_seconds=1e10)) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": [
            {"card_id": "c", "time": YEAR_2100, "rating": 3}]}).status_code == 200
        locked = http.post("/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": [
            {"card_id": "c", "time": time.time(), "rating": 3}]})
        assert locked.status_code == 422 and locked.json()["field"] == "reviews[0].time", locked.text
        assert "ahead of the server's clock" in locked.json()["detail"] and "deleted" in locked.json()["detail"]


@pytest.mark.parametrize("path, body, field, message", [
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": True, "response": 1}]},
     "events[0].question_id", "Input should be a valid string or a valid integer"),
    ("/v1/kt/deep_gpcm/events", {"student_id": "s", "events": [{"question_id": "", "response": 1}]},
     "events[0].question_id", "String should have at least 1 character"),
    ("/v1/kt/deep_gpcm/predict", {"student_id": "s", "question_ids": ["1", 2**64]},
     "question_ids[1]", "Input should be less than or equal to 9223372036854775807"),
    ("/v1/sessions/gru4rec/batch", {"sessions": [{"item_ids": [None]}]},
     "sessions[0].item_ids[0]", "Input should be a valid string or a valid integer"),
    ("/v1/srs/time_aware/predict", {"user_id": "u", "card_id": "c", "deck_id": 1.5},
     "deck_id", "Input should be a valid string or a valid integer"),
])
def test_an_id_of_either_type_fails_as_one_error_on_its_own_field(demo, path, body, field, message):
    url, _, _ = demo
    reply = httpx.post(url + path, json=body)
    problem = reply.json()
    assert reply.status_code == 422 and problem["field"] == field, reply.text
    assert problem["errors"] == [{"field": field, "message": message, "type": problem["errors"][0]["type"]}]
    assert problem["detail"] == f"{field}: {message}"


def test_every_faulty_field_is_listed_once_and_unknown_keys_keep_their_names(demo):
    url, _, _ = demo
    reply = httpx.post(url + "/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": [
        {"card_id": [], "deck_id": {}, "time": 1.0, "rating": 0, "int": 1, "constrained-str": 2}]})
    fields = [e["field"] for e in reply.json()["errors"]]
    assert reply.status_code == 422 and fields == ["reviews[0].int", "reviews[0].constrained-str", "reviews[0].card_id",
                                                   "reviews[0].deck_id", "reviews[0].rating"], reply.text


@pytest.mark.parametrize("text, escape, column", [
    (r'{"student_id": "\ud800", "question_ids": [1]}', r"\ud800", 17),
    (r'{"student_id": "ok", "question_ids": ["\udc00"]}', r"\udc00", 40),
    (r'{"student_id": "ab\ud800\u0041", "question_ids": [1]}', r"\ud800", 19),
    ('{"student_id": "s",\n "question_ids": ["\\ud83d\\ude00", "\\udbff\\n"]}', r"\udbff", 36),
])
def test_a_lone_surrogate_in_the_json_is_named_with_where_it_is(demo, text, escape, column):
    url, _, _ = demo
    reply = httpx.post(url + "/v1/kt/deep_gpcm/predict", content=text, headers={"content-type": "application/json"})
    problem = reply.json()
    assert reply.status_code == 422 and problem["field"] == "body", reply.text
    line = text.count("\n") + 1
    assert f"lone surrogate {escape} at line {line}, column {column}" in problem["detail"], problem["detail"]
    assert "hex escape" not in problem["detail"]


def test_a_surrogate_pair_and_an_escaped_backslash_are_fine(demo):
    url, question, _ = demo
    for student in (r"\ud83d\ude00", r"\\ud800"):
        text = f'{{"student_id": "{student}", "question_ids": ["{question}"]}}'
        reply = httpx.post(url + "/v1/kt/deep_gpcm/predict", content=text, headers={"content-type": "application/json"})
        assert reply.status_code == 200, reply.text


@pytest.mark.parametrize("method, path", [
    ("POST", "/v1/sessions/a%2Fb/events"), ("POST", "/v1/sessions/gru4rec%2Fx/recommend"),
    ("GET", "/v1/sessions/a%2fb/v"), ("DELETE", "/v1/sessions/a%2Fb/v"),
    ("POST", "/v1/kt/a%2Fb/events"), ("POST", "/v1/kt/a%2Fstudents/events"), ("GET", "/v1/kt/a%2Fb/students/s"),
    ("POST", "/v1/srs/a%2Fb/reviews"), ("POST", "/v1/srs/a%2Fusers/x"), ("GET", "/v1/models/a%2Fb/ids"),
])
def test_a_model_name_with_an_encoded_slash_is_an_unknown_model(demo, method, path):
    url, _, _ = demo
    reply = httpx.request(method, url + path, json={} if method == "POST" else None)
    problem = reply.json()
    assert reply.status_code == 404 and problem["field"] == "model", reply.text
    assert problem["type"] == "urn:nextstep:problem:unknown-model" and "'/'" in problem["detail"], problem


def test_an_encoded_slash_in_an_entity_id_is_still_the_id(demo):
    url, _, _ = demo
    with httpx.Client(base_url=url) as http:
        for path in ("/v1/sessions/gru4rec/org%2F42", "/v1/kt/deep_gpcm/students/org%2F42",
                     "/v1/srs/time_aware/users/org%2F42"):
            reply = http.get(path)
            assert reply.status_code == 200 and reply.json()["exists"] is False, (path, reply.text)
