"""Token ids of message texts already seen, so re-sent chat history is not tokenized again.

A chat client re-sends the whole conversation every turn; at 128K tokens of history, BPE over
the full text would cost more than the cache hit saves. Entries are keyed by a hash of
tenant + role + text and bounded by the bytes their ids occupy, least recently used out first.
The gateway also stores the ids the model actually generated for an answer, so the next turn
re-sends exactly those ids even where BPE would tokenize the same text differently.

Per tenant: an entry is found only by requests of the tenant that made it (`for_tenant`). Shared,
the stored answer ids told another tenant, through `usage.prompt_tokens`, that someone had been
answered exactly this text.
"""
from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from typing import NamedTuple

from services.gateway.tokenizer import DeepSeekTokenizer

_ENTRY_OVERHEAD_BYTES = 64  # OrderedDict slot + key + array header, roughly


def text_key(tenant: str, role: str, text: str) -> bytes:
    return hashlib.blake2b(f"{tenant}\x00{role}\x00{text}".encode("utf-8", "surrogatepass"),
                           digest_size=16).digest()


class TokenCacheStats(NamedTuple):
    entries: int
    bytes: int
    capacity_bytes: int
    hits: int
    misses: int


class TokenCache:
    """LRU of role+text -> token ids, bounded by bytes. Thread-safe: rendering runs in a thread."""

    def __init__(self, tokenizer: DeepSeekTokenizer, capacity_bytes: int):
        self.tokenizer = tokenizer
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, array] = OrderedDict()
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._lock = threading.Lock()

    def for_tenant(self, tenant: str) -> "TenantTokenCache":
        """This cache as one tenant sees it (what render_chat and the answer path use)."""
        return TenantTokenCache(self, tenant)

    def encode(self, role: str, text: str, tenant: str = "") -> list[int]:
        return self.encode_many([(role, text)], tenant)[0]

    def encode_many(self, items: list[tuple[str, str]], tenant: str = "") -> list[list[int]]:
        """Token ids for each (role, text) of `tenant`; all misses are tokenized in one parallel batch."""
        keys = [text_key(tenant, role, text) for role, text in items]
        found: list[array | None] = []
        with self._lock:
            for key in keys:
                ids = self._entries.get(key)
                if ids is not None:
                    self._entries.move_to_end(key)
                found.append(ids)
        missing = [index for index, ids in enumerate(found) if ids is None]
        if missing:
            encoded = self.tokenizer.encode_texts([items[index][1] for index in missing])
            for index, ids in zip(missing, encoded):
                found[index] = array("i", ids)
                self._store(keys[index], found[index])
        with self._lock:
            self._hits += len(items) - len(missing)
            self._misses += len(missing)
        return [ids.tolist() for ids in found]

    def remember(self, role: str, text: str, token_ids: list[int], tenant: str = "") -> None:
        """Record the ids that stand for `text` of `tenant` (e.g. the tokens the model generated for it)."""
        self._store(text_key(tenant, role, text), array("i", token_ids))

    def _store(self, key: bytes, ids: array) -> None:
        size = ids.itemsize * len(ids) + _ENTRY_OVERHEAD_BYTES
        if size > self.capacity_bytes:
            return
        with self._lock:
            previous = self._entries.pop(key, None)
            if previous is not None:
                self._bytes -= previous.itemsize * len(previous) + _ENTRY_OVERHEAD_BYTES
            self._entries[key] = ids
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.itemsize * len(evicted) + _ENTRY_OVERHEAD_BYTES

    def stats(self) -> TokenCacheStats:
        with self._lock:
            return TokenCacheStats(len(self._entries), self._bytes, self.capacity_bytes,
                                   self._hits, self._misses)


class TenantTokenCache(NamedTuple):
    """One tenant's view of a TokenCache: the same methods, keys scoped to the tenant."""

    cache: TokenCache
    tenant: str

    @property
    def tokenizer(self) -> DeepSeekTokenizer:
        return self.cache.tokenizer

    def encode(self, role: str, text: str) -> list[int]:
        return self.cache.encode(role, text, self.tenant)

    def encode_many(self, items: list[tuple[str, str]]) -> list[list[int]]:
        return self.cache.encode_many(items, self.tenant)

    def remember(self, role: str, text: str, token_ids: list[int]) -> None:
        self.cache.remember(role, text, token_ids, self.tenant)
