"""Batched model steps over a paged latent pool.

The pool holds, per layer, one array of pages (num_pages, page_tokens, A) at cache dtype; a page is
exactly one cache block, so a block read from disk is placed into a page and a page is saved as a
block with no repacking. Each sequence owns a block table (page ids, in position order). Page 0 is
the scratch page: padded tokens write there and padded table entries point at it; it is never owned.

Two kinds of work share a model step (the scheduler decides which):
- decode: one token of each of B sequences, the whole model in one dispatch; attention reads each
  sequence's pages through its block table (in place on the CPU, our kernel (cpu_kernels); elsewhere a gather
  into a dense (B, S, A) view, where a ragged paged MLA kernel for GPU/TPU can take the same arguments);
- prefill segment: tokens [start, start + n) of one sequence, layer-major over sub-chunks, attending
  over the sequence's pages (on a CPU with AMX read in place by our prefill kernel; elsewhere gathered into a
  view once per layer). The latents are written to the pool first and read back, so a prefix loaded from disk,
  kept in memory or computed a step earlier look the same.

Shapes are bucketed (batch to powers of two, views by `view_bucket`: finer for decode, which reads every
row of its views each step) so the compile count stays small; batch-invariant mode pads every decode batch
to one fixed size. Short prefill segments of several sequences share one pass (`prefill_segments`).
"""
from __future__ import annotations

from collections.abc import Callable, Generator
from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model import cpu_kernels
from model.config import ModelConfig
from model.mla import prefer_absorbed
from model.runner import (MIN_CHUNK, MIN_VIEW, LayerCalls, ModelRunner, SplitModule, _as_bits, _bits_dtype, _embed,
                          _pow2)
from model.transformer import DeepseekModel

SCRATCH_PAGE = 0


