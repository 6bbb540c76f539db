"""What a 503 tells a client, what a bad Redis URL does, and what an outage writes to the log (issue 36), against
real redis-servers and real HTTP into the app (the bundled demo models).

A write whose answer is lost is made deterministic with `StallingProxy`: a TCP relay between the service and the
server that freezes the server (SIGSTOP) just before it passes the compare-and-set on. The script then sits, sent,
in the server's socket buffer while the service waits in vain; the server runs it once resumed (SIGCONT), even
though the service has closed that connection by then (Redis reads the command before the end of the stream).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import re
import threading
import time
from typing import Any

import httpx
import pytest

from nextstep import demo
from nextstep.service.redis_clients import parse_url
from nextstep.service.redis_store import _CAS_LUA
from nextstep.service.settings import Settings

PROBLEM = "urn:nextstep:problem:"
CLIENTS = ("resp", "redis-py")

CAS_SHA = hashlib.sha1(_CAS_LUA.encode()).hexdigest().encode()  # (reads are scripts too: only the write stalls)


class StallingProxy:
    """A TCP relay to a `RedisProcess`, in a thread of its own. `arm()`: the next chunk the service sends that holds
    a compare-and-set (its script's EVALSHA) freezes the server before it is passed on; `stalled` is set then,
    and `gave_up` once the service closes that connection (its timeout). With `resume_when_given_up`, the server
    is resumed right then."""

    def __init__(self, redis: Any) -> None:
        self.redis = redis
        self.stalled, self.gave_up = threading.Event(), threading.Event()
        self._armed, self.resume_when_given_up = False, False
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(5)
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def arm(self, *, resume_when_given_up: bool = False) -> None:
        self.stalled.clear()
        self.gave_up.clear()
        self.resume_when_given_up, self._armed = resume_when_given_up, True

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._server = server
        self._ready.set()
        self._loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.redis.port)
        stalling = False

        async def to_server() -> None:
            nonlocal stalling
            while data := await reader.read(65536):
                if self._armed and CAS_SHA in data:
                    self._armed, stalling = False, True
                    self.redis.pause()  # frozen before the script reaches it: it runs only once resumed
                    self.stalled.set()
                up_writer.write(data)
                await up_writer.drain()
            up_writer.close()  # the end of the stream follows the commands, as the service's own close would
            if stalling:
                if self.resume_when_given_up:
                    self.redis.resume()
                self.gave_up.set()

        async def to_service() -> None:
            while data := await up_reader.read(65536):
                writer.write(data)
                await writer.drain()
            writer.close()

        try:
            await asyncio.gather(to_server(), to_service())
        except (ConnectionError, OSError):
            pass
        finally:
            writer.close()
            up_writer.close()

    def close(self) -> None:
        async def shut() -> None:
            self._server.close()
            relays = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in relays:
                task.cancel()
            await asyncio.gather(*relays, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shut(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()


@pytest.fixture
def proxy(redis_process):
    relay = StallingProxy(redis_process)
    try:
        yield relay
    finally:
        redis_process.resume()
        relay.close()


def _settings(url: str, client: str, **extra) -> Settings:
    return Settings(artifacts_dir=demo.BUNDLED, redis_url=f"{url}?client={client}", redis_timeout_seconds=0.3,
                    reload_refresh_seconds=3600, **extra)


def _event(student: str, event_id: str | None, question: int = 3) -> dict:
    return {"student_id": student, "events": [{"question_id": question, "response": 1,
                                               **({"event_id": event_id} if event_id else {})}]}


def _total(http: httpx.Client, student: str) -> int:
    reply = http.get(f"/v1/kt/deep_gpcm/students/{student}")
    assert reply.status_code == 200, reply.text
    return reply.json()["events_total"]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("with_id", [True, False], ids=["event_id", "no-event_id"])
def test_a_write_sent_and_not_answered_is_outcome_unknown_and_was_applied(proxy, redis_process, serve, client,
                                                                          with_id):
    """The server freezes after the service sent the compare-and-set and stays frozen past the service's timeouts:
    the 503 is outcome-unknown (not store-unavailable: the write was sent), and rightly so, because the event was
    applied once the server woke up. The retry with the same event id then applies nothing; without an event id the
    detail says the events may be applied twice."""
    with serve(_settings(proxy.url, client)) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=_event("s", "e0")).status_code == 200  # (script loaded)
        proxy.arm()
        reply = http.post("/v1/kt/deep_gpcm/events", json=_event("s", "e1" if with_id else None))
        assert proxy.stalled.is_set()
        assert reply.status_code == 503, reply.text
        problem = reply.json()
        assert problem["type"] == PROBLEM + "outcome-unknown", problem
        assert "same event ids" in problem["detail"], problem
        assert ("without an event_id" in problem["detail"]) is not with_id, problem
        redis_process.resume()
        assert _total(http, "s") == 2  # applied after all: the 503 could not have said "nothing was changed"
        if with_id:
            again = http.post("/v1/kt/deep_gpcm/events", json=_event("s", "e1"))
            assert again.status_code == 200, again.text
            assert (again.json()["events_absorbed"], again.json()["events_total"]) == (0, 2)


@pytest.mark.parametrize("client", CLIENTS)
def test_a_lost_answer_is_resolved_once_the_store_answers_again(proxy, redis_process, serve, client):
    """The server freezes after the compare-and-set was sent and wakes up as soon as the service gives up waiting
    for its answer: the service finds out what became of it (the event id in the store, or a second copy that
    fences the first) and answers 200, with the event applied once."""
    with serve(_settings(proxy.url, client)) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=_event("r", "e0")).status_code == 200
        proxy.arm(resume_when_given_up=True)
        reply = http.post("/v1/kt/deep_gpcm/events", json=_event("r", "e1"))
        assert proxy.stalled.is_set() and proxy.gave_up.is_set()  # the answer was lost indeed
        assert reply.status_code == 200, reply.text
        assert (reply.json()["events_absorbed"], reply.json()["events_total"]) == (1, 2)
        assert _total(http, "r") == 2


@pytest.mark.parametrize("client", CLIENTS)
def test_store_unavailable_means_nothing_was_changed(redis_process, serve, client):
    """Before the compare-and-set is sent (the server refuses connections, or hangs already at the read), the 503 is
    store-unavailable, and nothing was applied."""
    with serve(_settings(redis_process.url, client)) as url, httpx.Client(base_url=url, timeout=10) as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=_event("u", "e0")).status_code == 200
        redis_process.pause()  # hung: the read times out, the write is never sent
        reply = http.post("/v1/kt/deep_gpcm/events", json=_event("u", None))
        redis_process.resume()
        assert reply.status_code == 503 and reply.json()["type"] == PROBLEM + "store-unavailable", reply.text
        assert "127.0.0.1" not in reply.json()["detail"]
        assert reply.headers["Retry-After"] == "1"  # (every 503 says when to try again)
        assert _total(http, "u") == 1
        redis_process.stop()  # refused
        reply = http.post("/v1/kt/deep_gpcm/events", json=_event("u", None))
        assert reply.status_code == 503 and reply.json()["type"] == PROBLEM + "store-unavailable", reply.text
        assert "Connection refused" in reply.json()["detail"] and "127.0.0.1" not in reply.json()["detail"]


def test_a_cluster_url_naming_a_plain_server_is_a_503_naming_the_cause(redis_url, serve):
    """redis+cluster:// pointed at the suite's plain redis-server: every route that needs the store answers 503
    saying so, /readyz included (it was a 500, "cluster support disabled", on every route)."""
    cluster_url = redis_url.replace("redis://", "redis+cluster://").rsplit("/", 1)[0]
    with serve(Settings(artifacts_dir=demo.BUNDLED, redis_url=cluster_url, reload_refresh_seconds=3600)) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        for method, path, body in (("GET", "/readyz", None), ("POST", "/v1/kt/deep_gpcm/events", _event("c", "e")),
                                   ("GET", "/v1/kt/deep_gpcm/students/c", None)):
            reply = http.request(method, path, json=body)
            assert reply.status_code == 503, (path, reply.text)
            assert "not in cluster mode" in reply.json()["detail"], reply.text
            assert "redis://" in reply.json()["detail"]  # what to use instead
        assert http.get("/healthz").status_code == 200


@pytest.mark.parametrize("url, words", [
    ("redis://127.0.0.1:notaport/0", "port 'notaport'"),
    ("redis://u:s3cret@127.0.0.1:notaport/0", "port 'notaport'"),
    ("redis://127.0.0.1:0/0", "port '0'"),
    ("redis://127.0.0.1:65536", "port '65536'"),
    ("redis://127.0.0.1:/0", "port ''"),
    ("redis://::1:6379/0", "brackets"),
    ("redis://[::1/0", "Redis URL"),
    ("http://127.0.0.1:6379", "scheme 'http'"),
    ("redis://127.0.0.1:6379/zero", "database 'zero'"),
    ("redis://127.0.0.1:6379/-1", "database '-1'"),
    ("redis://127.0.0.1:6379/0/1", "the path is /db"),
    ("redis://:s3cret@127.0.0.1:6379/x", "database 'x'"),
    ("redis://127.0.0.1:6379/0?db=1&password=s3cret&nope=1", "nope"),
    ("redis+sentinel://127.0.0.1:26379/mymaster/0/9", "the path is"),
])
def test_a_malformed_redis_url_is_refused_at_start_naming_the_setting(url, words):
    """Bad port, scheme or database: Settings (what `nextstep serve` and create_app read first) refuse it, naming
    NEXTSTEP_REDIS_URL and never showing a password; `redis://127.0.0.1:notaport/0` was taken and later reported
    as host "127.0.0.1:notaport", port 6379."""
    with pytest.raises(ValueError, match="NEXTSTEP_REDIS_URL") as caught:
        Settings(redis_url=url)
    assert words in str(caught.value)
    assert "s3cret" not in str(caught.value)
    assert parse_url("redis://[::1]:6380/2").hosts == (("::1", 6380),)  # what is right still parses
    assert parse_url("redis://[::1]").hosts == (("::1", 6379),)


@pytest.mark.parametrize("client", CLIENTS)
def test_an_outage_is_logged_once_when_it_starts_and_once_when_it_ends(redis_process, serve, client, caplog):
    """Redis down while the reload generation is checked 50 times: one line saying it is unavailable (with the
    server's address and why; no traceback), one when it answers again. It was a three-exception traceback every
    check (632 lines in 32 s at the 2 s default)."""
    settings = _settings(redis_process.url, client)
    settings.reload_refresh_seconds = 0.02
    with caplog.at_level(logging.INFO, logger="nextstep"), serve(settings) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        assert http.get("/readyz").status_code == 200
        caplog.clear()
        redis_process.stop()
        time.sleep(1.0)  # about 50 checks
        down = [r for r in caplog.records if r.name.startswith("nextstep")]
        redis_process.start()
        deadline = time.monotonic() + 5
        while not any("answers again" in r.getMessage() for r in caplog.records) and time.monotonic() < deadline:
            time.sleep(0.05)
        up = [r for r in caplog.records if r.name.startswith("nextstep")][len(down):]
    assert len(down) == 1, [r.getMessage() for r in down]
    line = down[0].getMessage()
    # (why: refused, or lost when a check was under way as the server stopped)
    # (the first background check to meet the outage names it: the reload generation's, or the rollouts')
    assert re.search(f"Redis at {re.escape(redis_process.url)} unavailable: (reload generation|rollouts): "
                     "connection ", line), line
    assert down[0].exc_info is None and "\n" not in line
    assert [r.getMessage().split(" answers again")[0] for r in up] == [f"Redis at {redis_process.url}"], \
        [r.getMessage() for r in up]
