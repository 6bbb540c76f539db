"""Flashcard users across window layouts (issue 37): a version whose windows differ from the version that recorded a
user's reviews rebuilds the user's state from the reviews stored under the old layout, on the user's first request
or by a migration, and the rebuilt state is the one the same reviews recorded live under the new layout give; the
stored reviews export as the review CSV that training reads. Real artifacts (the bundled demo model, its manifest's
window size changed: the graphs take any number of history rows, and the card window, which the graph fixes, is
kept), real HTTP, real ONNX Runtime, the in-process store and a real Redis."""

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

import nextstep
from nextstep.service.redis_store import RedisStore
from nextstep.service.settings import Settings
from nextstep.service.srs.stored import HEADER, ROW, id_hash, schema_hash

DEMO = Path(nextstep.__file__).parent / "demo_artifacts" / "time_aware" / "demo"
T0 = 1_767_225_600.0  # 2026-01-01 UTC
DAY = 86400.0
CARD_SIZE = 4  # the demo graph's card window


def add_version(root: Path, version: str, year: int, size: int) -> str:
    """root/time_aware/<version>: the demo model, created in `year`, reading windows of `size` rows; its schema. Every
    user starts with evidence 50 nats for the network, never decaying, so that the network answers alone (weight
    1 - 2e-22): the evidence, which the network's answers add up, differs between windows of other sizes (and is
    carried over on a move, a test below checks), while these tests hold the states and answers to be the same."""
    out = root / "time_aware" / version
    shutil.copytree(DEMO, out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["window"]["card_size"] == CARD_SIZE
    evidence = {**manifest["evidence"], "prior": 50.0, "halflife_scored_reviews": None}
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": version, "created": f"{year}-01-01T00:00:00Z",
                                                   "window": {"size": size, "card_size": CARD_SIZE},
                                                   "evidence": evidence}))
    return schema_hash("time_aware", size, CARD_SIZE)


def reviews_of(seed: int, n: int, n_cards: int, start: float = T0, tag: str = "") -> list[dict]:
    """One user's reviews as the API takes them, in time order over a few weeks; some durations and states
    unknown, and some reviews of a card on the same day (not scored)."""
    rng = np.random.default_rng(seed)
    times = np.sort(start + rng.uniform(0, 30 * DAY, n))
    out = []
    for i, t in enumerate(times):
        c = int(rng.integers(n_cards))
        review = {"card_id": f"card-{c}", "deck_id": f"deck-{c % 3}", "time": float(t),
                  "rating": int(rng.integers(1, 5)), "event_id": f"r{tag}-{i}"}
        if i % 7:
            review["duration"] = float(np.round(rng.lognormal(1.8, 0.5), 3))
        if i % 5:
            review["state"] = int(rng.integers(0, 4))
        out.append(review)
    return out


def held(reviews: list[dict], size: int, card_size: int) -> int:
    """How many of the reviews a layout holds: the last `size` and each card's last `card_size`."""
    seqs = set(range(max(0, len(reviews) - size), len(reviews)))
    by_card: dict[str, list[int]] = {}
    for i, r in enumerate(reviews):
        by_card.setdefault(r["card_id"], []).append(i)
    for rows in by_card.values():
        seqs.update(rows[-card_size:])
    return len(seqs)


def post(http: httpx.Client, model: str, user: str, reviews: list[dict], chunk: int = 100) -> list[dict]:
    replies = []
    for lo in range(0, len(reviews), chunk):
        reply = http.post(f"/v1/srs/{model}/reviews", json={"user_id": user, "reviews": reviews[lo:lo + chunk]})
        assert reply.status_code == 200, reply.text
        replies.append(reply.json())
    return replies


