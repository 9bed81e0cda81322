"""The gateway app over real HTTP: auth, validation, errors, openapi, health, admin, metrics.

No engine exists yet in this repository; these tests cover every path that does not need one
(no engine configured, an engine that is not reachable). End-to-end generation is tested where
the real engine joins.
"""
import socket

import aiohttp
import jsonschema
import openai
import pytest
from aiohttp import web

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig

KEYS = "sk-a:tenantA,sk-b:tenantB"
CHAT = {"model": "deepseek-chat", "messages": [{"role": "user", "content": "hi"}]}


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def serve():
    """serve(**config) -> base URL of a running gateway on a free loopback port."""
    runners = []

    async def start(**fields) -> str:
        fields.setdefault("redis_url", "")
        fields.setdefault("api_keys", KEYS)
        config = GatewayConfig(port=8000, **fields)
        runner = web.AppRunner(create_app(config), handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()


async def call(method, url, key=None, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, headers=headers, **kwargs) as response:
            body = await response.json(content_type=None) if method != "GET" or "json" in \
                response.content_type else await response.text()
            return response.status, body, response.headers


def assert_openai_error(body, param=None):
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param


async def test_missing_and_wrong_keys_are_401(serve):
    base = await serve()
    for key, phrase in [(None, "didn't provide an API key"), ("sk-wrong", "Incorrect API key")]:
        status, body, _ = await call("POST", base + "/v1/chat/completions", key, json=CHAT)
        assert status == 401
        assert_openai_error(body)
        assert phrase in body["error"]["message"] and body["error"]["code"] == "invalid_api_key"
    status, _, _ = await call("GET", base + "/v1/models")
    assert status == 401


async def test_open_access_needs_no_key(serve):
    base = await serve(open_access=True, api_keys="")
    status, body, _ = await call("GET", base + "/v1/models")
    assert status == 200 and body["data"][0]["id"] == "deepseek-chat"


async def test_no_engine_configured_is_a_clear_503(serve):
    base = await serve()
    for path, body in [("/v1/chat/completions", CHAT),
                       ("/v1/completions", {"model": "deepseek-chat", "prompt": "x"})]:
        status, reply, _ = await call("POST", base + path, "sk-a", json=body)
        assert status == 503
        assert_openai_error(reply)
        assert "No engine is configured" in reply["error"]["message"]


async def test_unreachable_engine_is_a_503_with_retry_after(serve):
    engine = f"http://127.0.0.1:{closed_port()}"
    base = await serve(engines=[engine], engine_connect_timeout_s=0.5, admin_token="adm")
    status, reply, headers = await call("POST", base + "/v1/chat/completions", "sk-a",
                                        json={**CHAT, "stream": True})
    assert status == 503 and headers["Retry-After"] == "1"
    assert_openai_error(reply)
    assert "0 of 1 ready" in reply["error"]["message"]
    assert engine not in reply["error"]["message"]  # internal addresses stay internal
    status, ready, _ = await call("GET", base + "/readyz")
    assert status == 503 and ready["engines_configured"] == 1 and not ready["ready"]
    status, stats, _ = await call("GET", base + "/admin/stats", "adm")
    assert status == 200
    assert stats["engines"][0]["url"] == engine and not stats["engines"][0]["routable"]
    assert "probe failed" in stats["engines"][0]["last_error"]


async def test_openai_client_sees_field_errors(serve):
    base = await serve()
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-b", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="deepseek-chat", temperature=3,
                                             messages=[{"role": "user", "content": "hi"}])
    assert caught.value.param == "temperature"
    with pytest.raises(openai.NotFoundError) as caught:
        await client.chat.completions.create(model="gpt-4o",
                                             messages=[{"role": "user", "content": "hi"}])
    assert caught.value.code == "model_not_found"
    with pytest.raises(openai.InternalServerError) as caught:  # 503: no engine
        await client.completions.create(model="deepseek-chat", prompt=[1, 2, 3])
    assert caught.value.status_code == 503
    models = await client.models.list()
    assert [m.id for m in models.data] == ["deepseek-chat", "deepseek-reasoner"]
    assert (await client.models.retrieve("deepseek-reasoner")).id == "deepseek-reasoner"
    with pytest.raises(openai.NotFoundError):
        await client.models.retrieve("gpt-4o")
    with pytest.raises(openai.BadRequestError) as caught:
        await client.chat.completions.create(model="deepseek-chat", presence_penalty=5,
                                             messages=[{"role": "user", "content": "hi"}])
    assert caught.value.param == "presence_penalty"
    await client.close()


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "messages": [{"role": "user", "content": "hi"}, {"role": "bot", "content": "x"}]},
     "messages[1].role"),
    ({**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({**CHAT, "n": 3}, "n"),
    ({**CHAT, "max_tokens": 0}, "max_tokens"),
    ({"messages": CHAT["messages"]}, "model"),
])
async def test_validation_errors_are_400_naming_the_field(serve, body, param):
    base = await serve()
    status, reply, _ = await call("POST", base + "/v1/chat/completions", "sk-a", json=body)
    assert status == 400
    assert_openai_error(reply, param)
    assert reply["error"]["type"] == "invalid_request_error"


