"""Erasing one tenant's blocks from the index, the ledger and the volumes (data deletion).

The caller has fenced the tenant first (fence.TenantFence.begin_purge): saves of older epochs are
refused or withdraw themselves, so listing the volumes after the fence finds every old block that
will ever be published. Each segment is put in the grave before anything else (reconciliation never
republishes it), unpublished, uncounted, then unlinked at once: no grace period, a reader that
still holds it gets a miss. Objects reconciliation quarantined are unlinked too when their header names the
tenant (one whose header cannot be read cannot be attributed and stays). Blocks are MAC'd, not encrypted: erasure
is the unlink.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from .reader import read_header
from .segment import SegmentFormatError, SegmentHeader

if TYPE_CHECKING:
    from .store import BlockStore

log = logging.getLogger(__name__)


class PurgeResult(NamedTuple):
    segments: int  # segment objects unlinked
    blocks: int    # blocks they held


def stale(header: SegmentHeader, epochs: dict[str, int]) -> bool:
    """Whether the segment was written under an epoch its tenant has been purged past."""
    epoch = header.publication.epoch if header.publication is not None else 0
    return epoch < epochs.get(header.tenant, 0)


async def erase_tenant(store: "BlockStore", tenant: str, epoch: int) -> PurgeResult:
    """Erase every segment of `tenant` written under an epoch older than `epoch`, on every volume
    (live, in the grave, or never published); then drop the purge's tombstone. Idempotent."""
    segments = blocks = 0
    for vid, volume in store.volumes.items():
        records = {r.segment: r for r in await store.ledger.records(vid) if r.tenant == tenant}
        for segment in await volume.segments():
            try:
                header = await read_header(volume, segment)
            except SegmentFormatError:  # gone since the listing, or not a segment: reconciliation's
                continue
            if header.tenant != tenant or not stale(header, {tenant: epoch}):
                continue
            await erase_segment(store, vid, segment, header.publication and header.publication.root)
            records.pop(segment, None)
            segments, blocks = segments + 1, blocks + header.n_blocks
        for record in records.values():  # counted, but its object is gone (or unreadable): uncount it
            if not await volume.exists(record.segment):
                await store.capacity.retire(vid, record)
        for segment in await volume.quarantined():  # unpublished and uncounted already: unlinked if it is the tenant's
            try:
                header = await read_header(volume, segment, quarantined=True)
            except SegmentFormatError:  # torn or foreign bytes: not attributable to a tenant
                continue
            if header.tenant == tenant:
                await volume.delete_quarantined(segment)
                segments, blocks = segments + 1, blocks + header.n_blocks
    await store.fence.finish(tenant, epoch)
    log.info("purged tenant %r up to epoch %d: %d segments, %d blocks", tenant, epoch, segments, blocks)
    return PurgeResult(segments, blocks)


async def erase_segment(store: "BlockStore", vid: str, segment: str, root: bytes | None) -> None:
    """Grave, unpublish, uncount, unlink, forget: in that order, each step idempotent. `root`: the
    chain root its index entries are under (None: it has none unless the ledger knows it)."""
    await store.ledger.condemn(vid, segment)
    await _unpublish(store, vid, segment, root)
    await store.volumes[vid].delete(segment)
    await _unpublish(store, vid, segment, root)  # a reconciler that listed it before the grave may have republished it
    await store.ledger.buried(vid, segment)
    store.forget(segment)
    store.stats.segments_deleted += 1


async def _unpublish(store: "BlockStore", vid: str, segment: str, root: bytes | None) -> None:
    record = await store.ledger.record(vid, segment)
    if record is not None:
        await store.capacity.retire(vid, record)
    elif root is not None:
        await store.index.unpublish_segment(root, segment)
