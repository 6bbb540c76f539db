"""MicroBatcher on a real step_predict graph: batched answers equal direct session.run answers, concurrent
requests share runs, requests of different shapes are never mixed, errors reach their own caller."""

import asyncio

import numpy as np
import onnxruntime as ort
import pytest

from nextstep.service.registry import LoadedModel, ModelRegistry
from nextstep.service.runtime import MicroBatcher


@pytest.fixture(scope="module")
def model(artifact_tree) -> LoadedModel:
    registry = ModelRegistry(artifact_tree)
    registry.load()
    return registry.get("attention_gpcm")  # three state tensors, one of them int64 with no per-entity axes


def random_feeds(model: LoadedModel, rng: np.random.Generator, rows: int = 1, n_questions: int = 3) -> dict:
    """step_predict feeds: random states, events and questions."""
    feeds = {}
    for s in model.state_spec:
        shape = (rows, *s["shape"])
        feeds[s["name"]] = (rng.integers(0, 20, shape) if s["dtype"] == "int64" else rng.normal(size=shape)).astype(
            s["dtype"])
    n_index = len(model.ids) + 2
    feeds["question"] = rng.integers(2, n_index, rows)
    feeds["response"] = rng.integers(0, model.extra.n_cats, rows)
    feeds["questions"] = rng.integers(2, n_index, (rows, n_questions))
    return feeds


def direct(session: ort.InferenceSession, feeds: dict) -> list[np.ndarray]:
    return session.run(None, feeds)


