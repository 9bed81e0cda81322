"""POST /v1/chat/completions and /v1/completions: request -> tokens -> engine -> JSON or SSE."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from services.common.request_id import REQUEST_ID
from services.gateway.answer_stream import AnswerDelta, AnswerEnd, answer_events
from services.gateway.chat_template import render_chat, render_completion
from services.gateway.engine_client import EngineUnavailable
from services.gateway.engine_router import GenerationJob
from services.gateway.gateway_state import GatewayState
from services.gateway.tenants import Tenant
from services.gateway.openai_errors import OpenAIError, invalid, model_not_found, unavailable
from services.gateway.openai_requests import (ChatCompletionRequest, CompletionRequest,
                                              parse_chat_completion, parse_completion,
                                              parse_json_body)
from services.gateway.openai_responses import (ResponseHeader, Usage, chat_chunk,
                                               chat_completion, text_completion, usage_chunk)
from services.gateway.tenants import admin_allowed

log = logging.getLogger(__name__)

STATE = web.AppKey("gateway_state", GatewayState)
ARRIVED = web.RequestKey("arrived_monotonic_s", float)  # set by the app's middleware
PIN_HEADER = "X-DeepInfer-Engine"  # an engine URL or index: run the request there (admin only)
PIN_ADMIN_HEADER = "X-DeepInfer-Admin-Token"  # Authorization carries the API key; the admin token rides here


def _authorized(request: web.Request) -> tuple[GatewayState, Tenant]:
    state = request.app[STATE]
    return state, state.tenants.tenant_for(request.headers.get("Authorization"))


async def _capped_body(request: web.Request, state: GatewayState) -> bytearray:
    """The body, refused (413) as soon as it is longer than any prompt within the model's context
    can need (PromptBound.body_cap_bytes): by its Content-Length before reading, else while reading."""
    max_context = state.pool.max_context()
    cap = state.config.max_body_bytes if max_context is None else min(
        state.config.max_body_bytes, state.prompt_bound.body_cap_bytes(max_context))
    if (request.content_length or 0) > cap:
        raise _too_large(cap)
    body = bytearray()  # grown in place: no list of chunks joined into a second copy
    while chunk := await request.content.readany():
        if len(body) + len(chunk) > cap:
            raise _too_large(cap)
        body += chunk
    return body


def _too_large(cap: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than the {cap} bytes a prompt within this model's "
                       "context can take.", code="request_too_large", status=413)


def _refuse_if_too_long(state: GatewayState, texts: list[str], param: str) -> None:
    """context_length_exceeded before tokenizing, when the texts cannot fit (see prompt_bound.py)."""
    max_context = state.pool.max_context()
    if max_context is not None and (at_least := state.prompt_bound.min_tokens(texts)) >= max_context:
        raise invalid(param, f"This model's maximum context length is {max_context} tokens. However, "
                      f"your prompt is at least {at_least} tokens.", "context_length_exceeded")


def _check_model(state: GatewayState, model: str) -> None:
    if model != state.config.served_model:
        raise model_not_found(model)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, tenant = _authorized(request)
    with state.limits.admitted(tenant.name):  # the tenant's slot, from reading the body to the last byte out
        parsed = parse_chat_completion(parse_json_body(await _capped_body(request, state)))
        _check_model(state, parsed.model)
        _refuse_if_too_long(state, [message.text for message in parsed.messages], "messages")
        with state.metrics.render_seconds.time():
            tokens = await asyncio.to_thread(render_chat, parsed.messages,
                                             state.token_cache.for_tenant(tenant.name))
        return await _generate(request, state, tenant, tokens, parsed, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    state, tenant = _authorized(request)
    with state.limits.admitted(tenant.name):
        parsed = parse_completion(parse_json_body(await _capped_body(request, state)), state.tokenizer.vocab_size)
        _check_model(state, parsed.model)
        if isinstance(parsed.prompt, str):
            _refuse_if_too_long(state, [parsed.prompt], "prompt")
            with state.metrics.render_seconds.time():
                tokens = await asyncio.to_thread(render_completion, parsed.prompt,
                                                 state.token_cache.for_tenant(tenant.name))
        else:
            tokens = list(parsed.prompt)
        return await _generate(request, state, tenant, tokens, parsed, chat=False)


async def _generate(request: web.Request, state: GatewayState, tenant, tokens: list[int],
                    parsed: ChatCompletionRequest | CompletionRequest, chat: bool
                    ) -> web.StreamResponse:
    header = ResponseHeader(("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex,
                            int(time.time()), state.config.served_model)
    eos = (state.tokenizer.special.eos,)
    # The engines log and save under the request id the client sees in X-Request-Id.
    job = GenerationJob(request[REQUEST_ID], tokens, tenant, parsed.sampling, parsed.retention, eos,
                        "messages" if chat else "prompt", _pinned_engine(request, state))
    state.limits.charge(tenant.name, len(tokens))
    state.metrics.in_flight.inc()
    try:
        async with state.router.generation(job) as generation:
            first_token_at = time.monotonic()
            state.metrics.ttft_seconds.observe(first_token_at - request[ARRIVED])
            async with aclosing(answer_events(generation, len(tokens), state.tokenizer,
                                              parsed.stop, eos)) as answer:
                if parsed.stream:
                    return await _stream(request, state, header, answer, parsed, chat, first_token_at, tenant.name)
                return await _whole(state, header, answer, chat, first_token_at, tenant.name)
    except asyncio.CancelledError:  # the client went away (handler_cancellation)
        state.metrics.client_disconnects.inc()
        log.info("request %s: client went away, generation cancelled", header.id)
        raise
    finally:
        state.metrics.in_flight.dec()


def _pinned_engine(request: web.Request, state: GatewayState) -> str | None:
    """An admin may pin a request to one engine (URL or index in --engine order): tests and operators
    choose where a request runs instead of the router."""
    pin = request.headers.get(PIN_HEADER)
    if pin is None:
        return None
    if not admin_allowed("Bearer " + request.headers.get(PIN_ADMIN_HEADER, ""), state.config.admin_token):
        raise OpenAIError(f"{PIN_HEADER} needs a valid admin token in {PIN_ADMIN_HEADER}.",
                          code="invalid_admin_token", status=403, error_type="permission_error",
                          param=PIN_HEADER)
    return pin


def _account(state: GatewayState, end: AnswerEnd, text: str, chat: bool, first_token_at: float,
             tenant: str) -> Usage:
    usage = Usage(end.prompt_tokens, end.completion_tokens, end.cached_tokens)
    if end.completion_tokens > 1:  # time per output token after the first (TPOT)
        state.metrics.tpot_seconds.observe((time.monotonic() - first_token_at) / (end.completion_tokens - 1))
    state.metrics.prompt_tokens.labels("hit").inc(usage.cached_tokens)
    state.metrics.prompt_tokens.labels("miss").inc(usage.prompt_tokens - usage.cached_tokens)
    state.metrics.completion_tokens.inc(usage.completion_tokens)
    state.limits.charge(tenant, usage.completion_tokens)
    added = state.tokenizer.added_token_ids
    if chat and not end.stopped_by_string and not any(t in added for t in end.token_ids):
        # The next turn re-sends this answer: render it as the ids the model generated, so the
        # new prompt extends exactly the tokens whose cache the engine saved. Answers with
        # special-looking tokens are left to plain BPE, so no text can map to a turn boundary.
        state.token_cache.remember("assistant", text, end.token_ids, tenant)
    return usage


async def _whole(state: GatewayState, header: ResponseHeader, answer, chat: bool,
                 first_token_at: float, tenant: str) -> web.Response:
    parts: list[str] = []
    try:
        async for item in answer:
            if isinstance(item, AnswerDelta):
                parts.append(item.text)
            else:
                end = item
    except EngineUnavailable as failure:
        state.metrics.engine_failures.labels(failure.url, "mid_generation").inc()
        log.warning("request %s: engine failed mid-generation: %s", header.id, failure)
        raise unavailable("The engine failed while generating the answer. Try again.") from None
    text = "".join(parts)
    usage = _account(state, end, text, chat, first_token_at, tenant)
    body = (chat_completion(header, text, end.finish_reason, usage) if chat
            else text_completion(header, text, end.finish_reason, usage))
    return web.json_response(body)


async def _stream(request: web.Request, state: GatewayState, header: ResponseHeader, answer,
                  parsed: ChatCompletionRequest | CompletionRequest, chat: bool, first_token_at: float,
                  tenant: str
                  ) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)

    async def send(chunk: dict | str) -> None:
        payload = chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)
        await response.write(f"data: {payload}\n\n".encode())

    try:
        try:
            await _send_answer(send, state, header, answer, parsed.include_usage, chat, first_token_at, tenant)
        except EngineUnavailable as failure:
            state.metrics.engine_failures.labels(failure.url, "mid_generation").inc()
            log.warning("request %s: engine failed mid-stream: %s", header.id, failure)
            await send(OpenAIError("The engine failed while generating the answer.",
                                   code="engine_failed", status=503,
                                   error_type="service_unavailable_error").body())
            return response
        await send("[DONE]")
        await response.write_eof()
    except ConnectionResetError:  # the client went away; leaving the generation cancels it
        state.metrics.client_disconnects.inc()
        log.info("request %s: client went away mid-stream, generation cancelled", header.id)
    return response


async def _send_answer(send, state: GatewayState, header: ResponseHeader, answer,
                       include_usage: bool, chat: bool, first_token_at: float, tenant: str) -> None:
    if chat:
        await send(chat_chunk(header, {"role": "assistant", "content": ""},
                              include_usage_field=include_usage))
    parts: list[str] = []
    async for item in answer:
        if isinstance(item, AnswerDelta):
            parts.append(item.text)
            await send(chat_chunk(header, {"content": item.text},
                                  include_usage_field=include_usage) if chat
                       else text_completion(header, item.text, None,
                                            include_usage_field=include_usage))
            continue
        usage = _account(state, item, "".join(parts), chat, first_token_at, tenant)
        # OpenAI sends usage in an extra choice-less chunk when asked; DeepSeek always puts it
        # on the last chunk. Either way it appears exactly once.
        last_usage = None if include_usage else usage
        await send(chat_chunk(header, {}, item.finish_reason, last_usage,
                              include_usage_field=include_usage) if chat
                   else text_completion(header, "", item.finish_reason, last_usage,
                                        include_usage_field=include_usage))
        if include_usage:
            await send(usage_chunk(header, "chat.completion.chunk" if chat else "text_completion",
                                   usage))
