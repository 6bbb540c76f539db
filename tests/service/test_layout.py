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
    assert _imported("from nextstep.service.state import make_store; make_store(None, ttl_seconds=None)") == []
    assert "redis" in _imported("from nextstep.service.state import make_store; "
                                "make_store('redis://127.0.0.1:1', ttl_seconds=None)")  # (the probe sees one)
