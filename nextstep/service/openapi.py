"""The service's OpenAPI document: FastAPI's, completed with what FastAPI does not know of the service.

    complete(doc, open_paths) -> doc     (app.py serves the completed document at /openapi.json)
    render(app) -> str                   the document as committed (`nextstep openapi [PATH]`, `make openapi`)

Completed: every error answer is a `Problem` (application/problem+json) in place of FastAPI's validation-error
schemas; every route outside `open_paths` declares the `X-API-Key` security scheme and its 401; every route that
takes a body declares 413 (over the size limit), 415 (not application/json) and 422; the routes' own statuses
(routes/common.py `problems`) get their descriptions there.
"""

import json

from .errors import Problem
from .routes.common import PROBLEMS

SCHEME = "ApiKey"
PROBLEM_CONTENT = {"application/problem+json": {"schema": {"$ref": "#/components/schemas/Problem"}}}
# statuses of routes that do not declare them (app.py's system routes)
EXTRA = {("get", "/readyz"): {503: "Models are not loaded yet, or the state store cannot be reached."}}


def complete(doc: dict, open_paths: set[str]) -> dict:
    components = doc.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape; the service answers Problem
        schemas.pop(name, None)
    problem = Problem.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(problem.pop("$defs", {}))
    schemas["Problem"] = problem
    components["securitySchemes"] = {SCHEME: {
        "type": "apiKey", "in": "header", "name": "X-API-Key",
        "description": "One of the service's API keys (NEXTSTEP_API_KEYS); not needed when it has none."}}
    for path, methods in doc.get("paths", {}).items():
        for method, op in methods.items():
            responses = op.setdefault("responses", {})
            statuses = dict(EXTRA.get((method, path), {}))
            if path not in open_paths:
                op["security"] = [{SCHEME: []}]
                statuses[401] = PROBLEMS[401]
            if "requestBody" in op:
                statuses.update({s: PROBLEMS[s] for s in (413, 415, 422)})
            for status, description in statuses.items():
                responses.setdefault(str(status), {"description": description})
            for status, response in responses.items():
                if status[0] in "45":
                    if response.get("description") in (None, "", "Validation Error"):
                        response["description"] = PROBLEMS.get(int(status), "An error.")
                    response["content"] = PROBLEM_CONTENT
            op["responses"] = dict(sorted(responses.items()))
    return doc


def render(app) -> str:
    """The app's OpenAPI document as committed in openapi/openapi.json (`nextstep openapi` writes it)."""
    return json.dumps(app.openapi(), indent=2, sort_keys=True) + "\n"
