"""nextstep.client against the real service (uvicorn, Redis, the bundled demo models): typed answers, errors, pins,
and exactly-once writes through faults: a TCP proxy that drops a share of the service's answers after the service
applied the request, and Redis frozen under the service now and then. Every learner's, session's and user's event
count must equal what was sent, for knowledge tracing, sessions and flashcard reviews, with the sync and the async
client."""

import asyncio
import inspect
import logging
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest

from nextstep import demo
from nextstep.client import AsyncClient, Client, InvalidRequest, NotFound, OutcomeUnknown, Retry, Unavailable
from nextstep.service.kt.schemas import KtEvent, KtEventsAnswer
from nextstep.service.settings import Settings
from tests.doc_examples import GUIDE, README, python_examples
from tests.service.conftest import RedisProcess, serving

NOW = 1767225600.0


class DroppingProxy:
    """A TCP relay in front of the service, in a thread of its own: with probability `drop` (seeded) a chunk of the
    service's answer is not passed on, and both connections are closed instead. The service had answered, so the
    request was applied; the client sees a connection dropped without an answer."""

    def __init__(self, port: int, drop: float, seed: int = 0):
        self.upstream, self.drop, self.rng = port, drop, random.Random(seed)
        self.dropped = 0
        self._loop = asyncio.new_event_loop()
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self._thread.start()
        ready.wait(5)

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._relay, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        ready.set()
        self._loop.run_forever()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)

        async def pipe(src, dst, dropping: bool) -> None:
            try:
                while data := await src.read(65536):
                    if dropping and self.rng.random() < self.drop:
                        self.dropped += 1
                        break
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                for w in (writer, up_writer):
                    w.close()

        await asyncio.gather(pipe(reader, up_writer, False), pipe(up_reader, writer, True))

    def close(self) -> None:
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


@pytest.fixture
def faulty(tmp_path, redis_process):
    """(the service's own URL, the proxy, the Redis process): the demo models on a Redis whose replies time out
    after 0.3 s (a request gives up on it after two such waits), behind a proxy dropping 25% of the answers."""
    redis = redis_process
    settings = Settings(artifacts_dir=demo.BUNDLED, redis_url=redis.url, redis_timeout_seconds=0.3)
    with serving(settings) as url:
        proxy = DroppingProxy(int(url.rsplit(":", 1)[1]), drop=0.25)
        try:
            yield url, proxy, redis
        finally:
            redis.resume()
            proxy.close()


class Freezer:
    """Freezes Redis (SIGSTOP) for `pause` seconds, then lets it run for `every` seconds, and again, while it runs
    (in a thread); the first freeze comes at once."""

    def __init__(self, redis: RedisProcess, pause: float = 1.0, every: float = 0.5):
        self.redis, self.pause, self.every = redis, pause, every
        self.freezes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.redis.pause()
            self.freezes += 1
            time.sleep(self.pause)
            self.redis.resume()
            if self._stop.wait(self.every):
                return

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join(5)
        self.redis.resume()


PATIENT = Retry(attempts=40, backoff=0.02, max_backoff=0.3)
ENTITIES, WRITES = 4, 6


def plan(ids: dict[str, list[str]]) -> dict[str, list[tuple[str, list[dict]]]]:
    """Per task, (entity, events) writes of one or two events each, without event ids (the client gives them)."""
    rng = random.Random(1)
    writes = {"kt": [], "sessions": [], "srs": []}
    for e in range(ENTITIES):
        for w in range(WRITES):
            n = 1 + w % 2
            writes["kt"].append((f"learner-{e}", [{"question_id": rng.choice(ids["kt"]), "response": rng.randrange(4)}
                                                  for _ in range(n)]))
            writes["sessions"].append((f"visit-{e}", [{"item_id": rng.choice(ids["sessions"])} for _ in range(n)]))
            writes["srs"].append((f"user-{e}", [{"card_id": f"card-{rng.randrange(5)}", "rating": rng.randint(1, 4),
                                                 "time": NOW + 3600 * (2 * w + i), "duration": 5.0}
                                                for i in range(n)]))
    return writes


