"""The system routes every deployment probes: liveness, readiness, Prometheus metrics, and the API's docs pages
(Swagger UI and ReDoc, their assets served from the fastapi-offline package: no CDN, /docs works offline).

    install(app)   the completed OpenAPI document (openapi.py), the docs assets, then these routes
"""

import asyncio
from importlib.resources import files

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, PlainTextResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..errors import StoreUnavailable, problem
from ..handlers import store_fault
from ..middleware import DOCS_ASSETS, OPEN_PATHS
from ..openapi import complete
from ..schemas import Health, Ready
from .common import JsonRoute, answer

router = APIRouter(route_class=JsonRoute)


@router.get("/docs", include_in_schema=False)
async def swagger_ui(request: Request) -> HTMLResponse:
    app, root = request.app, request.scope.get("root_path", "")  # (behind a proxy that serves it under a prefix)
    return get_swagger_ui_html(openapi_url=root + app.openapi_url, title=f"{app.title} - Swagger UI",
                               swagger_js_url=f"{root}{DOCS_ASSETS}/swagger-ui-bundle.js",
                               swagger_css_url=f"{root}{DOCS_ASSETS}/swagger-ui.css",
                               swagger_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png",
                               swagger_ui_parameters={"validatorUrl": None})  # (its default is online)


@router.get("/redoc", include_in_schema=False)
async def redoc(request: Request) -> HTMLResponse:
    app, root = request.app, request.scope.get("root_path", "")
    return get_redoc_html(openapi_url=root + app.openapi_url, title=f"{app.title} - ReDoc",
                          redoc_js_url=f"{root}{DOCS_ASSETS}/redoc.standalone.js",
                          redoc_favicon_url=f"{root}{DOCS_ASSETS}/favicon.png", with_google_fonts=False)


@router.get("/healthz", tags=["system"], summary="The process is alive",
            responses=answer(Health, {"status": "ok"}))
async def healthz() -> dict:
    return {"status": "ok"}


@router.get("/readyz", tags=["system"], summary="Models loaded and the state store reachable; refused artifacts",
            responses=answer(Ready, {"status": "ready", "models": 2, "serving": {"deep_gpcm": "1", "gru4rec": "1"},
                                     "refused": []}))
async def readyz(request: Request):  # (open: clients that are not admins see no paths or library messages)
    state = request.app.state
    registry = state.registry
    models = registry.models()
    details = state.access.is_admin(request.scope)
    try:
        await asyncio.wait_for(state.store.ping(), timeout=2.0)
    except (StoreUnavailable, TimeoutError) as exc:
        if isinstance(exc, TimeoutError):
            exc = StoreUnavailable("no answer to PING within 2 s")
        state.store_faults.warning("not ready: state store unavailable: %s", exc)
        return problem(503, f"state store unavailable: {store_fault(exc, details)}")
    refused = [r.as_dict(details) for r in registry.report.refused]
    if state.settings.new_versions == "manual" and not state.rollouts.read:
        return problem(503, "the versions serving are not read from the state store yet (NEXTSTEP_NEW_VERSIONS="
                            "manual): this replica would not know which version to serve", refused=refused)
    if not models:
        where = state.settings.artifacts_dir if details else "the artifacts directory (NEXTSTEP_ARTIFACTS_DIR)"
        return problem(503, f"no model loaded from {where}", refused=refused)
    # refused artifacts do not make a replica unready: what serves, serves (docs/decisions.md)
    return {"status": "ready", "models": len(models), "serving": registry.report.serving, "refused": refused}


@router.get("/metrics", tags=["system"], summary="Prometheus metrics", response_class=PlainTextResponse)
async def prometheus(request: Request) -> PlainTextResponse:
    quality = getattr(request.app.state, "quality", None)
    if quality is not None:  # (the live scores recorded since the last flush, added up)
        quality.settle()
    return PlainTextResponse(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def install(app: FastAPI) -> None:
    def openapi() -> dict:  # FastAPI's document, completed once (openapi.py): errors, security, statuses
        if app.openapi_schema is None:
            app.openapi_schema = complete(FastAPI.openapi(app), OPEN_PATHS)
        return app.openapi_schema

    app.openapi = openapi
    app.mount(DOCS_ASSETS, StaticFiles(directory=str(files("fastapi_offline") / "static")), name="docs-assets")
    app.router.routes.extend(router.routes)
