"""Reconciliation of the index and ledger with the volumes, on real volumes and a real Valkey
(single and cluster): a lost index rebuilt, orphans, torn and foreign files, expiry, evictions
that stay evicted, one reconciler per volume."""
from __future__ import annotations

import os
import secrets
import time

import numpy as np
import pytest

from kvstore import PrefixIndex, block_hashes, open_redis
from kvstore.lease import VolumeLease
from kvstore.reconcile import Reconciler
from kvstore.retention import DAY_S
from kvstore.block_mac import BlockMac
from kvstore.segment import SegmentPublication, encode_segment
from kvstore.volume import QUARANTINE_DIR, segment_key
from tests.test_store_blocks import FP, GEOMETRY, MAC_KEY, latents, open_store, prompt, read_all


@pytest.fixture(params=["single", "cluster"])
async def index(request):
    if request.param == "single":
        client = open_redis(request.getfixturevalue("redis_url"))
    else:
        client = open_redis(request.getfixturevalue("cluster_url"), cluster=True)
    yield PrefixIndex(client)
    await client.aclose()


@pytest.fixture
async def store(tmp_path, index):
    s = await open_store(tmp_path, index)
    yield s
    await s.close()


async def flush(index: PrefixIndex) -> None:
    """The whole Redis lost: every key of index and ledger gone (every master of a cluster)."""
    if hasattr(index.redis, "get_nodes"):
        await index.redis.flushall(target_nodes=index.redis.get_primaries())
    else:
        await index.redis.flushall()


async def write_orphan(store, seed: int, written_at: float, ttl_s: int = DAY_S, fingerprint: str = FP,
                       mac_key: str = MAC_KEY) -> tuple:
    """A segment object written as a save writes it, but never published (its writer died)."""
    hashes = block_hashes(prompt(2, seed), fingerprint, "t", 16)
    data = latents(2, seed)
    publication = SegmentPublication(hashes[0], "chat", ttl_s, int(written_at) + ttl_s)
    payload, _ = encode_segment(fingerprint, GEOMETRY, "t", hashes, data, BlockMac(mac_key), publication=publication)
    segment = secrets.token_hex(16)
    await next(iter(store.volumes.values())).write(segment, payload)
    return hashes, data, segment


async def test_a_lost_index_is_rebuilt_from_the_volumes(store, index):
    chains = {"tenant-a": block_hashes(prompt(10, 1), FP, "tenant-a", 16),
              "tenant-b": block_hashes(prompt(6, 2), FP, "tenant-b", 16)}
    data = {"tenant-a": latents(10, 1), "tenant-b": latents(6, 2)}
    before = time.time()
    await store.save(chains["tenant-a"], data["tenant-a"], tenant="tenant-a", retention="agent")
    await store.save(chains["tenant-b"], data["tenant-b"], tenant="tenant-b")
    used = await store.ledger.used(list(store.volumes))
    await flush(index)
    assert (await index.lookup(chains["tenant-a"])).blocks == 0

    report = await Reconciler(store, min_age_s=0).run()
    assert report.segments == 5 and report.outcomes["republished"] == 5  # 4 + 4 + 2 and 4 + 2 blocks
    assert sorted(report.volumes) == sorted(store.volumes) and not report.busy and not report.quarantined
    for tenant, hashes in chains.items():
        hit = await index.lookup(hashes)
        assert hit.blocks == len(hashes)
        layers, valid = await read_all(store, hit)
        assert valid == len(hashes) * 16
        assert all(np.array_equal(got.view(np.uint16), want.view(np.uint16)) for got, want in zip(layers, data[tenant]))
    assert await store.ledger.used(list(store.volumes)) == used  # the budget counts the same bytes again
    # Retention and recency come back from the headers: the agent class's TTL, minus the time since
    # the save; the recency stamp is the write time (what eviction orders by until the next hit).
    hit = await index.lookup(chains["tenant-a"])
    segment_key_a = index.segment_key(hit.root, hit.runs[0].segment)
    assert int(await index.redis.hget(segment_key_a, "ttl")) == 3 * DAY_S
    assert 3 * DAY_S - (time.time() - before) - 5 <= await index.redis.ttl(segment_key_a) <= 3 * DAY_S
    assert (await index.redis.hget(segment_key_a, "tenant")).decode() == "tenant-a"
    oldest = await store.ledger.least_recent(hit.runs[0].volume, 10)
    stamp = await index.redis.zscore(store.ledger._keys(hit.runs[0].volume)[2], oldest[0].segment)
    assert before - 1 <= stamp / 1000 <= time.time()


