"""Who may call what (API keys and roles, the loopback rule), and the read deadlines of `nextstep serve`'s server:
real HTTP against uvicorn on a real socket, no mocks."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from nextstep.service import server as served
from nextstep.service.app import create_app
from nextstep.service.settings import Settings, SettingsError

EVENTS = {"student_id": "s", "events": [{"question_id": 3, "response": 1}]}
REMOTE = {"X-Forwarded-For": "203.0.113.9"}  # uvicorn trusts it from 127.0.0.1: a client behind a local proxy
USER_1, USER_2, ADMIN = "user-key-1-7d3f0a9c2b", "user-key-2-41e8b6d5f0", "admin-key-9c04e2a7b1"


@contextmanager
def running(config: uvicorn.Config):
    """A uvicorn server in a thread; yields (host, port) of its socket."""
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[:2]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def outside_address() -> str | None:
    """An address of this machine that is not loopback (None if it has none)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # no packet is sent: this only picks the outgoing interface
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if served.is_loopback(address) else address


def test_is_loopback():
    assert all(served.is_loopback(h) for h in ("127.0.0.1", "127.8.9.1", "::1", "[::1]", "localhost",
                                               "::ffff:127.0.0.1"))
    assert not any(served.is_loopback(h) for h in ("0.0.0.0", "10.0.0.1", "203.0.113.9", "::", "example.org", None))


def test_without_keys_the_admin_routes_are_served_to_loopback_clients_only(artifacts, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS).status_code == 200
        # the same machine: everything
        assert http.post("/v1/models/reload").status_code == 200
        assert http.delete("/v1/kt/deep_gpcm/students/s").json()["deleted"] is True
        assert http.put("/v1/kt/deep_gpcm/banks/active", json={"version": "v2"}).status_code == 404  # no banks
        # a client elsewhere (behind a proxy on this machine that names it): no admin route, every other one
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS, headers=REMOTE).status_code == 200
        assert http.get("/v1/kt/deep_gpcm/students/s", headers=REMOTE).status_code == 200
        for method, path in (("POST", "/v1/models/reload"), ("DELETE", "/v1/kt/deep_gpcm/students/s"),
                             ("DELETE", "/v1/sessions/gru4rec/visit-1"), ("DELETE", "/v1/srs/time_aware/users/u"),
                             ("PUT", "/v1/kt/deep_gpcm/banks/active")):
            reply = http.request(method, path, headers=REMOTE, json={"version": "v2"} if method == "PUT" else None)
            assert reply.status_code == 403, (method, path, reply.text)
            problem = reply.json()
            assert problem["field"] == "NEXTSTEP_ADMIN_KEYS" and problem["type"] == "urn:nextstep:problem:forbidden"
            assert "loopback" in problem["detail"]
        assert http.get("/v1/kt/deep_gpcm/students/s").json()["events_total"] == 1  # not deleted again


def test_a_client_on_another_interface_is_not_loopback(artifacts):
    """The same rule for a real non-loopback connection (no proxy header): the server bound to every interface,
    reached through this machine's outside address."""
    address = outside_address()
    if address is None:
        pytest.skip("this machine has no non-loopback address")
    art, _ = artifacts
    app = create_app(Settings(artifacts_dir=art))
    with running(served.config(app, Settings(), host="0.0.0.0", port=0, lifespan="on", log_level="warning")) as (
            _, port), httpx.Client(base_url=f"http://{address}:{port}") as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS).status_code == 200
        reply = http.post("/v1/models/reload")
        assert reply.status_code == 403 and reply.json()["field"] == "NEXTSTEP_ADMIN_KEYS", reply.text
        assert httpx.post(f"http://127.0.0.1:{port}/v1/models/reload").status_code == 200


