"""The model as the engine serves it: its projections at a serving dtype, stored (out, in).

The checkpoint keeps its own dtype (conversion, parity tests, model/reference.py); the engine serves a copy whose
`Linear`s are `ServingLinear`s: weights (and W_UK, W_UV) at the serving dtype, inputs cast to it, products summed
in float32, so the residual stream, norms, softmax and sampling stay float32. On XLA:CPU a bfloat16 product of ONE
row takes a slow path, so one row is computed as two; without AMX, bfloat16 products of many rows are slower than
float32's, so products of `WIDE_ROWS` or more rows (and prefill attention's) widen their bfloat16-rounded operands
to float32. `--dtype float32` serves the checkpoint unchanged.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from model import cpu_kernels
from model.config import check_serving_dtype
from model.experts import expert_method
from model.layers import Linear, MoE
from model.mla import MLAttention
from model.transformer import DeepseekModel

WIDE_ROWS = 128  # on a CPU without AMX, bfloat16 products of at least this many rows widen to float32


class ServingLinear(nnx.Module):
    """y = x @ W.T, W (out, in) at the serving dtype, float32 out; `few_rows`: few-row products take our kernel
    (model/cpu_kernels.py); `wide_rows`: products of at least that many rows widen to float32 (the module's note)."""

    def __init__(self, weight_OI: jax.Array, few_rows: bool = False, wide_rows: int = 0):
        self.weight = nnx.Param(weight_OI)
        self.few_rows = few_rows
        self.wide_rows = wide_rows

    def __call__(self, x: jax.Array) -> jax.Array:
        w_OI = self.weight[...]
        *lead, in_dim = x.shape
        rows = math.prod(lead)
        if self.few_rows and cpu_kernels.few_rows_supported(rows, in_dim):
            return cpu_kernels.few_row_product(x.reshape(rows, in_dim), w_OI).reshape(*lead, w_OI.shape[0])
        if self.wide_rows and rows >= self.wide_rows:
            return jnp.einsum("...i,oi->...o", x.astype(w_OI.dtype).astype(jnp.float32), w_OI.astype(jnp.float32))
        one_row = x.ndim == 2 and x.shape[0] == 1
        x = jnp.concatenate([x, x]) if one_row else x  # see the module's note on one-row products
        y = jnp.einsum("...i,oi->...o", x.astype(w_OI.dtype), w_OI, preferred_element_type=jnp.float32)
        return y[:1] if one_row else y


def serving_model(model: DeepseekModel, dtype: str, few_row_kernel: bool = True, wide: bool = True,
                  platform: str | None = None) -> DeepseekModel:
    """The model the engine runs at `dtype` on `platform` (None: where its arrays are): itself for float32 over
    float32, else a module tree sharing every array but the re-laid projections (drop the original to free them)."""
    check_serving_dtype(dtype, "serving dtype")
    if dtype == "float32" and all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(nnx.state(model))):
        return model
    graphdef, state = nnx.split(model)
    platform = platform or next(iter(jax.tree.leaves(state)[0].devices())).platform
    kernels = jnp.dtype(dtype) == jnp.bfloat16 and cpu_kernels.available(platform)[0]
    few_rows = few_row_kernel and kernels and cpu_kernels.few_rows_serve()
    widen = wide and jnp.dtype(dtype) == jnp.bfloat16 and platform == "cpu" and not cpu_kernels.has_amx()
    served = nnx.merge(graphdef, state)  # new modules over the same arrays
    for path, module in list(nnx.iter_graph(served)):
        if isinstance(module, MoE):  # GPU/TPU: routed experts at the serving dtype, never widened (experts.py)
            module.method = expert_method(platform)
            # the CPU keeps the checkpoint's: its tiles of float32 rows widen bfloat16 experts whole each call
            if module.method == "ragged_dot":
                for name in ("gate_proj", "up_proj", "down_proj"):
                    setattr(module, name, nnx.Param(getattr(module, name)[...].astype(dtype)))
        elif isinstance(module, MLAttention):  # attention's own products take the serving dtype too
            module.w_uk = nnx.Param(module.w_uk[...].astype(dtype))
            module.w_uv = nnx.Param(module.w_uv[...].astype(dtype))
            module.wide = widen
        elif isinstance(module, Linear):
            *parents, name = path
            parent = served
            for key in parents:
                parent = parent[key] if isinstance(key, int) else getattr(parent, key)
            setattr(parent, name, ServingLinear(module.kernel[...].T.astype(dtype), few_rows,
                                                 WIDE_ROWS if widen else 0))
    return served