async def test_an_intact_index_is_left_as_it_is(store, index):
    hashes = block_hashes(prompt(6, 3), FP, "t", 16)
    await store.save(hashes, latents(6, 3))
    keys = sorted([k async for k in index.redis.scan_iter(match="dikv:*")])
    values = [await index.redis.dump(k) for k in keys]
    report = await Reconciler(store, min_age_s=0).run()
    assert report.outcomes["known"] == 2 and report.segments == 2
    assert sum(report.outcomes.values()) == 2
    after = sorted([k async for k in index.redis.scan_iter(match="dikv:*")])
    assert after == keys and [await index.redis.dump(k) for k in keys] == values


async def test_torn_and_foreign_files_are_quarantined_and_reported(tmp_path, index):
    store = await open_store(tmp_path, index, n_volumes=1)
    try:
        hashes = block_hashes(prompt(12, 4), FP, "t", 16)
        result = await store.save(hashes, latents(12, 4))  # three 4-block segments
        root = tmp_path / "ssd0"
        torn = root / segment_key(result.segments[1])
        os.truncate(torn, os.path.getsize(torn) - 100)  # a torn write: the last bytes never landed
        garbage = root / segment_key(secrets.token_hex(16))
        garbage.write_bytes(b"not a segment at all")
        _, _, foreign = await write_orphan(store, 5, time.time() - 3600, fingerprint="another-model")
        legacy = secrets.token_hex(16)  # written before headers carried a publication record
        payload, _ = encode_segment(FP, GEOMETRY, "t", block_hashes(prompt(1, 14), FP, "t", 16), latents(1, 14),
                                    BlockMac(MAC_KEY))
        await next(iter(store.volumes.values())).write(legacy, payload)

        report = await Reconciler(store, min_age_s=0).run()
        reasons = {q["segment"]: q["reason"] for q in report.quarantined}
        assert set(reasons) == {result.segments[1], garbage.name, foreign, legacy}
        assert "torn" in reasons[result.segments[1]] and "magic" in reasons[garbage.name]
        assert "fingerprint" in reasons[foreign] and "no publication record" in reasons[legacy]
        assert report.outcomes["quarantined"] == 4 and report.outcomes["known"] == 2
        # moved aside, not deleted; the torn segment's entries are gone, so the prefix ends before it
        assert sorted(os.listdir(root / QUARANTINE_DIR)) == sorted(reasons)
        assert sorted(os.listdir(root / "segments")) == sorted([result.segments[0], result.segments[2]])
        assert (await index.lookup(hashes)).blocks == 4
        assert (await store.ledger.record(next(iter(store.volumes)), result.segments[1])) is None
        again = await Reconciler(store, min_age_s=0).run()
        assert again.quarantined == [] and again.outcomes["known"] == 2
    finally:
        await store.close()


async def test_orphans_are_republished_expired_ones_deleted_young_ones_left(store, index, tmp_path):
    vid = next(iter(store.volumes))
    orphan, orphan_data, orphan_segment = await write_orphan(store, 6, time.time() - 7200)
    expired, _, expired_segment = await write_orphan(store, 7, time.time() - 7200, ttl_s=3600)
    young, _, young_segment = await write_orphan(store, 8, time.time())
    gone = block_hashes(prompt(4, 9), FP, "t", 16)
    saved = await store.save(gone, latents(4, 9))
    used = sum((await store.ledger.used(list(store.volumes))).values())
    os.remove(next(tmp_path.glob(f"ssd*/{segment_key(saved.segments[0])}")))  # lost with its disk

    report = await Reconciler(store, min_age_s=60).run()
    assert report.outcomes["republished"] == 1 and report.outcomes["expired"] == 1
    assert report.outcomes["young"] == 1 and report.outcomes["dangling"] == 1
    hit = await index.lookup(orphan)
    layers, valid = await read_all(store, hit)
    assert valid == 32 and np.array_equal(layers[3].view(np.uint16), orphan_data[3].view(np.uint16))
    assert (await index.lookup(expired)).blocks == 0
    assert not list(tmp_path.glob(f"ssd*/{segment_key(expired_segment)}"))  # deleted
    assert not await store.ledger.in_grave(vid, expired_segment)  # ... and then forgotten
    assert (await index.lookup(young)).blocks == 0  # its writer may still publish it
    assert list(tmp_path.glob(f"ssd*/{segment_key(young_segment)}"))
    assert (await index.lookup(gone)).blocks == 0  # no entry points at a missing segment
    orphan_bytes = os.path.getsize(next(tmp_path.glob(f"ssd*/{segment_key(orphan_segment)}")))
    assert sum((await store.ledger.used(list(store.volumes))).values()) == used - saved.bytes + orphan_bytes
    assert (await Reconciler(store, min_age_s=0).run()).outcomes["republished"] == 1  # now old enough
    assert (await index.lookup(young)).blocks == 2


