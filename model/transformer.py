"""The DeepSeek decoder: embedding, decoder layers (MLA + dense or MoE feed-forward), final norm, LM head.
How a layer runs over the latent cache is the runner's (model/runner.py) and its attention backend's."""
from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from model.config import ModelConfig
from model.layers import DenseMLP, Linear, MoE, RMSNorm, normal_param
from model.mla import MLAttention


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rngs: nnx.Rngs):
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.attn = MLAttention(cfg, rngs)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        if cfg.is_moe_layer(layer):
            self.mlp = MoE(cfg, rngs)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, cfg.param_dtype, rngs)


class Head(nnx.Module):
    """Final norm and LM head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.param_dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, cfg.param_dtype, rngs)

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        return self.lm_head(self.norm(x_TD)).astype(jnp.float32)  # (T, V)


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
