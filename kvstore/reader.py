"""SegmentReader: verified reads of a hit's latents from the segments on the volumes."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from .block_mac import BlockMac
from .geometry import CacheGeometry
from .index import PrefixIndex
from .location import Hit, SegmentRun
from .prefetch import LayerRead
from .segment import (PREAMBLE_BYTES, BlockFault, SegmentForged, SegmentFormatError, SegmentHeader, SegmentMissing,
                      SegmentVersionError, check_blocks, copy_verified, decode_header, header_length)
from .stats import StoreStats
from .volume import Volume

log = logging.getLogger(__name__)

MiB = 1 << 20
MAX_CACHED_HEADERS = 4096


async def read_header(volume: Volume, segment: str, quarantined: bool = False) -> SegmentHeader:
    """The header of a segment object (in `quarantine/` if `quarantined`), read from its volume (one 4 KiB read,
    two for large headers). Raises SegmentMissing if there is no such object, SegmentFormatError if it is not a
    segment."""
    head = await volume.read(segment, 0, 4096, quarantined)
    if not head:
        raise SegmentMissing(f"segment {segment} is not on volume {volume.id}")
    length = header_length(head)
    if PREAMBLE_BYTES + length > len(head):
        head = await volume.read(segment, 0, PREAMBLE_BYTES + length, quarantined)
    return decode_header(head)


class HeaderCheck(NamedTuple):
    headers: dict[str, SegmentHeader]  # segment id -> header, for segments that passed
    valid_blocks: int                  # leading blocks of the hit whose headers match


class SegmentReader:
    """Reads layers of hits, verified: the LayerSource behind a local Prefetch.

    Invariants: a delivered block's segment header is of this format version and its block MAC
    verifies under the MAC key; the block matched that header (model fingerprint, geometry, block
    hash at its ordinal), its per-layer checksum, and holds only finite values; the first block that did not ends the
    usable prefix, is dropped from the index and counted in `stats.verification_failures`, and
    nothing raises for it. Segments a read holds (`readers`) are not deleted by this process.
    """

    def __init__(self, volumes: dict[str, Volume], geometry: CacheGeometry, fingerprint: str,
                 index: PrefixIndex, pool: ThreadPoolExecutor, mac: BlockMac,
                 read_chunk_bytes: int = 4 * MiB) -> None:
        self.volumes = volumes
        self.mac = mac
        self.geometry = geometry
        self.fingerprint = fingerprint
        self.index = index
        self.read_chunk_bytes = read_chunk_bytes
        self.stats = StoreStats()
        self.readers: Counter[str] = Counter()  # segment id -> reads holding it in this process
        self._pool = pool
        self._headers: OrderedDict[str, SegmentHeader] = OrderedDict()  # segments are immutable

    async def header(self, volume_id: str, segment: str) -> SegmentHeader:
        """The segment's header, its block MACs verified (cached: segments never change). Raises
        SegmentFormatError (SegmentVersionError, SegmentForged, SegmentMissing: counted here)."""
        cached = self._headers.get(segment)
        if cached is not None:
            self._headers.move_to_end(segment)
            return cached
        volume = self.volumes.get(volume_id)
        if volume is None:
            raise SegmentFormatError(f"unknown volume {volume_id}")
        try:
            header = await read_header(volume, segment)
        except SegmentVersionError:
            self.stats.old_format_segments += 1
            raise
        forged = self.mac.first_forged(header.version, header.fingerprint, header.hashes, header.checksums, header.macs)
        if forged is not None:
            self.stats.forged_segments += 1
            raise SegmentForged(f"block {forged} of segment {segment}: MAC does not verify")
        self._headers[segment] = header
        if len(self._headers) > MAX_CACHED_HEADERS:
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
        if header.data_offset != run.data_offset:
            return 0, f"segment data starts at byte {header.data_offset}, the index says {run.data_offset}"
        for i in range(run.count):
            if header.hashes[run.first + i] != hit.hashes[block + i]:
                return i, "block hash mismatch"
        return None, ""

    async def read_layer(self, hit: Hit, layer: int, check: HeaderCheck | None = None,
                         out: np.ndarray | None = None) -> LayerRead:
        """Layer `layer` of the hit's leading valid blocks, every block checksum-verified.

        Reads into `out` (>= tokens, row_width) stored rows when given, else into a new array.
        """
        started = time.perf_counter()
        g = self.geometry
        check = check or await self.verified_headers(hit)
        blocks = min(hit.blocks, check.valid_blocks)
        if out is None:
            out = np.empty((blocks * g.block_tokens, g.row_width), g.row_dtype)  # (tokens, row_width)
        reads, block = [], 0
        for run in hit.truncated(blocks).runs:
            rows = out[block * g.block_tokens:(block + run.count) * g.block_tokens]
            reads.append(self._read_run(run, layer, rows, check.headers[run.segment]))
            block += run.count
        valid = blocks
        block = 0
        for run, bad in zip(hit.truncated(blocks).runs, await asyncio.gather(*reads, return_exceptions=True)):
            if isinstance(bad, asyncio.CancelledError):
                raise bad
            if isinstance(bad, Exception):  # a volume error is a cache fault like any other
                log.error("layer %d of segment %s unreadable: %r", layer, run.segment, bad)
                valid = block
                await self._reject(hit, valid, run.segment, f"layer {layer} unreadable")
                break
            if bad is not None:
                valid = block + bad.block
                if bad.reason == "nonfinite":
                    self.stats.nonfinite_blocks += 1
                await self._reject(hit, valid, run.segment, f"layer {layer}: {bad.reason}")
                break
            block += run.count
        self.stats.layer_reads += 1
        self.stats.bytes_read += valid * g.block_bytes
        self.stats.read_latency.observe(time.perf_counter() - started)
        return LayerRead(out[:valid * g.block_tokens], valid)

    async def _read_run(self, run: SegmentRun, layer: int, rows: np.ndarray,
                        header: SegmentHeader) -> BlockFault | None:
        """Read one run's layer into `rows` (run.count * block_tokens, row_width), verifying each
        block; its first missing or bad block (index in the run), or None."""
        g = self.geometry
        volume = self.volumes[run.volume]
        start = run.data_offset + (layer * run.n_blocks + run.first) * g.block_bytes
        expected = header.checksums[layer, run.first:run.first + run.count]
        loop = asyncio.get_running_loop()
        if volume.read_mode == "mmap":
            def copy() -> int | None:
                return copy_verified(volume.mapped(run.segment), start, rows, expected, g)
            return await loop.run_in_executor(self._pool, copy)
        buffer = memoryview(rows.reshape(-1).view(np.uint8))
        step = max(g.block_bytes, self.read_chunk_bytes // g.block_bytes * g.block_bytes)
        offsets = range(0, len(buffer), step)
        got = await asyncio.gather(*(volume.read_into(run.segment, start + o, buffer[o:o + step])
                                     for o in offsets))
        short = [o + n for o, n in zip(offsets, got) if n < min(step, len(buffer) - o)]
        complete = min(short) // g.block_bytes if short else run.count  # blocks fully read
        bt = g.block_tokens
        fault = await loop.run_in_executor(self._pool, check_blocks, rows[:complete * bt], expected[:complete], g)
        if fault is not None:
            return fault
        return None if complete == run.count else BlockFault(complete, "short")

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

    def forget(self, segment: str) -> None:
        """Drop what this process caches about a segment (its header, its mapping)."""
        self._headers.pop(segment, None)
        for volume in self.volumes.values():
            volume.unmap(segment)
