"""The DeepSeek decoder: embedding, decoder layers (MLA + dense or MoE feed-forward), final norm, LM head."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import DenseMLP, Linear, MoE, RMSNorm, normal_param
from model.mla import KEY_BLOCK, MLAttention


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = MLAttention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype, rngs)

    # A layer runs in three steps so that a long prompt expands K/V once per layer (see ModelRunner):
    def project(self, x_TD, positions_T, cache_SA, start):
        return self.attn.project(self.input_norm(x_TD), positions_T, cache_SA, start)

    def finish(self, x_TD, q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded, key_block=KEY_BLOCK):
        """Attention output + residual, then the feed-forward + residual: (T, D)."""
        x_TD = x_TD + self.attn.attend(q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded, key_block)
        return x_TD + self.mlp(self.post_attn_norm(x_TD))


class Head(nnx.Module):
    """Final norm and LM head, applied to one position."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.param_dtype, rngs)

    def __call__(self, x_TD: jax.Array, index: jax.Array) -> jax.Array:
        x_1D = jax.lax.dynamic_slice_in_dim(x_TD, index, 1, axis=0)
        return (self.lm_head(self.norm(x_1D))[0]).astype(jnp.float32)  # (V,)


class DeepseekModel(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, on_layer: Callable[[int], None] | None = None):
        self.embed = normal_param(rngs, (cfg.vocab_size, cfg.hidden_size), cfg.param_dtype)  # (V, D)
        layers = []
        for layer in range(cfg.num_layers):
            layers.append(DecoderLayer(cfg, layer, rngs))
            if on_layer is not None:
                on_layer(layer)
        self.layers = nnx.List(layers)
        self.head = Head(cfg, rngs)
