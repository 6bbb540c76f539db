"""Each flashcard user's own FSRS-6 parameters: kept in their stored state, refitted off the request path from their
stored reviews with the evaluation protocol's fit (by the service's own refit worker, NEXTSTEP_SRS_REFIT=auto, and by
the `nextstep srs refit` command), and fed to the graphs. Real HTTP into the app, real Redis, real ONNX Runtime on the
bundled demo artifact (no training here)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time

import httpx
import numpy as np
import pytest

from nextstep import demo
from nextstep.cli import main
from nextstep.service.app import create_app
from nextstep.service.redis_store import RedisStore
from nextstep.service.registry import ModelRegistry, load_artifact
from nextstep.service.settings import Settings
from nextstep.service.srs import stored
from nextstep.service.srs.refit import FitProcess, RefitWorker, fit_stored, stored_rows
from nextstep.service.srs.service import SpacedRepetition
from nextstep.service.srs.stored import HEADER, HEADER_TAG, HEADER_V3, ROW, _decode, id_hash
from nextstep.service.srs.windows import history_feeds, window
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


def post(http, user: str, reviews: list[dict], chunk: int = 100) -> None:
    for lo in range(0, len(reviews), chunk):
        reply = http.post(f"/v1/srs/{MODEL}/reviews", json={"user_id": user, "reviews": reviews[lo:lo + chunk]})
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
    """The `nextstep srs refit` command's settings; the service these tests run leaves the refits to it."""
    monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_url)
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT_MIN_SCORED", "40")
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT_EVERY_SCORED", "30")
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT", "off")
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
                feeds = history_feeds([rows], len(rows), history.drift, w, history.day_start(model),
                                      history.evidence_of(model))
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
    """A v3 header (card count, drift; no parameters) reads with the defaults; the next review stores v5."""
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
    with serve(Settings(artifacts_dir=art, redis_url=redis_url, srs_refit="auto")) as url, \
            httpx.Client(base_url=url) as http:
        user = http.get(f"/v1/srs/{MODEL}/users/old").json()
        assert user["reviews_total"] == 2 and user["cards"] == 1
        assert user["parameters"]["w"] == pytest.approx(defaults) and user["parameters"]["fitted_on"] == 0
        reply = http.post(f"/v1/srs/{MODEL}/reviews", json={"user_id": "old", "reviews": [
            {"card_id": "a", "time": 1e9 + 3 * 86400, "rating": 3}]})
        assert reply.status_code == 200, reply.text
        assert http.get(f"/v1/srs/{MODEL}/users/old").json()["reviews_total"] == 3
        # a v3 header does not count scored reviews: the write queues the user for the service's refit, and the
        # fit, counting those stored, finds too few
        until("the v3 user's turn", lambda: refits(http))
        assert refits(http) == {"not_due": 1.0} and parameters(http, "old")["fitted_on"] == 0

    async def header_tag():
        store = RedisStore(redis_url, ttl_seconds=None)
        try:
            return (await store.get(key)).blob
        finally:
            await store.close()

    blob = asyncio.run(header_tag())
    assert int(np.frombuffer(blob, dtype="<i8", count=1)[0]) == HEADER_TAG
    assert (len(blob) - HEADER.itemsize) % ROW.itemsize == 0
    assert np.frombuffer(blob, dtype=HEADER, count=1)[0]["drift"][1] > 1.0  # the drift carried over (and grew)


# -- the service's own refit worker (NEXTSTEP_SRS_REFIT=auto) ------------------------------------------------------
def until(what: str, check, timeout: float = 60.0):
    """Poll `check()` until it answers something true (returned); fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.05)


def refits(http) -> dict[str, float]:
    """nextstep_srs_refits_total of the demo model, by outcome."""
    prefix = f'nextstep_srs_refits_total{{model="{MODEL}",outcome="'
    return {line[len(prefix):].split('"')[0]: float(line.split()[-1]) for line in http.get("/metrics").text.splitlines()
            if line.startswith(prefix)}


def parameters(http, user: str) -> dict:
    return http.get(f"/v1/srs/{MODEL}/users/{user}").json()["parameters"]


def stored_fit(url: str, model, user: str) -> tuple[list[float], int]:
    """fit_stored on every review the store holds for the user now, and how many they are."""
    async def read():
        store = RedisStore(url, ttl_seconds=None)
        try:
            return await store.read_all(f"srs:{MODEL}:{model.schema}:{user}")
        finally:
            await store.close()

    stored = asyncio.run(read())
    rows = stored_rows(_decode(stored).recent, stored.fields)
    return fit_stored(rows, model.manifest["model_config"]["day_start_hour"])[0], len(rows)


def lease(url: str, key: str, take: bool) -> bool | None:
    """Take (or release) the user's refit lease as another replica would."""
    async def run():
        store = RedisStore(url, ttl_seconds=None)
        try:
            return await store.lease(key, "elsewhere", 60_000) if take else await store.release(key, "elsewhere")
        finally:
            await store.close()

    return asyncio.run(run())


