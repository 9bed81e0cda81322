"""Where a prefix's latents live: runs of consecutive blocks inside segments."""
from __future__ import annotations

import re
from typing import NamedTuple

SEGMENT_ID = re.compile(r"^[0-9a-f]{32}$")
VOLUME_ID = re.compile(r"^[0-9a-f]{16}$")


class BlockLocation(NamedTuple):
    """One block inside one segment.

    The block's layer-l latents are bytes
    [data_offset + (l * n_blocks + ordinal) * block_bytes, + block_bytes) of the segment object:
    segments are layer-major, so one layer of consecutive blocks is one contiguous range.
    """

    volume: str       # volume id (16 hex), stable across restarts and mount points
    segment: str      # segment id (32 hex), never reused
    ordinal: int      # block index inside the segment
    n_blocks: int     # blocks in the segment
    data_offset: int  # bytes from the start of the segment object to layer 0, block 0

    def encode(self) -> bytes:
        """Index value "vol|seg|ordinal:06|n_blocks|data_offset": fixed offsets, so the lookup
        script can cut runs without parsing."""
        return f"{self.volume}|{self.segment}|{self.ordinal:06d}|{self.n_blocks}|{self.data_offset}".encode()


class SegmentRun(NamedTuple):
    """`count` consecutive blocks of one segment starting at `first`: one range per layer."""

    volume: str
    segment: str
    first: int        # ordinal of the run's first block in the segment
    count: int        # blocks in the run
    n_blocks: int     # blocks in the segment
    data_offset: int  # bytes

    @classmethod
    def decode(cls, raw: bytes) -> "SegmentRun":
        """From the lookup script's "vol|seg|first|n_blocks|data_offset|count"."""
        volume, segment, first, n_blocks, offset, count = raw.decode().split("|")
        if not VOLUME_ID.match(volume) or not SEGMENT_ID.match(segment):
            raise ValueError(f"malformed block location {raw[:120]!r}")
        return cls(volume, segment, int(first), int(count), int(n_blocks), int(offset))

    def locations(self) -> list[BlockLocation]:
        return [BlockLocation(self.volume, self.segment, self.first + i, self.n_blocks, self.data_offset)
                for i in range(self.count)]


class Hit(NamedTuple):
    """The longest leading run of a prompt's blocks present in the index.

    `hashes[i]` is block i of the prompt's chain; `runs` cover exactly blocks 0..len(hashes)-1
    in order; `root` is block 0's hash of the chain (it names the index shard). An empty hit
    is a miss.
    """

    root: bytes
    hashes: tuple[bytes, ...]
    runs: tuple[SegmentRun, ...]
    admitted: int | None = None  # leading blocks admitted to disk (PrefixIndex.lookup); None: every block

    @property
    def blocks(self) -> int:
        return len(self.hashes)

    @property
    def locations(self) -> list[BlockLocation]:
        return [loc for run in self.runs for loc in run.locations()]

    def truncated(self, blocks: int) -> "Hit":
        """The first `blocks` blocks of this hit."""
        runs, left = [], blocks
        for run in self.runs:
            if left <= 0:
                break
            runs.append(run._replace(count=min(run.count, left)))
            left -= run.count
        return Hit(self.root, self.hashes[:blocks], tuple(runs), self.admitted)


def miss(root: bytes = b"") -> Hit:
    return Hit(root, (), ())
