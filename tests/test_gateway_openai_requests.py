"""Request parsing: OpenAI's rules, errors naming the field, and agreement with /openapi.json."""
import json
import random

import jsonschema
import pytest

from services.gateway.chat_template import ChatMessage
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_requests import (engine_grammar, parse_chat_completion, parse_completion,
                                              parse_json_body)
from services.gateway.chat_template import ToolCall
from services.gateway.tokenizer import shared_tokenizer
from services.gateway.openapi_document import openapi_document

VOCAB = 129_280
SERVED = "m"


def chat(**fields):
    return {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}], **fields}


def error_of(call, *args) -> OpenAIError:
    with pytest.raises(OpenAIError) as caught:
        call(*args)
    assert caught.value.status == 400
    body = caught.value.body()["error"]
    assert body["type"] == "invalid_request_error" and body["message"]
    return caught.value


def test_full_chat_request():
    request = parse_chat_completion(chat(
        messages=[{"role": "system", "content": "be brief"},
                  {"role": "user", "content": [{"type": "text", "text": "a"},
                                               {"type": "text", "text": "b"}]},
                  {"role": "assistant", "content": None},
                  {"role": "user", "content": "ok"}],
        max_tokens=5, temperature=0, top_p=0.5, top_k=40, seed=7, stop=["\n\n", "END"],
        stream=True, stream_options={"include_usage": True}, n=1, user="u1"))
    assert request.messages == (ChatMessage("system", "be brief"), ChatMessage("user", "a\nb"),
                                ChatMessage("assistant", ""), ChatMessage("user", "ok"))
    assert (request.sampling.max_tokens, request.sampling.temperature, request.sampling.top_p,
            request.sampling.top_k, request.sampling.seed) == (5, 0.0, 0.5, 40, 7)
    assert request.stop == ("\n\n", "END") and request.stream and request.include_usage
    assert request.user == "u1" and request.retention == "chat"
    with pytest.raises(AttributeError):
        request.model = "other"  # frozen


def test_defaults_and_aliases():
    request = parse_chat_completion(chat(max_completion_tokens=9, max_tokens=3, stop="x"))
    assert request.sampling.max_tokens == 9 and request.stop == ("x",)
    plain = parse_chat_completion(chat(temperature=None, stream=None))
    assert (plain.sampling.temperature, plain.sampling.top_p, plain.sampling.max_tokens,
            plain.stream, plain.include_usage) == (1.0, 1.0, None, False, False)


