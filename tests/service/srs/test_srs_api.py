"""Spaced repetition end to end: real HTTP into the app, real ONNX Runtime on an exported time-aware model
(the bundled demo model; in the slow tier also the demo trained again, with its eager model), real Redis (or the
in-process store)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import shutil
import time
from pathlib import Path

import httpx
import hypothesis
import numpy as np
import onnxruntime as ort
import pytest
import redis.asyncio as aioredis
import schemathesis
import torch

from nextstep.demo import BUNDLED
from nextstep.service.redis_store import RedisStore
from nextstep.service.registry import load_artifact
from nextstep.service.settings import Settings
from nextstep.service.srs.stored import HEADER, ROW, id_hash
from nextstep.srs.review_window import select
from nextstep.training.export import load_weights
from nextstep.training.srs.reviews import ReviewLog
from nextstep.training.srs.time_aware_export import INPUTS, restore_time_aware
from nextstep.training.srs.time_aware_loop import ReviewTensors, predict
from tests.service.conftest import ODD_IDS, encoded

SIZE, CARD_SIZE = 32, 4  # small windows, so a few hundred reviews exercise the card-history rule
T0 = 1_767_225_600.0  # 2026-01-01 UTC
DAY = 86400.0


def review_log(seed: int, n: int = 300, n_cards: int = 40, days: float = 60.0) -> list[dict]:
    """One user's reviews as the API takes them: 40 cards in 3 decks over `days` days, in time order; the
    rating follows a forgetting curve (recall 0.5 ** (days / half-life), the half-life growing 2.5x with each
    recall and halving with each lapse), so that even a briefly trained model predicts recall that falls
    with time. Some durations and states are unknown (null)."""
    rng = np.random.default_rng(seed)
    times = np.sort(T0 + rng.uniform(0, days * DAY, n))
    stability, last, last_rating = np.full(n_cards, 2.0), np.full(n_cards, np.nan), {}
    out = []
    for i, t in enumerate(times):
        c = int(rng.integers(n_cards))
        first = np.isnan(last[c])
        p = 0.7 if first else 0.5 ** ((t - last[c]) / DAY / stability[c])
        rating = int(rng.integers(2, 5)) if rng.random() < p else 1
        stability[c] = stability[c] * 2.5 if rating > 1 else max(0.5, stability[c] / 2)
        state = 0 if first else (3 if last_rating.get(c) == 1 else 2)  # the card's state before this review
        last[c], last_rating[c] = t, rating
        review = {"card_id": f"card-{c}", "deck_id": f"deck-{c % 3}", "time": float(t), "rating": rating,
                  "event_id": f"r-{seed}-{i}"}
        if i % 7:
            review["duration"] = float(np.round(rng.lognormal(1.8, 0.5), 3))
        if i % 5:
            review["state"] = state
        out.append(review)
    return out


def as_log(reviews: list[dict], query: dict | None = None) -> ReviewLog:
    """The reviews (and a query appended as one more row: its outcome is never read) as a one-user ReviewLog
    with the service's integer coding of card and deck ids."""
    rows = reviews + ([{**query, "rating": 1}] if query else [])
    return ReviewLog(
        ["u"], np.array([0, len(rows)]), np.array([id_hash(r["card_id"]) for r in rows], dtype=np.int64),
        np.array([id_hash(r.get("deck_id", "")) for r in rows], dtype=np.int64),
        np.array([r["time"] for r in rows], dtype=np.float64), np.array([r["rating"] for r in rows], dtype=np.int64),
        np.array([np.nan if r.get("duration") is None else r["duration"] for r in rows], dtype=np.float32),
        np.array([-1 if r.get("state") is None else r["state"] for r in rows], dtype=np.int64),
        np.full(len(rows), -1, dtype=np.int64))


def as_version_1(artifact: Path, root: Path) -> Path:
    """`root`, an artifacts dir holding a copy of a demo time-aware `artifact` as time_aware/1."""
    shutil.copytree(artifact, root / "time_aware" / "1")
    path = root / "time_aware" / "1" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert manifest["window"] == {"size": SIZE, "card_size": CARD_SIZE}, "the demo's windows are this file's"
    path.write_text(json.dumps({**manifest, "version": "1"}))
    return root


@pytest.fixture(scope="session")
def srs_art(tmp_path_factory) -> Path:
    """An artifacts dir with time_aware/1: the bundled demo model (`make demo-artifacts` trains it on a simulated
    log), which has this file's window sizes and layer sizes; no training or export here."""
    return as_version_1(BUNDLED / "time_aware" / "demo", tmp_path_factory.mktemp("srs-demo"))


@pytest.fixture(scope="session")
def srs_model(demo_rebuilt, tmp_path_factory):
    """(artifacts dir with time_aware/1, the PyTorch model): the demo's time-aware model trained again from scratch
    (shared with tests/service/test_demo_served.py's rebuild: the whole artifact, exported through the real exporter,
    which checks parity, and its weights)."""
    root = as_version_1(demo_rebuilt / "work" / "artifacts" / "time_aware", tmp_path_factory.mktemp("srs-trained"))
    model, _ = load_weights(root / "time_aware" / "1", restore_time_aware)
    return root, model


def post_all(http: httpx.Client, user: str, reviews: list[dict], chunk: int) -> list[dict]:
    replies = []
    for lo in range(0, len(reviews), chunk):
        reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": user, "reviews": reviews[lo:lo + chunk]})
        assert reply.status_code == 200, reply.text
        replies.append(reply.json())
    return replies


@functools.cache
def onnx_session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _window(log, reviews: list[dict], n: int, card: str, errors: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """The window (hist_* rows, unpadded) review_window.select picks after reviews[:n] for a query on `card`, each
    row with its FSRS-6 error from `errors`."""
    card_seq = np.array([i for i, r in enumerate(reviews[:n]) if r["card_id"] == card], dtype=np.int64)
    seqs = select(card_seq, n, SIZE, CARD_SIZE)
    if len(seqs):
        return [log.card[seqs], log.deck[seqs], log.time[seqs], log.rating[seqs], log.duration[seqs],
                log.state[seqs], np.ones(len(seqs), dtype=bool), errors[seqs].astype(np.float32)], seqs
    return [np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1), np.ones(1, np.int64),  # one padding row
            np.zeros(1, np.float32), np.full(1, -1, np.int64), np.zeros(1, dtype=bool),
            np.full(1, np.nan, np.float32)], seqs


def _run(art: Path, hist: list[np.ndarray], drift, card: str, deck: str, times: np.ndarray,
         params=None, day_start: float | None = None, evidence: float | None = None) -> list[np.ndarray]:
    """The predict graph on one window for queries at `times`, with the user's FSRS-6 parameters, day boundary and
    evidence (default: the manifest's, which a user starts with): its outputs by name."""
    b = len(times)
    manifest = json.loads((art / "time_aware" / "1" / "manifest.json").read_text())
    if params is None:
        params = manifest["fsrs6"]["parameters"]
    if day_start is None:  # a user without their own: the model's
        day_start = manifest["model_config"]["day_start_hour"] * 3600.0
    if evidence is None:
        evidence = manifest["evidence"]["prior"]
    feeds = [np.repeat(h[None], b, axis=0) for h in hist] + [np.tile(np.float32(drift), (b, 1)),
                                                             np.tile(np.float32(params), (b, 1)),
                                                             np.full(b, day_start), np.full(b, np.float32(evidence)),
                                                             np.full(b, id_hash(card)), np.full(b, id_hash(deck)),
                                                             times]
    session = onnx_session(art / "time_aware" / "1" / "predict.onnx")
    outs = session.run(None, dict(zip(INPUTS, feeds, strict=True)))
    return dict(zip((o.name for o in session.get_outputs()), outs, strict=True))


