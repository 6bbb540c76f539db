"""How the service is put together: what importing a part of it pulls in, and the task plug-ins."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _imported(code: str) -> list[str]:
    """The modules of the Redis clients (redis-py, hiredis, ours) a fresh interpreter holds after `code`."""
    probe = (f"{code}\nimport sys\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('redis', 'hiredis') "
             "or m in ('nextstep.service.redis_clients', 'nextstep.service.resp', 'nextstep.service.redis_store')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # noqa: S307 (a list of names we printed)


def test_offline_scoring_imports_no_redis_client() -> None:
    """`nextstep score` replays learners through the in-process store: importing it (and the store, and every task
    module) loads no Redis client, ours or redis-py."""
    assert _imported("import nextstep.scoring, nextstep.service.memory_store, nextstep.service") == []
    routes = subprocess.run([sys.executable, "-c", "import sys, nextstep.scoring; "
                             "print(sorted(m for m in sys.modules if m.startswith('nextstep.service.routes') "
                             "or m.endswith('.routes')))"],
                            capture_output=True, text=True, cwd=ROOT, check=True)
    assert routes.stdout.strip() == "[]"  # (the task modules, not their routes)
    assert _imported("from nextstep.service.stores import make_store; make_store(None, ttl_seconds=None)") == []
    assert "redis" in _imported("from nextstep.service.stores import make_store; "
                                "make_store('redis://127.0.0.1:1', ttl_seconds=None)")  # (the probe sees one)


def test_each_task_is_one_plugin_and_the_app_serves_every_one(tmp_path: Path) -> None:
    """A task is a package (service/__init__.py's TASK_MODULES) with its service module and its routes module: its
    TaskSpec is registered, its routes are the app's, X-Model-Version pins its paths, its service lives on
    app.state."""
    from fastapi.testclient import TestClient

    from nextstep.service import TASK_MODULES
    from nextstep.service.app import create_app
    from nextstep.service.registry import TASKS
    from nextstep.service.settings import Settings
    from nextstep.service.tasks import plugins, stateful_task

    assert [p.service.__module__ for p in plugins()] == [f"nextstep.service.{name}.service" for name in TASK_MODULES]
    assert [p.spec.name for p in plugins()] == list(TASKS) == [p.service.TASK for p in plugins()]
    app = create_app(Settings(artifacts_dir=tmp_path))
    served = {(r.path, frozenset(r.methods)) for r in app.routes if hasattr(r, "methods")}
    assert app.state.pinned == {"models", "kt", "sessions", "srs"}
    with TestClient(app):
        for p in plugins():
            assert {(r.path, frozenset(r.methods)) for r in p.router.routes} <= served, p.spec.name
            assert isinstance(getattr(app.state, p.attr), p.service)
            assert (stateful_task(app, p.spec.name) is None) == (p.no_migrate is not None)
    assert [p.spec.name for p in plugins() if p.no_migrate] == []  # (flashcards migrate across window layouts)
