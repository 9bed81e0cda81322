"""Capacity: per-volume byte budgets, eviction of least-recently-hit segments, expiry sweep."""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, NamedTuple

from .ledger import SegmentRecord

if TYPE_CHECKING:
    from .store import BlockStore

log = logging.getLogger(__name__)


class SweepResult(NamedTuple):
    expired: int    # segments whose index entries had expired, now retired
    deleted: int    # segment objects removed from volumes


class Capacity:
    """Keeps every volume under its byte budget and reclaims what nobody can find any more.

    Invariants: a segment leaves the index before it leaves the budget (index entries first),
    and its bytes are deleted only after `reader_grace_s` and while no prefetch of this process
    holds it, so a reader that found it before never reads a deleted object mid-way.
    """

    def __init__(self, store: "BlockStore", budget_bytes: int | None, reader_grace_s: float) -> None:
        """`budget_bytes`: every volume's budget; None: each volume's recorded default (a share of its
        file system, see volume.py); a volume without one (an object store) needs an explicit budget."""
        self.store = store
        for volume in store.volumes.values():
            if budget_bytes is None and volume.default_budget_bytes is None:
                raise ValueError(f"volume {volume.name} is not on a file system: give it an explicit byte budget")
        self.budget_bytes = budget_bytes
        self.reader_grace_s = reader_grace_s
        self._sweeper: asyncio.Task | None = None

    async def make_room(self, volume: str, incoming: int) -> int:
        """Evict least-recently-hit segments of `volume` until `incoming` more bytes fit; returns evictions."""
        budget = self.budget_of(volume)
        if incoming > budget:
            raise ValueError(f"a segment of {incoming} bytes exceeds the volume budget of {budget}")
        evicted = 0
        ledger = self.store.ledger
        while (await ledger.used([volume]))[volume] + incoming > budget:
            victims = await ledger.least_recent(volume, 1)
            if not victims:
                break
            evicted += await self.retire(volume, victims[0])
        self.store.stats.evictions += evicted
        return evicted

    def budget_of(self, volume: str) -> int:
        """Bytes volume `volume` may hold: the explicit budget, else its recorded default."""
        return self.budget_bytes if self.budget_bytes is not None else self.store.volumes[volume].default_budget_bytes

    async def retire(self, volume: str, record: SegmentRecord) -> int:
        """Unpublish a segment, then stop counting it; its bytes go after the grace period."""
        await self.store.index.unpublish_segment(record.root, record.segment)
        return int(await self.store.ledger.retire(volume, record, self.reader_grace_s))

    async def evict(self, tenant: str | None = None) -> int:
        """Retire every segment (of `tenant` only, if given); returns how many."""
        count = 0
        for volume in self.store.volumes:
            for record in await self.store.ledger.records(volume):
                if tenant is None or record.tenant == tenant:
                    count += await self.retire(volume, record)
        self.store.stats.evictions += count
        return count

    async def sweep(self) -> SweepResult:
        """Retire expired segments and delete the bytes of retired ones past their grace. Segment
        objects no ledger knows (their writer died before publishing, or the index was lost) are
        the Reconciler's: it republishes them from their headers, or deletes them once expired."""
        store, expired, deleted = self.store, 0, 0
        for vid, volume in store.volumes.items():
            records = await store.ledger.records(vid)
            alive = await store.index.segment_alive([(r.root, r.segment) for r in records])
            for record, is_alive in zip(records, alive):
                if not is_alive:
                    expired += await self.retire(vid, record)
            for segment in await store.ledger.due_for_deletion(vid):
                if store.readers.get(segment):
                    continue
                await volume.delete(segment)
                await store.ledger.buried(vid, segment)
                store.forget(segment)
                deleted += 1
        store.stats.expired += expired
        store.stats.segments_deleted += deleted
        return SweepResult(expired, deleted)

    def start(self, interval_s: float) -> None:
        """Sweep every `interval_s` seconds in the background until stop()."""
        async def loop():
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.sweep()
                except Exception:  # Redis or a volume may be down; try again next round
                    log.exception("sweep failed")
        if self._sweeper is None:
            self._sweeper = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
            self._sweeper = None
