"""GET /healthz (the process is alive) and GET /readyz (every dependency answers)."""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from aiohttp import web

log = logging.getLogger(__name__)

# A readiness probe: dependency name -> reachable. Should not raise (if it does: not ready).
Readiness = Callable[[], Awaitable[dict[str, bool]]]


def add_health_routes(app: web.Application, readiness: Readiness) -> None:
    async def healthz(_: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        try:
            checks = await readiness()
        except Exception as e:  # a probe that breaks says "not ready", with why
            log.exception("readiness probe failed")
            checks = {f"probe ({type(e).__name__})": False}
        ready = all(checks.values())
        return web.json_response({"ready": ready, "checks": checks}, status=200 if ready else 503)

    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
