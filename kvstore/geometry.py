"""Cache geometry: the only model knowledge the block store has."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
}


@dataclass(frozen=True, slots=True)
class CacheGeometry:
    """Shape of the MLA latent cache.

    One latent row per token per layer: `latent_dim` values (512 c_kv + 64 k_pe for DeepSeek)
    in `dtype`. A block is `block_tokens` consecutive tokens; only full blocks are stored.
    Invariant: a token row is a whole number of 8-byte words (checksums sum uint64 words).
    """

    num_layers: int
    latent_dim: int = 576
    block_tokens: int = 64
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.latent_dim < 1:
            raise ValueError(f"latent_dim must be >= 1, got {self.latent_dim}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.row_bytes % 8:
            raise ValueError(f"latent_dim * itemsize must be a multiple of 8 bytes, got {self.row_bytes}")

    @property
    def np_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype]

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's latent in one layer (1,152 for 576 x bf16)."""
        return self.latent_dim * _DTYPES[self.dtype].itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block in one layer (72 KiB for 64 tokens x 576 x bf16)."""
        return self.block_tokens * self.row_bytes

    def as_dict(self) -> dict:
        return {"num_layers": self.num_layers, "latent_dim": self.latent_dim,
                "block_tokens": self.block_tokens, "dtype": self.dtype}
