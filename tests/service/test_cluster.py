"""The state stores on a real Redis Cluster (3 primaries, 3 replicas on loopback) and behind Sentinel: the store
contract, the service's concurrent-events test, learners on every node, banks, and failovers under load (503s only
while the failover lasts, then service again without a restart; acknowledged events counted after). Marked
`cluster` (`make test-cluster`); the fixtures are in conftest.py."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from typing import Any

import httpx
import pytest

from nextstep.service.kt.banks import RedisBankStore
from nextstep.service.redis_store import RedisStore
from nextstep.service.settings import Settings
from nextstep.service.state import StateStore
from tests.service.conftest import _raw
from tests.service.kt.test_kt_api import test_no_lost_updates_and_replays_change_nothing  # noqa: F401
from tests.service.test_state import (  # noqa: F401 -- the contract, collected here against the cluster
    KEY,
    _old_write,
    _wait_for,
    test_a_lease_has_one_owner_until_released_or_lapsed,
    test_a_window_of_no_ids_remembers_none,
    test_companion_fields_are_written_by_the_cas_and_read_with_the_state,
    test_companion_fields_share_the_ttl,
    test_dedupe_window_keeps_the_newest_ids,
    test_delete_removes_state_and_ids,
    test_event_ids_are_recorded_per_key,
    test_events_counter_adds,
    test_get_missing_key,
    test_no_lost_updates_under_concurrency,
    test_read_returns_state_and_seen_ids_together,
    test_scan_walks_every_key_of_a_prefix_once,
    test_set_then_get,
    test_stale_version_writes_nothing,
    test_ttl_expires_state_and_ids_and_writes_refresh_it,
)

pytestmark = pytest.mark.cluster
MODEL = "deep_gpcm"


@pytest.fixture
def open_store(redis_cluster):
    """The contract tests' store, on the cluster."""

    @contextlib.asynccontextmanager
    async def opener(**settings: Any):
        settings.setdefault("ttl_seconds", None)
        store: StateStore = RedisStore(redis_cluster.url, **settings)
        try:
            yield store
        finally:
            await store.close()

    return opener


@pytest.fixture
def store_url(redis_cluster) -> str:
    """test_kt_api's concurrent-events test, on the cluster."""
    return redis_cluster.url


def test_learners_on_every_node_are_served(artifacts, redis_cluster, serve):
    """The issue's bug: learners whose keys hash to another node got a 500 (MOVED). Now every learner is served,
    and their keys are spread over the three primaries."""
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, redis_url=redis_cluster.url)) as url, httpx.Client(base_url=url) as http:
        for i in range(40):
            body = {"student_id": f"learner-{i}", "events": [{"question_id": 2, "response": 1, "event_id": "e1"}],
                    "predict_question_ids": [3]}
            reply = http.post(f"/v1/kt/{MODEL}/events", json=body)
            assert reply.status_code == 200, reply.text
        for i in range(40):
            assert http.get(f"/v1/kt/{MODEL}/students/learner-{i}").json()["events_total"] == 1
    keys = {p: int(_raw(p, "DBSIZE").strip(b":\r\n")) for p in redis_cluster.primary_ports()}
    assert len(keys) == 3 and all(n > 0 for n in keys.values()), keys


def test_a_window_in_the_old_layout_is_read_and_moved_on_the_cluster(redis_cluster):
    """A window the release before wrote (its script, on the key's node) is read, then moved by the next write: the
    old keys and the new ones share the key's slot, so one script sees them all."""
    from redis.asyncio.cluster import RedisCluster

    async def body() -> None:
        raw = RedisCluster(host="127.0.0.1", port=redis_cluster.primary_ports()[0])
        store = RedisStore(redis_cluster.url, ttl_seconds=None, max_event_ids=20, key_prefix="old")
        meta = f"old:{{{KEY}}}"
        try:
            ids = [f"old-{i}" for i in range(30)]
            for version, event_id in enumerate(ids):
                await _old_write(raw, "old", version, [event_id], 20)
            assert await store.seen(KEY, ids) == set(ids[10:])
            assert await store.compare_and_set(KEY, 30, b"new", 1, ["new"]) is not None
            assert await store.seen(KEY, [*ids, "new"]) == {*ids[11:], "new"}
            assert not await raw.exists(f"{meta}:ring") and not await raw.exists(f"{meta}:ids")
            assert await raw.strlen(f"{meta}:order") == 20
            assert await store.delete(KEY) and not await raw.exists(meta)
        finally:
            await store.close()
            await raw.aclose()

    asyncio.run(body())


