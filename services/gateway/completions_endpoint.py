"""POST /v1/chat/completions and /v1/completions: request -> tokens -> engine -> JSON or SSE."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from contextlib import aclosing

from aiohttp import web

from services.common.request_id import REQUEST_ID
from typing import NamedTuple

from services.gateway.answer_stream import AnswerDelta, AnswerEnd, answer_events
from services.gateway.chat_template import (TOOL_ARGUMENTS_ROLE, TOOL_NAME_ROLE, render_chat,
                                            render_completion, render_fill_in_middle, tools_prompt)
from services.gateway.engine_client import EngineUnavailable
from services.gateway.engine_router import GenerationJob
from services.gateway.gateway_state import GatewayState
from services.gateway.tenants import Tenant
from services.gateway.openai_errors import OpenAIError, invalid, model_not_found, unavailable
from services.gateway.openai_requests import (MAX_LOGIT_BIAS, ChatCompletionRequest, CompletionRequest,
                                              engine_grammar, parse_chat_completion,
                                              parse_completion, parse_json_body)
from services.gateway.openai_responses import (ResponseHeader, Usage, chat_chunk, chat_completion,
                                               chat_logprobs, completion_logprobs, text_completion,
                                               tool_call_deltas, tool_calls_body, usage_chunk)
from services.gateway.reply_parser import ReplyParser
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


def served_models(state: GatewayState) -> list[str]:
    return [state.config.served_model] + ([state.config.reasoner_model] if state.config.reasoner_model else [])


def _check_model(state: GatewayState, model: str) -> None:
    if model not in served_models(state):
        raise model_not_found(model)


def _needs_tokens(state: GatewayState, param: str, feature: str, *names: str) -> None:
    if not state.tokenizer.template.has(*names):
        raise invalid(param, f"Invalid '{param}': the served model's tokenizer has no tokens for "
                             f"{feature}.", "unsupported_value")


def _check_template_tokens(state: GatewayState, parsed: ChatCompletionRequest, thinking: bool) -> None:
    if thinking:
        _needs_tokens(state, "thinking", "thinking mode", "think_begin", "think_end")
    if parsed.tools or any(m.role == "tool" or m.tool_calls for m in parsed.messages):
        _needs_tokens(state, "tools", "tool calls", "tool_calls_begin", "tool_calls_end",
                      "tool_call_begin", "tool_call_end", "tool_sep", "tool_output_begin",
                      "tool_output_end")


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, tenant = _authorized(request)
    with state.limits.admitted(tenant.name):  # the tenant's slot, from reading the body to the last byte out
        parsed = parse_chat_completion(parse_json_body(await _capped_body(request, state)),
                                       state.tokenizer.vocab_size)
        _check_model(state, parsed.model)
        thinking = parsed.thinking if parsed.thinking is not None else parsed.model == state.config.reasoner_model
        _check_template_tokens(state, parsed, thinking)
        grammar = engine_grammar(parsed, state.tokenizer.template)
        if grammar is not None and thinking:
            raise invalid("thinking", "Invalid 'thinking': JSON output and forced tool calls are "
                          "not supported in thinking mode.", "unsupported_value")
        _refuse_if_too_long(state, [message.text for message in parsed.messages], "messages")
        tools = tools_prompt(tool.definition for tool in parsed.tools) if parsed.tools else ""
        with state.metrics.render_seconds.time():
            tokens = await asyncio.to_thread(render_chat, parsed.messages,
                                             state.token_cache.for_tenant(tenant.name), tools, thinking)
        if parsed.tools and parsed.tool_choice.mode == "none":
            parsed = _without_tool_calls(parsed, state.tokenizer.template.tool_calls_begin)
        reply = ReplyShape(chat=True, thinking=thinking, parse_tool_calls=parsed.parses_tool_calls,
                           grammar=grammar, grammar_param="tools" if parsed.forces_tool_call else "response_format")
        return await _generate(request, state, tenant, tokens, parsed, reply)


async def completions(request: web.Request) -> web.StreamResponse:
    state, tenant = _authorized(request)
    with state.limits.admitted(tenant.name):
        parsed = parse_completion(parse_json_body(await _capped_body(request, state)), state.tokenizer.vocab_size)
        _check_model(state, parsed.model)
        cache = state.token_cache.for_tenant(tenant.name)
        if parsed.suffix is not None:
            _needs_tokens(state, "suffix", "fill-in-the-middle", "fim_begin", "fim_hole", "fim_end")
            _refuse_if_too_long(state, [parsed.prompt, parsed.suffix], "prompt")
            with state.metrics.render_seconds.time():
                tokens = await asyncio.to_thread(render_fill_in_middle, parsed.prompt, parsed.suffix, cache)
        elif isinstance(parsed.prompt, str):
            _refuse_if_too_long(state, [parsed.prompt], "prompt")
            with state.metrics.render_seconds.time():
                tokens = await asyncio.to_thread(render_completion, parsed.prompt, cache)
        else:
            tokens = list(parsed.prompt)
        return await _generate(request, state, tenant, tokens, parsed, ReplyShape(chat=False))


def _without_tool_calls(parsed: ChatCompletionRequest, calls_begin: int) -> ChatCompletionRequest:
    """tool_choice "none" with tools in the prompt: <｜tool▁calls▁begin｜> gets a -100 bias (OpenAI's
    ban), so the model cannot start a call."""
    bias = dict(parsed.sampling.logit_bias)
    if calls_begin not in bias and len(bias) >= MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"Invalid 'logit_bias': with tool_choice 'none' at most "
                      f"{MAX_LOGIT_BIAS - 1} entries (one is used to keep the model from calling).",
                      "invalid_value")
    bias[calls_begin] = -100.0
    return dataclasses.replace(parsed, sampling=dataclasses.replace(parsed.sampling, logit_bias=tuple(bias.items())))


class ReplyShape(NamedTuple):
    """How the tokens of one answer are read and shown."""
    chat: bool
    thinking: bool = False
    parse_tool_calls: bool = False
    grammar: dict | None = None
    grammar_param: str = "response_format"


async def _generate(request: web.Request, state: GatewayState, tenant, tokens: list[int],
                    parsed: ChatCompletionRequest | CompletionRequest, reply: ReplyShape
                    ) -> web.StreamResponse:
    response_id = ("chatcmpl-" if reply.chat else "cmpl-") + uuid.uuid4().hex
    eos = (state.tokenizer.special.eos,)
    # The engines log and save under the request id the client sees in X-Request-Id.
    job = GenerationJob(request[REQUEST_ID], tokens, tenant, parsed.sampling, parsed.retention, eos,
                        "messages" if reply.chat else "prompt", _pinned_engine(request, state),
                        reply.grammar, reply.grammar_param)
    state.limits.charge(tenant.name, len(tokens))
    if parsed.user is not None:  # OpenAI's end-user id, for abuse monitoring: kept in the log
        log.info("request %s: end user %r of tenant %s", request[REQUEST_ID], parsed.user[:256], tenant.name)
    state.metrics.in_flight.inc()
    try:
        async with state.router.generation(job) as generation:
            first_token_at = time.monotonic()
            state.metrics.ttft_seconds.observe(first_token_at - request[ARRIVED])
            header = ResponseHeader(response_id, int(time.time()), parsed.model,
                                    generation.fingerprint or None)
            parser = ReplyParser(state.tokenizer, parsed.stop, reply.thinking, reply.parse_tool_calls,
                                 response_id[-12:], getattr(parsed, "parallel_tool_calls", True),
                                 engine_ends_calls=reply.grammar is not None)
            answer_stream = answer_events(generation, len(tokens), parser, eos)
            async with aclosing(answer_stream) as answer:
                if parsed.stream:
                    return await _stream(request, state, header, answer, parsed, reply, first_token_at, tenant.name)
                return await _whole(state, header, answer, parsed, reply, first_token_at, tenant.name)
    except asyncio.CancelledError:  # the client went away (handler_cancellation)
        state.metrics.client_disconnects.inc()
        log.info("request %s: client went away, generation cancelled", response_id)
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
    if chat and not end.stopped_by_string:
        # The next turn re-sends this answer: render it as the ids the model generated, so the
        # new prompt extends exactly the tokens whose cache the engine saved. Ids with
        # special-looking tokens are left to plain BPE, so no text can map to a turn boundary.
        remembered = [("assistant", text, end.content_ids)]
        for parsed in end.tool_calls:
            remembered += [(TOOL_NAME_ROLE, parsed.call.name, parsed.name_ids),
                           (TOOL_ARGUMENTS_ROLE, parsed.call.arguments, parsed.argument_ids)]
        added = state.tokenizer.added_token_ids
        for role, role_text, ids in remembered:
            if not any(t in added for t in ids):
                state.token_cache.remember(role, role_text, ids, tenant)
    return usage


class _Collected:
    """The whole answer, gathered from its deltas."""

    def __init__(self):
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.logprobs: list = []

    def add(self, delta: AnswerDelta) -> None:
        self.content.append(delta.text)
        self.reasoning.append(delta.reasoning)
        self.logprobs.extend(delta.logprobs)


def _logprobs_body(state: GatewayState, parsed, chat: bool, entries, text_offset: int = 0) -> dict | None:
    if parsed.sampling.logprobs is None:
        return None
    if chat:
        return chat_logprobs(entries, state.tokenizer)
    return completion_logprobs(entries, state.tokenizer, text_offset)


async def _whole(state: GatewayState, header: ResponseHeader, answer, parsed, reply: ReplyShape,
                 first_token_at: float, tenant: str) -> web.Response:
    collected = _Collected()
    try:
        async for item in answer:
            if isinstance(item, AnswerDelta):
                collected.add(item)
            else:
                end = item
    except EngineUnavailable as failure:
        state.metrics.engine_failures.labels(failure.url, "mid_generation").inc()
        log.warning("request %s: engine failed mid-generation: %s", header.id, failure)
        raise unavailable("The engine failed while generating the answer. Try again.") from None
    text = "".join(collected.content)
    usage = _account(state, end, text, reply.chat, first_token_at, tenant)
    logprobs = _logprobs_body(state, parsed, reply.chat, collected.logprobs + list(end.logprobs))
    if reply.chat:
        body = chat_completion(header, text, end.finish_reason, usage,
                               "".join(collected.reasoning) if reply.thinking else None,
                               tool_calls_body(p.call for p in end.tool_calls), logprobs)
    else:
        body = text_completion(header, text, end.finish_reason, usage, logprobs=logprobs)
    return web.json_response(body)


async def _stream(request: web.Request, state: GatewayState, header: ResponseHeader, answer,
                  parsed: ChatCompletionRequest | CompletionRequest, reply: ReplyShape,
                  first_token_at: float, tenant: str) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
    await response.prepare(request)

    async def send(chunk: dict | str) -> None:
        payload = chunk if isinstance(chunk, str) else json.dumps(chunk, ensure_ascii=False)
        await response.write(f"data: {payload}\n\n".encode())

    try:
        try:
            await _send_answer(send, state, header, answer, parsed, reply, first_token_at, tenant)
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


def _chat_delta(item: AnswerDelta) -> dict:
    """DeepSeek streams reasoning as `reasoning_content` deltas, then the content as `content`."""
    delta = {}
    if item.reasoning:
        delta["reasoning_content"] = item.reasoning
    if item.text or (item.logprobs and not item.tool_calls):
        delta["content"] = item.text
    if item.tool_calls:
        delta["tool_calls"] = tool_call_deltas(item.tool_calls)
    return delta


async def _send_answer(send, state: GatewayState, header: ResponseHeader, answer, parsed,
                       reply: ReplyShape, first_token_at: float, tenant: str) -> None:
    include_usage, chat = parsed.include_usage, reply.chat
    if chat:
        await send(chat_chunk(header, {"role": "assistant", "content": ""},
                              include_usage_field=include_usage))
    parts: list[str] = []
    offset = 0  # characters of text sent so far (completions' logprobs text_offset)
    async for item in answer:
        if isinstance(item, AnswerDelta):
            parts.append(item.text)
            logprobs = _logprobs_body(state, parsed, chat, item.logprobs, offset) if item.logprobs else None
            offset += len(item.text)
            await send(chat_chunk(header, _chat_delta(item), include_usage_field=include_usage,
                                  logprobs=logprobs) if chat
                       else text_completion(header, item.text, None, include_usage_field=include_usage,
                                            logprobs=logprobs))
            continue
        usage = _account(state, item, "".join(parts), chat, first_token_at, tenant)
        logprobs = _logprobs_body(state, parsed, chat, item.logprobs, offset) if item.logprobs else None
        # OpenAI sends usage in an extra choice-less chunk when asked; DeepSeek always puts it
        # on the last chunk. Either way it appears exactly once.
        last_usage = None if include_usage else usage
        await send(chat_chunk(header, {}, item.finish_reason, last_usage,
                              include_usage_field=include_usage, logprobs=logprobs) if chat
                   else text_completion(header, "", item.finish_reason, last_usage,
                                        include_usage_field=include_usage, logprobs=logprobs))
        if include_usage:
            await send(usage_chunk(header, "chat.completion.chunk" if chat else "text_completion",
                                   usage))
