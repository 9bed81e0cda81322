"""The kvstore service: segment writes, verified layer reads and deletes over HTTP."""
from __future__ import annotations

import asyncio
import logging
import uuid

import msgpack
from aiohttp import web
from prometheus_client import CollectorRegistry
from redis.exceptions import RedisError

from kvstore import BlockStore, PrefixIndex, SegmentWriteError, open_redis
from kvstore.kv_events import EventPublisher
from kvstore.location import SEGMENT_ID
from kvstore.reconcile import Reconciler
from kvstore.quota import GiB, parse_quotas
from kvstore.segment import SegmentMissing
from kvstore.store import TenantPurged
from services.common import (RequestError, add_health_routes, add_metrics_route, admin_auth_middleware,
                             error_middleware, service_auth_middleware)
from services.common.instance import add_instance_header
from services.common.request_id import add_request_ids

from . import wire
from .admin_routes import add_admin_routes
from .config import KvstoreConfig
from .metrics import StoreCollector
from .openapi_document import kvstore_openapi_document

log = logging.getLogger(__name__)

SAVE_FIELDS = {"hashes", "start_block", "tenant", "retention", "ttl_s", "layers", "epoch"}

STORE = web.AppKey("store", BlockStore)
RECONCILER = web.AppKey("reconciler", Reconciler)
CONFIG = web.AppKey("config", KvstoreConfig)
REGISTRY = web.AppKey("registry", CollectorRegistry)
COLLECTOR = web.AppKey("collector", StoreCollector)


