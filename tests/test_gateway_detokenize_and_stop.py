"""Incremental detokenization over the real tokenizer, and stop strings across deltas."""
import random

import pytest

from services.gateway.detokenizer import IncrementalDetokenizer
from services.gateway.stop_strings import StopStringMatcher
from services.gateway.tokenizer import shared_tokenizer

TEXTS = [
    "plain ascii text",
    "emoji 🎉👩‍👩‍👧 and CJK 你好世界，日本語のテキスト",
    "  whitespace\t\n\r\n edges  ",
    "<｜User｜> looks special but is text, and <think>",
    "mixed: ∑ αβγ ünïcödé 🇩🇪 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture(scope="module")
def tokenizer():
    return shared_tokenizer()


def detokenize(tokenizer, ids):
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [detokenizer.push(token_id) for token_id in ids] + [detokenizer.finish()]
    return deltas


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_decoded_text(tokenizer, text):
    ids = tokenizer.encode_text(text)
    deltas = detokenize(tokenizer, ids)
    assert "".join(deltas) == text == tokenizer.decode(ids)
    assert all("\ufffd" not in delta for delta in deltas)


def test_multibyte_character_is_held_until_complete(tokenizer):
    ids = tokenizer.encode_text("🎉")
    assert len(ids) > 1  # the emoji's 4 bytes span several tokens
    deltas = detokenize(tokenizer, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🎉"


def test_special_tokens_are_skipped_and_added_tokens_kept(tokenizer):
    special = tokenizer.special
    think = tokenizer._full.token_to_id("<think>")
    ids = [special.bos, *tokenizer.encode_text("a"), think, special.eos]
    assert "".join(detokenize(tokenizer, ids)) == "a<think>" == tokenizer.decode(ids)


def test_random_token_streams_match_batch_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(1, 30))]
        assert "".join(detokenize(tokenizer, ids)) == tokenizer.decode(ids)


def test_unfinished_character_at_end_becomes_replacement(tokenizer):
    ids = tokenizer.encode_text("🎉")[:-1]
    assert "".join(detokenize(tokenizer, ids)) == "\ufffd"


def run_stops(stops, deltas):
    matcher = StopStringMatcher(tuple(stops))
    out = []
    for delta in deltas:
        scan = matcher.push(delta)
        out.append(scan.text)
        if scan.stopped:
            return "".join(out), True
    return "".join(out) + matcher.finish(), False


@pytest.mark.parametrize("stops, deltas, expected", [
    (["END"], ["abc", "E", "N", "D", "more"], ("abc", True)),
    (["END"], ["abcEN", "Dx"], ("abc", True)),
    (["END"], ["abcEN", "x"], ("abcENx", False)),
    (["END"], ["abcE"], ("abcE", False)),  # held text is emitted at the end
    (["\n\n", "###"], ["a\n", "b\n", "\n#"], ("a\nb", True)),
    (["ab", "b"], ["xab"], ("x", True)),  # the earliest match wins
    (["aab"], ["a", "a", "a", "b"], ("a", True)),  # overlapping partial match
    (["🎉"], ["x🎉y"], ("x", True)),
    ([], ["a", "b"], ("ab", False)),
])
def test_stop_strings_across_deltas(stops, deltas, expected):
    assert run_stops(stops, deltas) == expected


def test_never_emits_any_part_of_a_stop_string():
    rng = random.Random(1)
    alphabet = "abc"
    for _ in range(2000):
        stop = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, len(text))))
        deltas = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
        emitted, stopped = run_stops([stop], deltas)
        index = text.find(stop)
        assert (emitted, stopped) == ((text[:index], True) if index >= 0 else (text, False))