def answers(http: httpx.Client, model: str, user: str, cards: list[str], at: float) -> list[dict]:
    """The model's predictions of every card and its schedule, without the fields that name the user or say how
    the state came to be."""
    out = []
    for card in cards:
        reply = http.post(f"/v1/srs/{model}/predict", json={"user_id": user, "card_id": card, "time": at})
        assert reply.status_code == 200, reply.text
        out.append(reply.json())
    reply = http.post(f"/v1/srs/{model}/schedule", json={"user_id": user, "cards": [{"card_id": c} for c in cards],
                                                        "desired_retention": 0.9, "now": at})
    assert reply.status_code == 200, reply.text
    out.append(reply.json())
    return [{k: v for k, v in a.items() if k not in ("user_id", "rebuilt_from_events")} for a in out]


def summary(http: httpx.Client, model: str, user: str) -> dict:
    reply = http.get(f"/v1/srs/{model}/users/{user}")
    assert reply.status_code == 200, reply.text
    return reply.json()


def same_summary(a: dict, b: dict) -> None:
    for name in ("exists", "reviews_total", "last_review_time", "cards", "parameters"):
        assert a[name] == b[name], (name, a[name], b[name])


def stored(url: str, schema: str, users: list[str]) -> list:
    """Each user's whole stored record under a layout (header and recent block, every card's field)."""
    async def read():
        store = RedisStore(url, ttl_seconds=None)
        try:
            return [await store.read_all(f"srs:time_aware:{schema}:{u}") for u in users]
        finally:
            await store.close()
    return asyncio.run(read())


def same_rows(x: bytes, y: bytes, offset: int = 0) -> None:
    """The same stored reviews: FSRS-6's error on each to float32 rounding (ONNX Runtime's float32 results may
    differ in the last bit with the width a batch is padded to, which the requests' sizes decide), the rest exact."""
    a, b = np.frombuffer(x, dtype=ROW, offset=offset), np.frombuffer(y, dtype=ROW, offset=offset)
    assert len(a) == len(b)
    for name in ROW.names:
        if name == "error":
            np.testing.assert_allclose(a[name], b[name], rtol=1e-6, atol=1e-6)
        else:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def same_state(url: str | None, schema: str, a: str, b: str, evidence: bool = True) -> None:
    """Users a and b have the same state under the layout: header, recent block and every card's field (Redis only:
    the in-process store lives in the server); `evidence` False: but for the evidence."""
    if url is None:
        return
    same_record(*stored(url, schema, [a, b]), evidence=evidence)


def same_record(x, y, evidence: bool = True) -> None:
    """Two stored records (read_all) hold the same state: header, recent block and every card's field (`evidence`
    False: but for the header's evidence)."""
    assert x.exists and y.exists and x.events == y.events
    hx, hy = (np.frombuffer(s.blob, dtype=HEADER, count=1)[0] for s in (x, y))
    for name in HEADER.names:
        if evidence or name != "evidence":
            np.testing.assert_allclose(hx[name], hy[name], rtol=1e-6, err_msg=name)
    same_rows(x.blob, y.blob, HEADER.itemsize)
    assert set(x.fields) == set(y.fields)
    for card in x.fields:
        same_rows(x.fields[card], y.fields[card])


def close(a, b) -> None:
    """The same answers, numbers to float32 rounding."""
    assert type(a) is type(b) or {type(a), type(b)} <= {int, float}, (a, b)
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (a, b)
        for k in a:
            close(a[k], b[k])
    elif isinstance(a, list):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            close(x, y)
    elif isinstance(a, float):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6)
    else:
        assert a == b


