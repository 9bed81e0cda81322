"""What the bytes of one block of one layer must pass before attention may read them: their
checksum (xxh3-64, per block and layer) and finite values (no NaN or Inf in any latent).

xxh3-64 over each 72 KiB block-layer: detects flipped bits, zeroed, torn and reordered data
(also 8-byte words swapped inside a row, which the earlier rowsum64 missed), at ~27 GB/s per core
measured against 19 GB/s for rowsum64 (bench/kv_bench.py reports it as `checksum_gbps`). It is not
a MAC: who wrote a block is established by block_mac.py over these checksums.
"""
from __future__ import annotations

import numpy as np
import xxhash

from .geometry import CacheGeometry

CHECKSUM = "xxh3_64"

# dtype name -> (signed view, unsigned view, smallest bit pattern of a positive Inf/NaN, of a negative one).
# A positive value's pattern is non-finite iff it is >= the first limit; as a signed integer every
# negative value is below every positive one, so the signed maximum finds those. A negative value's
# pattern is non-finite iff it is >= the second limit, the top of the unsigned range, so the unsigned
# maximum finds those. Two max reductions, no temporary array.
_NONFINITE_FROM = {
    "bfloat16": (np.int16, np.uint16, 0x7F80, 0xFF80),
    "float16": (np.int16, np.uint16, 0x7C00, 0xFC00),
    "float32": (np.int32, np.uint32, 0x7F800000, 0xFF800000),
    "float8_e4m3fn": (np.int8, np.uint8, 0x7F, 0xFF),  # no Inf; 0x7F / 0xFF are NaN
}


def block_checksums(rows: np.ndarray, block_tokens: int) -> np.ndarray:
    """xxh3-64 of each block of one layer: (n_blocks * block_tokens, latent_dim) -> (n_blocks,) uint64."""
    raw = np.ascontiguousarray(rows).reshape(-1).view(np.uint8)
    n_blocks = rows.shape[0] // block_tokens
    step = raw.size // max(n_blocks, 1)
    return np.fromiter((xxhash.xxh3_64_intdigest(raw[i * step:(i + 1) * step].data) for i in range(n_blocks)),
                       np.uint64, n_blocks)


def nonfinite_blocks(rows: np.ndarray, block_tokens: int, dtype: str) -> np.ndarray:
    """(n_blocks,) bool: which blocks of (n_blocks * block_tokens, latent_dim) hold a NaN or Inf
    (an exponent of all ones), from the bit patterns: no float conversion, no temporary."""
    signed, unsigned, positive_limit, negative_limit = _NONFINITE_FROM[dtype]
    n_blocks = rows.shape[0] // block_tokens
    positive = rows.view(signed).reshape(n_blocks, -1).max(axis=1) >= positive_limit
    negative = rows.view(unsigned).reshape(n_blocks, -1).max(axis=1) >= negative_limit
    return positive | negative


def nonfinite_stored_blocks(rows: np.ndarray, g: CacheGeometry) -> np.ndarray:
    """nonfinite_blocks of stored rows (n_blocks * block_tokens, g.row_width) in g.row_dtype: in the fp8 format, of
    each part of a row (c_kv, scales, k_pe) at its own dtype."""
    if not g.fp8_dims:
        return nonfinite_blocks(rows, g.block_tokens, g.dtype)
    return np.logical_or.reduce([nonfinite_blocks(rows[:, a:b].view(_NONFINITE_FROM[dtype][1]), g.block_tokens, dtype)
                                 for a, b, dtype in g.row_parts])
