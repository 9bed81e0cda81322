"""The engine's model: decode batches and ragged prefill passes over the paged latent pool, attention by a backend.

- decode: a token of each of B sequences, in groups of like layers (one jitted call a group); the new latents are
  written after the step (XLA:CPU copies a pool that one computation both scatters into and reads).
- prefill: a pass computes segments (tokens [start, start + n) of one sequence each) layer-major, a layer's latents
  written into the pages first and read back by attention, so a prefix from disk, memory or a step earlier looks
  the same. One segment goes in chunks; several short ones as tiles of a page.
Shapes never follow a prompt's length: decode batches and prefill views are powers of two, decode tables one width.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Generator
from functools import lru_cache, partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from model.attention import AttentionBackend
from model.attention.xla import DECODE_BLOCK_ROWS, key_block_for
from model.config import ModelConfig
from model.latent_pool import SCRATCH_PAGE, LatentPool, as_bits, pow2
from model.sampling import SamplingParams, SamplingRow, sample_batch
from model.transformer import DeepseekModel

MIN_VIEW = 256  # rows: the smallest prefill view
MIN_CHUNK = 16  # tokens: the smallest padded chunk
DECODE_VIEW_STEPS = 4  # decode cost buckets per doubling past 512 rows (`decode_shape`)
DECODE_GROUP = 8  # layers per jitted decode call, at most
MAX_PASS_TILES = 8  # tiles (a page of rows each) of a pass of several segments: 512 rows, as a chunk
MAX_SEGMENT_TILES = 3  # tiles of a segment that goes in a pass of several
MAX_TILE_VIEW = 4096  # rows of the longest view a pass of several segments gives each tile


def enable_compilation_cache(path: str | None = None) -> None:
    path = path or os.environ.get("DEEPINFER_JAX_CACHE", os.path.expanduser("~/.cache/deepinfer/jax"))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # Every compile is kept: the small ones (a slice, a gather, the sampler: 30-100 ms each) add up to seconds of
    # stalls per new process, and a cache load takes a few ms.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


def view_bucket(n: int, page: int, steps: int = 1) -> int:
    """Rows of a view over positions [0, n), in whole pages: a power of two up to 512 rows; beyond, `steps` sizes
    per doubling up to 4,096 rows and at least 2 past it (each shape is a compile that stalls the engine)."""
    n = max(n, MIN_VIEW)
    pieces = 1 if n <= 512 else steps if n <= 4096 else max(steps, 2)
    unit = pow2(n) // (2 * pieces)
    return -(-(-(-n // unit) * unit) // page) * page


def prefill_chunk(cfg: ModelConfig, total: int, chunk_tokens: int, budget_bytes: int, key_block: int) -> int:
    """Largest power-of-two chunk (<= chunk_tokens) of a prompt ending at `total` whose float32 attention work
    space fits budget_bytes: one key block's scores (N, T, block) and the running (N, T, C or V) output."""
    view = view_bucket(total, 64)
    block = key_block_for(view, key_block)
    per_token = cfg.num_heads * block * 4 * 3  # scores, exp, probs
    if block < view:
        per_token += cfg.num_heads * max(cfg.kv_lora_rank, cfg.v_head_dim) * 4 * 2
    fit = max(MIN_CHUNK, budget_bytes // per_token)
    return min(pow2(chunk_tokens), 1 << (fit.bit_length() - 1))


class SplitModule:
    """A module split once (graph definition, flat state leaves), so no jitted call re-hashes or re-flattens it."""

    def __init__(self, module: nnx.Module):
        self.graphdef, state = nnx.split(module)
        self.leaves, self.state_def = jax.tree.flatten(state)

    def jit(self, body: Callable, static_argnums: tuple[int, ...] = (), donate_argnums: tuple[int, ...] = ()):
        """body(module, *args) jitted as f(*args); argnums count args (the module is not one)."""
        return partial(_jit_body(body, self.graphdef, self.state_def, static_argnums, donate_argnums), self.leaves)


@lru_cache(maxsize=None)
def _jit_body(body, graphdef, state_def, static_argnums, donate_argnums):
    """One jitted function per body and module structure, shared by like layers and runners of one model."""
    def call(leaves, *args):
        return body(nnx.merge(graphdef, jax.tree.unflatten(state_def, leaves)), *args)

    return jax.jit(call, static_argnums=tuple(i + 1 for i in static_argnums),
                   donate_argnums=tuple(i + 1 for i in donate_argnums))


def _write_slots(pool_PBA, slots_T, latents_TA):
    """The pool with each row t of latents_TA written at flat slot slots_T[t] (page * B + offset)."""
    P, B, A = pool_PBA.shape
    return pool_PBA.reshape(P * B, A).at[slots_T].set(as_bits(latents_TA), mode="promise_in_bounds").reshape(P, B, A)


def _decode_layer(backend, layer, absorbed, pool_PBA, x_BD, positions_B, tables_BQ):
    """One decode token of B sequences through a layer: (x_BD, the tokens' latents (B, A))."""
    attn = layer.attn
    h_BD = layer.input_norm(x_BD)
    q_nope_NBH, q_pe_NBR = attn.queries(h_BD, positions_B)
    latents_BA = attn.latents(h_BD, positions_B)
    q_lat_BNC = backend.per_head(q_nope_NBH, absorbed.w_uk_NCH).transpose(1, 0, 2)
    q_BNA = jnp.concatenate([q_lat_BNC, q_pe_NBR.transpose(1, 0, 2)], axis=-1).astype(backend.decode_dtype)
    out_BNC = backend.decode(attn, q_BNA, positions_B, pool_PBA, tables_BQ, latents_BA)
    x_BD = x_BD + attn.output(backend.per_head(out_BNC.transpose(1, 0, 2), absorbed.w_uv_NVC))
    return x_BD + layer.mlp(layer.post_attn_norm(x_BD)), latents_BA


@lru_cache(maxsize=64)
def _decode_group(layer_defs: tuple, head_def, weights_def, backend: AttentionBackend, first: bool, last: bool):
    """A group's decode call, shared by like groups: (x_BD, or the last group's logits (B, V); latents (G, B, A))."""
    def step(weights, pools, x, positions_B, tables_BQ):
        embed_VD, states, absorbeds, head_state = jax.tree.unflatten(weights_def, weights)
        x_BD = jnp.take(embed_VD, x, axis=0) if first else x
        latents = []
        for graphdef, state, absorbed, pool_PBA in zip(layer_defs, states, absorbeds, pools):
            x_BD, latents_BA = _decode_layer(backend, nnx.merge(graphdef, state), absorbed, pool_PBA, x_BD,
                                             positions_B, tables_BQ)
            latents.append(latents_BA)
        if last:
            head = nnx.merge(head_def, head_state)
            x_BD = head.lm_head(head.norm(x_BD)).astype(jnp.float32)
        return x_BD, jnp.stack(latents)

    return jax.jit(step)


@partial(jax.jit, donate_argnums=(0,))
def _write_latents(pools, slots_B, latents):
    latents_LBA = jnp.concatenate(latents)
    return [_write_slots(pool_PBA, slots_B, latents_BA) for pool_PBA, latents_BA in zip(pools, latents_LBA)]


def layer_groups(defs: list) -> list[range]:
    """Runs of consecutive layers of one structure, each cut into near-equal groups of at most DECODE_GROUP."""
    groups, start = [], 0
    for i in range(1, len(defs) + 1):
        if i == len(defs) or defs[i] != defs[start]:
            size = -(-(i - start) // -(-(i - start) // DECODE_GROUP))
            groups += [range(s, min(s + size, i)) for s in range(start, i, size)]
            start = i
    return groups


def _project(layer, x_TD, pool_PBA, positions_T, slots_T):
    """Queries of T tokens, and their latents written into the pool."""
    h_TD = layer.input_norm(x_TD)
    q_nope_NTH, q_pe_NTR = layer.attn.queries(h_TD, positions_T)
    return q_nope_NTH, q_pe_NTR, _write_slots(pool_PBA, slots_T, layer.attn.latents(h_TD, positions_T))


def _context(layer, pool_PBA, tables_MQ, end, into, backend, form):
    return backend.prefill_context(layer.attn, pool_PBA, tables_MQ, end, form, into)


def _attend(layer, x_RD, q_nope_NRH, q_pe_NRR, pool_PBA, tables_MQ, positions_MT, context, backend, form):
    """A chunk's attention (the backend's), its residual and the feed-forward over its R rows: (R, D)."""
    x_RD = x_RD + backend.prefill_attend(layer.attn, q_nope_NRH, q_pe_NRR, positions_MT, pool_PBA, tables_MQ,
                                         context, form)
    return x_RD + layer.mlp(layer.post_attn_norm(x_RD))


def _head_rows(head, x_RD, rows_K):
    """Logits (K, V) float32 of rows rows_K."""
    return head.lm_head(head.norm(x_RD[rows_K])).astype(jnp.float32)


@jax.jit
def _embed(embed_VD, tokens_T):
    return jnp.take(embed_VD, tokens_T, axis=0)


class Segment(NamedTuple):
    """Tokens at positions [start, start + len(tokens)) of one sequence whose block table is `pages`."""
    tokens: np.ndarray
    start: int
    pages: list[int]


class DecodeRow(NamedTuple):
    token: int
    position: int  # where the token goes (its latent is written at this position)
    pages: list[int]  # the sequence's block table, covering position


class _Chunk(NamedTuple):
    """M tiles of T query rows (R = M * T) on device: x (R, D), positions (M, T), (R,), slots (R,), tables (M, Q)."""
    x_RD: jax.Array
    positions_MT: jax.Array
    positions_R: jax.Array
    slots_R: jax.Array
    tables_MQ: jax.Array


class PrefillPass:
    """A prefill pass under way, a unit (a layer's context or chunk) a `step()`; after `units` steps `result` holds the
    logits (K, V) at each segment's last token (K a power of two), or the last chunk's output; closed early, redo it."""

    def __init__(self, units: int, per_layer: int, run: Generator):
        self.units, self.per_layer, self.done, self.result = units, per_layer, 0, None
        self._run = run

    @property
    def layer(self) -> int:
        return self.done // self.per_layer

    def step(self) -> object:
        out = next(self._run)
        self.done += 1
        if self.done == self.units:
            try:
                next(self._run)
            except StopIteration as finished:
                self.result = finished.value
        return out

    def run(self) -> jax.Array:
        while self.done < self.units:
            self.step()
        return self.result

    def close(self) -> None:
        self._run.close()


class Runner:
    def __init__(self, model: DeepseekModel, cfg: ModelConfig, pool: LatentPool, backend: AttentionBackend,
                 chunk_tokens: int = 512, attention_budget_bytes: int = 512 << 20, fixed_batch: int = 0,
                 form: str = "auto"):
        if form not in ("auto", "absorbed", "expanded"):
            raise ValueError(f"form must be auto, absorbed or expanded, got {form!r}")
        self.cfg, self.pool, self.backend, self.page = cfg, pool, backend, pool.page_tokens
        self.chunk_tokens, self.attention_budget_bytes = pow2(chunk_tokens), attention_budget_bytes
        self.fixed_batch = fixed_batch  # batch-invariant mode: every decode batch padded to this size
        self.form = form  # prefill attention's form: the backend's choice, or one named (tests, benchmarks)
        self.embed_VD = model.embed[...]
        layers = [SplitModule(layer) for layer in model.layers]
        self._project = [layer.jit(_project, donate_argnums=(1,)) for layer in layers]
        self._context = [layer.jit(_context, static_argnums=(4, 5), donate_argnums=(3,)) for layer in layers]
        self._attend = [layer.jit(_attend, static_argnums=(7, 8)) for layer in layers]
        head = SplitModule(model.head)
        self._head_rows = head.jit(_head_rows)
        # decode tables: one width, whole key blocks, up to the longest context the pool and the model allow
        step = max(1, DECODE_BLOCK_ROWS // self.page)
        self.table_pages = -(-min(pool.num_pages - 1, -(-cfg.max_position_embeddings // self.page)) // step) * step
        absorbed = [backend.absorbed(layer.attn) for layer in model.layers]
        self._groups = []
        for group in layer_groups([layer.graphdef for layer in layers]):
            first, last = group.start == 0, group.stop == len(layers)
            weights, weights_def = jax.tree.flatten((self.embed_VD if first else None,
                                                     [jax.tree.unflatten(layers[i].state_def, layers[i].leaves)
                                                      for i in group], [absorbed[i] for i in group],
                                                     jax.tree.unflatten(head.state_def, head.leaves) if last else None))
            call = _decode_group(tuple(layers[i].graphdef for i in group), head.graphdef, weights_def, backend, first,
                                 last)
            self._groups.append((group, call, weights))

    def check_tokens(self, tokens: np.ndarray, extra: int = 0) -> None:
        if tokens.ndim != 1 or tokens.size == 0:
            raise ValueError("tokens must be a non-empty 1-D sequence")
        if tokens.min() < 0 or tokens.max() >= self.cfg.vocab_size:
            bad = int(tokens[(tokens < 0) | (tokens >= self.cfg.vocab_size)][0])
            raise ValueError(f"token id {bad} out of range [0, {self.cfg.vocab_size})")
        if tokens.size + extra > self.cfg.max_context:
            raise ValueError(f"prompt of {tokens.size} tokens (+{extra} to generate) exceeds the context length "
                             f"{self.cfg.max_context}")

    def _slots(self, positions: np.ndarray, pages: list[int], valid: int) -> np.ndarray:
        """Flat pool slots of positions; positions at or past `valid` go to the scratch page."""
        table = np.asarray(pages, np.int64)
        real = positions < valid
        slots = SCRATCH_PAGE * self.page + positions % self.page
        slots[real] = table[positions[real] // self.page] * self.page + positions[real] % self.page
        return slots.astype(np.int32)

    def _table(self, pages: list[int], count: int) -> np.ndarray:
        table = np.full(count, SCRATCH_PAGE, np.int32)
        n = min(len(pages), count)
        table[:n] = pages[:n]
        return table

    def decode_shape(self, positions: list[int]) -> tuple[int, int]:
        """(padded batch, rows each sequence's attention costs) of a decode dispatch."""
        batch = max(self.fixed_batch, pow2(len(positions)))
        if not self.backend.decode_by_longest:
            return batch, self.table_pages * self.page
        return batch, view_bucket(max(positions) + 1, self.page, DECODE_VIEW_STEPS)

    def decode(self, rows: list[DecodeRow]) -> jax.Array:
        """Feeds a token per sequence; returns the logits on the device, (B, V), B >= len(rows) (padding past)."""
        B = max(self.fixed_batch, pow2(len(rows)))
        tokens, positions = np.zeros(B, np.int32), np.zeros(B, np.int32)
        slots = np.full(B, SCRATCH_PAGE * self.page, np.int32)
        tables = np.full((B, self.table_pages), SCRATCH_PAGE, np.int32)
        for i, r in enumerate(rows):
            tokens[i], positions[i] = r.token, r.position
            slots[i] = self._slots(np.asarray([r.position]), r.pages, r.position + 1)[0]
            tables[i] = self._table(r.pages, self.table_pages)
        x, latents = tokens, []
        for group, call, weights in self._groups:
            x, group_latents = call(weights, [self.pool.layers[i] for i in group], x, positions, tables)
            latents.append(group_latents)
        self.pool.layers = _write_latents(self.pool.layers, slots, latents)
        return x

    def batchable(self, n: int, end: int) -> bool:
        """Whether an n-token segment ending at `end` goes in a pass of several: short, and a short enough view."""
        return n <= MAX_SEGMENT_TILES * self.page and view_bucket(end, self.page) <= MAX_TILE_VIEW

    def chunk_sizes(self, n: int, end: int) -> list[int]:
        """Rows of each chunk of an n-token segment ending at `end`: `prefill_chunk`'s, the last the rest in pages."""
        if n == 1:
            return [1]
        T = min(prefill_chunk(self.cfg, end, self.chunk_tokens, self.attention_budget_bytes, self.backend.key_block),
                pow2(max(n, MIN_CHUNK)))
        full = (n - 1) // T  # chunks before the last
        rest = n - full * T
        last = pow2(max(rest, MIN_CHUNK)) if rest <= self.page else -(-rest // self.page) * self.page
        return [T] * full + [min(T, last)]

    def _form(self, n: int, end: int):
        return self.backend.prefill_form(n, view_bucket(end, self.page), self.form)

    def prefill(self, segments: list[Segment], want_logits: bool = True) -> PrefillPass:
        """A pass computing these segments (pages hold [0, start) already): one in chunks, several as a page's tiles."""
        B, ends = self.page, [s.start + len(s.tokens) for s in segments]
        for s, end in zip(segments, ends):
            if len(s.pages) * B < end:
                raise ValueError(f"{len(s.pages)} pages cannot hold {end} tokens")
        if len(segments) == 1:  # (segment, first row, rows) of each chunk's tiles
            n = len(segments[0].tokens)
            form, sizes = self._form(n, ends[0]), self.chunk_sizes(n, ends[0])
            pieces = [[(0, o, T)] for o, T in zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes)]
        else:
            pieces = [[(k, o, B) for k, s in enumerate(segments) for o in range(0, len(s.tokens), B)]]
            form = self.backend.prefill_form(B, view_bucket(max(ends), B), self.form, len(pieces[0]))
            if len(pieces[0]) > MAX_PASS_TILES:
                raise ValueError(f"{len(pieces[0])} tiles do not fit one pass of {MAX_PASS_TILES}")
        view = self.table_pages * B if form.fixed_table else view_bucket(max(ends), B)
        chunks = [self._chunk(segments, ends, tiles, view) for tiles in pieces]
        last_K = np.zeros(pow2(len(segments)), np.int32)  # each segment's last row in the last chunk
        for m, (k, o, T) in enumerate(pieces[-1]):
            if o < len(segments[k].tokens) <= o + T:
                last_K[k:] = m * T + len(segments[k].tokens) - 1 - o
        per_layer = len(chunks) + form.context_unit
        run = self._pass(chunks, max(ends), form, jnp.asarray(last_K), want_logits)
        return PrefillPass(self.cfg.num_layers * per_layer, per_layer, run)

    def _chunk(self, segments: list[Segment], ends: list[int], tiles: list[tuple[int, int, int]], view: int):
        T = tiles[0][2]
        tokens_MT, positions_MT = np.zeros((len(tiles), T), np.int32), np.zeros((len(tiles), T), np.int32)
        slots_MT, tables_MQ = np.zeros((len(tiles), T), np.int32), np.zeros((len(tiles), view // self.page), np.int32)
        for m, (k, o, _) in enumerate(tiles):
            seg = segments[k]
            part = seg.tokens[o:o + T]
            tokens_MT[m, :len(part)] = part
            positions_MT[m] = seg.start + o + np.arange(T)
            slots_MT[m] = self._slots(positions_MT[m], seg.pages, ends[k])
            tables_MQ[m] = self._table(seg.pages, view // self.page)
        return _Chunk(_embed(self.embed_VD, jnp.asarray(tokens_MT.reshape(-1))), jnp.asarray(positions_MT),
                      jnp.asarray(positions_MT.reshape(-1)), jnp.asarray(slots_MT.reshape(-1)), jnp.asarray(tables_MQ))

    def warm_up(self, pages: list[int], n: int, segment_sizes: list[int], batches: list[int]) -> float:
        """Compiles, on scratch `pages`, the first shapes a server meets; returns an n-token prefill's seconds."""
        greedy = SamplingRow(SamplingParams(), 0, 0)
        sample_batch(self.prefill([Segment(np.arange(1, 17), 0, pages)]).run(), [greedy])
        for size in [n, *(size for size in segment_sizes if size < n)]:
            self.prefill([Segment(np.arange(size) % self.cfg.vocab_size, 0, pages)]).run()
        for batch in batches:
            sample_batch(self.decode([DecodeRow(1, 16, pages)] * batch), [greedy] * batch)
        begin = time.perf_counter()
        np.asarray(self.prefill([Segment(np.arange(n) % self.cfg.vocab_size, 0, pages)]).run())
        return time.perf_counter() - begin

    def _pass(self, chunks: list[_Chunk], end: int, form, last_K, want_logits: bool) -> Generator:
        xs, context, end_ = [c.x_RD for c in chunks], None, jnp.asarray(end, jnp.int32)
        for layer in range(self.cfg.num_layers):
            queries = []
            for c, x in zip(chunks, xs):
                q_nope, q_pe, self.pool.layers[layer] = self._project[layer](x, self.pool.layers[layer],
                                                                             c.positions_R, c.slots_R)
                queries.append((q_nope, q_pe))
            if form.context_unit:  # a context once per layer for all chunks (other forms have none)
                into = self.backend.context_buffer(form.name, end, context)
                context = self._context[layer](self.pool.layers[layer], chunks[0].tables_MQ, end_, into,
                                               self.backend, form.name)
                yield context
            for i, c in enumerate(chunks):
                # the pool's array as it is now: a decode step between units donates (replaces) it
                xs[i] = self._attend[layer](xs[i], *queries[i], self.pool.layers[layer], c.tables_MQ,
                                            c.positions_MT, context, self.backend, form.name)
                yield xs[i]
        return self._head_rows(xs[-1], last_K) if want_logits else xs[-1]