def onnx_drift(art: Path, reviews: list[dict], day_start: float | None = None
               ) -> tuple[list[float], np.ndarray, float]:
    """(the drift sums after `reviews`, each review's FSRS-6 error, the evidence after them), stepped here: the graph
    answers each review from its window before it, and FSRS-6's error on it (rating > 1 minus fsrs_recall) is the
    review's error, and is added to the sums, when it is scored (NaN otherwise); so is the defaults' log loss minus
    the network's to the evidence. Stepped once per log (one graph call per review): the queries on one log share
    it."""
    drift, errors, evidence = _onnx_drift(art, json.dumps(reviews), day_start)
    return list(drift), errors.copy(), evidence


def _loss(p: float, recalled: bool) -> float:
    p = min(max(float(p), 1e-6), 1 - 1e-6)
    return -np.log(p) if recalled else -np.log1p(-p)


@functools.cache
def _onnx_drift(art: Path, reviews_json: str, day_start: float | None
                ) -> tuple[tuple[float, float], np.ndarray, float]:
    reviews = json.loads(reviews_json)
    manifest = json.loads((art / "time_aware" / "1" / "manifest.json").read_text())
    a = 0.5 ** (1 / manifest["drift"]["halflife_scored_reviews"])
    b = 0.5 ** (1 / manifest["evidence"]["halflife_scored_reviews"])
    log, m, w, evidence = as_log(reviews), 0.0, 0.0, manifest["evidence"]["prior"]
    errors = np.full(len(reviews), np.nan)
    for i, r in enumerate(reviews):
        hist, _ = _window(log, reviews, i, r["card_id"], errors)
        out = _run(art, hist, [m, w], r["card_id"], r.get("deck_id", ""), np.array([r["time"]]), day_start=day_start,
                   evidence=evidence)
        if out["scored"][0]:
            y = r["rating"] > 1
            errors[i] = float(y) - float(out["fsrs_recall"][0])
            m, w = a * m + errors[i], a * w + 1
            evidence = b * evidence + _loss(out["default_recall"][0], y) - _loss(out["network_recall"][0], y)
    return (m, w), errors, evidence


def offline_onnx(art: Path, reviews: list[dict], card: str, deck: str, at,
                 day_start: float | None = None) -> tuple[dict, np.ndarray]:
    """The exported graph on the window review_window.select picks from the raw log (no padding), with the drift
    stepped over the log (onnx_drift), for a query at `at` (a time, or an array of times: one row each), for a user
    whose days start `day_start` seconds after 00:00 UTC (None: the model's)."""
    drift, errors, evidence = onnx_drift(art, reviews, day_start)
    hist, seqs = _window(as_log(reviews), reviews, len(reviews), card, errors)
    out = _run(art, hist, drift, card, deck, np.atleast_1d(np.asarray(at, dtype=np.float64)), day_start=day_start,
               evidence=evidence)
    probs, recall, duration = out["rating_probs"], out["recall"], out["duration_s"]
    if np.ndim(at) == 0:
        probs, recall, duration = probs[0], recall[0], duration[0]
    return {"probs": probs, "recall": recall, "duration": duration}, seqs


def offline_eager(model, reviews: list[dict], card: str, deck: str, at: float) -> dict:
    """The PyTorch model through the training code's own windows and drift (ReviewTensors: user_windows,
    set_drift), the query appended to the log as its last review."""
    log = as_log(reviews, {"card_id": card, "deck_id": deck, "time": at})
    rt = ReviewTensors(log, SIZE, CARD_SIZE)
    rt.set_drift(model)
    rt.set_evidence(model)
    out = predict(model, rt, np.array([len(reviews)]))
    return {"probs": out["rating_probs"][0], "recall": out["recall"][0], "duration": out["duration_s"][0]}


def check_answer(got: dict, want: dict, atol: float = 1e-5) -> None:
    np.testing.assert_allclose([got["p_rating"][k] for k in "1234"], want["probs"], atol=atol)
    np.testing.assert_allclose(got["p_recall"], want["recall"], atol=atol)
    np.testing.assert_allclose(got["expected_duration_s"], want["duration"], atol=atol, rtol=1e-5)


@pytest.fixture(params=["demo", pytest.param("trained", marks=pytest.mark.slow)])
def served_model(request) -> tuple[Path, torch.nn.Module | None]:
    """(artifacts dir, the PyTorch model or None): the bundled demo artifact (graphs only), and in the slow tier the
    same recipe trained and exported again, whose eager model the answers are held to as well."""
    if request.param == "demo":
        return request.getfixturevalue("srs_art"), None
    return request.getfixturevalue("srs_model")


