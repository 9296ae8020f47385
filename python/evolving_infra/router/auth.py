"""API keys of the router's HTTP front end: one for the data path, a separate one for operators.

- The **data key** guards `/v1/*`: completions, models and the branch API. Clients send it as
  OpenAI's clients do, `Authorization: Bearer KEY` (or `X-API-Key: KEY`, for harnesses that set
  no bearer token).
- The **admin key** guards what operators use and agents never need: `/metrics` (which names
  engines, branches and load). Without an admin key, `/metrics` takes the data key when there
  is one (a key means the operator did not want the router open: `/metrics` must not be the
  one door left open), unless `metrics_public` (`--metrics-public`) says scrapers come without
  one; with no key at all it is open, as Prometheus scrapers expect on a private network.
- `/health` is always open: load balancers probe it without credentials, and it tells nothing an
  attacker can use (ready or not, engine counts).

Keys come from flags, the TOML config, or (kept out of `ps` listings) the environment variables
`EVOLVING_INFRA_API_KEY` and `EVOLVING_INFRA_ADMIN_API_KEY`. Comparison is constant-time. A
failed check is a 401 in OpenAI's error shape (`invalid_api_key`), and is counted and logged
like every error, without the key.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from aiohttp import web

from evolving_infra.router.api import ApiError

API_KEY_ENV = "EVOLVING_INFRA_API_KEY"
ADMIN_API_KEY_ENV = "EVOLVING_INFRA_ADMIN_API_KEY"
INVALID_API_KEY = "invalid_api_key"

_DATA_PREFIX = "/v1/"
_ADMIN_PATHS = frozenset({"/metrics"})


@dataclass(frozen=True, slots=True)
class ApiKeys:
    """The keys in force; `None`: that part is open."""

    data: str | None = None
    admin: str | None = None
    metrics_public: bool = False  # /metrics open although a data key is set (no admin key)

    @property
    def enabled(self) -> bool:
        return self.data is not None or self.admin is not None

    def required(self, path: str) -> tuple[str, str] | None:
        """(key, what it guards) for a request path, or None when the path is open."""
        if path.startswith(_DATA_PREFIX) and self.data is not None:
            return self.data, "the API"
        if path in _ADMIN_PATHS:
            if self.admin is not None:
                return self.admin, "admin endpoints"
            if self.data is not None and not self.metrics_public:
                return self.data, "admin endpoints (no admin key: the API key)"
        return None

    def check(self, request: web.Request) -> None:
        """Raises a 401 `ApiError` unless `request` carries the key its path needs."""
        need = self.required(request.path)
        if need is None:
            return
        key, scope = need
        given = presented_key(request)
        if given is None:
            raise ApiError(
                401,
                f"{scope} needs an API key: send 'Authorization: Bearer KEY'",
                code=INVALID_API_KEY,
                error_type="authentication_error",
            )
        # Compare as bytes: compare_digest refuses non-ASCII str, and a header may hold any.
        if not hmac.compare_digest(given.encode(), key.encode()):
            raise ApiError(
                401, "incorrect API key", code=INVALID_API_KEY, error_type="authentication_error"
            )


def presented_key(request: web.Request) -> str | None:
    """The key a request carries: a bearer token, else `X-API-Key`; None when it has neither."""
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("X-API-Key") or None
