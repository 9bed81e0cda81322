"""An engine's token stream -> the answer's deltas (content, reasoning, tool calls, logprobs) and its end."""
from __future__ import annotations

from typing import AsyncIterator, NamedTuple

from services.gateway.engine_client import DoneEvent, TokenEvent
from services.gateway.engine_router import Generation
from services.gateway.reply_parser import ParsedCall, ReplyDelta, ReplyParser


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), likeliest first


class AnswerDelta(NamedTuple):
    text: str                                  # content
    reasoning: str = ""
    tool_calls: tuple = ()                     # ToolCallDelta items
    logprobs: tuple[TokenLogprob, ...] = ()    # of the content tokens since the previous delta


class AnswerEnd(NamedTuple):
    finish_reason: str          # "stop" | "length" | "tool_calls"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens the engine loaded from the cache
    token_ids: list[int]        # generated ids, without a final stop token
    stopped_by_string: bool     # the text was cut at a stop string
    content_ids: list[int] = []           # ids of the content text (the next turn re-sends them)
    tool_calls: tuple[ParsedCall, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()  # content tokens not yet sent with a delta
    grammar_complete: bool | None = None     # None: no grammar was given
    system_fingerprint: str = ""


async def answer_events(generation: Generation, prompt_tokens: int, parser: ReplyParser,
                        stop_token_ids: tuple[int, ...]) -> AsyncIterator[AnswerDelta | AnswerEnd]:
    token_ids: list[int] = []
    done: DoneEvent | None = None
    loaded: int | None = None  # what the engine reported loading, with its first token
    pending: list[TokenLogprob] = []  # content logprobs not yet sent

    async def events():
        yield generation.first
        async for event in generation.events:
            yield event

    async for event in events():
        if isinstance(event, DoneEvent):
            done = event
            break
        token_ids.append(event.token_id)
        if event.cached_tokens is not None:
            loaded = event.cached_tokens
        if event.token_id in stop_token_ids:
            continue  # the end of the answer, not part of it
        delta, is_content = parser.push(event.token_id)
        if is_content and event.logprob is not None:
            pending.append(TokenLogprob(event.token_id, event.logprob, event.top_logprobs or ()))
        if delta:
            yield _delta(delta, pending)
            pending = []
        if parser.stopped:
            break  # the caller leaves the generation, which cancels it on the engine
    tail = parser.finish()
    if tail:
        yield _delta(tail, pending)
        pending = []
    received = len(token_ids)  # every generated token counts, a final end-of-sentence too
    if token_ids and token_ids[-1] in stop_token_ids:
        token_ids.pop()
    if done is None and not parser.stopped:
        raise RuntimeError("answer stream ended without a done event")  # engine_client prevents it
    content_ids = parser.content_ids
    if content_ids and content_ids[-1] in stop_token_ids:
        content_ids.pop()
    if parser.calls_complete or (parser.calls and done is not None and done.finish_reason == "stop"):
        finish_reason = "tool_calls"
    elif parser.stopped_by_string or done is None:
        finish_reason = "stop"
    else:
        finish_reason = done.finish_reason
    yield AnswerEnd(
        finish_reason=finish_reason,
        prompt_tokens=done.prompt_tokens if done else prompt_tokens,
        completion_tokens=received,
        # Without a done event (stopped early) the first token's count is the engine's; only an
        # engine that reports none leaves the index's estimate (it may load fewer after a bad block).
        cached_tokens=done.cached_tokens if done else loaded if loaded is not None else generation.hit_tokens,
        token_ids=token_ids,
        stopped_by_string=parser.stopped_by_string,
        content_ids=content_ids,
        tool_calls=tuple(parser.calls),
        logprobs=tuple(pending),
        grammar_complete=done.grammar_complete if done else None,
        system_fingerprint=generation.fingerprint,
    )


def _delta(delta: ReplyDelta, logprobs: list[TokenLogprob]) -> AnswerDelta:
    return AnswerDelta(delta.content, delta.reasoning, delta.tool_calls, tuple(logprobs))