def test_served_predictions_equal_the_offline_model(served_model, store_url, serve):
    art, model = served_model
    reviews = review_log(7)
    last = reviews[-1]["time"]
    counts = {}
    for r in reviews:
        counts[r["card_id"]] = counts.get(r["card_id"], 0) + 1
    often = max(counts, key=counts.get)
    stale = next(r["card_id"] for r in reviews if counts[r["card_id"]] > CARD_SIZE
                 and all(x["card_id"] != r["card_id"] for x in reviews[-SIZE:]))
    queries = [(often, "deck-x", last), (often, "deck-0", last + 3 * DAY),
               (stale, "deck-1", last + 600.0), (stale, "deck-2", last + 40 * DAY), ("card-new", "deck-0", last + 1),
               ("card-new", "", last + 10 * DAY), (reviews[-1]["card_id"], reviews[-1]["deck_id"], last)]
    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, httpx.Client(base_url=url, timeout=60) as http:
        replies = post_all(http, "learner", reviews, 64)
        assert [r["applied"] for r in replies] == [64, 64, 64, 64, 44] and replies[-1]["reviews_total"] == 300
        older_rows_used = False
        for card, deck, at in queries:
            reply = http.post("/v1/srs/time_aware/predict", json={"user_id": "learner", "card_id": card,
                                                                   "deck_id": deck, "time": at})
            assert reply.status_code == 200, reply.text
            got = reply.json()
            want, seqs = offline_onnx(art, reviews, card, deck, at)
            check_answer(got, want)
            if model is not None:
                check_answer(got, offline_eager(model, reviews, card, deck, at))
            assert got["history_used"] == len(seqs) and got["reviews_total"] == 300
            assert got["card_reviews"] == sum(reviews[s]["card_id"] == card for s in seqs)
            assert abs(sum(got["p_rating"].values()) - 1) < 1e-5
            older_rows_used |= bool(len(seqs)) and int(seqs[0]) < len(reviews) - SIZE
        assert older_rows_used, "no query used the card's rows from before the recent block"
        # every prediction (the queries, each review's FSRS-6 error) ran predict_memory, each card's FSRS-6 memory
        # from fsrs-rs (any for a new card, which the graph does not read): equal to predict.onnx run offline, above
        calls = {}
        for line in http.get("/metrics").text.splitlines():
            if line.startswith("nextstep_microbatch_rows_count{") and 'model="time_aware"' in line:
                calls[line.split('graph="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
        assert calls.get("predict_memory", 0) >= 5 + 5 and "predict" not in calls, calls
        manifest = json.loads((art / "time_aware" / "1" / "manifest.json").read_text())
        (_, weight), errors, evidence = onnx_drift(art, reviews)
        assert weight > 1 and manifest["drift"]["gain"] > 0  # the drift was in play
        assert abs(evidence - manifest["evidence"]["prior"]) > 0.1  # and the evidence, which the user's summary shows
        summary = http.get("/v1/srs/time_aware/users/learner").json()["evidence"]
        assert summary["nats"] == pytest.approx(evidence, abs=1e-4)
        assert summary["network_weight"] == pytest.approx(1 / (1 + np.exp(-evidence)), abs=1e-5)
        assert manifest["drift"]["deck_gain"] > 0 and np.isfinite(errors).sum() > 10  # and the deck's
        # an unknown user: an empty window, the model's prior
        fresh = http.post("/v1/srs/time_aware/predict", json={"user_id": "nobody", "card_id": "c", "time": T0}).json()
        check_answer(fresh, offline_onnx(art, [], "c", "", T0)[0])
        assert fresh["history_used"] == 0 and fresh["reviews_total"] == 0
        # the prediction asked with the reviews is the one /predict gives afterwards
        more = review_log(8, n=5, days=0.5)
        for r in more:  # after the others, and ahead of the clock by less than NEXTSTEP_MAX_CLOCK_SKEW_SECONDS
            r["time"] += time.time() + 3600 - T0
        both = http.post("/v1/srs/time_aware/reviews", json={
            "user_id": "learner", "reviews": more, "predict": {"card_id": stale, "deck_id": "deck-1"}}).json()
        assert both["applied"] == 5 and both["reviews_total"] == 305
        assert both["prediction"]["time"] == more[-1]["time"]  # no time given, the clock is behind: the last review
        check_answer(both["prediction"], offline_onnx(art, reviews + more, stale, "deck-1", more[-1]["time"])[0])
        summary = http.get("/v1/srs/time_aware/users/learner").json()
        assert summary["reviews_total"] == 305 and summary["last_review_time"] == more[-1]["time"]
        assert summary["cards"] == len({r["card_id"] for r in reviews + more}) and summary["exists"]
        assert http.delete("/v1/srs/time_aware/users/learner").json()["deleted"] is True
        assert http.get("/v1/srs/time_aware/users/learner").json()["exists"] is False
        assert http.delete("/v1/srs/time_aware/users/learner").json()["deleted"] is False


def test_each_user_has_their_own_day_boundary(srs_art, store_url, serve):
    """FSRS-6 counts a user's scheduler days. The same reviews for a user told (with their reviews) that their days
    start at 00:00 UTC and for one never told (the model's 04:00 UTC): a review between midnight and 4 am of a card
    seen the evening before is scored for the first only, and each user's answers are the graph's with their own
    boundary, which stays through later writes that do not mention it."""
    reviews = review_log(9, n=120)
    night = [i for i, r in enumerate(reviews) if (r["time"] % DAY) < 4 * 3600]
    assert night, "no review between midnight and 4 am UTC"
    card, deck = reviews[-1]["card_id"], reviews[-1]["deck_id"]
    at = reviews[-1]["time"] + 2.5 * DAY
    with serve(Settings(artifacts_dir=srs_art, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=60) as http:
        first = {"user_id": "east", "reviews": reviews[:60], "day_start_hour_utc": 0}
        assert http.post("/v1/srs/time_aware/reviews", json=first).status_code == 200
        post_all(http, "east", reviews[60:], 60)  # (not told again)
        post_all(http, "plain", reviews, 60)
        east, plain = (http.get(f"/v1/srs/time_aware/users/{u}").json()["parameters"] for u in ("east", "plain"))
        assert (east["day_start_hour_utc"], east["day_start_told"]) == (0.0, True)
        assert (plain["day_start_hour_utc"], plain["day_start_told"]) == (4.0, False)
        assert east["scored_reviews"] != plain["scored_reviews"]
        answers = {}
        for user, start in (("east", 0.0), ("plain", None)):
            got = http.post("/v1/srs/time_aware/predict", json={"user_id": user, "card_id": card, "deck_id": deck,
                                                                "time": at}).json()
            check_answer(got, offline_onnx(srs_art, reviews, card, deck, at, start)[0])
            answers[user] = got["p_recall"]
        assert answers["east"] != answers["plain"]
        bad = http.post("/v1/srs/time_aware/reviews", json={**first, "user_id": "x", "day_start_hour_utc": 24})
        assert bad.status_code == 422 and "day_start_hour_utc" in bad.text
        assert http.get("/v1/srs/time_aware/users/x").json()["exists"] is False


def test_an_artifact_without_predict_memory_answers_the_same_through_predict(srs_art, store_url, serve, tmp_path):
    """An artifact exported before `predict_memory` (the graph that takes the card's FSRS-6 memory from fsrs-rs)
    is served through `predict` alone, with the same answers, for cards seen and new."""
    old = tmp_path / "time_aware" / "1"
    shutil.copytree(srs_art / "time_aware" / "1", old)
    manifest = json.loads((old / "manifest.json").read_text())
    del manifest["graphs"]["predict_memory"]
    (old / "predict_memory.onnx").unlink()
    (old / "manifest.json").write_text(json.dumps(manifest))
    reviews = review_log(12, n=150)
    queries = [(reviews[-1]["card_id"], reviews[-1]["time"] + 2 * DAY), (reviews[3]["card_id"], reviews[-1]["time"]),
               ("card-new", reviews[-1]["time"] + DAY)]
    answers = {}
    for art in (srs_art, tmp_path):
        with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, \
                httpx.Client(base_url=url, timeout=60) as http:
            user = f"u-{art.name}"
            post_all(http, user, reviews, 75)
            answers[art] = [http.post("/v1/srs/time_aware/predict", json={
                "user_id": user, "card_id": card, "deck_id": "deck-0", "time": at}).json() for card, at in queries]
            graphs = {line.split('graph="')[1].split('"')[0] for line in http.get("/metrics").text.splitlines()
                      if line.startswith("nextstep_microbatch_rows_count{")}
            assert ("predict_memory" in graphs) == (art == srs_art), graphs
    for new, was in zip(answers[srs_art], answers[tmp_path], strict=True):
        check_answer(new, {"probs": [was["p_rating"][k] for k in "1234"], "recall": was["p_recall"],
                           "duration": was["expected_duration_s"]}, atol=1e-6)


def test_one_by_one_equals_one_batch_and_replays_apply_once(srs_art, store_url, serve):
    art = srs_art
    reviews = review_log(11, n=120)
    queries = [(f"card-{c}", f"deck-{c % 3}", reviews[-1]["time"] + dt) for c, dt in ((1, 0), (5, DAY), (39, 9 * DAY))]

    def answers(http, user):
        return [http.post("/v1/srs/time_aware/predict", json={"user_id": user, "card_id": c, "deck_id": d,
                                                               "time": t}).json() for c, d, t in queries]

    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, httpx.Client(base_url=url) as http:
        singles = post_all(http, "one-by-one", reviews, 1)
        assert all(r["applied"] == 1 for r in singles) and singles[-1]["reviews_total"] == 120
        batch = post_all(http, "batch", reviews, 120)[0]
        assert batch["applied"] == 120 and batch["replayed"] == 0 and batch["state_version"] == 1
        one, whole = (http.get(f"/v1/srs/time_aware/users/{u}").json() for u in ("one-by-one", "batch"))
        for k in ("reviews_total", "last_review_time", "cards"):
            assert one[k] == whole[k]
        for a, b in zip(answers(http, "one-by-one"), answers(http, "batch"), strict=True):
            assert {k: v for k, v in a.items() if k != "user_id"} == {k: v for k, v in b.items() if k != "user_id"}
        # replays: the whole batch again changes nothing; a batch half old, half new applies the new half
        again = post_all(http, "batch", reviews, 120)[0]
        assert (again["applied"], again["replayed"], again["reviews_total"], again["state_version"]) == (0, 120, 120, 1)
        more = review_log(12, n=10, days=1)
        for r in more:
            r["time"] += reviews[-1]["time"] - T0  # (after them, and not ahead of the clock)
        mixed = post_all(http, "batch", reviews[-10:] + more, 20)[0]
        assert (mixed["applied"], mixed["replayed"], mixed["reviews_total"]) == (10, 10, 130)
        # an id repeated within one request is one review
        dup = http.post("/v1/srs/time_aware/reviews", json={"user_id": "dup", "reviews": [reviews[0], reviews[0]]})
        assert (dup.json()["applied"], dup.json()["replayed"]) == (1, 1)


def test_recall_falls_with_time_and_the_schedule_inverts_it(srs_art, store_url, serve):
    """The exported model's recall for every card, on the window the service uses, never rises with the time
    since the card's last review (1 minute to 10 years); /schedule answers in one call: at each scheduled due
    an independent /predict gives the desired retention, every earlier moment more; due_now and beyond_horizon
    where the curve says so; a card never reviewed is new, due now; and a lower retention never schedules earlier."""
    art = srs_art
    reviews = review_log(21)
    now = reviews[-1]["time"] + 3600
    cards = [{"card_id": f"card-{c}", "deck_id": f"deck-{c % 3}"} for c in range(0, 40, 4)] + \
        [{"card_id": "never-seen", "deck_id": "deck-0"}]
    horizon = 3650 * DAY
    offsets = np.concatenate([[0.0], np.geomspace(60.0, horizon, 64)])
    curves = np.array([offline_onnx(art, reviews, c["card_id"], c["deck_id"], now + offsets)[0]["recall"]
                       for c in cards])
    assert (np.diff(curves, axis=1) <= 1e-6).all(), "recall rises again somewhere"
    assert (curves[:-1, 0] - curves[:-1, -1] > 0.02).all(), "the test model's recall hardly changes with time"
    assert np.ptp(curves[-1]) < 1e-6  # a card never reviewed: no curve, no time
    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, httpx.Client(base_url=url) as http:
        post_all(http, "u", reviews, 100)

        def predict(card, at):
            reply = http.post("/v1/srs/time_aware/predict", json={"user_id": "u", **card, "time": at})
            assert reply.status_code == 200, reply.text
            return reply.json()

        def schedule(retention, **extra):
            body = {"user_id": "u", "cards": cards, "now": now, "desired_retention": retention}
            reply = http.post("/v1/srs/time_aware/schedule", json={**body, **extra})
            assert reply.status_code == 200, reply.text
            got = reply.json()
            assert got["now"] == now and [c["card_id"] for c in got["cards"]] == [c["card_id"] for c in cards]
            return got["cards"]

        dues = {}
        for retention in (0.97, 0.9, 0.8, 0.6, float(np.median(curves[:-1, 0]))):
            dues[retention] = got = schedule(retention)
            for i, due in enumerate(got):
                curve = curves[i]
                at_due = predict(cards[i], due["due"])
                assert abs(at_due["p_recall"] - due["p_recall_at_due"]) < 1e-5
                assert abs(at_due["expected_duration_s"] - due["expected_duration_s"]) < 1e-3
                if i == len(cards) - 1:  # never reviewed: new (issue 38), due now
                    assert due["status"] == "new" and due["due"] == now, (i, due, retention)
                elif curve[0] <= retention:
                    assert due["status"] == "due_now" and due["due"] == now, (i, due, retention)
                elif curve[-1] > retention:
                    assert due["status"] == "beyond_horizon", (i, due, retention)
                else:
                    assert due["status"] == "scheduled" and now < due["due"], (i, due, retention)
                    # the first moment at or below the retention (the curve steps down at day boundaries,
                    # where FSRS-6's whole days tick over, so it may land below it), found to the schedule
                    # grid's resolution (about 5e-7 of the time since the card's last review)
                    margin = 1e-5 * (due["due"] - reviews[0]["time"])
                    assert at_due["p_recall"] <= retention + 1e-5, (i, due, retention)
                    assert predict(cards[i], due["due"] - margin)["p_recall"] > retention - 1e-5, (i, due, retention)
                    assert (curve[offsets < due["due"] - now - 1] > retention).all()
        order = sorted(dues)  # lower retention: never earlier
        for lower, higher in zip(order, order[1:], strict=False):
            assert all(a["due"] >= b["due"] - 1e-3 for a, b in zip(dues[lower], dues[higher], strict=True)), \
                       (lower, higher)
        assert {d["status"] for d in dues[0.6]} >= {"due_now", "scheduled"}
        # beyond a short horizon: the recall and answer time there
        low = schedule(0.001, horizon_days=0.01)[1]
        assert low["status"] == "beyond_horizon" and low["due"] == pytest.approx(now + 864.0)
        assert low["p_recall_at_due"] == pytest.approx(predict(cards[1], now + 864.0)["p_recall"], abs=1e-5)
        # no `now`: the current time
        before = time.time()
        default = http.post("/v1/srs/time_aware/schedule", json={"user_id": "u", "cards": [cards[1]],
                                                                 "desired_retention": 0.9}).json()
        assert before <= default["now"] <= time.time()


BAD = [
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 5}]}, 422, "rating"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 0}]}, 422, "rating"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": "3"}]}, 422, "rating"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0 * 1000, "rating": 3}]}, 422, "seconds"),
    ("reviews", {"reviews": [{"card_id": "c", "time": -1, "rating": 3}]}, 422, "time"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 3}, {"card_id": "c", "time": T0 - 1, "rating": 3}]},
     422, "reviews[1].time"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0 - DAY, "rating": 3}]}, 422, "reviews[0].time"),
    ("reviews", {"reviews": [{"card_id": "", "time": T0, "rating": 3}]}, 422, "card_id"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 3, "duration": -2}]}, 422, "duration"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 3, "state": 4}]}, 422, "state"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 3, "grade": 3}]}, 422, "grade"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0, "rating": 3}] * 6}, 413, "reviews"),
    ("reviews", {"reviews": []}, 422, "reviews"),
    ("reviews", {"reviews": [{"card_id": "c", "time": T0 + 5, "rating": 3}], "predict": {"card_id": "c", "time": T0}},
     422, "predict.time"),
    ("predict", {"card_id": "c", "time": T0 - 1}, 422, "time"),
    ("predict", {"card_id": "", "time": T0}, 422, "card_id"),
    ("predict", {"card_id": "c", "time": 1.7e12}, 422, "seconds"),
    ("schedule", {"cards": [{"card_id": "c"}], "desired_retention": 1.5}, 422, "desired_retention"),
    ("schedule", {"cards": [{"card_id": "c"}], "desired_retention": 0}, 422, "desired_retention"),
    ("schedule", {"cards": [{"card_id": "c"}], "desired_retention": 0.9, "now": T0 - 1}, 422, "now"),
    ("schedule", {"cards": [{"card_id": "c"}], "desired_retention": 0.9, "horizon_days": 0}, 422, "horizon_days"),
    ("schedule", {"cards": [], "desired_retention": 0.9}, 422, "cards"),
    ("schedule", {"cards": [{"card_id": "c"}] * 4, "desired_retention": 0.9}, 413, "cards"),
]