def test_a_user_moved_to_smaller_windows_is_as_if_recorded_there(tmp_path, store_url, serve):
    """Version 2 reads windows of 16 rows where version 1 read 32: a user of version 1 asking version 2 gets a state
    rebuilt from their stored reviews (said once: `rebuilt_from_events`), byte for byte the state of a user whose
    same reviews went to version 2 from the start, and both go on alike."""
    add_version(tmp_path, "1", 2026, 32)
    small = add_version(tmp_path, "2", 2027, 16)
    reviews = reviews_of(0, 300, 40)
    cards = sorted({r["card_id"] for r in reviews})
    later = reviews_of(1, 40, 40, start=reviews[-1]["time"] + DAY, tag="b")
    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        post(http, "time_aware@1", "moved", reviews)
        post(http, "time_aware@2", "live", reviews)
        first = summary(http, "time_aware@2", "moved")
        assert first["rebuilt_from_events"] == held(reviews, 32, CARD_SIZE) < 300
        assert "reviews_not_held" not in first  # (smaller windows: every review they keep was held)
        # the evidence the old windows' answers added up is carried over (all of the user's reviews count in it,
        # which no layout holds); it is not the evidence the new windows' answers would have added up
        old = summary(http, "time_aware@1", "moved")["evidence"]["nats"]
        assert first["evidence"]["nats"] == old != summary(http, "time_aware@2", "live")["evidence"]["nats"]
        same_summary(first, summary(http, "time_aware@2", "live"))
        assert summary(http, "time_aware@2", "moved")["rebuilt_from_events"] == 0  # stored: rebuilt once
        same_state(store_url, small, "moved", "live", evidence=False)
        at = later[0]["time"]
        close(answers(http, "time_aware@2", "moved", cards, at), answers(http, "time_aware@2", "live", cards, at))
        for user in ("moved", "live"):
            got = post(http, "time_aware@2", user, later, chunk=15)
            assert [r["rebuilt_from_events"] for r in got] == [0, 0, 0]
        same_state(store_url, small, "moved", "live", evidence=False)
        at = later[-1]["time"] + DAY
        close(answers(http, "time_aware@2", "moved", cards, at), answers(http, "time_aware@2", "live", cards, at))
        assert summary(http, "time_aware@1", "moved")["reviews_total"] == 300  # the old layout's state stays


def test_a_user_moved_to_larger_windows_has_what_the_old_ones_held(tmp_path, store_url, serve):
    """Version 3 reads windows of 64 rows where version 1 read 32. A user whose every review version 1 held moves
    on their first write, replays recognised, to the state of a user recorded under version 3 from the start. A
    user with more reviews is told how many the old windows no longer held (`reviews_not_held`); the new windows go
    without them until newer reviews replace them, and from then on the state is the live one's."""
    add_version(tmp_path, "1", 2026, 32)
    large = add_version(tmp_path, "3", 2028, 64)
    few, more = reviews_of(2, 30, 12), reviews_of(3, 5, 12, start=T0 + 40 * DAY, tag="m")
    many, after = reviews_of(4, 300, 40), reviews_of(5, 70, 40, start=T0 + 40 * DAY, tag="a")
    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        post(http, "time_aware@1", "few", few)
        post(http, "time_aware@3", "few-live", few)
        post(http, "time_aware@3", "few-live", more)
        moved = http.post("/v1/srs/time_aware@3/reviews", json={"user_id": "few", "reviews": few[-1:] + more}).json()
        assert (moved["rebuilt_from_events"], moved["applied"], moved["replayed"], moved["reviews_total"]) == \
            (30, 5, 1, 35)
        assert "reviews_not_held" not in moved
        same_state(store_url, large, "few", "few-live", evidence=False)
        cards = sorted({r["card_id"] for r in few})
        at = more[-1]["time"] + DAY
        close(answers(http, "time_aware@3", "few", cards, at), answers(http, "time_aware@3", "few-live", cards, at))

        post(http, "time_aware@1", "many", many)
        post(http, "time_aware@3", "many-live", many)
        kept = held(many, 32, CARD_SIZE)
        got = http.post("/v1/srs/time_aware@3/predict", json={"user_id": "many", "card_id": "card-1"}).json()
        assert (got["rebuilt_from_events"], got["reviews_not_held"], got["reviews_total"]) == (kept, 300 - kept, 300)
        assert got["history_used"] < http.post("/v1/srs/time_aware@3/predict", json={
            "user_id": "many-live", "card_id": "card-1"}).json()["history_used"] == 64
        post(http, "time_aware@3", "many", after, chunk=35)
        post(http, "time_aware@3", "many-live", after, chunk=35)
        same_state(store_url, large, "many", "many-live", evidence=False)
        cards = sorted({r["card_id"] for r in many})
        at = after[-1]["time"] + DAY
        close(answers(http, "time_aware@3", "many", cards, at), answers(http, "time_aware@3", "many-live", cards, at))


