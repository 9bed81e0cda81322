"""Per-volume segment accounting in Redis: bytes used, recency of hits, pending deletions.

Key layout (all keys of one volume share the hash tag {vol:<id>}, so each update is one atomic
script on one shard, in a cluster too):
  p:{vol:<id>}:segs   hash  segment -> "<root hex>|<bytes>|<tenant>"   (live segments)
  p:{vol:<id>}:used   int   sum of the live segments' bytes
  p:{vol:<id>}:lru    zset  segment -> last hit (unix ms, microsecond resolution)
  p:{vol:<id>}:grave  zset  segment -> earliest time its bytes may be deleted (unix ms)
"""
from __future__ import annotations

import time
from typing import NamedTuple, Sequence

import redis.asyncio as redis

_ADD_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('INCRBY', KEYS[2], ARGV[3])
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
end
"""

# Retire a live segment exactly once: it stops counting against the budget and waits in the
# grave until no reader that found it before the retirement can still be reading it.
_RETIRE_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
if not v then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('DECRBY', KEYS[2], ARGV[3])
redis.call('ZREM', KEYS[3], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
return 1
"""


class SegmentRecord(NamedTuple):
    segment: str
    root: bytes
    bytes: int
    tenant: str


def _now_ms() -> float:
    """Unix time in ms with microsecond resolution: two ledger updates a Redis round trip apart
    never tie (a tie would order them by segment name, not by time)."""
    return round(time.time() * 1000, 3)


class VolumeLedger:
    """Which segments live on which volume, how many bytes, and which were hit least recently.

    Invariant: `used(v)` equals the sum of the bytes of the live segments of v (add and retire
    are atomic and idempotent per segment).
    """

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str = "dikv") -> None:
        self.redis = client
        self.prefix = prefix
        self._add = client.register_script(_ADD_LUA)
        self._retire = client.register_script(_RETIRE_LUA)

    def _keys(self, volume: str) -> tuple[str, str, str, str]:
        tag = f"{self.prefix}:{{vol:{volume}}}:"
        return tag + "segs", tag + "used", tag + "lru", tag + "grave"

    async def add(self, volume: str, record: SegmentRecord, last_hit_ms: float | None = None) -> None:
        """Count a live segment (once); `last_hit_ms` (unix ms) is its recency stamp, default now."""
        segs, used, lru, _ = self._keys(volume)
        value = f"{record.root.hex()}|{record.bytes}|{record.tenant}"
        stamp = _now_ms() if last_hit_ms is None else last_hit_ms
        await self._add(keys=[segs, used, lru], args=[record.segment, value, record.bytes, stamp])

    async def touch(self, hits: Sequence[tuple[str, str]]) -> None:
        """Record a hit on each (volume, segment) now; unknown segments are ignored.

        `hits` is in chain order. The earlier a segment is in the chain the more recent its stamp
        (1 us apart), so that under pressure a prefix loses its tail first: losing a late block
        only shortens the next hit, losing an early one ends it there.
        """
        ordered = list(dict.fromkeys(hits))
        if not ordered:
            return
        pipe = self.redis.pipeline(transaction=False)
        now = _now_ms()
        for age, (volume, segment) in enumerate(reversed(ordered)):
            pipe.zadd(self._keys(volume)[2], {segment: round(now + age / 1000, 3)}, xx=True, gt=True)
        await pipe.execute()

    async def used(self, volumes: Sequence[str]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for volume in volumes:
            pipe.get(self._keys(volume)[1])
        return {v: int(n or 0) for v, n in zip(volumes, await pipe.execute())}

    async def records(self, volume: str) -> list[SegmentRecord]:
        raw = await self.redis.hgetall(self._keys(volume)[0])
        return [_record(seg, value) for seg, value in raw.items()]

    async def record(self, volume: str, segment: str) -> SegmentRecord | None:
        value = await self.redis.hget(self._keys(volume)[0], segment)
        return None if value is None else _record(segment, value)

    async def least_recent(self, volume: str, count: int) -> list[SegmentRecord]:
        """Up to `count` live segments of `volume`, least recently hit first."""
        segs, _, lru, _ = self._keys(volume)
        while True:
            names = await self.redis.zrange(lru, 0, count - 1)
            if not names:
                return []
            values = await self.redis.hmget(segs, names)
            stale = [n for n, v in zip(names, values) if v is None]
            if not stale:
                return [_record(n, v) for n, v in zip(names, values)]
            await self.redis.zrem(lru, *stale)  # recency of a segment no longer live: forget it

    async def retire(self, volume: str, record: SegmentRecord, grace_s: float) -> bool:
        """Stop counting `record`; its bytes may be deleted `grace_s` from now. False if already retired."""
        keys = list(self._keys(volume))
        delete_after = _now_ms() + int(grace_s * 1000)
        return bool(await self._retire(keys=keys, args=[record.segment, delete_after, record.bytes]))

    async def condemn(self, volume: str, segment: str, grace_s: float = 0.0) -> None:
        """Record that a segment no ledger counts (never published, or expired) is to be deleted,
        before deleting it: nobody republishes a segment in the grave."""
        await self.redis.zadd(self._keys(volume)[3], {segment: _now_ms() + int(grace_s * 1000)}, nx=True)

    async def in_grave(self, volume: str, segment: str) -> bool:
        return await self.redis.zscore(self._keys(volume)[3], segment) is not None

    async def due_for_deletion(self, volume: str) -> list[str]:
        return [s.decode() for s in await self.redis.zrangebyscore(self._keys(volume)[3], 0, _now_ms())]

    async def graves(self, volume: str) -> list[str]:
        """Every retired segment whose bytes have not been deleted yet."""
        return [s.decode() for s in await self.redis.zrange(self._keys(volume)[3], 0, -1)]

    async def buried(self, volume: str, segment: str) -> None:
        """The segment's bytes are gone; forget it."""
        await self.redis.zrem(self._keys(volume)[3], segment)


def _record(segment: bytes | str, value: bytes | str) -> SegmentRecord:
    seg = segment.decode() if isinstance(segment, bytes) else segment
    text = value.decode() if isinstance(value, bytes) else value
    root_hex, size, tenant = text.split("|", 2)
    return SegmentRecord(seg, bytes.fromhex(root_hex), int(size), tenant)
