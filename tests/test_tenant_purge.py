"""Purging one tenant's blocks (kvstore/purge.py, fence.py): real volumes, real Valkey, two stores
over the same volumes as an engine and the kvstore service have."""
from __future__ import annotations

import asyncio
import threading

import pytest

from kvstore import Reconciler, block_hashes
from kvstore.reader import read_header
from kvstore.purge import erase_tenant
from kvstore.store import TenantPurged
from tests.test_store_blocks import FP, GEOMETRY, index, latents, open_store, prompt, read_all  # noqa: F401

B = GEOMETRY.block_tokens


def chain(tenant: str, seed: int, blocks: int = 6) -> list[bytes]:
    return block_hashes(prompt(blocks, seed), FP, f"salt-{tenant}", B)


async def tenants_on_volumes(store) -> dict[str, int]:
    """Blocks per tenant in every segment object on the volumes (the grave and orphans included)."""
    found: dict[str, int] = {}
    for volume in store.volumes.values():
        for segment in await volume.segments():
            header = await read_header(volume, segment)
            found[header.tenant] = found.get(header.tenant, 0) + header.n_blocks
    return found


async def ledger_tenants(store) -> set[str]:
    return {r.tenant for v in store.volumes for r in await store.ledger.records(v)}


async def test_purge_erases_the_tenant_from_index_ledger_and_volumes(tmp_path, index):
    store = await open_store(tmp_path, index, reader_grace_s=600.0)  # retired bytes would linger
    try:
        alpha = [chain("alpha", s) for s in range(3)]
        beta = [chain("beta", 10 + s) for s in range(2)]
        for s, hashes in enumerate(alpha + beta):
            await store.save(hashes, latents(6, s), tenant="alpha" if s < 3 else "beta")
        vid, victim = [(v, r) for v in store.volumes for r in await store.ledger.records(v) if r.tenant == "alpha"][0]
        await store.capacity.retire(vid, victim)  # evicted: in the grave, its bytes still on disk
        assert (await tenants_on_volumes(store))["alpha"] == 18

        epoch = await store.fence.begin_purge("alpha")
        assert await store.fence.tombstones() == {"alpha": epoch}
        result = await erase_tenant(store, "alpha", epoch)

        assert result.blocks == 18 and result.segments == 6  # 4-block segments: 4 + 2 per chain
        assert [(await index.lookup(h)).blocks for h in alpha] == [0, 0, 0]
        assert "alpha" not in await tenants_on_volumes(store)
        assert "alpha" not in await ledger_tenants(store)
        assert set(await store.ledger.tenants_used(list(store.volumes))) == {"beta"}
        assert await store.fence.tombstones() == {}
        for hashes in beta:  # the other tenant's hits are whole and read back verified
            hit = await index.lookup(hashes)
            assert hit.blocks == 6 and (await read_all(store, hit))[1] == 6 * B
    finally:
        await store.close()


async def test_a_save_in_flight_during_a_purge_leaves_no_block(tmp_path, index):
    """The engine's store passed the epoch check and is about to write when the kvstore's store
    purges the tenant: its write lands after the purge listed the volumes, so it withdraws itself."""
    engine = await open_store(tmp_path, index)
    kvstore = await open_store(tmp_path, index)
    release = threading.Event()
    try:
        for _ in range(2):  # both of the engine store's I/O threads busy: its save waits to encode
            engine._pool.submit(release.wait)
        hashes = chain("alpha", 1, blocks=8)
        save = asyncio.create_task(engine.save(hashes, latents(8, 1), tenant="alpha", epoch=0))
        while engine._pool._work_queue.qsize() < 2:  # its segments are queued: the epoch check is behind it
            await asyncio.sleep(0.01)
        epoch = await kvstore.fence.begin_purge("alpha")
        assert (await erase_tenant(kvstore, "alpha", epoch)).blocks == 0
        release.set()
        with pytest.raises(TenantPurged, match="in flight"):
            await save
        assert (await index.lookup(hashes)).blocks == 0
        assert "alpha" not in await tenants_on_volumes(kvstore)
        assert "alpha" not in await ledger_tenants(kvstore)
        with pytest.raises(TenantPurged, match="since"):  # a save that begins under the old epoch: refused
            await engine.save(hashes, latents(8, 1), tenant="alpha", epoch=0)
        await engine.save(hashes, latents(8, 1), tenant="alpha", epoch=epoch)  # the new epoch saves again
        assert (await index.lookup(hashes)).blocks == 8
    finally:
        release.set()
        await engine.close()
        await kvstore.close()


async def test_reconciliation_finishes_a_purge_its_driver_left(tmp_path, index):
    """The driver fenced the tenant and died: the tombstone is all there is. A stale segment whose
    save died between publishing and its check is erased by the same pass."""
    store = await open_store(tmp_path, index)
    try:
        alpha, beta = chain("alpha", 1), chain("beta", 2)
        await store.save(alpha, latents(6, 1), tenant="alpha")
        await store.save(beta, latents(6, 2), tenant="beta")
        await store.fence.begin_purge("alpha")
        report = await Reconciler(store, min_age_s=0).run()
        assert report.purges == {"alpha": 1}
        assert (await index.lookup(alpha)).blocks == 0 and (await index.lookup(beta)).blocks == 6
        assert set(await tenants_on_volumes(store)) == {"beta"} and await store.fence.tombstones() == {}

        await store.save(beta, latents(6, 2), tenant="beta")  # no-op republish of beta's blocks
        gamma = chain("gamma", 3)
        await store.save(gamma, latents(6, 3), tenant="gamma")
        await store.fence.finish("gamma", await store.fence.begin_purge("gamma"))  # fenced, never erased
        report = await Reconciler(store, min_age_s=0).run()
        assert report.outcomes["purged"] == 2 and (await index.lookup(gamma)).blocks == 0
        assert set(await tenants_on_volumes(store)) == {"beta"}
    finally:
        await store.close()


async def test_a_purge_unlinks_the_tenants_quarantined_segments_and_keeps_others(tmp_path, index):
    """Reconciliation keeps torn or foreign segments in quarantine/ for a human; a tenant's erasure unlinks those
    whose header names it (a format switch quarantines a whole cache), and leaves other tenants' alone."""
    store = await open_store(tmp_path, index)
    try:
        await store.save(chain("alpha", 1), latents(6, 1), tenant="alpha")
        await store.save(chain("beta", 2), latents(6, 2), tenant="beta")
        for volume in store.volumes.values():
            for segment in await volume.segments():
                await volume.quarantine(segment)
        held = {v.id: await v.quarantined() for v in store.volumes.values()}
        assert sum(map(len, held.values())) == 4  # two chains of 6 blocks in 4-block segments

        epoch = await store.fence.begin_purge("alpha")
        result = await erase_tenant(store, "alpha", epoch)

        assert (result.segments, result.blocks) == (2, 6)
        left = [await v.quarantined() for v in store.volumes.values()]
        assert sum(map(len, left)) == 2
        for volume in store.volumes.values():
            for segment in await volume.quarantined():
                assert (await read_header(volume, segment, quarantined=True)).tenant == "beta"
    finally:
        await store.close()
