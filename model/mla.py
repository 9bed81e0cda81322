"""Multi-head Latent Attention (DeepSeek-V2/V3) reading the latent cache in its stored form.

Axes: T query tokens of this chunk, S key positions (the cache view), N heads, D hidden,
C kv_lora_rank (c_kv dims), R qk_rope_head_dim (k_pe dims), A = C + R (cached latent dims),
H qk_nope_head_dim, V v_head_dim.

The cache holds, per layer and position, `c_kv` after the latent RMSNorm and `k_pe` after RoPE, at
cache precision. The current chunk's latents are written to the cache first and then read back from
it, so a prefix loaded from disk and a prefix computed a chunk earlier look the same to attention.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import cpu_kernels
from model.config import ModelConfig
from model.layers import Linear, RMSNorm, normal_param
from model.rope import apply_rope, rope_tables, softmax_scale


KEY_BLOCK = 512  # key rows per step of blockwise prefill attention


def key_block_for(view: int, key_block: int) -> int:
    """The largest power of two <= key_block dividing the view (views are whole pages or 256-row steps,
    so this is key_block itself in practice); the whole view when key_block is 0 (one pass)."""
    if key_block <= 0:
        return view
    block = 1 << (min(key_block, view).bit_length() - 1)
    while view % block:
        block //= 2
    return block


def prefer_absorbed(cfg: ModelConfig, T: int, S: int, kernel: bool = False, expanded_kernel: bool = False) -> bool:
    """Absorbed (W_UK into q, W_UV after attention) costs ~T*S*(2C+R) + T*C*(H+V) multiply-adds per head;
    expanded (K and V materialised from c_kv) costs ~S*C*(H+V) + T*S*(H+R+V). Short chunks over long
    prefixes (decode, a short suffix after a hit) favour absorbed; long prefill chunks favour expanded.
    With the CPU's absorbed prefill kernel (`kernel`) but not its expanded one over pages (`expanded_kernel`:
    the paged runner's prefill), absorbed is always taken: on `mini` it measured faster than XLA's expanded
    form at every size tried, 2,048 tokens from scratch included (BENCHMARKS.md, prefill attention kernel).
    With both, the same rule: the two kernels run their products at about the same rate."""
    if kernel and not expanded_kernel:
        return True
    C, R, H, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    absorbed = T * S * (2 * C + R) + T * C * (H + V)
    expanded = S * C * (H + V) + T * S * (H + R + V)
    return absorbed < expanded


class MLAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        D, N, C = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
        dtype = cfg.param_dtype
        self.num_heads, self.kv_lora_rank = N, C
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.cache_dtype = cfg.cache_dtype
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(D, cfg.q_lora_rank, dtype, rngs)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype)
            self.q_b_proj = Linear(cfg.q_lora_rank, N * cfg.qk_head_dim, dtype, rngs)
        else:
            self.q_proj = Linear(D, N * cfg.qk_head_dim, dtype, rngs)
        self.kv_a_proj = Linear(D, C + cfg.qk_rope_head_dim, dtype, rngs)
        self.kv_a_norm = RMSNorm(C, cfg.rms_norm_eps, dtype)
        # kv_b split by what it produces: W_UK (C, N, H) -> k_nope, W_UV (C, N, V) -> values.
        self.w_uk = normal_param(rngs, (C, N, cfg.qk_nope_head_dim), dtype)
        self.w_uv = normal_param(rngs, (C, N, cfg.v_head_dim), dtype)
        self.o_proj = Linear(N * cfg.v_head_dim, D, dtype, rngs)
        inv_freq, self.rope_scaling = rope_tables(cfg)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: part of the graph definition
        self.scale = softmax_scale(cfg)
        # Absorbed prefill attention by our CPU kernel (model/cpu_kernels.py); the served model sets it where
        # the kernel runs (bfloat16 on a CPU with AMX).
        self.prefill_kernel = False
        # Prefill attention's products take float32 inputs (bfloat16 ones widened) where the served model sets
        # it: a CPU without AMX, whose bfloat16 products are slow (model/serving.py).
        self.wide = False

    def products_dtype(self):
        """The input dtype of prefill attention's products and of expanded keys and values: the weights', or
        float32 with `wide`."""
        return jnp.float32 if self.wide else self.w_uk.dtype

    def _rope(self, x_TNR: jax.Array, positions_T: jax.Array) -> jax.Array:
        return apply_rope(x_TNR, positions_T, np.asarray(self.inv_freq, np.float32), self.rope_scaling)

    def latents(self, x_TD: jax.Array, positions_T: jax.Array) -> jax.Array:
        """The cache entries of these tokens: (T, A) = [norm(c_kv) | rope(k_pe)] in cache dtype."""
        ckv_TX = self.kv_a_proj(x_TD)  # (T, C + R)
        c_TC = self.kv_a_norm(ckv_TX[:, : self.kv_lora_rank])
        kpe_TR = self._rope(ckv_TX[:, None, self.kv_lora_rank:], positions_T)[:, 0]
        return jnp.concatenate([c_TC, kpe_TR], axis=-1).astype(self.cache_dtype)

    def project(self, x_TD: jax.Array, positions_T: jax.Array, cache_SA: jax.Array, start: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Queries of these tokens, and their latents written into the cache at [start, start+T).

        Returns (q_nope (N, T, H), q_pe (N, T, R) after RoPE, cache_SA)."""
        cache_SA = jax.lax.dynamic_update_slice(cache_SA, self.latents(x_TD, positions_T), (start, 0))
        return (*self.queries(x_TD, positions_T), cache_SA)

    def queries(self, x_TD: jax.Array, positions_T: jax.Array) -> tuple[jax.Array, jax.Array]:
        """(q_nope (N, T, H), q_pe (N, T, R) after RoPE) of these tokens."""
        T, N = x_TD.shape[0], self.num_heads
        if hasattr(self, "q_proj"):
            q_TX = self.q_proj(x_TD)
        else:
            q_TX = self.q_b_proj(self.q_a_norm(self.q_a_proj(x_TD)))
        q_TNK = q_TX.reshape(T, N, self.nope_dim + self.rope_dim)
        q_pe_TNR = self._rope(q_TNK[..., self.nope_dim:], positions_T)
        return q_TNK[..., : self.nope_dim].transpose(1, 0, 2), q_pe_TNR.transpose(1, 0, 2)

    def expand(self, cache_SA: jax.Array, view: int, dtype) -> tuple[jax.Array, jax.Array]:
        """Keys (N, S, H + R) = [K_nope | k_pe shared by every head] and V (N, S, V) of cache rows
        [0, view), from the latents at cache precision. Done once per layer per prefill, however many
        query chunks then read them; whole keys make each chunk's scores one matmul."""
        kv_SA = self._rows(cache_SA[:view], dtype)
        c_SC, kpe_SR = kv_SA[:, : self.kv_lora_rank], kv_SA[:, self.kv_lora_rank:]
        k_nope_NSH = jnp.einsum("sc,cnh->nsh", c_SC, self.w_uk[...], preferred_element_type=jnp.float32)
        kpe_NSR = jnp.broadcast_to(kpe_SR[None], (self.num_heads, *kpe_SR.shape))
        v_NSV = jnp.einsum("sc,cnv->nsv", c_SC, self.w_uv[...], preferred_element_type=jnp.float32)
        return jnp.concatenate([k_nope_NSH.astype(dtype), kpe_NSR], axis=-1), v_NSV.astype(dtype)

    def expand_into(self, rows_RA: jax.Array, first: jax.Array, into: tuple[jax.Array, jax.Array], dtype
                    ) -> tuple[jax.Array, jax.Array]:
        """`expand` of R cache rows that hold positions [first, first + R), written at those rows of `into` (keys
        and values as `expand` returns them, with more rows than the view): a sequence's later prefill
        segments expand their own rows only. Rows past `into`'s end are not written (a padded segment's tail)."""
        index_R = first + jnp.arange(rows_RA.shape[0])
        return tuple(buf.at[:, index_R].set(new, mode="drop")
                     for buf, new in zip(into, self.expand(rows_RA, rows_RA.shape[0], dtype)))

    def attend(self, q_nope_NTH: jax.Array, q_pe_NTR: jax.Array, positions_T: jax.Array, cache_SA: jax.Array,
               view: int, expanded: tuple[jax.Array, jax.Array] | None, key_block: int = KEY_BLOCK) -> jax.Array:
        """Attention of T queries over cache rows [0, view); returns (T, D).

        With `expanded` (K_nope, V from `expand`) it is the expanded form; without, the absorbed form
        (W_UK folded into q, W_UV applied after attention). Keys after a query's position are masked,
        which also hides padding and stale rows. Scores are head-major (N, T, S): plain batched matmuls.
        A chunk of several queries over a view longer than `key_block` rows is computed blockwise
        (online softmax, scores (N, T, key_block) at a time); otherwise, and with key_block=0, in one pass.

        Products take their inputs at the weights' dtype (a bfloat16-served model's queries arrive in
        float32 and are rounded here, model/serving.py), or in float32 with `wide`, and accumulate scores and
        outputs in float32.
        """
        T, dtype = q_nope_NTH.shape[1], self.products_dtype()
        q_nope_NTH, q_pe_NTR = q_nope_NTH.astype(dtype), q_pe_NTR.astype(dtype)
        block = key_block_for(view, key_block)
        if expanded is None and T > 1 and self.prefill_kernel and cache_SA.dtype == jnp.uint16:
            out_NTV = self._attend_kernel(q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view)
        elif T > 1 and block < view:
            out_NTV = self._attend_blockwise(q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded, block)
        else:
            out_NTV = self._attend_once(q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded)
        return self._output(out_NTV)

    def _output(self, out_NTV: jax.Array) -> jax.Array:
        """(T, D): the heads' values through the output projection. Head-major products, then one transpose of
        the (small) result: a dot that writes (T, N, .) directly measured 2.4x slower on XLA:CPU."""
        T = out_NTV.shape[1]
        return self.o_proj(out_NTV.astype(self.w_uk.dtype).transpose(1, 0, 2).reshape(T, self.num_heads * self.v_dim))

    def reads_pages(self, pool_PBA: jax.Array) -> bool:
        """Whether `attend_pages` can read this paged pool in place (the CPU's prefill kernel, pages of whole
        64-row steps of raw bfloat16 bits)."""
        return bool(self.prefill_kernel) and pool_PBA.dtype == jnp.uint16 and pool_PBA.shape[1] % 64 == 0

    def attend_pages(self, q_nope_NRH: jax.Array, q_pe_NRR: jax.Array, positions_MT: jax.Array, pool_PBA: jax.Array,
                     tables_MQ: jax.Array, view: int) -> jax.Array:
        """`attend` absorbed for M tiles of T query rows at once (R = M * T; tile m holds one sequence's tokens
        and attends over rows [0, view) of that sequence's pages, tables_MQ[m], of a paged pool of raw bits):
        (R, D). The CPU's prefill kernel reads the pages in place, every tile in one call (`reads_pages`)."""
        dtype = self.w_uk.dtype
        q_NRA = self._absorbed_queries(q_nope_NRH.astype(dtype), q_pe_NRR.astype(dtype))
        out_NRC = cpu_kernels.mla_prefill_paged_attention(q_NRA, pool_PBA, tables_MQ, positions_MT, self.scale,
                                                          view, self.kv_lora_rank)
        return self._output(self._latent_values(out_NRC.astype(dtype)))

    def laid_width(self) -> int:
        """Columns of `expand_pages`'s rows: a head's key (H + R) and value (V)."""
        return self.nope_dim + self.rope_dim + self.v_dim

    def expands_pages(self, pool_PBA: jax.Array) -> bool:
        """Whether `expand_pages` can run over this pool: `reads_pages`, and widths its kernel takes."""
        widths = (self.nope_dim, self.rope_dim, self.v_dim, self.kv_lora_rank)
        return (self.reads_pages(pool_PBA) and all(w % 32 == 0 for w in widths)
                and self.v_dim <= self.nope_dim + self.rope_dim <= 1024 and pool_PBA.shape[-1] <= 1024)

    def expand_pages(self, pool_PBA: jax.Array, table_Q: jax.Array, end: jax.Array, into_NSX: jax.Array
                     ) -> jax.Array:
        """The expanded form's keys and values of a sequence's first `end` rows (<= rows) of its pages, table_Q,
        computed by the CPU's prefill kernel from the latents on the tiles and laid out for `attend_laid`: raw
        bits (N, rows, H + R + V), in into_NSX's memory (`cpu_kernels.mla_expand_pages`). XLA's bfloat16
        products of the expansion had cost more than the attention they saved (a 16K view: 149 ms a layer,
        against 139 ms for the expanded attention and 410 for the absorbed)."""
        return cpu_kernels.mla_expand_pages(pool_PBA, table_Q, end, self.w_uk[...], self.w_uv[...], into_NSX)

    def attend_laid(self, q_nope_NTH: jax.Array, q_pe_NTR: jax.Array, positions_T: jax.Array,
                    laid_NSX: jax.Array) -> jax.Array:
        """`attend` expanded for T query rows of one sequence (positions below the `end` of `expand_pages`) over
        its keys and values laid out by `expand_pages`: (T, D)."""
        dtype = self.w_uk.dtype
        q_NTK = jnp.concatenate([q_nope_NTH.astype(dtype), q_pe_NTR.astype(dtype)], axis=-1)
        return self._output(cpu_kernels.mla_prefill_expanded_attention(q_NTK, laid_NSX, positions_T, self.scale))

    def _rows(self, rows_SA: jax.Array, dtype) -> jax.Array:
        """Cache rows at `dtype`. A cache may also hand its rows over as their raw bits (the runners' prefill
        views): XLA:CPU turned a bfloat16 view sliced inside the blockwise loop into a float32 copy of the whole
        view, made before the loop."""
        if jnp.issubdtype(rows_SA.dtype, jnp.unsignedinteger):
            rows_SA = jax.lax.bitcast_convert_type(rows_SA, jnp.dtype(self.cache_dtype))
        return rows_SA.astype(dtype)

    def _absorbed_queries(self, q_nope_NTH: jax.Array, q_pe_NTR: jax.Array) -> jax.Array:
        """(N, T, A) = [q_nope @ W_UK | q_pe] at the inputs' dtype: queries against whole latents, so the scores
        are one contraction over A (FlashMLA's layout). Two products, over c_kv and k_pe, summed, measured 5x
        slower on XLA:CPU (the 64-wide one runs at a fifth of the rate)."""
        q_lat_NTC = jnp.einsum("nth,cnh->ntc", q_nope_NTH, self.w_uk[...], preferred_element_type=jnp.float32)
        return jnp.concatenate([q_lat_NTC.astype(q_nope_NTH.dtype), q_pe_NTR], axis=-1)

    def _attend_kernel(self, q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view) -> jax.Array:
        """(N, T, V) as `_attend_blockwise` absorbed, by the CPU's prefill attention kernel: flash attention on
        AMX tiles over the latent view's raw bits, in blocks of 64 rows from row 0 whatever T and view are."""
        out_NTC = cpu_kernels.mla_prefill_attention(self._absorbed_queries(q_nope_NTH, q_pe_NTR), cache_SA,
                                                    positions_T, self.scale, view, self.kv_lora_rank)
        return self._latent_values(out_NTC.astype(q_nope_NTH.dtype))

    def _latent_values(self, out_NTC: jax.Array) -> jax.Array:
        """(N, T, V): the absorbed form's attention-weighted latents through W_UV (at their dtype, summed in
        float32)."""
        return jnp.einsum("ntc,cnv->ntv", out_NTC, self.w_uv[...], preferred_element_type=jnp.float32)

    def _attend_once(self, q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded) -> jax.Array:
        """(N, T, V): every score of the chunk at once, (N, T, view) float32."""
        dtype = q_nope_NTH.dtype
        if expanded is None:
            kv_SA = self._rows(cache_SA[:view], dtype)  # attention reads the latents at cache precision
            c_SC = kv_SA[:, : self.kv_lora_rank]
            scores_NTS = jnp.einsum("nta,sa->nts", self._absorbed_queries(q_nope_NTH, q_pe_NTR), kv_SA,
                                    preferred_element_type=jnp.float32)
        else:
            q_NTK = jnp.concatenate([q_nope_NTH, q_pe_NTR], axis=-1)
            scores_NTS = jnp.einsum("ntk,nsk->nts", q_NTK, expanded[0][:, :view], preferred_element_type=jnp.float32)
        causal_TS = jnp.arange(view)[None, :] <= positions_T[:, None]
        scores_NTS = jnp.where(causal_TS[None], scores_NTS.astype(jnp.float32) * self.scale, -jnp.inf)
        probs_NTS = jax.nn.softmax(scores_NTS, axis=-1).astype(dtype)
        if expanded is None:
            out_lat_NTC = jnp.einsum("nts,sc->ntc", probs_NTS, c_SC, preferred_element_type=jnp.float32)
            return self._latent_values(out_lat_NTC.astype(dtype))
        return jnp.einsum("nts,nsv->ntv", probs_NTS, expanded[1][:, :view], preferred_element_type=jnp.float32)

    def _attend_blockwise(self, q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded, block) -> jax.Array:
        """(N, T, V) as `_attend_once`, over key blocks of `block` rows with a running max and sum (flash
        attention's online softmax): the scores alive at once are (N, T, block), whatever the view.

        Absorbed, a block is (block, C) latents + (block, R) k_pe shared by all heads and the running
        output stays in the latent (N, T, C) until W_UV; expanded, a block is (N, block, H + R) keys and
        (N, block, V) values. Blocks past the chunk's last position are skipped (a traced trip count)."""
        dtype = q_nope_NTH.dtype
        N, T = q_nope_NTH.shape[:2]
        C = self.kv_lora_rank
        if expanded is None:
            q_NTA = self._absorbed_queries(q_nope_NTH, q_pe_NTR)
            acc_dims = C

            def scores_and_values(begin):
                kv_BA = self._rows(jax.lax.dynamic_slice_in_dim(cache_SA, begin, block), dtype)
                scores_NTB = jnp.einsum("nta,ba->ntb", q_NTA, kv_BA, preferred_element_type=jnp.float32)
                return scores_NTB, lambda p_NTB: jnp.einsum("ntb,bc->ntc", p_NTB, kv_BA[:, :C],
                                                            preferred_element_type=jnp.float32)
        else:
            q_NTK = jnp.concatenate([q_nope_NTH, q_pe_NTR], axis=-1)
            acc_dims = self.v_dim

            def scores_and_values(begin):
                k_NBK = jax.lax.dynamic_slice_in_dim(expanded[0], begin, block, axis=1)
                v_NBV = jax.lax.dynamic_slice_in_dim(expanded[1], begin, block, axis=1)
                scores_NTB = jnp.einsum("ntk,nbk->ntb", q_NTK, k_NBK, preferred_element_type=jnp.float32)
                return scores_NTB, lambda p_NTB: jnp.einsum("ntb,nbv->ntv", p_NTB, v_NBV,
                                                            preferred_element_type=jnp.float32)

        def step(b, carry):
            max_NT, sum_NT, acc_NTX = carry
            begin = b * block
            scores_NTB, weigh = scores_and_values(begin)
            causal_TB = (begin + jnp.arange(block))[None, :] <= positions_T[:, None]
            scores_NTB = jnp.where(causal_TB[None], scores_NTB * self.scale, -jnp.inf)
            new_max_NT = jnp.maximum(max_NT, scores_NTB.max(axis=-1))
            safe_NT = jnp.where(jnp.isfinite(new_max_NT), new_max_NT, 0.0)  # a row with no key seen yet
            p_NTB = jnp.exp(scores_NTB - safe_NT[..., None])
            rescale_NT = jnp.exp(max_NT - safe_NT)
            acc_NTX = acc_NTX * rescale_NT[..., None] + weigh(p_NTB.astype(dtype))
            return new_max_NT, sum_NT * rescale_NT + p_NTB.sum(axis=-1), acc_NTX

        blocks = jnp.minimum(view // block, jnp.max(positions_T) // block + 1)
        init = (jnp.full((N, T), -jnp.inf, jnp.float32), jnp.zeros((N, T), jnp.float32),
                jnp.zeros((N, T, acc_dims), jnp.float32))
        _, sum_NT, acc_NTX = jax.lax.fori_loop(0, blocks, step, init)
        out_NTX = (acc_NTX / sum_NT[..., None]).astype(dtype)
        if expanded is None:
            return self._latent_values(out_NTX)
        return out_NTX
