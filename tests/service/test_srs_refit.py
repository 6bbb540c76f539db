"""Each flashcard user's own FSRS-6 parameters: kept in their stored state, refitted off the request path by the
`nextstep srs refit` worker from their stored reviews with the evaluation protocol's fit, and fed to the graphs.
Real HTTP into the app, real Redis, real ONNX Runtime on the bundled demo artifact (no training here)."""

from __future__ import annotations

import asyncio
import json
import shutil

import httpx
import numpy as np
import pytest

from nextstep import demo
from nextstep.cli import main
from nextstep.service.redis_store import RedisStore
from nextstep.service.registry import load_artifact
from nextstep.service.settings import Settings
from nextstep.service.srs import HEADER, HEADER_V3, ROW, _decode, history_feeds, id_hash, window
from nextstep.training.srs.eval import fit_fsrs6
from nextstep.training.srs.reviews import ReviewLog, simulate_reviews

pytest.importorskip("fsrs_rs_python")
MODEL = "time_aware"


@pytest.fixture
def art(tmp_path):
    root = tmp_path / "artifacts"
    shutil.copytree(demo.BUNDLED / MODEL / demo.VERSION, root / MODEL / demo.VERSION)
    return root


def user_log(seed: int, card_size: int, harsh: bool = False) -> ReviewLog:
    """One simulated user's reviews, each card's first `card_size` only (so the store, which keeps each card's last
    `card_size`, holds every review of every card); `harsh`: a user who forgets faster (half the recalls Again)."""
    log = simulate_reviews(n_users=1, n_cards=120, n_days=45, reviews_per_day=25, seed=seed)
    if harsh:
        rng = np.random.default_rng(seed)
        log.rating = np.where((log.elapsed_days > 0) & (rng.random(len(log)) < 0.35), 1, log.rating)
    nth = np.array([np.sum(log.card[:i] == c) for i, c in enumerate(log.card)])
    keep = np.flatnonzero(nth < card_size)
    return log.take(keep, log.user_ids, np.array([0, len(keep)]))


def as_reviews(log: ReviewLog, lo: int, hi: int) -> list[dict]:
    return [{"card_id": f"c{int(log.card[i])}", "deck_id": f"d{int(log.deck[i])}", "time": float(log.time[i]),
             "rating": int(log.rating[i]), "duration": float(log.duration[i]), "event_id": f"e{i}"}
            for i in range(lo, hi)]


def post(http, user: str, reviews: list[dict]) -> None:
    for lo in range(0, len(reviews), 100):
        reply = http.post(f"/v1/srs/{MODEL}/reviews", json={"user_id": user, "reviews": reviews[lo:lo + 100]})
        assert reply.status_code == 200, reply.text


def refit(art, monkeypatch, capsys, *users: str) -> dict:
    args = ["srs", "refit", "--model", MODEL, "--artifacts", str(art)]
    for u in users:
        args += ["--user", u]
    capsys.readouterr()
    assert main(args) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.fixture
def worker_env(monkeypatch, redis_url):
    monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_url)
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT_MIN_SCORED", "40")
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT_EVERY_SCORED", "30")
    return redis_url