def test_migrate_and_export_cover_every_primary(tmp_path, redis_cluster, serve):
    """The migrate route's walk and the event export reach the learners on each of the three primaries."""
    from nextstep.service.event_export import export_events
    from nextstep.training.kt.data import read_long_csv
    from tests.service.test_upgrades import add_version, learner_events, send

    add_version(tmp_path, "deep_gpcm", "1", 2026)
    learners = learner_events(30, 4)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_cluster.url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        send(http, learners)
        add_version(tmp_path, "deep_gpcm", "2", 2027, nudge=5.0)
        assert http.post("/v1/models/reload").status_code == 200
        cursor, rebuilt, cursors = "0", 0, set()
        while True:
            page = http.post(f"/v1/models/{MODEL}/migrate", json={"cursor": cursor, "limit": 4}).json()
            rebuilt += page["rebuilt"]
            cursor = page["cursor"]
            cursors.add(cursor.partition(":")[0])
            if page["done"]:
                break
        assert rebuilt == 30 and {"0", "1", "2"} <= cursors  # every primary walked
        assert all(http.get(f"/v1/kt/{MODEL}/students/{learner}").json()["rebuilt_from_events"] == 0
                   for learner in learners)

    async def export() -> dict:
        store = RedisStore(redis_cluster.url, ttl_seconds=None)
        try:
            return await export_events(store, "knowledge_tracing", MODEL, tmp_path / "out", test_fraction=0)
        finally:
            await store.close()

    assert asyncio.run(export())["entities"] == {"train": 30}
    data = read_long_csv(tmp_path / "out" / f"{MODEL}_train.csv.gz")
    assert sorted(s.student_id for s in data.sequences) == sorted(learners)


def test_the_flashcard_refit_walks_every_primary(tmp_path, redis_cluster, serve, monkeypatch, capsys):
    """`nextstep srs refit` over every user of a model finds the users on each of the three primaries (it walked
    one node's keys before)."""
    import shutil

    from nextstep import demo
    from tests.service.srs.test_srs_refit import MODEL as SRS
    from tests.service.srs.test_srs_refit import as_reviews, post, refit, user_log

    shutil.copytree(demo.BUNDLED / SRS / demo.VERSION, tmp_path / SRS / demo.VERSION)
    monkeypatch.setenv("NEXTSTEP_REDIS_URL", redis_cluster.url)
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT_MIN_SCORED", "1000000")  # none due: the walk alone is tested
    reviews = as_reviews(user_log(3, 4), 0, 20)
    with serve(Settings(artifacts_dir=tmp_path, redis_url=redis_cluster.url)) as url, \
            httpx.Client(base_url=url, timeout=30) as http:
        for i in range(24):
            post(http, f"user-{i}", reviews)
    keys = {p: int(_raw(p, "DBSIZE").strip(b":\r\n")) for p in redis_cluster.primary_ports()}
    assert len(keys) == 3 and all(n > 0 for n in keys.values()), keys
    assert refit(tmp_path, monkeypatch, capsys) == {"users": 24, "refitted": 0}


def test_banks_on_the_cluster(redis_cluster):
    """A bank version is published whole (one transaction: its keys share a slot), listed, fetched and activated."""

    async def body() -> None:
        banks = RedisBankStore(redis_cluster.url)
        try:
            await banks.publish("space", "v1", {"h_states": b"\x00" * 1000, "h_lengths": b"1"}, b'{"p": 1}')
            await banks.publish("space", "v1", {"h_states": b"other"}, b"{}")  # immutable: a second publish is a no-op
            assert await banks.versions("space") == (None, {"v1": b'{"p": 1}'})
            assert await banks.fetch("space", "v1", ["h_states", "x"]) == ([b"\x00" * 1000, None], b'{"p": 1}')
            assert await banks.init_active("space", "v1") == "v1"
            await banks.set_active("space", "v2")
            assert await banks.active("space") == "v2" and await banks.init_active("space", "v1") == "v2"
        finally:
            await banks.close()

    asyncio.run(body())