@pytest.mark.parametrize("fields, param", [
    ({"model": None}, "model"),
    ({"model": 3}, "model"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "messages[0].name"),
    ({"some_future_field": 1}, "some_future_field"),
    ({"presence_penalty": 5}, "presence_penalty"),
    ({"frequency_penalty": -7}, "frequency_penalty"),
    ({"logit_bias": {"12": 101}}, "logit_bias.12"),
    ({"logit_bias": {"012": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "tools": [{"type": "function", "function": {"name": "f"}}]},
     "response_format"),
    ({"thinking": {"type": "maybe"}}, "thinking"),
    ({"messages": [{"role": "assistant", "content": "a", "prefix": True, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].prefix"),
    ({"messages": [{"role": "user", "content": "a"}, {"content": "b"}]}, "messages[1].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]},
     "messages[0].content[0].text"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.1}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"seed": 2 ** 63}, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": ["a", 1]}, "stop[1]"),
    ({"stop": ""}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"n": 2}, "n"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": []}, "stream_options"),
    ({"user": 1}, "user"),
    ({"retention": "forever"}, "retention"),
])
def test_chat_errors_name_the_field(fields, param):
    assert error_of(parse_chat_completion, chat(**fields)).param == param


def test_completion_prompts():
    assert parse_completion({"model": "m", "prompt": "x"}, VOCAB).prompt == "x"
    assert parse_completion({"model": "m", "prompt": ["x"]}, VOCAB).prompt == "x"
    assert parse_completion({"model": "m", "prompt": [1, 2]}, VOCAB).prompt == (1, 2)
    assert parse_completion({"model": "m", "prompt": [[3]]}, VOCAB).prompt == (3,)
    for prompt, param in [(None, "prompt"), ([], "prompt"), (["a", "b"], "prompt[0]"),
                          ([1, VOCAB], "prompt[1]"), ([-1], "prompt[0]"), ([True], "prompt[0]"),
                          (5, "prompt")]:
        assert error_of(parse_completion, {"model": "m", "prompt": prompt}, VOCAB).param == param
    assert error_of(parse_completion, {"model": "m", "prompt": "x", "echo": True}, VOCAB).param == "echo"


@pytest.mark.parametrize("raw", [b"", b"{", b"[1]", b"\"text\"", b"{\"a\": NaN}", b"\xff\xfe"])
def test_body_must_be_a_json_object(raw):
    assert error_of(parse_json_body, raw).code == "invalid_json"


def _validator(name: str):
    schemas = openapi_document(VOCAB, SERVED)["components"]["schemas"]
    root = {"components": {"schemas": schemas}, "$ref": f"#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(root)


VALUES = [None, True, False, 0, 1, -1, 2, 1.0, 0.5, 1.5, 2.5, 40, 2 ** 63, "", "x", "chat",
          [], ["a"], ["a", "b", "c", "d", "e"], [1, 2], [[1]], [""], {}, {"include_usage": True},
          {"include_usage": "no"}]
MESSAGES = [[], [{"role": "user", "content": "hi"}], [{"role": "assistant"}], [{"role": "user"}],
            [{"role": "system", "content": [{"type": "text", "text": "a"}]}],
            [{"role": "user", "content": [{"type": "image"}]}], [{"role": "tool", "content": "x"}],
            [{"role": "user", "content": None}], ["hi"], [{"role": "assistant", "content": 1}],
            [{"role": "user", "content": "x", "name": 5}],
            [{"role": "user", "content": [{"type": "text", "text": "a", "extra": 1}]}]]
FIELDS = ["model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed",
          "n", "stop", "stream", "stream_options", "user", "retention", "unknown"]


def _agrees(parse, validator, body) -> None:
    valid = validator.is_valid(body)
    try:
        # The app answers any model but the served one with 404, after parsing.
        accepted = parse(json.loads(json.dumps(body))).model == SERVED
    except OpenAIError:
        accepted = False
    assert accepted == valid, (body, list(validator.iter_errors(body))[:1])


def test_schema_and_parser_agree_on_chat_bodies():
    validator, rng = _validator("ChatCompletionRequest"), random.Random(0)
    for _ in range(3000):
        body = {"model": "m", "messages": rng.choice(MESSAGES)}
        for field in rng.sample(FIELDS, rng.randint(0, 4)):
            body[field] = rng.choice(VALUES)
        if rng.random() < 0.1:
            del body[rng.choice(["model", "messages"])]
        _agrees(parse_chat_completion, validator, body)


def test_schema_and_parser_agree_on_completion_bodies():
    validator, rng = _validator("CompletionRequest"), random.Random(1)
    prompts = VALUES + [[VOCAB - 1], [VOCAB], [[1, 2]], [[]], [["a"]], ["a"], [3.0, 4],
                        [[5.0]], [1.5]]
    for _ in range(3000):
        body = {"model": "m", "prompt": rng.choice(prompts)}
        for field in rng.sample(FIELDS + ["echo"], rng.randint(0, 4)):
            body[field] = rng.choice(VALUES)
        _agrees(lambda b: parse_completion(b, VOCAB), validator, body)


TOOL = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_structured_fields_parse():
    request = parse_chat_completion(chat(
        messages=[{"role": "user", "content": "weather?"},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "sunny"}]},
                  {"role": "assistant", "content": "It is", "prefix": True}],
        tools=[TOOL], tool_choice="auto", parallel_tool_calls=False, presence_penalty=-2,
        frequency_penalty=1.5, logit_bias={"0": -100, "129279": 100}, logprobs=True, top_logprobs=20,
        thinking={"type": "disabled"}), VOCAB)
    assert request.messages[1].tool_calls == (ToolCall("c1", "get_weather", "{}"),)
    assert request.messages[2].text == "sunny" and request.messages[3].prefix
    earlier = parse_chat_completion(chat(messages=[{"role": "assistant", "content": "a", "prefix": True},
                                                   {"role": "user", "content": "b"}]))
    assert not earlier.messages[0].prefix  # completed in an earlier turn: history
    assert request.tools[0].name == "get_weather" and request.tool_choice.mode == "auto"
    assert request.parses_tool_calls and not request.forces_tool_call and not request.parallel_tool_calls
    assert (request.sampling.presence_penalty, request.sampling.frequency_penalty) == (-2.0, 1.5)
    assert request.sampling.logit_bias == ((0, -100.0), (129279, 100.0)) and request.sampling.logprobs == 20
    assert request.thinking is False and engine_grammar(request, shared_tokenizer().template) is None
    assert error_of(parse_chat_completion, chat(logit_bias={"129280": 1}), VOCAB).param == "logit_bias"
    completion = parse_completion({"model": "m", "prompt": "def f(", "suffix": "\n", "logprobs": 0}, VOCAB)
    assert completion.suffix == "\n" and completion.sampling.logprobs == 0
    assert error_of(parse_completion, {"model": "m", "prompt": [1], "suffix": "x"}, VOCAB).param == "suffix"
    assert error_of(parse_completion, {"model": "m", "prompt": "x", "best_of": 2}, VOCAB).param == "best_of"


def test_forced_tool_calls_and_json_output_become_engine_grammars():
    template = shared_tokenizer().template
    other = {"type": "function", "function": {"name": "other"}}
    named = parse_chat_completion(chat(tools=[TOOL, other],
                                       tool_choice={"type": "function", "function": {"name": "other"}}))
    grammar = engine_grammar(named, template)
    assert grammar["type"] == "lark" and '"other"' in grammar["grammar"] and "get_weather" not in grammar["grammar"]
    assert f"<[{template.tool_calls_begin}]> call <[{template.tool_calls_end}]>" in grammar["grammar"]
    required = engine_grammar(parse_chat_completion(chat(tools=[TOOL, other], tool_choice="required")), template)
    assert "call+" in required["grammar"]  # parallel_tool_calls defaults to true
    assert '"whitespace_flexible": false' in required["grammar"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert engine_grammar(parse_chat_completion(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})), template) == {
        "type": "json_schema", "schema": schema}
    assert engine_grammar(parse_chat_completion(chat(response_format={"type": "json_object"})), template) == {
        "type": "json_object"}
    assert engine_grammar(parse_chat_completion(chat(response_format={"type": "text"})), template) is None
