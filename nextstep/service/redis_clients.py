"""The Redis clients the state stores and the bank store share: one node, a Redis Cluster or a Sentinel-watched
primary, chosen by the URL (NEXTSTEP_REDIS_URL):

    redis://[user:password@]host[:port][/db]          one node (rediss:// with TLS)
    unix://[user:password@]/path/to/socket[?db=N]     one node, on a unix socket
    redis+cluster://host:port[,host:port...]          a Redis Cluster: any of its nodes (rediss+cluster:// with TLS)
    redis+sentinel://host:port[,host:port...]/service[/db]   the primary the sentinels name (rediss+sentinel://)

Query parameters (each also a NEXTSTEP_REDIS_* setting, which the URL's parameter overrides; see `RedisOptions`):
`client` (resp | redis-py | auto), `socket_timeout`, `socket_connect_timeout`, `max_connections`, `retries`,
`wait_replicas`, `wait_timeout` (ms), `db`; TLS: `ssl_ca_certs`, `ssl_ca_path`, `ssl_certfile`, `ssl_keyfile`,
`ssl_password`, `ssl_cert_reqs` (none | optional | required), `ssl_check_hostname`, `ssl_min_version` (TLSv1_2,
TLSv1_3), `ssl_ciphers`; Sentinel: `sentinel_username`, `sentinel_password`. An unknown parameter is an error,
not ignored.

Two implementations of one small interface (`Client.execute`: commands as tuples, sent in one write, their
replies in order):

* `RespClient` -- the service's own pipelined client (resp.py) for one node: one connection shared by every
  caller; the fastest (docs/decisions.md, "Redis clients"), so the default (`client=auto`) for a single node
  without `wait_replicas`.
* `PoolClient` (redis-py, one node or Sentinel) and `ClusterClient` (redis-py's `redis.asyncio.cluster`): a pool
  of connections, each carrying one caller's commands at a time.

Every client maps failures the same way: connection failures, timeouts, peers that do not speak RESP and the
"cannot serve now" error replies (`UNAVAILABLE_REPLIES`) raise `StoreUnavailable` naming the operation and the
reply; a write that was sent and then met a timeout or a lost connection raises `OutcomeUnknown` (it may have been
applied); NOSCRIPT is returned (the caller loads its script); any other error reply raises
redis.exceptions.ResponseError (a bug). The messages never name the server (they reach HTTP clients): the log does,
once per outage (`Health`: a line when Redis stops answering, one when it answers again, a reminder a minute).

Retries (docs/decisions.md): a call marked `idempotent` (every read, DEL, the bank writes) is retried up to
`retries` times after a connection failure or a timeout; the compare-and-set is retried only when it was certainly
not sent (the connection could not be opened). A cluster's MOVED and ASK redirects (the node did not run the
command) are followed by redis-py for every command.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import ssl as _ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import parse_qs, parse_qsl, unquote, urlencode, urlsplit, urlunsplit

import hiredis
import redis.exceptions as rexc
from redis.crc import key_slot

from .errors import OutcomeUnknown, StoreUnavailable
from .resp import NotSent, ReplyError, pack
from .resp import RespClient as _Resp

Command = tuple  # (name, *args): bytes, str, int or float each
log = logging.getLogger(__name__)

# Error replies meaning "Redis cannot serve us now", each with what it means for the operator. A write is refused
# whole in every case (Redis checks them before the command, or the script's first write, runs), so nothing is
# half-written. Any other error reply (e.g. WRONGTYPE) is a bug and propagates as redis.exceptions.ResponseError.
UNAVAILABLE_REPLIES = {
    "LOADING": "the server is loading its dataset from disk",
    "READONLY": "the server is a read-only replica (after a failover?): NEXTSTEP_REDIS_URL must name the primary",
    "MASTERDOWN": "the server is a replica whose primary is down (replica-serve-stale-data no)",
    "BUSY": "the server is busy running a script",
    "NOAUTH": "authentication needed: put the password in NEXTSTEP_REDIS_URL",
    "WRONGPASS": "the password in NEXTSTEP_REDIS_URL is refused",
    "NOPERM": "the Redis user lacks a permission the service needs",
    "CLUSTERDOWN": "the cluster is down",
    "TRYAGAIN": "the cluster is moving this key",
    "MOVED": "the cluster moved this key's slot (the next request follows it)",
    "ASK": "the cluster is moving this key's slot",
    "OOM": "the server is out of memory (maxmemory with a no-eviction policy)",
    "MISCONF": "the server refuses writes because it cannot persist to disk",
    "NOREPLICAS": "not enough replicas acknowledge writes (min-replicas-to-write)",
    "ERR max number of clients reached": "the server has reached maxclients",
}
_UNAVAILABLE_PREFIXES = tuple(UNAVAILABLE_REPLIES)
CLIENTS = ("auto", "resp", "redis-py")


@dataclass(frozen=True)
class RedisOptions:
    """How the service talks to Redis (NEXTSTEP_REDIS_* settings; a URL query parameter of the same meaning wins)."""

    client: str = "auto"  # resp | redis-py | auto: resp for one node without wait_replicas, else redis-py
    socket_timeout: float = 0.5  # seconds for a reply (a hung server); WAIT's own timeout comes on top
    connect_timeout: float = 0.5  # seconds to open a connection
    pool_size: int = 64  # redis-py: connections per node (each carries one request's commands at a time)
    retries: int = 1  # retries of an idempotent call (reads, DEL, bank writes) after a connection failure/timeout
    wait_replicas: int = 0  # a write is acknowledged once this many replicas have it (WAIT); 0 = don't wait
    wait_timeout_ms: int = 100  # how long WAIT waits; fewer replicas by then -> StoreUnavailable (the write stands)

    def __post_init__(self) -> None:
        if self.client not in CLIENTS:
            raise ValueError(f"Redis client {self.client!r}: one of {', '.join(CLIENTS)}")
        for name in ("socket_timeout", "connect_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Redis {name} must be > 0, got {getattr(self, name)!r}")
        if self.pool_size < 1 or self.retries < 0 or self.wait_replicas < 0 or self.wait_timeout_ms < 1:
            raise ValueError(f"Redis options out of range: {self}")


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL."""

    kind: str  # node | cluster | sentinel
    tls: bool
    hosts: tuple[tuple[str, int], ...]  # the node, the cluster's seed nodes, or the sentinels
    path: str | None = None  # unix socket
    db: int = 0
    username: str | None = None
    password: str | None = None
    service: str | None = None  # sentinel: the monitored primary's name
    ssl: dict = field(default_factory=dict)  # redis-py's ssl_* keyword arguments
    sentinel: dict = field(default_factory=dict)  # sentinel_username / sentinel_password
    options: RedisOptions = RedisOptions()

    @property
    def where(self) -> str:
        """The URL without credentials or parameters, for messages."""
        scheme = ("rediss" if self.tls else "redis") + ("" if self.kind == "node" else f"+{self.kind}")
        if self.path:
            return f"unix://{self.path}"
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.hosts)
        tail = f"/{self.service}" if self.kind == "sentinel" else ""
        return f"{scheme}://{hosts}{tail}" + (f"/{self.db}" if self.kind != "cluster" else "")


