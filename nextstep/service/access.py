"""Who may call what: API keys and roles, and the loopback rule (docs/decisions.md, "Access").

    Access(settings).check(scope, key, admin) -> None, or the problem to answer (401, 403)
    admin_route(method, path)                 -> whether a request needs the admin role
"""

import hmac

from .errors import problem
from .server import is_loopback
from .settings import Settings

ADMIN_METHODS = {"PUT", "PATCH", "DELETE"}  # bank swaps, deletes of learners, sessions and users


def admin_route(method: str, path: str) -> bool:
    """Whether a request needs the admin role: every PUT, PATCH and DELETE, and POSTs under /v1/models/ (reload)."""
    return method in ADMIN_METHODS or (method == "POST" and path.startswith("/v1/models/"))


def _matches(given: bytes, keys: list[bytes]) -> bool:
    """Whether `given` is one of `keys`, comparing with every key in constant time (no early exit)."""
    found = False
    for key in keys:
        found |= hmac.compare_digest(given, key)
    return found


class Access:
    """Who may call what: API keys and roles, and the loopback rule (docs/decisions.md, "Access"). `check` decides
    a request; `is_admin` whether a request would pass an admin route's check, which is who sees the service's
    details (artifact paths, ONNX Runtime's and Redis's messages) where the others see the kind of fault."""

    def __init__(self, settings: Settings):
        self.keys = [k.encode() for k in settings.api_keys]
        self.admin_keys = [k.encode() for k in settings.admin_keys]
        self.on = bool(self.keys or self.admin_keys)

    def check(self, scope, given: bytes | None, admin: bool):
        """None if the request may go on, else the problem to answer. With keys set, a request needs one (401); an
        admin route needs an admin key (403), or, while no admin key is set, a loopback client. With no keys at
        all, everything but the admin routes is open, and those are served to loopback clients only (403)."""
        route = f"{scope['method']} {scope['path'][:120]}"  # (a path may be long: not echoed whole)
        if self.on:
            if not given:  # (no key is empty: settings.py refuses one, and an empty header is no key)
                return problem(401, f"{'missing' if given is None else 'empty'} X-API-Key header", "X-API-Key",
                               "unauthorized")
            is_admin = _matches(given, self.admin_keys)
            if not is_admin and not _matches(given, self.keys):
                return problem(401, "invalid X-API-Key", "X-API-Key", "unauthorized")
            if not admin or is_admin:
                return None
            if self.admin_keys:
                return problem(403, f"{route} needs an admin key (NEXTSTEP_ADMIN_KEYS); "
                                    "this key has no admin role", "X-API-Key", "forbidden")
        client = scope.get("client")
        if is_loopback(client[0] if client else None):
            return None
        return problem(403, f"{route} is an admin route: with NEXTSTEP_ADMIN_KEYS unset it "
                            "is served to loopback clients only; set NEXTSTEP_ADMIN_KEYS and send one as X-API-Key",
                       "NEXTSTEP_ADMIN_KEYS", "forbidden")

    def is_admin(self, scope) -> bool:
        return self.check(scope, dict(scope["headers"]).get(b"x-api-key"), admin=True) is None  # (as __call__ reads it)
