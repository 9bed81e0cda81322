"""Admin endpoints: everything under /admin/ needs `Authorization: Bearer <admin token>`."""
from __future__ import annotations

import hmac

from aiohttp import web

from .errors import json_error

ADMIN_PREFIX = "/admin/"


def admin_auth_middleware(token: str):
    """401 without a bearer token, 403 with a wrong one; with no token configured, admin is off (403)."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if not request.path.startswith(ADMIN_PREFIX):
            return await handler(request)
        if not token:
            return json_error(403, "admin endpoints are disabled: no admin token configured")
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not given:
            return json_error(401, "admin endpoints need 'Authorization: Bearer <admin token>'", "Authorization")
        if not hmac.compare_digest(given.strip().encode(), token.encode()):
            return json_error(403, "wrong admin token", "Authorization")
        return await handler(request)
    return middleware
