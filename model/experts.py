"""Routed experts: token copies grouped by expert, and only the experts a token chose run on it.

Axes: T tokens, K experts per token, M = T*K token copies, E experts (the local ones under expert parallelism),
D hidden, I expert intermediate. The copies are sorted by expert (`dispatch`), each expert's SwiGLU runs on its own
rows (`grouped_swiglu`: `jax.lax.ragged_dot` on GPU/TPU, elsewhere a loop over tiles of sorted rows, as XLA:CPU
lowers `ragged_dot` to a dense matmul over every group), and the outputs go back to token order, weighted.
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

MAX_BLOCK = 128  # rows: the largest tile; bigger tiles waste more padding per expert


def dispatch(ids_TK: jax.Array, n_local: int, first: int = 0) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Sorts token copies by expert, experts outside [first, first + n_local) last: (order_M: copy index of each
    sorted row, sizes_E (n_local,) int32 rows per local expert, local_TK: whether a choice is local)."""
    local_TK = (ids_TK >= first) & (ids_TK < first + n_local)
    key_M = jnp.where(local_TK, ids_TK - first, n_local).reshape(-1)  # (M,)
    order_M = jnp.argsort(key_M, stable=True)
    sizes_E = jnp.zeros((n_local,), jnp.int32).at[key_M].add(1, mode="drop")
    return order_M, sizes_E, local_TK


def block_rows(copies: int, n_experts: int) -> int:
    """Tile height: the power of two at or above the mean rows per expert, between 1 and MAX_BLOCK."""
    mean = -(-copies // n_experts)
    return min(MAX_BLOCK, 1 << max(0, (mean - 1).bit_length()))


def _tiles(x_MD, gate_EDI, up_EDI, down_EID, sizes_E, block: int) -> jax.Array:
    """Rows past sum(sizes_E) come back as whatever the last tile wrote; callers mask them."""
    M, D = x_MD.shape
    E = sizes_E.shape[0]
    tiles_E = (sizes_E + block - 1) // block
    tile_end_E = jnp.cumsum(tiles_E)  # tiles of experts [0, e]
    row_start_E = jnp.cumsum(sizes_E) - sizes_E
    n_max = -(-M // block) + E  # static bound on sum(ceil(size / block))
    tile_N = jnp.arange(n_max)
    expert_N = jnp.minimum(jnp.searchsorted(tile_end_E, tile_N, side="right"), E - 1)
    start_N = row_start_E[expert_N] + (tile_N - (tile_end_E - tiles_E)[expert_N]) * block
    # A tile may run past its expert's rows into the next expert's, which that expert's tiles
    # (later in the loop) overwrite; padding keeps the last tile's slice from being clamped.
    x_PD = jnp.pad(x_MD, ((0, block), (0, 0)))  # (M + block, D)

    def tile(n, y_PD):
        e, start = expert_N[n], start_N[n]
        x_BD = jax.lax.dynamic_slice_in_dim(x_PD, start, block)
        h_BI = jax.nn.silu(x_BD @ gate_EDI[e]) * (x_BD @ up_EDI[e])
        return jax.lax.dynamic_update_slice_in_dim(y_PD, (h_BI @ down_EID[e]).astype(y_PD.dtype), start, 0)

    # a while loop over the tiles that exist: empty experts cost nothing
    y_PD = jax.lax.fori_loop(0, tile_end_E[-1], tile, jnp.zeros((M + block, D), x_MD.dtype))
    return y_PD[:M]


def _ragged(x_MD, gate_EDI, up_EDI, down_EID, sizes_E) -> jax.Array:
    dot = partial(jax.lax.ragged_dot, group_sizes=sizes_E, preferred_element_type=jnp.float32)
    x_MD = x_MD.astype(gate_EDI.dtype)
    h_MI = jax.nn.silu(dot(x_MD, gate_EDI)) * dot(x_MD, up_EDI)
    return dot(h_MI.astype(down_EID.dtype), down_EID)  # (M, D) float32


def grouped_swiglu(x_MD: jax.Array, gate_EDI: jax.Array, up_EDI: jax.Array, down_EID: jax.Array,
                   sizes_E: jax.Array, method: str = "auto") -> jax.Array:
    """SwiGLU of expert e on rows [sum(sizes[:e]), sum(sizes[:e+1])) of x_MD: (M, D), rows past them unspecified."""
    if method == "auto":
        method = expert_method(jax.default_backend())
    if method == "ragged_dot":
        return _ragged(x_MD, gate_EDI, up_EDI, down_EID, sizes_E)
    if method != "tiles":
        raise ValueError(f"grouped_swiglu: method must be auto, tiles or ragged_dot, got {method!r}")
    return _tiles(x_MD, gate_EDI, up_EDI, down_EID, sizes_E, block_rows(x_MD.shape[0], sizes_E.shape[0]))


def expert_method(platform: str) -> str:
    """The grouped SwiGLU's implementation for a platform (a served model names its platform: model/serving.py)."""
    return "ragged_dot" if platform in ("gpu", "cuda", "rocm", "tpu") else "tiles"


def routed_experts(x_TD: jax.Array, weights_TK: jax.Array, ids_TK: jax.Array, gate_EDI: jax.Array,
                   up_EDI: jax.Array, down_EID: jax.Array, first: int | jax.Array = 0,
                   method: str = "auto") -> jax.Array:
    """sum_k weights[t, k] * SwiGLU_{ids[t, k]}(x[t]) over the choices among the local experts [first, first + E);
    (T, D). Under expert parallelism each device passes its own `first` and the partial sums are added."""
    T, K = ids_TK.shape
    order_M, sizes_E, local_TK = dispatch(ids_TK, gate_EDI.shape[0], first)
    x_MD = x_TD[order_M // K]  # (M, D) sorted copies
    y_MD = grouped_swiglu(x_MD, gate_EDI, up_EDI, down_EID, sizes_E, method)
    y_TKD = jnp.zeros_like(y_MD).at[order_M].set(y_MD).reshape(T, K, -1)  # back in token order
    y_TKD = jnp.where(local_TK[..., None], y_TKD, 0)  # rows of other devices' experts are garbage
    return jnp.einsum("tk,tkd->td", weights_TK.astype(x_TD.dtype), y_TKD)


def all_experts(x_TD: jax.Array, weights_TK: jax.Array, ids_TK: jax.Array, gate_EDI: jax.Array,
                up_EDI: jax.Array, down_EID: jax.Array) -> jax.Array:
    """The reference: every expert on every token, unrouted ones weighted zero; (T, D). For tests and benchmarks."""
    E = gate_EDI.shape[0]
    weights_TE = (jax.nn.one_hot(ids_TK, E, dtype=jnp.float32) * weights_TK[..., None]).sum(1)
    h_TEI = (jax.nn.silu(jnp.einsum("td,edi->tei", x_TD, gate_EDI))
             * jnp.einsum("td,edi->tei", x_TD, up_EDI))
    y_TED = jnp.einsum("tei,eid->ted", h_TEI, down_EID)
    return jnp.einsum("te,ted->td", weights_TE.astype(x_TD.dtype), y_TED)
