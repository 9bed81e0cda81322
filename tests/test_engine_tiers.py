"""The disk tier's overlap (services/engine/tiers.py): a disk hit's prefill computes layer l as soon as layer l of
its prefix is in its pages, while later layers still load, and answers as a miss would.

Real parts: the kvstore service as its own process over two real volumes and a real Valkey, reached through a
gate (an HTTP proxy on loopback, test code) that holds every read of layer 1 or later until the test opens it, so
the overlap is shown without timing: the engine must compute the first layer while the rest cannot arrive.
"""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest
from aiohttp import web

from kvstore import block_hashes, cacheable_blocks
from model.config import preset
from model.weights import init_model, save_model
from services.engine.config import EngineConfig
from tests.conftest import free_port
from tests.test_engine_batching import SALT, Running, prompt

ROOT = Path(__file__).resolve().parent.parent
SERVICE_TOKEN = "tiers-service-token"
PROMPT = 64 * 6 + 20  # six cacheable blocks and a suffix


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    cfg = preset("tiny")
    return save_model(init_model(cfg), cfg, tmp_path_factory.mktemp("tiers") / "model")


@pytest.fixture
def kvstore(tmp_path, tiny, valkey_server):
    """The kvstore service for tiny's latents (its own process, two volumes): (url, volume dirs)."""
    g, port = tiny.config, free_port()
    volumes = [tmp_path / "v0", tmp_path / "v1"]
    args = [sys.executable, "-m", "services.kvstore", "--port", str(port), "--fingerprint", tiny.fingerprint,
            "--num-layers", str(g.num_layers), "--latent-dim", str(g.latent_dim), "--block-tokens", "64",
            "--redis-url", valkey_server.connection_url, "--index-prefix", f"tiers{port}", "--sweep-interval-s", "0",
            *(arg for v in volumes for arg in ("--volume", str(v)))]
    env = dict(os.environ, DEEPINFER_KVSTORE_SERVICE_TOKEN=SERVICE_TOKEN, DEEPINFER_KVSTORE_MAC_KEY="tiers-mac")
    with open(tmp_path / "kvstore.log", "wb") as log:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    yield f"http://127.0.0.1:{port}", volumes
    proc.terminate()
    proc.wait(timeout=10)


class Gate:
    """An HTTP proxy to the kvstore service that holds each read of layer >= 1 while closed."""

    def __init__(self, upstream: str):
        self.upstream, self.open = upstream, asyncio.Event()
        self.open.set()
        self.held = 0  # reads waiting at the gate now

    async def start(self) -> str:
        self.session = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{path:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        for _ in range(200):  # the service is up once it answers through the gate
            try:
                async with self.session.get(self.upstream + "/healthz") as reply:
                    if reply.status == 200:
                        return f"http://127.0.0.1:{port}"
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
        raise RuntimeError("the kvstore service did not come up")

    async def forward(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.path == "/v1/read" and msgpack.unpackb(body).get("layer", 0) >= 1:
            self.held += 1
            await self.open.wait()
            self.held -= 1
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type",
                                                                             "x-request-id")}
        async with self.session.request(request.method, self.upstream + request.path_qs, data=body,
                                        headers=headers) as reply:
            kept = {k: v for k, v in reply.headers.items() if k.lower().startswith("x-") or k.lower() == "content-type"}
            return web.Response(status=reply.status, body=await reply.read(), headers=kept)

    async def stop(self) -> None:
        self.open.set()
        await self.runner.cleanup()
        await self.session.close()


async def until(check, what: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def saved_hit(run: Running, tokens: np.ndarray):
    """The index's hit for `tokens` once the engine's saves are published."""
    await until(lambda: not run.engine.tiers.saves, "the saves")
    hashes = block_hashes(tokens.tolist(), run.loaded.fingerprint, SALT, 64)[:cacheable_blocks(len(tokens), 64)]
    for _ in range(200):
        hit = await run.cache.store.lookup(hashes)
        if hit.blocks == len(hashes):
            return hit
        await asyncio.sleep(0.05)
    raise AssertionError(f"only {hit.blocks} of {len(hashes)} blocks were published")


def corrupt_last_block_of_layer_1(volumes: list[Path], hit) -> int:
    """Flips bytes of layer 1 of the hit's last block in its segment file; returns the blocks still valid."""
    run = hit.runs[-1]
    path = next(v / "segments" / run.segment for v in volumes if (v / "segments" / run.segment).exists())
    block_bytes = 64 * 48 * 2  # tiny: 48 latent dims in bfloat16
    offset = run.data_offset + (1 * run.n_blocks + run.first + run.count - 1) * block_bytes
    with open(path, "r+b") as f:
        f.seek(offset + 100)
        flipped = bytes(b ^ 0x5A for b in f.read(16))
        f.seek(offset + 100)
        f.write(flipped)
    return hit.blocks - 1


@pytest.mark.parametrize("fault", [None, "layer 1 cut"])
async def test_a_disk_hits_first_layer_computes_while_later_layers_load_with_the_same_answer(tiny, kvstore, fault):
    """With reads of layer 1 held at the gate, the hit's prefill computes layer 0 (the metric of units computed
    while the load is in flight moves, no token is out yet); opened, the answer is the miss's, and without a fault
    bit for bit (logits' digests) the same hit's ungated. A layer that comes back cut (a block failing
    verification) closes the pass computed over the longer prefix and recomputes the rest: still the miss's
    answer, with fewer tokens from disk."""
    url, volumes = kvstore
    gate = Gate(url)
    cfg = EngineConfig(kvstore_url=await gate.start(), service_token=SERVICE_TOKEN, pool_tokens=64 * 64,
                       heartbeat_s=0.2, prefetch_deadline_factor=1e6)
    try:
        async with Running(tiny, cfg) as run:
            p = prompt(11, PROMPT)
            miss_ids, miss_digests, miss_done = await run.generate(run.job(p, max_tokens=6))
            assert miss_done["tiers"] == {"memory": 0, "disk": 0}
            hit = await saved_hit(run, p)
            await run.engine.drop_memory_tier()
            free_ids, free_digests, free_done = await run.generate(run.job(p, max_tokens=6, hit=hit))
            assert free_ids == miss_ids and free_done["tiers"]["disk"] == hit.blocks * 64
            valid = corrupt_last_block_of_layer_1(volumes, hit) if fault else hit.blocks

            await run.engine.drop_memory_tier()
            overlapped, aborted = run.metrics.overlapped_units, run.metrics.prefill_aborted
            before, aborted_before = overlapped._value.get(), aborted._value.get()
            gate.open.clear()
            events = []

            async def held_hit():
                async for event in run.engine.run(run.job(p, max_tokens=6, hit=hit)):
                    events.append(event)

            task = asyncio.create_task(held_hit())
            await until(lambda: overlapped._value.get() > before, "a unit computed while layer 1 is held")
            assert gate.held >= 1 and run.engine.stats()["loading"] == 1
            assert not any(e["type"] == "token" for e in events)  # the first token waits for the last layer
            gate.open.set()
            await task
            ids = [e["id"] for e in events if e["type"] == "token"]
            digests = [e["logits_sha256"] for e in events if e["type"] == "token"]
            done = next(e for e in events if e["type"] == "done")
            assert ids == miss_ids and done["tiers"]["disk"] == valid * 64
            assert done["timing"]["prefetch_stall_s"] > 0
            if fault:
                assert aborted._value.get() > aborted_before
                assert run.metrics.cache_fallbacks.labels("verification")._value.get() >= 1
            else:
                assert digests == free_digests
            await run.idle()
            run.check_pages()
    finally:
        await gate.stop()
