"""Request ids: one id per client request, carried gateway -> engine -> kvstore in `X-Request-Id`.

The gateway takes the client's id when it is a sane token (else makes one); every service puts the
id of the request it is serving into `current_request_id`, which the log formatter adds to each
line and the HTTP clients (engine_client, KvstoreClient) forward to the next service. Every
response carries it back.
"""
from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

from aiohttp import web

REQUEST_ID_HEADER = "X-Request-Id"
NO_REQUEST = "-"
_SANE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # no spaces or control characters in log lines

current_request_id: ContextVar[str] = ContextVar("request_id", default=NO_REQUEST)
REQUEST_ID = web.RequestKey("request_id", str)


def accepted_request_id(raw: str | None) -> str | None:
    """`raw` if it can go into log lines and headers as it is, else None."""
    return raw if raw is not None and _SANE.fullmatch(raw) else None


def new_request_id() -> str:
    return uuid.uuid4().hex


def forwarded_headers() -> dict[str, str]:
    """Headers for a call made while serving a request: its id, if there is one."""
    rid = current_request_id.get()
    return {} if rid == NO_REQUEST else {REQUEST_ID_HEADER: rid}


def add_request_ids(app: web.Application) -> None:
    """Outermost middleware of `app`: each request runs with its id set (the caller's, or a new
    one), and its response (a stream too) carries the id back."""
    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        rid = accepted_request_id(request.headers.get(REQUEST_ID_HEADER)) or new_request_id()
        request[REQUEST_ID] = rid
        token = current_request_id.set(rid)
        try:
            return await handler(request)
        finally:
            current_request_id.reset(token)

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if REQUEST_ID in request:
            response.headers[REQUEST_ID_HEADER] = request[REQUEST_ID]

    app.middlewares.insert(0, middleware)
    app.on_response_prepare.append(on_prepare)
