"""The request id a service is serving now: one id per client request, carried gateway -> engine -> kvstore in
`X-Request-Id` (request_id.py sets it per HTTP request). No HTTP library here: the engine's model side uses it."""
from __future__ import annotations

import re
import uuid
from contextvars import ContextVar

REQUEST_ID_HEADER = "X-Request-Id"
NO_REQUEST = "-"
_SANE = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")  # no spaces or control characters in log lines

current_request_id: ContextVar[str] = ContextVar("request_id", default=NO_REQUEST)


def accepted_request_id(raw: str | None) -> str | None:
    """`raw` if it can go into log lines and headers as it is, else None."""
    return raw if raw is not None and _SANE.fullmatch(raw) else None


def new_request_id() -> str:
    return uuid.uuid4().hex


def forwarded_headers() -> dict[str, str]:
    """Headers for a call made while serving a request: its id, if there is one."""
    rid = current_request_id.get()
    return {} if rid == NO_REQUEST else {REQUEST_ID_HEADER: rid}
