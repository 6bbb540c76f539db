"""The service: HTTP (app.py, routes/) over three tasks on one stateful core (core.py).

Each task module registers the manifest checks of its task with the model registry when imported (registry.
TaskSpec): importing them here means any use of the package knows every task."""

from . import kt, sessions, srs  # noqa: F401
