"""The OpenAPI 3.1 document served at /openapi.json.

It states exactly what openai_requests.py accepts (a test checks that on many bodies), so that
a schema-driven fuzzer's notion of a valid request is the gateway's.
"""
from __future__ import annotations

from services.common.openapi import token_id_pattern
from services.gateway.openai_requests import (MAX_LOGIT_BIAS, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS,
                                              RETENTION_CLASSES, SEED_RANGE)
from services.gateway.structured_output import MAX_TOOLS


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


_COUNT = {"type": "integer", "minimum": 0}

_SAMPLING_PROPERTIES = {
    "max_tokens": _nullable({"type": "integer", "minimum": 1,
                             "description": "Alias of max_completion_tokens."}),
    "max_completion_tokens": _nullable({"type": "integer", "minimum": 1,
                                        "description": "Most tokens to generate; cut to the "
                                                       "context left after the prompt."}),
    "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
    "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
    "top_k": _nullable({"type": "integer", "minimum": 0,
                        "description": "Extension: sample from the k likeliest tokens; 0 disables."}),
    "seed": _nullable({"type": "integer", "minimum": SEED_RANGE[0], "maximum": SEED_RANGE[1]}),
    "n": _nullable({"type": "integer", "minimum": 1, "maximum": 1}),
    "stop": _nullable({"oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "maxItems": MAX_STOP_STRINGS, "items": {"type": "string", "minLength": 1}},
    ]}),
    "stream": _nullable({"type": "boolean"}),
    "stream_options": _nullable({
        "type": "object", "additionalProperties": False,
        "properties": {"include_usage": _nullable({"type": "boolean"})},
        "description": "Only allowed when stream is true.",
    }),
    "user": _nullable({"type": "string"}),
    "retention": _nullable({"type": "string", "enum": list(RETENTION_CLASSES),
                            "description": "Extension: how long the prompt's cache is kept."}),
    "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
    "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                             "propertyNames": {"pattern": "^(0|[1-9][0-9]{0,8})$"},
                             "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                             "description": "Token id (a string) -> bias added to its logit."}),
}

_NAME = {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}


def _grammar_refused_when_thinking(reasoner: str | None) -> dict:
    """Thinking mode (thinking enabled, or the reasoner name without thinking disabled) takes no
    JSON output and no forced tool call."""
    thinking = [{"required": ["thinking"], "properties": {"thinking": {
        "type": "object", "properties": {"type": {"const": "enabled"}}}}}]
    if reasoner:
        thinking.append({"required": ["model"], "properties": {
            "model": {"const": reasoner},
            "thinking": {"not": {"type": "object", "properties": {"type": {"const": "disabled"}}}}}})
    grammar = {"anyOf": [_JSON_FORMAT, {"required": ["tool_choice"], "properties": {"tool_choice": {
        "anyOf": [{"const": "required"}, {"type": "object"}]}}}]}
    return {"if": {"anyOf": thinking}, "then": {"not": grammar}}


