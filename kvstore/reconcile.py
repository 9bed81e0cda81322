"""Reconciler: the volumes are the source of truth; the index and the ledger are rebuilt from them.

One pass, per volume, under that volume's lease (one reconciler at a time, whichever kvstore):
  - ledger records whose segment object is gone: unpublished and retired (dangling);
  - every segment object's header and size are checked: a torn file (wrong size, unreadable
    header) or a foreign one (another model's fingerprint or geometry, no publication record) is
    moved to `quarantine/` and reported, and unpublished first if the ledger knew it;
  - a valid segment the ledger does not know and the grave does not hold (an evicted segment is
    in the grave before its bytes are deleted) is republished from its header: index entries with
    its retention class and what its expiry leaves (entries a newer save made are kept), and a
    ledger record whose recency stamp is its write time; one past its expiry is recorded in the
    grave and deleted; one younger than `min_age_s` is left to its writer, which publishes after
    the bytes are durable;
  - a segment its tenant's purge fenced off (an older epoch, purge.stale) is erased, and a purge
    whose tombstone is still in the index (its driver died half-way) is finished before the volumes.
A pass works in batches of `concurrency` segments between awaits, so the service keeps serving:
until a segment is republished its prefixes are misses. Blocking nothing, it can run any time.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from .ledger import SegmentRecord
from .lease import VolumeLease
from .location import BlockLocation
from .purge import erase_segment, erase_tenant, stale
from .reader import read_header
from .segment import SegmentFormatError, SegmentHeader, SegmentMissing

if TYPE_CHECKING:
    from .store import BlockStore

log = logging.getLogger(__name__)

OUTCOMES = ("known", "republished", "young", "expired", "quarantined", "dangling", "vanished", "purged")


@dataclass
class ReconcileReport:
    """What one pass found and did; `outcomes` counts segments by OUTCOMES."""

    volumes: list[str] = field(default_factory=list)   # volume ids reconciled
    busy: list[str] = field(default_factory=list)      # volume ids another reconciler held
    segments: int = 0                                  # segment objects examined
    outcomes: Counter = field(default_factory=Counter)
    quarantined: list[dict] = field(default_factory=list)  # {"volume", "segment", "reason"}
    purges: dict[str, int] = field(default_factory=dict)  # tombstones finished: tenant -> epoch
    seconds: float = 0.0

    @property
    def segments_per_s(self) -> float:
        return self.segments / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict:
        body = asdict(self)
        body["outcomes"] = {name: self.outcomes[name] for name in OUTCOMES}
        body["segments_per_s"] = round(self.segments_per_s, 1)
        return body


class Reconciler:
    """Reconciles a BlockStore's volumes with its index and ledger (see the module docstring).

    Invariants: a segment is published only while its object exists, is whole and verifies its
    header against this store's model; a segment in the grave is never published again; a
    segment is put in the grave before its bytes are deleted.
    """

    def __init__(self, store: "BlockStore", *, min_age_s: float = 60.0, lease_ttl_s: float = 30.0,
                 concurrency: int = 32) -> None:
        self.store = store
        self.min_age_s = min_age_s
        self.lease_ttl_s = lease_ttl_s
        self.concurrency = concurrency
        self.totals: Counter = Counter()     # segments by outcome, over every pass of this process
        self.passes = 0
        self.last: ReconcileReport | None = None
        self._running = asyncio.Lock()
        self._epochs: dict[str, int] = {}  # tenants' purge epochs, read at the start of a pass
        self._loop: asyncio.Task | None = None

    @property
    def running(self) -> bool:
        return self._running.locked()

    async def run(self) -> ReconcileReport:
        """One pass over every volume whose lease is free; passes of this process take turns."""
        async with self._running:
            report = ReconcileReport()
            started = time.perf_counter()
            for tenant, epoch in (await self.store.fence.tombstones()).items():
                await erase_tenant(self.store, tenant, epoch)
                report.purges[tenant] = epoch
            self._epochs = await self.store.fence.epochs()
            for vid in self.store.volumes:
                lease = VolumeLease(self.store.index.redis, self.store.index.prefix, vid, self.lease_ttl_s)
                async with lease.hold() as taken:
                    if not taken:
                        report.busy.append(vid)
                        continue
                    await self._volume(vid, lease, report)
                    report.volumes.append(vid)
            report.seconds = time.perf_counter() - started
            self.totals.update(report.outcomes)
            self.passes += 1
            self.last = report
            log.info("reconciled %d segments on %d volumes in %.2f s (%s); %d volumes busy", report.segments,
                     len(report.volumes), report.seconds, dict(report.outcomes), len(report.busy))
            return report

    async def _volume(self, vid: str, lease: VolumeLease, report: ReconcileReport) -> None:
        volume = self.store.volumes[vid]
        await self.store.ledger.count_tenants(vid)
        objects = await volume.segments()  # listed before the ledger is read: see _dangling
        records = {r.segment: r for r in await self.store.ledger.records(vid)}
        await self._dangling(vid, set(objects), records, report)
        for first in range(0, len(objects), self.concurrency):
            if not lease.held.is_set():
                log.warning("lease of volume %s lost mid-pass; the next pass goes on", vid)
                return
            batch = objects[first:first + self.concurrency]
            outcomes = await asyncio.gather(*(self._segment(vid, s, records.get(s), report) for s in batch))
            report.segments += len(batch)
            report.outcomes.update(outcomes)

    async def _dangling(self, vid: str, listed: set[str], records: dict[str, SegmentRecord],
                        report: ReconcileReport) -> None:
        """Ledger records whose object is gone. A record newer than the listing has its object
        written before it (data first, then the ledger), so the object is checked again."""
        volume = self.store.volumes[vid]
        for segment, record in records.items():
            if segment in listed or await volume.exists(segment):
                continue
            await self.store.capacity.retire(vid, record)
            self.store.forget(segment)
            report.outcomes["dangling"] += 1
            log.warning("segment %s of volume %s is gone: unpublished", segment, vid)

    async def _segment(self, vid: str, segment: str, record: SegmentRecord | None, report: ReconcileReport) -> str:
        store, volume = self.store, self.store.volumes[vid]
        try:
            header = await read_header(volume, segment)
            problem = await self._problem(vid, segment, header)
        except SegmentMissing:
            return "vanished"  # deleted since the listing (evicted, expired)
        except SegmentFormatError as e:
            problem = f"unreadable header: {e}"
        if not problem and record is None and header.publication is None:
            problem = "cannot be republished: no publication record (written before headers carried one)"
        if problem:
            if record is not None:
                await store.capacity.retire(vid, record)
            await volume.quarantine(segment)
            store.forget(segment)
            report.quarantined.append({"volume": vid, "segment": segment, "reason": problem})
            log.warning("segment %s of volume %s quarantined: %s", segment, vid, problem)
            return "quarantined"
        if stale(header, self._epochs):
            await erase_segment(store, vid, segment, header.publication and header.publication.root)
            return "purged"
        if record is not None:
            return "known"
        return await self._unknown(vid, segment, header)

    async def _problem(self, vid: str, segment: str, header: SegmentHeader) -> str:
        """Why the segment cannot be published by this store, or "" if it can."""
        store = self.store
        if header.fingerprint != store.fingerprint:
            return f"foreign model fingerprint {header.fingerprint!r}"
        if header.geometry != store.geometry:
            return f"foreign geometry {header.geometry}"
        forged = store.mac.first_forged(header.version, header.fingerprint, header.hashes, header.checksums,
                                        header.macs)
        if forged is not None:  # written without the deployment's MAC key: never republished
            store.stats.forged_segments += 1
            return f"block {forged}'s MAC does not verify"
        size = header.data_offset + header.n_blocks * store.geometry.num_layers * store.geometry.block_bytes
        if not await store.volumes[vid].has_size(segment, size):
            return f"torn: not {size} bytes"
        return ""

    async def _unknown(self, vid: str, segment: str, header: SegmentHeader) -> str:
        """A whole, valid segment no ledger counts: republish it, delete it if expired, or wait."""
        store, volume, publication = self.store, self.store.volumes[vid], header.publication
        if await store.ledger.record(vid, segment) is not None:
            return "known"  # its writer published it since the ledger was read
        if await store.ledger.in_grave(vid, segment):
            return "vanished"  # evicted or expired: its bytes are about to be deleted
        now = time.time()
        if now >= publication.expires_at:
            await store.ledger.condemn(vid, segment)
            await volume.delete(segment)
            await store.ledger.buried(vid, segment)
            store.stats.segments_deleted += 1
            return "expired"
        if now - publication.written_at < self.min_age_s:
            return "young"
        size = header.data_offset + header.n_blocks * store.geometry.num_layers * store.geometry.block_bytes
        record = SegmentRecord(segment, publication.root, size, header.tenant)
        await store.ledger.add(vid, record, last_hit_ms=publication.written_at * 1000.0)
        locations = [BlockLocation(vid, segment, i, header.n_blocks, header.data_offset)
                     for i in range(header.n_blocks)]
        await store.index.publish(publication.root, header.hashes, locations, header.tenant, publication.ttl_s,
                                  expire_s=max(1, int(publication.expires_at - now)), missing_only=True)
        if not await volume.exists(segment):  # deleted between the header read and the publish
            await store.capacity.retire(vid, record)
            return "vanished"
        return "republished"

    def start(self, interval_s: float, retry_s: float = 10.0) -> None:
        """Reconcile now, in the background; again every `retry_s` while a pass fails or finds a
        volume busy, then every `interval_s` (0: never again) until stop()."""
        async def loop():
            while True:
                try:
                    complete = not (await self.run()).busy
                except Exception:  # Redis or a volume down: the next try will tell
                    log.exception("reconciliation failed")
                    complete = False
                if complete and interval_s <= 0:
                    return
                await asyncio.sleep(interval_s if complete else retry_s)
        if self._loop is None:
            self._loop = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
            self._loop = None
