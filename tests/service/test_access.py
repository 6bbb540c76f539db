"""Who may call what (API keys and roles, the loopback rule), and the read deadlines of `nextstep serve`'s server:
real HTTP against uvicorn on a real socket, no mocks."""

from __future__ import annotations

import json
import socket
import threading
import time
from contextlib import contextmanager

import httpx
import pytest
import uvicorn

from nextstep.service import server as served
from nextstep.service.app import create_app
from nextstep.service.settings import Settings

EVENTS = {"student_id": "s", "events": [{"question_id": 3, "response": 1}]}
REMOTE = {"X-Forwarded-For": "203.0.113.9"}  # uvicorn trusts it from 127.0.0.1: a client behind a local proxy


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
    settings = Settings(artifacts_dir=art, api_keys=["user-1", "user-2"], admin_keys=["admin-1"])
    user, admin = {"X-API-Key": "user-2"}, {"X-API-Key": "admin-1"}
    with serve(settings) as url, httpx.Client(base_url=url) as http:
        for headers, status in (({}, 401), ({"X-API-Key": "nope"}, 401), ({"X-API-Key": "admin-"}, 401),
                                (user, 200), (admin, 200)):
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
    with serve(Settings(artifacts_dir=art, api_keys=["k"])) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/models/reload").status_code == 401  # a key is still needed
        assert http.post("/v1/models/reload", headers={"X-API-Key": "k"}).status_code == 200
        reply = http.post("/v1/models/reload", headers={"X-API-Key": "k", **REMOTE})
        assert reply.status_code == 403 and reply.json()["field"] == "NEXTSTEP_ADMIN_KEYS"
        scrape = http.get("/metrics").text  # refusals are counted, before any route is matched
        for status in (401, 403):
            assert f'nextstep_requests_total{{model="",route="refused",status="{status}"}} 1.0' in scrape, status
    with serve(Settings(artifacts_dir=art, admin_keys=["a"])) as url, httpx.Client(base_url=url) as http:
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS).status_code == 401  # admin keys alone: all need one
        assert http.post("/v1/kt/deep_gpcm/events", json=EVENTS, headers={"X-API-Key": "a"}).status_code == 200


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


@pytest.fixture
def deadline_server(artifacts):
    """The app under `nextstep serve`'s server with 1-second read deadlines; yields (host, port)."""
    art, _ = artifacts
    settings = Settings(artifacts_dir=art, header_timeout_seconds=1.0, body_timeout_seconds=1.0)
    config = served.config(create_app(settings), settings, host="127.0.0.1", port=0, lifespan="on",
                           log_level="warning")
    with running(config) as address:
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
