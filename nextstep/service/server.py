"""The HTTP server `nextstep serve` runs: uvicorn, with read deadlines it lacks.

uvicorn (0.54) closes an idle keep-alive connection after `timeout_keep_alive`, but has no limit on how long a
request may take to arrive: a client that opens a connection and sends half a request line, half its headers, or
a body shorter than its content-length holds the connection (and its memory) for as long as it likes, and a few
thousand such clients exhaust the server (slowloris). `DeadlineProtocol`, uvicorn's httptools protocol with one
timer per request, closes such connections:

* the head (request line and headers) must arrive within `header_timeout` seconds of the request's first byte (or
  of the connection's opening, for a connection that sends nothing);
* the body within `body_timeout` seconds of the end of the head.

A request that misses its deadline is answered `408 Request Timeout` (when nothing was answered yet) and its
connection is closed; an application still waiting for the body sees the client disconnect. Other connections are
not affected. The cost is one timer per request (about 1.5 us).

    run(host=..., port=..., workers=..., access_log=...)    # what `nextstep serve` calls
    config(app, settings, **uvicorn_options) -> ServerConfig  # the same server for tests or embedding
"""

from __future__ import annotations

import ipaddress
import json
import logging

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .settings import Settings

log = logging.getLogger("nextstep.service")
_PROBLEM = json.dumps({"type": "about:blank", "title": "Request Timeout", "status": 408,
                       "detail": "the request did not arrive in time (header and body read deadlines)"}).encode()
_TIMED_OUT = (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/problem+json\r\n"
              b"content-length: %d\r\nconnection: close\r\n\r\n%b" % (len(_PROBLEM), _PROBLEM))


class ServerConfig(uvicorn.Config):
    """uvicorn's Config with the read deadlines (picklable: `--workers` sends it to each worker process)."""

    def __init__(self, app, *, header_timeout: float, body_timeout: float, **options) -> None:
        super().__init__(app, http=DeadlineProtocol, **options)
        self.header_timeout, self.body_timeout = header_timeout, body_timeout


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's head and one for its body (module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = getattr(self.config, "header_timeout", 10.0)
        self._body_timeout = getattr(self.config, "body_timeout", 30.0)
        self._timer = None  # the deadline of the request being read; None between requests
        self._head_done: float | None = None  # loop time at which the request's head was complete

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is closed too

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._head_done = self.loop.time()  # the timer, due at the head's deadline, then moves to the body's
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self) -> None:
        self._head_done = None
        self._timer = self.loop.call_later(self._head_timeout, self._due)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _due(self) -> None:
        self._timer = None
        if self._head_done is not None:  # the head came in time: the body has until its own deadline
            body_due = self._head_done + self._body_timeout
            if self.loop.time() < body_due:
                self._timer = self.loop.call_at(body_due, self._due)
                return
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        what = "body" if self._head_done is not None else "request line and headers"
        limit = self._body_timeout if self._head_done is not None else self._head_timeout
        log.info("closed a connection from %s: %s not received within %g s", self.client, what, limit)
        cycle = self.cycle  # (until the head is in, the previous request's, if any)
        if cycle is None or (cycle.response_complete if self._head_done is None else not cycle.response_started):
            transport.write(_TIMED_OUT)  # never into the middle of a response
        transport.close()


def is_loopback(host: str | None) -> bool:
    """Whether a host or address names this machine's loopback interface ("localhost", 127.0.0.0/8, ::1)."""
    if host is None:
        return False
    if host == "localhost":
        return True
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def config(app, settings: Settings, **options) -> ServerConfig:
    """The server configuration for `app` (an ASGI app, or an import string with factory=True)."""
    return ServerConfig(app, header_timeout=settings.header_timeout_seconds,
                        body_timeout=settings.body_timeout_seconds, **options)


def run(*, host: str, port: int, workers: int = 1, access_log: bool = False, settings: Settings | None = None) -> None:
    """Serve `nextstep.service.app:create_app` (settings from NEXTSTEP_* variables) until interrupted."""
    settings = settings or Settings()
    if not is_loopback(host) and not settings.admin_keys:
        log.warning("serving on %s without NEXTSTEP_ADMIN_KEYS: model reloads, bank swaps and deletes are refused "
                    "(403) to every client but this machine's loopback%s", host,
                    "" if settings.api_keys else "; every other route is open (no NEXTSTEP_API_KEYS)")
    server_config = config("nextstep.service.app:create_app", settings, factory=True, host=host, port=port,
                           workers=workers, access_log=access_log, log_level="info")
    server = uvicorn.Server(server_config)
    if workers > 1:
        from uvicorn.supervisors import Multiprocess

        Multiprocess(server_config, sockets=[server_config.bind_socket()]).run()
    else:
        server.run()
