"""Prefix latents + suffix prefill == full prefill; chunked == unchunked; absorbed == expanded (bf16 cache)."""
import numpy as np
import pytest

from model.config import preset
from model.runner import LatentCache, ModelRunner
from model.sampling import SamplingParams
from model.weights import init_model

PROMPT = 200


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")  # bf16 latent cache
    return cfg, init_model(cfg)


@pytest.fixture(scope="module")
def full(tiny):
    cfg, model = tiny
    runner = ModelRunner(model, cfg)
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, PROMPT)
    greedy = list(runner.generate(tokens, SamplingParams(max_tokens=12)))
    return runner, tokens, runner.prefill(tokens), greedy


def _close(a, b):
    return np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


@pytest.mark.parametrize("split", [1, 17, 63, 64, 65, 100, 128, 191, 199])
def test_suffix_on_prefix_latents_equals_full_prefill(full, split):
    runner, tokens, reference, greedy = full
    prefix = runner.prefill(tokens[:split])
    # What a hit hands the engine: the stored latents of the prefix, layer by layer, as host arrays.
    stored = [prefix.cache.latents(layer, 0, split) for layer in range(runner.cfg.num_layers)]
    loaded = runner.prefill(tokens[split:], LatentCache(runner.cfg), start=split, load_prefix=stored.__getitem__)
    assert _close(loaded.logits, reference.logits)
    assert loaded.cache.length == PROMPT
    for layer in range(runner.cfg.num_layers):
        ours, theirs = loaded.cache.latents(layer, 0, PROMPT), reference.cache.latents(layer, 0, PROMPT)
        np.testing.assert_array_equal(ours[:split], stored[layer])  # the prefix is read, never recomputed
        # The suffix's latents match the full pass up to bf16 rounding of fp32 noise.
        np.testing.assert_allclose(ours[split:].astype(np.float32), theirs[split:].astype(np.float32),
                                   rtol=1e-2, atol=1e-2)
    hit = list(runner.generate(tokens[split:], SamplingParams(max_tokens=12), LatentCache(runner.cfg),
                               start=split, load_prefix=stored.__getitem__))
    assert hit == greedy


@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
def test_chunked_prefill_equals_unchunked(full, chunk):
    runner, tokens, reference, _ = full
    chunked = runner.prefill(tokens, chunk_tokens=chunk)
    assert _close(chunked.logits, reference.logits)
    assert int(np.argmax(chunked.logits)) == int(np.argmax(reference.logits))


def test_absorbed_and_expanded_attention_agree(tiny, full):
    cfg, model = tiny
    _, tokens, reference, greedy = full
    for form in ("absorbed", "expanded"):
        runner = ModelRunner(model, cfg, attention=form)
        assert _close(runner.prefill(tokens).logits, reference.logits), form
        assert list(runner.generate(tokens, SamplingParams(max_tokens=12))) == greedy, form


def test_seeded_sampling_is_reproducible_and_respects_stop_tokens(full):
    runner, tokens, _, greedy = full
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=123)
    first = list(runner.generate(tokens, params))
    assert first == list(runner.generate(tokens, params))
    assert len(first) == 10
    stop = SamplingParams(max_tokens=12, stop_token_ids=(greedy[3],))
    assert list(runner.generate(tokens, stop)) == greedy[: greedy.index(greedy[3]) + 1]


def test_bad_tokens_and_overlong_prompts_fail_clearly(full):
    runner, tokens, _, _ = full
    with pytest.raises(ValueError, match="token id 129280 out of range"):
        runner.prefill([1, 2, 129_280])
    with pytest.raises(ValueError, match="token id -1 out of range"):
        runner.prefill([-1])
    with pytest.raises(ValueError, match="exceeds the context length 16384"):
        runner.prefill([1, 2, 3], start=16_382)
    with pytest.raises(ValueError, match="non-empty"):
        runner.prefill([])
