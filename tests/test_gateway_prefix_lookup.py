"""Prefix lookup against a real Valkey server: the hit cap, tenant isolation, the engine job's
hit encoding, and Redis failures served as misses."""
import asyncio
import secrets
import socket

import pytest

from kvstore.hashing import block_hashes
from kvstore.index import PrefixIndex, open_redis
from kvstore.location import BlockLocation, Hit, SegmentRun
from services.gateway.engine_router import GenerationJob, engine_job_body
from services.gateway.gateway_metrics import GatewayMetrics
from services.gateway.openai_requests import Sampling
from kvstore import cacheable_blocks
from services.gateway.prefix_lookup import PrefixLookup
from services.gateway.tenants import Tenant, tenant_salt

B = 64
FINGERPRINT = "model-fp-test"
SALT_KEY = "test-salt-key"
VOLUME = "00112233aabbccdd"


def tokens(n: int, seed: int = 3) -> list[int]:
    return [(7 * i + seed) % 100_000 for i in range(n)]


async def publish(index: PrefixIndex, hashes: list[bytes]) -> None:
    segment = secrets.token_hex(16)
    locations = [BlockLocation(VOLUME, segment, i, len(hashes), 4096) for i in range(len(hashes))]
    await index.publish(hashes[0], hashes, locations, tenant="t", ttl_s=3600)


@pytest.mark.parametrize("prompt, blocks", [(0, 0), (1, 0), (64, 0), (65, 1), (128, 1),
                                            (129, 2), (640, 9), (641, 10)])
def test_at_least_one_prompt_token_is_left_to_prefill(prompt, blocks):
    assert cacheable_blocks(prompt, B) == blocks


@pytest.fixture
async def index(redis_url):
    client = open_redis(redis_url)
    yield PrefixIndex(client)
    await client.aclose()


async def test_hit_is_capped_and_salted(index):
    salt = tenant_salt(SALT_KEY, "tenantA")
    prompt = tokens(5 * B)
    hashes = block_hashes(prompt, FINGERPRINT, salt, B)
    await publish(index, hashes)
    metrics = GatewayMetrics()
    lookup = PrefixLookup(index, timeout_s=2.0, metrics=metrics)
    # The prompt is exactly 5 blocks: only 4 may be hit, the 5th keeps a token to prefill.
    assert (await lookup.lookup(hashes, len(prompt), B)).blocks == 4
    longer = prompt + [1]
    assert (await lookup.lookup(block_hashes(longer, FINGERPRINT, salt, B), len(longer),
                                B)).blocks == 5
    other = block_hashes(prompt, FINGERPRINT, tenant_salt(SALT_KEY, "tenantB"), B)
    assert (await lookup.lookup(other, len(prompt), B)).blocks == 0
    assert metrics.lookup_failures._value.get() == 0


async def test_engine_job_carries_a_hit_the_engine_can_rebuild(index):
    tenant = Tenant("tenantA", tenant_salt(SALT_KEY, "tenantA"))
    prompt = tokens(3 * B + 10)
    hashes = block_hashes(prompt, FINGERPRINT, tenant.salt, B)
    await publish(index, hashes[:2])
    hit = await PrefixLookup(index, 2.0, GatewayMetrics()).lookup(hashes, len(prompt), B)
    job = GenerationJob("req-1", prompt, tenant, Sampling(max_tokens=None), "chat", (1,),
                        "messages")
    body = engine_job_body(job, hashes, hit, max_tokens=16)
    assert body["hit"]["blocks"] == 2 and body["tenant_salt"] == tenant.salt
    assert body["tenant"] == "tenantA"
    assert body["block_hashes"] == [h.hex() for h in hashes]
    wire = [bytes.fromhex(h) for h in body["block_hashes"]]
    rebuilt = Hit(wire[0], tuple(wire[:body["hit"]["blocks"]]),
                  tuple(SegmentRun(**item) for item in body["hit"]["locations"]))
    assert rebuilt == hit
    assert (body["max_tokens"], body["stop_token_ids"], body["retention"]) == (16, [1], "chat")


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_redis_down_is_a_counted_miss():
    client = open_redis(f"redis://127.0.0.1:{closed_port()}/0")
    metrics = GatewayMetrics()
    lookup = PrefixLookup(PrefixIndex(client), timeout_s=2.0, metrics=metrics)
    hashes = block_hashes(tokens(4 * B), FINGERPRINT, "salt", B)
    hit = await lookup.lookup(hashes, 4 * B, B)
    assert hit.blocks == 0 and metrics.lookup_failures._value.get() == 1
    assert not await lookup.ready()
    await client.aclose()


