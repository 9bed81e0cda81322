"""PrefixIndex and VolumeLedger against a real Valkey server and a real 3-master Valkey cluster."""
from __future__ import annotations

import asyncio
import secrets

import pytest

from kvstore.hashing import block_hashes
from kvstore.index import PrefixIndex, open_redis
from kvstore.ledger import SegmentRecord, VolumeLedger
from kvstore.location import BlockLocation

VOLUME = "00112233aabbccdd"


@pytest.fixture(params=["single", "cluster"])
async def client(request):
    if request.param == "single":
        r = open_redis(request.getfixturevalue("redis_url"))
    else:
        r = open_redis(request.getfixturevalue("cluster_url"), cluster=True)
    yield r
    await r.aclose()


def chain(n_blocks: int, salt: str = "tenant-a", seed: int = 0) -> list[bytes]:
    tokens = [(seed * 7919 + i) % 50_000 for i in range(n_blocks * 64)]
    return block_hashes(tokens, "model-fp", salt)


def locations(n: int, segment: str | None = None, start: int = 0) -> list[BlockLocation]:
    segment = segment or secrets.token_hex(16)
    return [BlockLocation(VOLUME, segment, start + i, start + n, 4096) for i in range(n)]


async def test_longest_leading_run(client):
    index = PrefixIndex(client)
    hashes = chain(12)
    await index.publish(hashes[0], hashes[:5], locations(5), tenant="a", ttl_s=3600)
    await index.publish(hashes[0], hashes[6:10], locations(4), tenant="a", ttl_s=3600)  # gap at block 5
    hit = await index.lookup(hashes)
    assert hit.blocks == 5
    assert hit.hashes == tuple(hashes[:5])
    assert [loc.ordinal for loc in hit.locations] == [0, 1, 2, 3, 4]
    assert (await index.lookup(hashes[:3])).blocks == 3
    assert (await index.lookup([])).blocks == 0


async def test_miss_and_tenant_isolation(client):
    index = PrefixIndex(client)
    mine, theirs = chain(8, salt="tenant-a"), chain(8, salt="tenant-b")
    assert set(mine).isdisjoint(theirs)
    await index.publish(mine[0], mine, locations(8), tenant="tenant-a", ttl_s=3600)
    assert (await index.lookup(mine)).blocks == 8
    assert (await index.lookup(theirs)).blocks == 0


async def test_ttl_expiry(client):
    index = PrefixIndex(client)
    hashes = chain(4)
    await index.publish(hashes[0], hashes, locations(4), tenant="a", ttl_s=1)
    assert (await index.lookup(hashes)).blocks == 4
    await asyncio.sleep(2.2)  # a hit may re-arm the 1 s TTL, so wait past two of them
    assert (await index.lookup(hashes)).blocks == 0


async def test_hit_refreshes_ttl(client):
    index = PrefixIndex(client)
    hashes = chain(3)
    loc = locations(3)
    await index.publish(hashes[0], hashes, loc, tenant="a", ttl_s=1000)
    key = index._chain(hashes[0]).encode() + b"b:" + hashes[1]
    seg_key = index.segment_key(hashes[0], loc[0].segment)
    await index.lookup(hashes)  # more than half the TTL left: nothing to do
    assert 900 < await client.ttl(key) <= 1000
    await client.expire(key, 5)
    await client.expire(seg_key, 5)
    await index.lookup(hashes)
    assert await client.ttl(key) > 900
    assert await client.ttl(seg_key) > 900


async def test_expired_segment_record_ends_the_run(client):
    index = PrefixIndex(client)
    hashes = chain(6)
    first, second = locations(3), locations(3, start=3)
    await index.publish(hashes[0], hashes[:3], first, tenant="a", ttl_s=3600)
    await index.publish(hashes[0], hashes[3:], second, tenant="a", ttl_s=3600)
    await client.delete(index.segment_key(hashes[0], second[0].segment))
    assert (await index.lookup(hashes)).blocks == 3


async def test_drop_and_unpublish_only_own_entries(client):
    index = PrefixIndex(client)
    hashes = chain(6)
    old, new = locations(6), locations(3, start=3)
    await index.publish(hashes[0], hashes, old, tenant="a", ttl_s=3600)
    await index.publish(hashes[0], hashes[3:], new, tenant="a", ttl_s=3600)  # blocks 3..5 re-saved elsewhere
    assert await index.unpublish_segment(hashes[0], old[0].segment) == 3
    assert (await index.lookup(hashes)).blocks == 0
    await index.publish(hashes[0], hashes[:3], locations(3), tenant="a", ttl_s=3600)
    hit = await index.lookup(hashes)
    assert hit.blocks == 6 and hit.locations[4].segment == new[0].segment
    await index.drop(hashes[0], hashes[2], segment=new[0].segment)  # points elsewhere: kept
    assert (await index.lookup(hashes)).blocks == 6
    await index.drop(hashes[0], hashes[2], segment=hit.locations[2].segment)
    assert (await index.lookup(hashes)).blocks == 2


async def test_lookup_2000_blocks_is_one_call(client):
    index = PrefixIndex(client)
    hashes = chain(2000)
    for start in range(0, 2000, 500):
        await index.publish(hashes[0], hashes[start:start + 500], locations(500), tenant="a", ttl_s=3600)
    hit = await index.lookup(hashes)
    assert hit.blocks == 2000


async def test_ledger_accounting(client):
    ledger = VolumeLedger(client)
    a = SegmentRecord(secrets.token_hex(16), b"\x01" * 16, 1000, "t1")
    b = SegmentRecord(secrets.token_hex(16), b"\x02" * 16, 500, "t2")
    await ledger.add(VOLUME, a)
    await asyncio.sleep(0.01)
    await ledger.add(VOLUME, b)
    await ledger.add(VOLUME, b)  # idempotent
    assert (await ledger.used([VOLUME]))[VOLUME] == 1500
    assert [r.segment for r in await ledger.least_recent(VOLUME, 10)] == [a.segment, b.segment]
    await asyncio.sleep(0.01)
    await ledger.touch([(VOLUME, a.segment)])
    assert [r.segment for r in await ledger.least_recent(VOLUME, 10)] == [b.segment, a.segment]
    assert await ledger.retire(VOLUME, b, grace_s=0)
    assert not await ledger.retire(VOLUME, b, grace_s=0)
    assert (await ledger.used([VOLUME]))[VOLUME] == 1000
    assert await ledger.due_for_deletion(VOLUME) == [b.segment]
    await ledger.buried(VOLUME, b.segment)
    assert await ledger.due_for_deletion(VOLUME) == []
    assert {r.segment for r in await ledger.records(VOLUME)} == {a.segment}


async def test_ledger_skips_stale_recency(client):
    ledger = VolumeLedger(client)
    live = SegmentRecord(secrets.token_hex(16), b"\x03" * 16, 10, "t")
    await ledger.add(VOLUME, live)
    await client.zadd(ledger._keys(VOLUME)[2], {"ff" * 16: 0})  # recency left over from elsewhere
    assert [r.segment for r in await ledger.least_recent(VOLUME, 1)] == [live.segment]
    assert await client.zcard(ledger._keys(VOLUME)[2]) == 1
