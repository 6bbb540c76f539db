"""app.py: the service's middleware stack (Service, ServiceMiddleware), and what every error becomes through it."""

import httpx
from fastapi import HTTPException
from fastapi.routing import APIRoute
from starlette.middleware.errors import ServerErrorMiddleware

from nextstep.service.app import create_app
from nextstep.service.middleware import ServiceMiddleware
from nextstep.service.routes.common import JsonRoute
from nextstep.service.schemas import Strict
from nextstep.service.settings import Settings


def test_the_stack_is_the_last_resort_then_the_service_middleware_then_the_router(tmp_path):
    app = create_app(Settings(artifacts_dir=tmp_path))
    stack = app.build_middleware_stack()
    assert isinstance(stack, ServerErrorMiddleware) and isinstance(stack.app, ServiceMiddleware)
    assert stack.app.app is app.router
    # FastAPI's own handling needs an exit stack in the scope; JsonRoute opens one off the fast path
    api = [r for r in app.routes if isinstance(r, APIRoute)]
    assert len(api) > 20 and all(isinstance(r, JsonRoute) for r in api), [r.path for r in api]


def test_the_per_event_routes_are_tried_first_and_no_path_of_theirs_meets_another_route(tmp_path):
    """The router tries routes in order (a regex each): every task's per-event POST routes come first, in the tasks'
    order, and no route behind one of them takes a POST to its path (the order changed nothing but the cost)."""
    app = create_app(Settings(artifacts_dir=tmp_path, redis_url=None))
    routes = [r for r in app.router.routes if isinstance(r, APIRoute)]
    first = ["/v1/kt/{model}/events", "/v1/kt/{model}/predict", "/v1/kt/{model}/next-item",
             "/v1/sessions/{model}/events", "/v1/sessions/{model}/recommend", "/v1/srs/{model}/reviews",
             "/v1/srs/{model}/predict", "/v1/srs/{model}/schedule"]
    assert [r.path for r in routes[:len(first)]] == first
    for route in routes[:len(first)]:
        path = route.path.replace("{model}", "m")
        scope = {"type": "http", "method": "POST", "path": path, "root_path": ""}
        takers = [r.path for r in routes if "POST" in r.methods and r.matches(scope)[0].name == "FULL"]
        assert takers == [route.path]


def test_every_error_gets_its_handlers_answer_and_is_counted(artifacts, serve):
    art, _ = artifacts
    settings = Settings(artifacts_dir=art)
    app = create_app(settings)

    @app.post("/teapot")
    async def teapot(body: dict) -> dict:
        raise HTTPException(418, "short and stout")

    @app.post("/bug")
    async def bug(body: Strict) -> dict:  # (a body model: the fast path)
        raise RuntimeError("a bug")

    assert app.router.routes[-1]._plan() is not None and app.router.routes[-2]._plan() is None
    with serve(settings, app) as url:
        with httpx.Client(base_url=url) as http:
            nowhere = http.get("/nowhere")
            assert nowhere.status_code == 404 and nowhere.headers["content-type"] == "application/problem+json"
            assert nowhere.json() == {"type": "about:blank", "title": "Not Found", "status": 404, "detail": "Not Found"}
            wrong_method = http.put("/healthz")
            assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "GET", wrong_method.headers
            unknown = http.post("/v1/kt/nobody/events", json={"student_id": "s", "events": [
                {"question_id": 1, "response": 1}]})  # the fast path: the error comes out of the route
            assert unknown.status_code == 404 and unknown.json()["field"] == "model", unknown.text
            assert unknown.json()["type"] == "urn:nextstep:problem:unknown-model"
            assert "nobody" in unknown.json()["detail"]
            slow = http.get("/v1/kt/nobody/students/s")  # FastAPI's handling: the route's own error handling
            assert slow.status_code == 404 and slow.json()["field"] == "model", slow.text
            tea = http.post("/teapot", json={})
            assert tea.status_code == 418 and tea.json()["detail"] == "short and stout"
            broken = http.post("/bug", json={})
            assert broken.status_code == 500 and broken.json()["title"] == "Internal Server Error", broken.text
            assert "a bug" not in broken.text  # nothing of the exception goes out
        with httpx.Client(base_url=url) as http:  # (uvicorn closes the connection of a 500 that was raised)
            assert http.get("/healthz").json() == {"status": "ok"}  # and the service goes on
            scrape = http.get("/metrics").text
    for route, status, n in (("unmatched", 404, 1), ("/healthz", 405, 1), ("/v1/kt/{model}/events", 404, 1),
                             ("/teapot", 418, 1), ("/bug", 500, 1)):
        assert f'nextstep_requests_total{{model="",route="{route}",status="{status}"}} {n}.0' in scrape, (route, status)


def test_the_docs_pages_work_offline_and_without_an_api_key(artifacts, serve):
    import json
    import re
    from pathlib import Path

    art, _ = artifacts
    committed = json.loads((Path(__file__).resolve().parents[2] / "openapi" / "openapi.json").read_text())
    key = "user-key-0123456789abcdef"
    with serve(Settings(artifacts_dir=art, api_keys=[key])) as url, httpx.Client(base_url=url) as http:
        assert http.get("/v1/models").status_code == 401  # the keys are on
        assert http.get("/openapi.json").json() == committed
        pages = {"/docs": ("swagger-ui-bundle.js", "swagger-ui.css"), "/redoc": ("redoc.standalone.js",)}
        for page, needs in pages.items():
            html = http.get(page)
            assert html.status_code == 200 and html.headers["content-type"].startswith("text/html"), page
            assert not re.search(r"(https?:)?//[a-z0-9]", html.text, re.I), f"{page} names an external URL"
            assets = re.findall(r'(?:src|href)="([^"]+)"', html.text)
            assert all(any(a.endswith(n) for a in assets) for n in needs), (page, assets)
            for asset in assets:
                got = http.get(asset)
                assert got.status_code == 200 and len(got.content) > 1000, (page, asset, got.status_code)
            assert "'/openapi.json'" in html.text or '"/openapi.json"' in html.text, page
        assert http.get("/docs/assets/nothing.js").status_code == 401  # only the listed files are open
