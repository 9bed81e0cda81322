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
    `fp8_dims` > 0 is the fp8 latent format (latent_format.py): a stored row is then `row_bytes`
    uint8, the leading fp8_dims (c_kv) in float8_e4m3fn with a float32 scale per 128 of them,
    the rest (k_pe) in `dtype`: FlashMLA's 656 bytes for DeepSeek. 0 (bf16 format): rows in `dtype`.
    Invariant: a stored row is a whole number of 8-byte words (fp8 rows are zero-padded to one).
    """

    num_layers: int
    latent_dim: int = 576
    block_tokens: int = 64
    dtype: str = "bfloat16"
    fp8_dims: int = 0

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.latent_dim < 1:
            raise ValueError(f"latent_dim must be >= 1, got {self.latent_dim}")
        if self.block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {self.block_tokens}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if not (0 <= self.fp8_dims < self.latent_dim and self.fp8_dims % 4 == 0):
            raise ValueError(f"fp8_dims must be a multiple of 4 in [0, latent_dim), got {self.fp8_dims}")
        if self.row_bytes % 8:
            raise ValueError(f"latent_dim * itemsize must be a multiple of 8 bytes, got {self.row_bytes}")

    @property
    def np_dtype(self) -> np.dtype:
        return _DTYPES[self.dtype]

    @property
    def latent_format(self) -> str:
        return "fp8" if self.fp8_dims else "bf16"

    @property
    def scale_tiles(self) -> int:
        """float32 scales per stored fp8 row: one per 128 fp8 dims (4 for DeepSeek)."""
        return -(-self.fp8_dims // 128)

    @property
    def row_parts(self) -> tuple[tuple[int, int, str], ...]:
        """(first byte, end byte, dtype) of each part of a stored fp8 row: c_kv, scales, k_pe."""
        scales = self.fp8_dims + 4 * self.scale_tiles
        rope = scales + (self.latent_dim - self.fp8_dims) * _DTYPES[self.dtype].itemsize
        return (0, self.fp8_dims, "float8_e4m3fn"), (self.fp8_dims, scales, "float32"), (scales, rope, self.dtype)

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's stored latent in one layer (1,152 for 576 x bf16, 656 in the fp8 format)."""
        if self.fp8_dims:
            return -(-self.row_parts[-1][1] // 8) * 8
        return self.latent_dim * _DTYPES[self.dtype].itemsize

    @property
    def row_width(self) -> int:
        """Elements of a stored row: latent_dim values, or row_bytes bytes in the fp8 format."""
        return self.row_bytes if self.fp8_dims else self.latent_dim

    @property
    def row_dtype(self) -> np.dtype:
        """dtype of stored rows as the store hands them out: `dtype`, or uint8 in the fp8 format."""
        return np.dtype(np.uint8) if self.fp8_dims else self.np_dtype

    @property
    def block_bytes(self) -> int:
        """Bytes of one stored block in one layer (72 KiB for 64 tokens x 576 x bf16, 41 KiB in fp8)."""
        return self.block_tokens * self.row_bytes

    def as_dict(self) -> dict:
        """The geometry as segment headers and the kvstore wire carry it (bf16 ones as before fp8 existed)."""
        fields = {"num_layers": self.num_layers, "latent_dim": self.latent_dim,
                  "block_tokens": self.block_tokens, "dtype": self.dtype}
        return fields | ({"fp8_dims": self.fp8_dims} if self.fp8_dims else {})
