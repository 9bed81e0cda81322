"""The reference forward: one prompt, no cache, no pages, one jitted pass; each layer's latents are rounded to
cache precision and read back by absorbed attention. Tests hold the serving path to it, and it to transformers'."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from model.sampling import SamplingParams, SamplingRow, request_seed, sample_batch


def _attention(attn, h_TD, positions_T):
    dtype = attn.products_dtype()
    q_nope_NTH, q_pe_NTR = attn.queries(h_TD, positions_T)
    kv_SA = attn.latents(h_TD, positions_T)  # (T, A) at cache dtype
    if not jax.sharding.get_abstract_mesh().empty:
        kv_SA = jax.lax.with_sharding_constraint(kv_SA, PartitionSpec())  # the latent is replicated
    kv_SA = kv_SA.astype(dtype)
    q_NTA = attn.absorbed_queries(q_nope_NTH.astype(dtype), q_pe_NTR.astype(dtype))
    scores_NTS = jnp.einsum("nta,sa->nts", q_NTA, kv_SA, preferred_element_type=jnp.float32) * attn.scale
    causal_TS = positions_T[None, :] <= positions_T[:, None]
    probs_NTS = jax.nn.softmax(jnp.where(causal_TS[None], scores_NTS, -jnp.inf), axis=-1).astype(dtype)
    out_NTC = jnp.einsum("nts,sc->ntc", probs_NTS, kv_SA[:, :attn.kv_lora_rank], preferred_element_type=jnp.float32)
    return attn.output(attn.latent_values(out_NTC.astype(dtype)))


def _logits(graphdef, state, tokens_T):
    model = nnx.merge(graphdef, state)
    positions_T = jnp.arange(tokens_T.shape[0], dtype=jnp.int32)
    x_TD = jnp.take(model.embed[...], tokens_T, axis=0)  # (T, D)
    for layer in model.layers:
        x_TD = x_TD + _attention(layer.attn, layer.input_norm(x_TD), positions_T)
        x_TD = x_TD + layer.mlp(layer.post_attn_norm(x_TD))
    return model.head(x_TD)  # (T, V) float32


logits_jit = jax.jit(_logits, static_argnums=(0,))


def prompt_logits(model: nnx.Module, tokens_T, mesh: Mesh | None = None) -> np.ndarray:
    """Logits (T, V) at every position of one prompt; on `mesh` when given (the weights already placed there)."""
    graphdef, state = nnx.split(model)
    tokens_T = jnp.asarray(tokens_T, jnp.int32)
    if mesh is None:
        return np.asarray(logits_jit(graphdef, state, tokens_T))
    with jax.set_mesh(mesh):
        return np.asarray(logits_jit(graphdef, state, jax.device_put(tokens_T, NamedSharding(mesh, PartitionSpec()))))


def generate(model: nnx.Module, prompt, params: SamplingParams, mesh: Mesh | None = None) -> list[int]:
    """The tokens after `prompt` (a stop token included), each from a whole pass, sampled as the engine samples."""
    tokens = np.zeros(len(prompt) + params.max_tokens, np.int64)
    tokens[:len(prompt)] = prompt
    seed, out = request_seed(params), []
    for n in range(len(prompt), len(tokens)):
        logits_V = prompt_logits(model, tokens, mesh)[n - 1]
        token = int(sample_batch(jnp.asarray(logits_V)[None], [SamplingRow(params, seed, len(out))]).tokens[0])
        out.append(token)
        if token in params.stop_token_ids:
            break
        tokens[n] = token
    return out


def greedy_tokens(model: nnx.Module, prompt, count: int, mesh: Mesh | None = None) -> list[int]:
    return generate(model, prompt, SamplingParams(max_tokens=count), mesh)
