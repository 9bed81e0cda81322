"""The attention-backend interface: how MLA attention reads the paged latent pool.

The pool holds, per layer, an array (P pages, B rows, A) of the latents' raw bits (uint16 for bfloat16, uint32
for float32). A block table lists a sequence's pages in position order: position p is row p % B of page
table[p // B]. Page 0 is the scratch page: padded tokens write there and padded table entries point at it.

The runner (model/runner.py) calls a backend inside its jitted functions; a backend keeps no state between calls.
- decode(attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA) -> (B, N, C) float32: each sequence's
  absorbed query ([q_nope @ W_UK | q_pe], FlashMLA's layout) over rows [0, position) of its pages and its own new
  latent (not yet in the pool): the softmax-weighted latents, normalised. `per_head` gives W_UK and W_UV's
  products around it (`Absorbed`: the layer's weights laid out per head once, at the backend's dtype).
- prefill: a pass's rows come as M tiles of T query rows; tile m belongs to one sequence and reads its pages
  through tables_MQ[m]. Per layer, once its latents are in the pool, `prefill_context` computes what all the
  layer's chunks read, where a form has such a context (expanded keys and values), then `prefill_attend` each
  chunk: its attention output (R = M * T, D), after o_proj. `prefill_form` names the form a segment takes.
Backends: xla (every platform), cpu (our C++ kernels), pallas (a GPU decode kernel; "auto" takes cpu where our
CPU kernels serve, else xla: the pallas kernel has been lowered for CUDA and run interpreted, not on a GPU yet).

Invariants, kept by every backend (tests/test_attention_backends.py holds each one to them):
1. Causal and private: a query at position p reads rows [0, p] of its own sequence only. Rows past p, other
   tables' pages, the scratch page and table padding never change its output, whatever finite values they hold.
2. Precision: latents are read at cache precision; the products take their operands at the attention dtype (the
   served weights', or float32 where `attn.wide`) and accumulate in float32; softmax runs in float32.
3. No whole-context copy in decode: decode reads pages through the tables a key block at a time (or in place),
   never materialising a (B, context, A) array.
4. Batch invariance where `batch_invariant`: at one batch size (batch-invariant mode pads every batch to one), a
   row's output bits depend on its own query, position and pages only, not on the other rows of its batch, on
   the table's width, or on the batch's longest position.
5. Explicit platform: a backend is chosen by name and platform (`make_backend`), not by where arrays live, so
   any platform's path can be traced and lowered anywhere.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from model.config import ModelConfig


class Absorbed(NamedTuple):
    """A layer's absorbed-attention weights laid out per head as (out, in) for decode's few rows: w_uk (N, C, H),
    w_uv (N, V, C), at the dtype the backend's `per_head` takes."""
    w_uk_NCH: jax.Array
    w_uv_NVC: jax.Array

    @staticmethod
    def of(attn, dtype) -> "Absorbed":
        w_uk, w_uv = attn.w_uk[...], attn.w_uv[...]
        return Absorbed(w_uk.transpose(1, 0, 2).astype(dtype), w_uv.transpose(1, 2, 0).astype(dtype))


class PrefillForm(NamedTuple):
    """How a prefill segment's attention is computed: `name` is the backend's own; `context_unit`: the form has a
    context (`prefill_context`, once per layer: expanded keys and values), a unit of its own (without one the
    context is None); `fixed_table`: every segment's table takes the pool's widest width (a kernel reading only
    each row's own range: one compiled shape per chunk size)."""
    name: str
    context_unit: bool
    fixed_table: bool = False


class AttentionBackend:
    name = ""
    batch_invariant = True  # invariant 4 holds
    decode_by_longest = True  # decode's work follows the batch's longest position (else each row's own)
    key_block = 0  # key rows per step of blockwise prefill attention (0: one pass)

    def __init__(self, cfg: ModelConfig, platform: str, dtype: str):
        self.cfg, self.platform, self.dtype = cfg, platform, jnp.dtype(dtype)
        # decode attention's two big products take this dtype: the cache dtype (as FlashMLA) for a model served
        # in bfloat16, float32 for one served in float32
        self.decode_dtype = jnp.promote_types(self.dtype, cfg.cache_dtype)

    def _settings(self) -> tuple:
        return tuple(sorted((name, str(value)) for name, value in vars(self).items() if name != "cfg"))

    def __eq__(self, other) -> bool:  # backends of equal settings trace alike: jitted calls share their compiles
        return type(self) is type(other) and self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), self._settings()))

    # -- decode --

    def absorbed(self, attn) -> Absorbed:
        return Absorbed.of(attn, self.decode_dtype)

    def per_head(self, x_NBI: jax.Array, w_NOI: jax.Array) -> jax.Array:
        """x_NBI @ w_NOI^T per head: (N, B, O) float32, x rounded to the weights' dtype."""
        return jnp.einsum("nbi,noi->nbo", x_NBI.astype(w_NOI.dtype), w_NOI, preferred_element_type=jnp.float32)

    def decode(self, attn, q_BNA: jax.Array, positions_B: jax.Array, pool_PBA: jax.Array, tables_BQ: jax.Array,
               latents_BA: jax.Array) -> jax.Array:
        raise NotImplementedError

    # -- prefill --

    def prefill_form(self, n: int, end: int, choice: str = "auto", tiles: int = 1) -> PrefillForm:
        """The form of n query rows a tile ending by `end` (the view's rows), in a pass of `tiles` tiles;
        `choice`: "auto" (the backend's), "absorbed" or "expanded"."""
        raise NotImplementedError

    def context_buffer(self, form: str, end: int, previous: Any) -> Any:
        """A buffer the layer's context is written into (donated), or None; `previous`: the pass's last context."""
        return None

    def prefill_context(self, attn, pool_PBA: jax.Array, tables_MQ: jax.Array, end: jax.Array, form: str,
                        into: Any = None) -> Any:
        raise NotImplementedError

    def prefill_attend(self, attn, q_nope_NRH: jax.Array, q_pe_NRR: jax.Array, positions_MT: jax.Array,
                       pool_PBA: jax.Array, tables_MQ: jax.Array, context: Any, form: str) -> jax.Array:
        raise NotImplementedError


def make_backend(name: str, cfg: ModelConfig, platform: str, dtype: str, page_tokens: int = 64,
                 **options) -> AttentionBackend:
    """The backend `name` ("auto": the best one for `platform`) for a model served at `dtype` over pages of
    `page_tokens`; `options` go to its constructor (tests and benchmarks turn kernels on or off)."""
    from model.attention.cpu import CpuBackend, cpu_serves
    from model.attention.pallas import PallasBackend
    from model.attention.xla import XlaBackend

    if name == "auto":
        name = "cpu" if platform == "cpu" and cpu_serves(cfg) else "xla"
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(('auto', *BACKENDS))}, got {name!r}")
    if name == "cpu":
        if platform != "cpu":
            raise ValueError(f"the cpu attention backend serves the cpu platform, not {platform!r}")
        return CpuBackend(cfg, platform, dtype, page_tokens=page_tokens, **options)
    return (PallasBackend if name == "pallas" else XlaBackend)(cfg, platform, dtype, **options)


BACKENDS = ("xla", "cpu", "pallas")
