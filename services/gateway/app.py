"""The gateway's aiohttp application: routes, OpenAI-format errors, health and admin."""
from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from services.common.instance import add_instance_header
from services.common.request_id import add_request_ids
from services.gateway.completions_endpoint import (ARRIVED, STATE, chat_completions, completions,
                                                   served_models)
from services.gateway.config import GatewayConfig
from services.gateway.dashboard_routes import add_dashboard_routes
from services.gateway.gateway_state import GatewayState
from services.gateway.openai_errors import OpenAIError, model_not_found
from services.gateway.openai_responses import model_card, models_list
from services.gateway.openapi_document import openapi_document
from services.gateway.tenant_purge import add_tenant_purge_route
from services.gateway.tenants import admin_allowed

log = logging.getLogger(__name__)

# Probes and scrapes come every few seconds; a line each would bury the requests.
_QUIET_ENDPOINTS = frozenset({"/healthz", "/readyz", "/metrics", "/admin/dashboard.json"})
SCRAPE_PING_S = 0.5
_HTTP_ERROR_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}


@web.middleware
async def openai_error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """Every error leaves as {"error": {...}}; every answer is counted by route and status."""
    request[ARRIVED] = time.monotonic()
    try:
        response = await handler(request)
    except OpenAIError as error:
        response = error.response()
    except web.HTTPException as error:
        if error.status < 400:
            raise
        response = OpenAIError(error.text or error.reason, code=_HTTP_ERROR_CODES.get(error.status),
                               status=error.status).response()
        if "Allow" in error.headers:  # a 405 must say which methods are allowed (RFC 9110)
            response.headers["Allow"] = error.headers["Allow"]
    except Exception:  # a bug or an unexpected failure: logged with context, never a stack trace
        log.exception("unhandled error on %s %s", request.method, request.path)
        response = OpenAIError("The server had an error while processing your request.",
                               code="internal_error", status=500,
                               error_type="server_error").response()
    resource = request.match_info.route.resource
    endpoint = resource.canonical if resource is not None else "unmatched"
    request.app[STATE].metrics.requests.labels(endpoint, str(response.status)).inc()
    if endpoint not in _QUIET_ENDPOINTS:
        log.info("%s %s -> %d in %.3f s", request.method, request.path, response.status,
                 time.monotonic() - request[ARRIVED])
    return response


async def models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.tenants.tenant_for(request.headers.get("Authorization"))
    return web.json_response(models_list(served_models(state), state.started_at))


async def model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.tenants.tenant_for(request.headers.get("Authorization"))
    model_id = request.match_info["model"]
    if model_id not in served_models(state):
        raise model_not_found(model_id)
    return web.json_response(model_card(model_id, state.started_at))


async def healthz(_request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


async def readyz(request: web.Request) -> web.Response:
    """Ready when an engine can take requests; the prefix index is reported but not required."""
    state = request.app[STATE]
    ready_engines = len(state.pool.ranked())
    body = {"ready": ready_engines > 0, "engines_ready": ready_engines,
            "engines_configured": len(state.pool.engines),
            "prefix_index": await state.lookup.ready()}
    return web.json_response(body, status=200 if ready_engines else 503)


async def openapi(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(openapi_document(state.tokenizer.vocab_size, served_models(state)))


def _require_admin(request: web.Request) -> None:
    if not admin_allowed(request.headers.get("Authorization"), request.app[STATE].config.admin_token):
        raise OpenAIError("A valid admin token is required.", code="invalid_admin_token",
                          status=401)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus text. With API keys the public port shows it only to the admin token: counters
    such as prefix-lookup hit tokens would otherwise tell one tenant about another's traffic."""
    state = request.app[STATE]
    if not state.config.open_access:
        _require_admin(request)
    try:  # Redis health as a gauge, for Prometheus and Grafana; a hung Redis reads as down
        up = await asyncio.wait_for(state.lookup.ready(), SCRAPE_PING_S)
    except asyncio.TimeoutError:
        up = False
    state.metrics.prefix_index_up.set(1 if up else 0)
    return web.Response(body=generate_latest(state.metrics.registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


async def admin_stats(request: web.Request) -> web.Response:
    state = request.app[STATE]
    _require_admin(request)
    return web.json_response({
        "served_model": state.config.served_model,
        "in_flight": state.pool.in_flight(),
        "engines": [engine.describe() | _memory_blocks(state, engine) for engine in state.pool.engines],
        "token_cache": state.token_cache.stats()._asdict(),
        "prefix_index": {"url_configured": bool(state.config.redis_url),
                         "ready": await state.lookup.ready()},
        "kv_events": None if state.view is None else {
            "loaded": state.view.loaded, "engines": state.view.engines, "blocks": state.view.blocks,
            "resyncs": state.view.resyncs},
    })


def _memory_blocks(state, engine) -> dict:
    """The blocks the engine holds in memory as its KV events tell this gateway (a count, not the hashes)."""
    if state.view is None or engine.stats is None:
        return {}
    return {"memory_blocks": state.view.held(engine.stats.engine_id)}


def create_app(config: GatewayConfig) -> web.Application:
    state = GatewayState.build(config)
    app = web.Application(middlewares=[openai_error_middleware],
                          client_max_size=config.max_body_bytes)
    app[STATE] = state
    add_request_ids(app)
    add_instance_header(app)
    app.on_startup.append(state.start)
    app.on_cleanup.append(state.stop)
    # DeepSeek serves chat prefix completion and FIM under /beta; both are the same handlers here.
    for root in ("/v1", "/beta"):
        app.router.add_post(f"{root}/chat/completions", chat_completions)
        app.router.add_post(f"{root}/completions", completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/v1/models/{model}", model)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)
    app.router.add_get("/admin/stats", admin_stats)
    add_dashboard_routes(app)
    add_tenant_purge_route(app)
    return app
