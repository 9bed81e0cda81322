"""The disk tier beside the model thread: a disk hit's layers read into the sequence's pages, new blocks saved.

Loads run on the event loop, one at a time: each layer is read (verified, as stored) into a slot of one staging buffer
(`read_ahead + 2` layers, page-locked where it can be) and reaches the model thread through a completion queue;
placing it (decoding fp8 rows on the device) frees the slot, and the hit's prefill runs that layer (passes.py). Saves:
the model thread copies (and encodes) new full blocks on the device; the host copy and the write run on the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np

from kvstore.store import SaveResult
from model.latent_pool import SCRATCH_PAGE, LatentPool, pow2
from services.common.request_context import current_request_id
from services.engine.block_manager import BlockManager
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.engine_metrics import EngineMetrics
from services.engine.sequence import Job, Load, Sequence

log = logging.getLogger(__name__)


def pin(buffer: np.ndarray, platform: str) -> bool:
    """Page-locks a host buffer for the accelerator's DMA (CUDA: cudaHostRegister); False where it cannot."""
    if platform not in ("gpu", "cuda"):
        return False
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            runtime = ctypes.CDLL(name)
        except OSError:
            continue
        return runtime.cudaHostRegister(ctypes.c_void_p(buffer.ctypes.data), ctypes.c_size_t(buffer.nbytes), 0) == 0
    return False


class Slots:
    """The staging buffer's layer slots for one load: layer l is read into slot l % R once layer l - R is placed."""

    def __init__(self, buffer: np.ndarray, rows: int, loop: asyncio.AbstractEventLoop):
        self.buffer, self.rows, self.loop = buffer, rows, loop
        self.placed = 0  # layers placed (freed), in order
        self._freed = asyncio.Event()

    async def until_placed(self, layers: int) -> None:
        while self.placed < layers:
            self._freed.clear()
            await self._freed.wait()

    async def take(self, layer: int) -> np.ndarray:  # kvstore.LayerBuffers
        await self.until_placed(layer - len(self.buffer) + 1)
        return self.buffer[layer % len(self.buffer), :self.rows]

    def free(self, layer: int) -> None:
        """Layer `layer` is placed (any thread)."""
        self.loop.call_soon_threadsafe(self._free, layer)

    def _free(self, layer: int) -> None:
        self.placed = max(self.placed, layer + 1)
        self._freed.set()


class LayerRead(NamedTuple):
    """A completion: layer `layer` of `load` is in `slots` ((valid tokens, A) rows of the hit from block 0)."""
    seq: Sequence
    load: Load
    layer: int
    latents: np.ndarray
    slots: Slots


