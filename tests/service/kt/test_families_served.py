"""Every knowledge-tracing family in the registry, trained for real, is served on the KT routes with its state in
a real Redis, and the served answers equal the offline model's teacher-forced predictions. A family added to the
registry is tested here without a new test (SimAKT, which also needs memory banks, has test_simakt_api.py)."""

import httpx
import numpy as np
import pytest
import torch

from nextstep.service.settings import Settings
from nextstep.training.families import by_task
from nextstep.training.kt.data import load_dataset
from nextstep.training.kt.run import load_model

pytestmark = pytest.mark.slow  # trains and serves every knowledge-tracing family (make test-all)

FAMILIES = [f for f in by_task("knowledge_tracing") if f.name != "simakt"]  # trained: conftest kt_families


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_served_answers_equal_the_offline_model(name, kt_families, redis_url, serve):
    artifacts, data = kt_families
    model, vocab, manifest = load_model(artifacts / name / "1")
    assert model.family == name and manifest["task"] == "knowledge_tracing"
    seq = load_dataset(data)[1].sequences[0]
    questions, responses = seq.questions.tolist(), seq.responses.tolist()
    with torch.no_grad():
        expected = model(torch.from_numpy(vocab.encode(seq.questions))[None],
                         torch.from_numpy(seq.responses)[None]).log_probs.exp()[0].numpy()
    with serve(Settings(artifacts_dir=artifacts, redis_url=redis_url)) as url, httpx.Client(base_url=url) as http:
        for t in range(len(questions) - 1):
            body = {"student_id": "s-1", "events": [{"question_id": questions[t], "response": responses[t],
                                                     "event_id": f"e{t}"}],
                    "predict_question_ids": [questions[t + 1]]}
            reply = http.post(f"/v1/kt/{name}/events", json=body)
            assert reply.status_code == 200, reply.text
            np.testing.assert_allclose(reply.json()["predictions"][0]["probabilities"], expected[t + 1], atol=1e-5)
        replay = http.post(f"/v1/kt/{name}/events", json={"student_id": "s-1", "events": [
            {"question_id": questions[0], "response": responses[0], "event_id": "e0"}]}).json()
        assert replay["events_skipped"] == 1 and replay["events_total"] == len(questions) - 1
        predicted = http.post(f"/v1/kt/{name}/predict", json={"student_id": "s-1", "question_ids": [questions[-1]]})
        np.testing.assert_allclose(predicted.json()["predictions"][0]["probabilities"], expected[-1], atol=1e-5)
        assert http.delete(f"/v1/kt/{name}/students/s-1").json()["deleted"] is True
