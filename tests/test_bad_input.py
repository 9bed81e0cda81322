"""Bad input against the real stack (tiny preset, real processes, real HTTP).

A schemathesis run over the gateway's own /openapi.json finds no 5xx and no response that breaks
the document; hand-written hostile requests to the gateway and the kvstore service each get a clear
4xx naming the problem (or a clean cancel), and none of them writes a byte or an index key.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import jsonschema
import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from services.gateway.openapi_document import openapi_document
from tests.grammar_check import schema_compiles
from tests.stack_probes import (ADMIN_TOKEN, admin_stats, http, metric, start_tiny_stack, stored,
                                wait_for_saves, wait_until_idle)

KVSTORE_MAX_BODY_MIB = 4  # so the oversized case is 4 MiB, not the default 512 MiB
CHAT = {"model": "deepseek-chat", "max_tokens": 2, "temperature": 0,
        "messages": [{"role": "user", "content": "hello"}]}
FUZZ_MAX_TOKENS = 4  # keeps generated valid requests short: the default budget is the whole context
DOCUMENT = openapi_document(vocab_size=2, served_models=["deepseek-chat", "deepseek-reasoner"])  # the paths, for parametrize


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DEEPINFER_KVSTORE_MAX_BODY_MIB", str(KVSTORE_MAX_BODY_MIB))
        running = start_tiny_stack(tmp_path_factory.mktemp("bad-input"))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def gateway_schema(stack):
    return schemathesis.openapi.from_url(stack.gateway_url + "/openapi.json")


@pytest.fixture(scope="module")
def served_document(stack):
    return http("GET", stack.gateway_url + "/openapi.json").json()


def _validator(document: dict, name: str) -> jsonschema.Draft202012Validator:
    root = {"components": document["components"], "$ref": f"#/components/schemas/{name}"}
    return jsonschema.Draft202012Validator(root)


def _operations() -> list[tuple[str, str, GenerationMode]]:
    """Every operation positively; negatively where there is something to get wrong (a body or a key)."""
    out = []
    for path, item in DOCUMENT["paths"].items():
        for method, operation in item.items():
            out.append((method.upper(), path, GenerationMode.POSITIVE))
            if "requestBody" in operation or operation.get("security", DOCUMENT["security"]):
                out.append((method.upper(), path, GenerationMode.NEGATIVE))
    return out


def _beyond_the_document(body) -> bool:
    """Rules JSON Schema cannot state, which the document says in words: a named tool_choice names one
    of the tools, tool names differ, tool parameters are a JSON Schema, and every schema constrained
    decoding gets compiles. A body breaking one is a 400."""
    if not isinstance(body, dict):
        return False
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type") == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if schema is not None and not schema_compiles(schema):
            return True
    if not isinstance(body.get("tools"), list):
        return False
    names = [tool["function"]["name"] for tool in body["tools"]]
    choice = body.get("tool_choice")
    if isinstance(choice, dict) and choice["function"]["name"] not in names:
        return True
    if len(set(names)) != len(names):
        return True
    for tool in body["tools"]:
        try:
            jsonschema.Draft202012Validator.check_schema(tool["function"].get("parameters") or {})
        except jsonschema.SchemaError:
            return True
        if not schema_compiles(tool["function"].get("parameters") or {"type": "object", "properties": {}}):
            return True
    return False


def _check_sse(body: bytes, chunk: jsonschema.Draft202012Validator,
               error: jsonschema.Draft202012Validator) -> None:
    """Each event of a streamed answer is one chunk object (or an Error), `[DONE]` last."""
    events = [line[len("data: "):] for line in body.decode().split("\n\n") if line]
    assert events and events[-1] == "[DONE]", events[-3:]
    for event in events[:-1]:
        data = json.loads(event)
        (error if "error" in data else chunk).validate(data)


@pytest.mark.parametrize("method, path, mode", _operations(),
                         ids=lambda v: v.value if isinstance(v, GenerationMode) else str(v))
def test_schemathesis_finds_no_server_error_and_no_schema_violation(stack, gateway_schema, served_document,
                                                                    method, path, mode):
    operation = gateway_schema[path][method]
    request_body = DOCUMENT["paths"][path][method.lower()].get("requestBody")
    valid_body = None
    if request_body is not None:
        ref = request_body["content"]["application/json"]["schema"]["$ref"]
        valid_body = _validator(served_document, ref.rsplit("/", 1)[-1])
    chunk_name = "ChatCompletionChunk" if path.endswith("chat/completions") else "Completion"
    chunk, error = _validator(served_document, chunk_name), _validator(served_document, "Error")
    key = ADMIN_TOKEN if path.startswith("/admin/") else "key-a"
    statuses: dict[int, int] = {}

    @settings(max_examples=12 if valid_body else 6, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def run(case):
        body_is_valid = valid_body is not None and valid_body.is_valid(case.body)
        if body_is_valid:
            case.body["max_completion_tokens"] = min(case.body.get("max_completion_tokens")
                                                     or case.body.get("max_tokens") or FUZZ_MAX_TOKENS,
                                                     FUZZ_MAX_TOKENS)
        # Valid cases use a valid key; a negative case may be about the key itself, so it keeps its own.
        headers = {"Authorization": f"Bearer {key}"}
        if mode is GenerationMode.NEGATIVE and "Authorization" in (case.headers or {}):
            headers = None
        beyond = mode is GenerationMode.POSITIVE and body_is_valid and _beyond_the_document(case.body)
        response = case.call_and_validate(base_url=stack.gateway_url, headers=headers, timeout=60,
                                          excluded_checks=[positive_data_acceptance] if beyond else None)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        if mode is GenerationMode.POSITIVE and body_is_valid:
            assert response.status_code == (400 if beyond else 200), response.text[:500]
        if response.headers.get("Content-Type", "").startswith("text/event-stream"):
            _check_sse(response.content, chunk, error)

    run()
    assert statuses and max(statuses) < 500, statuses


def _post_gateway(stack, body: bytes | dict, key: str = "key-a", path: str = "/v1/chat/completions"):
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    return http("POST", stack.gateway_url + path, data,
                {"Authorization": f"Bearer {key}", "Content-Type": "application/json"})


def _error(reply) -> dict:
    body = reply.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"], body
    return body["error"]


LONG_TEXT = "hello " * 17_000  # over the tiny preset's 16,384-token context


@pytest.mark.parametrize("body, param, code", [
    (b"{nope", None, "invalid_json"),
    (b"", None, "invalid_json"),
    (b"[" * 100_000 + b"]" * 100_000, None, "invalid_json"),
    (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, None, "invalid_json"),
    (b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}', None, "invalid_json"),
    (b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "\xed\xa0\x80"}]}', None,
     "invalid_json"),  # a UTF-8-encoded surrogate is not UTF-8
    (b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "\xc0\xaf"}]}', None,
     "invalid_json"),  # an overlong encoding of "/"
    (CHAT | {"messages": "hi"}, "messages", "invalid_type"),
    (CHAT | {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "invalid_type"),
    (CHAT | {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type", "invalid_value"),
    (CHAT | {"messages": ["hi"]}, "messages[0]", "invalid_type"),
    (CHAT | {"temperature": "hot"}, "temperature", "invalid_type"),
    (CHAT | {"max_tokens": "5"}, "max_tokens", "invalid_type"),
    (CHAT | {"stream": "yes"}, "stream", "invalid_type"),
    (CHAT | {"stop": 5}, "stop", "invalid_type"),
    (CHAT | {"model": 5}, "model", "invalid_type"),
    (CHAT | {"seed": 1.5}, "seed", "invalid_type"),
    (CHAT | {"top_p": True}, "top_p", "invalid_type"),
    (CHAT | {"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id", "invalid_value"),
    (CHAT | {"messages": [{"role": "developer", "content": "x"}]}, "messages[0].role", "invalid_value"),
    (CHAT | {"frequency_penalty": -7}, "frequency_penalty", "invalid_value"),
    (CHAT | {"n_probs": 3}, "n_probs", "unknown_parameter"),
    (CHAT | {"messages": [{"role": "user", "content": "x"}, {"role": "bot", "content": "x"}]},
     "messages[1].role", "invalid_value"),
    (CHAT | {"messages": [{"content": "x"}]}, "messages[0].role", "invalid_value"),
    (CHAT | {"messages": []}, "messages", "empty_array"),
    ({"model": "deepseek-chat"}, "messages", "missing_required_parameter"),
    (CHAT | {"max_tokens": 0}, "max_tokens", "invalid_value"),
    (CHAT | {"max_tokens": -1}, "max_tokens", "invalid_value"),
    (CHAT | {"max_completion_tokens": 0}, "max_completion_tokens", "invalid_value"),
    (json.dumps(CHAT).replace('"max_tokens": 2', '"max_tokens": ' + "9" * 5000).encode(), None,
     "invalid_json"),  # past Python's int-parsing limit
    (CHAT | {"messages": [{"role": "user", "content": LONG_TEXT}]}, "messages", "context_length_exceeded"),
])
def test_gateway_rejects_bad_chat_requests_by_name(stack, body, param, code):
    wait_for_saves(stack)
    before = stored(stack)
    reply = _post_gateway(stack, body)
    assert reply.status == 400, reply
    error = _error(reply)
    assert (error["param"], error["code"], error["type"]) == (param, code, "invalid_request_error"), error
    wait_for_saves(stack)
    assert stored(stack) == before


@pytest.mark.parametrize("extra", [
    {"seed": -2 ** 63, "temperature": 1}, {"seed": 2 ** 63 - 1, "temperature": 1},
    {"top_k": 129_279, "temperature": 1}, {"top_k": 2 ** 62, "temperature": 1},
    {"top_p": 1e-300, "temperature": 1}, {"temperature": 2}, {"stop": ["\x00"]}, {"user": "u" * 100_000},
    {"messages": [{"role": "assistant"}]}, {"messages": [{"role": "user", "content": []}]},
    {"messages": [{"role": "user", "content": "\x00" * 1000}]},
], ids=lambda extra: json.dumps(extra)[:40])
def test_gateway_serves_edge_values_the_document_allows(stack, extra):
    reply = _post_gateway(stack, CHAT | extra)
    assert reply.status == 200, reply
    assert reply.json()["usage"]["completion_tokens"] == 2


def test_a_vanishing_temperature_is_greedy(stack):
    """1e-40 is a valid temperature; in float32 it is 0, and logits / 0 used to make every token '!'."""
    greedy = _post_gateway(stack, CHAT | {"max_tokens": 6, "temperature": 0}).json()
    for temperature in (1e-300, 5e-324, 1e-40, 1e-35):
        reply = _post_gateway(stack, CHAT | {"max_tokens": 6, "temperature": temperature}).json()
        assert reply["choices"][0]["message"] == greedy["choices"][0]["message"], temperature


def test_bad_completion_requests_and_bodies_write_nothing(stack):
    wait_for_saves(stack)
    before = stored(stack)
    reply = _post_gateway(stack, {"model": "deepseek-chat", "prompt": [5] * 16_384, "max_tokens": 1},
                          path="/v1/completions")
    assert reply.status == 400 and _error(reply)["param"] == "prompt", reply
    assert _error(reply)["code"] == "context_length_exceeded"
    reply = _post_gateway(stack, {"model": "deepseek-chat", "prompt": [5, -1]}, path="/v1/completions")
    assert reply.status == 400 and _error(reply)["param"] == "prompt[1]", reply
    reply = _post_gateway(stack, {"model": "deepseek-chat", "prompt": "x", "max_tokens": 0},
                          path="/v1/completions")
    assert reply.status == 400 and _error(reply)["param"] == "max_tokens", reply
    # Oversized: the gateway's real limit (64 MiB) plus one byte.
    big = b'{"model": "deepseek-chat", "messages": [{"role": "user", "content": "' + b"x" * (64 << 20) + b'"}]}'
    reply = _post_gateway(stack, big)
    assert reply.status == 413 and _error(reply)["code"] == "request_too_large", reply.body[:300]
    for body in (b"{nope", CHAT | {"messages": []}, CHAT | {"messages": [{"role": "user", "content": LONG_TEXT}]}):
        assert _post_gateway(stack, body).status == 400
    assert _post_gateway(stack, CHAT, key="key-unknown").status == 401
    assert _post_gateway(stack, CHAT | {"model": "gpt-4o"}).status == 404
    wait_for_saves(stack)
    assert stored(stack) == before


async def test_a_stream_closed_by_the_client_midway_is_cancelled_and_the_stack_stays_healthy(stack):
    """max_tokens far past the context is accepted (cut to what is left); the client leaves after a
    few tokens, and the engine stops generating instead of running to the end of the context."""
    disconnects = metric(stack.gateway_url, "gateway_client_disconnects_total")
    cancelled = metric(stack.engine_urls[0], "deepinfer_engine_requests_total", 'outcome="cancelled"')
    body = CHAT | {"max_tokens": 10 ** 30, "stream": True,
                   "messages": [{"role": "user", "content": "Count to a million."}]}
    async with aiohttp.ClientSession() as session:
        response = await session.post(stack.gateway_url + "/v1/chat/completions", json=body,
                                      headers={"Authorization": "Bearer key-a"})
        assert response.status == 200
        chunks = 0
        async for line in response.content:
            chunks += line.startswith(b"data: {")
            if chunks == 4:
                break
        busy = admin_stats(stack.engine_urls[0])["in_flight"]
        response.close()  # drops the connection mid-stream
    assert chunks == 4 and busy == 1
    await asyncio.to_thread(wait_until_idle, stack)
    assert metric(stack.gateway_url, "gateway_client_disconnects_total") == disconnects + 1
    assert metric(stack.engine_urls[0], "deepinfer_engine_requests_total",
                  'outcome="cancelled"') == cancelled + 1
    assert http("GET", stack.gateway_url + "/readyz").status == 200
    reply = _post_gateway(stack, CHAT)
    assert reply.status == 200 and reply.json()["usage"]["completion_tokens"] == 2


async def test_a_client_that_abandons_a_whole_answer_cancels_its_generation(stack):
    """The non-streamed case: the gateway learns of the disconnect only by its handler being
    cancelled, and must then cancel the engine's generation (which would run to the context's end)."""
    disconnects = metric(stack.gateway_url, "gateway_client_disconnects_total")
    body = CHAT | {"max_tokens": 10 ** 30, "messages": [{"role": "user", "content": "Count to a billion."}]}
    async with aiohttp.ClientSession() as session:
        request = asyncio.create_task(session.post(stack.gateway_url + "/v1/chat/completions", json=body,
                                                   headers={"Authorization": "Bearer key-a"}))
        for _ in range(200):
            if admin_stats(stack.engine_urls[0])["in_flight"]:
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the request never reached the engine")
        request.cancel()  # drops the connection before any byte of the answer
        with pytest.raises(asyncio.CancelledError):
            await request
    await asyncio.to_thread(wait_until_idle, stack)
    assert metric(stack.gateway_url, "gateway_client_disconnects_total") == disconnects + 1
    assert _post_gateway(stack, CHAT).status == 200


# -- the kvstore service's msgpack API --

def _post_kvstore(stack, path: str, body: bytes):
    return http("POST", stack.kvstore_url + path, body, {"Content-Type": "application/msgpack",
                                                         "Authorization": f"Bearer {stack.secrets.service_token}"})


@pytest.fixture(scope="module")
def model_fields(stack):
    """The fingerprint and geometry the kvstore serves (from the engine, as a remote engine learns it)."""
    stats = admin_stats(stack.engine_urls[0])
    return {"fingerprint": stats["fingerprint"],
            "geometry": {"num_layers": stats["num_layers"], "latent_dim": stats["latent_dim"],
                         "block_tokens": stats["block_tokens"], "dtype": stats["cache_dtype"]}}


HOSTILE_MSGPACK = {
    "nested arrays 100k deep": b"\x91" * 100_000 + b"\xc0",
    "nested maps 100k deep": b"\x81\xa1a" * 100_000 + b"\xc0",
    "str32 declaring 4 GiB": b"\xdb\xff\xff\xff\xff" + b"abc",
    "bin32 declaring 4 GiB": b"\xc6\xff\xff\xff\xff",
    "array32 declaring 2^32 items": b"\xdd\xff\xff\xff\xff",
    "map32 declaring 2^32 pairs": b"\xdf\xff\xff\xff\xff",
    "ext32 declaring 4 GiB": b"\xc9\xff\xff\xff\xff\x01",
    "empty": b"",
    "trailing data": b"\x80\x80",
    "not a map": msgpack.packb([1, 2, 3]),
    "a map with a list key": b"\x81\x91\x01\x01",
    "not msgpack": b"\xc1\xff",
}


@pytest.mark.parametrize("path", ["/v1/segments", "/v1/read", "/v1/lookup"])
def test_kvstore_rejects_hostile_msgpack(stack, path):
    wait_for_saves(stack)
    before = stored(stack)
    for name, raw in HOSTILE_MSGPACK.items():
        reply = _post_kvstore(stack, path, raw)
        assert reply.status == 400, (name, reply)
        error = reply.json()["error"]
        assert reply.json()["field"] == "body" and "msgpack" in error, (name, error)
        assert not error.rstrip().endswith(":"), (name, "the message must say what is wrong")
    reply = _post_kvstore(stack, path, b"\0" * ((KVSTORE_MAX_BODY_MIB << 20) + 1))
    assert reply.status == 413 and "too large" in reply.json()["error"]
    assert stored(stack) == before


def test_kvstore_rejects_wrong_types_and_escaping_names_by_field(stack, model_fields):
    wait_for_saves(stack)
    before = stored(stack)
    geometry = model_fields["geometry"]
    rows = geometry["block_tokens"]
    layer = b"\0" * (rows * geometry["latent_dim"] * 2)
    save = model_fields | {"hashes": [b"\1" * 16], "layers": [layer] * geometry["num_layers"]}
    volume = http("GET", stack.kvstore_url + "/admin/volumes",
                  headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}).json()["volumes"][0]["id"]
    read = model_fields | {"root": b"\1" * 16, "hashes": [b"\1" * 16], "layer": 0,
                           "runs": [[volume, "ab" * 16, 0, 1, 1, 4096]]}
    cases = [
        ("/v1/segments", save | {"fingerprint": 5}, "fingerprint", 400),
        ("/v1/segments", save | {"geometry": [1, 2]}, "geometry", 400),
        ("/v1/segments", save | {"hashes": "abc"}, "hashes", 400),
        ("/v1/segments", save | {"hashes": [b"\1" * 15]}, "hashes", 400),
        ("/v1/segments", save | {"hashes": [5]}, "hashes", 400),
        ("/v1/segments", save | {"hashes": [b"\1" * 16] * 100_000}, "layers[0]", 400),
        ("/v1/segments", save | {"start_block": "0"}, "start_block", 400),
        ("/v1/segments", save | {"start_block": True}, "start_block", 400),
        ("/v1/segments", save | {"start_block": -1}, "start_block", 400),
        ("/v1/segments", save | {"start_block": 2 ** 63}, "start_block", 400),
        ("/v1/segments", save | {"layers": {"0": layer}}, "layers", 400),
        ("/v1/segments", save | {"layers": ["text"] * geometry["num_layers"]}, "layers[0]", 400),
        ("/v1/segments", save | {"ttl_s": "60"}, "ttl_s", 400),
        ("/v1/segments", save | {"ttl_s": 1.5}, "ttl_s", 400),
        ("/v1/segments", save | {"ttl_s": 2 ** 63}, "ttl_s", 400),
        ("/v1/segments", save | {"tenant": 5}, "tenant", 400),
        ("/v1/segments", save | {"retention": ["chat"]}, "retention", 400),
        ("/v1/segments", save | {"retention": "../../etc"}, "retention", 400),
        ("/v1/read", read | {"runs": {"a": 1}}, "runs", 400),
        ("/v1/read", read | {"runs": [[volume, "ab" * 16, 0, 1]]}, "runs[0]", 400),
        ("/v1/read", read | {"runs": [["../../../../etc", "ab" * 16, 0, 1, 1, 4096]]}, "runs[0]", 400),
        ("/v1/read", read | {"runs": [[volume, "../../etc/passwd", 0, 1, 1, 4096]]}, "runs[0]", 400),
        ("/v1/read", read | {"runs": [[volume, "AB" * 16, 0, 1, 1, 4096]]}, "runs[0]", 400),
        ("/v1/read", read | {"runs": [[volume, "ab" * 16, 0, 1, 1, -1]]}, "runs[0]", 400),
        ("/v1/read", read | {"runs": [[volume, "ab" * 16, 2 ** 64 - 1, 1, 1, 0]]}, "runs[0]", 400),
        ("/v1/read", read | {"layer": "0"}, "layer", 400),
        ("/v1/read", read | {"layer": 2 ** 40}, "layer", 400),
        ("/v1/read", read | {"root": "ab"}, "root", 400),
        ("/v1/read", read, "runs[0]", 404),  # a well-formed segment id that does not exist
        ("/v1/lookup", {"hashes": [1, 2]}, "hashes", 400),
        ("/v1/lookup", {}, "hashes", 400),
    ]
    for path, message, field, status in cases:
        reply = _post_kvstore(stack, path, msgpack.packb(message))
        assert reply.status == status, (path, field, reply)
        body = reply.json()
        assert body["error"], (path, field, body)
        if field is not None:
            assert body["field"] == field, (path, field, body)
    for segment in ("..%2F..%2Fvol0", "%2e%2e", "..", "ab" * 16 + "%2F..%2F..", "ab" * 15 + "%00" + "ab"):
        reply = http("DELETE", stack.kvstore_url + "/v1/segments/" + segment,
                     headers={"Authorization": f"Bearer {stack.secrets.service_token}"})
        assert reply.status in (400, 404), (segment, reply)
    assert stored(stack) == before
