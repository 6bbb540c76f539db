"""A new model version answers from each entity's whole logged history (issue 37): after version 2 becomes latest,
a learner's or session's next answer equals what version 2 gives when stepped over every logged event, and a pinned
older version catches up with events version 2 took. Real artifacts (the bundled demo models; version 2 starts from
another initial state, so the versions' answers differ), real HTTP, the in-process store and a real Redis."""

import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest

import nextstep
from nextstep.service.settings import Settings

DEMO = Path(nextstep.__file__).parent / "demo_artifacts"


def add_version(root: Path, family: str, version: str, year: int, nudge: float = 0.0) -> None:
    """root/<family>/<version>: the bundled demo artifact, created in `year`, its initial state tilted by `nudge`
    (not a constant shift: deep_gpcm's initial state is a log prior over an ability grid, blind to a constant)."""
    out = root / family / version
    shutil.copytree(DEMO / family / "demo", out)
    manifest = json.loads((out / "manifest.json").read_text())
    (out / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                   "created": f"{year}-01-01T00:00:00Z"}))
    for spec in manifest.get("state", []):  # (flashcard models keep no state tensors)
        path = out / spec["file"]
        state = np.load(path)
        np.save(path, state + (nudge * np.linspace(-1, 1, state.size)).reshape(state.shape).astype(state.dtype))


def probabilities(body: dict) -> np.ndarray:
    return np.array([p["probabilities"] for p in body["predictions"]])


def test_a_learner_keeps_their_history_across_versions(tmp_path, store_url, serve):
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    rng = np.random.default_rng(0)
    events = [{"question_id": str(q), "response": int(r), "event_id": f"e{i}", "timestamp": 1.7e9 + 60 * i}
              for i, (q, r) in enumerate(zip(rng.integers(0, 20, 40), rng.integers(0, 4, 40), strict=True))]
    asked = ["3", "7", "11"]

    def replayed(http: httpx.Client, model: str, history: list[dict]) -> np.ndarray:
        """What `model` gives when stepped over the whole history from its initial state (nothing stored)."""
        body = http.post(f"/v1/kt/{model}/batch", json={"students": [
            {"student_id": "x", "events": history, "predict_question_ids": asked}]}).json()
        return np.array([p["probabilities"] for p in body["students"][0]["predictions"]])

    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        for start in range(0, 40, 10):
            assert http.post("/v1/kt/deep_gpcm/events", json={
                "student_id": "ada", "events": events[start:start + 10]}).status_code == 200
        v1 = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert (v1["version"], v1["events_total"], v1["rebuilt_from_events"]) == ("1", 40, 0)

        add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
        assert http.post("/v1/models/reload").status_code == 200
        v2 = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert (v2["version"], v2["events_total"], v2["rebuilt_from_events"]) == ("2", 40, 40)
        np.testing.assert_allclose(probabilities(v2), replayed(http, "deep_gpcm@2", events), atol=1e-5)
        assert np.abs(probabilities(v2) - probabilities(v1)).max() > 1e-3  # the versions differ
        again = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert again["rebuilt_from_events"] == 0 and again["predictions"] == v2["predictions"]  # stored once

        # version 2 takes an event (a replayed id changes nothing); version 1, pinned, catches up with it
        more = {"question_id": "5", "response": 2, "event_id": "e40"}
        reply = http.post("/v1/kt/deep_gpcm/events", json={
            "student_id": "ada", "events": [events[0], more], "predict_question_ids": asked}).json()
        assert (reply["events_absorbed"], reply["events_skipped"], reply["events_total"]) == (1, 1, 41)
        np.testing.assert_allclose(probabilities(reply), replayed(http, "deep_gpcm@2", [*events, more]), atol=1e-5)
        old = http.post("/v1/kt/deep_gpcm@1/predict", json={"student_id": "ada", "question_ids": asked}).json()
        assert (old["version"], old["events_total"], old["rebuilt_from_events"]) == ("1", 41, 1)
        np.testing.assert_allclose(probabilities(old), replayed(http, "deep_gpcm@1", [*events, more]), atol=1e-5)

        # delete: every version's state and the log
        assert http.delete("/v1/kt/deep_gpcm/students/ada").status_code == 200
        for model in ("deep_gpcm", "deep_gpcm@1"):
            gone = http.get(f"/v1/kt/{model}/students/ada").json()
            assert (gone["exists"], gone["events_total"], gone["rebuilt_from_events"]) == (False, 0, 0)