def test_migrate_moves_every_flashcard_user_and_delete_reaches_every_layout(tmp_path, store_url, serve):
    """POST /v1/models/time_aware/migrate walks the users of the model's other layouts a page at a time and stores
    each one's state for the version's layout; a second walk rebuilds no one; a model with one layout has no one to
    walk. Deleting a user deletes their reviews under every layout (else the next request would rebuild them)."""
    add_version(tmp_path, "1", 2026, 32)
    users = {f"user-{u}": reviews_of(10 + u, 5 + 3 * u, 6) for u in range(5)}
    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        for user, reviews in users.items():
            post(http, "time_aware", user, reviews)
        one = http.post("/v1/models/time_aware/migrate", json={})
        assert one.status_code == 200 and (one.json()["entities"], one.json()["done"]) == (0, True), one.text
        add_version(tmp_path, "3", 2028, 64)
        assert http.post("/v1/models/reload").status_code == 200

        def walk() -> list[dict]:
            pages, cursor = [], "0"
            while True:
                page = http.post("/v1/models/time_aware/migrate", json={"version": "3", "cursor": cursor, "limit": 2})
                assert page.status_code == 200, page.text
                pages.append(page.json())
                cursor = page.json()["cursor"]
                if page.json()["done"]:
                    return pages

        first = walk()
        assert sum(p["entities"] for p in first) == 5 and first[-1]["cursor"] == "0"
        assert (sum(p["rebuilt"] for p in first), sum(p["events"] for p in first)) == \
            (5, sum(map(len, users.values())))
        for user, reviews in users.items():
            got = summary(http, "time_aware", user)
            assert (got["version"], got["rebuilt_from_events"], got["reviews_total"]) == ("3", 0, len(reviews))
        again = walk()
        assert (sum(p["entities"] for p in again), sum(p["rebuilt"] for p in again)) == (5, 0)
        bad = http.post("/v1/models/time_aware/migrate", json={"version": "3", "cursor": "0123456789ab/0"})
        assert bad.status_code == 422 and bad.json()["field"] == "cursor", bad.text

        gone = http.delete("/v1/srs/time_aware/users/user-0")
        assert gone.status_code == 200 and gone.json()["deleted"] is True
        for model in ("time_aware", "time_aware@1"):
            assert summary(http, model, "user-0")["exists"] is False
        assert summary(http, "time_aware", "user-1")["exists"] is True


