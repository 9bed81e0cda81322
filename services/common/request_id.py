"""Request ids: one id per client request, carried gateway -> engine -> kvstore in `X-Request-Id`.

The gateway takes the client's id when it is a sane token (else makes one); every service puts the
id of the request it is serving into `current_request_id` (request_context.py), which the log formatter adds to
each line and the HTTP clients (engine_client, KvstoreClient) forward to the next service. Every
response carries it back.
"""
from __future__ import annotations

from aiohttp import web

from services.common.request_context import (NO_REQUEST, REQUEST_ID_HEADER, accepted_request_id,
                                             current_request_id, forwarded_headers, new_request_id)

__all__ = ["NO_REQUEST", "REQUEST_ID", "REQUEST_ID_HEADER", "accepted_request_id", "add_request_ids",
           "current_request_id", "forwarded_headers", "new_request_id"]
REQUEST_ID = web.RequestKey("request_id", str)


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
