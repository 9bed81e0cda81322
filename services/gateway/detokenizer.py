"""Token ids -> text deltas, cut only at whole UTF-8 characters.

A byte-level BPE token can end in the middle of a character (one emoji is often 2-4 tokens).
Each id maps to its exact bytes; an incremental UTF-8 decoder holds back an unfinished
character until the token that completes it arrives. O(1) per token, and the concatenated
deltas equal decoding all ids at once (with special tokens skipped).
"""
from __future__ import annotations

import codecs

from services.gateway.tokenizer import DeepSeekTokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer: DeepSeekTokenizer):
        self._tokenizer = tokenizer
        # errors="replace": a model can emit bytes that never form valid UTF-8; show U+FFFD.
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Text completed by this token; "" while a character is still unfinished."""
        return self._decoder.decode(self._tokenizer.token_bytes(token_id))

    def finish(self) -> str:
        """Whatever is left at the end of generation (an unfinished character becomes U+FFFD)."""
        return self._decoder.decode(b"", final=True)
