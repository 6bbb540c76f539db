"""Live quality (issue 35, parts 1 and 5): each event scores the prediction the serving version would have made for it.

The arithmetic against scikit-learn and numpy on random predictions; then a held-out test file replayed through the
HTTP API, learner by learner, whose live log loss is `nextstep evaluate`'s on the same sequences and whose bucketed
AUC is the exact one's to 0.002 (in-process and Redis, where every replica's scores add up in Redis)."""

import asyncio
import json

import httpx
import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from nextstep.service.quality import BINS, Quality, event_scores, fields_of, summary
from nextstep.service.settings import Settings


def random_predictions(n: int, k: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, k)) * 2
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    responses = np.array([rng.choice(k, p=p) for p in probs])  # calibrated: drawn from the predictions
    return probs, responses


@pytest.mark.parametrize("k", [2, 4])
def test_the_sums_give_the_mean_scores_the_auc_and_a_calibration_table(k):
    probs, responses = random_predictions(3000, k, seed=k)
    halves = [fields_of(probs[:1000], responses[:1000]), fields_of(probs[1000:], responses[1000:])]
    sums: dict[str, float] = {}
    for fields in halves:  # two replicas' (or minutes') sums add up
        for name, value in fields.items():
            sums[name] = sums.get(name, 0.0) + value
    got = summary(sums)
    observed = probs[np.arange(3000), responses]
    assert got["scored"] == 3000
    assert got["log_loss"] == pytest.approx(-np.log(observed).mean(), abs=1e-9)
    onehot = np.eye(k)[responses]
    assert got["brier"] == pytest.approx(((probs - onehot) ** 2).sum(1).mean(), abs=1e-9)
    full = responses == k - 1
    assert got["auc"] == pytest.approx(roc_auc_score(full, probs[:, k - 1]), abs=0.002)
    table = got["calibration"]
    assert sum(row["count"] for row in table) == 3000 and len(table) == 10
    for row in table:  # the predictions are calibrated: observed near predicted where the counts allow
        if row["count"] >= 200:
            assert abs(row["observed"] - row["predicted"]) < 0.1, row
    empty = summary({})
    assert (empty["scored"], empty["log_loss"], empty["auc"]) == (0, None, None)


def test_a_certain_wrong_prediction_is_a_large_finite_loss():
    scores = event_scores(np.array([[1.0, 0.0], [0.5, 0.5]]), np.array([1, 0]))
    assert scores["log_loss"].tolist() == pytest.approx([-np.log(1e-12), np.log(2)])
    assert scores["brier"].tolist() == [2.0, 0.5]
    assert fields_of(np.array([[0.0, 1.0]]), np.array([1]))[f"p{BINS - 1}"] == 1  # P = 1 falls in the top bucket


def test_buckets_add_over_minutes_and_a_window_leaves_older_ones_out():
    now = [1_800_000_000.0]
    quality = Quality(None, clock=lambda: now[0])
    probs, responses = random_predictions(50, 2, seed=1)

    async def body() -> list[dict]:
        quality.record("m", "1", probs[:20], responses[:20])
        await quality.flush()
        now[0] += 3 * 60
        quality.record("m", "1", probs[20:], responses[20:])
        recent = await quality.report("m", [("1", "serving"), ("2", "serving")], window=120)
        everything = await quality.report("m", [("1", "serving")], window=600)
        return recent + everything

    recent, other, everything = asyncio.run(body())
    assert (recent["scored"], other["scored"], everything["scored"]) == (30, 0, 50)
    assert other["since"] is None and everything["since"] == 1_800_000_000.0
    assert everything["log_loss"] == pytest.approx(event_scores(probs, responses)["log_loss"].mean())


