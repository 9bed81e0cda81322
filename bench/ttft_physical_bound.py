"""ttft_bench, what no implementation on this machine can beat: a hit's physical lower bound,
max(prefix bytes / read bandwidth, suffix FLOPs / matmul peak).

The FLOPs are counted from the model config for the suffix's prefill over a cached prefix (every
projection, attention, MLP or MoE of each layer, the LM head for the one token sampled), in both MLA
forms, and the cheaper one counts:
  expanded  c_kv is up-projected (kv_b) into per-head keys and values for every prefix and suffix
            token, then ordinary attention over qk_head_dim / v_head_dim;
  absorbed  kv_b is folded into the query and the output (W_UK into q_nope, W_UV after attention), so
            attention runs on the 576-dim latent directly and the prefix is never expanded.
A multiply-add is 2 FLOPs. Causal: suffix token i attends to prefix + i + 1 tokens.
The read bandwidth is the raw device's (O_DIRECT, ttft_lower_bound.raw_device) for a hit whose prefix
is on disk, and a measured memcpy for one whose prefix is in RAM (page cache or the engine's pool):
attention has to stream the prefix's latents from memory at least once.
"""
from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from model.config import ModelConfig


class SuffixFlops(NamedTuple):
    """FLOPs of one suffix prefill over a cached prefix, per MLA form."""
    absorbed: float
    expanded: float

    @property
    def cheaper(self) -> float:
        return min(self.absorbed, self.expanded)

    @property
    def form(self) -> str:
        return "absorbed" if self.absorbed <= self.expanded else "expanded"


def suffix_flops(cfg: ModelConfig, prefix: int, suffix: int) -> SuffixFlops:
    """FLOPs to prefill `suffix` tokens after `prefix` cached tokens and sample one token."""
    d, h, s = cfg.hidden_size, cfg.num_heads, suffix
    nope, rope, v, lora = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    attended = s * prefix + s * (s + 1) // 2  # (query, key) pairs, causal within the suffix
    q_proj = (d * cfg.q_lora_rank + cfg.q_lora_rank * h * (nope + rope)) if cfg.q_lora_rank else d * h * (nope + rope)
    shared = s * (q_proj + d * cfg.latent_dim + h * v * d)  # q, kv_a (c_kv + k_pe), o_proj: per suffix token
    expanded = (shared + (prefix + s) * lora * h * (nope + v)  # kv_b over every token's c_kv
                + attended * h * (nope + rope + v))  # q.k and p.v per head
    absorbed = (shared + s * h * nope * lora + s * h * lora * v  # W_UK into q, W_UV after attention
                + attended * h * (cfg.latent_dim + lora))  # q.[c_kv|k_pe] and p.c_kv per head
    mlp = 0
    for layer in range(cfg.num_layers):
        if cfg.is_moe_layer(layer):
            mlp += s * (d * cfg.n_routed_experts  # router
                        + (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * d * cfg.moe_intermediate_size)
        else:
            mlp += s * 3 * d * cfg.intermediate_size  # SwiGLU: gate, up, down
    head = d * cfg.vocab_size  # logits of the last token only
    return SuffixFlops(2.0 * (cfg.num_layers * absorbed + mlp + head),
                       2.0 * (cfg.num_layers * expanded + mlp + head))


class MatmulPeak(NamedTuple):
    """GFLOP/s of a large jitted jnp matmul (float32 accumulation), best of the repeats (a peak), per input dtype."""
    size: int  # (size, size) @ (size, size)
    float32_gflops: float
    bfloat16_gflops: float

    @property
    def gflops(self) -> float:
        """The faster dtype: the bound may not assume the model runs slower than the machine can."""
        return max(self.float32_gflops, self.bfloat16_gflops)


def matmul_peak(size: int = 2048, repeats: int = 5) -> MatmulPeak:
    import jax
    import jax.numpy as jnp

    out = []
    for dtype in (jnp.float32, jnp.bfloat16):
        a = jax.random.normal(jax.random.key(0), (size, size), dtype)
        b = jax.random.normal(jax.random.key(1), (size, size), dtype)
        # float32 accumulation, as the engine's products run: a bfloat16 product that rounds its output
        # to bfloat16 takes a slower path on XLA:CPU (281 vs ~1,200 GFLOP/s measured here).
        matmul = jax.jit(lambda a, b: jnp.matmul(a, b, preferred_element_type=jnp.float32))
        matmul(a, b).block_until_ready()  # compile
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            matmul(a, b).block_until_ready()
            best = min(best, time.perf_counter() - begin)
        out.append(2.0 * size**3 / best / 1e9)
    return MatmulPeak(size, *out)


def memcpy_gbps(size_mib: int = 256, repeats: int = 5) -> float:
    """Bytes read per second by a large numpy copy (best of the repeats), GB/s."""
    src = np.ones(size_mib << 20, np.uint8)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - begin)
    return src.nbytes / best / 1e9
