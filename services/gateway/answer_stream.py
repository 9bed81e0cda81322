"""An engine's token stream -> the answer's text deltas and its end, with stop strings applied."""
from __future__ import annotations

from typing import AsyncIterator, NamedTuple

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.engine_client import DoneEvent, TokenEvent
from services.gateway.engine_router import Generation
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import DeepSeekTokenizer


class AnswerDelta(NamedTuple):
    text: str


class AnswerEnd(NamedTuple):
    finish_reason: str          # "stop" | "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int          # prompt tokens the engine loaded from the cache
    token_ids: list[int]        # generated ids, without a final stop token
    stopped_by_string: bool     # the text was cut at a stop string


async def answer_events(generation: Generation, prompt_tokens: int, tokenizer: DeepSeekTokenizer,
                        stops: tuple[str, ...], stop_token_ids: tuple[int, ...]
                        ) -> AsyncIterator[AnswerDelta | AnswerEnd]:
    detokenizer = IncrementalDetokenizer(tokenizer)
    matcher = StopStringMatcher(stops)
    token_ids: list[int] = []
    done: DoneEvent | None = None
    stopped = False
    loaded: int | None = None  # what the engine reported loading, with its first token

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
        scan = matcher.push(detokenizer.push(event.token_id))
        if scan.text:
            yield AnswerDelta(scan.text)
        if scan.stopped:
            stopped = True
            break  # the caller leaves the generation, which cancels it on the engine
    if not stopped:
        scan = matcher.push(detokenizer.finish())
        tail = scan.text + matcher.finish()
        stopped = scan.stopped
        if tail:
            yield AnswerDelta(tail)
    received = len(token_ids)  # every generated token counts, a final end-of-sentence too
    if token_ids and token_ids[-1] in stop_token_ids:
        token_ids.pop()
    if done is None and not stopped:
        raise RuntimeError("answer stream ended without a done event")  # engine_client prevents it
    yield AnswerEnd(
        finish_reason="stop" if stopped else done.finish_reason,
        prompt_tokens=done.prompt_tokens if done else prompt_tokens,
        completion_tokens=received,
        # Without a done event (stopped early) the first token's count is the engine's; only an
        # engine that reports none leaves the index's estimate (it may load fewer after a bad block).
        cached_tokens=done.cached_tokens if done else loaded if loaded is not None else generation.hit_tokens,
        token_ids=token_ids,
        stopped_by_string=stopped,
    )
