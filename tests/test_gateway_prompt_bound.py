"""PromptBound: a lower bound of a text's tokens, computed without tokenizing. It must never exceed
the real count (else a prompt that fits would be refused), and must be tight enough to refuse a
multi-megabyte text of ordinary words at once."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.prompt_bound import CHUNK_CHARS, PromptBound, alnum_words, utf8_slices
from services.gateway.tokenizer import shared_tokenizer

TOKENIZER = shared_tokenizer()
BOUND = PromptBound(TOKENIZER)

SAMPLES = ["hello world", "  a b  c ", "naïve café  déjà-vu", "x", "", "123 456\n789", "\u00a0 \u00a0 word",
           "def f(x):\n    return x ** 2  # square\n", "数据缓存在磁盘上 以便重用", " " * 500, "=" * 300,
           "a\u00a0b c\td\re\x0bf\x0cg", "😀 emoji 😀😀", "\ud800 lone surrogate"]

WORDS = st.sampled_from(["the", "latent", "  ", "\n", "\u00a0", "é", "数据", "x1", "--", "😀", "\t", "ab cd", "="])


def test_bound_never_exceeds_the_real_count_on_samples():
    for text in SAMPLES:
        assert BOUND.min_tokens([text]) <= len(TOKENIZER.encode_text(text)), repr(text)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(st.one_of(st.text(max_size=300), st.lists(WORDS, max_size=200).map("".join)))
def test_bound_never_exceeds_the_real_count(text):
    assert BOUND.min_tokens([text]) <= len(TOKENIZER.encode_text(text))


def test_word_count_is_the_same_across_slice_borders():
    text = "ab " * (CHUNK_CHARS // 3 + 7)
    assert alnum_words(utf8_slices(text)) == CHUNK_CHARS // 3 + 7
    glued = "x" * (CHUNK_CHARS - 1) + "yz w"  # one word across the border, then another
    assert alnum_words(utf8_slices(glued)) == 2
    assert BOUND.min_tokens([glued]) == -(-len(glued) // 128)  # the byte bound counts every slice


def test_a_long_text_of_words_is_bounded_tightly():
    text = "Fault test: latent segment volume prefix " * 20_000  # ~820 KB
    assert BOUND.min_tokens([text]) >= 0.8 * len(TOKENIZER.encode_text(text))
    assert BOUND.longest_token_bytes == 128
    assert BOUND.body_cap_bytes(4096) == 4096 * 128 * 6 + (1 << 20)
