"""An engine pod's memory, from the model preset: weights + latent pool + staging buffer + overhead.

Each term is what the engine itself allocates: the weights at the checkpoint's dtype (model/sharding.py's count
from the shapes), the pool as EngineConfig.pool_pages sizes it for --pool-gib, and the staging buffer of disk hits
(services/engine/tiers.py: read_ahead + 2 layer slots of the longest hit, a power of two of blocks, in stored rows).
On a GPU the weights and the pool are device memory; the host still stages the checkpoint and the disk hits, so the
pod's memory request counts all of it.
"""
from __future__ import annotations

from functools import cache
from typing import NamedTuple

import numpy as np

from kvstore.geometry import CacheGeometry
from kvstore.latent_format import fp8_dims
from model.config import preset
from services.engine.config import EngineConfig
from model.latent_pool import pow2

GIB = 1 << 30


class EngineMemory(NamedTuple):
    weights: int  # bytes
    pool: int
    staging: int
    overhead: int

    @property
    def total(self) -> int:
        return sum(self)

    @property
    def device(self) -> int:
        """What one accelerator holds: the weights and the pool."""
        return self.weights + self.pool


@cache  # DeepSeek-V2-Lite takes a second to count, V3 eight
def weight_bytes(preset_name: str) -> int:
    """The preset's parameters at the checkpoint's dtype, in bytes."""
    from model.sharding import bytes_per_device  # imports JAX and Flax: only when sizing

    return bytes_per_device(preset(preset_name), 1, 1)


def engine_memory(preset_name: str, cache_dtype: str, latent_format: str, pool_gib: float,
                  overhead_gib: float) -> EngineMemory:
    model = preset(preset_name, cache_dtype=cache_dtype)
    engine = EngineConfig(pool_gib=pool_gib, cache_dtype=cache_dtype, latent_format=latent_format)
    B = engine.block_tokens
    token_bytes = model.num_layers * model.latent_dim * np.dtype(model.cache_dtype).itemsize  # (L, A) per token
    pool = engine.pool_pages(token_bytes) * B * token_bytes
    stored = CacheGeometry(model.num_layers, model.latent_dim, B, cache_dtype,
                           fp8_dims(latent_format, model.latent_dim, model.qk_rope_head_dim))
    longest_hit_rows = pow2(-(-model.max_context // B)) * B
    staging = (engine.read_ahead + 2) * longest_hit_rows * stored.row_bytes
    return EngineMemory(weight_bytes(preset_name), pool, staging, int(overhead_gib * GIB))


def gib(n_bytes: int) -> str:
    """A Kubernetes quantity of whole GiB, rounded up."""
    return f"{-(-n_bytes // GIB)}Gi"