def test_bad_input_is_a_4xx_naming_the_field_and_changes_nothing(srs_art, serve):
    art = srs_art
    settings = Settings(artifacts_dir=art, max_events=5, srs_max_schedule_cards=3)
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        seed = {"user_id": "u", "reviews": [{"card_id": "c", "time": T0, "rating": 3}]}
        assert http.post("/v1/srs/time_aware/reviews", json=seed).status_code == 200
        before = http.get("/v1/srs/time_aware/users/u").json()
        for path, body, status, field in BAD:
            reply = http.post(f"/v1/srs/time_aware/{path}", json={"user_id": "u", **body})
            assert reply.status_code == status, (path, body, reply.text)
            assert field in reply.text, (path, body, reply.text)
        # NaN and Infinity (JSON literals Python accepts) are a 422 naming the field, not a 500
        for path, raw, field in (
                ("reviews", '{"user_id":"u","reviews":[{"card_id":"c","time":NaN,"rating":3}]}', "time"),
                ("reviews", '{"user_id":"u","reviews":[{"card_id":"c","time":1e9,"rating":3,"duration":Infinity}]}',
                 "duration"),
                ("predict", '{"user_id":"u","card_id":"c","time":-Infinity}', "time"),
                ("schedule", '{"user_id":"u","cards":[{"card_id":"c"}],"desired_retention":NaN}',
                 "desired_retention")):
            reply = http.post(f"/v1/srs/time_aware/{path}", content=raw, headers={"content-type": "application/json"})
            assert reply.status_code == 422 and field in reply.text, (path, raw, reply.text)
        huge = {"user_id": "u", "card_id": 10**4000}
        assert http.post("/v1/srs/time_aware/predict", json=huge).status_code == 422
        assert http.get("/v1/srs/time_aware/users/u").json() == before
        assert http.post("/v1/srs/time_aware/predict", json={"user_id": "", "card_id": "c"}).status_code == 422
        assert http.get("/v1/srs/time_aware/users/" + "x" * 201).status_code == 422
        missing = http.post("/v1/srs/nope/predict", json={"user_id": "u", "card_id": "c"})
        assert missing.status_code == 404 and "time_aware" in missing.json()["detail"]
        # an srs model is not a knowledge-tracing one
        assert http.post("/v1/kt/time_aware/predict", json={"student_id": "u", "question_ids": [1]}).status_code == 404
        models = {m["name"]: m for m in http.get("/v1/models").json()["models"]}
        assert models["time_aware"]["task"] == "srs"
        assert models["time_aware"]["window"] == {"size": SIZE, "card_size": CARD_SIZE}


