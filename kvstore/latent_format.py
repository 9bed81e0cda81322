"""The latent format on disk: bf16 (latents as the pool holds them) or fp8 (FlashMLA's FP8-with-scale layout).

fp8 stores each token's row (geometry.row_parts) as the c_kv dims in float8_e4m3fn, one float32 scale per 128 of
them, then k_pe unchanged (bf16): 656 bytes for DeepSeek instead of 1,152. As in FlashMLA's tests/quant.py, a
tile's scale is its max |x| / 448 rounded up to a power of two (at least 2^-13), so x / scale is exact before the
cast and never saturates. The codec is plain jnp (jittable on every platform): the engine quantizes on the device
before a save's device->host copy and dequantizes on the device while placing a disk hit into pages.

The two formats never meet: the cache fingerprint (block hashes, index keys, segment headers, MACs) of an fp8
cache is derived from the model's, and the header's geometry carries fp8_dims; a reader of the other format
finds no index entry, and a header of the other format is a foreign-geometry miss.
"""
from __future__ import annotations

import hashlib
from typing import Callable, NamedTuple

import numpy as np

from .geometry import CacheGeometry

LATENT_FORMATS = ("bf16", "fp8")
TILE_DIMS = 128      # c_kv dims per float32 scale
FP8_MAX = 448.0      # largest finite float8_e4m3fn
MIN_SCALE = 1e-4     # FlashMLA's floor (then rounded up to 2^-13)


def check_latent_format(latent_format: str, name: str = "latent_format") -> None:
    if latent_format not in LATENT_FORMATS:
        raise ValueError(f"{name} must be {' or '.join(LATENT_FORMATS)}, got {latent_format!r}")


def fp8_dims(latent_format: str, latent_dim: int, rope_dim: int) -> int:
    """CacheGeometry.fp8_dims of a format: the c_kv dims (latent_dim - rope_dim) for fp8, 0 for bf16."""
    check_latent_format(latent_format)
    return latent_dim - rope_dim if latent_format == "fp8" else 0


def cache_fingerprint(model_fingerprint: str, latent_format: str) -> str:
    """The fingerprint a cache's block hashes and segments carry: the model's for bf16 (caches written before the
    fp8 format stay valid), one derived from it for fp8."""
    check_latent_format(latent_format)
    if latent_format == "bf16":
        return model_fingerprint
    return hashlib.sha256(f"{model_fingerprint}|latent_format={latent_format}".encode()).hexdigest()[:32]


def quantize(latents_TA, g: CacheGeometry):
    """(T, latent_dim) latents in g.dtype (or their raw bits) -> (T, g.row_bytes) uint8 stored fp8 rows."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(g.dtype)
    if latents_TA.dtype != dtype:  # the pool's raw bits
        latents_TA = jax.lax.bitcast_convert_type(latents_TA, dtype)
    T, C, tiles = latents_TA.shape[0], g.fp8_dims, g.scale_tiles
    c_kv_TKD = jnp.pad(latents_TA[:, :C].astype(jnp.float32), ((0, 0), (0, tiles * TILE_DIMS - C))
                       ).reshape(T, tiles, TILE_DIMS)
    amax_TK = jnp.max(jnp.abs(c_kv_TKD), axis=-1)
    mantissa_TK, exponent_TK = jnp.frexp(jnp.maximum(amax_TK / FP8_MAX, MIN_SCALE))  # m * 2^e, m in [0.5, 1)
    exponent_TK = jnp.where(mantissa_TK == 0.5, exponent_TK - 1, exponent_TK)  # 2^e: the power of two >= it
    scale_TK = jax.lax.bitcast_convert_type((exponent_TK + 127).astype(jnp.int32) << 23, jnp.float32)  # exact
    q_TC = (c_kv_TKD / scale_TK[..., None]).astype(jnp.float8_e4m3fn).reshape(T, -1)[:, :C]
    parts = [jax.lax.bitcast_convert_type(q_TC, jnp.uint8),
             jax.lax.bitcast_convert_type(scale_TK, jnp.uint8).reshape(T, -1)]  # (T, tiles * 4), little-endian
    parts.append(jax.lax.bitcast_convert_type(latents_TA[:, C:], jnp.uint8).reshape(T, -1))
    row_T = jnp.concatenate(parts, axis=-1)
    return jnp.pad(row_T, ((0, 0), (0, g.row_bytes - row_T.shape[1])))


def dequantize(rows_TB, g: CacheGeometry):
    """(T, g.row_bytes) uint8 stored fp8 rows -> (T, latent_dim) latents in g.dtype (k_pe bit-exact)."""
    import jax
    import jax.numpy as jnp

    dtype = jnp.dtype(g.dtype)
    (_, c_end, _), (_, s_end, _), (_, r_end, _) = g.row_parts
    T, C, tiles = rows_TB.shape[0], g.fp8_dims, g.scale_tiles
    q_TC = jax.lax.bitcast_convert_type(rows_TB[:, :C], jnp.float8_e4m3fn).astype(jnp.float32)
    scale_TK = jax.lax.bitcast_convert_type(rows_TB[:, c_end:s_end].reshape(T, tiles, 4), jnp.float32)
    q_TKD = jnp.pad(q_TC, ((0, 0), (0, tiles * TILE_DIMS - C))).reshape(T, tiles, TILE_DIMS)
    c_kv_TC = (q_TKD * scale_TK[..., None]).reshape(T, -1)[:, :C]
    big = float(jnp.finfo(dtype).max)  # the cast can round a value past its tile's max: never to Inf
    c_kv_TC = jnp.clip(c_kv_TC, -big, big).astype(dtype)
    rope_TR = jax.lax.bitcast_convert_type(rows_TB[:, s_end:r_end].reshape(T, -1, dtype.itemsize), dtype)
    return jnp.concatenate([c_kv_TC, rope_TR], axis=-1)


class RowCodec(NamedTuple):
    """How a latent pool's rows are stored outside it (model/latent_pool.py): jittable, on (T, ...) rows."""
    width: int                   # elements of a stored row
    dtype: np.dtype              # of a stored row's elements
    encode: Callable             # (T, latent_dim) latents or their bits -> (T, width)
    decode: Callable             # (T, width) -> (T, latent_dim) latents in cache dtype


def row_codec(g: CacheGeometry) -> RowCodec | None:
    """The codec of g's format; None for bf16 (stored rows are the pool's rows)."""
    if not g.fp8_dims:
        return None
    return RowCodec(g.row_width, g.row_dtype, lambda x: quantize(x, g), lambda rows: dequantize(rows, g))
