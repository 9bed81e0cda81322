"""JSON errors: every error a client can cause is a 4xx JSON body naming what was wrong."""
from __future__ import annotations

import logging

from aiohttp import web

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A client error: HTTP `status`, a message, and the request field it is about (if any)."""

    def __init__(self, status: int, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.field = status, message, field


def json_error(status: int, message: str, field: str | None = None) -> web.Response:
    body = {"error": message} if field is None else {"error": message, "field": field}
    return web.json_response(body, status=status)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    """RequestError and aiohttp's HTTP errors become JSON; anything else is a logged 500."""
    try:
        return await handler(request)
    except RequestError as e:
        return json_error(e.status, e.message, e.field)
    except web.HTTPRequestEntityTooLarge as e:
        return json_error(413, f"request body too large: {e.text}", "body")
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return json_error(e.status, e.reason)
    except Exception:
        log.exception("unhandled error in %s %s", request.method, request.path)
        return json_error(500, "internal error")
