"""Fixtures that run a REAL redis-server (no mocks): CI installs it; locally `apt install redis-server`.

* `redis_server`  -- session-wide server; yields its URL.
* `redis_url`     -- that URL, with the database flushed before the test.
* `redis_process` -- a private server for one test that may stop/start or pause/resume it (outages).
* `redis_cluster` -- a session-wide Redis Cluster: 3 primaries, 3 replicas (`RedisClusterProcesses`; a test that
                     breaks one makes its own with `cluster_factory`).
* `sentinels`      -- one primary, one replica and three sentinels watching them (`SentinelProcesses`).

Every test runs with NEXTSTEP_SRS_REFIT=off (`_no_background_refit`) unless it names `srs_refit`.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from nextstep.service.app import create_app
from nextstep.service.settings import Settings


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

    def __init__(self, workdir: Path, port: int | None = None, extra: list[str] | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server is not on PATH; install it (e.g. `apt-get install redis-server`)")
        self.binary = binary
        self.workdir = workdir
        self.port = port or _free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.extra = list(extra or [])  # more redis-server arguments (cluster mode, replicaof)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def running(self) -> bool:
        return self._proc is not None

    def start(self, timeout: float = 5.0) -> None:
        """Start the server and wait until it answers PING."""
        assert self._proc is None, "already running"
        self.workdir.mkdir(parents=True, exist_ok=True)
        argv = [self.binary, "--save", "", "--appendonly", "no", "--port", str(self.port), "--bind", "127.0.0.1",
                "--repl-diskless-sync-delay", "0",  # a replica's sync starts at once, not after 5 s
                *self.extra]
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
        stop_process(self._proc)
        self._proc = None

    def kill(self) -> None:
        """A crash: SIGKILL, no shutdown."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def flush(self) -> None:
        assert _command(self.port, b"FLUSHALL").startswith(b"+OK")


@pytest.fixture(autouse=True)
def _no_background_refit(monkeypatch):
    """The service refits flashcard users by itself (NEXTSTEP_SRS_REFIT=auto), which changes a user's parameters
    and state version at their 32nd scored review: tests that compare answers with the artifact's defaults or count
    state versions would depend on when the worker ran. Off here; test_srs_refit.py turns it on where it tests it."""
    monkeypatch.setenv("NEXTSTEP_SRS_REFIT", "off")


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


@pytest.fixture(params=[pytest.param("in-process", marks=pytest.mark.slow), "redis"])
def store_url(request) -> str | None:
    """The API suites' store: a real Redis (its URL), and in the slow tier the in-process store too (None). The two
    stores are held to one contract in test_state.py, so the fast tier runs each API suite once, on Redis."""
    return request.getfixturevalue("redis_url") if request.param == "redis" else None