def test_the_parameters_held_after_a_prefix_are_what_the_protocol_fits_on_it(art, worker_env, serve, monkeypatch,
                                                                            capsys):
    card_size = load_artifact(art / MODEL / demo.VERSION).extra.window[1]
    log = user_log(5, card_size)
    half = len(log) // 2
    settings = Settings(artifacts_dir=art, redis_url=worker_env)
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        new = http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]  # a new user: the artifact's defaults
        defaults = json.loads((art / MODEL / demo.VERSION / "manifest.json").read_text())["fsrs6"]["parameters"]
        assert new["w"] == pytest.approx(defaults) and new["fitted_on"] == 0 and new["fitted_at"] is None
        post(http, "u1", as_reviews(log, 0, half))
        post(http, "few", as_reviews(log, 0, 30))  # too few scored reviews for a fit
        assert refit(art, monkeypatch, capsys) == {"users": 2, "refitted": 1}  # every user of the model (SCAN)
        got = http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]
        prefix = log.take(np.arange(half), log.user_ids, np.array([0, half]))
        assert got["w"] == pytest.approx(fit_fsrs6(prefix, np.arange(half)), abs=1e-9)
        assert got["w"] != pytest.approx(defaults, abs=1e-3)
        assert got["fitted_on"] == half and got["fitted_at"] > 0
        assert http.get(f"/v1/srs/{MODEL}/users/few").json()["parameters"]["fitted_on"] == 0
        assert refit(art, monkeypatch, capsys, "u1") == {"users": 1, "refitted": 0}  # nothing new: not due
        post(http, "u1", as_reviews(log, half, len(log)))
        assert refit(art, monkeypatch, capsys, "u1") == {"users": 1, "refitted": 1}
        again = http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]
        assert again["w"] == pytest.approx(fit_fsrs6(log, np.arange(len(log))), abs=1e-9)
        assert again["fitted_on"] == len(log)
        # the reviews recorded afterwards keep the fit; a deleted user starts from the defaults again
        post(http, "u1", [{"card_id": "late", "time": float(log.time[-1]) + 86400, "rating": 3}])
        assert http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]["w"] == again["w"]
        http.delete(f"/v1/srs/{MODEL}/users/u1")
        assert http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]["fitted_on"] == 0


def test_a_user_another_worker_is_fitting_is_left_to_it(art, worker_env, serve, monkeypatch, capsys):
    """Two workers never fit one user at once: while the user's lease is held elsewhere (a worker on another
    machine), a refit skips them and says so; once released, the next refit fits them."""
    path = art / MODEL / demo.VERSION
    log = user_log(5, load_artifact(path).extra.window[1])
    key = f"srs:{MODEL}:{load_artifact(path).schema}:u1"

    async def hold(take: bool) -> bool:
        store = RedisStore(worker_env, ttl_seconds=None)
        try:
            return await store.lease(key, "elsewhere", 60_000) if take else await store.release(key, "elsewhere")
        finally:
            await store.close()

    with serve(Settings(artifacts_dir=art, redis_url=worker_env)) as url, httpx.Client(base_url=url) as http:
        post(http, "u1", as_reviews(log, 0, 200))
        assert asyncio.run(hold(True))
        capsys.readouterr()
        assert main(["srs", "refit", "--model", MODEL, "--artifacts", str(art)]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
        assert lines == [{"user_id": "u1", "refitted": False, "reason": "another worker holds its lease"},
                         {"users": 1, "refitted": 0}]
        assert http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]["fitted_on"] == 0
        asyncio.run(hold(False))
        assert refit(art, monkeypatch, capsys) == {"users": 1, "refitted": 1}
        assert http.get(f"/v1/srs/{MODEL}/users/u1").json()["parameters"]["fitted_on"] == 200


