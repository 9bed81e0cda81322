"""Engine client, pool and router on the failures that need no engine: nothing listening,
a peer that accepts and never answers, and no engine ready at all."""
import asyncio
import socket

import aiohttp
import pytest

from services.gateway.engine_client import EngineClient, EngineStats, EngineUnavailable
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_router import EngineRouter, GenerationJob
from services.gateway.gateway_metrics import GatewayMetrics
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_requests import Sampling
from services.gateway.prefix_lookup import PrefixLookup
from services.gateway.tenants import Tenant, tenant_salt

JOB = {"request_id": "r", "tokens": [1, 2, 3], "max_tokens": 4}


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
async def black_hole():
    """A TCP peer that accepts connections and never sends a byte."""
    async def hold(reader, writer):
        await reader.read()
    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    server.close()


def client(session, url, read_timeout_s=5.0):
    return EngineClient(url, session, admin_token="", connect_timeout_s=0.5,
                        read_timeout_s=read_timeout_s)


async def test_nothing_listening(session):
    engine = client(session, f"http://127.0.0.1:{closed_port()}")
    assert not await engine.ready()
    with pytest.raises(aiohttp.ClientError):
        await engine.stats()
    with pytest.raises(EngineUnavailable) as caught:
        async with engine.generate(JOB):
            pass
    assert "unreachable" in caught.value.reason and caught.value.retry_after_s is None


async def test_silent_engine_times_out_before_the_first_token(session, black_hole):
    engine = client(session, black_hole, read_timeout_s=0.3)
    started = asyncio.get_running_loop().time()
    with pytest.raises(EngineUnavailable):
        async with engine.generate(JOB):
            pass
    assert asyncio.get_running_loop().time() - started < 3.0


async def test_probe_marks_engines_unroutable(session, black_hole):
    pool = EnginePool([f"http://127.0.0.1:{closed_port()}", black_hole],
                      lambda url: client(session, url, read_timeout_s=0.3), poll_s=60)
    await pool.probe_all()
    assert pool.ranked() == []
    assert all("probe failed" in engine.last_error for engine in pool.engines)


async def test_least_loaded_first(session):
    pool = EnginePool([f"http://127.0.0.1:{closed_port()}" for _ in range(3)],
                      lambda url: client(session, url), poll_s=60)
    await pool.discover()
    for index, engine in enumerate(pool.engines):
        engine.routable = True
        engine.stats = EngineStats("fp", "m", 4096, 64, in_flight=10 - index)
    first, second, third = pool.engines
    with pool.claim(third), pool.claim(third), pool.claim(first):
        assert pool.ranked() == [second, first, third]
        assert pool.in_flight() == 3
    assert pool.ranked() == [third, second, first]  # equal here: the engines' own counts decide
    pool.mark_failed(third, "broken stream")
    assert pool.ranked() == [second, first] and third.last_error == "broken stream"


async def test_router_without_a_ready_engine_says_so(session):
    job = GenerationJob("r", [1, 2, 3], Tenant("t", tenant_salt("k", "t")), Sampling(None), "chat",
                        (1,), "messages")
    metrics = GatewayMetrics()
    for urls, message in [([], "No engine is configured"),
                          ([f"http://127.0.0.1:{closed_port()}"], "0 of 1 ready")]:
        pool = EnginePool(urls, lambda url: client(session, url), 60)
        await pool.probe_all()
        router = EngineRouter(pool, PrefixLookup(None, 1.0, metrics), metrics, default_max_tokens=16)
        with pytest.raises(OpenAIError) as caught:
            async with router.generation(job):
                pass
        assert caught.value.status == 503 and message in caught.value.message


def test_job_body_carries_the_optional_fields_only_when_set():
    from kvstore.location import Hit
    from services.gateway.engine_router import GenerationJob, engine_job_body
    from services.gateway.openai_requests import Sampling
    from services.gateway.tenants import Tenant
    tenant = Tenant("t", "0" * 32)
    plain = GenerationJob("r", [1, 2], tenant, Sampling(max_tokens=4), "chat", (1,), "messages")
    body = engine_job_body(plain, [], Hit(b"", (), ()), 4)
    assert not {"presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "grammar"} & set(body)
    grammar = {"type": "json_object"}
    full = plain._replace(sampling=Sampling(max_tokens=4, presence_penalty=0.5, frequency_penalty=-1.0,
                                            logit_bias=((7, 100.0),), logprobs=0), grammar=grammar)
    body = engine_job_body(full, [], Hit(b"", (), ()), 4)
    assert (body["presence_penalty"], body["frequency_penalty"], body["logit_bias"], body["logprobs"],
            body["grammar"]) == (0.5, -1.0, {"7": 100.0}, 0, grammar)
