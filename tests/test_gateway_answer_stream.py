"""From engine events to answer text, finish reason and usage; response bodies vs /openapi.json.

The events here are the engine contract's own event values fed in order, as the engine client
yields them; no engine is involved.
"""
import jsonschema
import pytest

import json

from services.gateway.answer_stream import AnswerDelta, AnswerEnd, TokenLogprob, answer_events
from services.gateway.reply_parser import ReplyParser, ToolCallDelta
from services.gateway.engine_client import DoneEvent, TokenEvent
from services.gateway.engine_router import Generation
from services.gateway.openai_responses import (ResponseHeader, Usage, chat_chunk, chat_completion,
                                               chat_logprobs, completion_logprobs, model_card,
                                               models_list, text_completion, tool_call_deltas,
                                               tool_calls_body, usage_chunk)
from services.gateway.openapi_document import openapi_document
from services.gateway.tokenizer import shared_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return shared_tokenizer()


def generation(events, hit_tokens=0):
    async def rest():
        for event in events[1:]:
            yield event
    return Generation("http://engine", hit_tokens, events[0], rest(), "fp")


async def items_of(tokenizer, events, stops=(), hit_tokens=0, thinking=False, tools=False, parallel=True,
                   grammar=False):
    eos = (tokenizer.special.eos,)
    parser = ReplyParser(tokenizer, stops, thinking, tools, "test", parallel, engine_ends_calls=grammar)
    items = [item async for item in answer_events(generation(events, hit_tokens), 100, parser, eos)]
    assert isinstance(items[-1], AnswerEnd)
    return items


async def collect(tokenizer, events, stops=(), hit_tokens=0):
    items = await items_of(tokenizer, events, stops, hit_tokens)
    text = "".join(item.text for item in items if isinstance(item, AnswerDelta))
    return text, items[-1]


async def test_answer_to_end_of_sentence(tokenizer):
    answer = "Hello 🎉 wörld"
    ids = tokenizer.encode_text(answer)
    events = [TokenEvent(i) for i in ids] + [TokenEvent(tokenizer.special.eos),
                                            DoneEvent("stop", 100, 64, {"ttft_s": 0.1})]
    text, end = await collect(tokenizer, events, hit_tokens=128)
    assert text == answer
    assert end == AnswerEnd("stop", 100, len(ids) + 1, 64, ids, False, content_ids=ids,
                            system_fingerprint="fp")


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
    document = openapi_document(129_280, ["deepseek-chat", "deepseek-reasoner"])
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
    validator("ModelList").validate(models_list(["deepseek-chat", "deepseek-reasoner"], 0))
    validator("Model").validate(model_card("deepseek-chat", 0))
    with pytest.raises(jsonschema.ValidationError):
        validator("Usage").validate({**usage.body(), "extra": 1})


async def test_stop_string_early_uses_the_count_the_engine_reported_with_its_first_token(tokenizer):
    ids = tokenizer.encode_text("answer: 42\nEND of text that must not appear")
    # The index promised 128 tokens, but a block failed verification and the engine loaded 64.
    events = [TokenEvent(ids[0], cached_tokens=64)] + [TokenEvent(i) for i in ids[1:]]
    _, end = await collect(tokenizer, events, stops=("\nEND",), hit_tokens=128)
    assert end.stopped_by_string and end.cached_tokens == 64


def _call_tokens(tokenizer, calls):
    template = tokenizer.template
    ids = [template.tool_calls_begin]
    for name, arguments in calls:
        ids += [template.tool_call_begin, *tokenizer.encode_text(name), template.tool_sep,
                *tokenizer.encode_text(arguments), template.tool_call_end]
    return ids + [template.tool_calls_end]


async def test_tool_calls_are_parsed_from_their_tokens_and_streamed_as_deltas(tokenizer):
    content = tokenizer.encode_text("Let me check.")
    calls = [("get_weather", '{"city":"Paris"}'), ("get_time", '{"zone":"CET"}')]
    ids = content + _call_tokens(tokenizer, calls)
    # No done event: the gateway stops at <｜tool▁calls▁end｜> (an engine with a grammar ends there too).
    items = await items_of(tokenizer, [TokenEvent(i) for i in ids], tools=True)
    end = items[-1]
    assert end.finish_reason == "tool_calls" and end.content_ids == content
    assert [(p.call.name, p.call.arguments) for p in end.tool_calls] == calls
    assert [tokenizer.decode(p.argument_ids) for p in end.tool_calls] == [a for _, a in calls]
    assert "".join(i.text for i in items[:-1]) == "Let me check."
    # The streamed deltas assemble to the same calls, the OpenAI way: id and name first, then arguments.
    assembled: dict[int, dict] = {}
    for delta in tool_call_deltas([d for i in items[:-1] for d in i.tool_calls]):
        call = assembled.setdefault(delta["index"], {"id": None, "name": None, "arguments": ""})
        if "id" in delta:
            call["id"], call["name"] = delta["id"], delta["function"]["name"]
        call["arguments"] += delta["function"]["arguments"]
    assert [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
            for c in assembled.values()] == tool_calls_body(p.call for p in end.tool_calls)
    assert [json.loads(c["arguments"]) for c in assembled.values()] == [{"city": "Paris"}, {"zone": "CET"}]


async def test_a_forced_call_reads_the_engines_done_event(tokenizer):
    """Under a grammar the engine ends the reply itself: its done event (usage, grammar_complete) is read."""
    ids = _call_tokens(tokenizer, [("a", "{}")])
    done = DoneEvent("stop", 100, 64, {}, grammar_complete=True)
    end = (await items_of(tokenizer, [TokenEvent(i) for i in ids] + [done], tools=True, grammar=True))[-1]
    assert (end.finish_reason, end.cached_tokens, end.grammar_complete) == ("tool_calls", 64, True)


