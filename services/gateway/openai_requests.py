"""Parsing and validating OpenAI request bodies for /v1/chat/completions and /v1/completions.

Rules follow the OpenAI API: unknown fields are ignored, `null` means "not given", every error
names the field at fault. The OpenAPI document (openapi_document.py) states the same rules; a
test checks the two agree.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from services.gateway.chat_template import ROLES, ChatMessage
from services.gateway.openai_errors import invalid

MAX_STOP_STRINGS = 4
RETENTION_CLASSES = ("chat", "agent")
SEED_RANGE = (-(2 ** 63), 2 ** 63 - 1)
CONTENT_PART_SEPARATOR = "\n"  # how text parts of one message are joined, as vLLM does


@dataclass(frozen=True, slots=True)
class Sampling:
    max_tokens: int | None  # None: the gateway picks from the context left
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: disabled (an extension; OpenAI has no top_k)
    seed: int | None = None


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


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    model: str
    prompt: str | tuple[int, ...]  # text, or token ids used as they are
    sampling: Sampling
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


def _number(body: dict, name: str, low: float, high: float, *, low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise invalid(name, f"Invalid type for '{name}': expected a number.", "invalid_type")
    if value > high or value < low or (low_open and value == low):
        interval = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise invalid(name, f"Invalid '{name}': {value} is not in {interval}.", "invalid_value")
    return float(value)


def _boolean(body: dict, name: str, param: str | None = None) -> bool:
    value = body.get(name)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise invalid(param or name, f"Invalid type for '{param or name}': expected a boolean.",
                      "invalid_type")
    return value


def _sampling(body: dict) -> Sampling:
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
    return stream, _boolean(options, "include_usage", "stream_options.include_usage")


def _retention(body: dict) -> str:
    retention = _string(body, "retention")
    if retention is None:
        return "chat"
    if retention not in RETENTION_CLASSES:
        raise invalid("retention", f"Invalid 'retention': expected one of {list(RETENTION_CLASSES)}.",
                      "invalid_value")
    return retention


def _message(index: int, message: Any) -> ChatMessage:
    param = f"messages[{index}]"
    if not isinstance(message, dict):
        raise invalid(param, f"Invalid type for '{param}': expected an object.", "invalid_type")
    role = message.get("role")
    if role not in ROLES:
        raise invalid(f"{param}.role", f"Invalid value for '{param}.role': {role!r}. Supported "
                                       f"roles are {list(ROLES)}.", "invalid_value")
    content = message.get("content")
    if content is None and role == "assistant":
        return ChatMessage(role, "")
    if isinstance(content, str):
        return ChatMessage(role, content)
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
        texts.append(part["text"])
    return ChatMessage(role, CONTENT_PART_SEPARATOR.join(texts))


def parse_chat_completion(body: dict) -> ChatCompletionRequest:
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
    parsed = tuple(_message(index, message) for index, message in enumerate(messages))
    stream, include_usage = _streaming(body)
    return ChatCompletionRequest(model=model, messages=parsed, sampling=_sampling(body),
                                 stop=_stop(body), stream=stream, include_usage=include_usage,
                                 user=_string(body, "user"), retention=_retention(body))


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
    if _boolean(body, "echo"):
        raise invalid("echo", "Invalid 'echo': echo is not supported.", "unsupported_value")
    stream, include_usage = _streaming(body)
    return CompletionRequest(model=model, prompt=prompt, sampling=_sampling(body), stop=_stop(body),
                             stream=stream, include_usage=include_usage,
                             user=_string(body, "user"), retention=_retention(body))

