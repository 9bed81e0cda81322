"""Runs the model over a latent cache: chunked prefill (on top of cached prefix latents), layer by layer.

Shapes never follow the prompt length: chunks are padded to power-of-two token buckets, and cache
buffers and the cache views attention reads are bucketed (eighths of a power of two), so every prompt
length reuses a handful of compiled layer functions (also kept in the persistent compilation cache).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.config import ModelConfig
from model.mla import KEY_BLOCK, key_block_for, prefer_absorbed
from model.sampling import SamplingParams, SamplingRow, request_seed, sample_batch
from model.transformer import DeepseekModel

MIN_VIEW = 256  # tokens: the smallest cache view / buffer
MIN_CHUNK = 16  # tokens: the smallest padded chunk (a single decode token is its own bucket)


def enable_compilation_cache(path: str | None = None) -> None:
    path = path or os.environ.get("DEEPINFER_JAX_CACHE", os.path.expanduser("~/.cache/deepinfer/jax"))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every compile is kept: the small ones (a slice, a gather, the sampler: 30-100 ms each) add up to
    # seconds of stalls per new process, and a cache load takes a few ms.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def bucket(n: int) -> int:
    """Rows of a cache buffer or view holding n: steps of an eighth of the enclosing power of two (at
    least MIN_VIEW), so a shape wastes at most ~12% while each octave has at most 8 compiled shapes."""
    step = max(MIN_VIEW, _pow2(n) // 8)
    return -(-max(n, 1) // step) * step


def prefill_chunk(cfg: ModelConfig, total: int, chunk_tokens: int, budget_bytes: int, key_block: int) -> int:
    """Largest power-of-two chunk (<= chunk_tokens) of a prompt ending at `total` whose float32
    attention work space fits budget_bytes.

    One-pass attention (key_block 0) holds (N, T, view) scores, so a long prompt shrinks the chunk (16
    tokens for V3's 128 heads at 16K); blockwise attention holds one key block's scores plus its
    running (N, T, C or V) output, so the chunk no longer shrinks with the prompt."""
    view = bucket(total)
    block = key_block_for(view, key_block)
    per_token = cfg.num_heads * block * 4 * 3  # scores, exp, probs
    if block < view:  # the running output and its update
        per_token += cfg.num_heads * max(cfg.kv_lora_rank, cfg.v_head_dim) * 4 * 2
    fit = max(MIN_CHUNK, budget_bytes // per_token)
    return min(_pow2(chunk_tokens), 1 << (fit.bit_length() - 1))


@jax.jit
def _embed(embed_VD: jax.Array, tokens_T: jax.Array) -> jax.Array:
    return jnp.take(embed_VD, tokens_T, axis=0)


class SplitModule:
    """A module split once for jitted calls: its graph definition, and its state as one flat list of arrays.
    `jit(body)` makes body(module, *args) a function of args alone. Passed to jit as a static argument and a
    pytree, a layer's graph definition was hashed, and its nnx State flattened, on every call: ~0.3 ms of Python
    per call, 5.5 ms before a 64-token prefill segment of `mini` was dispatched (18 calls)."""

    def __init__(self, module: nnx.Module):
        self.graphdef, state = nnx.split(module)
        self.leaves, self.state_def = jax.tree.flatten(state)

    @property
    def state(self) -> nnx.State:
        return jax.tree.unflatten(self.state_def, self.leaves)

    def jit(self, body: Callable, static_argnums: tuple[int, ...] = (),
            donate_argnums: tuple[int, ...] = ()) -> Callable:
        """body(module, *args) jitted as f(*args); argnums count args (the module is not one)."""
        return partial(_jit_body(body, self.graphdef, self.state_def, static_argnums, donate_argnums), self.leaves)


@lru_cache(maxsize=None)
def _jit_body(body, graphdef, state_def, static_argnums, donate_argnums):
    """One jitted function per body and module structure (graph definition and state layout): layers of one
    structure, and runners of one model, share its compiles."""

    def call(leaves, *args):
        return body(nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves)), *args)

    return jax.jit(call, static_argnums=tuple(i + 1 for i in static_argnums),
                   donate_argnums=tuple(i + 1 for i in donate_argnums))


def _project(layer, x_TD, cache_SA, start):
    positions_T = start + jnp.arange(x_TD.shape[0], dtype=jnp.int32)
    return layer.project(x_TD, positions_T, cache_SA, start)


def _expand(layer, cache_SA, view):
    return layer.attn.expand(cache_SA, view, layer.attn.products_dtype())


def _bits_dtype(dtype) -> jnp.dtype:
    return jnp.dtype(f"uint{jnp.dtype(dtype).itemsize * 8}")


def _as_bits(x: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, _bits_dtype(x.dtype))


def _finish(layer, x_TD, q_nope_NTH, q_pe_NTR, cache_SA, start, view, expanded, key_block):
    positions_T = start + jnp.arange(x_TD.shape[0], dtype=jnp.int32)
    # Attention reads the cache as raw bits (MLAttention._rows): handed bfloat16 rows, XLA:CPU converted the whole
    # cache to float32 before the blockwise loop.
    return layer.finish(x_TD, q_nope_NTH, q_pe_NTR, positions_T, _as_bits(cache_SA), view, expanded, key_block)


class LayerCalls(NamedTuple):
    """A layer's jitted building blocks (`SplitModule.jit` of the bodies above)."""
    project: Callable  # (x_TD, cache_SA, start) -> q_nope_NTH, q_pe_NTR, cache_SA (donated)
    expand: Callable  # (cache_SA, view) -> expanded K and V
    finish: Callable  # (x_TD, q_nope_NTH, q_pe_NTR, cache_SA, start, view, expanded, key_block) -> (T, D)

    @classmethod
    def of(cls, layer: SplitModule) -> "LayerCalls":
        return cls(layer.jit(_project, donate_argnums=(1,)), layer.jit(_expand, static_argnums=(1,)),
                   layer.jit(_finish, static_argnums=(5, 7)))


@partial(jax.jit, static_argnums=(0, 1, 7, 8), donate_argnums=(5,))
def _decode(layer_defs, head_def, embed_VD, layer_states, head_state, caches, token, view, absorbed, start):
    """One decode step through every layer in a single dispatch: (logits (V,), new caches)."""
    x_TD = jnp.take(embed_VD, token[None], axis=0)  # (1, D)
    positions_T = start[None]
    out = []
    for graphdef, state, cache_SA in zip(layer_defs, layer_states, caches):
        layer = nnx.merge(graphdef, state)
        q_nope_NTH, q_pe_NTR, cache_SA = layer.project(x_TD, positions_T, cache_SA, start)
        expanded = None if absorbed else layer.attn.expand(cache_SA, view, x_TD.dtype)
        x_TD = layer.finish(x_TD, q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded)
        out.append(cache_SA)
    return nnx.merge(head_def, head_state)(x_TD, 0), out


def _head(head, x_TD, index):
    return head(x_TD, index)


@partial(jax.jit, static_argnums=(1,))
def _grow(cache_SA: jax.Array, capacity: int) -> jax.Array:
    return jnp.pad(cache_SA, ((0, capacity - cache_SA.shape[0]), (0, 0)))


@partial(jax.jit, donate_argnums=(0,))
def _place(cache_SA: jax.Array, latents_PA: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_slice(cache_SA, latents_PA.astype(cache_SA.dtype), (0, 0))


class LatentCache:
    """Per-layer latent buffers (capacity, A) in cache dtype; rows [0, length) are valid."""

    def __init__(self, cfg: ModelConfig, capacity: int = MIN_VIEW):
        self.cfg = cfg
        self.capacity = bucket(capacity)
        self.layers = [jnp.zeros((self.capacity, cfg.latent_dim), cfg.cache_dtype) for _ in range(cfg.num_layers)]
        self.length = 0

    def reserve(self, tokens: int) -> None:
        if tokens > self.capacity:
            self.capacity = bucket(tokens)
            self.layers = [_grow(buf, self.capacity) for buf in self.layers]

    def place_prefix(self, layer: int, latents_PA: np.ndarray | jax.Array) -> None:
        """Loads a prefix's latents (P, A) for one layer into rows [0, P)."""
        if latents_PA.shape[1:] != (self.cfg.latent_dim,):
            raise ValueError(f"prefix latents must be (P, {self.cfg.latent_dim}), got {latents_PA.shape}")
        rows = latents_PA.shape[0]
        self.reserve(rows)
        # Pad to a bucket so prefixes of every length share a few compiled shapes; the pad rows lie
        # past the prefix, where the suffix's latents overwrite them or causal masking hides them.
        padded = min(bucket(rows), self.capacity)
        if padded != rows:
            latents_PA = np.pad(np.asarray(latents_PA), ((0, padded - rows), (0, 0)))
        self.layers[layer] = _place(self.layers[layer], jnp.asarray(latents_PA))

    def latents(self, layer: int, begin: int, end: int) -> np.ndarray:
        """Rows [begin, end) of one layer as a host array (P, A) in cache dtype (for saving)."""
        if not 0 <= begin <= end <= self.length:
            raise ValueError(f"latent rows [{begin}, {end}) outside the valid [0, {self.length})")
        return np.asarray(self.layers[layer][begin:end])


class Prefill(NamedTuple):
    logits: np.ndarray  # (V,) float32 at the last prompt position
    cache: LatentCache




LayerLoader = Callable[[int], "np.ndarray | jax.Array"]  # layer -> prefix latents (P, A); may block on disk


class ModelRunner:
    """Owns a model's weights split per layer; all compute goes through a few jitted functions."""

    def __init__(self, model: DeepseekModel, cfg: ModelConfig, chunk_tokens: int = 512,
                 attention: str = "auto", attention_budget_bytes: int = 512 << 20, key_block: int = KEY_BLOCK):
        if attention not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"attention must be auto, absorbed or expanded, got {attention!r}")
        if key_block < 0:
            raise ValueError(f"key_block must be >= 0 (0 = one-pass attention), got {key_block}")
        self.cfg = cfg
        self.chunk_tokens = _pow2(chunk_tokens)
        self.attention = attention
        self.attention_budget_bytes = attention_budget_bytes
        self.key_block = key_block  # key rows per step of prefill attention; 0 = all scores at once
        self.embed_VD = model.embed[...]
        self.split_layers = [SplitModule(layer) for layer in model.layers]
        self.layer_calls = [LayerCalls.of(layer) for layer in self.split_layers]
        self.split_head = SplitModule(model.head)
        self._head = self.split_head.jit(_head)
        # (graph definition, state) of each layer and of the head, for the whole-model decode jits
        self.layers = [(layer.graphdef, layer.state) for layer in self.split_layers]
        self.head = (self.split_head.graphdef, self.split_head.state)
        self.prefill_kernel = bool(model.layers[0].attn.prefill_kernel)  # absorbed prefill by the CPU kernel

    # -- building blocks, one layer at a time (the engine interleaves disk reads with these) --

    def check_tokens(self, tokens: np.ndarray, start: int, extra: int = 0) -> None:
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            bad = int(tokens[(tokens < 0) | (tokens >= self.cfg.vocab_size)][0])
            raise ValueError(f"token id {bad} out of range [0, {self.cfg.vocab_size})")
        if start + tokens.size + extra > self.cfg.max_context:
            raise ValueError(f"prompt of {start + tokens.size} tokens (+{extra} to generate) exceeds the "
                             f"context length {self.cfg.max_context}")

    def chunk_size(self, total: int) -> int:
        return prefill_chunk(self.cfg, total, self.chunk_tokens, self.attention_budget_bytes, self.key_block)

    def embed(self, tokens_T: np.ndarray) -> jax.Array:
        return _embed(self.embed_VD, jnp.asarray(tokens_T, jnp.int32))

    def layer(self, layer: int, chunks: list[jax.Array], cache: LatentCache, start: int) -> list[jax.Array]:
        """One decoder layer over consecutive chunks of T tokens (positions start, start+T, ...).

        Layer-major: every chunk's latents go into the cache first, K/V are expanded from the cache once
        for the whole span (expanded form), then each chunk attends over its causal view. A long prompt
        thus expands each latent once per layer, not once per chunk.
        """
        T = chunks[0].shape[0]
        span = T * len(chunks)
        calls = self.layer_calls[layer]
        buf = cache.layers[layer]
        queries = []
        for i, x_TD in enumerate(chunks):
            q_nope_NTH, q_pe_NTR, buf = calls.project(x_TD, buf, np.int32(start + i * T))
            queries.append((q_nope_NTH, q_pe_NTR))
        full_view = self._view(cache, start + span)
        absorbed = (prefer_absorbed(self.cfg, span, full_view, self.prefill_kernel) if self.attention == "auto"
                    else self.attention == "absorbed")
        expanded = None if absorbed else calls.expand(buf, full_view)
        out = [calls.finish(x_TD, *queries[i], buf, np.int32(start + i * T), self._view(cache, start + (i + 1) * T),
                            expanded, self.key_block)
               for i, x_TD in enumerate(chunks)]
        cache.layers[layer] = buf
        return out

    @staticmethod
    def _view(cache: LatentCache, end: int) -> int:
        """Cache rows a query chunk ending at `end` attends over (bucketed, so shapes repeat)."""
        return min(cache.capacity, bucket(end))

    def logits(self, x_TD: jax.Array, index: int) -> jax.Array:
        return self._head(x_TD, np.int32(index))

    # -- whole passes --

    def prefill(self, tokens: np.ndarray | list[int], cache: LatentCache | None = None, start: int = 0,
                load_prefix: LayerLoader | None = None, chunk_tokens: int | None = None,
                reserve: int = 0, prefix_ready: Callable[[int], bool] | None = None) -> Prefill:
        """`prefill_on_device` with the logits copied to the host."""
        logits, cache = self.prefill_on_device(tokens, cache, start, load_prefix, chunk_tokens, reserve, prefix_ready)
        return Prefill(np.asarray(logits), cache)

    def prefill_on_device(self, tokens: np.ndarray | list[int], cache: LatentCache | None = None, start: int = 0,
                          load_prefix: LayerLoader | None = None, chunk_tokens: int | None = None, reserve: int = 0,
                          prefix_ready: Callable[[int], bool] | None = None) -> tuple[jax.Array, LatentCache]:
        """Computes tokens at positions [start, start+n) over a cache whose rows [0, start) are the prefix.

        load_prefix(l), when given, supplies layer l's prefix latents (start, A) just before layer l of
        the first chunk runs, so reading layer l+1 from disk overlaps computing layer l.
        prefix_ready(l), when given, says whether load_prefix(l) would return at once: then the layers
        already queued keep running while layer l is queued behind them (no wait, so no stall to
        measure); otherwise they are finished first, so that the time load_prefix blocks is exactly
        the time compute waits for disk.
        """
        tokens = np.asarray(tokens, np.int64)
        self.check_tokens(tokens, start, reserve)
        n = tokens.size
        chunk = _pow2(chunk_tokens) if chunk_tokens else self.chunk_size(start + n)
        T = 1 if n == 1 else min(chunk, _pow2(max(n, MIN_CHUNK)))
        count = -(-n // T)
        needed = start + count * T + reserve  # the padded tail chunk writes rows too
        cache = cache or LatentCache(self.cfg, needed)
        cache.reserve(needed)
        padded = np.pad(tokens, (0, count * T - n))
        chunks = [self.embed(padded[i * T:(i + 1) * T]) for i in range(count)]
        for layer in range(self.cfg.num_layers):
            if load_prefix is not None:
                if prefix_ready is None or not prefix_ready(layer):
                    jax.block_until_ready(chunks)
                cache.place_prefix(layer, load_prefix(layer))
            chunks = self.layer(layer, chunks, cache, start)
        cache.length = start + n
        return self.logits(chunks[-1], (n - 1) - (count - 1) * T), cache  # (V,) on the device

    def decode_step(self, token: int, cache: LatentCache) -> np.ndarray:
        """`decode_on_device` with the logits copied to the host."""
        return np.asarray(self.decode_on_device(token, cache))

    def decode_on_device(self, token: int, cache: LatentCache) -> jax.Array:
        """Logits (V,) after feeding one token at position cache.length (whole model, one dispatch)."""
        self.check_tokens(np.asarray([token]), cache.length)
        cache.reserve(cache.length + 2)
        view = self._view(cache, cache.length + 1)
        absorbed = self.attention != "expanded"
        layer_defs = tuple(graphdef for graphdef, _ in self.layers)
        logits, buffers = _decode(layer_defs, self.head[0], self.embed_VD, [state for _, state in self.layers],
                                  self.head[1], cache.layers, np.int32(token), view, absorbed,
                                  np.int32(cache.length))
        cache.layers = list(buffers)
        cache.length += 1
        return logits

    def generate(self, prompt: np.ndarray | list[int], params: SamplingParams, cache: LatentCache | None = None,
                 start: int = 0, load_prefix: LayerLoader | None = None) -> Iterator[int]:
        """Yields generated token ids; stops after a stop token (which is yielded) or max_tokens.

        Logits stay on the device: the engine's `sample_batch` samples there (same seeded stream as
        the engine's), and only the token id comes to the host each step."""
        prompt = np.asarray(prompt, np.int64)
        self.check_tokens(prompt, start, params.max_tokens)
        logits_V, cache = self.prefill_on_device(prompt, cache, start, load_prefix, reserve=params.max_tokens)
        seed = request_seed(params)
        for produced in range(1, params.max_tokens + 1):
            token = int(sample_batch(logits_V[None], [SamplingRow(params, seed, produced - 1)]).tokens[0])
            yield token
            if token in params.stop_token_ids or produced == params.max_tokens:
                return
            logits_V = self.decode_on_device(token, cache)
