"""One lookup of a prompt's block hashes in the prefix index, never failing the request.

The cache is an accelerator, not a dependency: if Redis is down, slow or returns garbage, the
request is served as a miss, and the failure is logged and counted.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Sequence

from kvstore.fence import TenantFence
from kvstore.hashing import cacheable_blocks
from kvstore.index import PrefixIndex
from kvstore.location import Hit, miss
from services.gateway.gateway_metrics import GatewayMetrics

log = logging.getLogger(__name__)

_FAILURE_LOG_INTERVAL_S = 10.0  # with Redis down every request fails its lookup; log a few


class PrefixLookup:
    def __init__(self, index: PrefixIndex | None, timeout_s: float, metrics: GatewayMetrics,
                 admit_after: int = 1, admit_window_s: float = 86400.0):
        self._index = index
        self.fence = None if index is None else TenantFence(index.redis, index.prefix)
        self._timeout_s = timeout_s
        self._metrics = metrics
        self._admit_after, self._admit_window_s = admit_after, admit_window_s
        self._last_failure_log = -_FAILURE_LOG_INTERVAL_S

    async def lookup(self, hashes: Sequence[bytes], prompt_tokens: int, block_tokens: int) -> Hit:
        hashes = hashes[:cacheable_blocks(prompt_tokens, block_tokens)]
        unseen = miss()._replace(admitted=0 if self._admit_after > 1 else None)  # admission writes nothing unseen
        if not hashes or self._index is None:
            return unseen
        try:
            hit = await asyncio.wait_for(self._index.lookup(hashes, self._admit_after, int(self._admit_window_s)),
                                         self._timeout_s)
        except Exception as error:  # any index failure is a miss, never the user's error
            self._metrics.lookup_failures.inc()
            now = time.monotonic()
            if now - self._last_failure_log >= _FAILURE_LOG_INTERVAL_S:
                self._last_failure_log = now
                log.warning("prefix lookup of %d blocks failed, serving as a miss (logged at "
                            "most every %.0f s; see gateway_prefix_lookup_failures_total): %r",
                            len(hashes), _FAILURE_LOG_INTERVAL_S, error)
            return unseen
        hit = hit.truncated(len(hashes))
        self._metrics.lookup_hit_tokens.inc(hit.blocks * block_tokens)
        if self._admit_after <= 1:
            return hit._replace(admitted=None)  # every block is written
        self._metrics.admission_blocks.labels("admitted").inc(hit.admitted - hit.blocks)
        self._metrics.admission_blocks.labels("deferred").inc(len(hashes) - hit.admitted)
        return hit

    async def handoff(self, hashes: Sequence[bytes], prompt_tokens: int, block_tokens: int, published: int | None,
                      hit: Hit) -> Hit:
        """A split request's prefix as its prefill engine left it, for the decode engine: the leading run of the
        prompt's full blocks (up to the `published` ones the prefill engine reported; None: unknown) the index holds,
        no sighting counted; `hit` is the request's own lookup (its admission carries over). Any failure: `hit`."""
        blocks = prompt_tokens // block_tokens  # every full block: the decode engine computes the first token's latent
        hashes = hashes[:blocks if published is None else min(blocks, published)]
        if not hashes or self._index is None:
            return hit
        try:
            handed = await asyncio.wait_for(self._index.lookup(hashes), self._timeout_s)
        except Exception as error:  # the request's own hit still holds: the decode engine recomputes the rest
            self._metrics.lookup_failures.inc()
            log.warning("handoff lookup of %d blocks failed: %r", len(hashes), error)
            return hit
        return handed._replace(admitted=hit.admitted) if handed.blocks >= hit.blocks else hit

    async def epoch(self, tenant: str) -> int | None:
        """The tenant's purge epoch (kvstore/fence.py): its saves carry it, so a purge that begins while
        they run leaves nothing of them. None when the index does not answer (the store reads it then)."""
        if self.fence is None:
            return None
        try:
            return await asyncio.wait_for(self.fence.epoch(tenant), self._timeout_s)
        except Exception:  # any index failure: the request goes on, its saves take the epoch current then
            self._metrics.lookup_failures.inc()
            return None

    async def ready(self) -> bool:
        return self._index is not None and await self._index.ping()
