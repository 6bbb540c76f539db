"""What a client may get wrong in a request, on every task, answered as a 4xx that says what and where (issue 36):
times ahead of the server's clock. On the bundled demo models (one per task)."""

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
