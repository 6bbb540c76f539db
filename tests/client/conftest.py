"""The service tests' fixtures the client's tests use: a private redis-server (`redis_process`), and no background
flashcard refits (tests/service/conftest.py)."""

from tests.service.conftest import _no_background_refit, redis_process  # noqa: F401 (fixtures, by name)