@pytest.fixture
def redis_process(tmp_path: Path) -> Iterator[RedisProcess]:
    """A private, started server the test may stop() and start() again on the same port."""
    server = RedisProcess(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _free_cluster_port() -> int:
    """A free port whose cluster bus port (+10000) is free too."""
    for _ in range(100):
        port = _free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    pytest.fail("no free port pair for a cluster node")


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if predicate():
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


class RedisClusterProcesses:
    """A Redis Cluster on loopback: `primaries` x (1 + `replicas`) redis-server processes with --cluster-enabled yes,
    joined by `redis-cli --cluster create`; a short cluster-node-timeout (1 s) so that a failover takes seconds."""

    def __init__(self, workdir: Path, primaries: int = 3, replicas: int = 1, node_timeout_ms: int = 1000) -> None:
        self.workdir, self.replicas, self.node_timeout_ms = workdir, replicas, node_timeout_ms
        self.nodes = {}
        for _ in range(primaries * (1 + replicas)):
            port = _free_cluster_port()
            self.nodes[port] = RedisProcess(workdir / str(port), port, extra=[
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", str(node_timeout_ms)])
        self.url = "redis+cluster://" + ",".join(f"127.0.0.1:{p}" for p in list(self.nodes)[:primaries])

    def start(self) -> None:
        for node in self.nodes.values():
            node.start()
        cli = shutil.which("redis-cli")
        if cli is None:
            pytest.fail("redis-cli is not on PATH; install it (e.g. `apt-get install redis-tools`)")
        done = subprocess.run([cli, "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.nodes),
                               "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                              capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            pytest.fail(f"redis-cli --cluster create failed:\n{done.stdout}\n{done.stderr}")
        self.wait_ok()

    def info(self, port: int) -> dict:
        reply = _raw(port, "CLUSTER INFO").decode()
        return dict(line.split(":", 1) for line in reply.split("\r\n") if ":" in line)

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Every running node sees the cluster ok with all its nodes' replication links up."""
        def ok() -> bool:
            return all(self.info(p)["cluster_state"] == "ok" for p, n in self.nodes.items() if n.running) and \
                all(b"master_link_status:up" in _raw(p, "INFO replication") for p in self.replica_ports())
        _wait(ok, "the cluster to be ok", timeout)

    def roles(self) -> dict[int, str]:
        return {p: ("primary" if b"role:master" in _raw(p, "INFO replication") else "replica")
                for p, n in self.nodes.items() if n.running}

    def primary_ports(self) -> list[int]:
        return [p for p, r in self.roles().items() if r == "primary"]

    def replica_ports(self) -> list[int]:
        return [p for p, r in self.roles().items() if r == "replica"]

    def port_of(self, key: str) -> int:
        """The primary serving a key's slot (the others answer MOVED)."""
        return next(p for p in self.primary_ports() if not _raw(p, f"EXISTS {key}").startswith(b"-MOVED"))

    def flush(self) -> None:
        for port in self.primary_ports():
            assert _raw(port, "FLUSHALL").startswith(b"+OK")

    def stop(self) -> None:
        for node in self.nodes.values():
            node.stop()


def _raw(port: int, command: str) -> bytes:
    """One inline command, the whole reply (for small replies)."""
    with socket.create_connection(("127.0.0.1", port), timeout=2.0) as sock:
        sock.sendall(command.encode() + b"\r\n")
        data = sock.recv(65536)
        if data.startswith(b"$"):  # a bulk string: read it whole
            size = int(data[1:data.index(b"\r\n")])
            while len(data) < data.index(b"\r\n") + 2 + size + 2:
                data += sock.recv(65536)
        return data


@pytest.fixture(scope="session")
def cluster_factory(tmp_path_factory):
    """`with cluster_factory() as cluster:` a private, started cluster, torn down after."""
    made = []

    @contextmanager
    def factory(**kwargs):
        cluster = RedisClusterProcesses(tmp_path_factory.mktemp("cluster"), **kwargs)
        made.append(cluster)
        try:
            cluster.start()
            yield cluster
        finally:
            cluster.stop()

    yield factory
    for cluster in made:
        cluster.stop()


@pytest.fixture(scope="session")
def session_cluster(cluster_factory) -> Iterator[RedisClusterProcesses]:
    with cluster_factory() as cluster:
        yield cluster


@pytest.fixture
def redis_cluster(session_cluster: RedisClusterProcesses) -> RedisClusterProcesses:
    """The session cluster, flushed; its `url` is `redis+cluster://` with the three first nodes."""
    session_cluster.flush()
    return session_cluster


class SentinelProcesses:
    """One primary, one replica and three sentinels (redis-server --sentinel) watching them as `mymaster`
    (down after 1 s, quorum 2)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.primary = RedisProcess(workdir / "primary")
        self.replica = RedisProcess(workdir / "replica", extra=["--replicaof", "127.0.0.1", "0"])
        self.sentinel_ports = [_free_port() for _ in range(3)]
        self._procs: list[subprocess.Popen] = []
        self.url = "redis+sentinel://" + ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports) + "/mymaster"

    def start(self) -> None:
        self.primary.start()
        self.replica.extra[-1] = str(self.primary.port)
        self.replica.start()
        _wait(lambda: b"master_link_status:up" in _raw(self.replica.port, "INFO replication"), "the replica")
        for port in self.sentinel_ports:
            folder = self.workdir / f"sentinel-{port}"
            folder.mkdir(parents=True)
            conf = folder / "sentinel.conf"
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                            f"sentinel monitor mymaster 127.0.0.1 {self.primary.port} 2\n"
                            "sentinel down-after-milliseconds mymaster 1000\n"
                            "sentinel failover-timeout mymaster 5000\n")
            log = open(folder / "sentinel.log", "wb")  # noqa: SIM115 -- owned by the child process
            self._procs.append(subprocess.Popen([shutil.which("redis-server"), str(conf), "--sentinel"],
                                                cwd=folder, stdout=log, stderr=subprocess.STDOUT))
            log.close()
        for port in self.sentinel_ports:  # each sentinel knows the replica and the other sentinels
            _wait(lambda p=port: b"num-other-sentinels\r\n$1\r\n2" in _raw(p, "SENTINEL MASTER mymaster")
                  or b"num-other-sentinels\r\n:2" in _raw(p, "SENTINEL MASTER mymaster"), "the sentinels")

    def primary_port(self) -> int:
        reply = _raw(self.sentinel_ports[0], "SENTINEL GET-MASTER-ADDR-BY-NAME mymaster")
        return int(reply.split(b"\r\n")[-2])

    def stop(self) -> None:
        for proc in self._procs:
            proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._procs.clear()
        self.replica.stop()
        self.primary.stop()


@pytest.fixture
def sentinels(tmp_path: Path) -> Iterator[SentinelProcesses]:
    group = SentinelProcesses(tmp_path / "sentinel")
    try:
        group.start()
        yield group
    finally:
        group.stop()


# -- the app under uvicorn (the models it serves: `artifacts` and `artifact_tree`, tests/conftest.py) --------------
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


# ids as apps make them: slashes, spaces, percent signs, query and fragment marks, dot segments, non-ASCII, the
# longest allowed; in a path each is percent-encoded (dots too: clients drop "." and ".." segments)
ODD_IDS = ["org/42", "org%2F42", "a b", "50%", "?x=1#y&z", "/lead", "trail/", "a//b", ".", "..", "ünï/çødé ✓",
           "x" * 200]


def encoded(entity_id: str) -> str:
    """An id as a path segment: percent-encoded, dots too."""
    from urllib.parse import quote

    return quote(entity_id, safe="").replace(".", "%2E")


def add_model_version(artifacts: Path, version: str) -> None:
    """deep_gpcm/<version>: a copy of deep_gpcm/v1 marked newer (created in the year 2999)."""
    new = artifacts / "deep_gpcm" / version
    shutil.copytree(artifacts / "deep_gpcm" / "v1", new)
    manifest = json.loads((new / "manifest.json").read_text())
    (new / "manifest.json").write_text(json.dumps({**manifest, "version": version,
                                                   "created": f"2999-01-0{version[-1]}T00:00:00Z"}))


def served_versions(url: str) -> set[str]:
    """The model versions a running service lists on /v1/models."""
    reply = httpx.get(f"{url}/v1/models", timeout=5)
    assert reply.status_code == 200, reply.text
    return {m["version"] for m in reply.json()["models"]}


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after 5 s; wait for the exit."""
    proc.terminate()
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# -- next-item models trained for real (test_sessions_api.py, test_unknown_ids.py) ----------------------------------
@pytest.fixture(scope="session")
def rec_artifacts(build_once):
    """artifacts/{gru4rec,popularity}/1 trained for real on generated sessions (60 items); once per run, read-only."""
    import numpy as np

    from nextstep.training.next_item.gru4rec_loop import GRU4RecTrainConfig
    from nextstep.training.next_item.run import train_next_item
    from nextstep.training.next_item.sessions import subset, write_gru4rec_tsv, zipf_sessions

    def build(root):
        data = zipf_sessions(300, 60, (2, 9), follow=0.7, seed=0)
        write_gru4rec_tsv(subset(data, np.arange(250)), root / "demo_train_full.txt")
        write_gru4rec_tsv(subset(data, np.arange(250, 300)), root / "demo_test.txt")
        cfg = GRU4RecTrainConfig(epochs=2, n_sample=16, model={"layers": (12,)})
        train_next_item("gru4rec", root, root / "artifacts" / "gru4rec" / "1", cfg=cfg, progress=False, log=False,
                        top_k=30)
        train_next_item("popularity", root, root / "artifacts" / "popularity" / "1", progress=False, log=False,
                        top_k=30)

    return build_once("rec", build) / "artifacts"
