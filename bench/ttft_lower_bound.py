"""ttft_bench, the in-process bound: reading the prefix's latents at the raw device's speed, and
computing the suffix with the prefix already in RAM (our Runner in this process, the prefix's latents in its
pool, same model directory and the engine's chunking), whichever is longer. What a hit through the stack adds
to it is serving overhead; the physical bound (ttft_physical_bound) is what the model code itself could gain.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from bench.kv_bench import dd_read_gbps, parallel_direct_read_gbps
from model.attention import make_backend
from model.latent_pool import LatentPool
from model.runner import Runner, Segment, enable_compilation_cache
from model.serving import serving_model
from model.weights import load_model

PAGE = 64  # tokens per page: the engine's block


class SuffixCompute(NamedTuple):
    """Seconds (lists: one per repeat) for the suffix of a `tokens`-long prompt over a cached prefix."""
    tokens: int
    prefix_tokens: int
    compute_s: list[float]  # prefix latents already placed in the pool: pure suffix compute
    placed_s: list[float]  # the same, each layer's prefix placed from host arrays just before its units (a RAM hit)
    compute_cpu_s: list[float]  # CPU time (all threads) of compute_s: vs wall time, what contention took


class RawDevice(NamedTuple):
    dd_gbps: float  # dd iflag=direct, 4 MiB requests (one in flight)
    parallel_gbps: float  # 8 O_DIRECT readers x 4 MiB
    gbps: float  # the better of the two: the reference a load is held to


def raw_device(directory: Path, size_mib: int) -> RawDevice:
    """Sequential O_DIRECT read bandwidth of `directory`'s device (kv_bench's measurement), GB/s."""
    path = directory / "ttft_dd.bin"
    try:
        dd = dd_read_gbps(path, size_mib, "4M")
        parallel = parallel_direct_read_gbps(path)
    finally:
        path.unlink(missing_ok=True)
    return RawDevice(dd, parallel, max(dd, parallel))


def suffix_compute(model_dir: Path, lengths: list[int], suffix: int, repeats: int, chunk_tokens: int = 512,
                   cache_dtype: str = "bfloat16", progress=None, dtype: str = "bfloat16") -> list[SuffixCompute]:
    """Times Runner.prefill of the suffix (one segment at position P = tokens - suffix) as the engine runs it,
    over the model as the engine serves it (`dtype`, model/serving.py, the engine's attention backend for this
    platform), after a warm-up call that compiles the shapes. The prefix's latents go into whole pages, the last
    one padded with zeros (the suffix then writes the rest of it). Latent values are random: compute time does
    not depend on them (the presets this bench runs are dense)."""
    enable_compilation_cache()
    loaded = load_model(model_dir, cache_dtype=cache_dtype)
    cfg = loaded.config
    platform = jax.default_backend()
    pool = LatentPool(cfg, 1 + -(-max(lengths) // PAGE), PAGE)
    backend = make_backend("auto", cfg, platform, dtype, page_tokens=PAGE)
    runner = Runner(serving_model(loaded.model, dtype, platform=platform), cfg, pool, backend,
                    chunk_tokens=chunk_tokens)
    rng = np.random.default_rng(0)
    out = []
    for tokens in lengths:
        prefix = tokens - suffix
        pages = list(range(1, 1 + -(-tokens // PAGE)))
        held = pages[:-(-prefix // PAGE)]  # the pages the prefix's latents touch (ttft_bench: at least one)
        latents = []  # per layer (len(held) * PAGE, A) at cache dtype, zeros past the prefix
        for _ in range(cfg.num_layers):
            rows_PA = np.zeros((len(held) * PAGE, cfg.latent_dim), pool.dtype)
            rows_PA[:prefix] = rng.standard_normal((prefix, cfg.latent_dim), np.float32) * 0.1
            latents.append(rows_PA)

        compute, placed, compute_cpu = [], [], []
        for rep in range(repeats + 1):  # the first is the warm-up
            segment = Segment(rng.integers(1_000, 100_000, suffix), prefix, pages)
            for layer in range(cfg.num_layers):
                pool.place(layer, held, latents[layer])
            jax.block_until_ready(pool.layers)
            begin, cpu = time.perf_counter(), time.process_time()
            jax.block_until_ready(runner.prefill([segment]).run())
            c, c_cpu = time.perf_counter() - begin, time.process_time() - cpu
            begin = time.perf_counter()
            run = runner.prefill([segment])
            for layer in range(cfg.num_layers):  # layer l placed, then its units: as a disk hit's layers arrive
                pool.place(layer, held, latents[layer])
                while run.done < run.units and run.layer == layer:
                    run.step()
            jax.block_until_ready(run.result)
            p = time.perf_counter() - begin
            if rep:
                compute.append(c)
                placed.append(p)
                compute_cpu.append(c_cpu)
            if progress is not None:
                progress.update()
        out.append(SuffixCompute(tokens, prefix, compute, placed, compute_cpu))
        del latents
        gc.collect()
    del runner, pool, loaded
    gc.collect()
    return out