def test_a_knowledge_tracing_model_is_not_served_on_the_srs_routes(srs_art, artifacts, tmp_path, serve):
    art = srs_art
    kt_art, _ = artifacts
    both = tmp_path / "artifacts"
    shutil.copytree(art / "time_aware", both / "time_aware")
    shutil.copytree(kt_art / "deep_gpcm", both / "deep_gpcm")
    with serve(Settings(artifacts_dir=both)) as url, httpx.Client(base_url=url) as http:
        for path, body in (("predict", {"user_id": "u", "card_id": "3"}),
                           ("reviews", {"user_id": "u", "reviews": [{"card_id": "3", "time": T0, "rating": 2}]}),
                           ("schedule", {"user_id": "u", "cards": [{"card_id": "3"}], "desired_retention": 0.9})):
            reply = http.post(f"/v1/srs/deep_gpcm/{path}", json=body)
            assert reply.status_code == 404 and "knowledge_tracing" in reply.json()["detail"], reply.text
        assert http.get("/v1/srs/deep_gpcm/users/u").status_code == 404
        assert http.post("/v1/srs/time_aware/predict", json={"user_id": "u", "card_id": "3"}).status_code == 200


def test_state_survives_a_restart_and_expires_after_two_idle_years_by_default(srs_art, redis_url, serve):
    art = srs_art
    reviews = review_log(31, n=80)
    query = {"user_id": "kept", "card_id": "card-3", "deck_id": "deck-0", "time": reviews[-1]["time"] + DAY}
    settings = Settings(artifacts_dir=art, redis_url=redis_url)
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        post_all(http, "kept", reviews, 30)
        before = http.post("/v1/srs/time_aware/predict", json=query).json()
    with serve(settings) as url, httpx.Client(base_url=url) as http:  # nothing in memory: all from Redis
        after = http.post("/v1/srs/time_aware/predict", json=query).json()
        assert after == before and after["reviews_total"] == 80

    async def ttls(pattern: str) -> dict:
        raw = aioredis.Redis.from_url(redis_url)
        try:
            return {k.decode(): await raw.pttl(k) async for k in raw.scan_iter(pattern)}
        finally:
            await raw.aclose()

    keys = asyncio.run(ttls("*srs:time_aware:*"))
    assert {k.rsplit("}", 1)[1] for k in keys} == {"", ":fields", ":order", ":seen"}
    two_years = 730 * 86400 * 1000
    assert all(two_years - 120_000 < ttl <= two_years for ttl in keys.values()), keys  # every key, on each write
    with serve(Settings(artifacts_dir=art, redis_url=redis_url, srs_ttl_seconds=60)) as url:
        httpx.post(f"{url}/v1/srs/time_aware/reviews", json={"user_id": "kept", "reviews": [
            {"card_id": "card-1", "time": reviews[-1]["time"] + 1, "rating": 3}]}).raise_for_status()
    assert all(50_000 < ttl <= 60_000 for ttl in asyncio.run(ttls("*srs:time_aware:*")).values())
    with serve(Settings(artifacts_dir=art, redis_url=redis_url, srs_ttl_seconds=0)) as url:  # 0: never expire
        httpx.post(f"{url}/v1/srs/time_aware/reviews", json={"user_id": "kept", "reviews": [
            {"card_id": "card-1", "time": reviews[-1]["time"] + 2, "rating": 3}]}).raise_for_status()
    assert set(asyncio.run(ttls("*srs:time_aware:*")).values()) == {-1}


