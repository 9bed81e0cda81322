"""Engine names resolved to one engine per address: the pool follows replicas as they come and go.

The real resolver is used for IP literals and `localhost`; the churn of `--scale engine=N` is played
by a resolver that answers as Docker's DNS does (every running replica's address, none once all
are gone). Real replicas behind real Docker DNS are the compose test's (tests/compose_stack.py).
"""
import ipaddress
import socket

import aiohttp
import pytest

from services.gateway.engine_client import EngineClient, EngineStats
from services.gateway.engine_discovery import address_url, replica_urls
from services.gateway.engine_pool import EnginePool
from services.gateway.engine_router import EngineRouter, GenerationJob
from services.gateway.gateway_metrics import GatewayMetrics
from services.gateway.openai_errors import OpenAIError
from services.gateway.openai_requests import Sampling
from services.gateway.prefix_lookup import PrefixLookup
from services.gateway.tenants import Tenant, tenant_salt

NAME = "http://engine:8200"


@pytest.fixture
async def session():
    async with aiohttp.ClientSession() as session:
        yield session


def connect(session):
    return lambda url: EngineClient(url, session, admin_token="", connect_timeout_s=0.5, read_timeout_s=1.0)


class DockerDns:
    """Answers a service name as Docker's embedded DNS does (the running replicas' addresses), in
    address order as replica_urls gives them."""

    def __init__(self, *addresses: str):
        self.addresses = list(addresses)

    async def __call__(self, url: str) -> list[str]:
        if not self.addresses:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [address_url(url, address) for address in sorted(self.addresses, key=ipaddress.ip_address)]


async def test_ip_literals_and_localhost_are_one_engine_each():
    assert await replica_urls("http://127.0.0.1:8200/") == ["http://127.0.0.1:8200"]
    assert await replica_urls("http://[::1]:8200") == ["http://[::1]:8200"]
    # localhost has an IPv4 and an IPv6 address: one engine, not two
    assert await replica_urls("http://localhost:8200") == ["http://127.0.0.1:8200"]
    with pytest.raises(OSError):
        await replica_urls("http://no-such-engine.invalid:8200")
    with pytest.raises(ValueError, match="no host"):
        await replica_urls("http://:8200")


async def test_replicas_join_and_leave_and_keep_their_state(session):
    dns = DockerDns("172.18.0.5")
    pool = EnginePool([NAME], connect(session), poll_s=60, resolve=dns)
    await pool.discover()
    [first] = pool.engines
    assert (first.name, first.client.url) == (NAME, "http://172.18.0.5:8200")
    with pool.claim(first):
        dns.addresses = ["172.18.0.7", "172.18.0.5"]  # scaled to 2
        await pool.discover()
        assert [e.client.url for e in pool.engines] == ["http://172.18.0.5:8200", "http://172.18.0.7:8200"]
        assert pool.engines[0] is first and first.in_flight == 1  # the same engine, its load kept
        assert not pool.engines[1].routable  # a new replica waits for its first probe
        dns.addresses = ["172.18.0.7"]  # the first replica stopped
        await pool.discover()
        assert [e.client.url for e in pool.engines] == ["http://172.18.0.7:8200"]
    assert first.in_flight == 0  # the request that ran on the departed replica still finished


async def test_a_name_that_stops_resolving_keeps_its_addresses(session):
    dns = DockerDns("172.18.0.5", "172.18.0.6")
    pool = EnginePool([NAME], connect(session), poll_s=60, resolve=dns)
    await pool.discover()
    before = list(pool.engines)
    dns.addresses = []  # every replica stopped, or the DNS server hiccuped
    await pool.discover()
    assert len(before) == 2 and all(a is b for a, b in zip(pool.engines, before, strict=True))
    assert all("did not resolve" in e.last_error for e in before)


async def test_each_replica_is_probed_and_routed_on_its_own(session):
    """Two replicas behind one name, one unreachable and one a peer that never answers: each is
    probed at its own address and neither is routable; then least-loaded order is per replica."""
    dns = DockerDns("127.0.0.2", "127.0.0.3")
    with socket.socket() as listener:
        listener.bind(("127.0.0.3", 0))
        listener.listen()
        port = listener.getsockname()[1]
        pool = EnginePool([f"http://engine:{port}"], connect(session), poll_s=60, resolve=dns)
        await pool.probe_all()
        assert pool.ranked() == [] and len(pool.engines) == 2
        assert all("probe failed" in e.last_error for e in pool.engines)
        assert [e.client.url for e in pool.engines] == [f"http://127.0.0.2:{port}", f"http://127.0.0.3:{port}"]
    for index, engine in enumerate(pool.engines):
        engine.routable, engine.stats = True, EngineStats("fp", "m", 4096, 64, in_flight=0)
    low, high = pool.engines
    with pool.claim(low):
        assert pool.ranked() == [high, low]  # least loaded per replica


async def test_pinning_a_name_with_several_replicas_is_refused(session):
    dns = DockerDns("172.18.0.5", "172.18.0.6")
    pool = EnginePool([NAME], connect(session), poll_s=60, resolve=dns)
    await pool.discover()
    for engine in pool.engines:
        engine.routable, engine.stats = True, EngineStats("fp", "m", 4096, 64, in_flight=0)
    metrics = GatewayMetrics()
    router = EngineRouter(pool, PrefixLookup(None, 1.0, metrics), metrics, default_max_tokens=4)
    job = GenerationJob("r", [1, 2, 3], Tenant("t", tenant_salt("k", "t")), Sampling(None), "chat",
                        (1,), "messages", engine=NAME)
    with pytest.raises(OpenAIError) as caught:
        async with router.generation(job):
            pass
    assert caught.value.status == 400 and caught.value.code == "ambiguous_engine"
    assert "http://172.18.0.5:8200" in caught.value.message