def test_states_migrate_command_moves_flashcard_users(tmp_path, redis_url, serve, monkeypatch, capsys):
    """`nextstep states migrate --to 3` for a flashcard model, before version 3 serves."""
    from nextstep.cli import main

    add_version(tmp_path, "1", 2026, 32)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        for u in range(3):
            post(http, "time_aware", f"u{u}", reviews_of(u, 8, 4))
        add_version(tmp_path, "3", 2028, 64)
        monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_url)
        monkeypatch.setenv("NEXTSTEP_ARTIFACTS_DIR", str(tmp_path))
        assert main(["states", "migrate", "--model", "time_aware", "--to", "3", "--quiet"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["version"], report["entities"], report["rebuilt"], report["events"]) == ("3", 3, 3, 24)
        assert http.post("/v1/models/reload").status_code == 200
        got = summary(http, "time_aware", "u0")
        assert (got["version"], got["rebuilt_from_events"], got["reviews_total"]) == ("3", 0, 8)


def test_events_export_writes_the_review_csv_that_training_reads(tmp_path, redis_url, serve, monkeypatch, capsys):
    """`nextstep events export` for a flashcard model: each user's stored reviews (from the newest layout that has
    them), in order, in the review-log CSV that `nextstep train time_aware` reads (ids as the service codes them,
    times as stored, each user's scheduler days by the boundary the app told), split by a hash of the user id;
    reviews the store no longer holds are counted."""
    from nextstep.cli import main
    from nextstep.service.event_export import in_test
    from nextstep.training.srs.reviews import read_review_data

    add_version(tmp_path, "1", 2026, 32)
    add_version(tmp_path, "3", 2028, 64)
    users = {f"user-{u}": reviews_of(20 + u, 10 + u, 8) for u in range(8)}
    users['odd, "quoted" id ✓'] = reviews_of(30, 12, 5)
    big = reviews_of(31, 200, 30)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        for n, (user, reviews) in enumerate(users.items()):
            post(http, "time_aware@1" if n % 2 else "time_aware@3", user, reviews)  # either layout
        post(http, "time_aware@1", "big", big)
        told = http.post("/v1/srs/time_aware@1/reviews", json={"user_id": "user-0", "reviews": [],
                                                               "day_start_hour_utc": 21.5})
        assert told.status_code == 422  # (reviews are required: the boundary comes with some)
        later = reviews_of(40, 3, 2, tag="late")
        shift = users["user-0"][-1]["time"] - later[0]["time"] + 86400
        for r in later:
            r["time"] += shift
        told = http.post("/v1/srs/time_aware@3/reviews", json={"user_id": "user-0", "reviews": later,
                                                               "day_start_hour_utc": 21.5})
        assert told.status_code == 200, told.text
        users["user-0"] = users["user-0"] + later
    monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_url)
    monkeypatch.setenv("NEXTSTEP_ARTIFACTS_DIR", str(tmp_path))
    out = tmp_path / "export"
    assert main(["events", "export", "--model", "time_aware", "--out", str(out), "--test-fraction", "0.5",
                 "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    test_side = {user for user in [*users, "big"] if in_test(user, 0.5)}
    assert 0 < len(test_side) < len(users) + 1
    assert report["entities"] == {"test": len(test_side), "train": len(users) + 1 - len(test_side)}
    kept = held(big, 32, CARD_SIZE)
    assert report["not_held"] == 200 - kept
    assert sum(report["events"].values()) == sum(map(len, users.values())) + kept
    for part in ("train", "test"):
        log = read_review_data(out / f"time_aware_{part}.csv.gz")
        assert set(log.user_ids) == ({*users, "big"} - test_side if part == "train" else test_side)
        for u, user in enumerate(log.user_ids):
            rows = slice(int(log.offsets[u]), int(log.offsets[u + 1]))
            start = (21.5 if user == "user-0" else 4.0) * 3600  # the boundary told, else 04:00 UTC
            days = np.floor((log.time[rows] - start) / 86400)
            np.testing.assert_array_equal(log.day_offsets()[rows], days - days.min())
            sent = users[user] if user != "big" else None
            if sent is None:  # the reviews held: the last 32 and each card's last 4
                assert len(log.time[rows]) == kept and np.all(np.diff(log.time[rows]) >= 0)
                continue
            assert log.card[rows].tolist() == [id_hash(r["card_id"]) for r in sent]
            assert log.deck[rows].tolist() == [id_hash(r["deck_id"]) for r in sent]
            assert log.time[rows].tolist() == [r["time"] for r in sent]
            assert log.rating[rows].tolist() == [r["rating"] for r in sent]
            assert log.state[rows].tolist() == [r.get("state", -1) for r in sent]
            np.testing.assert_array_equal(log.duration[rows], np.array([r.get("duration", np.nan) for r in sent],
                                                                       dtype=np.float32))
    whole = read_review_data(out)  # (the folder itself, as `--data`: its train file, as `nextstep retrain` reads it)
    assert set(whole.user_ids) == {*users, "big"} - test_side
    with pytest.raises(SystemExit, match="empty folder"):
        main(["events", "export", "--model", "time_aware", "--out", str(out), "--quiet"])