def test_a_session_keeps_its_clicks_across_versions(tmp_path, store_url, serve):
    add_version(tmp_path, "gru4rec", "1", 2026)
    ids = json.loads((DEMO / "gru4rec" / "demo" / "vocab_items.json").read_text())["ids"]
    clicks = [str(i) for i in ids[:5]]
    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        assert http.post("/v1/sessions/gru4rec/events", json={
            "session_id": "s", "events": [{"item_id": c} for c in clicks]}).status_code == 200
        add_version(tmp_path, "gru4rec", "2", 2027, nudge=0.3)
        assert http.post("/v1/models/reload").status_code == 200
        served = http.post("/v1/sessions/gru4rec/recommend", json={"session_id": "s", "k": 10}).json()
        assert (served["version"], served["events_total"], served["rebuilt_from_events"]) == ("2", 5, 5)
        batch = http.post("/v1/sessions/gru4rec/batch", json={"sessions": [{"item_ids": clicks}], "k": 10}).json()
        want = batch["sessions"][0]["items"]
        assert [i["item_id"] for i in served["items"]] == [i["item_id"] for i in want]
        np.testing.assert_allclose([i["score"] for i in served["items"]], [i["score"] for i in want], atol=1e-5)


def learner_events(n_learners: int, n_events: int, seed: int = 1) -> dict[str, list[dict]]:
    """Each learner's events, timed one minute apart from a start of their own (learner i's at 1.7e9 + i)."""
    rng = np.random.default_rng(seed)
    return {f"learner-{i}": [{"question_id": str(q), "response": int(r), "timestamp": 1.7e9 + i + 60 * t}
                             for t, (q, r) in enumerate(zip(rng.integers(0, 20, n_events), rng.integers(0, 4, n_events),
                                                            strict=True))]
            for i in range(n_learners)}


def send(http: httpx.Client, learners: dict[str, list[dict]], model: str = "deep_gpcm") -> None:
    """Each learner's events through POST /v1/kt/{model}/events, one request per learner."""
    for learner, events in learners.items():
        reply = http.post(f"/v1/kt/{model}/events", json={"student_id": learner, "events": events})
        assert reply.status_code == 200, reply.text


def test_migrate_brings_every_learner_to_the_new_version_a_page_at_a_time(tmp_path, store_url, serve):
    """POST /v1/models/{model}/migrate, a page per call, rebuilds every learner's state for version 2 from their log;
    after it their first request rebuilds nothing, and answers as version 2 replaying their history; a second walk
    finds nothing to do; a bad cursor is a 422 naming the field (flashcards: tests/service/srs/test_srs_upgrades.py)."""
    add_version(tmp_path, "deep_gpcm", "1", 2026)
    shutil.copytree(DEMO / "time_aware" / "demo", tmp_path / "time_aware" / "1")
    learners = learner_events(7, 12)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=store_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, learners)
        add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
        assert http.post("/v1/models/reload").status_code == 200

        def walk() -> list[dict]:
            pages, cursor = [], "0"
            while True:
                page = http.post("/v1/models/deep_gpcm/migrate", json={"version": "2", "cursor": cursor, "limit": 3})
                assert page.status_code == 200, page.text
                pages.append(page.json())
                cursor = page.json()["cursor"]
                if page.json()["done"]:
                    return pages

        first = walk()
        assert sum(p["entities"] for p in first) == 7 and len(first) >= 2 and first[-1]["cursor"] == "0"
        assert (sum(p["rebuilt"] for p in first), sum(p["events"] for p in first)) == (7, 7 * 12)
        assert all(p["lagging"] == 0 and p["version"] == "2" for p in first)
        for learner, events in learners.items():
            got = http.post("/v1/kt/deep_gpcm/predict", json={"student_id": learner, "question_ids": ["3"]}).json()
            assert (got["version"], got["rebuilt_from_events"], got["events_total"]) == ("2", 0, 12)
            replay = http.post("/v1/kt/deep_gpcm@2/batch", json={"students": [
                {"student_id": "x", "events": events, "predict_question_ids": ["3"]}]}).json()
            np.testing.assert_allclose(probabilities(got), probabilities(replay["students"][0]), atol=1e-5)
        again = walk()
        assert (sum(p["entities"] for p in again), sum(p["rebuilt"] for p in again)) == (7, 0)

        bad = http.post("/v1/models/deep_gpcm/migrate", json={"cursor": "not-a-cursor"})
        assert bad.status_code == 422 and bad.json()["field"] == "cursor", bad.text
        for cursor in (str(2 ** 64), f"0:{2 ** 64}", "9" * 20):  # (Redis's cursors are below 2^64)
            bad = http.post("/v1/models/deep_gpcm/migrate", json={"cursor": cursor})
            assert bad.status_code == 422 and bad.json()["field"] == "cursor", bad.text
        assert http.get("/v1/models").status_code == 200  # (the same connection goes on)
        pinned = http.post("/v1/models/deep_gpcm@2/migrate", json={})  # a pin names the version
        assert pinned.status_code == 200 and pinned.json()["version"] == "2", pinned.text
        assert http.post("/v1/models/deep_gpcm/migrate", headers={"X-Model-Version": "2"}, json={}) \
            .json()["version"] == "2"
        both = http.post("/v1/models/deep_gpcm@2/migrate", json={"version": "1"})
        assert both.status_code == 422 and both.json()["field"] == "version", both.text
        cards = http.post("/v1/models/time_aware/migrate", json={})  # one window layout: no user to move
        assert cards.status_code == 200 and (cards.json()["entities"], cards.json()["done"]) == (0, True), cards.text
        assert http.post("/v1/models/deep_gpcm/migrate", json={"version": "9"}).status_code == 404