class LatentPool:
    """Per layer one device array (num_pages, page_tokens, A) holding latents at cache dtype.

    The arrays hold the latents' raw bits (uint16 for bfloat16): XLA:CPU widens a bfloat16 scatter or
    dynamic-update-slice to float32 over the WHOLE operand, which turned every one-token write into a
    copy of the pool (measured: 0.7 s per decode step for a 1 GiB pool, 0.01 ms as uint16)."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_tokens: int):
        if num_pages < 2:
            raise ValueError(f"a pool needs at least 2 pages (one is scratch), got {num_pages}")
        self.num_pages, self.page_tokens, self.latent_dim = num_pages, page_tokens, cfg.latent_dim
        self.dtype = jnp.dtype(cfg.cache_dtype)
        self.layers = [jnp.zeros((num_pages, page_tokens, cfg.latent_dim), _bits_dtype(self.dtype))
                       for _ in range(cfg.num_layers)]

    @property
    def bytes(self) -> int:
        return len(self.layers) * self.num_pages * self.page_tokens * self.latent_dim * self.dtype.itemsize

    def place(self, layer: int, pages: list[int], latents_PA: np.ndarray) -> None:
        """Writes (len(pages) * page_tokens, A) latents into `pages` of one layer: one host-to-device copy
        and one donated scatter (page lists are padded to a power of two with the scratch page)."""
        n = len(pages)
        if latents_PA.shape != (n * self.page_tokens, self.latent_dim):
            raise ValueError(f"latents for {n} pages must be ({n * self.page_tokens}, {self.latent_dim}), "
                             f"got {latents_PA.shape}")
        padded = _pow2(n)
        pages_N = np.full(padded, SCRATCH_PAGE, np.int32)
        pages_N[:n] = pages
        if padded == n and latents_PA.flags.c_contiguous:
            rows_NBA = latents_PA.reshape(n, self.page_tokens, self.latent_dim)
        else:
            rows_NBA = np.zeros((padded, self.page_tokens, self.latent_dim), latents_PA.dtype)
            rows_NBA[:n] = latents_PA.reshape(n, self.page_tokens, self.latent_dim)
        bits = rows_NBA.astype(self.dtype, copy=False).view(_bits_dtype(self.dtype))  # no copy at cache dtype
        self.layers[layer] = _place_pages(self.layers[layer], jnp.asarray(pages_N), jnp.asarray(bits))

    def read(self, pages: list[int]) -> list["PageRead"]:
        """The latents of `pages` in every layer as device copies of their bits (so later steps may overwrite
        the pages), in one dispatch (one per layer cost each new answer's first token ~8 host dispatches);
        `host()` turns each into (len(pages) * page_tokens, A) cache-dtype rows off the model thread. The page
        list is padded to a power of two and the padding dropped on the host: a device slice per length was a
        compile each."""
        n = len(pages)
        pages_N = np.full(_pow2(n), SCRATCH_PAGE, np.int32)
        pages_N[:n] = pages
        return [PageRead(bits, n * self.page_tokens) for bits in _read_pages(tuple(self.layers), jnp.asarray(pages_N))]

    def host(self, read: "PageRead") -> np.ndarray:
        """A `read` result as a host array in cache dtype."""
        return np.asarray(read.bits)[:read.rows].view(self.dtype)


class PageRead(NamedTuple):
    bits: jax.Array  # (padded pages * page_tokens, A) raw bits
    rows: int  # rows that belong to the pages read


@partial(jax.jit, donate_argnums=(0,))
def _place_pages(pool_PBA, pages_N, rows_NBA):
    return pool_PBA.at[pages_N].set(rows_NBA)


@jax.jit
def _read_pages(layers, pages_N):
    return [_bits_view(pool_PBA, pages_N) for pool_PBA in layers]  # each (N * B, A) bits


def _write_slots(pool_PBA, slots_T, latents_TA):
    """The pool with each row t of latents_TA written at flat slot slots_T[t] (page * B + offset)."""
    P, B, A = pool_PBA.shape
    return pool_PBA.reshape(P * B, A).at[slots_T].set(_as_bits(latents_TA), mode="promise_in_bounds").reshape(P, B, A)


def _view(pool_PBA, table_Q, dtype):
    """Pages table_Q of the pool as dense (Q * B, A) latents at cache dtype."""
    pages = jax.lax.bitcast_convert_type(pool_PBA, jnp.dtype(dtype)).at[table_Q].get(mode="promise_in_bounds")
    return pages.reshape(-1, pool_PBA.shape[-1])


def _project_paged(layer, x_TD, pool_PBA, positions_T, slots_T):
    """Queries of T tokens, and their latents written into the pool."""
    h_TD = layer.input_norm(x_TD)
    q_nope_NTH, q_pe_NTR = layer.attn.queries(h_TD, positions_T)
    return q_nope_NTH, q_pe_NTR, _write_slots(pool_PBA, slots_T, layer.attn.latents(h_TD, positions_T))


def _bits_view(pool_PBA, table_Q):
    """Pages table_Q of the pool as a dense (..., Q * B, A) view of their raw bits, which prefill attention reads as
    the cache dtype a block at a time (MLAttention._rows): handed a bfloat16 view, XLA:CPU converted all of it to
    float32 before the blockwise loop (at 16K rows, 12 ms a layer and a 38 MB copy) and each block back inside it."""
    pages = pool_PBA.at[table_Q].get(mode="promise_in_bounds")
    return pages.reshape(*table_Q.shape[:-1], -1, pool_PBA.shape[-1])


@jax.jit
def _gather_view(pool_PBA, table_Q):
    """One sequence's pages as a dense (Q * B, A) view of their raw bits (`_bits_view`)."""
    return _bits_view(pool_PBA, table_Q)


def _per_head(x_NBI, w_NOI, few_rows: bool) -> jax.Array:
    """x_NBI @ w_NOI^T per head, (N, B, O) float32: B rows through each head's (O, I) weights. With `few_rows`
    (bfloat16 weights), by the CPU's few-row kernel, all heads in one call where the rows allow (x rounded to
    bfloat16, as the prefill path's products take it; else the same rounding before XLA's float32 product)."""
    if not few_rows:
        return jnp.einsum("nbi,noi->nbo", x_NBI.astype(jnp.float32), w_NOI)
    if cpu_kernels.few_rows_supported(x_NBI.shape[1], x_NBI.shape[2]):
        return cpu_kernels.few_row_product(x_NBI, w_NOI)
    x_NBI = x_NBI.astype(w_NOI.dtype).astype(jnp.float32)
    return jnp.einsum("nbi,noi->nbo", x_NBI, w_NOI.astype(jnp.float32))


def _decode_queries(absorb: "Absorb", q_nope_NBH, q_pe_NBR, dtype, few_rows: bool) -> jax.Array:
    """Absorbed queries (B, N, A) = [q_nope @ W_UK | q_pe] at `dtype`: one per sequence, against whole latents."""
    q_lat_BNC = _per_head(q_nope_NBH, absorb.w_uk_NCH, few_rows).transpose(1, 0, 2)
    return jnp.concatenate([q_lat_BNC, q_pe_NBR.transpose(1, 0, 2)], axis=-1).astype(dtype)


def _attend_view(attn, q_BNA, positions_B, kv_BSA, latents_BA, dtype) -> jax.Array:
    """Absorbed MLA attention of one query per sequence over its own (S, A) view of earlier positions
    and its own new latent (B, A), which is not in the view; returns the weighted latents (B, N, C) float32.

    As FlashMLA does it: keys are the whole 576-wide latent ([c_kv | k_pe], so the scores are one
    contraction and no slice of the view is copied) and values its first 512 columns; the two big
    products take `dtype` inputs (the cache dtype by default: the view is not widened) and accumulate
    and soften in float32. The new token's own key joins the softmax as one more column instead of being
    scattered into the view, which made XLA:CPU copy the whole view every layer. With dtype float32 it is
    the dense runner's attention, summed in another order."""
    S, C = kv_BSA.shape[1], attn.kv_lora_rank
    kv_BSA, new_BA = kv_BSA.astype(dtype), latents_BA.astype(dtype)
    scores_BNS = jnp.einsum("bsa,bna->bns", kv_BSA, q_BNA, preferred_element_type=jnp.float32) * attn.scale
    scores_BNS = jnp.where((jnp.arange(S)[None, :] < positions_B[:, None])[:, None], scores_BNS, -jnp.inf)
    own_BN = jnp.einsum("ba,bna->bn", new_BA, q_BNA, preferred_element_type=jnp.float32) * attn.scale
    top_BN = jnp.maximum(jnp.max(scores_BNS, axis=-1), own_BN)
    weights_BNS = jnp.exp(scores_BNS - top_BN[..., None])
    own_BN = jnp.exp(own_BN - top_BN)
    total_BN = jnp.sum(weights_BNS, axis=-1) + own_BN
    out_BNA = jnp.einsum("bns,bsa->bna", weights_BNS.astype(dtype), kv_BSA, preferred_element_type=jnp.float32)
    out_BNA = (out_BNA + own_BN[..., None] * new_BA[:, None].astype(jnp.float32)) / total_BN[..., None]
    return out_BNA[..., :C]


def _attend_pages(attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA, dtype, path: str) -> jax.Array:
    """`_attend_view`'s result computed by the CPU kernel from the pages in place (cpu_kernels): no view is
    gathered, each page is read once for both products. `path`: the kernel's ("auto": its best here)."""
    return cpu_kernels.paged_mla_decode(q_BNA, pool_PBA, tables_BQ, positions_B, latents_BA.astype(dtype),
                                        attn.scale, attn.kv_lora_rank, path)


def _attend_out(attn, absorb: "Absorb", out_BNC, few_rows: bool) -> jax.Array:
    """The weighted latents through W_UV and the output projection: (B, D)."""
    B = out_BNC.shape[0]
    out_NBV = _per_head(out_BNC.transpose(1, 0, 2), absorb.w_uv_NVC, few_rows)
    return attn.o_proj(out_NBV.transpose(1, 0, 2).reshape(B, -1))


class Absorb(NamedTuple):
    """A layer's absorbed-attention weights laid out per head as (out, in) for decode's few rows: w_uk (N, C, H),
    w_uv (N, V, C); bfloat16 for the few-row kernel, else float32 (XLA:CPU's float32 products of a few rows beat
    its bfloat16 ones: decode_bench)."""
    w_uk_NCH: jax.Array
    w_uv_NVC: jax.Array

    @staticmethod
    def of(attn, few_rows: bool) -> "Absorb":
        dtype = jnp.bfloat16 if few_rows else jnp.float32
        return Absorb(attn.w_uk[...].transpose(1, 0, 2).astype(dtype), attn.w_uv[...].transpose(1, 2, 0).astype(dtype))


@lru_cache(maxsize=8)
def _decode_step(layer_defs: tuple, head_def, weights_def):
    """`_decode_batch` jitted for one model's graph definitions, its weights as one flat list of arrays
    (`weights_def` unflattens them). Passed to jit as static arguments on every step, the graph definitions
    were hashed on every call, and the weights' nnx States flattened: 2.3 ms of Python before each dispatch
    (16 sequences, mini), every step. Cached by the definitions, so runners of one model share compiles."""

    def step(weights, pools, tokens_B, positions_B, tables_BQ, attention_dtype, kernel, few_rows):
        embed_VD, layer_states, absorbs, head_state = jax.tree.unflatten(weights_def, weights)
        return _decode_batch(layer_defs, head_def, embed_VD, layer_states, absorbs, head_state, pools, tokens_B,
                             positions_B, tables_BQ, attention_dtype, kernel, few_rows)

    return jax.jit(step, static_argnums=(5, 6, 7))


def _decode_batch(layer_defs, head_def, embed_VD, layer_states, absorbs, head_state, pools, tokens_B, positions_B,
                  tables_BQ, attention_dtype, kernel, few_rows):
    """One decode token for each of B sequences through every layer: (logits (B, V) float32, the tokens'
    latents (L, B, A)). Attention reads the pages in place with the CPU kernel's path `kernel` ("auto", ...), or
    with None from a gathered view; `few_rows`: the absorbed products per head by the few-row kernel (Absorb).
    The pools are only read here; `_write_latents` stores the new latents after: a
    scatter into a pool that the same computation also reads made XLA:CPU copy the whole pool."""
    x_BD = jnp.take(embed_VD, tokens_B, axis=0)
    B, Q = tables_BQ.shape
    latents = []
    for graphdef, state, absorb, pool_PBA in zip(layer_defs, layer_states, absorbs, pools):
        layer = nnx.merge(graphdef, state)
        h_BD = layer.input_norm(x_BD)
        q_nope_NBH, q_pe_NBR = layer.attn.queries(h_BD, positions_B)
        latents_BA = layer.attn.latents(h_BD, positions_B)
        q_BNA = _decode_queries(absorb, q_nope_NBH, q_pe_NBR, attention_dtype, few_rows)
        if kernel is not None:
            out_BNC = _attend_pages(layer.attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA, attention_dtype,
                                    kernel)
        else:
            kv_BSA = _view(pool_PBA, tables_BQ, layer.attn.cache_dtype).reshape(B, Q * pool_PBA.shape[1], -1)
            # The view as its own copy: fused into the two attention products, the gather ran inside each.
            kv_BSA = jax.lax.optimization_barrier(kv_BSA)
            out_BNC = _attend_view(layer.attn, q_BNA, positions_B, kv_BSA, latents_BA, attention_dtype)
        x_BD = x_BD + _attend_out(layer.attn, absorb, out_BNC, few_rows)
        x_BD = x_BD + layer.mlp(layer.post_attn_norm(x_BD))
        latents.append(latents_BA)
    head = nnx.merge(head_def, head_state)
    return head.lm_head(head.norm(x_BD)).astype(jnp.float32), jnp.stack(latents)


@partial(jax.jit, donate_argnums=(0,))
def _write_latents(pools, slots_B, latents_LBA):
    return [_write_slots(pool_PBA, slots_B, latents_BA) for pool_PBA, latents_BA in zip(pools, latents_LBA)]


def _finish_tiles(layer, x_RD, q_nope_NRH, q_pe_NRR, pool_PBA, tables_MQ, view, form, positions_MT):
    """Attention of M tiles of query rows (R = M * tile rows from `_project_paged`; each tile belongs to one
    sequence and reads that sequence's pages), then the feed-forward over all R rows at once: (R, D). `form`
    "pages": absorbed, by the CPU's prefill kernel, every tile in one call reading the pages in place
    (MLAttention.attend_pages); "absorbed" or "expanded": the dense runner's attention, batched over M, each
    tile's pages gathered into a (view, A) view. A pass in the pages form measured 1.10-1.61x faster on `mini`
    (BENCHMARKS.md, prefill passes)."""
    attn = layer.attn
    if form == "pages":
        x_RD = x_RD + attn.attend_pages(q_nope_NRH, q_pe_NRR, positions_MT, pool_PBA, tables_MQ, view)
        return x_RD + layer.mlp(layer.post_attn_norm(x_RD))
    M, T = positions_MT.shape
    kv_MSA = _bits_view(pool_PBA, tables_MQ)  # (M, view, A)
    q_nope_MNTH = q_nope_NRH.reshape(q_nope_NRH.shape[0], M, T, -1).transpose(1, 0, 2, 3)
    q_pe_MNTR = q_pe_NRR.reshape(q_pe_NRR.shape[0], M, T, -1).transpose(1, 0, 2, 3)

    def one(q_nope_NTH, q_pe_NTR, positions_T, kv_SA):
        expanded = None if form == "absorbed" else attn.expand(kv_SA, view, attn.products_dtype())
        return attn.attend(q_nope_NTH, q_pe_NTR, positions_T, kv_SA, view, expanded)

    x_RD = x_RD + jax.vmap(one)(q_nope_MNTH, q_pe_MNTR, positions_MT, kv_MSA).reshape(M * T, -1)
    return x_RD + layer.mlp(layer.post_attn_norm(x_RD))


def _expand_pages(layer, pool_PBA, table_Q, end, into_NSX):
    return layer.attn.expand_pages(pool_PBA, table_Q, end, into_NSX)


def _expand_rows(layer, pool_PBA, slots_R, first, into):
    """The expanded form's keys and values of pool slots slots_R (positions [first, first + R) of a sequence),
    written at those rows of `into` (`MLAttention.expand_into`)."""
    P, B, A = pool_PBA.shape
    rows_RA = pool_PBA.reshape(P * B, A).at[slots_R].get(mode="promise_in_bounds")
    return layer.attn.expand_into(rows_RA, first, into, layer.attn.products_dtype())


@partial(jax.jit, static_argnums=(1,))
def _grow(expanded, rows):
    """Expanded keys and values in buffers of `rows` rows, their rows first."""
    return tuple(jnp.pad(x, ((0, 0), (0, rows - x.shape[1]), (0, 0))) for x in expanded)


def _attend_laid(layer, q_nope_NTH, q_pe_NTR, laid_NSX, positions_T):
    """A chunk's expanded attention over its sequence's keys and values laid out by `_expand_pages`: (T, D).
    Apart from the feed-forward (`_finish_attended`), so that only this small call compiles per view bucket."""
    return layer.attn.attend_laid(q_nope_NTH, q_pe_NTR, positions_T, laid_NSX)


def _finish_attended(layer, x_TD, attended_TD):
    x_TD = x_TD + attended_TD
    return x_TD + layer.mlp(layer.post_attn_norm(x_TD))


def _head_rows(head, x_RD, rows_K):
    """Logits (K, V) float32 of rows rows_K."""
    return head.lm_head(head.norm(x_RD[rows_K])).astype(jnp.float32)


class PagedLayerCalls(NamedTuple):
    """A layer's jitted building blocks over the pool, beside the dense runner's (`LayerCalls`)."""
    dense: LayerCalls
    project: Callable  # (x_TD, pool_PBA (donated), positions_T, slots_T) -> q_nope_NTH, q_pe_NTR, pool_PBA
    finish_tiles: Callable  # (x_RD, q_nope_NRH, q_pe_NRR, pool_PBA, tables_MQ, view, form, positions_MT)
    expand: Callable  # (pool_PBA, table_Q, end, into_NSX (donated)) -> laid_NSX: the expanded keys and values
    expand_rows: Callable  # (pool_PBA, slots_R, first, into (donated)) -> keys and values with rows R expanded
    attend_laid: Callable  # (q_nope_NTH, q_pe_NTR, laid_NSX, positions_T) -> (T, D)
    finish_attended: Callable  # (x_TD, attended_TD) -> (T, D): the residual and the feed-forward

    @classmethod
    def of(cls, layer: SplitModule, dense: LayerCalls) -> "PagedLayerCalls":
        return cls(dense, layer.jit(_project_paged, donate_argnums=(1,)),
                   layer.jit(_finish_tiles, static_argnums=(5, 6)), layer.jit(_expand_pages, donate_argnums=(3,)),
                   layer.jit(_expand_rows, donate_argnums=(3,)),
                   layer.jit(_attend_laid), layer.jit(_finish_attended))


PrefillLayers = Generator[object, None, jax.Array]
"""A prefill pass one unit at a time (a chunk of a layer, or a layer: `PagedRunner.prefill_units`): each `next`
dispatches one unit and yields its output (to block on, to time it); the pass returns its result once every
unit is in. Between units the caller may dispatch other work, such as a decode step (each unit reads the pool's
arrays as they are when it runs, and writes only its own sequences' rows); a pass closed part-way has written its
rows into some layers only: its sequences must compute them again."""


def run_layers(layers: PrefillLayers) -> jax.Array:
    """Runs a layer-by-layer pass through; returns its result (dispatched)."""
    while True:
        try:
            next(layers)
        except StopIteration as done:
            return done.value


class Segment(NamedTuple):
    """A prefill segment: tokens at positions [start, start + len(tokens)) of one sequence with `pages`."""
    tokens: np.ndarray
    start: int
    pages: list[int]


DECODE_VIEW_STEPS = 4  # decode view sizes per doubling past 512 rows: at most 1.25x masked rows
MAX_PASS_TILES = 8  # tiles (pages of query rows) of one prefill_segments pass at most: 512 rows, as a chunk
MAX_SEGMENT_TILES = 3  # tiles of a segment that goes in a pass at most
MAX_TILE_VIEW = 4096  # rows of the longest view a prefill_segments pass reads (or gathers) per tile
LAID_ROWS = 4096  # the expanded form's keys and values buffer: rows, at least (then powers of two)
KEPT_BYTES = 2 << 30  # sequences' expanded keys and values kept between their prefill segments, at most (`_Kept`)


def view_bucket(n: int, page: int, steps: int = 1) -> int:
    """Rows of the view attention reads for positions [0, n), in whole pages: a power of two up to 512 rows;
    beyond, `steps` sizes per doubling up to 4,096 rows (1: powers of two) and at least 2 past it. Coarser
    than the dense runner's eighths: every distinct shape is a compile that stalls the whole engine (about a
    second each on this CPU), and a serving engine meets many lengths. Prefill takes steps=1 (at most 2x
    masked rows, which its blockwise attention mostly skips); decode, which reads every row of every
    sequence's view each step, takes DECODE_VIEW_STEPS."""
    n = max(n, MIN_VIEW)
    pieces = 1 if n <= 512 else steps if n <= 4096 else max(steps, 2)
    unit = _pow2(n) // (2 * pieces)
    size = -(-n // unit) * unit
    return -(-size // page) * page


class _Kept(NamedTuple):
    """A sequence's expanded keys and values of every layer, kept from its last prefill segment over gathered views
    for its next one (which then expands only its own rows): valid for positions [0, end) of its pages `pages`."""
    context: object
    pages: tuple[int, ...]
    end: int
    layers: list[tuple[jax.Array, jax.Array]]

    @property
    def bytes(self) -> int:
        return sum(x.nbytes for layer in self.layers for x in layer)


class DecodeRow(NamedTuple):
    token: int
    position: int  # where the token goes (its latent is written at this position)
    pages: list[int]  # the sequence's block table, covering position


class PagedRunner:
    """The engine's model: decode batches and prefill segments over a LatentPool."""

    def __init__(self, model: DeepseekModel, cfg: ModelConfig, pool: LatentPool, chunk_tokens: int = 512,
                 attention: str = "auto", attention_budget_bytes: int = 512 << 20, fixed_batch: int = 0,
                 decode_kernel: bool | None = None, decode_kernel_path: str | None = None,
                 prefill_in_place: bool | None = None):
        # The dense runner's weights split per layer and its chunking rule are reused as they are.
        self.dense = ModelRunner(model, cfg, chunk_tokens, attention, attention_budget_bytes)
        self.cfg, self.pool = cfg, pool
        self.page = pool.page_tokens
        self.fixed_batch = fixed_batch  # batch-invariant mode: every decode batch padded to this size
        # Input dtype of decode attention's two big products: the cache dtype (as FlashMLA) for a model served
        # in bfloat16, float32 for one served in float32 (model/serving.py): the wider of the two.
        self.decode_attention_dtype = jnp.promote_types(model.layers[0].attn.w_uk.dtype, cfg.cache_dtype).name
        # Decode attention from the pages in place (cpu_kernels) where the pool is on the CPU and the kernel
        # builds; None decides so (on a CPU with AVX-512, AMX, or AVX2 and FMA: cpu_kernels.decode_serves), False
        # keeps XLA's gathered view (as on a GPU or TPU).
        platform_name = next(iter(pool.layers[0].devices())).platform
        ok, why = cpu_kernels.available(platform_name)
        ok = ok and cpu_kernels.supports(cfg.latent_dim, cfg.kv_lora_rank)
        self.decode_kernel = ok and cpu_kernels.decode_serves() if decode_kernel is None else decode_kernel
        if self.decode_kernel and not ok:
            raise ValueError(f"the CPU decode kernel was asked for but is unavailable: {why or 'unsupported dims'}")
        # The kernel's path: its best here ("auto": AMX rounds queries and weights to bfloat16, as XLA's view path
        # does at a bfloat16 attention dtype), or float32's for a model served in float32; benches name one.
        self.decode_kernel_path = decode_kernel_path or ("auto" if self.decode_attention_dtype == "bfloat16"
                                                         else "float32")
        self._kernel_view = min(pool.num_pages - 1, -(-cfg.max_position_embeddings // self.page)) * self.page
        self._layer_defs = tuple(graphdef for graphdef, _ in self.dense.layers)
        self._layer_states = [state for _, state in self.dense.layers]
        # Decode's absorbed weights, laid out per head once: by the few-row kernel where the served model's
        # projections take it (bfloat16 on a CPU with our kernels), else XLA's float32 products.
        self._absorb_few_rows = bool(getattr(model.layers[0].attn.o_proj, "few_rows", False))
        self._absorbs = [Absorb.of(layer.attn, self._absorb_few_rows) for layer in model.layers]
        head_def, head_state = self.dense.head
        self._decode_weights, weights_def = jax.tree.flatten((self.dense.embed_VD, self._layer_states, self._absorbs,
                                                              head_state))
        self._decode_step = _decode_step(self._layer_defs, head_def, weights_def)
        self._layer_calls = [PagedLayerCalls.of(layer, calls)
                             for layer, calls in zip(self.dense.split_layers, self.dense.layer_calls)]
        self._head_rows = self.dense.split_head.jit(_head_rows)
        # Absorbed prefill attention reads the pages in place where the CPU's prefill kernel can
        # (MLAttention.attend_pages); None decides so, False gathers views (benches compare both). The expanded
        # form always gathers views.
        ok = model.layers[0].attn.reads_pages(pool.layers[0])
        self.prefill_reads_pages = ok if prefill_in_place is None else prefill_in_place
        if self.prefill_reads_pages and not ok:
            raise ValueError("prefill attention in place was asked for but the prefill kernel cannot read this pool")
        # The expanded form in place too, where the kernel takes the model's widths: long chunks take it
        self.prefill_expands_pages = self.prefill_reads_pages and model.layers[0].attn.expands_pages(pool.layers[0])
        attn = model.layers[0].attn
        self._laid_heads_width = (attn.num_heads, attn.laid_width())  # the expanded form's keys and values
        self._laid: jax.Array | None = None  # their buffer, kept between segments (`_take_laid`)
        # a position's expanded keys and values, all layers
        self._expanded_row_bytes = (len(model.layers) * attn.num_heads * attn.laid_width()
                                    * jnp.dtype(attn.products_dtype()).itemsize)
        self._kept: dict[int, _Kept] = {}  # by id(context), oldest first (`_take_kept`)

    @property
    def decode_attention(self) -> str:
        """How decode attention reads the pool: "cpu-kernel" (pages in place, cpu_kernels) or "xla-view" (XLA's
        products over gathered dense views)."""
        return "cpu-kernel" if self.decode_kernel else "xla-view"

    def check_tokens(self, tokens: np.ndarray, extra: int = 0) -> None:
        self.dense.check_tokens(tokens, 0, extra)

    def _slots(self, positions: np.ndarray, pages: list[int], valid: int) -> np.ndarray:
        """Flat pool slots of positions; positions at or past `valid` go to the scratch page."""
        table = np.asarray(pages, np.int64)
        slots = np.empty(positions.size, np.int32)
        real = positions < valid
        slots[real] = table[positions[real] // self.page] * self.page + positions[real] % self.page
        slots[~real] = SCRATCH_PAGE * self.page + positions[~real] % self.page
        return slots

    def _table(self, pages: list[int], rows: int) -> np.ndarray:
        table = np.full(rows // self.page, SCRATCH_PAGE, np.int32)
        n = min(len(pages), table.size)
        table[:n] = pages[:n]
        return table

    def decode_shape(self, positions: list[int]) -> tuple[int, int]:
        """(padded batch, view rows) of a decode dispatch of sequences at these positions. The kernel reads
        only each sequence's own rows, whatever its table's width, so its tables have one width, the longest
        sequence the pool and the model allow: one compiled shape per batch size. The gathered view reads
        every row, so it takes DECODE_VIEW_STEPS sizes per doubling."""
        batch = max(self.fixed_batch, _pow2(len(positions)))
        if self.decode_kernel:
            return batch, self._kernel_view
        return batch, view_bucket(max(positions) + 1, self.page, DECODE_VIEW_STEPS)

    def decode(self, rows: list[DecodeRow]) -> jax.Array:
        """Feeds one token per sequence; returns their logits on the device, (B, V) with B >= len(rows): the
        rows past len(rows) are the padded batch's (left there: slicing them off is an eager copy, and a
        compile per batch size, every step)."""
        n = len(rows)
        B, view = self.decode_shape([r.position for r in rows])
        tokens = np.zeros(B, np.int32)
        positions = np.zeros(B, np.int32)
        slots = np.full(B, SCRATCH_PAGE * self.page, np.int32)
        tables = np.full((B, view // self.page), SCRATCH_PAGE, np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.token, r.position
            slots[i] = self._slots(np.asarray([r.position]), r.pages, r.position + 1)[0]
            tables[i] = self._table(r.pages, view)
        logits, latents = self._decode_step(self._decode_weights, self.pool.layers, tokens, positions, tables,
                                            self.decode_attention_dtype,
                                            self.decode_kernel_path if self.decode_kernel else None,
                                            self._absorb_few_rows)
        self.pool.layers = _write_latents(self.pool.layers, slots, latents)
        return logits

    def batchable(self, n: int, end: int) -> bool:
        """Whether a segment of n tokens ending at `end` goes in a `prefill_segments` pass: a short one (alone,
        its padded chunk would be mostly padding, and its pass's fixed cost would be paid for a few rows) whose
        view is short enough to be read (or gathered) for each sequence in the pass. A longer one went faster alone when passes gathered views (`prefill`: measured in
        BENCHMARKS.md, prefill passes; reading pages in place, about as fast either way)."""
        return n <= MAX_SEGMENT_TILES * self.page and view_bucket(end, self.page) <= MAX_TILE_VIEW

    def prefill_segments(self, segments: list[Segment]) -> jax.Array:
        """`prefill_segments_layers` run through: the logits (K, V), dispatched."""
        return run_layers(self.prefill_segments_layers(segments))

    def prefill_segments_layers(self, segments: list[Segment]) -> PrefillLayers:
        """Computes several sequences' segments in one pass per layer: their rows share every projection and
        feed-forward product (one product of all rows instead of one per sequence). Rows go in tiles of one
        page (a segment takes whole tiles, its last one padded); each tile attends over its own sequence's
        pages, so segments of any lengths and positions mix with at most a tile's padding each. The tile count
        is the segments' own (up to MAX_PASS_TILES shapes per view): padded to a power of two, the padding tiles
        ran the whole blockwise loop like the others (it is vmapped over tiles), which cost 42% of a pass of
        five 64-token segments at 1K context (437 ms against 254). The view is the longest segment's. Writes
        the latents into the pages; yields after each layer's dispatch (`PrefillLayers`) and returns the logits
        (K, V) at each segment's last token, dispatched (rows past len(segments) repeat the last)."""
        B = self.page
        counts = [-(-s.tokens.size // B) for s in segments]
        if sum(counts) > MAX_PASS_TILES:
            raise ValueError(f"{sum(counts)} tiles do not fit one pass of {MAX_PASS_TILES}")
        M = sum(counts)
        ends = [s.start + s.tokens.size for s in segments]
        view = view_bucket(max(ends), B)
        absorbed = (prefer_absorbed(self.cfg, B, view, self.dense.prefill_kernel) if self.dense.attention == "auto"
                    else self.dense.attention == "absorbed")
        form = ("pages" if self.prefill_reads_pages else "absorbed") if absorbed else "expanded"
        if form == "pages":
            view = self._kernel_view  # the kernel reads each row's own causal range: one shape per tile count
        tokens_MT = np.zeros((M, B), np.int32)
        positions_MT = np.tile(np.arange(B, dtype=np.int32), (M, 1))
        slots_MT = np.full((M, B), SCRATCH_PAGE * B, np.int32) + np.arange(B, dtype=np.int32)
        tables_MQ = np.full((M, view // B), SCRATCH_PAGE, np.int32)
        last_K = np.zeros(_pow2(len(segments)), np.int32)
        tile = 0
        for k, (seg, end, count) in enumerate(zip(segments, ends, counts)):
            if len(seg.pages) * B < end:
                raise ValueError(f"{len(seg.pages)} pages cannot hold {end} tokens")
            n = seg.tokens.size
            rows = slice(tile, tile + count)
            tokens_MT[rows].reshape(-1)[:n] = seg.tokens
            positions_MT[rows] = (seg.start + np.arange(count * B, dtype=np.int32)).reshape(count, B)
            slots_MT[rows] = self._slots(positions_MT[rows].reshape(-1), seg.pages, end).reshape(count, B)
            tables_MQ[rows] = self._table(seg.pages, view)
            last_K[k:] = tile * B + n - 1
            tile += count
        x_RD = _embed(self.dense.embed_VD, jnp.asarray(tokens_MT.reshape(-1)))
        positions_R, slots_R = jnp.asarray(positions_MT.reshape(-1)), jnp.asarray(slots_MT.reshape(-1))
        positions_MT, tables_MQ = jnp.asarray(positions_MT), jnp.asarray(tables_MQ)
        for layer, calls in enumerate(self._layer_calls):
            q_nope_NRH, q_pe_NRR, self.pool.layers[layer] = calls.project(x_RD, self.pool.layers[layer], positions_R,
                                                                          slots_R)
            x_RD = calls.finish_tiles(x_RD, q_nope_NRH, q_pe_NRR, self.pool.layers[layer], tables_MQ, view, form,
                                      positions_MT)
            yield x_RD
        return self._head_rows(x_RD, jnp.asarray(last_K))

    def prefill(self, tokens: np.ndarray, start: int, pages: list[int], want_logits: bool, context: object = None,
                keep: bool = False) -> jax.Array:
        """`prefill_layers` run through: the logits (V,) or the last chunk's output, dispatched."""
        return run_layers(self.prefill_layers(tokens, start, pages, want_logits, context, keep))

    def prefill_layers(self, tokens: np.ndarray, start: int, pages: list[int], want_logits: bool,
                       context: object = None, keep: bool = False) -> PrefillLayers:
        """Computes positions [start, start + n) of one sequence whose pages hold its latents [0, start);
        writes their latents into `pages`. With the CPU's prefill kernel attention reads the pages in place:
        absorbed (`_finish_tiles`, one tile per chunk), or expanded (`_expand_pages` once per layer, a unit of its
        own, then each chunk over its keys and values); a single token takes XLA's path, as the dense runner's
        does. Otherwise attention reads the pages gathered into a view once per layer (expanded from it in the
        expanded form). Yields after each unit's dispatch (`PrefillLayers`: a chunk of a layer, or a layer's
        expansion; `prefill_units`); returns the logits (V,) at
        the last position if asked, else the last chunk's output (T, D): dispatched, not waited for; a caller
        that times the segment blocks on it.

        `context` (the sequence, compared by identity) and `keep` (its next segment follows): over gathered views
        in the expanded form, a segment expands the whole view in every layer, so a long prompt cut into many
        segments (a sliced pass among decoding streams) expanded its first rows again and again: on a CPU without
        AMX a 16K miss's passes took 219 s among 15 streams (46 passes) against 128 s alone (8). With `keep` the
        pass keeps its keys and values (`KEPT_BYTES` at most, all sequences'); the sequence's next segment in that
        form, given the same context, then expands only the rows computed since (`forget` drops them)."""
        tokens = np.asarray(tokens, np.int64)
        n, end = tokens.size, start + tokens.size
        if len(pages) * self.page < end:
            raise ValueError(f"{len(pages)} pages cannot hold {end} tokens")
        absorbed, in_place, sizes = self._prefill_plan(n, end)
        offsets = np.cumsum([0, *sizes[:-1]]).tolist()  # each chunk's first token, from start
        padded = np.pad(tokens, (0, sum(sizes) - n))
        chunks = [_embed(self.dense.embed_VD, jnp.asarray(padded[o:o + T], jnp.int32)) for o, T in zip(offsets, sizes)]
        positions = [start + o + np.arange(T, dtype=np.int32) for o, T in zip(offsets, sizes)]
        slots = [jnp.asarray(self._slots(p, pages, end)) for p in positions]
        positions = [jnp.asarray(p) for p in positions]
        count = len(sizes)
        view = view_bucket(end, self.page)
        key_block = self.dense.key_block
        if in_place:
            # The kernel reads each row's own causal range (its position), whatever the table's width: one
            # width, the longest the pool and the model allow, so a chunk size compiles once, not once per
            # view (a first call of a new view stalled every decoding stream 50-250 ms).
            view = self._kernel_view
        table = jnp.asarray(self._table(pages, view))
        views = [view if in_place else min(view, view_bucket(start + o + T, self.page)) for o, T in zip(offsets, sizes)]
        if in_place:  # one tile per chunk
            tables_1Q, positions_1T = table[None], [p[None] for p in positions]
        end_, laid_NSX = jnp.asarray(end, jnp.int32), None
        over_views = context is not None and not (in_place or absorbed)  # the expanded form over gathered views
        kept = self._take_kept(context, start, pages) if over_views else None
        rows = max(_pow2(view), kept.layers[0][0].shape[1] if kept else 0)  # rows of the kept keys and values
        keep = keep and over_views and rows * self._expanded_row_bytes <= KEPT_BYTES
        kept_layers = []
        if kept is not None:  # rows [kept.end, end): this segment's, and any an absorbed segment computed before it
            new_positions = kept.end + np.arange(_pow2(end - kept.end), dtype=np.int32)
            new_slots, first_ = jnp.asarray(self._slots(new_positions, pages, end)), jnp.asarray(kept.end, jnp.int32)
        for layer, calls in enumerate(self._layer_calls):
            pool_PBA = self.pool.layers[layer]
            queries = []
            for i in range(count):
                q_nope_NTH, q_pe_NTR, pool_PBA = calls.project(chunks[i], pool_PBA, positions[i], slots[i])
                queries.append((q_nope_NTH, q_pe_NTR))
            self.pool.layers[layer] = pool_PBA
            if in_place and absorbed:  # a unit per chunk
                for i in range(count):
                    # the pool's array as it is now: a decode step between units donates (replaces) it
                    chunks[i] = calls.finish_tiles(chunks[i], *queries[i], self.pool.layers[layer], tables_1Q,
                                                   views[i], "pages", positions_1T[i])
                    yield chunks[i]
            elif in_place:  # expanded: a unit for the layer's keys and values (and its projections), one per chunk
                if laid_NSX is None:  # one buffer for every layer's
                    laid_NSX = self._take_laid(end)
                laid_NSX = calls.expand(pool_PBA, table, end_, laid_NSX)
                yield laid_NSX  # a unit of its own: with the first chunk that unit took twice the others
                for i in range(count):
                    chunks[i] = calls.finish_attended(chunks[i], calls.attend_laid(*queries[i], laid_NSX,
                                                                                  positions[i]))
                    yield chunks[i]
            else:  # over a view gathered once per layer: as in place, a unit per chunk (and one for the expansion)
                kv_SA, expanded = _gather_view(pool_PBA, table), None
                if kept is not None:  # the new rows only, into the keys and values of the rows before
                    expanded = kept.layers[layer]
                    if expanded[0].shape[1] < rows:
                        expanded = _grow(expanded, rows)
                    expanded = calls.expand_rows(pool_PBA, new_slots, first_, expanded)
                elif not absorbed:
                    expanded = calls.dense.expand(kv_SA, view)
                    if keep:
                        expanded = _grow(expanded, rows)
                if expanded is not None:
                    kept_layers.append(expanded)
                    yield expanded
                for i in range(count):
                    chunks[i] = calls.dense.finish(chunks[i], *queries[i], kv_SA, np.int32(start + offsets[i]),
                                                   views[i], expanded, key_block)
                    yield chunks[i]
        if laid_NSX is not None:
            self._laid = laid_NSX  # for the next segment (a pass closed part-way drops its buffer)
        if keep:
            self._keep(_Kept(context, tuple(pages[:-(-end // self.page)]), end, kept_layers))
        if not want_logits:
            return chunks[-1]
        return self.dense.logits(chunks[-1], (n - 1) - offsets[-1])

    def _take_kept(self, context: object, start: int, pages: list[int]) -> _Kept | None:
        """The context's kept keys and values, taken out (a pass closed part-way drops them), if they hold
        positions [0, end) of these pages for an end at or before `start` (absorbed segments between add none)."""
        kept = self._kept.pop(id(context), None)
        if kept is None or kept.context is not context or kept.end > start:
            return None
        return kept if tuple(pages[:len(kept.pages)]) == kept.pages else None

    def _keep(self, kept: _Kept) -> None:
        """Keeps a sequence's keys and values for its next segment; the oldest others go past `KEPT_BYTES`."""
        self._kept[id(kept.context)] = kept
        while sum(k.bytes for k in self._kept.values()) > KEPT_BYTES:
            self._kept.pop(next(iter(self._kept)))

    def forget(self, context: object) -> None:
        """Drops what is kept for the context (a sequence finished, cancelled or preempted)."""
        kept = self._kept.get(id(context))
        if kept is not None and kept.context is context:
            del self._kept[id(context)]

    def _take_laid(self, end: int) -> jax.Array:
        """A buffer for the expanded form's keys and values of rows [0, end): the one kept from the last segment
        if it has the rows this one's bucket wants, else a new one. Buckets are powers of two from LAID_ROWS, so
        that the attention over it compiles for few shapes (one per chunk size up to 4K tokens of context); the
        kernel computes only `end` rows whatever the buffer's size. Taken, not shared: a segment computed while
        another's pass is in flight gets a buffer of its own."""
        heads, width = self._laid_heads_width
        shape = (heads, max(LAID_ROWS, _pow2(end)), width)
        laid, self._laid = self._laid, None
        return laid if laid is not None and laid.shape == shape else jnp.empty(shape, jnp.uint16)

    def _prefill_plan(self, n: int, end: int) -> tuple[bool, bool, list[int]]:
        """How `prefill_layers` computes an n-token segment ending at `end`: (absorbed, in place, chunk sizes).
        The form by `prefer_absorbed` (the expanded one where the kernel can compute it over the pages); in place
        where the kernel reads the pages for that form (more than one token)."""
        absorbed = (prefer_absorbed(self.cfg, n, view_bucket(end, self.page), self.dense.prefill_kernel,
                                    self.prefill_expands_pages)
                    if self.dense.attention == "auto" else self.dense.attention == "absorbed")
        in_place = self.prefill_reads_pages and n > 1 and (absorbed or self.prefill_expands_pages)
        return absorbed, in_place, self._chunk_sizes(n, end)

    def prefill_absorbed(self, n: int, end: int) -> bool:
        """Whether `prefill_layers` computes an n-token segment ending at `end` in the absorbed form."""
        return self._prefill_plan(n, end)[0]

    def prefill_units(self, n: int, end: int) -> int:
        """The units (`next` calls before the result) of `prefill_layers` for an n-token segment ending at `end`:
        a layer's chunk each (and in the expanded form one more per layer, its keys and values), whether attention
        reads the pages in place or a view gathered from them. (A layer each over a view, as before, made a
        slice a whole layer of the segment: on a CPU without AMX, 0.8 s a unit at 16K of context against a
        slice's budget of 0.26 s.)"""
        absorbed, _, sizes = self._prefill_plan(n, end)
        return len(self._layer_calls) * (len(sizes) + (not absorbed))

    def _chunk_sizes(self, n: int, end: int) -> list[int]:
        """Rows of each chunk of an n-token segment ending at `end`: chunks of the dense runner's size (a power of
        two), the last one cut to the rest in whole pages (a power of two up to a page). Padded to a power of two,
        a 300-token segment cost what 512 tokens do (167 against 174 ms on `mini`) and 600 what 1,024 do."""
        if n == 1:
            return [1]
        T = min(self.dense.chunk_size(end), _pow2(max(n, MIN_CHUNK)))
        full = (n - 1) // T  # chunks before the last
        rest = n - full * T
        last = _pow2(max(rest, MIN_CHUNK)) if rest <= self.page else -(-rest // self.page) * self.page
        return [T] * full + [min(T, last)]
