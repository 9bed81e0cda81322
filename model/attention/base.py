"""The attention-backend interface: how MLA attention reads the paged latent pool.

The pool holds, per layer, an array (P pages, B rows, A) of the latents' raw bits. A block table lists a sequence's
pages in position order: position p is row p % B of page table[p // B]. Page 0 is the scratch page: padded tokens
write there and padded table entries point at it.

The runner (model/runner.py) calls a backend inside its jitted functions; a backend keeps no state between calls.
- decode(attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA) -> (B, N, C) float32: each sequence's
  absorbed query ([q_nope @ W_UK | q_pe]) over rows [0, position) of its pages and its own new latent (not yet in
  the pool), softmax-weighted and normalised; `per_head` gives W_UK and W_UV's products around it.
- prefill: M tiles of T query rows, tile m one sequence's, reading its pages through tables_MQ[m]. Per layer,
  `prefill_context` computes what all chunks read (where the form has a context), then `prefill_attend` each
  chunk: (R = M * T, D) after o_proj. `prefill_form` names a segment's form.
Backends: xla (every platform), cpu (our C++ kernels), pallas (GPU decode); "auto": cpu where ours serve, else xla.

Invariants, kept by every backend (tests/test_attention_backends.py holds each one to them):
1. Causal and private: a query at position p reads rows [0, p] of its own sequence only. Rows past p, other
   tables' pages, the scratch page and table padding never change its output, whatever finite values they hold.
2. Precision: latents are read at cache precision; products take operands at the attention dtype (the served
   weights', or float32 where `attn.wide`) and accumulate in float32; softmax runs in float32.
3. No whole-context copy in decode: pages are read a key block at a time (or in place), never as (B, context, A).
4. Batch invariance where `batch_invariant`: at one batch size, a row's output bits depend on its own query,
   position and pages only: not on the batch's other rows, the table's width or the longest position.
5. Explicit platform: a backend is chosen by name and platform (`make_backend`), not by where arrays live, so
   any platform's path can be traced and lowered anywhere.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from model.config import ModelConfig


class Absorbed(NamedTuple):
    """A layer's W_UK (N, C, H) and W_UV (N, V, C) laid out per head, at the dtype `per_head` takes."""
    w_uk_NCH: jax.Array
    w_uv_NVC: jax.Array

    @staticmethod
    def of(attn, dtype) -> "Absorbed":
        w_uk, w_uv = attn.w_uk[...], attn.w_uv[...]
        return Absorbed(w_uk.transpose(1, 0, 2).astype(dtype), w_uv.transpose(1, 2, 0).astype(dtype))


class PrefillForm(NamedTuple):
    """How a prefill segment's attention is computed: `name` is the backend's; `context_unit`: a per-layer context
    (`prefill_context`) as a unit of its own; `fixed_table`: every table takes the pool's widest width."""
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
        # decode attention's products: the cache dtype (as FlashMLA) served in bfloat16, float32 served in float32
        self.decode_dtype = jnp.promote_types(self.dtype, cfg.cache_dtype)

    def _settings(self) -> tuple:
        return tuple(sorted((name, str(value)) for name, value in vars(self).items() if name != "cfg"))

    def __eq__(self, other) -> bool:  # backends of equal settings trace alike: jitted calls share their compiles
        return type(self) is type(other) and self._settings() == other._settings()

    def __hash__(self) -> int:
        return hash((type(self), self._settings()))

    def absorbed(self, attn) -> Absorbed:
        return Absorbed.of(attn, self.decode_dtype)

    def per_head(self, x_NBI: jax.Array, w_NOI: jax.Array) -> jax.Array:
        """x_NBI @ w_NOI^T per head: (N, B, O) float32, x rounded to the weights' dtype."""
        return jnp.einsum("nbi,noi->nbo", x_NBI.astype(w_NOI.dtype), w_NOI, preferred_element_type=jnp.float32)

    def decode(self, attn, q_BNA: jax.Array, positions_B: jax.Array, pool_PBA: jax.Array, tables_BQ: jax.Array,
               latents_BA: jax.Array) -> jax.Array:
        raise NotImplementedError

    def prefill_form(self, n: int, end: int, choice: str = "auto", tiles: int = 1) -> PrefillForm:
        """The form of n query rows of a tile ending by `end`, in a pass of `tiles`; `choice`: auto or a form."""
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
    """The backend `name` ("auto": the best for `platform`); `options` go to its constructor (tests, benchmarks)."""
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
