"""The `rediss://` TLS options (redis_clients.py: `ssl_ca_certs`, `ssl_certfile`, `ssl_keyfile`, `ssl_cert_reqs`,
`ssl_check_hostname`) against a REAL redis-server with TLS and client certificates required, for each client of
one node (the own pipelined client and the redis-py pool), through the real state store and once over HTTP.

The certificates are made here with `openssl`: a private CA, a server certificate whose subjectAltName is ONLY
`DNS:localhost` (so connecting to 127.0.0.1 is a real hostname mismatch), a client certificate from the same CA,
and a second, unrelated CA. A redis-server built without TLS support makes the module skip, saying so.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from nextstep import demo
from nextstep.service.errors import StoreUnavailable
from nextstep.service.settings import Settings
from nextstep.service.stores import make_store
from tests.service.conftest import _free_port, stop_process

CLIENTS = ("resp", "redis-py")
KEY = "kt:deep_gpcm:tls:learner"


def _openssl(*args: str | Path, cwd: Path) -> None:
    done = subprocess.run(["openssl", *map(str, args)], cwd=cwd, capture_output=True, text=True)
    if done.returncode:
        pytest.fail(f"openssl {' '.join(map(str, args))} failed:\n{done.stderr}")


def _make_pki(d: Path) -> None:
    """ca.crt/ca.key, server.crt/.key (SAN: DNS:localhost only), client.crt/.key (CA-signed), other-ca.crt."""
    for ca, cn in (("ca", "nextstep-test-ca"), ("other-ca", "unrelated-test-ca")):
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={cn}",
                 "-keyout", f"{ca}.key", "-out", f"{ca}.crt", cwd=d)
    for name, cn, ext in (("server", "localhost", "subjectAltName=DNS:localhost\nextendedKeyUsage=serverAuth\n"),
                          ("client", "nextstep-client", "extendedKeyUsage=clientAuth\n")):
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\n" + ext)
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={cn}", "-keyout", f"{name}.key",
                 "-out", f"{name}.csr", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                 "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.crt", cwd=d)


class TlsRedis:
    """redis-server with TLS only (--port 0), client certificates required, loopback, no persistence."""

    def __init__(self, pki: Path) -> None:
        self.pki, self.port = pki, _free_port()
        argv = [shutil.which("redis-server") or "redis-server", "--port", "0", "--tls-port", str(self.port),
                "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--tls-cert-file", str(pki / "server.crt"), "--tls-key-file", str(pki / "server.key"),
                "--tls-ca-cert-file", str(pki / "ca.crt"), "--tls-auth-clients", "yes"]
        self.log = pki / "redis.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(argv, cwd=pki, stdout=log, stderr=subprocess.STDOUT)

    def cli(self, *command: str) -> subprocess.CompletedProcess:
        p = self.pki
        return subprocess.run(["redis-cli", "--tls", "--cacert", str(p / "ca.crt"), "--cert", str(p / "client.crt"),
                               "--key", str(p / "client.key"), "-h", "localhost", "-p", str(self.port), *command],
                              capture_output=True, text=True, timeout=5)

    def wait(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while self.cli("PING").stdout.strip() != "PONG":
            if self.proc.poll() is not None:
                log = self.log.read_text(errors="replace")
                if "tls" in log.lower() and ("bad directive" in log.lower() or "not supported" in log.lower()):
                    pytest.skip(f"this redis-server was built without TLS support:\n{log[-500:]}")
                pytest.fail(f"TLS redis-server exited:\n{log[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"TLS redis-server did not answer PING:\n{self.log.read_text(errors='replace')[-2000:]}")
            time.sleep(0.05)

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsRedis]:
    for tool in ("openssl", "redis-server", "redis-cli"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is not on PATH (apt-get install openssl redis-server)")
    pki = tmp_path_factory.mktemp("tls")
    _make_pki(pki)
    server = TlsRedis(pki)
    try:
        server.wait()
        yield server
    finally:
        server.stop()


def _url(server: TlsRedis, client: str, host: str = "localhost", *, ca: str | None = "ca.crt",
         cert: bool = True, **params: str) -> str:
    p = server.pki
    query = {"client": client}
    if ca:
        query["ssl_ca_certs"] = str(p / ca)
    if cert:
        query.update(ssl_certfile=str(p / "client.crt"), ssl_keyfile=str(p / "client.key"))
    query.update(params)
    return f"rediss://{host}:{server.port}/0?" + "&".join(f"{k}={v}" for k, v in query.items())


async def _write_and_read(url: str, key: str) -> None:
    store = make_store(url, ttl_seconds=None)
    try:
        written = await store.compare_and_set(key, 0, b"state over TLS", added_events=1, event_ids=["e1"])
        assert written is not None and written.version == 1
        got = await store.get(key)
        assert got == written and got.blob == b"state over TLS"
        assert await store.seen(key, ["e1", "e2"]) == {"e1"}
    finally:
        await store.close()


def _stored(server: TlsRedis, key: str) -> bool:
    """Whether the store's state hash for `key` is in the server (layout: `nextstep:{<key>}`, state.RedisStore)."""
    return server.cli("EXISTS", f"nextstep:{{{key}}}").stdout.strip() == "1"


