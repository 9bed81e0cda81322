"""Tenant epochs and purge tombstones in Redis: the fence that keeps a purged tenant's old blocks out.

Key layout (both keys share the hash tag {tenants}, so a purge's first step is one atomic script):
  p:{tenants}:epoch   hash  tenant -> epoch (absent: 0)
  p:{tenants}:purge   hash  tenant -> epoch of a purge not yet finished on the volumes (the tombstone)

A purge bumps the epoch and writes its tombstone in one step, before anything is erased. Every save
carries the epoch its request began under (the gateway reads it with the prefix lookup); a store
refuses a save of an older epoch before writing and withdraws one whose epoch changed while it was
writing (the check after publishing), so a block of the old epoch either was published before the
purge listed the volumes (then the purge erases it) or is withdrawn by its own save. Whoever erases
the volumes (the kvstore's purge, or reconciliation finding the tombstone) removes the tombstone last.
"""
from __future__ import annotations

import redis.asyncio as redis

_BEGIN_LUA = """
local epoch = redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HSET', KEYS[2], ARGV[1], epoch)
return epoch
"""

# Remove the tombstone only if no newer purge of the tenant replaced it meanwhile.
_FINISH_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then return redis.call('HDEL', KEYS[1], ARGV[1]) end
return 0
"""


class TenantFence:
    """Invariants: a tenant's epoch only grows; a tombstone names the epoch its purge fenced, and is
    written in the same atomic step as that epoch."""

    def __init__(self, client: redis.Redis | redis.RedisCluster, prefix: str = "dikv") -> None:
        self.redis = client
        self.epochs_key = f"{prefix}:{{tenants}}:epoch"
        self.tombstones_key = f"{prefix}:{{tenants}}:purge"
        self._begin = client.register_script(_BEGIN_LUA)
        self._finish = client.register_script(_FINISH_LUA)

    async def epoch(self, tenant: str) -> int:
        return int(await self.redis.hget(self.epochs_key, tenant) or 0)

    async def epochs(self) -> dict[str, int]:
        """Every tenant that was ever purged -> its epoch."""
        return {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.epochs_key)).items()}

    async def begin_purge(self, tenant: str) -> int:
        """Fence the tenant (its epoch + 1) and leave the tombstone; returns the new epoch."""
        return int(await self._begin(keys=[self.epochs_key, self.tombstones_key], args=[tenant]))

    async def tombstones(self) -> dict[str, int]:
        """Purges not yet finished on the volumes: tenant -> the epoch they fenced."""
        return {k.decode(): int(v) for k, v in (await self.redis.hgetall(self.tombstones_key)).items()}

    async def finish(self, tenant: str, epoch: int) -> bool:
        """The volumes hold no block of `tenant` older than `epoch`: drop its tombstone."""
        return bool(await self._finish(keys=[self.tombstones_key], args=[tenant, epoch]))