def send_sync(client: Client, task: str, entity: str, events: list[dict]):
    if task == "kt":
        return client.kt.events("deep_gpcm", entity, events)
    if task == "sessions":
        return client.sessions.events("gru4rec", entity, events)
    return client.srs.reviews("time_aware", entity, events)


async def send_async(client: AsyncClient, task: str, entity: str, events: list[dict]):
    if task == "kt":
        return await client.kt.events("deep_gpcm", entity, events)
    if task == "sessions":
        return await client.sessions.events("gru4rec", entity, events)
    return await client.srs.reviews("time_aware", entity, events)


def totals(url: str) -> dict[tuple[str, str], int]:
    """Each entity's event count, read from the service directly (not through the proxy)."""
    with Client(url) as client:
        out = {}
        for e in range(ENTITIES):
            out[("kt", f"learner-{e}")] = client.kt.student("deep_gpcm", f"learner-{e}").events_total
            out[("sessions", f"visit-{e}")] = client.sessions.session("gru4rec", f"visit-{e}").events_total
            out[("srs", f"user-{e}")] = client.srs.user("time_aware", f"user-{e}").reviews_total
        return out


def expected(writes: dict) -> dict[tuple[str, str], int]:
    want: dict[tuple[str, str], int] = {}
    for task, entries in writes.items():
        for entity, events in entries:
            want[(task, entity)] = want.get((task, entity), 0) + len(events)
    return want


def ids_of(url: str) -> dict[str, list[str]]:
    with Client(url) as client:
        return {"kt": client.models.ids("deep_gpcm").ids, "sessions": client.models.ids("gru4rec").ids}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_every_event_counts_once_through_dropped_answers_and_a_freezing_redis(faulty, mode, caplog):
    url, proxy, redis = faulty
    writes = plan(ids_of(url))
    caplog.set_level(logging.INFO, logger="nextstep.client")
    with Freezer(redis) as freezer:
        if mode == "sync":
            with Client(proxy.url, retry=PATIENT, timeout=2.0) as client:
                for task, entries in writes.items():
                    for entity, events in entries:
                        send_sync(client, task, entity, events)
        else:
            async def run():
                async with AsyncClient(proxy.url, retry=PATIENT, timeout=2.0) as client:
                    async def entity_writes(task, entity):  # one entity's writes in order, entities at once
                        for e, events in writes[task]:
                            if e == entity:
                                await send_async(client, task, entity, events)
                    await asyncio.gather(*(entity_writes(task, entity) for task, entity in expected(writes)))
            asyncio.run(run())
    assert totals(url) == expected(writes)  # nothing lost, nothing doubled
    reasons = " ".join(r.getMessage() for r in caplog.records)
    assert proxy.dropped > 0 and "answer lost" in reasons, "no answer was dropped: the test proved nothing"
    assert freezer.freezes > 0 and "503" in reasons, "the store never failed under the service"


def test_answers_are_typed_errors_name_the_field_and_pins_choose_the_version(redis_process, tmp_path):
    with serving(Settings(artifacts_dir=demo.BUNDLED, redis_url=redis_process.url)) as url, Client(url) as client:
        ids = client.models.ids("deep_gpcm").ids
        answer = client.kt.events("deep_gpcm", "s/1", [KtEvent(question_id=ids[0], response=2)],
                                  predict_question_ids=[ids[1]])
        assert isinstance(answer, KtEventsAnswer) and answer.student_id == "s/1" and answer.events_absorbed == 1
        assert len(answer.predictions[0].probabilities) == 4 and answer.predictions[0].theta is not None
        assert client.kt.student("deep_gpcm", "s/1").events_total == 1  # (an id with a slash, percent-encoded)
        with pytest.raises(InvalidRequest) as refused:
            client.kt.events("deep_gpcm", "s/1", [{"question_id": ids[0], "response": 9}])
        assert refused.value.status == 422 and refused.value.field == "events[0].response"
        with pytest.raises(NotFound):
            client.kt.predict("no_such_model", "s/1", [ids[0]])
        version = client.models.rollout("deep_gpcm").serving
        pinned = Client(url, versions={"deep_gpcm": version})
        assert pinned.kt.predict("deep_gpcm", "s/1", [ids[0]]).version == version
        with pytest.raises(NotFound):
            Client(url, versions={"deep_gpcm": "no-such-version"}).kt.predict("deep_gpcm", "s/1", [ids[0]])
        recommended = client.sessions.events("gru4rec", "v", [{"item_id": client.models.ids("gru4rec").ids[0]}],
                                             recommend_k=3)
        assert len(recommended.recommendations) == 3 and recommended.source == "model"
        schedule = client.srs.schedule("time_aware", "u", [{"card_id": "c"}], 0.9, now=NOW)
        assert schedule.cards[0].status == "new"


