"""The `xla` attention backend: plain JAX, every platform.

Decode reads pages through the tables, a (B, DECODE_BLOCK_ROWS, A) gather per online-softmax step; prefill gathers
each tile's pages into a view, attended in `key_block`-row blocks (expanded: its keys and values, once per layer).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from model.attention.base import AttentionBackend, PrefillForm
from model.mla import as_cache_dtype, prefer_absorbed

KEY_BLOCK = 512  # key rows per step of blockwise prefill attention
DECODE_BLOCK_ROWS = 512  # key rows per step of decode attention (whole pages)


def key_block_for(view: int, key_block: int) -> int:
    """The largest power of two <= key_block dividing the view; the whole view when key_block is 0 (one pass)."""
    if key_block <= 0:
        return view
    block = 1 << (min(key_block, view).bit_length() - 1)
    while view % block:
        block //= 2
    return block


def _online_step(carry, scores_XS, weigh):
    """One key block of an online softmax: carry (max, sum, acc) over the leading axes X; `weigh(p)` the block's
    values weighted by p. A row with no key seen yet keeps max -inf and adds exact zeros (invariant 4)."""
    max_X, sum_X, acc_XC = carry
    new_max_X = jnp.maximum(max_X, scores_XS.max(axis=-1))
    safe_X = jnp.where(jnp.isfinite(new_max_X), new_max_X, 0.0)
    p_XS = jnp.exp(scores_XS - safe_X[..., None])
    rescale_X = jnp.exp(max_X - safe_X)
    return new_max_X, sum_X * rescale_X + p_XS.sum(axis=-1), acc_XC * rescale_X[..., None] + weigh(p_XS)


def views(pool_PBA, tables_MQ) -> jax.Array:
    """Each tile's pages as raw bits (M, Q * page, A): XLA:CPU would widen a whole bfloat16 view first."""
    return pool_PBA.at[tables_MQ].get(mode="promise_in_bounds").reshape(tables_MQ.shape[0], -1, pool_PBA.shape[-1])


def _start(lead: tuple[int, ...], width: int):
    return jnp.full(lead, -jnp.inf, jnp.float32), jnp.zeros(lead, jnp.float32), jnp.zeros((*lead, width), jnp.float32)