def test_keys_have_roles_normal_keys_read_and_write_events_admin_keys_do_everything(artifacts, serve):
    art, _ = artifacts
    settings = Settings(artifacts_dir=art, api_keys=[USER_1, USER_2], admin_keys=[ADMIN])
    user, admin = {"X-API-Key": USER_2}, {"X-API-Key": ADMIN}
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        for headers, status in (({}, 401), ({"X-API-Key": ""}, 401), ({"X-API-Key": "nope"}, 401),
                                ({"X-API-Key": ADMIN[:-1]}, 401), (user, 200), (admin, 200)):
            reply = http.post("/v1/kt/deep_gpcm/events", json=EVENTS, headers=headers)
            assert reply.status_code == status, (headers, reply.text)
            if status == 401:
                assert reply.json()["field"] == "X-API-Key" and reply.json()["type"].endswith("unauthorized")
        assert http.post("/v1/kt/deep_gpcm/predict", json={"student_id": "s", "question_ids": [3]},
                         headers=user).status_code == 200
        assert http.post("/v1/kt/deep_gpcm/batch", json={"students": [{"student_id": "b", "events": []}]},
                         headers=user).status_code == 200
        for method, path in (("POST", "/v1/models/reload"), ("DELETE", "/v1/kt/deep_gpcm/students/s"),
                             ("DELETE", "/v1/sessions/gru4rec/visit-1"), ("DELETE", "/v1/srs/time_aware/users/u"),
                             ("PUT", "/v1/kt/deep_gpcm/banks/active")):
            body = {"version": "v2"} if method == "PUT" else None
            assert http.request(method, path, json=body).status_code == 401  # no key: 401 before the role
            reply = http.request(method, path, headers=user, json=body)  # from loopback too: keys decide
            assert reply.status_code == 403, (method, path, reply.text)
            assert reply.json()["field"] == "X-API-Key" and "NEXTSTEP_ADMIN_KEYS" in reply.json()["detail"]
        assert http.get("/v1/kt/deep_gpcm/students/s", headers=user).json()["events_total"] == 2
        assert http.post("/v1/models/reload", headers=admin).status_code == 200
        assert http.delete("/v1/kt/deep_gpcm/students/s", headers=admin).json()["deleted"] is True
        assert http.put("/v1/kt/deep_gpcm/banks/active", json={"version": "v2"}, headers=admin).status_code == 404
        for path in ("/healthz", "/metrics"):  # probes and scraping need no key
            assert http.get(path).status_code == 200


def test_normal_keys_without_admin_keys_leave_the_admin_routes_to_loopback(artifacts, serve):
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art, api_keys=[USER_1])) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/models/reload").status_code == 401  # a key is still needed
        assert http.post("/v1/models/reload", headers={"X-API-Key": USER_1}).status_code == 200
        reply = http.post("/v1/models/reload", headers={"X-API-Key": USER_1, **REMOTE})
        assert reply.status_code == 403 and reply.json()["field"] == "NEXTSTEP_ADMIN_KEYS"
        scrape = http.get("/metrics").text  # refusals are counted, before any route is matched
        for status in (401, 403):
            assert f'nextstep_requests_total{{model="",route="refused",status="{status}"}} 1.0' in scrape, status
    with serve(Settings(artifacts_dir=art, admin_keys=[ADMIN])) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS).status_code == 401  # admin keys alone: all need one
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS, headers={"X-API-Key": ADMIN}).status_code == 200


# -- read deadlines ---------------------------------------------------------------------------------------------


def _read_until_closed(sock: socket.socket, limit: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when (seconds from now); fails after
    `limit` seconds."""
    sock.settimeout(limit)
    started, received = time.monotonic(), b""
    try:
        while chunk := sock.recv(4096):
            received += chunk
    except TimeoutError:
        pytest.fail(f"the connection was still open after {limit} s; received {received!r}")
    except ConnectionResetError:
        pass
    return received, time.monotonic() - started


@contextmanager
def _server(artifacts, **settings):
    """The app under `nextstep serve`'s server with these settings; yields (host, port)."""
    art, _ = artifacts
    chosen = Settings(artifacts_dir=art, **settings)
    config = served.config(create_app(chosen), chosen, host="127.0.0.1", port=0, lifespan="on", log_level="warning")
    with running(config) as address:
        yield address


@pytest.fixture
def deadline_server(artifacts):
    """The server with 1-second read deadlines; yields (host, port)."""
    with _server(artifacts, header_timeout_seconds=1.0, body_timeout_seconds=1.0) as address:
        yield address


HALF_HEAD = b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\nContent-Le"


def test_incomplete_requests_are_closed_at_their_deadline_while_others_are_served(deadline_server):
    host, port = deadline_server
    base = f"http://{host}:{port}"
    body = httpx.Request("POST", "/", json=EVENTS).content
    stalled = {
        "half a request line": b"POST /v1/kt/deep_gpc",
        "half the headers": HALF_HEAD,
        "nothing at all": b"",
        "half the body": b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                         b"content-length: %d\r\n\r\n%s" % (len(body), body[:10]),
    }
    sockets = {}
    for what, data in stalled.items():
        sockets[what] = socket.create_connection((host, port))
        sockets[what].sendall(data)
    with httpx.Client(base_url=base) as http:  # meanwhile, others are served as usual
        for _ in range(5):
            started = time.monotonic()
            assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS).status_code == 200
            assert time.monotonic() - started < 0.5
    for what, sock in sockets.items():
        with sock:
            received, after = _read_until_closed(sock, limit=4.0)
        assert after < 2.5, what
        assert received.startswith(b"HTTP/1.1 408 "), (what, received)
        head, _, body = received.partition(b"\r\n\r\n")
        assert b"content-type: application/problem+json" in head and json.loads(body)["status"] == 408, received