def test_a_replayed_test_file_scores_what_evaluate_measures(artifacts, store_url, serve):
    """Part 5: every test learner's events, in order, through POST /v1/kt/{model}/events (four requests each); the
    live log loss equals `nextstep evaluate`'s NLL on the same sequences (1e-6) and the bucketed AUC the exact AUC
    of the same predictions (0.002)."""
    from nextstep.training.kt.data import load_dataset
    from nextstep.training.kt.run import evaluate_artifact

    art, data = artifacts
    _, test = load_dataset(data)
    ids = [str(q) for q in json.loads((art / "deep_gpcm" / "v1" / "vocab_questions.json").read_text())["ids"]]
    sequences = [s for s in test.sequences if all(str(q) in ids for q in s.questions)]
    assert len(sequences) == len(test.sequences)  # (every test question is known: the same events as evaluate's)
    offline = evaluate_artifact(art / "deep_gpcm" / "v1", data)
    with serve(Settings(artifacts_dir=art, redis_url=store_url)) as url, httpx.Client(base_url=url, timeout=30) as http:
        before = http.get("/v1/models/deep_gpcm/quality").json()["versions"]
        exact_p, exact_y = [], []
        for n, s in enumerate(sequences):
            events = [{"question_id": str(q), "response": int(r)} for q, r in zip(s.questions, s.responses,
                                                                                    strict=True)]
            for part in (events[:1], events[1:2], events[2:6], events[6:]):  # (one event: scored.py; more: a job)
                assert http.post("/v1/kt/deep_gpcm/events", json={"student_id": f"test-{n}-{store_url is None}",
                                                                  "events": part}).status_code == 200
            batch = http.post("/v1/kt/deep_gpcm/batch", json={"students": [{"student_id": "x", "events": events}]})
            exact_p += [p["probabilities"][-1] for p in batch.json()["students"][0]["event_predictions"]]
            exact_y += [e["response"] == test.n_cats - 1 for e in events]
        reply = http.get("/v1/models/deep_gpcm/quality", params={"window": 600})
        assert reply.status_code == 200, reply.text
        (live,) = reply.json()["versions"]
        assert (live["version"], live["role"]) == ("v1", "serving")
        n_events = sum(len(s.questions) for s in sequences)
        assert (before[0]["scored"], before[0]["since"], live["scored"]) == (0, None, n_events)
        assert live["log_loss"] == pytest.approx(offline["nll"], abs=1e-6)
        assert live["auc"] == pytest.approx(roc_auc_score(exact_y, exact_p), abs=0.002)
        assert http.get("/v1/models/deep_gpcm/quality", params={"window": 10}).status_code == 422
        assert http.get("/v1/models/nope/quality").status_code == 404
        metrics = http.get("/metrics").text
        assert 'nextstep_live_scored_total{model="deep_gpcm",role="serving",version="v1"}' in metrics


def test_single_events_are_scored_together_after_their_answers(tmp_path, serve):
    """A request of one event runs one graph call (the step, or step_predict when it asks a question); its score
    waits, with those of other single-event requests, for one `predict` call with a row per event, off the request
    path. A request of several events is scored after the answer, by a job that keeps only the predictions: a
    `predict` call from the state before the first, a `step_predict` for each later one, and not the step after the
    last that the request has already run."""
    import shutil
    from pathlib import Path

    import nextstep

    demo = Path(nextstep.__file__).parent / "demo_artifacts" / "deep_gpcm" / "demo"
    shutil.copytree(demo, tmp_path / "deep_gpcm" / "1")
    question = str(json.loads((tmp_path / "deep_gpcm" / "1" / "vocab_questions.json").read_text())["ids"][3])

    def calls(metrics: str, kind: str = "count") -> dict[str, int]:
        out = {}
        for line in metrics.splitlines():
            if line.startswith(f"nextstep_microbatch_rows_{kind}{{") and 'model="deep_gpcm"' in line:
                graph = line.split('graph="')[1].split('"')[0]
                out[graph] = out.get(graph, 0) + int(float(line.split()[-1]))
        return out

    with serve(Settings(artifacts_dir=tmp_path)) as url, httpx.Client(base_url=url, timeout=30) as http:
        def send(events: int, asked: bool, student: str = "ada") -> None:
            body = {"student_id": student, "events": [{"question_id": question, "response": n % 2}
                                                      for n in range(events)],
                    **({"predict_question_ids": [question]} if asked else {})}
            assert http.post("/v1/kt/deep_gpcm/events", json=body).status_code == 200

        for n in range(1, 6):
            send(1, asked=n == 5, student=f"s{n % 2}")
        (live,) = http.get("/v1/models/deep_gpcm/quality").json()["versions"]  # (scores what waits, first)
        assert live["scored"] == 5
        metrics = http.get("/metrics").text
        assert calls(metrics, "sum") == {"step": 4, "step_predict": 1, "predict": 5}  # (rows)
        assert calls(metrics)["step"] == 4 and calls(metrics)["step_predict"] == 1
        send(3, asked=False)
        (live,) = http.get("/v1/models/deep_gpcm/quality").json()["versions"]
        assert live["scored"] == 8
        assert calls(http.get("/metrics").text, "sum") == {"step": 4, "step_predict": 3, "predict": 6, "fold": 1}


