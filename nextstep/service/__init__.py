"""The service: HTTP (app.py, routes/) over tasks on one stateful core (core.py).

A task is a plug-in of two modules named alike: its service module `<name>.py` (its TaskSpec, which it registers
with the model registry when imported, and its StatefulTask) and its routes module `routes/<name>.py` (its router
and its TaskPlugin, `TASK`: tasks.py). TASK_MODULES names them; importing the package registers every task's
TaskSpec, so that any use of it (offline scoring too) knows every task, without importing the routes."""

import importlib

TASK_MODULES = ("kt", "sessions", "srs")  # a new task: its name here (the order of the API's routes)

for _name in TASK_MODULES:
    importlib.import_module(f".{_name}", __name__)
