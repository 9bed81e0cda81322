"""A prompt too long for the model, refused before it is tokenized.

Tokenizing costs ~1.5 s and hundreds of MB per MB of text (the issue measured 10.6 s and 1.6 GB
for a 9 MB body), so the gateway first bounds from below the tokens a text must take, cheaply:
  - bytes: no token is longer than the vocabulary's longest (128 bytes for DeepSeek-V3), so a
    text of n UTF-8 bytes takes at least n / 128 tokens;
  - words: no token spans ASCII whitespace between two runs that hold an ASCII letter or digit
    (checked on the vocabulary when the bound is built), so each such whitespace-separated run
    takes at least one token of its own.
If the larger bound reaches the model's context, the request is context_length_exceeded without
tokenizing. The body itself is capped (`body_cap_bytes`) from the same figures before it is read.
"""
from __future__ import annotations

import re
from typing import Iterable, Iterator

import numpy as np

from services.gateway.tokenizer import DeepSeekTokenizer

_SPACE = np.zeros(256, bool)
_SPACE[list(b" \t\n\r\x0b\x0c")] = True
_ALNUM = np.zeros(256, bool)
_ALNUM[list(b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")] = True
_SPANNING = re.compile(rb"[0-9A-Za-z][^ \t\n\r\x0b\x0c]*[ \t\n\r\x0b\x0c]+[^ \t\n\r\x0b\x0c]*[0-9A-Za-z]")
CHUNK_CHARS = 1 << 20  # text is encoded and counted a slice at a time: ~9 bytes of working memory per byte
JSON_ESCAPE_FACTOR = 6  # "\u00e9": the most bytes JSON spends on one byte of text
BODY_OVERHEAD_BYTES = 1 << 20  # field names, roles, sampling parameters


def utf8_slices(text: str) -> Iterator[bytes]:
    """`text` as UTF-8, CHUNK_CHARS characters at a time (never the whole text encoded at once)."""
    for start in range(0, len(text), CHUNK_CHARS):
        yield text[start:start + CHUNK_CHARS].encode("utf-8", "surrogatepass")


def alnum_words(slices: Iterable[bytes]) -> int:
    """Whitespace-separated runs, over consecutive byte slices of one text, that hold at least one
    ASCII letter or digit."""
    count, previous_was_alnum = 0, False
    for data in slices:
        chunk = np.frombuffer(data, np.uint8)
        events = np.flatnonzero(_SPACE[chunk] | _ALNUM[chunk])  # positions of a space or an alnum byte
        kinds = _ALNUM[chunk[events]]                            # True: alnum, False: space
        if kinds.size:
            # a word is counted at its first alnum byte: the first alnum event after a space event
            count += int(kinds[0] and not previous_was_alnum) + int(np.count_nonzero(kinds[1:] & ~kinds[:-1]))
            previous_was_alnum = bool(kinds[-1])
    return count


class PromptBound:
    """The model's context and the tokenizer's figures the bound needs (built once per tokenizer)."""

    def __init__(self, tokenizer: DeepSeekTokenizer) -> None:
        pieces = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        spanning = [p for p in pieces if _SPANNING.search(p)]
        if spanning:  # the word bound would not be a bound for this vocabulary
            raise ValueError(f"tokens span whitespace between words, e.g. {spanning[:3]}: word bound unsound")
        self.longest_token_bytes = max(len(p) for p in pieces)

    def min_tokens(self, texts: list[str]) -> int:
        """A lower bound of the tokens `texts` take, tokenized one by one."""
        total = 0
        for text in texts:
            n_bytes = 0

            def counted(slices: Iterator[bytes]) -> Iterator[bytes]:
                nonlocal n_bytes
                for data in slices:
                    n_bytes += len(data)
                    yield data
            words = alnum_words(counted(utf8_slices(text)))
            total += max(-(-n_bytes // self.longest_token_bytes), words)
        return total

    def body_cap_bytes(self, max_context: int) -> int:
        """The largest JSON body a prompt within `max_context` tokens can need."""
        return max_context * self.longest_token_bytes * JSON_ESCAPE_FACTOR + BODY_OVERHEAD_BYTES