# name -> (host, URL options, None when it must work, else a regex the StoreUnavailable message must match)
CASES = {
    "right CA and client certificate": ("localhost", {}, None),
    "unrelated CA": ("localhost", {"ca": "other-ca.crt"}, r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"),
    "no CA given (system store does not know ours)": ("localhost", {"ca": None}, r"certificate verify failed"),
    # TLS 1.3: the server checks the client's certificate after the client's handshake ended; its alert usually
    # arrives, but a client that has written meanwhile may read a reset first (redis-py: ~15% here): then the
    # message says what a reset over TLS most likely means
    "no client certificate": ("localhost", {"cert": False},
                              r"(?i)certificate.required|handshake failure|refuses the client certificate"),
    "host not in the certificate, check on": ("127.0.0.1", {"ssl_check_hostname": "true"},
                                               r"IP address mismatch|not valid for '127\.0\.0\.1'"),
    "host not in the certificate, check by default": ("127.0.0.1", {}, r"IP address mismatch"),
    "host not in the certificate, check off": ("127.0.0.1", {"ssl_check_hostname": "false"}, None),
    "ssl_cert_reqs=none, no CA (insecure option)": ("localhost", {"ca": None, "ssl_cert_reqs": "none"}, None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("client", CLIENTS)
def test_tls_options_are_honoured(tls_redis: TlsRedis, client: str, case: str, caplog) -> None:
    host, options, refused = CASES[case]
    key = f"{KEY}:{client}:{list(CASES).index(case)}"
    url = _url(tls_redis, client, host, **options)
    if refused is None:
        asyncio.run(_write_and_read(url, key))
        assert _stored(tls_redis, key)  # really in this server, seen by an independent TLS client
        return
    with caplog.at_level(logging.WARNING, logger="nextstep.service.redis_clients"), \
            pytest.raises(StoreUnavailable, match=refused) as caught:
        asyncio.run(_write_and_read(url, key))
    assert str(tls_redis.port) not in str(caught.value)  # the message may reach HTTP clients: no address
    assert f"Redis at rediss://{host}:{tls_redis.port}/0 unavailable" in caplog.text  # the log names the server
    assert not _stored(tls_redis, key)  # refused, not written


@pytest.mark.parametrize("client", CLIENTS)
def test_kt_events_over_http_with_a_tls_redis(serve, tls_redis: TlsRedis, client: str) -> None:
    art = demo.BUNDLED  # the bundled demo models: nothing to train
    body = {"student_id": f"tls-{client}", "events": [{"question_id": 3, "response": 2}]}
    with serve(Settings(artifacts_dir=art, redis_url=_url(tls_redis, client))) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        reply = http.post("/v1/kt/deep_gpcm/events", json=body)
        assert reply.status_code == 200, reply.text
        assert http.get(f"/v1/kt/deep_gpcm/students/tls-{client}").json()["events_total"] == 1
    keys = tls_redis.cli("--scan", "--pattern", f"*tls-{client}*").stdout.split()
    assert keys, "the learner's state is not in the TLS server"

    with serve(Settings(artifacts_dir=art, redis_url=_url(tls_redis, client, ca="other-ca.crt"))) as url, \
            httpx.Client(base_url=url, timeout=10) as http:
        reply = http.post("/v1/kt/deep_gpcm/events", json=body)
        assert reply.status_code == 503, reply.text
        assert "certificate verify failed" in reply.json()["detail"]
