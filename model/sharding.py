"""The model's weights over a (tensor, expert) device mesh; the latent cache replicated.

- "tensor": attention heads (q_b_proj/q_proj columns, W_UK, W_UV, o_proj rows), the intermediate dim of the
  MLPs and of each routed expert, and the vocabulary. XLA inserts the all-reduces after o_proj and down_proj.
- "expert": the routed experts. `expert_parallel` runs `routed_experts` under `shard_map`: each device runs
  only the token copies routed to its own experts, and the partial sums are added over the mesh.
The latent cache is replicated (one latent per token per layer, shared by every head: no head axis to split), so
a block loads into every device as stored. A dim that does not divide by its axis's size stays replicated.
"""
from __future__ import annotations

import re
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

TENSOR, EXPERT = "tensor", "expert"

# (pattern over the flat parameter name, partition of each dim); first match wins, else replicated.
RULES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"^embed$", (TENSOR, None)),  # (V, D)
    (r"\.lm_head\.kernel$", (None, TENSOR)),  # (D, V)
    (r"\.attn\.(q_b_proj|q_proj)\.kernel$", (None, TENSOR)),  # (Q or D, N*(H+R)): head-major columns
    (r"\.attn\.(w_uk|w_uv)$", (None, TENSOR, None)),  # (C, N, H|V)
    (r"\.attn\.o_proj\.kernel$", (TENSOR, None)),  # (N*V, D)
    (r"\.mlp\.(shared\.)?(gate_proj|up_proj)\.kernel$", (None, TENSOR)),  # (D, I)
    (r"\.mlp\.(shared\.)?down_proj\.kernel$", (TENSOR, None)),  # (I, D)
    (r"\.mlp\.(gate_proj|up_proj)$", (EXPERT, None, TENSOR)),  # routed (E, D, I)
    (r"\.mlp\.down_proj$", (EXPERT, TENSOR, None)),  # routed (E, I, D)
)


def make_mesh(tensor: int, expert: int, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if tensor * expert > len(devices):
        raise ValueError(f"mesh tensor={tensor} x expert={expert} needs {tensor * expert} devices, "
                         f"{len(devices)} are visible")
    return Mesh(np.asarray(devices[: tensor * expert]).reshape(tensor, expert), (TENSOR, EXPERT))


def param_spec(name: str, shape: tuple[int, ...], mesh: Mesh | jax.sharding.AbstractMesh) -> P:
    """The partition of one parameter; an axis that does not divide its dim is dropped."""
    for pattern, axes in RULES:
        if re.search(pattern, name):
            kept = [axis if axis is not None and dim % mesh.shape[axis] == 0 else None
                    for axis, dim in zip(axes, shape)]
            return P(*kept)
    return P()


def _flat_names(tree: dict, prefix: str = "") -> dict:
    """Same nesting as `tree`, every leaf replaced by its dotted name."""
    return {key: _flat_names(value, f"{prefix}{key}.") if isinstance(value, dict) else f"{prefix}{key}"
            for key, value in tree.items()}


def param_shardings(params: dict, mesh: Mesh) -> dict:
    """A NamedSharding for every leaf of a pure-dict parameter tree (arrays or shape structs)."""
    names = _flat_names(params)
    return jax.tree.map(lambda name, value: NamedSharding(mesh, param_spec(name, value.shape, mesh)),
                        names, params)


def expert_parallel(routed: Callable, x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID) -> jax.Array:
    """routed(...) over the mesh in context, each device running its own experts; with no "expert" axis, a call."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or EXPERT not in mesh.axis_names:
        return routed(x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID)
    specs = [param_spec(".mlp." + name, w.shape, mesh)
             for name, w in (("gate_proj", gate_EDI), ("up_proj", up_EDI), ("down_proj", down_EID))]
    summed = tuple(axis for axis in (EXPERT, TENSOR) if axis in specs[0] or axis in specs[2])
    local_experts = gate_EDI.shape[0] // (mesh.shape[EXPERT] if EXPERT in specs[0] else 1)

    def local(x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID):
        first = jax.lax.axis_index(EXPERT) * local_experts if EXPERT in specs[0] else 0
        part_TD = routed(x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID, first=first)
        return jax.lax.psum(part_TD, summed) if summed else part_TD

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P(), *specs), out_specs=P(),
                         check_vma=False)(x_TD, weights_TK, ids_TK, gate_EDI, up_EDI, down_EID)


def bytes_per_device(cfg, tensor: int, expert: int) -> int:
    """Parameter bytes one device holds on a (tensor, expert) mesh, from the shapes and RULES alone."""
    from model.transformer import DeepseekModel  # here, not at the top: model.layers imports this module

    mesh = jax.sharding.AbstractMesh((tensor, expert), (TENSOR, EXPERT))
    params = nnx.to_pure_dict(nnx.state(nnx.eval_shape(lambda: DeepseekModel(cfg, nnx.Rngs(params=0))), nnx.Param))
    total = 0
    for name, value in zip(jax.tree.leaves(_flat_names(params)), jax.tree.leaves(params)):
        spec = tuple(param_spec(name, value.shape, mesh)) + (None,) * value.ndim
        shard = [dim // (mesh.shape[axis] if axis else 1) for dim, axis in zip(value.shape, spec)]
        total += int(np.prod(shard, dtype=np.int64)) * np.dtype(value.dtype).itemsize
    return total
