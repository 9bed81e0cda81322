"""API key -> tenant, and each tenant's salt for block hashes.

The salt keeps tenants' prefix caches apart: equal prompts of two tenants hash to different
blocks, so one tenant can never hit (or time) another's cache. The salt is HMAC(salt key, tenant)
under the deployment's secret salt key: stable (every gateway of the deployment computes the
same), distinct per tenant, and not computable outside the stack, so nobody can derive the
block hashes (index keys) of another tenant's prompt.
"""
from __future__ import annotations

import hmac
import logging
import secrets
from typing import NamedTuple

from services.gateway.openai_errors import unauthorized

log = logging.getLogger(__name__)

PUBLIC_TENANT = "public"  # the tenant of key-less requests in open-access mode
SALT_BYTES = 16


class Tenant(NamedTuple):
    name: str
    salt: str  # 32 hex chars; passed verbatim to block_hashes and to the engine


def tenant_salt(salt_key: str, name: str) -> str:
    """HMAC-SHA256(salt key, "dikv-tenant" NUL tenant), first 16 bytes as hex."""
    mac = hmac.new(salt_key.encode(), b"dikv-tenant\x00" + name.encode("utf-8"), "sha256")
    return mac.digest()[:SALT_BYTES].hex()


class TenantKeys:
    def __init__(self, keys: dict[str, str], open_access: bool, salt_key: str = ""):
        if not salt_key:
            # Still secret, but per process: cached prefixes do not survive a gateway restart and are
            # not shared with other gateways. `deepinfer up` and compose always give one.
            log.warning("no salt key configured: using a random one for this process")
            salt_key = secrets.token_hex(32)
        self._tenants = {key: Tenant(name, tenant_salt(salt_key, name)) for key, name in keys.items()}
        self._open_access = open_access
        self._public = Tenant(PUBLIC_TENANT, tenant_salt(salt_key, PUBLIC_TENANT))

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
