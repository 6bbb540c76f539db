from pathlib import Path

from nextstep.service.openapi import render

COMMITTED = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"


def test_committed_openapi_document_matches_the_app():
    assert COMMITTED.read_text() == render(), (
        "openapi/openapi.json drifted from the app: run `make openapi` and commit the result")


def test_every_route_has_an_example_or_a_summary():
    import json

    doc = json.loads(render())
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            assert op.get("summary"), f"{method.upper()} {path} has no summary"
            body = op.get("requestBody")
            if body:
                schema_ref = body["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
                assert doc["components"]["schemas"][schema_ref].get("examples"), f"{method.upper()} {path}: no example"
