"""`Client` and `AsyncClient`: the routes (routes.py) over an httpx client, with one retry rule for both.

An attempt that fails in a way a retry may mend is tried again, after a backoff with full jitter (a random wait up to
`backoff` x 2^attempt, at most `max_backoff`; at least the service's Retry-After, within `max_backoff`), until
`Retry.attempts` were made:

- the connection could not be made, or no connection was free (the request was not sent): every call;
- the service's 503 `store-unavailable` (the store refused it, nothing changed) or any other 503 (not ready): every
  call;
- the request was sent and its answer lost (a connection dropped, a read timeout), the service's 503
  `outcome-unknown` (its store stopped answering a write), a 502 or 504 from a proxy: the calls whose repetition is
  safe (all but a promote: reads, stateless scoring, PUT and DELETE, and the writes of events, each with its id);
- the service's 409 `conflict` (other writers kept winning the compare-and-set): every call.

Any other error answer raises its ProblemError at once. Spent attempts raise Unavailable, or OutcomeUnknown where a
write may have been applied (errors.py)."""

import asyncio
import contextlib
import logging
import random
import time
from dataclasses import dataclass

import httpx

from .errors import PROBLEM, OutcomeUnknown, Unavailable, refusal
from .routes import Call, KnowledgeTracing, Models, Sessions, SpacedRepetition, System, segment

log = logging.getLogger("nextstep.client")  # each retry, at INFO: the call, the failure, the wait

# failures of a request that was not sent: repeating it is always safe
UNSENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


@dataclass(frozen=True)
class Retry:
    """The retry budget of every call: `attempts` in all (1: no retry), waits from `backoff` seconds doubling to
    `max_backoff`."""

    attempts: int = 6
    backoff: float = 0.05
    max_backoff: float = 2.0

    def __post_init__(self):
        if self.attempts < 1 or self.backoff < 0 or self.max_backoff < 0:
            raise ValueError("Retry: attempts >= 1, backoff and max_backoff >= 0")


class Attempts:
    """One call's attempts: what each outcome means, and when the budget is spent."""

    def __init__(self, retry: Retry, call: Call):
        self.retry, self.call = retry, call
        self.made, self.maybe_applied = 0, False

    def answered(self, reply: httpx.Response):
        """The parsed answer of a successful reply; else the wait before the next attempt (or the error raised)."""
        self.made += 1
        if reply.status_code < 300:
            return True, self.call.answer.model_validate_json(reply.content)
        try:
            problem = reply.json()
            if not isinstance(problem, dict):
                raise ValueError
        except ValueError:
            problem = {"title": reply.reason_phrase, "detail": reply.text[:500]}
        error = refusal(reply.status_code, problem)
        kind = str(problem.get("type", "")).removeprefix(PROBLEM)
        reason = f"{reply.status_code} {kind or problem.get('title', '')}"
        if reply.status_code == 503 and kind != "outcome-unknown" or reply.status_code == 409 and kind == "conflict":
            return False, self._wait(error, reason, applied=False, after=reply.headers.get("retry-after"))
        if reply.status_code in (502, 503, 504):  # (outcome-unknown, or a proxy's: the write may have happened)
            return False, self._wait(error, reason, applied=True, after=reply.headers.get("retry-after"))
        raise error

    def failed(self, exc: httpx.TransportError) -> float:
        """The wait before the next attempt after a request that got no answer (or the error raised)."""
        self.made += 1
        if isinstance(exc, httpx.UnsupportedProtocol | httpx.LocalProtocolError | httpx.ProxyError):
            raise exc  # (a mistake in the call or the URL: no attempt will mend it)
        sent = not isinstance(exc, UNSENT)
        return self._wait(exc, f"{'answer lost' if sent else 'not sent'}: {exc!r}", applied=sent)

    def _wait(self, error: Exception, reason: str, applied: bool, after: str | None = None) -> float:
        if applied and self.call.repeat != "always":
            self.maybe_applied = True
            raise self._spent(error)
        self.maybe_applied |= applied
        if self.made >= self.retry.attempts:
            raise self._spent(error)
        cap = min(self.retry.max_backoff, self.retry.backoff * 2 ** (self.made - 1))
        wait = random.uniform(0, cap)
        if after:
            with contextlib.suppress(ValueError):
                wait = max(wait, min(float(after), self.retry.max_backoff))
        log.info("%s %s: attempt %d failed (%s); again in %.2f s", self.call.method, self.call.path, self.made, reason,
                 wait)
        return wait

    def _spent(self, error: Exception) -> Unavailable:
        what = f"{self.call.method} {self.call.path}: {self.made} attempt(s) failed, the last with {error!r}"
        if self.maybe_applied:
            return OutcomeUnknown(f"{what}; it may have been applied: sending the same call again is safe where "
                                  "it is an events write", attempts=self.made, last=error)
        return Unavailable(f"{what}; nothing was applied", attempts=self.made, last=error)