_TOOL_CHOICE_NEEDS_TOOLS = {
    "if": {"required": ["tool_choice"],
           "properties": {"tool_choice": {"anyOf": [{"const": "required"}, {"type": "object"}]}}},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}},
}
_TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"required": ["top_logprobs"], "properties": {"top_logprobs": {"type": "integer"}}},
    "then": {"required": ["logprobs"], "properties": {"logprobs": {"const": True}}},
}
_JSON_FORMAT = {"required": ["response_format"], "properties": {"response_format": {
    "type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}}}}
# JSON output needs tool calls off: tool_choice "none", or no tools and no tool_choice.
_JSON_OUTPUT_WITHOUT_TOOL_CALLS = {
    "if": _JSON_FORMAT,
    "then": {"anyOf": [
        {"required": ["tool_choice"], "properties": {"tool_choice": {"const": "none"}}},
        {"properties": {"tools": {"anyOf": [{"type": "null"}, {"maxItems": 0}]},
                        "tool_choice": {"type": "null"}}},
    ]},
}

# stream_options (when not null) requires stream: true.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"],
           "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _request_schemas(vocab_size: int, served_models: list[str]) -> dict:
    # Any other model name is answered 404 model_not_found, as OpenAI does.
    model = {"type": "string", "enum": list(served_models)}
    content = {"anyOf": [{"type": "string"}, {"type": "array", "items": _ref("TextPart")}]}
    sampling = dict(_SAMPLING_PROPERTIES)
    sampling["logit_bias"] = _nullable({**_SAMPLING_PROPERTIES["logit_bias"]["anyOf"][0],
                                        "propertyNames": {"pattern": token_id_pattern(vocab_size)}})
    token_ids = {"type": "array", "minItems": 1,
                 "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    return {
        "TextPart": {
            "type": "object", "required": ["type", "text"], "additionalProperties": False,
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        "ToolCallIn": {
            "type": "object", "required": ["id", "type", "function"], "additionalProperties": False,
            "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                           "function": {"type": "object", "required": ["name", "arguments"],
                                        "additionalProperties": False,
                                        "properties": {"name": {"type": "string"},
                                                       "arguments": {"type": "string"}}}},
        },
        "ChatMessage": {
            "type": "object", "required": ["role"],
            "properties": {"role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]}},
            "oneOf": [
                {"additionalProperties": False, "required": ["role", "content"],
                 "properties": {"role": {"enum": ["system", "user"]}, "content": content}},
                {"additionalProperties": False, "required": ["role", "content", "tool_call_id"],
                 "properties": {"role": {"const": "tool"}, "content": content,
                                "tool_call_id": {"type": "string"}}},
                {"additionalProperties": False,
                 "properties": {"role": {"const": "assistant"}, "content": _nullable(content),
                                "tool_calls": _nullable({"type": "array", "items": _ref("ToolCallIn")}),
                                "prefix": _nullable({"type": "boolean", "description":
                                                     "On the last message (without tool_calls): the "
                                                     "model continues this text. On an earlier message: "
                                                     "a prefix completed before, rendered as history."})},
                 "if": {"required": ["prefix"], "properties": {"prefix": {"const": True}}},
                 "then": {"properties": {"tool_calls": {"anyOf": [{"type": "null"}, {"maxItems": 0}]}}}},
            ],
        },
        "Tool": {
            "type": "object", "required": ["type", "function"], "additionalProperties": False,
            "properties": {"type": {"const": "function"}, "function": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {"name": _NAME, "description": _nullable({"type": "string"}),
                               "parameters": _nullable({"type": "object",
                                                        "description": "A JSON Schema of the arguments."}),
                               "strict": _nullable({"type": "boolean"})}}},
        },
        "ResponseFormat": {"oneOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"const": "json_schema"}, "json_schema": {
                 "type": "object", "required": ["name"],
                 "properties": {"name": _NAME, "description": {"type": "string"},
                                "schema": _nullable({"type": "object"}),
                                "strict": _nullable({"type": "boolean"})}}}},
        ]},
        "ChatCompletionRequest": {
            "type": "object", "required": ["model", "messages"], "additionalProperties": False,
            "properties": {
                "model": model,
                "messages": {"type": "array", "minItems": 1, "items": _ref("ChatMessage")},
                **sampling,
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
                "tools": _nullable({"type": "array", "maxItems": MAX_TOOLS, "items": _ref("Tool"),
                                    "description": "Function names must differ."}),
                "tool_choice": _nullable({"anyOf": [
                    {"type": "string", "enum": ["none", "auto", "required"]},
                    {"type": "object", "required": ["type", "function"],
                     "properties": {"type": {"const": "function"},
                                    "function": {"type": "object", "required": ["name"],
                                                 "properties": {"name": {"type": "string"}}}},
                     "description": "The name must be one of the tools'."}]}),
                "parallel_tool_calls": _nullable({"type": "boolean"}),
                "response_format": _nullable(_ref("ResponseFormat")),
                "thinking": _nullable({"type": "object", "required": ["type"], "additionalProperties": False,
                                       "properties": {"type": {"enum": ["enabled", "disabled"]}}}),
            },
            "allOf": [_STREAM_OPTIONS_NEED_STREAM, _TOOL_CHOICE_NEEDS_TOOLS, _TOP_LOGPROBS_NEED_LOGPROBS,
                      _JSON_OUTPUT_WITHOUT_TOOL_CALLS,
                      _grammar_refused_when_thinking(served_models[1] if len(served_models) > 1 else None)],
        },
        "CompletionRequest": {
            "type": "object", "required": ["model", "prompt"], "additionalProperties": False,
            "properties": {
                "model": model,
                "prompt": {"oneOf": [
                    {"type": "string"},
                    token_ids,
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": token_ids},
                ], "description": "One prompt: text, or token ids used as they are."},
                "suffix": _nullable({"type": "string", "description": "Fill in the middle between "
                                     "prompt and suffix (DeepSeek's FIM tokens); needs a text prompt."}),
                "echo": _nullable({"type": "boolean", "const": False}),
                **sampling,
                "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP_LOGPROBS}),
            },
            "allOf": [_STREAM_OPTIONS_NEED_STREAM, {
                "if": {"required": ["suffix"], "properties": {"suffix": {"type": "string"}}},
                "then": {"properties": {"prompt": {"anyOf": [
                    {"type": "string"},
                    {"type": "array", "items": {"type": "string"}}]}}}}],
        },
    }


