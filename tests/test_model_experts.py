"""Routed experts: grouped by expert, only the chosen experts run, same result as every expert on every token."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import preset
from model.experts import all_experts, block_rows, dispatch, routed_experts
from model.layers import MoE


def _experts(E: int, D: int, I: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    gate_EDI, up_EDI = (jnp.asarray(rng.normal(0, 0.1, (E, D, I)), jnp.float32) for _ in range(2))
    down_EID = jnp.asarray(rng.normal(0, 0.1, (E, I, D)), jnp.float32)
    return gate_EDI, up_EDI, down_EID


def _routes(T: int, K: int, E: int, seed: int = 1, skew: bool = False):
    rng = np.random.default_rng(seed)
    if skew:  # most tokens pick experts 0..K-1: one group spans many tiles, most experts are empty
        ids_TK = np.tile(np.arange(K), (T, 1))
        ids_TK[::7] = rng.permutation(E)[:K]
    else:
        ids_TK = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    return jnp.asarray(rng.random((T, K)), jnp.float32), jnp.asarray(ids_TK, jnp.int32)


@pytest.mark.parametrize("method", ["tiles", "ragged_dot"])
@pytest.mark.parametrize("T,skew", [(1, False), (3, False), (16, False), (40, False), (40, True)])
def test_routed_equals_every_expert_on_every_token(method, T, skew):
    E, K, D, I = 8, 3, 16, 12
    experts = _experts(E, D, I)
    weights_TK, ids_TK = _routes(T, K, E, skew=skew)
    x_TD = jnp.asarray(np.random.default_rng(2).normal(size=(T, D)), jnp.float32)
    got = jax.jit(routed_experts, static_argnames="method")(x_TD, weights_TK, ids_TK, *experts, method=method)
    np.testing.assert_allclose(got, all_experts(x_TD, weights_TK, ids_TK, *experts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("method", ["tiles", "ragged_dot"])
def test_expert_slices_add_up_to_the_whole(method):
    """What each device of an expert-parallel mesh computes: its own experts' share, zero elsewhere."""
    E, K, D, I, T = 16, 4, 16, 8, 24
    gate, up, down = _experts(E, D, I)
    weights_TK, ids_TK = _routes(T, K, E)
    x_TD = jnp.asarray(np.random.default_rng(3).normal(size=(T, D)), jnp.float32)
    parts = [routed_experts(x_TD, weights_TK, ids_TK, gate[f:f + 4], up[f:f + 4], down[f:f + 4], first=f,
                            method=method)
             for f in range(0, E, 4)]
    whole = all_experts(x_TD, weights_TK, ids_TK, gate, up, down)
    np.testing.assert_allclose(sum(parts), whole, rtol=1e-5, atol=1e-5)
    assert all(np.abs(p).max() > 0 for p in parts)
    nobody = routed_experts(x_TD, weights_TK, jnp.full_like(ids_TK, E - 1), gate[:4], up[:4], down[:4],
                            method=method)
    np.testing.assert_array_equal(nobody, 0)


def test_dispatch_sorts_copies_by_expert():
    ids_TK = jnp.asarray([[3, 0], [1, 3], [5, 0]], jnp.int32)
    order_M, sizes_E, local_TK = dispatch(ids_TK, n_local=4)
    assert np.asarray(ids_TK).reshape(-1)[np.asarray(order_M)].tolist() == [0, 0, 1, 3, 3, 5]
    assert sizes_E.tolist() == [2, 1, 0, 2]
    assert local_TK.tolist() == [[True, True], [True, True], [False, True]]
    assert [block_rows(m, 64) for m in (6, 96, 3072, 10**6)] == [1, 2, 64, 128]


def test_v2_lite_shaped_moe_layer_matches_the_all_experts_reference():
    """64 experts, top-6, softmax greedy routing, 2 shared experts; widths reduced (make test)."""
    cfg = preset("deepseek-v2-lite", hidden_size=256, moe_intermediate_size=64, param_dtype="float32")
    moe = MoE(cfg, nnx.Rngs(params=0))
    for T in (1, 16, 512):
        x_TD = jnp.asarray(np.random.default_rng(T).normal(size=(T, cfg.hidden_size)), jnp.float32)
        weights_TK, ids_TK = moe.route(x_TD)
        assert ids_TK.shape == (T, 6) and len(set(np.asarray(ids_TK).reshape(-1).tolist())) > (6 if T > 1 else 5)
        expect = all_experts(x_TD, weights_TK, ids_TK, moe.gate_proj[...], moe.up_proj[...], moe.down_proj[...])
        expect = expect + moe.shared(x_TD)
        got = nnx.jit(lambda m, x: m(x))(moe, x_TD)
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-5 * float(np.abs(expect).max()))
