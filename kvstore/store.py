"""BlockStore: saves new blocks as segments over the volumes and reads hits back, verified."""
from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Sequence

import numpy as np
from redis.exceptions import RedisError

from .capacity import Capacity
from .geometry import CacheGeometry
from .index import PrefixIndex
from .ledger import SegmentRecord, VolumeLedger
from .location import BlockLocation, Hit, SegmentRun
from .prefetch import LayerRead, Prefetch
from .retention import RetentionPolicy
from .hashing import HASH_BYTES
from .segment import (PREAMBLE_BYTES, SegmentFormatError, SegmentHeader, SegmentMissing, block_checksums,
                      copy_verified, data_offset_for, decode_header, encode_segment, header_length)
from .stats import StoreStats
from .volume import Volume

log = logging.getLogger(__name__)

MiB = 1 << 20


class SaveResult(NamedTuple):
    blocks: int                  # blocks written and published
    segments: tuple[str, ...]    # segment ids, in block order
    bytes: int                   # segment object bytes written


class HeaderCheck(NamedTuple):
    headers: dict[str, SegmentHeader]  # segment id -> header, for segments that passed
    valid_blocks: int                  # leading blocks of the hit whose headers match


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


class BlockStore:
    """Latent blocks of prompt prefixes on tensorstore volumes, found through a PrefixIndex.

    Invariants: save() returns only after the data is durable AND published, and publishes
    nothing when any write fails; every delivered block matched its segment header (model
    fingerprint, geometry, block hash) and its per-layer checksum, and a block that did not is
    dropped from the index and counted, never raised; one save becomes segments of at most
    `max_segment_blocks` blocks on the least used volumes, each stored layer-major, so reading
    one layer of a prefix is one range read per segment.
    """

    def __init__(self, volumes: Sequence[Volume], geometry: CacheGeometry, fingerprint: str,
                 index: PrefixIndex, ledger: VolumeLedger, pool: ThreadPoolExecutor, *,
                 budget_bytes: int | None = None, retention: RetentionPolicy = RetentionPolicy(),
                 max_segment_blocks: int = 64, read_ahead: int = 2, read_chunk_bytes: int = 4 * MiB,
                 reader_grace_s: float = 30.0) -> None:
        if not volumes:
            raise ValueError("a block store needs at least one volume")
        if len({v.id for v in volumes}) != len(volumes):
            raise ValueError("the same volume is listed twice")
        if not 1 <= max_segment_blocks < 1_000_000:
            raise ValueError(f"max_segment_blocks must be in [1, 999999], got {max_segment_blocks}")
        self.volumes = {v.id: v for v in volumes}
        self.geometry = geometry
        self.fingerprint = fingerprint
        self.index = index
        self.ledger = ledger
        self.retention = retention
        self.max_segment_blocks = max_segment_blocks
        self.read_ahead = read_ahead
        self.read_chunk_bytes = read_chunk_bytes
        self.stats = StoreStats()
        self.readers: Counter[str] = Counter()  # segment id -> prefetches reading it in this process
        self.capacity = Capacity(self, budget_bytes, reader_grace_s)
        self._pool = pool
        self._headers: OrderedDict[str, SegmentHeader] = OrderedDict()  # segments are immutable
        self._next_volume = 0
        self._background: set[asyncio.Task] = set()

    @classmethod
    async def open(cls, volumes: Sequence[str | dict[str, Any]], geometry: CacheGeometry, fingerprint: str,
                   index: PrefixIndex, *, threads: int = 4, read_mode: str = "mmap", **options) -> "BlockStore":
        """Open (creating if needed) the volumes; `read_mode` for `file` volumes: "mmap", "pread" or
        "tensorstore" (see Volume); `options` are the constructor's keywords."""
        pool = ThreadPoolExecutor(threads, thread_name_prefix="kvstore-io")
        opened = [await Volume.open(v, pool, read_mode) for v in volumes]
        ledger = VolumeLedger(index.redis, index.prefix)
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
                   tenant: str = "", retention: str = "chat", ttl_s: int | None = None) -> SaveResult:
        """Store blocks start_block..len(hashes)-1 of a chain; `hashes` is the chain from block 0.

        `layers[l]` is (n_new_blocks * block_tokens, latent_dim) in cache dtype.
        Raises ValueError naming a bad argument, SegmentWriteError if the data could not be
        made durable or published (then no unpublished data is left behind).
        """
        ttl = self.retention.ttl_s(retention, ttl_s)
        new = self._check_save(hashes, layers, start_block)
        spans = [(first, min(self.max_segment_blocks, new - first)) for first in range(0, new, self.max_segment_blocks)]
        try:
            volumes = await self._place([self._segment_bytes(count, tenant) for _, count in spans])
        except RedisError as e:
            self.stats.write_failures += 1
            raise SegmentWriteError(f"the index is unreachable, nothing written: {e}") from e
        bt = self.geometry.block_tokens
        written = await self._write_all([
            self._write_segment(volume, first, hashes[start_block + first:start_block + first + count],
                                [x[first * bt:(first + count) * bt] for x in layers], tenant)
            for (first, count), volume in zip(spans, volumes)])
        await self._publish_all(hashes, start_block, written, tenant, ttl)
        total = sum(w.bytes for w in written)
        self.stats.blocks_written += new
        self.stats.segments_written += len(written)
        self.stats.bytes_written += total
        return SaveResult(new, tuple(w.segment for w in written), total)

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
                           tenant: str, ttl: int) -> None:
        """Ledger record, then index entries, per segment in block order (the data is durable)."""
        root = hashes[0]
        for done, w in enumerate(written):
            try:
                await self.ledger.add(w.volume.id, SegmentRecord(w.segment, root, w.bytes, tenant))
                first = start_block + w.first
                locations = [BlockLocation(w.volume.id, w.segment, i, w.count, w.data_offset) for i in range(w.count)]
                await self.index.publish(root, hashes[first:first + w.count], locations, tenant, ttl)
            except Exception as e:  # index unreachable: the published segments stay valid, the rest goes
                self.stats.write_failures += 1
                await self._delete(written[done:])
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
        want = (new * g.block_tokens, g.latent_dim)
        for i, x in enumerate(layers):
            if not isinstance(x, np.ndarray) or x.shape != want:
                raise ValueError(f"layers[{i}] must have shape {want}, got {getattr(x, 'shape', type(x))}")
            if x.dtype != g.np_dtype:
                raise ValueError(f"layers[{i}] must have dtype {g.dtype}, got {x.dtype}")
        return new

    def _segment_bytes(self, blocks: int, tenant: str) -> int:
        """Bytes of a segment object: data plus an upper bound of its header (checksums, hashes)."""
        g = self.geometry
        header = 512 + len(self.fingerprint) + len(tenant) + blocks * (HASH_BYTES + 8 * g.num_layers)
        return data_offset_for(header) + blocks * g.num_layers * g.block_bytes

    async def _place(self, sizes: list[int]) -> list[Volume]:
        """A volume per segment: least used first (round-robin among equals), making room if needed."""
        used = await self.ledger.used(list(self.volumes))
        chosen = []
        for size in sizes:
            order = list(self.volumes)
            order = order[self._next_volume % len(order):] + order[:self._next_volume % len(order)]
            self._next_volume += 1
            vid = min(order, key=lambda v: used[v])
            used[vid] += size
            chosen.append(self.volumes[vid])
        for vid in {v.id for v in chosen}:
            await self.capacity.make_room(vid, sum(s for s, v in zip(sizes, chosen) if v.id == vid))
        return chosen

    async def _write_segment(self, volume: Volume, first: int, hashes: Sequence[bytes],
                             layers: Sequence[np.ndarray], tenant: str) -> _Written:
        segment = secrets.token_hex(16)
        payload, offset = await asyncio.get_running_loop().run_in_executor(
            self._pool, encode_segment, self.fingerprint, self.geometry, tenant, hashes, layers)
        await volume.write(segment, payload)
        return _Written(volume, segment, first, len(hashes), offset, len(payload))

    # ---- read -------------------------------------------------------------------------------

    def prefetch(self, hit: Hit, read_ahead: int | None = None, out: np.ndarray | None = None) -> Prefetch:
        """Start reading every layer of `hit` in the background (needs a running event loop).

        `out`: optional (num_layers, >= hit tokens, latent_dim) buffer to read into (see Prefetch).
        """
        self.touch(hit)
        return Prefetch(self, hit, self.read_ahead if read_ahead is None else read_ahead, out)

    async def header(self, volume_id: str, segment: str) -> SegmentHeader:
        """The segment's header (cached: segments never change). Raises SegmentFormatError."""
        cached = self._headers.get(segment)
        if cached is not None:
            self._headers.move_to_end(segment)
            return cached
        volume = self.volumes.get(volume_id)
        if volume is None:
            raise SegmentFormatError(f"unknown volume {volume_id}")
        head = await volume.read(segment, 0, 4096)
        if not head:
            raise SegmentMissing(f"segment {segment} is not on volume {volume_id}")
        length = header_length(head)
        if PREAMBLE_BYTES + length > len(head):
            head = await volume.read(segment, 0, PREAMBLE_BYTES + length)
        header = decode_header(head)
        self._headers[segment] = header
        if len(self._headers) > 4096:
            self._headers.popitem(last=False)
        return header

    async def verified_headers(self, hit: Hit) -> HeaderCheck:
        """Check each run's header against the hit; valid_blocks stops at the first mismatch."""
        found = await asyncio.gather(*(self.header(r.volume, r.segment) for r in hit.runs),
                                     return_exceptions=True)
        headers, block = {}, 0
        for run, header in zip(hit.runs, found):
            bad, why = self._first_bad_block(hit, run, block, header)
            if bad is not None:
                await self._reject(hit, block + bad, run.segment, why)
                return HeaderCheck(headers, block + bad)
            headers[run.segment] = header
            block += run.count
        return HeaderCheck(headers, block)

    def _first_bad_block(self, hit: Hit, run: SegmentRun, block: int,
                         header: SegmentHeader | BaseException) -> tuple[int | None, str]:
        """(index in `run` of the first block its header disowns, or None; why)."""
        if isinstance(header, BaseException):
            return 0, f"unreadable header: {header!r}"
        if header.fingerprint != self.fingerprint:
            return 0, f"foreign model fingerprint {header.fingerprint!r}"
        if header.geometry != self.geometry:
            return 0, f"foreign geometry {header.geometry}"
        if header.n_blocks != run.n_blocks or run.first + run.count > header.n_blocks:
            return 0, f"segment has {header.n_blocks} blocks, the index says {run.n_blocks}"
        for i in range(run.count):
            if header.hashes[run.first + i] != hit.hashes[block + i]:
                return i, "block hash mismatch"
        return None, ""

    async def read_layer(self, hit: Hit, layer: int, check: HeaderCheck | None = None,
                         out: np.ndarray | None = None) -> LayerRead:
        """Layer `layer` of the hit's leading valid blocks, every block checksum-verified.

        Reads into `out` (>= tokens, latent_dim) when given, else into a new array.
        """
        started = time.perf_counter()
        g = self.geometry
        check = check or await self.verified_headers(hit)
        blocks = min(hit.blocks, check.valid_blocks)
        if out is None:
            out = np.empty((blocks * g.block_tokens, g.latent_dim), g.np_dtype)  # (tokens, latent_dim)
        reads, block = [], 0
        for run in hit.truncated(blocks).runs:
            rows = out[block * g.block_tokens:(block + run.count) * g.block_tokens]
            reads.append(self._read_run(run, layer, rows, check.headers[run.segment]))
            block += run.count
        valid = blocks
        block = 0
        for run, bad in zip(hit.truncated(blocks).runs, await asyncio.gather(*reads)):
            if bad is not None:
                valid = block + bad
                await self._reject(hit, valid, run.segment, f"layer {layer} checksum")
                break
            block += run.count
        self.stats.layer_reads += 1
        self.stats.bytes_read += valid * g.block_bytes
        self.stats.read_latency.observe(time.perf_counter() - started)
        return LayerRead(out[:valid * g.block_tokens], valid)

    async def _read_run(self, run: SegmentRun, layer: int, rows: np.ndarray, header: SegmentHeader) -> int | None:
        """Read one run's layer into `rows` (run.count * block_tokens, latent_dim), verifying each
        block; the index of its first missing or bad block, or None."""
        g = self.geometry
        volume = self.volumes[run.volume]
        start = run.data_offset + (layer * run.n_blocks + run.first) * g.block_bytes
        expected = header.checksums[layer, run.first:run.first + run.count]
        loop = asyncio.get_running_loop()
        if volume.read_mode == "mmap":
            def copy() -> int | None:
                return copy_verified(volume.mapped(run.segment), start, rows, expected, g.block_tokens)
            return await loop.run_in_executor(self._pool, copy)
        buffer = memoryview(rows.reshape(-1).view(np.uint8))
        step = max(g.block_bytes, self.read_chunk_bytes // g.block_bytes * g.block_bytes)
        offsets = range(0, len(buffer), step)
        got = await asyncio.gather(*(volume.read_into(run.segment, start + o, buffer[o:o + step])
                                     for o in offsets))
        short = [o + n for o, n in zip(offsets, got) if n < min(step, len(buffer) - o)]
        complete = min(short) // g.block_bytes if short else run.count  # blocks fully read
        actual = await loop.run_in_executor(self._pool, block_checksums, rows, g.block_tokens)
        mismatch = np.flatnonzero(actual[:complete] != expected[:complete])
        if mismatch.size:
            return int(mismatch[0])
        return None if complete == run.count else complete

    async def _reject(self, hit: Hit, block: int, segment: str, why: str) -> None:
        """Block `block` of the hit failed verification: count it, drop its entry, go on as a miss."""
        self.stats.verification_failures += 1
        log.warning("block %d of root %s failed verification (%s); dropping it from the index",
                    block, hit.root.hex(), why)
        try:
            await self.index.drop(hit.root, hit.hashes[block], segment)
        except Exception:  # the index may be down: the entry then just stays a miss next time too
            log.exception("could not drop a bad index entry")
        self.forget(segment)

    # ---- bookkeeping ------------------------------------------------------------------------

    async def begin_read(self, hit: Hit) -> tuple[HeaderCheck, int]:
        """LayerSource: hold the hit's segments against deletion, verify their headers."""
        self.readers.update({r.segment for r in hit.runs})
        check = await self.verified_headers(hit)
        return check, check.valid_blocks

    def end_read(self, hit: Hit) -> None:
        segments = {r.segment for r in hit.runs}
        self.readers.subtract(segments)
        for s in segments:
            if self.readers[s] <= 0:
                del self.readers[s]

    def touch(self, hit: Hit) -> None:
        """Record, in the background, that the hit's segments were just used (eviction recency)."""
        if hit.runs:
            self._spawn(self.ledger.touch([(r.volume, r.segment) for r in hit.runs]))

    def forget(self, segment: str) -> None:
        """Drop what this process caches about a segment (its header, its mapping)."""
        self._headers.pop(segment, None)
        for volume in self.volumes.values():
            volume.unmap(segment)

    def _spawn(self, coro) -> None:
        async def logged():
            try:
                await coro
            except Exception:  # background bookkeeping: log, never disturb a request
                log.exception("background store task failed")
        task = asyncio.create_task(logged())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
