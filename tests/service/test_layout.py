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
    assert [p.spec.name for p in plugins()] == [p.service.TASK for p in plugins()]
    assert {p.spec.name for p in plugins()} == set(TASKS)  # (registered in the order they were first imported)
    app = create_app(Settings(artifacts_dir=tmp_path))
    served = {(r.path, frozenset(r.methods)) for r in app.routes if hasattr(r, "methods")}
    assert app.state.pinned == {"models", "kt", "sessions", "srs"}
    with TestClient(app):
        for p in plugins():
            assert {(r.path, frozenset(r.methods)) for r in p.router.routes} <= served, p.spec.name
            assert isinstance(getattr(app.state, p.attr), p.service)
            assert (stateful_task(app, p.spec.name) is None) == (p.no_migrate is not None)
    assert [p.spec.name for p in plugins() if p.no_migrate] == []  # (flashcards migrate across window layouts)


def test_a_new_task_is_a_package_and_a_line_in_the_task_list(tmp_path: Path, monkeypatch) -> None:
    """tests/service/toy: a service module (its spec and service) and a routes module (its plug-in), named in
    TASK_MODULES, and nothing else changed: the app loads its artifacts, serves its routes, lists its models, and a
    version pin (X-Model-Version) reaches its paths."""
    import json

    from fastapi.testclient import TestClient

    import nextstep.service
    from nextstep.service.app import create_app
    from nextstep.service.registry import TASKS
    from nextstep.service.settings import Settings
    from nextstep.service.tasks import plugins

    monkeypatch.setattr(nextstep.service, "TASK_MODULES", (*nextstep.service.TASK_MODULES, "tests.service.toy"))
    plugins.cache_clear()
    try:
        for version in ("1", "2"):
            (tmp_path / "echo" / version).mkdir(parents=True)
            (tmp_path / "echo" / version / "manifest.json").write_text(json.dumps({
                "name": "echo", "version": version, "family": "toy", "task": "toy",
                "created": f"202{version}-01-01T00:00:00Z", "graphs": {}}))
        key = "admin-key-of-the-toy-test"
        with TestClient(create_app(Settings(artifacts_dir=tmp_path, admin_keys=[key]))) as http:
            http.headers["X-API-Key"] = key
            assert http.get("/v1/toy/echo/entities/e-1").json() == {"model": "echo", "version": "2", "entity": "e-1"}
            pinned = http.get("/v1/toy/echo/entities/e-1", headers={"X-Model-Version": "1"}).json()
            assert pinned["version"] == "1"
            listed = {(m["name"], m["version"], m["task"]) for m in http.get("/v1/models").json()["models"]}
            assert listed == {("echo", "1", "toy"), ("echo", "2", "toy")}
            refused = http.post("/v1/models/echo/migrate", json={})
            assert refused.status_code == 422 and "a toy keeps no state" in refused.json()["detail"]
    finally:
        plugins.cache_clear()
        TASKS.pop("toy", None)


# the names of the tasks and of their packages: no module of the shared service uses one (service/__init__.py's
# TASK_MODULES, the one list, aside)
TASK_NAMES = {"knowledge_tracing", "next_item", "srs", "kt", "sessions"}


def test_the_shared_service_names_no_task() -> None:
    """No module of the shared service (nextstep/service/*.py, routes/) nor the CLI imports a task's package or
    compares anything with a task's name; the OpenAPI examples (`answer(...)`) and prose (docstrings, comments)
    aside. (The training side is per task by design: training/kt/, next_item/, srs/.)"""
    import ast

    found = []
    service = ROOT / "nextstep/service"
    shared = [*sorted(service.glob("*.py")), *sorted((service / "routes").glob("*.py")), ROOT / "nextstep/cli.py"]
    for path in shared:
        if path.name == "__init__.py" and path.parent.name == "service":
            continue
        tree = ast.parse(path.read_text())
        examples = {id(n) for call in ast.walk(tree) if isinstance(call, ast.Call)
                    and getattr(call.func, "id", None) == "answer" for n in ast.walk(call)}
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                      and node.body and isinstance(node.body[0], ast.Expr)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                parts = (node.module or "").split(".")
                if TASK_NAMES & set(parts) or any(alias.name in TASK_NAMES for alias in node.names):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in examples \
                    and id(node) not in docstrings and node.value in TASK_NAMES:
                found.append(f"{path.name}:{node.lineno} names {node.value!r}")
    assert not found, found


def test_the_service_loads_no_training_and_no_torch() -> None:
    """The app (every task's service and routes) imports no module of nextstep.training, nextstep.models or torch:
    it reads artifacts with ONNX Runtime (the flashcard refit's fit runs in a process of its own)."""
    probe = ("import sys\nfrom nextstep.service.app import create_app\ncreate_app()\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch' "
             "or m.startswith(('nextstep.training', 'nextstep.models'))))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "[]"