def assert_same(got: list[np.ndarray], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_single_request_equals_session_run(model):
    session = model.sessions["step_predict"]
    feeds = random_feeds(model, np.random.default_rng(0))
    batches = []

    async def main():
        batcher = MicroBatcher(session, on_batch=lambda rows, seconds: batches.append((rows, seconds)))
        try:
            return await batcher.run(feeds)
        finally:
            await batcher.close()

    got = asyncio.run(main())
    assert_same(got, direct(session, feeds))
    assert [rows for rows, _ in batches] == [1]
    assert batches[0][1] > 0


def run_concurrently(session, requests: list[dict], max_batch: int) -> tuple[list, list[int]]:
    """All requests at once through one batcher: (each request's outputs, rows of every session.run)."""
    batches = []

    async def main():
        batcher = MicroBatcher(session, max_batch=max_batch, on_batch=lambda rows, seconds: batches.append(rows))
        try:
            return await asyncio.gather(*(batcher.run(f) for f in requests))
        finally:
            await batcher.close()

    return asyncio.run(main()), batches


def test_concurrent_requests_are_batched_and_each_gets_its_own_rows(model):
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(1)
    requests = [random_feeds(model, rng, rows=2 if i % 10 == 0 else 1) for i in range(50)]
    results, batches = run_concurrently(session, requests, max_batch=64)
    for feeds, got in zip(requests, results, strict=True):
        assert_same(got, direct(session, feeds))
    assert sum(batches) == sum(f["question"].shape[0] for f in requests) == 55
    assert max(batches) > 1, batches  # they shared runs
    assert len(batches) < 50


def test_max_batch_caps_the_rows_of_a_run(model):
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(2)
    requests = [random_feeds(model, rng) for _ in range(40)]
    results, batches = run_concurrently(session, requests, max_batch=8)
    for feeds, got in zip(requests, results, strict=True):
        assert_same(got, direct(session, feeds))
    assert max(batches) == 8 and sum(batches) == 40


def test_requests_with_different_shapes_are_not_mixed(model):
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(3)
    sizes = [1, 3, 5, 3, 1, 5, 2] * 5  # questions per request
    requests = [random_feeds(model, rng, n_questions=m) for m in sizes]
    batches = []

    async def main():
        batcher = MicroBatcher(session, on_batch=lambda rows, seconds: batches.append(rows))
        try:
            return await asyncio.gather(*(batcher.run(f) for f in requests))
        finally:
            await batcher.close()

    results = asyncio.run(main())
    for m, feeds, got in zip(sizes, requests, results, strict=True):
        probs = got[len(model.state_spec)]
        assert probs.shape == (1, m, model.extra.n_cats)
        assert_same(got, direct(session, feeds))
    assert len(batches) >= len(set(sizes)) and sum(batches) == len(sizes)
    assert max(batches) > 1


def test_an_invalid_request_fails_only_its_caller(model):
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(4)
    good = [random_feeds(model, rng) for _ in range(10)]
    wrong_dtype = {**random_feeds(model, rng), "questions": np.array([[2.0, 3.0, 4.0]], dtype=np.float32)}
    out_of_range = {**random_feeds(model, rng), "questions": np.array([[2, 10_000, 3]])}  # same shapes as good ones
    missing = {k: v for k, v in random_feeds(model, rng).items() if k != "response"}

    async def main():
        batcher = MicroBatcher(session)
        try:
            with pytest.raises(ValueError, match="batch axis"):  # refused before it reaches the queue
                await batcher.run({**random_feeds(model, rng), "response": np.array(1)})
            return await asyncio.gather(*(batcher.run(f) for f in [*good[:5], wrong_dtype, out_of_range, missing,
                                                                     *good[5:]]), return_exceptions=True)
        finally:
            await batcher.close()

    results = asyncio.run(main())
    for i in (5, 6, 7):
        assert isinstance(results[i], Exception), results[i]
        assert not isinstance(results[i], list)
    assert "out of data bounds" in str(results[6]) or "indices" in str(results[6])
    for feeds, got in zip(good, results[:5] + results[8:], strict=True):
        assert_same(got, direct(session, feeds))


def test_session_errors_reach_the_caller_as_raised(model):
    class Broken(RuntimeError):
        pass

    class BrokenSession:
        def run(self, names, feeds):
            raise Broken("no")

    async def main():
        batcher = MicroBatcher(BrokenSession())
        try:
            with pytest.raises(Broken, match="no"):
                await batcher.run({"x": np.zeros((1, 2))})
            results = await asyncio.gather(*(batcher.run({"x": np.zeros((1, 2))}) for _ in range(5)),
                                           return_exceptions=True)
            assert all(isinstance(r, Broken) for r in results)
        finally:
            await batcher.close()
        with pytest.raises(RuntimeError, match="closed"):
            await batcher.run({"x": np.zeros((1, 2))})

    asyncio.run(main())


def test_a_cancelled_request_does_not_disturb_the_others(model):
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(5)
    requests = [random_feeds(model, rng) for _ in range(6)]

    async def main():
        batcher = MicroBatcher(session)
        try:
            tasks = [asyncio.ensure_future(batcher.run(f)) for f in requests]
            await asyncio.sleep(0)  # all queued
            tasks[2].cancel()
            return await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            await batcher.close()

    results = asyncio.run(main())
    assert isinstance(results[2], asyncio.CancelledError)
    for i in (0, 1, 3, 4, 5):
        assert_same(results[i], direct(session, requests[i]))


def test_a_lone_request_is_dispatched_at_once(model):
    """At low load nothing waits to fill a batch: with max_wait_ms of a minute, each of 20 requests in turn runs
    alone, at once (each must finish within 30 s, half the wait), and answers like session.run."""
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(6)
    requests = [random_feeds(model, rng) for _ in range(20)]
    batches = []

    async def main():
        batcher = MicroBatcher(session, max_wait_ms=60_000, on_batch=lambda rows, seconds: batches.append(rows))
        try:
            return [await asyncio.wait_for(batcher.run(feeds), timeout=30) for feeds in requests]
        finally:
            await batcher.close()

    for feeds, got in zip(requests, asyncio.run(main()), strict=True):
        assert_same(got, direct(session, feeds))
    assert batches == [1] * 20


def test_engines_release_the_batchers_of_models_replaced_by_a_reload(artifact_tree):
    import gc

    from nextstep.service.runtime import Engines

    registry = ModelRegistry(artifact_tree)
    registry.load()
    engines = Engines(max_batch=8, max_wait_ms=0)
    rng = np.random.default_rng(5)

    async def use(model):
        return await engines.run(model, "step_predict", random_feeds(model, rng))

    old = registry.get("attention_gpcm")
    asyncio.run(use(old))
    registry.load()  # a reload builds new LoadedModel objects with their own sessions
    new = registry.get("attention_gpcm")
    assert new is not old
    asyncio.run(use(new))
    del old
    gc.collect()
    assert list(engines._batchers.keys()) == [new]  # the replaced model and its batcher are gone
    asyncio.run(engines.close())


def test_run_now_runs_inline_when_idle_and_declines_when_busy(model):
    session = model.sessions["step_predict"]
    rng = np.random.default_rng(7)
    feeds = random_feeds(model, rng)
    batches = []

    async def main():
        batcher = MicroBatcher(session, on_batch=lambda rows, seconds: batches.append(rows))
        try:
            inline = batcher.run_now(feeds)  # idle: runs here, in this thread, and is recorded like any run
            assert inline is not None and batches == [1]
            queued = asyncio.ensure_future(batcher.run(random_feeds(model, rng)))
            await asyncio.sleep(0)  # queued, its run in flight
            assert batcher.run_now(feeds) is None  # busy: the caller must queue
            await queued
            with pytest.raises(ValueError, match="batch axis"):
                batcher.run_now({**feeds, "response": np.array(1)})
            return inline
        finally:
            await batcher.close()

    assert_same(asyncio.run(main()), direct(session, feeds))