async def test_a_segment_written_without_the_mac_key_is_quarantined_not_republished(store, index):
    """A well-formed orphan with a perfect publication record, written by someone without the
    deployment's MAC key (a volume writer, after the index was lost): never published, so never
    served; moved aside and counted."""
    forged, _, segment = await write_orphan(store, 21, time.time() - 7200, mac_key="not the deployment's")
    genuine, _, _ = await write_orphan(store, 22, time.time() - 7200)
    report = await Reconciler(store, min_age_s=0).run()
    reasons = {q["segment"]: q["reason"] for q in report.quarantined}
    assert "MAC does not verify" in reasons[segment] and report.outcomes["republished"] == 1
    assert (await index.lookup(forged)).blocks == 0 and (await index.lookup(genuine)).blocks == 2
    assert store.stats.forged_segments == 1


async def test_an_evicted_segment_is_never_republished(tmp_path, index):
    store = await open_store(tmp_path, index, reader_grace_s=3600)  # evicted bytes stay an hour
    try:
        hashes = block_hashes(prompt(6, 10), FP, "t", 16)
        await store.save(hashes, latents(6, 10))
        assert await store.capacity.evict() == 2
        assert len(list(tmp_path.glob("ssd*/segments/*"))) == 2  # bytes still there, in the grave
        report = await Reconciler(store, min_age_s=0).run()
        assert report.outcomes["republished"] == 0 and report.outcomes["vanished"] == 2
        assert (await index.lookup(hashes)).blocks == 0
    finally:
        await store.close()


async def test_one_reconciler_per_volume(store, index):
    hashes = block_hashes(prompt(4, 11), FP, "t", 16)
    await store.save(hashes, latents(4, 11))
    await flush(index)
    vid = next(iter(store.volumes))
    other = VolumeLease(index.redis, index.prefix, vid)  # another kvstore reconciling that volume
    async with other.hold() as taken:
        assert taken
        async with VolumeLease(index.redis, index.prefix, vid).hold() as second:
            assert not second
        report = await Reconciler(store, min_age_s=0).run()
        assert report.busy == [vid] and report.volumes == [v for v in store.volumes if v != vid]
        assert await other.holder() == other.token
    assert await other.holder() is None  # released by its holder
    report = await Reconciler(store, min_age_s=0).run()
    assert sorted(report.volumes) == sorted(store.volumes)
    assert (await index.lookup(hashes)).blocks == 4


async def test_a_republished_orphan_never_replaces_a_newer_entry(store, index):
    hashes, _, orphan_segment = await write_orphan(store, 12, time.time() - 7200)
    (newer,) = (await store.save(hashes, latents(2, 12))).segments  # the same blocks, saved again
    report = await Reconciler(store, min_age_s=0).run()
    assert report.outcomes["republished"] == 1 and report.outcomes["known"] == 1
    hit = await index.lookup(hashes)
    assert [run.segment for run in hit.runs] == [newer]  # the newer save's entries stay


async def test_s3_volumes_are_reconciled_the_same(s3_server, redis_url):
    """On a real S3-compatible server: a lost index rebuilt, a torn object quarantined (moved to
    quarantine/ in the bucket), its entries gone."""
    from tests.volume_shelf import S3Shelf
    shelf = S3Shelf(s3_server)
    client = open_redis(redis_url)
    index = PrefixIndex(client)
    store = await open_store(shelf, index)
    try:
        hashes = block_hashes(prompt(12, 13), FP, "t", 16)
        result = await store.save(hashes, latents(12, 13))
        await flush(index)
        torn = result.segments[2]
        shelf.write(torn, shelf.read(torn)[:-100])
        report = await Reconciler(store, min_age_s=0).run()
        assert report.outcomes["republished"] == 2 and [q["segment"] for q in report.quarantined] == [torn]
        layers, valid = await read_all(store, await index.lookup(hashes))
        assert valid == 8 * 16 and np.array_equal(layers[1].view(np.uint16), latents(12, 13)[1][:128].view(np.uint16))
        assert torn not in [s for v in shelf.volumes(2) for s in shelf.segments(v)]
        quarantined = [v for v in shelf.volumes(2) if shelf._store(v).read(QUARANTINE_DIR + torn).result().state == "value"]
        assert len(quarantined) == 1
    finally:
        await store.close()
        await client.aclose()
