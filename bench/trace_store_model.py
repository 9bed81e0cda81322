"""An in-memory mirror of BlockStore's capacity rules, for replaying a whole trace in seconds.

It follows, step by step, the code it mirrors (tests/test_bench_trace.py checks it against the
real BlockStore on real volumes and a real Valkey):
  save        BlockStore.save: blocks [start, end) of a chain become segments of at most
              `max_segment_blocks` blocks; BlockStore._place puts each on the least used volume
              (round-robin among equals), then Capacity.make_room evicts, per volume, the least
              recently hit segments until the incoming bytes fit the per-volume budget (and gives up
              silently when nothing is left to evict); VolumeLedger.add, then PrefixIndex.publish
              (a block's entry points at the newest segment that saved it).
  lookup      PrefixIndex.lookup: the longest leading run of blocks with an index entry.
  touch       BlockStore.prefetch -> VolumeLedger.touch: every segment of the hit is now most recent,
              the chain's first segment the most recent of all (a prefix loses its tail first).
  retire      Capacity.retire: entries still pointing at the segment go, its bytes stop counting.
Time is a logical clock (one tick per event), so "least recently hit" is exact; the ledger's
microsecond stamps give the same order for events a Redis round trip apart.
Blocks are integer keys (bench.trace_format); bytes come from the real BlockStore formula.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from types import SimpleNamespace
from typing import NamedTuple, Sequence

from kvstore import BlockStore, CacheGeometry

FINGERPRINT_CHARS = 32  # ModelConfig.fingerprint: 32 hex digits


def segment_bytes(geometry: CacheGeometry, blocks: int, tenant: str = "") -> int:
    """What Capacity.make_room charges for a segment of `blocks` blocks (BlockStore's own formula)."""
    sizing = SimpleNamespace(geometry=geometry, fingerprint="0" * FINGERPRINT_CHARS)
    return BlockStore._segment_bytes(sizing, blocks, tenant)


class Segment(NamedTuple):
    volume: int
    keys: tuple[int, ...]   # its blocks, in chain order
    bytes: int


class StoreModel:
    """Volumes with byte budgets, an LRU of segments per volume, and the prefix index, in dicts.

    Invariants (as in VolumeLedger / PrefixIndex): used[v] is the sum of the bytes of v's live
    segments; every index entry points at a live segment; a retired segment's entries are removed
    only where they still point at it.
    """

    def __init__(self, geometry: CacheGeometry, volumes: int = 4, budget_bytes: int | None = None,
                 max_segment_blocks: int = 64) -> None:
        if volumes < 1:
            raise ValueError(f"volumes must be >= 1, got {volumes}")
        self.geometry = geometry
        self.budget_bytes = budget_bytes
        self.max_segment_blocks = max_segment_blocks
        self.used = [0] * volumes
        self.lru: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(volumes)]  # least recent first
        self.segments: dict[int, Segment] = {}
        self.index: dict[int, int] = {}    # block key -> segment id
        self.evictions = 0
        self.failed_saves = 0              # a segment bigger than a volume's budget (ValueError in make_room)
        self.segment_sizes: Counter[int] = Counter()  # blocks per written segment -> count
        self._next_segment = 0
        self._next_volume = 0
        self._sizes: dict[int, int] = {}

    def _bytes(self, blocks: int) -> int:
        if blocks not in self._sizes:
            self._sizes[blocks] = segment_bytes(self.geometry, blocks)
        return self._sizes[blocks]

    def lookup(self, keys: Sequence[int]) -> tuple[int, list[int]]:
        """(blocks in the longest leading run present, the segments holding them in chain order)."""
        segments, index = {}, self.index
        for n, key in enumerate(keys):
            segment = index.get(key)
            if segment is None:
                return n, list(segments)
            segments[segment] = None
        return len(keys), list(segments)

    def touch(self, segments: Sequence[int]) -> None:
        """The hit's segments in chain order become most recent, the chain's first one last."""
        for segment in reversed(segments):
            record = self.segments.get(segment)
            if record is not None:
                self.lru[record.volume].move_to_end(segment)

    def save(self, keys: Sequence[int], start: int) -> int:
        """Store blocks keys[start:]; returns blocks written (0 if the save failed)."""
        new = len(keys) - start
        if new <= 0:
            return 0
        spans = [(first, min(self.max_segment_blocks, new - first)) for first in range(0, new, self.max_segment_blocks)]
        sizes = [self._bytes(count) for _, count in spans]
        chosen = self._place(sizes)
        try:
            for volume in dict.fromkeys(chosen):
                self._make_room(volume, sum(s for s, v in zip(sizes, chosen) if v == volume))
        except ValueError:
            self.failed_saves += 1
            return 0
        for (first, count), size, volume in zip(spans, sizes, chosen):
            segment = self._next_segment
            self._next_segment += 1
            block_keys = tuple(keys[start + first:start + first + count])
            self.segments[segment] = Segment(volume, block_keys, size)
            self.used[volume] += size
            self.lru[volume][segment] = None
            for key in block_keys:
                self.index[key] = segment
            self.segment_sizes[count] += 1
        return new

    def _place(self, sizes: list[int]) -> list[int]:
        used, volumes, chosen = list(self.used), len(self.used), []
        for size in sizes:
            shift = self._next_volume % volumes
            order = list(range(volumes))[shift:] + list(range(volumes))[:shift]
            self._next_volume += 1
            volume = min(order, key=lambda v: used[v])
            used[volume] += size
            chosen.append(volume)
        return chosen

    def _make_room(self, volume: int, incoming: int) -> None:
        if self.budget_bytes is None:
            return
        if incoming > self.budget_bytes:
            raise ValueError(f"a segment of {incoming} bytes exceeds the volume budget of {self.budget_bytes}")
        lru = self.lru[volume]
        while self.used[volume] + incoming > self.budget_bytes and lru:
            self.retire(next(iter(lru)))

    def retire(self, segment: int) -> None:
        record = self.segments.pop(segment)
        del self.lru[record.volume][segment]
        self.used[record.volume] -= record.bytes
        for key in record.keys:
            if self.index.get(key) == segment:
                del self.index[key]
        self.evictions += 1

    def live_blocks(self) -> int:
        return sum(len(s.keys) for s in self.segments.values())
