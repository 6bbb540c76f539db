"""`make run` on a fresh checkout: `nextstep serve --demo` with an empty artifacts directory serves the demo models
bundled in the package, one per task, without torch; the README's curl example for each task answers (real process,
real HTTP, real ONNX Runtime), and so does every other curl call the README and the guide (docs/guide/) show. And
the bundle is what its documented command builds from generated data."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import onnx
import pytest

from nextstep import demo
from nextstep.service.registry import load_artifact
from nextstep.service.settings import Settings
from tests.cli_script import cli_without
from tests.doc_examples import README, curl_calls, user_docs

ROOT = Path(__file__).resolve().parents[2]
HEALTHZ_PROMISE_S = 30.0  # `make run`'s bound here (docs/guide/operations.md: 0.5 s measured); this test prints its own
TASK_OF = {"kt": "knowledge_tracing", "sessions": "next_item", "srs": "srs"}

# runs `nextstep` with torch unimportable: serving the demo must not need it
WITHOUT_TORCH = cli_without("torch")


def readme_examples() -> dict[str, tuple[str, dict]]:
    """{route prefix: (path, JSON body)} of the README's first POST example of each task (`/v1/<prefix>/...`)."""
    examples = {}
    for call in curl_calls(README):
        prefix = call.path.split("/")[2]
        if call.method == "POST" and prefix in TASK_OF:
            examples.setdefault(prefix, (call.path, call.body))
    assert set(examples) == set(TASK_OF), f"README examples found for {sorted(examples)}"
    return examples


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def check_answer(prefix: str, body: dict, reply: httpx.Response) -> dict:
    assert reply.status_code == 200, reply.text
    got = reply.json()
    if prefix == "kt":
        (prediction,) = got["predictions"]
        assert prediction["question_id"] == body["predict_question_ids"][0]
        probabilities = prediction["probabilities"]
        assert math.isclose(sum(probabilities), 1.0, abs_tol=1e-4) and len(probabilities) == 4
        assert got["events_absorbed"] == len(body["events"])
    elif prefix == "sessions":
        items = [r["item_id"] for r in got["recommendations"]]
        assert len(items) == body["recommend_k"] and got["source"] == "model"
        assert not {e["item_id"] for e in body["events"]} & set(items)  # the clicked item is left out
    else:
        prediction = got["prediction"]
        assert math.isclose(sum(prediction["p_rating"].values()), 1.0, abs_tol=1e-4)
        assert 0 < prediction["p_recall"] < 1 and prediction["expected_duration_s"] > 0
        assert got["applied"] == len(body["reviews"])
    return got


def test_serve_demo_answers_the_readme_examples_for_all_three_tasks_without_torch(tmp_path):
    empty = tmp_path / "artifacts"
    empty.mkdir()
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTEP_")}  # in-process state, no keys
    env["PYTHONPATH"] = str(ROOT)
    log = (tmp_path / "serve.log").open("w")
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-c", WITHOUT_TORCH, "serve", "--demo", "--artifacts", str(empty),
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as http:
            while True:
                try:
                    if http.get("/healthz").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert proc.poll() is None, (tmp_path / "serve.log").read_text()
                assert time.monotonic() - started < HEALTHZ_PROMISE_S, f"no /healthz within {HEALTHZ_PROMISE_S} s"
                time.sleep(0.05)
            print(f"/healthz answered {time.monotonic() - started:.1f} s after `nextstep serve --demo` started")
            models = {m["name"]: m for m in http.get("/v1/models").json()["models"]}
            assert {name: m["task"] for name, m in models.items()} == \
                {"deep_gpcm": "knowledge_tracing", "gru4rec": "next_item", "time_aware": "srs"}
            assert all(m["version"] == demo.VERSION for m in models.values())
            for prefix, (path, body) in readme_examples().items():
                name = path.split("/")[3]
                assert models[name]["task"] == TASK_OF[prefix], path
                check_answer(prefix, body, http.post(path, json=body))
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        log.close()
    printed = (tmp_path / "serve.log").read_text()
    assert "serving the bundled demo models" in printed and "Traceback" not in printed


def test_serve_without_demo_refuses_an_empty_directory(tmp_path):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("NEXTSTEP_")}, "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, "-m", "nextstep.cli", "serve", "--artifacts", str(tmp_path)],
                            capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert f"no artifacts under {tmp_path}" in result.stderr and "--demo" in result.stderr


def test_bundle_holds_only_what_the_service_reads_and_loads():
    for name in demo.MODELS:
        path = demo.BUNDLED / name / demo.VERSION
        manifest = json.loads((path / "manifest.json").read_text())
        wanted = {"manifest.json", *(g["onnx"] for g in manifest["graphs"].values()),
                  *(s["file"] for s in manifest.get("state", [])), *manifest.get("vocabularies", {}).values()}
        assert {p.name for p in path.iterdir()} == wanted, name
        assert manifest["demo"]["built_by"] == demo.COMMAND and manifest["parity"]["passed"] is True
        assert not any("/" in str(v) for v in manifest["data"].values()), "no paths of the machine that built it"
        loaded = load_artifact(path)
        assert loaded.name == name and loaded.version == demo.VERSION


# -- the bundle is what `python -m nextstep.demo` builds --------------------------------------------------------


