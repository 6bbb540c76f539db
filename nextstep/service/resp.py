"""A small asyncio Redis client for the service's hot path: one multiplexed connection, replies by hiredis.

Why not redis-py's asyncio client: per command it costs about 0.1-0.2 ms of event-loop CPU (connection
pool, StreamReader, retry and timeout wrappers), which was a third of an event's cost in
bench/service_load.py; this client costs about 0.02 ms. What it does:

* one TCP (or unix socket, or TLS) connection, opened on first use and again after any failure;
* commands from concurrent callers are collected during one event-loop iteration and written together
  (one system call), their replies matched in order (Redis answers in order): concurrent requests share
  writes and round trips (pipelining);
* `call(*commands)` sends several commands in one write and returns their replies; an error reply is
  returned as `ReplyError`, not raised, so the caller decides (e.g. NOSCRIPT -> EVAL);
* a reply that does not come within `timeout` seconds means the server is hung: the connection is
  dropped, every caller waiting on it gets `TimeoutError`, the next call reconnects. Connection failures
  raise `ConnectionError` (`NotSent` when no connection could be opened: nothing was sent); a peer that does not
  speak RESP raises `ProtocolError`. Nothing is retried here (redis_clients.py decides).

It speaks to one node; redis_clients.py builds it from a URL and puts it behind the same interface as redis-py's
clients (cluster, Sentinel, pools).
"""

from __future__ import annotations

import asyncio
import collections
import ssl as _ssl

import hiredis

ReplyError = hiredis.ReplyError


class ProtocolError(ConnectionError):
    """The peer's bytes are not RESP: not a Redis server."""


class NotSent(ConnectionError):
    """No connection could be opened (or set up): nothing was sent, so even a write may be tried again."""


def pack(*args: bytes | str | int | float) -> bytes:
    """One command in RESP: hiredis's encoder (in C: under half of pack_python's time), pack_python for what it
    does not take (bool, bytearray)."""
    try:
        return hiredis.pack_command(args)
    except TypeError:
        return pack_python(*args)


def pack_python(*args: bytes | str | int | float) -> bytes:
    """One command in RESP, in Python: str as UTF-8, an int in decimal, a float as its repr."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        if isinstance(a, str):
            a = a.encode()
        elif isinstance(a, int):
            a = b"%d" % a
        elif isinstance(a, float):
            a = repr(a).encode()
        out += (b"$%d\r\n" % len(a), a, b"\r\n")  # (not "%b" % a: that copies a state blob once more)
    return b"".join(out)


class _Protocol(asyncio.Protocol):
    def __init__(self, timeout: float) -> None:
        self._reader = hiredis.Reader()
        self._waiters: collections.deque[tuple[asyncio.Future, float]] = collections.deque()  # (future, sent at)
        self._timeout = timeout
        self._timer: asyncio.TimerHandle | None = None
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None  # set once the connection is unusable
        self._pending: list[bytes] = []  # commands not written yet
        self._loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self._reader.feed(data)
        waiters = self._waiters
        while True:
            try:
                reply = self._reader.gets()
            except hiredis.ProtocolError as exc:
                self._fail(ProtocolError(f"not a Redis reply: {exc}"))
                return
            if reply is False:
                return
            if not waiters:  # an error before any command is the server refusing the connection (maxclients)
                self._fail(reply if isinstance(reply, ReplyError) else ProtocolError("a reply nobody asked for"))
                return
            future, _ = waiters.popleft()
            if not future.done():  # the caller may have been cancelled
                future.set_result(reply)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._fail(ConnectionError(f"connection lost: {exc}" if exc else "connection closed by the server"))

    def _fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        while self._waiters:
            future, _ = self._waiters.popleft()
            if not future.done():
                future.set_exception(error)
        if self.transport is not None:
            self.transport.abort()

    def send(self, payload: bytes, n: int) -> list[asyncio.Future]:
        if self.error is not None:
            raise self.error
        loop = self._loop
        now = loop.time()
        futures = [loop.create_future() for _ in range(n)]
        self._waiters.extend((f, now) for f in futures)
        if not self._pending:  # the first command of this loop iteration: write them all at its end
            loop.call_soon(self._flush)
        self._pending.append(payload)
        if self._timer is None:
            self._timer = loop.call_at(now + self._timeout, self._check)
        return futures

    def _flush(self) -> None:
        """One write (one system call) for every command sent during the last loop iteration: under load the
        commands of many requests share it."""
        pending, self._pending = self._pending, []
        if self.error is None:
            self.transport.write(b"".join(pending))

    def _check(self) -> None:
        """The oldest unanswered command tells whether the server is hung (replies come in order)."""
        self._timer = None
        if not self._waiters:
            return
        due = self._waiters[0][1] + self._timeout
        if self._loop.time() >= due:
            self._fail(TimeoutError(f"no reply within {self._timeout:g} s"))
        else:
            self._timer = self._loop.call_at(due, self._check)


class RespClient:
    """`await client.call(pack(...), pack(...))` -> the replies, in order."""

    def __init__(self, *, host: str | None = None, port: int | None = None, path: str | None = None,
                 ssl: _ssl.SSLContext | None = None, setup: list[bytes] = (), timeout: float,
                 connect_timeout: float) -> None:
        """A TCP (`host`, `port`; TLS with `ssl`) or unix socket (`path`) connection; `setup`: commands (AUTH,
        SELECT) sent first on every connection. redis_clients.RespClient builds these from a URL."""
        self._path, self._host, self._port, self._ssl = path, host, port, ssl
        self._setup = list(setup)
        self._timeout, self._connect_timeout = timeout, connect_timeout
        self._proto: _Protocol | None = None
        self._connecting: asyncio.Future | None = None

    async def _connection(self) -> _Protocol:
        proto = self._proto
        if proto is not None and proto.error is None:
            return proto
        if self._connecting is None:  # one connect at a time; concurrent callers wait for it
            self._connecting = asyncio.ensure_future(self._connect())
        connecting = self._connecting
        try:
            return await asyncio.shield(connecting)
        finally:
            if connecting.done() and self._connecting is connecting:
                self._connecting = None

    async def _connect(self) -> _Protocol:
        loop = asyncio.get_running_loop()
        self._proto = None

        def factory():
            return _Protocol(self._timeout)

        async with asyncio.timeout(self._connect_timeout):
            if self._path:
                _, proto = await loop.create_unix_connection(factory, self._path)
            else:
                _, proto = await loop.create_connection(factory, self._host, self._port, ssl=self._ssl)
        if self._setup:
            for reply in await asyncio.gather(*proto.send(b"".join(self._setup), len(self._setup))):
                if isinstance(reply, ReplyError):
                    proto._fail(ConnectionError(f"connection setup refused: {reply}"))
                    raise proto.error
        self._proto = proto
        return proto

    async def call(self, *commands: bytes) -> list:
        try:
            proto = await self._connection()
        except (OSError, TimeoutError) as exc:
            raise NotSent(str(exc) or type(exc).__name__) from exc
        futures = proto.send(b"".join(commands) if len(commands) > 1 else commands[0], len(commands))
        try:
            return [await f for f in futures]
        except BaseException:
            for f in futures:  # the others failed with the same error: mark it seen, or cancel them
                if f.done() and not f.cancelled():
                    f.exception()
                else:
                    f.cancel()
            raise

    async def close(self) -> None:
        if self._connecting is not None and not self._connecting.done():
            self._connecting.cancel()
        if self._proto is not None and self._proto.transport is not None:
            self._proto.transport.close()
        self._proto = None
