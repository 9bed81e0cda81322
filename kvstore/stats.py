"""Counters of the block store, exported by whoever embeds it (the kvstore service: Prometheus)."""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

READ_LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


@dataclass
class LatencyHistogram:
    """Cumulative-friendly bucket counts; counts[i] = observations <= buckets[i] (non-cumulative)."""

    buckets: tuple[float, ...] = READ_LATENCY_BUCKETS_S
    counts: list[int] = field(default_factory=lambda: [0] * (len(READ_LATENCY_BUCKETS_S) + 1))
    total_s: float = 0.0
    observations: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, seconds)] += 1
        self.total_s += seconds
        self.observations += 1


@dataclass
class StoreStats:
    bytes_read: int = 0                  # latent bytes delivered by verified reads
    bytes_written: int = 0               # segment object bytes made durable
    blocks_written: int = 0
    segments_written: int = 0
    write_failures: int = 0
    verification_failures: int = 0       # blocks whose header, MAC, hash, checksum or values did not pass
    forged_segments: int = 0             # headers whose block MACs did not verify (written without the key)
    old_format_segments: int = 0         # headers of another segment format version (read as misses)
    nonfinite_blocks: int = 0            # blocks with a NaN or Inf latent (read as misses)
    evictions: int = 0                   # segments retired for capacity or by an admin
    expired: int = 0                     # segments retired because their entries expired
    segments_deleted: int = 0            # segment objects removed from volumes
    layer_reads: int = 0
    read_latency: LatencyHistogram = field(default_factory=LatencyHistogram)  # one layer of one hit
