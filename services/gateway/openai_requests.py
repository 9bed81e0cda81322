"""Parsing and validating OpenAI request bodies for /v1/chat/completions and /v1/completions.

Rules follow the OpenAI API: `null` means "not given", every error names the field at fault, and a
field the gateway does not know is refused (400 naming it), as OpenAI refuses an unrecognized
argument: nothing is silently ignored. The OpenAPI document (openapi_document.py) states the same
rules; a test checks the two agree.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.gateway.chat_template import ROLES, ChatMessage, ToolCall
from services.gateway.openai_errors import invalid
from services.gateway.structured_output import (Tool, ToolChoice, parse_response_format,
                                                parse_tool_choice, parse_tools, tool_call_grammar)

MAX_STOP_STRINGS = 4
RETENTION_CLASSES = ("chat", "agent")
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)
CONTENT_PART_SEPARATOR = "\n"  # how text parts of one message are joined, as vLLM does
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_TOP_LOGPROBS = 20
THINKING_TYPES = ("enabled", "disabled")
_SAMPLING_FIELDS = frozenset({
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "seed", "n",
    "stop", "stream", "stream_options", "user", "retention", "presence_penalty", "frequency_penalty",
    "logit_bias", "logprobs"})
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "top_logprobs", "tools", "tool_choice",
                                  "parallel_tool_calls", "response_format", "thinking"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "suffix", "echo"}
MESSAGE_FIELDS = {"system": {"role", "content"}, "user": {"role", "content"},
                  "assistant": {"role", "content", "tool_calls", "prefix"},
                  "tool": {"role", "content", "tool_call_id"}}


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int | None  # None: the gateway picks from the context left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled (an extension; OpenAI has no top_k)
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    logprobs: int | None = None  # None: none; k: the chosen token's logprob and the top k


@dataclass(frozen=True, slots=True)
class ChatCompletionRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    sampling: Sampling
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    retention: str = "chat"
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice("none")
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # the engine grammar of response_format, None for text
    thinking: bool | None = None  # None: as the model name says (deepseek-reasoner thinks)

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice.mode != "none"

    @property
    def forces_tool_call(self) -> bool:
        return self.tool_choice.mode in ("required", "function")


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids used as they are
    sampling: Sampling
    suffix: str | None = None  # fill in the middle between prompt and suffix
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    retention: str = "chat"


def parse_json_body(raw: bytes | bytearray) -> dict:
    def reject_constant(name: str) -> None:
        raise ValueError(f"{name} is not valid JSON")
    try:
        # Strict UTF-8 (RFC 8259): json.loads(bytes) decodes with surrogatepass, which lets
        # UTF-8-encoded surrogates (invalid UTF-8) through as text.
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte order mark may be ignored
    except UnicodeDecodeError as error:
        raise invalid(None, f"The request body is not valid UTF-8 (byte {error.start}).",
                      code="invalid_json") from None
    try:
        body = json.loads(text, parse_constant=reject_constant)
    except RecursionError:  # deeply nested arrays or objects; a 500 otherwise
        raise invalid(None, "The JSON body of your request is nested too deeply.",
                      code="invalid_json") from None
    except ValueError:
        raise invalid(None, "We could not parse the JSON body of your request. The body must be "
                            "a JSON object.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, "The request body must be a JSON object.", code="invalid_json")
    return body


def _string(body: dict, name: str, *, required: bool = False) -> str | None:
    value = body.get(name)
    if value is None:
        if required:
            raise invalid(name, f"Missing required parameter: '{name}'.", "missing_required_parameter")
        return None
    if not isinstance(value, str):
        raise invalid(name, f"Invalid type for '{name}': expected a string.", "invalid_type")
    return value


def _integer(body: dict, name: str, low: int | None = None, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    # JSON Schema counts 2.0 as an integer; bool is a subclass of int in Python but not in JSON.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise invalid(name, f"Invalid type for '{name}': expected an integer.", "invalid_type")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"at least {low}" if high is None else f"between {low} and {high}"
        raise invalid(name, f"Invalid '{name}': {value} is not {bounds}.", "invalid_value")
    return value


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False,
            param: str | None = None) -> float | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(param, f"Invalid type for '{param}': expected a number.", "invalid_type")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise invalid(param, f"Invalid '{param}': {value} is not in {interval}.", "invalid_value")
    return float(value)


def _boolean(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(param or name, f"Invalid type for '{param or name}': expected a boolean.",
                      "invalid_type")
    return value


def _refuse_unknown(body: dict, known: frozenset[str] | set[str], prefix: str = "") -> None:
    for name in body:
        if name not in known:
            raise invalid(prefix + name, f"Unrecognized request argument supplied: {prefix + name}.",
                          "unknown_parameter")


def _logit_bias(body: dict, vocab_size: int | None) -> tuple[tuple[int, float], ...]:
    value = body.get("logit_bias")
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise invalid("logit_bias", "Invalid type for 'logit_bias': expected an object mapping token "
                                    "ids to numbers.", "invalid_type")
    if len(value) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"Invalid 'logit_bias': at most {MAX_LOGIT_BIAS} entries.",
                      "invalid_value")
    bias = []
    for key in value:
        canonical = key.isascii() and key.isdigit() and len(key) < 10 and (key == "0" or key[0] != "0")
        token = int(key) if canonical else -1
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f" in [0, {vocab_size})" if vocab_size is not None else ""
            raise invalid("logit_bias", f"Invalid 'logit_bias': key {key!r} is not a token id{bound}.",
                          "invalid_value")
        bias.append((token, _number(value, key, -100.0, 100.0, param=f"logit_bias.{key}")))
    return tuple(bias)


def _sampling(body: dict, vocab_size: int | None = None, logprobs: int | None = None) -> Sampling:
    max_tokens = _integer(body, "max_tokens", low=1)
    max_completion_tokens = _integer(body, "max_completion_tokens", low=1)
    n = _integer(body, "n", low=1)
    if n is not None and n != 1:
        raise invalid("n", "Only n=1 is supported.", "invalid_value")
    temperature = _number(body, "temperature", 0.0, 2.0)
    top_p = _number(body, "top_p", 0.0, 1.0, low_open=True)
    top_k = _integer(body, "top_k", low=0)
    return Sampling(
        max_tokens=max_completion_tokens if max_completion_tokens is not None else max_tokens,
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or 0,
        seed=_integer(body, "seed", *SEED_RANGE),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0) or 0.0,
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0) or 0.0,
        logit_bias=_logit_bias(body, vocab_size),
        logprobs=logprobs,
    )


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise invalid("stop", "Invalid type for 'stop': expected a string or an array of strings.",
                      "invalid_type")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"Invalid 'stop': at most {MAX_STOP_STRINGS} stop sequences.",
                      "invalid_value")
    for index, stop in enumerate(stops):
        param = "stop" if isinstance(value, str) else f"stop[{index}]"
        if not isinstance(stop, str):
            raise invalid(param, f"Invalid type for '{param}': expected a string.", "invalid_type")
        if not stop:
            raise invalid(param, f"Invalid '{param}': a stop sequence cannot be empty.",
                          "invalid_value")
    return tuple(stops)


def _streaming(body: dict) -> tuple[bool, bool]:
    stream = _boolean(body, "stream")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not isinstance(options, dict):
        raise invalid("stream_options", "Invalid type for 'stream_options': expected an object.",
                      "invalid_type")
    if not stream:
        raise invalid("stream_options", "The 'stream_options' parameter is only allowed when "
                                        "'stream' is enabled.", "invalid_value")
    _refuse_unknown(options, {"include_usage"}, "stream_options.")
    return stream, _boolean(options, "include_usage", "stream_options.include_usage")


def _retention(body: dict) -> str:
    retention = _string(body, "retention")
    if retention is None:
        return "chat"
    if retention not in RETENTION_CLASSES:
        raise invalid("retention", f"Invalid 'retention': expected one of {list(RETENTION_CLASSES)}.",
                      "invalid_value")
    return retention


def _content(message: dict, param: str) -> str:
    content = message.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{param}.content", f"Invalid type for '{param}.content': expected a string "
                                          "or an array of text parts.", "invalid_type")
    texts = []
    for part_index, part in enumerate(content):
        part_param = f"{param}.content[{part_index}]"
        if not isinstance(part, dict) or part.get("type") != "text":
            raise invalid(f"{part_param}.type", f"Invalid '{part_param}': only parts "
                          "{\"type\": \"text\", \"text\": ...} are supported.", "invalid_value")
        if not isinstance(part.get("text"), str):
            raise invalid(f"{part_param}.text", f"Invalid type for '{part_param}.text': expected "
                                                "a string.", "invalid_type")
        _refuse_unknown(part, {"type", "text"}, f"{part_param}.")
        texts.append(part["text"])
    return CONTENT_PART_SEPARATOR.join(texts)


def _tool_calls(message: dict, param: str) -> tuple[ToolCall, ...]:
    calls = message.get("tool_calls")
    if calls is None:
        return ()
    if not isinstance(calls, list):
        raise invalid(f"{param}.tool_calls", f"Invalid type for '{param}.tool_calls': expected an "
                                             "array.", "invalid_type")
    parsed = []
    for index, call in enumerate(calls):
        call_param = f"{param}.tool_calls[{index}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type") != "function" \
                or not isinstance(call.get("id"), str) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments"), str):
            raise invalid(call_param, f"Invalid '{call_param}': expected {{\"id\": string, \"type\": "
                          "\"function\", \"function\": {\"name\": string, \"arguments\": string}}.",
                          "invalid_value")
        _refuse_unknown(call, {"id", "type", "function"}, f"{call_param}.")
        _refuse_unknown(function, {"name", "arguments"}, f"{call_param}.function.")
        parsed.append(ToolCall(call["id"], function["name"], function["arguments"]))
    return tuple(parsed)


def _message(index: int, message: Any, last: bool) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(param, f"Invalid type for '{param}': expected an object.", "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{param}.role", f"Invalid value for '{param}.role': {role!r}. Supported "
                                       f"roles are {list(ROLES)}.", "invalid_value")
    _refuse_unknown(message, MESSAGE_FIELDS[role], f"{param}.")
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise invalid(f"{param}.tool_call_id", f"Invalid '{param}.tool_call_id': a tool message "
                      "needs the id (a string) of the call it answers.", "invalid_value")
    tool_calls = _tool_calls(message, param) if role == "assistant" else ()
    # The model continues a prefix only when it is the last message; an earlier one is a prefix
    # that an earlier turn completed, now history like any other answer.
    prefix = _boolean(message, "prefix", f"{param}.prefix") and last
    if prefix and tool_calls:
        raise invalid(f"{param}.prefix", f"Invalid '{param}.prefix': a message with tool_calls cannot "
                      "be a prefix to continue.", "invalid_value")
    if message.get("content") is None and role == "assistant":
        return ChatMessage(role, "", tool_calls, prefix)
    return ChatMessage(role, _content(message, param), tool_calls, prefix)


def _thinking(body: dict) -> bool | None:
    value = body.get("thinking")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in THINKING_TYPES or len(value) != 1:
        raise invalid("thinking", "Invalid 'thinking': expected {\"type\": \"enabled\"} or "
                                  "{\"type\": \"disabled\"}.", "invalid_value")
    return value["type"] == "enabled"


def _chat_logprobs(body: dict) -> int | None:
    wanted = _boolean(body, "logprobs")
    top = _integer(body, "top_logprobs", 0, MAX_TOP_LOGPROBS)
    if top is not None and not wanted:
        raise invalid("top_logprobs", "Invalid 'top_logprobs': 'logprobs' must be true to use "
                                      "'top_logprobs'.", "invalid_value")
    return (top or 0) if wanted else None


def parse_chat_completion(body: dict, vocab_size: int | None = None) -> ChatCompletionRequest:
    model = _string(body, "model", required=True)
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "Missing required parameter: 'messages'.",
                      "missing_required_parameter")
    if not isinstance(messages, list):
        raise invalid("messages", "Invalid type for 'messages': expected an array.", "invalid_type")
    if not messages:
        raise invalid("messages", "Invalid 'messages': empty array. Expected an array with "
                                  "minimum length 1.", "empty_array")
    parsed = tuple(_message(index, message, index == len(messages) - 1)
                   for index, message in enumerate(messages))
    _refuse_unknown(body, CHAT_FIELDS)
    stream, include_usage = _streaming(body)
    tools = parse_tools(body.get("tools"))
    tool_choice = parse_tool_choice(body.get("tool_choice"), tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise invalid("parallel_tool_calls", "Invalid type for 'parallel_tool_calls': expected a "
                                             "boolean.", "invalid_type")
    response_format = parse_response_format(body.get("response_format"))
    if response_format is not None and tool_choice.mode != "none":
        raise invalid("response_format", "Invalid 'response_format': JSON output cannot be combined "
                      "with tool calls; set tool_choice to 'none' or leave out 'tools'.", "invalid_value")
    if parsed[-1].prefix and (response_format is not None or tool_choice.mode in ("required", "function")):
        raise invalid(f"messages[{len(parsed) - 1}].prefix", "Invalid prefix: a prefix to continue "
                      "cannot be combined with a forced tool call or JSON output.", "invalid_value")
    return ChatCompletionRequest(model=model, messages=parsed,
                                 sampling=_sampling(body, vocab_size, _chat_logprobs(body)),
                                 stop=_stop(body), stream=stream, include_usage=include_usage,
                                 user=_string(body, "user"), retention=_retention(body),
                                 tools=tools, tool_choice=tool_choice,
                                 parallel_tool_calls=True if parallel is None else parallel,
                                 response_format=response_format, thinking=_thinking(body))


def engine_grammar(request: ChatCompletionRequest, template) -> dict | None:
    """The grammar the engine constrains decoding with, if any."""
    if request.forces_tool_call:
        return tool_call_grammar(request.tools, request.tool_choice, request.parallel_tool_calls,
                                 template)
    return request.response_format


def _prompt(body: dict, vocab_size: int) -> str | tuple[int, ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise invalid("prompt", "Missing required parameter: 'prompt'.", "missing_required_parameter")
    # A batch of one ([text] or [[ids]]) is one prompt; larger batches need n prompts per call.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise invalid("prompt", "Invalid 'prompt': expected a string or a non-empty array of "
                                "token ids (one prompt per request).", "invalid_value")
    tokens = []
    for index, token in enumerate(prompt):
        if isinstance(token, float) and token.is_integer():  # JSON Schema's integer allows 3.0
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise invalid(f"prompt[{index}]", f"Invalid 'prompt[{index}]': expected a token id "
                                              f"in [0, {vocab_size}).", "invalid_value")
        tokens.append(token)
    return tuple(tokens)


def parse_completion(body: dict, vocab_size: int) -> CompletionRequest:
    model = _string(body, "model", required=True)
    prompt = _prompt(body, vocab_size)
    _refuse_unknown(body, COMPLETION_FIELDS)
    suffix = _string(body, "suffix")
    if suffix is not None and not isinstance(prompt, str):
        raise invalid("suffix", "Invalid 'suffix': fill-in-the-middle needs a text prompt.",
                      "invalid_value")
    if _boolean(body, "echo"):
        raise invalid("echo", "Invalid 'echo': echo is not supported.", "unsupported_value")
    stream, include_usage = _streaming(body)
    logprobs = _integer(body, "logprobs", 0, MAX_TOP_LOGPROBS)
    return CompletionRequest(model=model, prompt=prompt, suffix=suffix,
                             sampling=_sampling(body, vocab_size, logprobs), stop=_stop(body),
                             stream=stream, include_usage=include_usage,
                             user=_string(body, "user"), retention=_retention(body))

