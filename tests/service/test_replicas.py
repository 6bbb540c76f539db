"""Several replicas behind a real load balancer: three `nextstep serve` processes, each on its own loopback port,
sharing one real redis-server, behind HAProxy (the Debian package) running docker/haproxy/haproxy.cfg, the file the
compose stack uses, with its server-template replaced by the three local replicas and its binds moved to free
loopback ports (everything else, round-robin and the /readyz health checks included, as written there).

What is checked: many writers on one learner through the balancer lose no update and a replayed event id is applied
once whichever replica receives it; every replica served its share, counted twice (each replica's /metrics and
HAProxy's per-server statistics agree request for request); a replica killed under load costs no event (clients
retry with the same event ids) and is taken out and back by the health checks; a reload through the balancer reaches
every replica within NEXTSTEP_RELOAD_REFRESH_SECONDS (the reload generation in Redis), and a replica reloaded by its
own address serves the new set at once.
"""

from __future__ import annotations

import asyncio
import csv
import io
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.service.conftest import add_model_version, served_versions

pytestmark = pytest.mark.slow  # three replica processes behind HAProxy (make test-all)

REPO = Path(__file__).resolve().parents[2]
HAPROXY_CFG = REPO / "docker" / "haproxy" / "haproxy.cfg"
EVENTS_ROUTE = "/v1/kt/{model}/events"
N_REPLICAS = 3
RELOAD_REFRESH = 1.0  # NEXTSTEP_RELOAD_REFRESH_SECONDS of the replicas


