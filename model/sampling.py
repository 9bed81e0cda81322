"""Token sampling: greedy, temperature, top-k, top-p, seeded; OpenAI's presence/frequency penalties and
logit_bias, a grammar's token mask and logprobs, all on the device. Stop tokens are the caller's loop."""
from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from model.latent_pool import pow2

MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI allows


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0  # logit[t] -= presence * (count[t] > 0), over the generated tokens
    frequency_penalty: float = 0.0  # logit[t] -= frequency * count[t]
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    logprobs: int | None = None  # None: none; k in [0, 20]: the chosen token's logprob and the top k

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 2.0:
            raise ValueError(f"temperature must be in [0, 2], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias must have at most {MAX_LOGIT_BIAS} entries, got {len(self.logit_bias)}")
        if not all(token >= 0 and -100.0 <= bias <= 100.0 for token, bias in self.logit_bias):
            raise ValueError("logit_bias must map token ids >= 0 to biases in [-100, 100]")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def shapes_logits(self) -> bool:
        """Penalties or bias change this request's logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)


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


class SamplingRow(NamedTuple):
    params: SamplingParams
    seed: int  # 0 <= seed < 2**64: the request's seed, or a random one drawn once per request
    step: int  # tokens this request has sampled before: a seeded request replays its stream
    generated: Sequence[int] = ()  # the tokens sampled so far, which the penalties count
    allowed: np.ndarray | None = None  # (W,) uint32 words from a grammar: bit t % 32 of word t // 32 = t allowed


class TokenLogprobs(NamedTuple):
    """The model's own log-softmax (before temperature, penalties, bias and masks) at one position."""
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # (token id, logprob) of the k most likely, descending


class Sampled(NamedTuple):
    tokens: np.ndarray  # (n,) one token per row
    logprobs: list[TokenLogprobs | None]  # per row: None unless the row's params asked for logprobs


def request_seed(params: SamplingParams) -> int:
    return params.seed % (1 << 64) if params.seed is not None else int.from_bytes(os.urandom(8), "little")


ARGMAX_CHUNK = 128  # vocabulary entries per chunk of argmax_tokens' first pass


