"""BlockStore: saves new blocks as segments over the volumes; reads hits back through SegmentReader."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Sequence

import numpy as np
from redis.exceptions import RedisError

from .block_check import nonfinite_stored_blocks
from .block_mac import BlockMac
from .capacity import Capacity
from .fence import TenantFence
from .geometry import CacheGeometry
from .index import PrefixIndex
from .ledger import SegmentRecord, VolumeLedger
from .location import BlockLocation, Hit
from .prefetch import Prefetch
from .purge import erase_segment
from .quota import Reservation, TenantQuotas
from .reader import MiB, SegmentReader
from .retention import RetentionPolicy
from .segment import SegmentPublication, encode_segment, segment_object_bytes
from .volume import Volume

log = logging.getLogger(__name__)

READ_AHEAD_LAYERS = 4   # layers in flight per prefetch (kv_bench: more in flight reads faster, cold and warm)
IO_THREADS = 8          # volume reads and checksums; mostly waiting on I/O or copying with the GIL released
# A volume whose write failed (full, read-only, gone) gets no new segments for this long, unless no
# volume is left: its ledger usage stops growing, so "least used" would otherwise pick it every time.
WRITE_FAILURE_REST_S = 30.0


class SaveResult(NamedTuple):
    blocks: int                  # blocks written and published
    segments: tuple[str, ...]    # segment ids, in block order
    bytes: int                   # segment object bytes written


class _Written(NamedTuple):
    """A segment of a save, durable on its volume, not yet published."""

    volume: Volume
    segment: str
    first: int        # its first block, counted from the save's start_block
    count: int        # blocks
    data_offset: int  # bytes
    bytes: int        # size of the segment object


class SegmentWriteError(RuntimeError):
    """A save could not make its data durable; nothing of it was published."""


class TenantPurged(SegmentWriteError):
    """The tenant's cache was purged since the save's request began (fence.py): nothing of it stays."""


class BlockStore(SegmentReader):
    """Latent blocks of prompt prefixes on tensorstore volumes, found through a PrefixIndex.

    Invariants: save() returns only after the data is durable AND published, and publishes
    nothing when any write fails; every stored block carries a MAC under `mac_key` (the
    deployment's secret); every delivered block's MAC verified and it matched its segment header
    (model fingerprint, geometry, block hash), its per-layer checksum and is finite; a block that did not is
    dropped from the index and counted, never raised; one save becomes segments of at most
    `max_segment_blocks` blocks on the least used volumes, each stored layer-major, so reading
    one layer of a prefix is one range read per segment. Reads: SegmentReader.
    """

    def __init__(self, volumes: Sequence[Volume], geometry: CacheGeometry, fingerprint: str,
                 index: PrefixIndex, ledger: VolumeLedger, pool: ThreadPoolExecutor, *, mac_key: str,
                 budget_bytes: int | None = None, retention: RetentionPolicy | None = None,
                 max_segment_blocks: int = 64, read_ahead: int = READ_AHEAD_LAYERS, read_chunk_bytes: int = 4 * MiB,
                 reader_grace_s: float = 30.0) -> None:
        if not volumes:
            raise ValueError("a block store needs at least one volume")
        if len({v.id for v in volumes}) != len(volumes):
            raise ValueError("the same volume is listed twice")
        if not 1 <= max_segment_blocks < 1_000_000:
            raise ValueError(f"max_segment_blocks must be in [1, 999999], got {max_segment_blocks}")
        super().__init__({v.id: v for v in volumes}, geometry, fingerprint, index, pool, BlockMac(mac_key),
                         read_chunk_bytes)
        self.ledger = ledger
        self.retention = retention or RetentionPolicy()
        self.max_segment_blocks = max_segment_blocks
        self.read_ahead = read_ahead
        self.capacity = Capacity(self, budget_bytes, reader_grace_s)
        self.fence = TenantFence(index.redis, index.prefix)
        self.quotas = TenantQuotas(self)
        self._next_volume = 0
        self._resting_until: dict[str, float] = {}  # volume id -> monotonic time; a write failed there
        self._background: set[asyncio.Task] = set()

    @classmethod
    async def open(cls, volumes: Sequence[str | dict[str, Any]], geometry: CacheGeometry, fingerprint: str,
                   index: PrefixIndex, *, threads: int = IO_THREADS, read_mode: str = "mmap", **options) -> "BlockStore":
        """Open (creating if needed) the volumes; `read_mode` for `file` volumes: "mmap", "pread" or
        "tensorstore" (see Volume); `options` are the constructor's keywords."""
        pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-io")
        opened = [await Volume.open(v, pool, read_mode) for v in volumes]
        ledger = VolumeLedger(index.redis, index.prefix)
        try:  # a ledger older than per-tenant counts; else reconciliation counts it
            await asyncio.gather(*(ledger.count_tenants(v.id) for v in opened))
        except RedisError as e:
            log.warning("could not count the ledger's segments per tenant yet: %s", e)
        return cls(opened, geometry, fingerprint, index, ledger, pool, **options)

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.capacity.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)
        for volume in self.volumes.values():
            volume.close()

    # ---- save -------------------------------------------------------------------------------

    async def save(self, hashes: Sequence[bytes], layers: Sequence[np.ndarray], *, start_block: int = 0,
                   tenant: str = "", retention: str = "chat", ttl_s: int | None = None,
                   epoch: int | None = None) -> SaveResult:
        """Store blocks start_block..len(hashes)-1 of a chain; `hashes` is the chain from block 0.
        `epoch`: the tenant's purge epoch the request began under (fence.py; None: the current one);
        the bytes are held in the tenant's quota (quota.py) until published.

        `layers[l]` is (n_new_blocks * block_tokens, row_width) stored rows in row_dtype (geometry.py: latents in
        cache dtype, or fp8 rows).
        Raises ValueError naming a bad argument, SegmentWriteError if the data could not be
        made durable or published (then no unpublished data is left behind), TenantPurged if the
        tenant was purged since `epoch` (then nothing of it is left behind).
        """
        if not self.mac.keyed:
            self.stats.write_failures += 1
            raise SegmentWriteError("no MAC key configured (mac_key): nothing can be stored")
        ttl = self.retention.ttl_s(retention, ttl_s)
        new = self._check_save(hashes, layers, start_block)
        spans = [(first, min(self.max_segment_blocks, new - first)) for first in range(0, new, self.max_segment_blocks)]
        sizes = [self._segment_bytes(count, tenant) for _, count in spans]
        async with contextlib.AsyncExitStack() as held:
            try:
                epoch = await self._epoch(tenant, epoch)
                room = await held.enter_async_context(self.quotas.room(tenant, sum(sizes)))
                volumes = await self._place(sizes)
            except RedisError as e:
                self.stats.write_failures += 1
                raise SegmentWriteError(f"the index is unreachable, nothing written: {e}") from e
            bt = self.geometry.block_tokens
            publication = SegmentPublication(hashes[0], retention, ttl, int(time.time()) + ttl, epoch)
            written = await self._write_all([
                self._write_segment(volume, first, hashes[start_block + first:start_block + first + count],
                                    [x[first * bt:(first + count) * bt] for x in layers], tenant, publication)
                for (first, count), volume in zip(spans, volumes)])
            await self._publish_all(hashes, start_block, written, tenant, ttl, room)
        await self._recheck(tenant, epoch, hashes[0], written)
        try:
            await self.quotas.trim(tenant)
        except RedisError:  # the next save of the tenant trims it
            log.warning("could not trim tenant %r to its quota after a save", tenant)
        total = sum(w.bytes for w in written)
        self.stats.blocks_written += new
        self.stats.segments_written += len(written)
        self.stats.bytes_written += total
        return SaveResult(new, tuple(w.segment for w in written), total)

    async def _epoch(self, tenant: str, epoch: int | None) -> int:
        """The epoch the save is written under: `epoch` unless the tenant was purged since (TenantPurged)."""
        current = await self.fence.epoch(tenant)
        if epoch is not None and epoch < current:
            self.stats.write_failures += 1
            raise TenantPurged(f"tenant {tenant!r} was purged since this save's request began")
        return current if epoch is None else epoch

    async def _recheck(self, tenant: str, epoch: int, root: bytes, written: list[_Written]) -> None:
        """After publishing: a purge that began meanwhile either listed these segments (and erases
        them) or began after this read; if the epoch moved, the save erases its own segments."""
        try:
            if await self.fence.epoch(tenant) == epoch:
                return
            for w in written:
                await erase_segment(self, w.volume.id, w.segment, root)
        except RedisError as e:  # reconciliation erases segments of a stale epoch (purge.stale)
            raise SegmentWriteError(f"could not check the tenant's epoch after publishing: {e}") from e
        self.stats.write_failures += 1
        raise TenantPurged(f"tenant {tenant!r} was purged while this save was in flight: withdrawn")

    async def _write_all(self, writes: list) -> list[_Written]:
        """Run the segment writes; if any fails, delete the others and raise SegmentWriteError."""
        results = await asyncio.gather(*writes, return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            self.stats.write_failures += 1
            await self._delete([r for r in results if not isinstance(r, BaseException)])
            raise SegmentWriteError(f"segment write failed: {errors[0]!r}") from errors[0]
        return results

    async def _publish_all(self, hashes: Sequence[bytes], start_block: int, written: list[_Written],
                           tenant: str, ttl: int, room: Reservation) -> None:
        """Ledger record (its bytes leave the quota reservation), then index entries, per segment in
        block order (the data is durable)."""
        root = hashes[0]
        for done, w in enumerate(written):
            try:
                await room.counted(self._segment_bytes(w.count, tenant),
                                   self.ledger.add(w.volume.id, SegmentRecord(w.segment, root, w.bytes, tenant)))
                first = start_block + w.first
                locations = [BlockLocation(w.volume.id, w.segment, i, w.count, w.data_offset) for i in range(w.count)]
                await self.index.publish(root, hashes[first:first + w.count], locations, tenant, ttl,
                                         parent=hashes[first - 1] if first else None)
            except Exception as e:  # index unreachable: the published segments stay valid, the rest goes
                self.stats.write_failures += 1
                with contextlib.suppress(Exception):  # counted, perhaps half published: uncount and unpublish it
                    await self.capacity.retire(w.volume.id, SegmentRecord(w.segment, root, w.bytes, tenant))
                await self._delete(written[done:])  # (with the index down, reconciliation does: dangling)
                raise SegmentWriteError(f"publishing failed after {done} of {len(written)} segments: {e!r}") from e

    async def _delete(self, written: list[_Written]) -> None:
        await asyncio.gather(*(w.volume.delete(w.segment) for w in written), return_exceptions=True)

    def _check_save(self, hashes: Sequence[bytes], layers: Sequence[np.ndarray], start_block: int) -> int:
        g = self.geometry
        if not 0 <= start_block < len(hashes):
            raise ValueError(f"start_block must be in [0, {len(hashes)}), got {start_block}")
        if len(layers) != g.num_layers:
            raise ValueError(f"layers must have {g.num_layers} entries, got {len(layers)}")
        new = len(hashes) - start_block
        want = (new * g.block_tokens, g.row_width)
        for i, x in enumerate(layers):
            if not isinstance(x, np.ndarray) or x.shape != want:
                raise ValueError(f"layers[{i}] must have shape {want}, got {getattr(x, 'shape', type(x))}")
            if x.dtype != g.row_dtype:
                raise ValueError(f"layers[{i}] must have dtype {g.row_dtype} ({g.latent_format} format), got {x.dtype}")
            if nonfinite_stored_blocks(x, g).any():
                raise ValueError(f"layers[{i}] holds NaN or Inf latents")
        return new

    def _segment_bytes(self, blocks: int, tenant: str) -> int:
        return segment_object_bytes(self.geometry, self.fingerprint, tenant, blocks)

    async def _place(self, sizes: list[int]) -> list[Volume]:
        """A volume per segment: least used first (round-robin among equals) among those whose budget
        can hold it, making room if needed; volumes whose last write failed recently only when every
        volume's did."""
        used = await self.ledger.used(list(self.volumes))
        now = time.monotonic()
        writable = [v for v in self.volumes if self._resting_until.get(v, 0.0) <= now]
        chosen = []
        for size in sizes:
            order = writable or list(self.volumes)
            # a volume whose budget cannot hold the segment at all (a small file system's default
            # share) is left out while another can
            order = [v for v in order if self.capacity.budget_of(v) >= size] or order
            order = order[self._next_volume % len(order):] + order[:self._next_volume % len(order)]
            self._next_volume += 1
            vid = min(order, key=lambda v: used[v])
            used[vid] += size
            chosen.append(self.volumes[vid])
        for vid in {v.id for v in chosen}:
            await self.capacity.make_room(vid, sum(s for s, v in zip(sizes, chosen) if v.id == vid))
        return chosen

    async def _write_segment(self, volume: Volume, first: int, hashes: Sequence[bytes],
                             layers: Sequence[np.ndarray], tenant: str, publication: SegmentPublication) -> _Written:
        segment = secrets.token_hex(16)
        payload, offset = await asyncio.get_running_loop().run_in_executor(
            self._pool, functools.partial(encode_segment, self.fingerprint, self.geometry, tenant, hashes, layers,
                                          self.mac, publication=publication))
        try:
            await volume.write(segment, payload)
        except Exception:
            self._resting_until[volume.id] = time.monotonic() + WRITE_FAILURE_REST_S
            log.warning("volume %s failed a write; no new segments there for %.0f s", volume.name, WRITE_FAILURE_REST_S)
            raise
        return _Written(volume, segment, first, len(hashes), offset, len(payload))

    # ---- read -------------------------------------------------------------------------------

    def prefetch(self, hit: Hit, read_ahead: int | None = None, out: np.ndarray | None = None) -> Prefetch:
        """Start reading every layer of `hit` in the background (needs a running event loop).

        `out`: optional (num_layers, >= hit tokens, row_width) buffer to read into (see Prefetch).
        """
        self.touch(hit)
        return Prefetch(self, hit, self.read_ahead if read_ahead is None else read_ahead, out)

    # ---- bookkeeping ------------------------------------------------------------------------

    def touch(self, hit: Hit) -> None:
        """Record, in the background, that the hit's segments were just used (eviction recency)."""
        if hit.runs:
            self._spawn(self.ledger.touch([(r.volume, r.segment) for r in hit.runs]))

    def _spawn(self, coro) -> None:
        async def logged():
            try:
                await coro
            except Exception:  # background bookkeeping: log, never disturb a request
                log.exception("background store task failed")
        task = asyncio.create_task(logged())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
