"""The role+text -> token ids cache, with the real tokenizer."""
import pytest

from services.gateway.token_cache import TokenCache
from services.gateway.tokenizer import shared_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return shared_tokenizer()


def test_hit_returns_the_same_ids_as_tokenizing(tokenizer):
    cache = TokenCache(tokenizer, capacity_bytes=1 << 20)
    texts = [("user", "first message"), ("assistant", "an answer"), ("user", "first message")]
    assert cache.encode_many(texts) == [tokenizer.encode_text(text) for _, text in texts]
    assert cache.encode_many(texts) == [tokenizer.encode_text(text) for _, text in texts]
    stats = cache.stats()
    assert (stats.entries, stats.hits, stats.misses) == (2, 3, 3)


def test_role_is_part_of_the_key(tokenizer):
    cache = TokenCache(tokenizer, capacity_bytes=1 << 20)
    cache.remember("assistant", "same text", [1, 2, 3])
    assert cache.encode("assistant", "same text") == [1, 2, 3]
    assert cache.encode("user", "same text") == tokenizer.encode_text("same text")


def test_bounded_by_bytes_least_recently_used_out(tokenizer):
    cache = TokenCache(tokenizer, capacity_bytes=3 * (4 * 100 + 64))
    for name in "abc":
        cache.remember("user", name, [7] * 100)
    cache.encode("user", "a")  # a is now the most recent; b is the oldest
    cache.remember("user", "d", [7] * 100)
    stats = cache.stats()
    assert stats.entries == 3 and stats.bytes <= stats.capacity_bytes
    assert cache.encode("user", "b") == tokenizer.encode_text("b")  # evicted, re-tokenized
    assert cache.encode("user", "a") == [7] * 100


def test_entry_larger_than_capacity_is_not_kept(tokenizer):
    cache = TokenCache(tokenizer, capacity_bytes=100)
    cache.remember("user", "big", [1] * 1000)
    assert cache.stats().entries == 0
    assert cache.encode("user", "big") == tokenizer.encode_text("big")


def test_entries_are_per_tenant(tokenizer):
    """An answer remembered for one tenant (ids that differ from plain BPE) is never what another
    tenant's identical text renders to: that would tell bob, via usage, what alice was answered."""
    cache = TokenCache(tokenizer, capacity_bytes=1 << 20)
    text = "a generated answer"
    plain = tokenizer.encode_text(text)
    alice, bob = cache.for_tenant("alice"), cache.for_tenant("bob")
    alice.remember("assistant", text, [7, 7, 7, 7, 7, 7, 7, 7])
    assert alice.encode("assistant", text) == [7] * 8
    assert bob.encode("assistant", text) == plain
    assert bob.encode_many([("assistant", text)]) == [plain]
    assert cache.encode("assistant", text) == plain  # the unscoped (tenant "") view neither
