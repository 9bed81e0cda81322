"""Blockwise (online-softmax) prefill attention equals the one-pass attention it replaces for long prompts: one
layer's MLA in both forms (the xla backend), and the whole model over a cached prefix; and the chunk it allows.
(tests/test_model_parity.py holds the runner against transformers as well.)"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from model.attention.xla import XlaBackend
from model.config import preset
from model.latent_pool import LatentPool
from model.mla import MLAttention
from model.runner import DecodeRow, Runner, Segment, prefill_chunk, view_bucket
from model.weights import init_model

PREFIX, SUFFIX = 700, 256  # the suffix starts mid key block; the view (1024 rows) spans 8 blocks of 128


def setup(cache_dtype: str):
    cfg = preset("tiny", cache_dtype=cache_dtype)
    attn = MLAttention(cfg, nnx.Rngs(params=3))
    end = PREFIX + SUFFIX
    view = view_bucket(end, 64)
    assert view == 1024
    x_SD = jax.random.normal(jax.random.key(1), (view, cfg.hidden_size), jnp.float32)
    positions_S = jnp.arange(view, dtype=jnp.int32)
    # Rows past `end` hold latents too (stale rows of an earlier, longer sequence): masking must hide them.
    view_SA = attn.latents(x_SD, positions_S)
    positions_T = positions_S[PREFIX:end]
    q_nope_NTH, q_pe_NTR = attn.queries(x_SD[PREFIX:end], positions_T)
    return cfg, attn, end, view_SA, positions_T, q_nope_NTH, q_pe_NTR


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["absorbed", "expanded"])
def test_blockwise_attention_equals_one_pass_over_a_cached_prefix(form, cache_dtype):
    cfg, attn, end, view_SA, positions_T, q_nope_NTH, q_pe_NTR = setup(cache_dtype)
    expanded = None if form == "absorbed" else attn.expand(view_SA, jnp.float32)
    one_pass = XlaBackend(cfg, "cpu", "float32", key_block=0).attend(attn, q_nope_NTH, q_pe_NTR, positions_T,
                                                                     view_SA, expanded)
    backend = XlaBackend(cfg, "cpu", "float32", key_block=128)
    blockwise = backend.attend(attn, q_nope_NTH, q_pe_NTR, positions_T, view_SA, expanded)
    scale = float(jnp.abs(one_pass).max())
    assert scale > 0
    assert float(jnp.abs(blockwise - one_pass).max()) <= 1e-5 * scale

    # The same queries over stale rows changed past `end` give the same output (they are masked).
    stale_SA = view_SA.at[end:].set(view_SA[end:] * 7 + 1)
    stale_expanded = None if form == "absorbed" else attn.expand(stale_SA, jnp.float32)
    again = backend.attend(attn, q_nope_NTH, q_pe_NTR, positions_T, stale_SA, stale_expanded)
    np.testing.assert_array_equal(np.asarray(again), np.asarray(blockwise))


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("key_block", [0, 128])
def test_a_cache_handed_over_as_raw_bits_attends_bit_identically(key_block, cache_dtype):
    """A paged pool's view is its latents' raw bits (uint16 for bfloat16, uint32 for float32): attention reads them
    as the cache dtype, in its blockwise loop of any block size, and in a vmapped batch of views (how prefill tiles
    read theirs), with the same bits as the typed view."""
    cfg, attn, _, view_SA, positions_T, q_nope_NTH, q_pe_NTR = setup(cache_dtype)
    bits_SA = jax.lax.bitcast_convert_type(view_SA, jnp.dtype(f"uint{view_SA.dtype.itemsize * 8}"))
    backend = XlaBackend(cfg, "cpu", "float32", key_block=key_block)

    def attend(view):
        return backend.attend(attn, q_nope_NTH, q_pe_NTR, positions_T, view, None)

    typed = attend(view_SA)
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
    table = list(range(1, 17))
    results = {}
    for key_block in (0, 64):  # 64: the 1024-row view in 16 blocks
        run = Runner(model, cfg, LatentPool(cfg, 20, 64), XlaBackend(cfg, "cpu", "float32", key_block=key_block),
                     chunk_tokens=128)
        run.prefill([Segment(tokens[:PREFIX], 0, table)], want_logits=False).run()
        logits = np.asarray(run.prefill([Segment(tokens[PREFIX:], PREFIX, table)]).run())[0]
        generated = [int(np.argmax(logits))]
        for i in range(7):
            step = run.decode([DecodeRow(generated[-1], PREFIX + SUFFIX + i, table)])
            generated.append(int(np.argmax(np.asarray(step)[0])))
        results[key_block] = logits, generated
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
        XlaBackend(preset("tiny"), "cpu", "float32", key_block=-1)  # refused before any weight is touched