async def test_without_parallel_tool_calls_the_reply_ends_after_the_first_call(tokenizer):
    ids = _call_tokens(tokenizer, [("a", "{}"), ("b", "{}")])
    items = await items_of(tokenizer, [TokenEvent(i) for i in ids], tools=True, parallel=False)
    assert items[-1].finish_reason == "tool_calls" and [p.call.name for p in items[-1].tool_calls] == ["a"]


async def test_tool_call_tokens_are_text_without_tools(tokenizer):
    ids = _call_tokens(tokenizer, [("f", "{}")])
    text, end = await collect(tokenizer, [TokenEvent(i) for i in ids] + [DoneEvent("length", 100, 0, {})])
    assert end.finish_reason == "length" and not end.tool_calls
    assert text == "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"


async def test_a_call_cut_by_the_budget_is_length(tokenizer):
    ids = _call_tokens(tokenizer, [("f", '{"a": "long text"}')])[:-3]
    items = await items_of(tokenizer, [TokenEvent(i) for i in ids] + [DoneEvent("length", 100, 0, {})],
                           tools=True)
    # The call so far, as it was streamed; the arguments do not parse, and finish_reason says why.
    assert items[-1].finish_reason == "length"
    [partial] = items[-1].tool_calls
    assert partial.call.name == "f" and partial.call.arguments == "".join(
        d.arguments for i in items[:-1] for d in i.tool_calls)


async def test_thinking_splits_reasoning_from_content(tokenizer):
    reasoning, answer = tokenizer.encode_text("2+2 is 4."), tokenizer.encode_text("Four.")
    ids = reasoning + [tokenizer.template.think_end] + answer + [tokenizer.special.eos]
    items = await items_of(tokenizer, [TokenEvent(i) for i in ids] + [DoneEvent("stop", 100, 0, {})],
                           thinking=True)
    assert "".join(i.reasoning for i in items[:-1]) == "2+2 is 4."
    assert "".join(i.text for i in items[:-1]) == "Four."
    assert items[-1].content_ids == answer  # what the next turn re-sends (the reasoning is dropped)


async def test_logprobs_cover_each_content_token_once(tokenizer):
    ids = tokenizer.encode_text("a 🎉 b") + [tokenizer.special.eos]
    events = [TokenEvent(i, logprob=-0.5 * n, top_logprobs=((i, -0.5 * n), (7, -9.0)))
              for n, i in enumerate(ids)] + [DoneEvent("stop", 100, 0, {})]
    items = await items_of(tokenizer, events)
    streamed = [e for i in items[:-1] for e in i.logprobs] + list(items[-1].logprobs)
    assert [e.token_id for e in streamed] == ids[:-1]  # the end-of-sentence is not part of the text
    body = chat_logprobs(streamed, tokenizer)
    assert bytes(b for e in body["content"] for b in e["bytes"]) == "a 🎉 b".encode()
    assert body["content"][0]["top_logprobs"][1]["token"] == tokenizer.decode([7])
    assert any(e["token"].startswith("bytes:") for e in body["content"])  # a piece of the emoji
    legacy = completion_logprobs(streamed, tokenizer, 0)
    assert legacy["token_logprobs"] == [e.logprob for e in streamed] and legacy["text_offset"][0] == 0
    header = ResponseHeader("chatcmpl-1", 1, "deepseek-chat", "fp")
    validator("ChatCompletion").validate(chat_completion(header, "x", "stop", Usage(1, 1, 0), None, None, body))
    validator("Completion").validate(text_completion(header, "x", "stop", Usage(1, 1, 0), logprobs=legacy))
    validator("ChatCompletion").validate(chat_completion(
        header, "", "tool_calls", Usage(1, 1, 0), "thought", [{"id": "c", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]))
    validator("ChatCompletionChunk").validate(chat_chunk(header, {"tool_calls": tool_call_deltas(
        [ToolCallDelta(0, "c", "f", ""), ToolCallDelta(0, arguments="{}")])}, logprobs=body))


async def test_random_token_soup_never_breaks_the_parser_and_deltas_add_up(tokenizer):
    """Any id sequence (template tokens in any order, broken UTF-8, stop strings) parses without error,
    and the streamed deltas add up to what the end reports."""
    import random
    rng = random.Random(0)
    template = tokenizer.template
    alphabet = [t for t in template if t is not None] + tokenizer.encode_text('a{"x": 1}🎉 END') + [
        tokenizer.special.user, 0x8F]
    for case in range(300):
        ids = [rng.choice(alphabet) for _ in range(rng.randint(0, 40))]
        events = [TokenEvent(i) for i in ids] + [DoneEvent(rng.choice(["stop", "length"]), 100, 0, {})]
        items = await items_of(tokenizer, events or [DoneEvent("stop", 100, 0, {})], stops=("END",),
                               thinking=case % 3 == 0, tools=case % 2 == 0, parallel=case % 5 != 0)
        end = items[-1]
        assert end.finish_reason in ("stop", "length", "tool_calls")
        streamed: dict[int, str] = {}
        for item in items[:-1]:
            for delta in item.tool_calls:
                streamed[delta.index] = streamed.get(delta.index, "") + delta.arguments
        assert [streamed.get(i, "") for i in range(len(end.tool_calls))] == [p.call.arguments for p in end.tool_calls]
        assert "END" not in "".join(i.text for i in items[:-1])
