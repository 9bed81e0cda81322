"""ttft_bench, the in-process bound: reading the prefix's latents at the raw device's speed, and
computing the suffix with the prefix already in RAM (in-process ModelRunner, same model directory and
the engine's chunking), whichever is longer. What a hit through the stack adds to it is serving
overhead; the physical bound (ttft_physical_bound) is what the model code itself could gain.
"""
from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from bench.kv_bench import dd_read_gbps, parallel_direct_read_gbps
from model.runner import LatentCache, ModelRunner, enable_compilation_cache
from model.serving import serving_model
from model.weights import load_model


class SuffixCompute(NamedTuple):
    """Seconds (lists: one per repeat) for the suffix of a `tokens`-long prompt over a cached prefix."""
    tokens: int
    prefix_tokens: int
    compute_s: list[float]  # prefix latents already placed in the cache: pure suffix compute
    placed_s: list[float]  # the same, placing the prefix layer by layer from host arrays (a RAM hit)
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
                   cache_dtype: str = "bfloat16", reserve: int = 1, progress=None,
                   dtype: str = "bfloat16") -> list[SuffixCompute]:
    """Times runner.prefill(suffix, cache, start=P) as the engine calls it (reserve = max_tokens), over the
    model as the engine serves it (`dtype`, model/serving.py), after a warm-up call that compiles the
    shapes. Latent values are random: compute time does not depend on them (the presets this bench runs
    are dense)."""
    enable_compilation_cache()
    loaded = load_model(model_dir, cache_dtype=cache_dtype)
    cfg = loaded.config
    runner = ModelRunner(serving_model(loaded.model, dtype), cfg, chunk_tokens=chunk_tokens)
    rng = np.random.default_rng(0)
    out = []
    for tokens in lengths:
        prefix = tokens - suffix
        latents = [(rng.standard_normal((prefix, cfg.latent_dim), np.float32) * 0.1).astype(jax.numpy.bfloat16)
                   for _ in range(cfg.num_layers)]  # (P, A) per layer, cache dtype
        compute, placed, compute_cpu = [], [], []
        for rep in range(repeats + 1):  # the first is the warm-up
            ids = rng.integers(1_000, 100_000, suffix)
            cache = LatentCache(cfg)
            cache.reserve(prefix + suffix + reserve)  # what prefill reserves, so it does not grow mid-way
            for layer in range(cfg.num_layers):
                cache.place_prefix(layer, latents[layer])
            jax.block_until_ready(cache.layers)
            begin, cpu = time.perf_counter(), time.process_time()
            runner.prefill(ids, cache, start=prefix, reserve=reserve)
            c, c_cpu = time.perf_counter() - begin, time.process_time() - cpu
            begin = time.perf_counter()
            runner.prefill(ids, LatentCache(cfg), start=prefix, load_prefix=lambda layer: latents[layer],
                           reserve=reserve)
            p = time.perf_counter() - begin
            if rep:
                compute.append(c)
                placed.append(p)
                compute_cpu.append(c_cpu)
            if progress is not None:
                progress.update()
            del cache
        out.append(SuffixCompute(tokens, prefix, compute, placed, compute_cpu))
        del latents
        gc.collect()
    del runner, loaded
    gc.collect()
    return out
