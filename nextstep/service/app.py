"""The FastAPI app: the settings, the middleware stack, the error handlers and the routes, wired together.

    create_app(settings) -> FastAPI        (`nextstep serve`, or `uvicorn --factory nextstep.service.app:create_app`)

What it holds while serving is made in lifespan.py; each task's routes and service come from its plug-in (tasks.py),
the system routes from routes/system.py and routes/models.py, the middleware from middleware.py.
"""

from fastapi import FastAPI

from . import handlers
from .access import Access
from .lifespan import lifespan
from .metrics import Metrics
from .middleware import PINNED, Service
from .routes import models, system
from .routes.common import JsonRoute
from .settings import Settings
from .tasks import plugins

PER_EVENT = ("/events", "/predict", "/next-item", "/recommend", "/reviews", "/schedule")  # POST routes tried first


def create_app(settings: Settings | None = None) -> FastAPI:
    # FastAPI's native OpenTelemetry looks for a configured provider on every request (about 5 us) even when
    # there is none; the service's own metrics are Prometheus (/metrics), so it is on only when asked for
    settings = settings or Settings()
    otel = settings.opentelemetry
    app = Service(title="NextStep", version="0.1.0", lifespan=lifespan,
                  telemetry={"tracing": otel, "metrics": otel, "logs": otel}, docs_url=None, redoc_url=None,
                  description="Predicts what a learner does next, from state kept per learner: knowledge tracing "
                              "(the response to a question), next-item sessions (the next click) and flashcards (a "
                              "review's rating, recall and answer time, and when to review).")
    app.state.settings, app.state.metrics, app.state.access = settings, Metrics(), Access(settings)
    app.state.pinned = PINNED | {p.path_prefix for p in plugins()}  # the paths X-Model-Version pins
    handlers.install(app)
    app.router.route_class = JsonRoute  # every route (Service's stack relies on it)
    # the task routes go first in the app's own route list: FastAPI's include_router would nest a router that
    # matches every request a second time, and the docs routes ahead of them would be tried on every request
    # (together about 20 us a request); these routers carry no settings of their own
    routes = [r for p in plugins() for r in p.router.routes]
    # and the per-event routes of every task first among them: the router tries routes in order, a regex each (about
    # 1 us with FastAPI's wrapper), and a flashcard predict came 15th (no path matches two of these routes, nor one of
    # them and a route moved behind it: each ends in its own word, and the catch-alls after them take GET and DELETE)
    routes.sort(key=lambda r: not ("POST" in getattr(r, "methods", ()) and r.path.endswith(PER_EVENT)))
    app.router.routes[:0] = routes
    system.install(app)  # the completed OpenAPI document, the docs pages, health, readiness, metrics
    app.router.routes.extend(models.router.routes)  # /v1/models...: list, ids, quality, rollouts, migrate, reload
    return app
