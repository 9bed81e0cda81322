"""API key -> tenant, and each tenant's salt for block hashes.

The salt keeps tenants' prefix caches apart: equal prompts of two tenants hash to different
blocks, so one tenant can never hit (or time) another's cache. Only the gateway computes
hashes, so the salt need not be secret; it must only be stable and distinct per tenant.
"""
from __future__ import annotations

import hashlib
import hmac
from typing import NamedTuple

from services.gateway.openai_errors import unauthorized

PUBLIC_TENANT = "public"  # the tenant of key-less requests in open-access mode


class Tenant(NamedTuple):
    name: str
    salt: str  # 32 hex chars; passed verbatim to block_hashes and to the engine


def tenant_salt(name: str) -> str:
    return hashlib.blake2b(name.encode("utf-8"), digest_size=16, person=b"dikv-tenant").hexdigest()


class TenantKeys:
    def __init__(self, keys: dict[str, str], open_access: bool):
        self._tenants = {key: Tenant(name, tenant_salt(name)) for key, name in keys.items()}
        self._open_access = open_access
        self._public = Tenant(PUBLIC_TENANT, tenant_salt(PUBLIC_TENANT))

    def tenant_for(self, authorization: str | None) -> Tenant:
        """The tenant named by an `Authorization: Bearer <key>` header, or a 401 OpenAIError."""
        key = bearer_token(authorization)
        if key is not None:
            tenant = self._tenants.get(key)
            if tenant is not None:
                return tenant
        if self._open_access:
            return self._public
        if key is None:
            raise unauthorized("You didn't provide an API key. Pass it in an Authorization "
                               "header: `Authorization: Bearer YOUR_KEY`.")
        raise unauthorized("Incorrect API key provided.")


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def admin_allowed(authorization: str | None, admin_token: str) -> bool:
    token = bearer_token(authorization)
    return bool(admin_token) and token is not None and hmac.compare_digest(
        token.encode(), admin_token.encode())
