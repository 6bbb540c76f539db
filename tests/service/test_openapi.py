import json
import re
from pathlib import Path

from nextstep.service.app import create_app
from nextstep.service.middleware import OPEN_PATHS
from nextstep.service.openapi import render

COMMITTED = Path(__file__).resolve().parents[2] / "openapi" / "openapi.json"
PROBLEM = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}


def document() -> str:
    return render(create_app())


def operations(doc: dict):
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            yield path, method, op


def test_committed_openapi_document_matches_the_app():
    assert COMMITTED.read_text() == document(), (
        "openapi/openapi.json drifted from the app: run `make openapi` and commit the result")


def test_every_route_has_an_example_or_a_summary():
    doc = json.loads(document())
    for path, method, op in operations(doc):
        assert op.get("summary"), f"{method.upper()} {path} has no summary"
        body = op.get("requestBody")
        if body:
            schema_ref = body["content"]["application/json"]["schema"]["$ref"].split("/")[-1]
            assert doc["components"]["schemas"][schema_ref].get("examples"), f"{method.upper()} {path}: no example"
        if path.startswith("/v1/") and "{model}" in path:
            answer = op["responses"]["200"]["content"]["application/json"]
            assert answer.get("example"), f"{method.upper()} {path}: no example answer"


def test_every_route_lists_its_error_answers_each_a_problem_document():
    doc = json.loads(document())
    seen = set()
    for path, method, op in operations(doc):
        where, codes = f"{method.upper()} {path}", set(op["responses"])
        seen |= codes
        assert ("401" in codes) == (path not in OPEN_PATHS), where
        if "requestBody" in op:
            assert {"413", "415", "422"} <= codes, where
        if "{model}" in path:
            assert {"404", "422"} <= codes, where
        if re.search(r"/(events|reviews|students/\{student_id\}|\{session_id\}|users/\{user_id\})$", path):
            assert "503" in codes, where  # every route that reads or writes an entity's state
        for code, answer in op["responses"].items():
            if code[0] in "45":
                assert answer["content"] == PROBLEM and answer["description"], (where, code)
    for path in ("/v1/kt/{model}/events", "/v1/sessions/{model}/events", "/v1/srs/{model}/reviews"):
        assert "409" in doc["paths"][path]["post"]["responses"], path  # the writes: compare-and-set conflicts
    assert "503" in doc["paths"]["/readyz"]["get"]["responses"]
    assert seen >= {"200", "401", "404", "409", "413", "415", "422", "503"}
    problem = doc["components"]["schemas"]["Problem"]
    assert set(problem["required"]) == {"type", "title", "status", "detail"}
    assert {"field", "errors"} <= set(problem["properties"]) and problem.get("examples")


def test_the_api_key_scheme_covers_the_protected_routes_only():
    doc = json.loads(document())
    assert doc["components"]["securitySchemes"]["ApiKey"]["type"] == "apiKey"
    assert doc["components"]["securitySchemes"]["ApiKey"]["in"] == "header"
    assert doc["components"]["securitySchemes"]["ApiKey"]["name"] == "X-API-Key"
    paths = set()
    for path, method, op in operations(doc):
        paths.add(path)
        assert op.get("security") == (None if path in OPEN_PATHS else [{"ApiKey": []}]), f"{method} {path}"
    assert {"/healthz", "/readyz", "/metrics"} <= paths and len(paths - OPEN_PATHS) > 15


def test_schema_names_are_readable_and_every_reference_resolves():
    doc = json.loads(document())
    names = set(doc["components"]["schemas"])
    assert all(re.fullmatch(r"[A-Z][A-Za-z]{2,39}", n) for n in names), sorted(names)
    assert {"KtBatchRequest", "SessionBatchRequest", "KtPredictRequest", "SrsPredictRequest", "Problem"} <= names
    assert not names & {"HTTPValidationError", "ValidationError"}
    refs = set(re.findall(r'"\$ref": "#/components/schemas/([^"]+)"', json.dumps(doc)))
    assert refs <= names and names - refs == set(), (refs - names, names - refs)
