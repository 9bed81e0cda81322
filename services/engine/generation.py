"""One generation: load the hit's prefix latents layer by layer while prefilling the suffix, decode,
and save the new full blocks after the first token is out.

All model compute runs on one worker thread (XLA already uses every core); requests interleave
there step by step. Disk reads run on the event loop and the store's I/O threads, ahead of compute.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import NamedTuple

import numpy as np

from kvstore import Hit, Prefetch, block_hashes
from model.runner import LatentCache, ModelRunner, Prefill
from model.sampling import Sampler, SamplingParams
from model.weights import LoadedModel
from services.engine.cache_link import CacheLink
from services.engine.config import EngineConfig
from services.engine.engine_metrics import EngineMetrics

log = logging.getLogger(__name__)


class Job(NamedTuple):
    request_id: str
    tokens: np.ndarray  # (n,) prompt token ids
    tenant: str
    tenant_salt: str
    hit: Hit  # from the gateway's lookup; may be empty
    params: SamplingParams
    retention: str


class QueueFull(Exception):
    """More requests are waiting than max_queue allows."""


class _PrefixShort(Exception):
    def __init__(self, valid_tokens: int, reason: str):
        self.valid_tokens, self.reason = valid_tokens, reason


class HitPrefill(NamedTuple):
    prefill: Prefill
    first_token: int
    loaded_tokens: int  # prompt tokens whose latents came from the cache
    stall_s: float  # time compute waited for disk
    seconds: float


class Generator:
    def __init__(self, loaded: LoadedModel, runner: ModelRunner, cache: CacheLink, cfg: EngineConfig,
                 metrics: EngineMetrics):
        self.loaded, self.runner, self.cache, self.cfg, self.metrics = loaded, runner, cache, cfg, metrics
        self.block_tokens = cfg.block_tokens
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="model")
        self._slots = asyncio.Semaphore(cfg.concurrency)
        self.waiting = 0
        self.active = 0
        self.saves: set[asyncio.Task] = set()
        self.prefill_tokens_per_s: float | None = None  # measured at warm-up; sets the prefetch deadline

    # -- admission --

    def check(self, tokens: np.ndarray, params: SamplingParams) -> None:
        """Raises ValueError (the user's fault) for ids out of range or a prompt too long."""
        self.runner.check_tokens(tokens, 0, params.max_tokens)

    async def run(self, job: Job) -> AsyncIterator[dict]:
        if self.waiting >= self.cfg.max_queue and self._slots.locked():
            raise QueueFull()
        self.waiting += 1
        self.metrics.queue_depth.set(self.waiting)
        try:
            yield {"type": "progress", "phase": "queued"}  # admitted: the caller may start its response
            await self._slots.acquire()
        finally:
            self.waiting -= 1
            self.metrics.queue_depth.set(self.waiting)
        self.active += 1
        self.metrics.in_flight.set(self.active)
        outcome = "cancelled"
        try:
            async for event in self._generate(job):
                yield event
            outcome = "ok"
        except Exception:
            outcome = "error"
            raise
        finally:
            self.active -= 1
            self.metrics.in_flight.set(self.active)
            self.metrics.requests.labels(outcome).inc()
            self._slots.release()

    # -- the request --

    async def _generate(self, job: Job) -> AsyncIterator[dict]:
        loop = asyncio.get_running_loop()
        begin = time.perf_counter()
        store = self.cache.store
        hit_tokens = min(job.hit.blocks * self.block_tokens, (job.tokens.size - 1) // self.block_tokens
                         * self.block_tokens) if store is not None else 0
        prefetch = store.prefetch(job.hit.truncated(hit_tokens // self.block_tokens)) if hit_tokens else None
        sampler = Sampler(job.params)
        try:
            first = await loop.run_in_executor(self.executor, self._prefill, job, prefetch, hit_tokens, sampler, loop)
        finally:
            if prefetch is not None:
                prefetch.cancel()
        ttft = time.perf_counter() - begin
        loaded, cache = first.loaded_tokens, first.prefill.cache
        self.metrics.ttft.labels("hit" if loaded else "miss").observe(ttft)
        self.metrics.prefill_tokens.labels("loaded").inc(loaded)
        self.metrics.prefill_tokens.labels("computed").inc(job.tokens.size - loaded)
        self.metrics.prefetch_stall.inc(first.stall_s)
        loaded_bytes = loaded * self.loaded.config.num_layers * self.loaded.config.latent_dim * cache.layers[0].dtype.itemsize
        self.metrics.bytes_loaded.inc(loaded_bytes)

        stops = set(job.params.stop_token_ids) | {self.loaded.config.eos_token_id}
        saved_blocks = loaded // self.block_tokens
        token, produced, finish = first.first_token, 0, "length"
        fed: list[int] = []  # answer tokens run through the model, so their latents are in the cache
        decode_begin = time.perf_counter()
        while True:
            if token in stops:
                finish = "stop"
                break
            yield {"type": "token", "id": token} if produced else {"type": "token", "id": token, "cached_tokens": loaded}
            produced += 1
            if produced == 1:
                saved_blocks = await self._save_new_blocks(job, cache, job.tokens, saved_blocks)
            if produced >= job.params.max_tokens:
                break
            fed.append(token)
            token = await loop.run_in_executor(self.executor, self._decode, token, cache, sampler)
        decode_s = time.perf_counter() - decode_begin
        self.metrics.generated_tokens.inc(produced)
        self.metrics.decode_seconds.inc(decode_s)
        # Blocks over prompt + answer (every token whose latent exists), so the next turn hits its own answer.
        history = np.concatenate([job.tokens, np.asarray(fed, np.int64)])
        await self._save_new_blocks(job, cache, history, saved_blocks)
        yield {"type": "done", "finish_reason": finish, "prompt_tokens": int(job.tokens.size),
               "cached_tokens": int(loaded), "completion_tokens": produced,
               "timing": {"ttft_s": ttft, "prefill_s": first.seconds, "prefetch_stall_s": first.stall_s,
                          "loaded_bytes": int(loaded_bytes), "decode_s": decode_s}}

    # -- on the model thread --

    def _prefill(self, job: Job, prefetch: Prefetch | None, hit_tokens: int, sampler: Sampler,
                 loop: asyncio.AbstractEventLoop) -> HitPrefill:
        begin = time.perf_counter()
        reserve = job.params.max_tokens
        rate = self.prefill_tokens_per_s
        # Waiting on disk longer than recomputing the prefix would take makes the hit a loss: give up
        # then. Only time spent waiting counts (not compilation or compute between the loads).
        stall_budget = max(0.5, self.cfg.prefetch_deadline_factor * hit_tokens / rate) if rate else None
        arrived: dict[int, np.ndarray] = {}
        stall = 0.0

        def load(layer: int, need: int) -> np.ndarray:
            nonlocal stall
            if layer not in arrived and prefetch.ready(layer):
                arrived[layer] = prefetch.result(layer)  # read ahead of compute: no wait, no loop round trip
            if layer not in arrived:
                waited = time.perf_counter()
                future = asyncio.run_coroutine_threadsafe(prefetch.layer(layer), loop)
                try:
                    arrived[layer] = future.result(None if stall_budget is None else max(0.0, stall_budget - stall))
                except FutureTimeout:
                    future.cancel()
                    raise _PrefixShort(0, "deadline") from None
                finally:
                    stall += time.perf_counter() - waited
            if arrived[layer].shape[0] < need:
                raise _PrefixShort(arrived[layer].shape[0], "verification")
            return arrived[layer][:need]

        prefix = hit_tokens
        while True:
            try:
                if prefix:
                    result = self.runner.prefill(job.tokens[prefix:], start=prefix,
                                                 load_prefix=lambda layer: load(layer, prefix), reserve=reserve,
                                                 prefix_ready=lambda layer: layer in arrived or prefetch.ready(layer))
                else:
                    result = self.runner.prefill(job.tokens, reserve=reserve)
                break
            except _PrefixShort as short:
                # Some latents failed verification or disk is too slow: use what is valid, recompute the rest.
                log.warning("request %s: cached prefix cut from %d to %d tokens (%s)", job.request_id, prefix,
                            short.valid_tokens, short.reason)
                self.metrics.cache_fallbacks.labels(short.reason).inc()
                prefix = short.valid_tokens
        token = sampler(result.logits)
        return HitPrefill(result, token, prefix, stall, time.perf_counter() - begin)

    def _decode(self, token: int, cache: LatentCache, sampler: Sampler) -> int:
        return sampler(self.runner.decode_step(token, cache))

    def _rows(self, cache: LatentCache, begin: int, end: int) -> list[np.ndarray]:
        return [cache.latents(layer, begin, end) for layer in range(self.loaded.config.num_layers)]

    # -- saving --

    async def _save_new_blocks(self, job: Job, cache: LatentCache, tokens: np.ndarray, saved_blocks: int) -> int:
        """Saves full blocks [saved_blocks, len(tokens)//B) in the background; returns the new high mark."""
        store, B = self.cache.store, self.block_tokens
        full = min(tokens.size, cache.length) // B
        if store is None or not self.cfg.save or full <= saved_blocks:
            return saved_blocks
        loop = asyncio.get_running_loop()
        layers = await loop.run_in_executor(self.executor, self._rows, cache, saved_blocks * B, full * B)
        hashes = block_hashes(tokens[: full * B].tolist(), self.loaded.fingerprint, job.tenant_salt, B)
        task = asyncio.create_task(self._save(store, hashes, layers, saved_blocks, job))
        self.saves.add(task)
        task.add_done_callback(self.saves.discard)
        return full

    async def _save(self, store, hashes, layers, start_block: int, job: Job) -> None:
        try:
            result = await store.save(hashes, layers, start_block=start_block, tenant=job.tenant,
                                      retention=job.retention)
            self.metrics.saves.labels("ok").inc()
            self.metrics.saved_blocks.inc(result.blocks)
        except Exception as error:  # noqa: BLE001 - a failed save never fails the request
            log.warning("request %s: saving %d blocks failed: %r", job.request_id, len(hashes) - start_block, error)
            self.metrics.saves.labels("failed").inc()

    async def drain(self, timeout_s: float) -> None:
        """Waits for pending saves (each publishes only durable data, so cutting one short leaves no entry)."""
        if self.saves:
            _, pending = await asyncio.wait(set(self.saves), timeout=timeout_s)
            for task in pending:
                task.cancel()

    # -- start-up --

    def warm_up(self) -> None:
        """Compiles the common shapes and measures prefill speed (for the prefetch deadline)."""
        cfg = self.loaded.config
        tokens = np.arange(1, 17) % cfg.vocab_size
        result = self.runner.prefill(tokens, reserve=2)
        self.runner.decode_step(int(tokens[0]), result.cache)
        n = min(self.cfg.chunk_tokens, 512)
        long = np.arange(n) % cfg.vocab_size
        self.runner.prefill(long)
        begin = time.perf_counter()
        self.runner.prefill(long)
        self.prefill_tokens_per_s = n / (time.perf_counter() - begin)
        log.info("warm: prefill %.0f tokens/s", self.prefill_tokens_per_s)
