"""From engine events to answer text, finish reason and usage; response bodies vs /openapi.json.

The events here are the engine contract's own event values fed in order, as the engine client
yields them; no engine is involved.
"""
import jsonschema
import pytest

from services.gateway.answer_stream import AnswerDelta, AnswerEnd, answer_events
from services.gateway.engine_client import DoneEvent, TokenEvent
from services.gateway.engine_router import Generation
from services.gateway.openai_responses import (ResponseHeader, Usage, chat_chunk,
                                               chat_completion, models_list, text_completion,
                                               usage_chunk)
from services.gateway.openapi_document import openapi_document
from services.gateway.tokenizer import shared_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return shared_tokenizer()


def generation(events, hit_tokens=0):
    async def rest():
        for event in events[1:]:
            yield event
    return Generation("http://engine", hit_tokens, events[0], rest())


async def collect(tokenizer, events, stops=(), hit_tokens=0):
    eos = (tokenizer.special.eos,)
    items = [item async for item in answer_events(generation(events, hit_tokens), 100, tokenizer,
                                                  stops, eos)]
    text = "".join(item.text for item in items if isinstance(item, AnswerDelta))
    assert isinstance(items[-1], AnswerEnd)
    return text, items[-1]


async def test_answer_to_end_of_sentence(tokenizer):
    answer = "Hello 🎉 wörld"
    ids = tokenizer.encode_text(answer)
    events = [TokenEvent(i) for i in ids] + [TokenEvent(tokenizer.special.eos),
                                            DoneEvent("stop", 100, 64, {"ttft_s": 0.1})]
    text, end = await collect(tokenizer, events, hit_tokens=128)
    assert text == answer
    assert end == AnswerEnd("stop", 100, len(ids) + 1, 64, ids, False)


async def test_length_limit(tokenizer):
    ids = tokenizer.encode_text("one two three")
    text, end = await collect(tokenizer, [TokenEvent(i) for i in ids] +
                              [DoneEvent("length", 100, 0, {})])
    assert text == "one two three" and end.finish_reason == "length"
    assert end.completion_tokens == len(ids) and end.token_ids == ids


async def test_stop_string_ends_early_without_done(tokenizer):
    ids = tokenizer.encode_text("answer: 42\nEND of text that must not appear")
    # No done event follows: the gateway stops reading at the stop string.
    text, end = await collect(tokenizer, [TokenEvent(i) for i in ids], stops=("\nEND",),
                              hit_tokens=64)
    assert text == "answer: 42"
    assert end.finish_reason == "stop" and end.stopped_by_string
    assert end.cached_tokens == 64  # the index's count, the engine's being unknown
    assert end.completion_tokens < len(ids)


async def test_stop_string_split_over_tokens_and_at_the_end(tokenizer):
    ids = tokenizer.encode_text("abc###")
    text, end = await collect(tokenizer, [TokenEvent(i) for i in ids] +
                              [DoneEvent("length", 100, 0, {})], stops=("###",))
    assert text == "abc" and end.finish_reason == "stop"


def validator(name):
    document = openapi_document(129_280, "deepseek-chat")
    return jsonschema.Draft202012Validator({"components": document["components"],
                                            "$ref": f"#/components/schemas/{name}"})


def test_response_bodies_match_the_openapi_document():
    header = ResponseHeader("chatcmpl-1", 1_700_000_000, "deepseek-chat")
    usage = Usage(prompt_tokens=1000, completion_tokens=20, cached_tokens=960)
    assert usage.body() == {"prompt_tokens": 1000, "completion_tokens": 20, "total_tokens": 1020,
                            "prompt_cache_hit_tokens": 960, "prompt_cache_miss_tokens": 40,
                            "prompt_tokens_details": {"cached_tokens": 960}}
    validator("ChatCompletion").validate(chat_completion(header, "hi", "stop", usage))
    chunk = validator("ChatCompletionChunk")
    chunk.validate(chat_chunk(header, {"role": "assistant", "content": ""}))
    chunk.validate(chat_chunk(header, {"content": "x"}, include_usage_field=True))
    chunk.validate(chat_chunk(header, {}, "length", usage))
    chunk.validate(usage_chunk(header, "chat.completion.chunk", usage))
    completion = validator("Completion")
    completion.validate(text_completion(header, "x", "stop", usage))
    completion.validate(text_completion(header, "x", None, include_usage_field=False))
    completion.validate(usage_chunk(header, "text_completion", usage))
    validator("ModelList").validate(models_list("deepseek-chat", 0))
    with pytest.raises(jsonschema.ValidationError):
        validator("Usage").validate({**usage.body(), "extra": 1})


async def test_stop_string_early_uses_the_count_the_engine_reported_with_its_first_token(tokenizer):
    ids = tokenizer.encode_text("answer: 42\nEND of text that must not appear")
    # The index promised 128 tokens, but a block failed verification and the engine loaded 64.
    events = [TokenEvent(ids[0], cached_tokens=64)] + [TokenEvent(i) for i in ids[1:]]
    _, end = await collect(tokenizer, events, stops=("\nEND",), hit_tokens=128)
    assert end.stopped_by_string and end.cached_tokens == 64
