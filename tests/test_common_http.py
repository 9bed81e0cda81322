"""services.common HTTP plumbing on a real aiohttp server: health, readiness, metrics, admin auth, errors."""
from __future__ import annotations

import aiohttp
from aiohttp import web
from aiohttp.test_utils import TestServer
from prometheus_client import CollectorRegistry, Counter

from services.common import (RequestError, add_health_routes, add_metrics_route, admin_auth_middleware,
                             error_middleware)


async def serve(token: str, ready: dict[str, bool]) -> TestServer:
    app = web.Application(middlewares=[error_middleware, admin_auth_middleware(token)], client_max_size=1024)

    async def readiness():
        return dict(ready)

    async def secret(_):
        return web.json_response({"secret": 42})

    async def bad(_):
        raise RequestError(422, "widgets must be positive", "widgets")

    async def echo(request):
        return web.Response(body=await request.read())

    async def boom(_):
        raise RuntimeError("bug")

    registry = CollectorRegistry()
    Counter("demo_requests", "demo", registry=registry).inc(3)
    add_health_routes(app, readiness)
    add_metrics_route(app, registry)
    app.router.add_get("/admin/secret", secret)
    app.router.add_get("/bad", bad)
    app.router.add_post("/echo", echo)
    app.router.add_get("/boom", boom)
    server = TestServer(app)
    await server.start_server()
    return server


async def test_health_readiness_metrics_errors():
    ready = {"redis": True}
    server = await serve("tok", ready)
    try:
        async with aiohttp.ClientSession(str(server.make_url("/"))) as http:
            assert (await (await http.get("/healthz")).json()) == {"status": "ok"}
            assert (await http.get("/readyz")).status == 200
            ready["redis"] = False
            r = await http.get("/readyz")
            assert r.status == 503 and (await r.json())["checks"] == {"redis": False}
            assert "demo_requests_total 3.0" in await (await http.get("/metrics")).text()
            r = await http.get("/bad")
            assert r.status == 422 and await r.json() == {"error": "widgets must be positive", "field": "widgets"}
            r = await http.post("/echo", data=b"x" * 4096)
            assert r.status == 413 and (await r.json())["field"] == "body"
            r = await http.get("/boom")
            assert r.status == 500 and await r.json() == {"error": "internal error"}
            assert (await http.get("/nowhere")).status == 404
    finally:
        await server.close()


async def test_admin_auth():
    server = await serve("tok", {})
    try:
        async with aiohttp.ClientSession(str(server.make_url("/"))) as http:
            assert (await http.get("/admin/secret")).status == 401
            assert (await http.get("/admin/secret", headers={"Authorization": "Basic tok"})).status == 401
            assert (await http.get("/admin/secret", headers={"Authorization": "Bearer nope"})).status == 403
            r = await http.get("/admin/secret", headers={"Authorization": "Bearer tok"})
            assert r.status == 200 and await r.json() == {"secret": 42}
    finally:
        await server.close()
    server = await serve("", {})
    try:
        async with aiohttp.ClientSession(str(server.make_url("/"))) as http:
            r = await http.get("/admin/secret", headers={"Authorization": "Bearer "})
            assert r.status == 403 and "disabled" in (await r.json())["error"]
    finally:
        await server.close()