class Tiers:
    def __init__(self, cfg: EngineConfig, cache: CacheLink, latents: LatentPool, blocks: BlockManager,
                 metrics: EngineMetrics, wake: Callable[[], None], platform: str):
        self.cfg, self.cache, self.latents, self.blocks, self.metrics = cfg, cache, latents, blocks, metrics
        self.B, self.platform, self._wake = cfg.block_tokens, platform, wake
        self.loop: asyncio.AbstractEventLoop | None = None
        self.completions: queue.SimpleQueue[LayerRead] = queue.SimpleQueue()
        self.saves: set[concurrent.futures.Future] = set()  # saves handed to the event loop, not yet done
        self._saves_lock = threading.Lock()
        self._staging: np.ndarray | None = None  # (read_ahead + 2, rows, A), made on the first hit, grown by need
        self.pinned = False
        self._staging_lock: asyncio.Lock | None = None

    @property
    def store(self):
        return self.cache.store

    def load(self, seq: Sequence, end: int) -> None:
        """Starts reading the sequence's hit up to `end` tokens (model thread); it counts them computed from here."""
        seq.load = load = Load(seq.computed, end, time.perf_counter())
        seq.computed = end
        load.cancel = asyncio.run_coroutine_threadsafe(self._read(seq, load), self.loop).cancel

    async def _read(self, seq: Sequence, load: Load) -> None:
        current_request_id.set(seq.request_id)  # this task's reads carry it to the kvstore service
        self._staging_lock = self._staging_lock or asyncio.Lock()
        L, blocks = len(self.latents.layers), load.end // self.B
        async with self._staging_lock:
            slots = Slots(self._buffer(pow2(blocks) * self.B), pow2(blocks) * self.B, asyncio.get_running_loop())
            prefetch = self.store.prefetch(seq.job.hit.truncated(blocks), out=slots)
            try:
                for layer in range(L):
                    self.completions.put(LayerRead(seq, load, layer, await prefetch.layer(layer), slots))
                    self._wake()
                await slots.until_placed(L)  # (the staging buffer is the next load's after that)
            finally:
                await prefetch.aclose()  # no read writes into the buffer any more

    def _buffer(self, rows: int) -> np.ndarray:
        g = self.cfg
        if self._staging is None or self._staging.shape[1] < rows:
            model = self.latents
            self._staging = np.empty((g.read_ahead + 2, rows, model.row_width), model.row_dtype)  # stored rows
            self.pinned = pin(self._staging, self.platform)
            log.info("staging buffer: %d layers x %d tokens (%.0f MiB)%s", *self._staging.shape[:2],
                     self._staging.nbytes / 2**20, ", page-locked" if self.pinned else "")
        return self._staging

    def place(self, read: LayerRead) -> bool:
        """Puts a read layer into the sequence's pages and frees its slot; returns whether verification cut the load."""
        seq, load, layer = read.seq, read.load, read.layer
        if seq.load is not load:  # cancelled, or the sequence was preempted: nothing to place
            read.slots.free(layer)
            return False
        B, start = self.B, load.start // self.B
        valid = max(start, min(load.end // B, len(read.latents) // B))
        cut = valid * B < load.end
        if cut:
            log.warning("request %s: cached prefix cut from %d to %d blocks (verification)", seq.request_id,
                        load.end // B, valid)
            self.metrics.cache_fallbacks.labels("verification").inc()
            load.end = seq.computed = valid * B
        if valid > start:
            rows = read.slots.rows
            staged = read.slots.buffer[layer % read.slots.buffer.shape[0], :rows]
            # rows past the valid ones must not reach the scratch page: 0 x NaN in P.V would poison padded batches
            staged[valid * B:] = 0
            targets = [SCRATCH_PAGE] * (rows // B)
            targets[start:valid] = seq.pages[start:valid]
            self.latents.place(layer, targets, staged).block_until_ready()  # copied off the slot
        read.slots.free(layer)
        load.placed = layer + 1
        return cut

    def take(self, abort: Callable[[Sequence], None]) -> None:
        """Places the layers read since; a layer cut short closes its pass, the last ends the load (then published)."""
        while True:
            try:
                read = self.completions.get_nowait()
            except queue.Empty:
                return
            seq, load = read.seq, read.load
            if self.place(read):
                abort(seq)
                if load.end <= load.start:  # nothing left to read: a miss from here
                    self.cancel(seq)
            if seq.load is load and load.placed == len(self.latents.layers):
                seq.load = None
                if seq.preemptions == 0:
                    seq.disk_tokens = load.end - load.start
                seq.saved_blocks = max(seq.saved_blocks, load.end // self.B)
                self.blocks.publish_sequence(seq)

    def deadlines(self, loading: list[Sequence], tokens_per_s: float | None,
                  abort: Callable[[Sequence], None]) -> float | None:
        """Cancels loads slower than prefetch_deadline_factor times recomputing; returns the seconds to the next one."""
        now, soonest = time.perf_counter(), None
        for seq in loading:
            load = seq.load
            left = (max(0.5, self.cfg.prefetch_deadline_factor * (load.end - load.start) / tokens_per_s)
                    if tokens_per_s else float("inf")) - (now - load.begin)
            if left > 0:
                soonest = left if soonest is None else min(soonest, left)
                continue
            log.warning("request %s: disk hit of %d tokens took over %.2f s; recomputing", seq.request_id,
                        load.end - load.start, now - load.begin)
            self.metrics.cache_fallbacks.labels("deadline").inc()
            seq.stall_s += now - load.begin
            abort(seq)
            self.cancel(seq)
        return soonest

    def cancel(self, seq: Sequence) -> None:
        """Stops the sequence's load (model thread); it counts as computed only what it held before."""
        load, seq.load = seq.load, None
        if load is not None:
            seq.computed = min(seq.computed, load.start)
            load.cancel()

    def save(self, seq: Sequence, hashes: list[bytes], full: int) -> None:
        """Hands blocks [saved_blocks, full) of the sequence to the store (model thread)."""
        start = seq.saved_blocks
        layers = self.latents.read(seq.pages[start:full])
        seq.saved_blocks = full
        # pending from here, not from when the loop starts it: after 'done', pending_saves == 0 means published
        future = asyncio.run_coroutine_threadsafe(self._save(seq.job, hashes, layers, start), self.loop)
        with self._saves_lock:
            self.saves.add(future)
        future.add_done_callback(self._saved)
        seq.saves.append((start, full, future))

    async def hand_off(self, seq: Sequence, done: dict) -> None:
        """Emits a handoff's 'done' once its saves end, with `handoff_blocks`: the leading blocks of its prompt the
        index holds (its hit's and those its saves published, up to the first that failed)."""
        published = seq.saves[0][0] if seq.saves else seq.saved_blocks
        for start, end, future in seq.saves:
            result = None if start > published else await asyncio.wrap_future(future)
            if result is None:
                break
            published = start + result.blocks
            if published < end:
                break
        seq.events.put_nowait(done | {"handoff_blocks": published})

    def _saved(self, future) -> None:
        with self._saves_lock:
            self.saves.discard(future)

    async def _save(self, job: Job, hashes: list[bytes], layers: list, start: int) -> SaveResult | None:
        current_request_id.set(job.request_id)  # this task's writes carry it to the kvstore service
        try:
            host = await asyncio.to_thread(lambda: [self.latents.host(x) for x in layers])
            result = await self.store.save(hashes, host, start_block=start, tenant=job.tenant, retention=job.retention,
                                           epoch=job.epoch)
            self.metrics.saves.labels("ok").inc()
            self.metrics.saved_blocks.inc(result.blocks)
            return result
        except Exception as error:  # noqa: BLE001 - a failed save never fails the request
            log.warning("request %s: saving %d blocks failed: %r", job.request_id, len(hashes) - start, error)
            self.metrics.saves.labels("failed").inc()
            return None

    async def drain(self, timeout_s: float) -> None:
        """Waits for pending saves (each publishes only durable data)."""
        with self._saves_lock:
            saves = [asyncio.wrap_future(f) for f in self.saves]
        if saves:
            _, pending = await asyncio.wait(saves, timeout=timeout_s)
            for future in pending:
                future.cancel()
