"""What a call of the client can fail with.

    NextStepError            the base of them all
    ProblemError             the service refused the request (a 4xx, or a 5xx not worth retrying): its problem
      NotFound               404: no loaded model of that name for the task
      InvalidRequest         413, 415, 422: `field` names the offending part of the request
      Unauthorized           401 or 403: no API key, a wrong one, or one without the admin role
    Unavailable              the retries are spent: the service or its store kept failing; nothing was applied
      OutcomeUnknown         the same, but a write was sent and its answer lost at least once: it may have been applied
                             (sending the same call again is safe: the client keeps its event ids)
"""

PROBLEM = "urn:nextstep:problem:"


class NextStepError(Exception):
    """Any error of a NextStep client call."""


class ProblemError(NextStepError):
    """The service answered with an error (an RFC 9457 problem document): `status`, `type`, `detail`, `field` (the
    offending request field, where one is), and the whole `problem`."""

    def __init__(self, status: int, problem: dict):
        self.status, self.problem = status, problem
        self.type = problem.get("type", "about:blank")
        self.detail = problem.get("detail") or problem.get("title") or f"HTTP {status}"
        self.field = problem.get("field")
        super().__init__(f"{status}: {self.detail}")


class NotFound(ProblemError):
    pass


class InvalidRequest(ProblemError):
    pass


class Unauthorized(ProblemError):
    pass


class Unavailable(NextStepError):
    """The call failed every attempt its retry budget allowed. `may_have_applied` is False: no attempt of it can
    have changed anything (each failed before the request was sent, or the store refused it untouched); `last` is
    the last attempt's failure (an httpx error or a ProblemError), `attempts` how many were made."""

    may_have_applied = False

    def __init__(self, message: str, *, attempts: int, last: Exception | None):
        self.attempts, self.last = attempts, last
        super().__init__(message)


class OutcomeUnknown(Unavailable):
    """As Unavailable, but at least one attempt sent a write whose answer never came (a dropped connection, a
    timeout, or the service's own `outcome-unknown`): it may have been applied. Events carry the ids the client gave
    them, so the same call sent again applies each at most once."""

    may_have_applied = True


BY_STATUS = {401: Unauthorized, 403: Unauthorized, 404: NotFound, 413: InvalidRequest, 415: InvalidRequest,
             422: InvalidRequest}


def refusal(status: int, problem: dict) -> ProblemError:
    """The error of a refused request, by its status."""
    return BY_STATUS.get(status, ProblemError)(status, problem)
