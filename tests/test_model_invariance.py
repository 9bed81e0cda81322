"""Prefix latents + suffix prefill == full prefill; chunked == unchunked; absorbed == expanded (bf16 cache): the
runner over the paged pool held to the reference forward (model/reference.py)."""
import numpy as np
import pytest

from model import reference
from model.attention import make_backend
from model.config import preset
from model.latent_pool import LatentPool
from model.runner import DecodeRow, Runner, Segment
from model.sampling import SamplingParams
from model.weights import init_model

PROMPT = 200
TABLE = list(range(1, 6))  # 5 pages of 64: the prompt and 12 more tokens


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")  # bf16 latent cache
    return cfg, init_model(cfg)


def runner(cfg, model, **options) -> Runner:
    return Runner(model, cfg, LatentPool(cfg, 8, 64), make_backend("auto", cfg, "cpu", "float32"), **options)


@pytest.fixture(scope="module")
def full(tiny):
    cfg, model = tiny
    tokens = np.random.default_rng(7).integers(0, cfg.vocab_size, PROMPT)
    return tokens, reference.prompt_logits(model, tokens)[-1], reference.greedy_tokens(model, tokens, 12)


def greedy(run: Runner, logits: np.ndarray, length: int, count: int) -> list[int]:
    """`count` greedy tokens from a prompt's last logits, decoding over the runner's pages."""
    out = [int(np.argmax(logits))]
    while len(out) < count:
        out.append(int(np.argmax(np.asarray(run.decode([DecodeRow(out[-1], length + len(out) - 1, TABLE)]))[0])))
    return out


def _close(a, b):
    return np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


@pytest.mark.parametrize("split", [1, 17, 63, 64, 65, 100, 128, 191, 199])
def test_suffix_on_prefix_latents_equals_full_prefill(tiny, full, split):
    cfg, model = tiny
    tokens, want, greedy_want = full
    computed = runner(cfg, model)
    computed.prefill([Segment(tokens[:split], 0, TABLE)], want_logits=False).run()
    # What a hit hands the engine: the stored latents of the prefix, layer by layer, as host arrays.
    stored = [computed.pool.host(read)[:split] for read in computed.pool.read(TABLE)]
    whole = runner(cfg, model)
    reference_logits = np.asarray(whole.prefill([Segment(tokens, 0, TABLE)]).run())[0]
    loaded = runner(cfg, model)
    pages = -(-split // 64)
    for layer, latents in enumerate(stored):  # whole pages; the suffix writes the rest of the last one
        loaded.pool.place(layer, TABLE[:pages], np.pad(latents, ((0, pages * 64 - split), (0, 0))))
    logits = np.asarray(loaded.prefill([Segment(tokens[split:], split, TABLE)]).run())[0]
    assert _close(logits, want) and _close(reference_logits, want)
    for layer, (ours, theirs) in enumerate(zip(loaded.pool.read(TABLE), whole.pool.read(TABLE))):
        ours, theirs = loaded.pool.host(ours)[:PROMPT], whole.pool.host(theirs)[:PROMPT]
        np.testing.assert_array_equal(ours[:split], stored[layer])  # the prefix is read, never recomputed
        # The suffix's latents match the full pass up to bf16 rounding of fp32 noise.
        np.testing.assert_allclose(ours[split:].astype(np.float32), theirs[split:].astype(np.float32),
                                   rtol=1e-2, atol=1e-2)
    assert greedy(loaded, logits, PROMPT, 12) == greedy_want


@pytest.mark.parametrize("chunk", [16, 32, 64, 128])
def test_chunked_prefill_equals_unchunked(tiny, full, chunk):
    cfg, model = tiny
    tokens, want, _ = full
    run = runner(cfg, model, chunk_tokens=chunk)
    assert len(run.chunk_sizes(PROMPT, PROMPT)) == -(-PROMPT // chunk)
    logits = np.asarray(run.prefill([Segment(tokens, 0, TABLE)]).run())[0]
    assert _close(logits, want) and int(np.argmax(logits)) == int(np.argmax(want))


def test_absorbed_and_expanded_attention_agree(tiny, full):
    cfg, model = tiny
    tokens, want, greedy_want = full
    for form in ("absorbed", "expanded"):
        run = runner(cfg, model, form=form)
        assert run._form(PROMPT, PROMPT).name == form
        logits = np.asarray(run.prefill([Segment(tokens, 0, TABLE)]).run())[0]
        assert _close(logits, want), form
        assert greedy(run, logits, PROMPT, 12) == greedy_want, form


def test_seeded_sampling_is_reproducible_and_respects_stop_tokens(tiny, full):
    _, model = tiny
    tokens, _, greedy_want = full
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=40, seed=123)
    first = reference.generate(model, tokens, params)
    assert first == reference.generate(model, tokens, params)
    assert len(first) == 10
    stop = SamplingParams(max_tokens=12, stop_token_ids=(greedy_want[3],))
    assert reference.generate(model, tokens, stop) == greedy_want[: greedy_want.index(greedy_want[3]) + 1]


def test_bad_tokens_and_overlong_prompts_fail_clearly(tiny):
    run = runner(*tiny)
    with pytest.raises(ValueError, match="token id 129280 out of range"):
        run.check_tokens(np.asarray([1, 2, 129_280]))
    with pytest.raises(ValueError, match="token id -1 out of range"):
        run.check_tokens(np.asarray([-1]))
    with pytest.raises(ValueError, match="exceeds the context length 16384"):
        run.check_tokens(np.asarray([1, 2, 3]), extra=16_382)
    with pytest.raises(ValueError, match="non-empty"):
        run.check_tokens(np.asarray([], np.int64))
    with pytest.raises(ValueError, match="pages cannot hold"):
        run.prefill([Segment(np.arange(300), 0, TABLE[:2])])
