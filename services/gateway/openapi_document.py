"""The OpenAPI 3.1 document served at /openapi.json.

It states exactly what openai_requests.py accepts (a test checks that on many bodies), so that
a schema-driven fuzzer's notion of a valid request is the gateway's.
"""
from __future__ import annotations

from services.gateway.openai_requests import MAX_STOP_STRINGS, RETENTION_CLASSES, SEED_RANGE


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
        "type": "object",
        "properties": {"include_usage": _nullable({"type": "boolean"})},
        "description": "Only allowed when stream is true.",
    }),
    "user": _nullable({"type": "string"}),
    "retention": _nullable({"type": "string", "enum": list(RETENTION_CLASSES),
                            "description": "Extension: how long the prompt's cache is kept."}),
}

# stream_options (when not null) requires stream: true.
_STREAM_OPTIONS_NEED_STREAM = {
    "if": {"required": ["stream_options"],
           "properties": {"stream_options": {"type": "object"}}},
    "then": {"required": ["stream"], "properties": {"stream": {"const": True}}},
}


def _request_schemas(vocab_size: int, served_model: str) -> dict:
    # Any other model name is answered 404 model_not_found, as OpenAI does.
    model = {"type": "string", "enum": [served_model]}
    token_ids = {"type": "array", "minItems": 1,
                 "items": {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}}
    return {
        "TextPart": {
            "type": "object", "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
        },
        "ChatMessage": {
            "type": "object", "required": ["role"],
            "properties": {
                "role": {"type": "string", "enum": ["system", "user", "assistant"]},
                "content": {"anyOf": [{"type": "string"},
                                      {"type": "array", "items": _ref("TextPart")},
                                      {"type": "null"}]},
            },
            # Only an assistant message may leave its content out or null.
            "if": {"properties": {"role": {"const": "assistant"}}},
            "else": {"required": ["content"],
                     "properties": {"content": {"type": ["string", "array"]}}},
        },
        "ChatCompletionRequest": {
            "type": "object", "required": ["model", "messages"],
            "properties": {"model": model,
                           "messages": {"type": "array", "minItems": 1,
                                        "items": _ref("ChatMessage")},
                           **_SAMPLING_PROPERTIES},
            **_STREAM_OPTIONS_NEED_STREAM,
        },
        "CompletionRequest": {
            "type": "object", "required": ["model", "prompt"],
            "properties": {
                "model": model,
                "prompt": {"oneOf": [
                    {"type": "string"},
                    token_ids,
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "string"}},
                    {"type": "array", "minItems": 1, "maxItems": 1, "items": token_ids},
                ], "description": "One prompt: text, or token ids used as they are."},
                "echo": _nullable({"type": "boolean", "const": False}),
                **_SAMPLING_PROPERTIES,
            },
            **_STREAM_OPTIONS_NEED_STREAM,
        },
    }


def _closed(properties: dict, required: list[str] | None = None) -> dict:
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


_FINISH_REASON = {"type": "string", "enum": ["stop", "length"]}

_RESPONSE_SCHEMAS = {
    "Usage": _closed({
        "prompt_tokens": _COUNT, "completion_tokens": _COUNT, "total_tokens": _COUNT,
        "prompt_cache_hit_tokens": _COUNT, "prompt_cache_miss_tokens": _COUNT,
        "prompt_tokens_details": _closed({"cached_tokens": _COUNT}),
    }),
    "ChatCompletion": _closed({
        "id": {"type": "string"}, "object": {"const": "chat.completion"},
        "created": _COUNT, "model": {"type": "string"},
        "choices": {"type": "array", "minItems": 1, "maxItems": 1, "items": _closed({
            "index": {"const": 0},
            "message": _closed({"role": {"const": "assistant"}, "content": {"type": "string"}}),
            "logprobs": {"type": "null"},
            "finish_reason": _FINISH_REASON,
        })},
        "usage": _ref("Usage"),
    }),
    "ChatCompletionChunk": _closed({
        "id": {"type": "string"}, "object": {"const": "chat.completion.chunk"},
        "created": _COUNT, "model": {"type": "string"},
        "choices": {"type": "array", "maxItems": 1, "items": _closed({
            "index": {"const": 0},
            "delta": _closed({"role": {"const": "assistant"}, "content": {"type": "string"}},
                             required=[]),
            "logprobs": {"type": "null"},
            "finish_reason": _nullable(_FINISH_REASON),
        })},
        "usage": _nullable(_ref("Usage")),
    }, required=["id", "object", "created", "model", "choices"]),
    "Completion": _closed({
        "id": {"type": "string"}, "object": {"const": "text_completion"},
        "created": _COUNT, "model": {"type": "string"},
        "choices": {"type": "array", "maxItems": 1, "items": _closed({
            "index": {"const": 0}, "text": {"type": "string"}, "logprobs": {"type": "null"},
            "finish_reason": _nullable(_FINISH_REASON),
        })},
        "usage": _nullable(_ref("Usage")),
    }, required=["id", "object", "created", "model", "choices"]),
    "ModelList": _closed({
        "object": {"const": "list"},
        "data": {"type": "array", "items": _closed({
            "id": {"type": "string"}, "object": {"const": "model"}, "created": _COUNT,
            "owned_by": {"type": "string"},
        })},
    }),
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


def openapi_document(vocab_size: int, served_model: str) -> dict:
    return {
        "openapi": "3.1.0",
        "info": {"title": "DeepInfer gateway", "version": "0.1.0",
                 "description": "OpenAI/DeepSeek-compatible API. Usage reports prompt-cache hits."},
        "paths": {
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest",
                                                "ChatCompletion", "ChatCompletionChunk"),
            "/v1/completions": _generation("Text completion", "CompletionRequest", "Completion",
                                           "Completion"),
            "/v1/models": {"get": {"summary": "Served models",
                                   "responses": {"200": {"description": "OK", "content": {
                                       "application/json": {"schema": _ref("ModelList")}}},
                                                 "401": _ERRORS["401"]}}},
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
            "schemas": {**_request_schemas(vocab_size, served_model), **_RESPONSE_SCHEMAS},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}],
    }
