"""Per-tenant byte quotas (kvstore/quota.py, ledger.py): real volumes, real Valkey."""
from __future__ import annotations

import asyncio

import pytest

from kvstore import block_hashes
from kvstore.quota import parse_quotas
from tests.test_store_blocks import FP, GEOMETRY, index, latents, open_store, prompt, read_all  # noqa: F401

B = GEOMETRY.block_tokens


def chain(tenant: str, seed: int, blocks: int = 4) -> list[bytes]:
    return block_hashes(prompt(blocks, seed), FP, f"salt-{tenant}", B)


async def test_a_tenant_over_its_quota_evicts_its_own_least_recent_first(tmp_path, index):
    store = await open_store(tmp_path, index)
    try:
        segment = store._segment_bytes(4, "alpha")  # one 4-block chain is one segment
        await store.quotas.publish(0, {"alpha": 3 * segment})
        beta = chain("beta", 99)
        await store.save(beta, latents(4, 99), tenant="beta")  # the least recent of all, and no quota
        alpha = [chain("alpha", s) for s in range(4)]
        for s in range(3):
            await store.save(alpha[s], latents(4, s), tenant="alpha")
        await read_all(store, await index.lookup(alpha[0]))
        await asyncio.sleep(0.05)  # the hit's recency is recorded in the background
        await store.save(alpha[3], latents(4, 3), tenant="alpha")
        assert [(await index.lookup(h)).blocks for h in alpha] == [4, 0, 4, 4]
        assert (await index.lookup(beta)).blocks == 4
        used = await store.ledger.tenants_used(list(store.volumes))
        assert used["alpha"] <= 3 * segment and used["beta"] > 0
    finally:
        await store.close()


async def test_concurrent_saves_never_take_a_tenant_past_its_quota(tmp_path, index):
    """Sixteen saves at once against a quota of three segments: the bytes in flight are reserved,
    so what the ledger counts never passes the quota, sampled after every event-loop turn."""
    store = await open_store(tmp_path, index, n_volumes=3)
    try:
        quota = 3 * store._segment_bytes(4, "alpha")
        await store.quotas.publish(0, {"alpha": quota})
        saves = asyncio.gather(*(store.save(chain("alpha", s), latents(4, s), tenant="alpha") for s in range(16)))
        peak = 0
        while not saves.done():
            peak = max(peak, await store.ledger.tenant_used(list(store.volumes), "alpha"))
            await asyncio.sleep(0)
        await saves
        assert 0 < peak <= quota
        assert sum([(await index.lookup(chain("alpha", s))).blocks > 0 for s in range(16)]) == 3
    finally:
        await store.close()


async def test_writers_in_two_processes_leave_a_tenant_within_its_quota_once_their_saves_end(tmp_path, index):
    """Two stores over the same volumes and index, as the kvstore service and an engine that mounts them: each
    reserves only its own saves, so together they can pass the quota while saves run; each save then trims its
    tenant back to the quota, its least recently hit segments first."""
    first = await open_store(tmp_path, index, n_volumes=2)
    second = await open_store(tmp_path, index, n_volumes=2)
    try:
        quota = 3 * first._segment_bytes(4, "alpha")
        await first.quotas.publish(0, {"alpha": quota})
        await asyncio.gather(*(store.save(chain("alpha", s), latents(4, s), tenant="alpha")
                               for s in range(12) for store in [(first, second)[s % 2]]))
        assert 0 < await first.ledger.tenant_used(list(first.volumes), "alpha") <= quota
        assert sum([(await index.lookup(chain("alpha", s))).blocks > 0 for s in range(12)]) <= 3
    finally:
        await first.close()
        await second.close()


async def test_a_ledger_written_before_tenants_were_counted_is_counted_once(tmp_path, index):
    store = await open_store(tmp_path, index, n_volumes=1)
    try:
        await store.save(chain("alpha", 1), latents(4, 1), tenant="alpha")
        await store.save(chain("beta", 2), latents(4, 2), tenant="beta")
        before = await store.ledger.tenants_used(list(store.volumes))
        (vid,) = store.volumes
        tused, tlru = store.ledger._tenant_keys(vid, "alpha")
        await index.redis.delete(tused, tlru, tused.replace("tused", "tcounted"))  # as an older kvstore left it
        assert await store.ledger.count_tenants(vid) == 2
        assert await store.ledger.count_tenants(vid) == 0  # once
        assert await store.ledger.tenants_used(list(store.volumes)) == before
        assert (await store.ledger.tenant_least_recent(vid, "alpha"))[0].tenant == "alpha"
    finally:
        await store.close()


def test_quota_map_names_a_bad_entry():
    assert parse_quotas("alpha=2, beta=0.5,") == {"alpha": 2.0, "beta": 0.5}
    for bad in ("alpha", "alpha=", "=2", "alpha=-1", "alpha=lots"):
        with pytest.raises(ValueError, match="TENANT=GIB"):
            parse_quotas(bad)


def test_api_keys_give_a_tenant_its_quota():
    from services.gateway.config import api_keys, tenant_quotas
    spec = "k1:alpha:2,k2:alpha:2, sk:with:colons:beta,k3:gamma:0.5"
    assert api_keys(spec) == {"k1": "alpha", "k2": "alpha", "sk:with:colons": "beta", "k3": "gamma"}
    assert tenant_quotas(spec) == {"alpha": 2.0, "gamma": 0.5}
    assert api_keys("legacy:5") == {"legacy": "5"}  # KEY:TENANT as before, whatever the tenant's name
    with pytest.raises(ValueError, match="two quotas"):
        tenant_quotas("k1:alpha:2,k2:alpha:3")