def _haproxy() -> str:
    path = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/usr/local/sbin")
    if path is None:
        pytest.fail("haproxy is not on PATH; install it (Debian/Ubuntu: `apt-get install haproxy`)")
    return path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait(predicate, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if value:
                return value
        except (httpx.HTTPError, OSError):
            pass
        if proc is not None and proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            pytest.fail(f"{what}: the process exited with {proc.returncode}\n{tail}")
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-3000:] if log else ""
            pytest.fail(f"{what}: not within {timeout} s\n{tail}")
        time.sleep(0.05)


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGTERM) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Replica:
    """One `nextstep serve` process (uvicorn, one worker) on its own loopback port."""

    def __init__(self, name: str, artifacts: Path, redis_url: str, workdir: Path) -> None:
        self.name, self.artifacts, self.redis_url = name, artifacts, redis_url
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("NEXTSTEP_")}
        env.update(NEXTSTEP_REDIS_URL=self.redis_url, NEXTSTEP_ARTIFACTS_DIR=str(self.artifacts),
                   NEXTSTEP_RELOAD_REFRESH_SECONDS=str(RELOAD_REFRESH),
                   PYTHONPATH=os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
        argv = [sys.executable, "-m", "nextstep.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 90) -> None:
        _wait(lambda: httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200, timeout,
              f"replica {self.name} on port {self.port} ready", self.proc, self.log)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        _stop(self.proc, sig)

    def events_served(self) -> int:
        """This process's count of 200 answers on the KT events route (its own /metrics, asked directly)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        return int(sum(sample.value for family in text_string_to_metric_families(text)
                       for sample in family.samples
                       if sample.name == "nextstep_requests_total" and sample.labels.get("route") == EVENTS_ROUTE
                       and sample.labels.get("status") == "200"))


def balancer_config(text: str, servers: dict[str, int], port: int, stats_port: int) -> str:
    """docker/haproxy/haproxy.cfg for loopback: `server-template` -> one `server` per replica, binds -> loopback."""
    (template,) = [line for line in text.splitlines() if line.strip().startswith("server-template ")]
    options = template.split()[4:]  # after: server-template PREFIX COUNT FQDN:PORT
    keep = [o for o in options if o not in ("resolve-prefer", "ipv4")]
    drop = {"resolvers", "init-addr"}  # DNS discovery options and their argument
    kept, skip = [], False
    for o in keep:
        if skip:
            skip = False
        elif o in drop:
            skip = True
        else:
            kept.append(o)
    indent = template[: len(template) - len(template.lstrip())]
    lines = "\n".join(f"{indent}server {name} 127.0.0.1:{p} {' '.join(kept)}".rstrip() for name, p in servers.items())
    text = text.replace(template, lines)
    text, n = re.subn(r"(?m)^(\s*bind )\*?:8000\b", rf"\g<1>127.0.0.1:{port}", text)
    assert n == 1, "the api frontend binds :8000"
    text, n = re.subn(r"(?m)^(\s*bind )\*?:8404\b", rf"\g<1>127.0.0.1:{stats_port}", text)
    assert n == 1, "the stats frontend binds :8404"
    return text


class Balancer:
    """HAProxy, foreground, running the derived config."""

    def __init__(self, replicas: list[Replica], workdir: Path) -> None:
        self.replicas = replicas
        self.port, self.stats_port = _free_port(), _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cfg = workdir / "haproxy.cfg"
        self.cfg.write_text(balancer_config(HAPROXY_CFG.read_text(), {r.name: r.port for r in replicas},
                                            self.port, self.stats_port))
        self.log = workdir / "haproxy.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([_haproxy(), "-db", "-f", str(self.cfg)], stdout=log,
                                         stderr=subprocess.STDOUT)
        _wait(lambda: self.servers(), 10, "haproxy statistics", self.proc, self.log)

    def stop(self) -> None:
        _stop(self.proc)

    def _rows(self) -> dict[str, dict[str, str]]:
        """HAProxy's statistics (CSV) of the api proxies, by svname (each server, FRONTEND, BACKEND)."""
        text = httpx.get(f"http://127.0.0.1:{self.stats_port}/stats;csv", timeout=5).text
        return {row["svname"]: row for row in csv.DictReader(io.StringIO(text.removeprefix("# ")))
                if row["pxname"] == "api"}

    def servers(self) -> dict[str, dict[str, str]]:
        """The statistics of each server of the api backend, by server name."""
        return {name: row for name, row in self._rows().items() if name not in ("FRONTEND", "BACKEND")}

    def backend(self) -> dict[str, str]:
        """The api backend's totals (wretr: connection retries, wredis: redispatches to another server)."""
        return self._rows()["BACKEND"]

    def wait_status(self, wanted: dict[str, str], timeout: float = 20) -> None:
        """Until each named server's status starts with the wanted word (UP, DOWN), as the health checks see it."""
        _wait(lambda: all(self.servers()[name]["status"].startswith(status) for name, status in wanted.items()),
              timeout, f"haproxy servers {wanted}", self.proc, self.log)

    def answered(self) -> dict[str, int]:
        """2xx responses HAProxy relayed from each server."""
        return {name: int(row["hrsp_2xx"] or 0) for name, row in self.servers().items()}


@pytest.fixture(scope="module")
def fleet(artifacts, session_redis, tmp_path_factory):
    """Three replicas on one redis-server behind HAProxy; the artifacts are a private copy (the reload test adds a
    version)."""
    art, _ = artifacts
    workdir = tmp_path_factory.mktemp("replicas")
    shutil.copytree(art, workdir / "artifacts")
    session_redis.flush()
    replicas = [Replica(f"r{i}", workdir / "artifacts", session_redis.url, workdir) for i in range(N_REPLICAS)]
    balancer = Balancer(replicas, workdir)
    try:
        for replica in replicas:
            replica.start()
        for replica in replicas:
            replica.wait_ready()
        balancer.start()
        balancer.wait_status({r.name: "UP" for r in replicas})
        yield balancer
    finally:
        balancer.stop()
        for replica in replicas:
            replica.stop()


def test_the_balancer_configs_are_valid(fleet):
    """`haproxy -c` accepts the compose file as written (its DNS names are resolved at run time: init-addr none) and
    the loopback variant the tests run."""
    for path in (HAPROXY_CFG, fleet.cfg):
        result = subprocess.run([_haproxy(), "-c", "-f", str(path)], capture_output=True, text=True)
        assert result.returncode == 0, f"{path}: {result.stdout}{result.stderr}"
    lines = [line.split()[:2] for line in fleet.cfg.read_text().splitlines() if not line.lstrip().startswith("#")]
    assert ["server-template"] not in [line[:1] for line in lines]
    assert [name for word, name in (line for line in lines if len(line) == 2) if word == "server"] == ["r0", "r1", "r2"]
    assert ["balance", "roundrobin"] in lines


async def _drive(url: str, student: str, clients: int, per_client: int, *, expect_absorbed: int | None,
                 after=None) -> dict[str, int]:
    """`clients` concurrent writers, each posting `per_client` events (ids c-i) for one student; a 502/503/504 or a
    dropped connection is retried with the same body (the event id makes that safe). Returns the events absorbed,
    the retries and the answers."""
    absorbed = retries = answered = 0

    async def client(c: int) -> None:
        nonlocal absorbed, retries, answered
        async with httpx.AsyncClient(base_url=url, timeout=30) as http:  # (a pool each: see test_kt_api's)
            for i in range(per_client):
                body = {"student_id": student, "events": [
                    {"question_id": 2 + (c + i) % 10, "response": (c * i) % 4, "event_id": f"{c}-{i}"}]}
                for _ in range(20):
                    try:
                        reply = await http.post("/v1/kt/deep_gpcm/events", json=body)
                    except httpx.TransportError:
                        retries += 1
                        continue
                    if reply.status_code in (502, 503, 504):
                        retries += 1
                        await asyncio.sleep(0.05)
                        continue
                    break
                assert reply.status_code == 200, reply.text
                n = reply.json()["events_absorbed"]
                if expect_absorbed is not None:
                    assert n == expect_absorbed, reply.text
                absorbed += n
                answered += 1
                if after is not None:
                    await after(answered)

    await asyncio.gather(*(client(c) for c in range(clients)))
    return {"absorbed": absorbed, "retries": retries, "answered": answered}


def test_many_writers_on_one_learner_through_the_balancer(fleet):
    clients, per_client = 50, 40
    total = clients * per_client
    replicas = fleet.replicas
    before = {r.name: r.events_served() for r in replicas}
    relayed_before = fleet.answered()

    first = asyncio.run(_drive(fleet.url, "busy", clients, per_client, expect_absorbed=1))
    assert first == {"absorbed": total, "retries": 0, "answered": total}
    summary = httpx.get(f"{fleet.url}/v1/kt/deep_gpcm/students/busy").json()
    assert summary["events_total"] == total == 2000

    # the same events again: every id was already applied, whichever replica receives it now
    again = asyncio.run(_drive(fleet.url, "busy", clients, per_client, expect_absorbed=0))
    assert again == {"absorbed": 0, "retries": 0, "answered": total}
    replayed = httpx.get(f"{fleet.url}/v1/kt/deep_gpcm/students/busy").json()
    assert replayed["events_total"] == total and replayed["state_version"] == summary["state_version"]

    # every replica took its share, and the two counts agree request for request: each replica's own metrics and
    # what HAProxy relayed from it (the two summaries above went through the balancer too: not events)
    served = {r.name: r.events_served() - before[r.name] for r in replicas}
    relayed = {name: n - relayed_before[name] for name, n in fleet.answered().items()}
    assert sum(served.values()) == 2 * total
    assert sum(relayed.values()) == 2 * total + 2
    for r in replicas:
        assert served[r.name] >= 0.25 * 2 * total, served  # round-robin: about a third each
        assert relayed[r.name] - served[r.name] in (0, 1, 2), (served, relayed)


def test_a_replayed_event_is_applied_once_whichever_replica_receives_it(fleet):
    body = {"student_id": "hopper", "events": [{"question_id": 3, "response": 2, "event_id": "e-1"}]}
    absorbed = [httpx.post(f"{r.url}/v1/kt/deep_gpcm/events", json=body).json()["events_absorbed"]
                for r in fleet.replicas]
    assert absorbed == [1, 0, 0]
    assert httpx.get(f"{fleet.url}/v1/kt/deep_gpcm/students/hopper").json()["events_total"] == 1


def test_a_replica_killed_under_load_loses_no_event_and_comes_back(fleet):
    clients, per_client = 30, 40
    total = clients * per_client
    victim = fleet.replicas[-1]
    killed_at: list[int] = []
    before = fleet.backend()

    async def kill_early(answered: int) -> None:
        if answered == total // 4 and not killed_at:
            killed_at.append(answered)
            victim.stop(signal.SIGKILL)  # no graceful shutdown: requests in flight there are cut

    try:
        run = asyncio.run(_drive(fleet.url, "survivor", clients, per_client, expect_absorbed=None, after=kill_early))
        assert killed_at and victim.proc.poll() is not None
        # every event stored exactly once. A request cut at the dead replica (HAProxy answers 502) may have been
        # stored before it died: its retry answers 0 absorbed, so the answers may absorb fewer than `total`, each
        # shortfall a retried request
        assert run["answered"] == total, run
        assert 0 <= total - run["absorbed"] <= run["retries"], run
        assert httpx.get(f"{fleet.url}/v1/kt/deep_gpcm/students/survivor").json()["events_total"] == total
        # the death was felt: requests sent to the dead replica before the checks took it out were retried on a
        # live one by HAProxy (a refused connection), or cut and retried by the client
        after = fleet.backend()
        felt = sum(int(after[k] or 0) - int(before[k] or 0) for k in ("wretr", "wredis")) + run["retries"]
        assert felt >= 1, (run, after)
        fleet.wait_status({victim.name: "DOWN"})
    finally:  # back on the same port, whatever happened above (the next test needs the whole fleet)
        if victim.proc.poll() is not None:
            victim.start()
        victim.wait_ready()
    # the health checks put it back in rotation, and it serves
    fleet.wait_status({victim.name: "UP"})
    assert victim.events_served() == 0  # a new process
    for i in range(3 * N_REPLICAS):
        reply = httpx.post(f"{fleet.url}/v1/kt/deep_gpcm/events", json={
            "student_id": "survivor", "events": [{"question_id": 4, "response": 1, "event_id": f"late-{i}"}]})
        assert reply.status_code == 200 and reply.json()["events_absorbed"] == 1, reply.text
    assert victim.events_served() >= 2
    assert httpx.get(f"{fleet.url}/v1/kt/deep_gpcm/students/survivor").json()["events_total"] == total + 9


def test_a_reload_through_the_balancer_reaches_every_replica(fleet):
    """One reload through the balancer lands on one replica, which bumps the reload generation in Redis; every other
    replica sees it move within NEXTSTEP_RELOAD_REFRESH_SECONDS and reloads itself (asked directly, each lists the new
    version). A replica reloaded by its own address still serves the new set as soon as it answers."""
    artifacts = fleet.replicas[0].artifacts
    add_model_version(artifacts, "v2")
    reply = httpx.post(f"{fleet.url}/v1/models/reload", timeout=30)
    assert reply.status_code == 200, reply.text
    told = reply.json()["fleet_generation"]
    assert isinstance(told, int) and told >= 1, reply.text
    answered = time.monotonic()
    reached = {}
    # the interval, plus a reload's own work (a rescan and a session build on two busy cores)
    deadline = answered + RELOAD_REFRESH + 10
    while len(reached) < N_REPLICAS and time.monotonic() < deadline:
        for r in fleet.replicas:
            if r.name not in reached and "v2" in served_versions(r.url):
                reached[r.name] = time.monotonic() - answered
        time.sleep(0.05)
    assert sorted(reached) == [r.name for r in fleet.replicas], reached
    print(f"reload reached the replicas after {reached} s (refresh {RELOAD_REFRESH} s)")
    for _ in range(2 * N_REPLICAS):  # every answer through the balancer lists it
        assert served_versions(fleet.url) == {"v1", "v2"}

    # a direct reload of each replica: that replica serves the new version in its answer, without waiting
    add_model_version(artifacts, "v3")
    generations = []
    for r in fleet.replicas:
        reply = httpx.post(f"{r.url}/v1/models/reload", timeout=30)
        assert reply.status_code == 200, reply.text
        assert "deep_gpcm/v3" in reply.json()["models"]
        assert "v3" in served_versions(r.url)
        generations.append(reply.json()["fleet_generation"])
    assert generations == [told + 1, told + 2, told + 3]
    for _ in range(2 * N_REPLICAS):
        assert served_versions(fleet.url) == {"v1", "v2", "v3"}
