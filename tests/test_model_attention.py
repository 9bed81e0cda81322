"""Blockwise (online-softmax) prefill attention equals the one-pass attention it replaces for long prompts:
one layer's MLA in both forms, and the whole model over a cached prefix; and the chunk it allows.
(tests/test_model_parity.py holds the blockwise form against transformers as well.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.config import preset
from model.mla import MLAttention
from model.runner import LatentCache, ModelRunner, bucket, prefill_chunk
from model.sampling import SamplingParams
from model.weights import init_model

PREFIX, SUFFIX = 700, 256  # the suffix starts mid key block; the view (1024 rows) spans 8 blocks of 128


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_blockwise_attention_equals_one_pass_over_a_cached_prefix(form, cache_dtype):
    cfg = preset("tiny", cache_dtype=cache_dtype)
    attn = MLAttention(cfg, nnx.Rngs(params=3))
    end = PREFIX + SUFFIX
    view = bucket(end)
    assert view == 1024
    x_SD = jax.random.normal(jax.random.key(1), (view, cfg.hidden_size), jnp.float32)
    positions_S = jnp.arange(view, dtype=jnp.int32)
    # Rows past `end` hold latents too (stale rows of an earlier, longer sequence): masking must hide them.
    cache_SA = attn.latents(x_SD, positions_S)
    positions_T = positions_S[PREFIX:end]
    q_nope_NTH, q_pe_NTR = attn.queries(x_SD[PREFIX:end], positions_T)
    expanded = None if form == "absorbed" else attn.expand(cache_SA, view, jnp.float32)

    one_pass = attn.attend(q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded, key_block=0)
    blockwise = attn.attend(q_nope_NTH, q_pe_NTR, positions_T, cache_SA, view, expanded, key_block=128)
    scale = float(jnp.abs(one_pass).max())
    assert scale > 0
    assert float(jnp.abs(blockwise - one_pass).max()) <= 1e-5 * scale

    # The same queries over stale rows changed past `end` give the same output (they are masked).
    stale_SA = cache_SA.at[end:].set(cache_SA[end:] * 7 + 1)
    stale_expanded = None if form == "absorbed" else attn.expand(stale_SA, view, jnp.float32)
    again = attn.attend(q_nope_NTH, q_pe_NTR, positions_T, stale_SA, view, stale_expanded, key_block=128)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(blockwise))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key_block", [0, 128])
def test_a_cache_handed_over_as_raw_bits_attends_bit_identically(key_block, cache_dtype):
    """A paged pool's view is its latents' raw bits (uint16 for bfloat16, uint32 for float32): attention
    reads them as the cache dtype, in both its one-pass and blockwise loops, and in a vmapped batch of views
    (how prefill tiles read theirs), with the same bits as the typed cache."""
    cfg = preset("tiny", cache_dtype=cache_dtype)
    attn = MLAttention(cfg, nnx.Rngs(params=3))
    end = PREFIX + SUFFIX
    view = bucket(end)
    x_SD = jax.random.normal(jax.random.key(1), (view, cfg.hidden_size), jnp.float32)
    positions_S = jnp.arange(view, dtype=jnp.int32)
    cache_SA = attn.latents(x_SD, positions_S)
    bits_SA = jax.lax.bitcast_convert_type(cache_SA, jnp.dtype(f"uint{cache_SA.dtype.itemsize * 8}"))
    positions_T = positions_S[PREFIX:end]
    q_nope_NTH, q_pe_NTR = attn.queries(x_SD[PREFIX:end], positions_T)

    def attend(cache):
        return attn.attend(q_nope_NTH, q_pe_NTR, positions_T, cache, view, None, key_block=key_block)

    typed = attend(cache_SA)
    assert float(jnp.abs(typed).max()) > 0
    np.testing.assert_array_equal(np.asarray(attend(bits_SA)), np.asarray(typed))
    batched = jax.vmap(attend)(jnp.stack([bits_SA, bits_SA]))
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(typed))


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")  # bf16 latent cache, fp32 weights
    return cfg, init_model(cfg)


def test_model_prefill_over_a_prefix_is_the_same_blockwise(tiny):
    cfg, model = tiny
    tokens = np.random.default_rng(5).integers(0, cfg.vocab_size, PREFIX + SUFFIX)
    greedy = SamplingParams(max_tokens=8)
    results = {}
    for key_block in (0, 64):  # 64: the 1024-row view in 16 blocks
        runner = ModelRunner(model, cfg, chunk_tokens=128, key_block=key_block)
        prefix = runner.prefill(tokens[:PREFIX])
        stored = [prefix.cache.latents(layer, 0, PREFIX) for layer in range(cfg.num_layers)]
        hit = runner.prefill(tokens[PREFIX:], LatentCache(cfg), start=PREFIX, load_prefix=stored.__getitem__)
        generated = list(runner.generate(tokens[PREFIX:], greedy, LatentCache(cfg), start=PREFIX,
                                         load_prefix=stored.__getitem__))
        results[key_block] = hit.logits, generated
    (one_pass, one_pass_tokens), (blockwise, blockwise_tokens) = results[0], results[64]
    assert np.abs(blockwise - one_pass).max() <= 1e-4 * np.abs(one_pass).max()
    assert blockwise_tokens == one_pass_tokens


def test_blockwise_chunks_do_not_shrink_with_the_prompt():
    v3, budget = preset("deepseek-v3"), 512 << 20
    # One pass: V3's 128 heads x 16K-row scores leave 16-token chunks; blockwise keeps 256 at every length.
    assert prefill_chunk(v3, 16_384, 512, budget, key_block=0) == 16
    assert [prefill_chunk(v3, n, 512, budget, key_block=512) for n in (4096, 16_384, 131_072)] == [256] * 3
    # A view within one key block is attended in one pass, and chunked as before.
    assert prefill_chunk(v3, 300, 512, budget, key_block=512) == prefill_chunk(v3, 300, 512, budget, key_block=0)
    with pytest.raises(ValueError, match="key_block"):
        ModelRunner(None, preset("tiny"), key_block=-1)  # refused before the weights are touched