def auto(art, url: str, **more) -> Settings:
    return Settings(artifacts_dir=art, redis_url=url, srs_refit="auto", srs_refit_min_scored=40,
                    srs_refit_every_scored=30, **more)


def test_the_service_refits_a_user_once_enough_scored_reviews_arrived_and_again_later(art, redis_url, serve):
    """Reviews posted over HTTP past NEXTSTEP_SRS_REFIT_MIN_SCORED scored reviews: the replica's worker fits the user
    off the request path, with the protocol's fit on the reviews stored (fit_stored), and again once
    NEXTSTEP_SRS_REFIT_EVERY_SCORED more arrived; a user below the threshold is never queued."""
    model = load_artifact(art / MODEL / demo.VERSION)
    log = user_log(5, model.extra.window[1])
    half = len(log) // 2
    app = create_app(auto(art, redis_url))
    with serve(app.state.settings, app) as url, httpx.Client(base_url=url, timeout=30) as http:
        # fsrs-rs holds the GIL while it fits: the worker fits in a process of its own, not in a thread
        assert isinstance(app.state.srs.fitter, FitProcess)
        post(http, "few", as_reviews(log, 0, 30))  # 30 reviews: fewer than 40 scored
        post(http, "u1", as_reviews(log, 0, half), chunk=half)  # one write: one fit, on all of them
        got = until("u1's first fit", lambda: parameters(http, "u1")["fitted_on"] and parameters(http, "u1"))
        w, held = stored_fit(redis_url, model, "u1")
        assert got["fitted_on"] == held == half and got["fitted_at"] > 0
        assert got["w"] == pytest.approx(w, abs=1e-9)
        assert got["w"] == pytest.approx(fit_fsrs6(log.take(np.arange(half), log.user_ids, np.array([0, half])),
                                                   np.arange(half)), abs=1e-9)
        # the worker takes users in turn: "few" came first, and was never queued (no turn: neither done nor skipped)
        assert parameters(http, "few")["fitted_on"] == 0
        assert refits(http) == {"done": 1.0}
        post(http, "u1", as_reviews(log, half, len(log)), chunk=len(log))  # far more than 30 scored reviews more
        again = until("u1's second fit", lambda: parameters(http, "u1")["fitted_on"] == len(log)
                      and parameters(http, "u1"))
        assert again["w"] == pytest.approx(stored_fit(redis_url, model, "u1")[0], abs=1e-9)
        assert again["w"] == pytest.approx(fit_fsrs6(log, np.arange(len(log))), abs=1e-9)
        assert refits(http) == {"done": 2.0}
        assert parameters(http, "few")["fitted_on"] == 0
        fitter = app.state.srs.fitter
        pid = fitter.pid
        assert pid is not None and pid != os.getpid()
    assert fitter.pid is None and not os.path.exists(f"/proc/{pid}")  # the shutdown stopped it (and reaped it)


def test_a_user_whose_lease_another_replica_holds_is_skipped_and_fitted_on_a_later_review(art, redis_url, serve):
    model = load_artifact(art / MODEL / demo.VERSION)
    log = user_log(5, model.extra.window[1])
    key = f"srs:{MODEL}:{model.schema}:u1"
    assert lease(redis_url, key, True)
    with serve(auto(art, redis_url)) as url, httpx.Client(base_url=url, timeout=30) as http:
        post(http, "u1", as_reviews(log, 0, 200), chunk=200)
        until("the skipped turn", lambda: refits(http).get("skipped"))
        assert parameters(http, "u1")["fitted_on"] == 0 and refits(http) == {"skipped": 1.0}
        lease(redis_url, key, False)
        late = {"card_id": f"c{int(log.card[199])}", "time": float(log.time[199]) + 86400, "rating": 3}  # scored
        post(http, "u1", [late])
        until("u1's fit", lambda: parameters(http, "u1")["fitted_on"] == 201)
        assert refits(http) == {"skipped": 1.0, "done": 1.0}


def test_a_failed_refit_is_counted_and_the_worker_goes_on(art, redis_url, serve):
    """A user whose stored reviews do not decode (a card's field cut short) fails, counted; the next user is fitted."""
    model = load_artifact(art / MODEL / demo.VERSION)
    log = user_log(5, model.extra.window[1])
    key = f"srs:{MODEL}:{model.schema}:bad"
    with serve(auto(art, redis_url)) as url, httpx.Client(base_url=url, timeout=30) as http:
        post(http, "bad", as_reviews(log, 0, 20))  # below the threshold: not queued yet

        async def cut():
            store = RedisStore(redis_url, ttl_seconds=None)
            try:
                stored = await store.get(key)
                assert await store.compare_and_set(key, stored.version, stored.blob, 0, fields={"junk": b"xyz"})
            finally:
                await store.close()

        asyncio.run(cut())
        post(http, "bad", as_reviews(log, 20, 200), chunk=180)
        post(http, "good", as_reviews(log, 0, 200), chunk=200)
        until("good's fit", lambda: parameters(http, "good")["fitted_on"] == 200)
        assert refits(http) == {"failed": 1.0, "done": 1.0}
        assert parameters(http, "bad")["fitted_on"] == 0


