"""The paged latent pool: per layer one device array (num_pages, page_tokens, A) of latents' raw bits (uint16 for
bfloat16: XLA:CPU widens a bfloat16 scatter over the WHOLE operand). A page is exactly one cache block. Page 0 is
the scratch page: padded tokens write there and padded table entries point at it; it is never owned. Blocks leave
and enter as stored rows: the pool's rows, or a codec's (kvstore/latent_format.py, run on the device).
"""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig

SCRATCH_PAGE = 0


def pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bits_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")


def as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, bits_dtype(x.dtype))


class PageRead(NamedTuple):
    bits: jax.Array  # (padded pages * page_tokens, row_width): raw bits, or a codec's stored rows
    rows: int  # rows that belong to the pages read


class LatentPool:
    def __init__(self, cfg: ModelConfig, num_pages: int, page_tokens: int, codec=None):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages, self.page_tokens, self.latent_dim = num_pages, page_tokens, cfg.latent_dim
        self.dtype = jnp.dtype(cfg.cache_dtype)
        self.codec = codec  # a kvstore.latent_format.RowCodec, or None: stored rows are (T, A) in cache dtype
        self.row_width, self.row_dtype = (codec.width, codec.dtype) if codec else (cfg.latent_dim, self.dtype)
        self.layers = [jnp.zeros((num_pages, page_tokens, cfg.latent_dim), bits_dtype(self.dtype))
                       for _ in range(cfg.num_layers)]

    @property
    def bytes(self) -> int:
        return len(self.layers) * self.num_pages * self.page_tokens * self.latent_dim * self.dtype.itemsize

    def place(self, layer: int, pages: list[int], latents_PA: np.ndarray) -> jax.Array:
        """Writes (len(pages) * page_tokens, row_width) stored rows into `pages` of one layer (decoded there);
        returns their device copy."""
        n, width = len(pages), self.row_width
        if latents_PA.shape != (n * self.page_tokens, width):
            raise ValueError(f"latents for {n} pages must be ({n * self.page_tokens}, {width}), got {latents_PA.shape}")
        padded = pow2(n)
        pages_N = np.full(padded, SCRATCH_PAGE, np.int32)
        pages_N[:n] = pages
        if padded == n and latents_PA.flags.c_contiguous:
            rows_NBA = latents_PA.reshape(n, self.page_tokens, width)
        else:
            rows_NBA = np.zeros((padded, self.page_tokens, width), latents_PA.dtype)
            rows_NBA[:n] = latents_PA.reshape(n, self.page_tokens, width)
        if self.codec is None:
            rows_NBA = rows_NBA.astype(self.dtype, copy=False).view(bits_dtype(self.dtype))  # no copy at cache dtype
        on_device = jnp.array(rows_NBA, copy=True)  # never an alias of the caller's (reused) buffer
        decode = self.codec and self.codec.decode
        self.layers[layer] = _place_pages(self.layers[layer], jnp.asarray(pages_N), on_device, decode)
        return on_device

    def read(self, pages: list[int]) -> list[PageRead]:
        """The stored rows of `pages` in every layer as device copies, in one dispatch (`host()` fetches each)."""
        n = len(pages)
        pages_N = np.full(pow2(n), SCRATCH_PAGE, np.int32)
        pages_N[:n] = pages
        encode = self.codec and self.codec.encode
        return [PageRead(bits, n * self.page_tokens)
                for bits in _read_pages(tuple(self.layers), jnp.asarray(pages_N), encode)]

    def host(self, read: PageRead) -> np.ndarray:
        """A `read` result as a host array of stored rows (row_width, row_dtype)."""
        return np.asarray(read.bits)[:read.rows].view(self.row_dtype)


@partial(jax.jit, donate_argnums=(0,), static_argnums=(3,))
def _place_pages(pool_PBA, pages_N, rows_NBW, decode=None):
    if decode is not None:  # (N, B, W) stored rows -> (N, B, A) raw bits
        rows_NBW = as_bits(decode(rows_NBW.reshape(-1, rows_NBW.shape[-1]))).reshape(*rows_NBW.shape[:2], -1)
    return pool_PBA.at[pages_N].set(rows_NBW)


@partial(jax.jit, static_argnums=(2,))
def _read_pages(layers, pages_N, encode=None):
    rows = [pool_PBA.at[pages_N].get(mode="promise_in_bounds").reshape(-1, pool_PBA.shape[-1]) for pool_PBA in layers]
    return rows if encode is None else [encode(r) for r in rows]
