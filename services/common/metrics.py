"""GET /metrics: Prometheus text from a per-app registry (no global registry, so tests can run
several apps in one process)."""
from __future__ import annotations

from typing import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


def add_metrics_route(app: web.Application, registry: CollectorRegistry,
                      before: Callable[[], Awaitable[None]] | None = None) -> None:
    """`before` runs ahead of each scrape (to refresh gauges that need an await)."""
    async def metrics(_: web.Request) -> web.Response:
        if before is not None:
            await before()
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    app.router.add_get("/metrics", metrics)