def test_a_call_that_spends_its_budget_says_whether_it_may_have_been_applied(redis_process, tmp_path):
    """Every answer dropped: OutcomeUnknown after the budget, and the event applied once by its three attempts.
    Redis frozen before the write (its read times out, no write is sent): Unavailable, nothing applied. Nothing
    listening: Unavailable, nothing applied."""
    redis = redis_process
    settings = Settings(artifacts_dir=demo.BUNDLED, redis_url=redis.url, redis_timeout_seconds=0.2)
    quick = Retry(attempts=3, backoff=0.01, max_backoff=0.05)
    with serving(settings) as url, Client(url, retry=quick) as client:
        ids = client.models.ids("deep_gpcm").ids
        proxy = DroppingProxy(int(url.rsplit(":", 1)[1]), drop=1.0)
        try:
            with Client(proxy.url, retry=quick) as lossy, pytest.raises(OutcomeUnknown) as lost:
                lossy.kt.events("deep_gpcm", "s", [{"question_id": ids[0], "response": 1}])
        finally:
            proxy.close()
        assert lost.value.attempts == 3 and lost.value.may_have_applied and proxy.dropped == 3
        assert client.kt.student("deep_gpcm", "s").events_total == 1
        redis.pause()
        try:
            with pytest.raises(Unavailable) as spent:
                client.kt.events("deep_gpcm", "s", [{"question_id": ids[0], "response": 1}])
        finally:
            redis.resume()
        assert spent.value.attempts == 3 and not spent.value.may_have_applied
        assert client.kt.student("deep_gpcm", "s").events_total == 1
    with Client("http://127.0.0.1:9", retry=quick) as nowhere, pytest.raises(Unavailable) as refused:
        nowhere.kt.events("deep_gpcm", "s", [{"question_id": "1", "response": 1}])
    assert not refused.value.may_have_applied


def test_the_client_imports_neither_the_service_stack_nor_the_models():
    """`pip install nextstep[client]` is httpx and pydantic: importing the client loads no FastAPI, Starlette, ONNX
    Runtime, numpy, redis or torch."""
    code = ("import sys, nextstep.client; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'fastapi', 'starlette', 'onnxruntime', 'numpy', 'redis', 'torch', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("doc", [README, GUIDE / "client.md"], ids=lambda p: p.name)
def test_the_documented_python_examples_run_on_the_demo_models(doc, capsys):
    """Each Python example of the README and the client's guide page, as a reader runs it after `make run` (the demo
    models, in-process state, no keys); an example that defines a coroutine function with no parameters is run."""
    examples = python_examples(doc)
    assert examples, f"{doc.name} shows no Python client example"
    with serving(Settings(artifacts_dir=demo.BUNDLED, redis_url=None, api_keys=[], admin_keys=[])) as url:
        for line, code in examples:
            namespace: dict = {}
            exec(compile(code.replace("http://localhost:8000", url), f"{doc.name}:{line}", "exec"), namespace)
            for value in list(namespace.values()):
                if inspect.iscoroutinefunction(value) and not inspect.signature(value).parameters:
                    assert asyncio.run(value()), f"{doc.name}:{line}: {value.__name__} answered nothing"


def test_httpx_errors_that_no_retry_mends_are_raised_at_once():
    with Client("ftp://example.invalid") as client, pytest.raises(httpx.UnsupportedProtocol):
        client.system.health()
