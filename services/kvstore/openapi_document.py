"""The kvstore service's API as an OpenAPI 3.1 document, served at GET /openapi.json (with the
service token). Data bodies are msgpack maps (`application/msgpack`): their schemas describe the
decoded map, with bytes fields as `format: binary` (wire.py is the reference); errors are JSON.
A fuzzer cannot encode msgpack from these, so tests/test_kvstore_service.py fuzzes the bodies
with a property-based test instead."""
from __future__ import annotations

MSGPACK = "application/msgpack"

_BYTES16 = {"type": "string", "format": "binary", "description": "16 raw bytes (a block hash)"}
_U63 = {"type": "integer", "minimum": 0, "maximum": (1 << 63) - 1}
_MODEL = {
    "fingerprint": {"type": "string", "description": "must be the service's cache fingerprint"},
    "geometry": {"type": "object", "required": ["num_layers", "latent_dim", "block_tokens", "dtype"],
                 "properties": {"num_layers": _U63, "latent_dim": _U63, "block_tokens": _U63,
                                "dtype": {"type": "string"},
                                "fp8_dims": {**_U63, "description": "fp8 latent format: c_kv dims (absent: bf16)"}}},
}
_RUN = {"type": "array", "prefixItems": [{"type": "string", "pattern": "^[0-9a-f]{16}$"},
                                         {"type": "string", "pattern": "^[0-9a-f]{32}$"}, _U63, _U63, _U63, _U63],
        "minItems": 6, "maxItems": 6, "description": "[volume, segment, first, count, n_blocks, data_offset]"}


def _msgpack_body(required: list[str], properties: dict, description: str) -> dict:
    return {"required": True, "description": description, "content": {MSGPACK: {"schema": {
        "type": "object", "required": required, "properties": properties}}}}


def _responses(ok: dict, *extra: str) -> dict:
    error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    out = {"200": ok, "400": {"description": "Malformed; `field` names it", **error},
           "401": {"description": "No service token", **error}, "403": {"description": "Wrong service token", **error}}
    for status in extra:
        out[status] = {"description": {"404": "Unknown volume or segment", "413": "Body too large",
                                       "503": "The index (Redis) or a volume failed"}[status], **error}
    return out


def kvstore_openapi_document() -> dict:
    save = _msgpack_body(["fingerprint", "geometry", "hashes", "layers"], _MODEL | {
        "hashes": {"type": "array", "items": _BYTES16, "description": "the chain from block 0"},
        "start_block": _U63, "tenant": {"type": "string"}, "retention": {"type": "string", "enum": ["chat", "agent"]},
        "ttl_s": {"type": ["integer", "null"]},
        "layers": {"type": "array", "items": {"type": "string", "format": "binary"},
                   "description": "per layer, (new blocks x block_tokens) stored rows (latents in cache "
                                  "dtype, or fp8 rows), finite"}},
        "Save blocks start_block.. of a chain (durable and published when answered)")
    read = _msgpack_body(["fingerprint", "geometry", "root", "hashes", "runs", "layer"], _MODEL | {
        "root": _BYTES16, "hashes": {"type": "array", "items": _BYTES16}, "runs": {"type": "array", "items": _RUN},
        "layer": _U63}, "One verified layer of a hit")
    lookup = _msgpack_body(["hashes"], {"hashes": {"type": "array", "items": _BYTES16}}, "Longest cached prefix")
    json_ok = {"description": "OK", "content": {"application/json": {}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "DeepInfer kvstore (internal)", "version": "0.1.0",
                 "description": "Every operation but /healthz and /readyz needs `Authorization: Bearer <service "
                                "token>`; /admin/* the admin token. Request bodies are msgpack maps."},
        "security": [{"bearer": []}],
        "paths": {
            "/v1/segments": {"post": {"summary": "Save", "requestBody": save,
                                      "responses": _responses(json_ok, "413", "503")}},
            "/v1/read": {"post": {"summary": "Read a layer", "requestBody": read, "responses": _responses(
                {"description": "Raw latents of the valid blocks; X-Valid-Blocks says how many",
                 "content": {"application/octet-stream": {}}}, "404", "413", "503")}},
            "/v1/lookup": {"post": {"summary": "Lookup", "requestBody": lookup, "responses": _responses(
                {"description": "msgpack {root, hashes, runs}", "content": {MSGPACK: {}}}, "413", "503")}},
            "/v1/segments/{segment}": {"delete": {
                "summary": "Unpublish a segment (its bytes go after the reader grace)",
                "parameters": [{"name": "segment", "in": "path", "required": True,
                                "schema": {"type": "string", "pattern": "^[0-9a-f]{32}$"}}],
                "responses": _responses(json_ok, "404", "503")}},
            "/healthz": {"get": {"security": [], "responses": {"200": json_ok}}},
            "/readyz": {"get": {"security": [], "responses": {"200": json_ok, "503": json_ok}}},
            "/metrics": {"get": {"responses": {"200": {"description": "Prometheus text",
                                                       "content": {"text/plain": {}}}}}},
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
            "schemas": {"Error": {"type": "object", "required": ["error"],
                                  "properties": {"error": {"type": "string"}, "field": {"type": "string"}}}},
        },
    }
