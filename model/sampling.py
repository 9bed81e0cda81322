"""Token sampling: greedy, temperature, top-k, top-p, seeded; stop tokens are the caller's loop."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import NamedTuple

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


def _sample_one(logits_V: jax.Array, key: jax.Array, temperature: jax.Array, top_p: jax.Array,
                top_k: jax.Array) -> jax.Array:
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


_sample = jax.jit(_sample_one)


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


class SamplingRow(NamedTuple):
    params: SamplingParams
    seed: int  # 0 <= seed < 2**64: the request's seed, or a random one drawn once per request
    step: int  # tokens this request has sampled before: a seeded request replays its stream


def request_seed(params: SamplingParams) -> int:
    return params.seed % (1 << 64) if params.seed is not None else int.from_bytes(os.urandom(8), "little")


@jax.jit
def _sample_rows(logits_BV, seeds_B2, steps_B, temperature_B, top_p_B, top_k_B):
    def one(logits_V, seed_2, step, temperature, top_p, top_k):
        key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_2[0]), seed_2[1]), step)
        return _sample_one(logits_V, key, jnp.where(temperature > 0, temperature, 1.0), top_p, top_k)

    sampled_B = jax.vmap(one)(logits_BV, seeds_B2, steps_B, temperature_B, top_p_B, top_k_B)
    return jnp.where(temperature_B > 0, sampled_B, jnp.argmax(logits_BV, axis=-1))


@jax.jit
def _greedy_rows(logits_BV):
    return jnp.argmax(logits_BV, axis=-1)


def sample_batch(logits_BV: jax.Array, rows: list[SamplingRow]) -> np.ndarray:
    """One token per row of a (B, V) logits batch, each row with its own parameters, on the device.

    The one sampler interface of the engine: later work adds token masks, penalties, bias and
    logprobs here. Rows are padded to a power of two so batch sizes share compiled shapes."""
    n = len(rows)
    padded = 1 << max(0, (n - 1).bit_length())
    if padded != n:
        logits_BV = jnp.pad(logits_BV, ((0, padded - n), (0, 0)))
    if all(row.params.greedy for row in rows):
        return np.asarray(_greedy_rows(logits_BV))[:n]
    seeds = np.zeros((padded, 2), np.uint32)
    steps = np.zeros(padded, np.int32)
    temperature = np.zeros(padded, np.float32)
    top_p = np.ones(padded, np.float32)
    top_k = np.zeros(padded, np.int32)
    for i, row in enumerate(rows):
        seeds[i] = (row.seed & 0xFFFFFFFF, row.seed >> 32)
        steps[i], temperature[i], top_p[i] = row.step, row.params.temperature, row.params.top_p
        top_k[i] = min(row.params.top_k, np.iinfo(np.int32).max)
    return np.asarray(_sample_rows(logits_BV, seeds, steps, temperature, top_p, top_k))[:n]
