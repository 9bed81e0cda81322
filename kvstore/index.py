"""The prefix index: block hash -> location, in Redis (or Redis Cluster).

Key layout (prefix `p`, root = hex of block 0's hash of the chain):
  p:{root}:b:<16-byte hash>  -> BlockLocation.encode()              TTL = its segment's
  p:{root}:s:<segment id>    -> hash {hashes, volume, tenant, ttl}   TTL = retention TTL
  p:{root}:n:<16-byte hash>  -> sightings of the block (admission)   TTL = the admission window
All keys of one chain share the hash tag {root}, so a lookup is ONE script call on one shard,
in a single Redis and in a cluster alike, and different prompts spread over shards.
Retention is per segment: a block entry counts only while its segment record lives, and a hit
re-arms the segment's TTL (and its blocks') once more than half of it has run down, so a
lookup costs one MGET plus a few calls per segment instead of one EXPIRE per block.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Sequence

import redis.asyncio as redis

from .hashing import HASH_BYTES
from .kv_events import DISK, BlockEvents
from .location import BlockLocation, Hit, SegmentRun, miss

log = logging.getLogger(__name__)

_LOOKUP_LUA = """
local prefix, blob = KEYS[1], ARGV[1]
local n = #blob / 16
local keys, vals = {}, {}
for i = 0, n - 1 do keys[i + 1] = prefix .. 'b:' .. string.sub(blob, i * 16 + 1, i * 16 + 16) end
for s = 1, n, 1000 do  -- unpack() has a stack limit
  local part = redis.call('MGET', unpack(keys, s, math.min(s + 999, n)))
  for j = 1, #part do vals[#vals + 1] = part[j] end
