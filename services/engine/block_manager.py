"""The block manager: who owns each page of the latent pool, and the memory tier of finished sequences' blocks.

A page holds one cache block (block_tokens positions, every layer); each page but the scratch page is either
- free: on the free list, content meaningless;
- owned: referenced by sequences' block tables (ref > 0); a full block whose latents are complete may also be
  published under its chained block hash, so a sequence with the same prefix shares it;
- hot: published, no longer referenced (ref == 0), kept in LRU order until a new page is needed.
The hashes are the disk index's (salted per tenant): a hash names the same latents in memory and on disk, and
tenants never share pages; each published page remembers its tenant, so a purge can find the tenant's pages.
A sequence's pages come and go only through `grant`, `extend` and `free`.
With `events`, every hash that becomes or stops being held (published, then evicted, dropped or purged) is reported
as a KV event of medium "memory" (kvstore/kv_events.py), so routers know what this engine holds.
"""
from __future__ import annotations

from collections import Counter, OrderedDict, deque

from kvstore.kv_events import MEMORY, BlockEvents
from model.latent_pool import SCRATCH_PAGE
from services.engine.sequence import Sequence


class PoolExhausted(Exception):
    """Fewer pages are free or hot than a request for pages needs."""


class BlockManager:
    def __init__(self, num_pages: int, block_tokens: int, fingerprint: str, memory_tier: bool = True,
                 events: BlockEvents | None = None):
        self.num_pages, self.block_tokens, self.fingerprint = num_pages, block_tokens, fingerprint
        self.memory_tier = memory_tier  # off: nothing is published, so nothing is shared or kept
        self.events = events
        self._free: deque[int] = deque(p for p in range(num_pages) if p != SCRATCH_PAGE)
        self._ref = [0] * num_pages
        self._page_of: dict[bytes, int] = {}  # block hash -> page (owned or hot)
        self._hash_of: dict[int, bytes] = {}
        self._tenant_of: dict[int, str] = {}  # published page -> its sequence's tenant
        self._hot: OrderedDict[int, None] = OrderedDict()  # ref-0 published pages, least recently used first
        self.evictions = 0

    @property
    def usable(self) -> int:
        return self.num_pages - 1

    def available(self) -> int:
        """Pages that allocate() can hand out now (free, then hot ones evicted)."""
        return len(self._free) + len(self._hot)

    @property
    def hot_pages(self) -> int:
        return len(self._hot)

    @property
    def owned_pages(self) -> int:
        return self.usable - self.available()

    def match(self, hashes: list[bytes]) -> list[int]:
        """Pages of the longest leading run of `hashes` held in memory (no reference taken)."""
        pages = []
        for h in hashes:
            page = self._page_of.get(h)
            if page is None:
                break
            pages.append(page)
        return pages

    def hot_in(self, pages: list[int]) -> int:
        """How many of `pages` are hot (acquiring them takes them out of what allocate() can use)."""
        return sum(1 for p in pages if self._ref[p] == 0)

    def publish(self, page: int, block_hash: bytes, tenant: str = "") -> None:
        """The page now holds the complete latents of the block named `block_hash`."""
        if self._ref[page] <= 0:
            raise ValueError(f"page {page} is not owned")
        if not self.memory_tier or block_hash in self._page_of or page in self._hash_of:
            return  # another page already serves this block (two sequences computed it at once)
        self._page_of[block_hash] = page
        self._hash_of[page] = block_hash
        self._tenant_of[page] = tenant

    @property
    def held_blocks(self) -> int:
        """Blocks published in memory (owned or hot): what a memory hit can share."""
        return len(self._page_of)

    def tenant_pages(self) -> dict[str, int]:
        """Published pages per tenant (what a purge of the tenant drops)."""
        return dict(Counter(self._tenant_of.values()))

    def acquire(self, pages: list[int]) -> None:
        """Takes a reference on published pages (a memory hit)."""
        for page in pages:
            if page not in self._hash_of:
                raise ValueError(f"page {page} is not published")
            if self._ref[page] == 0:
                del self._hot[page]
            self._ref[page] += 1

    def allocate(self, n: int) -> list[int]:
        """n pages owned by the caller; evicts the least recently used hot pages when none are free."""
        if n > self.available():
            raise PoolExhausted(f"{n} pages asked, {self.available()} available")
        pages, evicted = [], []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._hot.popitem(last=False)
                evicted.append(self._unpublish(page))
                self.evictions += 1
            self._ref[page] = 1
            pages.append(page)
        self._removed(evicted)
        return pages

    def release(self, pages: list[int]) -> None:
        """Drops a reference on each page: unreferenced published ones turn hot (a chain's head newest), others free."""
        for page in reversed(pages):
            if self._ref[page] <= 0:
                raise ValueError(f"page {page} released more often than taken")
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if page in self._hash_of:
                    self._hot[page] = None
                else:
                    self._free.append(page)

    def drop_hot(self) -> int:
        """Empties the memory tier (pages owned by sequences stay published); returns pages freed."""
        dropped = [self._unpublish(page) for page in self._hot]
        self._free.extend(self._hot)
        self._hot.clear()
        self._removed(dropped)
        return len(dropped)

    def drop_tenant(self, tenant: str) -> int:
        """Unpublishes every page of `tenant` (a purge): hot ones are freed, owned ones are freed by their release;
        returns the pages unpublished."""
        pages = [page for page, owner in self._tenant_of.items() if owner == tenant]
        self._removed([self._unpublish(page) for page in pages])
        for page in pages:
            if page in self._hot:
                del self._hot[page]
                self._free.append(page)
        return len(pages)

    def _unpublish(self, page: int) -> bytes:
        """The page no longer serves its block; returns the block's hash."""
        block_hash = self._hash_of.pop(page)
        del self._page_of[block_hash], self._tenant_of[page]
        return block_hash

    def _removed(self, hashes: list[bytes]) -> None:
        if hashes and self.events is not None:
            self.events.removed(hashes, MEMORY)

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)

    def grant(self, seq: Sequence, usable_blocks: int) -> list[int] | None:
        """Pages for an admitted sequence: its memory hit among its first `usable_blocks` blocks (references taken), new
        ones for the rest of its target and its next token; None (nothing taken) where the pool cannot hold it now."""
        memory = self.match(seq.hashes[:usable_blocks])
        new = self.pages_for(seq.target + 1) - len(memory)
        if new > self.available() - self.hot_in(memory):
            return None
        self.acquire(memory)
        seq.pages = memory + self.allocate(new)
        return memory

    def extend(self, seq: Sequence) -> bool:
        """Gives a decoding sequence the page its next token goes to, if it needs one and one is available."""
        if seq.computed // self.block_tokens < len(seq.pages):
            return True
        if self.available() == 0:
            return False
        seq.pages += self.allocate(1)
        return True

    def free(self, seq: Sequence) -> None:
        self.release(seq.pages)
        seq.pages = []

    def publish_sequence(self, seq: Sequence) -> None:
        """The sequence's full blocks whose latents are in every layer (`settled`) become shareable."""
        full = min(seq.settled // self.block_tokens, len(seq.pages))
        if full <= seq.published_blocks or seq.fenced:
            return
        hashes = seq.block_hashes(full, self.fingerprint, self.block_tokens)
        first = seq.published_blocks
        for block in range(first, full):
            self.publish(seq.pages[block], hashes[block], seq.job.tenant)
        seq.published_blocks = full
        held = [h for h in hashes[first:full] if h in self._page_of]  # by these pages or pages computed alongside
        if held and self.events is not None:
            self.events.stored(held, hashes[first - 1] if first and len(held) == full - first else None, MEMORY)