def test_a_kept_alive_connection_that_stalls_in_its_next_request_is_closed(deadline_server):
    host, port = deadline_server
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    with socket.create_connection((host, port)) as sock:
        sock.sendall(request)
        sock.settimeout(2)
        assert sock.recv(4096).startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHo")
        received, after = _read_until_closed(sock, limit=4.0)
        assert received.startswith(b"HTTP/1.1 408 ") and after < 2.5


def test_a_slow_client_within_the_deadline_is_answered(deadline_server):
    host, port = deadline_server
    body = httpx.Request("POST", "/", json=EVENTS).content
    head = b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n" \
           b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body)
    with socket.create_connection((host, port)) as sock:
        for part in (head[:20], head[20:], body[:5], body[5:]):  # 0.4 s per piece: the head in 0.4, the body in 0.8
            sock.sendall(part)
            time.sleep(0.4)
        received, _ = _read_until_closed(sock, limit=4.0)
    assert received.startswith(b"HTTP/1.1 200 "), received


def test_plain_uvicorn_would_hold_a_half_sent_request_open(artifacts, serve):
    """Why the server has its own protocol: uvicorn's has no such deadline (this holds for uvicorn 0.54)."""
    art, _ = artifacts
    with serve(Settings(artifacts_dir=art)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as sock:
            sock.sendall(HALF_HEAD)
            sock.settimeout(2.0)
            with pytest.raises(TimeoutError):
                sock.recv(4096)


# -- keys the service refuses to start with ---------------------------------------------------------------------

GOOD = "3f6c1e0a9b7d42e8a1c5f0e2d4b6a8c9"


@pytest.mark.parametrize("api_keys, admin_keys, named", [
    ('["user-key-1234567890"]', '["", "admin-key-1234567890"]', "NEXTSTEP_ADMIN_KEYS"),  # an empty key matched ""
    (GOOD, f"{ADMIN},", "NEXTSTEP_ADMIN_KEYS"),  # a trailing comma
    (f" , {GOOD}", ADMIN, "NEXTSTEP_API_KEYS"),
    ("   ", ADMIN, "NEXTSTEP_API_KEYS"),  # whitespace only (empty or unset: no keys)
    (json.dumps(["   "]), ADMIN, "NEXTSTEP_API_KEYS"),
    (GOOD, "admin-key-short", "NEXTSTEP_ADMIN_KEYS"),  # 15 characters
    (json.dumps([GOOD, "tiny"]), ADMIN, "NEXTSTEP_API_KEYS"),
    (json.dumps([f" {GOOD}"]), ADMIN, "NEXTSTEP_API_KEYS"),  # a space: no client sends it as part of a header
    (GOOD, json.dumps([ADMIN, GOOD]), "NEXTSTEP_API_KEYS and NEXTSTEP_ADMIN_KEYS"),  # one key in both roles
    ("[not json", ADMIN, "NEXTSTEP_API_KEYS"),
    (json.dumps([GOOD, 12345678901234567]), ADMIN, "NEXTSTEP_API_KEYS[1]"),
], ids=["empty-in-json", "trailing-comma", "empty-in-commas", "whitespace", "whitespace-in-json", "short",
        "short-in-json", "space", "both-roles", "bad-json", "not-a-string"])
def test_empty_short_or_doubled_keys_refuse_to_start(api_keys, admin_keys, named, tmp_path, monkeypatch):
    """However the keys are written (the environment, a .env file, arguments): one line naming the setting, no key."""
    env_file = tmp_path / ".env"
    env_file.write_text(f"NEXTSTEP_API_KEYS='{api_keys}'\nNEXTSTEP_ADMIN_KEYS='{admin_keys}'\n")
    monkeypatch.chdir(tmp_path)  # (Settings reads ./.env: the environment case runs without it)
    messages = []
    with pytest.raises(SettingsError) as refused:
        Settings(api_keys=api_keys, admin_keys=admin_keys)
    messages.append(str(refused.value))
    with pytest.raises(SettingsError) as refused:
        Settings(_env_file=env_file)
    messages.append(str(refused.value))
    env_file.unlink()
    monkeypatch.setenv("NEXTSTEP_API_KEYS", api_keys)
    monkeypatch.setenv("NEXTSTEP_ADMIN_KEYS", admin_keys)
    with pytest.raises(SettingsError) as refused:
        Settings()
    messages.append(str(refused.value))
    for message in messages:
        assert named in message and "\n" not in message, message
        shown = [k for k in (GOOD, ADMIN, "user-key-1234567890", "admin-key-1234567890", "admin-key-short", "tiny")
                 if k in message]
        assert not shown, message


def test_keys_as_the_service_reads_them(monkeypatch):
    monkeypatch.setenv("NEXTSTEP_API_KEYS", f" {USER_1} , {USER_2}")
    monkeypatch.setenv("NEXTSTEP_ADMIN_KEYS", json.dumps([ADMIN]))
    assert (Settings().api_keys, Settings().admin_keys) == ([USER_1, USER_2], [ADMIN])
    for unset in ("", "[]"):  # no keys: development (the admin routes for loopback clients only)
        monkeypatch.setenv("NEXTSTEP_API_KEYS", unset)
        assert Settings().api_keys == []


def test_nextstep_serve_refuses_an_empty_admin_key_in_one_line(artifacts):
    """The issue's command: an empty entry in a JSON list of admin keys was an admin key that an empty X-API-Key
    matched; now `nextstep serve` exits before it listens, with one line naming the setting."""
    art, _ = artifacts
    env = {**os.environ, "NEXTSTEP_API_KEYS": '["user-key-1234567890"]',
           "NEXTSTEP_ADMIN_KEYS": '["", "admin-key-1234567890"]'}
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "nextstep.cli", "serve", "--port", str(port), "--artifacts",
                           str(art)], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "NEXTSTEP_ADMIN_KEYS" in lines[0] and "empty" in lines[0], done.stderr
    assert "admin-key-1234567890" not in done.stderr and "user-key-1234567890" not in done.stderr