async def test_redis_that_never_answers_is_a_miss_after_the_timeout():
    async def black_hole(reader, writer):
        await reader.read()  # accept, never reply
    server = await asyncio.start_server(black_hole, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = open_redis(f"redis://127.0.0.1:{port}/0")
    metrics = GatewayMetrics()
    lookup = PrefixLookup(PrefixIndex(client), timeout_s=0.3, metrics=metrics)
    hashes = block_hashes(tokens(2 * B), FINGERPRINT, "salt", B)
    started = asyncio.get_running_loop().time()
    assert (await lookup.lookup(hashes, 2 * B + 1, B)).blocks == 0
    assert asyncio.get_running_loop().time() - started < 2.0
    assert metrics.lookup_failures._value.get() == 1
    await client.aclose()
    server.close()


async def test_no_index_configured_is_a_silent_miss():
    metrics = GatewayMetrics()
    lookup = PrefixLookup(None, 1.0, metrics)
    assert (await lookup.lookup([b"x" * 16], 1000, B)).blocks == 0
    assert metrics.lookup_failures._value.get() == 0


async def test_admission_admits_a_block_on_its_nth_sighting_per_chained_hash(index, redis_url):
    """--admit-after 2: a prompt's blocks are admitted (the engine may write them) on their second sighting;
    blocks already indexed count as admitted; a new suffix under a seen prefix is not admitted with it."""
    import redis as sync_redis

    salt = tenant_salt(SALT_KEY, "tenantA")
    lookup = PrefixLookup(index, 2.0, GatewayMetrics(), admit_after=2, admit_window_s=600)
    prompt = tokens(5 * B + 1)
    hashes = block_hashes(prompt, FINGERPRINT, salt, B)
    first = await lookup.lookup(hashes, len(prompt), B)
    assert (first.blocks, first.admitted) == (0, 0)
    assert "save_blocks" in engine_job_body(GenerationJob("r", prompt, Tenant("tenantA", salt), Sampling(None), "chat",
                                                          (), "messages"), hashes, first, 8)
    second = await lookup.lookup(hashes, len(prompt), B)
    assert (second.blocks, second.admitted) == (0, 5)
    # The same first three blocks, then a suffix nobody sent before: only the shared blocks are admitted.
    other = prompt[:3 * B] + [t + 1 for t in prompt[3 * B:]]
    assert (await lookup.lookup(block_hashes(other, FINGERPRINT, salt, B), len(other), B)).admitted == 3
    # Blocks in the index are on disk already: admitted whatever their count.
    fresh = tokens(4 * B + 1, seed=7)
    fresh_hashes = block_hashes(fresh, FINGERPRINT, salt, B)
    await publish(index, fresh_hashes[:2])
    hit = await lookup.lookup(fresh_hashes, len(fresh), B)
    assert (hit.blocks, hit.admitted) == (2, 2)
    # Sightings expire: every counter carries the window as its TTL.
    client = sync_redis.Redis.from_url(redis_url)
    counters = list(client.scan_iter(match="dikv:*:n:*"))
    assert counters and all(0 < client.ttl(key) <= 600 for key in counters)
    client.close()


async def test_without_admission_no_sightings_are_kept_and_every_block_is_written(index, redis_url):
    import redis as sync_redis

    lookup = PrefixLookup(index, 2.0, GatewayMetrics())
    prompt = tokens(3 * B + 1)
    hit = await lookup.lookup(block_hashes(prompt, FINGERPRINT, "ab" * 16, B), len(prompt), B)
    assert hit.admitted is None
    assert "save_blocks" not in engine_job_body(GenerationJob("r", prompt, Tenant("t", "ab" * 16), Sampling(None),
                                                              "chat", (), "messages"), [], hit, 8)
    client = sync_redis.Redis.from_url(redis_url)
    assert not list(client.scan_iter(match="dikv:*:n:*"))
    client.close()


async def test_under_admission_a_prompt_without_blocks_or_a_failed_lookup_writes_nothing():
    """A prompt too short for a cacheable block, or a lookup the index did not answer, has no sightings to go by:
    under admission the engine writes none of its blocks (answer blocks included), not all of them."""
    closed = open_redis(f"redis://127.0.0.1:{closed_port()}/0")
    for index in (None, PrefixIndex(closed)):
        lookup = PrefixLookup(index, 1.0, GatewayMetrics(), admit_after=2)
        assert (await lookup.lookup([b"x" * 16], 10, B)).admitted == 0  # no cacheable block
        assert (await lookup.lookup([b"x" * 16] * 3, 3 * B + 1, B)).admitted == 0  # no index, or no answer
    assert (await PrefixLookup(PrefixIndex(closed), 1.0, GatewayMetrics()).lookup([b"x" * 16], 2 * B, B)
            ).admitted is None  # without admission every block is written, as before
    await closed.aclose()
