"""The service: HTTP (app.py, routes/) over tasks on one stateful core (core.py).

A task is a package of its own, `<name>/`: its service module `service.py` (its TaskSpec, which it registers with
the model registry when imported, and its StatefulTask), its routes module `routes.py` (its router and its
TaskPlugin, `TASK`: tasks.py), and whatever else is its alone. TASK_MODULES names them; importing this package
registers every task's TaskSpec, so that any use of it (offline scoring too) knows every task, without importing the
routes."""

import importlib

# a new task: its package's name here (the order of the API's routes); a dotted path names a package elsewhere
TASK_MODULES = ("kt", "sessions", "srs")

for _name in TASK_MODULES:
    importlib.import_module(f"{_name if '.' in _name else __name__ + '.' + _name}.service")
