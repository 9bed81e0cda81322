"""/admin/* of the kvstore service (bearer token checked by the admin middleware)."""
from __future__ import annotations

import dataclasses

from aiohttp import web

from kvstore import BlockStore
from kvstore.purge import erase_tenant
from kvstore.reconcile import Reconciler
from services.common import RequestError


def add_admin_routes(app: web.Application, store_key: web.AppKey, reconciler_key: web.AppKey) -> None:
    def store_of(request: web.Request) -> BlockStore:
        return request.app[store_key]

    async def reconcile(request: web.Request) -> web.Response:
        """POST: one reconciliation pass now (after any running one); its report."""
        return web.json_response((await request.app[reconciler_key].run()).as_dict())

    async def reconciliation(request: web.Request) -> web.Response:
        """GET: whether a pass runs, how many completed, the last one's report."""
        reconciler: Reconciler = request.app[reconciler_key]
        last = reconciler.last.as_dict() if reconciler.last is not None else None
        return web.json_response({"running": reconciler.running, "passes": reconciler.passes, "last": last})

    async def stats(request: web.Request) -> web.Response:
        store = store_of(request)
        body = dataclasses.asdict(store.stats)
        body["volume_used_bytes"] = await store.ledger.used(list(store.volumes))
        body["reading_segments"] = len(store.readers)
        return web.json_response(body)

    async def volumes(request: web.Request) -> web.Response:
        store = store_of(request)
        used = await store.ledger.used(list(store.volumes))
        rows = []
        for vid, volume in store.volumes.items():
            rows.append({"id": vid, "name": volume.name, "spec": volume.spec, "used_bytes": used[vid],
                         "budget_bytes": store.capacity.budget_of(vid),
                         "segments": len(await store.ledger.records(vid)),
                         "reachable": await volume.reachable()})
        return web.json_response({"volumes": rows})

    async def sweep(request: web.Request) -> web.Response:
        return web.json_response((await store_of(request).capacity.sweep())._asdict())

    async def evict(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            raise RequestError(400, "body must be JSON: {\"tenant\": ...} or {\"all\": true}", "body") from None
        if not isinstance(body, dict):
            raise RequestError(400, "body must be a JSON object", "body")
        tenant = body.get("tenant")
        if body.get("all") is True and tenant is None:
            count = await store_of(request).capacity.evict()
        elif isinstance(tenant, str) and not body.get("all"):
            count = await store_of(request).capacity.evict(tenant=tenant)
        else:
            raise RequestError(400, "give exactly one of \"tenant\" (a string) or \"all\": true", "tenant")
        return web.json_response({"evicted": count})

    async def purge(request: web.Request) -> web.Response:
        """POST {"epoch"}: erase the tenant's blocks older than the epoch its purge fenced (the gateway's
        DELETE /admin/tenants/{tenant}/cache fences first); drops the purge's tombstone."""
        try:
            body = await request.json()
        except ValueError:
            raise RequestError(400, "body must be JSON: {\"epoch\": N}", "body") from None
        epoch = body.get("epoch") if isinstance(body, dict) else None
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 1:
            raise RequestError(400, "\"epoch\" must be the purge's epoch, an integer >= 1", "epoch")
        tenant = request.match_info["tenant"]
        result = await erase_tenant(store_of(request), tenant, epoch)
        return web.json_response({"tenant": tenant, "epoch": epoch, **result._asdict()})

    app.router.add_get("/admin/stats", stats)
    app.router.add_get("/admin/volumes", volumes)
    app.router.add_post("/admin/sweep", sweep)
    app.router.add_post("/admin/evict", evict)
    app.router.add_post("/admin/reconcile", reconcile)
    app.router.add_post("/admin/tenants/{tenant}/purge", purge)
    app.router.add_get("/admin/reconcile", reconciliation)