def _closed(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


_FINISH_REASON = {"type": "string", "enum": ["stop", "length", "tool_calls"]}
_FINGERPRINT = {"type": ["string", "null"], "description": "The engine's model fingerprint."}
_TOKEN_LOGPROB = _closed({"token": {"type": "string"}, "logprob": {"type": "number"},
                          "bytes": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                               "maximum": 255}}})
_CHAT_LOGPROBS = _nullable(_closed({
    "content": {"type": "array", "items": _closed({
        "token": {"type": "string"}, "logprob": {"type": "number"},
        "bytes": {"type": "array", "items": {"type": "integer"}},
        "top_logprobs": {"type": "array", "items": _TOKEN_LOGPROB}})},
    "refusal": {"type": "null"}}))
_COMPLETION_LOGPROBS = _nullable(_closed({
    "tokens": {"type": "array", "items": {"type": "string"}},
    "token_logprobs": {"type": "array", "items": {"type": "number"}},
    "top_logprobs": {"type": "array", "items": {"type": "object",
                                                "additionalProperties": {"type": "number"}}},
    "text_offset": {"type": "array", "items": _COUNT}}))
_TOOL_CALL = _closed({"id": {"type": "string"}, "type": {"const": "function"},
                      "function": _closed({"name": {"type": "string"}, "arguments": {"type": "string"}})})
_TOOL_CALL_DELTA = _closed({
    "index": _COUNT, "id": {"type": "string"}, "type": {"const": "function"},
    "function": _closed({"name": {"type": "string"}, "arguments": {"type": "string"}}, required=[])},
    required=["index", "function"])

_RESPONSE_SCHEMAS = {
    "Usage": _closed({
        "prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT,
        "prompt_cache_hit_tokens": _COUNT, "prompt_cache_miss_tokens": _COUNT,
        "prompt_tokens_details": _closed({"cached_tokens": _COUNT}),
    }),
    "ChatCompletion": _closed({
        "id": {"type": "string"}, "object": {"const": "chat.completion"},
        "created": _COUNT, "model": {"type": "string"}, "system_fingerprint": _FINGERPRINT,
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": _closed({
            "index": {"const": 0},
            "message": _closed({"role": {"const": "assistant"},
                                "content": {"type": ["string", "null"]},
                                "reasoning_content": {"type": "string",
                                                      "description": "Thinking mode: the reasoning."},
                                "tool_calls": {"type": "array", "items": _TOOL_CALL}},
                               required=["role", "content"]),
            "logprobs": _CHAT_LOGPROBS,
            "finish_reason": _FINISH_REASON,
        })},
        "usage": _ref("Usage"),
    }),
    "ChatCompletionChunk": _closed({
        "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"},
        "created": _COUNT, "model": {"type": "string"}, "system_fingerprint": _FINGERPRINT,
        "choices": {"type": "array", "maxItems": 1, "items": _closed({
            "index": {"const": 0},
            "delta": _closed({"role": {"const": "assistant"}, "content": {"type": "string"},
                              "reasoning_content": {"type": "string"},
                              "tool_calls": {"type": "array", "items": _TOOL_CALL_DELTA}},
                             required=[]),
            "logprobs": _CHAT_LOGPROBS,
            "finish_reason": _nullable(_FINISH_REASON),
        })},
        "usage": _nullable(_ref("Usage")),
    }, required=["id", "object", "created", "model", "choices"]),
    "Completion": _closed({
        "id": {"type": "string"}, "object": {"const": "text_completion"},
        "created": _COUNT, "model": {"type": "string"}, "system_fingerprint": _FINGERPRINT,
        "choices": {"type": "array", "maxItems": 1, "items": _closed({
            "index": {"const": 0}, "text": {"type": "string"}, "logprobs": _COMPLETION_LOGPROBS,
            "finish_reason": _nullable(_FINISH_REASON),
        })},
        "usage": _nullable(_ref("Usage")),
    }, required=["id", "object", "created", "model", "choices"]),
    "Model": _closed({"id": {"type": "string"}, "object": {"const": "model"}, "created": _COUNT,
                      "owned_by": {"type": "string"}}),
    "ModelList": _closed({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}),
    "Error": _closed({"error": _closed({
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]},
    })}),
}


