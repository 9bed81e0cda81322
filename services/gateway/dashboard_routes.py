"""GET /dashboard (the page) and GET /admin/dashboard.json (its data, admin token).

The page is static and holds no data, so it is served without a token; it asks for the admin token
(or takes it from the URL fragment, #token=..., which browsers never send to the server) and
sends it with every poll of the admin endpoint.
"""
from __future__ import annotations

from pathlib import Path

from aiohttp import web

from services.gateway.completions_endpoint import STATE
from services.gateway.dashboard_feed import dashboard_snapshot
from services.gateway.openai_errors import OpenAIError
from services.gateway.tenants import admin_allowed

PAGE = Path(__file__).with_name("dashboard.html")


async def dashboard_page(_request: web.Request) -> web.Response:
    return web.Response(body=PAGE.read_bytes(), content_type="text/html", charset="utf-8",
                        headers={"Cache-Control": "no-store", "Content-Security-Policy":
                                 "default-src 'self'; script-src 'unsafe-inline'; style-src 'unsafe-inline'"})


async def dashboard_data(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if not admin_allowed(request.headers.get("Authorization"), state.config.admin_token):
        raise OpenAIError("A valid admin token is required.", code="invalid_admin_token", status=401)
    return web.json_response(await dashboard_snapshot(state), headers={"Cache-Control": "no-store"})


def add_dashboard_routes(app: web.Application) -> None:
    app.router.add_get("/dashboard", dashboard_page)
    app.router.add_get("/admin/dashboard.json", dashboard_data)