async def test_malformed_and_oversized_bodies(serve):
    base = await serve(max_body_bytes=1000)
    status, reply, _ = await call("POST", base + "/v1/chat/completions", "sk-a", data=b"{nope")
    assert status == 400 and reply["error"]["code"] == "invalid_json"
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5000}]}
    status, reply, _ = await call("POST", base + "/v1/chat/completions", "sk-a", json=big)
    assert status == 413
    assert_openai_error(reply)
    status, reply, _ = await call("POST", base + "/v1/nothing-here", "sk-a", json=CHAT)
    assert status == 404
    assert_openai_error(reply)
    status, reply, headers = await call("PUT", base + "/v1/chat/completions", "sk-a", json=CHAT)
    assert status == 405 and headers["Allow"] == "POST"
    assert_openai_error(reply)


async def test_admin_stats_needs_the_admin_token(serve):
    base = await serve(admin_token="secret-admin")
    for key in (None, "sk-a", "wrong"):
        status, reply, _ = await call("GET", base + "/admin/stats", key)
        assert status == 401
        assert_openai_error(reply)
    status, stats, _ = await call("GET", base + "/admin/stats", "secret-admin")
    assert status == 200 and stats["in_flight"] == 0 and "token_cache" in stats
    unset = await serve()  # no admin token configured: admin endpoints stay closed
    status, _, _ = await call("GET", unset + "/admin/stats", "")
    assert status == 401


async def test_health_and_metrics(serve):
    base = await serve(admin_token="adm")
    assert (await call("GET", base + "/healthz"))[0] == 200
    await call("POST", base + "/v1/chat/completions", "sk-a", json={**CHAT, "top_p": 0})
    for key in (None, "sk-a", "adm2"):  # with API keys, a tenant's key does not open /metrics
        status, body, _ = await call("GET", base + "/metrics", key)
        assert status == 401, key
    status, text, headers = await call("GET", base + "/metrics", "adm")
    assert status == 200 and headers["Content-Type"].startswith("text/plain")
    assert 'gateway_requests_total{endpoint="/v1/chat/completions",status="400"} 1.0' in text
    assert "gateway_prefix_lookup_failures_total" in text


async def test_openapi_document_is_served_and_describes_errors(serve):
    base = await serve()
    status, document, _ = await call("GET", base + "/openapi.json")
    assert status == 200 and document["openapi"].startswith("3.1")
    schemas = document["components"]["schemas"]
    for schema in schemas.values():
        jsonschema.Draft202012Validator.check_schema(schema)
    usage = schemas["Usage"]
    assert set(usage["required"]) == {"prompt_tokens", "completion_tokens", "total_tokens",
                                      "prompt_cache_hit_tokens", "prompt_cache_miss_tokens",
                                      "prompt_tokens_details"}
    root = {"components": document["components"]}
    error = jsonschema.Draft202012Validator({**root, "$ref": "#/components/schemas/Error"})
    models = jsonschema.Draft202012Validator({**root, "$ref": "#/components/schemas/ModelList"})
    _, reply, _ = await call("POST", base + "/v1/chat/completions", "sk-a", json={**CHAT, "n": 2})
    error.validate(reply)
    _, reply, _ = await call("POST", base + "/v1/chat/completions", None, json=CHAT)
    error.validate(reply)
    _, reply, _ = await call("GET", base + "/v1/models", "sk-a")
    models.validate(reply)
    for path, operation in document["paths"].items():
        for method in operation.values():
            assert "200" in method["responses"], path