@pytest.mark.slow
def test_the_bundle_is_rebuilt_from_the_same_generated_data_and_settings(demo_rebuilt):
    for name in demo.MODELS:
        bundled = json.loads((demo.BUNDLED / name / demo.VERSION / "manifest.json").read_text())
        again = json.loads((demo_rebuilt / "out" / name / demo.VERSION / "manifest.json").read_text())
        # the data fingerprint is a hash of the generated files: the bundle came from this generator, these seeds
        assert again["data"] == bundled["data"], name
        for key in ("task", "family", "graphs", "state", "vocabularies", "train_config", "model_config", "demo"):
            assert again.get(key) == bundled.get(key), (name, key)
        assert sorted(p.name for p in (demo_rebuilt / "out" / name / demo.VERSION).iterdir()) == \
            sorted(p.name for p in (demo.BUNDLED / name / demo.VERSION).iterdir())
        for vocab in bundled.get("vocabularies", {}).values():
            assert (demo_rebuilt / "out" / name / demo.VERSION / vocab).read_text() == \
                (demo.BUNDLED / name / demo.VERSION / vocab).read_text()


@pytest.mark.slow
def test_the_bundled_models_answer_as_the_rebuilt_ones(demo_rebuilt, serve):
    """Training is seeded and single-threaded: the rebuilt models answer the README's examples as the bundle does
    (a bundle left stale by a change to training or export fails here: rebuild it with `make demo-artifacts`).

    Not to the last digit on every machine: CPUs with other vector units round differently (MKL and ATen pick
    AVX2 or AVX-512 kernels), and the optimiser carries that on. Rebuilt on an AVX-512/AMX machine, the bundle built
    on another answered within 2.1e-3 (deep_gpcm's theta; its probabilities within 5.6e-4, gru4rec's scores within
    3.4e-5, time_aware's within 6e-8): the tolerance is about five times that."""
    answers = {}
    for which, path in (("bundled", demo.BUNDLED), ("rebuilt", demo_rebuilt / "out")):
        with serve(Settings(artifacts_dir=path)) as url, httpx.Client(base_url=url) as http:
            answers[which] = {prefix: check_answer(prefix, body, http.post(p, json=body))
                              for prefix, (p, body) in readme_examples().items()}

    def numbers(value, at=""):
        if isinstance(value, dict):
            for k, v in value.items():
                yield from numbers(v, f"{at}.{k}")
        elif isinstance(value, list):
            for i, v in enumerate(value):
                yield from numbers(v, f"{at}[{i}]")
        elif isinstance(value, float):
            yield at, value

    for prefix in TASK_OF:
        a, b = dict(numbers(answers["bundled"][prefix])), dict(numbers(answers["rebuilt"][prefix]))
        assert a.keys() == b.keys() and a, prefix
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-2, abs=1e-2), (prefix, key)
    assert [r["item_id"] for r in answers["bundled"]["sessions"]["recommendations"]] == \
        [r["item_id"] for r in answers["rebuilt"]["sessions"]["recommendations"]]


@pytest.mark.slow
def test_slimming_drops_only_debug_metadata(demo_rebuilt):
    """The bundled graphs are the exported ones without per-node metadata: same nodes, same weights."""
    checked = 0
    for name in demo.MODELS:
        exported = demo_rebuilt / "work" / "artifacts" / name
        for graph in json.loads((exported / "manifest.json").read_text())["graphs"].values():
            full = onnx.load(str(exported / graph["onnx"]))
            slim = onnx.load(str(demo_rebuilt / "out" / name / demo.VERSION / graph["onnx"]))
            assert [(n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
                    for n in full.graph.node] == \
                   [(n.op_type, list(n.input), list(n.output), [a.SerializeToString() for a in n.attribute])
                    for n in slim.graph.node]
            assert [i.SerializeToString() for i in full.graph.initializer] == \
                   [i.SerializeToString() for i in slim.graph.initializer]
            assert full.graph.input == slim.graph.input and full.graph.output == slim.graph.output
            assert not any(n.metadata_props for n in slim.graph.node)
            assert slim.ByteSize() < full.ByteSize()
            checked += 1
    assert checked >= 7


@pytest.mark.parametrize("doc", user_docs(), ids=lambda p: p.name)
def test_every_documented_call_answers_on_the_demo_models(doc, serve):
    """Each page's curl calls, in the page's order, on a fresh service with the bundled demo models (in-process
    state, no keys): what a reader who pastes them into a shell after `make run` gets. Each answers 2xx."""
    calls = curl_calls(doc)
    settings = Settings(artifacts_dir=demo.BUNDLED, redis_url=None, api_keys=[], admin_keys=[])
    with serve(settings) as url, httpx.Client(base_url=url, timeout=10) as http:
        for call in calls:
            reply = http.request(call.method, call.path, headers=call.headers,
                                 content=None if call.body is None else json.dumps(call.body))
            assert 200 <= reply.status_code < 300, f"{call}: {reply.status_code} {reply.text}"
            if call.path.endswith("/schedule"):  # (a schedule shown should schedule: `now` after the reviews)
                assert any(c["status"] == "scheduled" for c in reply.json()["cards"]), f"{call}: {reply.text}"