class _Base:
    HTTP: type  # httpx.Client or httpx.AsyncClient

    def __init__(self, url: str, *, api_key: str | None = None, versions: dict[str, str] | None = None,
                 timeout: float | httpx.Timeout = 10.0, limits: httpx.Limits | None = None, retry: Retry | None = None,
                 headers: dict | None = None, **httpx_options):
        self.retry = retry or Retry()
        self.versions = dict(versions or {})
        headers = {"user-agent": "nextstep-client", **(headers or {}), **({"x-api-key": api_key} if api_key else {})}
        self.http = self.HTTP(base_url=url, timeout=timeout, limits=limits or httpx.Limits(), headers=headers,
                              **httpx_options)
        self.kt = KnowledgeTracing(self.send, self._model_path)
        self.sessions = Sessions(self.send, self._model_path)
        self.srs = SpacedRepetition(self.send, self._model_path)
        self.models = Models(self.send, self._model_path)
        self.system = System(self.send, self._model_path)

    def _model_path(self, model: str) -> str:
        """A model's path segment: pinned to the version `versions` names for it, unless the name pins one."""
        if "@" not in model and model in self.versions:
            model = f"{model}@{self.versions[model]}"
        return segment(model)

    def send(self, call: Call):
        raise NotImplementedError


class Client(_Base):
    """A synchronous client of a NextStep service.

        with Client("http://localhost:8000", api_key="...") as client:
            answer = client.kt.events("deep_gpcm", "student-42", [{"question_id": "17", "response": 2}],
                                      predict_question_ids=["18"])
            answer.predictions[0].probabilities

    `api_key`: the X-API-Key header. `versions`: {model: version} pins (`"deep_gpcm@2"` as a model name pins one
    call). `timeout`: seconds, or an httpx.Timeout. `limits`: the connection pool (httpx.Limits). `retry`: the
    budget of every call (Retry). Further keywords go to httpx.Client (a transport, a proxy, TLS settings)."""

    HTTP = httpx.Client

    def send(self, call: Call):
        attempts = Attempts(self.retry, call)
        while True:
            try:
                reply = self.http.request(call.method, call.path, json=call.body, params=call.params)
            except httpx.TransportError as exc:
                wait = attempts.failed(exc)
            else:
                done, result = attempts.answered(reply)
                if done:
                    return result
                wait = result
            time.sleep(wait)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *_) -> None:
        self.close()


class AsyncClient(_Base):
    """The asynchronous twin of Client: the same arguments and methods, each answering an awaitable.

        async with AsyncClient("http://localhost:8000") as client:
            answer = await client.sessions.events("gru4rec", "visit-7", [{"item_id": "214536502"}], recommend_k=5)
    """

    HTTP = httpx.AsyncClient

    async def send(self, call: Call):
        attempts = Attempts(self.retry, call)
        while True:
            try:
                reply = await self.http.request(call.method, call.path, json=call.body, params=call.params)
            except httpx.TransportError as exc:
                wait = attempts.failed(exc)
            else:
                done, result = attempts.answered(reply)
                if done:
                    return result
                wait = result
            await asyncio.sleep(wait)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *_) -> None:
        await self.aclose()
