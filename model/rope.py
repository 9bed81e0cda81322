"""YaRN rotary embedding, computed exactly as transformers' DeepseekV3 does (interleaved pair layout)."""
from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from model.config import ModelConfig


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(cfg: ModelConfig) -> tuple[np.ndarray, float]:
    """Returns (inv_freq (R/2,) float32, cos/sin scaling) for the rotary dims R = qk_rope_head_dim."""
    dim = cfg.qk_rope_head_dim
    base = cfg.rope_theta
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))  # (R/2,)
    yarn = cfg.rope_scaling
    if yarn is None:
        return (1.0 / pos_freqs).astype(np.float32), 1.0
    original = yarn["original_max_position_embeddings"]
    factor = yarn.get("factor") or cfg.max_position_embeddings / original
    mscale, mscale_all_dim = yarn.get("mscale"), yarn.get("mscale_all_dim")
    attention_factor = yarn.get("attention_factor")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = yarn.get("beta_fast") or 32
    beta_slow = yarn.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if yarn.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrapolation = 1.0 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN (DeepSeek-V2/V3)."""
    scale = cfg.qk_head_dim ** -0.5
    yarn = cfg.rope_scaling
    if yarn is not None and yarn.get("mscale_all_dim"):
        factor = yarn.get("factor") or cfg.max_position_embeddings / yarn["original_max_position_embeddings"]
        m = _yarn_mscale(factor, yarn["mscale_all_dim"])
        scale *= m * m
    return scale


def apply_rope(x_TNR: jnp.ndarray, positions_T: jnp.ndarray, inv_freq: np.ndarray, scaling: float) -> jnp.ndarray:
    """Rotates interleaved pairs (x0,x1),(x2,x3).. of the last axis into [evens' | odds'] halves. x_TNR: (T, N, R)
    for queries or (T, 1, R) for the shared key; positions_T: (T,) absolute positions."""
    freqs_TF = positions_T.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]  # (T, R/2)
    cos_T1F = (jnp.cos(freqs_TF) * scaling)[:, None, :].astype(x_TNR.dtype)
    sin_T1F = (jnp.sin(freqs_TF) * scaling)[:, None, :].astype(x_TNR.dtype)
    even, odd = x_TNR[..., 0::2], x_TNR[..., 1::2]
    return jnp.concatenate([even * cos_T1F - odd * sin_T1F, odd * cos_T1F + even * sin_T1F], axis=-1)