@web.middleware
async def index_down_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Redis unreachable is the service's dependency failing, not the client's fault: 503."""
    try:
        return await handler(request)
    except RedisError as e:
        log.warning("%s %s: prefix index unreachable: %s", request.method, request.path, e)
        raise RequestError(503, "the prefix index (Redis) is unreachable") from None


def create_app(config: KvstoreConfig) -> web.Application:
    app = web.Application(client_max_size=config.max_body_mib << 20,
                          middlewares=[error_middleware, admin_auth_middleware(config.admin_token),
                                       service_auth_middleware(config.service_token, config.admin_token),
                                       index_down_middleware])
    app[CONFIG] = config
    add_request_ids(app)
    add_instance_header(app)
    app.cleanup_ctx.append(_store_lifecycle)
    app.router.add_post("/v1/segments", save_segments)
    app.router.add_delete("/v1/segments/{segment}", delete_segment)
    app.router.add_post("/v1/read", read_layer)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_get("/openapi.json", openapi)

    async def readiness() -> dict[str, bool]:
        store = app[STORE]
        checks = {"redis": await store.index.ping()}
        for vid, volume in store.volumes.items():
            checks[f"volume:{vid}"] = await volume.reachable()
        return checks

    add_health_routes(app, readiness)
    app[REGISTRY] = CollectorRegistry()

    async def refresh() -> None:
        await app[COLLECTOR].refresh()

    add_metrics_route(app, app[REGISTRY], before=refresh)
    add_admin_routes(app, STORE, RECONCILER)
    return app


async def _store_lifecycle(app: web.Application):
    config = app[CONFIG]
    redis = open_redis(config.redis_url, cluster=config.redis_cluster, password=config.redis_password)
    events = None
    if config.kv_events:  # the disk medium's events: this service's own saves, evictions, sweeps and purges
        events = EventPublisher(redis, config.index_prefix, f"kvstore-{uuid.uuid4().hex}", config.block_tokens,
                                config.kv_events_max_len)
        events.start()
    index = PrefixIndex(redis, config.index_prefix, events)
    store = await BlockStore.open(
        config.volumes, config.geometry, config.cache_fingerprint, index, mac_key=config.mac_key,
        threads=config.io_threads,
        read_mode=config.read_mode,
        budget_bytes=config.budget_bytes, max_segment_blocks=config.max_segment_blocks,
        read_ahead=config.read_ahead, reader_grace_s=config.reader_grace_s)
    if config.sweep_interval_s > 0:
        store.capacity.start(config.sweep_interval_s)
    # Serving starts at once; until reconciliation republishes a segment, its prefixes are misses.
    reconciler = Reconciler(store, min_age_s=config.reconcile_min_age_s)
    reconciler.start(config.reconcile_interval_s)
    quotas = asyncio.create_task(_publish_quotas(store, config))
    app[STORE] = store
    app[RECONCILER] = reconciler
    app[COLLECTOR] = StoreCollector(store, reconciler, events)
    app[REGISTRY].register(app[COLLECTOR])
    log.info("kvstore serving %s (%s latents) on %d volumes", store.fingerprint, config.latent_format,
             len(store.volumes))
    yield
    quotas.cancel()
    await reconciler.stop()
    await store.close()
    if events is not None:
        await events.close()
    await redis.aclose()


async def _publish_quotas(store: BlockStore, config: KvstoreConfig, retry_s: float = 5.0) -> None:
    """The configured tenant quotas, to the index, where every writer reads them (kvstore/quota.py)."""
    quotas = {tenant: int(gib * GiB) for tenant, gib in parse_quotas(config.tenant_quotas).items()}
    while True:
        try:
            return await store.quotas.publish(int(config.tenant_quota_gib * GiB), quotas)
        except RedisError as e:
            log.warning("could not publish the tenant quotas (retrying in %.0f s): %s", retry_s, e)
            await asyncio.sleep(retry_s)


async def _message(request: web.Request) -> dict:
    return wire.unpack(await request.read())


async def save_segments(request: web.Request) -> web.Response:
    store = request.app[STORE]
    message = await _message(request)
    wire.check_model(message, store.fingerprint, store.geometry)
    save = wire.parse_save(message, store.geometry)
    try:
        result = await store.save(save.hashes, save.layers, start_block=save.start_block, tenant=save.tenant,
                                  retention=save.retention, ttl_s=save.ttl_s, epoch=save.epoch)
    except ValueError as e:  # the store names the argument first, e.g. "ttl_s must be ..."
        named = str(e).split(" ", 1)[0]
        field = named if named.split("[", 1)[0] in SAVE_FIELDS else None
        raise RequestError(400, str(e), field) from None
    except TenantPurged as e:  # the request began before its tenant's purge: nothing stays
        raise RequestError(409, str(e), "epoch") from None
    except SegmentWriteError as e:
        log.error("save failed: %s", e)
        raise RequestError(503, f"could not store the segment: {e}") from None
    log.info("saved %d blocks (%d bytes) of tenant %r in %d segments", result.blocks, result.bytes, save.tenant,
             len(result.segments))
    return web.json_response({"blocks": result.blocks, "segments": list(result.segments), "bytes": result.bytes})


async def read_layer(request: web.Request) -> web.Response:
    store = request.app[STORE]
    message = await _message(request)
    wire.check_model(message, store.fingerprint, store.geometry)
    read = wire.parse_read(message, store.geometry)
    for i, run in enumerate(read.hit.runs):
        if run.volume not in store.volumes:
            raise RequestError(404, f"unknown volume {run.volume}", f"runs[{i}]")
    try:
        await store.header(read.hit.runs[0].volume, read.hit.runs[0].segment)
    except SegmentMissing:
        raise RequestError(404, f"unknown segment {read.hit.runs[0].segment}", "runs[0]") from None
    except Exception:  # corrupt header: read_layer below counts it and serves a miss
        pass
    if read.layer == 0:  # one line per hit, not one per layer
        log.info("reading a hit of %d blocks", read.hit.blocks)
        store.touch(read.hit)
    context, _ = await store.begin_read(read.hit)
    try:
        result = await store.read_layer(read.hit, read.layer, context)
    finally:
        store.end_read(read.hit)
    return web.Response(body=result.latents.reshape(-1).view("uint8").data, content_type="application/octet-stream",
                        headers={wire.VALID_BLOCKS_HEADER: str(result.valid_blocks)})


async def lookup(request: web.Request) -> web.Response:
    store = request.app[STORE]
    message = await _message(request)
    hit = await store.index.lookup(wire.parse_hashes(message))
    return web.Response(body=msgpack.packb(wire.encode_hit(hit)), content_type=wire.MSGPACK)


async def openapi(_: web.Request) -> web.Response:
    return web.json_response(kvstore_openapi_document())


async def delete_segment(request: web.Request) -> web.Response:
    store = request.app[STORE]
    segment = request.match_info["segment"]
    if not SEGMENT_ID.match(segment):
        raise RequestError(400, "segment id must be 32 lowercase hex digits", "segment")
    for vid in store.volumes:
        record = await store.ledger.record(vid, segment)
        if record is not None:
            await store.capacity.retire(vid, record)
            return web.json_response({"deleted": segment, "volume": vid})
    raise RequestError(404, f"unknown segment {segment}", "segment")