end
local out, alive, run_first, run_count, prev_seg, prev_ord = {}, {}, nil, 0, nil, -1
for i = 1, n do
  local v = vals[i]
  if not v then break end
  local seg = string.sub(v, 18, 49)
  local ord = tonumber(string.sub(v, 51, 56))
  local ok = alive[seg]
  if ok == nil then
    local skey = prefix .. 's:' .. seg
    local ttl = tonumber(redis.call('HGET', skey, 'ttl'))
    ok = ttl ~= nil
    if ok and redis.call('TTL', skey) < ttl / 2 then
      redis.call('EXPIRE', skey, ttl)
      local hs = redis.call('HGET', skey, 'hashes') or ''
      for j = 0, #hs / 16 - 1 do
        redis.call('EXPIRE', prefix .. 'b:' .. string.sub(hs, j * 16 + 1, j * 16 + 16), ttl)
      end
    end
    alive[seg] = ok
  end
  if not ok then break end
  if seg == prev_seg and ord == prev_ord + 1 then
    run_count = run_count + 1
  else
    if run_first then out[#out + 1] = run_first .. '|' .. run_count end
    run_first, run_count = v, 1
  end
  prev_seg, prev_ord = seg, ord
end
if run_first then out[#out + 1] = run_first .. '|' .. run_count end
-- Admission (ARGV[2] = N > 1): one more sighting of every block, counted per chained hash for ARGV[3]
-- seconds after its last one; admitted = the leading blocks indexed already or seen N times.
local admit_after, admitted, hit = tonumber(ARGV[2] or '1'), n, 0
for _, line in ipairs(out) do hit = hit + tonumber(string.match(line, '|(%d+)$')) end
if admit_after > 1 then
  admitted = hit
  for i = 1, n do
    local key = prefix .. 'n:' .. string.sub(blob, (i - 1) * 16 + 1, i * 16)
    local seen = redis.call('INCR', key)
    redis.call('EXPIRE', key, ARGV[3])
    if i == admitted + 1 and seen >= admit_after then admitted = i end
  end
end
return {table.concat(out, '\\n'), admitted}
"""
# The first item's lines are the runs: each run's first block entry plus "|<count>"; the second item is
# how many leading blocks are admitted to disk.

# Delete the block entries of ARGV[1] (concatenated hashes) that still point at segment ARGV[2];
# with ARGV[3] == '1' also the segment record. Returns the deleted entries' hashes, concatenated.
_UNPUBLISH_LUA = """
local prefix, blob, seg = KEYS[1], ARGV[1], '|' .. ARGV[2] .. '|'
local removed = {}
for i = 0, #blob / 16 - 1 do
  local h = string.sub(blob, i * 16 + 1, i * 16 + 16)
  local key = prefix .. 'b:' .. h
  local v = redis.call('GET', key)
  if v and string.find(v, seg, 1, true) then redis.call('DEL', key); removed[#removed + 1] = h end
end
if ARGV[3] == '1' then redis.call('DEL', prefix .. 's:' .. ARGV[2]) end
return table.concat(removed)
"""


# Publish one segment: its record, then one entry per block. KEYS[1] the chain prefix; ARGV: segment
# id, volume, tenant, ttl (re-arm period), expire (seconds to live now), '1' to keep entries that
# exist, the concatenated block hashes, then each block's encoded location. One call instead of a
# command per block.
_PUBLISH_LUA = """
local prefix, seg, blob, expire = KEYS[1], ARGV[1], ARGV[7], tonumber(ARGV[5])
local skey = prefix .. 's:' .. seg
redis.call('HSET', skey, 'hashes', blob, 'volume', ARGV[2], 'tenant', ARGV[3], 'ttl', ARGV[4])
redis.call('EXPIRE', skey, expire)
for i = 0, #blob / 16 - 1 do
  local key = prefix .. 'b:' .. string.sub(blob, i * 16 + 1, i * 16 + 16)
  if ARGV[6] == '1' then
    redis.call('SET', key, ARGV[8 + i], 'EX', expire, 'NX')
  else
    redis.call('SET', key, ARGV[8 + i], 'EX', expire)
  end
end
return 1
"""


def open_redis(url: str, cluster: bool = False, timeout_s: float = 5.0,
               password: str = "") -> redis.Redis | redis.RedisCluster:
    """A redis.asyncio client; `cluster=True` for Redis Cluster (any node's URL). Commands and
    connects give up after `timeout_s` (a hanging index must not hang a request). `password`
    (of the URL's user, or of `default`) is given apart from the URL, which may then be logged."""
    options = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s}
    if password:
        options["password"] = password
    if cluster:
        return redis.RedisCluster.from_url(url, **options)
    return redis.Redis.from_url(url, **options)


class PrefixIndex:
    """Block hash -> BlockLocation; entries live for their segment's retention TTL after the last
    hit (a hit re-arms it once half has run down).

    Invariants: publish() is called only after the segment's bytes are durable; an entry is
    removed only if it still points at the segment being removed (a newer save of the same
    block is never deleted by an older segment's eviction). With `events`, every publish is a
    BlockStored and every removal a BlockRemoved of medium "disk" (entries that expire by TTL
    leave without one).
    """

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str = "dikv",
                 events: BlockEvents | None = None) -> None:
        if any(c in prefix for c in "{}"):
            raise ValueError(f"prefix must not contain braces, got {prefix!r}")
        self.redis = client
        self.prefix = prefix
        self.events = events
        self._lookup = client.register_script(_LOOKUP_LUA)
        self._unpublish = client.register_script(_UNPUBLISH_LUA)
        self._publish = client.register_script(_PUBLISH_LUA)

    def _chain(self, root: bytes) -> str:
        return f"{self.prefix}:{{{root.hex()}}}:"

    def segment_key(self, root: bytes, segment: str) -> str:
        return f"{self._chain(root)}s:{segment}"

    async def lookup(self, hashes: Sequence[bytes], admit_after: int = 1, admit_window_s: int = 86400) -> Hit:
        """Longest leading run of `hashes` (a prompt's chain from block 0) present in the index. With
        `admit_after` N > 1 this is one more sighting of every block (counted per chained hash, for
        `admit_window_s` after its last), and the hit's `admitted` is how many leading blocks are on
        disk already or seen N times: the blocks an engine may save."""
        if not hashes:
            return miss()
        root = hashes[0]
        raw, admitted = await self._lookup(keys=[self._chain(root)],
                                           args=[b"".join(hashes), admit_after, max(1, int(admit_window_s))])
        if not raw:
            return miss(root)._replace(admitted=int(admitted))
        runs, blocks = [], 0
        for entry in raw.split(b"\n"):
            try:
                run = SegmentRun.decode(entry)
            except ValueError:
                log.warning("malformed index entry %r under root %s", entry[:120], root.hex())
                await self.drop(root, hashes[blocks], None)
                break
            runs.append(run)
            blocks += run.count
        return Hit(root, tuple(hashes[:blocks]), tuple(runs), max(blocks, int(admitted)))

    async def publish(self, root: bytes, hashes: Sequence[bytes], locations: Sequence[BlockLocation],
                      tenant: str, ttl_s: int, *, expire_s: int | None = None, missing_only: bool = False,
                      parent: bytes | None = None) -> None:
        """Make blocks findable for `ttl_s` seconds after the last hit.

        All `locations` are in one segment whose bytes are already durable. `expire_s`: seconds
        the entries live until a hit re-arms them (default `ttl_s`; a republished segment gets
        what its header's expiry leaves). `missing_only`: block entries already present (a
        newer save of the same block) are kept. `parent`: the hash of the block before hashes[0]
        in its chain, when known (the BlockStored event's parent_block_hash).
        """
        expire_s = ttl_s if expire_s is None else expire_s
        if len(hashes) != len(locations) or not hashes:
            raise ValueError("publish needs one location per hash, at least one")
        if any(len(h) != HASH_BYTES for h in hashes):
            raise ValueError(f"block hashes must be {HASH_BYTES} bytes")
        if len({loc.segment for loc in locations}) != 1:
            raise ValueError("publish takes the blocks of one segment")
        first = locations[0]
        await self._publish(keys=[self._chain(root)], args=[
            first.segment, first.volume, tenant, ttl_s, expire_s, "1" if missing_only else "0", b"".join(hashes),
            *(loc.encode() for loc in locations)])
        if self.events is not None:
            self.events.stored(hashes, parent, DISK)

    async def drop(self, root: bytes, block_hash: bytes, segment: str | None) -> None:
        """Remove one (bad) entry; with `segment`, only if it still points into that segment."""
        key = self._chain(root).encode() + b"b:" + block_hash
        if segment is None:
            removed = [block_hash] if await self.redis.delete(key) else []
            self._removed(removed)
        else:
            self._removed(await self._unpublish(keys=[self._chain(root)], args=[block_hash, segment, "0"]))

    async def unpublish_segment(self, root: bytes, segment: str) -> int:
        """Remove every entry still pointing into `segment`, and its record. Returns entries removed."""
        hashes = await self.redis.hget(self.segment_key(root, segment), "hashes")
        if not hashes:
            return 0
        return self._removed(await self._unpublish(keys=[self._chain(root)], args=[hashes, segment, "1"]))

    def _removed(self, removed: bytes | list[bytes]) -> int:
        """Reports removed entries (a list, or hashes concatenated) as a BlockRemoved; returns how many."""
        if isinstance(removed, bytes):
            removed = [removed[i:i + HASH_BYTES] for i in range(0, len(removed), HASH_BYTES)]
        if removed and self.events is not None:
            self.events.removed(removed, DISK)
        return len(removed)

    async def segment_alive(self, pairs: Sequence[tuple[bytes, str]]) -> list[bool]:
        """Whether each (root, segment) record still exists (has not expired)."""
        if not pairs:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for root, segment in pairs:
            pipe.exists(self.segment_key(root, segment))
        return [bool(n) for n in await pipe.execute()]

    async def ping(self) -> bool:
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), timeout=2.0))
        except Exception:  # readiness probe: any failure means "not ready"
            return False
