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
from nextstep.training.kt.loop import TrainConfig
from nextstep.training.kt.run import load_model, train_model
from nextstep.training.kt.synthetic import write_gpcm_dataset

pytestmark = pytest.mark.slow  # trains and serves every knowledge-tracing family (make test-all)

# small sizes for whichever of these settings a family's config has
TINY = {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8, "embed_dim": 8, "n_heads": 2, "window": 4,
        "hidden": 8}
FAMILIES = [f for f in by_task("knowledge_tracing") if f.name != "simakt"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    data = write_gpcm_dataset(root / "data", n_students=40, n_questions=12, seq_len_range=(10, 14), seed=11)
    for entry in FAMILIES:
        small = {k: v for k, v in TINY.items() if k in entry.config_fields()}
        manifest = train_model(entry.name, data, root / "artifacts" / entry.name / "1",
                               cfg=TrainConfig(epochs=1, model=small), progress=False, log=False)
        assert manifest["parity"]["passed"], (entry.name, manifest["parity"])
    return root / "artifacts", data


@pytest.mark.parametrize("name", [f.name for f in FAMILIES])
def test_served_answers_equal_the_offline_model(name, trained, redis_url, serve):
    artifacts, data = trained
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