@pytest.mark.slow
def test_concurrent_reviews_are_all_applied_exactly_once(srs_art, store_url, serve):
    """50 clients post reviews for one user at once (with Redis: through two service instances, whose writes
    race on the compare-and-set); then all of them again, as replays."""
    art = srs_art
    clients, per_client = 50, 3
    cards = [(c * 7 + j) % 60 for c in range(clients) for j in range(per_client)]
    total = clients * per_client

    async def drive(urls: list[str], replay: bool) -> None:
        https = [httpx.AsyncClient(base_url=u, timeout=30, limits=httpx.Limits(max_connections=clients))
                 for u in urls]

        async def client(c: int):
            http = https[c % len(https)]
            for j in range(per_client):
                body = {"user_id": "busy", "reviews": [{"card_id": f"card-{cards[c * per_client + j]}",
                                                        "time": T0 + 1.0, "rating": 1 + (c + j) % 4,
                                                        "event_id": f"{c}-{j}"}]}
                reply = await http.post("/v1/srs/time_aware/reviews", json=body)
                assert reply.status_code == 200, reply.text
                assert reply.json()["applied"] == (0 if replay else 1)

        try:
            await asyncio.gather(*(client(c) for c in range(clients)))
        finally:
            for http in https:
                await http.aclose()

    def retries(url: str) -> float:
        text = httpx.get(f"{url}/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith('nextstep_cas_retries_total{model="time_aware"}'))

    settings = Settings(artifacts_dir=art, redis_url=store_url)
    with contextlib.ExitStack() as running:
        urls = [running.enter_context(serve(settings)) for _ in range(2 if store_url else 1)]
        url = urls[0]
        for u in urls:  # one request first: FastAPI builds an app's routes on its first request, and two apps
            httpx.get(f"{u}/v1/srs/time_aware/users/warm-up")  # building the same routers at once warn
        asyncio.run(drive(urls, replay=False))
        first = httpx.get(f"{url}/v1/srs/time_aware/users/busy").json()
        assert first["reviews_total"] == total and first["cards"] == len(set(cards))
        if store_url:
            assert sum(retries(u) for u in urls) > 0, "the two instances never raced"
        asyncio.run(drive(urls, replay=True))
        again = httpx.get(f"{url}/v1/srs/time_aware/users/busy").json()
        assert again["reviews_total"] == total and again["state_version"] == first["state_version"]
    if store_url:  # what is stored: the last SIZE reviews, numbered without gaps, and each card's last rows
        async def stored():
            store = RedisStore(store_url, ttl_seconds=None)
            key = f"srs:time_aware:{load_artifact(art / 'time_aware' / '1').schema}:busy"
            try:
                return await store.read(key, fields=[f"card-{k}" for k in range(60)])
            finally:
                await store.close()

        state, _ = asyncio.run(stored())
        recent = np.frombuffer(state.blob, dtype=ROW, offset=HEADER.itemsize)
        assert recent["seq"].tolist() == list(range(total - SIZE, total))
        seqs = [np.frombuffer(v, dtype=ROW)["seq"] for v in state.fields.values()]
        assert [len(s) for s in seqs] == [min(CARD_SIZE, cards.count(int(k.split("-")[1]))) for k in state.fields]
        assert all((np.diff(s) > 0).all() for s in seqs)
        everything = np.concatenate(seqs)
        assert len(np.unique(everything)) == len(everything) and everything.max() < total


def test_redis_outage_gives_503_and_recovers(srs_art, redis_process, serve):
    art = srs_art
    body = {"user_id": "u", "reviews": [{"card_id": "c", "time": T0, "rating": 3}]}
    with serve(Settings(artifacts_dir=art, redis_url=redis_process.url)) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        redis_process.stop()
        for method, path, payload in (("POST", "/v1/srs/time_aware/reviews", body),
                                      ("POST", "/v1/srs/time_aware/predict", {"user_id": "u", "card_id": "c"}),
                                      ("GET", "/v1/srs/time_aware/users/u", None)):
            reply = http.request(method, path, json=payload)
            assert reply.status_code == 503 and "unavailable" in reply.json()["detail"], (path, reply.text)
        redis_process.start()
        assert http.post("/v1/srs/time_aware/reviews", json=body).json()["applied"] == 1


def test_versions_share_a_users_reviews_unless_the_window_changes(srs_art, tmp_path):
    art = srs_art
    v1 = load_artifact(art / "time_aware" / "1")
    assert v1.task == "srs" and v1.extra.window == (SIZE, CARD_SIZE) and not v1.state_spec and not v1.ids
    shutil.copytree(art / "time_aware" / "1", tmp_path / "time_aware" / "2")
    assert load_artifact(tmp_path / "time_aware" / "2").schema == v1.schema
    manifest = json.loads((tmp_path / "time_aware" / "2" / "manifest.json").read_text())
    manifest["window"]["card_size"] = CARD_SIZE + 1
    (tmp_path / "time_aware" / "2" / "manifest.json").write_text(json.dumps(manifest))
    assert load_artifact(tmp_path / "time_aware" / "2").schema != v1.schema


SCHEMA = schemathesis.openapi.from_path(Path(__file__).resolve().parents[3] / "openapi" / "openapi.json")


@pytest.fixture(scope="module")
def srs_url(srs_art, serve):
    art = srs_art
    with serve(Settings(artifacts_dir=art, max_events=20, srs_max_schedule_cards=5)) as url:
        yield url


@pytest.mark.slow
@SCHEMA.include(path_regex="^/v1/srs/").parametrize()
@hypothesis.settings(max_examples=25, deadline=None, suppress_health_check=list(hypothesis.HealthCheck))
def test_no_server_errors_on_the_srs_routes(case, srs_url):
    """Generated requests (from the committed OpenAPI document) against a real srs model: never a 5xx."""
    if case.path_parameters:
        case.path_parameters["model"] = "time_aware"
    response = case.call(base_url=srs_url, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"





def test_any_user_id_round_trips_through_write_read_and_delete(srs_art, redis_url, serve):
    art = srs_art
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        for n, uid in enumerate(ODD_IDS):
            reviews = [{"card_id": "card/1", "time": T0 + i * DAY, "rating": 3} for i in range(n % 3 + 1)]
            written = http.post("/v1/srs/time_aware/reviews", json={"user_id": uid, "reviews": reviews})
            assert written.status_code == 200 and written.json()["user_id"] == uid, written.text
        assert http.get("/v1/srs/time_aware/users/org/42").json()["reviews_total"] == 1  # a "/" left as it is
        for n, uid in enumerate(ODD_IDS):
            read = http.get(f"/v1/srs/time_aware/users/{encoded(uid)}")
            assert read.status_code == 200, (uid, read.text)
            assert read.json()["user_id"] == uid and read.json()["reviews_total"] == n % 3 + 1, (uid, read.json())
        for uid in ODD_IDS:
            gone = http.delete(f"/v1/srs/time_aware/users/{encoded(uid)}")
            assert gone.status_code == 200 and gone.json() == {"user_id": uid, "deleted": True}, (uid, gone.text)
            assert http.get(f"/v1/srs/time_aware/users/{encoded(uid)}").json()["exists"] is False, uid
        for reply in (http.post("/v1/srs/time_aware/predict", json={"user_id": "x" * 201, "card_id": "c"}),
                      http.get(f"/v1/srs/time_aware/users/{'x' * 201}"),
                      http.delete(f"/v1/srs/time_aware/users/{'x' * 201}")):
            assert reply.status_code == 422 and reply.json()["field"] == "user_id", reply.text
            assert "x" * 201 not in reply.text


def test_a_read_only_replica_gives_503_naming_readonly(srs_art, redis_process, serve):
    """Reviews sent to a replica: 503 naming READONLY, the user's reviews unchanged."""
    from tests.service.conftest import RedisProcess
    from tests.service.test_state import _make_replica

    art = srs_art
    review = {"card_id": "c", "time": T0, "rating": 3}
    replica = RedisProcess(Path(str(redis_process.workdir) + "-replica"))
    replica.start()
    try:
        with serve(Settings(artifacts_dir=art, redis_url=redis_process.url)) as url:
            first = {"user_id": "u", "reviews": [review]}
            httpx.post(f"{url}/v1/srs/time_aware/reviews", json=first).raise_for_status()
        _make_replica(replica, redis_process)
        with serve(Settings(artifacts_dir=art, redis_url=replica.url)) as url, httpx.Client(base_url=url) as http:
            reply = http.post("/v1/srs/time_aware/reviews",
                              json={"user_id": "u", "reviews": [{**review, "time": T0 + 60, "card_id": "d"}]})
            assert reply.status_code == 503 and "READONLY" in reply.json()["detail"], reply.text
            user = http.get("/v1/srs/time_aware/users/u").json()
            assert user["reviews_total"] == 1 and user["cards"] == 1
    finally:
        replica.stop()


# ------------------------------------------------------------------------- issue 38: maximum interval, new, simulate


def test_schedule_stops_at_the_maximum_interval_and_names_new_cards(srs_art, serve):
    """NEXTSTEP_SRS_MAX_INTERVAL_DAYS caps the due at the card's last review plus that many days (status max_interval,
    the model's recall and answer time there), or now where that is past (due_now, the recall now); a card never
    reviewed is new (issue 38: it was due_now)."""
    art = srs_art
    reviews = review_log(21)
    now = reviews[-1]["time"] + 3600
    last = {}
    for r in reviews:
        last[r["card_id"]] = r["time"]
    cards = [{"card_id": f"card-{c}", "deck_id": f"deck-{c % 3}"} for c in range(0, 40, 3)] + \
        [{"card_id": "never-seen", "deck_id": "deck-0"}]
    with serve(Settings(artifacts_dir=art, srs_max_interval_days=2)) as url, httpx.Client(base_url=url) as http:
        post_all(http, "u", reviews, 100)
        reply = http.post("/v1/srs/time_aware/schedule", json={"user_id": "u", "cards": cards, "now": now,
                                                              "desired_retention": 0.05})
        assert reply.status_code == 200, reply.text
        got = reply.json()
        assert got["max_interval_days"] == 2
        statuses = {c["status"] for c in got["cards"]}
        assert statuses <= {"max_interval", "due_now", "new"} and "max_interval" in statuses
        for card, due in zip(cards, got["cards"], strict=True):
            if card["card_id"] == "never-seen":
                assert due["status"] == "new" and due["due"] == now
                continue
            cap = last[card["card_id"]] + 2 * DAY
            if cap > now:
                assert due["status"] == "max_interval" and due["due"] == pytest.approx(cap, abs=1e-3), due
            else:
                assert due["status"] == "due_now" and due["due"] == now, due
            at = http.post("/v1/srs/time_aware/predict", json={"user_id": "u", **card, "time": due["due"]}).json()
            assert due["p_recall_at_due"] == pytest.approx(at["p_recall"], abs=1e-5)
            assert due["expected_duration_s"] == pytest.approx(at["expected_duration_s"], abs=1e-3)


def test_simulate_answers_a_workload_per_retention_for_the_stored_deck(srs_art, store_url, serve):
    art = srs_art
    reviews = review_log(31)
    now = reviews[-1]["time"] + 3600
    n_cards = len({r["card_id"] for r in reviews})
    retentions = [0.7, 0.8, 0.9, 0.95]
    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, httpx.Client(base_url=url) as http:
        post_all(http, "u", reviews, 100)

        def simulate(**body):
            reply = http.post("/v1/srs/time_aware/simulate", json={"user_id": "u", "now": now, **body})
            assert reply.status_code == 200, reply.text
            return reply.json()

        got = simulate(days=60, desired_retentions=retentions)
        assert got["cards"] == n_cards and got["new_cards"] == 0 and got["days"] == 60 and got["now"] == now
        assert got["reviews_total"] == len(reviews) and got["replicas"] >= 2000 // n_cards
        assert 0 < got["sampled_cards"] <= n_cards
        assert [r["desired_retention"] for r in got["retentions"]] == retentions
        for r in got["retentions"]:
            assert len(r["reviews_per_day"]) == len(r["minutes_per_day"]) == 60
            assert sum(r["reviews_per_day"]) == pytest.approx(r["total_reviews"], abs=0.1)
            assert r["mean_minutes_per_day"] == pytest.approx(r["total_minutes"] / 60)
            assert r["total_minutes"] == pytest.approx(r["total_reviews"] * r["seconds_per_review"] / 60, rel=1e-6)
            assert 0 < r["recalled_at_end"] <= n_cards and r["interval_ratio_to_fsrs6"] > 0
        totals = [r["total_reviews"] for r in got["retentions"]]
        recalled = [r["recalled_at_end"] for r in got["retentions"]]
        assert totals == sorted(totals) and recalled == sorted(recalled)  # more retention: more work, more kept
        assert simulate(days=60, desired_retentions=retentions) == got  # seeded: the same answer again
        # cards given: the stored ones and one never reviewed (new), plus new cards
        given = simulate(days=30, cards=[{"card_id": "card-1"}, {"card_id": "card-2"}, {"card_id": "fresh"}],
                         new_cards=4, new_cards_per_day=2)
        assert (given["cards"], given["new_cards"], given["new_cards_introduced"]) == (2, 5, 5)
        assert given["seconds_per_new_card"] > 0


def test_simulate_introduces_new_cards_and_keeps_to_the_maximum_interval(srs_art, serve):
    """A deck of new cards only: introduced new_cards_per_day a day, and with a maximum interval of one day each
    is then reviewed every day: the counts are exact."""
    art = srs_art
    with serve(Settings(artifacts_dir=art, srs_max_interval_days=1)) as url, httpx.Client(base_url=url) as http:
        reply = http.post("/v1/srs/time_aware/simulate", json={
            "user_id": "nobody", "cards": [], "new_cards": 25, "new_cards_per_day": 10, "days": 6,
            "desired_retentions": [0.8, 0.9]})
        assert reply.status_code == 200, reply.text
        got = reply.json()
        assert (got["cards"], got["new_cards"], got["new_cards_introduced"], got["max_interval_days"]) == (0, 25, 25, 1)
        for r in got["retentions"]:
            assert r["reviews_per_day"] == [10, 20, 25, 25, 25, 25]
            assert r["interval_ratio_to_fsrs6"] == 1.0  # no reviewed card to ask the model about: FSRS-6's own


SIMULATE_BAD = [
    ({"days": 0}, 422, "days"),
    ({"days": 3651}, 422, "days"),
    ({"days": 3650, "desired_retentions": [0.8, 0.9, 0.95]}, 422, "days"),  # over the work bound
    ({"desired_retentions": []}, 422, "desired_retentions"),
    ({"desired_retentions": [0.9, 0.9]}, 422, "desired_retentions"),
    ({"desired_retentions": [0.9, 1.0]}, 422, "desired_retentions[1]"),
    ({"desired_retentions": [0.4]}, 422, "desired_retentions[0]"),
    ({"desired_retentions": [0.5 + i / 40 for i in range(11)]}, 422, "desired_retentions"),
    ({"new_cards": -1}, 422, "new_cards"),
    ({"new_cards_per_day": -1}, 422, "new_cards_per_day"),
    ({"new_cards": 4}, 413, "cards"),  # the stored deck (3 cards) and 4 new: above the limit of 5
    ({"new_cards": 6}, 413, "new_cards"),
    ({"cards": [{"card_id": ""}]}, 422, "cards[0].card_id"),
    ({"cards": [{"card_id": "c"}] * 6}, 413, "cards"),
    ({"seed": -1}, 422, "seed"),
    ({"now": T0 - 1}, 422, "now"),
    ({"horizon_days": 3}, 422, "horizon_days"),
]


def test_simulate_refuses_bad_input_naming_the_field(srs_art, serve):
    art = srs_art
    with serve(Settings(artifacts_dir=art, srs_max_simulate_cards=5)) as url, httpx.Client(base_url=url) as http:
        seed = {"user_id": "u", "reviews": [{"card_id": c, "time": T0 + i, "rating": 3} for i, c in enumerate("abc")]}
        assert http.post("/v1/srs/time_aware/reviews", json=seed).status_code == 200
        for body, status, field in SIMULATE_BAD:
            reply = http.post("/v1/srs/time_aware/simulate", json={"user_id": "u", **body})
            assert reply.status_code == status, (body, reply.text)
            assert reply.json()["field"] == field, (body, reply.text)
        reply = http.post("/v1/srs/nope/simulate", json={"user_id": "u"})
        assert reply.status_code == 404


def test_the_services_fsrs6_is_the_models():
    """srs/simulate.py's FSRS6 (numpy, in the service) gives the card states models/fsrs.py (the graphs') gives."""
    from nextstep.models import fsrs
    from nextstep.service.srs.simulate import FSRS6
    from nextstep.service.srs.stored import DEFAULT_FSRS6

    assert tuple(DEFAULT_FSRS6) == tuple(fsrs.DEFAULT_W)
    rng = np.random.default_rng(4)
    n, c = 400, 8
    rating = rng.integers(1, 5, (n, c)).astype(np.float64)
    day = np.cumsum(rng.choice([0, 0, 1, 2, 5, 20], (n, c)), axis=1).astype(np.float64)
    present = np.arange(c)[None] >= rng.integers(0, c, n)[:, None]  # a suffix of each row
    w = np.array(fsrs.DEFAULT_W) * rng.uniform(0.8, 1.2, 21)
    s, d = FSRS6.of(w).memory_state(rating, day, present)
    ts, td = fsrs.memory_state(torch.tensor(w), torch.tensor(rating), torch.tensor(day), torch.tensor(present))
    np.testing.assert_allclose(s, ts.numpy(), rtol=1e-9)
    np.testing.assert_allclose(d, td.numpy(), rtol=1e-9)


def test_the_simulators_model_curve_goes_through_the_two_measured_points():
    """ModelCurve.through recovers a power curve from its intervals' ratios to FSRS-6's at two retentions; one
    retention keeps FSRS-6's decay; FSRS-6's own ratios give FSRS-6."""
    from nextstep.service.srs.simulate import FSRS6, ModelCurve
    from nextstep.service.srs.stored import DEFAULT_FSRS6

    fsrs = FSRS6.of(DEFAULT_FSRS6)
    for stretch, decay in ((1.0, fsrs.decay), (2.5, 0.4), (0.3, 0.08)):
        truth = ModelCurve(stretch, decay)
        ratios = [float(truth.interval(1.0, r) / fsrs.interval(1.0, r)) for r in (0.75, 0.95)]
        got = ModelCurve.through(fsrs, [0.75, 0.95], ratios)
        assert got.decay == pytest.approx(decay, rel=1e-6) and got.stretch == pytest.approx(stretch, rel=1e-6)
        assert got.retrievability(got.interval(7.0, 0.85), 7.0) == pytest.approx(0.85)
    one = ModelCurve.through(fsrs, [0.9], [2.0])
    assert one.decay == fsrs.decay and one.interval(3.0, 0.9) == pytest.approx(2 * fsrs.interval(3.0, 0.9))


def test_live_quality_scores_each_reviews_recall_from_before_it(srs_art, redis_url, serve):
    """Issue 35 for flashcards: every scored review (its card last reviewed on an earlier day: FSRS-6's error on it is
    not NaN, onnx_drift) scores the P(recall) the model gave it from the user's state just before it: /quality's
    log loss is the mean -ln P(the outcome) over those reviews, each P read from the predict route just before the
    review was recorded (1e-6)."""
    art = srs_art
    reviews = review_log(23, n=80)
    _, errors, _ = onnx_drift(art, reviews)
    losses = []
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        for review in reviews:
            p = http.post("/v1/srs/time_aware/predict", json={
                "user_id": "u", "card_id": review["card_id"], "deck_id": review["deck_id"],
                "time": review["time"]}).json()["p_recall"]
            reply = http.post("/v1/srs/time_aware/reviews", json={"user_id": "u", "reviews": [review]})
            assert reply.status_code == 200, reply.text
            losses.append(-np.log(p if review["rating"] > 1 else 1 - p))
        (live,) = http.get("/v1/models/time_aware/quality").json()["versions"]
    mask = ~np.isnan(errors)
    assert 0 < mask.sum() < len(reviews) and live["scored"] == mask.sum()
    assert live["log_loss"] == pytest.approx(np.mean(np.array(losses)[mask]), abs=1e-6)