class Load:
    """`threads` client threads posting one event each per request (unique ids, their own learners) through the
    app until stopped; every answer recorded as (time, status, learner, event)."""

    def __init__(self, url: str, threads: int = 4, learners: int = 6) -> None:
        self.url, self.threads, self.learners = url, threads, learners
        self.answers: list[tuple[float, int, str, dict]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._workers = [threading.Thread(target=self._run, args=(t,), daemon=True) for t in range(threads)]

    def _run(self, t: int) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as http:
            n = 0
            while not self._stop.is_set():
                learner = f"t{t}-l{n % self.learners}"
                event = {"question_id": 2 + n % 10, "response": n % 4, "event_id": f"t{t}-{n}"}
                try:
                    status = http.post(f"/v1/kt/{MODEL}/events", json={"student_id": learner,
                                                                        "events": [event]}).status_code
                except httpx.TransportError:
                    status = -1
                with self._lock:
                    self.answers.append((time.monotonic(), status, learner, event))
                n += 1

    def __enter__(self) -> Load:
        for w in self._workers:
            w.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for w in self._workers:
            w.join(timeout=30)

    def statuses(self, since: float = 0.0) -> list[int]:
        with self._lock:
            return [s for t, s, _, _ in self.answers if t >= since]

    def wait_for_recovery(self, since: float, ok_seconds: float = 2.0, timeout: float = 60.0) -> None:
        """Until `ok_seconds` of nothing but 200s, after `since`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            time.sleep(0.2)
            with self._lock:
                recent = [(t, s) for t, s, _, _ in self.answers if t >= since]
            bad = [t for t, s in recent if s != 200]
            last_bad = max(bad) if bad else since
            if recent and time.monotonic() - last_bad >= ok_seconds and any(s == 200 for t, s in recent
                                                                             if t > last_bad):
                return
        pytest.fail(f"no recovery within {timeout} s: {sorted(set(self.statuses(since)))}")


def _surviving(http: httpx.Client, answers) -> tuple[int, int]:
    """(acknowledged events, of them lost): every acknowledged event is sent again with its id, per learner in one
    request; an id the store no longer knows is absorbed again, i.e. it had been lost."""
    acked: dict[str, list[dict]] = {}
    for _, status, learner, event in answers:
        if status == 200:
            acked.setdefault(learner, []).append(event)
    lost = 0
    for learner, events in acked.items():
        for start in range(0, len(events), 500):
            body = {"student_id": learner, "events": events[start:start + 500]}
            reply = http.post(f"/v1/kt/{MODEL}/events", json=body)
            assert reply.status_code == 200, reply.text
            lost += reply.json()["events_absorbed"]
    return sum(len(e) for e in acked.values()), lost


@pytest.mark.parametrize("wait_replicas", [0, 1])
def test_cluster_failover_under_load(artifacts, cluster_factory, serve, wait_replicas):
    """A primary crashes (SIGKILL) under steady load from 4 client threads: the service answers 503 (never a 500)
    only while the cluster fails over, then 200 again without a restart. With NEXTSTEP_REDIS_WAIT_REPLICAS=1 every
    acknowledged event survives (it was on the replica that took over), and the shard answers 503 until it has a
    replica again (the crashed node, restarted, rejoins as one); without it, the few acknowledged in the last
    moments before the crash may be lost (asynchronous replication), and the test reports how many."""
    art, _ = artifacts
    with cluster_factory() as cluster:
        settings = Settings(artifacts_dir=art, redis_url=cluster.url, redis_wait_replicas=wait_replicas)
        with serve(settings) as url, Load(url) as load:
            time.sleep(2.0)
            assert set(load.statuses()) == {200}, sorted(set(load.statuses()))
            victim = max(cluster.primary_ports(), key=lambda p: int(_raw(p, "DBSIZE").strip(b":\r\n")))
            crashed = time.monotonic()
            cluster.nodes[victim].kill()
            if wait_replicas:  # the shard's only replica is now its primary: nothing can acknowledge its writes
                _wait_for(lambda: victim not in cluster.roles() and len(cluster.primary_ports()) == 3 and
                          cluster.info(cluster.primary_ports()[0])["cluster_state"] == "ok", "the failover")
                time.sleep(1.0)
                assert 503 in load.statuses(time.monotonic() - 0.5)  # WAIT 1 refuses to acknowledge, honestly
                cluster.nodes[victim].start()  # it comes back as the new primary's replica
            load.wait_for_recovery(crashed)
            time.sleep(0.5)
        answers = list(load.answers)
        after = [(t, s) for t, s, _, _ in answers if t >= crashed]
        failed = [t for t, s in after if s != 200]
        assert {s for _, s in after} <= {200, 503}, sorted({s for _, s in after})
        window = (max(failed) - crashed) if failed else 0.0
        cluster.wait_ok()
        with serve(settings) as url, httpx.Client(base_url=url, timeout=30) as http:
            acked, lost = _surviving(http, answers)
        print(f"\nfailover (wait_replicas={wait_replicas}): {len(answers)} requests, {len(failed)} answered 503, "
              f"last 503 {window:.2f} s after the crash; {acked} events acknowledged, {lost} of them lost")
        assert window < 20
        if wait_replicas:
            assert lost == 0


def test_sentinel_failover_is_followed(artifacts, sentinels, serve):
    """redis+sentinel://: the service writes to the primary the sentinels name; the primary crashes, the sentinels
    promote the replica, and the same service (no restart) writes to it after 503s during the failover."""
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, redis_url=sentinels.url)) as url, Load(url, threads=2) as load:
        time.sleep(1.0)
        assert set(load.statuses()) == {200}, sorted(set(load.statuses()))
        old = sentinels.primary_port()
        crashed = time.monotonic()
        sentinels.primary.kill()
        load.wait_for_recovery(crashed, timeout=60)
        assert sentinels.primary_port() == sentinels.replica.port != old
        after = [(t, s) for t, s, _, _ in load.answers if t >= crashed]
        assert {s for _, s in after} <= {200, 503}, sorted({s for _, s in after})
        failed = [t for t, s in after if s != 200]
        print(f"\nsentinel failover: {len(failed)} requests answered 503, the last "
              f"{(max(failed) - crashed) if failed else 0:.2f} s after the crash")