# -- the head's size, and requests that do not parse ---------------------------------------------------------------


@pytest.fixture
def small_head_server(artifacts):
    """The server with a 4096-byte limit on a request's head; yields (host, port)."""
    with _server(artifacts, max_header_bytes=4096, header_timeout_seconds=5.0) as address:
        yield address


def _head(size: int, path: bytes = b"/healthz", close: bool = False) -> bytes:
    """A GET whose request line and headers are `size` bytes, the blank line that ends them included."""
    start = b"GET %s HTTP/1.1\r\nHost: x\r\n%bX-Pad: " % (path, b"Connection: close\r\n" if close else b"")
    return start + b"a" * (size - len(start) - 4) + b"\r\n\r\n"


def _problem(received: bytes, status: int) -> dict:
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), received[:300]
    assert b"content-type: application/problem+json" in head.lower() and b"connection: close" in head.lower()
    problem = json.loads(body)
    assert problem["status"] == status and problem["title"] and problem["detail"], problem
    return problem


def test_a_head_over_the_limit_is_431_and_its_connection_closed(small_head_server):
    host, port = small_head_server
    with socket.create_connection((host, port)) as sock:  # at the limit: served, and the connection kept
        sock.sendall(_head(4096))
        sock.settimeout(5)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
        sock.sendall(_head(4096))  # the next request's head is counted afresh
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 ")
    with socket.create_connection((host, port)) as sock:  # one byte over, the head unfinished: not read whole
        sock.sendall(_head(4097))
        received, after = _read_until_closed(sock, limit=3.0)
    assert after < 1.0
    assert "NEXTSTEP_MAX_HEADER_BYTES" in _problem(received, 431)["detail"]
    with socket.create_connection((host, port)) as sock:  # two requests in one write, each within the limit
        sock.sendall(_head(3000) + _head(3000, b"/healthz?again", close=True))
        received, _ = _read_until_closed(sock, limit=3.0)
    assert received.count(b"HTTP/1.1 200 ") == 2 and b" 431 " not in received


