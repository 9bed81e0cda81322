"""The internal plane's credential: every endpoint of an internal service (kvstore, engine) other
than /healthz, /readyz and /admin/* (admin token, see admin.py) needs
`Authorization: Bearer <service token>`, a secret shared by the deployment's services. /metrics
also opens to the admin token, so an operator's scraper needs no service credential.
"""
from __future__ import annotations

import hmac

from aiohttp import web

from .admin import ADMIN_PREFIX
from .errors import json_error

OPEN_PATHS = frozenset({"/healthz", "/readyz"})


def bearer_matches(authorization: str, token: str) -> bool:
    """Constant-time comparison of a `Bearer <token>` header with `token` (never matches an empty token)."""
    scheme, _, given = authorization.partition(" ")
    return bool(token) and scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token.encode())


def bearer_headers(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def service_auth_middleware(service_token: str, admin_token: str = ""):
    """401 without a bearer token, 403 with a wrong one; with no service token configured every
    internal endpoint is closed (403): an unauthenticated internal plane is not a mode."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        path = request.path
        if path in OPEN_PATHS or path.startswith(ADMIN_PREFIX):
            return await handler(request)
        authorization = request.headers.get("Authorization", "")
        if bearer_matches(authorization, service_token) or (
                path == "/metrics" and bearer_matches(authorization, admin_token)):
            return await handler(request)
        if not service_token:
            return json_error(403, "internal endpoints are closed: no service token configured")
        if not authorization.partition(" ")[2].strip():
            return json_error(401, "internal endpoints need 'Authorization: Bearer <service token>'", "Authorization")
        return json_error(403, "wrong service token", "Authorization")
    return middleware
