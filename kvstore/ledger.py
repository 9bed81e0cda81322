"""Per-volume segment accounting in Redis: bytes used, recency of hits, pending deletions.

Key layout (all keys of one volume share the hash tag {vol:<id>}, so each update is one atomic
script on one shard, in a cluster too):
  p:{vol:<id>}:segs   hash  segment -> "<root hex>|<bytes>|<tenant>"   (live segments)
  p:{vol:<id>}:used   int   sum of the live segments' bytes
  p:{vol:<id>}:lru    zset  segment -> last hit (unix ms, microsecond resolution)
  p:{vol:<id>}:grave  zset  segment -> earliest time its bytes may be deleted (unix ms)
  p:{vol:<id>}:tused  hash  tenant -> bytes of its live segments here (quota.py sums the volumes)
  p:{vol:<id>}:tlru:<tenant>  zset  the tenant's live segments -> last hit, as in lru
  p:{vol:<id>}:tcounted  set once tused and tlru count every live segment (ledgers older than them
                         are counted once, by count_tenants)
"""
from __future__ import annotations

import asyncio
import time
from typing import NamedTuple, Sequence

import redis.asyncio as redis

_ADD_LUA = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('INCRBY', KEYS[2], ARGV[3])
  redis.call('ZADD', KEYS[3], ARGV[4], ARGV[1])
  redis.call('HINCRBY', KEYS[4], ARGV[5], ARGV[3])
  redis.call('ZADD', KEYS[5], ARGV[4], ARGV[1])
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
redis.call('HINCRBY', KEYS[5], ARGV[4], -tonumber(ARGV[3]))
redis.call('ZREM', KEYS[6], ARGV[1])
return 1
"""

# A hit on each ARGV pair (segment, stamp) that is still live: its recency, and its tenant's.
_TOUCH_LUA = """
for i = 1, #ARGV, 2 do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    redis.call('ZADD', KEYS[2], 'XX', 'GT', ARGV[i + 1], ARGV[i])
    local tenant = string.match(v, '^[^|]*|[^|]*|(.*)$')
    redis.call('ZADD', KEYS[3] .. tenant, 'XX', 'GT', ARGV[i + 1], ARGV[i])
  end
end
"""

# Count every live segment per tenant once (a ledger written before tenants were counted).
_COUNT_TENANTS_LUA = """
if redis.call('SETNX', KEYS[4], 1) == 0 then return 0 end
redis.call('DEL', KEYS[3])
local segs = redis.call('HGETALL', KEYS[1])
for i = 1, #segs, 2 do
  local size, tenant = string.match(segs[i + 1], '^[^|]*|([^|]*)|(.*)$')
  redis.call('HINCRBY', KEYS[3], tenant, size)
  local stamp = redis.call('ZSCORE', KEYS[2], segs[i]) or 0
  redis.call('ZADD', ARGV[1] .. tenant, stamp, segs[i])
end
return #segs / 2
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
        self._touch = client.register_script(_TOUCH_LUA)
        self._count_tenants = client.register_script(_COUNT_TENANTS_LUA)

    def _keys(self, volume: str) -> tuple[str, str, str, str]:
        tag = f"{self.prefix}:{{vol:{volume}}}:"
        return tag + "segs", tag + "used", tag + "lru", tag + "grave"

    def _tenant_keys(self, volume: str, tenant: str = "") -> tuple[str, str]:
        """The volume's per-tenant usage hash and `tenant`'s recency zset (its prefix if tenant is "")."""
        tag = f"{self.prefix}:{{vol:{volume}}}:"
        return tag + "tused", tag + "tlru:" + tenant

    async def add(self, volume: str, record: SegmentRecord, last_hit_ms: float | None = None) -> None:
        """Count a live segment (once); `last_hit_ms` (unix ms) is its recency stamp, default now."""
        segs, used, lru, _ = self._keys(volume)
        value = f"{record.root.hex()}|{record.bytes}|{record.tenant}"
        stamp = _now_ms() if last_hit_ms is None else last_hit_ms
        await self._add(keys=[segs, used, lru, *self._tenant_keys(volume, record.tenant)],
                        args=[record.segment, value, record.bytes, stamp, record.tenant])

    async def touch(self, hits: Sequence[tuple[str, str]]) -> None:
        """Record a hit on each (volume, segment) now; unknown segments are ignored.

        `hits` is in chain order. The earlier a segment is in the chain the more recent its stamp
        (1 us apart), so that under pressure a prefix loses its tail first: losing a late block
        only shortens the next hit, losing an early one ends it there.
        """
        ordered = list(dict.fromkeys(hits))
        if not ordered:
            return
        now = _now_ms()
        stamps: dict[str, list] = {}
        for age, (volume, segment) in enumerate(reversed(ordered)):
            stamps.setdefault(volume, []).extend((segment, round(now + age / 1000, 3)))
        await asyncio.gather(*(self._touch(keys=[self._keys(v)[0], self._keys(v)[2], self._tenant_keys(v)[1]],
                                           args=args) for v, args in stamps.items()))

    async def used(self, volumes: Sequence[str]) -> dict[str, int]:
        pipe = self.redis.pipeline(transaction=False)
        for volume in volumes:
            pipe.get(self._keys(volume)[1])
        return {v: int(n or 0) for v, n in zip(volumes, await pipe.execute())}

    async def tenant_used(self, volumes: Sequence[str], tenant: str) -> int:
        """Bytes of `tenant`'s live segments on `volumes`."""
        pipe = self.redis.pipeline(transaction=False)
        for volume in volumes:
            pipe.hget(self._tenant_keys(volume)[0], tenant)
        return sum(int(n or 0) for n in await pipe.execute())

    async def tenants_used(self, volumes: Sequence[str]) -> dict[str, int]:
        """Every tenant with live segments on `volumes` -> their bytes."""
        pipe = self.redis.pipeline(transaction=False)
        for volume in volumes:
            pipe.hgetall(self._tenant_keys(volume)[0])
        used: dict[str, int] = {}
        for per_volume in await pipe.execute():
            for tenant, n in per_volume.items():
                used[tenant.decode()] = used.get(tenant.decode(), 0) + int(n)
        return {tenant: n for tenant, n in used.items() if n > 0}

    async def tenant_least_recent(self, volume: str, tenant: str) -> tuple[SegmentRecord, float] | None:
        """`tenant`'s least recently hit live segment on `volume` and its stamp (unix ms), if any."""
        segs, tlru = self._keys(volume)[0], self._tenant_keys(volume, tenant)[1]
        while True:
            least = await self.redis.zrange(tlru, 0, 0, withscores=True)
            if not least:
                return None
            (name, stamp), = least
            value = await self.redis.hget(segs, name)
            if value is not None:
                return _record(name, value), stamp
            await self.redis.zrem(tlru, name)  # recency of a segment no longer live: forget it

    async def count_tenants(self, volume: str) -> int:
        """Count a ledger's live segments per tenant, once (written before tenants were counted)."""
        segs, _, lru, _ = self._keys(volume)
        tused, tlru = self._tenant_keys(volume)
        return int(await self._count_tenants(keys=[segs, lru, tused, tused.replace("tused", "tcounted")],
                                             args=[tlru]))

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
        keys = [*self._keys(volume), *self._tenant_keys(volume, record.tenant)]
        delete_after = _now_ms() + int(grace_s * 1000)
        return bool(await self._retire(keys=keys, args=[record.segment, delete_after, record.bytes, record.tenant]))

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