class XlaBackend(AttentionBackend):
    name = "xla"

    def __init__(self, cfg, platform: str, dtype: str, key_block: int = KEY_BLOCK):
        super().__init__(cfg, platform, dtype)
        if key_block < 0:
            raise ValueError(f"key_block must be >= 0 (0 = one-pass attention), got {key_block}")
        self.key_block = key_block

    def decode(self, attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA):
        B, Q = tables_BQ.shape
        page, C, dtype = pool_PBA.shape[1], attn.kv_lora_rank, q_BNA.dtype
        K = max(1, min(Q, DECODE_BLOCK_ROWS // page))  # pages per key block; the runner's tables are whole blocks
        if Q % K:
            raise ValueError(f"decode tables of {Q} pages are not whole blocks of {K}")

        def block(b, carry):
            pages_BK = jax.lax.dynamic_slice_in_dim(tables_BQ, b * K, K, axis=1)
            kv_BSA = as_cache_dtype(pool_PBA[pages_BK], attn.cache_dtype).reshape(B, K * page, -1).astype(dtype)
            scores_BNS = jnp.einsum("bsa,bna->bns", kv_BSA, q_BNA, preferred_element_type=jnp.float32) * attn.scale
            rows_S = b * K * page + jnp.arange(K * page)
            scores_BNS = jnp.where((rows_S[None, :] < positions_B[:, None])[:, None], scores_BNS, -jnp.inf)
            return _online_step(carry, scores_BNS, lambda p: jnp.einsum(
                "bns,bsc->bnc", p.astype(dtype), kv_BSA[..., :C], preferred_element_type=jnp.float32))

        blocks = jnp.max(positions_B) // (K * page) + 1  # traced: the longest context's blocks, no more
        carry = jax.lax.fori_loop(0, blocks, block, _start((B, attn.num_heads), C))
        # the new token's own key and value: one more column of the softmax
        new_BA = latents_BA.astype(dtype)
        own_BN1 = jnp.einsum("ba,bna->bn", new_BA, q_BNA, preferred_element_type=jnp.float32)[..., None] * attn.scale
        _, sum_BN, acc_BNC = _online_step(carry, own_BN1, lambda p: p * new_BA[:, None, :C].astype(jnp.float32))
        return acc_BNC / sum_BN[..., None]

    def prefill_form(self, n, end, choice="auto", tiles=1):
        absorbed = prefer_absorbed(self.cfg, n, end) if choice == "auto" else choice == "absorbed"
        return PrefillForm("absorbed", False) if absorbed else PrefillForm("expanded", True)

    def prefill_context(self, attn, pool_PBA, tables_MQ, end, form, into=None):
        """Expanded: each tile's view and its keys and values, once per layer for all chunks; absorbed: None."""
        if form != "expanded":
            return None
        views_MSA = views(pool_PBA, tables_MQ)
        return views_MSA, jax.vmap(lambda view_SA: attn.expand(view_SA, attn.products_dtype()))(views_MSA)

    def prefill_attend(self, attn, q_nope_NRH, q_pe_NRR, positions_MT, pool_PBA, tables_MQ, context, form):
        M, T = positions_MT.shape
        N, dtype = q_nope_NRH.shape[0], attn.products_dtype()
        views_MSA, expanded = context or (views(pool_PBA, tables_MQ), None)

        def tile(q_nope_NTH, q_pe_NTR, positions_T, view_SA, expanded):  # (T, D), its rows' o_proj its own
            return attn.output(self.attend(attn, q_nope_NTH.astype(dtype), q_pe_NTR.astype(dtype), positions_T,
                                           view_SA, expanded))

        if M == 1:  # one sequence's chunk: no vmap
            return tile(q_nope_NRH, q_pe_NRR, positions_MT[0], views_MSA[0],
                        None if expanded is None else (expanded[0][0], expanded[1][0]))
        split = (lambda x: x.reshape(N, M, T, -1).transpose(1, 0, 2, 3))
        return jax.vmap(tile)(split(q_nope_NRH), split(q_pe_NRR), positions_MT, views_MSA, expanded).reshape(M * T, -1)

    def attend(self, attn, q_nope_NTH, q_pe_NTR, positions_T, view_SA, expanded) -> jax.Array:
        """(N, T, V): T queries over view rows [0, position], blockwise. A key block is, absorbed, (block, A) latents
        shared by all heads (output latent until W_UV); expanded, (N, block, H + R) keys and (N, block, V) values."""
        dtype = q_nope_NTH.dtype
        S, C = view_SA.shape[0], attn.kv_lora_rank
        block = key_block_for(S, self.key_block)
        if expanded is None:
            q_NTK, width = attn.absorbed_queries(q_nope_NTH, q_pe_NTR), C

            def keys(begin):
                kv_BA = as_cache_dtype(jax.lax.dynamic_slice_in_dim(view_SA, begin, block), attn.cache_dtype)
                kv_BA = kv_BA.astype(dtype)
                return kv_BA, (lambda p: jnp.einsum("ntb,bc->ntc", p, kv_BA[:, :C], preferred_element_type=jnp.float32))
            score = "nta,ba->ntb"
        else:
            q_NTK, width = jnp.concatenate([q_nope_NTH, q_pe_NTR], axis=-1), attn.v_dim

            def keys(begin):
                k_NBK = jax.lax.dynamic_slice_in_dim(expanded[0], begin, block, axis=1)
                v_NBV = jax.lax.dynamic_slice_in_dim(expanded[1], begin, block, axis=1)
                return k_NBK, (lambda p: jnp.einsum("ntb,nbv->ntv", p, v_NBV, preferred_element_type=jnp.float32))
            score = "ntk,nbk->ntb"

        def scores(begin):
            k, weigh = keys(begin)
            scores_NTB = jnp.einsum(score, q_NTK, k, preferred_element_type=jnp.float32) * attn.scale
            causal_TB = (begin + jnp.arange(block))[None, :] <= positions_T[:, None]
            return jnp.where(causal_TB[None], scores_NTB, -jnp.inf), weigh

        if block == S:  # one block: a plain softmax, no loop
            scores_NTS, weigh = scores(0)
            out_NTX = weigh(jax.nn.softmax(scores_NTS, axis=-1).astype(dtype)).astype(dtype)
        else:  # blocks past the last query skipped
            def step(b, carry):
                scores_NTB, weigh = scores(b * block)
                return _online_step(carry, scores_NTB, lambda p: weigh(p.astype(dtype)))

            blocks = jnp.minimum(S // block, jnp.max(positions_T) // block + 1)
            _, sum_NT, acc_NTX = jax.lax.fori_loop(0, blocks, step, _start(q_NTK.shape[:2], width))
            out_NTX = (acc_NTX / sum_NT[..., None]).astype(dtype)
        return attn.latent_values(out_NTX) if expanded is None else out_NTX