def _error(description: str) -> dict:
    return {"description": description,
            "content": {"application/json": {"schema": _ref("Error")}}}


_ERRORS = {
    "400": _error("Invalid request; `error.param` names the field."),
    "401": _error("Missing or unknown API key."),
    "404": _error("Unknown model."),
    "413": _error("Request body too large (longer than any prompt within the model's context)."),
    "429": _error("This API key's concurrent requests or tokens per minute are used up; see Retry-After."),
    "503": _error("No engine could take the request; see Retry-After."),
}


def _sse_event(chunk: str) -> dict:
    """One server-sent event (OpenAPI before 3.2 describes each event, not the stream)."""
    return {"type": "object", "required": ["data"],
            "properties": {
                "data": {"type": "string",
                         "description": f"One `{chunk}` object as JSON; an `Error` object if "
                                        "the engine fails mid-stream; `[DONE]` last."},
                "event": {"type": "string"}, "id": {"type": "string"},
                "retry": {"type": "integer"}}}


def _generation(summary: str, request: str, response: str, chunk: str) -> dict:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True,
                        "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": "The completion; with stream=true, server-sent events.",
                    "content": {"application/json": {"schema": _ref(response)},
                                "text/event-stream": {"schema": _sse_event(chunk)}}},
            **_ERRORS,
        },
    }}


def _plain(summary: str, content_type: str = "application/json", *, admin: bool = False,
           not_ready: bool = False) -> dict:
    operation = {"summary": summary, "security": [],
                 "responses": {"200": {"description": "OK", "content": {content_type: {}}}}}
    if not_ready:
        operation["responses"]["503"] = {"description": "Not ready",
                                         "content": {content_type: {}}}
    if admin:
        operation["security"] = [{"bearer": []}]
        operation["responses"]["401"] = _error("Missing or wrong admin token.")
    return {"get": operation}


def openapi_document(vocab_size: int, served_models: list[str] | str) -> dict:
    served_models = [served_models] if isinstance(served_models, str) else list(served_models)
    chat = _generation("Chat completion", "ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk")
    completion = _generation("Text completion (with suffix: fill in the middle)", "CompletionRequest",
                             "Completion", "Completion")
    return {
        "openapi": "3.1.0",
        "info": {"title": "DeepInfer gateway", "version": "0.1.0",
                 "description": "OpenAI/DeepSeek-compatible API. Usage reports prompt-cache hits."},
        "paths": {
            "/v1/chat/completions": chat,
            "/v1/completions": completion,
            "/beta/chat/completions": chat,  # DeepSeek's beta paths: the same operations
            "/beta/completions": completion,
            "/v1/models": {"get": {"summary": "Served models",
                                   "responses": {"200": {"description": "OK", "content": {
                                       "application/json": {"schema": _ref("ModelList")}}},
                                                 "401": _ERRORS["401"]}}},
            "/v1/models/{model}": {"get": {
                "summary": "One served model",
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "OK", "content": {
                    "application/json": {"schema": _ref("Model")}}},
                              "401": _ERRORS["401"], "404": _ERRORS["404"]}}},
            "/healthz": _plain("Alive", "text/plain"),
            "/readyz": _plain("Ready when at least one engine answers", not_ready=True),
            "/metrics": _plain("Prometheus metrics (with API keys: needs the admin token)", "text/plain",
                               admin=True),
            "/openapi.json": _plain("This document"),
            "/admin/stats": _plain("Engines, token cache and prefix lookup counters", admin=True),
            "/dashboard": _plain("The live dashboard page (its data needs the admin token)", "text/html"),
            "/admin/dashboard.json": _plain("The dashboard's data: the whole stack's counters", admin=True),
        },
        "components": {
            "schemas": {**_request_schemas(vocab_size, served_models), **_RESPONSE_SCHEMAS},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
