"""Fixtures that run a REAL redis-server (no mocks): CI installs it; locally `apt install redis-server`.

* `redis_server`  -- session-wide server; yields its URL.
* `redis_url`     -- that URL, with the database flushed before the test.
* `redis_process` -- a private server for one test that may stop/start or pause/resume it (outages).
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import uvicorn

from nextstep.service.app import create_app
from nextstep.service.settings import Settings
from nextstep.training.loop import TrainConfig
from nextstep.training.run import train_model
from nextstep.training.synthetic import write_gpcm_dataset


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _command(port: int, command: bytes) -> bytes:
    """Send one inline command over a raw socket and return the first reply line."""
    with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
        sock.sendall(command + b"\r\n")
        return sock.recv(64)


class RedisProcess:
    """One redis-server on a fixed port: no persistence, loopback only; can be stopped and restarted."""

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH; install it (e.g. `apt-get install redis-server`)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 5.0) -> None:
        """Start the server and wait until it answers PING."""
        assert self._proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [self.binary, "--save", "", "--appendonly", "no", "--port", str(self.port), "--bind", "127.0.0.1"]
        log = open(self.workdir / "redis.log", "ab")  # noqa: SIM115 -- owned by the child process
        self._proc = subprocess.Popen(argv, cwd=self.workdir, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while True:
            try:
                if _command(self.port, b"PING").startswith(b"+PONG"):
                    return
            except OSError:
                pass
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = (self.workdir / "redis.log").read_text(errors="replace")[-2000:]
                pytest.fail(f"redis-server on port {self.port} did not answer PING:\n{tail}")
            time.sleep(0.02)

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): the kernel still accepts connections, nothing answers."""
        assert self._proc is not None, "not running"
        self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._proc is not None, "not running"
        self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL) and wait for it to exit."""
        if self._proc is None:
            return
        self._proc.send_signal(signal.SIGCONT)  # a paused server would not act on SIGTERM
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def flush(self) -> None:
        assert _command(self.port, b"FLUSHALL").startswith(b"+OK")


@pytest.fixture(scope="session")
def session_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_server(session_redis: RedisProcess) -> str:
    """URL of the session-wide server, `redis://127.0.0.1:<port>/0`."""
    return session_redis.url


@pytest.fixture
def redis_url(session_redis: RedisProcess, redis_server: str) -> str:
    """The session server's URL, flushed so each test starts from an empty database."""
    session_redis.flush()
    return redis_server


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private, started server the test may stop() and start() again on the same port."""
    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- a served model: a tiny deep_gpcm trained for real, and the app under uvicorn ---------------------------
SMALL = {"memory_size": 4, "key_dim": 8, "value_dim": 8, "summary_dim": 8}


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory) -> tuple[Path, Path]:
    """(artifacts dir holding deep_gpcm/v1, data dir): a tiny model trained for real on generated data."""
    root = tmp_path_factory.mktemp("kt")
    data = write_gpcm_dataset(root / "data", n_students=40, n_questions=12, seq_len_range=(12, 16), seed=5)
    train_model("deep_gpcm", data, root / "artifacts" / "deep_gpcm" / "v1",
                cfg=TrainConfig(epochs=2, model=SMALL), progress=False, log=False)
    return root / "artifacts", data


@contextmanager
def serving(settings: Settings, app=None):
    """The app (`create_app(settings)` unless given) under uvicorn in a thread on a free loopback port; yields its
    base URL."""
    config = uvicorn.Config(app or create_app(settings), host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)




@pytest.fixture(scope="session")
def serve():
    """`with serve(settings) as url:` runs the app under uvicorn on a free loopback port."""
    return serving


@pytest.fixture(scope="session")
def artifact_tree(tmp_path_factory) -> Path:
    """deep_gpcm/1, deep_gpcm/2 (a copy marked newer) and attention_gpcm/1, tiny and trained once per session."""
    import json

    small = dict(memory_size=4, key_dim=8, value_dim=8, summary_dim=8, embed_dim=8, n_heads=2, window=4)
    root = tmp_path_factory.mktemp("service-artifacts")
    artifacts = root / "artifacts"
    data = write_gpcm_dataset(root / "data", n_students=40, n_questions=12, seq_len_range=(10, 15), seed=3)
    for name in ("deep_gpcm", "attention_gpcm"):
        train_model(name, data, artifacts / name / "1", cfg=TrainConfig(epochs=1, model=small), progress=False,
                    log=False)
    shutil.copytree(artifacts / "deep_gpcm" / "1", artifacts / "deep_gpcm" / "2")
    path = artifacts / "deep_gpcm" / "2" / "manifest.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "created": "2999-01-01T00:00:00Z", "version": "2"}))
    return artifacts
