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

Nor does uvicorn bound a request's head in bytes: httptools buffers a header value of any size before the app (and
its key check) sees the request, so a few connections sending 40 MB headers take hundreds of MB. The protocol
counts each head's bytes as they arrive and answers `431 Request Header Fields Too Large` once they pass
`max_header_bytes`, before the parser has them, and closes the connection. A request that does not parse is a 400.
Each of these answers is a problem document (application/problem+json), as the app's own are.

    run(host=..., port=..., workers=..., access_log=...)    # what `nextstep serve` calls
    config(app, settings, **uvicorn_options) -> ServerConfig  # the same server for tests or embedding
"""

from __future__ import annotations

import ipaddress
import json
import logging
import sys
from http import HTTPStatus

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from .settings import Settings

log = logging.getLogger("nextstep.service")


def _answer(status: int, detail: str) -> bytes:
    """A whole HTTP response: a problem document (the app's shape, errors.problem) that closes the connection."""
    phrase = HTTPStatus(status).phrase
    body = json.dumps({"type": "about:blank", "title": phrase, "status": status, "detail": detail}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/problem+json\r\ncontent-length: %d\r\n"
            b"connection: close\r\n\r\n%b" % (status, phrase.encode(), len(body), body))


_TIMED_OUT = _answer(408, "the request did not arrive in time (header and body read deadlines)")


class ServerConfig(uvicorn.Config):
    """uvicorn's Config with the read deadlines and the head's size limit (picklable: `--workers` sends it to each
    worker process)."""

    def __init__(self, app, *, header_timeout: float, body_timeout: float, max_header_bytes: int = 65_536,
                 **options) -> None:
        super().__init__(app, http=DeadlineProtocol, **options)
        self.header_timeout, self.body_timeout = header_timeout, body_timeout
        self.max_header_bytes = max_header_bytes


class DeadlineProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a deadline for each request's head and one for its body, a size limit on
    the head, and problem documents for the requests it refuses (module doc)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_timeout = getattr(self.config, "header_timeout", 10.0)
        self._body_timeout = getattr(self.config, "body_timeout", 30.0)
        self._max_head = getattr(self.config, "max_header_bytes", 65_536)
        self._timer = None  # the deadline of the request being read; None between requests
        self._head_done: float | None = None  # loop time at which the request's head was complete
        self._head_bytes: int | None = 0  # bytes of the head being read; None while a body is
        self._heads = 0  # heads completed on this connection

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm()  # a connection that never sends a byte is closed too

    def data_received(self, data: bytes) -> None:
        if self._head_bytes is None:  # a body (the app bounds it: NEXTSTEP_MAX_BODY_BYTES)
            super().data_received(data)
            return
        room = self._max_head - self._head_bytes
        if len(data) <= room:
            self._head_bytes += len(data)
            super().data_received(data)
            return
        # over the limit unless the head ends within the bytes it may still have: the parser gets those first,
        # and the rest only if the head did end there (the rest is then a body or the next request's head; a
        # pipelined head that starts within the same read is counted from the next read on)
        heads = self._heads
        self._head_bytes = self._max_head
        super().data_received(data[:room])
        if self.transport.is_closing():  # (a request that did not parse: answered 400 and closed)
            return
        if self._heads != heads:
            self.data_received(data[room:])
            return
        log.info("closed a connection from %s: request line and headers over %d bytes", self.client,
                 self._max_head)
        cycle = self.cycle  # the previous request's, if any: never answer into the middle of its response
        if cycle is None or cycle.response_complete:
            self.transport.write(_answer(431, f"the request line and headers are over {self._max_head} bytes "
                                              "(NEXTSTEP_MAX_HEADER_BYTES)"))
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        # uvicorn's answer to a request httptools cannot parse, as a problem document; called while that parser
        # error is handled, whose message says what is wrong ("Invalid header value char") without the request
        error = sys.exc_info()[1]
        what = str(error) if isinstance(error, httptools.HttpParserError) and str(error) else msg
        self.transport.write(_answer(400, f"malformed HTTP request: {what}"))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._timer is None:
            self._arm()

    def on_headers_complete(self) -> None:
        self._head_done = self.loop.time()  # the timer, due at the head's deadline, then moves to the body's
        self._head_bytes, self._heads = None, self._heads + 1
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        self._head_bytes = 0  # the next request's head
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
                        body_timeout=settings.body_timeout_seconds, max_header_bytes=settings.max_header_bytes,
                        **options)


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