def test_states_migrate_command_before_the_version_serves(tmp_path, redis_url, serve, monkeypatch, capsys):
    """`nextstep states migrate --to 2` runs before version 2 is loaded by the service (no reload yet), while
    version 1 serves: once the reload makes 2 latest, no learner's request rebuilds anything."""
    from nextstep.cli import main

    add_version(tmp_path, "deep_gpcm", "1", 2026)
    learners = learner_events(5, 9)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, learners)
        add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
        monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_url)
        monkeypatch.setenv("NEXTSTEP_ARTIFACTS_DIR", str(tmp_path))
        assert main(["states", "migrate", "--model", "deep_gpcm", "--to", "2", "--page", "2", "--quiet"]) == 0
        report = json.loads(capsys.readouterr().out)
        assert (report["version"], report["entities"], report["rebuilt"], report["events"]) == ("2", 5, 5, 45)
        assert report["entities_per_second"] > 0
        assert http.get("/v1/kt/deep_gpcm/students/learner-0").json()["version"] == "1"  # still serving 1
        assert http.post("/v1/models/reload").status_code == 200
        for learner in learners:
            got = http.get(f"/v1/kt/deep_gpcm/students/{learner}").json()
            assert (got["version"], got["rebuilt_from_events"], got["events_total"]) == ("2", 0, 9)
        with pytest.raises(SystemExit, match="no version '7'"):
            main(["states", "migrate", "--model", "deep_gpcm", "--to", "7"])


def test_events_export_writes_what_training_reads(tmp_path, redis_url, serve, monkeypatch, capsys):
    """`nextstep events export`: every learner's logged events, in order, in the long CSV that training reads (ids as
    sent, odd ones included), split by a hash of the learner id; every session's clicks in GRU4Rec's TSV."""
    from nextstep.cli import main
    from nextstep.service.event_export import in_test
    from nextstep.training.kt.data import read_long_csv
    from nextstep.training.next_item.sessions import read_gru4rec_tsv

    add_version(tmp_path, "deep_gpcm", "1", 2026)
    add_version(tmp_path, "gru4rec", "1", 2026)
    learners = learner_events(12, 6)
    learners['odd, "quoted"\tid ✓'] = learner_events(1, 3, seed=5)["learner-0"]
    items = [str(i) for i in json.loads((DEMO / "gru4rec" / "demo" / "vocab_items.json").read_text())["ids"][:9]]
    sessions = {f"s{i}": [{"item_id": items[(i + t) % 9], "timestamp": 1.75e9 + 10 * i + t} for t in range(i + 2)]
                for i in range(6)}
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, learners)
        for session, clicks in sessions.items():
            assert http.post("/v1/sessions/gru4rec/events", json={"session_id": session, "events": clicks}) \
                .status_code == 200
    monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_url)
    monkeypatch.setenv("NEXTSTEP_ARTIFACTS_DIR", str(tmp_path))
    out = tmp_path / "export"
    assert main(["events", "export", "--model", "deep_gpcm", "--out", str(out), "--test-fraction", "0.5",
                 "--quiet"]) == 0
    report = json.loads(capsys.readouterr().out)
    test_side = {learner for learner in learners if in_test(learner, 0.5)}
    assert 0 < len(test_side) < len(learners)
    assert report["entities"] == {"test": len(test_side), "train": len(learners) - len(test_side)}
    assert json.loads((out / "metadata.json").read_text()) == {"n_cats": 4}
    for part, names in (("train", set(learners) - test_side), ("test", test_side)):
        data = read_long_csv(out / f"deep_gpcm_{part}.csv.gz")
        assert {s.student_id for s in data.sequences} == names
        for s in data.sequences:
            sent = learners[s.student_id]
            assert [str(q) for q in s.questions] == [e["question_id"] for e in sent]
            assert s.responses.tolist() == [e["response"] for e in sent]
    with pytest.raises(SystemExit, match="empty folder"):  # files of an earlier export are never overwritten
        main(["events", "export", "--model", "deep_gpcm", "--out", str(out), "--quiet"])

    assert main(["events", "export", "--model", "gru4rec", "--out", str(out / "s"), "--test-fraction", "0",
                 "--quiet"]) == 0
    data = read_gru4rec_tsv(out / "s" / "gru4rec_train_full.tsv.gz")
    got = {name: [str(data.items[j]) for j in range(data.offsets[i], data.offsets[i + 1])]
           for i, name in enumerate(data.session_ids)}
    assert got == {s: [c["item_id"] for c in clicks] for s, clicks in sessions.items()}
    assert not (out / "s" / "gru4rec_test.tsv.gz").exists()  # (no test part asked for: no empty file)


