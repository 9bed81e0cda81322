"""The engine's internal API as an OpenAPI 3.1 document, served at GET /openapi.json (service token): what
parse_job accepts, so that a schema-driven fuzzer's notion of a valid job is the engine's."""
from __future__ import annotations

from services.common.openapi import token_id_pattern

INT31 = 1 << 31  # bounds token ids, max_tokens and top_k (far beyond any vocabulary or context)
INT63 = 1 << 63  # bounds seeds (OpenAI's seed is an int64) and the ints of a hit's segment runs
RETENTION_CLASSES = ("chat", "agent")


def _error(description: str, schema: str = "Error") -> dict:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}}}


_AUTH_ERRORS = {"401": _error("No bearer token.", "AuthError"), "403": _error("Wrong token.", "AuthError")}


def _plain(summary: str, content_type: str, secured: bool) -> dict:
    operation = {"summary": summary, "responses": {"200": {"description": "OK", "content": {content_type: {}}}}}
    if secured:
        operation["responses"] |= _AUTH_ERRORS
    else:
        operation["security"] = []
    return {"get": operation}


def _job(vocab_size: int, max_context: int) -> dict:
    token = {"type": "integer", "minimum": 0, "maximum": vocab_size - 1}
    run = {"type": "object", "additionalProperties": False,
           "required": ["volume", "segment", "first", "count", "n_blocks", "data_offset"],
           "properties": {"volume": {"type": "string", "pattern": "^[0-9a-f]{16}$"},
                          "segment": {"type": "string", "pattern": "^[0-9a-f]{32}$"},
                          "first": {"type": "integer", "minimum": 0, "maximum": INT63 - 1},
                          "count": {"type": "integer", "minimum": 1, "maximum": INT63 - 1},
                          "n_blocks": {"type": "integer", "minimum": 0, "maximum": INT63 - 1},
                          "data_offset": {"type": "integer", "minimum": 0, "maximum": INT63 - 1}}}
    return {
        "type": "object", "required": ["tokens"],
        "description": "A generation job from the gateway. The prompt plus max_tokens must fit the context.",
        "properties": {
            "tokens": {"type": "array", "items": token, "minItems": 1, "maxItems": max_context - 1},
            "request_id": {"type": "string", "maxLength": 200},
            "tenant": {"type": "string"},
            "tenant_salt": {"type": "string", "pattern": "^(?:[0-9a-f]{32})?$"},
            "retention": {"type": "string", "enum": list(RETENTION_CLASSES)},
            "save_blocks": {"type": "integer", "minimum": 0, "maximum": INT31 - 1,
                            "description": "admission: how many leading full blocks the engine may write to disk"},
            "handoff": {"type": "boolean", "description": "a split request's prefill: stop after the first token; "
                        "`done` (finish_reason handoff) comes once the prompt's blocks are saved, with handoff_blocks"},
            "generated": {"type": "array", "items": token, "maxItems": 1,
                          "description": "the first token a prefill engine sampled: decoding goes on after it "
                                         "(then max_tokens >= 2, no handoff)"},
            "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": INT31 - 1}},
            "max_tokens": {"type": "integer", "minimum": 1, "maximum": INT31 - 1},
            "temperature": {"type": "number", "minimum": 0, "maximum": 2},
            "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
            "top_k": {"type": "integer", "minimum": 0, "maximum": INT31 - 1},
            "seed": {"type": "integer", "minimum": -INT63, "maximum": INT63 - 1},
            "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
            "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
            "logit_bias": {"type": "object", "maxProperties": 300, "propertyNames": {"pattern": token_id_pattern(vocab_size)},
                           "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                           "description": "token id (decimal, below the vocabulary size) -> added to its logit"},
            "logprobs": {"type": ["integer", "null"], "minimum": 0, "maximum": 20,
                         "description": "k: token events carry the chosen token's logprob and the top k"},
            "grammar": {"description": "Constrains decoding; `done` then carries grammar_complete.", "oneOf": [
                {"type": "null"},
                {"type": "object", "required": ["type"], "properties": {"type": {"const": "json_object"}}},
                {"type": "object", "required": ["type", "schema"],
                 "properties": {"type": {"const": "json_schema"}, "schema": {"type": "object"}}},
                {"type": "object", "required": ["type", "grammar"],
                 "properties": {"type": {"const": "lark"}, "grammar": {"type": "string", "minLength": 1}}}]},
            "hit": {"type": "object", "required": ["blocks", "locations"],
                    "description": "The gateway's index lookup; stale or wrong locations are misses.",
                    "properties": {"blocks": {"type": "integer"}, "locations": {"type": "array", "items": run}}},
        },
    }


def engine_openapi_document(vocab_size: int, max_context: int) -> dict:
    """`vocab_size` and `max_context` (tokens) of the loaded model."""
    generate = {"post": {
        "summary": "Run one generation; NDJSON events: progress, token, done or error",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _job(vocab_size, max_context)}}},
        "responses": {
            "200": {"description": "A stream of JSON lines", "content": {"application/x-ndjson": {}}},
            "400": _error("Malformed job; `error.param` names the field."),
            **_AUTH_ERRORS,
            "503": _error("Loading, or the queue is full; see Retry-After."),
        }}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "DeepInfer engine (internal)", "version": "0.1.0",
                 "description": "Every operation but /healthz and /readyz needs `Authorization: Bearer <service "
                                "token>`; /admin/* the admin token."},
        "security": [{"bearer": []}],
        "paths": {
            "/internal/generate": generate,
            "/healthz": _plain("Alive", "application/json", secured=False),
            "/readyz": _plain("Ready once the model is loaded", "application/json", secured=False),
            "/metrics": _plain("Prometheus metrics (service or admin token)", "text/plain", secured=True),
            "/openapi.json": _plain("This document", "application/json", secured=True),
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {
                "AuthError": {"type": "object", "required": ["error"],
                              "properties": {"error": {"type": "string"}, "field": {"type": "string"}}},
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                "type": "object", "required": ["message"],
                "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                               "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}},
        },
    }
