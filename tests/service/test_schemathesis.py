"""Property-based HTTP tests generated from the committed OpenAPI document: no input may cause a 5xx, and every
successful answer conforms to its schema in the document."""

from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import response_schema_conformance

from nextstep.service.settings import Settings

pytestmark = pytest.mark.slow  # property-based fuzzing of every route (make test-all)

SCHEMA = schemathesis.openapi.from_path(Path(__file__).resolve().parents[2] / "openapi" / "openapi.json")


@pytest.fixture(scope="module")
def base_url(artifacts, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, max_events=50, max_questions=50)) as url:
        yield url


@SCHEMA.parametrize()
@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_server_errors(case, base_url):
    if "{model}" in case.path and case.path_parameters:
        case.path_parameters["model"] = "deep_gpcm"  # random model names only exercise the 404 path
    response = case.call(base_url=base_url, timeout=30)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    if response.status_code < 300:
        case.validate_response(response, checks=[response_schema_conformance])
