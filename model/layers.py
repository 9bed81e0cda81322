"""Feed-forward blocks of a DeepSeek decoder layer: RMSNorm, dense SwiGLU, and the MoE (router, routed
experts from model/experts.py, shared experts)."""
from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.experts import routed_experts
from model.sharding import expert_parallel

INIT_STD = 0.02  # DeepSeek's initializer_range


def normal_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype: str) -> nnx.Param:
    """N(0, 0.02) weights seeded from the module's JAX key, drawn with numpy (eager jax.random compiles per shape)."""
    key = rngs.params()
    if isinstance(key, jax.core.Tracer):  # under nnx.eval_shape: only shapes matter
        return nnx.Param(jax.random.normal(key, shape, jnp.float32).astype(dtype))
    seed = np.asarray(jax.random.key_data(key)).astype(np.uint32)
    values = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * np.float32(INIT_STD)
    return nnx.Param(jnp.asarray(values, dtype=dtype))


class Linear(nnx.Module):
    """y = x @ kernel, kernel stored (in, out) like flax; HF's (out, in) weights are transposed on import."""

    def __init__(self, d_in: int, d_out: int, dtype: str, rngs: nnx.Rngs):
        self.kernel = normal_param(rngs, (d_in, d_out), dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.kernel[...]


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: str):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return self.weight[...] * x32.astype(x.dtype)


class DenseMLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int, dtype: str, rngs: nnx.Rngs):
        self.gate_proj = Linear(hidden, intermediate, dtype, rngs)
        self.up_proj = Linear(hidden, intermediate, dtype, rngs)
        self.down_proj = Linear(intermediate, hidden, dtype, rngs)

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x_TD)) * self.up_proj(x_TD))


class RouterSpec(NamedTuple):
    """The static routing settings (hashable, so it can live in the module's graph definition)."""
    n_experts: int
    top_k: int
    n_group: int
    topk_group: int
    scoring_func: str
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float


class MoE(nnx.Module):
    """DeepSeek MoE: routed experts chosen per token (group-limited top-k) plus always-on shared experts."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        E, D, I = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.spec = RouterSpec(E, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group, cfg.scoring_func,
                               cfg.topk_method, cfg.norm_topk_prob, cfg.routed_scaling_factor)
        self.router = normal_param(rngs, (E, D), "float32")  # float32 whatever the weights' dtype, as upstream
        self.e_score_correction_bias = nnx.Param(jnp.zeros((E,), jnp.float32))
        self.gate_proj = normal_param(rngs, (E, D, I), cfg.param_dtype)
        self.up_proj = normal_param(rngs, (E, D, I), cfg.param_dtype)
        self.down_proj = normal_param(rngs, (E, I, D), cfg.param_dtype)
        self.shared = (DenseMLP(D, I * cfg.n_shared_experts, cfg.param_dtype, rngs)
                       if cfg.n_shared_experts else None)
        self.method = "auto"  # the grouped SwiGLU's (model/experts.py); the served model names its platform's

    def route(self, x_TD: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Returns (weights_TK float32, expert ids_TK) for K = num_experts_per_tok."""
        cfg = self.spec
        E, K, G = cfg.n_experts, cfg.top_k, cfg.n_group
        logits_TE = x_TD.astype(jnp.float32) @ self.router[...].T
        if cfg.scoring_func == "sigmoid":
            scores_TE = jax.nn.sigmoid(logits_TE)
        else:
            scores_TE = jax.nn.softmax(logits_TE, axis=-1)
        choice_TE = scores_TE + self.e_score_correction_bias[...] if cfg.topk_method == "noaux_tc" else scores_TE
        if cfg.topk_method != "greedy" and G > 1:
            grouped_TGE = choice_TE.reshape(-1, G, E // G)
            if cfg.topk_method == "noaux_tc":
                group_scores_TG = jax.lax.top_k(grouped_TGE, 2)[0].sum(-1)
            else:
                group_scores_TG = grouped_TGE.max(-1)
            _, groups_TG = jax.lax.top_k(group_scores_TG, cfg.topk_group)
            keep_TG = jax.nn.one_hot(groups_TG, G, dtype=jnp.bool_).any(axis=1)  # (T, G)
            keep_TE = jnp.repeat(keep_TG, E // G, axis=1)
            choice_TE = jnp.where(keep_TE, choice_TE, -jnp.inf)
        _, ids_TK = jax.lax.top_k(choice_TE, K)
        weights_TK = jnp.take_along_axis(scores_TE, ids_TK, axis=1)
        if cfg.norm_topk_prob:
            weights_TK = weights_TK / (weights_TK.sum(-1, keepdims=True) + 1e-20)
        return weights_TK * cfg.routed_scaling_factor, ids_TK

    def __call__(self, x_TD: jax.Array) -> jax.Array:
        weights_TK, ids_TK = self.route(x_TD)
        routed_TD = expert_parallel(partial(routed_experts, method=self.method), x_TD, weights_TK, ids_TK,
                                    self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        if self.shared is not None:
            routed_TD = routed_TD + self.shared(x_TD)
        return routed_TD
