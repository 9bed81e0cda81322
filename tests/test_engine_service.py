"""The engine as a real process: misses, hits through the real index and volumes, bad input, queueing."""
import asyncio
import json
import os
import subprocess
import sys
import time

import urllib.request

import aiohttp
import jsonschema
import numpy as np
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from kvstore import PrefixIndex, block_hashes, open_redis
from model import cpu_kernels
from model.reference import generate
from model.serving import serving_model
from model.sampling import SamplingParams
from model.weights import load_model
from services.common.metrics_text import Samples
from services.engine.openapi_document import engine_openapi_document
from services.gateway.engine_client import EngineClient
from tests.conftest import free_port
from tests.grammar_check import grammar_compiles

ADMIN = {"Authorization": "Bearer engine-admin"}
SERVICE_TOKEN = "engine-service-token"
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
SALT = "0f" * 16


@pytest.fixture(scope="module")
def engine(tmp_path_factory, valkey_server):
    tmp = tmp_path_factory.mktemp("engine")
    port = free_port()
    args = [sys.executable, "-m", "services.engine", "--port", str(port), "--preset", "tiny",
            "--models-dir", str(tmp / "models"), "--volume", str(tmp / "v0"), "--volume", str(tmp / "v1"),
            "--redis-url", valkey_server.connection_url, "--index-prefix", "enginetest",
            "--max-batch", "1", "--max-queue", "1", "--pool-tokens", "16384", "--heartbeat-s", "0.2"]
    log = open(tmp / "engine.log", "w")
    (tmp / "mac_key").write_text("engine-test-mac-key\n")
    env = dict(os.environ, JAX_PLATFORMS="cpu", DEEPINFER_ENGINE_ADMIN_TOKEN="engine-admin",
               DEEPINFER_ENGINE_SERVICE_TOKEN=SERVICE_TOKEN, DEEPINFER_ENGINE_MAC_KEY_FILE=str(tmp / "mac_key"))
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 240
    while time.time() < deadline:
        assert proc.poll() is None, (tmp / "engine.log").read_text()[-3000:]
        try:
            import urllib.request
            with urllib.request.urlopen(url + "/readyz", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    else:
        raise AssertionError("engine not ready: " + (tmp / "engine.log").read_text()[-3000:])
    yield url, tmp / "models" / "tiny", valkey_server.connection_url
    proc.terminate()
    proc.wait(30)


async def _generate(url: str, job: dict) -> tuple[int, list[dict]]:
    async with aiohttp.ClientSession(headers=SERVICE) as session:
        async with session.post(url + "/internal/generate", json=job) as r:
            if r.status != 200:
                return r.status, [await r.json()]
            return 200, [json.loads(line) for line in (await r.text()).splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(engine):
    _, model_dir, _ = engine
    loaded = load_model(model_dir)
    return loaded, serving_model(loaded.model, "bfloat16")  # as the engine serves it


async def test_miss_then_hit_through_the_index_gives_the_same_tokens(engine, reference):
    url, _, redis_url = engine
    loaded, served = reference
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 129_280, 300)]
    expected = generate(served, tokens, SamplingParams(max_tokens=10))
    job = {"tokens": tokens, "max_tokens": 10, "tenant_salt": SALT, "tenant": "t1"}

    status, events = await _generate(url, job)
    assert status == 200
    assert [e["id"] for e in events if e["type"] == "token"] == expected
    assert events[-1]["type"] == "done" and events[-1]["cached_tokens"] == 0

    index = PrefixIndex(open_redis(redis_url), "enginetest")
    hashes = block_hashes(tokens, loaded.fingerprint, SALT, 64)
    for _ in range(100):  # the save runs after the response; it publishes once durable
        hit = await index.lookup(hashes[: (len(tokens) - 1) // 64])
        if hit.blocks == 4:
            break
        await asyncio.sleep(0.1)
    assert hit.blocks == 4
    job["hit"] = {"blocks": hit.blocks, "locations": [run._asdict() for run in hit.runs]}
    # The engine kept the prompt's blocks in its pool: the repeat is a memory hit, no disk read.
    status, events = await _generate(url, job)
    assert [e["id"] for e in events if e["type"] == "token"] == expected
    done = events[-1]
    assert done["cached_tokens"] == 256 and done["tiers"] == {"memory": 256, "disk": 0}
    assert done["timing"]["loaded_bytes"] == 0
    # With the memory tier emptied, the same request reads its prefix from disk.
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/admin/memory-tier/drop", headers=ADMIN) as r:
            assert r.status == 200 and (await r.json())["dropped_pages"] >= 4
    status, events = await _generate(url, job)
    assert [e["id"] for e in events if e["type"] == "token"] == expected
    done = events[-1]
    assert done["cached_tokens"] == 256 and done["tiers"] == {"memory": 0, "disk": 256}
    assert done["timing"]["loaded_bytes"] == 256 * 2 * 48 * 2


async def test_bad_jobs_get_clear_400s(engine):
    url, _, _ = engine
    cases = [({"tokens": [1, 2, 129_280]}, "token id 129280 out of range"),
             ({"tokens": []}, "'tokens' must be a non-empty list"),
             ({"tokens": ["a"]}, "'tokens' must be a list of integer token ids"),
             ({"tokens": [1, 2 ** 70]}, "'tokens' must be a list of integer token ids"),
             ({"tokens": [1, 2], "max_tokens": 0}, "'max_tokens' must be in [1,"),
             ({"tokens": [1, 2], "max_tokens": 2 ** 64}, "'max_tokens' must be in [1,"),
             ({"tokens": [1, 2], "stop_token_ids": [1e400]}, "'stop_token_ids' must be a list of integer"),
             ({"tokens": [1, 2], "stop_token_ids": [2 ** 80]}, "'stop_token_ids' must be a list of integer"),
             ({"tokens": [1, 2], "stop_token_ids": 7}, "'stop_token_ids' must be of type list"),
             ({"tokens": [1, 2], "seed": 2 ** 64}, "'seed' must be in"),
             ({"tokens": [1, 2], "seed": -(2 ** 64)}, "'seed' must be in"),
             ({"tokens": [1, 2], "seed": 1.5}, "'seed' must be of type int"),
             ({"tokens": [1, 2], "temperature": 1e400}, "'temperature' must be a finite number"),
             ({"tokens": [1, 2], "temperature": 2 ** 70}, "'temperature' is out of range"),
             ({"tokens": [1, 2], "temperature": 3}, "temperature must be in [0, 2]"),
             ({"tokens": [1, 2], "top_p": 0}, "top_p must be in (0, 1]"),
             ({"tokens": [1, 2], "top_k": -1}, "'top_k' must be in [0,"),
             ({"tokens": [1, 2], "top_k": True}, "'top_k' must be of type int"),
             ({"tokens": [1, 2], "tenant_salt": "../x"}, "'tenant_salt' must be 32 lowercase hex"),
             ({"tokens": [1, 2], "tenant": 5}, "'tenant' must be of type str"),
             ({"tokens": [1, 2], "request_id": ["x"]}, "'request_id' must be of type str"),
             ({"tokens": [1, 2], "request_id": "x" * 1000}, "'request_id' must be at most"),
             ({"tokens": [1] * 200, "hit": {"blocks": True, "locations": []}}, "'hit' must be"),
             ({"tokens": [1] * 200, "hit": {"blocks": 2, "locations": [5]}}, "malformed"),
             ({"tokens": [1] * 200, "hit": {"blocks": 2, "locations": [
                 {"volume": "0123456789abcdef", "segment": "ab" * 16, "first": 2 ** 70, "count": 2, "n_blocks": 2,
                  "data_offset": 4096}]}}, "malformed"),
             ({"tokens": [1, 2], "temperature": "hot"}, "'temperature' must be of type float"),
             ({"tokens": [1] * 16_000, "max_tokens": 1000}, "exceeds the context length"),
             ({"tokens": [1] * 200, "hit": {"blocks": 2, "locations": [{"volume": "../../etc"}]}}, "malformed"),
             ({"tokens": [1, 2], "retention": "forever"}, "'retention' must be one of"),
             ({"tokens": [1, 2], "presence_penalty": 2.5}, "'presence_penalty' must be in [-2, 2]"),
             ({"tokens": [1, 2], "frequency_penalty": -7}, "'frequency_penalty' must be in [-2, 2]"),
             ({"tokens": [1, 2], "logit_bias": {"129280": 1}}, "'logit_bias' keys must be token ids in [0, 129280)"),
             ({"tokens": [1, 2], "logit_bias": {"-1": 1}}, "'logit_bias' keys must be token ids"),
             ({"tokens": [1, 2], "logit_bias": {"5": 101}}, "'logit_bias' values must be numbers in [-100, 100]"),
             ({"tokens": [1, 2], "logit_bias": {"5": "x"}}, "'logit_bias' values must be numbers"),
             ({"tokens": [1, 2], "logit_bias": {str(i): 1 for i in range(301)}}, "at most 300 entries"),
             ({"tokens": [1, 2], "logit_bias": [5]}, "'logit_bias' must be of type dict"),
             ({"tokens": [1, 2], "logprobs": 21}, "'logprobs' must be in [0, 21)"),
             ({"tokens": [1, 2], "logprobs": -1}, "'logprobs' must be in [0, 21)"),
             ({"tokens": [1, 2], "grammar": {"type": "yaml"}}, "'grammar' must be"),
             ({"tokens": [1, 2], "grammar": {"type": "json_schema", "schema": 5}}, "'grammar.schema' must be"),
             ({"tokens": [1, 2], "grammar": {"type": "json_schema", "schema": {"type": "integer", "minimum": 5,
                                                                               "maximum": 1}}}, "'grammar'"),
             ({"tokens": [1, 2], "grammar": {"type": "lark", "grammar": "start: undefined_rule"}},
              "'grammar' does not compile")]
    for job, message in cases:
        status, body = await _generate(url, job)
        assert status == 400, job
        assert message in body[0]["error"]["message"], (job, body)
        named = [name for name in ("presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "grammar")
                 if name in job]
        if named:
            assert body[0]["error"]["param"] == named[0], body
    async with aiohttp.ClientSession(headers=SERVICE) as session:
        async with session.post(url + "/internal/generate", data=b"{not json") as r:
            assert r.status == 400 and "not valid JSON" in (await r.json())["error"]["message"]


async def test_a_grammar_job_over_http_streams_logprobs_and_a_complete_json_answer(engine):
    url, _, _ = engine
    schema = {"type": "object", "required": ["x"], "additionalProperties": False,
              "properties": {"x": {"type": "integer"}}}
    status, events = await _generate(url, {"tokens": [5, 6, 7], "max_tokens": 30, "temperature": 1.0, "seed": 4,
                                           "logprobs": 3, "grammar": {"type": "json_schema", "schema": schema}})
    assert status == 200, events
    tokens = [e for e in events if e["type"] == "token"]
    done = events[-1]
    assert done["type"] == "done" and done["finish_reason"] == "stop" and done["grammar_complete"] is True, done
    assert all(len(e["top_logprobs"]) == 3 and e["logprob"] <= 0 for e in tokens)
    from model.grammar import default_tokenizer_json, token_grammar
    answer = json.loads(token_grammar(default_tokenizer_json(None), 129_280, 1).tokenizer.decode_str(
        [e["id"] for e in tokens]))
    jsonschema.validate(answer, schema)


async def test_full_queue_is_a_503_and_a_dropped_client_frees_its_slot(engine):
    url, _, _ = engine
    long_job = {"tokens": [5, 6, 7], "max_tokens": 2000}
    # The slot holder could only finish on its own after 16,000 tokens (the pool's size): it is still
    # running when the third job arrives, however fast or slow this machine is; it is cancelled below.
    holder_job = {"tokens": [5, 6, 7], "max_tokens": 16_000}
    async with aiohttp.ClientSession(headers=SERVICE) as session:
        first = await session.post(url + "/internal/generate", json=holder_job)   # holds the only slot
        await first.content.readline()
        second = asyncio.create_task(session.post(url + "/internal/generate", json=long_job))  # queued
        for _ in range(600):  # until the engine counts it as waiting (not a fixed sleep: CI machines are busy)
            async with session.get(url + "/admin/stats", headers=ADMIN) as r:
                if (await r.json())["waiting"] == 1:
                    break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the second job never showed as waiting")
        async with session.post(url + "/internal/generate", json=long_job) as third:
            assert third.status == 503 and third.headers["Retry-After"] == "1"
        first.close()  # the client goes away: its generation stops and the queued one starts
        queued = await asyncio.wait_for(second, 30)
        assert queued.status == 200
        await queued.content.readline()
        queued.close()
        for _ in range(100):
            async with session.get(url + "/admin/stats", headers=ADMIN) as r:
                stats = await r.json()
            if stats["in_flight"] == 0 and stats["waiting"] == 0:
                break
            await asyncio.sleep(0.1)
        assert stats["in_flight"] == 0 and stats["waiting"] == 0
        # this machine has a compiler: pages read in place, where the CPU has AVX-512, AMX, or AVX2 and FMA
        assert stats["attention_backend"] == ("cpu" if cpu_kernels.decode_serves() else "xla")


async def test_everything_but_health_needs_the_service_token(engine):
    url, _, _ = engine
    job = json.dumps({"tokens": [5, 6, 7], "max_tokens": 1, "tenant_salt": SALT})
    async with aiohttp.ClientSession() as session:
        for path in ("/healthz", "/readyz"):
            async with session.get(url + path) as r:
                assert r.status == 200, path
        for headers, status in (({}, 401), ({"Authorization": "Bearer"}, 401),
                                ({"Authorization": "Bearer wrong"}, 403),
                                ({"Authorization": f"Bearer {SERVICE_TOKEN}x"}, 403),
                                ({"Authorization": f"Basic {SERVICE_TOKEN}"}, 403)):
            async with session.post(url + "/internal/generate", data=job, headers=headers) as r:
                assert r.status == status, headers
            async with session.get(url + "/metrics", headers=headers) as r:
                assert r.status == status, headers
        async with session.get(url + "/metrics", headers=ADMIN) as r:  # an operator's scraper
            assert r.status == 200
        async with session.post(url + "/internal/generate", data=job, headers=SERVICE) as r:
            assert r.status == 200


async def test_health_metrics_and_admin_auth(engine):
    url, _, _ = engine
    async with aiohttp.ClientSession() as session:
        async with session.get(url + "/healthz") as r:
            assert r.status == 200
        async with session.get(url + "/admin/stats") as r:
            assert r.status == 401
        async with session.get(url + "/admin/stats", headers={"Authorization": "Bearer nope"}) as r:
            assert r.status == 403
        async with session.get(url + "/metrics", headers=SERVICE) as r:
            text = await r.text()
        assert "deepinfer_engine_ttft_seconds" in text and "deepinfer_engine_prefill_tokens_total" in text
        assert "deepinfer_engine_step_seconds_total" in text
        # the warm-up traced the model's shapes in this process (compiled or loaded from the cache)
        compile_s = Samples(text).by("deepinfer_engine_compile_seconds_total", "stage")
        assert set(compile_s) == {"trace", "lower", "compile", "cache_load"}
        assert compile_s["trace"] > 0 and compile_s["lower"] > 0


async def test_progress_events_keep_a_long_wait_alive_under_a_short_read_timeout(engine):
    """A request queued behind a long one for several times the gateway client's read timeout
    still completes: the engine's progress events every heartbeat (0.2 s here) are what the
    client reads meanwhile; they never count as tokens."""
    url, _, _ = engine
    async with aiohttp.ClientSession(headers=SERVICE) as session:
        patient = EngineClient(url, session, admin_token="", connect_timeout_s=2.0, read_timeout_s=1.0,
                               service_token=SERVICE_TOKEN)
        # The blocker could only finish on its own after 16,000 tokens (the pool's size): 2,000 took under 3 s
        # once decode steps got faster, and the queued request ran before the wait below was over.
        blocker = await session.post(url + "/internal/generate", json={"tokens": [5, 6, 7], "max_tokens": 16_000})
        try:
            while json.loads(await blocker.content.readline())["type"] != "token":
                pass  # the slot is taken once the blocker's first token is out

            async def queued_request() -> list:
                async with patient.generate({"request_id": "hb", "tokens": [8, 9, 10], "max_tokens": 3}) as events:
                    return [event async for event in events]
            queued = asyncio.create_task(queued_request())
            await asyncio.sleep(3.0)  # three read timeouts of waiting for the slot
            assert not queued.done()
            blocker.close()  # frees the slot
            got = await asyncio.wait_for(queued, 60)
        finally:
            blocker.close()
    assert [type(e).__name__ for e in got] == ["TokenEvent"] * 3 + ["DoneEvent"]
    assert got[-1].finish_reason == "length" and got[-1].prompt_tokens == 3


def _shorten(job: dict, document: dict) -> None:
    """Keep a fuzzed job quick (a few prompt tokens, two generated) without changing whether it is
    valid: only fields that are already valid are shortened."""
    properties = document["paths"]["/internal/generate"]["post"]["requestBody"]["content"]["application/json"][
        "schema"]["properties"]
    for name in ("tokens", "max_tokens"):
        if name in job and jsonschema.Draft202012Validator(properties[name]).is_valid(job[name]):
            job[name] = job[name][:64] if name == "tokens" else min(job[name], 2)


def _engine_operations() -> list[tuple[str, str, str]]:
    document = engine_openapi_document(vocab_size=2, max_context=2)
    return [(method.upper(), path, mode) for path, item in document["paths"].items() for method in item
            for mode in (("positive", "negative") if path == "/internal/generate" else ("positive",))]


@pytest.mark.parametrize("method, path, mode", _engine_operations())
def test_schemathesis_finds_no_server_error_in_the_engine_api(engine, method, path, mode):
    """Schema-driven fuzzing of the engine's internal API with the service token: no 5xx, every
    response as documented; a valid job streams events and never an error event."""
    url, _, _ = engine
    request = urllib.request.Request(url + "/openapi.json", headers=SERVICE)
    with urllib.request.urlopen(request, timeout=10) as response:
        document = json.load(response)
    operation = schemathesis.openapi.from_dict(document)[path][method]
    job_schema = document["paths"]["/internal/generate"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    valid_job = jsonschema.Draft202012Validator(job_schema)
    statuses: dict[int, int] = {}

    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=GenerationMode.POSITIVE if mode == "positive"
                                 else GenerationMode.NEGATIVE))
    def run(case):
        valid = path == "/internal/generate" and valid_job.is_valid(case.body)
        if path == "/internal/generate" and isinstance(case.body, dict):
            _shorten(case.body, document)
        # The document cannot state that a Lark text or a JSON schema compiles: a valid job whose grammar
        # does not is a 400 naming it (as test_bad_jobs_get_clear_400s shows), not a rejected valid job.
        # A negative case may be about the token itself: then it keeps its own (and is refused for it first).
        own_token = mode == "negative" and "Authorization" in (case.headers or {})
        uncompilable = (valid and not own_token and case.body.get("grammar") is not None
                        and not grammar_compiles(case.body["grammar"]))
        # Nor that a generated token needs max_tokens >= 2 and no handoff, or continues the job's grammar.
        continued = valid and not own_token and bool(case.body.get("generated")) and (
            case.body.get("max_tokens", 16) < 2 or case.body.get("handoff") or case.body.get("grammar") is not None)
        response = case.call_and_validate(base_url=url, headers=None if own_token else SERVICE, timeout=60,
                                          excluded_checks=[positive_data_acceptance]
                                          if uncompilable or continued else None)
        statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
        assert response.status_code < 500, response.text[:300]
        if uncompilable:
            assert response.status_code == 400 and "grammar" in response.text, response.text[:300]
        if continued and not uncompilable:
            assert response.status_code in (200, 400) and (response.status_code == 200 or "generated" in
                                                           response.text), response.text[:300]
        if valid and response.status_code == 200:
            events = [json.loads(line) for line in response.text.splitlines() if line.strip()]
            assert events[-1]["type"] == "done" and not [e for e in events if e["type"] == "error"], events[-3:]

    run()
    assert statuses and max(statuses) < 500, statuses
