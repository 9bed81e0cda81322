"""Which process answered: every response carries `X-DeepInfer-Instance`, the id its launcher gave it.

`deepinfer up` starts each service with its own random id in DEEPINFER_INSTANCE_ID and counts a
service as ready only when the answer on its port carries that id, so a foreign process listening
on the same port (another stack, a stale run) is never taken for the one it started. A service
started by hand gets a random id of its own. The id is an identity handed down by the supervisor,
not a setting, so it is not a config field.
"""
from __future__ import annotations

import os
import secrets

from aiohttp import web

INSTANCE_HEADER = "X-DeepInfer-Instance"
INSTANCE_ENV = "DEEPINFER_INSTANCE_ID"

_INSTANCE_ID = os.environ.get(INSTANCE_ENV) or secrets.token_hex(8)


def instance_id() -> str:
    return _INSTANCE_ID


def add_instance_header(app: web.Application) -> None:
    """Every response of `app` (streams included) names this process's instance id."""
    async def on_prepare(_request: web.Request, response: web.StreamResponse) -> None:
        response.headers[INSTANCE_HEADER] = _INSTANCE_ID

    app.on_response_prepare.append(on_prepare)