def test_two_users_get_their_own_parameters_and_their_own_curves_from_one_artifact(art, worker_env, serve,
                                                                                   monkeypatch, capsys):
    path = art / MODEL / demo.VERSION
    model = load_artifact(path)
    card_size = model.extra.window[1]
    logs = {"steady": user_log(8, card_size), "forgetful": user_log(9, card_size, harsh=True)}
    with serve(Settings(artifacts_dir=art, redis_url=worker_env)) as url, httpx.Client(base_url=url) as http:
        for user, log in logs.items():
            post(http, user, as_reviews(log, 0, len(log)))
        assert refit(art, monkeypatch, capsys, *logs) == {"users": 2, "refitted": 2}
        params = {u: np.array(http.get(f"/v1/srs/{MODEL}/users/{u}").json()["parameters"]["w"]) for u in logs}
        for user, log in logs.items():
            np.testing.assert_allclose(params[user], fit_fsrs6(log, np.arange(len(log))), atol=1e-9)
        assert np.abs(params["steady"] - params["forgetful"]).max() > 0.05
        # each user's served P(recall) is the graph's with their own parameters, not the other user's
        served, with_other = {}, {}
        for user, other in (("steady", "forgetful"), ("forgetful", "steady")):
            log = logs[user]
            card, deck = f"c{int(log.card[-1])}", f"d{int(log.deck[-1])}"
            at = float(log.time[-1]) + 6 * 86400
            reply = http.post(f"/v1/srs/{MODEL}/predict", json={"user_id": user, "card_id": card, "deck_id": deck,
                                                                 "time": at})
            served[user] = reply.json()["p_recall"]
            history = asyncio.run(_history(worker_env, model, user, card))
            rows = window(model, history, card)
            for name, w in ((user, params[user]), (other, params[other])):
                feeds = history_feeds([rows], len(rows), history.drift, w)
                feeds.update(card=np.array([id_hash(card)]), deck=np.array([id_hash(deck)]),
                             time=np.array([at], dtype=np.float64))
                session = model.sessions["predict"]
                recall = session.run(["recall"], {i.name: feeds[i.name] for i in session.get_inputs()})[0][0]
                (served if name == user else with_other).setdefault(f"{user}/{name}", float(recall))
            assert served[user] == pytest.approx(served[f"{user}/{user}"], abs=1e-6)
            assert abs(served[user] - with_other[f"{user}/{other}"]) > 1e-3


async def _history(url: str, model, user: str, card: str):
    store = RedisStore(url, ttl_seconds=None)
    try:
        stored, _ = await store.read(f"srs:{MODEL}:{model.schema}:{user}", fields=[card])
        return _decode(stored)
    finally:
        await store.close()


def test_a_state_stored_before_per_user_parameters_still_reads_and_is_upgraded(art, redis_url, serve):
    """A v3 header (card count, drift; no parameters) reads with the defaults; the next review stores v4."""
    model = load_artifact(art / MODEL / demo.VERSION)
    key = f"srs:{MODEL}:{model.schema}:old"
    rows = np.zeros(2, dtype=ROW)
    rows["seq"], rows["card"], rows["time"] = [0, 1], id_hash("a"), [1e9, 1e9 + 60]
    rows["rating"], rows["state"] = 3, -1
    rows["error"] = np.nan
    header = np.zeros(1, dtype=HEADER_V3)
    header["cards"], header["drift"] = 1, [0.1, 1.0]

    async def write():
        store = RedisStore(redis_url, ttl_seconds=None)
        try:
            assert await store.compare_and_set(key, 0, header.tobytes() + rows.tobytes(), 2,
                                               fields={"a": rows.tobytes()}) is not None
        finally:
            await store.close()

    asyncio.run(write())
    defaults = json.loads((art / MODEL / demo.VERSION / "manifest.json").read_text())["fsrs6"]["parameters"]
    with serve(Settings(artifacts_dir=art, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        user = http.get(f"/v1/srs/{MODEL}/users/old").json()
        assert user["reviews_total"] == 2 and user["cards"] == 1
        assert user["parameters"]["w"] == pytest.approx(defaults) and user["parameters"]["fitted_on"] == 0
        reply = http.post(f"/v1/srs/{MODEL}/reviews", json={"user_id": "old", "reviews": [
            {"card_id": "a", "time": 1e9 + 3 * 86400, "rating": 3}]})
        assert reply.status_code == 200, reply.text
        assert http.get(f"/v1/srs/{MODEL}/users/old").json()["reviews_total"] == 3

    async def header_tag():
        store = RedisStore(redis_url, ttl_seconds=None)
        try:
            return (await store.get(key)).blob
        finally:
            await store.close()

    blob = asyncio.run(header_tag())
    assert int(np.frombuffer(blob, dtype="<i8", count=1)[0]) == -4 and (len(blob) - HEADER.itemsize) % ROW.itemsize == 0
    assert np.frombuffer(blob, dtype=HEADER, count=1)[0]["drift"][1] > 1.0  # the drift carried over (and grew)