def test_a_40_mb_header_is_cut_off_and_the_service_goes_on(deadline_server):
    """The issue's request: a 40 MB header on /healthz was read whole (200), eight of them took the service from
    130 to 496 MiB. Now the connection is answered 431 and closed once its head passes 64 KiB; what the client
    got to send before it saw that is what the sockets' buffers held."""
    host, port = deadline_server
    with socket.create_connection((host, port)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
        sock.settimeout(5)
        sent, chunk = 0, b"a" * 65536
        try:
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ")
            while sent < 40_000_000:
                sent += sock.send(chunk)
            sock.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            received = sock.recv(65536)
        except ConnectionResetError:  # (the kernel may drop the answer with the reset of the unread bytes)
            received = b""
    assert sent < 16_000_000, f"the server read {sent} bytes of one header"
    if received:
        assert received.startswith(b"HTTP/1.1 431 "), received[:200]
    assert httpx.get(f"http://{host}:{port}/healthz").status_code == 200


MALFORMED = {
    "not a method": b"GARBAGE / HTTP/1.1\r\nHost: x\r\n\r\n",
    "bad version": b"GET /healthz HTTP/9.Z\r\nHost: x\r\n\r\n",
    "space in a header name": b"GET /healthz HTTP/1.1\r\nHo st: x\r\n\r\n",
    "control character in a value": b"GET /healthz HTTP/1.1\r\nHost: x\x01y\r\n\r\n",
    "header without a colon": b"GET /healthz HTTP/1.1\r\nHost x\r\n\r\n",
    "byte 0xff in the path": b"GET /\xff HTTP/1.1\r\nHost: x\r\n\r\n",
    "content-length not a number": b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n",
    "two content-lengths": b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n"
                           b"Content-Length: 2\r\n\r\n{}",
    "content-length and chunked": b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                                  b"Transfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n",
    "bad chunk size": b"POST /v1/kt/deep_gpcm/events HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                      b"zz\r\n{}\r\n0\r\n\r\n",
    "bare LF line ends": b"GET /healthz HTTP/1.1\nHost: x\n\n",
}


@pytest.mark.parametrize("request_bytes", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_request_that_does_not_parse_is_a_problem_400(deadline_server, request_bytes):
    host, port = deadline_server
    with socket.create_connection((host, port)) as sock:
        sock.sendall(request_bytes)
        received, _ = _read_until_closed(sock, limit=3.0)
    assert _problem(received, 400)["detail"].startswith("malformed HTTP request: "), received


# -- what clients that are not admins see of the state store's failures ------------------------------------------


def test_a_store_outage_names_no_address_but_to_admins_and_the_log(artifacts, redis_process, serve, caplog):
    art, _ = artifacts
    settings = Settings(artifacts_dir=art, redis_url=redis_process.url, api_keys=[USER_1], admin_keys=[ADMIN])
    address = redis_process.url.removeprefix("redis://").split("/")[0]  # 127.0.0.1:<port>
    port = address.rsplit(":", 1)[1]
    with serve(settings) as url, httpx.Client(base_url=url, timeout=10) as http:
        redis_process.stop()
        caplog.set_level("WARNING", logger="nextstep.service")
        for headers in ({"X-API-Key": USER_1}, {"X-API-Key": ADMIN, **REMOTE}):  # (an admin key from anywhere)
            for method, path, body in (("POST", "/v1/kt/deep_gpcm/events", EVENTS),
                                       ("GET", "/v1/kt/deep_gpcm/students/s", None), ("GET", "/readyz", None)):
                reply = http.request(method, path, json=body, headers=headers)
                assert reply.status_code == 503 and "unavailable" in reply.json()["detail"], reply.text
                if headers["X-API-Key"] == USER_1:
                    assert port not in reply.text and "127.0.0.1" not in reply.text, reply.text
        ready = http.get("/readyz")  # (open: no key, so no details)
        assert ready.status_code == 503 and port not in ready.text, ready.text
    assert any("state store unavailable" in r.getMessage() for r in caplog.records)  # the details: the log
