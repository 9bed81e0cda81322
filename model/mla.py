"""Multi-head Latent Attention (DeepSeek-V2/V3): the layer's projections and the forms of its attention math.

Axes: T query tokens, S key positions, N heads, D hidden, C kv_lora_rank (c_kv dims), R qk_rope_head_dim (k_pe
dims), A = C + R (cached latent dims), H qk_nope_head_dim, V v_head_dim. The cache holds `c_kv` after the latent
RMSNorm and `k_pe` after RoPE; how attention reads it is an attention backend's (model/attention/). The two forms:
absorbed (W_UK folded into the query, scores against whole latents, W_UV after attention) and expanded (keys and
values materialised from c_kv, scores per head).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.layers import Linear, RMSNorm, normal_param
from model.rope import apply_rope, rope_tables, softmax_scale


def prefer_absorbed(cfg: ModelConfig, T: int, S: int) -> bool:
    """Whether the absorbed form costs fewer multiply-adds per head, ~T*S*(2C+R) + T*C*(H+V), than the expanded
    one, ~S*C*(H+V) + T*S*(H+R+V): short chunks over long prefixes favour absorbed, long chunks expanded."""
    C, R, H, V = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    return T * S * (2 * C + R) + T * C * (H + V) < S * C * (H + V) + T * S * (H + R + V)


def as_cache_dtype(rows: jax.Array, cache_dtype) -> jax.Array:
    """Cache rows handed over as their raw bits (uint16 for bfloat16: the pool's storage) as the cache dtype."""
    if jnp.issubdtype(rows.dtype, jnp.unsignedinteger):
        return jax.lax.bitcast_convert_type(rows, jnp.dtype(cache_dtype))
    return rows


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
        self.w_uk = normal_param(rngs, (C, N, cfg.qk_nope_head_dim), dtype)  # kv_b's part that makes k_nope
        self.w_uv = normal_param(rngs, (C, N, cfg.v_head_dim), dtype)  # kv_b's part that makes the values
        self.o_proj = Linear(N * cfg.v_head_dim, D, dtype, rngs)
        inv_freq, self.rope_scaling = rope_tables(cfg)
        self.inv_freq = tuple(float(f) for f in inv_freq)  # static: part of the graph definition
        self.scale = softmax_scale(cfg)
        self.wide = False  # prefill attention's products widened to float32 (model/serving.py)

    def products_dtype(self):
        """The input dtype of prefill attention's products: the weights', or float32 with `wide`."""
        return jnp.float32 if self.wide else self.w_uk.dtype

    def _rope(self, x_TNR: jax.Array, positions_T: jax.Array) -> jax.Array:
        return apply_rope(x_TNR, positions_T, np.asarray(self.inv_freq, np.float32), self.rope_scaling)

    def latents(self, x_TD: jax.Array, positions_T: jax.Array) -> jax.Array:
        """The cache entries of these tokens: (T, A) = [norm(c_kv) | rope(k_pe)] in cache dtype."""
        ckv_TX = self.kv_a_proj(x_TD)  # (T, C + R)
        c_TC = self.kv_a_norm(ckv_TX[:, : self.kv_lora_rank])
        kpe_TR = self._rope(ckv_TX[:, None, self.kv_lora_rank:], positions_T)[:, 0]
        return jnp.concatenate([c_TC, kpe_TR], axis=-1).astype(self.cache_dtype)

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

    def expand(self, kv_SA: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
        """Keys (N, S, H + R) = [K_nope | k_pe] and values (N, S, V) of latent rows (or their raw bits), at `dtype`."""
        kv_SA = as_cache_dtype(kv_SA, self.cache_dtype).astype(dtype)
        c_SC, kpe_SR = kv_SA[:, : self.kv_lora_rank], kv_SA[:, self.kv_lora_rank:]
        k_nope_NSH = jnp.einsum("sc,cnh->nsh", c_SC, self.w_uk[...], preferred_element_type=jnp.float32)
        kpe_NSR = jnp.broadcast_to(kpe_SR[None], (self.num_heads, *kpe_SR.shape))
        v_NSV = jnp.einsum("sc,cnv->nsv", c_SC, self.w_uv[...], preferred_element_type=jnp.float32)
        return jnp.concatenate([k_nope_NSH.astype(dtype), kpe_NSR], axis=-1), v_NSV.astype(dtype)

    def absorbed_queries(self, q_nope_NTH: jax.Array, q_pe_NTR: jax.Array) -> jax.Array:
        """(N, T, A) = [q_nope @ W_UK | q_pe] at the inputs' dtype: scores as one contraction over A (FlashMLA's)."""
        q_lat_NTC = jnp.einsum("nth,cnh->ntc", q_nope_NTH, self.w_uk[...], preferred_element_type=jnp.float32)
        return jnp.concatenate([q_lat_NTC.astype(q_nope_NTH.dtype), q_pe_NTR], axis=-1)

    def latent_values(self, out_NTC: jax.Array) -> jax.Array:
        """(N, T, V): the absorbed form's attention-weighted latents through W_UV, summed in float32."""
        return jnp.einsum("ntc,cnv->ntv", out_NTC, self.w_uv[...], preferred_element_type=jnp.float32)

    def output(self, out_NTV: jax.Array) -> jax.Array:
        """(T, D): the heads' values through o_proj; head-major products, then one transpose of the (small) result."""
        T = out_NTV.shape[1]
        return self.o_proj(out_NTV.astype(self.w_uk.dtype).transpose(1, 0, 2).reshape(T, self.num_heads * self.v_dim))