def test_states_migrate_walks_a_page_again_after_a_stall_and_says_where_to_resume(
        tmp_path, redis_process, serve, monkeypatch, capsys):
    """Redis paused past the client's timeout under `nextstep states migrate`: the page is walked again once it
    answers; paused for good, the command stops with one line naming the --cursor to resume from."""
    import threading

    from nextstep import cli

    add_version(tmp_path, "deep_gpcm", "1", 2026)
    learners = learner_events(4, 5)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_process.url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, learners)
    add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
    monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_process.url)
    monkeypatch.setenv("NEXTSTEP_ARTIFACTS_DIR", str(tmp_path))
    monkeypatch.setenv("NEXTSTEP_REDIS_RETRIES", "0")  # (a read fails after the 0.5 s timeout, not twice that)
    monkeypatch.setattr(cli, "MIGRATE_TRIES", 2)  # (one retry, after 1 s)
    resumed = threading.Timer(1.0, redis_process.resume)  # (past the client's 0.5 s timeout)

    def stall(page: dict) -> None:  # (the progress line's hook: pause Redis once, after the first page)
        if not resumed.is_alive() and not resumed.finished.is_set():
            redis_process.pause()
            resumed.start()

    monkeypatch.setattr(cli, "_migrate_progress", stall)
    assert cli.main(["states", "migrate", "--model", "deep_gpcm", "--to", "2", "--page", "1"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["entities"] == 4 and "the page again in 1 s" in err

    monkeypatch.setattr(cli, "_migrate_progress", lambda page: redis_process.pause())
    try:
        with pytest.raises(SystemExit, match=r"resume with --cursor \d+"):
            cli.main(["states", "migrate", "--model", "deep_gpcm", "--to", "2", "--page", "1", "--quiet"])
    finally:
        redis_process.resume()


def test_a_failed_events_export_leaves_nothing_and_a_small_traffic_still_splits(tmp_path, redis_process, serve):
    """An export that fails (Redis paused after its first page, or down from the start) leaves no file in its
    folder, and a rerun into it succeeds; five learners that all hash to train give a test file of one learner (the
    nearest the split), and a single learner a train file alone."""
    import asyncio

    from nextstep.service.errors import StoreUnavailable
    from nextstep.service.event_export import export_events, in_test
    from nextstep.service.stores import make_store
    from nextstep.training.kt.data import read_long_csv

    add_version(tmp_path, "deep_gpcm", "1", 2026)
    names = [n for n in (f"l{i}" for i in range(100)) if not in_test(n, 0.2)][:5]
    learners = {name: events for name, events in zip(names, learner_events(5, 4).values(), strict=True)}
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_process.url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, learners)

    def export(out: Path, progress=None, **kwargs) -> dict:
        async def run():
            store = make_store(redis_process.url, ttl_seconds=None)
            try:
                return await export_events(store, "knowledge_tracing", "deep_gpcm", out, artifacts=tmp_path, page=1,
                                           progress=progress, **kwargs)
            finally:
                await store.close()
        return asyncio.run(run())

    out = tmp_path / "traffic"
    with pytest.raises(StoreUnavailable):
        export(out, progress=lambda counts: redis_process.pause())
    redis_process.resume()
    assert not out.exists() or not list(out.iterdir())
    assert not list(tmp_path.glob(".traffic*"))  # (nor a hidden folder of part-written files)

    report = export(out)  # (the rerun: into the same folder)
    assert report["entities"] == {"train": 4, "test": 1} and "nearest the split" in report["note"]
    train, test = (read_long_csv(out / f"deep_gpcm_{part}.csv.gz") for part in ("train", "test"))
    assert len(train.sequences) == 4 and len(test.sequences) == 1
    assert {s.student_id for s in train.sequences + test.sequences} == set(names)

    redis_process.flush()
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_process.url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, {names[0]: learners[names[0]]})
    alone = export(tmp_path / "alone")
    assert alone["entities"] == {"train": 1} and "no test file" in alone["note"]
    assert sorted(p.name for p in (tmp_path / "alone").iterdir()) == ["deep_gpcm_train.csv.gz", "metadata.json"]

    redis_process.stop()
    with pytest.raises(StoreUnavailable):
        export(tmp_path / "down")
    assert not (tmp_path / "down").exists()
