"""HTTP client for one engine's internal API.

POST /internal/generate streams NDJSON events: {"type": "progress"} once admitted and every few
seconds while the request waits or prefills, {"type": "token", "id"} (with "logprob" and
"top_logprobs" [[id, logprob], ...] when the job asked for logprobs), then {"type": "done",
"finish_reason", "prompt_tokens", "cached_tokens", "timing"} (with "grammar_complete" when the job
had a grammar, "handoff_blocks" when it was a handoff), or {"type": "error", "message"}.
The read timeout is a silence timeout: progress events keep a long prefill alive.
503 + Retry-After means its queue is full; 400 carries an OpenAI-style error for bad input.
Closing the response cancels the generation on the engine.
"""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager
from typing import AsyncIterator, NamedTuple

import aiohttp

from services.common.request_id import forwarded_headers
from services.common.service_auth import bearer_headers


class TokenEvent(NamedTuple):
    token_id: int
    cached_tokens: int | None = None  # on the first token: prompt tokens the engine really loaded
    logprob: float | None = None      # the model's log-softmax of this token (before any mask)
    top_logprobs: tuple[tuple[int, float], ...] | None = None


class DoneEvent(NamedTuple):
    finish_reason: str   # "stop" | "length"
    prompt_tokens: int
    cached_tokens: int   # prompt tokens loaded from the cache (after verification)
    timing: dict         # engine's own timings, seconds
    grammar_complete: bool | None = None  # None: the job had no grammar
    handoff_blocks: int | None = None  # a handoff's: leading prompt blocks the index holds for the decode engine


EngineEvent = TokenEvent | DoneEvent


class EngineStats(NamedTuple):
    fingerprint: str
    model: str
    max_context: int   # tokens, prompt + completion
    block_tokens: int  # tokens per cached block
    in_flight: int
    role: str = "both"  # prefill | decode | both (services/engine/config.py)
    engine_id: str = ""  # the engine process's id: its name in KV events


class EngineUnavailable(Exception):
    """The engine could not take or finish the request; another engine may. Not the user's fault."""

    def __init__(self, url: str, reason: str, retry_after_s: int | None = None):
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.reason = reason
        self.retry_after_s = retry_after_s


class EngineRejected(Exception):
    """The engine refused the input (HTTP 400): the user's fault, the same on every engine."""

    def __init__(self, url: str, error: dict):
        super().__init__(f"{url}: {error.get('message', error)}")
        self.error = error


class EngineClient:
    def __init__(self, url: str, session: aiohttp.ClientSession, admin_token: str,
                 connect_timeout_s: float, read_timeout_s: float, service_token: str = ""):
        self.url = url.rstrip("/")
        self._session = session
        self._admin_headers = bearer_headers(admin_token)
        self._service_headers = bearer_headers(service_token)  # /internal/* needs the service token
        self._probe_timeout = aiohttp.ClientTimeout(total=connect_timeout_s + 3.0,
                                                    connect=connect_timeout_s)
        # No total limit: a generation may stream for minutes; each read may wait for prefill.
        self._stream_timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s,
                                                     sock_read=read_timeout_s)

    async def ready(self) -> bool:
        try:
            async with self._session.get(f"{self.url}/readyz", timeout=self._probe_timeout) as r:
                return r.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError):
            return False

    async def stats(self) -> EngineStats:
        async with self._session.get(f"{self.url}/admin/stats", headers=self._admin_headers,
                                     timeout=self._probe_timeout) as response:
            if response.status in (401, 403):
                raise PermissionError(f"/admin/stats answered {response.status}: the gateway's "
                                      "admin_token must be the engine's admin token")
            response.raise_for_status()
            body = await response.json(content_type=None)
        return EngineStats(fingerprint=str(body["fingerprint"]), model=str(body["model"]),
                           max_context=int(body["max_context"]),
                           block_tokens=int(body["block_tokens"]),
                           in_flight=int(body.get("in_flight", 0)),
                           role=str(body.get("role", "both")), engine_id=str(body.get("engine_id", "")))

    @asynccontextmanager
    async def generate(self, job: dict) -> AsyncIterator[AsyncIterator[EngineEvent]]:
        """Start a generation; yields its event stream. Leaving the block cancels it."""
        try:
            response = await self._session.post(f"{self.url}/internal/generate", json=job,
                                                headers=forwarded_headers() | self._service_headers,
                                                timeout=self._stream_timeout)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as error:
            raise EngineUnavailable(self.url, f"unreachable ({error!r})") from error
        try:
            if response.status == 503:
                raise EngineUnavailable(self.url, "queue full",
                                        _retry_after(response.headers.get("Retry-After")))
            if response.status == 400:
                raise EngineRejected(self.url, await _error_of(response))
            if response.status in (401, 403):
                raise EngineUnavailable(self.url, f"HTTP {response.status}: the gateway's service_token "
                                                  "must be the engine's")
            if response.status != 200:
                raise EngineUnavailable(self.url, f"HTTP {response.status}")
            yield self._events(response)
        finally:
            response.close()

    async def _events(self, response: aiohttp.ClientResponse) -> AsyncIterator[EngineEvent]:
        try:
            while line := await response.content.readline():
                if not line.strip():
                    continue
                event = json.loads(line)
                kind = event.get("type")
                if kind == "token":
                    cached = event.get("cached_tokens")
                    logprob = event.get("logprob")
                    top = event.get("top_logprobs")
                    yield TokenEvent(int(event["id"]), None if cached is None else int(cached),
                                     None if logprob is None else float(logprob),
                                     None if top is None else tuple((int(t), float(lp)) for t, lp in top))
                elif kind == "done":
                    complete, handed = event.get("grammar_complete"), event.get("handoff_blocks")
                    yield DoneEvent(event["finish_reason"], int(event["prompt_tokens"]),
                                    int(event["cached_tokens"]), event.get("timing") or {},
                                    None if complete is None else bool(complete),
                                    None if handed is None else int(handed))
                    return
                elif kind == "error":
                    raise EngineUnavailable(self.url, f"engine error: {event.get('message')}")
                # "progress": the engine is alive and working; nothing to pass on
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError, KeyError,
                TypeError) as error:
            raise EngineUnavailable(self.url, f"stream broken ({error!r})") from error
        raise EngineUnavailable(self.url, "stream ended without a done event")


def _retry_after(value: str | None) -> int | None:
    try:
        return max(0, int(value)) if value is not None else None
    except ValueError:
        return None


async def _error_of(response: aiohttp.ClientResponse) -> dict:
    """{"message", "param"?, "code"?} from an engine's 400: OpenAI form {"error": {...}} or the
    services' common form {"error": "message", "field": "name"}."""
    try:
        body = await response.json(content_type=None)
    except (ValueError, aiohttp.ClientError):
        return {"message": (await response.text())[:500]}
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return error
    if isinstance(error, str):
        return {"message": error, "param": body.get("field")}
    return {"message": str(body)[:500]}
