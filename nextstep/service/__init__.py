"""The service: HTTP (app.py, routes/) over tasks on one stateful core (core.py).

A task is a package of its own, `<name>/`: its service module `service.py` (its TaskSpec, which it registers with
the model registry when imported, and its StatefulTask), its routes module `routes.py` (its router and its
TaskPlugin, `TASK`: tasks.py), and whatever else is its alone. TASK_MODULES names them; the registry registers every
task's TaskSpec at its first use (`register_tasks`), so that any use of it (offline scoring too) knows every task,
without importing the routes. A task's package may add commands to `nextstep` (its `commands.py`)."""

import functools
import importlib

# a new task: its package's name here (the order of the API's routes); a dotted path names a package elsewhere
TASK_MODULES = ("kt", "sessions", "srs")


def package(name: str) -> str:
    """A task's package from its TASK_MODULES entry: a name under this package, or a dotted path of its own."""
    return name if "." in name else f"{__name__}.{name}"


@functools.cache
def register_tasks() -> None:
    """Import every task's service module, which registers its TaskSpec with the model registry (registry.tasks()
    calls this: any use of the registry knows every task; importing this package alone imports none of them)."""
    for name in TASK_MODULES:
        importlib.import_module(f"{package(name)}.service")
