"""The `pallas` attention backend: decode attention as a ragged paged MLA kernel for GPUs; prefill takes xla's forms.

The kernel (Pallas, lowered to Triton) reads each page once for both products, FlashMLA's way: a key is the whole
latent, a value its c_kv. A sequence's key blocks are cut into `splits` runs, each an online softmax of its own,
merged after the kernel with the new token's column (a long context fills the GPU at small batches). Heads are
padded to 16, the matrix units' smallest tile. On the CPU it runs interpreted; it does not lower for TPUs.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from model.attention.xla import KEY_BLOCK, XlaBackend
from model.mla import as_cache_dtype


def _decode_kernel(lengths_ref, tables_ref, q_c_ref, q_pe_ref, pool_ref, acc_ref, max_ref, sum_ref, *,
                   scale: float, splits: int, block_pages: int):
    b, s = pl.program_id(0), pl.program_id(1)
    page, C = pool_ref.shape[1], q_c_ref.shape[-1]
    rows = block_pages * page
    q_c, q_pe = q_c_ref[...], q_pe_ref[...]  # (N, C), (N, R)
    length = lengths_ref[b]
    blocks = pl.cdiv(length, rows)
    per_split = pl.cdiv(blocks, splits)
    first = s * per_split

    def block(i, carry):
        max_N, sum_N, acc_NC = carry
        pages = tables_ref[b, pl.ds(i * block_pages, block_pages)]
        kv_c = pool_ref[pages, :, pl.ds(0, C)].reshape(rows, C)
        kv_pe = pool_ref[pages, :, pl.ds(C, q_pe.shape[-1])].reshape(rows, -1)
        scores = (jnp.dot(q_c, kv_c.T, preferred_element_type=jnp.float32)
                  + jnp.dot(q_pe, kv_pe.T, preferred_element_type=jnp.float32)) * scale  # (N, rows)
        scores = jnp.where((i * rows + jnp.arange(rows))[None, :] < length, scores, -jnp.inf)
        new_max_N = jnp.maximum(max_N, scores.max(axis=-1))
        p = jnp.exp(scores - new_max_N[:, None])
        rescale_N = jnp.exp(max_N - new_max_N)
        acc_NC = acc_NC * rescale_N[:, None] + jnp.dot(p.astype(kv_c.dtype), kv_c, preferred_element_type=jnp.float32)
        return new_max_N, sum_N * rescale_N + p.sum(axis=-1), acc_NC

    N = q_c.shape[0]
    init = (jnp.full((N,), -jnp.inf, jnp.float32), jnp.zeros((N,), jnp.float32), jnp.zeros((N, C), jnp.float32))
    max_N, sum_N, acc_NC = jax.lax.fori_loop(first, jnp.minimum(first + per_split, blocks), block, init)
    acc_ref[...], max_ref[...], sum_ref[...] = acc_NC, max_N, sum_N


class PallasBackend(XlaBackend):
    name = "pallas"
    decode_by_longest = False  # each sequence reads its own pages

    def __init__(self, cfg, platform: str, dtype: str, key_block: int = KEY_BLOCK, splits: int = 4,
                 interpret: bool | None = None):
        super().__init__(cfg, platform, dtype, key_block)
        if platform == "tpu":
            raise ValueError("the pallas backend's decode kernel lowers for GPUs (Triton); on a TPU take xla")
        self.splits = splits  # runs per sequence (static: each row's bits are its own at one batch size)
        self.interpret = platform == "cpu" if interpret is None else interpret

    def decode(self, attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA):
        B, N, A = q_BNA.shape
        C, page = attn.kv_lora_rank, pool_PBA.shape[1]
        Np = max(16, N)  # the matrix units' smallest tile
        Hb = min(Np, 64)  # heads a program takes: their float32 outputs (Hb, 512) must stay in registers
        q_BNA = jnp.pad(q_BNA, ((0, 0), (0, -Np % Hb + Np - N), (0, 0)))
        Np = q_BNA.shape[1]
        pool = as_cache_dtype(pool_PBA, attn.cache_dtype).astype(q_BNA.dtype)  # a bitcast at the cache dtype
        block_pages = max(1, 64 // page)
        tables_BQ = jnp.pad(tables_BQ, ((0, 0), (0, -tables_BQ.shape[1] % block_pages)))

        def query(width: int) -> pl.BlockSpec:  # a program's heads of its sequence
            return pl.BlockSpec((None, Hb, width), lambda b, s, h: (b, h, 0))

        def out(*width: int) -> pl.BlockSpec:  # a program's heads of its sequence's run
            return pl.BlockSpec((None, None, Hb, *width), lambda b, s, h: (b, s, h, *(0,) * len(width)))

        whole = pl.BlockSpec(memory_space=pl.ANY)  # read through tables and positions, not in blocks
        acc, top, total = pl.pallas_call(
            functools.partial(_decode_kernel, scale=attn.scale, splits=self.splits, block_pages=block_pages),
            grid=(B, self.splits, Np // Hb),
            in_specs=[whole, whole, query(C), query(A - C), whole],
            out_specs=[out(C), out(), out()],
            out_shape=[jax.ShapeDtypeStruct((B, self.splits, Np, C), jnp.float32),
                       jax.ShapeDtypeStruct((B, self.splits, Np), jnp.float32),
                       jax.ShapeDtypeStruct((B, self.splits, Np), jnp.float32)],
            compiler_params=plgpu.CompilerParams(num_warps=4 if Hb <= 32 else 8, num_stages=2),
            interpret=self.interpret,
        )(positions_B, tables_BQ, q_BNA[..., :C], q_BNA[..., C:], pool)
        # the runs merged, and the new token's own key and value as one more column
        new_BA = latents_BA.astype(q_BNA.dtype)
        own_BN = jnp.einsum("ba,bna->bn", new_BA, q_BNA[:, :N], preferred_element_type=jnp.float32) * attn.scale
        top_BN = jnp.maximum(top[:, :, :N].max(axis=1), own_BN)
        weight_BSN = jnp.exp(top[:, :, :N] - top_BN[:, None])
        own_BN = jnp.exp(own_BN - top_BN)
        acc_BNC = (weight_BSN[..., None] * acc[:, :, :N]).sum(axis=1) + own_BN[..., None] * new_BA[:, None, :C]
        return acc_BNC / ((weight_BSN * total[:, :, :N]).sum(axis=1) + own_BN)[..., None]