def test_pending_events_are_scored_in_batches_when_enough_wait_or_at_the_flush():
    """`pend` keeps a group's items until BATCH wait (then one job takes them) or the next flush; groups never mix;
    /quality's drain and a shutdown score what waits; a full queue drops a batch, counted as the requests it held."""
    from nextstep.service.quality import BATCH

    async def run() -> None:
        ran: list[tuple[str, list]] = []

        def job(group: str):
            async def score(items: list) -> None:
                ran.append((group, list(items)))
            return score

        quality = Quality(None, flush_seconds=3600)
        await quality.start()
        for i in range(BATCH + 3):
            quality.pend("m", "a", i, job("a"))
        quality.pend("m", "b", "x", job("b"))
        await asyncio.sleep(0.05)
        assert ran == [("a", list(range(BATCH)))]  # a full batch at once, the rest waits
        await quality.drain()
        assert sorted(ran[1:]) == [("a", [BATCH, BATCH + 1, BATCH + 2]), ("b", ["x"])]
        await quality.close()

        ran.clear()
        quality = Quality(None, flush_seconds=0.05)
        await quality.start()
        quality.pend("m", "a", 1, job("a"))
        await asyncio.sleep(0.3)
        assert ran == [("a", [1])]  # the flush scored it, no drain needed
        await quality.close()

        quality = Quality(None, flush_seconds=3600)
        await quality.start()
        quality.pend("m", "c", 2, job("c"))
        await quality.close()  # (a shutdown scores what waits)
        assert ran == [("a", [1]), ("c", [2])]
        ran.remove(("c", [2]))

        dropped: list[tuple[str, int]] = []
        quality = Quality(None, flush_seconds=3600, queue=1, on_drop=lambda model, n: dropped.append((model, n)))
        for i in range(3):  # no worker started: the batch is dropped, its three requests counted
            quality.pend("m", "a", i, job("a"))
        await quality.drain()
        assert dropped == [("m", 3)] and ran == [("a", [1])]

    asyncio.run(run())


def test_records_are_added_up_in_batches_when_flushed_or_once_enough_wait():
    """`record` only keeps what it is given (the request path); `settle` (a flush, a report, a scrape of /metrics)
    adds it up, in one batch per version and role, to the same sums as event by event; SETTLE_AT records waiting
    are added up at once."""
    from nextstep.service import quality as module

    added: list[tuple] = []
    quality = Quality(None, on_record=lambda key, fields: added.append((key, fields)))
    probs, responses = random_predictions(40, 3, seed=2)
    for i in range(40):
        quality.record("m", "1", probs[i:i + 1], responses[i:i + 1], "serving" if i % 2 else "shadow")
    quality.record_ranks("s", "1", [1.0, float("inf")])
    assert added == []
    quality.settle()
    by_key = {key: fields for key, fields in added}
    assert set(by_key) == {("m", "1", "serving"), ("m", "1", "shadow"), ("s", "1", "serving")}
    for role, first in (("serving", 1), ("shadow", 0)):
        want = fields_of(probs[first::2], responses[first::2])
        assert by_key[("m", "1", role)] == pytest.approx(want)
        assert want["n"] == 20 and want["ll"] == pytest.approx(event_scores(probs[first::2],
                                                                            responses[first::2])["log_loss"].sum())
    assert by_key[("s", "1", "serving")]["n"] == 2 and by_key[("s", "1", "serving")]["rr"] == 1.0
    added.clear()
    for _ in range(module.SETTLE_AT):
        quality.record("m", "1", probs[:1], responses[:1])
    assert [fields["n"] for _, fields in added] == [module.SETTLE_AT]