def test_a_fitting_process_that_was_killed_is_replaced_at_the_next_fit(art, redis_url, serve):
    """The fitting process killed between fits (the kernel's OOM killer, an operator): the next fit starts another,
    and the user is fitted (done, not failed)."""
    model = load_artifact(art / MODEL / demo.VERSION)
    log = user_log(5, model.extra.window[1])
    app = create_app(auto(art, redis_url))
    with serve(app.state.settings, app) as url, httpx.Client(base_url=url, timeout=30) as http:
        post(http, "u1", as_reviews(log, 0, 200), chunk=200)
        until("u1's fit", lambda: parameters(http, "u1")["fitted_on"])
        first = app.state.srs.fitter.pid
        os.kill(first, signal.SIGKILL)
        post(http, "u2", as_reviews(log, 0, 200), chunk=200)
        until("u2's fit", lambda: parameters(http, "u2")["fitted_on"] == 200)
        assert refits(http) == {"done": 2.0}
        assert app.state.srs.fitter.pid not in (None, first)
        w, _ = stored_fit(redis_url, model, "u2")
        assert parameters(http, "u2")["w"] == pytest.approx(w, abs=1e-9)


def test_with_the_setting_off_the_service_never_refits_and_the_command_still_does(art, worker_env, serve, monkeypatch,
                                                                                  capsys):
    log = user_log(5, load_artifact(art / MODEL / demo.VERSION).extra.window[1])
    settings = Settings(artifacts_dir=art, redis_url=worker_env)
    assert settings.srs_refit == "off"  # (worker_env)
    app = create_app(settings)
    with serve(settings, app) as url, httpx.Client(base_url=url, timeout=30) as http:
        post(http, "u1", as_reviews(log, 0, 200), chunk=200)
        assert app.state.srs.refits is None  # no worker, no queue: nothing will fit u1
        assert parameters(http, "u1")["fitted_on"] == 0 and refits(http) == {}
        assert refit(art, monkeypatch, capsys) == {"users": 1, "refitted": 1}  # the batch command
        assert parameters(http, "u1")["fitted_on"] == 200


def test_the_queue_holds_a_user_once_and_drops_past_its_size(art):
    """RefitWorker.offer: a user due a fit is queued once however many writes come before their turn; a user not due
    is not queued; past the queue's size a user is dropped, counted."""
    async def run() -> tuple[list[str], list[tuple]]:
        registry = ModelRegistry(art)
        registry.reload()
        model = registry.get(MODEL)
        srs = SpacedRepetition(registry, None, None, refit_min_scored=40, refit_every_scored=30)
        seen = []
        worker = RefitWorker(srs, 2, lambda name, outcome: seen.append((name, outcome)))
        worker.offer(model, "a", 39, stored.NO_FIT)  # not due
        worker.offer(model, "a", 40, stored.NO_FIT)
        worker.offer(model, "a", 45, stored.NO_FIT)  # waiting already: one turn
        worker.offer(model, "b", 10, stored.Fit((0.0,) * 21, 100, 50, 1.0))  # fitted at 50 scored: due at 80
        worker.offer(model, "b", 80, stored.Fit((0.0,) * 21, 100, 50, 1.0))
        worker.offer(model, "c", 100, stored.NO_FIT)  # the queue is full
        return [worker.queue.get_nowait()[2] for _ in range(worker.queue.qsize())], seen

    queued, seen = asyncio.run(run())
    assert queued == ["a", "b"] and seen == [(MODEL, "dropped")]


def test_a_user_whose_store_keeps_part_of_their_reviews_is_queued_again_only_after_enough_new_ones(art, redis_url,
                                                                                                   serve):
    """A user with more reviews of a card than the store keeps (each card's last `card_size`): the fit sees fewer
    scored reviews than the user has recorded, and a fit is due again after NEXTSTEP_SRS_REFIT_EVERY_SCORED scored
    reviews more than they had recorded at the fit, not at every write."""
    model = load_artifact(art / MODEL / demo.VERSION)
    log = user_log(5, 10 ** 6)  # every review: up to a dozen per card, four kept
    with serve(auto(art, redis_url)) as url, httpx.Client(base_url=url, timeout=30) as http:
        post(http, "u1", as_reviews(log, 0, 400), chunk=400)
        got = until("u1's fit", lambda: parameters(http, "u1")["fitted_on"] and parameters(http, "u1"))
        w, held = stored_fit(redis_url, model, "u1")
        assert got["fitted_on"] == held < 400 and got["w"] == pytest.approx(w, abs=1e-9)
        post(http, "u1", as_reviews(log, 400, 405))  # a few scored reviews more: not due
        post(http, "u2", as_reviews(log, 0, 200), chunk=200)
        until("u2's fit", lambda: parameters(http, "u2")["fitted_on"])
        assert refits(http) == {"done": 2.0}  # (u1, had it been queued again, came before u2: one worker, in turn)
        post(http, "u1", as_reviews(log, 405, 500), chunk=95)  # past 30 scored more
        until("u1's second fit", lambda: parameters(http, "u1")["fitted_on"] > held)
        assert refits(http) == {"done": 3.0}
