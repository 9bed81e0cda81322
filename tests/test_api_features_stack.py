"""The DeepSeek API's structured features end to end: the real stack (tiny preset, random weights, real
processes), driven with the official openai client. One stack for the whole module.

With random weights the model never calls a tool or writes JSON on its own: every valid structure here
is the grammar's doing (llguidance masks in the engine's sampler), at temperature 1.
"""
import json

import jsonschema
import pytest
from openai import OpenAI

from services.gateway.chat_template import ChatMessage, render_chat, render_fill_in_middle, tools_prompt
from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import shared_tokenizer
from tests.stack_probes import admin_stats, start_tiny_stack, wait_for_saves

B = 64
SEEDS = range(20)
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "days", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 12},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7},
                                  "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["zone"], "additionalProperties": False,
                                       "properties": {"zone": {"type": "string", "maxLength": 6}}}}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b"]}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_tiny_stack(tmp_path_factory.mktemp("api-features"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(stack):
    return OpenAI(base_url=stack.gateway_url + "/v1", api_key="key-a", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def cache():
    return TokenCache(shared_tokenizer(), 64 << 20)


def _validate_call(call, tool):
    assert call.type == "function" and call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_required_tool_call_always_parses_and_matches_its_schema(client):
    for seed in SEEDS:
        reply = client.chat.completions.create(model="deepseek-chat", messages=ASK, tools=[WEATHER, CLOCK],
                                               tool_choice="required", parallel_tool_calls=False,
                                               temperature=1, seed=seed, max_tokens=96)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (seed, choice)
        [call] = choice.message.tool_calls
        _validate_call(call, WEATHER if call.function.name == "get_weather" else CLOCK)


def test_named_tool_choice_calls_that_tool(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="deepseek-chat", messages=ASK, tools=[WEATHER, CLOCK], temperature=1, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=64)
        [call] = reply.choices[0].message.tool_calls
        _validate_call(call, CLOCK)


def test_tool_choice_none_keeps_the_model_from_calling(client):
    calls_begin = shared_tokenizer().template.tool_calls_begin
    # Even a +100 bias on <｜tool▁calls▁begin｜> cannot start a call: "none" bans the token.
    reply = client.chat.completions.create(model="deepseek-chat", messages=ASK, tools=[WEATHER],
                                           tool_choice="none", temperature=0, max_tokens=4,
                                           logit_bias={str(calls_begin): 100})
    assert reply.choices[0].message.tool_calls is None
    assert "tool▁calls▁begin" not in reply.choices[0].message.content


def test_streamed_tool_call_deltas_assemble_to_the_unstreamed_call(client):
    kwargs = dict(model="deepseek-chat", messages=ASK, tools=[WEATHER], tool_choice="required",
                  temperature=1, seed=7, max_tokens=96)
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id:
                    call["id"], call["name"] = delta.id, delta.function.name
                call["arguments"] += delta.function.arguments or ""
    assert finish == whole.finish_reason == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


def test_json_schema_output_always_validates(client):
    for seed in SEEDS:
        reply = client.chat.completions.create(
            model="deepseek-chat", messages=[{"role": "user", "content": "A person, as JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "person", "strict": True,
                                                                    "schema": PERSON}},
            temperature=1, seed=seed, max_tokens=64)
        assert reply.choices[0].finish_reason == "stop", (seed, reply.choices[0])
        jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_a_budget_below_the_smallest_instance_says_length(client):
    reply = client.chat.completions.create(
        model="deepseek-chat", messages=[{"role": "user", "content": "A person, as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        temperature=1, seed=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(reply.choices[0].message.content)


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400_naming_its_field(client):
    import openai
    unknown_format = {"type": "object", "properties": {"a": {"type": "string", "format": "no-such-format"}}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="deepseek-chat", messages=ASK, max_tokens=8, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": unknown_format}})
    assert caught.value.param == "response_format" and "no-such-format" in caught.value.message
    tool = {"type": "function", "function": {"name": "f", "parameters": unknown_format}}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="deepseek-chat", messages=ASK, max_tokens=8, tools=[tool],
                                       tool_choice="required")
    assert caught.value.param == "tools"


def test_json_object_output_parses(client):
    for seed in range(3):
        reply = client.chat.completions.create(
            model="deepseek-chat", messages=[{"role": "user", "content": "JSON please"}],
            response_format={"type": "json_object"}, temperature=1, seed=seed, max_tokens=48)
        if reply.choices[0].finish_reason == "stop":
            assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_logprobs_agree_between_stream_and_whole(client, stack):
    kwargs = dict(model="deepseek-chat", messages=[{"role": "user", "content": "Count to five."}],
                  temperature=0, max_tokens=12, logprobs=True, top_logprobs=5)
    whole = client.chat.completions.create(**kwargs)
    entries = whole.choices[0].logprobs.content
    streamed = [e for chunk in client.chat.completions.create(stream=True, **kwargs)
                for choice in chunk.choices if choice.logprobs for e in choice.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries] and entries
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in entries], abs=1e-5)
    assert bytes(b for e in entries for b in e.bytes).decode("utf-8", "replace") == whole.choices[0].message.content
    for entry in entries:  # greedy: the chosen token is the likeliest, and probabilities sum to at most 1
        assert len(entry.top_logprobs) == 5
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        assert sum(2.718281828 ** t.logprob for t in entry.top_logprobs) <= 1 + 1e-4
    assert whole.system_fingerprint == admin_stats(stack.engine_urls[0])["fingerprint"]
    legacy = client.completions.create(model="deepseek-chat", prompt="Count to five.", temperature=0,
                                       max_tokens=6, logprobs=3)
    assert len(legacy.choices[0].logprobs.tokens) == len(legacy.choices[0].logprobs.top_logprobs) > 0


def test_logit_bias_makes_greedy_pick_the_token(client):
    token = shared_tokenizer().encode_text(" banana")[0]
    reply = client.chat.completions.create(model="deepseek-chat", messages=ASK, temperature=0, max_tokens=5,
                                           logit_bias={str(token): 100}, logprobs=True)
    assert reply.choices[0].message.content == shared_tokenizer().decode([token]) * 5
    # The chosen token's logprob is the model's own (before the bias), far from the biased ~0.
    assert all(e.logprob < -1 for e in reply.choices[0].logprobs.content)


def test_penalties_push_greedy_away_from_repeats(client):
    """A +10 bias makes greedy repeat one token; presence and frequency penalties (subtracted from the
    logit of a token once it has appeared, and per appearance) stop the repeats. Greedy: no randomness."""
    token = shared_tokenizer().encode_text(" banana")[0]
    kwargs = dict(model="deepseek-chat", messages=ASK, temperature=0, max_tokens=16, logprobs=True,
                  logit_bias={str(token): 10})
    def picks(**penalties):
        reply = client.chat.completions.create(**kwargs, **penalties)
        return sum(1 for e in reply.choices[0].logprobs.content if e.token == shared_tokenizer().decode([token]))
    plain = picks()
    assert plain == 16
    assert picks(frequency_penalty=2) < plain
    assert 1 <= picks(presence_penalty=2, frequency_penalty=2) <= picks(frequency_penalty=2)


def test_fim_and_prefix_completion_render_deepseeks_tokens(client, stack, cache):
    beta = OpenAI(base_url=stack.gateway_url + "/beta", api_key="key-a", max_retries=0, timeout=300)
    prefix, suffix = "def add(a, b):\n", "\n    return c\n"
    fim = beta.completions.create(model="deepseek-chat", prompt=prefix, suffix=suffix, max_tokens=4, temperature=0)
    assert fim.usage.prompt_tokens == len(render_fill_in_middle(prefix, suffix, cache))
    messages = [{"role": "user", "content": "Write a haiku"},
                {"role": "assistant", "content": "Autumn moon", "prefix": True}]
    for api in (beta, OpenAI(base_url=stack.gateway_url + "/v1", api_key="key-a", max_retries=0)):
        reply = api.chat.completions.create(model="deepseek-chat", messages=messages, max_tokens=4, temperature=0)
        rendered = render_chat([ChatMessage("user", "Write a haiku"),
                                ChatMessage("assistant", "Autumn moon", prefix=True)], cache)
        assert reply.usage.prompt_tokens == len(rendered)
        assert not reply.choices[0].message.content.startswith("Autumn moon")  # only the continuation


def test_thinking_mode_returns_reasoning_apart_from_content(client):
    reply = client.chat.completions.create(model="deepseek-reasoner", messages=ASK, max_tokens=8, temperature=0)
    message = reply.choices[0].message
    assert isinstance(message.reasoning_content, str)
    assert message.reasoning_content + message.content  # with random weights, mostly reasoning
    chunks = list(client.chat.completions.create(model="deepseek-chat", messages=ASK, max_tokens=8,
                                                 temperature=0, stream=True,
                                                 extra_body={"thinking": {"type": "enabled"}}))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == message.reasoning_content


def test_thinking_turns_hit_the_previous_prompt(client, stack):
    """DeepSeek's template drops an earlier turn's reasoning (its <think> becomes </think>), so the next
    turn hits the previous prompt up to that token, block-aligned, and nothing of the previous answer."""
    messages = [{"role": "system", "content": "Think step by step. " * 20}, ASK[0]]
    first = client.chat.completions.create(model="deepseek-reasoner", messages=messages, max_tokens=8, temperature=0)
    wait_for_saves(stack)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "And tomorrow?"}]
    second = client.chat.completions.create(model="deepseek-reasoner", messages=messages, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > B
    assert second.usage.prompt_tokens_details.cached_tokens == (first.usage.prompt_tokens - 1) // B * B


def _system_prompt_ending_near_a_block_boundary(cache, tools: str) -> str:
    """A system prompt whose first-turn prompt ends 4 tokens before a block boundary, so that the
    tool call (at least 6 tokens) crosses into the next block."""
    words = "Use the tools. "
    while True:
        prompt = render_chat([ChatMessage("system", words), ChatMessage("user", ASK[0]["content"])], cache, tools)
        if len(prompt) % B == B - 4 and len(prompt) > B:
            return words
        words += "x"


def test_multi_turn_tool_conversation_hits_everything_before_the_newest_tool_result(client, stack, cache):
    system = _system_prompt_ending_near_a_block_boundary(cache, tools_prompt([WEATHER]))
    messages = [{"role": "system", "content": system}, ASK[0]]
    first = client.chat.completions.create(model="deepseek-chat", messages=messages, tools=[WEATHER],
                                           tool_choice="required", temperature=1, seed=3, max_tokens=96)
    assert first.choices[0].finish_reason == "tool_calls"
    wait_for_saves(stack)
    calls = first.choices[0].message.tool_calls  # parallel calls allowed: one or more
    messages.append({"role": "assistant", "content": None, "tool_calls": [
        {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": c.function.arguments}}
        for c in calls]})
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"forecast": "sunny", "high": 21}'}
                 for c in calls]
    second = client.chat.completions.create(model="deepseek-chat", messages=messages, tools=[WEATHER],
                                            temperature=0, max_tokens=4)
    # The engine saved the first prompt and every answer token fed back through the model (all but
    # the last); the second prompt repeats them exactly, then adds <｜end▁of▁sentence｜> and the result.
    saved = first.usage.prompt_tokens + first.usage.completion_tokens - 1
    expected = min(saved // B, (second.usage.prompt_tokens - 1) // B) * B
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert expected > first.usage.prompt_tokens // B * B  # the hit reaches into the tool call
