"""Token sampling: greedy, temperature, top-k, top-p, seeded; stop tokens are the caller's loop."""
from __future__ import annotations

import os
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@jax.jit
def _sample(logits_V: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array, top_k: jax.Array) -> jax.Array:
    """top_k is traced (0 = no cut), so a client choosing new values never triggers a recompile."""
    logits_V = logits_V.astype(jnp.float32) / temperature
    order_V = jnp.argsort(-logits_V)
    sorted_V = logits_V[order_V]
    rank_V = jnp.arange(sorted_V.shape[0])
    sorted_V = jnp.where((top_k > 0) & (rank_V >= top_k), -jnp.inf, sorted_V)
    probs_V = jax.nn.softmax(sorted_V)
    # Keep the smallest set whose mass reaches top_p (the first token always stays).
    drop_V = (jnp.cumsum(probs_V) - probs_V) >= top_p
    sorted_V = jnp.where(drop_V, -jnp.inf, sorted_V)
    return order_V[jax.random.categorical(key, sorted_V)]


class Sampler:
    """One per request: its own PRNG stream, so a seeded request samples the same tokens every time."""

    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(4), "little")
        self._key = jax.random.key(seed)
        self._step = 0

    def __call__(self, logits_V: jax.Array | np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(np.asarray(logits_V)))
        key = jax.random.fold_in(self._key, self._step)
        self._step += 1
        return int(_sample(jnp.asarray(logits_V), key, jnp.float32(p.temperature), jnp.float32(p.top_p),
                           jnp.int32(min(p.top_k, np.iinfo(np.int32).max))))
