"""DELETE /admin/tenants/{tenant}/cache: erase one tenant's cached prefixes everywhere (admin token).

Three steps, each safe to repeat:
1. the index fences the tenant (its epoch + 1) and records a tombstone, in one step (kvstore/fence.py):
   from here a save of a request that began before publishes nothing that stays;
2. every engine drops the tenant's pages from its memory tier and fences its sequences in flight;
3. the kvstore erases the tenant's blocks from the index, the ledger and the volumes (unlinked), then
   drops the tombstone.
If step 3 does not finish (the kvstore is down, or this gateway dies), the kvstore's reconciliation
finishes it from the tombstone (at its start, hourly, on POST /admin/reconcile); an engine that missed
step 2 fences itself at the tenant's next request, whose epoch is newer than the engine's.
"""
from __future__ import annotations

import asyncio
import logging
from urllib.parse import quote

import aiohttp
from aiohttp import web

from services.common.service_auth import bearer_headers
from services.gateway.completions_endpoint import STATE
from services.gateway.openai_errors import OpenAIError
from services.gateway.tenants import admin_allowed

log = logging.getLogger(__name__)

ENGINE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)
KVSTORE_TIMEOUT = aiohttp.ClientTimeout(total=600.0)  # it reads every segment header on every volume


async def _post(session: aiohttp.ClientSession, url: str, token: str, body: dict,
                timeout: aiohttp.ClientTimeout) -> dict:
    async with session.post(url, json=body, headers=bearer_headers(token), timeout=timeout) as response:
        answer = await response.json(content_type=None)
        if response.status != 200:
            raise RuntimeError(f"{url} answered {response.status}: {answer}")
        return answer


async def purge_tenant_cache(request: web.Request) -> web.Response:
    state = request.app[STATE]
    config = state.config
    if not admin_allowed(request.headers.get("Authorization"), config.admin_token):
        raise OpenAIError("A valid admin token is required.", code="invalid_admin_token", status=401)
    tenant = request.match_info["tenant"]
    fence = state.lookup.fence
    if fence is None:
        raise OpenAIError("No prefix index is configured (--redis-url): there is no cache to purge.",
                          code="no_prefix_index", status=503)
    try:
        epoch = await fence.begin_purge(tenant)
    except Exception as error:  # Redis down: nothing was fenced, nothing erased
        log.warning("purge of tenant %r: the prefix index is unreachable: %r", tenant, error)
        raise OpenAIError("The prefix index is unreachable; nothing was purged. Try again.",
                          code="prefix_index_unavailable", status=503) from None
    path = f"/admin/tenants/{quote(tenant, safe='')}/purge"
    engines = [engine.client.url for engine in state.pool.engines]
    answers = await asyncio.gather(*(_post(state.session, url + path, config.admin_token, {"epoch": epoch},
                                           ENGINE_TIMEOUT) for url in engines), return_exceptions=True)
    missed = [url for url, answer in zip(engines, answers) if isinstance(answer, BaseException)]
    for url in missed:
        log.warning("purge of tenant %r: engine %s missed it (it fences itself at the tenant's next request)",
                    tenant, url)
    try:
        if not config.kvstore_url:
            raise RuntimeError("no --kvstore-url")
        erased = await _post(state.session, config.kvstore_url.rstrip("/") + path, config.admin_token,
                             {"epoch": epoch}, KVSTORE_TIMEOUT)
    except Exception as error:  # the tombstone stays: the kvstore's reconciliation finishes the erasure
        log.warning("purge of tenant %r (epoch %d): the kvstore did not erase it now: %r", tenant, epoch, error)
        raise OpenAIError(f"Tenant {tenant!r} is fenced (epoch {epoch}) and its memory tiers are dropped, but "
                          "the kvstore could not erase its blocks now; its reconciliation finishes the purge.",
                          code="purge_pending", status=503) from None
    memory = sum(answer["pages"] for answer in answers if not isinstance(answer, BaseException))
    log.info("purged tenant %r (epoch %d): %d blocks on disk, %d pages in memory", tenant, epoch,
             erased["blocks"], memory)
    return web.json_response({"tenant": tenant, "epoch": epoch, "blocks": erased["blocks"],
                              "segments": erased["segments"], "memory_blocks": memory, "engines_missed": missed})


def add_tenant_purge_route(app: web.Application) -> None:
    app.router.add_delete("/admin/tenants/{tenant}/cache", purge_tenant_cache)