def argmax_tokens(logits_BV: jax.Array) -> jax.Array:
    """jnp.argmax over the vocabulary as plain reductions (XLA:CPU does not vectorize argmax's variadic one): each
    chunk's maximum, then the first chunk holding the row's, then the first entry in it. A row with a NaN gives 0."""
    B, V = logits_BV.shape
    C = -(-V // ARGMAX_CHUNK)
    padded_BV = logits_BV if C * ARGMAX_CHUNK == V else jnp.pad(
        logits_BV, ((0, 0), (0, C * ARGMAX_CHUNK - V)), constant_values=-jnp.inf)
    chunks_BCK = padded_BV.reshape(B, C, ARGMAX_CHUNK)
    chunk_max_BC = jnp.max(chunks_BCK, axis=-1)
    best_B1 = jnp.max(chunk_max_BC, axis=-1, keepdims=True)
    chunk_B = jnp.argmax(chunk_max_BC == best_B1, axis=-1)  # the first chunk that holds the maximum
    chunk_BK = jnp.take_along_axis(chunks_BCK, chunk_B[:, None, None], axis=1)[:, 0]
    entry_B = jnp.argmax(chunk_BK == best_B1, axis=-1)
    return (chunk_B * ARGMAX_CHUNK + entry_B).astype(jnp.int32)


def _sample_keyed(logits_V, seed_2, step, temperature, top_p, top_k, cut: bool):
    """cut (static): some row has a top-k or top-p cut, which needs a costly sort of the vocabulary."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed_2[0]), seed_2[1]), step)
    temperature = jnp.where(temperature > 0, temperature, 1.0)
    if not cut:
        return jax.random.categorical(key, logits_V.astype(jnp.float32) / temperature)
    return _sample_one(logits_V, key, temperature, top_p, top_k)


@functools.partial(jax.jit, static_argnames=("cut",))
def _sample_rows(logits_BV, seeds_B2, steps_B, temperature_B, top_p_B, top_k_B, cut: bool):
    sample = functools.partial(_sample_keyed, cut=cut)
    sampled_B = jax.vmap(sample)(logits_BV, seeds_B2, steps_B, temperature_B, top_p_B, top_k_B)
    return jnp.where(temperature_B > 0, sampled_B, argmax_tokens(logits_BV))


_greedy_rows = jax.jit(argmax_tokens)


@functools.partial(jax.jit, static_argnames=("logprobs", "top_n", "draw", "cut", "penalize", "bias", "mask"))
def _sample_shaped_rows(logits_BV, seeds_B2, steps_B, temperature_B, top_p_B, top_k_B, counted_BT, presence_B,
                        frequency_B, bias_ids_BK, bias_BK, allowed_BW, logprobs: bool, top_n: int, draw: bool,
                        cut: bool, penalize: bool, bias: bool, mask: bool):
    """Penalties (over the counted ids; id V pads), bias, the grammar's bitmask, then sampling; logprobs of the raw
    logits (top_n > 0 only: a top-k costs more). Returns (tokens, chosen, top ids, top), the last 3 None without."""
    raw_BV = logits_BV.astype(jnp.float32)
    B, V = raw_BV.shape
    rows_B1 = jnp.arange(B)[:, None]
    shaped_BV = raw_BV
    if penalize:
        counts_BV = jnp.zeros((B, V), jnp.float32).at[rows_B1, counted_BT].add(1.0, mode="drop")
        shaped_BV = shaped_BV - frequency_B[:, None] * counts_BV - presence_B[:, None] * (counts_BV > 0)
    if bias:
        shaped_BV = shaped_BV.at[rows_B1, bias_ids_BK].add(bias_BK, mode="drop")
    if mask:  # unpack the (B, W) uint32 words into (B, W * 32) bits, no gather
        bits_BW32 = (allowed_BW[:, :, None] >> jnp.arange(32, dtype=jnp.uint32)[None, None, :]) & 1  # uint32: logical
        bits_BV = bits_BW32.reshape(B, -1)[:, :V]
        shaped_BV = jnp.where(bits_BV > 0, shaped_BV, -jnp.inf)
    sampled_B = argmax_tokens(shaped_BV)
    if draw:  # some row samples at a temperature
        sample = functools.partial(_sample_keyed, cut=cut)
        drawn_B = jax.vmap(sample)(shaped_BV, seeds_B2, steps_B, temperature_B, top_p_B, top_k_B)
        sampled_B = jnp.where(temperature_B > 0, drawn_B, sampled_B)
    if not logprobs:
        return sampled_B, None, None, None
    lse_B = jax.nn.logsumexp(raw_BV, axis=-1)
    chosen_B = jnp.take_along_axis(raw_BV, sampled_B[:, None], axis=1)[:, 0] - lse_B
    if not top_n:
        return sampled_B, chosen_B, jnp.zeros((B, 0), jnp.int32), jnp.zeros((B, 0), jnp.float32)
    top_BN, top_ids_BN = jax.lax.top_k(raw_BV, top_n)  # the same order as the logprobs'
    return sampled_B, chosen_B, top_ids_BN, top_BN - lse_B[:, None]


def sample_batch(logits_BV: jax.Array, rows: list[SamplingRow]) -> Sampled:
    """The engine's sampler: a token per row of (B, V) logits (B >= len(rows)), each row with its own parameters,
    padded to powers of two (shared compiled shapes); a plain batch takes the plain paths (greedy: `argmax_tokens`)."""
    n = len(rows)
    padded = pow2(n)
    if logits_BV.shape[0] < padded:
        logits_BV = jnp.pad(logits_BV, ((0, padded - logits_BV.shape[0]), (0, 0)))
    elif logits_BV.shape[0] > padded:
        logits_BV = logits_BV[:padded]
    none = [None] * n
    shaped = any(row.params.shapes_logits or row.allowed is not None or row.params.logprobs is not None
                 for row in rows)
    if not shaped and all(row.params.greedy for row in rows):
        return Sampled(np.asarray(_greedy_rows(logits_BV))[:n], none)
    seeds = np.zeros((padded, 2), np.uint32)
    steps = np.zeros(padded, np.int32)
    temperature = np.zeros(padded, np.float32)
    top_p = np.ones(padded, np.float32)
    top_k = np.zeros(padded, np.int32)
    for i, row in enumerate(rows):
        seeds[i] = (row.seed & 0xFFFFFFFF, row.seed >> 32)
        steps[i], temperature[i], top_p[i] = row.step, row.params.temperature, row.params.top_p
        top_k[i] = min(row.params.top_k, np.iinfo(np.int32).max)
    cut = any(not row.params.greedy and (row.params.top_p < 1.0 or row.params.top_k > 0) for row in rows)
    if not shaped:
        return Sampled(np.asarray(_sample_rows(logits_BV, seeds, steps, temperature, top_p, top_k, cut=cut))[:n],
                       none)
    V = logits_BV.shape[1]
    penalized = [row.generated if row.params.presence_penalty or row.params.frequency_penalty else ()
                 for row in rows]
    counted = np.full((padded, pow2(max(1, *map(len, penalized)))), V, np.int32)  # V: dropped
    bias_ids = np.full((padded, pow2(max(1, *(len(row.params.logit_bias) for row in rows)))), V, np.int32)
    bias = np.zeros(bias_ids.shape, np.float32)
    presence = np.zeros(padded, np.float32)
    frequency = np.zeros(padded, np.float32)
    words = -(-V // 32)
    allowed = np.full((padded, words), 0xFFFFFFFF, np.uint32)
    for i, row in enumerate(rows):
        counted[i, :len(penalized[i])] = penalized[i]
        presence[i], frequency[i] = row.params.presence_penalty, row.params.frequency_penalty
        for j, (token, value) in enumerate(row.params.logit_bias):
            bias_ids[i, j], bias[i, j] = token, value
        if row.allowed is not None:
            w = min(words, row.allowed.size)
            allowed[i, :w] = row.allowed[:w]
            allowed[i, w:] = 0  # ids the grammar's tokenizer does not have
    asked = [row.params.logprobs for row in rows if row.params.logprobs is not None]
    top_n = min(MAX_LOGPROBS, pow2(max(asked))) if asked and max(asked) else 0  # few shapes to compile
    tokens, chosen, top_ids, top = _sample_shaped_rows(logits_BV, seeds, steps, temperature, top_p, top_k, counted,
                                                       presence, frequency, bias_ids, bias, allowed,
                                                       logprobs=bool(asked), top_n=top_n,
                                                       draw=any(not row.params.greedy for row in rows), cut=cut,
                                                       penalize=bool(presence.any() or frequency.any()),
                                                       bias=bool(bias.any()),
                                                       mask=any(row.allowed is not None for row in rows))
    tokens = np.asarray(tokens)[:n]
    logprobs = list(none)
    if asked:
        chosen, top_ids, top = np.asarray(chosen), np.asarray(top_ids), np.asarray(top)
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is not None:
                logprobs[i] = TokenLogprobs(float(chosen[i]), [(int(t), float(v)) for t, v in
                                                               zip(top_ids[i, :k], top[i, :k])])
    return Sampled(tokens, logprobs)