_OPTION_PARAMS = {"client": ("client", str), "socket_timeout": ("socket_timeout", float),
                  "socket_connect_timeout": ("connect_timeout", float), "max_connections": ("pool_size", int),
                  "retries": ("retries", int), "wait_replicas": ("wait_replicas", int),
                  "wait_timeout": ("wait_timeout_ms", int)}
_SSL_PARAMS = ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_cert_reqs",
               "ssl_check_hostname", "ssl_min_version", "ssl_ciphers")
_SENTINEL_PARAMS = ("sentinel_username", "sentinel_password")
_SCHEMES = {"redis": (False, "node"), "rediss": (True, "node"), "unix": (False, "node"),
            "redis+cluster": (False, "cluster"), "rediss+cluster": (True, "cluster"),
            "redis+sentinel": (False, "sentinel"), "rediss+sentinel": (True, "sentinel")}


_SECRET_PARAMS = ("password", "ssl_password", "sentinel_password")


def redacted(url: str) -> str:
    """A Redis URL as messages show it: the passwords (in the user part and the parameters) as ***."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc = parts.netloc
    if "@" in netloc:
        credentials, _, hosts = netloc.rpartition("@")
        user, colon, _ = credentials.partition(":")
        netloc = f"{user}{':***' if colon else ''}@{hosts}"
    query = urlencode([(k, "***" if k in _SECRET_PARAMS else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)], safe="/*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def _hosts(netloc: str, default_port: int, shown: str) -> tuple[tuple[str, int], ...]:
    """host[:port][,host[:port]...] (an IPv6 address in brackets) -> ((host, port), ...); ValueError naming the
    faulty part."""
    hosts = ()
    for item in netloc.split(","):
        if item.startswith("["):  # [::1]:6379
            host, closed, rest = item[1:].partition("]")
            if not closed or (rest and not rest.startswith(":")):
                raise ValueError(f"Redis URL {shown}: {item!r} is not host[:port] ([an IPv6 address] in brackets)")
            port = rest[1:] if rest else None
        elif item.count(":") > 1:
            raise ValueError(f"Redis URL {shown}: {item!r}: an IPv6 address goes in brackets ([::1]:6379)")
        else:
            host, colon, port = item.partition(":")
            port = port if colon else None
        if not host:
            raise ValueError(f"Redis URL {shown} without a host")
        if port is not None and not (port.isascii() and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"Redis URL {shown}: port {port!r} of host {host!r} is not a number from 1 to 65535")
        hosts += ((host, int(port) if port else default_port),)
    return hosts


def _bool(name: str, value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"Redis URL parameter {name}={value!r}: not a boolean")


def parse_url(url: str, options: RedisOptions | None = None) -> RedisTarget:
    """A Redis URL (module docstring) with `options` as the defaults of its parameters; ValueError when malformed
    (the message shows the URL without its passwords)."""
    options = options or RedisOptions()
    shown = redacted(url)
    try:
        parts = urlsplit(url)
    except ValueError as exc:  # (an unclosed "[")
        raise ValueError(f"Redis URL {shown}: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in _SCHEMES:
        raise ValueError(f"Redis URL scheme {parts.scheme!r} not supported: one of {', '.join(_SCHEMES)}")
    tls, kind = _SCHEMES[scheme]
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    unknown = set(query) - set(_OPTION_PARAMS) - set(_SSL_PARAMS) - set(_SENTINEL_PARAMS) - {"db", "password"}
    if unknown:
        raise ValueError(f"Redis URL parameter(s) {', '.join(sorted(unknown))} not known; known: "
                         f"{', '.join(sorted([*_OPTION_PARAMS, *_SSL_PARAMS, *_SENTINEL_PARAMS, 'db']))}")
    changes = {}
    for param, (name, kind_of) in _OPTION_PARAMS.items():
        if param in query:
            try:
                changes[name] = kind_of(query[param])
            except ValueError:
                raise ValueError(f"Redis URL parameter {param}={query[param]!r}: not a {kind_of.__name__}") from None
    options = replace(options, **changes)
    ssl = {k: query[k] for k in _SSL_PARAMS if k in query}
    if "ssl_check_hostname" in ssl:
        ssl["ssl_check_hostname"] = _bool("ssl_check_hostname", ssl["ssl_check_hostname"])
    if ssl.get("ssl_cert_reqs", "required") not in ("none", "optional", "required"):
        raise ValueError(f"Redis URL parameter ssl_cert_reqs={ssl['ssl_cert_reqs']!r}: none, optional or required")
    if "ssl_min_version" in ssl:
        try:
            ssl["ssl_min_version"] = _ssl.TLSVersion[ssl["ssl_min_version"]]
        except KeyError:
            raise ValueError(f"Redis URL parameter ssl_min_version={ssl['ssl_min_version']!r}: TLSv1_2 or "
                             "TLSv1_3") from None
    if ssl and not tls:
        raise ValueError(f"Redis URL parameters {', '.join(sorted(ssl))} need TLS: use a rediss scheme")
    sentinel = {k: query[k] for k in _SENTINEL_PARAMS if k in query}
    if sentinel and kind != "sentinel":
        raise ValueError("sentinel_username/sentinel_password apply to redis+sentinel:// URLs only")
    username = unquote(parts.username) if parts.username else None
    password = unquote(parts.password) if parts.password is not None else query.get("password")
    path_parts = [p for p in parts.path.split("/") if p]
    service, db, path, hosts = None, query.get("db"), None, ()
    if scheme == "unix":
        path = parts.path
        if not path:
            raise ValueError(f"unix:// Redis URL without a socket path: {shown}")
    else:
        hosts = _hosts(parts.netloc.rpartition("@")[2], 26379 if kind == "sentinel" else 6379, shown)
        if kind == "node" and len(hosts) > 1:
            raise ValueError(f"several hosts in {shown}: use redis+cluster:// or redis+sentinel://")
        if kind == "sentinel":
            if not path_parts:
                raise ValueError(f"redis+sentinel:// URL without the service name: {shown} (.../mymaster)")
            service, path_parts = path_parts[0], path_parts[1:]
        if len(path_parts) > 1:
            raise ValueError(f"Redis URL {shown}: the path is /db (a number), or /service[/db] for Sentinel")
        if path_parts:
            db = path_parts[0]
    db = "0" if db is None or db == "" else db
    if not (db.isascii() and db.isdigit()):
        raise ValueError(f"Redis URL {shown}: database {db!r} is not a number (0, 1, ...)")
    db = int(db)
    if kind == "cluster" and db:
        raise ValueError("a Redis Cluster has database 0 only")
    if options.client == "resp" and (kind != "node" or options.wait_replicas):
        raise ValueError("client=resp speaks to one node without wait_replicas (a WAIT would hold up every request "
                         "pipelined behind it): use client=redis-py or auto")
    return RedisTarget(kind, tls, hosts, path, db, username, password, service, ssl, sentinel, options)


def ssl_context(ssl: dict) -> _ssl.SSLContext:
    """The TLS context redis-py would build from the same ssl_* arguments (the resp client's)."""
    reqs = {"none": _ssl.CERT_NONE, "optional": _ssl.CERT_OPTIONAL,
            "required": _ssl.CERT_REQUIRED}[ssl.get("ssl_cert_reqs", "required")]
    context = _ssl.create_default_context(cafile=ssl.get("ssl_ca_certs"), capath=ssl.get("ssl_ca_path"))
    context.check_hostname = bool(ssl.get("ssl_check_hostname", True)) and reqs != _ssl.CERT_NONE
    context.verify_mode = reqs
    if ssl.get("ssl_certfile"):
        context.load_cert_chain(ssl["ssl_certfile"], ssl.get("ssl_keyfile"), ssl.get("ssl_password"))
    if ssl.get("ssl_min_version") is not None:
        context.minimum_version = ssl["ssl_min_version"]
    if ssl.get("ssl_ciphers"):
        context.set_ciphers(ssl["ssl_ciphers"])
    return context


# -- errors ---------------------------------------------------------------------------------------------------------


def reply_text(error: BaseException) -> str:
    """An error reply as Redis wrote it ("READONLY You can't write..."), from either client's error object."""
    code = getattr(error, "status_code", None)  # redis-py strips the code it knows and keeps it here
    return f"{code} {error}" if code else str(error)


def is_noscript(reply) -> bool:
    return isinstance(reply, (ReplyError, rexc.ResponseError)) and reply_text(reply).startswith("NOSCRIPT")


def is_error(reply) -> bool:
    return isinstance(reply, (ReplyError, rexc.RedisError))


# host:port, [v6]:port and Python's ('host', port) address tuples, as OS and client errors write them
_ADDRESS = re.compile(r"\('[^']*', \d+(?:, \d+, \d+)?\)|\[[0-9A-Fa-f:.%]+\](?::\d+)?|[\w.\-]+:\d+\b")


def without_address(text: str) -> str:
    """An error text with every server address taken out (messages reach HTTP clients; the log names the server)."""
    return _ADDRESS.sub("<address>", text)


def refusal(what: str, error: BaseException) -> Exception:
    """StoreUnavailable for an error reply that means Redis cannot serve now; ResponseError for any other."""
    text = reply_text(error)
    if text.startswith(_UNAVAILABLE_PREFIXES):
        meaning = next(v for k, v in UNAVAILABLE_REPLIES.items() if text.startswith(k))
        return StoreUnavailable(f"Redis unavailable during {what}: {without_address(text)} ({meaning})")
    return rexc.ResponseError(text)


def _os_reason(error: BaseException) -> str | None:
    """The OS's words for the first OSError with an errno in an exception's chain ("Connection refused")."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, _ssl.SSLError):  # (its errno is OpenSSL's; its text says what failed)
            return None
        if isinstance(error, OSError) and error.errno:
            # (a resolver error has a negative errno and its own words; asyncio's connect errors carry the address)
            return error.strerror if error.errno < 0 and error.strerror else os.strerror(error.errno)
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _failure(error: BaseException, timeout: float) -> str:
    """What went wrong with the connection, in words, without the server's address."""
    if isinstance(error, NotSent):
        cause = error.__cause__ or error
        if isinstance(cause, (TimeoutError, asyncio.TimeoutError, rexc.TimeoutError)):
            return "connection failed: no connection within the connect timeout"
        return f"connection failed: {_os_reason(cause) or without_address(reply_text(cause)) or type(cause).__name__}"
    if isinstance(error, (TimeoutError, asyncio.TimeoutError, rexc.TimeoutError)):
        return f"no reply within {timeout:g} s"
    if isinstance(error, (rexc.InvalidResponse, rexc.DataError)):
        return f"not a Redis reply: {without_address(str(error))}"
    return f"connection lost: {_os_reason(error) or without_address(reply_text(error)) or type(error).__name__}"


class Health:
    """A client's outages in the log, with the server's address: one line when Redis stops answering (and why), one
    when it answers again, and while it stays down a one-line reminder every `remind` seconds; a server that comes
    and goes gets at most one "unavailable" line per `quiet` seconds (the next line counts the failed calls)."""

    def __init__(self, name: str, *, remind: float = 60.0, quiet: float = 10.0) -> None:
        self.name, self.remind, self.quiet = name, remind, quiet
        self.down = False  # (read on every call: the one cost when all is well)
        self.logged = False  # the current outage has been announced
        self.since = self.remind_at = 0.0
        self.quiet_until = -math.inf
        self.failures = 0

    def failed(self, reason: str) -> None:
        now = time.monotonic()
        if not self.down:
            self.down, self.logged, self.since, self.failures = True, False, now, 0
        self.failures += 1
        if not self.logged and now >= self.quiet_until:
            log.warning("%s unavailable: %s (logged again when it answers, and every %g s while it does not)",
                        self.name, reason, self.remind)
            self.logged, self.quiet_until, self.remind_at = True, now + self.quiet, now + self.remind
        elif self.logged and now >= self.remind_at:
            log.warning("%s still unavailable after %.0f s (%d failed calls): %s", self.name, now - self.since,
                        self.failures, reason)
            self.remind_at = now + self.remind

    def ok(self) -> None:
        if self.logged:
            log.warning("%s answers again after %.1f s unavailable (%d failed calls)", self.name,
                        time.monotonic() - self.since, self.failures)
        self.down = self.logged = False


_CONNECTION_ERRORS = (ConnectionError, TimeoutError, OSError, NotSent, rexc.ConnectionError, rexc.TimeoutError,
                      rexc.InvalidResponse, rexc.ClusterError, rexc.RedisClusterException)


class Client:
    """What the stores need from Redis. `execute(what, commands, atomic=, idempotent=, write=)`:

    * the commands go out in one write on one connection and their replies come back in order (with `atomic`,
      inside MULTI/EXEC: the replies of the commands within; all keys in one hash slot on a cluster);
    * `write`: with `wait_replicas`, the call returns only once that many replicas acknowledged it (WAIT on the
      same connection); fewer within `wait_timeout_ms` raises StoreUnavailable (the write itself stands);
    * `idempotent`: may be retried after a connection failure or timeout (`retries`); otherwise only when nothing
      was sent;
    * failures raise StoreUnavailable, or OutcomeUnknown for a `write` that was sent and not answered;
    * NOSCRIPT replies are returned; other error replies raise (module docstring)."""

    target: RedisTarget
    where: str

    def __init__(self, target: RedisTarget, role: str = "") -> None:
        self.target, self.where, self.options = target, target.where, target.options
        self.health = Health(f"Redis{f' ({role})' if role else ''} at {self.where}")

    async def execute(self, what: str, commands: Sequence[Command], *, atomic: bool = False,
                      idempotent: bool = True, write: bool = False) -> list:
        attempt, sent = 0, False
        while True:
            try:
                replies = await self._send(commands, atomic, write and self.options.wait_replicas > 0)
                break
            except OutcomeUnknown:  # (WAIT: the write stands, unreplicated)
                raise
            except StoreUnavailable as exc:  # the client's own finding (a cluster URL naming a plain server)
                self.health.failed(str(exc))
                raise
            except _CONNECTION_ERRORS as exc:
                if isinstance(exc, (rexc.RedisError, hiredis.ReplyError)) and getattr(exc, "status_code", None):
                    raise refusal(what, exc) from exc  # an error reply raised by the client (LOADING)
                sent = sent or not isinstance(exc, NotSent)
                if attempt < self.options.retries and (idempotent or isinstance(exc, NotSent)):
                    attempt += 1
                    await asyncio.sleep(min(0.05 * 2 ** (attempt - 1), 0.5))
                    continue
                reason = _failure(exc, self.options.socket_timeout)
                if self.target.tls and "reset by peer" in reason.lower():  # TLS 1.3: a refused client certificate
                    reason += (" (over TLS this is how a server that refuses the client certificate, or its "
                               "absence, often answers: check ssl_certfile/ssl_keyfile)")  # can come as a reset
                self.health.failed(f"{what}: {reason}")
                if write and sent:  # it may have run (or may yet run, when a hung server wakes up)
                    raise OutcomeUnknown(f"Redis unavailable during {what}: {reason}, after the write was sent: it "
                                         "may or may not have been applied") from exc
                raise StoreUnavailable(f"Redis unavailable during {what}: {reason}") from exc
        if self.health.down:
            self.health.ok()
        for reply in replies:
            if is_error(reply) and not is_noscript(reply):
                raise refusal(what, reply)
        return replies

    async def scan(self, cursor: str, match: str, count: int) -> tuple[str, list[bytes]]:
        """One SCAN step over the hashes whose names match `match`: (the next cursor, "0" once the walk is over; the
        names). A walk started at "0" and followed to "0" sees every key that existed throughout it (some maybe
        twice); on a cluster, every primary's in turn."""
        (reply,) = await self.execute("scan", (("SCAN", cursor, "MATCH", match, "COUNT", count, "TYPE", "hash"),))
        following, names = reply
        return (following.decode() if isinstance(following, bytes) else str(following)), list(names)

    def _check_wait(self, acknowledged) -> None:
        wanted = self.options.wait_replicas
        if not isinstance(acknowledged, int) or acknowledged < wanted:
            raise OutcomeUnknown(
                f"Redis: the write was applied but only {acknowledged} of {wanted} replicas acknowledged it within "
                f"{self.options.wait_timeout_ms} ms (NEXTSTEP_REDIS_WAIT_REPLICAS): a failover may still lose it; "
                "retrying the request with its event ids applies it once", resolvable=False)

    async def _send(self, commands: Sequence[Command], atomic: bool, wait: bool) -> list:
        raise NotImplementedError

    async def close(self) -> None:
        raise NotImplementedError


def _unwrap_exec(replies: list, n: int) -> list:
    """The replies of MULTI, n x QUEUED, EXEC -> the n commands' replies (a refused EXEC -> its error, n times)."""
    queued, result = replies[1:-1], replies[-1]
    for reply in queued:  # a command refused while queueing (OOM, READONLY ...) aborts the transaction
        if is_error(reply):
            return [reply] * n
    if is_error(result):
        return [result] * n
    return list(result)


class RespClient(Client):
    """One node through resp.RespClient: one connection, the commands of concurrent callers pipelined."""

    def __init__(self, target: RedisTarget, role: str = "") -> None:
        super().__init__(target, role)
        setup = []
        if target.password is not None:
            setup.append(pack("AUTH", target.username, target.password) if target.username
                         else pack("AUTH", target.password))
        if target.db:
            setup.append(pack("SELECT", target.db))
        ssl = ssl_context(target.ssl) if target.tls else None
        host, port = target.hosts[0] if target.hosts else (None, None)
        self._resp = _Resp(host=host, port=port, path=target.path, ssl=ssl, setup=setup,
                           timeout=target.options.socket_timeout, connect_timeout=target.options.connect_timeout)

    async def _send(self, commands: Sequence[Command], atomic: bool, wait: bool) -> list:
        packed = [pack(*c) for c in commands]
        if atomic:
            packed = [pack("MULTI"), *packed, pack("EXEC")]
        try:
            replies = await self._resp.call(*packed)
        except ReplyError as exc:  # the server refused the connection itself (maxclients)
            return [exc] * len(commands)
        return _unwrap_exec(replies, len(commands)) if atomic else replies

    async def close(self) -> None:
        await self._resp.close()


def _redis_py_kwargs(target: RedisTarget) -> dict:
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    kwargs = dict(username=target.username, password=target.password, socket_timeout=target.options.socket_timeout,
                  socket_connect_timeout=target.options.connect_timeout, retry=Retry(NoBackoff(), 0))
    if target.tls:
        kwargs.update(ssl=True, **target.ssl)
    return kwargs


class PoolClient(Client):
    """One node or a Sentinel-watched primary through a redis-py connection pool. Each call takes a connection,
    writes its commands in one packet and reads their replies (no response callbacks: the replies are RESP's, as
    the resp client's)."""

    def __init__(self, target: RedisTarget, role: str = "") -> None:
        super().__init__(target, role)
        import redis.asyncio as aioredis

        kwargs = _redis_py_kwargs(target)
        tls = kwargs.pop("ssl", False)
        kwargs.update(db=target.db, max_connections=target.options.pool_size)
        if target.kind == "sentinel":
            from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

            sentinel_kwargs = dict(socket_timeout=target.options.connect_timeout,
                                   socket_connect_timeout=target.options.connect_timeout,
                                   username=target.sentinel.get("sentinel_username"),
                                   password=target.sentinel.get("sentinel_password"))
            if tls:
                sentinel_kwargs.update(ssl=True, **target.ssl)
            self._sentinel = Sentinel(list(target.hosts), sentinel_kwargs=sentinel_kwargs, ssl=tls, **kwargs)
            self._pool = SentinelConnectionPool(target.service, self._sentinel, ssl=tls, **kwargs)
        elif target.path:
            kwargs.pop("ssl", None)
            self._pool = aioredis.ConnectionPool(connection_class=aioredis.UnixDomainSocketConnection,
                                                 path=target.path, **kwargs)
        else:
            host, port = target.hosts[0]
            cls = aioredis.SSLConnection if tls else aioredis.Connection
            self._pool = aioredis.ConnectionPool(connection_class=cls, host=host, port=port, **kwargs)
        self._wait_read_timeout = target.options.socket_timeout + target.options.wait_timeout_ms / 1000
        self._slots = asyncio.Semaphore(target.options.pool_size)  # callers beyond the pool wait for a connection

    async def _send(self, commands: Sequence[Command], atomic: bool, wait: bool) -> list:
        async with self._slots:
            return await self._on_connection(commands, atomic, wait)

    async def _on_connection(self, commands: Sequence[Command], atomic: bool, wait: bool) -> list:
        n = len(commands)
        if atomic:
            commands = [("MULTI",), *commands, ("EXEC",)]
        if wait:
            commands = [*commands, ("WAIT", self.options.wait_replicas, self.options.wait_timeout_ms)]
        try:
            conn = await self._pool.get_connection()
        except _CONNECTION_ERRORS as exc:
            if getattr(exc, "status_code", None):  # an error reply during the handshake (LOADING, WRONGPASS ...)
                raise
            raise NotSent(str(exc)) from exc
        try:
            await conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            replies = []
            for i in range(len(commands)):
                timeout = self._wait_read_timeout if wait and i == len(commands) - 1 else None
                try:
                    replies.append(await conn.read_response(timeout=timeout, disconnect_on_error=False))
                except rexc.ResponseError as exc:  # an error reply: the rest still follow
                    replies.append(exc)
                except rexc.ConnectionError as exc:
                    if not getattr(exc, "status_code", None):
                        raise
                    replies.append(exc)  # LOADING and maxclients come as ConnectionError subclasses
        except BaseException:
            await conn.disconnect()  # replies may still be on their way: the connection is not reused
            raise
        finally:
            await self._pool.release(conn)
        if wait:
            *replies, acknowledged = replies
            if not any(is_error(r) for r in replies):
                self._check_wait(acknowledged)
        return _unwrap_exec(replies, n) if atomic else replies

    async def close(self) -> None:
        await self._pool.disconnect()
        if self.target.kind == "sentinel":
            for s in self._sentinel.sentinels:
                with contextlib.suppress(Exception):
                    await s.aclose()


class ClusterClient(Client):
    """A Redis Cluster: the slot map read with CLUSTER SLOTS, a redis-py pool per node (`PoolClient`), each call sent
    to the node of its first key (the keys of one call share a hash tag: one slot). A MOVED or ASK reply means the
    node did not run the commands: the call goes to the node named (MOVED also updates the map), writes included. A
    connection failure marks the map stale: the next call reads it again, which is how a failover is followed.

    Why not redis.asyncio.cluster.RedisCluster: in redis-py 8.1 it fails under concurrency (16 tasks sending HMGET
    and HSET to one key: connections closed under other tasks, "'NoneType' object has no attribute 'writelines'",
    protocol errors on the server), and its transactions run each command on an event loop of their own in a
    thread (docs/decisions.md, "Redis clients")."""

    def __init__(self, target: RedisTarget, role: str = "") -> None:
        super().__init__(target, role)
        self._nodes: dict[tuple[str, int], PoolClient] = {}
        self._slots: list[tuple[str, int] | None] = [None] * 16384
        self._stale = True
        self._lock: asyncio.Lock | None = None

    def _node(self, address: tuple[str, int]) -> PoolClient:
        node = self._nodes.get(address)
        if node is None:
            node = self._nodes[address] = PoolClient(replace(self.target, kind="node", hosts=(address,)))
        return node

    async def _refresh(self) -> None:
        """The slot map from the first node (known ones, then the URL's) that answers CLUSTER SLOTS. None answering:
        NotSent (the call was not sent anywhere); only error replies: StoreUnavailable naming the first (a server
        not in cluster mode says so), never a 500."""
        self._lock = self._lock or asyncio.Lock()
        async with self._lock:
            if not self._stale:
                return
            error: BaseException | None = None
            refused: BaseException | None = None
            for address in dict.fromkeys([*(a for a in self._slots if a), *self.target.hosts]):
                try:
                    (reply,) = await self._node(address)._send([("CLUSTER", "SLOTS")], False, False)
                except _CONNECTION_ERRORS as exc:
                    if getattr(exc, "status_code", None):  # an error reply in the handshake (NOAUTH, LOADING ...)
                        refused = refused or exc
                    error = exc
                    continue
                if is_error(reply):
                    refused = refused or reply
                    continue
                slots: list[tuple[str, int] | None] = [None] * 16384
                for start, end, primary, *_ in reply:
                    host = primary[0].decode() or address[0]
                    slots[start:end + 1] = [(host, int(primary[1]))] * (end - start + 1)
                self._slots, self._stale = slots, False
                return
            if refused is not None:
                text = reply_text(refused)
                if "cluster support disabled" in text:
                    raise StoreUnavailable(
                        "NEXTSTEP_REDIS_URL is a redis+cluster:// URL, but the server is not in cluster mode (it "
                        f"answers CLUSTER SLOTS with {without_address(text)!r}): use redis://host:port for a "
                        "single server, or redis+sentinel:// for a Sentinel-watched primary")
                unavailable = refusal("reading the cluster's slot map", refused)
                raise unavailable if isinstance(unavailable, StoreUnavailable) else StoreUnavailable(
                    f"Redis Cluster: reading the slot map (CLUSTER SLOTS) was refused: {without_address(text)}")
            raise NotSent("no cluster node answered") from error

    async def _send(self, commands: Sequence[Command], atomic: bool, wait: bool) -> list:
        if self._stale:
            await self._refresh()
        first = commands[0]
        key = first[3] if first[0] in ("EVALSHA", "EVAL") and first[2] else (first[1] if len(first) > 1 else None)
        address = self._slots[key_slot(key.encode() if isinstance(key, str) else key)] if key is not None \
            else next((a for a in self._slots if a), self.target.hosts[0])
        if address is None:
            raise rexc.ClusterDownError("the slot of this key is not served by any node", status_code="CLUSTERDOWN")
        asking = False
        for _ in range(5):  # redirects
            sent = [("ASKING",), *commands] if asking and not atomic else commands
            try:
                replies = await self._node(address)._send(sent, atomic, wait)
            except _CONNECTION_ERRORS:
                self._stale = True
                raise
            if asking and not atomic:
                replies = replies[1:]
            redirect = next((r for r in replies if isinstance(r, rexc.AskError)), None)
            if redirect is None:
                return replies
            address, asking = (redirect.host, int(redirect.port)), not isinstance(redirect, rexc.MovedError)
            if not asking:
                self._slots[redirect.slot_id] = address
        return replies

    async def scan(self, cursor: str, match: str, count: int) -> tuple[str, list[bytes]]:
        """Client.scan over every primary in turn (ordered by address): the cursor is "<primary>:<its cursor>".
        Primaries added or removed during a walk may be missed or walked twice: a walk is to be repeated, not
        trusted to be exact, while the cluster is resharded."""
        if self._stale:
            await self.execute("scan", (("PING",),))  # reads the slot map, with the client's failure handling
        primaries = sorted({a for a in self._slots if a})
        node, _, inner = cursor.partition(":") if cursor != "0" else ("0", "", "0")
        try:
            at = int(node)
        except ValueError:
            raise ValueError(f"not a cluster scan cursor: {cursor!r}") from None
        if not 0 <= at < len(primaries):
            return "0", []
        following, names = await self._node(primaries[at]).scan(inner or "0", match, count)
        if following == "0":
            return ("0" if at + 1 >= len(primaries) else f"{at + 1}:0"), names
        return f"{at}:{following}", names

    async def close(self) -> None:
        for node in self._nodes.values():
            await node.close()


def connect(url: str, options: RedisOptions | None = None, role: str = "") -> Client:
    """The client for a Redis URL (module docstring). Nothing is opened until the first call. `role` names it in the
    log ("banks")."""
    target = parse_url(url, options)
    client = target.options.client
    if client == "auto":
        client = "resp" if target.kind == "node" and not target.options.wait_replicas else "redis-py"
    if target.kind == "cluster":
        return ClusterClient(target, role)
    return (RespClient if client == "resp" else PoolClient)(target, role)
