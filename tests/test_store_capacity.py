"""BlockStore capacity: byte budgets, eviction, expiry sweeps, on real volumes and real Valkey."""
from __future__ import annotations

import asyncio
import os
import time

import numpy as np
import pytest

from kvstore import BlockStore, PrefixIndex, block_hashes, open_redis
from kvstore.volume import BUDGET_KEY, DEFAULT_BUDGET_SHARE
from tests.test_store_blocks import FP, GEOMETRY, index, latents, open_store, prompt, read_all  # noqa: F401


@pytest.fixture
async def store(tmp_path, index):
    s = await open_store(tmp_path, index)
    yield s
    await s.close()


async def test_eviction_keeps_budget_and_recently_hit(tmp_path, index):
    seg_bytes = 4096 + 4 * GEOMETRY.num_layers * GEOMETRY.block_bytes  # 4-block segment with header
    store = await open_store(tmp_path, index, n_volumes=1, budget_bytes=int(2.5 * seg_bytes))
    try:
        chains = [block_hashes(prompt(4, 20 + i), FP, "t", 16) for i in range(4)]
        await store.save(chains[0], latents(4, 20))
        await store.save(chains[1], latents(4, 21))
        await read_all(store, await index.lookup(chains[0]))  # chain 0 is now the most recent hit
        await asyncio.sleep(0.05)
        await store.save(chains[2], latents(4, 22))  # evicts chain 1
        assert [(await index.lookup(c)).blocks for c in chains[:3]] == [4, 0, 4]
        used = (await store.ledger.used(list(store.volumes)))
        assert max(used.values()) <= 2.5 * seg_bytes
        assert store.stats.evictions == 1
        result = await store.capacity.sweep()
        assert result.deleted == 1
        assert len(os.listdir(tmp_path / "ssd0" / "segments")) == 2
    finally:
        await store.close()



async def test_a_hit_prefix_loses_its_tail_first(tmp_path, index):
    """A 12-block chain in three 4-block segments, hit: under pressure its last segment goes
    first (the hit shrinks to 8 blocks), never its first (that would end every later hit)."""
    seg_bytes = 4096 + 4 * GEOMETRY.num_layers * GEOMETRY.block_bytes
    store = await open_store(tmp_path, index, n_volumes=1, budget_bytes=int(3.5 * seg_bytes))
    try:
        chain = block_hashes(prompt(12, 40), FP, "t", 16)
        await store.save(chain, latents(12, 40))
        await read_all(store, await index.lookup(chain))
        await asyncio.sleep(0.05)  # the touch is recorded in the background
        await store.save(block_hashes(prompt(4, 41), FP, "t", 16), latents(4, 41))
        assert (await index.lookup(chain)).blocks == 8
        assert store.stats.evictions == 1
    finally:
        await store.close()


async def test_sweep_reclaims_expired(store, index, tmp_path):
    hashes = block_hashes(prompt(2, 30), FP, "t", 16)
    store.retention.classes["short"] = 1
    try:
        await store.save(hashes, latents(2, 30), retention="short")
    finally:
        del store.retention.classes["short"]
    await asyncio.sleep(1.5)
    result = await store.capacity.sweep()
    assert (result.expired, result.deleted) == (1, 1)
    assert all(not os.listdir(p / "segments") for p in tmp_path.glob("ssd*") if (p / "segments").exists())



async def test_evict_by_tenant(store, index):
    a = block_hashes(prompt(2, 40), FP, "tenant-a", 16)
    b = block_hashes(prompt(2, 40), FP, "tenant-b", 16)
    await store.save(a, latents(2, 40), tenant="tenant-a")
    await store.save(b, latents(2, 40), tenant="tenant-b")
    assert await store.capacity.evict(tenant="tenant-a") == 1
    assert (await index.lookup(a)).blocks == 0 and (await index.lookup(b)).blocks == 2



async def test_store_on_a_redis_cluster(tmp_path, cluster_url):
    client = open_redis(cluster_url, cluster=True)
    seg_bytes = 4096 + 4 * GEOMETRY.num_layers * GEOMETRY.block_bytes
    store = await open_store(tmp_path, PrefixIndex(client), budget_bytes=int(2.5 * seg_bytes))
    try:
        chains = [block_hashes(prompt(4, 80 + i), FP, "t", 16) for i in range(6)]
        for i, chain in enumerate(chains):
            await store.save(chain, latents(4, 80 + i))
        used = await store.ledger.used(list(store.volumes))
        assert all(u <= 2.5 * seg_bytes for u in used.values()) and store.stats.evictions >= 1
        hit = await store.index.lookup(chains[-1])
        layers, valid = await read_all(store, hit)
        assert valid == 64 and np.array_equal(layers[0].view(np.uint16), latents(4, 85)[0].view(np.uint16))
        assert (await store.capacity.sweep()).deleted == store.stats.evictions
    finally:
        await store.close()
        await client.aclose()



async def test_sweep_leaves_unknown_segments_to_reconciliation(store, tmp_path):
    """A segment object no ledger knows (its writer died before publishing, or the index was lost)
    is not the sweep's to delete: the Reconciler republishes or deletes it by its header."""
    segments = tmp_path / "ssd0" / "segments"
    segments.mkdir(parents=True, exist_ok=True)
    old = segments / ("ab" * 16)
    old.write_bytes(b"a writer died before publishing")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    assert await store.capacity.sweep() == (0, 0)
    assert old.exists()


async def test_default_budget_is_a_recorded_share_of_the_file_system(tmp_path, index):
    """Never unlimited: without an explicit budget a file volume gets 80% of its file system's total
    size, recorded in the volume on first open, so every later opener (kvstore, engines) applies
    the same figure; an explicit budget wins; a volume on no file system needs one."""
    store = await open_store(tmp_path, index, n_volumes=1)
    try:
        (vid, volume), = store.volumes.items()
        fs = os.statvfs(tmp_path / "ssd0")
        assert volume.default_budget_bytes == int(fs.f_blocks * fs.f_frsize * DEFAULT_BUDGET_SHARE)
        assert store.capacity.budget_of(vid) == volume.default_budget_bytes
        assert (tmp_path / "ssd0" / BUDGET_KEY).read_text() == str(volume.default_budget_bytes)
    finally:
        await store.close()
    (tmp_path / "ssd0" / BUDGET_KEY).write_text("12345678")  # as recorded by the first opener
    again = await open_store(tmp_path, index, n_volumes=1)
    explicit = await open_store(tmp_path, index, n_volumes=1, budget_bytes=1 << 20)
    try:
        assert again.capacity.budget_of(vid) == 12345678
        assert explicit.capacity.budget_of(vid) == 1 << 20
    finally:
        await again.close()
        await explicit.close()
    with pytest.raises(ValueError, match="not on a file system"):
        await BlockStore.open([{"driver": "memory"}], GEOMETRY, FP, index, mac_key="k", threads=1)
